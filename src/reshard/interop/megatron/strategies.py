"""The save and load strategies that Megatron-Core's ``dist_checkpointing`` finds under backend ``"reshard"``.

Megatron's save writes ``common.pt`` and its ``metadata.json`` itself; the strategy writes the ShardedTensors
and ShardedObjects as a reshard checkpoint in ``checkpoint_dir/reshard`` (:data:`RESHARD_SUBDIR`) and keeps the
directory from ever loading as a mix of two saves (:mod:`reshard.interop.megatron.directory`). Every error it raises
is both Megatron's ``CheckpointingException`` and reshard's error class (:mod:`reshard.interop.megatron.errors`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject as McoreShardedObject
from megatron.core.dist_checkpointing.mapping import ShardedTensor as McoreShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy

from reshard.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CommunicationError,
    MismatchError,
    StateDictError,
    UnconfirmedCommitError,
)
from reshard.flows.async_save import AsyncCheckpointer
from reshard.flows.load import load as reshard_load
from reshard.flows.options import LoadOptions, SaveOptions
from reshard.flows.save import save as reshard_save
from reshard.interop.megatron.convert import ABSENT, rebuild_state, split_state
from reshard.interop.megatron.directory import (
    COMMON_PT_ENTRY,
    RESHARD_SUBDIR,
    Repointed,
    check_common_pt,
    check_started,
    common_pt_digest,
    put_back,
    repoint,
)
from reshard.interop.megatron.errors import megatron_errors
from reshard.io.sources import read_metadata_bytes
from reshard.metadata import METADATA_FILE, Metadata
from reshard.net.comm import Communicator
from reshard.storage import storage_for

__all__ = ["BACKEND", "RESHARD_SUBDIR", "VERSION", "ReshardLoadStrategy", "ReshardSaveStrategy"]

BACKEND = "reshard"
VERSION = 1

logger = logging.getLogger("reshard")


def _reshard_dir(checkpoint_dir: str | Path) -> Path:
    return Path(checkpoint_dir) / RESHARD_SUBDIR


def _rank0_value(values: list[Any]) -> Any:
    return values[0]


def _stored_metadata(checkpoint_dir: str | Path, *, check_common: bool = False) -> Metadata:
    """The reshard checkpoint's metadata on every rank: read once, by rank 0, and broadcast (a directory with
    Megatron's ``metadata.json`` and no ``reshard/`` is an ``IncompleteCheckpointError``). ``check_common``:
    rank 0 also checks that ``common.pt`` belongs to it (``IncompleteCheckpointError`` otherwise). Collective
    over the default group (reshard's agreement: every rank raises the same error, a dead peer is a
    ``CommunicationError``)."""
    directory = _reshard_dir(checkpoint_dir)
    where = str(directory / METADATA_FILE)
    comm = Communicator(None)
    read: list[tuple[bytes, Metadata]] = []

    def local() -> None:
        if not comm.is_coordinator:
            return
        storage = storage_for(directory)
        try:
            raw = read_metadata_bytes(storage)
        except CheckpointNotFoundError:
            check_started(checkpoint_dir)
            raise
        finally:
            storage.close()
        metadata = Metadata.from_json_bytes(raw, where=where)
        if check_common:
            check_common_pt(checkpoint_dir, metadata)
        read.append((raw, metadata))

    comm.step("megatron: read the metadata", local)
    raw = comm.broadcast_bytes(read[0][0] if read else None)
    return read[0][1] if read else Metadata.from_json_bytes(raw, where=where)


def _put_back_after(failure: CheckpointError, checkpoint_dir: str | Path, before: Repointed | None) -> None:
    """After a save that raised ``failure`` (a refusal, or a failure every rank agreed on) before its reshard
    checkpoint committed: rank 0 puts Megatron's ``metadata.json`` back as it was before the strategy pointed it
    at itself, where that cannot make a mix loadable (:func:`~reshard.interop.megatron.directory.put_back`: not over
    another backend's checkpoint, whose ``common.pt`` Megatron has replaced and which the strategy's load then
    refuses).
    Collective over the default group (every rank raised ``failure``'s class, by reshard's agreement): no rank
    returns from the save, and reads ``metadata.json`` again, before rank 0 is done. Not after a
    ``CommunicationError`` (a peer died or is unreachable: there is no agreement to count on, and the directory
    stays pointed at the strategy, whose load refuses what it did not commit) nor an ``UnconfirmedCommitError``
    (the new checkpoint is committed). A failure to put it back is logged (``failure`` is what the save raises)."""
    if isinstance(failure, (CommunicationError, UnconfirmedCommitError)):
        return

    def local() -> None:
        if before is not None:
            put_back(checkpoint_dir, before)

    try:
        Communicator(None).step("megatron: put metadata.json back", local)
    except CheckpointError as exc:
        logger.warning(
            "the save into %s was refused (%s), and Megatron's metadata.json could not be put back as it was "
            "(%s): it names the reshard strategy, whose load refuses the directory",
            checkpoint_dir,
            failure,
            exc,
        )


class ReshardSaveStrategy(AsyncSaveShardedStrategy):  # type: ignore[misc]  # megatron-core is untyped
    """Megatron's sharded save as a reshard save into ``checkpoint_dir/reshard`` (see the package docstring),
    synchronous (:meth:`save`) or asynchronous (:meth:`async_save`, for ``dist_checkpointing.save(...,
    async_sharded_save=True)``).

    ``options`` are reshard's :class:`~reshard.SaveOptions` (checksums, workers, memory budget). An earlier
    checkpoint in the same directory is replaced so that Megatron's load never opens a mix of the two once the
    strategy runs: when it starts, rank 0 records the digest of the ``common.pt`` Megatron has just written and
    points Megatron's ``metadata.json`` at the strategy (atomically); a load checks that ``common.pt`` is the
    one the committed reshard checkpoint was saved with. A save the strategy refuses puts ``metadata.json`` back
    as it was (:mod:`reshard.interop.megatron.directory`).
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, options: SaveOptions | None = None) -> None:
        super().__init__(backend, version)
        self.options = options
        self._checkpointer: AsyncCheckpointer | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Collective over the default group: every rank calls it (Megatron's ``dist_checkpointing.save``
        does)."""
        with megatron_errors():
            state, before = self._prepare(sharded_state_dict, checkpoint_dir)
            try:
                reshard_save(state, _reshard_dir(checkpoint_dir), overwrite=True, options=self.options)
            except CheckpointError as exc:
                _put_back_after(exc, checkpoint_dir, before)
                raise

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        """Snapshot the tensors into host buffers (reused from one save to the next) and write them in a
        background thread of this process; returns Megatron's ``AsyncRequest`` with nothing to run in
        Megatron's writer process and a finalize function that waits for reshard's commit, so that Megatron
        writes its ``metadata.json`` after it. Collective over the default group, like the background save's
        own agreement, which runs over a gloo group of its own (created at the first call) so that it never
        meets the training's collectives."""
        with megatron_errors():
            if self._checkpointer is None:
                self._checkpointer = AsyncCheckpointer(group=dist.new_group(backend="gloo"))
            state, before = self._prepare(sharded_state_dict, checkpoint_dir)
            try:
                handle = self._checkpointer.save(
                    state, _reshard_dir(checkpoint_dir), overwrite=True, options=self.options
                )
            except CheckpointError as exc:
                _put_back_after(exc, checkpoint_dir, before)
                raise

        def finalize() -> None:  # on every rank (Megatron's finalisation of the request)
            with megatron_errors():
                try:
                    handle.wait()
                except CheckpointError as exc:
                    _put_back_after(exc, checkpoint_dir, before)
                    raise

        return AsyncRequest(async_fn=None, async_fn_args=(), finalize_fns=[finalize])

    def _prepare(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> tuple[dict[Any, Any], Repointed | None]:
        """The reshard state dict to save, with the digest of ``common.pt``; on rank 0, ``common.pt`` made
        durable, Megatron's ``metadata.json`` naming the strategy written atomically (as soon as the strategy
        starts, so that a death from then on leaves a directory its load refuses) and what it replaced (None on
        the other ranks; :mod:`reshard.interop.megatron.directory`). Collective over the default group: the conversion
        of every rank and rank 0's files are agreed on (the same error on every rank), and a state refused on
        any rank puts ``metadata.json`` back before the error is raised."""
        comm = Communicator(None)
        converted: list[dict[Any, Any]] = []
        repointed: list[Repointed] = []

        def local() -> str | None:
            sharded, _ = split_state(sharded_state_dict, None)  # Megatron keeps the common state in its common.pt
            state: dict[Any, Any] = dict(sharded) if sharded is not ABSENT else {}
            if COMMON_PT_ENTRY in state:
                raise StateDictError(f"{COMMON_PT_ENTRY!r} is the strategy's own entry: rename that key")
            converted.append(state)
            if not comm.is_coordinator:
                return None
            digest = common_pt_digest(checkpoint_dir, durable=True)
            repointed.append(repoint(checkpoint_dir, self.backend, self.version))
            return digest

        try:
            digest = comm.step("megatron: prepare the save", local, _rank0_value)
        except CheckpointError as exc:
            _put_back_after(exc, checkpoint_dir, repointed[0] if repointed else None)
            raise
        state = converted[0]
        state[COMMON_PT_ENTRY] = digest
        return state, (repointed[0] if repointed else None)


class ReshardLoadStrategy(LoadShardedStrategy):  # type: ignore[misc]  # megatron-core is untyped
    """Megatron's sharded load from the reshard checkpoint in ``checkpoint_dir/reshard``, into any layout, also
    inside Megatron's ``FullyParallelLoadStrategyWrapper``."""

    def __init__(self, *, options: LoadOptions | None = None) -> None:
        super().__init__()
        self.options = options

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            with megatron_errors():
                raise MismatchError(f"the checkpoint's sharded backend is {loaded_backend!r}, not {BACKEND!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            with megatron_errors():
                raise MismatchError(
                    f"the checkpoint's {BACKEND} backend version is {loaded_version}, this reads {VERSION}"
                )

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """Collective over the default group. Returns the state dict of ``sharded_state_dict``'s nesting with
        tensors and objects loaded (the ShardedTensors' own tensors, filled in place; those with
        ``allow_shape_mismatch`` zeroed first, as Megatron's ``torch_dist`` strategy does, so that what the
        checkpoint does not cover is zero)."""
        with megatron_errors():
            stored = _stored_metadata(checkpoint_dir, check_common=True)
            comm = Communicator(None)
            converted: list[Any] = []

            def local() -> None:  # agreed on, so that a template refused on some ranks fails on every rank
                converted.append(split_state(sharded_state_dict, stored, loading=True)[0])

            comm.step("megatron: convert the template", local)
            template = converted[0] if converted[0] is not ABSENT else {}
            loaded = reshard_load(template, _reshard_dir(checkpoint_dir), options=self.options)
            result = rebuild_state(loaded, sharded_state_dict, ABSENT)
            return result if result is not ABSENT else {}

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, McoreShardedTensor]:
        """Every stored tensor as a data-less Megatron ShardedTensor of its global shape and dtype, by key."""
        with megatron_errors():
            return _tensors_metadata(_stored_metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """:meth:`load_tensors_metadata` and every stored ShardedObject cell, by Megatron's unique key."""
        with megatron_errors():
            stored = _stored_metadata(checkpoint_dir)
        out: dict[str, Any] = dict(_tensors_metadata(stored))
        for key, entry in stored.objects.items():
            for cell in entry.entries:
                sharded = McoreShardedObject(key, None, tuple(entry.global_shape), tuple(cell.offset))
                out[sharded.unique_key] = sharded
        return out


def _tensors_metadata(stored: Metadata) -> dict[str, McoreShardedTensor]:
    return {
        key: McoreShardedTensor.from_rank_offsets(
            key, torch.empty(entry.global_shape, dtype=entry.torch_dtype, device="meta")
        ).without_data()
        for key, entry in stored.tensors.items()
    }
