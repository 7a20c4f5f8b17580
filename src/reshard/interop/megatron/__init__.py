"""Megatron-Core's ``dist_checkpointing`` on reshard, with Megatron's own sharded state dicts as they are.

Importing this package registers a save and a load strategy with Megatron-Core's registry under backend
``"reshard"``, version 1 (megatron-core is an optional dependency; this package needs it)::

    import reshard.interop.megatron  # noqa: F401  (registers the strategies)
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_state_dict, ckpt_dir, sharded_strategy=("reshard", 1))
    state_dict = dist_checkpointing.load(sharded_state_dict, ckpt_dir)  # finds the strategy itself

Megatron writes what it always writes at the root of ``ckpt_dir`` (its ``metadata.json`` naming the backend,
``common.pt`` with the non-sharded values, a pickle that Megatron writes with ``torch.save``); the strategy writes
the ShardedTensors and ShardedObjects as a reshard checkpoint in ``ckpt_dir/reshard`` (:data:`RESHARD_SUBDIR`), so
the two ``metadata.json`` files never meet, and makes a save over an earlier checkpoint safe from the moment it
starts: a load finds the earlier save, the new one, or an error, never a mix of the two, refused saves included
(before the strategy starts, Megatron has already rewritten ``common.pt``:
:mod:`reshard.interop.megatron.directory` says what that leaves). Every tensor is checksummed and loads
into any other layout, reading only the bytes each rank needs; ShardedObjects are stored without pickle (TE's
``_extra_state`` bytes included). The strategies also work inside Megatron's ``FullyParallelSaveStrategyWrapper``
and ``FullyParallelLoadStrategyWrapper``, and raise errors that are both Megatron's ``CheckpointingException`` and
reshard's error classes (:mod:`reshard.interop.megatron.errors`).

The direct route, for code that calls reshard itself: :func:`to_reshard` turns a Megatron sharded state dict
(ShardedTensors, ShardedObjects, ShardedTensorFactories, LocalNonpersistentObjects, plain values) into a
reshard state dict, and :func:`from_reshard` turns what ``reshard.load`` returned back into the plain state
dict that ``model.load_state_dict`` and the optimizer's ``load_state_dict`` take::

    reshard.save(to_reshard(model.sharded_state_dict()), path)
    template = model.sharded_state_dict()
    model.load_state_dict(from_reshard(reshard.load(to_reshard(template), path), template))

Megatron's semantics are kept: ``prepend_axis_num`` axes exist only in the checkpoint (the local tensor keeps
its shape); ``allow_shape_mismatch`` loads the part of the stored tensor that overlaps the requested box (a
vocabulary padded for another TP size, both ways); the strategy zeroes such tensors first, as Megatron's
``torch_dist`` strategy does, so the rest is zero, while the direct route leaves the rest of the local tensor
as it was.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy

from reshard.flows.options import LoadOptions, SaveOptions
from reshard.interop.megatron.convert import COMMON_ENTRY, COMMON_KEY, from_reshard, to_reshard
from reshard.interop.megatron.errors import MegatronCheckpointError
from reshard.interop.megatron.strategies import (
    BACKEND,
    RESHARD_SUBDIR,
    VERSION,
    ReshardLoadStrategy,
    ReshardSaveStrategy,
)

__all__ = [
    "BACKEND",
    "COMMON_ENTRY",
    "COMMON_KEY",
    "RESHARD_SUBDIR",
    "VERSION",
    "MegatronCheckpointError",
    "ReshardLoadStrategy",
    "ReshardSaveStrategy",
    "from_reshard",
    "register",
    "to_reshard",
]


def register(*, save_options: SaveOptions | None = None, load_options: LoadOptions | None = None) -> None:
    """Register the strategies with Megatron-Core's registry under (:data:`BACKEND`, :data:`VERSION`): done on
    import with default options; call it again for others (the last registration wins)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, ReshardSaveStrategy(options=save_options))
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, ReshardLoadStrategy(options=load_options))


register()
