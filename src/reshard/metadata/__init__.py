"""The checkpoint's ``metadata.json``: schema, JSON encoding, and strict validation of what is read.

By concern: :mod:`~reshard.metadata.model` (the frozen values and the format's constants),
:mod:`~reshard.metadata.columns` (boxes one by one or in columns), :mod:`~reshard.metadata.wire` (writing,
the packed encoding, the document's checksum) and :mod:`~reshard.metadata.parse` (strict reading);
:meth:`Metadata.to_json_bytes` and :meth:`Metadata.from_json_bytes` are the entry points.
Decoding trusts nothing: every field's type and
range is checked, file names must stay inside the checkpoint, boxes must lie inside their tensor and
tile it exactly, and byte ranges must lie inside their files, so that a hostile ``metadata.json`` gets a
:class:`~reshard.CorruptCheckpointError` before anything is read or allocated. ``docs/format.md``
describes the same format in prose.

Six versions: version 1 lists every box of every tensor as a JSON object. Version 2 adds a *packed*
encoding of a tensor's boxes (a grid rule, or packed integers, for the geometry; packed integers for
files, offsets and checksums; see :mod:`reshard.geometry.grid`), which keeps the metadata of a checkpoint
of ten thousand ranks in tens of megabytes and its decoding in numpy. Version 3 is version 2 plus a
checksum of the document itself (its last member, ``metadata_crc32c``), so that damage which leaves valid
JSON (a changed offset, shape or size) is detected before anything is read. Version 4 is version 3 plus
a content hash per box (XXH3-128) and data files of sibling checkpoints (``files[i].checkpoint``), which an
incremental save references instead of rewriting unchanged boxes. Version 5 is version 4 plus the records of
scaled (low-precision) tensors (``scaled``: format, block, scale keys; :mod:`~reshard.metadata.scaled`). A
writer writes version 3, or 4 when the save hashes content, or 5 when it holds scaled tensors, packing the
tensors that have many boxes or checksums; readers read all six. Version 6 is version 5 with *partitioned*
metadata: ``tensors`` is an index (dtype, global shape, part) and the boxes live in part files that the
document names with their size and SHA-256 (:mod:`~reshard.metadata.partition` writes them,
:mod:`~reshard.metadata.parts` reads them), so that a rank of a load reads only the parts it needs.
In memory, packed boxes are a :class:`SavedBoxes`: a sequence of :class:`SavedBox` backed by columns.
"""

from __future__ import annotations

from reshard.metadata.columns import BoxColumns, PartBoxes, SavedBox, SavedBoxes
from reshard.metadata.model import (
    CONTENT_HASH_ALGORITHM,
    CONTENT_HASH_BYTES,
    DATA_DIR,
    FORMAT_NAME,
    FORMAT_VERSION,
    HASHED_VERSION,
    MAX_METADATA_BYTES,
    METADATA_CHECKSUM_MEMBER,
    METADATA_FILE,
    PACK_MIN_BOXES,
    PACK_MIN_CHECKSUMS,
    PART_FILE_PATTERN,
    PARTITIONED_VERSION,
    READABLE_VERSIONS,
    REFERENCED_FILE_PATTERN,
    SCALED_VERSION,
    SEALED_VERSION,
    SIBLING_PREFIX,
    DataFile,
    Metadata,
    MetadataPart,
    ObjectMetadata,
    SavedObject,
    TensorMetadata,
    document_digest,
    part_path,
)
from reshard.metadata.parse import check_relative_path
from reshard.metadata.wire import seal_document

__all__ = [
    "CONTENT_HASH_ALGORITHM",
    "CONTENT_HASH_BYTES",
    "DATA_DIR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASHED_VERSION",
    "MAX_METADATA_BYTES",
    "METADATA_CHECKSUM_MEMBER",
    "METADATA_FILE",
    "PACK_MIN_BOXES",
    "PACK_MIN_CHECKSUMS",
    "PARTITIONED_VERSION",
    "PART_FILE_PATTERN",
    "READABLE_VERSIONS",
    "REFERENCED_FILE_PATTERN",
    "SCALED_VERSION",
    "SEALED_VERSION",
    "SIBLING_PREFIX",
    "BoxColumns",
    "DataFile",
    "Metadata",
    "MetadataPart",
    "ObjectMetadata",
    "PartBoxes",
    "SavedBox",
    "SavedBoxes",
    "SavedObject",
    "TensorMetadata",
    "check_relative_path",
    "document_digest",
    "part_path",
    "seal_document",
]
