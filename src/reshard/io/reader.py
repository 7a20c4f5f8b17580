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
  (safetensors).

And one way for a group of items that share checksum chunks (:mod:`reshard.io.chunkgroups`): **streamed**,
the chunks the group touches are read once, in pieces through the staging buffer, each verified as its last
piece arrives, every piece copied into every item's destination that needs it. A group is streamed when
reading it item by item would read its chunks more than twice over (many small pieces in one chunk), and
when chunks are larger than half the staging buffer (a budget below four chunks) and some item is not a
direct read. So no chunk is read more than twice per load, whatever the budget.

Reads are batched so that object stores serve them concurrently (:meth:`Storage.read_ranges`); the
staging memory of a batch is at most ``buffer_bytes`` (the planner keeps every item within it).

A destination in GPU memory is read as a host destination would be, into a *proxy*: a contiguous host tensor
of the overlap's shape in the saved dtype, carved from a pinned arena (so a contiguous run is read straight
into it); full arenas are copied to the device on a side stream, the conversion to the destination's dtype
happening there, while the reads go on into the other arena (:class:`~reshard.io.device.DeviceFill`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from reshard.errors import StorageError
from reshard.geometry.boxes import Box, row_major_strides
from reshard.io.chunkgroups import ChunkGroup, chunk_groups, merged, stream_group, touched_ranges
from reshard.io.device import DeviceFill, is_host_bytes
from reshard.io.referencing import referencing
from reshard.io.verified import (
    DEFAULT_LOAD_MEMORY_BUDGET,
    MIN_LOAD_MEMORY_BUDGET,
    ReadBudget,
    Segment,
    VerifiedReader,
)
from reshard.state.dtypes import byte_view
from reshard.storage import ReadRequest, Storage

if TYPE_CHECKING:
    from reshard.metadata import Metadata, SavedBox, SavedObject
    from reshard.planning.load_plan import LoadPlan, ReadItem

__all__ = ["DEFAULT_LOAD_MEMORY_BUDGET", "MIN_LOAD_MEMORY_BUDGET", "ReadBudget", "ReadExecutor"]

_ALIGN = 64


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


@dataclass
class _Queue:
    """The reads of a :meth:`ReadExecutor.run` begun and not yet done: a batch of items whose reads land in
    the staging buffer, and a run of direct reads read chunk by chunk."""

    batch: list[_Pending] = field(default_factory=list)
    staged_bytes: int = 0
    direct: _DirectRun | None = None


class ReadExecutor(VerifiedReader):
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
        budget = ReadBudget.of(memory_budget_bytes, device=device or fill_all_through_host)
        super().__init__(
            referencing(storage), metadata, transfer_bytes=budget.max_read_bytes, stream_bytes=budget.stream_bytes
        )
        self.buffer_bytes = budget.staging_bytes
        self.arena_bytes = budget.arena_bytes
        self.fill_all_through_host = fill_all_through_host
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.bytes_verify_extra = 0
        """Bytes read (or, for mapped files, checksummed) beyond the planned reads, to verify whole chunks."""
        self.bytes_direct = 0
        """Bytes read straight into their destination (or its host proxy)."""
        self.bytes_to_device = 0
        """Bytes copied from host proxies into destinations outside host memory."""

    # ---- the plan ------------------------------------------------------------------------------------

    def _oversized(self) -> bool:
        """Whether checksum chunks are too large to be staged whole (see the module doc)."""
        return 2 * self.metadata.checksum_chunk_bytes > self.buffer_bytes

    def run(self, plan: LoadPlan, views: list[torch.Tensor], boxes: list[Box]) -> None:
        """Fill ``views[i]`` (holding ``boxes[i]``) from the reads of ``plan``, verifying every chunk used.
        Destinations outside host memory are complete when it returns (or raises)."""
        # Arenas of the budget's share; an executor made without ``device`` holds a read item per arena.
        fill = DeviceFill(self.arena_bytes or self.transfer_bytes) if self._any_through_host(views) else None
        queue = _Queue()
        chunk = self.metadata.checksum_chunk_bytes
        try:
            for group in chunk_groups(plan.items, lambda item: touched_ranges(item, self._saved(item), chunk)):
                for item in group.items:
                    self.check_file(item.file)
                if self._streamed(group, views, boxes):
                    self._drain(queue)
                    self._stream(group, views, boxes, fill)
                    continue
                for item, ranges in zip(group.items, group.ranges, strict=True):
                    dest = self._destination(item, views, boxes)
                    if fill is not None and self._through_host(dest):
                        dtype = self.metadata.tensors[item.key].torch_dtype
                        if not fill.has_room(dest, dtype):  # finish the arena's reads, send it, take the other one
                            self._drain(queue)
                            fill.flush()
                        dest = fill.proxy(dest, dtype)
                    self._enqueue(queue, item, dest, ranges)
            self._drain(queue)
        except BaseException:
            if fill is not None:
                fill.abandon()
            raise
        if fill is not None:
            fill.close()
            self.bytes_to_device += fill.bytes_copied

    def _saved(self, item: ReadItem) -> SavedBox:
        return self.metadata.tensors[item.key].boxes[item.saved_index]

    @staticmethod
    def _destination(item: ReadItem, views: list[torch.Tensor], boxes: list[Box]) -> torch.Tensor:
        target = views[item.target].detach()
        return target[item.overlap.relative_to(boxes[item.target])] if target.ndim else target

    def _enqueue(self, queue: _Queue, item: ReadItem, dest: torch.Tensor, ranges: list[tuple[int, int]]) -> None:
        """Begin reading ``item`` into ``dest``: into the batch, the direct run, or (mapped) at once."""
        saved = self._saved(item)
        pending = self._prepare(item, saved, dest, ranges)
        if pending is None:
            return  # read and copied already (mapped)
        if self._by_chunk(pending):
            if queue.batch:
                self._flush(queue.batch, queue.staged_bytes)
                queue.batch, queue.staged_bytes = [], 0
            start = item.pattern.first * item.itemsize
            ((lo, hi),) = pending.ranges
            if queue.direct is not None and queue.direct.continued_by(saved, start):
                queue.direct.pieces.append((start, byte_view(pending.dest)))
                queue.direct.hi = hi
                return
            if queue.direct is not None:
                self._read_direct_by_chunk(queue.direct)
            queue.direct = _DirectRun(saved, self._what(item, saved), [(start, byte_view(pending.dest))], lo, hi)
            return
        need = -(-pending.nbytes // _ALIGN) * _ALIGN
        if queue.batch and queue.staged_bytes + need > self.buffer_bytes:
            self._flush(queue.batch, queue.staged_bytes)
            queue.batch, queue.staged_bytes = [], 0
        pending.offset = queue.staged_bytes
        queue.batch.append(pending)
        queue.staged_bytes += need

    def _drain(self, queue: _Queue) -> None:
        """Complete every read begun: the batch, the direct run."""
        if queue.direct is not None:
            self._read_direct_by_chunk(queue.direct)
            queue.direct = None
        if queue.batch:
            self._flush(queue.batch, queue.staged_bytes)
            queue.batch, queue.staged_bytes = [], 0

    def _through_host(self, dest: torch.Tensor) -> bool:
        """Whether ``dest`` is filled through a host proxy."""
        return self.fill_all_through_host or dest.device.type != "cpu"

    def _any_through_host(self, views: list[torch.Tensor]) -> bool:
        return any(self._through_host(view) for view in views)

    def _direct(self, item: ReadItem, dest: torch.Tensor) -> bool:
        """Whether ``item`` is read straight into ``dest`` (or into its host proxy): one run of the saved dtype
        into contiguous host memory holding the stored bytes as they are."""
        pattern = item.pattern
        if pattern.count != 1 or pattern.span != pattern.needed:
            return False
        dtype = self.metadata.tensors[item.key].torch_dtype
        return self._through_host(dest) or (dest.dtype == dtype and is_host_bytes(dest))

    def _streamed(self, group: ChunkGroup, views: list[torch.Tensor], boxes: list[Box]) -> bool:
        """Whether a group's chunks are read once for all its items (see :mod:`reshard.io.chunkgroups`): when
        reading them item by item would read them more than twice over, and when chunks are too large to be
        staged whole and some item is not a direct read (it reads through the stream, once, not its runs after
        streaming its chunks to verify them)."""
        if not group.ranges[0]:
            return False  # no checksums
        if group.touched_bytes > 2 * group.union_bytes:
            return True
        return self._oversized() and not all(
            self._direct(item, self._destination(item, views, boxes)) for item in group.items
        )

    def _stream(self, group: ChunkGroup, views: list[torch.Tensor], boxes: list[Box], fill: DeviceFill | None) -> None:
        """Read a group's chunks once (:func:`~reshard.io.chunkgroups.stream_group`), in parts that fit the
        arena of proxies when destinations are outside host memory."""
        dtype = self.metadata.tensors[group.items[0].key].torch_dtype
        members: list[tuple[ReadItem, torch.Tensor]] = []
        ranges: list[tuple[int, int]] = []
        for item, item_ranges in zip(group.items, group.ranges, strict=True):
            dest = self._destination(item, views, boxes)
            if fill is not None and self._through_host(dest):
                if not fill.has_room(dest, dtype):
                    self._stream_members(members, ranges, dtype)
                    members, ranges = [], []
                    fill.flush()
                dest = fill.proxy(dest, dtype)
            members.append((item, dest))
            ranges.extend(item_ranges)
        self._stream_members(members, ranges, dtype)

    def _stream_members(
        self, members: list[tuple[ReadItem, torch.Tensor]], ranges: list[tuple[int, int]], dtype: torch.dtype
    ) -> None:
        if not members:
            return
        item = members[0][0]
        saved = self._saved(item)
        union = merged(ranges)
        name = self.metadata.files[saved.file].location
        nbytes = max(2 * dtype.itemsize, self.buffer_bytes)
        self._staging(nbytes)
        self.bytes_verified += stream_group(
            members,
            union,
            saved,
            dtype=dtype,
            chunk_bytes=self.metadata.checksum_chunk_bytes,
            name=name,
            where=self.storage.describe(name),
            what=self._what(item, saved),
            buffer=self.buffer[:nbytes],
            read=self.read,
        )
        planned = sum(member.bytes_read for member, _ in members)
        self.bytes_verify_extra += max(0, sum(hi - lo for lo, hi in union) - planned)

    def _prepare(
        self, item: ReadItem, saved: SavedBox, dest: torch.Tensor, ranges: list[tuple[int, int]]
    ) -> _Pending | None:
        """Choose how to read ``item`` (see the module doc), whose reads touch the chunks ``ranges``; a mapped
        item is read here and then. (An item of a checksummed box that is not a direct read never comes here
        when the chunks are too large to stage: it is streamed.)"""
        pattern = item.pattern
        itemsize = item.itemsize
        checked = bool(saved.checksums)
        oversized = checked and self._oversized()
        if self._direct(item, dest):
            start = pattern.first * itemsize
            end = start + pattern.span * itemsize
            extra = 0 if oversized or not ranges else (start - ranges[0][0]) + (ranges[-1][1] - end)
            return _Pending(item, saved, dest, "direct", 0, extra, ranges, streamed=oversized)
        if self._copy_mapped(item, saved, dest, ranges):
            return None
        if checked:
            region_start = ranges[0][0] - ranges[0][0] % itemsize
            region_end = ranges[-1][1]
            nbytes = -(-(region_end - region_start) // itemsize) * itemsize
            return _Pending(item, saved, dest, "chunks", 0, nbytes, ranges, region_start)
        return _Pending(item, saved, dest, "runs", 0, pattern.count * pattern.span * itemsize, [])

    def _what(self, item: ReadItem, saved: SavedBox) -> str:
        return f"tensor {item.key!r} box at {list(saved.offset)}"

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
                segments.append(Segment(chunk_lo, start - chunk_lo, staging[chunk_lo - lo : head]))
            position = max(chunk_lo, start)
            while position < min(chunk_hi, end):
                while position >= piece_start + len(piece):
                    piece_start, piece = next(pieces)
                b = min(chunk_hi, end, piece_start + len(piece))
                segments.append(Segment(position, b - position, piece[position - piece_start : b - piece_start]))
                position = b
            if chunk_hi > end:
                a = max(chunk_lo, end)
                segments.append(Segment(a, chunk_hi - a, staging[head + a - end : head + tail]))
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
                    Segment(pending.ranges[0][0], head, raw[:head]),
                    Segment(start, end - start, dest),
                    Segment(end, tail, raw[head : head + tail]),
                ]
            else:  # oversized chunks: the parts outside the run are streamed
                lo, hi = pending.ranges[0][0], pending.ranges[-1][1]
                segments = [Segment(lo, start - lo), Segment(start, end - start, dest), Segment(end, hi - end)]
                self.bytes_verify_extra += (start - lo) + (hi - end)
            segments = [s for s in segments if s.length]
            self.verify_chunks(
                saved.checksums, saved.byte_length, saved.file, saved.byte_offset, pending.ranges, segments, what
            )
            return
        if pending.kind == "chunks":
            raw = staging[pending.offset : pending.offset + pending.nbytes]
            segment = Segment(pending.region_start, pending.nbytes, raw)
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

    def _copy_mapped(self, item: ReadItem, saved: SavedBox, dest: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
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
        lo = min(ranges[0][0], first) if ranges else first
        hi = max(ranges[-1][1], first + extent) if ranges else first + extent
        name = self.metadata.files[saved.file].location
        try:
            mapped = self.storage.map_range(name, saved.byte_offset + lo, hi - lo)
        except OSError as exc:
            raise StorageError(f"cannot map data file {self.storage.describe(name)}: {exc}") from exc
        if mapped is None:
            return False
        what = self._what(item, saved)
        try:
            if ranges:
                raw = byte_view(mapped.tensor)
                self.verify_chunks(
                    saved.checksums,
                    saved.byte_length,
                    saved.file,
                    saved.byte_offset,
                    ranges,
                    [Segment(lo, hi - lo, raw)],
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
            [Segment(0, entry.byte_length, view)],
            what,
        )
        return bytes(blob)

    def close(self) -> None:
        """Release the staging buffers."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.scratch = torch.empty(0, dtype=torch.uint8)
