"""Save with N ranks, load with M ranks, over real spawned processes and gloo (pool of 4 ranks)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import reshard
from tests.layouts import check_loaded, load_layout, save_layout
from tests.rankpool import RankContext, RankPool

TIMEOUT = 60.0


def rank_save(ctx: RankContext, path: str, size: int) -> int | None:
    group, member = ctx.group_of_size(size)
    if not member:
        return None
    metadata = reshard.save(save_layout(ctx.rank, size), path, group=group, timeout=TIMEOUT)
    return metadata.world_size


def rank_load(ctx: RankContext, path: str, size: int, saved_size: int) -> dict[str, float] | None:
    group, member = ctx.group_of_size(size)
    if not member:
        return None
    template = load_layout(ctx.rank, size, saved_size)
    stats = reshard.LoadStats()
    result = reshard.load(template, path, group=group, timeout=TIMEOUT, stats=stats)
    check_loaded(result, template, ctx.rank, saved_size)
    return {"needed": stats.bytes_needed, "read": stats.bytes_read}


@pytest.mark.dist
@pytest.mark.parametrize(("save_size", "load_size"), list(itertools.product([1, 2, 4], [1, 2, 4])))
def test_save_n_load_m(pool4: RankPool, tmp_path: Path, save_size: int, load_size: int) -> None:
    path = str(tmp_path / "ckpt")
    saved = pool4.run_ok(rank_save, path, save_size)
    assert saved[:save_size] == [save_size] * save_size
    metadata = reshard.read_metadata(path)
    assert metadata.world_size == save_size
    # Each unique box is written once: the stored bytes equal the bytes of the global tensors.
    from tests.layouts import GLOBALS

    expected = sum(torch.empty(shape, dtype=dtype).nbytes for shape, dtype in GLOBALS.values()) + 5 * 4
    assert metadata.total_bytes == expected
    stats = pool4.run_ok(rank_load, path, load_size, save_size)
    assert all(s is not None and s["read"] >= s["needed"] > 0 for s in stats[:load_size])


@pytest.mark.unit
def test_single_process_round_trip_without_distributed(tmp_path: Path) -> None:
    """group=None without torch.distributed initialised: one process, no collectives."""
    path = tmp_path / "ckpt"
    reshard.save(save_layout(0, 1), path)
    template = load_layout(0, 1, 1)
    check_loaded(reshard.load(template, path), template, 0, 1)


def rank_save_in_half(ctx: RankContext, root: str) -> str:
    lower = ctx.rank < ctx.world_size // 2
    group = ctx.groups["lower_half"] if lower else ctx.groups["upper_half"]
    local_rank = ctx.rank % (ctx.world_size // 2)
    name = "a" if lower else "b"
    value = torch.full((4, 2), 1.0 if lower else 2.0) + torch.arange(8.0).reshape(4, 2)
    piece = value[local_rank * 2 : local_rank * 2 + 2].clone()
    state = {"w": reshard.ShardedTensor.from_rank_offsets("w", piece, (0, local_rank, 2)), "name": name}
    reshard.save(state, f"{root}/{name}", group=group, timeout=TIMEOUT)
    return name


def rank_load_crosswise(ctx: RankContext, root: str) -> tuple[str, list[float]]:
    lower = ctx.rank < ctx.world_size // 2
    group = ctx.groups["lower_half"] if lower else ctx.groups["upper_half"]
    local_rank = ctx.rank % (ctx.world_size // 2)
    name = "b" if lower else "a"
    target = torch.zeros(4, 1)
    state = {"w": reshard.ShardedTensor.from_rank_offsets("w", target, (1, local_rank, 2)), "name": ""}
    out = reshard.load(state, f"{root}/{name}", group=group, timeout=TIMEOUT)
    return out["name"], out["w"].reshape(-1).tolist()


@pytest.mark.dist
def test_explicit_groups_save_concurrently_and_load_crosswise(pool4: RankPool, tmp_path: Path) -> None:
    """Two 2-rank groups save two checkpoints at the same time, then each loads the other's."""
    assert pool4.run_ok(rank_save_in_half, str(tmp_path)) == ["a", "a", "b", "b"]
    assert reshard.read_metadata(tmp_path / "a").world_size == 2
    results = pool4.run_ok(rank_load_crosswise, str(tmp_path))
    base = torch.arange(8.0).reshape(4, 2)
    for rank, (name, values) in enumerate(results):
        column = rank % 2
        offset = 2.0 if rank < 2 else 1.0
        assert name == ("b" if rank < 2 else "a")
        assert values == (base[:, column] + offset).tolist()
