"""Low-precision formats: which elements, which scales, which blocks, and how the three give values back.

A scaled tensor is low-precision *data* plus *scales*, one scale per block of the data, and for some
formats one fp32 *global scale* for the whole tensor. The format fixes the element type, the scale type,
the formula that gives the values back, and (for the microscaling formats) the block along the last axis.
The block shape is given per axis of the logical (unpacked) tensor: an int is a block of that many
elements; ``None`` means the whole axis (one scale shared along it: per-tensor scaling is all ``None``,
per-row scaling of a 2-D weight is ``(1, None)``).

Formats (``value`` is the element as a real number, ``s`` its block's scale, ``g`` the global scale):

=================  ====================  ====================  ==============  =========================
name               data dtype            scale dtype           block           value
=================  ====================  ====================  ==============  =========================
``fp8_e4m3``       float8_e4m3fn         float32               any             ``data * s``
``fp8_e5m2``       float8_e5m2           float32               any             ``data * s``
``mxfp8_e4m3``     float8_e4m3fn         float8_e8m0fnu        32 on last      ``data * s``
``mxfp8_e5m2``     float8_e5m2           float8_e8m0fnu        32 on last      ``data * s``
``mxfp4``          e2m1, 2 per byte      float8_e8m0fnu        32 on last      ``data * s``
``nvfp4``          e2m1, 2 per byte      float8_e4m3fn         16 on last      ``data * s * g``
``nvfp4_divisor``  e2m1, 2 per byte      float8_e4m3fn         16 on last      ``data * s / g``
=================  ====================  ====================  ==============  =========================

``nvfp4`` is NVIDIA's convention (ModelOpt's ``weight_scale_2``, torchao's ``per_tensor_scale``: ``g`` is
amax / (6 * 448)); ``nvfp4_divisor`` is compressed-tensors' (``weight_global_scale``: ``g`` is 6 * 448 /
amax). They are two formats because the same bytes give other values under the other formula.

Packed FP4 holds two elements per byte along the last axis (the first element in the low nibble), stored
as ``uint8`` or ``float4_e2m1fn_x2``; shapes and boxes of packed data are in bytes, so the last axis of
the stored tensor is half the logical one. E8M0 scales may be stored as ``float8_e8m0fnu`` or as their
``uint8`` bit patterns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reshard.errors import ShardingError

__all__ = [
    "FORMATS",
    "Block",
    "ScaleFormat",
    "normalize_block",
    "scale_format",
    "scale_grid_shape",
    "stored_block",
]

Block = tuple[int | None, ...]
"""A block shape per axis of the logical tensor: elements per block, or None for the whole axis."""


@dataclass(frozen=True, slots=True)
class ScaleFormat:
    """One low-precision format (see the module's table).

    Attributes:
        name: the format's name, as the checkpoint's metadata records it.
        data_dtypes: the dtypes the stored data may have (first: the natural one).
        elements_per_item: logical elements per stored element along the last axis (2 for packed FP4).
        scale_dtypes: the dtypes the stored scales may have (first: the natural one).
        fixed_last_block: the block along the last axis that the format fixes (32 for MX, 16 for NVFP4;
            all other axes then have blocks of 1), or None when the block shape is the user's choice.
        global_scale: None, ``"multiply"`` or ``"divide"``: whether the format has a global fp32 scale and
            how it enters the value.
    """

    name: str
    data_dtypes: tuple[torch.dtype, ...]
    elements_per_item: int
    scale_dtypes: tuple[torch.dtype, ...]
    fixed_last_block: int | None
    global_scale: str | None = None


_E8M0 = (torch.float8_e8m0fnu, torch.uint8)
_FP4 = (torch.uint8, torch.float4_e2m1fn_x2)

FORMATS: dict[str, ScaleFormat] = {
    fmt.name: fmt
    for fmt in (
        ScaleFormat("fp8_e4m3", (torch.float8_e4m3fn,), 1, (torch.float32,), None),
        ScaleFormat("fp8_e5m2", (torch.float8_e5m2,), 1, (torch.float32,), None),
        ScaleFormat("mxfp8_e4m3", (torch.float8_e4m3fn,), 1, _E8M0, 32),
        ScaleFormat("mxfp8_e5m2", (torch.float8_e5m2,), 1, _E8M0, 32),
        ScaleFormat("mxfp4", _FP4, 2, _E8M0, 32),
        ScaleFormat("nvfp4", _FP4, 2, (torch.float8_e4m3fn,), 16, "multiply"),
        ScaleFormat("nvfp4_divisor", _FP4, 2, (torch.float8_e4m3fn,), 16, "divide"),
    )
}


def scale_format(name: str, *, key: str = "") -> ScaleFormat:
    """The format called ``name``.

    Raises:
        ShardingError: no such format (naming ``key`` when given, and the formats there are).
    """
    fmt = FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        where = f"{key!r}: " if key else ""
        raise ShardingError(f"{where}unknown low-precision format {name!r}; the formats are {sorted(FORMATS)}")
    return fmt


def normalize_block(fmt: ScaleFormat, block: Block | None, ndim: int, *, key: str) -> Block:
    """The block shape of a ``ndim``-axis tensor of format ``fmt``, in logical elements.

    ``block`` None is the format's own block (MX, NVFP4: 1 on every axis but the last) or, for the FP8
    formats, per-tensor scaling. A given block must have ``ndim`` entries, each a positive int or None,
    and for a format with a fixed block it must be that block.

    Raises:
        ShardingError: naming ``key``, when the block does not fit the format or the tensor.
    """
    if fmt.fixed_last_block is not None:
        own: Block = (1,) * (ndim - 1) + (fmt.fixed_last_block,) if ndim else ()
        if ndim == 0:
            raise ShardingError(f"{key!r}: format {fmt.name} blocks the last axis and needs at least one axis")
        if block is not None and tuple(block) != own:
            raise ShardingError(f"{key!r}: format {fmt.name} has blocks {list(own)}, not {list(block)}")
        return own
    if block is None:
        return (None,) * ndim
    entries = tuple(block)
    if len(entries) != ndim:
        raise ShardingError(f"{key!r}: block {list(entries)} needs one entry per axis of the {ndim}-d tensor")
    for entry in entries:
        if entry is not None and (not isinstance(entry, int) or isinstance(entry, bool) or entry < 1):
            raise ShardingError(f"{key!r}: block {list(entries)} must hold positive ints or None (whole axis)")
    return entries


def stored_block(fmt: ScaleFormat, block: Block) -> Block:
    """``block`` in stored elements: the last axis divided by the elements per stored item (packed FP4)."""
    if fmt.elements_per_item == 1 or not block or block[-1] is None:
        return block
    last = block[-1]
    if last % fmt.elements_per_item:
        raise ShardingError(f"format {fmt.name}: a block of {last} does not hold whole packed bytes")
    return (*block[:-1], last // fmt.elements_per_item)


def scale_grid_shape(shape: tuple[int, ...], block_in_stored: Block) -> tuple[int, ...]:
    """The shape of the scales of a (stored) tensor of ``shape``: one cell per block, a block at the end
    of an axis that the shape does not fill counting as one, and 1 on a whole-axis (None) block."""
    return tuple(1 if b is None else math.ceil(n / b) for n, b in zip(shape, block_in_stored, strict=True))
