"""A save whose process was killed (SIGKILL, mid-write of its data file) and what comes after it (issue 38 item 4).

Real processes and real files: a child process saves through :class:`tests.faults.FaultyStorage`, which kills it
with SIGKILL once part of its data file is on disk, leaving its lock (this host, its pid) and a partial data file.
Then, in the test process: ``reshard ls`` must say the writer is gone (not that the step is being written); a save
again at that path must leave only its own data files there (nothing of the dead save's bytes); ``reshard gc
--dry-run`` must say what it keeps and why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import reshard
from reshard.flows.manager import step_name
from reshard.io.locking import LockInfo, machine_identity, pid_namespace, this_process
from reshard.metadata import METADATA_FILE, Metadata

pytestmark = pytest.mark.dist

ROWS, COLS = 256, 1024  # 1 MiB of float32: the kill comes after 300 000 bytes of it

_CHILD = """
import sys, torch, reshard
from tests.faults import Fault, FaultyStorage
path, marker, overwrite = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
shape = (int(sys.argv[4]), int(sys.argv[5]))
state = {"w": reshard.ShardedTensor("w", torch.full(shape, 2.0), shape, (0, 0)), "step": 2}
if overwrite:  # a committed checkpoint first, which the killed save overwrites
    reshard.save({"w": reshard.ShardedTensor("w", torch.ones(shape), shape, (0, 0)), "step": 1}, path)
fault = Fault(point="mid_write", rank=0, after_bytes=300_000, marker=marker)
reshard.save(state, FaultyStorage(path, fault), overwrite=overwrite)
"""


_CHAIN_CHILD = """
import sys, torch, reshard
from reshard.net.transports import ThreadGroup
from tests.faults import Fault, FaultyStorage
from tests.threads import on_threads
path, marker, point, ranks = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
fault = Fault(point=point, rank=0, marker=marker)
def save(rank, group):
    piece = torch.full((4, 8), float(ranks + rank))
    tensor = reshard.ShardedTensor.from_rank_offsets("w", piece, (0, rank, ranks))
    return reshard.save({"w": tensor}, FaultyStorage(path, fault), group=group)
if ranks == 1:
    save(0, None)
else:
    group = ThreadGroup(ranks, timeout=60)
    on_threads(ranks, lambda rank: save(rank, group.member(rank)), group=group)
"""


def run_killed(path: Path, marker: Path, point: str, ranks: int) -> dict[str, object]:
    """Run a save of ``ranks`` ranks (threads of one child process) at ``path`` that SIGKILLs itself at ``point``;
    what its marker says."""
    argv = [sys.executable, "-c", _CHAIN_CHILD, str(path), str(marker), point, str(ranks)]
    child = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    _, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGKILL, err[-2000:]
    fired: dict[str, object] = json.loads(marker.read_text())
    assert fired["point"] == point and fired["pid"] == child.pid
    return fired


def state(value: float, step: int) -> dict[str, object]:
    return {"w": reshard.ShardedTensor("w", torch.full((ROWS, COLS), value), (ROWS, COLS), (0, 0)), "step": step}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reshard", *args], capture_output=True, text=True, timeout=120, check=False
    )


def data_files(path: Path) -> set[str]:
    return {f"data/{p.name}" for p in (path / "data").iterdir()}


def metadata_files(path: Path) -> set[str]:
    metadata = Metadata.from_json_bytes((path / METADATA_FILE).read_bytes())
    return {f.path for f in metadata.files if f.checkpoint is None}


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """Two saves killed with SIGKILL mid-write, each in its own process (run side by side): ``fresh``, the first
    save of step 2 of a manager root; ``overwrite``, an overwrite of a committed checkpoint. Each: (path, pid)."""
    base = tmp_path_factory.mktemp("killed")
    cases = {"fresh": base / "root" / step_name(2), "overwrite": base / "ckpt"}
    children = {}
    for name, path in cases.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        marker = base / f"{name}.marker.json"
        argv = [
            sys.executable,
            "-c",
            _CHILD,
            str(path),
            str(marker),
            "1" if name == "overwrite" else "0",
            str(ROWS),
            str(COLS),
        ]
        children[name] = (subprocess.Popen(argv, stderr=subprocess.PIPE, text=True), marker)
    out = {}
    for name, (child, marker) in children.items():
        _, err = child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL, err
        fired = json.loads(marker.read_text())
        assert fired["point"] == "mid_write" and fired["pid"] == child.pid
        out[name] = (cases[name], child.pid)
    return out


def copy_of(killed_path: Path, tmp_path: Path) -> Path:
    """A private copy of a killed save's directory (its manager root for a step), modification times kept."""
    source = killed_path.parent if killed_path.name.startswith("step_") else killed_path
    target = tmp_path / source.name
    shutil.copytree(source, target)
    return target / killed_path.name if source is not killed_path else target


def test_ls_says_a_dead_local_writer_is_gone(killed: dict[str, tuple[Path, int]]) -> None:
    """The lock a killed save left names this host and a process that no longer exists: ``reshard ls`` says the
    save was interrupted and its writer is gone (it said ``(locked: being written)``)."""
    path, pid = killed["fresh"]
    lock = LockInfo.from_bytes((path / ".lock").read_bytes())
    assert lock is not None and lock.pid == pid and lock.host == socket.gethostname()
    done = run_cli("ls", str(path.parent))
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if step_name(2) in line)
    assert "incomplete" in line and f"(interrupted: writer pid {pid} on this host is gone)" in line, line
    assert "being written" not in line, line
    listing = json.loads(run_cli("ls", str(path.parent), "--json").stdout)
    (step,) = listing["steps"]
    assert step["status"] == "incomplete" and step["locked"] is False and step["dead_writer_pid"] == pid


def test_a_save_again_carries_none_of_the_dead_saves_bytes(killed: dict[str, tuple[Path, int]], tmp_path: Path) -> None:
    """A save at the path of a killed one takes its stale lock over and leaves only its own data files: the dead
    save's partial file (no metadata lists it, its writer is gone) is removed."""
    path = copy_of(killed["fresh"][0], tmp_path)
    dead = data_files(path)
    assert len(dead) == 1 and (path / sorted(dead)[0]).stat().st_size > 0
    reshard.save(state(3.0, 2), path)
    assert data_files(path) == metadata_files(path), "the committed checkpoint carries the dead save's file"
    assert not dead & data_files(path)
    loaded = reshard.load(state(0.0, 0), path)
    assert torch.equal(loaded["w"], torch.full((ROWS, COLS), 3.0)) and loaded["step"] == 2


def test_an_overwrite_after_a_killed_overwrite_keeps_only_its_own_files(
    killed: dict[str, tuple[Path, int]], tmp_path: Path
) -> None:
    """A killed overwrite leaves the committed checkpoint, its own partial file and its lock; the next overwrite
    leaves exactly its own files (the replaced checkpoint's and the dead save's go)."""
    path = copy_of(killed["overwrite"][0], tmp_path)
    assert len(data_files(path)) == 2
    reshard.save(state(4.0, 2), path, overwrite=True)
    assert data_files(path) == metadata_files(path) and len(data_files(path)) == 1
    assert torch.equal(reshard.load(state(0.0, 0), path)["w"], torch.full((ROWS, COLS), 4.0))


def _lock_of_a_gone_process(path: Path, token: str) -> None:
    """The save lock of ``path`` as a save ``token`` of this machine whose process is gone left it."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    stale = LockInfo(
        host=socket.gethostname(),
        machine=machine_identity(),
        pid_namespace=pid_namespace(),
        pid=gone.pid,
        token=token,
        created=time.time(),
    )
    (path / ".lock").write_bytes(stale.to_bytes())


def test_a_dead_holder_of_a_committed_checkpoint_loses_no_file(tmp_path: Path) -> None:
    """A save that committed and died before releasing its lock: its files are the checkpoint's. A save at that
    path (refused: it exists) and one that overwrites it take the stale lock over; neither deletes a file the
    committed metadata lists before its own commit (the refused one deletes nothing)."""
    path = tmp_path / "ckpt"
    result = reshard.save(state(1.0, 1), path)
    _lock_of_a_gone_process(path, result.save_id)
    files = data_files(path)
    with pytest.raises(reshard.CheckpointExistsError):
        reshard.save(state(2.0, 2), path)
    assert data_files(path) == files == metadata_files(path)
    assert torch.equal(reshard.load(state(0.0, 0), path)["w"], torch.full((ROWS, COLS), 1.0))


def test_gc_dry_run_says_what_it_keeps_and_why(killed: dict[str, tuple[Path, int]], tmp_path: Path) -> None:
    """The killed overwrite's partial file is unreferenced but young: ``gc --dry-run`` keeps it and says so, naming
    the CLI's option (it said only ``nothing to collect``); with ``--min-age 0`` it would remove it."""
    path = copy_of(killed["overwrite"][0], tmp_path)
    done = run_cli("gc", str(path), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "kept 1 unreferenced data file younger than 1 h (--min-age)" in done.stdout, done.stdout
    assert data_files(path) - metadata_files(path), "a dry run removed a file"
    done = run_cli("gc", str(path), "--dry-run", "--min-age", "0")
    (dead,) = data_files(path) - metadata_files(path)
    assert f"would remove {dead}" in done.stdout and "kept" not in done.stdout, done.stdout
    assert os.path.exists(path / dead)


def test_a_save_killed_inside_the_dead_file_cleanup_leaves_nothing_of_either_dead_save(tmp_path: Path) -> None:
    """Found by the second outside attack (F2): save X (2 ranks, 2 data files) killed just before its commit; save A
    takes X's lock over, deletes the first of X's files and is killed; save B takes A's lock over. B removed A's files
    only (the lock no longer named X), and committed with X's second file in ``data/``. Every dead save a lock was
    taken over from is recorded in the taker's marker before anything is deleted, so B removes X's files too."""
    path = tmp_path / "ckpt"
    run_killed(path, tmp_path / "x.json", "in_commit", ranks=2)
    x_files = data_files(path)
    assert len(x_files) == 2 and not (path / METADATA_FILE).exists()
    fired = run_killed(path, tmp_path / "a.json", "after_data_delete", ranks=1)
    assert fired["file"] in x_files and len(data_files(path) & x_files) == 1  # A died inside the cleanup
    result = reshard.save(state(5.0, 3), path)
    assert data_files(path) == metadata_files(path), "the committed checkpoint carries a dead save's file"
    assert all(name.startswith(f"data/{result.save_id}-") for name in data_files(path))
    assert not (path / ".lock").exists() and not list(path.glob(".lock.*"))
    loaded = reshard.load(state(0.0, 0), path)
    assert torch.equal(loaded["w"], torch.full((ROWS, COLS), 5.0)) and loaded["step"] == 3


def test_a_refused_taker_still_removes_the_dead_saves_files(tmp_path: Path) -> None:
    """Issue 38 G6 (third outside attack): a plain save over a committed checkpoint took the stale lock of a dead
    overwrite save, was refused (CheckpointExistsError) and released the lock: the record of the dead save went
    with its marker, and its data file stayed for good (the next overwrite committed beside it). A taker removes the
    dead saves' files that no committed metadata lists before anything else, refused or not."""
    path = tmp_path / "ck"
    reshard.save(state(1.0, 1), path)
    committed = data_files(path)
    dead_id = "d" * 32
    (path / "data" / f"{dead_id}-r00000.bin").write_bytes(b"dead bytes")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    dead = dataclasses.replace(this_process(dead_id), pid=gone.pid, started=None)
    (path / ".lock").write_bytes(dead.to_bytes())
    with pytest.raises(reshard.CheckpointExistsError):
        reshard.save(state(2.0, 2), path)
    assert data_files(path) == committed, "the dead save's file outlived the taker that was refused"
    reshard.save(state(3.0, 3), path, overwrite=True)
    assert data_files(path) == metadata_files(path)


def _died_in_its_commit(path: Path, value: float) -> tuple[str, str]:
    """The state a save of ``path`` killed inside its commit leaves (a lock of a gone process naming its save id, and
    the commit's temporary holding its whole ``metadata.json``); the temporary's name, and a look-alike's name that
    is not reshard's (it must stay)."""
    doomed = reshard.save(state(value, 9), path.parent / "doomed")  # what the dead save's document would be
    _lock_of_a_gone_process(path, doomed.save_id)
    temporary, other = f".{METADATA_FILE}.tmp-{'a' * 32}", f".{METADATA_FILE}.tmp-{'b' * 32}"
    (path / temporary).write_bytes((path.parent / "doomed" / METADATA_FILE).read_bytes())
    (path / other).write_bytes(b"the user's notes, not a checkpoint's metadata")
    return temporary, other


@pytest.mark.parametrize("after", ["overwrite", "gc"])
def test_the_commit_temporary_of_a_save_killed_in_its_commit_is_removed(tmp_path: Path, after: str) -> None:
    """A save killed between writing its commit's temporary and linking it left ``.metadata.json.tmp-<hex>`` (a whole
    metadata document) that no later overwrite or gc removed: the save that takes the dead save's lock over, and gc,
    remove it (a file of that name that is not a reshard document stays)."""
    path = tmp_path / "ckpt"
    reshard.save(state(1.0, 1), path)
    temporary, other = _died_in_its_commit(path, 5.0)
    if after == "overwrite":
        reshard.save(state(2.0, 2), path, overwrite=True)
    else:
        done = run_cli("gc", str(path), "--min-age", "0")
        assert done.returncode == 0, done.stderr
        assert "1 commit temporary file" in done.stdout, done.stdout
    assert not (path / temporary).exists() and (path / other).exists()
    expected = 2.0 if after == "overwrite" else 1.0
    assert torch.equal(reshard.load(state(0.0, 0), path)["w"], torch.full((ROWS, COLS), expected))
    assert data_files(path) == metadata_files(path)
