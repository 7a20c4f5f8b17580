"""Housekeeping of a checkpoint location: finding and removing data files no commit references.

Data files are named per save, so a save that failed or was interrupted, an overwrite interrupted after
its commit, or a losing racer leaves files that ``metadata.json`` does not list. Loads ignore them;
:func:`collect_garbage` (``reshard gc PATH``) removes them. Only files under ``data/`` are candidates, and
only those older than ``min_age_s``, so that the files of a save still writing to the same location are
left alone.
"""

from __future__ import annotations

import time
from typing import Any

from reshard.errors import CheckpointNotFoundError, IncompleteCheckpointError
from reshard.load import read_metadata_bytes
from reshard.metadata import DATA_DIR, METADATA_FILE, Metadata
from reshard.storage import CheckpointLocation, storage_for

__all__ = ["DEFAULT_GC_MIN_AGE_S", "collect_garbage"]

DEFAULT_GC_MIN_AGE_S = 3600.0
"""Files younger than this are never collected: a save may still be writing them."""


def collect_garbage(
    path: CheckpointLocation,
    *,
    dry_run: bool = False,
    min_age_s: float = DEFAULT_GC_MIN_AGE_S,
    include_incomplete: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Remove (or, with ``dry_run``, list) the data files under ``path`` that its ``metadata.json`` does
    not reference. Not collective: run it from one process.

    Args:
        path: the checkpoint (directory, URL or Storage).
        dry_run: only list what would be removed.
        min_age_s: leave files younger than this many seconds (a save may still be writing them).
        include_incomplete: when ``path`` has data files but no ``metadata.json`` (an interrupted save),
            remove them all; without it such a path raises IncompleteCheckpointError.
        storage_options: passed to the object-store client.

    Returns:
        The relative names removed (or that would be).
    """
    storage = storage_for(path, storage_options)
    try:
        try:
            referenced = {f.path for f in Metadata.from_json_bytes(read_metadata_bytes(storage)).files}
        except IncompleteCheckpointError:
            if not include_incomplete:
                raise
            referenced = set()
        except CheckpointNotFoundError:
            raise
        now = time.time()
        garbage = [
            name
            for name in storage.list_files(DATA_DIR)
            if name not in referenced and name != METADATA_FILE and now - storage.modified_time(name) >= min_age_s
        ]
        if not dry_run:
            for name in garbage:
                storage.delete(name)
        return garbage
    finally:
        if storage is not path:
            storage.close()
