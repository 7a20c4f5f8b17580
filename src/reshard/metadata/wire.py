"""Writing the metadata model as ``metadata.json``: the JSON members, the packed encoding of version 2,
and the document's own checksum of version 3 (docs/format.md sections 3, 6.2 and 14)."""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any

import crc32c
import numpy as np
import numpy.typing as npt

from reshard.geometry.grid import grid_rule
from reshard.metadata.columns import BoxColumns, SavedBox, SavedBoxes
from reshard.metadata.model import (
    CHECKSUM_ALGORITHM,
    CONTENT_HASH_ALGORITHM,
    FORMAT_NAME,
    HASHED_VERSION,
    METADATA_CHECKSUM_MEMBER,
    PACK_MIN_BOXES,
    PACK_MIN_CHECKSUMS,
    PARTITIONED_VERSION,
    SCALED_VERSION,
)
from reshard.state.codec import encode_tagged

if TYPE_CHECKING:
    from reshard.metadata.model import Metadata, TensorMetadata

__all__ = [
    "SEAL_LENGTH",
    "SEAL_PREFIX",
    "metadata_to_bytes",
    "metadata_to_json",
    "seal_document",
    "tensor_entry",
]


def metadata_to_json(
    metadata: Metadata,
    *,
    packed: bool | None = None,
    index: dict[str, Any] | None = None,
    parts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """See :meth:`Metadata.to_json_dict`. With ``index`` and ``parts`` (:mod:`reshard.metadata.partition`): the
    version-6 document, whose ``tensors`` member is ``index`` and whose ``parts`` member follows it."""
    version = metadata.writes_version if index is None else PARTITIONED_VERSION
    hashed = metadata.content_hashes
    tensors: dict[str, Any] = (
        {key: tensor_entry(t, packed, hashed) for key, t in metadata.tensors.items()} if index is None else index
    )
    doc: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": version,
        "save_id": metadata.save_id,
        "created_by": metadata.created_by,
        "world_size": metadata.world_size,
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": metadata.checksum_chunk_bytes},
    }
    if version >= HASHED_VERSION:
        doc["content_hash"] = {"algorithm": CONTENT_HASH_ALGORITHM} if hashed else None
    if version >= SCALED_VERSION:
        doc["scaled"] = {key: record.to_json() for key, record in metadata.scaled.items()}
    return doc | {
        "files": [_file_json(f.path, f.size, f.checkpoint) for f in metadata.files],
        "tensors": tensors,
        **({} if parts is None else {"parts": parts}),
        "objects": {
            key: {
                "global_shape": list(o.global_shape),
                "entries": [
                    {
                        "offset": list(e.offset),
                        "file": e.file,
                        "byte_offset": e.byte_offset,
                        "byte_length": e.byte_length,
                        "crc32c": list(e.checksums),
                    }
                    for e in o.entries
                ],
            }
            for key, o in metadata.objects.items()
        },
        "common": {path: encode_tagged(value, where=path) for path, value in metadata.common.items()},
    }


def tensor_entry(tensor: TensorMetadata, packed: bool | None, hashed: bool) -> dict[str, Any]:
    """The wire form of one tensor (``tensors[key]`` of versions 1 to 5): dtype, global shape, fingerprint,
    and its boxes, packed or plain (``packed`` as in :meth:`Metadata.to_json_dict`)."""
    entry: dict[str, Any] = {"dtype": tensor.dtype, "global_shape": list(tensor.global_shape)}
    if tensor.fingerprint is not None:
        entry["fingerprint"] = f"{tensor.fingerprint:016x}"
    if _should_pack(tensor, packed):
        entry["packed"] = _packed_json(tensor, hashed)
    else:
        entry["boxes"] = [_box_json(b, hashed) for b in tensor.boxes]
    return entry


def _file_json(path: str, size: int, checkpoint: str | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"path": path, "size": size}
    if checkpoint is not None:
        entry["checkpoint"] = checkpoint
    return entry


def _box_json(box: SavedBox, hashed: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "offset": list(box.offset),
        "shape": list(box.shape),
        "file": box.file,
        "byte_offset": box.byte_offset,
        "byte_length": box.byte_length,
        "crc32c": list(box.checksums),
    }
    if hashed:
        if box.content_hash is None:
            raise ValueError(f"a box at {list(box.offset)} has no content hash in a checkpoint with content hashes")
        entry["hash"] = box.content_hash.hex()
    return entry


def metadata_to_bytes(metadata: Metadata, *, packed: bool | None = None) -> bytes:
    """See :meth:`Metadata.to_json_bytes`."""
    body = json.dumps(metadata_to_json(metadata, packed=packed), separators=(",", ":"), allow_nan=False)
    return seal_document(body.encode("utf-8"))


SEAL_PREFIX = b',"' + METADATA_CHECKSUM_MEMBER.encode() + b'":"'
SEAL_LENGTH = 10
"""The 8 hexadecimal digits of the checksum and the two bytes ``"}`` that end a sealed document."""


def seal_document(body: bytes) -> bytes:
    """Add the checksum member to a document: ``body`` is a JSON object's text, without the member,
    ending with ``}``. The result ends with ``,"metadata_crc32c":"<8 lowercase hex digits>"}``, and the
    checksum is the CRC-32C of every byte before those 8 digits (docs/format.md section 6)."""
    text = body.rstrip()
    if not text.endswith(b"}") or text.replace(b" ", b"") == b"{}":
        raise ValueError("seal_document needs the text of a JSON object with members")
    head = text[:-1] + SEAL_PREFIX
    return head + f"{crc32c.crc32c(head):08x}".encode() + b'"}'


def _b64(values: npt.ArrayLike, dtype: str) -> str:
    """Little-endian integers ``values`` as packed base64 (the packed fields of format version 2)."""
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")


def _should_pack(tensor: TensorMetadata, packed: bool | None) -> bool:
    """Whether :meth:`Metadata.to_json_dict` packs ``tensor``'s boxes (see there)."""
    boxes = tensor.boxes
    if packed is False or not boxes:
        return False
    if isinstance(boxes, SavedBoxes):
        columns = boxes.columns
        if not (columns.shape > 0).all():
            return False
        checksums = int(columns.crc_count.sum())
    else:
        if any(b.box.volume == 0 for b in boxes):
            return False
        checksums = sum(len(b.checksums) for b in boxes)
    return packed is True or len(boxes) >= PACK_MIN_BOXES or checksums >= PACK_MIN_CHECKSUMS


def _packed_json(tensor: TensorMetadata, hashed: bool) -> dict[str, Any]:
    """The packed form of a tensor's boxes: the grid rule of their tiling when it has one, else every
    box's offset and shape; then, in the same order, their files, byte offsets, checksums and (``hashed``)
    content hashes."""
    columns = BoxColumns.of(tensor.boxes, len(tensor.global_shape))
    rule = grid_rule(columns.offset, columns.shape, tensor.global_shape)
    geometry: dict[str, Any]
    if rule is not None:
        columns = columns.take(rule.order)
        geometry = {
            "grid": [c.tolist() for c in rule.cuts],
            "split": _b64(np.stack([rule.split_cells, rule.split_counts], axis=1), "<u8"),
            "starts": _b64(rule.split_starts, "<u8"),
        }
    else:
        geometry = {"explicit": _b64(np.concatenate([columns.offset, columns.shape], axis=1), "<u8")}
    out = {
        "boxes": len(columns.file),
        **geometry,
        "file": _b64(columns.file, "<u4"),
        "byte_offset": _b64(columns.byte_offset, "<u8"),
        "crc32c": _b64(columns.checksums_in_order(), "<u4"),
    }
    if hashed:
        if columns.content_hash is None:
            raise ValueError(f"tensor {tensor.key!r} has no content hashes in a checkpoint with content hashes")
        out["hash"] = _b64(columns.content_hash, "u1")
    return out
