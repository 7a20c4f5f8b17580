"""Low-precision (data, scale) pairs of Hugging Face checkpoints loaded as ScaledTensors (issue 32, item 2).

The checkpoints are written here with the ``safetensors`` package, in the tensor names and ``config.json`` of
transformers' FineGrainedFP8 (DeepSeek-V3: ``weight_scale_inv``) and of compressed-tensors (``weight_scale``,
``weight_packed``, ``weight_global_scale``); data and scales are random bytes of the right dtypes, so every
comparison is of bytes. Loads run on in-process ranks (ThreadGroup) at TP1/TP2/TP4.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import reshard
from reshard import CorruptCheckpointError, MismatchError, ScaledTensor, ShardedTensor
from reshard.interop import HuggingFaceSource
from reshard.interop.hf_source import Concat, Stack
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads

pytestmark = pytest.mark.unit

E4M3 = torch.float8_e4m3fn
HIDDEN, BLOCK, EXPERTS = 64, 16, 4
PROJ = ("q_proj", "k_proj", "v_proj")


def random_bytes(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def random_scales(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def on_ranks(world: int, run: Callable[[int, Any], Any]) -> list[Any]:
    group = ThreadGroup(world)
    return on_threads(world, lambda rank: run(rank, group.member(rank)), group=group)


def write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], quantization: dict[str, Any] | None) -> Path:
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN}
    if quantization is not None:
        config["quantization_config"] = quantization
    (path / "config.json").write_text(json.dumps(config))
    return path


FINE_GRAINED = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
    "modules_to_not_convert": ["lm_head"],
}


def fine_grained_tensors(
    scale_dtype: torch.dtype = torch.float32, scale_suffix: str = "weight_scale_inv"
) -> dict[str, torch.Tensor]:
    """One layer of a DeepSeek-style FP8 checkpoint: q/k/v (64 x 64) and 4 experts' w1 (64 x 64), each FP8 with
    one scale per 16 x 16 block, and a bf16 norm."""
    out: dict[str, torch.Tensor] = {"model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    modules = [f"model.layers.0.self_attn.{p}" for p in PROJ]
    modules += [f"model.layers.0.mlp.experts.{e}.w1" for e in range(EXPERTS)]
    for seed, module in enumerate(modules):
        out[f"{module}.weight"] = random_bytes(HIDDEN, HIDDEN, seed=seed).view(E4M3)
        out[f"{module}.{scale_suffix}"] = random_scales(
            HIDDEN // BLOCK, HIDDEN // BLOCK, seed=100 + seed, dtype=scale_dtype
        )
    return out


KEY_MAP = {
    "qkv": Concat(*(f"model.layers.0.self_attn.{p}.weight" for p in PROJ)),
    "experts.w1": Stack(*(f"model.layers.0.mlp.experts.{e}.w1.weight" for e in range(EXPERTS))),
    "norm": "model.norm.weight",
}


def fp8_template(tp: int, rank: int) -> dict[str, Any]:
    """Rank ``rank`` of TP ``tp``: its rows of each of q, k and v (a segmented fused QKV) and its rows of every
    expert's w1, as FP8 ScaledTensors with 16 x 16 blocks (zeros, to be filled)."""
    n = HIDDEN // tp
    segments = [(i * HIDDEN + rank * n, n) for i in range(3)]
    qkv = ShardedTensor.segmented("qkv", torch.zeros(3 * n, HIDDEN, dtype=E4M3), (3 * HIDDEN, HIDDEN), 0, segments)
    w1 = ShardedTensor.from_rank_offsets("experts.w1", torch.zeros(EXPERTS, n, HIDDEN, dtype=E4M3), (1, rank, tp))
    return {
        "qkv": ScaledTensor(qkv, torch.zeros(3 * n // BLOCK, HIDDEN // BLOCK), "fp8_e4m3", (BLOCK, BLOCK)),
        "experts.w1": ScaledTensor(
            w1, torch.zeros(EXPERTS, n // BLOCK, HIDDEN // BLOCK), "fp8_e4m3", (1, BLOCK, BLOCK)
        ),
        "norm": torch.zeros(HIDDEN, dtype=torch.bfloat16),
    }


def expected_fp8(files: dict[str, torch.Tensor], tp: int, rank: int, suffix: str) -> dict[str, torch.Tensor]:
    """What rank ``rank`` of TP ``tp`` must hold: slices of the files' tensors (scales widened to float32)."""
    rows = slice(rank * HIDDEN // tp, (rank + 1) * HIDDEN // tp)
    cells = slice(rows.start // BLOCK, rows.stop // BLOCK)
    attn = [f"model.layers.0.self_attn.{p}" for p in PROJ]
    experts = [f"model.layers.0.mlp.experts.{e}.w1" for e in range(EXPERTS)]
    return {
        "qkv": torch.cat([files[f"{m}.weight"][rows] for m in attn]),
        "qkv:scale": torch.cat([files[f"{m}.{suffix}"][cells] for m in attn]).float(),
        "experts.w1": torch.stack([files[f"{m}.weight"][rows] for m in experts]),
        "experts.w1:scale": torch.stack([files[f"{m}.{suffix}"][cells] for m in experts]).float(),
    }


def load_on_ranks(path: Path, tp: int, template: Callable[[int, int], dict[str, Any]], key_map: Any) -> list[Any]:
    return on_ranks(tp, lambda rank, g: reshard.load(template(tp, rank), HuggingFaceSource(path, key_map), group=g))


def check_fp8(loaded: list[dict[str, Any]], files: dict[str, torch.Tensor], tp: int, suffix: str) -> None:
    for rank, state in enumerate(loaded):
        want = expected_fp8(files, tp, rank, suffix)
        for key in ("qkv", "experts.w1"):
            assert same_bytes(state[key].data.data, want[key]), (tp, rank, key)
            assert same_bytes(state[key].scale, want[key + ":scale"]), (tp, rank, key)
        assert torch.equal(state["norm"], files["model.norm.weight"])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fine_grained_fp8_loads_as_scaled_tensors_at_any_tp(tmp_path: Path, tp: int) -> None:
    files = fine_grained_tensors()
    path = write_checkpoint(tmp_path / "hf", files, FINE_GRAINED)
    check_fp8(load_on_ranks(path, tp, fp8_template, KEY_MAP), files, tp, "weight_scale_inv")


COMPRESSED_FP8_BLOCK = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "block",
                "group_size": None,
                "block_structure": [BLOCK, BLOCK],
                "dynamic": False,
            },
            "input_activations": None,
            "format": "float-quantized",
        }
    },
    "ignore": ["lm_head"],
}


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compressed_tensors_fp8_block_scales_in_the_model_dtype_load_widened_exactly(
    tmp_path: Path, scale_dtype: torch.dtype
) -> None:
    files = fine_grained_tensors(scale_dtype, "weight_scale")
    path = write_checkpoint(tmp_path / "hf", files, COMPRESSED_FP8_BLOCK)
    check_fp8(load_on_ranks(path, 2, fp8_template, KEY_MAP), files, 2, "weight_scale")


def ct_config(fmt: str, bits: int, group: int, strategy: str, scale_dtype: str | None) -> dict[str, Any]:
    weights = {"num_bits": bits, "type": "float", "symmetric": True, "strategy": strategy, "group_size": group}
    weights.update({"dynamic": False, "scale_dtype": scale_dtype})
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": fmt}},
        "ignore": ["lm_head"],
    }


NVFP4 = ct_config("nvfp4-pack-quantized", 4, 16, "tensor_group", "torch.float8_e4m3fn")
MXFP4 = ct_config("mxfp4-pack-quantized", 4, 32, "group", "torch.uint8")
MXFP8 = ct_config("mxfp8-quantized", 8, 32, "group", "torch.uint8")


def packed_tensors(fmt: str, *, same_global: bool = True) -> dict[str, torch.Tensor]:
    """q/k/v (64 x 64 logical) in a compressed-tensors format: NVFP4 or MXFP4 packed two to a byte
    (``weight_packed`` 64 x 32), MXFP8 (``weight`` E4M3); scales per 16 (NVFP4, E4M3) or 32 (MX, E8M0 bits)."""
    group = 16 if fmt == "nvfp4_divisor" else 32
    out: dict[str, torch.Tensor] = {}
    for seed, proj in enumerate(PROJ):
        module = f"model.layers.0.self_attn.{proj}"
        if fmt == "mxfp8_e4m3":
            out[f"{module}.weight"] = random_bytes(HIDDEN, HIDDEN, seed=seed).view(E4M3)
        else:
            out[f"{module}.weight_packed"] = random_bytes(HIDDEN, HIDDEN // 2, seed=seed)
        scale = random_bytes(HIDDEN, HIDDEN // group, seed=50 + seed)
        out[f"{module}.weight_scale"] = scale.view(E4M3) if fmt == "nvfp4_divisor" else scale
        if fmt == "nvfp4_divisor":
            out[f"{module}.weight_global_scale"] = torch.tensor([448.0 * 6 / (1.5 if same_global else 1 + seed)])
    return out


def packed_template(fmt: str) -> Callable[[int, int], dict[str, Any]]:
    group = 16 if fmt == "nvfp4_divisor" else 32
    per_byte = 1 if fmt == "mxfp8_e4m3" else 2
    dtype = E4M3 if fmt == "mxfp8_e4m3" else torch.float4_e2m1fn_x2
    scale_dtype = E4M3 if fmt == "nvfp4_divisor" else torch.float8_e8m0fnu

    def template(tp: int, rank: int) -> dict[str, Any]:
        n = HIDDEN // tp
        segments = [(i * HIDDEN + rank * n, n) for i in range(3)]
        data = torch.zeros(3 * n, HIDDEN // per_byte, dtype=torch.uint8).view(dtype)
        qkv = ShardedTensor.segmented("qkv", data, (3 * HIDDEN, HIDDEN // per_byte), 0, segments)
        scale = torch.zeros(3 * n, HIDDEN // group, dtype=torch.uint8).view(scale_dtype)
        glob = torch.zeros((), dtype=torch.float32) if fmt == "nvfp4_divisor" else None
        return {"qkv": ScaledTensor(qkv, scale, fmt, global_scale=glob)}

    return template


QKV_MAP = {"qkv": Concat(*(f"model.layers.0.self_attn.{p}.weight" for p in PROJ))}


@pytest.mark.parametrize(("fmt", "config"), [("nvfp4_divisor", NVFP4), ("mxfp4", MXFP4), ("mxfp8_e4m3", MXFP8)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_compressed_tensors_packed_and_mx_formats_load_at_any_tp(
    tmp_path: Path, fmt: str, config: dict[str, Any], tp: int
) -> None:
    files = packed_tensors(fmt)
    path = write_checkpoint(tmp_path / "hf", files, config)
    loaded = load_on_ranks(path, tp, packed_template(fmt), QKV_MAP)
    data_name = "weight" if fmt == "mxfp8_e4m3" else "weight_packed"
    for rank, state in enumerate(loaded):
        rows = slice(rank * HIDDEN // tp, (rank + 1) * HIDDEN // tp)
        modules = [f"model.layers.0.self_attn.{p}" for p in PROJ]
        data = torch.cat([files[f"{m}.{data_name}"][rows] for m in modules])
        scale = torch.cat([files[f"{m}.weight_scale"][rows] for m in modules])
        assert same_bytes(state["qkv"].data.data.view(torch.uint8), data.view(torch.uint8)), (tp, rank)
        assert same_bytes(state["qkv"].scale.view(torch.uint8), scale.view(torch.uint8)), (tp, rank)
        if fmt == "nvfp4_divisor":
            assert same_bytes(state["qkv"].global_scale, files[f"{modules[0]}.weight_global_scale"].view(()))


# ---- refusals ----------------------------------------------------------------------------------------------


def test_a_plain_template_of_a_pair_is_refused_data_without_its_scales(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "hf", fine_grained_tensors(), FINE_GRAINED)
    name = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(MismatchError, match="without its scales"):
        reshard.load(
            {"q": torch.zeros(HIDDEN, HIDDEN, dtype=E4M3)}, HuggingFaceSource(path, {"q": name}, allow_unused=True)
        )
    with pytest.raises(MismatchError, match="without its scales"):  # under its own name, as a float32 cast
        reshard.load({name: torch.zeros(HIDDEN, HIDDEN)}, HuggingFaceSource(path, allow_unused=True))


def test_fp8_without_its_scale_in_a_quantized_checkpoint_is_an_error_naming_it(tmp_path: Path) -> None:
    files = fine_grained_tensors()
    del files["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    path = write_checkpoint(tmp_path / "hf", files, FINE_GRAINED)
    template = {"norm": torch.zeros(HIDDEN, dtype=torch.bfloat16)}
    with pytest.raises(CorruptCheckpointError, match=r"k_proj\.weight"):
        reshard.load(template, HuggingFaceSource(path, {"norm": "model.norm.weight"}, allow_unused=True))


def test_one_byte_tensors_without_a_quantization_config_stay_plain(tmp_path: Path) -> None:
    """No config names a quantization: a uint8 tensor is bytes, loaded as they are (never read as FP8)."""
    raw = random_bytes(HIDDEN, HIDDEN, seed=9)
    path = write_checkpoint(tmp_path / "hf", {"layers.0.mask": raw, "layers.0.weight_scale": torch.ones(4)}, None)
    loaded = reshard.load({"layers.0.mask": torch.zeros_like(raw)}, HuggingFaceSource(path, allow_unused=True))
    assert torch.equal(loaded["layers.0.mask"], raw)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda f, c: f.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(4, 5)}), "scale grid"),
        (
            lambda f, c: f.update(
                {"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(4, 4, dtype=torch.int32)}
            ),
            "not the data and scales",
        ),
        (lambda f, c: c.update({"weight_block_size": [16, -1]}), "two positive integers"),
        (lambda f, c: c.update({"fmt": "e3m4"}), "fmt"),
        (lambda f, c: c.update({"quant_method": 7}), "quant_method"),
    ],
)
def test_hostile_or_inconsistent_config_and_tensors_are_corrupt_checkpoints(
    tmp_path: Path, change: Callable[[dict[str, Any], dict[str, Any]], None], match: str
) -> None:
    files, config = fine_grained_tensors(), dict(FINE_GRAINED)
    change(files, config)
    path = write_checkpoint(tmp_path / "hf", files, config)
    with pytest.raises(CorruptCheckpointError, match=match):
        reshard.load(
            {"norm": torch.zeros(HIDDEN, dtype=torch.bfloat16)}, HuggingFaceSource(path, KEY_MAP, allow_unused=True)
        )


def test_config_that_is_not_json_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "hf", fine_grained_tensors(), FINE_GRAINED)
    (path / "config.json").write_text('{"quantization_config": ')
    with pytest.raises(CorruptCheckpointError, match=r"config\.json"):
        reshard.load(
            {"norm": torch.zeros(HIDDEN, dtype=torch.bfloat16)}, HuggingFaceSource(path, KEY_MAP, allow_unused=True)
        )


def test_fused_parts_with_different_global_scales_are_refused(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "hf", packed_tensors("nvfp4_divisor", same_global=False), NVFP4)
    with pytest.raises(MismatchError, match="different global scales"):
        reshard.load(packed_template("nvfp4_divisor")(1, 0), HuggingFaceSource(path, QKV_MAP))


def test_a_fused_part_that_cuts_a_block_is_refused(tmp_path: Path) -> None:
    files = fine_grained_tensors()
    files["model.layers.0.self_attn.q_proj.weight"] = random_bytes(24, HIDDEN, seed=3).view(E4M3)
    files["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(2, 4)
    path = write_checkpoint(tmp_path / "hf", files, FINE_GRAINED)
    with pytest.raises(MismatchError, match="inside a block of 16"):
        reshard.load(fp8_template(1, 0), HuggingFaceSource(path, KEY_MAP))


def test_a_scaled_template_of_another_block_is_refused(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "hf", fine_grained_tensors(), FINE_GRAINED)
    data = ShardedTensor("q", torch.zeros(HIDDEN, HIDDEN, dtype=E4M3), (HIDDEN, HIDDEN), (0, 0))
    template = {"q": ScaledTensor(data, torch.zeros(2, 2), "fp8_e4m3", (32, 32))}
    with pytest.raises(MismatchError, match=r"blocks \[16, 16\]"):
        reshard.load(
            template, HuggingFaceSource(path, {"q": "model.layers.0.self_attn.q_proj.weight"}, allow_unused=True)
        )
