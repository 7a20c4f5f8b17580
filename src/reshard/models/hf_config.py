"""The Hugging Face configs of the reference GPT: :func:`hf_config_options` reads a transformers config (what
:meth:`ModelConfig.from_hf` builds), :func:`hf_config_of` writes one (the ``config.json`` of ``export-hf``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from reshard.errors import MismatchError
from reshard.models.config import ARCHITECTURES, LLAMA3_ROPE_KEYS, ModelConfig

__all__ = ["HF_DEFAULTS", "HF_DEFAULT_THETA", "hf_config_of", "hf_config_options"]


HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    },
    "mixtral": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": None,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "num_experts_per_tok": 2,
        "num_local_experts": 8,
        "router_jitter_noise": 0.0,
    },
    "qwen2_moe": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "layer_types": None,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4,
        "num_experts": 60,
        "norm_topk_prob": False,
        "mlp_only_layers": None,
        "qkv_bias": True,
    },
    "qwen3_moe": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": 4096,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 768,
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "norm_topk_prob": False,
        "mlp_only_layers": None,
    },
}
"""transformers 5's defaults (its config classes' field defaults) of the fields :func:`hf_config_options` reads,
per ``model_type``: what transformers builds from a ``config.json`` that leaves a field out."""

HF_DEFAULT_THETA = {"llama": 10000.0, "mixtral": 1000000.0, "qwen2_moe": 10000.0, "qwen3_moe": 10000.0}
"""transformers' ``default_theta`` per ``model_type``: the rotary base of a config without ``rope_theta``."""

_EVERY_POSITION = (
    "the reference model attends to every earlier position, and a window changes the result of any sequence "
    "longer than it, which a config cannot rule out"
)


def hf_config_options(config: Any) -> dict[str, Any]:
    """The :class:`ModelConfig` options of a Hugging Face config (see :meth:`ModelConfig.from_hf`), read as
    transformers 5 reads it: a field the config leaves out takes transformers' default of its ``model_type``
    (:data:`HF_DEFAULTS`), and a field only other architectures have is ignored, as transformers ignores it.

    Raises:
        MismatchError: the config describes something the reference model does not compute, naming the fields.
    """
    raw = _hf_config_dict(config)
    arch = raw.get("model_type")
    if arch not in ARCHITECTURES:
        raise MismatchError(
            f"model_type={arch!r} is not supported by the reference model (it reproduces {list(ARCHITECTURES)})"
        )
    doc = {**HF_DEFAULTS[arch], **raw}
    problems = _attention_problems(doc, arch)
    if float(doc.get("attention_dropout") or 0.0) != 0.0:
        problems.append(
            f"attention_dropout={doc['attention_dropout']}: transformers drops attention weights when it trains, "
            "the reference model never (attention_dropout other than 0 is not supported)"
        )
    if arch == "mixtral" and float(doc.get("router_jitter_noise") or 0.0) != 0.0:
        problems.append(
            f"router_jitter_noise={doc['router_jitter_noise']}: transformers' Mixtral scales the router's input by "
            "noise when it trains, the reference model never (router_jitter_noise other than 0 is not supported)"
        )
    theta, scaling = _rope_options(doc, arch, problems)
    if problems:
        raise MismatchError(
            f"the {arch} config describes what the reference model does not compute: " + "; ".join(problems)
        )
    heads = int(doc["num_attention_heads"])
    hidden = int(doc["hidden_size"])
    layers = int(doc["num_hidden_layers"])
    return {
        "vocab_size": int(doc["vocab_size"]),
        "hidden": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_query_groups": int(doc.get("num_key_value_heads") or heads),
        "head_dim": int(doc.get("head_dim") or hidden // heads),
        "ffn_hidden": int(doc["intermediate_size"]),
        **_moe_options(doc, raw, arch, layers),
        "rms_norm_eps": float(doc["rms_norm_eps"]),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_bias": arch in ("llama", "qwen3_moe") and bool(doc["attention_bias"]),
        "mlp_bias": arch == "llama" and bool(doc["mlp_bias"]),
        "hidden_act": str(doc["hidden_act"]),
        "tie_word_embeddings": bool(doc["tie_word_embeddings"]),
        "max_position_embeddings": int(doc["max_position_embeddings"]),
        "architecture": arch,
    }


def _attention_problems(doc: dict[str, Any], arch: str) -> list[str]:
    """The fields that make transformers' attention other than causal attention to every earlier position,
    in its forward or in its cache when it decodes: sliding windows (per architecture, and per layer through
    ``layer_types``), chunked attention, ``is_causal=False``."""
    problems = []
    if not doc.get("is_causal", True):
        problems.append(
            f"is_causal={doc['is_causal']!r}: transformers then attends both ways, the reference model causally"
        )
    if doc.get("attention_chunk_size") is not None:
        problems.append(
            f"attention_chunk_size={doc['attention_chunk_size']}: transformers' cache keeps only a chunk when it "
            f"decodes; {_EVERY_POSITION}"
        )
    layer_types: list[Any] = list(doc.get("layer_types") or ())
    origin = ""
    if arch == "qwen2_moe" and doc.get("layer_types") is None:  # Qwen2MoeConfig's own layer types
        window_layers = int(doc["max_window_layers"])
        use = bool(doc["use_sliding_window"])
        layer_types = [
            "sliding_attention" if (i + 1) % 2 and i < window_layers and use else "full_attention"
            for i in range(int(doc["num_hidden_layers"]))
        ]
        origin = f" (from use_sliding_window={use}, max_window_layers={window_layers})"
    other = [i for i, kind in enumerate(layer_types) if kind != "full_attention"]
    if other:
        kinds = sorted({str(layer_types[i]) for i in other})
        problems.append(
            f"layer_types has {kinds} at layers {', '.join(map(str, other))}{origin}: transformers attends within "
            f"a window there; {_EVERY_POSITION}"
        )
    window = doc.get("sliding_window")
    if arch == "qwen3_moe" and doc["use_sliding_window"] and window is not None:
        problems.append(
            f"use_sliding_window=True with sliding_window={window}: transformers' Qwen3-MoE attends within a "
            f"window of {window} positions in every layer; {_EVERY_POSITION}"
        )
    elif arch in ("llama", "mixtral") and window is not None:
        where = (
            "a mask in its forward and a window on its cache"
            if arch == "mixtral"
            else "Llama's forward ignores it, but its cache keeps only that many positions when it decodes"
        )
        problems.append(f"sliding_window={window}: transformers attends within a window ({where}); {_EVERY_POSITION}")
    return problems


def _rope_options(doc: dict[str, Any], arch: str, problems: list[str]) -> tuple[float, dict[str, Any] | None]:
    """``rope_theta`` and ``rope_scaling`` as transformers standardises them: a legacy ``rope_scaling`` replaces
    ``rope_parameters``, ``rope_theta`` beside them fills theirs, a llama3 scaling without its original length
    takes ``original_max_position_embeddings`` or ``max_position_embeddings``. Appends what it refuses."""
    rope = dict(doc.get("rope_scaling") or doc.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in rope.values()):
        problems.append(
            f"rope_parameters per layer type ({sorted(rope)}): the reference model has one rotary embedding"
        )
        return HF_DEFAULT_THETA[arch], None
    rope.setdefault("rope_theta", doc.get("rope_theta", HF_DEFAULT_THETA[arch]))
    if doc.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", doc["partial_rotary_factor"])
    rope_type = rope.setdefault("rope_type", rope.get("type", "default"))
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        problems.append("partial_rotary_factor other than 1.0 is not supported by the reference model")
    if rope_type == "default":
        return float(rope["rope_theta"]), None
    if rope_type != "llama3":
        problems.append(
            f"rope_type={rope_type!r} is not supported by the reference model (it has 'default' and 'llama3')"
        )
        return float(rope["rope_theta"]), None
    if doc.get("original_max_position_embeddings") is not None:
        rope["original_max_position_embeddings"] = doc["original_max_position_embeddings"]
    rope.setdefault("original_max_position_embeddings", doc["max_position_embeddings"])
    return float(rope["rope_theta"]), {"rope_type": "llama3", **{k: rope[k] for k in LLAMA3_ROPE_KEYS if k in rope}}


def _moe_options(doc: dict[str, Any], raw: dict[str, Any], arch: str, layers: int) -> dict[str, Any]:
    """The experts of a Mixtral (every layer) or a Qwen-MoE (the layers ``mlp_only_layers`` and
    ``decoder_sparse_step`` leave them); the expert count under the name each architecture's config reads."""
    if arch == "llama":
        return {"moe_layers": ()}
    if arch == "mixtral":  # MixtralConfig maps num_experts onto num_local_experts: the former wins
        experts = raw["num_experts"] if raw.get("num_experts") is not None else doc["num_local_experts"]
        return {
            "moe_layers": tuple(range(layers)),
            "num_experts": int(experts),
            "moe_topk": int(doc["num_experts_per_tok"]),
            "expert_ffn_hidden": int(doc["intermediate_size"]),
            "expert_glu": True,
        }
    experts = doc["num_experts"]
    if arch == "qwen3_moe" and raw.get("num_local_experts") is not None:  # Qwen3MoeConfig's own name wins
        experts = raw["num_local_experts"]
    step = int(doc["decoder_sparse_step"])
    if step < 1:
        raise MismatchError(
            f"decoder_sparse_step={step}: the layers with experts are those whose number + 1 it divides"
        )
    dense = {int(layer) for layer in doc["mlp_only_layers"] or ()}
    moe: dict[str, Any] = {
        "moe_layers": tuple(i for i in range(layers) if int(experts) > 0 and i not in dense and (i + 1) % step == 0),
        "num_experts": int(experts) or 1,
        "moe_topk": int(doc["num_experts_per_tok"]),
        "expert_ffn_hidden": int(doc["moe_intermediate_size"]),
        "expert_glu": True,
        "moe_norm_topk": bool(doc["norm_topk_prob"]),
        "qk_norm": arch == "qwen3_moe",
    }
    if arch == "qwen2_moe":
        shared = int(doc["shared_expert_intermediate_size"] or 0)
        if shared < 1:
            raise MismatchError(
                "shared_expert_intermediate_size must be positive (Qwen2-MoE always has a shared expert)"
            )
        moe["shared_expert_ffn_hidden"] = shared
        moe["qkv_bias"] = bool(doc["qkv_bias"])
    return moe


def _hf_config_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, dict):
        return dict(config)
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
        ValueError: ``model`` is a Llama with (un-gated) experts, ModelConfig's defaults, which is not a Hugging Face
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
        **({"attention_bias": model.attention_bias} if arch in ("llama", "qwen3_moe") else {}),
        **({"mlp_bias": model.mlp_bias} if arch == "llama" else {}),
        "attention_dropout": 0.0,
        "tie_word_embeddings": model.tie_word_embeddings,
        "dtype": str(dtype).removeprefix("torch."),
    }
