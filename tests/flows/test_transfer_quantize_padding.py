"""A padded source quantized on the way (issue 32, part E): a vocabulary of 1000 rows padded to a multiple
of the trainer's TP (1002 over 3 ranks, rows that cut the target's blocks) into a ScaledTensor padded to
another multiple (1280 over 2 ranks). The real rows and the real scale cells must be bit for bit
``quantize`` of the logical (1000-row) tensor, the padding of the data and of the scales zero, as a
:class:`~reshard.ScaledTensor` pads them (scale logical shape ``ceil(1000 / b)``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import reshard
from reshard import ScaledTensor, ShardedTensor
from reshard.state.quantize import quantize
from tests.flows.test_scaled import on_ranks, same_bytes
from tests.flows.test_transfer_quantize import weights

pytestmark = pytest.mark.unit

VOCAB, HIDDEN = 1000, 64
LOGICAL = weights(VOCAB, HIDDEN, seed=11)


def padded_source(rank: int, tp: int) -> dict[str, Any]:
    """Rank ``rank`` of the trainer's TP ``tp``: its rows of the vocabulary padded to a multiple of ``tp``
    (the padding rows hold garbage, which must never reach a target)."""
    if rank >= tp:
        return {}
    rows = -(-VOCAB // tp)
    local = torch.full((rows, HIDDEN), 1e30).to(LOGICAL.dtype)
    real = LOGICAL[rank * rows : (rank + 1) * rows]
    local[: real.shape[0]] = real
    full = (rows * tp, HIDDEN)
    return {"emb": ShardedTensor("emb", local, full, (rank * rows, 0), logical_shape=(VOCAB, HIDDEN))}


def row_block(block: Any) -> int:
    """The scales' rows per block on axis 0 (1 for the formats whose blocks lie along the last axis)."""
    return 1 if block is None else block[0]


def padded_target(rank: int, fmt: str, block: Any, tp: int, padded: int) -> dict[str, Any]:
    """A ScaledTensor template of rank ``rank`` of ``tp``, padded to ``padded`` rows, its data and scales
    filled with non-zero bytes (so that padding left unwritten shows); nothing past ``tp``."""
    if rank >= tp:
        return {}
    rows = padded // tp
    want = quantize(LOGICAL, fmt, block)
    width = want.data.shape[1]
    data = torch.full((rows, width), 0x11, dtype=torch.uint8).view(want.data.dtype)
    scale_shape = (-(-rows // row_block(block)), want.scale.shape[1])
    scale = torch.full(scale_shape, 7.0).to(want.scale.dtype) if want.scale.dtype != torch.uint8 else None
    if scale is None:
        scale = torch.full(scale_shape, 0x11, dtype=torch.uint8)
    sharded = ShardedTensor.from_rank_offsets("emb", data, (0, rank, tp), logical_shape=(VOCAB, width))
    glob = None if want.global_scale is None else torch.full((), 7.0)
    return {"emb": ScaledTensor(sharded, scale, fmt, block, global_scale=glob)}


@pytest.mark.parametrize(
    ("fmt", "block"), [("fp8_e4m3", (128, 32)), ("mxfp8_e4m3", None), ("nvfp4", None), ("fp8_e5m2", (1, None))]
)
def test_a_padded_vocabulary_quantized_into_a_padded_scaled_target(fmt: str, block: Any) -> None:
    want = quantize(LOGICAL, fmt, block)
    padded = 1280

    def run(rank: int, g: Any) -> dict[str, Any]:
        state = padded_target(rank, fmt, block, 2, padded)
        reshard.transfer(padded_source(rank, 3), state, group=g)
        return state

    step = row_block(block)
    for rank, state in enumerate(on_ranks(3, run)):
        if rank >= 2:
            continue
        got = state["emb"]
        rows = padded // 2
        lo, hi = rank * rows, min((rank + 1) * rows, VOCAB)
        assert same_bytes(got.data.data[: hi - lo], want.data[lo:hi]), f"rank {rank}: data"
        assert not got.data.data[hi - lo :].view(torch.uint8).any(), f"rank {rank}: data padding not zeroed"
        s_lo, s_hi = lo // step, min(-(-(rank + 1) * rows // step), want.scale.shape[0])
        assert same_bytes(got.scale[: s_hi - s_lo], want.scale[s_lo:s_hi]), f"rank {rank}: scales"
        assert not got.scale[s_hi - s_lo :].view(torch.uint8).any(), f"rank {rank}: scale padding not zeroed"
        if want.global_scale is not None:
            assert torch.equal(got.global_scale.reshape(()), want.global_scale.reshape(()))


HEAD = LOGICAL.t().contiguous()  # (64, 1000): an output layer padded along its blocked (last) axis


@pytest.mark.parametrize(("fmt", "block"), [("mxfp8_e4m3", None), ("nvfp4", None), ("fp8_e4m3", (32, 128))])
def test_padding_along_the_blocked_axis_leaves_a_partial_last_block(fmt: str, block: Any) -> None:
    """Columns padded to 1002 over 3 senders, wanted padded to 1280 over 2 receivers: the last real block
    ([992, 1000) for blocks of 32) is partial, its scale the amax of its real elements only (the senders'
    padding holds 1e30); the scale cells past ``ceil(1000 / b)`` are padding, zeroed."""
    want = quantize(HEAD, fmt, block)
    per = 2 if fmt == "nvfp4" else 1
    padded, cols = 1280, 334

    def run(rank: int, g: Any) -> dict[str, Any]:
        source = {}
        if rank < 3:
            local = torch.full((HIDDEN, cols), 1e30).to(HEAD.dtype)
            real = HEAD[:, rank * cols : (rank + 1) * cols]
            local[:, : real.shape[1]] = real
            source = {
                "head": ShardedTensor("head", local, (HIDDEN, 3 * cols), (0, rank * cols), logical_shape=(64, VOCAB))
            }
        state = {}
        if rank < 2:
            width = padded // 2 // per
            data = torch.full((HIDDEN, width), 0x11, dtype=torch.uint8).view(want.data.dtype)
            cells = -(-padded // 2 // (block[1] if block else 16 if fmt == "nvfp4" else 32))
            scale = torch.full((want.scale.shape[0], cells), 7.0).to(want.scale.dtype)
            sharded = ShardedTensor.from_rank_offsets("head", data, (1, rank, 2), logical_shape=(HIDDEN, VOCAB // per))
            glob = None if want.global_scale is None else torch.full((), 7.0)
            state = {"head": ScaledTensor(sharded, scale, fmt, block, global_scale=glob)}
        reshard.transfer(source, state, group=g)
        return state

    for rank, state in enumerate(on_ranks(3, run)):
        if rank >= 2:
            continue
        got = state["head"]
        width = padded // 2 // per
        lo, hi = rank * width, min((rank + 1) * width, VOCAB // per)
        assert same_bytes(got.data.data[:, : hi - lo].contiguous(), want.data[:, lo:hi].contiguous()), rank
        assert not got.data.data[:, hi - lo :].contiguous().view(torch.uint8).any(), rank
        cells = got.scale.shape[1]
        c_lo, c_hi = rank * cells, min((rank + 1) * cells, want.scale.shape[1])
        assert same_bytes(got.scale[:, : c_hi - c_lo].contiguous(), want.scale[:, c_lo:c_hi].contiguous()), rank
        assert not got.scale[:, c_hi - c_lo :].contiguous().view(torch.uint8).any(), rank
        if want.global_scale is not None:
            assert torch.equal(got.global_scale.reshape(()), want.global_scale.reshape(()))
