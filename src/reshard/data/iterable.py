"""An iterable dataset of shards whose per-rank, per-worker positions are kept in global terms.

A :class:`ShardedIterable` is made of *shards* (files, say); each shard is a sequence of samples, and a
sample's global id is ``(shard, offset)``. Every (data rank, loader worker) pair of the current layout is one
*stream*: stream ``s = rank * num_workers + worker`` of ``S = num_replicas * num_workers``. An epoch's shard
order is ``0..n-1``, or a permutation seeded with ``seed + epoch`` (``shuffle_shards``); its *plan* assigns the
shards that have samples left, in that order, to the streams round-robin (stream ``s`` gets every ``S``-th);
a stream reads its shards one after the other, each from its cursor (the number of its samples consumed).

A stream's state (:meth:`ShardedIterable.state_dict`, torchdata's ``Stateful`` protocol, so that
``StatefulDataLoader`` snapshots it in each worker) is global: the ids of the shards it owns and their
cursors. :mod:`reshard.data.iterable_state` combines the streams of every rank into one cursor per shard, and
gives a plan for any other layout from it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from reshard.data.order import SEED_RANGE, epoch_order, generator_seed
from reshard.errors import DataStateError

__all__ = ["STREAM_FORMAT", "Plan", "ShardedIterable", "StreamState", "stream_shards"]

T = TypeVar("T")

STREAM_FORMAT = "reshard.data.ShardedIterable/stream/1"
"""The ``format`` of a stream's :meth:`ShardedIterable.state_dict`."""


@dataclass(frozen=True)
class Plan:
    """Where an epoch stands when streams are (re)assigned: a cursor per shard, and optionally the stream that
    owns each shard (``owners[i]``, -1 for none) for ``streams`` streams, kept when a restore finds the same
    number of streams, so that every stream continues with the shards it had."""

    epoch: int
    cursors: tuple[int, ...]
    owners: tuple[int, ...] | None = None
    streams: int = 0


def stream_shards(plan: Plan, lengths: Sequence[int], order: Sequence[int], stream: int, streams: int) -> list[int]:
    """The shards stream ``stream`` of ``streams`` reads under ``plan``, in reading order: the shards with
    samples left, in the epoch's order, every ``streams``-th from the ``stream``-th; or, when the plan records
    the owners of the same number of streams, the shards it owned (with samples left), in the epoch's order."""
    left = [i for i in order if plan.cursors[i] < lengths[i]]
    if plan.owners is not None and plan.streams == streams:
        return [i for i in left if plan.owners[i] == stream]
    return left[stream::streams]


@dataclass(frozen=True)
class StreamState:
    """One stream's position: stream ``stream`` of ``streams`` in ``epoch`` reads ``shards`` in this order,
    shard ``shards[k]`` from sample ``cursors[k]``."""

    epoch: int
    stream: int
    streams: int
    shards: tuple[int, ...]
    cursors: tuple[int, ...]

    def to_json(self, *, seed: int, digest: str) -> dict[str, Any]:
        return {
            "format": STREAM_FORMAT,
            "epoch": self.epoch,
            "seed": seed,
            "digest": digest,
            "stream": self.stream,
            "streams": self.streams,
            "shards": list(self.shards),
            "cursors": list(self.cursors),
        }


def _int(what: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise DataStateError(f"{what} is {value!r} ({type(value).__name__}), not an int")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise DataStateError(f"{what} is {value}, outside {bound}")
    return value


def _int_list(what: str, value: object) -> list[object]:
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.int64 or value.dim() != 1:
            raise DataStateError(f"{what} is a {value.dtype} tensor of shape {tuple(value.shape)}, not 1-d int64")
        return [int(v) for v in value.tolist()]
    if not isinstance(value, list | tuple):
        raise DataStateError(f"{what} is {type(value).__name__}, not a list of ints")
    return list(value)


def parse_stream(state: object, *, lengths: Sequence[int], seed: int, digest: str, name: str) -> StreamState:
    """A stream's :meth:`ShardedIterable.state_dict` checked against the dataset (``name`` says whose state it
    is): its format, seed and shard list fingerprint, every shard id in range and owned once, every cursor
    within its shard. :class:`DataStateError` naming what is wrong."""
    if not isinstance(state, dict) or state.get("format") != STREAM_FORMAT:
        shown = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise DataStateError(
            f"{name}: not the state of a reshard.data.ShardedIterable stream (format {shown!r}); reshard cannot "
            "interpret it, so it cannot carry it to another layout"
        )
    if state.get("digest") != digest:
        raise DataStateError(
            f"{name}: saved for another shard list (fingerprint {str(state.get('digest'))[:12]}, this dataset's "
            f"is {digest[:12]}: {len(lengths)} shards of {sum(lengths)} samples)"
        )
    if state.get("seed") != seed:
        raise DataStateError(f"{name}: saved with seed {state.get('seed')!r}, this dataset has seed {seed}")
    streams = _int(f"{name}: streams", state.get("streams"), 1)
    stream = _int(f"{name}: stream", state.get("stream"), 0, streams - 1)
    epoch = _int(f"{name}: epoch", state.get("epoch"), 0)
    generator_seed(seed, epoch, where=name)
    shards = [_int(f"{name}: shard id", s, 0, len(lengths) - 1) for s in _int_list(f"{name}: shards", state["shards"])]
    raw = _int_list(f"{name}: cursors", state.get("cursors"))
    if len(raw) != len(shards):
        raise DataStateError(f"{name}: {len(shards)} shards but {len(raw)} cursors")
    if len(set(shards)) != len(shards):
        raise DataStateError(f"{name}: a shard is listed twice in {shards}")
    cursors = [_int(f"{name}: cursor of shard {s}", c, 0, lengths[s]) for s, c in zip(shards, raw, strict=True)]
    return StreamState(epoch, stream, streams, tuple(shards), tuple(cursors))


def fingerprint(lengths: Sequence[int], names: Sequence[str] | None) -> str:
    """The SHA-256 of the shard list (the number of shards, their lengths and names): a resume against
    another dataset is refused."""
    doc = json.dumps({"lengths": list(lengths), "names": list(names) if names is not None else None})
    return hashlib.sha256(doc.encode()).hexdigest()


class _SequenceShards(Generic[T]):
    """Opens shard ``i`` of a list of sequences at an offset (a class, not a lambda, so that the dataset
    pickles into spawned loader workers)."""

    def __init__(self, shards: list[Sequence[T]]) -> None:
        self.shards = shards

    def __call__(self, shard: int, start: int) -> Iterator[T]:
        data = self.shards[shard]
        return (data[i] for i in range(start, len(data)))


class ShardedIterable(IterableDataset[T], Generic[T]):
    """An iterable dataset of shards whose position survives a change of data-parallel size or worker count.

    Args:
        shards: a sequence of shards, each an indexable sequence of samples; or a callable
            ``open_shard(shard, start)`` that yields the samples of shard ``shard`` from offset ``start``
            (then ``lengths`` is required).
        lengths: the number of samples of each shard (required with a callable; taken from ``len`` otherwise).
        names: optional shard names (file names), part of the fingerprint a resume is checked against.
        rank, num_replicas: this process's data-parallel rank and their number; by default those of the
            default ``torch.distributed`` group (0 of 1 without one).
        seed: the seed of the shard order (with ``shuffle_shards``).
        shuffle_shards: read the shards of epoch ``e`` in an order drawn with ``seed + e``.
        with_ids: yield ``{"shard": s, "offset": o, "sample": x}`` instead of ``x``.

    Each stream (rank, worker of ``torch.utils.data.get_worker_info()``) reads its own shards; the epoch
    changes only with :meth:`set_epoch`, as with ``DistributedSampler`` (a pass over a consumed stream yields
    nothing).
    """

    def __init__(
        self,
        shards: Sequence[Sequence[T]] | Callable[[int, int], Iterable[T]],
        *,
        lengths: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        rank: int | None = None,
        num_replicas: int | None = None,
        seed: int = 0,
        shuffle_shards: bool = False,
        with_ids: bool = False,
    ) -> None:
        super().__init__()
        if callable(shards):
            if lengths is None:
                raise DataStateError("ShardedIterable: a callable shard opener needs lengths=[samples per shard]")
            self._open: Callable[[int, int], Iterable[T]] = shards
        else:
            data = list(shards)
            if lengths is None:
                lengths = [len(s) for s in data]
            self._open = _SequenceShards(data)
        self.lengths = tuple(_int(f"ShardedIterable: length of shard {i}", n, 0) for i, n in enumerate(lengths))
        if names is not None and len(names) != len(self.lengths):
            raise DataStateError(f"ShardedIterable: {len(names)} names for {len(self.lengths)} shards")
        if (rank is None) != (num_replicas is None):
            raise DataStateError("ShardedIterable: give both rank and num_replicas, or neither")
        if num_replicas is not None and rank is not None:
            _int("ShardedIterable: num_replicas", num_replicas, 1)
            _int("ShardedIterable: rank", rank, 0, num_replicas - 1)
        self.names = tuple(names) if names is not None else None
        self.rank, self.num_replicas = rank, num_replicas
        self.seed = _int("ShardedIterable: seed", seed, 0, SEED_RANGE[1])
        self.shuffle_shards = bool(shuffle_shards)
        self.with_ids = bool(with_ids)
        self.digest = fingerprint(self.lengths, self.names)
        self.plan = Plan(0, (0,) * len(self.lengths))
        self._stream: StreamState | None = None
        self._cursors: list[int] = []

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` with every shard unread; no-op when it is the current epoch (so that a loop
        that calls it at the top of every epoch does not undo a restore in the middle of one)."""
        generator_seed(self.seed, _int("ShardedIterable.set_epoch: epoch", epoch, 0), where="ShardedIterable.set_epoch")
        if epoch != self.plan.epoch:
            self.set_plan(Plan(epoch, (0,) * len(self.lengths)))

    def set_plan(self, plan: Plan) -> None:
        """Replace where the epoch stands (what :func:`reshard.data.restore_iterable` does); every stream then
        computes its own shards from it."""
        self.plan = plan
        self._stream = None

    def layout(self) -> tuple[int, int, int, int]:
        """``(rank, num_replicas, worker, num_workers)`` of this copy of the dataset, now."""
        if self.rank is not None and self.num_replicas is not None:
            rank, replicas = self.rank, self.num_replicas
        elif dist.is_available() and dist.is_initialized():
            rank, replicas = dist.get_rank(), dist.get_world_size()
        else:
            rank, replicas = 0, 1
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return rank, replicas, worker, workers

    def stream_state(self) -> StreamState:
        """This stream's position, computed from the plan at the first call after a plan change."""
        rank, replicas, worker, workers = self.layout()
        stream, streams = rank * workers + worker, replicas * workers
        if self._stream is None:
            order = epoch_order(
                len(self.lengths), seed=self.seed, epoch=self.plan.epoch, shuffle=self.shuffle_shards
            ).tolist()
            shards = stream_shards(self.plan, self.lengths, order, stream, streams)
            self._stream = StreamState(self.plan.epoch, stream, streams, tuple(shards), ())
            self._cursors = [self.plan.cursors[i] for i in shards]
        elif (self._stream.stream, self._stream.streams) != (stream, streams):
            raise DataStateError(
                f"ShardedIterable: the state of stream {self._stream.stream} of {self._stream.streams} was loaded "
                f"into stream {stream} of {streams} (rank {rank} of {replicas}, worker {worker} of {workers}); a "
                "change of layout goes through reshard.data.capture_iterable / restore_iterable"
            )
        s = self._stream
        return StreamState(s.epoch, s.stream, s.streams, s.shards, tuple(self._cursors))

    def state_dict(self) -> dict[str, Any]:
        """This stream's position in global terms (torchdata's ``Stateful``): the shards it owns and their
        cursors, with the epoch, seed and the shard list's fingerprint."""
        return self.stream_state().to_json(seed=self.seed, digest=self.digest)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue a stream from its :meth:`state_dict` (the same layout; torchdata's same-layout resume)."""
        stream = parse_stream(
            state_dict, lengths=self.lengths, seed=self.seed, digest=self.digest, name="ShardedIterable"
        )
        self.plan = Plan(stream.epoch, (0,) * len(self.lengths))
        self._stream = StreamState(stream.epoch, stream.stream, stream.streams, stream.shards, ())
        self._cursors = list(stream.cursors)

    def remaining(self) -> int:
        """Samples this stream has left in the epoch (what a DDP job compares across ranks for even ends)."""
        state = self.stream_state()
        return sum(self.lengths[s] - c for s, c in zip(state.shards, state.cursors, strict=True))

    def __iter__(self) -> Iterator[Any]:
        state = self.stream_state()
        return self._samples(state.shards, self._cursors)

    def _samples(self, shards: tuple[int, ...], cursors: list[int]) -> Iterator[Any]:
        """The stream's samples from its cursors; the cursor of a shard moves as each sample is yielded, so a
        state taken between two samples holds exactly those handed out (``cursors`` is this stream's own list:
        a plan change gives the dataset a new one, and an old iterator no longer moves it)."""
        for k, shard in enumerate(shards):
            start = cursors[k]
            if start >= self.lengths[shard]:
                continue
            for offset, sample in enumerate(self._open(shard, start), start):
                if offset >= self.lengths[shard]:
                    break
                cursors[k] = offset + 1
                yield {"shard": shard, "offset": offset, "sample": sample} if self.with_ids else sample
