"""The storage seam: what save and load need from a place that holds a checkpoint.

A :class:`Storage` is rooted at one checkpoint (a directory, later an object-store prefix); every name is
a relative POSIX path inside it, already checked by :func:`reshard.metadata.check_relative_path` when it
comes from a file. Data goes in and out through memoryviews, so tensors are written from and read into
their own memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["FileReader", "FileWriter", "Storage"]


class FileWriter(ABC):
    """A data file being written sequentially by one rank. Not thread-safe."""

    @abstractmethod
    def write(self, data: memoryview) -> None:
        """Append all of ``data``."""

    @abstractmethod
    def tell(self) -> int:
        """Bytes written so far."""

    @abstractmethod
    def commit(self) -> None:
        """Make the file durable (fsync) and close it. After this the file is complete."""

    @abstractmethod
    def abort(self) -> None:
        """Close and remove the partial file; never raises."""


class FileReader(ABC):
    """Random-access reads of one data file."""

    @abstractmethod
    def read_into(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from byte ``offset``; return the bytes read (less only at end of file)."""

    @abstractmethod
    def close(self) -> None: ...


class Storage(ABC):
    """A checkpoint's place: its files by relative name.

    ``describe()`` names the root for messages. Methods raise ``OSError`` (``FileNotFoundError`` for a
    missing name) on failure; callers turn those into reshard's errors.
    """

    @abstractmethod
    def describe(self, name: str = "") -> str:
        """A human-readable location of ``name`` (or of the root), for error messages."""

    @abstractmethod
    def root_exists(self) -> bool:
        """Whether the root exists (as a directory or prefix)."""

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def size(self, name: str) -> int: ...

    @abstractmethod
    def list_files(self, prefix: str = "") -> list[str]:
        """Relative names of all files under ``prefix`` (recursively), sorted."""

    @abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """The whole content of a small file."""

    @abstractmethod
    def prepare_root(self) -> None:
        """Create the root and its ``data`` directory if needed. Called by the coordinator only, before
        any rank writes."""

    @abstractmethod
    def open_writer(self, name: str) -> FileWriter:
        """Create ``name`` for writing; it must not exist yet (names are unique to each save)."""

    @abstractmethod
    def open_reader(self, name: str) -> FileReader: ...

    @abstractmethod
    def write_atomic(self, name: str, data: bytes) -> None:
        """Publish ``data`` as ``name`` all at once: readers see the old content or the new, never a
        part. This is the commit of a checkpoint."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; a missing name is not an error."""

    def sync_dir(self, name: str) -> None:  # noqa: B027 - optional hook with a default
        """Make the files created under directory ``name`` durable (a directory fsync where the backend
        has directories). Called by the coordinator after every writer finished, before the commit."""
