"""Megatron-LM's own ``tests/unit_tests/dist_checkpointing`` scenarios (tag core_v0.16.1), with the reshard strategy
swapped in: every save is ``dist_checkpointing.save(..., sharded_strategy=("reshard", 1))`` (Megatron's tests
patch the default save strategy to ``torch_dist``), and every load finds the strategy in ``metadata.json``.

Ported to CPU and gloo on the session's 4 ranks (Megatron's run on 8 GPUs): parallel sizes, splits and expected
values are scaled to a world of 4, CUDA seeding is replaced by ``torch.manual_seed`` with CPU initialisation,
Transformer Engine layer specs by the local ones, ``get_megatron_optimizer`` by Megatron's FP32Optimizer over
Adam (``tests/megatron_models.py``), and the mock strategies of the fully-parallel tests by the reshard ones
(checking, beside Megatron's distribution, that what loads is bit-exact). Each test names the Megatron test it
ports; the module docstring of ``tests/megatron_models.py`` lists the CPU workarounds. Scenarios that need CUDA,
Transformer Engine, ``megatron.training``, nvidia-resiliency-ext or the internals of the ``torch_dist`` format
are not ported (see ``docs/migrating.md``).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import PoolRegistry
from tests.megatron_models import MegatronLayout, rank_release_megatron, rank_thread_count
from tests.rankpool import RankContext, RankPool

pytestmark = pytest.mark.dist

pytest.importorskip("megatron.core")

WORLD = 4


@pytest.fixture(scope="module", autouse=True)
def release_megatron_groups(pools: PoolRegistry) -> Iterator[None]:
    """After this module, no process group of Megatron's is left in the pool's processes."""
    before = pools.get(WORLD).run_ok(rank_thread_count)
    yield
    after = pools.get(WORLD).run_ok(rank_release_megatron)
    assert all(a <= b + 8 for a, b in zip(after, before, strict=True)), (before, after)


def _layout(tp: int = 1, pp: int = 1) -> None:
    """Megatron's parallel state for TP x PP (``Utils.initialize_model_parallel(tp, pp)``), DP the rest."""
    from tests.megatron_models import use_layout

    use_layout(MegatronLayout(tp=tp, pp=pp))


def _save(state: Any, path: str, **kwargs: Any) -> Any:
    from megatron.core import dist_checkpointing

    import reshard.interop.megatron  # noqa: F401  (registers the strategies)

    return dist_checkpointing.save(state, path, sharded_strategy=("reshard", 1), **kwargs)


def _load(state: Any, path: str, **kwargs: Any) -> Any:
    from megatron.core import dist_checkpointing

    import reshard.interop.megatron  # noqa: F401

    return dist_checkpointing.load(state, path, **kwargs)


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The warnings logged in this rank process while active (Megatron's ``caplog.at_level(WARNING)``)."""
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        yield messages
    finally:
        logging.getLogger().removeHandler(handler)


def _no_diff(a: Any, b: Any) -> bool:
    from megatron.core.dist_checkpointing.dict_utils import diff

    return not any(map(bool, diff(a, b)))


# ---- test_serialization.py: TestSerialization -------------------------------------------------------------


def rank_single_process_save_load(ctx: RankContext, path: str) -> tuple[list[str], list[int]]:
    """test_single_process_save_load (without its DTensor on a CUDA mesh)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    _layout()
    state = {
        "sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.ones(2, 4), replica_id=ctx.rank),
        "sd_keyB": ShardedTensor.from_rank_offsets("keyB", torch.ones(3, 5, 7), replica_id=ctx.rank),
    }
    _save(state, path)
    loaded = _load(
        {"load_sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.zeros(2, 4), replica_id=ctx.rank)}, path
    )
    assert torch.equal(loaded["load_sd_keyA"], torch.ones(2, 4))
    return sorted(loaded), list(loaded["load_sd_keyA"].shape)


def test_single_process_save_load(pool4: RankPool, tmp_path: Path) -> None:
    assert pool4.run_ok(rank_single_process_save_load, str(tmp_path)) == [(["load_sd_keyA"], [2, 4])] * WORLD


def rank_multi_process_save(ctx: RankContext, path: str) -> dict[str, Any]:
    """test_multi_process_save (preprocess_common_before_consistancy_check), loaded back."""
    from megatron.core.dist_checkpointing import ShardedTensor

    _layout(2, 2)
    rank, world = ctx.rank, ctx.world_size

    def state(fill: float) -> dict[str, Any]:
        return {
            "sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.full((2, 4), fill), (0, rank, world)),
            "sd_keyB": ShardedTensor.from_rank_offsets("keyB", torch.full((3, 5, 7), fill), (2, rank, world)),
        }

    def preprocess_fn(x: dict[str, Any]) -> dict[str, Any]:
        del x["rank"]
        return x

    full = {**state(rank + 1.0), "lr": 0.01, "rank": rank}
    _save(full, path, validate_access_integrity=True, preprocess_common_before_consistancy_check=preprocess_fn)
    loaded = _load(state(0.0), path)
    assert torch.all(loaded["sd_keyA"] == rank + 1) and torch.all(loaded["sd_keyB"] == rank + 1)
    return {"lr": loaded["lr"]}


def test_multi_process_save(pool4: RankPool, tmp_path: Path) -> None:
    assert pool4.run_ok(rank_multi_process_save, str(tmp_path)) == [{"lr": 0.01}] * WORLD


def rank_multi_process_save_log_difference(ctx: RankContext, path: str) -> list[str]:
    """test_multi_process_save_log_difference: Megatron's check of the common state logs the difference."""
    from megatron.core.dist_checkpointing import ShardedTensor

    _layout(2, 2)
    rank, world = ctx.rank, ctx.world_size
    state = {
        "sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.ones(2, 4), (0, rank, world)),
        "sd_keyB": ShardedTensor.from_rank_offsets("keyB", torch.ones(3, 5, 7), (2, rank, world)),
        "rank": rank,
    }
    with _warnings() as messages:
        _save(state, path, validate_access_integrity=True, preprocess_common_before_consistancy_check=lambda x: x)
    return [m for m in messages if "common state dict differs" in m]


def test_multi_process_save_log_difference(pool4: RankPool, tmp_path: Path) -> None:
    results = pool4.run_ok(rank_multi_process_save_log_difference, str(tmp_path))
    assert results[0] == []
    for rank in range(1, WORLD):
        assert results[rank] == [
            f"Rank {rank} common state dict differs from rank 0 common state dict. Keys only on rank 0: [], "
            f"Keys only on {rank}: [], Mismatched keys: [(('rank',), <class 'int'>, <class 'int'>)]"
        ]


def rank_partition_change_save_load(ctx: RankContext, path: str) -> bool:
    """test_partition_change_save_load: saved on TP=2 x PP=2, loaded whole, then on TP=1 x PP=2 (DP=2)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor

    _layout(2, 2)
    tp, pp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    rank, world = ctx.rank, ctx.world_size
    ten_a_global = torch.tensor([[0, 1], [10, 11]])  # (2, 2): 10 * tp + pp
    ten_a = torch.zeros(1, 1) + 10 * tp + pp
    ten_b = torch.zeros(4, 5, 10) + (torch.arange(10) + 10 * rank)  # (4, 5, 40): (x, y, z) is 100x + z
    ten_b += torch.arange(4).unsqueeze(-1).unsqueeze(-1) * 100
    state = {
        "sd_keyA": ShardedTensor.from_rank_offsets("keyA", ten_a, (0, tp, 2), (1, pp, 2), replica_id=0),
        "sd_keyB": ShardedTensor.from_rank_offsets("keyB", ten_b, (2, rank, world)),
    }
    _save(state, path)
    whole = {
        "sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.empty(2, 2), replica_id=rank),
        "sd_keyB": ShardedTensor.from_rank_offsets("keyB", torch.empty(4, 5, 40), replica_id=rank),
    }
    loaded = _load(whole, path)
    assert torch.all(loaded["sd_keyA"] == ten_a_global)
    expected_b = torch.arange(40).expand(4, 5, 40) + 100 * torch.arange(4).view(4, 1, 1)
    assert torch.all(loaded["sd_keyB"] == expected_b)

    _layout(1, 2)  # TP=1 x PP=2 x DP=2
    dp, pp = parallel_state.get_data_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()
    other = {
        "sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.empty(2, 1), (1, dp, 2), replica_id=pp),
        # (Megatron's test reads each of 4 x-slices on 2 of 8 ranks; here each of 4 ranks reads one.)
        "sd_keyB": ShardedTensor.from_rank_offsets("keyB", torch.empty(5, 40), (0, rank, 4), prepend_axis_num=1),
    }
    loaded = _load(other, path)
    assert torch.all(loaded["sd_keyA"][:, 0] == ten_a_global[:, dp])
    assert loaded["sd_keyB"].shape == (5, 40)
    return bool(torch.all(loaded["sd_keyB"] == torch.arange(40).expand(5, 40) + rank * 100))


def test_partition_change_save_load(pool4: RankPool, tmp_path: Path) -> None:
    assert pool4.run_ok(rank_partition_change_save_load, str(tmp_path)) == [True] * WORLD


def rank_load_tensors_metadata(ctx: RankContext, path: str) -> list[float]:
    """test_load_tensors_metadata."""
    from megatron.core.dist_checkpointing import ShardedTensor, load_tensors_metadata

    rank, world = ctx.rank, ctx.world_size
    state = {
        "sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.arange(10) + rank * 10, (0, rank, world)),
        "sd_keyB": ShardedTensor.from_rank_offsets("keyB", torch.ones(3, 5, 7), (2, rank, world)),
    }
    _save(state, path)
    metadata = load_tensors_metadata(path)
    assert "keyA" in metadata and "sd_keyA" not in metadata  # keys are ShardedTensor keys
    assert metadata["keyA"].global_shape == metadata["keyA"].local_shape == (10 * world,)
    assert metadata["keyB"].global_shape == metadata["keyB"].local_shape == (3, 5, 7 * world)
    assert metadata["keyA"].global_offset == (0,) and metadata["keyB"].global_offset == (0, 0, 0)
    assert metadata["keyA"].axis_fragmentations == (1,) and metadata["keyB"].axis_fragmentations == (1, 1, 1)
    assert metadata["keyA"].replica_id == 0 and metadata["keyB"].replica_id == 0
    loaded = _load(metadata, path, validate_access_integrity=False)  # every rank's replica 0 overlaps
    assert torch.all(loaded["keyA"] == torch.arange(10 * world))
    return loaded["keyA"].tolist()


def test_load_tensors_metadata(pool4: RankPool, tmp_path: Path) -> None:
    assert pool4.run_ok(rank_load_tensors_metadata, str(tmp_path)) == [list(range(10 * WORLD))] * WORLD


def rank_can_mix_sharded_tensors_and_factories(ctx: RankContext, path: str) -> bool:
    """test_can_mix_sharded_tensors_and_factories."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    _layout()

    def build_fn(key: str, tensor: torch.Tensor, replica_id: Any, flattened_range: Any) -> list[Any]:
        assert flattened_range is None
        return [ShardedTensor.from_rank_offsets(key + f"part{i}", tensor, replica_id=replica_id) for i in (1, 2, 3)]

    def state(base: int) -> dict[str, Any]:
        return {
            "all": [
                ShardedTensor.from_rank_offsets("A", torch.arange(2) + base, replica_id=ctx.rank),
                ShardedTensor.from_rank_offsets("B", torch.arange(3) + base, replica_id=ctx.rank),
                ShardedTensor.from_rank_offsets("C", torch.arange(4) + base, replica_id=ctx.rank),
                ShardedTensorFactory("D", torch.arange(5) + base, build_fn, sum, replica_id=ctx.rank),
            ]
        }

    _save(state(0), path)
    loaded = _load(state(10), path)
    expected = {"all": [torch.arange(2), torch.arange(3), torch.arange(4), torch.arange(5) * 3]}
    return _no_diff(loaded, expected)


def test_can_mix_sharded_tensors_and_factories(pool4: RankPool, tmp_path: Path) -> None:
    assert pool4.run_ok(rank_can_mix_sharded_tensors_and_factories, str(tmp_path)) == [True] * WORLD


def rank_load_error_msg(ctx: RankContext, missing: str, empty: str) -> list[tuple[str, bool]]:
    """test_load_error_msg: a missing directory, one that is not a checkpoint, and a key the checkpoint lacks
    raise CheckpointingException with Megatron's words (the last one from the strategy)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException

    _layout()
    sh_ten = ShardedTensor.from_rank_offsets("keyA", torch.rand(10), replica_id=ctx.rank)
    state = {"some_key": sh_ten}
    out = []
    for path, words in ((missing, f"directory {missing} does not exist"), (empty, "is not a distributed checkpoint")):
        with pytest.raises(CheckpointingException) as exc_info:
            _load(state, path)
        out.append((type(exc_info.value).__name__, words in str(exc_info.value)))
    _save(state, empty)
    sh_ten.key = "different_key"
    with pytest.raises(CheckpointingException) as exc_info:
        _load(state, empty)
    out.append((type(exc_info.value).__name__, "different_key" in str(exc_info.value)))
    return out


def test_load_error_msg(pool4: RankPool, tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    results = pool4.run_ok(rank_load_error_msg, str(tmp_path / "non-existent"), str(tmp_path / "ckpt"))
    expected = [("CheckpointingException", True), ("CheckpointingException", True), ("MismatchError", True)]
    assert results == [expected] * WORLD


def rank_sharded_object_serialization(ctx: RankContext, path: str) -> Any:
    """test_sharded_object_serialization: an io.BytesIO object (torch.save inside) comes back as io.BytesIO."""
    from megatron.core.dist_checkpointing import ShardedObject

    _layout()
    serialized = io.BytesIO()
    torch.save({"some": "dict"}, serialized)
    _save({"some_key": ShardedObject("sh_obj_A", serialized, (1,), (0,), replica_id=ctx.rank)}, path)
    other = io.BytesIO()
    torch.save({"other": "dictionary"}, other)
    loaded = _load({"other_key": ShardedObject("sh_obj_A", other, (1,), (0,), replica_id=ctx.rank)}, path)
    assert "other_key" in loaded
    loaded["other_key"].seek(0)
    return torch.load(loaded["other_key"])


def test_sharded_object_serialization(pool4: RankPool, tmp_path: Path) -> None:
    assert pool4.run_ok(rank_sharded_object_serialization, str(tmp_path)) == [{"some": "dict"}] * WORLD


def rank_tensor_shape_mismatch(ctx: RankContext, path: str) -> bool:
    """test_tensor_shape_mismatch on TP=2 x PP=2: (2, 16) saved (Megatron's: (2, 32) on 8 ranks); a rigid
    tensor of another global shape is refused, a flexible one loads the overlap, zeros beyond."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException

    _layout(2, 2)
    rank, world = ctx.rank, ctx.world_size
    local = torch.arange(4).unsqueeze(0).expand(2, 4) + rank * 4
    state = {
        "rigid": ShardedTensor.from_rank_offsets("keyA", local, (1, rank, world)),
        "flexible": ShardedTensor.from_rank_offsets("keyB", local, (1, rank, world), allow_shape_mismatch=True),
    }
    assert state["rigid"].global_shape == state["flexible"].global_shape == (2, 16)
    _save(state, path)
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank, tp_rank = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_rank(),
    )

    def tensor(key: str, cols: int, **kwargs: Any) -> dict[str, Any]:
        name = "keyA" if key == "rigid" else "keyB"
        sharded = ShardedTensor.from_rank_offsets(
            name, torch.ones(2, cols), (1, pp_rank, pp_size), replica_id=tp_rank, **kwargs
        )
        return {key: sharded}

    for cols in (7, 9):  # smaller coverage (14 < 16), larger (18 > 16)
        with pytest.raises(CheckpointingException):
            _load(tensor("rigid", cols), path)
        loaded = _load(tensor("flexible", cols, allow_shape_mismatch=True), path)["flexible"]
        expected = torch.arange(cols).unsqueeze(0).expand(2, cols) + pp_rank * cols
        if cols == 9 and pp_rank >= 16 // 9:
            expected = expected.clone()
            expected[:, 16 - 9 * pp_rank :] = 0  # padding with 0s
        assert torch.all(loaded == expected), (cols, loaded, expected)
    return True


def test_tensor_shape_mismatch(pool4: RankPool, tmp_path: Path) -> None:
    assert pool4.run_ok(rank_tensor_shape_mismatch, str(tmp_path)) == [True] * WORLD


def rank_empty_load(ctx: RankContext, path: str) -> tuple[list[str], list[float] | None]:
    """test_empty_load: ranks with nothing sharded (and common values that only rank 0 saves)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    _layout(2, 2)
    state: dict[str, Any]
    if ctx.rank == 0:
        state = {"common": "common-value"}
    elif ctx.rank == 1:
        state = {"a": 3}  # not saved at all (common saved by rank 0 only)
    elif ctx.rank == 2:
        state = {"b": 3}
    else:
        state = {"a": ShardedTensor.from_rank_offsets("x", torch.ones(2) * ctx.rank, replica_id=ctx.rank - 3)}
    _save(state, path)
    if ctx.rank == 3:
        state["a"].data.zero_()
    loaded = _load(state, path)
    assert loaded["common"] == "common-value"
    return sorted(loaded), loaded["a"].tolist() if "a" in loaded else None


def test_empty_load(pool4: RankPool, tmp_path: Path) -> None:
    results = pool4.run_ok(rank_empty_load, str(tmp_path))
    assert results == [(["common"], None)] * 3 + [(["a", "common"], [3.0, 3.0])]  # rank 3 held the main replica


def rank_content_metadata(ctx: RankContext, path: str, content_metadata: dict[str, Any]) -> tuple[Any, Any]:
    """test_content_metadata_load_from_checkpoint and test_content_metadata_load_from_state_dict."""
    from megatron.core.dist_checkpointing import load_content_metadata

    _layout()
    state = {"common": (3, 5, 7)}
    _save(state, path, content_metadata=content_metadata)
    from_checkpoint = load_content_metadata(path)
    from_state_dict = load_content_metadata(preloaded_state_dict=_load(state, path))
    return from_checkpoint, from_state_dict


@pytest.mark.parametrize("content_metadata", [{"a": 3}, {"nested": {"a": 3}, "flat": (5, {6: None})}, {}])
def test_content_metadata(pool4: RankPool, tmp_path: Path, content_metadata: dict[str, Any]) -> None:
    results = pool4.run_ok(rank_content_metadata, str(tmp_path), content_metadata)
    assert results == [(content_metadata, content_metadata)] * WORLD


def _split_content(split: list[int], content_split: list[int]) -> torch.Tensor:
    """Megatron's content of an uneven 1-D split: the element at global index i holds the rank that owns i in
    ``content_split`` (the split the test loads into)."""
    total = sum(split)
    data = torch.zeros(total)
    for idx in torch.cumsum(torch.tensor(content_split), 0):
        if idx < total:
            data[idx] += 1
    return data.cumsum(0)


def rank_uneven_1d_sharding(ctx: RankContext, path: str, src: list[int], dest: list[int]) -> bool:
    """test_uneven_1d_sharding: one uneven 1-D shard per rank (empty ones included), loaded into another split."""
    from megatron.core.dist_checkpointing import ShardedTensor

    _layout(2, 2)

    def shard(split: list[int], data: torch.Tensor | None) -> Any:
        offset, size = sum(split[: ctx.rank]), split[ctx.rank]
        local = torch.zeros(size) if data is None else data[offset : offset + size].clone()
        return ShardedTensor("a", local, local.dtype, (size,), (sum(split),), (offset,), None)

    _save({"a": shard(src, _split_content(src, dest))}, path)
    loaded = _load({"a": shard(dest, None)}, path)
    return bool(torch.all(loaded["a"] == ctx.rank))


UNEVEN = [
    ([3] * 4, None),
    ([1, 5, 7, 3], None),
    ([2, 2, 2, 10], None),
    ([3] * 4, [1, 1, 2, 8]),
    ([1, 5, 7, 3], [9, 3, 3, 1]),
    ([5, 5, 0, 0], [5, 0, 2, 3]),  # empty shards
    ([10, 0, 0, 0], [0, 0, 5, 5]),
]


@pytest.mark.parametrize(("src", "dest"), UNEVEN)
def test_uneven_1d_sharding(pool4: RankPool, tmp_path: Path, src: list[int], dest: list[int] | None) -> None:
    dest = src if dest is None else dest
    assert pool4.run_ok(rank_uneven_1d_sharding, str(tmp_path), src, dest) == [True] * WORLD


def rank_uneven_1d_sharding_multiple_shards(
    ctx: RankContext, path: str, src: list[list[int]], dest: list[list[int]]
) -> bool:
    """test_uneven_1d_sharding_multiple_shards: several uneven shards per rank, in dicts keyed by integers."""
    from megatron.core.dist_checkpointing import ShardedTensor

    _layout(2, 2)

    def shards(split: list[list[int]], data: torch.Tensor | None) -> dict[int, Any]:
        total = sum(map(sum, split))
        offset = sum(map(sum, split[: ctx.rank]))
        out = {}
        for i, size in enumerate(split[ctx.rank]):
            local = torch.zeros(size) if data is None else data[offset : offset + size].clone()
            out[i] = ShardedTensor("a", local, local.dtype, (size,), (total,), (offset,), None)
            offset += size
        return out

    content = _split_content([sum(s) for s in src], [sum(s) for s in dest])
    _save(shards(src, content), path)
    loaded = _load(shards(dest, None), path)
    return all(bool(torch.all(t == ctx.rank)) for t in loaded.values())


UNEVEN_MULTIPLE = [
    ([[3]] * 4, None),
    ([[]] * 3 + [[3, 3]], None),
    ([[4], [7, 8], [1], [3, 3]], None),
    ([[2]] * 2 + [[10]] * 2, [[10]] * 2 + [[2]] * 2),
    ([[4], [7, 8], [1], [3, 3]], [[2, 4], [], [5, 9], [1, 1, 1, 1, 1, 1]]),
    ([[3]] * 4, [[2, 4]] * 2 + [[]] * 2),
]


@pytest.mark.parametrize(("src", "dest"), UNEVEN_MULTIPLE)
def test_uneven_1d_sharding_multiple_shards(
    pool4: RankPool, tmp_path: Path, src: list[list[int]], dest: list[list[int]] | None
) -> None:
    dest = src if dest is None else dest
    assert pool4.run_ok(rank_uneven_1d_sharding_multiple_shards, str(tmp_path), src, dest) == [True] * WORLD


# ---- test_serialization.py: TestNonStrictLoad -------------------------------------------------------------


def _non_strict_base(rank: int, world: int) -> dict[str, Any]:
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    return {
        "TenA": ShardedTensor.from_rank_offsets("TenA", torch.arange(2), replica_id=rank),
        "TenB": ShardedTensor.from_rank_offsets("TenB", torch.arange(3), (0, rank, world), replica_id=0),
        "TenC": ShardedTensor.from_rank_offsets("TenC", torch.arange(3), replica_id=world - rank - 1),
        "ObjA": ShardedObject("ObjA", list(range(10)), (1,), (0,), replica_id=rank),
        "ObjB": ShardedObject("ObjB", [rank + 7], (1, world), (0, rank), replica_id=0),  # a set in Megatron
    }


def rank_non_strict_load(ctx: RankContext, path: str, case: str, validate_integrity: bool) -> dict[str, Any]:
    """TestNonStrictLoad.test_unexpected_keys_handling_during_validation, test_missing_keys_raises_error_during_
    validation and test_exact_load_handling: per StrictHandling mode, what Megatron's load gives (the keys
    loaded, the missing and unexpected keys it returns, the words of what it raises or logs)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling

    _layout(2, 2)
    rank, world = ctx.rank, ctx.world_size
    _save(_non_strict_base(rank, world), path)

    def template() -> dict[str, Any]:
        state = _non_strict_base(rank, world)
        if case == "unexpected":
            state["TenD"] = ShardedTensor.from_rank_offsets("UnexpectedTenD", torch.arange(3), replica_id=rank)
            state["ObjD"] = ShardedObject("UnexpectedObjD", None, (1,), (0,), replica_id=rank)
        elif case == "missing":
            del state["TenA"], state["ObjB"]
        return state

    out: dict[str, Any] = {}
    for strict in StrictHandling:
        with _warnings() as messages:
            try:
                result = _load(template(), path, validate_access_integrity=validate_integrity, strict=strict)
            except CheckpointingException as exc:
                out[strict.value] = {"raised": str(exc)}
                continue
        loaded = result[0] if isinstance(result, tuple) else result
        out[strict.value] = {"keys": sorted(loaded), "logged": " ".join(messages)}
        if isinstance(result, tuple):
            out[strict.value].update(missing=sorted(result[1]), unexpected=sorted(result[2]))
        assert torch.equal(loaded["TenB"], torch.arange(3))  # this rank's shard
    return out


def _check_error(text: str, *, unexpected: bool) -> None:
    if unexpected:
        assert "Unexpected keys" in text and "UnexpectedTenD" in text and "UnexpectedObjD" in text, text
        assert "Missing keys" not in text, text
    else:
        assert "Unexpected keys" not in text and "TenA" in text and "ObjB" in text and "Missing keys" in text, text


@pytest.mark.parametrize("validate_integrity", [True, False])
def test_unexpected_keys_handling_during_validation(pool4: RankPool, tmp_path: Path, validate_integrity: bool) -> None:
    for r in pool4.run_ok(rank_non_strict_load, str(tmp_path), "unexpected", validate_integrity):
        # ASSUME_OK_UNEXPECTED: the strategy raises (a CheckpointingException, where torch_dist raises DCP's own)
        assert "UnexpectedTenD" in r["assume_ok_unexpected"]["raised"]
        _check_error(r["raise_unexpected"]["raised"], unexpected=True)
        _check_error(r["raise_all"]["raised"], unexpected=True)
        for mode in ("log_unexpected", "log_all"):
            assert "TenA" in r[mode]["keys"]
            _check_error(r[mode]["logged"], unexpected=True)
        for mode in ("return_unexpected", "return_all"):
            assert "TenA" in r[mode]["keys"]
            assert r[mode]["unexpected"] == ["UnexpectedObjD", "UnexpectedTenD"] and r[mode]["missing"] == []
        assert "TenA" in r["ignore_all"]["keys"]


@pytest.mark.parametrize("validate_integrity", [True, False])
def test_missing_keys_raises_error_during_validation(pool4: RankPool, tmp_path: Path, validate_integrity: bool) -> None:
    for r in pool4.run_ok(rank_non_strict_load, str(tmp_path), "missing", validate_integrity):
        for mode in ("assume_ok_unexpected", "raise_unexpected", "log_unexpected", "ignore_all"):
            assert "TenB" in r[mode]["keys"] and r[mode]["logged"] == "", mode
        assert r["return_unexpected"]["missing"] == [] and r["return_unexpected"]["unexpected"] == []
        _check_error(r["raise_all"]["raised"], unexpected=False)
        assert "TenB" in r["log_all"]["keys"]
        _check_error(r["log_all"]["logged"], unexpected=False)
        assert r["return_all"]["unexpected"] == [] and r["return_all"]["missing"] == ["ObjB", "TenA"]


@pytest.mark.parametrize("validate_integrity", [True, False])
def test_exact_load_handling(pool4: RankPool, tmp_path: Path, validate_integrity: bool) -> None:
    for r in pool4.run_ok(rank_non_strict_load, str(tmp_path), "exact", validate_integrity):
        for mode, result in r.items():
            assert "TenB" in result["keys"] and "ObjB" in result["keys"] and result["logged"] == "", mode
            if mode.startswith("return"):
                assert result["missing"] == [] and result["unexpected"] == [], mode


def rank_sharded_metadata(ctx: RankContext, path: str) -> dict[str, Any]:
    """TestNonStrictLoad.test_sharded_metadata: load_sharded_metadata, then a load of exactly that."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    _layout(2, 2)
    world = ctx.world_size
    _save(_non_strict_base(ctx.rank, world), path)
    metadata = load_sharded_metadata(path)
    loaded = _load(metadata, path, validate_access_integrity=False)
    assert loaded["ObjA/shard_0_1"] == list(range(10))
    for shard in range(world):
        assert loaded[f"ObjB/shard_0.{shard}_1.{world}"] == [shard + 7]
    assert torch.equal(loaded["TenA"], torch.arange(2)) and torch.equal(loaded["TenC"], torch.arange(3))
    assert torch.equal(loaded["TenB"], torch.arange(3).repeat(world))
    return {"keys": sorted({v.key for v in metadata.values()}), "unique": sorted(metadata)}


def test_sharded_metadata(pool4: RankPool, tmp_path: Path) -> None:
    expected = {
        "keys": ["ObjA", "ObjB", "TenA", "TenB", "TenC"],
        "unique": sorted(["TenA", "TenB", "TenC", "ObjA/shard_0_1", *(f"ObjB/shard_0.{i}_1.4" for i in range(4))]),
    }
    assert pool4.run_ok(rank_sharded_metadata, str(tmp_path)) == [expected] * WORLD


# ---- test_fully_parallel.py: TestFullyParallelSaveAndLoad -------------------------------------------------


def _fully_parallel_state(rank: int, world: int, *, saving: bool) -> dict[str, Any]:
    """TestFullyParallelSaveAndLoad.get_sharded_state_dict on TP=2 x DP=2, with distinct values (Megatron's are
    ones) so that a misplaced load is caught: each global tensor is ``arange + 10000 * i``; zeros to load into."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor

    tp, tp_size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    dp = parallel_state.get_data_parallel_rank(with_context_parallel=True)

    def data(i: int, size: int, offset: int) -> torch.Tensor:
        return torch.arange(offset, offset + size, dtype=torch.float32) + 10000 * i if saving else torch.zeros(size)

    tp_split = (0, tp, tp_size)
    return {
        "sd_key_tp_repl1": ShardedTensor.from_rank_offsets(
            "key_TP_repl1", data(1, 10, 10 * tp), tp_split, replica_id=dp
        ),
        "sd_key_tp_repl2": ShardedTensor.from_rank_offsets(
            "key_TP_repl2", data(2, 10, 10 * tp), tp_split, replica_id=dp
        ),
        "sd_keyB": ShardedTensor.from_rank_offsets("keyB", data(3, 20, 20 * rank), (0, rank, world)),
        "sd_keyE_no_C": ShardedTensor.from_rank_offsets("keyC", data(4, 100, 0), replica_id=rank),
        "sd_keyX_no_D": ShardedTensor.from_rank_offsets("keyD", data(5, 1000, 0), replica_id=rank),
        "sd_keyC_no_E": ShardedTensor.from_rank_offsets("keyE", data(6, 100, 0), replica_id=rank),
    }


def _main_ranks(distribution: Any) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for (key, *_), rank in distribution.main_rank_for_shard.items():
        out.setdefault(key, []).append(rank)
    return {key: sorted(ranks) for key, ranks in out.items()}


def rank_save_and_load_distribution(ctx: RankContext, path: str, along_dp: bool) -> dict[str, Any]:
    """test_save_distribution and test_load_distribution with the reshard strategy in the wrappers (Megatron's
    use mock strategies that record what they are asked for): the wrappers' distributions, the keys each rank's
    strategy is asked to save (its main replicas) and to load, and the values loaded (bit-exact)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.base import StrategyAction, get_default_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
        FullyParallelSaveStrategyWrapper,
    )
    from megatron.core.dist_checkpointing.utils import _sharded_tensor_shard_id

    from reshard.interop.megatron import ReshardLoadStrategy
    from tests.megatron_models import cpu_synchronize

    _layout(2, 1)
    group = parallel_state.get_data_parallel_group(with_context_parallel=True) if along_dp else dist.group.WORLD
    state = _fully_parallel_state(ctx.rank, ctx.world_size, saving=True)
    expected = {k: v.data.clone() for k, v in state.items()}
    save_strategy = FullyParallelSaveStrategyWrapper(
        get_default_strategy(StrategyAction.SAVE_SHARDED, "reshard", 1), group, do_cache_distribution=True
    )
    dist_checkpointing.save(state, path, sharded_strategy=save_strategy)
    saved = _main_ranks(save_strategy.cached_distribution)
    in_group = save_strategy.cached_distribution.shards_in_this_group
    saving = sorted(v.key for v in state.values() if _sharded_tensor_shard_id(v) in in_group and v.replica_id == 0)

    asked: set[str] = set()

    class Recording(ReshardLoadStrategy):  # the real strategy, which also notes what it is asked to load
        def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
            asked.update(v.key for v in nested_values(sharded_state_dict) if is_main_replica(v.replica_id))
            return super().load(sharded_state_dict, checkpoint_dir)

    assert isinstance(get_default_load_sharded_strategy(path), ReshardLoadStrategy)  # what metadata.json names
    load_strategy = FullyParallelLoadStrategyWrapper(
        Recording(), group, do_cache_distribution=True, exchange_algo="gather_object"
    )
    template = _fully_parallel_state(ctx.rank, ctx.world_size, saving=False)
    with cpu_synchronize():
        loaded = _load(template, path, sharded_strategy=load_strategy)
    assert loaded.keys() == template.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected), [
        k for k in expected if not torch.equal(loaded[k], expected[k])
    ]
    return {
        "saved": saved,
        "saving": saving,
        "loaded": _main_ranks(load_strategy.cached_distribution),
        "asked": sorted(asked),
    }


def _ranks_of(mapping: dict[str, list[int]], rank: int) -> list[str]:
    return sorted(key for key, ranks in mapping.items() if rank in ranks)


@pytest.mark.parametrize("along_dp", [False, True])
def test_save_and_load_distribution(pool4: RankPool, tmp_path: Path, along_dp: bool) -> None:
    """Megatron's expected distributions, scaled from 8 ranks (TP=2 x DP=4) to 4 (TP=2 x DP=2): lowest coverage
    first, then the largest tensor, then the shard id; across DP groups (along_dp), a load assigns the shards
    whose main replica is in another group last."""
    results = pool4.run_ok(rank_save_and_load_distribution, str(tmp_path), along_dp)
    world = {
        "keyB": [0, 1, 2, 3],
        "key_TP_repl1": [0, 1],
        "key_TP_repl2": [2, 3],
        "keyD": [0],
        "keyC": [1],
        "keyE": [2],
    }
    tp0 = {"keyB": [0, 1], "keyD": [0], "keyC": [1], "keyE": [1], "key_TP_repl1": [1], "key_TP_repl2": [1]}
    tp1_save = {"keyB": [0, 1], "key_TP_repl1": [0], "key_TP_repl2": [1]}
    tp1_load = {**tp1_save, "keyD": [0], "keyC": [1], "keyE": [1]}  # keyC, D, E: main replicas in the other group
    for rank, r in enumerate(results):
        if not along_dp:
            save, load, me = world, world, rank
        else:
            save, load, me = (tp0, tp0, rank // 2) if rank % 2 == 0 else (tp1_save, tp1_load, rank // 2)
        assert r["saved"] == save and r["loaded"] == load, (rank, r)
        assert r["saving"] == _ranks_of(save, me), (rank, r)
        assert r["asked"] == _ranks_of(load, me), (rank, r)


def rank_broadcast_sharded_objects(ctx: RankContext, path: str) -> tuple[list[str], dict[str, Any]]:
    """test_broadcast_sharded_objects: object i is main on rank i; each rank's strategy loads its own, and the
    wrapper hands every rank all of them."""
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    from reshard.interop.megatron import ReshardLoadStrategy
    from tests.megatron_models import cpu_synchronize

    rank, world = ctx.rank, ctx.world_size

    def state(value: bool) -> dict[str, Any]:
        return {
            f"Obj_{i}": ShardedObject(f"Obj_{i}", {"i": i} if value else None, (1,), (0,), replica_id=abs(rank - i))
            for i in range(world)
        }

    _save(state(True), path)
    asked: list[str] = []

    class Recording(ReshardLoadStrategy):
        def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
            asked.extend(v.key for v in nested_values(sharded_state_dict))
            return super().load(sharded_state_dict, checkpoint_dir)

    with cpu_synchronize():
        loaded = FullyParallelLoadStrategyWrapper(Recording(), None).load(state(False), path)
    return asked, loaded


def test_broadcast_sharded_objects(pool4: RankPool, tmp_path: Path) -> None:
    for rank, (asked, loaded) in enumerate(pool4.run_ok(rank_broadcast_sharded_objects, str(tmp_path))):
        assert asked == [f"Obj_{rank}"]
        assert loaded == {f"Obj_{i}": {"i": i} for i in range(WORLD)}


# ---- test_async_save.py ------------------------------------------------------------------------------------


def rank_async_is_equivalent_to_sync(ctx: RankContext, async_dir: str, sync_dir: str) -> bool:
    """test_async_is_equivalent_to_sync (the request finalised with execute_sync: AsyncCallsQueue needs CUDA)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    import reshard.interop.megatron  # noqa: F401

    _layout(2, 2)
    rank, world = ctx.rank, ctx.world_size
    state = {
        "sd_keyA": ShardedTensor.from_rank_offsets("keyA", torch.arange(8.0).view(2, 4), replica_id=rank),
        "sd_keyB": ShardedTensor.from_rank_offsets(
            "keyB", torch.arange(105.0).view(3, 5, 7), replica_id=world - rank - 1
        ),
    }
    request = dist_checkpointing.save(state, async_dir, sharded_strategy=("reshard", 1), async_sharded_save=True)
    _save(state, sync_dir)
    request.execute_sync()
    loaded_async, loaded_sync = _load(state, async_dir), _load(state, sync_dir)
    return _no_diff(loaded_async, loaded_sync) and torch.equal(
        loaded_async["sd_keyB"], torch.arange(105.0).view(3, 5, 7)
    )


def test_async_is_equivalent_to_sync(pool4: RankPool, tmp_path: Path) -> None:
    (tmp_path / "async").mkdir()
    (tmp_path / "sync").mkdir()
    results = pool4.run_ok(rank_async_is_equivalent_to_sync, str(tmp_path / "async"), str(tmp_path / "sync"))
    assert results == [True] * WORLD


# ---- models/test_mlp_glu.py --------------------------------------------------------------------------------


def _mlp(seed: int) -> Any:
    """initialize_mlp with the local layer spec (Megatron's uses Transformer Engine's) and CPU initialisation."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=parallel_state.get_pipeline_model_parallel_world_size(),
        hidden_size=12,
        num_attention_heads=4,
        use_cpu_initialization=True,
        gated_linear_unit=True,
    )
    return MLP(config, get_gpt_layer_local_spec().submodules.mlp.submodules)


def rank_mlp_glu_reconfiguration(
    ctx: RankContext, dir_a: str, dir_b: str, src: list[int], dest: list[int], singleton: bool
) -> bool:
    """TestParallelMLPWithGLU.test_parallel_reconfiguration_e2e: an MLP with GLU (a ShardedTensorFactory) saved on
    ``src`` (TP, PP), loaded into another model on ``dest`` and saved again; both checkpoints hold the same."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import load_plain_tensors
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    def metadata() -> dict[str, Any]:  # (the TE spec's layers add the DP group themselves, the local ones do not)
        return ensure_metadata_has_dp_cp_group({"singleton_local_shards": singleton})

    _layout(*src)
    prefix = f"{parallel_state.get_pipeline_model_parallel_rank()}."
    _save(_mlp(123).sharded_state_dict(prefix=prefix, metadata=metadata()), dir_a)
    _layout(*dest)
    mlp_b = _mlp(321)  # other weights: the load must replace them
    loaded = _load(mlp_b.sharded_state_dict(prefix=prefix, metadata=metadata()), dir_a)
    mlp_b.load_state_dict({k.removeprefix(prefix): v for k, v in loaded.items()})
    _save(mlp_b.sharded_state_dict(prefix=prefix, metadata=metadata()), dir_b)
    _layout()
    return _no_diff(load_plain_tensors(dir_a), load_plain_tensors(dir_b))


@pytest.mark.parametrize("singleton", [True, False])
@pytest.mark.parametrize(("src", "dest"), [((2, 2), (1, 2)), ((1, 1), (4, 1)), ((1, 4), (1, 4)), ((1, 1), (2, 1))])
def test_mlp_glu_parallel_reconfiguration(
    pool4: RankPool, tmp_path: Path, src: tuple[int, int], dest: tuple[int, int], singleton: bool
) -> None:
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    args = (str(tmp_path / "A"), str(tmp_path / "B"), list(src), list(dest), singleton)
    assert pool4.run_ok(rank_mlp_glu_reconfiguration, *args) == [True] * WORLD


# ---- test_optimizer.py: TestFP32Optimizer (and the 1-D model of TestOptimizerResharding) -------------------


def _optimizer_model(kind: str) -> Any:
    """SwigluFactoryModel (a TP-split linear in Megatron's GLU factory) or Model1dFlattenTensor (a 1-D TP-split
    parameter) of Megatron's test_optimizer.py, on the current layout."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    tp, tp_size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    replica = (
        parallel_state.get_pipeline_model_parallel_rank(),
        0,
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if kind == "swiglu":
                self.linear = torch.nn.Linear(5, 64 // tp_size, bias=False)
            else:
                self.weight_1d = torch.nn.Parameter(torch.randn(128 // tp_size))

        def sharded_state_dict(self) -> dict[str, Any]:
            state = self.state_dict(keep_vars=True)
            name = "linear.weight" if kind == "swiglu" else "weight_1d"
            state[name] = ShardedTensor.from_rank_offsets(name, state[name], (0, tp, tp_size), replica_id=replica)
            if kind == "swiglu":
                state[name] = apply_swiglu_sharded_factory(state[name], ())
            return state

    return Model()


def rank_fp32_optimizer_resharding(
    ctx: RankContext, dir_a: str, dir_b: str, src: list[int], dest: list[int], kind: str
) -> bool:
    """test_fp32_optimizer_resharding: the optimizer state saved on ``src`` (TP, PP), loaded on ``dest`` into
    another model's optimizer and saved again; both checkpoints hold the same tensors."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    from tests.megatron_models import build_optimizer

    metadata = {"distrib_optim_sharding_type": "fully_reshardable"}
    _layout(*src)
    torch.manual_seed(2)
    model_a = _optimizer_model(kind)
    optimizer_a = build_optimizer(model_a, filled=True)
    _save(optimizer_a.sharded_state_dict(model_a.sharded_state_dict(), metadata=metadata), dir_a)
    _layout(*dest)
    torch.manual_seed(3)
    model_b = _optimizer_model(kind)
    optimizer_b = build_optimizer(model_b)
    template = optimizer_b.sharded_state_dict(model_b.sharded_state_dict(), is_loading=True, metadata=metadata)
    optimizer_b.load_state_dict(_load(template, dir_a))
    _save(optimizer_b.sharded_state_dict(model_b.sharded_state_dict(), metadata=metadata), dir_b)
    _layout()
    plain_a, plain_b = load_plain_tensors(dir_a), load_plain_tensors(dir_b)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in plain_a), sorted(plain_a)
    return _no_diff(plain_a, plain_b)


@pytest.mark.parametrize("kind", ["swiglu", "1d"])
@pytest.mark.parametrize(("src", "dest"), [((2, 2), (2, 2)), ((2, 2), (4, 1)), ((4, 1), (1, 2))])
def test_fp32_optimizer_resharding(
    pool4: RankPool, tmp_path: Path, src: tuple[int, int], dest: tuple[int, int], kind: str
) -> None:
    (tmp_path / "A").mkdir()
    (tmp_path / "B").mkdir()
    args = (str(tmp_path / "A"), str(tmp_path / "B"), list(src), list(dest), kind)
    assert pool4.run_ok(rank_fp32_optimizer_resharding, *args) == [True] * WORLD
