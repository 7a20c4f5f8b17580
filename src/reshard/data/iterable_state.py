"""Capture and restore of :class:`~reshard.data.iterable.ShardedIterable` positions across layouts.

:func:`capture_iterable` (collective) takes every rank's position, in global terms, and combines them into one
layout-independent value: a cursor per shard (the samples of that shard *consumed*, that is yielded by the
data loader to the training loop before its state was taken; prefetched samples do not count), the stream
that owned each shard, and the epoch, seed and fingerprint of the shard list. It is stored as one single-cell
:class:`~reshard.ShardedObject` that a load at any layout asks for. :func:`restore_iterable` (local) turns the
value into the dataset's plan for the layout it finds.

The pieces are pure and separate: :func:`local_part` (one rank's streams), :func:`combine` (the coordinator's
agreement checks and the global value) and :func:`apply` (the value checked against a dataset, as a plan).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader

from reshard.data.capture_step import agreed_capture
from reshard.data.iterable import Plan, ShardedIterable, StreamState, parse_stream
from reshard.data.order import generator_seed
from reshard.errors import DataStateError
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.state.sharding import ShardedObject

__all__ = ["KIND", "apply", "capture_iterable", "combine", "local_part", "restore_iterable"]

KIND = "reshard.data.iterable/1"
"""The ``kind`` of the value :func:`capture_iterable` stores."""

_AGREED = ("epoch", "seed", "shuffle_shards", "digest", "num_shards", "num_replicas", "num_workers")


def dataset_of(obj: object) -> tuple[ShardedIterable[Any], DataLoader[Any] | None]:
    """The :class:`ShardedIterable` of ``obj`` (itself, or a data loader's dataset) and the loader, if any;
    :class:`DataStateError` naming what reshard cannot interpret."""
    if isinstance(obj, ShardedIterable):
        return obj, None
    if isinstance(obj, DataLoader):
        if isinstance(obj.dataset, ShardedIterable):
            return obj.dataset, obj
        raise DataStateError(
            f"the dataset of the {type(obj).__name__} is a {type(obj.dataset).__name__}, not a "
            "reshard.data.ShardedIterable: reshard cannot know which samples its state stands for, so it cannot "
            "carry it to another layout"
        )
    raise DataStateError(
        f"a {type(obj).__name__} is neither a reshard.data.ShardedIterable nor a data loader over one: reshard "
        "cannot interpret its position"
    )


@dataclass(frozen=True)
class _Batching:
    """How a loader turns stream samples into the steps it yields."""

    num_workers: int
    batch_size: int | None
    drop_last: bool


def _advance(streams: list[StreamState], lengths: tuple[int, ...], *, start: int, steps: int, how: _Batching) -> None:
    """Move the workers' cursors (in place, ``streams[w].cursors`` being lists here) over the ``steps`` batches
    the loader yielded after its snapshot: in torchdata's order, round-robin over the workers from ``start``,
    skipping a worker whose stream has ended; a batch takes ``batch_size`` samples (fewer at a stream's end,
    or none with ``drop_last``, where the stream's short tail is dropped, as the loader drops it)."""
    size = how.batch_size or 1
    cursors = [list(s.cursors) for s in streams]

    def left(w: int) -> int:
        return sum(lengths[s] - c for s, c in zip(streams[w].shards, cursors[w], strict=True))

    def take(w: int, count: int) -> None:
        for k, shard in enumerate(streams[w].shards):
            moved = min(count, lengths[shard] - cursors[w][k])
            cursors[w][k] += moved
            count -= moved

    ended = [False] * len(streams)
    worker = start
    for step in range(steps):
        for _ in range(len(streams)):
            remaining = left(worker)
            if not ended[worker] and remaining and not (how.drop_last and how.batch_size and remaining < size):
                break
            if not ended[worker]:
                take(worker, remaining)  # the short tail the loader drops, or nothing
                ended[worker] = True
            worker = (worker + 1) % len(streams)
        else:
            raise DataStateError(
                f"the data loader's state says {steps} batches were yielded since its last snapshot, but its "
                f"workers' streams end after {step}: the state does not belong to this dataset"
            )
        take(worker, min(size, left(worker)))
        worker = (worker + 1) % len(streams)
    for w, stream in enumerate(streams):
        streams[w] = StreamState(stream.epoch, stream.stream, stream.streams, stream.shards, tuple(cursors[w]))


def _dict(what: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataStateError(f"{what} is a {type(value).__name__}, not a dict (not a torchdata 0.11 state?)")
    return value


def _parse(state: object, dataset: ShardedIterable[Any], name: str) -> StreamState:
    return parse_stream(state, lengths=dataset.lengths, seed=dataset.seed, digest=dataset.digest, name=name)


def loader_streams(state: object, dataset: ShardedIterable[Any], how: _Batching) -> list[StreamState]:
    """The streams of one rank from its ``StatefulDataLoader.state_dict()`` (torchdata 0.11), at the samples
    yielded to the training loop: without workers, the dataset's state; with workers, each worker's dataset
    state in the last snapshot, moved on by the batches yielded since (which a same-layout torchdata resume
    replays)."""
    state = _dict("the data loader's state", state)
    if how.num_workers == 0:
        return [_parse(state.get("dataset_state"), dataset, "the data loader's dataset state")]
    snapshot = _dict("the data loader's _snapshot", state.get("_snapshot"))
    workers = _dict("the data loader's _worker_snapshots", snapshot.get("_worker_snapshots"))
    streams = []
    for w in range(how.num_workers):
        worker = _dict(f"the state of worker {w}", workers.get(f"worker_{w}"))
        streams.append(_parse(worker.get("dataset_state"), dataset, f"the dataset state of worker {w}"))
    steps, last = state.get("_steps_since_snapshot"), snapshot.get("_last_yielded_worker_id")
    if not isinstance(steps, int) or not isinstance(last, int) or steps < 0 or not 0 <= last < how.num_workers:
        raise DataStateError(f"the data loader's state has steps {steps!r} and last worker {last!r}")
    _advance(streams, dataset.lengths, start=(last + 1) % how.num_workers, steps=steps, how=how)
    return streams


def local_part(obj: object) -> dict[str, Any]:
    """This rank's part of a capture (JSON): the streams of its dataset or data loader, at what was yielded."""
    dataset, loader = dataset_of(obj)
    how = _Batching(0, None, False)
    if loader is None:
        streams = [dataset.stream_state()]
    else:
        state_dict = getattr(loader, "state_dict", None)
        if not callable(state_dict):
            raise DataStateError(
                f"a {type(loader).__name__} has no state_dict(): its position is not known; use torchdata's "
                "StatefulDataLoader (or iterate the ShardedIterable itself)"
            )
        if getattr(loader, "in_order", True) is False:
            raise DataStateError("a data loader with in_order=False yields in no fixed order: its position is unknown")
        how = _Batching(loader.num_workers, loader.batch_size, loader.drop_last)
        streams = loader_streams(state_dict(), dataset, how)
    epochs = {s.epoch for s in streams}
    if len(epochs) != 1:
        raise DataStateError(f"the streams of this rank are in different epochs {sorted(epochs)}")
    counts = {s.streams for s in streams}
    return {
        "kind": KIND,
        "epoch": epochs.pop(),
        "seed": dataset.seed,
        "shuffle_shards": dataset.shuffle_shards,
        "digest": dataset.digest,
        "num_shards": len(dataset.lengths),
        "num_workers": max(how.num_workers, 1),
        "num_replicas": counts.pop() // max(how.num_workers, 1) if len(counts) == 1 else -1,
        "streams": [
            {"stream": s.stream, "streams": s.streams, "shards": s.shards, "cursors": s.cursors} for s in streams
        ],
    }


def combine(values: list[dict[str, Any]], lengths: tuple[int, ...]) -> dict[str, Any]:
    """The global value from every rank's :func:`local_part` (in rank order): checks that they agree (epoch,
    seed, shard list, layout; replicas of a data rank hold the same streams; every stream present, every shard
    owned once) and gives each shard's cursor (a shard no stream owns was consumed before the streams' plan)
    and owner. :class:`DataStateError` naming what disagrees."""
    first = values[0]
    for rank, value in enumerate(values):
        for field in _AGREED:
            if value.get(field) != first.get(field):
                raise DataStateError(
                    f"capture_iterable: rank {rank} has {field} {value.get(field)!r}, rank 0 has {first.get(field)!r}"
                )
    total = first["num_replicas"] * first["num_workers"]
    seen: dict[int, tuple[int, dict[str, Any]]] = {}
    for rank, value in enumerate(values):
        for stream in value["streams"]:
            if stream["streams"] != total:
                raise DataStateError(f"capture_iterable: rank {rank} has a stream of {stream['streams']}, not {total}")
            if stream["stream"] in seen and seen[stream["stream"]][1] != stream:
                raise DataStateError(
                    f"capture_iterable: ranks {seen[stream['stream']][0]} and {rank} are replicas of one data rank "
                    f"but disagree on the position of stream {stream['stream']}"
                )
            seen[stream["stream"]] = (rank, stream)
    missing = sorted(set(range(total)) - set(seen))
    if missing:
        raise DataStateError(f"capture_iterable: no rank holds streams {missing} of {total} (a data rank is missing)")
    cursors, owners = list(lengths), [-1] * len(lengths)
    for index, (_, stream) in sorted(seen.items()):
        for shard, cursor in zip(stream["shards"], stream["cursors"], strict=True):
            if owners[shard] != -1:
                raise DataStateError(f"capture_iterable: shard {shard} is read by streams {owners[shard]} and {index}")
            owners[shard], cursors[shard] = index, cursor
    fields = {f: first[f] for f in _AGREED}
    return {"kind": KIND, **fields, "streams": total, "cursors": cursors, "owners": owners}


def capture_iterable(
    loader_or_dataset: object,
    *,
    key: str = "data",
    group: Group = None,
    timeout: datetime.timedelta | float | None = None,
) -> ShardedObject:
    """The position of every rank's :class:`ShardedIterable` (or torchdata ``StatefulDataLoader`` over one) as
    one layout-independent :class:`~reshard.ShardedObject` to put in the state dict of a save. Collective:
    every rank of ``group`` calls it (replicas of a data rank too: they must agree); every rank raises the same
    :class:`DataStateError` when the parts disagree or cannot be interpreted. It is the step of
    :func:`reshard.data.capture` too: a rank that captures a sampler meanwhile, another ``key`` or a ``key``
    that is no non-empty str fail every rank alike."""
    return iterable_capture(loader_or_dataset, key=key, group=group, timeout=timeout, consumed=None)


def iterable_capture(
    loader_or_dataset: object,
    *,
    key: str,
    group: Group,
    timeout: datetime.timedelta | float | None,
    consumed: int | None,
) -> ShardedObject:
    """:func:`capture_iterable`, with the ``consumed`` that :func:`reshard.data.capture` was given: refused
    (streams count themselves) inside the rank's part, so that every rank raises it. Collective."""
    communicator = Communicator(group, timeout=timeout)

    def local() -> dict[str, Any]:
        if consumed is not None:
            raise DataStateError("reshard.data.capture: consumed= does not apply to an iterable dataset")
        return local_part(loader_or_dataset)

    def combined(values: list[dict[str, Any]]) -> dict[str, Any]:
        # the coordinator's own shard lengths (its local part succeeded, and every digest agrees)
        return combine(values, dataset_of(loader_or_dataset)[0].lengths)

    value = agreed_capture(communicator, kind="iterable", key=key, local=local, combine=combined)
    stored = dict(value)
    stored["cursors"] = torch.tensor(value["cursors"], dtype=torch.int64)
    stored["owners"] = torch.tensor(value["owners"], dtype=torch.int64)
    return ShardedObject(key, stored, (1,), (0,), replica_id=communicator.rank)


def _ints(what: str, value: object, count: int) -> list[int]:
    """A stored per-shard column: a 1-d int64 tensor of ``count`` entries (what :func:`capture_iterable`
    stores), as a list."""
    if not isinstance(value, torch.Tensor):
        raise DataStateError(f"{what} is a {type(value).__name__}, not a 1-d int64 tensor")
    if value.dtype != torch.int64 or value.dim() != 1:
        raise DataStateError(f"{what} is a {value.dtype} tensor of shape {tuple(value.shape)}, not 1-d int64")
    if value.device.type != "cpu":
        raise DataStateError(f"{what} is a tensor on {value.device}, not the CPU (as a load returns it)")
    if value.numel() != count:
        raise DataStateError(f"{what} has {value.numel()} entries for {count} shards")
    return [int(v) for v in value.tolist()]


def _count(what: str, number: object, low: int) -> int:
    if isinstance(number, bool) or not isinstance(number, int) or number < low:
        raise DataStateError(f"restore_iterable: {what} is {number!r}")
    return number


def _layout(value: dict[str, Any], dataset: ShardedIterable[Any]) -> tuple[int, int]:
    """(epoch, streams) of a value, checked against its own metadata: the epoch one the shard order's
    generator takes, ``num_replicas x num_workers`` streams, ``num_shards`` the dataset's."""
    epoch = _count("epoch", value.get("epoch"), 0)
    generator_seed(dataset.seed, epoch, where="restore_iterable")
    streams = _count("streams", value.get("streams"), 1)
    replicas = _count("num_replicas", value.get("num_replicas"), 1)
    workers = _count("num_workers", value.get("num_workers"), 1)
    if replicas * workers != streams:
        raise DataStateError(
            f"restore_iterable: the value's {replicas} replicas of {workers} workers are not its {streams} streams"
        )
    shards = value.get("num_shards")
    if shards != len(dataset.lengths) or isinstance(shards, bool):
        raise DataStateError(f"restore_iterable: num_shards is {shards!r} for the {len(dataset.lengths)} shards")
    return epoch, streams


def apply(value: object, dataset: ShardedIterable[Any]) -> Plan:
    """The plan of ``dataset`` from a captured value, checked: the same shard list (fingerprint), seed and
    shard shuffling; a consistent layout (:func:`_layout`); cursors within each shard; owners streams of the
    value, or -1 (no stream: the shard was consumed before the streams' plan) only for a consumed shard, so
    that no shard with samples left goes unread. Local."""
    if isinstance(value, ShardedObject):
        value = value.value
    if not isinstance(value, dict) or value.get("kind") != KIND:
        kind = value.get("kind") if isinstance(value, dict) else type(value).__name__
        raise DataStateError(f"restore_iterable: the value is not a captured ShardedIterable position ({kind!r})")
    if value.get("digest") != dataset.digest:
        raise DataStateError(
            f"restore_iterable: the position was captured for another shard list ({value.get('num_shards')!r} "
            f"shards, fingerprint {str(value.get('digest'))[:12]}); this dataset has {len(dataset.lengths)} "
            f"shards of {sum(dataset.lengths)} samples (fingerprint {dataset.digest[:12]})"
        )
    for field, own in (("seed", dataset.seed), ("shuffle_shards", dataset.shuffle_shards)):
        if type(value.get(field)) is not type(own) or value.get(field) != own:  # 0 is not False
            raise DataStateError(
                f"restore_iterable: captured with {field} {value.get(field)!r}, the dataset has {own!r}"
            )
    epoch, streams = _layout(value, dataset)
    cursors = _ints("restore_iterable: cursors", value.get("cursors"), len(dataset.lengths))
    owners = _ints("restore_iterable: owners", value.get("owners"), len(dataset.lengths))
    for shard, (cursor, owner) in enumerate(zip(cursors, owners, strict=True)):
        if not 0 <= cursor <= dataset.lengths[shard]:
            raise DataStateError(
                f"restore_iterable: the cursor of shard {shard} is {cursor}, outside [0, {dataset.lengths[shard]}]"
            )
        if not -1 <= owner < streams:
            raise DataStateError(f"restore_iterable: shard {shard} is owned by stream {owner} of {streams}")
        if owner == -1 and cursor < dataset.lengths[shard]:
            raise DataStateError(
                f"restore_iterable: shard {shard} has {dataset.lengths[shard] - cursor} samples left but no stream "
                "owns it (owner -1 is for a consumed shard): the value is inconsistent"
            )
    return Plan(epoch, tuple(cursors), tuple(owners), streams)


def restore_iterable(value: object, loader_or_dataset: object) -> Plan:
    """Set the dataset's position from a captured value (a loaded :class:`~reshard.ShardedObject` or its
    value), for whatever layout this run has, and return it (the epoch and every shard's cursor). Local: no
    collective. A loader's own pending state is dropped, so its next iterator (and its workers) start from
    this position."""
    dataset, loader = dataset_of(loader_or_dataset)
    plan = apply(value, dataset)
    dataset.set_plan(plan)
    load = getattr(loader, "load_state_dict", None)
    if loader is not None and callable(load):
        load({})
        if getattr(loader, "next_iter_state", None) is not None:
            loader.next_iter_state = None  # torchdata keeps a pending state across an empty load_state_dict
    return plan
