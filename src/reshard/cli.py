"""The ``reshard`` command line: a thin shell over the public functions.

Subcommands: ``inspect``, ``validate``, ``ls``, ``diff``, ``convert``, ``export``, ``import-dcp``, ``gc``,
``demo``; ``reshard COMMAND --help`` describes each (docs/cli.md too). Long operations draw a progress bar
(bytes and throughput) on stderr when it is a terminal, unless ``--quiet``.

Exit codes:

- 0: success (``diff``: no difference beyond the tolerance; ``validate``: no problem).
- 1: ``diff`` found differences, or ``validate`` found problems.
- 2: wrong usage (unknown option, missing argument, unreadable key map, missing ``--trust-pickle``).
- 3: a checkpoint is missing, incomplete, corrupt, locked or otherwise refused, or storage failed (the
  one-line message on stderr says which).
- 130: interrupted (Ctrl-C).
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
from reshard.metadata import FORMAT_NAME, Metadata

__all__ = ["inspect_summary", "main", "printable"]


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


class _SafeText:
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
        "version": metadata.format_version,
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


class _UsageError(Exception):
    """A command-line mistake found after parsing (exit code 2)."""


class _TqdmProgress:
    """A tqdm bar on stderr: bytes with binary unit prefixes, and throughput."""

    def __init__(self) -> None:
        self.bar: Any = None

    def start(self, total_bytes: int, description: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total_bytes, desc=description, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr
        )

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _progress(args: argparse.Namespace) -> _TqdmProgress | None:
    """A progress bar when stderr is a terminal and ``--quiet`` is off; None otherwise."""
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        return None
    return _TqdmProgress()


def _cast_dtype(args: argparse.Namespace) -> Any:
    from reshard.interop.offline import CAST_DTYPES

    return CAST_DTYPES[args.dtype] if args.dtype else None


def _say(args: argparse.Namespace, line: str) -> None:
    """A summary line on stdout, unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        sys.stdout.write(line + "\n")


def _fmt_float(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _cmd_diff(args: argparse.Namespace) -> int:
    from reshard.interop.diff import diff_checkpoints

    report = diff_checkpoints(
        args.a,
        args.b,
        atol=args.atol,
        rtol=args.rtol,
        ignore_dtypes=args.ignore_dtypes,
        storage_options=_storage_options(args),
        progress=_progress(args),
    )
    if args.json:
        json.dump(report.to_json_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not args.quiet:
        shown = [t for t in report.tensors if args.all or t.problem is not None]
        rows = [("key", "max abs", "max rel", "result")]
        rows += [(t.key, _fmt_float(t.max_abs), _fmt_float(t.max_rel), t.problem or "within tolerance") for t in shown]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        if shown:
            for row in rows:
                cells = [cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)]
                sys.stdout.write("  ".join([*cells, row[3]]) + "\n")
        for entry in report.entries:
            sys.stdout.write(f"{entry.kind} {entry.key}: {entry.problem}\n")
        verdict = "no differences beyond the tolerance" if report.ok else f"{report.problems} differences"
        sys.stdout.write(f"{len(report.tensors)} tensors compared (atol {args.atol}, rtol {args.rtol}): {verdict}\n")
    return 0 if report.ok else 1


def _cmd_convert(args: argparse.Namespace) -> int:
    from reshard.interop.convert import convert_checkpoint

    if (args.dst is None) == (args.to is None):
        raise _UsageError("give the destination either as DST or as --to URL (exactly one)")
    dst = args.dst if args.dst is not None else args.to
    if args.dry_run:
        metadata = read_metadata(args.src, storage_options=_storage_options(args))
        cast = _cast_dtype(args)
        casts = [k for k, t in metadata.tensors.items() if cast is not None and t.torch_dtype.is_floating_point]
        sys.stdout.write(
            f"would copy {len(metadata.tensors)} tensors ({_human_bytes(metadata.total_bytes)}), "
            f"{len(metadata.objects)} objects and {len(metadata.common)} common values to {dst}"
            + (f", casting {len(casts)} floating-point tensors to {args.dtype}" if cast is not None else "")
            + "\n"
        )
        return 0
    metadata = convert_checkpoint(
        args.src,
        dst,
        dtype=_cast_dtype(args),
        overwrite=args.overwrite,
        storage_options=_storage_options(args),
        progress=_progress(args),
    )
    _say(
        args,
        f"wrote {dst}: {len(metadata.tensors)} tensors ({_human_bytes(metadata.total_bytes)}), "
        f"{len(metadata.objects)} objects, {len(metadata.common)} common values",
    )
    return 0


def _key_map(args: argparse.Namespace) -> Any:
    """The export's key map: ``--key-map`` (JSON: key -> name or null) and ``--prefix``, as one function."""
    mapping: dict[str, str | None] = {}
    if args.key_map:
        try:
            with open(args.key_map, encoding="utf-8") as handle:
                loaded = json.load(handle)
        except (OSError, ValueError) as exc:
            raise _UsageError(f"cannot read the key map {args.key_map}: {exc}") from exc
        if not isinstance(loaded, dict) or not all(v is None or isinstance(v, str) for v in loaded.values()):
            raise _UsageError(f"the key map {args.key_map} must be a JSON object of key -> name (or null)")
        mapping = loaded
    prefix: str | None = args.prefix
    if prefix is None:
        return mapping or None

    def name(key: str) -> str | None:
        if key in mapping:
            return mapping[key]
        return key[len(prefix) :] if key.startswith(prefix) and len(key) > len(prefix) else None

    return name


def _cmd_export(args: argparse.Namespace) -> int:
    from reshard.interop.export import export_safetensors

    result = export_safetensors(
        args.checkpoint,
        args.out,
        key_map=_key_map(args),
        dtype=_cast_dtype(args),
        max_shard_bytes=args.max_shard_size,
        overwrite=args.overwrite,
        storage_options=_storage_options(args),
        progress=_progress(args),
    )
    _say(
        args,
        f"wrote {args.out}: {len(result.weight_map)} tensors ({_human_bytes(result.total_bytes)}) in "
        f"{len(result.files)} safetensors files and model.safetensors.index.json",
    )
    if result.left_out:
        _say(args, f"left out by the key map: {len(result.left_out)} tensors")
    if result.not_tensors:
        _say(args, f"not exported (safetensors holds tensors only): {result.not_tensors} objects and common values")
    return 0


def _cmd_import_dcp(args: argparse.Namespace) -> int:
    if not args.trust_pickle:
        raise _UsageError(
            "--trust-pickle is required: a torch.distributed.checkpoint directory keeps its metadata as a pickle, "
            "and loading it can execute code from the file; pass it only for a checkpoint you trust"
        )
    import warnings

    from reshard.interop.dcp import import_dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="reshard import-dcp")  # reported below instead
        result = import_dcp(
            args.src,
            args.dst,
            trust_pickle=True,
            strict=args.strict,
            overwrite=args.overwrite,
            storage_options=_storage_options(args),
            progress=_progress(args),
        )
    for path, reason in result.left_out.items():
        sys.stderr.write(f"reshard import-dcp: left out {path!r}: {reason}\n")
    metadata = result.metadata
    _say(
        args,
        f"wrote {args.dst}: {len(metadata.tensors)} tensors ({_human_bytes(metadata.total_bytes)}), "
        f"{len(metadata.common)} common values; {len(result.left_out)} values left out",
    )
    return 0


def _cmd_export_peft(args: argparse.Namespace) -> int:
    from reshard.demo.peft import export_peft

    exported = export_peft(args.checkpoint, args.out, storage_options=_storage_options(args))
    print(f"wrote {len(exported)} adapter tensors to {args.out} (adapter_model.safetensors, adapter_config.json)")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from reshard.demo.run import main as demo_main

    return demo_main(args)


EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE, EXIT_CHECKPOINT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES_HELP = """Exit codes:
  0    success (diff: nothing differs beyond the tolerance; validate: no problem)
  1    diff found differences, or validate found problems
  2    wrong usage (bad option, unreadable key map, import-dcp without --trust-pickle)
  3    a checkpoint is missing, incomplete, corrupt, locked or refused, or storage failed
  130  interrupted"""


def _add_diff_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    diff = sub.add_parser(
        "diff",
        parents=parents,
        help="compare two checkpoints tensor by tensor; exit 1 if they differ beyond a tolerance",
        description="Compare checkpoint A with checkpoint B (the reference) whatever layouts saved them: per "
        "tensor the largest absolute difference max|a-b| and relative difference max|a-b|/|b|, computed in "
        "float64 slab by slab (bounded memory); keys on one side only, differing global shapes and dtypes; "
        "ShardedObject cells by their bytes and common values by value. An element differs when "
        "|a-b| > atol + rtol*|b|; two NaNs at the same place are equal. Prints the tensors that differ "
        "(all with --all) and exits 1 if anything differs.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("a", help="checkpoint A (directory or URL)")
    diff.add_argument("b", help="checkpoint B, the reference (directory or URL)")
    diff.add_argument("--atol", type=_non_negative_float, default=0.0, help="absolute tolerance (default 0)")
    diff.add_argument("--rtol", type=_non_negative_float, default=0.0, help="relative tolerance (default 0)")
    diff.add_argument(
        "--ignore-dtypes",
        action="store_true",
        help="compare tensors whose dtypes differ by value only (a bf16 copy against its fp32 source)",
    )
    diff.add_argument("--all", action="store_true", help="list every tensor, not only those that differ")
    diff.add_argument("--json", action="store_true", help="print the full report as JSON")
    diff.set_defaults(func=_cmd_diff)


def _add_convert_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    convert = sub.add_parser(
        "convert",
        parents=parents,
        help="copy a checkpoint (local <-> s3:// or gs://), optionally casting floating-point tensors",
        description="Copy checkpoint SRC to DST (or --to URL) in one process, tensor by tensor in bounded "
        "memory: same keys, global shapes, objects and common values; each tensor stored as one box. Every "
        "checksum is verified while reading, the copy is committed like a save (metadata.json last) and "
        "passes `reshard validate`. DST may be SRC itself with --overwrite (an in-place cast: the old "
        "checkpoint stays loadable until the new one commits). --storage-option applies to both sides.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("src", help="the checkpoint to copy (directory or URL)")
    convert.add_argument("dst", nargs="?", help="where to write the copy (directory or URL)")
    convert.add_argument("--to", metavar="URL", help="the destination, instead of DST (e.g. s3://bucket/prefix)")
    convert.add_argument("--overwrite", action="store_true", help="replace a complete checkpoint at the destination")
    convert.add_argument("--dry-run", action="store_true", help="say what would be copied, write nothing")
    convert.set_defaults(func=_cmd_convert)


def _add_export_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    export = sub.add_parser(
        "export",
        parents=parents,
        help="write a checkpoint's tensors as Hugging Face sharded safetensors",
        description="Write every tensor of CKPT, whole and unpadded, into OUT as model-0000i-of-0000n.safetensors "
        "files plus model.safetensors.index.json (written last), streamed slab by slab so memory stays bounded "
        "whatever the tensor sizes. Names are the checkpoint keys, unless --key-map or --prefix say otherwise. "
        "ShardedObjects and common values are not exported (safetensors holds tensors only).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export.add_argument("checkpoint", metavar="CKPT", help="the checkpoint (directory or URL)")
    export.add_argument("out", metavar="OUT", help="the output directory (or URL); other files in it are kept")
    export.add_argument("--format", choices=["safetensors"], default="safetensors", help="the output format")
    export.add_argument(
        "--max-shard-size",
        type=_size,
        default="5GB",
        metavar="SIZE",
        help="largest shard, e.g. 2GB, 500MB, 1GiB (KB/MB/GB powers of 1000; default 5GB); a larger tensor "
        "gets a shard of its own",
    )
    export.add_argument(
        "--key-map",
        metavar="FILE.json",
        help="a JSON object mapping checkpoint keys to output names; null leaves a tensor out; keys it does "
        "not list keep their names (or follow --prefix); a key the checkpoint lacks is an error",
    )
    export.add_argument(
        "--prefix",
        help="export only the keys that start with PREFIX, with PREFIX removed (e.g. --prefix model.)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")
    export.set_defaults(func=_cmd_export)


def _add_import_dcp_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    imported = sub.add_parser(
        "import-dcp",
        parents=parents,
        help="convert a torch.distributed.checkpoint directory into a reshard checkpoint (needs --trust-pickle)",
        description="Convert the DCP checkpoint directory SRC into a reshard checkpoint at DST, tensor by "
        "tensor: each tensor is loaded whole by DCP in this process and streamed out, so memory holds one "
        "tensor at a time. Non-tensor values are read with torch.load(weights_only=True): plain data becomes "
        "common values (and tensors inside them tensors) at their dotted paths; anything else is left out "
        "with a message (an error with --strict). DCP's .metadata is a PICKLE: loading it can execute code "
        "from the file, so --trust-pickle is required.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    imported.add_argument("src", help="the torch.distributed.checkpoint directory (local)")
    imported.add_argument("dst", help="where to write the reshard checkpoint (directory or URL)")
    imported.add_argument(
        "--trust-pickle",
        action="store_true",
        help="required: DCP's .metadata is a pickle and loading it can execute code from the file; pass this "
        "only for a checkpoint from a source you trust",
    )
    imported.add_argument(
        "--strict", action="store_true", help="fail on a non-tensor value that cannot be stored (default: leave it out)"
    )
    imported.add_argument("--overwrite", action="store_true", help="replace a complete checkpoint at DST")
    imported.set_defaults(func=_cmd_import_dcp)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a non-negative number")
    return value


def _size(text: str) -> int:
    from reshard.interop.export import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reshard",
        description="Inspect and work with reshard checkpoints (topology-independent PyTorch checkpoints).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        "saves that failed, were interrupted, or lost a race. Only names a save writes are candidates; files "
        "younger than --min-age are kept, since a save may still be writing them; a data directory that is a "
        "symbolic link is refused. Loads ignore such files, so this only frees space.",
    )
    gc.add_argument("path", help="checkpoint directory or URL")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    gc.add_argument(
        "--min-age", type=float, default=3600.0, metavar="SECONDS", help="keep files younger than this (default 3600)"
    )
    gc.add_argument(
        "--incomplete",
        action="store_true",
        help="also clean a path with data but no metadata.json (an interrupted save): remove all its data files",
    )
    gc.set_defaults(func=_cmd_gc)
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar and no summary (the bar is drawn only when stderr is a terminal anyway)",
    )
    dtype = argparse.ArgumentParser(add_help=False)
    dtype.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        help="cast floating-point tensors (float8 included) to this dtype; integer, bool and complex tensors "
        "keep theirs",
    )
    _add_diff_parser(sub, [storage, quiet])
    _add_convert_parser(sub, [storage, quiet, dtype])
    _add_export_parser(sub, [storage, quiet, dtype])
    _add_import_dcp_parser(sub, [storage, quiet])
    export_peft = sub.add_parser(
        "export-peft",
        parents=[storage],
        help="write the demo model's LoRA adapters as a Hugging Face PEFT adapter",
        description="Read the LoRA adapters of a demo-model checkpoint (adapter-only or full, any saving layout) "
        "whole, and write OUT/adapter_model.safetensors (PEFT key names, fused QKV and GLU linears split per "
        "projection) and OUT/adapter_config.json. The naming is reshard.demo.peft.demo_peft_tensors; the Python "
        "API export_peft(..., name_map=) takes another.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export_peft.add_argument("checkpoint", metavar="CKPT", help="the checkpoint (directory or URL)")
    export_peft.add_argument("out", metavar="OUT", help="the output directory (or URL); must not hold an adapter")
    export_peft.set_defaults(func=_cmd_export_peft)
    demo = sub.add_parser("demo", help="train a small GPT on CPU ranks, save, resume on another layout, train on")
    from reshard.demo.run import build_parser as build_demo_parser

    build_demo_parser(demo)
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reshard`` command; returns the exit code."""
    args = build_parser().parse_args(argv)
    stdout = sys.stdout
    sys.stdout = _SafeText(stdout)  # keys and paths from checkpoints are untrusted
    errors = _SafeText(sys.stderr)
    try:
        code: int = args.func(args)
    except _UsageError as exc:
        errors.write(f"reshard {args.command}: error: {exc}\n")
        return EXIT_USAGE
    except CheckpointError as exc:
        errors.write(f"reshard {args.command}: {exc}\n")
        return EXIT_CHECKPOINT
    except BrokenPipeError:  # output piped into a reader that stopped early (| head)
        return EXIT_OK
    except KeyboardInterrupt:
        errors.write(f"reshard {args.command}: interrupted\n")
        return EXIT_INTERRUPTED
    finally:
        sys.stdout = stdout
    return code


if __name__ == "__main__":
    raise SystemExit(main())
