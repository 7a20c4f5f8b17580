"""capture/restore on real ranks: four gloo processes consume uneven batches through StatefulDataLoaders and
save their data state; the first two of them load it as a DP=2 job and consume the rest of the epoch. And
ElasticSampler's Stateful protocol through a StatefulDataLoader with worker processes."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

import reshard
from reshard.data import ElasticSampler, Positions, capture, restore, template
from tests.datastate.loaderjobs import Ids, assert_exactly_once
from tests.rankpool import RankContext, RankPool, forkserver_context

pytestmark = pytest.mark.dist

SIZE = 74


def rank_save_at_4(ctx: RankContext, path: str) -> list[int]:
    """Consume 3 batches of 2 (rank 1: 4), capture over the world, save; the ids consumed."""
    sampler = ElasticSampler(Ids(SIZE), ctx.world_size, ctx.rank, seed=11)
    loader = StatefulDataLoader(Ids(SIZE), batch_size=2, sampler=sampler)
    it = iter(loader)
    ids = [int(i) for _ in range(4 if ctx.rank == 1 else 3) for i in next(it)]
    reshard.save({"data": capture(loader)}, path)
    return ids


def rank_resume_at_2(ctx: RankContext, path: str) -> list[int] | None:
    """The first two ranks: load, restore, consume to the end of the epoch; the ids consumed."""
    group, member = ctx.group_of_size(2)
    if not member:
        return None
    sampler = ElasticSampler(Ids(SIZE), 2, ctx.rank, seed=11)
    loader = StatefulDataLoader(Ids(SIZE), batch_size=2, sampler=sampler)
    restore(reshard.load({"data": template()}, path, group=group)["data"], loader)
    return [int(i) for batch in loader for i in batch]


def test_save_at_4_gloo_ranks_resume_at_2(pool4: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    before = pool4.run_ok(rank_save_at_4, path)
    after = [ids for ids in pool4.run_ok(rank_resume_at_2, path) if ids is not None]
    assert len(after) == 2
    assert_exactly_once(SIZE, before, after)


@pytest.mark.parametrize("snapshot_every", [1, 3])
def test_stateful_dataloader_with_workers_resumes_an_elastic_sampler_on_the_same_layout(snapshot_every: int) -> None:
    """The same through a 2-worker loader that prefetches and snapshots every 1 or 3 steps: torchdata restores
    the sampler from its main snapshot and replays the steps since; the resumed loader yields exactly the
    rest of the uninterrupted sequence."""

    def loader() -> StatefulDataLoader:
        sampler = ElasticSampler(Ids(40), 2, 0, seed=6)
        sampler.resume(0, Positions.of([0, 1, 2, 3, 17]))
        return StatefulDataLoader(
            Ids(40),
            batch_size=2,
            sampler=sampler,
            num_workers=2,
            snapshot_every_n_steps=snapshot_every,
            multiprocessing_context=forkserver_context(),
        )

    expected = [int(i) for batch in loader() for i in batch]
    first = loader()
    it = iter(first)
    before = [int(i) for _ in range(4) for i in next(it)]
    state = first.state_dict()
    del it
    second = loader()
    second.sampler.resume(0, Positions())  # what the state holds must win over what the sampler held
    second.load_state_dict(state)
    after = [int(i) for batch in second for i in batch]
    assert before + after == expected
