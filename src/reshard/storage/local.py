"""Checkpoints in a local (or shared, POSIX) filesystem directory.

Data files are written with early writeback: every :data:`WRITEBACK_BYTES` written, the writer asks the
kernel to start writing the new range to the device (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
which does not wait), so that the disk works while the rest is still being written and checksummed, and
the final ``fsync`` (which alone makes the file durable) finds little left to do. Where the call does not
exist or fails, nothing changes but the timing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import os
import shutil
import stat
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from reshard.storage.base import FileTooLargeError, FileWriter, MappedRange, ReadRequest, Storage
from reshard.storage.filesystems import Sharing, detect_sharing, sharing_from_env

__all__ = ["WRITEBACK_BYTES", "LocalStorage"]

WRITEBACK_BYTES = 4 * 1024 * 1024
"""A data file writer starts the writeback of what it wrote every this many bytes."""

_SYNC_FILE_RANGE_WRITE = 2  # from <fcntl.h>: initiate writeback of dirty pages in the range, do not wait


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _too_large(where: str, size: int, limit: int) -> OSError:
    return FileTooLargeError(
        errno.EFBIG, f"{size} bytes or more, above the limit of {limit} bytes for this file", where
    )


class _LocalWriter(FileWriter):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.position = 0
        self.written_back = 0
        """Bytes whose writeback has been started (see the module doc)."""
        self.start_writeback = _sync_file_range()

    def write(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while view:
            written = os.write(self.fd, view)
            self.position += written
            view = view[written:]
        if self.start_writeback is not None and self.position - self.written_back >= WRITEBACK_BYTES:
            # A hint: its failure (a filesystem without it) only loses the overlap; fsync still decides.
            self.start_writeback(self.fd, self.written_back, self.position - self.written_back, _SYNC_FILE_RANGE_WRITE)
            self.written_back = self.position

    def tell(self) -> int:
        return self.position

    def commit(self) -> None:
        try:
            os.fsync(self.fd)
        finally:
            os.close(self.fd)
            self.fd = -1

    def abort(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(OSError):
            self.path.unlink()


def _read_fully(fd: int, offset: int, buffer: memoryview) -> int:
    view = buffer.cast("B") if buffer.format != "B" or buffer.ndim != 1 else buffer
    total = 0
    while total < len(view):
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


class _LocalMapping(MappedRange):
    def __init__(self, mapping: mmap.mmap, skip: int, length: int) -> None:
        self.mapping = mapping
        self.tensor = torch.frombuffer(mapping, dtype=torch.uint8)[skip : skip + length]

    def close(self) -> None:
        del self.tensor
        with contextlib.suppress(BufferError):  # a view of the tensor is still alive: the GC unmaps it later
            self.mapping.close()


def _check_inside(name: str) -> None:
    """Raise ``OSError(EINVAL)`` for a name with a ``..`` component: every name is below the root (a file of
    another checkpoint is read through that checkpoint's storage, see :mod:`reshard.io.referencing`)."""
    if ".." in name.split("/"):
        raise OSError(errno.EINVAL, "a '..' component: a storage name is below the checkpoint's root", name)


def _check_no_links(root: Path, name: str, *, leaf: bool = False) -> None:
    """Raise ``OSError(ELOOP)`` when a directory component of ``name`` below ``root`` (and, with ``leaf``,
    ``name`` itself) is a symbolic link: reshard never follows links inside a checkpoint, so that nothing
    it reads, writes or deletes can lie outside it."""
    _check_inside(name)
    parts = [p for p in name.split("/") if p]
    for depth in range(1, len(parts) + (1 if leaf else 0)):
        if os.path.islink(root.joinpath(*parts[:depth])):
            raise OSError(
                errno.ELOOP,
                "a symbolic link: reshard does not follow links inside a checkpoint",
                str(root.joinpath(*parts[:depth])),
            )


def _open_regular(root: Path, name: str) -> int:
    """Open ``root/name`` for reading without following a symbolic link in any component below the
    root, and only if it is a regular file (a FIFO or device would block or lie)."""
    _check_no_links(root, name)
    fd = os.open(root / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(root / name))
    return fd


class LocalStorage(Storage):
    """A checkpoint directory.

    Commits write a temporary file in the same directory and fsync it; a replacing commit renames it
    over the target, a create-only commit hard-links it to the target (which fails if the target exists,
    atomically) and removes the temporary name; then the directory is fsynced. A crash leaves the old
    file or the new one, never a mix, and never a temporary file outside the checkpoint.

    Symbolic links below the root are never followed, by reads, writes, listings or deletions: a data file
    is opened with ``O_NOFOLLOW``, and an operation whose path passes through a link (a ``data`` directory
    that is a link, say) fails with ``OSError(ELOOP)``, so that no operation reaches outside the checkpoint.
    The root itself may be a link.

    ``shared``: whether the directory is on a file system that many nodes share, where a load's replicas read
    each byte once between them by default (:meth:`sharing`): True or False decide it; None (the default)
    takes the environment variable ``RESHARD_SHARED_FILESYSTEM`` (``1`` or ``0``) where set, else detects
    the file system's type (:mod:`reshard.storage.filesystems`). Its children and siblings inherit it.
    """

    supports_mapping = True
    concurrent_reads = False

    def __init__(self, root: str | os.PathLike[str], *, shared: bool | None = None) -> None:
        self.root = Path(root)
        self.shared = shared
        self._sharing: Sharing | None = None

    def sharing(self) -> Sharing:
        """``shared`` where given, else the environment's override, else the detected type of the root's file
        system; decided on the first call (a statfs and one read of mountinfo), then kept."""
        if self._sharing is None:
            path = str(self._resolved())
            if self.shared is not None:
                self._sharing = Sharing(self.shared, f"LocalStorage(shared={self.shared}) for {path}")
            else:
                self._sharing = sharing_from_env(path) or detect_sharing(path)
        return self._sharing

    def _resolved(self) -> Path:
        """The root's path; where the root itself is a link (``latest -> step_000001000``), the directory it
        points to, whose name and siblings are those its references and markers use."""
        if self.root.is_symlink():
            return Path(os.path.realpath(self.root))
        return Path(os.path.abspath(self.root))

    @property
    def parent(self) -> Path:
        return self._resolved().parent

    @property
    def name(self) -> str:
        return self._resolved().name

    def sibling(self, name: str) -> Storage:
        return LocalStorage(self.parent / name, shared=self.shared)

    def describe(self, name: str = "") -> str:
        return str(self.root / name) if name else str(self.root)

    def root_exists(self) -> bool:
        return self.root.is_dir()

    def exists(self, name: str) -> bool:
        _check_inside(name)
        return (self.root / name).exists()

    def size(self, name: str) -> int:
        fd = _open_regular(self.root, name)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def modified_time(self, name: str) -> float:
        _check_inside(name)
        return os.lstat(self.root / name).st_mtime

    def list_files(self, prefix: str = "") -> list[str]:
        """Files (and symbolic links, which are not followed) under ``prefix``; ``OSError(ELOOP)`` when
        ``prefix`` passes through a link."""
        _check_no_links(self.root, prefix, leaf=True)
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        found: list[str] = []
        pending = [base]
        while pending:
            folder = pending.pop()
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False) or entry.is_symlink():
                        found.append(Path(entry.path).relative_to(self.root).as_posix())
        return sorted(found)

    def list_children(self) -> list[str]:
        return sorted(os.listdir(self.root)) if self.root.is_dir() else []

    def list_names(self, prefix: str) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(n for n in os.listdir(self.root) if n.startswith(prefix) and not (self.root / n).is_dir())

    def read_bytes(self, name: str, *, max_bytes: int | None = None) -> bytes:
        fd = _open_regular(self.root, name)
        try:
            if max_bytes is not None and os.fstat(fd).st_size > max_bytes:
                raise _too_large(self.describe(name), os.fstat(fd).st_size, max_bytes)
            chunks: list[bytes] = []
            total = 0
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return b"".join(chunks)
                total += len(chunk)
                if max_bytes is not None and total > max_bytes:
                    raise _too_large(self.describe(name), total, max_bytes)
                chunks.append(chunk)
        finally:
            os.close(fd)

    def read_ranges(self, requests: list[ReadRequest], *, max_buffered_bytes: int | None = None) -> list[int]:
        fds: dict[str, int] = {}
        try:
            out = []
            for request in requests:
                fd = fds.get(request.name)
                if fd is None:
                    fd = _open_regular(self.root, request.name)
                    fds[request.name] = fd
                out.append(_read_fully(fd, request.offset, request.buffer))
                self.range_bytes_read += out[-1]
            return out
        finally:
            for fd in fds.values():
                os.close(fd)

    def map_range(self, name: str, offset: int, length: int) -> MappedRange | None:
        """A private (copy-on-write, never written) mapping of ``length`` bytes at ``offset``, opened
        without following symbolic links."""
        if length <= 0:
            return None
        fd = _open_regular(self.root, name)
        try:
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, length + offset - start, access=mmap.ACCESS_COPY, offset=start)
        finally:
            os.close(fd)
        self.range_bytes_read += length
        return _LocalMapping(mapping, offset - start, length)

    def prepare_root(self) -> None:
        _check_no_links(self.root, "data", leaf=True)
        (self.root / "data").mkdir(parents=True, exist_ok=True)

    def open_writer(self, name: str, *, max_buffered_bytes: int | None = None) -> FileWriter:
        _check_no_links(self.root, name, leaf=True)
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return _LocalWriter(path)

    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        _check_no_links(self.root, name)
        target = self.root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            if replace:
                os.replace(temp, target)
            else:
                os.link(temp, target)  # atomic create-only: FileExistsError if a commit got there first
        finally:
            temp.unlink(missing_ok=True)
        _fsync_dir(target.parent)

    def child(self, name: str) -> Storage:
        return LocalStorage(self.root / name, shared=self.shared)

    def delete_prefix(self, prefix: str) -> None:
        _check_no_links(self.root, prefix)
        target = self.root / prefix
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)  # removes links inside as links, never what they point to

    def delete(self, name: str) -> None:
        _check_no_links(self.root, name)
        (self.root / name).unlink(missing_ok=True)

    def remove_empty_dirs(self) -> None:
        if self.root.is_symlink() or not self.root.is_dir():
            return
        for folder, _, _ in os.walk(self.root, topdown=False, followlinks=False):
            with contextlib.suppress(OSError):  # not empty (or gone): it stays
                os.rmdir(folder)

    def is_link(self, name: str) -> bool:
        return os.path.islink(self.root / name)

    def root_is_link(self) -> bool:
        return self.root.is_symlink()

    def sync_dir(self, name: str) -> None:
        _fsync_dir(self.root / name)
