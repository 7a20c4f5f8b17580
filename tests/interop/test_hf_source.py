"""Hugging Face safetensors checkpoints as a load source: ``load(template, HuggingFaceSource(hf_dir, key_map))``.

The files are written by the ``safetensors`` library from a model in memory (the demo GPT's full tensors
under Llama/Mixtral names), then loaded straight into the demo model at TP=2 x PP=2, each rank reading
only the bytes of its boxes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import reshard
from reshard.demo.training import Trainer, TrainingConfig
from reshard.interop import HuggingFaceSource
from reshard.interop.hf_source import Concat, Stack
from reshard.models.config import ModelConfig
from reshard.models.hf import hf_key_map, to_hf_tensors
from tests.demo_groups import layout_groups
from tests.rankpool import RankContext, RankPool


def _trainer(layout: str) -> Trainer | None:
    groups = layout_groups(layout)
    return None if groups is None else Trainer(ModelConfig(), TrainingConfig(), groups)


def rank_trained_model(ctx: RankContext) -> dict[str, torch.Tensor] | None:
    """The demo model's full tensors after two steps on one rank (not its initial values, which the
    loading layout would reproduce by itself)."""
    trainer = _trainer("tp=1")
    if trainer is None:
        return None
    for _ in range(2):
        trainer.train_step()
    return {k: v for k, v in trainer.full_state().items() if not k.startswith("optimizer.")}


def rank_load_hf(ctx: RankContext, layout: str, hf_dir: str) -> dict[str, Any] | None:
    trainer = _trainer(layout)
    if trainer is None:
        return None
    stats = reshard.LoadStats()
    template = {"model": trainer.sharded_state_dict()["model"]}
    reshard.load(
        template,
        HuggingFaceSource(hf_dir, key_map=hf_key_map(trainer.model_config)),
        group=trainer.groups.layout.process_group,
        stats=stats,
    )
    full = {k: v for k, v in trainer.full_state().items() if not k.startswith("optimizer.")}
    return {"full": full, "read": stats.bytes_read, "needed": stats.bytes_needed, "loss": trainer.train_step()}


def _write_sharded(hf: dict[str, torch.Tensor], out: Path, shards: int) -> int:
    """Write ``hf`` as ``shards`` safetensors files with a Hugging Face index; return the data bytes."""
    out.mkdir()
    names = sorted(hf)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: hf[n] for n in names[i::shards]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in hf.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


@pytest.mark.dist
def test_llama_style_checkpoint_loads_straight_into_tp2_pp2(pool4: RankPool, tmp_path: Path) -> None:
    full = pool4.run_ok(rank_trained_model)[0]
    hf = to_hf_tensors(full, ModelConfig())
    assert "model.layers.0.self_attn.k_proj.weight" in hf and "model.layers.1.mlp.experts.3.up_proj.weight" in hf
    hf_dir = tmp_path / "hf"
    total = _write_sharded(hf, hf_dir, shards=3)
    results = pool4.run_ok(rank_load_hf, "tp=2,pp=2", str(hf_dir))
    for key, tensor in full.items():
        assert torch.equal(results[0]["full"][key], tensor), key
    for r in results:
        assert r["read"] <= 1.10 * r["needed"]  # only the bytes of its boxes
        assert r["read"] < 0.6 * total
    # The loaded model trains on as the original would: the same loss as one rank from the same weights.
    reference = pool4.run_ok(rank_load_hf, "tp=1", str(hf_dir))[0]
    assert results[0]["loss"] == pytest.approx(reference["loss"], rel=2e-5)


@pytest.mark.unit
def test_single_file_source_without_key_map_and_with_casts(tmp_path: Path) -> None:
    """``model.safetensors`` alone, template keys = tensor names, a bf16 source into fp32, a row slice,
    and Concat / Stack in one process."""
    hf_dir = tmp_path / "single"
    hf_dir.mkdir()
    a = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    b = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    save_file({"a": a, "b": b, "c": a + 100}, str(hf_dir / "model.safetensors"))
    rows = torch.zeros(3, 4)
    out = reshard.load(
        {
            "a": reshard.ShardedTensor("a", rows, (6, 4), (3, 0)),
            "b": torch.zeros(2, 4),
            "fused": torch.zeros(12, 4),
            "stacked": torch.zeros(2, 6, 4),
        },
        HuggingFaceSource(str(hf_dir), key_map={"fused": Concat("c", "a"), "stacked": Stack("a", "c")}),
    )
    assert torch.equal(out["a"], a[3:])
    assert torch.equal(out["b"], b.float())
    assert torch.equal(out["fused"], torch.cat([a + 100, a]))
    with pytest.raises(reshard.MismatchError, match="different dtypes"):
        reshard.load({"x": torch.zeros(8, 4)}, HuggingFaceSource(str(hf_dir), key_map={"x": Concat("a", "b")}))
    assert torch.equal(out["stacked"], torch.stack([a, a + 100]))


@pytest.mark.unit
def test_bad_sources_and_key_maps_fail_clearly(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file({"a": torch.zeros(2, 3), "b": torch.zeros(2, 4)}, str(hf_dir / "model.safetensors"))
    with pytest.raises(reshard.MismatchError, match="no tensor 'nope'"):
        reshard.load({"x": torch.zeros(2, 3)}, HuggingFaceSource(str(hf_dir), key_map={"x": "nope"}))
    with pytest.raises(reshard.MismatchError, match="cannot concatenate"):
        reshard.load({"x": torch.zeros(4, 3)}, HuggingFaceSource(str(hf_dir), key_map={"x": Concat("a", "b")}))
    with pytest.raises(reshard.MismatchError, match="missing from the checkpoint"):
        reshard.load({"x": torch.zeros(2, 3)}, HuggingFaceSource(hf_dir))
    with pytest.raises(reshard.MismatchError, match="global shape"):
        reshard.load({"a": torch.zeros(3, 3)}, HuggingFaceSource(hf_dir))
    # An index naming a shard that is not there, or a tensor its shard lacks.
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(reshard.CorruptCheckpointError, match="is missing"):
        reshard.load({"a": torch.zeros(2, 3)}, HuggingFaceSource(hf_dir))
    index = {"weight_map": {"a": "model.safetensors", "z": "model.safetensors"}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(reshard.CorruptCheckpointError, match="do not hold: z"):
        reshard.load({"a": torch.zeros(2, 3)}, HuggingFaceSource(hf_dir))
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../escape.safetensors"}}))
    with pytest.raises(reshard.CorruptCheckpointError, match="shard name"):
        reshard.load({"a": torch.zeros(2, 3)}, HuggingFaceSource(hf_dir))
    # A header whose offsets run past the file.
    (hf_dir / "model.safetensors.index.json").unlink()
    raw = bytearray((hf_dir / "model.safetensors").read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header["b"]["data_offsets"][1] += 4
    encoded = json.dumps(header).encode()
    encoded += b" " * (length - len(encoded))
    (hf_dir / "model.safetensors").write_bytes(raw[:8] + encoded[:length] + raw[8 + length :])
    with pytest.raises(reshard.CorruptCheckpointError):
        reshard.load({"a": torch.zeros(2, 3)}, HuggingFaceSource(hf_dir))
    # A reshard checkpoint is not a safetensors source, and a safetensors directory is not a checkpoint.
    ckpt = tmp_path / "ckpt"
    reshard.save({"a": torch.zeros(2)}, str(ckpt))
    with pytest.raises(reshard.CheckpointNotFoundError, match="not a Hugging Face safetensors checkpoint"):
        reshard.load({"a": torch.zeros(2)}, HuggingFaceSource(str(ckpt), key_map={"a": "a"}))
    with pytest.raises(reshard.CheckpointNotFoundError, match="HuggingFaceSource"):
        reshard.load({"a": torch.zeros(2, 3)}, hf_dir)


@pytest.mark.dist
def test_source_on_an_object_store_reads_only_the_ranges_needed(object_store: Any, tmp_path: Path) -> None:
    """An indexed safetensors set in a bucket: headers and the template's rows come as ranged reads."""
    from reshard.storage import ObjectStorage

    local = tmp_path / "hf"
    local.mkdir()
    save_file({"q": torch.arange(64.0).reshape(16, 4)}, str(local / "model-00001-of-00002.safetensors"))
    save_file({"k": -torch.arange(32.0).reshape(8, 4)}, str(local / "model-00002-of-00002.safetensors"))
    weight_map = {"q": "model-00001-of-00002.safetensors", "k": "model-00002-of-00002.safetensors"}
    (local / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    options = object_store.storage_options
    url = f"{object_store.protocol}://{object_store.new_bucket()}/llama"
    storage = ObjectStorage(url, options)
    try:
        for file in local.iterdir():
            storage.put(file.name, file.read_bytes())
    finally:
        storage.close()
    stats = reshard.LoadStats()
    rows = reshard.ShardedTensor("qk", torch.zeros(4, 4), (24, 4), (14, 0))  # 2 rows of q, 2 of k
    reshard.load(
        {"qk": rows}, HuggingFaceSource(url, key_map={"qk": Concat("q", "k")}, storage_options=options), stats=stats
    )
    expected = torch.cat([torch.arange(64.0).reshape(16, 4), -torch.arange(32.0).reshape(8, 4)])[14:18]
    assert torch.equal(rows.data, expected)
    assert stats.bytes_read == stats.bytes_needed == 4 * 4 * 4


@pytest.mark.unit
def test_source_tensors_no_template_uses_are_an_error_unless_allowed(tmp_path: Path) -> None:
    """A key map that does not fit silently drops weights: source tensors that no template key uses raise
    MismatchError naming them; allow_unused=True loads part of the source."""
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file({"a": torch.ones(2, 3), "b": torch.zeros(2, 4), "c": torch.zeros(1)}, str(hf_dir / "model.safetensors"))
    with pytest.raises(reshard.MismatchError, match=r"2 tensors of the source are used by no template key.*'b', 'c'"):
        reshard.load({"a": torch.zeros(2, 3)}, HuggingFaceSource(hf_dir))
    with pytest.raises(reshard.MismatchError, match=r"1 tensors .*'c'.*allow_unused=True"):
        reshard.load({"x": torch.zeros(2, 7)}, HuggingFaceSource(hf_dir, key_map={"x": Concat("a", "b", axis=1)}))
    out = reshard.load({"a": torch.zeros(2, 3)}, HuggingFaceSource(hf_dir, allow_unused=True))
    assert torch.equal(out["a"], torch.ones(2, 3))
