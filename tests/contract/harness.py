"""The kill harness: run one flow on fresh rank processes, SIGKILL one of them at a chosen point, and check
the guarantees afterwards.

One *iteration* forks ``world`` fresh processes from a zygote that has imported torch and reshard (a
millisecond each, where spawning costs seconds), forms a gloo group, and runs one flow
(:mod:`tests.contract.flows`) over what its ``prepare`` left on disk. One rank (the *victim*) SIGKILLs itself
before or after its ``index``-th event (:mod:`tests.contract.events`), or after a seeded random delay. A dry
run lists every rank's events, so a long run visits every event of every rank. A flow that restores after a
death (the peer-memory tier) *regroups*: once every survivor has answered, the harness hands the survivors
a new group on a new port, as a job's restart would.

After the survivors have answered (bounded: a hang is a finding), :func:`check` applies the guarantees of
:mod:`tests.contract.guarantees`: the generic ones (no hang, reshard errors only, the same error on every
rank, nothing touched outside the flow's places, the user's files intact), then the flow's own
(what must load, as what).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.contract import guarantees
from tests.contract.events import Events, KillPoint, instrument
from tests.contract.flows import FLOWS, ForeignFailure, RankRun

COLLECTIVE_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 90.0
HARNESS_DIR = "harness"
"""Where in an iteration's directory the harness keeps its own files (answers, kill markers)."""


@dataclass(frozen=True)
class Iteration:
    flow: str
    world: int
    point: KillPoint | None
    directory: str
    """A fresh directory for this iteration; the flow's places lie in it."""
    hold: KillPoint | None = None
    """Another rank that waits at this event until the victim has died (to order two ranks' steps)."""


@dataclass
class Outcome:
    """What one iteration found."""

    flow: str
    world: int
    point: str
    killed: bool
    status: str
    """One of :data:`tests.contract.guarantees.STATUSES`."""
    reason: str = ""
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    loaded: int | None = None
    """The generation the flow's checkpoint (or returned state) held afterwards (None: none)."""
    seconds: float = 0.0


# ---- the ranks' side ------------------------------------------------------------------------------------


def _init_group(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(doc, default=str))
    temp.rename(path)  # whole, or not at all


class _Regroup:
    """A survivor's way into the new group the harness forms after the flow's first part (see the module
    doc): write the first answer, wait for the harness's list of survivors, join the new group."""

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory = directory
        self.rank = rank

    def __call__(self, first: dict[str, Any]) -> tuple[int, int] | None:
        import torch.distributed as dist

        _write_json(self.directory / f"first-{self.rank}.json", first)
        order = self.directory / "regroup.json"
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while not order.exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the harness never formed the new group")
            threading.Event().wait(0.005)  # polling the harness's order, with a deadline
        doc = json.loads(order.read_text())
        survivors = doc["survivors"]
        if self.rank not in survivors:
            return None
        dist.destroy_process_group()
        new_rank = survivors.index(self.rank)
        try:
            _init_group(new_rank, len(survivors), doc["port"])
        except Exception as exc:
            raise GroupTrouble(f"{type(exc).__name__}: {exc}") from exc
        return new_rank, len(survivors)


class GroupTrouble(Exception):
    """The harness's own trouble: a group that could not form (its port taken meanwhile). The iteration is
    run again; it says nothing of the flow."""


def _worker(rank: int, port: int, spec: dict[str, Any], answer_path: Path) -> None:
    import torch

    import reshard

    iteration = Iteration(
        flow=spec["flow"],
        world=spec["world"],
        point=KillPoint(**spec["point"]) if spec["point"] else None,
        directory=spec["directory"],
        hold=KillPoint(**spec["hold"]) if spec["hold"] else None,
    )
    torch.set_num_threads(1)
    try:
        _init_group(rank, iteration.world, port)
    except Exception as exc:  # the harness's own trouble (the port taken meanwhile): the iteration is run again
        _write_json(answer_path, {"rank": rank, "harness": f"{type(exc).__name__}: {exc}"[:2000]})
        os._exit(0)
    place = Path(iteration.directory)
    harness = place / HARNESS_DIR
    mine = iteration.point if iteration.point is not None and iteration.point.rank == rank else None
    held = iteration.hold if iteration.hold is not None and iteration.hold.rank == rank else None
    victim = harness / f"killed-{iteration.point.rank}.json" if iteration.point else None
    events = Events(mine, harness / f"killed-{rank}.json" if mine else None, place, held, victim)
    instrument(events)
    timer = None
    if mine is not None and mine.delay_s is not None:
        timer = threading.Timer(mine.delay_s, events.kill_if_armed, args=(f"after {mine.delay_s:.3f} s",))
        timer.daemon = True
    run = RankRun(
        rank=rank,
        world=iteration.world,
        place=place,
        timeout=COLLECTIVE_TIMEOUT_S,
        events=events,
        timer=timer,
        regroup=_Regroup(harness, rank),
    )
    answer: dict[str, Any] = {}
    started = time.monotonic()
    try:
        answer.update(FLOWS[iteration.flow].run(run) or {})
        answer["ok"] = True
    except reshard.CheckpointError as exc:
        answer.update(error=type(exc).__name__, message=str(exc)[:2000])
    except ForeignFailure as exc:
        answer.update(error=f"foreign {exc.kind}", message=str(exc)[:2000])
    except GroupTrouble as exc:
        answer.update(harness=str(exc)[:2000])
    except BaseException as exc:  # reported: an exception that is not reshard's is itself a finding
        answer.update(error=type(exc).__name__, message=str(exc)[:2000], other="".join(traceback.format_exception(exc)))
    finally:
        events.armed = False
        if timer is not None:
            timer.cancel()
    answer.update(rank=rank, seconds=time.monotonic() - started, events=events.names)
    answer["touched"] = events.paths.touched
    _write_json(answer_path, answer)
    os._exit(0)  # never tear down a group with dead members


# ---- the zygote ----------------------------------------------------------------------------------------


class _Zygote:
    """A process that has imported torch, reshard and the flows' libraries once and forks a fresh rank
    process per request. Requests and exit reports are JSON lines on its stdin/stdout."""

    def __init__(self) -> None:
        here = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from tests.contract.harness import zygote_main; zygote_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            bufsize=1,
        )
        self.exits: dict[int, int] = {}
        self.lock = threading.Lock()
        self.requests = threading.Lock()
        """Held from a request to its pid: iterations run in threads at once (tests/contract/test_kills.py)."""
        self.started: queue.Queue[int] = queue.Queue()
        self.reader = threading.Thread(target=self._read, name="contract-zygote", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            doc = json.loads(line)
            if "started" in doc:
                with self.lock:
                    # A pid the system reuses (a long run forks tens of thousands of ranks): the exit reported
                    # before this start was an earlier process's, and this one's comes after this line.
                    self.exits.pop(int(doc["started"]), None)
                self.started.put(int(doc["started"]))
            else:
                with self.lock:
                    self.exits[int(doc["pid"])] = int(doc["code"])

    def fork(self, rank: int, port: int, spec: dict[str, Any], answer_path: Path) -> int:
        """Start rank ``rank`` of an iteration; its pid."""
        assert self.process.stdin is not None
        request = {"rank": rank, "port": port, "spec": spec, "answer": str(answer_path)}
        with self.requests:  # the zygote answers in order: the next "started" line is this request's
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            return self.started.get(timeout=120)

    def exit_code(self, pid: int) -> int | None:
        with self.lock:
            return self.exits.get(pid)


def zygote_main() -> None:
    """The zygote's loop (see :class:`_Zygote`): read a request, fork, report the child's pid and later its
    exit status (a negative signal number when killed)."""
    import selectors

    import torch

    import reshard  # noqa: F401
    from tests.contract import flows

    flows.preload()
    torch.set_num_threads(1)
    children: set[int] = set()
    # Reading stdin in a thread would make the forks multi-threaded: poll it from this thread instead.
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
_ZYGOTE_LOCK = threading.Lock()


def _zygote() -> _Zygote:
    """The one zygote of this process (started on first use, again if it died); threads share it."""
    with _ZYGOTE_LOCK:
        if not _ZYGOTE or _ZYGOTE[0].process.poll() is not None:
            _ZYGOTE[:] = [_Zygote()]
        return _ZYGOTE[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the parent's side ----------------------------------------------------------------------------------


def _wait_until(done: Any, deadline: float) -> bool:
    while not done():
        if time.monotonic() > deadline:
            return False
        threading.Event().wait(0.005)  # polling the ranks' answer files, with a deadline
    return True


def run_workers(iteration: Iteration) -> tuple[dict[int, dict[str, Any]], dict[int, int | None], bool]:
    """Start the ranks of ``iteration``, collect every survivor's answer (bounded; with a regroup, hand
    the survivors their new group in between), end every process. Returns the answers by rank, the exit
    codes, and whether every survivor answered in time."""
    zygote = _zygote()
    spec = {
        "flow": iteration.flow,
        "world": iteration.world,
        "point": asdict(iteration.point) if iteration.point else None,
        "directory": iteration.directory,
        "hold": asdict(iteration.hold) if iteration.hold else None,
    }
    harness = Path(iteration.directory) / HARNESS_DIR
    harness.mkdir(parents=True, exist_ok=True)
    paths = {r: harness / f"answer-{r}.json" for r in range(iteration.world)}
    port = free_port()
    pids = {r: zygote.fork(r, port, spec, paths[r]) for r in range(iteration.world)}
    deadline = time.monotonic() + ANSWER_TIMEOUT_S

    def ended() -> set[int]:
        return {r for r, pid in pids.items() if zygote.exit_code(pid) is not None}

    in_time = True
    if FLOWS[iteration.flow].regroups:
        firsts = {r: harness / f"first-{r}.json" for r in pids}
        in_time = _wait_until(lambda: {r for r, p in firsts.items() if p.exists()} | ended() == set(pids), deadline)
        survivors = sorted(r for r, p in firsts.items() if p.exists())
        _write_json(harness / "regroup.json", {"survivors": survivors, "port": free_port()})
    if in_time:
        in_time = _wait_until(lambda: {r for r, p in paths.items() if p.exists()} | ended() == set(pids), deadline)
    for pid in pids.values():
        if zygote.exit_code(pid) is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    # Checked only once every rank is gone and reaped: a rank that answered and was then killed still holds
    # its pid (a zombie) until the zygote reaps it, and a lock naming a live pid is not stale.
    _wait_until(lambda: len(ended()) == len(pids), time.monotonic() + ANSWER_TIMEOUT_S)
    got = {r: json.loads(path.read_text()) for r, path in paths.items() if path.exists()}
    return got, {r: zygote.exit_code(pid) for r, pid in pids.items()}, in_time


def check(iteration: Iteration, answers: dict[int, dict[str, Any]], in_time: bool, killed: bool) -> Outcome:
    """The guarantees, after an iteration: the generic ones, then the flow's."""
    flow = FLOWS[iteration.flow]
    point = iteration.point.describe() if iteration.point else "none"
    outcome = Outcome(iteration.flow, iteration.world, point, killed, "clean", answers=answers)
    place = Path(iteration.directory)
    allowed = [place / p for p in (*flow.places, HARNESS_DIR)]
    findings = [
        guarantees.answered_in_time(in_time, ANSWER_TIMEOUT_S),
        guarantees.only_reshard_errors(answers),
        guarantees.same_outcome(answers, killed=killed),
        *(guarantees.touched_inside(a.get("touched", []), place, allowed, rank=r) for r, a in sorted(answers.items())),
    ]
    finding = next((f for f in findings if f is not None), None)
    if finding is None:
        finding = guarantees.foreign_untouched(flow.planted(place))
    try:
        if finding is None:
            outcome.loaded, finding = flow.check(place, iteration.world, answers, killed)
        if finding is None:
            finding = flow.follow_up(place, iteration.world)
    except Exception as exc:  # a check that cannot even run is a finding, not the end of the sample
        finding = guarantees.Finding("other", f"checking failed: {''.join(traceback.format_exception(exc))[-800:]}")
    if finding is not None:
        outcome.status, outcome.reason = finding.status, finding.reason
    return outcome


def prepare(iteration: Iteration) -> None:
    """In this process: what exists before the iteration's flow (and the user's files around it)."""
    FLOWS[iteration.flow].prepare(Path(iteration.directory), iteration.world)


HARNESS_ATTEMPTS = 3
"""Runs of an iteration whose group could not even form (the harness's trouble, not the flow's)."""


def run_iteration(iteration: Iteration) -> Outcome:
    """Prepare, run and check one iteration (again, from scratch, when a rank could not join the group)."""
    started = time.monotonic()
    for _attempt in range(HARNESS_ATTEMPTS):
        prepare(iteration)
        answers, _codes, in_time = run_workers(iteration)
        if not any("harness" in answer for answer in answers.values()):
            break
        shutil.rmtree(iteration.directory, ignore_errors=True)
        Path(iteration.directory).mkdir(parents=True)
    else:
        failed = {r: a["harness"] for r, a in answers.items() if "harness" in a}
        raise RuntimeError(f"the ranks of {iteration.flow} could not form a group {HARNESS_ATTEMPTS} times: {failed}")
    victim = iteration.point.rank if iteration.point else None
    killed = victim is not None and (Path(iteration.directory) / HARNESS_DIR / f"killed-{victim}.json").exists()
    outcome = check(iteration, answers, in_time, killed)
    outcome.seconds = time.monotonic() - started
    return outcome


def dry_run(flow: str, world: int, directory: Path) -> tuple[dict[int, list[str]], float]:
    """The events of every rank in one run of ``flow`` without a kill, and its duration; the run must
    keep every guarantee."""
    directory.mkdir(parents=True, exist_ok=True)
    iteration = Iteration(flow, world, None, str(directory))
    outcome = run_iteration(iteration)
    answers = outcome.answers
    if outcome.status != "clean" or len(answers) != world or not all(a.get("ok") for a in answers.values()):
        brief = {r: {k: v for k, v in a.items() if k != "touched"} for r, a in answers.items()}
        raise RuntimeError(f"the dry run of {flow} on {world} ranks failed: {outcome.reason} {brief}")
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
    flows: tuple[tuple[str, int], ...], base: Path, *, seed: int, systematic: int | None, timed: int
) -> Iterator[Iteration]:
    """Iterations over ``flows`` ((flow, world) pairs): for each, ``systematic`` kill points (None: all),
    sampled around the flow's pinned points (:func:`_sample`, seeded); and ``timed`` kills at random delays
    within the dry run's span."""
    rng = random.Random(seed)
    count = 0
    for name, world in flows:
        events, seconds = dry_run(name, world, base / f"dry-{name}-{world}")
        points = kill_points(events)
        if systematic is not None and systematic < len(points):
            points = _sample(points, [p for p in FLOWS[name].pinned(events) if p in points], systematic, rng)
        span = 1.5 * seconds
        for _ in range(timed):
            points.append(KillPoint(rank=rng.randrange(world), delay_s=rng.uniform(0.0, span)))
        for point in points:
            count += 1
            directory = base / f"it-{count:05d}"
            directory.mkdir(parents=True)
            yield Iteration(name, world, point, str(directory))


def _sample(points: list[KillPoint], pinned: list[KillPoint], count: int, rng: random.Random) -> list[KillPoint]:
    """``count`` of ``points``: every pinned one when they fit (the rest drawn), else the first two pinned
    (the commit) and the remainder drawn half from the other pinned points, half from the rest."""
    rest = [p for p in points if p not in pinned]
    if len(pinned) <= count:
        return pinned + rng.sample(rest, count - len(pinned))
    first, others = pinned[:2], pinned[2:]
    from_pinned = rng.sample(others, min(len(others), (count - len(first)) // 2))
    return first + from_pinned + rng.sample(rest, min(len(rest), count - len(first) - len(from_pinned)))


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """The figures docs/reliability.md quotes: per status, and per flow."""

    def count(selected: list[Outcome]) -> dict[str, int]:
        row = {"tried": len(selected), "killed": sum(o.killed for o in selected)}
        row.update({s: sum(o.status == s for o in selected) for s in guarantees.STATUSES})
        row["kept_old"] = sum(o.loaded == 1 for o in selected)
        row["committed_new"] = sum(o.loaded == 2 for o in selected)
        return row

    flows = sorted({o.flow for o in outcomes})
    return {
        **count(outcomes),
        "by_flow": {f: count([o for o in outcomes if o.flow == f]) for f in flows},
        "failures": [
            {
                **asdict(o),
                "answers": {
                    r: {k: v for k, v in a.items() if k not in ("touched", "events")} for r, a in o.answers.items()
                },
            }
            for o in outcomes
            if o.status != "clean"
        ][:20],
    }


def remove(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
