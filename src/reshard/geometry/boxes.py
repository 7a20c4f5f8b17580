"""N-dimensional box math: the geometry that saving and loading are built on.

A *box* is an axis-aligned region of a global tensor: ``offset`` (the global index of its first element
on every axis) and ``shape`` (its extent on every axis), in elements. A 0-dimensional tensor is the one
box with ``offset == shape == ()``. Boxes are stored row-major (C order) in data files, so a sub-box of a
stored box is a set of equally sized contiguous *runs* of bytes.

Everything here is pure: no I/O, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Box", "ReadPattern", "flat_range_boxes", "read_pattern", "row_major_strides", "strides_overlap"]


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned region ``[offset, offset + shape)`` of a global tensor, in elements."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise ValueError(f"box offset {self.offset} and shape {self.shape} differ in rank")
        if any(o < 0 for o in self.offset) or any(s < 0 for s in self.shape):
            raise ValueError(f"box offset {self.offset} and shape {self.shape} must be non-negative")

    @classmethod
    def full(cls, global_shape: tuple[int, ...]) -> Box:
        """The box covering a whole tensor of ``global_shape``."""
        return cls((0,) * len(global_shape), tuple(global_shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        """The exclusive upper corner, ``offset + shape``."""
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=True))

    @property
    def volume(self) -> int:
        """Number of elements in the box (1 for a 0-dimensional box)."""
        return math.prod(self.shape)

    def is_inside(self, global_shape: tuple[int, ...]) -> bool:
        """Whether the box lies within a tensor of ``global_shape`` (same rank, no element outside)."""
        return len(global_shape) == self.ndim and all(e <= g for e, g in zip(self.end, global_shape, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common region of two boxes, or None when they share no element."""
        if other.ndim != self.ndim:
            raise ValueError(f"cannot intersect boxes of rank {self.ndim} and {other.ndim}")
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.end, other.end, strict=True))
        if any(h <= low for low, h in zip(lo, hi, strict=True)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Index slices that select this box inside a tensor that holds ``outer``."""
        return tuple(slice(o - oo, o - oo + s) for o, oo, s in zip(self.offset, outer.offset, self.shape, strict=True))


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    strides = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        strides[axis] = strides[axis + 1] * shape[axis + 1]
    return tuple(strides)


_EXACT_OVERLAP_ELEMENTS = 1 << 16
"""Up to this many elements, a layout that the quick test cannot clear is checked element by element."""


def strides_overlap(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether two elements of a tensor of ``shape`` and element ``strides`` may share memory (an expanded
    tensor, or strides that step into each other). A layout is clear when, axes sorted by stride, each stride
    exceeds the reach of the smaller ones (every ordinary view: permuted, sliced, stepped); another layout of
    at most 65536 elements is checked element by element, and a larger one counts as overlapping."""
    if any(n == 0 for n in shape):
        return False
    axes = sorted((abs(s), n) for n, s in zip(shape, strides, strict=True) if n > 1)
    reach = 0
    for stride, n in axes:
        if stride <= reach:
            break
        reach += (n - 1) * stride
    else:
        return False
    if math.prod(n for _, n in axes) > _EXACT_OVERLAP_ELEMENTS:
        return True
    offsets = [0]
    for stride, n in axes:
        offsets = [o + i * stride for o in offsets for i in range(n)]
    return len(set(offsets)) != len(offsets)


@dataclass(frozen=True, slots=True)
class ReadPattern:
    """How to fetch a sub-box of a stored box: ``count`` reads of ``span`` elements each.

    Read ``i`` starts ``first + i_multi . lead_strides`` elements into the stored box, where ``i_multi`` is
    ``i`` unravelled over ``lead_shape`` (the first ``len(lead_shape)`` axes of the sub-box). Inside a read,
    the sub-box's remaining axes are laid out with the stored box's strides ``inner_strides``. ``needed``
    is the number of elements of the sub-box; ``count * span - needed`` elements are read and discarded.
    """

    first: int
    span: int
    lead_shape: tuple[int, ...]
    lead_strides: tuple[int, ...]
    inner_shape: tuple[int, ...]
    inner_strides: tuple[int, ...]
    needed: int

    @property
    def count(self) -> int:
        return math.prod(self.lead_shape)

    @property
    def read_elements(self) -> int:
        return self.count * self.span

    def starts(self) -> list[int]:
        """Element offset, in the stored box, of every read, in row-major order of the lead axes."""
        starts = [self.first]
        for size, stride in zip(self.lead_shape, self.lead_strides, strict=True):
            starts = [s + i * stride for s in starts for i in range(size)]
        return starts


def read_pattern(stored: Box, sub: Box, *, max_amplification: float | None, request_cost: int = 0) -> ReadPattern:
    """Plan the reads of ``sub`` (inside ``stored``) from ``stored``'s row-major bytes.

    Reads are whole slabs: for each index of the first ``L`` axes of ``sub``, one read spans from the first
    to the last needed element of the remaining axes. With ``max_amplification``, ``L`` is chosen as small as
    possible (fewest reads) such that elements read / elements needed stays at most ``max_amplification``;
    the largest ``L`` considered reads exactly the needed elements (runs over the trailing axes that ``sub``
    covers whole), so the result always respects the bound when ``max_amplification >= 1``. With
    ``max_amplification=None`` the storage decides: ``L`` minimises ``reads * request_cost + elements read``
    (``request_cost`` in elements: what one request costs in elements that could be read instead), so that
    an object store reads few large ranges and a local file (cost 0) exactly the needed runs.
    """
    if sub.intersect(stored) != sub and sub.volume > 0:
        raise ValueError(f"sub-box {sub} is not inside stored box {stored}")
    strides = row_major_strides(stored.shape)
    rel = tuple(o - so for o, so in zip(sub.offset, stored.offset, strict=True))
    first = sum(r * st for r, st in zip(rel, strides, strict=True))
    ndim = sub.ndim
    needed = sub.volume
    # The deepest useful level: axes after `exact` are covered whole by the sub-box, so one read per
    # index of the axes before `exact` (inclusive of nothing after) is exactly contiguous.
    exact = ndim
    while exact > 0 and sub.shape[exact - 1] == stored.shape[exact - 1]:
        exact -= 1
    exact = max(exact - 1, 0)
    chosen = exact
    if max_amplification is None:
        costs = []
        for level in range(exact + 1):
            span = 1 + sum((n - 1) * st for n, st in zip(sub.shape[level:], strides[level:], strict=True))
            costs.append((math.prod(sub.shape[:level]) * (request_cost + span), level))
        chosen = min(costs)[1] if needed else exact
    for level in range(exact + 1):
        inner_shape = sub.shape[level:]
        inner_strides = strides[level:]
        span = 1 + sum((n - 1) * st for n, st in zip(inner_shape, inner_strides, strict=True)) if needed else 0
        count = math.prod(sub.shape[:level])
        fits = max_amplification is not None and count * span <= max_amplification * needed
        if level == chosen if max_amplification is None else (level == exact or fits):
            return ReadPattern(
                first=first,
                span=span,
                lead_shape=sub.shape[:level],
                lead_strides=strides[:level],
                inner_shape=inner_shape,
                inner_strides=inner_strides,
                needed=needed,
            )
    raise AssertionError("unreachable: the exact level always returns")


def flat_range_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[Box, int]]:
    """Decompose elements ``[start, end)`` of the row-major flattening of a tensor of ``shape`` into boxes.

    Returns ``(box, flat_offset)`` pairs in flat order, where ``box`` is in the tensor's own coordinates
    and its elements are exactly ``[flat_offset, flat_offset + box.volume)`` of the flattening, in the
    box's own row-major order (so a contiguous 1-D slice of the flat data, reshaped to ``box.shape``, is
    the box). On 2-D: at most three boxes (partial first row, whole middle rows, partial last row); in
    general at most ``2 * ndim - 1``. An empty range gives no boxes.
    """
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) does not lie within the {total} elements of shape {shape}")
    out: list[tuple[Box, int]] = []
    _flat_boxes(shape, start, end, (), 0, out)
    return out


def _flat_boxes(
    shape: tuple[int, ...], start: int, end: int, prefix: tuple[int, ...], base: int, out: list[tuple[Box, int]]
) -> None:
    """Boxes of ``[start, end)`` of ``shape``'s flattening, each prefixed by the fixed leading indices
    ``prefix`` (as size-1 axes); ``base`` is the flat offset of element ``prefix + (0, ...)``."""
    if start >= end:
        return
    ones = (1,) * len(prefix)
    if not shape:
        out.append((Box(prefix, ones), base))
        return
    inner = math.prod(shape[1:])
    if inner == 0:
        return
    first_row, first_rem = divmod(start, inner)
    last_row, last_rem = divmod(end, inner)
    if first_row == last_row:
        _flat_boxes(shape[1:], first_rem, last_rem, (*prefix, first_row), base + first_row * inner, out)
        return
    whole_start = first_row
    if first_rem:
        _flat_boxes(shape[1:], first_rem, inner, (*prefix, first_row), base + first_row * inner, out)
        whole_start += 1
    if last_row > whole_start:
        out.append(
            (
                Box((*prefix, whole_start, *(0,) * (len(shape) - 1)), (*ones, last_row - whole_start, *shape[1:])),
                base + whole_start * inner,
            )
        )
    if last_rem:
        _flat_boxes(shape[1:], 0, last_rem, (*prefix, last_row), base + last_row * inner, out)
