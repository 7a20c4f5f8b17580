"""The options of the reference GPT (:class:`ModelConfig`, :class:`LoraConfig`) and their Hugging Face
counterparts: :func:`hf_config_options` reads a transformers config, :func:`hf_config_of` writes one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from reshard.models.parallel import ParallelConfig

__all__ = [
    "EMBEDDING_KEY",
    "GATE_ACTIVATIONS",
    "LORA_TARGETS",
    "LORA_TARGET_OF_SUFFIX",
    "OUTPUT_WEIGHT_KEY",
    "LoraConfig",
    "ModelConfig",
    "hf_config_of",
    "hf_config_options",
    "is_adapter_key",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Sizes and options of the reference GPT, a Llama-family decoder: RMSNorm (``rms_norm_eps``), rotary
    position embeddings (``rope_theta``; ``rope_scaling`` None or the ``llama3`` scaling of Llama 3.1),
    grouped-query attention (``num_query_groups`` key/value heads of ``head_dim``) with optional per-head
    RMSNorms of the queries and keys before the rotation (``qk_norm``, Qwen3), optional biases on the
    attention projections (``attention_bias``) and on the MLP (``mlp_bias``), a gated MLP (``hidden_act`` of
    the gate: ``silu`` for SwiGLU, or ``gelu``), and an output layer that is its own tensor or the word
    embedding (``tie_word_embeddings``, on any number of pipeline stages).
    ``moe_layers`` are the global layer numbers that use experts.
    ``max_position_embeddings`` only travels with the model (to the ``config.json`` of an export). The experts
    are un-gated MLPs (``fc2(gelu(fc1 x))``), or with ``expert_glu`` gated ones as in Mixtral and Qwen-MoE
    (``fc2(act(gate x) * fc1 x)``, ``act`` the ``hidden_act``), routed by a softmax over the experts and the
    top ``moe_topk``, renormalised when ``moe_norm_topk`` (Mixtral always; Qwen-MoE's ``norm_topk_prob``).
    ``qkv_bias`` puts biases on Q, K and V only, and ``shared_expert_ffn_hidden`` adds a shared expert (a gated
    MLP every token goes through, scaled by a sigmoid gate), both as in Qwen2-MoE.

    ``architecture`` is the Hugging Face ``model_type`` the model reproduces, which fixes its tensors'
    Hugging Face names and its exported ``config.json``: ``"llama"`` (also the demo's own model with un-gated
    experts, which has no Hugging Face counterpart), ``"mixtral"`` (gated experts in every layer) or
    ``"qwen3_moe"`` (gated experts, query/key norms, dense MLPs in the layers not in ``moe_layers``).

    :meth:`from_hf` builds one from a Hugging Face config; :meth:`check` says which layouts can run it.
    """

    vocab_size: int = 61
    hidden: int = 32
    num_layers: int = 4
    num_heads: int = 8
    num_query_groups: int = 4
    head_dim: int = 4
    ffn_hidden: int = 64
    moe_layers: tuple[int, ...] = (1, 3)
    num_experts: int = 4
    moe_topk: int = 2
    expert_ffn_hidden: int = 32
    seq_len: int = 16
    vocab_pad_multiple: int = 8
    seed: int = 1234
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    expert_glu: bool = False
    qk_norm: bool = False
    moe_norm_topk: bool = True
    qkv_bias: bool = False
    shared_expert_ffn_hidden: int = 0
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is not one of {list(ARCHITECTURES)}")
        problems = []
        if self.architecture == "mixtral":
            if tuple(self.moe_layers) != tuple(range(self.num_layers)) or not self.expert_glu:
                problems.append("gated experts (expert_glu) in every layer")
            if self.qk_norm or not self.moe_norm_topk:
                problems.append("no query/key norms and renormalised top-k weights")
        elif self.architecture == "qwen3_moe":
            if not self.expert_glu or not self.qk_norm:
                problems.append("gated experts (expert_glu) and query/key norms (qk_norm)")
            if self.mlp_bias:
                problems.append("no MLP biases")
        elif self.architecture == "qwen2_moe":
            if not self.expert_glu or self.qk_norm or self.mlp_bias or self.attention_bias:
                problems.append("gated experts (expert_glu), no query/key norms and biases on Q, K, V only (qkv_bias)")
        elif self.qk_norm:
            problems.append("no query/key norms (those are Qwen3's)")
        if self.architecture != "qwen2_moe" and (self.qkv_bias or self.shared_expert_ffn_hidden):
            problems.append("no shared experts and no biases on Q, K, V alone (those are Qwen2-MoE's)")
        if self.qkv_bias and self.attention_bias:
            problems.append("either attention_bias (Q, K, V and the output projection) or qkv_bias, not both")
        if problems:
            raise ValueError(f"architecture={self.architecture!r} needs " + " and ".join(problems))
        if self.hidden_act not in GATE_ACTIVATIONS:
            supported = sorted(GATE_ACTIVATIONS)
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported: the model has {supported}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type != "llama3":
                raise ValueError(
                    f"rope_scaling with rope_type={rope_type!r} is not supported: the model has the default "
                    "rotary embedding and the 'llama3' scaling"
                )
            missing = sorted(set(LLAMA3_ROPE_KEYS) - set(self.rope_scaling))
            if missing:
                raise ValueError(f"rope_scaling of type 'llama3' needs {missing}")

    def padded_vocab(self, tp: int) -> int:
        multiple = tp * self.vocab_pad_multiple
        return -(-self.vocab_size // multiple) * multiple

    def check(self, parallel: ParallelConfig) -> None:
        """Raise ValueError when ``parallel`` cannot run this model."""
        chunks = parallel.pp * parallel.vpp
        problems = []
        if self.num_layers % chunks:
            problems.append(f"num_layers={self.num_layers} is not divisible by pp*vpp={chunks}")
        if self.num_query_groups % parallel.tp:
            problems.append(f"num_query_groups={self.num_query_groups} is not divisible by tp={parallel.tp}")
        if self.num_heads % self.num_query_groups:
            problems.append("num_heads must be a multiple of num_query_groups")
        if self.ffn_hidden % parallel.tp:
            problems.append(f"ffn_hidden={self.ffn_hidden} is not divisible by tp={parallel.tp}")
        if self.moe_layers and self.num_experts % parallel.ep:
            problems.append(f"num_experts={self.num_experts} is not divisible by ep={parallel.ep}")
        if self.moe_layers and self.shared_expert_ffn_hidden % parallel.tp:
            problems.append(
                f"shared_expert_ffn_hidden={self.shared_expert_ffn_hidden} is not divisible by tp={parallel.tp}"
            )
        if self.moe_layers and self.expert_ffn_hidden % parallel.etp:
            problems.append(f"expert_ffn_hidden={self.expert_ffn_hidden} is not divisible by etp={parallel.etp}")
        if problems:
            raise ValueError(f"layout {parallel.describe()} cannot run this model: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["moe_layers"] = list(self.moe_layers)
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ModelConfig:
        """The inverse of :meth:`to_dict`; options a document lacks take their defaults (documents written
        before they existed), and an option this model does not know is an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(doc) - known)
        if unknown:
            raise ValueError(f"unknown model options {unknown}")
        values = dict(doc)
        if "moe_layers" in values:
            values["moe_layers"] = tuple(values["moe_layers"])
        return cls(**values)

    @classmethod
    def from_hf(cls, config: Any, **overrides: Any) -> ModelConfig:
        """The model of a Hugging Face Llama config: a ``transformers`` config object, a ``config.json`` path
        or the directory holding it, or the parsed dict. ``overrides`` set the options Hugging Face does not
        describe (``seq_len``, ``seed``, ``vocab_pad_multiple``).

        Raises:
            ValueError: the config describes something this model does not compute exactly (another
                architecture, a rope type other than default and llama3, partial rotary embeddings, an
                activation other than silu and gelu, attention dropout), naming the option.
        """
        return cls(**hf_config_options(config), **overrides)


GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu}
"""The activations of the MLP's gate the model supports, by their Hugging Face names."""

ARCHITECTURES = ("llama", "mixtral", "qwen2_moe", "qwen3_moe")
"""The Hugging Face ``model_type`` values the reference model reproduces."""

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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


EMBEDDING_KEY = "embedding.word_embeddings.weight"
OUTPUT_WEIGHT_KEY = "output_layer.weight"

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2", "experts.fc1", "experts.fc2")
"""The linears LoRA can adapt: attention QKV and output projection, the dense MLP's fc1 and fc2, and the
experts' fc1 and fc2."""

LORA_TARGET_OF_SUFFIX = {
    "self_attention.qkv.weight": "qkv",
    "self_attention.proj.weight": "proj",
    "mlp.fc1.weight": "fc1",
    "mlp.fc2.weight": "fc2",
    "mlp.experts.fc1.weight": "experts.fc1",
    "mlp.experts.fc2.weight": "experts.fc2",
}


def is_adapter_key(key: str) -> bool:
    """Whether ``key`` (a parameter key, or a path or optimizer key that contains one) is a LoRA adapter."""
    return ".lora_A." in key or ".lora_B." in key or key.endswith((".lora_A", ".lora_B"))


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters on the linears named in ``targets`` (see :data:`LORA_TARGETS`).

    ``init_b="zeros"`` is the usual start (the adapted model equals the base); ``"random"`` gives
    ``B`` random values too, so that every adapter tensor is distinct from the start (tests).
    """

    rank: int = 4
    alpha: float = 8.0
    targets: tuple[str, ...] = LORA_TARGETS
    init_b: str = "zeros"

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be a non-empty subset of {list(LORA_TARGETS)}, got {unknown}")
        if self.init_b not in ("zeros", "random"):
            raise ValueError(f"init_b must be 'zeros' or 'random', got {self.init_b!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "init_b": self.init_b}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> LoraConfig:
        return cls(**{**doc, "targets": tuple(doc["targets"])})


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
