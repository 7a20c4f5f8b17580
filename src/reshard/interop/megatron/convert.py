"""Megatron-Core sharded state dicts in reshard's terms and back: :func:`to_reshard` and :func:`from_reshard`
(the direct route), and the two walks both they and the strategies use, :func:`split_state` and
:func:`rebuild_state`.

Megatron's semantics are kept: ``prepend_axis_num`` axes exist only in the checkpoint (the local tensor keeps
its shape); ``allow_shape_mismatch`` loads the part of the stored tensor that overlaps the requested box (a
vocabulary padded for another TP size, both ways); dict keys that are neither strings nor integers (the
shard-id tuples of Megatron's FullyParallelLoadStrategyWrapper) name their entries by their ``repr``.
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensorFactory
from megatron.core.dist_checkpointing.mapping import ShardedObject as McoreShardedObject
from megatron.core.dist_checkpointing.mapping import ShardedTensor as McoreShardedTensor
from megatron.core.fp8_utils import dequantize_fp8_tensor, is_float8tensor

from reshard.errors import MismatchError, StateDictError
from reshard.interop.dcp import MEGATRON_COMMON_KEY
from reshard.metadata import Metadata
from reshard.state.sharding import ShardedObject, ShardedTensor

__all__ = [
    "ABSENT",
    "COMMON_ENTRY",
    "COMMON_KEY",
    "from_reshard",
    "rebuild_state",
    "sharded_key",
    "split_state",
    "to_reshard",
]

BYTES_IO = "__reshard_bytes_io__"
"""The key under which an ``io.BytesIO`` value of a ShardedObject travels as its bytes."""


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
    overlap and leaves the rest of the local tensor alone (the strategy, like Megatron's ``torch_dist``, zeroes
    such tensors before it loads; this conversion does not touch their data). A ShardedTensor with
    ``data=None`` (a template of ``load_tensors_metadata``) gets an empty CPU tensor (zeros with
    ``allow_shape_mismatch``). A dict key that is neither a string nor an integer names its entry by its
    ``repr`` on the reshard side.

    Raises:
        StateDictError: the state dict is not a dict, or holds a ShardedTensor with ``flattened_range`` (not
            expressible in megatron-core 0.16.1), or a dict whose keys name the same entry.
        MismatchError: an ``allow_shape_mismatch`` tensor has other axes than the stored one.
    """
    if not isinstance(sharded_state_dict, dict):
        raise StateDictError(f"a Megatron sharded state dict is a dict, got {type(sharded_state_dict).__name__}")
    sharded, common = split_state(sharded_state_dict, stored)
    out = dict(sharded) if sharded is not ABSENT else {}
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    out[COMMON_ENTRY] = ShardedObject(COMMON_KEY, common if common is not ABSENT else {}, (1,), (0,), rank)
    return out


COMMON_ENTRY = "__megatron_common__"
"""The top-level entry of :func:`to_reshard`'s result that holds Megatron's common state."""
COMMON_KEY = MEGATRON_COMMON_KEY
"""The key of the ShardedObject that holds Megatron's common state in a checkpoint of the direct route (and
of a Megatron ``torch_dist`` checkpoint converted by ``reshard import-dcp``)."""

ABSENT: Any = object()
"""An empty side of :func:`split_state`, a value :func:`rebuild_state` leaves out."""


def sharded_key(key: Any) -> str | int:
    """The key of a dict entry on the sharded side: ``key`` itself for a string or an integer (reshard's
    paths), its ``repr`` for anything else (the shard-id tuples of Megatron's FullyParallelLoadStrategyWrapper)."""
    if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
        return key
    return repr(key)


def split_state(value: Any, stored: Metadata | None, *, loading: bool = False) -> tuple[Any, Any]:
    """(the sharded part of ``value`` in reshard's terms, its common part), each ``ABSENT`` when empty.

    ``stored``: see :func:`to_reshard`. ``loading``: the state dict is about to be loaded by the strategy,
    which, as Megatron's ``torch_dist`` strategy does, zeroes every ``allow_shape_mismatch`` tensor first
    (the part the checkpoint does not cover stays zero).

    Raises:
        StateDictError: a ShardedTensor with ``flattened_range``, or two keys of a dict that name the same
            entry on the sharded side (see :func:`sharded_key`).
        MismatchError: an ``allow_shape_mismatch`` tensor with other axes than the stored one.
    """
    if isinstance(value, LocalNonpersistentObject):
        return ABSENT, ABSENT
    if isinstance(value, ShardedTensorFactory):
        return split_state(value.build(), stored, loading=loading)
    if isinstance(value, McoreShardedTensor):
        return _tensor(value, stored, loading), ABSENT
    if isinstance(value, McoreShardedObject):
        data = value.data
        if isinstance(data, io.BytesIO):
            data = {BYTES_IO: data.getvalue()}
        return ShardedObject(value.key, data, value.global_shape, value.global_offset, value.replica_id), ABSENT
    if isinstance(value, dict) and value:
        sharded: dict[str | int, Any] = {}
        common = {}
        for key, child in value.items():
            child_sharded, child_common = split_state(child, stored, loading=loading)
            if child_sharded is not ABSENT:
                name = sharded_key(key)
                if name in sharded:
                    raise StateDictError(f"the keys {name!r} and {key!r} of one dict name the same entry")
                sharded[name] = child_sharded
            if child_common is not ABSENT:
                common[key] = child_common
        return sharded or ABSENT, common or ABSENT
    if isinstance(value, list) and value:
        parts = [split_state(child, stored, loading=loading) for child in value]
        if all(part[0] is ABSENT for part in parts):
            return ABSENT, [c if c is not ABSENT else None for _, c in parts]
        # A list with sharded entries stays whole on the sharded side (positions matter): its common entries
        # become reshard common values, its non-persistent ones None.
        return [s if s is not ABSENT else (c if c is not ABSENT else None) for s, c in parts], ABSENT
    return ABSENT, value


def _tensor(sharded: McoreShardedTensor, stored: Metadata | None, loading: bool) -> ShardedTensor:
    if sharded.flattened_range is not None:
        raise StateDictError(f"{sharded.key!r}: flattened_range is not supported (nor by megatron-core 0.16.1)")
    if sharded.data is None:  # as torch_dist initialises a data-less template
        sharded.init_data("cpu", init_fn=torch.zeros if sharded.allow_shape_mismatch else torch.empty)
    elif sharded.allow_shape_mismatch and loading:
        sharded.data.detach().zero_()  # as torch_dist does before it loads (mcore_to_pyt_state_dict)
    local = sharded.data
    if not loading and is_float8tensor(local):
        # Megatron's load dequantizes every Transformer Engine FP8 template (force_all_tensors_to_non_fp8) before
        # a strategy sees it, so the checkpoint holds the values, never FP8 bytes without their scales.
        local = dequantize_fp8_tensor(local)
    data = local.reshape((1,) * sharded.prepend_axis_num + tuple(sharded.local_shape))
    global_shape, offset = tuple(sharded.global_shape), tuple(sharded.global_offset)
    saved = stored.tensors.get(sharded.key) if stored is not None else None
    if sharded.allow_shape_mismatch and saved is not None and saved.global_shape != global_shape:
        # Megatron's semantics: read where the requested box overlaps the stored tensor.
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
    return ShardedTensor(sharded.key, data, global_shape, offset, sharded.replica_id)


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
    result = rebuild_state(rest, sharded_state_dict, common)
    return result if result is not ABSENT else {}


def rebuild_state(loaded: Any, template: Any, common: Any) -> Any:
    """The value Megatron's load gives for ``template`` (a value of a Megatron sharded state dict), from
    ``loaded`` (what ``reshard.load`` returned for its sharded side, see :func:`split_state`) and ``common``
    (the checkpoint's common state at the same place); ``ABSENT`` for nothing.

    Raises:
        MismatchError: a list of ``common`` has another length than the template's.
    """
    if isinstance(template, LocalNonpersistentObject):
        return template.unwrap()
    if isinstance(template, ShardedTensorFactory):
        return template.merge_fn(rebuild_state(loaded, template.build(), ABSENT))
    if isinstance(template, McoreShardedTensor):
        if template.data is not None:
            return template.data  # filled in place through the view to_reshard made
        return loaded.reshape(tuple(template.local_shape))
    if isinstance(template, McoreShardedObject):
        if isinstance(loaded, dict) and set(loaded) == {BYTES_IO}:
            return io.BytesIO(loaded[BYTES_IO])
        return loaded
    if isinstance(template, dict) and template:
        out = {}
        for key, child in template.items():
            child_loaded = loaded.get(sharded_key(key), ABSENT) if isinstance(loaded, dict) else ABSENT
            child_common = common.get(key, ABSENT) if isinstance(common, dict) else ABSENT
            value = rebuild_state(child_loaded, child, child_common)
            if value is not ABSENT:
                out[key] = value
        if isinstance(common, dict):
            out.update({k: v for k, v in common.items() if k not in template})
        return out
    if isinstance(template, list) and template:
        if isinstance(loaded, list):  # a list with sharded entries (see split_state)
            return [
                item if _is_plain(child) else rebuild_state(item, child, ABSENT)
                for item, child in zip(loaded, template, strict=True)
            ]
        if isinstance(common, list) and len(common) != len(template):
            # Megatron merges lists by position: another length (an optimizer's parameter groups on another
            # expert layout) would pair the wrong entries.
            raise MismatchError(
                f"the checkpoint's list has {len(common)} entries where the state dict has {len(template)} "
                "(an optimizer with other parameter groups?): lists are merged by position, so this cannot load"
            )
        commons = common if isinstance(common, list) else [ABSENT] * len(template)
        items = [rebuild_state(ABSENT, child, c) for child, c in zip(template, commons, strict=True)]
        if all(item is ABSENT for item in items):
            return ABSENT
        return [None if item is ABSENT else item for item in items]
    if common is not ABSENT:
        return common
    return ABSENT


def _is_plain(value: Any) -> bool:
    """Whether ``value`` holds nothing sharded (a common value of a list kept on the sharded side)."""
    return split_state(value, None)[0] is ABSENT and not isinstance(value, LocalNonpersistentObject)
