"""Exclusive locks against concurrent writers: a chain of marker objects, each created create-only.

A save holds the lock of its checkpoint (``<checkpoint>/.lock``) from planning until its commit (or
failure); a :class:`~reshard.CheckpointManager` holds the lock of its root around its save and retention.
Two writers on one path must never interleave, and a writer that crashed must not block the path for long.

**The chain.** A lock is a sequence of *markers*: generation 0 is named ``.lock``, generation ``g > 0`` is
``.lock.<g, 12 digits>``. The lock's state is its highest generation (none: free). Every marker is
written with the storage's create-only commit (an exclusive hard link locally, ``If-None-Match: *`` on S3,
``ifGenerationMatch=0`` on GCS), so a transition from generation ``g`` to ``g + 1`` is a compare-and-swap:
of any number of writers that try it, exactly one succeeds. A marker names its holder (host, pid, a
token unique to the holder) and when it was written.

- **Acquire**: with no marker, create generation 0; with a stale holder at generation ``g`` (below),
  create ``g + 1``. Then list the markers again: the writer holds the lock only if its marker is the
  highest and, when it took over ``g``, marker ``g`` still exists (it was not released in between, which
  would let a fresh writer start a new chain at generation 0 at the same time). Then it deletes the
  markers below its own.
- **Renew**: the holder moves its lock to the next generation every ``renew_s`` seconds (a background
  thread), which is how other hosts tell a live holder from a dead one. A holder whose renewal fails
  has lost its lock; a save checks that it still holds it right before its commit.
- **Release**: the holder deletes its marker if it is still the highest.
- **Stale holders**: a holder is stale when it ran on this host and its process no longer exists, when
  it ran on this host and its marker was written more than ``stale_after_s`` ago, or when the lock does not
  move for ``lease_s`` seconds while a writer waits (measured on the waiter's own clock). A holder on another
  host is judged by that last rule only, never by its marker's ``written`` time, which is the holder's clock (a
  host whose clock runs behind would otherwise lose a live lock at once): a writer that finds a lock of another
  host waits up to ``lease_s`` for it to be released or to prove stale. One function says this rule,
  :func:`stale_at_sight`, and every judgment of a holder uses it: the judgments that do not watch (retention, the
  liveness of reference markers, lock temporaries, ``reshard gc --dry-run``) therefore never find a holder of another
  host stale, and keep what it holds for that run (retention says so); whoever needs it gone watches the lock through
  :func:`acquire_lock` (a save over it; ``reshard gc``, a single process that may wait).

Only the holder deletes markers (its predecessors after taking over, its own on release), so the checks
above are sound on any storage with create-only commits and consistent listings: local and shared POSIX
filesystems, S3 and GCS.

**Dead saves are recorded, not chained.** A writer that takes a stale holder's lock over writes, in the marker of the
takeover itself, the tokens of that holder and of every dead save that holder's marker recorded
(``LockInfo.dead_saves``); renewals carry them. So whoever removes a dead save's files (a save over it, retention,
``reshard gc``) finds every dead save since the lock was last released in the current marker, even when an
earlier taker was killed in the middle of its cleanup: nothing depends on a chain of takers that a kill can cut.

**Inheriting a stale lock.** A save's lock token is its save id, so the lock a dead save left behind is what
ties its data files to it (:mod:`reshard.io.retirement`). Whoever takes the lock of a checkpoint only to change its
files briefly (a deletion, a reference marker) acquires with ``inherit=True``: taking over a stale holder, its
marker keeps that holder's token (so the tie holds at every point of the takeover), and on release it hands the
lock back to the stale holder (a successor marker with the stale holder's identity and times) unless told that
nothing needs the tie any more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from reshard.errors import CheckpointLockedError, StorageError
from reshard.storage import FileTooLargeError, Storage

__all__ = [
    "DEFAULT_LEASE_S",
    "DEFAULT_RENEW_S",
    "DEFAULT_STALE_AFTER_S",
    "LOCK_FILE",
    "Lock",
    "LockInfo",
    "LockTiming",
    "acquire_lock",
    "foreign_holder",
    "lock_markers",
    "read_lock",
    "stale_at_sight",
]

logger = logging.getLogger("reshard")

LOCK_FILE = ".lock"
"""The name of a lock's generation-0 marker; later generations append ``.<generation>``."""
DEFAULT_RENEW_S = 15.0
"""How often a holder moves its lock to the next generation."""
DEFAULT_LEASE_S = 60.0
"""A lock that does not move for this long while a writer watches it is stale."""
DEFAULT_STALE_AFTER_S = 600.0
"""A marker written longer ago than this (by the reader's clock) is stale."""

_POLL_S = 0.25
_MAX_MARKER_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class LockTiming:
    """How a lock tells live holders from dead ones (see the module doc); every value in seconds."""

    renew_s: float = DEFAULT_RENEW_S
    lease_s: float = DEFAULT_LEASE_S
    stale_after_s: float = DEFAULT_STALE_AFTER_S

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.lease_s:
            raise ValueError(f"a lock's renew_s ({self.renew_s}) must be positive and below lease_s ({self.lease_s})")
        if self.stale_after_s <= 0:
            raise ValueError(f"a lock's stale_after_s must be positive, got {self.stale_after_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LockInfo:
    """What a marker says: who holds the lock (host, process id, a token unique to the holder), when the
    holder first took it (``created``) and when this marker was written (``written``), in seconds since
    the epoch by the holder's clock; ``generation`` is the marker's place in the chain. ``pid_namespace`` and
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

    def to_bytes(self) -> bytes:
        doc: dict[str, object] = {
            "host": self.host,
            "pid": self.pid,
            "token": self.token,
            "created": self.created,
            "written": self.written,
        }
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
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def describe(self) -> str:
        age = time.time() - self.created
        return f"process {self.pid} on {self.host}, for {age:.0f} s"

    def holder_is_gone(self) -> bool:
        """Whether the holder provably ran in this host's pid namespace and its process no longer exists (its
        pid is free, or another process started under it since). A holder in another pid namespace (a container
        with the same host name) is never judged by its pid; a marker without a namespace (written by an older
        release) is judged by the pid alone, as that release did."""
        if self.host != socket.gethostname():
            return False
        if self.pid_namespace is not None and self.pid_namespace != pid_namespace():
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
    )


def _marker_name(name: str, generation: int) -> str:
    return name if generation == 0 else f"{name}.{generation:012d}"


def lock_markers(storage: Storage, name: str = LOCK_FILE) -> dict[int, str]:
    """The markers of lock ``name`` (a name at the storage's root) that exist, by generation."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\.(\d{{12}}))?$")
    out = {}
    for found in storage.list_names(name):
        match = pattern.match(found)
        if match is not None:
            out[int(match.group(1) or 0)] = found
    return out


def _current(storage: Storage, name: str) -> tuple[int | None, LockInfo | None]:
    """The highest generation of the lock and its holder (None, None: free). A marker that cannot be
    parsed is a holder of unknown identity (never live)."""
    for _ in range(5):
        markers = lock_markers(storage, name)
        if not markers:
            return None, None
        generation = max(markers)
        try:
            raw = storage.read_bytes(markers[generation], max_bytes=_MAX_MARKER_BYTES)
        except FileNotFoundError:
            continue  # renewed or released between the listing and the read: look again
        except FileTooLargeError:
            raw = b""  # not a marker this library wrote: a holder of unknown identity
        info = LockInfo.from_bytes(raw, generation)
        if info is None:
            info = LockInfo(host="?", pid=-1, token="", created=0.0, written=0.0, generation=generation)
        return generation, info
    raise CheckpointLockedError(f"{storage.describe()}: the lock keeps changing while it is read")


def read_lock(storage: Storage, name: str = LOCK_FILE) -> LockInfo | None:
    """The lock's holder, or None when the lock is free (or cannot be read). Not collective."""
    try:
        return _current(storage, name)[1]
    except (OSError, CheckpointLockedError):
        return None


class Lock:
    """A lock this process holds (see :func:`acquire_lock`). ``renew``, ``check`` and ``release`` may be
    called from any thread; the background renewal of :meth:`start_renewing` stops at ``release``."""

    def __init__(
        self,
        storage: Storage,
        name: str,
        info: LockInfo,
        *,
        what: str,
        timing: LockTiming,
        inherited: LockInfo | None = None,
        taken_over: LockInfo | None = None,
    ) -> None:
        self.storage = storage
        self.name = name
        self.info = info
        self.what = what
        self.timing = timing
        self.inherited = inherited
        """The stale holder this lock was taken over from, keeping its token (``inherit=True``), or None."""
        self.taken_over = taken_over
        """The stale holder this lock was taken over from (inherited or not), or None: a save that takes over the
        lock of a dead save removes that save's data files (:meth:`reshard.io.commit.SaveCommit.begin`)."""
        self.lost: str | None = None
        """Why this process no longer holds the lock (None while it does)."""
        self._mutex = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def token(self) -> str:
        return self.info.token

    @property
    def generation(self) -> int:
        return self.info.generation

    def renew(self) -> None:
        """Move the lock to the next generation (proof of life for other hosts).

        Raises:
            CheckpointLockedError: another writer took the lock over (this one was judged stale).
        """
        with self._mutex:
            if self.lost is not None:
                raise CheckpointLockedError(self.lost)
            successor = _take(self.storage, self.name, self.info, basis=self.info.generation, what=self.what)
            if successor is None:
                self.lost = (
                    f"{self.storage.describe()}: this process lost the {self.what} lock (another writer took it over "
                    "after judging this one stale)"
                )
                raise CheckpointLockedError(self.lost)
            self.info = successor

    def check(self) -> None:
        """Raise CheckpointLockedError unless this process still holds the lock (call before a commit)."""
        with self._mutex:
            if self.lost is not None:
                raise CheckpointLockedError(self.lost)
            generation, holder = _current(self.storage, self.name)
            if generation != self.info.generation or holder is None or holder.token != self.token:
                self.lost = (
                    f"{self.storage.describe()}: this process lost the {self.what} lock to "
                    f"{holder.describe() if holder else 'nobody (it was removed)'}"
                )
                raise CheckpointLockedError(self.lost)

    def start_renewing(self) -> None:
        """Renew in a daemon thread every ``timing.renew_s`` seconds until :meth:`release`."""
        if self._thread is not None:
            return

        def run() -> None:
            while not self._stop.wait(self.timing.renew_s):
                try:
                    self.renew()
                except CheckpointLockedError:
                    logger.warning("%s", self.lost)
                    return
                except Exception as exc:  # a failed renewal is retried at the next interval
                    logger.warning("renewing the %s lock of %s failed: %s", self.what, self.storage.describe(), exc)

        self._thread = threading.Thread(target=run, name="reshard-lock-renewal", daemon=True)
        self._thread.start()

    def release(self, *, hand_back: bool = True) -> None:
        """Stop renewing and remove this process's marker if it is still the lock's current one; a lock
        :attr:`inherited` from a stale holder goes back to that holder instead, unless ``hand_back`` is False
        (nothing needs what the stale lock tied any more). Best effort, never raises."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._mutex:
            try:
                generation, holder = _current(self.storage, self.name)
                if generation == self.info.generation and holder is not None and holder.token == self.token:
                    if self.inherited is not None and hand_back:
                        stale = self.inherited
                        _take(self.storage, self.name, stale, basis=generation, what=self.what, written=stale.written)
                    else:
                        self.storage.delete(_marker_name(self.name, generation))
            except (OSError, CheckpointLockedError) as exc:
                logger.warning("could not release the %s lock of %s: %s", self.what, self.storage.describe(), exc)
            self.lost = self.lost or "released"


def _take(
    storage: Storage, name: str, holder: LockInfo, *, basis: int | None, what: str, written: float | None = None
) -> LockInfo | None:
    """Try to move the lock from generation ``basis`` (None: free) to the next one for ``holder`` (written now,
    or at ``written``); the new marker on success, None when another writer got there first."""
    generation = 0 if basis is None else basis + 1
    mine = LockInfo(
        host=holder.host,
        pid=holder.pid,
        token=holder.token,
        created=holder.created,
        written=time.time() if written is None else written,
        generation=generation,
        pid_namespace=holder.pid_namespace,
        started=holder.started,
        dead_saves=holder.dead_saves,
    )
    marker = _marker_name(name, generation)
    document = mine.to_bytes()
    try:
        storage.commit(marker, document, replace=False)
    except FileExistsError:
        try:
            existing = storage.read_bytes(marker, max_bytes=_MAX_MARKER_BYTES)
        except (FileNotFoundError, FileTooLargeError):
            existing = b""
        if existing != document:
            return None
        # a retried create-only write whose first answer was lost: the marker is this one
    except OSError as exc:
        raise StorageError(f"cannot take the {what} lock: writing {storage.describe(marker)} failed: {exc}") from exc
    markers = lock_markers(storage, name)
    if max(markers, default=-1) != generation or (basis is not None and basis not in markers):
        # A later generation exists, or the marker taken over was released meanwhile (so a fresh chain may
        # have started beside this one): this marker is void.
        with contextlib.suppress(OSError):
            storage.delete(marker)
        return None
    for older, older_name in markers.items():
        if older < generation:
            with contextlib.suppress(OSError):
                storage.delete(older_name)
    return mine


def acquire_lock(
    storage: Storage,
    token: str,
    *,
    what: str,
    name: str = LOCK_FILE,
    timing: LockTiming | None = None,
    inherit: bool = False,
) -> Lock:
    """Take the lock ``name`` of ``storage`` for ``token``, taking over from a stale holder (with a
    warning), and waiting up to ``timing.lease_s`` for a holder on another host to release the lock or to
    prove stale. With ``inherit``, a stale holder taken over keeps its token (see the module doc). Not
    collective: one process (a group's coordinator) calls it.

    Raises:
        CheckpointLockedError: another live writer holds it.
        StorageError: the marker could not be written (a full disk, no permission).
    """
    timing = timing or LockTiming()
    me = this_process(token)
    watched: tuple[int, float] | None = None  # a remote holder's generation, and since when (monotonic)
    started = time.monotonic()
    while True:
        generation, holder = _current(storage, name)
        if holder is None or generation is None:
            taken = _take(storage, name, me, basis=None, what=what)
        elif holder.token == token:
            return Lock(storage, name, holder, what=what, timing=timing)
        else:
            now = time.monotonic()
            if watched is not None and watched[0] != generation:
                raise CheckpointLockedError(
                    f"{storage.describe()} is being written by another save ({what} lock held by "
                    f"{holder.describe()}, renewed while this process waited); two writers must not share a "
                    "checkpoint path"
                )
            if watched is None:
                watched = (generation, now)
            unmoved = now - watched[1]
            if not (stale_at_sight(holder, timing.stale_after_s) or unmoved >= timing.lease_s):
                if holder.host == socket.gethostname():
                    raise CheckpointLockedError(
                        f"{storage.describe()} is being written by another save ({what} lock held by "
                        f"{holder.describe()}); two writers must not share a checkpoint path"
                    )
                time.sleep(_POLL_S)  # a holder on another host: wait for it to renew, release or go stale
                continue
            logger.warning(
                "breaking the stale %s lock of %s (held by %s%s)",
                what,
                storage.describe(),
                holder.describe(),
                f", unchanged for {unmoved:.0f} s" if unmoved >= timing.lease_s else "",
            )
            heir = inherit and bool(holder.token)  # a marker of unknown identity ties nothing: nothing to inherit
            taker = _heir(me, holder) if heir else _successor(me, holder)
            taken = _take(storage, name, taker, basis=generation, what=what)
            if taken is not None:
                return Lock(
                    storage,
                    name,
                    taken,
                    what=what,
                    timing=timing,
                    inherited=holder if heir else None,
                    taken_over=holder,
                )
            watched = None
        if taken is not None:
            return Lock(storage, name, taken, what=what, timing=timing)
        if time.monotonic() - started > 2 * timing.lease_s:
            raise CheckpointLockedError(
                f"{storage.describe()}: could not take the {what} lock (other writers keep taking it)"
            )


def stale_at_sight(holder: LockInfo, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> bool:
    """Whether ``holder`` is stale without watching its lock: a holder of unknown identity, one of this host that is
    gone, or one of this host whose marker is older than ``stale_after_s`` (one clock wrote and reads it). A holder on
    another host never is: its ``written`` time is by its own clock, which may run behind this one, so only the lease
    measured here, while watching, judges it (:func:`acquire_lock`). The one rule of every judgment of a holder (see
    the module doc); a caller that does not watch keeps what a foreign holder holds."""
    if not holder.token:
        return True  # a marker reshard did not write (or cannot read): it ties nothing and renews never
    if holder.host != socket.gethostname():
        return False
    return time.time() - max(holder.written, holder.created) > stale_after_s or holder.holder_is_gone()


def foreign_holder(holder: LockInfo) -> bool:
    """Whether ``holder`` ran on another host (judged only by watching its lock: :func:`stale_at_sight`)."""
    return bool(holder.token) and holder.host != socket.gethostname()


def _heir(me: LockInfo, stale: LockInfo) -> LockInfo:
    """``me`` holding the token of the ``stale`` holder it takes over from (and its record of dead saves)."""
    return dataclasses.replace(me, token=stale.token, dead_saves=stale.dead_saves)


MAX_DEAD_SAVES = 1024
"""The most dead saves a marker records (the newest; a marker stays far below the 64 KiB a reader reads)."""


def _successor(me: LockInfo, stale: LockInfo) -> LockInfo:
    """``me`` taking over from ``stale``, recording ``stale``'s token after the dead saves ``stale`` recorded: the
    marker of the takeover names them all before the taker deletes anything of theirs (see the module doc)."""
    dead = [t for t in stale.dead_saves if t != me.token]
    if stale.token and stale.token != me.token and stale.token not in dead:
        dead.append(stale.token)
    return dataclasses.replace(me, dead_saves=tuple(dead[-MAX_DEAD_SAVES:]))
