"""CheckpointManager: latest pointer, retention, fallback past broken checkpoints; validate and ls."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import reshard
from reshard.cli import main as cli_main
from reshard.io.locking import LOCK_FILE, LockInfo, machine_identity, pid_namespace


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((64,), float(step)), "trainer": {"step": step}}


def _template() -> dict[str, object]:
    return {"w": torch.zeros(64), "trainer": {"step": -1}}


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``reshard ARGS`` in this process (the entry point itself is run as a program in tests/cli/test_cli.py)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return subprocess.CompletedProcess(["reshard", *args], code, out.getvalue(), err.getvalue())


@pytest.mark.unit
def test_retention_latest_and_load(tmp_path: Path) -> None:
    manager = reshard.CheckpointManager(tmp_path, keep_last=2, keep_every=2)
    for step in range(1, 6):
        manager.save(step, _state(step))
    assert manager.steps() == [2, 4, 5]  # the 2 newest, plus every 2nd step
    assert manager.latest_pointer() == 5
    template = _template()
    found = manager.load_latest_with_state(template)
    assert found is not None
    step, loaded = found
    assert step == 5 and loaded["trainer"] == {"step": 5} and torch.equal(template["w"], torch.full((64,), 5.0))
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.unit
def test_fallback_past_corrupt_and_incomplete_checkpoints(tmp_path: Path) -> None:
    manager = reshard.CheckpointManager(tmp_path)
    for step in (10, 20, 30):
        manager.save(step, _state(step))
    newest = reshard.read_metadata(manager.path_of(30))
    data = tmp_path / "step_000000030" / newest.files[0].path
    raw = bytearray(data.read_bytes())
    raw[newest.tensors["w"].boxes[0].byte_offset + 5] ^= 1
    data.write_bytes(bytes(raw))
    (tmp_path / "step_000000020" / "metadata.json").unlink()  # an interrupted save
    with pytest.warns(UserWarning, match="skipping checkpoint") as caught:
        assert manager.load_latest(_template()) == 10
    reasons = [str(w.message) for w in caught]
    assert len(reasons) == 2 and "step_000000030" in reasons[0] and "checksum mismatch" in reasons[0]
    assert "step_000000020" in reasons[1] and "no metadata.json" in reasons[1]
    assert manager.steps() == [10, 30]  # 30 is committed (its damage is found by reading it)
    assert reshard.CheckpointManager(tmp_path / "empty").load_latest(_template()) is None


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
    )
    return int(done.stdout)


@pytest.mark.dist
def test_retention_removes_old_leftovers_but_not_newer_or_live_ones(tmp_path: Path) -> None:
    """What a save that died leaves (its data file, its lock naming its save) is removed once older than the
    newest complete step; a newer one, a running one, and files that no save's lock or record ties to a save
    (named like data files, but no lock) stay."""
    manager = reshard.CheckpointManager(tmp_path, keep_last=1)
    manager.save(1, _state(1))
    dead = _dead_pid()
    for leftover in ("step_000000002", "step_000000009"):  # an interrupted save before and after step 5
        save_id = uuid.uuid4().hex
        (tmp_path / leftover / "data").mkdir(parents=True)
        (tmp_path / leftover / "data" / f"{save_id}-r00000.bin").write_bytes(b"partial")
        info = LockInfo(
            host=socket.gethostname(),
            machine=machine_identity(),
            pid_namespace=pid_namespace(),
            pid=dead,
            token=save_id,
            created=time.time(),
        )
        (tmp_path / leftover / LOCK_FILE).write_bytes(info.to_bytes())
    untied = tmp_path / "step_000000004" / "data" / f"{uuid.uuid4().hex}-r00000.bin"
    untied.parent.mkdir(parents=True)
    untied.write_bytes(b"no lock names this save")
    live = tmp_path / "step_000000003"
    (live / "data").mkdir(parents=True)
    info = LockInfo(
        host=socket.gethostname(),
        machine=machine_identity(),
        pid_namespace=pid_namespace(),
        pid=os.getppid(),
        token="t",
        created=time.time(),
    )
    (live / LOCK_FILE).write_bytes(info.to_bytes())  # a save that is running right now
    manager.save(5, _state(5))
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_"))
    assert names == ["step_000000003", "step_000000004", "step_000000005", "step_000000009"]
    assert untied.read_bytes() == b"no lock names this save"


@pytest.mark.unit
def test_two_managers_on_one_root_cannot_interleave(tmp_path: Path) -> None:
    info = LockInfo(
        host=socket.gethostname(),
        machine=machine_identity(),
        pid_namespace=pid_namespace(),
        pid=os.getppid(),
        token="other",
        created=time.time(),
    )
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / LOCK_FILE).write_bytes(info.to_bytes())  # another manager is saving
    with pytest.raises(reshard.CheckpointLockedError, match="manager lock"):
        reshard.CheckpointManager(tmp_path).save(1, _state(1))
    assert not (tmp_path / "step_000000001").exists()


@pytest.mark.unit
def test_validate_and_ls_commands(tmp_path: Path) -> None:
    manager = reshard.CheckpointManager(tmp_path)
    manager.save(1, _state(1))
    manager.save(2, _state(2))
    path = tmp_path / "step_000000002"
    good = _run_cli("validate", str(path))
    assert good.returncode == 0 and "OK (presence, sizes and every checksum checked)" in good.stdout
    metadata = reshard.read_metadata(path)
    data = path / metadata.files[0].path
    raw = bytearray(data.read_bytes())
    raw[metadata.tensors["w"].boxes[0].byte_offset] ^= 0x40
    data.write_bytes(bytes(raw))
    bad = _run_cli("validate", str(path))
    assert bad.returncode == 1
    assert "PROBLEM: tensor 'w' box at [0]: checksum mismatch in data file" in bad.stdout and data.name in bad.stdout
    assert _run_cli("validate", "--quick", str(path)).returncode == 0  # sizes are right
    data.write_bytes(bytes(raw[:-3]))
    quick = _run_cli("validate", "--quick", str(path))
    assert quick.returncode == 1 and "has" in quick.stdout and "the metadata says" in quick.stdout
    (tmp_path / "step_000000001" / "metadata.json").unlink()
    listing = _run_cli("ls", str(tmp_path), "--json")
    assert listing.returncode == 0, listing.stderr
    doc = json.loads(listing.stdout)
    assert doc["latest"] == 2
    assert [(s["step"], s["status"]) for s in doc["steps"]] == [(1, "incomplete"), (2, "complete")]
    text = _run_cli("ls", str(tmp_path))
    assert "step_000000002  complete" in text.stdout and "(latest)" in text.stdout
    incomplete = _run_cli("validate", str(tmp_path / "step_000000001"))
    assert incomplete.returncode == 1 and "interrupted" in incomplete.stdout
