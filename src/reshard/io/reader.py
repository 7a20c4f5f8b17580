"""The read executor: one rank's planned reads, performed, verified and copied into place.

Every byte a load uses is verified against the checksum of its chunk, and the check is made on the very
bytes that are used: a chunk is read whole, its checksum computed over what was read, and only those bytes
are copied into the destination. A read touching part of a chunk therefore also reads the rest of that
chunk (the extra bytes are counted in ``bytes_verify_extra``, apart from the planned ``bytes_read``).

Four ways to read an item of the plan (one overlap of a target box with a saved box):

- **direct**: the overlap is one contiguous run of the saved dtype, and the destination is contiguous CPU
  memory: the run is read straight into the destination; the parts of its first and last chunks outside
  the run are read into the staging buffer; each chunk's checksum is computed across those pieces.
- **mapped** (local files): the chunks the overlap touches are mapped, verified in the mapping, and the
  overlap is copied (and converted) from the mapping into the destination in one strided pass.
- **chunks**: the chunks the overlap touches are read into the staging buffer at their places in the box,
  verified there, and copied out with one strided copy.
- **runs**: only the overlap's runs are read into the staging buffer. Used for sources without checksums
  (safetensors), and when a checkpoint's checksum chunks are larger than half the staging buffer (then
  the chunks are first verified by streaming them through a small buffer, a separate read of the same
  stored bytes: the one case where the verified bytes are not the copied ones).

Reads are batched so that object stores serve them concurrently (:meth:`Storage.read_ranges`); the
staging memory of a batch is at most ``buffer_bytes`` (the planner keeps every item within it).

A destination in GPU memory is read as a host destination would be, into a *proxy*: a contiguous host tensor
of the overlap's shape in the saved dtype, carved from a pinned arena (so a contiguous run is read straight
into it); full arenas are copied to the device on a side stream, the conversion to the destination's dtype
happening there, while the reads go on into the other arena (:class:`~reshard.io.device.DeviceFill`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from reshard.dtypes import byte_view
from reshard.errors import CheckpointError, CorruptCheckpointError, StorageError
from reshard.geometry.boxes import Box, row_major_strides
from reshard.io.checksums import crc32c_of, run_starts, touched_chunks
from reshard.io.device import DeviceFill, is_host_bytes
from reshard.storage import RangeReadError, ReadRequest, Storage

if TYPE_CHECKING:
    from reshard.metadata import Metadata, SavedBox, SavedObject
    from reshard.planning.load_plan import LoadPlan, ReadItem

__all__ = ["DEFAULT_LOAD_MEMORY_BUDGET", "MIN_LOAD_MEMORY_BUDGET", "ReadBudget", "ReadExecutor"]

DEFAULT_LOAD_MEMORY_BUDGET = 32 * 1024 * 1024
"""The host memory a rank's load holds at most for its own buffers, by default (see :class:`ReadExecutor`)."""

MIN_LOAD_MEMORY_BUDGET = 16
"""The smallest budget a load can keep (a few bytes of staging and of mapped window)."""

_ALIGN = 64
_STREAM_PIECE = 1 << 20
"""Largest piece in which an oversized chunk is streamed through the scratch buffer."""


@dataclass(frozen=True, slots=True)
class _Segment:
    """Bytes ``[start, start + length)`` of a stored box, either already in memory (``view``) or to be
    streamed from storage while a chunk is verified (``view`` None)."""

    start: int
    length: int
    view: memoryview | None = None


@dataclass
class _Pending:
    """An item of the current batch whose reads land in the staging buffer at ``offset``."""

    item: ReadItem
    saved: SavedBox
    dest: torch.Tensor
    kind: str
    """'direct', 'chunks' or 'runs'."""
    offset: int
    nbytes: int
    ranges: list[tuple[int, int]]
    """Box-relative byte ranges of the touched chunks (empty: nothing to verify here)."""
    region_start: int = 0
    """For 'chunks': the box-relative byte at ``offset`` of the staging buffer."""
    streamed: bool = False
    """For 'direct' with oversized chunks: the parts of the touched chunks outside the run are streamed
    from storage while verifying, instead of being staged."""


@dataclass
class _DirectRun:
    """Consecutive direct reads of one stored box, read chunk by chunk as one (see
    :meth:`ReadExecutor._by_chunk`): when planning cut an overlap into slabs, a checksum chunk that straddles
    two slabs is verified across both destinations instead of having its other part read beside each."""

    saved: SavedBox
    what: str
    pieces: list[tuple[int, memoryview]]
    """(box-relative start, destination bytes), each starting where the previous one ends."""
    lo: int
    """Box-relative start of the first touched chunk."""
    hi: int
    """Box-relative end of the last touched chunk."""

    @property
    def end(self) -> int:
        start, view = self.pieces[-1]
        return start + len(view)

    def continued_by(self, saved: SavedBox, start: int) -> bool:
        """Whether a direct read of ``saved`` from box-relative byte ``start`` continues this run."""
        return saved.file == self.saved.file and saved.byte_offset == self.saved.byte_offset and start == self.end


@dataclass(frozen=True, slots=True)
class ReadBudget:
    """How a load's memory budget is shared among the executor's buffers (see :class:`ReadExecutor`)."""

    staging_bytes: int
    """The staging buffer: half the budget."""
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
        a quarter for staging and the rest beyond the scratch piece in three equal parts: the largest read
        item and two arenas that hold it (so that a read item always fits an arena)."""
        if memory_budget_bytes < MIN_LOAD_MEMORY_BUDGET:
            raise ValueError(f"a load's memory budget must be at least {MIN_LOAD_MEMORY_BUDGET} bytes")
        stream = max(1, min(_STREAM_PIECE, memory_budget_bytes // 8))
        if device:
            staging = memory_budget_bytes // 4
            third = max(1, (memory_budget_bytes - staging - stream) // 3)
            return cls(staging, stream, third, third)
        staging = memory_budget_bytes // 2
        return cls(staging, stream, memory_budget_bytes - staging - stream)


class ReadExecutor:
    """Performs one rank's reads (see the module doc). Not thread-safe; one per load.

    Memory: the executor's buffers never hold more than ``memory_budget_bytes`` at once: half of it is the
    staging buffer (reads that do not land in their destination, the parts of chunks outside a direct
    read), the rest the largest mapped window of a local file (whose pages count in the resident set while
    mapped) or an object store's response bodies in flight, and the scratch piece through which oversized
    chunks are streamed (:class:`ReadBudget`). The planner keeps every read item within
    ``ReadBudget.max_read_bytes``, so that holds whatever the tensor sizes.

    Destinations outside host memory (CUDA tensors) are filled through host proxies
    (:class:`~reshard.io.device.DeviceFill`): each read item lands in a proxy of the saved dtype exactly as it
    would in a host destination (straight into it when the overlap is one contiguous run), and the proxies
    are copied to the device on a side stream while the next reads go on. The budget then also holds the two
    arenas of proxies (``ReadBudget.of(..., device=True)``; planning must use the same shares).

    Args:
        storage: where the data files are.
        metadata: the checkpoint (or source) being read.
        memory_budget_bytes: the budget, at least :data:`MIN_LOAD_MEMORY_BUDGET`.
        device: whether some destinations are outside host memory (the budget's shares depend on it).
        fill_all_through_host: fill every destination through proxies, host ones too: how the CPU-only test
            suite runs the path of device destinations.
    """

    def __init__(
        self,
        storage: Storage,
        metadata: Metadata,
        *,
        memory_budget_bytes: int = DEFAULT_LOAD_MEMORY_BUDGET,
        device: bool = False,
        fill_all_through_host: bool = False,
    ) -> None:
        self.storage = storage
        self.metadata = metadata
        budget = ReadBudget.of(memory_budget_bytes, device=device or fill_all_through_host)
        self.buffer_bytes = budget.staging_bytes
        self.stream_bytes = budget.stream_bytes
        self.transfer_bytes = budget.max_read_bytes
        self.arena_bytes = budget.arena_bytes
        self.fill_all_through_host = fill_all_through_host
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.scratch = torch.empty(0, dtype=torch.uint8)
        self.bytes_verified = 0
        """Bytes whose chunk checksum was verified."""
        self.bytes_verify_extra = 0
        """Bytes read (or, for mapped files, checksummed) beyond the planned reads, to verify whole chunks."""
        self.bytes_direct = 0
        """Bytes read straight into their destination (or its host proxy)."""
        self.bytes_to_device = 0
        """Bytes copied from host proxies into destinations outside host memory."""
        self.checked_files: set[int] = set()

    # ---- files and raw reads -------------------------------------------------------------------------

    def check_file(self, file: int) -> None:
        """Before the first read of a data file: it exists and has the size the metadata says."""
        if file in self.checked_files:
            return
        entry = self.metadata.files[file]
        where = self.storage.describe(entry.location)
        if entry.checkpoint is not None:
            where += f" (of checkpoint {entry.checkpoint}, which {self.storage.describe()} references)"
        try:
            size = self.storage.size(entry.location)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {where} is missing") from None
        except OSError as exc:
            raise StorageError(f"cannot open data file {where}: {exc}") from exc
        if size != entry.size:
            raise CorruptCheckpointError(
                f"data file {where} has {size} bytes, the metadata says {entry.size}: it was truncated or altered"
            )
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

    def verify_chunks(
        self,
        checksums: tuple[int, ...],
        box_length: int,
        file: int,
        box_offset: int,
        ranges: list[tuple[int, int]],
        segments: list[_Segment],
        what: str,
    ) -> None:
        """Verify every chunk of ``ranges`` (box-relative, whole chunks) of a stored box at ``box_offset`` of
        data file ``file``: each chunk's checksum is computed over ``segments`` (ascending, together covering
        the ranges), the ones without a view being streamed from storage through a bounded buffer."""
        chunk = self.metadata.checksum_chunk_bytes
        name = self.metadata.files[file].location
        at = 0
        for lo, hi in ranges:
            for chunk_lo in range(lo, hi, chunk):
                chunk_hi = min(chunk_lo + chunk, hi, box_length)
                value = 0
                position = chunk_lo
                while position < chunk_hi:
                    while at < len(segments) and segments[at].start + segments[at].length <= position:
                        at += 1
                    if at == len(segments) or segments[at].start > position:
                        raise AssertionError(f"{what}: no bytes for [{position}, {chunk_hi}) of the box to verify")
                    segment = segments[at]
                    stop = min(chunk_hi, segment.start + segment.length)
                    if segment.view is not None:
                        value = crc32c_of(segment.view[position - segment.start : stop - segment.start], value)
                    else:
                        value = self._crc_streamed(name, box_offset + position, stop - position, value, what)
                    position = stop
                index = chunk_lo // chunk
                if index >= len(checksums) or value != checksums[index]:
                    where = self.storage.describe(name)
                    raise CorruptCheckpointError(
                        f"{what}: checksum mismatch in data file {where} at bytes "
                        f"[{box_offset + chunk_lo}, {box_offset + chunk_hi})"
                    )
                self.bytes_verified += chunk_hi - chunk_lo

    def verify_stored(self, checksums: tuple[int, ...], length: int, file: int, offset: int, what: str) -> None:
        """Verify every chunk of a whole stored box or blob (``length`` bytes at ``offset`` of data file
        ``file``), streamed through a bounded buffer whatever the chunk size.

        Raises:
            CorruptCheckpointError: a chunk's checksum does not match, or the file is short.
            StorageError: the file cannot be read.
        """
        if length:
            self.verify_chunks(checksums, length, file, offset, [(0, length)], [_Segment(0, length)], what)

    def _crc_streamed(self, name: str, offset: int, length: int, value: int, what: str) -> int:
        piece = max(1, min(length, self.stream_bytes))
        view = self._scratch_view(piece)
        for start in range(0, length, piece):
            part = view[: min(piece, length - start)]
            self.read([ReadRequest(name, offset + start, part)], [what])
            value = crc32c_of(part, value)
        return value

    # ---- the plan ------------------------------------------------------------------------------------

    def _oversized(self) -> bool:
        """Whether checksum chunks are too large to be staged whole (see the module doc)."""
        return 2 * self.metadata.checksum_chunk_bytes > self.buffer_bytes

    def run(self, plan: LoadPlan, views: list[torch.Tensor], boxes: list[Box]) -> None:
        """Fill ``views[i]`` (holding ``boxes[i]``) from the reads of ``plan``, verifying every chunk used.
        Destinations outside host memory are complete when it returns (or raises)."""
        # Arenas of the budget's share; an executor made without ``device`` holds a read item per arena.
        fill = DeviceFill(self.arena_bytes or self.transfer_bytes) if self._any_through_host(views) else None
        batch: list[_Pending] = []
        staged_bytes = 0
        direct: _DirectRun | None = None

        def drain() -> None:
            """Complete every read begun: the batch, the direct run."""
            nonlocal batch, staged_bytes, direct
            if direct is not None:
                self._read_direct_by_chunk(direct)
                direct = None
            if batch:
                self._flush(batch, staged_bytes)
                batch, staged_bytes = [], 0

        try:
            for item in plan.items:
                self.check_file(item.file)
                target = views[item.target]
                dest = target.detach()[item.overlap.relative_to(boxes[item.target])] if target.ndim else target.detach()
                saved = self.metadata.tensors[item.key].boxes[item.saved_index]
                if fill is not None and self._through_host(dest):
                    dtype = self.metadata.tensors[item.key].torch_dtype
                    if not fill.has_room(dest, dtype):  # finish the arena's reads, send it, take the other one
                        drain()
                        fill.flush()
                    dest = fill.proxy(dest, dtype)
                pending = self._prepare(item, saved, dest)
                if pending is None:
                    continue  # read and copied already (mapped)
                if self._by_chunk(pending):
                    if batch:
                        self._flush(batch, staged_bytes)
                        batch, staged_bytes = [], 0
                    start = item.pattern.first * item.itemsize
                    ((lo, hi),) = pending.ranges
                    if direct is not None and direct.continued_by(saved, start):
                        direct.pieces.append((start, byte_view(pending.dest)))
                        direct.hi = hi
                        continue
                    if direct is not None:
                        self._read_direct_by_chunk(direct)
                    direct = _DirectRun(saved, self._what(item, saved), [(start, byte_view(pending.dest))], lo, hi)
                    continue
                need = -(-pending.nbytes // _ALIGN) * _ALIGN
                if batch and staged_bytes + need > self.buffer_bytes:
                    self._flush(batch, staged_bytes)
                    batch, staged_bytes = [], 0
                pending.offset = staged_bytes
                batch.append(pending)
                staged_bytes += need
            drain()
        except BaseException:
            if fill is not None:
                fill.abandon()
            raise
        if fill is not None:
            fill.close()
            self.bytes_to_device += fill.bytes_copied

    def _through_host(self, dest: torch.Tensor) -> bool:
        """Whether ``dest`` is filled through a host proxy."""
        return self.fill_all_through_host or dest.device.type != "cpu"

    def _any_through_host(self, views: list[torch.Tensor]) -> bool:
        return any(self._through_host(view) for view in views)

    def _prepare(self, item: ReadItem, saved: SavedBox, dest: torch.Tensor) -> _Pending | None:
        """Choose how to read ``item`` (see the module doc); a mapped item is read here and then."""
        pattern = item.pattern
        itemsize = item.itemsize
        checked = bool(saved.checksums)
        oversized = checked and self._oversized()
        ranges: list[tuple[int, int]] = []
        if checked:
            starts = run_starts(pattern.first, pattern.lead_shape, pattern.lead_strides) * itemsize
            ranges = touched_chunks(
                starts, pattern.span * itemsize, self.metadata.checksum_chunk_bytes, saved.byte_length
            )
        dtype = self.metadata.tensors[item.key].torch_dtype
        direct = pattern.count == 1 and pattern.span == pattern.needed and dest.dtype == dtype and is_host_bytes(dest)
        if direct:
            start = pattern.first * itemsize
            end = start + pattern.span * itemsize
            extra = 0 if oversized or not ranges else (start - ranges[0][0]) + (ranges[-1][1] - end)
            return _Pending(item, saved, dest, "direct", 0, extra, ranges, streamed=oversized)
        if self._copy_mapped(item, saved, dest, ranges, oversized):
            return None
        if checked and not oversized:
            region_start = ranges[0][0] - ranges[0][0] % itemsize
            region_end = ranges[-1][1]
            nbytes = -(-(region_end - region_start) // itemsize) * itemsize
            return _Pending(item, saved, dest, "chunks", 0, nbytes, ranges, region_start)
        if checked:
            self._verify_streamed(saved, ranges, item)
        return _Pending(item, saved, dest, "runs", 0, pattern.count * pattern.span * itemsize, [])

    def _what(self, item: ReadItem, saved: SavedBox) -> str:
        return f"tensor {item.key!r} box at {list(saved.offset)}"

    def _verify_streamed(self, saved: SavedBox, ranges: list[tuple[int, int]], item: ReadItem) -> None:
        """Verify the touched chunks of an item by streaming them from storage (oversized chunks)."""
        segments = [_Segment(lo, hi - lo) for lo, hi in ranges]
        self.verify_chunks(
            saved.checksums, saved.byte_length, saved.file, saved.byte_offset, ranges, segments, self._what(item, saved)
        )
        runs = item.pattern.count * item.pattern.span * item.itemsize
        self.bytes_verify_extra += sum(hi - lo for lo, hi in ranges) - min(runs, sum(hi - lo for lo, hi in ranges))

    def _by_chunk(self, pending: _Pending) -> bool:
        """Whether a direct read goes chunk by chunk, each chunk verified as soon as it is read (while its
        bytes are still in the CPU's cache: a quarter less time than verifying after the whole read, on
        the benchmark machine), rather than in a batch: where the storage serves batches one read at a
        time anyway (local files)."""
        return (
            not self.storage.concurrent_reads
            and pending.kind == "direct"
            and len(pending.ranges) == 1
            and not pending.streamed
        )

    def _read_direct_by_chunk(self, run: _DirectRun) -> None:
        """Direct reads (see :meth:`_by_chunk`): for each touched chunk, its parts inside the run are read into
        their destinations and its parts outside the run into the staging buffer, then the chunk is verified."""
        saved, what = run.saved, run.what
        name = self.metadata.files[saved.file].location
        chunk = self.metadata.checksum_chunk_bytes
        lo, hi = run.lo, run.hi
        start, end = run.pieces[0][0], run.end
        head, tail = start - lo, hi - end
        staging = self._staging(head + tail)
        self.bytes_direct += end - start
        self.bytes_verify_extra += head + tail
        pieces = iter(run.pieces)
        piece_start, piece = next(pieces)
        for chunk_lo in range(lo, hi, chunk):
            chunk_hi = min(chunk_lo + chunk, hi)
            segments = []
            if chunk_lo < start:
                segments.append(_Segment(chunk_lo, start - chunk_lo, staging[chunk_lo - lo : head]))
            position = max(chunk_lo, start)
            while position < min(chunk_hi, end):
                while position >= piece_start + len(piece):
                    piece_start, piece = next(pieces)
                b = min(chunk_hi, end, piece_start + len(piece))
                segments.append(_Segment(position, b - position, piece[position - piece_start : b - piece_start]))
                position = b
            if chunk_hi > end:
                a = max(chunk_lo, end)
                segments.append(_Segment(a, chunk_hi - a, staging[head + a - end : head + tail]))
            self.read(
                [
                    ReadRequest(name, saved.byte_offset + seg.start, seg.view)
                    for seg in segments
                    if seg.view is not None
                ],
                [what] * len(segments),
            )
            self.verify_chunks(
                saved.checksums,
                saved.byte_length,
                saved.file,
                saved.byte_offset,
                [(chunk_lo, chunk_hi)],
                segments,
                what,
            )

    def _staging(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the staging buffer, allocated once at the batch limit (planning keeps
        every item within it), so that growing batches do not leave a trail of freed buffers in the heap."""
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(max(nbytes, self.buffer_bytes), dtype=torch.uint8)
        return byte_view(self.buffer[:nbytes]) if nbytes else memoryview(b"")

    def _flush(self, batch: list[_Pending], staged_bytes: int) -> None:
        staging = self._staging(staged_bytes)
        requests: list[ReadRequest] = []
        whats: list[str] = []
        for pending in batch:
            requests_of, what = self._requests(pending, staging), self._what(pending.item, pending.saved)
            requests += requests_of
            whats += [what] * len(requests_of)
        self.read(requests, whats)
        for pending in batch:
            self._finish(pending, staging)

    def _requests(self, pending: _Pending, staging: memoryview) -> list[ReadRequest]:
        item, saved = pending.item, pending.saved
        name = self.metadata.files[saved.file].location
        itemsize = item.itemsize
        region = staging[pending.offset : pending.offset + pending.nbytes]
        if pending.kind == "direct":
            start = item.pattern.first * itemsize
            end = start + item.pattern.span * itemsize
            self.bytes_direct += end - start
            out = [ReadRequest(name, saved.byte_offset + start, byte_view(pending.dest))]
            if pending.ranges and not pending.streamed:
                head = start - pending.ranges[0][0]
                tail = pending.ranges[-1][1] - end
                if head:
                    out.append(ReadRequest(name, saved.byte_offset + pending.ranges[0][0], region[:head]))
                if tail:
                    out.append(ReadRequest(name, saved.byte_offset + end, region[head : head + tail]))
                self.bytes_verify_extra += head + tail
            return out
        if pending.kind == "chunks":
            out = []
            for lo, hi in pending.ranges:
                view = region[lo - pending.region_start : hi - pending.region_start]
                out.append(ReadRequest(name, saved.byte_offset + lo, view))
            runs = item.pattern.count * item.pattern.span * itemsize
            self.bytes_verify_extra += max(0, sum(hi - lo for lo, hi in pending.ranges) - runs)
            return out
        span_bytes = item.pattern.span * itemsize
        return [
            ReadRequest(name, saved.byte_offset + first * itemsize, region[i * span_bytes : (i + 1) * span_bytes])
            for i, first in enumerate(item.pattern.starts())
        ]

    def _finish(self, pending: _Pending, staging: memoryview) -> None:
        item, saved = pending.item, pending.saved
        what = self._what(item, saved)
        itemsize = item.itemsize
        dtype = self.metadata.tensors[item.key].torch_dtype
        region = self.buffer[pending.offset : pending.offset + pending.nbytes]
        if pending.kind == "direct":
            if not pending.ranges:
                return
            start = item.pattern.first * itemsize
            end = start + item.pattern.span * itemsize
            dest = byte_view(pending.dest)
            if not pending.streamed:
                head = start - pending.ranges[0][0]
                tail = pending.ranges[-1][1] - end
                raw = staging[pending.offset : pending.offset + pending.nbytes]
                segments = [
                    _Segment(pending.ranges[0][0], head, raw[:head]),
                    _Segment(start, end - start, dest),
                    _Segment(end, tail, raw[head : head + tail]),
                ]
            else:  # oversized chunks: the parts outside the run are streamed
                lo, hi = pending.ranges[0][0], pending.ranges[-1][1]
                segments = [_Segment(lo, start - lo), _Segment(start, end - start, dest), _Segment(end, hi - end)]
                self.bytes_verify_extra += (start - lo) + (hi - end)
            segments = [s for s in segments if s.length]
            self.verify_chunks(
                saved.checksums, saved.byte_length, saved.file, saved.byte_offset, pending.ranges, segments, what
            )
            return
        if pending.kind == "chunks":
            raw = staging[pending.offset : pending.offset + pending.nbytes]
            segment = _Segment(pending.region_start, pending.nbytes, raw)
            self.verify_chunks(
                saved.checksums, saved.byte_length, saved.file, saved.byte_offset, pending.ranges, [segment], what
            )
            first = item.pattern.first - pending.region_start // itemsize
            source = region.view(dtype)[first:].as_strided(item.overlap.shape, row_major_strides(saved.shape))
            with torch.no_grad():
                pending.dest.copy_(source)
            return
        pattern = item.pattern
        lead_strides: list[int] = []
        stride = pattern.span
        for size in reversed(pattern.lead_shape):
            lead_strides.insert(0, stride)
            stride *= size
        source = region.view(dtype).as_strided(
            (*pattern.lead_shape, *pattern.inner_shape), (*lead_strides, *pattern.inner_strides)
        )
        with torch.no_grad():
            pending.dest.copy_(source.reshape(pending.dest.shape))

    def _copy_mapped(
        self, item: ReadItem, saved: SavedBox, dest: torch.Tensor, ranges: list[tuple[int, int]], oversized: bool
    ) -> bool:
        """Verify the touched chunks in a mapping of the file and copy the overlap from it into its
        destination, converting the dtype in the same pass. False where the storage cannot map (or the
        mapping would be misaligned for the dtype)."""
        dtype = self.metadata.tensors[item.key].torch_dtype
        itemsize = item.itemsize
        strides = row_major_strides(saved.shape)
        first = item.pattern.first * itemsize
        if (saved.byte_offset + first) % itemsize:
            return False  # a view of the mapping would be misaligned: take the staged path
        extent = (1 + sum((n - 1) * st for n, st in zip(item.overlap.shape, strides, strict=True))) * itemsize
        lo = first if oversized or not ranges else min(ranges[0][0], first)
        hi = first + extent if oversized or not ranges else max(ranges[-1][1], first + extent)
        name = self.metadata.files[saved.file].location
        try:
            mapped = self.storage.map_range(name, saved.byte_offset + lo, hi - lo)
        except OSError as exc:
            raise StorageError(f"cannot map data file {self.storage.describe(name)}: {exc}") from exc
        if mapped is None:
            return False
        what = self._what(item, saved)
        try:
            if ranges and oversized:
                self._verify_streamed(saved, ranges, item)
            elif ranges:
                raw = byte_view(mapped.tensor)
                self.verify_chunks(
                    saved.checksums,
                    saved.byte_length,
                    saved.file,
                    saved.byte_offset,
                    ranges,
                    [_Segment(lo, hi - lo, raw)],
                    what,
                )
                del raw  # release the buffer export, so that the mapping can be closed now
                runs = item.pattern.count * item.pattern.span * itemsize
                self.bytes_verify_extra += max(0, sum(b - a for a, b in ranges) - runs)
            source = mapped.tensor[first - lo : first - lo + extent].view(dtype).as_strided(item.overlap.shape, strides)
            with torch.no_grad():
                dest.copy_(source)
            del source
        finally:
            mapped.close()
        return True

    # ---- objects -------------------------------------------------------------------------------------

    def read_object_blob(self, key: str, entry: SavedObject) -> bytes:
        """The stored bytes of one ShardedObject cell, read whole and verified (file size, length, every
        checksum), not decoded."""
        what = f"object {key!r} at {list(entry.offset)}"
        self.check_file(entry.file)
        blob = bytearray(entry.byte_length)
        view = memoryview(blob)
        self.read([ReadRequest(self.metadata.files[entry.file].location, entry.byte_offset, view)], [what])
        ranges = [(0, entry.byte_length)] if entry.byte_length else []
        self.verify_chunks(
            entry.checksums,
            entry.byte_length,
            entry.file,
            entry.byte_offset,
            ranges,
            [_Segment(0, entry.byte_length, view)],
            what,
        )
        return bytes(blob)

    def close(self) -> None:
        """Release the staging buffers."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.scratch = torch.empty(0, dtype=torch.uint8)
