"""Simulated data-parallel jobs for the tests of reshard.data's loaders: ranks as threads of this process
(a ThreadGroup), each with its own sampler and loader over :class:`Ids`, that consume batches, capture and
save their data state with reshard.save, or load it, restore it and go on."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchdata.stateful_dataloader import StatefulDataLoader

import reshard
from reshard.data import ElasticSampler, capture, restore, template
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads


class Ids(Dataset[int]):
    """A map-style dataset whose sample is its own index: the sample id the tests count."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


@dataclass(frozen=True)
class Job:
    """One phase of a job: ``world`` ranks, each consuming ``batches[rank]`` batches (None: to the end of
    the epoch) of ``batch`` samples; restored from ``load`` and saved to ``save`` when given."""

    world: int
    batches: tuple[int | None, ...] | None = None
    load: Path | None = None
    save: Path | None = None
    size: int = 74
    batch: int = 2
    seed: int = 7
    epoch: int = 0
    stateful: bool = True
    workers: int = 0
    sampler: Callable[..., Sampler[int]] = ElasticSampler
    pass_consumed: bool = False
    loader_options: dict[str, Any] = field(default_factory=dict)
    seeds: tuple[int, ...] | None = None  # per rank, to make ranks disagree
    resume_epoch: int | None = None  # the trainer's set_epoch after the restore (None: the restored epoch)


def make_loader(job: Job, sampler: Sampler[int], size: int) -> DataLoader[Any]:
    if job.stateful:
        return StatefulDataLoader(
            Ids(size), batch_size=job.batch, sampler=sampler, num_workers=job.workers, **job.loader_options
        )
    return DataLoader(Ids(size), batch_size=job.batch, sampler=sampler, num_workers=job.workers)


def rank_step(job: Job, group: ThreadGroup, rank: int, size: int | None = None) -> list[int]:
    """One rank of ``job``: the sample ids it consumed."""
    member = group.member(rank)
    seed = job.seeds[rank] if job.seeds is not None else job.seed
    sampler = job.sampler(Ids(size or job.size), job.world, rank, seed=seed)
    sampler.set_epoch(job.epoch)  # type: ignore[attr-defined]
    loader = make_loader(job, sampler, size or job.size)
    if job.load is not None:
        loaded = reshard.load({"data": template()}, job.load, group=member)
        restore(loaded["data"], loader)
        # what a trainer does after a resume: set_epoch(the restored epoch) keeps the restored position
        sampler.set_epoch(job.resume_epoch if job.resume_epoch is not None else loaded["data"]["epoch"])
    ids: list[int] = []
    it = iter(loader)
    wanted = job.batches[rank] if job.batches is not None else None
    while wanted is None or len(ids) < wanted * job.batch:
        try:
            ids += [int(i) for i in next(it)]
        except StopIteration:
            break
    if job.save is not None:
        cell = capture(loader, group=member, consumed=len(ids) if job.pass_consumed else None)
        reshard.save({"data": cell}, job.save, group=member)
    return ids


def run(job: Job, sizes: list[int] | None = None) -> list[list[int]]:
    """Every rank of ``job`` on threads; each rank's consumed sample ids."""
    group = ThreadGroup(job.world, timeout=60.0)
    return on_threads(job.world, lambda r: rank_step(job, group, r, sizes[r] if sizes else None), group=group)


def errors_per_rank(job: Job, sizes: list[int] | None = None) -> list[BaseException | None]:
    """Every rank of ``job``; the exception each raised (None for a rank that did not)."""
    group = ThreadGroup(job.world, timeout=60.0)

    def one(rank: int) -> BaseException | None:
        try:
            rank_step(job, group, rank, sizes[rank] if sizes else None)
        except Exception as exc:  # returned for the test to compare across ranks
            return exc
        return None

    return on_threads(job.world, one)


def assert_exactly_once(size: int, *parts: list[list[int]]) -> None:
    """Every sample id of ``range(size)`` consumed exactly once over all ranks of all phases."""
    counts = Counter(i for phase in parts for ids in phase for i in ids)
    repeated = sorted(i for i, n in counts.items() if n > 1)
    missing = sorted(set(range(size)) - set(counts))
    assert not repeated and not missing, f"repeated {repeated}, missing {missing}"
    assert sum(counts.values()) == size


def flat(ids: list[list[int]]) -> list[int]:
    return [i for rank in ids for i in rank]


def order(size: int, seed: int, epoch: int) -> torch.Tensor:
    return reshard.data.epoch_order(size, seed=seed, epoch=epoch, shuffle=True)
