"""Reads of stored byte ranges, and the verification of their checksum chunks: the base of the read executor.

:class:`VerifiedReader` checks a data file's size before its first read, fills read requests (a short
answer is a truncated file, a failed one a :class:`~reshard.StorageError`), and verifies chunks of stored
boxes and blobs with the one chunk verifier (:mod:`reshard.io.chunkcheck`) over the bytes in memory, streaming
the others through a bounded scratch buffer. :func:`verify_stored_ranges` checks whole stored boxes of one
file that way (node-local staging, ``validate``). :class:`ReadBudget` says how a load's memory budget is
shared among the buffers of :class:`~reshard.io.reader.ReadExecutor`, which builds the planned reads of a
load on this class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from reshard.errors import CheckpointError, CorruptCheckpointError, StorageError
from reshard.io.checksums import crc32c_of
from reshard.io.chunkcheck import Segment, StoredChunks, Streamer, verify_segments
from reshard.io.referencing import ReferencingStorage, referencing
from reshard.state.dtypes import byte_view
from reshard.storage import RangeReadError, ReadRequest, Storage

if TYPE_CHECKING:
    from reshard.metadata import Metadata

__all__ = [
    "DEFAULT_LOAD_MEMORY_BUDGET",
    "MIN_LOAD_MEMORY_BUDGET",
    "ReadBudget",
    "Segment",
    "StoredEntry",
    "VerifiedReader",
    "check_data_file",
    "check_data_files",
    "verify_stored_ranges",
]

DEFAULT_LOAD_MEMORY_BUDGET = 32 * 1024 * 1024
"""The host memory a rank's load holds at most for its own buffers, by default (see
:class:`~reshard.io.reader.ReadExecutor`)."""

MIN_LOAD_MEMORY_BUDGET = 16
"""The smallest budget a load can keep (a few bytes of read buffer and of mapped window)."""

_STREAM_PIECE = 1 << 20
"""Largest piece in which an oversized chunk is streamed through the scratch buffer."""

VERIFY_MEMORY_BUDGET = 1 << 20
"""The buffer through which :func:`verify_stored_ranges` reads whole stored boxes (any chunk size)."""


@dataclass(frozen=True, slots=True)
class ReadBudget:
    """How a load's memory budget is shared among the buffers of :class:`~reshard.io.reader.ReadExecutor`."""

    read_buffer_bytes: int
    """The read buffer (reads that cannot land in their destination): half the budget."""
    stream_bytes: int
    """The scratch piece through which oversized chunks are streamed: at most 1 MiB, an eighth."""
    max_read_bytes: int
    """The rest: the largest read item, and so mapped window of a local file, that planning may make; on an
    object store, the most response bytes of ranged GETs in flight."""
    arena_bytes: int = 0
    """For a load into device memory: each of the two host arenas of :class:`~reshard.io.device.DeviceFill`
    (0 otherwise)."""

    @classmethod
    def of(cls, memory_budget_bytes: int, *, device: bool = False) -> ReadBudget:
        """The shares of ``memory_budget_bytes``; with ``device`` (some destinations are not in host memory),
        a quarter for the read buffer and the rest beyond the scratch piece in three equal parts: the largest read
        item and two arenas that hold it (so that a read item always fits an arena)."""
        if memory_budget_bytes < MIN_LOAD_MEMORY_BUDGET:
            raise ValueError(f"a load's memory budget must be at least {MIN_LOAD_MEMORY_BUDGET} bytes")
        stream = max(1, min(_STREAM_PIECE, memory_budget_bytes // 8))
        if device:
            read_buffer = memory_budget_bytes // 4
            third = max(1, (memory_budget_bytes - read_buffer - stream) // 3)
            return cls(read_buffer, stream, third, third)
        read_buffer = memory_budget_bytes // 2
        return cls(read_buffer, stream, memory_budget_bytes - read_buffer - stream)


class VerifiedReader:
    """Reads and verifies stored ranges of one checkpoint's data files (see the module doc). Not thread-safe.

    Args:
        storage: where the data files are.
        metadata: the checkpoint (or source) being read.
        transfer_bytes: the most response bytes an object store may hold in flight for one batch of reads.
        stream_bytes: the scratch piece through which chunks not in memory are streamed to verify them.
    """

    def __init__(self, storage: Storage, metadata: Metadata, *, transfer_bytes: int, stream_bytes: int) -> None:
        self.owns_references = not isinstance(storage, ReferencingStorage)
        self.storage = referencing(storage)
        """``storage``, reading the files of sibling checkpoints that the metadata names by location too."""
        self.metadata = metadata
        self.transfer_bytes = transfer_bytes
        self.stream_bytes = stream_bytes
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.bytes_verified = 0
        """Bytes whose chunk checksum was verified."""
        self.checked_files: set[int] = set()

    def close(self) -> None:
        """Release the scratch buffer and close the sibling checkpoints' storages this reader opened (those of
        a :class:`ReferencingStorage` it was given are its owner's to close)."""
        self.scratch = torch.empty(0, dtype=torch.uint8)
        if self.owns_references:
            self.storage.close()

    # ---- files and raw reads -------------------------------------------------------------------------

    def check_file(self, file: int) -> None:
        """Before the first read of a data file: it exists and has the size the metadata says."""
        if file in self.checked_files:
            return
        check_data_file(self.storage, self.metadata, file)
        self.checked_files.add(file)

    def read(self, requests: list[ReadRequest], whats: list[str]) -> None:
        """Fill every request (one batch); a short answer is a truncated file."""
        if not requests:
            return
        try:
            got = self.storage.read_ranges(requests, max_buffered_bytes=self.transfer_bytes)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{whats[0]}: a data file is missing: {exc}") from exc
        except CheckpointError:
            raise
        except RangeReadError as exc:
            raise StorageError(f"reading {whats[0]} failed: {exc}") from exc
        except OSError as exc:
            raise StorageError(f"reading {whats[0]} failed: {exc}") from exc
        for request, count, what in zip(requests, got, whats, strict=True):
            if count != len(request.buffer):
                raise CorruptCheckpointError(
                    f"{what}: data file {self.storage.describe(request.name)} is truncated: expected "
                    f"{len(request.buffer)} bytes at offset {request.offset}, got {count}"
                )

    def _scratch_view(self, nbytes: int) -> memoryview:
        if self.scratch.numel() < nbytes:
            self.scratch = torch.empty(nbytes, dtype=torch.uint8)
        return byte_view(self.scratch)[:nbytes]

    # ---- verification --------------------------------------------------------------------------------

    def stored(
        self, checksums: tuple[int, ...], box_length: int, file: int, box_offset: int, what: str
    ) -> StoredChunks:
        """A stored box or blob of data file ``file`` as the chunk verifier sees it
        (:class:`~reshard.io.chunkcheck.StoredChunks`)."""
        name = self.metadata.files[file].location
        return StoredChunks(
            what=what,
            name=name,
            where=self.storage.describe(name),
            byte_offset=box_offset,
            byte_length=box_length,
            checksums=checksums,
            chunk_bytes=self.metadata.checksum_chunk_bytes,
        )

    def verify_chunks(
        self,
        checksums: tuple[int, ...],
        box_length: int,
        file: int,
        box_offset: int,
        ranges: list[tuple[int, int]],
        segments: list[Segment],
        what: str,
    ) -> None:
        """Verify every chunk of ``ranges`` (box-relative, whole chunks) of a stored box at ``box_offset`` of
        data file ``file`` (:func:`~reshard.io.chunkcheck.verify_segments`): each chunk's checksum is computed over
        ``segments`` (ascending, together covering the ranges), the ones without a view being streamed from
        storage through the bounded scratch buffer."""
        self.verify(self.stored(checksums, box_length, file, box_offset, what), ranges, segments)

    def verify(self, stored: StoredChunks, ranges: Sequence[tuple[int, int]], segments: Sequence[Segment]) -> None:
        """:func:`~reshard.io.chunkcheck.verify_segments`, reading the segments without a view through the scratch
        buffer; the bytes verified are counted."""
        self.bytes_verified += verify_segments(stored, ranges, segments, self.streamer(stored))

    def streamer(self, stored: StoredChunks) -> Streamer:
        """Reads bytes of ``stored`` through the scratch buffer for the chunk verifier (a
        :data:`~reshard.io.chunkcheck.Streamer`)."""

        def stream(start: int, length: int, value: int) -> int:
            return self._crc_streamed(stored, start, length, value)

        return stream

    def verify_stored(self, checksums: tuple[int, ...], length: int, file: int, offset: int, what: str) -> None:
        """Verify every chunk of a whole stored box or blob (``length`` bytes at ``offset`` of data file
        ``file``), streamed through a bounded buffer whatever the chunk size.

        Raises:
            CorruptCheckpointError: a chunk's checksum does not match, or the file is short.
            StorageError: the file cannot be read.
        """
        if length:
            self.verify_chunks(checksums, length, file, offset, [(0, length)], [Segment(0, length)], what)

    def _crc_streamed(self, stored: StoredChunks, start: int, length: int, value: int) -> int:
        """The CRC of bytes ``[start, start + length)`` of ``stored``, continuing ``value``, read in pieces of
        the scratch buffer."""
        piece = max(1, min(length, self.stream_bytes))
        view = self._scratch_view(piece)
        for at in range(0, length, piece):
            part = view[: min(piece, length - at)]
            self.read([ReadRequest(stored.name, stored.byte_offset + start + at, part)], [stored.what])
            value = crc32c_of(part, value)
        return value


StoredEntry = tuple[str, int, int, int, tuple[int, ...]]
"""A stored box or blob to verify whole: ``(what, file, byte_offset, byte_length, checksums)``."""


def verify_stored_ranges(
    storage: Storage,
    metadata: Metadata,
    stored: Sequence[StoredEntry],
    *,
    memory_budget_bytes: int = VERIFY_MEMORY_BUDGET,
    on_verified: Callable[[int], None] | None = None,
    stop_at_first: bool = False,
) -> list[str]:
    """Verify every chunk of the boxes and blobs ``stored`` (of data files whose sizes the caller has checked),
    reading them through one buffer of ``memory_budget_bytes``, whatever the chunk size; one problem (the
    error's text) per damaged box or blob, in order, none when all match. ``on_verified(length)`` is told each
    entry's bytes as it is done; with ``stop_at_first``, the first problem ends the check. The file verifier of
    node-local staging and of ``validate``. Not collective.

    Raises:
        nothing of the checkpoint's: a read that fails or comes back short is that entry's problem.
    """
    reader = VerifiedReader(storage, metadata, transfer_bytes=memory_budget_bytes, stream_bytes=memory_budget_bytes)
    reader.checked_files.update(file for _, file, _, _, _ in stored)
    problems: list[str] = []
    try:
        for what, file, offset, length, checksums in stored:
            try:
                reader.verify_stored(checksums, length, file, offset, what)
            except CheckpointError as exc:
                problems.append(str(exc))
                if stop_at_first:
                    break
            if on_verified is not None:
                on_verified(length)
    finally:
        reader.close()
    return problems


def check_data_file(storage: Storage, metadata: Metadata, file: int) -> None:
    """Data file ``file`` of ``metadata`` exists in ``storage`` (the checkpoint's own, which resolves the
    files it references) and has the size the metadata says: CorruptCheckpointError, else StorageError."""
    entry = metadata.files[file]
    where = storage.describe(entry.location)
    if entry.checkpoint is not None:
        where += f" (of checkpoint {entry.checkpoint}, which {storage.describe()} references)"
    try:
        size = storage.size(entry.location)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"data file {where} is missing") from None
    except OSError as exc:
        raise StorageError(f"cannot open data file {where}: {exc}") from exc
    if size != entry.size:
        raise CorruptCheckpointError(
            f"data file {where} has {size} bytes, the metadata says {entry.size}: it was truncated or altered"
        )


def check_data_files(storage: Storage, metadata: Metadata) -> None:
    """Every data file of ``metadata`` as :func:`check_data_file` wants it. For a caller that allocates tensors
    from the metadata's shapes before a load (a template built from the checkpoint itself): the shapes' bytes
    are then bounded by files that exist, never by a number of the metadata alone (docs/reliability.md,
    section 5)."""
    for file in range(len(metadata.files)):
        check_data_file(storage, metadata, file)
