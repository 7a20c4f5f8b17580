"""Reading and writing reshard checkpoints from one process, tensor by tensor, in bounded memory.

The tools of the command line (``convert``, ``diff``, ``export``, ``import-dcp``) work on whole
checkpoints that may be larger than memory, in a single process that may or may not have a process
group. :class:`CheckpointReader` reads a tensor as consecutive slabs of its row-major flattening,
through the same load planning, direct reads, read buffer and checksum verification as
:func:`reshard.load`, but without any collective. :class:`CheckpointWriter` writes a checkpoint one
tensor at a time, each as a single box streamed in pieces, in the format and with the commit protocol of
:func:`reshard.save` (the save lock, data file names unique to the write, ``metadata.json`` validated and
committed last), as if one rank had saved it.
"""

from __future__ import annotations

import logging
import math
import uuid
import weakref
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any

import torch

from reshard._version import __version__
from reshard.errors import CheckpointError, MismatchError, StateDictError
from reshard.flows.options import DEFAULT_CHECKSUM_CHUNK_BYTES
from reshard.geometry.boxes import flat_range_boxes
from reshard.io.commit import SaveCommit
from reshard.io.datafile import DataFileWriter, data_file_name, tensor_bytes
from reshard.io.reader import ReadBudget, ReadExecutor
from reshard.io.references import verify_references
from reshard.io.sources import read_full_metadata
from reshard.metadata import (
    METADATA_FILE,
    DataFile,
    Metadata,
    ObjectMetadata,
    SavedBox,
    SavedObject,
    TensorMetadata,
)
from reshard.planning.load_plan import DEFAULT_MAX_READ_AMPLIFICATION, TargetPiece, plan_load
from reshard.state.codec import encode_tagged
from reshard.state.dtypes import dtype_name
from reshard.state.fingerprint import combine
from reshard.state.fingerprint import fingerprint as content_fingerprint
from reshard.state.scaled import ScaledRecord
from reshard.storage import CheckpointLocation, Storage, storage_for

logger = logging.getLogger("reshard")

__all__ = [
    "CAST_DTYPES",
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "DEFAULT_SLAB_BYTES",
    "CheckpointReader",
    "CheckpointWriter",
    "cast_floating",
    "kept_scaled",
    "scaled_part_keys",
]

DEFAULT_SLAB_BYTES = 64 * 1024 * 1024
"""Largest piece of a tensor a reader hands out at once (in bytes of the requested dtype)."""

DEFAULT_MEMORY_BUDGET_BYTES = 16 * 1024 * 1024
"""The reader's buffers: the read buffer for reads that cannot land directly in a slab (strided boxes, dtype
conversions) and mapped windows (see :class:`reshard.io.reader.ReadExecutor`)."""

CAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The dtypes a conversion can cast floating tensors to, by their short names."""


def cast_floating(saved: torch.dtype, target: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of dtype ``saved`` gets when floating tensors are cast to ``target``: ``target``
    for floating-point dtypes (float8 included), ``saved`` for the others (integers, bool, complex) and
    when ``target`` is None."""
    return target if target is not None and saved.is_floating_point else saved


def scaled_part_keys(metadata: Metadata) -> frozenset[str]:
    """The keys of every part (data, scales, global scale) of the checkpoint's scaled tensors: a dtype
    conversion never touches them (cast without each other, the data would decode with wrong scales)."""
    return frozenset(k for r in metadata.scaled.values() for k in r.part_keys)


def kept_scaled(metadata: Metadata, target: torch.dtype | None, keys: Iterable[str] | None = None) -> tuple[str, ...]:
    """The scaled tensors (data keys, sorted) a conversion to ``target`` writes in their own formats, of
    those with a part among ``keys`` (None: all); none without ``target``."""
    if target is None:
        return ()
    wanted = None if keys is None else set(keys)
    return tuple(sorted(key for key, r in metadata.scaled.items() if wanted is None or wanted & set(r.part_keys)))


class CheckpointReader:
    """A committed checkpoint, read by this process alone, piece by piece.

    Not collective: it never touches ``torch.distributed``, so it works in a process with or without a
    process group. Memory stays bounded by one slab plus ``memory_budget_bytes`` (the reader's buffers),
    whatever the tensor sizes. Every checksum chunk a read covers is verified, as with :func:`reshard.load`.
    Use it as a context manager, or call :meth:`close`.

    Raises (on construction):
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError: nothing valid at ``path``
            (CorruptCheckpointError also for a reference to another checkpoint that no marker ties to it).
    """

    def __init__(
        self,
        path: CheckpointLocation,
        *,
        storage_options: dict[str, Any] | None = None,
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    ) -> None:
        self.storage = storage_for(path, storage_options)
        self._owns_storage = self.storage is not path
        try:
            self.metadata = read_full_metadata(self.storage)
            verify_references(self.storage, self.metadata)
        except BaseException:
            self.close()
            raise
        self.max_read_bytes = ReadBudget.of(memory_budget_bytes).max_read_bytes
        self._executor = ReadExecutor(self.storage, self.metadata, memory_budget_bytes=memory_budget_bytes)
        self._slab = torch.empty(0, dtype=torch.uint8)

    def describe(self) -> str:
        """Where the checkpoint is, for messages."""
        return self.storage.describe()

    def tensor(self, key: str) -> TensorMetadata:
        """The metadata of tensor ``key``.

        Raises:
            MismatchError: the checkpoint has no such tensor.
        """
        found = self.metadata.tensors.get(key)
        if found is None:
            raise MismatchError(f"{self.describe()} has no tensor {key!r}")
        return found

    def iter_slabs(
        self, key: str, *, dtype: torch.dtype | None = None, slab_bytes: int = DEFAULT_SLAB_BYTES
    ) -> Iterator[torch.Tensor]:
        """Tensor ``key`` as consecutive 1-D pieces of its row-major flattening, converted to ``dtype``
        (default: its own), each at most ``slab_bytes`` bytes (at least one element).

        The yielded tensor's memory is reused for the next piece (of this tensor or another: the reader
        keeps one slab buffer, so that reading tensor after tensor does not fragment the heap): copy it to
        keep it. A tensor of zero elements yields nothing.
        """
        saved = self.tensor(key)
        out_dtype = dtype or saved.torch_dtype
        total = math.prod(saved.global_shape)
        per = max(1, slab_bytes // out_dtype.itemsize)
        source_itemsize = saved.torch_dtype.itemsize
        chunk = self.metadata.checksum_chunk_bytes
        if chunk % source_itemsize == 0 and per * source_itemsize >= chunk:
            # Slabs that end on checksum chunk boundaries of a one-box tensor verify without extra reads.
            per = per * source_itemsize // chunk * chunk // source_itemsize
        buffer = self.slab_buffer(min(per, total) * out_dtype.itemsize).view(out_dtype)
        for start in range(0, total, per):
            out = buffer[: min(total, start + per) - start]
            self.read_flat(key, start, out)
            yield out

    def slab_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` bytes (uint8) of the reader's one scratch buffer, grown (never shrunk) as needed; the
        slabs of :meth:`iter_slabs` live in it, so it is valid until the next call of either."""
        if self._slab.numel() < nbytes:
            self._slab = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating the new
            self._slab = torch.empty(nbytes, dtype=torch.uint8)
        return self._slab[:nbytes]

    def read_flat(self, key: str, start: int, out: torch.Tensor) -> None:
        """Fill ``out`` (a contiguous 1-D CPU tensor) with elements ``[start, start + out.numel())`` of the
        row-major flattening of tensor ``key``, converted to ``out``'s dtype."""
        saved = self.tensor(key)
        if out.ndim != 1 or not out.is_contiguous():
            raise ValueError("read_flat fills a contiguous 1-D tensor")
        pieces = flat_range_boxes(saved.global_shape, start, start + out.numel())
        boxes = [box for box, _ in pieces]
        views = [out[at - start : at - start + box.volume].view(box.shape) for box, at in pieces]
        plan = plan_load(
            self.metadata,
            [TargetPiece(key=key, box=box) for box in boxes],
            max_read_amplification=DEFAULT_MAX_READ_AMPLIFICATION,
            max_read_bytes=self.max_read_bytes,
        )
        self._executor.run(plan, views, boxes)

    def read_object_blob(self, key: str, entry: SavedObject) -> bytes:
        """The stored bytes of one ShardedObject cell (the encoded blob, see docs/format.md section 7.2),
        read and checked as :func:`reshard.load` reads it (file size, length, every checksum), not decoded."""
        return self._executor.read_object_blob(key, entry)

    def close(self) -> None:
        """Release the read buffer and the storage (when this reader opened it)."""
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.close()
        self._slab = torch.empty(0, dtype=torch.uint8)
        if self._owns_storage:
            self.storage.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _abandon(file: DataFileWriter, commit: SaveCommit, storage: Storage | None) -> None:
    """What a :class:`CheckpointWriter` dropped without commit or abort leaves is discarded (never raises)."""
    logger.warning(
        "a CheckpointWriter of %s was dropped without commit() or abort(): aborted", commit.storage.describe()
    )
    try:
        file.abort()
    except Exception as exc:  # a finalizer must not raise; the lock and the files still go
        logger.warning("aborting the data file of a dropped CheckpointWriter failed: %s", exc)
    commit.discard()
    if storage is not None:
        storage.close()


class CheckpointWriter:
    """Writes a checkpoint from this process alone, one tensor at a time.

    Each tensor is stored as one box covering it, streamed in pieces; object cells are copied as encoded
    blobs; common values are kept in memory until the commit. The result is a checkpoint as
    :func:`reshard.save` from one rank writes it (``world_size`` 1, one data file), and passes
    ``reshard validate``.

    Call order: construct (takes the save lock and refuses a complete checkpoint at ``path`` unless
    ``overwrite``; the directory may not exist yet), then any number of :meth:`write_tensor`,
    :meth:`write_object_blob` and :meth:`set_common`, then :meth:`commit` (``metadata.json`` last) or
    :meth:`abort` (removes what was written). As a context manager, leaving the block by an exception or
    without a commit aborts. Not collective, not thread-safe.

    Args:
        path: where to write: a directory, a ``file://``, ``s3://`` or ``gs://`` URL, or a Storage.
        overwrite: replace a complete checkpoint at ``path`` (it stays loadable until the commit).
        fingerprint: store every tensor's content fingerprint (see ``SaveOptions(fingerprint=True)``).
        checksum_chunk_bytes: size of the pieces each stored box is checksummed in.
        storage_options: passed to the object-store client.
    """

    def __init__(
        self,
        path: CheckpointLocation,
        *,
        overwrite: bool = False,
        fingerprint: bool = False,
        checksum_chunk_bytes: int = DEFAULT_CHECKSUM_CHUNK_BYTES,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        if checksum_chunk_bytes < 1:
            raise ValueError(f"checksum_chunk_bytes must be positive, got {checksum_chunk_bytes}")
        self.storage: Storage = storage_for(path, storage_options)
        self._owns_storage = self.storage is not path
        self.overwrite = overwrite
        self.fingerprint = fingerprint
        self.chunk_bytes = checksum_chunk_bytes
        self.save_id = uuid.uuid4().hex
        self.tensors: dict[str, TensorMetadata] = {}
        self.objects: dict[str, tuple[tuple[int, ...], list[SavedObject]]] = {}
        self.common: dict[str, object] = {}
        self.scaled: dict[str, ScaledRecord] = {}
        self._done = False
        self._name = data_file_name(self.save_id, 0)
        self._commit = SaveCommit(self.storage, self.save_id, overwrite=overwrite)
        try:
            self._commit.begin()
        except BaseException:
            self._close_storage()
            raise
        try:
            self._file = DataFileWriter(self.storage, self._name, checksum_chunk_bytes)
        except BaseException:
            self._commit.discard()
            self._close_storage()
            raise
        # A writer dropped without commit() or abort() (outside a with block) must not hold the lock it renews for
        # the life of the process: collected (or at the interpreter's exit), it aborts.
        self._abandoned = weakref.finalize(
            self, _abandon, self._file, self._commit, self.storage if self._owns_storage else None
        )

    def describe(self) -> str:
        """Where the checkpoint is being written, for messages."""
        return self.storage.describe()

    def write_tensor(
        self, key: str, dtype: torch.dtype, global_shape: tuple[int, ...], pieces: Iterable[torch.Tensor]
    ) -> TensorMetadata:
        """Store tensor ``key`` from ``pieces``: consecutive runs of its row-major flattening (tensors of
        ``dtype``, any shape, their elements taken in row-major order) that together hold exactly
        ``prod(global_shape)`` elements. Each piece is written before the next is taken, so a generator
        that reads one piece at a time keeps memory at one piece.

        Raises:
            StateDictError: a repeated key, an unsupported dtype, a piece of another dtype, or the wrong
                number of elements.
            StorageError: the data file could not be written.
        """
        self._check_open()
        if key in self.tensors:
            raise StateDictError(f"tensor {key!r} was already written")
        try:
            name = dtype_name(dtype)
        except KeyError:
            raise StateDictError(f"tensor {key!r}: reshard cannot store dtype {dtype}") from None
        global_shape = tuple(int(s) for s in global_shape)
        total = math.prod(global_shape)
        self._file.begin()
        prints: list[int] = []
        done = 0
        for piece in pieces:
            if piece.dtype != dtype:
                raise StateDictError(f"tensor {key!r}: a piece of dtype {piece.dtype}, expected {dtype}")
            count = piece.numel()
            if done + count > total:
                raise StateDictError(f"tensor {key!r}: more than its {total} elements were given")
            self._file.feed(tensor_bytes(piece))
            if self.fingerprint:
                flat = piece.detach().reshape(-1)
                for box, at in flat_range_boxes(global_shape, done, done + count):
                    prints.append(content_fingerprint(flat[at - done : at - done + box.volume], box, global_shape))
            done += count
        if done != total:
            raise StateDictError(f"tensor {key!r}: {done} of its {total} elements were given")
        stored = self._file.end()
        boxes: tuple[SavedBox, ...] = ()
        if total:
            boxes = (
                SavedBox(
                    offset=(0,) * len(global_shape),
                    shape=global_shape,
                    file=0,
                    byte_offset=stored.byte_offset,
                    byte_length=stored.byte_length,
                    checksums=stored.checksums,
                ),
            )
        tensor = TensorMetadata(
            key=key,
            dtype=name,
            global_shape=global_shape,
            boxes=boxes,
            fingerprint=combine(prints) if self.fingerprint else None,
        )
        self.tensors[key] = tensor
        return tensor

    def write_object_blob(self, key: str, global_shape: tuple[int, ...], offset: tuple[int, ...], blob: bytes) -> None:
        """Store one cell of ShardedObject ``key`` (grid ``global_shape``, cell ``offset``) from its encoded
        blob (as :meth:`CheckpointReader.read_object_blob` returns it). Every cell of the grid must be
        written before the commit."""
        self._check_open()
        shape, entries = self.objects.setdefault(key, (tuple(global_shape), []))
        if shape != tuple(global_shape):
            raise StateDictError(f"object {key!r}: grid {list(global_shape)} differs from {list(shape)}")
        stored = self._file.append(memoryview(blob))
        entries.append(
            SavedObject(
                offset=tuple(offset),
                file=0,
                byte_offset=stored.byte_offset,
                byte_length=stored.byte_length,
                checksums=stored.checksums,
            )
        )

    def set_common(self, path: str, value: object) -> None:
        """Store common value ``value`` at dotted path ``path`` (a JSON-like scalar or bytes).

        Raises:
            StateDictError: a value the format cannot hold.
        """
        self._check_open()
        encode_tagged(value, where=f"common value {path!r}")
        self.common[path] = value

    def set_scaled(self, record: ScaledRecord) -> None:
        """Record that the tensors ``record`` names (written with :meth:`write_tensor`) are one scaled tensor;
        the commit checks them (their shapes and dtypes are the format's)."""
        self._check_open()
        self.scaled[record.key] = record

    def _check_open(self) -> None:
        if self._done:
            raise CheckpointError(f"the writer of {self.describe()} has already committed or aborted")

    def commit(self) -> Metadata:
        """Make the data file durable, then commit ``metadata.json`` (the checkpoint exists from this
        instant, through the same commit protocol as :func:`reshard.save`); with ``overwrite``, then remove
        the replaced checkpoint's data files.

        Raises:
            CorruptCheckpointError: what was written does not form a valid checkpoint (an object grid with
                missing cells, say); nothing is committed.
            CheckpointExistsError, StorageError: as for :func:`reshard.save`; nothing this writer wrote is
                deleted unless it is known not to have committed.
        """
        self._check_open()
        try:
            size = self._file.commit()
            metadata = Metadata(
                save_id=self.save_id,
                created_by=f"reshard {__version__}",
                world_size=1,
                checksum_chunk_bytes=self.chunk_bytes,
                files=(DataFile(path=self._name, size=size),),
                tensors=dict(sorted(self.tensors.items())),
                objects={
                    key: ObjectMetadata(
                        key=key, global_shape=shape, entries=tuple(sorted(entries, key=lambda e: e.offset))
                    )
                    for key, (shape, entries) in sorted(self.objects.items())
                },
                common=dict(self.common),
                scaled=dict(sorted(self.scaled.items())),
            )
            document = metadata.to_json_bytes()
            Metadata.from_json_bytes(document, where=self.storage.describe(METADATA_FILE))  # what a reader checks
            self._commit.publish(document, keep={self._name})
        except BaseException:
            self._discard()
            raise
        self._done = True
        self._abandoned.detach()
        self._close_storage()
        return metadata

    def abort(self) -> None:
        """Discard everything written and release the lock; never raises. Nothing is committed."""
        if self._done:
            return
        self._file.abort()
        self._discard()

    def _discard(self) -> None:
        """After a failure: remove this writer's files unless its commit happened (or may have)."""
        self._done = True
        self._abandoned.detach()
        self._commit.discard()
        self._close_storage()

    def _close_storage(self) -> None:
        if self._owns_storage:
            self.storage.close()

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.abort()
