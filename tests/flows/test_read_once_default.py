"""Read once by default where the checkpoint's storage is shared (issue 33, item 3): object stores and shared
file systems read each byte once per replica group unless ``LoadOptions(read_once=False)``; local disks do
not; ``LoadStats.read_once`` and ``read_once_reason`` say which mode ran and why, the same on every rank.

No NFS or FUSE mount can be made on the test machine: a shared file system is marked as such by the user's
overrides (``LocalStorage(path, shared=True)``, ``RESHARD_SHARED_FILESYSTEM=1``), which take the same path
through the load as a detected one (:mod:`reshard.storage.filesystems`, tested on mountinfo texts)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import CheckpointError
from reshard.net.transports import ThreadGroup
from reshard.storage import LocalStorage, Storage
from reshard.storage.filesystems import SHARED_ENV
from tests.rankpool import RankContext, RankPool
from tests.threads import on_threads

FULL = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
CHUNKS = reshard.SaveOptions(checksum_chunk_bytes=128)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("read_once_default") / "ckpt"
    reshard.save({"w": FULL, "step": 1}, path, options=CHUNKS)
    return path


def _replica_template() -> dict[str, Any]:
    """Every rank needs the whole of ``w``: replicas, as data-parallel ranks are."""
    return {"w": torch.zeros_like(FULL), "step": 0}


def _load_on_threads(
    size: int, storages: list[Storage | Path], options: reshard.LoadOptions | None = None
) -> list[reshard.LoadStats | BaseException]:
    """Each rank of a ThreadGroup loads the replicated template from its storage; its stats (the load checked
    bit-exactly) or the exception it raised."""
    group = ThreadGroup(size, timeout=20.0)

    def run(rank: int) -> reshard.LoadStats | BaseException:
        stats = reshard.LoadStats()
        try:
            loaded = reshard.load(
                _replica_template(), storages[rank], group=group.member(rank), options=options, stats=stats
            )
        except CheckpointError as exc:
            return exc
        assert torch.equal(loaded["w"], FULL) and loaded["step"] == 1
        return stats

    return on_threads(size, run)


def _stats(results: list[reshard.LoadStats | BaseException]) -> list[reshard.LoadStats]:
    assert all(isinstance(r, reshard.LoadStats) for r in results), results
    return [r for r in results if isinstance(r, reshard.LoadStats)]


@pytest.mark.unit
def test_a_storage_marked_shared_reads_once_by_default(ckpt: Path) -> None:
    stats = _stats(_load_on_threads(2, [LocalStorage(ckpt, shared=True) for _ in range(2)]))
    assert sum(s.bytes_from_peers for s in stats) > 0
    assert sum(s.bytes_read for s in stats) == FULL.numel() * 4  # each byte read once over both ranks
    assert [(s.read_once, s.read_once_reason) for s in stats] == [(True, f"LocalStorage(shared=True) for {ckpt}")] * 2


@pytest.mark.unit
def test_a_local_directory_does_not_read_once_and_says_why(ckpt: Path) -> None:
    sharing = LocalStorage(ckpt).sharing()
    if sharing.shared:
        pytest.skip(f"the test directory is shared: {sharing.reason}")
    stats = _stats(_load_on_threads(2, [ckpt, ckpt]))
    assert all(s.bytes_from_peers == 0 and s.bytes_read == FULL.numel() * 4 for s in stats)
    assert [(s.read_once, s.read_once_reason) for s in stats] == [(False, sharing.reason)] * 2
    assert "(local" in sharing.reason


@pytest.mark.unit
def test_one_ranks_shared_storage_turns_read_once_on_for_every_rank(ckpt: Path) -> None:
    stats = _stats(_load_on_threads(2, [LocalStorage(ckpt, shared=False), LocalStorage(ckpt, shared=True)]))
    assert sum(s.bytes_from_peers for s in stats) > 0
    reason = f"LocalStorage(shared=True) for {ckpt} (on rank 1)"
    assert [(s.read_once, s.read_once_reason) for s in stats] == [(True, reason)] * 2


@pytest.mark.unit
@pytest.mark.parametrize(
    ("size", "options", "read_once", "reason"),
    [
        (2, reshard.LoadOptions(read_once=False), False, "LoadOptions(read_once=False)"),
        (2, reshard.LoadOptions(read_once=True), True, "LoadOptions(read_once=True)"),
        (1, None, False, "one rank"),
    ],
    ids=["off", "on", "one_rank"],
)
def test_the_options_and_a_lone_rank_decide_before_the_storage(
    ckpt: Path, size: int, options: reshard.LoadOptions | None, read_once: bool, reason: str
) -> None:
    stats = _stats(_load_on_threads(size, [LocalStorage(ckpt, shared=not read_once)] * size, options))
    assert [(s.read_once, s.read_once_reason) for s in stats] == [(read_once, reason)] * size
    assert (sum(s.bytes_from_peers for s in stats) > 0) is read_once


@pytest.mark.unit
def test_node_staging_reads_the_staged_copies_instead(ckpt: Path, tmp_path: Path) -> None:
    options = reshard.LoadOptions(staging=reshard.StagingOptions(directory=str(tmp_path / "stage")))
    stats = _stats(_load_on_threads(2, [LocalStorage(ckpt, shared=True)] * 2, options))
    assert [(s.read_once, s.read_once_reason) for s in stats] == [
        (False, "staging downloads each file once per node")
    ] * 2


@pytest.mark.unit
def test_an_override_reshard_cannot_read_fails_every_rank(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARED_ENV, "sometimes")
    results = _load_on_threads(2, [ckpt, ckpt])
    assert all(isinstance(r, CheckpointError) and f"{SHARED_ENV}='sometimes'" in str(r) for r in results), results


def rank_load_replicas(ctx: RankContext, path: str, env: str | None) -> dict[str, Any]:
    """Every rank loads the whole of ``w`` from the directory ``path`` (a plain path, as a training job passes
    it), with ``RESHARD_SHARED_FILESYSTEM`` set to ``env`` for the load."""
    before = os.environ.pop(SHARED_ENV, None)
    if env is not None:
        os.environ[SHARED_ENV] = env
    try:
        stats = reshard.LoadStats()
        loaded = reshard.load(_replica_template(), path, stats=stats)
    finally:
        os.environ.pop(SHARED_ENV, None)
        if before is not None:
            os.environ[SHARED_ENV] = before
    return {
        "exact": bool(torch.equal(loaded["w"], FULL)) and loaded["step"] == 1,
        "from_peers": stats.bytes_from_peers,
        "read": stats.bytes_read,
        "read_once": stats.read_once,
        "reason": stats.read_once_reason,
    }


@pytest.mark.dist
def test_gloo_ranks_on_a_shared_file_system_read_once_bit_exactly(pool4: RankPool, ckpt: Path) -> None:
    """Four gloo ranks, replicas of ``w``: with the environment marking local paths shared, storage serves
    each byte once over the group and the rest travels between ranks; without it, on this machine's local
    disk, every replica reads its own copy, and the stats say why."""
    shared = pool4.run_ok(rank_load_replicas, str(ckpt), "1")
    assert all(r["exact"] for r in shared)
    assert sum(r["from_peers"] for r in shared) == 3 * FULL.numel() * 4
    assert sum(r["read"] for r in shared) == FULL.numel() * 4
    assert {(r["read_once"], r["reason"]) for r in shared} == {(True, f"{SHARED_ENV}=1 ({ckpt} taken as shared)")}
    local = LocalStorage(ckpt).sharing()
    if local.shared:
        pytest.skip(f"the test directory is shared: {local.reason}")
    plain = pool4.run_ok(rank_load_replicas, str(ckpt), None)
    assert all(r["exact"] and r["from_peers"] == 0 and r["read"] == FULL.numel() * 4 for r in plain)
    assert {(r["read_once"], r["reason"]) for r in plain} == {(False, local.reason)}
