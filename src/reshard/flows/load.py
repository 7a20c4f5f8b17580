"""``reshard.load``: fill a template state dict of the current layout from a checkpoint of any layout.

The flow is a fixed list of phases (:mod:`reshard.flows.load_phases`), each ending in agreement:

1. the coordinator reads and validates ``metadata.json`` and broadcasts it: no other rank reads it;
2. each rank matches its template against the metadata;
3. each rank reads the metadata parts its keys need (partitioned metadata, format version 6) and plans its
   reads: for every target box, the overlaps with the saved boxes and the byte runs
   that hold them. With ``LoadOptions(read_once=...)`` in effect the coordinator first schedules who reads
   which part (:mod:`reshard.planning.exchange`), or reuses the schedule of a plan cache
   (:mod:`reshard.flows.load_planning`): the planner's choice, carried by the plan;
4. with node-local staging, each node downloads the files it needs once;
5. each rank reads those bytes (:mod:`reshard.io.reader`), straight into the destination tensor when the
   overlap is one contiguous run of the same dtype, otherwise through a reused buffer (or a mapping of a
   local file) and one strided copy; every checksum chunk a read touches is read whole and verified on the
   bytes used, so no byte a load returns is unverified;
6. with a read-once schedule, the bytes several ranks need travel from their reader to the others;
7. with ``LoadOptions(verify=True)``, the end-to-end fingerprints are checked;
8. the result state dict is built from the template.
"""

from __future__ import annotations

import datetime
import logging
import time
import warnings
from typing import Any

from reshard.flows.collector import collector_paused
from reshard.flows.load_phases import (
    Exchanged,
    LoadContext,
    Matched,
    ReadDone,
    ReadPlan,
    Staged,
    attempt,
    exchange,
    map_back,
    match_template,
    read,
    read_metadata_once,
    stage,
    unstage,
    verify,
)
from reshard.flows.load_planning import plan_reads
from reshard.flows.options import LoadOptions
from reshard.flows.plan_cache import ReadPlanCache
from reshard.flows.stats import EXCHANGE, LoadStats, PhaseClock
from reshard.io.sources import CheckpointSource, as_source, read_full_metadata
from reshard.metadata import Metadata
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.storage import CheckpointLocation, storage_for

__all__ = ["LoadStats", "load", "load_reusing", "read_metadata"]

logger = logging.getLogger("reshard")


def read_metadata(path: CheckpointLocation, *, storage_options: dict[str, Any] | None = None) -> Metadata:
    """Read and validate a checkpoint's metadata (tensors, dtypes, shapes, boxes, files, common state)
    without reading any tensor data; for partitioned metadata (format version 6) every part, verified
    (:func:`~reshard.io.sources.read_full_metadata`). Not collective. ``path`` is a directory, URL or Storage."""
    storage = storage_for(path, storage_options)
    try:
        return read_full_metadata(storage)
    finally:
        if storage is not path:
            storage.close()


def load(
    state_dict: Any,
    source: CheckpointLocation | CheckpointSource,
    *,
    group: Group = None,
    strict: bool = True,
    options: LoadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta | float | None = None,
    stats: LoadStats | None = None,
) -> Any:
    """Load a checkpoint into a template state dict of the current layout. Called by all ranks of ``group``.

    The template says what this rank needs: :class:`~reshard.ShardedTensor` leaves (any layout: other
    world size, split axes or offsets, segments, flat ranges or padding than the saving one), plain
    tensors (read whole), ShardedObjects and common values. Tensors are filled in place; padding past a
    template's ``logical_shape`` is set to zero.

    Args:
        state_dict: the template.
        source: the checkpoint: a directory, a ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix``
            URL, or a :class:`~reshard.storage.Storage` (a reshard checkpoint); or a
            :class:`~reshard.io.sources.CheckpointSource`, such as
            :class:`~reshard.interop.HuggingFaceSource` for a Hugging Face safetensors directory.
        group: the ranks that load together: a process group (``None``: the default group, or this process
            alone), or a :class:`~reshard.net.transports.ThreadGroup` member.
        strict: when True, keys of the template missing from the checkpoint raise
            :class:`~reshard.MismatchError`; when False they are skipped (left as they are) with a warning.
        options: how to read (:class:`~reshard.LoadOptions`: dtype casts, read merging, the staging
            buffer, end-to-end verification, node-local staging); the defaults suit most loads.
        storage_options: passed to the object-store client of a path or URL ``source`` (see
            :func:`reshard.save`).
        timeout: how long any collective may wait for the slowest rank.
        stats: if given, filled with this rank's read accounting.

    Returns:
        A state dict of the template's structure in which each ShardedTensor is replaced by its filled
        local tensor, each ShardedObject by its saved value and each common value by the saved one.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError: nothing loadable at ``source``.
        MismatchError: missing keys (with ``strict``), a (logical) global shape that differs, or a dtype
            that differs when ``allow_dtype_cast`` is off.
        CorruptCheckpointError: invalid metadata, a checksum mismatch, a truncated or missing file.
        CheckpointError: any failure, raised on every rank and naming the failing ranks.
    """
    return load_reusing(
        None,
        state_dict,
        source,
        group=group,
        strict=strict,
        options=options,
        storage_options=storage_options,
        timeout=timeout,
        stats=stats,
    )


def load_reusing(
    plan_cache: ReadPlanCache | None,
    state_dict: Any,
    source: CheckpointLocation | CheckpointSource,
    *,
    group: Group = None,
    strict: bool = True,
    options: LoadOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta | float | None = None,
    stats: LoadStats | None = None,
) -> Any:
    """:func:`load` with the read-once schedules ``plan_cache`` keeps across loads (a
    :class:`~reshard.flows.plan_cache.ReadPlanCache`; a :class:`~reshard.CheckpointManager` passes its own, as
    :func:`reshard.flows.save.save_replacing` takes a manager's save plans; :func:`reshard.load` keeps none): with
    ``LoadOptions(reuse_plan=True)``, the default, a read-once load whose ranks' targets were scheduled before
    reuses that schedule instead of gathering them (:mod:`reshard.flows.load_planning`). Called by all ranks of
    ``group``, each passing a cache, or each None."""
    started = time.perf_counter()
    # Paused from the first step: a collection the caller's objects made due must not start in this call
    # (reshard.flows.collector).
    with collector_paused():
        options = options if options is not None else LoadOptions()
        comm = Communicator(group, timeout=timeout)
        opened = as_source(source, storage_options)
        try:
            ctx = LoadContext(opened, comm, options, strict, PhaseClock("load", comm.rank, started), plan_cache)
            return _load_from(ctx, state_dict, stats=stats)
        finally:
            if opened is not source:
                opened.close()


def _load_from(ctx: LoadContext, state_dict: Any, *, stats: LoadStats | None) -> Any:
    """The body of :func:`load` once the source is open: the phases of :mod:`reshard.flows.load_phases`."""
    comm, strict, options = ctx.comm, ctx.strict, ctx.options
    agreed = read_metadata_once(ctx)
    metadata = agreed.metadata
    with ctx.clock.phase("plan"):
        matched = attempt(match_template, state_dict, metadata, rank=comm.rank, strict=strict, options=options)
    planned = plan_reads(ctx, agreed, matched)
    metadata = planned.metadata  # with the boxes of this rank's keys (partitioned metadata: read from parts)
    template = matched.get()  # the planning step succeeded on every rank, this one's matching too
    _warn_unloaded(template, options)
    staged = stage(ctx, metadata, template, planned)
    try:
        done = read(ctx, metadata, template, planned, staged)
    finally:
        unstage(ctx, staged)  # every rank of every node is done reading (or failed) once the step returned
    exchanged = exchange(ctx, template, planned)
    uncovered = verify(ctx, metadata, template)
    if uncovered:
        warnings.warn(
            "reshard.load(LoadOptions(verify=True)): not checked, the template's primary boxes do not cover "
            f"them whole: {', '.join(uncovered[:20])}",
            stacklevel=3,
        )
    result = map_back(state_dict, metadata, done.objects)
    if stats is not None:
        needed = _bytes_needed(metadata, template, planned)
        _fill_stats(stats, ctx.clock, planned, done, exchanged, staged, needed=needed, template=template)
        stats.read_once, stats.read_once_reason = agreed.read_once, agreed.read_once_reason
        stats.schedule_reused = planned.reused
    _log(ctx, planned)
    return result


def _listed(names: tuple[str, ...]) -> str:
    return ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")


def _warn_unloaded(template: Matched, options: LoadOptions) -> None:
    """Warn of the template's entries this load leaves as they are: missing ones (``strict=False``), and
    object cells of a changed grid under ``LoadOptions(object_grid=...)`` with the saved cells no rank gets."""
    if template.missing:
        warnings.warn(
            f"reshard.load(strict=False): {len(template.missing)} entries are not in the checkpoint and were left "
            f"as they are: {_listed(template.missing)}",
            stacklevel=4,
        )
    grids = template.regridded
    if grids.changed:
        kept = f"this rank's cells keep the template's value: {_listed(grids.kept)}" if grids.kept else ""
        ignored = f"saved cells loaded by no rank: {_listed(grids.ignored)}" if grids.ignored else ""
        warnings.warn(
            f"reshard.load(LoadOptions(object_grid={options.object_grid!r})): {'; '.join(grids.changed)}: "
            + "; ".join(part for part in (kept, ignored) if part),
            stacklevel=4,
        )


def _bytes_needed(metadata: Metadata, template: Matched, planned: ReadPlan) -> int:
    """The saved bytes this rank's targets cover (with a read-once schedule its own reads cover less)."""
    if planned.schedule is None:
        return planned.plan.bytes_needed
    return sum(
        p.box.volume * metadata.tensors[k].torch_dtype.itemsize
        for k, p in zip(template.keys, template.pieces, strict=True)
    )


def _fill_stats(
    stats: LoadStats,
    clock: PhaseClock,
    planned: ReadPlan,
    done: ReadDone,
    exchanged: Exchanged,
    staged: Staged,
    *,
    needed: int,
    template: Matched,
) -> None:
    """Fill the caller's ``stats`` once the load succeeded."""
    stats.bytes_needed = needed
    stats.bytes_from_peers = exchanged.bytes_received
    stats.bytes_to_peers = exchanged.bytes_sent
    stats.exchange_rounds = exchanged.rounds
    stats.bytes_read = planned.plan.bytes_read
    stats.read_requests = planned.plan.requests
    stats.bytes_verified = done.bytes_verified
    stats.bytes_direct = done.bytes_direct
    stats.bytes_to_device = done.bytes_to_device
    stats.bytes_verify_extra = done.bytes_verify_extra
    if staged.files is not None:
        stats.files_downloaded = len(staged.files.downloaded)
        stats.bytes_downloaded = staged.files.bytes_downloaded
        stats.files_reused = len(staged.files.reused)
    stats.missing = template.missing
    stats.objects_kept = template.regridded.kept
    stats.objects_ignored = template.regridded.ignored
    stats.seconds_metadata = clock.get("metadata")
    stats.seconds_plan = clock.get("plan")
    stats.seconds_stage = clock.get("stage")
    stats.seconds_read = clock.get("read")
    stats.seconds_verify = clock.get("verify")
    stats.seconds_exchange = clock.get(EXCHANGE)
    stats.seconds = clock.elapsed()


def _log(ctx: LoadContext, planned: ReadPlan) -> None:
    """The INFO summary of this rank's load."""
    seconds = ctx.clock.elapsed()
    plan = planned.plan
    logger.info(
        "[rank=%d] loaded %s in %.3f s (%s): %d bytes needed, %d read in %d requests (%.1f MB/s)",
        ctx.comm.rank,
        ctx.source.storage.describe(),
        seconds,
        ctx.clock.summary(),
        plan.bytes_needed,
        plan.bytes_read,
        plan.requests,
        plan.bytes_read / seconds / 1e6 if seconds > 0 else 0.0,
    )
