"""``reshard.TieredCheckpointManager`` on real gloo ranks: 4 ranks as 2 simulated nodes of 2 (node directories
``<tmp>/local/node{node}``), every 2 steps to peer memory and node-local disk, every 4 to the durable root (a local
directory, and once an S3 bucket), through one manager per rank. A job resumes after losing a node (the survivors
and new ranks, into another layout, bit-exact) and after losing every fast tier (from the durable root); a damaged
node-local copy falls back with a warning and the job saves on; a drain that fails is raised at the next save on
every rank, its step not finalized; a drain killed by SIGKILL leaves its step unfinalized and nothing finalized
lost, and a new job's restore finishes it.

Each rank keeps its manager in :data:`_MANAGERS` between the pool's calls (a job's life over several calls); a rank
"lost" drops it (its peer memory goes with it) and its node's directory is deleted."""

from __future__ import annotations

import errno
import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

import reshard
from reshard.flows.certify import certified
from tests.faults import Fault, FaultyRoot, kill_pool, run_with_deaths
from tests.flows.test_nodelocal import NODE_SIZE, WORLD, _differences, training_state
from tests.rankpool import RankContext, RankFailure, RankPool

pytestmark = pytest.mark.dist

_MANAGERS: dict[str, reshard.TieredCheckpointManager] = {}
"""This rank's manager of the running job, by test."""
_DRAIN_GROUP: list[Any] = []
"""One gloo group of every rank for the drains, made once per process (by every rank at once: the first call of a
test function here runs on every rank), so that a new rank's manager makes no collective of its own."""


def _state(rank: int, step: int, *, tp: int = 2, fill: bool = True) -> dict[str, Any]:
    """test_nodelocal's training state (weights split by TP and replicated over DP, ZeRO moments, FP8 scaled) at
    ``step``, without its per-rank object (the peer-memory tier keeps tensors and common values only)."""
    state = {**training_state(tp, rank, fill=fill), "step": step if fill else 0}
    del state["rng"]
    return state


def _differ(template: dict[str, Any], got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    no_object = SimpleNamespace(value=None)
    return _differences(template, {**got, "rng": None}, {**want, "rng": no_object})


def _durable(durable: str | dict[str, Any]) -> reshard.Durable:
    if isinstance(durable, dict):  # a fault on one step's directory
        fault = Fault.from_json(durable["fault"])
        return reshard.Durable(FaultyRoot(durable["root"], durable["step"], fault), every=4)
    if durable.startswith("s3://"):
        return reshard.Durable(durable, every=4, storage_options=_S3_OPTIONS[0] if _S3_OPTIONS else None)
    return reshard.Durable(durable, every=4)


_S3_OPTIONS: list[dict[str, Any]] = []


def _manager(ctx: RankContext, key: str, root: str, durable: Any) -> reshard.TieredCheckpointManager:
    """This rank's manager of job ``key`` (a new one when the rank has none: a new rank, or a new job)."""
    if not _DRAIN_GROUP:
        _DRAIN_GROUP.append(dist.new_group(backend="gloo"))
    if key not in _MANAGERS:
        tiers = [
            reshard.PeerMemory(every=2, node_size=NODE_SIZE),
            reshard.LocalDisk(os.path.join(root, "node{node}"), every=2, node_size=NODE_SIZE),
            _durable(durable),
        ]
        # The job whose drain is killed: its survivors wait out the timeout, so it is shorter there (as in
        # test_nodelocal.py's kills).
        timeout = 10 if key == "killed" else 20
        _MANAGERS[key] = reshard.TieredCheckpointManager(tiers, drain_group=_DRAIN_GROUP[0], timeout=timeout)
    return _MANAGERS[key]


def rank_job(
    ctx: RankContext, key: str, root: str, durable: Any, steps: list[int], s3: Any = None, wait: bool = True
) -> list[Any]:
    """Train: save ``steps``, then (``wait``) wait for the drain; this rank's status as plain lists."""
    if s3 is not None:
        _S3_OPTIONS[:] = [s3]
    manager = _manager(ctx, key, root, durable)
    for step in steps:
        manager.save(step, _state(ctx.rank, step))
    if wait:
        manager.wait()
    return [[s.step, list(s.tiers), s.finalized, s.certified] for s in manager.status()]


def rank_lose(ctx: RankContext, key: str, ranks: list[int]) -> None:
    """The ranks ``ranks`` are lost: their managers (and peer memory) are gone."""
    if ctx.rank in ranks:
        _MANAGERS.pop(key).close()


def rank_restore(ctx: RankContext, key: str, root: str, durable: Any, tp: int) -> list[Any]:
    """Restore at TP ``tp`` x DP ``WORLD // tp``: the step, the tier, the leaves that differ, the warnings."""
    manager = _manager(ctx, key, root, durable)
    template = _state(ctx.rank, 0, tp=tp, fill=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = manager.restore(template)
    assert found is not None
    step, tier, state = found
    return [step, tier, _differ(template, state, _state(ctx.rank, step, tp=tp)), [str(w.message) for w in caught]]


def rank_end(ctx: RankContext, key: str) -> list[int]:
    """Finish the job's drain; the finalized steps."""
    manager = _MANAGERS.pop(key)
    manager.close()
    return manager.durable.steps()


def _restored(results: list[Any], step: int, tier: str) -> list[str]:
    for rank, (got_step, got_tier, differences, _) in enumerate(results):
        assert (got_step, got_tier, differences) == (step, tier, []), (rank, got_step, got_tier, differences)
    warned: list[str] = results[0][3]
    return warned


def test_a_job_resumes_after_losing_a_node_and_after_losing_every_fast_tier(
    pool4: RankPool, tmp_path: Path, s3_server: Any
) -> None:
    """Steps 2..8 to peer memory and node-local disk, 4 and 8 drained to S3 (finalized, certified). Node 1 (ranks 2,
    3) is lost with its disk: the survivors and two new ranks restore step 8 from peer memory at TP4 x DP1,
    bit-exact. Then every fast tier is lost (new processes' managers, node directories deleted): step 8 restores
    from the durable tier at TP1 x DP4, and the job saves on."""
    root, key = str(tmp_path / "local"), "lose"
    durable = f"s3://{s3_server.new_bucket()}/run"
    status = pool4.run_ok(rank_job, key, root, durable, [2, 4, 6, 8], s3_server.storage_options)
    held = {s[0]: s[1:] for s in status[0]}  # step 4 may still be on node-local disk: its drain ran with step 8's save
    assert held[4][1:] == [True, True] and "durable" in held[4][0], status[0]
    assert held[6] == [["local"], False, True] and held[8] == [["peer", "local", "durable"], True, True], status[0]
    pool4.run_ok(rank_lose, key, [2, 3])
    shutil.rmtree(tmp_path / "local" / "node1")
    warned = _restored(pool4.run_ok(rank_restore, key, root, durable, 4), 8, "peer")
    assert not [w for w in warned if "failed" in w], warned

    pool4.run_ok(rank_lose, key, [0, 1, 2, 3])
    shutil.rmtree(tmp_path / "local")
    _restored(pool4.run_ok(rank_restore, key, root, durable, 1), 8, "durable")
    pool4.run_ok(rank_job, key, root, durable, [10, 12])
    assert pool4.run_ok(rank_end, key) == [[4, 8, 12]] * WORLD


def _damage(step_dir: Path) -> None:
    """Flip the first byte of a box that rank 0's data file of the step holds."""
    metadata = reshard.read_metadata(str(step_dir))
    file = next(i for i, f in enumerate(metadata.files) if f.path.endswith("r00000.bin"))
    box = next(b for t in metadata.tensors.values() for b in t.boxes if b.file == file)
    damaged = step_dir / metadata.files[file].path
    raw = bytearray(damaged.read_bytes())
    raw[box.byte_offset] ^= 0xFF
    damaged.write_bytes(bytes(raw))


def test_a_damaged_node_local_copy_falls_back_with_a_warning_and_the_job_saves_on(
    pool4: RankPool, tmp_path: Path
) -> None:
    root, durable, key = str(tmp_path / "local"), str(tmp_path / "durable"), "damaged"
    pool4.run_ok(rank_job, key, root, durable, [2, 4, 6])
    pool4.run_ok(rank_lose, key, [0, 1, 2, 3])  # a new job: peer memory gone
    _damage(tmp_path / "local" / "node0" / "step_000000006")
    warned = _restored(pool4.run_ok(rank_restore, key, root, durable, 4), 4, "local")
    assert any("step 6 from the local tier failed" in w for w in warned), warned
    pool4.run_ok(rank_job, key, root, durable, [6, 8])  # step 6 again: the damaged copy is replaced
    assert pool4.run_ok(rank_end, key) == [[4, 8]] * WORLD


def test_a_failed_drain_is_raised_at_the_next_save_on_every_rank_and_its_step_is_not_finalized(
    pool4: RankPool, tmp_path: Path
) -> None:
    root, key = str(tmp_path / "local"), "failed"
    fault = Fault("before_write", rank=1, errno=errno.EIO)
    durable = {"root": str(tmp_path / "durable"), "step": "step_000000008", "fault": fault.to_json()}
    pool4.run_ok(rank_job, key, root, durable, [4])
    pool4.run_ok(rank_job, key, root, durable, [8], None, False)  # returns: the drain of step 8 runs on
    results = pool4.run(rank_job, key, root, durable, [10])  # raised at the save of step 10, or at its wait()
    assert all(isinstance(r, RankFailure) for r in results), results
    assert all("Input/output error" in r.message or "rank 1" in r.message for r in results), results
    assert not (tmp_path / "durable" / "step_000000008" / "metadata.json").exists()
    status = {s[0]: s for s in pool4.run_ok(rank_job, key, root, durable, [])[0]}
    assert status[4][1:3] == [["durable"], True] and status[8][2] is False and "local" in status[8][1], status
    assert pool4.run_ok(rank_end, key) == [[4]] * WORLD


def test_a_drain_killed_by_sigkill_finalizes_nothing_loses_nothing_and_a_new_job_finishes_it(tmp_path: Path) -> None:
    root, key, marker = str(tmp_path / "local"), "killed", tmp_path / "killed.json"
    fault = Fault("mid_write", rank=3, after_bytes=16, marker=str(marker))
    durable = {"root": str(tmp_path / "durable"), "step": "step_000000008", "fault": fault.to_json()}
    pool = RankPool(WORLD)
    try:
        pool.run_ok(rank_job, key, root, durable, [2, 4])
        run = run_with_deaths(pool, rank_job, key, root, durable, [6, 8], dead={3})
    finally:
        kill_pool(pool)
    assert marker.exists() and run.exitcodes[3] != 0
    assert not (tmp_path / "durable" / "step_000000008" / "metadata.json").exists()
    assert (tmp_path / "durable" / "step_000000004" / "metadata.json").exists()
    pool = RankPool(WORLD)
    try:
        warned = _restored(pool.run_ok(rank_restore, key, root, str(tmp_path / "durable"), 4), 8, "local")
        assert pool.run_ok(rank_end, key) == [[4, 8]] * WORLD, warned
    finally:
        pool.request_close()
        pool.close()
    assert certified(str(tmp_path / "durable" / "step_000000008"))
