"""kill -9 of one rank of every flow, at a seeded sample of its events and at random delays, with every
guarantee checked after each kill (:mod:`tests.contract.harness`).

Each flow's dry run lists every event of every rank; the sample always holds the flow's pinned points (the
coordinator around its commit, the first exchange of tensors) so that both outcomes of a save are reached.
``python -m benchmarks.chaos --all-flows`` visits every event of every rank, on 2 to 4 ranks, for the
figures of docs/reliability.md. A failing iteration prints its flow, kill point and reason; rerun it alone
with ``tests.contract.harness.run_iteration``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.contract import flows_trainers, harness
from tests.contract.flows import FLOWS

pytestmark = pytest.mark.dist

SEED = 20261202
# (flow, ranks): kill points sampled from the dry run's events (None: every one), kills at random delays
PLAN: dict[tuple[str, int], tuple[int | None, int]] = {
    ("overwrite", 2): (24, 2),
    ("async", 3): (12, 2),
    ("fresh", 3): (12, 2),
    ("partitioned", 2): (10, 1),
    ("manager", 3): (12, 2),
    ("manager_reuse", 3): (12, 2),
    ("incremental", 2): (14, 2),
    ("read_once", 3): (10, 1),
    ("manager_read_reuse", 3): (10, 1),
    ("hierarchical", 4): (12, 1),
    ("hierarchical_load", 3): (8, 1),
    ("transfer", 3): (8, 1),
    ("delta", 2): (8, 1),
    ("quantize", 2): (8, 1),
    ("peer", 3): (10, 1),
    ("tiered", 3): (12, 2),
    ("data", 3): (10, 1),
    ("megatron", 2): (10, 1),
    ("convert", 1): (8, 1),
    ("import_dcp", 1): (8, 1),
    ("titan", 2): (8, 1),
    ("titan_async", 2): (8, 1),
    ("lightning", 1): (8, 1),
    ("accelerate", 1): (8, 1),
}
RUN = [case for case in PLAN if flows_trainers.missing(case[0]) is None]
"""The cases whose libraries are installed (a trainer integration's flow is skipped without its library)."""


def test_every_flow_is_in_the_sample() -> None:
    """A flow is not done until the suite kills it (docs/architecture.md, "Adding a flow")."""
    assert {name for name, _ in PLAN} == set(FLOWS)


CONCURRENT_FLOWS = 2
"""Flows sampled at once, each in a thread of its own (the harness shares one zygote between them): a rank
spends most of an iteration waiting (its group forming, fsync, the harness polling its answer), so two
samples side by side take about half the wall time of one after the other on two cores. Each flow's sample is
the same as alone (seeded per flow); its timed kills are drawn within its own dry run's span, measured under
the same load."""


def _sample_flow(base: Path, case: tuple[str, int]) -> list[harness.Outcome]:
    """Every iteration of ``case``'s sample (PLAN), one after the other."""
    (flow, world), (systematic, timed) = case, PLAN[case]
    runs = []
    for iteration in harness.plan(
        ((flow, world),), base / f"{flow}-{world}", seed=SEED, systematic=systematic, timed=timed
    ):
        runs.append(harness.run_iteration(iteration))
        harness.remove(iteration.directory)
    return runs


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[harness.Outcome]]:
    base = tmp_path_factory.mktemp("kills")
    with ThreadPoolExecutor(CONCURRENT_FLOWS, thread_name_prefix="kill-sample") as executor:
        futures = {case: executor.submit(_sample_flow, base, case) for case in RUN}
        return {case: future.result() for case, future in futures.items()}


def _report(runs: list[harness.Outcome]) -> str:
    bad = [o for o in runs if o.status != "clean"]
    return "\n".join(f"{o.flow}/{o.world} {o.point}: {o.status}: {o.reason}" for o in bad[:10])


@pytest.mark.parametrize("case", list(PLAN), ids=[f"{f}-{w}" for f, w in PLAN])
def test_no_kill_breaks_a_guarantee(
    outcomes: dict[tuple[str, int], list[harness.Outcome]], case: tuple[str, int]
) -> None:
    if case not in RUN:
        pytest.skip(f"{flows_trainers.missing(case[0])} is not installed")
    runs = outcomes[case]
    summary = harness.summarize(runs)
    assert summary["clean"] == summary["tried"], _report(runs)
    # the kills did happen (a random delay may fall after the flow has ended)
    assert summary["killed"] >= summary["tried"] - PLAN[case][1]


@pytest.mark.parametrize("flow", ["overwrite", "manager", "incremental", "convert", "import_dcp"])
def test_both_outcomes_of_a_commit_are_reached(
    outcomes: dict[tuple[str, int], list[harness.Outcome]], flow: str
) -> None:
    """A sample that never kills after the commit (or never before) would not test the point of no return."""
    runs = next(runs for (name, _), runs in outcomes.items() if name == flow)
    summary = harness.summarize(runs)
    assert summary["committed_new"] > 0 and summary["kept_old"] > 0, summary


def test_every_phase_boundary_of_a_two_rank_overwrite_was_visited(
    outcomes: dict[tuple[str, int], list[harness.Outcome]], tmp_path: Path
) -> None:
    events, _ = harness.dry_run("overwrite", 2, tmp_path / "dry")
    collectives = [(rank, i) for rank, names in events.items() for i, n in enumerate(names) if n.endswith("_bytes")]
    visited = {o.point for o in outcomes[("overwrite", 2)]}
    for rank, index in collectives:
        for when in ("before", "after"):
            assert harness.KillPoint(rank=rank, index=index, when=when).describe() in visited
