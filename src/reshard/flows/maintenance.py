"""Housekeeping of a checkpoint location: finding and removing data files no commit references.

Data files are named per save, so a save that failed or was interrupted, an overwrite interrupted after
its commit, or a losing racer leaves files that ``metadata.json`` does not list. Loads ignore them;
:func:`collect_garbage` (``reshard gc PATH``) removes them. In a committed checkpoint, only files under
``data/`` whose names are those a save writes (:data:`~reshard.io.datafile.DATA_FILE_PATTERN`) are candidates,
and only those older than ``min_age_s``, so that the files of a save still writing to the same location, and
anything a person put there, are left alone. Files that a live incremental checkpoint references (its marker
is in ``refs/``, :mod:`reshard.io.references`) are never candidates. A *retired* directory, and with
``include_incomplete`` an interrupted save, are cleaned by :func:`reshard.io.retirement.remove_checkpoint`, which
deletes only the files that something reshard wrote ties to a reshard save (a retirement record, the lock of a
save that died, a reference marker) and removes the directory only once it is empty: a directory reshard did
not make (a project with its own ``retired.json`` or files named like data files) is refused, untouched.
Whether a directory is reshard's is decided from its top level, ``data/`` and ``refs/`` alone (a home directory,
``/``, is never walked).
Symbolic links are never followed: a ``data`` directory that is a link, or a ``path`` that is one, is refused, so
that nothing outside the checkpoint can be deleted (and a checkpoint's referrers are looked for beside it, where
their references resolve). Deletions run under the checkpoint's save lock
(:func:`reshard.io.references.lock_for_deletion`), so that no incremental save adds a reference marker meanwhile. A
directory that holds no file at all has nothing to collect.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError, StorageError
from reshard.flows.progress import Progress, reporting
from reshard.io.commit import commit_temporaries
from reshard.io.datafile import DATA_FILE_PATTERN
from reshard.io.locking import LOCK_FILE
from reshard.io.references import (
    REFERENCES_DIR,
    RETIRED_FILE,
    check_referenced_files,
    lock_for_deletion,
    protected_files,
    reference_problems,
    refuse_a_link,
)
from reshard.io.retirement import CERTIFICATE_FILE, CHECKS_FILE, Removal, remove_checkpoint
from reshard.io.sources import read_full_metadata, read_metadata_bytes
from reshard.io.verified import StoredEntry, verify_stored_ranges
from reshard.metadata import DATA_DIR, METADATA_FILE, Metadata
from reshard.storage import CheckpointLocation, Storage, storage_for

__all__ = [
    "DEFAULT_GC_MIN_AGE_S",
    "KEPT_OTHER_NAME",
    "KEPT_REFERENCED",
    "KEPT_UNTIED",
    "KEPT_YOUNG",
    "GarbageReport",
    "Kept",
    "collect_garbage",
    "collect_garbage_report",
    "describe_kept",
    "describe_removed",
    "validate_checkpoint",
]

DEFAULT_GC_MIN_AGE_S = 3600.0
"""Files younger than this are never collected: a save may still be writing them."""


KEPT_YOUNG = "young"
"""Why a file was kept: not referenced, but younger than ``min_age_s`` (a save may still be writing it)."""
KEPT_REFERENCED = "referenced"
"""Why a file was kept: a live reference marker protects it (another checkpoint uses it)."""
KEPT_UNTIED = "untied"
"""Why a file was kept: nothing reshard wrote ties it to a reshard save (it may be a person's)."""
KEPT_OTHER_NAME = "other name"
"""Why a file was kept: it is under ``data/`` but not named as a save names its files."""


@dataclass(frozen=True, slots=True)
class Kept:
    """Files that :func:`collect_garbage_report` left in place for one reason (``why``, one of ``KEPT_*``)."""

    why: str
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GarbageReport:
    """What :func:`collect_garbage_report` removed (or, dry, would remove), and what it kept and why; ``min_age_s``
    is the age under which files were kept."""

    removed: tuple[str, ...]
    kept: tuple[Kept, ...] = ()
    min_age_s: float = DEFAULT_GC_MIN_AGE_S


def collect_garbage(
    path: CheckpointLocation,
    *,
    dry_run: bool = False,
    min_age_s: float = DEFAULT_GC_MIN_AGE_S,
    include_incomplete: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """The names :func:`collect_garbage_report` removed (with ``dry_run``: would remove); see it for the rest."""
    report = collect_garbage_report(
        path,
        dry_run=dry_run,
        min_age_s=min_age_s,
        include_incomplete=include_incomplete,
        storage_options=storage_options,
    )
    return list(report.removed)


def collect_garbage_report(
    path: CheckpointLocation,
    *,
    dry_run: bool = False,
    min_age_s: float = DEFAULT_GC_MIN_AGE_S,
    include_incomplete: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> GarbageReport:
    """Remove (or, with ``dry_run``, list) the data files under ``path`` that its ``metadata.json`` does
    not reference, and say which such files were kept and why (:class:`Kept`). Not collective: run it from one
    process.

    Args:
        path: the checkpoint (directory, URL or Storage).
        dry_run: only list what would be removed.
        min_age_s: leave files younger than this many seconds (a save may still be writing them).
        include_incomplete: when ``path`` has data files but no ``metadata.json`` (an interrupted save),
            remove those that the lock the dead save left (or a reference marker) ties to it; without it such
            a path raises IncompleteCheckpointError.
        storage_options: passed to the object-store client.

    Returns:
        The relative names removed (or that would be): none for a directory that holds no file at all (nothing to
        collect: it is not removed, since nothing ties it to a save); and the files kept, by reason.

    Raises:
        CheckpointError: ``path`` is a symbolic link (nothing is deleted through one).
        CheckpointNotFoundError: no checkpoint at ``path`` (also: a ``retired.json`` that reshard did not
            write); nothing is removed.
        IncompleteCheckpointError: data files but no ``metadata.json`` (without ``include_incomplete``, or
            when nothing ties them to a reshard save); nothing is removed.
        CheckpointLockedError: a live save (or another deletion, or a save referencing it) holds ``path``.
        StorageError: listing or deleting failed.
    """
    storage = storage_for(path, storage_options)
    try:
        try:
            refuse_a_link(storage)
            if storage.root_exists() and not _looks_like_reshards(storage):
                if not set(storage.list_children()) - {DATA_DIR, REFERENCES_DIR} and not (
                    storage.list_files(DATA_DIR) or storage.list_files(REFERENCES_DIR)
                ):
                    return GarbageReport((), min_age_s=min_age_s)  # no file (a deletion cut short): nothing to collect
                raise CheckpointNotFoundError(
                    f"{storage.describe()} is not a reshard checkpoint: nothing at its top level, in {DATA_DIR}/ or "
                    f"in {REFERENCES_DIR}/ is reshard's ({METADATA_FILE}, {RETIRED_FILE}, a lock, data files named as "
                    "a save names them, reference markers); nothing listed below it, nothing removed"
                )
            if storage.exists(RETIRED_FILE):  # metadata.json too: a retirement cut short before it deleted it
                return _report(remove_checkpoint(storage, dry_run=dry_run, watch=True), min_age_s)
            try:
                metadata = Metadata.from_json_bytes(read_metadata_bytes(storage))
            except IncompleteCheckpointError:
                if not include_incomplete:
                    raise
                removal = remove_checkpoint(storage, dry_run=dry_run, min_age_s=min_age_s, watch=True)
                if not removal.proven and removal.left:
                    names = ", ".join(removal.left[:5]) + (", ..." if len(removal.left) > 5 else "")
                    raise IncompleteCheckpointError(
                        f"{storage.describe()} has no {METADATA_FILE}, and nothing ties its files ({names}) to a "
                        "reshard save (no lock or lock temporary of a save that died, no retirement record or "
                        "reference marker names them): nothing removed, delete them yourself if they are yours to "
                        "delete"
                    ) from None
                if removal.left:
                    warnings.warn(_untied_left(storage, removal.left), stacklevel=3)
                return _report(removal, min_age_s)
            return _collect_committed(storage, metadata, dry_run=dry_run, min_age_s=min_age_s)
        except CheckpointError:  # some derive from OSError (CheckpointNotFoundError, StorageError): as they are
            raise
        except OSError as exc:
            raise StorageError(
                f"collecting the garbage of {storage.describe()} failed (nothing more deleted): {exc}"
            ) from exc
    finally:
        if storage is not path:
            storage.close()


def _looks_like_reshards(storage: Storage) -> bool:
    """Whether ``storage`` may be a checkpoint reshard wrote, looking only at its top level and the files of its
    ``data/`` and ``refs/`` (never walking the rest of a directory that is not one: a home directory, ``/``).

    Raises:
        OSError: listing failed (ELOOP: ``data/`` or ``refs/`` is a link).
    """
    for name in storage.list_children():
        if name in (METADATA_FILE, RETIRED_FILE) or name.startswith(LOCK_FILE) or _TEMPORARY.search(name):
            return True
    if any(DATA_FILE_PATTERN.match(n) or _TEMPORARY.search(n) for n in storage.list_files(DATA_DIR)):
        return True
    return bool(storage.list_files(REFERENCES_DIR))


def _untied_left(storage: Storage, left: Sequence[str]) -> str:
    names = ", ".join(left[:5]) + (", ..." if len(left) > 5 else "")
    return (
        f"reshard gc: {storage.describe()} keeps {len(left)} file(s) that nothing ties to a reshard save ({names}), "
        "and so the directory stays: delete them yourself if they are yours to delete"
    )


def _report(removal: Removal, min_age_s: float) -> GarbageReport:
    kept = ((KEPT_YOUNG, removal.young), (KEPT_REFERENCED, removal.kept), (KEPT_UNTIED, removal.left))
    return GarbageReport(
        tuple(removal.removed), tuple(Kept(why, tuple(names)) for why, names in kept if names), min_age_s
    )


def _collect_committed(storage: Storage, metadata: Metadata, *, dry_run: bool, min_age_s: float) -> GarbageReport:
    """In a committed checkpoint: the data files of other saves (named as a save names them) that neither its
    metadata nor a live reference marker names, older than ``min_age_s``, and the stale markers.

    Raises:
        OSError: listing or deleting failed.
    """
    if dry_run:
        return _garbage(storage, metadata, min_age_s)
    lock = lock_for_deletion(storage)
    lock.start_renewing()
    try:
        # Under the lock: the metadata (an overwrite may have committed meanwhile), then the markers.
        metadata = Metadata.from_json_bytes(read_metadata_bytes(storage))
        report = _garbage(storage, metadata, min_age_s)
        for name in report.removed:
            storage.delete(name)
    finally:
        lock.release(hand_back=False)  # the metadata ties every data file here: a dead save's lock ties nothing more
    return report


def _garbage(storage: Storage, metadata: Metadata, min_age_s: float) -> GarbageReport:
    """What gc of a committed checkpoint removes, and what of ``data/`` that the metadata does not list it keeps."""
    own = set(metadata.own_paths)  # the data files and the metadata's part files
    protected, stale = protected_files(storage)
    now = time.time()
    kept: dict[str, list[str]] = {KEPT_YOUNG: [], KEPT_REFERENCED: [], KEPT_OTHER_NAME: []}
    garbage = []
    for name in storage.list_files(DATA_DIR):
        if name in own:
            continue
        if not DATA_FILE_PATTERN.match(name):
            kept[KEPT_OTHER_NAME].append(name)
        elif name in protected:
            kept[KEPT_REFERENCED].append(name)
        elif now - storage.modified_time(name) < min_age_s:
            kept[KEPT_YOUNG].append(name)
        else:
            garbage.append(name)
    # Left by a save killed inside its commit (gc holds the save lock, so none is live); a young one is left alone, as
    # a young data file is (a dry run holds no lock: a save may be committing).
    garbage += [n for n in commit_temporaries(storage) if now - storage.modified_time(n) >= min_age_s]
    return GarbageReport(
        tuple(garbage + stale), tuple(Kept(why, tuple(names)) for why, names in kept.items() if names), min_age_s
    )


_KEPT_WHY = {
    KEPT_YOUNG: ("unreferenced data file", "unreferenced data files", "younger than {age} ({option})"),
    KEPT_REFERENCED: ("data file", "data files", "that other checkpoints reference (their markers are in refs/)"),
    KEPT_UNTIED: ("file", "files", "that nothing ties to a reshard save (delete them yourself if they are yours)"),
    KEPT_OTHER_NAME: ("file", "files", f"under {DATA_DIR}/ not named as a save names its data files"),
}


def describe_kept(report: GarbageReport, *, age_option: str = "min_age_s") -> list[str]:
    """One line per reason :func:`collect_garbage_report` kept files for: ``"kept 3 unreferenced data files younger
    than 1 h (--min-age)"`` (``age_option``: the name of the age threshold where the caller set it)."""
    lines = []
    for kept in report.kept:
        one, many, why = _KEPT_WHY[kept.why]
        why = why.format(age=_duration(report.min_age_s), option=age_option)
        lines.append(f"kept {len(kept.names)} {one if len(kept.names) == 1 else many} {why}")
    return lines


def _duration(seconds: float) -> str:
    """``3600`` as ``1 h``, ``600`` as ``10 min``, ``90`` as ``90 s``."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


_TEMPORARY = re.compile(r"(?:^|/)\.[^/]+\.tmp-[0-9a-f]{32}$")
_KINDS: tuple[tuple[str, str, Callable[[str], bool]], ...] = (
    ("commit temporary file", "commit temporary files", lambda n: _TEMPORARY.search(n) is not None),
    ("data file", "data files", lambda n: n.startswith(f"{DATA_DIR}/")),
    ("stale reference marker", "stale reference markers", lambda n: n.startswith(f"{REFERENCES_DIR}/")),
    ("stale lock marker", "stale lock markers", lambda n: n.startswith(LOCK_FILE)),
    ("metadata.json", "", lambda n: n == METADATA_FILE),
    ("the retirement record", "", lambda n: n == RETIRED_FILE),
    (CERTIFICATE_FILE, "", lambda n: n == CERTIFICATE_FILE),
    (CHECKS_FILE, "", lambda n: n == CHECKS_FILE),
    ("other file", "other files", lambda n: True),
)


def describe_removed(names: Sequence[str]) -> str:
    """What :func:`collect_garbage` removed, by kind: ``"1 data file, 1 stale reference marker and the retirement
    record"`` (``"nothing"`` for none)."""
    counts = [0] * len(_KINDS)
    for name in names:
        counts[next(i for i, (_, _, match) in enumerate(_KINDS) if match(name))] += 1
    parts = []
    for (one, many, _), count in zip(_KINDS, counts, strict=True):
        if count:
            parts.append(one if not many else f"{count} {one if count == 1 else many}")
    if not parts:
        return "nothing"
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def validate_checkpoint(
    path: CheckpointLocation,
    *,
    quick: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> list[str]:
    """Every problem of the checkpoint at ``path``, as one line each (empty: the checkpoint is good).

    Checks completeness (``metadata.json`` present and valid), that every data file exists with the size
    the metadata says (the files of other checkpoints that an incremental checkpoint references too, each
    problem naming both checkpoints, once a marker in the other checkpoint ties the reference to this one:
    else that is the problem, and the file is not opened), and, unless ``quick``, every checksum of every
    stored box and object (``progress``, if given, is told the bytes checked). Not collective.

    Raises:
        CheckpointNotFoundError: there is no checkpoint at ``path`` (nothing to validate).
    """
    storage = storage_for(path, storage_options)
    try:
        try:
            metadata = read_full_metadata(storage)
        except CheckpointNotFoundError:  # no checkpoint to validate: not a problem of one
            raise
        except CheckpointError as exc:
            return [str(exc)]
        referenced_problems = reference_problems(storage, metadata)  # before any such file is sized
        referenced_problems.update(check_referenced_files(storage, metadata, skip=referenced_problems))
        problems = [referenced_problems[i] for i in sorted(referenced_problems)]
        good_files = set()
        for index, entry in enumerate(metadata.files):
            if entry.checkpoint is not None:
                if index not in referenced_problems:
                    good_files.add(index)
                continue
            try:
                size = storage.size(entry.path)
            except FileNotFoundError:
                problems.append(f"data file {storage.describe(entry.path)} is missing")
                continue
            except OSError as exc:
                problems.append(f"data file {storage.describe(entry.path)} cannot be read: {exc}")
                continue
            if size != entry.size:
                problems.append(
                    f"data file {storage.describe(entry.path)} has {size} bytes, the metadata says {entry.size}"
                )
                continue
            good_files.add(index)
        if not quick:
            problems += _check_all_chunks(storage, metadata, good_files, progress)
        return problems
    finally:
        if storage is not path:
            storage.close()


def _check_all_chunks(storage: Storage, metadata: Metadata, files: set[int], progress: Progress | None) -> list[str]:
    """Every chunk of every stored box and blob in ``files`` (whose sizes the caller checked), by the chunk
    verifier of loads (:func:`~reshard.io.verified.verify_stored_ranges`: bounded memory whatever the declared
    chunk size); one problem per damaged box or blob."""
    entries: list[StoredEntry] = []
    for key, tensor in metadata.tensors.items():
        for box in tensor.boxes:
            what = f"tensor {key!r} box at {list(box.offset)}"
            entries.append((what, box.file, box.byte_offset, box.byte_length, box.checksums))
    for key, obj in metadata.objects.items():
        for entry in obj.entries:
            what = f"object {key!r} at {list(entry.offset)}"
            entries.append((what, entry.file, entry.byte_offset, entry.byte_length, entry.checksums))
    entries = [entry for entry in entries if entry[1] in files]
    with reporting(progress, sum(entry[3] for entry in entries), "validate") as advance:
        return verify_stored_ranges(storage, metadata, entries, on_verified=advance)
