"""The options of the reference GPT (:class:`ModelConfig`, :class:`LoraConfig`); their Hugging Face counterparts
are in :mod:`reshard.models.hf_config`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
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
    Hugging Face names and its exported ``config.json``: ``"llama"`` (also, with ``moe_layers``, a Llama with
    un-gated experts, this class's defaults, which has no Hugging Face counterpart), ``"mixtral"`` (gated
    experts in every layer: what ``reshard demo`` trains), ``"qwen2_moe"`` (gated experts, a shared expert, biases
    on Q, K, V) or ``"qwen3_moe"`` (gated experts, query/key norms, dense MLPs in the layers not in ``moe_layers``).

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
            if self.attention_bias or self.mlp_bias:  # MixtralConfig has neither option
                problems.append("no attention or MLP biases")
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
        """The model of a Hugging Face Llama, Mixtral, Qwen2-MoE or Qwen3-MoE config: a ``transformers`` config
        object, a ``config.json`` path or the directory holding it, or the parsed dict, read as transformers 5
        reads it (a field left out takes transformers' default for the ``model_type``; a field of other
        architectures is ignored, as transformers ignores it). ``overrides`` set the options Hugging Face does
        not describe (``seq_len``, ``seed``, ``vocab_pad_multiple``).

        Raises:
            MismatchError: the config describes something this model does not compute exactly, naming the
                fields: another architecture; attention other than causal over every earlier position (a
                ``sliding_window`` of Llama or Mixtral, ``use_sliding_window`` of Qwen3-MoE, a ``layer_types``
                entry other than ``full_attention``, Qwen2-MoE's included, ``attention_chunk_size``,
                ``is_causal=False``), whatever the window's size, since a longer sequence always meets it;
                a rope type other than default and llama3, partial rotary embeddings; attention dropout or
                Mixtral's router jitter (transformers applies both when it trains).
            ValueError: an activation other than silu and gelu.
        """
        from reshard.models.hf_config import hf_config_options

        return cls(**hf_config_options(config), **overrides)


GATE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": F.silu, "gelu": F.gelu}
"""The activations of the MLP's gate the model supports, by their Hugging Face names."""

ARCHITECTURES = ("llama", "mixtral", "qwen2_moe", "qwen3_moe")
"""The Hugging Face ``model_type`` values the reference model reproduces."""

LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
