"""Scaled tensors as one unit of state: low-precision data, its scales and its global scale, described once.

A :class:`ScaledTensor` is a rank's piece of a low-precision tensor (FP8, MX, NVFP4; see
:mod:`reshard.state.lowprec`): the data described as a :class:`~reshard.ShardedTensor` (any constructor but
the flat range), the local scales as a plain tensor, the format, the block shape and, for the NVFP4 formats,
the fp32 global scale. The user never describes the scales: their :class:`~reshard.ShardedTensor` is *derived*
from the data's description, so that a reshard moves every scale with its block:

- along a blocked axis (block ``b``, in stored elements) a data box ``[o, o + n)`` holds the scale cells
  ``[o / b, ceil((o + n) / b))``; ``o`` must be a multiple of ``b`` and ``o + n`` a multiple of ``b`` or the
  end of the global axis, else the split cuts a block and is refused (:class:`~reshard.ShardingError` naming
  the tensor, the axis and the block size). A segment ``(g, n)`` of a fused tensor maps the same way;
- along a whole-axis (``None``) block the scale box is ``[0, 1)``: the rank whose data starts at 0 on that
  axis holds its primary copy, the others replicas;
- padding (``logical_shape``) pads the scales consistently: their logical shape is ``ceil(logical / b)``.

The global scale is a whole-tensor leaf (0-d) whose primary copy is held by the rank whose primary data
holds the origin element (of an empty tensor: whose primary data box starts at the origin). Saved, the
three are tensors ``<key>``, ``<key>:scale`` and ``<key>:global_scale``
plus a :class:`ScaledRecord` in the metadata; bytes of dtypes a checkpoint does not name (packed FP4 as
``float4_e2m1fn_x2``, E8M0 scales as ``float8_e8m0fnu``) are saved and filled through ``uint8`` views of
the same memory, never cast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from reshard.errors import ShardingError
from reshard.state.dtypes import BYTE_VIEW_DTYPES
from reshard.state.lowprec import Block, ScaleFormat, normalize_block, scale_format, scale_grid_shape, stored_block
from reshard.state.sharding import ReplicaId, ShardedTensor

__all__ = ["GLOBAL_SCALE_SUFFIX", "SCALE_SUFFIX", "ScaledRecord", "ScaledTensor", "canonical_block", "stored_view"]

SCALE_SUFFIX = ":scale"
GLOBAL_SCALE_SUFFIX = ":global_scale"


def stored_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a ``uint8`` view of its memory when its dtype is one a checkpoint stores as bytes."""
    return tensor.view(torch.uint8) if tensor.dtype in BYTE_VIEW_DTYPES else tensor


@dataclass(frozen=True, slots=True)
class ScaledRecord:
    """What a checkpoint records of a scaled tensor ``key``: its format, its block shape (per logical axis,
    elements or None for the whole axis) and the keys of its scales and global scale (None: none)."""

    key: str
    format: str
    block: Block
    scale_key: str
    global_scale_key: str | None

    @property
    def part_keys(self) -> tuple[str, ...]:
        """The keys of its saved parts: the data, the scales and (when it has one) the global scale."""
        return tuple(k for k in (self.key, self.scale_key, self.global_scale_key) if k is not None)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "block": list(self.block),
            "scale": self.scale_key,
            "global_scale": self.global_scale_key,
        }

    def describe(self) -> str:
        return f"format {self.format} with blocks {list(self.block)}"


def _as_tuple(replica_id: ReplicaId) -> tuple[int, ...]:
    return (replica_id,) if isinstance(replica_id, int) else tuple(replica_id)


def _cells(key: str, axis: int, start: int, length: int, end_of_axis: int, block: int, logical: int) -> tuple[int, int]:
    """The scale cells ``(first, count)`` of the data range ``[start, start + length)`` of ``axis``.

    Raises:
        ShardingError: the range starts or ends inside a block (the end of the axis excepted).
    """
    stop = start + length
    if start % block or (stop % block and stop != end_of_axis):
        cut = start if start % block else stop
        raise ShardingError(
            f"{key!r}: the split at {cut} on axis {axis} cuts a block of {logical} elements (the data range "
            f"[{start}, {stop}) must start and end on block boundaries): the scales could not follow their blocks"
        )
    return start // block, math.ceil(stop / block) - start // block


def canonical_block(fmt: ScaleFormat, block: Block, global_shape: tuple[int, ...]) -> Block:
    """``block`` with every entry that spans its whole (non-empty) axis written as None: one scale along the
    axis either way, and a record that does not depend on how the axis was cut (a torchao slice shows its
    own length as the block, a whole tensor the axis's). The formats that fix their block keep it."""
    if fmt.fixed_last_block is not None:
        return block
    return tuple(None if b is not None and 0 < n <= b else b for b, n in zip(block, global_shape, strict=True))


@dataclass(frozen=True, slots=True)
class _Derived:
    """The scale's description, derived from the data's."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    holder: bool
    segments: tuple[tuple[int, int], ...] | None
    logical_shape: tuple[int, ...] | None


def _derive(data: ShardedTensor, sblock: Block, logical_block: Block) -> _Derived:
    """The scale grid's global shape, this rank's scale box (or segments) and whether this rank holds its
    primary copy on every whole-axis block."""
    key = data.key
    if data.flat_range is not None:
        raise ShardingError(f"{key!r}: a scaled tensor's data cannot be a flat range (from_flat_range) yet")
    shape = data.shard_shape
    offset, local, holder = [], [], True
    seg_axis = data.segment_axis
    segments = None
    for axis, (b, lb) in enumerate(zip(sblock, logical_block, strict=True)):
        if b is None:
            if axis == seg_axis:
                holder = holder and any(g == 0 and n for g, n in data.segments or ())
            else:
                holder = holder and data.global_offset[axis] == 0
            offset.append(0)
            local.append(1)
            continue
        end = data.global_shape[axis]
        if axis == seg_axis and data.segments is not None:
            segments = tuple(_cells(key, axis, g, n, end, b, lb or b) for g, n in data.segments)
            offset.append(0)
            local.append(sum(n for _, n in segments))
            continue
        first, count = _cells(key, axis, data.global_offset[axis], shape[axis], end, b, lb or b)
        offset.append(first)
        local.append(count)
    logical = scale_grid_shape(data.logical_shape, sblock) if data.logical_shape is not None else None
    return _Derived(scale_grid_shape(data.global_shape, sblock), tuple(offset), tuple(local), holder, segments, logical)


@dataclass(frozen=True, slots=True)
class ScaledTensor:
    """A rank's piece of a low-precision tensor and its scales, saved and loaded as one unit.

    Args:
        data: the low-precision data (dtype of the format; packed FP4 as ``uint8`` or ``float4_e2m1fn_x2``,
            shapes and boxes in bytes), described with any ShardedTensor constructor but ``from_flat_range``.
        scale: this rank's scales: one per block of its data, of the shape the data's boxes give (a 0-d
            per-tensor scale is taken as ``(1,) * ndim``, the same memory).
        format: a name of :data:`reshard.state.lowprec.FORMATS`.
        block: elements per block on each logical axis, None for the whole axis (None: the format's block,
            per-tensor scaling for the FP8 formats). A block at least as long as its (non-empty) axis is the
            whole axis: it is recorded as None, so every layout of the tensor records the same block (of a
            padded axis, the logical length counts for the record; the scales follow the stored length).
        global_scale: the fp32 global scale (0-d or ``(1,)``) of the NVFP4 formats; None for the others.

    Raises:
        ShardingError: naming the key: an unknown format, a block the format or tensor refuses, data or scale
            dtypes of another format, a split that cuts a block (naming the axis and the block size), a local
            scale of another shape than the derived one, a missing or unexpected global scale, a flat range.
    """

    data: ShardedTensor
    scale: torch.Tensor
    format: str
    block: Block | None = None
    global_scale: torch.Tensor | None = None
    scale_sharded: ShardedTensor = field(init=False, repr=False, compare=False)
    global_scale_sharded: ShardedTensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.data, ShardedTensor):
            raise ShardingError(f"a ScaledTensor's data must be a ShardedTensor, got {type(self.data).__name__}")
        key = self.data.key
        fmt = scale_format(self.format, key=key)
        ndim = len(self.data.global_shape)
        block = canonical_block(fmt, normalize_block(fmt, self.block, ndim, key=key), self.data.global_shape)
        object.__setattr__(self, "block", block)
        _check_dtypes(key, fmt, self.data.data, self.scale)
        derived = _derive(self.data, stored_block(fmt, block), block)
        object.__setattr__(self, "scale_sharded", self._scale_sharded(derived))
        object.__setattr__(self, "global_scale_sharded", self._global_sharded(fmt))

    @property
    def key(self) -> str:
        return self.data.key

    @property
    def record(self) -> ScaledRecord:
        """What the checkpoint's metadata records of this tensor. Its block is canonical against the logical
        (saved) shape, which every layout of the tensor shares: a block at least as long as a padded axis's
        logical length is the whole axis in the record, while the scales are derived over the stored (padded)
        shape (``block``). Both give the same scale cells over the logical elements."""
        fmt = scale_format(self.format, key=self.key)
        return ScaledRecord(
            key=self.key,
            format=self.format,
            block=canonical_block(fmt, tuple(self.block or ()), self.data.saved_shape),
            scale_key=self.key + SCALE_SUFFIX,
            global_scale_key=self.key + GLOBAL_SCALE_SUFFIX if fmt.global_scale else None,
        )

    def parts(self) -> list[ShardedTensor]:
        """The data, the scales and (when the format has one) the global scale as ShardedTensors, each over
        the stored bytes of its tensor (``uint8`` views where the dtype is stored as bytes): what a save
        writes and a load fills in place."""
        out = [replace(self.data, data=stored_view(self.data.data)), self.scale_sharded]
        if self.global_scale_sharded is not None:
            out.append(self.global_scale_sharded)
        return out

    def _scale_sharded(self, derived: _Derived) -> ShardedTensor:
        key = self.data.key
        scale = self.scale
        expected = derived.local_shape
        if scale.ndim == 0 and all(n == 1 for n in expected):
            scale = scale.view(expected)
        if tuple(scale.shape) != expected:
            raise ShardingError(
                f"{key!r}: the local scale has shape {list(scale.shape)}, but the data's box and the block "
                f"{list(self.block or ())} need {list(expected)}"
            )
        rid = (*_as_tuple(self.data.replica_id), 0 if derived.holder else 1)
        name = key + SCALE_SUFFIX
        if derived.segments is not None and self.data.segment_axis is not None:
            return ShardedTensor.segmented(
                name,
                stored_view(scale),
                derived.global_shape,
                self.data.segment_axis,
                derived.segments,
                rid,
                global_offset=derived.offset,
                logical_shape=derived.logical_shape,
            )
        return ShardedTensor(
            name, stored_view(scale), derived.global_shape, derived.offset, rid, logical_shape=derived.logical_shape
        )

    def _global_sharded(self, fmt: ScaleFormat) -> ShardedTensor | None:
        key = self.data.key
        value = self.global_scale
        if fmt.global_scale is None:
            if value is not None:
                raise ShardingError(f"{key!r}: format {fmt.name} has no global scale, but one was given")
            return None
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float32 or value.numel() != 1 or value.ndim > 1:
            raise ShardingError(
                f"{key!r}: format {fmt.name} needs a global_scale: a float32 tensor of shape () or (1,)"
            )
        # The primary copy is the one beside the origin element; an empty tensor has none, and its global
        # scale is held by the primary data box at the origin offset.
        empty = math.prod(self.data.global_shape) == 0
        origin = self.data.is_main_replica and (
            all(o == 0 for o in self.data.global_offset)
            if empty
            else any(all(o == 0 for o in p.box.offset) and p.box.volume > 0 for p in self.data.pieces())
        )
        rid = (*_as_tuple(self.data.replica_id), 0 if origin else 1)
        return ShardedTensor(key + GLOBAL_SCALE_SUFFIX, value.view(()), (), (), rid)


def _check_dtypes(key: str, fmt: ScaleFormat, data: torch.Tensor, scale: object) -> None:
    if data.dtype not in fmt.data_dtypes:
        raise ShardingError(
            f"{key!r}: format {fmt.name} holds its data as {', '.join(map(str, fmt.data_dtypes))}, not {data.dtype}"
        )
    if not isinstance(scale, torch.Tensor):
        raise ShardingError(f"{key!r}: the scale must be a torch.Tensor, got {type(scale).__name__}")
    if scale.dtype not in fmt.scale_dtypes:
        raise ShardingError(
            f"{key!r}: format {fmt.name} holds its scales as {', '.join(map(str, fmt.scale_dtypes))}, not {scale.dtype}"
        )
