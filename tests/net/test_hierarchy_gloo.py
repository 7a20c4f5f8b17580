"""The two-level control path over real gloo processes (reshard.net.hierarchy.HierarchicalGroups): save and load
through it at other layouts, bit-exact; ranks disagreeing about the node layout; a subgroup, refused; a rank that
never arrives."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.net.comm import Communicator
from reshard.net.hierarchy import HierarchicalGroups, HierarchicalTransport
from tests.rankpool import RankContext, RankFailure, RankPool, private_pool

pytestmark = pytest.mark.dist

TIMEOUT = 30.0
FULL = torch.arange(8 * 6, dtype=torch.float64).reshape(8, 6)


def _rows(rank: int) -> dict[str, Any]:
    """TP 4: rank r holds rows [2r, 2r + 2) of ``w``."""
    return {"w": reshard.ShardedTensor("w", FULL[2 * rank : 2 * rank + 2].clone(), (8, 6), (2 * rank, 0)), "step": 5}


def _columns(half: int) -> dict[str, Any]:
    """TP 2 (by columns): half ``half`` of every row of ``w``."""
    return {"w": reshard.ShardedTensor("w", torch.zeros(8, 3, dtype=torch.float64), (8, 6), (0, 3 * half)), "step": 0}


def _local(loaded: dict[str, Any]) -> torch.Tensor:
    w = loaded["w"]
    return w.local_tensor if isinstance(w, reshard.ShardedTensor) else w


def rank_hierarchical_save(ctx: RankContext, path: str) -> list[int]:
    groups = HierarchicalGroups(None, ranks_per_node=2, timeout=TIMEOUT)
    reshard.save(_rows(ctx.rank), path, group=groups, timeout=TIMEOUT)
    transport = Communicator(groups, timeout=TIMEOUT).transport
    assert isinstance(transport, HierarchicalTransport)
    return [list(node) for node in groups.layout.nodes]


def rank_flat_load_on_two(ctx: RankContext, path: str) -> list[float] | None:
    group, member = ctx.group_of_size(2)
    if not member:
        return None
    loaded = reshard.load(_columns(ctx.rank), path, group=group, timeout=TIMEOUT)
    assert loaded["step"] == 5
    return _local(loaded).flatten().tolist()


def rank_flat_save(ctx: RankContext, path: str) -> None:
    reshard.save(_rows(ctx.rank), path, timeout=TIMEOUT)


def rank_hierarchical_load_tp2_dp2(ctx: RankContext, path: str) -> list[float]:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as torchrun sets it: the layout's default
    try:
        groups = HierarchicalGroups(None, timeout=TIMEOUT)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    assert groups.layout.nodes == ((0, 1), (2, 3))
    loaded = reshard.load(_columns(ctx.rank % 2), path, group=groups, timeout=TIMEOUT)
    assert loaded["step"] == 5
    return _local(loaded).flatten().tolist()


@pytest.mark.parametrize("hierarchical", ["save", "load"])
def test_a_checkpoint_through_the_hierarchy_loads_bit_exact_at_another_layout(
    pool4: RankPool, tmp_path: Path, hierarchical: str
) -> None:
    path = str(tmp_path / "ckpt")
    if hierarchical == "save":
        assert pool4.run_ok(rank_hierarchical_save, path)[0] == [[0, 1], [2, 3]]
        halves = pool4.run_ok(rank_flat_load_on_two, path)[:2]
    else:
        pool4.run_ok(rank_flat_save, path)
        halves = pool4.run_ok(rank_hierarchical_load_tp2_dp2, path)
        assert halves[2:] == halves[:2]  # the replicas of DP 2 got the same columns
    for half, values in enumerate(halves[:2]):
        assert torch.equal(torch.tensor(values, dtype=torch.float64).reshape(8, 3), FULL[:, 3 * half : 3 * half + 3])


def rank_disagreeing_layout(ctx: RankContext, path: str, theirs: int) -> None:
    groups = HierarchicalGroups(None, ranks_per_node=theirs if ctx.rank == 1 else 2, timeout=TIMEOUT)
    reshard.save(_rows(ctx.rank), path, group=groups, timeout=TIMEOUT)


@pytest.mark.parametrize("theirs", [1, 3], ids=["another-layout", "not-dividing"])
def test_ranks_disagreeing_about_the_layout_fail_alike_and_write_nothing(
    pool4: RankPool, tmp_path: Path, theirs: int
) -> None:
    path = tmp_path / "ckpt"
    outcomes = pool4.run(rank_disagreeing_layout, str(path), theirs)
    assert all(isinstance(o, RankFailure) and o.error_class == "CheckpointError" for o in outcomes), outcomes
    assert len({o.message for o in outcomes}) == 1, outcomes
    assert ("disagree" if theirs == 1 else "rank 1") in outcomes[0].message
    assert not path.exists()


def rank_subgroup(ctx: RankContext) -> None:
    if ctx.rank >= 2:
        HierarchicalGroups(ctx.groups["upper_half"], ranks_per_node=1, timeout=TIMEOUT)


def test_a_subgroup_is_refused_on_each_of_its_ranks(pool4: RankPool) -> None:
    outcomes = pool4.run(rank_subgroup)
    assert outcomes[:2] == [None, None]
    assert all(isinstance(o, RankFailure) and "every process of the job" in o.message for o in outcomes[2:]), outcomes


def rank_one_never_arrives(ctx: RankContext) -> str:
    groups = HierarchicalGroups(None, ranks_per_node=2, timeout=TIMEOUT)
    if ctx.rank == 3:
        return "absent"
    comm = Communicator(groups, timeout=datetime.timedelta(seconds=2))
    comm.step("phase", lambda: ctx.rank, sum)
    return "returned"


def test_a_member_that_never_arrives_is_a_communication_error_on_every_other_rank() -> None:
    pool = private_pool(4)
    try:
        outcomes = pool.run(rank_one_never_arrives, timeout_s=60)
    finally:
        pool.broken = True
        pool.close()
    assert outcomes[3] == "absent"
    assert all(isinstance(o, RankFailure) and o.error_class == "CommunicationError" for o in outcomes[:3]), outcomes


def rank_step_failing_on(ctx: RankContext, failing: int) -> Any:
    groups = HierarchicalGroups(None, ranks_per_node=2, timeout=TIMEOUT)
    comm = Communicator(groups, timeout=TIMEOUT)

    def local() -> int:
        if ctx.rank == failing:
            raise reshard.StorageError(f"no space left on rank {ctx.rank}")
        return ctx.rank

    return comm.step("phase", local, sum)


@pytest.mark.parametrize("failing", [3, 2, 0], ids=["member-of-node-1", "leader-of-node-1", "coordinator"])
def test_a_failure_on_one_rank_is_the_same_error_on_every_rank_over_gloo(pool4: RankPool, failing: int) -> None:
    outcomes = pool4.run(rank_step_failing_on, failing)
    assert all(isinstance(o, RankFailure) and o.error_class == "StorageError" for o in outcomes), outcomes
    assert {o.message for o in outcomes} == {f"phase failed on rank {failing}: no space left on rank {failing}"}


def rank_async_save(ctx: RankContext, path: str) -> None:
    groups = HierarchicalGroups(None, ranks_per_node=2, timeout=TIMEOUT)
    reshard.async_save(_rows(ctx.rank), path, group=groups, timeout=TIMEOUT).wait()


def test_an_asynchronous_save_runs_its_protocol_through_the_hierarchy(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    pool4.run_ok(rank_async_save, str(path))
    loaded = reshard.load({"w": torch.zeros(8, 6, dtype=torch.float64), "step": 0}, path)
    assert torch.equal(loaded["w"], FULL) and loaded["step"] == 5
