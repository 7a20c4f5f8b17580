"""``reshard.save``: every rank writes its unique boxes once; the coordinator commits.

Flow (each phase ends in agreement, so a failure on any rank raises on every rank and nothing is
committed):

1. *describe*: each rank flattens its state dict into pieces (boxes, no data); the descriptions are
   gathered on the coordinator, which validates the global tiling, elects one writer per box and
   prepares the directory.
2. *write*: each elected rank writes its boxes, with CRC-32C checksums, into its own data file, whose
   name is unique to this save, and fsyncs it.
3. *commit*: the coordinator writes ``metadata.json`` atomically (temporary file, fsync, rename,
   directory fsync). Until then the directory holds no committed checkpoint from this save.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch
import torch.distributed as dist

from reshard._version import __version__
from reshard.boxes import Box
from reshard.codec import encode_object_blob, encode_tagged
from reshard.comm import Communicator
from reshard.dtypes import byte_view, dtype_name
from reshard.errors import CheckpointError, CheckpointExistsError, StorageError
from reshard.fingerprint import combine, fingerprint
from reshard.locking import acquire_lock, release_lock
from reshard.metadata import (
    DATA_DIR,
    METADATA_FILE,
    DataFile,
    Metadata,
    ObjectMetadata,
    SavedBox,
    SavedObject,
    TensorMetadata,
)
from reshard.planning.save_plan import LocalSaveDescription, ObjectPiece, TensorPiece, WriteAssignment, plan_save
from reshard.sharding import LocalPiece
from reshard.statedict import FlatStateDict, flatten_state_dict
from reshard.stats import PhaseClock, SaveStats, fill_save_stats
from reshard.storage import CheckpointLocation, FileWriter, Storage, storage_for

__all__ = ["DEFAULT_CHECKSUM_CHUNK_BYTES", "save"]

logger = logging.getLogger("reshard")

DEFAULT_CHECKSUM_CHUNK_BYTES = 4 * 1024 * 1024
"""Stored bytes are checksummed in pieces of this size, so a partial read can verify what it touches."""

_ALIGNMENT = 64
"""Every stored box starts at a multiple of this many bytes of its data file."""


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` in C order, without a copy when it is a contiguous CPU tensor."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.resolve_conj().resolve_neg()
    return byte_view(data.contiguous())


def _write_checksummed(writer: FileWriter, data: memoryview, chunk_bytes: int) -> tuple[int, int, tuple[int, ...]]:
    """Append ``data`` at the next aligned offset; return (byte_offset, byte_length, chunk checksums)."""
    padding = -writer.tell() % _ALIGNMENT
    if padding:
        writer.write(memoryview(bytes(padding)))
    offset = writer.tell()
    checksums = []
    for start in range(0, len(data), chunk_bytes):
        chunk = data[start : start + chunk_bytes]
        checksums.append(crc32c.crc32c(chunk))
        writer.write(chunk)
    return offset, len(data), tuple(checksums)


@dataclass
class _SaveState:
    """What one rank keeps between the phases of one save."""

    flat: FlatStateDict = field(default_factory=FlatStateDict)
    views: list[torch.Tensor] = field(default_factory=list)
    """The local data of every described box, in description order."""
    blobs: list[bytes] = field(default_factory=list)
    description: LocalSaveDescription = field(default_factory=lambda: LocalSaveDescription(tensors=(), objects=()))
    """This rank's own description."""
    descriptions: list[LocalSaveDescription] = field(default_factory=list)
    """Every rank's description; on the coordinator only."""


def save(
    state_dict: Any,
    path: CheckpointLocation,
    *,
    group: dist.ProcessGroup | None = None,
    overwrite: bool = False,
    fingerprint: bool = False,
    storage_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta | float | None = None,
    checksum_chunk_bytes: int = DEFAULT_CHECKSUM_CHUNK_BYTES,
    stats: SaveStats | None = None,
) -> Metadata:
    """Save a (sharded) state dict as a checkpoint at ``path``. Called by all ranks of ``group``.

    Args:
        state_dict: nested dicts/lists whose leaves are :class:`~reshard.ShardedTensor`,
            :class:`~reshard.ShardedObject`, plain tensors (full, replicated on every rank: written
            once) or JSON-like common values (the coordinator's are written).
        path: the checkpoint: a directory (created if needed), a ``file://``, ``s3://bucket/prefix`` or
            ``gs://bucket/prefix`` URL, or a :class:`~reshard.storage.Storage`. Every rank passes the same.
        group: the ranks that save together; ``None`` means the default group, or this process alone
            when ``torch.distributed`` is not initialised.
        overwrite: replace a complete checkpoint at ``path``. The old one stays loadable until the new
            ``metadata.json`` replaces it; its data files are removed after that.
        timeout: how long any collective may wait for the slowest rank (default 10 minutes).
        checksum_chunk_bytes: size of the pieces each stored box is checksummed in.
        fingerprint: also store, for every tensor, a layout-independent content fingerprint, so that
            ``load(..., verify=True)`` can check a reshard end to end (costs an extra pass over the data,
            see docs/reliability.md).
        storage_options: passed to the object-store client (fsspec ``s3``/``gs`` filesystem options such
            as ``endpoint_url``); credentials otherwise come from the client's usual configuration.
        stats: if given, filled with this rank's bytes written and seconds per phase (see
            :class:`~reshard.SaveStats`) once the save has committed.

    Returns:
        The committed checkpoint's metadata (on every rank).

    Raises:
        ShardingError: the ranks' boxes do not tile their tensors (same on every rank).
        CheckpointExistsError: ``path`` holds a complete checkpoint and ``overwrite`` is off.
        StorageError: a file could not be written on some rank.
        CheckpointError: any failure, on every rank, naming the failing ranks.
    """
    started = time.perf_counter()
    comm = Communicator(group, timeout=timeout)
    storage = storage_for(path, storage_options)
    try:
        return _save_to(
            storage,
            state_dict,
            comm,
            overwrite=overwrite,
            checksum_chunk_bytes=checksum_chunk_bytes,
            with_fingerprints=fingerprint,
            started=started,
            stats=stats,
        )
    finally:
        if storage is not path:
            storage.close()


def _save_to(
    storage: Storage,
    state_dict: Any,
    comm: Communicator,
    *,
    overwrite: bool,
    checksum_chunk_bytes: int,
    with_fingerprints: bool,
    started: float,
    stats: SaveStats | None = None,
) -> Metadata:
    """The body of :func:`save` once the storage is open."""
    clock = PhaseClock("save", comm.rank, started)
    location = storage.describe()
    state = _SaveState()

    def describe() -> dict[str, Any]:
        description = _prepare_rank_state(state, state_dict, rank=comm.rank, is_coordinator=comm.is_coordinator)
        return {"path": location, "pieces": description.to_json()}

    def plan(docs: list[dict[str, Any]]) -> dict[str, Any]:
        paths = {doc["path"] for doc in docs}
        if len(paths) > 1:
            by_path = {p: [r for r, doc in enumerate(docs) if doc["path"] == p] for p in sorted(paths)}
            raise CheckpointError(f"the ranks passed different checkpoint paths: {by_path}")
        state.descriptions = [LocalSaveDescription.from_json(d["pieces"]) for d in docs]
        assignments = plan_save(state.descriptions)
        save_id = uuid.uuid4().hex
        _prepare_root(storage, overwrite=overwrite, save_id=save_id)
        return {"save_id": save_id, "assignments": [[list(a.tensors), list(a.objects)] for a in assignments]}

    with clock.exchange():
        decision = comm.step("save planning", clock.timed("plan", describe), clock.timed("plan", plan))
    save_id: str = decision["save_id"]
    tensors_to_write, objects_to_write = decision["assignments"][comm.rank]
    assignment = WriteAssignment(tensors=tuple(tensors_to_write), objects=tuple(objects_to_write))
    logger.debug("[rank=%d] save %s: writing %d boxes", comm.rank, save_id, len(assignment.tensors))

    def write() -> dict[str, Any]:
        return _write_assigned(storage, state, assignment, save_id, comm.rank, checksum_chunk_bytes, with_fingerprints)

    replaced_files: set[str] = set()

    def commit(results: list[dict[str, Any]]) -> dict[str, Any]:
        metadata = _build_metadata(state, results, save_id, comm.size, checksum_chunk_bytes)
        replaced_files.update(_read_previous_files(storage) if overwrite else ())
        storage.sync_dir(DATA_DIR)
        # The commit point: before it the old checkpoint (if any) is intact, after it the new one is.
        document = metadata.to_json_bytes()
        try:
            storage.commit(METADATA_FILE, document, replace=overwrite)
        except OSError as exc:
            if not isinstance(exc, FileExistsError):
                raise StorageError(
                    f"committing {storage.describe(METADATA_FILE)} failed on the coordinator (rank {comm.rank}): {exc}"
                ) from exc
            # A retried create-only put whose first answer was lost finds its own object: that is a success.
            if _committed_document(storage) == document:
                release_lock(storage, save_id)
                return metadata.to_json_dict()
            raise CheckpointExistsError(
                f"another save committed a checkpoint at {storage.describe()} while this one was writing; "
                "this save's data was discarded"
            ) from None
        release_lock(storage, save_id)
        return metadata.to_json_dict()

    try:
        with clock.exchange():
            committed = comm.step("save", clock.timed("write", write), clock.timed("commit", commit))
    except CheckpointError:
        # Nothing was committed (the commit is all or nothing): this save's files are garbage.
        if comm.is_coordinator:
            _remove_save_files(storage, save_id)
            release_lock(storage, save_id)
        raise
    with clock.phase("commit"):
        metadata = Metadata.from_json_bytes(_json_bytes(committed))
        if comm.is_coordinator and replaced_files:
            _remove_replaced_files(storage, replaced_files - {f.path for f in metadata.files})
    stats = stats if stats is not None else SaveStats()
    written = [state.views[i].nbytes for i in assignment.tensors]
    fill_save_stats(stats, metadata, clock, _data_file_name(save_id, comm.rank), written)
    logger.info(
        "[rank=%d] saved %s in %.3f s (%s): this rank wrote %d bytes (%.1f MB/s); the checkpoint holds %d bytes "
        "in %d files",
        comm.rank,
        storage.describe(),
        stats.seconds,
        clock.summary(),
        stats.bytes_written,
        stats.throughput / 1e6,
        metadata.total_bytes,
        len(metadata.files),
    )
    return metadata


def _json_bytes(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _prepare_rank_state(state: _SaveState, state_dict: Any, *, rank: int, is_coordinator: bool) -> LocalSaveDescription:
    """Phase one on one rank: flatten the state dict, encode object values (and, on the coordinator,
    check that common values can be encoded), and describe every box. Fills ``state``."""
    state.flat = flatten_state_dict(state_dict, rank=rank)
    state.blobs = [encode_object_blob(o.value, where=f"object {o.key!r}") for o in state.flat.objects]
    if is_coordinator:
        for item_path, value in state.flat.common.items():
            encode_tagged(value, where=f"common value {item_path!r}")
    state.description, state.views = _describe(state.flat)
    return state.description


def _describe(flat: FlatStateDict) -> tuple[LocalSaveDescription, list[torch.Tensor]]:
    """This rank's description (boxes, no data) and, in the same order, the views holding each box."""
    tensors = []
    views = []
    for st in flat.tensors:
        name = dtype_name(st.data.dtype)
        pieces = st.pieces()
        if not pieces:  # nothing to store, but the key, dtype and shape are still recorded
            empty = Box((0,) * len(st.saved_shape), (0,) * len(st.saved_shape))
            pieces = [LocalPiece(empty, st.data.new_empty((0,) * len(st.saved_shape)))]
        for piece in pieces:
            tensors.append(
                TensorPiece(
                    key=st.key, dtype=name, global_shape=st.saved_shape, box=piece.box, replica_id=st.replica_id
                )
            )
            views.append(piece.view)
    objects = [
        ObjectPiece(key=o.key, global_shape=o.global_shape, offset=o.global_offset, replica_id=o.replica_id)
        for o in flat.objects
    ]
    return LocalSaveDescription(tensors=tuple(tensors), objects=tuple(objects)), views


def _prepare_root(storage: Storage, *, overwrite: bool, save_id: str) -> None:
    """On the coordinator, before anyone writes: create the directories, take the save lock (so that no
    other save interleaves with this one), refuse to clobber a complete checkpoint."""
    try:
        storage.prepare_root()
    except OSError as exc:
        raise StorageError(f"cannot create checkpoint directory {storage.describe()}: {exc}") from exc
    acquire_lock(storage, save_id, what="save")
    if storage.exists(METADATA_FILE) and not overwrite:
        release_lock(storage, save_id)
        raise CheckpointExistsError(
            f"{storage.describe()} already holds a complete checkpoint; pass overwrite=True to replace it"
        )


def _committed_document(storage: Storage) -> bytes | None:
    """The bytes of the committed ``metadata.json``, or None when they cannot be read."""
    try:
        return storage.read_bytes(METADATA_FILE)
    except (OSError, CheckpointError):
        return None


def _read_previous_files(storage: Storage) -> set[str]:
    """Data files of the checkpoint being overwritten (empty when there is none or it is unreadable)."""
    try:
        return {f.path for f in Metadata.from_json_bytes(storage.read_bytes(METADATA_FILE)).files}
    except (OSError, CheckpointError):
        return set()


def _data_file_name(save_id: str, rank: int) -> str:
    return f"{DATA_DIR}/{save_id}-r{rank:05d}.bin"


def _write_assigned(
    storage: Storage,
    state: _SaveState,
    assignment: WriteAssignment,
    save_id: str,
    rank: int,
    chunk_bytes: int,
    with_fingerprints: bool = False,
) -> dict[str, Any]:
    """Write this rank's assigned boxes and objects into its data file; describe where they went."""
    if not assignment.tensors and not assignment.objects:
        return {"file": None, "size": 0, "tensors": [], "objects": []}
    name = _data_file_name(save_id, rank)
    try:
        writer = storage.open_writer(name)
    except OSError as exc:
        raise StorageError(f"cannot create data file {storage.describe(name)}: {exc}") from exc
    written_tensors = []
    written_objects = []
    try:
        for index in assignment.tensors:
            offset, length, checksums = _write_checksummed(writer, tensor_bytes(state.views[index]), chunk_bytes)
            piece = state.description.tensors[index]
            print_ = fingerprint(state.views[index], piece.box, piece.global_shape) if with_fingerprints else None
            written_tensors.append([index, offset, length, list(checksums), print_])
        for index in assignment.objects:
            offset, length, checksums = _write_checksummed(writer, memoryview(state.blobs[index]), chunk_bytes)
            written_objects.append([index, offset, length, list(checksums)])
        size = writer.tell()
        writer.commit()
    except OSError as exc:
        writer.abort()
        raise StorageError(f"writing {storage.describe(name)} failed: {exc}") from exc
    except BaseException:
        writer.abort()
        raise
    return {"file": name, "size": size, "tensors": written_tensors, "objects": written_objects}


def _build_metadata(
    state: _SaveState, results: list[dict[str, Any]], save_id: str, world_size: int, chunk_bytes: int
) -> Metadata:
    """On the coordinator: combine every rank's description and write report into the metadata."""
    files: list[DataFile] = []
    tensor_info: dict[str, tuple[str, tuple[int, ...]]] = {}
    boxes: dict[str, list[SavedBox]] = {}
    prints: dict[str, list[int]] = {}
    fingerprinted = False
    object_shapes: dict[str, tuple[int, ...]] = {}
    entries: dict[str, list[SavedObject]] = {}
    for desc in state.descriptions:
        for piece in desc.tensors:
            tensor_info.setdefault(piece.key, (piece.dtype, piece.global_shape))
            boxes.setdefault(piece.key, [])
        for obj in desc.objects:
            object_shapes.setdefault(obj.key, obj.global_shape)
            entries.setdefault(obj.key, [])
    for rank, report in enumerate(results):
        if report["file"] is None:
            continue
        file_index = len(files)
        files.append(DataFile(path=report["file"], size=report["size"]))
        desc = state.descriptions[rank]
        for index, offset, length, checksums, print_ in report["tensors"]:
            piece = desc.tensors[index]
            if print_ is not None:
                fingerprinted = True
                prints.setdefault(piece.key, []).append(print_)
            boxes[piece.key].append(
                SavedBox(
                    offset=piece.box.offset,
                    shape=piece.box.shape,
                    file=file_index,
                    byte_offset=offset,
                    byte_length=length,
                    checksums=tuple(checksums),
                )
            )
        for index, offset, length, checksums in report["objects"]:
            obj = desc.objects[index]
            entries[obj.key].append(
                SavedObject(
                    offset=obj.offset,
                    file=file_index,
                    byte_offset=offset,
                    byte_length=length,
                    checksums=tuple(checksums),
                )
            )
    return Metadata(
        save_id=save_id,
        created_by=f"reshard {__version__}",
        world_size=world_size,
        checksum_chunk_bytes=chunk_bytes,
        files=tuple(files),
        tensors={
            key: TensorMetadata(
                key=key,
                dtype=dtype,
                global_shape=shape,
                boxes=tuple(sorted(boxes[key], key=lambda b: b.offset)),
                fingerprint=combine(prints.get(key, [])) if fingerprinted else None,
            )
            for key, (dtype, shape) in sorted(tensor_info.items())
        },
        objects={
            key: ObjectMetadata(
                key=key, global_shape=shape, entries=tuple(sorted(entries[key], key=lambda e: e.offset))
            )
            for key, shape in sorted(object_shapes.items())
        },
        common=dict(state.flat.common),
    )


def _remove_replaced_files(storage: Storage, names: set[str]) -> None:
    """Best effort, on the coordinator after an overwrite committed: remove the replaced checkpoint's
    data files. Only names under ``data/`` are touched; a failure is logged, never raised, because the
    new checkpoint is already committed and complete."""
    for name in sorted(names):
        if not name.startswith(f"{DATA_DIR}/"):
            continue
        try:
            storage.delete(name)
        except OSError as exc:
            logger.warning("could not remove %s of the replaced checkpoint: %s", storage.describe(name), exc)


def _remove_save_files(storage: Storage, save_id: str) -> None:
    """Best effort, on the coordinator after a failed save: remove the data files this save wrote."""
    try:
        for name in storage.list_files(DATA_DIR):
            if name.startswith(f"{DATA_DIR}/{save_id}-"):
                storage.delete(name)
    except OSError as exc:
        logger.warning("could not remove the data files of failed save %s: %s", save_id, exc)
