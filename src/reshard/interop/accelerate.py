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
import re
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

from reshard.errors import CheckpointError, MismatchError
from reshard.flows.load import load, read_metadata
from reshard.flows.save import save
from reshard.metadata import Metadata
from reshard.net.comm import Communicator, parse_timeout

__all__ = ["ACCELERATE_FILES_KEY", "RESHARD_FOLDER", "ReshardHandle", "use_reshard"]

RESHARD_FOLDER = "reshard"
"""The reshard checkpoint's folder inside an accelerate state directory."""

ACCELERATE_FILES_KEY = "accelerate_files"
"""The common value of the reshard checkpoint that records accelerate's own files of the same save: a JSON
object of file name to SHA-256 hex digest."""

_ACCELERATE_PREFIXES = ("scheduler", "sampler", "dl_state_dict", "scaler.pt", "random_states_", "custom_checkpoint_")
"""The names of the files accelerate's ``save_accelerator_state`` and ``save_custom_state`` write (models and
optimizers excepted: reshard saves those); other files of the directory are the user's and are not recorded."""

_ACCELERATE_OWN_MODEL_FILES = re.compile(
    r"^(?:(?:pytorch_)?model(?:_[0-9]+)?\.(?:safetensors|bin)|optimizer(?:_[0-9]+)?\.bin|pytorch_model_fsdp_[0-9]+|optimizer_[0-9]+)$"
)
"""accelerate's own model and optimizer files and folders (written by ``save_state`` without reshard): a reshard
save into a directory holding them is refused, or a later load without reshard would read them with the new
save's scheduler and step."""

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
    if not isinstance(accelerator, Accelerator):
        raise CheckpointError(f"use_reshard takes an accelerate.Accelerator, not {type(accelerator).__name__}")
    _, problem = parse_timeout(timeout)
    if problem is not None:
        raise CheckpointError(f"use_reshard: {problem}")
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
    def save_state(output_dir: str | os.PathLike[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        output_dir = None if output_dir is None else os.fspath(output_dir)
        _refuse_url(output_dir)
        with _hidden_from_accelerate(accelerator, hidden):
            # Everything reshard could refuse is decided before accelerate chooses, deletes (total_limit) or
            # writes anything; the state dicts do not change while accelerate writes its own files.
            state = _prepared_save(hidden, output_dir, timeout)
            written: list[Any] = []
            try:
                written.append(original_save(output_dir, *args, **kwargs))
            finally:
                # Every process's files are written before any is recorded; a process whose own writes failed
                # makes every process fail here (accelerate's plain barrier would leave the others waiting).
                Communicator(None, timeout=timeout).step("accelerate.saved", lambda: _raise_unless(written))
            _save_through_reshard(state, hidden["output_dir"][0], timeout)
            return written[0]

    @functools.wraps(original_load)
    def load_state(input_dir: str | os.PathLike[str] | None = None, *args: Any, **kwargs: Any) -> Any:
        input_dir = None if input_dir is None else os.fspath(input_dir)
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


def _raise_unless(written: list[Any]) -> None:
    if not written:
        raise CheckpointError("accelerate's own save_state failed on this process (its error is raised there)")


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


def _model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``get_model_state_dict`` (FSDP2 / DTensor leaves stay sharded); a model without parameters or buffers
    has the empty state torch's helper refuses to compute outside a process group."""
    if next(model.parameters(), None) is None and next(model.buffers(), None) is None:
        return {}
    return dict(get_model_state_dict(model))


def _optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, template: bool = False
) -> dict[str, Any]:
    """The flattened ``get_optimizer_state_dict``, leaving the optimizer as it was. torch's helper gives an
    optimizer that has not stepped yet a state by stepping it with zero gradients (Adam's step counter becomes
    1, which changes every later update); that state is dropped again here, and an optimizer without state
    saves its hyperparameters only, as accelerate's own ``optimizer.state_dict()`` does. ``template``: for a
    load, whose template keeps the state entries (filled from the checkpoint where it has them)."""
    fresh = not optimizer.state
    state = dict(get_optimizer_state_dict(model, optimizer, options=_OPTIM_OPTIONS))
    if fresh:
        optimizer.state.clear()
        if not template:
            state = {key: value for key, value in state.items() if not key.startswith("state.")}
    return state


def _state(
    hidden: dict[str, list[Any]], *, template: bool = False
) -> tuple[dict[str, Any], list[tuple[torch.nn.Module, Any]]]:
    """The state dict reshard saves (``template``: the template it loads into), and (model, optimizer) pairs."""
    models: list[torch.nn.Module] = hidden.get("models", [])
    state: dict[str, Any] = {f"model_{i}": _model_state(model) for i, model in enumerate(models)}
    pairs = []
    for i, wrapped in enumerate(hidden.get("optimizers", [])):
        optimizer = _plain_optimizer(wrapped)
        model = _owner(optimizer, models, i)
        state[f"optimizer_{i}"] = _optimizer_state(model, optimizer, template=template)
        pairs.append((model, optimizer))
    return state, pairs


def _prepared_save(hidden: dict[str, list[Any]], output_dir: str | None, timeout: float | None) -> dict[str, Any]:
    """The state dict a ``save_state`` will write, built and agreed before accelerate does anything: a model or
    optimizer reshard cannot save, or a directory holding accelerate's own model files, is the same
    ``CheckpointError`` on every process while nothing was deleted or written. **Collective**: every process."""
    built: dict[str, Any] = {}

    def local() -> None:
        if output_dir is not None and os.path.isdir(output_dir):
            own = sorted(name for name in os.listdir(output_dir) if _ACCELERATE_OWN_MODEL_FILES.match(name))
            if own:
                raise CheckpointError(
                    f"{output_dir} holds accelerate's own model or optimizer files {own[:4]} (a save_state without "
                    "use_reshard): a load without reshard would read them with this save's scheduler and step; "
                    "save to a new directory or remove them"
                )
        built.update(_state(hidden)[0])

    Communicator(None, timeout=timeout).step("accelerate.prepare", local)
    return built


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


def _save_through_reshard(state: dict[str, Any], output_dir: str, timeout: float | None) -> None:
    """After accelerate's own files: one reshard checkpoint of the models and optimizers (``state``, from
    :func:`_prepared_save`) in ``<output_dir>/reshard`` with the digests of those files, replacing one saved there
    before (as accelerate overwrites its files). Its commit is the point where the directory holds the new save.
    **Collective**: every process (the coordinator's digests are stored; every process read the same files after
    a barrier)."""
    state = {**state, ACCELERATE_FILES_KEY: json.dumps(accelerate_files(output_dir), sort_keys=True)}
    with torch.no_grad():
        save(state, f"{output_dir.rstrip('/')}/{RESHARD_FOLDER}", overwrite=True, timeout=timeout)


def _check_accelerate_files(input_dir: str, path: str, timeout: float | None) -> Metadata:
    """The reshard checkpoint's metadata, once accelerate's files are found to be those it recorded (refused:
    two saves mixed, a file changed). Every process reads the metadata and the files; the verdict is agreed
    (**collective**: every process), so all raise the same error or none."""
    found: list[Metadata] = []

    def local() -> None:
        metadata = read_metadata(path)
        recorded = metadata.common.get(ACCELERATE_FILES_KEY)
        if not isinstance(recorded, str):
            raise CheckpointError(
                f"{path}: no record of accelerate's files ({ACCELERATE_FILES_KEY}); not saved by this version of "
                "use_reshard"
            )
        try:
            same = json.loads(recorded) == accelerate_files(input_dir)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{input_dir}: cannot read accelerate's files: {exc}") from exc
        if not same:
            raise CheckpointError(
                f"{input_dir}: accelerate's files (scheduler, RNG states, step, registered objects) are not those "
                f"saved with the reshard checkpoint in {path}: the directory mixes two saves (a save_state that did "
                "not finish?) or a file was changed; load another state directory"
            )
        found.append(metadata)

    Communicator(None, timeout=timeout).step("accelerate.check", local)
    return found[0]


def _saved_keys(metadata: Metadata) -> set[str]:
    return set(metadata.tensors) | set(metadata.objects) | set(metadata.common)


def _load_template(
    hidden: dict[str, list[Any]], metadata: Metadata, path: str
) -> tuple[dict[str, Any], list[tuple[torch.nn.Module, Any]], dict[str, Any]]:
    """The template of a load: the models' current state dicts and the optimizers' with the state entries the
    checkpoint holds (an optimizer saved before its first step, or a parameter that never had a gradient, has
    none); and the optimizers' whole templates (what :func:`_set_optimizer` fills the missing entries with).
    A saved model entry the model does not have is a MismatchError, as accelerate's strict ``load_state_dict``
    refuses an unexpected key."""
    state, pairs = _state(hidden, template=True)
    saved = _saved_keys(metadata)
    whole = {}
    for name, entries in state.items():
        if name.startswith("model_"):
            extra = sorted(key for key in saved if key.startswith(f"{name}.") and key[len(name) + 1 :] not in entries)
            if extra:
                raise MismatchError(f"{path}: {name} holds entries the prepared model does not have: {extra[:5]}")
        else:
            whole[name] = entries
            state[name] = {
                key: value
                for key, value in entries.items()
                if not key.startswith("state.") or f"{name}.{key}" in saved or _nested_in(f"{name}.{key}", saved)
            }
    state[ACCELERATE_FILES_KEY] = ""
    return state, pairs, whole


def _nested_in(key: str, saved: set[str]) -> bool:
    return any(entry.startswith(f"{key}.") for entry in saved)


def _storage(value: Any) -> int:
    local = value.to_local() if hasattr(value, "to_local") else value
    return int(local.untyped_storage().data_ptr())


def _set_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any], whole: dict[str, Any]
) -> None:
    """``set_optimizer_state_dict`` of what was loaded; a parameter the checkpoint held no state for starts with
    none, as with accelerate's own ``load_state_dict``. torch's helper wants an entry for every state of every
    parameter (it steps a fresh optimizer with zero gradients to make them), so the missing entries are given
    the template's own tensors and the states holding them are dropped after (an Adam step counter of 1 with
    zero moments would change every later update)."""
    missing = {key: value for key, value in whole.items() if key.startswith("state.") and key not in loaded}
    set_optimizer_state_dict(model, optimizer, {**loaded, **missing}, options=_OPTIM_OPTIONS)
    if not any(key.startswith("state.") for key in loaded):
        optimizer.state.clear()
        return
    marks = {_storage(value) for value in missing.values() if isinstance(value, torch.Tensor) and value.numel()}
    for param, entries in list(optimizer.state.items()):
        if any(
            isinstance(value, torch.Tensor) and value.numel() and _storage(value) in marks for value in entries.values()
        ):
            del optimizer.state[param]


def _load_through_reshard(hidden: dict[str, list[Any]], input_dir: str, timeout: float | None) -> None:
    """The load pre-hook: the models and optimizers from ``<input_dir>/reshard`` into their current layout,
    before accelerate loads anything, once accelerate's files are checked against the checkpoint's record (a
    missing or bad checkpoint, or files of another save, raise reshard's error on every process and change
    nothing: ``CheckpointNotFoundError`` for a state saved without ``use_reshard``). **Collective**."""
    path = f"{input_dir.rstrip('/')}/{RESHARD_FOLDER}"
    metadata = _check_accelerate_files(input_dir, path, timeout)
    template: list[tuple[dict[str, Any], list[tuple[torch.nn.Module, Any]], dict[str, Any]]] = []
    Communicator(None, timeout=timeout).step(
        "accelerate.template", lambda: template.append(_load_template(hidden, metadata, path))
    )
    state, pairs, whole = template[0]
    with torch.no_grad():
        loaded = load(state, path, strict=True, timeout=timeout)
    models: list[torch.nn.Module] = hidden.get("models", [])
    for i, model in enumerate(models):
        if loaded[f"model_{i}"] or _model_state(model):  # nothing to set in a model without state
            set_model_state_dict(model, loaded[f"model_{i}"])
    for i, (model, optimizer) in enumerate(pairs):
        _set_optimizer(model, optimizer, loaded[f"optimizer_{i}"], whole[f"optimizer_{i}"])
