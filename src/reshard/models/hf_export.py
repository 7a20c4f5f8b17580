"""``reshard export-hf``: a demo-model checkpoint as a Hugging Face model directory that transformers loads.

The output directory holds ``config.json`` (the ``LlamaForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``
or ``Qwen3MoeForCausalLM`` that computes what the model computes,
:func:`reshard.models.hf_config.hf_config_of`) and the model's tensors under transformers' names
(:mod:`reshard.models.hf`): ``model.safetensors`` when they fit one shard, else numbered shards and
``model.safetensors.index.json``. Fused tensors are split back (QKV into ``q_proj``/``k_proj``/``v_proj``,
the GLU into ``gate_proj``/``up_proj``), the vocabulary padding is not there (checkpoints hold the logical
shapes), and nothing else of the checkpoint is written (no optimizer state, RNG or trainer state).

Memory stays bounded: every output tensor is a row range of a checkpoint tensor, streamed in slabs through
one buffer. The export is atomic: everything is written into a temporary directory beside ``OUT`` and
renamed to ``OUT`` at the end, so an interrupted export leaves no directory transformers would load.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from reshard.errors import CheckpointExistsError, MismatchError, StorageError
from reshard.interop.export import DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, plan_shards, shard_file_names
from reshard.interop.hf_source import Stack
from reshard.interop.offline import DEFAULT_SLAB_BYTES, CheckpointReader
from reshard.interop.safetensors import SafetensorsWriter, TensorSpec
from reshard.models.config import ModelConfig, is_adapter_key
from reshard.models.hf import checkpoint_model_config, hf_key_map, split_for_hf
from reshard.models.hf_config import hf_config_of
from reshard.models.hf_quant import (
    QUANT_SCHEMES,
    ExportPart,
    QuantScheme,
    check_source_format,
    is_quantized_weight,
    quantization_config,
    quantized_parts,
    write_quantized,
)
from reshard.models.hf_scaled import PartPlace, passthrough_parts, refuse_unquantized, write_cast
from reshard.storage import CheckpointLocation, LocalStorage

__all__ = ["CONFIG_FILE", "SINGLE_FILE", "export_hf"]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"


def _parts(reader: CheckpointReader, model: ModelConfig, scheme: QuantScheme | None) -> list[ExportPart]:
    """Every output tensor of the model, as a row range of its checkpoint tensor (with ``scheme``, the
    quantized weights as their data, scale and global-scale tensors)."""
    key_map = hf_key_map(model)
    missing = sorted(k for k in key_map if k not in reader.metadata.tensors)
    if missing:
        raise MismatchError(
            f"{reader.describe()} lacks {len(missing)} tensors of the model: {', '.join(missing[:10])}"
            f"{' ...' if len(missing) > 10 else ''} (an adapter-only checkpoint? export it with export-peft)"
        )
    model_dtype = reader.tensor("embedding.word_embeddings.weight").torch_dtype
    parts = []
    for key, source in key_map.items():
        saved = reader.tensor(key)
        record = reader.metadata.scaled.get(key)
        # split_for_hf names the parts and gives their shapes; the data is streamed below, not held here.
        meta = torch.empty(saved.global_shape, dtype=saved.torch_dtype, device="meta")
        start = row = 0
        for index, (name, piece) in enumerate(split_for_hf(key, meta, model)):
            spec = TensorSpec(name=name, dtype=saved.torch_dtype, shape=tuple(piece.shape))
            quantized = scheme is not None and is_quantized_weight(name)
            if record is not None:
                if scheme is None or not quantized:
                    raise refuse_unquantized(name, record, scheme)
                check_source_format(key, (record.format, record.block), saved.torch_dtype, scheme)
                place = PartPlace(index if isinstance(source, Stack) else None, row, piece.shape[0])
                parts += passthrough_parts(reader, spec, start, record, scheme, place, model_dtype)
            elif scheme is not None and quantized and check_source_format(key, None, saved.torch_dtype, scheme):
                parts += quantized_parts(spec, key, start, scheme)
            else:
                parts.append(ExportPart(spec, key, start))
            start += math.prod(piece.shape)
            row += 0 if isinstance(source, Stack) else piece.shape[0]  # a Concat splits rows (axis 0)
    return sorted(parts, key=lambda p: p.spec.name)


def _kept_modules(parts: list[ExportPart]) -> list[str]:
    """The modules of the 2-D weights left in high precision (``lm_head`` always), embeddings aside."""
    kept = {"lm_head"}
    for part in parts:
        name = part.spec.name
        if part.role == "plain" and len(part.spec.shape) == 2 and not name.endswith("embed_tokens.weight"):
            kept.add(name.removesuffix(".weight"))
    return sorted(kept)


def _exportable_model(reader: CheckpointReader) -> ModelConfig:
    """The model of the checkpoint, which export-hf can write.

    Raises:
        MismatchError: not a demo-model checkpoint, no Hugging Face architecture, or LoRA adapters in it.
    """
    model = checkpoint_model_config(reader.metadata, reader.describe())
    try:
        hf_config_of(model)  # a Llama with un-gated experts has none
    except ValueError as exc:
        raise MismatchError(str(exc)) from None
    adapters = sorted(k for k in reader.metadata.tensors if is_adapter_key(k) and not k.startswith("optimizer."))
    if adapters:
        raise MismatchError(
            f"{reader.describe()} holds {len(adapters)} LoRA adapter tensors ({adapters[0]}, ...): export them "
            "with export-peft; export-hf writes the base model only and does not merge adapters"
        )
    return model


def export_hf(
    checkpoint: CheckpointLocation,
    out: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    storage_options: dict[str, Any] | None = None,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
    quantize: str | None = None,
) -> dict[str, tuple[int, ...]]:
    """Write the model of a demo-model checkpoint (saved on any layout) as a Hugging Face model directory
    ``out`` (see the module doc). Not collective. Returns the written names and shapes.

    Args:
        checkpoint: the reshard checkpoint (directory, URL or Storage).
        out: a local directory that must not exist yet; it appears complete or not at all.
        max_shard_bytes: shard size limit (a larger tensor gets a shard of its own).
        storage_options: for an object-store ``checkpoint``.
        slab_bytes: the largest piece of a tensor held in memory at once (a quantized weight: at least one
            row of its blocks).
        quantize: a scheme of :data:`reshard.models.hf_quant.QUANT_SCHEMES` (``fp8-block128`` for
            transformers' FineGrainedFP8; ``ct-fp8-block128``, ``ct-fp8-channel``, ``ct-mxfp8``, ``ct-mxfp4``,
            ``ct-nvfp4`` for compressed-tensors): the Linear weights quantized on the way, with the consumer's
            tensor names and ``quantization_config`` (see :mod:`reshard.models.hf_quant`).

    Raises:
        CheckpointExistsError: ``out`` exists.
        ValueError: an unknown ``quantize`` scheme.
        MismatchError: not a checkpoint of the reference model, a weight the ``quantize`` scheme cannot hold
            or that is already low precision (not requantized), a Llama with un-gated experts (not a
            Hugging Face architecture), a checkpoint without the model's tensors, or LoRA adapters in it
            (export those with export-peft; merging is not done here).
        StorageError: writing failed (nothing is left at ``out``).
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if quantize is not None and quantize not in QUANT_SCHEMES:
        raise ValueError(f"unknown quantization scheme {quantize!r}; the schemes are {', '.join(QUANT_SCHEMES)}")
    scheme = None if quantize is None else QUANT_SCHEMES[quantize]
    target = Path(out)
    if target.exists() or target.is_symlink():
        raise CheckpointExistsError(f"{target} already exists; export-hf writes a new directory")
    with CheckpointReader(checkpoint, storage_options=storage_options) as reader:
        model = _exportable_model(reader)
        parts = _parts(reader, model, scheme)
        config = hf_config_of(model, reader.tensor("embedding.word_embeddings.weight").torch_dtype)
        if scheme is not None:
            config["quantization_config"] = quantization_config(scheme, _kept_modules(parts))
        shards = plan_shards([p.spec.nbytes for p in parts], max_shard_bytes)
        names = [SINGLE_FILE] if len(shards) == 1 else shard_file_names(len(shards))
        target.parent.mkdir(parents=True, exist_ok=True)
        temp = target.parent / f".{target.name}.export-hf-{uuid.uuid4().hex}"
        temp.mkdir()
        try:
            storage = LocalStorage(temp)
            weight_map: dict[str, str] = {}
            global_scales: dict[tuple[str, int], torch.Tensor] = {}  # NVFP4: one amax pass per weight
            for shard, name in zip(shards, names, strict=True):
                _write_shard(reader, storage, [parts[i] for i in shard], name, slab_bytes, scheme, global_scales)
                weight_map.update({parts[i].spec.name: name for i in shard})
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(p.spec.nbytes for p in parts)}, "weight_map": weight_map}
                storage.commit(INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode(), replace=False)
            storage.commit(CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode(), replace=False)
            storage.sync_dir("")
            os.rename(temp, target)  # atomic: OUT appears complete, or not at all
            with contextlib.suppress(OSError):
                fd = os.open(target.parent, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except BaseException as exc:
            shutil.rmtree(temp, ignore_errors=True)
            if isinstance(exc, OSError) and not isinstance(exc, StorageError):
                raise StorageError(f"writing the export into {target} failed: {exc}") from exc
            raise
    return {p.spec.name: p.spec.shape for p in parts}


def _write_shard(
    reader: CheckpointReader,
    storage: LocalStorage,
    parts: list[ExportPart],
    name: str,
    slab_bytes: int,
    scheme: QuantScheme | None,
    global_scales: dict[tuple[str, int], torch.Tensor] | None = None,
) -> None:
    """One safetensors file of ``parts``, each streamed in slabs of at most ``slab_bytes`` (quantized ones
    by :func:`write_quantized`, sharing ``global_scales``)."""
    # Larger elements first: every tensor then starts aligned to its element size.
    ordered = sorted(parts, key=lambda p: (-p.spec.dtype.itemsize, p.spec.name))
    sink = storage.open_writer(name)
    try:
        writer = SafetensorsWriter(sink, [p.spec for p in ordered], {"format": "pt"})
        for part in ordered:
            if part.role in ("data", "scale", "global"):
                assert scheme is not None
                write_quantized(reader, writer, part, scheme, slab_bytes, global_scales=global_scales)
                writer.end_tensor()
                continue
            if part.role == "cast":  # saved scales in the consumer's dtype, exactly
                write_cast(reader, writer, part, slab_bytes)
                writer.end_tensor()
                continue
            itemsize = part.spec.dtype.itemsize
            per_slab = max(1, slab_bytes // itemsize)
            total = math.prod(part.spec.shape)
            for offset in range(0, total, per_slab):
                count = min(per_slab, total - offset)
                slab = reader.slab_buffer(count * itemsize).view(part.spec.dtype)[:count]
                reader.read_flat(part.key, part.start + offset, slab)
                writer.write(slab)
            writer.end_tensor()
        writer.close()
    except BaseException:
        sink.abort()
        raise
