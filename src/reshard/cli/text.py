"""What the command line prints: terminal-safe text and the summary of ``reshard inspect``."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reshard.metadata import Metadata

__all__ = ["SafeText", "counted", "human_bytes", "inspect_summary", "print_inspect", "printable"]


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: ``1 problem``, ``3 problems``, ``2 entries``."""
    if n == 1:
        return f"{n} {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") and noun[-2:-1] not in "aeiou" else f"{n} {noun}s"


def printable(text: str) -> str:
    """``text`` safe to show on a terminal: every character that is not printable (control characters such
    as ESC, format characters such as a right-to-left override, lone surrogates) except the newline is
    written as an escape (``\\x1b``, ``\\u202e``), so that a key or path read from a checkpoint cannot move
    the cursor, recolour the terminal or fail to encode."""
    if all(c.isprintable() or c == "\n" for c in text):
        return text
    out = []
    for c in text:
        if c.isprintable() or c == "\n":
            out.append(c)
        else:
            code = ord(c)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


class SafeText:
    """A text stream that writes :func:`printable` text, and falls back to backslash escapes for what its
    encoding cannot hold (an ASCII terminal, say)."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        safe = printable(text)
        try:
            return int(self.stream.write(safe))
        except UnicodeEncodeError:
            encoding = getattr(self.stream, "encoding", None) or "ascii"
            return int(self.stream.write(safe.encode(encoding, "backslashreplace").decode(encoding)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def inspect_summary(metadata: Metadata, path: str) -> dict[str, Any]:
    """The facts ``reshard inspect`` shows, as JSON-able data."""
    from reshard.metadata import FORMAT_NAME
    from reshard.state.codec import encode_tagged

    own = [f for f in metadata.files if f.checkpoint is None]
    tensors = []
    for key, tensor in sorted(metadata.tensors.items()):
        grid = [len({b.offset[axis] for b in tensor.boxes}) for axis in range(len(tensor.global_shape))]
        tensors.append(
            {
                "key": key,
                "dtype": tensor.dtype,
                "global_shape": list(tensor.global_shape),
                "boxes": len(tensor.boxes),
                "grid": grid,
                "bytes": sum(b.byte_length for b in tensor.boxes),
            }
        )
    objects = [
        {
            "key": key,
            "global_shape": list(obj.global_shape),
            "entries": len(obj.entries),
            "bytes": sum(e.byte_length for e in obj.entries),
        }
        for key, obj in sorted(metadata.objects.items())
    ]
    return {
        "path": path,
        "format": FORMAT_NAME,
        "version": metadata.format_version,
        "save_id": metadata.save_id,
        "created_by": metadata.created_by,
        "layout": {"world_size": metadata.world_size, "writers": len(own)},
        "checksum": {"algorithm": "crc32c", "chunk_bytes": metadata.checksum_chunk_bytes},
        "files": len(own),
        "file_bytes": sum(f.size for f in own),
        "tensor_bytes": metadata.total_bytes,
        "written_bytes": metadata.total_bytes - metadata.referenced_bytes,
        "referenced_bytes": metadata.referenced_bytes,
        "referenced_checkpoints": list(metadata.referenced_checkpoints),
        "content_hashes": metadata.content_hashes,
        "tensors": tensors,
        "objects": objects,
        "common": {k: encode_tagged(v, where=k) for k, v in sorted(metadata.common.items())},
    }


def print_inspect(summary: dict[str, Any]) -> None:
    out = sys.stdout.write
    out(f"checkpoint {summary['path']}\n")
    out(f"  format {summary['format']} v{summary['version']}, save {summary['save_id']}, by {summary['created_by']}\n")
    layout = summary["layout"]
    out(
        f"  saved by {counted(layout['world_size'], 'rank')} ({layout['writers']} wrote data files); "
        f"{human_bytes(summary['tensor_bytes'])} of tensors in {human_bytes(summary['file_bytes'])} of files\n"
    )
    if summary["referenced_checkpoints"]:
        out(
            f"  incremental: {human_bytes(summary['written_bytes'])} of tensors written, "
            f"{human_bytes(summary['referenced_bytes'])} referenced in {', '.join(summary['referenced_checkpoints'])}\n"
        )
    out("\n")
    rows = [("key", "dtype", "global shape", "boxes", "grid", "bytes")]
    for t in summary["tensors"]:
        grid = "x".join(map(str, t["grid"])) or "-"
        rows.append((t["key"], t["dtype"], str(t["global_shape"]), str(t["boxes"]), grid, human_bytes(t["bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")
    if summary["objects"]:
        out("\n  objects:\n")
        for o in summary["objects"]:
            cells = counted(o["entries"], "entry")
            out(f"    {o['key']}  grid {o['global_shape']}  {cells}  {human_bytes(o['bytes'])}\n")
    if summary["common"]:
        out(f"\n  common values: {', '.join(summary['common'])}\n")
    out(
        f"\n  total: {counted(len(summary['tensors']), 'tensor')}, {human_bytes(summary['tensor_bytes'])}; "
        f"{counted(len(summary['objects']), 'object')}; {counted(len(summary['common']), 'common value')}\n"
    )
