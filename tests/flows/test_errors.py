"""Every error reshard names, provoked for real: on every rank, naming the failing rank, never a hang."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import pytest
import torch

import reshard
from reshard.metadata import METADATA_FILE
from tests.rankpool import RankContext, RankFailure, RankPool, private_pool

TIMEOUT = 60.0


def _state(rank: int, world: int) -> dict[str, object]:
    data = torch.arange(8.0).reshape(4, 2)[rank * (4 // world) : (rank + 1) * (4 // world)].clone()
    return {"w": reshard.ShardedTensor.from_rank_offsets("w", data, (0, rank, world)), "step": 1}


def _failures(results: list[object]) -> list[RankFailure]:
    assert all(isinstance(r, RankFailure) for r in results), results
    return [r for r in results if isinstance(r, RankFailure)]


def _assert_same_error_everywhere(results: list[object], error_class: str, *fragments: str) -> list[RankFailure]:
    failures = _failures(results)
    messages = {f.message for f in failures}
    assert len(messages) == 1, messages
    for failure in failures:
        assert failure.error_class == error_class, (failure.error_class, failure.message)
        for fragment in fragments:
            assert fragment in failure.message, (fragment, failure.message)
    return failures


# ---- save: invalid layouts -------------------------------------------------------------------------


def rank_save_overlapping_primaries(ctx: RankContext, path: str) -> None:
    # Ranks 1 and 2 both claim rows [2, 3) as primary; rows of rank 3 are never covered.
    starts = [0, 1, 1, 2]
    data = torch.ones(1, 2)
    reshard.save({"w": reshard.ShardedTensor("w", data, (4, 2), (starts[ctx.rank], 0))}, path, timeout=TIMEOUT)


@pytest.mark.dist
def test_overlapping_primary_boxes_raise_sharding_error_on_every_rank(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results = pool4.run(rank_save_overlapping_primaries, str(path))
    _assert_same_error_everywhere(results, "ShardingError", "'w'", "ranks 1 and 2", "offset [1, 0]")
    assert not (path / METADATA_FILE).exists()


def rank_save_with_gap(ctx: RankContext, path: str) -> None:
    state = _state(ctx.rank, ctx.world_size)
    if ctx.rank == 3:
        state["w"] = reshard.ShardedTensor("w", torch.ones(1, 2), (4, 2), (3, 0), replica_id=1)
    reshard.save(state, path, timeout=TIMEOUT)


@pytest.mark.dist
def test_gap_and_orphan_replica_raise_sharding_error(pool4: RankPool, tmp_path: Path) -> None:
    results = pool4.run(rank_save_with_gap, str(tmp_path / "ckpt"))
    _assert_same_error_everywhere(results, "ShardingError", "'w'", "rank 3 holds a replica", "no rank holds as primary")
    results = pool4.run(rank_save_with_gap_only, str(tmp_path / "ckpt"))
    _assert_same_error_everywhere(results, "ShardingError", "'w'", "cover 6 of 8 elements", "[0, 1, 2]")


def rank_save_with_gap_only(ctx: RankContext, path: str) -> None:
    state = _state(ctx.rank, ctx.world_size)
    if ctx.rank == 3:
        del state["w"]
    reshard.save(state, path, timeout=TIMEOUT)


def rank_save_disagreeing_dtype(ctx: RankContext, path: str) -> None:
    state = _state(ctx.rank, ctx.world_size)
    if ctx.rank == 2:
        w = state["w"]
        assert isinstance(w, reshard.ShardedTensor)
        state["w"] = reshard.ShardedTensor("w", w.data.double(), w.global_shape, w.global_offset)
    reshard.save(state, path, timeout=TIMEOUT)


@pytest.mark.dist
def test_disagreeing_dtype_names_both_ranks(pool4: RankPool, tmp_path: Path) -> None:
    results = pool4.run(rank_save_disagreeing_dtype, str(tmp_path / "ckpt"))
    _assert_same_error_everywhere(results, "ShardingError", "'w'", "dtype", "rank 0 has float32", "rank 2 has float64")


# ---- save: one rank fails --------------------------------------------------------------------------


def rank_save_unsupported_value_on_rank2(ctx: RankContext, path: str) -> None:
    state = _state(ctx.rank, ctx.world_size)
    if ctx.rank == 2:
        state["rng"] = reshard.ShardedObject("rng", {"handle": object()}, (1,), (0,))
    reshard.save(state, path, timeout=TIMEOUT)


@pytest.mark.dist
def test_planning_exception_on_one_rank_fails_every_rank(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results = pool4.run(rank_save_unsupported_value_on_rank2, str(path))
    failures = _assert_same_error_everywhere(results, "StateDictError", "failed on rank 2", "object")
    assert set(failures[0].failures) == {2}
    assert not path.exists() or not (path / METADATA_FILE).exists()


def rank_save_with_file_size_limit(ctx: RankContext, path: str, limited_rank: int) -> None:
    """Rank ``limited_rank`` may write at most 64 bytes per file: a real EFBIG from the kernel."""
    data = torch.arange(4096.0)[ctx.rank * 1024 : (ctx.rank + 1) * 1024].clone()
    state = {"big": reshard.ShardedTensor.from_rank_offsets("big", data, (0, ctx.rank, ctx.world_size))}
    if ctx.rank != limited_rank:
        reshard.save(state, path, timeout=TIMEOUT)
        return
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, previous_limit[1]))
    try:
        reshard.save(state, path, timeout=TIMEOUT)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)


def rank_load_old(ctx: RankContext, path: str) -> list[float]:
    target = torch.zeros(1, 2)
    out = reshard.load({"w": reshard.ShardedTensor.from_rank_offsets("w", target, (0, ctx.rank, 4)), "step": 0}, path)
    return out["w"].reshape(-1).tolist()


@pytest.mark.dist
def test_write_failure_on_one_rank_fails_all_and_commits_nothing(pool4: RankPool, tmp_path: Path) -> None:
    old = tmp_path / "old"
    pool4.run_ok(_rank_save_state, str(old))
    path = tmp_path / "new"
    results = pool4.run(rank_save_with_file_size_limit, str(path), 1)
    failures = _assert_same_error_everywhere(results, "StorageError", "failed on rank 1")
    assert set(failures[0].failures) == {1}
    assert "File too large" in failures[0].message or "EFBIG" in failures[0].message
    assert not (path / METADATA_FILE).exists()
    assert list((path / "data").iterdir()) == []  # partial data removed
    # An older checkpoint elsewhere is untouched and loads.
    values = pool4.run_ok(rank_load_old, str(old))
    assert values == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]


def _rank_save_state(ctx: RankContext, path: str, overwrite: bool = False) -> None:
    reshard.save(_state(ctx.rank, ctx.world_size), path, overwrite=overwrite, timeout=TIMEOUT)


@pytest.mark.dist
def test_existing_checkpoint_needs_overwrite(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    pool4.run_ok(_rank_save_state, str(path))
    first = reshard.read_metadata(path)
    results = pool4.run(_rank_save_state, str(path))
    _assert_same_error_everywhere(results, "CheckpointExistsError", "overwrite=True")
    assert reshard.read_metadata(path).save_id == first.save_id
    pool4.run_ok(_rank_save_state, str(path), True)
    second = reshard.read_metadata(path)
    assert second.save_id != first.save_id
    on_disk = sorted(p.relative_to(path).as_posix() for p in (path / "data").iterdir())
    assert on_disk == sorted(f.path for f in second.files)  # the old save's files are gone


# ---- load errors -----------------------------------------------------------------------------------


def rank_load_wrong_shape_on_rank3(ctx: RankContext, path: str) -> None:
    global_shape = (4, 3) if ctx.rank == 3 else (4, 2)
    target = torch.zeros(1, global_shape[1])
    reshard.load({"w": reshard.ShardedTensor("w", target, global_shape, (ctx.rank, 0))}, path, timeout=TIMEOUT)


@pytest.mark.dist
def test_shape_mismatch_on_one_rank_raises_mismatch_error_everywhere(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    pool4.run_ok(_rank_save_state, str(path))
    results = pool4.run(rank_load_wrong_shape_on_rank3, str(path))
    _assert_same_error_everywhere(results, "MismatchError", "rank 3", "'w'", "saved global shape [4, 2]", "[4, 3]")


def rank_load_with_missing_key(ctx: RankContext, path: str, strict: bool) -> list[float]:
    target = torch.zeros(1, 2)
    state = {
        "w": reshard.ShardedTensor.from_rank_offsets("w", target, (0, ctx.rank, 4)),
        "extra": reshard.ShardedTensor("extra", torch.full((2,), 7.0), (2,), (0,)),
        "step": 0,
    }
    with pytest.warns(UserWarning, match="extra") if not strict else _no_warning():
        out = reshard.load(state, path, strict=strict, timeout=TIMEOUT)
    return [*out["w"].reshape(-1).tolist(), *out["extra"].tolist(), out["step"]]


class _no_warning:  # a tiny context manager used in place of pytest.warns
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


@pytest.mark.dist
def test_missing_keys_strict_and_not_strict(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    pool4.run_ok(_rank_save_state, str(path))
    results = pool4.run(rank_load_with_missing_key, str(path), True)
    _assert_same_error_everywhere(results, "MismatchError", "missing from the checkpoint", "tensor 'extra'")
    values = pool4.run_ok(rank_load_with_missing_key, str(path), False)
    assert values[1] == [2.0, 3.0, 7.0, 7.0, 1]  # 'extra' left as it was, the rest loaded


def rank_load_plain(ctx: RankContext, path: str) -> None:
    reshard.load(_state(ctx.rank, ctx.world_size), path, timeout=TIMEOUT)


@pytest.mark.dist
def test_corrupt_data_is_detected_on_every_rank(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    pool4.run_ok(_rank_save_state, str(path))
    metadata = reshard.read_metadata(path)
    box = metadata.tensors["w"].boxes[2]
    data_file = path / metadata.files[box.file].path
    raw = bytearray(data_file.read_bytes())
    raw[box.byte_offset + 3] ^= 0x10
    data_file.write_bytes(bytes(raw))
    results = pool4.run(rank_load_plain, str(path))
    _assert_same_error_everywhere(
        results, "CorruptCheckpointError", "rank 2", "checksum mismatch", "'w'", data_file.name
    )


@pytest.mark.dist
def test_truncated_and_missing_data_files(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    pool4.run_ok(_rank_save_state, str(path))
    metadata = reshard.read_metadata(path)
    first = path / metadata.files[0].path
    first.write_bytes(first.read_bytes()[:-8])
    results = pool4.run(rank_load_plain, str(path))
    _assert_same_error_everywhere(results, "CorruptCheckpointError", "truncated or altered", first.name)
    first.unlink()
    results = pool4.run(rank_load_plain, str(path))
    _assert_same_error_everywhere(results, "CorruptCheckpointError", "is missing", first.name)


@pytest.mark.dist
def test_interrupted_save_is_incomplete(pool4: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    pool4.run_ok(_rank_save_state, str(path))
    (path / METADATA_FILE).unlink()
    results = pool4.run(rank_load_plain, str(path))
    _assert_same_error_everywhere(results, "IncompleteCheckpointError", "interrupted", "no metadata.json")
    with pytest.raises(reshard.IncompleteCheckpointError):
        reshard.read_metadata(path)


@pytest.mark.unit
def test_missing_path_and_non_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(reshard.CheckpointNotFoundError, match="does not exist") as info:
        reshard.load({"x": torch.zeros(1)}, tmp_path / "nowhere")
    assert "\n" not in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(reshard.CheckpointNotFoundError, match=r"not a reshard checkpoint"):
        reshard.read_metadata(tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    with pytest.raises(reshard.CheckpointNotFoundError, match=r"not a checkpoint directory"):
        reshard.read_metadata(tmp_path / "file")
    assert issubclass(reshard.CheckpointNotFoundError, FileNotFoundError)


@pytest.mark.unit
def test_corrupt_metadata_is_refused(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(3)}, tmp_path)
    (tmp_path / METADATA_FILE).write_text('{"format": "reshard", "version": 99}')
    with pytest.raises(reshard.CorruptCheckpointError, match=r"version 99 is not supported"):
        reshard.load({"w": torch.zeros(3)}, tmp_path)


@pytest.mark.unit
def test_sharded_tensor_validation_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"'w'.*extends past"):
        reshard.ShardedTensor("w", torch.zeros(2, 2), (3, 2), (2, 0))
    with pytest.raises(ValueError, match=r"'w'.*same number of axes"):
        reshard.ShardedTensor("w", torch.zeros(2, 2), (4,), (0,))
    with pytest.raises(ValueError, match=r"'w'.*negative"):
        reshard.ShardedTensor("w", torch.zeros(2), (4,), (-1,))
    with pytest.raises(ValueError, match=r"'w'.*replica_id"):
        reshard.ShardedTensor("w", torch.zeros(2), (2,), (0,), replica_id=-1)
    with pytest.raises(ValueError, match=r"'w'.*rank 2 is not within 2 parts"):
        reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 2, 2))
    st = reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 3), (0, 1, 4), (1, 2, 3))
    assert st.global_shape == (8, 9) and st.global_offset == (2, 6)


# ---- a rank that never joins: a timeout, not a hang -----------------------------------------------


def rank_save_but_rank1_absent(ctx: RankContext, path: str) -> str:
    if ctx.rank == 1:
        return "absent"
    try:
        reshard.save(_state(ctx.rank, ctx.world_size), path, timeout=3.0)
    except reshard.CommunicationError as exc:
        return f"CommunicationError: {exc}"
    return "saved"


@pytest.mark.dist
def test_absent_rank_times_out_instead_of_hanging(tmp_path: Path) -> None:
    pool = private_pool(2)  # its own pool: the timed-out collective leaves the group unusable
    try:
        results = pool.run(rank_save_but_rank1_absent, str(tmp_path / "ckpt"), timeout_s=120)
    finally:
        pool.close()
    assert results[1] == "absent"
    assert results[0].startswith("CommunicationError:") and "did not complete within 3 s" in results[0]
    assert not (tmp_path / "ckpt" / METADATA_FILE).exists()


@pytest.mark.unit
def test_library_errors_are_not_base_exceptions() -> None:
    assert issubclass(reshard.CheckpointError, Exception)
    for cls in (reshard.ShardingError, reshard.MismatchError, reshard.CorruptCheckpointError):
        assert issubclass(cls, ValueError) and issubclass(cls, reshard.CheckpointError)
    assert issubclass(reshard.StorageError, OSError)
    assert os.sep == "/"


def rank_save_to_own_path(ctx: RankContext, root: str) -> None:
    reshard.save(_state(ctx.rank, ctx.world_size), f"{root}/ckpt{ctx.rank % 2}", timeout=TIMEOUT)


@pytest.mark.dist
def test_ranks_passing_different_paths_are_refused(pool4: RankPool, tmp_path: Path) -> None:
    results = pool4.run(rank_save_to_own_path, str(tmp_path))
    _assert_same_error_everywhere(results, "CheckpointError", "different checkpoint paths", "ckpt1': [1, 3]")
    assert not (tmp_path / "ckpt0" / METADATA_FILE).exists()


@pytest.mark.unit
def test_overwrite_survives_a_failed_cleanup_of_old_files(tmp_path: Path) -> None:
    """Removing the replaced checkpoint's files happens after the commit and is best effort: a failure
    there must not cost the new checkpoint."""
    reshard.save({"w": torch.ones(4)}, tmp_path)
    old = reshard.read_metadata(tmp_path)
    old_file = tmp_path / old.files[0].path
    old_file.unlink()
    old_file.mkdir()  # deleting it as a file now fails
    (old_file / "keep").write_text("x")
    reshard.save({"w": torch.full((4,), 2.0)}, tmp_path, overwrite=True)
    assert torch.equal(reshard.load({"w": torch.zeros(4)}, tmp_path)["w"], torch.full((4,), 2.0))


@pytest.mark.unit
def test_symlinked_data_file_is_not_followed(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(4)}, tmp_path / "ckpt")
    metadata = reshard.read_metadata(tmp_path / "ckpt")
    data_file = tmp_path / "ckpt" / metadata.files[0].path
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data_file.read_bytes())
    data_file.unlink()
    data_file.symlink_to(outside)
    with pytest.raises(reshard.StorageError, match=r"cannot open data file .*symbolic link"):
        reshard.load({"w": torch.zeros(4)}, tmp_path / "ckpt")
