"""Checkpoints on S3 and GCS (real protocol servers on 127.0.0.1), direct and through node-local staging.

The servers run in this test process (moto's threaded server; fake-gcs-server as a subprocess); the
spawned ranks reach them over HTTP with the storage options passed as arguments. Faults come from a
loopback proxy that throttles, fails or drops a chosen fraction of requests.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.storage.objectstore import ObjectStorage, RetryPolicy
from tests.layouts import check_loaded, load_layout, save_layout
from tests.rankpool import RankContext, RankFailure, RankPool

pytestmark = pytest.mark.dist

TIMEOUT = 120.0
FAST_RETRY = RetryPolicy(max_attempts=8, base_delay_s=0.01, max_delay_s=0.2)


def _storage(url: str, options: dict[str, Any], retry: RetryPolicy = FAST_RETRY) -> ObjectStorage:
    return ObjectStorage(url, options, retry=retry)


def rank_save(ctx: RankContext, url: str, options: dict[str, Any], size: int) -> str | None:
    group, member = ctx.group_of_size(size)
    if not member:
        return None
    storage = _storage(url, options)
    try:
        reshard.save(save_layout(ctx.rank, size), storage, group=group, timeout=TIMEOUT)
    finally:
        storage.close()
    return "saved"


def rank_load(
    ctx: RankContext,
    url: str,
    options: dict[str, Any],
    size: int,
    saved_size: int,
    staging: str | None,
    node_group: str | None = None,
) -> dict[str, int] | None:
    group, member = ctx.group_of_size(size)
    if not member:
        return None
    template = load_layout(ctx.rank, size, saved_size)
    stats = reshard.LoadStats()
    storage = _storage(url, options)
    kwargs: dict[str, Any] = {}
    if staging is not None:
        node = ctx.rank // 2 if node_group else 0
        kwargs = {"options": reshard.LoadOptions(staging=reshard.StagingOptions(directory=f"{staging}/node{node}"))}
        if node_group:
            kwargs["node_group"] = ctx.groups[node_group if ctx.rank < 2 else "upper_half"]
    try:
        result = reshard.load(template, storage, group=group, timeout=TIMEOUT, stats=stats, **kwargs)
    finally:
        storage.close()
    check_loaded(result, template, ctx.rank, saved_size)
    return {"downloaded": stats.files_downloaded, "reused": stats.files_reused, "read": stats.bytes_read}


@pytest.mark.parametrize("mode", ["direct", "staging"])
def test_save_4_load_2_on_object_store(pool4: RankPool, object_store: Any, tmp_path: Path, mode: str) -> None:
    bucket = object_store.new_bucket()
    url = f"{object_store.protocol}://{bucket}/run/step_1"
    options = object_store.storage_options
    assert pool4.run_ok(rank_save, url, options, 4) == ["saved"] * 4
    metadata = reshard.read_metadata(url, storage_options=options)
    assert metadata.world_size == 4
    staging = str(tmp_path / "staging") if mode == "staging" else None
    results = pool4.run_ok(rank_load, url, options, 2, 4, staging)
    if staging is not None:
        # One node: every needed file downloaded exactly once, by one of its ranks; cleaned up afterwards.
        assert sum(r["downloaded"] for r in results[:2]) == len({f.path for f in metadata.files})
        assert not any(p.is_file() for p in (tmp_path / "staging").rglob("*"))
    # And back into 4 ranks from the same objects.
    pool4.run_ok(rank_load, url, options, 4, 4, staging)


def rank_save_seed_layout(ctx: RankContext, url: str, options: dict[str, Any]) -> None:
    """The seed report's situation: the tensor 'node0.only' and the object 'node0.rng' are written by
    node 0's ranks (0 and 1) alone; common state lives in metadata.json."""
    value = torch.arange(64.0).reshape(8, 8)
    state: dict[str, Any] = {"step": 1234, "config": {"lr": 0.5}}
    if ctx.rank < 2:
        state["only"] = reshard.ShardedTensor.from_rank_offsets(
            "node0.only", value[ctx.rank * 4 : ctx.rank * 4 + 4].clone(), (0, ctx.rank, 2)
        )
        state["rng"] = reshard.ShardedObject("node0.rng", {"seed": ctx.rank}, (2,), (ctx.rank,))
    state["mine"] = reshard.ShardedTensor.from_rank_offsets("mine", torch.full((2,), float(ctx.rank)), (0, ctx.rank, 4))
    storage = _storage(url, options)
    try:
        reshard.save(state, storage, timeout=TIMEOUT)
    finally:
        storage.close()


def rank_load_seed_layout(
    ctx: RankContext, url: str, options: dict[str, Any], staging_root: str, keep: bool
) -> dict[str, Any]:
    node = ctx.rank // 2
    node_group = ctx.groups["lower_half" if node == 0 else "upper_half"]
    target = torch.zeros(8, 8)
    template = {
        "only": reshard.ShardedTensor("node0.only", target, (8, 8), (0, 0)),  # every rank needs all of it
        "rng": reshard.ShardedObject("node0.rng", None, (2,), (ctx.rank % 2,)),
        "mine": reshard.ShardedTensor("mine", torch.zeros(8), (8,), (0,)),
        "step": 0,
        "config": {"lr": 0.0},
    }
    stats = reshard.LoadStats()
    storage = _storage(url, options)
    try:
        out = reshard.load(
            template,
            storage,
            timeout=TIMEOUT,
            stats=stats,
            options=reshard.LoadOptions(
                staging=reshard.StagingOptions(directory=f"{staging_root}/node{node}", keep=keep, node_group=node_group)
            ),
        )
    finally:
        storage.close()
    assert torch.equal(out["only"], torch.arange(64.0).reshape(8, 8))
    assert out["rng"] == {"seed": ctx.rank % 2}
    assert torch.equal(out["mine"], torch.arange(4.0).repeat_interleave(2))
    assert out["step"] == 1234 and out["config"] == {"lr": 0.5}
    return {"node": node, "downloaded": stats.files_downloaded, "reused": stats.files_reused}


def test_seed_scenario_two_nodes_stage_what_any_rank_needs(
    pool4: RankPool, object_store: Any, fault_proxy: Any, tmp_path: Path
) -> None:
    """4 ranks as 2 nodes with separate staging directories and explicit node groups. Node 1's ranks need
    tensors and an object whose bytes live only in node 0's data objects: the load succeeds, each object
    is downloaded at most once per node (counted at the server side, through the proxy), and the staging
    directories are empty afterwards."""
    bucket = object_store.new_bucket()
    url = f"{object_store.protocol}://{bucket}/ckpt"
    pool4.run_ok(rank_save_seed_layout, url, object_store.storage_options)
    metadata = reshard.read_metadata(url, storage_options=object_store.storage_options)
    files = [f.path for f in metadata.files]
    assert len(files) == 4
    proxy = fault_proxy(object_store)
    options = object_store.options(proxy.url)
    results = pool4.run_ok(rank_load_seed_layout, url, options, str(tmp_path / "staging"), False)
    for node in (0, 1):
        downloads = sum(r["downloaded"] for r in results if r["node"] == node)
        assert downloads == len(files)  # every file is needed by this node (the full 'only' and 'mine' tensors)
    for name in files:
        path = object_store.object_path(bucket, f"ckpt/{name}")
        whole_gets = proxy.count("GET", path, ranged=False)
        assert 1 <= whole_gets <= 2, (name, whole_gets)  # at most once per node
        assert proxy.count("GET", path, ranged=True) == 0  # every read was local
    assert not any(p.is_file() for p in (tmp_path / "staging").rglob("*"))

    # Staging again with keep=True: complete files are then reused, and a damaged one is not trusted.
    pool4.run_ok(rank_load_seed_layout, url, options, str(tmp_path / "kept"), True)
    staged = sorted(p for p in (tmp_path / "kept" / "node1").rglob("*.bin"))
    assert len(staged) == len(files)
    raw = bytearray(staged[0].read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    staged[0].write_bytes(bytes(raw))
    results = pool4.run_ok(rank_load_seed_layout, url, options, str(tmp_path / "kept"), True)
    node1 = [r for r in results if r["node"] == 1]
    assert sum(r["downloaded"] for r in node1) == 1 and sum(r["reused"] for r in node1) == len(files) - 1
    node0 = [r for r in results if r["node"] == 0]
    assert sum(r["downloaded"] for r in node0) == 0 and sum(r["reused"] for r in node0) == len(files)


def rank_save_in_halves_to_one_prefix(ctx: RankContext, url: str, options: dict[str, Any]) -> str:
    lower = ctx.rank < 2
    group = ctx.groups["lower_half" if lower else "upper_half"]
    value = 1.0 if lower else 2.0
    state = {
        "a": reshard.ShardedTensor.from_rank_offsets("a", torch.full((3,), value), (0, ctx.rank % 2, 2)),
        "b": torch.full((5,), value),
        "writer": "lower" if lower else "upper",
    }
    storage = _storage(url, options)
    try:
        reshard.save(state, storage, group=group, timeout=TIMEOUT)
    except (reshard.CheckpointExistsError, reshard.CheckpointLockedError) as exc:
        return f"refused: {exc}"
    finally:
        storage.close()
    return "saved"


def test_two_concurrent_saves_to_one_prefix_never_mix(pool4: RankPool, object_store: Any) -> None:
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    results = pool4.run_ok(rank_save_in_halves_to_one_prefix, url, object_store.storage_options)
    lower, upper = results[0], results[2]
    assert results[1] == lower and results[3] == upper
    # One committed; the other got a clear error: the lock was taken, or the checkpoint already existed.
    assert sorted([lower == "saved", upper == "saved"]) == [False, True], results
    loser = lower if lower != "saved" else upper
    assert any(
        reason in loser
        for reason in ("already holds a complete checkpoint", "another save committed", "being written by another save")
    ), loser
    out = reshard.load(
        {"a": torch.zeros(6), "b": torch.zeros(5), "writer": ""}, url, storage_options=object_store.storage_options
    )
    value = 1.0 if out["writer"] == "lower" else 2.0
    assert torch.equal(out["a"], torch.full((6,), value)) and torch.equal(out["b"], torch.full((5,), value))


def rank_save_with_failing_uploads_on_rank2(
    ctx: RankContext, url: str, good: dict[str, Any], bad: dict[str, Any]
) -> None:
    """Rank 2 talks to the store through a proxy that fails every request: its upload fails after the
    bounded retries."""
    options = bad if ctx.rank == 2 else good
    storage = _storage(url, options, RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.05))
    try:
        reshard.save(save_layout(ctx.rank, 4), storage, timeout=TIMEOUT)
    finally:
        storage.close()


def test_upload_failure_on_one_rank_fails_all_and_keeps_older_checkpoints(
    pool4: RankPool, object_store: Any, fault_proxy: Any
) -> None:
    bucket = object_store.new_bucket()
    options = object_store.storage_options
    old = f"{object_store.protocol}://{bucket}/step_1"
    pool4.run_ok(rank_save, old, options, 4)
    proxy = fault_proxy(object_store)
    proxy.set_faults(rate=1.0, mix={"503": 1.0})
    new = f"{object_store.protocol}://{bucket}/step_2"
    results = pool4.run(rank_save_with_failing_uploads_on_rank2, new, options, object_store.options(proxy.url))
    assert all(isinstance(r, RankFailure) for r in results)
    assert {r.error_class for r in results} == {"StorageError"}
    assert all("rank 2" in r.message and "failed after 3 attempts" in r.message for r in results)
    fs = ObjectStorage(new, options)
    try:
        assert not fs.exists("metadata.json")
    finally:
        fs.close()
    pool4.run_ok(rank_load, old, options, 2, 4, None)  # the older checkpoint is unharmed


def test_retries_survive_20_percent_faults_and_give_up_in_bounded_time(
    pool4: RankPool, object_store: Any, fault_proxy: Any, tmp_path: Path
) -> None:
    bucket = object_store.new_bucket()
    proxy = fault_proxy(object_store, seed=7)
    proxy.set_faults(rate=0.2, mix={"503": 1.0, "429": 1.0, "drop": 1.0})
    options = object_store.options(proxy.url)
    url = f"{object_store.protocol}://{bucket}/ckpt"
    pool4.run_ok(rank_save, url, options, 4)
    pool4.run_ok(rank_load, url, options, 2, 4, None)
    pool4.run_ok(rank_load, url, options, 4, 4, str(tmp_path / "staging"))
    assert proxy.count(faulted=True) > 0  # faults really happened and were retried
    proxy.set_faults(rate=1.0)
    started = time.monotonic()
    with pytest.raises(reshard.StorageError, match="failed after 8 attempts"):
        reshard.load({"step": 0}, _storage(url, options))
    assert time.monotonic() - started < 30


def test_gc_removes_only_unreferenced_old_data(object_store: Any) -> None:
    options = object_store.storage_options
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    reshard.save({"w": torch.ones(4)}, url, storage_options=options)
    storage = ObjectStorage(url, options)
    try:
        storage.put("data/deadbeef-r00000.bin", b"leftover of a failed save")
        kept = reshard.read_metadata(url, storage_options=options).files[0].path
        from reshard.flows.maintenance import collect_garbage

        assert collect_garbage(url, storage_options=options, min_age_s=3600) == []  # too young
        assert collect_garbage(url, storage_options=options, min_age_s=0, dry_run=True) == ["data/deadbeef-r00000.bin"]
        assert collect_garbage(url, storage_options=options, min_age_s=0) == ["data/deadbeef-r00000.bin"]
        assert storage.list_files("data") == [kept]
    finally:
        storage.close()
    assert torch.equal(reshard.load({"w": torch.zeros(4)}, url, storage_options=options)["w"], torch.ones(4))


def test_partitioned_metadata_on_an_object_store(object_store: Any) -> None:
    """Format version 6 through the object store: the parts are uploaded before metadata.json, a load reads them,
    a damaged part is refused, gc keeps the live parts and removes those of another save."""
    options = object_store.storage_options
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    parts = reshard.SaveOptions(metadata_parts=True)
    reshard.save({"w": torch.arange(6.0), "step": 2}, url, storage_options=options, options=parts)
    storage = ObjectStorage(url, options)
    try:
        metadata = reshard.read_metadata(url, storage_options=options)
        (part,) = metadata.parts
        assert storage.list_files("data") == sorted([metadata.files[0].path, part.path])
        loaded = reshard.load({"w": torch.zeros(6), "step": 0}, url, storage_options=options)
        assert torch.equal(loaded["w"], torch.arange(6.0)) and loaded["step"] == 2
        orphan = "data/0123456789abcdef0123456789abcdef-metadata-00000.json"
        storage.put(orphan, b"{}")
        from reshard.flows.maintenance import collect_garbage

        assert collect_garbage(url, storage_options=options, min_age_s=0) == [orphan]
        raw = storage.read_bytes(part.path)
        storage.put(part.path, raw[:-1] + b" ")
        with pytest.raises(reshard.CorruptCheckpointError, match="SHA-256"):
            reshard.load({"w": torch.zeros(6)}, url, storage_options=options)
    finally:
        storage.close()


def test_cli_inspect_and_gc_on_urls(object_store: Any) -> None:
    import json
    import subprocess
    import sys

    options = object_store.storage_options
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    reshard.save({"w": torch.ones(2, 3)}, url, storage_options=options)
    flags = [f"--storage-option=endpoint_url={object_store.endpoint_url}"]
    if object_store.protocol == "s3":
        flags += ["--storage-option=key=" + options["key"], "--storage-option=secret=" + options["secret"]]
    else:
        flags += ["--storage-option=token=anon", "--storage-option=project=" + options["project"]]
    env = {**os.environ, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "reshard", "inspect", url, "--json", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["tensors"][0]["global_shape"] == [2, 3]
    done = subprocess.run(
        [sys.executable, "-m", "reshard", "gc", url, "--dry-run", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "nothing to collect"


def test_incomplete_prefix_and_file_url(object_store: Any, tmp_path: Path) -> None:
    options = object_store.storage_options
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    reshard.save({"w": torch.ones(2)}, url, storage_options=options)
    storage = ObjectStorage(url, options)
    try:
        storage.delete("metadata.json")
    finally:
        storage.close()
    with pytest.raises(reshard.IncompleteCheckpointError):
        reshard.load({"w": torch.zeros(2)}, url, storage_options=options)
    with pytest.raises(reshard.CheckpointNotFoundError, match="does not exist"):
        reshard.read_metadata(f"{object_store.protocol}://{object_store.new_bucket()}/nothing", storage_options=options)
    reshard.save({"w": torch.ones(2)}, f"file://{tmp_path}/ck")
    assert torch.equal(reshard.load({"w": torch.zeros(2)}, f"file://{tmp_path}/ck")["w"], torch.ones(2))


def test_large_data_objects_are_uploaded_in_parts(object_store: Any, fault_proxy: Any) -> None:
    """A data object larger than a part goes up as several parts (S3 multipart upload; GCS parts
    composed into the object), and the parts are gone afterwards."""
    from reshard.storage.objectstore import TransferOptions

    proxy = fault_proxy(object_store)
    url = f"{object_store.protocol}://{object_store.new_bucket()}/big"
    part = 5 * 1024 * 1024  # S3's smallest part
    big = torch.randn(3 * part // 4 + 1000)  # 3 full parts of 5 MiB and a short fourth
    storage = ObjectStorage(url, object_store.options(proxy.url), transfer=TransferOptions(part_bytes=part))
    try:
        reshard.save({"w": big}, storage)
        names = storage.list_files()
    finally:
        storage.close()
    if object_store.protocol == "s3":
        assert proxy.count("PUT", contains="partNumber=") == 4
        assert proxy.count("POST", contains="uploadId=") == 1  # complete_multipart_upload
    else:
        assert proxy.count("POST", contains="/compose") == 1
    assert len(names) == 2 and names[-1] == "metadata.json"  # one data object, no parts left behind
    out = reshard.load({"w": torch.zeros_like(big)}, url, storage_options=object_store.storage_options)
    assert torch.equal(out["w"], big)


def test_checkpoint_manager_on_an_object_store(object_store: Any) -> None:
    """Steps, the latest pointer (one put), retention (prefix deletes) and the root lock on S3 and GCS."""
    root = f"{object_store.protocol}://{object_store.new_bucket()}/run"
    manager = reshard.CheckpointManager(root, keep_last=2, storage_options=object_store.storage_options)
    try:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.full((8,), float(step)), "step": step})
        assert manager.steps() == [2, 3]
        assert manager.latest_pointer() == 3
        template = {"w": torch.zeros(8), "step": -1}
        found = manager.load_latest_with_state(template)
        assert found is not None and found[0] == 3 and found[1]["step"] == 3
        assert torch.equal(template["w"], torch.full((8,), 3.0))
        assert not manager.root.exists(".lock")
    finally:
        manager.close()
