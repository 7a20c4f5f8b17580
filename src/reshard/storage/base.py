"""The storage seam: what save and load need from a place that holds a checkpoint.

A :class:`Storage` is rooted at one checkpoint (a directory, or an object-store prefix); every name is a
relative POSIX path inside it, already checked by :func:`reshard.metadata.check_relative_path` when it
comes from a file. No name reaches outside the root: a checkpoint beside this one is :meth:`Storage.sibling`
(the data files an incremental checkpoint references there are resolved by :mod:`reshard.io.referencing`,
which alone knows how a checkpoint names them).

Data goes in and out through memoryviews, so tensors are written from and read into their own memory.
Reads are byte-range-first and batched (:meth:`Storage.read_ranges`) so that object stores can issue them
concurrently.

Methods raise ``OSError`` on failure (``FileNotFoundError`` for a missing name, ``FileExistsError`` when a
create-only commit finds the name taken); callers turn those into reshard's errors. Object-store
backends retry transient failures themselves and raise :class:`~reshard.StorageError` when they give up.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.errors import StorageError
from reshard.storage.filesystems import Sharing

if TYPE_CHECKING:
    import torch

__all__ = ["FileTooLargeError", "FileWriter", "MappedRange", "RangeReadError", "ReadRequest", "Storage"]


class FileTooLargeError(OSError):
    """A small file (metadata, an index, a lock marker) is larger than the limit its reader set, so it is
    not read whole: a hostile or broken file must not cost gigabytes of memory."""


class RangeReadError(OSError):
    """A ranged read was answered with bytes of another range or length than asked (a server or proxy
    that ignored the ``Range`` header, say): those bytes are never used."""


@dataclass(frozen=True, slots=True)
class ReadRequest:
    """Fill ``buffer`` with the bytes of ``name`` that start at ``offset`` (``len(buffer)`` bytes)."""

    name: str
    offset: int
    buffer: memoryview


class MappedRange(ABC):
    """A mapped byte range of a file. ``tensor`` is a uint8 tensor over it; ``close`` unmaps it, after
    which the tensor (and any view of it) must not be used."""

    tensor: torch.Tensor

    @abstractmethod
    def close(self) -> None: ...


class FileWriter(ABC):
    """A data file being written sequentially by one rank. Not thread-safe."""

    @abstractmethod
    def write(self, data: memoryview) -> None:
        """Append all of ``data`` (the writer may keep a reference until the next call returns)."""

    @abstractmethod
    def tell(self) -> int:
        """Bytes written so far."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file complete and durable (fsync, or the object's final upload). After this the file
        exists under its name."""

    @abstractmethod
    def abort(self) -> None:
        """Discard the partial file; never raises."""


class Storage(ABC):
    """A checkpoint's place: its files by relative name.

    Capabilities (class or instance attributes), checked where reshard's guarantees depend on them:

    - ``supports_conditional_create``: a create-only :meth:`commit` is atomic (of two racing creators
      exactly one succeeds). Create-only commits of ``metadata.json`` and lock markers need it; a backend
      without it must refuse them with an error, never degrade to check-then-write.
    - ``supports_mapping``: :meth:`map_range` can return mappings (else it returns None and reads go
      through :meth:`read_ranges`).
    - ``supports_ranged_reads``: :meth:`read_ranges` reads ranges without fetching whole files.
    - ``concurrent_reads``: :meth:`read_ranges` serves the requests of one call concurrently (object
      stores), so the reader batches them; where False (local files), it issues small reads and verifies
      each as soon as it lands.
    - ``request_cost_bytes``: what one read request costs, in bytes that could be read in the same time
      (first-byte latency x bandwidth). 0 for local files, where reading exactly the needed runs is best;
      an object store's ranged GET costs megabytes, so a load merges strided runs into few large GETs when
      :class:`~reshard.LoadOptions` leaves ``max_read_amplification`` to the backend.
    """

    supports_conditional_create: bool = True
    request_cost_bytes: int = 0
    supports_mapping: bool = False
    supports_ranged_reads: bool = True
    concurrent_reads: bool = True

    @abstractmethod
    def describe(self, name: str = "") -> str:
        """A human-readable location of ``name`` (or of the root), for error messages."""

    def sharing(self) -> Sharing:
        """Whether many nodes share this storage, so that the replicas of a load read each byte once between
        them by default (``LoadOptions(read_once=None)``), and why. The default: shared where a request is
        costly (an object store); :class:`~reshard.storage.LocalStorage` detects shared file systems
        (:mod:`reshard.storage.filesystems`). Decided once per object; raises :class:`~reshard.CheckpointError`
        for an override it cannot read."""
        if self.request_cost_bytes > 0:
            return Sharing(True, f"object store {self.describe()}")
        return Sharing(False, f"{self.describe()}: requests are cheap and the storage is not known to be shared")

    def root_exists(self) -> bool:
        """Whether the root exists (a directory, or a prefix with at least one object). Derived: whether it
        holds a file (a backend with directories says whether the directory is there)."""
        return bool(self.list_files())

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def size(self, name: str) -> int: ...

    @abstractmethod
    def modified_time(self, name: str) -> float:
        """When ``name`` was last written, in seconds since the epoch."""

    @abstractmethod
    def list_files(self, prefix: str = "") -> list[str]:
        """Relative names of all files under ``prefix`` (recursively), sorted."""

    def list_children(self) -> list[str]:
        """Names of the immediate children of the root (files and directories or prefixes), sorted. Derived
        from :meth:`list_files` (a backend with directories lists empty ones too)."""
        return sorted({name.split("/", 1)[0] for name in self.list_files()})

    @abstractmethod
    def list_names(self, prefix: str) -> list[str]:
        """Names of the files directly under the root that start with ``prefix``, sorted (lock markers)."""

    @abstractmethod
    def read_bytes(self, name: str, *, max_bytes: int | None = None) -> bytes:
        """The whole content of a small file; ``FileTooLargeError`` when it has more than ``max_bytes``
        bytes (checked before the content is read where the backend can)."""

    range_bytes_read: int = 0
    """Bytes this object has read through :meth:`read_ranges` and mapped through :meth:`map_range`: the
    tensor data and object blobs of loads (metadata and other small files are not counted)."""

    @abstractmethod
    def read_ranges(self, requests: list[ReadRequest], *, max_buffered_bytes: int | None = None) -> list[int]:
        """Fill every request's buffer; return the bytes read for each (fewer only at the end of a file).

        Backends may serve the requests concurrently and in any order; the caller must not touch the
        buffers until this returns. A backend whose answers can be of another range than asked (HTTP)
        checks each answer's range and length and raises ``RangeReadError`` rather than fill a buffer with
        other bytes. ``max_buffered_bytes``: the most the backend may hold at once of answers not yet in
        their buffers (an object store's response bodies in flight; a local file reads straight into the
        buffers and holds none); None leaves it to the backend's transfer options.
        """

    @abstractmethod
    def prepare_root(self) -> None:
        """Create the root and its ``data`` directory where the backend has directories. Called by the
        coordinator only, before any rank writes."""

    @abstractmethod
    def open_writer(self, name: str, *, max_buffered_bytes: int | None = None) -> FileWriter:
        """Create ``name`` for writing; it must not exist yet (names are unique to each save).

        ``max_buffered_bytes``: the most host memory the writer may hold of data written but not yet
        stored (an object store's parts being filled and in flight); None: the storage's own bound. A
        writer that cannot keep within it raises :class:`~reshard.StorageError` (on open, or on the write
        that would exceed it), never exceeds it. Local files hold nothing (the kernel's page cache is not
        the writer's memory)."""

    @abstractmethod
    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        """Publish ``data`` as ``name`` all at once: readers see the old content (or nothing) or the new,
        never a part. With ``replace`` off the write is create-only and raises ``FileExistsError`` if
        ``name`` exists, so that of two racing commits exactly one wins. This is a checkpoint's commit."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; a missing name is not an error."""

    @property
    def name(self) -> str:
        """The root's own name in its parent (the last component of its path or prefix; of the directory it
        points to, for a local root that is a symbolic link)."""
        raise StorageError(f"{self.describe()}: this storage has no name in a parent (no sibling checkpoints)")

    def sibling(self, name: str) -> Storage:
        """The storage of the checkpoint ``name`` beside this one (same parent directory or prefix)."""
        raise StorageError(f"{self.describe()}: this storage cannot reach sibling checkpoints (asked for {name!r})")

    @abstractmethod
    def child(self, name: str) -> Storage:
        """The storage rooted at ``name`` inside this one (a checkpoint inside a manager's root)."""

    def delete_prefix(self, prefix: str) -> None:
        """Remove everything under ``prefix`` (a directory or object prefix); a missing one is fine. Derived:
        each file :meth:`list_files` names, through :meth:`delete`."""
        for name in self.list_files(prefix):
            self.delete(name)

    def remove_empty_dirs(self) -> None:  # noqa: B027 - optional hook with a default
        """Remove the directories under the root that hold no file, and the root itself if it holds none,
        where the backend has directories (never through a symbolic link; a directory that holds anything
        stays). Object stores have no directories: nothing to do."""

    def is_link(self, name: str) -> bool:
        """Whether ``name`` (a child of the root) is a symbolic link, which deletions never go through."""
        return False

    def root_is_link(self) -> bool:
        """Whether the root itself is a symbolic link (a checkpoint reached through a link): nothing is deleted
        through it, and no reference resolves through it (docs/format.md section 15.2)."""
        return False

    def download(self, name: str, local_path: Path) -> None:
        """Copy the whole of ``name`` into the local file ``local_path`` (created or truncated).

        The default reads in pieces through :meth:`read_ranges`; object stores override it.
        """
        size = self.size(name)
        piece = 16 * 1024 * 1024
        with open(local_path, "wb") as out:
            for start in range(0, size, piece):
                buffer = bytearray(min(piece, size - start))
                (got,) = self.read_ranges([ReadRequest(name, start, memoryview(buffer))])
                if got != len(buffer):
                    raise OSError(f"{self.describe(name)} ended after {start + got} of {size} bytes")
                out.write(buffer)
            out.flush()
            os.fsync(out.fileno())

    def map_range(self, name: str, offset: int, length: int) -> MappedRange | None:
        """Bytes ``[offset, offset + length)`` of ``name`` mapped into memory (read-only in use), or None
        where the backend cannot map files (the default). Close it when done: mapped file pages count
        towards the process's resident memory while mapped."""
        return None

    def sync_dir(self, name: str) -> None:  # noqa: B027 - optional hook with a default
        """Make the files created under directory ``name`` durable (a directory fsync where the backend
        has directories). Called by the coordinator after every writer finished, before the commit."""

    def close(self) -> None:  # noqa: B027 - optional hook with a default
        """Release connections and threads. The storage must not be used afterwards."""
