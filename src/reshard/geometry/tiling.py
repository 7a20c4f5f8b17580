"""Does a set of boxes tile a global tensor exactly? Pure geometry, used at save and at load.

Two checks: :func:`find_tiling_problem` looks at one tensor's boxes and says what is wrong (which two boxes
overlap, or how much is covered); :func:`untiled_groups` checks many tensors at once, vectorised, and says
only which of them fail, so that the explanation is computed for those alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from reshard.geometry.boxes import Box
from reshard.geometry.sorting import lexsort

__all__ = ["MAX_CORNER_NDIM", "TilingProblem", "find_tiling_problem", "first_overlap", "untiled_groups"]

MAX_CORNER_NDIM = 8
""":func:`untiled_groups` takes boxes of at most this many axes (it looks at ``2 ** ndim`` corners each)."""

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class TilingProblem:
    """Why boxes fail to tile a tensor: ``"overlap"`` of boxes ``indices[0]`` and ``indices[1]``, or a
    ``"gap"`` (``covered`` of ``total`` elements are covered, ``indices`` is empty)."""

    kind: str
    indices: tuple[int, ...]
    covered: int
    total: int


def first_overlap(boxes: list[Box]) -> tuple[int, int] | None:
    """The indices (ascending) of two boxes of ``boxes`` that share an element, or None when no two do (boxes of
    volume 0 share nothing). A sweep along the axis on which the boxes start at the most distinct places, each box
    compared only with those still open there: near ``n log n`` for regular layouts (rows, columns, flat ranges),
    where comparing every pair was quadratic."""
    live = [(i, b) for i, b in enumerate(boxes) if b.volume > 0]
    if len(live) < 2:
        return None
    ndim = live[0][1].ndim
    if ndim == 0:
        return (live[0][0], live[1][0])
    axis = max(range(ndim), key=lambda a: len({b.offset[a] for _, b in live}))
    live.sort(key=lambda item: (item[1].offset[axis], item[0]))
    active: list[tuple[int, Box]] = []
    for index, box in live:
        start = box.offset[axis]
        active = [(j, other) for j, other in active if other.offset[axis] + other.shape[axis] > start]
        for j, other in active:
            if box.intersect(other) is not None:
                first, second = sorted((j, index))
                return (first, second)
        active.append((index, box))
    return None


def find_tiling_problem(global_shape: tuple[int, ...], boxes: list[Box]) -> TilingProblem | None:
    """Check that ``boxes`` (each already inside ``global_shape``) cover every element exactly once.

    Boxes of volume 0 are ignored. No overlap plus a total volume equal to the tensor's means an exact
    tiling. Overlaps are found by a sweep along the axis on which the boxes start at the most distinct
    places, which keeps regular tilings near ``n log n``.
    """
    total = math.prod(global_shape)
    live = [(i, b) for i, b in enumerate(boxes) if b.volume > 0]
    if len(global_shape) == 0:
        if len(live) > 1:
            return TilingProblem("overlap", (live[0][0], live[1][0]), len(live), 1)
        return None if live else TilingProblem("gap", (), 0, 1)
    overlap = first_overlap(boxes)
    if overlap is not None:
        return TilingProblem("overlap", overlap, 0, total)
    covered = sum(b.volume for _, b in live)
    if covered != total:
        return TilingProblem("gap", (), covered, total)
    return None


def untiled_groups(group: Int64Array, offset: Int64Array, end: Int64Array, domain: Int64Array) -> npt.NDArray[np.bool_]:
    """Which groups of boxes fail to tile their domain exactly, for many groups at once.

    Box ``i`` is ``[offset[i], end[i])`` and belongs to group ``group[i]``; group ``g`` must tile
    ``[0, domain[g])``. All boxes have the same number of axes ``d`` (the columns, at most
    :data:`MAX_CORNER_NDIM`) and lie inside their domain. Returns a boolean per group, True where the
    boxes overlap or leave a gap.

    Why it works: give each corner of a box the sign ``(-1) ** (number of axes on which it is the upper
    corner)``. Summing those signs point by point over a set of boxes gives the mixed finite difference of
    its coverage count, which determines the coverage count (both vanish far away). So a set of boxes
    covers every element of the domain exactly once if and only if its corner sums equal the domain's own
    corners: no sweep, no pairwise comparison, ``n * 2 ** d`` points sorted once.
    """
    groups = len(domain)
    bad = np.zeros(groups, dtype=bool)
    d = offset.shape[1] if offset.ndim == 2 else 0
    if d > MAX_CORNER_NDIM:
        raise ValueError(f"untiled_groups takes at most {MAX_CORNER_NDIM} axes, got {d}")
    live = np.flatnonzero((end > offset).all(axis=1)) if d else np.arange(len(group))
    # The domain's corners enter with the opposite sign; a domain with no element has none.
    full = np.flatnonzero((domain > 0).all(axis=1)) if d else np.arange(groups)
    lows = np.concatenate([offset[live], np.zeros((len(full), d), dtype=np.int64)])
    highs = np.concatenate([end[live], domain[full]])
    owner = np.concatenate([group[live], full]).astype(np.int64)
    weight = np.concatenate([np.ones(len(live), dtype=np.int64), -np.ones(len(full), dtype=np.int64)])
    if len(owner) == 0:
        return bad
    corners = []
    signs = []
    for mask in range(1 << d):
        upper = [(mask >> a) & 1 for a in range(d)]
        corners.append(np.stack([highs[:, a] if upper[a] else lows[:, a] for a in range(d)], axis=1) if d else lows)
        signs.append(weight * (-1 if sum(upper) % 2 else 1))
    points = np.concatenate(corners) if d else np.zeros((len(owner), 0), dtype=np.int64)
    owners = np.tile(owner, 1 << d)
    sign = np.concatenate(signs)
    order = lexsort((*(points[:, a] for a in range(d - 1, -1, -1)), owners))
    points, owners, sign = points[order], owners[order], sign[order]
    starts = np.ones(len(owners), dtype=bool)
    starts[1:] = (owners[1:] != owners[:-1]) | (points[1:] != points[:-1]).any(axis=1)
    first = np.flatnonzero(starts)
    sums = np.add.reduceat(sign, first)
    bad[owners[first[sums != 0]]] = True
    return bad
