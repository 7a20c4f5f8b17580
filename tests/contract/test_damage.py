"""Seeded damage of a manager's root of incremental steps (data files, metadata, markers, retired.json,
latest.json), then every reader and mutator of the root (:mod:`tests.contract.damage`)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from tests.contract import damage

pytestmark = pytest.mark.dist

SEED = 20261202
DAMAGES = 40
"""Damaged copies in ``make test`` (``benchmarks.chaos --all-flows``: 1,000)."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("damage") / "root"
    damage.make_pristine(root)
    return root


def test_the_pristine_root_passes_every_tool(pristine: Path, tmp_path: Path) -> None:
    damage.copy(pristine, tmp_path / "root")
    verdict = damage.run_tools(tmp_path / "root", damage.Damage("none", ""))
    assert not verdict.findings, verdict.results
    assert verdict.results["load step_000000001"] == "error"  # retired: not a checkpoint
    assert verdict.results["load step_000000003"] == "exact"
    assert verdict.results["certified step_000000003"] == "exact"  # certified


def test_damage_is_refused_or_harmless_and_never_costs_a_kept_checkpoint(pristine: Path, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    verdicts = []
    for i in range(DAMAGES):
        root = tmp_path / f"c{i}"
        damage.copy(pristine, root)
        hurt = damage.corrupt(root, rng)
        verdicts.append(damage.run_tools(root, hurt))
        shutil.rmtree(root)
    summary = damage.summarize(verdicts)
    assert summary["silent"] == summary["lost"] == summary["outside"] == summary["other"] == 0, summary["failures"]
    assert len(summary["by_kind"]) >= 10, summary["by_kind"]


@pytest.mark.parametrize("record", ["certified.json", "checks.json"])
@pytest.mark.parametrize("how", ["flip", "truncate", "delete", "garbage", "swap"])
def test_a_damaged_certification_record_certifies_nothing_and_loads_are_unaffected(
    pristine: Path, tmp_path: Path, record: str, how: str
) -> None:
    """Step 3's record damaged: the step is not certified (or, a flipped bit in its time, still its own), every
    step loads as before, and the certifying manager resumes from a certified step, exactly."""
    root = tmp_path / "root"
    damage.copy(pristine, root)
    target = root / "step_000000003" / record
    hurt = damage.damage_file(target, how, random.Random(SEED), others=[root / "step_000000002" / record])
    verdict = damage.run_tools(root, hurt)
    assert not verdict.findings, verdict.results
    assert verdict.results["load step_000000003"] == verdict.results["load step_000000002"] == "exact"
    if how in ("truncate", "delete", "garbage", "swap") and record == "certified.json":
        assert verdict.results["certified step_000000003"] == "error"


@pytest.mark.parametrize("how", ["flip", "same_size"])
def test_damage_to_the_held_file_is_not_referenced_by_the_next_save(pristine: Path, tmp_path: Path, how: str) -> None:
    """The frozen base's held file damaged without a change of size: the steps that reference it are refused,
    and the manager's next save writes what it cannot prove is stored, so step 4 loads."""
    root = tmp_path / "root"
    damage.copy(pristine, root)
    hurt = damage.corrupt_held(root, how, random.Random(SEED))
    verdict = damage.run_tools(root, hurt)
    assert not verdict.findings, verdict.results
    assert verdict.results["load step_000000003"] == "error" and verdict.results["save"] == "exact"
