"""The checkpoint's ``metadata.json``: schema, JSON encoding, and strict validation of what is read.

The logical model is a set of frozen dataclasses; :meth:`Metadata.to_json_bytes` and
:meth:`Metadata.from_json_bytes` are the wire model. Decoding trusts nothing: every field's type and
range is checked, file names must stay inside the checkpoint, boxes must lie inside their tensor and
tile it exactly, and byte ranges must lie inside their files, so that a hostile ``metadata.json`` gets a
:class:`~reshard.CorruptCheckpointError` before anything is read or allocated. ``docs/format.md``
describes the same format in prose.

Three versions: version 1 lists every box of every tensor as a JSON object. Version 2 adds a *packed*
encoding of a tensor's boxes (a grid rule, or packed integers, for the geometry; packed integers for
files, offsets and checksums; see :mod:`reshard.planning.grid`), which keeps the metadata of a checkpoint
of ten thousand ranks in tens of megabytes and its decoding in numpy. Version 3 is version 2 plus a
checksum of the document itself (its last member, ``metadata_crc32c``), so that damage which leaves valid
JSON (a changed offset, shape or size) is detected before anything is read. A writer writes version 3,
packing the tensors that have many boxes or checksums; readers read all three. In memory, packed boxes
are a :class:`SavedBoxes`: a sequence of :class:`SavedBox` backed by columns.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import crc32c
import numpy as np
import numpy.typing as npt
import torch

from reshard.boxes import Box
from reshard.codec import decode_tagged, encode_tagged, strict_json_loads
from reshard.dtypes import DTYPE_BY_NAME
from reshard.errors import CorruptCheckpointError
from reshard.planning.grid import BoxIndex, expand_grid, grid_rule
from reshard.planning.tiling import MAX_CORNER_NDIM, find_tiling_problem, untiled_groups

__all__ = [
    "DATA_DIR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_METADATA_BYTES",
    "METADATA_CHECKSUM_MEMBER",
    "METADATA_FILE",
    "PACK_MIN_BOXES",
    "PACK_MIN_CHECKSUMS",
    "READABLE_VERSIONS",
    "SEALED_VERSION",
    "BoxColumns",
    "DataFile",
    "Metadata",
    "ObjectMetadata",
    "SavedBox",
    "SavedBoxes",
    "SavedObject",
    "TensorMetadata",
    "check_relative_path",
    "seal_document",
]

FORMAT_NAME = "reshard"
FORMAT_VERSION = 3
"""The format version this reshard writes."""
READABLE_VERSIONS = (1, 2, 3)
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
CHECKSUM_ALGORITHM = "crc32c"
_MAX_INT = 2**62
_MAX_NDIM = 64

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class DataFile:
    """A data file of the checkpoint: ``path`` relative to the checkpoint root, ``size`` in bytes."""

    path: str
    size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedBox:
    """One stored box of a tensor: elements ``[offset, offset + shape)`` of the global tensor, stored
    row-major in ``byte_length`` bytes at ``byte_offset`` of data file number ``file``.

    ``checksums`` holds the CRC-32C of each consecutive ``checksum_chunk_bytes`` piece of those bytes
    (the last piece may be shorter).
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    file: int
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]

    @property
    def box(self) -> Box:
        return Box(self.offset, self.shape)


@dataclass(frozen=True, slots=True, eq=False)
class BoxColumns:
    """The stored boxes of one tensor as columns, sorted by offset: row ``i`` describes box ``i``.

    Attributes:
        offset, shape: ``(n, ndim)`` elements, as in :class:`SavedBox`.
        file, byte_offset, byte_length: ``(n,)``, as in :class:`SavedBox`.
        crc_start, crc_count: ``(n,)``: box ``i``'s checksums are ``crc[crc_start[i]:][:crc_count[i]]``.
        crc: every checksum (CRC-32C), ``uint32``.
    """

    offset: Int64Array
    shape: Int64Array
    file: Int64Array
    byte_offset: Int64Array
    byte_length: Int64Array
    crc_start: Int64Array
    crc_count: Int64Array
    crc: npt.NDArray[np.uint32]

    @classmethod
    def of(cls, boxes: Sequence[SavedBox], ndim: int) -> BoxColumns:
        """The columns of any sequence of boxes (a :class:`SavedBoxes` already has them)."""
        if isinstance(boxes, SavedBoxes):
            return boxes.columns
        n = len(boxes)
        counts = np.array([len(b.checksums) for b in boxes], dtype=np.int64)
        return cls(
            offset=np.array([b.offset for b in boxes], dtype=np.int64).reshape(n, ndim),
            shape=np.array([b.shape for b in boxes], dtype=np.int64).reshape(n, ndim),
            file=np.array([b.file for b in boxes], dtype=np.int64),
            byte_offset=np.array([b.byte_offset for b in boxes], dtype=np.int64),
            byte_length=np.array([b.byte_length for b in boxes], dtype=np.int64),
            crc_start=np.cumsum(counts) - counts,
            crc_count=counts,
            crc=np.array([c for b in boxes for c in b.checksums], dtype=np.uint32),
        )

    def sorted(self) -> BoxColumns:
        """The same boxes sorted by offset (lexicographically), the order of the Python API."""
        d = self.offset.shape[1]
        order = np.lexsort(tuple(self.offset[:, a] for a in range(d - 1, -1, -1))) if d else np.arange(len(self.file))
        return self.take(order)

    def take(self, order: Int64Array) -> BoxColumns:
        """Boxes ``order`` (the checksums stay where they are; only the per-box columns move)."""
        return BoxColumns(
            offset=self.offset[order],
            shape=self.shape[order],
            file=self.file[order],
            byte_offset=self.byte_offset[order],
            byte_length=self.byte_length[order],
            crc_start=self.crc_start[order],
            crc_count=self.crc_count[order],
            crc=self.crc,
        )

    def checksums_in_order(self) -> npt.NDArray[np.uint32]:
        """Every box's checksums, box after box (the packed ``crc32c`` field)."""
        total = int(self.crc_count.sum())
        first = np.repeat(self.crc_start - (np.cumsum(self.crc_count) - self.crc_count), self.crc_count)
        return self.crc[first + np.arange(total, dtype=np.int64)]


class SavedBoxes(Sequence[SavedBox]):
    """The stored boxes of one tensor held as :class:`BoxColumns`, sorted by offset.

    A read-only sequence of :class:`SavedBox` (a box object is made when asked for), so that a tensor of a
    hundred thousand boxes costs a few megabytes and no Python object per box. It can also be *lazy*: the
    columns are then decoded (and validated) from the metadata document on first use, so a rank that only
    needs some tensors decodes only those. :meth:`lookup` finds the boxes overlapping a region.
    """

    __slots__ = ("_columns", "_count", "_index", "_load")

    def __init__(
        self, columns: BoxColumns | None = None, *, count: int = 0, load: Callable[[], BoxColumns] | None = None
    ) -> None:
        """Either ``columns`` (sorted by offset), or ``count`` and ``load``, which returns them."""
        if (columns is None) == (load is None):
            raise ValueError("SavedBoxes takes either columns or a loader")
        self._columns = columns
        self._load = load
        self._count = len(columns.file) if columns is not None else count
        self._index: BoxIndex | None = None

    @property
    def columns(self) -> BoxColumns:
        if self._columns is None:
            if self._load is None:  # unreachable: __init__ sets one of the two
                raise RuntimeError("SavedBoxes has neither columns nor a loader")
            columns = self._load()
            if len(columns.file) != self._count:
                raise CorruptCheckpointError(f"packed boxes: {len(columns.file)} decoded, {self._count} declared")
            self._columns, self._load = columns, None
        return self._columns

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> SavedBox: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[SavedBox, ...]: ...

    def __getitem__(self, index: int | slice) -> SavedBox | tuple[SavedBox, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._count)))
        if not -self._count <= index < self._count:
            raise IndexError(f"box {index} of {self._count}")
        i = index % self._count
        c = self.columns
        start, count = int(c.crc_start[i]), int(c.crc_count[i])
        return SavedBox(
            offset=tuple(c.offset[i].tolist()),
            shape=tuple(c.shape[i].tolist()),
            file=int(c.file[i]),
            byte_offset=int(c.byte_offset[i]),
            byte_length=int(c.byte_length[i]),
            checksums=tuple(c.crc[start : start + count].tolist()),
        )

    def __iter__(self) -> Iterator[SavedBox]:
        for i in range(self._count):
            yield self[i]

    def box(self, i: int) -> Box:
        """The region of box ``i`` (without making its :class:`SavedBox`)."""
        c = self.columns
        return Box(tuple(c.offset[i].tolist()), tuple(c.shape[i].tolist()))

    def lookup(self) -> BoxIndex:
        """The lookup structure of these boxes (built on first use)."""
        if self._index is None:
            self._index = BoxIndex(self.columns.offset, self.columns.shape)
        return self._index

    @property
    def total_bytes(self) -> int:
        return int(self.columns.byte_length.sum())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        if len(other) != self._count:
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"SavedBoxes({self._count} boxes)"


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMetadata:
    """A tensor of the checkpoint: its element type, global shape and stored boxes."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    boxes: Sequence[SavedBox]
    """The stored boxes, sorted by offset: a tuple, or a :class:`SavedBoxes` (columns) when packed."""
    fingerprint: int | None = None
    """The layout-independent content fingerprint (see reshard.fingerprint), when the save computed it."""

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
        format_version: the version of the document this was read from (:data:`FORMAT_VERSION` for
            metadata made in memory); not part of the comparison of two Metadata.
    """

    save_id: str
    created_by: str
    world_size: int
    checksum_chunk_bytes: int
    files: tuple[DataFile, ...]
    tensors: dict[str, TensorMetadata] = field(default_factory=dict)
    objects: dict[str, ObjectMetadata] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)
    format_version: int = field(default=FORMAT_VERSION, compare=False)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data stored (each box once)."""
        return sum(
            t.boxes.total_bytes if isinstance(t.boxes, SavedBoxes) else sum(b.byte_length for b in t.boxes)
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
        tensors: dict[str, Any] = {}
        for key, t in self.tensors.items():
            entry: dict[str, Any] = {"dtype": t.dtype, "global_shape": list(t.global_shape)}
            if t.fingerprint is not None:
                entry["fingerprint"] = f"{t.fingerprint:016x}"
            if _should_pack(t, packed):
                entry["packed"] = _packed_json(t)
            else:
                entry["boxes"] = [
                    {
                        "offset": list(b.offset),
                        "shape": list(b.shape),
                        "file": b.file,
                        "byte_offset": b.byte_offset,
                        "byte_length": b.byte_length,
                        "crc32c": list(b.checksums),
                    }
                    for b in t.boxes
                ]
            tensors[key] = entry
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "save_id": self.save_id,
            "created_by": self.created_by,
            "world_size": self.world_size,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": self.checksum_chunk_bytes},
            "files": [{"path": f.path, "size": f.size} for f in self.files],
            "tensors": tensors,
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
                for key, o in self.objects.items()
            },
            "common": {path: encode_tagged(value, where=path) for path, value in self.common.items()},
        }

    def to_json_bytes(self, *, packed: bool | None = None) -> bytes:
        """``metadata.json``: :meth:`to_json_dict` as compact ASCII JSON, sealed with its checksum."""
        body = json.dumps(self.to_json_dict(packed=packed), separators=(",", ":"), allow_nan=False).encode("utf-8")
        return seal_document(body)

    @classmethod
    def from_json_bytes(cls, raw: bytes, *, where: str = METADATA_FILE, lazy: bool = False) -> Metadata:
        """Parse and validate ``metadata.json`` (format version 1 or 2).

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
        sealed = _check_seal(raw, where)
        try:
            doc = strict_json_loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
            raise CorruptCheckpointError(f"{where}: not valid JSON: {exc}") from exc
        return _Parser(where, lazy=lazy, sealed=sealed).parse(doc)


_SEAL_PREFIX = b',"' + METADATA_CHECKSUM_MEMBER.encode() + b'":"'
_SEAL_LENGTH = 10
"""The 8 hexadecimal digits of the checksum and the two bytes ``"}`` that end a sealed document."""


def seal_document(body: bytes) -> bytes:
    """Add the checksum member to a document: ``body`` is a JSON object's text, without the member,
    ending with ``}``. The result ends with ``,"metadata_crc32c":"<8 lowercase hex digits>"}``, and the
    checksum is the CRC-32C of every byte before those 8 digits (docs/format.md section 6)."""
    text = body.rstrip()
    if not text.endswith(b"}") or text.replace(b" ", b"") == b"{}":
        raise ValueError("seal_document needs the text of a JSON object with members")
    head = text[:-1] + _SEAL_PREFIX
    return head + f"{crc32c.crc32c(head):08x}".encode() + b'"}'


def _check_seal(raw: bytes, where: str) -> bool:
    """Whether ``raw`` ends with a checksum member; a checksum that does not match is corruption."""
    if len(raw) < len(_SEAL_PREFIX) + _SEAL_LENGTH or not raw.endswith(b'"}'):
        return False
    if raw[-_SEAL_LENGTH - len(_SEAL_PREFIX) : -_SEAL_LENGTH] != _SEAL_PREFIX:
        return False
    digits = raw[-_SEAL_LENGTH:-2]
    if not all(c in b"0123456789abcdef" for c in digits):
        raise CorruptCheckpointError(f"{where}: {METADATA_CHECKSUM_MEMBER}: expected 8 lowercase hexadecimal digits")
    expected = int(digits, 16)
    actual = crc32c.crc32c(raw[:-_SEAL_LENGTH])
    if actual != expected:
        raise CorruptCheckpointError(
            f"{where}: the document's checksum does not match its bytes ({METADATA_CHECKSUM_MEMBER} {expected:08x}, "
            f"computed {actual:08x}): metadata.json is damaged"
        )
    return True


def check_relative_path(path: str) -> str | None:
    """Why ``path`` is not a safe relative file name inside a checkpoint, or None when it is.

    Safe names are POSIX relative paths of non-empty components, without ``.``/``..``, backslashes,
    NUL, a URL scheme or a drive letter.
    """
    if not path:
        return "is empty"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 text"
    if "\x00" in path:
        return "contains NUL"
    if "\\" in path:
        return "contains a backslash"
    if path.startswith("/"):
        return "is absolute"
    if ":" in path:
        return "contains ':' (a scheme or drive)"
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' component"
    return None


class _Parser:
    """Validating decoder of the wire form; every error names the JSON path of the bad field."""

    def __init__(self, where: str, *, lazy: bool = False, sealed: bool = False) -> None:
        self.where = where
        self.lazy = lazy
        self.sealed = sealed
        self.version = 1

    def fail(self, path: str, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {path}: {message}")

    def obj(self, value: object, path: str, keys: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected an object, got {type(value).__name__}")
        if set(value) != keys:
            missing, extra = sorted(keys - set(value)), sorted(set(value) - keys)
            raise self.fail(path, f"expected fields {sorted(keys)} (missing {missing}, unexpected {extra})")
        return value

    def integer(self, value: object, path: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_INT:
            raise self.fail(path, f"expected a non-negative integer below 2**62, got {value!r}")
        return value

    def int_list(self, value: object, path: str, max_len: int | None = None) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self.fail(path, f"expected a list of integers, got {type(value).__name__}")
        if max_len is not None and len(value) > max_len:
            raise self.fail(path, f"has {len(value)} entries, at most {max_len} allowed")
        return tuple(self.integer(v, f"{path}[{i}]") for i, v in enumerate(value))

    def key(self, key: str, section: str) -> str:
        """A tensor, object or common key: text that UTF-8 can hold (no lone surrogates), as every key a
        state dict can give is."""
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise self.fail(f"{section}[{key!r}]", "the key is not valid Unicode text (a lone surrogate)") from None
        return key

    def string(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {type(value).__name__}")
        return value

    def parse(self, doc: object) -> Metadata:
        if isinstance(doc, dict):  # format and version first: another version may have other fields
            if doc.get("format") != FORMAT_NAME:
                found = doc.get("format")
                raise self.fail("format", f"expected {FORMAT_NAME!r}, got {found!r}: not a reshard checkpoint")
            version = doc.get("version")
            if type(version) is not int or version not in READABLE_VERSIONS:
                raise self.fail(
                    "version",
                    f"format version {version!r} is not supported (this reshard reads versions "
                    f"{', '.join(map(str, READABLE_VERSIONS))})",
                )
            self.version = version
            if version >= SEALED_VERSION and not self.sealed:
                raise self.fail(
                    METADATA_CHECKSUM_MEMBER,
                    f"a version-{version} document must end with its checksum member "
                    f'(,"{METADATA_CHECKSUM_MEMBER}":"<8 hex digits>"}}): metadata.json is damaged or was edited',
                )
        members = {
            "format",
            "version",
            "save_id",
            "created_by",
            "world_size",
            "checksum",
            "files",
            "tensors",
            "objects",
            "common",
        }
        if self.version >= SEALED_VERSION:
            members.add(METADATA_CHECKSUM_MEMBER)
        top = self.obj(doc, "$", members)
        checksum = self.obj(top["checksum"], "checksum", {"algorithm", "chunk_bytes"})
        if checksum["algorithm"] != CHECKSUM_ALGORITHM:
            raise self.fail("checksum.algorithm", f"unsupported algorithm {checksum['algorithm']!r}")
        chunk_bytes = self.integer(checksum["chunk_bytes"], "checksum.chunk_bytes")
        if chunk_bytes == 0:
            raise self.fail("checksum.chunk_bytes", "must be positive")
        world_size = self.integer(top["world_size"], "world_size")
        if world_size == 0:
            raise self.fail("world_size", "must be at least 1")
        files = self.files(top["files"])
        tensors_doc = top["tensors"]
        if not isinstance(tensors_doc, dict):
            raise self.fail("tensors", "expected an object")
        tensors = {
            self.key(key, "tensors"): self.tensor(key, value, files, chunk_bytes) for key, value in tensors_doc.items()
        }
        objects_doc = top["objects"]
        if not isinstance(objects_doc, dict):
            raise self.fail("objects", "expected an object")
        objects = {
            self.key(key, "objects"): self.object(key, value, files, chunk_bytes) for key, value in objects_doc.items()
        }
        common_doc = top["common"]
        if not isinstance(common_doc, dict):
            raise self.fail("common", "expected an object")
        common = {
            self.key(path, "common"): decode_tagged(value, where=f"{self.where}: common[{path!r}]")
            for path, value in common_doc.items()
        }
        return Metadata(
            save_id=self.string(top["save_id"], "save_id"),
            created_by=self.string(top["created_by"], "created_by"),
            world_size=world_size,
            checksum_chunk_bytes=chunk_bytes,
            files=files,
            tensors=tensors,
            objects=objects,
            common=common,
            format_version=self.version,
        )

    def files(self, value: object) -> tuple[DataFile, ...]:
        if not isinstance(value, list):
            raise self.fail("files", "expected a list")
        out = []
        seen: set[str] = set()
        for i, item in enumerate(value):
            entry = self.obj(item, f"files[{i}]", {"path", "size"})
            path = self.string(entry["path"], f"files[{i}].path")
            problem = check_relative_path(path)
            if problem:
                raise self.fail(f"files[{i}].path", f"file name {path!r} {problem}")
            if path == METADATA_FILE or path in seen:
                raise self.fail(f"files[{i}].path", f"file name {path!r} is repeated or reserved")
            seen.add(path)
            out.append(DataFile(path=path, size=self.integer(entry["size"], f"files[{i}].size")))
        return tuple(out)

    def byte_range(
        self, entry: dict[str, Any], path: str, files: tuple[DataFile, ...], chunk_bytes: int
    ) -> tuple[int, int, int, tuple[int, ...]]:
        file = self.integer(entry["file"], f"{path}.file")
        if file >= len(files):
            raise self.fail(f"{path}.file", f"file index {file} is out of range ({len(files)} files)")
        byte_offset = self.integer(entry["byte_offset"], f"{path}.byte_offset")
        byte_length = self.integer(entry["byte_length"], f"{path}.byte_length")
        if byte_offset + byte_length > files[file].size:
            raise self.fail(
                path,
                f"bytes [{byte_offset}, {byte_offset + byte_length}) lie past the end of "
                f"{files[file].path} ({files[file].size} bytes)",
            )
        expected_chunks = -(-byte_length // chunk_bytes)
        checksums = self.int_list(entry["crc32c"], f"{path}.crc32c", max_len=expected_chunks)
        if len(checksums) != expected_chunks or any(c >= 2**32 for c in checksums):
            raise self.fail(f"{path}.crc32c", f"expected {expected_chunks} 32-bit checksums")
        return file, byte_offset, byte_length, checksums

    def tensor(self, key: str, value: object, files: tuple[DataFile, ...], chunk_bytes: int) -> TensorMetadata:
        path = f"tensors[{key!r}]"
        keys = {
            "dtype",
            "global_shape",
            "packed" if self.version >= 2 and isinstance(value, dict) and "packed" in value else "boxes",
        }
        doc = self.obj(
            value, path, keys | {"fingerprint"} if isinstance(value, dict) and "fingerprint" in value else keys
        )
        fingerprint = None
        if "fingerprint" in doc:
            text = doc["fingerprint"]
            if not isinstance(text, str) or len(text) != 16 or any(c not in "0123456789abcdef" for c in text):
                raise self.fail(f"{path}.fingerprint", "expected 16 lowercase hex digits")
            fingerprint = int(text, 16)
        dtype_name = self.string(doc["dtype"], f"{path}.dtype")
        dtype = DTYPE_BY_NAME.get(dtype_name)
        if dtype is None:
            raise self.fail(f"{path}.dtype", f"unknown dtype {dtype_name!r}")
        global_shape = self.int_list(doc["global_shape"], f"{path}.global_shape", max_len=_MAX_NDIM)
        if "packed" in doc:
            if math.prod(global_shape) * dtype.itemsize > _MAX_INT:
                raise self.fail(
                    f"{path}.global_shape", f"a packed tensor holds at most 2**62 bytes, not {list(global_shape)}"
                )
            packed = _PackedTensor(
                self, f"{path}.packed", doc["packed"], global_shape, dtype.itemsize, files, chunk_bytes
            )
            boxes: Sequence[SavedBox] = (
                SavedBoxes(count=packed.count, load=packed.decode) if self.lazy else SavedBoxes(packed.decode())
            )
            return TensorMetadata(
                key=key, dtype=dtype_name, global_shape=global_shape, boxes=boxes, fingerprint=fingerprint
            )
        if not isinstance(doc["boxes"], list):
            raise self.fail(f"{path}.boxes", "expected a list")
        saved = []
        for i, item in enumerate(doc["boxes"]):
            bpath = f"{path}.boxes[{i}]"
            entry = self.obj(item, bpath, {"offset", "shape", "file", "byte_offset", "byte_length", "crc32c"})
            offset = self.int_list(entry["offset"], f"{bpath}.offset", max_len=_MAX_NDIM)
            shape = self.int_list(entry["shape"], f"{bpath}.shape", max_len=_MAX_NDIM)
            box = Box(offset, shape) if len(offset) == len(shape) else None
            if box is None or not box.is_inside(global_shape):
                raise self.fail(
                    bpath, f"box at {list(offset)} of shape {list(shape)} lies outside {list(global_shape)}"
                )
            file, byte_offset, byte_length, checksums = self.byte_range(entry, bpath, files, chunk_bytes)
            if byte_length != box.volume * dtype.itemsize:
                raise self.fail(bpath, f"byte_length {byte_length} does not match {box.volume} {dtype_name} elements")
            saved.append(
                SavedBox(
                    offset=offset,
                    shape=shape,
                    file=file,
                    byte_offset=byte_offset,
                    byte_length=byte_length,
                    checksums=checksums,
                )
            )
        problem = find_tiling_problem(global_shape, [b.box for b in saved])
        if problem is not None:
            if problem.kind == "overlap":
                i, j = problem.indices
                raise self.fail(path, f"boxes {i} and {j} overlap")
            raise self.fail(path, f"boxes cover {problem.covered} of {problem.total} elements")
        return TensorMetadata(
            key=key, dtype=dtype_name, global_shape=global_shape, boxes=tuple(saved), fingerprint=fingerprint
        )

    def object(self, key: str, value: object, files: tuple[DataFile, ...], chunk_bytes: int) -> ObjectMetadata:
        path = f"objects[{key!r}]"
        doc = self.obj(value, path, {"global_shape", "entries"})
        global_shape = self.int_list(doc["global_shape"], f"{path}.global_shape", max_len=_MAX_NDIM)
        if not isinstance(doc["entries"], list):
            raise self.fail(f"{path}.entries", "expected a list")
        entries = []
        seen: set[tuple[int, ...]] = set()
        for i, item in enumerate(doc["entries"]):
            epath = f"{path}.entries[{i}]"
            entry = self.obj(item, epath, {"offset", "file", "byte_offset", "byte_length", "crc32c"})
            offset = self.int_list(entry["offset"], f"{epath}.offset", max_len=_MAX_NDIM)
            if len(offset) != len(global_shape) or any(o >= s for o, s in zip(offset, global_shape, strict=True)):
                raise self.fail(f"{epath}.offset", f"{list(offset)} is outside the grid {list(global_shape)}")
            if offset in seen:
                raise self.fail(f"{epath}.offset", f"{list(offset)} is stored twice")
            seen.add(offset)
            file, byte_offset, byte_length, checksums = self.byte_range(entry, epath, files, chunk_bytes)
            entries.append(
                SavedObject(
                    offset=offset, file=file, byte_offset=byte_offset, byte_length=byte_length, checksums=checksums
                )
            )
        if len(entries) != math.prod(global_shape):
            raise self.fail(path, f"{len(entries)} entries for a grid of {math.prod(global_shape)} cells")
        return ObjectMetadata(key=key, global_shape=global_shape, entries=tuple(entries))


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


def _packed_json(tensor: TensorMetadata) -> dict[str, Any]:
    """The packed form of a tensor's boxes: the grid rule of their tiling when it has one, else every
    box's offset and shape; then, in the same order, their files, byte offsets and checksums."""
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
    return {
        "boxes": len(columns.file),
        **geometry,
        "file": _b64(columns.file, "<u4"),
        "byte_offset": _b64(columns.byte_offset, "<u8"),
        "crc32c": _b64(columns.checksums_in_order(), "<u4"),
    }


class _PackedTensor:
    """One packed tensor entry (format version 2): its fields are checked for shape at once, its boxes
    decoded and validated by :meth:`decode`, now or, for a lazy parse, when first used."""

    def __init__(
        self,
        parser: _Parser,
        path: str,
        value: object,
        global_shape: tuple[int, ...],
        itemsize: int,
        files: tuple[DataFile, ...],
        chunk_bytes: int,
    ) -> None:
        self.parser = parser
        self.path = path
        self.grid = isinstance(value, dict) and "grid" in value
        fields = {"boxes", "file", "byte_offset", "crc32c"} | (
            {"grid", "split", "starts"} if self.grid else {"explicit"}
        )
        self.doc = parser.obj(value, path, fields)
        self.count = parser.integer(self.doc["boxes"], f"{path}.boxes")
        for name in fields - {"boxes", "grid"}:
            parser.string(self.doc[name], f"{path}.{name}")
        # The number of boxes sizes what a lazy parse promises: check it against the text now.
        if len(self.doc["file"]) != 4 * -(-4 * self.count // 3):
            raise self.fail("file", f"cannot hold the file indices of {self.count} boxes")
        self.global_shape = global_shape
        self.itemsize = itemsize
        self.files = files
        self.chunk_bytes = chunk_bytes

    def fail(self, name: str, message: str) -> CorruptCheckpointError:
        return self.parser.fail(f"{self.path}.{name}", message)

    def integers(self, name: str, dtype: str, count: int | None) -> Int64Array:
        """Field ``name``: base64 of little-endian ``dtype`` integers (``count`` of them, if given)."""
        try:
            raw = base64.b64decode(self.doc[name], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise self.fail(name, f"not valid base64: {exc}") from None
        size = np.dtype(dtype).itemsize
        if len(raw) % size or (count is not None and len(raw) != count * size):
            expected = f"{count} integers" if count is not None else f"a multiple of {size} bytes"
            raise self.fail(name, f"holds {len(raw)} bytes, expected {expected} of {size} bytes")
        values = np.frombuffer(raw, dtype=dtype)
        if dtype == "<u8" and (values > _MAX_INT).any():
            raise self.fail(name, "holds an integer above 2**62")
        return values.astype(np.int64)

    def decode(self) -> BoxColumns:
        n = self.count
        d = len(self.global_shape)
        shape_of = np.asarray(self.global_shape, dtype=np.int64)
        file = self.integers("file", "<u4", n)
        byte_offset = self.integers("byte_offset", "<u8", n)
        crc = self.integers("crc32c", "<u4", None).astype(np.uint32)
        if self.grid:
            offset, shape = self.decode_grid(n, d)
        else:
            offset, shape = self.decode_explicit(n, d, shape_of)
        byte_length = (np.prod(shape, axis=1) if d else np.ones(n, dtype=np.int64)) * self.itemsize
        if (file >= len(self.files)).any():
            raise self.fail("file", f"a file index is out of range ({len(self.files)} files)")
        sizes = np.array([f.size for f in self.files], dtype=np.uint64)
        past = byte_offset.astype(np.uint64) + byte_length.astype(np.uint64) > sizes[file] if n else np.zeros(0, bool)
        if past.any():
            i = int(np.argmax(past))
            raise self.fail(
                "byte_offset",
                f"box {i}: bytes [{byte_offset[i]}, {byte_offset[i] + byte_length[i]}) lie past the end of "
                f"{self.files[int(file[i])].path} ({self.files[int(file[i])].size} bytes)",
            )
        counts = -(-byte_length // self.chunk_bytes)
        if int(counts.sum()) != len(crc):
            raise self.fail("crc32c", f"holds {len(crc)} checksums, the boxes need {int(counts.sum())}")
        return BoxColumns(
            offset=offset,
            shape=shape,
            file=file,
            byte_offset=byte_offset,
            byte_length=byte_length,
            crc_start=np.cumsum(counts) - counts,
            crc_count=counts,
            crc=crc,
        ).sorted()

    def decode_grid(self, n: int, d: int) -> tuple[Int64Array, Int64Array]:
        grid = self.doc["grid"]
        if not isinstance(grid, list) or len(grid) != d:
            raise self.fail("grid", f"expected a list of {d} lists of cuts, one per axis")
        cuts = tuple(
            np.asarray(self.parser.int_list(c, f"{self.path}.grid[{a}]"), dtype=np.int64) for a, c in enumerate(grid)
        )
        if any(len(c) == 0 for c in cuts):
            raise self.fail("grid", "every axis needs at least the cut 0")
        cells = math.prod(len(c) - 1 for c in cuts)
        split = self.integers("split", "<u8", None)
        if len(split) % 2:
            raise self.fail("split", "expected (cell, count) pairs")
        split_cells, split_counts = split[0::2], split[1::2]
        starts = self.integers("starts", "<u8", None)
        if cells > n or (split_counts > n).any() or cells + int(split_counts.sum()) != n:
            raise self.fail(
                "boxes", f"{n} boxes do not match a grid of {cells} cells split {int(split_counts.sum())} times"
            )
        try:
            return expand_grid(self.global_shape, cuts, split_cells, split_counts, starts)
        except ValueError as exc:
            raise self.fail("grid", str(exc)) from None

    def decode_explicit(self, n: int, d: int, global_shape: Int64Array) -> tuple[Int64Array, Int64Array]:
        rows = self.integers("explicit", "<u8", n * 2 * d).reshape(n, 2 * d)
        offset, shape = rows[:, :d], rows[:, d:]
        outside = ~((offset + shape <= global_shape).all(axis=1) & (shape > 0).all(axis=1))
        if outside.any():
            i = int(np.argmax(outside))
            raise self.fail(
                "explicit",
                f"box {i} at {offset[i].tolist()} of shape {shape[i].tolist()} is empty or lies outside "
                f"{global_shape.tolist()}",
            )
        if d <= MAX_CORNER_NDIM:
            bad = untiled_groups(np.zeros(n, dtype=np.int64), offset, offset + shape, global_shape[None, :])[0]
        else:
            bad = (
                find_tiling_problem(
                    self.global_shape,
                    [Box(tuple(o), tuple(s)) for o, s in zip(offset.tolist(), shape.tolist(), strict=True)],
                )
                is not None
            )
        if bad:
            raise self.fail("explicit", "the boxes overlap or leave a gap: they do not tile the tensor")
        return offset, shape
