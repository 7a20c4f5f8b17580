"""Hostile documents of every format version against every reading and root tool, with every path the tools
touch recorded (:mod:`tests.contract.hostile`)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from tests.contract import hostile

pytestmark = pytest.mark.dist

SEED = 20261202
SAMPLE = {1: 3, 2: 3, 3: 3, 4: 27, 6: 6}
"""Attacked documents per format version in ``make test`` (``benchmarks.chaos --all-flows``: 200 and more)."""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    base = tmp_path_factory.mktemp("hostile-pristine")
    out = {}
    for version in SAMPLE:
        hostile.make_pristine(base / f"v{version}", version)
        out[version] = base / f"v{version}"
    return out


def test_the_pristine_sandboxes_pass_every_tool(pristine: dict[int, Path], tmp_path: Path) -> None:
    for version, path in pristine.items():
        copy = tmp_path / f"v{version}"
        shutil.copytree(path, copy, symlinks=True)
        verdict = hostile.run_tools(copy, path, hostile.Attack(version, "none", ""))
        assert set(verdict.results.values()) == {"exact"}, (version, verdict.results)


@pytest.mark.parametrize("version", sorted(SAMPLE))
def test_hostile_documents_are_refused_without_touching_anything_outside(
    pristine: dict[int, Path], tmp_path: Path, version: int
) -> None:
    rng = random.Random(SEED + version)
    verdicts = []
    for i in range(SAMPLE[version]):
        copy = tmp_path / f"doc-{i}"
        shutil.copytree(pristine[version], copy, symlinks=True)
        attack = hostile.attack(copy, version, rng)
        verdicts.append(hostile.run_tools(copy, pristine[version], attack))
        shutil.rmtree(copy)
    summary = hostile.summarize(verdicts)
    assert summary["silent"] == summary["outside"] == summary["other"] == 0, summary["failures"]


@pytest.mark.parametrize("record", hostile.RECORDS)
def test_hostile_certification_records_certify_nothing(pristine: dict[int, Path], tmp_path: Path, record: str) -> None:
    """Every hostile record (oversized, deep, wrong types, hostile strings) against every tool: refused or harmless,
    never certified, nothing touched outside."""
    verdicts = []
    for i, how in enumerate(sorted(hostile.HOSTILE_RECORDS)):
        copy = tmp_path / f"doc-{i}"
        shutil.copytree(pristine[4], copy, symlinks=True)
        detail = hostile.attack_record(copy, record, how)
        verdicts.append(hostile.run_tools(copy, pristine[4], hostile.Attack(4, "record", detail)))
        assert verdicts[-1].results["certification"] in ("error", "exact"), verdicts[-1].results
        shutil.rmtree(copy)
    summary = hostile.summarize(verdicts)
    assert summary["silent"] == summary["outside"] == summary["other"] == 0, summary["failures"]
