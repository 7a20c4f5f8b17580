"""Data files: their names, the alignment of what they hold, and the one writer of checksummed ranges.

Rank ``r`` of save ``save_id`` writes ``data/<save_id>-r<r, 5 digits>.bin`` (docs/format.md section 9), so
that no two saves ever share a file; every stored box or object blob starts at a multiple of
:data:`ALIGNMENT` bytes and is checksummed in chunks (:mod:`reshard.io.checksums`). A
:class:`DataFileWriter` appends ranges and returns where each went (:class:`StoredRange`), for the
metadata.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from reshard.errors import StorageError
from reshard.io.checksums import ChunkedChecksum
from reshard.io.device import HostSlabs, is_host_bytes
from reshard.metadata import DATA_DIR
from reshard.state.dtypes import byte_view
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
    "host_slabs",
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

MAX_HOST_SLAB_BYTES = 16 * 1024 * 1024
"""Each of the two host slabs through which tensors that are not contiguous CPU memory are written takes at
most this much of the budget (and at most an eighth of it); larger slabs would not write faster."""

HOST_SLAB_SLOTS = 2
"""Host slabs of a writer: a GPU tensor's next slab is copied to the host while the previous one is
checksummed and written (:class:`~reshard.io.device.HostSlabs`)."""


def host_slabs(memory_budget_bytes: int) -> HostSlabs:
    """The host slabs of a save with this budget: :data:`HOST_SLAB_SLOTS` of an eighth of it each, at most
    :data:`MAX_HOST_SLAB_BYTES` (allocated at first need)."""
    return HostSlabs(max(1, min(MAX_HOST_SLAB_BYTES, memory_budget_bytes // 8)), slots=HOST_SLAB_SLOTS)


def data_file_name(save_id: str, rank: int) -> str:
    """The data file rank ``rank`` of save ``save_id`` writes (a name relative to the checkpoint)."""
    return f"{DATA_DIR}/{save_id}-r{rank:05d}.bin"


DATA_FILE_PATTERN = re.compile(
    rf"^{DATA_DIR}/[0-9a-f]{{8,}}-(?:r[0-9]{{5,}}\.bin(?:\.parts-[0-9a-f]{{8}}/[0-9]{{5,}}|\.compose-[0-9]+-[0-9]{{5,}}-[0-9a-f]{{8}})?"
    rf"|metadata-[0-9]{{5,}}\.json)$"
)
"""The names a save writes under ``data/``: data files, the temporary part objects of an object-store
upload that was cut short, and the part files of partitioned metadata (format version 6). Maintenance deletes
nothing else."""


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


def content_digest(tensor: torch.Tensor, slabs: HostSlabs | None = None) -> bytes:
    """The XXH3-128 digest (16 bytes, big-endian as ``xxhash`` gives it) of ``tensor``'s elements in C order,
    the bytes a data file stores for it: the content hash of format version 4. Memory that is not plain host
    bytes (a GPU tensor, a view) is copied a slab at a time through ``slabs`` (a writer's, to reuse its
    buffers; by default buffers of :data:`MAX_HOST_SLAB_BYTES`)."""
    data = tensor.detach()
    if is_host_bytes(data):
        return xxhash.xxh3_128_digest(byte_view(data))
    hasher = xxhash.xxh3_128()
    for _, view in (slabs if slabs is not None else HostSlabs(MAX_HOST_SLAB_BYTES)).slabs([data]):
        hasher.update(view)
    return hasher.digest()


class DataFileWriter:
    """Appends checksummed, aligned ranges to one new data file. Not thread-safe.

    Call order: construct (creates the file, which must not exist), any number of :meth:`append` or
    :meth:`append_tensor` (or of :meth:`begin`, :meth:`feed`..., :meth:`end` to stream one range in pieces),
    then :meth:`commit` (the file is durable) or :meth:`abort` (it is removed).

    Memory: at most ``memory_budget_bytes`` for the writer's own buffers: two host slabs (an eighth of the
    budget each, at most :data:`MAX_HOST_SLAB_BYTES`; pinned for GPU tensors) through which tensors that
    are not contiguous CPU memory are copied a slab at a time, the next slab's copy running while the
    previous one is written, and what the storage may hold of data not yet stored (the rest: an object
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
        slabs: HostSlabs | None = None,
    ) -> None:
        self.storage = storage
        self.name = name
        self.chunk_bytes = chunk_bytes
        self.hash_content = hash_content
        """Also compute every range's XXH3-128 digest (:attr:`StoredRange.content_hash`), in the same pass."""
        self.slabs = slabs if slabs is not None else host_slabs(memory_budget_bytes)
        """The host slabs (:func:`host_slabs` of the budget unless given: a save shares them with its
        :func:`content_digest` calls)."""
        try:
            self._file: FileWriter = storage.open_writer(
                name, max_buffered_bytes=memory_budget_bytes - HOST_SLAB_SLOTS * self.slabs.slab_bytes
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
        """Write the elements of ``tensor`` in C order as one range (see :meth:`append_tensors`)."""
        (stored,) = self.append_tensors([tensor])
        return stored

    def append_tensors(self, tensors: Sequence[torch.Tensor]) -> list[StoredRange]:
        """Write the elements of each tensor in C order as one range each, in order; where each went.
        Contiguous CPU memory is written as it is; anything else (a GPU tensor, a transposed or sliced view,
        a conjugate) is copied through the host slabs a slab at a time, never whole, a GPU tensor's
        next slab (of the same tensor or the next) on its way to the host while the current one is written
        (:class:`~reshard.io.device.HostSlabs`: no synchronisation of the caller's CUDA stream)."""
        stored: list[StoredRange] = []
        current = -1
        for position, view in self.slabs.slabs(tensors):
            if position != current:
                if current >= 0:
                    stored.append(self.end())
                self.begin()
                current = position
            for start in range(0, len(view), WRITE_PIECE_BYTES):
                self.feed(view[start : start + WRITE_PIECE_BYTES])
        if current >= 0:
            stored.append(self.end())
        return stored

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
