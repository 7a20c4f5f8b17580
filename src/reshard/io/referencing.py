"""Where a referenced data file lies: the one place that reads the ``../<checkpoint>/<path>`` names.

An incremental checkpoint names, for the boxes it did not write, the data file of the sibling checkpoint that
holds them (:attr:`reshard.metadata.DataFile.location`, ``../<checkpoint>/<path>``, docs/format.md section 15;
:data:`reshard.metadata.SIBLING_PREFIX`). Storage backends know nothing of that form: a name there is always
below the storage's root. :func:`resolve_location` turns a location into the sibling's storage and the name
inside it, and :class:`ReferencingStorage` is a storage that reads locations so, for the code that reads data
files by their location (a load's reads, its staging, an incremental save's read-back, ``validate``).

Nothing here is collective; a ReferencingStorage is used by the one process that made it.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

from reshard.metadata import SIBLING_PREFIX
from reshard.storage import FileWriter, ReadRequest, Storage
from reshard.storage.base import MappedRange
from reshard.storage.filesystems import Sharing

__all__ = ["ReferencingStorage", "referencing", "resolve_location", "split_location"]


def split_location(location: str) -> tuple[str | None, str]:
    """``(checkpoint, path)`` of a location ``../<checkpoint>/<path>``; ``(None, location)`` for a name of the
    checkpoint itself. The parts were each checked as safe names when the metadata was read."""
    if not location.startswith(SIBLING_PREFIX):
        return None, location
    checkpoint, _, path = location[len(SIBLING_PREFIX) :].partition("/")
    return checkpoint, path


def resolve_location(
    storage: Storage, location: str, sibling: Callable[[str], Storage] | None = None
) -> tuple[Storage, str]:
    """The storage that holds ``location`` of the checkpoint at ``storage``, and its name there: ``storage``
    itself, or for ``../<checkpoint>/<path>`` the sibling checkpoint (``sibling(checkpoint)``, by default
    :meth:`Storage.sibling`) and ``path``.

    Raises:
        OSError: ``ELOOP`` when the sibling is reached through a symbolic link (no reference resolves through
            one, docs/format.md section 15.2).
        StorageError: ``storage`` has no siblings (a bucket's root, or a storage without a parent).
    """
    checkpoint, path = split_location(location)
    if checkpoint is None:
        return storage, path
    target = (sibling or storage.sibling)(checkpoint)
    if target.root_is_link():
        raise OSError(errno.ELOOP, "a symbolic link: reshard resolves no reference through a link", target.describe())
    return target, path


class ReferencingStorage(Storage):
    """``inner``, whose reads also take locations of sibling checkpoints (:func:`resolve_location`).

    Reads of a name of ``inner`` go to ``inner`` (one batch, as before); those of a sibling go to that
    sibling's storage, opened once and closed by :meth:`close`, and their bytes are counted in
    ``inner.range_bytes_read`` too, as a read of the checkpoint. Everything else (writes, listings, deletions)
    is ``inner``'s: a checkpoint writes and deletes only its own files.
    """

    def __init__(self, inner: Storage) -> None:
        self.inner = inner
        self.siblings: dict[str, Storage] = {}
        self.supports_conditional_create = inner.supports_conditional_create
        self.request_cost_bytes = inner.request_cost_bytes
        self.supports_mapping = inner.supports_mapping
        self.supports_ranged_reads = inner.supports_ranged_reads
        self.concurrent_reads = inner.concurrent_reads

    def sharing(self) -> Sharing:
        return self.inner.sharing()

    @property
    def range_bytes_read(self) -> int:
        return self.inner.range_bytes_read

    @range_bytes_read.setter
    def range_bytes_read(self, value: int) -> None:
        self.inner.range_bytes_read = value

    def _sibling(self, checkpoint: str) -> Storage:
        if checkpoint not in self.siblings:
            self.siblings[checkpoint] = self.inner.sibling(checkpoint)
        return self.siblings[checkpoint]

    def _resolve(self, location: str) -> tuple[Storage, str]:
        return resolve_location(self.inner, location, self._sibling)

    # ---- reads by location -----------------------------------------------------------------------------

    def describe(self, name: str = "") -> str:
        checkpoint, path = split_location(name)
        return self.inner.describe(name) if checkpoint is None else self._sibling(checkpoint).describe(path)

    def exists(self, name: str) -> bool:
        target, path = self._resolve(name)
        return target.exists(path)

    def size(self, name: str) -> int:
        target, path = self._resolve(name)
        return target.size(path)

    def modified_time(self, name: str) -> float:
        target, path = self._resolve(name)
        return target.modified_time(path)

    def read_bytes(self, name: str, *, max_bytes: int | None = None) -> bytes:
        target, path = self._resolve(name)
        return target.read_bytes(path, max_bytes=max_bytes)

    def read_ranges(self, requests: list[ReadRequest], *, max_buffered_bytes: int | None = None) -> list[int]:
        """One batch per storage the requests name (a single one, ``inner``'s, unless they reach siblings)."""
        groups: dict[int, tuple[Storage, list[int], list[ReadRequest]]] = {}
        for index, request in enumerate(requests):
            target, path = self._resolve(request.name)
            group = groups.setdefault(id(target), (target, [], []))
            group[1].append(index)
            group[2].append(ReadRequest(path, request.offset, request.buffer))
        counts = [0] * len(requests)
        for target, indices, batch in groups.values():
            got = target.read_ranges(batch, max_buffered_bytes=max_buffered_bytes)
            if target is not self.inner:
                self.inner.range_bytes_read += sum(got)
            for index, count in zip(indices, got, strict=True):
                counts[index] = count
        return counts

    def map_range(self, name: str, offset: int, length: int) -> MappedRange | None:
        target, path = self._resolve(name)
        mapped = target.map_range(path, offset, length)
        if mapped is not None and target is not self.inner:
            self.inner.range_bytes_read += length
        return mapped

    def download(self, name: str, local_path: Path) -> None:
        target, path = self._resolve(name)
        target.download(path, local_path)

    # ---- the checkpoint's own files: inner's ---------------------------------------------------------------

    def root_exists(self) -> bool:
        return self.inner.root_exists()

    def list_files(self, prefix: str = "") -> list[str]:
        return self.inner.list_files(prefix)

    def list_children(self) -> list[str]:
        return self.inner.list_children()

    def list_names(self, prefix: str) -> list[str]:
        return self.inner.list_names(prefix)

    def prepare_root(self) -> None:
        self.inner.prepare_root()

    def open_writer(self, name: str, *, max_buffered_bytes: int | None = None) -> FileWriter:
        return self.inner.open_writer(name, max_buffered_bytes=max_buffered_bytes)

    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        self.inner.commit(name, data, replace=replace)

    def delete(self, name: str) -> None:
        self.inner.delete(name)

    def delete_prefix(self, prefix: str) -> None:
        self.inner.delete_prefix(prefix)

    def remove_empty_dirs(self) -> None:
        self.inner.remove_empty_dirs()

    @property
    def name(self) -> str:
        return self.inner.name

    def sibling(self, name: str) -> Storage:
        return self.inner.sibling(name)

    def child(self, name: str) -> Storage:
        return self.inner.child(name)

    def is_link(self, name: str) -> bool:
        return self.inner.is_link(name)

    def root_is_link(self) -> bool:
        return self.inner.root_is_link()

    def sync_dir(self, name: str) -> None:
        self.inner.sync_dir(name)

    def close(self) -> None:
        """Close the siblings this storage opened (``inner`` is its owner's to close)."""
        siblings, self.siblings = list(self.siblings.values()), {}
        for storage in siblings:
            storage.close()


def referencing(storage: Storage) -> Storage:
    """``storage`` as a :class:`ReferencingStorage` (itself where it is one already)."""
    return storage if isinstance(storage, ReferencingStorage) else ReferencingStorage(storage)
