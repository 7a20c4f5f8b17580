"""What an outside attack on ``reshard.TieredCheckpointManager`` found (issue 33), pinned on in-process ranks (threads
of a ``ThreadGroup``; 2 ranks as 2 simulated nodes of 1, each node's directory ``<tmp>/node{node}``): a node-local
step of an abandoned timeline that no node can restore no longer blocks the job, a finalized step whose certificate
never reached the durable tier gets it from its node-local copy, one certify rule for every tier, a peer-memory step
whose checks passed is certified, and non-integer steps are a ValueError naming the step."""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.flows.certify import certified, options_term
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads

pytestmark = pytest.mark.unit


def _tiers(tmp_path: Path, *, peer: bool = False, keep_last: int = 3) -> list[Any]:
    """Every step to peer memory (when ``peer``), every 2 to node-local disk, every 4 to the durable root."""
    tiers: list[Any] = [reshard.PeerMemory(every=1, node_size=1)] if peer else []
    tiers.append(reshard.LocalDisk(os.path.join(tmp_path, "node{node}"), every=2, node_size=1, keep_last=keep_last))
    tiers.append(reshard.Durable(tmp_path / "durable", every=4))
    return tiers


def _managers(tiers: list[Any], **kwargs: Any) -> tuple[ThreadGroup, list[reshard.TieredCheckpointManager]]:
    group, drains = ThreadGroup(2, timeout=30), ThreadGroup(2, timeout=30)
    managers = [
        reshard.TieredCheckpointManager(
            tiers, group=group.member(r), drain_group=drains.member(r), timeout=30, **kwargs
        )
        for r in range(2)
    ]
    return group, managers


def _state(rank: int, step: int) -> dict[str, Any]:
    """``w`` (8 x 4, every value ``step``) split on rows over the 2 ranks."""
    rows = torch.full((4, 4), float(step))
    return {"w": reshard.ShardedTensor.from_rank_offsets("w", rows, (0, rank, 2)), "step": step}


def _saved(tiers: list[Any], steps: tuple[int, ...], **kwargs: Any) -> None:
    """A job that saves ``steps``, waits for its drain and ends."""
    group, managers = _managers(tiers, **kwargs)

    def run(r: int) -> None:
        for step in steps:
            managers[r].save(step, _state(r, step))
        managers[r].close()

    on_threads(2, run, group=group)


def _restore(managers: list[Any], group: ThreadGroup) -> tuple[list[Any], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = on_threads(2, lambda r: managers[r].restore(_state(r, -1)), group=group)
    return [(step, tier, float(state["w"].data[0, 0])) for step, tier, state in found], [str(w.message) for w in caught]


def test_a_newer_node_local_step_no_node_can_restore_is_discarded_after_a_restore_and_saved_again(
    tmp_path: Path,
) -> None:
    """F2: steps 2, 4, 6 node-local (4 finalized); node 1's disk is replaced: step 6 is complete on node 0 only,
    not restorable. The restart restores step 4; its save of step 6 then replaces node 0's abandoned copy (it was
    refused on every rank, at every restart, for ever); a person's file in that copy stays."""
    tiers = _tiers(tmp_path)
    _saved(tiers, (2, 4, 6))
    shutil.rmtree(tmp_path / "node1")
    (tmp_path / "node0" / "step_000000006" / "notes.txt").write_text("mine")
    group, managers = _managers(tiers)
    found, _ = _restore(managers, group)
    assert found == [(4, "durable", 4.0)] * 2
    results = on_threads(2, lambda r: managers[r].save(6, _state(r, 106)), group=group)
    assert [r.tiers for r in results] == [("local",)] * 2
    assert (tmp_path / "node0" / "step_000000006" / "notes.txt").read_text() == "mine"
    found, _ = _restore(managers, group)
    assert found == [(6, "local", 106.0)] * 2
    on_threads(2, lambda r: managers[r].close())


def test_a_finalized_step_whose_certificate_never_arrived_gets_it_from_its_node_local_copy(tmp_path: Path) -> None:
    """F3: a drain killed between the durable ``metadata.json`` and ``certified.json`` (here: the durable
    certificate removed, the state it leaves) left the finalized step uncertified for ever, and status said
    certified from the node-local copy. Status now says what the durable tier holds; the next restore (or save)
    copies the node-local certificate, which certifies the same ``metadata.json`` bytes."""
    tiers = _tiers(tmp_path)
    _saved(tiers, (2, 4))
    durable = tmp_path / "durable" / "step_000000004"
    assert certified(durable)
    (durable / "certified.json").unlink()
    group, managers = _managers(tiers)
    assert [(s.step, s.finalized, s.certified) for s in managers[0].status()] == [(2, False, True), (4, True, False)]
    found, _ = _restore(managers, group)
    assert found == [(4, "local", 4.0)] * 2
    assert certified(durable)
    assert [(s.step, s.finalized, s.certified) for s in managers[1].status()] == [(2, False, True), (4, True, True)]
    on_threads(2, lambda r: managers[r].close())


def test_the_first_save_also_carries_a_lost_durable_certificate(tmp_path: Path) -> None:
    """F3, without a restore: the job's first save finishes the certificate of the finalized step."""
    tiers = _tiers(tmp_path)
    _saved(tiers, (4,))
    durable = tmp_path / "durable" / "step_000000004"
    (durable / "certified.json").unlink()
    group, managers = _managers(tiers)
    on_threads(2, lambda r: managers[r].save(6, _state(r, 6)), group=group)
    assert certified(durable)
    on_threads(2, lambda r: managers[r].close())


@pytest.mark.parametrize(
    ("manager", "given"),
    [
        (None, (reshard.CertifyOptions(), reshard.CertifyOptions())),
        (reshard.CertifyOptions(), (reshard.CertifyOptions(allow_nonfinite=("w",)),) * 2),
        (reshard.CertifyOptions(), (reshard.CertifyOptions(replicas=False), None)),
    ],
)
def test_a_save_options_certify_other_than_the_managers_fails_every_rank_naming_both(
    tmp_path: Path, manager: Any, given: tuple[Any, Any]
) -> None:
    """F4: the manager's ``certify`` is the only source of every tier's checks (the drain carries what they
    certified); a ``SaveOptions.certify`` other than it was honoured by some tiers and not others, and ranks
    passing other ones both succeeded. Now a CheckpointError on every rank, naming both, before anything is
    written."""
    _, managers = _managers(_tiers(tmp_path), certify=manager)
    errors = [""] * 2

    def run(r: int) -> None:
        certify = given[r]
        options = reshard.SaveOptions(certify=certify) if certify is not None else None
        try:
            managers[r].save(4, _state(r, 4), options=options)
        except reshard.CheckpointError as exc:
            errors[r] = f"{type(exc).__name__}: {exc}"
        managers[r].close()

    on_threads(2, run)
    assert errors[0] and errors[0] == errors[1], errors
    assert errors[0].startswith("CheckpointError") and "SaveOptions.certify=" in errors[0], errors[0]
    assert f"the manager's certify is {options_term(manager)}" in errors[0], errors[0]
    assert not (tmp_path / "node0" / "step_000000004").exists()
    assert not (tmp_path / "durable" / "step_000000004").exists()


def test_the_managers_own_certify_in_save_options_is_accepted(tmp_path: Path) -> None:
    """F4: the same checks as the manager's, given again in the options, are no conflict."""
    group, managers = _managers(_tiers(tmp_path))
    options = reshard.SaveOptions(certify=reshard.CertifyOptions())
    on_threads(2, lambda r: managers[r].save(4, _state(r, 4), options=options), group=group)
    on_threads(2, lambda r: managers[r].close())
    assert certified(tmp_path / "durable" / "step_000000004")


def test_a_peer_memory_step_whose_checks_passed_is_certified_and_restored(tmp_path: Path) -> None:
    """F6: the peer generation of step 7 (no storage tier holds it) passed its own checks: it is certified."""
    group, managers = _managers(_tiers(tmp_path, peer=True))
    on_threads(2, lambda r: [managers[r].save(s, _state(r, s)) for s in range(1, 8)], group=group)
    assert [(s.step, s.certified) for s in managers[0].status() if s.step == 7] == [(7, True)]
    found, caught = _restore(managers, group)
    assert found == [(7, "peer", 7.0)] * 2
    assert not [w for w in caught if "certified" in w], caught
    on_threads(2, lambda r: managers[r].close())


def test_a_step_without_a_certificate_is_named_once_in_the_warning(tmp_path: Path) -> None:
    """F6: the note said ``is not certified (not certified)``; it now says why once."""
    tiers = _tiers(tmp_path)
    _saved(tiers, (4, 6))
    for node in ("node0", "node1"):
        (tmp_path / node / "step_000000006" / "certified.json").unlink()
    group, managers = _managers(tiers)
    found, caught = _restore(managers, group)
    assert found == [(4, "local", 4.0)] * 2
    notes = [w for w in caught if "step 6" in w]
    assert notes and all("not certified (not certified)" not in w for w in notes), notes
    assert all("no certified.json" in w for w in notes), notes
    on_threads(2, lambda r: managers[r].close())


@pytest.mark.parametrize("step", [2.0, True, torch.tensor(2)], ids=["float", "bool", "tensor"])
def test_a_step_that_is_not_an_int_is_a_value_error_naming_it_in_every_manager(tmp_path: Path, step: Any) -> None:
    """F7: a float step was ``Unknown format code 'd'``, a tensor step a CheckpointError wrapping a TypeError, a
    bool saved as step 1."""
    state = {"w": torch.ones(4)}
    tiers = [reshard.LocalDisk(tmp_path / "local", every=1), reshard.Durable(tmp_path / "durable", every=2)]
    tiered = reshard.TieredCheckpointManager(tiers)
    manager = reshard.CheckpointManager(tmp_path / "plain")
    local = reshard.NodeLocalCheckpoints(tmp_path / "nodelocal")
    for save in (tiered.save, manager.save, local.save):
        with pytest.raises(ValueError, match=re.escape(repr(step))):
            save(step, state)
    tiered.close()
    manager.close()
    for where in ("local", "durable", "plain", "nodelocal"):
        assert not list((tmp_path / where).glob("step_*")), where


def test_node_local_steps_of_an_abandoned_timeline_are_not_restored_past_a_finalized_step(tmp_path: Path) -> None:
    """(second outside attack) Job X on cluster 1 saves node-local 2, 4, 6, 8 (4 finalized; the drain of 8 cut before
    its commit). Job Y on other nodes (empty disks), same durable root, restores 4 and saves 6 and 8 anew (8
    finalized: Y's save). Back on cluster 1, a restore took X's node-local step 8 as the fastest copy of step 8:
    the job went on from X's abandoned timeline while the finalized step 8 was Y's, silently. Now a node-local copy
    of a step the durable tier holds as another save, and every node-local step after it, are not restored from."""
    cluster1 = _tiers(tmp_path / "c1")
    cluster1[-1] = reshard.Durable(tmp_path / "durable", every=4)
    cluster2 = _tiers(tmp_path / "c2")
    cluster2[-1] = reshard.Durable(tmp_path / "durable", every=4)
    _saved(cluster1, (2, 4, 6, 8))
    for name in ("certified.json", "checks.json", "metadata.json"):  # the drain of 8 killed before its commit
        (tmp_path / "durable" / "step_000000008" / name).unlink(missing_ok=True)
    group, managers = _managers(cluster2)
    found, _ = _restore(managers, group)
    assert found == [(4, "durable", 4.0)] * 2
    on_threads(2, lambda r: [managers[r].save(s, _state(r, 100 + s)) for s in (6, 8)] and managers[r].close())
    group, managers = _managers(cluster1)
    found, warned = _restore(managers, group)
    assert found == [(8, "durable", 108.0)] * 2
    assert any("node-local steps [8] are of another timeline" in w for w in warned), warned
    on_threads(2, lambda r: managers[r].close())
