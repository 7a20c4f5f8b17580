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

import numpy as np
import numpy.typing as npt

from reshard.errors import ShardingError
from reshard.geometry.boxes import Box
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

__all__ = ["plan_save", "plan_save_table"]

Int64Array = npt.NDArray[np.int64]

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
    world = table.world
    keys = table.keys
    key_rank = np.empty(len(keys), dtype=np.int64)
    key_rank[sorted(range(len(keys)), key=keys.__getitem__)] = np.arange(len(keys), dtype=np.int64)
    header_key = table.header_key
    piece_key = header_key[table.header]
    width = table.offset.shape[1]
    slow = np.zeros(len(keys), dtype=bool)  # keys that the piece-by-piece validation must look at
    slow[np.bincount(header_key, minlength=len(keys)) > 1] = True  # ranks disagree on dtype or global shape
    header_ndim = np.array([len(s) for s in table.header_shape], dtype=np.int64)
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
    ends = table.offset + table.shape
    inside = (table.ndim == header_ndim[table.header]) & (ends <= domain[table.header]).all(axis=1)
    slow[piece_key[~inside]] = True
    # Group the pieces that hold data by box: each group needs exactly one primary.
    live = np.flatnonzero(
        ~slow[piece_key] & ((table.shape > 0) | (np.arange(width) >= table.ndim[:, None])).all(axis=1)
    )
    order = live[
        np.lexsort(
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
            (table.offset[order[1:]] != table.offset[order[:-1]]) | (table.shape[order[1:]] != table.shape[order[:-1]])
        ).any(axis=1)
    group_start = np.flatnonzero(starts)
    main = table.replica_main[table.replica]
    mains = np.add.reduceat(main[order].astype(np.int64), group_start) if len(order) else np.zeros(0, np.int64)
    slow[piece_key[order[group_start[mains != 1]]]] = True
    # Holders of each group, primary first, then replicas in (rank, index) order.
    group_of = np.cumsum(starts) - 1
    holder_order = np.lexsort((np.arange(len(order)), ~main[order], group_of)) if len(order) else order
    holders = order[holder_order]
    primary = holders[group_start]
    # The primaries of each remaining key must tile its global tensor.
    good_key = ~slow
    checked = [h for h in range(len(header_key)) if good_key[header_key[h]]]
    for ndim in sorted({len(table.header_shape[h]) for h in checked}):
        headers = [h for h in checked if len(table.header_shape[h]) == ndim]
        local = np.full(len(keys), -1, dtype=np.int64)
        local[header_key[headers]] = np.arange(len(headers))
        boxes = primary[good_key[piece_key[primary]] & (local[piece_key[primary]] >= 0)]
        bad = untiled_groups(
            local[piece_key[boxes]], table.offset[boxes, :ndim], ends[boxes, :ndim], domain[headers, :ndim]
        )
        slow[header_key[np.asarray(headers, dtype=np.int64)[bad]]] = True
    # The keys that failed a check: piece by piece, in key order, which raises the first error.
    slow_jobs: list[_Job] = []
    for key_id in sorted(np.flatnonzero(slow).tolist(), key=keys.__getitem__):
        rows = np.flatnonzero(piece_key == key_id)
        pieces = [(int(table.rank[r]), int(table.index[r]), table.tensor_piece(int(r))) for r in rows]
        slow_jobs.extend(_validate_tensor(keys[key_id], pieces))
    # One job per group of a good key: (bytes, key, offset) decide the order.
    keep = ~slow[piece_key[primary]]
    group_ids = np.flatnonzero(keep)
    job_bytes = itemsize[table.header[primary[group_ids]]] * np.prod(
        np.where(np.arange(width) < table.ndim[primary[group_ids], None], table.shape[primary[group_ids]], 1), axis=1
    )
    job_offset = table.offset[primary[group_ids]]
    job_order = np.lexsort(
        (*(job_offset[:, a] for a in range(width - 1, -1, -1)), key_rank[piece_key[primary[group_ids]]], -job_bytes)
    )
    bounds = np.append(group_start, len(order)).tolist()
    holder_rank = table.rank[holders].tolist()
    holder_index = table.index[holders].tolist()
    ordered: list[tuple[int, list[tuple[int, int]]]] | None = None
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
    assigned_tensors: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    if ordered is not None:
        for nbytes, hs in ordered:
            rank, index = min(hs, key=lambda h: (load[h[0]], h[0]))
            load[rank] += nbytes
            assigned_tensors[rank].append(index)
    else:
        sizes = job_bytes.tolist()
        groups = group_ids.tolist()
        for j in job_order.tolist():
            g = groups[j]
            best = bounds[g]
            best_rank = holder_rank[best]
            for h in range(best + 1, bounds[g + 1]):
                rank = holder_rank[h]
                if load[rank] < load[best_rank] or (load[rank] == load[best_rank] and rank < best_rank):
                    best, best_rank = h, rank
            load[best_rank] += sizes[j]
            assigned_tensors[best_rank].append(holder_index[best])

    assigned_objects: list[list[int]] = [[] for _ in range(world)]
    objects_by_key: dict[str, list[tuple[int, int, ObjectPiece]]] = defaultdict(list)
    for rank, objects in enumerate(table.objects):
        for index, obj in enumerate(objects):
            objects_by_key[obj.key].append((rank, index, obj))
    for key in sorted(objects_by_key):
        for rank, index in _validate_object(key, objects_by_key[key]):
            assigned_objects[rank].append(index)

    return [
        WriteAssignment(tensors=tuple(sorted(t)), objects=tuple(sorted(o)))
        for t, o in zip(assigned_tensors, assigned_objects, strict=True)
    ]


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
