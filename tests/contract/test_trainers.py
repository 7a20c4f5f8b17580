"""The trainer integrations' flows (:mod:`tests.contract.flows_trainers`) killed at chosen points: the points
where a save of the integration is between its own writes and reshard's commit (the kill sample of
test_kills.py draws from every point; these pin the ones that once broke a guarantee)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract import flows_trainers, harness
from tests.contract.events import KillPoint

pytestmark = pytest.mark.dist


def _kill_at(flow: str, world: int, base: Path, picks: list[tuple[str, str]]) -> list[harness.Outcome]:
    """One iteration per (event name prefix, 'before'/'after') of ``picks``, at rank 0's first such event."""
    if flows_trainers.missing(flow):
        pytest.skip(f"{flows_trainers.missing(flow)} is not installed")
    events, _ = harness.dry_run(flow, world, base / "dry")
    runs = []
    for count, (prefix, when) in enumerate(picks):
        index = next(i for i, name in enumerate(events[0]) if name.startswith(prefix))
        directory = base / f"it-{count}"
        directory.mkdir()
        runs.append(harness.run_iteration(harness.Iteration(flow, world, KillPoint(0, index, when), str(directory))))
    return runs


def _failures(runs: list[harness.Outcome]) -> list[str]:
    return [f"{o.point}: {o.status}: {o.reason}" for o in runs if o.status != "clean" or not o.killed]


def test_accelerate_save_state_killed_between_its_files_and_reshards_commit_never_loads_a_mix(tmp_path: Path) -> None:
    """Kills around reshard's commit and around each file accelerate writes itself (scheduler, RNG and step,
    registered object): ``load_state`` then restores one whole save or raises a reshard error, never the model
    of one save with the scheduler, step or RNG of the other (it did: reshard's checkpoint was committed first,
    accelerate's files after it)."""
    picks = [("commit metadata.json", "before"), ("commit metadata.json", "after")]
    picks += [(f"torch.save {name}", "before") for name in ("scheduler", "random_states", "custom_checkpoint")]
    runs = _kill_at("accelerate", 1, tmp_path, picks)
    assert not _failures(runs), _failures(runs)
    assert {o.loaded for o in runs} >= {None, 2} or {o.loaded for o in runs} >= {1, 2}, [o.loaded for o in runs]
