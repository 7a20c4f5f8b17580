"""Save plans reused over real processes and gloo (pool of 4 ranks): a manager's second save of a layout reuses its
plan in memory, a restarted job (fresh managers) reuses the plan kept in the root, and a layout changed on one rank
plans again; every checkpoint loads as saved."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.planning.layouts import PLAN_CACHE_FILE
from tests.rankpool import RankContext, RankPool

pytestmark = pytest.mark.dist

TIMEOUT = 60.0
REUSED = "the plan of this layout is reused"
FROM_FILE = "holds this layout"


def state(rank: int, world: int, generation: int, *, rows: int = 2) -> dict[str, Any]:
    data = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 100 * rank + generation
    return {
        "w": reshard.ShardedTensor(key="w", data=data, global_shape=(world * rows, 4), global_offset=(rank * rows, 0)),
        "bias": torch.full((3,), float(generation)),
        "step": generation,
    }


class _Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def rank_saves(ctx: RankContext, root: str, steps: list[int], rows: list[int]) -> list[list[str]]:
    """A fresh manager saves ``steps`` (rank 1 with ``rows[i]`` rows at step i, the others 2); per step, the
    messages of reshard's logger that say a plan was reused."""
    logger = logging.getLogger("reshard")
    handler, level = _Messages(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    manager = reshard.CheckpointManager(root, timeout=TIMEOUT)
    said = []
    try:
        for step, rank1_rows in zip(steps, rows, strict=True):
            handler.messages.clear()
            layout_rows = rank1_rows if ctx.rank == 1 else 2
            data = state(ctx.rank, ctx.world_size, step)
            if layout_rows != 2:  # rank 1 alone holds another box: the layout changed on it only
                data["w"] = reshard.ShardedTensor(
                    key="w",
                    data=torch.zeros(layout_rows, 4),
                    global_shape=(ctx.world_size * 2, 4),
                    global_offset=(2, 0),
                )
            try:
                manager.save(step, data)
            except reshard.ShardingError as exc:
                said.append([f"ShardingError: {exc}"])
                continue
            said.append([m for m in handler.messages if REUSED in m or FROM_FILE in m])
    finally:
        manager.close()
        logger.removeHandler(handler)
        logger.setLevel(level)
    return said


def rank_loads(ctx: RankContext, path: str, generation: int) -> bool:
    template = state(ctx.rank, ctx.world_size, 0)
    template["w"] = reshard.ShardedTensor(
        key="w", data=torch.zeros(2, 4), global_shape=(ctx.world_size * 2, 4), global_offset=(ctx.rank * 2, 0)
    )
    loaded = reshard.load(template, path, timeout=TIMEOUT)
    expected = state(ctx.rank, ctx.world_size, generation)
    return bool(torch.equal(loaded["w"].data, expected["w"].data) and torch.equal(loaded["bias"], expected["bias"]))


def test_plans_are_reused_in_memory_and_after_a_restart_and_a_changed_rank_is_caught(
    pool4: RankPool, tmp_path: Path
) -> None:
    root = str(tmp_path / "root")
    first = pool4.run_ok(rank_saves, root, [1, 2], [2, 2])
    assert [len(said[0]) for said in first] == [0] * 4  # the first save plans
    assert all(any(REUSED in m for m in said[1]) for said in first)  # the second reuses, on every rank
    assert (tmp_path / "root" / PLAN_CACHE_FILE).is_file()
    restarted = pool4.run_ok(rank_saves, root, [3], [2])
    assert any(FROM_FILE in m for m in restarted[0][0]) and all(any(REUSED in m for m in s[0]) for s in restarted)
    for step in (1, 2, 3):
        assert pool4.run_ok(rank_loads, str(tmp_path / "root" / f"step_{step:09d}"), step) == [True] * 4
    changed = pool4.run_ok(rank_saves, root, [4], [3])  # rank 1's box now overlaps rank 0's (and rank 2's)
    assert all(s[0][0].startswith("ShardingError") for s in changed) and len({s[0][0] for s in changed}) == 1


def rank_manager_loads(ctx: RankContext, root: str, loads: int, rank1_rows: int) -> list[tuple[bool, bool]]:
    """A fresh manager loads the latest step ``loads`` times with ``LoadOptions(read_once=True)`` into rows of ``w``
    cut in halves (ranks 0 and 2 the first, 1 and 3 the second: two replicas of each half), rank 1 with
    ``rank1_rows`` rows instead of 4; per load, whether the schedule was reused and the bytes are those saved."""
    manager = reshard.CheckpointManager(root, timeout=TIMEOUT)
    half = ctx.rank % 2
    rows = rank1_rows if ctx.rank == 1 else 4
    out = []
    try:
        for _ in range(loads):
            template = state(ctx.rank, ctx.world_size, 0)
            template["w"] = reshard.ShardedTensor(
                key="w", data=torch.zeros(rows, 4), global_shape=(ctx.world_size * 2, 4), global_offset=(half * 4, 0)
            )
            stats = reshard.LoadStats()
            step, loaded = manager.load_latest_with_state(  # type: ignore[misc]
                template, options=reshard.LoadOptions(read_once=True), stats=stats
            )
            saved = torch.cat([state(r, ctx.world_size, step)["w"].data for r in range(ctx.world_size)])
            same = torch.equal(loaded["w"].data, saved[half * 4 : half * 4 + rows])
            out.append((stats.schedule_reused, same and stats.bytes_from_peers > 0))
    finally:
        manager.close()
    return out


def test_read_once_schedules_are_reused_in_memory_and_after_a_restart(pool4: RankPool, tmp_path: Path) -> None:
    root = str(tmp_path / "root")
    pool4.run_ok(rank_saves, root, [1], [2])
    first = pool4.run_ok(rank_manager_loads, root, 2, 4)
    assert first == [[(False, True), (True, True)]] * 4  # scheduled, then reused in memory; the bytes saved
    assert (tmp_path / "root" / "reads.reshard-cache").is_file()
    assert pool4.run_ok(rank_manager_loads, root, 1, 4) == [[(True, True)]] * 4  # a restart: the needs in the root
    assert pool4.run_ok(rank_manager_loads, root, 1, 2) == [[(False, True)]] * 4  # rank 1 alone changed
