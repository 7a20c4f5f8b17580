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
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)

import reshard
from reshard.errors import MismatchError, StateDictError
from reshard.interop.dcp import MEGATRON_COMMON_KEY
from reshard.metadata import Metadata
from reshard.options import LoadOptions, SaveOptions
from reshard.sources import read_metadata_bytes
from reshard.storage import storage_for

__all__ = [
    "BACKEND",
    "COMMON_ENTRY",
    "COMMON_KEY",
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


def to_reshard(sharded_state_dict: dict[str, Any], *, stored: Metadata | None = None) -> dict[str, Any]:
    """A Megatron-Core sharded state dict as a reshard state dict (not collective). The input keeps its
    structure; only a data-less ShardedTensor is given its (empty CPU) tensor, which the load then fills.

    ShardedTensors become reshard ShardedTensors over the same data (a view with the ``prepend_axis_num``
    axes in front, no copy), at the same place in the nesting; ShardedObjects become reshard ShardedObjects
    (an ``io.BytesIO`` value, as TE's ``_extra_state``, travels as its bytes); a ShardedTensorFactory is
    replaced by the sub-state-dict it builds (Megatron's GLU and expert layouts); LocalNonpersistentObjects
    are left out (:func:`from_reshard` restores them from the template). The other values, Megatron's
    *common* state (what its own save pickles into ``common.pt``), are gathered into one ShardedObject,
    :data:`COMMON_KEY`, under the top-level entry :data:`COMMON_ENTRY` (rank 0's copy is saved, without
    pickle): a load gets the checkpoint's common state whatever the template holds, as Megatron's load does
    (an optimizer's ``common_step``, absent from a template built before any step, comes back).

    ``stored``, the metadata of the checkpoint to load from, is needed when a ShardedTensor has
    ``allow_shape_mismatch``: its box is then clipped to the stored global shape, so that a load reads the
    overlap and leaves the rest of the local tensor alone. A ShardedTensor with ``data=None`` (a template of
    ``load_tensors_metadata``) gets an empty CPU tensor.

    Raises:
        StateDictError: the state dict is not a dict, or holds a ShardedTensor with ``flattened_range`` (not
            expressible in megatron-core 0.16.1).
    """
    if not isinstance(sharded_state_dict, dict):
        raise StateDictError(f"a Megatron sharded state dict is a dict, got {type(sharded_state_dict).__name__}")
    sharded, common = _split(sharded_state_dict, stored)
    out = dict(sharded) if sharded is not _ABSENT else {}
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    out[COMMON_ENTRY] = reshard.ShardedObject(COMMON_KEY, common if common is not _ABSENT else {}, (1,), (0,), rank)
    return out


COMMON_ENTRY = "__megatron_common__"
"""The top-level entry of :func:`to_reshard`'s result that holds Megatron's common state."""
COMMON_KEY = MEGATRON_COMMON_KEY
"""The key of the ShardedObject that holds Megatron's common state in a checkpoint of the direct route (and
of a Megatron ``torch_dist`` checkpoint converted by ``reshard import-dcp``)."""

_ABSENT: Any = object()


def _split(value: Any, stored: Metadata | None) -> tuple[Any, Any]:
    """(the sharded part of ``value`` in reshard's terms, its common part), each ``_ABSENT`` when empty."""
    if isinstance(value, LocalNonpersistentObject):
        return _ABSENT, _ABSENT
    if isinstance(value, ShardedTensorFactory):
        return _split(value.build(), stored)
    if isinstance(value, McoreShardedTensor):
        return _tensor(value, stored), _ABSENT
    if isinstance(value, McoreShardedObject):
        data = value.data
        if isinstance(data, io.BytesIO):
            data = {_BYTES_IO: data.getvalue()}
        return reshard.ShardedObject(
            value.key, data, value.global_shape, value.global_offset, value.replica_id
        ), _ABSENT
    if isinstance(value, dict) and value:
        sharded, common = {}, {}
        for key, child in value.items():
            child_sharded, child_common = _split(child, stored)
            if child_sharded is not _ABSENT:
                sharded[key] = child_sharded
            if child_common is not _ABSENT:
                common[key] = child_common
        return sharded or _ABSENT, common or _ABSENT
    if isinstance(value, list) and value:
        parts = [_split(child, stored) for child in value]
        if all(part[0] is _ABSENT for part in parts):
            return _ABSENT, [c if c is not _ABSENT else None for _, c in parts]
        # A list with sharded entries stays whole on the sharded side (positions matter): its common entries
        # become reshard common values, its non-persistent ones None.
        return [s if s is not _ABSENT else (c if c is not _ABSENT else None) for s, c in parts], _ABSENT
    return _ABSENT, value


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


def from_reshard(loaded: dict[str, Any], sharded_state_dict: dict[str, Any]) -> dict[str, Any]:
    """The plain state dict Megatron's ``load`` would return (not collective): from ``loaded``, what
    ``reshard.load`` returned for ``to_reshard(sharded_state_dict)``, each ShardedTensor's local tensor in its
    local shape, each ShardedObject's value (an ``io.BytesIO`` again where it was one), each factory's
    sub-state-dict merged back by its ``merge_fn``, each LocalNonpersistentObject unwrapped from the template,
    and the checkpoint's common state as the base (a common value the template lacks is added; one the
    checkpoint lacks is left out, as Megatron's load does). It is what ``model.load_state_dict`` and a
    Megatron optimizer's ``load_state_dict`` take."""
    common = loaded.get(COMMON_ENTRY, {})
    rest = {k: v for k, v in loaded.items() if k != COMMON_ENTRY}
    result = _rebuild(rest, sharded_state_dict, common)
    return result if result is not _ABSENT else {}


def _rebuild(loaded: Any, template: Any, common: Any) -> Any:
    if isinstance(template, LocalNonpersistentObject):
        return template.unwrap()
    if isinstance(template, ShardedTensorFactory):
        return template.merge_fn(_rebuild(loaded, template.build(), _ABSENT))
    if isinstance(template, McoreShardedTensor):
        if template.data is not None:
            return template.data  # filled in place through the view to_reshard made
        return loaded.reshape(tuple(template.local_shape))
    if isinstance(template, McoreShardedObject):
        if isinstance(loaded, dict) and set(loaded) == {_BYTES_IO}:
            return io.BytesIO(loaded[_BYTES_IO])
        return loaded
    if isinstance(template, dict) and template:
        out = {}
        for key, child in template.items():
            child_loaded = loaded.get(key, _ABSENT) if isinstance(loaded, dict) else _ABSENT
            child_common = common.get(key, _ABSENT) if isinstance(common, dict) else _ABSENT
            value = _rebuild(child_loaded, child, child_common)
            if value is not _ABSENT:
                out[key] = value
        if isinstance(common, dict):
            out.update({k: v for k, v in common.items() if k not in template})
        return out
    if isinstance(template, list) and template:
        if isinstance(loaded, list):  # a list with sharded entries (see _split)
            return [
                item if _is_plain(child) else _rebuild(item, child, _ABSENT)
                for item, child in zip(loaded, template, strict=True)
            ]
        if isinstance(common, list) and len(common) != len(template):
            # Megatron merges lists by position: another length (an optimizer's parameter groups on another
            # expert layout) would pair the wrong entries.
            raise MismatchError(
                f"the checkpoint's list has {len(common)} entries where the state dict has {len(template)} "
                "(an optimizer with other parameter groups?): lists are merged by position, so this cannot load"
            )
        commons = common if isinstance(common, list) else [_ABSENT] * len(template)
        items = [_rebuild(_ABSENT, child, c) for child, c in zip(template, commons, strict=True)]
        if all(item is _ABSENT for item in items):
            return _ABSENT
        return [None if item is _ABSENT else item for item in items]
    if common is not _ABSENT:
        return common
    return _ABSENT


def _is_plain(value: Any) -> bool:
    """Whether ``value`` holds nothing sharded (a common value of a list kept on the sharded side)."""
    return _split(value, None)[0] is _ABSENT and not isinstance(value, LocalNonpersistentObject)


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


class ReshardSaveStrategy(AsyncSaveShardedStrategy):  # type: ignore[misc]  # megatron-core is untyped
    """Megatron's sharded save as a reshard save into ``checkpoint_dir/reshard`` (see the module docstring),
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
        sharded, _ = _split(sharded_state_dict, None)  # Megatron keeps the common state in its common.pt
        state = sharded if sharded is not _ABSENT else {}
        reshard.save(state, _reshard_dir(checkpoint_dir), overwrite=True, options=self.options)

    def async_save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> AsyncRequest:
        """Snapshot the tensors into host buffers (reused from one save to the next) and write them in a
        background thread of this process; returns Megatron's ``AsyncRequest`` with nothing to run in
        Megatron's writer process and a finalize function that waits for reshard's commit, so that the
        ``metadata.json`` Megatron writes after it never names an uncommitted checkpoint. Collective over
        the default group, like the background save's own agreement, which runs over a gloo group of its
        own (created at the first call) so that it never meets the training's collectives."""
        if self._checkpointer is None:
            self._checkpointer = reshard.AsyncCheckpointer(group=dist.new_group(backend="gloo"))
        sharded, _ = _split(sharded_state_dict, None)
        state = sharded if sharded is not _ABSENT else {}
        handle = self._checkpointer.save(state, _reshard_dir(checkpoint_dir), overwrite=True, options=self.options)

        def finalize() -> None:
            handle.wait()

        return AsyncRequest(async_fn=None, async_fn_args=(), finalize_fns=[finalize])


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
        sharded, _ = _split(sharded_state_dict, stored)
        loaded = reshard.load(
            sharded if sharded is not _ABSENT else {}, _reshard_dir(checkpoint_dir), options=self.options
        )
        result = _rebuild(loaded, sharded_state_dict, _ABSENT)
        return result if result is not _ABSENT else {}

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
