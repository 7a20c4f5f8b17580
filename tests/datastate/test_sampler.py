"""ElasticSampler: torch's DistributedSampler when nothing was consumed, the remaining positions of an epoch
on any number of ranks when something was, and torchdata's Stateful protocol for same-layout resumes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from reshard.data import ElasticSampler, Positions, epoch_order
from reshard.errors import DataStateError
from tests.datastate.loaderjobs import Ids

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("size", [1, 7, 16, 33])
@pytest.mark.parametrize("world", [1, 3, 4, 8])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_unconsumed_sampler_is_torchs_distributed_sampler(
    size: int, world: int, shuffle: bool, drop_last: bool
) -> None:
    for epoch in (0, 3):
        for rank in range(world):
            ours = ElasticSampler(Ids(size), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            torchs = DistributedSampler(Ids(size), world, rank, shuffle=shuffle, seed=5, drop_last=drop_last)
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs)
            assert len(ours) == len(torchs) == len(list(ours))


def test_epoch_order_is_the_distributed_samplers_permutation() -> None:
    whole = DistributedSampler(Ids(20), 1, 0, seed=9)
    whole.set_epoch(2)
    assert epoch_order(20, seed=9, epoch=2, shuffle=True).tolist() == list(whole)
    assert epoch_order(5, seed=9, epoch=2, shuffle=False).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("size", "new_world", "drop_last"), [(37, 2, False), (37, 8, False), (37, 8, True), (64, 2, True)]
)
def test_a_prefix_resume_yields_what_an_uninterrupted_run_at_the_new_layout_yields(
    size: int, new_world: int, drop_last: bool
) -> None:
    """Consumed: a prefix of C = 8 positions (a multiple of the new world): each new rank yields exactly the
    rest of what DistributedSampler at the new world would have yielded in this epoch."""
    done = 8
    for rank in range(new_world):
        resumed = ElasticSampler(Ids(size), new_world, rank, seed=1, drop_last=drop_last)
        resumed.resume(4, Positions.prefix(done))
        uninterrupted = DistributedSampler(Ids(size), new_world, rank, seed=1, drop_last=drop_last)
        uninterrupted.set_epoch(4)
        assert list(resumed) == list(uninterrupted)[done // new_world :]
        assert len(resumed) == len(list(uninterrupted)) - done // new_world


def test_remaining_positions_are_dealt_in_order_round_robin() -> None:
    """Consumed {0..4, 7}: the rest, 5, 6, 8, 9, ..., dealt round-robin over 3 ranks, padded from the start."""
    order = epoch_order(12, seed=0, epoch=0, shuffle=True)
    rest = [5, 6, 8, 9, 10, 11]
    for rank in range(4):
        sampler = ElasticSampler(Ids(12), 4, rank, seed=0)
        sampler.resume(0, Positions.of([0, 1, 2, 3, 4, 7]))
        padded = [*rest, 0, 1]
        assert list(sampler) == order[padded[rank::4]].tolist()


def test_set_epoch_keeps_the_consumed_positions_of_the_same_epoch_and_clears_them_for_a_new_one() -> None:
    sampler = ElasticSampler(Ids(10), 2, 0, seed=3)
    sampler.resume(2, Positions.prefix(4))
    sampler.set_epoch(2)
    assert sampler.consumed_positions == Positions.prefix(4)
    assert len(sampler) == 3
    sampler.set_epoch(3)
    assert sampler.consumed_positions == Positions()
    fresh = DistributedSampler(Ids(10), 2, 0, seed=3)
    fresh.set_epoch(3)
    assert list(sampler) == list(fresh)


@pytest.mark.parametrize("restored", [False, True])
def test_stateful_dataloader_resumes_an_elastic_sampler_on_the_same_layout(restored: bool) -> None:
    """StatefulDataLoader.state_dict / load_state_dict (no workers) carry the sampler through its Stateful
    protocol: a new loader continues exactly where the old one was, also from a restored consumed set."""

    def loader() -> tuple[StatefulDataLoader, ElasticSampler]:
        sampler = ElasticSampler(Ids(30), 3, 1, seed=4)
        if restored:
            sampler.resume(1, Positions.of([0, 1, 2, 9, 10]))
        else:
            sampler.set_epoch(1)
        return StatefulDataLoader(Ids(30), batch_size=2, sampler=sampler), sampler

    whole, _ = loader()
    expected = [int(i) for batch in whole for i in batch]
    first, _ = loader()
    it = iter(first)
    before = [int(i) for _ in range(3) for i in next(it)]
    state = first.state_dict()
    second, sampler = loader()
    sampler.resume(0, Positions())  # what the state holds must win over what the sampler held
    second.load_state_dict(state)
    after = [int(i) for batch in second for i in batch]
    assert before + after == expected


@pytest.mark.parametrize(
    "state",
    [
        {"epoch": 0, "consumed": [[0, 3]]},
        {"epoch": "0", "consumed": [], "yielded": 0},
        {"epoch": 0, "consumed": [[3, 1]], "yielded": 0},
        {"epoch": 0, "consumed": [[0, 3], [2, 5]], "yielded": 0},
        {"epoch": 0, "consumed": [[0, 99]], "yielded": 0},
        {"epoch": 0, "consumed": [["a", "b"]], "yielded": 0},
        {"epoch": 0, "consumed": [], "yielded": -1},
        {"epoch": 0, "consumed": [], "yielded": 50},
        {"epoch": 2**80, "consumed": [], "yielded": 0},
        {"epoch": 2**63, "consumed": [], "yielded": 0},
    ],
)
def test_load_state_dict_refuses_a_malformed_state(state: dict[str, object]) -> None:
    sampler = ElasticSampler(Ids(10), 2, 0)
    with pytest.raises(DataStateError):
        sampler.load_state_dict(state)


def test_a_refused_state_changes_nothing() -> None:
    """More indices yielded than the rank's share of the state's epoch: refused before the epoch or the consumed
    positions change (it set both, then refused)."""
    sampler = ElasticSampler(Ids(10), 2, 0)
    with pytest.raises(DataStateError, match="6 yielded of 5"):
        sampler.load_state_dict({"epoch": 9, "consumed": [], "yielded": 6})
    assert (sampler.epoch, sampler.consumed_positions) == (0, Positions())


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_is_the_count_of_the_positions_a_rank_takes(drop_last: bool) -> None:
    for size, world, consumed in ((10, 3, []), (10, 3, [0, 4, 5]), (7, 4, [6]), (5, 8, [0, 1]), (9, 2, list(range(9)))):
        for rank in range(world):
            sampler = ElasticSampler(Ids(size), world, rank, drop_last=drop_last)
            sampler.resume(0, Positions.of(consumed))
            assert len(sampler) == sampler.positions().numel() == len(list(sampler))


def test_positions_are_sorted_disjoint_intervals() -> None:
    assert Positions.of([5, 1, 2, 3, 9, 2]).intervals == ((1, 4), (5, 6), (9, 10))
    assert Positions.prefix(4).union(Positions.of([4, 6])).intervals == ((0, 5), (6, 7))
    assert Positions.of([1, 3]).remaining(5).tolist() == [0, 2, 4]
    for chosen in ([], [0], [0, 1, 2, 5, 9], [3, 4]):
        taken = torch.zeros(10, dtype=torch.bool)
        taken[chosen] = True
        assert Positions.from_mask(taken) == Positions.of(chosen)
    stored = Positions.of([0, 1, 7]).to_tensor()
    assert stored.dtype == torch.int64
    assert Positions.from_tensor(stored, 8, where="t") == Positions.of([0, 1, 7])
    for bad in (torch.tensor([[0, 9]]), torch.tensor([[-1, 2]]), torch.tensor([[0, 3], [2, 4]]), [[0, 1]]):
        with pytest.raises(DataStateError):
            Positions.from_tensor(bad, 8, where="t")
