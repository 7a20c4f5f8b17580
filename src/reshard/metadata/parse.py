"""Reading ``metadata.json``: strict validation of every field before anything is read or allocated.

Decoding trusts nothing: every field's type and range is checked, file names must stay inside the
checkpoint, boxes must lie inside their tensor and tile it exactly, and byte ranges must lie inside their
files, so that a hostile document gets a :class:`~reshard.CorruptCheckpointError` naming the JSON path of
the bad field. Packed tensors (version 2) are decoded here too, now or, for a lazy parse, on first use.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Sequence
from typing import Any

import crc32c
import numpy as np
import numpy.typing as npt

from reshard.errors import CorruptCheckpointError
from reshard.geometry.boxes import Box
from reshard.geometry.grid import expand_grid
from reshard.geometry.tiling import MAX_CORNER_NDIM, find_tiling_problem, untiled_groups
from reshard.metadata.columns import BoxColumns, Int64Array, PartBoxes, SavedBox, SavedBoxes
from reshard.metadata.index import parse_index_entry, parse_parts_member
from reshard.metadata.model import (
    CHECKSUM_ALGORITHM,
    CONTENT_HASH_ALGORITHM,
    CONTENT_HASH_BYTES,
    FORMAT_NAME,
    HASHED_VERSION,
    MAX_INTEGER,
    MAX_NDIM,
    METADATA_CHECKSUM_MEMBER,
    METADATA_FILE,
    PARTITIONED_VERSION,
    READABLE_VERSIONS,
    REFERENCED_FILE_PATTERN,
    SCALED_VERSION,
    SEALED_VERSION,
    DataFile,
    Metadata,
    ObjectMetadata,
    SavedObject,
    TensorMetadata,
)
from reshard.metadata.paths import check_relative_path, plain_data_file
from reshard.metadata.scaled import parse_scaled
from reshard.metadata.wire import SEAL_LENGTH, SEAL_PREFIX
from reshard.state.codec import decode_tagged, strict_json_loads
from reshard.state.dtypes import DTYPE_BY_NAME

__all__ = ["DocumentParser", "check_relative_path", "parse_metadata"]


def parse_metadata(raw: bytes, *, where: str = METADATA_FILE, lazy: bool = False) -> Metadata:
    """See :meth:`Metadata.from_json_bytes`."""
    sealed = _check_seal(raw, where)
    try:
        doc = strict_json_loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise CorruptCheckpointError(f"{where}: not valid JSON: {exc}") from exc
    return DocumentParser(where, lazy=lazy, sealed=sealed).parse(doc)


def _check_seal(raw: bytes, where: str) -> bool:
    """Whether ``raw`` ends with a checksum member; a checksum that does not match is corruption."""
    if len(raw) < len(SEAL_PREFIX) + SEAL_LENGTH or not raw.endswith(b'"}'):
        return False
    if raw[-SEAL_LENGTH - len(SEAL_PREFIX) : -SEAL_LENGTH] != SEAL_PREFIX:
        return False
    digits = raw[-SEAL_LENGTH:-2]
    if not all(c in b"0123456789abcdef" for c in digits):
        raise CorruptCheckpointError(f"{where}: {METADATA_CHECKSUM_MEMBER}: expected 8 lowercase hexadecimal digits")
    expected = int(digits, 16)
    actual = crc32c.crc32c(raw[:-SEAL_LENGTH])
    if actual != expected:
        raise CorruptCheckpointError(
            f"{where}: the document's checksum does not match its bytes ({METADATA_CHECKSUM_MEMBER} {expected:08x}, "
            f"computed {actual:08x}): metadata.json is damaged"
        )
    return True


class DocumentParser:
    """Validating decoder of the wire form; every error names the JSON path of the bad field. Used for
    ``metadata.json`` here and for the part files of version 6 (:mod:`reshard.metadata.parts`)."""

    def __init__(self, where: str, *, lazy: bool = False, sealed: bool = False) -> None:
        self.where = where
        self.lazy = lazy
        self.sealed = sealed
        self.version = 1
        self.hashed = False
        self.sizes: tuple[tuple[DataFile, ...], npt.NDArray[np.uint64]] | None = None

    def fail(self, path: str, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.where}: {path}: {message}")

    def file_sizes(self, files: tuple[DataFile, ...]) -> npt.NDArray[np.uint64]:
        """The sizes of ``files`` as an array, made once per parse (every packed tensor checks its byte ranges)."""
        if self.sizes is None or self.sizes[0] is not files:
            self.sizes = (files, np.array([f.size for f in files], dtype=np.uint64))
        return self.sizes[1]

    def obj(self, value: object, path: str, keys: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(path, f"expected an object, got {type(value).__name__}")
        if set(value) != keys:
            missing, extra = sorted(keys - set(value)), sorted(set(value) - keys)
            raise self.fail(path, f"expected fields {sorted(keys)} (missing {missing}, unexpected {extra})")
        return value

    def integer(self, value: object, path: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INTEGER:
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
        self.check_version(doc)
        top = self.obj(doc, "$", self.members())
        self.check_content_hash(top)
        chunk_bytes = self.chunk_bytes(top)
        world_size = self.integer(top["world_size"], "world_size")
        if world_size == 0:
            raise self.fail("world_size", "must be at least 1")
        files = self.files(top["files"])
        tensors_doc = top["tensors"]
        if not isinstance(tensors_doc, dict):
            raise self.fail("tensors", "expected an object")
        save_id = self.string(top["save_id"], "save_id")
        parts = parse_parts_member(self, top["parts"], save_id) if self.version >= PARTITIONED_VERSION else ()
        tensors = {
            self.key(key, "tensors"): parse_index_entry(self, key, value, len(parts))
            if parts
            else self.tensor(key, value, files, chunk_bytes)
            for key, value in tensors_doc.items()
        }
        if parts and len({t.boxes.part for t in tensors.values() if isinstance(t.boxes, PartBoxes)}) != len(parts):
            raise self.fail("parts", "a part holds no tensor of the index")
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
            save_id=save_id,
            created_by=self.string(top["created_by"], "created_by"),
            world_size=world_size,
            checksum_chunk_bytes=chunk_bytes,
            files=files,
            tensors=tensors,
            objects=objects,
            common=common,
            content_hashes=self.hashed,
            scaled=parse_scaled(top["scaled"], tensors, objects, self.fail) if self.version >= SCALED_VERSION else {},
            format_version=self.version,
            parts=parts,
        )

    def check_version(self, doc: object) -> None:
        """The format and version, read first (another version may have other fields): sets :attr:`version`."""
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

    def members(self) -> set[str]:
        """The top-level members a document of :attr:`version` has."""
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
        if self.version >= HASHED_VERSION:
            members.add("content_hash")
        if self.version >= SCALED_VERSION:
            members.add("scaled")
        if self.version >= PARTITIONED_VERSION:
            members.add("parts")
        return members

    def described(self, path: str, doc: dict[str, Any]) -> tuple[str, tuple[int, ...], int | None]:
        """A tensor's dtype name, global shape and fingerprint (None when it has none), checked."""
        fingerprint = None
        if "fingerprint" in doc:
            text = doc["fingerprint"]
            if not isinstance(text, str) or len(text) != 16 or any(c not in "0123456789abcdef" for c in text):
                raise self.fail(f"{path}.fingerprint", "expected 16 lowercase hex digits")
            fingerprint = int(text, 16)
        dtype_name = self.string(doc["dtype"], f"{path}.dtype")
        if dtype_name not in DTYPE_BY_NAME:
            raise self.fail(f"{path}.dtype", f"unknown dtype {dtype_name!r}")
        return dtype_name, self.int_list(doc["global_shape"], f"{path}.global_shape", max_len=MAX_NDIM), fingerprint

    def check_content_hash(self, top: dict[str, Any]) -> None:
        """The content-hash algorithm, where the version has one: sets :attr:`hashed`."""
        if self.version >= HASHED_VERSION and top["content_hash"] is not None:
            algorithm = self.obj(top["content_hash"], "content_hash", {"algorithm"})["algorithm"]
            if algorithm != CONTENT_HASH_ALGORITHM:
                raise self.fail("content_hash.algorithm", f"unsupported algorithm {algorithm!r}")
            self.hashed = True

    def chunk_bytes(self, top: dict[str, Any]) -> int:
        """The checksum algorithm (checked) and chunk size (positive)."""
        checksum = self.obj(top["checksum"], "checksum", {"algorithm", "chunk_bytes"})
        if checksum["algorithm"] != CHECKSUM_ALGORITHM:
            raise self.fail("checksum.algorithm", f"unsupported algorithm {checksum['algorithm']!r}")
        chunk_bytes = self.integer(checksum["chunk_bytes"], "checksum.chunk_bytes")
        if chunk_bytes == 0:
            raise self.fail("checksum.chunk_bytes", "must be positive")
        return chunk_bytes

    def files(self, value: object) -> tuple[DataFile, ...]:
        if not isinstance(value, list):
            raise self.fail("files", "expected a list")
        out = []
        seen: set[tuple[str | None, str]] = set()
        for i, item in enumerate(value):
            quick = plain_data_file(item)  # the common entry, checked at once: a load's every rank parses thousands
            if quick is not None and (None, quick.path) not in seen:
                seen.add((None, quick.path))
                out.append(quick)
                continue
            fields = {"path", "size"}
            if self.version >= HASHED_VERSION and isinstance(item, dict) and "checkpoint" in item:
                fields.add("checkpoint")
            entry = self.obj(item, f"files[{i}]", fields)
            path = self.string(entry["path"], f"files[{i}].path")
            problem = check_relative_path(path)
            if problem:
                raise self.fail(f"files[{i}].path", f"file name {path!r} {problem}")
            checkpoint = None
            if "checkpoint" in entry:
                checkpoint = self.string(entry["checkpoint"], f"files[{i}].checkpoint")
                problem = check_relative_path(checkpoint) or ("contains '/'" if "/" in checkpoint else None)
                if problem:
                    raise self.fail(f"files[{i}].checkpoint", f"checkpoint name {checkpoint!r} {problem}")
                if not REFERENCED_FILE_PATTERN.match(path):
                    raise self.fail(
                        f"files[{i}].path",
                        f"a file of checkpoint {checkpoint!r} must be a data file name "
                        f"(data/<32 hex digits>-r<rank>.bin), got {path!r}",
                    )
            if path == METADATA_FILE or (checkpoint, path) in seen:
                raise self.fail(f"files[{i}].path", f"file name {path!r} is repeated or reserved")
            seen.add((checkpoint, path))
            out.append(DataFile(path=path, size=self.integer(entry["size"], f"files[{i}].size"), checkpoint=checkpoint))
        return tuple(out)

    def content_hash(self, value: object, path: str) -> bytes:
        if not isinstance(value, str) or len(value) != 2 * CONTENT_HASH_BYTES or value.strip("0123456789abcdef"):
            raise self.fail(path, f"expected {2 * CONTENT_HASH_BYTES} lowercase hex digits")
        return bytes.fromhex(value)

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
        dtype_name, global_shape, fingerprint = self.described(path, doc)
        dtype = DTYPE_BY_NAME[dtype_name]
        if "packed" in doc:
            if math.prod(global_shape) * dtype.itemsize > MAX_INTEGER:
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
            box_fields = {"offset", "shape", "file", "byte_offset", "byte_length", "crc32c"}
            entry = self.obj(item, bpath, box_fields | {"hash"} if self.hashed else box_fields)
            offset = self.int_list(entry["offset"], f"{bpath}.offset", max_len=MAX_NDIM)
            shape = self.int_list(entry["shape"], f"{bpath}.shape", max_len=MAX_NDIM)
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
                    content_hash=self.content_hash(entry["hash"], f"{bpath}.hash") if self.hashed else None,
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
        global_shape = self.int_list(doc["global_shape"], f"{path}.global_shape", max_len=MAX_NDIM)
        if math.prod(global_shape) == 0:  # no save writes one: a ShardedObject's grid has a cell per axis at least
            raise self.fail(f"{path}.global_shape", f"the grid {list(global_shape)} has no cells")
        if not isinstance(doc["entries"], list):
            raise self.fail(f"{path}.entries", "expected a list")
        entries = []
        seen: set[tuple[int, ...]] = set()
        for i, item in enumerate(doc["entries"]):
            epath = f"{path}.entries[{i}]"
            entry = self.obj(item, epath, {"offset", "file", "byte_offset", "byte_length", "crc32c"})
            offset = self.int_list(entry["offset"], f"{epath}.offset", max_len=MAX_NDIM)
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


class _PackedTensor:
    """One packed tensor entry (format version 2): its fields are checked for shape at once, its boxes
    decoded and validated by :meth:`decode`, now or, for a lazy parse, when first used."""

    def __init__(
        self,
        parser: DocumentParser,
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
        if parser.hashed:
            fields.add("hash")
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
        if dtype == "<u8" and (values > MAX_INTEGER).any():
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
        sizes = self.parser.file_sizes(self.files)
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
        content_hash = None
        if "hash" in self.doc:
            digests = self.integers("hash", "u1", None)
            if len(digests) != n * CONTENT_HASH_BYTES:
                raise self.fail(
                    "hash", f"holds {len(digests)} bytes, expected a {CONTENT_HASH_BYTES}-byte hash per box"
                )
            content_hash = digests.astype(np.uint8).reshape(n, CONTENT_HASH_BYTES)
        return BoxColumns(
            offset=offset,
            shape=shape,
            file=file,
            byte_offset=byte_offset,
            byte_length=byte_length,
            crc_start=np.cumsum(counts) - counts,
            crc_count=counts,
            crc=crc,
            content_hash=content_hash,
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
