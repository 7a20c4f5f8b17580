"""Issue 32, the second outside attack on low-precision state: a transfer source key held as a ScaledTensor on
some ranks and as a plain tensor on others (F2), and a padded scaled tensor whose block is shorter than its
padded axis but at least its logical one (F3).

In-process ranks (ThreadGroup): the real save, load and transfer protocols."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import ScaledTensor, ShardedTensor
from reshard.metadata.model import METADATA_CHECKSUM_MEMBER
from reshard.metadata.wire import seal_document
from reshard.state.quantize import quantize
from tests.flows.test_scaled import errors_on_ranks, on_ranks, same_bytes

pytestmark = pytest.mark.unit

E4M3 = torch.float8_e4m3fn
W = torch.randn(4, 64, generator=torch.Generator().manual_seed(6)) * 3
WANT = quantize(W, "fp8_e4m3", block=(2, 32))


def _scaled_w(data: torch.Tensor, scale: torch.Tensor, *offsets: tuple[int, int, int], replica_id: int = 0) -> Any:
    return ScaledTensor(
        ShardedTensor.from_rank_offsets("w", data.clone(), *offsets, replica_id=replica_id),
        scale.clone(),
        "fp8_e4m3",
        (2, 32),
    )


def _fp32_primary_scaled_replica(rank: int) -> dict[str, Any]:
    """The attack's "consistent" case: a plain fp32 W (primary) on rank 0, quantize(W) as a replica on rank 1."""
    if rank == 0:
        return {"w": ShardedTensor.from_rank_offsets("w", W.clone())}
    return {"w": _scaled_w(WANT.data, WANT.scale, replica_id=1)} if rank == 1 else {}


def _scaled_primary_fp32_replica(rank: int) -> dict[str, Any]:
    if rank == 0:
        return {"w": _scaled_w(WANT.data, WANT.scale)}
    return {"w": ShardedTensor.from_rank_offsets("w", W.clone(), replica_id=1)} if rank == 1 else {}


def _bf16_rows_scaled_rows(rank: int) -> dict[str, Any]:
    """Rows 0-1 of W as bf16 on rank 0, rows 2-3 as a scaled tensor on rank 1."""
    rows = slice(2 * rank, 2 * rank + 2)
    if rank == 0:
        return {"w": ShardedTensor.from_rank_offsets("w", W[rows].bfloat16(), (0, 0, 2))}
    return {"w": _scaled_w(WANT.data[rows], WANT.scale[1:], (0, 1, 2))} if rank == 1 else {}


SOURCES: dict[str, Callable[[int], dict[str, Any]]] = {
    "fp32 primary, scaled replica": _fp32_primary_scaled_replica,
    "scaled primary, fp32 replica": _scaled_primary_fp32_replica,
    "bf16 rows, scaled rows": _bf16_rows_scaled_rows,
}


def _scaled_target() -> dict[str, Any]:
    data = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 64, dtype=E4M3))
    return {"w": ScaledTensor(data, torch.zeros(2, 2), "fp8_e4m3", (2, 32))}


@pytest.mark.parametrize("session", [False, True], ids=["transfer", "session"])
@pytest.mark.parametrize("case", list(SOURCES))
def test_a_transfer_refuses_a_source_key_scaled_on_some_ranks_and_plain_on_others(case: str, session: bool) -> None:
    """F2. Was: "fp32 primary, scaled replica" succeeded with the right scale and W cast straight to fp8 (values
    off by ~57x); "bf16 rows, scaled rows" failed with "'w:scale' ... held by no rank". Now the save's error on
    every rank, naming the key and the ranks of each kind, before any byte moves (the target is left as it was)."""
    build = SOURCES[case]
    targets = [_scaled_target() if rank == 2 else {} for rank in range(3)]

    def move(rank: int, group: Any) -> None:
        if session:
            reshard.TransferSession(group=group).transfer(build(rank), targets[rank], delta=False)
        else:
            reshard.transfer(build(rank), targets[rank], group=group)

    errors = errors_on_ranks(3, move)
    assert all(isinstance(e, reshard.ShardingError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    message = str(errors[0])
    assert "'w' is a ScaledTensor on ranks [1] but a plain tensor on ranks [0]" in message or (
        "'w' is a ScaledTensor on ranks [0] but a plain tensor on ranks [1]" in message
    ), message
    assert not targets[2]["w"].data.data.view(torch.uint8).any() and not targets[2]["w"].scale.any()


def test_a_transfer_from_scaled_primary_and_scaled_replica_still_moves_bit_exact() -> None:
    """The refusal is of the mix only: scaled copies on both source ranks transfer bit for bit."""

    def source(rank: int) -> dict[str, Any]:
        return {"w": _scaled_w(WANT.data, WANT.scale, replica_id=rank)} if rank < 2 else {}

    def move(rank: int, group: Any) -> Any:
        target = _scaled_target() if rank == 2 else {}
        return reshard.transfer(source(rank), target, group=group)

    got = on_ranks(3, move)[2]["w"]
    assert same_bytes(got.data.data, WANT.data) and same_bytes(got.scale, WANT.scale)


# ---- F3: logical (100, 64) padded to (128, 64), block (112, 32): one block of rows either way ----------------

C = torch.randn(100, 64, generator=torch.Generator().manual_seed(2))
CQ = quantize(C, "fp8_e4m3", block=(112, 32))


def _padded(rank: int, *, fill: bool) -> dict[str, Any]:
    """Rank ``rank`` of 2 holding columns [32 rank, 32 rank + 32) of ``c`` padded to 128 rows (scale rows: 2,
    of which 1 logical)."""
    cols = slice(32 * rank, 32 * rank + 32)
    data = torch.zeros(128, 32, dtype=E4M3)
    scale = torch.zeros(2, 1)
    if fill:
        data[:100] = CQ.data[:, cols]
        scale[:1] = CQ.scale[:, rank : rank + 1]
    sharded = ShardedTensor("c", data, (128, 64), (0, 32 * rank), logical_shape=(100, 64))
    return {"c": ScaledTensor(sharded, scale, "fp8_e4m3", (112, 32))}


def _unpadded(*, fill: bool) -> dict[str, Any]:
    data = CQ.data.clone() if fill else torch.zeros(100, 64, dtype=E4M3)
    scale = CQ.scale.clone() if fill else torch.zeros(1, 2)
    return {"c": ScaledTensor(ShardedTensor.from_rank_offsets("c", data), scale, "fp8_e4m3", (112, 32))}


def test_a_padded_scaled_tensor_records_the_block_of_its_logical_shape() -> None:
    """F3. The record is what every layout shares: canonical against the logical shape. The scales' derivation
    keeps the stored (padded) shape: two scale rows, one logical."""
    padded, unpadded = _padded(0, fill=False)["c"], _unpadded(fill=False)["c"]
    assert padded.record == unpadded.record
    assert padded.record.block == (None, 32)
    assert padded.scale_sharded.global_shape == (2, 2) and padded.scale_sharded.logical_shape == (1, 2)


def test_padded_and_unpadded_layouts_of_one_scaled_tensor_load_each_other_bit_exact(tmp_path: Path) -> None:
    """F3. Was: the padded save recorded blocks [112, 32] (canonical against the padded 128 rows) and the
    unpadded template [None, 32], so the load was a MismatchError although both give one scale row. Now both
    ways load bit for bit, and both saves record the same block."""
    on_ranks(2, lambda r, g: reshard.save(_padded(r, fill=True), tmp_path / "padded", group=g))
    reshard.save(_unpadded(fill=True), tmp_path / "unpadded")
    records = [reshard.read_metadata(tmp_path / p).scaled["c"] for p in ("padded", "unpadded")]
    assert records[0] == records[1] and records[0].block == (None, 32)

    got = reshard.load(_unpadded(fill=False), tmp_path / "padded")["c"]
    assert same_bytes(got.data.data, CQ.data) and same_bytes(got.scale, CQ.scale)

    def load_padded(rank: int, group: Any) -> ScaledTensor:
        return reshard.load(_padded(rank, fill=False), tmp_path / "unpadded", group=group)["c"]

    for rank, leaf in enumerate(on_ranks(2, load_padded)):
        want = _padded(rank, fill=True)["c"]
        assert same_bytes(leaf.data.data, want.data.data) and same_bytes(leaf.scale, want.scale)


def test_a_padded_scaled_tensor_transfers_to_an_unpadded_layout_and_is_quantized_into_one() -> None:
    """F3, the transfer side: padded scaled sources (two ranks) fill an unpadded ScaledTensor target (was: a
    MismatchError on the blocks), and fp32 sources are quantized into the padded target as quantize gives."""

    def scaled(rank: int, group: Any) -> Any:
        target = _unpadded(fill=False) if rank == 0 else {}
        return reshard.transfer(_padded(rank, fill=True), target, group=group)

    got = on_ranks(2, scaled)[0]["c"]
    assert same_bytes(got.data.data, CQ.data) and same_bytes(got.scale, CQ.scale)

    def quantized(rank: int, group: Any) -> Any:
        source = {"c": ShardedTensor.from_rank_offsets("c", C[:, 32 * rank : 32 * rank + 32].clone(), (1, rank, 2))}
        return reshard.transfer(source, _padded(rank, fill=False), group=group)["c"]

    for rank, leaf in enumerate(on_ranks(2, quantized)):
        want = _padded(rank, fill=True)["c"]
        assert same_bytes(leaf.data.data, want.data.data) and same_bytes(leaf.scale, want.scale)


def _as_written_before_the_fix(path: Path) -> None:
    """Rewrite ``path``'s record of ``c`` with the block a padded save recorded before F3 ([112, 32]), sealed."""
    doc = json.loads((path / "metadata.json").read_bytes())
    doc.pop(METADATA_CHECKSUM_MEMBER)
    doc["scaled"]["c"]["block"] = [112, 32]
    (path / "metadata.json").write_bytes(seal_document(json.dumps(doc).encode()))


def test_a_checkpoint_whose_padded_record_holds_the_padded_block_still_loads_both_layouts(tmp_path: Path) -> None:
    """F3, compatibility: a checkpoint saved padded before the fix records [112, 32]; it is the same scale grid
    over the logical shape, so the padded template that saved it and an unpadded one both load it bit for bit."""
    on_ranks(2, lambda r, g: reshard.save(_padded(r, fill=True), tmp_path / "old", group=g))
    _as_written_before_the_fix(tmp_path / "old")
    assert reshard.read_metadata(tmp_path / "old").scaled["c"].block == (112, 32)
    got = reshard.load(_unpadded(fill=False), tmp_path / "old")["c"]
    assert same_bytes(got.data.data, CQ.data) and same_bytes(got.scale, CQ.scale)
    for rank, leaf in enumerate(
        on_ranks(2, lambda r, g: reshard.load(_padded(r, fill=False), tmp_path / "old", group=g)["c"])
    ):
        want = _padded(rank, fill=True)["c"]
        assert same_bytes(leaf.data.data, want.data.data) and same_bytes(leaf.scale, want.scale)
