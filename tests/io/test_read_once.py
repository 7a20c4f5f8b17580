"""Read once per replica group, then exchange (``LoadOptions(read_once=...)``, :mod:`reshard.io.exchange`).

Storage bytes are counted by the storage layer itself (``Storage.range_bytes_read``), summed over the
ranks, and compared with the unique bytes the job needs; every load is checked bit-exactly against the
saved tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import CorruptCheckpointError
from reshard.net.transports import ThreadGroup
from reshard.planning.exchange import MIN_SLAB_BYTES, schedule_reads
from reshard.storage.local import LocalStorage
from tests.rankpool import RankContext, RankFailure, RankPool
from tests.threads import on_threads

ROWS, COLS = 16, 12
FULL = {
    "w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS),
    "b": torch.arange(COLS, dtype=torch.bfloat16),
    "emb": torch.arange(10 * 4, dtype=torch.float64).reshape(10, 4) / 7,
}
UNIQUE_BYTES = sum(t.numel() * t.element_size() for t in FULL.values())


SMALL_CHUNKS = reshard.SaveOptions(checksum_chunk_bytes=16)
"""Checksum chunks of 16 bytes, a divisor of every row: a rank that reads some rows of a box verifies only
those (with the default 4 MiB chunks, every reader of a small box reads it whole to verify it)."""


def _save_full(path: Path) -> None:
    reshard.save(dict(FULL), path, overwrite=True, options=SMALL_CHUNKS)


def _template(tp: int, tp_size: int) -> dict[str, Any]:
    """A TP-split ``w`` and ``emb`` (rows: contiguous ranges of the saved boxes, so that the bytes each rank
    reads are exactly those it needs) and a replicated ``b``."""
    rows = 10 // tp_size
    return {
        "w": reshard.ShardedTensor.from_rank_offsets("w", torch.empty(ROWS // tp_size, COLS), (0, tp, tp_size)),
        "b": torch.empty(COLS, dtype=torch.bfloat16),
        "emb": reshard.ShardedTensor.from_rank_offsets(
            "emb", torch.empty(rows, 4, dtype=torch.float64), (0, tp, tp_size)
        ),
    }


def _check(loaded: dict[str, Any], tp: int, tp_size: int) -> None:
    per, rows = ROWS // tp_size, 10 // tp_size
    assert torch.equal(loaded["w"], FULL["w"][tp * per : (tp + 1) * per])
    assert torch.equal(loaded["b"], FULL["b"])
    assert torch.equal(loaded["emb"], FULL["emb"][tp * rows : (tp + 1) * rows])


def rank_load_replicated(ctx: RankContext, path: str, tp_size: int, read_once: bool | None) -> dict[str, int]:
    """Every rank loads its TP slice; ranks with the same ``rank % tp_size`` are replicas (DP, CP)."""
    tp = ctx.rank % tp_size
    storage = LocalStorage(Path(path))
    stats = reshard.LoadStats()
    loaded = reshard.load(
        _template(tp, tp_size), storage, options=reshard.LoadOptions(read_once=read_once), stats=stats
    )
    _check(loaded, tp, tp_size)
    return {
        "storage": storage.range_bytes_read,
        "read": stats.bytes_read,
        "needed": stats.bytes_needed,
        "from_peers": stats.bytes_from_peers,
        "to_peers": stats.bytes_to_peers,
    }


@pytest.mark.dist
@pytest.mark.parametrize("tp_size", [2, 1], ids=["DP2xTP2", "DP2xCP2"])
def test_replicas_read_each_unique_byte_once(pool4: RankPool, tmp_path: Path, tp_size: int) -> None:
    """DP=2 x TP=2, and DP=2 x CP=2 (4 replicas of one TP rank): storage serves each unique byte once over
    all ranks, bit-exactly; without read_once it serves it once per replica."""
    _save_full(tmp_path / "ckpt")
    once = pool4.run_ok(rank_load_replicated, str(tmp_path / "ckpt"), tp_size, True)
    plain = pool4.run_ok(rank_load_replicated, str(tmp_path / "ckpt"), tp_size, False)
    split = sum(FULL[k].numel() * FULL[k].element_size() for k in ("w", "emb"))
    needed = split // tp_size + FULL["b"].numel() * 2  # per rank: its TP slices and the replicated bias
    assert [r["needed"] for r in once] == [needed] * 4
    assert sum(r["storage"] for r in plain) == sum(r["read"] for r in plain) == 4 * needed  # once per replica
    assert sum(r["storage"] for r in once) == sum(r["read"] for r in once) == UNIQUE_BYTES  # once in all
    assert sum(r["from_peers"] for r in once) == sum(r["to_peers"] for r in once) == 4 * needed - UNIQUE_BYTES
    assert all(r["from_peers"] == r["to_peers"] == 0 for r in plain)


def rank_load_uneven(ctx: RankContext, path: str) -> dict[str, int]:
    """Three ranks whose row ranges overlap unevenly: 0..9, 4..13, 2..15 of ``w``."""
    group = None
    rows = [(0, 10), (4, 14), (2, 16), (0, 16)][ctx.rank]
    lo, hi = rows
    storage = LocalStorage(Path(path))
    stats = reshard.LoadStats()
    template = {"w": reshard.ShardedTensor("w", torch.empty(hi - lo, COLS), (ROWS, COLS), (lo, 0))}
    loaded = reshard.load(template, storage, group=group, options=reshard.LoadOptions(read_once=True), stats=stats)
    assert torch.equal(loaded["w"], FULL["w"][lo:hi])
    return {"storage": storage.range_bytes_read, "from_peers": stats.bytes_from_peers}


@pytest.mark.dist
def test_uneven_overlaps_are_read_once(pool4: RankPool, tmp_path: Path) -> None:
    """Overlaps shared by some ranks only (grid cells of the row ranges): every row of ``w`` read once."""
    reshard.save({"w": FULL["w"]}, tmp_path / "ckpt", options=SMALL_CHUNKS)
    results = pool4.run_ok(rank_load_uneven, str(tmp_path / "ckpt"))
    assert sum(r["storage"] for r in results) == FULL["w"].numel() * 4
    assert sum(r["from_peers"] for r in results) > 0


def rank_load_corrupt(ctx: RankContext, path: str) -> None:
    reshard.load(_template(ctx.rank % 2, 2), path, options=reshard.LoadOptions(read_once=True))


@pytest.mark.dist
def test_a_checksum_failure_of_a_reader_fails_every_rank_without_waiting(pool4: RankPool, tmp_path: Path) -> None:
    """The reads are agreed on before any byte is exchanged: a corrupt box fails the load on every rank
    (the same error), and no rank waits for bytes that will not come."""
    _save_full(tmp_path / "ckpt")
    data = next((tmp_path / "ckpt" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[3] ^= 0x01
    data.write_bytes(bytes(raw))
    results = pool4.run(rank_load_corrupt, str(tmp_path / "ckpt"), timeout_s=60)
    assert all(isinstance(r, RankFailure) and r.error_class == CorruptCheckpointError.__name__ for r in results)


@pytest.mark.dist
def test_object_store_loads_read_once_by_default(object_store: Any, tmp_path: Path) -> None:
    """On S3 and GCS (a request costs as much as megabytes of reading), replicas read once without being
    asked: 4 replicas (threads) fetch the checkpoint's bytes once in all."""
    bucket = object_store.new_bucket()
    url = f"{object_store.protocol}://{bucket}/ckpt"
    options = object_store.storage_options
    reshard.save(dict(FULL), url, storage_options=options, options=SMALL_CHUNKS)
    group = ThreadGroup(4)
    results: list[reshard.LoadStats] = [reshard.LoadStats() for _ in range(4)]

    def rank(r: int) -> None:
        loaded = reshard.load(_template(0, 1), url, group=group.member(r), storage_options=options, stats=results[r])
        _check(loaded, 0, 1)

    on_threads(4, rank)
    assert sum(s.bytes_read for s in results) == UNIQUE_BYTES
    assert sum(s.bytes_from_peers for s in results) == 3 * UNIQUE_BYTES


@pytest.mark.unit
def test_casts_padding_flat_ranges_and_many_rounds(tmp_path: Path) -> None:
    """Replicas with a dtype cast, a padded (logical-shape) tensor and ZeRO-1 flat ranges, through a
    budget so small that the exchange takes many rounds: the same result as plain loads."""
    big = torch.randn(64, 256)  # 64 KiB: split into slabs among its readers
    reshard.save({"big": big, "w": FULL["w"], "v": torch.arange(10.0)}, tmp_path / "ckpt")
    group = ThreadGroup(2)
    outputs: list[dict[str, torch.Tensor]] = [{}, {}]
    stats = [reshard.LoadStats(), reshard.LoadStats()]

    def rank(r: int) -> None:
        template = {
            "big": torch.empty(64, 256, dtype=torch.float64),  # read as float64: a cast
            "w": reshard.ShardedTensor.from_flat_range(
                "w", torch.empty(150 - 37), (ROWS, COLS), (ROWS, COLS), (0, 0), 37, 150
            ),
            "v": reshard.ShardedTensor("v", torch.empty(16), (16,), (0,), logical_shape=(10,)),
        }
        options = reshard.LoadOptions(read_once=True, memory_budget_bytes=1 << 16)
        outputs[r] = reshard.load(template, tmp_path / "ckpt", group=group.member(r), options=options, stats=stats[r])

    on_threads(2, rank)
    for out in outputs:
        assert torch.equal(out["big"], big.double())
        assert torch.equal(out["w"], FULL["w"].flatten()[37:150])
        assert torch.equal(out["v"][:10], torch.arange(10.0)) and not out["v"][10:].any()
    assert min(s.bytes_from_peers for s in stats) > 0
    assert stats[0].exchange_rounds == stats[1].exchange_rounds >= 4  # 64 KiB of float64 per rank, 32 KiB rounds


@pytest.mark.unit
def test_schedule_balances_readers_and_bounds_rounds() -> None:
    """Pure schedule: a shared box is cut into one slab per needer, each needer reads about the same, and
    no round sends or receives more than its bound."""
    nbytes = 64 * MIN_SLAB_BYTES
    rows = nbytes // (4 * 1024)
    need = ["t", [0, 0], [rows, 1024], "float32"]
    schedules = schedule_reads([[need] for _ in range(4)], round_bytes=nbytes // 8)
    read = [sum(ref[2][0] for ref in s.reads) * 1024 * 4 for s in schedules]
    assert sum(read) == nbytes and max(read) == min(read) == nbytes // 4
    assert len({len(s.rounds) for s in schedules}) == 1
    for s in schedules:
        for rnd in s.rounds:
            sent = sum(ref[2][0] * 1024 * 4 for _, cells in rnd["send"] for ref in cells)
            received = sum(ref[2][0] * 1024 * 4 for _, cells in rnd["recv"] for ref in cells)
            assert sent <= nbytes // 8 and received <= nbytes // 8


@pytest.mark.unit
def test_read_once_and_node_staging_exclude_each_other(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="read_once"):
        reshard.LoadOptions(read_once=True, staging=reshard.StagingOptions(directory=str(tmp_path)))


@pytest.mark.unit
def test_a_key_held_twice_by_a_rank_and_a_rank_with_nothing_to_load(tmp_path: Path) -> None:
    """Tied weights: a rank's template holds the same key twice (both filled, the second by a local copy of
    what it read or received); and a rank that loads nothing still takes part in the exchange."""
    reshard.save({"emb": FULL["emb"]}, tmp_path / "ckpt", options=SMALL_CHUNKS)
    group = ThreadGroup(3)
    out: list[Any] = [None] * 3
    stats = [reshard.LoadStats() for _ in range(3)]

    def rank(r: int) -> None:
        template: dict[str, Any] = {}
        if r < 2:
            template = {
                "embedding": reshard.ShardedTensor("emb", torch.empty(10, 4, dtype=torch.float64), (10, 4), (0, 0)),
                "output": reshard.ShardedTensor("emb", torch.zeros(10, 4, dtype=torch.float64), (10, 4), (0, 0)),
            }
        options = reshard.LoadOptions(read_once=True)
        out[r] = reshard.load(template, tmp_path / "ckpt", group=group.member(r), options=options, stats=stats[r])

    on_threads(3, rank)
    for r in range(2):
        assert torch.equal(out[r]["embedding"], FULL["emb"]) and torch.equal(out[r]["output"], FULL["emb"])
    assert out[2] == {}
    assert sum(s.bytes_read for s in stats) == FULL["emb"].numel() * 8
