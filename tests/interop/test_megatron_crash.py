"""kill -9 of a rank during Megatron's ``dist_checkpointing.save(..., sharded_strategy=("reshard", 1))`` over an
earlier checkpoint in the same directory, with real processes, real files and the real megatron-core.

Megatron's save writes, in this order: ``common.pt`` (rank 0, ``torch.save`` in place), then the strategy's
part (here the reshard checkpoint in ``reshard/``), then its ``metadata.json`` (rank 0, in place). Whatever
point a kill hits, Megatron's ``dist_checkpointing.load`` of the directory must load the complete earlier save,
the complete new one, or raise: never the new ``common.pt`` (iteration, arguments) with the old tensors.

Each kill runs on a private pool of 2 ranks (a killed rank leaves its group unusable), which is killed
afterwards; the loads and the saves after the crash run on the session's 4-rank pool. The kill is a real
``os.kill(os.getpid(), SIGKILL)`` at the chosen point, placed by wrapping the function that runs there (a
marker file written just before it says where the process died).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.faults import kill_pool, run_with_deaths
from tests.rankpool import RankContext, RankFailure, RankPool, private_pool

pytestmark = pytest.mark.dist

pytest.importorskip("megatron.core")

ROWS, COLS = 16, 64  # rows per saving rank
OLD, NEW, AFTER = 1, 2, 3  # iterations: the earlier save, the interrupted one, a save after the crash


def _global_w(world: int, iteration: int) -> torch.Tensor:
    return torch.arange(world * ROWS * COLS, dtype=torch.float32).view(world * ROWS, COLS) + 100000.0 * iteration


def _state(rank: int, world: int, iteration: int) -> dict[str, Any]:
    """What a training job saves: a tensor split over the ranks, a replicated one, an object per rank, and
    common values that Megatron writes into common.pt (they tell the iteration too)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    rows = _global_w(world, iteration)[rank * ROWS : (rank + 1) * ROWS].clone()
    return {
        "w": ShardedTensor.from_rank_offsets("w", rows, (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((8,), float(iteration)), replica_id=rank),
        "rng": ShardedObject("rng", {"iteration": iteration, "rank": rank}, (world,), (rank,)),
        "iteration": iteration,
        "args": {"lr": 0.5 * iteration},
    }


def _fire(marker: str, point: str, **details: Any) -> None:
    Path(marker).write_text(json.dumps({"point": point, "pid": os.getpid(), **details}))
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, path: str, marker: str) -> None:
    """Make this process kill itself at ``point`` of the next save into ``path``."""
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy

    from reshard.storage import LocalStorage

    root = Path(path)
    if point == "after_common_pt":  # Megatron wrote common.pt; the strategy has not started
        save_common = TorchCommonSaveStrategy.save_common

        def common_then_die(self: Any, state_dict: Any, checkpoint_dir: Any) -> None:
            save_common(self, state_dict, checkpoint_dir)
            _fire(marker, point, common_pt=state_dict["iteration"])

        TorchCommonSaveStrategy.save_common = common_then_die
    elif point == "after_repoint":  # the strategy has pointed Megatron's metadata.json at itself
        from reshard.interop.megatron import strategies

        repoint = strategies.repoint

        def repoint_then_die(*args: Any, **kwargs: Any) -> Any:
            before = repoint(*args, **kwargs)
            _fire(marker, point, backend=json.loads((root / "metadata.json").read_text())["sharded_backend"])
            return before

        strategies.repoint = repoint_then_die
    elif point == "in_data_write":  # a rank opens its data file of the reshard checkpoint
        open_writer = LocalStorage.open_writer

        def die_on_data(self: Any, name: str, **kwargs: Any) -> Any:
            if name.startswith("data/"):
                _fire(marker, point, file=name)
            return open_writer(self, name, **kwargs)

        LocalStorage.open_writer = die_on_data
    elif point in ("in_reshard_commit", "before_megatron_metadata"):
        committed = (root / "reshard" / "metadata.json").read_bytes()  # the earlier save's

        def reshard_committed() -> bool:
            return (root / "reshard" / "metadata.json").read_bytes() != committed

        if point == "in_reshard_commit":  # the new reshard/metadata.json is written and synced, not yet renamed
            replace = os.replace

            def die_before_rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
                if Path(dst) == root / "reshard" / "metadata.json":
                    _fire(marker, point, reshard_committed=reshard_committed(), temporary=Path(src).exists())
                replace(src, dst, *args, **kwargs)

            os.replace = die_before_rename
        else:  # the strategy returned; Megatron is about to write its metadata.json
            save_config = serialization.save_config

            def die_before_config(config: Any, checkpoint_dir: Any) -> None:
                _fire(marker, point, reshard_committed=reshard_committed())
                save_config(config, checkpoint_dir)

            serialization.save_config = die_before_config


def rank_save_then_crash(
    ctx: RankContext, path: str, earlier: str, point: str, killed: int, marker: str
) -> dict[str, Any]:
    """Save iteration OLD completely with the ``earlier`` strategy (``"reshard"`` or Megatron's ``"torch_dist"``),
    then iteration NEW into the same directory with the reshard strategy and rank ``killed`` armed to die at
    ``point``; a survivor reports how its save ended."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import reshard.interop.megatron  # noqa: F401

    if earlier == "torch_dist":
        _torch_dist_save(_state(ctx.rank, ctx.world_size, OLD), path)
    else:
        dist_checkpointing.save(_state(ctx.rank, ctx.world_size, OLD), path, sharded_strategy=("reshard", 1))
    dist.barrier()
    if ctx.rank == killed:
        _arm(point, path, marker)
    try:
        dist_checkpointing.save(_state(ctx.rank, ctx.world_size, NEW), path, sharded_strategy=("reshard", 1))
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)[:300]}
    return {"saved": True}


def rank_load_outcome(ctx: RankContext, path: str, world: int, strategy: Any = None) -> dict[str, Any]:
    """Megatron's dist_checkpointing.load of every saved tensor and object cell (on every rank), with the
    strategy that metadata.json names or ``strategy``: which save the common state, the tensors and the
    objects come from, or the error."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException

    import reshard.interop.megatron  # noqa: F401

    template = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(world * ROWS, COLS), replica_id=ctx.rank),
        "b": ShardedTensor.from_rank_offsets("b", torch.zeros(8), replica_id=ctx.rank),
        "rng": [ShardedObject("rng", None, (world,), (r,), replica_id=ctx.rank) for r in range(world)],
    }
    try:
        loaded = dist_checkpointing.load(template, path, sharded_strategy=strategy)
    except Exception as exc:
        return {"error": type(exc).__name__, "megatron_catches": isinstance(exc, CheckpointingException)}
    w = next((it for it in (OLD, NEW, AFTER) if torch.equal(loaded["w"], _global_w(world, it))), None)
    b = {int(v) for v in loaded["b"].tolist()}
    return {
        "iteration": loaded["iteration"],
        "args": loaded["args"]["lr"] / 0.5,
        "w": w,
        "b": b.pop() if len(b) == 1 else None,
        "rng": sorted({cell["iteration"] for cell in loaded["rng"]}),
    }


def rank_save_again(ctx: RankContext, path: str) -> None:
    """After the crash: the next save into the same directory, on 4 ranks."""
    from megatron.core import dist_checkpointing

    import reshard.interop.megatron  # noqa: F401

    dist_checkpointing.save(_state(ctx.rank, ctx.world_size, AFTER), path, sharded_strategy=("reshard", 1))


@dataclass(frozen=True)
class Crash:
    name: str
    point: str
    killed: int
    path: Path
    marker: dict[str, Any]
    survivors: dict[int, Any]
    exitcodes: dict[int, int | None]


MIX = "the new common state with the old tensors"
INCOMPLETE = "IncompleteCheckpointError"
CRASHES: dict[str, tuple[str, str, Any, Any]] = {
    # name: (the earlier checkpoint's strategy, the kill point of rank 0 in the reshard-strategy save over it,
    #        what dist_checkpointing.load gives afterwards, what it gives with sharded_strategy=("reshard", 1))
    # (The contract suite's "megatron" flow, tests/contract/flows_edge.py, kills every rank at a sample of every
    # event of such a save over a reshard-strategy checkpoint, the rank's data write and the reshard commit
    # among them.)
    # The new common.pt beside the old tensors, under the old metadata.json: common.pt is not the one the
    # committed reshard checkpoint was saved with.
    "after_common_pt": ("reshard", "after_common_pt", INCOMPLETE, INCOMPLETE),
    # The reshard checkpoint committed, Megatron has not written its metadata.json yet: the new save.
    "before_megatron_metadata": ("reshard", "before_megatron_metadata", NEW, NEW),
    # Over Megatron's torch_dist: the kill comes inside Megatron's save, before any strategy code runs, and
    # metadata.json still names torch_dist, whose load reads the new common.pt with the old tensors, as after
    # the same kill in a torch_dist save over a torch_dist checkpoint. A reshard-strategy load refuses.
    "torch_dist_after_common_pt": ("torch_dist", "after_common_pt", MIX, "MismatchError"),
    # Over Megatron's torch_dist, right after the strategy pointed metadata.json at itself (it has written
    # nothing in reshard/ yet): refused as an interrupted save.
    "torch_dist_after_repoint": ("torch_dist", "after_repoint", INCOMPLETE, INCOMPLETE),
}
WORLD = 2


@pytest.fixture(scope="module", params=list(CRASHES))
def crash(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Crash:
    name = request.param
    earlier, point, _, _ = CRASHES[name]
    killed = 0
    base = tmp_path_factory.mktemp(f"megatron-crash-{name}")
    path = base / "iter"
    path.mkdir()
    marker = base / "killed.json"
    pool = private_pool(WORLD)
    try:
        run = run_with_deaths(pool, rank_save_then_crash, str(path), earlier, point, killed, str(marker), dead={killed})
    finally:
        kill_pool(pool)
    assert marker.exists(), f"rank {killed} was not killed at {point}: {run.results}"
    return Crash(name, point, killed, path, json.loads(marker.read_text()), run.results, run.exitcodes)


def test_rank_is_killed_at_the_chosen_point(crash: Crash) -> None:
    assert crash.exitcodes == {crash.killed: -signal.SIGKILL}
    assert crash.marker["point"] == crash.point
    if crash.point == "after_common_pt":
        assert crash.marker["common_pt"] == NEW  # Megatron had written the new common.pt
    if crash.point == "in_reshard_commit":
        assert not crash.marker["reshard_committed"] and crash.marker["temporary"]
    if crash.point == "before_megatron_metadata":
        assert crash.marker["reshard_committed"]
    if crash.point == "after_repoint":
        assert crash.marker["backend"] == "reshard"
    for rank, result in crash.survivors.items():
        assert not isinstance(result, RankFailure) and "saved" not in result, (rank, result)


def _expected_load(expected: Any) -> dict[str, Any]:
    if expected == MIX:
        return {"iteration": NEW, "args": NEW, "w": OLD, "b": OLD, "rng": [OLD]}
    if isinstance(expected, str):
        return {"error": expected, "megatron_catches": True}
    return {"iteration": expected, "args": expected, "w": expected, "b": expected, "rng": [expected]}


def test_load_after_the_crash(pool4: RankPool, crash: Crash) -> None:
    """dist_checkpointing.load of the directory loads the earlier save, the new one, or raises; never a mix,
    except where the save died inside Megatron's own code over a checkpoint of Megatron's torch_dist strategy,
    before the strategy started (documented: as with Megatron's own strategies)."""
    backend = json.loads((crash.path / "metadata.json").read_text())["sharded_backend"]
    assert backend == ("torch_dist" if crash.name == "torch_dist_after_common_pt" else "reshard")
    expected = _expected_load(CRASHES[crash.name][2])
    for rank, r in enumerate(pool4.run_ok(rank_load_outcome, str(crash.path), WORLD, timeout_s=120)):
        assert r == expected, (rank, crash.name, r)


def test_a_reshard_strategy_load_after_the_crash_never_mixes(pool4: RankPool, crash: Crash) -> None:
    """dist_checkpointing.load(..., sharded_strategy=("reshard", 1)) of the directory: the earlier save, the new
    one, or an error, whatever strategy saved the earlier checkpoint."""
    expected = _expected_load(CRASHES[crash.name][3])
    for rank, r in enumerate(pool4.run_ok(rank_load_outcome, str(crash.path), WORLD, ("reshard", 1), timeout_s=120)):
        assert r == expected, (rank, crash.name, r)


def test_the_next_save_over_the_crash_loads(pool4: RankPool, crash: Crash, tmp_path: Path) -> None:
    path = tmp_path / "iter"
    shutil.copytree(crash.path, path)
    pool4.run_ok(rank_save_again, str(path), timeout_s=120)
    for r in pool4.run_ok(rank_load_outcome, str(path), 4, timeout_s=120):
        assert r == {"iteration": AFTER, "args": AFTER, "w": AFTER, "b": AFTER, "rng": [AFTER]}, r


def rank_refused_save(ctx: RankContext, path: str, iteration: int) -> str:
    """Save iteration OLD, then a save into the same directory that the strategy refuses (a ShardedObject
    whose value it cannot store without pickle) with the common state of ``iteration``; the refusal's class."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject

    import reshard.interop.megatron  # noqa: F401

    dist_checkpointing.save(_state(ctx.rank, ctx.world_size, OLD), path, sharded_strategy=("reshard", 1))
    state = _state(ctx.rank, ctx.world_size, iteration)
    state["bad"] = ShardedObject("bad", object(), (1,), (0,), replica_id=ctx.rank)
    try:
        dist_checkpointing.save(state, path, sharded_strategy=("reshard", 1))
    except Exception as exc:
        return type(exc).__name__
    return "saved"


@pytest.mark.parametrize("iteration", [OLD, NEW])
def test_a_refused_save_over_a_checkpoint_never_leaves_a_mix(pool4: RankPool, tmp_path: Path, iteration: int) -> None:
    """A save refused with an error (not a kill) over an earlier checkpoint: Megatron has already rewritten
    common.pt by the time the strategy sees the state. With the same common state as before (a step saved
    again), the earlier checkpoint stays whole and loadable; with another, the directory is refused, never
    loaded as the new common state with the old tensors."""
    path = tmp_path / "iter"
    path.mkdir()
    assert pool4.run_ok(rank_refused_save, str(path), iteration, timeout_s=120) == ["StateDictError"] * 4
    for r in pool4.run_ok(rank_load_outcome, str(path), 4, timeout_s=120):
        if iteration == OLD:
            assert r == {"iteration": OLD, "args": OLD, "w": OLD, "b": OLD, "rng": [OLD]}, r
        else:
            assert r == {"error": "IncompleteCheckpointError", "megatron_catches": True}, r


# ---- a refused save over a checkpoint of Megatron's own torch_dist strategy --------------------------------

# How the strategy refuses a save (every rank raises the class), made on rank 1 only where a variant allows:
REFUSALS = {
    "object": "StateDictError",  # a ShardedObject whose value reshard cannot store without pickle (a set)
    "conversion": "StateDictError",  # a state dict the strategy cannot convert (its own entry's key)
    "options": "MegatronCheckpointError",  # the ranks' SaveOptions differ (another registration or instance)
    "shapes": "ShardingError",  # the ranks' global shapes differ (Megatron's own check switched off)
    "async": "StateDictError",  # "object", through async_sharded_save: refused in the background save
    "fresh": "StateDictError",  # "object" into a directory that held no checkpoint
    "superseded": "StateDictError",  # "object" over torch_dist's NEW, which superseded a reshard-strategy OLD
}


def _torch_dist_save(state: dict[str, Any], path: str) -> None:
    """Megatron's own torch_dist save (the CPU variant of its strategy, as in tests/interop/test_megatron.py)."""
    from benchmarks.compare import _megatron_cpu_save_strategy
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(state, path, sharded_strategy=_megatron_cpu_save_strategy())


def _refused_save(ctx: RankContext, variant: str, path: str) -> str:
    """A reshard-strategy save of iteration OLD (the common state saved before, byte for byte) into ``path``,
    refused as ``variant`` says (on rank 1 where it can be); the class of the error."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    import reshard
    from reshard.interop.megatron import ReshardSaveStrategy
    from reshard.interop.megatron.directory import COMMON_PT_ENTRY

    state = _state(ctx.rank, ctx.world_size, OLD)
    strategy: Any = ("reshard", 1)
    if ctx.rank == 1 and variant in ("object", "async", "fresh", "superseded"):
        state["bad"] = ShardedObject("bad", {1, 2}, (1,), (0,))
    if ctx.rank == 1 and variant == "conversion":
        state[COMMON_PT_ENTRY] = ShardedObject("x", [1], (1,), (0,))
    if ctx.rank == 1 and variant == "options":
        chunk = reshard.SaveOptions().checksum_chunk_bytes * 2
        strategy = ReshardSaveStrategy(options=reshard.SaveOptions(checksum_chunk_bytes=chunk))
    if ctx.rank == 1 and variant == "shapes":
        state["w"] = ShardedTensor.from_rank_offsets("w", state["w"].data, (0, 1, ctx.world_size + 1))
    try:
        request = dist_checkpointing.save(
            state,
            path,
            sharded_strategy=strategy,
            validate_access_integrity=variant != "shapes",
            async_sharded_save=variant == "async",
        )
        if request is not None:
            request.execute_sync()  # Megatron's finalisation: waits for the background save
    except Exception as exc:
        return type(exc).__name__
    return "saved"


def rank_refused_over_torch_dist(ctx: RankContext, base: str) -> dict[str, Any]:
    """For each refusal: Megatron's torch_dist save of iteration OLD (none for "fresh"), then the refused
    reshard-strategy save into the same directory; the error, whether Megatron's metadata.json is as before
    (read as soon as the save returned, on every rank) and what dist_checkpointing.load gives then."""
    import torch.distributed as dist

    import reshard.interop.megatron  # noqa: F401

    out: dict[str, Any] = {}
    for variant in REFUSALS:
        path = Path(base) / variant
        path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if variant == "superseded":  # the refused save's common.pt has the bytes of the reshard save's
            from megatron.core import dist_checkpointing

            dist_checkpointing.save(_state(ctx.rank, ctx.world_size, OLD), str(path), sharded_strategy=("reshard", 1))
            _torch_dist_save(_state(ctx.rank, ctx.world_size, NEW), str(path))
        elif variant != "fresh":
            _torch_dist_save(_state(ctx.rank, ctx.world_size, OLD), str(path))
        config = path / "metadata.json"
        before = config.read_bytes() if config.exists() else None
        dist.barrier()
        error = _refused_save(ctx, variant, str(path))
        after = config.read_bytes() if config.exists() else None
        load = rank_load_outcome(ctx, str(path), ctx.world_size) if variant != "fresh" else None
        names = json.loads(after)["sharded_backend"] if after is not None else None
        out[variant] = {"error": error, "metadata_json_kept": after == before, "names": names, "load": load}
    return out


def test_a_refused_save_over_a_torch_dist_checkpoint_is_refused_never_a_mix(pool4: RankPool, tmp_path: Path) -> None:
    """A reshard-strategy save that the strategy refuses (on one rank or all, in the conversion, the planning
    or the background save) over a checkpoint of Megatron's torch_dist strategy: Megatron has already replaced
    that checkpoint's common.pt (here with the same bytes, in general with another iteration's), and nothing
    records whether it belongs to the old tensors, so metadata.json keeps naming the strategy and every load of
    the directory raises IncompleteCheckpointError on every rank (putting metadata.json back would let the
    torch_dist load return a new iteration with the old tensors). Into a directory that held no checkpoint,
    metadata.json is removed again. A reshard-strategy checkpoint that the torch_dist save superseded is never
    loaded again, even where the refused save's common.pt has its bytes (it used to come back whole, in place of
    the newer torch_dist save)."""
    wrong = []
    for rank, results in enumerate(pool4.run_ok(rank_refused_over_torch_dist, str(tmp_path), timeout_s=240)):
        for variant, error in REFUSALS.items():
            got = results[variant]
            if variant == "fresh":
                ok = got == {"error": error, "metadata_json_kept": True, "names": None, "load": None}
            else:
                refused = {"error": "IncompleteCheckpointError", "megatron_catches": True}
                ok = got["error"] == error and got["names"] == "reshard" and got["load"] == refused
            if not ok:
                wrong.append((rank, variant, got))
    assert not wrong, wrong
