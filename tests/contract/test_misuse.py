"""Concurrent misuse (:mod:`tests.contract.misuse`): two jobs on one root, an overwrite during a load, a
copied or moved step under retention and gc."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.contract import misuse

pytestmark = pytest.mark.dist


def test_two_jobs_saving_into_one_root_at_once(tmp_path: Path) -> None:
    assert misuse.two_managers_on_one_root(tmp_path) == []


def test_an_overwrite_during_a_load_never_mixes_two_saves(tmp_path: Path) -> None:
    assert misuse.overwrite_during_a_load(tmp_path) == []


@pytest.mark.parametrize("how", ["copy", "move"])
def test_a_copied_or_moved_step_loads_exactly_or_is_refused_at_every_point(tmp_path: Path, how: str) -> None:
    assert misuse.copied_and_moved_steps(tmp_path, how) == []
