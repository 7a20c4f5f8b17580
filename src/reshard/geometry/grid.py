"""The grid of a set of boxes: how a tiling is stored as a rule, and how a box's neighbours are found.

A *full cut* of a set of boxes on axis ``a`` is a coordinate that no box crosses: every box ends at or
before it, or starts at or after it. The full cuts of all axes cut the tensor into a rectilinear grid of
*cells*, each of which holds whole boxes. In the tilings that training layouts produce, tensor, pipeline
and expert parallelism are full cuts, so most cells hold exactly one box (the cell itself), and the
others, cut by a distributed optimizer's flat ranges, hold boxes that are each contiguous in the cell's
row-major flattening. Such a tiling is described completely by the cuts of every axis and, for each split
cell, where along its flattening each of its boxes starts: a few integers, whatever the number of boxes.
That is the packed geometry of the checkpoint format (version 2, ``docs/format.md``): :func:`grid_rule`
finds it, :func:`expand_grid` turns it back into boxes (validating it).

The same grid indexes boxes for lookup (:class:`BoxIndex`): the cells a query box touches are found by
bisection on each axis, and inside a split cell the boxes are sorted along the flattening, so finding the
boxes that overlap a query takes time in the number found, not in the number of boxes.

Everything here is pure and vectorised with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from reshard.geometry.boxes import Box
from reshard.geometry.sorting import lexsort

__all__ = ["BoxIndex", "GridRule", "expand_grid", "full_cuts", "grid_rule"]

Int64Array = npt.NDArray[np.int64]
_MAX_LINEAR = 2**62


def full_cuts(offset: Int64Array, end: Int64Array, extent: int) -> Int64Array:
    """The coordinates in ``[0, extent]`` that none of the non-empty intervals ``[offset[i], end[i])``
    crosses, sorted (0 and ``extent`` always among them)."""
    values = np.sort(np.concatenate([offset, end, np.array([0, extent], dtype=np.int64)]))
    candidates = values[np.concatenate([[True], values[1:] != values[:-1]])]  # np.unique would import numpy.ma
    starts = np.sort(offset)
    ends = np.sort(end)
    # Intervals strictly around c: those starting before c, less those ending at or before c.
    crossing = np.searchsorted(starts, candidates, "left") - np.searchsorted(ends, candidates, "right")
    cuts: Int64Array = candidates[(crossing == 0) & (candidates <= extent)]
    return cuts


def _row_strides(shape: Int64Array) -> Int64Array:
    """Row-major element strides of each row of ``shape`` (one shape per row)."""
    strides = np.ones_like(shape)
    if shape.shape[1] > 1:
        strides[:, :-1] = np.cumprod(shape[:, :0:-1], axis=1)[:, ::-1]
    return strides


def _contiguous(rel: Int64Array, shape: Int64Array, outer: Int64Array) -> npt.NDArray[np.bool_]:
    """Whether each box (at ``rel`` inside a box of shape ``outer``, of shape ``shape``) is one contiguous
    run of ``outer``'s row-major flattening: extent 1 on the axes before some axis ``m``, whole axes after
    it."""
    d = shape.shape[1]
    if d == 0:
        return np.ones(len(shape), dtype=bool)
    not_one = shape != 1
    m = np.where(not_one.any(axis=1), np.argmax(not_one, axis=1), d)
    after = np.arange(d)[None, :] > m[:, None]
    return np.asarray((~after | ((rel == 0) & (shape == outer))).all(axis=1))


@dataclass(frozen=True, slots=True)
class GridRule:
    """A tiling as a rule (see the module docstring).

    Attributes:
        cuts: per axis, the full cuts, ``0`` first and the axis length last.
        split_cells: the row-major numbers of the cells that hold more than one box, increasing.
        split_counts: for each split cell, how many boxes start after its first element (its boxes - 1).
        split_starts: for each split cell in turn, where its boxes after the first start along its
            row-major flattening, increasing.
        order: the boxes in the rule's order (cells in row-major order, a split cell's boxes along its
            flattening), as indices into the boxes the rule was made from.
    """

    cuts: tuple[Int64Array, ...]
    split_cells: Int64Array
    split_counts: Int64Array
    split_starts: Int64Array
    order: Int64Array


def grid_rule(offset: Int64Array, shape: Int64Array, global_shape: tuple[int, ...]) -> GridRule | None:
    """The rule of the tiling of ``global_shape`` by the non-empty boxes ``offset``/``shape`` (one box per
    row), or None when it has none: a cell holds boxes that are not each contiguous in its flattening.

    The boxes must tile the tensor (the caller validated it); the rule is checked by expanding it again.
    """
    n, d = shape.shape
    if n == 0 or (shape <= 0).any():
        return None
    end = offset + shape
    cuts = tuple(full_cuts(offset[:, a], end[:, a], global_shape[a]) for a in range(d))
    counts = [len(c) - 1 for c in cuts]
    if math.prod(counts) > n:
        return None  # not a tiling: a tiling has at least one box per cell
    coord = np.stack([np.searchsorted(cuts[a], offset[:, a], "right") - 1 for a in range(d)], axis=1) if d else None
    if coord is None:
        cell_id = np.zeros(n, dtype=np.int64)
        lo = hi = np.zeros((n, 0), dtype=np.int64)
    else:
        lo = np.stack([cuts[a][coord[:, a]] for a in range(d)], axis=1)
        hi = np.stack([cuts[a][coord[:, a] + 1] for a in range(d)], axis=1)
        cell_id = np.zeros(n, dtype=np.int64)
        for a in range(d):
            cell_id = cell_id * counts[a] + coord[:, a]
    cell_shape = hi - lo
    rel = offset - lo
    flat = (rel * _row_strides(cell_shape)).sum(axis=1)
    boxes_in_cell = np.bincount(cell_id, minlength=math.prod(counts))
    split = boxes_in_cell[cell_id] > 1
    if not _contiguous(rel[split], shape[split], cell_shape[split]).all():
        return None
    order = lexsort((flat, cell_id))
    split_cells = np.flatnonzero(boxes_in_cell > 1).astype(np.int64)
    starts_in_order = flat[order]
    first = np.ones(n, dtype=bool)
    first[1:] = cell_id[order][1:] != cell_id[order][:-1]
    rule = GridRule(
        cuts=cuts,
        split_cells=split_cells,
        split_counts=boxes_in_cell[split_cells].astype(np.int64) - 1,
        split_starts=starts_in_order[~first & split[order]].astype(np.int64),
        order=order.astype(np.int64),
    )
    try:
        again_offset, again_shape = expand_grid(
            global_shape, rule.cuts, rule.split_cells, rule.split_counts, rule.split_starts
        )
    except ValueError:
        return None
    if not (np.array_equal(again_offset, offset[order]) and np.array_equal(again_shape, shape[order])):
        return None
    return rule


def expand_grid(
    global_shape: tuple[int, ...],
    cuts: tuple[Int64Array, ...],
    split_cells: Int64Array,
    split_counts: Int64Array,
    split_starts: Int64Array,
) -> tuple[Int64Array, Int64Array]:
    """The boxes (offsets, shapes; one per row, in the rule's order) that a rule describes.

    Every part of the rule is checked, so the result tiles ``global_shape`` exactly; the number of boxes is
    ``number of cells + sum(split_counts)``, which the caller bounds before calling.

    Raises:
        ValueError: saying what is wrong with the rule.
    """
    d = len(global_shape)
    if len(cuts) != d:
        raise ValueError(f"the grid has {len(cuts)} axes, the tensor {d}")
    for a, (c, extent) in enumerate(zip(cuts, global_shape, strict=True)):
        if len(c) == 0 or c[0] != 0 or c[-1] != extent or (len(c) > 1 and (np.diff(c) <= 0).any()):
            raise ValueError(f"the cuts of axis {a} must rise strictly from 0 to {extent}")
        if extent == 0 and len(c) != 1:
            raise ValueError(f"the cuts of axis {a} must be [0] on an axis of length 0")
    counts = [len(c) - 1 for c in cuts]
    cells = math.prod(counts)
    if len(split_cells) != len(split_counts):
        raise ValueError("split cells and their counts differ in number")
    if len(split_cells) and (split_cells[0] < 0 or split_cells[-1] >= cells or (np.diff(split_cells) <= 0).any()):
        raise ValueError(f"split cells must be distinct cell numbers below {cells}, increasing")
    if (split_counts < 1).any() or int(split_counts.sum()) != len(split_starts):
        raise ValueError("every split cell needs at least one start, and the starts must add up")
    # Every cell: its coordinates, corner and shape.
    cell_ids = np.arange(cells, dtype=np.int64)
    lo = np.zeros((cells, d), dtype=np.int64)
    hi = np.zeros((cells, d), dtype=np.int64)
    rest = cell_ids.copy()
    for a in range(d - 1, -1, -1):
        index = rest % counts[a]
        rest //= counts[a]
        lo[:, a] = cuts[a][index]
        hi[:, a] = cuts[a][index + 1]
    cell_shape = hi - lo
    volume = np.prod(cell_shape, axis=1) if d else np.ones(cells, dtype=np.int64)
    # Boxes per cell, in order: one for an unsplit cell, 1 + count for a split one.
    per_cell = np.ones(cells, dtype=np.int64)
    per_cell[split_cells] += split_counts
    owner = np.repeat(cell_ids, per_cell)
    first = np.ones(len(owner), dtype=bool)
    first[1:] = owner[1:] != owner[:-1]
    start = np.zeros(len(owner), dtype=np.int64)
    start[~first] = split_starts
    stop = np.empty(len(owner), dtype=np.int64)
    stop[:-1] = np.where(first[1:], volume[owner[:-1]], start[1:])
    if len(owner):
        stop[-1] = volume[owner[-1]]
    if (stop <= start).any() or (start < 0).any():
        raise ValueError("the starts of a split cell must rise strictly inside the cell")
    if not first.all():
        shapes = cell_shape[owner]
        strides = _row_strides(shapes)
        first_at = (start[:, None] // strides) % np.maximum(shapes, 1)
        last_at = ((stop - 1)[:, None] // strides) % np.maximum(shapes, 1)
        box_shape = last_at - first_at + 1
        if not _contiguous(first_at, box_shape, shapes).all() or (np.prod(box_shape, axis=1) != stop - start).any():
            raise ValueError("a box of a split cell is not one contiguous run of the cell's flattening")
        return lo[owner] + first_at, box_shape
    return lo, cell_shape


class BoxIndex:
    """Finds which of a fixed set of boxes overlap a given box.

    Built once per tensor (``n log n``), then each :meth:`overlapping` takes time in the number of boxes
    it returns: the query's cells are found by bisection on each axis, a cell holding several boxes that
    are contiguous in its flattening is searched by bisection along it. Works for any set of boxes (a
    tiling or not); boxes with no element never overlap anything. A set of at most :data:`SCAN_BOXES`
    boxes is not indexed: each lookup compares the query with every box, which is cheaper at that size than
    building the grid.
    """

    SCAN_BOXES = 16

    def __init__(self, offset: Int64Array, shape: Int64Array) -> None:
        self.offset = offset
        self.end = offset + shape
        n, d = shape.shape
        self.ndim = d
        live = np.flatnonzero((shape > 0).all(axis=1)) if d else np.arange(n, dtype=np.int64)
        self.scan: Int64Array | None = live if n <= self.SCAN_BOXES else None
        if self.scan is not None:
            return
        live_offset, live_end = offset[live], self.end[live]
        self.cuts = [full_cuts(live_offset[:, a], live_end[:, a], int(live_end[:, a].max(initial=0))) for a in range(d)]
        coord = (
            np.stack(
                [np.maximum(np.searchsorted(self.cuts[a], live_offset[:, a], "right") - 1, 0) for a in range(d)], axis=1
            )
            if d
            else np.zeros((len(live), 0), dtype=np.int64)
        )
        # Cells are numbered by their coordinates in row-major order (sorted lexicographically).
        order = lexsort((*(coord[:, a] for a in range(d - 1, -1, -1)),)) if d else np.arange(len(live))
        lo = np.stack([self.cuts[a][coord[:, a]] for a in range(d)], axis=1) if d else coord
        hi = (
            np.stack([self.cuts[a][np.minimum(coord[:, a] + 1, len(self.cuts[a]) - 1)] for a in range(d)], axis=1)
            if d
            else coord
        )
        flat_start = ((live_offset - lo) * _row_strides(hi - lo)).sum(axis=1)
        new_cell = np.ones(len(live), dtype=bool)
        sorted_coord = coord[order]
        new_cell[1:] = (sorted_coord[1:] != sorted_coord[:-1]).any(axis=1) if d else False
        cell_number = np.cumsum(new_cell) - 1
        # Inside a cell, boxes along its flattening.
        order = order[lexsort((flat_start[order], cell_number))]
        self.box_of = live[order]
        self.flat_start = flat_start[order]
        volume = np.prod(live_end - live_offset, axis=1) if d else np.ones(len(live), dtype=np.int64)
        self.flat_stop = self.flat_start + volume[order]
        self.cell_first = np.flatnonzero(new_cell)
        self.cell_stop = np.append(self.cell_first[1:], len(order))
        self.cell_coord = coord[order][self.cell_first]
        self.cell_lo = lo[order][self.cell_first]
        self.cell_hi = hi[order][self.cell_first]
        contiguous = _contiguous((live_offset - lo)[order], (live_end - live_offset)[order], (hi - lo)[order])
        disjoint = np.ones(len(order), dtype=bool)
        disjoint[1:] = (self.flat_stop[:-1] <= self.flat_start[1:]) | new_cell[1:]
        # A cell can be searched along its flattening when its boxes are contiguous runs that do not overlap.
        good = np.add.reduceat((contiguous & disjoint).astype(np.int64), self.cell_first) if len(order) else order
        self.searchable = good == (self.cell_stop - self.cell_first)
        counts = [len(c) - 1 for c in self.cuts]
        self.cell_key = np.zeros(len(self.cell_first), dtype=np.int64)
        self.dense = math.prod(counts) <= _MAX_LINEAR
        if self.dense:  # cells are found by their row-major number
            for a in range(d):
                self.cell_key = self.cell_key * max(counts[a], 1) + self.cell_coord[:, a]
        self.counts = counts

    def overlapping(self, box: Box) -> list[int]:
        """The indices of the boxes that share an element with ``box``, increasing."""
        if box.ndim != self.ndim:
            raise ValueError(f"cannot look up a box of {box.ndim} axes among boxes of {self.ndim}")
        q_lo = np.asarray(box.offset, dtype=np.int64)
        q_hi = np.asarray(box.end, dtype=np.int64)
        if self.scan is not None:
            if (q_hi <= q_lo).any():
                return []
            live = self.scan
            hit = (self.offset[live] < q_hi).all(axis=1) & (self.end[live] > q_lo).all(axis=1)
            return sorted(live[hit].tolist())
        if (q_hi <= q_lo).any() or len(self.cell_first) == 0:
            return []
        first = np.zeros(self.ndim, dtype=np.int64)
        last = np.zeros(self.ndim, dtype=np.int64)
        for a in range(self.ndim):
            first[a] = max(int(np.searchsorted(self.cuts[a], q_lo[a], "right")) - 1, 0)
            last[a] = min(int(np.searchsorted(self.cuts[a], q_hi[a], "left")) - 1, self.counts[a] - 1)
        if (last < first).any():
            return []
        spans = last - first + 1
        if self.dense and math.prod(spans.tolist()) <= len(self.cell_key):
            wanted = np.zeros(1, dtype=np.int64)
            for a in range(self.ndim):
                wanted = (wanted[:, None] * max(self.counts[a], 1) + np.arange(first[a], last[a] + 1)[None, :]).ravel()
            at = np.searchsorted(self.cell_key, wanted)
            inside = at < len(self.cell_key)
            at, wanted = at[inside], wanted[inside]
            cells = at[self.cell_key[at] == wanted]
        else:
            cells = np.flatnonzero(((self.cell_coord >= first) & (self.cell_coord <= last)).all(axis=1))
        candidates = []
        for c in cells.tolist():
            lo, hi = int(self.cell_first[c]), int(self.cell_stop[c])
            if hi - lo > 1 and self.searchable[c]:
                # The query's first and last elements in this cell bound the boxes it can touch.
                cell_lo, cell_hi = self.cell_lo[c], self.cell_hi[c]
                strides = _row_strides((cell_hi - cell_lo)[None, :])[0]
                f_lo = int(((np.maximum(q_lo, cell_lo) - cell_lo) * strides).sum())
                f_hi = int(((np.minimum(q_hi, cell_hi) - 1 - cell_lo) * strides).sum())
                lo, hi = (
                    lo + int(np.searchsorted(self.flat_stop[lo:hi], f_lo, "right")),
                    lo + int(np.searchsorted(self.flat_start[lo:hi], f_hi, "right")),
                )
            candidates.append(self.box_of[lo:hi])
        if not candidates:
            return []
        found = np.concatenate(candidates)
        hit = (self.offset[found] < q_hi).all(axis=1) & (self.end[found] > q_lo).all(axis=1)
        return sorted(found[hit].tolist())
