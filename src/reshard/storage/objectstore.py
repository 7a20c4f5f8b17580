"""Checkpoints under an object-store prefix (``s3://bucket/prefix``, ``gs://bucket/prefix``) through fsspec.

fsspec (with s3fs or gcsfs) is used behind this one adapter, configured by the clients' usual environment
and files plus ``storage_options``. Behaviour that matters for checkpoints:

- **Commit without rename.** Object stores have no atomic rename (a "move" is copy + delete), so the
  commit is a single put of ``metadata.json``, create-only unless replacing: S3 ``If-None-Match: *``, GCS
  ``ifGenerationMatch=0``. Of two racing saves to one prefix exactly one commits; the other gets
  ``FileExistsError`` (reshard: CheckpointExistsError). A prefix without ``metadata.json`` is incomplete.
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
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from reshard.errors import StorageError
from reshard.storage.base import FileTooLargeError, FileWriter, RangeReadError, ReadRequest, Storage

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


_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


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


def _make_filesystem(protocol: str, options: dict[str, Any]) -> Any:
    """An fsspec filesystem with the client's own retries off (reshard retries, with a known bound) and
    no instance cache (fsspec's global cache would share clients between unrelated checkpoints)."""
    import fsspec

    options = {**options, "skip_instance_cache": True}
    if protocol in ("gs", "gcs"):
        import os

        # gcsfs probes the bucket type over gRPC, which stalls for a minute against emulators and proxies
        # unless this is off; it only matters for hierarchical-namespace buckets, which reshard does not need.
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
        import gcsfs

        class _SingleAttemptGCS(gcsfs.GCSFileSystem):  # type: ignore[misc]
            # GCSFileSystem._request retries 6 times with up to 32 s waits; call the undecorated request.
            _request = getattr(gcsfs.GCSFileSystem._request, "__wrapped__", gcsfs.GCSFileSystem._request)

        return _SingleAttemptGCS(**options)
    if protocol in ("s3", "s3a"):
        merged = dict(options)
        config = dict(merged.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        merged["config_kwargs"] = config
        fs = fsspec.filesystem("s3", **merged)
        fs.retries = 1
        return fs
    return fsspec.filesystem(protocol, **options)


class ObjectStorage(Storage):
    """A checkpoint under an object-store URL prefix (see the module doc)."""

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
        self.url = url.rstrip("/")
        self.root = rest.strip("/")
        self.retry = retry or RetryPolicy()
        self.transfer = transfer or TransferOptions()
        self.storage_options = dict(storage_options or {})
        try:
            self.fs = _make_filesystem(protocol, self.storage_options)
        except ImportError as exc:
            extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol, protocol)
            raise StorageError(f"{url}: install reshard[{extra}] to use {protocol}:// URLs ({exc})") from exc
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._rng = random.Random()

    # ---- plumbing ----------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}" if name else self.root

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

    def root_exists(self) -> bool:
        return bool(self.list_files())

    def exists(self, name: str) -> bool:
        path = self._path(name)
        return bool(self.call("checking", name, lambda: self.fs.exists(path)))

    def size(self, name: str) -> int:
        path = self._path(name)
        return int(self.call("sizing", name, lambda: self.fs.info(path)["size"]))

    def modified_time(self, name: str) -> float:
        path = self._path(name)
        info = self.call("inspecting", name, lambda: self.fs.info(path))
        stamp = info.get("LastModified") or info.get("mtime") or info.get("updated")
        if isinstance(stamp, str):
            import datetime

            return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        if stamp is None:
            raise StorageError(f"{self.describe(name)}: the store reports no modification time")
        return float(stamp.timestamp())

    def list_files(self, prefix: str = "") -> list[str]:
        path = self._path(prefix)
        self.fs.invalidate_cache()
        found = self.call("listing", prefix, lambda: self.fs.find(path))
        start = len(self.root) + 1
        return sorted(p[start:] for p in found if p.startswith(self.root + "/"))

    def list_children(self) -> list[str]:
        return sorted({name.split("/", 1)[0] for name in self.list_files()})

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
        path = self._path(name)
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
        path = self._path(request.name)
        end = request.offset + len(request.buffer)
        data, content_range = self.call("reading", request.name, lambda: self._ranged_get(path, request.offset, end))
        count = _checked_range(self.describe(request.name), request.offset, end, data, content_range)
        request.buffer[:count] = memoryview(data)[:count]
        return count

    def _ranged_get(self, path: str, start: int, end: int) -> tuple[bytes, str | None]:
        """Bytes ``[start, end)`` of object ``path`` and the ``Content-Range`` the server answered with
        (None where the client does not expose it): the caller checks that they are the bytes asked for."""
        from fsspec.asyn import sync

        header = f"bytes={start}-{end - 1}"
        if self.protocol in ("s3", "s3a"):
            bucket, key = path.split("/", 1)

            async def get() -> tuple[bytes, str | None]:
                response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=header)
                try:
                    body = await response["Body"].read()
                finally:
                    response["Body"].close()
                return bytes(body), response.get("ContentRange")

            return sync(self.fs.loop, get)  # type: ignore[no-any-return]
        if self.protocol in ("gs", "gcs"):
            headers, body = sync(self.fs.loop, self.fs._call, "GET", self.fs.url(path), headers={"Range": header})
            found = {k.lower(): v for k, v in dict(headers).items()}
            return bytes(body), found.get("content-range")
        return bytes(self.fs.cat_file(path, start=start, end=end)), None

    def read_ranges(self, requests: list[ReadRequest]) -> list[int]:
        if len(requests) <= 1:
            return [self._read_one(r) for r in requests]
        return list(self.pool().map(self._read_one, requests))

    def prepare_root(self) -> None:
        """Object stores have no directories."""

    def open_writer(self, name: str) -> FileWriter:
        return _PartsWriter(self, name)

    def commit(self, name: str, data: bytes, *, replace: bool) -> None:
        path = self._path(name)
        mode = "overwrite" if replace else "create"
        self.call("committing", name, lambda: self.fs.pipe_file(path, data, mode=mode))

    def delete(self, name: str) -> None:
        path = self._path(name)
        with contextlib.suppress(FileNotFoundError):
            self.call("deleting", name, lambda: self.fs.rm_file(path))

    def child(self, name: str) -> Storage:
        return ObjectStorage(f"{self.url}/{name}", self.storage_options, retry=self.retry, transfer=self.transfer)

    def delete_prefix(self, prefix: str) -> None:
        for name in self.list_files(prefix):
            self.delete(name)

    def download(self, name: str, local_path: Path) -> None:
        path = self._path(name)
        self.call("downloading", name, lambda: self.fs.get_file(path, str(local_path)))

    # ---- uploads (used by _PartsWriter) ------------------------------------------------------------

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        self.call("uploading", name, lambda: self.fs.pipe_file(path, data))


@dataclass
class _Upload:
    """State of one multipart (S3) or composite (GCS) upload."""

    upload_id: str | None = None
    parts: list[concurrent.futures.Future[Any]] = field(default_factory=list)
    part_names: list[str] = field(default_factory=list)


class _PartsWriter(FileWriter):
    """Streams a data object in parts uploaded concurrently; a one-part object is a single put."""

    def __init__(self, storage: ObjectStorage, name: str) -> None:
        self.storage = storage
        self.name = name
        self.buffer = bytearray()
        self.position = 0
        self.upload = _Upload()
        self.gcs = storage.protocol in ("gs", "gcs")
        bucket_key = storage._path(name).split("/", 1)
        self.bucket, self.key = bucket_key[0], bucket_key[1]

    def tell(self) -> int:
        return self.position

    def write(self, data: memoryview) -> None:
        self.buffer += data
        self.position += len(data)
        part = self.storage.transfer.part_bytes
        while len(self.buffer) >= part:
            chunk = bytes(self.buffer[:part])
            del self.buffer[:part]
            self._submit(chunk)

    def _submit(self, chunk: bytes) -> None:
        storage = self.storage
        # Bound memory: at most max_concurrency parts in flight.
        in_flight = [f for f in self.upload.parts if not f.done()]
        if len(in_flight) >= storage.transfer.max_concurrency:
            concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
        number = len(self.upload.parts) + 1
        if self.gcs:
            part_name = f"{self.name}.parts-{uuid.uuid4().hex[:8]}/{number:05d}"
            self.upload.part_names.append(part_name)
            self.upload.parts.append(storage.pool().submit(storage.put, part_name, chunk))
            return
        if self.upload.upload_id is None:
            response = storage.call(
                "starting upload of",
                self.name,
                lambda: storage.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key),
            )
            self.upload.upload_id = response["UploadId"]
        upload_id = self.upload.upload_id

        def upload_part() -> dict[str, Any]:
            response = storage.call(
                f"uploading part {number} of",
                self.name,
                lambda: storage.fs.call_s3(
                    "upload_part", Bucket=self.bucket, Key=self.key, UploadId=upload_id, PartNumber=number, Body=chunk
                ),
            )
            return {"PartNumber": number, "ETag": response["ETag"]}

        self.upload.parts.append(storage.pool().submit(upload_part))

    def commit(self) -> None:
        storage = self.storage
        if not self.upload.parts:
            storage.put(self.name, bytes(self.buffer))
            return
        if self.buffer:
            self._submit(bytes(self.buffer))
            self.buffer = bytearray()
        results = [f.result() for f in self.upload.parts]
        if self.gcs:
            self._compose(self.upload.part_names)
            for part_name in self.upload.part_names:
                storage.delete(part_name)
            return
        upload_id = self.upload.upload_id
        storage.call(
            "completing upload of",
            self.name,
            lambda: storage.fs.call_s3(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=upload_id,
                MultipartUpload={"Parts": results},
            ),
        )

    def _compose(self, sources: list[str]) -> None:
        """GCS compose takes at most 32 sources: compose in a tree through intermediate objects."""
        storage = self.storage
        level = 0
        while len(sources) > 32:
            grouped = []
            for i in range(0, len(sources), 32):
                target = f"{self.name}.compose-{level}-{i // 32:05d}-{uuid.uuid4().hex[:8]}"
                group = sources[i : i + 32]
                storage.call(
                    "composing",
                    target,
                    lambda t=target, g=group: storage.fs.merge(  # type: ignore[misc]
                        storage._path(t), [storage._path(s) for s in g]
                    ),
                )
                grouped.append(target)
                self.upload.part_names.append(target)
            sources = grouped
            level += 1
        storage.call(
            "composing",
            self.name,
            lambda: storage.fs.merge(storage._path(self.name), [storage._path(s) for s in sources]),
        )

    def abort(self) -> None:
        storage = self.storage
        for future in self.upload.parts:
            with contextlib.suppress(Exception):
                future.result()
        with contextlib.suppress(Exception):
            if self.upload.upload_id is not None:
                upload_id = self.upload.upload_id
                storage.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id)
        for part_name in self.upload.part_names:
            with contextlib.suppress(Exception):
                storage.delete(part_name)
        with contextlib.suppress(Exception):
            storage.delete(self.name)
