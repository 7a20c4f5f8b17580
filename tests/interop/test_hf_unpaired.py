"""Issue 32, the outside attack (S6): a Hugging Face directory holding a one-byte tensor (FP8 data, packed FP4
bytes) beside a scale tensor of its name, with no quantization_config naming the pair, is refused naming both,
``allow_unused`` or not (was: the data loaded without its scale under ``allow_unused=True``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import reshard
from reshard.interop import HuggingFaceSource
from reshard.state.quantize import quantize

pytestmark = pytest.mark.unit

FP8 = quantize(torch.randn(256, 128, generator=torch.Generator().manual_seed(0)) * 50, "fp8_e4m3", block=(128, 128))
MX = quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(1)), "mxfp4")
CT_MXFP4_IGNORED = {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "ignore": ["re:proj"],
        "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "group_size": 32}}},
    }
}


def _directory(tmp: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None) -> Path:
    tmp.mkdir()
    save_file(tensors, str(tmp / "model.safetensors"))
    if config is not None:
        (tmp / "config.json").write_text(json.dumps(config))
    return tmp


@pytest.mark.parametrize("allow_unused", [False, True])
@pytest.mark.parametrize(
    "case",
    ["fp8 weight_scale_inv, no quantization_config", "fp8 weight_scale, no config.json", "mxfp4 packed, ignored"],
)
def test_a_one_byte_tensor_beside_its_scale_without_a_config_naming_the_pair_is_refused(
    tmp_path: Path, case: str, allow_unused: bool
) -> None:
    if case.startswith("fp8"):
        scale = "proj.weight_scale_inv" if "inv" in case else "proj.weight_scale"
        tensors, data = {"proj.weight": FP8.data, scale: FP8.scale}, "proj.weight"
        config = {"model_type": "llama"} if "inv" in case else None
        template: dict[str, Any] = {"x": torch.zeros(256, 128, dtype=torch.bfloat16)}
        options = reshard.LoadOptions(allow_dtype_cast=True)
    else:
        tensors, data, scale = (
            {"proj.weight_packed": MX.data, "proj.weight_scale": MX.scale.view(torch.uint8)},
            "proj.weight_packed",
            "proj.weight_scale",
        )
        config = CT_MXFP4_IGNORED
        template, options = {"x": torch.zeros(4, 32, dtype=torch.uint8)}, reshard.LoadOptions()
    source = HuggingFaceSource(_directory(tmp_path / "hf", tensors, config), {"x": data}, allow_unused=allow_unused)
    with pytest.raises(reshard.CorruptCheckpointError) as caught:
        reshard.load(template, source, options=options)
    assert repr(data) in str(caught.value) and repr(scale) in str(caught.value), caught.value


def test_a_plain_weight_beside_an_unrelated_scale_name_still_loads(tmp_path: Path) -> None:
    """A bfloat16 weight is not low precision: a ``weight_scale`` beside it (a LayerScale, say) is no pair."""
    weight = torch.randn(4, 8).to(torch.bfloat16)
    hf = _directory(tmp_path / "hf", {"proj.weight": weight, "proj.weight_scale": torch.ones(4)}, None)
    out = reshard.load(
        {"proj.weight": torch.zeros(4, 8, dtype=torch.bfloat16)}, HuggingFaceSource(hf, allow_unused=True)
    )
    assert torch.equal(out["proj.weight"], weight)
