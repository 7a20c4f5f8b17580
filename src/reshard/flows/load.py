"""``reshard.load``: fill a template state dict of the current layout from a checkpoint of any layout.

Flow (each phase ends in agreement):

1. the coordinator reads and validates ``metadata.json`` and broadcasts it: no other rank reads it;
2. each rank matches its template against the metadata and plans its reads: for every target box, the
   overlaps with the saved boxes and the byte runs that hold them;
3. each rank reads those bytes (:mod:`reshard.io.reader`), straight into the destination tensor when the
   overlap is one contiguous run of the same dtype, otherwise through a reused buffer (or a mapping of a
   local file) and one strided copy; every checksum chunk a read touches is read whole and verified on the
   bytes used, so no byte a load returns is unverified.

With ``LoadOptions(read_once=...)`` in effect, step 2 gathers every rank's target boxes on the coordinator,
which schedules who reads which part (:mod:`reshard.io.exchange`); after step 3 agreed that every rank's reads
succeeded, a fourth step sends the bytes several ranks need from their reader to the others.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from reshard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    MismatchError,
)
from reshard.flows.collector import collector_paused
from reshard.flows.options import LoadOptions, check_terms, load_terms
from reshard.flows.stats import EXCHANGE, PhaseClock
from reshard.geometry.boxes import Box
from reshard.io.exchange import (
    MIN_SLAB_BYTES,
    ExchangeCounters,
    RankSchedule,
    cell_view,
    describe_need,
    run_exchange,
    schedule_reads,
)
from reshard.io.reader import ReadBudget, ReadExecutor
from reshard.io.sources import CheckpointSource, as_source, read_metadata_bytes
from reshard.io.staging import StagedFiles, node_id, stage_files
from reshard.metadata import METADATA_FILE, Metadata, SavedObject
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.planning.load_plan import DEFAULT_MAX_READ_AMPLIFICATION, LoadPlan, TargetPiece, check_template, plan_load
from reshard.state.codec import decode_object_blob
from reshard.state.dtypes import dtype_name
from reshard.state.fingerprint import fingerprint
from reshard.state.sharding import LocalPiece, ShardedObject, ShardedTensor
from reshard.state.statedict import FlatStateDict, flatten_state_dict, is_empty_container, map_leaves
from reshard.storage import CheckpointLocation, storage_for

__all__ = ["LoadStats", "load", "read_metadata"]

logger = logging.getLogger("reshard")


@dataclass
class LoadStats:
    """What one rank's load did, filled in by :func:`load` when passed as ``stats=``.

    Attributes:
        bytes_needed: bytes of saved tensor data that this rank's targets cover.
        bytes_read: bytes of tensor data actually read (>= needed: strided runs merged into larger reads).
        read_requests: number of read calls issued for tensor data.
        bytes_verified: bytes whose checksum was verified.
        bytes_verify_extra: bytes read (or, for mapped local files, checksummed) beyond the planned reads,
            to verify the whole chunks that the reads touch (not counted in ``bytes_read``).
        bytes_direct: bytes read straight into their destination tensor (no intermediate copy), or, for a
            destination in GPU memory, into its pinned host proxy (one copy to the device, no other).
        bytes_to_device: bytes copied from pinned host proxies into destinations in GPU memory (on a side
            stream, overlapped with the reads; docs/concepts.md, "GPU memory").
        bytes_from_peers, bytes_to_peers: with ``LoadOptions(read_once=...)`` in effect, the bytes this rank
            received from the ranks that read them, and sent to the ranks that needed what it read (its own
            reads are in ``bytes_read``; over all ranks, storage sees each needed byte once).
        exchange_rounds: the rounds that exchange took (the same on every rank; 0 without one).
        files_downloaded, bytes_downloaded: with staging, the whole data files this rank downloaded for its
            node (each file needed by a node is downloaded by exactly one of its ranks).
        files_reused: with staging, complete files found in the staging directory and reused.
        seconds_metadata: reading and validating ``metadata.json`` (on the coordinator) or decoding the
            broadcast copy (on the others).
        seconds_plan: flattening the template, checking it against the metadata and planning the reads.
        seconds_stage: with staging, agreeing on and downloading this node's files (collectives included).
        seconds_read: reading, verifying and copying this rank's data into place.
        seconds_verify: with ``LoadOptions(verify=True)``, the end-to-end fingerprint check (collectives included).
        seconds_exchange: time in the other collectives beyond this rank's own work (the metadata
            broadcast, waiting for the slowest rank at the end of each phase).
        seconds: wall time of the whole load on this rank (at least the sum of the phases).
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    read_requests: int = 0
    bytes_verified: int = 0
    bytes_verify_extra: int = 0
    bytes_direct: int = 0
    bytes_to_device: int = 0
    bytes_from_peers: int = 0
    bytes_to_peers: int = 0
    exchange_rounds: int = 0
    files_downloaded: int = 0
    bytes_downloaded: int = 0
    files_reused: int = 0
    seconds_metadata: float = 0.0
    seconds_plan: float = 0.0
    seconds_stage: float = 0.0
    seconds_read: float = 0.0
    seconds_verify: float = 0.0
    seconds_exchange: float = 0.0
    seconds: float = 0.0

    @property
    def throughput(self) -> float:
        """bytes_read / seconds, in bytes per second (0.0 for an instant load)."""
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    @property
    def read_amplification(self) -> float:
        """bytes_read / bytes_needed (1.0 when nothing was needed)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def read_metadata(path: CheckpointLocation, *, storage_options: dict[str, Any] | None = None) -> Metadata:
    """Read and validate a checkpoint's metadata (tensors, dtypes, shapes, boxes, files, common state)
    without reading any tensor data. Not collective. ``path`` is a directory, URL or Storage."""
    storage = storage_for(path, storage_options)
    try:
        return Metadata.from_json_bytes(read_metadata_bytes(storage), where=storage.describe(METADATA_FILE))
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
    started = time.perf_counter()
    options = options if options is not None else LoadOptions()
    comm = Communicator(group, timeout=timeout)
    opened = as_source(source, storage_options)
    try:
        with collector_paused():
            return _load_from(opened, state_dict, comm, strict=strict, stats=stats, options=options, started=started)
    finally:
        if opened is not source:
            opened.close()


def _load_from(
    source: CheckpointSource,
    state_dict: Any,
    comm: Communicator,
    *,
    strict: bool,
    stats: LoadStats | None,
    options: LoadOptions,
    started: float,
) -> Any:
    """The body of :func:`load` once the source is open."""
    clock = PhaseClock("load", comm.rank, started)
    storage = source.storage
    metadata_holder: list[tuple[bytes, Metadata]] = []

    mine = _arguments(source, comm, strict=strict, options=options)

    def read_on_coordinator() -> dict[str, Any]:
        if comm.is_coordinator:
            metadata_holder.append(source.read_metadata())
        return mine

    # Only the coordinator reads the metadata (metadata.json, or the safetensors headers); the others get
    # the bytes it validated. The ranks' arguments are agreed on in the same step.
    with clock.exchange():
        agreed = comm.step("reading metadata", clock.timed("metadata", read_on_coordinator), _agreed_arguments)
        raw = comm.broadcast_bytes(metadata_holder[0][0] if comm.is_coordinator else None)
    with clock.phase("metadata"):
        metadata = metadata_holder[0][1] if comm.is_coordinator else source.decode_metadata(raw)

    flat = FlatStateDict()
    plan_holder: list[LoadPlan] = []
    missing: list[str] = []
    pieces: list[LocalPiece] = []
    keys: list[str] = []  # the key of each piece
    # Read once per replica group: the reads are planned after the coordinator's schedule says who reads what.
    read_once = bool(agreed["read_once"])
    read_views: list[torch.Tensor] = []
    read_boxes: list[Box] = []

    def on_device() -> bool:
        """Whether some of this rank's reads land outside host memory (GPU tensors: read through proxies)."""
        return any(view.device.type != "cpu" for view in read_views)

    def plan_reads(targets: list[TargetPiece]) -> None:
        # Staged loads read local copies; otherwise the storage says what a request costs.
        request_cost = 0 if options.staging is not None else storage.request_cost_bytes
        amplification = options.max_read_amplification
        if amplification is None and request_cost == 0:
            amplification = DEFAULT_MAX_READ_AMPLIFICATION
        plan_holder.append(
            plan_load(
                metadata,
                targets,
                max_read_amplification=amplification,
                max_read_bytes=ReadBudget.of(options.memory_budget_bytes, device=on_device()).max_read_bytes,
                request_cost_bytes=request_cost,
            )
        )

    def flatten() -> None:
        template = flatten_state_dict(state_dict, rank=comm.rank, dedup=False)
        missing.extend(
            check_template(
                template,
                metadata,
                strict=strict,
                allow_dtype_cast=options.allow_dtype_cast,
                allow_lossy_cast=options.allow_lossy_cast,
            )
        )
        flat.tensors, flat.objects = template.tensors, template.objects
        for tensor in flat.tensors:
            for piece in tensor.pieces():
                pieces.append(piece)
                keys.append(tensor.key)

    def plan_own_pieces() -> None:
        """Every piece read by this rank itself, as a plain load reads it."""
        read_views.extend(p.view for p in pieces)
        read_boxes.extend(p.box for p in pieces)
        plan_reads([TargetPiece(key=key, box=piece.box) for key, piece in zip(keys, pieces, strict=True)])

    def plan() -> list[str] | None:
        flatten()
        plan_own_pieces()
        # Sources that refuse unused entries (safetensors) need every rank's keys: a rank holds one stage.
        return sorted(set(keys)) if source.refuses_unused else None

    def check_unused(keys_per_rank: list[list[str] | None]) -> None:
        """On the coordinator: the source's entries no rank's template uses, an error where it refuses them."""
        if not source.refuses_unused:
            return
        unused = source.unused_entries({key for keys in keys_per_rank for key in keys or ()})
        if unused:
            shown = ", ".join(repr(name) for name in unused[:20])
            raise MismatchError(
                f"{source.describe()}: {len(unused)} tensors of the source are used by no template key of this "
                f"load: {shown}{' ...' if len(unused) > 20 else ''} (a key map that does not fit the checkpoint? "
                "pass allow_unused=True to the source to load a part of it)"
            )

    schedule: RankSchedule | None = None
    with clock.exchange():
        if not read_once:
            comm.step("load planning", clock.timed("plan", plan), check_unused)
        else:

            def needs() -> bytes:
                flatten()
                described = [describe_need(key, piece) for key, piece in zip(keys, pieces, strict=True)]
                return json.dumps({"keys": sorted(set(keys)), "needs": described}).encode()

            def schedule_all(payloads: list[bytes]) -> tuple[bool, list[bytes]]:
                docs = [json.loads(p) for p in payloads]
                check_unused([d["keys"] if source.refuses_unused else None for d in docs])
                schedules = schedule_reads(
                    [d["needs"] for d in docs],
                    round_bytes=_round_bytes(int(agreed["budget"])),
                    min_slab_bytes=max(MIN_SLAB_BYTES, metadata.checksum_chunk_bytes),
                )
                return any(s.shared for s in schedules), [json.dumps(s.to_json()).encode() for s in schedules]

            shared, reply = comm.step_scatter("load planning", clock.timed("plan", needs), schedule_all)
            schedule = RankSchedule.from_json(json.loads(reply)) if shared else None
            with clock.phase("plan"):
                if schedule is None:  # nothing is needed by more than one rank
                    plan_own_pieces()
                else:
                    targets = []
                    for ref in schedule.reads:
                        box = Box(tuple(ref[1]), tuple(ref[2]))
                        targets.append(TargetPiece(key=keys[ref[0]], box=box))
                        read_views.append(cell_view(pieces, ref))
                        read_boxes.append(box)
                    plan_reads(targets)
    if missing:
        warnings.warn(
            f"reshard.load(strict=False): {len(missing)} entries are not in the checkpoint and were left as "
            f"they are: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}",
            stacklevel=3,
        )
    load_plan = plan_holder[0]
    staged: StagedFiles | None = None
    staging = options.staging
    if staging is not None:
        needed = {item.file for item in load_plan.items}
        for obj in flat.objects:
            needed.update(e.file for e in metadata.objects[obj.key].entries if e.offset == obj.global_offset)
        with clock.phase("stage"):
            staged = stage_files(comm, storage, metadata, needed, staging.path, staging.node_group)
    executor = ReadExecutor(
        staged.storage if staged is not None else storage,
        staged.metadata if staged is not None else metadata,
        memory_budget_bytes=options.memory_budget_bytes,
        device=on_device(),
    )
    loaded_objects: dict[tuple[str, tuple[int, ...]], object] = {}

    def read() -> None:
        with torch.no_grad():
            for piece in pieces:
                if piece.padded_view is not None:
                    piece.zero_padding()
        try:
            executor.run(load_plan, read_views, read_boxes)
            for obj in flat.objects:
                loaded_objects[(obj.key, obj.global_offset)] = _read_object(executor, metadata, obj)
        finally:
            executor.close()

    try:
        with clock.exchange():
            comm.step("reading data", clock.timed("read", read))
    finally:
        # Every rank of every node is done reading (or failed) once the step returns or raises.
        if staged is not None and staging is not None and not staging.keep:
            staged.remove()
    exchanged = ExchangeCounters()
    if schedule is not None:
        with clock.exchange():
            exchange = schedule

            def send_and_receive() -> None:
                run_exchange(comm.transport, exchange, pieces, exchanged)

            comm.step("exchanging data", clock.timed("read", send_and_receive))
    if options.verify:
        with clock.phase("verify"):
            _verify_fingerprints(comm, metadata, flat.tensors)

    def result_leaf(path: str, leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            return leaf.data
        if isinstance(leaf, ShardedObject):
            return loaded_objects.get((leaf.key, leaf.global_offset), leaf.value)
        if isinstance(leaf, torch.Tensor) or is_empty_container(leaf):
            return leaf
        return metadata.common.get(path, leaf)

    result = map_leaves(state_dict, result_leaf)
    if stats is not None:
        stats.bytes_needed = (
            load_plan.bytes_needed
            if schedule is None
            else sum(p.box.volume * metadata.tensors[k].torch_dtype.itemsize for k, p in zip(keys, pieces, strict=True))
        )
        stats.bytes_from_peers = exchanged.bytes_received
        stats.bytes_to_peers = exchanged.bytes_sent
        stats.exchange_rounds = len(schedule.rounds) if schedule is not None else 0
        stats.bytes_read = load_plan.bytes_read
        stats.read_requests = load_plan.requests
        stats.bytes_verified = executor.bytes_verified
        stats.bytes_direct = executor.bytes_direct
        stats.bytes_to_device = executor.bytes_to_device
        stats.bytes_verify_extra = executor.bytes_verify_extra
        if staged is not None:
            stats.files_downloaded = len(staged.downloaded)
            stats.bytes_downloaded = staged.bytes_downloaded
            stats.files_reused = len(staged.reused)
        stats.seconds_metadata = clock.get("metadata")
        stats.seconds_plan = clock.get("plan")
        stats.seconds_stage = clock.get("stage")
        stats.seconds_read = clock.get("read")
        stats.seconds_verify = clock.get("verify")
        stats.seconds_exchange = clock.get(EXCHANGE)
        stats.seconds = clock.elapsed()
    seconds = clock.elapsed()
    logger.info(
        "[rank=%d] loaded %s in %.3f s (%s): %d bytes needed, %d read in %d requests (%.1f MB/s)",
        comm.rank,
        storage.describe(),
        seconds,
        clock.summary(),
        load_plan.bytes_needed,
        load_plan.bytes_read,
        load_plan.requests,
        load_plan.bytes_read / seconds / 1e6 if seconds > 0 else 0.0,
    )
    return result


def _arguments(source: CheckpointSource, comm: Communicator, *, strict: bool, options: LoadOptions) -> dict[str, Any]:
    """What this rank's load sends the coordinator in its first step: the arguments every rank must pass alike
    (:func:`~reshard.flows.options.load_terms`), whether its storage wants to read once, and its memory budget."""
    node = node_id(options.staging.node_group) if options.staging is not None else ""
    kind = type(source).__name__ + (" refusing unused entries" if source.refuses_unused else "")
    return {
        "terms": load_terms(options, strict=strict, source=kind, node=node),
        "read_once": _read_once_wanted(options, comm, source.storage.request_cost_bytes),
        "budget": options.memory_budget_bytes,
    }


def _agreed_arguments(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """On the coordinator: the arguments agree; read once where any rank's storage wants it, and exchange
    within the smallest budget of the group."""
    check_terms([d["terms"] for d in docs], "reshard.load")
    return {"read_once": any(d["read_once"] for d in docs), "budget": min(d["budget"] for d in docs)}


def _read_once_wanted(options: LoadOptions, comm: Communicator, request_cost_bytes: int) -> bool:
    """Whether this load reads once per replica group: on request, or by default where a storage request is
    costly (object stores) and several ranks load together; never with node-local staging, which already
    downloads each file once per node."""
    if comm.size == 1 or options.staging is not None or options.read_once is False:
        return False
    return options.read_once is True or request_cost_bytes > 0


def _round_bytes(memory_budget_bytes: int) -> int:
    """The most bytes a rank sends (or receives) in one round of the exchange: half the (smallest) memory
    budget, since the send and the receive buffer live together (the read buffers are released by then)."""
    return max(4096, memory_budget_bytes // 2)


def _verify_fingerprints(comm: Communicator, metadata: Metadata, tensors: list[ShardedTensor]) -> None:
    """The end-to-end check of ``LoadOptions(verify=True)``: a collective step; see :func:`load`."""

    def partial() -> dict[str, list[int]]:
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

    def check(parts: list[dict[str, list[int]]]) -> list[str]:
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

    uncovered = comm.step("verifying", partial, check)
    if uncovered:
        warnings.warn(
            "reshard.load(LoadOptions(verify=True)): not checked, the template's primary boxes do not cover "
            f"them whole: "
            f"{', '.join(uncovered[:20])}",
            stacklevel=4,
        )


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
