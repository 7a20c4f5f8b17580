"""The planners made to scale give exactly what the straightforward ones (``tests/oracle_planning.py``) give.

Layouts come from :mod:`reshard.testing.layouts` (a Megatron-style MoE transformer without tensor data),
whose descriptions are checked against reshard's own save and load paths on real (meta-device)
ShardedTensors first. Then, on a simulated 512-rank layout: the save plan (validation and writer
election), and, below in ``test_scale_metadata.py``, the metadata and the load plans of another layout.
The vectorised tiling check, the grid rule and the box index are compared with brute force on random
boxes.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import CheckpointError, ShardingError
from reshard.geometry.boxes import Box, flat_range_boxes
from reshard.geometry.grid import BoxIndex, expand_grid, grid_rule
from reshard.geometry.tiling import find_tiling_problem, untiled_groups
from reshard.planning.descriptions import (
    DescriptionTable,
    LocalSaveDescription,
    TensorPiece,
    describe_state,
    encode_description,
)
from reshard.planning.load_plan import TargetPiece
from reshard.planning.save_plan import plan_save, plan_save_table
from reshard.state.statedict import flatten_state_dict
from reshard.testing import MegatronLayout, MoETransformer, Parallelism
from tests import oracle_planning as oracle

pytestmark = pytest.mark.dist  # in-process, but seconds: kept out of make test-fast

SMALL = MoETransformer(
    layers=4,
    hidden=16,
    heads=4,
    query_groups=2,
    head_dim=4,
    experts=8,
    expert_ffn=6,
    shared_expert_ffn=4,
    vocab=50,
    vocab_multiple=4,
)
"""Small enough to build real (meta) ShardedTensors for every rank; every kind of shard occurs: segmented
QKV and GLU, padded vocabulary, ETP-segmented experts, ZeRO flat ranges over buckets."""

MODEL_512 = MoETransformer(
    layers=8,
    hidden=64,
    heads=8,
    query_groups=8,
    head_dim=8,
    experts=32,
    expert_ffn=16,
    shared_expert_ffn=8,
    vocab=1000,
    vocab_multiple=8,
)
LAYOUT_512 = Parallelism(tp=8, pp=4, dp=16, ep=16, bucket_elements=5000)


@pytest.mark.parametrize(
    "par",
    [
        Parallelism(tp=2, pp=2, dp=2, ep=2, etp=2, bucket_elements=300),
        Parallelism(tp=2, pp=1, dp=3, cp=2, ep=4, zero=False),
        Parallelism(tp=1, pp=4, dp=4, ep=4),
    ],
    ids=str,
)
def test_generated_descriptions_are_what_reshard_describes(par: Parallelism) -> None:
    """The fast generator agrees with reshard's own save path (flatten + describe of real ShardedTensors on
    the meta device) and load path (flatten + pieces) on every rank."""
    layout = MegatronLayout(SMALL, par)
    for rank in range(par.world):
        state = layout.rank_state_dict(rank)
        described, _ = describe_state(flatten_state_dict(state, rank=rank))
        generated = layout.rank_description(rank)
        assert generated.tensors == described.tensors
        assert generated.objects == described.objects
        template = flatten_state_dict(state, rank=rank, dedup=False)
        targets = [TargetPiece(key=t.key, box=p.box) for t in template.tensors for p in t.pieces()]
        assert layout.rank_targets(rank) == targets
    assert plan_save([layout.rank_description(r) for r in range(par.world)])  # a valid layout


def test_generator_sizes_and_validation() -> None:
    model = MoETransformer()
    assert 1.2e12 < model.parameters < 1.3e12
    par = Parallelism(tp=8, pp=16, dp=64, ep=64)
    assert par.world == 8192 and par.edp == 8
    assert par.coords(8191) == par.coords(8191)
    c = par.coords(8 * 64 * 5 + 8 * 3 + 2)
    assert (c.tp, c.dp, c.pp, c.ep, c.edp) == (2, 3, 5, 26, 0)
    with pytest.raises(ValueError, match="must divide"):
        MegatronLayout(model, Parallelism(tp=3))
    with pytest.raises(ValueError, match="not in a world"):
        par.coords(8192)


def test_wire_description_round_trips() -> None:
    layout = MegatronLayout(SMALL, Parallelism(tp=2, pp=2, dp=2, ep=2, etp=2, bucket_elements=300))
    descriptions = [layout.rank_description(r) for r in range(layout.parallelism.world)]
    extra = LocalSaveDescription(
        tensors=(
            TensorPiece(key="big", dtype="int8", global_shape=(2**40,), box=Box((2**39,), (2**39,)), replica_id=(0, 7)),
            TensorPiece(key="s", dtype="float32", global_shape=(), box=Box((), ()), replica_id=3),
        ),
        objects=(),
    )
    payloads = [encode_description(d, {"rank": i}) for i, d in enumerate([*descriptions, extra])]
    table, contexts = DescriptionTable.from_wire(payloads)
    assert contexts == [{"rank": i} for i in range(len(payloads))]
    for rank, description in enumerate([*descriptions, extra]):
        assert table.description(rank) == description
    assert DescriptionTable.from_descriptions(descriptions).description(3) == descriptions[3]
    with pytest.raises(CheckpointError, match="rank 1 sent a malformed save description"):
        DescriptionTable.from_wire([payloads[0], b"RSD1" + payloads[1][4:10], payloads[2]])
    with pytest.raises(CheckpointError, match="rank 0 sent a malformed"):
        DescriptionTable.from_wire([b"XXXX" + payloads[0][4:]])


def test_save_plan_matches_the_oracle_on_512_ranks() -> None:
    layout = MegatronLayout(MODEL_512, LAYOUT_512)
    descriptions = [layout.rank_description(r) for r in range(LAYOUT_512.world)]
    table, _ = DescriptionTable.from_wire([encode_description(d) for d in descriptions])
    assert plan_save_table(table) == oracle.plan_save(descriptions)


def _random_descriptions(rng: random.Random) -> list[LocalSaveDescription]:
    """A few ranks holding tiles (some replicated, some broken) of a few tensors."""
    ranks = rng.randrange(1, 5)
    pieces: list[list[TensorPiece]] = [[] for _ in range(ranks)]
    for k in range(rng.randrange(1, 4)):
        ndim = rng.randrange(0, 4)
        shape = tuple(rng.randrange(1, 5) for _ in range(ndim))
        cuts = [sorted({0, s, rng.randrange(0, s + 1)}) for s in shape]
        for cell in itertools.product(*[range(len(c) - 1) for c in cuts]):
            box = Box(
                tuple(c[i] for c, i in zip(cuts, cell, strict=True)),
                tuple(c[i + 1] - c[i] for c, i in zip(cuts, cell, strict=True)),
            )
            holders = rng.sample(range(ranks), rng.randrange(1, ranks + 1))
            for n, rank in enumerate(holders):
                replica = n if rng.random() < 0.9 else rng.randrange(0, 2)
                pieces[rank].append(
                    TensorPiece(
                        key=f"k{k}",
                        dtype=rng.choice(["float32", "bfloat16"]) if rng.random() < 0.05 else "float32",
                        global_shape=shape,
                        box=box,
                        replica_id=replica,
                    )
                )
        if rng.random() < 0.2 and pieces[0]:
            pieces[0].pop(rng.randrange(len(pieces[0])))
        if rng.random() < 0.1 and ndim:
            pieces[-1].append(
                TensorPiece(
                    key=f"k{k}", dtype="float32", global_shape=shape, box=Box((0,) * ndim, (1,) * ndim), replica_id=0
                )
            )
    return [LocalSaveDescription(tensors=tuple(p), objects=()) for p in pieces]


def test_save_plan_matches_the_oracle_on_random_and_broken_layouts() -> None:
    """Same writers for valid layouts, same error (class and message) for broken ones."""
    rng = random.Random(20260101)
    errors = 0
    for _ in range(400):
        descriptions = _random_descriptions(rng)
        try:
            expected: object = oracle.plan_save(descriptions)
        except ShardingError as exc:
            expected = str(exc)
            errors += 1
        try:
            got: object = plan_save(descriptions)
        except ShardingError as exc:
            got = str(exc)
        assert got == expected
    assert 50 < errors < 350  # both kinds were exercised


def _grid_tiling(rng: random.Random, shape: tuple[int, ...]) -> list[Box]:
    """A random grid tiling of ``shape`` whose cells are kept, split along their flattening (like ZeRO
    ranges), or halved along the last axis."""
    cuts = [sorted({0, s, *(rng.randrange(0, s + 1) for _ in range(2))}) for s in shape]
    boxes = []
    for cell_index in itertools.product(*[range(len(c) - 1) for c in cuts]):
        cell = Box(
            tuple(c[i] for c, i in zip(cuts, cell_index, strict=True)),
            tuple(c[i + 1] - c[i] for c, i in zip(cuts, cell_index, strict=True)),
        )
        roll = rng.random()
        if roll < 0.4 and cell.volume > 1:
            points = [0, *sorted({rng.randrange(1, cell.volume) for _ in range(3)}), cell.volume]
            for a, b in itertools.pairwise(points):
                for box, _ in flat_range_boxes(cell.shape, a, b):
                    boxes.append(Box(tuple(o + c for o, c in zip(box.offset, cell.offset, strict=True)), box.shape))
        elif roll < 0.5 and cell.ndim and cell.shape[-1] > 1:
            h = rng.randrange(1, cell.shape[-1])
            boxes.append(Box(cell.offset, (*cell.shape[:-1], h)))
            boxes.append(Box((*cell.offset[:-1], cell.offset[-1] + h), (*cell.shape[:-1], cell.shape[-1] - h)))
        else:
            boxes.append(cell)
    rng.shuffle(boxes)
    return boxes


def _arrays(boxes: list[Box], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    offset = np.array([b.offset for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    shape = np.array([b.shape for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
    return offset, shape


@pytest.fixture(params=["grid", "scan"])
def index_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a BoxIndex answers: its grid (every set indexed) and, for small sets, a scan of all boxes."""
    monkeypatch.setattr(BoxIndex, "SCAN_BOXES", 0 if request.param == "grid" else 1 << 30)
    return str(request.param)


def test_grid_rule_round_trips_and_the_index_finds_exactly_the_overlaps(index_mode: str) -> None:
    rng = random.Random(7)
    ruled = 0
    for _ in range(600):
        shape = tuple(rng.randrange(1, 7) for _ in range(rng.randrange(0, 4)))
        boxes = _grid_tiling(rng, shape)
        offset, size = _arrays(boxes, len(shape))
        rule = grid_rule(offset, size, shape)
        if rule is not None:
            ruled += 1
            again = expand_grid(shape, rule.cuts, rule.split_cells, rule.split_counts, rule.split_starts)
            assert np.array_equal(again[0], offset[rule.order]) and np.array_equal(again[1], size[rule.order])
        index = BoxIndex(offset, size)
        for _ in range(8):
            lo = tuple(rng.randrange(0, s + 1) for s in shape)
            query = Box(lo, tuple(rng.randrange(0, s - o + 1) for o, s in zip(lo, shape, strict=True)))
            assert index.overlapping(query) == [i for i, b in enumerate(boxes) if b.intersect(query) is not None]
    assert ruled > 500


def test_the_index_works_on_boxes_that_do_not_tile(index_mode: str) -> None:
    rng = random.Random(8)
    for _ in range(300):
        shape = tuple(rng.randrange(1, 9) for _ in range(rng.randrange(1, 4)))
        boxes = []
        for _ in range(rng.randrange(0, 12)):
            lo = tuple(rng.randrange(0, s) for s in shape)
            boxes.append(Box(lo, tuple(rng.randrange(0, s - o + 1) for o, s in zip(lo, shape, strict=True))))
        index = BoxIndex(*_arrays(boxes, len(shape)))
        for _ in range(8):
            lo = tuple(rng.randrange(0, s + 1) for s in shape)
            query = Box(lo, tuple(rng.randrange(0, s - o + 1) for o, s in zip(lo, shape, strict=True)))
            assert index.overlapping(query) == [i for i, b in enumerate(boxes) if b.intersect(query) is not None]


def test_expand_grid_refuses_bad_rules() -> None:
    cuts = (np.array([0, 2, 4]), np.array([0, 3]))
    none = np.zeros(0, dtype=np.int64)
    offset, shape = expand_grid((4, 3), cuts, none, none, none)
    assert offset.tolist() == [[0, 0], [2, 0]] and shape.tolist() == [[2, 3], [2, 3]]
    bad = {
        "rise strictly": ((4, 3), (np.array([0, 2, 2, 4]), np.array([0, 3])), none, none, none),
        "from 0 to 4": ((4, 3), (np.array([1, 4]), np.array([0, 3])), none, none, none),
        "grid has 1 axes": ((4, 3), (np.array([0, 4]),), none, none, none),
        "distinct cell numbers": ((4, 3), cuts, np.array([2]), np.array([1]), np.array([3])),
        "at least one start": ((4, 3), cuts, np.array([0]), np.array([0]), none),
        "rise strictly inside": ((4, 3), cuts, np.array([0]), np.array([1]), np.array([6])),
        "not one contiguous run": ((4, 3), cuts, np.array([0]), np.array([1]), np.array([1])),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            expand_grid(*args)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corner_sums_agree_with_the_sweep(data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(0, 4), max_size=3)))
    ndim = len(shape)
    boxes = []
    for _ in range(data.draw(st.integers(0, 8))):
        lo = tuple(data.draw(st.integers(0, s)) for s in shape)
        boxes.append(Box(lo, tuple(data.draw(st.integers(0, s - o)) for o, s in zip(lo, shape, strict=True))))
    if data.draw(st.booleans()) and all(shape):
        boxes = _grid_tiling(random.Random(data.draw(st.integers(0, 1000))), shape)
    offset, size = _arrays(boxes, ndim)
    bad = untiled_groups(
        np.zeros(len(boxes), dtype=np.int64), offset, offset + size, np.array([shape], dtype=np.int64).reshape(1, ndim)
    )
    assert bool(bad[0]) == (find_tiling_problem(shape, boxes) is not None)
