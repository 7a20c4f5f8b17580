"""The stored boxes of a tensor, one object per box or in columns.

:class:`SavedBox` is one stored box; :class:`BoxColumns` holds many as integer columns, and
:class:`SavedBoxes` presents them as a read-only sequence of :class:`SavedBox` (made when asked for), so that
a tensor of a hundred thousand boxes costs a few megabytes and no Python object per box.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import numpy.typing as npt

from reshard.errors import CheckpointError, CorruptCheckpointError
from reshard.geometry.boxes import Box
from reshard.geometry.grid import BoxIndex
from reshard.geometry.sorting import lexsort

__all__ = ["BoxColumns", "Int64Array", "PartBoxes", "SavedBox", "SavedBoxes"]

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, kw_only=True)
class SavedBox:
    """One stored box of a tensor: elements ``[offset, offset + shape)`` of the global tensor, stored
    row-major in ``byte_length`` bytes at ``byte_offset`` of data file number ``file``.

    ``checksums`` holds the CRC-32C of each consecutive ``checksum_chunk_bytes`` piece of those bytes
    (the last piece may be shorter); ``content_hash``, in a checkpoint with content hashes (version 4), the
    16-byte XXH3-128 digest of all of them, which an incremental save compares to decide what to rewrite.
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    file: int
    byte_offset: int
    byte_length: int
    checksums: tuple[int, ...]
    content_hash: bytes | None = None

    @property
    def box(self) -> Box:
        return Box(self.offset, self.shape)


@dataclass(frozen=True, slots=True, eq=False)
class BoxColumns:
    """The stored boxes of one tensor as columns, sorted by offset: row ``i`` describes box ``i``.

    Attributes:
        offset, shape: ``(n, ndim)`` elements, as in :class:`SavedBox`.
        file, byte_offset, byte_length: ``(n,)``, as in :class:`SavedBox`.
        crc_start, crc_count: ``(n,)``: box ``i``'s checksums are ``crc[crc_start[i]:][:crc_count[i]]``.
        crc: every checksum (CRC-32C), ``uint32``.
        content_hash: ``(n, 16)`` ``uint8``: every box's content hash, or None in a checkpoint without them.
    """

    offset: Int64Array
    shape: Int64Array
    file: Int64Array
    byte_offset: Int64Array
    byte_length: Int64Array
    crc_start: Int64Array
    crc_count: Int64Array
    crc: npt.NDArray[np.uint32]
    content_hash: npt.NDArray[np.uint8] | None = None

    @classmethod
    def of(cls, boxes: Sequence[SavedBox], ndim: int) -> BoxColumns:
        """The columns of any sequence of boxes (a :class:`SavedBoxes` already has them)."""
        if isinstance(boxes, SavedBoxes):
            return boxes.columns
        n = len(boxes)
        counts = np.array([len(b.checksums) for b in boxes], dtype=np.int64)
        hashes = [b.content_hash for b in boxes if b.content_hash is not None]
        return cls(
            offset=np.array([b.offset for b in boxes], dtype=np.int64).reshape(n, ndim),
            shape=np.array([b.shape for b in boxes], dtype=np.int64).reshape(n, ndim),
            file=np.array([b.file for b in boxes], dtype=np.int64),
            byte_offset=np.array([b.byte_offset for b in boxes], dtype=np.int64),
            byte_length=np.array([b.byte_length for b in boxes], dtype=np.int64),
            crc_start=np.cumsum(counts) - counts,
            crc_count=counts,
            crc=np.array([c for b in boxes for c in b.checksums], dtype=np.uint32),
            content_hash=(
                np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(n, 16).copy()
                if n and len(hashes) == n
                else None
            ),
        )

    def sorted(self) -> BoxColumns:
        """The same boxes sorted by offset (lexicographically), the order of the Python API."""
        d = self.offset.shape[1]
        order = lexsort(tuple(self.offset[:, a] for a in range(d - 1, -1, -1))) if d else np.arange(len(self.file))
        return self.take(order)

    def take(self, order: Int64Array) -> BoxColumns:
        """Boxes ``order`` (the checksums stay where they are; only the per-box columns move)."""
        return BoxColumns(
            offset=self.offset[order],
            shape=self.shape[order],
            file=self.file[order],
            byte_offset=self.byte_offset[order],
            byte_length=self.byte_length[order],
            crc_start=self.crc_start[order],
            crc_count=self.crc_count[order],
            crc=self.crc,
            content_hash=self.content_hash[order] if self.content_hash is not None else None,
        )

    def checksums_in_order(self) -> npt.NDArray[np.uint32]:
        """Every box's checksums, box after box (the packed ``crc32c`` field)."""
        total = int(self.crc_count.sum())
        first = np.repeat(self.crc_start - (np.cumsum(self.crc_count) - self.crc_count), self.crc_count)
        return self.crc[first + np.arange(total, dtype=np.int64)]


class SavedBoxes(Sequence[SavedBox]):
    """The stored boxes of one tensor held as :class:`BoxColumns`, sorted by offset.

    A read-only sequence of :class:`SavedBox` (a box object is made when asked for), so that a tensor of a
    hundred thousand boxes costs a few megabytes and no Python object per box. It can also be *lazy*: the
    columns are then decoded (and validated) from the metadata document on first use, so a rank that only
    needs some tensors decodes only those. :meth:`lookup` finds the boxes overlapping a region.
    """

    __slots__ = ("_columns", "_count", "_index", "_load")

    def __init__(
        self, columns: BoxColumns | None = None, *, count: int = 0, load: Callable[[], BoxColumns] | None = None
    ) -> None:
        """Either ``columns`` (sorted by offset), or ``count`` and ``load``, which returns them."""
        if (columns is None) == (load is None):
            raise ValueError("SavedBoxes takes either columns or a loader")
        self._columns = columns
        self._load = load
        self._count = len(columns.file) if columns is not None else count
        self._index: BoxIndex | None = None

    @property
    def columns(self) -> BoxColumns:
        if self._columns is None:
            if self._load is None:  # unreachable: __init__ sets one of the two
                raise RuntimeError("SavedBoxes has neither columns nor a loader")
            columns = self._load()
            if len(columns.file) != self._count:
                raise CorruptCheckpointError(f"packed boxes: {len(columns.file)} decoded, {self._count} declared")
            self._columns, self._load = columns, None
        return self._columns

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> SavedBox: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[SavedBox, ...]: ...

    def __getitem__(self, index: int | slice) -> SavedBox | tuple[SavedBox, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._count)))
        if not -self._count <= index < self._count:
            raise IndexError(f"box {index} of {self._count}")
        i = index % self._count
        c = self.columns
        start, count = int(c.crc_start[i]), int(c.crc_count[i])
        return SavedBox(
            offset=tuple(c.offset[i].tolist()),
            shape=tuple(c.shape[i].tolist()),
            file=int(c.file[i]),
            byte_offset=int(c.byte_offset[i]),
            byte_length=int(c.byte_length[i]),
            checksums=tuple(c.crc[start : start + count].tolist()),
            content_hash=c.content_hash[i].tobytes() if c.content_hash is not None else None,
        )

    def __iter__(self) -> Iterator[SavedBox]:
        for i in range(self._count):
            yield self[i]

    def box(self, i: int) -> Box:
        """The region of box ``i`` (without making its :class:`SavedBox`)."""
        c = self.columns
        return Box(tuple(c.offset[i].tolist()), tuple(c.shape[i].tolist()))

    def lookup(self) -> BoxIndex:
        """The lookup structure of these boxes (built on first use)."""
        if self._index is None:
            self._index = BoxIndex(self.columns.offset, self.columns.shape)
        return self._index

    @property
    def total_bytes(self) -> int:
        return int(self.columns.byte_length.sum())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        if len(other) != self._count:
            return False
        return all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"SavedBoxes({self._count} boxes)"


class PartBoxes(Sequence[SavedBox]):
    """The boxes of a tensor of partitioned metadata (version 6) whose part file was not read: only the number
    of the part that holds them. Any use of the boxes raises: a reader reads the parts it needs first
    (:func:`reshard.io.parts.read_parts`), and every other reader reads them all
    (:func:`reshard.io.parts.read_full_metadata`), so that each part is verified before its boxes are used."""

    __slots__ = ("key", "part")

    def __init__(self, key: str, part: int) -> None:
        self.key = key
        self.part = part

    def _unread(self) -> CheckpointError:
        return CheckpointError(
            f"the boxes of tensor {self.key!r} live in metadata part {self.part}, which was not read "
            "(read the checkpoint's metadata with reshard.io.parts.read_full_metadata, or the parts with read_parts)"
        )

    def __len__(self) -> int:
        raise self._unread()

    @overload
    def __getitem__(self, index: int) -> SavedBox: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[SavedBox, ...]: ...

    def __getitem__(self, index: int | slice) -> SavedBox | tuple[SavedBox, ...]:
        raise self._unread()

    def __iter__(self) -> Iterator[SavedBox]:
        raise self._unread()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PartBoxes) and (other.key, other.part) == (self.key, self.part)

    def __hash__(self) -> int:
        return hash((self.key, self.part))

    def __repr__(self) -> str:
        return f"PartBoxes({self.key!r} in part {self.part})"
