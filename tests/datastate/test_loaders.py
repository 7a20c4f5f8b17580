"""capture/restore of map-style loaders across layouts: a DP=4 job on threads consumes some batches and saves
its data state with reshard.save; DP=2 and DP=8 jobs load it, restore it and consume to the end of the epoch;
every sample of the epoch is consumed exactly once over the whole job (asserted by sample ids)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

import reshard
from reshard.data import ElasticSampler, Positions, capture, restore, template
from reshard.errors import DataStateError
from reshard.net.transports import ThreadGroup
from tests.datastate.loaderjobs import Ids, Job, assert_exactly_once, errors_per_rank, flat, order, run
from tests.rankpool import forkserver_context
from tests.threads import on_threads

UNEVEN = (3, 4, 3, 3)  # rank 1 consumed one batch more: 26 of 74 samples, 48 left (a multiple of 2 and 8)

CLIENTS: dict[str, dict[str, Any]] = {
    "stateful-elastic": {},
    "stateful-distributed": {"sampler": DistributedSampler},
    "plain-elastic": {"stateful": False},
    "plain-distributed-consumed": {"stateful": False, "sampler": DistributedSampler, "pass_consumed": True},
}


@pytest.mark.unit
@pytest.mark.parametrize("client", sorted(CLIENTS))
@pytest.mark.parametrize("new_world", [2, 8])
def test_save_at_4_resume_at_another_world_consumes_every_sample_once(
    tmp_path: Path, client: str, new_world: int
) -> None:
    before = run(Job(4, UNEVEN, save=tmp_path / "c", **CLIENTS[client]))
    assert [len(ids) for ids in before] == [6, 8, 6, 6]
    after = run(Job(new_world, load=tmp_path / "c"))
    assert_exactly_once(74, before, after)
    assert len({len(ids) for ids in after}) == 1  # 48 left: an even share on every new rank


@pytest.mark.unit
@pytest.mark.parametrize("new_world", [2, 8])
def test_a_prefix_resume_is_the_uninterrupted_run_at_the_new_layout(tmp_path: Path, new_world: int) -> None:
    """16 samples consumed at DP=4 (4 each, a prefix of the order): each new rank yields what it would have
    yielded from there in a run at the new layout from the start of the epoch."""
    before = run(Job(4, (2, 2, 2, 2), save=tmp_path / "c", epoch=2))
    after = run(Job(new_world, load=tmp_path / "c", epoch=2))
    for rank, ids in enumerate(after):
        uninterrupted = DistributedSampler(Ids(74), new_world, rank, seed=7)
        uninterrupted.set_epoch(2)
        assert ids == list(uninterrupted)[16 // new_world :]
    assert sorted(flat(before)) == sorted(order(74, 7, 2)[:16].tolist())


@pytest.mark.unit
def test_a_second_reshard_in_the_same_epoch(tmp_path: Path) -> None:
    """4 -> 2 -> 8 in one epoch: 26 consumed at 4 (uneven), 16 more at 2, the last 32 at 8."""
    first = run(Job(4, UNEVEN, save=tmp_path / "a"))
    second = run(Job(2, (4, 4), load=tmp_path / "a", save=tmp_path / "b"))
    third = run(Job(8, load=tmp_path / "b"))
    assert [len(ids) for ids in third] == [4] * 8
    assert_exactly_once(74, first, second, third)


@pytest.mark.unit
def test_saved_at_the_end_of_an_epoch_the_next_epoch_is_a_new_order(tmp_path: Path) -> None:
    """Saved after the loader finished epoch 0: the resumed epoch 0 yields nothing at any layout; epoch 1 is
    DistributedSampler's order of epoch 1 at the new layout."""
    run(Job(4, save=tmp_path / "c", size=64))
    value = reshard.load({"data": template()}, tmp_path / "c")["data"]
    assert value["consumed"].tolist() == [[0, 64]]
    assert run(Job(2, load=tmp_path / "c", size=64)) == [[], []]
    for rank, ids in enumerate(run(Job(2, load=tmp_path / "c", size=64, resume_epoch=1))):
        fresh = DistributedSampler(Ids(64), 2, rank, seed=7)
        fresh.set_epoch(1)
        assert ids == list(fresh)


@pytest.mark.unit
def test_set_epoch_before_the_capture_means_nothing_of_the_new_epoch_consumed() -> None:
    """A loader that finished epoch 0, then set_epoch(1), captured before the first batch: epoch 1, nothing
    consumed (the finished iteration belongs to epoch 0)."""
    group = ThreadGroup(2, timeout=30.0)

    def rank(r: int) -> dict[str, Any]:
        sampler = ElasticSampler(Ids(10), 2, r)
        loader = StatefulDataLoader(Ids(10), batch_size=2, sampler=sampler)
        assert len(list(loader)) == 3
        sampler.set_epoch(1)
        return dict(capture(loader, group=group.member(r)).value)

    value = on_threads(2, rank, group=group)[0]
    assert value["epoch"] == 1
    assert value["consumed"].numel() == 0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("differ", "named"),
    [("seeds", "seed"), ("sizes", "size"), ("epochs", "epoch")],
)
def test_ranks_that_disagree_raise_the_same_error_on_every_rank(tmp_path: Path, differ: str, named: str) -> None:
    job = Job(4, (1, 1, 1, 1), save=tmp_path / "c", seeds=(7, 7, 8, 7) if differ == "seeds" else None)
    sizes = [74, 74, 75, 74] if differ == "sizes" else None
    errors = _epochs_disagree() if differ == "epochs" else errors_per_rank(job, sizes)
    assert all(isinstance(e, DataStateError) for e in errors), errors
    assert all(f"disagree on the {named}" in str(e) for e in errors), errors
    assert not (tmp_path / "c").exists()


def _epochs_disagree() -> list[BaseException | None]:
    group = ThreadGroup(2, timeout=30.0)

    def rank(r: int) -> BaseException | None:
        sampler = ElasticSampler(Ids(10), 2, r)
        sampler.set_epoch(r)
        try:
            capture(sampler, group=group.member(r), consumed=0)
        except DataStateError as exc:
            return exc
        return None

    return on_threads(2, rank)


@pytest.mark.unit
def test_peers_of_a_data_parallel_rank_must_report_the_same_state() -> None:
    """A group of 4 = DP 2 x TP 2: TP peers that agree give the DP=2 value; a peer that consumed one more
    sample than its twin fails the capture on every rank."""
    for extra in (0, 1):
        group = ThreadGroup(4, timeout=30.0)

        def rank(r: int, extra: int = extra, group: ThreadGroup = group) -> Any:
            sampler = ElasticSampler(Ids(20), 2, r // 2, seed=1)
            try:
                return capture(sampler, group=group.member(r), consumed=3 + (extra if r == 3 else 0)).value
            except DataStateError as exc:
                return exc

        results = on_threads(4, rank)
        if extra:
            assert all(isinstance(e, DataStateError) and "data-parallel rank 1" in str(e) for e in results)
        else:
            assert results[0]["consumed"].tolist() == [[0, 6]]
            assert results[0]["saved_dp_size"] == 2


@pytest.mark.unit
def test_a_missing_data_parallel_rank_is_refused() -> None:
    group = ThreadGroup(2, timeout=30.0)

    def rank(r: int) -> BaseException | None:
        try:
            capture(ElasticSampler(Ids(20), 3, r), group=group.member(r), consumed=0)
        except DataStateError as exc:
            return exc
        return None

    assert all(isinstance(e, DataStateError) and "[2]" in str(e) for e in on_threads(2, rank))


@pytest.mark.unit
def test_an_opaque_loader_is_refused_unless_an_approximation_is_opted_in(tmp_path: Path) -> None:
    """Two ranks each with a RandomSampler: the value records the client as opaque with the samples consumed;
    restore refuses it naming RandomSampler; restart_epoch and skip_count do what they say."""
    group = ThreadGroup(2, timeout=30.0)

    def rank(r: int) -> list[int]:
        loader = StatefulDataLoader(Ids(40), batch_size=2, sampler=RandomSampler(Ids(40)))
        it = iter(loader)
        ids = [int(i) for _ in range(2 + r) for i in next(it)]
        reshard.save({"data": capture(loader, group=group.member(r))}, tmp_path / "c", group=group.member(r))
        return ids

    on_threads(2, rank, group=group)
    value = reshard.load({"data": template()}, tmp_path / "c")["data"]
    assert value["kind"] == "opaque"
    assert value["consumed_samples"] == 10
    target = ElasticSampler(Ids(40), 4, 0, seed=2)
    with pytest.raises(DataStateError, match="RandomSampler"):
        restore(value, target)
    done = restore(value, target, approximate="restart_epoch")
    assert (done.approximation, done.consumed) == ("restart_epoch", 0)
    assert len(target) == 10
    done = restore(value, target, approximate="skip_count")
    assert target.consumed_positions == Positions.prefix(10)
    assert len(list(target)) == 8  # 30 left: padded to 32 over 4 ranks
    with pytest.raises(DataStateError, match="skip_count"):
        restore(value, RandomSampler(Ids(40)), approximate="skip_count")
    with pytest.raises(DataStateError, match="approximate"):
        restore(value, target, approximate="guess")


@pytest.mark.unit
def test_an_opaque_job_counts_each_rank_once_whether_or_not_it_has_a_data_parallel_rank() -> None:
    """Rank 0 reads through a RandomSampler (no data-parallel rank), rank 1 is data-parallel rank 0 of an
    ElasticSampler: the opaque value counts both ranks' samples (rank 0's count was keyed 0 like data-parallel
    rank 0 and one of the two was dropped)."""
    group = ThreadGroup(2, timeout=30.0)

    def rank(r: int) -> object:
        if r == 0:
            loader = StatefulDataLoader(Ids(40), batch_size=3, sampler=RandomSampler(Ids(40)))
            next(iter(loader))
            return capture(loader, group=group.member(r)).value
        return capture(ElasticSampler(Ids(40), 2, 0), consumed=2, group=group.member(r)).value

    values = on_threads(2, rank, group=group)
    assert values[0]["kind"] == "opaque" and values[0]["consumed_samples"] == 5


@pytest.mark.unit
def test_a_custom_batch_sampler_is_opaque() -> None:
    class Reversed(BatchSampler):
        pass

    sampler = ElasticSampler(Ids(12), 1, 0)
    loader = DataLoader(Ids(12), batch_sampler=Reversed(sampler, 3, False))
    next(iter(loader))
    value = capture(loader, consumed=3).value
    assert value["kind"] == "opaque"
    assert "custom batch_sampler (Reversed)" in value["clients"][0]


@pytest.mark.unit
def test_an_iterable_dataset_is_named_and_refused() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(5))

    with pytest.raises(DataStateError, match=r"is a Stream, not a reshard\.data\.ShardedIterable"):
        capture(StatefulDataLoader(Stream(), batch_size=2))


@pytest.mark.unit
def test_what_cannot_be_known_needs_consumed() -> None:
    with pytest.raises(DataStateError, match="consumed="):
        capture(DataLoader(Ids(10), batch_size=2, sampler=ElasticSampler(Ids(10), 1, 0), num_workers=2))
    with pytest.raises(DataStateError, match="consumed="):
        capture(DataLoader(Ids(10), batch_size=2, sampler=DistributedSampler(Ids(10), 1, 0)))
    with pytest.raises(DataStateError, match="consumed="):
        capture(ElasticSampler(Ids(10), 1, 0))
    with pytest.raises(DataStateError, match="consumed=11"):
        capture(ElasticSampler(Ids(10), 1, 0), consumed=11)


@pytest.mark.unit
def test_torchs_distributed_sampler_takes_a_value_only_when_nothing_was_consumed() -> None:
    sampler = ElasticSampler(Ids(10), 1, 0, seed=3)
    sampler.set_epoch(2)
    fresh = capture(sampler, consumed=0).value
    partial = capture(sampler, consumed=4).value
    target = DistributedSampler(Ids(10), 2, 1, seed=3)
    restore(fresh, target)
    assert target.epoch == 2
    with pytest.raises(DataStateError, match="ElasticSampler"):
        restore(partial, target)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("size", 5),
        ("seed", 4),
        ("shuffle", False),
        ("drop_last", True),
    ],
)
def test_a_sampler_that_differs_from_the_saved_one_is_named(field: str, bad: Any) -> None:
    value = dict(capture(ElasticSampler(Ids(10), 1, 0, seed=3), consumed=2).value)
    value[field] = bad
    with pytest.raises(DataStateError, match=field):
        restore(value, ElasticSampler(Ids(10), 2, 0, seed=3))


HOSTILE: dict[str, Any] = {
    "beyond the dataset": {"consumed": torch.tensor([[0, 11]])},
    "negative": {"consumed": torch.tensor([[-2, 3]])},
    "overlapping": {"consumed": torch.tensor([[0, 4], [3, 6]])},
    "unsorted": {"consumed": torch.tensor([[5, 6], [0, 2]])},
    "empty interval": {"consumed": torch.tensor([[3, 3]])},
    "float positions": {"consumed": torch.tensor([[0.0, 2.0]])},
    "a list": {"consumed": [[0, 2]]},
    "three columns": {"consumed": torch.tensor([[0, 2, 4]])},
    "on the meta device": {"consumed": torch.tensor([[0, 2]], device="meta")},
    "size a string": {"size": "10"},
    "epoch a bool": {"epoch": True},
    "negative epoch": {"epoch": -1},
    "epoch beyond int64": {"epoch": 2**80},
    "epoch 2**63": {"epoch": 2**63},
    "size beyond int64": {"size": 2**70},
    "consumed_samples beyond int64": {"consumed_samples": 2**70},
    "no seed": {"seed": None},
    "other format": {"format": "x"},
    "unknown kind": {"kind": "maybe"},
    "exact with clients": {"clients": ["RandomSampler"]},
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_value_is_refused(case: str) -> None:
    value = dict(capture(ElasticSampler(Ids(10), 1, 0), consumed=2).value)
    value.update(HOSTILE[case])
    target = ElasticSampler(Ids(10), 2, 0)
    with pytest.raises(DataStateError):
        restore(value, target)
    assert target.consumed_positions == Positions()
    with pytest.raises(DataStateError):
        restore([1, 2], target)


@pytest.mark.dist
@pytest.mark.parametrize("new_world", [2, 8])
def test_stateful_loader_with_workers_save_at_4_resume_at_another_world(tmp_path: Path, new_world: int) -> None:
    """Two workers per rank, snapshots every 3 steps, prefetching: consumed is what the loader yielded, not
    what its sampler drew; the resume (with workers at DP=2) consumes every sample once."""
    workers: dict[str, Any] = {
        "workers": 2,
        "loader_options": {
            "snapshot_every_n_steps": 3,
            "prefetch_factor": 2,
            "multiprocessing_context": forkserver_context(),
        },
    }
    before = run(Job(4, (5, 4, 4, 4), save=tmp_path / "c", **workers))
    after = run(Job(new_world, load=tmp_path / "c", **(workers if new_world == 2 else {})))
    assert_exactly_once(74, before, after)


@pytest.mark.dist
def test_with_workers_the_sampler_draws_ahead_of_what_is_consumed() -> None:
    """What makes 'consumed' differ from 'drawn': after 2 batches the sampler of a 2-worker loader has drawn
    more (prefetched), and the captured value counts the 4 yielded samples only."""
    sampler = ElasticSampler(Ids(40), 1, 0, shuffle=False)
    loader = StatefulDataLoader(
        Ids(40), batch_size=2, sampler=sampler, num_workers=2, multiprocessing_context=forkserver_context()
    )
    it = iter(loader)
    got = [int(i) for _ in range(2) for i in next(it)]
    assert sampler.drawn > 4
    value = capture(loader).value
    del it
    assert got == [0, 1, 2, 3]
    assert value["consumed"].tolist() == [[0, 4]]


@pytest.mark.unit
@pytest.mark.parametrize("stateful", [False, True])
def test_a_capture_right_after_a_restore_keeps_the_restored_position(tmp_path: Path, stateful: bool) -> None:
    """Restored at DP=2 and captured again before any iteration (a save at the resume step): the value is
    the one restored, not an epoch with nothing consumed."""
    run(Job(4, UNEVEN, save=tmp_path / "a"))
    saved = reshard.load({"data": template()}, tmp_path / "a")["data"]
    group = ThreadGroup(2, timeout=30.0)

    def rank(r: int) -> Any:
        sampler = ElasticSampler(Ids(74), 2, r, seed=7)
        target: Any = StatefulDataLoader(Ids(74), batch_size=2, sampler=sampler) if stateful else sampler
        restore(saved, target)
        return capture(target, group=group.member(r), consumed=None if stateful else 0).value

    again = on_threads(2, rank, group=group)[0]
    assert saved["consumed"].numel() > 0
    assert again["consumed"].tolist() == saved["consumed"].tolist()


def _after_the_last_batch(loader: DataLoader[Any], batches: int) -> list[int]:
    """The sample ids of the first ``batches`` batches, the iterator kept alive (still inside the loop)."""
    it = iter(loader)
    loader._kept = it  # type: ignore[attr-defined]
    return [int(i) for _ in range(batches) for i in next(it)]


@pytest.mark.unit
@pytest.mark.parametrize("sampler", [ElasticSampler, DistributedSampler])
def test_a_capture_right_after_the_last_short_batch_counts_the_rank_share(sampler: Any) -> None:
    """A share of 5, batches of 2: after [0,1],[2,3],[4] (inside the loop) the loader yielded 3 batches of
    at most 2 but 5 samples; the value is the whole share, not a refused 'consumed=6'."""
    loader = StatefulDataLoader(Ids(5), batch_size=2, sampler=sampler(Ids(5), 1, 0, shuffle=False))
    assert _after_the_last_batch(loader, 3) == [0, 1, 2, 3, 4]
    assert capture(loader).value["consumed"].tolist() == [[0, 5]]


@pytest.mark.unit
def test_a_capture_after_the_last_short_batch_on_4_padded_ranks() -> None:
    """10 samples on 4 ranks: shares of 3 (padded to 12), batches of 2 then 1; every rank captured right
    after its short batch: the epoch is consumed."""
    group = ThreadGroup(4, timeout=30.0)

    def rank(r: int) -> Any:
        loader = StatefulDataLoader(Ids(10), batch_size=2, sampler=ElasticSampler(Ids(10), 4, r, seed=1))
        assert len(_after_the_last_batch(loader, 2)) == 3
        return capture(loader, group=group.member(r)).value

    assert on_threads(4, rank, group=group)[0]["consumed"].tolist() == [[0, 10]]


@pytest.mark.unit
def test_with_drop_last_batches_no_short_batch_is_counted() -> None:
    """drop_last=True: batches [0,1],[2,3] of a share of 5, the 5th sample never yielded: 4 consumed; a
    state claiming one batch more than the share holds is still refused."""
    loader = StatefulDataLoader(
        Ids(5), batch_size=2, drop_last=True, sampler=ElasticSampler(Ids(5), 1, 0, shuffle=False)
    )
    assert _after_the_last_batch(loader, 2) == [0, 1, 2, 3]
    assert capture(loader).value["consumed"].tolist() == [[0, 4]]
    with pytest.raises(DataStateError, match="consumed=6"):
        capture(loader, consumed=6)


@pytest.mark.dist
def test_with_workers_a_capture_after_the_last_short_batch_counts_the_rank_share() -> None:
    """The same with 2 worker processes (the count comes from the loader's snapshot)."""
    sampler = ElasticSampler(Ids(5), 1, 0, shuffle=False)
    loader = StatefulDataLoader(
        Ids(5), batch_size=2, sampler=sampler, num_workers=2, multiprocessing_context=forkserver_context()
    )
    got = _after_the_last_batch(loader, 3)
    value = capture(loader).value
    del loader._kept  # type: ignore[attr-defined]
    assert got == [0, 1, 2, 3, 4]
    assert value["consumed"].tolist() == [[0, 5]]


@pytest.mark.unit
@pytest.mark.parametrize(("seed", "epoch"), [(2, 2**80), (2**64 - 1, 1), (-(2**63), 0)])
def test_an_epoch_the_order_generator_cannot_take_is_refused_at_restore(seed: int, epoch: int) -> None:
    """seed + epoch seeds the epoch's order: a value torch's generator cannot take fails the restore (a
    DataStateError, the sampler unchanged), not the first iteration (a ValueError); the edges are taken."""
    value = dict(capture(ElasticSampler(Ids(10), 1, 0, seed=seed), consumed=4).value)
    value["epoch"] = epoch
    target = ElasticSampler(Ids(10), 2, 1, seed=seed)
    if epoch == 0:
        restore(value, target)
        assert len(list(target)) == 3
        return
    with pytest.raises(DataStateError, match="epoch"):
        restore(value, target)
    assert (target.epoch, target.consumed_positions) == (0, Positions())
    assert len(list(target)) == 5


@pytest.mark.unit
def test_skip_count_refuses_a_count_beyond_one_epoch() -> None:
    """skip_count takes consumed_samples as positions of one epoch: a count beyond the dataset's size (each
    rank's sampler drew from the whole dataset, or a crafted value) is refused, not clamped; the size is taken."""
    value = dict(capture(StatefulDataLoader(Ids(40), sampler=RandomSampler(Ids(40)))).value)
    assert value["kind"] == "opaque"
    for count, left in ((40, 0), (41, None), (10**6, None)):
        value["consumed_samples"] = count
        target = ElasticSampler(Ids(40), 4, 0, seed=2)
        if left is None:
            with pytest.raises(DataStateError, match=f"consumed_samples {count}"):
                restore(value, target, approximate="skip_count")
            assert target.consumed_positions == Positions()
        else:
            restore(value, target, approximate="skip_count")
            assert len(list(target)) == left


@pytest.mark.unit
def test_a_restore_into_a_custom_batch_sampler_names_it() -> None:
    """A DataLoader built with batch_sampler= has torch's placeholder SequentialSampler as .sampler: the
    refusal names the batch_sampler and its sampler, not the placeholder; the sampler is not touched."""
    value = capture(ElasticSampler(Ids(12), 1, 0), consumed=3).value
    inner = ElasticSampler(Ids(12), 3, 0)
    loader = DataLoader(Ids(12), batch_sampler=BatchSampler(inner, 2, False))
    with pytest.raises(DataStateError, match=r"batch_sampler \(BatchSampler over ElasticSampler\)") as caught:
        restore(value, loader)
    assert "SequentialSampler" not in str(caught.value)
    assert inner.consumed_positions == Positions()
