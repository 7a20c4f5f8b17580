"""The corruption suite in ``make test``: seeded damage to a committed checkpoint, every reading tool run
on each damaged copy, and "error or exact, never wrong" (see :mod:`tests.corruption`).

``benchmarks/chaos.py --corruptions N`` runs more of them for docs/reliability.md.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from tests import corruption
from tests.conftest import PoolRegistry

pytestmark = pytest.mark.dist

SEED = 20261201
CORRUPTIONS = 150


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, pools: PoolRegistry) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("corruption")
    corruption.make_pristine_in(pools.get(4), base / "pristine", base / "other")
    return base / "pristine", base / "other"


def test_the_pristine_checkpoint_passes_every_tool(pristine: tuple[Path, Path], tmp_path: Path) -> None:
    path, _ = pristine
    runs = corruption.run_tools(path, path, tmp_path, corruption.Damage("none", benign=True))
    assert set(runs.results.values()) == {"exact"}, runs.results
    assert len(list((path / "data").iterdir())) == 2


def test_damage_is_refused_or_harmless_never_wrong(pristine: tuple[Path, Path], tmp_path: Path) -> None:
    path, other = pristine
    rng = random.Random(SEED)
    all_runs = []
    for i in range(CORRUPTIONS):
        copy = tmp_path / f"c{i}"
        shutil.copytree(path, copy / "ckpt")
        (copy / "out").mkdir()
        damage = corruption.corrupt(copy / "ckpt", other, rng)
        all_runs.append(corruption.run_tools(copy / "ckpt", path, copy / "out", damage))
        shutil.rmtree(copy)
    summary = corruption.summarize(all_runs)
    assert summary["silent"] == 0 and summary["violations"] == 0, corruption.dumps(summary)
    assert summary["refused"] > summary["tool_runs"] // 2  # most damage is caught, not harmless
    assert len(summary["by_kind"]) >= 12, summary["by_kind"]
