"""Checkpoints under an object-store prefix (``s3://bucket/prefix``, ``gs://bucket/prefix``) through fsspec.

fsspec (with s3fs or gcsfs) is used behind this one adapter, configured by the clients' usual environment
and files plus ``storage_options``; what differs between protocols (the client, ranged reads with their
``Content-Range``, multipart or composite uploads, conditional creation) is a strategy of
:mod:`reshard.storage.protocols`. Behaviour that matters for checkpoints:

- **Commit without rename.** Object stores have no atomic rename (a "move" is copy + delete), so the
  commit is a single put of ``metadata.json``, create-only unless replacing: S3 ``If-None-Match: *``, GCS
  ``ifGenerationMatch=0``. Of two racing saves to one prefix exactly one commits; the other gets
  ``FileExistsError`` (reshard: CheckpointExistsError). A prefix without ``metadata.json`` is incomplete.
  Other fsspec protocols have no atomic conditional create: a create-only commit (and so a lock) is refused
  there with a StorageError rather than done as check-then-write.
- **Uploads.** A data object is streamed from tensor memory into parts of ``part_bytes`` that are
  uploaded concurrently (at most ``max_concurrency`` in flight, so memory stays bounded): S3 multipart
  upload; on GCS, parts are uploaded as temporary objects and composed into the final object (GCS's
  parallel composite upload), then deleted. An object of one part is a single put.
- **Ranged reads.** ``read_ranges`` issues one ranged GET per request, concurrently, at most
  ``max_concurrency`` in flight, and checks the length of every answer.
- **Retries.** Throttling (429, SlowDown), 5xx answers, timeouts and dropped connections are retried with
  exponential backoff and full jitter, up to ``RetryPolicy.max_attempts`` attempts per operation; the
  clients' own retries are turned off so the bound holds. A final failure raises
  :class:`~reshard.StorageError` naming the object and the operation.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from reshard.errors import CheckpointNotFoundError, StorageError
from reshard.storage.base import FileTooLargeError, FileWriter, RangeReadError, ReadRequest, Storage
from reshard.storage.protocols import protocol_for

__all__ = ["ObjectStorage", "RetryPolicy", "TransferOptions"]

logger = logging.getLogger("reshard")

T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """Exponential backoff with full jitter: before attempt ``i`` (from 1) wait a uniform random time in
    ``[0, min(max_delay_s, base_delay_s * 2**i))``."""

    max_attempts: int = 8
    base_delay_s: float = 0.1
    max_delay_s: float = 5.0

    def delays(self, rng: random.Random) -> Iterator[float]:
        for attempt in range(1, self.max_attempts):
            yield rng.uniform(0, min(self.max_delay_s, self.base_delay_s * 2**attempt))


MIN_GET_BYTES = 1024 * 1024
"""The smallest ranged GET a read is cut into when a memory budget shares its bytes among many in flight."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferOptions:
    """Concurrency and part size of object-store transfers."""

    max_concurrency: int = 16
    part_bytes: int = 16 * 1024 * 1024


_RETRYABLE_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.EPIPE}
_RETRYABLE_WORDS = (
    "SlowDown",
    "reduce your request rate",
    "Throttl",
    "TooManyRequests",
    "Too Many Requests",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "Service Unavailable",
    "Bad Gateway",
    "Gateway Timeout",
    "Connection reset",
    "Server disconnected",
    "Connection aborted",
    "ConnectionClosed",
    "timed out",
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed object-store call may succeed if tried again (throttling, 5xx, timeouts, dropped
    connections), looking through the chain of causes the clients attach."""
    if isinstance(exc, FileNotFoundError | FileExistsError | PermissionError | IsADirectoryError):
        return False
    for item in _chain(exc):
        status = getattr(item, "code", None) or getattr(item, "status", None)
        response = getattr(item, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", status)
        if isinstance(status, int) and (status == 429 or 500 <= status < 600):
            return True
        if isinstance(item, ConnectionError | TimeoutError):
            return True
        if isinstance(item, OSError) and item.errno in _RETRYABLE_ERRNOS:
            return True
        module = type(item).__module__
        if module.startswith(("aiohttp", "botocore.exceptions", "urllib3", "requests")) and not isinstance(
            item, FileNotFoundError | PermissionError
        ):
            name = type(item).__name__
            if (
                "Client" in name
                or "Connection" in name
                or "Timeout" in name
                or "Proxy" in name
                or "Disconnected" in name
            ):
                return True
        if any(word in str(item) for word in _RETRYABLE_WORDS):
            return True
    return False


_CONTENT_RANGE = re.compile(r"^bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)$")


def _checked_range(where: str, start: int, end: int, data: bytes, content_range: str | None) -> int:
    """How many bytes of ``data`` are bytes ``[start, end)`` of ``where``: all of them, or fewer only where
    the object ends. An answer of another range or length raises RangeReadError: HTTP allows a server (or a
    proxy) to ignore a ``Range`` header and send the whole object, which must never be taken for the range."""
    asked = end - start
    if content_range is None:
        if len(data) != asked:
            raise RangeReadError(
                errno.EIO,
                f"a read of bytes [{start}, {end}) got {len(data)} bytes and no Content-Range: the server or a "
                "proxy ignored the Range header",
                where,
            )
        return len(data)
    match = _CONTENT_RANGE.match(content_range.strip())
    if match is None:
        raise RangeReadError(errno.EIO, f"a read of bytes [{start}, {end}) got Content-Range {content_range!r}", where)
    first, last, total = int(match.group(1)), int(match.group(2)), match.group(3)
    got = last - first + 1
    at_end = total != "*" and last + 1 == int(total)
    if first != start or got != len(data) or got > asked or (got < asked and not at_end):
        raise RangeReadError(
            errno.EIO,
            f"a read of bytes [{start}, {end}) was answered with {len(data)} bytes of Content-Range {content_range!r}",
            where,
        )
    return got


OBJECT_STORE_REQUEST_COST_BYTES = 4 << 20
"""One ranged GET costs about as long as reading 4 MiB (tens of milliseconds to the first byte at a few
hundred MB/s): the load planner merges runs whose gaps are cheaper to read than a request."""


class ObjectStorage(Storage):
    """A checkpoint under an object-store URL prefix (see the module doc)."""

    request_cost_bytes = OBJECT_STORE_REQUEST_COST_BYTES

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retry: RetryPolicy | None = None,
        transfer: TransferOptions | None = None,
    ) -> None:
        protocol, sep, rest = url.partition("://")
        if not sep or not rest.strip("/"):
            raise StorageError(f"invalid object-store URL {url!r}: expected scheme://bucket/prefix")
        self.protocol = protocol
        self.strategy = protocol_for(protocol)
        self.supports_conditional_create = self.strategy.conditional_create
        self.url = url.rstrip("/")
        self.root = rest.strip("/")
        self.retry = retry or RetryPolicy()
        self.transfer = transfer or TransferOptions()
        self.storage_options = dict(storage_options or {})
        try:
            self.fs = self.strategy.filesystem(self.storage_options)
        except ImportError as exc:
            extra = self.strategy.extra
            raise StorageError(f"{url}: install reshard[{extra}] to use {protocol}:// URLs ({exc})") from exc
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._rng = random.Random()

    # ---- plumbing ----------------------------------------------------------------------------------

    def object_path(self, name: str) -> str:
        """The fsspec path (``bucket/key``) of ``name``."""
        return f"{self.root}/{name}" if name else self.root

    def _parent_of(self, text: str) -> str:
        parent, sep, _ = text.rpartition("/")
        if not sep or parent.endswith((":/", ":")):
            raise StorageError(f"{self.url} is a bucket's root: it has no sibling checkpoints")
        return parent

    @property
    def name(self) -> str:
        return self.root.rpartition("/")[2]

    def sibling(self, name: str) -> Storage:
        return ObjectStorage(
            f"{self._parent_of(self.url)}/{name}", self.storage_options, retry=self.retry, transfer=self.transfer
        )

    def describe(self, name: str = "") -> str:
        return f"{self.url}/{name}" if name else self.url

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.transfer.max_concurrency, thread_name_prefix="reshard-io"
                )
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def call(self, operation: str, name: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries (see RetryPolicy); raise StorageError naming the object and operation
        when a retryable failure persists. Non-retryable OSErrors (missing object, precondition) pass
        through unchanged."""
        delays = self.retry.delays(self._rng)
        attempt = 1
        while True:
            try:
                return fn()
            except Exception as exc:
                if not is_retryable(exc):
                    if isinstance(exc, OSError):
                        raise
                    raise StorageError(
                        f"{operation} {self.describe(name)} failed: {type(exc).__name__}: {exc}"
                    ) from exc
                delay = next(delays, None)
                if delay is None:
                    raise StorageError(
                        f"{operation} {self.describe(name)} failed after {attempt} attempts: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                logger.debug("retrying %s %s in %.2f s after %s", operation, self.describe(name), delay, exc)
                time.sleep(delay)
                attempt += 1

    # ---- Storage -----------------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        path = self.object_path(name)
        return bool(self.call("checking", name, lambda: self.fs.exists(path)))

    def size(self, name: str) -> int:
        path = self.object_path(name)
        return int(self.call("sizing", name, lambda: self.fs.info(path)["size"]))

    def modified_time(self, name: str) -> float:
        path = self.object_path(name)
        info = self.call("inspecting", name, lambda: self.fs.info(path))
        stamp = info.get("LastModified") or info.get("mtime") or info.get("updated")
        if isinstance(stamp, str):
            import datetime

            return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        if stamp is None:
            raise StorageError(f"{self.describe(name)}: the store reports no modification time")
        return float(stamp.timestamp())

    def list_files(self, prefix: str = "") -> list[str]:
        path = self.object_path(prefix)
        self.fs.invalidate_cache()
        try:
            found = self.call("listing", prefix, lambda: self.fs.find(path))
        except FileNotFoundError as exc:  # a listing of a missing prefix is empty: the bucket is missing
            bucket = self.root.split("/", 1)[0]
            raise CheckpointNotFoundError(
                f"listing {self.describe(prefix)} failed: the bucket {bucket!r} does not exist ({exc})"
            ) from exc
        start = len(self.root) + 1
        return sorted(p[start:] for p in found if p.startswith(self.root + "/"))

    def list_names(self, prefix: str) -> list[str]:
        self.fs.invalidate_cache()
        try:
            found = self.call("listing", prefix, lambda: self.fs.find(self.root, prefix=prefix))
        except FileNotFoundError:
            return []
        start = len(self.root) + 1
        names = (p[start:] for p in found if p.startswith(self.root + "/"))
        return sorted(n for n in names if n.startswith(prefix) and "/" not in n)

    def read_bytes(self, name: str, *, max_bytes: int | None = None) -> bytes:
        path = self.object_path(name)
        if max_bytes is not None:
            size = self.size(name)
            if size > max_bytes:
                raise FileTooLargeError(
                    errno.EFBIG,
                    f"{size} bytes, above the limit of {max_bytes} bytes for this file",
                    self.describe(name),
                )
            data = bytes(self.call("reading", name, lambda: self.fs.cat_file(path, start=0, end=max_bytes + 1)))
            if len(data) > max_bytes:
                raise FileTooLargeError(
                    errno.EFBIG, f"more than the limit of {max_bytes} bytes for this file", self.describe(name)
                )
            return data
        return bytes(self.call("reading", name, lambda: self.fs.cat_file(path)))

    def _read_one(self, request: ReadRequest) -> int:
        if not request.buffer:
            return 0
        path = self.object_path(request.name)
        end = request.offset + len(request.buffer)
        data, content_range = self.call(
            "reading", request.name, lambda: self.strategy.ranged_get(self.fs, path, request.offset, end)
        )
        count = _checked_range(self.describe(request.name), request.offset, end, data, content_range)
        request.buffer[:count] = memoryview(data)[:count]
        return count

    def get_sizes(self, max_buffered_bytes: int | None) -> tuple[int, int]:
        """The size of the ranged GETs :meth:`read_ranges` cuts reads into, and how many it keeps in flight,
        so that at most ``max_buffered_bytes`` of response bodies are in flight: as many GETs as
        ``max_concurrency`` allows, each at least :data:`MIN_GET_BYTES` (where the budget has room) and at
        most ``part_bytes``."""
        transfer = self.transfer
        cap = transfer.max_concurrency * transfer.part_bytes if max_buffered_bytes is None else max_buffered_bytes
        piece = max(1, min(transfer.part_bytes, max(MIN_GET_BYTES, cap // transfer.max_concurrency), cap))
        return piece, max(1, min(transfer.max_concurrency, cap // piece))

    def read_ranges(self, requests: list[ReadRequest], *, max_buffered_bytes: int | None = None) -> list[int]:
        """Ranged GETs of at most ``part_bytes`` each (smaller under a tight ``max_buffered_bytes``), at most
        ``max_concurrency`` in flight, and never more response bytes in flight than ``max_buffered_bytes``
        (default: ``max_concurrency * part_bytes``)."""
        piece, in_flight = self.get_sizes(max_buffered_bytes)
        gets = [
            (index, ReadRequest(r.name, r.offset + start, r.buffer[start : start + piece]))
            for index, r in enumerate(requests)
            for start in range(0, len(r.buffer), piece)
        ]
        counts = [0] * len(requests)
        if len(gets) <= 1 or in_flight == 1:
            for index, get in gets:
                counts[index] += self._read_one(get)
            self.range_bytes_read += sum(counts)
            return counts
        pool = self.pool()
        running: dict[concurrent.futures.Future[int], int] = {}
        try:
            for index, get in gets:
                if len(running) >= in_flight:
                    done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                    for future in done:
                        counts[running.pop(future)] += future.result()
                running[pool.submit(self._read_one, get)] = index
            for future in concurrent.futures.as_completed(list(running)):
                counts[running.pop(future)] += future.result()
        finally:
            for future in running:  # after an error: let the others finish before the buffers are released
                future.cancel()
            concurrent.futures.wait(running)
        self.range_bytes_read += sum(counts)
        return counts

    def prepare_root(self) -> None:
        """Object stores have no directories."""

    def open_writer(self, name: str, *, max_buffered_bytes: int | None = None) -> FileWriter:
        return self.strategy.writer(self, name, max_buffered_bytes)

    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        path = self.object_path(name)
        if not replace and not self.supports_conditional_create:
            raise StorageError(
                f"{self.describe(name)}: {self.protocol}:// cannot create an object conditionally (atomically, only "
                "if it is absent), which a create-only commit and a lock need; checkpoints there can only be read"
            )
        mode = "overwrite" if replace else "create"
        self.call("committing", name, lambda: self.fs.pipe_file(path, data, mode=mode))

    def delete(self, name: str) -> None:
        path = self.object_path(name)
        with contextlib.suppress(FileNotFoundError):
            self.call("deleting", name, lambda: self.fs.rm_file(path))

    def child(self, name: str) -> Storage:
        return ObjectStorage(f"{self.url}/{name}", self.storage_options, retry=self.retry, transfer=self.transfer)

    def download(self, name: str, local_path: Path) -> None:
        path = self.object_path(name)
        self.call("downloading", name, lambda: self.fs.get_file(path, str(local_path)))

    # ---- uploads (used by the protocols' writers) -----------------------------------------------------

    def put(self, name: str, data: bytes) -> None:
        path = self.object_path(name)
        self.call("uploading", name, lambda: self.fs.pipe_file(path, data))
