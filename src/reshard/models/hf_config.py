"""The Hugging Face configs of the reference GPT: :func:`hf_config_options` reads a transformers config (what
:meth:`ModelConfig.from_hf` builds), :func:`hf_config_of` writes one (the ``config.json`` of ``export-hf``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from reshard.models.config import ARCHITECTURES, LLAMA3_ROPE_KEYS, ModelConfig

__all__ = ["hf_config_of", "hf_config_options"]


def hf_config_options(config: Any) -> dict[str, Any]:
    """The :class:`ModelConfig` options of a Hugging Face Llama config (see :meth:`ModelConfig.from_hf`)."""
    doc = _hf_config_dict(config)
    model_type = doc.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"model_type={model_type!r} is not supported by the reference model (it reproduces {list(ARCHITECTURES)})"
        )
    if float(doc.get("router_jitter_noise") or 0.0) != 0.0:
        raise ValueError("router_jitter_noise other than 0 is not supported by the reference model")
    if doc.get("use_sliding_window") and doc.get("sliding_window") is not None:
        raise ValueError(
            "use_sliding_window=True is not supported by the reference model (it attends to every position)"
        )
    heads = int(doc["num_attention_heads"])
    hidden = int(doc["hidden_size"])
    head_dim = doc.get("head_dim") or hidden // heads
    rope = dict(doc.get("rope_parameters") or {})
    legacy_scaling = doc.get("rope_scaling")
    if legacy_scaling:  # transformers 4.x configs: rope_theta beside rope_scaling
        rope = {**dict(legacy_scaling), **rope}
        rope.setdefault("rope_type", rope.pop("type", None))
    theta = float(rope.get("rope_theta", doc.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", "default") or "default"
    if float(rope.get("partial_rotary_factor", doc.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported by the reference model")
    if float(doc.get("attention_dropout") or 0.0) != 0.0:
        raise ValueError("attention_dropout other than 0 is not supported by the reference model")
    scaling = None
    if rope_type == "llama3":
        scaling = {"rope_type": "llama3", **{k: rope[k] for k in LLAMA3_ROPE_KEYS if k in rope}}
    elif rope_type != "default":
        raise ValueError(
            f"rope_type={rope_type!r} is not supported by the reference model (it has 'default' and 'llama3')"
        )
    kv_heads = doc.get("num_key_value_heads") or heads
    layers = int(doc["num_hidden_layers"])
    moe: dict[str, Any] = {"moe_layers": ()}
    if model_type == "mixtral":
        moe = {
            "moe_layers": tuple(range(layers)),
            "num_experts": int(doc["num_local_experts"]),
            "moe_topk": int(doc["num_experts_per_tok"]),
            "expert_ffn_hidden": int(doc["intermediate_size"]),
            "expert_glu": True,
        }
    elif model_type in ("qwen2_moe", "qwen3_moe"):
        experts = int(doc.get("num_experts") or doc.get("num_local_experts") or 0)
        dense = {int(layer) for layer in doc.get("mlp_only_layers") or ()}
        step = int(doc.get("decoder_sparse_step", 1))
        moe = {
            "moe_layers": tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0),
            "num_experts": experts or 1,
            "moe_topk": int(doc["num_experts_per_tok"]),
            "expert_ffn_hidden": int(doc["moe_intermediate_size"]),
            "expert_glu": True,
            "moe_norm_topk": bool(doc.get("norm_topk_prob", False)),
            "qk_norm": model_type == "qwen3_moe",
        }
        if model_type == "qwen2_moe":
            shared = int(doc.get("shared_expert_intermediate_size") or 0)
            if shared < 1:
                raise ValueError(
                    "shared_expert_intermediate_size must be positive (Qwen2-MoE always has a shared expert)"
                )
            moe["shared_expert_ffn_hidden"] = shared
            moe["qkv_bias"] = bool(doc.get("qkv_bias", True))
    return {
        "vocab_size": int(doc["vocab_size"]),
        "hidden": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_query_groups": int(kv_heads),
        "head_dim": int(head_dim),
        "ffn_hidden": int(doc["intermediate_size"]),
        **moe,
        "rms_norm_eps": float(doc.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": bool(doc.get("attention_bias", False)) and model_type != "qwen2_moe",
        "mlp_bias": bool(doc.get("mlp_bias", False)),
        "hidden_act": str(doc.get("hidden_act", "silu")),
        "tie_word_embeddings": bool(doc.get("tie_word_embeddings", False)),
        "max_position_embeddings": int(doc.get("max_position_embeddings", 2048)),
        "architecture": model_type,
    }


def _hf_config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        doc = json.loads(path.read_text())
        if not isinstance(doc, dict):
            raise TypeError(f"{path}: not a JSON object")
        return doc
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise TypeError(f"expected a transformers config, a config.json path or a dict, got {type(config).__name__}")
    doc = to_dict()
    if not isinstance(doc, dict):
        raise TypeError("config.to_dict() did not return a dict")
    return doc


def hf_config_of(model: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model (``LlamaForCausalLM``, ``MixtralForCausalLM``,
    ``Qwen2MoeForCausalLM`` or ``Qwen3MoeForCausalLM``, by ``model.architecture``) that computes what ``model``
    computes: the inverse of :meth:`ModelConfig.from_hf`.

    Raises:
        ValueError: ``model`` is a Llama with experts (the demo's own), which is not a Hugging Face
            architecture.
    """
    arch = model.architecture
    if arch == "llama" and model.moe_layers:
        raise ValueError(
            f"the model has experts in layers {list(model.moe_layers)} but architecture='llama': only Mixtral's "
            "and Qwen-MoE's experts are a Hugging Face architecture, so this model has no Hugging Face config"
        )
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling is not None:
        rope = {**model.rope_scaling, "rope_theta": model.rope_theta}
    intermediate = model.ffn_hidden
    experts: dict[str, Any] = {}
    if arch == "mixtral":
        intermediate = model.expert_ffn_hidden
        experts = {
            "num_local_experts": model.num_experts,
            "num_experts_per_tok": model.moe_topk,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
        }
    elif arch in ("qwen2_moe", "qwen3_moe"):
        experts = {
            **(
                {"shared_expert_intermediate_size": model.shared_expert_ffn_hidden, "qkv_bias": model.qkv_bias}
                if arch == "qwen2_moe"
                else {}
            ),
            "num_experts": model.num_experts,
            "num_experts_per_tok": model.moe_topk,
            "moe_intermediate_size": model.expert_ffn_hidden,
            "norm_topk_prob": model.moe_norm_topk,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(model.num_layers) if i not in model.moe_layers],
            "use_sliding_window": False,
            "sliding_window": None,
            "output_router_logits": False,
        }
    names = {
        "llama": "LlamaForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "qwen2_moe": "Qwen2MoeForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM",
    }
    return {
        "architectures": [names[arch]],
        "model_type": arch,
        **experts,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "hidden_act": model.hidden_act,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.rms_norm_eps,
        "rope_parameters": rope,
        **({} if arch == "qwen2_moe" else {"attention_bias": model.attention_bias}),
        **({} if arch in ("qwen2_moe", "qwen3_moe") else {"mlp_bias": model.mlp_bias}),
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_word_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
    }
