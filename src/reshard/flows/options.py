"""Option objects of ``save`` and ``load``: small frozen values, one per concern.

Every rank of a group passes equal options; ``save`` and ``load`` check that they do agree across ranks in
their first collective step (a rank that passes other ones fails the operation on every rank, with a
:class:`~reshard.CheckpointError` naming the option and the ranks of each value), so that a difference is an
error on every rank, never a hang or a silently different operation. :func:`load_terms` and
:func:`check_terms` are that check for a load (and for the peer-memory tier).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.errors import CheckpointError
from reshard.io.datafile import DEFAULT_SAVE_MEMORY_BUDGET, MIN_SAVE_MEMORY_BUDGET
from reshard.io.reader import DEFAULT_LOAD_MEMORY_BUDGET, MIN_LOAD_MEMORY_BUDGET
from reshard.planning.certify import CertifyOptions
from reshard.planning.objects import OBJECT_GRIDS, ObjectGrid

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "DEFAULT_CHECKSUM_CHUNK_BYTES",
    "LoadOptions",
    "SaveOptions",
    "StagingOptions",
    "check_terms",
    "load_terms",
]

DEFAULT_CHECKSUM_CHUNK_BYTES = 4 * 1024 * 1024
"""Stored bytes are checksummed in pieces of this size, so a partial read can verify what it touches."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions:
    """How a save writes.

    Attributes:
        fingerprint: also store, for every tensor, a layout-independent content fingerprint, so that
            ``load(..., options=LoadOptions(verify=True))`` can check a reshard end to end (an extra pass
            over the data; docs/reliability.md section 9).
        checksum_chunk_bytes: size of the pieces each stored box is checksummed in (a positive integer).
        content_hash: also store every box's content hash (XXH3-128, computed as the box is written, about
            15 GB/s per core), so that a later save can use this checkpoint as the ``base`` of an incremental
            save (format version 4). An incremental save always stores them.
        memory_budget_bytes: the most host memory this rank's save holds at once for its own buffers
            (default 256 MiB, at least 1 MiB): the host slabs through which tensors that are not contiguous
            CPU memory (GPU tensors, transposed views) are streamed a slab at a time instead of copied whole,
            and an object store's upload parts in flight; a storage that cannot keep within it (a budget
            below two upload parts, a one-put store and a data file larger than the budget) raises
            :class:`~reshard.StorageError` and nothing is committed. Not in it: the state itself, the
            encoded values of ShardedObjects, and the snapshot of an asynchronous save (the state's size,
            by design).
        verify_base: for an incremental save (``base=``), before a box is referenced instead of written, its
            writer reads the copy the base stores back (the box's bytes, streamed through the memory budget; on
            object stores ranged GETs, one per run of neighbouring boxes) and references it only if its
            XXH3-128 equals that of the bytes in memory; a copy that is damaged, missing or unreadable is written
            anew (a warning names its file; ``SaveResult.rewritten_bytes`` counts it), so the new checkpoint is
            complete and loads. This reads every referenced byte on every save. False trusts the base's
            recorded hashes and reads nothing of it (the behaviour before this option): a base damaged after
            its commit then makes the new checkpoint unloadable. Every rank passes the same.
        certify: run the checks of a certified recovery point on the state saved (:class:`~reshard.CertifyOptions`:
            no NaN or infinity, replicas equal; :mod:`reshard.flows.certify`) and return them in
            ``SaveResult.checks``; when they pass, the coordinator writes ``certified.json`` after the commit. A
            failed check never fails the save (a warning on the coordinator names the problems). None: no checks.
            Every rank passes equal ones.
        reuse_plan: in the saves of a :class:`~reshard.CheckpointManager` or an :class:`~reshard.AsyncCheckpointer`
            (which keep the plans of their saves), a save whose layout (keys, dtypes, shapes, boxes, replica ids,
            objects, group size, every rank's position) was planned before sends only a fingerprint of it at planning
            and reuses that plan; any difference plans anew (docs/scale.md, "Plans reused"). :func:`reshard.save` and
            :func:`reshard.async_save` keep no plans: there it changes nothing. Every rank passes the same.
        metadata_parts: whether the metadata is partitioned (format version 6: ``metadata.json`` holds an index and
            the tensors' boxes live in part files, so that a rank of a load reads only the parts its keys need;
            docs/format.md section 19): None (the default) when the tensors' boxes take several MiB (what pays at
            thousands of ranks), True always (a save without tensors has nothing to partition and fails), False
            never. Every rank passes the same.

    Raises (on construction):
        ValueError: ``memory_budget_bytes`` below 1 MiB.
        TypeError: ``metadata_parts`` is not True, False or None.
    """

    fingerprint: bool = False
    checksum_chunk_bytes: int = DEFAULT_CHECKSUM_CHUNK_BYTES
    content_hash: bool = False
    memory_budget_bytes: int = DEFAULT_SAVE_MEMORY_BUDGET
    verify_base: bool = True
    certify: CertifyOptions | None = None
    reuse_plan: bool = True
    metadata_parts: bool | None = None

    def __post_init__(self) -> None:
        if self.metadata_parts is not None and not isinstance(self.metadata_parts, bool):
            raise TypeError(f"metadata_parts must be True, False or None, got {self.metadata_parts!r}")
        if self.certify is not None and not isinstance(self.certify, CertifyOptions):
            raise TypeError(f"certify must be a reshard.CertifyOptions or None, got {self.certify!r}")
        if self.memory_budget_bytes < MIN_SAVE_MEMORY_BUDGET:
            raise ValueError(
                f"memory_budget_bytes must be at least {MIN_SAVE_MEMORY_BUDGET} bytes, got {self.memory_budget_bytes}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingOptions:
    """Load through node-local staging: the ranks of each node agree on the whole data files any of them
    needs, each file is downloaded once per node into ``directory`` (a temporary name, then renamed;
    complete files from an earlier run are reused after checking their size and checksums), and all reads
    are then local. For storage that is slow to range-read.

    Attributes:
        directory: the node-local directory.
        keep: keep the staged files after the load (they are removed by default).
        node_group: the process group of the ranks that share ``directory``; default: the ranks with the
            same hostname.
    """

    directory: str | os.PathLike[str]
    keep: bool = False
    node_group: dist.ProcessGroup | None = None

    @property
    def path(self) -> Path:
        return Path(self.directory)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """How a load reads.

    Attributes:
        allow_dtype_cast: convert saved elements to the template's dtype while copying (bf16 <-> fp32,
            fp16 -> fp32, int32 -> int64, ...); when False a dtype difference raises
            :class:`~reshard.MismatchError`.
        allow_lossy_cast: also allow the conversions that change values beyond rounding
            (:func:`reshard.state.dtypes.is_lossy_cast`: floating to integer, which truncates; an integer to a
            narrower one; complex to real; anything to bool); by default they raise
            :class:`~reshard.MismatchError`, since a float checkpoint loaded into an integer template is
            almost always a mistake.
        max_read_amplification: bytes read / bytes needed allowed when merging strided runs into larger
            reads (at least 1.0); None (the default) leaves it to the storage: local files merge within 1.1,
            object stores merge wherever a gap is cheaper to read than another ranged GET
            (``Storage.request_cost_bytes``), so a strided resharded load makes a few large GETs, not one per
            row.
        memory_budget_bytes: the most host memory this rank's load holds at once for its own buffers
            (default 32 MiB): the read buffer of reads that cannot land directly in their destination
            (strided overlaps, dtype conversions, the parts of checksum chunks outside a read), and the
            mapped windows of local files or an object store's ranged GETs in flight (under half the budget:
            a larger budget makes larger and more concurrent GETs); reads are planned in pieces that keep
            within it, whatever the tensor sizes. Not in it: the targets, the metadata and the read plan.
        verify: after reading, recompute every tensor's content fingerprint over the primary boxes of this
            layout, combine the partial sums across ranks and compare them with the fingerprints the save
            stored (``SaveOptions(fingerprint=True)``): a wrong copy, a planner bug or a forgery of the data
            raises CorruptCheckpointError naming the tensor, on every rank. Tensors the template does not
            cover whole, or loads with a dtype conversion, cannot be checked (a warning names them).
        staging: load through node-local staging (:class:`StagingOptions`); None reads directly.
        read_once: whether the ranks that need the same saved bytes (data- and context-parallel replicas,
            any overlap of several ranks' boxes) read them from storage once between them, each reader
            verifying what it read, and send them to the others over the group (:mod:`reshard.io.exchange`):
            True, False, or None (the default) for where it wins: on when several ranks load from storage
            many nodes share (:meth:`~reshard.storage.Storage.sharing`: an object store, or a shared file
            system such as NFS, Lustre, GPFS, CephFS, BeeGFS or a FUSE mount, detected or marked with
            ``LocalStorage(path, shared=True)`` or ``RESHARD_SHARED_FILESYSTEM=1``), off for a local disk
            (replicas on one node share its page cache); where the ranks' storages differ, on when any of them
            is shared (every rank decides alike; ``LoadStats.read_once_reason`` says why). The exchange's
            buffers come out of ``memory_budget_bytes`` (half for sending, half for receiving, at least 4 KiB
            each), after the reads released theirs.
        object_grid: what a per-rank :class:`~reshard.ShardedObject` whose template grid differs from the
            saved one loads (a resume on another layout; :mod:`reshard.planning.objects`): ``"exact"`` (the
            default) raises :class:`~reshard.MismatchError` on every rank; ``"same_coordinate"`` loads each
            requested cell from the saved cell of the same coordinate, and a requested cell the saved grid
            does not have keeps the template's value (``LoadStats.objects_kept``), while saved cells outside
            the requested grid are loaded by no rank (``LoadStats.objects_ignored``), both named in a warning
            (grids of another number of axes raise :class:`~reshard.MismatchError`); ``"skip"`` loads no cell
            of a changed grid (every one keeps the template's value, every saved cell is named). An object
            whose grid did not change loads as ever.
        reuse_plan: in the loads of a :class:`~reshard.CheckpointManager` (which keeps the read-once schedules of its
            loads, in memory and in its root; or of any caller of :func:`reshard.flows.load.load_reusing`), a
            read-once load whose ranks' targets (keys, boxes, dtypes, group size, every rank's position) were
            scheduled before sends only a fingerprint of them at planning and reuses that schedule; any difference
            schedules anew (docs/scale.md, "Plans reused"). A load that does not read once has no schedule: there it
            changes nothing.

    Every rank of a load passes the same options, checked in the load's first collective step (a difference
    is a :class:`~reshard.CheckpointError` on every rank naming the option and the ranks of each value, before
    anything is read), with two exceptions, which only say how a rank reads its own bytes, never what it
    gets: ``memory_budget_bytes`` (a rank short of host memory may pass a smaller budget; a read-once
    exchange, whose rounds every rank shares, keeps within the smallest budget of the group) and
    ``max_read_amplification`` (each rank plans its own reads, as its own storage would decide with None).
    ``staging.directory`` must agree among the ranks of a node (another node may stage elsewhere).

    Raises (on construction):
        ValueError: ``max_read_amplification`` below 1.0, ``memory_budget_bytes`` below 16,
            ``read_once=True`` with ``staging`` (staging already downloads each file once per node), or an
            ``object_grid`` other than ``"exact"``, ``"same_coordinate"`` and ``"skip"``.
    """

    allow_dtype_cast: bool = True
    allow_lossy_cast: bool = False
    max_read_amplification: float | None = None
    memory_budget_bytes: int = DEFAULT_LOAD_MEMORY_BUDGET
    verify: bool = False
    staging: StagingOptions | None = None
    read_once: bool | None = None
    object_grid: ObjectGrid = "exact"
    reuse_plan: bool = True

    def __post_init__(self) -> None:
        if self.object_grid not in OBJECT_GRIDS:
            choices = ", ".join(map(repr, OBJECT_GRIDS))
            raise ValueError(f"object_grid must be one of {choices}, got {self.object_grid!r}")
        if self.read_once and self.staging is not None:
            raise ValueError("read_once=True and staging exclude each other: staging downloads each file once per node")
        if self.max_read_amplification is not None and not self.max_read_amplification >= 1.0:
            raise ValueError(f"max_read_amplification must be at least 1.0, got {self.max_read_amplification}")
        if self.memory_budget_bytes < MIN_LOAD_MEMORY_BUDGET:
            raise ValueError(
                f"memory_budget_bytes must be at least {MIN_LOAD_MEMORY_BUDGET}, got {self.memory_budget_bytes}"
            )


def load_terms(options: LoadOptions, *, strict: bool, source: str, node: str, plan_cache: bool) -> dict[str, Any]:
    """The arguments of one rank's load that every rank must pass alike (JSON values), for :func:`check_terms`:
    every field of ``options`` but the two that may differ per rank (see :class:`LoadOptions`), ``strict``,
    the kind of ``source`` and whether a plan cache was passed (``plan_cache``). ``node`` names this rank's node
    (the staging directory must agree among the ranks of each node)."""
    staging = options.staging
    return {
        "allow_dtype_cast": bool(options.allow_dtype_cast),
        "allow_lossy_cast": bool(options.allow_lossy_cast),
        "verify": bool(options.verify),
        "read_once": options.read_once if options.read_once is None else bool(options.read_once),
        "object_grid": str(options.object_grid),
        "reuse_plan": bool(options.reuse_plan),
        "plan_cache": bool(plan_cache),
        "staging": staging is not None,
        "staging.keep": None if staging is None else bool(staging.keep),
        "staging.directory": None if staging is None else [node, os.path.abspath(staging.path)],
        "strict": bool(strict),
        "source": source,
    }


def check_terms(terms: list[dict[str, Any]], operation: str) -> None:
    """On the coordinator: every rank passed the same value of every term (``terms[r]`` from rank ``r``). A
    sub-term (a dotted name, such as ``staging.keep``) is compared among the ranks that pass a value for it
    (not None); one whose value is ``[node, value]`` among the ranks of each node.

    Raises:
        CheckpointError: naming each term that differs and the ranks of each value.
    """
    problems = []
    for name in terms[0]:
        values = {rank: t[name] for rank, t in enumerate(terms) if "." not in name or t[name] is not None}
        if "." in name and any(isinstance(v, list) for v in values.values()):
            by_node: dict[str, dict[int, Any]] = {}
            for rank, (node, value) in values.items():
                by_node.setdefault(node, {})[rank] = value
            problems += [f"{name} on node {node}: {_by_rank(v)}" for node, v in by_node.items() if _by_rank(v, True)]
        elif _by_rank(values, True):
            problems.append(f"{name}: {_by_rank(values)}")
    if problems:
        raise CheckpointError(
            f"the ranks passed different arguments to {operation}: {'; '.join(problems)} (every rank of the group "
            "must pass the same)"
        )


def _by_rank(values: dict[int, Any], differ: bool = False) -> str:
    """``True on rank 0, False on ranks 1, 2``: the ranks of each value; with ``differ``, "" when every rank
    passed the same value."""
    ranks: dict[str, tuple[Any, list[int]]] = {}
    for rank, value in sorted(values.items()):
        ranks.setdefault(json.dumps(value, sort_keys=True), (value, []))[1].append(rank)
    if differ and len(ranks) < 2:
        return ""
    return ", ".join(
        f"{value!r} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for value, r in ranks.values()
    )


def count_argument(owner: str, name: str, value: object) -> int:
    """``value`` when it is an integer of at least 1 (a bool is not a count); else a ValueError naming ``owner``
    and ``name``, raised where it was passed (on that rank), as the option objects report a bad value."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be an integer of at least 1, got {value!r}")
    return value


def node_size_argument(owner: str, node_size: object) -> int:
    """Ranks per node: ``node_size`` where given, else the launcher's ``LOCAL_WORLD_SIZE``, else 1 (a tier that keeps
    copies on other nodes, or files on each node's disk, needs it); checked by :func:`count_argument`."""
    if node_size is not None:
        return count_argument(owner, "node_size", node_size)
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    given: object = int(local) if local.strip().isdigit() else local
    return count_argument(owner, "node_size (LOCAL_WORLD_SIZE, from the launcher's environment)", given)
