"""Who holds a lock, and whether that process is gone (reshard.io.locking.LockInfo.holder_is_gone): a pid means
one process only within one pid namespace and while that process lives. Found by the outside attack on issue 38's
dead-writer fix: two containers sharing a host name (host networking) judged each other's live saves dead, and a
reused pid kept a dead save's lock."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from reshard.io.locking import (
    DEFAULT_STALE_AFTER_S,
    LOCK_FILE,
    LockInfo,
    LockTiming,
    acquire_lock,
    pid_namespace,
    process_start,
    this_process,
)
from reshard.storage import storage_for

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


def test_a_live_holder_on_another_host_whose_clock_is_behind_is_watched_not_broken_at_once(tmp_path: Path) -> None:
    """Found by the second outside attack (F5): staleness compared a marker's ``written`` time (the holder's clock)
    with this host's clock, so a live writer on a host whose clock runs 10+ minutes behind lost its lock at once. A
    holder on another host is judged on the observer's clock only: its marker must stay unchanged (not renewed)
    for ``lease_s`` as measured here before it is taken over."""
    storage = storage_for(tmp_path)
    behind = time.time() - 11 * 60  # the holder's clock runs 11 minutes behind this host's
    holder = LockInfo(host="another-host.example", pid=4242, token="f" * 32, created=behind, written=behind)
    storage.commit(LOCK_FILE, holder.to_bytes(), replace=False)
    timing = LockTiming(renew_s=0.1, lease_s=1.0, stale_after_s=DEFAULT_STALE_AFTER_S)
    started = time.monotonic()
    lock = acquire_lock(storage, "0" * 32, what="save", timing=timing)
    try:
        assert time.monotonic() - started >= timing.lease_s  # watched for the lease first, not broken at once
        assert lock.taken_over is not None and lock.taken_over.host == "another-host.example"
    finally:
        lock.release()
        storage.close()
