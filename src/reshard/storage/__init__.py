"""Where checkpoints live. :func:`storage_for` picks the backend for a path or URL."""

from __future__ import annotations

import os
from typing import Any

from reshard.storage.base import FileTooLargeError, FileWriter, RangeReadError, ReadRequest, Storage
from reshard.storage.local import LocalStorage
from reshard.storage.objectstore import ObjectStorage, RetryPolicy, TransferOptions

__all__ = [
    "CheckpointLocation",
    "FileTooLargeError",
    "FileWriter",
    "LocalStorage",
    "ObjectStorage",
    "RangeReadError",
    "ReadRequest",
    "RetryPolicy",
    "Storage",
    "TransferOptions",
    "storage_for",
]

CheckpointLocation = str | os.PathLike[str] | Storage
"""Where a checkpoint is: a local path, a ``file://``, ``s3://`` or ``gs://`` URL, or a Storage object."""


def storage_for(path: CheckpointLocation, storage_options: dict[str, Any] | None = None) -> Storage:
    """The storage backend of a checkpoint location.

    Plain paths and ``file://`` URLs are local directories; ``s3://bucket/prefix`` and ``gs://bucket/prefix``
    are object-store prefixes (through fsspec with s3fs or gcsfs, installed by the ``reshard[s3]`` and
    ``reshard[gcs]`` extras), configured by the clients' usual environment and files plus
    ``storage_options``, passed to the fsspec filesystem. A :class:`Storage` is returned as it is.
    """
    if isinstance(path, Storage):
        return path
    text = os.fspath(path)
    if text.startswith("file://"):
        return LocalStorage(text[len("file://") :])
    if "://" in text:
        return ObjectStorage(text, storage_options)
    return LocalStorage(text)
