"""The save lock: two writers cannot interleave on one checkpoint path; a crashed holder's lock is broken."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import reshard
from reshard.io.locking import LOCK_FILE, LockInfo, machine_identity, pid_namespace


def _plant_lock(path: Path, pid: int, created: float | None = None) -> None:
    path.mkdir(parents=True, exist_ok=True)
    info = LockInfo(
        host=socket.gethostname(),
        machine=machine_identity(),
        pid_namespace=pid_namespace(),
        pid=pid,
        token="someone-else",
        created=created or time.time(),
    )
    (path / LOCK_FILE).write_bytes(info.to_bytes())


@pytest.mark.unit
def test_a_live_writer_holds_the_path(tmp_path: Path) -> None:
    _plant_lock(tmp_path / "ckpt", os.getppid())  # a live process (our parent) holds it
    with pytest.raises(reshard.CheckpointLockedError, match=rf"being written by another save.*process {os.getppid()}"):
        reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "metadata.json").exists()
    with pytest.raises(reshard.IncompleteCheckpointError, match="a save is writing it or was interrupted"):
        reshard.load({"w": torch.zeros(2)}, tmp_path / "ckpt")


@pytest.mark.dist
def test_a_crashed_holders_lock_is_broken(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    _plant_lock(tmp_path / "ckpt", int(dead.stdout))  # that process has exited
    with caplog.at_level("WARNING", logger="reshard"):
        reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert "breaking the stale save lock" in caplog.text
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()  # released after the commit
    assert torch.equal(reshard.load({"w": torch.zeros(2)}, tmp_path / "ckpt")["w"], torch.ones(2))


@pytest.mark.unit
def test_an_old_lock_is_stale_whatever_its_holder(tmp_path: Path) -> None:
    _plant_lock(tmp_path / "ckpt", os.getppid(), created=time.time() - 48 * 3600)
    reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "metadata.json").exists()


@pytest.mark.unit
def test_a_failed_save_releases_its_lock(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    with pytest.raises(reshard.CheckpointExistsError):
        reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / LOCK_FILE).exists()
