"""The index of partitioned metadata (format version 6) in ``metadata.json``: the ``parts`` member and each
tensor's index entry (dtype, global shape, fingerprint, part), read hostile-proof by the document's parser.

Every rank of a load parses the index of thousands of tensors: an entry of the common form (exactly a known
dtype, a global shape of integers in range and a part in range) is taken at once, anything else is checked
field by field, so that the error names the field at fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from reshard.metadata.columns import PartBoxes
from reshard.metadata.model import (
    MAX_INTEGER,
    MAX_METADATA_BYTES,
    MAX_NDIM,
    PART_FILE_PATTERN,
    MetadataPart,
    TensorMetadata,
)
from reshard.metadata.paths import check_relative_path
from reshard.state.dtypes import DTYPE_BY_NAME

if TYPE_CHECKING:
    from reshard.metadata.parse import DocumentParser

__all__ = ["parse_index_entry", "parse_parts_member"]

_HEX = frozenset("0123456789abcdef")


def parse_parts_member(parser: DocumentParser, value: object, save_id: str) -> tuple[MetadataPart, ...]:
    """The ``parts`` member: at least one part, each named as save ``save_id`` names its part of that index
    (``data/<save id>-metadata-<index>.json``), with a size and a 64-digit SHA-256."""
    if not isinstance(value, list) or not value:
        raise parser.fail("parts", "expected a non-empty list")
    out = []
    for i, item in enumerate(value):
        entry = parser.obj(item, f"parts[{i}]", {"path", "size", "sha256"})
        path = parser.string(entry["path"], f"parts[{i}].path")
        match = PART_FILE_PATTERN.fullmatch(path)
        if check_relative_path(path) or match is None or match["save_id"] != save_id or int(match["number"]) != i:
            raise parser.fail(f"parts[{i}].path", f"expected data/{save_id}-metadata-{i:05d}.json, got {path!r}")
        digest = parser.string(entry["sha256"], f"parts[{i}].sha256")
        if len(digest) != 64 or not set(digest) <= _HEX:
            raise parser.fail(f"parts[{i}].sha256", "expected 64 lowercase hexadecimal digits")
        size = parser.integer(entry["size"], f"parts[{i}].size")
        if size > MAX_METADATA_BYTES:  # a part is read whole into memory: the limit of metadata.json holds for it
            raise parser.fail(f"parts[{i}].size", f"{size} bytes, more than metadata may hold ({MAX_METADATA_BYTES})")
        out.append(MetadataPart(path=path, size=size, sha256=digest))
    return tuple(out)


def parse_index_entry(parser: DocumentParser, key: str, value: object, parts: int) -> TensorMetadata:
    """``tensors[key]`` of the index: dtype, global shape, fingerprint (optional) and the number of the part
    that holds the tensor's boxes (below ``parts``); its boxes are a :class:`PartBoxes` until that part is read."""
    plain = _plain_entry(value, parts)
    if plain is not None:
        dtype, shape, part = plain
        return TensorMetadata(key=key, dtype=dtype, global_shape=shape, boxes=PartBoxes(key, part))
    path = f"tensors[{key!r}]"
    keys = {"dtype", "global_shape", "part"} | ({"fingerprint"} & set(value) if isinstance(value, dict) else set())
    doc = parser.obj(value, path, keys)
    part = parser.integer(doc["part"], f"{path}.part")
    if part >= parts:
        raise parser.fail(f"{path}.part", f"part {part} is out of range ({parts} parts)")
    dtype_name, global_shape, fingerprint = parser.described(path, doc)
    return TensorMetadata(
        key=key, dtype=dtype_name, global_shape=global_shape, boxes=PartBoxes(key, part), fingerprint=fingerprint
    )


def _plain_entry(value: object, parts: int) -> tuple[str, tuple[int, ...], int] | None:
    """An entry of exactly ``dtype`` (known), ``global_shape`` (at most :data:`MAX_NDIM` integers in range) and
    ``part`` (in range), as its values; None for anything else."""
    if not isinstance(value, dict) or len(value) != 3:
        return None
    dtype, shape, part = value.get("dtype"), value.get("global_shape"), value.get("part")
    if not isinstance(dtype, str) or dtype not in DTYPE_BY_NAME or not isinstance(shape, list) or len(shape) > MAX_NDIM:
        return None
    if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part < parts:
        return None
    if not all(type(n) is int and 0 <= n <= MAX_INTEGER for n in shape):
        return None
    return dtype, tuple(shape), part
