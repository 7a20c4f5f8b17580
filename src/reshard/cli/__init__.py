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
import sys
from collections.abc import Callable, Sequence
from typing import Any

from reshard._version import __version__
from reshard.cli.commands import (
    EXIT_CHECKPOINT,
    EXIT_CODES_HELP,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    cmd_convert,
    cmd_demo,
    cmd_diff,
    cmd_export,
    cmd_export_hf,
    cmd_export_peft,
    cmd_gc,
    cmd_import_dcp,
    cmd_inspect,
    cmd_ls,
    cmd_validate,
)
from reshard.cli.text import SafeText, inspect_summary, printable
from reshard.errors import CheckpointError

__all__ = ["build_parser", "inspect_summary", "main", "printable"]


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
    diff.set_defaults(func=cmd_diff)


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
    convert.set_defaults(func=cmd_convert)


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
    export.set_defaults(func=cmd_export)


def _add_import_dcp_parser(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    imported = sub.add_parser(
        "import-dcp",
        parents=parents,
        help="convert a torch.distributed.checkpoint directory into a reshard checkpoint (needs --trust-pickle)",
        description="Convert the DCP checkpoint directory SRC into a reshard checkpoint at DST, tensor by "
        "tensor: each tensor is loaded whole by DCP in this process and streamed out, so memory holds one "
        "tensor at a time. Non-tensor values are read with torch.load(weights_only=True): plain data becomes "
        "common values (and tensors inside them tensors) at their dotted paths; anything else is left out "
        "with a message (an error with --strict). A Megatron-Core torch_dist checkpoint converts completely: its "
        "ShardedObject cells as reshard ShardedObjects and its common.pt (torch.load(weights_only=True)) as the "
        "ShardedObject megatron.common, which reshard.interop.megatron's direct route loads. DCP's .metadata is a "
        "PICKLE: loading it can execute code from the file, so --trust-pickle is required.",
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
    imported.set_defaults(func=cmd_import_dcp)


def _add_model_export_parsers(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """``export-peft`` and ``export-hf``: a reference-model checkpoint for PEFT and for transformers."""
    export_peft = sub.add_parser(
        "export-peft",
        parents=parents,
        help="write the demo model's LoRA adapters as a Hugging Face PEFT adapter",
        description="Read the LoRA adapters of a demo-model checkpoint (adapter-only or full, any saving layout) "
        "whole, and write OUT/adapter_model.safetensors (PEFT key names, fused QKV and GLU linears split per "
        "projection) and OUT/adapter_config.json. The naming is reshard.models.peft.peft_tensors; the Python "
        "API export_peft(..., name_map=) takes another. Expert adapters of a Mixtral or Qwen-MoE go to PEFT's "
        "target_parameters (the fused 3-D expert weights of transformers 5). Adapters PEFT would drop or misplace "
        "are refused, listing them: those of un-gated experts (a Llama with experts), which are no Hugging Face "
        "architecture, and those of a Qwen-MoE's dense MLP layers. The adapters of 'reshard demo --lora R' (its "
        "model is a Mixtral) are written; PEFT puts them on the base they were trained on: with --from-hf DIR, "
        "DIR (pass it as --base-model).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export_peft.add_argument("checkpoint", metavar="CKPT", help="the checkpoint (directory or URL)")
    export_peft.add_argument("out", metavar="OUT", help="the output directory (or URL); must not hold an adapter")
    export_peft.add_argument(
        "--base-model",
        metavar="NAME_OR_DIR",
        default=None,
        help="the base model, written as base_model_name_or_path (AutoPeftModelForCausalLM loads it from there)",
    )
    export_peft.set_defaults(func=cmd_export_peft)
    export_hf = sub.add_parser(
        "export-hf",
        parents=parents,
        help="write a demo-model checkpoint as a Hugging Face model directory (config.json + safetensors)",
        description="Read the model of a reference-model checkpoint (any saving layout) and write OUT/config.json "
        "(a LlamaForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM or Qwen3MoeForCausalLM that computes what "
        "the model computes) and its tensors under transformers' names (model.safetensors, or numbered shards and "
        "model.safetensors.index.json): fused QKV and GLU split back, no vocabulary padding, no optimizer, RNG or "
        "trainer state. Streamed in bounded memory, into a temporary directory renamed to OUT at the end: OUT "
        "appears complete or not at all. OUT must not exist. Refused: a Llama with un-gated "
        "experts (ModelConfig's defaults; the demo's model is a Mixtral, written as one), which are no Hugging "
        "Face architecture, a checkpoint with LoRA adapters (use export-peft), a checkpoint without the model's "
        "tensors.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    export_hf.add_argument("checkpoint", metavar="CKPT", help="the checkpoint (directory or URL)")
    export_hf.add_argument("out", metavar="OUT", help="the output directory, a local path that does not exist yet")
    export_hf.add_argument(
        "--max-shard-size",
        type=_size,
        default="5GB",
        metavar="SIZE",
        help="largest shard, e.g. 2GB, 500MB, 1GiB (default 5GB); one shard is written as model.safetensors",
    )
    export_hf.add_argument(
        "--quantize",
        choices=["fp8-block128", "ct-fp8-block128", "ct-fp8-channel", "ct-mxfp8", "ct-mxfp4", "ct-nvfp4"],
        default=None,
        metavar="SCHEME",
        help="quantize the Linear weights (attention, MLP, experts; not embeddings, norms, lm_head, routers) on the "
        "way, with the consumer's tensor names and config.json quantization_config: fp8-block128 (transformers "
        "FineGrainedFP8: E4M3, 128x128 blocks, weight_scale_inv; every such weight a multiple of 128 in both "
        "axes), or for compressed-tensors ct-fp8-block128 (FP8_BLOCK), ct-fp8-channel (FP8_DYNAMIC, per row), "
        "ct-mxfp8 (MXFP8), ct-mxfp4 (MXFP4), ct-nvfp4 (NVFP4A16: weight_packed, weight_scale, "
        "weight_global_scale). Weights must be float32, bfloat16 or float16: low-precision ones are refused, "
        "never requantized",
    )
    export_hf.set_defaults(func=cmd_export_hf)


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


def _parents() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser, argparse.ArgumentParser]:
    """The option groups several commands share: ``--storage-option``, ``--quiet`` and ``--dtype``."""
    storage = argparse.ArgumentParser(add_help=False)
    storage.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="an option for the object-store client (repeatable), e.g. endpoint_url=http://127.0.0.1:9000; "
        "credentials otherwise come from the client's usual environment and configuration files",
    )
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
    return storage, quiet, dtype


def _add_checkpoint_parsers(sub: Any, storage: argparse.ArgumentParser, quiet: argparse.ArgumentParser) -> None:
    """``inspect``, ``validate``, ``ls`` and ``gc``: the commands on one checkpoint or manager root."""
    inspect = sub.add_parser(
        "inspect",
        parents=[storage],
        help="show the tensors, dtypes, shapes, boxes and bytes of a checkpoint",
        description="Print, per tensor, its dtype, global shape, number of saved boxes, the grid of box offsets "
        "per axis and its bytes; then objects, common values, totals and the saving layout. Reads only "
        "metadata.json and, for a partitioned checkpoint (format version 6), its metadata parts, each verified.",
    )
    inspect.add_argument("path", help="checkpoint directory or URL (file://, s3://bucket/prefix, gs://bucket/prefix)")
    inspect.add_argument("--json", action="store_true", help="print the same facts as JSON")
    inspect.set_defaults(func=cmd_inspect)
    validate = sub.add_parser(
        "validate",
        parents=[storage, quiet],
        help="check a checkpoint: completeness, file sizes and every checksum",
        description="Check that PATH is a complete checkpoint (metadata.json present and valid), that every data "
        "file exists with its recorded size, and (unless --quick) every CRC-32C of every stored box and object, "
        "with a progress bar on a terminal. Prints each problem, the step's certification (certified, not "
        "certified: why, e.g. a damaged certified.json or one of another save; not checked), which does not change "
        "the exit code, and a summary line (neither with --quiet); exits 1 if there is any problem of the data.",
    )
    validate.add_argument("path", help="checkpoint directory or URL")
    validate.add_argument("--quick", action="store_true", help="check presence and sizes only, not checksums")
    validate.set_defaults(func=cmd_validate)
    ls = sub.add_parser(
        "ls",
        parents=[storage],
        help="list the step checkpoints of a CheckpointManager root",
        description="List the step directories of a manager root with their status (complete, incomplete: an "
        "interrupted or running save, corrupt), size, which one latest.json points at, and the certification of "
        "each complete step (certified; not certified: why, e.g. its checks failed; not checked).",
    )
    ls.add_argument("root", help="manager root directory or URL")
    ls.add_argument("--json", action="store_true", help="print the listing as JSON")
    ls.set_defaults(func=cmd_ls)
    gc = sub.add_parser(
        "gc",
        parents=[storage],
        help="remove data files that no commit references (failed or interrupted saves)",
        description="Remove the data files under PATH/data that metadata.json does not reference: leftovers of "
        "saves that failed, were interrupted, or lost a race. Only names a save writes are candidates; files "
        "younger than --min-age are kept, since a save may still be writing them, and gc says what it kept and why; a "
        "PATH or a data directory that is a symbolic link is refused. Loads ignore such files, so this only frees "
        "space.",
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
    gc.set_defaults(func=cmd_gc)


def _add_demo_parser(sub: Any, help_text: str) -> None:
    """``demo``, an application rather than a library command: its arguments are the demo's own
    (:func:`reshard.demo.run.build_parser`), so building them imports :mod:`reshard.demo`."""
    demo = sub.add_parser("demo", help=help_text)
    from reshard.demo.run import build_parser as build_demo_parser

    build_demo_parser(demo)
    demo.set_defaults(func=cmd_demo)


APPLICATIONS: dict[str, tuple[str, Callable[[Any, str], None]]] = {
    "demo": ("train a small GPT on CPU ranks, save, resume on another layout, train on", _add_demo_parser),
}
"""The commands that are applications of the library, by name: their one-line help, and what adds their parser
to the subcommands (importing :mod:`reshard.demo` or :mod:`reshard.models` to build their arguments). A library
command (``inspect``, ``ls``, ...) imports neither, so :func:`main` adds these only when the command line names
one; otherwise each is listed by its help alone."""


def _library_parser() -> tuple[argparse.ArgumentParser, Any]:
    """The parser of the library's commands, and its subcommands (to which the applications are added)."""
    parser = argparse.ArgumentParser(
        prog="reshard",
        description="Inspect and work with reshard checkpoints (topology-independent PyTorch checkpoints).",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"reshard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    storage, quiet, dtype = _parents()
    _add_checkpoint_parsers(sub, storage, quiet)
    _add_diff_parser(sub, [storage, quiet])
    _add_convert_parser(sub, [storage, quiet, dtype])
    _add_export_parser(sub, [storage, quiet, dtype])
    _add_import_dcp_parser(sub, [storage, quiet])
    _add_model_export_parsers(sub, [storage])
    return parser, sub


def build_parser() -> argparse.ArgumentParser:
    """The whole ``reshard`` command line: the library's commands and the applications' (:data:`APPLICATIONS`,
    whose arguments import :mod:`reshard.demo`)."""
    parser, sub = _library_parser()
    for help_text, add in APPLICATIONS.values():
        add(sub, help_text)
    return parser


def _parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """:func:`build_parser` where ``argv`` names an application command; else the library's commands with the
    applications only listed, so that ``reshard --help`` or ``reshard ls`` imports no application."""
    command = next((word for word in argv if not word.startswith("-")), None)
    if command in APPLICATIONS:
        return build_parser()
    parser, sub = _library_parser()
    for name, (help_text, _) in APPLICATIONS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # listed by --help; never parses (see above)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reshard`` command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser_for(argv).parse_args(argv)
    stdout = sys.stdout
    sys.stdout = SafeText(stdout)  # keys and paths from checkpoints are untrusted
    errors = SafeText(sys.stderr)
    try:
        code: int = args.func(args)
    except UsageError as exc:
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
