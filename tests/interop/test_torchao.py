"""torchao 0.18's Float8Tensor, MXTensor and NVFP4Tensor saved at TP2 and loaded at TP4 and TP1 through
reshard.interop.torchao, on in-process ranks, with the real package on CPU (issue 32, part C).

The weights are quantized by torchao's own ``quantize_`` configs. Float8's dynamic-activation config refuses
to run without a GPU (``_check_hardware_support``, a check of the matmul's hardware only): the test lifts that
check and runs the rest of ``quantize_`` (``Float8Tensor.from_hp`` runs on CPU). NVFP4's dynamic-activation
config needs an sm100 GPU to quantize; its weight-only config gives the same weight tensor and runs on CPU.
A rank's TP shard is torchao's own slice of the globally quantized weight (``full[rows]``, ``full[:, cols]``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import MismatchError, ShardingError
from reshard.net.transports import ThreadGroup
from reshard.state.lowprec import Block
from tests.threads import on_threads

torchao = pytest.importorskip("torchao")

from torchao.prototype.mx_formats import (  # noqa: E402
    MXDynamicActivationMXWeightConfig,
    NVFP4WeightOnlyConfig,
)
from torchao.quantization import (  # noqa: E402
    Float8DynamicActivationFloat8WeightConfig,
    PerBlock,
    PerRow,
    quantize_,
)

from reshard.interop.torchao import TorchaoShard, torchao_state, torchao_to_scaled  # noqa: E402

pytestmark = pytest.mark.dist

# A column-parallel Linear (weight (512, 256), rows split) and a row-parallel one (weight (256, 512), columns split).
SHAPES = {"col.weight": (512, 256), "row.weight": (256, 512)}
AXIS = {"col.weight": 0, "row.weight": 1}


def config(kind: str) -> Any:
    if kind == "fp8_row":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    if kind == "fp8_block":
        return Float8DynamicActivationFloat8WeightConfig(granularity=(PerBlock([1, 128]), PerBlock([128, 128])))
    if kind == "mxfp8":
        return MXDynamicActivationMXWeightConfig()
    return NVFP4WeightOnlyConfig()


BLOCKS: dict[str, Block | None] = {"fp8_row": (1, None), "fp8_block": (128, 128), "mxfp8": None, "nvfp4": None}


def quantized_model(kind: str, seed: int) -> dict[str, Any]:
    """The torchao tensors of a tiny model whose Linear weights ``quantize_`` turned into ``kind``."""
    torch.manual_seed(seed)
    linears = {
        name.split(".")[0]: torch.nn.Linear(s[1], s[0], bias=False, dtype=torch.bfloat16) for name, s in SHAPES.items()
    }
    model = torch.nn.ModuleDict(linears)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda granularity: None)
        quantize_(model, config(kind))
    return dict(model.state_dict())


def shard(full: Any, key: str, tp: int, rank: int) -> Any:
    """Rank ``rank``'s TP slice of ``full`` (torchao's own slicing)."""
    n = SHAPES[key][AXIS[key]] // tp
    return full[rank * n : (rank + 1) * n] if AXIS[key] == 0 else full[:, rank * n : (rank + 1) * n]


def tp_state(tensors: dict[str, Any], kind: str, tp: int, rank: int, keys: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in keys:
        offset = [0, 0]
        offset[AXIS[key]] = rank * SHAPES[key][AXIS[key]] // tp
        out[key] = TorchaoShard(shard(tensors[key], key, tp, rank), SHAPES[key], tuple(offset), BLOCKS[kind])
    return out


def on_ranks(world: int, run: Callable[[int, Any], Any]) -> list[Any]:
    group = ThreadGroup(world)
    return on_threads(world, lambda rank: run(rank, group.member(rank)), group=group)


def save_tp2(kind: str, path: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    source = quantized_model(kind, seed=1)

    def save(rank: int, group: Any) -> None:
        with torchao_state(tp_state(source, kind, 2, rank, keys)) as state:
            reshard.save(state, path, group=group)

    on_ranks(2, save)
    return source


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bytes_of(a), bytes_of(b))


def keys_of(kind: str) -> tuple[str, ...]:
    # torchao cannot slice an MXTensor with swizzled scales along its last axis: column-parallel only.
    return ("col.weight",) if kind == "mxfp8" else tuple(SHAPES)


@pytest.mark.parametrize("kind", ["fp8_row", "fp8_block", "mxfp8", "nvfp4"])
def test_saved_at_tp2_loads_at_tp4_and_tp1_bit_exact(tmp_path: Path, kind: str) -> None:
    keys = keys_of(kind)
    source = save_tp2(kind, tmp_path / "ckpt", keys)
    for tp in (4, 1):
        template = quantized_model(kind, seed=2)
        states = [tp_state(template, kind, tp, rank, keys) for rank in range(tp)]

        def load(rank: int, group: Any, states: list[dict[str, Any]] = states) -> None:
            with torchao_state(states[rank]) as state:
                reshard.load(state, tmp_path / "ckpt", group=group)

        on_ranks(tp, load)
        for rank, state in enumerate(states):
            for key in keys:
                got, want = state[key].tensor, shard(source[key], key, tp, rank)
                assert same_bytes(got.qdata, want.qdata), (kind, tp, rank, key)
                assert same_bytes(got.scale, want.scale), (kind, tp, rank, key)
                if kind == "nvfp4":
                    assert same_bytes(got.per_tensor_scale, want.per_tensor_scale)
                assert torch.equal(got.dequantize(), want.dequantize())


def test_whole_tensors_round_trip_on_one_rank(tmp_path: Path) -> None:
    """A model's state dict as is (every torchao tensor whole), swizzled MX scales written back after the load."""
    source = quantized_model("mxfp8", seed=1)
    with torchao_state(source) as state:
        reshard.save(state, tmp_path / "ckpt")
    template = quantized_model("mxfp8", seed=2)
    assert not same_bytes(template["col.weight"].scale, source["col.weight"].scale)
    with torchao_state(template) as state:
        reshard.load(state, tmp_path / "ckpt")
    for key in SHAPES:
        assert same_bytes(template[key].qdata, source[key].qdata)
        assert same_bytes(template[key].scale, source[key].scale)


@pytest.mark.parametrize(("saved", "loaded"), [("fp8_row", "fp8_block"), ("mxfp8", "nvfp4"), ("nvfp4", "mxfp8")])
def test_other_granularity_or_format_is_refused(tmp_path: Path, saved: str, loaded: str) -> None:
    save_tp2(saved, tmp_path / "ckpt", ("col.weight",))
    template = quantized_model(loaded, seed=2)
    errors: list[BaseException] = []

    def load(rank: int, group: Any) -> None:
        try:
            with torchao_state(tp_state(template, loaded, 2, rank, ("col.weight",))) as state:
                reshard.load(state, tmp_path / "ckpt", group=group)
        except MismatchError as exc:
            errors.append(exc)

    on_ranks(2, load)
    assert len(errors) == 2 and "col.weight" in str(errors[0])


def test_a_slice_that_does_not_show_its_block_needs_one() -> None:
    """A 128-row slice of a weight with 128x128 blocks holds one scale on axis 0, as a slice of a weight scaled
    by the whole axis would: reshard refuses to guess, and takes the block when given."""
    full = quantized_model("fp8_block", seed=1)["col.weight"]
    with pytest.raises(ShardingError, match="TorchaoShard\\(block="):
        torchao_to_scaled("w", TorchaoShard(full[:128], (512, 256), (0, 0)))
    scaled = torchao_to_scaled("w", TorchaoShard(full[:128], (512, 256), (0, 0), (128, 128)))
    assert scaled.block == (128, 128) and scaled.scale_sharded.global_shape == (4, 2)


def test_swizzled_scales_outside_torchao_state_are_refused() -> None:
    full = quantized_model("mxfp8", seed=1)["col.weight"]
    assert full.is_swizzled_scales
    with pytest.raises(ShardingError, match="swizzled"):
        torchao_to_scaled("w", full)


@pytest.mark.parametrize("kind", ["fp8_row", "mxfp8", "nvfp4"])
def test_a_torchao_tensor_given_as_is_is_refused(tmp_path: Path, kind: str) -> None:
    """Without torchao_state a torchao tensor is no plain tensor: reshard says so instead of saving what
    torchao's dispatch makes of it (or failing inside a read)."""
    source = quantized_model(kind, seed=1)
    with pytest.raises(reshard.StateDictError, match="torchao_state"):
        reshard.save(source, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    with torchao_state(source) as state:
        reshard.save(state, tmp_path / "ckpt")
    template = quantized_model(kind, seed=2)
    before = bytes_of(template["col.weight"].qdata).clone()
    with pytest.raises(reshard.StateDictError, match="torchao_state"):
        reshard.load(template, tmp_path / "ckpt")
    assert torch.equal(bytes_of(template["col.weight"].qdata), before)
