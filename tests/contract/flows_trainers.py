"""The flows of the trainer integrations (issue 35): torchtitan's ``ReshardCheckpointManager`` (a step saved
synchronously, and one saved by the background thread of ``async_mode="async"``), Lightning's
``ReshardCheckpointIO`` (``last.ckpt`` saved again over itself, then removed) and Accelerate's ``use_reshard``
(``save_state`` over a state directory of an earlier save). Each runs the integration's own save under the
harness's kill points and checks afterwards with the harness's checks (:func:`tests.contract.flows.check_root`,
:func:`tests.contract.guarantees.loads_as`) what a load through the integration returns.

A flow whose library is not installed stays registered (every flow is in the kill sample's plan) and is
skipped by the tests (:func:`missing`); :func:`preload` imports only what is installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from tests.contract import guarantees, states
from tests.contract.flows import Flow, RankRun, check_root, register
from tests.contract.guarantees import Answers, Finding

REQUIRES = {"titan": "torchtitan", "titan_async": "torchtitan", "lightning": "pytorch_lightning"}
REQUIRES["accelerate"] = "accelerate"


def missing(flow: str) -> str | None:
    """The library ``flow`` needs when it is not installed (the tests skip the flow), else None."""
    package = REQUIRES.get(flow)
    return package if package is not None and importlib.util.find_spec(package) is None else None


def preload() -> None:
    """Import the installed integrations (seconds each) once, in the zygote."""
    for module in ("reshard.interop.torchtitan", "reshard.interop.lightning", "reshard.interop.accelerate"):
        with contextlib.suppress(ImportError):
            importlib.import_module(module)


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """The checking process's global RNGs as they were (a load through accelerate restores saved ones)."""
    import numpy as np

    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


# ---- Accelerate: save_state over the state directory of an earlier save ------------------------------------


class Counter:
    """An object registered with ``register_for_checkpointing`` (accelerate's ``custom_checkpoint_0.pkl``)."""

    def __init__(self, generation: int) -> None:
        self.generation = generation

    def state_dict(self) -> dict[str, int]:
        return {"generation": self.generation}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.generation = int(state["generation"])


def model_weight(generation: int) -> torch.Tensor:
    return torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100.0 * generation


class AccelerateJob:
    """One process's accelerator with a prepared model, optimizer and LR scheduler, a registered object and
    ``use_reshard``, set to the values of one generation: the model (reshard's checkpoint), and the scheduler's
    epoch, the step counter, the registered object and the torch RNG (accelerate's own files)."""

    def __init__(self, generation: int) -> None:
        from accelerate import Accelerator

        from reshard.interop.accelerate import use_reshard

        self.accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 3, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        self.model, self.optimizer, _ = self.accelerator.prepare(model, optimizer, self.scheduler)
        self.counter = Counter(generation)
        self.accelerator.register_for_checkpointing(self.counter)
        use_reshard(self.accelerator, timeout=guarantees_timeout())
        self.set(generation)

    def set(self, generation: int) -> None:
        with torch.no_grad():
            self.model.weight.copy_(model_weight(generation))
        self.scheduler.last_epoch = generation
        self.accelerator.step = generation
        self.counter.generation = generation
        torch.manual_seed(generation)

    def generations(self) -> dict[str, int | None]:
        """Which generation each part holds now (None: none)."""
        rng = next((g for g in (1, 2, 3) if torch.equal(torch.get_rng_state(), seeded(g))), None)
        weight = next((g for g in (1, 2, 3) if torch.equal(self.model.weight.detach(), model_weight(g))), None)
        return {
            "model": weight,
            "scheduler": int(self.scheduler.last_epoch),
            "step": int(self.accelerator.step),
            "registered": self.counter.generation,
            "rng": rng,
        }


def guarantees_timeout() -> float:
    from tests.contract.harness import COLLECTIVE_TIMEOUT_S

    return COLLECTIVE_TIMEOUT_S


def seeded(generation: int) -> torch.Tensor:
    return torch.Generator().manual_seed(generation).get_state()


def accelerate_load(directory: Path) -> tuple[int | None, str]:
    """``load_state(directory)`` into a fresh job, in this process: the generation every part holds (-1: the
    parts disagree or hold no generation), or None and the reshard error it raised."""
    import reshard

    with kept_rng():
        job = AccelerateJob(0)
        try:
            job.accelerator.load_state(str(directory))
        except reshard.CheckpointError as exc:
            return None, f"{type(exc).__name__}: {exc}"
        parts = job.generations()
    found = set(parts.values())
    return (found.pop() if len(found) == 1 and None not in found else -1), f"load_state restored {parts}"


@register
class AccelerateState(Flow):
    """``accelerator.save_state(dir)`` with ``use_reshard`` (one process) over the state directory of an
    earlier ``save_state`` of generation 1. Afterwards ``load_state(dir)`` restores one whole generation (2 when
    the save returned), or raises a reshard error when the save did not return; never a mix of the two saves."""

    name = "accelerate"
    places = ("state",)
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"state": ("notes.txt", "data/user.csv")}
    worlds = (1,)

    def run(self, run: RankRun) -> dict[str, Any] | None:
        job = AccelerateJob(1)
        job.accelerator.save_state(str(run.place / "state"))  # generation 1, before the kill points count
        job.set(2)
        with run.armed():
            job.accelerator.save_state(str(run.place / "state"))
        return None

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        done = guarantees.confirmed(answers)
        generation, how = accelerate_load(place / "state")
        if generation is None:
            return None, Finding("lost", f"the save returned, yet: {how}") if done else None
        if generation not in ((2,) if done else (1, 2)):
            status = "silent" if generation == -1 else "lost"
            return generation, Finding(status, f"a load that mixes two saves or holds another: {how}")
        return generation, None

    def follow_up(self, place: Path, world: int) -> Finding | None:
        """A later ``save_state`` of generation 3 to the same directory loads as generation 3."""
        with kept_rng():
            job = AccelerateJob(3)
            job.accelerator.save_state(str(place / "state"))
        generation, how = accelerate_load(place / "state")
        return None if generation == 3 else Finding("other", f"a later save_state does not load as 3: {how}")


# ---- torchtitan: ReshardCheckpointManager.save(2) over a folder whose step 1 is committed ----------------------


class ContractState:
    """An extra state of the trainer (as ``{"train_state": trainer}``): the contract's generation of this rank."""

    def __init__(self, rank: int, world: int, generation: int) -> None:
        import dataclasses

        import reshard

        # A sharded tensor is saved under its own key, a plain one under its path: the key is the path here, as
        # in the template of the checks (``{"contract": full_template}``).
        self.value = {
            name: dataclasses.replace(value, key=f"contract.{name}")
            if isinstance(value, reshard.ShardedTensor)
            else value
            for name, value in states.rank_state(rank, world, generation).items()
        }

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state


def titan_step(generation: int, world: int) -> dict[str, Any]:
    """A step of the titan flows as one process saves it (the model part's weight, the contract's state)."""
    return {"model": {"weight": model_weight(generation)}, "contract": states.single_process_state(generation, world)}


@register
class TitanStep(Flow):
    """torchtitan's ``ReshardCheckpointManager.save(2)`` (``keep_latest_k=2``) on a folder whose step 1 holds
    generation 1: a tiny model part in torchtitan's ``ModelWrapper``, its ``OptimizersContainer``, and the
    contract's state as an extra trainer state. Afterwards every step listed complete loads as its own
    generation, the newest is at least what a rank reported saved (:func:`tests.contract.flows.check_root`)."""

    name = "titan"
    places = ("root",)
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"root": ("notes.txt",)}
    async_mode: ClassVar[str] = "disabled"

    def prepare_place(self, place: Path, world: int) -> None:
        import reshard

        manager = reshard.CheckpointManager(place / "root", keep_last=2)
        manager.save(1, titan_step(1, world))
        manager.close()

    def run(self, run: RankRun) -> dict[str, Any] | None:
        from torchtitan.components.optimizer.optimizer import default_adamw
        from torchtitan.distributed import utils as titan_utils

        from reshard.interop.torchtitan import ReshardCheckpointManager

        # The model part is the same plain tensor on every rank (a replica): torchtitan's default backend,
        # spmd_types, keeps tensor-parallel shards as plain tensors too, which the manager refuses on several
        # ranks (docs/reliability.md section 18, I9); the backends it supports say what a plain tensor is.
        titan_utils.set_spmd_backend("partial_dtensor")
        model = torch.nn.Linear(4, 3, bias=False)
        with torch.no_grad():
            model.weight.copy_(model_weight(2))
        optimizer_config = default_adamw(lr=1e-3, foreach=False)
        optimizer_config.implementation = "for-loop"
        optimizers = optimizer_config.build(model_parts=[model])
        config = ReshardCheckpointManager.Config(
            enable=True, folder="root", interval=1, keep_latest_k=2, async_mode=self.async_mode, timeout_s=run.timeout
        )
        manager = config.build(
            dataloader=None,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=None,
            states={"contract": ContractState(run.rank, run.world, 2)},
            sd_adapter=None,
            base_folder=str(run.place),
        )
        with run.armed():
            manager.save(2)
            manager.close()  # waits for a background save
        return None

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        expected = 2 if guarantees.confirmed(answers) else None
        return check_root(place / "root", world, expected, under="contract")

    def follow_up(self, place: Path, world: int) -> Finding | None:
        import reshard

        manager = reshard.CheckpointManager(place / "root", keep_last=2)
        try:
            manager.save(3, titan_step(3, world))
        except reshard.CheckpointError as exc:
            return Finding("other", f"a later manager save failed: {type(exc).__name__}: {exc}")
        finally:
            manager.close()
        return check_root(place / "root", world, 3, under="contract")[1]


@register
class TitanAsyncStep(TitanStep):
    """The same with ``async_mode="async"``: ``save`` returns with the snapshot saved by the background thread over
    the manager's own gloo group, and ``close`` waits for it (and raises its error)."""

    name = "titan_async"
    async_mode = "async"


# ---- Lightning: ReshardCheckpointIO.save_checkpoint over last.ckpt, then remove_checkpoint ---------------------


def lightning_dict(generation: int) -> dict[str, Any]:
    """A Lightning checkpoint dict of ``generation``: the model's tensors, an optimizer state, loop counters."""
    full = states.global_state(generation, 1)
    return {
        "state_dict": {"w": full["w"], "e": full["e"]},
        "optimizer_states": [{"state": {0: {"exp_avg": full["frozen"]}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "epoch": generation,
        "global_step": 10 * generation,
        "bias": full["bias"],
    }


def lightning_generation(loaded: dict[str, Any]) -> int:
    """Which generation a loaded checkpoint dict is, bit for bit (-1: none)."""
    for generation in (1, 2, 3):
        want = lightning_dict(generation)
        tensors = [
            (loaded["state_dict"]["w"], want["state_dict"]["w"]),
            (loaded["state_dict"]["e"], want["state_dict"]["e"]),
            (loaded["optimizer_states"][0]["state"][0]["exp_avg"], want["optimizer_states"][0]["state"][0]["exp_avg"]),
            (loaded["bias"], want["bias"]),
        ]
        counters = (loaded["epoch"], loaded["global_step"]) == (want["epoch"], want["global_step"])
        if counters and all(states.same_bits(a, b) for a, b in tensors):
            return generation
    return -1


def lightning_load(path: Path) -> tuple[int | None, str]:
    """``ReshardCheckpointIO().load_checkpoint(path)`` in this process: its generation, or None and the error."""
    import reshard
    from reshard.interop.lightning import ReshardCheckpointIO

    try:
        loaded = ReshardCheckpointIO().load_checkpoint(path)
    except (reshard.CheckpointError, FileNotFoundError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return lightning_generation(loaded), ""


@register
class LightningLast(Flow):
    """``ReshardCheckpointIO().save_checkpoint(generation 2, "last.ckpt")`` by one process over a committed
    generation 1 at the same path (as Lightning saves ``last.ckpt`` again and again); the user's files in and
    around it. Afterwards it loads as 1 or 2 (2 when the save returned), never a mix; ``remove_checkpoint``
    then deletes reshard's files only."""

    name = "lightning"
    places = ("last.ckpt",)
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"last.ckpt": ("notes.txt", "data/user.csv")}
    worlds = (1,)

    def prepare_place(self, place: Path, world: int) -> None:
        from reshard.interop.lightning import ReshardCheckpointIO

        ReshardCheckpointIO().save_checkpoint(lightning_dict(1), place / "last.ckpt")

    def run(self, run: RankRun) -> dict[str, Any] | None:
        from reshard.interop.lightning import ReshardCheckpointIO

        plugin = ReshardCheckpointIO(timeout_s=run.timeout)
        checkpoint = lightning_dict(2)
        with run.armed():
            plugin.save_checkpoint(checkpoint, run.place / "last.ckpt")
        return None

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        allowed = (2,) if guarantees.confirmed(answers) else (1, 2)
        generation, how = lightning_load(place / "last.ckpt")
        if generation is None:
            return None, Finding("lost", f"last.ckpt does not load: {how}")
        if generation not in allowed:
            status = "silent" if generation == -1 else "lost"
            return generation, Finding(status, f"last.ckpt loads as generation {generation}, expected {allowed}")
        return generation, guarantees.readers_agree(place / "last.ckpt", True)

    def follow_up(self, place: Path, world: int) -> Finding | None:
        """``remove_checkpoint`` deletes the checkpoint and nothing of the user's in or around it."""
        from reshard.interop.lightning import ReshardCheckpointIO

        ReshardCheckpointIO().remove_checkpoint(place / "last.ckpt")
        if (place / "last.ckpt" / "metadata.json").exists() or lightning_load(place / "last.ckpt")[0] is not None:
            return Finding("other", "remove_checkpoint left a checkpoint that loads")
        return guarantees.foreign_untouched(self.planted(place))
