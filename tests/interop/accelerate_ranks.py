"""The ranks of tests/interop/test_accelerate.py, started by Accelerate's own launcher (``accelerate launch --cpu``).

``save OUT``: a tiny MLP sharded by hand with FSDP2 over every process (accelerate runs FSDP only on accelerator
devices: on CPU its state is MULTI_CPU, which would wrap the model in DDP, so the model is registered with
``prepare_model(evaluation_mode=True)``, which registers it unwrapped), AdamW, a StepLR scheduler and a registered
custom object, trained three steps; ``accelerator.save_state`` through ``use_reshard``; then the full model and
optimizer state, the scheduler, the step, an RNG draw after the save and the model after one more step (the
uninterrupted run) go to ``OUT/reference.pt``.

``load OUT``: a model of another layout (``plain``: unsharded on one process; ``tp``: tensor parallel over every
process), freshly initialised, ``accelerator.load_state`` through ``use_reshard``, and what it then holds (the
same items) goes to ``OUT/loaded_<layout>.pt``. Every process feeds the same batch, so FSDP's averaged gradient
equals one process's gradient exactly and the step after the resume is comparable bit for bit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from reshard.errors import CheckpointError
from reshard.interop.accelerate import use_reshard

FULL = StateDictOptions(full_state_dict=True)
FULL_OPTIM = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)


class Counter:
    """A custom object registered with ``register_for_checkpointing`` (accelerate pickles it itself)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def build(layout: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + k)
    return tuple(torch.randn(4, n, generator=generator) for n in (8, 6, 5))  # type: ignore[return-value]


def train_step(accelerator: Any, models: list[Any], optimizers: list[Any], scheduler: Any, k: int) -> None:
    """One step of both models (``net`` and ``head``) on the same batch on every process."""
    x, y, z = batch(k)
    out = models[0](x)
    loss = torch.nn.functional.mse_loss(out, y) + models[1](z).square().mean()
    accelerator.backward(loss)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    scheduler.step()


def full_state(models: list[Any], optimizers: list[Any]) -> dict[str, Any]:
    """The whole model and optimizer state of both models (collective under a sharded layout)."""
    state: dict[str, Any] = {}
    for i, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
        state[f"model_{i}"] = _cloned(get_model_state_dict(model, options=FULL))
        state[f"optimizer_{i}"] = _cloned(get_optimizer_state_dict(model, optimizer.optimizer, options=FULL_OPTIM))
    return state


def _cloned(state: dict[str, Any]) -> dict[str, Any]:
    """A copy whose tensors no later step or gather can change."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def setup(out: Path, layout: str, seed: int) -> tuple[Any, list[Any], list[Any], Any, Counter]:
    """An accelerator with automatic checkpoint naming under ``out`` (keeping 2), through reshard; ``net`` in
    ``layout`` (AdamW, StepLR) and ``head``, a Linear that accelerate wraps in DDP on several processes (SGD)."""
    config = ProjectConfiguration(project_dir=str(out), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False, project_config=config)
    use_reshard(accelerator)
    net = build(layout, seed)
    head = torch.nn.Linear(5, 3)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    head_optimizer = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    if layout == "plain" and accelerator.num_processes == 1:
        net = accelerator.prepare_model(net)
    else:
        net = accelerator.prepare_model(net, evaluation_mode=True)
    head = accelerator.prepare_model(head)
    optimizer, head_optimizer, scheduler = accelerator.prepare(optimizer, head_optimizer, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, [net, head], [optimizer, head_optimizer], scheduler, counter


def run_save(out: Path) -> None:
    accelerator, models, optimizers, scheduler, counter = setup(out, "fsdp", seed=0)
    for k in range(3):
        train_step(accelerator, models, optimizers, scheduler, k)
        counter.n += 1
        accelerator.step = 5 + k
        accelerator.save_state()  # checkpoints/checkpoint_<k>; total_limit=2 removes checkpoint_0
    saved = full_state(models, optimizers)
    saved_scheduler = dict(scheduler.state_dict())
    draw = torch.rand(5)
    train_step(accelerator, models, optimizers, scheduler, 3)
    after = full_state(models, optimizers)
    if accelerator.is_main_process:
        checkpoints = out / "checkpoints"
        reference = {
            "saved": saved,
            "scheduler": saved_scheduler,
            "counter": counter.n,
            "step": 7,
            "draw": draw,
            "after": {k: v for k, v in after.items() if k.startswith("model_")},
            "folders": sorted(os.listdir(checkpoints)),
            "files": sorted(os.listdir(checkpoints / "checkpoint_2")),
        }
        torch.save(reference, out / "reference.pt")
    accelerator.wait_for_everyone()


def run_load(out: Path, layout: str) -> None:
    accelerator, models, optimizers, scheduler, counter = setup(out, layout, seed=123)
    refused: dict[str, str] = {}
    try:
        use_reshard(accelerator)
    except CheckpointError as error:
        refused["twice"] = type(error).__name__
    try:
        accelerator.save_state("s3://bucket/state")
    except CheckpointError as error:
        refused["url"] = type(error).__name__
    empty = out / f"empty_{layout}"
    empty.mkdir(exist_ok=True)
    before = dict(scheduler.state_dict())
    try:
        accelerator.load_state(str(empty))
    except CheckpointError as error:
        refused["missing"] = type(error).__name__
    refused["scheduler_untouched"] = str(scheduler.state_dict() == before)
    accelerator.load_state()  # the newest of checkpoints/
    loaded = full_state(models, optimizers)
    draw = torch.rand(5)
    result = {
        "loaded": loaded,
        "scheduler": dict(scheduler.state_dict()),
        "counter": counter.n,
        "step": accelerator.step,
        "draw": draw,
        "refused": refused,
    }
    train_step(accelerator, models, optimizers, scheduler, 3)
    result["after"] = {k: v for k, v in full_state(models, optimizers).items() if k.startswith("model_")}
    if accelerator.is_main_process:
        torch.save(result, out / f"loaded_{layout}.pt")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    mode, directory = sys.argv[1], Path(sys.argv[2])
    if mode == "save":
        run_save(directory)
    else:
        run_load(directory, sys.argv[3])
