"""Deleting a checkpoint without losing what others use, and without deleting anything reshard did not write.

Retention (:class:`~reshard.CheckpointManager`) and ``reshard gc`` delete whole checkpoints, retired ones and
the leftovers of interrupted saves through :func:`remove_checkpoint`. It deletes only files that a reshard save
wrote **and** that something reshard wrote ties to that save (the save id is in their names):

- a committed ``metadata.json``: its own data files, and the other files of ``data/`` named as a save names
  them (leftovers of its failed or interrupted saves, which ``reshard gc`` collects in a committed checkpoint
  anyway);
- a retirement record, ``retired.json`` (below): the files it lists;
- a save lock left by a save that died (a stale lock; a save's lock token is its save id): that save's files, and
  those of the dead saves its marker records (``LockInfo.dead_saves``: saves whose lock it had taken over);
- a well-formed reference marker (:mod:`reshard.io.references`): the files it names.

In a directory that one of these ties, reshard's own commit temporaries (``.<name>.tmp-<32 hex>``) and its
stale lock and reference markers go too. A directory with none of them is not reshard's: nothing in it is
deleted. No directory is removed unless it is empty; a file that nothing ties (a person's notes, a file named
like a data file of another save) stays, and so does its directory. Files that live reference markers name are
never deleted: the checkpoint is then **retired** instead of removed.

The order makes every point at which a deletion can be cut short (a crash, ``kill -9``) safe. When
``metadata.json`` goes, or when files others use stay, the record is written first::

    retired.json    {"retired": <seconds since the epoch>, "save_id": "<32 hex>" | null,
                     "files": [every data file it ties], "kept": [those that live markers protect]}

then ``metadata.json``, then the unprotected files, then the stale markers; the record goes last, once nothing
is kept, and then the directories that are empty. So a cut-short deletion leaves a retired directory (which
every reader refuses, and the next retention or ``gc`` finishes), never one that looks complete but lacks
files, never untied files, and never loses a referenced file. ``retired.json`` of earlier versions
(``{"retired": ..., "kept": [...]}``) is read as a record of its kept files. A ``retired.json`` that is not
such a record is refused with :class:`~reshard.CheckpointNotFoundError`, and nothing is deleted.

Not collective: one process (the coordinator of a manager's save, ``reshard gc``).
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from reshard.errors import CheckpointExistsError, CheckpointLockedError, CheckpointNotFoundError, CorruptCheckpointError
from reshard.io.datafile import DATA_FILE_PATTERN
from reshard.io.locking import LOCK_FILE, Lock, LockInfo, foreign_holder, lock_markers, stale_at_sight
from reshard.io.references import (
    REFERENCES_DIR,
    RETIRED_FILE,
    lock_for_deletion,
    marker_state,
    read_markers,
    refuse_a_link,
)
from reshard.metadata import DATA_DIR, MAX_METADATA_BYTES, METADATA_FILE, Metadata, document_digest
from reshard.storage import FileTooLargeError, Storage

__all__ = [
    "CERTIFICATE_FILE",
    "CERTIFICATION_FILES",
    "CHECKS_FILE",
    "MAX_RECORD_BYTES",
    "Removal",
    "RetiredRecord",
    "delete_checkpoint",
    "read_record",
    "remove_checkpoint",
]

logger = logging.getLogger("reshard")

CERTIFICATE_FILE = "certified.json"
"""The record of a certified checkpoint (:mod:`reshard.flows.certify`): a file of the checkpoint, deleted with it
(it certifies a ``metadata.json``, so it goes with the metadata, before the data files)."""

CHECKS_FILE = "checks.json"
"""The record of what a certified save's checks found (:mod:`reshard.flows.certify`), tied to its ``metadata.json``
as the certificate is: a file of the checkpoint, deleted with it, before its metadata."""

CERTIFICATION_FILES = (CERTIFICATE_FILE, CHECKS_FILE)
"""The certification records of a checkpoint (deleted first: they name a ``metadata.json``)."""

MAX_RECORD_BYTES = 16 * 1024 * 1024
"""The largest ``retired.json`` read (a record of 8192 data files takes half a megabyte)."""
_MAX_LOCK_BYTES = 64 * 1024
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
_TEMPORARY = re.compile(rf"^(?:{REFERENCES_DIR}/)?\.[^/]+\.tmp-[0-9a-f]{{32}}$")
"""The temporary names of :meth:`~reshard.storage.Storage.commit` (a local commit cut short leaves one)."""
_LOCK_TEMPORARY = re.compile(rf"^\.{re.escape(LOCK_FILE)}(?:\.[0-9]{{12}})?\.tmp-[0-9a-f]{{32}}$")
"""The temporary of a lock marker's create-only commit (a save killed at its lock's link leaves one)."""


@dataclass(frozen=True, slots=True)
class RetiredRecord:
    """What ``retired.json`` says (see the module doc)."""

    retired: float
    save_id: str | None
    """The save whose ``metadata.json`` was deleted (None: unknown, a record of an earlier version)."""
    files: frozenset[str]
    kept: frozenset[str]

    def to_bytes(self) -> bytes:
        document = {
            "retired": self.retired,
            "save_id": self.save_id,
            "files": sorted(self.files),
            "kept": sorted(self.kept),
        }
        return json.dumps(document, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, raw: bytes) -> RetiredRecord:
        """The record ``raw`` is; ValueError (or KeyError, TypeError) when it is not one reshard wrote."""
        doc = json.loads(raw)
        if not isinstance(doc, dict) or set(doc) not in ({"retired", "save_id", "files", "kept"}, {"retired", "kept"}):
            raise ValueError("not the members of a retirement record")
        retired, kept = doc["retired"], _data_files(doc["kept"], "kept")
        if isinstance(retired, bool) or not isinstance(retired, int | float) or not math.isfinite(retired):
            raise ValueError(f"retired is {retired!r}, not a time")
        if "files" not in doc:  # written by an earlier version: it kept those files, and always some
            if not kept:
                raise ValueError("it keeps no file")
            return cls(retired=float(retired), save_id=None, files=kept, kept=kept)
        listed = doc["files"]
        if isinstance(listed, list):  # the certification records were listed by the first version that wrote them
            listed = [name for name in listed if name not in CERTIFICATION_FILES]
        save_id, files = doc["save_id"], _data_files(listed, "files")
        if save_id is not None and (not isinstance(save_id, str) or not _SAVE_ID.match(save_id)):
            raise ValueError(f"save_id is {save_id!r}")
        if not kept <= files:
            raise ValueError("it keeps files it does not list")
        return cls(retired=float(retired), save_id=save_id, files=files, kept=kept)

    def ties(self, metadata: Metadata) -> bool:
        """Whether ``metadata`` is the document of the checkpoint this record retired."""
        if self.save_id is not None:
            return metadata.save_id == self.save_id
        return any(path in self.files for path in metadata.own_paths)


def _data_files(value: object, what: str) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and DATA_FILE_PATTERN.match(v) for v in value):
        raise ValueError(f"{what} are not data file names")
    return frozenset(value)


def read_record(storage: Storage) -> RetiredRecord | None:
    """The retirement record of ``storage`` (None: there is no ``retired.json``).

    Raises:
        CheckpointNotFoundError: ``retired.json`` is not a record reshard wrote (a project's own file, a huge
            or broken one): the directory is not a reshard checkpoint, and nothing may be deleted in it.
        OSError: it cannot be read.
    """
    try:
        raw = storage.read_bytes(RETIRED_FILE, max_bytes=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return None
    except FileTooLargeError as exc:
        raise CheckpointNotFoundError(_not_a_record(storage, exc.strerror or str(exc))) from None
    try:
        return RetiredRecord.parse(raw)
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # deeply nested JSON: RecursionError
        raise CheckpointNotFoundError(_not_a_record(storage, str(exc))) from None


def _not_a_record(storage: Storage, why: str) -> str:
    return (
        f"{storage.describe()} is not a reshard checkpoint: its {RETIRED_FILE} is not a retirement record that reshard "
        f"wrote ({why}); nothing deleted"
    )


@dataclass
class Removal:
    """What :func:`remove_checkpoint` did (or, with ``dry_run``, would do)."""

    removed: list[str] = field(default_factory=list)
    """The names deleted, in the order they went."""
    retired: bool = False
    """Files that live referrers use were kept: the directory is retired (``retired.json``)."""
    left: list[str] = field(default_factory=list)
    """Files left because nothing ties them to a reshard save (and so the directory stays)."""
    proven: bool = False
    """Something reshard wrote (metadata, a record, a stale save lock, a reference marker) ties files here."""
    young: list[str] = field(default_factory=list)
    """Tied files kept because they are younger than ``min_age_s``."""
    kept: list[str] = field(default_factory=list)
    """Tied files kept because live reference markers protect them (other checkpoints use them)."""


@dataclass
class _Ties:
    """What ties the files of one directory to reshard saves (see the module doc)."""

    record: RetiredRecord | None
    metadata: Metadata | None
    lock_markers: list[str]
    files: set[str]
    """Tied data files that exist."""
    extra: list[str]
    """Tied commit temporaries that exist."""
    untied: list[str]
    proven: bool
    """Something reshard wrote ties files here (metadata, a record, a stale save lock, a reference marker)."""


def _tied_metadata(storage: Storage, record: RetiredRecord | None) -> Metadata | None:
    """The committed ``metadata.json`` (None: there is none).

    Raises:
        CorruptCheckpointError: it is not valid, or not the document of the retired checkpoint.
    """
    try:
        raw = storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
        metadata = Metadata.from_json_bytes(raw, where=storage.describe(METADATA_FILE))
    except FileNotFoundError:
        return None
    except (FileTooLargeError, CorruptCheckpointError) as exc:
        raise CorruptCheckpointError(
            f"{storage.describe()} has a {METADATA_FILE} that is not valid ({exc}): nothing deleted"
        ) from exc
    if record is not None and not record.ties(metadata):
        raise CorruptCheckpointError(
            f"{storage.describe()} holds {RETIRED_FILE} of save {record.save_id} and {METADATA_FILE} of save "
            f"{metadata.save_id}: nothing deleted"
        )
    return metadata


def _stale_save_lock(storage: Storage, *, watch: bool) -> tuple[set[str], list[str]]:
    """The save ids of the dead saves whose locks are left here, and those lock markers. A holder on another host is
    never stale at sight (:func:`reshard.io.locking.stale_at_sight`): with ``watch`` its marker is listed (without its
    token: the lock is then watched for the lease, and its token comes with the lock taken over), else it is live.

    Raises:
        CheckpointLockedError: a live save holds the directory.
    """
    tokens: set[str] = set()
    names = []
    for name in lock_markers(storage).values():
        try:
            info = LockInfo.from_bytes(storage.read_bytes(name, max_bytes=_MAX_LOCK_BYTES))
        except FileNotFoundError:
            continue
        except (FileTooLargeError, RecursionError):
            return set(), []  # not a marker reshard wrote: it ties nothing
        if info is None:
            return set(), []
        if foreign_holder(info) and watch:
            names.append(name)
            continue
        if foreign_holder(info):
            raise CheckpointLockedError(
                f"{storage.describe()} is locked by a save on host {info.host} ({info.describe()}); its lock has not "
                "been seen unchanged for the lease yet (a lock of another host is judged on this host's clock, only by "
                "watching it: a save over it or `reshard gc` does): nothing deleted"
            )
        if not stale_at_sight(info):
            raise CheckpointLockedError(
                f"{storage.describe()} is locked by a live save ({info.describe()}): nothing deleted"
            )
        tokens |= {t for t in (info.token, *info.dead_saves) if _SAVE_ID.match(t)}
        names.append(name)
    return tokens, names


def _lock_temporaries(storage: Storage, names: Sequence[str]) -> dict[str, str | None]:
    """The temporaries of lock markers at the top of ``storage`` (``names``: its files) whose content is a lock
    record reshard wrote, by name: the token of the save that left it (its create-only link cut short) when the
    holder is stale, None when it is live (a save taking or renewing the lock right now: it is that save's, and
    goes with its commit). A file named so that is not a lock record is none of them (a person's: it stays)."""
    out: dict[str, str | None] = {}
    for name in names:
        if not _LOCK_TEMPORARY.match(name):
            continue
        try:
            info = LockInfo.from_bytes(storage.read_bytes(name, max_bytes=_MAX_LOCK_BYTES))
        except (FileNotFoundError, FileTooLargeError, RecursionError):
            continue
        if info is not None:
            out[name] = info.token if stale_at_sight(info) else None
    return out


def _ties(storage: Storage, named: set[str], tokens: set[str], locks: list[str], held: bool) -> _Ties:
    """What ties the files of ``storage`` (``named``: the files its well-formed reference markers name; ``tokens``
    and ``locks``: the save ids and the markers of the stale save locks here; ``held``: this process holds the
    lock, whose markers are neither tied files nor untied ones). The lock temporaries of dead saves tie their
    saves' files and go; a commit temporary goes only where something else reshard wrote ties the directory."""
    record = read_record(storage)
    metadata = _tied_metadata(storage, record)
    storage.list_files(DATA_DIR)  # OSError (ELOOP) where data/ is a link: nothing is deleted through it
    names = storage.list_files()
    temporaries = _lock_temporaries(storage, [n for n in names if "/" not in n])
    dead = {name for name, token in temporaries.items() if token is not None}
    saves = tokens | {token for token in temporaries.values() if token is not None}
    tied = set(record.files if record is not None else ()) | named
    if metadata is not None:
        tied |= set(metadata.own_paths)  # its data files and its metadata's part files
    if metadata is not None or record is not None:  # the certification of the save being deleted goes with it
        tied |= {name for name in CERTIFICATION_FILES if name in names}
    for name in names:
        if DATA_FILE_PATTERN.match(name) and (metadata is not None or name[5:].partition("-")[0] in saves):
            tied.add(name)
    proven = record is not None or metadata is not None or bool(locks or named or (held and tokens))
    extra = sorted(dead | {n for n in names if proven and _TEMPORARY.match(n) and n not in temporaries})
    special = {METADATA_FILE, RETIRED_FILE, *locks, *temporaries, *(lock_markers(storage).values() if held else ())}
    files = {n for n in names if n in tied}
    untied = [n for n in names if n not in tied and n not in special and not n.startswith(f"{REFERENCES_DIR}/")]
    return _Ties(
        record=record,
        metadata=metadata,
        lock_markers=locks,
        files=files,
        extra=extra,
        untied=untied,
        proven=proven or bool(dead),
    )


def _worth_a_lock(storage: Storage, locks: list[str]) -> bool:
    """Whether something reshard wrote may tie files here: only then is the lock written (never into a directory
    that is not reshard's).

    Raises:
        CheckpointNotFoundError: ``retired.json`` is not a record reshard wrote.
    """
    if locks or read_record(storage) is not None or storage.exists(METADATA_FILE):
        return True
    if any(token is not None for token in _lock_temporaries(storage, storage.list_names(f".{LOCK_FILE}")).values()):
        return True
    return bool(read_markers(storage))


def remove_checkpoint(
    storage: Storage,
    *,
    dry_run: bool = False,
    min_age_s: float | None = None,
    watch: bool = False,
    only_save: str | None = None,
) -> Removal:
    """Delete what reshard wrote at ``storage`` (a checkpoint, a retired one, an interrupted save), keeping the
    files that live referrers use (the directory is then retired) and every file nothing ties to a reshard
    save; the directory goes once empty. ``min_age_s``: also keep tied files younger than this (``gc``).

    Deletes under the checkpoint's save lock (:func:`reshard.io.references.lock_for_deletion`), held from before the
    reference markers are read until the last tied file is gone, so that no save adds a marker meanwhile. The lock
    of a save that died is taken over keeping its token, which ties that save's files until they are deleted or
    recorded (else it is handed back). The lock is released before the record and the empty directories go. A lock of
    another host is judged only by watching it for the lease (:func:`reshard.io.locking.stale_at_sight`): with
    ``watch`` (``reshard gc``, which may wait) it is watched, else (retention on a coordinator whose ranks wait, and
    every ``dry_run``) the directory is kept for this run: CheckpointLockedError. ``only_save``: the SHA-256 of the
    one ``metadata.json`` that may be deleted (a damaged step a manager judged still the save it skipped), checked
    again under the lock: a directory holding another save now (or none) is left whole.

    Raises:
        CheckpointExistsError: ``only_save`` is given and the checkpoint is another save now (nothing deleted).
        CheckpointError: ``storage`` is reached through a symbolic link (nothing deleted).
        CheckpointNotFoundError: ``retired.json`` is not a record reshard wrote (nothing deleted).
        CorruptCheckpointError: ``metadata.json`` is not valid, or of another save than the record's.
        CheckpointLockedError: a live save (or another deletion, or a save marking it) holds the directory.
        OSError: listing, reading or deleting failed (what was deleted stays deleted).
    """
    refuse_a_link(storage)
    tokens, locks = _stale_save_lock(storage, watch=watch and not dry_run)
    if dry_run or not _worth_a_lock(storage, locks):
        _refuse_another_save(storage, only_save)
        return _remove(storage, tokens, locks, dry_run=dry_run, min_age_s=min_age_s, lock=None)
    lock = lock_for_deletion(storage)
    lock.start_renewing()
    if lock.inherited is not None:  # the dead saves it recorded too (a taker killed inside its cleanup)
        tokens |= {t for t in (lock.token, *lock.inherited.dead_saves) if _SAVE_ID.match(t)}
    try:
        _refuse_another_save(storage, only_save)  # under the lock: no save commits here until it is released
        return _remove(storage, tokens, [], dry_run=False, min_age_s=min_age_s, lock=lock, taken_over=locks)
    except BaseException:
        lock.release()  # an inherited lock goes back: it still ties what it tied
        raise


def _refuse_another_save(storage: Storage, only_save: str | None) -> None:
    """Raise CheckpointExistsError unless ``only_save`` is None or the SHA-256 of ``metadata.json`` here."""
    if only_save is None:
        return
    try:
        found = document_digest(storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES))
    except (FileNotFoundError, FileTooLargeError):
        found = None
    if found != only_save:
        raise CheckpointExistsError(
            f"{storage.describe()} is not the save that was to be deleted any more (another save committed there, "
            "or none is): nothing deleted"
        )


def _remove(
    storage: Storage,
    tokens: set[str],
    locks: list[str],
    *,
    dry_run: bool,
    min_age_s: float | None,
    lock: Lock | None,
    taken_over: Sequence[str] = (),
) -> Removal:
    """:func:`remove_checkpoint` once the lock is held (``lock``, which took over the stale markers ``taken_over``),
    or without deleting (``dry_run``, or a directory that nothing ties: only one with no file at all is removed).
    Releases ``lock``."""
    protected, stale, named = marker_state(storage)
    ties = _ties(storage, named, tokens, locks, held=lock is not None)
    removal = Removal(left=ties.untied, proven=ties.proven)
    if not removal.proven or (lock is None and not dry_run):
        if lock is not None:
            lock.release()
        elif not ties.untied and not dry_run and not storage.list_files():
            storage.remove_empty_dirs()  # only directories, no file at all (a save that failed cleaned up)
        return removal  # else nothing here is reshard's: nothing is deleted
    now = time.time()
    young = {n for n in ties.files if min_age_s is not None and now - storage.modified_time(n) < min_age_s}
    kept = ties.files & protected
    doomed = sorted(ties.files - kept - young)
    removal.retired = bool(kept)
    removal.young, removal.kept = sorted(young - kept), sorted(kept)
    record = ties.record
    listed = record.files if record is not None else frozenset()
    has_record = record is not None
    if ties.metadata is not None or (kept and record is None) or (record is not None and not ties.files <= listed):
        # First of all: from here on, wherever this is cut short, the directory is retired, every tied file listed.
        save_id = ties.metadata.save_id if ties.metadata is not None else record.save_id if record is not None else None
        record = RetiredRecord(
            retired=record.retired if record is not None else now,
            save_id=save_id,
            # Data files only: the certification records go first, before the metadata that ties them.
            files=frozenset((ties.files | listed) - set(CERTIFICATION_FILES)),
            kept=frozenset(kept),
        )
        if not dry_run:
            storage.commit(RETIRED_FILE, record.to_bytes(), replace=True)
            has_record = True
    certificate = [name for name in CERTIFICATION_FILES if name in doomed]
    doomed = [name for name in doomed if name not in CERTIFICATION_FILES]
    steps = certificate + ([METADATA_FILE] if ties.metadata is not None else []) + doomed + sorted(stale)
    done = not (kept or young)
    if has_record or done:  # the record (or nothing left) ties what the lock of a dead save tied
        steps += ties.extra + ties.lock_markers
    for name in steps:
        if not dry_run:
            storage.delete(name)
        removal.removed.append(name)
    if lock is not None:
        # Files left that only the lock of a dead save ties: it goes back to that save.
        lock.release(hand_back=not (has_record or done))
        if (has_record or done) and lock.inherited is not None:
            removal.removed += taken_over  # the lock the dead save left, carried by this one until now
    if has_record and done:  # after the lock: a cut here leaves the record, which the next deletion finishes
        if not dry_run:
            storage.delete(RETIRED_FILE)
        removal.removed.append(RETIRED_FILE)
    if done and not dry_run:
        storage.remove_empty_dirs()  # the directory goes only if nothing is left in it
    return removal


def delete_checkpoint(storage: Storage) -> bool:
    """Delete the checkpoint at ``storage`` (see :func:`remove_checkpoint`); whether it was retired (files that
    others reference kept) rather than removed.

    Raises:
        as :func:`remove_checkpoint`.
    """
    return remove_checkpoint(storage).retired
