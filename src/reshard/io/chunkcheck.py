"""The one chunk verifier: these bytes of a stored box, at these box-relative offsets, match its chunk CRC-32Cs.

A stored box or object blob is checksummed in consecutive chunks of ``chunk_bytes`` counted from its first
byte (docs/format.md section 6, :mod:`reshard.io.checksums`). Whoever reads stored bytes and uses them checks
them here first: the read executor of loads (:mod:`reshard.io.reader`, each read mode and the streamed groups
of :mod:`reshard.io.chunkgroups`), node-local staging deciding whether a file already on local disk is complete
(:mod:`reshard.io.staging`), and ``validate`` (:mod:`reshard.flows.maintenance`). Like a checksum codec it holds
no I/O of its own: bytes come in memory, or from a ``stream`` callable that the caller backs with storage. A
mismatch is a :class:`~reshard.CorruptCheckpointError` naming the box (``what``: its key), the data file and
the absolute byte offsets of the chunk in that file, so that every reader reports damage the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from reshard.errors import CorruptCheckpointError
from reshard.io.checksums import crc32c_of

__all__ = [
    "ChunkProgress",
    "Segment",
    "StoredChunks",
    "Streamer",
    "check_chunk",
    "feed",
    "verify_segments",
]


@dataclass(frozen=True, slots=True)
class StoredChunks:
    """One stored box or blob as its checksums see it: ``byte_length`` bytes at ``byte_offset`` of the data file
    ``name`` (described as ``where`` in messages), checksummed in chunks of ``chunk_bytes``; ``what`` names it
    (``"tensor 'w' box at [0, 0]"``)."""

    what: str
    name: str
    where: str
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]
    chunk_bytes: int

    def chunks(self, lo: int, hi: int) -> Iterator[tuple[int, int]]:
        """The chunks ``[chunk_lo, chunk_hi)`` (box-relative) of the range ``[lo, hi)``, which starts at a chunk's
        first byte; the last one ends at ``hi`` or at the end of the box."""
        for chunk_lo in range(lo, hi, self.chunk_bytes):
            yield chunk_lo, min(chunk_lo + self.chunk_bytes, hi, self.byte_length)

    def chunk_end(self, chunk_lo: int) -> int:
        """The end of the chunk that starts at box-relative byte ``chunk_lo``."""
        return min(chunk_lo + self.chunk_bytes, self.byte_length)


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes ``[start, start + length)`` of a stored box, either already in memory (``view``) or to be
    streamed from storage while a chunk is verified (``view`` None)."""

    start: int
    length: int
    view: memoryview | None = None


Streamer = Callable[[int, int, int], int]
"""``stream(start, length, crc)``: the CRC-32C of bytes ``[start, start + length)`` of the box, read from
storage, continuing from ``crc``."""


def check_chunk(stored: StoredChunks, chunk_lo: int, chunk_hi: int, value: int) -> int:
    """Check that ``value`` is the checksum of the chunk ``[chunk_lo, chunk_hi)`` of ``stored``; its length.

    Raises:
        CorruptCheckpointError: it is not (or the box has no checksum for that chunk), naming the box, the
            file and the chunk's bytes in the file.
    """
    index = chunk_lo // stored.chunk_bytes
    if index >= len(stored.checksums) or value != stored.checksums[index]:
        raise CorruptCheckpointError(
            f"{stored.what}: checksum mismatch in data file {stored.where} at bytes "
            f"[{stored.byte_offset + chunk_lo}, {stored.byte_offset + chunk_hi})"
        )
    return chunk_hi - chunk_lo


def verify_segments(
    stored: StoredChunks,
    ranges: Sequence[tuple[int, int]],
    segments: Sequence[Segment],
    stream: Streamer | None = None,
) -> int:
    """Verify every chunk of ``ranges`` (box-relative, ascending, each starting at a chunk's first byte) over
    ``segments`` (ascending, together covering the ranges); segments without a view are read through ``stream``.
    Returns the bytes verified.

    Raises:
        CorruptCheckpointError: a chunk's checksum does not match.
        AssertionError: the segments leave a byte of a range uncovered, or one without a view has no ``stream``
            (a bug of the caller, not damage).
    """
    verified = 0
    at = 0
    for lo, hi in ranges:
        for chunk_lo, chunk_hi in stored.chunks(lo, hi):
            value = 0
            position = chunk_lo
            while position < chunk_hi:
                while at < len(segments) and segments[at].start + segments[at].length <= position:
                    at += 1
                if at == len(segments) or segments[at].start > position:
                    raise AssertionError(f"{stored.what}: no bytes for [{position}, {chunk_hi}) of the box to verify")
                segment = segments[at]
                stop = min(chunk_hi, segment.start + segment.length)
                if segment.view is not None:
                    value = crc32c_of(segment.view[position - segment.start : stop - segment.start], value)
                elif stream is not None:
                    value = stream(position, stop - position, value)
                else:
                    raise AssertionError(f"{stored.what}: bytes [{position}, {stop}) are neither in memory nor read")
                position = stop
            verified += check_chunk(stored, chunk_lo, chunk_hi, value)
    return verified


@dataclass(frozen=True, slots=True)
class ChunkProgress:
    """How far the bytes of a box fed in order (:func:`feed`) have come: ``position`` (box-relative) is the next
    byte expected, ``value`` the checksum of the bytes of its chunk before it."""

    position: int = 0
    value: int = 0


def feed(stored: StoredChunks, progress: ChunkProgress, position: int, data: memoryview) -> tuple[ChunkProgress, int]:
    """Add bytes ``[position, position + len(data))`` of the box to the running checksums: they continue the
    bytes fed before (``progress``), or start a chunk. Each chunk is checked when its last byte arrives. Returns
    the new progress and the bytes of the chunks checked now.

    Raises:
        CorruptCheckpointError: a chunk completed here does not match its checksum.
        ValueError: ``position`` neither continues ``progress`` nor starts a chunk.
    """
    value = progress.value
    if position != progress.position:
        if position % stored.chunk_bytes:
            raise ValueError(f"{stored.what}: bytes fed at {position}, expected {progress.position} or a chunk start")
        value = 0
    verified = 0
    at = 0
    while at < len(data):
        here = position + at
        chunk_lo = here // stored.chunk_bytes * stored.chunk_bytes
        chunk_hi = stored.chunk_end(chunk_lo)
        take = min(len(data) - at, chunk_hi - here)
        value = crc32c_of(data[at : at + take], value if here > chunk_lo else 0)
        at += take
        if here + take == chunk_hi:
            verified += check_chunk(stored, chunk_lo, chunk_hi, value)
            value = 0
    return ChunkProgress(position + len(data), value), verified
