"""The issue's round trip on real processes (torch.distributed gloo): an FP8 checkpoint with 128x128 block
scales saved at TP2 x EP2 loads at TP4 x EP1 with data and scales bit-exact, and ranks that disagree on a
block fail with the same error class on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import ScaledTensor, ShardedTensor
from tests.flows.test_scaled import expert_state, same_bytes
from tests.rankpool import RankContext, RankFailure, RankPool

pytestmark = pytest.mark.dist


def rank_save_tp2_ep2(ctx: RankContext, path: str) -> None:
    reshard.save(expert_state(2, 2, ctx.rank, fill=True), path)


def rank_load_tp4_ep1(ctx: RankContext, path: str) -> list[str]:
    """The keys whose data or scales differ from what this rank should hold at TP4 x EP1."""
    template = expert_state(4, 1, ctx.rank, fill=False)
    reshard.load(template, path)
    want = expert_state(4, 1, ctx.rank, fill=True)
    return [
        key
        for key, leaf in template.items()
        if not (same_bytes(leaf.data.data, want[key].data.data) and same_bytes(leaf.scale, want[key].scale))
    ]


def rank_save_disagreeing_blocks(ctx: RankContext, path: str) -> None:
    data = ShardedTensor.from_rank_offsets("w", torch.zeros(128, 64, dtype=torch.float8_e4m3fn), (0, ctx.rank, 4))
    block = (128, None) if ctx.rank == 0 else (64, None)
    reshard.save({"w": ScaledTensor(data, torch.ones(128 // block[0], 1), "fp8_e4m3", block)}, path)


def test_fp8_block_checkpoint_tp2_ep2_to_tp4_ep1_on_gloo_processes(pool4: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    pool4.run_ok(rank_save_tp2_ep2, path)
    assert pool4.run_ok(rank_load_tp4_ep1, path) == [[], [], [], []]
    results: list[Any] = pool4.run(rank_save_disagreeing_blocks, str(tmp_path / "bad"))
    assert all(isinstance(r, RankFailure) and r.error_class == "ShardingError" for r in results), results
    assert not (tmp_path / "bad" / "metadata.json").exists()
