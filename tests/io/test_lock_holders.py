"""Who holds a lock, and whether that process is gone (reshard.io.locking.LockInfo.holder_is_gone): a pid means
one process only within one pid namespace and while that process lives. Found by the outside attack on issue 38's
dead-writer fix: two containers sharing a host name (host networking) judged each other's live saves dead, and a
reused pid kept a dead save's lock."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import uuid
from pathlib import Path

import pytest
import torch

import reshard
from reshard.flows.manager import step_name
from reshard.io.locking import (
    DEFAULT_LEASE_S,
    DEFAULT_STALE_AFTER_S,
    LOCK_FILE,
    LockInfo,
    LockTiming,
    acquire_lock,
    foreign_holder,
    pid_namespace,
    process_start,
    read_lock,
    stale_at_sight,
    this_process,
)
from reshard.io.retirement import remove_checkpoint
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


def test_a_marker_of_an_older_release_is_watched_not_judged_by_its_pid() -> None:
    """Issue 38 G4: a marker without a machine identity (an older release) may be of another machine with this host
    name: it is never judged by its pid nor its written time (it is watched for the lease)."""
    legacy = LockInfo.from_bytes(
        b'{"host": "%s", "pid": %d, "token": "t", "created": 1.0}' % (os.uname().nodename.encode(), _free_pid())
    )
    assert legacy is not None and legacy.pid_namespace is None and legacy.started is None and legacy.machine is None
    assert not legacy.holder_is_gone() and not stale_at_sight(legacy) and foreign_holder(legacy)
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
    timing = LockTiming(renew_s=0.1, lease_s=0.3, stale_after_s=DEFAULT_STALE_AFTER_S)
    started = time.monotonic()
    lock = acquire_lock(storage, "0" * 32, what="save", timing=timing)
    try:
        assert time.monotonic() - started >= timing.lease_s  # watched for the lease first, not broken at once
        assert lock.taken_over is not None and lock.taken_over.host == "another-host.example"
    finally:
        lock.release()
        storage.close()


def _foreign_marker(token: str) -> bytes:
    """The lock marker of a live save on another host whose clock runs 11 minutes behind this host's."""
    behind = time.time() - 11 * 60
    return LockInfo(host="another-host.example", pid=4242, token=token, created=behind, written=behind).to_bytes()


def test_retention_keeps_the_files_a_live_save_of_a_host_behind_references(tmp_path: Path) -> None:
    """Found by the second outside attack (F6): a reference marker is live while its referrer's save runs, judged by
    that save's lock without watching it, by the marker's ``written`` time (the holder's clock). An incremental save
    running on a host 11 minutes behind had its marker judged stale, and the deletion of the checkpoint it references
    deleted the files it uses. A foreign holder is never stale at sight: the files are kept (the holder retired)."""
    holder = tmp_path / "root" / step_name(1)
    reshard.save({"w": torch.ones(64)}, holder)
    files = sorted(f"data/{p.name}" for p in (holder / "data").iterdir())
    referrer_save = uuid.uuid4().hex
    marker = {"checkpoint": step_name(2), "save_id": referrer_save, "files": files}
    (holder / "refs").mkdir()
    (holder / "refs" / f"{step_name(2)}.{referrer_save}.json").write_text(json.dumps(marker))
    referrer = tmp_path / "root" / step_name(2)
    referrer.mkdir()
    (referrer / LOCK_FILE).write_bytes(_foreign_marker(referrer_save))
    storage = storage_for(holder)
    try:
        removal = remove_checkpoint(storage)
    finally:
        storage.close()
    assert removal.retired and removal.kept == files
    assert all((holder / name).exists() for name in files), "a file a live save references was deleted"


def test_retention_keeps_a_step_a_live_save_of_a_host_behind_is_writing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """(F6) Retention judged the lock of a step being written on a host 11 minutes behind by its ``written`` time:
    dead, so it removed the step's files (after watching the lock for the lease on the coordinator, while the other
    ranks waited). Now it keeps the step for this run without waiting, and says why."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1)
    manager.save(1, {"w": torch.ones(8)})
    running = root / step_name(2)
    (running / "data").mkdir(parents=True)
    save_id = uuid.uuid4().hex
    (running / "data" / f"{save_id}-r00000.bin").write_bytes(b"being written")
    (running / LOCK_FILE).write_bytes(_foreign_marker(save_id))
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="reshard"):
        manager.save(3, {"w": torch.ones(8)})
    assert time.monotonic() - started < DEFAULT_LEASE_S / 2, "retention watched a lock on the coordinator"
    assert (running / "data" / f"{save_id}-r00000.bin").exists(), "retention deleted a live save's file"
    assert f"kept {step_name(2)}: its lock by host another-host.example has not been seen unchanged" in caplog.text


# ---- issue 38, third outside attack: holders that share a host name, and markers that must stay readable -------


WATCH_LEASE_S = 0.3
"""The lease of the takeovers below: a holder judged only by watching is taken after it, one judged by pid at once."""


def _watched_then_taken(tmp_path: Path, marker: bytes) -> float:
    """Write ``marker`` as a lock's holder, take the lock with a lease of ``WATCH_LEASE_S``; how long that took (a
    holder judged only by watching is taken over once its lock has not moved for the lease)."""
    storage = storage_for(tmp_path)
    (tmp_path / LOCK_FILE).write_bytes(marker)
    started = time.monotonic()
    lock = acquire_lock(storage, "c" * 32, what="save", timing=LockTiming(renew_s=0.1, lease_s=WATCH_LEASE_S))
    try:
        assert lock.taken_over is not None and lock.taken_over.token == "b" * 32
        return time.monotonic() - started
    finally:
        lock.release()
        storage.close()


def _as_json(info: LockInfo, **changes: object) -> bytes:
    """The marker of ``info`` with its document's members changed (members an older release did not know too)."""
    return json.dumps({**json.loads(info.to_bytes()), **changes}).encode()


def test_a_dead_holder_of_this_host_in_another_pid_namespace_is_watched_then_taken_over(tmp_path: Path) -> None:
    """G3: a save in a container (host networking: this host name, its own pid namespace) killed, and its container
    restarted in a new namespace: its pid means nothing here, so the lock was refused at once on every attempt until
    the marker was 10 minutes old. A holder that cannot be judged by its pid is watched for the lease."""
    me = this_process("b" * 32)
    if me.pid_namespace is None:
        pytest.skip("this system's /proc gives no pid namespace")
    dead = dataclasses.replace(me, pid=_free_pid(), pid_namespace=me.pid_namespace + 1, written=time.time())
    assert _watched_then_taken(tmp_path, dead.to_bytes()) >= WATCH_LEASE_S


@pytest.mark.parametrize("where", ["container, clock 11 minutes behind", "bare metal, init pid namespace"])
def test_a_live_holder_on_another_machine_with_this_host_name_is_watched(tmp_path: Path, where: str) -> None:
    """G4: machines that share a host name judged each other's live locks by this machine's clock and pids: (i) a
    container holder on a machine 11 minutes behind was taken over at once (its marker looked old); (ii) a
    bare-metal holder is in the init pid namespace, whose inode is the same on every Linux machine, so its pid was
    looked up in this machine's /proc and judged gone. A marker records its machine (boot id): another machine's
    holder is watched for the lease, whatever its host name."""
    me = this_process("b" * 32)
    if me.pid_namespace is None or not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("this system's /proc gives no pid namespace or machine identity")
    if where.startswith("container"):
        behind = time.time() - 11 * 60
        holder = dataclasses.replace(me, pid=1234, pid_namespace=me.pid_namespace + 7, created=behind, written=behind)
    else:
        holder = dataclasses.replace(me, pid=_free_pid(), started=99, written=time.time())
    marker = _as_json(holder, machine="boot:another-machine-0000")
    assert _watched_then_taken(tmp_path, marker) >= WATCH_LEASE_S


def test_a_dead_holder_of_this_machine_and_namespace_is_still_taken_over_at_once(tmp_path: Path) -> None:
    """G4's counterpart: the machine identity does not slow down a restart on the machine whose save died."""
    me = this_process("b" * 32)
    if me.pid_namespace is None or not Path("/proc/sys/kernel/random/boot_id").exists():
        pytest.skip("this system's /proc gives no pid namespace or machine identity")
    dead = dataclasses.replace(me, pid=_free_pid(), written=time.time())
    assert dead.holder_is_gone() and stale_at_sight(dead)
    assert _watched_then_taken(tmp_path, dead.to_bytes()) < WATCH_LEASE_S


@pytest.mark.parametrize("inherit", [False, True])
def test_a_takers_marker_stays_readable_after_an_oversized_stale_one(tmp_path: Path, inherit: bool) -> None:
    """G5: a hostile (or damaged) stale marker just under the 64 KiB a reader reads: its token and dead saves were
    copied whole into the taker's marker, which then read as a holder of unknown identity (stale at sight): a second
    save took the live save's lock at once. Only save ids are copied, and the record is trimmed (oldest first) to
    keep the marker small: a taker's marker reads back as itself, and a second writer is refused."""
    storage = storage_for(tmp_path)
    doc = json.loads(dataclasses.replace(this_process("x"), pid=_free_pid(), created=1.0, written=1.0).to_bytes())
    doc["token"] = "d" * (32 if inherit else 64)  # a save id, or a token that is none (not copied)
    doc["dead_saves"] = [f"{i:032x}" for i in range(1, 1600)]  # 1599 well-formed save ids: more than fit
    doc["dead_saves"].insert(0, "z" * (65_000 - len(json.dumps(doc, separators=(",", ":")))))  # and a huge one
    (tmp_path / LOCK_FILE).write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    assert 64_000 < (tmp_path / LOCK_FILE).stat().st_size < 64 * 1024
    first = acquire_lock(storage, "a" * 32, what="save", inherit=inherit)
    try:
        held = read_lock(storage)
        assert held is not None and held.token == first.token and held.pid == os.getpid(), held
        assert held.token == ("d" * 32 if inherit else "a" * 32)
        assert held.dead_saves[-1] == f"{1599:032x}" and all(len(t) == 32 for t in held.dead_saves)
        first.renew()
        assert read_lock(storage) == first.info
        with pytest.raises(reshard.CheckpointLockedError):
            acquire_lock(storage, "b" * 32, what="save")
        first.check()
    finally:
        first.release(hand_back=False)
        storage.close()
