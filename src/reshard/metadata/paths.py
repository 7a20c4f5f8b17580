"""The file names a checkpoint's metadata may hold: relative, inside the checkpoint, never escaping it."""

from __future__ import annotations

__all__ = ["check_relative_path"]


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
