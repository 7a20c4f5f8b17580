"""Unit and property tests of the N-d box math: ``Box``, ``row_major_strides`` and ``read_pattern``."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.geometry.boxes import Box, ReadPattern, read_pattern, row_major_strides
from tests.tiers import examples

pytestmark = pytest.mark.unit

PROPERTY = settings(max_examples=examples(150), deadline=None, database=None)


# --------------------------------------------------------------------------------------------------
# Box


class TestBoxValidation:
    def test_offset_and_shape_must_have_the_same_rank(self) -> None:
        with pytest.raises(ValueError, match="differ in rank"):
            Box((0, 0), (1,))

    @pytest.mark.parametrize(("offset", "shape"), [((-1,), (2,)), ((0,), (-2,)), ((0, -3), (1, 1))])
    def test_negative_entries_are_refused(self, offset: tuple[int, ...], shape: tuple[int, ...]) -> None:
        with pytest.raises(ValueError, match="non-negative"):
            Box(offset, shape)

    def test_box_is_frozen_and_hashable(self) -> None:
        box = Box((1, 2), (3, 4))
        with pytest.raises(dataclasses.FrozenInstanceError):
            box.offset = (0, 0)  # type: ignore[misc]
        assert {box: 1}[Box((1, 2), (3, 4))] == 1
        assert box != Box((1, 2), (3, 5))

    def test_properties(self) -> None:
        box = Box((1, 2, 3), (4, 5, 6))
        assert box.ndim == 3
        assert box.end == (5, 7, 9)
        assert box.volume == 120

    def test_full(self) -> None:
        assert Box.full((3, 4)) == Box((0, 0), (3, 4))
        assert Box.full(()) == Box((), ())


class TestZeroDimensionalAndEmptyBoxes:
    def test_zero_dimensional_box_has_one_element(self) -> None:
        box = Box((), ())
        assert box.ndim == 0
        assert box.volume == 1
        assert box.end == ()

    def test_zero_dimensional_box_intersects_itself(self) -> None:
        box = Box((), ())
        assert box.intersect(Box((), ())) == box

    def test_zero_dimensional_box_is_inside_a_scalar_only(self) -> None:
        box = Box((), ())
        assert box.is_inside(())
        assert not box.is_inside((1,))

    def test_zero_dimensional_relative_to_selects_the_scalar(self) -> None:
        box = Box((), ())
        assert box.relative_to(box) == ()
        assert torch.tensor(5.0)[box.relative_to(box)].item() == 5.0

    @pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 0, 2)])
    def test_volume_zero(self, shape: tuple[int, ...]) -> None:
        assert Box((0,) * len(shape), shape).volume == 0

    def test_empty_box_intersects_nothing(self) -> None:
        empty = Box((1, 1), (0, 3))
        assert empty.intersect(Box((0, 0), (4, 4))) is None
        assert Box((0, 0), (4, 4)).intersect(empty) is None

    def test_empty_box_at_the_edge_is_inside(self) -> None:
        assert Box((4, 0), (0, 3)).is_inside((4, 3))
        assert not Box((5, 0), (0, 3)).is_inside((4, 3))


class TestIntersect:
    def test_overlapping(self) -> None:
        a = Box((0, 0), (4, 4))
        b = Box((2, 3), (4, 4))
        assert a.intersect(b) == Box((2, 3), (2, 1))
        assert b.intersect(a) == Box((2, 3), (2, 1))

    def test_contained(self) -> None:
        outer = Box((0, 0, 0), (5, 5, 5))
        inner = Box((1, 2, 3), (2, 2, 2))
        assert outer.intersect(inner) == inner
        assert inner.intersect(outer) == inner

    def test_touching_boxes_share_nothing(self) -> None:
        assert Box((0, 0), (2, 2)).intersect(Box((2, 0), (2, 2))) is None
        assert Box((0, 0), (2, 2)).intersect(Box((0, 2), (2, 2))) is None

    def test_disjoint(self) -> None:
        assert Box((0,), (3,)).intersect(Box((5,), (3,))) is None
        # Overlap on one axis only is not an overlap.
        assert Box((0, 0), (3, 3)).intersect(Box((1, 5), (3, 3))) is None

    def test_rank_mismatch(self) -> None:
        with pytest.raises(ValueError, match="rank"):
            Box((0,), (3,)).intersect(Box((0, 0), (3, 3)))

    @PROPERTY
    @given(data=st.data(), ndim=st.integers(1, 4))
    def test_intersection_is_the_set_of_common_elements(self, data: st.DataObject, ndim: int) -> None:
        def box() -> Box:
            offset = tuple(data.draw(st.integers(0, 5)) for _ in range(ndim))
            shape = tuple(data.draw(st.integers(0, 4)) for _ in range(ndim))
            return Box(offset, shape)

        a, b = box(), box()

        def elements(bx: Box) -> set[tuple[int, ...]]:
            return set(itertools.product(*(range(o, o + s) for o, s in zip(bx.offset, bx.shape, strict=True))))

        common = elements(a) & elements(b)
        got = a.intersect(b)
        assert got == b.intersect(a)
        if not common:
            assert got is None
        else:
            assert got is not None
            assert elements(got) == common


class TestRelativeToAndIsInside:
    def test_relative_to_selects_the_sub_box(self) -> None:
        outer = Box((10, 20), (4, 5))
        inner = Box((11, 22), (2, 3))
        data = torch.arange(20).reshape(4, 5)
        assert inner.relative_to(outer) == (slice(1, 3), slice(2, 5))
        assert torch.equal(data[inner.relative_to(outer)], torch.tensor([[7, 8, 9], [12, 13, 14]]))

    def test_relative_to_itself_is_everything(self) -> None:
        box = Box((3, 4), (2, 2))
        assert box.relative_to(box) == (slice(0, 2), slice(0, 2))

    @pytest.mark.parametrize(
        ("box", "shape", "inside"),
        [
            (Box((0, 0), (4, 5)), (4, 5), True),
            (Box((1, 1), (3, 4)), (4, 5), True),
            (Box((1, 1), (4, 4)), (4, 5), False),
            (Box((0, 0), (4, 6)), (4, 5), False),
            (Box((0,), (4,)), (4, 5), False),
            (Box((0, 0, 0), (1, 1, 1)), (4, 5), False),
        ],
    )
    def test_is_inside(self, box: Box, shape: tuple[int, ...], inside: bool) -> None:
        assert box.is_inside(shape) is inside


# --------------------------------------------------------------------------------------------------
# row_major_strides


@pytest.mark.parametrize(
    ("shape", "strides"),
    [((), ()), ((7,), (1,)), ((2, 3), (3, 1)), ((2, 3, 4), (12, 4, 1)), ((5, 1, 1, 3), (3, 3, 3, 1))],
)
def test_row_major_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
    assert row_major_strides(shape) == strides


@PROPERTY
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=5).map(tuple))
def test_row_major_strides_match_torch_contiguous(shape: tuple[int, ...]) -> None:
    assert row_major_strides(shape) == torch.empty(shape).stride()


# --------------------------------------------------------------------------------------------------
# read_pattern


def _gather(stored: Box, pattern: ReadPattern) -> np.ndarray:
    """Read the stored box's row-major elements exactly as ``pattern`` plans: ``count`` reads of ``span``
    elements, then lay each read out with ``inner_strides``. Returns an array of the sub-box's shape."""
    flat = np.arange(stored.volume)
    reads = []
    for start in pattern.starts():
        assert start >= 0
        assert start + pattern.span <= stored.volume, "a read runs past the stored box"
        chunk = flat[start : start + pattern.span]
        picked = np.empty(pattern.inner_shape, dtype=flat.dtype)
        for index in itertools.product(*(range(n) for n in pattern.inner_shape)):
            position = sum(i * s for i, s in zip(index, pattern.inner_strides, strict=True))
            assert position < pattern.span, "an element lies outside its read"
            picked[index] = chunk[position]
        reads.append(picked)
    return np.stack(reads).reshape((*pattern.lead_shape, *pattern.inner_shape))


def _expected(stored: Box, sub: Box) -> np.ndarray:
    return np.arange(stored.volume).reshape(stored.shape)[sub.relative_to(stored)]


class TestReadPatternLevels:
    def test_whole_box_is_one_read(self) -> None:
        stored = Box((2, 0, 0), (4, 5, 6))
        pattern = read_pattern(stored, stored, max_amplification=1.0)
        assert pattern.count == 1
        assert pattern.first == 0
        assert pattern.span == pattern.needed == 120
        assert pattern.lead_shape == ()

    def test_rows_of_a_matrix_are_one_read(self) -> None:
        stored = Box((0, 0), (6, 5))
        sub = Box((2, 0), (3, 5))
        pattern = read_pattern(stored, sub, max_amplification=1.0)
        assert (pattern.count, pattern.first, pattern.span, pattern.needed) == (1, 10, 15, 15)

    def test_columns_need_one_read_per_row_at_amplification_one(self) -> None:
        stored = Box((0, 0), (6, 5))
        sub = Box((1, 1), (3, 2))
        pattern = read_pattern(stored, sub, max_amplification=1.0)
        assert pattern.lead_shape == (3,)
        assert pattern.span == 2
        assert pattern.starts() == [6, 11, 16]
        assert pattern.read_elements == pattern.needed == 6

    def test_large_amplification_merges_everything_into_one_read(self) -> None:
        stored = Box((0, 0), (6, 5))
        sub = Box((1, 1), (3, 2))
        pattern = read_pattern(stored, sub, max_amplification=100.0)
        assert pattern.count == 1
        assert pattern.first == 6
        # From element (1, 1) to element (3, 2): 2 rows of 5 plus 2.
        assert pattern.span == 12
        assert pattern.inner_strides == (5, 1)

    def test_amplification_bound_picks_the_middle_level(self) -> None:
        # Stored (4, 10, 10); sub (2, 10, 9). One read from the first to the last needed element spans
        # 199 elements (amplification 1.106); one read per axis-0 index spans 99 (2 * 99 / 180 = 1.1); one
        # read per (axis 0, axis 1) index reads exactly the 180 needed elements.
        stored = Box((0, 0, 0), (4, 10, 10))
        sub = Box((1, 0, 0), (2, 10, 9))
        loose = read_pattern(stored, sub, max_amplification=1.2)
        assert loose.count == 1
        assert loose.span == 199
        assert loose.first == 100
        middle = read_pattern(stored, sub, max_amplification=1.101)
        assert middle.lead_shape == (2,)
        assert middle.span == 99
        assert middle.starts() == [100, 200]
        exact = read_pattern(stored, sub, max_amplification=1.09)
        assert exact.lead_shape == (2, 10)
        assert exact.span == 9
        assert exact.read_elements == exact.needed == 180

    def test_sub_box_spanning_whole_trailing_axes_reads_slabs(self) -> None:
        stored = Box((0, 0, 0), (5, 4, 3))
        sub = Box((1, 1, 0), (3, 2, 3))  # axis 2 whole, axis 1 partial
        pattern = read_pattern(stored, sub, max_amplification=1.0)
        assert pattern.lead_shape == (3,)
        assert pattern.span == 6
        assert pattern.read_elements == pattern.needed

    def test_below_one_still_reads_exactly(self) -> None:
        stored = Box((0, 0), (6, 5))
        sub = Box((1, 1), (3, 2))
        pattern = read_pattern(stored, sub, max_amplification=0.5)
        assert pattern.read_elements == pattern.needed

    def test_zero_dimensional(self) -> None:
        pattern = read_pattern(Box((), ()), Box((), ()), max_amplification=1.0)
        assert (pattern.count, pattern.first, pattern.span, pattern.needed) == (1, 0, 1, 1)
        assert pattern.starts() == [0]

    def test_zero_volume_sub_box_reads_nothing(self) -> None:
        pattern = read_pattern(Box((0, 0), (4, 4)), Box((1, 1), (0, 2)), max_amplification=1.0)
        assert pattern.needed == 0
        assert pattern.read_elements == 0

    def test_sub_box_outside_stored_box_is_refused(self) -> None:
        with pytest.raises(ValueError, match="not inside"):
            read_pattern(Box((0, 0), (4, 4)), Box((2, 2), (3, 1)), max_amplification=1.0)
        with pytest.raises(ValueError, match="not inside"):
            read_pattern(Box((4, 0), (4, 4)), Box((0, 0), (2, 2)), max_amplification=1.0)

    def test_offset_stored_box(self) -> None:
        stored = Box((10, 20), (4, 5))
        sub = Box((11, 22), (2, 3))
        pattern = read_pattern(stored, sub, max_amplification=1.0)
        assert pattern.starts() == [7, 12]
        np.testing.assert_array_equal(_gather(stored, pattern), _expected(stored, sub))


@st.composite
def stored_and_sub(draw: st.DrawFn) -> tuple[Box, Box]:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    offset = tuple(draw(st.integers(0, 3)) for _ in range(ndim))
    sub_offset = []
    sub_shape = []
    for o, s in zip(offset, shape, strict=True):
        lo = draw(st.integers(0, s - 1))
        hi = draw(st.integers(lo + 1, s))
        sub_offset.append(o + lo)
        sub_shape.append(hi - lo)
    return Box(offset, shape), Box(tuple(sub_offset), tuple(sub_shape))


def _trailing_whole_axes(stored: Box, sub: Box) -> int:
    count = 0
    for axis in range(stored.ndim - 1, -1, -1):
        if sub.shape[axis] != stored.shape[axis]:
            break
        count += 1
    return count


class TestReadPatternProperties:
    @PROPERTY
    @given(boxes=stored_and_sub(), amplification=st.sampled_from([1.0, 1.05, 1.1, 1.5, 3.0, 1000.0]))
    def test_planned_reads_fetch_exactly_the_sub_box(self, boxes: tuple[Box, Box], amplification: float) -> None:
        stored, sub = boxes
        pattern = read_pattern(stored, sub, max_amplification=amplification)
        assert pattern.needed == sub.volume
        assert pattern.inner_shape == sub.shape[len(pattern.lead_shape) :]
        assert pattern.lead_shape == sub.shape[: len(pattern.lead_shape)]
        assert len(pattern.starts()) == pattern.count
        np.testing.assert_array_equal(_gather(stored, pattern), _expected(stored, sub))
        starts = pattern.starts()
        assert starts == sorted(starts)
        # Reads never overlap one another.
        assert all(b - a >= pattern.span for a, b in itertools.pairwise(starts))

    @PROPERTY
    @given(boxes=stored_and_sub(), amplification=st.floats(1.0, 4.0))
    def test_amplification_bound_is_respected_with_fewest_reads(
        self, boxes: tuple[Box, Box], amplification: float
    ) -> None:
        stored, sub = boxes
        pattern = read_pattern(stored, sub, max_amplification=amplification)
        assert pattern.read_elements <= amplification * pattern.needed
        # No smaller level (fewer, larger reads) would have stayed within the bound.
        strides = row_major_strides(stored.shape)
        for level in range(len(pattern.lead_shape)):
            span = 1 + sum((n - 1) * s for n, s in zip(sub.shape[level:], strides[level:], strict=True))
            assert math.prod(sub.shape[:level]) * span > amplification * pattern.needed

    @PROPERTY
    @given(boxes=stored_and_sub())
    def test_exact_reads_cover_whole_trailing_axes_in_one_run(self, boxes: tuple[Box, Box]) -> None:
        stored, sub = boxes
        pattern = read_pattern(stored, sub, max_amplification=1.0)
        assert pattern.read_elements == pattern.needed
        whole = _trailing_whole_axes(stored, sub)
        # At most one read per index of the axes before the last partial axis: the runs over the partial
        # axis and the whole axes after it are contiguous (leading axes of extent 1 merge further).
        level = len(pattern.lead_shape)
        assert level <= max(stored.ndim - whole - 1, 0)
        assert pattern.span == math.prod(sub.shape[level:])
        assert pattern.count == math.prod(sub.shape[:level])
        if whole >= stored.ndim - 1:
            assert pattern.count == 1
