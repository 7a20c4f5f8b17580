"""reshard.data.capture / capture_iterable are one agreed step: ranks that pass different kinds of data (a
sampler here, an iterable dataset there) or different keys, or a key that is no name, end the same way, with
the same DataStateError on every rank (and no rank returns while another raises)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from reshard.data import ElasticSampler, ShardedIterable, capture, capture_iterable
from reshard.errors import DataStateError
from reshard.net.transports import ThreadGroup
from tests.datastate.loaderjobs import Ids
from tests.threads import outcomes_on_threads

pytestmark = pytest.mark.unit


def per_rank(size: int, run: Callable[[int, Any], object]) -> list[object]:
    """``run(rank, member)`` on a thread per rank of one ThreadGroup; what each returned or raised."""
    group = ThreadGroup(size, timeout=30)
    return list(outcomes_on_threads(size, lambda r: run(r, group.member(r))))


def sampler(r: int) -> ElasticSampler:
    return ElasticSampler(Ids(12), 2, r)


def iterable(r: int) -> ShardedIterable[int]:
    return ShardedIterable([[1, 2], [3]], rank=r, num_replicas=2)


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(5))


def assert_same_error(results: list[object], *messages: str) -> None:
    assert all(isinstance(e, DataStateError) for e in results), results
    assert len({str(e) for e in results}) == 1, results
    for message in messages:
        assert message in str(results[0]), results[0]


@pytest.mark.parametrize("everywhere", [False, True])
@pytest.mark.parametrize("key", [3, "", None])
def test_a_key_that_is_no_name_fails_every_rank(key: object, everywhere: bool) -> None:
    def run(r: int, member: Any) -> object:
        chosen = key if everywhere or r == 1 else "data"
        return capture(sampler(r), consumed=2, key=chosen, group=member)  # type: ignore[arg-type]

    assert_same_error(per_rank(2, run), "key", repr(key))


def test_ranks_with_different_keys_fail_naming_them() -> None:
    results = per_rank(2, lambda r, m: capture(sampler(r), consumed=2, key=["data", "other"][r], group=m))
    assert_same_error(results, "rank 0: 'data'", "rank 1: 'other'")


def test_ranks_with_different_keys_fail_naming_them_for_iterables_too() -> None:
    results = per_rank(2, lambda r, m: capture_iterable(iterable(r), key=["data", "other"][r], group=m))
    assert_same_error(results, "rank 0: 'data'", "rank 1: 'other'")


@pytest.mark.parametrize(
    "other",
    [
        iterable,
        lambda r: StatefulDataLoader(Stream(), batch_size=2),
    ],
    ids=["sharded-iterable", "loader-over-an-iterable-dataset"],
)
def test_a_sampler_here_and_an_iterable_there_fail_every_rank(other: Callable[[int], object]) -> None:
    def run(r: int, member: Any) -> object:
        return capture(sampler(r) if r == 0 else other(r), consumed=2 if r == 0 else None, group=member)

    results = per_rank(2, run)
    assert_same_error(results)
    assert "not in the same reshard operation" not in str(results[0])


def test_ranks_of_two_kinds_fail_naming_them() -> None:
    def run(r: int, member: Any) -> object:
        if r == 0:
            return capture(sampler(r), consumed=2, group=member)
        return capture_iterable(iterable(r), group=member)

    assert_same_error(per_rank(2, run), "rank 0: 'sampler'", "rank 1: 'iterable'")


def test_consumed_for_an_iterable_on_one_rank_fails_every_rank() -> None:
    results = per_rank(2, lambda r, m: capture(iterable(r), consumed=1 if r == 1 else None, group=m))
    assert_same_error(results, "consumed=")


def test_agreeing_ranks_still_capture() -> None:
    values = per_rank(2, lambda r, m: capture(sampler(r), consumed=2, key="pos", group=m))
    assert [v.key for v in values] == ["pos", "pos"]  # type: ignore[attr-defined]
    streams = per_rank(2, lambda r, m: capture(iterable(r), key="it", group=m))
    assert [v.key for v in streams] == ["it", "it"]  # type: ignore[attr-defined]
