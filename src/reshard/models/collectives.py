"""Autograd-aware collectives of tensor and expert parallelism, over a :class:`~reshard.models.parallel.Group`.

Each is a conjugate pair (forward, backward) in the style of Megatron's mappings; all are no-ops on a
group of one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from reshard.models.parallel import Group

__all__ = ["copy_to_group", "gather_last_dim", "gather_tokens", "reduce_from_group", "reduce_then_slice_tokens"]


def _all_reduce(tensor: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size > 1:
        dist.all_reduce(tensor, group=group.process_group)
    return tensor


def _all_gather(tensor: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if group.size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(parts, tensor.contiguous(), group=group.process_group)
    return torch.cat(parts, dim=dim)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (the input feeds each rank's shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce (sum of partial results) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last axis forward (every rank then uses the whole); keep own slice backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        ctx.width = x.shape[-1]
        return _all_gather(x, group, x.ndim - 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = ctx.group.index * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


class _GatherTokens(torch.autograd.Function):
    """All-gather along axis 0 forward, where every rank uses the gathered tokens differently (its own
    experts); backward sums the gradients of all ranks and keeps own rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        ctx.rows = x.shape[0]
        return _all_gather(x, group, 0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = _all_reduce(grad.contiguous().clone(), ctx.group)
        start = ctx.group.index * ctx.rows
        return total[start : start + ctx.rows].contiguous(), None


class _ReduceThenSliceTokens(torch.autograd.Function):
    """Sum partial results over the group and keep own rows forward; all-gather the gradients of every
    rank's rows backward."""

    @staticmethod
    def forward(ctx: Any, partial: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        rows = partial.shape[0] // group.size
        start = group.index * rows
        return _all_reduce(partial.clone(), group)[start : start + rows].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad.contiguous(), ctx.group, 0), None


def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToGroup.apply(x, group)  # type: ignore[no-untyped-call]


def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFromGroup.apply(x, group)  # type: ignore[no-untyped-call]


def gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherLastDim.apply(x, group)  # type: ignore[no-untyped-call]


def gather_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherTokens.apply(x, group)  # type: ignore[no-untyped-call]


def reduce_then_slice_tokens(partial: torch.Tensor, group: Group) -> torch.Tensor:
    return partial if group.size == 1 else _ReduceThenSliceTokens.apply(partial, group)  # type: ignore[no-untyped-call]
