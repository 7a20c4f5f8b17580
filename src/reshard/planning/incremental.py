"""Planning an incremental save: which assigned boxes the base checkpoint already holds, and where.

On the coordinator, after the writers are elected: every box a rank is to write is looked up in the base
checkpoint's metadata by key, dtype, global shape, offset and shape. Where the base stores that very box
with a content hash, the rank is told the hash (:attr:`WriteAssignment.base_hashes`); the rank hashes its
own bytes and writes the box when the hashes differ, or when the copy the base stores does not read back as
those bytes (:mod:`reshard.io.reuse`; for that the rank is told where the copy lies,
:attr:`WriteAssignment.base_places`, unless the save trusts its base). The content hash is XXH3-128 over the box's
bytes, never the CRC-32C: a CRC can be made to collide by changing four bytes, and a box rewritten on a
matching CRC alone would silently keep stale data. A box the base does not hold in the same place (the
layout changed, the tensor is new, or its dtype or shape changed) is written as in a full save.

The base's reference is resolved to the checkpoint that holds the bytes (a base's own reference is
followed once, here, so that a load never walks a chain), and a box that the target itself would hold (a
base that references the checkpoint being overwritten) is written again rather than referenced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from reshard.errors import CheckpointError
from reshard.metadata import BoxColumns, DataFile, Metadata
from reshard.planning.descriptions import DescriptionTable, WriteAssignment

__all__ = ["ReferencedBox", "match_base"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferencedBox:
    """A box of the base that an incremental save may reference: where its bytes lie (``path`` of the
    checkpoint ``checkpoint``, ``size`` bytes long) and its checksums and content hash."""

    checkpoint: str
    path: str
    size: int
    byte_offset: int
    byte_length: int
    checksums: npt.NDArray[np.uint32]
    content_hash: bytes


def match_base(
    table: DescriptionTable,
    assignments: Sequence[WriteAssignment],
    base: Metadata,
    *,
    base_name: str,
    target_name: str,
    chunk_bytes: int,
    places: bool = False,
) -> tuple[list[WriteAssignment], dict[int, ReferencedBox]]:
    """The assignments with the base's hashes filled in (with ``places``, also where each of those boxes is
    stored, which a writer that reads the base back needs), and the referable base box of each table row
    that has one. Pure: no I/O.

    Raises:
        CheckpointError: the base has no content hashes, or checksums boxes in chunks of another size.
    """
    if not base.content_hashes:
        raise CheckpointError(
            f"the base checkpoint {base_name!r} records no content hashes (it was saved without "
            "SaveOptions(content_hash=True)): an incremental save has nothing to compare with"
        )
    if base.checksum_chunk_bytes != chunk_bytes:
        raise CheckpointError(
            f"the base checkpoint {base_name!r} checksums in chunks of {base.checksum_chunk_bytes} bytes, this save "
            f"in chunks of {chunk_bytes}: a referenced box would carry checksums of another size"
        )
    boxes_at: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], int]] = {}
    columns_of: dict[str, BoxColumns] = {}
    references: dict[int, ReferencedBox] = {}
    out = []
    for rank, assignment in enumerate(assignments):
        hashes: list[str | None] = []
        files: dict[tuple[str, int], int] = {}
        where: list[tuple[int, int, int] | None] = []
        for index in assignment.tensors:
            row = int(table.rank_start[rank]) + index
            found = _lookup(table, row, base, boxes_at, columns_of)
            where.append(None)
            if found is None:
                hashes.append(None)
                continue
            columns, i = found
            entry = base.files[int(columns.file[i])]
            holder = entry.checkpoint if entry.checkpoint is not None else base_name
            if holder == target_name or columns.content_hash is None:
                hashes.append(None)
                continue
            start, count = int(columns.crc_start[i]), int(columns.crc_count[i])
            reference = ReferencedBox(
                checkpoint=holder,
                path=entry.path,
                size=entry.size,
                byte_offset=int(columns.byte_offset[i]),
                byte_length=int(columns.byte_length[i]),
                checksums=columns.crc[start : start + count],
                content_hash=columns.content_hash[i].tobytes(),
            )
            references[row] = reference
            hashes.append(reference.content_hash.hex())
            if places:
                name = DataFile(path=entry.path, size=entry.size, checkpoint=holder).location
                file = files.setdefault((name, entry.size), len(files))
                where[-1] = (file, reference.byte_offset, reference.byte_length)
        out.append(
            dataclasses.replace(
                assignment,
                base_hashes=tuple(hashes),
                base_files=tuple(files) if places else (),
                base_places=tuple(where) if places else (),
            )
        )
    return out, references


def _lookup(
    table: DescriptionTable,
    row: int,
    base: Metadata,
    places: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], int]],
    columns_of: dict[str, BoxColumns],
) -> tuple[BoxColumns, int] | None:
    """The base's box in the place of table row ``row`` (same key, dtype, global shape, offset, shape)."""
    header = int(table.header[row])
    key = table.keys[int(table.header_key[header])]
    tensor = base.tensors.get(key)
    expected = (table.header_dtype[header], table.header_shape[header])
    if tensor is None or (tensor.dtype, tensor.global_shape) != expected:
        return None
    ndim = int(table.ndim[row])
    offset = tuple(table.offset[row, :ndim].tolist())
    shape = tuple(table.shape[row, :ndim].tolist())
    if 0 in shape:
        return None
    if key not in places:
        columns = BoxColumns.of(tensor.boxes, len(tensor.global_shape))
        columns_of[key] = columns
        places[key] = {
            (tuple(o), tuple(s)): i
            for i, (o, s) in enumerate(zip(columns.offset.tolist(), columns.shape.tolist(), strict=True))
        }
    i = places[key].get((offset, shape))
    return None if i is None else (columns_of[key], i)
