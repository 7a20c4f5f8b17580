"""Hostile tensors on one rank (:mod:`tests.contract.hostile_tensors`): every flow that moves tensors between
ranks refuses what it cannot read or fill with the same reshard error on every rank, before any byte moved
and without a hang, and handles conjugate views exactly."""

from __future__ import annotations

import pytest

from tests.contract import hostile_tensors

pytestmark = pytest.mark.dist

CASES = hostile_tensors.cases()


@pytest.mark.parametrize("case", CASES, ids=[f"{c.flow}-{c.tensor}" for c in CASES])
def test_a_hostile_tensor_on_one_rank_fails_every_rank_alike_or_travels_exactly(case: hostile_tensors.Case) -> None:
    answers, in_time = hostile_tensors.run_case(case)
    problem = hostile_tensors.judge(case, answers, in_time)
    assert problem == "", problem
