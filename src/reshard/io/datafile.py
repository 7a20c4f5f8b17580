"""Data files: their names, the alignment of what they hold, and the one writer of checksummed ranges.

Rank ``r`` of save ``save_id`` writes ``data/<save_id>-r<r, 5 digits>.bin`` (docs/format.md section 9), so
that no two saves ever share a file; every stored box or object blob starts at a multiple of
:data:`ALIGNMENT` bytes and is checksummed in chunks (:mod:`reshard.io.checksums`). A
:class:`DataFileWriter` appends ranges and returns where each went (:class:`StoredRange`), for the
metadata.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from reshard.dtypes import byte_view
from reshard.errors import StorageError
from reshard.io.checksums import ChunkedChecksum
from reshard.metadata import DATA_DIR
from reshard.storage import FileWriter, Storage

__all__ = [
    "ALIGNMENT",
    "DATA_FILE_PATTERN",
    "WRITE_PIECE_BYTES",
    "DataFileWriter",
    "StoredRange",
    "data_file_name",
    "is_data_file_of",
    "tensor_bytes",
]

ALIGNMENT = 64
"""Every stored box and object blob starts at a multiple of this many bytes of its data file."""

WRITE_PIECE_BYTES = 4 * 1024 * 1024
"""A range is handed to the storage in pieces of this size (each checksummed just before it is written)."""


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
    """Where one box or blob went: ``byte_length`` bytes at ``byte_offset`` of its data file, and the
    checksum of each chunk of them."""

    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]


class DataFileWriter:
    """Appends checksummed, aligned ranges to one new data file. Not thread-safe.

    Call order: construct (creates the file, which must not exist), any number of :meth:`append` (or of
    :meth:`begin`, :meth:`feed`..., :meth:`end` to stream one range in pieces), then :meth:`commit` (the
    file is durable) or :meth:`abort` (it is removed).

    Raises:
        StorageError: the file cannot be created or written, naming it.
    """

    def __init__(self, storage: Storage, name: str, chunk_bytes: int) -> None:
        self.storage = storage
        self.name = name
        self.chunk_bytes = chunk_bytes
        try:
            self._file: FileWriter = storage.open_writer(name)
        except OSError as exc:
            raise StorageError(f"cannot create data file {storage.describe(name)}: {exc}") from exc
        self._range: tuple[int, ChunkedChecksum] | None = None

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
        self._range = (self._file.tell(), ChunkedChecksum(self.chunk_bytes))

    def feed(self, data: memoryview) -> None:
        """Append the next bytes of the current range."""
        if self._range is None:
            raise RuntimeError("no range is being written")
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        self._range[1].update(view)
        self._write(view)

    def end(self) -> StoredRange:
        """Finish the current range; where it went."""
        if self._range is None:
            raise RuntimeError("no range is being written")
        start, checksum = self._range
        self._range = None
        return StoredRange(byte_offset=start, byte_length=self._file.tell() - start, checksums=checksum.finish())

    def append(self, data: memoryview) -> StoredRange:
        """Write ``data`` as one range, in pieces of :data:`WRITE_PIECE_BYTES`."""
        self.begin()
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
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
