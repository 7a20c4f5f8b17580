"""The phases of :func:`reshard.load`, each a top-level function from frozen values to a frozen value.

The flow (:func:`reshard.flows.load.load`) runs them in a fixed order, every rank of the group alike:

1. :func:`read_metadata_once` (collective: one agreed step and the broadcast of its result): the coordinator
   reads and validates the metadata, the ranks' arguments are agreed on, the others decode its bytes;
2. :func:`match_template` (local): the template's pieces, keys and objects that the checkpoint holds, and
   the missing entries (``strict=False``); the caller's state dict is only read;
3. :func:`reshard.flows.load_planning.plan_reads` (collective: one step, two after a miss of a plan cache): the
   coordinator checks for unused source entries and, when the load reads once, schedules who reads what
   (:mod:`reshard.planning.exchange`), or reuses a schedule; each rank plans its reads
   (:func:`reshard.planning.load_plan.plan_load`) into a :class:`ReadPlan`;
4. :func:`stage` (collective, optional): node-local staging of the files the reads need;
5. :func:`read` (collective: one step): each rank reads, verifies and copies its bytes into place;
6. :func:`exchange` (collective: one step, a no-op without a read-once schedule): the bytes several ranks
   need travel from their reader to the others;
7. :func:`verify` (collective: one step, optional): the end-to-end fingerprints;
8. :func:`map_back` (local): the result state dict.

A local failure is carried to the next collective step as an :class:`Outcome`, so that every rank raises
the same agreed error instead of leaving its peers waiting. The tensors of the template are filled in place
(that is what a load does); nothing else of the caller's is changed.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from reshard.errors import CheckpointError, CorruptCheckpointError
from reshard.flows.options import LoadOptions, check_terms, load_terms
from reshard.flows.plan_cache import ReadPlanCache
from reshard.flows.stats import PhaseClock
from reshard.geometry.boxes import Box
from reshard.io.exchange import ExchangeCounters, run_exchange
from reshard.io.reader import ReadExecutor
from reshard.io.sources import CheckpointSource
from reshard.io.staging import StagedFiles, node_id, stage_files
from reshard.metadata import Metadata, SavedObject
from reshard.net.comm import Communicator
from reshard.planning.exchange import RankSchedule
from reshard.planning.load_plan import LoadPlan, check_template
from reshard.planning.objects import ObjectMatch
from reshard.state.codec import decode_object_blob
from reshard.state.dtypes import dtype_name
from reshard.state.fingerprint import fingerprint
from reshard.state.scaled import ScaledTensor
from reshard.state.sharding import LocalPiece, ShardedObject, ShardedTensor
from reshard.state.statedict import flatten_state_dict, is_empty_container, map_leaves

__all__ = [
    "Agreed",
    "Exchanged",
    "LoadContext",
    "Matched",
    "Outcome",
    "ReadDone",
    "ReadPlan",
    "Staged",
    "attempt",
    "exchange",
    "map_back",
    "match_template",
    "read",
    "read_metadata_once",
    "stage",
    "unstage",
    "verify",
]

T = TypeVar("T")
ObjectCell = tuple[str, tuple[int, ...]]
"""A ShardedObject cell: its key and global offset."""


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """The value of a local phase, or the exception it raised, carried to the next collective step."""

    value: T | None = None
    error: Exception | None = None

    def get(self) -> T:
        """The value; the phase's exception raised again if it failed."""
        if self.error is not None:
            raise self.error
        return self.value  # type: ignore[return-value]

    def check(self) -> None:
        """Raise the phase's exception, if any (a collective step's local part)."""
        self.get()


def attempt(fn: Callable[..., T], *args: Any, **kwargs: Any) -> Outcome[T]:
    """``fn(*args, **kwargs)`` as an :class:`Outcome` (an ``Exception`` is kept, not raised)."""
    try:
        return Outcome(fn(*args, **kwargs))
    except Exception as exc:  # raised again inside the next collective step, on this rank
        return Outcome(error=exc)


@dataclass(frozen=True)
class LoadContext:
    """What every phase of one load on one rank may use: the open source, the group, the arguments, the
    clock that times the phases (an instrument: no phase reads it), and the cache of read-once schedules the
    caller keeps (a :class:`~reshard.CheckpointManager`'s; None: none)."""

    source: CheckpointSource
    comm: Communicator
    options: LoadOptions
    strict: bool
    clock: PhaseClock
    plans: ReadPlanCache | None = None


@dataclass(frozen=True)
class Agreed:
    """The outcome of :func:`read_metadata_once`, the same on every rank: the metadata, whether the load
    reads once per replica group and why (``LoadStats.read_once_reason``), and the smallest memory budget
    of the group (for the exchange)."""

    metadata: Metadata
    read_once: bool
    budget: int
    read_once_reason: str = ""


def _read_once_wanted(ctx: LoadContext) -> tuple[bool, str]:
    """Whether this rank wants to read once, and why: on request; never alone or with node-local staging
    (which downloads each file once per node); by default where its storage is shared by many nodes (object
    stores, shared file systems: :meth:`~reshard.storage.Storage.sharing`)."""
    options = ctx.options
    if ctx.comm.size == 1:
        return False, "one rank"
    if options.staging is not None:
        return False, "staging downloads each file once per node"
    if options.read_once is not None:
        return bool(options.read_once), f"LoadOptions(read_once={bool(options.read_once)})"
    sharing = ctx.source.storage.sharing()
    return sharing.shared, sharing.reason


def _arguments(ctx: LoadContext) -> dict[str, Any]:
    """What this rank sends the coordinator in its first step: the arguments every rank must pass alike
    (:func:`~reshard.flows.options.load_terms`), whether it wants to read once and why, and its budget."""
    options = ctx.options
    node = node_id(options.staging.node_group) if options.staging is not None else ""
    kind = type(ctx.source).__name__ + (" refusing unused entries" if ctx.source.refuses_unused else "")
    wanted, reason = _read_once_wanted(ctx)
    terms = load_terms(options, strict=ctx.strict, source=kind, node=node, plan_cache=ctx.plans is not None)
    return {"terms": terms, "read_once": wanted, "reason": reason, "budget": options.memory_budget_bytes}


def _agreed_arguments(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """On the coordinator: the arguments agree; read once where any rank wants it, with the reason of the
    first rank that wants the mode agreed on (the coordinator's when it is off), and exchange within the
    smallest budget of the group."""
    check_terms([d["terms"] for d in docs], "reshard.load")
    read_once = any(d["read_once"] for d in docs)
    rank = next(r for r, d in enumerate(docs) if d["read_once"] == read_once)
    reason = docs[rank]["reason"] + (f" (on rank {rank})" if rank else "")
    return {"read_once": read_once, "reason": reason, "budget": min(d["budget"] for d in docs)}


def _returning(outcome: Outcome[Any], value: Outcome[T]) -> T:
    """A step's local part: ``value`` once ``outcome`` succeeded (and ``value`` itself)."""
    outcome.check()
    return value.get()


def read_metadata_once(ctx: LoadContext) -> Agreed:
    """Phase 1, called by every rank: only the coordinator reads the metadata (``metadata.json``, or the
    safetensors headers); one agreed step checks that the ranks' arguments agree, then the coordinator
    broadcasts the bytes it validated and the others decode them."""
    comm, clock = ctx.comm, ctx.clock
    with clock.exchange():
        with clock.phase("metadata"):
            read = attempt(ctx.source.read_metadata) if comm.is_coordinator else Outcome((b"", None))
        arguments = attempt(_arguments, ctx)  # a storage's override it cannot read fails the step on every rank
        agreed = comm.step("reading metadata", functools.partial(_returning, read, arguments), _agreed_arguments)
        raw, mine = read.get()
        raw = comm.broadcast_bytes(raw if comm.is_coordinator else None)
    with clock.phase("metadata"):
        metadata = mine if mine is not None else ctx.source.decode_metadata(raw)
    return Agreed(metadata, bool(agreed["read_once"]), int(agreed["budget"]), str(agreed["reason"]))


@dataclass(frozen=True)
class Matched:
    """This rank's template against the checkpoint: the tensors, their pieces (and each piece's key) and
    the objects to read, the entries the checkpoint does not hold (``strict=False``), and what the
    ``object_grid`` policy decided for objects whose grid changed (:class:`~reshard.planning.objects.ObjectMatch`:
    the cells kept as the template's, the saved cells no rank loads, one line per changed grid)."""

    tensors: tuple[ShardedTensor, ...]
    objects: tuple[ShardedObject, ...]
    pieces: tuple[LocalPiece, ...]
    keys: tuple[str, ...]
    missing: tuple[str, ...]
    regridded: ObjectMatch = field(default_factory=ObjectMatch)
    grids: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Each per-rank object of the template and its grid, whatever the policy loads of it."""


def match_template(state_dict: Any, metadata: Metadata, *, rank: int, strict: bool, options: LoadOptions) -> Matched:
    """Phase 2, local: flatten the template and check it against the metadata (shapes, dtypes, casts,
    missing entries, object grids under ``LoadOptions(object_grid=...)``:
    :func:`~reshard.planning.load_plan.check_template`). ``state_dict`` is not changed."""
    template = flatten_state_dict(state_dict, rank=rank, dedup=False)
    grids = tuple(sorted({(obj.key, tuple(obj.global_shape)) for obj in template.objects}))
    missing, objects = check_template(
        template,
        metadata,
        strict=strict,
        allow_dtype_cast=options.allow_dtype_cast,
        allow_lossy_cast=options.allow_lossy_cast,
        object_grid=options.object_grid,
    )
    pairs = [(tensor.key, piece) for tensor in template.tensors for piece in tensor.pieces()]
    return Matched(
        tensors=tuple(template.tensors),
        objects=tuple(template.objects),
        pieces=tuple(piece for _, piece in pairs),
        keys=tuple(key for key, _ in pairs),
        missing=tuple(missing),
        regridded=ObjectMatch(kept=objects.kept, ignored=objects.ignored, changed=objects.changed),
        grids=grids,
    )


@dataclass(frozen=True)
class ReadPlan:
    """This rank's reads: the plan, the views its boxes land in, and the read-once schedule (None: each
    rank reads its own pieces, and there is nothing to exchange)."""

    plan: LoadPlan
    views: tuple[torch.Tensor, ...]
    boxes: tuple[Box, ...]
    schedule: RankSchedule | None
    on_device: bool
    metadata: Metadata
    """The metadata planned with: the agreed one, with the boxes of this rank's keys read from their parts
    (partitioned metadata, :meth:`~reshard.io.sources.CheckpointSource.complete_metadata`)."""
    reused: bool = False
    """Whether the read-once schedule came from a plan cache (the needs were not gathered); the same on every rank."""


@dataclass(frozen=True)
class Staged:
    """The files of node-local staging (None: the load reads the checkpoint itself)."""

    files: StagedFiles | None


def stage(ctx: LoadContext, metadata: Metadata, matched: Matched, planned: ReadPlan) -> Staged:
    """Phase 4, collective where ``LoadOptions(staging=...)`` is set (every rank calls it): the files this
    node's reads need, each downloaded by one rank of the node (:func:`~reshard.io.staging.stage_files`)."""
    staging = ctx.options.staging
    if staging is None:
        return Staged(None)
    needed = {item.file for item in planned.plan.items}
    for obj in matched.objects:
        needed.update(e.file for e in metadata.objects[obj.key].entries if e.offset == obj.global_offset)
    with ctx.clock.phase("stage"):
        return Staged(stage_files(ctx.comm, ctx.source.storage, metadata, needed, staging.path, staging.node_group))


def unstage(ctx: LoadContext, staged: Staged) -> None:
    """Remove this rank's staged files unless ``StagingOptions(keep=True)``; called once every rank's read
    step returned or raised (so no rank of the node still reads them)."""
    if staged.files is not None and ctx.options.staging is not None and not ctx.options.staging.keep:
        staged.files.remove()


@dataclass(frozen=True)
class ReadDone:
    """What :func:`read` did on this rank: the ShardedObject values it read, and the reader's counts."""

    objects: Mapping[ObjectCell, object]
    bytes_verified: int
    bytes_verify_extra: int
    bytes_direct: int
    bytes_to_device: int


def _read_object(executor: ReadExecutor, metadata: Metadata, obj: ShardedObject) -> object:
    """The value of one ShardedObject cell: its blob read whole, verified and decoded (no pickle)."""
    entry: SavedObject = next(e for e in metadata.objects[obj.key].entries if e.offset == obj.global_offset)
    what = f"object {obj.key!r} at {list(obj.global_offset)}"
    blob = executor.read_object_blob(obj.key, entry)
    try:
        return decode_object_blob(memoryview(blob), where=what)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CorruptCheckpointError(f"{what}: cannot decode: {exc}") from exc


def _read_local(ctx: LoadContext, metadata: Metadata, matched: Matched, planned: ReadPlan, staged: Staged) -> ReadDone:
    """This rank's reads: zero the padding, fill the planned views, read the objects."""
    with torch.no_grad():
        for piece in matched.pieces:
            if piece.padded_view is not None:
                piece.zero_padding()
    files = staged.files
    executor = ReadExecutor(
        files.storage if files is not None else ctx.source.storage,
        files.metadata if files is not None else metadata,
        memory_budget_bytes=ctx.options.memory_budget_bytes,
        device=planned.on_device,
    )
    try:
        executor.run(planned.plan, list(planned.views), list(planned.boxes))
        objects = {(obj.key, obj.global_offset): _read_object(executor, metadata, obj) for obj in matched.objects}
    finally:
        executor.close()
    return ReadDone(
        objects, executor.bytes_verified, executor.bytes_verify_extra, executor.bytes_direct, executor.bytes_to_device
    )


def read(ctx: LoadContext, metadata: Metadata, matched: Matched, planned: ReadPlan, staged: Staged) -> ReadDone:
    """Phase 5, one collective step: each rank reads its bytes into place (:mod:`reshard.io.reader`:
    direct where it can, every chunk used verified), then every rank learns whether all succeeded."""
    with ctx.clock.exchange():
        with ctx.clock.phase("read"):
            done = attempt(_read_local, ctx, metadata, matched, planned, staged)
        ctx.comm.step("reading data", done.check)
    return done.get()


@dataclass(frozen=True)
class Exchanged:
    """What :func:`exchange` moved for this rank, and in how many rounds (the same on every rank)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    rounds: int = 0


def _run_exchange(ctx: LoadContext, schedule: RankSchedule, pieces: tuple[LocalPiece, ...]) -> Exchanged:
    counters = ExchangeCounters()
    run_exchange(ctx.comm.transport, schedule, pieces, counters)
    return Exchanged(counters.bytes_sent, counters.bytes_received, len(schedule.rounds))


def exchange(ctx: LoadContext, matched: Matched, planned: ReadPlan) -> Exchanged:
    """Phase 6, after every rank's reads succeeded: with a read-once schedule, its rounds of sends and
    receives (every rank of the group) and one step that agrees on their outcome; without one, nothing
    (no collective)."""
    if planned.schedule is None:
        return Exchanged()
    with ctx.clock.exchange():
        with ctx.clock.phase("read"):
            done = attempt(_run_exchange, ctx, planned.schedule, matched.pieces)
        ctx.comm.step("exchanging data", done.check)
    return done.get()


def _partial_fingerprints(metadata: Metadata, tensors: tuple[ShardedTensor, ...]) -> dict[str, list[int]]:
    """This rank's part of the fingerprint of every tensor it holds a primary piece of, and its volume."""
    out: dict[str, list[int]] = {}
    for tensor in tensors:
        saved = metadata.tensors[tensor.key]
        if not tensor.is_main_replica or dtype_name(tensor.data.dtype) != saved.dtype:
            continue
        if saved.fingerprint is None:
            raise CheckpointError(
                f"verify=True: the checkpoint holds no fingerprint of {tensor.key!r}; save with "
                "SaveOptions(fingerprint=True)"
            )
        entry = out.setdefault(tensor.key, [0, 0])
        for piece in tensor.pieces():
            entry[0] = (entry[0] + fingerprint(piece.view, piece.box, saved.global_shape)) & ((1 << 64) - 1)
            entry[1] += piece.box.volume
    return out


def _check_fingerprints(metadata: Metadata, parts: list[dict[str, list[int]]]) -> list[str]:
    """On the coordinator: the sums of the parts against the saved fingerprints; returns the tensors the
    primary boxes do not cover whole (not checked), raises on a mismatch."""
    sums: dict[str, list[int]] = {}
    for part in parts:
        for key, (value, volume) in part.items():
            total = sums.setdefault(key, [0, 0])
            total[0] = (total[0] + value) & ((1 << 64) - 1)
            total[1] += volume
    wrong = []
    uncovered = []
    for key, (value, volume) in sorted(sums.items()):
        saved = metadata.tensors[key]
        if volume != math.prod(saved.global_shape):
            uncovered.append(key)
        elif value != saved.fingerprint:
            wrong.append(key)
    if wrong:
        raise CorruptCheckpointError(
            f"verify=True: the loaded content of {', '.join(repr(k) for k in wrong)} differs from what was saved "
            "(content fingerprint mismatch)"
        )
    return uncovered


def verify(ctx: LoadContext, metadata: Metadata, matched: Matched) -> tuple[str, ...]:
    """Phase 7, one collective step where ``LoadOptions(verify=True)`` (every rank calls it): each rank
    fingerprints its primary pieces, the coordinator compares the sums with the saved fingerprints. Returns
    the tensors that could not be checked (the template's primary boxes do not cover them whole)."""
    if not ctx.options.verify:
        return ()
    with ctx.clock.phase("verify"):
        local = functools.partial(_partial_fingerprints, metadata, matched.tensors)
        uncovered = ctx.comm.step("verifying", local, functools.partial(_check_fingerprints, metadata))
    return tuple(uncovered)


def _result_leaf(metadata: Metadata, objects: Mapping[ObjectCell, object], path: str, leaf: Any) -> Any:
    if isinstance(leaf, ScaledTensor):
        return leaf  # its data, scales and global scale were filled in place
    if isinstance(leaf, ShardedTensor):
        return leaf.data
    if isinstance(leaf, ShardedObject):
        return objects.get((leaf.key, leaf.global_offset), leaf.value)
    if isinstance(leaf, torch.Tensor) or is_empty_container(leaf):
        return leaf
    return metadata.common.get(path, leaf)


def map_back(state_dict: Any, metadata: Metadata, objects: Mapping[ObjectCell, object]) -> Any:
    """Phase 8, local: a state dict of the template's structure in which each ShardedTensor is replaced by
    its (filled) local tensor, each ShardedObject by its saved value (its template value when missing) and
    each common value by the saved one (the template's when missing)."""
    return map_leaves(state_dict, functools.partial(_result_leaf, metadata, objects))
