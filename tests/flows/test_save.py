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
