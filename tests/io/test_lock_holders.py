"""Who holds a lock, and whether that process is gone (reshard.io.locking.LockInfo.holder_is_gone): a pid means
one process only within one pid namespace and while that process lives. Found by the outside attack on issue 38's
dead-writer fix: two containers sharing a host name (host networking) judged each other's live saves dead, and a
reused pid kept a dead save's lock."""

from __future__ import annotations

import dataclasses
import os

import pytest

from reshard.io.locking import LockInfo, pid_namespace, process_start, this_process

pytestmark = pytest.mark.unit


def _free_pid() -> int:
    """A pid no process has now (the highest pids are rarely in use)."""
    for pid in range(4_194_000, 4_194_304):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    pytest.skip("no free pid found")


def test_this_process_records_its_namespace_and_start_and_is_alive() -> None:
    me = this_process("t")
    assert me.pid == os.getpid() and me.pid_namespace == pid_namespace() and me.started == process_start(me.pid)
    if me.pid_namespace is None:
        pytest.skip("this system's /proc gives no pid namespace")
    assert not me.holder_is_gone()
    assert LockInfo.from_bytes(me.to_bytes()) == me


def test_a_holder_in_another_pid_namespace_is_never_judged_by_its_pid() -> None:
    me = this_process("t")
    if me.pid_namespace is None:
        pytest.skip("this system's /proc gives no pid namespace")
    elsewhere = dataclasses.replace(me, pid=_free_pid(), pid_namespace=me.pid_namespace + 1)
    assert not elsewhere.holder_is_gone()
    assert dataclasses.replace(elsewhere, pid_namespace=me.pid_namespace).holder_is_gone()


def test_a_pid_reused_by_another_process_is_a_gone_holder() -> None:
    me = this_process("t")
    if me.started is None:
        pytest.skip("this system's /proc gives no process start time")
    assert dataclasses.replace(me, started=me.started - 1).holder_is_gone()
    assert not dataclasses.replace(me, started=None).holder_is_gone()


def test_a_marker_of_an_older_release_is_judged_by_its_pid_as_before() -> None:
    legacy = LockInfo.from_bytes(
        b'{"host": "%s", "pid": %d, "token": "t", "created": 1.0}' % (os.uname().nodename.encode(), _free_pid())
    )
    assert legacy is not None and legacy.pid_namespace is None and legacy.started is None
    assert legacy.holder_is_gone()
    assert LockInfo.from_bytes(b'{"host": "h", "pid": 1, "token": "t", "created": 1.0, "started": "x"}') is None
