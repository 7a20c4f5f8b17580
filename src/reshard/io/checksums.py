"""Chunked CRC-32C: how stored bytes are checksummed, and which chunks a read touches.

Every stored box and object blob is checksummed in consecutive pieces of ``chunk_bytes`` bytes counted
from its first byte (the last piece may be shorter): docs/format.md section 6. This module is the one
implementation of that rule: computing the checksums while writing (one shot, or streamed in pieces of
any size), and, for a load, the chunks that a set of byte runs touches (every such chunk is read whole and
verified, so that every byte a load uses has been checked against its chunk's checksum).
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
import numpy as np
import numpy.typing as npt

__all__ = [
    "CHECKSUM_ALGORITHM",
    "ChunkedChecksum",
    "chunk_checksums",
    "crc32c_of",
    "run_starts",
    "touched_chunks",
]

CHECKSUM_ALGORITHM = "crc32c"
"""The checksum of every chunk: CRC-32C (Castagnoli), as the ``crc32c`` package computes it."""


def crc32c_of(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC-32C of ``data``, continuing from ``value`` (the CRC of the bytes before it)."""
    return int(crc32c.crc32c(data, value))


def chunk_checksums(data: memoryview, chunk_bytes: int) -> tuple[int, ...]:
    """The checksum of every ``chunk_bytes`` piece of ``data`` (none for empty data)."""
    view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
    return tuple(crc32c_of(view[start : start + chunk_bytes]) for start in range(0, len(view), chunk_bytes))


class ChunkedChecksum:
    """The chunk checksums of a byte stream fed in pieces of any size (a data file written in slabs)."""

    def __init__(self, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self.values: list[int] = []
        self._value = 0
        self._filled = 0

    def update(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while view:
            take = min(self.chunk_bytes - self._filled, len(view))
            self._value = crc32c_of(view[:take], self._value)
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_bytes:
                self.values.append(self._value)
                self._value, self._filled = 0, 0

    def finish(self) -> tuple[int, ...]:
        """All the checksums, the last (shorter) chunk included; the stream is then complete."""
        if self._filled:
            self.values.append(self._value)
            self._value, self._filled = 0, 0
        return tuple(self.values)


def run_starts(first: int, lead_shape: Sequence[int], lead_strides: Sequence[int]) -> npt.NDArray[np.int64]:
    """The start of every run of a read pattern (``first + index . lead_strides`` over ``lead_shape``, in
    row-major order of the index), as one integer array."""
    starts = np.asarray([first], dtype=np.int64)
    for size, stride in zip(lead_shape, lead_strides, strict=True):
        starts = (starts[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    return starts


def touched_chunks(
    starts: npt.NDArray[np.int64], run_bytes: int, chunk_bytes: int, box_bytes: int
) -> list[tuple[int, int]]:
    """The chunks that byte runs ``[s, s + run_bytes)`` (``s`` in ``starts``, ascending) of a stored box of
    ``box_bytes`` bytes touch, as maximal byte ranges ``[lo, hi)`` of whole chunks (the last chunk of the
    box may be short), ascending. Runs of zero bytes touch nothing."""
    if run_bytes <= 0 or len(starts) == 0:
        return []
    first = starts // chunk_bytes
    last = (starts + (run_bytes - 1)) // chunk_bytes
    if len(first) == 1:
        groups_first, groups_last = first, last
    else:
        # A new range starts wherever a run's first chunk lies past the previous run's last chunk + 1.
        breaks = np.flatnonzero(first[1:] > np.maximum.accumulate(last)[:-1] + 1) + 1
        begin = np.concatenate(([0], breaks))
        end = np.concatenate((breaks, [len(first)])) - 1
        groups_first = first[begin]
        groups_last = np.maximum.accumulate(last)[end]
    return [
        (int(lo) * chunk_bytes, min((int(hi) + 1) * chunk_bytes, box_bytes))
        for lo, hi in zip(groups_first.tolist(), groups_last.tolist(), strict=True)
    ]
