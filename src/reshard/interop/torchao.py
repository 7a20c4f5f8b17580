"""torchao's low-precision tensors (``Float8Tensor``, ``MXTensor``, ``NVFP4Tensor``) saved and loaded as
:class:`~reshard.ScaledTensor`\\ s, so that a checkpoint of a model ``quantize_`` turned into them reshards like any
other scaled state, bit-exact.

Use :func:`torchao_state` around a save or a load::

    with reshard.interop.torchao.torchao_state(model.state_dict()) as state:
        reshard.save(state, path)          # or reshard.load(state, path): fills the tensors in place

Every leaf that is a torchao tensor becomes a ScaledTensor over the *same memory* as the torchao tensor's
``qdata`` and ``scale`` (and ``per_tensor_scale``), keyed by its path and covering the whole tensor. A rank
that holds a tensor-parallel or expert shard of a torchao tensor (the slice ``full[rows]`` of the quantized
global tensor, or what torchao's quantization of that slice gives where the scales are per block) puts a
:class:`TorchaoShard` in the state dict instead, naming the global shape and where its slice lies.

Formats (``torchao`` attribute -> reshard format, block per logical axis):

- ``Float8Tensor`` (``Float8DynamicActivationFloat8WeightConfig``, ``Float8Tensor.from_hp``): ``fp8_e4m3`` or
  ``fp8_e5m2`` by ``qdata``'s dtype; the block from torchao's ``block_size``, an entry that covers the whole
  axis written as None (``PerTensor``: all None, ``PerRow``: ``(1, None)``, ``PerBlock([128, 128])``:
  ``(128, 128)`` where the axes are longer than 128).
- ``MXTensor``: ``mxfp8_e4m3``, ``mxfp8_e5m2`` or ``mxfp4`` by its ``elem_dtype`` (block 32 on the last axis;
  the scale calculation mode, FLOOR or RCEIL, changes no stored byte's meaning and is not recorded).
- ``NVFP4Tensor``: ``nvfp4`` (block 16; torchao's ``per_tensor_scale`` multiplies: the global scale). An
  NVFP4Tensor without ``per_tensor_scale`` is refused.

Swizzled (blocked) scales, the layout torchao's MX and NVFP4 inference configs always write, are unswizzled
into a row-major copy that is saved; on load that copy is filled, then swizzled back into the tensor's own
scale when the ``with`` block ends without an error: the checkpoint holds row-major scales only.
What reshard does not carry (``act_quant_kwargs``, ``mm_config``, ``kernel_preference``, the original
dtype, ``use_triton_kernel``, ``act_per_tensor_scale``, whether scales are swizzled) is the template's own on
load: build the template with the same torchao config.

Nothing here imports torchao unless the state dict holds its tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.errors import ShardingError
from reshard.state.lowprec import Block, scale_format
from reshard.state.scaled import ScaledTensor
from reshard.state.sharding import ReplicaId, ShardedTensor
from reshard.state.statedict import map_leaves, torchao_class

__all__ = ["TorchaoShard", "is_torchao_tensor", "torchao_state", "torchao_to_scaled"]


def is_torchao_tensor(value: object) -> bool:
    """Whether ``value`` is a torchao ``Float8Tensor``, ``MXTensor`` or ``NVFP4Tensor`` (importing nothing)."""
    return torchao_class(value) is not None


@dataclass(frozen=True, slots=True)
class TorchaoShard:
    """This rank's slice of a torchao tensor, as a state dict leaf of :func:`torchao_state`.

    Args:
        tensor: the torchao tensor of the slice (``full[a:b]`` of the quantized global tensor, or torchao's
            quantization of the slice where its scales are per block).
        global_shape: the logical shape of the global tensor.
        global_offset: where the slice starts in it (logical elements).
        block: the global tensor's block per axis (None entries: whole axis). None: read from the slice,
            which a Float8Tensor does not always show (an axis the slice cuts, holding one scale along it,
            may be scaled whole or by blocks as long as the slice: that needs ``block``).
        replica_id: as :class:`~reshard.ShardedTensor`'s (0: the primary copy).
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    block: Block | None = None
    replica_id: ReplicaId = 0


@dataclass
class _Swizzled:
    """A swizzled torchao scale and the row-major copy that the checkpoint sees."""

    owner: Any
    row_major: torch.Tensor


@dataclass
class _Conversion:
    swizzled: list[_Swizzled] = field(default_factory=list)


def _format_of(key: str, kind: str, tensor: Any) -> str:
    if kind == "Float8Tensor":
        names = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
        dtype = tensor.qdata.dtype
    elif kind == "MXTensor":
        names = {torch.float8_e4m3fn: "mxfp8_e4m3", torch.float8_e5m2: "mxfp8_e5m2", torch.float4_e2m1fn_x2: "mxfp4"}
        dtype = tensor.elem_dtype
    else:
        return "nvfp4"
    name = names.get(dtype)
    if name is None:
        raise ShardingError(f"{key!r}: a torchao {kind} of element dtype {dtype} has no reshard format")
    return name


def _float8_block(key: str, tensor: Any, global_shape: tuple[int, ...], block: Block | None) -> Block:
    """The global block of a Float8Tensor (slice), canonical: an entry reaching the axis' end is None."""
    local, scale = tuple(tensor.qdata.shape), tuple(tensor.scale.shape)
    if len(scale) != len(local):
        raise ShardingError(f"{key!r}: a Float8Tensor's scale {list(scale)} must have one axis per data axis")
    out: list[int | None] = []
    for axis, (n, s, whole) in enumerate(zip(local, scale, global_shape, strict=True)):
        given = None if block is None else block[axis]
        if given is not None and given >= whole:
            given = None
        if s > 1:
            inferred: int | None = math.ceil(n / s)
        elif n == whole:
            inferred = None
        elif block is None:
            raise ShardingError(
                f"{key!r}: the slice holds {n} of {whole} elements on axis {axis} with one scale: the tensor is "
                "scaled by the whole axis or by blocks of that length; say which with TorchaoShard(block=...)"
            )
        else:
            inferred = given
        if block is not None and given != inferred:
            raise ShardingError(
                f"{key!r}: block {list(block)} does not fit the slice's {s} scales over {n} elements on axis {axis}"
            )
        out.append(inferred)
    return tuple(out)


def _unswizzled(key: str, tensor: Any, rows: int, cols: int, conversion: _Conversion) -> torch.Tensor:
    """A row-major copy of ``tensor``'s swizzled scale (``rows`` x ``cols`` cells), to be written back."""
    from torchao.prototype.mx_formats.utils import from_blocked  # type: ignore[import-untyped]

    if tensor.qdata.ndim != 2:
        raise ShardingError(f"{key!r}: swizzled scales of a {tensor.qdata.ndim}-d torchao tensor are not supported")
    row_major: torch.Tensor = from_blocked(tensor.scale, rows, cols).contiguous()
    conversion.swizzled.append(_Swizzled(tensor, row_major))
    return row_major


def _scale_of(key: str, kind: str, tensor: Any, conversion: _Conversion) -> torch.Tensor:
    scale = tensor.scale
    if kind == "Float8Tensor":
        return scale  # type: ignore[no-any-return]
    if tensor.qdata.ndim and tensor.qdata.stride(-1) != 1:
        raise ShardingError(
            f"{key!r}: a torchao {kind} whose qdata is transposed (blocks across memory) is unsupported"
        )
    logical = tuple(tensor.shape)
    cols = logical[-1] // int(tensor.block_size)
    if getattr(tensor, "is_swizzled_scales", False):
        return _unswizzled(key, tensor, math.prod(logical[:-1]), cols, conversion).view(*logical[:-1], cols)
    return scale.view(*logical[:-1], cols)  # type: ignore[no-any-return]


def torchao_to_scaled(key: str, leaf: torch.Tensor | TorchaoShard, *, replica_id: ReplicaId = 0) -> ScaledTensor:
    """The ScaledTensor of a torchao tensor (whole, with ``replica_id``) or of a :class:`TorchaoShard`, over the
    same memory. A tensor with swizzled scales is refused here: :func:`torchao_state` unswizzles and writes back.

    Raises:
        ShardingError: naming ``key``: not a torchao tensor reshard knows, an element dtype without a format, a
            block the slice does not show or does not fit, a split that cuts a block, an NVFP4Tensor without
            ``per_tensor_scale``, swizzled scales (here; in :func:`torchao_state`: of a 3-d tensor).
    """
    return _to_scaled(key, leaf, None, replica_id)


def _to_scaled(
    key: str, leaf: torch.Tensor | TorchaoShard, conversion: _Conversion | None, replica_id: ReplicaId
) -> ScaledTensor:
    shard = leaf if isinstance(leaf, TorchaoShard) else None
    tensor: Any = leaf.tensor if isinstance(leaf, TorchaoShard) else leaf
    kind = torchao_class(tensor)
    if kind is None:
        raise ShardingError(f"{key!r}: {type(tensor).__name__} is not a torchao Float8Tensor, MXTensor or NVFP4Tensor")
    if conversion is None and getattr(tensor, "is_swizzled_scales", False):
        raise ShardingError(f"{key!r}: a torchao tensor with swizzled scales needs torchao_state (which unswizzles)")
    fmt_name = _format_of(key, kind, tensor)
    fmt = scale_format(fmt_name, key=key)
    logical = tuple(tensor.shape)
    global_shape = tuple(shard.global_shape) if shard else logical
    offset = tuple(shard.global_offset) if shard else (0,) * len(logical)
    if len(global_shape) != len(logical) or len(offset) != len(logical):
        raise ShardingError(f"{key!r}: global_shape and global_offset need one entry per axis of {list(logical)}")
    block = _float8_block(key, tensor, global_shape, shard.block if shard else None) if kind == "Float8Tensor" else None
    per = fmt.elements_per_item
    stored_shape = (*global_shape[:-1], global_shape[-1] // per) if logical else ()
    stored_offset = (*offset[:-1], offset[-1] // per) if logical else ()
    if logical and (global_shape[-1] % per or offset[-1] % per):
        raise ShardingError(f"{key!r}: packed FP4 needs an even last-axis shape and offset")
    data = ShardedTensor(key, tensor.qdata, stored_shape, stored_offset, shard.replica_id if shard else replica_id)
    global_scale = None
    if kind == "NVFP4Tensor":
        global_scale = tensor.per_tensor_scale
        if global_scale is None:
            raise ShardingError(f"{key!r}: an NVFP4Tensor without per_tensor_scale is not supported (format nvfp4)")
    scale = _scale_of(key, kind, tensor, conversion or _Conversion())
    return ScaledTensor(data, scale, fmt_name, block, global_scale)


@contextmanager
def torchao_state(state_dict: object, *, replica_id: ReplicaId = 0) -> Iterator[Any]:
    """``state_dict`` with every torchao tensor and :class:`TorchaoShard` leaf a :class:`~reshard.ScaledTensor`
    over the same memory, to pass to a save or load inside the ``with`` block; swizzled scales are row-major
    copies there, written back into the tensors' swizzled scales when the block ends without an error (after a
    load: the loaded scales; after a save: the same values).

    ``replica_id`` is that of the whole torchao tensors (not of the :class:`TorchaoShard` leaves, which carry
    their own): when every rank holds the same whole tensors, pass the rank, as a save does for plain tensors,
    so that rank 0 holds the primary copy.

    Raises:
        ShardingError: as :func:`torchao_to_scaled`, naming the leaf's path.
    """
    conversion = _Conversion()

    def convert(path: str, leaf: object) -> object:
        if isinstance(leaf, TorchaoShard) or is_torchao_tensor(leaf):
            return _to_scaled(path, leaf, conversion, replica_id)  # type: ignore[arg-type]
        return leaf

    converted = map_leaves(state_dict, convert)
    yield converted
    if conversion.swizzled:
        from torchao.prototype.mx_formats.utils import to_blocked

        for item in conversion.swizzled:
            scale = item.owner.scale
            with torch.no_grad():
                scale.copy_(to_blocked(item.row_major).view(scale.shape))
