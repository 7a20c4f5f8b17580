"""References between checkpoints: what an incremental save leaves in the checkpoints it points into, which
references a reader may follow, and which files every deletion must keep.

An incremental save (``reshard.save(..., base=...)``, ``CheckpointManager(incremental=True)``) writes only
the boxes whose content changed; its ``metadata.json`` names, for the others, the data file of the sibling
checkpoint that *holds* the bytes (``files[i].checkpoint``, docs/format.md section 15), never a file that
itself refers on, so that a load reads every byte from where it lies. Deleting a holder would break the
referrer, so before its commit the save leaves a **reference marker** in every holder::

    <holder>/refs/<referrer>.<save_id>.json     {"checkpoint": "<referrer>", "save_id": "...", "files": [...]}

A marker is *live* while the referrer's committed ``metadata.json`` is that save's (same ``save_id``), or
while the referrer has no commit yet and a live save lock (the save is still running; a lock of another host is
live, since only watching it can tell: :func:`reshard.io.locking.stale_at_sight`); unreadable or
corrupt referrers count as live, since deleting on a guess could cost data. Every deletion of data files
asks first (:func:`protected_files`): an overwrite's cleanup, ``reshard gc``, and retention
(:mod:`reshard.io.retirement`, which retires a checkpoint that others reference).

The marker is also what ties a reference to its referrer: a reader follows the references of a checkpoint
only while each holder keeps the marker of that very checkpoint (its name) and save, naming the files
(:func:`verify_references`); a checkpoint copied or moved away from its name, or a document naming a
directory that is no checkpoint, is refused before any referenced file is opened.

**Who may change a holder's files.** Whoever deletes files of a checkpoint (retention, ``reshard gc``, an
overwrite's cleanup) holds that checkpoint's save lock (:mod:`reshard.io.locking`) for its whole run, and judges the
markers under it; a save that references a holder takes the holder's lock briefly to write its marker and check
that the files it will reference are there (:func:`mark_holders`, at the save's planning, before any writer skips
a box: from then on the marker is live through the save's own lock). So a deleter either sees the marker, or the
save cannot take the lock and fails cleanly before anything is committed. Nothing is deleted through a symbolic
link, and no reference resolves through one (:func:`lock_for_deletion`, :func:`verify_references`): a holder's
referrers are looked for beside it, where their references resolve.

All functions here run in one process (the coordinator of a save or load, retention, ``reshard gc``,
``validate``); none is collective.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from reshard.errors import CheckpointError, CheckpointLockedError, CorruptCheckpointError, StorageError
from reshard.io.locking import Lock, acquire_lock, read_lock, stale_at_sight
from reshard.io.referencing import resolve_location, split_location
from reshard.metadata import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    REFERENCED_FILE_PATTERN,
    DataFile,
    Metadata,
    check_relative_path,
)
from reshard.planning.incremental import ReferencedBox
from reshard.storage import FileTooLargeError, Storage

__all__ = [
    "REFERENCES_DIR",
    "RETIRED_FILE",
    "ReferenceMarker",
    "check_referenced_files",
    "is_retired",
    "lock_for_deletion",
    "mark_holders",
    "marker_state",
    "protected_files",
    "reference_problems",
    "refuse_a_link",
    "remove_markers",
    "settle_markers",
    "verify_references",
]

logger = logging.getLogger("reshard")

REFERENCES_DIR = "refs"
"""The directory of a checkpoint that holds the markers of the checkpoints referencing its files."""
RETIRED_FILE = "retired.json"
"""Written into a checkpoint that was deleted while others reference its files (see the module doc)."""
MAX_MARKER_BYTES = 64 * 1024 * 1024
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
_MARKER_NAME = re.compile(rf"^{REFERENCES_DIR}/[^/]+\.[0-9a-f]{{32}}\.json$")
"""The names markers have (anything else in ``refs/`` is no marker: left alone, never read)."""
_NOT_A_REGULAR_FILE = (errno.ELOOP, errno.EINVAL)
"""How a local storage refuses to read a symbolic link or a FIFO (see reshard.storage.local)."""
_NAMED_BY_THE_DOCUMENT = (errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP)
"""Why a sibling that a document names cannot be looked at, because of the name itself (a file, a name too long, a
link loop): the reference is unusable, not the storage."""


@dataclass(frozen=True, slots=True)
class ReferenceMarker:
    """One marker: checkpoint ``checkpoint``'s save ``save_id`` references ``files`` of the holder."""

    name: str
    """The marker's name in the holder (``refs/<checkpoint>.<save_id>.json``)."""
    checkpoint: str
    save_id: str
    files: frozenset[str]


def marker_name(referrer: str, save_id: str) -> str:
    return f"{REFERENCES_DIR}/{referrer}.{save_id}.json"


def lock_for_deletion(storage: Storage) -> Lock:
    """Take the save lock of the checkpoint at ``storage`` for a run that deletes its files or adds a reference
    marker to it (see the module doc), inheriting a stale holder's token (:func:`reshard.io.locking.acquire_lock`).

    Raises:
        CheckpointError: ``storage`` is reached through a symbolic link (nothing is deleted or marked through one).
        CheckpointLockedError: a live save, deletion or referencing save holds it.
        StorageError: the lock cannot be written.
    """
    refuse_a_link(storage)
    return acquire_lock(storage, uuid.uuid4().hex, what="save", inherit=True)


def refuse_a_link(storage: Storage) -> None:
    """Raise CheckpointError when ``storage`` is reached through a symbolic link: nothing is deleted or marked
    through one (a checkpoint's referrers are looked for beside it, and the link is not where it lies)."""
    if storage.root_is_link():
        raise CheckpointError(
            f"{storage.describe()} is a symbolic link: reshard deletes nothing through a link (the checkpoints that "
            "reference it look for it where the link is, and it for its referrers where it lies); nothing deleted"
        )


def _marker_document(referrer: str, save_id: str, paths: Iterable[str]) -> bytes:
    return json.dumps(
        {"checkpoint": referrer, "save_id": save_id, "files": sorted(paths)}, separators=(",", ":")
    ).encode()


def mark_holders(
    storage: Storage, save_id: str, references: Iterable[ReferencedBox], *, check_files: bool = True
) -> list[str]:
    """At the planning of an incremental save of ``storage`` (save ``save_id``, whose save lock is held, so that the
    markers are live from the start), before any writer skips a box: in every holder of ``references``, under the
    holder's lock, leave a marker naming every file the save may reference there, then (``check_files``) check that
    those files are there with their sizes. A save that reads back what it references (``verify_base``) passes
    ``check_files=False``: its writers write anew what is missing, and the commit checks what is referenced.
    Returns the holders marked (narrowed by :func:`settle_markers` at the commit).

    Raises:
        CheckpointLockedError: a holder's lock is held (a gc, retention or save is changing its files).
        CheckpointError: a holder is a symbolic link or missing, or a file is missing or of another size.
        StorageError: a lock or marker could not be written.
        On any error the markers already left are removed, and nothing else was written.
    """
    by_holder: dict[str, dict[str, int]] = {}
    for box in references:
        by_holder.setdefault(box.checkpoint, {})[box.path] = box.size
    marked: list[str] = []
    try:
        for holder, files in sorted(by_holder.items()):
            _mark_holder(storage, save_id, holder, files, marked, check_files)
    except BaseException:
        remove_markers(storage, save_id, marked)
        raise
    return marked


def _mark_holder(
    storage: Storage, save_id: str, holder: str, files: dict[str, int], marked: list[str], check_files: bool
) -> None:
    """:func:`mark_holders` for one holder (appended to ``marked`` once its marker is written)."""
    target = storage.sibling(holder)
    try:
        if target.root_is_link():
            raise CheckpointError(
                f"the incremental save cannot reference {holder}: {target.describe()} is a symbolic link, and no "
                "reference resolves through one"
            )
        if not target.root_exists():
            if not check_files:  # nothing there to reference: the writers write those boxes anew
                return
            raise CheckpointError(f"the incremental save cannot reference its base: {target.describe()} is missing")
        try:
            lock = lock_for_deletion(target)
        except CheckpointLockedError:
            held_by = read_lock(target)
            who = held_by.describe() if held_by is not None else "another process"
            raise CheckpointLockedError(
                f"the incremental save of {storage.describe()} cannot reference {holder} now: {target.describe()} is "
                f"locked by {who} (a gc, retention or save changing its files); nothing was written or committed: "
                "save again"
            ) from None
        try:
            name = marker_name(storage.name, save_id)
            try:
                target.commit(name, _marker_document(storage.name, save_id, files), replace=True)
            except OSError as exc:
                raise StorageError(
                    f"cannot leave the reference marker of {storage.describe()} in {target.describe()}: {exc}"
                ) from exc
            marked.append(holder)
            if not check_files:
                return
            entries = [DataFile(path=path, size=size, checkpoint=holder) for path, size in sorted(files.items())]
            problems = [p for p in (_file_problem(storage, e) for e in entries) if p is not None]
            if problems:
                raise CheckpointError(f"the incremental save cannot reference its base: {'; '.join(problems)}")
        finally:
            lock.release()
    finally:
        target.close()


def settle_markers(storage: Storage, metadata: Metadata, marked: list[str]) -> None:
    """At the commit of ``metadata`` (of the checkpoint at ``storage``), whose save marked the holders ``marked`` at
    its planning: the marker in each holder it references names exactly the files it references there, and the
    holders it does not reference lose theirs. Under each holder's lock; a holder whose lock is held, or whose marker
    cannot be rewritten, keeps the wider marker (which protects more than is used, never less). Never raises."""
    referenced: dict[str, list[str]] = {}
    for entry in metadata.files:
        if entry.checkpoint is not None:
            referenced.setdefault(entry.checkpoint, []).append(entry.path)
    name = marker_name(storage.name, metadata.save_id)
    for holder in sorted(set(marked)):
        target = storage.sibling(holder)
        try:
            lock = lock_for_deletion(target)
            try:
                if holder in referenced:
                    document = _marker_document(storage.name, metadata.save_id, referenced[holder])
                    target.commit(name, document, replace=True)
                else:
                    target.delete(name)
            finally:
                lock.release()
        except (OSError, CheckpointError) as exc:
            logger.info("the reference marker %s keeps the files this save might have referenced: %s", name, exc)
        finally:
            target.close()


def remove_markers(storage: Storage, save_id: str, holders: list[str]) -> None:
    """After a save that did not commit: remove the markers it left (best effort; never raises)."""
    for holder in holders:
        try:
            target = storage.sibling(holder)
            try:
                target.delete(marker_name(storage.name, save_id))
            finally:
                target.close()
        except (OSError, CheckpointError) as exc:
            logger.warning("could not remove the reference marker of save %s in %s: %s", save_id, holder, exc)


def _where(storage: Storage, entry: DataFile, holder: Storage | None = None) -> str:
    """Names the referenced file of ``entry`` in messages; ``holder``: its checkpoint's storage, where open."""
    checkpoint, path = split_location(entry.location)
    if holder is not None or checkpoint is None:
        place = (holder or storage).describe(path)
    else:
        sibling = storage.sibling(checkpoint)
        place = sibling.describe(path)
        sibling.close()
    return f"data file {entry.path} of checkpoint {entry.checkpoint}, which {storage.describe()} references ({place}),"


def check_referenced_files(storage: Storage, metadata: Metadata, *, skip: Collection[int] = ()) -> dict[int, str]:
    """The problem of every file of another checkpoint that ``metadata`` (of the checkpoint at ``storage``)
    references and that is missing, unreadable, or of another size than recorded, by file index (but those in
    ``skip``); each names both checkpoints."""
    problems = {}
    for index, entry in enumerate(metadata.files):
        if entry.checkpoint is None or index in skip:
            continue
        problem = _file_problem(storage, entry)
        if problem is not None:
            problems[index] = problem
    return problems


def _file_problem(storage: Storage, entry: DataFile) -> str | None:
    """Why the file of another checkpoint that ``entry`` names is not there as recorded, or None."""
    try:
        holder, path = resolve_location(storage, entry.location)
    except OSError as exc:
        return f"{_where(storage, entry)} cannot be read: {exc}"
    try:
        where = _where(storage, entry, holder)
        try:
            size = holder.size(path)
        except FileNotFoundError:
            return f"{where} is missing"
        except OSError as exc:
            return f"{where} cannot be read: {exc}"
        if size != entry.size:
            return f"{where} has {size} bytes, the metadata says {entry.size}"
        return None
    finally:
        if holder is not storage:
            holder.close()


def _holder_problem(storage: Storage, save_id: str, holder: str, paths: set[str]) -> str | None:
    """Why the files ``paths`` of sibling ``holder`` are not references that the checkpoint at ``storage`` (save
    ``save_id``) may use, or None when they are: ``holder`` must hold the reference marker of this very
    checkpoint and save (which only that save writes, before its commit, and which keeps the files from every
    deletion), naming every one of them. Reads that marker only; where it is missing, looks at whether
    ``holder`` exists and is a checkpoint, to say so.

    Raises:
        OSError, CheckpointError: the holder could not be looked at.
    """
    target = storage.sibling(holder)
    try:
        return _tie_problem(target, marker_name(storage.name, save_id), holder, paths)
    except OSError as exc:
        if isinstance(exc, StorageError) or exc.errno not in _NAMED_BY_THE_DOCUMENT:
            raise
        return f"is refused unread: {holder} cannot be a sibling checkpoint ({exc.strerror}: {exc.filename})"
    finally:
        target.close()


def _tie_problem(target: Storage, name: str, holder: str, paths: set[str]) -> str | None:
    """:func:`_holder_problem` of the holder at ``target``, whose marker for this checkpoint is ``name``."""
    if target.root_is_link():
        return (
            f"is refused unread: {holder} is a symbolic link, and reshard resolves no reference through a link "
            "(retention and gc delete nothing through one, and look for a checkpoint's referrers beside it): move the "
            "checkpoint back beside the checkpoints that reference it"
        )
    try:
        marker = _parse_marker(name, target.read_bytes(name, max_bytes=MAX_MARKER_BYTES))
    except FileNotFoundError:
        if not (target.exists(METADATA_FILE) or target.exists(RETIRED_FILE)):
            if not target.root_exists():
                return "is missing"
            return (
                f"is refused unread: {holder} is not a reshard checkpoint (it has neither {METADATA_FILE} nor "
                f"{RETIRED_FILE}) and holds no reference marker {name} for this checkpoint"
            )
        return (
            f"is not protected and refused unread: {holder} holds no reference marker {name} for this "
            "checkpoint, so its retention and gc may delete the file at any time (a checkpoint copied or "
            "moved keeps no protection under its new name or place: copy or move the whole directory of "
            "checkpoints, whose markers name each other)"
        )
    except (FileTooLargeError, ValueError, KeyError, TypeError, RecursionError) as exc:
        return f"is refused unread: the reference marker {name} in {holder} is malformed ({exc})"
    except OSError as exc:
        if exc.errno not in _NOT_A_REGULAR_FILE:
            raise
        return f"is refused unread: the reference marker {name} in {holder} is not a regular file ({exc.strerror})"
    if not paths <= marker.files:
        return f"is not protected and refused unread: the reference marker {name} in {holder} does not name it"
    return None


def reference_problems(storage: Storage, metadata: Metadata) -> dict[int, str]:
    """The problem of every file of another checkpoint that ``metadata`` (of the checkpoint at ``storage``)
    references but may not use (see :func:`_holder_problem`: a checkpoint copied or moved, a reference to a
    directory that is no checkpoint), by file index; nothing of such a file is opened or even sized."""
    by_holder: dict[str, list[int]] = {}
    for index, entry in enumerate(metadata.files):
        if entry.checkpoint is not None:
            by_holder.setdefault(entry.checkpoint, []).append(index)
    problems = {}
    for holder, indices in sorted(by_holder.items()):
        try:
            problem = _holder_problem(storage, metadata.save_id, holder, {metadata.files[i].path for i in indices})
        except (OSError, CheckpointError) as exc:
            problem = f"cannot be checked: {exc}"
        if problem is not None:
            problems.update({i: f"{_where(storage, metadata.files[i])} {problem}" for i in indices})
    return problems


def verify_references(storage: Storage, metadata: Metadata) -> None:
    """Before any file of another checkpoint that ``metadata`` references is opened: refuse the references
    that :func:`reference_problems` finds.

    Raises:
        CorruptCheckpointError: naming the first reference refused (and how many there are).
        StorageError: a holder could not be looked at.
    """
    by_holder: dict[str, set[str]] = {}
    for entry in metadata.files:
        if entry.checkpoint is not None:
            by_holder.setdefault(entry.checkpoint, set()).add(entry.path)
    for holder, paths in sorted(by_holder.items()):
        try:
            problem = _holder_problem(storage, metadata.save_id, holder, paths)
        except StorageError:
            raise
        except (OSError, CheckpointError) as exc:
            raise StorageError(f"cannot check the references of {storage.describe()} into {holder}: {exc}") from exc
        if problem is not None:
            entry = next(f for f in metadata.files if f.checkpoint == holder)
            more = f" (and {len(paths) - 1} more files of {holder})" if len(paths) > 1 else ""
            raise CorruptCheckpointError(f"{_where(storage, entry)} {problem}{more}")


def read_markers(holder: Storage) -> list[ReferenceMarker]:
    """The reference markers in ``holder``. Anything else in ``refs/`` (a name no marker has, a symbolic link, a
    FIFO, a directory) and malformed markers (too large, not JSON, not at the name their content gives, naming other
    files than data files) are skipped with a warning, never followed: they protect nothing a well-formed one does
    not, since a referrer writes a well-formed one (a regular file) before it commits, and nothing ever deletes them.

    Raises:
        OSError: the markers cannot be listed, or one cannot be read (then nothing may be deleted on a guess).
    """
    out = []
    for name in holder.list_files(REFERENCES_DIR):
        if not _MARKER_NAME.match(name):
            logger.warning("ignoring %s: not a reference marker (no marker has this name)", holder.describe(name))
            continue
        try:
            marker = _parse_marker(name, holder.read_bytes(name, max_bytes=MAX_MARKER_BYTES))
        except FileNotFoundError:
            continue
        except (FileTooLargeError, ValueError, KeyError, TypeError, RecursionError) as exc:
            logger.warning("ignoring the malformed reference marker %s: %s", holder.describe(name), exc)
            continue
        except OSError as exc:
            if exc.errno not in _NOT_A_REGULAR_FILE:
                raise
            logger.warning("ignoring %s: not a regular file (%s)", holder.describe(name), exc.strerror)
            continue
        out.append(marker)
    return out


def _parse_marker(name: str, raw: bytes) -> ReferenceMarker:
    """A marker as :func:`write_markers` writes it, at the name it gives it; ValueError (or KeyError, TypeError)
    for anything else."""
    doc = json.loads(raw)
    if not isinstance(doc, dict) or set(doc) != {"checkpoint", "save_id", "files"}:
        raise ValueError("not a reference marker")
    checkpoint, save_id, files = doc["checkpoint"], doc["save_id"], doc["files"]
    if not isinstance(checkpoint, str) or check_relative_path(checkpoint) or "/" in checkpoint:
        raise ValueError(f"bad checkpoint name {checkpoint!r}")
    if not isinstance(save_id, str) or not _SAVE_ID.match(save_id) or name != marker_name(checkpoint, save_id):
        raise ValueError(f"save id {save_id!r} or name {name!r} is not the marker's")
    if not isinstance(files, list) or not all(isinstance(f, str) and REFERENCED_FILE_PATTERN.match(f) for f in files):
        raise ValueError("its files are not data file names")
    return ReferenceMarker(name=name, checkpoint=checkpoint, save_id=save_id, files=frozenset(files))


def _is_live(holder: Storage, marker: ReferenceMarker) -> bool:
    """Whether the referrer of ``marker`` still needs the files (see the module doc)."""
    referrer = holder.sibling(marker.checkpoint)
    try:
        try:
            raw = referrer.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
            if Metadata.from_json_bytes(raw, lazy=True).save_id == marker.save_id:
                return True
        except FileNotFoundError:
            pass
        except (OSError, CorruptCheckpointError):
            return True
        # Not (or no longer) committed as that save: live only while that save is still running (a save's
        # lock token is its save_id), judged without watching: a holder of another host is running.
        running = read_lock(referrer)
        return running is not None and running.token == marker.save_id and not stale_at_sight(running)
    finally:
        referrer.close()


def marker_state(holder: Storage) -> tuple[set[str], list[str], set[str]]:
    """The files of ``holder`` that live referrers use, the names of its stale markers, and the files that any
    of its well-formed markers names (live or stale: each is a data file of a reshard save, named in a marker
    that an incremental save wrote).

    Raises:
        OSError: the markers cannot be listed or read.
    """
    protected: set[str] = set()
    named: set[str] = set()
    stale = []
    for marker in read_markers(holder):
        named |= marker.files
        if _is_live(holder, marker):
            protected |= marker.files
        else:
            stale.append(marker.name)
    return protected, stale, named


def protected_files(holder: Storage) -> tuple[set[str], list[str]]:
    """The files of ``holder`` that live referrers use, and the names of its stale markers.

    Raises:
        OSError: the markers cannot be listed or read.
    """
    protected, stale, _ = marker_state(holder)
    return protected, stale


def is_retired(storage: Storage) -> bool:
    """Whether ``storage`` holds a retired checkpoint (see the module doc)."""
    try:
        return storage.exists(RETIRED_FILE)
    except OSError:
        return False
