"""Certification after a restart: a certified save records its checks (``checks.json``, tied to its
``metadata.json``), so that any manager of the root (a restarted job's) can certify the step later, and what the
listing says of each step. Ranks are threads of this process (ThreadGroup: the real protocol; real files)."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

import reshard
from reshard.flows.certify import CHECKS_FILE, certification_status, certified, checks_status
from reshard.io.retirement import remove_checkpoint
from reshard.storage import storage_for
from tests.flows.test_certify import dp_state, manager_infos, manager_run

pytestmark = pytest.mark.unit

OPTIONS = reshard.CertifyOptions()


def saved_by(root: Path, steps: dict[int, dict[str, bool]], **kwargs: Any) -> None:
    """Step ``s`` saved by a first incarnation, with ``dp_state(r, **steps[s])`` on rank 1 (rank 0 clean)."""

    def run(manager: reshard.CheckpointManager, r: int) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step, damage in steps.items():
                manager.save(step, dp_state(r, **(damage if r == 1 else {})))

    manager_run(root, run, **kwargs)


def test_a_restarted_manager_certifies_a_step_its_previous_incarnation_checked(tmp_path: Path) -> None:
    saved_by(tmp_path, {1: {}}, certify=OPTIONS, certify_hook=lambda step, checks: False)  # vetoed: not certified
    assert not certified(tmp_path / "step_000000001")

    def later(manager: reshard.CheckpointManager, r: int) -> Any:
        before = [(s.certified, s.certification) for s in manager_infos(manager)]
        return before, manager.certify(1), [s.certified for s in manager_infos(manager)]

    for before, checks, after in manager_run(tmp_path, later, certify=OPTIONS):  # a new process's managers
        assert before == [(False, "not certified yet (its checks passed)")]
        assert checks == reshard.Checks(passed=True, checked=("finite", "replicas")) and after == [True]


def test_a_restarted_manager_refuses_failed_unknown_or_foreign_checks(tmp_path: Path) -> None:
    saved_by(tmp_path, {1: {"nan": True}, 2: {}, 3: {}}, certify=OPTIONS, certify_hook=lambda step, checks: False)
    saved_by(tmp_path, {4: {}})  # a manager without certify: no checks
    shutil.copy(tmp_path / "step_000000002" / CHECKS_FILE, tmp_path / "step_000000003" / CHECKS_FILE)
    (tmp_path / "step_000000002" / CHECKS_FILE).write_bytes(b'{"format": 1, "passed": true')

    def later(manager: reshard.CheckpointManager, r: int) -> Any:
        reasons = [s.certification for s in manager_infos(manager)]
        for step, match in [(1, "NaN"), (2, "not a record"), (3, "another save"), (4, "not checked")]:
            with pytest.raises(reshard.CheckpointError, match=rf"step {step} cannot be certified.*{match}"):
                manager.certify(step)
        return reasons

    for reasons in manager_run(tmp_path, later, certify=OPTIONS):
        assert reasons[0].startswith("its checks failed: 'w' box (2,0)+(2,4) holds 1 NaN")
        assert "checks.json is not a record reshard wrote" in reasons[1]
        assert "checks of another save" in reasons[2]
        assert reasons[3] == "not checked"
    checks, why = checks_status(storage_for(tmp_path / "step_000000001"))
    assert checks is not None and not checks.passed and why == ""


def test_retention_and_remove_delete_checks_json_with_its_step(tmp_path: Path) -> None:
    saved_by(tmp_path, {1: {}, 2: {}, 3: {}}, certify=OPTIONS, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_000000003"]
    assert (tmp_path / "step_000000003" / CHECKS_FILE).exists()
    removal = remove_checkpoint(storage_for(tmp_path / "step_000000003"))
    assert not removal.left and not (tmp_path / "step_000000003").exists()


@pytest.mark.parametrize("next_step", [5, 6])
def test_a_job_resumed_from_a_certified_step_saves_on_past_the_uncertified_newer_one(
    tmp_path: Path, next_step: int
) -> None:
    """Resumed from certified step 4 past an uncertified 6 (its replicas differ), the job saves 5 (or 6) without
    ``rewind``, as past a damaged step that load_latest skipped: the uncertified 6 goes once the save commits."""
    saved_by(tmp_path, {4: {}, 6: {"flip": True}}, certify=OPTIONS)

    def restarted(manager: reshard.CheckpointManager, r: int) -> Any:
        skipped: list[tuple[int, str]] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = manager.load_latest(dp_state(r), skipped=skipped)
            result = manager.save(next_step, dp_state(r))
        return step, result.checks.passed, manager.steps(), skipped

    for step, passed, steps, skipped in manager_run(tmp_path, restarted, certify=OPTIONS):
        assert step == 4 and passed and steps == [4, next_step]
        assert [s for s, _ in skipped] == [6] and "not certified" in skipped[0][1]
    assert certified(tmp_path / f"step_{next_step:09d}")


def test_a_skipped_uncertified_step_certified_since_counts_as_newer(tmp_path: Path) -> None:
    saved_by(tmp_path, {4: {}, 6: {}}, certify=OPTIONS, certify_hook=lambda step, checks: step != 6)

    def restarted(manager: reshard.CheckpointManager, r: int) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step = manager.load_latest(dp_state(r))
        manager.certify(6)  # promoted after the load skipped it: it is a recovery point, newer than 5
        with pytest.raises(reshard.CheckpointExistsError, match="newer"):
            manager.save(5, dp_state(r))
        return step, manager.steps()

    assert manager_run(tmp_path, restarted, certify=OPTIONS) == [(4, [4, 6]), (4, [4, 6])]


@pytest.mark.parametrize("record", ["certified.json", "checks.json"])
def test_a_record_whose_time_overflows_a_float_is_refused_not_raised(tmp_path: Path, record: str) -> None:
    """``certified_at``/``checked_at`` an integer too large for a float: the step is not certified, with a reason
    (math.isfinite raised OverflowError out of certificate_status, which never raises)."""
    saved_by(tmp_path, {1: {}}, certify=OPTIONS)
    path = tmp_path / "step_000000001" / record
    doc = json.loads(path.read_bytes())
    doc["certified_at" if record == "certified.json" else "checked_at"] = 10**400
    path.write_text(json.dumps(doc))
    is_certified, why = certification_status(storage_for(tmp_path / "step_000000001"))
    assert not is_certified if record == "certified.json" else is_certified
    checks, reason = checks_status(storage_for(tmp_path / "step_000000001"))
    assert (checks is None) == (record == "checks.json")
    assert f"{record} is not a" in (why if record == "certified.json" else reason)


def test_a_retired_step_is_not_certified_even_with_its_certificate(tmp_path: Path) -> None:
    """A ``retired.json`` beside a genuine certificate (a step retention retired, or a forged record): no recovery
    point (certification_status said certified)."""
    saved_by(tmp_path, {1: {}}, certify=OPTIONS)
    step = tmp_path / "step_000000001"
    (step / "retired.json").write_text(json.dumps({"retired": 1, "kept": ["../home/notes.txt", "/etc/hosts"]}))
    is_certified, why = certification_status(storage_for(step))
    assert not is_certified and "retired" in why and not certified(step)


def test_certify_of_a_step_saved_again_since_its_checks_certifies_nothing(tmp_path: Path) -> None:
    """The checks a manager's save found in memory belong to that save: once the step holds another save (here a
    plain save of a NaN over it), ``certify(step)`` must not certify the new bytes with the old checks (an outside
    attack certified and then loaded the NaN)."""

    def run(manager: reshard.CheckpointManager, r: int) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.save(5, dp_state(r))  # checks pass, the hook vetoes: not certified yet
            reshard.save(dp_state(r, nan=True), tmp_path / "step_000000005", overwrite=True, group=manager.group)
            with pytest.raises(reshard.CheckpointError, match="step 5 cannot be certified"):
                manager.certify(5)
        return [s.certified for s in manager_infos(manager)]

    for certified_after in manager_run(tmp_path, run, certify=OPTIONS, certify_hook=lambda step, checks: False):
        assert certified_after == [False]
    assert not certified(tmp_path / "step_000000005")


def test_a_hook_that_returns_no_bool_vetoes_naming_what_it_returned(tmp_path: Path) -> None:
    """A hook answers True or False: ``"no"`` (truthy) approved the step and ``None`` vetoed it silently."""

    def run(manager: reshard.CheckpointManager, r: int) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return manager.save(1, dp_state(r)).checks

    for checks in manager_run(tmp_path, run, certify=OPTIONS, certify_hook=lambda step, checks: "no"):
        assert checks is not None and not checks.passed
        assert any("returned 'no'" in problem for problem in checks.problems), checks.problems
    assert not certified(tmp_path / "step_000000001")


def test_a_deletion_of_a_certified_step_cut_short_is_finished_by_the_next(tmp_path: Path) -> None:
    """The retirement record of a certified step listed ``certified.json`` and ``checks.json`` among its files, and
    every reader then refused the record as "not one reshard wrote": a deletion cut short after the record never
    finished, the step and its data leaked for ever (outside attack)."""
    saved_by(tmp_path, {1: {}}, certify=OPTIONS)
    step = storage_for(tmp_path / "step_000000001")
    assert certified(tmp_path / "step_000000001")
    original = type(step).delete

    def cut_at_data(self: Any, name: str) -> None:
        if name.startswith("data/"):
            raise OSError("cut short")
        original(self, name)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(step), "delete", cut_at_data)
        with pytest.raises(OSError, match="cut short"):
            remove_checkpoint(step)
    assert (tmp_path / "step_000000001" / "retired.json").exists()
    removal = remove_checkpoint(storage_for(tmp_path / "step_000000001"))
    assert not removal.left and not (tmp_path / "step_000000001").exists()
