"""Where a load reads boxes from: a :class:`CheckpointSource`.

A source gives the coordinator of a load the checkpoint's metadata (and the bytes that the other ranks
decode it from, so that only one rank reads it) and a :class:`~reshard.storage.Storage` that the planned
byte runs are read from. The planner and the read executor are the same for every source; only where the
metadata and the bytes come from differs. Sources:

- :class:`ReshardCheckpoint`: a reshard checkpoint (``metadata.json``, verified data files). A plain path,
  URL or Storage given to :func:`reshard.load` means this.
- :class:`reshard.interop.HuggingFaceSource`: a Hugging Face safetensors directory with a key map.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any

from reshard.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
)
from reshard.io.datafile import DATA_FILE_PATTERN
from reshard.io.locking import read_lock
from reshard.io.parts import read_parts
from reshard.io.references import RETIRED_FILE, is_retired, verify_references
from reshard.io.referencing import ReferencingStorage
from reshard.metadata import DATA_DIR, MAX_METADATA_BYTES, METADATA_FILE, Metadata
from reshard.storage import CheckpointLocation, FileTooLargeError, Storage, storage_for

__all__ = ["CheckpointSource", "ReshardCheckpoint", "as_source", "read_full_metadata", "read_metadata_bytes"]

_SAFETENSORS_NAMES = ("model.safetensors", "model.safetensors.index.json")


class CheckpointSource(ABC):
    """What a load reads from. Used by one load (the source is closed after it when the load opened it).

    Call order, on every rank of the load: the coordinator calls :meth:`read_metadata` and broadcasts the
    bytes it returns; every other rank calls :meth:`decode_metadata` on them (they never read the metadata
    themselves); every rank calls :meth:`complete_metadata` for its template's keys (partitioned metadata: the
    parts it needs); then every rank reads its byte runs from :attr:`storage`.
    """

    storage: Storage

    def describe(self) -> str:
        """Where the source is, for messages."""
        return self.storage.describe()

    @abstractmethod
    def read_metadata(self) -> tuple[bytes, Metadata]:
        """On the coordinator: the metadata, validated, and the bytes the other ranks decode it from.

        Raises:
            CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError, StorageError.
            CorruptCheckpointError also when the checkpoint references a file of another checkpoint that no
            marker ties to it (:func:`reshard.io.references.verify_references`).
        """

    @abstractmethod
    def decode_metadata(self, raw: bytes) -> Metadata:
        """On the other ranks: the metadata from the bytes the coordinator read (and validated)."""

    def complete_metadata(self, metadata: Metadata, keys: Collection[str]) -> Metadata:
        """On every rank, inside the load's planning step (so that a failure is agreed on): ``metadata`` with
        the boxes of ``keys`` (this rank's template keys) ready to plan with. A source whose metadata holds every
        box returns it as it is; a reshard checkpoint of partitioned metadata reads the parts those keys need.

        Raises:
            CorruptCheckpointError, StorageError: a part is missing, damaged, of another save or unreadable.
        """
        return metadata

    refuses_unused = False
    """Whether entries that no template key of a load uses (over all its ranks) are an error (see
    :meth:`unused_entries`). Not for a reshard checkpoint: loading part of one (the model without the
    optimizer) is normal."""

    def unused_entries(self, keys: set[str]) -> list[str]:
        """The entries of the source that a load whose templates (over all its ranks) hold ``keys`` would not
        use, where :attr:`refuses_unused` (else ``[]``)."""
        return []

    def close(self) -> None:
        """Release the storage."""
        self.storage.close()


def read_metadata_bytes(storage: Storage) -> bytes:
    """The raw ``metadata.json`` of a checkpoint, or the error that says why there is none.

    Raises:
        CheckpointNotFoundError: the path does not exist, is not a checkpoint, or is a retired one (deleted
            but keeping the data files that others reference: ``retired.json``, with or without a
            ``metadata.json`` that a retirement cut short did not delete yet).
        IncompleteCheckpointError: data files but no ``metadata.json`` (a save that never committed).
        CorruptCheckpointError: ``metadata.json`` is larger than :data:`~reshard.metadata.MAX_METADATA_BYTES`.
        StorageError: the file exists but cannot be read.
    """
    where = storage.describe()
    try:
        raw = storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
    except FileNotFoundError:
        raw = None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{where} is a file, not a checkpoint directory") from None
    except FileTooLargeError as exc:
        raise CorruptCheckpointError(
            f"{storage.describe(METADATA_FILE)} is too large to be metadata ({exc.strerror}); refused unread"
        ) from exc
    except OSError as exc:
        raise StorageError(f"cannot read {storage.describe(METADATA_FILE)}: {exc}") from exc
    if raw is not None:
        # Retirement writes retired.json before it deletes metadata.json: a retirement cut short in between
        # leaves both, and the directory is retired for every reader (docs/format.md section 15.3). Checked
        # after the read, so that a retirement that starts meanwhile is seen too.
        try:
            retired = storage.exists(RETIRED_FILE)
        except OSError as exc:
            raise StorageError(f"cannot check {storage.describe(RETIRED_FILE)}: {exc}") from exc
        if retired:
            raise CheckpointNotFoundError(_retired_message(where))
        return raw
    try:
        exists = storage.root_exists()
        holder = read_lock(storage) if exists else None
        # Files named as a save names them, or the empty data/ a save creates first: a project's own data/
        # directory, holding other files, is not an interrupted save.
        data_files = storage.list_files(DATA_DIR) if exists else []
        has_data = any(DATA_FILE_PATTERN.match(name) for name in data_files) or (
            exists and not data_files and storage.exists(DATA_DIR)
        )
        safetensors = exists and not has_data and any(storage.exists(n) for n in _SAFETENSORS_NAMES)
        retired = exists and is_retired(storage)
    except CheckpointNotFoundError:  # a missing bucket, named by the storage
        raise
    except OSError as exc:
        raise StorageError(f"{where} has no {METADATA_FILE}, and looking for its data failed: {exc}") from exc
    if not exists:
        raise CheckpointNotFoundError(f"no checkpoint at {where}: the path does not exist")
    if retired:
        raise CheckpointNotFoundError(_retired_message(where))
    if holder is not None:
        raise IncompleteCheckpointError(
            f"{where} has no {METADATA_FILE}: a save is writing it or was interrupted "
            f"(lock held by {holder.describe()})"
        )
    if has_data:
        what = "holds data files" if data_files else f"holds the empty {DATA_DIR}/ a save creates first"
        raise IncompleteCheckpointError(
            f"{where} {what} but no {METADATA_FILE}: a save that was interrupted before it committed"
        )
    if safetensors:
        raise CheckpointNotFoundError(
            f"{where} is a Hugging Face safetensors directory, not a reshard checkpoint: load it through "
            "reshard.interop.HuggingFaceSource(path, key_map)"
        )
    raise CheckpointNotFoundError(f"{where} is not a reshard checkpoint: it has no {METADATA_FILE}")


def read_full_metadata(storage: Storage, *, where: str | None = None) -> Metadata:
    """The whole metadata of the checkpoint in ``storage``, whatever its version: ``metadata.json`` read
    (:func:`read_metadata_bytes`) and validated and, for partitioned metadata (version 6), every part read and
    verified (:func:`reshard.io.parts.read_parts`). The one reader for everything that wants every tensor's boxes
    (validate, inspect, export, convert, diff, incremental bases, ...). Not collective.

    Args:
        storage: the checkpoint.
        where: names ``metadata.json`` in error messages (default: its storage name).

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError, StorageError.
    """
    raw = read_metadata_bytes(storage)
    return read_parts(storage, Metadata.from_json_bytes(raw, where=where or storage.describe(METADATA_FILE)))


def _retired_message(where: str) -> str:
    return (
        f"{where} was deleted (retired, {RETIRED_FILE}): it is not a checkpoint and keeps only the data files that "
        "other checkpoints reference; load one of those"
    )


class ReshardCheckpoint(CheckpointSource):
    """A reshard checkpoint: its ``metadata.json`` (validated, sealed) and its data files.

    Args:
        path: a directory, a ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix`` URL, or a Storage.
        storage_options: passed to the object-store client.
    """

    def __init__(self, path: CheckpointLocation, storage_options: dict[str, Any] | None = None) -> None:
        self.inner = storage_for(path, storage_options)
        self._owns_storage = self.inner is not path
        self.storage = ReferencingStorage(self.inner)  # the data files of siblings it references, by location

    def read_metadata(self) -> tuple[bytes, Metadata]:
        raw = read_metadata_bytes(self.storage)
        metadata = Metadata.from_json_bytes(raw, where=self.storage.describe(METADATA_FILE))
        verify_references(self.storage, metadata)  # before any rank opens a file of another checkpoint
        return raw, metadata

    def decode_metadata(self, raw: bytes) -> Metadata:
        # The coordinator validated these bytes: each rank decodes only the packed tensors it loads.
        return Metadata.from_json_bytes(raw, lazy=True)

    def complete_metadata(self, metadata: Metadata, keys: Collection[str]) -> Metadata:
        return read_parts(self.storage, metadata, keys)

    def close(self) -> None:
        self.storage.close()
        if self._owns_storage:
            self.inner.close()


def as_source(
    location: CheckpointLocation | CheckpointSource, storage_options: dict[str, Any] | None
) -> CheckpointSource:
    """``location`` as a source: a CheckpointSource as it is, anything else as a :class:`ReshardCheckpoint`."""
    if isinstance(location, CheckpointSource):
        return location
    return ReshardCheckpoint(location, storage_options)
