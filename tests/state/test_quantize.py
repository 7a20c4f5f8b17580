"""The quantizers' own rules, in one process with no reference library (those are in
``test_quantize_references.py``): the split a distributed sender uses equals the one-call :func:`quantize`
bit for bit, and reshard's documented choices (zero tensors, negative zero, saturation, FP4 ties, NaN,
errors) hold.
"""

from __future__ import annotations

import pytest
import torch

from reshard.errors import ShardingError, StateDictError
from reshard.state.lowprec import FORMATS
from reshard.state.quantize import (
    block_amax,
    dequantize,
    global_scale_from_amax,
    pack_fp4,
    quantize,
    quantize_with_scales,
    scales_from_amax,
    unpack_fp4,
)

pytestmark = pytest.mark.unit

BLOCKS: list[tuple[str, tuple[int | None, ...] | None]] = [
    ("fp8_e4m3", None),
    ("fp8_e4m3", (1, None)),
    ("fp8_e4m3", (128, 128)),
    ("fp8_e5m2", None),
    ("fp8_e5m2", (1, None)),
    ("fp8_e5m2", (128, 128)),
    ("fp8_e4m3", (3, 40)),
    ("mxfp8_e4m3", None),
    ("mxfp8_e5m2", None),
    ("mxfp4", None),
    ("nvfp4", None),
    ("nvfp4_divisor", None),
]
IDS = [f"{fmt}-{block}" for fmt, block in BLOCKS]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t``, every NaN as one pattern (a NaN's sign and payload are unspecified)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.where(torch.isnan(t.float()), torch.full_like(t.view(torch.uint8), 0x7F), t.view(torch.uint8))
    if t.dtype.is_floating_point and t.element_size() > 1:
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def sample(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-12, 12, shape, generator=generator))
    x[0, :40] = 0.0  # a zero block or two
    x[1, 3] = -0.0
    return x.to(dtype)


def test_every_format_has_a_case() -> None:
    assert {fmt for fmt, _ in BLOCKS} == set(FORMATS)


def _half_masks(shape: tuple[int, ...], block: tuple[int | None, ...]) -> torch.Tensor:
    """True on the first half of every block along its last blocked axis (so each block is split in two)."""
    axis = max(i for i, b in enumerate(block) if b is None or b > 1) if any(b != 1 for b in block) else 0
    size = shape[axis] if block[axis] is None else block[axis]
    assert size is not None
    index = torch.arange(shape[axis]) % size < (size + 1) // 2
    return index.reshape([-1 if i == axis else 1 for i in range(len(shape))]).expand(shape)


@pytest.mark.parametrize(("fmt", "block"), BLOCKS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amax_of_two_halves_then_scales_then_data_equals_quantize(fmt, block, dtype) -> None:
    """The sender's steps: each half of every block gives its amax (the other half zero, which changes no
    amax), the block's amax is their max, then the global scale, the scales, the data: equal to quantize."""
    x = sample((300, 200), 7, dtype)
    x[5, 17] = float("nan")
    x[9, 150] = float("inf")
    full = quantize(x, fmt, block)
    logical = FORMATS[fmt]
    own = (
        block
        if block is not None
        else (None, None)
        if logical.fixed_last_block is None
        else (1, logical.fixed_last_block)
    )
    first = _half_masks(tuple(x.shape), own)
    zero = torch.zeros((), dtype=dtype)
    amax = torch.maximum(
        block_amax(torch.where(first, x, zero), fmt, block), block_amax(torch.where(first, zero, x), fmt, block)
    )
    assert torch.equal(bits(amax), bits(block_amax(x, fmt, block)))
    global_scale = global_scale_from_amax(amax.amax(), fmt) if logical.global_scale else None
    scale = scales_from_amax(amax, fmt, global_scale)
    data = quantize_with_scales(x, scale, fmt, block, global_scale)
    assert same(scale, full.scale) and same(global_scale, full.global_scale) and same(data, full.data)


@pytest.mark.parametrize(("fmt", "block"), BLOCKS, ids=IDS)
def test_a_box_on_block_boundaries_quantizes_as_its_part_of_the_whole(fmt, block) -> None:
    """A rank holding rows [128, 300) and columns [64, 200) (block boundaries, running to the ends) computes
    its amaxes, and with the whole tensor's scales (and global scale) its data: the whole's slice."""
    x = sample((300, 200), 11)
    full = quantize(x, fmt, block)
    spec = FORMATS[fmt]
    own = block if block is not None else (None, None) if spec.fixed_last_block is None else (1, spec.fixed_last_block)
    if any(b is None for b in own):
        return  # a whole-axis block has one cell: the box's amax is a part of it (the test above)
    row0, col0 = 130 // own[0] * own[0], 130 // own[1] * own[1]
    rows, cols = slice(row0 // own[0], None), slice(col0 // own[1], None)
    box = x[row0:, col0:]
    assert torch.equal(bits(block_amax(box, fmt, block)), bits(block_amax(x, fmt, block)[rows, cols]))
    data = quantize_with_scales(box, full.scale[rows, cols].contiguous(), fmt, block, full.global_scale)
    per_item = spec.elements_per_item
    assert same(data, full.data[row0:, col0 // per_item :].contiguous())


def test_three_axis_tensors_block_per_expert() -> None:
    """A stacked expert weight (E, rows, cols) in (1, 128, 128) blocks is each expert's 2-D quantization."""
    x = torch.stack([sample((130, 260), seed) for seed in range(3)])
    whole = quantize(x, "fp8_e4m3", (1, 128, 128))
    for expert in range(3):
        alone = quantize(x[expert], "fp8_e4m3", (128, 128))
        assert same(whole.data[expert], alone.data) and same(whole.scale[expert], alone.scale)


def test_bfloat16_input_is_quantized_as_its_exact_float32_value() -> None:
    x = sample((64, 96), 3, torch.bfloat16)
    for fmt, block in BLOCKS:
        a, b = quantize(x, fmt, block), quantize(x.float(), fmt, block)
        assert same(a.data, b.data) and same(a.scale, b.scale) and same(a.global_scale, b.global_scale)


def test_all_zero_tensors_quantize_to_zeros_with_the_documented_scales() -> None:
    """reshard's choices where a reference divides 0 by 0 (torchao's E5M2 float8, torchao's NVFP4 global
    scale of a zero tensor), and compressed-tensors' eps elsewhere."""
    x = torch.zeros(4, 64)
    expected_scale = {"fp8_e4m3": 2.0**-23, "fp8_e5m2": 2.0**-23, "nvfp4": 2.0**-6, "nvfp4_divisor": 0.125}
    for fmt in FORMATS:
        q = quantize(x, fmt)
        assert not bits(q.data).any(), fmt
        assert torch.equal(dequantize(q.data, q.scale, fmt, None, q.global_scale), x), fmt
        if fmt in expected_scale:
            assert (q.scale.float() == expected_scale[fmt]).all(), fmt
        else:
            assert not q.scale.view(torch.uint8).any(), fmt  # E8M0 byte 0
        if q.global_scale is not None:
            assert q.global_scale.item() == 1.0


def test_nvfp4_global_scale_of_a_non_finite_amax_is_one_and_the_divisor_follows_compressed_tensors() -> None:
    for amax in (float("nan"), float("inf"), 0.0):
        assert global_scale_from_amax(torch.tensor(amax), "nvfp4").item() == 1.0
    assert global_scale_from_amax(torch.tensor(float("nan")), "nvfp4_divisor").item() == 1.0
    assert global_scale_from_amax(torch.tensor(float("inf")), "nvfp4_divisor").item() == 0.0
    assert global_scale_from_amax(torch.tensor(5376.0), "nvfp4").item() == 2.0
    assert global_scale_from_amax(torch.tensor(1344.0), "nvfp4_divisor").item() == 2.0
    with pytest.raises(ShardingError, match="no global scale"):
        global_scale_from_amax(torch.tensor(1.0), "mxfp4")


def test_negative_zero_follows_each_formats_reference() -> None:
    x = torch.tensor([[-0.0, -0.01, 1.0, 0.0] * 8])
    assert quantize(x, "fp8_e4m3").data.view(torch.uint8)[0, 0] == 0x00  # compressed-tensors: + 0.0
    assert quantize(x, "fp8_e5m2").data.view(torch.uint8)[0, 0] == 0x80  # torchao keeps the sign
    assert quantize(x, "mxfp8_e4m3").data.view(torch.uint8)[0, 0] == 0x80
    nv = quantize(x, "nvfp4").data
    div = quantize(x, "nvfp4_divisor").data
    assert nv[0, 0] == 0x88  # -0.0 and -0.01: both code 8 (torchao: the sign bit)
    assert div[0, 0] == 0x80  # -0.0 -> code 0 (torch.sign(-0.0) is 0), -0.01 -> code 8


def test_fp4_rounds_ties_to_even_and_saturates() -> None:
    ties = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, float("inf"), -5.0, -0.2, 0.3, 1e30, 6.0, 2.6, -2.4]
    )
    scale = torch.tensor([[1.0]], dtype=torch.float8_e4m3fn).expand(1, 1).contiguous()
    data = quantize_with_scales(ties.reshape(1, 16), scale, "nvfp4_divisor", None, torch.tensor(1.0))
    assert unpack_fp4(data).flatten().tolist() == [
        0.0,
        1.0,
        1.0,
        2.0,
        2.0,
        4.0,
        4.0,
        6.0,
        6.0,
        -4.0,
        -0.0,
        0.5,
        6.0,
        6.0,
        3.0,
        -2.0,
    ]
    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)
    assert torch.equal(
        pack_fp4(codes), torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=torch.uint8)
    )
    assert unpack_fp4(pack_fp4(codes)).flatten().tolist() == [
        0.0,
        0.5,
        1.0,
        1.5,
        2.0,
        3.0,
        4.0,
        6.0,
        -0.0,
        -0.5,
        -1.0,
        -1.5,
        -2.0,
        -3.0,
        -4.0,
        -6.0,
    ]


def test_fp8_saturates_at_the_formats_max_and_keeps_nan() -> None:
    x = torch.tensor([[1e5, -1e30, float("inf"), float("nan"), 1.0]])
    for fmt, top in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        data = quantize_with_scales(x, torch.ones(1, 1), fmt, None).float()
        assert data[0, :3].tolist() == [top, -top, top] and torch.isnan(data[0, 3]) and data[0, 4] == 1.0
    # MX FLOOR: amax 480 has exponent 8, so the scale is 1 and 480 saturates to 448.
    q = quantize(torch.tensor([[480.0] + [1.0] * 31]), "mxfp8_e4m3")
    assert q.scale.view(torch.uint8).item() == 127 and q.data.float()[0, 0].item() == 448.0


def test_mx_blocks_below_the_smallest_normal_scale_dequantize_to_half_as_torchao() -> None:
    """torchao divides by 2**-126 where the E8M0 byte is 0 but that byte means 2**-127: kept bit for bit."""
    x = torch.full((1, 32), 2.0**-120)
    q = quantize(x, "mxfp8_e4m3")
    assert q.scale.view(torch.uint8).item() == 0
    assert q.data.float()[0, 0].item() == 2.0**6
    assert dequantize(q.data, q.scale, "mxfp8_e4m3")[0, 0].item() == 2.0**-121


def test_nan_blocks_dequantize_to_nan_and_only_them() -> None:
    x = sample((4, 64), 5)
    x[2, 40] = float("nan")
    for fmt in FORMATS:
        block = (1, 32) if fmt.startswith("fp8") else None
        q = quantize(x, fmt, block)
        values = dequantize(q.data, q.scale, fmt, block, q.global_scale)
        cells = FORMATS[fmt].fixed_last_block or 32
        start = 40 // cells * cells
        assert torch.isnan(values[2, start : start + cells]).all(), fmt
        assert torch.isnan(values).sum() == cells, fmt


def test_dequantize_gives_values_within_half_a_blocks_amax() -> None:
    """A sanity bound on every format (saturation under MX's FLOOR scale costs at most amax / 2)."""
    x = sample((16, 128), 9)
    for fmt in FORMATS:
        block = (1, 32) if fmt.startswith("fp8") else None
        q = quantize(x, fmt, block)
        values = dequantize(q.data, q.scale, fmt, block, q.global_scale, dtype=torch.bfloat16)
        assert values.dtype == torch.bfloat16 and values.shape == x.shape
        amax = block_amax(x, fmt, block).repeat_interleave(FORMATS[fmt].fixed_last_block or 32, dim=1)
        assert ((values.float() - x).abs() <= 0.5 * amax + 1e-30).all(), fmt
        assert torch.equal(values, dequantize(q.data, q.scale, fmt, block, q.global_scale).to(torch.bfloat16))


def test_bad_inputs_are_reshard_errors() -> None:
    x = torch.randn(4, 64)
    with pytest.raises(StateDictError, match="float32, bfloat16 or float16"):
        quantize(torch.ones(4, 64, dtype=torch.int32), "fp8_e4m3")
    with pytest.raises(ShardingError, match="even last axis"):
        quantize(torch.randn(4, 33), "mxfp4")
    with pytest.raises(ShardingError, match="unknown low-precision format"):
        quantize(x, "fp6")
    with pytest.raises(ShardingError, match="has blocks"):
        quantize(x, "mxfp8_e4m3", (1, 16))
    with pytest.raises(ShardingError, match="scales of shape"):
        quantize_with_scales(x, torch.ones(4, 3, dtype=torch.float8_e8m0fnu), "mxfp8_e4m3")
    with pytest.raises(ShardingError, match="scales are"):
        quantize_with_scales(x, torch.ones(4, 2), "mxfp8_e4m3")
    with pytest.raises(ShardingError, match="needs its global scale"):
        quantize_with_scales(x, torch.ones(4, 4, dtype=torch.float8_e4m3fn), "nvfp4")
    with pytest.raises(ShardingError, match="has no global scale"):
        scales_from_amax(torch.ones(1, 1), "fp8_e4m3", torch.tensor(1.0))
    with pytest.raises(ShardingError, match="data is"):
        dequantize(torch.zeros(4, 64), torch.ones(1, 1), "fp8_e4m3")
