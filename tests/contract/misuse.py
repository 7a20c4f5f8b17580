"""Concurrent misuse: what users and schedulers do that no flow's own tests assume.

- two jobs (real processes) saving steps into one root at the same time;
- an overwrite committed, and its old files deleted, while another process is in the middle of loading
  the checkpoint it replaces;
- a step copied or moved beside its siblings (``cp -r``, ``mv``), then retention and ``gc`` running.

Each returns the findings (empty: every guarantee held), judged by :mod:`tests.contract.guarantees`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from tests.contract import guarantees, states
from tests.contract.flows import check_root

WORLD = 2
REPO = Path(__file__).resolve().parents[2]

_JOB = """
import json, sys
from pathlib import Path
import reshard
from tests.contract import states
root, step, out = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
manager = reshard.CheckpointManager(root, keep_last=1, timeout=30)
sys.stdin.readline()  # the start line: both jobs are ready, the test releases them together
try:
    manager.save(step, states.single_process_state(step, 2))
    answer = {"ok": True}
except reshard.CheckpointError as exc:
    answer = {"error": type(exc).__name__, "message": str(exc)}
out.write_text(json.dumps(answer))
"""


def two_managers_on_one_root(place: Path) -> list[str]:
    """Two single-process jobs start saving steps 2 and 3 into one root at the same instant: each succeeds
    or raises a reshard error (a lock held), and the root is consistent afterwards."""
    import reshard

    root = place / "root"
    manager = reshard.CheckpointManager(root, keep_last=1)
    manager.save(1, states.single_process_state(1, WORLD))
    manager.close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", _JOB, str(root), str(step), str(place / f"answer-{step}.json")],
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE,
            text=True,
        )
        for step in (2, 3)
    ]
    for job in jobs:
        assert job.stdin is not None
        job.stdin.write("go\n")
        job.stdin.flush()
    findings = []
    for job in jobs:
        if job.wait(timeout=120) != 0:
            findings.append(f"a job exited with {job.returncode}")
    answers = {s: json.loads((place / f"answer-{s}.json").read_text()) for s in (2, 3)}
    done = [s for s, a in answers.items() if a.get("ok")]
    if not done:
        findings.append(f"neither job saved: {answers}")
    _, finding = check_root(root, WORLD, max(done) if done else None)
    if finding is not None:
        findings.append(f"{finding.status}: {finding.reason}")
    return findings


def overwrite_during_a_load(place: Path) -> list[str]:
    """A load has read ``metadata.json`` of A when another save overwrites the path with B and deletes A's
    files; the load goes on. It must return exactly A or raise a reshard error, never B's bytes or a mix."""
    import reshard
    from reshard.storage import LocalStorage

    path = place / "ckpt"
    flows_save(path, 1)
    read_metadata = LocalStorage.read_bytes
    loader = threading.current_thread()
    overwritten = threading.Event()

    def paused(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        data = read_metadata(self, name, *args, **kwargs)
        if threading.current_thread() is loader and name == "metadata.json" and not overwritten.is_set():
            writer = threading.Thread(target=flows_save, args=(path, 2), kwargs={"overwrite": True})
            writer.start()
            writer.join()
            overwritten.set()
        return data

    LocalStorage.read_bytes = paused  # type: ignore[method-assign]
    try:
        loaded = reshard.load(states.full_template(WORLD), path)
        generation = states.generation_of(loaded, WORLD, (1, 2))
        result = "exact" if generation == 1 else f"silent: the load returned generation {generation}"
    except reshard.CheckpointError as exc:
        result = f"error: {type(exc).__name__}"
    finally:
        LocalStorage.read_bytes = read_metadata  # type: ignore[method-assign]
    findings = [result] if result.startswith("silent") else []
    if not overwritten.is_set():
        findings.append("the overwrite never ran during the load")
    _, after = guarantees.loads_as(path, WORLD, (2,), what="the overwritten checkpoint")
    if after is not None:
        findings.append(f"{after.status}: {after.reason}")
    return findings


def flows_save(path: Path, generation: int, **kwargs: Any) -> None:
    import reshard

    reshard.save(states.single_process_state(generation, WORLD), path, **kwargs)


def copied_and_moved_steps(place: Path, how: str) -> list[str]:
    """A root of incremental steps 1-2 (step 2 references step 1's file); step 2 is copied (``cp -r``) or
    moved (``mv``) to step 5; then the manager saves step 6 (incremental) and step 7 (in full) with
    ``keep_last=1, keep_every=5`` (which keeps step 5), and ``gc`` runs on every step after each. The copy
    (or the moved step) must load exactly or be refused with a reshard error, at every point: never load
    once and then stop loading without having been deleted by the policy, never load other bytes. Every
    step the policy keeps loads."""
    import reshard
    from reshard.flows.maintenance import collect_garbage

    root = place / "root"
    manager = reshard.CheckpointManager(root, keep_last=2, incremental=True)
    for step in (1, 2):
        manager.save(step, states.single_process_state(step, WORLD))
    manager.close()
    moved = root / "step_000000005"
    (shutil.copytree if how == "copy" else shutil.move)(root / "step_000000002", moved)
    findings: list[str] = []
    loaded_once = False

    def observe(when: str) -> None:
        nonlocal loaded_once
        if not moved.exists():
            return
        generation, error = guarantees.load_generation(moved, WORLD, (1, 2, 6, 7))
        if generation is not None and generation != 2:
            findings.append(f"silent: the {how} of step 2 loads as generation {generation} {when}")
        elif generation == 2:
            loaded_once = True
        elif loaded_once:
            findings.append(f"lost: the {how} of step 2 loaded before, and {when} it does not: {error}")

    observe("right after the " + how)
    for step in (6, 7):
        # step 7 is a full save, so that nothing but the copy still needs step 1's file
        manager = reshard.CheckpointManager(root, keep_last=1, keep_every=5, incremental=step == 6)
        try:
            manager.save(step, states.single_process_state(step, WORLD))
        except reshard.CheckpointError as exc:
            findings.append(f"other: the save of step {step} failed: {type(exc).__name__}: {exc}")
        finally:
            manager.close()
        observe(f"after the save of step {step} and its retention")
        for directory in sorted(p for p in root.iterdir() if p.name.startswith("step_")):
            with contextlib.suppress(reshard.CheckpointError):
                collect_garbage(directory, min_age_s=0.0)
        observe(f"after gc following step {step}")
    _, finding = guarantees.loads_as(root / "step_000000007", WORLD, (7,), what="step 7")
    if finding is not None:
        findings.append(f"{finding.status}: {finding.reason}")
    return findings
