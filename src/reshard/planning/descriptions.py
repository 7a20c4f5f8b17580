"""What each rank describes at save planning, and its compact form on the wire.

A rank's description lists its tensor pieces (key, dtype, global shape, box, replica id) and object cells,
never data. :func:`encode_description` packs it for the gather to the coordinator (headers and replica ids
as JSON, each once, boxes as one integer array); :meth:`DescriptionTable.from_wire` decodes every rank's
payload into one :class:`DescriptionTable` of integer columns, on which save planning runs vectorised. A
:class:`WriteAssignment` is what the coordinator sends back to each rank: which of its pieces it writes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from reshard.errors import CheckpointError
from reshard.geometry.boxes import Box
from reshard.state.dtypes import dtype_name
from reshard.state.sharding import LocalPiece, ReplicaId, is_main_replica
from reshard.state.statedict import FlatStateDict

__all__ = [
    "DescriptionTable",
    "LocalSaveDescription",
    "ObjectPiece",
    "TensorPiece",
    "WriteAssignment",
    "describe_state",
    "encode_description",
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
    """What one rank writes: indices into its own description's ``tensors`` and ``objects``; for an
    incremental save, ``base_hashes[i]`` is the content hash (32 hex digits) of the base checkpoint's box
    equal in place to ``tensors[i]`` (None: the base has none), which the rank compares before it writes,
    and, for a save that reads its base back (``SaveOptions(verify_base=True)``), ``base_places[i]`` says
    where that box is stored: ``(file, byte offset, byte length)``, ``file`` indexing ``base_files``, whose
    elements are ``(name, size)``: the data file's name for the new checkpoint's storage
    (``../<holder>/<path>``) and the size its metadata records."""

    tensors: tuple[int, ...]
    objects: tuple[int, ...]
    base_hashes: tuple[str | None, ...] = ()
    base_files: tuple[tuple[str, int], ...] = ()
    base_places: tuple[tuple[int, int, int] | None, ...] = ()

    def to_bytes(self) -> bytes:
        """The assignment as the coordinator sends it (to that rank only)."""
        doc: list[Any] = [list(self.tensors), list(self.objects)]
        if any(h is not None for h in self.base_hashes):
            doc.append(list(self.base_hashes))
            if self.base_files:
                doc.append([list(f) for f in self.base_files])
                doc.append([list(p) if p is not None else None for p in self.base_places])
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> WriteAssignment:
        tensors, objects, *rest = json.loads(raw)
        files = rest[1] if len(rest) > 1 else []
        places = rest[2] if len(rest) > 2 else []
        return cls(
            tensors=tuple(int(t) for t in tensors),
            objects=tuple(int(o) for o in objects),
            base_hashes=tuple(rest[0]) if rest else (),
            base_files=tuple((str(name), int(size)) for name, size in files),
            base_places=tuple((int(p[0]), int(p[1]), int(p[2])) if p is not None else None for p in places),
        )

    def base_hash(self, position: int) -> bytes | None:
        """The base's content hash for ``tensors[position]``, or None."""
        if position >= len(self.base_hashes) or self.base_hashes[position] is None:
            return None
        return bytes.fromhex(str(self.base_hashes[position]))

    def base_copy(self, position: int) -> tuple[str, int, int, int] | None:
        """Where the base stores ``tensors[position]``: its data file's name and recorded size, the byte offset
        and length; None when the assignment does not say (no base box, or a save that trusts its base)."""
        if position >= len(self.base_places) or self.base_places[position] is None:
            return None
        file, offset, length = self.base_places[position]  # type: ignore[misc]
        name, size = self.base_files[file]
        return name, size, offset, length


def describe_state(flat: FlatStateDict) -> tuple[LocalSaveDescription, list[torch.Tensor]]:
    """A rank's description of its flattened state dict (boxes, no data) and, in the same order, the
    views holding each box. A tensor with nothing to store is still described (an empty box), so that its
    key, dtype and shape are recorded."""
    tensors = []
    views = []
    for st in flat.tensors:
        name = dtype_name(st.data.dtype)
        pieces = st.pieces()
        if not pieces:
            empty = Box((0,) * len(st.saved_shape), (0,) * len(st.saved_shape))
            pieces = [LocalPiece(empty, st.data.new_empty((0,) * len(st.saved_shape)))]
        for piece in pieces:
            tensors.append(
                TensorPiece(
                    key=st.key, dtype=name, global_shape=st.saved_shape, box=piece.box, replica_id=st.replica_id
                )
            )
            views.append(piece.view)
    objects = [
        ObjectPiece(key=o.key, global_shape=o.global_shape, offset=o.global_offset, replica_id=o.replica_id)
        for o in flat.objects
    ]
    return LocalSaveDescription(tensors=tuple(tensors), objects=tuple(objects)), views


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
