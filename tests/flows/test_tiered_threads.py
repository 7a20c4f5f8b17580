"""``reshard.TieredCheckpointManager`` on in-process ranks (threads of a ``ThreadGroup``): its tier values, the
agreement on them, which tier keeps which step, what ``status`` says, and the order and fallbacks of ``restore``
between the peer-memory and durable tiers (the node-local tier and real process deaths: test_tiered.py)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads

pytestmark = pytest.mark.unit

W = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4)


def _state(rank: int, step: int) -> dict[str, Any]:
    """TP=2 x DP=2 on 4 ranks (nodes of 2: ranks 0, 1 and 2, 3): ``w`` split on rows by TP; the step in ``w``."""
    tp, dp = rank % 2, rank // 2
    rows = (W + step)[tp * 4 : tp * 4 + 4].clone()
    return {"w": reshard.ShardedTensor.from_rank_offsets("w", rows, (0, tp, 2), replica_id=dp), "step": step}


def _template(rank: int, world: int) -> dict[str, Any]:
    """``w`` split on rows ``world`` ways (another layout than the saving one)."""
    rows = 8 // world
    return {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 4), (0, rank, world)), "step": -1}


def _expected(rank: int, world: int, step: int) -> torch.Tensor:
    rows = 8 // world
    return (W + step)[rank * rows : (rank + 1) * rows]


def _managers(
    tmp_path: Path, world: int, group: ThreadGroup, node_size: int = 2
) -> list[reshard.TieredCheckpointManager]:
    """One manager per rank: every 2 steps to peer memory (nodes of ``node_size``), every 4 to the durable root."""
    tiers = [reshard.PeerMemory(every=2, node_size=node_size), reshard.Durable(tmp_path / "durable", every=4)]
    return [reshard.TieredCheckpointManager(tiers, group=group.member(r), timeout=30) for r in range(world)]


def _restore(managers: list[reshard.TieredCheckpointManager], group: ThreadGroup) -> tuple[list[Any], list[str]]:
    world = len(managers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = on_threads(world, lambda r: managers[r].restore(_template(r, world)), group=group)
    return found, [str(w.message) for w in caught]


def _check(found: list[Any], step: int, tier: str) -> None:
    world = len(found)
    for rank, (got_step, got_tier, state) in enumerate(found):
        assert (got_step, got_tier) == (step, tier), (rank, got_step, got_tier)
        assert torch.equal(state["w"], _expected(rank, world, step)), rank
        assert state["step"] == step


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: reshard.PeerMemory(every=0), "PeerMemory.every"),
        (lambda: reshard.PeerMemory(every=2, replicas=0), "PeerMemory.replicas"),
        (lambda: reshard.PeerMemory(every=True), "PeerMemory.every"),
        (lambda: reshard.PeerMemory(every=2, node_size=0), "PeerMemory.node_size"),
        (lambda: reshard.LocalDisk("", every=2), "LocalDisk.directory"),
        (lambda: reshard.LocalDisk("/x", every=2, keep_last=0), "LocalDisk.keep_last"),
        (lambda: reshard.LocalDisk("/x", every=1.5), "LocalDisk.every"),
        (lambda: reshard.Durable("/x", every=-1), "Durable.every"),
        (lambda: reshard.Durable("/x", every=4, keep_last=0), "Durable.keep_last"),
        (lambda: reshard.Durable("/x", every=4, keep_every=0), "Durable.keep_every"),
        (lambda: reshard.Durable(None, every=4), "Durable.root"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_tier_value_is_a_value_error_naming_its_field(make: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


@pytest.mark.parametrize(
    ("tiers", "says"),
    [
        ([reshard.PeerMemory(every=2)], "Durable tier is required"),
        ([], "must be a list"),
        ([reshard.Durable("/x", every=4), reshard.PeerMemory(every=2)], "fastest first"),
        ([reshard.Durable("/x", every=4), reshard.Durable("/y", every=8)], "more than one Durable"),
        ([reshard.PeerMemory(every=2), "/x"], "is not a PeerMemory"),
        # (second outside attack) one directory for both: a node-local step was taken as finalized, and the drain
        # of the next durable step found the node-local copy in its own target (CheckpointExistsError)
        ([reshard.LocalDisk("/x/ckpt", every=2), reshard.Durable("/x/ckpt", every=4)], "is the Durable root"),
        ([reshard.LocalDisk("/x/node{node}", every=2), reshard.Durable("/x/node1", every=4)], "is the Durable root"),
    ],
)
def test_a_bad_list_of_tiers_is_a_value_error(tiers: list[Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        reshard.TieredCheckpointManager(tiers)


def test_ranks_passing_other_tiers_fail_every_rank_naming_the_difference(tmp_path: Path) -> None:
    group = ThreadGroup(2)
    errors = [""] * 2

    def run(r: int) -> None:
        tiers = [reshard.PeerMemory(every=2 if r == 0 else 4, node_size=1), reshard.Durable(tmp_path, every=4)]
        manager = reshard.TieredCheckpointManager(tiers, group=group.member(r), timeout=30)
        try:
            manager.save(4, {"w": torch.ones(2)})
        except reshard.CheckpointError as exc:
            errors[r] = f"{type(exc).__name__}: {exc}"

    on_threads(2, run)
    assert len(set(errors)) == 1, errors
    assert errors[0].startswith("CheckpointError") and "PeerMemory" in errors[0] and "'every': 4" in errors[0]
    assert not (tmp_path / "step_000000004").exists()  # refused before anything was saved


def test_each_tier_keeps_its_steps_and_restore_takes_the_newest_fastest(tmp_path: Path) -> None:
    """Every 2 steps to peer memory, every 4 to the durable root: after step 6 the peer tier holds 6 and the
    durable one 4; status says so on every rank; a restore into another layout (TP=4) comes from peer memory,
    step 6, bit for bit. New managers (the job restarted: peer memory gone) restore step 4 from the durable root."""
    group = ThreadGroup(4)
    managers = _managers(tmp_path, 4, group)
    results = {}
    for step in (2, 4, 5, 6):
        results[step] = on_threads(4, lambda r, s=step: managers[r].save(s, _state(r, s)), group=group)
    assert [r.tiers for r in (results[2][0], results[4][0], results[5][0], results[6][0])] == [
        ("peer",),
        ("peer", "durable"),
        (),
        ("peer",),
    ]
    assert results[4][0].durable is not None and not results[4][0].draining
    for manager in managers:
        status = [(s.step, s.tiers, s.finalized) for s in manager.status()]
        assert status == [(4, ("durable",), True), (6, ("peer",), False)]
        assert manager.finalized(4) and not manager.finalized(6)
    found, warned = _restore(managers, group)
    _check(found, 6, "peer")
    assert not warned

    fresh_group = ThreadGroup(2)
    fresh = _managers(tmp_path, 2, fresh_group, node_size=1)
    found, warned = _restore(fresh, fresh_group)
    _check(found, 4, "durable")


def test_survivors_and_new_ranks_restore_from_peer_memory_into_another_layout(tmp_path: Path) -> None:
    """Node 0 (ranks 0, 1) is lost; the survivors (ranks 2, 3, holding node 0's copies) and two new ranks (fresh
    managers) form a new group and restore at TP=4 from peer memory: step 6, newer than the durable step 4."""
    group = ThreadGroup(4)
    managers = _managers(tmp_path, 4, group)
    for step in (4, 6):
        on_threads(4, lambda r, s=step: managers[r].save(s, _state(r, s)), group=group)
    new_group = ThreadGroup(4)
    survivors = [managers[2], managers[3], *_managers(tmp_path, 2, new_group)]
    for r, manager in enumerate(survivors):
        manager.group = new_group.member(r)
    found, warned = _restore(survivors, new_group)
    _check(found, 6, "peer")
    assert not warned, warned


def test_a_peer_generation_lost_with_its_nodes_falls_back_to_durable_with_a_warning(tmp_path: Path) -> None:
    """Both ranks of node 0 and both of node 1 hold step 6's boxes; with only ranks 0 and 1 left (node 1's copies of
    node 0's boxes gone with it... and node 0 holding its own), rank 0 and a new rank: half the boxes are gone, the
    peer restore raises DataUnavailableError on every rank, and the restore falls back to durable step 4, saying
    which tier, step and why."""
    group = ThreadGroup(4)
    managers = _managers(tmp_path, 4, group)
    for step in (4, 6):
        on_threads(4, lambda r, s=step: managers[r].save(s, _state(r, s)), group=group)
    new_group = ThreadGroup(2)
    # rank 0 holds w's rows 0..3 (TP 0) and rank 2's copy; rows 4..7 were rank 1's and rank 3's copy: both gone.
    left = [managers[0], *_managers(tmp_path, 1, new_group)]
    for r, manager in enumerate(left):
        manager.group = new_group.member(r)
    found, warned = _restore(left, new_group)
    _check(found, 4, "durable")
    assert any("step 6 from the peer tier failed" in w and "held by no rank" in w for w in warned), warned


def test_a_corrupt_durable_step_falls_back_to_the_older_one(tmp_path: Path) -> None:
    group = ThreadGroup(2)
    managers = _managers(tmp_path, 2, group, node_size=1)
    for step in (4, 8):
        on_threads(2, lambda r, s=step: managers[r].save(s, _state(r, s)), group=group)
    data = next((tmp_path / "durable" / "step_000000008" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    fresh_group = ThreadGroup(2)
    found, warned = _restore(_managers(tmp_path, 2, fresh_group, node_size=1), fresh_group)
    _check(found, 4, "durable")
    assert any("step 8 from the durable tier failed" in w for w in warned), warned


def test_nothing_saved_restores_none_and_a_template_mismatch_raises(tmp_path: Path) -> None:
    group = ThreadGroup(2)
    managers = _managers(tmp_path, 2, group, node_size=1)
    assert on_threads(2, lambda r: managers[r].restore(_template(r, 2)), group=group) == [None, None]
    on_threads(2, lambda r: managers[r].save(2, _state(r, 2)), group=group)

    def wrong(r: int) -> Any:
        template = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4, dtype=torch.int64), (0, r, 2))}
        return managers[r].restore({**template, "step": -1})

    with pytest.raises(reshard.CheckpointError):
        on_threads(2, wrong, group=group)


def test_save_written_commits_a_step_that_a_function_wrote_under_the_manager_rules(tmp_path: Path) -> None:
    """What a drain uses: the step written by the function (here a plain save into the step's storage) is committed
    under the manager's rules: ``latest.json`` names it, retention runs (keep_last=1 deletes step 4), and a step
    older than the newest complete one is refused before the function runs."""
    manager = reshard.CheckpointManager(tmp_path, keep_last=1)
    manager.save(4, {"w": torch.ones(2)})
    written: list[int] = []

    def write(step: int) -> Any:
        def run(target: Any, replaces: Any) -> None:
            written.append(step)
            reshard.save({"w": torch.full((2,), float(step))}, target)
            target.close()

        return run

    manager.save_written(8, write(8))
    assert manager.steps() == [8] and manager.latest_pointer() == 8
    assert torch.equal(reshard.load({"w": torch.zeros(2)}, tmp_path / "step_000000008")["w"], torch.full((2,), 8.0))
    with pytest.raises(reshard.CheckpointExistsError, match="go back in time"):
        manager.save_written(6, write(6))
    assert written == [8] and manager.steps() == [8]
