"""``reshard.save``: every rank writes its unique boxes once; the coordinator commits.

Flow (each phase ends in agreement, so a failure on any rank raises on every rank and nothing is
committed):

1. *describe*: each rank flattens its state dict into pieces (boxes, no data); the descriptions are
   gathered on the coordinator (in a compact form), which validates the global tiling, elects one writer
   per box and prepares the directory, then sends each rank its own assignment only.
2. *write*: each elected rank writes its boxes, with CRC-32C checksums, into its own data file, whose
   name is unique to this save, and fsyncs it.
3. *commit*: the coordinator writes ``metadata.json`` atomically (temporary file, fsync, rename or
   exclusive link, directory fsync; a conditional put on object stores), through
   :class:`~reshard.io.commit.SaveCommit`. Until then the directory holds no committed checkpoint from
   this save, and a failure removes this save's files. The commit is a point of no return: after it,
   nothing this save wrote is deleted whatever fails next; a failure then (a rank that dies before the
   coordinator's confirmation reaches it) is :class:`~reshard.UnconfirmedCommitError`, and the checkpoint
   stays. The other ranks get a summary (:class:`SaveResult`), never the whole metadata.

The per-save arguments (path, ``overwrite``, ``fingerprint``, ``checksum_chunk_bytes``, ``content_hash``,
``verify_base``, ``base``) travel with the descriptions and must agree across ranks, or nothing is written.

An *incremental* save (``base=``) differs in two places: planning looks every assigned box up in the base
(:mod:`reshard.planning.incremental`) and tells its writer the base's content hash and where the base stores
the box, and a writer whose box hashes the same, and whose stored copy reads back as its bytes, references it
instead of writing it (:mod:`reshard.io.reuse`; a copy damaged since its commit is written anew); at planning,
before any box is skipped, the coordinator leaves reference markers in the checkpoints it may reference, under
each one's lock, and checks that their files are there; at the commit the markers are narrowed to what is
referenced (:mod:`reshard.io.references`).

The phases are functions of frozen values, one collective at most each: :mod:`reshard.flows.save_phases`
(describe, plan, write) and :mod:`reshard.flows.save_commit` (commit, finish); :func:`save` runs them in
that order, and so does an asynchronous save on its snapshot.

So what a rank other than the coordinator sends and receives does not grow with the number of ranks
(docs/scale.md measures it, with the coordinator's planning time and memory, up to 8192 ranks).
"""

from __future__ import annotations

import datetime
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from reshard.flows.certify import Checks, save_facts
from reshard.flows.collector import collector_paused
from reshard.flows.options import SaveOptions
from reshard.flows.plan_cache import PlanCache
from reshard.flows.save_commit import Committed, commit, finish
from reshard.flows.save_phases import Described, Planned, SaveRequest, describe_rank, plan, write_assigned
from reshard.flows.save_reuse import offer_layout, plan_layouts
from reshard.flows.stats import PhaseClock, SaveStats
from reshard.io.datafile import tensor_bytes
from reshard.io.reuse import base_name_of
from reshard.metadata import Metadata
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.storage import CheckpointLocation, storage_for

__all__ = ["SaveResult", "run_phases", "save", "save_replacing", "saved_result", "tensor_bytes"]

logger = logging.getLogger("reshard")


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveResult:
    """What :func:`save` returns on every rank of the group.

    Attributes:
        path: the checkpoint, as its storage describes it.
        save_id: the id of this save (data file names contain it).
        world_size: ranks in the group that saved.
        num_files: data files this save wrote (one per rank that wrote something).
        file_bytes: bytes of the data files this save wrote together.
        total_bytes: bytes of tensor data in the checkpoint (each box once), written or referenced.
        referenced_bytes: of those, the bytes an incremental save did not write because its base held them
            (they stay in the files of the checkpoints that hold them).
        rewritten_bytes: of the bytes written, those an incremental save wrote although its base records the
            same content, because the copy the base stores did not read back as it (damaged after its commit,
            missing, unreadable; ``SaveOptions(verify_base=True)``, the default): 0 when the base is sound.
        metadata: on the coordinator (rank 0 of the group), the committed metadata; None on the other ranks,
            which never receive the whole checkpoint's metadata (at ten thousand ranks that would be every
            rank holding everyone's plan): use :func:`reshard.read_metadata` where it is needed.
        stats: this rank's :class:`~reshard.SaveStats` (bytes written, seconds per phase).
        checks: with ``SaveOptions(certify=...)``, the outcome of the checks (:class:`~reshard.Checks`, the same on
            every rank; ``passed``: the coordinator wrote ``certified.json``); None without.
    """

    path: str
    save_id: str
    world_size: int
    num_files: int
    file_bytes: int
    total_bytes: int
    metadata: Metadata | None
    referenced_bytes: int = 0
    rewritten_bytes: int = 0
    stats: SaveStats = field(default_factory=SaveStats, compare=False)
    checks: Checks | None = None


def save(
    state_dict: Any,
    path: CheckpointLocation,
    *,
    group: Group = None,
    overwrite: bool = False,
    options: SaveOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta | float | None = None,
    base: CheckpointLocation | None = None,
    **deprecated: Any,
) -> SaveResult:
    """Save a (sharded) state dict as a checkpoint at ``path``. Called by all ranks of ``group``.

    Args:
        state_dict: nested dicts/lists whose leaves are :class:`~reshard.ShardedTensor`,
            :class:`~reshard.ShardedObject`, plain tensors (full, replicated on every rank: written
            once) or JSON-like common values (the coordinator's are written).
        path: the checkpoint: a directory (created if needed), a ``file://``, ``s3://bucket/prefix`` or
            ``gs://bucket/prefix`` URL, or a :class:`~reshard.storage.Storage`. Every rank passes the same.
        group: the ranks that save together: a process group (``None``: the default group, or this process
            alone when ``torch.distributed`` is not initialised), or a :class:`~reshard.net.transports.ThreadGroup`
            member.
        overwrite: replace a complete checkpoint at ``path``. The old one stays loadable until the new
            ``metadata.json`` replaces it; its data files are removed after that.
        options: how to write (:class:`~reshard.SaveOptions`: content fingerprints, the checksum chunk
            size, whether an incremental save reads its base back); every rank passes equal ones.
        timeout: how long any collective may wait for the slowest rank (default 10 minutes).
        storage_options: passed to the object-store client (fsspec ``s3``/``gs`` filesystem options such
            as ``endpoint_url``); credentials otherwise come from the client's usual configuration.
        base: save incrementally against this earlier checkpoint, a sibling of ``path`` (same parent
            directory or prefix) saved with content hashes: a box whose place and content hash equal the
            base's, and whose stored copy reads back as its bytes (unless ``SaveOptions(verify_base=False)``),
            is not written, and the metadata references the file that holds it (docs/format.md section 15);
            the new checkpoint records content hashes too. Every rank passes the same.
        deprecated: ``stats=``, a :class:`~reshard.SaveStats` to fill, is still taken for one release with a
            DeprecationWarning (this rank's statistics are ``SaveResult.stats``); any other keyword is a
            TypeError.

    Returns:
        A :class:`SaveResult` on every rank: the checkpoint's id, size and files, this rank's statistics; on
        the coordinator also its committed metadata.

    Raises:
        ShardingError: the ranks' boxes do not tile their tensors (same on every rank).
        CheckpointExistsError: ``path`` holds a complete checkpoint and ``overwrite`` is off.
        CheckpointLockedError: another save holds ``path``, or (incremental) a checkpoint holding bytes of the base
            is locked by a gc, retention or save changing its files (nothing is written then).
        CheckpointError: ``base`` is not a sibling of ``path``, has no content hashes, or checksums in
            chunks of another size; or a data file it references is missing at the commit (nothing is
            written then; a file already missing when it is read back is not referenced);
            CorruptCheckpointError when ``base`` itself references files that no marker ties to it (a
            copied or moved checkpoint).
        StorageError: a file could not be written on some rank.
        UnconfirmedCommitError: the checkpoint was committed and is complete, but a failure after the commit
            (a rank died or lost contact) kept the save from ending in agreement; nothing is deleted.
        CheckpointError: any failure, on every rank, naming the failing ranks; nothing is committed.
    """
    started = time.perf_counter()
    filled = _deprecated_stats(deprecated)
    result = save_replacing(
        state_dict,
        path,
        replaces=None,
        overwrite=overwrite,
        group=group,
        options=options,
        storage_options=storage_options,
        timeout=timeout,
        base=base,
        started=started,
    )
    if filled is not None:
        vars(filled).update(vars(result.stats))  # the caller's SaveStats, filled as before
    return result


def save_replacing(
    state_dict: Any,
    path: CheckpointLocation,
    *,
    replaces: str | None,
    overwrite: bool = False,
    group: Group = None,
    options: SaveOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta | float | None = None,
    base: CheckpointLocation | None = None,
    started: float | None = None,
    certificate: bool = True,
    plan_cache: PlanCache | None = None,
) -> SaveResult:
    """:func:`save`, which may also replace the one complete checkpoint at ``path`` whose ``metadata.json`` has the
    SHA-256 ``replaces`` (checked on the coordinator under the save lock; any other is refused as without
    ``overwrite``): how :class:`~reshard.CheckpointManager` saves again a damaged step that its ``load_latest``
    resumed past. Called by all ranks of ``group``, with equal arguments. ``certificate=False``: with
    ``SaveOptions(certify=...)`` the checks run but ``certified.json`` is not written (the manager writes it once its
    ``certify_hook`` approved). ``plan_cache``: where the coordinator keeps the plans of earlier saves (a manager's or
    an asynchronous checkpointer's; with ``SaveOptions(reuse_plan=True)``, the default, a save of a layout planned
    before skips the gather of the descriptions and the planning: :mod:`reshard.flows.save_reuse`); every rank passes
    one or none.

    Raises:
        as :func:`save`.
    """
    started = time.perf_counter() if started is None else started
    # Paused from the first step: a collection the caller's objects made due must not start in this call
    # (reshard.flows.collector).
    with collector_paused():
        options = options if options is not None else SaveOptions()
        comm = Communicator(group, timeout=timeout)
        storage = storage_for(path, storage_options)
        try:
            base_name = None if base is None else base_name_of(storage, base, storage_options)
            request = SaveRequest.of(
                storage,
                options,
                overwrite=overwrite,
                base_name=base_name,
                replaces=replaces,
                certificate=certificate,
                plans=plan_cache,
            )
            return _save_to(request, state_dict, comm, started=started)
        finally:
            if storage is not path:
                storage.close()


def certify_facts(request: SaveRequest, described: Described, planned: Planned) -> dict[str, Any] | None:
    """This rank's facts for the checks of ``request.certify`` (None without): local, after its write, so that a rank
    that writes nothing checksums its replicas while the writers write. Never raises."""
    if request.certify is None or described.error is not None:
        return None
    return save_facts(
        described.description.tensors,
        described.views,
        planned.assignment.tensors,
        request.certify,
        chunk_bytes=request.checksum_chunk_bytes,
    )


def _deprecated_stats(deprecated: dict[str, Any]) -> SaveStats | None:
    """The ``stats=`` keyword of earlier releases (a DeprecationWarning), or None; any other keyword is a
    TypeError, as for any function."""
    unknown = sorted(set(deprecated) - {"stats"})
    if unknown:
        raise TypeError(f"save() got an unexpected keyword argument {unknown[0]!r}")
    if "stats" not in deprecated:
        return None
    warnings.warn(
        "reshard.save(stats=...) is deprecated and goes in the next release: read SaveResult.stats",
        DeprecationWarning,
        stacklevel=3,
    )
    stats = deprecated["stats"]
    if stats is not None and not isinstance(stats, SaveStats):
        raise TypeError(f"save() got stats={stats!r}: a reshard.SaveStats or None")
    return stats


def _save_to(request: SaveRequest, state_dict: Any, comm: Communicator, *, started: float) -> SaveResult:
    """The phases of :func:`save` once the storage is open (see the module doc and
    :mod:`reshard.flows.save_phases`); the result, with this rank's statistics."""
    clock = PhaseClock("save", comm.rank, started)
    rank = comm.rank
    planned, committed, stats = run_phases(request, state_dict, comm, clock)
    result = saved_result(request, comm, planned, committed, stats, committed.checks, stacklevel=5)
    logger.info(
        "[rank=%d] saved %s in %.3f s (%s): this rank wrote %d bytes (%.1f MB/s); the checkpoint holds %d bytes "
        "in %d files",
        rank,
        result.path,
        stats.seconds,
        clock.summary(),
        stats.bytes_written,
        stats.throughput / 1e6,
        result.total_bytes,
        result.num_files,
    )
    return result


def run_phases(
    request: SaveRequest, state_dict: Any, comm: Communicator, clock: PhaseClock
) -> tuple[Planned, Committed, SaveStats]:
    """Every rank of ``comm``: the phases of a save (describe, plan, write, the checks' facts, commit, finish) on
    ``request``'s storage; what was planned, what was committed and this rank's statistics. Shared by
    :func:`save` and the node-local save (:mod:`reshard.flows.nodelocal`), which goes on with steps of its own."""
    rank = comm.rank
    described = clock.timed("plan", describe_rank)(request, state_dict, rank=rank, is_coordinator=comm.is_coordinator)
    if request.reusing:  # the planner choice: a plan reused, or planned on the layouts gathered after a miss
        planned = plan_layouts(comm, request, described, clock, offer_layout(comm, request, described, clock))
    else:
        planned = plan(comm, request, described, clock)
    written = clock.timed("write", write_assigned)(request, described, planned, rank=rank)
    facts = clock.timed("certify", certify_facts)(request, described, planned)
    committed = commit(comm, request, described, planned, written, clock, facts)
    return planned, committed, finish(committed, described, written, clock)


def saved_result(
    request: SaveRequest,
    comm: Communicator,
    planned: Planned,
    committed: Committed,
    stats: SaveStats,
    checks: Checks | None,
    *,
    stacklevel: int,
) -> SaveResult:
    """This rank's :class:`SaveResult` of a committed save; with failed ``checks``, the coordinator warns that the
    step is saved but not certified (``stacklevel``: the user's frame)."""
    result = SaveResult(
        path=request.storage.describe(),
        save_id=planned.save_id,
        world_size=comm.size,
        num_files=committed.files,
        file_bytes=committed.file_bytes,
        total_bytes=committed.total_bytes,
        metadata=committed.metadata,
        referenced_bytes=committed.referenced_bytes,
        rewritten_bytes=committed.rewritten_bytes,
        stats=stats,
        checks=checks,
    )
    if checks is not None and not checks.passed and comm.is_coordinator:
        problems = "; ".join(checks.problems)
        warnings.warn(f"reshard: {result.path} is saved but not certified: {problems}", stacklevel=stacklevel)
    return result
