"""Every flow carries scaled tensors (issue 32, part A): async_save, CheckpointManager, reshard.transfer,
TransferSession, and the command line's ls / validate / diff / inspect on a checkpoint holding them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import MismatchError, ScaledTensor, ShardedTensor
from reshard.cli import main
from reshard.flows.manager import step_name
from tests.flows.test_scaled import E4M3, E8M0, FP4, expert_state, on_ranks, random_bytes, same_bytes

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


def test_peer_memory_tier_refuses_scaled_tensors_rather_than_skip_them() -> None:
    """The peer-memory tier does not keep scaled records yet: a save of a ScaledTensor, or a restore into one
    (which would have left it unfilled, as a common value), is a StateDictError on every rank."""

    def save(rank: int, g: Any) -> None:
        reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=30).save(nv_state(2, 1, rank, fill=True), group=g)

    with pytest.raises(reshard.StateDictError, match=r"peer-memory tier .* not ScaledTensors \(yet\): 'nv'"):
        on_ranks(2, save)

    def restore(rank: int, g: Any) -> None:
        tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=30)
        tier.save({"b": torch.ones(2)}, group=g)
        tier.restore({"b": torch.zeros(2), **nv_state(2, 1, rank, fill=False)}, group=g)

    with pytest.raises(reshard.StateDictError, match=r"peer-memory tier .* not ScaledTensors \(yet\): 'nv'"):
        on_ranks(2, restore)
