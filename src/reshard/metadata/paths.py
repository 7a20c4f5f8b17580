"""The file names a checkpoint's metadata may hold: relative, inside the checkpoint, never escaping it."""

from __future__ import annotations

from typing import Any

from reshard.metadata.model import MAX_INTEGER, REFERENCED_FILE_PATTERN, DataFile

__all__ = ["check_relative_path", "plain_data_file"]


def check_relative_path(path: str) -> str | None:
    """Why ``path`` is not a safe relative file name inside a checkpoint, or None when it is.

    Safe names are POSIX relative paths of non-empty components, without ``.``/``..``, backslashes,
    NUL, a URL scheme or a drive letter.
    """
    if not path:
        return "is empty"
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 text"
    if "\x00" in path:
        return "contains NUL"
    if "\\" in path:
        return "contains a backslash"
    if path.startswith("/"):
        return "is absolute"
    if ":" in path:
        return "contains ':' (a scheme or drive)"
    parts = path.split("/")
    if "" in parts or "." in parts or ".." in parts:
        return "has an empty, '.' or '..' component"
    return None


def plain_data_file(item: Any) -> DataFile | None:
    """``files[i]`` as a :class:`DataFile` when it is the common entry, checked at once: exactly a path and a
    size, the path a data file name as a save gives it (``data/<32 hex digits>-r<rank>.bin``, safe by its form),
    the size an integer in range; None for anything else, which the parser checks field by field (naming the
    field at fault). Every rank of a load parses the files of thousands of ranks."""
    if type(item) is not dict or len(item) != 2:
        return None
    path, size = item.get("path"), item.get("size")
    if isinstance(path, str) and isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= MAX_INTEGER:
        return DataFile(path=path, size=size) if REFERENCED_FILE_PATTERN.fullmatch(path) else None
    return None
