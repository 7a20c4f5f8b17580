"""``export-hf --quantize`` of a checkpoint whose Linear weights are saved as ScaledTensors already (issue 32):
written as they are (no requantizing) under the consumer's names and dtypes, loaded by transformers and
decompressed by compressed-tensors to reshard's dequantization of the saved bytes; and the refusals.

The checkpoints are saved at TP2 (threads of a ThreadGroup) from ``reshard.state.quantize.quantize`` of a tiny
random Llama's weights. transformers and compressed-tensors take seconds to import: dist tier.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.interop.hf_source import Stack
from reshard.models.config import ModelConfig
from reshard.models.hf import hf_key_map
from reshard.models.hf_export import export_hf
from reshard.models.hf_quant import QUANT_SCHEMES, is_quantized_weight
from reshard.state.quantize import Quantized, dequantize, quantize, quantize_with_scales
from tests.flows.test_scaled import on_ranks, same_bytes
from tests.hf_models import save_hf_model
from tests.models.test_hf_quant_export import _assert_transformers_loads, _export, _files

pytestmark = pytest.mark.dist

TP2 = {  # every Linear splits in two on whole 128x128 blocks (QKV 768 rows, GLU 512, 256 columns)
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_hidden_layers": 2,
}
ROW_PARALLEL = (".qkv.", ".fc1.")  # split on rows; the others (proj, fc2) on columns


def _quantized(weight: torch.Tensor, scheme_name: str, *, exact_scales: bool) -> Quantized:
    """``weight`` quantized to the scheme's format and blocks; with ``exact_scales``, the FP8 scales rounded to
    the weight's dtype first (the data divided by the rounded ones), as compressed-tensors keeps them."""
    scheme = QUANT_SCHEMES[scheme_name]
    whole = quantize(weight.float(), scheme.fmt, scheme.block)
    if exact_scales and whole.scale.dtype == torch.float32:
        rounded = whole.scale.to(weight.dtype).float()
        return Quantized(quantize_with_scales(weight.float(), rounded, scheme.fmt, scheme.block), rounded, None)
    return whole


def _scaled_checkpoint(tmp: Path, scheme_name: str, *, exact_scales: bool = True) -> tuple[Path, Any, dict[str, Any]]:
    """A tiny random Llama (bfloat16) saved at TP2 with its Linear weights as ScaledTensors of the scheme's
    format and blocks (the others plain); returns the checkpoint, the transformers model and the quantized
    weights by checkpoint key."""
    model = save_hf_model(tmp / "hf", TP2)
    config = ModelConfig.from_hf(tmp / "hf")
    tensors = _files(tmp / "hf")
    scheme = QUANT_SCHEMES[scheme_name]
    full: dict[str, torch.Tensor] = {}
    for key, source in hf_key_map(config).items():
        assert isinstance(source, str) or not isinstance(source, Stack)
        names = [source] if isinstance(source, str) else list(source.sources)
        full[key] = torch.cat([tensors[n] for n in names]).to(torch.bfloat16)
    quantized = {
        key: _quantized(weight, scheme_name, exact_scales=exact_scales)
        for key, weight in full.items()
        if weight.ndim == 2 and ("qkv" in key or key.endswith(("proj.weight", "fc1.weight", "fc2.weight")))
    }

    def save(rank: int, group: Any) -> None:
        state: dict[str, Any] = {"trainer": {"model_config": config.to_dict()}}
        for key, weight in full.items():
            if key not in quantized:
                state[key] = weight.clone()
                continue
            q = quantized[key]
            axis = 0 if any(p in key for p in ROW_PARALLEL) else 1
            data = q.data.chunk(2, dim=axis)[rank].clone()
            sharded = reshard.ShardedTensor.from_rank_offsets(key, data, (axis, rank, 2))
            glob = None if q.global_scale is None else q.global_scale.clone()
            state[key] = reshard.ScaledTensor(
                sharded, q.scale.chunk(2, dim=axis)[rank].clone(), scheme.fmt, scheme.block, global_scale=glob
            )
        reshard.save(state, tmp / "ckpt", group=group)

    on_ranks(2, save)
    assert reshard.read_metadata(tmp / "ckpt").scaled  # saved as scaled tensors
    return tmp / "ckpt", model, quantized


def _reshards_dequantization(quantized: dict[str, Quantized], scheme_name: str, config: ModelConfig) -> dict[str, Any]:
    """reshard's dequantization (float32) of the saved weights, by Hugging Face weight name."""
    scheme = QUANT_SCHEMES[scheme_name]
    out = {}
    for key, q in quantized.items():
        whole = dequantize(q.data, q.scale, scheme.fmt, scheme.block, q.global_scale)
        source = hf_key_map(config)[key]
        names = [source] if isinstance(source, str) else list(source.sources)
        rows = [whole.shape[0] // len(names)] * len(names) if len(names) != 3 else [256, 256, 256]
        out.update(zip(names, torch.split(whole, rows), strict=True))
    return out


def test_transformers_loads_a_pass_through_of_saved_fp8_block_scaled_weights(tmp_path: Path) -> None:
    """FP8 128x128 ScaledTensors saved at TP2 -> export-hf --quantize fp8-block128: the data and float32
    ``weight_scale_inv`` are the saved bytes (split at the fused QKV and GLU parts), and transformers (CPU,
    its own dequantization) holds reshard's dequantization of them, with the logits of a model holding them."""
    ckpt, original, quantized = _scaled_checkpoint(tmp_path, "fp8-block128", exact_scales=False)
    out = tmp_path / "fp8"
    _export(ckpt, out, "fp8-block128")
    files = _files(out)
    qkv = quantized["decoder.layers.0.self_attention.qkv.weight"]
    assert same_bytes(files["model.layers.0.self_attn.k_proj.weight"], qkv.data[256:512])
    assert torch.equal(files["model.layers.0.self_attn.k_proj.weight_scale_inv"], qkv.scale[2:4])
    proj = quantized["decoder.layers.1.self_attention.proj.weight"]
    assert same_bytes(files["model.layers.1.self_attn.o_proj.weight"], proj.data)
    assert torch.equal(files["model.layers.1.self_attn.o_proj.weight_scale_inv"], proj.scale)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["weight_block_size"] == [128, 128] and "lm_head" in config["modules_to_not_convert"]
    assert not any(is_quantized_weight(m + ".weight") for m in config["modules_to_not_convert"])
    dequantized = _reshards_dequantization(quantized, "fp8-block128", ModelConfig.from_hf(tmp_path / "hf"))
    assert len(dequantized) == 2 * 7
    _assert_transformers_loads(out, tmp_path / "hf", files, dequantized, original, torch.bfloat16)


@pytest.mark.parametrize("scheme_name", ["ct-fp8-block128", "ct-mxfp8", "ct-nvfp4"])
def test_compressed_tensors_decompresses_a_pass_through_to_reshards_dequantization(
    tmp_path: Path, scheme_name: str
) -> None:
    """ScaledTensors of the scheme's format saved at TP2 -> export-hf --quantize ct-*: the data, scales (FP8:
    float32 scales exact in bfloat16 written in bfloat16, the dtype compressed-tensors keeps them in) and
    NVFP4's global scale are the saved values, and compressed-tensors' own decompression of every quantized
    module equals reshard's dequantization of the saved bytes."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    ckpt, _, quantized = _scaled_checkpoint(tmp_path, scheme_name)
    out = tmp_path / scheme_name
    _export(ckpt, out, scheme_name)
    files = _files(out)
    scheme = QUANT_SCHEMES[scheme_name]
    config = QuantizationConfig.model_validate(json.loads((out / "config.json").read_text())["quantization_config"])
    group = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    dequantized = _reshards_dequantization(quantized, scheme_name, ModelConfig.from_hf(tmp_path / "hf"))
    assert len(dequantized) == 2 * 7
    for name, expected in dequantized.items():
        base = name.removesuffix("weight")
        local = {k.removeprefix(base): v for k, v in files.items() if k.startswith(base) and "." not in k[len(base) :]}
        got = compressor.decompress(dict(local), group)["weight"]
        assert torch.equal(got, expected.to(got.dtype)), name
    fc2 = quantized["decoder.layers.0.mlp.fc2.weight"]
    name = "model.layers.0.mlp.down_proj."
    assert same_bytes(files[name + scheme.data_name], fc2.data)
    assert (
        torch.equal(files[name + scheme.scale_name].view(torch.uint8), fc2.scale.to(torch.bfloat16).view(torch.uint8))
        if fc2.scale.dtype == torch.float32
        else same_bytes(files[name + scheme.scale_name], fc2.scale)
    )
    if fc2.global_scale is not None:
        assert torch.equal(files[name + "weight_global_scale"], fc2.global_scale.reshape(1))


def test_pass_through_refusals_leave_nothing(tmp_path: Path) -> None:
    """Scales that bfloat16 cannot hold exactly (compressed-tensors would round them) are refused naming
    why; so are other blocks of the same format, and an export without --quantize (the data would be written
    without its scales), naming --quantize and the schemes of the format. Nothing is left at the outputs."""
    ckpt, _, _ = _scaled_checkpoint(tmp_path, "fp8-block128", exact_scales=False)
    with pytest.raises(reshard.MismatchError, match=r"cannot hold exactly in bfloat16 .*rounding it would change"):
        export_hf(ckpt, tmp_path / "rounded", quantize="ct-fp8-block128")
    with pytest.raises(reshard.MismatchError, match=r"format fp8_e4m3 with blocks \[128, 128\].*ct-fp8-channel writes "
                       r"blocks \[1, None\]: the blocks differ"):  # fmt: skip
        export_hf(ckpt, tmp_path / "channel", quantize="ct-fp8-channel")
    with pytest.raises(reshard.MismatchError, match=r"export it with --quantize fp8-block128 or ct-fp8-block128"):
        export_hf(ckpt, tmp_path / "plain")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf"]
