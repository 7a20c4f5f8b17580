"""Events of a rank's process, counted so that a kill point can name one, and the record of every path the
process touched.

An *event* is one operation a flow makes that another process could observe: a collective of reshard's
protocol (gather, broadcast, scatter), a round of point-to-point tensor traffic, a storage operation of
:class:`reshard.storage.LocalStorage` (create, write, fsync, commit, delete, list, read), and any other
file-system call that changes something under the iteration's directory (Megatron's own ``common.pt`` and
``metadata.json``, an offline writer's files): the last kind comes from Python's audit hooks. Wrappers are
installed around the real methods in the rank's process only (nothing is mocked: a wrapper counts, and at
its kill point adds ``os.kill(os.getpid(), SIGKILL)``).

The same audit hook records every path the process opens, lists, stats, creates or deletes while the flow
runs (:class:`PathLog`), for the guarantee that nothing outside the checkpoint is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SAVE_ID = re.compile(r"[0-9a-f]{32}")
_GENERATION = re.compile(r"\.lock\.\d{12}")

# audit events that change the file system, and the argument that names the path
MUTATIONS = {"os.remove": 0, "os.rmdir": 0, "os.mkdir": 0, "os.rename": 0, "os.link": 1, "shutil.rmtree": 0}
READS = {"os.listdir": 0, "os.scandir": 0}


@dataclass(frozen=True)
class KillPoint:
    """Kill global rank ``rank`` at its ``index``-th event (``when``: 'before' or 'after' it), or, with
    ``delay_s`` set, after that many seconds of its flow."""

    rank: int
    index: int = -1
    when: str = "before"
    delay_s: float | None = None
    wait_for: str = ""
    """At the point, first wait (bounded) until this file of the iteration's place appears or changes (e.g.
    'ckpt/metadata.json': the coordinator has committed). For regression tests that need the victim to die
    exactly after another rank's step."""

    def describe(self) -> str:
        if self.delay_s is not None:
            return f"rank {self.rank} after {self.delay_s * 1000:.0f} ms"
        waits = f", once {self.wait_for} is written" if self.wait_for else ""
        return f"rank {self.rank} {self.when} event {self.index}{waits}"


class PathLog:
    """Every path this process touched while armed, as (operation, absolute path) pairs."""

    def __init__(self) -> None:
        self.touched: list[tuple[str, str]] = []

    def add(self, operation: str, path: Any, dir_fd: int = -1) -> None:
        if isinstance(path, int) or dir_fd not in (-1, None):
            return  # an open descriptor, or a name relative to one: its directory was recorded when opened
        try:
            text = os.fsdecode(path)
        except TypeError:
            return
        self.touched.append((operation, os.path.abspath(text)))


class Events:
    """Counts this process's events; kills it at its kill point, or holds it at a hold point until the
    victim has died (to order two ranks' steps)."""

    def __init__(
        self,
        point: KillPoint | None,
        marker: Path | None,
        place: Path,
        hold: KillPoint | None = None,
        victim_marker: Path | None = None,
    ) -> None:
        self.point = point
        self.marker = marker
        self.place = place
        self.hold = hold
        self.victim_marker = victim_marker
        self.names: list[str] = []
        self.armed = False
        self.depth = 0  # inside a wrapped storage call: its file-system calls are part of that one event
        self.paths = PathLog()
        self.before = self._watched()

    def _watched(self) -> bytes | None:
        if self.point is None or not self.point.wait_for:
            return None
        with contextlib.suppress(OSError):
            return (self.place / self.point.wait_for).read_bytes()
        return None

    def _wait(self) -> None:
        """Until the watched file differs from what it was when the flow started (at most 30 s)."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and self._watched() == self.before:
            threading.Event().wait(0.005)

    def hit(self, name: str, when: str) -> None:
        if not self.armed:
            return
        if when == "before":
            self.names.append(_GENERATION.sub(".lock.<g>", _SAVE_ID.sub("<id>", name)))
        hold = self.hold
        if hold is not None and hold.index == len(self.names) - 1 and hold.when == when and self.victim_marker:
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline and not victim_dead(self.victim_marker):
                threading.Event().wait(0.005)
        point = self.point
        if point is not None and point.delay_s is None and point.index == len(self.names) - 1 and point.when == when:
            if point.wait_for:
                self._wait()
            self.kill(f"{when} {self.names[-1]}")
        # An event of the audit hook (a file-system call outside any wrapped one) is seen before its call only: the
        # kill "after" it comes at the next event, once its call is done (it never came: a sampled point missed).
        audit_after = point is not None and point.when == "after" and point.index == len(self.names) - 2
        if point is not None and audit_after and point.delay_s is None and when == "before":
            if point.wait_for:
                self._wait()
            self.kill(f"after {self.names[-2]} (at {self.names[-1]})")

    def kill(self, where: str) -> None:
        self.armed = False
        if self.marker is not None:
            self.marker.write_text(json.dumps({"where": where, "events": len(self.names), "pid": os.getpid()}))
        os.kill(os.getpid(), signal.SIGKILL)

    def kill_if_armed(self, where: str) -> None:
        """A timed kill: only while the flow's operation runs (not while the harness regroups the ranks:
        a rank dying in the harness's own rendezvous tests torch.distributed, not reshard)."""
        if self.armed:
            self.kill(where)

    @contextlib.contextmanager
    def event(self, name: str) -> Iterator[None]:
        """One event around a call: counted before and after, file-system calls inside it not counted."""
        self.hit(name, "before")
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        self.hit(name, "after")

    def audit(self, event: str, args: tuple[Any, ...]) -> None:
        """The audit hook: record touched paths; a file-system change outside any wrapped call under the
        place is an event of its own (before only: the hook runs before the call)."""
        if not self.armed:
            return
        if event == "open":
            path, mode, flags = args
            self.paths.add("open", path)
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR)
            )
            if writing and self.depth == 0 and self._under_place(path):
                self.hit(f"write {self._relative(path)}", "before")
        elif event in MUTATIONS or event in READS:
            index = (MUTATIONS | READS)[event]
            dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir") and len(args) > 1 else -1
            self.paths.add(event, args[index], dir_fd if isinstance(dir_fd, int) else -1)
            if event in MUTATIONS and self.depth == 0 and dir_fd in (-1, None) and self._under_place(args[index]):
                self.hit(f"{event} {self._relative(args[index])}", "before")

    def _under_place(self, path: Any) -> bool:
        if isinstance(path, int):
            return False
        with contextlib.suppress(TypeError, ValueError):
            return os.path.abspath(os.fsdecode(path)).startswith(str(self.place) + os.sep)
        return False

    def _relative(self, path: Any) -> str:
        return os.path.relpath(os.path.abspath(os.fsdecode(path)), self.place)


def victim_dead(marker: Path) -> bool:
    """Whether the victim that wrote ``marker`` has died (its process is gone or a zombie)."""
    try:
        pid = json.loads(marker.read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def _wrap(owner: type, name: str, events: Events, label: Callable[..., str]) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with events.event(label(self, *args, **kwargs)):
            return original(self, *args, **kwargs)

    setattr(owner, name, wrapper)


def _record_stats(events: Events) -> None:
    """``os.stat`` and ``os.lstat`` have no audit event: wrap them (pathlib calls them through ``os``)."""
    for name in ("stat", "lstat"):
        original = getattr(os, name)

        def recorded(path: Any, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if events.armed and kwargs.get("dir_fd") is None:
                events.paths.add("stat", path)
            return _original(path, *args, **kwargs)

        setattr(os, name, recorded)


def instrument(events: Events) -> None:
    """Install the event wrappers and the audit hook in this process (a rank of an iteration; never the
    test process)."""
    from reshard.net.comm import Communicator
    from reshard.net.transports import TorchTransport
    from reshard.storage import LocalStorage
    from reshard.storage.local import _LocalWriter

    for method in ("gather_bytes", "broadcast_bytes", "scatter_bytes"):
        _wrap(Communicator, method, events, lambda self, *a, m=method, **k: m)
    _wrap(TorchTransport, "exchange", events, lambda self, *a, **k: "exchange")
    for method in ("open_writer", "commit", "delete", "delete_prefix", "sync_dir", "read_bytes", "prepare_root"):
        _wrap(LocalStorage, method, events, lambda self, name="", *a, m=method, **k: f"{m} {name}")
    for method in ("list_files", "list_names", "exists", "size"):
        _wrap(LocalStorage, method, events, lambda self, name="", *a, m=method, **k: f"{m} {name}")
    _wrap(_LocalWriter, "write", events, lambda self, data: f"write {self.path.name}")
    _wrap(_LocalWriter, "commit", events, lambda self: f"fsync {self.path.name}")
    _wrap_functions(events)
    _record_stats(events)
    sys.addaudithook(events.audit)


def _wrap_functions(events: Events) -> None:
    """Events made outside reshard's own layers: ``torch.save`` (Megatron's ``common.pt``: its file is
    opened in C++, out of the audit hook's sight) and the collectives other libraries call directly
    (Megatron's consistency checks), counted when not inside a reshard event."""
    import torch
    import torch.distributed as dist

    def wrapped(owner: Any, name: str, label: Callable[..., str]) -> None:
        original = getattr(owner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if events.depth:
                return original(*args, **kwargs)
            with events.event(label(*args, **kwargs)):
                return original(*args, **kwargs)

        setattr(owner, name, call)

    wrapped(torch, "save", lambda obj, f, *a, **k: f"torch.save {os.path.basename(str(f))}")
    for name in ("barrier", "all_gather_object", "gather_object", "broadcast_object_list", "all_reduce"):
        wrapped(dist, name, lambda *a, n=name, **k: f"torch.distributed.{n}")
