"""The checkpoint's ``metadata.json``: schema, JSON encoding, and strict validation of what is read.

The logical model is a set of frozen dataclasses; :meth:`Metadata.to_json_bytes` and
:meth:`Metadata.from_json_bytes` are the wire model. Decoding trusts nothing: every field's type and
range is checked, file names must stay inside the checkpoint, boxes must lie inside their tensor and
tile it exactly, and byte ranges must lie inside their files, so that a hostile ``metadata.json`` gets a
:class:`~reshard.CorruptCheckpointError` before anything is read or allocated. ``docs/format.md``
describes the same format in prose.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.boxes import Box
from reshard.codec import decode_tagged, encode_tagged, strict_json_loads
from reshard.dtypes import DTYPE_BY_NAME
from reshard.errors import CorruptCheckpointError
from reshard.planning.tiling import find_tiling_problem

__all__ = [
    "DATA_DIR",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "METADATA_FILE",
    "DataFile",
    "Metadata",
    "ObjectMetadata",
    "SavedBox",
    "SavedObject",
    "TensorMetadata",
    "check_relative_path",
]

FORMAT_NAME = "reshard"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
DATA_DIR = "data"
CHECKSUM_ALGORITHM = "crc32c"
_MAX_INT = 2**62
_MAX_NDIM = 64


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


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorMetadata:
    """A tensor of the checkpoint: its element type, global shape and stored boxes."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    boxes: tuple[SavedBox, ...]
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
    """

    save_id: str
    created_by: str
    world_size: int
    checksum_chunk_bytes: int
    files: tuple[DataFile, ...]
    tensors: dict[str, TensorMetadata] = field(default_factory=dict)
    objects: dict[str, ObjectMetadata] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Bytes of tensor data stored (each box once)."""
        return sum(b.byte_length for t in self.tensors.values() for b in t.boxes)

    def to_json_dict(self) -> dict[str, Any]:
        """The wire form of the metadata (plain JSON types)."""
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "save_id": self.save_id,
            "created_by": self.created_by,
            "world_size": self.world_size,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "chunk_bytes": self.checksum_chunk_bytes},
            "files": [{"path": f.path, "size": f.size} for f in self.files],
            "tensors": {
                key: {
                    "dtype": t.dtype,
                    "global_shape": list(t.global_shape),
                    **({"fingerprint": f"{t.fingerprint:016x}"} if t.fingerprint is not None else {}),
                    "boxes": [
                        {
                            "offset": list(b.offset),
                            "shape": list(b.shape),
                            "file": b.file,
                            "byte_offset": b.byte_offset,
                            "byte_length": b.byte_length,
                            "crc32c": list(b.checksums),
                        }
                        for b in t.boxes
                    ],
                }
                for key, t in self.tensors.items()
            },
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

    def to_json_bytes(self) -> bytes:
        return json.dumps(self.to_json_dict(), separators=(",", ":"), allow_nan=False).encode("utf-8")

    @classmethod
    def from_json_bytes(cls, raw: bytes, *, where: str = METADATA_FILE) -> Metadata:
        """Parse and validate ``metadata.json``.

        Raises:
            CorruptCheckpointError: anything wrong, with the JSON path of the offending field.
        """
        try:
            doc = strict_json_loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
            raise CorruptCheckpointError(f"{where}: not valid JSON: {exc}") from exc
        return _Parser(where).parse(doc)


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

    def __init__(self, where: str) -> None:
        self.where = where

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

    def string(self, value: object, path: str) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"expected a string, got {type(value).__name__}")
        return value

    def parse(self, doc: object) -> Metadata:
        if isinstance(doc, dict):  # format and version first: another version may have other fields
            if doc.get("format") != FORMAT_NAME:
                found = doc.get("format")
                raise self.fail("format", f"expected {FORMAT_NAME!r}, got {found!r}: not a reshard checkpoint")
            if type(doc.get("version")) is not int or doc.get("version") != FORMAT_VERSION:
                raise self.fail(
                    "version",
                    f"format version {doc.get('version')!r} is not supported (this reshard reads {FORMAT_VERSION})",
                )
        top = self.obj(
            doc,
            "$",
            {
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
            },
        )
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
        tensors = {key: self.tensor(key, value, files, chunk_bytes) for key, value in tensors_doc.items()}
        objects_doc = top["objects"]
        if not isinstance(objects_doc, dict):
            raise self.fail("objects", "expected an object")
        objects = {key: self.object(key, value, files, chunk_bytes) for key, value in objects_doc.items()}
        common_doc = top["common"]
        if not isinstance(common_doc, dict):
            raise self.fail("common", "expected an object")
        common = {
            path: decode_tagged(value, where=f"{self.where}: common[{path!r}]") for path, value in common_doc.items()
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
        keys = {"dtype", "global_shape", "boxes"}
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
        if not isinstance(doc["boxes"], list):
            raise self.fail(f"{path}.boxes", "expected a list")
        boxes = []
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
            boxes.append(
                SavedBox(
                    offset=offset,
                    shape=shape,
                    file=file,
                    byte_offset=byte_offset,
                    byte_length=byte_length,
                    checksums=checksums,
                )
            )
        problem = find_tiling_problem(global_shape, [b.box for b in boxes])
        if problem is not None:
            if problem.kind == "overlap":
                i, j = problem.indices
                raise self.fail(path, f"boxes {i} and {j} overlap")
            raise self.fail(path, f"boxes cover {problem.covered} of {problem.total} elements")
        return TensorMetadata(
            key=key, dtype=dtype_name, global_shape=global_shape, boxes=tuple(boxes), fingerprint=fingerprint
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
