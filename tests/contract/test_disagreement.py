"""Options that disagree across ranks: every rank raises the same reshard error naming the option, and
nothing is committed (:mod:`tests.contract.disagreement`), for every option of every collective flow."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import reshard
from tests.contract import disagreement

pytestmark = pytest.mark.dist

CASES = disagreement.cases()


def test_every_option_field_has_a_case() -> None:
    """A new field of an option object must get a case (or a reason to differ per rank)."""
    for kind, table in disagreement.ALTERNATES.items():
        fields = {f.name for f in dataclasses.fields(getattr(reshard, kind))}
        assert fields == set(table), f"{kind}: fields without a case: {fields - set(table)}"


@pytest.mark.parametrize("case", CASES, ids=[f"{c.flow}-{c.option}" for c in CASES])
def test_a_disagreeing_option_fails_every_rank_alike_and_commits_nothing(
    case: disagreement.Case, tmp_path: Path
) -> None:
    disagreement.prepare(case, tmp_path)
    outcome = disagreement.run_case(case, tmp_path)
    problem = disagreement.judge(case, outcome, tmp_path)
    assert problem == "", problem
