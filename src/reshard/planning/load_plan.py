"""Load planning: which saved bytes each target box needs, and how to read them.

Pure: given the checkpoint's metadata and the boxes a rank wants (on its own, possibly different,
layout), return the reads. Each target box is intersected with the saved boxes of its key; every overlap
becomes one :class:`ReadItem`, read with the fewest requests that keep the read amplification within the
bound (see :func:`reshard.boxes.read_pattern`).
"""

from __future__ import annotations

from dataclasses import dataclass

from reshard.boxes import Box, ReadPattern, read_pattern
from reshard.metadata import Metadata

__all__ = ["DEFAULT_MAX_READ_AMPLIFICATION", "LoadPlan", "ReadItem", "TargetPiece", "plan_load"]

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


def plan_load(
    metadata: Metadata,
    targets: list[TargetPiece],
    *,
    max_read_amplification: float = DEFAULT_MAX_READ_AMPLIFICATION,
) -> LoadPlan:
    """The reads that fill every target piece from the checkpoint.

    The caller has checked that every target's key exists with a matching global shape; saved boxes
    tile their tensor (validated when the metadata was parsed), so every target element is covered by
    exactly one read.
    """
    items: list[ReadItem] = []
    for target_index, target in enumerate(targets):
        tensor = metadata.tensors[target.key]
        itemsize = tensor.torch_dtype.itemsize
        for saved_index, saved in enumerate(tensor.boxes):
            overlap = target.box.intersect(saved.box)
            if overlap is None:
                continue
            pattern = read_pattern(saved.box, overlap, max_amplification=max_read_amplification)
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
