"""CheckpointManager and the order of steps (issue 38, item 5): a save older than the newest complete step is
refused on every rank unless ``rewind=True``, which deletes the newer steps after the rewound step commits; a step
that is complete already is refused naming it; a restart after either can always proceed."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
import reshard.flows.manager as manager_module
from reshard.flows.manager import step_name
from reshard.metadata import METADATA_FILE
from reshard.net.transports import ThreadGroup
from tests.rankpool import RankContext, RankFailure, RankPool
from tests.threads import on_threads


def _state(rank: int, world: int, step: int) -> dict[str, Any]:
    """Each rank's rows of one tensor whose values say the step (and a per-rank object)."""
    rows = torch.full((4, 8), float(step * 10 + rank))
    return {
        "w": reshard.ShardedTensor.from_rank_offsets("w", rows, (0, rank, world)),
        "rng": reshard.ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
        "step": step,
    }


def _template(rank: int, world: int) -> dict[str, Any]:
    return {
        "w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(4, 8), (0, rank, world)),
        "rng": reshard.ShardedObject("rng", None, (world,), (rank,)),
        "step": -1,
    }


def _manager_call(rank: int, world: int, group: Any, root: Path, call: str, step: int, **kwargs: Any) -> Any:
    """One rank's ``CheckpointManager`` call: ``save`` of ``step`` (its error returned, not raised) or ``load``
    (the step loaded, checked against the values that step saved)."""
    incremental = kwargs.pop("incremental", False)
    manager = reshard.CheckpointManager(root, group=group, timeout=30, incremental=incremental)
    try:
        if call == "save":
            return manager.save(step, _state(rank, world, step), **kwargs)
        template = _template(rank, world)
        found = manager.load_latest_with_state(template)
        assert found is not None
        loaded_step, loaded = found
        assert loaded["step"] == loaded_step and loaded["rng"] == {"rank": rank, "step": loaded_step}
        assert torch.equal(template["w"].data, torch.full((4, 8), float(loaded_step * 10 + rank)))
        return loaded_step
    except reshard.CheckpointError as exc:
        return exc
    finally:
        manager.close()


def _on_two_ranks(root: Path, call: str, step: int, **kwargs: Any) -> list[Any]:
    group = ThreadGroup(2, timeout=30.0)
    return on_threads(2, lambda rank: _manager_call(rank, 2, group.member(rank), root, call, step, **dict(kwargs)))


def _saved(root: Path, step: int, **kwargs: Any) -> None:
    for rank, result in enumerate(_on_two_ranks(root, "save", step, **kwargs)):
        assert isinstance(result, reshard.SaveResult), (rank, result)


def _refused(root: Path, step: int, **kwargs: Any) -> list[reshard.CheckpointError]:
    """Save ``step``; every rank must raise the same CheckpointExistsError, which is returned."""
    results = _on_two_ranks(root, "save", step, **kwargs)
    for rank, result in enumerate(results):
        assert isinstance(result, reshard.CheckpointExistsError), (rank, result)
    assert len({str(e) for e in results}) == 1, results
    return list(results)


def _complete(root: Path) -> list[int]:
    manager = reshard.CheckpointManager(root)
    try:
        return manager.steps()
    finally:
        manager.close()


def _latest(root: Path) -> int | None:
    manager = reshard.CheckpointManager(root)
    try:
        return manager.latest_pointer()
    finally:
        manager.close()


@pytest.mark.unit
def test_a_save_older_than_the_newest_step_is_refused_on_every_rank_naming_the_ways_out(tmp_path: Path) -> None:
    _saved(tmp_path, 4)
    _saved(tmp_path, 6)
    error = _refused(tmp_path, 2)[0]
    message = str(error)
    assert "step 2" in message and "4, 6" in message and "rewind=True" in message and "load_latest" in message
    assert _complete(tmp_path) == [4, 6] and _latest(tmp_path) == 6
    assert not (tmp_path / step_name(2) / METADATA_FILE).exists()
    assert _on_two_ranks(tmp_path, "load", 0) == [6, 6]
    _saved(tmp_path, 8)  # resuming from the latest proceeds
    assert _complete(tmp_path) == [4, 6, 8] and _latest(tmp_path) == 8


@pytest.mark.unit
def test_an_overwrite_of_an_older_step_is_going_back_in_time_too(tmp_path: Path) -> None:
    _saved(tmp_path, 4)
    _saved(tmp_path, 6)
    message = str(_refused(tmp_path, 4, overwrite=True)[0])
    assert "step 4" in message and "6" in message and "rewind=True" in message
    assert _complete(tmp_path) == [4, 6] and _latest(tmp_path) == 6
    assert _on_two_ranks(tmp_path, "load", 0) == [6, 6]


@pytest.mark.unit
def test_a_rewind_deletes_the_newer_steps_and_a_restart_saves_them_again(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _saved(tmp_path, step)
    (tmp_path / step_name(8) / "data").mkdir(parents=True)  # the leftover of an interrupted save of step 8
    _saved(tmp_path, 3, rewind=True)
    assert _complete(tmp_path) == [2, 3] and _latest(tmp_path) == 3
    assert not (tmp_path / step_name(4)).exists() and not (tmp_path / step_name(6)).exists()
    assert not (tmp_path / step_name(8)).exists()
    assert _on_two_ranks(tmp_path, "load", 0) == [3, 3]  # the restart resumes from the rewound step
    _saved(tmp_path, 4)  # and saves step 4 again, of the new timeline
    assert _complete(tmp_path) == [2, 3, 4] and _latest(tmp_path) == 4
    assert _on_two_ranks(tmp_path, "load", 0) == [4, 4]


@pytest.mark.unit
def test_a_rewind_over_an_existing_step_needs_overwrite_and_keeps_the_older_steps(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _saved(tmp_path, step)
    message = str(_refused(tmp_path, 4, rewind=True)[0])
    assert "step 4" in message and "overwrite=True" in message
    assert _complete(tmp_path) == [2, 4, 6] and _latest(tmp_path) == 6
    _saved(tmp_path, 4, rewind=True, overwrite=True)
    assert _complete(tmp_path) == [2, 4] and _latest(tmp_path) == 4
    assert _on_two_ranks(tmp_path, "load", 0) == [4, 4]


@pytest.mark.unit
def test_an_incremental_rewind_references_only_older_steps(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        _saved(tmp_path, step, incremental=True)
    _saved(tmp_path, 3, rewind=True, incremental=True)
    assert reshard.read_metadata(tmp_path / step_name(3)).referenced_checkpoints in ((), (step_name(2),))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == [step_name(2), step_name(3)]
    assert _on_two_ranks(tmp_path, "load", 0) == [3, 3]


@pytest.mark.unit
def test_saving_a_complete_step_again_names_the_step_on_every_rank(tmp_path: Path) -> None:
    _saved(tmp_path, 4)
    message = str(_refused(tmp_path, 4)[0])
    assert "step 4" in message and step_name(4) in message and "overwrite=True" in message
    assert _complete(tmp_path) == [4] and _latest(tmp_path) == 4
    _saved(tmp_path, 4, overwrite=True)
    assert _on_two_ranks(tmp_path, "load", 0) == [4, 4]


@pytest.mark.unit
def test_an_interrupted_newer_save_does_not_stop_a_restart(tmp_path: Path) -> None:
    """Only complete steps are newer steps: a restart after a crash in the save of step 6 saves step 5."""
    _saved(tmp_path, 4)
    _saved(tmp_path, 6)
    (tmp_path / step_name(6) / METADATA_FILE).unlink()  # the save of step 6 never committed
    assert _on_two_ranks(tmp_path, "load", 0) == [4, 4]
    _saved(tmp_path, 5)
    _saved(tmp_path, 6)
    assert _complete(tmp_path) == [4, 5, 6] and _latest(tmp_path) == 6


# ---- the user's sequence, on real processes --------------------------------------------------------------------


def rank_manager(ctx: RankContext, root: str, call: str, step: int, kwargs: dict[str, Any]) -> Any:
    """On each rank of the pool: one manager call; an error comes back as its class and message."""
    result = _manager_call(ctx.rank, ctx.world_size, None, Path(root), call, step, **kwargs)
    if isinstance(result, reshard.CheckpointError):
        return {"error_class": type(result).__name__, "message": str(result)}
    return "saved" if isinstance(result, reshard.SaveResult) else result


@pytest.mark.dist
def test_the_users_restart_that_forgot_to_resume(pool4: RankPool, tmp_path: Path) -> None:
    root = str(tmp_path / "root")

    def run(call: str, step: int, **kwargs: Any) -> list[Any]:
        results = pool4.run(rank_manager, root, call, step, kwargs)
        assert not any(isinstance(r, RankFailure) for r in results), results
        return results

    assert run("save", 4) == run("save", 6) == ["saved"] * 4
    refused = run("save", 2)  # a new manager, a restart that forgot to resume
    assert len({r["message"] for r in refused}) == 1, refused
    for result in refused:
        assert result["error_class"] == "CheckpointExistsError", result
        assert "4, 6" in result["message"] and "rewind=True" in result["message"]
    assert _latest(tmp_path / "root") == 6 and _complete(tmp_path / "root") == [4, 6]
    assert run("save", 2, rewind=True) == ["saved"] * 4
    assert _latest(tmp_path / "root") == 2 and _complete(tmp_path / "root") == [2]
    assert run("load", 0) == [2] * 4  # the next restart resumes from step 2 and proceeds
    assert run("save", 4) == ["saved"] * 4
    assert _latest(tmp_path / "root") == 4 and _complete(tmp_path / "root") == [2, 4]
    assert run("load", 0) == [4] * 4


def _resume_then_save(rank: int, group: Any, root: Path, step: int) -> tuple[int | None, Any]:
    """A restart: a manager resumes with ``load_latest`` (which skips what it cannot load), then saves ``step``;
    the step it resumed from, and the save's result or error."""
    manager = reshard.CheckpointManager(root, group=group, timeout=30)
    try:
        resumed = manager.load_latest(_template(rank, 2))
        try:
            return resumed, manager.save(step, _state(rank, 2, step))
        except reshard.CheckpointError as exc:
            return resumed, exc
    finally:
        manager.close()


@pytest.mark.unit
def test_a_restart_that_resumed_past_a_damaged_newest_step_can_save_again(tmp_path: Path) -> None:
    """Found while reviewing the fix above: with steps 4 and 6 saved and 6 damaged, ``load_latest`` resumes from
    4; the next save (5) is then older than 6, and an automatic restart loop would be refused for ever. A save
    may go past the steps its manager's ``load_latest`` skipped as unloadable (they are deleted once it commits,
    with a warning); a manager that did not resume is still refused."""
    _saved(tmp_path, 4)
    _saved(tmp_path, 6)
    data_file = sorted((tmp_path / step_name(6) / "data").iterdir())[0]
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    _refused(tmp_path, 5)  # no resume: the damaged step still counts
    group = ThreadGroup(2, timeout=30.0)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        results = on_threads(2, lambda rank: _resume_then_save(rank, group.member(rank), tmp_path, 5))
    messages = [str(w.message) for w in warned]
    assert any("skipping checkpoint" in m for m in messages) and any("saved past steps [6]" in m for m in messages)
    for rank, (resumed, result) in enumerate(results):
        assert resumed == 4 and isinstance(result, reshard.SaveResult), (rank, resumed, result)
    assert _complete(tmp_path) == [4, 5] and _latest(tmp_path) == 5
    assert _on_two_ranks(tmp_path, "load", 0) == [5, 5]


@pytest.mark.unit
def test_a_step_skipped_while_still_being_written_blocks_a_save_once_it_commits(tmp_path: Path) -> None:
    """Found by the outside attack on the fix above: ``load_latest`` skipped step 6 because its save had not
    committed yet (another job still writing it); once that save commits, step 6 is a good checkpoint, and a save
    of 5 by the manager that resumed from 4 must be refused, not delete it."""
    _saved(tmp_path, 4)
    _saved(tmp_path, 6)
    metadata = tmp_path / step_name(6) / METADATA_FILE
    held = metadata.with_name("held-back.json")
    metadata.rename(held)  # step 6 as a save that has not committed yet
    group = ThreadGroup(2, timeout=30.0)
    managers = [reshard.CheckpointManager(tmp_path, group=group.member(rank), timeout=30) for rank in range(2)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resumed = on_threads(2, lambda rank: managers[rank].load_latest(_template(rank, 2)))
        assert resumed == [4, 4]
        held.rename(metadata)  # ... and now it commits

        def save_five(rank: int) -> Any:
            try:
                return managers[rank].save(5, _state(rank, 2, 5))
            except reshard.CheckpointError as exc:
                return exc

        results = on_threads(2, save_five)
    finally:
        for manager in managers:
            manager.close()
    assert all(isinstance(r, reshard.CheckpointExistsError) and "6" in str(r) for r in results), results
    assert _complete(tmp_path) == [4, 6] and _latest(tmp_path) == 6


def _resumed_managers(root: Path, group: ThreadGroup) -> list[reshard.CheckpointManager]:
    """Two ranks' managers that resumed with ``load_latest`` (warnings of skipped steps silenced)."""
    managers = [reshard.CheckpointManager(root, group=group.member(rank), timeout=30) for rank in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = on_threads(2, lambda rank: managers[rank].load_latest(_template(rank, 2)))
    assert resumed == [4, 4] and all(m.resumed_past == {6} for m in managers)
    return managers


def _save_five(managers: list[reshard.CheckpointManager]) -> list[Any]:
    def save(rank: int) -> Any:
        try:
            return managers[rank].save(5, _state(rank, 2, 5))
        except reshard.CheckpointError as exc:
            return exc

    try:
        return on_threads(2, save)
    finally:
        for manager in managers:
            manager.close()


@pytest.mark.unit
def test_a_skipped_step_that_loads_again_is_not_deleted_and_blocks_the_save(tmp_path: Path) -> None:
    """Found by the second outside attack (F1 A): ``load_latest`` skipped step 6 because a data file of it was
    away for a moment; the file came back, and the save of 5 deleted the loadable step 6. A skipped step is
    deleted only while it is still the save that was skipped and still fails its checks; a step that loads again
    counts as newer: the save of 5 is refused on every rank, naming ``rewind=True``, and step 6 stays."""
    _saved(tmp_path, 4)
    _saved(tmp_path, 6)
    data_file = sorted((tmp_path / step_name(6) / "data").iterdir())[0]
    away = data_file.with_name("away")
    data_file.rename(away)  # a data file away for a moment (a copy being put back)
    managers = _resumed_managers(tmp_path, ThreadGroup(2, timeout=30.0))
    away.rename(data_file)  # ... and back: step 6 loads again
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        results = _save_five(managers)
    assert all(isinstance(r, reshard.CheckpointExistsError) for r in results), results
    assert len({str(r) for r in results}) == 1 and "rewind=True" in str(results[0]) and "6" in str(results[0])
    assert not any("saved past" in str(w.message) for w in warned)
    assert _complete(tmp_path) == [4, 6] and _latest(tmp_path) == 6
    assert _on_two_ranks(tmp_path, "load", 0) == [6, 6]


@pytest.mark.unit
def test_a_step_saved_anew_after_the_skip_is_never_deleted(tmp_path: Path) -> None:
    """Found by the second outside attack (F1 B): after ``load_latest`` skipped a damaged step 6, another manager
    saved a new, good step 6 (``overwrite=True``); the first job's save of 5 deleted that new checkpoint, which
    nobody skipped. The skipped step is remembered by its save's identity: another save there counts as newer."""
    _saved(tmp_path, 4)
    _saved(tmp_path, 6)
    data_file = sorted((tmp_path / step_name(6) / "data").iterdir())[0]
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))  # damaged for good
    managers = _resumed_managers(tmp_path, ThreadGroup(2, timeout=30.0))
    _saved(tmp_path, 6, overwrite=True)  # another manager writes step 6 anew
    results = _save_five(managers)
    assert all(isinstance(r, reshard.CheckpointExistsError) and "rewind=True" in str(r) for r in results), results
    assert _complete(tmp_path) == [4, 6]
    assert _on_two_ranks(tmp_path, "load", 0) == [6, 6]


# ---- issue 38, third outside attack: the window after the judgment, and the skipped step saved again -----------


def _damaged_six(root: Path) -> None:
    """Steps 4 and 6 saved on two ranks; a data file of step 6 damaged for good."""
    _saved(root, 4)
    _saved(root, 6)
    data_file = sorted((root / step_name(6) / "data").iterdir())[0]
    raw = bytearray(data_file.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data_file.write_bytes(bytes(raw))


def _another_writer_at(monkeypatch: pytest.MonkeyPatch, root: Path, call: int) -> list[str]:
    """Right after the coordinator's ``call``-th judgment that step 6 is still the damaged save skipped, another
    writer commits a good step 6 (``reshard.save(..., overwrite=True)``: it takes only the step's lock); the save
    ids it committed."""
    real = manager_module.still_skipped
    calls: list[str | None] = []
    committed: list[str] = []

    def judged_then_saved_anew(where: Any, skipped: Any) -> str | None:
        why = real(where, skipped)
        calls.append(why)
        if len(calls) == call and why is not None:
            committed.append(reshard.save({"w": torch.full((8,), 66.0)}, root / step_name(6), overwrite=True).save_id)
        return why

    monkeypatch.setattr(manager_module, "still_skipped", judged_then_saved_anew)
    return committed


@pytest.mark.unit
def test_a_step_saved_anew_after_the_last_judgment_is_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G1: after the save of 5 committed, the coordinator judged step 6 still the damaged save skipped, and then
    deleted it; a good step 6 committed by another writer in between was deleted. The deletion is told which save
    it may delete (the digest of its metadata) and checks it again under the step's own lock."""
    _damaged_six(tmp_path)
    managers = _resumed_managers(tmp_path, ThreadGroup(2, timeout=30.0))
    committed = _another_writer_at(monkeypatch, tmp_path, call=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = _save_five(managers)
    assert all(isinstance(r, reshard.SaveResult) for r in results), results
    assert committed and reshard.read_metadata(tmp_path / step_name(6)).save_id == committed[0]
    assert _complete(tmp_path) == [4, 5, 6]
    loaded = {"w": torch.zeros(8)}
    reshard.load(loaded, tmp_path / step_name(6))
    assert torch.equal(loaded["w"], torch.full((8,), 66.0))


def _save_six(managers: list[reshard.CheckpointManager]) -> list[Any]:
    def save(rank: int) -> Any:
        try:
            return managers[rank].save(6, _state(rank, 2, 6))
        except reshard.CheckpointError as exc:
            return exc

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return on_threads(2, save)
    finally:
        for manager in managers:
            manager.close()


@pytest.mark.unit
def test_a_restart_saves_the_damaged_step_it_resumed_past_again(tmp_path: Path) -> None:
    """G2: saves every 2 steps, step 6 damaged; the restart resumes from 4 (skipping 6) and its next save is step 6
    itself, which was refused as complete already on every restart (a restart loop). A skipped step equal to the
    step saved, still that save and still failing, is replaced by the new save (an overwrite of a damaged step)."""
    _damaged_six(tmp_path)
    results = _save_six(_resumed_managers(tmp_path, ThreadGroup(2, timeout=30.0)))
    assert all(isinstance(r, reshard.SaveResult) for r in results), results
    assert _complete(tmp_path) == [4, 6] and _latest(tmp_path) == 6
    assert _on_two_ranks(tmp_path, "load", 0) == [6, 6]
    assert len(list((tmp_path / step_name(6) / "data").iterdir())) == len(
        {f.path for f in reshard.read_metadata(tmp_path / step_name(6)).files}
    ), "the damaged save's files outlived its replacement"


@pytest.mark.unit
def test_a_skipped_step_saved_anew_before_its_replacement_is_not_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """G2 with G1's window: another writer commits a good step 6 right after the coordinator judged it still the
    damaged one; the save of 6 checks again under the step's lock and is refused on every rank, keeping it."""
    _damaged_six(tmp_path)
    managers = _resumed_managers(tmp_path, ThreadGroup(2, timeout=30.0))
    committed = _another_writer_at(monkeypatch, tmp_path, call=1)
    results = _save_six(managers)
    assert all(isinstance(r, reshard.CheckpointExistsError) for r in results), results
    assert committed and reshard.read_metadata(tmp_path / step_name(6)).save_id == committed[0]
