"""Every flow of reshard, as the contract suite runs it: what exists before (``prepare``, in the test
process), what each rank does (``run``, in a rank process, with the operation under test *armed* so that
its events count), and what must hold afterwards (``check``, with :mod:`tests.contract.guarantees`).

A flow names the *places* its ranks may touch (paths in the iteration's directory: a checkpoint, a root of
steps, a source and a destination); the harness checks that nothing else there was touched, and that the
user's files planted in and around those places are intact. The flows of the storage layer live here;
those of the network (transfer, the peer tier), of Megatron-Core and of the offline writers live in
:mod:`tests.contract.flows_network` and :mod:`tests.contract.flows_edge` and register themselves in
:data:`FLOWS` too.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tests.contract import guarantees, states
from tests.contract.events import Events, KillPoint
from tests.contract.guarantees import Answers, Finding

USER_DIR = "user"
"""A sibling of the flow's places with the user's own files (and a decoy ``retired.json``)."""
USER_FILES = ("notes.txt", "src/train.py", "retired.json", "data/user.csv")


@dataclass
class RankRun:
    """What a flow's ``run`` gets in its rank process."""

    rank: int
    world: int
    place: Path
    timeout: float
    events: Events
    timer: threading.Timer | None = None
    regroup: Callable[[dict[str, Any]], tuple[int, int] | None] | None = None
    """For flows that go on after a death: report the first part's outcome, wait for the harness's new
    group, and return (new rank, new world), or None when this rank is not in it."""
    _timer_started: bool = field(default=False, repr=False)

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Count events (and let the kill point fire) inside the block; the timed kill starts at the first."""
        if self.timer is not None and not self._timer_started:
            self._timer_started = True
            self.timer.start()
        self.events.armed = True
        try:
            yield
        finally:
            self.events.armed = False


class Flow:
    """One flow: override ``prepare_place``, ``run`` and ``check``."""

    name: ClassVar[str]
    places: ClassVar[tuple[str, ...]] = ("ckpt",)
    """Paths of the iteration's directory the ranks may touch."""
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"ckpt": ("notes.txt", "data/user.csv")}
    """The user's files planted in each place before the flow (they must survive it untouched)."""
    regroups: ClassVar[bool] = False
    worlds: ClassVar[tuple[int, ...]] = (2, 3, 4)
    """The world sizes of the long mode."""

    def prepare(self, place: Path, world: int) -> None:
        """In the test process: what exists before the flow, then the user's files."""
        self.prepare_place(place, world)
        for where, names in {**self.foreign, USER_DIR: USER_FILES}.items():
            guarantees.plant(place / where, names)

    def planted(self, place: Path) -> dict[Path, bytes]:
        """What :meth:`prepare` planted, with the bytes each file must still hold."""
        out = {}
        for where, names in {**self.foreign, USER_DIR: USER_FILES}.items():
            for name in names:
                out[place / where / name] = guarantees.FOREIGN.get(name, f"foreign file {name}\n".encode())
        return out

    def prepare_place(self, place: Path, world: int) -> None:
        """The committed state the flow starts from (default: nothing)."""

    def run(self, run: RankRun) -> dict[str, Any] | None:
        raise NotImplementedError

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        """The flow's own guarantees: the generation its result holds, and the first finding."""
        raise NotImplementedError

    def follow_up(self, place: Path, world: int) -> Finding | None:
        """After the checks: the next use of the same place must work (no dead holder's lock blocks it)."""
        return None

    def pinned(self, events: dict[int, list[str]]) -> list[KillPoint]:
        """Kill points every sample includes: the coordinator just before and after its commit (so that a
        sample reaches both outcomes of a save), then every rank around every collective of the protocol."""
        commit = [i for i, name in enumerate(events[0]) if name == "commit metadata.json"][:1]
        points = [KillPoint(rank=0, index=i, when=w) for i in commit for w in ("before", "after")]
        for rank, names in sorted(events.items()):
            for i, name in enumerate(names):
                if name.endswith("_bytes"):
                    points += [KillPoint(rank=rank, index=i, when=w) for w in ("before", "after")]
        return points


FLOWS: dict[str, Flow] = {}


class ForeignFailure(Exception):
    """A failure of the client library's own code, not of reshard's (Megatron's own collectives finding a
    peer dead): a flow raises it instead, and the harness records it without holding it against reshard."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.kind = type(cause).__name__


def raised_inside_reshard(exc: BaseException) -> bool:
    """Whether any frame of ``exc``'s traceback is reshard's own code."""
    import traceback

    import reshard

    package = str(Path(reshard.__file__).parent)
    return any(frame.filename.startswith(package) for frame in traceback.extract_tb(exc.__traceback__))


def register(flow: type[Flow]) -> type[Flow]:
    FLOWS[flow.name] = flow()
    return flow


def preload() -> None:
    """Import what every flow's rank needs, once, in the zygote (so that forked ranks start at once)."""
    for module in (flows_network, flows_edge, flows_tiered, flows_data, flows_trainers, flows_hierarchy):
        module.preload()


def save_single(path: Path, generation: int, world: int, **kwargs: Any) -> None:
    """Generation ``generation`` of a ``world``-rank job, saved by this process."""
    import reshard

    reshard.save(states.single_process_state(generation, world), path, **kwargs)


def later_save(path: Path, world: int) -> Finding | None:
    """A save of generation 3 to ``path`` from this process must succeed and load."""
    import reshard

    try:
        save_single(path, 3, world, overwrite=True)
    except reshard.CheckpointError as exc:
        return Finding("other", f"a later save failed: {type(exc).__name__}: {exc}")
    _, finding = guarantees.loads_as(path, world, (3,), what="the later save")
    return finding


# ---- save: overwrite, asynchronous, fresh ---------------------------------------------------------------


@register
class Overwrite(Flow):
    """``reshard.save(B, path, overwrite=True)`` over a committed A."""

    name = "overwrite"

    def prepare_place(self, place: Path, world: int) -> None:
        save_single(place / "ckpt", 1, world)

    def save(self, run: RankRun, state: dict[str, Any]) -> None:
        import reshard

        reshard.save(state, run.place / "ckpt", overwrite=True, timeout=run.timeout)

    def run(self, run: RankRun) -> dict[str, Any] | None:
        state = states.rank_state(run.rank, run.world, 2)
        with run.armed():
            self.save(run, state)
        return None

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        path = place / "ckpt"
        done = guarantees.confirmed(answers)
        allowed = (2,) if done else (1, 2)
        generation, finding = guarantees.loads_as(path, world, allowed, what="the checkpoint")
        if finding is None:
            finding = guarantees.readers_agree(path, True)
        return generation, finding

    def follow_up(self, place: Path, world: int) -> Finding | None:
        return later_save(place / "ckpt", world)


@register
class AsyncOverwrite(Overwrite):
    """``AsyncCheckpointer.save(B, path, overwrite=True).wait()`` over a committed A."""

    name = "async"

    def save(self, run: RankRun, state: dict[str, Any]) -> None:
        import reshard

        checkpointer = reshard.AsyncCheckpointer(timeout=run.timeout)
        checkpointer.save(state, run.place / "ckpt", overwrite=True).wait()


@register
class Fresh(Overwrite):
    """``reshard.save(B, path)`` where no checkpoint is (the user's files are there)."""

    name = "fresh"

    def prepare_place(self, place: Path, world: int) -> None:
        pass

    def save(self, run: RankRun, state: dict[str, Any]) -> None:
        import reshard

        reshard.save(state, run.place / "ckpt", timeout=run.timeout)

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        import reshard

        path = place / "ckpt"
        generation, error = guarantees.load_generation(path, world, (1, 2, 3))
        if generation == -1 or generation == 1:
            return generation, Finding("silent", f"a fresh save loads as generation {generation}")
        if generation is None:
            if not isinstance(error, reshard.IncompleteCheckpointError | reshard.CheckpointNotFoundError):
                return None, Finding("lost", f"the fresh checkpoint neither loads nor is incomplete: {error}")
            if guarantees.confirmed(answers):
                return None, Finding("lost", f"a rank reported the save done, yet: {error}")
        return generation, guarantees.readers_agree(path, generation is not None)


@register
class Partitioned(Overwrite):
    """``reshard.save(B, path, overwrite=True)`` with ``SaveOptions(metadata_parts=True)`` over a committed A whose
    metadata is partitioned too (format version 6: the parts are written before ``metadata.json``), then every
    rank loads B back, each reading the parts its keys need."""

    name = "partitioned"

    def prepare_place(self, place: Path, world: int) -> None:
        import reshard

        save_single(place / "ckpt", 1, world, options=reshard.SaveOptions(metadata_parts=True))

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        state = states.rank_state(run.rank, run.world, 2)
        parts = reshard.SaveOptions(metadata_parts=True)
        with run.armed():
            reshard.save(state, run.place / "ckpt", overwrite=True, options=parts, timeout=run.timeout)
            loaded = reshard.load(states.full_template(run.world), run.place / "ckpt", timeout=run.timeout)
        generation = states.generation_of(loaded, run.world, (1, 2, 3))
        return {"generation": -1 if generation is None else generation}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        generation, finding = super().check(place, world, answers, killed)
        return generation, guarantees.returned_generation(answers, (2,), what="load") or finding

    def pinned(self, events: dict[int, list[str]]) -> list[KillPoint]:
        """The coordinator right after its metadata parts are durable (before ``metadata.json``: a save that must
        leave no committed checkpoint, its parts garbage) and right after its commit, then the usual points."""
        pinned = super().pinned(events)
        parts = [i for i, name in enumerate(events[0]) if name.startswith("fsync ") and "-metadata-" in name]
        first = [KillPoint(rank=0, index=i, when="after") for i in parts[-1:]] + pinned[1:2]
        return [*first, pinned[0], *pinned[2:]]


# ---- the manager: save, latest.json, retention; incremental saves and gc --------------------------------


def check_root(
    root: Path, world: int, newest_expected: int | None, *, under: str | None = None
) -> tuple[int | None, Finding | None]:
    """A root of steps after a manager's flow: every step that ``reshard ls`` calls complete loads as its
    own generation and passes ``validate``, every other does not load; the newest complete step is at
    least ``newest_expected``; ``latest.json`` names a step that loads. ``under``: the states lie under that
    key of each step (:func:`tests.contract.guarantees.load_generation`)."""
    import reshard
    from reshard.flows.manager import scan_root
    from reshard.storage import LocalStorage

    newest = None
    for info in scan_root(LocalStorage(root)):
        path = root / info.name
        generation, error = guarantees.load_generation(path, world, (1, 2, 3), under=under)
        if info.status == "complete":
            if generation != info.step:
                status = "silent" if generation == -1 else "lost"
                return generation, Finding(status, f"{info.name} is listed complete but loads as {generation}: {error}")
            finding = guarantees.readers_agree(path, True)
            if finding is not None:
                return generation, finding
            newest = info.step
        elif generation is not None:
            return generation, Finding("other", f"{info.name} is listed {info.status} but loads as {generation}")
    if newest is None:
        return None, Finding("lost", "no step of the root loads")
    if newest_expected is not None and newest < newest_expected:
        return newest, Finding("lost", f"a rank reported step {newest_expected} saved, the newest loadable is {newest}")
    latest = reshard.CheckpointManager(root).latest_pointer()
    if (
        latest is None
        or guarantees.load_generation(root / f"step_{latest:09d}", world, (1, 2, 3), under=under)[0] != latest
    ):
        return newest, Finding("other", f"latest.json names step {latest}, which does not load")
    return newest, None


@register
class ManagerStep(Flow):
    """``CheckpointManager(root, keep_last=1).save(2, B)`` on a root whose step 1 holds A."""

    name = "manager"
    places = ("root",)
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"root": ("notes.txt",)}
    incremental: ClassVar[bool] = False
    follow_up_overwrites: ClassVar[bool] = False
    """Whether the follow-up's save of step 3 passes ``overwrite=True`` (a flow whose run may have saved step 3)."""

    def manager(self, root: Path, timeout: float | None = None) -> Any:
        import reshard

        return reshard.CheckpointManager(root, keep_last=1, incremental=self.incremental, timeout=timeout)

    def prepare_place(self, place: Path, world: int) -> None:
        manager = self.manager(place / "root")
        manager.save(1, states.single_process_state(1, world))
        manager.close()

    def run(self, run: RankRun) -> dict[str, Any] | None:
        state = states.rank_state(run.rank, run.world, 2)
        manager = self.manager(run.place / "root", run.timeout)
        with run.armed():
            manager.save(2, state)
        return None

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        return check_root(place / "root", world, 2 if guarantees.confirmed(answers) else None)

    def follow_up(self, place: Path, world: int) -> Finding | None:
        import reshard

        manager = self.manager(place / "root")
        try:
            manager.save(3, states.single_process_state(3, world), overwrite=self.follow_up_overwrites)
        except reshard.CheckpointError as exc:
            return Finding("other", f"a later manager save failed: {type(exc).__name__}: {exc}")
        finally:
            manager.close()
        return check_root(place / "root", world, 3)[1]


@register
class ReusedPlanStep(ManagerStep):
    """``CheckpointManager(root, keep_last=1)`` on a root whose step 1 holds A (saved by one process): ``save(2, B)``,
    which plans the ranks' layout and writes the plan cache (``plans.reshard-cache``), then ``save(3, C)`` of the same
    layout by the same manager, whose planning reuses step 2's plan (only fingerprints are sent:
    reshard.flows.save_reuse); both armed, and the plan cache's commit pinned among the kill points."""

    name = "manager_reuse"
    follow_up_overwrites = True  # its run may have committed step 3

    def run(self, run: RankRun) -> dict[str, Any] | None:
        manager = self.manager(run.place / "root", run.timeout)
        with run.armed():
            manager.save(2, states.rank_state(run.rank, run.world, 2))
            manager.save(3, states.rank_state(run.rank, run.world, 3))
        return None

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        # A commit a rank reports (done, or unconfirmed when a rank died after it) may be step 2's or step 3's.
        return check_root(place / "root", world, 2 if guarantees.confirmed(answers) else None)

    def pinned(self, events: dict[int, list[str]]) -> list[KillPoint]:
        cache = [i for i, name in enumerate(events[0]) if name.endswith("plans.reshard-cache")][:1]
        return [KillPoint(rank=0, index=i, when=w) for i in cache for w in ("before", "after")] + super().pinned(events)


@register
class IncrementalStep(ManagerStep):
    """``CheckpointManager(root, keep_last=1, incremental=True).save(2, B)`` (B shares ``frozen`` with A,
    so step 2 references step 1's file, and retention retires step 1), then ``reshard gc`` of every step
    by rank 0, as a cron job would."""

    name = "incremental"
    incremental = True

    def prepare_place(self, place: Path, world: int) -> None:
        pass  # step 1 is saved by the ranks (an incremental save references boxes of the same layout)

    def run(self, run: RankRun) -> dict[str, Any] | None:
        from reshard.flows.maintenance import collect_garbage

        self.manager(run.place / "root", run.timeout).save(1, states.rank_state(run.rank, run.world, 1))
        super().run(run)
        if run.rank == 0:
            root = run.place / "root"
            with run.armed():
                for step in sorted(p for p in root.iterdir() if p.name.startswith("step_")):
                    collect_garbage(step, min_age_s=0.0, include_incomplete=False)
        return None


# ---- load: read once per replica group --------------------------------------------------------------------


@register
class ReadOnceLoad(Flow):
    """Every rank loads the whole of a committed checkpoint with ``LoadOptions(read_once=True)``: each
    cell read by one rank and sent to the others."""

    name = "read_once"

    def prepare_place(self, place: Path, world: int) -> None:
        save_single(place / "ckpt", 1, world)

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        template = states.full_template(run.world)
        with run.armed():
            loaded = reshard.load(
                template, run.place / "ckpt", options=reshard.LoadOptions(read_once=True), timeout=run.timeout
            )
        generation = states.generation_of(loaded, run.world, (1, 2, 3))
        return {"generation": -1 if generation is None else generation}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        finding = guarantees.returned_generation(answers, (1,), what="load")
        generation, lost = guarantees.loads_as(place / "ckpt", world, (1,), what="the checkpoint after the load")
        return generation, finding or lost

    def pinned(self, events: dict[int, list[str]]) -> list[KillPoint]:
        first = next((i for i, name in enumerate(events[0]) if name == "exchange"), None)
        return [] if first is None else [KillPoint(rank=0, index=first, when="before")]


@register
class ReusedReadSchedule(Flow):
    """A root whose step 1 holds A (saved by one process): each rank's ``CheckpointManager`` loads the latest step
    twice with ``LoadOptions(read_once=True)`` (the first schedules and writes the read plan cache,
    ``reads.reshard-cache``; the second reuses the schedule in memory), then a new manager (a restarted job) loads it
    once more (the schedule made again from the needs in the file): all armed, the cache's commit pinned among the
    kill points. Every load returns A; the root loads as before; a later load and save of the root work."""

    name = "manager_read_reuse"
    places = ("root",)
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"root": ("notes.txt",)}

    def prepare_place(self, place: Path, world: int) -> None:
        import reshard

        manager = reshard.CheckpointManager(place / "root")
        manager.save(1, states.single_process_state(1, world))
        manager.close()

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        def generation(manager: Any) -> int:
            template = states.full_template(run.world)
            found = manager.load_latest_with_state(template, options=reshard.LoadOptions(read_once=True))
            got = states.generation_of(found[1], run.world, (1, 2, 3)) if found is not None else None
            return -1 if got is None else got

        first = reshard.CheckpointManager(run.place / "root", timeout=run.timeout)
        with run.armed():
            generations = [generation(first), generation(first)]
            restarted = reshard.CheckpointManager(run.place / "root", timeout=run.timeout)
            generations.append(generation(restarted))
        first.close()
        restarted.close()
        return {"generation": generations[0] if len(set(generations)) == 1 else -1}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        finding = guarantees.returned_generation(answers, (1,), what="load")
        generation, lost = check_root(place / "root", world, 1)
        return generation, finding or lost

    def follow_up(self, place: Path, world: int) -> Finding | None:
        import reshard

        manager = reshard.CheckpointManager(place / "root", keep_last=1)
        try:
            found = manager.load_latest_with_state(states.full_template(world))
            if found is None or states.generation_of(found[1], world, (1, 2, 3)) != 1:
                return Finding("lost", "a later manager load did not return step 1")
            manager.save(2, states.single_process_state(2, world))
        except reshard.CheckpointError as exc:
            return Finding("other", f"a later manager load or save failed: {type(exc).__name__}: {exc}")
        finally:
            manager.close()
        return check_root(place / "root", world, 2)[1]

    def pinned(self, events: dict[int, list[str]]) -> list[KillPoint]:
        cache = [i for i, name in enumerate(events[0]) if name.endswith("reads.reshard-cache")][:1]
        return [KillPoint(rank=0, index=i, when=w) for i in cache for w in ("before", "after")] + super().pinned(events)


def write_json(path: Path, doc: Any) -> None:
    path.write_text(json.dumps(doc))


# The flows of the network and of the edge register themselves on import.
from tests.contract import (  # noqa: E402
    flows_data,
    flows_edge,
    flows_hierarchy,
    flows_network,
    flows_tiered,
    flows_trainers,
)
