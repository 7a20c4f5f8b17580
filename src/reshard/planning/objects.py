"""Which ShardedObject cells of a load template the checkpoint fills, by the policy for a changed grid.

Per-rank objects (an RNG state per (pp, tp) rank, a data loader's position) do not reshard: a cell holds one
rank's value. When a job resumes on another layout, the template's grid of an object differs from the saved
one, and what to do is the user's choice, ``LoadOptions(object_grid=...)``, never a silent default:

- ``"exact"`` (the default): a changed grid is a :class:`~reshard.MismatchError`;
- ``"same_coordinate"``: each requested cell loads the saved cell of the same coordinate; a requested cell
  outside the saved grid (a rank the saved layout did not have) keeps the template's value, and saved cells
  outside the requested grid are loaded by no rank: both are named. The grids must have the same axes;
- ``"skip"``: no cell of an object whose grid changed is loaded: every requested cell keeps the template's
  value, and every saved cell is named as not loaded.

An object whose grid did not change loads as ever under every policy. Pure: no I/O, no collectives; every
rank whose template holds an object computes the same saved cells for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from reshard.metadata import ObjectMetadata
from reshard.state.sharding import ShardedObject

__all__ = ["OBJECT_GRIDS", "ObjectGrid", "ObjectMatch", "match_objects"]

ObjectGrid = Literal["exact", "same_coordinate", "skip"]
OBJECT_GRIDS: tuple[ObjectGrid, ...] = ("exact", "same_coordinate", "skip")
"""The policies of ``LoadOptions(object_grid=...)``."""


@dataclass(frozen=True)
class ObjectMatch:
    """The template's ShardedObject cells against the checkpoint.

    Attributes:
        present: the cells to read (the saved cell of the same coordinate).
        missing: cells the checkpoint lacks although the grid is the same (``strict`` decides).
        kept: cells whose saved grid changed and that, by the policy, keep the template's value.
        ignored: saved cells of a changed grid that no requested cell loads (the same on every rank whose
            template holds the object).
        changed: one line per object whose grid changed and the policy accepted, for the warning.
        mismatches: grid changes the policy refuses (a :class:`~reshard.MismatchError`).
    """

    present: tuple[ShardedObject, ...] = ()
    missing: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    mismatches: tuple[str, ...] = ()


def cell_name(key: str, offset: Sequence[int]) -> str:
    """How a load names one cell: ``object 'rng' at [1, 0]`` (as ``LoadStats.missing`` does)."""
    return f"object {key!r} at {list(offset)}"


def _inside(offset: Sequence[int], grid: Sequence[int]) -> bool:
    return len(offset) == len(grid) and all(o < n for o, n in zip(offset, grid, strict=True))


def _grids(saved: ObjectMetadata, requested: tuple[int, ...]) -> str:
    return f"object {saved.key!r}: saved grid {list(saved.global_shape)}, requested {list(requested)}"


def _refused(saved: ObjectMetadata, requested: tuple[int, ...], policy: ObjectGrid) -> str | None:
    """Why ``policy`` refuses the grid change of ``saved`` to ``requested``, or None."""
    grids = _grids(saved, requested)
    if policy == "exact":
        return (
            f"{grids} (LoadOptions(object_grid='same_coordinate') loads the cells both grids hold, "
            "object_grid='skip' none of them)"
        )
    if policy == "same_coordinate" and len(saved.global_shape) != len(requested):
        return (
            f"{grids}: another number of axes has no same coordinate (LoadOptions(object_grid='skip') leaves "
            "the template's values)"
        )
    return None


def _ignored(saved: ObjectMetadata, requested: tuple[int, ...], policy: ObjectGrid) -> list[str]:
    """The saved cells of a changed grid that no requested cell of ``requested`` loads, in grid order."""
    offsets = sorted(e.offset for e in saved.entries)
    return [cell_name(saved.key, o) for o in offsets if policy == "skip" or not _inside(o, requested)]


def match_objects(
    objects: Iterable[ShardedObject], saved: Mapping[str, ObjectMetadata], policy: ObjectGrid
) -> ObjectMatch:
    """Match the template's ShardedObject cells with the saved objects under the grid ``policy`` (module
    docstring). A key the checkpoint lacks is missing, as is a cell of an unchanged grid it holds no value
    of."""
    present: list[ShardedObject] = []
    missing: list[str] = []
    kept: list[str] = []
    ignored: dict[str, list[str]] = {}
    changed: dict[str, str] = {}
    mismatches: dict[str, str] = {}
    for obj in objects:
        entry = saved.get(obj.key)
        name = cell_name(obj.key, obj.global_offset)
        if entry is None:
            missing.append(name)
            continue
        held = any(e.offset == obj.global_offset for e in entry.entries)
        if entry.global_shape != obj.global_shape:
            refused = _refused(entry, obj.global_shape, policy)
            if refused is not None:
                mismatches.setdefault(obj.key, refused)
                continue
            changed.setdefault(obj.key, _grids(entry, obj.global_shape))
            ignored.setdefault(obj.key, _ignored(entry, obj.global_shape, policy))
            if policy == "skip" or not _inside(obj.global_offset, entry.global_shape):
                kept.append(name)
                continue
        if held:
            present.append(obj)
        else:
            missing.append(name)
    return ObjectMatch(
        present=tuple(present),
        missing=tuple(missing),
        kept=tuple(kept),
        ignored=tuple(name for names in ignored.values() for name in names),
        changed=tuple(changed.values()),
        mismatches=tuple(mismatches.values()),
    )
