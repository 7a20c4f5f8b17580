"""DTensor state dicts: save on a (2, 2) device mesh, load on (4,), on (1,) and into plain ShardedTensors.

The local index arithmetic (:func:`reshard.state.dtensor.local_index_runs`) is checked in one process against
torch's own splitting of index tensors, for many uneven, nested and strided cases. The multi-process tests
build every DTensor with ``distribute_tensor(..., src_data_rank=None)`` (torch cuts the local tensor, so
the layout under test is torch's, not reshard's) on the 4-rank gloo pool and compare every load bitwise
with the slice torch would hold. Device meshes that need new process groups are made once per pool (cached
in the rank's context), so test cases do not pile up groups.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import reshard
from reshard import ShardedTensor, ShardingError
from reshard.state.dtensor import dtensor_to_sharded, local_index_runs
from tests.rankpool import RankContext, RankFailure, RankPool

TIMEOUT = 60.0

# --- the index arithmetic, against torch's own splitting (one process) -----------------------------------


def torch_indices(
    length: int, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: list[Any]
) -> list[int]:
    """The global indices of a 1-d tensor of ``length`` held at ``coordinate``, cut by torch's placements
    left to right (Replicate leaves them as they are)."""
    index = torch.arange(length)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard | _StridedShard):
            pieces, _ = placement._split_tensor(index, mesh_shape[mesh_dim], with_padding=False, contiguous=False)
            index = pieces[coordinate[mesh_dim]]
    return [int(i) for i in index]


def expand(runs: tuple[tuple[int, int], ...]) -> list[int]:
    return [i for start, length in runs for i in range(start, start + length)]


def placement_choices() -> list[Any]:
    return [Replicate(), Shard(0), _StridedShard(0, split_factor=2), _StridedShard(0, split_factor=3)]


MESH_SHAPES = [(n,) for n in range(1, 5)] + list(itertools.product(range(1, 4), repeat=2)) + [(2, 3, 2), (3, 2, 2)]


@pytest.mark.dist  # in-process, but seconds: kept out of make test-fast
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
def test_local_index_runs_match_torch_splitting(mesh_shape: tuple[int, ...]) -> None:
    """Shard and _StridedShard nest left to right exactly as torch splits, on even, uneven and empty shards."""
    checked = 0
    for placements in itertools.product(placement_choices(), repeat=len(mesh_shape)):
        for length in (0, 1, 2, 5, 7, 9, 12):
            for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
                (runs,) = local_index_runs("x", (length,), mesh_shape, coordinate, list(placements))
                assert expand(runs) == torch_indices(length, mesh_shape, coordinate, list(placements)), (
                    placements,
                    length,
                    coordinate,
                )
                assert all(n > 0 for _, n in runs)
                checked += 1
    assert checked == 7 * 4 ** len(mesh_shape) * math.prod(mesh_shape)


@pytest.mark.unit
@pytest.mark.parametrize("global_shape", [(7, 5), (3, 11), (1, 4), (0, 3), (9, 9)], ids=str)
def test_local_box_matches_torch_local_shape_and_offset(global_shape: tuple[int, int]) -> None:
    """Shard/Replicate on 2-d meshes: the box is torch's (local shape, global offset) on every coordinate."""
    choices = [Replicate(), Shard(0), Shard(1)]
    for mesh_shape in [(2, 2), (3, 2), (2, 4), (4, 3)]:
        for placements in itertools.product(choices, repeat=2):
            for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
                runs = local_index_runs("x", global_shape, mesh_shape, coordinate, list(placements))
                shape, offset = _compute_local_shape_and_global_offset(
                    global_shape, mesh_shape, list(coordinate), list(placements)
                )
                assert all(len(r) <= 1 for r in runs)
                assert tuple(sum(n for _, n in r) for r in runs) == tuple(shape)
                if math.prod(shape):
                    assert tuple(r[0][0] for r in runs) == tuple(offset), (placements, mesh_shape, coordinate)


@pytest.mark.unit
def test_local_index_runs_follow_a_shard_order() -> None:
    """Tensor axis 0 cut by mesh dim 1 first, then mesh dim 0 (the order torch's redistribution uses)."""
    rows = {
        c: expand(local_index_runs("x", (7,), (2, 2), c, [Shard(0), Shard(0)], shard_order=[(0, (1, 0))])[0])
        for c in itertools.product(range(2), range(2))
    }
    assert rows == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6]}


@pytest.mark.unit
def test_partial_and_unknown_placements_are_refused_naming_the_key() -> None:
    with pytest.raises(ShardingError, match=r"'layers\.0\.w'.*Partial"):
        local_index_runs("layers.0.w", (4,), (2, 2), (0, 1), [Partial(), Shard(0)])
    with pytest.raises(ShardingError, match=r"'w'.*not supported"):
        local_index_runs("w", (4,), (2,), (0,), ["shard"])
    with pytest.raises(ShardingError, match="'w'"):
        local_index_runs("w", (4,), (2,), (0,), [Shard(1)])


# --- the layouts of the multi-process tests ----------------------------------------------------------------

MESH_2X2 = "reshard-test-mesh-2x2"

SAVE_LAYOUT: dict[str, tuple[tuple[int, ...], torch.dtype, list[Any]]] = {
    "a": ((7, 6), torch.float32, [Shard(0), Shard(1)]),  # uneven rows
    "b": ((5, 4), torch.float32, [Shard(0), Shard(0)]),  # axis 0 cut twice, nested and uneven
    "c": ((6, 3), torch.bfloat16, [Replicate(), Shard(1)]),  # replicated along mesh dim 0
    "d": ((3,), torch.float32, [Replicate(), Replicate()]),
    "e": ((3, 2), torch.float32, [Shard(0), Shard(0)]),  # coordinate (1, 1) holds zero rows
    "f": ((9, 2), torch.float32, [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP2 + TP, uneven
    "g": ((8, 3), torch.float32, [Shard(0), _StridedShard(0, split_factor=2)]),  # non-contiguous rows
    "h": ((), torch.float64, [Replicate(), Replicate()]),  # a scalar
}
EXTRA_KEY = "extra.rows"
EXTRA_SHAPE = (8, 5)
STEP = 11

LOAD_LAYOUT_4: dict[str, list[Any]] = {
    "b": [Shard(1)],
    "c": [Shard(0)],
    "d": [Shard(0)],  # 3 rows on 4 ranks: the last gets none
    "e": [Replicate()],
    "f": [Shard(1)],
    "g": [Shard(0)],
    "h": [Replicate()],
}
"""Keys loaded as DTensors on a (4,) mesh; "a" is loaded as plain ShardedTensors, EXTRA_KEY as a DTensor."""
A_ROWS_4 = [(0, 2), (2, 2), (4, 2), (6, 1)]


def global_value(key: str) -> torch.Tensor:
    shape, dtype = (EXTRA_SHAPE, torch.float32) if key == EXTRA_KEY else SAVE_LAYOUT[key][:2]
    seed = sum(map(ord, key))
    return (torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 0.25 + seed).to(dtype)


def mesh_2x2(ctx: RankContext) -> DeviceMesh:
    """The (2, 2) mesh over the pool's 4 ranks, made once per pool (its groups are collective to create)."""
    mesh = ctx.groups.get(MESH_2X2)
    if mesh is None:
        mesh = init_device_mesh("cpu", (2, 2))
        ctx.groups[MESH_2X2] = mesh
    return mesh


def mesh_4() -> DeviceMesh:
    return init_device_mesh("cpu", (4,))  # the default group: no new process group


def save_state_2x2(ctx: RankContext) -> dict[str, Any]:
    mesh = mesh_2x2(ctx)
    model = {
        key: distribute_tensor(global_value(key), mesh, placements, src_data_rank=None)
        for key, (_, _, placements) in SAVE_LAYOUT.items()
    }
    extra = ShardedTensor.from_rank_offsets(
        EXTRA_KEY, global_value(EXTRA_KEY)[2 * ctx.rank : 2 * ctx.rank + 2].clone(), (0, ctx.rank, 4)
    )
    return {"model": model, "extra": {"rows": extra}, "step": STEP}


# --- what runs on each rank ------------------------------------------------------------------------------


def rank_save_2x2(ctx: RankContext, path: str) -> list[str]:
    state = save_state_2x2(ctx)
    described = {k: dtensor_to_sharded(f"model.{k}", v) for k, v in state["model"].items()}
    # The non-contiguous strided shard is described as segments of axis 0.
    assert described["g"] is not None
    assert described["g"].segment_axis == 0
    assert described["g"].segments is not None
    assert len(described["g"].segments) == 2
    reshard.save(state, path, timeout=TIMEOUT)
    return sorted(reshard.read_metadata(path).tensors)


def rank_async_save_2x2(ctx: RankContext, path: str) -> None:
    """async_save snapshots the DTensors' local tensors: changing them after it returns changes nothing."""
    state = save_state_2x2(ctx)
    handle = reshard.async_save(state, path, timeout=TIMEOUT)
    for dtensor in state["model"].values():
        dtensor.to_local().fill_(-1)
    handle.wait(timeout=TIMEOUT)


def rank_load_4(ctx: RankContext, path: str) -> None:
    mesh = mesh_4()
    model: dict[str, Any] = {
        key: distribute_tensor(torch.zeros_like(global_value(key)), mesh, placements, src_data_rank=None)
        for key, placements in LOAD_LAYOUT_4.items()
    }
    model["b"] = torch.nn.Parameter(model["b"])  # a module's DTensor parameter, which requires grad
    start, length = A_ROWS_4[ctx.rank]
    model["a"] = ShardedTensor("model.a", torch.zeros(length, 6), (7, 6), (start, 0))
    extra = distribute_tensor(torch.zeros(EXTRA_SHAPE), mesh, [Shard(1)], src_data_rank=None)
    template = {"model": model, "extra": {"rows": extra}, "step": 0}
    pointers = {key: v.to_local().data_ptr() for key, v in model.items() if isinstance(v, DTensor)}
    result = reshard.load(template, path, timeout=TIMEOUT)
    assert result["step"] == STEP
    assert result["extra"]["rows"] is extra
    want = distribute_tensor(global_value(EXTRA_KEY), mesh, [Shard(1)], src_data_rank=None).to_local()
    assert torch.equal(extra.to_local(), want)
    assert torch.equal(result["model"]["a"], global_value("a")[start : start + length])
    for key, placements in LOAD_LAYOUT_4.items():
        got = result["model"][key]
        assert got is model[key], key  # the template's own DTensor, filled in place
        assert got.to_local().data_ptr() == pointers[key], key
        want = distribute_tensor(global_value(key), mesh, placements, src_data_rank=None).to_local()
        assert got.to_local().dtype == want.dtype
        assert torch.equal(got.to_local(), want), key
    assert isinstance(result["model"]["b"], torch.nn.Parameter)
    assert result["model"]["b"].requires_grad


def rank_load_1(ctx: RankContext, path: str) -> int | None:
    """Rank 0 alone, on a (1,) mesh of its own group: every tensor whole."""
    group, member = ctx.group_of_size(1)
    if not member:
        return None
    mesh = DeviceMesh.from_group(group, "cpu")
    template = {
        "model": {
            key: distribute_tensor(
                torch.zeros_like(global_value(key)), mesh, [Shard(0) if shape else Replicate()], src_data_rank=None
            )
            for key, (shape, _, _) in SAVE_LAYOUT.items()
        },
        "extra": {"rows": distribute_tensor(torch.zeros(EXTRA_SHAPE), mesh, [Replicate()], src_data_rank=None)},
    }
    result = reshard.load(template, path, group=group, timeout=TIMEOUT)
    for key in SAVE_LAYOUT:
        assert torch.equal(result["model"][key].to_local(), global_value(key)), key
    assert torch.equal(result["extra"]["rows"].to_local(), global_value(EXTRA_KEY))
    return len(SAVE_LAYOUT)


def rank_save_shard_order(ctx: RankContext, path: str) -> list[int]:
    """A DTensor whose spec cuts axis 0 by mesh dim 1 first: its rows are those torch's own all-gather
    puts back in place (checked with full_tensor), and they are saved where they belong."""
    mesh = mesh_2x2(ctx)
    value = torch.arange(14, dtype=torch.float32).reshape(7, 2)
    placements = (Shard(0), Shard(0))
    (rows, _) = local_index_runs("o", (7, 2), (2, 2), mesh.get_coordinate() or (), placements, [(0, (1, 0))])
    spec = DTensorSpec(
        mesh,
        placements,
        tensor_meta=TensorMeta(torch.Size((7, 2)), (2, 1), torch.float32),
        shard_order=(ShardOrderEntry(tensor_dim=0, mesh_dims=(1, 0)),),
    )
    dtensor = DTensor(value[expand(rows)].contiguous(), spec, requires_grad=False)
    assert torch.equal(dtensor.full_tensor(), value)
    reshard.save({"o": dtensor}, path, timeout=TIMEOUT)
    return expand(rows)


def rank_partial(ctx: RankContext, path: str, mode: str) -> None:
    mesh = mesh_2x2(ctx)
    partial = DTensor.from_local(torch.ones(2, 2), mesh, [Partial(), Shard(0)])
    state = {"layers": {"0": {"w": partial}}, "ok": torch.ones(2)}
    if mode == "save":
        reshard.save(state, path, timeout=TIMEOUT)
    else:
        reshard.load(state, path, timeout=TIMEOUT)


def rank_save_half(ctx: RankContext, path: str, placements_name: str) -> bool | None:
    """Save a (2, 2)-mesh DTensor with the group of mesh row 0 (ranks 0 and 1) only."""
    mesh = mesh_2x2(ctx)
    placements = {"replicated_rows": [Replicate(), Shard(1)], "sharded": [Shard(0), Shard(1)]}[placements_name]
    dtensor = distribute_tensor(global_value("a"), mesh, placements, src_data_rank=None)
    if ctx.rank >= 2:
        return None
    reshard.save({"a": dtensor}, path, group=ctx.groups["lower_half"], timeout=TIMEOUT)
    return True


# --- the tests ---------------------------------------------------------------------------------------------


def load_whole(path: Path) -> Any:
    """Every saved tensor whole, read in this (non-distributed) process."""
    template: dict[str, Any] = {
        "model": {key: torch.zeros_like(global_value(key)) for key in SAVE_LAYOUT},
        "extra": {"rows": torch.zeros(EXTRA_SHAPE)},
    }
    return reshard.load(template, path)


@pytest.mark.dist
def test_save_on_2x2_mesh_load_on_4_1_and_whole(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    keys = pool4.run_ok(rank_save_2x2, str(path))
    assert keys[0] == sorted([EXTRA_KEY, *(f"model.{k}" for k in SAVE_LAYOUT)])
    metadata = reshard.read_metadata(path)
    assert metadata.common == {"step": STEP}
    assert metadata.tensors["model.c"].dtype == "bfloat16"
    # The replicated and zero-row shards are written once: the stored boxes tile each tensor exactly.
    for key in SAVE_LAYOUT:
        stored = metadata.tensors[f"model.{key}"]
        assert sum(math.prod(b.shape) for b in stored.boxes) == math.prod(stored.global_shape), key
    assert len(metadata.tensors["model.d"].boxes) == 1
    assert len(metadata.tensors["model.e"].boxes) == 3
    whole = load_whole(path)
    for key in SAVE_LAYOUT:
        assert torch.equal(whole["model"][key], global_value(key)), key
    assert torch.equal(whole["extra"]["rows"], global_value(EXTRA_KEY))

    pool4.run_ok(rank_load_4, str(path))
    assert pool4.run_ok(rank_load_1, str(path)) == [len(SAVE_LAYOUT), None, None, None]


@pytest.mark.dist
def test_async_save_of_dtensors(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    pool4.run_ok(rank_async_save_2x2, str(path))
    whole = load_whole(path)
    for key in SAVE_LAYOUT:
        assert torch.equal(whole["model"][key], global_value(key)), key


@pytest.mark.dist
def test_shard_order_of_the_spec_is_followed(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    rows = pool4.run_ok(rank_save_shard_order, str(path))
    assert rows == [[0, 1], [4, 5], [2, 3], [6]]
    loaded = reshard.load({"o": torch.zeros(7, 2)}, path)
    assert torch.equal(loaded["o"], torch.arange(14, dtype=torch.float32).reshape(7, 2))


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["save", "load"])
def test_partial_placement_fails_on_every_rank_naming_the_key(pool4: RankPool, tmp_path: Path, mode: str) -> None:
    path = tmp_path / "ckpt"
    if mode == "load":
        reshard.save({"layers": {"0": {"w": torch.ones(4, 2)}}, "ok": torch.ones(2)}, path)
    results = pool4.run(rank_partial, str(path), mode)
    for result in results:
        assert isinstance(result, RankFailure)
        assert result.error_class == "ShardingError"
        assert "'layers.0.w'" in result.message
        assert "Partial" in result.message
        assert sorted(result.failures) == [0, 1, 2, 3]
    if mode == "save":
        assert not (path / "metadata.json").exists()


@pytest.mark.dist
def test_save_group_must_hold_the_primary_copies(pool4: RankPool, tmp_path: Path) -> None:
    """Mesh row 0 holds a whole replica of a (Replicate, Shard) DTensor, so it can save it alone; a DTensor
    sharded on both mesh dimensions leaves a gap, which save refuses on every rank of the group."""
    good = tmp_path / "good"
    assert pool4.run_ok(rank_save_half, str(good), "replicated_rows") == [True, True, None, None]
    assert torch.equal(reshard.load({"a": torch.zeros(7, 6)}, good)["a"], global_value("a"))
    bad = tmp_path / "bad"
    results = pool4.run(rank_save_half, str(bad), "sharded")
    assert results[2:] == [None, None]
    for result in results[:2]:
        assert isinstance(result, RankFailure)
        assert result.error_class == "ShardingError"
        assert "'a'" in result.message
    assert not (bad / "metadata.json").exists()


@pytest.mark.unit
def test_a_dtensor_module_still_being_imported_by_another_thread_holds_no_dtensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While one thread imports torch.distributed.tensor, the module is in sys.modules without its DTensor class yet;
    another thread flattening a state dict then asks whether a value is a DTensor: the answer is no, never an
    AttributeError (found as a contract-suite setup that failed when two flows prepared their checkpoints at once)."""
    import sys
    import types

    from reshard.state.dtensor import is_dtensor

    monkeypatch.setitem(sys.modules, "torch.distributed.tensor", types.ModuleType("torch.distributed.tensor"))
    assert is_dtensor(torch.zeros(2)) is False
