"""The tiers of the suite (tests/tiers.py): a test has exactly one, and a unit test cannot start a process or a
server: the guard refuses it, in the test's thread and in others."""

from __future__ import annotations

import contextlib
import multiprocessing
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field

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
            server.bind(("127.0.0.1", 0))
            with pytest.raises(pytest.fail.Exception, match="listens on a socket"):
                server.listen()
    assert len(guard.violations) == 2


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
