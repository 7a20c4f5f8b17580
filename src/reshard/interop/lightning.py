"""PyTorch Lightning checkpoints through reshard: ``ReshardCheckpointIO`` and ``ReshardModelParallelStrategy``.

Lightning (``pytorch-lightning`` 2.6) writes a checkpoint through its strategy: ``Trainer.save_checkpoint``,
``ModelCheckpoint`` and ``trainer.fit(ckpt_path=...)`` call ``strategy.save_checkpoint`` / ``load_checkpoint`` /
``remove_checkpoint``, which the single-device and DDP strategies hand to the ``CheckpointIO`` plugin (on the
global rank 0 only for a save and a removal; on every rank for a load).

- :class:`ReshardCheckpointIO` (``Trainer(plugins=[ReshardCheckpointIO()])``) stores Lightning's checkpoint dict
  (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``, ``epoch``, ``global_step``,
  ``hyper_parameters``...) as one reshard checkpoint, a directory at the path Lightning names (``...ckpt``): its
  tensors as tensors, everything else as reshard's common values (tagged JSON, never pickle), plus the shape of
  the dict (which containers are dicts with int keys, lists, tuples) so that a load returns the same structure.
  A value that tagged JSON cannot hold raises ``StateDictError`` naming its key, before anything is written.
- :class:`ReshardModelParallelStrategy` (``Trainer(strategy=ReshardModelParallelStrategy(...))``) is Lightning's
  ``ModelParallelStrategy`` (FSDP2 and DTensor tensor parallelism from ``configure_model``) whose sharded
  checkpoint is a reshard checkpoint saved by all ranks together: each rank writes its shards, and a resume at
  another mesh or world size loads each rank's shards of the new layout.

Saves are atomic (a checkpoint is complete once its ``metadata.json`` is committed; an overwritten one stays
loadable until then) and a removal deletes only the files a reshard save wrote in that directory
(:func:`reshard.io.retirement.delete_checkpoint`). ``s3://`` and ``gs://`` paths pass through Lightning to reshard
unchanged (``storage_options`` of the plugin or strategy). Lightning is imported here only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
from pytorch_lightning.strategies.model_parallel import ModelParallelStrategy

from reshard.errors import CheckpointError, CorruptCheckpointError, StateDictError
from reshard.flows.load import load, read_metadata
from reshard.flows.options import LoadOptions, SaveOptions
from reshard.flows.save import save
from reshard.io.retirement import delete_checkpoint
from reshard.io.verified import check_data_files
from reshard.metadata import Metadata
from reshard.net.comm import Communicator
from reshard.net.transports import SingleProcess
from reshard.storage import storage_for

__all__ = ["MAX_STRUCTURE_DEPTH", "STRUCTURE_KEY", "ReshardCheckpointIO", "ReshardModelParallelStrategy"]

STRUCTURE_KEY = "reshard_lightning_structure"
"""The top-level key under which the checkpoint dict's structure is stored (a JSON string, a common value)."""

_TIMEOUT_S = 600.0


# ---- the structure of a checkpoint dict -------------------------------------------------------------------


def structure_of(obj: object) -> object:
    """The containers of ``obj`` as JSON: ``{"dict": [[key, child]...]}``, ``{"list": [...]}``,
    ``{"tuple": [...]}``; ``"tensor"`` for a tensor leaf and ``"value"`` for any other leaf. reshard's dotted
    paths alone cannot tell a list from a dict with int keys, or an int key from a str one."""
    if isinstance(obj, Mapping):
        return {"dict": [[key, structure_of(value)] for key, value in obj.items()]}
    if isinstance(obj, list):
        return {"list": [structure_of(value) for value in obj]}
    if isinstance(obj, tuple):  # a torch.Size too: reshard stores it as the tuple of its sizes
        return {"tuple": [structure_of(value) for value in obj]}
    return "tensor" if isinstance(obj, torch.Tensor) else "value"


def _dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in path)


MAX_STRUCTURE_DEPTH = 100
"""Nesting deeper than this in a saved structure record is refused (a forged record must not exhaust the stack)."""


def template_of(
    structure: object, metadata: Metadata, device: torch.device, path: tuple[str | int, ...] = ()
) -> object:
    """A load template of ``structure``: each tensor an empty tensor of its saved global shape and dtype on
    ``device`` (filled by the load), each other leaf a placeholder the load replaces with the saved value.
    CheckpointError for a record that :func:`structure_of` cannot have written."""
    where = _dotted(path) or "<root>"
    if len(path) > MAX_STRUCTURE_DEPTH:
        raise CheckpointError(f"{where}: the Lightning structure record nests deeper than {MAX_STRUCTURE_DEPTH}")
    if structure == "value":
        return None
    if structure == "tensor":
        saved = metadata.tensors.get(_dotted(path))
        if saved is None:
            raise CheckpointError(f"{where}: the checkpoint's structure names a tensor it does not hold")
        return torch.empty(saved.global_shape, dtype=saved.torch_dtype, device=device)
    if not isinstance(structure, dict) or len(structure) != 1:
        raise CheckpointError(f"{where}: malformed Lightning structure record")
    ((kind, children),) = structure.items()
    if kind not in ("dict", "list", "tuple") or not isinstance(children, list):
        raise CheckpointError(f"{where}: malformed Lightning structure record (kind {kind!r})")
    if kind == "dict":
        pairs = [_dict_entry(child, where) for child in children]
        if len({key for key, _ in pairs}) != len(pairs):
            raise CheckpointError(f"{where}: malformed Lightning structure record (a key twice)")
        return {key: template_of(child, metadata, device, (*path, key)) for key, child in pairs}
    items = [template_of(child, metadata, device, (*path, i)) for i, child in enumerate(children)]
    return tuple(items) if kind == "tuple" else items


def _dict_entry(entry: object, where: str) -> tuple[str | int, object]:
    """One ``[key, child]`` pair of a dict's record: a str or int key (bool is not an int here)."""
    if not isinstance(entry, list) or len(entry) != 2:
        raise CheckpointError(f"{where}: malformed Lightning structure record (a dict entry {entry!r:.80})")
    key, child = entry
    if not isinstance(key, str | int) or isinstance(key, bool):
        raise CheckpointError(f"{where}: malformed Lightning structure record (a dict key {key!r:.80})")
    return key, child


def _tensors_of(template: object, path: tuple[str | int, ...] = ()) -> dict[str, torch.Tensor]:
    """The template's tensors by dotted path."""
    if isinstance(template, torch.Tensor):
        return {_dotted(path): template}
    items = (
        template.items()
        if isinstance(template, dict)
        else enumerate(template)
        if isinstance(template, list | tuple)
        else ()
    )
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_tensors_of(value, (*path, key)))
    return out


def checked_template(where: str, metadata: Metadata, device: torch.device, storage_options: Any) -> object:
    """The load template of the checkpoint at ``where`` (:func:`template_of`), allocated only after every data
    file was found at the size the metadata says, and bounded by them: the tensors' bytes come from files that
    exist, never from a number of the metadata alone (docs/reliability.md, section 5)."""
    storage = storage_for(where, storage_options)
    try:
        check_data_files(storage, metadata)
    finally:
        storage.close()
    structure = saved_structure(metadata, where)
    on_disk = sum(entry.size for entry in metadata.files)
    tensors = _tensors_of(template_of(structure, metadata, torch.device("meta")))
    if set(tensors) != set(metadata.tensors):
        raise CheckpointError(f"{where}: its Lightning structure record does not name every tensor it holds")
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    if needed > on_disk:
        raise CorruptCheckpointError(f"{where}: its tensors need {needed} bytes, its data files hold {on_disk}")
    return template_of(structure, metadata, device)


def with_structure(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` plus its structure under :data:`STRUCTURE_KEY`, which it must not use itself."""
    if STRUCTURE_KEY in checkpoint:
        raise StateDictError(f"{STRUCTURE_KEY}: the checkpoint dict uses the key reshard keeps its structure in")
    return {**checkpoint, STRUCTURE_KEY: json.dumps(structure_of(checkpoint))}


def saved_structure(metadata: Metadata, where: str) -> object:
    """The structure a :class:`ReshardCheckpointIO` save recorded; CheckpointError for another checkpoint."""
    raw = metadata.common.get(STRUCTURE_KEY)
    if not isinstance(raw, str):
        raise CheckpointError(f"{where}: not a Lightning checkpoint saved through reshard (no {STRUCTURE_KEY})")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"{where}: malformed {STRUCTURE_KEY}: {exc}") from exc


def _location(path: str | os.PathLike[str]) -> str:
    text = os.fspath(path)
    return text if "://" in text else os.path.abspath(text)


def _device_of(map_location: Any) -> torch.device:
    """The device of a load's tensors: ``map_location`` as a device or its name (None: the CPU). A function or a
    dict of ``torch.load`` cannot be honoured: CheckpointError, never ignored."""
    if map_location is None:
        return torch.device("cpu")
    if isinstance(map_location, str | torch.device):
        try:
            device = torch.device(map_location)
        except RuntimeError as exc:
            raise CheckpointError(f"map_location={map_location!r}: not a device: {exc}") from exc
        if device.type == "meta":
            raise CheckpointError(f"map_location={map_location!r}: a load needs a device that holds the values")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise CheckpointError(f"map_location={map_location!r}: CUDA is not available in this process")
        return device
    raise CheckpointError(
        f"map_location={map_location!r}: ReshardCheckpointIO takes a device or a device name, not a "
        "function or a dict (torch.load's storage remapping)"
    )


def _options(storage_options: Any, default: dict[str, Any] | None) -> dict[str, Any] | None:
    if storage_options is None:
        return default
    if not isinstance(storage_options, dict):
        raise CheckpointError(
            f"storage_options={storage_options!r}: reshard takes a dict of the object-store client's options"
        )
    return storage_options


def _remove(path: str, storage_options: dict[str, Any] | None) -> None:
    """Delete the reshard checkpoint at ``path``: only the files a reshard save wrote there (never the
    directory's other files, never its parent)."""
    if "://" not in path and os.path.islink(path):
        # Lightning's own link (ModelCheckpoint(save_last="link")): the link goes, never what it points at.
        os.unlink(path)
        return
    storage = storage_for(path, storage_options)
    try:
        if storage.root_exists():
            delete_checkpoint(storage)
    finally:
        storage.close()


# ---- the CheckpointIO plugin ------------------------------------------------------------------------------


class ReshardCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` over reshard, for the single-device and DDP strategies.

    Not collective: Lightning saves and removes on the global rank 0 only and loads on every rank, each alone
    (a group of one process; the checkpoint's tensors are whole, as the DDP replicas hold them). A checkpoint
    saved at any world size therefore resumes at any other.

    Args:
        storage_options: the object-store client's options for ``s3://`` and ``gs://`` paths.
        save_options, load_options: reshard's :class:`~reshard.SaveOptions` / :class:`~reshard.LoadOptions`.
        timeout_s: how long a save or load may wait (it has no peers: storage only).
    """

    def __init__(
        self,
        *,
        storage_options: dict[str, Any] | None = None,
        save_options: SaveOptions | None = None,
        load_options: LoadOptions | None = None,
        timeout_s: float = _TIMEOUT_S,
    ) -> None:
        self.storage_options = storage_options
        self.save_options = save_options
        self.load_options = load_options
        self.timeout_s = timeout_s

    def _alone(self) -> SingleProcess:
        import datetime

        return SingleProcess(datetime.timedelta(seconds=self.timeout_s))

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as a reshard checkpoint at the directory ``path``, replacing one already there
        atomically (Lightning's ``last.ckpt`` is saved again and again). ``storage_options``: for this save
        instead of the plugin's."""
        with torch.no_grad():
            save(
                with_structure(checkpoint),
                _location(path),
                group=self._alone(),
                overwrite=True,
                options=self.save_options,
                storage_options=_options(storage_options, self.storage_options),
            )

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``, tensors on ``map_location`` (a device; default the CPU).
        ``weights_only`` changes nothing: reshard never unpickles, so every load is as safe as ``True``."""
        del weights_only
        where = _location(path)
        device = _device_of(map_location)
        # A missing checkpoint is reshard's CheckpointNotFoundError, which is a FileNotFoundError as Lightning
        # expects of a CheckpointIO.
        metadata = read_metadata(where, storage_options=self.storage_options)
        template = checked_template(where, metadata, device, self.storage_options)
        with torch.no_grad():
            loaded = load(
                template,
                where,
                group=self._alone(),
                options=self.load_options,
                storage_options=self.storage_options,
            )
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{where}: the saved checkpoint is not a dict")
        return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Delete the reshard checkpoint at ``path`` (``ModelCheckpoint``'s ``save_top_k``): only the files a
        reshard save wrote there; other files and the directory holding them stay."""
        _remove(_location(path), self.storage_options)


# ---- the model-parallel strategy --------------------------------------------------------------------------


class ReshardModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / DTensor TP) whose sharded checkpoints are reshard's.

    ``save_checkpoint`` and ``load_checkpoint`` are **collective** over the default process group: Lightning
    calls them on every rank. The model's and optimizers' state dicts stay sharded (DTensors, each rank writes its
    shards); a load fills templates of the current layout (any mesh or world size) and sets them into the model
    and optimizers, as Lightning's own DCP path does. Takes ``ModelParallelStrategy``'s arguments except
    ``save_distributed_checkpoint`` (always a sharded reshard checkpoint), plus ``storage_options``,
    ``save_options`` and ``load_options``.
    """

    def __init__(
        self,
        *args: Any,
        storage_options: dict[str, Any] | None = None,
        save_options: SaveOptions | None = None,
        load_options: LoadOptions | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise CheckpointError(
                "ReshardModelParallelStrategy saves sharded reshard checkpoints only: save_distributed_checkpoint "
                "must be True (a reshard checkpoint loads into one process anyway)"
            )
        super().__init__(*args, **kwargs)
        self.reshard_storage_options = storage_options
        self.reshard_save_options = save_options
        self.reshard_load_options = load_options

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str], storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` (its sharded ``state_dict`` and ``optimizer_states``, the rest as common values)
        as one reshard checkpoint at the directory rank 0 names. Collective: every rank calls it."""
        path = _location(self.broadcast(filepath))
        with torch.no_grad():
            save(
                with_structure(checkpoint),
                path,
                overwrite=True,
                options=self.reshard_save_options,
                storage_options=_options(storage_options, self.reshard_storage_options),
            )

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Delete the reshard checkpoint at ``filepath`` on the global rank 0 (``ModelCheckpoint``'s
        ``save_top_k``): only the files a reshard save wrote there. Lightning's default would hand it to its
        ``TorchCheckpointIO``, which removes the whole directory, whatever else it holds."""
        if self.is_global_zero:
            _remove(_location(filepath), self.reshard_storage_options)

    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint at the path rank 0 names into the model and optimizers (any layout) and return
        the rest of the checkpoint dict for Lightning (loops, callbacks, epoch, ...). Collective."""
        del weights_only
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        path = _location(self.broadcast(checkpoint_path))
        prepared: list[tuple[dict[str, Any], list[Any]]] = []
        # One agreed step: a checkpoint one rank cannot use is the same error on every rank (none waits in load).
        Communicator(None).step("lightning.template", lambda: prepared.append(self._template(path)))
        template, optimizers = prepared[0]
        with torch.no_grad():
            loaded = load(
                template, path, options=self.reshard_load_options, storage_options=self.reshard_storage_options
            )
        assert self.model is not None
        strict = self.lightning_module.strict_loading if self.lightning_module is not None else True
        set_model_state_dict(self.model, loaded.pop("state_dict"), options=_sharded(strict=strict))
        for optimizer, state in zip(optimizers, loaded.pop("optimizer_states", []), strict=True):
            set_optimizer_state_dict(self.model, optimizer, state, options=_sharded(strict=strict))
        return dict(loaded)

    def _template(self, path: str) -> tuple[dict[str, Any], list[Any]]:
        """The load template: the model's and optimizers' live sharded state dicts, and the checkpoint's other
        tensors allocated on the CPU (built on the meta device first, so that the model and optimizer entries,
        replaced by the live ones, are never allocated at their global shapes); the optimizers, unwrapped."""
        metadata = read_metadata(path, storage_options=self.reshard_storage_options)
        template = checked_template(path, metadata, torch.device("meta"), self.reshard_storage_options)
        if not isinstance(template, dict):
            raise CheckpointError(f"{path}: the saved checkpoint is not a dict")
        optimizers = self._live_templates(template, path)
        materialized = _on_cpu(template)
        assert isinstance(materialized, dict)
        return materialized, optimizers

    def _live_templates(self, template: dict[str, Any], where: str) -> list[Any]:
        """Put the model's and optimizers' current sharded state dicts in ``template`` (the layout the load
        fills: this rank's shards of the current mesh); the optimizers, unwrapped."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        assert self.model is not None
        optimizers = [getattr(opt, "_optimizer", opt) for opt in self.optimizers]
        saved = template.get("optimizer_states", [])
        if len(saved) != len(optimizers):
            raise CheckpointError(f"{where}: holds {len(saved)} optimizer states, the model has {len(optimizers)}")
        template["state_dict"] = get_model_state_dict(self.model, options=_sharded(strict=True))
        template["optimizer_states"] = [
            _with_saved_groups(get_optimizer_state_dict(self.model, opt, options=_sharded(strict=True)), old)
            for opt, old in zip(optimizers, saved, strict=True)
        ]
        return optimizers


def _on_cpu(template: object) -> object:
    """``template`` with each tensor on the meta device replaced by an empty CPU tensor of its shape and dtype."""
    if isinstance(template, torch.Tensor):
        return torch.empty(template.shape, dtype=template.dtype) if template.is_meta else template
    if isinstance(template, dict):
        return {key: _on_cpu(value) for key, value in template.items()}
    if isinstance(template, list | tuple):
        items = [_on_cpu(value) for value in template]
        return tuple(items) if isinstance(template, tuple) else items
    return template


def _sharded(*, strict: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, cpu_offload=False, strict=strict)


def _with_saved_groups(live: dict[str, Any], saved: Any) -> dict[str, Any]:
    """The live optimizer state dict (its tensors are the templates), with the saved ``param_groups``'
    structure (the load replaces their values with the saved hyperparameters)."""
    if isinstance(saved, dict) and "param_groups" in saved:
        return {**live, "param_groups": saved["param_groups"]}
    return live
