"""Issue 32, the second outside attack on low-precision state: a transfer source key held as a ScaledTensor on
some ranks and as a plain tensor on others (F2), and a padded scaled tensor whose block is shorter than its
padded axis but at least its logical one (F3).

In-process ranks (ThreadGroup): the real save, load and transfer protocols."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import reshard
from reshard import ScaledTensor, ShardedTensor
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
