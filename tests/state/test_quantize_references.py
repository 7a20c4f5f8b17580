"""The quantizers of :mod:`reshard.state.quantize` against the reference implementation of each format.

Each test runs the real reference code (torchao 0.18, compressed-tensors 0.20, on CPU) and reshard on the same
input and compares bytes: data, scales, global scales, and the dequantized float32 values (bit patterns; NaN
equal to NaN). The only place a difference is allowed is the FP4 code of a NaN element, which no reference
defines (the module docstring says why; the block's scale is NaN, so it dequantizes to NaN in both).
``dist`` tier: importing torchao and compressed-tensors takes seconds.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, nvfp4_quantize, per_tensor_amax_to_scale
from torchao.quantization.quant_primitives import (
    _choose_scale_float8,
    _dequantize_affine_float8,
    _quantize_affine_float8,
)

from reshard.state.quantize import Quantized, dequantize, quantize, unpack_fp4

pytestmark = pytest.mark.dist

Reference = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]]
"""x -> (data, scale, global scale or None, dequantized float32), as the reference computes them."""


def _pad(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """``x`` padded with zeros to a multiple of ``block`` on every axis (the references need whole blocks)."""
    pads: list[int] = []
    for n, b in zip(reversed(x.shape), reversed(block), strict=True):
        pads += [0, -n % b]
    return torch.nn.functional.pad(x, pads)


def _cut(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return t[tuple(slice(0, n) for n in shape)]


def _block_minmax(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block min and max (what an observer hands compressed-tensors' ``calculate_qparams``)."""
    padded = _pad(x, block)
    rows, cols = padded.shape[0] // block[0], padded.shape[1] // block[1]
    blocks = padded.reshape(rows, block[0], cols, block[1])
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def ct_fp8(strategy: str) -> Reference:
    """compressed-tensors' FP8 E4M3: scales from ``calculate_qparams``, data from ``quantize`` with the zero
    point ``initialize_module_for_quantization`` creates (force_zero_point), values from ``dequantize``."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        kwargs: dict[str, object] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
        if strategy == "block":
            kwargs["block_structure"] = [128, 128]
        args = QuantizationArgs(**kwargs)  # type: ignore[arg-type]
        if strategy == "tensor":
            low, high = torch.aminmax(x)
        elif strategy == "channel":
            low, high = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
        else:
            low, high = _block_minmax(x, (128, 128))
        scale, zero_point = calculate_qparams(low, high, args)
        data = ct_quantize(x, scale, zero_point, args, dtype=torch.float8_e4m3fn)
        values = ct_dequantize(data, scale, zero_point, args)
        return data, scale, None, values

    return run


def torchao_fp8_e5m2(block: tuple[int, int] | None) -> Reference:
    """torchao's float8 primitives (the ``Float8Tensor`` workflows) with E5M2: per-tensor (None), per-row
    ``(1, cols)`` or 2-D blocks; shapes the block does not divide are padded with zeros, then cut."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        size = list(x.shape) if block is None else [1, x.shape[1]] if block == (1, 0) else list(block)
        padded = _pad(x, tuple(size))
        scale = _choose_scale_float8(padded, size, torch.float8_e5m2)
        data = _cut(_quantize_affine_float8(padded, scale, torch.float8_e5m2), tuple(x.shape))
        values = _cut(_dequantize_affine_float8(_pad(data, tuple(size)), scale), tuple(x.shape))
        return data, scale, None, values

    return run


def torchao_mx(elem: torch.dtype) -> Reference:
    """torchao's ``to_mx`` (default ``ScaleCalculationMode.FLOOR``) and ``to_dtype``, on a last axis padded
    to whole blocks of 32."""

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        padded = _pad(x, (1, 32)).contiguous()
        scale, data = to_mx(padded, elem, 32)
        values = to_dtype(data, scale, elem, 32, torch.float32)
        cols = x.shape[1] // 2 if elem == torch.float4_e2m1fn_x2 else x.shape[1]
        return data[:, :cols], scale, None, values[:, : x.shape[1]]

    return run


def torchao_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """torchao's ``nvfp4_quantize`` with ``per_tensor_amax_to_scale(max |x|)``, and
    ``NVFP4Tensor.dequantize``; a last axis padded to whole blocks of 16."""
    padded = _pad(x, (1, 16)).contiguous()
    global_scale = per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    scale, data = nvfp4_quantize(padded, 16, global_scale)
    tensor = NVFP4Tensor.to_nvfp4(padded, per_tensor_scale=global_scale)
    assert torch.equal(tensor.qdata.view(torch.uint8), data)
    values = tensor.dequantize(torch.float32)
    return data[:, : x.shape[1] // 2], scale, global_scale, values[:, : x.shape[1]]


def ct_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """compressed-tensors' ``NVFP4`` scheme: ``generate_gparam``, ``calculate_qparams`` per group of 16 with
    E4M3 scales, ``quantize_and_pack_fp4``, and ``dequantize`` of the unpacked values."""
    args = QuantizationArgs(
        num_bits=4,
        type="float",
        symmetric=True,
        strategy="tensor_group",
        group_size=16,
        scale_dtype=torch.float8_e4m3fn,
    )
    padded = _pad(x, (1, 16))
    global_scale = generate_gparam(torch.amin(x), torch.amax(x))
    groups = padded.unflatten(-1, (padded.shape[1] // 16, 16))
    scale, _ = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args, global_scale=global_scale)
    data = quantize_and_pack_fp4(padded, scale, global_scale=global_scale, group_size=16)
    values = ct_dequantize(unpack_fp4(data), scale, None, args, dtype=torch.float32, global_scale=global_scale)
    return data[:, : x.shape[1] // 2], scale.to(torch.float8_e4m3fn), global_scale, values[:, : x.shape[1]]


# format, reshard's block, the reference
CASES: list[tuple[str, tuple[int | None, ...] | None, Reference]] = [
    ("fp8_e4m3", None, ct_fp8("tensor")),
    ("fp8_e4m3", (1, None), ct_fp8("channel")),
    ("fp8_e4m3", (128, 128), ct_fp8("block")),
    ("fp8_e5m2", None, torchao_fp8_e5m2(None)),
    ("fp8_e5m2", (1, None), torchao_fp8_e5m2((1, 0))),
    ("fp8_e5m2", (128, 128), torchao_fp8_e5m2((128, 128))),
    ("mxfp8_e4m3", None, torchao_mx(torch.float8_e4m3fn)),
    ("mxfp8_e5m2", None, torchao_mx(torch.float8_e5m2)),
    ("mxfp4", None, torchao_mx(torch.float4_e2m1fn_x2)),
    ("nvfp4", None, torchao_nvfp4),
    ("nvfp4_divisor", None, ct_nvfp4),
]
IDS = [f"{fmt}-{block}" for fmt, block, _ in CASES]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` (any dtype) as integers, every NaN of a float tensor as one pattern (the
    sign of a NaN is left unspecified: the references' reductions disagree on it)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        nan = torch.isnan(t.float())
        return torch.where(nan, torch.full_like(t.view(torch.uint8), 0x7F), t.view(torch.uint8)).flatten()
    if t.dtype.is_floating_point and t.element_size() >= 2:
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints).flatten()


def assert_same(ours: Quantized, values: torch.Tensor, ref: tuple[torch.Tensor, ...], *, nan_codes: bool) -> None:
    """Data, scale, global scale and values equal bit for bit; with ``nan_codes``, the FP4 codes of NaN
    elements are left out (the one thing no reference defines)."""
    data, scale, global_scale, ref_values = ref
    mine, theirs = _bits(ours.data), _bits(data.view(ours.data.dtype) if data.dtype != ours.data.dtype else data)
    assert mine.shape == theirs.shape
    assert torch.equal(_bits(ours.scale), _bits(scale.view(ours.scale.dtype).to(ours.scale.dtype)))
    if global_scale is None:
        assert ours.global_scale is None
    else:
        assert ours.global_scale is not None and torch.equal(_bits(ours.global_scale), _bits(global_scale))
    assert torch.equal(_bits(values), _bits(ref_values.to(torch.float32)))
    if nan_codes:
        keep = ~torch.isnan(values).flatten()
        mine, theirs = mine[keep[0::2] & keep[1::2]], theirs[keep[0::2] & keep[1::2]]
    assert torch.equal(mine, theirs)


def _run(fmt: str, block: tuple[int | None, ...] | None, reference: Reference, x: torch.Tensor) -> None:
    ours = quantize(x, fmt, block)
    values = dequantize(ours.data, ours.scale, fmt, block, ours.global_scale)
    ref = reference(x.float() if fmt.startswith("fp8_") or fmt == "nvfp4_divisor" else x)
    assert_same(ours, values, ref, nan_codes=fmt in ("mxfp4", "nvfp4", "nvfp4_divisor"))


@pytest.mark.parametrize(("fmt", "block", "reference"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(256, 384), (300, 200)])
def test_random_inputs_equal_the_reference(fmt, block, reference, dtype, shape) -> None:
    """Random normal inputs (and a wide-range mix of magnitudes): every byte and value is the reference's,
    on shapes the blocks divide and on shapes whose last blocks are partial."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{fmt}{block}{dtype}{shape}".encode()))
    x = torch.randn(shape, generator=generator)
    x = x * torch.exp2(torch.randint(-20, 20, shape, generator=generator).float())
    _run(fmt, block, reference, x.to(dtype))


def edge_tensor(dtype: torch.dtype) -> torch.Tensor:
    """Rows of 128 (four MX blocks, eight NVFP4 blocks): zero blocks with -0.0, subnormals, tiny amax,
    values at and beyond FP8 maxima (huge finite values), exact FP4 ties after scaling, mixed signs."""
    rows = []
    rows.append(torch.zeros(128))
    rows.append(torch.tensor([-0.0, 0.0] * 64))
    rows.append(torch.full((128,), 1e-40) * torch.arange(128).remainder(3).sub(1))  # subnormal amax
    rows.append(torch.linspace(-1e-30, 1e-30, 128))  # tiny amax
    rows.append(torch.tensor([448.0, -448.0, 464.0, 480.0, 57344.0, -61440.0, 1e30, -3e38] * 16))
    rows.append(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 16) * torch.tensor([1.0, -1.0] * 64))
    rows.append(torch.tensor([6.0, 0.1, -0.1, -0.0, 1e-3, -5.0, 2.9, 3.1] * 16))
    rows.append(torch.linspace(-300.0, 300.0, 128))
    return torch.stack(rows).to(dtype)


@pytest.mark.parametrize(("fmt", "block", "reference"), CASES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_edge_cases_equal_the_reference(fmt, block, reference, dtype) -> None:
    """Zero blocks, negative zero, subnormals, tiny amax, saturation: the reference's bytes, where the
    reference is defined there. Excluded, and tested in test_quantize.py as reshard's choices: torchao's
    FP8 E5M2 of an all-zero block (0 / 0) and torchao's NVFP4 of an all-zero tensor."""
    x = edge_tensor(dtype)
    if fmt == "fp8_e5m2":
        x = x + 1e-3  # torchao divides 0 by 0 on a zero block (reshard uses a scale of 2**-23 there)
        x[1, ::2] = -0.0
    if block == (128, 128):
        x = torch.cat([x, -x.flip(0)] * 20)[:150]
    _run(fmt, block, reference, x.to(dtype))


@pytest.mark.parametrize(("fmt", "block", "reference"), CASES, ids=IDS)
def test_nan_and_inf_equal_the_reference(fmt, block, reference) -> None:
    """NaN makes its block's scale NaN and the block dequantize to NaN; inf saturates (and, under the
    block's amax, pushes its neighbours to zero). Global-scale formats get the global scale the
    reference computes from the same amax (reshard's choice for a non-finite amax is in test_quantize.py)."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    x[2, 100] = -float("inf")
    x[3, 0] = float("nan")
    x[3, 1] = -float("inf")
    if fmt in ("nvfp4", "nvfp4_divisor"):
        finite = x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        _run_with_global(fmt, finite, x)
        return
    if block == (128, 128):
        x = torch.cat([x] * 64)
    _run(fmt, block, reference, x)


def _run_with_global(fmt: str, finite: torch.Tensor, x: torch.Tensor) -> None:
    """NVFP4 formats on ``x`` with the global scale of ``finite``'s amax, reshard and the reference."""
    from reshard.state.quantize import block_amax, global_scale_from_amax, quantize_with_scales, scales_from_amax

    g = global_scale_from_amax(finite.abs().amax(), fmt)
    scale = scales_from_amax(block_amax(x, fmt), fmt, g)
    ours = Quantized(quantize_with_scales(x, scale, fmt, None, g), scale, g)
    values = dequantize(ours.data, scale, fmt, None, g)
    if fmt == "nvfp4":
        ref_scale, data = nvfp4_quantize(x, 16, g)
        tensor = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=g)
        ref = (data, ref_scale, g, tensor.dequantize(torch.float32))
    else:
        args = QuantizationArgs(
            num_bits=4,
            type="float",
            symmetric=True,
            strategy="tensor_group",
            group_size=16,
            scale_dtype=torch.float8_e4m3fn,
        )
        groups = x.unflatten(-1, (x.shape[1] // 16, 16))
        scale32, _ = calculate_qparams(groups.amin(dim=-1), groups.amax(dim=-1), args, global_scale=g)
        data = quantize_and_pack_fp4(x, scale32, global_scale=g, group_size=16)
        ref_values = ct_dequantize(unpack_fp4(data), scale32, None, args, dtype=torch.float32, global_scale=g)
        ref = (data, scale32.to(torch.float8_e4m3fn), g, ref_values)
    assert_same(ours, values, ref, nan_codes=True)
    assert torch.isnan(values[0, :16]).all() and not torch.isnan(values[0, 16:]).any()


def test_mx_scale_mode_is_torchao_default() -> None:
    """The reference's default scale mode is FLOOR (the one reshard follows); a mode change upstream fails
    here rather than in a silent difference."""
    import inspect

    from torchao.prototype.mx_formats.constants import F32_MIN_NORMAL
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode

    assert inspect.signature(to_mx).parameters["scaling_mode"].default == ScaleCalculationMode.FLOOR
    assert math.ldexp(1.0, -126) == F32_MIN_NORMAL
