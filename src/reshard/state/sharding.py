"""How a rank describes its piece of a global tensor: :class:`ShardedTensor` and :class:`ShardedObject`.

A rank's local tensor is a *box* of a global tensor that every layout agrees on: the same ``key``
(global layer and expert numbers, never local ones) and the same ``global_shape`` on every layout. The
box starts at ``global_offset``. ``replica_id`` tells identical copies apart: all zeros marks the primary
copy of a box, anything else a replica of a box that another rank also holds (data- or
context-parallel copies). Exactly one copy of each box is written.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.errors import ShardingError
from reshard.geometry.boxes import Box, flat_range_boxes
from reshard.state.dtypes import BYTE_VIEW_DTYPES, DTYPE_BY_NAME

__all__ = [
    "LocalPiece",
    "ReplicaId",
    "ShardedObject",
    "ShardedTensor",
    "is_main_replica",
    "normalize_replica_id",
]

ReplicaId = int | tuple[int, ...]
"""0, or a tuple of replica coordinates (one per replicating parallel dimension); all zeros is primary."""


def normalize_replica_id(key: str, replica_id: object) -> ReplicaId:
    """Check that ``replica_id`` is a non-negative int or a tuple of them; return it as such."""
    if isinstance(replica_id, bool):
        raise ShardingError(f"{key!r}: replica_id must be an int or a tuple of ints, not a bool")
    if isinstance(replica_id, int):
        if replica_id < 0:
            raise ShardingError(f"{key!r}: replica_id {replica_id} is negative")
        return replica_id
    if isinstance(replica_id, tuple | list):
        items = tuple(replica_id)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
            raise ShardingError(f"{key!r}: replica_id {replica_id!r} must hold non-negative ints")
        return items
    raise ShardingError(f"{key!r}: replica_id must be an int or a tuple of ints, got {type(replica_id).__name__}")


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Whether ``replica_id`` marks the primary copy (0, or a tuple of zeros)."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(i == 0 for i in replica_id)


def _int_tuple(key: str, name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, torch.Size):
        return tuple(int(v) for v in value)
    if not isinstance(value, tuple | list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ShardingError(f"{key!r}: {name} must be a tuple of ints, got {value!r}")
    if any(v < 0 for v in value):
        raise ShardingError(f"{key!r}: {name} {tuple(value)} has a negative entry")
    return tuple(value)


def _check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise ShardingError(f"a key must be a non-empty string, got {key!r}")


@dataclass(frozen=True, slots=True)
class LocalPiece:
    """One box of a ShardedTensor and the view of the local data that holds it.

    Attributes:
        box: the region of the global (logical) tensor, in global coordinates.
        view: the local elements of ``box``, a view into the ShardedTensor's ``data`` with ``box.shape``.
        padded_view: when this piece was clipped to the logical shape, the whole unclipped view (whose
            elements outside ``box`` are padding, zeroed on load by :meth:`zero_padding`); otherwise None.
    """

    box: Box
    view: torch.Tensor
    padded_view: torch.Tensor | None = None

    def zero_padding(self) -> None:
        """Zero the padding of a clipped piece (the elements of ``padded_view`` past the logical shape) and
        nothing else; a no-op for a piece without padding.

        The real elements (``view``) are the leading ``view.shape`` of ``padded_view`` on every axis (a
        logical shape clips only the end of a box), so the padding is, per axis, the slab past them. A
        transfer that leaves its unchanged cells in place needs exactly this: zeroing the whole padded view
        would wipe real rows that are not sent again.
        """
        padded = self.padded_view
        if padded is None:
            return
        with torch.no_grad():
            for axis, (real, whole) in enumerate(zip(self.view.shape, padded.shape, strict=True)):
                if real < whole:
                    padded[(slice(None),) * axis + (slice(real, whole),)].zero_()


@dataclass(frozen=True, slots=True)
class ShardedTensor:
    """A rank's local ``data`` and where it lies in global tensor ``key``.

    The plain form (this constructor): ``data`` is the box of the global tensor that starts at
    ``global_offset``. The other constructors describe the other ways training cuts tensors:
    :meth:`segmented` (fused QKV, fused gate/up: several ranges of one axis, concatenated),
    :meth:`from_flat_range` (ZeRO-1 optimizer state: a slice of the flattened local shard) and, on every
    constructor, ``logical_shape`` (a global tensor padded past its logical size, like a vocabulary padded
    to a multiple of TP). Use those constructors rather than setting the keyword fields by hand.

    Attributes:
        key: the tensor's name, identical on every layout (global layer/expert numbers).
        data: the local tensor; saved from, and filled in place by a load.
        global_shape: the shape of the whole (padded) tensor, in elements.
        global_offset: global index of the local shard's first element on every axis, in elements (0 on a
            segmented axis).
        replica_id: 0 (or all zeros) for the primary copy of this box, anything else for a replica.
        logical_shape: the unpadded shape; elements past it on any axis are padding, never saved, and
            zeroed on load. None: no padding.
        segment_axis, segments: for a segmented shard, the axis and the ``(global_start, length)`` of each
            local range along it, in local order.
        flat_range: for a flat-range shard, ``(flat_start, flat_end)``: ``data`` is 1-D and holds those
            elements of the row-major flattening of the local shard, whose shape is ``local_shape``.
        local_shape: the local shard's shape (``data.shape`` unless ``flat_range`` is set).

    Raises:
        ShardingError: (a ``ValueError``) naming the key, when the description does not fit the global
            shape, the ranks differ, an offset is negative, segments overlap, a flat range runs past the
            end, the padding is larger than the global shape, or the dtype cannot be stored.
    """

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0
    logical_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    segment_axis: int | None = field(default=None, kw_only=True)
    segments: tuple[tuple[int, int], ...] | None = field(default=None, kw_only=True)
    flat_range: tuple[int, int] | None = field(default=None, kw_only=True)
    local_shape: tuple[int, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        key = self.key
        _check_key(key)
        if not isinstance(self.data, torch.Tensor):
            raise ShardingError(f"{key!r}: data must be a torch.Tensor, got {type(self.data).__name__}")
        if self.data.dtype not in DTYPE_BY_NAME.values() and self.data.dtype not in BYTE_VIEW_DTYPES:
            raise ShardingError(f"{key!r}: dtype {self.data.dtype} cannot be stored")
        global_shape = _int_tuple(key, "global_shape", self.global_shape)
        global_offset = _int_tuple(key, "global_offset", self.global_offset)
        object.__setattr__(self, "global_shape", global_shape)
        object.__setattr__(self, "global_offset", global_offset)
        object.__setattr__(self, "replica_id", normalize_replica_id(key, self.replica_id))
        if self.flat_range is not None:
            self._check_flat_range()
        elif self.local_shape is not None and tuple(self.local_shape) != tuple(self.data.shape):
            raise ShardingError(
                f"{key!r}: local_shape {self.local_shape} differs from data.shape {tuple(self.data.shape)}"
            )
        local_shape = self.shard_shape
        object.__setattr__(self, "local_shape", local_shape)
        if not len(global_shape) == len(global_offset) == len(local_shape):
            raise ShardingError(
                f"{key!r}: global_shape {global_shape}, global_offset {global_offset} and local "
                f"shape {local_shape} must have the same number of axes"
            )
        if self.segments is not None or self.segment_axis is not None:
            self._check_segments()
        elif not Box(global_offset, local_shape).is_inside(global_shape):
            raise ShardingError(
                f"{key!r}: local box at offset {global_offset} with shape {local_shape} "
                f"extends past global_shape {global_shape}"
            )
        if self.logical_shape is not None:
            logical = _int_tuple(key, "logical_shape", self.logical_shape)
            object.__setattr__(self, "logical_shape", logical)
            if len(logical) != len(global_shape) or any(lo > g for lo, g in zip(logical, global_shape, strict=True)):
                raise ShardingError(
                    f"{key!r}: logical_shape {logical} must have the axes of global_shape {global_shape} and "
                    "be no larger on any axis (the padding cannot be larger than the global shape)"
                )

    def _check_flat_range(self) -> None:
        key = self.key
        if self.local_shape is None:
            raise ShardingError(f"{key!r}: a flat range needs local_shape, the shape of the local shard")
        local_shape = _int_tuple(key, "local_shape", self.local_shape)
        object.__setattr__(self, "local_shape", local_shape)
        flat = self.flat_range
        if flat is None or len(flat) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise ShardingError(f"{key!r}: flat_range must be (flat_start, flat_end), got {flat!r}")
        start, end = flat
        total = math.prod(local_shape)
        if not 0 <= start <= end <= total:
            raise ShardingError(
                f"{key!r}: flat range [{start}, {end}) runs past the {total} elements of the local shard "
                f"of shape {list(local_shape)}"
            )
        object.__setattr__(self, "flat_range", (start, end))
        if self.data.ndim != 1 or self.data.numel() != end - start:
            raise ShardingError(
                f"{key!r}: data must be 1-D with {end - start} elements for flat range [{start}, {end}), "
                f"got shape {list(self.data.shape)}"
            )

    def _check_segments(self) -> None:
        key = self.key
        axis = self.segment_axis
        local_shape = self.shard_shape
        if self.segments is None or axis is None:
            raise ShardingError(f"{key!r}: a segmented shard needs both segment_axis and segments")
        if not isinstance(axis, int) or not 0 <= axis < len(self.global_shape):
            raise ShardingError(f"{key!r}: segment axis {axis!r} is out of range for {len(self.global_shape)} axes")
        segments = []
        for entry in self.segments:
            if len(entry) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry):
                raise ShardingError(
                    f"{key!r}: segments must be (global_start, length) non-negative ints, got {entry!r}"
                )
            segments.append((entry[0], entry[1]))
        object.__setattr__(self, "segments", tuple(segments))
        if self.global_offset[axis] != 0:
            raise ShardingError(f"{key!r}: global_offset on the segmented axis {axis} must be 0")
        if sum(n for _, n in segments) != local_shape[axis]:
            raise ShardingError(
                f"{key!r}: segment lengths add up to {sum(n for _, n in segments)}, but the local shard has "
                f"{local_shape[axis]} on axis {axis}"
            )
        ordered = sorted((g, n) for g, n in segments if n)
        for (g0, n0), (g1, _) in itertools.pairwise(ordered):
            if g0 + n0 > g1:
                raise ShardingError(f"{key!r}: segments [{g0}, {g0 + n0}) and [{g1}, ...) overlap on axis {axis}")
        if ordered and ordered[-1][0] + ordered[-1][1] > self.global_shape[axis]:
            raise ShardingError(
                f"{key!r}: segment ending at {ordered[-1][0] + ordered[-1][1]} extends past global_shape "
                f"{list(self.global_shape)} on axis {axis}"
            )
        other = Box(
            tuple(0 if a == axis else o for a, o in enumerate(self.global_offset)),
            tuple(self.global_shape[axis] if a == axis else n for a, n in enumerate(local_shape)),
        )
        if not other.is_inside(self.global_shape):
            raise ShardingError(
                f"{key!r}: local shard at offset {self.global_offset} with shape {local_shape} extends past "
                f"global_shape {self.global_shape}"
            )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        logical_shape: tuple[int, ...] | None = None,
    ) -> ShardedTensor:
        """Describe ``data`` as shard ``rank`` of ``parts`` equal parts along ``axis``, for each given
        ``(axis, rank, parts)``; axes not named are whole.

        Example: a column-parallel weight on TP rank 1 of 4:
        ``ShardedTensor.from_rank_offsets("layers.0.qkv.weight", w, (0, 1, 4))``.
        """
        _check_key(key)
        if not isinstance(data, torch.Tensor):
            raise ShardingError(f"{key!r}: data must be a torch.Tensor, got {type(data).__name__}")
        global_shape = list(data.shape)
        global_offset = [0] * data.ndim
        seen: set[int] = set()
        for entry in rank_offsets:
            if len(entry) != 3 or not all(isinstance(v, int) for v in entry):
                raise ShardingError(f"{key!r}: rank offsets must be (axis, rank, parts) ints, got {entry!r}")
            axis, rank, parts = entry
            if not 0 <= axis < data.ndim:
                raise ShardingError(f"{key!r}: axis {axis} is out of range for a {data.ndim}-d tensor")
            if axis in seen:
                raise ShardingError(f"{key!r}: axis {axis} is given twice in rank offsets")
            if parts < 1 or not 0 <= rank < parts:
                raise ShardingError(f"{key!r}: rank {rank} is not within {parts} parts on axis {axis}")
            seen.add(axis)
            global_shape[axis] = data.shape[axis] * parts
            global_offset[axis] = data.shape[axis] * rank
        return cls(key, data, tuple(global_shape), tuple(global_offset), replica_id, logical_shape=logical_shape)

    @classmethod
    def segmented(
        cls,
        key: str,
        data: torch.Tensor,
        global_shape: tuple[int, ...],
        axis: int,
        segments: list[tuple[int, int]] | tuple[tuple[int, int], ...],
        replica_id: ReplicaId = 0,
        *,
        global_offset: tuple[int, ...] | None = None,
        logical_shape: tuple[int, ...] | None = None,
    ) -> ShardedTensor:
        """Describe ``data`` as the concatenation along ``axis`` of several ranges of the global tensor.

        ``segments`` lists the ``(global_start, length)`` of each range along ``axis``, in local order.
        Other axes start at ``global_offset`` (default 0). Example: a fused QKV weight of plain multi-head
        attention on TP rank ``r`` of ``tp`` with a global layout ``[Q; K; V]`` of ``h`` rows each:
        ``segments = [(r*h/tp, h/tp), (h + r*h/tp, h/tp), (2*h + r*h/tp, h/tp)]``.
        """
        offset = tuple(global_offset) if global_offset is not None else (0,) * data.ndim
        return cls(
            key,
            data,
            global_shape,
            offset,
            replica_id,
            logical_shape=logical_shape,
            segment_axis=axis,
            segments=tuple((int(g), int(n)) for g, n in segments),
        )

    @classmethod
    def from_flat_range(
        cls,
        key: str,
        data: torch.Tensor,
        local_shape: tuple[int, ...],
        global_shape: tuple[int, ...],
        global_offset: tuple[int, ...],
        flat_start: int,
        flat_end: int,
        replica_id: ReplicaId = 0,
        *,
        segment_axis: int | None = None,
        segments: list[tuple[int, int]] | tuple[tuple[int, int], ...] | None = None,
        logical_shape: tuple[int, ...] | None = None,
    ) -> ShardedTensor:
        """Describe a 1-D ``data`` holding elements ``[flat_start, flat_end)`` of the row-major flattening
        of the local shard: the box of shape ``local_shape`` at ``global_offset`` (or, with
        ``segment_axis``/``segments``, a segmented local shard). This is how a distributed optimizer
        (ZeRO-1) holds its slice of the optimizer state of a tensor-parallel shard.
        """
        return cls(
            key,
            data,
            global_shape,
            global_offset,
            replica_id,
            logical_shape=logical_shape,
            segment_axis=segment_axis,
            segments=tuple(segments) if segments is not None else None,
            flat_range=(flat_start, flat_end),
            local_shape=tuple(local_shape),
        )

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The shape of the local shard (``data.shape``, or ``local_shape`` for a flat range)."""
        if self.flat_range is not None and self.local_shape is not None:
            return self.local_shape
        return tuple(self.data.shape)

    @property
    def saved_shape(self) -> tuple[int, ...]:
        """The global shape a checkpoint records: the logical shape when padded, else the global shape."""
        return self.logical_shape if self.logical_shape is not None else self.global_shape

    @property
    def local_box(self) -> Box:
        """The region of the global tensor that a plain (unsegmented) local shard covers."""
        if self.segments is not None:
            raise ShardingError(f"{self.key!r}: a segmented shard covers several boxes; use pieces()")
        return Box(self.global_offset, self.shard_shape)

    @property
    def is_main_replica(self) -> bool:
        return is_main_replica(self.replica_id)

    def _shard_mappings(self) -> list[tuple[Box, tuple[int, ...]]]:
        """(box of the local shard in local coordinates, global offset of that box)."""
        shape = self.shard_shape
        if self.segments is None or self.segment_axis is None:
            return [(Box.full(shape), self.global_offset)]
        axis = self.segment_axis
        out = []
        local_start = 0
        for global_start, length in self.segments:
            if length:
                local = Box(
                    tuple(local_start if a == axis else 0 for a in range(len(shape))),
                    tuple(length if a == axis else n for a, n in enumerate(shape)),
                )
                out.append((local, tuple(global_start if a == axis else o for a, o in enumerate(self.global_offset))))
            local_start += length
        return out

    def pieces(self) -> list[LocalPiece]:
        """The boxes of the global (logical) tensor that this rank's data holds, with their local views.

        Each view shares memory with ``data`` (so a load fills ``data`` in place). Padding past
        ``logical_shape`` is clipped off; empty boxes are dropped.
        """
        raw: list[tuple[Box, torch.Tensor]] = []
        mappings = self._shard_mappings()
        if self.flat_range is None:
            for local, offset in mappings:
                raw.append((Box(offset, local.shape), self.data[local.relative_to(Box.full(self.shard_shape))]))
        else:
            flat_start, _ = self.flat_range
            for flat_box, flat_offset in flat_range_boxes(self.shard_shape, *self.flat_range):
                start = flat_offset - flat_start
                block = self.data[start : start + flat_box.volume].view(flat_box.shape)
                for local, offset in mappings:
                    part = flat_box.intersect(local)
                    if part is None:
                        continue
                    global_offset = tuple(
                        o + p - lo for o, p, lo in zip(offset, part.offset, local.offset, strict=True)
                    )
                    raw.append((Box(global_offset, part.shape), block[part.relative_to(flat_box)]))
        out = []
        logical = Box.full(self.logical_shape) if self.logical_shape is not None else None
        for box, view in raw:
            if box.volume == 0 and box.ndim:
                continue
            if logical is None or box.ndim == 0:
                out.append(LocalPiece(box, view))
                continue
            clipped = box.intersect(logical)
            if clipped == box:
                out.append(LocalPiece(box, view))
            elif clipped is not None:
                out.append(LocalPiece(clipped, view[clipped.relative_to(box)], padded_view=view))
            else:  # all padding: nothing to save or read, only zeros to fill on load
                empty = Box(tuple(min(o, n) for o, n in zip(box.offset, logical.shape, strict=True)), (0,) * box.ndim)
                out.append(LocalPiece(empty, view[(slice(0, 0),) * box.ndim], padded_view=view))
        return out


@dataclass(frozen=True, slots=True)
class ShardedObject:
    """Per-rank non-tensor state addressed by coordinates in a grid of ``global_shape`` cells.

    Example: the RNG state of each (pp, tp) rank is ``ShardedObject("rng", state, (pp, tp), (pp_rank,
    tp_rank), replica_id=dp_rank)``. ``value`` is JSON-like data (dicts, lists, tuples, str, int, float,
    bool, None, bytes) possibly holding torch tensors or numpy arrays; it is never pickled.
    """

    key: str
    value: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        _check_key(self.key)
        global_shape = _int_tuple(self.key, "global_shape", self.global_shape)
        global_offset = _int_tuple(self.key, "global_offset", self.global_offset)
        object.__setattr__(self, "global_shape", global_shape)
        object.__setattr__(self, "global_offset", global_offset)
        object.__setattr__(self, "replica_id", normalize_replica_id(self.key, self.replica_id))
        if len(global_shape) != len(global_offset):
            raise ShardingError(
                f"{self.key!r}: global_shape {global_shape} and global_offset {global_offset} "
                "must have the same number of axes"
            )
        if any(o >= s for o, s in zip(global_offset, global_shape, strict=True)):
            raise ShardingError(f"{self.key!r}: offset {global_offset} is outside the grid {global_shape}")

    @property
    def is_main_replica(self) -> bool:
        return is_main_replica(self.replica_id)
