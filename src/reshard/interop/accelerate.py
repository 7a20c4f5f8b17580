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
chosen it (automatic naming, ``total_limit``) and before it writes or reads its own files. The load hook loads
there. The save hook only records the directory: reshard's checkpoint is saved after accelerate has written its
own files, with their SHA-256 digests as a common value, so that its commit is the commit of the whole directory;
``load_state`` refuses a directory whose accelerate files are not the ones recorded (a save killed between
accelerate's files and reshard's commit), with ``CheckpointError`` on every process, before anything is loaded.
Hooks alone cannot replace accelerate's model and optimizer files (under FSDP its DCP save runs before the hook; the
optimizers are always saved by ``save_accelerator_state``), so for the duration of each call the accelerator's
model and optimizer lists are handed to reshard and hidden from accelerate's own model and optimizer code, then
restored. ``ReshardHandle.remove()`` undoes all of it.

accelerate is imported here only: ``import reshard`` never needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
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
from reshard.flows.load import load, read_metadata
from reshard.flows.save import save

__all__ = ["ACCELERATE_FILES_KEY", "RESHARD_FOLDER", "ReshardHandle", "use_reshard"]

RESHARD_FOLDER = "reshard"
"""The reshard checkpoint's folder inside an accelerate state directory."""

ACCELERATE_FILES_KEY = "accelerate_files"
"""The common value of the reshard checkpoint that records accelerate's own files of the same save: a JSON
object of file name to SHA-256 hex digest."""

_ACCELERATE_PREFIXES = ("scheduler", "sampler", "dl_state_dict", "scaler.pt", "random_states_", "custom_checkpoint_")
"""The names of the files accelerate's ``save_accelerator_state`` and ``save_custom_state`` write (models and
optimizers excepted: reshard saves those); other files of the directory are the user's and are not recorded."""

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
        hidden["output_dir"] = [output_dir]  # saved after accelerate's files (see the module doc)

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
            location = original_save(output_dir, *args, **kwargs)
            accelerator.wait_for_everyone()  # every process's files are written before any is recorded
            _save_through_reshard(hidden, hidden["output_dir"][0], timeout)
            return location

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


def accelerate_files(directory: str) -> dict[str, str]:
    """SHA-256 of each file accelerate wrote itself in ``directory`` (:data:`_ACCELERATE_PREFIXES`), by name."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(_ACCELERATE_PREFIXES) and os.path.isfile(path):
            digest = hashlib.sha256()
            with open(path, "rb") as file:
                for block in iter(lambda: file.read(1 << 20), b""):
                    digest.update(block)
            out[name] = digest.hexdigest()
    return out


def _save_through_reshard(hidden: dict[str, list[Any]], output_dir: str, timeout: float | None) -> None:
    """After accelerate's own files: one reshard checkpoint of the models and optimizers in
    ``<output_dir>/reshard`` with the digests of those files, replacing one saved there before (as accelerate
    overwrites its files). Its commit is the point where the directory holds the new save. **Collective**: every
    process (the coordinator's digests are stored; every process read the same files after a barrier)."""
    state, _ = _state(hidden)
    state[ACCELERATE_FILES_KEY] = json.dumps(accelerate_files(output_dir), sort_keys=True)
    with torch.no_grad():
        save(state, f"{output_dir.rstrip('/')}/{RESHARD_FOLDER}", overwrite=True, timeout=timeout)


def _check_accelerate_files(input_dir: str, path: str) -> None:
    """Refuse a directory whose accelerate files are not those the reshard checkpoint recorded (two saves mixed,
    a file changed). Every process reads the metadata and the files; the verdict is agreed over the default
    group (**collective** when a group is initialized: every process), so all raise the same error or none."""
    error: CheckpointError | None = None
    try:
        recorded = read_metadata(path).common.get(ACCELERATE_FILES_KEY)
        if not isinstance(recorded, str):
            error = CheckpointError(
                f"{path}: no record of accelerate's files ({ACCELERATE_FILES_KEY}); not saved "
                "by this version of use_reshard"
            )
        elif json.loads(recorded) != accelerate_files(input_dir):
            error = CheckpointError(
                f"{input_dir}: accelerate's files (scheduler, RNG states, step, registered objects) are not those "
                f"saved with the reshard checkpoint in {path}: the directory mixes two saves (a save_state that did "
                "not finish?) or a file was changed; load another state directory"
            )
    except CheckpointError as exc:
        error = exc
    except (OSError, ValueError) as exc:
        error = CheckpointError(f"{input_dir}: cannot read accelerate's files: {exc}")
    failed = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(failed)
    if error is not None:
        raise error
    if int(failed.item()):
        raise CheckpointError(f"{input_dir}: another process found accelerate's files or the checkpoint unusable")


def _load_through_reshard(hidden: dict[str, list[Any]], input_dir: str, timeout: float | None) -> None:
    """The load pre-hook: the models and optimizers from ``<input_dir>/reshard`` into their current layout,
    before accelerate loads anything, once accelerate's files are checked against the checkpoint's record (a
    missing or bad checkpoint, or files of another save, raise reshard's error on every process and change
    nothing: ``CheckpointNotFoundError`` for a state saved without ``use_reshard``). **Collective**."""
    path = f"{input_dir.rstrip('/')}/{RESHARD_FOLDER}"
    _check_accelerate_files(input_dir, path)
    state, pairs = _state(hidden)
    state[ACCELERATE_FILES_KEY] = ""
    with torch.no_grad():
        loaded = load(state, path, strict=True, timeout=timeout)
    models: list[torch.nn.Module] = hidden.get("models", [])
    for i, model in enumerate(models):
        set_model_state_dict(model, loaded[f"model_{i}"])
    for i, (model, optimizer) in enumerate(pairs):
        set_optimizer_state_dict(model, optimizer, loaded[f"optimizer_{i}"], options=_OPTIM_OPTIONS)
