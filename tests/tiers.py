"""The three tiers of the test suite, and the guard that keeps the ``unit`` tier honest.

Every test has exactly one tier mark (``pytestmark`` of its module, or a mark on the test itself):

* ``unit``: no processes, servers or subprocesses; ranks are threads of this process
  (:class:`reshard.net.transports.ThreadGroup`, :func:`tests.threads.on_threads`) and storage is a
  :class:`~reshard.storage.LocalStorage` on ``tmp_path`` or fsspec's in-memory filesystem. Each is fast: the
  whole tier is ``make test-fast``, under 30 s on two cores.
* ``dist``: spawns ranks (the rank pools of ``tests/conftest.py``), subprocesses, or starts servers (the S3 and
  GCS servers of :mod:`tests.objectstores`, their fault proxies); and the few in-process tests that take seconds
  (property tests at 512 ranks, the contract suite), which would not let the fast tier stay fast.
* ``slow``: many seconds each: benchmark smokes, long chaos samples, installs, demo runs.

``tests/conftest.py`` refuses to collect a test with no tier or with two, and runs every ``unit`` test under
:func:`unit_guard`, which turns starting a process or listening on a socket into a test failure that names the
test, so a ``unit`` mark cannot hide a test that belongs to ``dist``.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

TIERS = ("unit", "dist", "slow")

FAST_TIER_ENV = "RESHARD_FAST_TIER"
"""Set by ``make test-fast``: property tests of the unit tier draw a fifth of their examples (at least 20), so
the developer's loop stays under 30 s; ``make test`` draws them all."""


def examples(count: int) -> int:
    """How many examples a property test draws: ``count``, or a fifth of it (at least 20) under
    ``make test-fast``."""
    return max(20, count // 5) if os.environ.get(FAST_TIER_ENV) else count


def tiers_of(item: pytest.Item) -> list[str]:
    """The tier marks a collected test carries, from its own marks, its class's and its module's."""
    return sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})


def tier_errors(items: list[pytest.Item]) -> list[str]:
    """One line per test that has no tier or more than one."""
    errors = []
    for item in items:
        tiers = tiers_of(item)
        if len(tiers) != 1:
            found = " and ".join(tiers) if tiers else "no tier"
            errors.append(f"{item.nodeid}: {found} (mark it with exactly one of {', '.join(TIERS)})")
    return errors


class UnitGuard:
    """What a ``unit`` test tried to start, noted even when the attempt was in another thread (a server's own
    thread, whose failure the test's thread may never see): the conftest fails the test's report with it."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.violations: list[str] = []

    def refuser(self, what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            message = f"{self.nodeid} is marked unit but {what}: mark it dist (see tests/tiers.py)"
            self.violations.append(message)
            # pytest.fail raises a BaseException: a test's own ``except Exception`` cannot swallow it
            pytest.fail(message, pytrace=True)

        return refuse


@contextmanager
def unit_guard(guard: UnitGuard) -> Iterator[None]:
    """While a ``unit`` test sets up, runs and tears down: starting a subprocess, a multiprocessing (or
    torch.multiprocessing) process, forking, listening on a socket (a server), or starting a rank pool, an
    object store server or a fault proxy of the test helpers fails the test."""
    import tests.objectstores
    import tests.rankpool

    refuse = guard.refuser
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess.Popen, "_execute_child", refuse("starts a subprocess"))
        patch.setattr(multiprocessing.process.BaseProcess, "start", refuse("starts a process"))
        patch.setattr(os, "fork", refuse("forks"))
        patch.setattr(os, "forkpty", refuse("forks (a pseudo-terminal child)"))
        patch.setattr(_posixsubprocess, "fork_exec", refuse("starts a process (fork_exec)"))
        patch.setattr(os, "system", refuse("runs a shell command"))
        patch.setattr(os, "posix_spawn", refuse("spawns a process"))
        patch.setattr(os, "posix_spawnp", refuse("spawns a process"))
        patch.setattr(socket.socket, "listen", refuse("listens on a socket (starts a server)"))
        patch.setattr(socket.socket, "bind", refuse("binds a socket (a server, UDP ones included)"))
        patch.setattr(tests.rankpool.RankPool, "__init__", refuse("starts a pool of ranks"))
        patch.setattr(tests.objectstores, "start_s3_server", refuse("starts the S3 server"))
        patch.setattr(tests.objectstores, "start_gcs_server", refuse("starts the GCS server"))
        patch.setattr(tests.objectstores.FaultProxy, "start", refuse("starts a fault proxy (a server)"))
        yield
