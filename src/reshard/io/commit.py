"""The commit protocol: the one place that writes ``metadata.json``, and what may be deleted around it.

A checkpoint exists from the instant its ``metadata.json`` is durable; that instant is a point of no
return. :class:`SaveCommit` runs the protocol of one save (``reshard.save`` on its coordinator, and the
single-process :class:`~reshard.interop.offline.CheckpointWriter`), in this order:

1. :meth:`SaveCommit.begin`: create the directory, take the save lock (renewed in the background until
   the end), refuse a complete checkpoint unless overwriting (after the cleanup below: a refused save removes the
   dead saves' files too, since its release drops the record of them). A lock taken over from a save that died (its
   holder stale: its process gone from this host, or its lock not renewed) ties that save's data files, and those of
   every dead save its marker records (the takeover records them all in this save's marker before anything is
   deleted, so a save killed inside this cleanup leaves them named to the next): those
   that no committed ``metadata.json`` lists and no reference marker protects are removed here, under the
   lock, and again right after the commit (a holder wrongly judged stale may have finished a file meanwhile),
   so that a save over an interrupted one carries none of its bytes.
2. the data files are written (by every writer rank) and made durable.
3. :meth:`SaveCommit.publish`: check that the lock is still held, make ``data/`` durable, then write
   ``metadata.json`` with the storage's atomic commit (create-only unless overwriting). Its outcome is
   one of three:

   - *committed*: the commit succeeded, or failed in a way that left our very document in place (a
     retried create-only put whose first answer was lost finds its own bytes);
   - *not committed*: nothing of ours was published (another save's document is there, or none);
   - *unknown*: the commit failed and what is there cannot be read back.

4. :meth:`SaveCommit.discard` after any failure: it deletes this save's data files **only when the
   outcome is known not to be committed**. After a commit, or when the outcome is unknown, nothing is
   deleted (an unknown outcome leaves files that ``reshard gc`` removes once it is clear they are not
   referenced), so that no failure after the point of no return can cost a committed checkpoint.
5. after a committed overwrite, still inside :meth:`SaveCommit.publish` and under the same save lock: the replaced
   checkpoint's data files that the new one does not name (best effort; never raises). Only then is the lock
   released, so the next save of the path, which may replace this one at once, never starts while the files this
   one replaced are still there (it would remove only this one's, and leave those for ``reshard gc``).
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from reshard.errors import CheckpointError, CheckpointExistsError, CheckpointLockedError, StorageError
from reshard.io.datafile import is_data_file_of
from reshard.io.locking import Lock, LockTiming, acquire_lock
from reshard.io.references import RETIRED_FILE, protected_files, refuse_a_link
from reshard.metadata import DATA_DIR, FORMAT_NAME, MAX_METADATA_BYTES, METADATA_FILE, Metadata, document_digest

if TYPE_CHECKING:
    from reshard.storage import Storage

__all__ = ["CommitOutcome", "SaveCommit", "commit_temporaries"]

logger = logging.getLogger("reshard")

_SAVE_ID = re.compile(r"^[0-9a-f]{8,}$")
"""The tokens of save locks (a save's lock token is its save id, as in its data file names)."""


_METADATA_TEMPORARY = re.compile(rf"^\.{re.escape(METADATA_FILE)}\.tmp-[0-9a-f]{{32}}$")
"""The temporary of a local commit of ``metadata.json`` (:meth:`reshard.storage.LocalStorage.commit`)."""
_DOCUMENT_START = b'{"format":"' + FORMAT_NAME.encode() + b'",'


def commit_temporaries(storage: Storage) -> list[str]:
    """The temporaries of ``metadata.json`` commits at the root of ``storage`` (``.metadata.json.tmp-<32 hex>``,
    regular files that begin as a reshard metadata document): what a save killed inside its commit left. Only a
    holder of the checkpoint's save lock may delete them (a commit runs under that lock, so none is live then); a
    file of that name that is not reshard's (a link, a FIFO, other bytes) is not listed.

    Raises:
        OSError: listing failed.
    """
    found = []
    for name in storage.list_names(f".{METADATA_FILE}.tmp-"):
        if not _METADATA_TEMPORARY.match(name):
            continue
        try:
            head = storage.read_bytes(name, max_bytes=MAX_METADATA_BYTES)[: len(_DOCUMENT_START)]
        except OSError:  # gone, a link, not a regular file, too large: not a temporary reshard left
            continue
        if head == _DOCUMENT_START:
            found.append(name)
    return found


class CommitOutcome(enum.Enum):
    """Where a save stands with respect to its commit."""

    OPEN = "open"
    """Not published yet: a failure discards the save's files."""
    COMMITTED = "committed"
    """``metadata.json`` of this save is durable: nothing it references is ever deleted by this save."""
    NOT_COMMITTED = "not committed"
    """The publication failed and left nothing of this save: its files are garbage."""
    UNKNOWN = "unknown"
    """The publication failed and its effect cannot be read back: the files are kept."""


class SaveCommit:
    """The commit protocol of one save (see the module doc). Used by one process: the coordinator of a
    save, or a single-process writer. Not thread-safe.

    Args:
        storage: the checkpoint.
        save_id: the save's id; its data files are named after it.
        overwrite: replace a complete checkpoint (the old one stays loadable until the new commit).
        lock_timing: how the save lock renews and judges stale holders.
        replaces: without ``overwrite``, the SHA-256 of the one ``metadata.json`` this save may replace (a damaged
            step that :class:`~reshard.CheckpointManager` resumed past), checked under the save lock: any other
            complete checkpoint there is refused as without ``overwrite``.
    """

    def __init__(
        self,
        storage: Storage,
        save_id: str,
        *,
        overwrite: bool,
        lock_timing: LockTiming | None = None,
        replaces: str | None = None,
    ) -> None:
        self.storage = storage
        self.save_id = save_id
        self.overwrite = overwrite
        self.replaces = replaces
        self.lock_timing = lock_timing
        self.outcome = CommitOutcome.OPEN
        self.lock: Lock | None = None
        self.replaced: set[str] = set()
        """With ``overwrite``: the data files of the checkpoint this one replaced (read before the commit)."""
        self.dead_saves: tuple[str, ...] = ()
        """The save ids of the dead saves whose stale lock this one took over (its files go: :meth:`begin`): the one
        that held it, and every one that its marker recorded (a taker killed inside its cleanup leaves them there)."""

    # ---- 1. begin ------------------------------------------------------------------------------------

    def begin(self) -> None:
        """Before anyone writes: create the directories, take the save lock, refuse to clobber a complete
        checkpoint.

        Raises:
            StorageError: the directory or the lock cannot be written.
            CheckpointLockedError: another live save holds the lock.
            CheckpointExistsError: a complete checkpoint is there and ``overwrite`` is off.
        """
        try:
            self.storage.prepare_root()
        except OSError as exc:
            raise StorageError(f"cannot create checkpoint directory {self.storage.describe()}: {exc}") from exc
        self.lock = acquire_lock(self.storage, self.save_id, what="save", timing=self.lock_timing)
        self.lock.start_renewing()
        if self.lock.taken_over is not None:
            # Recorded in this save's own marker by the takeover itself, before anything is deleted; removed before
            # any refusal below: the release of a refused save's lock would drop the record with its marker.
            self.dead_saves = tuple(t for t in self.lock.info.dead_saves if _SAVE_ID.match(t) and t != self.save_id)
            self._remove_dead_files()
            self._remove_commit_temporaries()
        try:
            exists = self.storage.exists(METADATA_FILE)
            linked = self.storage.is_link(METADATA_FILE)
        except OSError as exc:
            self.release_lock()
            raise StorageError(f"cannot check {self.storage.describe(METADATA_FILE)}: {exc}") from exc
        if linked:  # an overwrite would replace the link, and could not tell which files it replaced
            self.release_lock()
            raise StorageError(
                f"{self.storage.describe(METADATA_FILE)} is a symbolic link: reshard neither reads nor replaces a "
                "checkpoint through one (nothing was written)"
            )
        if exists and not self.overwrite and self.replaces is not None and self._holds(self.replaces):
            self.overwrite = True  # still the damaged save the caller judged, and this save holds its lock now
        if exists and not self.overwrite:
            self.release_lock()
            found = (
                "a complete checkpoint" if self._holds_a_document() else f"a {METADATA_FILE} that reshard did not write"
            )
            raise CheckpointExistsError(
                f"{self.storage.describe()} already holds {found}; pass overwrite=True (--overwrite on "
                "the command line) to replace it"
            )

    def _holds_a_document(self) -> bool:
        """Whether ``metadata.json`` here begins as a reshard document (True when it cannot be read: the message
        then says what it would have said before)."""
        try:
            raw = self.storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
        except OSError:
            return True
        return raw.startswith(_DOCUMENT_START)

    def _holds(self, digest: str) -> bool:
        """Whether ``metadata.json`` here is the document whose SHA-256 is ``digest`` (False when unreadable)."""
        try:
            raw = self.storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
        except OSError:
            return False
        return document_digest(raw) == digest

    def _remove_dead_files(self) -> None:
        """Under the lock taken over from the :attr:`dead_saves`: remove their data files that the committed
        ``metadata.json`` (if any: a dead save may have committed before it died) does not list and no reference
        marker protects. Nothing is removed when the metadata or the markers cannot be read. Best effort: a failure
        is logged (``reshard gc`` collects what is left), never raised."""
        if not self.dead_saves:
            return
        try:
            names = [
                n for n in self.storage.list_files(DATA_DIR) if any(is_data_file_of(n, d) for d in self.dead_saves)
            ]
            if not names:
                return
            listed = self._previous_files(strict=True)
            protected, _ = protected_files(self.storage)
            for name in sorted(set(names) - listed - protected):
                self.storage.delete(name)
        except (OSError, CheckpointError) as exc:
            logger.warning(
                "the data files of dead saves %s at %s are kept for `reshard gc`: %s",
                ", ".join(self.dead_saves),
                self.storage.describe(),
                exc,
            )

    def _remove_commit_temporaries(self) -> None:
        """Under the lock taken over from a dead holder: remove the temporaries of ``metadata.json`` commits
        (:func:`commit_temporaries`: a save killed inside its commit left one; no commit runs while this save holds
        the lock). Best effort: a failure is logged, never raised."""
        try:
            for name in commit_temporaries(self.storage):
                self.storage.delete(name)
        except OSError as exc:
            logger.warning("the commit temporaries at %s are kept: %s", self.storage.describe(), exc)

    def release_lock(self) -> None:
        """Release the save lock (best effort; never raises)."""
        if self.lock is not None:
            self.lock.release()

    # ---- 3. publish ----------------------------------------------------------------------------------

    def publish(
        self, document: bytes, *, parts: Sequence[tuple[str, bytes]] = (), keep: Collection[str] | None = None
    ) -> None:
        """Commit ``document`` as ``metadata.json``, after every data file it names is durable. On return
        the checkpoint is committed (:attr:`outcome` is COMMITTED), what an overwrite replaced is removed and the
        lock released. ``parts``: the part files of partitioned metadata (name under ``data/``, bytes), written and
        made durable first, like the data files (a failure before the commit leaves them to :meth:`discard`, as this
        save's files). ``keep``: every file ``document`` names (its ``own_paths``); the replaced checkpoint's other
        files are removed before the lock is released (None: none is, they are left to ``reshard gc``).

        Raises:
            CheckpointLockedError: this save lost its lock (another writer judged it stale); not committed.
            CheckpointExistsError: another save committed here meanwhile; not committed.
            StorageError: the commit failed (:attr:`outcome` says whether it is known not to have happened).
        """
        if self.outcome is not CommitOutcome.OPEN:
            raise CheckpointError(f"save {self.save_id} was already {self.outcome.value}")
        where = self.storage.describe(METADATA_FILE)
        try:
            if self.lock is not None:
                self.lock.check()
            if self.overwrite:
                self.replaced = self._previous_files()
            for name, data in parts:
                self._write_part(name, data)
            self.storage.sync_dir(DATA_DIR)
            # A save into a retired checkpoint's directory makes it a checkpoint again: the marker goes before
            # the commit (the files that others reference stay protected by their reference markers).
            if self.storage.exists(RETIRED_FILE):
                self.storage.delete(RETIRED_FILE)
        except CheckpointLockedError:
            self.outcome = CommitOutcome.NOT_COMMITTED
            raise
        except OSError as exc:
            self.outcome = CommitOutcome.NOT_COMMITTED
            raise StorageError(f"committing {where} failed: {exc}") from exc
        try:
            self.storage.commit(METADATA_FILE, document, replace=self.overwrite)
        except OSError as exc:
            self.outcome = self._outcome_after_failure(document)
            if self.outcome is CommitOutcome.COMMITTED:
                logger.warning("committing %s reported %s, but the committed document is this save's", where, exc)
            elif isinstance(exc, FileExistsError):
                raise CheckpointExistsError(
                    f"another save committed a checkpoint at {self.storage.describe()} while this one was writing; "
                    "this save's data was discarded"
                ) from None
            elif self.outcome is CommitOutcome.UNKNOWN:
                raise StorageError(
                    f"committing {where} failed and its outcome cannot be read back: {exc}. This save's data files "
                    "are kept; `reshard validate` tells whether the checkpoint committed, `reshard gc` removes them "
                    "if it did not"
                ) from exc
            else:
                raise StorageError(f"committing {where} failed: {exc}") from exc
        self.outcome = CommitOutcome.COMMITTED
        self._remove_dead_files()  # what a holder wrongly judged stale finished since begin (never raises)
        if keep is not None:
            self._remove_replaced(set(keep))
        self.release_lock()

    def _write_part(self, name: str, data: bytes) -> None:
        """Write one part file of partitioned metadata, durably (a save's own name under ``data/``)."""
        if not is_data_file_of(name, self.save_id):
            raise CheckpointError(f"{name!r} is not a file name of save {self.save_id}")
        writer = self.storage.open_writer(name)
        try:
            writer.write(memoryview(data))
            writer.commit()
        except BaseException:
            writer.abort()
            raise

    def _outcome_after_failure(self, document: bytes) -> CommitOutcome:
        """After a failed commit: whether our document is in place, another is (or none), or no one knows."""
        try:
            found = self.storage.read_bytes(METADATA_FILE, max_bytes=max(MAX_METADATA_BYTES, len(document)))
        except FileNotFoundError:
            return CommitOutcome.NOT_COMMITTED
        except OSError:
            return CommitOutcome.UNKNOWN
        return CommitOutcome.COMMITTED if found == document else CommitOutcome.NOT_COMMITTED

    def _previous_files(self, *, strict: bool = False) -> set[str]:
        """Data files (and metadata part files) of the committed checkpoint (empty when there is none, or it is
        unreadable: then its files stay, for ``reshard gc``; with ``strict`` an unreadable one raises).

        Raises:
            OSError, CheckpointError: with ``strict``, ``metadata.json`` exists but cannot be read or parsed.
        """
        try:
            raw = self.storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
            return set(Metadata.from_json_bytes(raw, lazy=True).own_paths)
        except FileNotFoundError:
            return set()
        except (OSError, CheckpointError):
            if strict:
                raise
            return set()

    # ---- 4. discard, 5. remove what was replaced ---------------------------------------------------------

    def discard(self) -> None:
        """After a failure: remove this save's data files if it is known not to have committed, and
        release the lock. Best effort; never raises."""
        if self.outcome is CommitOutcome.OPEN:
            self.outcome = CommitOutcome.NOT_COMMITTED
        if self.outcome is CommitOutcome.NOT_COMMITTED:
            try:
                for name in self.storage.list_files(DATA_DIR):
                    if is_data_file_of(name, self.save_id):
                        self.storage.delete(name)
            except OSError as exc:
                logger.warning("could not remove the data files of failed save %s: %s", self.save_id, exc)
        else:
            logger.warning(
                "save %s at %s is %s: its data files are kept",
                self.save_id,
                self.storage.describe(),
                self.outcome.value,
            )
        self.release_lock()

    def _remove_replaced(self, keep: set[str]) -> None:
        """Right after a committed overwrite, under this save's lock (so no incremental save adds a reference marker
        while the markers are judged, and no other save of the path runs): remove the replaced checkpoint's data files
        that the new one does not name (``keep``) and that no other checkpoint references
        (:mod:`reshard.io.references`). Nothing is removed through a symbolic link, or once the lock is lost. Only names
        under ``data/`` are touched; a failure is logged, never raised: the new checkpoint is committed and complete."""
        doomed = sorted(n for n in self.replaced - keep if n.startswith(f"{DATA_DIR}/"))
        if not doomed:
            return
        try:
            refuse_a_link(self.storage)
            if self.lock is not None:
                self.lock.check()
            referenced, _ = protected_files(self.storage)
        except (OSError, CheckpointError) as exc:
            logger.warning("the replaced checkpoint's files are kept for `reshard gc`: %s", exc)
            return
        for name in doomed:
            if name in referenced:
                continue
            try:
                self.storage.delete(name)
            except OSError as exc:
                logger.warning("could not remove %s of the replaced checkpoint: %s", self.storage.describe(name), exc)
