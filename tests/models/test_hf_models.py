"""The reference model against the real transformers: a Llama checkpoint written by ``save_pretrained`` loads
straight into any layout of the model (``HuggingFaceSource`` with the model's key map), and the model's logits
equal transformers' own forward on the same tokens, with normal positions (rotary embeddings included).

Tiny random models are built here (no hub access); transformers runs in the test process, the reshard model
in the ranks of a pool, which never import transformers.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

import reshard
from reshard import cli
from reshard.demo.training import Trainer, TrainingConfig
from reshard.models.config import LoraConfig, ModelConfig
from reshard.models.parallel import ParallelConfig
from reshard.models.peft import export_peft
from tests.demo_groups import layout_groups
from tests.hf_models import TOKENS, rank_hf_logits
from tests.hf_models import save_hf_model as _save_llama
from tests.rankpool import RankContext, RankPool

LLAMAS: dict[str, dict[str, Any]] = {
    "untied": {},
    "biases": {"attention_bias": True, "mlp_bias": True},
    "llama3_rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        }
    },
    "gelu_theta": {"hidden_act": "gelu", "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}},
    "tied": {"tie_word_embeddings": True},
    "mixtral": {"architecture": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {  # un-normalised top-k weights, a dense layer among the MoE ones, biases on the attention
        "architecture": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": False,
        "mlp_only_layers": [1],
        "attention_bias": True,
    },
    "qwen2_moe": {  # a shared expert, biases on Q, K, V only, normalised top-k weights, a dense last layer
        "architecture": "qwen2_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": True,
        "mlp_only_layers": [3],
    },
}
MOE_VARIANTS = ("mixtral", "qwen2_moe", "qwen3_moe")

MOE_LAYOUTS = ["tp=2,dp=2,ep=2", "tp=2,etp=2", "dp=4,ep=4"]
"""Expert layouts, besides LAYOUTS, for the MoE variants (TP=2 x EP=2, ETP=2, EP=4)."""


@pytest.fixture(scope="module")
def llama_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each variant saved once, with transformers' logits for TOKENS."""
    out = {}
    for name, options in LLAMAS.items():
        directory = tmp_path_factory.mktemp(f"llama-{name}")
        model = _save_llama(directory, options)
        with torch.no_grad():
            out[name] = (directory, model(TOKENS).logits)
    return out


LAYOUTS = ["tp=1", "tp=2,pp=2", "tp=4"]


@pytest.mark.dist
@pytest.mark.parametrize("variant", list(LLAMAS))
def test_hf_logits_equal_transformers_on_every_layout(
    pool4: RankPool, llama_dirs: dict[str, tuple[Path, torch.Tensor]], variant: str
) -> None:
    directory, expected = llama_dirs[variant]
    layouts = list(LAYOUTS)
    if variant == "untied":  # virtual pipeline stages (interleaved chunks) and context-parallel replicas
        layouts += ["pp=2,vpp=2", "tp=2,cp=2"]
    if variant == "tied":  # the output layer on the last stage is a copy of the first stage's embedding
        layouts += ["pp=4"]
    if variant in MOE_VARIANTS:
        layouts += MOE_LAYOUTS
    for layout in layouts:
        results = [r for r in pool4.run_ok(rank_hf_logits, layout, str(directory)) if r is not None]
        logits = [r["logits"] for r in results if r["logits"] is not None]
        assert logits, layout
        for got in logits:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f"{variant} on {layout}")
        for r in results:
            assert r["read"] == r["needed"], layout  # each rank reads exactly its bytes


@pytest.mark.dist
def test_from_hf_reads_every_option_and_refuses_what_it_cannot_compute(
    llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    directory, _ = llama_dirs["biases"]
    config = transformers.AutoConfig.from_pretrained(directory)
    from_object, from_dir = ModelConfig.from_hf(config), ModelConfig.from_hf(directory)
    assert from_object == from_dir
    assert from_dir.attention_bias and from_dir.mlp_bias and from_dir.head_dim == 8 and from_dir.rms_norm_eps == 1e-5
    assert from_dir.num_query_groups == 4 and from_dir.moe_layers == ()
    scaled = ModelConfig.from_hf(llama_dirs["llama3_rope"][0])
    assert scaled.rope_theta == 500000.0 and scaled.rope_scaling is not None
    assert scaled.rope_scaling["rope_type"] == "llama3" and scaled.rope_scaling["factor"] == 8.0
    assert ModelConfig.from_hf(llama_dirs["tied"][0]).tie_word_embeddings
    mixtral = ModelConfig.from_hf(llama_dirs["mixtral"][0])
    assert mixtral.expert_glu and mixtral.moe_layers == (0, 1, 2, 3) and mixtral.num_experts == 4
    assert mixtral.moe_topk == 2 and mixtral.expert_ffn_hidden == 64 and mixtral.architecture == "mixtral"
    qwen = ModelConfig.from_hf(llama_dirs["qwen3_moe"][0])
    assert qwen.architecture == "qwen3_moe" and qwen.qk_norm and not qwen.moe_norm_topk and qwen.attention_bias
    assert qwen.moe_layers == (0, 2, 3) and qwen.expert_ffn_hidden == 32 and qwen.ffn_hidden == 64
    qwen_doc = json.loads((llama_dirs["qwen3_moe"][0] / "config.json").read_text())
    qwen2 = ModelConfig.from_hf(llama_dirs["qwen2_moe"][0])
    assert qwen2.architecture == "qwen2_moe" and qwen2.qkv_bias and not qwen2.attention_bias and not qwen2.qk_norm
    assert qwen2.shared_expert_ffn_hidden == 48 and qwen2.moe_norm_topk and qwen2.moe_layers == (0, 1, 2)
    with pytest.raises(ValueError, match="shared_expert_ffn_hidden=48 is not divisible by tp=5"):
        qwen2.check(ParallelConfig(tp=5))
    with pytest.raises(ValueError, match="no shared experts"):
        ModelConfig(shared_expert_ffn_hidden=16)
    sparse = ModelConfig.from_hf({**qwen_doc, "mlp_only_layers": [], "decoder_sparse_step": 2})
    assert sparse.moe_layers == (1, 3)
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf({**qwen_doc, "use_sliding_window": True, "sliding_window": 8})
    with pytest.raises(ValueError, match="architecture='mixtral' needs"):
        ModelConfig(architecture="mixtral", moe_layers=(1,), expert_glu=True)
    with pytest.raises(ValueError, match="architecture='llama' needs no query/key norms"):
        ModelConfig(qk_norm=True)

    doc = json.loads((directory / "config.json").read_text())
    refused = {
        "model_type": ({"model_type": "gpt2"}, "model_type='gpt2'"),
        "rope_type": ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type='yarn'"),
        "hidden_act": ({"hidden_act": "relu"}, "hidden_act='relu'"),
        "router_jitter_noise": ({"model_type": "mixtral", "router_jitter_noise": 0.1}, "router_jitter_noise"),
        "attention_dropout": ({"attention_dropout": 0.1}, "attention_dropout"),
        "partial_rotary_factor": (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
    }
    for name, (change, message) in refused.items():
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf({**doc, **change})
        assert name
    with pytest.raises(ValueError, match="unknown model options"):
        ModelConfig.from_dict({**ModelConfig().to_dict(), "sliding_window": 4})
    legacy = ModelConfig().to_dict()
    del legacy["rms_norm_eps"], legacy["moe_layers"]  # a document written before these options existed
    assert ModelConfig.from_dict(legacy) == ModelConfig()


# ---- PEFT: adapters trained on a layout, loaded by PEFT onto the transformers base ------------------------


def rank_lora_from_hf(
    ctx: RankContext, layout: str, hf_dir: str, path: str, targets: tuple[str, ...] | None = None
) -> dict[str, Any] | None:
    """The model of ``hf_dir`` with LoRA on every linear (or ``targets``) on ``layout``: base loaded from the
    safetensors, adapters trained two steps, an adapter-only checkpoint saved; the logits with the adapters."""
    groups = layout_groups(layout)
    if groups is None:
        return None
    model = ModelConfig.from_hf(hf_dir, seq_len=TOKENS.shape[1])
    lora = LoraConfig(init_b="random") if targets is None else LoraConfig(init_b="random", targets=targets)
    trainer = Trainer(model, TrainingConfig(), groups, lora)
    trainer.load_hf(hf_dir)  # the base; the adapters keep their initial values
    for _ in range(2):
        trainer.train_step()
    trainer.save_adapter(path)
    return {"logits": trainer.logits(TOKENS)}


@pytest.mark.dist
def test_peft_loads_an_exported_adapter_onto_the_transformers_base(
    pool4: RankPool, llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """LoRA trained on TP=2 x PP=2 over a Llama loaded from its safetensors, exported with export-peft:
    PeftModel and AutoPeftModelForCausalLM (through base_model_name_or_path) load it with no missing or
    unexpected keys, and their logits equal the reshard model's with its adapters."""
    import peft

    cases = [("untied", "tp=2,pp=2"), ("biases", "tp=2,pp=2"), ("qwen3_moe", "tp=2,etp=2"), ("mixtral", "dp=2,ep=2")]
    cases += [("qwen2_moe", "tp=2,dp=2,ep=2")]
    for variant, layout in cases:
        hf_dir, _ = llama_dirs[variant]
        ckpt, out = tmp_path / f"adapter-{variant}", tmp_path / f"peft-{variant}"
        # A Qwen3-MoE's dense MLP (layer 1) has no PEFT target: see test_export_peft_refuses_what_peft_would_misplace.
        targets = ("qkv", "proj", "experts.fc1", "experts.fc2") if variant.startswith("qwen") else None
        results = pool4.run_ok(rank_lora_from_hf, layout, str(hf_dir), str(ckpt), targets)
        expected = next(r["logits"] for r in results if r is not None and r["logits"] is not None)
        exported = export_peft(ckpt, out, base_model=str(hf_dir))
        # Per layer: q, k, v, o, and gate, up, down of a dense MLP or the experts' gate_up_proj and down_proj.
        per_layer = {"untied": [7] * 4, "biases": [7] * 4, "qwen3_moe": [6, 4, 6, 6], "mixtral": [6] * 4}.get(
            variant,
            [6, 6, 6, 4],  # qwen2_moe: the shared experts are no LoRA target
        )
        assert len(exported) == 2 * sum(per_layer), variant  # A and B
        config = json.loads((out / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(hf_dir)
        if variant in MOE_VARIANTS:
            assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
            with_adapter = peft.PeftModel.from_pretrained(base, out).eval()
            auto = peft.AutoPeftModelForCausalLM.from_pretrained(out).eval()
        complaints = [str(w.message) for w in caught if "missing" in str(w.message) or "unexpected" in str(w.message)]
        assert not complaints, complaints
        # PEFT does not warn about unexpected keys: every exported tensor must land in a module of the model.
        loaded = with_adapter.state_dict()
        landed = {name.replace(".weight", ".default.weight") for name in exported}
        assert landed <= set(loaded), sorted(landed - set(loaded))
        assert len({k for k in loaded if ".lora_" in k}) == len(exported)
        for name, shape in exported.items():
            assert tuple(loaded[name.replace(".weight", ".default.weight")].shape) == shape, name
        with torch.no_grad():
            for model in (with_adapter, auto):
                torch.testing.assert_close(model(TOKENS).logits, expected, rtol=0, atol=1e-5, msg=variant)
        base_logits = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)(TOKENS).logits
        assert (base_logits - expected).abs().max() > 1e-3  # the adapters matter
        if variant in MOE_VARIANTS:  # and so do the experts' adapters
            ckpt_dense, out_dense = tmp_path / f"adapter-{variant}-dense", tmp_path / f"peft-{variant}-dense"
            dense_targets = ("qkv", "proj")
            dense = pool4.run_ok(rank_lora_from_hf, layout, str(hf_dir), str(ckpt_dense), dense_targets)
            dense_logits = next(r["logits"] for r in dense if r is not None and r["logits"] is not None)
            assert (dense_logits - expected).abs().max() > 1e-4, variant
            dense_exported = export_peft(ckpt_dense, out_dense)
            assert not any(".experts." in name for name in dense_exported)
            assert "target_parameters" not in json.loads((out_dense / "adapter_config.json").read_text())


@pytest.mark.dist
def test_export_peft_refuses_what_peft_would_misplace(
    pool4: RankPool, llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """Adapters PEFT would drop or put elsewhere are refused, naming them, and nothing is written: un-gated
    experts (a Llama with experts, ModelConfig's defaults), and a Qwen3-MoE's dense MLP layers (PEFT maps
    gate_proj/up_proj/down_proj targets of a Qwen-MoE model to its experts)."""
    hf_dir, _ = llama_dirs["qwen3_moe"]
    ckpt = tmp_path / "qwen-dense-mlp"
    pool4.run_ok(rank_lora_from_hf, "tp=1", str(hf_dir), str(ckpt), ("qkv", "fc1", "fc2"))
    with pytest.raises(reshard.MismatchError, match=r"dense MLPs of a Qwen-MoE \(decoder.layers.1.mlp.fc1"):
        export_peft(ckpt, tmp_path / "out-qwen")
    demo = tmp_path / "demo-experts"
    pool4.run_ok(rank_lora_demo_model, "tp=1", str(demo))
    with pytest.raises(reshard.MismatchError, match=r"un-gated experts .*decoder.layers.1.mlp.experts.fc1"):
        export_peft(demo, tmp_path / "out-demo")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-experts", "qwen-dense-mlp"]


def rank_lora_demo_model(ctx: RankContext, layout: str, path: str) -> None:
    """ModelConfig's defaults (a Llama with un-gated experts in layers 1 and 3) with LoRA on every target, saved."""
    groups = layout_groups(layout)
    if groups is not None:
        Trainer(ModelConfig(), TrainingConfig(), groups, LoraConfig(init_b="random")).save_adapter(path)


# ---- export-hf: back to a Hugging Face model directory ---------------------------------------------------


def rank_train_from_hf(ctx: RankContext, layout: str, hf_dir: str, path: str, steps: int) -> dict[str, Any] | None:
    """The Llama of ``hf_dir`` on ``layout``, loaded from its safetensors, trained ``steps`` steps and saved
    whole (model, Adam, RNG, trainer state); its logits after training."""
    groups = layout_groups(layout)
    if groups is None:
        return None
    trainer = Trainer(ModelConfig.from_hf(hf_dir, seq_len=TOKENS.shape[1]), TrainingConfig(), groups)
    trainer.load_hf(hf_dir)
    for _ in range(steps):
        trainer.train_step()
    trainer.save(path)
    return {"logits": trainer.logits(TOKENS)}


def _hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


@pytest.mark.dist
def test_export_hf_of_an_untrained_model_is_bit_exact_with_the_original_files(
    pool4: RankPool, llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """Hugging Face -> reshard (saved on TP=2 x PP=2, PP=4 when tied, EP and ETP layouts for MoE) -> reshard
    export-hf: the same tensor names and bits as the files save_pretrained wrote, and a config.json that
    rebuilds the same model."""
    for variant in ("untied", "biases", "llama3_rope", "tied", "mixtral", "qwen2_moe", "qwen3_moe"):
        hf_dir, _ = llama_dirs[variant]
        layouts = {"tied": "pp=4", "mixtral": "tp=2,dp=2,ep=2", "qwen2_moe": "tp=2,pp=2", "qwen3_moe": "tp=2,etp=2"}
        layout = layouts.get(variant, "tp=2,pp=2")
        ckpt, out = tmp_path / f"ckpt-{variant}", tmp_path / f"hf-{variant}"
        pool4.run_ok(rank_train_from_hf, layout, str(hf_dir), str(ckpt), 0)
        # the command itself, in this process (it starts no ranks: no second import of torch per variant)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            code = cli.main(["export-hf", str(ckpt), str(out)])
        assert code == 0, err.getvalue()
        original, exported = _hf_tensors(hf_dir), _hf_tensors(out)
        assert sorted(exported) == sorted(original), variant
        for name, tensor in original.items():
            assert torch.equal(exported[name], tensor), (variant, name)
        assert ModelConfig.from_hf(out) == ModelConfig.from_hf(hf_dir), variant
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (variant, info)
        names = {
            "mixtral": "MixtralForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM",
        }
        assert type(reloaded).__name__ == names.get(variant, "LlamaForCausalLM")
        with torch.no_grad():
            torch.testing.assert_close(reloaded.eval()(TOKENS).logits, llama_dirs[variant][1], rtol=0, atol=1e-6)


@pytest.mark.dist
def test_a_trained_model_exported_loads_in_transformers_with_its_logits(
    pool4: RankPool, llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """Two steps of training (a Llama on TP=2 x PP=2, a Qwen3-MoE on TP=2 x DP=2 x EP=2), export-hf in shards:
    AutoModelForCausalLM loads it with no missing, unexpected or mismatched keys, and its logits equal the
    trained reshard model's. The Qwen3-MoE trained on one rank reaches the same logits (the per-head
    query/key norms, shared by the TP ranks, get their whole gradient on each)."""
    from reshard.models.hf_export import export_hf

    for variant, layout in (("biases", "tp=2,pp=2"), ("qwen3_moe", "tp=2,dp=2,ep=2"), ("qwen2_moe", "tp=2,etp=2")):
        hf_dir, untrained = llama_dirs[variant]
        ckpt, out = tmp_path / f"ckpt-{variant}", tmp_path / f"hf-{variant}"
        results = pool4.run_ok(rank_train_from_hf, layout, str(hf_dir), str(ckpt), 2)
        expected = next(r["logits"] for r in results if r is not None and r["logits"] is not None)
        assert (expected - untrained).abs().max() > 1e-3, variant  # it trained
        written = export_hf(ckpt, out, max_shard_bytes=20_000)
        assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
        model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (variant, info)
        assert set(written) == set(_hf_tensors(hf_dir)), variant  # the names save_pretrained writes
        with torch.no_grad():
            torch.testing.assert_close(model.eval()(TOKENS).logits, expected, rtol=0, atol=1e-5, msg=variant)
        if variant in MOE_VARIANTS:
            single = pool4.run_ok(rank_train_from_hf, "tp=1", str(hf_dir), str(tmp_path / f"single-{variant}"), 2)
            torch.testing.assert_close(single[0]["logits"], expected, rtol=0, atol=1e-4)


@pytest.mark.dist
def test_tied_embeddings_over_pipeline_stages_train_as_one_tensor(
    pool4: RankPool, llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """A tied Llama on PP=4 and TP=2 x PP=2 (the last stage's output layer a copy of the first stage's embedding)
    and on DP=2 x PP=2 with ZeRO-1 trains exactly as on one rank (the embedding group sums the two copies'
    gradients); the checkpoint holds the embedding once and no output layer, and exports to a tied Llama that
    transformers loads with the trained logits."""
    from reshard.models.hf_export import export_hf

    hf_dir, untrained = llama_dirs["tied"]
    single = pool4.run_ok(rank_train_from_hf, "tp=1", str(hf_dir), str(tmp_path / "single"), 2)[0]["logits"]
    assert (single - untrained).abs().max() > 1e-3
    for layout in ("pp=4", "tp=2,pp=2", "dp=2,pp=2,zero"):
        ckpt = tmp_path / layout.replace(",", "-").replace("=", "")
        results = pool4.run_ok(rank_train_from_hf, layout, str(hf_dir), str(ckpt), 2)
        logits = next(r["logits"] for r in results if r is not None and r["logits"] is not None)
        torch.testing.assert_close(logits, single, rtol=0, atol=1e-5, msg=layout)
        tensors = reshard.read_metadata(ckpt).tensors
        assert "output_layer.weight" not in tensors
        embedding = tensors["embedding.word_embeddings.weight"]
        assert sum(math.prod(box.shape) for box in embedding.boxes) == 61 * 32, layout  # once, not per stage
        out = tmp_path / f"hf-{ckpt.name}"
        export_hf(ckpt, out)
        model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        assert model.config.tie_word_embeddings
        with torch.no_grad():
            torch.testing.assert_close(model(TOKENS).logits, logits, rtol=0, atol=1e-5, msg=layout)


@pytest.mark.dist
def test_export_hf_refuses_what_it_cannot_write_and_leaves_nothing(
    pool4: RankPool, llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    from reshard.models.hf_export import export_hf

    hf_dir, _ = llama_dirs["untied"]
    ckpt = tmp_path / "ckpt"
    pool4.run_ok(rank_train_from_hf, "tp=1", str(hf_dir), str(ckpt), 0)
    (tmp_path / "taken").mkdir()
    with pytest.raises(reshard.CheckpointExistsError):
        export_hf(ckpt, tmp_path / "taken")
    # An adapter-only checkpoint has no model tensors: refused, nothing written.
    adapter = tmp_path / "adapter"
    pool4.run_ok(rank_lora_from_hf, "tp=1", str(hf_dir), str(adapter))
    with pytest.raises(reshard.MismatchError, match="export-peft"):
        export_hf(adapter, tmp_path / "from-adapter")
    # The demo's MoE model is not a Hugging Face architecture.
    moe = tmp_path / "moe"
    reshard.save({"trainer": {"model_config": ModelConfig().to_dict()}, "w": torch.ones(1)}, moe)
    with pytest.raises(reshard.MismatchError, match="experts"):
        export_hf(moe, tmp_path / "from-moe")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "ckpt", "moe", "taken"]


@pytest.mark.slow
def test_demo_from_hf_starts_from_the_transformers_weights(
    llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """reshard demo --from-hf DIR: layout A starts from the Llama's weights (its first loss is transformers'
    loss on the same batch), saves, and layout B resumes bit-exactly."""
    import torch.nn.functional as F

    from reshard.demo.training import global_batch

    hf_dir, _ = llama_dirs["biases"]
    out = tmp_path / "demo"
    command = [sys.executable, "-m", "reshard", "demo", "--from-hf", str(hf_dir), "--layout-a", "tp=2,pp=2"]
    command += ["--layout-b", "tp=4", "--steps", "1", "--resume-steps", "1", "--out", str(out), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["phase_a"]["digest_saved"] == report["phase_b"]["digest_loaded"]
    model_config = ModelConfig.from_hf(hf_dir)
    batch = global_batch(0, model_config, TrainingConfig())
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = hf(batch[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    assert report["phase_a"]["losses"][0] == pytest.approx(expected, rel=1e-5)
    refused = subprocess.run([*command[:6], "--hidden", "64"], capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 2 and "drop --hidden" in refused.stderr


@pytest.mark.dist
def test_demo_lora_from_hf_resumes_its_adapters_on_the_transformers_base(
    llama_dirs: dict[str, tuple[Path, torch.Tensor]], tmp_path: Path
) -> None:
    """reshard demo --from-hf DIR --lora R: phase B resumes the adapters on the same base as phase A, the Llama's
    weights (it used to resume them on the reference model's random initial weights: a resumed state other than
    the saved one, exit 1)."""
    hf_dir, _ = llama_dirs["biases"]
    command = [sys.executable, "-m", "reshard", "demo", "--from-hf", str(hf_dir), "--lora", "2", "--layout-a", "tp=2"]
    command += ["--layout-b", "tp=1", "--steps", "1", "--resume-steps", "1", "--out", str(tmp_path / "demo"), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["phase_a"]["digest_saved"] == report["phase_b"]["digest_loaded"] != ""
    assert report["phase_b"]["losses"][0] == pytest.approx(report["phase_a"]["loss_after"], rel=1e-5)
