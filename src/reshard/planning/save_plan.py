"""Save planning: validate the global layout that the ranks describe and elect one writer per box.

Pure functions over plain values: they take every rank's description (what the coordinator gathered)
and return, per rank, which of its pieces it writes. They can be run for any number of simulated ranks
in one process.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from reshard.boxes import Box
from reshard.dtypes import DTYPE_BY_NAME
from reshard.errors import ShardingError
from reshard.planning.tiling import find_tiling_problem
from reshard.sharding import ReplicaId, is_main_replica

__all__ = [
    "LocalSaveDescription",
    "ObjectPiece",
    "TensorPiece",
    "WriteAssignment",
    "plan_save",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorPiece:
    """One box of a tensor as a rank holds it (no data): the unit of save planning."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    replica_id: ReplicaId

    def to_json(self) -> list[Any]:
        rid = self.replica_id if isinstance(self.replica_id, int) else list(self.replica_id)
        return [self.key, self.dtype, list(self.global_shape), list(self.box.offset), list(self.box.shape), rid]

    @classmethod
    def from_json(cls, doc: list[Any]) -> TensorPiece:
        key, dtype, global_shape, offset, shape, rid = doc
        return cls(
            key=key,
            dtype=dtype,
            global_shape=tuple(global_shape),
            box=Box(tuple(offset), tuple(shape)),
            replica_id=rid if isinstance(rid, int) else tuple(rid),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectPiece:
    """One cell of a ShardedObject grid as a rank holds it."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    replica_id: ReplicaId

    def to_json(self) -> list[Any]:
        rid = self.replica_id if isinstance(self.replica_id, int) else list(self.replica_id)
        return [self.key, list(self.global_shape), list(self.offset), rid]

    @classmethod
    def from_json(cls, doc: list[Any]) -> ObjectPiece:
        key, global_shape, offset, rid = doc
        return cls(
            key=key,
            global_shape=tuple(global_shape),
            offset=tuple(offset),
            replica_id=rid if isinstance(rid, int) else tuple(rid),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalSaveDescription:
    """What one rank holds: its tensor pieces and object cells, in its own order."""

    tensors: tuple[TensorPiece, ...]
    objects: tuple[ObjectPiece, ...]

    def to_json(self) -> dict[str, Any]:
        return {"tensors": [t.to_json() for t in self.tensors], "objects": [o.to_json() for o in self.objects]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LocalSaveDescription:
        return cls(
            tensors=tuple(TensorPiece.from_json(t) for t in doc["tensors"]),
            objects=tuple(ObjectPiece.from_json(o) for o in doc["objects"]),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteAssignment:
    """What one rank writes: indices into its own description's ``tensors`` and ``objects``."""

    tensors: tuple[int, ...]
    objects: tuple[int, ...]


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

    Raises:
        ShardingError: naming the key, the ranks and the boxes involved.
    """
    pieces_by_key: dict[str, list[tuple[int, int, TensorPiece]]] = defaultdict(list)
    for rank, desc in enumerate(descriptions):
        for index, piece in enumerate(desc.tensors):
            pieces_by_key[piece.key].append((rank, index, piece))

    assigned_tensors: list[list[int]] = [[] for _ in descriptions]
    jobs: list[tuple[int, str, tuple[int, ...], list[tuple[int, int]]]] = []
    for key in sorted(pieces_by_key):
        jobs.extend(_validate_tensor(key, pieces_by_key[key]))
    load = [0] * len(descriptions)
    for nbytes, _key, _offset, holders in sorted(jobs, key=lambda j: (-j[0], j[1], j[2])):
        rank, index = min(holders, key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        assigned_tensors[rank].append(index)

    assigned_objects: list[list[int]] = [[] for _ in descriptions]
    objects_by_key: dict[str, list[tuple[int, int, ObjectPiece]]] = defaultdict(list)
    for rank, desc in enumerate(descriptions):
        for index, obj in enumerate(desc.objects):
            objects_by_key[obj.key].append((rank, index, obj))
    for key in sorted(objects_by_key):
        for rank, index in _validate_object(key, objects_by_key[key]):
            assigned_objects[rank].append(index)

    return [
        WriteAssignment(tensors=tuple(sorted(t)), objects=tuple(sorted(o)))
        for t, o in zip(assigned_tensors, assigned_objects, strict=True)
    ]


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
            "all hold replicas; a plain tensor must be present on rank 0 of the group"
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
