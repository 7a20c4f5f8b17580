"""The subcommands of ``reshard``: each takes the parsed arguments and returns the exit code."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from reshard.cli.text import counted, human_bytes, inspect_summary, print_inspect, printable
from reshard.errors import CheckpointNotFoundError

__all__ = [
    "EXIT_CHECKPOINT",
    "EXIT_CODES_HELP",
    "EXIT_DIFFERENT",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "UsageError",
    "cmd_convert",
    "cmd_demo",
    "cmd_diff",
    "cmd_export",
    "cmd_export_hf",
    "cmd_export_peft",
    "cmd_gc",
    "cmd_import_dcp",
    "cmd_inspect",
    "cmd_ls",
    "cmd_validate",
]


def storage_options_of(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--storage-option KEY=VALUE`` pairs; values are JSON when they parse as JSON, else strings."""
    options: dict[str, Any] = {}
    for item in getattr(args, "storage_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options or None


def cmd_inspect(args: argparse.Namespace) -> int:
    from reshard.flows.load import read_metadata

    metadata = read_metadata(args.path, storage_options=storage_options_of(args))
    summary = inspect_summary(metadata, args.path)
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_inspect(summary)
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from reshard.flows.maintenance import collect_garbage_report, describe_kept, describe_removed

    report = collect_garbage_report(
        args.path,
        dry_run=args.dry_run,
        min_age_s=args.min_age,
        include_incomplete=args.incomplete,
        storage_options=storage_options_of(args),
    )
    verb = "would remove" if args.dry_run else "removed"
    for name in report.removed:
        sys.stdout.write(f"{verb} {name}\n")
    sys.stdout.write(f"{verb} {describe_removed(report.removed)}\n" if report.removed else "nothing to collect\n")
    for line in describe_kept(report, age_option="--min-age"):
        sys.stdout.write(f"{line}\n")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from reshard.flows.maintenance import validate_checkpoint

    problems = validate_checkpoint(
        args.path, quick=args.quick, storage_options=storage_options_of(args), progress=progress_of(args)
    )
    for problem in problems:
        sys.stdout.write(f"PROBLEM: {problem}\n")
    certification = None if args.quiet else certification_line(args)  # part of the summary: not with --quiet
    if certification is not None:
        say(args, f"certification: {printable(certification).replace(chr(10), ' ')}")
    kind = "presence and sizes" if args.quick else "presence, sizes and every checksum"
    if problems:
        say(args, f"{args.path}: {counted(len(problems), 'problem')} ({kind} checked)")
        return 1
    say(args, f"{args.path}: OK ({kind} checked)")
    return 0


def certification_line(args: argparse.Namespace) -> str | None:
    """What ``validate`` says of the certification of the checkpoint at ``args.path`` (None: it has no
    ``metadata.json``, nothing to certify): ``certified (finite, replicas)``, ``not checked``, or ``not certified:``
    and why (a damaged certificate, another save's, failed checks). It never changes the exit code."""
    from reshard.flows.certify import certificate_status, certification_status
    from reshard.metadata import METADATA_FILE
    from reshard.storage import storage_for

    storage = storage_for(args.path, storage_options_of(args))
    try:
        if not storage.exists(METADATA_FILE):
            return None
        record, _ = certificate_status(storage)
        if record is not None:
            return f"certified ({', '.join(record.checks)})"
        return certification_text(certification_status(storage)[1])
    finally:
        storage.close()


def certification_text(why: str) -> str:
    """A step's certification as ``ls`` and ``validate`` show it, from ``StepInfo.certification``."""
    if not why:
        return "certified"
    return why if why == "not checked" else f"not certified: {why}"


def cmd_ls(args: argparse.Namespace) -> int:
    from reshard.flows.manager import CheckpointManager, scan_root

    manager = CheckpointManager(args.root, storage_options=storage_options_of(args))
    try:
        if not manager.root.root_exists():
            raise CheckpointNotFoundError(f"no checkpoint root at {manager.root.describe()}: the path does not exist")
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
                        "dead_writer_pid": i.dead_writer_pid,
                        "tensor_bytes": i.tensor_bytes,
                        "written_bytes": i.written_bytes,
                        "referenced_bytes": i.referenced_bytes,
                        "world_size": i.world_size,
                        "problem": i.problem,
                        "certified": i.certified,
                        "certification": i.certification,
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
        if info.dead_writer_pid is not None:
            flags += f" (interrupted: writer pid {info.dead_writer_pid} on this host is gone)"
        size = human_bytes(info.tensor_bytes) if info.status == "complete" else "-"
        if info.referenced_bytes:
            written, referenced = human_bytes(info.written_bytes), human_bytes(info.referenced_bytes)
            flags = f"  ({written} written, {referenced} referenced)" + flags
        if info.status == "complete":
            flags += f"  {printable(certification_text(info.certification)).replace(chr(10), ' ')}"
        sys.stdout.write(f"  {info.name}  {info.status:<10}  {size:>10}{flags}\n")
    return 0


class UsageError(Exception):
    """A command-line mistake found after parsing (exit code 2)."""


class TqdmProgress:
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


def progress_of(args: argparse.Namespace) -> TqdmProgress | None:
    """A progress bar when stderr is a terminal and ``--quiet`` is off; None otherwise."""
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        return None
    return TqdmProgress()


def cast_dtype_of(args: argparse.Namespace) -> Any:
    from reshard.interop.offline import CAST_DTYPES

    return CAST_DTYPES[args.dtype] if args.dtype else None


def say(args: argparse.Namespace, line: str) -> None:
    """A summary line on stdout, unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        sys.stdout.write(line + "\n")


def fmt_float(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def cmd_diff(args: argparse.Namespace) -> int:
    from reshard.interop.diff import diff_checkpoints

    report = diff_checkpoints(
        args.a,
        args.b,
        atol=args.atol,
        rtol=args.rtol,
        ignore_dtypes=args.ignore_dtypes,
        storage_options=storage_options_of(args),
        progress=progress_of(args),
    )
    if args.json:
        json.dump(report.to_json_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif not args.quiet:
        shown = [t for t in report.tensors if args.all or t.problem is not None]
        rows = [("key", "max abs", "max rel", "result")]
        rows += [(t.key, fmt_float(t.max_abs), fmt_float(t.max_rel), t.problem or "within tolerance") for t in shown]
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


def cmd_convert(args: argparse.Namespace) -> int:
    from reshard.flows.load import read_metadata
    from reshard.interop.convert import convert_checkpoint
    from reshard.interop.offline import kept_scaled, scaled_part_keys

    if (args.dst is None) == (args.to is None):
        raise UsageError("give the destination either as DST or as --to URL (exactly one)")
    dst = args.dst if args.dst is not None else args.to
    if args.dry_run:
        metadata = read_metadata(args.src, storage_options=storage_options_of(args))
        cast = cast_dtype_of(args)
        parts = scaled_part_keys(metadata)
        casts = [
            k
            for k, t in metadata.tensors.items()
            if cast is not None and t.torch_dtype.is_floating_point and k not in parts
        ]
        sys.stdout.write(
            f"would copy {len(metadata.tensors)} tensors ({human_bytes(metadata.total_bytes)}), "
            f"{len(metadata.objects)} objects and {len(metadata.common)} common values to {dst}"
            + (f", casting {len(casts)} floating-point tensors to {args.dtype}" if cast is not None else "")
            + "\n"
        )
        _say_kept(args, kept_scaled(metadata, cast), force=True)
        return 0
    metadata = convert_checkpoint(
        args.src,
        dst,
        dtype=cast_dtype_of(args),
        overwrite=args.overwrite,
        storage_options=storage_options_of(args),
        progress=progress_of(args),
    )
    say(
        args,
        f"wrote {dst}: {len(metadata.tensors)} tensors ({human_bytes(metadata.total_bytes)}), "
        f"{len(metadata.objects)} objects, {len(metadata.common)} common values",
    )
    _say_kept(args, kept_scaled(metadata, cast_dtype_of(args)))
    return 0


def _say_kept(args: argparse.Namespace, kept: tuple[str, ...], *, force: bool = False) -> None:
    """Name the scaled tensors a ``--dtype`` left in their formats (convert, export)."""
    if not kept:
        return
    names = ", ".join(kept[:10]) + (" ..." if len(kept) > 10 else "")
    line = (
        f"{len(kept)} scaled tensors ({names}) kept in their formats: --dtype casts plain tensors only (the "
        "data, scales and global scale of a scaled tensor are never cast)"
    )
    if force:
        sys.stdout.write(line + "\n")
    else:
        say(args, line)


def key_map_of(args: argparse.Namespace) -> Any:
    """The export's key map: ``--key-map`` (JSON: key -> name or null) and ``--prefix``, as one function."""
    mapping: dict[str, str | None] = {}
    if args.key_map:
        try:
            with open(args.key_map, encoding="utf-8") as handle:
                loaded = json.load(handle)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read the key map {args.key_map}: {exc}") from exc
        if not isinstance(loaded, dict) or not all(v is None or isinstance(v, str) for v in loaded.values()):
            raise UsageError(f"the key map {args.key_map} must be a JSON object of key -> name (or null)")
        mapping = loaded
    prefix: str | None = args.prefix
    if prefix is None:
        return mapping or None

    def name(key: str) -> str | None:
        if key in mapping:
            return mapping[key]
        return key[len(prefix) :] if key.startswith(prefix) and len(key) > len(prefix) else None

    return name


def cmd_export(args: argparse.Namespace) -> int:
    from reshard.interop.export import export_safetensors

    result = export_safetensors(
        args.checkpoint,
        args.out,
        key_map=key_map_of(args),
        dtype=cast_dtype_of(args),
        max_shard_bytes=args.max_shard_size,
        overwrite=args.overwrite,
        storage_options=storage_options_of(args),
        progress=progress_of(args),
    )
    say(
        args,
        f"wrote {args.out}: {len(result.weight_map)} tensors ({human_bytes(result.total_bytes)}) in "
        f"{len(result.files)} safetensors files and model.safetensors.index.json",
    )
    _say_kept(args, result.kept_scaled)
    if result.left_out:
        say(args, f"left out by the key map: {len(result.left_out)} tensors")
    if result.not_tensors:
        say(args, f"not exported (safetensors holds tensors only): {result.not_tensors} objects and common values")
    return 0


def cmd_import_dcp(args: argparse.Namespace) -> int:
    if not args.trust_pickle:
        raise UsageError(
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
            storage_options=storage_options_of(args),
            progress=progress_of(args),
        )
    for path, reason in result.left_out.items():
        sys.stderr.write(f"reshard import-dcp: left out {path!r}: {reason}\n")
    metadata = result.metadata
    say(
        args,
        f"wrote {args.dst}: {len(metadata.tensors)} tensors ({human_bytes(metadata.total_bytes)}), "
        f"{len(metadata.common)} common values; {len(result.left_out)} values left out",
    )
    return 0


def cmd_export_peft(args: argparse.Namespace) -> int:
    from reshard.models.peft import export_peft

    exported = export_peft(
        args.checkpoint, args.out, base_model=args.base_model, storage_options=storage_options_of(args)
    )
    print(f"wrote {len(exported)} adapter tensors to {args.out} (adapter_model.safetensors, adapter_config.json)")
    return EXIT_OK


def cmd_export_hf(args: argparse.Namespace) -> int:
    from reshard.models.hf_export import export_hf

    written = export_hf(
        args.checkpoint,
        args.out,
        max_shard_bytes=args.max_shard_size,
        storage_options=storage_options_of(args),
        quantize=args.quantize,
    )
    quantized = f", Linear weights quantized {args.quantize}" if args.quantize else ""
    print(f"wrote {args.out}: config.json and {len(written)} tensors under Hugging Face names{quantized}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from reshard.demo.run import main as demo_main

    return demo_main(args)


EXIT_OK, EXIT_DIFFERENT, EXIT_USAGE, EXIT_CHECKPOINT, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES_HELP = """Exit codes:
  0    success (diff: nothing differs beyond the tolerance; validate: no problem)
  1    diff found differences, or validate found problems
  2    wrong usage (bad option, unreadable key map, import-dcp without --trust-pickle)
  3    a checkpoint is missing, incomplete, corrupt, locked or refused, or storage failed
  130  interrupted"""
