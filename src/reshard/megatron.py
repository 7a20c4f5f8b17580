"""Megatron-Core's ``dist_checkpointing`` on reshard, with Megatron's own sharded state dicts as they are.

Importing this module registers a save and a load strategy with Megatron-Core's registry under backend
``"reshard"``, version 1 (megatron-core is an optional dependency; this module needs it)::

    import reshard.megatron  # noqa: F401  (registers the strategies)
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=("reshard", 1))
    state_dict = dist_checkpointing.load(sharded_state_dict, ckpt_dir)  # finds the strategy itself

Megatron writes what it always writes at the root of ``ckpt_dir`` (its ``metadata.json`` naming the backend,
``common.pt`` with the non-sharded values, a pickle that Megatron writes with ``torch.save``); the strategy
writes the ShardedTensors and ShardedObjects as a reshard checkpoint in ``ckpt_dir/reshard``
(:data:`RESHARD_SUBDIR`), so the two ``metadata.json`` files never meet. Every tensor is checksummed and
loads into any other layout, reading only the bytes each rank needs; ShardedObjects are stored without
pickle (TE's ``_extra_state`` bytes included).

The direct route, for code that calls reshard itself: :func:`to_reshard` turns a Megatron sharded state dict
(ShardedTensors, ShardedObjects, ShardedTensorFactories, LocalNonpersistentObjects, plain values) into a
reshard state dict, and :func:`from_reshard` turns what ``reshard.load`` returned back into the plain state
dict that ``model.load_state_dict`` and the optimizer's ``load_state_dict`` take::

    reshard.save(to_reshard(model.sharded_state_dict()), path)
    template = model.sharded_state_dict()
    model.load_state_dict(from_reshard(reshard.load(to_reshard(template), path), template))

Megatron's semantics are kept: ``prepend_axis_num`` axes exist only in the checkpoint (the local tensor keeps
its shape); ``allow_shape_mismatch`` loads the part of the stored tensor that overlaps the requested box and
leaves the rest of the local tensor as it was (a vocabulary padded for another TP size, both ways).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory
from megatron.core.dist_checkpointing.mapping import ShardedObject as McoreShardedObject
from megatron.core.dist_checkpointing.mapping import ShardedTensor as McoreShardedTensor
from megatron.core.dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

import reshard
from reshard.errors import MismatchError, StateDictError
from reshard.metadata import Metadata
from reshard.options import LoadOptions, SaveOptions
from reshard.sources import read_metadata_bytes
from reshard.storage import storage_for

__all__ = [
    "BACKEND",
    "RESHARD_SUBDIR",
    "VERSION",
    "ReshardLoadStrategy",
    "ReshardSaveStrategy",
    "from_reshard",
    "register",
    "to_reshard",
]

BACKEND = "reshard"
VERSION = 1
RESHARD_SUBDIR = "reshard"
"""Where in a Megatron checkpoint directory the strategy keeps the reshard checkpoint."""

_BYTES_IO = "__reshard_bytes_io__"


def to_reshard(sharded_state_dict: Any, *, stored: Metadata | None = None) -> Any:
    """A Megatron-Core sharded state dict as a reshard state dict of the same nesting (not collective).

    ShardedTensors become reshard ShardedTensors over the same data (a view with the ``prepend_axis_num``
    axes in front, no copy); ShardedObjects become reshard ShardedObjects (an ``io.BytesIO`` value, as TE's
    ``_extra_state``, travels as its bytes); a ShardedTensorFactory is replaced by the sub-state-dict it
    builds (Megatron's GLU and expert layouts); LocalNonpersistentObjects are left out (they are restored
    from the template by :func:`from_reshard`); other values stay, as common values. The input is not
    modified.

    ``stored``, the metadata of the checkpoint to load from, is needed when a ShardedTensor has
    ``allow_shape_mismatch``: its box is then clipped to the stored global shape, so that a load reads
    the overlap and leaves the rest of the local tensor alone. A ShardedTensor with ``data=None`` (a
    template of ``load_tensors_metadata``) gets an empty CPU tensor.

    Raises:
        StateDictError: a ShardedTensor with ``flattened_range`` (not expressible in megatron-core 0.16.1).
    """
    return _convert(sharded_state_dict, (), stored)


def _convert(value: Any, path: tuple[Any, ...], stored: Metadata | None) -> Any:
    if isinstance(value, ShardedTensorFactory):
        return _convert(value.build(), path, stored)
    if isinstance(value, McoreShardedTensor):
        return _tensor(value, stored)
    if isinstance(value, McoreShardedObject):
        data = value.data
        if isinstance(data, io.BytesIO):
            data = {_BYTES_IO: data.getvalue()}
        return reshard.ShardedObject(value.key, data, value.global_shape, value.global_offset, value.replica_id)
    if isinstance(value, dict):
        return {
            k: _convert(v, (*path, k), stored) for k, v in value.items() if not isinstance(v, LocalNonpersistentObject)
        }
    if isinstance(value, list):
        return [
            _convert(v, (*path, i), stored) for i, v in enumerate(value) if not isinstance(v, LocalNonpersistentObject)
        ]
    return value


def _tensor(sharded: McoreShardedTensor, stored: Metadata | None) -> reshard.ShardedTensor:
    if sharded.flattened_range is not None:
        raise StateDictError(f"{sharded.key!r}: flattened_range is not supported (nor by megatron-core 0.16.1)")
    if sharded.data is None:
        sharded.init_data("cpu")
    data = sharded.data.reshape((1,) * sharded.prepend_axis_num + tuple(sharded.local_shape))
    global_shape, offset = tuple(sharded.global_shape), tuple(sharded.global_offset)
    saved = stored.tensors.get(sharded.key) if stored is not None else None
    if sharded.allow_shape_mismatch and saved is not None and saved.global_shape != global_shape:
        # Megatron's semantics: read where the requested box overlaps the stored tensor, keep the rest.
        stored_shape = saved.global_shape
        if len(stored_shape) != len(global_shape):
            raise MismatchError(
                f"{sharded.key!r}: the checkpoint holds a {len(stored_shape)}-d tensor, the state dict a "
                f"{len(global_shape)}-d one (allow_shape_mismatch allows other sizes, not other axes)"
            )
        ends = [min(o + n, s) for o, n, s in zip(offset, data.shape, stored_shape, strict=True)]
        lengths = [max(e - o, 0) for e, o in zip(ends, offset, strict=True)]
        data = data[tuple(slice(0, n) for n in lengths)]
        offset = tuple(min(o, s) for o, s in zip(offset, stored_shape, strict=True))
        global_shape = stored_shape
    return reshard.ShardedTensor(sharded.key, data, global_shape, offset, sharded.replica_id)


def from_reshard(loaded: Any, sharded_state_dict: Any) -> Any:
    """The plain state dict Megatron's ``load`` would return: ``loaded`` (what ``reshard.load`` returned for
    ``to_reshard(sharded_state_dict)``) with each ShardedTensor's local tensor in its local shape,
    each ShardedObject's value (an ``io.BytesIO`` again where it was one), each factory's sub-state-dict
    merged back by its ``merge_fn``, and each LocalNonpersistentObject unwrapped from the template (not
    collective). It is what ``model.load_state_dict`` and a Megatron optimizer's ``load_state_dict``
    take."""
    if isinstance(sharded_state_dict, LocalNonpersistentObject):
        return sharded_state_dict.unwrap()
    if isinstance(sharded_state_dict, ShardedTensorFactory):
        return sharded_state_dict.merge_fn(from_reshard(loaded, sharded_state_dict.build()))
    if isinstance(sharded_state_dict, McoreShardedTensor):
        if sharded_state_dict.data is not None:
            return sharded_state_dict.data  # filled in place through the view to_reshard made
        return loaded.reshape(tuple(sharded_state_dict.local_shape))
    if isinstance(sharded_state_dict, McoreShardedObject):
        if isinstance(loaded, dict) and set(loaded) == {_BYTES_IO}:
            return io.BytesIO(loaded[_BYTES_IO])
        return loaded
    if isinstance(sharded_state_dict, dict):
        return {k: _child(loaded, k, v) for k, v in sharded_state_dict.items()}
    if isinstance(sharded_state_dict, list):
        kept = iter(loaded if isinstance(loaded, list) else [])
        return [
            v.unwrap() if isinstance(v, LocalNonpersistentObject) else from_reshard(next(kept), v)
            for v in sharded_state_dict
        ]
    return loaded


def _child(loaded: Any, key: Any, template: Any) -> Any:
    if isinstance(template, LocalNonpersistentObject):
        return template.unwrap()
    if not isinstance(loaded, dict) or key not in loaded:
        raise MismatchError(f"the loaded state has no entry {key!r} that the template holds")
    return from_reshard(loaded[key], template)


# ---- the strategies ---------------------------------------------------------------------------------------


def _reshard_dir(checkpoint_dir: str | Path) -> Path:
    return Path(checkpoint_dir) / RESHARD_SUBDIR


def _stored_metadata(checkpoint_dir: str | Path) -> Metadata:
    """The reshard checkpoint's metadata on every rank: read once, by rank 0, and broadcast. Collective
    over the default group when torch.distributed is initialised."""
    directory = _reshard_dir(checkpoint_dir)
    where = str(directory / "metadata.json")
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


class ReshardSaveStrategy(SaveShardedStrategy):  # type: ignore[misc]  # megatron-core is untyped
    """Megatron's sharded save as a reshard save into ``checkpoint_dir/reshard`` (see the module docstring).

    ``options`` are reshard's :class:`~reshard.SaveOptions` (checksums, workers, memory budget). An earlier
    reshard checkpoint in the same directory is replaced atomically (Megatron overwrites its own files in
    place): until the new one commits, the old one stays loadable.
    """

    def __init__(self, backend: str = BACKEND, version: int = VERSION, *, options: SaveOptions | None = None) -> None:
        super().__init__(backend, version)
        self.options = options

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
        """Collective over the default group: every rank calls it (Megatron's ``dist_checkpointing.save``
        does)."""
        reshard.save(to_reshard(sharded_state_dict), _reshard_dir(checkpoint_dir), overwrite=True, options=self.options)


class ReshardLoadStrategy(LoadShardedStrategy):  # type: ignore[misc]  # megatron-core is untyped
    """Megatron's sharded load from the reshard checkpoint in ``checkpoint_dir/reshard``, into any layout."""

    def __init__(self, *, options: LoadOptions | None = None) -> None:
        super().__init__()
        self.options = options

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise MismatchError(f"the checkpoint's sharded backend is {loaded_backend!r}, not {BACKEND!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise MismatchError(f"the checkpoint's {BACKEND} backend version is {loaded_version}, this reads {VERSION}")

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        """Collective over the default group. Returns the state dict of ``sharded_state_dict``'s nesting with
        tensors and objects loaded (the ShardedTensors' own tensors, filled in place)."""
        stored = _stored_metadata(checkpoint_dir)
        template = to_reshard(sharded_state_dict, stored=stored)
        loaded = reshard.load(template, _reshard_dir(checkpoint_dir), options=self.options)
        return from_reshard(loaded, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict[str, McoreShardedTensor]:
        """Every stored tensor as a data-less Megatron ShardedTensor of its global shape and dtype, by key."""
        return _tensors_metadata(_stored_metadata(checkpoint_dir))

    def load_sharded_metadata(self, checkpoint_dir: str | Path) -> dict[str, Any]:
        """:meth:`load_tensors_metadata` and every stored ShardedObject cell, by Megatron's unique key."""
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


def register(*, save_options: SaveOptions | None = None, load_options: LoadOptions | None = None) -> None:
    """Register the strategies with Megatron-Core's registry under (:data:`BACKEND`, :data:`VERSION`): done on
    import with default options; call it again for others (the last registration wins)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, ReshardSaveStrategy(options=save_options))
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, ReshardLoadStrategy(options=load_options))


register()
