"""The save and load strategies that Megatron-Core's ``dist_checkpointing`` finds under backend ``"reshard"``.

Megatron's save writes ``common.pt`` and its ``metadata.json`` itself; the strategy writes the ShardedTensors
and ShardedObjects as a reshard checkpoint in ``checkpoint_dir/reshard`` (:data:`RESHARD_SUBDIR`). Every error
it raises is both Megatron's ``CheckpointingException`` and reshard's error class (:mod:`reshard.megatron.errors`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedObject as McoreShardedObject
from megatron.core.dist_checkpointing.mapping import ShardedTensor as McoreShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy

import reshard
from reshard.errors import MismatchError
from reshard.megatron.convert import ABSENT, rebuild_state, split_state
from reshard.megatron.errors import megatron_errors
from reshard.metadata import METADATA_FILE, Metadata
from reshard.options import LoadOptions, SaveOptions
from reshard.sources import read_metadata_bytes
from reshard.storage import storage_for

__all__ = ["BACKEND", "RESHARD_SUBDIR", "VERSION", "ReshardLoadStrategy", "ReshardSaveStrategy"]

BACKEND = "reshard"
VERSION = 1
RESHARD_SUBDIR = "reshard"
"""Where in a Megatron checkpoint directory the strategy keeps the reshard checkpoint."""


def _reshard_dir(checkpoint_dir: str | Path) -> Path:
    return Path(checkpoint_dir) / RESHARD_SUBDIR


def _stored_metadata(checkpoint_dir: str | Path) -> Metadata:
    """The reshard checkpoint's metadata on every rank: read once, by rank 0, and broadcast. Collective
    over the default group when torch.distributed is initialised."""
    directory = _reshard_dir(checkpoint_dir)
    where = str(directory / METADATA_FILE)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return reshard.read_metadata(directory)
    holder: list[Any] = [None]
    if dist.get_rank() == 0:
        storage = storage_for(directory)
        try:
            holder[0] = read_metadata_bytes(storage)
        except Exception as exc:  # every rank raises it
            holder[0] = exc
        finally:
            storage.close()
    dist.broadcast_object_list(holder, src=0)
    if isinstance(holder[0], BaseException):
        raise holder[0]
    return Metadata.from_json_bytes(holder[0], where=where)


class ReshardSaveStrategy(AsyncSaveShardedStrategy):  # type: ignore[misc]  # megatron-core is untyped
    """Megatron's sharded save as a reshard save into ``checkpoint_dir/reshard`` (see the package docstring),
    synchronous (:meth:`save`) or asynchronous (:meth:`async_save`, for ``dist_checkpointing.save(...,
    async_sharded_save=True)``).

    ``options`` are reshard's :class:`~reshard.SaveOptions` (checksums, workers, memory budget). An earlier
    reshard checkpoint in the same directory is replaced atomically (Megatron overwrites its own files in
    place): until the new one commits, the old one stays loadable.
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, options: SaveOptions | None = None) -> None:
        super().__init__(backend, version)
        self.options = options
        self._checkpointer: reshard.AsyncCheckpointer | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Collective over the default group: every rank calls it (Megatron's ``dist_checkpointing.save``
        does)."""
        with megatron_errors():
            sharded, _ = split_state(sharded_state_dict, None)  # Megatron keeps the common state in its common.pt
            state = sharded if sharded is not ABSENT else {}
            reshard.save(state, _reshard_dir(checkpoint_dir), overwrite=True, options=self.options)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        """Snapshot the tensors into host buffers (reused from one save to the next) and write them in a
        background thread of this process; returns Megatron's ``AsyncRequest`` with nothing to run in
        Megatron's writer process and a finalize function that waits for reshard's commit, so that the
        ``metadata.json`` Megatron writes after it never names an uncommitted checkpoint. Collective over
        the default group, like the background save's own agreement, which runs over a gloo group of its
        own (created at the first call) so that it never meets the training's collectives."""
        with megatron_errors():
            if self._checkpointer is None:
                self._checkpointer = reshard.AsyncCheckpointer(group=dist.new_group(backend="gloo"))
            sharded, _ = split_state(sharded_state_dict, None)
            state = sharded if sharded is not ABSENT else {}
            handle = self._checkpointer.save(state, _reshard_dir(checkpoint_dir), overwrite=True, options=self.options)

        def finalize() -> None:
            with megatron_errors():
                handle.wait()

        return AsyncRequest(async_fn=None, async_fn_args=(), finalize_fns=[finalize])


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
            stored = _stored_metadata(checkpoint_dir)
            sharded, _ = split_state(sharded_state_dict, stored, loading=True)
            template = sharded if sharded is not ABSENT else {}
            loaded = reshard.load(template, _reshard_dir(checkpoint_dir), options=self.options)
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
