"""Fault injection for crash tests: local storages that SIGKILL their own process, or raise ``OSError``,
at a chosen point of a save, on a chosen rank.

Everything here is real: the storages are :class:`~reshard.storage.LocalStorage` subclasses that write real
files and delegate every operation to it; a fault only adds, at one point, either
``os.kill(os.getpid(), signal.SIGKILL)`` (the process dies there, as under ``kill -9``) or ``raise OSError(errno)``.
Before a kill, the fault writes a small JSON *marker* file outside the checkpoint, so that the test can check
that the process died where it was meant to (and how many bytes of the data file had reached the disk).

The fault points of one save, in protocol order:

- ``before_write``: in ``open_writer`` of the rank's data file, before the file is created;
- ``mid_write``: in ``FileWriter.write``, once ``after_bytes`` bytes of the data file have been written;
- ``before_data_commit``: in ``FileWriter.commit`` (the data file's fsync), before it runs;
- ``after_write``: in ``FileWriter.commit``, after the data file is fsynced and closed (the rank returns
  from the commit of its data file, then dies before reporting to the coordinator);
- ``in_commit``: inside ``Storage.commit`` of ``metadata.json`` (the coordinator), after the temporary file is
  written and fsynced and before it is linked (create-only) or renamed (replace) into place.

And one point of the save that takes over a dead save's lock: ``after_data_delete``, in ``Storage.delete`` of a
name under ``data/`` (the dead-file cleanup, on the coordinator), right after the first such file is deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from reshard.metadata import METADATA_FILE
from reshard.storage import FileWriter, LocalStorage, Storage
from tests.rankpool import RankPool

POINTS = ("before_write", "mid_write", "before_data_commit", "after_write", "in_commit", "after_data_delete")


@dataclass(frozen=True)
class Fault:
    """One fault: at ``point`` of the save, on global rank ``rank``, either SIGKILL the process
    (``errno is None``) or raise ``OSError(errno, ...)``. ``marker`` is a file written just before a kill."""

    point: str
    rank: int
    errno: int | None = None
    after_bytes: int = 0
    marker: str = ""

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Fault:
        return cls(**doc)

    def applies(self, point: str) -> bool:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return point == self.point and rank == self.rank

    def fire(self, **details: Any) -> None:
        """Raise the injected OSError, or write the marker and SIGKILL this process."""
        if self.errno is not None:
            raise OSError(self.errno, f"{os.strerror(self.errno)} (injected at {self.point})")
        if self.marker:
            doc = {"point": self.point, "rank": self.rank, "pid": os.getpid(), "time": time.time(), **details}
            Path(self.marker).write_text(json.dumps(doc))
        os.kill(os.getpid(), signal.SIGKILL)
        raise AssertionError("unreachable: SIGKILL did not end the process")  # pragma: no cover


class FaultyWriter(FileWriter):
    """A data file writer that delegates to the real one and fires the fault at its point."""

    def __init__(self, inner: FileWriter, fault: Fault, path: Path) -> None:
        self.inner = inner
        self.fault = fault
        self.path = path

    def _on_disk(self) -> int:
        try:
            return self.path.stat().st_size
        except FileNotFoundError:
            return -1

    def write(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        if self.fault.applies("mid_write") and self.inner.tell() + len(view) > self.fault.after_bytes:
            keep = max(self.fault.after_bytes - self.inner.tell(), 0)
            if keep:
                self.inner.write(view[:keep])
            self.fault.fire(written=self.inner.tell(), on_disk=self._on_disk(), file=self.path.name)
        self.inner.write(view)

    def tell(self) -> int:
        return self.inner.tell()

    def commit(self) -> None:
        if self.fault.applies("before_data_commit"):
            self.fault.fire(written=self.inner.tell(), on_disk=self._on_disk(), file=self.path.name)
        self.inner.commit()
        if self.fault.applies("after_write"):
            self.fault.fire(written=self.inner.tell(), on_disk=self._on_disk(), file=self.path.name)

    def abort(self) -> None:
        self.inner.abort()


@contextlib.contextmanager
def _faulty_publish(fault: Fault, target: Path) -> Iterator[None]:
    """While active, ``os.link`` and ``os.replace`` onto ``target`` fire the fault before publishing the file
    (after a kill they are never restored: the process is gone)."""
    saved_link, saved_replace = os.link, os.replace

    def guard(original: Any) -> Any:
        def publish(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            if Path(dst) == target:
                temps = sorted(p.name for p in target.parent.glob(f".{target.name}.tmp-*"))
                fault.fire(temporary_files=temps, target_exists=target.exists())
            original(src, dst, *args, **kwargs)

        return publish

    os.link, os.replace = guard(saved_link), guard(saved_replace)
    try:
        yield
    finally:
        os.link, os.replace = saved_link, saved_replace


class FaultyStorage(LocalStorage):
    """A checkpoint directory whose saves hit ``fault`` (on the fault's rank only)."""

    def __init__(self, root: str | os.PathLike[str], fault: Fault) -> None:
        super().__init__(root)
        self.fault = fault

    def open_writer(self, name: str, *, max_buffered_bytes: int | None = None) -> FileWriter:
        if self.fault.applies("before_write"):
            self.fault.fire(file=name, exists=(self.root / name).exists())
        return FaultyWriter(
            super().open_writer(name, max_buffered_bytes=max_buffered_bytes), self.fault, self.root / name
        )

    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        if name == METADATA_FILE and self.fault.applies("in_commit"):
            with _faulty_publish(self.fault, self.root / name):
                super().commit(name, data, replace=replace)
            return
        super().commit(name, data, replace=replace)

    def delete(self, name: str) -> None:
        super().delete(name)
        if name.startswith("data/") and self.fault.applies("after_data_delete"):
            self.fault.fire(file=name)

    def child(self, name: str) -> Storage:
        return FaultyStorage(self.root / name, self.fault)


class FaultyRoot(LocalStorage):
    """A manager root whose step directory ``step_name`` is a :class:`FaultyStorage` (every other child is
    a plain LocalStorage): pass it as ``CheckpointManager(root=...)`` to fault one step's save."""

    def __init__(self, root: str | os.PathLike[str], step_name: str, fault: Fault) -> None:
        super().__init__(root)
        self.step_name = step_name
        self.fault = fault

    def child(self, name: str) -> Storage:
        if name == self.step_name:
            return FaultyStorage(self.root / name, self.fault)
        return LocalStorage(self.root / name)


# ---- running a test function on a pool where some ranks get killed ------------------------------------


@dataclass(frozen=True)
class DeathRun:
    """The outcome of :func:`run_with_deaths`: per-rank results of the ranks that answered (a value or a
    RankFailure), the exit codes of the processes that died, and the wall time until the last answer."""

    results: dict[int, Any]
    exitcodes: dict[int, int | None]
    seconds: float


def run_with_deaths(pool: RankPool, fn: Any, *args: Any, dead: set[int], timeout_s: float = 90.0) -> DeathRun:
    """Run ``fn(ctx, *args)`` on every rank of a private ``pool`` where the ranks ``dead`` are expected to
    die. Waits (bounded) for an answer from every other rank and for the dead ones to exit; a rank that
    neither answers nor dies within ``timeout_s`` is a hang and fails the test. The pool is broken after
    this (its group has lost members): close it with :func:`kill_pool`."""
    started = time.monotonic()
    deadline = started + timeout_s
    for q in pool.tasks:
        q.put((fn.__module__, fn.__name__, args, {}))
    pool.broken = True
    survivors = set(range(pool.world_size)) - dead
    results: dict[int, Any] = {}
    while not survivors <= results.keys():
        remaining = deadline - time.monotonic()
        try:
            rank, _status, value = pool.results.get(timeout=max(remaining, 0.01))
        except queue.Empty:
            missing = sorted(survivors - results.keys())
            alive = [r for r, p in enumerate(pool.processes) if p.is_alive()]
            raise AssertionError(
                f"ranks {missing} did not answer within {timeout_s:.0f} s (a hang); alive processes: {alive}"
            ) from None
        results[rank] = value
    seconds = time.monotonic() - started
    exitcodes = {}
    for r in sorted(dead):
        pool.processes[r].join(timeout=max(deadline - time.monotonic(), 1.0))
        exitcodes[r] = pool.processes[r].exitcode
    extra = {}
    with contextlib.suppress(queue.Empty):
        while True:  # a rank expected to die that answered instead
            rank, _status, value = pool.results.get_nowait()
            extra[rank] = value
    if extra:
        raise AssertionError(f"ranks expected to die answered: {extra}")
    return DeathRun(results=results, exitcodes=exitcodes, seconds=seconds)


def kill_pool(pool: RankPool) -> None:
    """End a broken private pool: its surviving processes hold a group with dead members, so they are
    killed (by process id) rather than asked to tear the group down."""
    for p in pool.processes:
        if p.is_alive():
            p.kill()
        p.join(timeout=30)
    for q in [*pool.tasks, pool.results]:
        q.cancel_join_thread()
        q.close()
