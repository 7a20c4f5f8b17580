"""``reshard.TieredCheckpointManager`` certifying its saves, on in-process ranks (threads of a ``ThreadGroup``; 4 ranks
as 2 simulated nodes of 2, each node's directory ``<tmp>/node{node}``): a drained step carries its certificate to the
durable tier, a flipped bit on one data-parallel replica leaves its step uncertified and restore picks the older
certified step saying why, and the job then saves on past the uncertified durable step and the node-local steps it
abandoned."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.flows.certify import certified
from reshard.net.transports import ThreadGroup
from tests.flows.test_tiered_threads import _expected, _state, _template
from tests.threads import on_threads

pytestmark = pytest.mark.unit


def _managers(tmp_path: Path, group: ThreadGroup, drains: ThreadGroup, **kwargs: Any) -> list[Any]:
    """Every 2 steps to peer memory and node-local disk, every 4 to the durable root; certifying by default."""
    tiers = [
        reshard.PeerMemory(every=2, node_size=2),
        reshard.LocalDisk(os.path.join(tmp_path, "node{node}"), every=2, node_size=2),
        reshard.Durable(tmp_path / "durable", every=4),
    ]
    return [
        reshard.TieredCheckpointManager(
            tiers, group=group.member(r), drain_group=drains.member(r), timeout=30, **kwargs
        )
        for r in range(4)
    ]


def _flipped(rank: int, step: int) -> dict[str, Any]:
    """:func:`_state`, but rank 3 (the DP replica of ``w``'s rows 4..7) holds one flipped bit."""
    state = _state(rank, step)
    if rank == 3:
        data = state["w"].data
        data.view(torch.int32)[0, 0] ^= 1
    return state


def _save(managers: list[Any], group: ThreadGroup, step: int, state: Any = _state) -> list[Any]:
    return on_threads(4, lambda r: managers[r].save(step, state(r, step)), group=group)


def _restore(managers: list[Any], group: ThreadGroup) -> tuple[list[Any], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = on_threads(4, lambda r: managers[r].restore(_template(r, 4)), group=group)
    return found, [str(w.message) for w in caught]


def test_a_drained_step_carries_its_certificate_and_status_says_certified(tmp_path: Path) -> None:
    group, drains = ThreadGroup(4, timeout=30), ThreadGroup(4, timeout=30)
    managers = _managers(tmp_path, group, drains)
    results = _save(managers, group, 4)
    assert all(r.local is not None and r.local.checks is not None and r.local.checks.passed for r in results)
    on_threads(4, lambda r: managers[r].wait())
    durable = tmp_path / "durable" / "step_000000004"
    assert certified(str(durable))
    for node in (0, 1):  # the certificate on every node, the same bytes as the durable step's
        local = tmp_path / f"node{node}" / "step_000000004"
        assert (local / "certified.json").read_bytes() == (durable / "certified.json").read_bytes()
    status = managers[0].status()
    assert [(s.step, s.tiers, s.finalized, s.certified) for s in status] == [
        (4, ("peer", "local", "durable"), True, True)
    ]


def test_a_flipped_replica_bit_is_not_certified_restore_picks_the_older_certified_step_and_the_job_saves_on(
    tmp_path: Path,
) -> None:
    """Steps 4 and 6 are certified; step 8 holds one flipped bit on rank 3's replica of ``w``: its checks fail on
    every tier (peer, node-local, and the durable copy the drain made), so the restore skips step 8 with a warning
    naming the replicas that differ and resumes from node-local step 6. The job saves step 8 again (good this
    time): the abandoned node-local step 8 is replaced, the drain replaces the uncertified durable step 8 instead of
    being refused, and step 8 ends finalized and certified."""
    group, drains = ThreadGroup(4, timeout=30), ThreadGroup(4, timeout=30)
    managers = _managers(tmp_path, group, drains)
    for step in (4, 6):
        _save(managers, group, step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the save's own warning: saved but not certified
        results = _save(managers, group, 8, _flipped)
    on_threads(4, lambda r: managers[r].wait())
    checks = results[0].local.checks
    assert not checks.passed and any("differ" in p for p in checks.problems), checks
    assert managers[0].finalized(8) and not certified(str(tmp_path / "durable" / "step_000000008"))

    found, warned = _restore(managers, group)
    for rank, (step, tier, state) in enumerate(found):
        assert (step, tier) == (6, "local"), (rank, step, tier)
        assert torch.equal(state["w"], _expected(rank, 4, 6))
    skipped = [w for w in warned if "step 8 of the" in w and "not certified" in w]
    assert skipped and all("differ" in w for w in skipped), warned

    _save(managers, group, 8)  # saves on: no CheckpointExistsError from the node-local or the durable tier
    on_threads(4, lambda r: managers[r].wait())
    assert managers[0].finalized(8) and certified(str(tmp_path / "durable" / "step_000000008"))
    status = {s.step: s for s in managers[0].status()}
    assert status[8].certified and status[8].tiers == ("peer", "local", "durable")


def test_a_certify_hook_veto_leaves_the_step_uncertified_on_every_tier(tmp_path: Path) -> None:
    group, drains = ThreadGroup(4, timeout=30), ThreadGroup(4, timeout=30)
    managers = _managers(tmp_path, group, drains, certify_hook=lambda step, checks: step != 8)
    _save(managers, group, 4)
    results = _save(managers, group, 8)
    on_threads(4, lambda r: managers[r].wait())
    assert results[0].local.checks.passed is False and "vetoed" in results[0].local.checks.problems[0]
    assert certified(str(tmp_path / "durable" / "step_000000004"))
    assert not certified(str(tmp_path / "durable" / "step_000000008"))
    assert not (tmp_path / "node0" / "step_000000008" / "certified.json").exists()
    with pytest.raises(ValueError, match="certify_hook needs certify"):
        reshard.TieredCheckpointManager(
            [reshard.Durable(tmp_path / "d", every=4)], certify=None, certify_hook=lambda s, c: True
        )


def test_ranks_passing_other_certify_fail_every_rank_naming_it(tmp_path: Path) -> None:
    group = ThreadGroup(2, timeout=30)
    errors = [""] * 2

    def run(r: int) -> None:
        certify = reshard.CertifyOptions() if r == 0 else reshard.CertifyOptions(replicas=False)
        tiers = [reshard.Durable(tmp_path, every=4)]
        manager = reshard.TieredCheckpointManager(tiers, group=group.member(r), certify=certify, timeout=30)
        try:
            manager.save(4, {"w": torch.ones(2)})
        except reshard.CheckpointError as exc:
            errors[r] = f"{type(exc).__name__}: {exc}"

    on_threads(2, run)
    assert len(set(errors)) == 1 and errors[0].startswith("CheckpointError") and "certify" in errors[0], errors
    assert not (tmp_path / "step_000000004").exists()
