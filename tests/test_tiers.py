"""The tiers of the suite (tests/tiers.py): a test has exactly one, and a unit test cannot start a process or a
server: the guard refuses it, in the test's thread and in others."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import multiprocessing.util
import os
import pty
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.conftest import UNIT_GUARD
from tests.tiers import UnitGuard, tier_errors, unit_guard

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Marked:
    """What tier_errors reads of a collected test: its node id and its marks."""

    nodeid: str
    marks: tuple[str, ...] = field(default=())

    def iter_markers(self) -> list[pytest.Mark]:
        return [getattr(pytest.mark, name).mark for name in self.marks]


def test_a_test_with_no_tier_or_two_is_named_and_one_tier_passes() -> None:
    items = [
        Marked("a", ("unit",)),
        Marked("b", ()),
        Marked("c", ("dist", "slow", "parametrize")),
        Marked("d", ("slow",)),
    ]
    errors = tier_errors(items)  # type: ignore[arg-type]
    assert len(errors) == 2
    assert errors[0].startswith("b: no tier")
    assert errors[1].startswith("c: dist and slow")


def test_this_unit_test_runs_under_the_guard(request: pytest.FixtureRequest) -> None:
    """The conftest wraps every unit test: starting a subprocess here fails, without a guard of the test's own,
    and the refusal is noted for the report (cleared here, where it is the expected outcome)."""
    with pytest.raises(pytest.fail.Exception, match="marked unit but starts a subprocess"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)
    noted = request.node.stash[UNIT_GUARD].violations
    assert len(noted) == 1
    assert noted[0].startswith(request.node.nodeid)
    noted.clear()


def test_the_guard_refuses_processes_and_servers_and_notes_each() -> None:
    guard = UnitGuard("tests/x.py::test_y")
    with unit_guard(guard):
        with pytest.raises(pytest.fail.Exception, match=r"tests/x\.py::test_y is marked unit but starts a process"):
            multiprocessing.get_context("spawn").Process(target=print).start()
        with socket.socket() as server:
            with pytest.raises(pytest.fail.Exception, match="binds a socket"):
                server.bind(("127.0.0.1", 0))
            with pytest.raises(pytest.fail.Exception, match="listens on a socket"):
                server.listen()
    assert len(guard.violations) == 3


async def _datagram_endpoint() -> None:
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0))
    transport.close()


def _udp_server() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind(("127.0.0.1", 0))


@pytest.mark.parametrize(
    "start",
    [
        pytest.param(lambda: os.forkpty(), id="forkpty"),  # noqa: PLW0108 (looked up at call time, once patched)
        pytest.param(pty.fork, id="pty.fork"),
        pytest.param(
            lambda: multiprocessing.util.spawnv_passfds(sys.executable, [sys.executable, "-c", "pass"], ()),
            id="fork_exec",  # how the resource tracker of shared memory starts
        ),
        pytest.param(_udp_server, id="udp"),
        pytest.param(lambda: asyncio.run(_datagram_endpoint()), id="asyncio-udp"),
    ],
)
def test_the_guard_refuses_the_other_ways_to_start_a_process_or_a_server(start: Any) -> None:
    """Found by the outside attack on the tiers: a pseudo-terminal fork, the resource tracker that shared
    memory starts through ``_posixsubprocess``, a UDP server (bound, never listening), asyncio's datagram
    endpoints. Each is refused and noted."""
    guard = UnitGuard("tests/x.py::test_w")
    with unit_guard(guard), pytest.raises(pytest.fail.Exception, match=r"tests/x\.py::test_w is marked unit but"):
        start()
    assert len(guard.violations) >= 1


def test_a_start_in_another_thread_is_noted_for_the_report() -> None:
    """A server's own thread may swallow the failure; the guard's note is what fails the test's report."""
    guard = UnitGuard("tests/x.py::test_z")
    with unit_guard(guard):

        def serve() -> None:  # a server thread that swallows whatever stops it
            with contextlib.suppress(BaseException):
                subprocess.run(["true"], check=False)

        worker = threading.Thread(target=serve)
        worker.start()
        worker.join()
    assert guard.violations == [
        "tests/x.py::test_z is marked unit but starts a subprocess: mark it dist (see tests/tiers.py)"
    ]
