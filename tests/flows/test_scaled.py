"""Scaled tensors through save and load at another layout, on in-process ranks (issue 32, part A).

Data and scales are random bytes (any bit pattern, NaNs included): every comparison is of bytes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import MismatchError, ScaledTensor, ShardedTensor, ShardingError
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads

pytestmark = pytest.mark.unit

E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
FP4 = torch.float4_e2m1fn_x2


def random_bytes(*shape: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def on_ranks(world: int, run: Callable[[int, Any], Any]) -> list[Any]:
    group = ThreadGroup(world)
    return on_threads(world, lambda rank: run(rank, group.member(rank)), group=group)


def errors_on_ranks(world: int, run: Callable[[int, Any], Any]) -> list[BaseException | None]:
    """Each rank's exception (None: it returned)."""
    group = ThreadGroup(world)

    def guarded(rank: int) -> BaseException | None:
        try:
            run(rank, group.member(rank))
        except Exception as exc:  # collected for the test to compare
            return exc
        return None

    return on_threads(world, guarded)


# ---- an MoE layer: 4 experts of (512, 256) FP8 weights with 128x128 block scales ----------------------------

EXPERTS, ROWS, COLS, BLOCK = 4, 512, 256, 128
EXPERT_DATA = random_bytes(EXPERTS, ROWS, COLS, seed=1)
EXPERT_SCALE = torch.rand(EXPERTS, ROWS // BLOCK, COLS // BLOCK, generator=torch.Generator().manual_seed(2))


def expert_state(tp: int, ep: int, rank: int, *, fill: bool, replica: int = 0) -> dict[str, Any]:
    """Rank ``rank`` of TP ``tp`` x EP ``ep`` (TP fastest): its experts, each a key, rows split by TP."""
    tp_rank, ep_rank = rank % tp, rank // tp
    per_ep = EXPERTS // ep
    rows = ROWS // tp
    out: dict[str, Any] = {}
    for expert in range(ep_rank * per_ep, (ep_rank + 1) * per_ep):
        key = f"experts.{expert}.fc1.weight"
        data = EXPERT_DATA[expert, tp_rank * rows : (tp_rank + 1) * rows].clone()
        scale = EXPERT_SCALE[expert, tp_rank * rows // BLOCK : (tp_rank + 1) * rows // BLOCK].clone()
        if not fill:
            data.zero_()
            scale.zero_()
        sharded = ShardedTensor.from_rank_offsets(key, data.view(E4M3), (0, tp_rank, tp), replica_id=replica)
        out[key] = ScaledTensor(sharded, scale, "fp8_e4m3", (BLOCK, BLOCK))
    return out


def check_experts(state: dict[str, Any], tp: int, ep: int, rank: int) -> None:
    want = expert_state(tp, ep, rank, fill=True)
    assert state.keys() == want.keys()
    for key, leaf in state.items():
        assert same_bytes(leaf.data.data, want[key].data.data), key
        assert same_bytes(leaf.scale, want[key].scale), key


def test_fp8_block_scaled_experts_saved_at_tp2_ep2_load_at_tp4_ep1_bit_exact(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    on_ranks(4, lambda rank, g: reshard.save(expert_state(2, 2, rank, fill=True), path, group=g))
    metadata = reshard.read_metadata(path)
    assert metadata.format_version == 5
    record = metadata.scaled["experts.0.fc1.weight"]
    assert (record.format, record.block, record.scale_key) == ("fp8_e4m3", (128, 128), "experts.0.fc1.weight:scale")
    assert metadata.tensors["experts.0.fc1.weight:scale"].global_shape == (4, 2)

    def load(rank: int, g: Any) -> dict[str, Any]:
        template = expert_state(4, 1, rank, fill=False)
        result = reshard.load(template, path, group=g)
        assert result["experts.3.fc1.weight"] is template["experts.3.fc1.weight"]
        return template

    for rank, state in enumerate(on_ranks(4, load)):
        check_experts(state, 4, 1, rank)


def test_read_once_load_of_replicated_scaled_experts(tmp_path: Path) -> None:
    on_ranks(4, lambda rank, g: reshard.save(expert_state(2, 2, rank, fill=True), tmp_path, group=g))
    options = reshard.LoadOptions(read_once=True)

    def load(rank: int, g: Any) -> dict[str, Any]:
        # TP2 x EP1 x DP2: ranks 2 and 3 hold replicas of ranks 0 and 1
        template = expert_state(2, 1, rank % 2, fill=False, replica=rank // 2)
        reshard.load(template, tmp_path, group=g, options=options)
        return template

    for rank, state in enumerate(on_ranks(4, load)):
        check_experts(state, 2, 1, rank % 2)


# ---- fused QKV: [Q; K; V] of 128 rows each, 32x32 blocks, TP2 -> TP4 ----------------------------------------

QKV = random_bytes(384, 64, seed=3)
QKV_SCALE = torch.rand(12, 2, generator=torch.Generator().manual_seed(4))


def qkv_state(tp: int, rank: int, *, fill: bool) -> dict[str, Any]:
    rows = 128 // tp
    segments = [(part * 128 + rank * rows, rows) for part in range(3)]
    data = torch.cat([QKV[g : g + n] for g, n in segments])
    scale = torch.cat([QKV_SCALE[g // 32 : (g + n) // 32] for g, n in segments])
    if not fill:
        data, scale = torch.zeros_like(data), torch.zeros_like(scale)
    sharded = ShardedTensor.segmented("qkv", data.view(E4M3), (384, 64), 0, segments)
    return {"qkv": ScaledTensor(sharded, scale, "fp8_e4m3", (32, 32))}


def test_fused_qkv_scales_follow_their_segments_tp2_to_tp4(tmp_path: Path) -> None:
    on_ranks(2, lambda rank, g: reshard.save(qkv_state(2, rank, fill=True), tmp_path, group=g))
    loaded = on_ranks(4, lambda rank, g: reshard.load(qkv_state(4, rank, fill=False), tmp_path, group=g))
    for rank, state in enumerate(loaded):
        want = qkv_state(4, rank, fill=True)["qkv"]
        assert same_bytes(state["qkv"].data.data, want.data.data)
        assert torch.equal(state["qkv"].scale, want.scale)


# ---- padding: a vocabulary of 300 rows padded to 320, 16-row blocks, TP2 -> TP4 -----------------------------

VOCAB = random_bytes(320, 32, seed=5)
VOCAB_SCALE = torch.rand(20, 1, generator=torch.Generator().manual_seed(6))


def vocab_state(tp: int, rank: int, *, fill: bool) -> dict[str, Any]:
    rows = 320 // tp
    data = VOCAB[rank * rows : (rank + 1) * rows].clone()
    scale = VOCAB_SCALE[rank * rows // 16 : (rank + 1) * rows // 16].clone()
    if not fill:
        data.fill_(0x7F)  # not zero: the load must zero the padding
        scale.fill_(7.0)
    sharded = ShardedTensor.from_rank_offsets("emb", data.view(E4M3), (0, rank, tp), logical_shape=(300, 32))
    return {"emb": ScaledTensor(sharded, scale, "fp8_e4m3", (16, None))}


def test_padding_pads_scales_consistently_tp2_to_tp4(tmp_path: Path) -> None:
    on_ranks(2, lambda rank, g: reshard.save(vocab_state(2, rank, fill=True), tmp_path, group=g))
    metadata = reshard.read_metadata(tmp_path)
    assert metadata.tensors["emb"].global_shape == (300, 32)
    assert metadata.tensors["emb:scale"].global_shape == (19, 1)
    loaded = on_ranks(4, lambda rank, g: reshard.load(vocab_state(4, rank, fill=False), tmp_path, group=g))
    last = loaded[3]["emb"]  # rows [240, 320): real up to 300; scale cells [15, 20): real up to 19
    assert same_bytes(last.data.data[:60], VOCAB[240:300].view(E4M3))
    assert not last.data.data[60:].view(torch.uint8).any()
    assert torch.equal(last.scale[:4], VOCAB_SCALE[15:19]) and not last.scale[4:].any()
    assert torch.equal(loaded[0]["emb"].scale, VOCAB_SCALE[:5])


# ---- MXFP8 idempotence (Megatron-LM#6666): save at one layout, load at another, save again -----------------

MX = random_bytes(8, 256, seed=7)
MX_SCALE = random_bytes(8, 8, seed=8)


def mx_state(parts: int, axis: int, rank: int, *, fill: bool) -> dict[str, Any]:
    data = MX.chunk(parts, dim=axis)[rank].clone()
    scale = MX_SCALE.chunk(parts, dim=axis)[rank].clone()
    if not fill:
        data.zero_()
        scale.zero_()
    sharded = ShardedTensor.from_rank_offsets("w", data.view(E4M3), (axis, rank, parts))
    return {"w": ScaledTensor(sharded, scale.view(E8M0), "mxfp8_e4m3")}


def test_mxfp8_save_load_at_another_layout_save_again_is_idempotent(tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    on_ranks(2, lambda rank, g: reshard.save(mx_state(2, 1, rank, fill=True), first, group=g))

    def reshard_and_save(rank: int, g: Any) -> None:
        state = mx_state(4, 0, rank, fill=False)
        reshard.load(state, first, group=g)
        reshard.save(state, second, group=g)

    on_ranks(4, reshard_and_save)
    one, two = mx_state(1, 0, 0, fill=False), mx_state(1, 0, 0, fill=False)
    reshard.load(one, first)
    reshard.load(two, second)
    assert same_bytes(one["w"].data.data, two["w"].data.data) and same_bytes(one["w"].scale, two["w"].scale)
    assert same_bytes(one["w"].data.data, MX.view(E4M3)) and same_bytes(one["w"].scale, MX_SCALE.view(E8M0))
    assert reshard.read_metadata(first).scaled == reshard.read_metadata(second).scaled


# ---- MXFP4 saved from uint8 data, loaded in place into float4_e2m1fn_x2 data at another layout --------------


def test_mxfp4_loads_in_place_into_float4_and_e8m0_tensors(tmp_path: Path) -> None:
    data, scale = random_bytes(4, 64, seed=9), random_bytes(4, 4, seed=10)  # 128 elements per row: 4 blocks

    def save(rank: int, g: Any) -> None:
        sharded = ShardedTensor.from_rank_offsets("w4", data.chunk(2, 1)[rank].clone(), (1, rank, 2))
        reshard.save({"w4": ScaledTensor(sharded, scale.chunk(2, 1)[rank].clone(), "mxfp4")}, tmp_path, group=g)

    on_ranks(2, save)
    target = torch.zeros(2, 64, dtype=FP4)
    target_scale = torch.zeros(2, 4, dtype=E8M0)
    pointers = (target.data_ptr(), target_scale.data_ptr())

    def load(rank: int, g: Any) -> None:
        if rank == 1:
            sharded = ShardedTensor.from_rank_offsets("w4", target, (0, 1, 2))
            reshard.load({"w4": ScaledTensor(sharded, target_scale, "mxfp4")}, tmp_path, group=g)
        else:
            sharded = ShardedTensor.from_rank_offsets("w4", torch.zeros(2, 64, dtype=FP4), (0, 0, 2))
            reshard.load({"w4": ScaledTensor(sharded, torch.zeros(2, 4, dtype=E8M0), "mxfp4")}, tmp_path, group=g)

    on_ranks(2, load)
    assert (target.data_ptr(), target_scale.data_ptr()) == pointers
    assert torch.equal(target.view(torch.uint8), data[2:]) and torch.equal(target_scale.view(torch.uint8), scale[2:])


# ---- refusals ------------------------------------------------------------------------------------------------


def test_a_template_whose_split_cuts_a_block_is_refused() -> None:
    # TP8 would give 64-row shards of 128-row blocks: the template cannot be described
    sharded = ShardedTensor.from_rank_offsets("experts.0.fc1.weight", torch.zeros(64, COLS, dtype=E4M3), (0, 1, 8))
    with pytest.raises(ShardingError, match=r"'experts\.0\.fc1\.weight'.*axis 0.*block of 128"):
        ScaledTensor(sharded, torch.ones(1, 2), "fp8_e4m3", (128, 128))


def _refused_load(path: Path, template: Callable[[int], dict[str, Any]], match: str) -> None:
    errors = errors_on_ranks(2, lambda rank, g: reshard.load(template(rank), path, group=g))
    assert all(isinstance(e, MismatchError) for e in errors), errors
    assert any(re.search(match, str(e)) for e in errors), errors


def test_plain_template_of_a_scaled_key_is_refused(tmp_path: Path) -> None:
    on_ranks(2, lambda rank, g: reshard.save(qkv_state(2, rank, fill=True), tmp_path, group=g))

    def plain(rank: int) -> dict[str, Any]:
        return {"qkv": qkv_state(2, rank, fill=False)["qkv"].data}

    _refused_load(tmp_path, plain, r"'qkv'.*checkpoint holds a scaled tensor of format fp8_e4m3.*template a plain")


def test_other_block_or_format_is_refused_naming_both(tmp_path: Path) -> None:
    on_ranks(2, lambda rank, g: reshard.save(qkv_state(2, rank, fill=True), tmp_path, group=g))

    def other_block(rank: int) -> dict[str, Any]:
        leaf = qkv_state(2, rank, fill=False)["qkv"]
        return {"qkv": ScaledTensor(leaf.data, torch.zeros(leaf.scale.shape[0] // 2, 1), "fp8_e4m3", (64, 64))}

    _refused_load(tmp_path, other_block, r"blocks \[32, 32\].*template format fp8_e4m3 with blocks \[64, None\]")

    def other_format(rank: int) -> dict[str, Any]:
        leaf = qkv_state(2, rank, fill=False)["qkv"]
        data = ShardedTensor.segmented(
            "qkv", leaf.data.data.view(torch.float8_e5m2), (384, 64), 0, leaf.data.segments or ()
        )
        return {"qkv": ScaledTensor(data, leaf.scale, "fp8_e5m2", (32, 32))}

    _refused_load(tmp_path, other_format, r"checkpoint holds format fp8_e4m3.*template format fp8_e5m2")


def test_scaled_template_of_a_plain_key_is_refused(tmp_path: Path) -> None:
    reshard.save({"qkv": QKV.view(E4M3).clone()}, tmp_path)
    _refused_load(tmp_path, lambda rank: qkv_state(2, rank, fill=False), r"'qkv'.*holds a plain tensor.*ScaledTensor")


def test_ranks_that_disagree_on_the_block_fail_with_one_error_class_on_every_rank(tmp_path: Path) -> None:
    def save(rank: int, g: Any) -> None:
        data = ShardedTensor.from_rank_offsets("w", torch.zeros(128, 64, dtype=E4M3), (0, rank, 2))
        block = (128, None) if rank == 0 else (64, None)
        reshard.save({"w": ScaledTensor(data, torch.ones(128 // block[0], 1), "fp8_e4m3", block)}, tmp_path, group=g)

    errors = errors_on_ranks(2, save)
    assert all(isinstance(e, ShardingError) for e in errors), errors
    assert "'w' is described differently" in str(errors[0])
    assert not (tmp_path / "metadata.json").exists()
