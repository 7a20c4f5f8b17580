"""reshard.data.ShardedIterable: per-rank, per-worker positions captured in global terms and resharded.

Every test asserts by SAMPLE IDS ``(shard, offset)``: over the whole job (before and after a change of data-parallel
size or worker count), every sample of the epoch is consumed exactly once. Ranks are simulated: each rank its own
torchdata StatefulDataLoader, driven from the test's thread; the capture collective and the save and load run on a
ThreadGroup (tests/threads.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import reshard
from reshard.data import ShardedIterable, capture_iterable, restore_iterable
from reshard.data.iterable_state import KIND
from reshard.errors import DataStateError
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads, outcomes_on_threads

LENGTHS = [7, 3, 11, 5, 9, 2, 13, 6, 4, 8, 10, 1, 12]  # 13 shards of uneven length, 91 samples
SHARDS = [[s * 1000 + o for o in range(n)] for s, n in enumerate(LENGTHS)]
EVERY = {(s, o) for s, n in enumerate(LENGTHS) for o in range(n)}
BATCH = 3

Id = tuple[int, int]


def dataset(rank: int, replicas: int, **kw: Any) -> ShardedIterable[int]:
    return ShardedIterable(SHARDS, rank=rank, num_replicas=replicas, with_ids=True, **kw)


def loader(ds: ShardedIterable[int], workers: int = 0, every: int = 1) -> StatefulDataLoader[Any]:
    return StatefulDataLoader(ds, batch_size=BATCH, num_workers=workers, snapshot_every_n_steps=every)


def ids(batch: dict[str, torch.Tensor]) -> list[Id]:
    """The sample ids of a collated batch, checked against the samples themselves."""
    out = list(zip(batch["shard"].tolist(), batch["offset"].tolist(), strict=True))
    assert batch["sample"].tolist() == [s * 1000 + o for s, o in out]
    return out


class Rank:
    """One simulated data-parallel rank: its loader and its iterator, driven from the test's thread."""

    def __init__(self, rank: int, replicas: int, workers: int = 0, every: int = 1, **kw: Any) -> None:
        self.dataset = dataset(rank, replicas, **kw)
        self.loader = loader(self.dataset, workers, every)
        self.it: Iterator[Any] | None = None

    def take(self, batches: int) -> list[Id]:
        if self.it is None:
            self.it = iter(self.loader)
        out: list[Id] = []
        for _ in range(batches):
            out += ids(next(self.it))
        return out

    def rest(self) -> list[Id]:
        if self.it is None:
            self.it = iter(self.loader)
        return [i for batch in self.it for i in ids(batch)]


def save_positions(ranks: list[Rank], path: Path, capture: Callable[..., Any] = capture_iterable) -> None:
    """capture_iterable on every rank (threads of one ThreadGroup), then reshard.save of the captured object."""
    group = ThreadGroup(len(ranks))

    def run(r: int) -> None:
        obj = capture(ranks[r].loader, group=group.member(r))
        reshard.save({"data": obj}, path, group=group.member(r))

    on_threads(len(ranks), run, group=group)


def load_positions(ranks: list[Rank], path: Path, restore: Callable[..., Any] = restore_iterable) -> None:
    """reshard.load of the single-cell object on every rank of the new layout, then restore_iterable (local)."""
    group = ThreadGroup(len(ranks))

    def run(r: int) -> object:
        template = {"data": reshard.ShardedObject("data", None, (1,), (0,))}
        return reshard.load(template, path, group=group.member(r))["data"]

    for rank, value in zip(ranks, on_threads(len(ranks), run, group=group), strict=True):
        restore(value, rank.loader)


def assert_once(consumed: list[Id]) -> None:
    counts = Counter(consumed)
    assert {i for i, c in counts.items() if c > 1} == set(), "samples consumed twice"
    assert EVERY - set(counts) == set(), "samples never consumed"
    assert set(counts) == EVERY


UNEVEN = [1, 3, 0, 2]  # batches each of the 4 ranks consumes before the save


@pytest.mark.unit
@pytest.mark.parametrize("new_dp", [2, 4, 8])
def test_dp4_to_another_dp_consumes_every_sample_once(tmp_path: Path, new_dp: int) -> None:
    old = [Rank(r, 4) for r in range(4)]
    consumed = [i for rank, n in zip(old, UNEVEN, strict=True) for i in rank.take(n)]
    assert len(consumed) == sum(UNEVEN) * BATCH
    save_positions(old, tmp_path / "ckpt")
    new = [Rank(r, new_dp) for r in range(new_dp)]
    load_positions(new, tmp_path / "ckpt")
    for rank in new:
        consumed += rank.rest()
    assert_once(consumed)


@pytest.mark.unit
def test_a_second_reshard_in_the_same_epoch(tmp_path: Path) -> None:
    old = [Rank(r, 4) for r in range(4)]
    consumed = [i for rank, n in zip(old, UNEVEN, strict=True) for i in rank.take(n)]
    save_positions(old, tmp_path / "a")
    middle = [Rank(r, 2) for r in range(2)]
    load_positions(middle, tmp_path / "a")
    consumed += middle[0].take(4) + middle[1].take(1)
    save_positions(middle, tmp_path / "b")
    new = [Rank(r, 8) for r in range(8)]
    load_positions(new, tmp_path / "b")
    for rank in new:
        consumed += rank.rest()
    assert_once(consumed)


@pytest.mark.unit
def test_reshard_data_capture_and_restore_take_iterable_datasets_too(tmp_path: Path) -> None:
    """reshard.data.capture / restore hand a loader over a ShardedIterable to capture_iterable /
    restore_iterable: one pair of calls for every kind of data."""
    old = [Rank(r, 4) for r in range(4)]
    before = [i for rank, n in zip(old, UNEVEN, strict=True) for i in rank.take(n)]
    save_positions(old, tmp_path / "ckpt", reshard.data.capture)
    new = [Rank(r, 2) for r in range(2)]
    load_positions(new, tmp_path / "ckpt", reshard.data.restore)
    assert_once(before + [i for rank in new for i in rank.rest()])
    value = reshard.load({"data": reshard.data.template()}, tmp_path / "ckpt")["data"]
    done = reshard.data.restore(value, Rank(0, 2).loader)  # says what it restored
    assert (done.epoch, done.consumed, done.approximation) == (0, len(before), None)
    with pytest.raises(DataStateError, match="consumed= does not apply"):
        reshard.data.capture(new[0].loader, consumed=3)


@pytest.mark.unit
def test_the_same_layout_continues_as_an_uninterrupted_run(tmp_path: Path) -> None:
    """At the same number of streams, each stream keeps its shards: the order is the uninterrupted one."""
    reference = [Rank(r, 4).rest() for r in range(4)]
    old = [Rank(r, 4) for r in range(4)]
    before = [rank.take(n) for rank, n in zip(old, UNEVEN, strict=True)]
    save_positions(old, tmp_path / "ckpt")
    new = [Rank(r, 4) for r in range(4)]
    load_positions(new, tmp_path / "ckpt")
    for r, rank in enumerate(new):
        assert before[r] + rank.rest() == reference[r]


@pytest.mark.unit
def test_torchdata_load_state_dict_resumes_the_same_layout() -> None:
    """A stream's state_dict is torchdata's Stateful: StatefulDataLoader.load_state_dict continues it."""
    reference = Rank(1, 4).rest()
    first = Rank(1, 4)
    before = first.take(2)
    state = first.loader.state_dict()
    second = Rank(1, 4)
    second.loader.load_state_dict(state)
    assert before + second.rest() == reference


@pytest.mark.unit
def test_a_stream_state_loaded_into_another_layout_is_refused() -> None:
    state = Rank(1, 4).loader.state_dict()
    other = Rank(1, 2)
    other.loader.load_state_dict(state)
    with pytest.raises(DataStateError, match="stream 1 of 4 was loaded into stream 1 of 2"):
        other.rest()


@pytest.mark.unit
def test_epochs_start_over_with_a_seeded_shard_order() -> None:
    ranks = [Rank(r, 2, seed=7, shuffle_shards=True) for r in range(2)]
    epochs = []
    for epoch in range(3):
        per_rank = []
        for rank in ranks:
            rank.dataset.set_epoch(epoch)
            rank.it = None
            per_rank.append(rank.rest())
        assert_once(per_rank[0] + per_rank[1])
        epochs.append(per_rank)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    again = Rank(0, 2, seed=7, shuffle_shards=True)
    again.dataset.set_epoch(1)
    again.dataset.set_epoch(1)  # the same epoch again: nothing is reset
    assert again.take(1) + again.rest() == epochs[1][0]
    assert ranks[0].rest() == [], "a pass over a consumed stream yields nothing until set_epoch"


def rank_errors(size: int, run: Callable[[int], object]) -> list[BaseException | None]:
    """``run(rank)`` on a thread per rank; what each raised (None when it returned)."""
    return [o if isinstance(o, BaseException) else None for o in outcomes_on_threads(size, run)]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("rank3", "message"),
    [
        ({"seed": 5}, "rank 3 has seed 5, rank 0 has 0"),
        ({"shuffle_shards": True}, "rank 3 has shuffle_shards True"),
        ({"rank": 2}, "ranks 2 and 3 are replicas of one data rank but disagree"),
        ({"replicas": 5}, "rank 3 has num_replicas 5, rank 0 has 4"),
    ],
)
def test_disagreeing_ranks_raise_the_same_error_on_every_rank(rank3: dict[str, Any], message: str) -> None:
    ranks = [Rank(r, 4) for r in range(3)]
    ranks.append(Rank(rank3.pop("rank", 3), rank3.pop("replicas", 4), **rank3))
    for rank, n in zip(ranks, UNEVEN, strict=True):
        rank.take(n)
    group = ThreadGroup(4, timeout=30)
    errors = rank_errors(4, lambda r: capture_iterable(ranks[r].loader, group=group.member(r)))
    assert all(isinstance(e, DataStateError) for e in errors), errors
    assert all(message in str(e) for e in errors), errors


@pytest.mark.unit
def test_a_missing_data_rank_is_refused() -> None:
    """Two ranks of a group of 2 that both say they are data rank 0 of 2: stream 1 is held by nobody."""
    ranks = [Rank(0, 2), Rank(0, 2)]
    group = ThreadGroup(2, timeout=30)
    errors = rank_errors(2, lambda r: capture_iterable(ranks[r].loader, group=group.member(r)))
    assert all(isinstance(e, DataStateError) and "no rank holds streams [1]" in str(e) for e in errors), errors


def captured(ranks: list[Rank]) -> dict[str, Any]:
    group = ThreadGroup(len(ranks))
    objs = on_threads(len(ranks), lambda r: capture_iterable(ranks[r].loader, group=group.member(r)), group=group)
    value = dict(objs[0].value)
    assert value["kind"] == KIND
    return value


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cursors": 2, "at": 20}, "the cursor of shard 2 is 20, outside"),
        ({"cursors": 2, "at": -1}, "the cursor of shard 2 is -1, outside"),
        ({"cursors": "x"}, "cursors is a str, not a 1-d int64 tensor"),
        ({"cursors": [0] * len(LENGTHS)}, "cursors is a list, not a 1-d int64 tensor"),
        ({"owners": 2, "at": -1}, "shard 2 has 11 samples left but no stream owns it"),
        ({"epoch": 2**63}, "epoch is 9223372036854775808"),
        ({"num_workers": 0}, "num_workers is 0"),
        ({"num_replicas": -1}, "num_replicas is -1"),
        ({"num_replicas": 3}, "3 replicas of 1 workers are not its 4 streams"),
        ({"num_shards": 14}, "num_shards is 14 for the 13 shards"),
        ({"cursors": torch.zeros(len(LENGTHS))}, "torch.float32 tensor"),
        ({"cursors": torch.zeros(3, dtype=torch.int64)}, "has 3 entries for 13 shards"),
        ({"owners": 0, "at": 9}, "owned by stream 9 of 4"),
        ({"epoch": -1}, "epoch is -1"),
        ({"epoch": "0"}, "epoch is '0'"),
        ({"streams": 0}, "streams is 0"),
        ({"seed": 1}, "captured with seed 1"),
        ({"kind": "other"}, "not a captured ShardedIterable position"),
        ({"digest": "0" * 64}, "captured for another shard list"),
        ({"shuffle_shards": 0}, "captured with shuffle_shards 0"),
        ({"cursors": torch.zeros(len(LENGTHS), dtype=torch.int64, device="meta")}, "on meta, not the CPU"),
    ],
)
def test_hostile_values_are_refused(change: dict[str, Any], message: str) -> None:
    value = captured([Rank(r, 4) for r in range(4)])
    at = change.pop("at", None)
    for field, new in change.items():
        if at is not None:
            value[field] = value[field].clone()
            value[field][new] = at
        else:
            value[field] = new
    target = Rank(0, 2)
    with pytest.raises(DataStateError, match=message):
        restore_iterable(value, target.loader)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cursors": [99]}, "cursor of shard"),
        ({"cursors": [-1]}, "cursor of shard"),
        ({"shards": [13]}, "shard id is 13"),
        ({"shards": ["0"]}, "shard id is '0'"),
        ({"stream": 4}, "stream is 4"),
        ({"epoch": 2**80}, "epoch is 1208925819614629174706176"),
        ({"format": "x"}, "not the state of a reshard.data.ShardedIterable stream"),
        ({"digest": "x"}, "saved for another shard list"),
    ],
)
def test_hostile_stream_states_are_refused(change: dict[str, Any], message: str) -> None:
    state = dataset(0, 4).state_dict()
    state.update(change)
    if "shards" in change or "cursors" in change:
        state["shards"], state["cursors"] = state["shards"][: len(state["cursors"])], state["cursors"][:1]
        state["shards"] = change.get("shards", state["shards"][:1])
    with pytest.raises(DataStateError, match=message):
        dataset(0, 4).load_state_dict(state)


@pytest.mark.unit
def test_another_dataset_is_refused(tmp_path: Path) -> None:
    value = captured([Rank(r, 2) for r in range(2)])
    other = ShardedIterable([*SHARDS, [1, 2]], rank=0, num_replicas=2)
    with pytest.raises(DataStateError, match=r"captured for another shard list.*14 shards of 93 samples"):
        restore_iterable(value, other)


class Opaque(IterableDataset[int]):
    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Iterator[int]:
        yield from range(10)

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


@pytest.mark.unit
def test_state_reshard_cannot_interpret_is_refused_naming_it() -> None:
    with pytest.raises(DataStateError, match="the dataset of the StatefulDataLoader is a Opaque"):
        capture_iterable(StatefulDataLoader(Opaque(), batch_size=2))
    value = captured([Rank(0, 1)])
    with pytest.raises(DataStateError, match=r"is a Opaque, not a reshard\.data\.ShardedIterable"):
        restore_iterable(value, StatefulDataLoader(Opaque(), batch_size=2))
    with pytest.raises(DataStateError, match="DataLoader has no state_dict"):
        capture_iterable(DataLoader(dataset(0, 1), batch_size=2))
    with pytest.raises(DataStateError, match="a list is neither"):
        capture_iterable([1, 2])


@pytest.mark.dist
@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize(("new_dp", "new_workers"), [(2, 3), (8, 1), (4, 2)])
def test_workers_positions_are_those_yielded_not_prefetched(
    tmp_path: Path, every: int, new_dp: int, new_workers: int
) -> None:
    """DP=4 with 2 workers each (prefetching 2 batches per worker), snapshots every step or every 3 steps, then
    a resume at another DP size and worker count: every sample once, so no prefetched sample counted as
    consumed (it would be missing) and no yielded one forgotten (it would be twice)."""
    old = [Rank(r, 4, workers=2, every=every) for r in range(4)]
    consumed = [i for rank, n in zip(old, [2, 5, 1, 4], strict=True) for i in rank.take(n)]
    save_positions(old, tmp_path / "ckpt")
    del old
    new = [Rank(r, new_dp, workers=new_workers) for r in range(new_dp)]
    load_positions(new, tmp_path / "ckpt")
    for rank in new:
        consumed += rank.rest()
    assert_once(consumed)


@pytest.mark.unit
def test_a_shard_without_owner_is_accepted_only_when_consumed(tmp_path: Path) -> None:
    """Owner -1 means a shard no stream reads (consumed before the streams' plan): with its cursor at its end
    the value restores at the same layout and every other sample is yielded once."""
    ranks = [Rank(r, 4) for r in range(4)]
    consumed = [i for rank, n in zip(ranks, UNEVEN, strict=True) for i in rank.take(n)]
    value = captured(ranks)
    shard = int(value["owners"][2])
    value["cursors"], value["owners"] = value["cursors"].clone(), value["owners"].clone()
    value["cursors"][2], value["owners"][2] = LENGTHS[2], -1
    assert shard >= 0
    again = [Rank(r, 4) for r in range(4)]
    for rank in again:
        restore_iterable(value, rank.loader)
    rest = [i for rank in again for i in rank.rest()]
    skipped = {(2, o) for o in range(LENGTHS[2])} - set(consumed)
    assert_once(consumed + rest + sorted(skipped))


@pytest.mark.unit
def test_epochs_the_shard_order_generator_cannot_take_are_refused() -> None:
    with pytest.raises(DataStateError, match="epoch"):
        dataset(0, 1).set_epoch(2**63)
    with pytest.raises(DataStateError, match="seed"):
        dataset(0, 1, seed=2**64)
