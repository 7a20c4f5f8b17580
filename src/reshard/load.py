"""``reshard.load``: fill a template state dict of the current layout from a checkpoint of any layout.

Flow (each phase ends in agreement):

1. the coordinator reads and validates ``metadata.json`` and broadcasts it: no other rank reads it;
2. each rank matches its template against the metadata and plans its reads: for every target box, the
   overlaps with the saved boxes and the byte runs that hold them;
3. each rank reads only those bytes, straight into the destination tensor when the overlap is one
   contiguous run of the same dtype, otherwise through a reused buffer and one strided copy; every
   checksum chunk that a read covers whole is verified.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from reshard.boxes import Box
from reshard.codec import decode_object_blob
from reshard.comm import Communicator
from reshard.dtypes import byte_view, dtype_name
from reshard.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MismatchError,
    StorageError,
)
from reshard.metadata import DATA_DIR, METADATA_FILE, Metadata, SavedObject
from reshard.planning.load_plan import DEFAULT_MAX_READ_AMPLIFICATION, LoadPlan, ReadItem, TargetPiece, plan_load
from reshard.sharding import LocalPiece, ShardedObject, ShardedTensor
from reshard.statedict import FlatStateDict, flatten_state_dict, map_leaves
from reshard.storage import FileReader, Storage, storage_for

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
        seconds: wall time of the whole load on this rank.
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    read_requests: int = 0
    bytes_verified: int = 0
    seconds: float = 0.0

    @property
    def read_amplification(self) -> float:
        """bytes_read / bytes_needed (1.0 when nothing was needed)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


def read_metadata_bytes(storage: Storage) -> bytes:
    """The raw ``metadata.json`` of a checkpoint, or the error that says why there is none.

    Raises:
        CheckpointNotFoundError: the path does not exist, or is not a checkpoint.
        IncompleteCheckpointError: data files but no ``metadata.json`` (a save that never committed).
        StorageError: the file exists but cannot be read.
    """
    where = storage.describe()
    try:
        return storage.read_bytes(METADATA_FILE)
    except FileNotFoundError:
        pass
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{where} is a file, not a checkpoint directory") from None
    except OSError as exc:
        raise StorageError(f"cannot read {storage.describe(METADATA_FILE)}: {exc}") from exc
    if not storage.root_exists():
        raise CheckpointNotFoundError(f"no checkpoint at {where}: the path does not exist")
    if storage.list_files(DATA_DIR):
        raise IncompleteCheckpointError(
            f"{where} holds data files but no {METADATA_FILE}: a save that was interrupted before it committed"
        )
    raise CheckpointNotFoundError(f"{where} is not a reshard checkpoint: it has no {METADATA_FILE}")


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """Read and validate a checkpoint's metadata (tensors, dtypes, shapes, boxes, files, common state)
    without reading any tensor data. Not collective."""
    storage = storage_for(path)
    return Metadata.from_json_bytes(read_metadata_bytes(storage), where=storage.describe(METADATA_FILE))


def load(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None = None,
    strict: bool = True,
    timeout: datetime.timedelta | float | None = None,
    stats: LoadStats | None = None,
    allow_dtype_cast: bool = True,
    max_read_amplification: float = DEFAULT_MAX_READ_AMPLIFICATION,
) -> Any:
    """Load a checkpoint into a template state dict of the current layout. Called by all ranks of ``group``.

    The template says what this rank needs: :class:`~reshard.ShardedTensor` leaves (any layout: other
    world size, split axes or offsets, segments, flat ranges or padding than the saving one), plain
    tensors (read whole), ShardedObjects and common values. Tensors are filled in place; padding past a
    template's ``logical_shape`` is set to zero.

    Args:
        state_dict: the template.
        path: the checkpoint directory.
        group: the ranks that load together (``None``: default group, or this process alone).
        strict: when True, keys of the template missing from the checkpoint raise
            :class:`~reshard.MismatchError`; when False they are skipped (left as they are) with a warning.
        timeout: how long any collective may wait for the slowest rank.
        stats: if given, filled with this rank's read accounting.
        allow_dtype_cast: convert saved elements to the template's dtype while copying (bf16 <-> fp32,
            fp16 -> fp32, ...); when False a dtype difference raises :class:`~reshard.MismatchError`.
        max_read_amplification: bytes read / bytes needed allowed when merging strided runs into larger
            reads (at least 1.0).

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
    storage = storage_for(path)
    metadata_holder: list[tuple[bytes, Metadata]] = []

    def read_on_coordinator() -> None:
        if comm.is_coordinator:
            raw = read_metadata_bytes(storage)
            metadata_holder.append((raw, Metadata.from_json_bytes(raw, where=storage.describe(METADATA_FILE))))

    # Only the coordinator touches metadata.json; the others get the bytes it validated.
    comm.step("reading metadata", read_on_coordinator)
    raw = comm.broadcast_bytes(metadata_holder[0][0] if comm.is_coordinator else None)
    metadata = metadata_holder[0][1] if comm.is_coordinator else Metadata.from_json_bytes(raw)

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
        plan_holder.append(plan_load(metadata, targets, max_read_amplification=max_read_amplification))

    comm.step("load planning", plan)
    if missing:
        warnings.warn(
            f"reshard.load(strict=False): {len(missing)} entries are not in the checkpoint and were left as "
            f"they are: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}",
            stacklevel=2,
        )
    executor = _ReadExecutor(storage, metadata)
    loaded_objects: dict[tuple[str, tuple[int, ...]], object] = {}

    def read() -> None:
        try:
            with torch.no_grad():
                for piece in pieces:
                    if piece.padded_view is not None:
                        piece.padded_view.zero_()
            executor.run(plan_holder[0], [p.view for p in pieces], [p.box for p in pieces])
            for obj in flat.objects:
                loaded_objects[(obj.key, obj.global_offset)] = executor.read_object(obj)
        finally:
            executor.close()

    comm.step("reading data", read)

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
        stats.bytes_needed = plan_holder[0].bytes_needed
        stats.bytes_read = plan_holder[0].bytes_read
        stats.read_requests = plan_holder[0].requests
        stats.bytes_verified = executor.bytes_verified
        stats.seconds = time.perf_counter() - started
    logger.info(
        "[rank=%d] loaded %s: %d bytes needed, %d read in %d requests, %.3f s",
        comm.rank,
        storage.describe(),
        plan_holder[0].bytes_needed,
        plan_holder[0].bytes_read,
        plan_holder[0].requests,
        time.perf_counter() - started,
    )
    return result


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


class _ReadExecutor:
    """Performs one rank's reads: opens each data file once, reuses one staging buffer, verifies
    checksums of every chunk it reads whole. Single-threaded."""

    def __init__(self, storage: Storage, metadata: Metadata) -> None:
        self.storage = storage
        self.metadata = metadata
        self.readers: dict[int, FileReader] = {}
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.bytes_verified = 0

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()

    def _reader(self, file: int) -> FileReader:
        reader = self.readers.get(file)
        if reader is None:
            entry = self.metadata.files[file]
            where = self.storage.describe(entry.path)
            try:
                size = self.storage.size(entry.path)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"data file {where} is missing") from None
            except OSError as exc:
                raise StorageError(f"cannot open data file {where}: {exc}") from exc
            if size != entry.size:
                raise CorruptCheckpointError(
                    f"data file {where} has {size} bytes, the metadata says {entry.size}: it was truncated or altered"
                )
            try:
                reader = self.storage.open_reader(entry.path)
            except OSError as exc:
                raise StorageError(f"cannot open data file {where}: {exc}") from exc
            self.readers[file] = reader
        return reader

    def _staging(self, nbytes: int) -> torch.Tensor:
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes]

    def _read_exact(self, file: int, offset: int, out: memoryview, what: str) -> None:
        got = self._reader(file).read_into(offset, out)
        if got != len(out):
            path = self.storage.describe(self.metadata.files[file].path)
            raise CorruptCheckpointError(
                f"{what}: data file {path} is truncated: expected {len(out)} bytes at offset {offset}, got {got}"
            )

    def _check_chunk(self, expected: int, data: memoryview, file: int, file_offset: int, what: str) -> None:
        if crc32c.crc32c(data) != expected:
            path = self.storage.describe(self.metadata.files[file].path)
            raise CorruptCheckpointError(
                f"{what}: checksum mismatch in data file {path} at bytes [{file_offset}, {file_offset + len(data)})"
            )
        self.bytes_verified += len(data)

    def _verify_range(
        self,
        saved_checksums: tuple[int, ...],
        box_length: int,
        start: int,
        data: memoryview,
        file: int,
        box_offset: int,
        what: str,
    ) -> None:
        chunk = self.metadata.checksum_chunk_bytes
        end = start + len(data)
        for index in range(-(-start // chunk), len(saved_checksums)):
            lo = index * chunk
            hi = min(lo + chunk, box_length)
            if hi > end:
                break
            self._check_chunk(saved_checksums[index], data[lo - start : hi - start], file, box_offset + lo, what)

    def run(self, plan: LoadPlan, tensors: list[torch.Tensor], boxes: list[Box]) -> None:
        for item in plan.items:
            self._read_item(item, tensors[item.target], boxes[item.target])

    def _read_item(self, item: ReadItem, target: torch.Tensor, target_box: Box) -> None:
        saved = self.metadata.tensors[item.key].boxes[item.saved_index]
        dtype = self.metadata.tensors[item.key].torch_dtype
        what = f"tensor {item.key!r} box at {list(saved.offset)}"
        dest = target.detach()[item.overlap.relative_to(target_box)] if target.ndim else target.detach()
        pattern = item.pattern
        itemsize = item.itemsize
        span_bytes = pattern.span * itemsize
        direct = (
            pattern.count == 1
            and pattern.span == pattern.needed
            and dest.dtype == dtype
            and dest.device.type == "cpu"
            and dest.is_contiguous()
        )
        if direct:
            view = byte_view(dest)
            start = pattern.first * itemsize
            self._read_exact(saved.file, saved.byte_offset + start, view, what)
            self._verify_range(saved.checksums, saved.byte_length, start, view, saved.file, saved.byte_offset, what)
            return
        staging = self._staging(pattern.count * span_bytes)
        view = byte_view(staging)
        for i, first in enumerate(pattern.starts()):
            start = first * itemsize
            chunk = view[i * span_bytes : (i + 1) * span_bytes]
            self._read_exact(saved.file, saved.byte_offset + start, chunk, what)
            self._verify_range(saved.checksums, saved.byte_length, start, chunk, saved.file, saved.byte_offset, what)
        lead_strides: list[int] = []
        stride = pattern.span
        for size in reversed(pattern.lead_shape):
            lead_strides.insert(0, stride)
            stride *= size
        source = staging.view(dtype).as_strided(
            (*pattern.lead_shape, *pattern.inner_shape), (*lead_strides, *pattern.inner_strides)
        )
        with torch.no_grad():
            dest.copy_(source.reshape(dest.shape))

    def read_object(self, obj: ShardedObject) -> object:
        entry: SavedObject = next(e for e in self.metadata.objects[obj.key].entries if e.offset == obj.global_offset)
        what = f"object {obj.key!r} at {list(obj.global_offset)}"
        blob = bytearray(entry.byte_length)
        view = memoryview(blob)
        self._read_exact(entry.file, entry.byte_offset, view, what)
        self._verify_range(entry.checksums, entry.byte_length, 0, view, entry.file, entry.byte_offset, what)
        try:
            return decode_object_blob(view, where=what)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CorruptCheckpointError(f"{what}: cannot decode: {exc}") from exc
