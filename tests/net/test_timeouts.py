"""A timeout reshard cannot use (not a number of seconds, not positive, not finite) is a reshard error on every
rank of the call, agreed in its first step: the rank that passed it does not fail alone while the others wait
out their own timeouts (outside attack on reshard.data: ``capture(timeout="x")`` on one rank raised a plain
``ValueError`` there and left rank 0 in the collective until its timeout)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
import reshard.data
from reshard.net.transports import ThreadGroup
from tests.datastate.loaderjobs import Ids
from tests.threads import outcomes_on_threads

pytestmark = pytest.mark.unit

BAD = ["x", math.nan, math.inf, 0, -1.0, [1], True]


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_bad_timeout_on_one_rank_fails_every_rank_of_a_capture_at_once(bad: Any) -> None:
    group = ThreadGroup(2, timeout=20)

    def rank(r: int) -> object:
        sampler = reshard.data.ElasticSampler(Ids(8), num_replicas=2, rank=r)
        return reshard.data.capture(sampler, consumed=1, group=group.member(r), timeout=bad if r == 1 else 30)

    outcomes = outcomes_on_threads(2, rank)
    assert all(isinstance(o, reshard.CheckpointError) for o in outcomes), outcomes
    assert {type(o) for o in outcomes} == {reshard.CheckpointError}
    assert all("timeout" in str(o) for o in outcomes)


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_bad_timeout_fails_a_save_with_a_reshard_error_and_writes_nothing(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(reshard.CheckpointError, match="timeout"):
        reshard.save({"w": torch.ones(3)}, tmp_path / "ckpt", timeout=bad)
    assert not (tmp_path / "ckpt" / "metadata.json").exists()


def test_good_timeouts_are_taken() -> None:
    import datetime

    from reshard.net.comm import Communicator

    for good in (0.5, 3, datetime.timedelta(seconds=2)):
        assert Communicator(None, timeout=good).timeout.total_seconds() == pytest.approx(
            good.total_seconds() if isinstance(good, datetime.timedelta) else good
        )
