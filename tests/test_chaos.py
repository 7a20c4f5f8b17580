"""The chaos suite in ``make test``: SIGKILL of one rank at phase boundaries and at random points of real
multi-process saves, with the invariants of :mod:`tests.chaos` checked after each kill.

Each scenario's dry run lists every event (collective, storage operation) of every rank; the suite visits a
seeded sample of them (before and after each) and a few kills at random delays. ``benchmarks/chaos.py`` runs
all of them, and more, for the figures of docs/reliability.md. A failing iteration prints its scenario, kill
point and reason; rerun it alone with ``tests.chaos.run_iteration``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import chaos

SEED = 20261201
# (scenario, ranks): kill points sampled from the dry run's events (None: every one), kills at random delays
PLAN = {
    ("overwrite", 2): (None, 4),
    ("overwrite", 4): (24, 4),
    ("async", 2): (24, 4),
    ("fresh", 3): (24, 4),
    ("manager", 3): (40, 4),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[chaos.Outcome]]:
    base = tmp_path_factory.mktemp("chaos")
    out: dict[tuple[str, int], list[chaos.Outcome]] = {}
    for (scenario, world), (systematic, timed) in PLAN.items():
        runs = out.setdefault((scenario, world), [])
        for iteration in chaos.plan(
            ((scenario, world),), base / f"{scenario}-{world}", seed=SEED, systematic=systematic, timed=timed
        ):
            runs.append(chaos.run_iteration(iteration))
            chaos.remove(iteration.directory)
    return out


def _report(runs: list[chaos.Outcome]) -> str:
    bad = [o for o in runs if o.status != "clean"]
    return "\n".join(f"{o.scenario}/{o.world} {o.point}: {o.status}: {o.reason}" for o in bad[:10])


@pytest.mark.parametrize("case", list(PLAN), ids=[f"{s}-{w}" for s, w in PLAN])
def test_no_kill_costs_a_checkpoint_or_loads_wrong_bytes(
    outcomes: dict[tuple[str, int], list[chaos.Outcome]], case: tuple[str, int]
) -> None:
    runs = outcomes[case]
    summary = chaos.summarize(runs)
    assert summary["lost"] == 0 and summary["silent"] == 0 and summary["violations"] == 0, _report(runs)
    assert summary["clean"] == summary["tried"]
    # the kills did happen, and both outcomes of a save were reached: the old state kept, the new one committed
    assert summary["killed"] >= summary["tried"] - PLAN[case][1]
    if case[0] != "fresh":
        assert summary["committed_new"] > 0 and summary["kept_old"] > 0, summary


def test_every_phase_boundary_of_a_two_rank_overwrite_was_visited(
    outcomes: dict[tuple[str, int], list[chaos.Outcome]], tmp_path: Path
) -> None:
    events, _ = chaos.dry_run("overwrite", 2, tmp_path / "dry")
    collectives = [(rank, i) for rank, names in events.items() for i, n in enumerate(names) if n.endswith("_bytes")]
    visited = {o.point for o in outcomes[("overwrite", 2)]}
    for rank, index in collectives:
        for when in ("before", "after"):
            assert chaos.KillPoint(rank=rank, index=index, when=when).describe() in visited
