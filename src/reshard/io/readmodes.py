"""The four ways a load reads one item of its plan, as functions over frozen values.

A read item (one overlap of a target box with a saved box, :class:`~reshard.planning.load_plan.ReadItem`) is
resolved against its stored box into a :class:`BoxRead`: its stored chunks
(:class:`~reshard.io.chunkcheck.StoredChunks`), the chunks its reads touch, the saved dtype and shape, and its
destination (a host tensor, or the host proxy of a device one). Every mode verifies each touched chunk whole,
on the very bytes it uses, with the one chunk verifier (:mod:`reshard.io.chunkcheck`), and says what it did
as :class:`ReadCounts`.

- **direct** (:func:`direct_requests`, :func:`finish_direct`): the overlap is one contiguous run of the saved
  dtype, and the destination is contiguous host memory: the run is read straight into the destination; the
  parts of its first and last chunks outside the run go to the read buffer (or, with chunks too large for it,
  are streamed while verifying); each chunk's checksum is computed across those pieces. Where storage serves
  reads one at a time (local files), consecutive direct reads of a box are read chunk by chunk instead, each
  chunk verified while still in the CPU's cache (:class:`DirectRun`, :func:`read_direct_run`).
- **mapped** (:func:`read_mapped`, local files): the touched chunks are mapped, verified in the mapping, and the
  overlap copied (and converted) from the mapping into the destination in one strided pass.
- **chunks** (:func:`chunk_requests`, :func:`finish_chunks`): the touched chunks are read into the read buffer
  at their places in the box, verified there, and copied out with one strided copy.
- **runs** (:func:`run_requests`, :func:`finish_runs`): only the overlap's runs are read into the read buffer;
  for sources without checksums (safetensors).

Direct, chunks and runs reads are batched (:class:`BufferedRead`: where in the read buffer an item's bytes
land): the requests of a batch are served together, then each item is finished. The I/O goes through a
:class:`~reshard.io.verified.VerifiedReader` (``io``), which checks short reads and streams bytes not in memory.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from reshard.errors import StorageError
from reshard.geometry.boxes import row_major_strides
from reshard.io.chunkcheck import Segment, StoredChunks, verify_segments
from reshard.io.device import is_host_bytes
from reshard.state.dtypes import byte_view
from reshard.storage import ReadRequest

if TYPE_CHECKING:
    from reshard.io.verified import VerifiedReader
    from reshard.planning.load_plan import ReadItem

__all__ = [
    "BoxRead",
    "BufferedRead",
    "DirectRun",
    "ReadCounts",
    "buffered",
    "chunk_requests",
    "direct_requests",
    "finish",
    "finish_chunks",
    "finish_direct",
    "finish_runs",
    "is_direct",
    "read_direct_run",
    "read_mapped",
    "requests",
    "run_requests",
]

Ranges = tuple[tuple[int, int], ...]
"""Box-relative byte ranges ``[lo, hi)`` of whole checksum chunks, ascending."""


@dataclass(frozen=True, slots=True)
class ReadCounts:
    """What reads did: bytes verified, bytes read straight into their destination (``direct``), bytes read or
    checksummed beyond the planned reads to verify whole chunks (``extra``)."""

    verified: int = 0
    direct: int = 0
    extra: int = 0

    def __add__(self, other: ReadCounts) -> ReadCounts:
        return ReadCounts(self.verified + other.verified, self.direct + other.direct, self.extra + other.extra)


@dataclass(frozen=True, slots=True)
class BoxRead:
    """One read item resolved against its stored box: ``stored`` (its chunks, file and name for messages), the
    chunks its reads touch (``ranges``, empty for a box without checksums), the saved ``dtype`` and ``shape``,
    and ``dest``, the tensor its overlap goes to."""

    item: ReadItem
    stored: StoredChunks
    ranges: Ranges
    dtype: torch.dtype
    shape: tuple[int, ...]
    dest: torch.Tensor

    @property
    def run(self) -> tuple[int, int]:
        """The box-relative bytes ``[start, end)`` of the item's first run (its only one, for a direct read)."""
        pattern, itemsize = self.item.pattern, self.item.itemsize
        return pattern.first * itemsize, (pattern.first + pattern.span) * itemsize

    @property
    def runs_bytes(self) -> int:
        """The bytes of all the item's runs."""
        return self.item.pattern.count * self.item.pattern.span * self.item.itemsize

    def request(self, start: int, view: memoryview) -> ReadRequest:
        """A request for the box-relative bytes from ``start`` into ``view``."""
        return ReadRequest(self.stored.name, self.stored.byte_offset + start, view)


def is_direct(item: ReadItem, dtype: torch.dtype, dest: torch.Tensor, through_host: bool) -> bool:
    """Whether ``item`` (stored as ``dtype``) is read straight into ``dest``: one run of the saved dtype, into
    a host proxy (``through_host``) or into contiguous host memory holding the stored bytes as they are."""
    pattern = item.pattern
    if pattern.count != 1 or pattern.span != pattern.needed:
        return False
    return through_host or (dest.dtype == dtype and is_host_bytes(dest))


# ---- reads through the read buffer ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BufferedRead:
    """A read of a batch whose bytes (``nbytes`` of them; for a direct read, the parts of chunks outside its run)
    land in the read buffer at ``offset``. ``mode``: 'direct', 'chunks' or 'runs'; ``region_start``: for
    'chunks', the box-relative byte at ``offset``; ``streamed``: for 'direct' with chunks too large for the read
    buffer, the parts outside the run are streamed while verifying instead."""

    read: BoxRead
    mode: str
    nbytes: int
    offset: int = 0
    region_start: int = 0
    streamed: bool = False


def buffered(read: BoxRead, *, direct: bool, oversized: bool) -> BufferedRead:
    """How ``read`` (not mapped) goes through the read buffer: ``direct`` (see :func:`is_direct`), else its
    touched chunks, else (no checksums) its runs. ``oversized``: chunks are too large to hold two in the read
    buffer (a checksummed read that is not direct is then streamed by its group instead)."""
    ranges = read.ranges
    if direct:
        start, end = read.run
        streamed = bool(ranges) and oversized
        extra = 0 if streamed or not ranges else (start - ranges[0][0]) + (ranges[-1][1] - end)
        return BufferedRead(read, "direct", extra, streamed=streamed)
    if ranges:
        itemsize = read.item.itemsize
        region_start = ranges[0][0] - ranges[0][0] % itemsize
        nbytes = -(-(ranges[-1][1] - region_start) // itemsize) * itemsize
        return BufferedRead(read, "chunks", nbytes, region_start=region_start)
    return BufferedRead(read, "runs", read.runs_bytes)


def direct_requests(buffered: BufferedRead, region: memoryview) -> list[ReadRequest]:
    """The run into its destination; the rest of its first and last chunks into ``region``."""
    read = buffered.read
    start, end = read.run
    out = [read.request(start, byte_view(read.dest))]
    if read.ranges and not buffered.streamed:
        head, tail = start - read.ranges[0][0], read.ranges[-1][1] - end
        if head:
            out.append(read.request(read.ranges[0][0], region[:head]))
        if tail:
            out.append(read.request(end, region[head : head + tail]))
    return out


def finish_direct(buffered: BufferedRead, region: memoryview, io: VerifiedReader) -> ReadCounts:
    """Verify the touched chunks across the run (in its destination) and the parts in ``region`` (or streamed)."""
    read = buffered.read
    start, end = read.run
    if not read.ranges:
        return ReadCounts(direct=end - start)
    lo, hi = read.ranges[0][0], read.ranges[-1][1]
    dest = byte_view(read.dest)
    if buffered.streamed:
        segments = [Segment(lo, start - lo), Segment(start, end - start, dest), Segment(end, hi - end)]
    else:
        head, tail = start - lo, hi - end
        segments = [Segment(lo, head, region[:head]), Segment(start, end - start, dest)]
        segments.append(Segment(end, tail, region[head : head + tail]))
    segments = [s for s in segments if s.length]
    verified = verify_segments(read.stored, read.ranges, segments, io.streamer(read.stored))
    return ReadCounts(verified, end - start, (start - lo) + (hi - end))


def chunk_requests(buffered: BufferedRead, region: memoryview) -> list[ReadRequest]:
    """Each touched range at its place in ``region`` (which starts at box byte ``region_start``)."""
    read, base = buffered.read, buffered.region_start
    return [read.request(lo, region[lo - base : hi - base]) for lo, hi in read.ranges]


def finish_chunks(buffered: BufferedRead, region: torch.Tensor, io: VerifiedReader) -> ReadCounts:
    """Verify the chunks in ``region``, then copy the overlap out of it with one strided copy."""
    read = buffered.read
    segment = Segment(buffered.region_start, buffered.nbytes, byte_view(region))
    verified = verify_segments(read.stored, read.ranges, [segment])
    first = read.item.pattern.first - buffered.region_start // read.item.itemsize
    source = region.view(read.dtype)[first:].as_strided(read.item.overlap.shape, row_major_strides(read.shape))
    with torch.no_grad():
        read.dest.copy_(source)
    return ReadCounts(verified, 0, max(0, sum(hi - lo for lo, hi in read.ranges) - read.runs_bytes))


def run_requests(buffered: BufferedRead, region: memoryview) -> list[ReadRequest]:
    """Each run of the item's pattern, one after the other in ``region``."""
    read = buffered.read
    span_bytes = read.item.pattern.span * read.item.itemsize
    return [
        read.request(first * read.item.itemsize, region[i * span_bytes : (i + 1) * span_bytes])
        for i, first in enumerate(read.item.pattern.starts())
    ]


def finish_runs(buffered: BufferedRead, region: torch.Tensor, io: VerifiedReader) -> ReadCounts:
    """Copy the runs in ``region`` into the destination (nothing to verify: the source has no checksums)."""
    read = buffered.read
    pattern = read.item.pattern
    lead_strides: list[int] = []
    stride = pattern.span
    for size in reversed(pattern.lead_shape):
        lead_strides.insert(0, stride)
        stride *= size
    source = region.view(read.dtype).as_strided(
        (*pattern.lead_shape, *pattern.inner_shape), (*lead_strides, *pattern.inner_strides)
    )
    with torch.no_grad():
        read.dest.copy_(source.reshape(read.dest.shape))
    return ReadCounts()


def requests(buffered: BufferedRead, buffer: torch.Tensor) -> list[ReadRequest]:
    """The requests of a buffered read whose bytes land at its offset of ``buffer`` (the read buffer)."""
    region = byte_view(buffer[buffered.offset : buffered.offset + buffered.nbytes])
    if buffered.mode == "direct":
        return direct_requests(buffered, region)
    return (chunk_requests if buffered.mode == "chunks" else run_requests)(buffered, region)


def finish(buffered: BufferedRead, buffer: torch.Tensor, io: VerifiedReader) -> ReadCounts:
    """Verify and copy a buffered read once its requests are served."""
    region = buffer[buffered.offset : buffered.offset + buffered.nbytes]
    if buffered.mode == "direct":
        return finish_direct(buffered, byte_view(region), io)
    return (finish_chunks if buffered.mode == "chunks" else finish_runs)(buffered, region, io)


# ---- direct reads chunk by chunk -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DirectRun:
    """Consecutive direct reads of one stored box, read chunk by chunk as one: when planning cut an overlap
    into slabs, a chunk that straddles two slabs is verified across both destinations instead of having its
    other part read beside each. ``pieces``: (box-relative start, destination bytes), each starting where the
    previous one ends; ``lo``, ``hi``: the box-relative bounds of the touched chunks."""

    stored: StoredChunks
    pieces: tuple[tuple[int, memoryview], ...]
    lo: int
    hi: int

    @classmethod
    def of(cls, read: BoxRead) -> DirectRun:
        ((lo, hi),) = read.ranges
        return cls(read.stored, ((read.run[0], byte_view(read.dest)),), lo, hi)

    @property
    def start(self) -> int:
        return self.pieces[0][0]

    @property
    def end(self) -> int:
        start, view = self.pieces[-1]
        return start + len(view)

    def continued(self, read: BoxRead) -> DirectRun | None:
        """This run with ``read`` added, when ``read`` is a direct read of the same box from where it ends."""
        same = (read.stored.name, read.stored.byte_offset) == (self.stored.name, self.stored.byte_offset)
        if not same or read.run[0] != self.end:
            return None
        return DirectRun(self.stored, (*self.pieces, (read.run[0], byte_view(read.dest))), self.lo, read.ranges[-1][1])


def _chunk_segments(
    run: DirectRun, starts: list[int], chunk_lo: int, chunk_hi: int, outside: memoryview
) -> list[Segment]:
    """The pieces of one chunk: its parts before and after the run (in ``outside``), and its parts in the run's
    destinations (``starts``: the box-relative start of each of the run's pieces)."""
    start, end = run.start, run.end
    head = start - run.lo
    segments = []
    if chunk_lo < start:
        segments.append(Segment(chunk_lo, start - chunk_lo, outside[chunk_lo - run.lo : head]))
    for piece_start, piece in run.pieces[max(0, bisect.bisect_right(starts, chunk_lo) - 1) :]:
        if piece_start >= chunk_hi:
            break
        a, b = max(chunk_lo, piece_start), min(chunk_hi, piece_start + len(piece))
        if a < b:
            segments.append(Segment(a, b - a, piece[a - piece_start : b - piece_start]))
    if chunk_hi > end:
        a = max(chunk_lo, end)
        segments.append(Segment(a, chunk_hi - a, outside[head + a - end : head + chunk_hi - end]))
    return segments


def read_direct_run(run: DirectRun, outside: memoryview, io: VerifiedReader) -> ReadCounts:
    """For each touched chunk: read its parts inside the run into their destinations and its parts outside the
    run into ``outside`` (``(start - lo) + (hi - end)`` bytes of the read buffer), then verify it."""
    verified = 0
    starts = [piece_start for piece_start, _ in run.pieces]
    for chunk_lo, chunk_hi in run.stored.chunks(run.lo, run.hi):
        segments = _chunk_segments(run, starts, chunk_lo, chunk_hi, outside)
        reads = [
            ReadRequest(run.stored.name, run.stored.byte_offset + s.start, s.view)
            for s in segments
            if s.view is not None
        ]
        io.read(reads, [run.stored.what] * len(reads))
        verified += verify_segments(run.stored, [(chunk_lo, chunk_hi)], segments)
    outside_bytes = (run.start - run.lo) + (run.hi - run.end)
    return ReadCounts(verified, run.end - run.start, outside_bytes)


# ---- mapped local files --------------------------------------------------------------------------------


def read_mapped(read: BoxRead, io: VerifiedReader) -> ReadCounts | None:
    """Verify the touched chunks in a mapping of the file and copy the overlap from it into its destination,
    converting the dtype in the same pass. None where the storage cannot map (or the mapping would be
    misaligned for the dtype): the read then goes through the read buffer.

    Raises:
        StorageError: the file cannot be mapped.
    """
    itemsize, stored, ranges = read.item.itemsize, read.stored, read.ranges
    strides = row_major_strides(read.shape)
    first = read.run[0]
    if (stored.byte_offset + first) % itemsize:
        return None  # a view of the mapping would be misaligned
    extent = (1 + sum((n - 1) * st for n, st in zip(read.item.overlap.shape, strides, strict=True))) * itemsize
    lo = min(ranges[0][0], first) if ranges else first
    hi = max(ranges[-1][1], first + extent) if ranges else first + extent
    try:
        mapped = io.storage.map_range(stored.name, stored.byte_offset + lo, hi - lo)
    except OSError as exc:
        raise StorageError(f"cannot map data file {stored.where}: {exc}") from exc
    if mapped is None:
        return None
    counts = ReadCounts()
    try:
        if ranges:
            raw = byte_view(mapped.tensor)
            verified = verify_segments(stored, ranges, [Segment(lo, hi - lo, raw)])
            del raw  # release the buffer export, so that the mapping can be closed now
            counts = ReadCounts(verified, 0, max(0, sum(b - a for a, b in ranges) - read.runs_bytes))
        source = (
            mapped.tensor[first - lo : first - lo + extent]
            .view(read.dtype)
            .as_strided(read.item.overlap.shape, strides)
        )
        with torch.no_grad():
            read.dest.copy_(source)
        del source
    finally:
        mapped.close()
    return counts
