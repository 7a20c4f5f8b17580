"""Does a set of boxes tile a global tensor exactly? Pure geometry, used at save and at load."""

from __future__ import annotations

import math
from dataclasses import dataclass

from reshard.boxes import Box

__all__ = ["TilingProblem", "find_tiling_problem"]


@dataclass(frozen=True, slots=True)
class TilingProblem:
    """Why boxes fail to tile a tensor: ``"overlap"`` of boxes ``indices[0]`` and ``indices[1]``, or a
    ``"gap"`` (``covered`` of ``total`` elements are covered, ``indices`` is empty)."""

    kind: str
    indices: tuple[int, ...]
    covered: int
    total: int


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
    axis = max(range(len(global_shape)), key=lambda a: len({b.offset[a] for _, b in live}))
    live.sort(key=lambda item: (item[1].offset[axis], item[0]))
    active: list[tuple[int, Box]] = []
    for index, box in live:
        start = box.offset[axis]
        active = [(j, other) for j, other in active if other.offset[axis] + other.shape[axis] > start]
        for j, other in active:
            if box.intersect(other) is not None:
                first, second = sorted((j, index))
                return TilingProblem("overlap", (first, second), 0, total)
        active.append((index, box))
    covered = sum(b.volume for _, b in live)
    if covered != total:
        return TilingProblem("gap", (), covered, total)
    return None
