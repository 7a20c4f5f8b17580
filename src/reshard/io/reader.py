"""The read executor: one rank's planned reads, performed, verified and copied into place.

Every byte a load uses is verified against the checksum of its chunk, and the check is made on the very
bytes that are used: a chunk is read whole, its checksum computed over what was read (by the one chunk
verifier, :mod:`reshard.io.chunkcheck`), and only those bytes are copied into the destination. A read touching
part of a chunk therefore also reads the rest of that chunk (the extra bytes are counted in
``bytes_verify_extra``, apart from the planned ``bytes_read``).

Each item of the plan (one overlap of a target box with a saved box) is read in one of four modes, small
functions over a frozen :class:`~reshard.io.readmodes.BoxRead` (:mod:`reshard.io.readmodes`): **direct**
(the run straight into its destination), **mapped** (local files, from a mapping), **chunks** (the touched
chunks into the read buffer, then one strided copy), **runs** (sources without checksums). This module
chooses the mode, batches reads and keeps the buffers.

And one way for a group of items that share checksum chunks (:mod:`reshard.io.chunkgroups`): **streamed**,
the chunks the group touches are read once, in pieces through the read buffer, each verified as its last
piece arrives, every piece copied into every item's destination that needs it. A group is streamed when
reading it item by item would read its chunks more than twice over (many small pieces in one chunk), and
when chunks are larger than half the read buffer (a budget below four chunks) and some item is not a
direct read. So no chunk is read more than twice per load, whatever the budget.

Reads are batched so that object stores serve them concurrently (:meth:`Storage.read_ranges`); the
read buffer of a batch holds at most ``read_buffer_bytes`` (the planner keeps every item within it).

A destination in GPU memory is read as a host destination would be, into a *proxy*: a contiguous host tensor
of the overlap's shape in the saved dtype, carved from a pinned arena (so a contiguous run is read straight
into it); full arenas are copied to the device on a side stream, the conversion to the destination's dtype
happening there, while the reads go on into the other arena (:class:`~reshard.io.device.DeviceFill`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from reshard.geometry.boxes import Box
from reshard.io.chunkgroups import ChunkGroup, chunk_groups, merged, stream_group, touched_ranges
from reshard.io.device import DeviceFill
from reshard.io.readmodes import (
    BoxRead,
    BufferedRead,
    DirectRun,
    ReadCounts,
    buffered,
    finish,
    is_direct,
    read_direct_run,
    read_mapped,
    requests,
)
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


@dataclass(frozen=True, slots=True)
class _Queue:
    """The reads of a :meth:`ReadExecutor.run` begun and not yet done: a batch of reads whose bytes land in
    the read buffer (``buffered_bytes`` of it taken), and a run of direct reads read chunk by chunk."""

    batch: tuple[BufferedRead, ...] = ()
    buffered_bytes: int = 0
    direct: DirectRun | None = None


class ReadExecutor(VerifiedReader):
    """Performs one rank's reads (see the module doc). Not thread-safe; one per load.

    Memory: the executor's buffers never hold more than ``memory_budget_bytes`` at once: half of it is the
    read buffer (reads that do not land in their destination, the parts of chunks outside a direct read),
    the rest the largest mapped window of a local file (whose pages count in the resident set while mapped)
    or an object store's response bodies in flight, and the scratch piece through which oversized chunks are
    streamed (:class:`ReadBudget`). The planner keeps every read item within ``ReadBudget.max_read_bytes``,
    so that holds whatever the tensor sizes.

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
        super().__init__(storage, metadata, transfer_bytes=budget.max_read_bytes, stream_bytes=budget.stream_bytes)
        self.read_buffer_bytes = budget.read_buffer_bytes
        self.arena_bytes = budget.arena_bytes
        self.fill_all_through_host = fill_all_through_host
        self.read_buffer = torch.empty(0, dtype=torch.uint8)
        self.bytes_verify_extra = 0
        """Bytes read (or, for mapped files, checksummed) beyond the planned reads, to verify whole chunks."""
        self.bytes_direct = 0
        """Bytes read straight into their destination (or its host proxy)."""
        self.bytes_to_device = 0
        """Bytes copied from host proxies into destinations outside host memory."""

    # ---- the plan ------------------------------------------------------------------------------------

    def _oversized(self) -> bool:
        """Whether checksum chunks are too large for two to fit the read buffer (see the module doc)."""
        return 2 * self.metadata.checksum_chunk_bytes > self.read_buffer_bytes

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
                    queue = self._drain(queue)
                    self._stream(group, views, boxes, fill)
                    continue
                for item, ranges in zip(group.items, group.ranges, strict=True):
                    dest = self._destination(item, views, boxes)
                    if fill is not None and self._through_host(dest):
                        dtype = self.metadata.tensors[item.key].torch_dtype
                        if not fill.has_room(dest, dtype):  # finish the arena's reads, send it, take the other one
                            queue = self._drain(queue)
                            fill.flush()
                        dest = fill.proxy(dest, dtype)
                    queue = self._enqueue(queue, self._box_read(item, dest, ranges))
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

    def _box_read(self, item: ReadItem, dest: torch.Tensor, ranges: list[tuple[int, int]]) -> BoxRead:
        """``item`` resolved against its stored box, its reads touching the chunks ``ranges``, into ``dest``."""
        saved = self._saved(item)
        stored = self.stored(saved.checksums, saved.byte_length, saved.file, saved.byte_offset, _what(item, saved))
        dtype = self.metadata.tensors[item.key].torch_dtype
        return BoxRead(item, stored, tuple(ranges), dtype, saved.shape, dest)

    @staticmethod
    def _destination(item: ReadItem, views: list[torch.Tensor], boxes: list[Box]) -> torch.Tensor:
        target = views[item.target].detach()
        return target[item.overlap.relative_to(boxes[item.target])] if target.ndim else target

    def _count(self, counts: ReadCounts) -> None:
        self.bytes_verified += counts.verified
        self.bytes_direct += counts.direct
        self.bytes_verify_extra += counts.extra

    def _enqueue(self, queue: _Queue, read: BoxRead) -> _Queue:
        """Begin ``read``: read and copy it at once (mapped), or add it to the direct run or the batch; the
        queue then."""
        direct = is_direct(read.item, read.dtype, read.dest, self._through_host(read.dest))
        if not direct:
            counts = read_mapped(read, self)
            if counts is not None:
                self._count(counts)
                return queue
        planned = buffered(read, direct=direct, oversized=self._oversized())
        if self._by_chunk(planned):
            queue = self._flush_batch(queue)
            continued = queue.direct.continued(read) if queue.direct is not None else None
            if continued is not None:
                return dataclasses.replace(queue, direct=continued)
            self._drain(queue)
            return _Queue(direct=DirectRun.of(read))
        need = -(-planned.nbytes // _ALIGN) * _ALIGN
        if queue.batch and queue.buffered_bytes + need > self.read_buffer_bytes:
            queue = self._flush_batch(queue)
        planned = dataclasses.replace(planned, offset=queue.buffered_bytes)
        return dataclasses.replace(queue, batch=(*queue.batch, planned), buffered_bytes=queue.buffered_bytes + need)

    def _drain(self, queue: _Queue) -> _Queue:
        """Complete every read begun: the direct run, the batch; an empty queue."""
        if queue.direct is not None:
            run = queue.direct
            outside = self._buffer(run.start - run.lo + run.hi - run.end)
            self._count(read_direct_run(run, outside, self))
        self._flush_batch(queue)
        return _Queue()

    def _flush_batch(self, queue: _Queue) -> _Queue:
        """Serve the batch's requests together, then verify and copy each read; the queue without it."""
        if not queue.batch:
            return queue
        self._buffer(queue.buffered_bytes)
        batch_requests: list[ReadRequest] = []
        whats: list[str] = []
        for planned in queue.batch:
            of_read = requests(planned, self.read_buffer)
            batch_requests += of_read
            whats += [planned.read.stored.what] * len(of_read)
        self.read(batch_requests, whats)
        for planned in queue.batch:
            self._count(finish(planned, self.read_buffer, self))
        return dataclasses.replace(queue, batch=(), buffered_bytes=0)

    def _through_host(self, dest: torch.Tensor) -> bool:
        """Whether ``dest`` is filled through a host proxy."""
        return self.fill_all_through_host or dest.device.type != "cpu"

    def _any_through_host(self, views: list[torch.Tensor]) -> bool:
        return any(self._through_host(view) for view in views)

    def _streamed(self, group: ChunkGroup, views: list[torch.Tensor], boxes: list[Box]) -> bool:
        """Whether a group's chunks are read once for all its items (see :mod:`reshard.io.chunkgroups`): when
        reading them item by item would read them more than twice over, and when chunks are too large to be
        held whole and some item is not a direct read (it reads through the stream, once, not its runs after
        streaming its chunks to verify them)."""
        if not group.ranges[0]:
            return False  # no checksums
        if group.touched_bytes > 2 * group.union_bytes:
            return True
        dtype = self.metadata.tensors[group.items[0].key].torch_dtype
        return self._oversized() and not all(
            is_direct(item, dtype, dest, self._through_host(dest))
            for item in group.items
            for dest in [self._destination(item, views, boxes)]
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
        nbytes = max(2 * dtype.itemsize, self.read_buffer_bytes)
        self._buffer(nbytes)
        self.bytes_verified += stream_group(
            members,
            union,
            saved,
            dtype=dtype,
            chunk_bytes=self.metadata.checksum_chunk_bytes,
            name=name,
            where=self.storage.describe(name),
            what=_what(item, saved),
            buffer=self.read_buffer[:nbytes],
            read=self.read,
        )
        planned = sum(member.bytes_read for member, _ in members)
        self.bytes_verify_extra += max(0, sum(hi - lo for lo, hi in union) - planned)

    def _by_chunk(self, planned: BufferedRead) -> bool:
        """Whether a direct read goes chunk by chunk, each chunk verified as soon as it is read (while its
        bytes are still in the CPU's cache: a quarter less time than verifying after the whole read, on
        the benchmark machine), rather than in a batch: where the storage serves batches one read at a
        time anyway (local files)."""
        return (
            not self.storage.concurrent_reads
            and planned.mode == "direct"
            and len(planned.read.ranges) == 1
            and not planned.streamed
        )

    def _buffer(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the read buffer, allocated once at the batch limit (planning keeps every
        item within it), so that growing batches do not leave a trail of freed buffers in the heap."""
        if self.read_buffer.numel() < nbytes:
            self.read_buffer = torch.empty(max(nbytes, self.read_buffer_bytes), dtype=torch.uint8)
        return byte_view(self.read_buffer[:nbytes]) if nbytes else memoryview(b"")

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
        """Release the read buffer and the scratch buffer, and close the sibling checkpoints' storages this
        reader opened."""
        self.read_buffer = torch.empty(0, dtype=torch.uint8)
        super().close()


def _what(item: ReadItem, saved: SavedBox) -> str:
    """How messages name the stored box an item reads."""
    return f"tensor {item.key!r} box at {list(saved.offset)}"
