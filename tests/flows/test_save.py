"""reshard.save's own arguments (reshard.flows.save): stats in SaveOptions, the deprecated stats= keyword."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import reshard
from reshard.flows.stats import SaveStats

pytestmark = pytest.mark.unit


def state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32)}


def test_save_options_stats_are_filled_once_the_save_commits(tmp_path: Path) -> None:
    stats = SaveStats()
    result = reshard.save(state(), tmp_path / "a", options=reshard.SaveOptions(stats=stats))
    assert stats.bytes_written == result.total_bytes == 24
    assert stats.file_bytes == result.file_bytes > 0
    assert stats.seconds > 0


def test_save_options_that_differ_only_in_their_stats_are_equal() -> None:
    assert reshard.SaveOptions(stats=SaveStats()) == reshard.SaveOptions()
    assert hash(reshard.SaveOptions(stats=SaveStats())) == hash(reshard.SaveOptions())


def test_the_stats_keyword_still_fills_with_a_deprecation_warning(tmp_path: Path) -> None:
    stats = SaveStats()
    with pytest.warns(DeprecationWarning, match=r"SaveOptions\(stats=\.\.\.\)") as caught:
        result = reshard.save(state(), tmp_path / "a", stats=stats)
    assert caught[0].filename == __file__  # the warning points at the caller
    assert stats.bytes_written == result.total_bytes == 24


def test_stats_twice_or_an_unknown_keyword_is_a_type_error(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match="both"):
            reshard.save(state(), tmp_path / "a", stats=SaveStats(), options=reshard.SaveOptions(stats=SaveStats()))
    with pytest.raises(TypeError, match="'overwrites'"):
        reshard.save(state(), tmp_path / "a", overwrites=True)
    assert not (tmp_path / "a").exists()
