"""A transfer that quantizes on the way (issue 32, part E): a BF16 / FP32 trainer layout to a low-precision
inference layout, on in-process ranks. Every result is compared byte for byte with
:func:`reshard.state.quantize.quantize` of the whole high-precision tensor."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import reshard
from reshard import CheckpointError, MismatchError, ScaledTensor, ShardedTensor, ShardingError
from reshard.state.dtypes import dtype_name
from reshard.state.quantize import Quantized, quantize
from tests.flows.test_scaled import errors_on_ranks, on_ranks, same_bytes

pytestmark = pytest.mark.unit


def weights(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Values over many magnitudes (so that blocks get different scales), a few outliers and zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    x.view(-1)[:: max(1, x.numel() // 7)] = 0.0
    x.view(-1)[3] = 1e4
    return x.to(dtype)


def rows_source(key: str, full: torch.Tensor, rows: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s rows ``[rank * rows, (rank + 1) * rows)``, or nothing past the tensor."""
    if (rank + 1) * rows > full.shape[0]:
        return {}
    box = full[rank * rows : (rank + 1) * rows].clone()
    return {key: ShardedTensor(key, box, tuple(full.shape), (rank * rows, 0))}


def _part(t: torch.Tensor, parts: int, axis: int, rank: int) -> torch.Tensor:
    return t if t.shape[axis] == 1 else t.chunk(parts, dim=axis)[rank]


def target(key: str, want: Quantized, fmt: str, block: Any, parts: int, axis: int, rank: int) -> dict[str, Any]:
    """A zeroed ScaledTensor template of rank ``rank`` of ``parts`` along ``axis``, and nothing past them."""
    if rank >= parts:
        return {}
    data = torch.zeros_like(_part(want.data, parts, axis, rank))
    scale = torch.zeros_like(_part(want.scale, parts, axis, rank))
    glob = None if want.global_scale is None else torch.zeros(())
    sharded = ShardedTensor.from_rank_offsets(key, data, (axis, rank, parts))
    return {key: ScaledTensor(sharded, scale, fmt, block, global_scale=glob)}


def check(state: dict[str, Any], key: str, want: Quantized, parts: int, axis: int, rank: int) -> None:
    if rank >= parts:
        assert state == {}
        return
    got = state[key]
    assert same_bytes(got.data.data, _part(want.data, parts, axis, rank)), f"rank {rank}: data differs"
    assert same_bytes(got.scale, _part(want.scale, parts, axis, rank)), f"rank {rank}: scales differ"
    if want.global_scale is not None:
        assert torch.equal(got.global_scale, want.global_scale)


W = weights(128, 512, seed=1)


@pytest.mark.parametrize(("parts", "axis"), [(4, 1), (1, 0), (2, 1)])
def test_tp2_bf16_rows_of_64_to_fp8_128x128_blocks_bit_exact(parts: int, axis: int) -> None:
    """Source rows of 64 per rank cut every 128-row block in two: each block's amax is the max of two
    senders' parts. Targets: TP4 and TP2 by columns, TP1."""
    want = quantize(W, "fp8_e4m3", (128, 128))

    def run(rank: int, g: Any) -> dict[str, Any]:
        state = target("w", want, "fp8_e4m3", (128, 128), parts, axis, rank)
        stats = reshard.TransferStats()
        reshard.transfer(rows_source("w", W, 64, rank), state, group=g, stats=stats)
        if rank < parts and parts > 1:  # low-precision bytes only: 1 per element, 4 per scale
            assert stats.bytes_received <= W.numel() // parts + 4 * want.scale.numel()
        return state

    for rank, state in enumerate(on_ranks(4, run)):
        check(state, "w", want, parts, axis, rank)


@pytest.mark.parametrize(
    ("fmt", "block", "axis"),
    [("fp8_e4m3", None, 1), ("fp8_e4m3", (1, None), 1), ("fp8_e5m2", (128, 64), 1), ("mxfp8_e4m3", None, 0)],
)
def test_per_tensor_per_row_other_blocks_and_mxfp8(fmt: str, block: Any, axis: int) -> None:
    want = quantize(W, fmt, block)

    def run(rank: int, g: Any) -> dict[str, Any]:
        state = target("w", want, fmt, block, 4, axis, rank)
        reshard.transfer(rows_source("w", W, 64, rank), state, group=g)
        return state

    for rank, state in enumerate(on_ranks(4, run)):
        check(state, "w", want, 4, axis, rank)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_divisor", "mxfp4"])
def test_fp4_global_amax_reduced_over_senders_that_cut_blocks(fmt: str) -> None:
    """FP32 columns split at 40 and 200 (cutting blocks of 16 and 32); the tensor's amax lies on one
    sender only, so every other sender's global scale comes from the reduction."""
    full = weights(8, 256, seed=3, dtype=torch.float32)
    want = quantize(full, fmt)
    cuts = [0, 40, 200, 256]

    def run(rank: int, g: Any) -> dict[str, Any]:
        source = {}
        if rank < 3:
            lo, hi = cuts[rank], cuts[rank + 1]
            source = {"w": ShardedTensor("w", full[:, lo:hi].clone(), (8, 256), (0, lo))}
        state = target("w", want, fmt, None, 4, 0, rank)
        reshard.transfer(source, state, group=g)
        return state

    for rank, state in enumerate(on_ranks(4, run)):
        check(state, "w", want, 4, 0, rank)


QKV = weights(384, 256, seed=4)


def test_fused_qkv_segments_quantized_tp2_to_tp4() -> None:
    """A fused QKV weight (three segments of 128 rows) held TP2 in BF16, wanted TP4 in FP8 blocks of
    (32, 128): each rank's target is a quarter of every segment, data and scales following their segments."""
    block = (32, 128)
    want = quantize(QKV, "fp8_e4m3", block)

    def segments(tp: int, rank: int) -> tuple[tuple[int, int], ...]:
        n = 128 // tp
        return tuple((s * 128 + rank * n, n) for s in range(3))

    def run(rank: int, g: Any) -> dict[str, Any]:
        rows = [QKV[g0 : g0 + n] for g0, n in segments(2, rank)] if rank < 2 else []
        source = (
            {"qkv": ShardedTensor.segmented("qkv", torch.cat(rows), (384, 256), 0, segments(2, rank))} if rows else {}
        )
        seg = segments(4, rank)
        data = torch.zeros(96, 256, dtype=torch.float8_e4m3fn)
        scale = torch.zeros(3, 2)
        sharded = ShardedTensor.segmented("qkv", data, (384, 256), 0, seg)
        state = {"qkv": ScaledTensor(sharded, scale, "fp8_e4m3", block)}
        reshard.transfer(source, state, group=g)
        return state

    for rank, state in enumerate(on_ranks(4, run)):
        idx = [i for g0, n in ((s * 128 + rank * 32, 32) for s in range(3)) for i in range(g0, g0 + n)]
        assert same_bytes(state["qkv"].data.data, want.data[idx])
        assert same_bytes(state["qkv"].scale, want.scale[[i // 32 for i in idx[::32]]])


def test_a_session_quantizes_again_and_refuses_deltas() -> None:
    second = weights(128, 512, seed=9)

    def run(rank: int, g: Any) -> dict[str, Any]:
        session = reshard.TransferSession(group=g)
        state = target("w", quantize(W, "mxfp8_e4m3"), "mxfp8_e4m3", None, 2, 1, rank)
        session.transfer(rows_source("w", W, 64, rank), state, delta=False)
        session.transfer(rows_source("w", second, 64, rank), state, delta=False)
        with pytest.raises(CheckpointError, match="does not send deltas of the tensors it quantizes"):
            session.transfer(rows_source("w", second, 64, rank), state)
        return state

    want = quantize(second, "mxfp8_e4m3")
    for rank, state in enumerate(on_ranks(2, run)):
        check(state, "w", want, 2, 1, rank)


def test_ranks_that_want_other_formats_fail_with_one_error() -> None:
    def run(rank: int, g: Any) -> None:
        fmt = "mxfp8_e4m3" if rank == 1 else "fp8_e4m3"
        block = None if rank == 1 else (128, 128)
        state = target("w", quantize(W, fmt, block), fmt, block, 2, 1, rank)
        reshard.transfer(rows_source("w", W, 64, rank), state, group=g)

    errors = errors_on_ranks(2, run)
    assert all(isinstance(e, MismatchError) for e in errors), errors
    assert all(
        "ranks [0] want format fp8_e4m3" in str(e) and "ranks [1] want format mxfp8_e4m3" in str(e) for e in errors
    )


def test_low_precision_plain_source_and_odd_fp4_columns_are_refused() -> None:
    want = quantize(W, "fp8_e4m3", (128, 128))

    def plain_fp8(rank: int, g: Any) -> None:
        source = rows_source("w", W.to(torch.float8_e4m3fn), 64, rank)
        reshard.transfer(source, target("w", want, "fp8_e4m3", (128, 128), 2, 1, rank), group=g)

    errors = errors_on_ranks(2, plain_fp8)
    assert all(
        isinstance(e, MismatchError) and "the source 'w' is a plain float8_e4m3fn tensor" in str(e) for e in errors
    )

    full = weights(8, 64, seed=2, dtype=torch.float32)
    nv = quantize(full, "nvfp4")

    def odd(rank: int, g: Any) -> None:
        lo, hi = (0, 33) if rank == 0 else (33, 64)
        source = {"w": ShardedTensor("w", full[:, lo:hi].clone(), (8, 64), (0, lo))}
        reshard.transfer(source, target("w", nv, "nvfp4", None, 2, 0, rank), group=g)

    errors = errors_on_ranks(2, odd)
    assert all(isinstance(e, ShardingError) and "an even column" in str(e) for e in errors), errors


def test_a_scaled_source_of_the_target_format_moves_its_bytes() -> None:
    want = quantize(W, "fp8_e4m3", (128, 128))

    def run(rank: int, g: Any) -> dict[str, Any]:
        source = target("w", want, "fp8_e4m3", (128, 128), 2, 1, rank)
        if source:
            source["w"].data.data.copy_(want.data.chunk(2, dim=1)[rank])
            source["w"].scale.copy_(want.scale.chunk(2, dim=1)[rank])
        state = target("w", want, "fp8_e4m3", (128, 128), 4, 1, rank)
        reshard.transfer(source, state, group=g)
        return state

    for rank, state in enumerate(on_ranks(4, run)):
        check(state, "w", want, 4, 1, rank)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "nvfp4", "fp8_e4m3"])
def test_a_block_cut_by_four_senders_and_a_nan_on_one_of_them(fmt: str) -> None:
    """Columns split at 40, 50 and 60: the block [32, 64) of every row is cut among four senders, its
    amax the max of four parts (the coordinator's combine over all cut cells at once); a NaN in the third
    sender's part of row 2's block makes that block's scale NaN on every receiver (NaN wins), an inf in
    row 5 another's. Bit for bit ``quantize`` of the whole tensor."""
    full = weights(8, 128, seed=13, dtype=torch.float32)
    full[2, 55] = float("nan")
    full[5, 41] = float("inf")
    block = (1, 32) if fmt == "fp8_e4m3" else None
    want = quantize(full, fmt, block)
    cuts = [0, 40, 50, 60, 128]

    def run(rank: int, g: Any) -> dict[str, Any]:
        lo, hi = cuts[rank], cuts[rank + 1]
        source = {"w": ShardedTensor("w", full[:, lo:hi].clone(), (8, 128), (0, lo))}
        state = target("w", want, fmt, block, 2, 0, rank)
        reshard.transfer(source, state, group=g)
        return state

    for rank, state in enumerate(on_ranks(4, run)):
        check(state, "w", want, 2, 0, rank)


@pytest.mark.parametrize(
    ("dtype", "why"),
    [
        (torch.float8_e4m3fn, "float8_e4m3fn is already low-precision"),
        (torch.float8_e5m2, "float8_e5m2 is already low-precision"),
        (torch.float64, "float64 would be rounded to float32 first"),
        (torch.int32, "int32 is not a floating-point dtype"),
    ],
)
def test_a_source_that_is_not_quantized_says_which_are_and_why(dtype: torch.dtype, why: str) -> None:
    """A plain source of a scaled target that a transfer does not quantize: the error names the dtypes it
    does quantize and why this one is not, on every rank."""
    want = quantize(W, "fp8_e4m3", (128, 128))

    def run(rank: int, g: Any) -> None:
        source = rows_source("w", W.to(torch.float32).to(dtype), 64, rank)
        reshard.transfer(source, target("w", want, "fp8_e4m3", (128, 128), 2, 1, rank), group=g)

    errors = errors_on_ranks(2, run)
    assert all(isinstance(e, MismatchError) for e in errors), errors
    for e in errors:
        assert f"the source 'w' is a plain {dtype_name(dtype)} tensor" in str(e), e
        assert "quantizes float32, bfloat16 and float16 sources" in str(e) and why in str(e), e
