"""Who holds a lock (:class:`LockInfo`, a marker's document) and what this process can tell about it: its machine
(:func:`machine_identity`), pid namespace and process start, so that a pid means one process. The rules that judge
holders are in :mod:`reshard.io.locking`; not collective.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LockInfo", "is_save_token", "machine_identity", "pid_namespace", "process_start", "this_process"]

_SAVE_TOKEN = re.compile(r"^[0-9a-f]{32}$")
"""The tokens a taker copies from a stale marker: save ids (``uuid4().hex``), as every writer's token is."""
_MACHINE = re.compile(r"^[0-9A-Za-z:-]{1,80}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class LockInfo:
    """What a marker says: who holds the lock (host, process id, a token unique to the holder), when the
    holder first took it (``created``) and when this marker was written (``written``), in seconds since
    the epoch by the holder's clock; ``generation`` is the marker's place in the chain. ``machine`` (the holder's
    machine identity, :func:`machine_identity`) tells machines that share a host name apart. ``pid_namespace`` and
    ``started`` (the holder's pid namespace and its process's start time, where ``/proc`` says them) make the
    process id mean one process: two containers that share a host name (host networking) have pid namespaces of
    their own, and a pid is reused once its process ends. ``dead_saves``: the tokens of every stale holder whose lock
    this holder (or a holder it took over from, and so on) took over, oldest first, recorded in the very marker of the
    takeover, so that a taker killed while it removes their files leaves them named to the next taker."""

    host: str
    pid: int
    token: str
    created: float
    written: float = 0.0
    generation: int = 0
    pid_namespace: int | None = None
    started: int | None = None
    dead_saves: tuple[str, ...] = ()
    machine: str | None = None

    def to_bytes(self) -> bytes:
        doc: dict[str, object] = {
            "host": self.host,
            "pid": self.pid,
            "token": self.token,
            "created": self.created,
            "written": self.written,
        }
        if self.machine is not None:
            doc["machine"] = self.machine
        if self.pid_namespace is not None:
            doc["pid_namespace"] = self.pid_namespace
        if self.started is not None:
            doc["started"] = self.started
        if self.dead_saves:
            doc["dead_saves"] = list(self.dead_saves)
        return json.dumps(doc).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, generation: int = 0) -> LockInfo | None:
        try:
            doc = json.loads(raw)
            created = float(doc["created"])
            return cls(
                host=str(doc["host"]),
                pid=int(doc["pid"]),
                token=str(doc["token"]),
                created=created,
                written=float(doc.get("written", created)),
                generation=generation,
                pid_namespace=_optional_int(doc.get("pid_namespace")),
                started=_optional_int(doc.get("started")),
                dead_saves=_tokens(doc.get("dead_saves", [])),
                machine=_machine(doc.get("machine")),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def describe(self) -> str:
        age = time.time() - self.created
        return f"process {self.pid} on {self.host}, for {age:.0f} s"

    def on_this_machine(self) -> bool:
        """Whether the holder ran on this machine since its last boot: the same host name and the same machine
        identity (a marker without one, of an older release or a system that has none, never is: its holder might
        be another machine of that name, whose clock and pids mean nothing here)."""
        mine = machine_identity()
        return self.host == socket.gethostname() and mine is not None and self.machine == mine

    def judged_by_pid(self) -> bool:
        """Whether the holder's pid can be looked up here: it ran on this machine, in this pid namespace."""
        here = pid_namespace()
        return self.on_this_machine() and here is not None and self.pid_namespace == here

    def holder_is_gone(self) -> bool:
        """Whether the holder provably ran on this machine in this pid namespace (:meth:`judged_by_pid`) and its
        process no longer exists (its pid is free, or another process started under it since). Any other holder
        (another machine, another pid namespace: a container with the same host name) is never judged by its
        pid."""
        if not self.judged_by_pid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # the process exists (another user's)
        if self.started is not None:
            now = process_start(self.pid)
            return now is not None and now != self.started
        return False


def _optional_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"not an integer: {value!r}")
    return value


def _machine(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _MACHINE.match(value):
        raise TypeError(f"not a machine identity: {value!r}")
    return value


def is_save_token(token: str) -> bool:
    """Whether ``token`` has the shape of a save id (the only tokens a taker copies from a stale marker)."""
    return bool(_SAVE_TOKEN.match(token))


@functools.cache
def machine_identity() -> str | None:
    """This machine's identity for as long as it runs: its boot id (Linux, unique per machine and boot), else its
    ``/etc/machine-id``, prefixed by which it is; None where neither can be read (then no holder is judged to be of
    this machine: every lock is watched for its lease)."""
    for kind, path in (("boot", "/proc/sys/kernel/random/boot_id"), ("machine", "/etc/machine-id")):
        try:
            value = f"{kind}:{Path(path).read_text(encoding='ascii').strip()}"
        except (OSError, UnicodeDecodeError):
            continue
        if _MACHINE.match(value) and len(value) > len(kind) + 8:
            return value
    return None


def _tokens(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise TypeError(f"not a list of tokens: {value!r}")
    return tuple(value)


def pid_namespace() -> int | None:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``), or None where ``/proc`` does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
        return int(raw[raw.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def this_process(token: str) -> LockInfo:
    """A marker of this process holding for ``token``, created now."""
    pid = os.getpid()
    return LockInfo(
        host=socket.gethostname(),
        pid=pid,
        token=token,
        created=time.time(),
        pid_namespace=pid_namespace(),
        started=process_start(pid),
        machine=machine_identity(),
    )
