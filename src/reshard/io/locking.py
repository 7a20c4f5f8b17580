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
- **Stale holders**: a holder is stale when it ran on this machine, in this pid namespace, and its process no
  longer exists, when it ran on this machine and its marker was written more than ``stale_after_s`` ago, or when
  the lock does not move for ``lease_s`` seconds while a writer waits (measured on the waiter's own clock). *This
  machine* means the same host name **and** the same machine identity (``LockInfo.machine``: Linux's boot id,
  ``/proc/sys/kernel/random/boot_id``, unique per machine and boot; else ``/etc/machine-id``): host names are not
  unique in practice (containers given one ``--hostname``, hosts all called ``localhost``), and the init pid
  namespace has the same inode on every Linux machine. A holder of another machine (or of this one before a
  reboot, or a marker without an identity: older releases, systems that have none) is judged by the lease rule
  only, never by its marker's ``written`` time, which is the holder's clock (a machine whose clock runs behind would
  otherwise lose a live lock at once), nor by its pid; so is a holder of this machine in another pid namespace (a
  container restarted after a kill), whose pid means nothing here. A writer that finds such a lock waits up to
  ``lease_s`` for it to be released or to prove stale. One function says this rule,
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

**A marker stays small.** A reader reads at most 64 KiB of a marker, and one it cannot read is a holder of unknown
identity (stale at sight): so only tokens shaped as save ids (32 lowercase hex digits) are ever copied from a stale
marker into a taker's (its own token when it inherits, its dead saves), and the record of dead saves is trimmed,
oldest first, until the marker is at most half that limit. Every marker written reads back as its writer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import threading
import time
from dataclasses import dataclass

from reshard.errors import CheckpointLockedError, StorageError
from reshard.io.holders import LockInfo, is_save_token, machine_identity, pid_namespace, process_start, this_process
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
    "is_save_token",
    "lock_markers",
    "machine_identity",
    "pid_namespace",
    "process_start",
    "read_lock",
    "stale_at_sight",
    "this_process",
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
_MARKER_BUDGET_BYTES = _MAX_MARKER_BYTES // 2
"""The most a marker this library writes takes (its record of dead saves is trimmed to fit)."""


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


def _marker_name(name: str, generation: int) -> str:
    return name if generation == 0 else f"{name}.{generation:012d}"


def lock_markers(storage: Storage, name: str = LOCK_FILE) -> dict[int, str]:
    """The markers of lock ``name`` (a name at the storage's root) that exist, by generation."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\.([0-9]{{12}}))?$")
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
    stamp = time.time() if written is None else written
    mine = _bounded(dataclasses.replace(holder, written=stamp, generation=generation))
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
        _withdraw(storage, marker, document)
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


def _withdraw(storage: Storage, marker: str, document: bytes) -> None:
    """After a create-only write of ``marker`` that failed: a write that failed after its link (the temporary's
    removal, the directory's fsync) left the marker in place, naming this live process, which would hold the lock
    against every writer while it lives; delete it when it is ours (best effort)."""
    with contextlib.suppress(OSError):
        if storage.read_bytes(marker, max_bytes=_MAX_MARKER_BYTES) == document:
            storage.delete(marker)


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
                if not foreign_holder(holder):  # its pid is alive here: no need to watch
                    raise CheckpointLockedError(
                        f"{storage.describe()} is being written by another save ({what} lock held by "
                        f"{holder.describe()}); two writers must not share a checkpoint path"
                    )
                time.sleep(_POLL_S)  # a holder judged only by watching: wait for it to renew, release or go stale
                continue
            logger.warning(
                "breaking the stale %s lock of %s (held by %s%s)",
                what,
                storage.describe(),
                holder.describe(),
                f", unchanged for {unmoved:.0f} s" if unmoved >= timing.lease_s else "",
            )
            heir = inherit and is_save_token(holder.token)  # another token ties no file: nothing to inherit
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
    """Whether ``holder`` is stale without watching its lock: a holder of unknown identity, or one of this machine
    (:meth:`LockInfo.on_this_machine`) whose marker is older than ``stale_after_s`` (one clock wrote and reads it) or
    whose process is gone (judged by its pid only in this pid namespace). A holder of another machine never is: its
    ``written`` time is by its own clock, which may run behind this one, so only the lease measured here, while
    watching, judges it (:func:`acquire_lock`). The one rule of every judgment of a holder (see the module doc); a
    caller that does not watch keeps what a :func:`foreign_holder` holds."""
    if not holder.token:
        return True  # a marker reshard did not write (or cannot read): it ties nothing and renews never
    if not holder.on_this_machine():
        return False
    return time.time() - max(holder.written, holder.created) > stale_after_s or holder.holder_is_gone()


def foreign_holder(holder: LockInfo) -> bool:
    """Whether ``holder`` can be proven gone only by watching its lock for the lease: it ran on another machine (or
    its marker does not say which), or in another pid namespace of this one (see :func:`stale_at_sight`)."""
    return bool(holder.token) and not holder.judged_by_pid()


def _heir(me: LockInfo, stale: LockInfo) -> LockInfo:
    """``me`` holding the token of the ``stale`` holder it takes over from (a save id) and its record of dead
    saves (bounded when written: :func:`_bounded`)."""
    return dataclasses.replace(me, token=stale.token, dead_saves=stale.dead_saves)


def _successor(me: LockInfo, stale: LockInfo) -> LockInfo:
    """``me`` taking over from ``stale``, recording ``stale``'s token after the dead saves ``stale`` recorded: the
    marker of the takeover names them all before the taker deletes anything of theirs (see the module doc). Only
    save ids are copied (another token ties no file); :func:`_take` bounds the record."""
    dead = [t for t in stale.dead_saves if t != me.token]
    if is_save_token(stale.token) and stale.token != me.token and stale.token not in dead:
        dead.append(stale.token)
    return dataclasses.replace(me, dead_saves=tuple(dead))


def _bounded(info: LockInfo) -> LockInfo:
    """``info`` as a marker may say it: its record of dead saves holds save ids only, trimmed oldest first until
    the marker takes at most half of what a reader reads (32 KiB: at most 910 save ids of 36 bytes each), so
    that every marker written reads back as its writer (a hostile or damaged stale marker copied whole would make
    the taker's unreadable: a holder of unknown identity, stale at sight)."""
    dead = [t for t in info.dead_saves if is_save_token(t)]
    room = _MARKER_BUDGET_BYTES - len(dataclasses.replace(info, dead_saves=()).to_bytes()) - len(', "dead_saves": []')
    keep = 0
    for token in reversed(dead):  # the newest first: each takes its quotes and a separator
        room -= len(token) + 4
        if room < 0:
            break
        keep += 1
    return dataclasses.replace(info, dead_saves=tuple(dead[len(dead) - keep :]))
