"""Asynchronous save: a consistent snapshot, background write and commit, errors through the handle."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import reshard
from tests.memory import peak_rss_growth
from tests.rankpool import RankContext, RankPool

TIMEOUT = 60.0


@pytest.mark.unit
def test_snapshot_is_consistent_and_buffers_are_reused(tmp_path: Path) -> None:
    weight = torch.randn(1000, 37)
    sharded = reshard.ShardedTensor.segmented("fused", torch.randn(10, 4), (10, 4), 0, [(5, 5), (0, 5)])
    checkpointer = reshard.AsyncCheckpointer()
    expected = []
    for step in range(3):
        state = {
            "w": weight,
            "fused": sharded,
            "rng": reshard.ShardedObject("rng", {"s": [step]}, (1,), (0,)),
            "step": step,
        }
        expected.append((weight.clone(), sharded.data.clone()))
        handle = checkpointer.save(state, tmp_path / f"step{step}")
        weight.add_(1.0)  # training goes on while the background thread writes
        sharded.data.mul_(2.0)
        assert handle.wait() is not None
        assert handle.done() and handle.total_seconds is not None and handle.snapshot_seconds >= 0
    buffers = dict(checkpointer._buffers)
    checkpointer.save({"w": weight, "fused": sharded, "step": 9}, tmp_path / "again").wait()
    assert all(checkpointer._buffers[k] is v for k, v in buffers.items())  # reused, not reallocated
    for step, (w, fused) in enumerate(expected):
        template = {
            "w": torch.zeros_like(w),
            "fused": reshard.ShardedTensor("fused", torch.zeros(10, 4), (10, 4), (0, 0)),
            "rng": reshard.ShardedObject("rng", None, (1,), (0,)),
            "step": -1,
        }
        out = reshard.load(template, tmp_path / f"step{step}")
        assert torch.equal(out["w"], w)
        assert torch.equal(out["fused"][5:10], fused[0:5]) and torch.equal(out["fused"][0:5], fused[5:10])
        assert out["rng"] == {"s": [step]} and out["step"] == step


@pytest.mark.unit
def test_an_overlapped_snapshot_of_host_tensors_is_complete_when_save_returns(tmp_path: Path) -> None:
    """``overlap_snapshot=True`` only defers the copies of GPU tensors (tests/io/test_gpu.py): host tensors are
    copied before ``save`` returns, ``snapshot_done`` says so and ``wait_snapshot`` has nothing to order."""
    weight = torch.arange(12.0).reshape(3, 4)
    checkpointer = reshard.AsyncCheckpointer()
    handle = checkpointer.save({"w": weight}, tmp_path / "ckpt", overlap_snapshot=True)
    assert handle.snapshot_done()
    handle.wait_snapshot()
    weight.add_(1.0)
    handle.wait()
    one_off = reshard.async_save({"w": weight}, tmp_path / "one-off", overlap_snapshot=True)
    weight.add_(1.0)
    one_off.wait()
    assert torch.equal(reshard.load({"w": torch.zeros(3, 4)}, tmp_path / "ckpt")["w"], torch.arange(12.0).reshape(3, 4))
    assert torch.equal(
        reshard.load({"w": torch.zeros(3, 4)}, tmp_path / "one-off")["w"], torch.arange(12.0).reshape(3, 4) + 1
    )


@pytest.mark.unit
def test_warmup_pre_pays_the_snapshot_buffers(tmp_path: Path) -> None:
    """After warmup the first snapshot copies into memory already resident (no new peak), into the same
    buffers, and warmup reports their bytes; a save in flight is finalised before buffers are touched."""
    mib = 2**20
    # 40 MiB: above glibc's largest mmap threshold, so every new buffer is fresh memory (not reused heap)
    state = {"w": torch.randn(40 * mib // 4), "b": torch.randn(7).to(torch.bfloat16), "step": 3}
    cold = reshard.AsyncCheckpointer()
    with peak_rss_growth() as grown:
        cold.snapshot(state)
    assert grown() >= 39 * mib  # fresh buffers: the whole state becomes resident during the first snapshot
    del cold

    checkpointer = reshard.AsyncCheckpointer()
    assert checkpointer.warmup(state) == 40 * mib + 7 * 2
    buffers = dict(checkpointer._buffers)
    with peak_rss_growth() as grown:
        snapshot = checkpointer.snapshot(state)
    assert grown() < 2 * mib, f"peak RSS grew by {grown() / mib:.1f} MiB after warmup"
    assert all(checkpointer._buffers[k] is v for k, v in buffers.items())
    assert torch.equal(snapshot["w"], state["w"]) and snapshot["step"] == 3

    handle = checkpointer.save(state, tmp_path / "first")
    checkpointer.warmup(state)  # finalises the save in flight before zeroing its buffers
    assert handle.done()
    out = reshard.load(
        {"w": torch.zeros_like(state["w"]), "b": torch.zeros(7, dtype=torch.bfloat16), "step": 0}, tmp_path / "first"
    )
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])


@pytest.mark.unit
def test_one_save_in_flight_the_next_finalises_the_previous(tmp_path: Path) -> None:
    checkpointer = reshard.AsyncCheckpointer()
    first = checkpointer.save({"w": torch.randn(2_000_000)}, tmp_path / "a")
    second = checkpointer.save({"w": torch.randn(10)}, tmp_path / "b")
    assert first.done()  # the second save waited for it
    assert second.wait() is not None
    assert reshard.read_metadata(tmp_path / "a").world_size == 1
    # Each handle exposes its background save's stats.
    assert first.stats.bytes_written == 2_000_000 * 4 == first.stats.checkpoint_bytes
    assert second.stats.bytes_written == 40 and second.stats.seconds_write > 0


@pytest.mark.unit
def test_async_save_one_off_and_errors_are_raised_once(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(3)}, tmp_path / "taken")
    handle = reshard.async_save({"w": torch.ones(3)}, tmp_path / "taken")  # exists, no overwrite
    with pytest.raises(reshard.CheckpointExistsError):
        handle.wait()
    assert handle.wait() is None  # reported exactly once
    assert reshard.async_save({"w": torch.ones(3)}, tmp_path / "taken", overwrite=True).wait() is not None


def rank_async_save_with_failure(ctx: RankContext, path: str) -> list[str]:
    """Every rank saves through a dedicated gloo group; rank 1 may not write more than 64 bytes per file
    (a real EFBIG). Every rank's wait() raises the same error, once."""
    group = dist.new_group(backend="gloo")  # collective over all pool ranks: each calls it
    data = torch.arange(4096.0)[ctx.rank * 1024 : (ctx.rank + 1) * 1024].clone()
    state = {"w": reshard.ShardedTensor.from_rank_offsets("w", data, (0, ctx.rank, ctx.world_size))}
    checkpointer = reshard.AsyncCheckpointer(group=group, timeout=TIMEOUT)
    outcome = []
    previous = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if ctx.rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, previous[1]))
    try:
        handle = checkpointer.save(state, path)
        try:
            handle.wait()
            outcome.append("saved")
        except reshard.CheckpointError as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
        outcome.append(repr(handle.wait()))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous)
        signal.signal(signal.SIGXFSZ, handler)
    dist.destroy_process_group(group)
    return outcome


@pytest.mark.dist
def test_background_failure_surfaces_from_wait_on_every_rank(pool4: RankPool, tmp_path: Path) -> None:
    results = pool4.run_ok(rank_async_save_with_failure, str(tmp_path / "ckpt"))
    for errors, second in results:
        assert errors.startswith("StorageError:") and "failed on rank 1" in errors
        assert second == "None"
    assert not (tmp_path / "ckpt" / "metadata.json").exists()


CRASHING_SAVER = """
import os, signal, sys, torch, reshard
reshard.save({"w": torch.full((8,), 1.0)}, sys.argv[1] + "/previous")
handle = reshard.async_save({"w": torch.randn(64_000_000)}, sys.argv[1] + "/new")
print("snapshot taken", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # the process dies while the background thread writes
"""


@pytest.mark.dist
def test_crash_during_background_write_leaves_previous_checkpoint_intact(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_SAVER, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == -signal.SIGKILL and "snapshot taken" in done.stdout
    assert torch.equal(reshard.load({"w": torch.zeros(8)}, tmp_path / "previous")["w"], torch.full((8,), 1.0))
    assert not (tmp_path / "new" / "metadata.json").exists()
    with pytest.raises((reshard.IncompleteCheckpointError, reshard.CheckpointNotFoundError)):
        reshard.load({"w": torch.zeros(64_000_000)}, tmp_path / "new")
    assert os.path.isdir(tmp_path / "previous")


@pytest.mark.unit
def test_a_tied_weight_snapshotted_twice_is_saved_once_and_two_different_tensors_are_refused(tmp_path: Path) -> None:
    """Issue 34: the snapshot copies a tied weight once per path (two buffers, equal bytes): still one box, saved
    once. Two different tensors as one box of a key are refused with ShardingError naming both paths."""
    w = torch.arange(8.0)
    shared = reshard.ShardedTensor.from_rank_offsets("k", w)
    checkpointer = reshard.AsyncCheckpointer()
    result = checkpointer.save({"embed": shared, "head": shared}, tmp_path / "tied").wait()
    assert result.total_bytes == 32
    assert torch.equal(reshard.load({"k": torch.zeros(8)}, tmp_path / "tied")["k"], w)
    other = reshard.ShardedTensor.from_rank_offsets("k", -w)
    handle = checkpointer.save({"embed": shared, "head": other}, tmp_path / "untied")
    with pytest.raises(reshard.ShardingError, match="'embed' and 'head'"):
        handle.wait()
    assert not (tmp_path / "untied" / "metadata.json").exists()
