"""Save and load statistics (bytes, seconds per phase, throughput) and the phase log of the ``reshard`` logger."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import LoadStats, SaveStats, ShardedObject, ShardedTensor
from reshard.metadata import Metadata
from tests.rankpool import RankContext, RankPool

TIMEOUT = 60.0

SAVE_PHASES = ("seconds_plan", "seconds_exchange", "seconds_write", "seconds_commit")
LOAD_PHASES = (
    "seconds_metadata",
    "seconds_plan",
    "seconds_stage",
    "seconds_read",
    "seconds_verify",
    "seconds_exchange",
)


def state(rank: int = 0, world: int = 1) -> dict[str, Any]:
    rows = torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    part = 8 // world
    return {
        "w": ShardedTensor.from_rank_offsets("w", rows[rank * part : (rank + 1) * part].clone(), (0, rank, world)),
        "bias": torch.arange(5, dtype=torch.bfloat16),  # replicated on every rank: written once
        "rng": ShardedObject("rng", {"seed": rank}, (world,), (rank,)),
        "step": 3,
    }


def box_bytes_by_file(metadata: Metadata) -> dict[str, int]:
    out = {f.path: 0 for f in metadata.files}
    for tensor in metadata.tensors.values():
        for box in tensor.boxes:
            out[metadata.files[box.file].path] += box.byte_length
    return out


def check_phases(stats: SaveStats | LoadStats, phases: tuple[str, ...]) -> None:
    seconds = [getattr(stats, name) for name in phases]
    assert all(s >= 0.0 for s in seconds), seconds
    assert stats.seconds > 0.0
    assert sum(seconds) <= stats.seconds
    assert stats.throughput == pytest.approx(
        stats.bytes_written / stats.seconds if isinstance(stats, SaveStats) else stats.bytes_read / stats.seconds
    )


@pytest.mark.unit
def test_save_stats_count_what_the_files_hold(tmp_path: Path) -> None:
    stats = SaveStats()
    metadata = reshard.save(
        state(), tmp_path / "ckpt", stats=stats, options=reshard.SaveOptions(fingerprint=True)
    ).metadata
    assert metadata is not None  # a single process is the coordinator
    (data_file,) = metadata.files
    assert (
        stats.bytes_written == box_bytes_by_file(metadata)[data_file.path] == metadata.total_bytes == 8 * 16 * 4 + 5 * 2
    )
    assert stats.checkpoint_bytes == metadata.total_bytes
    assert stats.boxes_written == 2
    assert stats.file_bytes == data_file.size == (tmp_path / "ckpt" / data_file.path).stat().st_size
    assert stats.file_bytes > stats.bytes_written  # the object's bytes and alignment padding
    check_phases(stats, SAVE_PHASES)
    assert stats.seconds_write > 0.0
    assert stats.seconds_commit > 0.0
    assert stats.write_throughput == pytest.approx(stats.bytes_written / stats.seconds_write)


@pytest.mark.unit
def test_load_stats_time_every_phase(tmp_path: Path) -> None:
    reshard.save(state(), tmp_path / "ckpt", options=reshard.SaveOptions(fingerprint=True))
    stats = LoadStats()
    template = {"w": torch.zeros(8, 16), "bias": torch.zeros(5, dtype=torch.bfloat16), "step": 0}
    reshard.load(template, tmp_path / "ckpt", stats=stats, options=reshard.LoadOptions(verify=True))
    assert stats.bytes_read == stats.bytes_needed == 8 * 16 * 4 + 5 * 2
    check_phases(stats, LOAD_PHASES)
    for name in ("seconds_metadata", "seconds_plan", "seconds_read", "seconds_verify"):
        assert getattr(stats, name) > 0.0, name
    assert stats.seconds_stage == 0.0  # no staging directory


@pytest.mark.unit
def test_phases_are_logged_at_debug_with_one_info_summary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        reshard.save(state(), tmp_path / "ckpt")
        reshard.load({"w": torch.zeros(8, 16)}, tmp_path / "ckpt", strict=False)
    records = [r for r in caplog.records if r.name == "reshard"]
    debug = {r.getMessage().split(": ")[0] for r in records if r.levelno == logging.DEBUG}
    for phase in ("plan", "exchange", "write", "commit"):
        assert f"[rank=0] save {phase}" in debug
    for phase in ("metadata", "plan", "exchange", "read"):
        assert f"[rank=0] load {phase}" in debug
    info = [r.getMessage() for r in records if r.levelno == logging.INFO]
    assert len(info) == 2
    assert info[0].startswith("[rank=0] saved ")
    assert "this rank wrote 522 bytes" in info[0]
    assert info[1].startswith("[rank=0] loaded ")
    assert "512 bytes needed" in info[1]
    assert "write " in info[0]
    assert "read " in info[1]


@pytest.mark.dist
def test_nothing_reaches_stderr_by_default(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import torch, reshard
        reshard.save({{"w": torch.ones(4)}}, {str(tmp_path / "ckpt")!r})
        reshard.load({{"w": torch.zeros(4)}}, {str(tmp_path / "ckpt")!r})
        print("done")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "done\n"
    assert run.stderr == ""


# --- four ranks --------------------------------------------------------------------------------------------


def rank_save_stats(ctx: RankContext, path: str) -> dict[str, Any]:
    result = reshard.save(state(ctx.rank, ctx.world_size), path, timeout=TIMEOUT)
    return dataclasses.asdict(result.stats)


@pytest.mark.dist
def test_ranks_bytes_written_add_up_to_the_checkpoint(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    per_rank = pool4.run_ok(rank_save_stats, str(path))
    metadata = reshard.read_metadata(path)
    by_file = box_bytes_by_file(metadata)
    sizes = {f.path: f.size for f in metadata.files}
    assert sum(s["bytes_written"] for s in per_rank) == metadata.total_bytes
    for rank, stats in enumerate(per_rank):
        name = next((p for p in by_file if p.endswith(f"-r{rank:05d}.bin")), None)
        assert stats["bytes_written"] == (by_file[name] if name else 0)
        assert stats["file_bytes"] == (sizes[name] if name else 0)
        assert stats["checkpoint_bytes"] == metadata.total_bytes
        assert sum(stats[p] for p in SAVE_PHASES) <= stats["seconds"]
    # The replicated bias is written by one rank only; every rank writes its rows of w.
    assert sum(s["boxes_written"] for s in per_rank) == 4 + 1
