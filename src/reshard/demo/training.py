"""Training the demo GPT on one layout, checkpointing it with reshard, and resuming on another.

Everything a rank needs lives in a :class:`Trainer`: the model stage, Adam, the learning-rate schedule,
the step counter, the parallel groups and the rank's data stream. The data is a synthetic, deterministic
dataset read in epochs (:mod:`reshard.demo.data`): step ``s`` of an uninterrupted run trains on the same
samples on every layout, each data-parallel rank reading its share through a ``reshard.data.ElasticSampler``.

Resume semantics: parameters, Adam's state, the step, the consumed samples, the data order (the epoch and
which of its samples were consumed, captured in global terms with ``reshard.data.capture``: a resume on
another data-parallel size reads exactly what an uninterrupted run on it would) and the schedule continue.
RNG states are saved per rank with ``reshard.data.rng_state``, at coordinates (pp, dp, cp, tp); on resume
(``restore_rng`` with the policy ``"same_coordinate"``), a rank whose coordinates exist in the saved layout
continues its saved streams exactly, and a rank that is new (the saved layout had fewer ranks along some
axis) is seeded from the model's seed, the step and its coordinates (``reshard.data.derive_seed``).

LoRA fine-tuning (``Trainer(..., lora=LoraConfig())``) freezes the base and trains the adapters. Its
checkpoints are adapter-only (:meth:`Trainer.save_adapter`): adapters, their Adam state, RNG and trainer
state, without the frozen base, each unique box written once. :meth:`Trainer.load_adapter` loads them on
any layout and fails loudly when they do not fit (see there).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import reshard
from reshard.data import restore_rng, rng_state, rng_template
from reshard.data import template as data_template
from reshard.demo.data import DataStream, global_batch
from reshard.demo.optimizer import Adam, AdamConfig, LRSchedule
from reshard.models.config import LoraConfig, ModelConfig, is_adapter_key
from reshard.models.gpt import GPTStage
from reshard.models.parallel import ParallelGroups
from reshard.net.comm import Communicator
from reshard.state.sharding import ShardedTensor

__all__ = ["Trainer", "TrainingConfig", "global_batch"]

logger = logging.getLogger("reshard.demo")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """Batch sizes and schedule. ``global_batch`` sequences per step are split over data-parallel ranks,
    then into micro-batches of ``micro_batch``."""

    global_batch: int = 8
    micro_batch: int = 2
    data_seed: int = 7
    epoch_samples: int = 48
    """Samples of the dataset, read once per epoch (a multiple of ``global_batch``)."""
    schedule: LRSchedule = field(default_factory=LRSchedule)
    adam: AdamConfig = field(default_factory=AdamConfig)


class Trainer:
    """One rank's training state on one layout. Created by every rank of the layout."""

    def __init__(
        self, model: ModelConfig, training: TrainingConfig, groups: ParallelGroups, lora: LoraConfig | None = None
    ) -> None:
        parallel = groups.config
        if training.global_batch % (parallel.dp * training.micro_batch):
            raise ValueError(
                f"global_batch={training.global_batch} is not divisible by dp*micro_batch="
                f"{parallel.dp * training.micro_batch}"
            )
        if training.epoch_samples % training.global_batch:
            raise ValueError(
                f"epoch_samples={training.epoch_samples} is not a multiple of global_batch={training.global_batch}"
            )
        self.model_config = model
        self.training = training
        self.groups = groups
        self.lora = lora
        self.stage = GPTStage(model, groups, lora)
        self.optimizer = Adam(self.stage, training.adam, zero=parallel.zero)
        self.step = 0
        self.consumed_samples = 0
        self.data = DataStream(model, training, dp=parallel.dp, dp_rank=groups.coords.dp)
        self.last_indices: list[int] = []
        """The sample indices of this rank's last step."""
        torch.manual_seed(model.seed + groups.rank)

    # ---- one training step -----------------------------------------------------------------------

    def train_step(self) -> float:
        """Forward and backward over this rank's micro-batches (pipeline: all forward, then all backward,
        per micro-batch), gradient reduction, Adam. Returns the global mean loss (on every rank)."""
        g = self.groups
        parallel = g.config
        self.last_indices, mine = self.data.next_batch()
        micro = torch.split(mine, self.training.micro_batch)
        total = torch.zeros(())
        for tokens in micro:
            total += self._forward_backward(tokens, scale=1.0 / len(micro)) / len(micro)
        self.optimizer.reduce_gradients()
        self.optimizer.update(self.training.schedule.lr(self.step))
        self.step += 1
        self.consumed_samples += self.training.global_batch
        # Only the last pipeline stage has the loss: sum over the layout, divided by its holders.
        if not self.stage.has_output:
            total.zero_()
        dist.all_reduce(total, group=g.layout.process_group)
        holders = parallel.tp * parallel.cp * parallel.dp
        return float(total) / holders

    @torch.no_grad()
    def loss(self, step: int) -> float:
        """The global mean loss of the current state on the batch of ``step``, forward only (the state is
        unchanged). Called by every rank of the layout; every rank returns it. ``train_step`` at that step
        reports the same loss (up to the order of float additions) before it updates."""
        g = self.groups
        tokens = global_batch(step, self.model_config, self.training)
        logits = self.logits(tokens[:, :-1])
        total = torch.zeros(())
        if logits is not None:
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        dist.all_reduce(total, group=g.layout.process_group)
        parallel = g.config
        return float(total) / (parallel.tp * parallel.cp * parallel.dp)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The model's logits ``[batch, seq, vocab]`` for ``tokens`` ``[batch, seq]`` (positions 0 .. seq-1),
        through every pipeline stage. Called by every rank of the layout with the same tokens; the ranks of
        the last stage return the logits, the others None."""
        g = self.groups
        stage = self.stage
        pp = g.config.pp
        shape = (tokens.shape[0], tokens.shape[1], self.model_config.hidden)
        x: torch.Tensor | None = None
        for virtual in range(stage.num_chunks):
            owner = virtual % pp
            if owner != g.coords.pp:
                continue
            if virtual == 0:
                x = stage.embed(tokens)
            elif (virtual - 1) % pp != owner or x is None:
                x = torch.empty(shape)
                dist.recv(x, src=g.pp.ranks[(virtual - 1) % pp], group=g.pp.process_group)
            for layer in stage.chunks[stage.virtual_stages.index(virtual)]:
                x = stage.layer(layer, x)
            if virtual == stage.num_chunks - 1:
                return stage.output(x)
            if (virtual + 1) % pp != owner:
                dist.send(x, dst=g.pp.ranks[(virtual + 1) % pp], group=g.pp.process_group)
        return None

    def _forward_backward(self, tokens: torch.Tensor, *, scale: float) -> torch.Tensor:
        """One micro-batch through every virtual pipeline stage and back. Returns this rank's loss (0 where
        the rank does not hold the last stage)."""
        g = self.groups
        stage = self.stage
        pp = g.config.pp
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        shape = (tokens.shape[0], self.model_config.seq_len, self.model_config.hidden)
        saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        carry: torch.Tensor | None = None
        loss = torch.zeros(())
        for virtual in range(stage.num_chunks):
            owner = virtual % pp
            if owner != g.coords.pp:
                continue
            if virtual == 0:
                x_in = None
                x = stage.embed(inputs)
            else:
                if (virtual - 1) % pp == owner and carry is not None:
                    x_in = carry.detach().requires_grad_(True)
                else:
                    x_in = torch.empty(shape)
                    dist.recv(x_in, src=g.pp.ranks[(virtual - 1) % pp], group=g.pp.process_group)
                    x_in.requires_grad_(True)
                x = x_in
            for layer in stage.chunks[stage.virtual_stages.index(virtual)]:
                x = stage.layer(layer, x)
            if virtual == stage.num_chunks - 1:
                logits = stage.output(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                x = loss * scale
            elif (virtual + 1) % pp != owner:
                dist.send(x.detach(), dst=g.pp.ranks[(virtual + 1) % pp], group=g.pp.process_group)
            saved[virtual] = (x_in, x)
            carry = x
        grad_carry: torch.Tensor | None = None
        for virtual in reversed(range(stage.num_chunks)):
            owner = virtual % pp
            if owner != g.coords.pp:
                continue
            x_in, x_out = saved[virtual]
            if virtual == stage.num_chunks - 1:
                torch.autograd.backward(x_out)
            else:
                if (virtual + 1) % pp == owner and grad_carry is not None:
                    grad = grad_carry
                else:
                    grad = torch.empty(shape)
                    dist.recv(grad, src=g.pp.ranks[(virtual + 1) % pp], group=g.pp.process_group)
                torch.autograd.backward(x_out, grad)
            if x_in is not None:
                grad_in = x_in.grad if x_in.grad is not None else torch.zeros_like(x_in)
                if (virtual - 1) % pp != owner:
                    dist.send(grad_in, dst=g.pp.ranks[(virtual - 1) % pp], group=g.pp.process_group)
                grad_carry = grad_in
        return loss.detach()

    # ---- checkpoints -----------------------------------------------------------------------------

    def sharded_state_dict(self) -> dict[str, Any]:
        """The whole training state, described for reshard: model, optimizer, per-rank RNG, trainer state."""
        g = self.groups
        c = g.coords
        p = g.config
        model = {key: layout.sharded(self.stage.params[key].detach()) for key, layout in self.stage.layouts.items()}
        return {
            "model": model,
            "optimizer": self.optimizer.sharded_state_dict(),
            "rng": rng_state(
                "rng_state",
                coordinate=(c.pp, c.dp, c.cp, c.tp),
                grid=(p.pp, p.dp, p.cp, p.tp),
                seed=self.model_config.seed,
            ),
            "trainer": self.trainer_state(),
        }

    def trainer_state(self) -> dict[str, Any]:
        p = self.groups.config
        return {
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "optimizer_step": self.optimizer.step,
            "model_config": self.model_config.to_dict(),
            "parallel": {**asdict(p)},
            "schedule": asdict(self.training.schedule),
            "lora": None if self.lora is None else self.lora.to_dict(),
        }

    def adapter_sharded_state_dict(self) -> dict[str, Any]:
        """The training state without the frozen base weights: the LoRA adapters, their Adam state, the
        RNG and the trainer state. Replicas of an adapter box (DP, CP, and TP or ETP for the replicated
        factor) carry non-zero replica ids, so a save writes each unique box once."""
        if self.lora is None:
            raise ValueError("this trainer has no LoRA adapters (Trainer(..., lora=LoraConfig()))")
        adapters: dict[str, Any] = reshard.filter_state_dict(
            self.sharded_state_dict(), lambda path, leaf: not path.startswith("model.") or is_adapter_key(path)
        )
        return adapters

    def save_adapter(self, path: str, *, overwrite: bool = False) -> reshard.SaveResult:
        """Save an adapter-only checkpoint (collective over the layout)."""
        group = self.groups.layout.process_group
        state = {**self.adapter_sharded_state_dict(), "data": self.data.captured(group)}
        return reshard.save(state, path, group=group, overwrite=overwrite)

    def load_adapter(self, path: str, *, missing_ok: bool = False, stats: reshard.LoadStats | None = None) -> bool:
        """Resume LoRA training from an adapter checkpoint saved on any layout (collective over the layout).

        Returns True when it loaded. Nothing here falls back to fresh adapters by itself:

        - no checkpoint at ``path`` raises :class:`~reshard.CheckpointNotFoundError`, unless the caller
          passes ``missing_ok=True``; then it returns False and the adapters stay as they are;
        - data without a committed checkpoint raises :class:`~reshard.IncompleteCheckpointError`, even with
          ``missing_ok`` (an interrupted save is not "no checkpoint");
        - adapters that do not fit this model (another rank, alpha or set of target modules, another base
          model) raise :class:`~reshard.MismatchError` listing every difference, including adapters the
          checkpoint holds that this model would not load.
        """
        if self.lora is None:
            raise ValueError("this trainer has no LoRA adapters (Trainer(..., lora=LoraConfig()))")
        state = self.adapter_sharded_state_dict()
        if not self._check_adapters(path, state, missing_ok=missing_ok):
            logger.warning("no adapter checkpoint at %s: keeping the current adapters (missing_ok=True)", path)
            return False
        self.load(path, stats=stats, state=state)
        return True

    def _check_adapters(self, path: str, state: dict[str, Any], *, missing_ok: bool) -> bool:
        """Whether the checkpoint at ``path`` exists (False only with ``missing_ok``); raise MismatchError
        listing every difference between its adapter tensors (and their optimizer states) and this
        model's, over the whole layout (with PP, a rank holds only its stages' adapters).

        Collective over the layout: the coordinator alone reads the metadata, compares, and every rank
        gets the same answer or raises the same error."""
        assert self.lora is not None
        lora = self.lora
        wanted = {st.key: list(st.saved_shape) for st in (*state["model"].values(), *state["optimizer"].values())}

        def compare(per_rank: list[dict[str, list[int]]]) -> bool:
            try:
                metadata = reshard.read_metadata(path)
            except reshard.CheckpointNotFoundError:
                if missing_ok:
                    return False
                raise
            everywhere = {k: shape for keys in per_rank for k, shape in keys.items()}
            saved = {k: list(t.global_shape) for k, t in metadata.tensors.items() if is_adapter_key(k)}
            problems = []
            saved_lora = metadata.common.get("trainer.lora.rank"), metadata.common.get("trainer.lora.alpha")
            if saved_lora != (lora.rank, lora.alpha):
                problems.append(
                    f"LoRA rank/alpha: checkpoint {saved_lora[0]}/{saved_lora[1]}, model {lora.rank}/{lora.alpha}"
                )
            for label, keys in (
                ("missing from the checkpoint", sorted(everywhere.keys() - saved.keys())),
                ("only in the checkpoint", sorted(saved.keys() - everywhere.keys())),
            ):
                if keys:
                    problems.append(f"{len(keys)} adapter tensors {label}: {', '.join(keys[:20])}")
            both = sorted(k for k in everywhere.keys() & saved.keys() if everywhere[k] != saved[k])
            problems += [f"{k}: checkpoint shape {saved[k]}, model shape {everywhere[k]}" for k in both[:20]]
            if problems:
                raise reshard.MismatchError("the adapter checkpoint does not fit this model: " + "; ".join(problems))
            return True

        found: bool = Communicator(self.groups.layout.process_group).step("checking adapters", lambda: wanted, compare)
        return found

    def save(self, path: str, *, overwrite: bool = False) -> reshard.SaveResult:
        """Save the training state and the data position (collective over the layout)."""
        group = self.groups.layout.process_group
        state = {**self.sharded_state_dict(), "data": self.data.captured(group)}
        return reshard.save(state, path, group=group, overwrite=overwrite)

    def load_hf(self, hf_dir: str, *, stats: reshard.LoadStats | None = None) -> None:
        """Initialise the model's weights (not LoRA adapters) straight from a Hugging Face safetensors
        directory that matches the model (:meth:`ModelConfig.from_hf`), each rank reading only its bytes.
        Collective over the layout. Raises :class:`~reshard.MismatchError` when the files do not fit the
        model (missing tensors, other shapes, tensors the model has no place for)."""
        from reshard.interop import HuggingFaceSource
        from reshard.models.hf import hf_key_map

        model = self.sharded_state_dict()["model"]
        reshard.load(
            {"model": {k: v for k, v in model.items() if not is_adapter_key(k)}},
            HuggingFaceSource(hf_dir, key_map=hf_key_map(self.model_config)),
            group=self.groups.layout.process_group,
            stats=stats,
        )

    def load(self, path: str, *, stats: reshard.LoadStats | None = None, state: dict[str, Any] | None = None) -> None:
        """Resume from a checkpoint saved on any layout (collective over the layout). See the module
        docstring for what continues and how RNG states of new ranks are seeded. ``state`` is the part
        of :meth:`sharded_state_dict` to load (default: all of it)."""
        group = self.groups.layout.process_group
        template = self.trainer_state()
        del template["lora"]  # checked below, and absent from checkpoints of trainers without LoRA
        saved = reshard.load({"trainer": template}, path, group=group)["trainer"]
        if ModelConfig.from_dict(saved["model_config"]) != self.model_config:
            raise reshard.MismatchError(f"the checkpoint holds another model: {saved['model_config']}")
        state = self.sharded_state_dict() if state is None else state
        c, p = self.groups.coords, self.groups.config
        mine, grid = (c.pp, c.dp, c.cp, c.tp), (p.pp, p.dp, p.cp, p.tp)
        state["rng"] = rng_template("rng_state", coordinate=mine, grid=grid)
        has_data: bool = Communicator(group).step(  # save() adds the data position, sharded_state_dict() does not
            "demo: a data position saved?", lambda: None, lambda _: "data" in reshard.read_metadata(path).objects
        )
        if has_data:
            state["data"] = data_template("data")
        options = reshard.LoadOptions(object_grid="same_coordinate")
        loaded = reshard.load(state, path, group=group, stats=stats, options=options)
        trainer = loaded["trainer"]
        self.step = trainer["step"]
        self.consumed_samples = trainer["consumed_samples"]
        self.optimizer.step = trainer["optimizer_step"]
        if has_data:
            self.data.restore(loaded["data"])
        else:  # every step reads the next global batch of the epoch's order: the position is a prefix
            self.data.skip_to(self.consumed_samples)
        restore_rng(
            loaded["rng"],
            key="rng_state",
            coordinate=mine,
            grid=grid,
            policy="same_coordinate",
            seed=self.model_config.seed,
            step=self.step,
        )

    def set_full_state(self, full: dict[str, torch.Tensor], trainer_state: dict[str, Any]) -> None:
        """Take the model and Adam's state from full (logical) tensors, and the counters from
        ``trainer_state``: an in-memory reshard onto this layout, independent of reshard's save and load."""
        state = self.sharded_state_dict()
        with torch.no_grad():
            for st in (*state["model"].values(), *state["optimizer"].values()):
                whole = full[st.key]
                for piece in st.pieces():
                    if piece.padded_view is not None:
                        piece.zero_padding()
                    box = piece.box
                    piece.view.copy_(whole[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))])
        self.step = trainer_state["step"]
        self.consumed_samples = trainer_state["consumed_samples"]
        self.optimizer.step = trainer_state["optimizer_step"]
        self.data.skip_to(self.consumed_samples)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and Adam state gathered into full (logical) tensors, on every rank of the
        layout: the layout-independent picture used to check a resume. Collective over the layout."""
        state = self.sharded_state_dict()
        tensors = {**state["model"], **state["optimizer"]}
        return gather_full_tensors(tensors, self.groups)


def gather_full_tensors(tensors: dict[str, ShardedTensor], groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Assemble full tensors from every rank's primary pieces (all-gather over the layout's group).

    Independent of reshard's save and load: it only uses :meth:`ShardedTensor.pieces`.
    """
    pieces = []
    for st in tensors.values():
        if not st.is_main_replica:
            continue
        for piece in st.pieces():
            if piece.box.volume:
                pieces.append((st.key, st.saved_shape, piece.box.offset, piece.box.shape, piece.view.contiguous()))
    group = groups.layout
    sizes = torch.tensor([sum(p[4].numel() for p in pieces)], dtype=torch.int64)
    all_sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size)]
    dist.all_gather(all_sizes, sizes, group=group.process_group)
    longest = max(int(s) for s in all_sizes)
    flat = torch.zeros(longest)
    if pieces:
        flat[: int(sizes)] = torch.cat([p[4].reshape(-1).float() for p in pieces])
    flats = [torch.empty(longest) for _ in range(group.size)]
    dist.all_gather(flats, flat, group=group.process_group)
    comm = Communicator(group.process_group)
    described = json.dumps([[k, list(s), list(o), list(n)] for k, s, o, n, _ in pieces]).encode()
    gathered = comm.gather_bytes(described)
    everyone = json.loads(
        comm.broadcast_bytes(json.dumps([g.decode() for g in gathered]).encode() if gathered else None)
    )
    everyone = [json.loads(e) for e in everyone]
    full: dict[str, torch.Tensor] = {}
    for data, entries in zip(flats, everyone, strict=True):
        position = 0
        for key, shape, offset, box_shape in entries:
            target = full.setdefault(key, torch.full(tuple(shape), float("nan")))
            count = 1
            for n in box_shape:
                count *= n
            region = tuple(slice(o, o + n) for o, n in zip(offset, box_shape, strict=True))
            target[region] = data[position : position + count].view(tuple(box_shape))
            position += count
    return full


def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and its wall time in seconds."""
    started = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - started
