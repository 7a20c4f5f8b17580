"""Save planning: validate the global layout that the ranks describe and elect one writer per box.

Pure functions over plain values: they take every rank's description (what the coordinator gathered)
and return, per rank, which of its pieces it writes. They can be run for any number of simulated ranks
in one process.

At scale the coordinator never holds a million piece objects: each rank sends its description in the
compact form of :func:`encode_description`, the coordinator decodes all of them into one
:class:`DescriptionTable` (columns of integers) and :func:`plan_save_table` validates and elects on
those columns, vectorised.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from reshard.errors import ShardingError
from reshard.geometry.boxes import Box
from reshard.geometry.sorting import lexsort
from reshard.geometry.tiling import MAX_CORNER_NDIM, find_tiling_problem, untiled_groups
from reshard.planning.descriptions import (
    DescriptionTable,
    LocalSaveDescription,
    ObjectPiece,
    TensorPiece,
    WriteAssignment,
)
from reshard.state.dtypes import DTYPE_BY_NAME
from reshard.state.sharding import is_main_replica

__all__ = ["BoxGroups", "elect_writers", "header_domains", "plan_save", "plan_save_table", "untiled_keys"]

Int64Array = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

_MAX_BYTES = 2**62


def _box_text(box: Box) -> str:
    return f"offset {list(box.offset)} shape {list(box.shape)}"


def plan_save(descriptions: list[LocalSaveDescription]) -> list[WriteAssignment]:
    """Validate the layout described by every rank and choose who writes each box.

    Checks, for every tensor key: all ranks agree on dtype and global shape; the primary boxes (replica
    id all zeros) tile the global tensor exactly: no gap, no overlap, no box claimed as primary twice;
    every replica box equals a primary box. For every object key: ranks agree on the grid shape and
    every cell has exactly one primary.

    Writers are balanced: every box is written by one of the ranks that hold it (its primary or any
    replica); boxes are assigned from the largest down to the holder with the fewest bytes assigned so
    far (ties to the lower rank), so replicated state is spread over its replicas. The result depends only
    on the descriptions, so it is the same wherever it is computed.

    This is :func:`plan_save_table` on the descriptions' :class:`DescriptionTable`.

    Raises:
        ShardingError: naming the key, the ranks and the boxes involved.
    """
    return plan_save_table(DescriptionTable.from_descriptions(descriptions))


def plan_save_table(table: DescriptionTable) -> list[WriteAssignment]:
    """:func:`plan_save` on every rank's pieces in columns: what the coordinator runs.

    The checks are vectorised over all pieces at once (sorting, not pairwise comparison: about
    ``n log n`` for ``n`` pieces, a few seconds for a million), and the tiling of each tensor is checked
    by corner sums (:func:`~reshard.geometry.tiling.untiled_groups`). A tensor that fails a check, or that
    they cannot take (more than :data:`~reshard.geometry.tiling.MAX_CORNER_NDIM` axes, more than 2**62
    bytes, an unknown dtype), goes through the piece-by-piece validation, which raises the error naming
    ranks and boxes (or, for the tensors the vectorised checks cannot take, accepts it). Tensors are
    reported in key order, so the error raised is the same as a piece-by-piece check of every key.
    """
    piece_key = table.header_key[table.header]
    domain, itemsize, slow = header_domains(table)
    ends = table.offset + table.shape
    inside = (table.ndim == _header_ndim(table)[table.header]) & (ends <= domain[table.header]).all(axis=1)
    slow = slow | _mask(len(table.keys), piece_key[~inside])
    groups = BoxGroups.of(table, piece_key, slow)
    slow = slow | _mask(len(table.keys), piece_key[groups.order[groups.start[groups.primaries != 1]]])
    slow = slow | untiled_keys(table, piece_key, slow, groups.primary, domain)
    # The keys that failed a check: piece by piece, in key order, which raises the first error.
    slow_jobs: list[_Job] = []
    for key_id in sorted(np.flatnonzero(slow).tolist(), key=table.keys.__getitem__):
        rows = np.flatnonzero(piece_key == key_id)
        pieces = [(int(table.rank[r]), int(table.index[r]), table.tensor_piece(int(r))) for r in rows]
        slow_jobs.extend(_validate_tensor(table.keys[key_id], pieces))
    assigned_tensors = elect_writers(table, piece_key, slow, groups, itemsize, slow_jobs)
    assigned_objects = _object_writers(table)
    return [
        WriteAssignment(tensors=tuple(sorted(t)), objects=tuple(sorted(o)))
        for t, o in zip(assigned_tensors, assigned_objects, strict=True)
    ]


def _mask(size: int, key_ids: Int64Array) -> BoolArray:
    """A mask of ``size`` keys, set at ``key_ids``."""
    mask = np.zeros(size, dtype=bool)
    mask[key_ids] = True
    return mask


def _header_ndim(table: DescriptionTable) -> Int64Array:
    return np.array([len(s) for s in table.header_shape], dtype=np.int64)


def header_domains(table: DescriptionTable) -> tuple[Int64Array, Int64Array, BoolArray]:
    """Per header (a key's dtype and global shape as some rank describes it): its global shape padded to the
    table's width, its item size, and the keys the vectorised checks cannot take (the piece-by-piece validation
    looks at them): keys on which ranks disagree (more than one header), and keys whose dtype is unknown, with more
    axes than :data:`~reshard.geometry.tiling.MAX_CORNER_NDIM` or the table's width, or of more than 2**62 bytes."""
    width = table.offset.shape[1]
    header_key = table.header_key
    slow = np.bincount(header_key, minlength=len(table.keys)) > 1
    domain = np.zeros((len(header_key), width), dtype=np.int64)
    itemsize = np.zeros(len(header_key), dtype=np.int64)
    for h, (dtype, shape) in enumerate(zip(table.header_dtype, table.header_shape, strict=True)):
        torch_dtype = DTYPE_BY_NAME.get(dtype)
        if (
            torch_dtype is None
            or len(shape) > min(width, MAX_CORNER_NDIM)
            or math.prod(shape) * torch_dtype.itemsize > _MAX_BYTES
        ):
            slow[header_key[h]] = True
            continue
        domain[h, : len(shape)] = shape
        itemsize[h] = torch_dtype.itemsize
    return domain, itemsize, slow


@dataclass(frozen=True, slots=True)
class BoxGroups:
    """The pieces of the keys still checked that hold data, grouped by box: ``order`` sorts them by (key, offset,
    shape), group ``g`` starts at ``order[start[g]]``; ``holders`` is ``order`` with each group's primary first,
    then its replicas in (rank, index) order; ``primary[g]`` is group ``g``'s first holder, ``primaries[g]`` how
    many primaries it has (a valid layout: exactly one)."""

    order: Int64Array
    start: Int64Array
    holders: Int64Array
    primary: Int64Array
    primaries: Int64Array

    @classmethod
    def of(cls, table: DescriptionTable, piece_key: Int64Array, slow: BoolArray) -> BoxGroups:
        width = table.offset.shape[1]
        live = np.flatnonzero(
            ~slow[piece_key] & ((table.shape > 0) | (np.arange(width) >= table.ndim[:, None])).all(axis=1)
        )
        order = live[
            lexsort(
                (
                    *(table.shape[live, a] for a in range(width - 1, -1, -1)),
                    *(table.offset[live, a] for a in range(width - 1, -1, -1)),
                    piece_key[live],
                )
            )
        ]
        starts = np.ones(len(order), dtype=bool)
        if len(order):
            starts[1:] = (piece_key[order[1:]] != piece_key[order[:-1]]) | (
                (table.offset[order[1:]] != table.offset[order[:-1]])
                | (table.shape[order[1:]] != table.shape[order[:-1]])
            ).any(axis=1)
        start = np.flatnonzero(starts)
        main = table.replica_main[table.replica]
        primaries = np.add.reduceat(main[order].astype(np.int64), start) if len(order) else np.zeros(0, np.int64)
        group_of = np.cumsum(starts) - 1
        holder_order = lexsort((np.arange(len(order)), ~main[order], group_of)) if len(order) else order
        holders = order[holder_order]
        return cls(order=order, start=start, holders=holders, primary=holders[start], primaries=primaries)


def untiled_keys(
    table: DescriptionTable, piece_key: Int64Array, slow: BoolArray, primary: Int64Array, domain: Int64Array
) -> BoolArray:
    """The keys, among those not ``slow``, whose primary boxes (``primary``: one piece per box) do not tile their
    global tensor exactly (checked by corner sums, :func:`~reshard.geometry.tiling.untiled_groups`, for the keys of
    each number of axes together)."""
    header_key = table.header_key
    good_key = ~slow
    untiled = np.zeros(len(table.keys), dtype=bool)
    ends = table.offset + table.shape
    checked = [h for h in range(len(header_key)) if good_key[header_key[h]]]
    for ndim in sorted({len(table.header_shape[h]) for h in checked}):
        headers = [h for h in checked if len(table.header_shape[h]) == ndim]
        local = np.full(len(table.keys), -1, dtype=np.int64)
        local[header_key[headers]] = np.arange(len(headers))
        boxes = primary[good_key[piece_key[primary]] & (local[piece_key[primary]] >= 0)]
        bad = untiled_groups(
            local[piece_key[boxes]], table.offset[boxes, :ndim], ends[boxes, :ndim], domain[headers, :ndim]
        )
        untiled[header_key[np.asarray(headers, dtype=np.int64)[bad]]] = True
    return untiled


def elect_writers(
    table: DescriptionTable,
    piece_key: Int64Array,
    slow: BoolArray,
    groups: BoxGroups,
    itemsize: Int64Array,
    slow_jobs: list[_Job],
) -> list[list[int]]:
    """Per rank, the indices of the boxes it writes: one job per box group of a key that passed the vectorised
    checks, plus ``slow_jobs`` (from the piece-by-piece validation); jobs go from the largest down (ties by key,
    then offset) to the holder with the fewest bytes assigned so far (ties to the lower rank)."""
    keys = table.keys
    width = table.offset.shape[1]
    key_rank = np.empty(len(keys), dtype=np.int64)
    key_rank[sorted(range(len(keys)), key=keys.__getitem__)] = np.arange(len(keys), dtype=np.int64)
    primary = groups.primary
    group_ids = np.flatnonzero(~slow[piece_key[primary]])
    first = primary[group_ids]
    job_bytes = itemsize[table.header[first]] * np.prod(
        np.where(np.arange(width) < table.ndim[first, None], table.shape[first], 1), axis=1
    )
    job_offset = table.offset[first]
    job_order = lexsort((*(job_offset[:, a] for a in range(width - 1, -1, -1)), key_rank[piece_key[first]], -job_bytes))
    bounds = np.append(groups.start, len(groups.order)).tolist()
    holder_rank = table.rank[groups.holders].tolist()
    holder_index = table.index[groups.holders].tolist()
    if slow_jobs:  # rare: merge with the piece-by-piece jobs under the same ordering
        every = slow_jobs + [
            (
                int(job_bytes[j]),
                keys[int(piece_key[primary[g]])],
                tuple(int(v) for v in job_offset[j, : int(table.ndim[primary[g]])]),
                list(zip(holder_rank[bounds[g] : bounds[g + 1]], holder_index[bounds[g] : bounds[g + 1]], strict=True)),
            )
            for j, g in enumerate(group_ids.tolist())
        ]
        ordered = [(nbytes, hs) for nbytes, _key, _offset, hs in sorted(every, key=lambda j: (-j[0], j[1], j[2]))]
        return _elect_in_order(table.world, ordered)
    assigned: list[list[int]] = [[] for _ in range(table.world)]
    load = [0] * table.world
    sizes = job_bytes.tolist()
    ids = group_ids.tolist()
    for j in job_order.tolist():
        g = ids[j]
        best = bounds[g]
        best_rank = holder_rank[best]
        for h in range(best + 1, bounds[g + 1]):
            rank = holder_rank[h]
            if load[rank] < load[best_rank] or (load[rank] == load[best_rank] and rank < best_rank):
                best, best_rank = h, rank
        load[best_rank] += sizes[j]
        assigned[best_rank].append(holder_index[best])
    return assigned


def _elect_in_order(world: int, ordered: list[tuple[int, list[tuple[int, int]]]]) -> list[list[int]]:
    """Per rank, the boxes it writes: each job ``(bytes, holders as (rank, index))``, in order, to the holder with
    the fewest bytes assigned so far (ties to the lower rank)."""
    assigned: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for nbytes, hs in ordered:
        rank, index = min(hs, key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        assigned[rank].append(index)
    return assigned


def _object_writers(table: DescriptionTable) -> list[list[int]]:
    """Per rank, the indices of the object cells it writes (their primaries), each object validated."""
    assigned: list[list[int]] = [[] for _ in range(table.world)]
    objects_by_key: dict[str, list[tuple[int, int, ObjectPiece]]] = defaultdict(list)
    for rank, objects in enumerate(table.objects):
        for index, obj in enumerate(objects):
            objects_by_key[obj.key].append((rank, index, obj))
    for key in sorted(objects_by_key):
        for rank, index in _validate_object(key, objects_by_key[key]):
            assigned[rank].append(index)
    return assigned


_Job = tuple[int, str, tuple[int, ...], list[tuple[int, int]]]


def _validate_tensor(
    key: str, pieces: list[tuple[int, int, TensorPiece]]
) -> list[tuple[int, str, tuple[int, ...], list[tuple[int, int]]]]:
    """Check one tensor's pieces; return its write jobs: (bytes, key, offset, holders as (rank, index))."""
    first_rank, _, first = pieces[0]
    for rank, _, piece in pieces:
        if not piece.box.is_inside(piece.global_shape):
            raise ShardingError(
                f"{key!r}: rank {rank} describes box {_box_text(piece.box)}, which does not lie inside its "
                f"global_shape {list(piece.global_shape)}"
            )
        if piece.dtype != first.dtype:
            raise ShardingError(
                f"{key!r}: ranks disagree on dtype: rank {first_rank} has {first.dtype}, rank {rank} has {piece.dtype}"
            )
        if piece.global_shape != first.global_shape:
            raise ShardingError(
                f"{key!r}: ranks disagree on global_shape: rank {first_rank} has {list(first.global_shape)}, "
                f"rank {rank} has {list(piece.global_shape)}"
            )
    primaries = [(rank, index, p) for rank, index, p in pieces if is_main_replica(p.replica_id) and p.box.volume > 0]
    holders: dict[Box, list[tuple[int, int]]] = {}
    for rank, index, piece in primaries:
        if piece.box in holders:
            other = holders[piece.box][0][0]
            raise ShardingError(
                f"{key!r}: box {_box_text(piece.box)} is claimed as primary by ranks {other} and {rank}; "
                "give all but one copy a non-zero replica_id"
            )
        holders[piece.box] = [(rank, index)]
    if not primaries and any(p.box.volume for _, _, p in pieces):
        raise ShardingError(
            f"{key!r}: no rank holds a primary copy (replica_id 0): ranks {sorted({r for r, _, _ in pieces})} "
            "all hold replicas; the group must include the rank holding replica 0 (rank 0 of the group for a plain "
            "tensor, coordinate 0 of the replicated mesh dimensions for a DTensor)"
        )
    for rank, index, piece in pieces:
        if is_main_replica(piece.replica_id) or piece.box.volume == 0:
            continue
        if piece.box not in holders:
            raise ShardingError(
                f"{key!r}: rank {rank} holds a replica (replica_id {piece.replica_id}) of box "
                f"{_box_text(piece.box)}, which no rank holds as primary; a replica must equal its primary's box"
            )
        holders[piece.box].append((rank, index))
    problem = find_tiling_problem(first.global_shape, [p.box for _, _, p in primaries])
    if problem is not None:
        if problem.kind == "overlap":
            (ra, _, a), (rb, _, b) = (primaries[i] for i in problem.indices)
            raise ShardingError(
                f"{key!r}: primary boxes overlap: rank {ra} {_box_text(a.box)} and rank {rb} {_box_text(b.box)}"
            )
        raise ShardingError(
            f"{key!r}: primary boxes cover {problem.covered} of {problem.total} elements of global_shape "
            f"{list(first.global_shape)} (ranks with primaries: {sorted({r for r, _, _ in primaries})}); "
            "some part of the tensor is held by no rank as primary"
        )
    itemsize = DTYPE_BY_NAME[first.dtype].itemsize
    return [(box.volume * itemsize, key, box.offset, hs) for box, hs in holders.items()]


def _validate_object(key: str, pieces: list[tuple[int, int, ObjectPiece]]) -> list[tuple[int, int]]:
    """Check one object's cells; return the writers as (rank, index)."""
    first_rank, _, first = pieces[0]
    cells: dict[tuple[int, ...], int] = {}
    writers = []
    for rank, index, piece in pieces:
        if piece.global_shape != first.global_shape:
            raise ShardingError(
                f"object {key!r}: ranks disagree on global_shape: rank {first_rank} has "
                f"{list(first.global_shape)}, rank {rank} has {list(piece.global_shape)}"
            )
        if not is_main_replica(piece.replica_id):
            continue
        if piece.offset in cells:
            raise ShardingError(
                f"object {key!r}: cell {list(piece.offset)} is claimed as primary by ranks "
                f"{cells[piece.offset]} and {rank}"
            )
        cells[piece.offset] = rank
        writers.append((rank, index))
    total = 1
    for s in first.global_shape:
        total *= s
    if len(cells) != total:
        held = {p.offset for _, _, p in pieces}
        missing = [c for c in _grid(first.global_shape) if c not in cells][:5]
        kind = "held only as replicas" if all(m in held for m in missing) else "held by no rank"
        raise ShardingError(
            f"object {key!r}: {total - len(cells)} of {total} cells have no primary, e.g. "
            f"{[list(m) for m in missing]} ({kind})"
        )
    return writers


def _grid(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    cells: list[tuple[int, ...]] = [()]
    for size in shape:
        cells = [(*c, i) for c in cells for i in range(size)]
        if len(cells) > 100_000:
            break
    return cells
