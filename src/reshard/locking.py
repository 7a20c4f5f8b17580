"""Exclusive locks against concurrent writers: a marker object created with a create-only write.

A save holds ``<checkpoint>/.lock`` from planning until its commit (or failure); a
:class:`~reshard.CheckpointManager` holds ``<root>/.lock`` around its save and retention. The marker is
created with the storage's create-only commit (an exclusive hard link locally; ``If-None-Match: *`` on S3,
``ifGenerationMatch=0`` on GCS, which both refuse a second creator), so of two writers exactly one gets it
and the other fails with :class:`~reshard.CheckpointLockedError`. The marker names its holder (host, pid,
a token, the time). A holder that crashed leaves its marker behind; such a lock is *stale* and is broken by
the next writer when its holder was on the same host and that process no longer exists, or when it is
older than ``stale_after_s``. Object stores without conditional writes cannot give this guarantee; S3 and
GCS both have them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import dataclass

from reshard.errors import CheckpointLockedError
from reshard.storage import Storage

__all__ = ["DEFAULT_STALE_AFTER_S", "LOCK_FILE", "LockInfo", "acquire_lock", "read_lock", "release_lock"]

logger = logging.getLogger("reshard")

LOCK_FILE = ".lock"
DEFAULT_STALE_AFTER_S = 24 * 3600.0
"""A lock older than this is broken even when its holder cannot be checked (another host)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LockInfo:
    """Who holds a lock: host, process id, a token unique to the holder, and when it was taken."""

    host: str
    pid: int
    token: str
    created: float

    def to_bytes(self) -> bytes:
        return json.dumps({"host": self.host, "pid": self.pid, "token": self.token, "created": self.created}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> LockInfo | None:
        try:
            doc = json.loads(raw)
            return cls(
                host=str(doc["host"]), pid=int(doc["pid"]), token=str(doc["token"]), created=float(doc["created"])
            )
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        age = time.time() - self.created
        return f"process {self.pid} on {self.host}, for {age:.0f} s"

    def is_stale(self, stale_after_s: float) -> bool:
        if time.time() - self.created > stale_after_s:
            return True
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
        return False


def read_lock(storage: Storage, name: str = LOCK_FILE) -> LockInfo | None:
    """The lock's holder, or None when there is no lock (or it is unreadable)."""
    try:
        return LockInfo.from_bytes(storage.read_bytes(name))
    except OSError:
        return None


def acquire_lock(
    storage: Storage, token: str, *, name: str = LOCK_FILE, stale_after_s: float = DEFAULT_STALE_AFTER_S, what: str
) -> None:
    """Take the lock ``name`` of ``storage`` for ``token``; break a stale one (with a warning).

    Raises:
        CheckpointLockedError: another live writer holds it.
    """
    info = LockInfo(host=socket.gethostname(), pid=os.getpid(), token=token, created=time.time())
    for _ in range(2):
        try:
            storage.commit(name, info.to_bytes(), replace=False)
            return
        except FileExistsError:
            holder = read_lock(storage, name)
            if holder is not None and holder.token == token:
                return  # a retried create-only write that had in fact succeeded
            if holder is not None and not holder.is_stale(stale_after_s):
                raise CheckpointLockedError(
                    f"{storage.describe()} is being written by another save ({what} lock held by "
                    f"{holder.describe()}); two writers must not share a checkpoint path"
                ) from None
            logger.warning(
                "breaking the stale %s lock of %s (held by %s)",
                what,
                storage.describe(),
                holder.describe() if holder else "an unreadable marker",
            )
            storage.delete(name)
    raise CheckpointLockedError(f"{storage.describe()}: could not take the {what} lock (another writer broke in)")


def release_lock(storage: Storage, token: str, *, name: str = LOCK_FILE) -> None:
    """Remove the lock if ``token`` still holds it; best effort, never raises."""
    try:
        holder = read_lock(storage, name)
        if holder is not None and holder.token == token:
            storage.delete(name)
    except OSError as exc:
        logger.warning("could not release the lock of %s: %s", storage.describe(), exc)
