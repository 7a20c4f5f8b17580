"""Assembling a save's metadata on its coordinator, from every rank's description and write report.

The write report is what a rank sends after writing its data file: per box, its index in the rank's own
description, its byte offset and length, and its chunk checksums (packed); per object cell the same; the
file's name and size. :func:`assemble_metadata` is a pure function of the descriptions (a
:class:`~reshard.planning.descriptions.DescriptionTable`) and the reports, so a save of any number of ranks
can be assembled in one process (``reshard.testing.simulate``, ``benchmarks/scale.py``).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from reshard._version import __version__
from reshard.metadata import (
    CONTENT_HASH_BYTES,
    BoxColumns,
    DataFile,
    Metadata,
    ObjectMetadata,
    SavedBoxes,
    SavedObject,
    TensorMetadata,
)
from reshard.planning.descriptions import DescriptionTable
from reshard.planning.incremental import ReferencedBox
from reshard.state.fingerprint import combine

__all__ = [
    "BoxParts",
    "ObjectReport",
    "TensorReport",
    "WriteReport",
    "assemble_metadata",
    "referenced_parts",
    "tensor_metadata",
    "written_parts",
]

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorReport:
    """Where a rank's boxes went, in columns: ``index[i]`` is the box's index in the rank's description,
    stored at ``byte_offset[i]`` with ``byte_length[i]`` bytes; ``crc32c`` holds every box's chunk
    checksums one after the other, as little-endian uint32; ``fingerprint`` (when the save computes them)
    each box's content fingerprint; ``content_hash`` (when the save hashes content) each box's 16-byte
    digest, one after the other. ``reused``: the indices of the boxes an incremental save did not write
    because the base holds the same bytes (with their fingerprints in ``reused_fingerprint``)."""

    index: tuple[int, ...] = ()
    byte_offset: tuple[int, ...] = ()
    byte_length: tuple[int, ...] = ()
    crc32c: bytes = b""
    fingerprint: tuple[int, ...] | None = None
    content_hash: bytes = b""
    reused: tuple[int, ...] = ()
    reused_fingerprint: tuple[int, ...] | None = None

    @classmethod
    def of(
        cls,
        index: Sequence[int],
        byte_offset: Sequence[int],
        byte_length: Sequence[int],
        checksums: Sequence[int],
        fingerprint: Sequence[int] | None = None,
        *,
        content_hash: bytes = b"",
        reused: Sequence[int] = (),
        reused_fingerprint: Sequence[int] | None = None,
    ) -> TensorReport:
        return cls(
            index=tuple(index),
            byte_offset=tuple(byte_offset),
            byte_length=tuple(byte_length),
            crc32c=np.asarray(checksums, dtype="<u4").tobytes(),
            fingerprint=tuple(fingerprint) if fingerprint is not None else None,
            content_hash=content_hash,
            reused=tuple(reused),
            reused_fingerprint=tuple(reused_fingerprint) if reused_fingerprint is not None else None,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "index": list(self.index),
            "byte_offset": list(self.byte_offset),
            "byte_length": list(self.byte_length),
            "crc32c": base64.b64encode(self.crc32c).decode("ascii"),
            "fingerprint": list(self.fingerprint) if self.fingerprint is not None else None,
            "content_hash": base64.b64encode(self.content_hash).decode("ascii"),
            "reused": list(self.reused),
            "reused_fingerprint": list(self.reused_fingerprint) if self.reused_fingerprint is not None else None,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> TensorReport:
        prints = doc["fingerprint"]
        reused_prints = doc["reused_fingerprint"]
        return cls(
            index=tuple(doc["index"]),
            byte_offset=tuple(doc["byte_offset"]),
            byte_length=tuple(doc["byte_length"]),
            crc32c=base64.b64decode(doc["crc32c"]),
            fingerprint=tuple(prints) if prints is not None else None,
            content_hash=base64.b64decode(doc["content_hash"]),
            reused=tuple(doc["reused"]),
            reused_fingerprint=tuple(reused_prints) if reused_prints is not None else None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectReport:
    """Where one object cell of a rank went: ``index`` in the rank's description, its bytes and checksums."""

    index: int
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteReport:
    """What one rank wrote (``file`` None: nothing was assigned to it). ``rewritten_bytes``: of the tensor bytes
    it wrote, those an incremental save wrote because the base's stored copy did not read back as the state's."""

    file: str | None = None
    size: int = 0
    tensors: TensorReport = TensorReport()
    objects: tuple[ObjectReport, ...] = ()
    rewritten_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "size": self.size,
            "tensors": self.tensors.to_json(),
            "objects": [[o.index, o.byte_offset, o.byte_length, list(o.checksums)] for o in self.objects],
            "rewritten_bytes": self.rewritten_bytes,
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> WriteReport:
        return cls(
            file=doc["file"],
            size=int(doc["size"]),
            tensors=TensorReport.from_json(doc["tensors"]),
            objects=tuple(
                ObjectReport(index=i, byte_offset=o, byte_length=n, checksums=tuple(c)) for i, o, n, c in doc["objects"]
            ),
            rewritten_bytes=int(doc.get("rewritten_bytes", 0)),
        )


def assemble_metadata(
    table: DescriptionTable,
    reports: Sequence[WriteReport],
    *,
    save_id: str,
    world_size: int,
    chunk_bytes: int,
    common: Mapping[str, Any],
    content_hashes: bool = False,
    references: Mapping[int, ReferencedBox] | None = None,
) -> Metadata:
    """On the coordinator: every rank's description (``table``) and write report (``reports``, in rank order)
    combined into the checkpoint's metadata. Pure: no I/O, no collectives.

    ``content_hashes``: the reports carry every written box's content hash, recorded in the metadata.
    ``references``: for an incremental save, the base's box of each table row a rank may have reused
    (:func:`~reshard.planning.incremental.match_base`); a reused box is recorded in the file of the
    checkpoint that holds it, listed after the save's own files.

    Tensor boxes are assembled in columns (:class:`~reshard.metadata.SavedBoxes`), never as one object per
    box: a checkpoint of hundreds of thousands of boxes takes seconds and megabytes here.
    """
    files, written, entries = written_parts(table, reports)
    referenced_files, referenced = referenced_parts(table, reports, references, first_file=len(files))
    row, columns = (written + referenced).columns(table, chunk_bytes=chunk_bytes, content_hashes=content_hashes)
    prints = written.fingerprints + referenced.fingerprints if (written + referenced).fingerprinted else None
    object_shapes: dict[str, tuple[int, ...]] = {}
    for objects in table.objects:
        for obj in objects:
            object_shapes.setdefault(obj.key, obj.global_shape)
    return Metadata(
        save_id=save_id,
        created_by=f"reshard {__version__}",
        world_size=world_size,
        checksum_chunk_bytes=chunk_bytes,
        files=(*files, *referenced_files),
        tensors=tensor_metadata(table, row, columns, prints),
        objects={
            key: ObjectMetadata(
                key=key, global_shape=shape, entries=tuple(sorted(entries.get(key, ()), key=lambda e: e.offset))
            )
            for key, shape in sorted(object_shapes.items())
        },
        common=dict(common),
        content_hashes=content_hashes,
    )


@dataclass(frozen=True, slots=True)
class BoxParts:
    """Where some boxes of a save are stored, as column pieces (one per rank) that :meth:`columns` joins: the table
    rows of the boxes, the index of each one's file in the metadata's file list, its byte offset and length, its
    chunk checksums, its content hash (16 bytes, when hashed), and the boxes' fingerprints in the same order
    (``fingerprinted``: the save computes them)."""

    rows: tuple[Int64Array, ...] = ()
    file: tuple[Int64Array, ...] = ()
    byte_offset: tuple[Int64Array, ...] = ()
    byte_length: tuple[Int64Array, ...] = ()
    crc: tuple[npt.NDArray[Any], ...] = ()
    content_hash: tuple[bytes, ...] = ()
    fingerprints: tuple[int, ...] = ()
    fingerprinted: bool = False

    def __add__(self, other: BoxParts) -> BoxParts:
        return BoxParts.joined([self, other])

    @staticmethod
    def joined(parts: Sequence[BoxParts]) -> BoxParts:
        """The pieces of ``parts`` in order, as one (joined once: adding them one by one would copy the growing
        tuples again for every rank, quadratic in the ranks)."""
        return BoxParts(
            rows=tuple(r for p in parts for r in p.rows),
            file=tuple(f for p in parts for f in p.file),
            byte_offset=tuple(o for p in parts for o in p.byte_offset),
            byte_length=tuple(n for p in parts for n in p.byte_length),
            crc=tuple(c for p in parts for c in p.crc),
            content_hash=tuple(h for p in parts for h in p.content_hash),
            fingerprints=tuple(f for p in parts for f in p.fingerprints),
            fingerprinted=any(p.fingerprinted for p in parts),
        )

    def columns(
        self, table: DescriptionTable, *, chunk_bytes: int, content_hashes: bool
    ) -> tuple[Int64Array, BoxColumns]:
        """The table rows of the boxes and their :class:`~reshard.metadata.BoxColumns` (with the boxes' offsets and
        shapes from ``table``, at its full width), in the order of the pieces."""
        empty = np.zeros(0, dtype=np.int64)
        row = np.concatenate(self.rows) if self.rows else empty
        byte_length = np.concatenate(self.byte_length) if self.byte_length else empty
        crc_count = -(-byte_length // chunk_bytes)
        return row, BoxColumns(
            offset=table.offset[row],
            shape=table.shape[row],
            file=np.concatenate(self.file) if self.file else empty,
            byte_offset=np.concatenate(self.byte_offset) if self.byte_offset else empty,
            byte_length=byte_length,
            crc_start=np.cumsum(crc_count) - crc_count,
            crc_count=crc_count,
            crc=np.concatenate(self.crc).astype(np.uint32) if self.crc else np.zeros(0, dtype=np.uint32),
            content_hash=(
                np.frombuffer(b"".join(self.content_hash), dtype=np.uint8).reshape(len(row), CONTENT_HASH_BYTES).copy()
                if content_hashes
                else None
            ),
        )


def written_parts(
    table: DescriptionTable, reports: Sequence[WriteReport]
) -> tuple[list[DataFile], BoxParts, dict[str, list[SavedObject]]]:
    """The save's own data files (one per rank that wrote one, in rank order), where the boxes written went, and
    where each object's cells went (by key)."""
    files: list[DataFile] = []
    parts: list[BoxParts] = []
    entries: dict[str, list[SavedObject]] = {}
    for rank, report in enumerate(reports):
        if report.file is None:
            continue
        file_index = len(files)
        files.append(DataFile(path=report.file, size=report.size))
        written = report.tensors
        index = np.asarray(written.index, dtype=np.int64)
        parts.append(
            BoxParts(
                rows=(table.rank_start[rank] + index,),
                file=(np.full(len(index), file_index, dtype=np.int64),),
                byte_offset=(np.asarray(written.byte_offset, dtype=np.int64),),
                byte_length=(np.asarray(written.byte_length, dtype=np.int64),),
                crc=(np.frombuffer(written.crc32c, dtype="<u4"),),
                content_hash=(written.content_hash,),
                fingerprints=written.fingerprint or (),
                fingerprinted=written.fingerprint is not None,
            )
        )
        for stored in report.objects:
            obj = table.objects[rank][stored.index]
            entries.setdefault(obj.key, []).append(
                SavedObject(
                    offset=obj.offset,
                    file=file_index,
                    byte_offset=stored.byte_offset,
                    byte_length=stored.byte_length,
                    checksums=stored.checksums,
                )
            )
    return files, BoxParts.joined(parts), entries


def referenced_parts(
    table: DescriptionTable,
    reports: Sequence[WriteReport],
    references: Mapping[int, ReferencedBox] | None,
    *,
    first_file: int,
) -> tuple[list[DataFile], BoxParts]:
    """For an incremental save: the files of other checkpoints that the reused boxes lie in (each once, numbered
    from ``first_file`` on in the metadata's file list) and where those boxes are stored.

    Raises:
        ValueError: a rank reused boxes but the save has no ``references``.
    """
    files: list[DataFile] = []
    numbers: dict[tuple[str, str], int] = {}
    parts: list[BoxParts] = []
    for rank, report in enumerate(reports):
        if not report.tensors.reused:
            continue
        if references is None:
            raise ValueError(f"rank {rank} reused boxes of a base, but the save has no base")
        reused_rows = table.rank_start[rank] + np.asarray(report.tensors.reused, dtype=np.int64)
        reused = [references[row_id] for row_id in reused_rows.tolist()]
        for ref in reused:
            if (ref.checkpoint, ref.path) not in numbers:
                numbers[ref.checkpoint, ref.path] = first_file + len(files)
                files.append(DataFile(path=ref.path, size=ref.size, checkpoint=ref.checkpoint))
        part = BoxParts(
            rows=(reused_rows,),
            file=(np.array([numbers[ref.checkpoint, ref.path] for ref in reused], dtype=np.int64),),
            byte_offset=(np.array([ref.byte_offset for ref in reused], dtype=np.int64),),
            byte_length=(np.array([ref.byte_length for ref in reused], dtype=np.int64),),
            crc=tuple(ref.checksums for ref in reused),
            content_hash=tuple(ref.content_hash for ref in reused),
            fingerprints=report.tensors.reused_fingerprint or (),
            fingerprinted=report.tensors.reused_fingerprint is not None,
        )
        parts.append(part)
    return files, BoxParts.joined(parts)


def tensor_metadata(
    table: DescriptionTable, row: Int64Array, columns: BoxColumns, prints: Sequence[int] | None
) -> dict[str, TensorMetadata]:
    """Every key's :class:`~reshard.metadata.TensorMetadata`, in key order: its boxes (``columns``, whose table rows
    are ``row``), cut to the key's number of axes and sorted, and its fingerprint combined from ``prints`` (the
    boxes' fingerprints in the order of ``row``; None: the save computes none)."""
    key_of_row = table.header_key[table.header[row]]
    by_key = np.argsort(key_of_row, kind="stable")
    starts = np.searchsorted(key_of_row[by_key], np.arange(len(table.keys) + 1))
    first_header: dict[int, int] = {}
    for h, key_id in enumerate(table.header_key.tolist()):
        first_header.setdefault(key_id, h)
    tensors = {}
    for key_id, key in sorted(enumerate(table.keys), key=lambda item: item[1]):
        header = first_header[key_id]
        shape = table.header_shape[header]
        mine = by_key[starts[key_id] : starts[key_id + 1]]
        part = columns.take(mine)
        boxes = dataclasses.replace(part, offset=part.offset[:, : len(shape)], shape=part.shape[:, : len(shape)])
        tensors[key] = TensorMetadata(
            key=key,
            dtype=table.header_dtype[header],
            global_shape=shape,
            boxes=SavedBoxes(boxes.sorted()),
            fingerprint=combine([prints[i] for i in mine.tolist()]) if prints is not None else None,
        )
    return tensors
