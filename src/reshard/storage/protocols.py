"""What differs between object stores, one strategy per protocol, behind :class:`~reshard.storage.ObjectStorage`.

An :class:`ObjectProtocol` builds the fsspec filesystem (with the client's own retries off: reshard retries,
with a known bound), performs a ranged GET that reports the server's ``Content-Range``, streams a data
object up in parts, and says whether the store can create an object *conditionally* (atomically, only if
absent), on which create-only commits and locks rely:

- :class:`S3`: ``If-None-Match: *`` puts; multipart uploads;
- :class:`GCS`: ``ifGenerationMatch=0`` uploads; parts uploaded as temporary objects and composed;
- :class:`OtherFsspec`: any other fsspec protocol: plain ranged reads and single puts, and **no**
  conditional create (fsspec's default create mode checks, then writes): such a store can hold checkpoints
  that are written with ``overwrite`` and read, but a create-only commit or a lock is refused there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.errors import StorageError
from reshard.storage.base import FileWriter

if TYPE_CHECKING:
    from reshard.storage.objectstore import ObjectStorage

__all__ = ["GCS", "S3", "ObjectProtocol", "OtherFsspec", "protocol_for"]


class ObjectProtocol(ABC):
    """The strategy of one object-store protocol (see the module doc). Stateless; shared."""

    extra: str = ""
    """The reshard extra that installs the client (``pip install '/path/to/reshard[s3]'``)."""
    conditional_create: bool = False
    """Whether a create-only put is atomic: exactly one of two racing creators succeeds."""

    @abstractmethod
    def filesystem(self, options: dict[str, Any]) -> Any:
        """The fsspec filesystem for ``options`` (no instance cache, no client retries)."""

    def ranged_get(self, fs: Any, path: str, start: int, end: int) -> tuple[bytes, str | None]:
        """Bytes ``[start, end)`` of ``path`` and the ``Content-Range`` of the answer (None: unknown)."""
        return bytes(fs.cat_file(path, start=start, end=end)), None

    def writer(self, storage: ObjectStorage, name: str, max_buffered_bytes: int | None) -> FileWriter:
        """A writer that streams the data object ``name`` up, holding at most ``max_buffered_bytes``."""
        return SinglePutWriter(storage, name, max_buffered_bytes)


class S3(ObjectProtocol):
    extra = "s3"
    conditional_create = True

    def filesystem(self, options: dict[str, Any]) -> Any:
        import fsspec

        merged = {**options, "skip_instance_cache": True}
        config = dict(merged.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        merged["config_kwargs"] = config
        fs = fsspec.filesystem("s3", **merged)
        fs.retries = 1
        return fs

    def ranged_get(self, fs: Any, path: str, start: int, end: int) -> tuple[bytes, str | None]:
        # s3fs's cat_file does not expose Content-Range: issue the GET through its client call.
        from fsspec.asyn import sync

        bucket, key = path.split("/", 1)

        async def get() -> tuple[bytes, str | None]:
            response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")
            try:
                body = await response["Body"].read()
            finally:
                response["Body"].close()
            return bytes(body), response.get("ContentRange")

        return sync(fs.loop, get)  # type: ignore[no-any-return]

    def writer(self, storage: ObjectStorage, name: str, max_buffered_bytes: int | None) -> FileWriter:
        return S3MultipartWriter(storage, name, max_buffered_bytes)


class GCS(ObjectProtocol):
    extra = "gcs"
    conditional_create = True

    def filesystem(self, options: dict[str, Any]) -> Any:
        # The plain client class: the experimental one that gcsfs exports by default probes every bucket's
        # type over gRPC (a minute's stall against emulators and proxies) and is not needed here.
        from gcsfs.core import GCSFileSystem

        class SingleAttemptGCS(GCSFileSystem):  # type: ignore[misc]
            # GCSFileSystem._request retries 6 times with up to 32 s waits; call the undecorated request.
            _request = getattr(GCSFileSystem._request, "__wrapped__", GCSFileSystem._request)

        return SingleAttemptGCS(**{**options, "skip_instance_cache": True})

    def ranged_get(self, fs: Any, path: str, start: int, end: int) -> tuple[bytes, str | None]:
        from fsspec.asyn import sync

        headers, body = sync(fs.loop, fs._call, "GET", fs.url(path), headers={"Range": f"bytes={start}-{end - 1}"})
        found = {k.lower(): v for k, v in dict(headers).items()}
        return bytes(body), found.get("content-range")

    def writer(self, storage: ObjectStorage, name: str, max_buffered_bytes: int | None) -> FileWriter:
        return GCSComposeWriter(storage, name, max_buffered_bytes)


class OtherFsspec(ObjectProtocol):
    """Any other fsspec protocol, by its name."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.extra = protocol

    def filesystem(self, options: dict[str, Any]) -> Any:
        import fsspec

        return fsspec.filesystem(self.protocol, **{**options, "skip_instance_cache": True})


def protocol_for(scheme: str) -> ObjectProtocol:
    """The strategy of URL scheme ``scheme``."""
    if scheme in ("s3", "s3a"):
        return S3()
    if scheme in ("gs", "gcs"):
        return GCS()
    return OtherFsspec(scheme)


# ---- uploads --------------------------------------------------------------------------------------------


@dataclass
class _Upload:
    parts: list[concurrent.futures.Future[Any]] = field(default_factory=list)
    part_names: list[str] = field(default_factory=list)
    upload_id: str | None = None


class PartsWriter(FileWriter, ABC):
    """Streams a data object in parts of ``transfer.part_bytes`` uploaded concurrently; an object of one
    part is a single put.

    Memory: the part being filled, plus the parts in flight (each a copy handed to the upload). With
    ``max_buffered_bytes`` the number in flight is cut to keep the two within it (at most
    ``max_buffered_bytes // part_bytes - 1``, and never more than ``transfer.max_concurrency``); a budget
    below two parts cannot be kept and raises :class:`~reshard.StorageError` on open."""

    def __init__(self, storage: ObjectStorage, name: str, max_buffered_bytes: int | None = None) -> None:
        self.storage = storage
        self.name = name
        self.buffer = bytearray()
        self.position = 0
        self.upload = _Upload()
        part = storage.transfer.part_bytes
        self.max_in_flight = storage.transfer.max_concurrency
        if max_buffered_bytes is not None and self.multipart:
            if max_buffered_bytes < 2 * part:
                raise StorageError(
                    f"{storage.describe(name)}: a memory budget of {max_buffered_bytes} bytes cannot hold the part "
                    f"being filled and one part in flight ({part} bytes each): raise the budget to at least "
                    f"{2 * part} bytes or lower TransferOptions(part_bytes=...)"
                )
            self.max_in_flight = max(1, min(self.max_in_flight, max_buffered_bytes // part - 1))

    multipart = True
    """Whether the object goes up in parts (False: one put of the whole object)."""

    def tell(self) -> int:
        return self.position

    def write(self, data: memoryview) -> None:
        view = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        part = self.storage.transfer.part_bytes
        self.position += len(view)
        while view:
            take = min(len(view), part - len(self.buffer))
            self.buffer += view[:take]
            view = view[take:]
            if len(self.buffer) == part:
                self._submit_buffer()

    def _submit_buffer(self) -> None:
        """Hand the filled buffer to an upload. A slot is waited for first, so that the copy handed over, the
        buffer it is made from and the parts in flight together stay within ``max_in_flight + 1`` parts."""
        in_flight = [f for f in self.upload.parts if not f.done()]
        while len(in_flight) >= self.max_in_flight:
            concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
            in_flight = [f for f in in_flight if not f.done()]
        chunk = bytes(self.buffer)
        self.buffer = bytearray()
        self.upload.parts.append(self.start_part(len(self.upload.parts) + 1, chunk))

    @abstractmethod
    def start_part(self, number: int, chunk: bytes) -> concurrent.futures.Future[Any]:
        """Begin uploading part ``number`` (from 1) in the storage's thread pool."""

    @abstractmethod
    def finish(self, results: list[Any]) -> None:
        """Make the object from its uploaded parts (their futures' results, in order)."""

    def commit(self) -> None:
        if not self.upload.parts:
            self.storage.put(self.name, bytes(self.buffer))
            return
        if self.buffer:
            self._submit_buffer()
        self.finish([f.result() for f in self.upload.parts])

    def abort(self) -> None:
        for future in self.upload.parts:
            with contextlib.suppress(Exception):
                future.result()
        self.abort_upload()
        for part_name in self.upload.part_names:
            with contextlib.suppress(Exception):
                self.storage.delete(part_name)
        with contextlib.suppress(Exception):
            self.storage.delete(self.name)

    def abort_upload(self) -> None:
        """Cancel what the protocol keeps of an unfinished upload (best effort, never raises)."""


class SinglePutWriter(PartsWriter):
    """Buffers the whole object and puts it once (stores without multipart uploads): a data file larger
    than ``max_buffered_bytes`` cannot be written, and the write that would exceed it raises."""

    multipart = False

    def __init__(self, storage: ObjectStorage, name: str, max_buffered_bytes: int | None = None) -> None:
        super().__init__(storage, name, max_buffered_bytes)
        self.max_buffered_bytes = max_buffered_bytes

    def write(self, data: memoryview) -> None:
        if self.max_buffered_bytes is not None and self.position + len(data) > self.max_buffered_bytes:
            raise StorageError(
                f"{self.storage.describe(self.name)}: {self.storage.protocol}:// stores a data file in one put, "
                f"buffered whole in memory, and this one grows past the memory budget of "
                f"{self.max_buffered_bytes} bytes (SaveOptions(memory_budget_bytes=...))"
            )
        self.buffer += data
        self.position += len(data)

    def start_part(self, number: int, chunk: bytes) -> concurrent.futures.Future[Any]:
        raise AssertionError("a single-put writer has no parts")

    def finish(self, results: list[Any]) -> None:
        raise AssertionError("a single-put writer has no parts")


class S3MultipartWriter(PartsWriter):
    """An S3 multipart upload."""

    def __init__(self, storage: ObjectStorage, name: str, max_buffered_bytes: int | None = None) -> None:
        super().__init__(storage, name, max_buffered_bytes)
        self.bucket, self.key = storage.object_path(name).split("/", 1)

    def start_part(self, number: int, chunk: bytes) -> concurrent.futures.Future[Any]:
        storage = self.storage
        fs = storage.fs
        if self.upload.upload_id is None:
            response = storage.call(
                "starting upload of",
                self.name,
                lambda: fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key),
            )
            self.upload.upload_id = response["UploadId"]
        upload_id = self.upload.upload_id

        def upload_part() -> dict[str, Any]:
            response = storage.call(
                f"uploading part {number} of",
                self.name,
                lambda: fs.call_s3(
                    "upload_part", Bucket=self.bucket, Key=self.key, UploadId=upload_id, PartNumber=number, Body=chunk
                ),
            )
            return {"PartNumber": number, "ETag": response["ETag"]}

        return storage.pool().submit(upload_part)

    def finish(self, results: list[Any]) -> None:
        upload_id = self.upload.upload_id
        self.storage.call(
            "completing upload of",
            self.name,
            lambda: self.storage.fs.call_s3(
                "complete_multipart_upload",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=upload_id,
                MultipartUpload={"Parts": results},
            ),
        )

    def abort_upload(self) -> None:
        if self.upload.upload_id is None:
            return
        with contextlib.suppress(Exception):
            self.storage.fs.call_s3(
                "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload.upload_id
            )


class GCSComposeWriter(PartsWriter):
    """GCS's parallel composite upload: parts as temporary objects, composed into the object, then deleted."""

    def start_part(self, number: int, chunk: bytes) -> concurrent.futures.Future[Any]:
        part_name = f"{self.name}.parts-{uuid.uuid4().hex[:8]}/{number:05d}"
        self.upload.part_names.append(part_name)
        return self.storage.pool().submit(self.storage.put, part_name, chunk)

    def finish(self, results: list[Any]) -> None:
        self._compose(list(self.upload.part_names))
        for part_name in self.upload.part_names:
            self.storage.delete(part_name)

    def _compose(self, sources: list[str]) -> None:
        """GCS compose takes at most 32 sources: compose in a tree through intermediate objects."""
        storage = self.storage
        path = storage.object_path
        level = 0
        while len(sources) > 32:
            grouped = []
            for i in range(0, len(sources), 32):
                target = f"{self.name}.compose-{level}-{i // 32:05d}-{uuid.uuid4().hex[:8]}"
                group = sources[i : i + 32]
                storage.call(
                    "composing",
                    target,
                    lambda t=target, g=group: storage.fs.merge(path(t), [path(s) for s in g]),  # type: ignore[misc]
                )
                grouped.append(target)
                self.upload.part_names.append(target)
            sources = grouped
            level += 1
        storage.call("composing", self.name, lambda: storage.fs.merge(path(self.name), [path(s) for s in sources]))
