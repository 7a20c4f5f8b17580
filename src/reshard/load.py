"""``reshard.load``: fill a template state dict of the current layout from a checkpoint of any layout.

Flow (each phase ends in agreement):

1. the coordinator reads and validates ``metadata.json`` and broadcasts it: no other rank reads it;
2. each rank matches its template against the metadata and plans its reads: for every target box, the
   overlaps with the saved boxes and the byte runs that hold them;
3. each rank reads those bytes (:mod:`reshard.io.reader`), straight into the destination tensor when the
   overlap is one contiguous run of the same dtype, otherwise through a reused buffer (or a mapping of a
   local file) and one strided copy; every checksum chunk a read touches is read whole and verified on the
   bytes used, so no byte a load returns is unverified.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from reshard.codec import decode_object_blob
from reshard.comm import Communicator
from reshard.dtypes import dtype_name
from reshard.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MismatchError,
    StateDictError,
    StorageError,
)
from reshard.fingerprint import fingerprint
from reshard.io.reader import DEFAULT_READ_BUFFER_BYTES, ReadExecutor
from reshard.locking import read_lock
from reshard.metadata import DATA_DIR, MAX_METADATA_BYTES, METADATA_FILE, Metadata, SavedObject
from reshard.planning.load_plan import DEFAULT_MAX_READ_AMPLIFICATION, LoadPlan, TargetPiece, plan_load
from reshard.sharding import LocalPiece, ShardedObject, ShardedTensor
from reshard.staging import StagedFiles, stage_files
from reshard.statedict import FlatStateDict, flatten_state_dict, map_leaves
from reshard.stats import EXCHANGE, PhaseClock
from reshard.storage import CheckpointLocation, FileTooLargeError, Storage, storage_for

if TYPE_CHECKING:
    from reshard.interop.hf_source import KeyMap

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
        bytes_direct: bytes read straight into their destination tensor (no intermediate copy).
        files_downloaded, bytes_downloaded: with staging, the whole data files this rank downloaded for its
            node (each file needed by a node is downloaded by exactly one of its ranks).
        files_reused: with staging, complete files found in the staging directory and reused.
        seconds_metadata: reading and validating ``metadata.json`` (on the coordinator) or decoding the
            broadcast copy (on the others).
        seconds_plan: flattening the template, checking it against the metadata and planning the reads.
        seconds_stage: with staging, agreeing on and downloading this node's files (collectives included).
        seconds_read: reading, verifying and copying this rank's data into place.
        seconds_verify: with ``verify=True``, the end-to-end fingerprint check (collectives included).
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


def read_metadata_bytes(storage: Storage) -> bytes:
    """The raw ``metadata.json`` of a checkpoint, or the error that says why there is none.

    Raises:
        CheckpointNotFoundError: the path does not exist, or is not a checkpoint.
        IncompleteCheckpointError: data files but no ``metadata.json`` (a save that never committed).
        CorruptCheckpointError: ``metadata.json`` is larger than :data:`~reshard.metadata.MAX_METADATA_BYTES`.
        StorageError: the file exists but cannot be read.
    """
    where = storage.describe()
    try:
        return storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{where} is a file, not a checkpoint directory") from None
    except FileTooLargeError as exc:
        raise CorruptCheckpointError(
            f"{storage.describe(METADATA_FILE)} is too large to be metadata ({exc.strerror}); refused unread"
        ) from exc
    except OSError as exc:
        raise StorageError(f"cannot read {storage.describe(METADATA_FILE)}: {exc}") from exc
    try:
        exists = storage.root_exists()
        holder = read_lock(storage) if exists else None
        has_data = exists and (bool(storage.list_files(DATA_DIR)) or storage.exists(DATA_DIR))
    except OSError as exc:
        raise StorageError(f"{where} has no {METADATA_FILE}, and looking for its data failed: {exc}") from exc
    if not exists:
        raise CheckpointNotFoundError(f"no checkpoint at {where}: the path does not exist")
    if holder is not None:
        raise IncompleteCheckpointError(
            f"{where} has no {METADATA_FILE}: a save is writing it or was interrupted "
            f"(lock held by {holder.describe()})"
        )
    if has_data:
        raise IncompleteCheckpointError(
            f"{where} holds data files but no {METADATA_FILE}: a save that was interrupted before it committed"
        )
    raise CheckpointNotFoundError(f"{where} is not a reshard checkpoint: it has no {METADATA_FILE}")


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
    path: CheckpointLocation,
    *,
    group: dist.ProcessGroup | None = None,
    strict: bool = True,
    timeout: datetime.timedelta | float | None = None,
    stats: LoadStats | None = None,
    allow_dtype_cast: bool = True,
    max_read_amplification: float = DEFAULT_MAX_READ_AMPLIFICATION,
    read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES,
    storage_options: dict[str, Any] | None = None,
    staging_dir: str | os.PathLike[str] | None = None,
    keep_staged: bool = False,
    node_group: dist.ProcessGroup | None = None,
    verify: bool = False,
    key_map: KeyMap | None = None,
) -> Any:
    """Load a checkpoint into a template state dict of the current layout. Called by all ranks of ``group``.

    The template says what this rank needs: :class:`~reshard.ShardedTensor` leaves (any layout: other
    world size, split axes or offsets, segments, flat ranges or padding than the saving one), plain
    tensors (read whole), ShardedObjects and common values. Tensors are filled in place; padding past a
    template's ``logical_shape`` is set to zero.

    Args:
        state_dict: the template.
        path: the checkpoint: a directory, a ``file://``, ``s3://bucket/prefix`` or ``gs://bucket/prefix``
            URL, or a :class:`~reshard.storage.Storage`.
        group: the ranks that load together (``None``: default group, or this process alone).
        strict: when True, keys of the template missing from the checkpoint raise
            :class:`~reshard.MismatchError`; when False they are skipped (left as they are) with a warning.
        timeout: how long any collective may wait for the slowest rank.
        stats: if given, filled with this rank's read accounting.
        allow_dtype_cast: convert saved elements to the template's dtype while copying (bf16 <-> fp32,
            fp16 -> fp32, ...); when False a dtype difference raises :class:`~reshard.MismatchError`.
        max_read_amplification: bytes read / bytes needed allowed when merging strided runs into larger
            reads (at least 1.0).
        read_buffer_bytes: the staging memory of this rank's reads that cannot land directly in their
            destination (strided overlaps, dtype conversions); reads are planned in pieces of at most
            this size, so a load's extra memory stays bounded by it whatever the tensor sizes.
        storage_options: passed to the object-store client (see :func:`reshard.save`).
        staging_dir: load through node-local staging: the ranks of each node agree on the whole data
            files any of them needs, each file is downloaded once per node into this directory (a temp
            name, then renamed; complete files from an earlier run are reused after checking their size
            and checksums), and all reads are then local. For storage that is slow to range-read.
        keep_staged: keep the staged files after the load (they are removed by default).
        node_group: with ``staging_dir``, the process group of the ranks that share this node's staging
            directory; default: the ranks with the same hostname.
        verify: after reading, recompute every tensor's content fingerprint over the primary boxes of this
            layout, combine the partial sums across ranks and compare them with the fingerprints the save
            stored (``save(..., fingerprint=True)``): a wrong copy, a planner bug or corruption a chunk
            checksum missed raises CorruptCheckpointError naming the tensor, on every rank. Tensors the
            template does not cover whole, or loads with a dtype conversion, cannot be checked (a warning
            names them).
        key_map: for a Hugging Face safetensors source (a directory with ``model.safetensors`` or
            ``model.safetensors.index.json`` instead of a reshard checkpoint): template key -> source, a
            tensor name, or :class:`~reshard.interop.hf_source.Concat` / ``Stack`` of several (fused QKV,
            GLU, stacked experts). Keys it does not name are looked up under their own name. Each rank
            reads only the bytes of its boxes; safetensors has no checksums, so nothing is verified.

    Returns:
        A state dict of the template's structure in which each ShardedTensor is replaced by its filled
        local tensor, each ShardedObject by its saved value and each common value by the saved one.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError: nothing loadable at ``path``.
        MismatchError: missing keys (with ``strict``), a (logical) global shape that differs, or a dtype
            that differs when ``allow_dtype_cast`` is off.
        CorruptCheckpointError: invalid metadata, a checksum mismatch, a truncated or missing file.
        CheckpointError: any failure, raised on every rank and naming the failing ranks.
    """
    if max_read_amplification < 1.0:
        raise ValueError(f"max_read_amplification must be at least 1.0, got {max_read_amplification}")
    started = time.perf_counter()
    comm = Communicator(group, timeout=timeout)
    storage = storage_for(path, storage_options)
    try:
        return _load_from(
            storage,
            state_dict,
            comm,
            strict=strict,
            stats=stats,
            allow_dtype_cast=allow_dtype_cast,
            max_read_amplification=max_read_amplification,
            read_buffer_bytes=read_buffer_bytes,
            verify=verify,
            key_map=key_map,
            started=started,
            staging=_StagingOptions(Path(staging_dir), keep_staged, node_group) if staging_dir is not None else None,
        )
    finally:
        if storage is not path:
            storage.close()


@dataclass(frozen=True, slots=True)
class _StagingOptions:
    directory: Path
    keep: bool
    node_group: dist.ProcessGroup | None


def _load_from(
    storage: Storage,
    state_dict: Any,
    comm: Communicator,
    *,
    strict: bool,
    stats: LoadStats | None,
    allow_dtype_cast: bool,
    max_read_amplification: float,
    read_buffer_bytes: int,
    verify: bool,
    key_map: KeyMap | None,
    started: float,
    staging: _StagingOptions | None,
) -> Any:
    """The body of :func:`load` once the storage is open."""
    from reshard.interop.hf_source import describe_source, is_safetensors_source, source_metadata

    clock = PhaseClock("load", comm.rank, started)
    metadata_holder: list[tuple[bytes, Metadata]] = []

    def read_on_coordinator() -> bool:
        if comm.is_coordinator:
            if not storage.exists(METADATA_FILE) and is_safetensors_source(storage):
                source = describe_source(storage)
                metadata_holder.append((json.dumps(source).encode(), source_metadata(source, key_map)))
                return True
            if key_map is not None:
                raise StateDictError("key_map applies to Hugging Face safetensors sources, not to reshard checkpoints")
            raw = read_metadata_bytes(storage)
            metadata_holder.append((raw, Metadata.from_json_bytes(raw, where=storage.describe(METADATA_FILE))))
        return False

    # Only the coordinator touches metadata.json (or the safetensors headers); the others get the bytes
    # it validated.
    with clock.exchange():
        from_safetensors = comm.step("reading metadata", clock.timed("metadata", read_on_coordinator), lambda r: r[0])
        raw = comm.broadcast_bytes(metadata_holder[0][0] if comm.is_coordinator else None)
    with clock.phase("metadata"):
        if comm.is_coordinator:
            metadata = metadata_holder[0][1]
        elif from_safetensors:
            metadata = source_metadata(json.loads(raw), key_map)
        else:
            # The coordinator validated these bytes: each rank decodes only the packed tensors it loads.
            metadata = Metadata.from_json_bytes(raw, lazy=True)

    flat = FlatStateDict()
    plan_holder: list[LoadPlan] = []
    missing: list[str] = []
    pieces: list[LocalPiece] = []

    def plan() -> None:
        template = flatten_state_dict(state_dict, rank=comm.rank, dedup=False)
        missing.extend(_check_template(template, metadata, strict=strict, allow_dtype_cast=allow_dtype_cast))
        flat.tensors, flat.objects = template.tensors, template.objects
        targets = []
        for tensor in flat.tensors:
            for piece in tensor.pieces():
                pieces.append(piece)
                targets.append(TargetPiece(key=tensor.key, box=piece.box))
        plan_holder.append(
            plan_load(
                metadata, targets, max_read_amplification=max_read_amplification, max_read_bytes=read_buffer_bytes
            )
        )

    with clock.exchange():
        comm.step("load planning", clock.timed("plan", plan))
    if missing:
        warnings.warn(
            f"reshard.load(strict=False): {len(missing)} entries are not in the checkpoint and were left as "
            f"they are: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}",
            stacklevel=3,
        )
    load_plan = plan_holder[0]
    staged: StagedFiles | None = None
    if staging is not None:
        needed = {item.file for item in load_plan.items}
        for obj in flat.objects:
            needed.update(e.file for e in metadata.objects[obj.key].entries if e.offset == obj.global_offset)
        with clock.phase("stage"):
            staged = stage_files(comm, storage, metadata, needed, staging.directory, staging.node_group)
    executor = ReadExecutor(staged.storage if staged is not None else storage, metadata, buffer_bytes=read_buffer_bytes)
    loaded_objects: dict[tuple[str, tuple[int, ...]], object] = {}

    def read() -> None:
        with torch.no_grad():
            for piece in pieces:
                if piece.padded_view is not None:
                    piece.padded_view.zero_()
        try:
            executor.run(load_plan, [p.view for p in pieces], [p.box for p in pieces])
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
    if verify:
        with clock.phase("verify"):
            _verify_fingerprints(comm, metadata, flat.tensors)

    def result_leaf(path: str, leaf: Any) -> Any:
        if isinstance(leaf, ShardedTensor):
            return leaf.data
        if isinstance(leaf, ShardedObject):
            return loaded_objects.get((leaf.key, leaf.global_offset), leaf.value)
        if isinstance(leaf, torch.Tensor):
            return leaf
        return metadata.common.get(path, leaf)

    result = map_leaves(state_dict, result_leaf)
    if stats is not None:
        stats.bytes_needed = load_plan.bytes_needed
        stats.bytes_read = load_plan.bytes_read
        stats.read_requests = load_plan.requests
        stats.bytes_verified = executor.bytes_verified
        stats.bytes_direct = executor.bytes_direct
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


def _verify_fingerprints(comm: Communicator, metadata: Metadata, tensors: list[ShardedTensor]) -> None:
    """The end-to-end check of ``load(verify=True)``: a collective step; see :func:`load`."""

    def partial() -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for tensor in tensors:
            saved = metadata.tensors[tensor.key]
            if not tensor.is_main_replica or dtype_name(tensor.data.dtype) != saved.dtype:
                continue
            if saved.fingerprint is None:
                raise CheckpointError(
                    f"verify=True: the checkpoint holds no fingerprint of {tensor.key!r}; save with fingerprint=True"
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
            f"reshard.load(verify=True): not checked, the template's primary boxes do not cover them whole: "
            f"{', '.join(uncovered[:20])}",
            stacklevel=4,
        )


def _check_template(flat: FlatStateDict, metadata: Metadata, *, strict: bool, allow_dtype_cast: bool) -> list[str]:
    """Compare the template with the checkpoint. Return the missing entries (when not strict) and drop
    them from ``flat.tensors`` and ``flat.objects``, so that only present entries are planned and read.

    Raises:
        MismatchError: a global shape or dtype differs (always), or entries are missing (with ``strict``).
    """
    missing: list[str] = []
    mismatches: list[str] = []
    present = []
    for st in flat.tensors:
        saved = metadata.tensors.get(st.key)
        if saved is None:
            missing.append(f"tensor {st.key!r}")
            continue
        if saved.global_shape != st.saved_shape:
            kind = "logical shape" if st.logical_shape is not None else "global shape"
            mismatches.append(
                f"tensor {st.key!r}: saved global shape {list(saved.global_shape)}, requested {kind} "
                f"{list(st.saved_shape)}"
            )
        elif saved.dtype != dtype_name(st.data.dtype) and not allow_dtype_cast:
            mismatches.append(
                f"tensor {st.key!r}: saved dtype {saved.dtype}, requested {dtype_name(st.data.dtype)} "
                "(allow_dtype_cast=False)"
            )
        present.append(st)
    present_objects = []
    for obj in flat.objects:
        saved_obj = metadata.objects.get(obj.key)
        if saved_obj is not None and saved_obj.global_shape != obj.global_shape:
            mismatches.append(
                f"object {obj.key!r}: saved grid {list(saved_obj.global_shape)}, requested {list(obj.global_shape)}"
            )
        elif saved_obj is None or not any(e.offset == obj.global_offset for e in saved_obj.entries):
            missing.append(f"object {obj.key!r} at {list(obj.global_offset)}")
        else:
            present_objects.append(obj)
    for path in flat.common:
        if path not in metadata.common:
            missing.append(f"common value {path!r}")
    if mismatches:
        raise MismatchError("the checkpoint does not match the template: " + "; ".join(mismatches))
    if missing and strict:
        raise MismatchError(
            f"{len(missing)} entries of the template are missing from the checkpoint: "
            + ", ".join(missing[:50])
            + (" ..." if len(missing) > 50 else "")
        )
    flat.tensors = present
    flat.objects = present_objects
    return missing


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
