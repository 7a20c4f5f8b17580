"""Reading the part files of partitioned metadata (format version 6), hostile-proof.

A part is trusted only once its size and SHA-256 match what the sealed ``metadata.json`` says of it; its
boxes are then validated exactly as those of a whole document (docs/format.md section 19). Reading the bytes
from storage is :mod:`reshard.io.parts`' concern; this module is pure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Collection

from reshard.errors import CorruptCheckpointError
from reshard.metadata.columns import PartBoxes
from reshard.metadata.model import PART_FORMAT, PARTITIONED_VERSION, Metadata, TensorMetadata
from reshard.metadata.parse import DocumentParser
from reshard.state.codec import strict_json_loads

__all__ = ["parse_part", "part_of", "with_tensors"]


def part_of(metadata: Metadata, key: str) -> int | None:
    """The number of the part that holds tensor ``key``'s boxes, or None when they are not in an unread part."""
    boxes = metadata.tensors[key].boxes
    return boxes.part if isinstance(boxes, PartBoxes) else None


def with_tensors(metadata: Metadata, tensors: dict[str, TensorMetadata]) -> Metadata:
    """``metadata`` with the tensors of ``tensors`` (read from their parts) in place of their index entries."""
    if not tensors:
        return metadata
    return dataclasses.replace(metadata, tensors={k: tensors.get(k, t) for k, t in metadata.tensors.items()})


def parse_part(
    raw: bytes, metadata: Metadata, number: int, keys: Collection[str] | None = None, *, where: str | None = None
) -> dict[str, TensorMetadata]:
    """The tensors of part ``number`` of partitioned ``metadata`` (version 6), from the part file's bytes
    ``raw``: its size and SHA-256 are checked against the index first, then that it holds exactly the keys the
    index puts in it, then the boxes of ``keys`` (None: of all of them) exactly as a tensor of a whole document
    (inside its tensor and tiling it, byte ranges inside the files, checksums). The boxes of a key not asked for
    are neither decoded nor returned: a rank of a load validates what it uses. ``where`` names the part in errors
    (its location in the checkpoint's storage; default: its path in the checkpoint).

    Raises:
        CorruptCheckpointError: anything wrong, naming the part and the JSON path of the bad field.
    """
    part = metadata.parts[number]
    where = where or part.path
    if len(raw) != part.size:
        raise CorruptCheckpointError(f"{where}: holds {len(raw)} bytes, the metadata says {part.size}")
    if hashlib.sha256(raw).hexdigest() != part.sha256:
        raise CorruptCheckpointError(f"{where}: its SHA-256 does not match the metadata's: the part is damaged")
    try:
        doc = strict_json_loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON: {exc}") from exc
    parser = DocumentParser(where, sealed=True)
    parser.version, parser.hashed = PARTITIONED_VERSION, metadata.content_hashes
    top = parser.obj(doc, "$", {"format", "save_id", "part", "tensors"})
    if (top["format"], top["save_id"], top["part"]) != (PART_FORMAT, metadata.save_id, number):
        raise parser.fail("$", f"not part {number} of save {metadata.save_id}")
    mine = {k: t for k, t in metadata.tensors.items() if isinstance(t.boxes, PartBoxes) and t.boxes.part == number}
    if not isinstance(top["tensors"], dict) or set(top["tensors"]) != set(mine):
        raise parser.fail("tensors", f"expected the boxes of the {len(mine)} tensors the index puts in this part")
    out = {}
    for key, t in mine.items():
        if keys is not None and key not in keys:
            continue
        stored = top["tensors"][key]
        if not isinstance(stored, dict) or len(stored) != 1 or set(stored) - {"boxes", "packed"}:
            raise parser.fail(f"tensors[{key!r}]", "expected an object with one member, boxes or packed")
        entry = {"dtype": t.dtype, "global_shape": list(t.global_shape)} | stored
        tensor = parser.tensor(key, entry, metadata.files, metadata.checksum_chunk_bytes)
        out[key] = dataclasses.replace(tensor, fingerprint=t.fingerprint)
    return out
