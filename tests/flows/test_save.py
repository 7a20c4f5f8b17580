"""reshard.save's own arguments (reshard.flows.save): this rank's statistics in SaveResult.stats, the
deprecated stats= keyword, at most eight parameters."""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path

import pytest
import torch

import reshard
from reshard.flows.stats import SaveStats
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads

pytestmark = pytest.mark.unit


def state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32)}


def test_the_result_carries_this_ranks_stats(tmp_path: Path) -> None:
    result = reshard.save(state(), tmp_path / "a")
    assert result.stats.bytes_written == result.total_bytes == 24
    assert result.stats.file_bytes == result.file_bytes > 0
    assert result.stats.seconds > 0


def test_the_stats_keyword_still_fills_with_a_deprecation_warning(tmp_path: Path) -> None:
    stats = SaveStats()
    with pytest.warns(DeprecationWarning, match=r"SaveResult\.stats") as caught:
        result = reshard.save(state(), tmp_path / "a", stats=stats)
    assert caught[0].filename == __file__  # the warning points at the caller
    assert stats.bytes_written == result.total_bytes == 24
    assert stats == result.stats and stats is not result.stats


def test_a_wrong_stats_or_an_unknown_keyword_is_a_type_error_and_writes_nothing(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match="SaveStats"):
            reshard.save(state(), tmp_path / "a", stats=reshard.LoadStats())
    with pytest.raises(TypeError, match="'overwrites'"):
        reshard.save(state(), tmp_path / "a", overwrites=True)
    assert not (tmp_path / "a").exists()


def test_save_and_load_take_at_most_eight_named_parameters() -> None:
    """Issue 31: the flows' entry points stay small (``save``'s ``**deprecated`` holds ``stats=`` for one
    release)."""
    for function in (reshard.save, reshard.load):
        named = [
            p for p in inspect.signature(function).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        assert len(named) <= 8, (function.__name__, [p.name for p in named])


def test_an_incremental_save_that_references_every_box_records_their_fingerprints(tmp_path: Path) -> None:
    """Found while attacking issue 31's redesign (older than it): with ``fingerprint=True``, an incremental save
    whose every box is referenced (no rank writes a file: a frozen model saved again) recorded no fingerprint,
    and ``LoadOptions(verify=True)`` then refused the checkpoint as saved without fingerprints."""
    options = reshard.SaveOptions(content_hash=True, fingerprint=True)
    reshard.save(state(), tmp_path / "a", options=options)
    result = reshard.save(state(), tmp_path / "b", options=options, base=tmp_path / "a")
    assert result.num_files == 0 and result.referenced_bytes == 24
    base, again = reshard.read_metadata(tmp_path / "a"), reshard.read_metadata(tmp_path / "b")
    assert again.tensors["w"].fingerprint == base.tensors["w"].fingerprint is not None
    loaded = reshard.load({"w": torch.empty(6)}, tmp_path / "b", options=reshard.LoadOptions(verify=True))
    assert torch.equal(loaded["w"], state()["w"])


def test_two_different_tensors_of_one_box_on_one_rank_fail_every_rank_and_keep_the_old_checkpoint(
    tmp_path: Path,
) -> None:
    """Issue 34 (found attacking record buffers): rank 1's state dict holds two different tensors under one key
    and box (``p`` and ``q``). The save kept one of them silently; now every rank raises the same ShardingError
    naming the key, the box and both paths, and the committed checkpoint it would overwrite still loads."""
    path = tmp_path / "ckpt"
    group = ThreadGroup(2)

    def save(r: int, state: dict[str, object]) -> str:
        try:
            reshard.save(state, path, group=group.member(r), overwrite=True)
        except reshard.CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    def shard(r: int, value: float) -> reshard.ShardedTensor:
        return reshard.ShardedTensor.from_rank_offsets("k", torch.full((2,), value), (0, r, 2))

    assert on_threads(2, lambda r: save(r, {"p": shard(r, r)})) == ["ok", "ok"]
    outcomes = on_threads(2, lambda r: save(r, {"p": shard(r, 5.0), "q": shard(r, 5.0 + r)}))
    assert outcomes[0] == outcomes[1] and outcomes[0].startswith("ShardingError"), outcomes
    for word in ("'k'", "offset [2] shape [2]", "'p'", "'q'", "rank 1"):
        assert word in outcomes[0], outcomes[0]
    assert torch.equal(reshard.load({"k": torch.zeros(4)}, path)["k"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
