"""Segmented shards, flat ranges and padding: decompositions into boxes, in one process.

Property tests: for random shapes, ranges and segment orders, decomposing a local tensor into boxes and
reading each box back out of the global tensor reassembles the original exactly; flat-range boxes tile
exactly the range. Then real single-process saves and loads of each layout.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reshard
from reshard.geometry.boxes import Box, flat_range_boxes
from reshard.state.sharding import ShardedTensor
from tests.tiers import examples

pytestmark = pytest.mark.unit

SETTINGS = settings(max_examples=examples(150), deadline=None)


def region(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))] if box.ndim else t


@st.composite
def shape_and_range(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    total = math.prod(shape)
    start = draw(st.integers(0, total))
    end = draw(st.integers(start, total))
    return shape, start, end


@SETTINGS
@given(shape_and_range())
def test_flat_range_boxes_tile_exactly_the_range(case: tuple[tuple[int, ...], int, int]) -> None:
    shape, start, end = case
    full = torch.arange(math.prod(shape)).reshape(shape)
    flat = full.reshape(-1)
    boxes = flat_range_boxes(shape, start, end)
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    position = start
    for box, flat_offset in boxes:
        assert box.volume > 0
        assert box.is_inside(shape)
        assert flat_offset == position  # boxes come in flat order, contiguous, no gap, no overlap
        assert torch.equal(region(full, box).reshape(-1), flat[flat_offset : flat_offset + box.volume])
        position += box.volume
    assert position == end or start == end


@st.composite
def flat_range_case(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int]:
    ndim = draw(st.integers(1, 3))
    local_shape = tuple(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    margin = tuple(draw(st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim)))
    offset = tuple(draw(st.integers(0, m)) for m in margin)
    global_shape = tuple(n + m for n, m in zip(local_shape, margin, strict=True))
    total = math.prod(local_shape)
    start = draw(st.integers(0, total))
    end = draw(st.integers(start, total))
    return global_shape, local_shape, offset, start, end


@SETTINGS
@given(flat_range_case())
def test_flat_range_pieces_reassemble_the_original(case: tuple) -> None:
    global_shape, local_shape, offset, start, end = case
    full = torch.randn(global_shape)
    shard = region(full, Box(offset, local_shape)).contiguous()
    data = shard.reshape(-1)[start:end].clone()
    st_ = ShardedTensor.from_flat_range("k", data, local_shape, global_shape, offset, start, end)
    pieces = st_.pieces()
    assert sum(p.box.volume for p in pieces) == end - start
    for piece in pieces:
        assert torch.equal(piece.view, region(full, piece.box))
        assert piece.view.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()
    for a in range(len(pieces)):
        for b in range(a + 1, len(pieces)):
            assert pieces[a].box.intersect(pieces[b].box) is None


@st.composite
def segmented_case(draw: st.DrawFn) -> tuple:
    ndim = draw(st.integers(1, 3))
    global_shape = tuple(draw(st.lists(st.integers(1, 7), min_size=ndim, max_size=ndim)))
    axis = draw(st.integers(0, ndim - 1))
    cuts = sorted(set(draw(st.lists(st.integers(0, global_shape[axis]), max_size=6))) | {0, global_shape[axis]})
    ranges = [(lo, hi - lo) for lo, hi in itertools.pairwise(cuts)]
    chosen = draw(st.lists(st.sampled_from(ranges), unique=True, min_size=1)) if ranges else []
    chosen = draw(st.permutations(chosen))
    flat = draw(st.booleans())
    return global_shape, axis, chosen, flat, draw(st.integers(0, 10**6))


@SETTINGS
@given(segmented_case())
def test_segmented_pieces_reassemble_the_original(case: tuple) -> None:
    global_shape, axis, segments, use_flat_range, seed = case
    full = torch.randn(global_shape, generator=torch.Generator().manual_seed(seed))
    local = torch.cat([full.narrow(axis, g, n) for g, n in segments], dim=axis)
    if use_flat_range:
        total = local.numel()
        start, end = seed % (total + 1), total - (seed // 7) % (total + 1 - seed % (total + 1))
        data = local.reshape(-1)[start:end].clone()
        st_ = ShardedTensor.from_flat_range(
            "k",
            data,
            tuple(local.shape),
            global_shape,
            (0,) * len(global_shape),
            start,
            end,
            segment_axis=axis,
            segments=segments,
        )
        expected_volume = end - start
    else:
        data = local.clone()
        st_ = ShardedTensor.segmented("k", data, global_shape, axis, segments)
        expected_volume = data.numel()
    pieces = st_.pieces()
    assert sum(p.box.volume for p in pieces) == expected_volume
    for piece in pieces:
        assert torch.equal(piece.view, region(full, piece.box))
    for a in range(len(pieces)):
        for b in range(a + 1, len(pieces)):
            assert pieces[a].box.intersect(pieces[b].box) is None


def test_fused_qkv_mha_segments_and_gqa_groups() -> None:
    heads, dim, hidden, tp = 4, 2, 3, 2
    qkv = torch.arange(3 * heads * dim * hidden, dtype=torch.float32).reshape(3 * heads * dim, hidden)
    rows = heads * dim // tp
    for rank in range(tp):
        segments = [(part * heads * dim + rank * rows, rows) for part in range(3)]
        local = torch.cat([qkv[g : g + n] for g, n in segments])
        pieces = ShardedTensor.segmented("qkv", local, tuple(qkv.shape), 0, segments).pieces()
        assert [p.box.offset[0] for p in pieces] == [g for g, _ in segments]
        assert all(torch.equal(p.view, qkv[p.box.offset[0] : p.box.offset[0] + rows]) for p in pieces)


def test_padding_clips_pieces_and_marks_the_padded_view() -> None:
    data = torch.arange(8.0).reshape(4, 2)  # rows 4..7 of a vocabulary padded from 6 to 8 rows
    st_ = ShardedTensor("emb", data, (8, 2), (4, 0), logical_shape=(6, 2))
    (piece,) = st_.pieces()
    assert piece.box == Box((4, 0), (2, 2))
    assert piece.padded_view is not None and piece.padded_view.shape == (4, 2)
    all_padding = ShardedTensor("emb", torch.ones(2, 2), (8, 2), (6, 0), logical_shape=(6, 2)).pieces()
    assert len(all_padding) == 1 and all_padding[0].box.volume == 0 and all_padding[0].padded_view is not None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ShardedTensor.segmented("k", torch.zeros(4), (6,), 0, [(0, 2), (1, 2)]), "'k'.*overlap"),
        (lambda: ShardedTensor.segmented("k", torch.zeros(4), (6,), 0, [(0, 2), (5, 2)]), "'k'.*extends past"),
        (lambda: ShardedTensor.segmented("k", torch.zeros(4), (6,), 0, [(0, 3)]), "'k'.*add up to 3"),
        (
            lambda: ShardedTensor.from_flat_range("k", torch.zeros(3), (2, 2), (2, 2), (0, 0), 2, 5),
            "'k'.*runs past the 4 elements",
        ),
        (
            lambda: ShardedTensor.from_flat_range("k", torch.zeros(2), (2, 2), (2, 2), (0, 0), 1, 4),
            "'k'.*3 elements",
        ),
        (lambda: ShardedTensor("k", torch.zeros(2), (4,), (0,), logical_shape=(5,)), "'k'.*padding cannot be larger"),
    ],
)
def test_invalid_layouts_raise_sharding_error(build: object, message: str) -> None:
    with pytest.raises(reshard.ShardingError, match=message):
        build()  # type: ignore[operator]


def test_zero_flat_ranges_round_trip_in_one_process(tmp_path: Path) -> None:
    """One process holding three flat ranges of one key (as three leaves) saves them; a full template
    loads them back, and a plain full save loads into flat-range templates (mid-row, less than a row,
    to the end, empty)."""
    full = torch.randn(5, 3)
    ranges = [(0, 4), (4, 5), (5, 15)]  # mid-row, less than a row, to the end
    state = {
        f"m{i}": ShardedTensor.from_flat_range("exp_avg", full.reshape(-1)[s:e].clone(), (5, 3), (5, 3), (0, 0), s, e)
        for i, (s, e) in enumerate(ranges)
    }
    reshard.save(state, tmp_path / "zero")
    target = torch.zeros(5, 3)
    loaded = reshard.load({"m": ShardedTensor("exp_avg", target, (5, 3), (0, 0))}, tmp_path / "zero")
    assert torch.equal(loaded["m"], full)
    # And the reverse: a plain full save loaded as flat ranges.
    reshard.save({"m": ShardedTensor("exp_avg", full, (5, 3), (0, 0))}, tmp_path / "plain")
    for s, e in [*ranges, (7, 7)]:
        part = torch.zeros(e - s)
        template = {"m": ShardedTensor.from_flat_range("exp_avg", part, (5, 3), (5, 3), (0, 0), s, e)}
        assert torch.equal(reshard.load(template, tmp_path / "plain")["m"], full.reshape(-1)[s:e])


def test_padding_is_zeroed_and_logical_shape_checked(tmp_path: Path) -> None:
    vocab, hidden = 5, 2
    full = torch.randn(vocab, hidden)
    padded = torch.cat([full, torch.full((3, hidden), 7.0)])  # padded to 8 rows, padding garbage
    reshard.save({"emb": ShardedTensor("emb", padded, (8, hidden), (0, 0), logical_shape=(vocab, hidden))}, tmp_path)
    metadata = reshard.read_metadata(tmp_path)
    assert metadata.tensors["emb"].global_shape == (vocab, hidden)  # the padding is never saved
    assert metadata.total_bytes == vocab * hidden * 4
    target = torch.full((12, hidden), float("nan"))  # another padded size, garbage everywhere
    out = reshard.load(
        {"emb": ShardedTensor("emb", target, (12, hidden), (0, 0), logical_shape=(vocab, hidden))}, tmp_path
    )
    assert torch.equal(out["emb"][:vocab], full)
    assert torch.equal(out["emb"][vocab:], torch.zeros(12 - vocab, hidden))
    with pytest.raises(reshard.MismatchError, match=r"'emb'.*saved global shape \[5, 2\].*logical shape \[6, 2\]"):
        reshard.load({"emb": ShardedTensor("emb", target, (12, hidden), (0, 0), logical_shape=(6, hidden))}, tmp_path)


@pytest.mark.parametrize(
    ("saved", "target"),
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float32)],
)
def test_dtype_conversion_on_load(tmp_path: Path, saved: torch.dtype, target: torch.dtype) -> None:
    full = torch.randn(6, 4).to(saved)
    reshard.save({"w": ShardedTensor("w", full, (6, 4), (0, 0))}, tmp_path)
    dest = torch.zeros(6, 2, dtype=target)
    out = reshard.load({"w": ShardedTensor("w", dest, (6, 4), (0, 2))}, tmp_path)
    assert torch.equal(out["w"], full[:, 2:].to(target))
    with pytest.raises(reshard.MismatchError, match=r"'w'.*saved dtype .*allow_dtype_cast=False"):
        reshard.load(
            {"w": ShardedTensor("w", dest, (6, 4), (0, 2))},
            tmp_path,
            options=reshard.LoadOptions(allow_dtype_cast=False),
        )


def test_reads_are_planned_in_pieces_of_bounded_size(tmp_path: Path) -> None:
    """A load's staging memory is bounded by ``memory_budget_bytes``: big overlaps are read in slabs."""
    from reshard.planning.load_plan import TargetPiece, plan_load

    full = torch.randn(64, 48)
    reshard.save({"w": ShardedTensor("w", full, (64, 48), (0, 0))}, tmp_path)
    metadata = reshard.read_metadata(tmp_path)
    target = TargetPiece(key="w", box=Box((3, 5), (60, 20)))  # a strided sub-box: rows of 20 of 48 columns
    plan = plan_load(metadata, [target], max_read_bytes=1024)
    assert len(plan.items) > 1
    assert all(item.bytes_read <= 1024 for item in plan.items)
    assert sum(item.bytes_needed for item in plan.items) == 60 * 20 * 4
    assert plan.bytes_read <= 1.10 * plan.bytes_needed
    dest = torch.zeros(60, 20, dtype=torch.float64)  # a dtype conversion: nothing lands directly
    stats = reshard.LoadStats()
    out = reshard.load(
        {"w": ShardedTensor("w", dest, (64, 48), (3, 5))},
        tmp_path,
        stats=stats,
        options=reshard.LoadOptions(memory_budget_bytes=1024),
    )
    assert torch.equal(out["w"], full[3:63, 5:25].double())
    assert stats.read_requests >= len(plan.items)


def test_zero_copy_same_layout_load_equals_the_copying_path(tmp_path: Path) -> None:
    """A same-layout load reads straight into the destination; a destination that is not contiguous
    takes the copying path; both give the same bits."""
    full = torch.randn(32, 16)
    reshard.save({"w": ShardedTensor("w", full, (32, 16), (0, 0))}, tmp_path)
    direct = torch.zeros(32, 16)
    stats = reshard.LoadStats()
    reshard.load({"w": ShardedTensor("w", direct, (32, 16), (0, 0))}, tmp_path, stats=stats)
    assert stats.bytes_direct == stats.bytes_needed == 32 * 16 * 4
    strided = torch.zeros(16, 32).t()  # the same shape, column-major memory
    stats = reshard.LoadStats()
    reshard.load({"w": ShardedTensor("w", strided, (32, 16), (0, 0))}, tmp_path, stats=stats)
    assert stats.bytes_direct == 0
    assert torch.equal(direct, full) and torch.equal(strided, full)
