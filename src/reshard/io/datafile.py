"""Data files: their names, the alignment of what they hold, and the one writer of checksummed ranges.

Rank ``r`` of save ``save_id`` writes ``data/<save_id>-r<r, 5 digits>.bin`` (docs/format.md section 9), so
that no two saves ever share a file; every stored box or object blob starts at a multiple of
:data:`ALIGNMENT` bytes and is checksummed in chunks (:mod:`reshard.io.checksums`). A
:class:`DataFileWriter` appends ranges and returns where each went (:class:`StoredRange`), for the
metadata.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from reshard.dtypes import byte_view
from reshard.errors import StorageError
from reshard.io.checksums import ChunkedChecksum
from reshard.metadata import DATA_DIR
from reshard.storage import FileWriter, Storage

__all__ = [
    "ALIGNMENT",
    "DATA_FILE_PATTERN",
    "DEFAULT_SAVE_MEMORY_BUDGET",
    "MIN_SAVE_MEMORY_BUDGET",
    "WRITE_PIECE_BYTES",
    "DataFileWriter",
    "StoredRange",
    "content_digest",
    "data_file_name",
    "is_data_file_of",
    "tensor_bytes",
]

ALIGNMENT = 64
"""Every stored box and object blob starts at a multiple of this many bytes of its data file."""

WRITE_PIECE_BYTES = 1024 * 1024
"""A range is handed to the storage in pieces of this size, each checksummed just before it is written:
small enough that the write copies it from the CPU's cache, where the checksum just left it (1 MiB pieces
took a 250 MB-per-rank cold save from 0.28 s to 0.19-0.21 s with early writeback; benchmarks/README.md)."""


DEFAULT_SAVE_MEMORY_BUDGET = 256 * 1024 * 1024
"""The host memory a rank's save holds at most for its own buffers, by default (see :class:`DataFileWriter`)."""

MIN_SAVE_MEMORY_BUDGET = 1024 * 1024
"""The smallest budget a save accepts."""

MAX_STAGING_BYTES = 16 * 1024 * 1024
"""The staging buffer of tensors that are not contiguous CPU memory takes at most this much of the budget
(and at most a quarter of it); larger slabs would not write faster."""


def data_file_name(save_id: str, rank: int) -> str:
    """The data file rank ``rank`` of save ``save_id`` writes (a name relative to the checkpoint)."""
    return f"{DATA_DIR}/{save_id}-r{rank:05d}.bin"


DATA_FILE_PATTERN = re.compile(
    rf"^{DATA_DIR}/[0-9a-f]{{8,}}-r\d{{5,}}\.bin(?:\.parts-[0-9a-f]{{8}}/\d{{5,}}|\.compose-\d+-\d{{5,}}-[0-9a-f]{{8}})?$"
)
"""The names a save writes under ``data/``: data files, and the temporary part objects of an object-store
upload that was cut short. Maintenance deletes nothing else."""


def is_data_file_of(name: str, save_id: str) -> bool:
    """Whether ``name`` (relative to the checkpoint) is a data file of save ``save_id``."""
    return name.startswith(f"{DATA_DIR}/{save_id}-")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` in C order, without a copy when it is a contiguous CPU tensor."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.resolve_conj().resolve_neg()
    return byte_view(data.contiguous())


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredRange:
    """Where one box or blob went: ``byte_length`` bytes at ``byte_offset`` of its data file, the
    checksum of each chunk of them and, from a writer that hashes content, their XXH3-128 digest."""

    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]
    content_hash: bytes | None = None


def content_digest(tensor: torch.Tensor, staging_bytes: int = MAX_STAGING_BYTES) -> bytes:
    """The XXH3-128 digest (16 bytes, big-endian as ``xxhash`` gives it) of ``tensor``'s elements in C order,
    the bytes a data file stores for it: the content hash of format version 4. Memory that is not contiguous
    CPU memory (a GPU tensor, a view) is copied a slab of at most ``staging_bytes`` at a time."""
    data = tensor.detach()
    if data.device.type == "cpu" and data.is_contiguous() and not data.is_conj() and not data.is_neg():
        return xxhash.xxh3_128_digest(byte_view(data))
    hasher = xxhash.xxh3_128()
    staging = torch.empty(min(staging_bytes, data.nbytes), dtype=torch.uint8)
    for slab in _slabs(data, staging_bytes):
        staged = staging[: slab.nbytes].view(slab.dtype).view(slab.shape)
        staged.copy_(slab)
        hasher.update(byte_view(staged))
    return hasher.digest()


class DataFileWriter:
    """Appends checksummed, aligned ranges to one new data file. Not thread-safe.

    Call order: construct (creates the file, which must not exist), any number of :meth:`append` or
    :meth:`append_tensor` (or of :meth:`begin`, :meth:`feed`..., :meth:`end` to stream one range in pieces),
    then :meth:`commit` (the file is durable) or :meth:`abort` (it is removed).

    Memory: at most ``memory_budget_bytes`` for the writer's own buffers: a staging buffer (a quarter of
    the budget, at most :data:`MAX_STAGING_BYTES`) through which tensors that are not contiguous CPU memory
    are copied a slab at a time, and what the storage may hold of data not yet stored (the rest: an object
    store's upload parts).

    Raises:
        StorageError: the file cannot be created or written, naming it, or the storage cannot keep within
            the budget.
    """

    def __init__(
        self,
        storage: Storage,
        name: str,
        chunk_bytes: int,
        memory_budget_bytes: int = DEFAULT_SAVE_MEMORY_BUDGET,
        *,
        hash_content: bool = False,
    ) -> None:
        self.storage = storage
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.hash_content = hash_content
        """Also compute every range's XXH3-128 digest (:attr:`StoredRange.content_hash`), in the same pass."""
        self.staging_bytes = max(1, min(MAX_STAGING_BYTES, memory_budget_bytes // 4))
        self._staging = torch.empty(0, dtype=torch.uint8)
        try:
            self._file: FileWriter = storage.open_writer(
                name, max_buffered_bytes=memory_budget_bytes - self.staging_bytes
            )
        except OSError as exc:
            raise StorageError(f"cannot create data file {storage.describe(name)}: {exc}") from exc
        self._range: tuple[int, ChunkedChecksum, Any] | None = None

    def tell(self) -> int:
        """Bytes written so far."""
        return self._file.tell()

    def _write(self, data: memoryview) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise StorageError(f"writing {self.storage.describe(self.name)} failed: {exc}") from exc

    def begin(self) -> None:
        """Start a range at the next aligned offset (a range begun before and never ended is dropped: its
        bytes stay in the file, unreferenced)."""
        padding = -self._file.tell() % ALIGNMENT
        if padding:
            self._write(memoryview(bytes(padding)))
        hasher = xxhash.xxh3_128() if self.hash_content else None
        self._range = (self._file.tell(), ChunkedChecksum(self.chunk_bytes), hasher)

    def feed(self, data: memoryview) -> None:
        """Append the next bytes of the current range."""
        if self._range is None:
            raise RuntimeError("no range is being written")
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        self._range[1].update(view)
        if self._range[2] is not None:
            self._range[2].update(view)
        self._write(view)

    def end(self) -> StoredRange:
        """Finish the current range; where it went."""
        if self._range is None:
            raise RuntimeError("no range is being written")
        start, checksum, hasher = self._range
        self._range = None
        return StoredRange(
            byte_offset=start,
            byte_length=self._file.tell() - start,
            checksums=checksum.finish(),
            content_hash=hasher.digest() if hasher is not None else None,
        )

    def append(self, data: memoryview) -> StoredRange:
        """Write ``data`` as one range, in pieces of :data:`WRITE_PIECE_BYTES`."""
        self.begin()
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        for start in range(0, len(view), WRITE_PIECE_BYTES):
            self.feed(view[start : start + WRITE_PIECE_BYTES])
        return self.end()

    def append_tensor(self, tensor: torch.Tensor) -> StoredRange:
        """Write the elements of ``tensor`` in C order as one range. Contiguous CPU memory is written as it
        is; anything else (a GPU tensor, a transposed or sliced view, a conjugate) is copied through the
        staging buffer a slab at a time, never whole."""
        data = tensor.detach()
        if data.device.type == "cpu" and data.is_contiguous() and not data.is_conj() and not data.is_neg():
            return self.append(byte_view(data))
        if self._staging.numel() < min(self.staging_bytes, data.nbytes):
            self._staging = torch.empty(min(self.staging_bytes, data.nbytes), dtype=torch.uint8)
        self.begin()
        for slab in _slabs(data, self.staging_bytes):
            staged = self._staging[: slab.nbytes].view(slab.dtype).view(slab.shape)
            staged.copy_(slab)  # resolves a conjugate or negative view, converts nothing else
            view = byte_view(staged)
            for start in range(0, len(view), WRITE_PIECE_BYTES):
                self.feed(view[start : start + WRITE_PIECE_BYTES])
        return self.end()

    def commit(self) -> int:
        """Make the file complete and durable (fsync, or the object's final upload); its size."""
        size = self._file.tell()
        try:
            self._file.commit()
        except OSError as exc:
            self._file.abort()
            raise StorageError(f"writing {self.storage.describe(self.name)} failed: {exc}") from exc
        except BaseException:
            self._file.abort()
            raise
        return size

    def abort(self) -> None:
        """Discard the partial file; never raises."""
        self._file.abort()


def _slabs(tensor: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """Consecutive views that cover ``tensor`` in C order, each of at most ``max_bytes`` (or one element):
    runs of whole rows along the first axis, or, where one row is already larger, the slabs of each row."""
    if tensor.nbytes <= max_bytes or tensor.ndim == 0:
        yield tensor
        return
    row_bytes = tensor.nbytes // tensor.shape[0]
    if row_bytes <= max_bytes:
        step = max_bytes // row_bytes
        for start in range(0, tensor.shape[0], step):
            yield tensor[start : start + step]
        return
    for row in tensor:
        yield from _slabs(row, max_bytes)
