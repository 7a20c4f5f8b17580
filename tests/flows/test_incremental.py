"""Incremental checkpoints: a save writes only the boxes whose content changed and references the rest,
and no deletion (retention, ``reshard gc``, an overwrite) ever removes a file that a kept checkpoint uses.

Real files (and real S3 and GCS protocol servers), real processes: the LoRA run is the demo GPT with
adapters on four spawned ranks at TP=2 x PP=2; the kill -9 runs a real save in a child process that
SIGKILLs itself at a chosen point (tests/faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch
import xxhash

import reshard
from reshard.cli import main as cli_main
from reshard.demo.run import state_digest
from reshard.demo.training import Trainer, TrainingConfig
from reshard.flows.maintenance import collect_garbage, validate_checkpoint
from reshard.flows.manager import scan_root, step_name
from reshard.io.references import REFERENCES_DIR, RETIRED_FILE
from reshard.io.retirement import delete_checkpoint
from reshard.models.config import LoraConfig, ModelConfig, is_adapter_key
from reshard.net.transports import ThreadGroup
from reshard.storage import LocalStorage
from tests.demo_groups import layout_groups
from tests.rankpool import RankContext, RankPool
from tests.threads import on_threads

ROOT = Path(__file__).resolve().parents[2]
HASHED = reshard.SaveOptions(content_hash=True)


def frozen_and_trained(step: int) -> dict[str, Any]:
    """A state whose ``frozen`` tensors never change and whose ``adapter`` and ``step`` do."""
    g = torch.Generator().manual_seed(1)
    frozen = {f"layer{i}": torch.randn(64, 64, generator=g) for i in range(9)}
    return {
        "frozen": frozen,
        "adapter": torch.full((64, 64), float(step)),
        "rng": reshard.ShardedObject("rng", {"step": step}, (1,), (0,)),
        "step": step,
    }


def template() -> dict[str, Any]:
    return {
        "frozen": {f"layer{i}": torch.zeros(64, 64) for i in range(9)},
        "adapter": torch.zeros(64, 64),
        "rng": reshard.ShardedObject("rng", None, (1,), (0,)),
        "step": -1,
    }


def assert_loads_as(path: Path | str, step: int, **kwargs: Any) -> None:
    loaded = reshard.load(template(), path, **kwargs)
    expected = frozen_and_trained(step)
    for key, value in expected["frozen"].items():
        assert torch.equal(loaded["frozen"][key], value), key
    assert torch.equal(loaded["adapter"], expected["adapter"])
    assert loaded["rng"] == {"step": step} and loaded["step"] == step


@pytest.mark.dist  # seconds of fsync-heavy saves: kept out of the fast tier (make test-fast)
def test_only_the_changed_boxes_are_written(tmp_path: Path) -> None:
    first = reshard.save(frozen_and_trained(1), tmp_path / "a", options=HASHED)
    assert first.referenced_bytes == 0 and first.metadata is not None and first.metadata.content_hashes
    second = reshard.save(frozen_and_trained(2), tmp_path / "b", base=tmp_path / "a")
    adapter_bytes = 64 * 64 * 4
    assert second.total_bytes == first.total_bytes == 10 * adapter_bytes
    assert second.referenced_bytes == 9 * adapter_bytes  # the nine frozen tensors
    blob = second.metadata.objects["rng"].entries[0].byte_length  # type: ignore[union-attr]
    assert adapter_bytes + blob <= second.file_bytes < adapter_bytes + blob + 64  # the adapter and the blob
    metadata = reshard.read_metadata(tmp_path / "b")
    assert metadata.format_version == 4 and metadata.referenced_checkpoints == ("a",)
    own = {i for i, f in enumerate(metadata.files) if f.checkpoint is None}
    for key, tensor in metadata.tensors.items():
        assert all((box.file in own) == (key == "adapter") for box in tensor.boxes), key
    assert_loads_as(tmp_path / "b", 2)
    assert_loads_as(tmp_path / "a", 1)
    # A third save refers to the file that holds the bytes (a's), never to b's references: no chain.
    third = reshard.save(frozen_and_trained(3), tmp_path / "c", base=tmp_path / "b")
    assert third.metadata is not None and third.metadata.referenced_checkpoints == ("a",)
    assert_loads_as(tmp_path / "c", 3, options=reshard.LoadOptions(verify=False))
    # Unchanged state: nothing but the object blob is written.
    fourth = reshard.save(frozen_and_trained(3), tmp_path / "d", base=tmp_path / "c")
    assert fourth.metadata is not None and fourth.metadata.referenced_checkpoints == ("a", "c")
    assert fourth.referenced_bytes == fourth.total_bytes
    assert validate_checkpoint(tmp_path / "d") == []


def _crc_preserving_change(data: bytes) -> bytes:
    """Other bytes with the same CRC-32C: CRC is affine over GF(2), so 33 single-bit changes are linearly
    dependent in their effect on the 32-bit CRC; flipping a dependent set leaves the CRC unchanged."""
    zero = crc32c.crc32c(bytes(len(data)))
    rows: list[tuple[int, int]] = []  # (effect on the CRC, set of bit positions as a mask), reduced
    for bit in range(64):
        flip = bytearray(len(data))
        flip[8 + bit // 8] = 1 << (bit % 8)
        effect, combo = crc32c.crc32c(bytes(flip)) ^ zero, 1 << bit
        for row_effect, row_combo in rows:
            if effect ^ row_effect < effect:
                effect, combo = effect ^ row_effect, combo ^ row_combo
        if effect == 0:
            changed = bytearray(data)
            for b in range(64):
                if combo >> b & 1:
                    changed[8 + b // 8] ^= 1 << (b % 8)
            return bytes(changed)
        rows.append((effect, combo))
        rows.sort(reverse=True)
    raise AssertionError("no dependent set among 64 bit flips")


@pytest.mark.unit
def test_a_box_whose_crc_matches_but_bytes_differ_is_rewritten(tmp_path: Path) -> None:
    old = torch.arange(256, dtype=torch.uint8).repeat(4)
    new_bytes = _crc_preserving_change(bytes(old.numpy()))
    new = torch.frombuffer(bytearray(new_bytes), dtype=torch.uint8)
    assert crc32c.crc32c(new_bytes) == crc32c.crc32c(bytes(old.numpy())) and not torch.equal(new, old)
    assert xxhash.xxh3_128_digest(new_bytes) != xxhash.xxh3_128_digest(bytes(old.numpy()))
    options = reshard.SaveOptions(content_hash=True, checksum_chunk_bytes=1 << 20)  # one chunk: one CRC per box
    reshard.save({"t": old, "same": old.clone()}, tmp_path / "a", options=options)
    reshard.save({"t": new, "same": old.clone()}, tmp_path / "b", options=options, base=tmp_path / "a")
    a, b = reshard.read_metadata(tmp_path / "a"), reshard.read_metadata(tmp_path / "b")
    assert a.tensors["t"].boxes[0].checksums == b.tensors["t"].boxes[0].checksums  # the CRCs collide
    assert b.files[b.tensors["t"].boxes[0].file].checkpoint is None  # but the strong hash decided: rewritten
    assert b.files[b.tensors["same"].boxes[0].file].checkpoint == "a"
    loaded = reshard.load(
        {"t": torch.zeros(1024, dtype=torch.uint8), "same": torch.zeros(1024, dtype=torch.uint8)}, tmp_path / "b"
    )
    assert torch.equal(loaded["t"], new) and torch.equal(loaded["same"], old)


@pytest.mark.unit
def test_a_layout_change_writes_the_changed_tensors_in_full(tmp_path: Path) -> None:
    """Saved by 2 ranks (``w`` split in two rows), then by 4 (``w`` in four): ``w``'s boxes differ, so it is
    written again; the replicated ``b`` keeps its box and is referenced."""
    w = torch.arange(64.0).reshape(8, 8)
    b = torch.arange(8.0)

    def save_on(ranks: int, path: Path, base: Path | None) -> None:
        group = ThreadGroup(ranks)

        def run(rank: int) -> None:
            rows = 8 // ranks
            state = {
                "w": reshard.ShardedTensor.from_rank_offsets(
                    "w", w[rank * rows : (rank + 1) * rows].clone(), (0, rank, ranks)
                ),
                "b": b.clone(),
            }
            reshard.save(state, path, group=group.member(rank), options=HASHED, base=base)

        on_threads(ranks, run)

    save_on(2, tmp_path / "two", None)
    save_on(4, tmp_path / "four", tmp_path / "two")
    metadata = reshard.read_metadata(tmp_path / "four")
    assert len(metadata.tensors["w"].boxes) == 4
    assert all(metadata.files[box.file].checkpoint is None for box in metadata.tensors["w"].boxes)
    assert metadata.files[metadata.tensors["b"].boxes[0].file].checkpoint == "two"
    loaded = reshard.load({"w": torch.zeros(8, 8), "b": torch.zeros(8)}, tmp_path / "four")
    assert torch.equal(loaded["w"], w) and torch.equal(loaded["b"], b)


@pytest.mark.unit
def test_a_staged_load_of_an_incremental_checkpoint(tmp_path: Path) -> None:
    reshard.save(frozen_and_trained(1), tmp_path / "ckpts" / "a", options=HASHED)
    reshard.save(frozen_and_trained(2), tmp_path / "ckpts" / "b", base=tmp_path / "ckpts" / "a")
    staging = reshard.StagingOptions(directory=tmp_path / "staging", keep=True)
    assert_loads_as(tmp_path / "ckpts" / "b", 2, options=reshard.LoadOptions(staging=staging))
    staged = sorted(p.relative_to(tmp_path / "staging").as_posix() for p in (tmp_path / "staging").rglob("*.bin"))
    assert len(staged) == 2 and staged[0].startswith("data/") and staged[1].startswith("referenced/a/data/")


# ---- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.unit
def test_a_base_that_cannot_be_referenced_is_an_error_and_nothing_is_written(tmp_path: Path) -> None:
    reshard.save(frozen_and_trained(1), tmp_path / "plain")  # no content hashes
    reshard.save(frozen_and_trained(1), tmp_path / "hashed", options=HASHED)
    (tmp_path / "elsewhere").mkdir()
    reshard.save(frozen_and_trained(1), tmp_path / "elsewhere" / "hashed", options=HASHED)
    cases = [
        ("plain", "records no content hashes"),
        ("elsewhere/hashed", "must be a sibling"),
        ("target", "cannot be its own base"),
    ]
    for base, match in cases:
        with pytest.raises(reshard.CheckpointError, match=match):
            reshard.save(frozen_and_trained(2), tmp_path / "target", base=tmp_path / base)
    with pytest.raises(reshard.CheckpointError, match="chunks of 4194304 bytes, this save in chunks of 4096"):
        reshard.save(
            frozen_and_trained(2),
            tmp_path / "target",
            base=tmp_path / "hashed",
            options=reshard.SaveOptions(checksum_chunk_bytes=4096),
        )
    assert not (tmp_path / "target" / "metadata.json").exists()
    assert not list((tmp_path / "target").rglob("*.bin"))
    assert not (tmp_path / "hashed" / REFERENCES_DIR).exists()


@pytest.mark.unit
def test_a_base_that_lost_a_file_fails_the_save_and_leaves_no_marker(tmp_path: Path) -> None:
    """A save that trusts its base (``verify_base=False``) learns of the lost file only from the check of the
    referenced files' sizes before its commit: it fails there. (A verifying save, the default, cannot read the
    boxes back and writes them instead: tests/flows/test_incremental_verify.py.)"""
    reshard.save(frozen_and_trained(1), tmp_path / "a", options=HASHED)
    for data_file in (tmp_path / "a" / "data").iterdir():
        data_file.unlink()
    trusting = reshard.SaveOptions(verify_base=False)
    with pytest.raises(reshard.CheckpointError, match=r"cannot reference its base: data file .* of checkpoint a"):
        reshard.save(frozen_and_trained(2), tmp_path / "b", base=tmp_path / "a", options=trusting)
    assert not (tmp_path / "b" / "metadata.json").exists() and not list((tmp_path / "b").rglob("*.bin"))
    assert not list((tmp_path / "a" / REFERENCES_DIR).iterdir())


# ---- deletions that must keep referenced files ------------------------------------------------------------------


def _bin_files(path: Path) -> set[str]:
    return {p.name for p in path.rglob("*.bin")}


@pytest.mark.dist  # seconds of fsync-heavy saves: kept out of the fast tier (make test-fast)
def test_retention_and_gc_keep_every_referenced_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    first = manager.save(1, frozen_and_trained(1))
    first_files = _bin_files(root / step_name(1))
    for step in (2, 3, 4):
        result = manager.save(step, frozen_and_trained(step))
        assert result.referenced_bytes == 9 * 64 * 64 * 4, step
        for child in sorted(root.iterdir()):
            if child.is_dir():
                collect_garbage(child, min_age_s=0)
        assert_loads_as(root / step_name(step), step)
    infos = {i.step: i for i in scan_root(LocalStorage(root))}
    assert {s: i.status for s, i in infos.items()} == {1: "retired", 4: "complete"}  # 2 and 3: nothing referenced
    assert infos[4].referenced_bytes == 9 * 64 * 64 * 4 and infos[4].written_bytes == 64 * 64 * 4
    # Step 1 keeps exactly its data file (the frozen tensors), no metadata: it is not loadable and not incomplete.
    assert _bin_files(root / step_name(1)) == first_files and not (root / step_name(1) / "metadata.json").exists()
    assert (root / step_name(1) / RETIRED_FILE).exists() and len(
        list((root / step_name(1) / REFERENCES_DIR).iterdir())
    ) == 1
    with pytest.raises(reshard.CheckpointNotFoundError, match="retired"):
        reshard.load(template(), root / step_name(1))
    assert reshard.CheckpointManager(root).load_latest(template()) == 4
    assert validate_checkpoint(root / step_name(4)) == []
    assert cli_main(["ls", str(root)]) == 0
    listing = capsys.readouterr().out
    assert "step_000000001  retired" in listing and "written, 144.0 KiB referenced)" in listing
    assert cli_main(["inspect", str(root / step_name(4))]) == 0
    assert "16.0 KiB of tensors written, 144.0 KiB referenced in step_000000001" in capsys.readouterr().out
    # A full save (a manager without incremental) references nothing: the retired step goes whole.
    reshard.CheckpointManager(root, keep_last=1).save(5, frozen_and_trained(5))
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [step_name(5)]
    assert first.total_bytes == 10 * 64 * 64 * 4


@pytest.mark.unit
def test_overwriting_or_deleting_a_referenced_checkpoint_keeps_what_is_referenced(tmp_path: Path) -> None:
    reshard.save(frozen_and_trained(1), tmp_path / "a", options=HASHED)
    old_files = _bin_files(tmp_path / "a")
    reshard.save(frozen_and_trained(2), tmp_path / "b", base=tmp_path / "a")
    changed = frozen_and_trained(7)
    changed["frozen"] = {k: v + 1 for k, v in changed["frozen"].items()}
    reshard.save(changed, tmp_path / "a", overwrite=True, options=HASHED)
    assert old_files < _bin_files(tmp_path / "a")  # the overwrite kept the file b references
    assert collect_garbage(tmp_path / "a", min_age_s=0) == []  # and gc does too
    assert_loads_as(tmp_path / "b", 2)
    # Once b is gone, its marker is stale and the old file is garbage.
    assert delete_checkpoint(LocalStorage(tmp_path / "b")) is False and not (tmp_path / "b").exists()
    removed = collect_garbage(tmp_path / "a", min_age_s=0)
    assert {Path(n).name for n in removed if n.endswith(".bin")} == old_files
    assert any(n.startswith(f"{REFERENCES_DIR}/") for n in removed)
    assert _bin_files(tmp_path / "a") == _bin_files(tmp_path / "a") - old_files
    loaded = reshard.load(template(), tmp_path / "a")
    assert torch.equal(loaded["frozen"]["layer0"], changed["frozen"]["layer0"])


@pytest.mark.unit
def test_a_manager_resumes_incremental_saves_after_full_ones(tmp_path: Path) -> None:
    root = tmp_path / "root"
    reshard.CheckpointManager(root).save(1, frozen_and_trained(1))  # no content hashes: cannot be a base
    manager = reshard.CheckpointManager(root, incremental=True)
    assert manager.save(2, frozen_and_trained(2)).referenced_bytes == 0  # full, with hashes
    assert manager.save(3, frozen_and_trained(3)).referenced_bytes == 9 * 64 * 64 * 4
    assert manager.load_latest(template()) == 3


# ---- kill -9 during an incremental save -------------------------------------------------------------------------

KILL_SCRIPT = textwrap.dedent(
    """
    import sys
    import reshard
    from reshard.flows.manager import step_name
    from tests.faults import Fault, FaultyRoot
    from tests.flows.test_incremental import frozen_and_trained

    root, point, marker = sys.argv[1:4]
    clean = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    clean.save(1, frozen_and_trained(1))
    clean.save(2, frozen_and_trained(2))
    fault = Fault(point=point, rank=0, after_bytes=1000, marker=marker)
    manager = reshard.CheckpointManager(FaultyRoot(root, step_name(3), fault), keep_last=1, incremental=True)
    manager.save(3, frozen_and_trained(3))
    print("not killed")
    """
)


@pytest.mark.dist
@pytest.mark.parametrize("point", ["mid_write", "in_commit"])
def test_kill_9_during_an_incremental_save_keeps_the_previous_checkpoints(tmp_path: Path, point: str) -> None:
    root, marker = tmp_path / "root", tmp_path / "killed.json"
    child = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT, str(root), point, str(marker)],
        check=False,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"},  # this checkout's reshard
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert json.loads(marker.read_text())["point"] == point
    statuses = {i.step: i.status for i in scan_root(LocalStorage(root))}
    assert statuses == {1: "retired", 2: "complete", 3: "incomplete"}
    first_files = _bin_files(root / step_name(1))
    assert len(first_files) == 1
    assert_loads_as(root / step_name(2), 2)
    assert validate_checkpoint(root / step_name(2)) == []
    # gc of every directory (the dead save's marker is stale: its save never committed and its lock is gone)
    for child_dir in sorted(root.iterdir()):
        if child_dir.is_dir() and child_dir.name != step_name(3):
            collect_garbage(child_dir, min_age_s=0)
    assert _bin_files(root / step_name(1)) == first_files
    assert_loads_as(root / step_name(2), 2)
    # The job resumes: the next save of step 3 commits, retention removes the dead save's leftovers.
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{step_name(3)}: it has no metadata.json"):
        assert manager.load_latest(template()) == 2
    manager.save(3, frozen_and_trained(3), overwrite=True)
    assert_loads_as(root / step_name(3), 3)
    markers = sorted(p.name for p in (root / step_name(1) / REFERENCES_DIR).iterdir())
    assert len(markers) == 1 and markers[0].startswith(f"{step_name(3)}.")


# ---- object stores -------------------------------------------------------------------------------------------


@pytest.mark.dist
def test_incremental_saves_on_an_object_store(object_store: Any) -> None:
    url = f"{object_store.protocol}://{object_store.new_bucket()}/run"
    options = object_store.storage_options
    manager = reshard.CheckpointManager(url, keep_last=1, incremental=True, storage_options=options)
    try:
        for step in (1, 2):
            result = manager.save(step, frozen_and_trained(step))
            assert result.referenced_bytes == (0 if step == 1 else 9 * 64 * 64 * 4)
        assert {i.step: i.status for i in scan_root(manager.root)} == {1: "retired", 2: "complete"}
        latest = f"{url}/{step_name(2)}"
        assert validate_checkpoint(latest, storage_options=options) == []
        metadata = reshard.read_metadata(latest, storage_options=options)
        assert metadata.referenced_checkpoints == (step_name(1),)
        assert collect_garbage(f"{url}/{step_name(1)}", min_age_s=0, storage_options=options) == []
        assert_loads_as(latest, 2, storage_options=options)
    finally:
        manager.close()


# ---- the LoRA run at TP=2 x PP=2 --------------------------------------------------------------------------------

LORA = LoraConfig(init_b="random").to_dict()


def _lora_trainer(layout: str) -> Trainer | None:
    groups = layout_groups(layout)
    if groups is None:
        return None
    return Trainer(ModelConfig(), TrainingConfig(), groups, LoraConfig.from_dict(LORA))


LOAD_LAYOUTS = ("tp=1", "pp=2,dp=2")
"""Each step is loaded right after its save at one of these, in turn (neither is the saving layout)."""


def rank_lora_incremental_run(ctx: RankContext, root: str, steps: int) -> dict[str, Any] | None:
    """Train at TP=2 x PP=2 with the base frozen; after every step, an incremental manager save (keep_last=2),
    a load of that step at another layout, and (rank 0) ``reshard gc`` of every step directory."""
    for layout in LOAD_LAYOUTS:  # creating groups is collective over the pool: every rank, in this order
        layout_groups(layout)
    trainer = _lora_trainer("tp=2,pp=2")
    if trainer is None:
        return None
    group = trainer.groups.layout.process_group
    manager = reshard.CheckpointManager(root, keep_last=2, incremental=True, group=group)
    out: dict[str, Any] = {"digests": {}, "loaded": {}, "results": {}}
    for i in range(steps):
        trainer.train_step()
        result = manager.save(trainer.step, trainer.sharded_state_dict())
        out["digests"][trainer.step] = state_digest(trainer.full_state())
        out["results"][trainer.step] = {"file_bytes": result.file_bytes, "referenced_bytes": result.referenced_bytes}
        loaded = rank_lora_load(ctx, LOAD_LAYOUTS[i % 2], str(Path(root) / step_name(trainer.step)))
        if loaded is not None:
            out["loaded"][trainer.step] = loaded
        if ctx.rank == 0:
            for child in sorted(Path(root).iterdir()):
                if child.is_dir():
                    collect_garbage(child, min_age_s=0)
    manager.close()
    return out


def rank_lora_load(ctx: RankContext, layout: str, path: str) -> str | None:
    trainer = _lora_trainer(layout)
    if trainer is None:
        return None
    trainer.load(path)
    return state_digest(trainer.full_state())


@pytest.mark.dist
def test_lora_incremental_checkpoints_write_only_what_training_changes(pool4: RankPool, tmp_path: Path) -> None:
    root = tmp_path / "root"
    run = pool4.run_ok(rank_lora_incremental_run, str(root), 4)[0]
    infos = {i.step: i for i in scan_root(LocalStorage(root))}
    assert {s: i.status for s, i in infos.items()} == {1: "retired", 3: "complete", 4: "complete"}
    for step in (2, 3, 4):
        metadata = reshard.read_metadata(root / step_name(step)) if step != 2 else None
        if metadata is None:
            continue
        written_tensors = {
            key: sum(b.byte_length for b in t.boxes if metadata.files[b.file].checkpoint is None)
            for key, t in metadata.tensors.items()
        }
        trained = sum(
            t.nbytes for key, t in metadata.tensors.items() if is_adapter_key(key) or key.startswith("optimizer.")
        )
        rng = sum(e.byte_length for o in metadata.objects.values() for e in o.entries)
        written = sum(written_tensors.values()) + rng
        assert written <= 1.01 * (trained + rng), step
        assert all(
            v == 0 for k, v in written_tensors.items() if not (is_adapter_key(k) or k.startswith("optimizer."))
        ), step
        assert run["results"][step]["referenced_bytes"] == metadata.total_bytes - sum(written_tensors.values())
        assert run["results"][step]["file_bytes"] < 1.01 * (trained + rng) + 64 * sum(
            len(t.boxes) for t in metadata.tensors.values()
        )
    assert run["loaded"] == run["digests"]  # every step, loaded at another layout right after its save
    for step, layout in ((3, "pp=2,dp=2"), (4, "tp=1")):  # and the kept ones after retention and gc
        digests = pool4.run_ok(rank_lora_load, layout, str(root / step_name(step)))
        assert digests[0] == run["digests"][step], (step, layout)


@pytest.mark.unit
def test_a_save_into_a_retired_directory_and_retention_of_a_cut_short_deletion(tmp_path: Path) -> None:
    """A retired directory saved into becomes a checkpoint again (its referenced file still kept); a holder
    that lost its metadata.json without being retired (a deletion cut short) is retired by retention, not
    removed as an interrupted save."""
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True)
    manager.save(1, frozen_and_trained(1))
    manager.save(2, frozen_and_trained(2))
    held = _bin_files(root / step_name(1))
    assert (root / step_name(1) / RETIRED_FILE).exists()
    reshard.save(frozen_and_trained(7), root / step_name(1), options=HASHED)
    assert not (root / step_name(1) / RETIRED_FILE).exists()
    assert {i.step: i.status for i in scan_root(LocalStorage(root))} == {1: "complete", 2: "complete"}
    assert held < _bin_files(root / step_name(1))  # the file step 2 references is still there
    assert_loads_as(root / step_name(1), 7)
    assert_loads_as(root / step_name(2), 2)
    # Step 1's metadata.json disappears without retirement (an older deletion cut short): retention after
    # step 3 must keep the file that steps 2 and 3 reference.
    (root / step_name(1) / "metadata.json").unlink()
    manager.save(3, frozen_and_trained(3))
    assert {i.step: i.status for i in scan_root(LocalStorage(root))} == {1: "retired", 3: "complete"}
    assert held <= _bin_files(root / step_name(1))
    assert_loads_as(root / step_name(3), 3)


@pytest.mark.dist  # seconds of fsync-heavy saves: kept out of the fast tier (make test-fast)
def test_full_every_bounds_how_long_a_checkpoint_stays_referenced(tmp_path: Path) -> None:
    root = tmp_path / "root"
    manager = reshard.CheckpointManager(root, keep_last=1, incremental=True, full_every=3)
    referenced = []
    directories = []
    for step in range(1, 8):
        referenced.append(manager.save(step, frozen_and_trained(step)).referenced_bytes)
        directories.append(sorted(p.name for p in root.iterdir() if p.is_dir()))
    frozen = 9 * 64 * 64 * 4
    assert referenced == [0, frozen, frozen, 0, frozen, frozen, 0]  # steps 4 and 7: 3 steps after their holder
    assert directories[3] == [step_name(4)] and directories[6] == [step_name(7)]  # the old holders went whole
    assert max(len(d) for d in directories) == 2
    assert_loads_as(root / step_name(7), 7)
    with pytest.raises(ValueError, match="full_every needs incremental=True"):
        reshard.CheckpointManager(root, full_every=3)


@pytest.mark.unit
def test_fingerprints_and_read_once_loads_of_an_incremental_checkpoint(tmp_path: Path) -> None:
    """The reused boxes' fingerprints are combined like the written ones' (``verify=True`` passes), and a
    read-once load of two replicas (threads) reads referenced files like its own."""
    options = reshard.SaveOptions(content_hash=True, fingerprint=True)
    reshard.save(frozen_and_trained(1), tmp_path / "a", options=options)
    reshard.save(frozen_and_trained(2), tmp_path / "b", options=options, base=tmp_path / "a")
    full = reshard.read_metadata(tmp_path / "b")
    plain = reshard.save(frozen_and_trained(2), tmp_path / "plain", options=options).metadata
    assert plain is not None
    assert {k: t.fingerprint for k, t in full.tensors.items()} == {k: t.fingerprint for k, t in plain.tensors.items()}
    assert_loads_as(tmp_path / "b", 2, options=reshard.LoadOptions(verify=True))
    group = ThreadGroup(2)
    stats = [reshard.LoadStats(), reshard.LoadStats()]

    def run(rank: int) -> None:
        assert_loads_as(
            tmp_path / "b",
            2,
            group=group.member(rank),
            options=reshard.LoadOptions(read_once=True),
            stats=stats[rank],
        )

    on_threads(2, run)
    assert sum(s.bytes_from_peers for s in stats) > 0
