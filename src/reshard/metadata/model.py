"""The checkpoint's metadata as frozen values: files, tensors and their boxes, objects, common values.

This is the logical model; :mod:`reshard.metadata.wire` writes it as ``metadata.json`` and
:mod:`reshard.metadata.parse` reads and validates it back.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from reshard.metadata.columns import BoxColumns, PartBoxes, SavedBox, SavedBoxes
from reshard.state.dtypes import DTYPE_BY_NAME
from reshard.state.scaled import ScaledRecord

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CONTENT_HASH_ALGORITHM",
    "CONTENT_HASH_BYTES",
    "DATA_DIR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HASHED_VERSION",
    "MAX_INTEGER",
    "MAX_METADATA_BYTES",
    "MAX_NDIM",
    "METADATA_CHECKSUM_MEMBER",
    "METADATA_FILE",
    "PACK_MIN_BOXES",
    "PACK_MIN_CHECKSUMS",
    "PARTITIONED_VERSION",
    "PART_FILE_PATTERN",
    "PART_FORMAT",
    "READABLE_VERSIONS",
    "REFERENCED_FILE_PATTERN",
    "SCALED_VERSION",
    "SEALED_VERSION",
    "SIBLING_PREFIX",
    "DataFile",
    "Metadata",
    "MetadataPart",
    "ObjectMetadata",
    "SavedObject",
    "TensorMetadata",
    "document_digest",
    "part_path",
]

FORMAT_NAME = "reshard"
FORMAT_VERSION = 3
"""The format version this reshard writes for a checkpoint without content hashes."""
HASHED_VERSION = 4
"""The format version of a checkpoint with content hashes (and, for an incremental save, references to the
data files of other checkpoints): version 3 plus those (docs/format.md section 15)."""
SCALED_VERSION = 5
"""The format version of a checkpoint holding scaled (low-precision) tensors: version 4 plus the ``scaled``
member (docs/format.md section 16); a checkpoint without them is written as version 3 or 4 as before."""
PARTITIONED_VERSION = 6
"""The format version of partitioned metadata: version 5 whose ``tensors`` member is an index (dtype, global shape,
part) and whose boxes live in part files that the document names with their size and SHA-256 (docs/format.md
section 19). Written only for a checkpoint whose tensors' section is large, or when a save asks for it."""
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
SEALED_VERSION = 3
"""From this version on, a document ends with its own checksum (:func:`seal_document`)."""
METADATA_CHECKSUM_MEMBER = "metadata_crc32c"
MAX_METADATA_BYTES = 512 * 1024 * 1024
"""The largest ``metadata.json`` a reader reads (a checkpoint of 8192 ranks and 1.25 T parameters needs
36 MiB): a bigger one is refused before it is read, so that a hostile file cannot cost gigabytes."""
PACK_MIN_BOXES = 32
"""A writer packs a tensor that has at least this many boxes ..."""
PACK_MIN_CHECKSUMS = 256
"""... or at least this many checksums (unless told to pack all or none)."""
METADATA_FILE = "metadata.json"
DATA_DIR = "data"
PART_FORMAT = "reshard-metadata-part"
"""The ``format`` member of a part file of partitioned metadata (version 6)."""
PART_FILE_PATTERN = re.compile(r"^data/(?P<save_id>[0-9a-f]{8,})-metadata-(?P<number>[0-9]{5,})\.json$")
"""The names of the part files of partitioned metadata: ``data/<save id>-metadata-<number>.json``. The save id
keeps two saves' parts apart, and ``data/`` makes them files of the save like its data files."""


def part_path(save_id: str, number: int) -> str:
    """The name of part ``number`` of save ``save_id``'s partitioned metadata (:data:`PART_FILE_PATTERN`)."""
    return f"{DATA_DIR}/{save_id}-metadata-{number:05d}.json"


def document_digest(raw: bytes) -> str:
    """The SHA-256 (lowercase hex) of a ``metadata.json``'s bytes: what ties a record written beside it (a
    retirement, a certificate, the checks, a skipped step, a node-local copy) to exactly one save."""
    return hashlib.sha256(raw).hexdigest()


CHECKSUM_ALGORITHM = "crc32c"
SIBLING_PREFIX = "../"
"""How a storage name addresses a file of a sibling checkpoint (:attr:`DataFile.location`)."""
REFERENCED_FILE_PATTERN = re.compile(r"^data/[0-9a-f]{32}-r[0-9]{5,}\.bin$")
"""The only names a file of a sibling checkpoint may have: a data file as a save names it
(``data/<save id>-r<rank>.bin``, docs/format.md sections 9 and 15.2), so that a reference never names another
kind of file."""
CONTENT_HASH_ALGORITHM = "xxh3_128"
"""The content hash of every stored box in a version-4 checkpoint: XXH3's 128-bit variant (seed 0)."""
CONTENT_HASH_BYTES = 16
MAX_INTEGER = 2**62
MAX_NDIM = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class DataFile:
    """A data file of the checkpoint: ``path`` relative to the root of the checkpoint that holds it, ``size``
    in bytes. ``checkpoint`` is None for the checkpoint's own files; for a file an incremental save
    references, the name of the sibling checkpoint (same parent directory or prefix) that holds it."""

    path: str
    size: int
    checkpoint: str | None = None

    @property
    def location(self) -> str:
        """The file's name for this checkpoint's :class:`~reshard.storage.Storage`: ``path``, or
        ``../<checkpoint>/<path>`` for a file of a sibling checkpoint (the storages resolve that form)."""
        return self.path if self.checkpoint is None else f"{SIBLING_PREFIX}{self.checkpoint}/{self.path}"


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataPart:
    """A part file of partitioned metadata (version 6): its ``path`` relative to the checkpoint, its ``size`` in
    bytes and the SHA-256 of its bytes (lowercase hex), which a reader checks before it parses the part."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMetadata:
    """A tensor of the checkpoint: its element type, global shape and stored boxes."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    boxes: Sequence[SavedBox]
    """The stored boxes, sorted by offset: a tuple, or a :class:`SavedBoxes` (columns) when packed."""
    fingerprint: int | None = None
    """The layout-independent content fingerprint (see reshard.state.fingerprint), when the save computed it."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPE_BY_NAME[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole global tensor."""
        return math.prod(self.global_shape) * self.torch_dtype.itemsize


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedObject:
    """One stored ShardedObject value: the blob at ``offset`` of the object's grid (see ``codec``)."""

    offset: tuple[int, ...]
    file: int
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ObjectMetadata:
    """A ShardedObject of the checkpoint: its grid shape and one stored value per grid cell."""

    key: str
    global_shape: tuple[int, ...]
    entries: tuple[SavedObject, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Metadata:
    """Everything a reader needs to know about a committed checkpoint.

    Attributes:
        save_id: a random id unique to the save that wrote the checkpoint; data file names contain it.
        created_by: the writing library and version, for humans.
        world_size: number of ranks of the group that saved.
        checksum_chunk_bytes: each stored box's bytes are checksummed in pieces of this many bytes.
        files: the data files, indexed by ``SavedBox.file``.
        tensors: by key.
        objects: by key.
        common: common (non-sharded) values by dotted state-dict path, decoded.
        content_hashes: every stored box carries its content hash (:data:`CONTENT_HASH_ALGORITHM`), which
            an incremental save compares with (version 4).
        scaled: the record of each scaled (low-precision) tensor, by its data's key (version 5): its format,
            block shape and the keys of its scales.
        format_version: the version of the document this was read from (:data:`FORMAT_VERSION` for
            metadata made in memory); not part of the comparison of two Metadata.
        parts: the part files of partitioned metadata (version 6), in the order the index numbers them; empty
            for a document that holds its boxes itself. Not part of the comparison of two Metadata: how the
            boxes are stored is the writer's choice, not what the checkpoint holds.
    """

    save_id: str
    created_by: str
    world_size: int
    checksum_chunk_bytes: int
    files: tuple[DataFile, ...]
    tensors: dict[str, TensorMetadata] = field(default_factory=dict)
    objects: dict[str, ObjectMetadata] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)
    content_hashes: bool = False
    scaled: dict[str, ScaledRecord] = field(default_factory=dict)
    format_version: int = field(default=FORMAT_VERSION, compare=False)
    parts: tuple[MetadataPart, ...] = field(default=(), compare=False)

    @property
    def own_paths(self) -> tuple[str, ...]:
        """Every file of this checkpoint the committed document ties to it: its own data files (not those of
        sibling checkpoints it references) and the part files of partitioned metadata. What maintenance keeps,
        and what a copy of the checkpoint copies besides ``metadata.json``."""
        return tuple(f.path for f in self.files if f.checkpoint is None) + tuple(p.path for p in self.parts)

    @property
    def writes_version(self) -> int:
        """The version :meth:`to_json_bytes` writes: 5 with scaled tensors, 4 with content hashes or references,
        else 3."""
        if self.scaled:
            return SCALED_VERSION
        if self.content_hashes or any(f.checkpoint is not None for f in self.files):
            return HASHED_VERSION
        return FORMAT_VERSION

    @property
    def referenced_bytes(self) -> int:
        """Bytes of tensor data stored in other checkpoints' files (referenced by an incremental save); tensors
        whose boxes are in a part that was not read (partitioned metadata) are not counted."""
        others = np.array([f.checkpoint is not None for f in self.files], dtype=bool)
        if not others.any():
            return 0
        total = 0
        for t in self.tensors.values():
            if isinstance(t.boxes, PartBoxes):  # in a part that was not read: not counted
                continue
            columns = BoxColumns.of(t.boxes, len(t.global_shape))
            total += int(columns.byte_length[others[columns.file]].sum())
        return total

    @property
    def referenced_checkpoints(self) -> tuple[str, ...]:
        """The sibling checkpoints whose files this one references, sorted."""
        return tuple(sorted({f.checkpoint for f in self.files if f.checkpoint is not None}))

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data stored (each box once), in its own files and referenced ones alike. A tensor whose
        boxes are in a part that was not read counts its whole size: its boxes tile it, each stored once."""
        return sum(
            t.nbytes
            if isinstance(t.boxes, PartBoxes)
            else t.boxes.total_bytes
            if isinstance(t.boxes, SavedBoxes)
            else sum(b.byte_length for b in t.boxes)
            for t in self.tensors.values()
        )

    def to_json_dict(self, *, packed: bool | None = None) -> dict[str, Any]:
        """The wire form of the metadata (plain JSON types).

        Args:
            packed: which tensors get the packed encoding of version 2: None (what reshard writes) those
                with at least :data:`PACK_MIN_BOXES` boxes or :data:`PACK_MIN_CHECKSUMS` checksums, True
                all, False none. Tensors with an empty box are never packed.

        Returns every member of the version-3 document except its checksum, which only
        :meth:`to_json_bytes` can add (it covers the document's bytes).
        """
        from reshard.metadata.wire import metadata_to_json

        return metadata_to_json(self, packed=packed)

    def to_json_bytes(self, *, packed: bool | None = None) -> bytes:
        """``metadata.json``: :meth:`to_json_dict` as compact ASCII JSON, sealed with its checksum."""
        from reshard.metadata.wire import metadata_to_bytes

        return metadata_to_bytes(self, packed=packed)

    @classmethod
    def from_json_bytes(cls, raw: bytes, *, where: str = METADATA_FILE, lazy: bool = False) -> Metadata:
        """Parse and validate ``metadata.json`` (format version 1, 2 or 3).

        Args:
            raw: the document.
            where: names the document in error messages.
            lazy: decode (and validate) each packed tensor's boxes when they are first used rather than
                now. For a document another process has just validated: the ranks of a load get the bytes
                that the coordinator read and validated, and each decodes only the tensors it loads.

        Raises:
            CorruptCheckpointError: anything wrong, with the JSON path of the offending field (with
                ``lazy``, for a packed tensor's boxes, when they are first used); for version 3, a document
                whose checksum does not match its bytes.
        """
        from reshard.metadata.parse import parse_metadata

        return parse_metadata(raw, where=where, lazy=lazy)
