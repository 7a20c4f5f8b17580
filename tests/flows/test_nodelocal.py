"""Node-local checkpoints (reshard.NodeLocalCheckpoints) on real gloo ranks: 4 ranks as 2 simulated nodes of 2,
each node's directory ``<tmp>/node{node}``. Saved at TP2 x DP2, restored at TP4, TP1 x DP4 and the same layout
bit-exact; a lost node, a damaged byte, drains to a local directory and to S3, a drain killed and run again, and
retention per node."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import ScaledTensor, ShardedObject, ShardedTensor
from reshard.storage import Storage
from tests.faults import Fault, FaultyStorage, kill_pool, run_with_deaths
from tests.rankpool import RankContext, RankFailure, RankPool

pytestmark = pytest.mark.dist

NODE_SIZE = 2
WORLD = 4


def _global(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, key)))
    return torch.randn(shape, generator=gen)


def _part(full: torch.Tensor, axis: int, index: int, parts: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    size = full.shape[axis] // parts
    offset = tuple(index * size if a == axis else 0 for a in range(full.ndim))
    return full.narrow(axis, index * size, size).clone(), offset


def _sharded(
    key: str, full: torch.Tensor, axis: int, index: int, parts: int, replica: int, fill: bool
) -> ShardedTensor:
    local, offset = _part(full, axis, index, parts)
    return ShardedTensor(key, local if fill else torch.zeros_like(local), tuple(full.shape), offset, replica)


def training_state(tp: int, rank: int, *, fill: bool) -> dict[str, Any]:
    """Rank ``rank``'s state at TP ``tp`` x DP ``WORLD // tp`` (``fill``: the values; else a zeroed template):
    model weights split by TP (rows and columns) and replicated over DP, optimizer moments split over every rank
    (ZeRO), a scaled FP8 weight split by TP, a per-rank object and common values."""
    t, d = rank % tp, rank // tp
    fp8 = _global("fp8", (8, 4)).to(torch.float8_e4m3fn)
    data, offset = _part(fp8, 0, t, tp)
    scale = torch.arange(8 // 2, dtype=torch.float32).reshape(4, 1)[offset[0] // 2 : offset[0] // 2 + 8 // tp // 2]
    if not fill:
        data, scale = torch.zeros_like(data), torch.zeros_like(scale)
    return {
        "model": {
            "qkv": _sharded("qkv", _global("qkv", (8, 6)), 0, t, tp, d, fill),
            "proj": _sharded("proj", _global("proj", (6, 8)), 1, t, tp, d, fill),
            "fp8": ScaledTensor(ShardedTensor("fp8", data, (8, 4), offset, d), scale.clone(), "fp8_e4m3", (2, None)),
        },
        "optimizer": {"exp_avg": _sharded("exp_avg", _global("exp_avg", (8, 6)), 0, rank, WORLD, 0, fill)},
        "rng": ShardedObject("rng", {"rank": rank, "seed": 1000 + rank} if fill else None, (WORLD,), (rank,)),
        "step": 100 if fill else 0,
        "config": {"lr": 0.5, "tp": 2} if fill else {"lr": 0.0, "tp": 0},
    }


def _differences(template: dict[str, Any], got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """The leaves of ``template`` (filled in place) and ``got`` (what the load returned) whose bytes or values
    differ from ``want``."""
    out = []
    for group in ("model", "optimizer"):
        for key, leaf in want[group].items():
            mine = template[group][key]
            pairs = (
                [(mine.data.data, leaf.data.data), (mine.scale, leaf.scale)]
                if isinstance(leaf, ScaledTensor)
                else [(mine.data, leaf.data)]
            )
            if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in pairs):
                out.append(key)
    if got["rng"] != want["rng"].value:
        out.append("rng")
    if got["step"] != want["step"] or got["config"] != want["config"]:
        out.append("common")
    return out


def _checkpoints(ctx: RankContext, root: str, **kwargs: Any) -> reshard.NodeLocalCheckpoints:
    return reshard.NodeLocalCheckpoints(os.path.join(root, "node{node}"), node_size=NODE_SIZE, timeout=60, **kwargs)


def rank_save(ctx: RankContext, root: str, step: int) -> list[int]:
    tiers = _checkpoints(ctx, root)
    tiers.save(step, training_state(2, ctx.rank, fill=True))
    return tiers.steps()


def rank_restore(ctx: RankContext, root: str, step: int, tp: int) -> list[str]:
    tiers = _checkpoints(ctx, root)
    template = training_state(tp, ctx.rank, fill=False)
    restored = tiers.restore(step, template)
    return _differences(template, restored, training_state(tp, ctx.rank, fill=True))


def rank_restorable(ctx: RankContext, root: str) -> list[int]:
    return _checkpoints(ctx, root).restorable()


def rank_drain(ctx: RankContext, root: str, step: int, target: str, options: dict[str, Any] | None) -> None:
    _checkpoints(ctx, root).drain(step, target, storage_options=options)


def rank_load(ctx: RankContext, path: str, tp: int, options: dict[str, Any] | None) -> list[str]:
    template = training_state(tp, ctx.rank, fill=False)
    loaded = reshard.load(template, path, storage_options=options)
    return _differences(template, loaded, training_state(tp, ctx.rank, fill=True))


def _step_dir(root: Path, node: int, step: int) -> Path:
    return root / f"node{node}" / f"step_{step:09d}"


def test_save_at_tp2_dp2_restores_at_tp4_tp1_dp4_and_the_same_layout(pool4: RankPool, tmp_path: Path) -> None:
    assert pool4.run_ok(rank_save, str(tmp_path), 10) == [[10]] * WORLD
    node0, node1 = _step_dir(tmp_path, 0, 10), _step_dir(tmp_path, 1, 10)
    # The same metadata.json on both nodes; each node holds only the files its ranks wrote.
    assert (node0 / "metadata.json").read_bytes() == (node1 / "metadata.json").read_bytes()
    files0 = {p.name[-10:] for p in (node0 / "data").iterdir()}
    files1 = {p.name[-10:] for p in (node1 / "data").iterdir()}
    assert files0 == {"r00000.bin", "r00001.bin"} and files1 == {"r00002.bin", "r00003.bin"}, (files0, files1)
    assert pool4.run_ok(rank_restorable, str(tmp_path)) == [[10]] * WORLD
    for tp in (4, 1, 2):
        assert pool4.run_ok(rank_restore, str(tmp_path), 10, tp) == [[]] * WORLD, tp
    # Fetched files stay: after the TP4 restore every node needed every file.
    assert sorted(p.name for p in (node0 / "data").iterdir()) == sorted(p.name for p in (node1 / "data").iterdir())
    assert not list(tmp_path.rglob(".*part-*"))


def test_a_lost_node_makes_the_step_unrestorable_naming_its_files(pool4: RankPool, tmp_path: Path) -> None:
    pool4.run_ok(rank_save, str(tmp_path), 10)
    lost = sorted(p.name for p in (_step_dir(tmp_path, 1, 10) / "data").iterdir())
    shutil.rmtree(tmp_path / "node1")
    assert pool4.run_ok(rank_restorable, str(tmp_path)) == [[]] * WORLD
    results = pool4.run(rank_restore, str(tmp_path), 10, 4)
    assert all(isinstance(r, RankFailure) and r.error_class == "DataUnavailableError" for r in results), results
    assert all(name in results[0].message for name in lost), results[0].message
    assert not (tmp_path / "node1").exists()  # nothing moved


def test_a_damaged_byte_is_corrupt_checkpoint_error_on_every_rank(pool4: RankPool, tmp_path: Path) -> None:
    pool4.run_ok(rank_save, str(tmp_path), 10)
    step0 = _step_dir(tmp_path, 0, 10)
    metadata = reshard.read_metadata(str(step0))
    file = next(i for i, f in enumerate(metadata.files) if f.path.endswith("r00000.bin"))
    box = next(b for t in metadata.tensors.values() for b in t.boxes if b.file == file)
    damaged = step0 / metadata.files[file].path
    raw = bytearray(damaged.read_bytes())
    raw[box.byte_offset] ^= 0xFF
    damaged.write_bytes(bytes(raw))
    results = pool4.run(rank_restore, str(tmp_path), 10, 4)
    assert all(isinstance(r, RankFailure) and r.error_class == "CorruptCheckpointError" for r in results), results
    # Node 1 did not keep the damaged copy under the file's name, nor a temporary one.
    assert not (_step_dir(tmp_path, 1, 10) / metadata.files[file].path).exists()
    assert not list(tmp_path.rglob(".*part-*"))


def _same_files(local: Path, durable: Path) -> None:
    for path in [local / "metadata.json", *sorted((local / "data").iterdir())]:
        relative = path.relative_to(local)
        assert (durable / relative).read_bytes() == path.read_bytes(), relative


def test_drain_to_a_local_directory_and_to_s3_loads_bit_exact(pool4: RankPool, tmp_path: Path, s3_server: Any) -> None:
    root = tmp_path / "local"
    pool4.run_ok(rank_save, str(root), 10)
    durable = tmp_path / "durable" / "step_000000010"
    pool4.run_ok(rank_drain, str(root), 10, str(durable), None)
    pool4.run_ok(rank_drain, str(root), 10, str(durable), None)  # done already: nothing changes
    assert sorted(p.name for p in (durable / "data").iterdir()) == sorted(
        [p.name for p in (_step_dir(root, 0, 10) / "data").iterdir()]
        + [p.name for p in (_step_dir(root, 1, 10) / "data").iterdir()]
    )
    _same_files(_step_dir(root, 0, 10), durable)
    _same_files(_step_dir(root, 1, 10), durable)
    assert pool4.run_ok(rank_load, str(durable), 4, None) == [[]] * WORLD
    bucket = s3_server.new_bucket()
    url = f"s3://{bucket}/run/step_000000010"
    pool4.run_ok(rank_drain, str(root), 10, url, s3_server.storage_options)
    assert pool4.run_ok(rank_load, url, 1, s3_server.storage_options) == [[]] * WORLD


def rank_drain_faulty(ctx: RankContext, root: str, step: int, target: str, fault: dict[str, Any]) -> None:
    tiers = reshard.NodeLocalCheckpoints(os.path.join(root, "node{node}"), node_size=NODE_SIZE, timeout=10)
    tiers.drain(step, FaultyStorage(target, Fault.from_json(fault)))


def test_a_drain_killed_mid_copy_completes_when_run_again(tmp_path: Path) -> None:
    root, target = tmp_path / "local", tmp_path / "durable" / "step_000000010"
    marker = tmp_path / "killed.json"
    pool = RankPool(WORLD)
    try:
        pool.run_ok(rank_save, str(root), 10)
        fault = Fault("mid_write", rank=3, after_bytes=16, marker=str(marker))
        run = run_with_deaths(pool, rank_drain_faulty, str(root), 10, str(target), fault.to_json(), dead={3})
    finally:
        kill_pool(pool)
    assert marker.exists() and run.exitcodes[3] != 0
    assert all(isinstance(r, RankFailure) for r in run.results.values()), run.results
    assert not (target / "metadata.json").exists()
    killed_in = json.loads(marker.read_text())["file"]
    assert (target / "data" / killed_in).stat().st_size == 16  # a part of the file rank 3 was copying
    pool = RankPool(WORLD)
    try:
        pool.run_ok(rank_drain, str(root), 10, str(target), None)
        assert pool.run_ok(rank_load, str(target), 4, None) == [[]] * WORLD
    finally:
        pool.request_close()
        pool.close()
    _same_files(_step_dir(root, 1, 10), target)


def rank_retention(ctx: RankContext, root: str) -> list[list[int]]:
    tiers = _checkpoints(ctx, root, keep_last=1)
    seen = []
    for step in (10, 20, 30):
        if step == 20:
            tiers.keep({10})
        tiers.save(step, training_state(2, ctx.rank, fill=True))
        seen.append(tiers.steps())
    tiers.keep(set())
    tiers.save(40, training_state(2, ctx.rank, fill=True))
    seen.append(tiers.steps())
    return seen


def test_retention_per_node_keeps_the_newest_and_the_kept_steps(pool4: RankPool, tmp_path: Path) -> None:
    expected = [[10], [10, 20], [10, 30], [40]]
    assert pool4.run_ok(rank_retention, str(tmp_path)) == [expected] * WORLD
    for node in (0, 1):
        assert sorted(p.name for p in (tmp_path / f"node{node}").iterdir()) == ["step_000000040"]


class _KilledOnNode(reshard.NodeLocalCheckpoints):
    """Node-local checkpoints whose step storage SIGKILLs this rank at ``fault`` (a real local storage)."""

    fault: Fault | None = None

    def path_of(self, step: int) -> Storage:
        if self.fault is None:
            return super().path_of(step)
        return FaultyStorage(self.step_directory(step), self.fault)


def rank_save_killed(ctx: RankContext, root: str, step: int, fault: dict[str, Any]) -> list[int]:
    tiers = _KilledOnNode(os.path.join(root, "node{node}"), node_size=NODE_SIZE, timeout=10)
    tiers.fault = Fault.from_json(fault)
    tiers.save(step, training_state(2, ctx.rank, fill=True))
    return tiers.steps()


def test_a_save_killed_mid_write_on_another_node_then_saved_again_keeps_no_leftover(tmp_path: Path) -> None:
    marker = tmp_path / "killed.json"
    pool = RankPool(WORLD)
    try:
        pool.run_ok(rank_save, str(tmp_path), 10)
        fault = Fault("mid_write", rank=3, after_bytes=16, marker=str(marker))
        run = run_with_deaths(pool, rank_save_killed, str(tmp_path), 20, fault.to_json(), dead={3})
    finally:
        kill_pool(pool)
    assert marker.exists() and run.exitcodes[3] != 0
    assert all(isinstance(r, RankFailure) for r in run.results.values()), run.results
    leftovers = sorted((_step_dir(tmp_path, 1, 20) / "data").glob("*-r00003.bin"))
    assert [p.stat().st_size for p in leftovers] == [16]  # the part rank 3 wrote before it was killed
    assert not list(tmp_path.glob("node*/step_000000020/metadata.json"))
    pool = RankPool(WORLD)
    try:
        assert pool.run_ok(rank_save, str(tmp_path), 20) == [[10, 20]] * WORLD
        assert pool.run_ok(rank_restore, str(tmp_path), 20, 4) == [[]] * WORLD
        assert pool.run_ok(rank_restore, str(tmp_path), 10, 1) == [[]] * WORLD  # the earlier step is whole
    finally:
        pool.request_close()
        pool.close()
    metadata = reshard.read_metadata(str(_step_dir(tmp_path, 1, 20)))
    named = {f.path for f in metadata.files}
    for node in (0, 1):
        held = {f"data/{p.name}" for p in (_step_dir(tmp_path, node, 20) / "data").iterdir()}
        assert held <= named, held - named
    assert not any(p.exists() for p in leftovers)
