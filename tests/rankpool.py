"""A pool of rank processes, reused across test cases.

Starting ranks is the slow part of a multi-process test (importing torch, forming the gloo group), so
the pool starts ``world_size`` processes once, forms the default gloo group and a fixed set of
subgroups, and then runs one test function after another on every rank. The test suite's pools fork
their ranks from multiprocessing's forkserver, which imported torch and reshard once for the session
(:func:`forkserver_context`); ``start_method="spawn"`` gives ranks that import everything themselves.

A test function is a module-level function ``fn(ctx: RankContext, *args)``, referenced by module and
name (so nothing is pickled but plain arguments); its return value (plain data) comes back per rank.
An exception comes back as :class:`RankFailure` with its class name, message and the ``failures``
attribute of reshard errors. Waiting is bounded: a rank that does not answer within the timeout fails
the test and the pool is marked broken (the fixture then starts a new one).
"""

from __future__ import annotations

import datetime
import importlib
import os
import queue
import socket
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60.0

FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "reshard",
    "tests.rankpool",
    "tests.faults",
    "megatron.core.dist_checkpointing",  # skipped by the forkserver when megatron-core is not installed
    "reshard.interop.megatron",
)
"""What the forkserver of :func:`private_pool` imports once, before it forks any rank."""


def forkserver_context() -> Any:
    """multiprocessing's forkserver context, its server told to import :data:`FORKSERVER_PRELOAD` first (which
    counts when the session's forkserver starts, on the first process started through it): a process it starts
    is forked from a server that imported torch and reshard once, in a fraction of a second, where a spawned
    one imports them again (seconds of CPU on two cores)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


@dataclass
class RankContext:
    """What a test function gets on each rank."""

    rank: int
    world_size: int
    groups: dict[str, Any] = field(default_factory=dict)

    def group_of_size(self, size: int) -> tuple[Any, bool]:
        """The group of the first ``size`` ranks, and whether this rank belongs to it.

        ``size == world_size`` gives the default group (``None``).
        """
        if size == self.world_size:
            return None, True
        return self.groups[f"first{size}"], self.rank < size


@dataclass(frozen=True)
class RankFailure:
    error_class: str
    message: str
    failures: dict[int, str]
    traceback: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _subgroup_specs(world_size: int) -> dict[str, list[int]]:
    specs: dict[str, list[int]] = {}
    size = 1
    while size < world_size:
        specs[f"first{size}"] = list(range(size))
        size *= 2
    if world_size % 2 == 0 and world_size >= 4:
        half = world_size // 2
        specs["lower_half"] = list(range(half))
        specs["upper_half"] = list(range(half, world_size))
    return specs


def _worker(rank: int, world_size: int, port: int, tasks: Any, results: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # up to 8 ranks share 2 cores
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    )
    groups: dict[str, Any] = {}
    for name, ranks in _subgroup_specs(world_size).items():
        # new_group is collective over the whole world: every rank creates every group, in order.
        groups[name] = dist.new_group(ranks, backend="gloo")
    ctx = RankContext(rank=rank, world_size=world_size, groups=groups)
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        module_name, fn_name, args, kwargs = task
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
            results.put((rank, "ok", fn(ctx, *args, **kwargs)))
        except BaseException as exc:  # reported to the test, which decides
            failure = RankFailure(
                error_class=type(exc).__name__,
                message=str(exc),
                failures=dict(getattr(exc, "failures", {}) or {}),
                traceback="".join(traceback.format_exception(exc)),
            )
            results.put((rank, "error", failure))
    # Every result was taken by the test already: leave at once, without a process-group teardown or the
    # interpreter's (seconds per pool at the end of a session, for nothing).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class PoolBrokenError(RuntimeError):
    pass


class RankPool:
    """``world_size`` spawned ranks with a gloo group, running test functions on request."""

    def __init__(self, world_size: int, *, start_timeout_s: float = 240.0, start_method: str = "spawn") -> None:
        self.world_size = world_size
        ctx = forkserver_context() if start_method == "forkserver" else mp.get_context(start_method)
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.processes = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.processes:
            p.start()
        self.broken = False
        self._collect("ready", start_timeout_s)

    def _collect(self, expected: str | None, timeout_s: float) -> list[Any]:
        out: dict[int, Any] = {}
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        while len(out) < self.world_size:
            remaining = (deadline - datetime.datetime.now()).total_seconds()
            try:
                rank, status, value = self.results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                self.broken = True
                dead = [r for r, p in enumerate(self.processes) if not p.is_alive()]
                raise PoolBrokenError(
                    f"ranks {sorted(set(range(self.world_size)) - set(out))} did not answer within "
                    f"{timeout_s:.0f} s (dead processes: {dead})"
                ) from None
            if expected is not None and status != expected:
                self.broken = True
                raise PoolBrokenError(f"rank {rank} failed to start: {value}")
            out[rank] = value
        return [out[r] for r in range(self.world_size)]

    def run(self, fn: Any, *args: Any, timeout_s: float = 180.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return per-rank results, where an exception
        is returned as a :class:`RankFailure`."""
        if self.broken:
            raise PoolBrokenError("the pool is broken by an earlier test")
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, args, kwargs))
        return self._collect(None, timeout_s)

    def run_ok(self, fn: Any, *args: Any, timeout_s: float = 180.0, **kwargs: Any) -> list[Any]:
        """Like :meth:`run`, but fail with every rank's traceback if any rank raised."""
        results = self.run(fn, *args, timeout_s=timeout_s, **kwargs)
        failures = [(r, v) for r, v in enumerate(results) if isinstance(v, RankFailure)]
        if failures:
            details = "\n".join(f"--- rank {r} ---\n{v.traceback}" for r, v in failures)
            raise AssertionError(f"{len(failures)} ranks failed:\n{details}")
        return results

    def request_close(self) -> None:
        """Tell every rank to exit (without waiting: :meth:`close` waits)."""
        if getattr(self, "_close_requested", False):
            return
        self._close_requested = True
        for q in self.tasks:
            q.put(None)

    def close(self) -> None:
        self.request_close()
        for p in self.processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def private_pool(world_size: int) -> RankPool:
    """A pool of a test's own, for a test that breaks it (kills a rank, leaves a collective timed out): its ranks
    are forked by multiprocessing's forkserver, which imported torch, reshard and megatron-core once for the
    session (:data:`FORKSERVER_PRELOAD`), so it starts in about a second where spawned ranks import torch again,
    seconds each. The ranks are fresh processes all the same: nothing of a test's ranks reaches the next's. The
    shared pools of ``tests/conftest.py`` start the same way."""
    return RankPool(world_size, start_method="forkserver")
