"""How a rank describes its piece of a global tensor: :class:`ShardedTensor` and :class:`ShardedObject`.

A rank's local tensor is a *box* of a global tensor that every layout agrees on: the same ``key``
(global layer and expert numbers, never local ones) and the same ``global_shape`` on every layout. The
box starts at ``global_offset``. ``replica_id`` tells identical copies apart: all zeros marks the primary
copy of a box, anything else a replica of a box that another rank also holds (data- or
context-parallel copies). Exactly one copy of each box is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from reshard.boxes import Box
from reshard.dtypes import DTYPE_BY_NAME
from reshard.errors import ShardingError

__all__ = ["ReplicaId", "ShardedObject", "ShardedTensor", "is_main_replica", "normalize_replica_id"]

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
class ShardedTensor:
    """A rank's local ``data``: the box of global tensor ``key`` that starts at ``global_offset``.

    Attributes:
        key: the tensor's name, identical on every layout (global layer/expert numbers).
        data: the local tensor; saved from, and filled in place by a load.
        global_shape: the shape of the whole tensor, in elements.
        global_offset: global index of ``data``'s first element on every axis, in elements.
        replica_id: 0 (or all zeros) for the primary copy of this box, anything else for a replica.

    Raises:
        ShardingError: (a ``ValueError``) naming the key, when the box does not fit the global shape, the
            ranks differ, an offset is negative, or the dtype cannot be stored.
    """

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        _check_key(self.key)
        if not isinstance(self.data, torch.Tensor):
            raise ShardingError(f"{self.key!r}: data must be a torch.Tensor, got {type(self.data).__name__}")
        if self.data.dtype not in DTYPE_BY_NAME.values():
            raise ShardingError(f"{self.key!r}: dtype {self.data.dtype} cannot be stored")
        global_shape = _int_tuple(self.key, "global_shape", self.global_shape)
        global_offset = _int_tuple(self.key, "global_offset", self.global_offset)
        object.__setattr__(self, "global_shape", global_shape)
        object.__setattr__(self, "global_offset", global_offset)
        object.__setattr__(self, "replica_id", normalize_replica_id(self.key, self.replica_id))
        local_shape = tuple(self.data.shape)
        if not len(global_shape) == len(global_offset) == len(local_shape):
            raise ShardingError(
                f"{self.key!r}: global_shape {global_shape}, global_offset {global_offset} and local "
                f"shape {local_shape} must have the same number of axes"
            )
        if not self.local_box.is_inside(global_shape):
            raise ShardingError(
                f"{self.key!r}: local box at offset {global_offset} with shape {local_shape} "
                f"extends past global_shape {global_shape}"
            )

    @classmethod
    def from_rank_offsets(
        cls, key: str, data: torch.Tensor, *rank_offsets: tuple[int, int, int], replica_id: ReplicaId = 0
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
        return cls(key, data, tuple(global_shape), tuple(global_offset), replica_id)

    @property
    def local_box(self) -> Box:
        """The region of the global tensor that ``data`` holds."""
        return Box(self.global_offset, tuple(self.data.shape))

    @property
    def is_main_replica(self) -> bool:
        return is_main_replica(self.replica_id)


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
