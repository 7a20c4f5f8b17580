"""Hugging Face naming of the reference GPT: load a Llama checkpoint (as transformers' ``save_pretrained``
writes it) straight into any layout of the model, and name the model's full tensors the Hugging Face way.

The demo model's modules map to Hugging Face's like this (``L`` a layer, ``e`` an expert)::

    embedding.word_embeddings.weight            model.embed_tokens.weight
    decoder.layers.L.input_norm.weight          model.layers.L.input_layernorm.weight
    decoder.layers.L.self_attention.qkv.weight  Concat(q_proj, k_proj, v_proj)   (model.layers.L.self_attn.*)
    decoder.layers.L.self_attention.qkv.bias    Concat(q_proj, k_proj, v_proj)   (biases, attention_bias)
    decoder.layers.L.self_attention.proj.weight model.layers.L.self_attn.o_proj.weight (and .bias)
    decoder.layers.L.self_attention.q_norm.weight model.layers.L.self_attn.q_norm.weight (and k_norm; Qwen3)
    decoder.layers.L.pre_mlp_norm.weight        model.layers.L.post_attention_layernorm.weight
    decoder.layers.L.mlp.fc1.weight             Concat(gate_proj, up_proj)       (model.layers.L.mlp.*)
    decoder.layers.L.mlp.fc1.bias               Concat(gate_proj, up_proj)       (biases, mlp_bias)
    decoder.layers.L.mlp.fc2.weight             model.layers.L.mlp.down_proj.weight (and .bias)
    decoder.layers.L.mlp.router.weight          model.layers.L.mlp.gate.weight   (Mixtral: block_sparse_moe.gate)
    decoder.layers.L.mlp.experts.gate.weight    Stack(model.layers.L.block_sparse_moe.experts.e.w1.weight, ...)
                                                (Mixtral, expert_glu; fc1 is then Stack(w3), fc2 Stack(w2))
    decoder.layers.L.mlp.experts.gate.weight    Stack(model.layers.L.mlp.experts.e.gate_proj.weight, ...) (Qwen-MoE)
    decoder.layers.L.mlp.shared_expert.fc1.weight Concat(gate_proj, up_proj) (model.layers.L.mlp.shared_expert.*)
    decoder.layers.L.mlp.shared_expert.fc2.weight model.layers.L.mlp.shared_expert.down_proj.weight
    decoder.layers.L.mlp.shared_expert_gate.weight model.layers.L.mlp.shared_expert_gate.weight (Qwen2-MoE)
    decoder.layers.L.mlp.experts.fc1.weight     Stack(model.layers.L.mlp.experts.e.up_proj.weight, e = 0..E-1)
    decoder.layers.L.mlp.experts.fc2.weight     Stack(model.layers.L.mlp.experts.e.down_proj.weight, ...)
    decoder.final_norm.weight                   model.norm.weight
    output_layer.weight                         lm_head.weight                   (absent when tied)

The fused QKV's global layout is ``[all Q heads; all K heads; all V heads]`` (grouped-query attention
regrouping happens in each rank's local layout), so it is exactly the concatenation of Hugging Face's
three projections. Hugging Face stores each head's rows in the order its rotary embedding pairs them (the
two halves of the head), and the model applies the rotation the same way, so no permutation is involved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from reshard.errors import MismatchError
from reshard.interop.hf_source import Concat, Source, Stack
from reshard.models.config import ModelConfig

if TYPE_CHECKING:
    from reshard.metadata import Metadata

__all__ = ["checkpoint_model_config", "common_tree", "hf_key_map", "split_for_hf", "to_hf_tensors"]


def hf_key_map(model: ModelConfig) -> dict[str, Source]:
    """The ``key_map`` for ``reshard.load(template, HuggingFaceSource(hf_dir, key_map))``: demo-model key ->
    Hugging Face source (see the module docstring)."""
    key_map: dict[str, Source] = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_norm.weight": "model.norm.weight",
    }
    if not model.tie_word_embeddings:
        key_map["output_layer.weight"] = "lm_head.weight"
    for layer in range(model.num_layers):
        ours, theirs = f"decoder.layers.{layer}", f"model.layers.{layer}"
        attn, mlp = f"{theirs}.self_attn", f"{theirs}.mlp"
        key_map[f"{ours}.input_norm.weight"] = f"{theirs}.input_layernorm.weight"
        key_map[f"{ours}.self_attention.qkv.weight"] = Concat(
            f"{attn}.q_proj.weight", f"{attn}.k_proj.weight", f"{attn}.v_proj.weight"
        )
        key_map[f"{ours}.self_attention.proj.weight"] = f"{attn}.o_proj.weight"
        if model.attention_bias or model.qkv_bias:
            key_map[f"{ours}.self_attention.qkv.bias"] = Concat(
                f"{attn}.q_proj.bias", f"{attn}.k_proj.bias", f"{attn}.v_proj.bias"
            )
        if model.attention_bias:
            key_map[f"{ours}.self_attention.proj.bias"] = f"{attn}.o_proj.bias"
        key_map[f"{ours}.pre_mlp_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        if model.qk_norm:
            key_map[f"{ours}.self_attention.q_norm.weight"] = f"{attn}.q_norm.weight"
            key_map[f"{ours}.self_attention.k_norm.weight"] = f"{attn}.k_norm.weight"
        if layer in model.moe_layers and model.architecture == "mixtral":  # Mixtral's naming
            moe = f"{theirs}.block_sparse_moe"
            experts = range(model.num_experts)
            key_map[f"{ours}.mlp.router.weight"] = f"{moe}.gate.weight"
            key_map[f"{ours}.mlp.experts.gate.weight"] = Stack(*(f"{moe}.experts.{e}.w1.weight" for e in experts))
            key_map[f"{ours}.mlp.experts.fc1.weight"] = Stack(*(f"{moe}.experts.{e}.w3.weight" for e in experts))
            key_map[f"{ours}.mlp.experts.fc2.weight"] = Stack(*(f"{moe}.experts.{e}.w2.weight" for e in experts))
        elif layer in model.moe_layers:
            key_map[f"{ours}.mlp.router.weight"] = f"{mlp}.gate.weight"
            experts = range(model.num_experts)
            if model.expert_glu:
                key_map[f"{ours}.mlp.experts.gate.weight"] = Stack(
                    *(f"{mlp}.experts.{e}.gate_proj.weight" for e in experts)
                )
            key_map[f"{ours}.mlp.experts.fc1.weight"] = Stack(*(f"{mlp}.experts.{e}.up_proj.weight" for e in experts))
            key_map[f"{ours}.mlp.experts.fc2.weight"] = Stack(*(f"{mlp}.experts.{e}.down_proj.weight" for e in experts))
            if model.shared_expert_ffn_hidden:
                shared = f"{mlp}.shared_expert"
                key_map[f"{ours}.mlp.shared_expert.fc1.weight"] = Concat(
                    f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"
                )
                key_map[f"{ours}.mlp.shared_expert.fc2.weight"] = f"{shared}.down_proj.weight"
                key_map[f"{ours}.mlp.shared_expert_gate.weight"] = f"{mlp}.shared_expert_gate.weight"
        else:
            key_map[f"{ours}.mlp.fc1.weight"] = Concat(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight")
            key_map[f"{ours}.mlp.fc2.weight"] = f"{mlp}.down_proj.weight"
            if model.mlp_bias:
                key_map[f"{ours}.mlp.fc1.bias"] = Concat(f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias")
                key_map[f"{ours}.mlp.fc2.bias"] = f"{mlp}.down_proj.bias"
    return key_map


def _fused_rows(key: str, model: ModelConfig) -> list[int]:
    """Rows of each part of the fused tensor ``key``: ``[Q; K; V]`` or ``[gate; up]``."""
    if ".self_attention.qkv." in key:
        kv_rows = model.num_query_groups * model.head_dim
        return [model.num_heads * model.head_dim, kv_rows, kv_rows]
    if ".mlp.shared_expert." in key:
        return [model.shared_expert_ffn_hidden, model.shared_expert_ffn_hidden]
    return [model.ffn_hidden, model.ffn_hidden]


def split_for_hf(key: str, tensor: torch.Tensor, model: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The full (logical) tensor of demo-model key ``key`` under its Hugging Face name(s): a fused tensor
    split into its parts by rows, a stacked one into its experts (views, not copies).

    Raises:
        KeyError: ``key`` is not in :func:`hf_key_map`.
    """
    source = hf_key_map(model)[key]
    if isinstance(source, str):
        return [(source, tensor)]
    if isinstance(source, Stack):
        return list(zip(source.sources, tensor.unbind(0), strict=True))
    parts = torch.split(tensor, _fused_rows(key, model), dim=source.axis)
    return list(zip(source.sources, parts, strict=True))


def to_hf_tensors(full: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The demo model's full (logical) tensors under Hugging Face names: the inverse of
    :func:`hf_key_map`, splitting fused and stacked tensors. Keys the map does not name (optimizer
    states) are left out."""
    names = hf_key_map(model)
    return {
        name: part.contiguous()
        for key, tensor in full.items()
        if key in names
        for name, part in split_for_hf(key, tensor, model)
    }


def common_tree(common: dict[str, Any], prefix: str) -> Any:
    """The common values below ``prefix`` (dotted paths) as the nested dicts and lists they were saved
    from (a dict whose keys are 0..n-1 was a list)."""
    tree: dict[str, Any] = {}
    for path, value in common.items():
        if not path.startswith(prefix + "."):
            continue
        *parents, leaf = path[len(prefix) + 1 :].split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    def listify(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: listify(v) for k, v in node.items()}
        if items and sorted(items) == sorted(str(i) for i in range(len(items))):
            return [items[str(i)] for i in range(len(items))]
        return items

    return listify(tree)


def checkpoint_model_config(metadata: Metadata, where: str) -> ModelConfig:
    """The :class:`ModelConfig` a demo-model checkpoint was trained with (its ``trainer.model_config``).

    Raises:
        MismatchError: the checkpoint (at ``where``, for the message) is not one of the demo model.
    """
    doc = common_tree(metadata.common, "trainer.model_config")
    if not isinstance(doc, dict) or not doc:
        raise MismatchError(f"{where} is not a checkpoint of the demo model (it has no trainer.model_config)")
    if "moe_layers" not in doc:  # written before empty lists were kept: the layers with experts hold them
        doc["moe_layers"] = sorted(
            {int(k.split(".")[2]) for k in metadata.tensors if k.startswith("decoder.layers.") and ".mlp.experts." in k}
        )
    return ModelConfig.from_dict(doc)
