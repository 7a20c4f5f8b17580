"""Where checkpoints live. :func:`storage_for` picks the backend for a path."""

from __future__ import annotations

import os

from reshard.storage.base import FileReader, FileWriter, Storage
from reshard.storage.local import LocalStorage

__all__ = ["FileReader", "FileWriter", "LocalStorage", "Storage", "storage_for"]


def storage_for(path: str | os.PathLike[str]) -> Storage:
    """The storage backend of a checkpoint path: a local directory (``file://`` URLs included)."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    elif "://" in text:
        from reshard.errors import CheckpointError

        raise CheckpointError(f"unsupported checkpoint URL {text!r}: only local paths are supported")
    return LocalStorage(text)
