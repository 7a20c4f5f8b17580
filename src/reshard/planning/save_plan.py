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

import json
import math
import struct
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from reshard.dtypes import DTYPE_BY_NAME
from reshard.errors import CheckpointError, ShardingError
from reshard.geometry.boxes import Box
from reshard.geometry.tiling import MAX_CORNER_NDIM, find_tiling_problem, untiled_groups
from reshard.sharding import ReplicaId, is_main_replica

__all__ = [
    "DescriptionTable",
    "LocalSaveDescription",
    "ObjectPiece",
    "TensorPiece",
    "WriteAssignment",
    "encode_description",
    "plan_save",
    "plan_save_table",
]

Int64Array = npt.NDArray[np.int64]


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


_MAX_BYTES = 2**62
_WIRE_MAGIC = b"RSD1"
_FRAME = struct.Struct("<4sIII")


@dataclass(frozen=True, slots=True, eq=False)
class DescriptionTable:
    """Every rank's tensor pieces in columns: one row per piece, in (rank, index) order.

    This is what the coordinator plans on: a million pieces are a few arrays rather than a million
    objects. Pieces refer to *headers* (a distinct ``(key, dtype, global_shape)``) and to replica ids by
    number. ``offset`` and ``shape`` have as many columns as the most axes of any box, unused columns 0.

    Attributes:
        keys: every key, by key number (in the order first seen).
        header_key, header_dtype, header_shape: per header: its key number, dtype name and global shape.
        replicas, replica_main: every replica id, by number, and whether it marks a primary copy.
        rank, index: per piece: the rank that described it and its position in that rank's ``tensors``.
        header, replica, ndim, offset, shape: per piece: its header, replica id, number of axes, box.
        rank_start: the rows of rank ``r`` are ``rank_start[r]:rank_start[r + 1]``.
        objects: per rank, its object cells.
    """

    keys: tuple[str, ...]
    header_key: Int64Array
    header_dtype: tuple[str, ...]
    header_shape: tuple[tuple[int, ...], ...]
    replicas: tuple[ReplicaId, ...]
    replica_main: npt.NDArray[np.bool_]
    rank: Int64Array
    index: Int64Array
    header: Int64Array
    replica: Int64Array
    ndim: Int64Array
    offset: Int64Array
    shape: Int64Array
    rank_start: Int64Array
    objects: tuple[tuple[ObjectPiece, ...], ...]

    @property
    def world(self) -> int:
        return len(self.objects)

    def __len__(self) -> int:
        return len(self.rank)

    def tensor_piece(self, row: int) -> TensorPiece:
        """Piece ``row`` as the rank described it."""
        h = int(self.header[row])
        nd = int(self.ndim[row])
        return TensorPiece(
            key=self.keys[int(self.header_key[h])],
            dtype=self.header_dtype[h],
            global_shape=self.header_shape[h],
            box=Box(tuple(self.offset[row, :nd].tolist()), tuple(self.shape[row, :nd].tolist())),
            replica_id=self.replicas[int(self.replica[row])],
        )

    def description(self, rank: int) -> LocalSaveDescription:
        """Rank ``rank``'s description, rebuilt from the columns."""
        rows = range(int(self.rank_start[rank]), int(self.rank_start[rank + 1]))
        return LocalSaveDescription(tensors=tuple(self.tensor_piece(r) for r in rows), objects=self.objects[rank])

    @classmethod
    def from_descriptions(cls, descriptions: list[LocalSaveDescription]) -> DescriptionTable:
        """The table of descriptions held as objects (tests, single process)."""
        builder = _TableBuilder()
        for desc in descriptions:
            headers = [(p.key, p.dtype, p.global_shape) for p in desc.tensors]
            replicas = [p.replica_id for p in desc.tensors]
            width = max((p.box.ndim for p in desc.tensors), default=0)
            rows = np.zeros((len(desc.tensors), 2 * width), dtype=np.int64)
            ndim = np.zeros(len(desc.tensors), dtype=np.int64)
            for i, p in enumerate(desc.tensors):
                nd = p.box.ndim
                ndim[i] = nd
                rows[i, :nd] = p.box.offset
                rows[i, width : width + nd] = p.box.shape
            builder.add_rank(
                headers, np.arange(len(headers)), replicas, np.arange(len(replicas)), ndim, rows, desc.objects
            )
        return builder.build()

    @classmethod
    def from_wire(cls, payloads: list[bytes]) -> tuple[DescriptionTable, list[Any]]:
        """The table of every rank's :func:`encode_description` payload (in rank order), and each
        payload's ``context``.

        Raises:
            CheckpointError: a payload is not a description (a rank runs another version of reshard).
        """
        builder = _TableBuilder()
        contexts = []
        seen_headers: dict[bytes, list[tuple[str, str, tuple[int, ...]]]] = {}
        seen_replicas: dict[bytes, list[ReplicaId]] = {}
        for rank, payload in enumerate(payloads):
            try:
                headers, replicas, array, objects, context = _decode_wire(payload, seen_headers, seen_replicas)
            except (ValueError, TypeError, KeyError, struct.error, UnicodeDecodeError) as exc:
                raise CheckpointError(f"rank {rank} sent a malformed save description: {exc}") from exc
            contexts.append(context)
            builder.add_rank(headers, array[:, 0], replicas, array[:, 1], array[:, 2], array[:, 3:], objects)
        return builder.build(), contexts


def _decode_wire(
    payload: bytes,
    seen_headers: dict[bytes, list[tuple[str, str, tuple[int, ...]]]],
    seen_replicas: dict[bytes, list[ReplicaId]],
) -> tuple[list[tuple[str, str, tuple[int, ...]]], list[ReplicaId], Int64Array, tuple[ObjectPiece, ...], Any]:
    """Decode one :func:`encode_description` payload; header and replica lists already seen (as bytes)
    are shared rather than decoded again."""
    magic, n_headers, n_replicas, n_rest = _FRAME.unpack_from(payload)
    if magic != _WIRE_MAGIC:
        raise ValueError(f"it starts with {magic!r}, not {_WIRE_MAGIC!r}")
    at = _FRAME.size
    raw_headers = payload[at : at + n_headers]
    raw_replicas = payload[at + n_headers : at + n_headers + n_replicas]
    at += n_headers + n_replicas
    rest = json.loads(payload[at : at + n_rest])
    at += n_rest
    headers = seen_headers.get(raw_headers)
    if headers is None:
        headers = [(str(k), str(d), tuple(int(v) for v in s)) for k, d, s in json.loads(raw_headers)]
        seen_headers[raw_headers] = headers
    replicas = seen_replicas.get(raw_replicas)
    if replicas is None:
        replicas = [r if isinstance(r, int) else tuple(int(v) for v in r) for r in json.loads(raw_replicas)]
        seen_replicas[raw_replicas] = replicas
    count, width = int(rest["rows"]), int(rest["width"])
    if rest["int"] not in ("<i4", "<i8"):
        raise ValueError(f"unknown integer type {rest['int']!r}")
    array = np.frombuffer(payload, dtype=rest["int"], count=count * (3 + 2 * width), offset=at)
    array = array.reshape(count, 3 + 2 * width).astype(np.int64)
    if (array < 0).any() or (array[:, 0] >= len(headers)).any() or (array[:, 1] >= len(replicas)).any():
        raise ValueError("an index is out of range")
    objects = tuple(ObjectPiece.from_json(o) for o in rest["objects"])
    return headers, replicas, array, objects, rest["context"]


def encode_description(description: LocalSaveDescription, context: Any = None) -> bytes:
    """The compact wire form of one rank's description, sent to the coordinator at save planning:
    headers and replica ids as JSON (each once), the boxes as one packed integer array. ``context`` is
    any JSON-able value that travels with it (the checkpoint path, for instance)."""
    headers: dict[tuple[str, str, tuple[int, ...]], int] = {}
    replicas: dict[tuple[type, ReplicaId], int] = {}
    width = max((p.box.ndim for p in description.tensors), default=0)
    rows: list[int] = []
    pad = [0] * width
    for p in description.tensors:
        nd = p.box.ndim
        rows.append(headers.setdefault((p.key, p.dtype, p.global_shape), len(headers)))
        rows.append(replicas.setdefault((type(p.replica_id), p.replica_id), len(replicas)))
        rows.append(nd)
        rows += p.box.offset
        rows += pad[nd:]
        rows += p.box.shape
        rows += pad[nd:]
    dtype = "<i4" if max(rows, default=0) < 2**31 else "<i8"
    raw_headers = json.dumps([[k, d, list(s)] for k, d, s in headers], separators=(",", ":")).encode()
    raw_replicas = json.dumps(
        [r if isinstance(r, int) else list(r) for _, r in replicas], separators=(",", ":")
    ).encode()
    rest = {
        "rows": len(description.tensors),
        "width": width,
        "int": dtype,
        "objects": [o.to_json() for o in description.objects],
        "context": context,
    }
    raw_rest = json.dumps(rest, separators=(",", ":"), allow_nan=False).encode()
    frame = _FRAME.pack(_WIRE_MAGIC, len(raw_headers), len(raw_replicas), len(raw_rest))
    return b"".join((frame, raw_headers, raw_replicas, raw_rest, np.asarray(rows, dtype=dtype).tobytes()))


class _TableBuilder:
    """Accumulates ranks' pieces, interning keys, headers and replica ids, then builds the table."""

    def __init__(self) -> None:
        self.keys: dict[str, int] = {}
        self.headers: dict[tuple[str, str, tuple[int, ...]], int] = {}
        self.replicas: dict[tuple[type, ReplicaId], int] = {}
        self.header_maps: dict[int, tuple[list[Any], Int64Array]] = {}
        self.replica_maps: dict[int, tuple[list[Any], Int64Array]] = {}
        self.parts: list[tuple[Int64Array, Int64Array, Int64Array, Int64Array]] = []
        self.objects: list[tuple[ObjectPiece, ...]] = []

    @staticmethod
    def _map(
        items: list[Any], table: dict[Any, int], memo: dict[int, tuple[list[Any], Int64Array]], wrap: Any
    ) -> Int64Array:
        """Global numbers of ``items``; a list seen before (the same object: ranks with equal headers
        share one decoded list) is mapped once."""
        found = memo.get(id(items))
        if found is not None and found[0] is items:
            return found[1]
        numbers = np.array([table.setdefault(wrap(x), len(table)) for x in items], dtype=np.int64)
        memo[id(items)] = (items, numbers)
        return numbers

    def add_rank(
        self,
        headers: list[tuple[str, str, tuple[int, ...]]],
        header: npt.ArrayLike,
        replicas: list[ReplicaId],
        replica: npt.ArrayLike,
        ndim: npt.ArrayLike,
        boxes: Int64Array,
        objects: tuple[ObjectPiece, ...],
    ) -> None:
        """One rank: its pieces' header and replica numbers (into its own ``headers`` and ``replicas``
        lists), axes, and boxes (offsets then shapes, each padded to the same width)."""
        header_map = self._map(headers, self.headers, self.header_maps, lambda h: h)
        replica_map = self._map(replicas, self.replicas, self.replica_maps, lambda r: (type(r), r))
        self.parts.append(
            (
                header_map[np.asarray(header, dtype=np.int64)],
                replica_map[np.asarray(replica, dtype=np.int64)],
                np.asarray(ndim, dtype=np.int64),
                boxes,
            )
        )
        self.objects.append(objects)

    def build(self) -> DescriptionTable:
        header_list = list(self.headers)
        keys: dict[str, int] = {}
        header_key = np.array([keys.setdefault(k, len(keys)) for k, _, _ in header_list], dtype=np.int64)
        counts = [len(p[0]) for p in self.parts]
        width = max((p[3].shape[1] // 2 for p in self.parts), default=0)
        total = sum(counts)
        offset = np.zeros((total, width), dtype=np.int64)
        shape = np.zeros((total, width), dtype=np.int64)
        at = 0
        for (_, _, _, boxes), n in zip(self.parts, counts, strict=True):
            w = boxes.shape[1] // 2
            offset[at : at + n, :w] = boxes[:, :w]
            shape[at : at + n, :w] = boxes[:, w:]
            at += n
        rank_start = np.zeros(len(self.parts) + 1, dtype=np.int64)
        np.cumsum(counts, out=rank_start[1:])
        replica_list = [r for _, r in self.replicas]
        concat = (
            (lambda i: np.concatenate([p[i] for p in self.parts])) if self.parts else (lambda i: np.zeros(0, np.int64))
        )
        return DescriptionTable(
            keys=tuple(keys),
            header_key=header_key,
            header_dtype=tuple(d for _, d, _ in header_list),
            header_shape=tuple(s for _, _, s in header_list),
            replicas=tuple(replica_list),
            replica_main=np.array([is_main_replica(r) for r in replica_list], dtype=bool),
            rank=np.repeat(np.arange(len(self.parts), dtype=np.int64), counts),
            index=np.concatenate([np.arange(n, dtype=np.int64) for n in counts]) if counts else np.zeros(0, np.int64),
            header=concat(0),
            replica=concat(1),
            ndim=concat(2),
            offset=offset,
            shape=shape,
            rank_start=rank_start,
            objects=tuple(self.objects),
        )


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
