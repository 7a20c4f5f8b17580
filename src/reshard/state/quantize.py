"""Quantizers: high-precision tensors to the low-precision formats of :mod:`reshard.state.lowprec`, and back.

Each format is computed with the same floating-point operations, in the same order, as ONE reference
implementation that real consumers use, so the bytes are equal to the reference's bit for bit on the same
input (``tests/state/test_quantize_references.py`` runs the references):

=================  =========================================================================================
format             reference (the code reshard's operations follow)
=================  =========================================================================================
``fp8_e4m3``       compressed-tensors 0.20: ``calculate_qparams`` (scale = amax / 448) and the
                   ``float-quantized`` compressor's ``quantize`` (``x / scale + zero_point``, clamp, cast),
                   strategies TENSOR (block all None), CHANNEL (``(1, None)``) and BLOCK (``FP8_BLOCK``,
                   ``(128, 128)``; any other block shape the same way); ``dequantize`` (``data * scale``).
``fp8_e5m2``       torchao 0.18: ``_choose_scale_float8`` (scale = amax / 57344) and
                   ``_quantize_affine_float8`` / ``_dequantize_affine_float8`` (compressed-tensors has no
                   E5M2).
``mxfp8_e4m3``,    torchao 0.18 ``to_mx`` with its default ``ScaleCalculationMode.FLOOR`` (the E8M0 exponent
``mxfp8_e5m2``,    is floor(log2(amax)) minus the element's largest exponent: 8, 15, 2) and ``to_dtype``.
``mxfp4``
``nvfp4``          torchao 0.18 ``nvfp4_quantize`` with ``per_tensor_scale = per_tensor_amax_to_scale(amax)``
                   (amax / 2688), and ``NVFP4Tensor.dequantize``.
``nvfp4_divisor``  compressed-tensors 0.20: ``generate_gparam`` (2688 / amax), ``calculate_qparams`` with
                   ``scale_dtype=float8_e4m3fn`` (the ``NVFP4`` scheme), ``quantize_and_pack_fp4`` and the
                   ``nvfp4-pack-quantized`` decompression.
=================  =========================================================================================

transformers' FineGrainedFP8 (``Fp8Quantize``, the ``weight_scale_inv`` layout) is not the reference of
128x128 blocks, though it runs on CPU: it multiplies the data by ``448 / amax`` and stores the scale as
``1 / (448 / amax)``; the multiplier cannot be recovered from the stored scale (``1 / (1 / m) != m`` for 15%
of float32 values), so a sender that computes scales first and data second (a distributed quantization)
could not reproduce it, and it leaves tensors whose shape the block does not divide unquantized. Its
loader dequantizes reshard's bytes as ``data * scale``, the value reshard's :func:`dequantize` gives.

**Amax** (:func:`block_amax`): the largest absolute value of each block, in float32 (``abs`` then ``amax``;
a bfloat16 or float16 input is widened exactly first). A block the tensor's shape does not fill (the last
along an axis the block does not divide) has the amax of the elements it holds: the result is the
reference's on the input padded with zeros (torchao and transformers refuse such shapes; compressed-
tensors pads). A NaN anywhere in a block makes its amax NaN; an inf makes it inf. The amax of a block is the
max of the amaxes of any split of it (``torch.maximum`` of the parts, NaN winning), which is how a
distributed sender combines partial blocks before :func:`scales_from_amax`.

**Scales** (:func:`scales_from_amax`), per format:

- FP8: ``amax / max`` in float32 (448 or 57344); a zero amax gives ``2**-23`` (float32's eps, as
  compressed-tensors; torchao's E5M2 would divide 0 by 0: reshard uses the same eps there).
- MX (FLOOR): the E8M0 byte ``clamp(e(amax) - emax, -127, 128) + 127`` where ``e`` is the float32 exponent
  field minus 127 (a subnormal or zero amax counts as ``-127``, inf as ``128``), 255 for a NaN amax.
- ``nvfp4``: ``clamp((amax / 6) / g, 2**-6, 448)`` rounded to E4M3 (never an E4M3 subnormal).
- ``nvfp4_divisor``: ``clamp(g * (amax / 6), -448, 448)`` rounded to E4M3, a zero result replaced by
  0.125 (compressed-tensors' eps of E4M3: so an all-zero or tiny block has scale 0.125).

**Global scales** (:func:`global_scale_from_amax`, the NVFP4 formats, from the amax of the whole tensor):
``nvfp4``: ``amax / 2688``; torchao leaves a zero (all-zero tensor), inf or NaN global scale as it is and
then writes NaN scales and undefined data, so reshard uses 1.0 there (a documented choice; every finite
nonzero amax is torchao's). ``nvfp4_divisor``: ``2688 / max(amax, float32 tiny)`` with NaN and inf replaced
by 1.0, exactly compressed-tensors' (an all-zero tensor gets 1.0; an inf amax gets 0.0, its blocks then
quantize to zero).

**Data** (:func:`quantize_with_scales`), in float32 after widening the input:

- FP8: ``x / scale`` (E4M3 adds compressed-tensors' zero point ``+ 0.0``, which turns ``-0.0`` into
  ``+0.0``; E5M2 keeps ``-0.0`` as torchao), clamped to ``[-max, max]`` (saturation: values beyond the
  format's max, and inf, become the max; NaN stays NaN), then cast with round-to-nearest-even (E4M3
  subnormals included).
- MX: ``x / max(2**(byte - 127), 2**-126)``: torchao divides by the smallest float32 normal when the byte is 0
  (a block whose amax is below ``2**(emax - 126)``, zero blocks included) although the byte means
  ``2**-127``, so :func:`dequantize` of such a block gives half the quantized value: torchao's own result,
  kept bit for bit. FP8 elements then clamp and cast as above; FP4 elements saturate at 6 (inf too).
- ``nvfp4``: ``x * ((1 / g) / scale)`` (torchao multiplies by a reciprocal), clamp to ``[-6, 6]``.
- ``nvfp4_divisor``: ``x / (scale / g)``, clamp to ``[-6, 6]``.
- FP4 rounding is to the nearest E2M1 value, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
  1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). Two elements per byte along the last axis, the first in the low
  nibble; the sign is bit 3 of a code.

**Negative zero** (where the two NVFP4 references disagree): torchao (``nvfp4``, ``mxfp4``) keeps the sign
bit of any value that rounds to zero, ``-0.0`` included (code 8); compressed-tensors (``nvfp4_divisor``)
takes the sign from ``torch.sign``, which is 0 for ``-0.0``: an exact ``-0.0`` becomes code 0 but a small
negative value that rounds to zero becomes code 8. Each format follows its reference.

**NaN elements**: a NaN makes its block's scale NaN (E8M0 255, E4M3 NaN, float32 NaN), so
:func:`dequantize` gives NaN for the whole block under every format. FP8 data keeps the NaN. FP4 has no NaN
code: torchao's bit arithmetic on a NaN gives a code that depends on the NaN's payload and
compressed-tensors' packing casts NaN to int8 (undefined), so reshard writes the zero code (with the sign
rule above); the data bytes of NaN elements are the one place reshard and a reference may differ, and the
block dequantizes to NaN either way.

**Inputs**: float32, bfloat16 or float16 (widened exactly to float32: every reference's float32 result on
``x.float()``; torchao's MX and NVFP4 widen bfloat16 themselves, while compressed-tensors and torchao's
float8 primitives on a bfloat16 tensor would round the scale to bfloat16 first, which the float32 scales of
these formats do not). The sign and payload of a NaN (amax, scale, FP8 data) are not specified: the
references' reductions themselves disagree on them. Packed FP4 needs an even last
axis. Quantization is deterministic (no randomness, elementwise float32 operations).

These functions are importable from ``reshard.state.quantize`` (the package's top level keeps checkpoint
operations and the state types).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reshard.errors import ShardingError, StateDictError
from reshard.state.lowprec import Block, ScaleFormat, normalize_block, scale_format, scale_grid_shape

__all__ = [
    "INPUT_DTYPE_NAMES",
    "Quantized",
    "block_amax",
    "dequantize",
    "global_scale_from_amax",
    "pack_fp4",
    "quantize",
    "quantize_with_scales",
    "scales_from_amax",
    "unpack_fp4",
]

_FP4_MAX = 6.0
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_MX_EMAX = {"mxfp8_e4m3": 8, "mxfp8_e5m2": 15, "mxfp4": 2}
_NVFP4_AMAX_DIVISOR = 448.0 * 6.0
_FP8_ZERO_SCALE = float(torch.finfo(torch.float32).eps)
_E4M3_ZERO_SCALE = 0.125
_E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)
_F32_TINY = float(torch.finfo(torch.float32).tiny)
_E8M0_NAN = 255
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INPUT_DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The names of the dtypes :func:`quantize` takes (and a transfer quantizes on the way)."""
# E2M1 codes 0..15 as values (bit 3 is the sign).
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The E2M1 rounding thresholds: a magnitude passes (>) or reaches (>=) each; ties go to the even code.
_FP4_UP_STRICT = (0.25, 1.25, 2.5, 5.0)
_FP4_UP_REACH = (0.75, 1.75, 3.5)


@dataclass(frozen=True)
class Quantized:
    """A quantized tensor: ``data`` in the format's stored dtype (FP4 packed into uint8, two per byte),
    ``scale`` (one per block, the scale grid's shape, the format's scale dtype) and, for the NVFP4 formats,
    the 0-d float32 ``global_scale`` (else None)."""

    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None


def _format(fmt: str | ScaleFormat) -> ScaleFormat:
    return fmt if isinstance(fmt, ScaleFormat) else scale_format(fmt)


def _logical_block(fmt: ScaleFormat, shape: tuple[int, ...], block: Block | None) -> Block:
    """The block shape in logical elements, with every whole-axis entry still None."""
    return normalize_block(fmt, block, len(shape), key="quantize")


def _check_input(x: torch.Tensor, fmt: ScaleFormat) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype not in _INPUT_DTYPES:
        what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise StateDictError(f"format {fmt.name}: quantize takes float32, bfloat16 or float16 tensors, not {what}")
    if fmt.elements_per_item == 2 and (x.ndim == 0 or x.shape[-1] % 2):
        raise ShardingError(f"format {fmt.name}: packed FP4 needs an even last axis, not shape {list(x.shape)}")


def block_amax(x: torch.Tensor, fmt: str | ScaleFormat, block: Block | None = None) -> torch.Tensor:
    """The float32 amax (largest absolute value) of each block of ``x``, shaped as the scale grid.

    ``x`` is the logical (unpacked) high-precision tensor or any box of it whose offsets are multiples of the
    block; a block ``x`` does not fill counts the elements it holds. NaN propagates. The amax of a block is
    the ``torch.maximum`` of the amaxes of its parts, which is how a sender that holds part of a block
    combines it with the others'.
    """
    spec = _format(fmt)
    _check_input(x, spec)
    lblock = _logical_block(spec, tuple(x.shape), block)
    magnitude = x.float().abs()
    if x.ndim == 0:
        return magnitude
    sizes = [max(n, 1) if b is None else b for n, b in zip(x.shape, lblock, strict=True)]
    pads: list[int] = []
    # An empty axis has no cells along a blocked axis (the scale grid's ceil(0 / b)) and one along a whole
    # axis (padded to one element): the shapes ScaledTensor derives for the scales.
    for n, s, b in zip(reversed(x.shape), reversed(sizes), reversed(lblock), strict=True):
        pads += [0, -n % s if n else (1 if b is None else 0)]
    padded = torch.nn.functional.pad(magnitude, pads) if any(pads) else magnitude
    blocked = padded.reshape([v for n, s in zip(padded.shape, sizes, strict=True) for v in (n // s, s)])
    return blocked.amax(dim=tuple(range(1, 2 * x.ndim, 2)))


def global_scale_from_amax(tensor_amax: torch.Tensor, fmt: str | ScaleFormat) -> torch.Tensor:
    """The 0-d float32 global scale of an NVFP4-format tensor whose amax (over the whole tensor) is given.

    ``nvfp4``: ``amax / 2688`` (torchao's ``per_tensor_amax_to_scale``), 1.0 where that is zero or not
    finite; ``nvfp4_divisor``: ``2688 / max(amax, tiny)``, NaN and inf replaced by 1.0 (compressed-tensors'
    ``generate_gparam``).

    Raises:
        ShardingError: the format has no global scale.
    """
    spec = _format(fmt)
    amax = torch.as_tensor(tensor_amax).to(torch.float32).reshape(())
    if spec.global_scale == "multiply":
        scale = amax / _NVFP4_AMAX_DIVISOR
        return torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
    if spec.global_scale == "divide":
        scale = _NVFP4_AMAX_DIVISOR / torch.clamp(amax, min=_F32_TINY)
        return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0)
    raise ShardingError(f"format {spec.name} has no global scale")


def _global(spec: ScaleFormat, global_scale: torch.Tensor | None) -> torch.Tensor:
    if spec.global_scale is None:
        if global_scale is not None:
            raise ShardingError(f"format {spec.name} has no global scale, but one was given")
        return torch.ones(())
    if global_scale is None:
        raise ShardingError(f"format {spec.name} needs its global scale (see global_scale_from_amax)")
    if global_scale.numel() != 1 or global_scale.dtype != torch.float32:
        raise ShardingError(f"format {spec.name}: the global scale is one float32 value, not {global_scale!r}")
    return global_scale.reshape(())


def scales_from_amax(
    amax: torch.Tensor, fmt: str | ScaleFormat, global_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The scales of blocks whose float32 amaxes are given, in the format's natural scale dtype (same shape).

    Raises:
        ShardingError: an NVFP4 format without its global scale, or another format with one.
    """
    spec = _format(fmt)
    amax = amax.to(torch.float32)
    g = _global(spec, global_scale)
    if spec.name in _MX_EMAX:
        return _e8m0_from_amax(amax, _MX_EMAX[spec.name])
    if spec.global_scale == "multiply":
        scaled = (amax / _FP4_MAX) / g
        return torch.clamp(scaled, min=_E4M3_TINY, max=448.0).to(torch.float8_e4m3fn)
    if spec.global_scale == "divide":
        rounded = torch.clamp(g * (amax / _FP4_MAX), -448.0, 448.0).to(torch.float8_e4m3fn)
        zero = torch.full_like(rounded, _E4M3_ZERO_SCALE)
        return torch.where(rounded.float() == 0, zero.float(), rounded.float()).to(torch.float8_e4m3fn)
    scale = amax / _FP8_MAX[spec.data_dtypes[0]]
    return torch.where(scale == 0, torch.full_like(scale, _FP8_ZERO_SCALE), scale)


def _e8m0_from_amax(amax: torch.Tensor, emax: int) -> torch.Tensor:
    """torchao's FLOOR scale: the float32 exponent of amax minus the element's largest exponent, biased."""
    exponent = (torch.bitwise_right_shift(amax.view(torch.int32), 23) & 0xFF) - 127
    biased = torch.clamp(exponent - emax, min=-127, max=128) + 127
    biased = torch.where(torch.isnan(amax), torch.full_like(biased, _E8M0_NAN), biased)
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand(cells: torch.Tensor, shape: tuple[int, ...], block: Block) -> torch.Tensor:
    """Per-block values repeated over their blocks (a partial last block cut), broadcastable to ``shape``."""
    out = cells
    for axis, (n, b) in enumerate(zip(shape, block, strict=True)):
        if b is not None and b > 1:
            out = out.repeat_interleave(b, dim=axis).narrow(axis, 0, n)
    return out


def _check_scale(spec: ScaleFormat, scale: torch.Tensor, shape: tuple[int, ...], block: Block) -> torch.Tensor:
    grid = scale_grid_shape(shape, block)
    if not isinstance(scale, torch.Tensor) or scale.dtype not in spec.scale_dtypes:
        what = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ShardingError(f"format {spec.name}: scales are {[str(d) for d in spec.scale_dtypes]}, not {what}")
    if tuple(scale.shape) != grid and not (scale.numel() == 1 and all(g == 1 for g in grid)):
        raise ShardingError(
            f"format {spec.name}: a tensor of shape {list(shape)} in blocks {list(block)} has scales of shape "
            f"{list(grid)}, not {list(scale.shape)}"
        )
    return scale.reshape(grid)


def _mx_divisor(scale: torch.Tensor) -> torch.Tensor:
    """torchao's float32 divisor of an E8M0 scale: 2**(byte - 127), at least the smallest float32 normal."""
    bits = torch.bitwise_left_shift(scale.view(torch.uint8).to(torch.int32), 23)
    return torch.clamp(bits.view(torch.float32), min=2.0**-126)


def quantize_with_scales(
    x: torch.Tensor,
    scale: torch.Tensor,
    fmt: str | ScaleFormat,
    block: Block | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` (logical, high precision) quantized with the given block scales: the data in the stored dtype.

    ``scale`` has the scale grid's shape (:func:`scales_from_amax` of :func:`block_amax`); FP4 comes back
    packed (uint8, last axis halved). Equal to :func:`quantize`'s data for the scales it computes.

    Raises:
        StateDictError: ``x`` is not float32, bfloat16 or float16.
        ShardingError: scales of another shape or dtype, a missing or unexpected global scale, an odd last
            axis for packed FP4.
    """
    spec = _format(fmt)
    _check_input(x, spec)
    shape = tuple(x.shape)
    lblock = _logical_block(spec, shape, block)
    cells = _check_scale(spec, scale, shape, lblock)
    g = _global(spec, global_scale)
    xf = x.float()
    if spec.name in _MX_EMAX:
        values = xf / _expand(_mx_divisor(cells), shape, lblock)
    elif spec.global_scale == "multiply":
        values = xf * _expand((1.0 / g) / cells.float(), shape, lblock)
    elif spec.global_scale == "divide":
        values = xf / _expand(cells.float() / g, shape, lblock)
    else:
        values = xf / _expand(cells.float(), shape, lblock)
        if spec.name == "fp8_e4m3":
            values = values + 0.0  # compressed-tensors adds its zero point: -0.0 becomes +0.0
    if spec.elements_per_item == 1:
        top = _FP8_MAX[spec.data_dtypes[0]]
        return torch.clamp(values, -top, top).to(spec.data_dtypes[0])
    values = torch.clamp(values, -_FP4_MAX, _FP4_MAX)
    return pack_fp4(_fp4_codes(values, negative_zero=spec.global_scale != "divide"))


def _fp4_codes(values: torch.Tensor, *, negative_zero: bool) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of float32 values already clamped to [-6, 6], ties to the even code.

    ``negative_zero``: the sign bit of every value (torchao); otherwise only of values below zero
    (compressed-tensors, whose ``torch.sign(-0.0)`` is 0). NaN gives the zero code.
    """
    magnitude = values.abs()
    codes = torch.zeros(values.shape, dtype=torch.uint8)
    for threshold in _FP4_UP_STRICT:
        codes += (magnitude > threshold).to(torch.uint8)
    for threshold in _FP4_UP_REACH:
        codes += (magnitude >= threshold).to(torch.uint8)
    negative = torch.signbit(values) if negative_zero else values < 0
    negative = negative & ~torch.isnan(values)
    return codes | (negative.to(torch.uint8) << 3)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, even last axis) packed two per byte, the first of each pair in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed FP4 (uint8 or float4_e2m1fn_x2) as float32 values, the last axis doubled."""
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).reshape(*raw.shape[:-1], raw.shape[-1] * 2)
    return torch.tensor(_FP4_VALUES, dtype=torch.float32)[codes.long()]


def quantize(x: torch.Tensor, fmt: str | ScaleFormat, block: Block | None = None) -> Quantized:
    """``x`` quantized to ``fmt`` in one call: :func:`block_amax`, then (NVFP4 formats) the global scale from
    the tensor's amax, then :func:`scales_from_amax`, then :func:`quantize_with_scales`.

    ``block`` is per logical axis (None entries: whole axis); None is the format's own block, or per-tensor
    scaling for the FP8 formats.
    """
    spec = _format(fmt)
    amax = block_amax(x, spec, block)
    global_scale = None
    if spec.global_scale is not None:
        tensor_amax = amax.amax() if amax.numel() else torch.zeros((), dtype=torch.float32)
        global_scale = global_scale_from_amax(tensor_amax, spec)
    scale = scales_from_amax(amax, spec, global_scale)
    return Quantized(quantize_with_scales(x, scale, spec, block, global_scale), scale, global_scale)


def dequantize(
    data: torch.Tensor,
    scale: torch.Tensor,
    fmt: str | ScaleFormat,
    block: Block | None = None,
    global_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The values of quantized ``data`` (the stored tensor: FP4 packed), computed in float32, then ``dtype``.

    FP8 and MX: ``data * scale`` (an E8M0 byte is ``2**(byte - 127)``, 255 is NaN); ``nvfp4``:
    ``data * (g * scale)``; ``nvfp4_divisor``: ``data * (scale / g)``: each its reference's operations.

    Raises:
        ShardingError: data of a dtype the format does not store, scales of another shape or dtype, a
            missing or unexpected global scale.
    """
    spec = _format(fmt)
    if not isinstance(data, torch.Tensor) or data.dtype not in spec.data_dtypes:
        what = data.dtype if isinstance(data, torch.Tensor) else type(data).__name__
        raise ShardingError(f"format {spec.name}: data is {[str(d) for d in spec.data_dtypes]}, not {what}")
    values = unpack_fp4(data) if spec.elements_per_item == 2 else data.to(torch.float32)
    shape = tuple(values.shape)
    lblock = _logical_block(spec, shape, block)
    cells = _check_scale(spec, scale, shape, lblock)
    g = _global(spec, global_scale)
    if spec.name in _MX_EMAX:
        raw = cells.view(torch.uint8)
        factor = torch.pow(torch.full(raw.shape, 2.0), raw.to(torch.int16) - 127)
        factor = torch.where(raw != _E8M0_NAN, factor, torch.full_like(factor, float("nan")))
    elif spec.global_scale == "multiply":
        factor = g * cells.float()
    elif spec.global_scale == "divide":
        factor = cells.float() / g
    else:
        factor = cells.float()
    return (values * _expand(factor, shape, lblock)).to(dtype)
