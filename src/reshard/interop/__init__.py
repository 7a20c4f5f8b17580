"""Interoperability and offline tools: Hugging Face safetensors out, torch.distributed.checkpoint in,
and whole-checkpoint copy, cast and comparison, all in one process and in bounded memory.

- :class:`HuggingFaceSource`: a Hugging Face safetensors directory as a source of :func:`reshard.load`, with
  a key map (:class:`Concat`, :class:`Stack` for fused and stacked tensors).
- :func:`export_safetensors`: a checkpoint's tensors as Hugging Face sharded safetensors.
- :func:`import_dcp`: a ``torch.distributed.checkpoint`` directory as a reshard checkpoint.
- :func:`convert_checkpoint`: copy (local <-> object storage) and cast a checkpoint.
- :func:`diff_checkpoints`: per-tensor differences between two checkpoints.
- :mod:`reshard.interop.safetensors`: the safetensors format itself (strict header parser, streaming writer).
- :mod:`reshard.interop.offline`: single-process, tensor-by-tensor reading and writing of checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reshard.flows.progress import Progress
from reshard.interop.convert import convert_checkpoint
from reshard.interop.diff import DiffReport, EntryDiff, TensorDiff, diff_checkpoints
from reshard.interop.export import ExportResult, KeyMap, export_safetensors
from reshard.interop.hf_source import Concat, HuggingFaceSource, SourceMap, Stack
from reshard.interop.offline import CheckpointReader, CheckpointWriter

if TYPE_CHECKING:
    from reshard.interop.dcp import ImportResult, import_dcp

__all__ = [
    "CheckpointReader",
    "CheckpointWriter",
    "Concat",
    "DiffReport",
    "EntryDiff",
    "ExportResult",
    "HuggingFaceSource",
    "ImportResult",
    "KeyMap",
    "Progress",
    "SourceMap",
    "Stack",
    "TensorDiff",
    "convert_checkpoint",
    "diff_checkpoints",
    "export_safetensors",
    "import_dcp",
]


def __getattr__(name: str) -> Any:
    """``import_dcp`` and ``ImportResult`` import torch.distributed.checkpoint, so only when asked for."""
    if name in ("import_dcp", "ImportResult"):
        from reshard.interop import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
