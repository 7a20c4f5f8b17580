"""An incremental save references only stored bytes it has proven to be the state's.

Before a box is referenced instead of written, its writer reads the base's stored copy back (exactly the box's
byte range) and compares its XXH3-128 with the hash of the bytes it holds; a copy that was damaged after its
commit (a flipped byte, a file replaced by another of the same size: sizes are checked, contents are not) is
written anew, so the new checkpoint is complete and loads, and the save warns, naming the damaged file.
``SaveOptions(verify_base=False)`` trusts the recorded hashes and reads nothing.

Real files (and real S3 and GCS protocol servers), real damage, ranks as threads of a ThreadGroup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.flows.maintenance import validate_checkpoint
from reshard.flows.manager import step_name
from reshard.net.transports import ThreadGroup
from reshard.storage import LocalStorage, storage_for
from tests.memory import peak_rss_growth
from tests.threads import on_threads

WORLD = 2
ROWS, COLS, LAYERS = 32, 64, 4
BOX_BYTES = ROWS * COLS * 4
"""Each rank's box of each frozen layer."""
FROZEN_BYTES = WORLD * LAYERS * BOX_BYTES
HASHED = reshard.SaveOptions(content_hash=True)


def global_state(step: int, seed: int = 5) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    frozen = {f"layer{i}": torch.randn(WORLD * ROWS, COLS, generator=g) for i in range(LAYERS)}
    return {"frozen": frozen, "adapter": torch.full((WORLD * ROWS, 8), float(step)), "step": step}


def rank_state(rank: int, step: int, seed: int = 5) -> dict[str, Any]:
    """Rank ``rank``'s rows of every tensor of :func:`global_state`."""
    full = global_state(step, seed)

    def rows(key: str, tensor: torch.Tensor) -> reshard.ShardedTensor:
        part = tensor[rank * ROWS : (rank + 1) * ROWS].clone()
        return reshard.ShardedTensor.from_rank_offsets(key, part, (0, rank, WORLD))

    return {
        "frozen": {k: rows(f"frozen.{k}", v) for k, v in full["frozen"].items()},
        "adapter": rows("adapter", full["adapter"]),
        "step": step,
    }


def template() -> dict[str, Any]:
    return {
        "frozen": {
            f"layer{i}": reshard.ShardedTensor.from_rank_offsets(
                f"frozen.layer{i}", torch.zeros(WORLD * ROWS, COLS), (0, 0, 1)
            )
            for i in range(LAYERS)
        },
        "adapter": reshard.ShardedTensor.from_rank_offsets("adapter", torch.zeros(WORLD * ROWS, 8), (0, 0, 1)),
        "step": -1,
    }


def frozen_template() -> dict[str, torch.Tensor]:
    return {f"layer{i}": torch.zeros(WORLD * ROWS, COLS) for i in range(LAYERS)}


def assert_holds(loaded: dict[str, Any], step: int, seed: int = 5) -> None:
    """``loaded`` (a :func:`template` filled) is bit for bit the state of ``step``."""
    want = global_state(step, seed)
    for key, value in want["frozen"].items():
        assert torch.equal(loaded["frozen"][key].data.view(torch.int32), value.view(torch.int32)), key
    assert torch.equal(loaded["adapter"].data, want["adapter"]) and loaded["step"] == step


def save_on_ranks(
    path: Path | str, step: int, *, seed: int = 5, **kwargs: Any
) -> tuple[list[reshard.SaveResult], list[reshard.SaveStats]]:
    """A save of ``step`` on :data:`WORLD` ranks (threads); every rank's result and stats."""
    group = ThreadGroup(WORLD)

    def run(rank: int) -> reshard.SaveResult:
        return reshard.save(rank_state(rank, step, seed), path, group=group.member(rank), **kwargs)

    results = on_threads(WORLD, run, group=group)
    return results, [result.stats for result in results]


def frozen_box(path: Path, layer: int, rank: int) -> tuple[Path, int, int]:
    """The data file (absolute), byte offset and length of rank ``rank``'s box of ``frozen.layer<layer>``."""
    metadata = reshard.read_metadata(path)
    box = next(b for b in metadata.tensors[f"frozen.layer{layer}"].boxes if b.offset[0] == rank * ROWS)
    entry = metadata.files[box.file]
    holder = path.parent / entry.checkpoint if entry.checkpoint is not None else path
    return holder / entry.path, box.byte_offset, box.byte_length


def flip_byte(file: Path, at: int) -> None:
    raw = bytearray(file.read_bytes())
    raw[at] ^= 0x10
    file.write_bytes(bytes(raw))


def own_file(path: Path, layer: int, rank: int) -> bool:
    """Whether that box of checkpoint ``path`` lies in its own data file (written, not referenced)."""
    metadata = reshard.read_metadata(path)
    box = next(b for b in metadata.tensors[f"frozen.layer{layer}"].boxes if b.offset[0] == rank * ROWS)
    return metadata.files[box.file].checkpoint is None


@pytest.mark.unit
def test_a_flipped_byte_in_the_base_is_written_again_not_referenced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_on_ranks(tmp_path / "a", 1, options=HASHED)
    damaged, offset, length = frozen_box(tmp_path / "a", 2, 1)
    flip_byte(damaged, offset + length // 2)
    with caplog.at_level("WARNING", logger="reshard"):
        results, stats = save_on_ranks(tmp_path / "b", 2, base=tmp_path / "a")
    assert_holds(reshard.load(template(), tmp_path / "b"), 2)
    assert own_file(tmp_path / "b", 2, 1)  # written anew
    assert not own_file(tmp_path / "b", 2, 0) and not own_file(tmp_path / "b", 1, 1)  # the sound ones referenced
    assert str(damaged) in caplog.text
    assert all(r.rewritten_bytes == BOX_BYTES for r in results)
    assert all(r.referenced_bytes == FROZEN_BYTES - BOX_BYTES for r in results)
    assert [s.bytes_rewritten for s in stats] == [0, BOX_BYTES]
    assert [s.bytes_base_read for s in stats] == [LAYERS * BOX_BYTES] * WORLD  # each writer its own boxes
    assert [s.bytes_base_verified for s in stats] == [LAYERS * BOX_BYTES, (LAYERS - 1) * BOX_BYTES]
    assert validate_checkpoint(tmp_path / "b") == []
    # The healed checkpoint is a sound base in turn: the next save references the rewritten box where it now lies.
    results, stats = save_on_ranks(tmp_path / "c", 3, base=tmp_path / "b")
    assert results[0].rewritten_bytes == 0 and results[0].referenced_bytes == FROZEN_BYTES
    assert frozen_box(tmp_path / "c", 2, 1)[0].parent.parent == tmp_path / "b"
    assert_holds(reshard.load(template(), tmp_path / "c"), 3)


@pytest.mark.unit
def test_a_base_file_replaced_by_another_of_the_same_size_is_not_referenced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 0's data file of the base is replaced by rank 0's file of another checkpoint of the same layout
    (other values): same size, so only reading the bytes can tell."""
    save_on_ranks(tmp_path / "a", 1, options=HASHED)
    save_on_ranks(tmp_path / "other", 1, seed=6, options=HASHED)
    replaced, _, _ = frozen_box(tmp_path / "a", 0, 0)
    (other,) = [p for p in (tmp_path / "other" / "data").iterdir() if p.name.endswith("-r00000.bin")]
    assert other.stat().st_size == replaced.stat().st_size
    replaced.write_bytes(other.read_bytes())
    with caplog.at_level("WARNING", logger="reshard"):
        results, stats = save_on_ranks(tmp_path / "b", 2, base=tmp_path / "a")
    assert_holds(reshard.load(template(), tmp_path / "b"), 2)
    assert all(own_file(tmp_path / "b", layer, 0) and not own_file(tmp_path / "b", layer, 1) for layer in range(LAYERS))
    assert str(replaced) in caplog.text
    assert results[1].rewritten_bytes == LAYERS * BOX_BYTES
    assert [s.bytes_rewritten for s in stats] == [LAYERS * BOX_BYTES, 0]
    assert validate_checkpoint(tmp_path / "b") == []


@pytest.mark.dist  # seconds of fsync-heavy saves: kept out of the fast tier (make test-fast)
def test_a_manager_heals_a_damaged_frozen_base_on_two_ranks(tmp_path: Path) -> None:
    """CheckpointManager(incremental=True) on 2 ranks: the held file of the frozen base (step 1, retired) gets a
    flipped byte after steps 1 and 2; step 3 writes that box again and loads, and so does every later step."""
    root = tmp_path / "root"
    group = ThreadGroup(WORLD)

    def save_steps(steps: tuple[int, ...]) -> list[list[reshard.SaveResult]]:
        def run(rank: int) -> list[reshard.SaveResult]:
            manager = reshard.CheckpointManager(root, keep_last=1, incremental=True, group=group.member(rank))
            try:
                return [manager.save(step, rank_state(rank, step)) for step in steps]
            finally:
                manager.close()

        return on_threads(WORLD, run, group=group)

    save_steps((1, 2))
    assert (root / step_name(1) / "retired.json").exists()
    damaged, offset, _ = frozen_box(root / step_name(2), 3, 0)
    assert damaged.parent.parent == root / step_name(1)
    flip_byte(damaged, offset + 7)
    results = save_steps((3,))
    manager = reshard.CheckpointManager(root)
    found = manager.load_latest_with_state(template())
    assert found is not None and found[0] == 3
    assert_holds(found[1], 3)
    assert all(r[0].rewritten_bytes == BOX_BYTES for r in results)
    save_steps((4,))
    found = manager.load_latest_with_state(template())
    manager.close()
    assert found is not None and found[0] == 4
    assert_holds(found[1], 4)
    assert frozen_box(root / step_name(4), 3, 0)[0].parent.parent == root / step_name(3)


@pytest.mark.unit
def test_verify_base_false_references_without_reading(tmp_path: Path) -> None:
    """The storage counts the bytes it reads: a trusting save reads none of the base, a verifying one exactly
    the bytes it references. Trusting a damaged base then commits a checkpoint that does not load, which is
    what the option's documentation says it risks."""
    reshard.save(global_state(1), tmp_path / "a", options=HASHED)
    trusting = LocalStorage(tmp_path / "b")
    options = reshard.SaveOptions(verify_base=False)
    result = reshard.save(global_state(2), trusting, base=tmp_path / "a", options=options)
    stats = result.stats
    assert result.referenced_bytes == FROZEN_BYTES
    assert trusting.range_bytes_read == 0 and stats.bytes_base_read == 0 and stats.bytes_base_verified == 0
    verifying = LocalStorage(tmp_path / "c")
    result = reshard.save(global_state(2), verifying, base=tmp_path / "a")
    stats = result.stats
    assert result.referenced_bytes == FROZEN_BYTES and result.rewritten_bytes == 0
    assert verifying.range_bytes_read == stats.bytes_base_read == stats.bytes_base_verified == FROZEN_BYTES
    metadata = reshard.read_metadata(tmp_path / "a")
    box = metadata.tensors["frozen.layer0"].boxes[0]
    flip_byte(tmp_path / "a" / metadata.files[box.file].path, box.byte_offset)
    reshard.save(global_state(3), tmp_path / "d", base=tmp_path / "a", options=options)
    with pytest.raises(reshard.CorruptCheckpointError, match="checksum mismatch"):
        reshard.load({"frozen": frozen_template()}, tmp_path / "d")


@pytest.mark.unit
def test_a_base_that_lost_its_data_file_is_saved_in_full(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A read that fails (the file is gone) is a copy that cannot be proven: the boxes are written."""
    reshard.save(global_state(1), tmp_path / "a", options=HASHED)
    (lost,) = (tmp_path / "a" / "data").iterdir()
    lost.unlink()
    with caplog.at_level("WARNING", logger="reshard"):
        result = reshard.save(global_state(2), tmp_path / "b", base=tmp_path / "a")
    assert result.referenced_bytes == 0 and result.rewritten_bytes == FROZEN_BYTES
    assert str(lost) in caplog.text
    assert reshard.read_metadata(tmp_path / "b").referenced_checkpoints == ()
    refs = tmp_path / "a" / "refs"
    assert not refs.exists() or not any(refs.iterdir())  # unmarked at the commit
    loaded = reshard.load({"frozen": frozen_template()}, tmp_path / "b")
    assert all(torch.equal(loaded["frozen"][k], v) for k, v in global_state(2)["frozen"].items())


@pytest.mark.dist
def test_a_damaged_base_object_is_written_again(object_store: Any) -> None:
    """On S3 and GCS: a held object with a flipped byte (replaced through the store's own API) is read back with
    ranged GETs and written anew."""
    url = f"{object_store.protocol}://{object_store.new_bucket()}/run"
    options = object_store.storage_options
    reshard.save(global_state(1), f"{url}/a", options=HASHED, storage_options=options)
    metadata = reshard.read_metadata(f"{url}/a", storage_options=options)
    box = metadata.tensors["frozen.layer1"].boxes[0]
    name = metadata.files[box.file].path
    holder = storage_for(f"{url}/a", options)
    try:
        raw = bytearray(holder.read_bytes(name))
        raw[box.byte_offset + 3] ^= 1
        holder.commit(name, bytes(raw), replace=True)
    finally:
        holder.close()
    target = storage_for(f"{url}/b", options)
    try:
        result = reshard.save(global_state(2), target, base=f"{url}/a", storage_options=options)
        read_back = target.range_bytes_read
    finally:
        target.close()
    assert_holds(reshard.load(template(), f"{url}/b", storage_options=options), 2)
    assert read_back == FROZEN_BYTES  # every referenced box, in ranged GETs
    assert result.rewritten_bytes == box.byte_length and result.referenced_bytes == FROZEN_BYTES - box.byte_length


@pytest.mark.dist  # seconds of fsync-heavy saves: kept out of the fast tier (make test-fast)
def test_reading_the_base_back_keeps_within_the_save_budget(tmp_path: Path) -> None:
    """A 64 MiB frozen tensor read back by a save with a 4 MiB budget: the peak RSS grows by far less than the
    tensor (the copy is streamed through a small buffer, never read whole)."""
    frozen = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(3))
    reshard.save({"frozen": frozen, "step": 1}, tmp_path / "a", options=HASHED)
    options = reshard.SaveOptions(memory_budget_bytes=4 * 2**20)
    with peak_rss_growth() as grown:
        result = reshard.save({"frozen": frozen, "step": 2}, tmp_path / "b", base=tmp_path / "a", options=options)
    assert result.stats.bytes_base_verified == frozen.nbytes
    assert grown() < 16 * 2**20, f"peak RSS grew by {grown() / 2**20:.1f} MiB"


@pytest.mark.dist
def test_reading_back_from_an_object_store_takes_one_ranged_get_per_run_of_boxes(
    object_store: Any, fault_proxy: Any
) -> None:
    """64 small boxes side by side in the base's object are read back by one ranged GET (not one per box); one of
    them damaged is still told apart from its neighbours and written anew."""
    proxy = fault_proxy(object_store)
    url = f"{object_store.protocol}://{object_store.new_bucket()}/run"
    options = object_store.options(proxy.url)
    g = torch.Generator().manual_seed(9)
    state = {f"small{i:02d}": torch.randn(1024, generator=g) for i in range(64)}
    reshard.save(state, f"{url}/a", options=HASHED, storage_options=options)
    metadata = reshard.read_metadata(f"{url}/a", storage_options=options)
    box = metadata.tensors["small17"].boxes[0]
    name = metadata.files[box.file].path
    holder = storage_for(f"{url}/a", options)
    try:
        raw = bytearray(holder.read_bytes(name))
        raw[box.byte_offset + 100] ^= 4
        holder.commit(name, bytes(raw), replace=True)
    finally:
        holder.close()
    proxy.reset()
    result = reshard.save(state, f"{url}/b", base=f"{url}/a", storage_options=options)
    stats = result.stats
    gets = [r for r in proxy.records if r.method == "GET" and r.range and "/a/data/" in r.path]
    assert len(gets) == 1, [r.range for r in gets]
    assert result.rewritten_bytes == box.byte_length == 4096
    assert stats.bytes_base_verified == 63 * 4096
    loaded = reshard.load({k: torch.zeros(1024) for k in state}, f"{url}/b", storage_options=options)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.dist
def test_a_failed_read_back_is_read_again_box_by_box(object_store: Any, fault_proxy: Any) -> None:
    """The one ranged GET of a run fails (a 503, no retries left): the boxes are read back one by one, so the
    failure costs no box its reference; only the damaged one is written anew."""
    from reshard.storage import ObjectStorage, RetryPolicy

    failed: list[str] = []

    def first_ranged_get(record: Any) -> bool:
        hit = bool(record.range) and "/a/data/" in record.path and not failed
        if hit:
            failed.append(record.range)
        return hit

    proxy = fault_proxy(object_store, fault_filter=first_ranged_get, fault_mix={"503": 1.0})
    url = f"{object_store.protocol}://{object_store.new_bucket()}/run"
    options = object_store.options(proxy.url)
    state = {f"small{i:02d}": torch.full((1024,), float(i)) for i in range(8)}
    reshard.save(state, f"{url}/a", options=HASHED, storage_options=options)
    metadata = reshard.read_metadata(f"{url}/a", storage_options=options)
    box = metadata.tensors["small03"].boxes[0]
    name = metadata.files[box.file].path
    holder = storage_for(f"{url}/a", options)
    try:
        raw = bytearray(holder.read_bytes(name))
        raw[box.byte_offset] ^= 1
        holder.commit(name, bytes(raw), replace=True)
    finally:
        holder.close()
    target = ObjectStorage(f"{url}/b", options, retry=RetryPolicy(max_attempts=1))
    proxy.fault_rate = 1.0
    try:
        result = reshard.save(state, target, base=f"{url}/a", storage_options=options)
    finally:
        proxy.fault_rate = 0.0
        target.close()
    assert len(failed) == 1
    assert result.rewritten_bytes == box.byte_length and result.referenced_bytes == 7 * box.byte_length
    loaded = reshard.load({k: torch.zeros(1024) for k in state}, f"{url}/b", storage_options=options)
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
