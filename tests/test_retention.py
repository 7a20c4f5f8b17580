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
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.cli import main as cli_main
from reshard.interop import CheckpointReader
from reshard.maintenance import validate_checkpoint
from reshard.manager import LATEST_FILE, scan_root, step_name
from reshard.references import REFERENCES_DIR, RETIRED_FILE
from reshard.storage import LocalStorage
from reshard.transports import ThreadGroup
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
