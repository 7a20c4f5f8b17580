"""Load planning: which saved bytes each target box needs, and how to read them.

Pure: given the checkpoint's metadata and the boxes a rank wants (on its own, possibly different,
layout), return the reads. Each target box is intersected with the saved boxes of its key; every overlap
becomes one :class:`ReadItem`, read with the fewest requests that keep the read amplification within the
bound (see :func:`reshard.boxes.read_pattern`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from reshard.boxes import Box, ReadPattern, read_pattern, row_major_strides
from reshard.metadata import Metadata

__all__ = [
    "DEFAULT_MAX_READ_AMPLIFICATION",
    "DEFAULT_MAX_READ_BYTES",
    "LoadPlan",
    "ReadItem",
    "TargetPiece",
    "plan_load",
]

DEFAULT_MAX_READ_AMPLIFICATION = 1.10
"""Bytes read / bytes needed allowed when merging strided runs into fewer, larger reads."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetPiece:
    """A box a rank wants filled: ``box`` of global tensor ``key``."""

    key: str
    box: Box


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadItem:
    """Fill ``overlap`` (global coordinates) of target piece ``target`` from saved box ``saved_index`` of
    ``key``, which lies at ``byte_offset`` of file ``file``; ``pattern`` says which bytes to read."""

    target: int
    key: str
    overlap: Box
    saved_index: int
    saved_box: Box
    file: int
    byte_offset: int
    itemsize: int
    pattern: ReadPattern

    @property
    def bytes_needed(self) -> int:
        return self.pattern.needed * self.itemsize

    @property
    def bytes_read(self) -> int:
        return self.pattern.read_elements * self.itemsize

    @property
    def requests(self) -> int:
        return self.pattern.count


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPlan:
    """All reads of one rank, sorted by file and offset."""

    items: tuple[ReadItem, ...]

    @property
    def bytes_needed(self) -> int:
        return sum(i.bytes_needed for i in self.items)

    @property
    def bytes_read(self) -> int:
        return sum(i.bytes_read for i in self.items)

    @property
    def requests(self) -> int:
        return sum(i.requests for i in self.items)


DEFAULT_MAX_READ_BYTES = 64 * 1024 * 1024
"""Largest single read item: bigger overlaps are split along their leading axes, which bounds the
staging memory of a load (and makes reads of object stores concurrent)."""


def _split_overlap(
    saved: Box, overlap: Box, itemsize: int, max_amplification: float, max_bytes: int, chunk_bytes: int = 0
) -> list[tuple[Box, ReadPattern]]:
    """Cut ``overlap`` into consecutive slabs along its first axes so that each slab's read is at most
    ``max_bytes`` (a slab of one element row is never cut further)."""
    pattern = read_pattern(saved, overlap, max_amplification=max_amplification)
    strides = row_major_strides(saved.shape)
    extent_elements = 1 + sum((n - 1) * st for n, st in zip(overlap.shape, strides, strict=True))
    # Bounded by both what is read and the range it spans (what a memory-mapped copy touches).
    if max(pattern.read_elements, extent_elements) * itemsize <= max_bytes:
        return [(overlap, pattern)]
    axis = next((a for a, extent in enumerate(overlap.shape) if extent > 1), None)
    if axis is None:
        return [(overlap, pattern)]
    extent = overlap.shape[axis]
    parts = min(extent, -(-max(pattern.read_elements, extent_elements) * itemsize // max_bytes))
    step = -(-extent // parts)
    row_bytes = math.prod(overlap.shape[axis + 1 :]) * itemsize
    whole_rows = overlap.shape[axis + 1 :] == saved.shape[axis + 1 :] and all(n == 1 for n in overlap.shape[:axis])
    if chunk_bytes and whole_rows and row_bytes:
        # Slabs of whole rows are contiguous: make them whole checksum chunks, so that every chunk a
        # slab covers can be verified.
        unit = math.lcm(row_bytes, chunk_bytes) // row_bytes
        if unit * row_bytes <= max_bytes:
            step = max(unit, (max_bytes // (unit * row_bytes)) * unit)
    out = []
    for start in range(0, extent, step):
        size = min(step, extent - start)
        offset = tuple(o + start if a == axis else o for a, o in enumerate(overlap.offset))
        shape = tuple(size if a == axis else n for a, n in enumerate(overlap.shape))
        out.extend(_split_overlap(saved, Box(offset, shape), itemsize, max_amplification, max_bytes, chunk_bytes))
    return out


def plan_load(
    metadata: Metadata,
    targets: list[TargetPiece],
    *,
    max_read_amplification: float = DEFAULT_MAX_READ_AMPLIFICATION,
    max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
) -> LoadPlan:
    """The reads that fill every target piece from the checkpoint.

    The caller has checked that every target's key exists with a matching global shape; saved boxes
    tile their tensor (validated when the metadata was parsed), so every target element is covered by
    exactly one read. No read item is larger than ``max_read_bytes`` unless a single row of its overlap
    already is.
    """
    items: list[ReadItem] = []
    for target_index, target in enumerate(targets):
        tensor = metadata.tensors[target.key]
        itemsize = tensor.torch_dtype.itemsize
        for saved_index, saved in enumerate(tensor.boxes):
            whole = target.box.intersect(saved.box)
            if whole is None:
                continue
            for overlap, pattern in _split_overlap(
                saved.box, whole, itemsize, max_read_amplification, max_read_bytes, metadata.checksum_chunk_bytes
            ):
                items.append(
                    ReadItem(
                        target=target_index,
                        key=target.key,
                        overlap=overlap,
                        saved_index=saved_index,
                        saved_box=saved.box,
                        file=saved.file,
                        byte_offset=saved.byte_offset,
                        itemsize=itemsize,
                        pattern=pattern,
                    )
                )
    items.sort(key=lambda i: (i.file, i.byte_offset + i.pattern.first * i.itemsize))
    return LoadPlan(items=tuple(items))
