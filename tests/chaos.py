"""Chaos runs: SIGKILL one rank of a real multi-process save at a chosen point, then check the invariants.

One *iteration* starts ``world`` fresh processes (forked from a forkserver that has imported torch and
reshard, so starting them costs tens of milliseconds rather than seconds), forms a gloo group, and runs one
save *scenario* over a checkpoint that already holds a committed state A, saving state B:

- ``overwrite``: ``reshard.save(B, path, overwrite=True)``;
- ``async``: ``AsyncCheckpointer.save(B, path, overwrite=True)`` then ``wait()``;
- ``fresh``: ``reshard.save(B, new_path)`` (nothing there before);
- ``manager``: ``CheckpointManager(root, keep_last=1).save(2, B)`` on a root whose step 1 holds A.

One rank (the *victim*) SIGKILLs itself at a *kill point*: the ``k``-th event of its save, before or after
it. Events are every collective (gather, broadcast, scatter) and every storage operation (creating,
writing, fsyncing, committing, deleting, listing, reading a file) that the rank makes, counted by
wrappers installed in the victim's process around the real methods (nothing is mocked: the wrapper only
adds ``os.kill(os.getpid(), SIGKILL)`` at its point). A dry run of each scenario lists every rank's events,
so a run can visit every phase boundary of every rank systematically; a *timed* kill point instead kills
after a seeded random delay, anywhere.

After the survivors have answered (bounded: a hang fails the iteration), the parent process checks, with
reshard's public API and its command line:

- the newest committed checkpoint loads **bit-exactly** as A or B (B if any survivor reported success or
  the commit as done); ``fresh`` may also be incomplete (never corrupt); ``manager``'s ``latest.json`` names
  a complete step, and the newest complete step is the one a load finds;
- ``reshard validate`` passes exactly the checkpoints that load, and ``reshard ls`` calls complete exactly
  the steps that load;
- a later save to the same path or root succeeds (a dead holder's lock does not block it) and loads.

Outcomes per iteration: ``clean`` (every invariant held), ``lost`` (no loadable checkpoint where the
previous one or a committed one should be), ``silent`` (a load returned other bytes than A's or B's), or
``violation`` (another invariant failed, with the reason).
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

SCENARIOS = ("overwrite", "async", "fresh", "manager")
ROWS, COLS = 8, 64
COLLECTIVE_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 90.0


# ---- the states ----------------------------------------------------------------------------------------


def global_state(generation: int, world: int) -> dict[str, torch.Tensor]:
    """The global tensors of generation ``generation`` (A is 1, B is 2; a later save 3)."""
    g = torch.Generator().manual_seed(1000 * generation + world)
    return {
        "w": torch.randn(world * ROWS, COLS, generator=g),
        "e": torch.randn(ROWS, world * 4, generator=g).to(torch.bfloat16),
        "bias": torch.randint(-(2**40), 2**40, (17,), generator=g, dtype=torch.int64),
    }


def rank_state(rank: int, world: int, generation: int) -> dict[str, Any]:
    import reshard

    full = global_state(generation, world)
    return {
        "w": reshard.ShardedTensor.from_rank_offsets(
            "w", full["w"][rank * ROWS : (rank + 1) * ROWS].clone(), (0, rank, world)
        ),
        "e": reshard.ShardedTensor.from_rank_offsets(
            "e", full["e"][:, rank * 4 : (rank + 1) * 4].clone(), (1, rank, world)
        ),
        "bias": full["bias"].clone(),
        "rng": reshard.ShardedObject("rng", {"rank": rank, "generation": generation}, (world,), (rank,)),
        "step": generation,
    }


def full_template(world: int) -> dict[str, Any]:
    import reshard

    return {
        "w": torch.zeros(world * ROWS, COLS),
        "e": torch.zeros(ROWS, world * 4, dtype=torch.bfloat16),
        "bias": torch.zeros(17, dtype=torch.int64),
        "rng": reshard.ShardedObject("rng", None, (world,), (0,)),
        "step": -1,
    }


def generation_of(loaded: dict[str, Any], world: int, candidates: tuple[int, ...]) -> int | None:
    """Which generation ``loaded`` is, bit for bit (None: none of them, a silent wrong load)."""
    for generation in candidates:
        want = global_state(generation, world)
        same = all(
            torch.equal(loaded[k].contiguous().view(torch.uint8), want[k].contiguous().view(torch.uint8)) for k in want
        )
        if same and loaded["step"] == generation and loaded["rng"] == {"rank": 0, "generation": generation}:
            return generation
    return None


# ---- kill points and the events they count ---------------------------------------------------------------


@dataclass(frozen=True)
class KillPoint:
    """Kill global rank ``rank`` at its ``index``-th event (``when``: 'before' or 'after' it), or, with
    ``delay_s`` set, after that many seconds of its save."""

    rank: int
    index: int = -1
    when: str = "before"
    delay_s: float | None = None
    wait_for: str = ""
    """At the point, first wait (bounded) until this file of the checkpoint appears or changes: 'metadata.json'
    (the coordinator has committed) or '.lock' (the coordinator holds the save lock). For regression tests
    that need the victim to die exactly after another rank's step."""

    def describe(self) -> str:
        if self.delay_s is not None:
            return f"rank {self.rank} after {self.delay_s * 1000:.0f} ms"
        waits = f", once {self.wait_for} is written" if self.wait_for else ""
        return f"rank {self.rank} {self.when} event {self.index}{waits}"


_SAVE_ID = re.compile(r"[0-9a-f]{32}")


class _Events:
    """Counts this process's events; kills it at the kill point (see the module doc), or holds it at a
    hold point until the victim has died."""

    def __init__(
        self,
        point: KillPoint | None,
        marker: Path | None,
        checkpoint: Path | None = None,
        hold: KillPoint | None = None,
        victim_marker: Path | None = None,
    ) -> None:
        self.point = point
        self.marker = marker
        self.checkpoint = checkpoint
        self.hold = hold
        self.victim_marker = victim_marker
        self.names: list[str] = []
        self.armed = False
        self.before = self._watched()

    def _watched(self) -> bytes | None:
        if self.point is None or not self.point.wait_for or self.checkpoint is None:
            return None
        with contextlib.suppress(OSError):
            return (self.checkpoint / self.point.wait_for).read_bytes()
        return None

    def _wait(self) -> None:
        """Until the watched file differs from what it was when the save started (at most 30 s)."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and self._watched() == self.before:
            threading.Event().wait(0.005)

    def hit(self, name: str, when: str) -> None:
        if not self.armed:
            return
        if when == "before":
            self.names.append(_SAVE_ID.sub("<id>", name))
        hold = self.hold
        if hold is not None and hold.index == len(self.names) - 1 and hold.when == when and self.victim_marker:
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline and not _victim_dead(self.victim_marker):
                threading.Event().wait(0.005)
        point = self.point
        if point is not None and point.delay_s is None and point.index == len(self.names) - 1 and point.when == when:
            if point.wait_for:
                self._wait()
            self.kill(f"{when} {self.names[-1]}")

    def kill(self, where: str) -> None:
        if self.marker is not None:
            self.marker.write_text(json.dumps({"where": where, "events": len(self.names), "pid": os.getpid()}))
        os.kill(os.getpid(), signal.SIGKILL)


def _victim_dead(marker: Path) -> bool:
    """Whether the victim that wrote ``marker`` has died (its process is gone or a zombie)."""
    try:
        pid = json.loads(marker.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _wrap(owner: type, name: str, events: _Events, label: Callable[..., str]) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        what = label(self, *args, **kwargs)
        events.hit(what, "before")
        result = original(self, *args, **kwargs)
        events.hit(what, "after")
        return result

    setattr(owner, name, wrapper)


def instrument(events: _Events) -> None:
    """Install the event wrappers in this process (a chaos worker; never in the test process)."""
    from reshard.comm import Communicator
    from reshard.storage import LocalStorage
    from reshard.storage.local import _LocalWriter

    for method in ("gather_bytes", "broadcast_bytes", "scatter_bytes"):
        _wrap(Communicator, method, events, lambda self, *a, m=method, **k: m)
    for method in ("open_writer", "commit", "delete", "delete_prefix", "sync_dir", "read_bytes", "prepare_root"):
        _wrap(LocalStorage, method, events, lambda self, name="", *a, m=method, **k: f"{m} {name}")
    for method in ("list_files", "list_names", "exists", "size"):
        _wrap(LocalStorage, method, events, lambda self, name="", *a, m=method, **k: f"{m} {name}")
    _wrap(_LocalWriter, "write", events, lambda self, data: f"write {self.path.name}")
    _wrap(_LocalWriter, "commit", events, lambda self: f"fsync {self.path.name}")


# ---- one iteration ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Iteration:
    scenario: str
    world: int
    point: KillPoint | None
    directory: str
    """A fresh directory for this iteration: the checkpoint (or root) is ``directory/ckpt``."""
    hold: KillPoint | None = None
    """Another rank that waits at this event until the victim has died (to order two ranks' steps)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare(iteration: Iteration) -> None:
    """In the parent: state A, committed, where the scenario expects it (one process wrote it)."""
    path = Path(iteration.directory) / "ckpt"
    if iteration.scenario in ("overwrite", "async"):
        _save_single(path, 1, iteration.world)
    elif iteration.scenario == "manager":
        _save_single(path / "step_000000001", 1, iteration.world)
        (path / "latest.json").write_text(json.dumps({"step": 1, "path": "step_000000001"}))


def _save_single(path: Path, generation: int, world: int) -> None:
    """Generation ``generation`` of a ``world``-rank job saved by one process (the same global content)."""
    import reshard

    full = global_state(generation, world)
    state: dict[str, Any] = dict(full)
    state["rng"] = [
        reshard.ShardedObject("rng", {"rank": r, "generation": generation}, (world,), (r,)) for r in range(world)
    ]
    state["step"] = generation
    reshard.save(state, path)


def _worker(rank: int, port: int, spec: dict[str, Any], answer_path: Path) -> None:
    import torch.distributed as dist

    import reshard

    iteration = Iteration(
        scenario=spec["scenario"],
        world=spec["world"],
        point=KillPoint(**spec["point"]) if spec["point"] else None,
        directory=spec["directory"],
        hold=KillPoint(**spec["hold"]) if spec["hold"] else None,
    )
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=iteration.world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    mine = iteration.point if iteration.point is not None and iteration.point.rank == rank else None
    path = Path(iteration.directory) / "ckpt"
    held = iteration.hold if iteration.hold is not None and iteration.hold.rank == rank else None
    victim = Path(iteration.directory) / f"killed-{iteration.point.rank}.json" if iteration.point else None
    events = _Events(mine, Path(iteration.directory) / f"killed-{rank}.json" if mine else None, path, held, victim)
    instrument(events)
    state = rank_state(rank, iteration.world, 2)
    answer: dict[str, Any] = {}
    started = time.monotonic()
    if mine is not None and mine.delay_s is not None:
        timer = threading.Timer(mine.delay_s, events.kill, args=(f"after {mine.delay_s:.3f} s",))
        timer.daemon = True
    else:
        timer = None
    try:
        events.armed = True
        if timer is not None:
            timer.start()
        if iteration.scenario == "overwrite":
            reshard.save(state, path, overwrite=True, timeout=COLLECTIVE_TIMEOUT_S)
        elif iteration.scenario == "fresh":
            reshard.save(state, path, timeout=COLLECTIVE_TIMEOUT_S)
        elif iteration.scenario == "async":
            checkpointer = reshard.AsyncCheckpointer(timeout=COLLECTIVE_TIMEOUT_S)
            checkpointer.save(state, path, overwrite=True).wait()
        else:
            manager = reshard.CheckpointManager(path, keep_last=1, timeout=COLLECTIVE_TIMEOUT_S)
            manager.save(2, state)
        answer["ok"] = True
    except reshard.CheckpointError as exc:
        answer.update(error=type(exc).__name__, message=str(exc))
    except BaseException as exc:  # reported: an exception that is not reshard's is itself a finding
        answer.update(error=type(exc).__name__, message=str(exc), other="".join(traceback.format_exception(exc)))
    finally:
        events.armed = False
        if timer is not None:
            timer.cancel()
    answer.update(rank=rank, seconds=time.monotonic() - started, events=events.names)
    temp = answer_path.with_suffix(".tmp")
    temp.write_text(json.dumps(answer))
    temp.rename(answer_path)  # whole, or not at all
    os._exit(0)  # never tear down a group with dead members


@dataclass
class Outcome:
    """What one iteration found."""

    scenario: str
    world: int
    point: str
    killed: bool
    status: str
    """'clean', 'lost', 'silent' or 'violation'."""
    reason: str = ""
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    loaded: int | None = None
    """The generation the checkpoint loaded as (None: it did not load)."""
    seconds: float = 0.0


class _Zygote:
    """A process that has imported torch and reshard once and forks a fresh rank process per request, so
    that starting the ranks of an iteration costs milliseconds (a spawned process would import torch, and
    the test runner's main module, again). Requests and exit reports are JSON lines on its stdin/stdout."""

    def __init__(self) -> None:
        here = Path(__file__).resolve().parent.parent
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from tests.chaos import zygote_main; zygote_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.exits: dict[int, int] = {}
        self.lock = threading.Lock()
        self.started: queue.Queue[int] = queue.Queue()
        self.reader = threading.Thread(target=self._read, name="chaos-zygote", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            doc = json.loads(line)
            if "started" in doc:
                self.started.put(int(doc["started"]))
            else:
                with self.lock:
                    self.exits[int(doc["pid"])] = int(doc["code"])

    def fork(self, rank: int, port: int, spec: dict[str, Any], answer_path: Path) -> int:
        """Start rank ``rank`` of an iteration; its pid."""
        assert self.process.stdin is not None
        request = {"rank": rank, "port": port, "spec": spec, "answer": str(answer_path)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.started.get(timeout=60)

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            return self.exits.get(pid)


def zygote_main() -> None:
    """The zygote's loop (see :class:`_Zygote`): read a request, fork, report the child's pid and later its
    exit status (a negative signal number when killed)."""
    import torch.distributed

    import reshard  # noqa: F401

    torch.set_num_threads(1)
    children: set[int] = set()
    # Reading stdin in a thread would make the forks multi-threaded: poll it from this thread instead.
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ)
    out = sys.stdout
    while True:
        for _key, _ in selector.select(timeout=0.05):
            line = sys.stdin.readline()
            if not line:
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                selector.close()
                try:
                    _worker(request["rank"], request["port"], request["spec"], Path(request["answer"]))
                finally:
                    os._exit(1)
            children.add(pid)
            out.write(json.dumps({"started": pid}) + "\n")
            out.flush()
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                out.write(json.dumps({"pid": pid, "code": code}) + "\n")
                out.flush()


_ZYGOTE: list[_Zygote] = []


def _zygote() -> _Zygote:
    if not _ZYGOTE or _ZYGOTE[0].process.poll() is not None:
        _ZYGOTE[:] = [_Zygote()]
    return _ZYGOTE[0]


def run_workers(iteration: Iteration) -> tuple[dict[int, dict[str, Any]], dict[int, int | None], bool]:
    """Start the ranks of ``iteration``, collect every survivor's answer (bounded), end every process.
    Returns the answers by rank, the exit codes, and whether every survivor answered in time."""
    zygote = _zygote()
    port = _free_port()
    spec = {
        "scenario": iteration.scenario,
        "world": iteration.world,
        "point": asdict(iteration.point) if iteration.point else None,
        "directory": iteration.directory,
        "hold": asdict(iteration.hold) if iteration.hold else None,
    }
    directory = Path(iteration.directory)
    paths = {r: directory / f"answer-{r}.json" for r in range(iteration.world)}
    pids = {r: zygote.fork(r, port, spec, paths[r]) for r in range(iteration.world)}
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    in_time = True
    while True:
        ended = {r for r, pid in pids.items() if zygote.exit_code(pid) is not None}
        answered = {r for r, path in paths.items() if path.exists()}
        if answered | ended == set(pids):
            break
        if time.monotonic() > deadline:
            in_time = False
            break
        threading.Event().wait(0.005)  # polling the answers' files, with a deadline
    for pid in pids.values():
        if zygote.exit_code(pid) is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    got = {r: json.loads(path.read_text()) for r, path in paths.items() if path.exists()}
    return got, {r: zygote.exit_code(pid) for r, pid in pids.items()}, in_time


def _cli(*args: str) -> tuple[int, str]:
    from reshard.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(args))
    return code, out.getvalue()


def _load_generation(path: Path, world: int) -> tuple[int | None, BaseException | None]:
    """Load ``path`` whole: the generation it holds (None and the error when it does not load)."""
    import reshard

    try:
        loaded = reshard.load(full_template(world), path)
    except reshard.CheckpointError as exc:
        return None, exc
    generation = generation_of(loaded, world, (1, 2, 3))
    return (generation if generation is not None else -1), None


def check(iteration: Iteration, answers: dict[int, dict[str, Any]], in_time: bool, killed: bool) -> Outcome:
    """The invariants of the module doc, after an iteration."""
    import reshard

    point = iteration.point.describe() if iteration.point else "none"
    outcome = Outcome(iteration.scenario, iteration.world, point, killed, "clean", answers=answers)
    root = Path(iteration.directory) / "ckpt"
    others = [a for a in answers.values() if "other" in a]
    if others:
        return _fail(outcome, "violation", f"a non-reshard exception: {others[0]['other'][-400:]}")
    if not in_time:
        return _fail(outcome, "violation", f"the survivors did not all answer within {ANSWER_TIMEOUT_S} s (a hang)")
    confirmed = any(a.get("ok") or a.get("error") == "UnconfirmedCommitError" for a in answers.values())
    if iteration.scenario == "manager":
        path = _newest_complete(root, iteration.world)
        if path is None:
            return _fail(outcome, "lost", "no step of the root loads")
        step = int(path.name.split("_")[1])
        generation, error = _load_generation(path, iteration.world)
        outcome.loaded = generation
        if generation != step:
            return _fail(
                outcome, "silent" if generation == -1 else "violation", f"{path.name} loads as {generation}: {error}"
            )
        if confirmed and step != 2:
            return _fail(outcome, "lost", "a rank reported step 2 saved, but the newest loadable step is 1")
        latest = reshard.CheckpointManager(root).latest_pointer()
        latest_ok, _ = _load_generation(root / f"step_{latest:09d}", iteration.world) if latest else (None, None)
        if latest_ok is None or latest_ok != latest:
            return _fail(outcome, "violation", f"latest.json names step {latest}, which does not load")
        code, text = _cli("ls", str(root), "--json")
        listed = {s["step"]: s["status"] for s in json.loads(text)["steps"]} if code == 0 else {}
        for name in sorted(p.name for p in root.iterdir() if p.name.startswith("step_")):
            loads = _load_generation(root / name, iteration.world)[0] is not None
            status = listed.get(int(name.split("_")[1]))
            if (status == "complete") != loads:
                return _fail(outcome, "violation", f"reshard ls says {name} is {status}, a load says {loads}")
            if loads and _cli("validate", str(root / name))[0] != 0:
                return _fail(outcome, "violation", f"{name} loads but reshard validate fails")
        follow_up = root
    else:
        generation, error = _load_generation(root, iteration.world)
        outcome.loaded = generation
        validated = _cli("validate", str(root))[0] == 0
        if generation == -1:
            return _fail(outcome, "silent", "the checkpoint loaded as neither A nor B")
        if generation is None:
            incomplete = isinstance(error, reshard.IncompleteCheckpointError | reshard.CheckpointNotFoundError)
            if iteration.scenario != "fresh" or not incomplete:
                return _fail(outcome, "lost", f"nothing loads: {error}")
            if confirmed:
                return _fail(outcome, "lost", f"a rank reported the save done, yet: {error}")
        elif confirmed and generation != 2:
            return _fail(outcome, "lost", f"a rank reported the save done, yet the checkpoint holds {generation}")
        if validated != (generation is not None):
            return _fail(outcome, "violation", f"reshard validate says {validated}, the load {generation}")
        follow_up = root
    problem = _follow_up(follow_up, iteration)
    if problem:
        return _fail(outcome, "violation", problem)
    return outcome


def _newest_complete(root: Path, world: int) -> Path | None:
    steps = sorted((p for p in root.iterdir() if p.name.startswith("step_")), reverse=True)
    for path in steps:
        if _load_generation(path, world)[0] is not None:
            return path
    return None


def _follow_up(path: Path, iteration: Iteration) -> str:
    """A later save to the same place, from this process, must succeed and load (no lock of a dead process
    blocks it)."""
    import reshard

    world = iteration.world
    full = global_state(3, world)
    state: dict[str, Any] = dict(full)
    state["rng"] = [reshard.ShardedObject("rng", {"rank": r, "generation": 3}, (world,), (r,)) for r in range(world)]
    state["step"] = 3
    try:
        if iteration.scenario == "manager":
            manager = reshard.CheckpointManager(path, keep_last=1)
            manager.save(3, state)
            target = path / "step_000000003"
        else:
            reshard.save(state, path, overwrite=True)
            target = path
    except reshard.CheckpointError as exc:
        return f"a later save failed: {type(exc).__name__}: {exc}"
    generation, error = _load_generation(target, world)
    return "" if generation == 3 else f"the later save loads as {generation}: {error}"


def _fail(outcome: Outcome, status: str, reason: str) -> Outcome:
    outcome.status = status
    outcome.reason = reason
    return outcome


def run_iteration(iteration: Iteration) -> Outcome:
    """Prepare, run and check one iteration."""
    started = time.monotonic()
    prepare(iteration)
    answers, _codes, in_time = run_workers(iteration)
    victim = iteration.point.rank if iteration.point else None
    killed = victim is not None and (Path(iteration.directory) / f"killed-{victim}.json").exists()
    outcome = check(iteration, answers, in_time, killed)
    outcome.seconds = time.monotonic() - started
    return outcome


def dry_run(scenario: str, world: int, directory: Path) -> tuple[dict[int, list[str]], float]:
    """The events of every rank in one save of ``scenario`` without a kill, and the save's duration."""
    directory.mkdir(parents=True, exist_ok=True)
    iteration = Iteration(scenario, world, None, str(directory))
    prepare(iteration)
    answers, _codes, in_time = run_workers(iteration)
    if not in_time or len(answers) != world or not all(a.get("ok") for a in answers.values()):
        raise RuntimeError(f"the dry run of {scenario} on {world} ranks failed: {answers}")
    remove(str(directory))
    return {rank: answers[rank]["events"] for rank in range(world)}, max(a["seconds"] for a in answers.values())


def kill_points(events: dict[int, list[str]]) -> list[KillPoint]:
    """Every event of every rank, before and after: the systematic kill points."""
    return [
        KillPoint(rank=rank, index=i, when=when)
        for rank, names in sorted(events.items())
        for i in range(len(names))
        for when in ("before", "after")
    ]


def plan(
    scenarios: tuple[tuple[str, int], ...],
    base: Path,
    *,
    seed: int,
    systematic: int | None,
    timed: int,
) -> Iterator[Iteration]:
    """Iterations over ``scenarios`` ((scenario, world) pairs): for each, ``systematic`` kill points (None: all):
    the coordinator's just before and just after its commit of ``metadata.json`` (the point of no return, so
    that a sample always reaches both outcomes of a save), the others drawn (seeded) from the rest; and
    ``timed`` kills at random delays within the dry run's span."""
    rng = random.Random(seed)
    count = 0
    for scenario, world in scenarios:
        events, seconds = dry_run(scenario, world, base / f"dry-{scenario}-{world}")
        points = kill_points(events)
        if systematic is not None and systematic < len(points):
            commit = next((i for i, name in enumerate(events[0]) if name == "commit metadata.json"), None)
            pinned = [] if commit is None else [KillPoint(rank=0, index=commit, when=w) for w in ("before", "after")]
            rest = [p for p in points if p not in pinned]
            points = pinned[:systematic] + rng.sample(rest, max(0, systematic - len(pinned)))
        span = 1.5 * seconds
        for _ in range(timed):
            points.append(KillPoint(rank=rng.randrange(world), delay_s=rng.uniform(0.0, span)))
        for point in points:
            count += 1
            directory = base / f"it-{count:05d}"
            directory.mkdir(parents=True)
            yield Iteration(scenario, world, point, str(directory))


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """The figures docs/reliability.md quotes."""
    by_status: dict[str, int] = {}
    for o in outcomes:
        by_status[o.status] = by_status.get(o.status, 0) + 1
    return {
        "tried": len(outcomes),
        "killed": sum(o.killed for o in outcomes),
        "clean": by_status.get("clean", 0),
        "lost": by_status.get("lost", 0),
        "silent": by_status.get("silent", 0),
        "violations": by_status.get("violation", 0),
        "committed_new": sum(o.loaded == 2 for o in outcomes),
        "kept_old": sum(o.loaded == 1 for o in outcomes),
        "by_scenario": {s: sum(1 for o in outcomes if o.scenario == s) for s in sorted({o.scenario for o in outcomes})},
        "failures": [asdict(o) for o in outcomes if o.status != "clean"][:20],
    }


def remove(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
