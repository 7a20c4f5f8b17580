"""Capture and restore the data position of map-style loaders and samplers across layouts.

:func:`capture` (collective) turns every rank's loader or sampler into one layout-independent value, the
epoch's consumed positions (:mod:`reshard.data.progress`); :func:`restore` (local) sets a rank's
:class:`~reshard.data.sampler.ElasticSampler` to take its share of what remains, on any number of ranks.
"Consumed" means yielded to the training loop before the capture: samples a ``StatefulDataLoader`` drew or
its workers prefetched but did not yield are not consumed, and are yielded again after a restore.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler
from torch.utils.data.distributed import DistributedSampler

from reshard.data.capture_step import agreed_capture
from reshard.data.iterable import ShardedIterable
from reshard.data.iterable_state import KIND as ITERABLE_KIND
from reshard.data.iterable_state import iterable_capture, restore_iterable
from reshard.data.order import Positions, generator_seed
from reshard.data.progress import DataProgress, RankReport, combine_reports, digest
from reshard.data.sampler import ElasticSampler, share
from reshard.errors import DataStateError
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.state.sharding import ShardedObject

try:  # torchdata is optional: without it there is no StatefulDataLoader to find
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
except ImportError:  # pragma: no cover - the test extra installs torchdata
    StatefulDataLoader = StatefulBatchSampler = type("_Absent", (), {})

APPROXIMATIONS = ("restart_epoch", "skip_count")
"""What :func:`restore` may do with an opaque value on another layout, when the caller opts in:
``restart_epoch`` starts the saved epoch over (samples consumed before the save are consumed again);
``skip_count`` gives an ``ElasticSampler`` the first ``consumed_samples`` positions of the epoch as consumed
(exact only if the saved job's order was that epoch's global order and its ranks consumed a prefix; a count
beyond the dataset's size is no epoch's positions, as when each rank's sampler drew from the whole dataset,
and is refused)."""


@dataclass(frozen=True)
class RestoredData:
    """What :func:`restore` did: the epoch set, how many of its positions count as consumed, and the
    approximation used (None: exact)."""

    epoch: int | None
    consumed: int
    approximation: str | None = None


def template(key: str = "data") -> ShardedObject:
    """The load template of the value :func:`capture` made under ``key``: its one cell, at any layout."""
    return ShardedObject(key, None, (1,), (0,))


def capture(
    loader_or_sampler: object,
    *,
    key: str = "data",
    group: Group = None,
    timeout: datetime.timedelta | float | None = None,
    consumed: int | None = None,
) -> ShardedObject:
    """The data position of the job as one single-cell ``ShardedObject`` under ``key``, for ``reshard.save``.

    Collective: every rank of ``group`` calls it. ``consumed`` (samples of this rank's current iteration
    that the training loop consumed) is required for a bare sampler and for a plain ``DataLoader`` with
    workers, and overrides what the loader reports. Ranks that share a data-parallel rank (TP/PP peers) must
    report the same; any disagreement raises DataStateError on every rank. An opaque client (a sampler or
    loader whose order reshard cannot know) gives a value recording it as opaque.

    A :class:`~reshard.data.ShardedIterable` (or a loader over an iterable dataset) is captured by
    :func:`~reshard.data.capture_iterable` (``consumed`` does not apply to it: its streams count themselves).
    Both are one agreed step: ranks that pass different kinds of data or different keys, or a key that is no
    non-empty str, raise the same DataStateError on every rank.
    """
    if _iterable(loader_or_sampler):
        return iterable_capture(loader_or_sampler, key=key, group=group, timeout=timeout, consumed=consumed)
    comm = Communicator(group, timeout=timeout)
    base = _base(loader_or_sampler)

    def local() -> dict[str, Any]:
        return report(loader_or_sampler, consumed).to_json()

    combined = agreed_capture(
        comm, kind="sampler", key=key, local=local, combine=lambda reports: combine_reports(reports, base)
    )
    value = DataProgress.from_json(combined).to_value()
    return ShardedObject(key, value, (1,), (0,), replica_id=comm.rank)


def _iterable(target: object) -> bool:
    """Whether ``target`` is an iterable dataset or a loader over one (the iterable flow's, not a sampler's)."""
    return isinstance(target, ShardedIterable) or (
        isinstance(target, DataLoader) and isinstance(target.dataset, IterableDataset)
    )


def _base(target: object) -> Positions:
    """The epoch's positions consumed before the target's current iteration (restored, or kept by
    ``set_epoch`` of the same epoch); empty unless an ElasticSampler."""
    sampler = target.sampler if isinstance(target, DataLoader) else target
    return sampler.consumed_positions if isinstance(sampler, ElasticSampler) else Positions()


def _known_order(sampler: object) -> bool:
    """Whether reshard knows the sampler's order: an ElasticSampler or a DistributedSampler whose
    ``__iter__`` is torch's own."""
    if isinstance(sampler, ElasticSampler):
        return type(sampler).__iter__ is ElasticSampler.__iter__
    return isinstance(sampler, DistributedSampler) and type(sampler).__iter__ is DistributedSampler.__iter__


def report(target: object, consumed: int | None) -> RankReport:
    """This rank's report of ``target`` (a loader or a sampler) for :func:`capture`."""
    if consumed is not None and (type(consumed) is not int or consumed < 0):
        raise DataStateError(f"reshard.data.capture: consumed={consumed!r} is not a count of samples")
    if isinstance(target, DataLoader):
        sampler = target.sampler
        problem = _loader_problem(target)
        taken, finished = _loader_taken(target, sampler, consumed, problem)
        client = f"{type(target).__name__} with {type(sampler).__name__}"
        return _sampler_report(sampler, client, taken, finished, problem)
    if isinstance(target, Sampler):
        if consumed is None:
            raise DataStateError(
                f"reshard.data.capture: a bare {type(target).__name__} needs consumed= (the samples of its "
                "current iteration the training loop consumed)"
            )
        return _sampler_report(target, type(target).__name__, consumed, False, None)
    raise DataStateError(f"reshard.data.capture: {type(target).__name__} is neither a DataLoader nor a Sampler")


def _loader_problem(loader: DataLoader[Any]) -> str | None:
    """Why a loader's draws cannot be mapped to positions (None when they can)."""
    batches = loader.batch_sampler
    if batches is not None and (type(batches) not in (BatchSampler, StatefulBatchSampler) or _custom_batches(loader)):
        return f"a custom batch_sampler ({type(batches).__name__})"
    if loader.num_workers > 0 and not getattr(loader, "in_order", True):
        return "in_order=False with workers"
    if not _known_order(loader.sampler):
        return f"a sampler of unknown order ({type(loader.sampler).__name__})"
    return None


def _custom_batches(loader: DataLoader[Any]) -> bool:
    """Whether the loader's batches come from a batch_sampler of its own (``batch_sampler=``: then its
    ``.sampler`` is torch's placeholder, not what draws the samples)."""
    batches = loader.batch_sampler
    return batches is not None and getattr(batches, "sampler", None) is not loader.sampler


def _per_yield(loader: DataLoader[Any]) -> int:
    """Samples per item the loader yields (its batch size, or 1 without batching)."""
    batches = loader.batch_sampler
    return int(batches.batch_size) if isinstance(batches, BatchSampler) else 1


def _loader_taken(
    loader: DataLoader[Any], sampler: object, consumed: int | None, problem: str | None
) -> tuple[int | None, bool]:
    """(samples of the current iteration yielded to the training loop, whether the iteration finished)."""
    if consumed is not None:
        return consumed, False
    if loader.num_workers > 0 and not isinstance(loader, StatefulDataLoader):
        raise DataStateError(
            "reshard.data.capture: a plain DataLoader with workers does not tell what it yielded (its workers "
            "prefetch); pass consumed=, or use torchdata's StatefulDataLoader"
        )
    if isinstance(sampler, ElasticSampler) and not sampler.iterated_this_epoch:
        return 0, False  # set_epoch moved on since the loader's last iteration: nothing of this epoch yet
    if isinstance(loader, StatefulDataLoader):
        if loader.num_workers > 0 and problem is not None:
            return None, False
        yielded, finished = stateful_yielded(loader)
        return _samples_yielded(loader, sampler, yielded), finished
    if isinstance(sampler, ElasticSampler):
        return sampler.drawn, False  # no workers: what the sampler drew is what the loop got
    if problem is not None:
        return None, False
    raise DataStateError(
        f"reshard.data.capture: a plain DataLoader with a {type(sampler).__name__} does not tell what it "
        "yielded; pass consumed=, or use ElasticSampler or torchdata's StatefulDataLoader"
    )


def _samples_yielded(loader: DataLoader[Any], sampler: object, batches: int) -> int:
    """The samples in the first ``batches`` items the loader yielded: ``batches x batch_size``, except that
    the last batch of the rank's share is short when the batches keep the tail (``drop_last=False``), so a
    count of exactly the share's batches is the share (``min(batches x batch_size, share)``, exact because
    only the last batch is short). A count beyond that is left as it is, for the capture to refuse."""
    per_yield = _per_yield(loader)
    taken = batches * per_yield
    if per_yield > 1 and not loader.drop_last and hasattr(sampler, "__len__"):
        rank_share = len(sampler)
        if (batches - 1) * per_yield < rank_share < taken:
            return rank_share
    return taken


def stateful_yielded(loader: StatefulDataLoader) -> tuple[int, bool]:
    """(items the loader's current iteration yielded to the training loop, whether it finished), from its
    ``state_dict`` (torchdata 0.11: ``_num_yielded`` without workers; with workers the snapshot's
    ``_snapshot_step`` plus ``_steps_since_snapshot``), or from the state it will resume."""
    state = loader.next_iter_state if loader._iterator is None else loader.state_dict()
    if state is None:
        return 0, False
    try:
        if "_snapshot" in state:
            yielded = state["_snapshot"]["_snapshot_step"] + state["_steps_since_snapshot"]
        else:
            yielded = state["_num_yielded"]
        finished = state["_iterator_finished"]
    except (KeyError, TypeError) as exc:
        raise DataStateError(f"reshard.data.capture: a StatefulDataLoader state of another shape: {exc!r}") from exc
    if type(yielded) is not int or yielded < 0 or type(finished) is not bool:
        raise DataStateError(f"reshard.data.capture: StatefulDataLoader yielded {yielded!r}, finished {finished!r}")
    return yielded, finished


def _sampler_report(sampler: object, client: str, taken: int | None, finished: bool, problem: str | None) -> RankReport:
    """The report of a sampler: exact for a known order, else opaque with what is known."""
    dataset = getattr(sampler, "dataset", getattr(sampler, "data_source", None))
    size = len(dataset) if dataset is not None and hasattr(dataset, "__len__") else None
    if problem is not None or not _known_order(sampler):
        distributed = sampler if isinstance(sampler, DistributedSampler) else None
        return RankReport(
            client=f"{client} ({problem or 'a sampler of unknown order'})",
            opaque=True,
            dp_rank=distributed.rank if distributed is not None else None,
            dp_size=distributed.num_replicas if distributed is not None else None,
            size=size,
            seed=getattr(sampler, "seed", None),
            shuffle=getattr(sampler, "shuffle", None),
            drop_last=getattr(sampler, "drop_last", None),
            epoch=getattr(sampler, "epoch", None),
            base="",
            taken=taken,
            finished=finished,
        )
    assert isinstance(sampler, DistributedSampler)
    assert size is not None
    base = _base(sampler)
    if taken is None:
        raise DataStateError(f"reshard.data.capture: {client}: the samples consumed are unknown; pass consumed=")
    own = share(size, sampler.num_replicas, base, sampler.drop_last)
    if taken > own:
        raise DataStateError(f"reshard.data.capture: {client}: consumed={taken} of the rank's {own} samples")
    return RankReport(
        client=client,
        opaque=False,
        dp_rank=sampler.rank,
        dp_size=sampler.num_replicas,
        size=size,
        seed=sampler.seed,
        shuffle=sampler.shuffle,
        drop_last=sampler.drop_last,
        epoch=sampler.epoch,
        base=digest(base),
        taken=taken,
        finished=finished,
    )


def restore(value: object, loader_or_sampler: object, *, approximate: str | None = None) -> RestoredData:
    """Set this rank's loader or sampler to resume the data position :func:`capture` saved, on any layout.

    Local (no collective): every rank restores the same value (as ``reshard.load`` returns it for
    :func:`template`, or the ``ShardedObject`` itself) into its own loader or sampler. The sampler
    must be an :class:`ElasticSampler` with the saved dataset size, seed, shuffle and drop_last (torch's
    ``DistributedSampler`` only when nothing of the epoch was consumed); a ``StatefulDataLoader``'s iterator
    is reset, so that the next ``iter(loader)`` starts at the restored position. An opaque value is refused
    (DataStateError naming its clients) unless ``approximate`` names one of :data:`APPROXIMATIONS`, which
    only opaque values use.

    A value of :func:`~reshard.data.capture_iterable` (or a target that is an iterable dataset or a loader over
    one) is restored by :func:`~reshard.data.restore_iterable`; ``approximate`` does not apply to it.
    """
    raw = value.value if isinstance(value, ShardedObject) else value
    if _iterable(loader_or_sampler) or (isinstance(raw, dict) and raw.get("kind") == ITERABLE_KIND):
        if approximate is not None:
            raise DataStateError("reshard.data.restore: approximate= does not apply to an iterable dataset")
        plan = restore_iterable(raw, loader_or_sampler)
        return RestoredData(epoch=plan.epoch, consumed=sum(plan.cursors))
    if approximate is not None and approximate not in APPROXIMATIONS:
        raise DataStateError(f"reshard.data.restore: approximate={approximate!r} is none of {APPROXIMATIONS}")
    progress = DataProgress.from_value(raw)
    loader = loader_or_sampler if isinstance(loader_or_sampler, DataLoader) else None
    sampler = loader.sampler if loader is not None else loader_or_sampler
    if loader is not None and _custom_batches(loader):
        batches = loader.batch_sampler
        inner = type(getattr(batches, "sampler", None)).__name__
        raise DataStateError(
            f"reshard.data.restore: a {type(loader).__name__} with a custom batch_sampler ({type(batches).__name__} "
            f"over {inner}) cannot take a saved position: reshard cannot know its order; build the loader with "
            "sampler=reshard.data.ElasticSampler(...) and batch_size="
        )
    if not isinstance(sampler, Sampler):
        raise DataStateError(
            f"reshard.data.restore: {type(loader_or_sampler).__name__} is neither a DataLoader nor a Sampler"
        )
    done = _restore_opaque(progress, sampler, approximate) if progress.opaque else _restore_exact(progress, sampler)
    if isinstance(loader, StatefulDataLoader):
        loader.load_state_dict({})  # drops the current iterator
        loader.next_iter_state = None  # and a state it would resume
    return done


def _restore_exact(progress: DataProgress, sampler: Sampler[Any]) -> RestoredData:
    """Give ``sampler`` the saved epoch and consumed positions, after checking it draws the same order."""
    if not isinstance(sampler, DistributedSampler) or not _known_order(sampler):
        raise DataStateError(
            f"reshard.data.restore: a {type(sampler).__name__} cannot take a saved position; use "
            "reshard.data.ElasticSampler"
        )
    mine = {
        "size": len(sampler.dataset),  # type: ignore[arg-type]
        "seed": sampler.seed,
        "shuffle": sampler.shuffle,
        "drop_last": sampler.drop_last,
    }
    saved = {"size": progress.size, "seed": progress.seed, "shuffle": progress.shuffle, "drop_last": progress.drop_last}
    differ = [f"{name} {saved[name]!r} saved, {mine[name]!r} here" for name in mine if mine[name] != saved[name]]
    if differ:
        raise DataStateError(f"reshard.data.restore: the sampler differs from the saved one: {'; '.join(differ)}")
    assert progress.epoch is not None
    if isinstance(sampler, ElasticSampler):
        sampler.resume(progress.epoch, progress.consumed)
    elif progress.consumed.count == 0:
        sampler.set_epoch(progress.epoch)
    else:
        raise DataStateError(
            f"reshard.data.restore: torch's DistributedSampler cannot skip the {progress.consumed.count} "
            f"samples of epoch {progress.epoch} consumed before the save; use reshard.data.ElasticSampler"
        )
    return RestoredData(progress.epoch, progress.consumed.count)


def _restore_opaque(progress: DataProgress, sampler: Sampler[Any], approximate: str | None) -> RestoredData:
    """An opaque value: refused unless the caller opted into an approximation."""
    if approximate is None:
        raise DataStateError(
            f"reshard.data.restore: the saved data state is opaque ({'; '.join(progress.opaque)}): reshard cannot "
            "know which samples it consumed, so it cannot resume it on another layout; on the same layout restore "
            "the client's own state (StatefulDataLoader.load_state_dict on every rank), or pass "
            "approximate='restart_epoch' (the epoch starts over: samples repeat) or approximate='skip_count' "
            f"(an ElasticSampler skips the first {progress.consumed_samples} positions: exact only if the orders agree)"
        )
    epoch = progress.epoch if progress.epoch is not None else getattr(sampler, "epoch", None)
    if isinstance(sampler, DistributedSampler) and epoch is not None:
        generator_seed(sampler.seed, epoch, where="reshard.data.restore")
    if approximate == "restart_epoch":
        if isinstance(sampler, ElasticSampler) and epoch is not None:
            sampler.resume(epoch, Positions())
        elif isinstance(sampler, DistributedSampler) and epoch is not None:
            sampler.set_epoch(epoch)
        return RestoredData(epoch, 0, approximate)
    if not isinstance(sampler, ElasticSampler) or epoch is None or progress.consumed_samples is None:
        raise DataStateError(
            "reshard.data.restore: approximate='skip_count' needs an ElasticSampler and a saved epoch and count "
            f"(here {type(sampler).__name__}, epoch {epoch}, count {progress.consumed_samples})"
        )
    if progress.size is not None and progress.size != sampler.size:
        raise DataStateError(f"reshard.data.restore: dataset size {progress.size} saved, {sampler.size} here")
    count = progress.consumed_samples
    if count > sampler.size:
        raise DataStateError(
            f"reshard.data.restore: approximate='skip_count' with consumed_samples {count} beyond the epoch's "
            f"{sampler.size} positions: the count is not of one epoch's global order (each rank's sampler drew "
            "from the whole dataset?); use approximate='restart_epoch'"
        )
    sampler.resume(epoch, Positions.prefix(count))
    return RestoredData(epoch, count, approximate)
