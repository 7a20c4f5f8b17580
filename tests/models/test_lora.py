"""LoRA adapter checkpoints of the demo GPT: every unique adapter box written once, resumed on any layout
bit-exactly, and loud failures where the seed report's stack silently started from fresh adapters.

The scenarios come from the seed report on adapter checkpoints (``shared/seeds/002_*``): DP/CP replicas
duplicating shards, ETP slices dropped when shards were named by (TP, PP, EP) alone, an interrupted save
leaving partial data, and an EP4 checkpoint resumed at EP1 silently training a fresh adapter.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.demo.run import state_digest
from reshard.demo.training import Trainer, TrainingConfig
from reshard.metadata import METADATA_FILE
from reshard.models.config import LoraConfig, ModelConfig, is_adapter_key
from reshard.models.parallel import ParallelConfig
from tests.demo_groups import layout_groups
from tests.rankpool import RankContext, RankPool

RANDOM_B = LoraConfig(init_b="random")
EXPERT_B = "decoder.layers.1.mlp.experts.fc1.lora_B.weight"


def _trainer(layout: str, lora: dict[str, Any] | None) -> Trainer | None:
    groups = layout_groups(layout)
    if groups is None:
        return None
    return Trainer(ModelConfig(), TrainingConfig(), groups, LoraConfig.from_dict(lora) if lora else None)


def _adapters_of(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in full.items() if is_adapter_key(k)}


def rank_lora_losses(ctx: RankContext, layout: str, steps: int) -> dict[str, Any] | None:
    trainer = _trainer(layout, RANDOM_B.to_dict())
    if trainer is None:
        return None
    before = trainer.full_state()
    losses = [trainer.train_step() for _ in range(steps)]
    after = trainer.full_state()
    base_frozen = all(
        torch.equal(before[k], after[k]) for k in before if not k.startswith("optimizer.") and not is_adapter_key(k)
    )
    adapters_moved = all(not torch.equal(before[k], after[k]) for k in _adapters_of(before))
    optimizer_keys = sorted(k for k in after if k.startswith("optimizer."))
    return {
        "losses": losses,
        "base_frozen": base_frozen,
        "adapters_moved": adapters_moved,
        "optimizer_keys": optimizer_keys,
    }


LORA_LAYOUTS = ["tp=2", "dp=2,ep=2", "tp=2,etp=2", "cp=2,dp=2,ep=2,etp=2", "tp=2,pp=2,dp=2,ep=2,etp=2,zero"]


@pytest.mark.dist
def test_lora_trains_the_same_on_every_layout_with_the_base_frozen(pool8: RankPool) -> None:
    """The TP/ETP-aware adapters are correct: losses match one rank (up to reassociation), only adapters
    move, and Adam holds state for the adapters alone."""
    reference = pool8.run_ok(rank_lora_losses, "tp=1", 8)[0]
    assert min(reference["losses"][-3:]) < reference["losses"][0]  # it learns (after the learning-rate warmup)
    assert reference["base_frozen"] and reference["adapters_moved"]
    assert reference["optimizer_keys"] and all(is_adapter_key(k) for k in reference["optimizer_keys"])
    for layout in LORA_LAYOUTS:
        result = pool8.run_ok(rank_lora_losses, layout, 3)[0]
        assert result["losses"] == pytest.approx(reference["losses"][:3], rel=2e-5), layout
        assert result["base_frozen"] and result["adapters_moved"], layout


# ---- the seed's TP1/PP1/EP2/ETP2 scenario ---------------------------------------------------------------


def rank_save_seed_values(ctx: RankContext, path: str) -> dict[str, Any] | None:
    """TP1/PP1/EP2/ETP2 on four ranks (CP2 gives ETP its two token-sharing ranks): each rank's slice of
    an expert adapter gets the value 10 * ep + etp, as in the seed report (0, 1, 10, 11)."""
    trainer = _trainer("cp=2,dp=2,ep=2,etp=2", RANDOM_B.to_dict())
    if trainer is None:
        return None
    c = trainer.groups.coords
    with torch.no_grad():
        trainer.stage.params[EXPERT_B].fill_(10 * c.ep + c.etp)
    trainer.save_adapter(path)
    return {"coords": (c.tp, c.pp, c.ep, c.etp)}


def rank_load_expert_adapter(ctx: RankContext, layout: str, path: str) -> dict[str, Any] | None:
    trainer = _trainer(layout, RANDOM_B.to_dict())
    if trainer is None:
        return None
    assert trainer.load_adapter(path)
    return {"full": trainer.full_state()[EXPERT_B]}


@pytest.mark.dist
def test_seed_etp_slices_are_all_saved_and_restored(pool8: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "adapter")
    saved = pool8.run_ok(rank_save_seed_values, path)[:4]
    assert [s["coords"] for s in saved] == [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1)]
    boxes = reshard.read_metadata(path).tensors[EXPERT_B].boxes
    assert len(boxes) == 4  # one box per (TP, PP, EP, ETP) coordinate: no slice dropped, none twice
    cfg = ModelConfig()
    half_e, half_f = cfg.num_experts // 2, cfg.expert_ffn_hidden // 2
    for layout in ("tp=1", "dp=4,ep=4", "tp=2,dp=2,ep=2,etp=2"):  # EP1 (the seed's silent fresh start), EP4
        full = pool8.run_ok(rank_load_expert_adapter, layout, path)[0]["full"]
        for ep in range(2):
            for etp in range(2):
                block = full[ep * half_e : (ep + 1) * half_e, etp * half_f : (etp + 1) * half_f]
                assert torch.all(block == 10 * ep + etp), (layout, ep, etp)


# ---- save at one layout, load at three others ------------------------------------------------------------


def rank_train_and_save_adapter(
    ctx: RankContext, layout: str, steps: int, path: str, lora: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    trainer = _trainer(layout, lora or RANDOM_B.to_dict())
    if trainer is None:
        return None
    for _ in range(steps):
        trainer.train_step()
    full = trainer.full_state()
    trainer.save_adapter(path)
    adapters = {k: v for k, v in full.items() if is_adapter_key(k)}
    return {"digest": state_digest(adapters), "adapters": adapters, "step": trainer.step}


def rank_resume_adapter(ctx: RankContext, layout: str, path: str, steps: int) -> dict[str, Any] | None:
    trainer = _trainer(layout, {**RANDOM_B.to_dict(), "init_b": "zeros"})  # fresh adapters differ from saved
    if trainer is None:
        return None
    assert trainer.load_adapter(path)
    full = trainer.full_state()
    adapters = _adapters_of(full)
    losses = [trainer.train_step() for _ in range(steps)]
    return {"digest": state_digest(adapters), "step": trainer.step, "losses": losses}


@pytest.mark.dist
def test_adapter_checkpoint_resumes_bit_exactly_on_other_layouts(pool8: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "adapter")
    saved = pool8.run_ok(rank_train_and_save_adapter, "tp=2,pp=2,dp=2,ep=2,etp=2,zero", 2, path)[0]
    adapters: dict[str, torch.Tensor] = saved["adapters"]
    metadata = reshard.read_metadata(path)
    # Only adapters and their Adam states were saved, each unique box once: the data bytes are exactly
    # the bytes of the whole adapter tensors, whatever the DP/CP/TP/ETP replication.
    assert set(metadata.tensors) == set(adapters)
    unique_bytes = sum(t.numel() * 4 for t in adapters.values())
    stored = sum(box.byte_length for t in metadata.tensors.values() for box in t.boxes)
    assert stored == unique_bytes
    # On disk: those bytes, the RNG states (one per saving rank), the data position (one cell) and at most 63
    # bytes of alignment each.
    entries = [e for o in metadata.objects.values() for e in o.entries]
    boxes = [box for t in metadata.tensors.values() for box in t.boxes]
    assert len(metadata.objects["rng_state"].entries) == 8 and len(metadata.objects["data"].entries) == 1
    assert len(entries) == 9
    payload = unique_bytes + sum(e.byte_length for e in entries)
    on_disk = sum(f.stat().st_size for f in (Path(path) / "data").iterdir())
    assert payload <= on_disk < payload + 64 * (len(boxes) + len(entries))
    for layout in ("tp=1", "tp=4,dp=2,ep=2", "pp=2,vpp=2,cp=2,etp=2,zero"):
        resumed = pool8.run_ok(rank_resume_adapter, layout, path, 1)
        world = ParallelConfig.parse(layout).world_size
        assert all(r["digest"] == saved["digest"] for r in resumed[:world]), layout
        assert resumed[0]["step"] == saved["step"] + 1


# ---- loud failures ---------------------------------------------------------------------------------------


def rank_save_adapter(ctx: RankContext, layout: str, lora: dict[str, Any] | None, path: str) -> bool | None:
    trainer = _trainer(layout, lora)
    if trainer is None:
        return None
    if lora is None:
        trainer.save(path)
    else:
        trainer.save_adapter(path)
    return True


def rank_try_load_adapter(
    ctx: RankContext, layout: str, lora: dict[str, Any], path: str, missing_ok: bool
) -> dict[str, Any] | None:
    trainer = _trainer(layout, lora)
    if trainer is None:
        return None
    before = state_digest(_adapters_of(trainer.full_state()))
    try:
        loaded = trainer.load_adapter(path, missing_ok=missing_ok)
    except reshard.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    after = state_digest(_adapters_of(trainer.full_state()))
    return {"loaded": loaded, "unchanged": before == after}


def _errors(results: list[Any], world: int) -> set[tuple[str, str]]:
    return {(r["error"], r["message"]) for r in results[:world]}


@pytest.mark.dist
def test_incompatible_adapters_raise_mismatch_listing_the_differences(pool8: RankPool, tmp_path: Path) -> None:
    rank8 = tmp_path / "rank8"
    pool8.run_ok(rank_save_adapter, "dp=2,ep=2", {**RANDOM_B.to_dict(), "rank": 8}, str(rank8))
    results = pool8.run_ok(rank_try_load_adapter, "tp=2", RANDOM_B.to_dict(), str(rank8), False)
    [(error, message)] = _errors(results, 2)  # the same error on every rank
    assert error == "MismatchError"
    assert "rank/alpha: checkpoint 8/8.0, model 4/8.0" in message
    assert "decoder.layers.0.self_attention.qkv.lora_A.weight: checkpoint shape [8, 32], model shape [4, 32]" in message

    attention_only = tmp_path / "attention-only"
    narrow = {**RANDOM_B.to_dict(), "targets": ["qkv", "proj"]}
    pool8.run_ok(rank_save_adapter, "tp=2", narrow, str(attention_only))
    [(error, message)] = _errors(
        pool8.run_ok(rank_try_load_adapter, "tp=1", RANDOM_B.to_dict(), str(attention_only), False), 1
    )
    assert error == "MismatchError" and "missing from the checkpoint" in message
    assert "decoder.layers.0.mlp.fc1.lora_A.weight" in message

    # The reverse: the checkpoint holds adapters this model would drop silently.
    everything = tmp_path / "everything"
    pool8.run_ok(rank_save_adapter, "tp=1", RANDOM_B.to_dict(), str(everything))
    [(error, message)] = _errors(pool8.run_ok(rank_try_load_adapter, "tp=2", narrow, str(everything), False), 2)
    assert error == "MismatchError" and "only in the checkpoint" in message
    assert "decoder.layers.1.mlp.experts.fc2.lora_B.weight" in message

    # A full checkpoint of a model without LoRA holds no adapters at all.
    base = tmp_path / "base"
    pool8.run_ok(rank_save_adapter, "tp=1", None, str(base))
    [(error, message)] = _errors(pool8.run_ok(rank_try_load_adapter, "tp=1", RANDOM_B.to_dict(), str(base), True), 1)
    assert error == "MismatchError" and "missing from the checkpoint" in message


@pytest.mark.dist
def test_interrupted_or_missing_adapter_checkpoints_never_mean_fresh_adapters(pool8: RankPool, tmp_path: Path) -> None:
    saved = tmp_path / "adapter"
    pool8.run_ok(rank_save_adapter, "dp=2,ep=2", RANDOM_B.to_dict(), str(saved))
    # Adapter data without a committed checkpoint: what an interrupted save leaves.
    interrupted = tmp_path / "interrupted"
    shutil.copytree(saved, interrupted)
    (interrupted / METADATA_FILE).unlink()
    for missing_ok in (False, True):
        results = pool8.run_ok(rank_try_load_adapter, "dp=4,ep=4", RANDOM_B.to_dict(), str(interrupted), missing_ok)
        [(error, message)] = _errors(results, 4)
        assert error == "IncompleteCheckpointError", message
    # Nothing at the path: an error unless the caller asked for missing_ok, which keeps the adapters as they are.
    nothing = str(tmp_path / "never-saved")
    [(error, _)] = _errors(pool8.run_ok(rank_try_load_adapter, "tp=2", RANDOM_B.to_dict(), nothing, False), 2)
    assert error == "CheckpointNotFoundError"
    results = pool8.run_ok(rank_try_load_adapter, "tp=2", RANDOM_B.to_dict(), nothing, True)[:2]
    assert all(r == {"loaded": False, "unchanged": True} for r in results)
    # The committed one still loads, on a layout of other EP size.
    zero_b = {**RANDOM_B.to_dict(), "init_b": "zeros"}
    results = pool8.run_ok(rank_try_load_adapter, "dp=4,ep=4", zero_b, str(saved), False)[:4]
    assert all(r == {"loaded": True, "unchanged": False} for r in results)


# ---- Hugging Face PEFT export ----------------------------------------------------------------------------


@pytest.mark.dist
def test_peft_export_of_a_tp2_adapter_checkpoint_equals_the_gathered_adapter(pool8: RankPool, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path = tmp_path / "adapter"
    dense_targets = LoraConfig(init_b="random", targets=("qkv", "proj", "fc1", "fc2")).to_dict()
    layout = "tp=2,dp=2,ep=2,etp=2"
    adapters = pool8.run_ok(rank_train_and_save_adapter, layout, 1, str(path), dense_targets)[0]["adapters"]
    out = tmp_path / "peft"
    done = subprocess.run(
        [sys.executable, "-m", "reshard", "export-peft", str(path), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    exported = load_file(str(out / "adapter_model.safetensors"))
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8.0
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    cfg = ModelConfig()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_query_groups * cfg.head_dim
    expected: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        src, dst = f"decoder.layers.{layer}", f"base_model.model.model.layers.{layer}"

        def fused(module: str, parts: dict[str, tuple[int, int]], src: str = src, dst: str = dst) -> None:
            a, b = adapters[f"{src}.{module}.lora_A.weight"], adapters[f"{src}.{module}.lora_B.weight"]
            for name, (start, stop) in parts.items():
                expected[f"{dst}.{name}.lora_A.weight"] = a
                expected[f"{dst}.{name}.lora_B.weight"] = b[start:stop]

        fused(
            "self_attention.qkv",
            {"self_attn.q_proj": (0, q), "self_attn.k_proj": (q, q + kv), "self_attn.v_proj": (q + kv, q + 2 * kv)},
        )
        fused("self_attention.proj", {"self_attn.o_proj": (0, cfg.hidden)})
        if layer not in cfg.moe_layers:
            fused(
                "mlp.fc1", {"mlp.gate_proj": (0, cfg.ffn_hidden), "mlp.up_proj": (cfg.ffn_hidden, 2 * cfg.ffn_hidden)}
            )
            fused("mlp.fc2", {"mlp.down_proj": (0, cfg.hidden)})
    assert sorted(exported) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    # Every PEFT projection's update B_i A_i is the matching row block of the fused update B A.
    a = adapters["decoder.layers.0.self_attention.qkv.lora_A.weight"]
    b = adapters["decoder.layers.0.self_attention.qkv.lora_B.weight"]
    per_projection = [
        exported[f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_B.weight"]
        @ exported[f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_A.weight"]
        for p in "qkv"
    ]
    torch.testing.assert_close(torch.cat(per_projection), b @ a)

    # The export never overwrites, and a checkpoint without adapters is refused.
    def export(ckpt: Path, into: Path) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "reshard", "export-peft", str(ckpt), str(into)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    again = export(path, out)
    assert again.returncode == 3 and "already holds a PEFT adapter" in again.stderr
    base = tmp_path / "base"
    pool8.run_ok(rank_save_adapter, "tp=1", None, str(base))
    refused = export(base, tmp_path / "peft-of-base")
    assert refused.returncode == 3 and "holds no LoRA adapters" in refused.stderr
    # Adapters of un-gated experts (ModelConfig's defaults) have no PEFT module to go to: refused, not written.
    experts = tmp_path / "experts"
    pool8.run_ok(rank_train_and_save_adapter, layout, 1, str(experts))
    refused = export(experts, tmp_path / "peft-of-experts")
    assert refused.returncode == 3 and "have no PEFT target" in refused.stderr and "mlp.experts.fc1" in refused.stderr
    assert not (tmp_path / "peft-of-experts").exists()
