"""Read items that share checksum chunks: found in a load's plan, and read through one stream.

A load verifies every checksum chunk a read touches, whole. Several read items can touch one chunk: the
planner cuts an overlap into items that keep within the memory budget (smaller than a chunk when the budget is
below four chunks), and a template of many small pieces (rows, flat ranges, cells of a read-once exchange)
makes many items in one chunk. Read item by item, such a chunk would be read and verified once per item.

:func:`chunk_groups` walks the plan (sorted by file and offset) and gathers consecutive items of one stored
box whose touched chunks overlap; :func:`stream_group` then reads the chunks such a group touches **once**,
in pieces of the read buffer, in order: each piece's bytes are added to the running checksum of their chunk
(:func:`reshard.io.chunkcheck.feed`; a chunk is checked when its last byte has been read) and copied, converting
the dtype, into every item's destination that needs them. So storage serves each touched chunk once, and
every byte a load uses is verified on the very bytes it uses (copied before its chunk's last piece arrives: a
mismatch fails the load, as a run read straight into its destination would).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from reshard.geometry.boxes import Box, flat_range_boxes, row_major_strides
from reshard.io.checksums import run_starts, touched_chunks
from reshard.io.chunkcheck import ChunkProgress, StoredChunks, feed
from reshard.state.dtypes import byte_view
from reshard.storage import ReadRequest

if TYPE_CHECKING:
    from reshard.metadata import SavedBox
    from reshard.planning.load_plan import ReadItem

__all__ = ["ChunkGroup", "chunk_groups", "merged", "stream_group", "touched_ranges"]

Ranges = list[tuple[int, int]]
"""Box-relative byte ranges ``[lo, hi)`` of whole checksum chunks, ascending."""


def touched_ranges(item: ReadItem, saved: SavedBox, chunk_bytes: int) -> Ranges:
    """The chunks of ``saved`` that ``item``'s reads touch (none for a box without checksums)."""
    if not saved.checksums:
        return []
    pattern = item.pattern
    starts = run_starts(pattern.first, pattern.lead_shape, pattern.lead_strides) * item.itemsize
    return touched_chunks(starts, pattern.span * item.itemsize, chunk_bytes, saved.byte_length)


def merged(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """The union of ``ranges``, as ascending disjoint ranges (touching ones joined)."""
    out: Ranges = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


@dataclass
class ChunkGroup:
    """Consecutive read items of one stored box whose touched chunks overlap (one item: none shared)."""

    items: list[ReadItem] = field(default_factory=list)
    ranges: list[Ranges] = field(default_factory=list)
    """The touched chunks of each item."""
    end: int = 0
    """The end of the last chunk any item touches."""

    @property
    def touched_bytes(self) -> int:
        """What reading item by item reads to verify: each item's touched chunks."""
        return sum(hi - lo for ranges in self.ranges for lo, hi in ranges)

    @property
    def union_bytes(self) -> int:
        """What reading the group once reads: the chunks any item touches."""
        return sum(hi - lo for lo, hi in merged(r for ranges in self.ranges for r in ranges))


def chunk_groups(items: Iterable[ReadItem], touched: Callable[[ReadItem], Ranges]) -> Iterator[ChunkGroup]:
    """The items of a plan (sorted by file and offset, as :func:`~reshard.planning.load_plan.plan_load` sorts
    them) in groups: an item joins the group before it when it reads the same stored box and its first touched
    chunk lies before the group's last one ends. Items without checksums are groups of their own."""
    group: ChunkGroup | None = None
    for item in items:
        ranges = touched(item)
        if (
            group is not None
            and ranges
            and group.ranges[-1]
            and (group.items[-1].key, group.items[-1].saved_index) == (item.key, item.saved_index)
            and ranges[0][0] < group.end
        ):
            group.items.append(item)
            group.ranges.append(ranges)
            group.end = max(group.end, ranges[-1][1])
            continue
        if group is not None:
            yield group
        group = ChunkGroup([item], [ranges], ranges[-1][1] if ranges else 0)
    if group is not None:
        yield group


@dataclass(frozen=True, slots=True)
class _Member:
    """One item of a streamed group: its overlap in the stored box's coordinates, the box-relative elements it
    spans, and where it goes."""

    overlap: Box
    first: int
    end: int
    dest: torch.Tensor


def stream_group(
    members: list[tuple[ReadItem, torch.Tensor]],
    ranges: Ranges,
    saved: SavedBox,
    *,
    dtype: torch.dtype,
    chunk_bytes: int,
    name: str,
    where: str,
    what: str,
    buffer: torch.Tensor,
    read: Callable[[list[ReadRequest], list[str]], None],
) -> int:
    """Read the chunks ``ranges`` of stored box ``saved`` (of data file ``name``, described as ``where``) once,
    piece by piece through ``buffer`` (uint8, at least two elements long), verify each chunk as its last piece
    arrives (:func:`~reshard.io.chunkcheck.feed`), and copy every member item's elements into its destination.
    Returns the bytes verified.

    Raises:
        CorruptCheckpointError: a chunk's checksum does not match (the destinations then hold bytes of it).
    """
    itemsize = dtype.itemsize
    strides = row_major_strides(saved.shape)
    pending = []
    for item, dest in members:
        overlap = Box(tuple(o - s for o, s in zip(item.overlap.offset, saved.offset, strict=True)), item.overlap.shape)
        first = sum(o * st for o, st in zip(overlap.offset, strides, strict=True))
        last = sum((o + n - 1) * st for o, n, st in zip(overlap.offset, overlap.shape, strides, strict=True))
        pending.append(_Member(overlap, first, last + 1, dest))
    pending.sort(key=lambda m: m.first)
    piece = max(itemsize, (buffer.numel() - itemsize) // itemsize * itemsize)
    stored = StoredChunks(what, name, where, saved.byte_offset, saved.byte_length, saved.checksums, chunk_bytes)
    progress = ChunkProgress()
    verified = 0
    active: list[_Member] = []
    upcoming = iter(pending)
    following = next(upcoming, None)
    for lo, hi in ranges:
        position = lo
        while position < hi:
            base = position // itemsize * itemsize
            stop = min(hi, base + piece)
            raw = buffer[position - base : stop - base]
            read([ReadRequest(name, saved.byte_offset + position, byte_view(raw))], [what])
            progress, done = feed(stored, progress, position, byte_view(raw))
            verified += done
            e0, e1 = -(-position // itemsize), stop // itemsize
            while following is not None and following.first < e1:
                active.append(following)
                following = next(upcoming, None)
            if e1 > e0 and active:
                elements = buffer[: (stop - base) // itemsize * itemsize].view(dtype)
                _copy_out(active, elements, base // itemsize, e0, e1, saved.shape, strides)
            active = [m for m in active if m.end > e1]
            position = stop
    return verified


def _copy_out(
    active: list[_Member],
    elements: torch.Tensor,
    origin: int,
    e0: int,
    e1: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
) -> None:
    """Copy the elements ``[e0, e1)`` of the stored box (``elements[i]`` is element ``origin + i``) that the
    active members need into their destinations."""
    boxes = [box for box, _ in flat_range_boxes(shape, e0, e1)]
    for member, box in itertools.product(active, boxes):
        if member.end <= e0 or member.first >= e1:
            continue
        part = box.intersect(member.overlap)
        if part is None:
            continue
        start = sum(o * st for o, st in zip(part.offset, strides, strict=True)) - origin
        source = elements.as_strided(part.shape, strides, elements.storage_offset() + start)
        with torch.no_grad():
            member.dest[part.relative_to(member.overlap)].copy_(source)
