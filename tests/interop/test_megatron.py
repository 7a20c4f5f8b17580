"""reshard.interop.megatron against the real megatron-core: its ``dist_checkpointing.save`` / ``load`` with the reshard
strategy, and the direct route, on a GPTModel (GQA, GLU, MoE with the allgather dispatcher) and Megatron's
own optimizer, saved on one layout and loaded on others (4 gloo ranks; only the ranks import megatron-core).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import PoolRegistry
from tests.megatron_models import MegatronLayout, assemble, check_pieces, rank_release_megatron, rank_thread_count
from tests.rankpool import RankContext, RankPool

pytestmark = pytest.mark.dist

pytest.importorskip("megatron.core")


def _state(model: Any, optimizer: Any, *, loading: bool, iteration: int, rng: bool = True) -> dict[str, Any]:
    """The sharded state dict Megatron-LM saves: model, optimizer, iteration and a per-rank RNG object (which,
    as in Megatron-LM, only a load on the saving layout asks for: a ShardedObject's grid cannot change)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedObject

    model_state = model.sharded_state_dict()
    pp, tp = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    sizes = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    state = {
        "model": model_state,
        "optimizer": optimizer.sharded_state_dict(model_state, is_loading=loading),
        "iteration": iteration,
    }
    if rng:
        value = {"random": (3, (1, 2, 3), None), "torch": torch.arange(4, dtype=torch.uint8) + tp}
        state["rng_state"] = ShardedObject(
            "rng_state", value, sizes, (pp, tp), replica_id=parallel_state.get_data_parallel_rank()
        )
    return state


def _saved_rng_cell(rank: int, saved: str = "tp=2,pp=2") -> Any:
    """An RNG object of the saving layout ``saved`` for rank ``rank`` to ask for: a load on another layout asks
    for the saving layout's cells (a ShardedObject's grid cannot change), each by at least one rank (rank ``r``
    the ``r % cells``-th, as replica ``r // cells``), so that all of them are loaded and Megatron reports
    nothing missing."""
    from megatron.core.dist_checkpointing import ShardedObject

    layout = MegatronLayout.parse(saved)
    cell = rank % (layout.pp * layout.tp)
    offset = (cell // layout.tp, cell % layout.tp)
    return ShardedObject("rng_state", None, (layout.pp, layout.tp), offset, replica_id=rank // (layout.pp * layout.tp))


def _fully_parallel(action: str, path: str | None = None) -> Any:
    """The strategy Megatron-LM uses with --ckpt-fully-parallel-save / --ckpt-fully-parallel-load: the reshard
    strategy (for a load, the one metadata.json names) in Megatron's wrapper over the data-parallel group (with
    context parallelism), as Megatron-LM's checkpointing builds it; a load exchanges with ``gather_object``
    (its other exchanges need CUDA)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if action == "save":
        return FullyParallelSaveStrategyWrapper(get_default_strategy(StrategyAction.SAVE_SHARDED, "reshard", 1), group)
    assert path is not None
    strategy = get_default_load_sharded_strategy(path)
    return FullyParallelLoadStrategyWrapper(strategy, group, exchange_algo="gather_object")


def rank_megatron_save(ctx: RankContext, layout: str, path: str, fully_parallel: bool = False) -> list[Any]:
    """Megatron's dist_checkpointing.save of the model and optimizer on ``layout`` with the reshard strategy
    (``fully_parallel``: in Megatron's FullyParallelSaveStrategyWrapper); returns the saved pieces."""
    from megatron.core import dist_checkpointing

    import reshard.interop.megatron  # noqa: F401  (registers the strategies)
    from tests.megatron_models import build_gpt, build_optimizer, perturb, sharded_pieces

    parsed = MegatronLayout.parse(layout)
    model = build_gpt(parsed)
    perturb(model)
    optimizer = build_optimizer(model, filled=True)
    state = _state(model, optimizer, loading=False, iteration=3)
    pieces = sharded_pieces(state)
    strategy = _fully_parallel("save") if fully_parallel else ("reshard", 1)
    dist_checkpointing.save(state, path, sharded_strategy=strategy)
    return pieces


def rank_megatron_load(
    ctx: RankContext, layout: str, path: str, saved: str = "tp=2,pp=2", fully_parallel: bool = False
) -> dict[str, Any]:
    """A fresh model and optimizer on ``layout`` (other weights, zero Adam state), loaded with Megatron's plain
    dist_checkpointing.load (strict RETURN_ALL; ``fully_parallel``: the strategy in Megatron's
    FullyParallelLoadStrategyWrapper) from a checkpoint saved on ``saved`` and handed to model.load_state_dict
    and the optimizer's load_state_dict; returns the pieces they then hold."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    import reshard.interop.megatron  # noqa: F401
    from tests.megatron_models import build_gpt, build_optimizer, cpu_synchronize, sharded_pieces

    parsed = MegatronLayout.parse(layout)
    model = build_gpt(parsed, seed=99)
    optimizer = build_optimizer(model)
    state = _state(model, optimizer, loading=True, iteration=0, rng=layout == saved)
    if layout != saved:
        state["rng_state"] = _saved_rng_cell(ctx.rank, saved)
    strategy = _fully_parallel("load", path) if fully_parallel else None
    with cpu_synchronize():
        loaded, missing, unexpected = dist_checkpointing.load(
            state, path, sharded_strategy=strategy, strict=StrictHandling.RETURN_ALL
        )
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])
    after = _state(model, optimizer, loading=False, iteration=loaded["iteration"], rng=False)
    return {
        "pieces": sharded_pieces(after),
        "missing": sorted(missing),
        "unexpected": sorted(unexpected),
        "iteration": loaded["iteration"],
        "rng": loaded.get("rng_state"),
        "step": [s["step"].item() for s in optimizer.optimizer.state.values()],
    }


@pytest.fixture(scope="module", autouse=True)
def release_megatron_groups(pools: PoolRegistry) -> Iterator[None]:
    """After this module, no process group of Megatron's is left in the pool's processes: each holds threads
    for the life of the process, and Megatron creates about seventeen per layout."""
    before = pools.get(4).run_ok(rank_thread_count)
    yield
    after = pools.get(4).run_ok(rank_release_megatron)
    assert all(a <= b + 8 for a, b in zip(after, before, strict=True)), (before, after)


@pytest.fixture(scope="module")
def megatron_checkpoint(pools: PoolRegistry, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A GPTModel and its optimizer saved by dist_checkpointing.save on TP=2 x PP=2 with the reshard strategy,
    and the full tensors it saved."""
    path = tmp_path_factory.mktemp("megatron") / "iter_3"
    path.mkdir()
    pieces = pools.get(4).run_ok(rank_megatron_save, "tp=2,pp=2", str(path), timeout_s=240)
    return path, assemble(pieces)


def test_megatron_save_writes_its_files_and_a_reshard_checkpoint_beside_them(
    megatron_checkpoint: tuple[Path, dict[str, Any]],
) -> None:
    import json

    import reshard

    path, full = megatron_checkpoint
    assert json.loads((path / "metadata.json").read_text())["sharded_backend"] == "reshard"
    assert (path / "common.pt").is_file()  # Megatron's own pickle of the non-sharded values
    metadata = reshard.read_metadata(path / "reshard")
    assert set(metadata.tensors) == set(full)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in metadata.tensors)
    assert "rng_state" in metadata.objects and not any(torch.isnan(t).any() for t in full.values())


@pytest.mark.parametrize("layout", ["tp=1", "pp=4", "tp=2,pp=2", "ep=2", "tp=2,ep=2", "ep=4"])
def test_megatron_load_at_another_layout_is_bit_exact_and_strict(
    pool4: RankPool, megatron_checkpoint: tuple[Path, dict[str, Any]], layout: str
) -> None:
    path, full = megatron_checkpoint
    results = pool4.run_ok(rank_megatron_load, layout, str(path), timeout_s=240)
    problems = check_pieces(full, [r["pieces"] for r in results])
    assert not problems, problems[:10]
    # Megatron's words: "missing" is in the checkpoint but not asked for, "unexpected" asked for but not in it.
    for r in results:
        assert r["missing"] == [] and r["unexpected"] == [], layout
        assert r["iteration"] == 3 and set(r["step"]) == {3.0}
    for rank, r in enumerate(results):  # each saving rank's RNG object comes back, pickle-free
        assert r["rng"]["random"] == (3, (1, 2, 3), None)
        assert torch.equal(r["rng"]["torch"], torch.arange(4, dtype=torch.uint8) + rank % 2)


def test_megatron_fully_parallel_wrappers_save_and_load_bit_exactly(pool4: RankPool, tmp_path: Path) -> None:
    """Megatron-LM's --ckpt-fully-parallel-save and --ckpt-fully-parallel-load: the reshard strategy inside
    Megatron's FullyParallelSaveStrategyWrapper (TP=2 x DP=2, the wrapper over each DP pair) and, on PP=2 x DP=2,
    inside FullyParallelLoadStrategyWrapper, which hands the strategy dicts keyed by shard-id tuples and
    exchanges what each rank loaded: every tensor bit-exact, nothing missing or unexpected, the RNG objects of
    the saving layout back."""
    path = tmp_path / "fully_parallel"
    path.mkdir()
    full = assemble(pool4.run_ok(rank_megatron_save, "tp=2", str(path), True, timeout_s=240))
    results = pool4.run_ok(rank_megatron_load, "pp=2", str(path), "tp=2", True, timeout_s=240)
    problems = check_pieces(full, [r["pieces"] for r in results])
    assert not problems, problems[:10]
    for rank, r in enumerate(results):
        assert r["missing"] == [] and r["unexpected"] == [] and r["iteration"] == 3 and set(r["step"]) == {3.0}
        assert torch.equal(r["rng"]["torch"], torch.arange(4, dtype=torch.uint8) + rank % 2)


# ---- the direct route: reshard.save / reshard.load of Megatron's sharded state dicts --------------------------


def rank_direct_save(ctx: RankContext, layout: str, path: str) -> list[Any]:
    """reshard.save(to_reshard(state)) of the model and optimizer on ``layout``; the saved pieces."""
    import reshard
    from reshard.interop.megatron import to_reshard
    from tests.megatron_models import build_gpt, build_optimizer, perturb, sharded_pieces

    model = build_gpt(MegatronLayout.parse(layout))
    perturb(model)
    optimizer = build_optimizer(model, filled=True)
    state = _state(model, optimizer, loading=False, iteration=3, rng=False)
    pieces = sharded_pieces(state)
    reshard.save(to_reshard(state), path)
    return pieces


def rank_direct_load(ctx: RankContext, layout: str, path: str) -> dict[str, Any]:
    """reshard.load(to_reshard(template)) on ``layout``, from_reshard, then model.load_state_dict and the
    optimizer's load_state_dict (strict); the pieces they then hold."""
    import reshard
    from reshard.interop.megatron import from_reshard, to_reshard
    from tests.megatron_models import build_gpt, build_optimizer, sharded_pieces

    model = build_gpt(MegatronLayout.parse(layout), seed=99)
    optimizer = build_optimizer(model)
    template = _state(model, optimizer, loading=True, iteration=0, rng=False)
    loaded = from_reshard(reshard.load(to_reshard(template), path), template)
    model.load_state_dict(loaded["model"], strict=True)
    optimizer.load_state_dict(loaded["optimizer"])
    after = _state(model, optimizer, loading=False, iteration=loaded["iteration"], rng=False)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.optimizer.param_groups]
    steps = sorted({state["step"].item() for state in optimizer.optimizer.state.values()})
    return {"pieces": sharded_pieces(after), "iteration": loaded["iteration"], "groups": groups, "steps": steps}


def test_direct_route_reshards_into_model_and_optimizer_load_state_dict(pool4: RankPool, tmp_path: Path) -> None:
    """reshard.save(to_reshard(...)) on EP=2 x TP=2, loaded on PP=4 and on TP=1 x EP=4 through from_reshard:
    model.load_state_dict (strict) and the optimizer's load_state_dict take the result as it is (factories
    merged back, no prepended axes, the optimizer's parameter groups from the loading layout), every tensor
    equal to the saved one."""
    path = tmp_path / "direct"
    full = assemble(pool4.run_ok(rank_direct_save, "tp=2,ep=2", str(path), timeout_s=240))
    for layout in ("pp=4", "ep=4"):
        results = pool4.run_ok(rank_direct_load, layout, str(path), timeout_s=240)
        problems = check_pieces(full, [r["pieces"] for r in results])
        assert not problems, (layout, problems[:10])
        for r in results:
            assert r["iteration"] == 3 and r["steps"] == [3.0]  # Adam's common step, from the common state
            assert [g["is_expert_parallel"] for g in r["groups"]] == [False, True]


# ---- Megatron's metadata entry points, vocabulary padding, TE's _extra_state bytes -----------------------------


def rank_megatron_metadata(ctx: RankContext, path: str) -> dict[str, Any]:
    """load_tensors_metadata, load_sharded_metadata, load_plain_tensors and load_common_state_dict."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization

    import reshard.interop.megatron  # noqa: F401

    tensors = dist_checkpointing.load_tensors_metadata(path)
    sharded = serialization.load_sharded_metadata(path)
    plain = dist_checkpointing.load_plain_tensors(path)
    common = dist_checkpointing.load_common_state_dict(path)
    return {
        "tensors": {k: (tuple(v.global_shape), v.dtype, v.data is None) for k, v in tensors.items()},
        "objects": sorted(k for k, v in sharded.items() if type(v).__name__ == "ShardedObject"),
        "plain": plain if ctx.rank == 0 else None,
        "iteration": common["iteration"],
    }


def test_megatron_metadata_entry_points(pool4: RankPool, megatron_checkpoint: tuple[Path, dict[str, Any]]) -> None:
    path, full = megatron_checkpoint
    results = pool4.run_ok(rank_megatron_metadata, str(path), timeout_s=240)
    for r in results:
        assert r["tensors"] == {k: (tuple(t.shape), t.dtype, True) for k, t in full.items()}
        rng = [k for k in r["objects"] if k.startswith("rng_state/")]
        assert rng == [f"rng_state/shard_{pp}.{tp}_2.2" for pp in range(2) for tp in range(2)]
        # and the _extra_state objects of every layer (and expert) of Megatron's modules
        assert "decoder.layers.self_attention.linear_qkv._extra_state/shard_3_4" in r["objects"]
        assert r["iteration"] == 3
    plain = results[0]["plain"]
    # (Megatron's load merges its common.pt into the result too: the iteration, the optimizer's common step)
    assert set(full) <= set(plain) and all(torch.equal(plain[k], full[k]) for k in full)


def rank_padded_save(ctx: RankContext, path: str, vocab: int) -> None:
    """A vocabulary-parallel embedding of ``vocab`` padded rows over 4 TP ranks (allow_shape_mismatch, as
    Megatron's) and a TE-like ``_extra_state`` of bytes per rank, through dist_checkpointing.save."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    import reshard.interop.megatron  # noqa: F401

    rows = vocab // 4
    data = torch.arange(vocab * 3, dtype=torch.float32).view(vocab, 3)[ctx.rank * rows : (ctx.rank + 1) * rows]
    state = {
        "emb": ShardedTensor.from_rank_offsets("emb", data.clone(), (0, ctx.rank, 4), allow_shape_mismatch=True),
        "extra": ShardedObject("linear._extra_state", io.BytesIO(b"te-state-" + bytes([ctx.rank])), (4,), (ctx.rank,)),
    }
    dist_checkpointing.save(state, path, sharded_strategy=("reshard", 1))


def rank_padded_load(ctx: RankContext, path: str, vocab: int, tp: int) -> dict[str, Any] | None:
    """The embedding with ``vocab`` padded rows over ``tp`` ranks (the others load nothing), filled with -1
    before the load, and the ``_extra_state`` object of this rank's cell."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    import reshard.interop.megatron  # noqa: F401

    rows = vocab // tp
    state: dict[str, Any] = {
        "extra": ShardedObject("linear._extra_state", io.BytesIO(), (4,), (ctx.rank,)),
    }
    if ctx.rank < tp:
        local = torch.full((rows, 3), -1.0)
        state["emb"] = ShardedTensor.from_rank_offsets("emb", local, (0, ctx.rank, tp), allow_shape_mismatch=True)
    loaded = dist_checkpointing.load(state, path)
    return {"emb": loaded.get("emb"), "extra": loaded["extra"]}


def test_megatron_vocabulary_padding_both_ways_and_extra_state_bytes(pool4: RankPool, tmp_path: Path) -> None:
    """allow_shape_mismatch as Megatron has it: a vocabulary padded to 72 rows loads into 64 rows (the first
    64) and into 80 (the first 72; the 8 rows past the stored tensor are zeros, as Megatron's torch_dist
    strategy leaves them: it zeroes every allow_shape_mismatch tensor before a load), from any TP size;
    TE's io.BytesIO _extra_state comes back as io.BytesIO with its bytes."""
    path = tmp_path / "padded"
    path.mkdir()
    pool4.run_ok(rank_padded_save, str(path), 72)
    saved = torch.arange(72 * 3, dtype=torch.float32).view(72, 3)
    for vocab, tp in ((64, 2), (80, 4), (72, 1)):
        results = pool4.run_ok(rank_padded_load, str(path), vocab, tp)
        rows = vocab // tp
        for rank, r in enumerate(results):
            assert isinstance(r["extra"], io.BytesIO) and r["extra"].getvalue() == b"te-state-" + bytes([rank])
            if rank >= tp:
                continue
            expected = torch.zeros(rows, 3)  # the local tensor held -1 before the load
            start = rank * rows
            overlap = max(0, min(start + rows, 72) - start)
            expected[:overlap] = saved[start : start + overlap]
            assert torch.equal(r["emb"], expected), (vocab, tp, rank)


UNEVEN_SAVE = (3, 5, 2, 6)
UNEVEN_LOAD = (6, 2, 5, 3)


def _uneven(key: str, sizes: tuple[int, ...], rank: int, fill: float | None) -> Any:
    """Rows ``sizes[rank]`` of a (16, 2) tensor on each rank: an uneven 1-D split (no regular grid)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    start, rows = sum(sizes[:rank]), sizes[rank]
    full = torch.arange(32, dtype=torch.float64).view(16, 2)
    data = full[start : start + rows].clone() if fill is None else torch.full((rows, 2), fill, dtype=torch.float64)
    return ShardedTensor(key, data, data.dtype, (rows, 2), (16, 2), (start, 0), None)


def rank_replicas_and_uneven_save(ctx: RankContext, path: str) -> None:
    """Four tensors replicated on every rank (replica_id = rank) and one split unevenly, through
    dist_checkpointing.save with the reshard strategy."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    import reshard.interop.megatron  # noqa: F401

    state: dict[str, Any] = {"uneven": _uneven("uneven", UNEVEN_SAVE, ctx.rank, None)}
    for i in range(4):
        value = torch.full((256,), float(i))
        state[f"replicated{i}"] = ShardedTensor.from_rank_offsets(f"replicated{i}", value, replica_id=ctx.rank)
    dist_checkpointing.save(state, path, sharded_strategy=("reshard", 1))


def rank_uneven_load(ctx: RankContext, path: str) -> torch.Tensor:
    from megatron.core import dist_checkpointing

    import reshard.interop.megatron  # noqa: F401

    return dist_checkpointing.load({"uneven": _uneven("uneven", UNEVEN_LOAD, ctx.rank, -1.0)}, path)["uneven"]


def test_megatron_uneven_splits_and_save_distributed_over_replicas(pool4: RankPool, tmp_path: Path) -> None:
    """As in Megatron's own tests: a tensor split unevenly (3, 5, 2, 6 rows) loads into another uneven split,
    and tensors replicated on every rank are written once each, by different ranks (the writes are spread
    over the replicas, not all left to rank 0)."""
    import reshard

    path = tmp_path / "uneven"
    path.mkdir()
    pool4.run_ok(rank_replicas_and_uneven_save, str(path))
    metadata = reshard.read_metadata(path / "reshard")
    writers = {metadata.tensors[f"replicated{i}"].boxes[0].file for i in range(4)}
    assert len(writers) == 4 and len(metadata.files) == 4
    full = torch.arange(32, dtype=torch.float64).view(16, 2)
    for rank, got in enumerate(pool4.run_ok(rank_uneven_load, str(path))):
        start = sum(UNEVEN_LOAD[:rank])
        assert torch.equal(got, full[start : start + UNEVEN_LOAD[rank]])


def rank_megatron_errors(ctx: RankContext, path: str, bad_path: str) -> dict[str, tuple[str, bool, str, str]]:
    """A dist_checkpointing.save of a tensor and an object with the reshard strategy, then loads (and a save)
    that must fail; per case: the error's class, whether Megatron's callers catch it (CheckpointingException),
    the reshard class it also is, and its message."""
    import pickle

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException

    import reshard.interop.megatron  # noqa: F401

    world, rank = ctx.world_size, ctx.rank
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0).view(4, 2) + 8 * rank, (0, rank, world)),
        "obj": ShardedObject("obj", {"rank": rank}, (world,), (rank,)),
    }
    dist_checkpointing.save(state, path, sharded_strategy=("reshard", 1))
    loads = {
        "unexpected key": {"w": ShardedTensor.from_rank_offsets("different_key", torch.zeros(4, 2), (0, rank, world))},
        "global shape": {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 2), (0, rank, world))},
        "other axes": {
            "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 2, 1), (0, rank, world), allow_shape_mismatch=True)
        },
        "object grid": {"obj": ShardedObject("obj", None, (world, 1), (rank, 0))},
    }
    out: dict[str, tuple[str, bool, str, str]] = {}

    def record(case: str, exc: Exception) -> None:
        assert type(pickle.loads(pickle.dumps(exc))) is type(exc)  # it crosses processes as it is
        reshard_class = next((c.__name__ for c in type(exc).__mro__ if c.__module__ == "reshard.errors"), "")
        out[case] = (type(exc).__name__, isinstance(exc, CheckpointingException), reshard_class, str(exc))

    for case, template in loads.items():
        try:
            dist_checkpointing.load(template, path)
        except Exception as exc:
            record(case, exc)
    bad = {"obj": ShardedObject("not_encodable", object(), (1,), (0,), replica_id=rank)}
    try:
        dist_checkpointing.save(bad, bad_path, sharded_strategy=("reshard", 1))
    except Exception as exc:
        record("save", exc)
    return out


def test_megatron_errors_are_checkpointing_exceptions_and_reshard_errors(pool4: RankPool, tmp_path: Path) -> None:
    """What Megatron's callers catch: a load the strategy refuses (a key the checkpoint lacks, under Megatron's
    default strictness, which leaves unexpected keys to the strategy; another global shape; other axes under
    allow_shape_mismatch; another object grid) and a save it refuses (a value it cannot store without pickle)
    raise a CheckpointingException that is also reshard's error class, the same on every rank."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "bad").mkdir()
    results = pool4.run_ok(rank_megatron_errors, str(tmp_path / "ckpt"), str(tmp_path / "bad"), timeout_s=240)
    expected = {
        "unexpected key": "MismatchError",
        "global shape": "MismatchError",
        "other axes": "MismatchError",
        "object grid": "MismatchError",
        "save": "StateDictError",
    }
    for rank, r in enumerate(results):
        assert set(r) == set(expected), (rank, r)
        for case, (name, megatron_catches, reshard_class, message) in r.items():
            assert megatron_catches, (rank, case, name, message)
            assert reshard_class == expected[case] and name == results[0][case][0], (rank, case, r[case])
    assert "different_key" in results[0]["unexpected key"][3]


def rank_megatron_async_save(ctx: RankContext, layout: str, path: str) -> dict[str, Any]:
    """dist_checkpointing.save(..., async_sharded_save=True) with the reshard strategy: the parameters change
    right after the call returns (training goes on), then the request is finalised as Megatron does it
    (``execute_sync``: its writer process has nothing to run; the finalize functions wait for reshard's
    commit, then write Megatron's metadata.json)."""
    import json

    from megatron.core import dist_checkpointing

    import reshard.interop.megatron  # noqa: F401
    from tests.megatron_models import build_gpt, build_optimizer, perturb, sharded_pieces

    model = build_gpt(MegatronLayout.parse(layout))
    perturb(model)
    optimizer = build_optimizer(model, filled=True)
    state = _state(model, optimizer, loading=False, iteration=3, rng=False)
    pieces = sharded_pieces(state)
    request = dist_checkpointing.save(state, path, sharded_strategy=("reshard", 1), async_sharded_save=True)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1000.0)
    config = Path(path) / "metadata.json"  # written by the strategy, before the background save commits
    before_finalize = json.loads(config.read_text())["sharded_backend"] if config.exists() else None
    request.execute_sync()
    return {"pieces": pieces, "before_finalize": before_finalize}


def test_megatron_async_save_through_its_async_request(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "async"
    path.mkdir()
    results = pool4.run_ok(rank_megatron_async_save, "tp=2,pp=2", str(path), timeout_s=240)
    # Before the commit, Megatron's metadata.json names the strategy already, whose load refuses a common.pt that
    # the committed reshard checkpoint was not saved with (tests/interop/test_megatron_crash.py kills saves there).
    assert all(r["before_finalize"] == "reshard" for r in results)
    full = assemble([r["pieces"] for r in results])
    loaded = pool4.run_ok(rank_megatron_load, "tp=1", str(path), timeout_s=240)
    problems = check_pieces(full, [r["pieces"] for r in loaded])
    assert not problems, problems[:10]  # the snapshot, not the values changed after the call


# ---- reshard import-dcp of a Megatron torch_dist checkpoint -------------------------------------------------


def rank_megatron_torch_dist_save(ctx: RankContext, layout: str, path: str) -> list[Any]:
    """Megatron's own torch_dist save of the model, optimizer and RNG objects (with the CPU variant of its
    strategy, see benchmarks/compare.py); the saved pieces."""
    import warnings

    from benchmarks.compare import _megatron_cpu_save_strategy
    from megatron.core import dist_checkpointing

    from tests.megatron_models import build_gpt, build_optimizer, perturb, sharded_pieces

    model = build_gpt(MegatronLayout.parse(layout))
    perturb(model)
    optimizer = build_optimizer(model, filled=True)
    state = _state(model, optimizer, loading=False, iteration=3)
    pieces = sharded_pieces(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist_checkpointing.save(state, path, sharded_strategy=_megatron_cpu_save_strategy())
    return pieces


def test_import_dcp_converts_a_megatron_torch_dist_checkpoint_completely(pool4: RankPool, tmp_path: Path) -> None:
    """reshard import-dcp of Megatron's own torch_dist checkpoint (TP=2 x PP=2): tensors, every ShardedObject
    cell (as a reshard ShardedObject) and common.pt (as the megatron.common object), nothing left out; the
    direct route then loads it on TP=1 and on EP=2 into model.load_state_dict and the optimizer's
    load_state_dict, every tensor equal to the saved one, the iteration and Adam's step back."""
    import reshard
    from reshard.interop import import_dcp

    source, converted = tmp_path / "megatron", tmp_path / "converted"
    source.mkdir()
    full = assemble(pool4.run_ok(rank_megatron_torch_dist_save, "tp=2,pp=2", str(source), timeout_s=240))
    result = import_dcp(source, converted, trust_pickle=True, strict=True)
    assert not result.left_out
    metadata = reshard.read_metadata(converted)
    assert set(metadata.tensors) == set(full)
    assert metadata.objects["rng_state"].global_shape == (2, 2) and len(metadata.objects["rng_state"].entries) == 4
    assert "megatron.common" in metadata.objects
    for layout in ("tp=1", "ep=2"):
        results = pool4.run_ok(rank_direct_load, layout, str(converted), timeout_s=240)
        problems = check_pieces(full, [r["pieces"] for r in results])
        assert not problems, (layout, problems[:10])
        assert all(r["iteration"] == 3 and r["steps"] == [3.0] for r in results)


def rank_param_groups_refused(ctx: RankContext, path: str) -> str:
    """A direct-route checkpoint whose optimizer had two parameter groups, loaded into a template with one:
    from_reshard refuses (lists merge by position), naming the problem."""
    import reshard
    from reshard.errors import MismatchError
    from reshard.interop.megatron import from_reshard, to_reshard

    groups = [{"lr": 0.1, "is_expert_parallel": False}, {"lr": 0.1, "is_expert_parallel": True}]
    reshard.save(to_reshard({"optimizer": {"param_groups": groups}}), path)
    template = {"optimizer": {"param_groups": [{"lr": 0.0, "is_expert_parallel": False}]}}
    try:
        from_reshard(reshard.load(to_reshard(template), path), template)
    except MismatchError as exc:
        return str(exc)
    return "loaded"


def test_direct_route_refuses_lists_of_another_length(pool4: RankPool, tmp_path: Path) -> None:
    messages = pool4.run_ok(rank_param_groups_refused, str(tmp_path / "groups"))
    assert all("has 2 entries where the state dict has 1" in m for m in messages), messages
