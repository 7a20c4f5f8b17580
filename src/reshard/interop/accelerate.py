"""Hugging Face Accelerate's ``save_state`` / ``load_state`` with models and optimizers through reshard.

``use_reshard(accelerator)`` turns it on for one ``Accelerator``: from then on ``accelerator.save_state(dir)``
writes the state dicts of the prepared models and optimizers as one reshard checkpoint in ``<dir>/reshard``
(``model_<i>``: ``get_model_state_dict``; ``optimizer_<i>``: ``get_optimizer_state_dict``, flattened; FSDP2 /
DTensor leaves stay sharded, plain tensors are written once), and ``accelerator.load_state(dir)`` loads them back
into whatever layout the models have now (another world size, another mesh, a plain module on one process).
Everything else accelerate saves (LR schedulers, dataloader samplers, RNG states, the gradient scaler, the
``step`` counter, objects registered with ``register_for_checkpointing``) is still saved and loaded by
accelerate's own code, in the same files; automatic checkpoint naming and ``total_limit`` stay accelerate's.

The seam: accelerate's save and load pre-hooks are called with the resolved directory after accelerate has
chosen it (automatic naming, ``total_limit``) and before it writes or reads its own files, so reshard saves and
loads there. Hooks alone cannot replace accelerate's model and optimizer files (under FSDP its DCP save runs
before the hook; the optimizers are always saved by ``save_accelerator_state``), so for the duration of each call
the accelerator's model and optimizer lists are handed to reshard and hidden from accelerate's own model and
optimizer code, then restored. ``ReshardHandle.remove()`` undoes all of it.

accelerate is imported here only: ``import reshard`` never needs it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from reshard.errors import CheckpointError
from reshard.flows.load import load
from reshard.flows.save import save

__all__ = ["RESHARD_FOLDER", "ReshardHandle", "use_reshard"]

RESHARD_FOLDER = "reshard"
"""The reshard checkpoint's folder inside an accelerate state directory."""

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_REFUSED = {
    DistributedType.DEEPSPEED: "DeepSpeed saves its engine's own checkpoint",
    DistributedType.MEGATRON_LM: "Megatron-LM saves its own checkpoint",
    DistributedType.XLA: "XLA tensors are not supported by reshard",
}


@dataclasses.dataclass(frozen=True)
class ReshardHandle:
    """What :func:`use_reshard` changed on one accelerator; ``remove()`` restores accelerate's own saving."""

    accelerator: Any
    _undo: Callable[[], None] = dataclasses.field(repr=False)

    def remove(self) -> None:
        """Restore accelerate's own ``save_state`` / ``load_state`` (not collective)."""
        self._undo()


def use_reshard(accelerator: Accelerator, *, timeout: float | None = None) -> ReshardHandle:
    """Make ``accelerator.save_state`` / ``load_state`` put its prepared models and optimizers through reshard.

    Call it once per accelerator, on every process, before the first ``save_state`` or ``load_state``; models
    and optimizers prepared later are included (the lists are read at each call). ``save_state`` and
    ``load_state`` stay collective over all processes, as in accelerate. ``timeout``: how long any collective
    of a save or load may wait for the slowest rank (None: reshard's default).

    Raises:
        CheckpointError: the accelerator uses DeepSpeed, Megatron-LM, XLA or FSDP1 (whose checkpoints reshard
            cannot write), or ``use_reshard`` was already called on it.
    """
    _refuse_distributed_type(accelerator)
    if getattr(accelerator, "_reshard_handle", None) is not None:
        raise CheckpointError("use_reshard was already called on this accelerator")
    hidden: dict[str, list[Any]] = {}

    def save_hook(_models: list[Any], _weights: list[Any], output_dir: str) -> None:
        _save_through_reshard(hidden, output_dir, timeout)

    def load_hook(_models: list[Any], input_dir: str) -> None:
        _load_through_reshard(hidden, input_dir, timeout)

    handles = [
        accelerator.register_save_state_pre_hook(save_hook),
        accelerator.register_load_state_pre_hook(load_hook),
    ]
    original_save, original_load = accelerator.save_state, accelerator.load_state

    @functools.wraps(original_save)
    def save_state(output_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        _refuse_url(output_dir)
        with _hidden_from_accelerate(accelerator, hidden):
            return original_save(output_dir, *args, **kwargs)

    @functools.wraps(original_load)
    def load_state(input_dir: str | None = None, *args: Any, **kwargs: Any) -> Any:
        _refuse_url(input_dir)
        with _hidden_from_accelerate(accelerator, hidden):
            return original_load(input_dir, *args, **kwargs)

    def undo() -> None:
        for handle in handles:
            handle.remove()
        for name in ("save_state", "load_state", "_reshard_handle"):
            accelerator.__dict__.pop(name, None)

    accelerator.save_state = save_state
    accelerator.load_state = load_state
    handle = ReshardHandle(accelerator, undo)
    accelerator._reshard_handle = handle
    return handle


def _refuse_distributed_type(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind in _REFUSED:
        raise CheckpointError(f"use_reshard: distributed type {kind}: {_REFUSED[kind]}; use accelerate's own saving")
    if kind == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise CheckpointError(
            "use_reshard: FSDP1 (fsdp_version=1) keeps flat parameters reshard cannot save; use fsdp_version=2"
        )


def _refuse_url(directory: str | None) -> None:
    """accelerate's state directories are local folders (it calls ``os.makedirs`` / ``os.path.isdir`` on them):
    a URL would put accelerate's files in a local folder named after the scheme and reshard's in the bucket."""
    if directory is not None and "://" in str(directory):
        raise CheckpointError(
            f"accelerate state directory {directory!r}: accelerate saves to local folders only; save reshard "
            "checkpoints to s3:// or gs:// with reshard.save / reshard.CheckpointManager instead"
        )


@contextmanager
def _hidden_from_accelerate(accelerator: Accelerator, hidden: dict[str, list[Any]]) -> Iterator[None]:
    """For one ``save_state`` / ``load_state`` call: the models and optimizers go to the hooks (``hidden``), and
    accelerate's own model and optimizer code sees empty lists; restored however the call ends."""
    _refuse_distributed_type(accelerator)
    models, optimizers = accelerator._models, accelerator._optimizers
    hidden["models"], hidden["optimizers"] = list(models), list(optimizers)
    accelerator._models, accelerator._optimizers = [], []
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers
        hidden.clear()


def _plain_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` under accelerate's ``AcceleratedOptimizer`` wrappers."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"use_reshard: {type(optimizer).__name__} is not a torch.optim.Optimizer")
    return optimizer


def _owner(optimizer: torch.optim.Optimizer, models: list[torch.nn.Module], index: int) -> torch.nn.Module:
    """The prepared model whose parameters the optimizer updates (all of them in one model)."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for model in models:
        if params <= {id(p) for p in model.parameters()}:
            return model
    raise CheckpointError(
        f"use_reshard: optimizer {index} updates parameters that are not all in one prepared model; prepare the "
        "model(s) it trains with the accelerator"
    )


def _state(hidden: dict[str, list[Any]]) -> tuple[dict[str, Any], list[tuple[torch.nn.Module, Any]]]:
    """The state dict reshard saves (and the template it loads into), and (model, optimizer) pairs."""
    models: list[torch.nn.Module] = hidden.get("models", [])
    state: dict[str, Any] = {f"model_{i}": get_model_state_dict(model) for i, model in enumerate(models)}
    pairs = []
    for i, wrapped in enumerate(hidden.get("optimizers", [])):
        optimizer = _plain_optimizer(wrapped)
        model = _owner(optimizer, models, i)
        state[f"optimizer_{i}"] = get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS)
        pairs.append((model, optimizer))
    return state, pairs


def _save_through_reshard(hidden: dict[str, list[Any]], output_dir: str, timeout: float | None) -> None:
    """The save pre-hook: one reshard checkpoint of the models and optimizers in ``<output_dir>/reshard``,
    replacing one saved there before (as accelerate overwrites its files). **Collective**: every process."""
    state, _ = _state(hidden)
    with torch.no_grad():
        save(state, f"{output_dir.rstrip('/')}/{RESHARD_FOLDER}", overwrite=True, timeout=timeout)


def _load_through_reshard(hidden: dict[str, list[Any]], input_dir: str, timeout: float | None) -> None:
    """The load pre-hook: the models and optimizers from ``<input_dir>/reshard`` into their current layout,
    before accelerate loads anything (a missing or bad checkpoint raises reshard's error on every process and
    changes nothing: ``CheckpointNotFoundError`` for a state saved without ``use_reshard``). **Collective**."""
    path = f"{input_dir.rstrip('/')}/{RESHARD_FOLDER}"
    state, pairs = _state(hidden)
    with torch.no_grad():
        loaded = load(state, path, strict=True, timeout=timeout)
    models: list[torch.nn.Module] = hidden.get("models", [])
    for i, model in enumerate(models):
        set_model_state_dict(model, loaded[f"model_{i}"])
    for i, (model, optimizer) in enumerate(pairs):
        set_optimizer_state_dict(model, optimizer, loaded[f"optimizer_{i}"], options=_OPTIM_OPTIONS)
