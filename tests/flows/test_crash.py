"""Crashes and full disks during a save, with real processes and real files.

A rank of a :class:`~reshard.CheckpointManager` save is killed with SIGKILL (a real ``os.kill`` of a spawned
rank, from inside the save, at a chosen point: see :mod:`tests.faults`), or its storage fails with ENOSPC or
EIO (a real full tmpfs, and injected ``OSError``). In every case the surviving ranks must raise a
:class:`~reshard.CheckpointError` within a bounded time, the previous checkpoint of the same root must still
load bit-exactly, the interrupted step must read as incomplete (``reshard.load``, ``reshard validate``,
``reshard ls``) and ``latest.json`` must never name it.

A killed rank leaves its process group unusable, so every kill runs on its own private pool, which is
killed afterwards; the non-lethal faults share the session's 4-rank pool.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.flows.manager import LATEST_FILE, step_name
from reshard.metadata import METADATA_FILE
from tests.faults import Fault, FaultyRoot, kill_pool, run_with_deaths
from tests.rankpool import RankContext, RankFailure, RankPool, private_pool

pytestmark = pytest.mark.dist

TIMEOUT_S = 10.0
"""The collective timeout every save here runs with."""

PREVIOUS, INTERRUPTED = 1, 2
ROWS_PER_RANK, COLS = 32, 256  # 32 KiB of float32 rows per rank: the data write is several calls long


# ---- the state: every leaf kind, different on every step ------------------------------------------------


def global_tensors(world: int, step: int) -> dict[str, torch.Tensor]:
    """The global tensors of step ``step`` (what a bit-exact load must reproduce)."""
    g = torch.Generator().manual_seed(7919 * step + world)
    return {
        "w": torch.randn(world * ROWS_PER_RANK, COLS, generator=g),
        "e": torch.randn(8, world * 16, generator=g).to(torch.bfloat16),
        "model.bias": torch.randint(-(2**62), 2**62, (33,), generator=g, dtype=torch.int64),
    }


def rank_state(rank: int, world: int, step: int) -> dict[str, Any]:
    full = global_tensors(world, step)
    rows = full["w"][rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK].clone()
    cols = full["e"][:, rank * 16 : (rank + 1) * 16].clone()
    return {
        "w": reshard.ShardedTensor.from_rank_offsets("w", rows, (0, rank, world)),
        "e": reshard.ShardedTensor.from_rank_offsets("e", cols, (1, rank, world)),
        "model": {"bias": full["model.bias"].clone()},  # replicated: written once
        "rng": reshard.ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
        "trainer": {"step": step},
    }


def full_template(world: int) -> dict[str, Any]:
    rows = world * ROWS_PER_RANK
    return {
        "w": reshard.ShardedTensor("w", torch.zeros(rows, COLS), (rows, COLS), (0, 0)),
        "e": reshard.ShardedTensor("e", torch.zeros(8, world * 16, dtype=torch.bfloat16), (8, world * 16), (0, 0)),
        "model": {"bias": torch.zeros(33, dtype=torch.int64)},
        "rng": reshard.ShardedObject("rng", None, (world,), (0,)),
        "trainer": {"step": -1},
    }


def assert_bit_exact(loaded: dict[str, Any], world: int, step: int) -> None:
    expected = global_tensors(world, step)
    got = {"w": loaded["w"], "e": loaded["e"], "model.bias": loaded["model"]["bias"]}
    for key, want in expected.items():
        have = got[key]
        assert have.dtype == want.dtype and have.shape == want.shape, key
        assert torch.equal(have.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), key
    assert loaded["trainer"] == {"step": step}
    assert loaded["rng"] == {"rank": 0, "step": step}


def load_step(root: Path, step: int, world: int) -> dict[str, Any]:
    loaded = reshard.load(full_template(world), root / step_name(step))
    assert_bit_exact(loaded, world, step)
    return loaded


def run_cli(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "reshard", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=120)
    return process.returncode, out, err


# ---- kill -9 of one rank during a manager save ----------------------------------------------------------


def rank_save_then_crash(ctx: RankContext, root: str, fault: dict[str, Any]) -> dict[str, Any]:
    """Save step PREVIOUS cleanly, then step INTERRUPTED with the fault armed (one rank dies in it)."""
    storage = FaultyRoot(root, step_name(INTERRUPTED), Fault.from_json(fault))
    manager = reshard.CheckpointManager(storage, group=None, timeout=TIMEOUT_S)
    manager.save(PREVIOUS, rank_state(ctx.rank, ctx.world_size, PREVIOUS))
    latest_before = manager.latest_pointer()
    started = time.monotonic()
    try:
        manager.save(INTERRUPTED, rank_state(ctx.rank, ctx.world_size, INTERRUPTED))
    except reshard.CheckpointError as exc:
        return {
            "error_class": type(exc).__name__,
            "message": str(exc),
            "failures": exc.failures,
            "seconds": time.monotonic() - started,
            "latest_before": latest_before,
            "latest_after": manager.latest_pointer(),
        }
    return {"saved": True, "seconds": time.monotonic() - started}


@dataclass(frozen=True)
class Crash:
    point: str
    world: int
    killed: int
    root: Path
    marker: dict[str, Any]
    survivors: dict[int, Any]
    exitcodes: dict[int, int | None]
    seconds: float
    cli: dict[str, tuple[int, str, str]]
    """(exit code, stdout, stderr) of ``reshard validate`` of both steps and ``reshard ls --json`` of the root,
    run (concurrently) right after the crash."""


CRASHES = {
    # point: (world size, rank killed, after_bytes)
    "mid_write": (4, 2, 20000),  # 4 ranks: three survivors must all fail
    "in_commit": (2, 0, 0),  # the coordinator, inside Storage.commit of metadata.json
}
"""The crashes of ``make test`` here; the contract suite's "manager" flow (tests/contract/flows.py) kills every
rank before and after a sample of every event of a manager's save (before and after its data write among
them), with the same checks of the root afterwards."""


@pytest.fixture(scope="module", params=list(CRASHES))
def crash(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Crash:
    point = request.param
    world, killed, after_bytes = CRASHES[point]
    base = tmp_path_factory.mktemp(f"crash-{point}")
    root = base / "root"
    marker = base / "killed.json"
    fault = Fault(point=point, rank=killed, after_bytes=after_bytes, marker=str(marker))
    pool = private_pool(world)
    try:
        run = run_with_deaths(pool, rank_save_then_crash, str(root), fault.to_json(), dead={killed})
    finally:
        kill_pool(pool)
    assert marker.exists(), f"rank {killed} was not killed at {point}: {run.results}"
    commands = {
        "validate_interrupted": run_cli("validate", str(root / step_name(INTERRUPTED))),
        "validate_previous": run_cli("validate", str(root / step_name(PREVIOUS))),
        "ls": run_cli("ls", str(root), "--json"),
    }
    return Crash(
        point=point,
        world=world,
        killed=killed,
        root=root,
        marker=json.loads(marker.read_text()),
        survivors=run.results,
        exitcodes=run.exitcodes,
        seconds=run.seconds,
        cli={name: finish(process) for name, process in commands.items()},
    )


def test_rank_is_killed_at_the_chosen_point(crash: Crash) -> None:
    assert crash.exitcodes == {crash.killed: -signal.SIGKILL}
    assert crash.marker["point"] == crash.point and crash.marker["rank"] == crash.killed
    if crash.point == "before_write":
        assert crash.marker["exists"] is False  # died before creating its data file
    elif crash.point == "mid_write":
        size = ROWS_PER_RANK * COLS * 4
        assert 0 < crash.marker["written"] == crash.marker["on_disk"] < size  # part of its first box reached the disk
    elif crash.point == "after_write":
        assert crash.marker["written"] == crash.marker["on_disk"] > ROWS_PER_RANK * COLS * 4  # complete and closed
    else:
        assert crash.marker["temporary_files"] and crash.marker["target_exists"] is False


def test_survivors_raise_checkpoint_error_in_bounded_time(crash: Crash) -> None:
    assert sorted(crash.survivors) == sorted(set(range(crash.world)) - {crash.killed})
    for rank, result in crash.survivors.items():
        assert not isinstance(result, RankFailure), f"rank {rank}: {result}"
        assert "saved" not in result, f"rank {rank} claims to have saved step {INTERRUPTED}"
        assert result["error_class"] in {"CommunicationError", "CheckpointError"}, result
        assert result["seconds"] < 3 * TIMEOUT_S, result
        assert result["latest_before"] == PREVIOUS and result["latest_after"] == PREVIOUS
    assert crash.seconds < 60


def test_previous_checkpoint_loads_bit_exactly(crash: Crash) -> None:
    load_step(crash.root, PREVIOUS, crash.world)
    manager = reshard.CheckpointManager(crash.root)
    try:
        template = full_template(crash.world)
        found = manager.load_latest_with_state(template)
        assert found is not None and found[0] == PREVIOUS
        assert_bit_exact(found[1], crash.world, PREVIOUS)
        assert manager.steps() == [PREVIOUS]
    finally:
        manager.close()


def test_latest_never_points_at_the_interrupted_step(crash: Crash) -> None:
    assert json.loads((crash.root / LATEST_FILE).read_text())["step"] == PREVIOUS
    assert not (crash.root / step_name(INTERRUPTED) / METADATA_FILE).exists()


def test_interrupted_step_is_not_loadable_and_fails_validation(crash: Crash) -> None:
    interrupted = crash.root / step_name(INTERRUPTED)
    assert interrupted.is_dir()
    with pytest.raises(reshard.CheckpointError, match=r"no metadata\.json"):
        reshard.load(full_template(crash.world), interrupted)
    code, out, err = crash.cli["validate_interrupted"]
    assert code == 1 and "PROBLEM:" in out and "metadata.json" in out, (out, err)
    code, out, err = crash.cli["validate_previous"]
    assert code == 0 and "OK (presence, sizes and every checksum checked)" in out, (out, err)
    code, out, err = crash.cli["ls"]
    assert code == 0, err
    doc = json.loads(out)
    assert doc["latest"] == PREVIOUS
    statuses = {s["step"]: s["status"] for s in doc["steps"]}
    assert statuses[PREVIOUS] == "complete" and statuses.get(INTERRUPTED) != "complete", statuses


def test_interrupted_step_is_reported_incomplete(crash: Crash) -> None:
    with pytest.raises(reshard.IncompleteCheckpointError):
        reshard.load(full_template(crash.world), crash.root / step_name(INTERRUPTED))
    doc = json.loads(crash.cli["ls"][1])
    statuses = {s["step"]: s["status"] for s in doc["steps"]}
    assert statuses == {PREVIOUS: "complete", INTERRUPTED: "incomplete"}


def _copy_root(crash: Crash, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(crash.root, root, symlinks=True)
    return root


def test_next_saves_after_the_crash_succeed(crash: Crash, tmp_path: Path) -> None:
    """A new manager on the same root (one process, after the crash) saves the interrupted step again and
    then the next one: the stale locks of a dead coordinator are broken, and latest moves on."""
    root = _copy_root(crash, tmp_path)
    manager = reshard.CheckpointManager(root, keep_last=1)
    try:
        manager.save(INTERRUPTED, rank_state(0, 1, INTERRUPTED))
        assert manager.latest_pointer() == INTERRUPTED
        load_step(root, INTERRUPTED, 1)
        manager.save(3, {"x": torch.arange(4.0)})
        assert manager.steps() == [3] and manager.latest_pointer() == 3
        assert reshard.load({"x": torch.zeros(4)}, manager.path_of(3))["x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        manager.close()


def test_retention_removes_the_interrupted_step(crash: Crash, tmp_path: Path) -> None:
    root = _copy_root(crash, tmp_path)
    manager = reshard.CheckpointManager(root, keep_last=1)
    try:
        manager.save(3, {"x": torch.arange(4.0)})
    finally:
        manager.close()
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [step_name(3)]


# ---- a full disk and I/O errors ----------------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (skips the test where mounting is not permitted)."""
    where.mkdir(parents=True)
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount commands here")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root with CAP_SYS_ADMIN): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], check=False, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False, timeout=60)


def rank_manager_save(ctx: RankContext, root: str, step: int, rows: int) -> dict[str, Any]:
    manager = reshard.CheckpointManager(root, group=None, timeout=TIMEOUT_S)
    value = torch.full((rows, COLS), float(ctx.rank + step))
    state = {"big": reshard.ShardedTensor.from_rank_offsets("big", value, (0, ctx.rank, ctx.world_size))}
    try:
        manager.save(step, state)
    except reshard.CheckpointError as exc:
        return {"error_class": type(exc).__name__, "message": str(exc), "failures": exc.failures}
    finally:
        manager.close()
    return {"saved": True}


def test_real_enospc_on_a_small_tmpfs(pool4: RankPool, tmp_path: Path) -> None:
    """Every rank writes 1.5 MiB into a 1 MiB tmpfs: no rank's data fits even alone."""
    with small_tmpfs(tmp_path / "tmpfs", "1m") as root:
        pool4.run_ok(rank_manager_save, str(root), PREVIOUS, 1)  # 4 KiB: fits
        free_before = os.statvfs(root).f_bavail
        results = pool4.run(rank_manager_save, str(root), INTERRUPTED, 1536)
        free_after = os.statvfs(root).f_bavail
        messages = {result["message"] for result in results}
        assert len(messages) == 1, messages  # the same agreed error everywhere
        for rank, result in enumerate(results):
            assert not isinstance(result, RankFailure), f"rank {rank}: {result}"
            assert result["error_class"] == "StorageError", (rank, result)
            assert "No space left on device" in result["message"] and "save failed on rank" in result["message"]
            assert result["failures"] and all("No space left" in m for m in result["failures"].values())
        interrupted = root / step_name(INTERRUPTED)
        assert not (interrupted / METADATA_FILE).exists()
        assert [p for p in interrupted.rglob("*") if p.is_file()] == []  # partial data and lock removed
        assert free_after == free_before  # every byte of the failed save was given back
        loaded = reshard.load({"big": torch.zeros(4, COLS)}, root / step_name(PREVIOUS))
        expected = torch.arange(1.0, 5.0).reshape(4, 1).expand(4, COLS)
        assert torch.equal(loaded["big"], expected)
        assert json.loads((root / LATEST_FILE).read_text())["step"] == PREVIOUS
        assert reshard.CheckpointManager(root).steps() == [PREVIOUS]


def rank_save_with_injected_error(ctx: RankContext, root: str, fault: dict[str, Any]) -> dict[str, Any]:
    storage = FaultyRoot(root, step_name(INTERRUPTED), Fault.from_json(fault))
    manager = reshard.CheckpointManager(storage, group=None, timeout=TIMEOUT_S)
    manager.save(PREVIOUS, rank_state(ctx.rank, ctx.world_size, PREVIOUS))
    try:
        manager.save(INTERRUPTED, rank_state(ctx.rank, ctx.world_size, INTERRUPTED))
    except reshard.CheckpointError as exc:
        return {"error_class": type(exc).__name__, "message": str(exc), "failures": exc.failures}
    return {"saved": True}


def _check_failed_save_left_previous_intact(root: Path) -> None:
    interrupted = root / step_name(INTERRUPTED)
    assert not (interrupted / METADATA_FILE).exists()
    assert [p.name for p in interrupted.rglob("*") if p.is_file()] == []  # data, temporary files and lock removed
    assert json.loads((root / LATEST_FILE).read_text())["step"] == PREVIOUS
    load_step(root, PREVIOUS, 4)


@pytest.mark.parametrize(
    ("point", "code", "rank"),
    [
        ("mid_write", errno.ENOSPC, 1),  # after 20000 bytes of its data file
        ("before_data_commit", errno.EIO, 2),  # the data file's fsync fails
        ("before_write", errno.EIO, 3),  # the data file cannot be created
    ],
)
def test_injected_write_error_fails_every_rank(
    pool4: RankPool, tmp_path: Path, point: str, code: int, rank: int
) -> None:
    root = tmp_path / "root"
    fault = Fault(point=point, rank=rank, errno=code, after_bytes=20000)
    results = pool4.run(rank_save_with_injected_error, str(root), fault.to_json())
    for r, result in enumerate(results):
        assert not isinstance(result, RankFailure), f"rank {r}: {result}"
        assert result["error_class"] == "StorageError", (r, result)
        assert result["message"].startswith(f"save failed on rank {rank}: "), result
        assert os.strerror(code) in result["message"] and f"-r{rank:05d}.bin" in result["message"]
        assert list(result["failures"]) == [rank]
    assert len({result["message"] for result in results}) == 1
    _check_failed_save_left_previous_intact(root)


def _commit_failure(pool: RankPool, root: Path) -> list[Any]:
    fault = Fault(point="in_commit", rank=0, errno=errno.ENOSPC)
    results = pool.run(rank_save_with_injected_error, str(root), fault.to_json())
    for r, result in enumerate(results):
        assert not isinstance(result, RankFailure), f"rank {r}: {result}"
    return results


def test_injected_commit_error_fails_every_rank(pool4: RankPool, tmp_path: Path) -> None:
    """ENOSPC while the coordinator publishes metadata.json (after the temporary file is written)."""
    root = tmp_path / "root"
    results = _commit_failure(pool4, root)
    for r, result in enumerate(results):
        assert result["error_class"] == "StorageError", (r, result)
        assert os.strerror(errno.ENOSPC) in result["message"]
    assert len({result["message"] for result in results}) == 1
    _check_failed_save_left_previous_intact(root)


def test_injected_commit_error_names_the_rank_and_file(pool4: RankPool, tmp_path: Path) -> None:
    results = _commit_failure(pool4, tmp_path / "root")
    for result in results:
        assert "rank 0" in result["message"] and METADATA_FILE in result["message"], result
