"""Export the demo GPT's LoRA adapters from a reshard checkpoint to Hugging Face PEFT's format.

``reshard export-peft CKPT OUT`` (or :func:`export_peft`) writes ``OUT/adapter_model.safetensors`` and
``OUT/adapter_config.json``: full adapter tensors (unsharded, unpadded, whatever layout saved them) under
PEFT's key names, ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``.

The names come from a *name map*, a function ``(key, tensor, model, lora) -> [(name, tensor), ...]``: the
default, :func:`peft_tensors`, names the demo model's modules as :mod:`reshard.models.hf` does (like a
Hugging Face Llama, Mixtral or Qwen-MoE model) and splits its fused linears, which PEFT adapts one
projection at a time:

====================================================  ================================================
reshard key (``decoder.layers.L.`` ...)                PEFT module (``base_model.model.model.layers.L.``)
====================================================  ================================================
``self_attention.qkv`` (fused ``[Q; K; V]``)           ``self_attn.q_proj``, ``k_proj``, ``v_proj``
``self_attention.proj``                               ``self_attn.o_proj``
``mlp.fc1`` (fused GLU ``[gate; up]``)                 ``mlp.gate_proj``, ``mlp.up_proj``
``mlp.fc2``                                           ``mlp.down_proj``
``mlp.experts.fc1`` / ``fc2`` (stacked ``[E, ...]``)   ``mlp.experts`` parameters ``gate_up_proj`` /
                                                      ``down_proj`` (Mixtral, Qwen-MoE)
====================================================  ================================================

A fused linear ``W = [W_1; W_2; ...]`` with adapter ``B A`` becomes one adapter per part with the same
``A`` and the matching rows of ``B``: ``W_i + B_i A`` is exactly the fused update, row block by row block.
Expert adapters go to the 3-D expert parameters of transformers 5 (PEFT's ``target_parameters``), one
adapter for all experts of a layer, as PEFT lays it out (see :func:`_expert_adapter`).
Pass another function as ``name_map`` for another model's naming.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from reshard.errors import CheckpointError, MismatchError
from reshard.flows.load import load, read_metadata
from reshard.interop.hf_source import Concat
from reshard.interop.safetensors import SafetensorsWriter, TensorSpec
from reshard.models.config import LoraConfig, ModelConfig, is_adapter_key
from reshard.models.hf import checkpoint_model_config, common_tree, hf_key_map, split_for_hf
from reshard.storage import CheckpointLocation, storage_for

__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_FILE", "NameMap", "export_peft", "peft_tensors"]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"

NameMap = Callable[[str, torch.Tensor, ModelConfig, LoraConfig], list[tuple[str, torch.Tensor]]]
"""(reshard adapter key, its full tensor, the model's sizes, the adapters' options) -> PEFT (name, tensor)
pairs."""

HF_EXPERT_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""The architectures whose experts transformers holds as fused 3-D parameters that PEFT adapts
(``target_parameters``): ``mlp.experts.gate_up_proj [E, 2 * ffn, h]`` and ``mlp.experts.down_proj [E, h, ffn]``."""


def peft_tensors(
    key: str, tensor: torch.Tensor, model: ModelConfig, lora: LoraConfig
) -> list[tuple[str, torch.Tensor]]:
    """The default name map (see the module docstring): PEFT names and tensors for one adapter tensor of
    the reference GPT, from the Hugging Face naming of :mod:`reshard.models.hf`.

    Raises:
        MismatchError: ``key`` is no adapter of the model, or an expert adapter of a model whose experts are
            no Hugging Face architecture (PEFT would have nothing to put it on).
    """
    factor = "lora_A" if ".lora_A." in key else "lora_B"
    base = key.replace(f".{factor}.weight", ".weight")
    source = hf_key_map(model).get(base)
    if not is_adapter_key(key) or not key.endswith(f".{factor}.weight") or source is None:
        raise MismatchError(f"{key!r} is not an adapter key of the demo model")
    if ".mlp.experts." in key:
        return [_expert_adapter(key, base, factor, tensor, model, lora)]
    if isinstance(source, Concat) and factor == "lora_A":  # one shared A for every part of a fused linear
        parts = [(name, tensor) for name in source.sources]
    else:  # B's rows follow the base's parts
        parts = split_for_hf(base, tensor, model)
    return [(f"base_model.model.{name.removesuffix('.weight')}.{factor}.weight", t.contiguous()) for name, t in parts]


def _expert_adapter(
    key: str, base: str, factor: str, tensor: torch.Tensor, model: ModelConfig, lora: LoraConfig
) -> tuple[str, torch.Tensor]:
    """One stacked expert adapter (``[E, r, in]`` for A, ``[E, out, r]`` for B) as the adapter PEFT puts on
    the fused 3-D expert parameter: A ``[E * r, in]`` (expert-major rows), B ``[out, r * E]`` (column
    ``k * E + e`` is expert ``e``'s column ``k``). The model adapts the experts' up projection (``fc1``),
    not their gate: its update on ``gate_up_proj`` has zero gate rows, which is exactly the same model.
    PEFT nests the wrappers of one module, ``gate_up_proj`` inside (``experts.base_layer``) when both
    parameters are adapted."""
    if model.architecture not in HF_EXPERT_ARCHITECTURES:
        raise MismatchError(
            f"{key!r} adapts un-gated experts (architecture={model.architecture!r} with experts, ModelConfig's "
            "defaults), which are no Hugging Face architecture: PEFT would have no module to put it on"
        )
    layer = base.split(".")[2]
    up = base.endswith(".experts.fc1.weight")
    experts = tensor.shape[0]
    if factor == "lora_A":
        peft_tensor = tensor.reshape(experts * tensor.shape[1], tensor.shape[2])
    else:
        peft_tensor = tensor.permute(1, 2, 0).reshape(tensor.shape[1], tensor.shape[2] * experts)
        if up:
            peft_tensor = torch.cat((torch.zeros_like(peft_tensor), peft_tensor), dim=0)
    nested = up and "experts.fc2" in lora.targets
    module = f"base_model.model.model.layers.{layer}.mlp.experts{'.base_layer' if nested else ''}"
    return f"{module}.{factor}.weight", peft_tensor.contiguous()


def _refuse_misplaced(keys: list[str], model: ModelConfig) -> None:
    """Raise MismatchError for adapters the default naming would give PEFT to drop or misplace without a word:
    those of un-gated experts, and those of a Qwen-MoE's dense MLPs."""
    untargeted = [k for k in keys if ".mlp.experts." in k]
    if untargeted and model.architecture not in HF_EXPERT_ARCHITECTURES:
        raise MismatchError(
            f"{len(untargeted)} adapters of the checkpoint have no PEFT target: they adapt un-gated experts "
            f"(architecture={model.architecture!r} with experts), which are no Hugging Face architecture, and PEFT "
            f"would drop them when loading ({', '.join(untargeted[:6])}{' ...' if len(untargeted) > 6 else ''}); "
            "train LoRA without the expert targets, or on a Mixtral (the demo's model) or a Qwen-MoE, to export it"
        )
    dense_mlp = [k for k in keys if ".mlp.fc" in k]
    if dense_mlp and model.architecture in ("qwen2_moe", "qwen3_moe"):
        raise MismatchError(
            f"{len(dense_mlp)} adapters of the checkpoint adapt the dense MLPs of a Qwen-MoE "
            f"({', '.join(dense_mlp[:4])}{' ...' if len(dense_mlp) > 4 else ''}): PEFT reads the targets gate_proj, "
            "up_proj and down_proj of a Qwen-MoE model as the experts' projections, so it would put them on the "
            "experts; train LoRA without the targets fc1 and fc2 to export it"
        )


def _adapter_config(
    lora: LoraConfig, modules: list[str], parameters: list[str], base_model: str | None
) -> dict[str, Any]:
    """``adapter_config.json``: a PEFT LoRA on ``modules`` (and the 3-D expert ``parameters``)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": modules,
        **({"target_parameters": parameters} if parameters else {}),
        "modules_to_save": None,
        "inference_mode": True,
        "use_rslora": False,
    }


def export_peft(
    checkpoint: CheckpointLocation,
    out: CheckpointLocation,
    *,
    name_map: NameMap = peft_tensors,
    base_model: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Write the LoRA adapters of a demo-model checkpoint (adapter-only or full) as a PEFT adapter.

    Runs in one process (no process group): each adapter tensor is read whole, from any saving layout.
    ``base_model`` (a hub name or a directory) goes into ``adapter_config.json`` as
    ``base_model_name_or_path``, which ``AutoPeftModelForCausalLM.from_pretrained`` loads the base from.
    Returns the exported names and shapes.

    Raises:
        MismatchError: the checkpoint holds no LoRA adapters, or (with the default name map) adapters of
            un-gated experts (a Llama with experts, ModelConfig's defaults), which are no Hugging Face
            architecture (PEFT would drop them without a word), or
            adapters of a Qwen-MoE's dense MLP layers (PEFT would put them on the experts), or the name map
            rejects a key.
        CheckpointError: ``out`` already holds an adapter (the export never overwrites).
    """
    metadata = read_metadata(checkpoint, storage_options=storage_options)
    lora_doc = common_tree(metadata.common, "trainer.lora")
    keys = sorted(k for k in metadata.tensors if is_adapter_key(k) and not k.startswith("optimizer."))
    if not keys or not isinstance(lora_doc, dict) or not lora_doc:
        raise MismatchError(f"the checkpoint at {checkpoint} holds no LoRA adapters of the demo model")
    lora = LoraConfig.from_dict(lora_doc)
    model = checkpoint_model_config(metadata, str(checkpoint))
    if name_map is peft_tensors:
        _refuse_misplaced(keys, model)
    template = {k: torch.empty(metadata.tensors[k].global_shape, dtype=metadata.tensors[k].torch_dtype) for k in keys}
    full = load(template, checkpoint, storage_options=storage_options)
    tensors = [pair for key in keys for pair in name_map(key, full[key], model, lora)]
    modules = sorted({name.split(".")[-3] for name, _ in tensors if ".mlp.experts." not in name})
    parameters = [
        f"mlp.experts.{name}"
        for target, name in (("experts.fc1", "gate_up_proj"), ("experts.fc2", "down_proj"))
        if target in lora.targets and any(".mlp.experts." in k for k in keys)
    ]
    config = _adapter_config(lora, modules, parameters, base_model)
    storage = storage_for(out, storage_options)
    try:
        if storage.exists(ADAPTER_FILE) or storage.exists(ADAPTER_CONFIG_FILE):
            raise CheckpointError(f"{storage.describe()} already holds a PEFT adapter; choose an empty directory")
        specs = [TensorSpec(name=name, dtype=t.dtype, shape=tuple(t.shape)) for name, t in tensors]
        sink = storage.open_writer(ADAPTER_FILE)
        writer = SafetensorsWriter(sink, specs, {"format": "pt"})
        try:
            for _, tensor in tensors:
                writer.write(tensor)
                writer.end_tensor()
            writer.close()
        except BaseException:
            writer.abort()
            raise
        storage.commit(ADAPTER_CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode(), replace=False)
    finally:
        storage.close()
    return {name: tuple(t.shape) for name, t in tensors}
