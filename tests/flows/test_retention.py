"""Regression tests of the defects an outside attack found in ``reshard gc``, retention, incremental references
and the manager (docs/reliability.md, section 13), and the hostile and unlucky cases around them.

Real files, real processes: the cut-short retentions and collections are real ``kill -9``s of a process that
runs them (forked once per kill point from one helper process that has imported torch and reshard, so that a
point costs milliseconds); nothing of the storage is mocked. A test that must show that a file outside a
checkpoint is never touched reads the checkpoint through :class:`Watched`, a real LocalStorage that notes the
names it is asked about.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.cli import main as cli_main
from reshard.flows.maintenance import collect_garbage, validate_checkpoint
from reshard.flows.manager import LATEST_FILE, scan_root, step_name
from reshard.interop import CheckpointReader
from reshard.io.locking import LOCK_FILE, LockInfo, machine_identity, pid_namespace
from reshard.io.references import REFERENCES_DIR, RETIRED_FILE
from reshard.net.transports import ThreadGroup
from reshard.storage import LocalStorage, ObjectStorage, Storage
from tests.faults import Fault, FaultyStorage
from tests.flows.test_incremental import assert_loads_as, frozen_and_trained, template
from tests.metadata_docs import read_doc, write_doc
from tests.threads import on_threads

ROOT = Path(__file__).resolve().parents[2]
HASHED = reshard.SaveOptions(content_hash=True)
OLD = 1_000_000_000.0  # 2001: older than any --min-age


def _age(path: Path) -> None:
    for item in [path, *path.rglob("*")]:
        os.utime(item, (OLD, OLD), follow_symlinks=False)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=False, capture_output=True, text=True
    )
    return int(child.stdout)


def _cli(*args: str) -> tuple[int, str]:
    """``reshard ARGS`` (in this process): its exit code and what it wrote on stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    assert "Traceback" not in err.getvalue(), err.getvalue()
    return code, err.getvalue()


# ---- 5: gc of a directory that holds a retired.json it did not write -------------------------------------------

HEX = "0123456789abcdef" * 2
NOT_RECORDS = {
    "own_json": b'{"retired": ["model-2019", "model-2020"], "owner": "the project"}\n',
    "not_json": b"models we retired: 2019, 2020\n",
    "old_form_foreign": b'{"retired": 1.5, "kept": ["src/train.py"]}',
    "old_form_escape": json.dumps({"retired": 1.5, "kept": [f"../other/data/{HEX}-r00000.bin"]}).encode(),
    "new_form_foreign": json.dumps(
        {"retired": 1.5, "save_id": HEX, "files": ["data/train.csv"], "kept": []}, separators=(",", ":")
    ).encode(),
    "huge": b"",  # made a sparse 65 MiB file below
    "deep": b"[" * 100_000,
}


@pytest.mark.unit
@pytest.mark.parametrize("record", sorted(NOT_RECORDS))
def test_5_gc_never_empties_a_directory_whose_retired_json_reshard_did_not_write(tmp_path: Path, record: str) -> None:
    """A project directory (no metadata.json) with its own ``retired.json``, sources, a CSV, a file named like a
    reshard data file and a ``refs/`` folder, all old: ``gc`` (any options) refuses it, deletes nothing and
    leaves the directory; so does retention when such a directory sits in a manager root as a step."""
    project = tmp_path / "project"
    files = {
        "src/train.py": b"print('training')\n",
        "data/train.csv": b"a,b\n1,2\n",
        f"data/{HEX}-r00000.bin": b"named like a data file",
        "refs/notes.json": b'{"checkpoint": "x"}',
        RETIRED_FILE: NOT_RECORDS[record],
    }
    for name, content in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_bytes(content)
    if record == "huge":
        os.truncate(project / RETIRED_FILE, 65 * 1024 * 1024)
    _age(project)
    before = _snapshot(project)
    for options in ({}, {"dry_run": True}, {"include_incomplete": True}):
        with pytest.raises(reshard.CheckpointNotFoundError, match=r"retired\.json"):
            collect_garbage(project, min_age_s=0, **options)  # type: ignore[arg-type]
    code, err = _cli("gc", str(project), "--min-age", "0", "--incomplete")
    assert code == 3 and "retired.json" in err and "nothing" in err
    assert _snapshot(project) == before
    # The same directory as a step of a manager root: retention leaves it whole.
    root = tmp_path / "root"
    shutil.copytree(project, root / step_name(1), symlinks=True)
    _age(root / step_name(1))
    reshard.CheckpointManager(root, keep_last=1).save(2, {"w": torch.ones(4)})
    assert _snapshot(root / step_name(1)) == before


@pytest.mark.unit
def test_5_gc_of_a_home_directory_or_of_files_named_like_data_deletes_nothing(tmp_path: Path) -> None:
    """``gc`` of a home directory (a ``.ssh``, a project, a ``data/`` with files named as a save names them,
    no metadata.json): refused, nothing deleted, whatever the options; ``gc /`` refuses too."""
    home = tmp_path / "home"
    files = {
        ".ssh/id_rsa": b"-----BEGIN OPENSSH PRIVATE KEY-----\n",
        ".bashrc": b"export PATH\n",
        "project/src/model.py": b"import torch\n",
        f"data/{HEX}-r00000.bin": b"a file of mine",
        f"data/{HEX[::-1]}-r00001.bin": b"another",
        "refs/x.json": json.dumps(
            {"checkpoint": "project", "save_id": HEX, "files": [f"data/{HEX}-r00000.bin"]}
        ).encode(),
    }
    for name, content in files.items():
        (home / name).parent.mkdir(parents=True, exist_ok=True)
        (home / name).write_bytes(content)
    _age(home)
    before = _snapshot(home)
    with pytest.raises(reshard.IncompleteCheckpointError):
        collect_garbage(home, min_age_s=0)
    with pytest.raises(reshard.CheckpointError, match="nothing ties"):
        collect_garbage(home, min_age_s=0, include_incomplete=True)
    code, err = _cli("gc", str(home), "--incomplete", "--min-age", "0")
    assert code == 3 and "nothing ties" in err
    assert _snapshot(home) == before
    code, err = _cli("gc", "/", "--dry-run", "--incomplete", "--min-age", "0")
    assert code == 3 and err.strip()


@pytest.mark.unit
def test_5_gc_of_a_real_retired_checkpoint_removes_only_what_its_save_wrote(tmp_path: Path) -> None:
    """A retired step that also holds a person's notes and a file named like data of another save: once no
    checkpoint references it, retention removes exactly the files its record names, its markers and the
    record, and leaves the rest (and so the directory)."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    manager.save(1, frozen_and_trained(1))
    manager.save(2, frozen_and_trained(2))
    retired = root / step_name(1)
    record = json.loads((retired / RETIRED_FILE).read_bytes())
    assert len(record["files"]) == 1 and record["kept"] == record["files"] and len(record["save_id"]) == 32
    (retired / "notes.txt").write_text("why we kept step 1")
    foreign = retired / "data" / f"{HEX}-r00000.bin"
    foreign.write_bytes(b"not of this save")
    _age(retired)
    reshard.CheckpointManager(root, keep_last=1).save(3, frozen_and_trained(3))  # a full save: nothing referenced
    assert sorted(p.relative_to(retired).as_posix() for p in retired.rglob("*") if p.is_file()) == [
        f"data/{HEX}-r00000.bin",
        "notes.txt",
    ]
    assert_loads_as(root / step_name(3), 3)


@pytest.mark.unit
def test_5_a_retirement_record_of_the_previous_version_is_swept(tmp_path: Path) -> None:
    """``retired.json`` as reshard wrote it before it recorded the save (``{"retired", "kept"}``): its kept files
    are reshard's and go once unreferenced, with the directory."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    manager.save(1, frozen_and_trained(1))
    manager.save(2, frozen_and_trained(2))
    retired = root / step_name(1)
    record = json.loads((retired / RETIRED_FILE).read_bytes())
    (retired / RETIRED_FILE).write_text(json.dumps({"retired": record["retired"], "kept": record["kept"]}))
    assert collect_garbage(retired, min_age_s=0) == []  # step 2 still references the kept file
    assert_loads_as(root / step_name(2), 2)
    shutil.rmtree(root / step_name(2))  # its referrer goes
    removed = collect_garbage(retired, min_age_s=0)
    assert RETIRED_FILE in removed and not retired.exists()


# ---- 6: copies and moves of an incremental step ---------------------------------------------------------------


def _unprotected(path: Path, holder: str) -> str:
    marker = rf"{REFERENCES_DIR}/{re.escape(path.name)}\.[0-9a-f]{{32}}\.json"
    return rf"{holder}.*no reference marker {marker}.*copied or moved"


@pytest.mark.unit
def test_6_a_copied_or_moved_step_is_refused_and_retention_and_gc_keep_what_others_use(tmp_path: Path) -> None:
    """``cp -r step_2 step_2_backup``, ``mv step_3 step_7`` and a copy of a step into another root without
    its holder are refused by load and validate, naming the reference and the missing marker (nothing of the
    holder's data is opened), before and after retention and gc; a copy or tarball of the whole root is
    consistent (its markers name its own steps) and loads, and retention and gc in either root never cost the
    other a file."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, incremental=True)
    for step in (1, 2, 3):
        manager.save(step, frozen_and_trained(step))
    holder = step_name(1)
    whole = shutil.copytree(root, tmp_path / "copy_of_root")
    with tarfile.open(tmp_path / "root.tar", "w") as tar:
        tar.add(root, arcname="root")
    with tarfile.open(tmp_path / "root.tar") as tar:
        tar.extractall(tmp_path / "restored", filter="data")
    backup = shutil.copytree(root / step_name(2), root / "step_2_backup")
    elsewhere = shutil.copytree(root / step_name(2), tmp_path / "other_root" / step_name(2))
    moved = (root / step_name(3)).rename(root / step_name(7))

    def refused() -> None:
        for path in (backup, moved):
            with pytest.raises(reshard.CorruptCheckpointError, match=_unprotected(path, holder)):
                reshard.load(template(), path)
            problems = validate_checkpoint(path)
            assert len(problems) == 1 and re.search(_unprotected(path, holder), problems[0]), problems
        with pytest.raises(reshard.CorruptCheckpointError, match=f"{holder}.*is missing"):
            reshard.load(template(), elsewhere)

    refused()
    for copy in (whole, tmp_path / "restored" / "root"):
        for step in (1, 2, 3):
            assert_loads_as(copy / step_name(step), step)
    # Retention (the moved step is no base: a full save) and gc of every directory.
    reshard.CheckpointManager(root, keep_last=1, incremental=True).save(8, frozen_and_trained(8))
    for child in sorted(root.iterdir()):
        if child.is_dir():
            collect_garbage(child, min_age_s=0)
    assert_loads_as(root / step_name(8), 8)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [step_name(8), "step_2_backup"]
    with pytest.raises(reshard.CorruptCheckpointError, match=f"{holder}.*is missing"):
        reshard.load(template(), backup)
    # The copies of the whole root lost nothing, and their own retention and gc keep what they use.
    for copy in (whole, tmp_path / "restored" / "root"):
        for step in (1, 2, 3):
            assert_loads_as(copy / step_name(step), step)
        reshard.CheckpointManager(copy, keep_last=1, incremental=True).save(4, frozen_and_trained(4))
        for child in sorted(copy.iterdir()):
            if child.is_dir():
                collect_garbage(child, min_age_s=0)
        assert {i.step: i.status for i in scan_root(LocalStorage(copy))} == {1: "retired", 4: "complete"}
        assert_loads_as(copy / step_name(4), 4)


@pytest.mark.unit
def test_6_a_moved_newest_step_is_no_base_and_never_loaded_silently(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, incremental=True)
    for step in (1, 2):
        manager.save(step, frozen_and_trained(step))
    (root / step_name(2)).rename(root / step_name(5))
    skipped: list[tuple[int, str]] = []
    with pytest.warns(UserWarning, match="no reference marker"):
        found = manager.load_latest_with_state(template(), skipped=skipped)
    assert found is not None and found[0] == 1 and skipped[0][0] == 5
    result = manager.save(6, frozen_and_trained(6))  # its base would be step 5, which is not protected
    assert result.referenced_bytes == 0
    assert_loads_as(root / step_name(6), 6)


@pytest.mark.unit
def test_6_a_step_read_through_a_link_keeps_its_references(tmp_path: Path) -> None:
    """A link to a step (``latest -> step_2`` beside it, or from another directory) is that step: its name and
    siblings are those of the directory it points to, so its references hold."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, incremental=True)
    for step in (1, 2):
        manager.save(step, frozen_and_trained(step))
    (root / "latest").symlink_to(step_name(2))
    (tmp_path / "elsewhere").symlink_to(root / step_name(2))
    for link in (root / "latest", tmp_path / "elsewhere"):
        assert_loads_as(link, 2)
        assert validate_checkpoint(link) == []


@pytest.mark.unit
def test_a_manager_whose_base_lost_bytes_saves_in_full(tmp_path: Path) -> None:
    """The file that the newest step references was truncated (a damaged disk): the next save of the job is
    made in full instead of failing (it could not reference that file), and loads."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=2, incremental=True)
    manager.save(1, frozen_and_trained(1))
    manager.save(2, frozen_and_trained(2))
    (held,) = (root / step_name(1) / "data").iterdir()
    held.write_bytes(held.read_bytes()[:-5])
    with pytest.raises(reshard.CorruptCheckpointError):
        reshard.load(template(), root / step_name(2))
    assert manager.save(3, frozen_and_trained(3)).referenced_bytes == 0
    assert_loads_as(root / step_name(3), 3)


# ---- 7: a retirement cut short after its record ------------------------------------------------------------------

CUT_AFTER_RECORD = textwrap.dedent(
    """
    import os, signal, sys
    import reshard
    from reshard.storage import LocalStorage
    from tests.flows.test_incremental import frozen_and_trained

    root = sys.argv[1]
    manager = reshard.CheckpointManager(root, incremental=True)
    manager.save(1, frozen_and_trained(1))
    manager.save(2, frozen_and_trained(2))
    commit = LocalStorage.commit

    def commit_then_die(self, name, data, *, replace):
        commit(self, name, data, replace=replace)
        if name == "retired.json" and self.root.name == "step_000000001":
            os.kill(os.getpid(), signal.SIGKILL)

    LocalStorage.commit = commit_then_die
    reshard.CheckpointManager(root, keep_last=1, incremental=True).save(3, frozen_and_trained(3))
    print("not killed")
    """
)


@pytest.mark.dist
def test_7_a_retirement_cut_short_after_its_record_is_no_checkpoint_for_any_reader(tmp_path: Path) -> None:
    root = tmp_path / "root"
    child = subprocess.run(
        [sys.executable, "-c", CUT_AFTER_RECORD, str(root)],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -9, child.stderr
    cut = root / step_name(1)
    assert (cut / RETIRED_FILE).exists() and (cut / "metadata.json").exists()
    assert {i.step: i.status for i in scan_root(LocalStorage(root))}[1] == "retired"
    for read in (
        lambda: reshard.load(template(), cut),
        lambda: reshard.read_metadata(cut),
        lambda: validate_checkpoint(cut),
        lambda: CheckpointReader(cut),
    ):
        with pytest.raises(reshard.CheckpointNotFoundError, match="retired"):
            read()
    for args in (
        ["inspect", str(cut)],
        ["validate", str(cut)],
        ["export", str(cut), str(tmp_path / "hf")],
        ["convert", str(cut), str(tmp_path / "converted")],
        ["diff", str(cut), str(root / step_name(3))],
        ["diff", str(root / step_name(3)), str(cut)],
    ):
        code, err = _cli(*args)
        assert code == 3 and "retired" in err, (args, err)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "converted").exists()
    # The job goes on: step 3 loads, and the next retention finishes the retirement.
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    assert manager.load_latest(template()) == 3
    manager.save(4, frozen_and_trained(4))
    assert not (cut / "metadata.json").exists() and (cut / RETIRED_FILE).exists()
    assert {i.step: i.status for i in scan_root(LocalStorage(root))} == {1: "retired", 4: "complete"}
    assert_loads_as(root / step_name(4), 4)


# ---- 8: references to directories that are not the sibling checkpoint that wrote the file -------------------------


class Watched(LocalStorage):
    """A checkpoint directory that notes every name it (or a sibling it hands out) is asked about."""

    def __init__(self, root: str | os.PathLike[str], seen: list[str]) -> None:
        super().__init__(root)
        self.seen = seen

    def _note(self, name: str) -> None:
        self.seen.append(self.describe(name))

    def exists(self, name: str) -> bool:
        self._note(name)
        return super().exists(name)

    def size(self, name: str) -> int:
        self._note(name)
        return super().size(name)

    def read_bytes(self, name: str, *, max_bytes: int | None = None) -> bytes:
        self._note(name)
        return super().read_bytes(name, max_bytes=max_bytes)

    def read_ranges(self, requests: list[Any], *, max_buffered_bytes: int | None = None) -> list[int]:
        for request in requests:
            self._note(request.name)
        return super().read_ranges(requests, max_buffered_bytes=max_buffered_bytes)

    def map_range(self, name: str, offset: int, length: int) -> Any:
        self._note(name)
        return super().map_range(name, offset, length)

    def list_files(self, prefix: str = "") -> list[str]:
        self._note(prefix)
        return super().list_files(prefix)

    def sibling(self, name: str) -> Storage:
        return Watched(self.parent / name, self.seen)


def _point_at(checkpoint: Path, holder: str, path: str, size: int) -> None:
    """Make every box of ``checkpoint`` lie in ``path`` of sibling ``holder`` (a forged reference)."""
    doc = read_doc(checkpoint)
    doc["files"] = [{"path": path, "size": size, "checkpoint": holder}]
    write_doc(checkpoint, doc)


@pytest.mark.unit
@pytest.mark.parametrize(
    "case", ["secret_file", "data_name_in_a_plain_directory", "checkpoint_without_marker", "malformed_marker"]
)
def test_8_a_reference_outside_a_protected_sibling_checkpoint_is_refused_unopened(tmp_path: Path, case: str) -> None:
    """A hostile checkpoint unpacked in a home directory references ``~/.ssh/id_rsa``, a file named like data
    in a directory that is no checkpoint, or a real checkpoint's data file that holds no marker for it: load
    and validate refuse it naming the reference, and never touch the referenced file (not even its size)."""
    home = tmp_path / "home"
    secret = b"-----BEGIN OPENSSH PRIVATE KEY-----\n" + b"k" * 1000
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_bytes(secret)
    reshard.save({"w": torch.ones(8)}, home / "evil", options=HASHED)
    reshard.save({"w": torch.ones(8)}, home / "other", options=HASHED)
    other_file = reshard.read_metadata(home / "other").files[0]
    if case == "secret_file":
        holder, target, size, match = ".ssh", "id_rsa", 4096, r"files\[0\].path.*data file"
    elif case == "data_name_in_a_plain_directory":
        (home / "project" / "data").mkdir(parents=True)
        shutil.copy(home / "other" / other_file.path, home / "project" / other_file.path)
        holder, target, size, match = "project", other_file.path, other_file.size, "project.*not a reshard checkpoint"
    elif case == "checkpoint_without_marker":
        holder, target, size, match = "other", other_file.path, other_file.size, "other.*no reference marker"
    else:  # a marker with evil's name and save id, nested too deep to parse
        save_id = reshard.read_metadata(home / "evil").save_id
        (home / "other" / REFERENCES_DIR).mkdir()
        (home / "other" / REFERENCES_DIR / f"evil.{save_id}.json").write_bytes(b"[" * 100_000)
        holder, target, size, match = "other", other_file.path, other_file.size, "other.*is malformed"
    _point_at(home / "evil", holder, target, size)
    seen: list[str] = []
    with pytest.raises(reshard.CorruptCheckpointError, match=match) as caught:
        reshard.load({"w": torch.zeros(8)}, Watched(home / "evil", seen))
    assert str(len(secret)) not in str(caught.value)
    problems = validate_checkpoint(Watched(home / "evil", seen))
    assert len(problems) == 1 and re.search(match, problems[0]) and str(len(secret)) not in problems[0]
    touched = [name for name in seen if name.endswith((target, "id_rsa"))]
    assert touched == [], touched


# ---- 10: a manager whose retention fails after the commit ---------------------------------------------------------


def _two_rank_state(rank: int, step: int) -> dict[str, Any]:
    """Rank 0 writes the frozen tensor, rank 1 the one that changes every step (two data files)."""
    state: dict[str, Any] = {
        "rng": reshard.ShardedObject("rng", {"rank": rank, "step": step}, (2,), (rank,)),
        "step": step,
    }
    if rank == 0:
        state["frozen"] = torch.arange(4096.0).reshape(64, 64)
    else:
        adapter = torch.full((64, 64), float(step))
        state["adapter"] = reshard.ShardedTensor.from_rank_offsets("adapter", adapter, (0, 0, 1))
    return state


def _two_rank_template() -> dict[str, Any]:
    return {
        "frozen": torch.zeros(64, 64),
        "adapter": torch.zeros(64, 64),
        "rng": reshard.ShardedObject("rng", None, (2,), (1,)),
        "step": -1,
    }


def _assert_two_rank_step(path: Path, step: int) -> None:
    loaded = reshard.load(_two_rank_template(), path)
    assert torch.equal(loaded["frozen"], torch.arange(4096.0).reshape(64, 64))
    assert torch.equal(loaded["adapter"], torch.full((64, 64), float(step)))
    assert loaded["rng"] == {"rank": 1, "step": step} and loaded["step"] == step


@pytest.mark.unit
def test_10_a_retention_that_fails_after_the_commit_is_an_unconfirmed_commit_on_every_rank(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    group = ThreadGroup(2)

    def save(step: int, keep_last: int | None) -> Any:
        def run(rank: int) -> Any:
            manager = reshard.CheckpointManager(root, keep_last=keep_last, group=group.member(rank))
            try:
                return manager.save(step, _two_rank_state(rank, step))
            except reshard.CheckpointError as exc:
                return exc
            finally:
                manager.close()

        return on_threads(2, run, group=group)

    save(1, None)
    (elsewhere / "x.json").parent.mkdir()
    (elsewhere / "x.json").write_text("{}")
    (root / step_name(1) / REFERENCES_DIR).symlink_to(elsewhere)  # the retention of step 1 fails on it
    errors = save(2, 1)
    for rank, error in enumerate(errors):
        assert isinstance(error, reshard.UnconfirmedCommitError), (rank, error)
        assert f"{step_name(2)} was committed" in str(error) and "retention" in str(error), str(error)
        assert error.save_id == reshard.read_metadata(root / step_name(2)).save_id
    assert json.loads((root / LATEST_FILE).read_text())["step"] == 2
    _assert_two_rank_step(root / step_name(2), 2)
    assert (elsewhere / "x.json").read_text() == "{}"
    (root / step_name(1) / REFERENCES_DIR).unlink()
    assert all(not isinstance(r, reshard.CheckpointError) for r in save(3, 1))
    assert reshard.CheckpointManager(root).steps() == [3]


# ---- hostile roots and markers -------------------------------------------------------------------------------------


@pytest.mark.dist
def test_retention_never_deletes_through_a_step_that_is_a_link(tmp_path: Path) -> None:
    """A manager root whose step directories are links (to a checkpoint kept on another disk, to a home
    directory): retention deletes nothing through them."""
    root, home, kept = tmp_path / "root", tmp_path / "home", tmp_path / "kept"
    reshard.save({"w": torch.ones(4)}, kept / "ckpt")
    (home / "data").mkdir(parents=True)
    (home / "data" / f"{HEX}-r00000.bin").write_bytes(b"mine")
    (home / LOCK_FILE).write_bytes(
        LockInfo(
            host=socket.gethostname(),
            machine=machine_identity(),
            pid_namespace=pid_namespace(),
            pid=_dead_pid(),
            token=HEX,
            created=OLD,
        ).to_bytes()
    )
    _age(home)
    before_home, before_kept = _snapshot(home), _snapshot(kept)
    root.mkdir()
    (root / step_name(1)).symlink_to(kept / "ckpt")
    (root / step_name(2)).symlink_to(home)
    reshard.CheckpointManager(root, keep_last=1).save(3, {"w": torch.zeros(4)})
    assert _snapshot(home) == before_home and _snapshot(kept) == before_kept
    assert (root / step_name(1)).is_symlink() and (root / step_name(2)).is_symlink()


@pytest.mark.unit
def test_retention_of_a_step_whose_data_is_a_link_deletes_nothing(tmp_path: Path) -> None:
    """A step whose ``data`` is a link to a directory elsewhere: retention deletes nothing of it (not even its
    metadata.json) and says so; the save is committed (UnconfirmedCommitError)."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    manager = reshard.CheckpointManager(root, keep_last=1)
    manager.save(1, frozen_and_trained(1))
    shutil.move(root / step_name(1) / "data", elsewhere)
    (root / step_name(1) / "data").symlink_to(elsewhere)
    before, inside = _snapshot(elsewhere), _snapshot(root / step_name(1))
    with pytest.raises(reshard.UnconfirmedCommitError, match="symbolic link"):
        manager.save(2, frozen_and_trained(2))
    assert _snapshot(elsewhere) == before and _snapshot(root / step_name(1)) == inside
    assert_loads_as(root / step_name(2), 2)


@pytest.mark.unit
def test_hostile_reference_markers_protect_nothing_and_are_never_deleted(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    manager.save(1, frozen_and_trained(1))
    manager.save(2, frozen_and_trained(2))
    refs = root / step_name(1) / REFERENCES_DIR
    hostile = {
        "huge.json": b"",
        "bad.json": b"{not json",
        f"step_000000002.{HEX}.json": b"[" * 100_000,
        "escape.x.json": json.dumps({"checkpoint": "..", "save_id": HEX, "files": ["data/x"]}).encode(),
        f"step_000000009.{HEX}.json": json.dumps(
            {"checkpoint": "step_000000002", "save_id": HEX, "files": ["../../etc/passwd"]}
        ).encode(),
    }
    for name, content in hostile.items():
        (refs / name).write_bytes(content)
    os.truncate(refs / "huge.json", 65 * 1024 * 1024)
    assert collect_garbage(root / step_name(1), min_age_s=0) == []
    assert_loads_as(root / step_name(2), 2)
    reshard.CheckpointManager(root, keep_last=1).save(3, frozen_and_trained(3))  # nothing references step 1 now
    left = sorted(
        p.relative_to(root / step_name(1)).as_posix() for p in (root / step_name(1)).rglob("*") if p.is_file()
    )
    assert left == sorted(f"{REFERENCES_DIR}/{name}" for name in hostile)
    assert_loads_as(root / step_name(3), 3)


@pytest.mark.dist
def test_retention_gc_and_references_on_an_object_store(object_store: Any) -> None:
    """The same rules on S3 and GCS: a step copied to another prefix beside it is refused naming the missing
    marker; retirement records its files, and the sweep leaves an object that nothing ties to a save."""
    options = object_store.storage_options
    url = f"{object_store.protocol}://{object_store.new_bucket()}/run"
    manager = reshard.CheckpointManager(url, keep_last=1, incremental=True, storage_options=options)
    root = ObjectStorage(url, options)
    try:
        manager.save(1, frozen_and_trained(1))
        manager.save(2, frozen_and_trained(2))
        retired = root.child(step_name(1))
        record = json.loads(retired.read_bytes(RETIRED_FILE))
        assert len(record["files"]) == 1 and record["kept"] == record["files"]
        for name in root.child(step_name(2)).list_files():  # cp -r step_2 step_2_backup
            root.put(f"step_2_backup/{name}", root.child(step_name(2)).read_bytes(name))
        with pytest.raises(reshard.CorruptCheckpointError, match=r"no reference marker refs/step_2_backup\."):
            reshard.load(template(), f"{url}/step_2_backup", storage_options=options)
        root.put(f"{step_name(1)}/notes.txt", b"why we kept step 1")
        reshard.CheckpointManager(url, keep_last=1, storage_options=options).save(3, frozen_and_trained(3))
        assert root.child(step_name(1)).list_files() == ["notes.txt"]
        assert root.child(step_name(2)).list_files() == []
        assert_loads_as(f"{url}/{step_name(3)}", 3, storage_options=options)
    finally:
        manager.close()
        root.close()


# ---- kill -9 of retention and gc at every step -----------------------------------------------------------------------

KILL_RUN = textwrap.dedent(
    """
    import json, os, shutil, signal, sys, traceback
    from pathlib import Path

    from reshard.storage import LocalStorage
    from tests.flows.test_retention import prepare_scenario, run_scenario

    template, work, scenario = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    prepare_scenario(template, scenario)
    points = []
    for point in range(400):
        target = work / f"{point:03d}"
        shutil.copytree(template, target / "root", symlinks=True)
        pid = os.fork()
        if pid == 0:
            try:
                state = {"armed": scenario in ("gc", "resave"), "count": 0}
                for method in ("commit", "delete", "delete_prefix", "remove_empty_dirs"):
                    original = getattr(LocalStorage, method, None)
                    if original is None:
                        continue

                    def wrapper(self, *args, _original=original, _method=method, **kwargs):
                        if state["armed"]:
                            if state["count"] == point:
                                what = f"{_method} {self.describe(args[0] if args else '')}"
                                (target / "killed.json").write_text(json.dumps({"point": point, "what": what}))
                                os.kill(os.getpid(), signal.SIGKILL)
                            state["count"] += 1
                        result = _original(self, *args, **kwargs)
                        if _method == "commit" and args[0] == "latest.json":
                            state["armed"] = True
                        return result

                    setattr(LocalStorage, method, wrapper)
                run_scenario(target / "root", scenario)
            except BaseException:
                traceback.print_exc()
                os._exit(2)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        if not killed and os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"point {point}: the run failed")
        points.append({"point": point, "killed": killed})
        if not killed:
            break
    (work / "points.json").write_text(json.dumps(points))
    """
)


def prepare_scenario(template: Path, scenario: str) -> None:
    """In the helper process: the root a scenario starts from (see :func:`run_scenario`)."""
    group = ThreadGroup(2)

    def save(step: int, keep_last: int | None) -> None:
        def run(rank: int) -> None:
            manager = reshard.CheckpointManager(
                template, keep_last=keep_last, incremental=True, group=group.member(rank)
            )
            manager.save(step, _two_rank_state(rank, step))

        on_threads(2, run, group=group)

    save(1, None)
    save(2, None if scenario == "retire" else 1)
    if scenario == "gc":
        shutil.rmtree(template / step_name(2))  # step 1's referrer goes: its retired directory is garbage
    # Step 0: a save killed while it wrote (its stale lock names its save; its data file is partial).
    pid = os.fork()
    if pid == 0:
        fault = Fault(point="mid_write", rank=0, after_bytes=1000)
        reshard.save(frozen_and_trained(0), FaultyStorage(template / step_name(0), fault))
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and (template / step_name(0) / LOCK_FILE).exists()


def run_scenario(root: Path, scenario: str) -> None:
    """In a forked child: the work whose every storage step may be its last.

    - ``retire``: steps 1 (complete) and 2 (references 1); an incremental save of step 3 with keep_last=1:
      retention deletes step 2 whole, retires step 1 (keeping the file step 3 references) and removes step 0;
    - ``full``: step 1 retired, step 2 referencing it; a full save of step 3: step 2 and step 1 go whole;
    - ``gc``: step 1 retired with no referrer: ``gc`` of every directory;
    - ``resave``: step 1 retired, step 2 referencing it; a save into step 1's retired directory (which deletes
      ``retired.json`` before its commit).
    """
    if scenario == "resave":
        group = ThreadGroup(2)
        path = root / step_name(1)
        on_threads(2, lambda r: reshard.save(_two_rank_state(r, 1), path, group=group.member(r), options=HASHED))
        return
    if scenario == "gc":
        for child in sorted(root.iterdir()):
            if child.is_dir():
                with contextlib.suppress(reshard.CheckpointError):
                    collect_garbage(child, min_age_s=0, include_incomplete=True)
        return
    group = ThreadGroup(2)

    def run(rank: int) -> None:
        manager = reshard.CheckpointManager(
            root, keep_last=1, incremental=scenario == "retire", group=group.member(rank)
        )
        manager.save(3, _two_rank_state(rank, 3))

    on_threads(2, run, group=group)


def _layout(root: Path) -> list[str]:
    """Every file under ``root`` with save ids as ``<id>`` (runs with other ids compare equal)."""
    return sorted(
        re.sub(r"[0-9a-f]{32}", "<id>", p.relative_to(root).as_posix()) for p in root.rglob("*") if p.is_file()
    )


def _check_after_kill(root: Path, scenario: str) -> None:
    """What must hold wherever the kill fell: every complete step loads bit-exactly and validates, every retired
    one is refused, the steps the policy keeps are complete."""
    infos = {i.step: i for i in scan_root(LocalStorage(root))}
    for step, info in infos.items():
        path = root / info.name
        if info.status == "complete":
            _assert_two_rank_step(path, step)
            assert validate_checkpoint(path) == [], step
        elif info.status == "retired":
            with pytest.raises(reshard.CheckpointNotFoundError, match="retired"):
                reshard.load(_two_rank_template(), path)
        else:
            assert info.status == "incomplete" and step < 3, (step, info)
    if scenario in ("retire", "full"):
        assert infos[3].status == "complete" and json.loads((root / LATEST_FILE).read_text())["step"] == 3
    if scenario == "resave":
        assert infos[2].status == "complete"
    if scenario == "retire":
        assert infos[1].status in ("complete", "retired")


def _recover(root: Path, scenario: str) -> None:
    """What a job does next: the next save (with the scenario's retention), then gc of every directory."""
    if scenario != "gc":
        group = ThreadGroup(2)

        def run(rank: int) -> None:
            manager = reshard.CheckpointManager(
                root, keep_last=1, incremental=scenario in ("retire", "resave"), group=group.member(rank)
            )
            manager.save(4, _two_rank_state(rank, 4))

        on_threads(2, run, group=group)
    for child in sorted(root.iterdir()):
        if child.is_dir():
            with contextlib.suppress(reshard.CheckpointError):
                collect_garbage(child, min_age_s=0, include_incomplete=True)


@pytest.mark.dist
@pytest.mark.parametrize("scenario", ["retire", "full", "gc", "resave"])
def test_kill_9_at_every_step_of_retention_and_gc_loses_nothing_and_converges(tmp_path: Path, scenario: str) -> None:
    """SIGKILL the process that runs retention (or gc, or a save into a retired directory) before each of its
    deletions and writes, one kill point per run: every committed, non-retired checkpoint still loads, retired
    ones are refused, and the next save and gc leave exactly what an uninterrupted run leaves."""
    work = tmp_path / "work"
    work.mkdir()
    child = subprocess.run(
        [sys.executable, "-c", KILL_RUN, str(tmp_path / "template"), str(work), scenario],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stderr
    points = json.loads((work / "points.json").read_text())
    assert len(points) >= 4 and not points[-1]["killed"] and all(p["killed"] for p in points[:-1])
    layouts = []
    for point in points:
        root = work / f"{point['point']:03d}" / "root"
        _check_after_kill(root, scenario)
        _recover(root, scenario)
        _check_after_kill(root, "gc")
        layouts.append(_layout(root))
    clean = layouts[-1]
    for point, layout in zip(points, layouts, strict=True):
        assert layout == clean, (point, sorted(set(layout) ^ set(clean)))
