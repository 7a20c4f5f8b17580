"""``ModelConfig.from_hf`` against transformers 5's own reading of a config: every field that changes what
transformers computes is either computed exactly by the reference model or refused, naming the field; a field
transformers ignores changes nothing; a ``config.json`` that leaves a field out gets transformers' default.

"What transformers computes" is the forward in eval mode, one step of decoding with its cache, and the forward
in training mode (the reference model trains): a field refused here is shown to change one of the three, a field
accepted as a no-op to change none. Tiny random models are built here (no hub access).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import reshard
from reshard.models.config import ModelConfig
from reshard.models.hf_config import HF_DEFAULT_THETA, HF_DEFAULTS
from tests.hf_models import BASE, MOE_OPTIONS, TOKENS, hf_classes, rank_hf_logits, save_hf_model
from tests.rankpool import RankPool

pytestmark = pytest.mark.dist


def _model(architecture: str, options: dict[str, Any]) -> Any:
    """The tiny random model of ``architecture`` with ``options``, in eval mode, its weights fixed by the seed
    (the options below change no shape, so every variant of an architecture has the same weights)."""
    config_class, model_class = hf_classes(architecture)
    config = config_class(**{**BASE, **MOE_OPTIONS[architecture], **options})
    torch.manual_seed(0)
    return model_class(config).eval()


def _function(model: Any) -> dict[str, torch.Tensor]:
    """What the model computes: eval logits, one decoding step after TOKENS through the cache, and the training
    forward (with a fixed seed for its noise)."""
    with torch.no_grad():
        prompt = model(TOKENS, use_cache=True)
        step = model(TOKENS[:, :1], past_key_values=prompt.past_key_values, use_cache=True).logits
        model.train()
        torch.manual_seed(1)
        train = model(TOKENS, use_cache=False).logits
        model.eval()
    return {"eval": prompt.logits, "decode": step, "train": train}


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [name for name in a if a[name].shape != b[name].shape or (a[name] - b[name]).abs().max() > 1e-4]


def _json_doc(model: Any) -> dict[str, Any]:
    """The config as save_pretrained writes it into config.json."""
    doc: dict[str, Any] = json.loads(model.config.to_json_string())
    return doc


REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    # The reported defect: transformers' Mixtral masks attention to a window; the reference model attends to all.
    "mixtral_sliding_window": ("mixtral", {"sliding_window": 4}, "sliding_window=4"),
    "qwen3_use_sliding_window": ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 4}, "use_sliding_window"),
    "qwen2_sliding_layers": ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 4}, "layers 0, 2"),
    "qwen2_one_sliding_layer": (
        "qwen2_moe",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        r"layer_types .*sliding_attention.* layers 0\b",
    ),
    # Llama's forward ignores a window, but its cache keeps only that many positions when decoding.
    "llama_sliding_window": ("llama", {"sliding_window": 4}, "sliding_window=4"),
    "llama_layer_types": (
        "llama",
        {"sliding_window": 4, "layer_types": ["sliding_attention"] * 4},
        "layer_types",
    ),
    "llama_attention_chunk_size": ("llama", {"attention_chunk_size": 4}, "attention_chunk_size=4"),
    "mixtral_is_causal": ("mixtral", {"is_causal": False}, "is_causal=False"),
    "llama_is_causal": ("llama", {"is_causal": False}, "is_causal=False"),
    "mixtral_router_jitter_noise": ("mixtral", {"router_jitter_noise": 0.5}, "router_jitter_noise"),
    "qwen3_attention_dropout": ("qwen3_moe", {"attention_dropout": 0.5}, "attention_dropout"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_from_hf_refuses_every_field_that_changes_what_transformers_computes(case: str) -> None:
    """Each field below changes transformers' function (shown first), and from_hf refuses it, from the config
    object and from its config.json, with a MismatchError naming it."""
    architecture, options, message = REFUSED[case]
    base, changed = _model(architecture, {}), _model(architecture, options)
    assert _differs(_function(base), _function(changed)), f"{case}: transformers computes the same"
    for source in (changed.config, _json_doc(changed)):
        with pytest.raises(reshard.MismatchError, match=message):
            ModelConfig.from_hf(source)
    ModelConfig.from_hf(base.config)  # the same model without the field is accepted


NO_OPS: dict[str, tuple[str, dict[str, Any]]] = {
    # Qwen2-MoE's window applies only to the layers below max_window_layers (and only with use_sliding_window).
    "qwen2_window_on_no_layer": (
        "qwen2_moe",
        {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0},
    ),
    "qwen2_window_unused": ("qwen2_moe", {"use_sliding_window": False, "sliding_window": 4}),
    "qwen3_window_unused": ("qwen3_moe", {"use_sliding_window": False, "sliding_window": 4}),
    # Fields of other architectures, which transformers' model of this one never reads.
    "mixtral_biases": ("mixtral", {"attention_bias": True, "mlp_bias": True, "norm_topk_prob": False}),
    "qwen3_mlp_bias": ("qwen3_moe", {"mlp_bias": True, "router_jitter_noise": 0.5}),
    "qwen2_biases": ("qwen2_moe", {"attention_bias": True, "mlp_bias": True, "router_jitter_noise": 0.5}),
    "llama_moe_fields": ("llama", {"num_experts": 3, "mlp_only_layers": [0], "use_sliding_window": True}),
    # The router's auxiliary loss is a term of the training loss, not of the logits; pad_token_id fixes which
    # embedding row nn.Embedding initialises to zero (the weights are loaded); pretraining_tp is unused.
    "mixtral_router_loss": ("mixtral", {"output_router_logits": True, "router_aux_loss_coef": 0.5}),
    "llama_unused": ("llama", {"pretraining_tp": 2, "pad_token_id": 0, "layer_types": ["full_attention"] * 4}),
}


@pytest.mark.parametrize("case", list(NO_OPS))
def test_from_hf_accepts_what_transformers_ignores_and_reads_the_same_model(case: str) -> None:
    """Transformers computes the same with and without each field (shown first), and from_hf reads the same model
    with and without it, whose logits equal transformers' (test_hf_models' variants)."""
    architecture, options = NO_OPS[case]
    base, changed = _model(architecture, {}), _model(architecture, options)
    assert not _differs(_function(base), _function(changed)), f"{case}: transformers computes something else"
    expected = ModelConfig.from_hf(base.config)
    assert ModelConfig.from_hf(changed.config) == expected, case
    assert ModelConfig.from_hf(_json_doc(changed)) == expected, case


EXACT: dict[str, tuple[str, dict[str, Any], str]] = {
    # head_dim left out: hidden_size / num_attention_heads (4), not BASE's 8.
    "llama_default_head_dim": ("llama", {"head_dim": None}, "tp=2"),
    "mixtral_default_head_dim": ("mixtral", {"head_dim": None}, "dp=2,ep=2"),
    "qwen3_sparse_step": ("qwen3_moe", {"decoder_sparse_step": 2, "norm_topk_prob": True}, "tp=2,etp=2"),
    "qwen2_no_qkv_bias": ("qwen2_moe", {"qkv_bias": False, "mlp_only_layers": [], "decoder_sparse_step": 2}, "tp=2"),
}


@pytest.mark.parametrize("case", list(EXACT))
def test_fields_the_model_computes_give_transformers_logits(pool4: RankPool, tmp_path: Path, case: str) -> None:
    """Fields that change the function and that the reference model computes: the same logits as transformers,
    on one rank and on a parallel layout."""
    architecture, options, layout = EXACT[case]
    model = save_hf_model(tmp_path, {"architecture": architecture, **MOE_OPTIONS[architecture], **options})
    with torch.no_grad():
        expected = model(TOKENS).logits
    for run_on in ("tp=1", layout):
        results = [r for r in pool4.run_ok(rank_hf_logits, run_on, str(tmp_path)) if r is not None]
        logits = [r["logits"] for r in results if r["logits"] is not None]
        assert logits, run_on
        for got in logits:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f"{case} on {run_on}")


SPARSE_DOCS: dict[str, dict[str, Any]] = {
    # Only sizes: every other field takes its architecture's default in transformers (Mixtral's rms_norm_eps is
    # 1e-5 and its rope_theta 1e6; Qwen3-MoE's experts are num_local_experts, 128 by default ...).
    "llama": {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 8, "intermediate_size": 64},
    "mixtral": {"model_type": "mixtral", "hidden_size": 32, "num_attention_heads": 8, "intermediate_size": 64},
    "qwen2_moe": {"model_type": "qwen2_moe", "hidden_size": 32, "num_attention_heads": 8, "num_key_value_heads": 4},
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 32, "num_attention_heads": 8},
    # transformers 4 configs: rope_theta beside the rope fields; a llama3 scaling without its original length
    # takes max_position_embeddings; rope_scaling wins over rope_parameters.
    "legacy_theta": {**BASE, "model_type": "llama", "rope_theta": 500000.0},
    "legacy_llama3": {
        **BASE,
        "model_type": "llama",
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    },
    "rope_scaling_first": {
        **BASE,
        "model_type": "llama",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 2.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "qwen3_window_default": {**BASE, "model_type": "qwen3_moe", "use_sliding_window": False},
    # Expert counts under either name, as each architecture's config reads them.
    "mixtral_both_names": {**BASE, "model_type": "mixtral", "num_experts": 4, "num_local_experts": 6},
    "qwen3_both_names": {**BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_local_experts": 6},
    "qwen2_local_experts": {**BASE, "model_type": "qwen2_moe", "num_local_experts": 6, "mlp_only_layers": None},
}


@pytest.mark.parametrize("case", list(SPARSE_DOCS))
def test_a_config_json_is_read_as_transformers_reads_it(tmp_path: Path, case: str) -> None:
    """from_hf of a config.json equals from_hf of the config transformers' AutoConfig builds from the same file:
    fields it leaves out take transformers' defaults of that architecture, not the reference model's."""
    (tmp_path / "config.json").write_text(json.dumps(SPARSE_DOCS[case]))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    assert ModelConfig.from_hf(tmp_path) == ModelConfig.from_hf(theirs), case


def test_the_default_tables_are_transformers_defaults() -> None:
    """HF_DEFAULTS and HF_DEFAULT_THETA, which fill the fields a config.json leaves out, are the defaults of
    transformers' config classes."""
    for architecture, defaults in HF_DEFAULTS.items():
        config_class, _ = hf_classes(architecture)
        theirs = {f.name: f.default for f in dataclasses.fields(config_class)}
        for name, value in defaults.items():
            assert name in theirs and theirs[name] == value, (architecture, name, value, theirs.get(name))
        assert HF_DEFAULT_THETA[architecture] == config_class.default_theta, architecture


def test_from_hf_refuses_nested_rope_parameters_and_a_zero_sparse_step() -> None:
    doc = {**BASE, "model_type": "llama", "rope_parameters": {"full_attention": {"rope_type": "default"}}}
    with pytest.raises(reshard.MismatchError, match="rope_parameters"):
        ModelConfig.from_hf(doc)
    with pytest.raises(reshard.MismatchError, match="decoder_sparse_step=0"):
        ModelConfig.from_hf({**BASE, **MOE_OPTIONS["qwen3_moe"], "model_type": "qwen3_moe", "decoder_sparse_step": 0})
    with pytest.raises(ValueError, match="architecture='mixtral' needs no attention or MLP biases"):
        ModelConfig(architecture="mixtral", moe_layers=(0, 1, 2, 3), expert_glu=True, attention_bias=True)
