"""Adam with an optional distributed optimizer (ZeRO-1), gradient reduction, and a learning-rate schedule.

Gradient reduction (every rank, after backward): dense parameters are averaged over the data- and
context-parallel group; expert parameters are averaged over the expert-data-parallel group and divided by
the EP size (each EP rank's gradient already sums the tokens of its EP group). A tied word embedding held
by two pipeline stages (the embedding on the first, its copy as the output layer on the last) first sums
its two gradients over the embedding group, so both copies take the same steps. Adam is element-wise, so
updating a flat slice of a parameter (ZeRO-1) gives exactly the same bits as updating all of it.

With ZeRO-1, each rank's local parameters are laid end to end in a flat buffer (dense and expert
parameters in two buffers, sorted by key); the dense buffer is split evenly over the data- and
context-parallel ranks and the expert buffer over the expert-data-parallel ranks; each rank keeps Adam's
``exp_avg`` and ``exp_avg_sq`` only for its slice, updates its slice of the parameters, and all-gathers
the updated parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard.models.config import EMBEDDING_KEY
from reshard.models.gpt import GPTStage
from reshard.models.parallel import Group
from reshard.state.sharding import ShardedTensor

__all__ = ["Adam", "AdamConfig", "LRSchedule"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamConfig:
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass(frozen=True, slots=True, kw_only=True)
class LRSchedule:
    """Linear warmup to ``max_lr`` over ``warmup`` steps, then cosine decay to ``min_ratio * max_lr`` at
    ``total_steps``. Its only state is the step, kept in the trainer state."""

    max_lr: float = 3e-3
    warmup: int = 5
    total_steps: int = 100
    min_ratio: float = 0.1

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.max_lr * (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total_steps - self.warmup))
        return self.max_lr * (self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class _FlatShard:
    """One ZeRO-1 buffer: the parameters in it, and this rank's slice ``[start, end)`` of it."""

    keys: list[str]
    offsets: list[int]
    group: Group
    shard: int
    start: int
    end: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class Adam:
    """Adam over a :class:`GPTStage`'s parameters, optionally ZeRO-1 sharded. ``step`` counts updates."""

    def __init__(self, stage: GPTStage, config: AdamConfig, *, zero: bool) -> None:
        self.stage = stage
        self.config = config
        self.zero = zero
        self.step = 0
        self.exp_avg: dict[str, torch.Tensor] = {}
        self.exp_avg_sq: dict[str, torch.Tensor] = {}
        self.shards: list[_FlatShard] = []
        if zero:
            dense = sorted(k for k in stage.trainable if not stage.layouts[k].is_expert)
            experts = sorted(k for k in stage.trainable if stage.layouts[k].is_expert)
            for keys, group in ((dense, stage.groups.dp_cp), (experts, stage.groups.edp)):
                if keys:
                    self.shards.append(self._make_shard(keys, group))
        else:
            for key in stage.trainable:
                param = stage.params[key]
                self.exp_avg[key] = torch.zeros_like(param)
                self.exp_avg_sq[key] = torch.zeros_like(param)

    def _make_shard(self, keys: list[str], group: Group) -> _FlatShard:
        offsets = [0]
        for key in keys:
            offsets.append(offsets[-1] + self.stage.params[key].numel())
        shard = -(-offsets[-1] // group.size)
        start = min(group.index * shard, offsets[-1])
        end = min(start + shard, offsets[-1])
        return _FlatShard(keys, offsets, group, shard, start, end, torch.zeros(end - start), torch.zeros(end - start))

    def reduce_gradients(self) -> None:
        """Average gradients over the ranks that hold replicas of each parameter (see module doc)."""
        g = self.stage.groups
        for key in self.stage.trainable:
            param = self.stage.params[key]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            layout = self.stage.layouts[key]
            tied = key == EMBEDDING_KEY and self.stage.config.tie_word_embeddings
            if tied and g.embedding is not None and g.embedding.size > 1:
                # the word embedding and its copy, the last stage's output layer: sum both uses
                dist.all_reduce(grad, group=g.embedding.process_group)
            group = g.edp if layout.is_expert else g.dp_cp
            if group.size > 1:
                dist.all_reduce(grad, group=group.process_group)
                grad /= group.size
            if layout.is_expert and g.ep.size > 1:
                grad /= g.ep.size
            param.grad = grad

    def _adam(self, param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float) -> None:
        c = self.config
        m.mul_(c.beta1).add_(grad, alpha=1 - c.beta1)
        v.mul_(c.beta2).addcmul_(grad, grad, value=1 - c.beta2)
        m_hat = m / (1 - c.beta1**self.step)
        v_hat = v / (1 - c.beta2**self.step)
        param.sub_(lr * m_hat / (v_hat.sqrt() + c.eps))

    @torch.no_grad()
    def update(self, lr: float) -> None:
        """One Adam step with learning rate ``lr`` (after :meth:`reduce_gradients`); clears gradients."""
        self.step += 1
        params = self.stage.params
        if not self.zero:
            for key in self.stage.trainable:
                param = params[key]
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                self._adam(param, grad, self.exp_avg[key], self.exp_avg_sq[key], lr)
        for shard in self.shards:
            flat_param = torch.cat([params[k].detach().reshape(-1) for k in shard.keys])
            flat_grad = torch.cat([params[k].grad.reshape(-1) for k in shard.keys])  # type: ignore[union-attr]
            mine = flat_param[shard.start : shard.end]
            self._adam(mine, flat_grad[shard.start : shard.end], shard.exp_avg, shard.exp_avg_sq, lr)
            if shard.group.size > 1:
                padded = torch.zeros(shard.shard)
                padded[: shard.end - shard.start] = mine
                parts = [torch.empty(shard.shard) for _ in range(shard.group.size)]
                dist.all_gather(parts, padded, group=shard.group.process_group)
                flat_param = torch.cat(parts)[: shard.offsets[-1]]
            for key, lo, hi in zip(shard.keys, shard.offsets, shard.offsets[1:], strict=False):
                params[key].copy_(flat_param[lo:hi].view_as(params[key]))
        for param in params.values():
            param.grad = None

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        """Adam's state with global keys ``optimizer.exp_avg.<param key>`` (and ``exp_avg_sq``): the same
        boxes as the parameter without ZeRO; flat ranges of the local parameter with ZeRO-1."""
        out: dict[str, ShardedTensor] = {}
        layouts = self.stage.layouts
        if not self.zero:
            for key in self.stage.trainable:
                for name, states in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                    out[f"optimizer.{name}.{key}"] = layouts[key].sharded(states[key], key=f"optimizer.{name}.{key}")
            return out
        for shard in self.shards:
            for key, lo, hi in zip(shard.keys, shard.offsets, shard.offsets[1:], strict=False):
                start, end = max(lo, shard.start), min(hi, shard.end)
                if end < start:
                    start = end = lo  # this rank holds none of the parameter: an empty range
                for name, state in (("exp_avg", shard.exp_avg), ("exp_avg_sq", shard.exp_avg_sq)):
                    data = state[start - shard.start : end - shard.start] if end > start else state[:0]
                    out[f"optimizer.{name}.{key}"] = layouts[key].flat(
                        data, start - lo, end - lo, key=f"optimizer.{name}.{key}"
                    )
        return out
