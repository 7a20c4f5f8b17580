"""Every flow carries scaled tensors (issue 32, part A): async_save, CheckpointManager, reshard.transfer,
TransferSession, and the command line's ls / validate / diff / inspect on a checkpoint holding them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import MismatchError, ScaledTensor, ShardedTensor
from reshard.cli import main
from reshard.flows.manager import step_name
from tests.flows.test_scaled import (
    E4M3,
    E8M0,
    EXPERT_DATA,
    EXPERT_SCALE,
    FP4,
    errors_on_ranks,
    expert_state,
    on_ranks,
    random_bytes,
    same_bytes,
)

pytestmark = pytest.mark.unit

NV = random_bytes(8, 32, seed=11)  # nvfp4: 64 elements per row, 4 blocks of 16
NV_SCALE = random_bytes(8, 4, seed=12)
NV_GLOBAL = torch.tensor(0.37)


def nv_state(parts: int, axis: int, rank: int, *, fill: bool, fp4: bool = False) -> dict[str, Any]:
    data = NV.chunk(parts, dim=axis)[rank].clone()
    scale = NV_SCALE.chunk(parts, dim=axis)[rank].clone()
    glob = NV_GLOBAL.clone().reshape(1)
    if not fill:
        data.zero_()
        scale.zero_()
        glob.zero_()
    sharded = ShardedTensor.from_rank_offsets("nv", data.view(FP4) if fp4 else data, (axis, rank, parts))
    return {"nv": ScaledTensor(sharded, scale.view(E4M3), "nvfp4", global_scale=glob)}


def check_nv(state: dict[str, Any], parts: int, axis: int, rank: int) -> None:
    got, want = state["nv"], nv_state(parts, axis, rank, fill=True)["nv"]
    assert same_bytes(got.data.data, want.data.data) and same_bytes(got.scale, want.scale)
    assert torch.equal(got.global_scale, want.global_scale)


def test_async_save_snapshots_scaled_tensors(tmp_path: Path) -> None:
    def save(rank: int, g: Any) -> None:
        state = nv_state(2, 1, rank, fill=True, fp4=True)
        checkpointer = reshard.AsyncCheckpointer(group=g)
        handle = checkpointer.save(state, tmp_path)
        handle.wait_snapshot()
        leaf = state["nv"]
        leaf.data.data.view(torch.uint8).zero_()  # after the snapshot: the checkpoint keeps the old bytes
        leaf.scale.view(torch.uint8).zero_()
        leaf.global_scale.zero_()
        checkpointer.wait()

    on_ranks(2, save)
    loaded = on_ranks(4, lambda rank, g: reshard.load(nv_state(4, 0, rank, fill=False), tmp_path, group=g))
    for rank, state in enumerate(loaded):
        check_nv(state, 4, 0, rank)


def test_checkpoint_manager_saves_and_loads_scaled_tensors(tmp_path: Path) -> None:
    def run(rank: int, g: Any) -> None:
        manager = reshard.CheckpointManager(tmp_path, group=g, incremental=True)
        manager.save(1, expert_state(2, 2, rank, fill=True))
        manager.save(2, expert_state(2, 2, rank, fill=True))  # incremental: references step 1's boxes

    on_ranks(4, run)

    def load(rank: int, g: Any) -> dict[str, Any]:
        template = expert_state(4, 1, rank, fill=False)
        assert reshard.CheckpointManager(tmp_path, group=g).load_latest(template) == 2
        return template

    for rank, state in enumerate(on_ranks(4, load)):
        want = expert_state(4, 1, rank, fill=True)
        for key, leaf in state.items():
            assert same_bytes(leaf.data.data, want[key].data.data) and same_bytes(leaf.scale, want[key].scale)


def test_transfer_and_session_move_scaled_tensors_with_their_scales() -> None:
    def run(rank: int, g: Any) -> list[dict[str, Any]]:
        source = nv_state(2, 1, rank, fill=True)
        once = nv_state(2, 0, rank, fill=False, fp4=True)
        reshard.transfer(source, once, group=g)
        session = reshard.TransferSession(group=g)
        again = nv_state(2, 0, rank, fill=False)
        session.transfer(source, again)
        return [once, again]

    for rank, (once, again) in enumerate(on_ranks(2, run)):
        check_nv(once, 2, 0, rank)
        check_nv(again, 2, 0, rank)


def test_transfer_refuses_a_plain_target_of_a_scaled_source_and_another_format() -> None:
    def plain(rank: int, g: Any) -> None:
        target = {"nv": nv_state(2, 0, rank, fill=False)["nv"].data}
        reshard.transfer(nv_state(2, 1, rank, fill=True), target, group=g)

    with pytest.raises(MismatchError, match=r"'nv': the source 'nv' is format nvfp4 .*the target a plain tensor"):
        on_ranks(2, plain)

    def other(rank: int, g: Any) -> None:
        leaf = nv_state(2, 0, rank, fill=False)["nv"]
        target = {"nv": ScaledTensor(leaf.data, torch.zeros(4, 2, dtype=E8M0), "mxfp4")}
        reshard.transfer(nv_state(2, 1, rank, fill=True), target, group=g)

    with pytest.raises(MismatchError, match=r"source 'nv' is format nvfp4.*the target format mxfp4"):
        on_ranks(2, other)


def test_command_line_ls_validate_inspect_diff_on_a_scaled_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    values = torch.randn(256, 128, generator=torch.Generator().manual_seed(13)).to(E4M3)
    state = {
        "w": ScaledTensor(ShardedTensor("w", values, (256, 128), (0, 0)), torch.ones(2, 1), "fp8_e4m3", (128, None))
    }
    reshard.CheckpointManager(tmp_path).save(1, state)
    step = str(tmp_path / step_name(1))
    reshard.save(state, tmp_path / "copy")
    assert main(["ls", str(tmp_path), "--json"]) == 0
    assert main(["validate", step]) == 0
    assert main(["inspect", step, "--json"]) == 0
    capsys.readouterr()
    assert main(["diff", step, str(tmp_path / "copy"), "--json"]) == 0
    assert all(entry["ok"] for entry in json.loads(capsys.readouterr().out)["tensors"])
    state["w"].scale[1] = 2.0
    reshard.save(state, tmp_path / "changed")
    assert main(["diff", step, str(tmp_path / "changed")]) == 1
    assert "w:scale" in capsys.readouterr().out


PEER_BIAS = torch.arange(6, dtype=torch.float32)


def peer_state(tp: int, rank: int, *, fill: bool) -> dict[str, Any]:
    """Rank ``rank`` of TP ``tp`` (fastest) x DP: FP8 128x128 experts split on rows, NVFP4 (with its global
    scale) split on columns, and a plain tensor; DP ranks hold replicas."""
    tp_rank, dp = rank % tp, rank // tp
    state: dict[str, Any] = expert_state(tp, 1, tp_rank, fill=fill, replica=dp)
    data, scale = NV.chunk(tp, dim=1)[tp_rank].clone(), NV_SCALE.chunk(tp, dim=1)[tp_rank].clone()
    glob = NV_GLOBAL.clone().reshape(1)
    bias = PEER_BIAS.clone()
    if not fill:
        for tensor in (data, scale, glob, bias):
            tensor.zero_()
    sharded = ShardedTensor.from_rank_offsets("nv", data, (1, tp_rank, tp), replica_id=dp)
    state["nv"] = ScaledTensor(sharded, scale.view(E4M3), "nvfp4", global_scale=glob)
    state["b"] = bias
    return state


def check_peer_state(state: dict[str, Any], tp: int, rank: int) -> None:
    want = peer_state(tp, rank, fill=True)
    assert state.keys() == want.keys()
    for key, leaf in want.items():
        if isinstance(leaf, ScaledTensor):
            got = state[key]
            assert isinstance(got, ScaledTensor), key
            assert same_bytes(got.data.data, leaf.data.data) and same_bytes(got.scale, leaf.scale), key
            assert leaf.global_scale is None or torch.equal(got.global_scale, leaf.global_scale), key
        else:
            assert torch.equal(state[key], leaf), key


def test_peer_memory_keeps_scaled_tensors_and_restores_them_at_tp4_and_tp1_after_losing_a_rank() -> None:
    """A peer save at TP2 x DP2 (two nodes of two) keeps the primaries of the scaled tensors' data, scales and
    global scale (nothing twice) with one copy on the other node; rank 0 (the primary of the global scale and
    of the origin boxes) is lost, and the survivors restore at TP4 (with a new rank) and at TP1, bit-exact."""
    tiers = [reshard.PeerMemoryCheckpoint(replicas=1, node_size=2, timeout=30) for _ in range(4)]
    results = on_ranks(4, lambda rank, g: tiers[rank].save(peer_state(2, rank, fill=True), group=g))
    expected = EXPERT_DATA.numel() + EXPERT_SCALE.numel() * 4 + NV.numel() + NV_SCALE.numel() + 4 + 6 * 4
    assert sum(r.own_bytes for r in results) == expected  # every primary once, no replica
    assert sum(r.copy_bytes for r in results) == expected
    survivors = [*tiers[1:], reshard.PeerMemoryCheckpoint(replicas=1, node_size=2, timeout=30)]  # rank 0 lost
    restored = on_ranks(4, lambda rank, g: survivors[rank].restore(peer_state(4, rank, fill=False), group=g))
    for rank, state in enumerate(restored):
        check_peer_state(state, 4, rank)
    restored = on_ranks(3, lambda rank, g: survivors[rank].restore(peer_state(1, rank, fill=False), group=g))
    for rank, state in enumerate(restored):
        check_peer_state(state, 1, rank)


def _bad_template(rank: int, case: str) -> dict[str, Any]:
    """A template that a load of the peer state refuses (see the test below)."""
    template = peer_state(2, rank, fill=False)
    if case == "plain":
        template["nv"] = template["nv"].data  # the data without its scales
    elif case == "other":
        template["nv"] = ScaledTensor(template["nv"].data, torch.zeros(8, 1, dtype=E8M0), "mxfp4")
    else:
        data = ShardedTensor("b", torch.zeros(6, dtype=E4M3), (6,), (0,), replica_id=rank)
        template["b"] = ScaledTensor(data, torch.ones(()), "fp8_e4m3")
    return template


BAD = {
    "plain": r"'nv': the checkpoint holds a scaled tensor of format nvfp4 .*the template a plain tensor",
    "other": r"'nv': the checkpoint holds format nvfp4 with blocks \[1, 16\], the template format mxfp4",
    "scaled": r"'b': the checkpoint holds a plain tensor, the template a ScaledTensor of format fp8_e4m3",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_peer_memory_restore_refuses_what_a_load_refuses(tmp_path: Path, case: str) -> None:
    """A restore whose template asks a plain tensor for a scaled key, another format, or a ScaledTensor for a
    plain key: the MismatchError a load of the same state raises, on every rank, before any byte moves."""
    tiers = [reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=30) for _ in range(2)]
    on_ranks(2, lambda rank, g: tiers[rank].save(peer_state(2, rank, fill=True), group=g))
    on_ranks(2, lambda rank, g: reshard.save(peer_state(2, rank, fill=True), tmp_path, group=g))
    templates = [_bad_template(rank, case) for rank in range(2)]
    loads = errors_on_ranks(2, lambda rank, g: reshard.load(templates[rank], tmp_path, group=g))
    restores = errors_on_ranks(2, lambda rank, g: tiers[rank].restore(templates[rank], group=g))
    for error in (*loads, *restores):
        assert isinstance(error, MismatchError) and re.search(BAD[case], str(error)), error
    for template in templates:  # nothing moved
        assert not template["experts.0.fc1.weight"].scale.any()
        assert not template["experts.0.fc1.weight"].data.data.view(torch.uint8).any()


def test_peer_save_refuses_ranks_that_disagree_on_a_scaled_tensor() -> None:
    """One rank describes ``nv`` as a ScaledTensor, the other as a plain tensor: a ShardingError naming it on
    every rank, as a save raises."""

    def save(rank: int, g: Any) -> None:
        state = peer_state(2, rank, fill=True)
        if rank == 1:
            state["nv"] = state["nv"].data
        reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=30).save(state, group=g)

    errors = errors_on_ranks(2, save)
    assert all(isinstance(e, reshard.ShardingError) and "'nv'" in str(e) for e in errors), errors
