"""Regression tests of the second outside attack on ``reshard gc``, retention and references (docs/reliability.md,
section 13): holders reached through a symbolic link, gc racing a save that references the holder, stray entries in
``refs/``, references that name a file or an impossible name, a gc killed before it removed its directory, and what
gc says it removed.

Real files, links, FIFOs and processes. Two operations that race are put in a chosen order by a LocalStorage
subclass that stops its thread at one call until the test lets it go (:class:`PausedAt`); nothing is mocked and
nothing waits on time.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import reshard
from reshard.cli import main as cli_main
from reshard.errors import CheckpointNotFoundError
from reshard.flows.maintenance import collect_garbage, validate_checkpoint
from reshard.flows.manager import scan_root, step_name
from reshard.interop import convert_checkpoint
from reshard.io.references import REFERENCES_DIR, RETIRED_FILE
from reshard.io.retirement import delete_checkpoint
from reshard.storage import FileWriter, LocalStorage
from tests.flows.test_incremental import HASHED, assert_loads_as, frozen_and_trained, template
from tests.metadata_docs import read_doc, write_doc

ROOT = Path(__file__).resolve().parents[2]
OLD = 1_000_000_000.0  # 2001: older than any --min-age


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _bins(path: Path) -> set[str]:
    return {p.name for p in path.rglob("*.bin")}


def _cli(*args: str) -> tuple[int, str, str]:
    """``reshard ARGS`` (in this process): its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    assert "Traceback" not in err.getvalue(), err.getvalue()
    return code, out.getvalue(), err.getvalue()


def _three_steps(root: Path, *, keep_last: int | None = 1) -> reshard.CheckpointManager:
    """Steps 1 to 3 of an incremental manager: step 1 holds the frozen tensors that the later steps reference."""
    manager = reshard.CheckpointManager(root, keep_last=keep_last, incremental=True)
    for step in (1, 2, 3):
        manager.save(step, frozen_and_trained(step))
    return manager


# ---- 1: a holder moved to another disk and linked back ---------------------------------------------------------


@pytest.mark.unit
def test_gc_of_a_holder_reached_through_a_link_deletes_nothing_and_the_reference_is_not_followed(
    tmp_path: Path,
) -> None:
    """``mv step_1 /other/; ln -s /other/step_1 root/step_1``: gc of the link (any options, the command line too)
    refuses naming the link and deletes nothing; a reader refuses the reference through the link instead of
    reading what no deletion would keep; moved back, step 3 loads."""
    root, other = tmp_path / "root", tmp_path / "other_disk"
    _three_steps(root)
    holder = root / step_name(1)
    assert (holder / RETIRED_FILE).exists()
    other.mkdir()
    holder.rename(other / step_name(1))
    holder.symlink_to(other / step_name(1))
    before = _snapshot(other)
    for options in ({}, {"min_age_s": 0}, {"min_age_s": 0, "include_incomplete": True}, {"dry_run": True}):
        with pytest.raises(reshard.CheckpointError, match=f"{step_name(1)}.*symbolic link"):
            collect_garbage(holder, **options)  # type: ignore[arg-type]
    for extra in ([], ["--min-age", "0"], ["--min-age", "0", "--incomplete"]):
        code, _, err = _cli("gc", str(holder), *extra)
        assert code == 3 and str(holder) in err and "symbolic link" in err, err
    assert _snapshot(other) == before
    step3 = root / step_name(3)
    with pytest.raises(reshard.CorruptCheckpointError, match=f"{step_name(1)} is a symbolic link"):
        reshard.load(template(), step3)
    problems = validate_checkpoint(step3)
    assert len(problems) == 1 and "symbolic link" in problems[0], problems
    holder.unlink()
    (other / step_name(1)).rename(holder)
    assert_loads_as(step3, 3)
    assert validate_checkpoint(step3) == []


@pytest.mark.unit
def test_an_overwrite_of_a_holder_reached_through_a_link_keeps_the_files_others_reference(tmp_path: Path) -> None:
    """``b`` references ``a``'s file; ``a`` is moved away and linked back, then overwritten through the link: the
    overwrite's cleanup deletes nothing through the link (its referrers are not beside the directory it points
    to), so once moved back ``b`` loads."""
    reshard.save(frozen_and_trained(1), tmp_path / "a", options=HASHED)
    reshard.save(frozen_and_trained(2), tmp_path / "b", base=tmp_path / "a")
    old = _bins(tmp_path / "a")
    (tmp_path / "other").mkdir()
    (tmp_path / "a").rename(tmp_path / "other" / "a")
    (tmp_path / "a").symlink_to(tmp_path / "other" / "a")
    reshard.save(frozen_and_trained(7), tmp_path / "a", overwrite=True, options=HASHED)
    assert old < _bins(tmp_path / "other" / "a")
    (tmp_path / "a").unlink()
    (tmp_path / "other" / "a").rename(tmp_path / "a")
    assert_loads_as(tmp_path / "b", 2)
    assert_loads_as(tmp_path / "a", 7)


@pytest.mark.unit
def test_a_manager_whose_newest_step_is_a_link_saves_in_full(tmp_path: Path) -> None:
    """The newest step moved to another disk and linked back: it cannot be a base (nothing would be referenced
    through the link), so the next save is made in full, with a warning, and loads; retention leaves the link."""
    root, other = tmp_path / "root", tmp_path / "other_disk"
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    manager.save(1, frozen_and_trained(1))
    other.mkdir()
    (root / step_name(1)).rename(other / step_name(1))
    (root / step_name(1)).symlink_to(other / step_name(1))
    assert manager.save(2, frozen_and_trained(2)).referenced_bytes == 0
    assert_loads_as(root / step_name(2), 2)
    assert (root / step_name(1)).is_symlink() and (other / step_name(1) / "metadata.json").exists()


# ---- 2: gc racing a save that references the holder -------------------------------------------------------------


class PausedAt(LocalStorage):
    """A real checkpoint directory whose first ``list_files(prefix)`` (``on="list"``) or first ``open_writer``
    (``on="write"``) stops its thread, after the call, until ``go`` is set; ``reached`` says it got there."""

    def __init__(self, root: str | os.PathLike[str], on: str, prefix: str = "") -> None:
        super().__init__(root)
        self.on, self.prefix = on, prefix
        self.reached, self.go = threading.Event(), threading.Event()

    def _pause(self) -> None:
        if not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(120), "the test never let the paused thread go"

    def list_files(self, prefix: str = "") -> list[str]:
        names = super().list_files(prefix)
        if self.on == "list" and prefix == self.prefix:
            self._pause()
        return names

    def open_writer(self, name: str, *, max_buffered_bytes: int | None = None) -> FileWriter:
        writer = super().open_writer(name, max_buffered_bytes=max_buffered_bytes)
        if self.on == "write":
            self._pause()
        return writer


def _in_thread(run: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``run()`` in a thread; the list receives its result or the exception it raised."""
    outcome: list[Any] = []

    def body() -> None:
        try:
            outcome.append(run())
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    return thread, outcome


def _assert_references_there(path: Path) -> None:
    """Every file of another checkpoint that ``path`` references exists, with its recorded size."""
    for entry in reshard.read_metadata(path).files:
        if entry.checkpoint is not None:
            held = path.parent / entry.checkpoint / entry.path
            assert held.stat().st_size == entry.size, held


@pytest.mark.unit
def test_gc_that_listed_a_holders_markers_before_a_save_referenced_it_never_deletes_what_the_save_uses(
    tmp_path: Path,
) -> None:
    """gc of retired step 1 stops right after it listed ``refs/`` (step 2's marker only); meanwhile the job saves
    step 3 (incremental, keep_last=1), whose retention would delete step 2. gc holds step 1's save lock for its
    whole run, so the save cannot reference step 1: it fails cleanly (CheckpointLockedError, nothing committed,
    step 2 still there); gc then keeps the file step 2 uses, and the save made again references it and loads."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    for step in (1, 2):
        manager.save(step, frozen_and_trained(step))
    held = _bins(root / step_name(1))
    paused = PausedAt(root / step_name(1), on="list", prefix=REFERENCES_DIR)
    thread, outcome = _in_thread(lambda: collect_garbage(paused, min_age_s=0))
    assert paused.reached.wait(120)
    try:
        with pytest.raises(reshard.CheckpointLockedError, match=step_name(1)):
            manager.save(3, frozen_and_trained(3))
    finally:
        paused.go.set()
        thread.join()
    assert outcome == [[]], outcome  # step 2 still references the file: nothing to delete
    assert not (root / step_name(3) / "metadata.json").exists()
    assert_loads_as(root / step_name(2), 2)
    assert manager.save(3, frozen_and_trained(3)).referenced_bytes > 0
    assert_loads_as(root / step_name(3), 3)
    _assert_references_there(root / step_name(3))
    assert _bins(root / step_name(1)) == held
    assert collect_garbage(root / step_name(1), min_age_s=0) == []


@pytest.mark.unit
def test_a_save_that_referenced_a_holder_before_gc_listed_it_is_protected_from_planning_on(tmp_path: Path) -> None:
    """``a`` is retired, keeping the file ``b`` references; ``c`` (base ``b``, so referencing ``a``'s file) is saving
    and stops at its first data write, after its planning; meanwhile ``b`` is deleted and gc runs on ``a``: the
    marker ``c`` left at planning (live through ``c``'s save lock) keeps the file ``c`` is about to reference, so
    ``c`` commits and loads; its marker in ``b``, which it ended up not referencing, is gone after its commit, so
    ``b`` is swept whole."""
    reshard.save(frozen_and_trained(1), tmp_path / "a", options=HASHED)
    reshard.save(frozen_and_trained(2), tmp_path / "b", base=tmp_path / "a")
    held = _bins(tmp_path / "a")
    assert delete_checkpoint(LocalStorage(tmp_path / "a")) is True  # retired: b references its file
    paused = PausedAt(tmp_path / "c", on="write")
    thread, outcome = _in_thread(lambda: reshard.save(frozen_and_trained(3), paused, base=tmp_path / "b"))
    assert paused.reached.wait(120)
    try:
        delete_checkpoint(LocalStorage(tmp_path / "b"))
        collect_garbage(tmp_path / "a", min_age_s=0)
        assert _bins(tmp_path / "a") == held
    finally:
        paused.go.set()
        thread.join()
    (result,) = outcome
    assert isinstance(result, reshard.SaveResult), result
    assert result.referenced_bytes == 9 * 64 * 64 * 4
    assert_loads_as(tmp_path / "c", 3)
    _assert_references_there(tmp_path / "c")
    collect_garbage(tmp_path / "b", min_age_s=0)
    assert not (tmp_path / "b").exists()
    collect_garbage(tmp_path / "a", min_age_s=0)
    assert _bins(tmp_path / "a") == held
    assert_loads_as(tmp_path / "c", 3)


@pytest.mark.unit
def test_gc_of_an_overwritten_holder_holds_its_lock_while_it_judges_the_markers(tmp_path: Path) -> None:
    """``a`` was overwritten and keeps its old file only for ``b``; gc of ``a`` (a committed checkpoint) stops after
    listing ``refs/``: a save that would reference that file through ``b`` fails cleanly, so when ``b`` is deleted
    meanwhile and gc goes on, the file it removes is referenced by nothing; ``a`` still loads."""
    reshard.save(frozen_and_trained(1), tmp_path / "a", options=HASHED)
    reshard.save(frozen_and_trained(2), tmp_path / "b", base=tmp_path / "a")
    old = _bins(tmp_path / "a")
    changed = frozen_and_trained(7)
    changed["frozen"] = {k: v + 1 for k, v in changed["frozen"].items()}
    reshard.save(changed, tmp_path / "a", overwrite=True, options=HASHED)
    assert old < _bins(tmp_path / "a")
    paused = PausedAt(tmp_path / "a", on="list", prefix=REFERENCES_DIR)
    thread, outcome = _in_thread(lambda: collect_garbage(paused, min_age_s=0))
    assert paused.reached.wait(120)
    try:
        with pytest.raises(reshard.CheckpointLockedError, match="cannot reference a now"):
            reshard.save(frozen_and_trained(3), tmp_path / "c", base=tmp_path / "b")
        delete_checkpoint(LocalStorage(tmp_path / "b"))
    finally:
        paused.go.set()
        thread.join()
    (removed,) = outcome
    assert {Path(n).name for n in removed if n.endswith(".bin")} == old, removed
    assert not (tmp_path / "c" / "metadata.json").exists()
    assert reshard.load(template(), tmp_path / "a")["step"] == 7


# ---- 3: stray entries in a holder's refs/ ---------------------------------------------------------------------------

MARKER_NAMED = f"{step_name(9)}.{'0' * 32}.json"


@pytest.mark.dist  # seconds of fsync-heavy saves: kept out of the fast tier (make test-fast)
@pytest.mark.parametrize(
    "kind", ["link", "marker_named_link", "link_loop", "fifo", "directory", "marker_named_directory", "junk"]
)
def test_a_stray_entry_in_refs_is_left_alone_and_never_stops_retention_or_gc(tmp_path: Path, kind: str) -> None:
    """A link (under any name, to a directory outside, or a loop), a FIFO, a directory or a junk file in retired
    step 1's ``refs/``: later saves and their retention succeed, gc of step 1 succeeds, and the entry (and what a
    link points to) is left as it was."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "x").mkdir(parents=True)
    (outside / "x" / "notes.txt").write_text("mine")
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    manager.save(1, frozen_and_trained(1))
    manager.save(2, frozen_and_trained(2))
    refs = root / step_name(1) / REFERENCES_DIR
    entry = refs / (MARKER_NAMED if kind.startswith("marker_named") else "evil")
    if kind.endswith("link"):
        entry.symlink_to(outside / "x")
    elif kind == "link_loop":
        entry.symlink_to(entry)
    elif kind == "fifo":
        os.mkfifo(entry)
    elif kind.endswith("directory"):
        (entry / "inner.json").parent.mkdir()
        (entry / "inner.json").write_text("{}")
    else:
        entry.write_text("not a marker")
    for step in (3, 4):
        manager.save(step, frozen_and_trained(step))
        assert_loads_as(root / step_name(step), step)
    assert collect_garbage(root / step_name(1), min_age_s=0) == []  # step 4 references its file
    code, _, err = _cli("gc", str(root / step_name(1)), "--min-age", "0")
    assert code == 0, err
    assert os.path.lexists(entry)
    assert (outside / "x" / "notes.txt").read_text() == "mine"
    # A full save: nothing references step 1 any more, its files go and the stray entry stays.
    reshard.CheckpointManager(root, keep_last=1).save(5, frozen_and_trained(5))
    assert os.path.lexists(entry) and not _bins(root / step_name(1))
    assert_loads_as(root / step_name(5), 5)


@pytest.mark.unit
def test_a_referrers_marker_that_is_a_link_refuses_the_reference_as_corrupt(tmp_path: Path) -> None:
    """Step 2's own marker in step 1 replaced by a link to a copy of it: the reference is not tied (a marker must be
    a regular file), so load refuses step 2 as corrupt, naming the marker, and load_latest falls back to step 1."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, incremental=True)
    manager.save(1, frozen_and_trained(1))
    manager.save(2, frozen_and_trained(2))
    (marker,) = (root / step_name(1) / REFERENCES_DIR).iterdir()
    copy = tmp_path / "copy.json"
    shutil.copy(marker, copy)
    marker.unlink()
    marker.symlink_to(copy)
    with pytest.raises(reshard.CorruptCheckpointError, match=f"{marker.name}.*not a regular file"):
        reshard.load(template(), root / step_name(2))
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{step_name(2)}"):
        assert manager.load_latest(template()) == 1


# ---- 4: references naming a file or an impossible name ---------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("name", ["latest.json", "x" * 300])
def test_a_reference_that_names_a_file_or_an_impossible_name_is_corrupt_and_load_latest_falls_back(
    tmp_path: Path, name: str
) -> None:
    """Step 3's document resealed with its references naming ``latest.json`` (a file) or a 300-character name:
    load and convert raise CorruptCheckpointError naming the reference, validate reports it, and load_latest skips
    step 3 with a warning and loads step 2."""
    root = tmp_path / "root"
    manager = _three_steps(root, keep_last=2)
    step3 = root / step_name(3)
    doc = read_doc(step3)
    for entry in doc["files"]:
        if "checkpoint" in entry:
            entry["checkpoint"] = name
    write_doc(step3, doc)
    with pytest.raises(reshard.CorruptCheckpointError, match=f"of checkpoint {name[:40]}"):
        reshard.load(template(), step3)
    with pytest.raises(reshard.CorruptCheckpointError, match=f"of checkpoint {name[:40]}"):
        convert_checkpoint(step3, tmp_path / "converted")
    problems = validate_checkpoint(step3)
    assert len(problems) == 1 and name[:40] in problems[0], problems
    skipped: list[tuple[int, str]] = []
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{step_name(3)}"):
        found = manager.load_latest_with_state(template(), skipped=skipped)
    assert found is not None and found[0] == 2 and [s for s, _ in skipped] == [3]


# ---- 5: a gc killed before it removed its directory -----------------------------------------------------------------

KILL_BEFORE_RMDIR = textwrap.dedent(
    """
    import os, signal, sys
    from reshard.flows.maintenance import collect_garbage

    holder = os.path.abspath(sys.argv[1])

    def hook(event, args):
        if event == "os.rmdir" and os.path.abspath(os.fsdecode(args[0])) == holder:
            os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    collect_garbage(holder, min_age_s=0)
    print("not killed")
    """
)


@pytest.mark.dist
def test_gc_killed_before_it_removed_the_directory_leaves_one_that_the_next_gc_calls_empty(tmp_path: Path) -> None:
    """A retired step whose only referrer is gone: ``kill -9`` of its gc right before the directory itself is
    removed leaves an empty directory; gc of it (any options) says there is nothing to collect and exits 0,
    and the next retention removes it."""
    root = tmp_path / "root"
    _three_steps(root)
    shutil.rmtree(root / step_name(3))
    holder = root / step_name(1)
    child = subprocess.run(
        [sys.executable, "-c", KILL_BEFORE_RMDIR, str(holder)],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -9, child.stderr
    assert holder.is_dir() and not [p for p in holder.rglob("*") if not p.is_dir()]
    for options in ({}, {"min_age_s": 0, "include_incomplete": True}, {"dry_run": True}):
        assert collect_garbage(holder, **options) == []  # type: ignore[arg-type]
    for extra in ([], ["--incomplete", "--min-age", "0"]):
        code, out, err = _cli("gc", str(holder), *extra)
        assert code == 0 and "nothing to collect" in out, (out, err)
    assert holder.is_dir()
    reshard.CheckpointManager(root, keep_last=1).save(4, frozen_and_trained(4))
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [step_name(4)]


# ---- 6: what gc says it removed ------------------------------------------------------------------------------------


@pytest.mark.unit
def test_gc_says_what_it_removed_by_kind(tmp_path: Path) -> None:
    """gc of a retired step whose referrer is gone removes one data file, one stale marker and the record, and
    says so (not "3 unreferenced data files"); a dry run says the same with "would remove"; gc of a checkpoint
    with nothing to remove says so."""
    root = tmp_path / "root"
    _three_steps(root)
    shutil.rmtree(root / step_name(3))
    holder = str(root / step_name(1))
    code, out, _ = _cli("gc", holder, "--min-age", "0", "--dry-run")
    assert code == 0 and out.splitlines()[-1] == (
        "would remove 1 data file, 1 stale reference marker and the retirement record"
    ), out
    code, out, _ = _cli("gc", holder, "--min-age", "0")
    assert code == 0 and out.splitlines()[-1] == (
        "removed 1 data file, 1 stale reference marker and the retirement record"
    ), out
    assert not Path(holder).exists()
    reshard.save(frozen_and_trained(1), tmp_path / "plain")
    code, out, _ = _cli("gc", str(tmp_path / "plain"), "--min-age", "0")
    assert code == 0 and out.splitlines() == ["nothing to collect"], out
    assert scan_root(LocalStorage(root)) == []


# ---- 7: the temporaries of a save killed at one of reshard's atomic writes -----------------------------------------

KILL_AT_LOCK_LINK = textwrap.dedent(
    """
    import os, signal, sys
    import reshard
    from tests.flows.test_incremental import frozen_and_trained
    real_link = os.link
    def link(src, dst, *args, **kwargs):
        if str(dst).endswith("step_000000003/.lock"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_link(src, dst, *args, **kwargs)
    os.link = link
    reshard.CheckpointManager(sys.argv[1], keep_last=1, incremental=True).save(3, frozen_and_trained(3))
    """
)


def _save_killed_at_its_lock_link(root: Path) -> Path:
    """Steps 1 and 2, then step 3 killed (SIGKILL, in a real process) at the create-only link of its save lock:
    the step holds the lock's temporary ``..lock.tmp-<hex>`` and an empty ``data/``."""
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    for step in (1, 2):
        manager.save(step, frozen_and_trained(step))
    child = subprocess.run(
        [sys.executable, "-c", KILL_AT_LOCK_LINK, str(root)],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -9, child.stderr
    step = root / step_name(3)
    files = [p.relative_to(step).as_posix() for p in step.rglob("*") if not p.is_dir()]
    assert len(files) == 1 and files[0].startswith("..lock.tmp-"), files
    return step


@pytest.mark.dist
def test_a_save_killed_at_the_link_of_its_lock_is_cleared_by_gc_and_by_retention(tmp_path: Path) -> None:
    """The lock temporary that a save killed at its lock's link leaves is reshard's own (its content is the lock
    record of a holder that is gone): ``gc --incomplete`` removes the step, and so does the retention of a later
    save (the step is older than the newest complete one); ``reshard ls`` no longer shows it."""
    root = tmp_path / "root"
    step = _save_killed_at_its_lock_link(root)
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    code, out, err = _cli("gc", str(step), "--min-age", "0", "--incomplete")
    assert code == 0 and out.splitlines()[-1] == "removed 1 commit temporary file", (out, err)
    assert not step.exists()
    manager = reshard.CheckpointManager(copy, keep_last=1, incremental=True)
    manager.save(4, frozen_and_trained(4))
    assert [s.status for s in scan_root(LocalStorage(copy))] == ["retired", "complete"]  # step 1: frozen tensors
    assert not (copy / step_name(3)).exists()


@pytest.mark.dist
def test_a_file_named_like_a_temporary_that_reshard_did_not_write_stays_with_its_directory(tmp_path: Path) -> None:
    """Beside a lock temporary of a dead save, a person's file named like a lock temporary but not a lock record
    and one named like another temporary stay, and so does their directory, with a warning that names them (not
    one that says the directory holds data files); retention leaves them too. Without the dead save's temporary,
    gc refuses the directory and names its files."""
    root = tmp_path / "root"
    step = _save_killed_at_its_lock_link(root)
    hexa, hexb = "a" * 32, "b" * 32
    (step / f"..lock.tmp-{hexa}").write_text("my notes")
    (step / f".notes.txt.tmp-{hexb}").write_text("mine")
    mine = [f"..lock.tmp-{hexa}", f".notes.txt.tmp-{hexb}"]
    with pytest.warns(UserWarning, match="nothing ties to a reshard save") as caught:
        code, out, err = _cli("gc", str(step), "--min-age", "0", "--incomplete")
    message = str(caught[0].message)
    assert code == 0 and out.splitlines()[-2:] == [
        "removed 1 commit temporary file",
        "kept 2 files that nothing ties to a reshard save (delete them yourself if they are yours)",
    ], (out, err)
    assert "holds data files" not in message and all(name in message for name in mine), message
    assert sorted(p.name for p in step.iterdir() if p.is_file()) == mine
    code, out, err = _cli("gc", str(step), "--min-age", "0", "--incomplete")
    assert code == 3 and "holds data files" not in err and "not a reshard checkpoint" in err, err
    reshard.CheckpointManager(root, keep_last=1, incremental=True).save(4, frozen_and_trained(4))
    assert sorted(p.name for p in step.iterdir() if p.is_file()) == mine


@pytest.mark.unit
def test_retention_removes_the_latest_temporaries_of_dead_managers_and_no_one_elses(tmp_path: Path) -> None:
    """A manager killed while it replaced ``latest.json`` leaves ``.latest.json.tmp-<hex>`` in the root: the next
    manager's retention removes it (it holds the root's lock, so no other writer of the pointer is alive), and
    leaves a file named so that is not a pointer reshard wrote."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1)
    manager.save(1, frozen_and_trained(1))
    ours, theirs = root / f".latest.json.tmp-{'c' * 32}", root / f".latest.json.tmp-{'d' * 32}"
    ours.write_bytes((root / "latest.json").read_bytes())
    theirs.write_text('{"step": 1, "path": "step_000000001", "mine": true}')
    manager.save(2, frozen_and_trained(2))
    assert not ours.exists() and theirs.exists()


@pytest.mark.unit
@pytest.mark.parametrize("pointer", ["latest.json", "plans.reshard-cache", "reads.reshard-cache"])
@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_temporary_name_that_is_no_regular_file_stays_and_retention_goes_on(
    tmp_path: Path, pointer: str, kind: str
) -> None:
    """A FIFO or a link named like a temporary of ``latest.json`` or of the plan cache is not reshard's (it never
    makes either): it stays, untouched and unfollowed, with a warning, and every later save commits, points
    ``latest.json`` at itself and applies retention as before (an outside attack found every later save raising
    UnconfirmedCommitError, and ``keep_last`` ignored)."""
    root = tmp_path / "root"
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    manager = reshard.CheckpointManager(root, keep_last=1)
    manager.save(1, frozen_and_trained(1))
    planted = root / f".{pointer}.tmp-{'e' * 32}"
    os.mkfifo(planted) if kind == "fifo" else planted.symlink_to(outside)
    for step in (2, 3):
        with pytest.warns(UserWarning, match="not a regular file"):
            manager.save(step, frozen_and_trained(step))
    assert manager.steps() == [3] and manager.latest_pointer() == 3
    assert planted.is_symlink() if kind == "symlink" else stat.S_ISFIFO(planted.lstat().st_mode)
    assert outside.read_text() == "not yours"
    manager.close()


# ---- 8: gc of a directory that is not reshard's does not walk it ---------------------------------------------------

_LISTED: list[list[str]] = []  # while not empty: the directories listed (os.scandir, os.listdir), by the audit hook


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _LISTED and event in ("os.scandir", "os.listdir"):
        _LISTED[-1].append(os.path.abspath(os.fsdecode(args[0] if args[0] is not None else ".")))


sys.addaudithook(_audit)


@pytest.mark.unit
@pytest.mark.parametrize("project", [False, True], ids=["home", "project-with-data"])
def test_gc_of_a_directory_that_is_not_reshards_lists_only_its_top_data_and_refs(tmp_path: Path, project: bool) -> None:
    """gc (a dry run of ``--incomplete`` too) of a deep directory that holds nothing reshard wrote (a home
    directory; a project with its own ``data/train.csv``) refuses it as not a checkpoint, and lists nothing below
    it but ``data/`` and ``refs/`` (seen by an audit hook on every directory listing): ``/`` or an NFS share is
    never walked."""
    home = tmp_path / "home"
    deep = home.joinpath(*[f"d{i}" for i in range(12)])
    deep.mkdir(parents=True)
    (deep / "f.txt").write_text("x")
    (home / "notes.txt").write_text("mine")
    if project:
        (home / "data").mkdir()
        (home / "data" / "train.csv").write_text("a,b\n")
    allowed = {str(home), str(home / "data"), str(home / "refs")}
    for options in ({"dry_run": True, "include_incomplete": True}, {"include_incomplete": True}, {}):
        _LISTED.append([])
        try:
            with pytest.raises(CheckpointNotFoundError, match="not a reshard checkpoint"):
                collect_garbage(home, min_age_s=0, **options)  # type: ignore[arg-type]
        finally:
            listed = set(_LISTED.pop())
        assert listed <= allowed, sorted(listed - allowed)
    assert (deep / "f.txt").exists() and (home / "notes.txt").exists()
