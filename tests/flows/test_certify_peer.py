"""Certified peer-memory saves (``PeerMemoryCheckpoint.save(certify=...)``): the checks of a certified save run on
the state the tier keeps, judged on the coordinator of the save's planning step, kept with the generation and
agreed again by a restore. Ranks are threads of this process (ThreadGroup: the real protocol)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import reshard
from reshard.net.transports import ThreadGroup
from tests.flows.test_certify import dp_state
from tests.threads import on_threads

pytestmark = pytest.mark.unit


def peer_save(tiers: list[reshard.PeerMemoryCheckpoint], states: list[Any], **kwargs: Any) -> list[Any]:
    group = ThreadGroup(len(states), timeout=20)
    return on_threads(len(states), lambda r: tiers[r].save(states[r], group=group.member(r), **kwargs), group=group)


def test_a_flipped_bit_in_one_peer_replica_fails_the_checks_naming_key_and_ranks() -> None:
    tiers = [reshard.PeerMemoryCheckpoint(node_size=1) for _ in range(2)]
    results = peer_save(tiers, [dp_state(0), dp_state(1, flip=True)], certify=reshard.CertifyOptions())
    checks = [r.checks for r in results]
    assert checks[0] == checks[1] and checks[0] is not None and not checks[0].passed
    (problem,) = checks[0].problems
    assert "'emb'" in problem and "rank 1" in problem and "rank 0 (the copy saved)" in problem
    assert [t.checks for t in tiers] == checks


def test_a_clean_peer_save_passes_and_a_restore_agrees_its_checks() -> None:
    tiers = [reshard.PeerMemoryCheckpoint(node_size=1) for _ in range(2)]
    results = peer_save(tiers, [dp_state(0), dp_state(1)], certify=reshard.CertifyOptions())
    passed = reshard.Checks(passed=True, checked=("finite", "replicas"))
    assert [r.checks for r in results] == [passed, passed]
    fresh = [tiers[0], reshard.PeerMemoryCheckpoint(node_size=1)]  # rank 1 restarted: a new object
    group = ThreadGroup(2, timeout=20)
    restored = on_threads(2, lambda r: fresh[r].restore(dp_state(r), group=group.member(r)), group=group)
    assert torch.equal(restored[1]["w"].data, dp_state(1)["w"].data)
    assert [t.checks for t in fresh] == [passed, passed]


def test_a_peer_save_without_certify_has_no_checks_and_a_nan_is_named() -> None:
    tiers = [reshard.PeerMemoryCheckpoint(node_size=1) for _ in range(2)]
    assert [r.checks for r in peer_save(tiers, [dp_state(0), dp_state(1)])] == [None, None]
    assert [t.checks for t in tiers] == [None, None]
    results = peer_save(tiers, [dp_state(0, nan=True), dp_state(1)], certify=reshard.CertifyOptions())
    assert results[0].checks is not None and not results[0].checks.passed
    assert "'w' box (0,0)+(2,4) holds 1 NaN" in results[0].checks.problems[0]


def test_ranks_with_other_certify_options_in_a_peer_save_are_refused_on_every_rank() -> None:
    tiers = [reshard.PeerMemoryCheckpoint(node_size=1) for _ in range(2)]
    group = ThreadGroup(2, timeout=20)
    options = [reshard.CertifyOptions(), None]
    errors: list[Exception] = []

    def run(r: int) -> None:
        try:
            tiers[r].save(dp_state(r), group=group.member(r), certify=options[r])
        except reshard.CheckpointError as exc:
            errors.append(exc)

    on_threads(2, run)
    assert len(errors) == 2 and all("certify" in str(e) for e in errors)
