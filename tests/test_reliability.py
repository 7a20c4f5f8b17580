"""Regression tests of the defects that chaos and fault injection found (docs/reliability.md, section 12).

Each test reproduces its defect as it was reported, with real processes, files, servers and kills, and
checks the fixed behaviour; on the code before the fix each of them fails.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.io.locking import (
    LOCK_FILE,
    LockInfo,
    acquire_lock,
    lock_markers,
    machine_identity,
    pid_namespace,
    read_lock,
)
from reshard.metadata import METADATA_FILE
from reshard.storage import LocalStorage
from tests.contract import harness
from tests.metadata_docs import read_doc, seal, write_doc
from tests.rankpool import RankContext, RankFailure, RankPool

TIMEOUT = 30.0


def _event_index(events: list[str], name: str, occurrence: int) -> int:
    """The index of the ``occurrence``-th (from 0; negative from the end) event called ``name``."""
    found = [i for i, e in enumerate(events) if e == name]
    return found[occurrence]


# ---- D1: a rank dies after its write was reported; the commit must stay ---------------------------------


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_d1_a_rank_dying_after_the_commit_never_costs_the_checkpoint(tmp_path: Path, world: int) -> None:
    """Rank 1 dies right after the coordinator has gathered its report and committed metadata.json, before
    the coordinator's decision reaches it. With overwrite=True the old checkpoint is already replaced, so
    the new one is the only one: it must load, bit-exactly; the coordinator says the commit happened."""
    events, _ = harness.dry_run("overwrite", world, tmp_path / "dry")
    report = _event_index(events[1], "gather_bytes", -1)  # rank 1's write report
    point = harness.KillPoint(rank=1, index=report, when="after", wait_for=f"ckpt/{METADATA_FILE}")
    committed = _event_index(events[0], f"commit {METADATA_FILE}", 0)
    hold = harness.KillPoint(rank=0, index=committed, when="after")  # the coordinator waits for the death
    (tmp_path / "it").mkdir()
    iteration = harness.Iteration("overwrite", world, point, str(tmp_path / "it"), hold=hold)
    outcome = harness.run_iteration(iteration)
    assert outcome.killed, outcome
    assert outcome.status == "clean", outcome.reason
    assert outcome.loaded == 2  # state B, committed and complete
    coordinator = outcome.answers[0]
    assert coordinator["error"] == "UnconfirmedCommitError", coordinator
    assert "was committed" in coordinator["message"] and "is complete" in coordinator["message"]
    for rank in range(2, world):  # a survivor that got the decision reports success, which is now true
        assert outcome.answers[rank].get("ok") or outcome.answers[rank]["error"] == "UnconfirmedCommitError"


@pytest.mark.dist
def test_d1_the_manager_points_latest_at_a_step_committed_before_a_rank_died(tmp_path: Path) -> None:
    events, _ = harness.dry_run("manager", 3, tmp_path / "dry")
    fsynced = max(i for i, e in enumerate(events[2]) if e.startswith("fsync "))
    report = events[2].index("gather_bytes", fsynced)  # rank 2's write report in the save of step 2
    point = harness.KillPoint(rank=2, index=report, when="after", wait_for=f"root/step_000000002/{METADATA_FILE}")
    hold = harness.KillPoint(rank=0, index=_event_index(events[0], f"commit {METADATA_FILE}", 0), when="after")
    (tmp_path / "it").mkdir()
    outcome = harness.run_iteration(harness.Iteration("manager", 3, point, str(tmp_path / "it"), hold=hold))
    assert outcome.killed and outcome.status == "clean", outcome
    assert outcome.answers[0]["error"] == "UnconfirmedCommitError"


# ---- D2: chunks verified at the ends of contiguous reads of two files ---------------------------------


def rank_save_rows(ctx: RankContext, path: str) -> None:
    group, member = ctx.group_of_size(2)
    if member:
        rows = torch.arange(8 * 256, dtype=torch.float32).reshape(8, 256)[4 * ctx.rank : 4 * ctx.rank + 4]
        reshard.save({"w": reshard.ShardedTensor("w", rows.clone(), (8, 256), (4 * ctx.rank, 0))}, path, group=group)


@pytest.mark.dist
def test_d2_a_resharded_contiguous_load_verifies_the_chunks_of_both_files(pool4: RankPool, tmp_path: Path) -> None:
    """Both boxes start at byte 0 of their own data file; row 2, inside rank 0's box, is zeroed. Rows [1, 6)
    span both boxes: each one's touched chunk must be verified (they were keyed by offset alone)."""
    path = tmp_path / "ckpt"
    pool4.run_ok(rank_save_rows, str(path))
    full = torch.arange(8 * 256, dtype=torch.float32).reshape(8, 256)
    assert torch.equal(reshard.load({"w": torch.zeros(8, 256)}, path)["w"], full)
    metadata = reshard.read_metadata(path)
    box0 = next(b for b in metadata.tensors["w"].boxes if b.offset == (0, 0))
    assert {b.byte_offset for b in metadata.tensors["w"].boxes} == {0}
    data = path / metadata.files[box0.file].path
    raw = bytearray(data.read_bytes())
    raw[box0.byte_offset + 2 * 1024 : box0.byte_offset + 3 * 1024] = bytes(1024)
    data.write_bytes(bytes(raw))
    for rows in ((1, 6), (1, 4), (2, 3)):
        template = {"w": reshard.ShardedTensor("w", torch.zeros(rows[1] - rows[0], 256), (8, 256), (rows[0], 0))}
        with pytest.raises(reshard.CorruptCheckpointError, match="checksum mismatch"):
            reshard.load(template, path)
    untouched = {"w": reshard.ShardedTensor("w", torch.zeros(3, 256), (8, 256), (5, 0))}
    assert torch.equal(reshard.load(untouched, path)["w"], full[5:])


@pytest.mark.unit
def test_d2_every_byte_of_a_strided_load_is_verified(tmp_path: Path) -> None:
    """A column slice of rows (runs shorter than a chunk) reads and verifies the chunks it touches whole:
    damage in a byte the load uses is caught, whatever the read pattern."""
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    reshard.save({"w": full}, tmp_path / "ckpt", options=reshard.SaveOptions(checksum_chunk_bytes=1024))
    metadata = reshard.read_metadata(tmp_path / "ckpt")
    box = metadata.tensors["w"].boxes[0]
    data = tmp_path / "ckpt" / metadata.files[0].path
    raw = bytearray(data.read_bytes())
    raw[box.byte_offset + (10 * 32 + 3) * 4] ^= 0x04  # element (10, 3): used by a load of columns [0, 8)
    data.write_bytes(bytes(raw))
    for storage in (LocalStorage(tmp_path / "ckpt"), _NoMapStorage(tmp_path / "ckpt")):
        for cast in (torch.float32, torch.float64):
            template = {"w": reshard.ShardedTensor("w", torch.zeros(64, 8, dtype=cast), (64, 32), (0, 0))}
            stats = reshard.LoadStats()
            with pytest.raises(reshard.CorruptCheckpointError, match="checksum mismatch"):
                reshard.load(template, storage, stats=stats)
    stats = reshard.LoadStats()
    template = {"w": reshard.ShardedTensor("w", torch.zeros(64, 8), (64, 32), (0, 24))}
    with pytest.raises(reshard.CorruptCheckpointError):  # the damaged chunk holds rows 8-15 of these columns too
        reshard.load(template, tmp_path / "ckpt", stats=stats)


class _NoMapStorage(LocalStorage):
    """Local files read through ``read_ranges`` only, as an object store reads (no memory mapping)."""

    def map_range(self, name: str, offset: int, length: int) -> None:
        return None


@pytest.mark.unit
def test_d2_strided_loads_read_whole_chunks_and_report_it(tmp_path: Path) -> None:
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    reshard.save({"w": full}, tmp_path / "ckpt", options=reshard.SaveOptions(checksum_chunk_bytes=1024))
    for storage in (LocalStorage(tmp_path / "ckpt"), _NoMapStorage(tmp_path / "ckpt")):
        template = {"w": reshard.ShardedTensor("w", torch.zeros(64, 8), (64, 32), (0, 8))}
        stats = reshard.LoadStats()
        out = reshard.load(template, storage, stats=stats)
        assert torch.equal(out["w"], full[:, 8:16])
        assert stats.bytes_read == stats.bytes_needed == 64 * 8 * 4
        assert stats.bytes_verified == 64 * 32 * 4  # every chunk is touched by some row's run
        assert stats.bytes_verify_extra == stats.bytes_verified - stats.bytes_read


# ---- D7: an endpoint that ignores Range ------------------------------------------------------------------


@pytest.mark.dist
def test_d7_an_answer_of_another_range_is_never_used(object_store: Any, fault_proxy: Any) -> None:
    """Behind a proxy that drops the Range header of every GET (HTTP allows a 200 with the whole object),
    a load of rows [10, 20) must fail, never return rows [0, 10)."""
    proxy = fault_proxy(object_store)
    bucket = object_store.new_bucket()
    url = f"{object_store.protocol}://{bucket}/ckpt"
    options = object_store.options(proxy.url)
    full = torch.arange(40 * 64, dtype=torch.float32).reshape(40, 64)
    reshard.save({"w": full}, url, storage_options=options)
    template = {"w": reshard.ShardedTensor("w", torch.zeros(10, 64), (40, 64), (10, 0))}
    assert torch.equal(reshard.load(template, url, storage_options=options)["w"], full[10:20])
    proxy.fail_next(1000, "ignore_range", method="GET")
    template = {"w": reshard.ShardedTensor("w", torch.zeros(10, 64), (40, 64), (10, 0))}
    with pytest.raises(reshard.StorageError, match="Range"):
        reshard.load(template, url, storage_options=options)
    assert torch.count_nonzero(template["w"].data) == 0  # nothing of what came back was used


# ---- D4, D8, D9: arguments and operations that ranks disagree on -------------------------------------------


def rank_save_with(ctx: RankContext, path: str, options: dict[str, list[Any]]) -> dict[str, Any]:
    group, member = ctx.group_of_size(2)
    if not member:
        return {}
    mine = {name: values[ctx.rank] for name, values in options.items()}
    state = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.full((4, 4), 2.0 + ctx.rank), (0, ctx.rank, 2))}
    try:
        reshard.save(state, path, group=group, overwrite=True, timeout=TIMEOUT, options=reshard.SaveOptions(**mine))
    except reshard.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"ok": True}


@pytest.mark.dist
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"checksum_chunk_bytes": [4 * 1024 * 1024, 64]}, "checksum_chunk_bytes"),
        ({"fingerprint": [True, False]}, "fingerprint"),
        ({"checksum_chunk_bytes": [64, 0]}, "checksum_chunk_bytes"),
    ],
    ids=["chunk_sizes", "fingerprint_on_one_rank", "invalid_chunk_size"],
)
def test_d4_d8_ranks_passing_different_save_arguments_commit_nothing(
    pool4: RankPool, tmp_path: Path, options: dict[str, list[Any]], named: str
) -> None:
    path = tmp_path / "ckpt"
    reshard.save({"w": torch.ones(8, 4)}, path)
    before = (path / METADATA_FILE).read_bytes()
    results = [r for r in pool4.run(rank_save_with, str(path), options) if r]
    assert len(results) == 2 and all(r.get("error") == "CheckpointError" for r in results), results
    assert len({r["message"] for r in results}) == 1 and named in results[0]["message"]
    assert (path / METADATA_FILE).read_bytes() == before  # the good checkpoint stays, untouched
    assert torch.equal(reshard.load({"w": torch.zeros(8, 4)}, path)["w"], torch.ones(8, 4))


def rank_save_or_load(ctx: RankContext, path: str) -> dict[str, Any]:
    group, member = ctx.group_of_size(2)
    if not member:
        return {}
    started = time.monotonic()
    try:
        if ctx.rank == 0:
            reshard.save({"w": torch.ones(4)}, path, group=group, overwrite=True, timeout=TIMEOUT)
        else:
            reshard.load({"w": torch.zeros(4)}, path, group=group, timeout=TIMEOUT)
    except reshard.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started}
    except Exception as exc:
        return {"other": f"{type(exc).__name__}: {exc}"}
    return {"ok": True}


@pytest.mark.dist
def test_d9_one_rank_saving_while_another_loads_is_a_reshard_error_everywhere(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    reshard.save({"w": torch.ones(4)}, path)
    results = [r for r in pool4.run(rank_save_or_load, str(path)) if r]
    assert all("error" in r for r in results), results
    assert all("not in the same reshard operation" in r["message"] for r in results), results
    assert all(r["seconds"] < TIMEOUT for r in results)


# ---- D3: maintenance never follows a symlinked data/ ------------------------------------------------------


def _checkpoint_with_linked_data(tmp_path: Path) -> tuple[Path, Path, list[Path]]:
    """A committed checkpoint whose ``data`` is a link to a directory elsewhere (holding its files and an
    old, unreferenced one)."""
    path = tmp_path / "ckpt"
    reshard.save({"w": torch.ones(4)}, path)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(path / "data", elsewhere)
    (path / "data").symlink_to(elsewhere)
    stale = elsewhere / "0123456789abcdef0123456789abcdef-r00000.bin"
    stale.write_bytes(b"an old data file")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    return path, elsewhere, sorted(elsewhere.iterdir())


@pytest.mark.dist
def test_d3_gc_refuses_a_symlinked_data_directory(tmp_path: Path) -> None:
    from reshard.flows.maintenance import collect_garbage

    path, _, files = _checkpoint_with_linked_data(tmp_path)
    with pytest.raises(reshard.StorageError, match="symbolic link"):
        collect_garbage(path, min_age_s=0)
    assert all(f.exists() for f in files)
    code = subprocess.run(
        [sys.executable, "-m", "reshard", "gc", str(path), "--min-age", "0"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert code.returncode == 3 and "symbolic link" in code.stderr and "Traceback" not in code.stderr
    assert all(f.exists() for f in files)


@pytest.mark.unit
def test_d3_an_overwrite_never_deletes_through_a_symlinked_data_directory(tmp_path: Path) -> None:
    path, _, files = _checkpoint_with_linked_data(tmp_path)
    with pytest.raises(reshard.StorageError, match="symbolic link"):
        reshard.save({"w": torch.zeros(4)}, path, overwrite=True)
    assert all(f.exists() for f in files)
    assert sorted(p.name for p in path.iterdir()) == ["data", METADATA_FILE]  # nothing written, nothing lost


@pytest.mark.unit
def test_d3_gc_deletes_only_the_names_a_save_writes(tmp_path: Path) -> None:
    from reshard.flows.maintenance import collect_garbage

    reshard.save({"w": torch.ones(4)}, tmp_path / "ckpt")
    mine = tmp_path / "ckpt" / "data" / "train.csv"
    mine.write_text("a,b\n")
    leftover = tmp_path / "ckpt" / "data" / "0123456789abcdef0123456789abcdef-r00003.bin"
    leftover.write_bytes(b"x")
    assert collect_garbage(tmp_path / "ckpt", min_age_s=0) == ["data/0123456789abcdef0123456789abcdef-r00003.bin"]
    assert mine.exists() and not leftover.exists()


# ---- D5: a peer dying during planning must not leave the lock held ------------------------------------------


@pytest.mark.dist
def test_d5_a_peer_dying_in_planning_releases_the_coordinators_lock(tmp_path: Path) -> None:
    events, _ = harness.dry_run("fresh", 2, tmp_path / "dry")
    planning = _event_index(events[1], "gather_bytes", 0)
    point = harness.KillPoint(rank=1, index=planning, when="after", wait_for=f"ckpt/{LOCK_FILE}")
    locked = _event_index(events[0], f"commit {LOCK_FILE}", 0)
    hold = harness.KillPoint(rank=0, index=locked, when="after")  # planning goes on once rank 1 is dead
    (tmp_path / "it").mkdir()
    iteration = harness.Iteration("fresh", 2, point, str(tmp_path / "it"), hold=hold)
    harness.prepare(iteration)
    answers, _codes, in_time = harness.run_workers(iteration)
    assert in_time and (tmp_path / "it" / harness.HARNESS_DIR / "killed-1.json").exists()
    assert answers[0]["error"] == "CommunicationError", answers
    assert lock_markers(LocalStorage(tmp_path / "it" / "ckpt")) == {}  # released, not left for a day


# ---- D6: two writers breaking the same stale lock -----------------------------------------------------------


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


class _PausingStorage(LocalStorage):
    """The second writer: after it has read the stale holder, it waits until the first writer is done."""

    def __init__(self, root: Path, read_stale: threading.Event, first_done: threading.Event) -> None:
        super().__init__(root)
        self.read_stale = read_stale
        self.first_done = first_done

    def read_bytes(self, name: str, *, max_bytes: int | None = None) -> bytes:
        data = super().read_bytes(name, max_bytes=max_bytes)
        if name.startswith(LOCK_FILE) and not self.read_stale.is_set():
            self.read_stale.set()
            assert self.first_done.wait(30), "the first writer did not finish"
        return data


@pytest.mark.dist
def test_d6_two_writers_finding_the_same_stale_lock_cannot_both_take_it(tmp_path: Path) -> None:
    stale = LockInfo(
        host=socket.gethostname(),
        machine=machine_identity(),
        pid_namespace=pid_namespace(),
        pid=_dead_pid(),
        token="crashed",
        created=time.time(),
    )
    (tmp_path / LOCK_FILE).write_bytes(stale.to_bytes())
    read_stale, first_done = threading.Event(), threading.Event()
    outcomes: dict[str, Any] = {}

    def second() -> None:
        try:
            outcomes["second"] = acquire_lock(_PausingStorage(tmp_path, read_stale, first_done), "second", what="save")
        except reshard.CheckpointLockedError as exc:
            outcomes["second"] = exc

    thread = threading.Thread(target=second)
    thread.start()
    assert read_stale.wait(30)
    try:
        outcomes["first"] = acquire_lock(LocalStorage(tmp_path), "first", what="save")
    finally:
        first_done.set()
        thread.join(30)
    assert not isinstance(outcomes["first"], Exception)
    assert isinstance(outcomes["second"], reshard.CheckpointLockedError), outcomes
    holder = read_lock(LocalStorage(tmp_path))
    assert holder is not None and holder.token == "first"
    outcomes["first"].release()
    assert lock_markers(LocalStorage(tmp_path)) == {}


@pytest.mark.dist
def test_d6_racing_writers_on_a_stale_lock_take_it_exactly_once(tmp_path: Path) -> None:
    """Eight threads, each with its own storage, race to break one stale lock, twenty times over."""
    for round_ in range(20):
        root = tmp_path / f"r{round_}"
        root.mkdir()
        stale = LockInfo(
            host=socket.gethostname(),
            machine=machine_identity(),
            pid_namespace=pid_namespace(),
            pid=_dead_pid() if round_ == 0 else 2**22 + 7,
            token="x",
            created=0,
        )
        (root / LOCK_FILE).write_bytes(stale.to_bytes())
        start = threading.Barrier(8)
        won: list[str] = []
        lost: list[str] = []

        def race(
            token: str,
            root: Path = root,
            start: threading.Barrier = start,
            won: list[str] = won,
            lost: list[str] = lost,
        ) -> None:
            start.wait()
            try:
                acquire_lock(LocalStorage(root), token, what="save")
                won.append(token)
            except reshard.CheckpointLockedError:
                lost.append(token)

        threads = [threading.Thread(target=race, args=(f"t{i}",)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(won) == 1 and len(lost) == 7, (round_, won, lost)
        assert read_lock(LocalStorage(root)).token == won[0]  # type: ignore[union-attr]


@pytest.mark.dist  # in one process, but it waits out a real lease of 0.6 s
def test_a_lock_of_another_host_is_taken_over_once_it_stops_moving(tmp_path: Path) -> None:
    """A holder on another host cannot be checked by pid: it is stale once the lock has not moved for a
    lease (measured on this host's clock); a live holder renews and keeps it."""
    from reshard.io.locking import LockTiming

    timing = LockTiming(renew_s=0.1, lease_s=0.6, stale_after_s=600)
    remote = LockInfo(host="elsewhere", pid=1, token="remote", created=time.time(), written=time.time())
    (tmp_path / LOCK_FILE).write_bytes(remote.to_bytes())
    started = time.monotonic()
    lock = acquire_lock(LocalStorage(tmp_path), "mine", what="save", timing=timing)
    assert 0.6 <= time.monotonic() - started < 10
    live = LocalStorage(tmp_path / "live")
    live.prepare_root()
    holder = acquire_lock(live, "holder", what="save", timing=timing)
    holder.start_renewing()
    try:
        # this process is the holder's host, so pretend to be another host's writer looking at it
        info = read_lock(live)
        assert info is not None and info.token == "holder"
        with mock_host("a-third-host"), pytest.raises(reshard.CheckpointLockedError, match="renewed while"):
            acquire_lock(live, "third", what="save", timing=timing)
    finally:
        holder.release()
        lock.release()


@contextlib.contextmanager
def mock_host(name: str) -> Any:
    from unittest import mock

    with mock.patch("reshard.io.holders.socket.gethostname", return_value=name):
        yield


# ---- D10: sizes checked before reading --------------------------------------------------------------------


@pytest.mark.unit
def test_d10_an_oversized_metadata_file_is_refused_unread(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(4)}, tmp_path / "ckpt")
    target = tmp_path / "ckpt" / METADATA_FILE
    with open(target, "r+b") as f:
        f.truncate(600 * 1024 * 1024)  # sparse: 600 MiB that reading would have to allocate
    started = time.monotonic()
    with pytest.raises(reshard.CorruptCheckpointError, match="too large"):
        reshard.read_metadata(tmp_path / "ckpt")
    assert time.monotonic() - started < 5


@pytest.mark.unit
def test_d10_an_oversized_safetensors_index_is_refused_unread(tmp_path: Path) -> None:
    from reshard.interop.hf_source import describe_source

    (tmp_path / "model.safetensors.index.json").write_bytes(b"{}")
    with open(tmp_path / "model.safetensors.index.json", "r+b") as f:
        f.truncate(1024 * 1024 * 1024)
    with pytest.raises(reshard.CorruptCheckpointError, match="larger than"):
        describe_source(LocalStorage(tmp_path))


# ---- D11: what the command line prints from a checkpoint ------------------------------------------------------


@pytest.mark.dist
def test_d11_inspect_escapes_control_characters_of_keys(tmp_path: Path) -> None:
    reshard.save({"evil\x1b[2J\x1b[31m": torch.ones(2), "rtl\u202egpj.exe": torch.ones(1)}, tmp_path / "ckpt")
    done = subprocess.run(
        [sys.executable, "-m", "reshard", "inspect", str(tmp_path / "ckpt")], capture_output=True, check=False
    )
    assert done.returncode == 0
    assert b"\x1b" not in done.stdout and "\u202e".encode() not in done.stdout
    assert b"evil\\x1b[2J\\x1b[31m" in done.stdout and b"rtl\\u202egpj.exe" in done.stdout


@pytest.mark.dist
def test_d11_a_lone_surrogate_in_a_key_is_refused_cleanly(tmp_path: Path) -> None:
    with pytest.raises(reshard.StateDictError, match="lone surrogate"):
        reshard.save({"a\ud800b": torch.ones(2)}, tmp_path / "refused")
    reshard.save({"ab": torch.ones(2)}, tmp_path / "ckpt")
    doc = read_doc(tmp_path / "ckpt")
    doc["tensors"]["a\ud800b"] = doc["tensors"].pop("ab")
    write_doc(tmp_path / "ckpt", doc)  # json escapes the surrogate: valid JSON, resealed
    with pytest.raises(reshard.CorruptCheckpointError, match="lone surrogate"):
        reshard.read_metadata(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    done = subprocess.run(
        [sys.executable, "-m", "reshard", "inspect", str(tmp_path / "ckpt")], capture_output=True, env=env, check=False
    )
    assert done.returncode == 3 and b"Traceback" not in done.stderr and b"lone surrogate" in done.stderr


# ---- D12: a lock that cannot be written names the rank and the file ----------------------------------------


class _FullDiskForLocks(LocalStorage):
    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        if name.startswith(LOCK_FILE):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().commit(name, data, replace=replace)


@pytest.mark.unit
def test_d12_a_lock_that_cannot_be_written_names_the_rank_and_the_file(tmp_path: Path) -> None:
    with pytest.raises(reshard.StorageError) as info:
        reshard.save({"w": torch.ones(2)}, _FullDiskForLocks(tmp_path / "ckpt"))
    message = str(info.value)
    assert "rank 0" in message and str(tmp_path / "ckpt" / LOCK_FILE) in message and "No space left" in message


# ---- metadata.json carries its own checksum --------------------------------------------------------------


@pytest.mark.unit
def test_damage_that_leaves_valid_json_is_caught_by_every_reader(tmp_path: Path) -> None:
    """A digit of an offset changed in metadata.json (valid JSON, consistent-looking): load, read_metadata,
    validate, export and convert all refuse it."""
    from reshard.flows.maintenance import validate_checkpoint
    from reshard.interop import convert_checkpoint, export_safetensors

    reshard.save({"w": torch.arange(64.0).reshape(8, 8), "b": torch.ones(3)}, tmp_path / "ckpt")
    raw = (tmp_path / "ckpt" / METADATA_FILE).read_bytes()
    at = raw.index(b'"byte_offset":') + len(b'"byte_offset":')
    damaged = raw[:at] + (b"1" if raw[at : at + 1] != b"1" else b"2") + raw[at + 1 :]
    (tmp_path / "ckpt" / METADATA_FILE).write_bytes(damaged)
    json.loads(damaged)  # still valid JSON
    match = "checksum does not match"
    with pytest.raises(reshard.CorruptCheckpointError, match=match):
        reshard.load({"w": torch.zeros(8, 8), "b": torch.zeros(3)}, tmp_path / "ckpt")
    with pytest.raises(reshard.CorruptCheckpointError, match=match):
        export_safetensors(tmp_path / "ckpt", tmp_path / "hf")
    with pytest.raises(reshard.CorruptCheckpointError, match=match):
        convert_checkpoint(tmp_path / "ckpt", tmp_path / "copy")
    assert any(match in p for p in validate_checkpoint(tmp_path / "ckpt"))
    assert not (tmp_path / "copy" / METADATA_FILE).exists()
    resealed = seal(damaged[: damaged.rindex(b',"metadata_crc32c"')] + b"}")
    (tmp_path / "ckpt" / METADATA_FILE).write_bytes(resealed)  # a forger who knows the format gets past it
    with pytest.raises(reshard.CheckpointError):  # ... and then the box's bytes fail their checksums
        reshard.load({"w": torch.zeros(8, 8), "b": torch.zeros(3)}, tmp_path / "ckpt")


# ---- the offline writer's commit with a lost answer ---------------------------------------------------------


def _lose_the_answer_to_the_commit(proxy: Any, protocol: str) -> None:
    """The put of metadata.json is forwarded (it takes effect) and its answer thrown away: S3 names the
    object in the path; a GCS upload names it in the body."""
    if protocol == "s3":
        proxy.fail_next(1, "drop_after", method="PUT", contains="metadata.json")
    else:
        proxy.fail_next(1, "drop_after", method="POST", contains="/upload/", body_contains=b"metadata.json")


@pytest.mark.dist
def test_a_lost_answer_to_the_offline_commit_keeps_the_committed_checkpoint(
    object_store: Any, fault_proxy: Any, tmp_path: Path
) -> None:
    """The put of metadata.json reaches the server, its answer is lost; the retry finds the object. The
    offline writer (convert, import-dcp) must take that as committed, and keep its data file."""
    from reshard.flows.maintenance import validate_checkpoint
    from reshard.interop import convert_checkpoint

    reshard.save({"w": torch.arange(32.0), "step": 3}, tmp_path / "src")
    proxy = fault_proxy(object_store)
    bucket = object_store.new_bucket()
    url = f"{object_store.protocol}://{bucket}/converted"
    options = object_store.options(proxy.url)
    _lose_the_answer_to_the_commit(proxy, object_store.protocol)
    convert_checkpoint(tmp_path / "src", url, storage_options=options)
    assert proxy.count(faulted=True) == 1
    assert validate_checkpoint(url, storage_options=object_store.options()) == []
    loaded = reshard.load({"w": torch.zeros(32), "step": 0}, url, storage_options=object_store.options())
    assert torch.equal(loaded["w"], torch.arange(32.0)) and loaded["step"] == 3


@pytest.mark.dist
def test_a_lost_answer_to_a_saves_commit_keeps_the_committed_checkpoint(object_store: Any, fault_proxy: Any) -> None:
    proxy = fault_proxy(object_store)
    bucket = object_store.new_bucket()
    url = f"{object_store.protocol}://{bucket}/saved"
    options = object_store.options(proxy.url)
    _lose_the_answer_to_the_commit(proxy, object_store.protocol)
    reshard.save({"w": torch.arange(16.0)}, url, storage_options=options)
    assert proxy.count(faulted=True) == 1
    loaded = reshard.load({"w": torch.zeros(16)}, url, storage_options=object_store.options())
    assert torch.equal(loaded["w"], torch.arange(16.0))


# ---- an unknown commit outcome keeps the data ------------------------------------------------------------


class _CommitFailsUnreadably(LocalStorage):
    """The commit of metadata.json reports a failure after linking it, and it cannot be read back."""

    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        super().commit(name, data, replace=replace)
        if name == METADATA_FILE:
            raise OSError(errno.EIO, "I/O error after the link (injected)")

    def read_bytes(self, name: str, *, max_bytes: int | None = None) -> bytes:
        if name == METADATA_FILE and (self.root / name).exists():
            raise OSError(errno.EIO, "unreadable (injected)")
        return super().read_bytes(name, max_bytes=max_bytes)


@pytest.mark.unit
def test_a_commit_of_unknown_outcome_deletes_nothing(tmp_path: Path) -> None:
    with pytest.raises(reshard.StorageError, match="outcome cannot be read back"):
        reshard.save({"w": torch.arange(4.0)}, _CommitFailsUnreadably(tmp_path / "ckpt"))
    assert torch.equal(reshard.load({"w": torch.zeros(4)}, tmp_path / "ckpt")["w"], torch.arange(4.0))


@pytest.mark.dist
def test_failures_in_save_planning_are_rank_failures_not_parse_errors(pool4: RankPool, tmp_path: Path) -> None:
    """A RankFailure here would mean a raw exception escaped; every rank gets a CheckpointError."""
    results = pool4.run(rank_save_or_load, str(tmp_path / "nothing"))
    assert not any(isinstance(r, RankFailure) for r in results)


# ---- racing writers on one path ----------------------------------------------------------------------------


def _race_saves(path: Path, writers: int, *, overwrite: bool) -> dict[int, str]:
    """``writers`` threads save their own state to ``path`` at once; each one's outcome."""
    start = threading.Barrier(writers)
    outcomes: dict[int, str] = {}

    def write(i: int) -> None:
        start.wait()
        try:
            reshard.save({"w": torch.full((64, 16), float(i)), "who": i}, path, overwrite=overwrite)
            outcomes[i] = "saved"
        except (reshard.CheckpointLockedError, reshard.CheckpointExistsError) as exc:
            outcomes[i] = type(exc).__name__

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


@pytest.mark.unit
@pytest.mark.parametrize("overwrite", [False, True])
def test_racing_writers_leave_exactly_one_whole_checkpoint(tmp_path: Path, overwrite: bool) -> None:
    for round_ in range(8):
        path = tmp_path / f"r{round_}"
        if overwrite:
            reshard.save({"w": torch.full((64, 16), -1.0), "who": -1}, path)
        outcomes = _race_saves(path, 4, overwrite=overwrite)
        winners = [i for i, o in outcomes.items() if o == "saved"]
        assert len(outcomes) == 4 and winners, outcomes
        if not overwrite:
            assert len(winners) == 1, outcomes
        loaded = reshard.load({"w": torch.zeros(64, 16), "who": 0}, path)
        assert loaded["who"] in winners and torch.equal(loaded["w"], torch.full((64, 16), float(loaded["who"])))
        referenced = {f.path for f in reshard.read_metadata(path).files}
        assert {f"data/{p.name}" for p in (path / "data").iterdir()} == referenced  # no loser's file is left
        assert lock_markers(LocalStorage(path)) == {}


class _StartsAnotherSaveAtRelease(LocalStorage):
    """The first save: once its ``metadata.json`` is committed, the moment its save lock is released another save
    of the same path starts (``on_release``), and this save goes on only when that one holds the lock."""

    def __init__(self, root: Path, on_release: Any) -> None:
        super().__init__(root)
        self.committed = False
        self.on_release = on_release

    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        super().commit(name, data, replace=replace)
        self.committed = self.committed or name == METADATA_FILE

    def delete(self, name: str) -> None:
        super().delete(name)
        if self.committed and name.startswith(".lock") and self.on_release is not None:
            on_release, self.on_release = self.on_release, None
            on_release()


class _HoldsInItsWrite(LocalStorage):
    """The second save: says when it writes its data (it holds the save lock then) and waits for ``go``."""

    def __init__(self, root: Path, writing: threading.Event, go: threading.Event) -> None:
        super().__init__(root)
        self.writing, self.go = writing, go

    def open_writer(self, name: str, *, max_buffered_bytes: int | None = None) -> Any:
        if name.startswith("data/"):
            self.writing.set()
            assert self.go.wait(30), "the first save never finished"
        return super().open_writer(name, max_buffered_bytes=max_buffered_bytes)


@pytest.mark.unit
def test_an_overwrite_started_the_moment_another_releases_its_lock_leaves_no_replaced_file(tmp_path: Path) -> None:
    """Two overwrites of one path in a row, the second taking the lock the instant the first releases it: the first
    save's checkpoint replaced, the files of the one before it are gone too (they were left, unreferenced, when the
    first save removed what it replaced only after releasing its lock, and the second held it by then)."""
    path = tmp_path / "ckpt"
    reshard.save({"w": torch.full((8,), -1.0)}, path)
    writing, go = threading.Event(), threading.Event()
    outcome: list[object] = []

    def second_save() -> None:
        try:
            reshard.save({"w": torch.full((8,), 2.0)}, _HoldsInItsWrite(path, writing, go), overwrite=True)
            outcome.append("saved")
        except Exception as exc:  # the assertion below names it
            outcome.append(exc)

    second = threading.Thread(target=second_save)

    def start_second() -> None:
        second.start()
        assert writing.wait(30), "the second save never began writing"

    try:
        reshard.save({"w": torch.full((8,), 1.0)}, _StartsAnotherSaveAtRelease(path, start_second), overwrite=True)
    finally:
        go.set()
        if second.ident is not None:
            second.join(60)
    assert outcome == ["saved"]
    assert torch.equal(reshard.load({"w": torch.zeros(8)}, path)["w"], torch.full((8,), 2.0))
    referenced = {f.path for f in reshard.read_metadata(path).files}
    assert {f"data/{p.name}" for p in (path / "data").iterdir()} == referenced
    assert lock_markers(LocalStorage(path)) == {}


@pytest.mark.unit
def test_an_overwrite_of_a_checkpoint_whose_metadata_json_is_a_link_is_refused(tmp_path: Path) -> None:
    """docs/reliability.md, section 7: a save with overwrite=True refuses a checkpoint whose ``metadata.json`` is a
    symbolic link (it replaced the link, and left the replaced checkpoint's data file behind, unreferenced)."""
    path = tmp_path / "ckpt"
    reshard.save({"w": torch.zeros(4)}, path)
    files = sorted(p.name for p in (path / "data").iterdir())
    elsewhere = tmp_path / "elsewhere.json"
    (path / METADATA_FILE).rename(elsewhere)
    (path / METADATA_FILE).symlink_to(elsewhere)
    before = elsewhere.read_bytes()
    with pytest.raises(reshard.StorageError, match="symbolic link"):
        reshard.save({"w": torch.ones(4)}, path, overwrite=True)
    assert (path / METADATA_FILE).is_symlink() and elsewhere.read_bytes() == before
    assert sorted(p.name for p in (path / "data").iterdir()) == files
    assert lock_markers(LocalStorage(path)) == {}


class _LockWriteFailsAfterItsLink(LocalStorage):
    """The create-only write of the first lock marker lands, then reports a failure (its temporary's removal or
    the directory's fsync failed: an append-only directory, an I/O error)."""

    failed = False

    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        super().commit(name, data, replace=replace)
        if name.startswith(".lock") and not self.failed:
            self.failed = True
            raise OSError(errno.EIO, "I/O error after the link (injected)")


@pytest.mark.unit
def test_a_save_whose_lock_write_fails_after_landing_leaves_no_lock(tmp_path: Path) -> None:
    """docs/reliability.md: a save that fails releases its lock. One whose lock marker landed but whose write reported
    a failure left the marker, naming this live process: every later save of the path (and gc) was refused."""
    path = tmp_path / "ckpt"
    reshard.save({"w": torch.zeros(4)}, path)
    with pytest.raises(reshard.StorageError, match="cannot take the save lock"):
        reshard.save({"w": torch.ones(4)}, _LockWriteFailsAfterItsLink(path), overwrite=True)
    assert lock_markers(LocalStorage(path)) == {}
    reshard.save({"w": torch.full((4,), 2.0)}, path, overwrite=True)
    assert torch.equal(reshard.load({"w": torch.zeros(4)}, path)["w"], torch.full((4,), 2.0))


@pytest.mark.unit
def test_a_checkpoint_writer_dropped_without_commit_or_abort_releases_its_lock(tmp_path: Path) -> None:
    """An offline writer made outside a ``with`` block and dropped (its caller raised before commit or abort) kept
    renewing its lock for the life of the process: every save of the path was refused. Collected, it aborts."""
    import gc

    from reshard.interop.offline import CheckpointWriter

    path = tmp_path / "ckpt"
    reshard.save({"w": torch.zeros(4)}, path)
    kept = sorted(p.name for p in (path / "data").iterdir())

    def convert_that_fails() -> None:
        writer = CheckpointWriter(path, overwrite=True)
        writer.write_tensor("w", torch.float32, (4,), [torch.ones(4)])
        raise RuntimeError("the caller's own failure")

    with pytest.raises(RuntimeError):
        convert_that_fails()
    gc.collect()  # the traceback held the writer until the with block ended
    assert lock_markers(LocalStorage(path)) == {}
    assert sorted(p.name for p in (path / "data").iterdir()) == kept
    reshard.save({"w": torch.full((4,), 2.0)}, path, overwrite=True)
    assert torch.equal(reshard.load({"w": torch.zeros(4)}, path)["w"], torch.full((4,), 2.0))


@pytest.mark.unit
def test_a_save_over_another_programs_metadata_json_says_what_it_found(tmp_path: Path) -> None:
    """A directory whose ``metadata.json`` is another program's was refused as holding "a complete checkpoint"."""
    path = tmp_path / "dataset"
    path.mkdir()
    (path / METADATA_FILE).write_text('{"dataset": "imagenet", "rows": 1281167}')
    with pytest.raises(reshard.CheckpointExistsError, match=r"a metadata\.json that reshard did not write"):
        reshard.save({"w": torch.ones(4)}, path)
    assert (path / METADATA_FILE).read_text() == '{"dataset": "imagenet", "rows": 1281167}'
    reshard.save({"w": torch.ones(4)}, tmp_path / "ckpt")
    with pytest.raises(reshard.CheckpointExistsError, match="already holds a complete checkpoint"):
        reshard.save({"w": torch.ones(4)}, tmp_path / "ckpt")
