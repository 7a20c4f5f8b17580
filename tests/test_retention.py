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
from reshard.interop import CheckpointReader
from reshard.maintenance import collect_garbage, validate_checkpoint
from reshard.manager import LATEST_FILE, scan_root, step_name
from reshard.references import REFERENCES_DIR, RETIRED_FILE
from reshard.storage import LocalStorage, Storage
from reshard.transports import ThreadGroup
from tests.metadata_docs import read_doc, write_doc
from tests.test_incremental import assert_loads_as, frozen_and_trained, template
from tests.threads import on_threads

ROOT = Path(__file__).resolve().parent.parent
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


# ---- 6: copies and moves of an incremental step ---------------------------------------------------------------


def _unprotected(path: Path, holder: str) -> str:
    marker = rf"{REFERENCES_DIR}/{re.escape(path.name)}\.[0-9a-f]{{32}}\.json"
    return rf"{holder}.*no reference marker {marker}.*copied or moved"


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


# ---- 7: a retirement cut short after its record ------------------------------------------------------------------

CUT_AFTER_RECORD = textwrap.dedent(
    """
    import os, signal, sys
    import reshard
    from reshard.storage import LocalStorage
    from tests.test_incremental import frozen_and_trained

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


@pytest.mark.parametrize("case", ["secret_file", "data_name_in_a_plain_directory", "checkpoint_without_marker"])
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
    else:
        holder, target, size, match = "other", other_file.path, other_file.size, "other.*no reference marker"
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
