"""The benchmarks' scratch directories go however a run ends (issue 38 item 6): a killed ``compare.py`` left
6.2 GB in ``.reshard-bench-*`` inside the clone, because SIGTERM ends Python without running ``finally``.
``benchmarks/scratch.py`` turns SIGTERM and SIGHUP into SystemExit while the directory exists; these tests
send the real signals to real processes and look at what is left on disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from benchmarks.scratch import scratch_dir

    # Ctrl-C as a terminal delivers it: a test run started in the background (nohup, &) hands its children
    # SIGINT ignored, and Python keeps an ignored SIGINT ignored (no KeyboardInterrupt at all).
    signal.signal(signal.SIGINT, signal.default_int_handler)

    with scratch_dir(".reshard-bench-", sys.argv[1]) as work:
        (work / "data.bin").write_bytes(os.urandom(1 << 20))
        print(work, flush=True)
        if sys.argv[2] == "raise":
            raise RuntimeError("a failing benchmark")
        sys.stdin.readline()  # until the test's signal arrives (or stdin closes)
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("how", "code"),
    [("SIGTERM", 128 + signal.SIGTERM), ("SIGHUP", 128 + signal.SIGHUP), ("SIGINT", -signal.SIGINT), ("raise", 1)],
)
def test_the_scratch_directory_is_removed_on_a_signal_or_an_error(tmp_path: Path, how: str, code: int) -> None:
    command = [sys.executable, "-c", CHILD, str(tmp_path), how]
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    ) as child:
        assert child.stdout is not None and child.stderr is not None
        work = Path(child.stdout.readline().strip())
        assert work.parent == tmp_path
        if how != "raise":  # the child waits on its stdin with its scratch file written: then the signal
            assert (work / "data.bin").stat().st_size == 1 << 20
            child.send_signal(getattr(signal, how))
        # stdin stays open until the child has ended: its readline can only end by the signal. (communicate()
        # closed it at once, and a child scheduled late read the end of its input first, then ran its pending
        # SIGINT handler after its clean-up had set SIGINT to ignored: it exited 0 under load.)
        child.wait(timeout=50)
        err = child.stderr.read()
    assert child.returncode == code, err
    assert list(tmp_path.iterdir()) == []


def _rank_processes(pid: int) -> list[int]:
    """The spawned children of ``pid`` (its rank processes; not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(120)
def test_a_sigterm_to_a_running_compare_leaves_no_scratch_directory(tmp_path: Path) -> None:
    """A tiny compare.py in the default place (the current directory), killed with SIGTERM once its rank
    processes are working: it exits with 143, its rank processes are gone and nothing of its scratch
    directory is left."""
    command = [
        sys.executable, str(REPO / "benchmarks" / "compare.py"), "--size-gib", "0.004", "--repeat", "1",
        "--mode", "warm", "--systems", "limits,reshard", "--ranks", "2", "--load-world", "1",
    ]  # fmt: skip
    env = {**_env(), "PYTHONUNBUFFERED": "1"}
    ranks: list[int] = []
    with subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    ) as bench:
        try:
            assert bench.stderr is not None
            seen = []
            for line in bench.stderr:
                seen.append(line)
                if line.startswith("warm repetition 1/1"):
                    break
            assert seen and seen[-1].startswith("warm repetition"), "".join(seen)
            assert [p.name[:15] for p in tmp_path.iterdir()] == [".reshard-bench-"]  # the run is writing there
            ranks = _rank_processes(bench.pid)
            assert len(ranks) == 3  # the 2 saving ranks and the 1 of the world-size-change load
            bench.send_signal(signal.SIGTERM)
            code = bench.wait(timeout=60)
            survivors = [pid for pid in ranks if _alive(pid)]
        finally:
            for pid in ranks:  # what the benchmark should have stopped, so that a failure leaves nothing either
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM
    assert survivors == []
    assert list(tmp_path.iterdir()) == []
