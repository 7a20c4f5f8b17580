"""A torchtitan checkpoint manager backed by reshard: ``ReshardCheckpointManager``.

torchtitan (0.3) picks its checkpoint backend by the class of ``Trainer.Config.checkpoint``: the field is a
``BaseCheckpointManager.Config`` and ``config.checkpoint.build(...)`` constructs the class that declares that
``Config``. Setting ``checkpoint=ReshardCheckpointManager.Config(enable=True, ...)`` in a trainer config therefore
makes every ``trainer.checkpointer.save`` and ``load`` go through reshard, with no other change to torchtitan.

What it saves is what torchtitan's DCP manager saves (the model's state dict of FSDP2/TP DTensors, the flattened
optimizer state, the LR schedulers' state, the dataloader's per data-parallel-rank state and the train state), as
one reshard checkpoint per step under ``<dump_folder>/<folder>`` (``step_000000010``, ...) kept by a
``reshard.CheckpointManager`` (``keep_latest_k`` is its ``keep_last``). Because reshard loads any layout into
any other, a job resumes at another FSDP/TP degree (DCP does too for DTensors; the dataloader's per-rank state
needs the same data-parallel degree, else ``MismatchError`` on every rank unless ``exclude_from_loading``
names it), from ``s3://`` or ``gs://`` folders (``storage_options``), and with ``read_once`` (each byte read
from storage once and exchanged between ranks).

``async_mode`` ``"async"`` and ``"async_with_pinned_mem"`` save as torchtitan's DCP manager does: ``save`` returns
once the state is snapshotted into host buffers that reshard's :class:`~reshard.AsyncCheckpointer` keeps from one
save to the next (pinned for CUDA tensors), and a background thread saves the snapshot through the step manager
(lock, commit, ``latest``, retention) over a gloo group of its own, made when the manager is built, so that its
collectives never meet the training's. The next save, a load and ``close`` wait for it first (``close`` and
``maybe_wait_for_saving`` raise its error). The snapshot is complete when ``save`` returns in both modes, so
``maybe_wait_for_staging`` has nothing to wait for. A last-step save is synchronous, as in torchtitan.
Hugging Face safetensors (``initial_load_in_hf``, ``last_save_in_hf``) go through the trainer's state-dict adapter:
:mod:`reshard.interop.torchtitan_hf`.

Layouts: under torchtitan's ``spmd_backend`` ``"partial_dtensor"`` and ``"full_dtensor"`` every FSDP/TP
parameter of the state dict is a DTensor whose placements say its box of the global tensor, which reshard saves
and loads at any other layout. Under ``"spmd_types"`` a parameter FSDP2 did not make a DTensor is a plain tensor
of the rank's local shard: on more than one rank the manager refuses it when it is built (``CheckpointError``),
never saving rank 0's shard as the whole tensor.

torchtitan is imported here only: ``import reshard`` never needs it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.utils import get_spmd_backend

from reshard.errors import CheckpointError, CheckpointNotFoundError
from reshard.flows.async_save import AsyncCheckpointer
from reshard.flows.load import load
from reshard.flows.manager import CheckpointManager
from reshard.flows.options import LoadOptions
from reshard.interop.torchtitan_hf import export_hf, load_hf_model
from reshard.net.comm import Communicator
from reshard.state.sharding import ShardedObject

__all__ = ["ReshardCheckpointManager"]

logger = logging.getLogger("reshard")

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


def _is_remote(path: str) -> bool:
    return "://" in path


def _join(base: str, folder: str) -> str:
    if not base or _is_remote(folder) or os.path.isabs(folder):
        return folder
    return base.rstrip("/") + "/" + folder


class ReshardCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """torchtitan's checkpoint manager contract (``save``, ``load``, ``close``, the waits) over reshard.

    Built by torchtitan's trainer from its ``Config`` with the trainer's dataloader, model parts, optimizers,
    LR schedulers and extra states (``{"train_state": trainer}``). ``save`` and ``load`` are collective over the
    default process group: every rank of the job calls them at the same step, as torchtitan's trainer does.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        """torchtitan's shared checkpoint policies, plus what reshard adds."""

        async_mode: str = "disabled"
        """``"disabled"``, ``"async"`` or ``"async_with_pinned_mem"`` (see the module doc); any other value
        raises ``CheckpointError`` when the manager is built."""

        storage_options: dict[str, Any] | None = None
        """Options of the object-store client for an ``s3://`` or ``gs://`` folder (``endpoint_url``, ...)."""

        read_once: bool | None = None
        """``LoadOptions(read_once=...)`` of every load: None lets reshard decide."""

        timeout_s: float | None = None
        """How long any collective of a save or load may wait for the slowest rank (None: reshard's default)."""

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        _agree_on_config(config, sd_adapter, model_parts)
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Future[None] | None = None
        self.config = config
        self.folder = _join(base_folder, config.folder)
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers})
        self.states.update({DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.sd_adapter = sd_adapter
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self._replica: int | None = None
        self._snapshots: AsyncCheckpointer | None = None
        self._executor: ThreadPoolExecutor | None = None
        group = None
        if config.async_mode != "disabled":
            group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            self._snapshots = AsyncCheckpointer(group=group, timeout=config.timeout_s)
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reshard-torchtitan-save")
        self._manager: CheckpointManager | None = CheckpointManager(
            self.folder,
            keep_last=config.keep_latest_k or None,
            group=group,
            storage_options=config.storage_options,
            timeout=config.timeout_s,
        )

    def __del__(self) -> None:
        try:
            self.close()
        except Exception as exc:  # a finaliser must not raise; close() called by the trainer raises it
            logger.warning("closing the reshard torchtitan checkpoint manager failed: %s", exc)

    # ---- save ------------------------------------------------------------------------------------------

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save step ``curr_step`` when torchtitan's policy says so (the interval, the first step, the last
        step). **Collective** over the default group: every rank calls it at every step."""
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step and self.config.last_save_model_only:
            self._save_model_only(curr_step)
            return True
        state = self._full_state(self.states)
        with torch.no_grad():
            if self._snapshots is None or last_step:
                self._root().save(curr_step, state, overwrite=True)
            else:
                self._save_in_background(curr_step, self._snapshots.snapshot(state))
        return True

    def _save_model_only(self, curr_step: int) -> None:
        """The last step's model-only checkpoint in ``export_dtype``; with ``last_save_in_hf`` under the
        adapter's HF names, then exported as HF safetensors to ``<folder>/step-<N>``. Collective."""
        model = self._export_model()
        if self.config.last_save_in_hf:
            with torch.no_grad():
                self._root().save(curr_step, self.sd_adapter.to_hf(model), overwrite=True)
            export_hf(
                self._root().path_of(curr_step),
                _join(self.folder, f"step-{curr_step}"),
                storage_options=self.config.storage_options,
                timeout=self.config.timeout_s,
            )
            return
        with torch.no_grad():
            self._root().save(curr_step, {MODEL: model}, overwrite=True)

    def _save_in_background(self, curr_step: int, snapshot: dict[str, Any]) -> None:
        """Save ``snapshot`` (host copies) as step ``curr_step`` on the background thread; ``save_future`` is
        its outcome. The step manager's collectives run over the manager's own gloo group."""
        manager, executor = self._root(), self._executor
        assert executor is not None

        def run() -> None:
            with torch.no_grad():
                manager.save(curr_step, snapshot, overwrite=True)

        self.save_future = executor.submit(run)

    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.config.load_only:
            return False
        if curr_step == 1 and self.config.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.config.interval == 0

    def _export_model(self) -> dict[str, Any]:
        """The model state of a last-step, model-only checkpoint, floating tensors cast to ``export_dtype``."""
        dtype = self.export_dtype
        return {
            key: value.to(dtype)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype
            else value
            for key, value in self.states[MODEL].state_dict().items()
        }

    def _full_state(self, states: dict[str, Any]) -> dict[str, Any]:
        """The state dict reshard saves (and the template it loads into) for the entries of ``states``."""
        out: dict[str, Any] = {}
        for key, holder in states.items():
            if holder is None:
                continue
            if key == DATALOADER:
                out[key] = self._dataloader_object(holder.state_dict())
            else:
                out[key] = holder.state_dict()
        return out

    def _dataloader_object(self, loader_state: dict[str, Any]) -> Any:
        """torchtitan's dataloader state (``{"dp_rank_<r>": pickled bytes, "world_size": n}``) as one cell of a
        grid of data-parallel ranks; the ranks of one data-parallel rank (TP peers) are its replicas.
        Stored as the bytes torchtitan made, never unpickled by reshard."""
        if not loader_state:
            return {}
        ranks = [key for key in loader_state if key.startswith("dp_rank_")]
        if len(ranks) != 1 or "world_size" not in loader_state:
            raise CheckpointError(f"unexpected dataloader state keys {sorted(loader_state)}")
        dp_rank, dp_world = int(ranks[0][len("dp_rank_") :]), int(loader_state["world_size"])
        return ShardedObject(
            "dataloader", loader_state[ranks[0]], (dp_world,), (dp_rank,), replica_id=self._replica_of(dp_rank)
        )

    def _replica_of(self, dp_rank: int) -> int:
        """This rank's index among the ranks of its data-parallel rank, agreed once in one step of reshard's
        protocol (any backend of the default group: torchtitan's is NCCL on GPUs). **Collective** over the default
        group: every rank calls it at its first save or load of a dataloader state (every rank of a job has one)."""
        if self._replica is None:
            comm = Communicator(None, timeout=self.config.timeout_s)
            replicas = comm.step(
                "torchtitan.replicas", lambda: dp_rank, lambda ranks: [ranks[:i].count(r) for i, r in enumerate(ranks)]
            )
            self._replica = int(replicas[comm.rank])
        return self._replica

    # ---- load ------------------------------------------------------------------------------------------

    def _load(self, step: int = -1) -> bool:
        """Load step ``step`` of the folder (-1: the newest complete one), else the initial checkpoint
        (``initial_load_path``), into the trainer's objects. **Collective** over the default group.
        Returns False for a fresh start (nothing to load)."""
        self.maybe_wait_for_saving()
        options = LoadOptions(read_once=self.config.read_once)
        kwargs: dict[str, Any] = {"options": options, "strict": True}
        chosen = self._agreed_step(step)
        if chosen is not None:
            states = self._states_to_load(model_only=chosen == 0)
            loaded = load(
                self._full_state(states),
                self._root().path_of(chosen),
                timeout=self.config.timeout_s,
                **kwargs,
            )
        elif self.config.initial_load_in_hf:
            self._load_hf(options)
            return True
        elif self.config.initial_load_path:
            states = self._states_to_load(model_only=self.config.initial_load_model_only)
            loaded = load(
                self._full_state(states),
                self.config.initial_load_path,
                storage_options=self.config.storage_options,
                timeout=self.config.timeout_s,
                **kwargs,
            )
        else:
            return False
        self._apply(states, loaded)
        return True

    def _agreed_step(self, step: int) -> int | None:
        """The step every rank loads: ``step``, or the newest complete one for -1 (None: the folder has none),
        from listings that must agree (ranks that see different steps, on a file system with stale attribute
        caches say, would read different checkpoints). **Collective**: every rank; the same error on all."""

        def choose(listings: list[list[int]]) -> int | None:
            if any(listing != listings[0] for listing in listings):
                raise CheckpointError(f"{self.folder}: the ranks see different complete steps: {listings}")
            steps = listings[0]
            if step != -1 and step not in steps:
                raise CheckpointNotFoundError(
                    f"checkpoint.load_step={step}: no complete checkpoint of it in {self.folder}"
                )
            return (steps[-1] if step == -1 else step) if steps else None

        chosen: int | None = Communicator(None, timeout=self.config.timeout_s).step(
            "torchtitan.step", lambda: list(self._root().steps()), choose
        )
        return chosen

    def _load_hf(self, options: LoadOptions) -> None:
        """The initial load from HF safetensors: ``initial_load_path``, else the adapter's ``hf_assets_path``
        (as torchtitan's DCP manager). Collective."""
        path = self.config.initial_load_path or getattr(self.sd_adapter, "hf_assets_path", None)
        if not path:
            raise CheckpointError(
                "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path or the model's hf_assets_path"
            )
        load_hf_model(
            self.sd_adapter,
            self.states[MODEL],
            path,
            options=options,
            storage_options=self.config.storage_options,
            timeout=self.config.timeout_s,
        )

    def _states_to_load(self, model_only: bool) -> dict[str, Any]:
        if model_only:
            return {MODEL: self.states[MODEL]}
        unknown = [key for key in self.config.exclude_from_loading if key not in self.states]
        if unknown:
            raise CheckpointError(f"checkpoint.exclude_from_loading names {unknown}, not states of this trainer")
        return {k: v for k, v in self.states.items() if k not in self.config.exclude_from_loading}

    def _apply(self, states: dict[str, Any], loaded: dict[str, Any]) -> None:
        """Hand each loaded entry to its torchtitan object (tensors were filled in place; the objects' own
        ``load_state_dict`` restores what is not a tensor and re-fuses hook-split parameters)."""
        for key, holder in states.items():
            if holder is None or key not in loaded:
                continue
            value = loaded[key]
            if key == DATALOADER:
                if isinstance(value, dict) and not value:
                    continue
                dp_rank = int(holder.dp_rank)
                value = {f"dp_rank_{dp_rank}": value, "world_size": int(holder.dp_world_size)}
            holder.load_state_dict(value)

    def _root(self) -> CheckpointManager:
        """The reshard manager of the folder (``CheckpointError`` once ``close`` released it)."""
        if self._manager is None:
            raise CheckpointError("the reshard checkpoint manager was closed")
        return self._manager

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints in the folder, oldest first (not collective)."""
        return self._root().steps()

    # ---- the rest of the contract ----------------------------------------------------------------------

    def _maybe_wait_for_staging(self) -> None:
        """The snapshot of an asynchronous save is complete when ``save`` returns: nothing is left staging."""

    def _wait_for_saving(self) -> None:
        """Wait for the background save in flight and raise its error (the same on every rank: reshard's save
        agrees on failures). Called through ``maybe_wait_for_saving``, by the next save, a load and ``close``."""
        future: Future[None] | None = self.save_future
        self.save_future = None
        if future is not None:
            future.result()

    def _close(self) -> None:
        """Wait for a background save in flight (raising its error), then release the threads and storage."""
        try:
            if getattr(self, "save_future", None) is not None:
                self._wait_for_saving()
        finally:
            executor = getattr(self, "_executor", None)
            if executor is not None:
                executor.shutdown(wait=True)
                self._executor = None
            manager = getattr(self, "_manager", None)
            if manager is not None:
                manager.close()
                self._manager = None


def _agree_on_config(config: ReshardCheckpointManager.Config, sd_adapter: Any, model_parts: list[Any]) -> None:
    """The options this manager refuses (:func:`_refuse_unsupported`, :func:`_refuse_local_shards`) and the
    config itself, agreed by every rank in one step when the manager is built: an option refused on one rank, or
    a config field that differs between ranks (``async_mode`` on some ranks only would make a process group on
    those alone and hang), is the same ``CheckpointError`` on every rank. **Collective** over the default
    process group when it is initialized (torchtitan builds the manager on every rank)."""
    fields = {field.name: repr(getattr(config, field.name)) for field in dataclasses.fields(config)}

    def local() -> dict[str, str]:
        if config.enable:
            _refuse_unsupported(config, sd_adapter)
            _refuse_local_shards(model_parts)
        return fields

    def combine(values: list[dict[str, str]]) -> None:
        differ = sorted(name for name in fields if len({value.get(name) for value in values}) > 1)
        if differ:
            raise CheckpointError(f"checkpoint options differ between ranks: {', '.join(differ)}")

    Communicator(None, timeout=config.timeout_s).step("torchtitan.config", local, combine)


def _refuse_unsupported(config: ReshardCheckpointManager.Config, sd_adapter: Any) -> None:
    """An option this manager cannot honour is an error when it is built, never ignored."""
    if config.async_mode not in ASYNC_MODES:
        raise CheckpointError(f"checkpoint.async_mode={config.async_mode!r}: not one of {', '.join(ASYNC_MODES)}")
    if config.initial_load_in_hf_quantized:
        raise CheckpointError(
            "checkpoint.initial_load_in_hf_quantized: torchtitan's quantized HF reader is not supported by the "
            "reshard checkpoint manager (reshard.interop.HuggingFaceSource reads scaled HF checkpoints)"
        )
    if (config.last_save_in_hf or config.initial_load_in_hf) and sd_adapter is None:
        raise CheckpointError(
            "checkpoint.last_save_in_hf / initial_load_in_hf need the model's state-dict adapter (sd_adapter)"
        )
    if config.create_seed_checkpoint:
        raise CheckpointError("checkpoint.create_seed_checkpoint is not supported by the reshard checkpoint manager")


def _refuse_local_shards(model_parts: list[torch.nn.Module]) -> None:
    """A multi-rank model parallelized under torchtitan's ``spmd_backend="spmd_types"`` whose parameters are
    plain tensors (not DTensors) is refused with ``CheckpointError`` when the manager is built (every rank
    builds the same model, so every rank raises it, before any collective).

    Under ``spmd_types`` a model-parallel parameter is the rank's local shard as a plain tensor (its layout is
    torchtitan's sharding config and the live mesh, neither of which the state dict carries): saved, each
    rank's TP shard would pass for the whole tensor and rank 0's would be written as it. FSDP2 turns them into
    DTensors on the full mesh where the torch build supports it (torch 2.13 refuses: "all parameters must be
    DTensors on the full SPMD mesh"); those save and load like ``partial_dtensor``/``full_dtensor`` ones."""
    if get_spmd_backend() != "spmd_types" or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from torch.distributed.tensor import DTensor

    for index, part in enumerate(model_parts):
        for name, param in part.named_parameters():
            if not isinstance(param, DTensor):
                raise CheckpointError(
                    f"model part {index} parameter {name!r} is a plain tensor under torchtitan's "
                    f"spmd_backend='spmd_types' on {dist.get_world_size()} ranks: a rank-local shard whose place in "
                    "the global tensor the state dict does not say; the reshard checkpoint manager supports "
                    "spmd_backend='partial_dtensor' and 'full_dtensor' (and spmd_types models whose parameters "
                    "FSDP2 made DTensors)"
                )
