"""What ranks exchange, over real gloo processes (pool of 4): each rank gets only its own reply, failures are
agreed on, and a rank other than the coordinator sends and receives the bytes of its own payloads only.

``benchmarks/scale.py`` computes these figures for 8192 ranks from the same formulas
(:func:`reshard.net.comm.padded_size`); here they are checked against the counters of real collectives.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import ShardingError
from reshard.net.comm import Communicator, padded_size
from tests.metadata_docs import read_doc
from tests.rankpool import RankContext, RankFailure, RankPool

pytestmark = pytest.mark.dist

TIMEOUT = 60.0


def _payload(rank: int) -> bytes:
    return f"rank {rank} ".encode() * (rank + 1)


def rank_step_scatter(ctx: RankContext, fail: str) -> dict[str, Any]:
    comm = Communicator(timeout=TIMEOUT)

    def local() -> bytes:
        if fail == "local" and ctx.rank == 2:
            raise ShardingError("rank 2 cannot describe its pieces")
        return _payload(ctx.rank)

    def combine(payloads: list[bytes]) -> tuple[Any, list[bytes]]:
        if fail == "combine":
            raise ShardingError("the layout does not tile")
        assert payloads == [_payload(r) for r in range(ctx.world_size)]
        return {"sizes": [len(p) for p in payloads]}, [b"reply %d" % r * (r + 1) for r in range(ctx.world_size)]

    value, reply = comm.step_scatter("testing", local, combine)
    return {"value": value, "reply": reply.decode(), "sent": comm.bytes_sent, "received": comm.bytes_received}


def test_step_scatter_replies_and_counts_bytes(pool4: RankPool) -> None:
    results = pool4.run_ok(rank_step_scatter, "")
    sizes = [len(_payload(r)) for r in range(4)]
    replies = [len(b"reply %d" % r * (r + 1)) for r in range(4)]
    header = len(json.dumps({"result": {"sizes": sizes}}).encode())
    for rank, result in enumerate(results):
        assert result["value"] == {"sizes": sizes}
        assert result["reply"] == f"reply {rank}" * (rank + 1)
        if rank == 0:
            continue
        # all-reduce of the longest length, then the gather of this rank's padded payload behind its tag (the
        # phase's name with its 2-byte length, and a status byte)
        tag = 2 + len("testing") + 1
        assert result["sent"] == 8 + padded_size([s + tag for s in sizes])
        # the all-reduce, the broadcast header (8-byte length and the JSON), the longest reply, this reply
        assert result["received"] == 8 + (8 + header) + 8 + padded_size(replies)


def test_step_scatter_agrees_on_failures(pool4: RankPool) -> None:
    for fail, message in (("local", "testing failed on rank 2: rank 2 cannot"), ("combine", "does not tile")):
        results = pool4.run(rank_step_scatter, fail)
        assert all(isinstance(r, RankFailure) for r in results)
        assert {r.error_class for r in results} == {"ShardingError"}
        assert all(message in r.message for r in results)


def rank_save_and_load(ctx: RankContext, path: str) -> dict[str, Any]:
    """4 ranks save one tensor as many flat ranges each (a packed tensor), then load it by columns."""
    full = torch.arange(64 * 6, dtype=torch.float32).reshape(64, 6)
    rows = full[16 * ctx.rank : 16 * ctx.rank + 16]
    leaves: dict[str, Any] = {}
    for i, start in enumerate(range(0, 96, 10)):
        end = min(start + 10, 96)
        leaves[f"p{i}"] = reshard.ShardedTensor.from_flat_range(
            "w", rows.reshape(-1)[start:end].clone(), (16, 6), (64, 6), (16 * ctx.rank, 0), start, end
        )
    leaves["bias"] = torch.ones(3)
    result = reshard.save(leaves, path, timeout=TIMEOUT)
    template = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(64, 3), (1, ctx.rank % 2, 2))}
    out = reshard.load(template, path, timeout=TIMEOUT)
    return {
        "has_metadata": result.metadata is not None,
        "result": [result.world_size, result.num_files, result.total_bytes, result.file_bytes, result.save_id],
        "loaded": torch.equal(out["w"], full[:, 3 * (ctx.rank % 2) : 3 * (ctx.rank % 2) + 3]),
    }


def test_save_returns_a_summary_everywhere_and_metadata_on_the_coordinator(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results = pool4.run_ok(rank_save_and_load, str(path))
    assert [r["has_metadata"] for r in results] == [True, False, False, False]
    assert all(r["loaded"] for r in results)
    assert len({json.dumps(r["result"]) for r in results}) == 1
    metadata = reshard.read_metadata(path)
    assert metadata.format_version == 3
    assert "packed" in read_doc(path)["tensors"]["w"]  # 44 boxes of "w": packed
    world_size, files, total, file_bytes, save_id = results[0]["result"]
    assert (world_size, files, total, save_id) == (4, len(metadata.files), metadata.total_bytes, metadata.save_id)
    assert total == (64 * 6 + 3) * 4
    assert file_bytes == sum(f.size for f in metadata.files)
