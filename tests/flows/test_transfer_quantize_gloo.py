"""A quantizing transfer on real processes (torch.distributed gloo, issue 32 part E): a BF16 trainer layout
(TP2, rows of 64 that cut the 128-row blocks) to an FP8 128x128 inference layout (TP4 by columns) and to
NVFP4 (the global amax reduced over the senders), bit-exact against ``quantize`` of the whole tensor."""

from __future__ import annotations

import pytest
import torch

import reshard
from reshard.state.quantize import quantize
from tests.flows.test_scaled import same_bytes
from tests.flows.test_transfer_quantize import W, _part, rows_source, target
from tests.rankpool import RankContext, RankPool

pytestmark = pytest.mark.dist


def rank_transfer(ctx: RankContext, fmt: str, block: list[int] | None) -> list[str]:
    """What differs on this rank from ``quantize`` of the whole tensor (nothing, when right)."""
    as_block = None if block is None else tuple(block)
    want = quantize(W, fmt, as_block)
    state = target("w", want, fmt, as_block, 4, 1, ctx.rank)
    reshard.transfer(rows_source("w", W, 64, ctx.rank), state)
    got = state["w"]
    wrong = []
    if not same_bytes(got.data.data, _part(want.data, 4, 1, ctx.rank)):
        wrong.append("data")
    if not same_bytes(got.scale, _part(want.scale, 4, 1, ctx.rank)):
        wrong.append("scale")
    if want.global_scale is not None and not torch.equal(got.global_scale, want.global_scale):
        wrong.append("global scale")
    return wrong


def test_bf16_tp2_to_fp8_blocks_and_nvfp4_tp4_on_gloo_processes(pool4: RankPool) -> None:
    assert pool4.run_ok(rank_transfer, "fp8_e4m3", [128, 128]) == [[], [], [], []]
    assert pool4.run_ok(rank_transfer, "nvfp4", None) == [[], [], [], []]
