"""References between checkpoints: what an incremental save leaves in the checkpoints it points into, and
how a checkpoint is deleted without losing bytes that others still use.

An incremental save (``reshard.save(..., base=...)``, ``CheckpointManager(incremental=True)``) writes only
the boxes whose content changed; its ``metadata.json`` names, for the others, the data file of the sibling
checkpoint that *holds* the bytes (``files[i].checkpoint``, docs/format.md section 15), never a file that
itself refers on, so that a load reads every byte from where it lies. Deleting a holder would break the
referrer, so before its commit the save leaves a **reference marker** in every holder::

    <holder>/refs/<referrer>.<save_id>.json     {"checkpoint": "<referrer>", "save_id": "...", "files": [...]}

A marker is *live* while the referrer's committed ``metadata.json`` is that save's (same ``save_id``), or
while the referrer has no commit yet and a live save lock (the save is still running); unreadable or
corrupt referrers count as live, since deleting on a guess could cost data. Every deletion of data files
asks first (:func:`protected_files`): an overwrite's cleanup, ``reshard gc``, and retention, which deletes a
checkpoint with :func:`delete_checkpoint`: a checkpoint that no live marker points into goes whole; one
that others reference is **retired**: ``retired.json`` is written first, then ``metadata.json`` and the
files no one references are deleted. A retired directory is not a checkpoint (a load says so) and not an
interrupted save; :func:`sweep_retired` (retention and ``reshard gc``) removes what its markers no longer
protect, and the directory once nothing does.

All functions here run in one process (the coordinator of a save, retention, ``reshard gc``); none is
collective.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from reshard.errors import CheckpointError, CorruptCheckpointError, StorageError
from reshard.locking import DEFAULT_STALE_AFTER_S, read_lock
from reshard.metadata import MAX_METADATA_BYTES, METADATA_FILE, Metadata, check_relative_path
from reshard.storage import Storage

__all__ = [
    "REFERENCES_DIR",
    "RETIRED_FILE",
    "ReferenceMarker",
    "check_referenced_files",
    "delete_checkpoint",
    "is_retired",
    "protected_files",
    "remove_markers",
    "sweep_retired",
    "write_markers",
]

logger = logging.getLogger("reshard")

REFERENCES_DIR = "refs"
"""The directory of a checkpoint that holds the markers of the checkpoints referencing its files."""
RETIRED_FILE = "retired.json"
"""Written into a checkpoint that was deleted while others reference its files (see the module doc)."""
MAX_MARKER_BYTES = 64 * 1024 * 1024


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


def write_markers(storage: Storage, metadata: Metadata) -> list[str]:
    """Before the commit of ``metadata`` into ``storage``: leave a marker in every checkpoint whose files
    it references. Returns the holders marked (for :func:`remove_markers` if the save then fails).

    Raises:
        StorageError: a marker could not be written (nothing is committed then).
    """
    referrer = storage.name
    by_holder: dict[str, list[str]] = {}
    for entry in metadata.files:
        if entry.checkpoint is not None:
            by_holder.setdefault(entry.checkpoint, []).append(entry.path)
    marked = []
    for holder, paths in sorted(by_holder.items()):
        document = json.dumps(
            {"checkpoint": referrer, "save_id": metadata.save_id, "files": sorted(paths)}, separators=(",", ":")
        ).encode()
        target = storage.sibling(holder)
        try:
            target.commit(marker_name(referrer, metadata.save_id), document, replace=True)
        except OSError as exc:
            raise StorageError(
                f"cannot leave the reference marker of {storage.describe()} in {target.describe()}: {exc}"
            ) from exc
        finally:
            target.close()
        marked.append(holder)
    return marked


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


def check_referenced_files(storage: Storage, metadata: Metadata) -> dict[int, str]:
    """The problem of every file of another checkpoint that ``metadata`` (of the checkpoint at ``storage``)
    references and that is missing, unreadable, or of another size than recorded, by file index; each
    names both checkpoints."""
    problems = {}
    for index, entry in enumerate(metadata.files):
        if entry.checkpoint is None:
            continue
        where = (
            f"data file {entry.path} of checkpoint {entry.checkpoint} ({storage.describe(entry.location)}), "
            f"which {storage.describe()} references,"
        )
        try:
            size = storage.size(entry.location)
        except FileNotFoundError:
            problems[index] = f"{where} is missing"
            continue
        except OSError as exc:
            problems[index] = f"{where} cannot be read: {exc}"
            continue
        if size != entry.size:
            problems[index] = f"{where} has {size} bytes, the metadata says {entry.size}"
    return problems


def read_markers(holder: Storage) -> list[ReferenceMarker]:
    """The reference markers in ``holder`` (malformed ones are skipped with a warning: they protect nothing
    a well-formed one does not, and a referrer always writes a well-formed one before it commits)."""
    out = []
    for name in holder.list_files(REFERENCES_DIR):
        try:
            marker = _parse_marker(name, holder.read_bytes(name, max_bytes=MAX_MARKER_BYTES))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring the malformed reference marker %s: %s", holder.describe(name), exc)
            continue
        out.append(marker)
    return out


def _parse_marker(name: str, raw: bytes) -> ReferenceMarker:
    doc = json.loads(raw)
    checkpoint, save_id, files = doc["checkpoint"], doc["save_id"], doc["files"]
    if not isinstance(checkpoint, str) or check_relative_path(checkpoint) or "/" in checkpoint:
        raise ValueError(f"bad checkpoint name {checkpoint!r}")
    if not isinstance(save_id, str) or not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ValueError("bad save_id or files")
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
        # lock token is its save_id).
        running = read_lock(referrer)
        return running is not None and running.token == marker.save_id and not running.is_stale(DEFAULT_STALE_AFTER_S)
    finally:
        referrer.close()


def protected_files(holder: Storage) -> tuple[set[str], list[str]]:
    """The files of ``holder`` that live referrers use, and the names of its stale markers.

    Raises:
        OSError: the markers cannot be listed.
    """
    protected: set[str] = set()
    stale = []
    for marker in read_markers(holder):
        if _is_live(holder, marker):
            protected |= marker.files
        else:
            stale.append(marker.name)
    return protected, stale


def is_retired(storage: Storage) -> bool:
    """Whether ``storage`` holds a retired checkpoint (see the module doc)."""
    try:
        return storage.exists(RETIRED_FILE)
    except OSError:
        return False


def delete_checkpoint(storage: Storage) -> bool:
    """Delete the checkpoint at ``storage``, keeping the data files that live referrers use (then the
    checkpoint is *retired*). Returns whether it was retired rather than removed whole.

    Order: ``retired.json`` (only when something is kept), ``metadata.json``, then the other files, so that a
    deletion cut short leaves a retired directory or an incomplete one, never one that looks complete but
    lacks files, and never loses a referenced file.

    Raises:
        OSError: a file could not be deleted (what was deleted stays deleted).
    """
    protected, stale = protected_files(storage)
    if not protected:
        storage.delete(METADATA_FILE)
        storage.delete_prefix("")
        return False
    document = json.dumps({"retired": time.time(), "kept": sorted(protected)}, separators=(",", ":")).encode()
    storage.commit(RETIRED_FILE, document, replace=True)
    storage.delete(METADATA_FILE)
    sweep_retired(storage, protected=protected, stale=stale)
    return True


def sweep_retired(
    storage: Storage, *, protected: set[str] | None = None, stale: list[str] | None = None, dry_run: bool = False
) -> list[str]:
    """In a retired checkpoint: remove the files no live referrer uses and the stale markers; the whole
    directory once nothing is protected. Returns the names removed (or, with ``dry_run``, that would be).

    Raises:
        OSError: listing or deleting failed.
    """
    if protected is None or stale is None:
        protected, stale = protected_files(storage)
    if protected:
        keep = protected | {RETIRED_FILE}
        names = [n for n in storage.list_files() if n not in keep and not n.startswith(f"{REFERENCES_DIR}/")]
        names += stale
    else:
        names = storage.list_files()
    if dry_run:
        return sorted(names)
    for name in sorted(names, key=lambda n: (n == RETIRED_FILE, n)):  # retired.json last
        storage.delete(name)
    if not protected:
        storage.delete_prefix("")
    return sorted(names)
