"""The ``reshard`` command line: a thin shell over the public functions.

Exit codes: 0 success; 1 the checkpoint is missing, incomplete, corrupt or otherwise refused (the
message says which), or ``validate`` found problems; 2 wrong usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from reshard._version import __version__
from reshard.codec import encode_tagged
from reshard.errors import CheckpointError
from reshard.load import read_metadata
from reshard.metadata import FORMAT_NAME, FORMAT_VERSION, Metadata

__all__ = ["inspect_summary", "main"]


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def inspect_summary(metadata: Metadata, path: str) -> dict[str, Any]:
    """The facts ``reshard inspect`` shows, as JSON-able data."""
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
        "version": FORMAT_VERSION,
        "save_id": metadata.save_id,
        "created_by": metadata.created_by,
        "layout": {"world_size": metadata.world_size, "writers": len(metadata.files)},
        "checksum": {"algorithm": "crc32c", "chunk_bytes": metadata.checksum_chunk_bytes},
        "files": len(metadata.files),
        "file_bytes": sum(f.size for f in metadata.files),
        "tensor_bytes": metadata.total_bytes,
        "tensors": tensors,
        "objects": objects,
        "common": {k: encode_tagged(v, where=k) for k, v in sorted(metadata.common.items())},
    }


def _print_inspect(summary: dict[str, Any]) -> None:
    out = sys.stdout.write
    out(f"checkpoint {summary['path']}\n")
    out(f"  format {summary['format']} v{summary['version']}, save {summary['save_id']}, by {summary['created_by']}\n")
    layout = summary["layout"]
    out(
        f"  saved by {layout['world_size']} ranks ({layout['writers']} wrote data files); "
        f"{_human_bytes(summary['tensor_bytes'])} of tensors in {_human_bytes(summary['file_bytes'])} of files\n\n"
    )
    rows = [("key", "dtype", "global shape", "boxes", "grid", "bytes")]
    for t in summary["tensors"]:
        grid = "x".join(map(str, t["grid"])) or "-"
        rows.append((t["key"], t["dtype"], str(t["global_shape"]), str(t["boxes"]), grid, _human_bytes(t["bytes"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        out("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n")
    if summary["objects"]:
        out("\n  objects:\n")
        for o in summary["objects"]:
            out(f"    {o['key']}  grid {o['global_shape']}  {o['entries']} entries  {_human_bytes(o['bytes'])}\n")
    if summary["common"]:
        out(f"\n  common values: {', '.join(summary['common'])}\n")
    out(
        f"\n  total: {len(summary['tensors'])} tensors, {_human_bytes(summary['tensor_bytes'])}; "
        f"{len(summary['objects'])} objects; {len(summary['common'])} common values\n"
    )


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--storage-option KEY=VALUE`` pairs; values are JSON when they parse as JSON, else strings."""
    options: dict[str, Any] = {}
    for item in getattr(args, "storage_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CheckpointError(f"--storage-option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options or None


def _cmd_inspect(args: argparse.Namespace) -> int:
    metadata = read_metadata(args.path, storage_options=_storage_options(args))
    summary = inspect_summary(metadata, args.path)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_inspect(summary)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from reshard.maintenance import collect_garbage

    removed = collect_garbage(
        args.path,
        dry_run=args.dry_run,
        min_age_s=args.min_age,
        include_incomplete=args.incomplete,
        storage_options=_storage_options(args),
    )
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        sys.stdout.write(f"{verb} {name}\n")
    sys.stdout.write(f"{verb} {len(removed)} unreferenced data files\n")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from reshard.maintenance import validate_checkpoint

    problems = validate_checkpoint(args.path, quick=args.quick, storage_options=_storage_options(args))
    for problem in problems:
        sys.stdout.write(f"PROBLEM: {problem}\n")
    kind = "presence and sizes" if args.quick else "presence, sizes and every checksum"
    if problems:
        sys.stdout.write(f"{args.path}: {len(problems)} problems ({kind} checked)\n")
        return 1
    sys.stdout.write(f"{args.path}: OK ({kind} checked)\n")
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    from reshard.manager import CheckpointManager, scan_root

    manager = CheckpointManager(args.root, storage_options=_storage_options(args))
    try:
        infos = scan_root(manager.root)
        latest = manager.latest_pointer()
    finally:
        manager.close()
    if args.json:
        json.dump(
            {
                "root": args.root,
                "latest": latest,
                "steps": [
                    {
                        "step": i.step,
                        "name": i.name,
                        "status": i.status,
                        "locked": i.locked,
                        "tensor_bytes": i.tensor_bytes,
                        "world_size": i.world_size,
                        "problem": i.problem,
                    }
                    for i in infos
                ],
            },
            sys.stdout,
            indent=2,
        )
        sys.stdout.write("\n")
        return 0
    sys.stdout.write(f"{args.root}: {len(infos)} step directories, latest -> {latest}\n")
    for info in infos:
        flags = (" (latest)" if info.step == latest else "") + (" (locked: being written)" if info.locked else "")
        size = _human_bytes(info.tensor_bytes) if info.status == "complete" else "-"
        sys.stdout.write(f"  {info.name}  {info.status:<10}  {size:>10}{flags}\n")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from reshard.demo.run import main as demo_main

    return demo_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reshard",
        description="Inspect and work with reshard checkpoints (topology-independent PyTorch checkpoints).",
        epilog="Exit codes: 0 success, 1 checkpoint missing/incomplete/corrupt/refused, 2 wrong usage.",
    )
    parser.add_argument("--version", action="version", version=f"reshard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    storage = argparse.ArgumentParser(add_help=False)
    storage.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="an option for the object-store client (repeatable), e.g. endpoint_url=http://127.0.0.1:9000; "
        "credentials otherwise come from the client's usual environment and configuration files",
    )
    inspect = sub.add_parser(
        "inspect",
        parents=[storage],
        help="show the tensors, dtypes, shapes, boxes and bytes of a checkpoint",
        description="Print, per tensor, its dtype, global shape, number of saved boxes, the grid of box offsets "
        "per axis and its bytes; then objects, common values, totals and the saving layout. Reads only "
        "metadata.json.",
    )
    inspect.add_argument("path", help="checkpoint directory or URL (file://, s3://bucket/prefix, gs://bucket/prefix)")
    inspect.add_argument("--json", action="store_true", help="print the same facts as JSON")
    inspect.set_defaults(func=_cmd_inspect)
    validate = sub.add_parser(
        "validate",
        parents=[storage],
        help="check a checkpoint: completeness, file sizes and every checksum",
        description="Check that PATH is a complete checkpoint (metadata.json present and valid), that every data "
        "file exists with its recorded size, and (unless --quick) every CRC-32C of every stored box and object. "
        "Prints each problem; exits 1 if there is any.",
    )
    validate.add_argument("path", help="checkpoint directory or URL")
    validate.add_argument("--quick", action="store_true", help="check presence and sizes only, not checksums")
    validate.set_defaults(func=_cmd_validate)
    ls = sub.add_parser(
        "ls",
        parents=[storage],
        help="list the step checkpoints of a CheckpointManager root",
        description="List the step directories of a manager root with their status (complete, incomplete: an "
        "interrupted or running save, corrupt), size, and which one latest.json points at.",
    )
    ls.add_argument("root", help="manager root directory or URL")
    ls.add_argument("--json", action="store_true", help="print the listing as JSON")
    ls.set_defaults(func=_cmd_ls)
    gc = sub.add_parser(
        "gc",
        parents=[storage],
        help="remove data files that no commit references (failed or interrupted saves)",
        description="Remove the data files under PATH/data that metadata.json does not reference: leftovers of "
        "saves that failed, were interrupted, or lost a race. Files younger than --min-age are kept, since a save "
        "may still be writing them. Loads ignore such files, so this only frees space.",
    )
    gc.add_argument("path", help="checkpoint directory or URL")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    gc.add_argument(
        "--min-age", type=float, default=3600.0, metavar="SECONDS", help="keep files younger than this (default 3600)"
    )
    gc.add_argument(
        "--incomplete",
        action="store_true",
        help="also clean a path with data but no metadata.json (an interrupted save): remove all its data",
    )
    gc.set_defaults(func=_cmd_gc)
    demo = sub.add_parser("demo", help="train a small GPT on CPU ranks, save, resume on another layout, train on")
    from reshard.demo.run import build_parser as build_demo_parser

    build_demo_parser(demo)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reshard`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except CheckpointError as exc:
        sys.stderr.write(f"reshard {args.command}: {exc}\n")
        return 1
    except BrokenPipeError:  # output piped into a reader that stopped early (| head)
        return 0
    return code


if __name__ == "__main__":
    raise SystemExit(main())
