"""Tiny random transformers models for the tests that hold the reference model against transformers
(tests/models/test_hf_models.py, tests/models/test_hf_config.py, tests/demo/test_demo_exports.py), and the rank
function that runs the reference model built from one of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

import reshard
from reshard.demo.training import Trainer, TrainingConfig
from reshard.models.config import ModelConfig
from tests.demo_groups import layout_groups
from tests.rankpool import RankContext

TOKENS = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(11))

BASE: dict[str, Any] = {
    "vocab_size": 61,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,  # not hidden_size / num_attention_heads (4)
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}

MOE_OPTIONS: dict[str, dict[str, Any]] = {
    "llama": {},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
}
"""The experts of a tiny model of each architecture."""


def hf_classes(architecture: str) -> tuple[Any, Any]:
    """transformers' config class and causal-LM class of ``architecture`` (a ``model_type``)."""
    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }[architecture]


def save_hf_model(directory: Path, options: dict[str, Any], seed: int = 0) -> Any:
    """A random tiny LlamaForCausalLM (or MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM by
    ``architecture``) of BASE's sizes with ``options``, saved with save_pretrained into ``directory``; returns
    the model."""
    options = dict(options)
    config_class, model_class = hf_classes(options.pop("architecture", "llama"))
    config = config_class(**{**BASE, **options})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # transformers zero-initialises biases: make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return model


def rank_hf_logits(ctx: RankContext, layout: str, hf_dir: str) -> dict[str, Any] | None:
    """Build the reference model on ``layout`` from ``hf_dir``'s config.json, load its safetensors straight
    into it, and return the last stage's logits for TOKENS and the load's bytes."""
    groups = layout_groups(layout)
    if groups is None:
        return None
    trainer = Trainer(ModelConfig.from_hf(hf_dir, seq_len=TOKENS.shape[1]), TrainingConfig(), groups)
    stats = reshard.LoadStats()
    trainer.load_hf(hf_dir, stats=stats)
    logits = trainer.logits(TOKENS)
    return {"logits": logits, "read": stats.bytes_read, "needed": stats.bytes_needed}
