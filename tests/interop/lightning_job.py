"""A real Lightning training job on CPU ranks, run by ``tests/interop/test_lightning.py`` as a subprocess.

``python tests/interop/lightning_job.py <mode> <dir> <devices>``; Lightning's own launcher re-runs this command
for the other ranks (``strategy="ddp"`` and ``ModelParallelStrategy`` on the CPU accelerator, gloo).

Modes:
- ``ddp-save``: fit 3 steps with ``ReshardCheckpointIO`` (a ``ModelCheckpoint`` keeping the latest step, top-1);
  then ``trainer.save_checkpoint`` to ``<dir>/reshard.ckpt`` through reshard and to ``<dir>/torch.ckpt`` through
  Lightning's own ``TorchCheckpointIO``.
- ``ddp-resume``: ``trainer.fit(ckpt_path=<dir>/reshard.ckpt)`` for 2 more steps; what the module, optimizer and
  loops hold when training starts again is written to ``<dir>/resumed-<devices>.pt``.
- ``mp-save`` / ``mp-resume``: the same with ``ReshardModelParallelStrategy`` (FSDP2 over the data-parallel mesh
  from ``configure_model``); the full (unsharded) model and optimizer state at the save and at the resume go to
  ``<dir>/saved-mp.pt`` and ``<dir>/resumed-mp-<devices>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from pytorch_lightning.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from reshard.interop.lightning import ReshardCheckpointIO, ReshardModelParallelStrategy


class Tiny(pl.LightningModule):
    """Two linear layers and Adam with a step LR schedule: every part of a Lightning checkpoint is non-trivial."""

    def __init__(self, width: int = 8, sharded: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.sharded = sharded
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))

    def configure_model(self) -> None:
        if self.sharded:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}

    def train_dataloader(self) -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 4, generator=gen))
        return DataLoader(data, batch_size=4)


class Record(Callback):
    """At the start of (resumed) training, write what the model, optimizer, scheduler and loops hold."""

    def __init__(self, out: Path, full: bool) -> None:
        self.out, self.full = out, full

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        record = full_state(trainer) if self.full else plain_state(trainer, pl_module)
        if trainer.is_global_zero:
            torch.save(record, self.out)


def plain_state(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    return {
        "state_dict": pl_module.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "lr_scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "fit_loop": trainer.fit_loop.state_dict(),
    }


def full_state(trainer: pl.Trainer) -> dict[str, Any]:
    """The unsharded model and optimizer state (a collective of every rank)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = trainer.strategy.model
    return {
        "model": get_model_state_dict(model, options=full),
        "optimizer": get_optimizer_state_dict(model, trainer.optimizers[0], options=full),
        "global_step": trainer.global_step,
        "fit_loop": trainer.fit_loop.state_dict(),
    }


def trainer_for(mode: str, out: Path, devices: int, max_steps: int) -> pl.Trainer:
    sharded = mode.startswith("mp")
    common: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": devices,
        "max_steps": max_steps,
        "default_root_dir": str(out / "root"),
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=str(out / "keep"), save_top_k=1, every_n_train_steps=1)]
    if mode.endswith("resume"):
        callbacks.append(Record(out / f"resumed-{'mp-' if sharded else ''}{devices}.pt", full=sharded))
    if sharded:
        strategy = ReshardModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        return pl.Trainer(strategy=strategy, callbacks=callbacks, **common)
    return pl.Trainer(
        strategy="ddp" if devices > 1 else "auto", plugins=[ReshardCheckpointIO()], callbacks=callbacks, **common
    )


def main(mode: str, out: Path, devices: int) -> None:
    pl.seed_everything(1, verbose=False)
    model = Tiny(sharded=mode.startswith("mp"))
    if mode.endswith("save"):
        trainer = trainer_for(mode, out, devices, max_steps=3)
        trainer.fit(model)
        trainer.save_checkpoint(str(out / "reshard.ckpt"))
        if mode == "mp-save":
            record = full_state(trainer)
            if trainer.is_global_zero:
                torch.save(record, out / "saved-mp.pt")
        else:
            trainer.strategy.checkpoint_io = TorchCheckpointIO()
            trainer.save_checkpoint(str(out / "torch.ckpt"))
    else:
        trainer = trainer_for(mode, out, devices, max_steps=5)
        trainer.fit(model, ckpt_path=str(out / "reshard.ckpt"))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))
