"""A real Megatron-Core GPTModel and optimizer on CPU ranks (gloo), for the tests of ``reshard.interop.megatron``.

Runs inside the ranks of a pool (only they import megatron-core). Megatron's CPU obstacles are worked
around here and nowhere in ``src/``:

- ``model_parallel_cuda_manual_seed`` needs CUDA: the model is built with ``use_cpu_initialization``
  (Megatron initialises each full weight on the CPU from ``torch.manual_seed`` and slices it), so it is
  not called.
- ``DistributedDataParallel`` and ``get_megatron_optimizer`` allocate CUDA buffers: the optimizer is
  Megatron's own ``FP32Optimizer`` over a ``torch.optim.Adam`` of the model's parameters (one parameter
  group for the dense parameters and one for the experts, as Megatron groups them), whose constructor's
  only CUDA call (the loss-scale tensor) is replaced.
- The MoE layers use the ``allgather`` token dispatcher (the default ``alltoall`` one needs CUDA).
- ``FullyParallelLoadStrategyWrapper.load`` calls ``torch.cuda.synchronize()`` after its exchange (a no-op
  for CPU tensors, an error without CUDA): :func:`cpu_synchronize` makes it a no-op while the wrapper loads,
  and its exchange runs with ``exchange_algo="gather_object"`` (the ``broadcast`` and ``gather_rounds``
  exchanges copy every tensor to CUDA).
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from collections.abc import Iterator
from typing import Any

import torch

VOCAB = 64  # Megatron pads the vocabulary itself (make_vocab_size_divisible_by): the model gets the padded size
HIDDEN = 16
LAYERS = 4
EXPERTS = 4


@dataclasses.dataclass(frozen=True)
class MegatronLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @classmethod
    def parse(cls, text: str) -> MegatronLayout:
        sizes = dict(part.split("=") for part in text.split(",") if part)
        return cls(**{k: int(v) for k, v in sizes.items()})


_current: list[MegatronLayout | None] = [None]
_snapshots: dict[MegatronLayout, dict[str, Any]] = {}
"""Megatron's parallel state (the globals of ``parallel_state``) of each layout this rank process has used:
switching back restores them instead of creating the process groups again. Each gloo group keeps threads
polling its connections, so groups created per test would pile up in the pool's processes and slow the whole
suite down."""


def _state_names() -> list[str]:
    from megatron.core import parallel_state

    return [name for name in vars(parallel_state) if name.startswith("_") and name[1:2].isupper()]


def use_layout(layout: MegatronLayout) -> None:
    """Megatron's parallel state for ``layout`` over the pool's default group. The first use of a layout in a
    rank process is collective over the default group (it creates the groups)."""
    from megatron.core import parallel_state

    if _current[0] == layout:
        return
    if _current[0] is not None:
        _snapshots[_current[0]] = {name: getattr(parallel_state, name) for name in _state_names()}
    snapshot = _snapshots.get(layout)
    if snapshot is not None:
        for name, value in snapshot.items():
            setattr(parallel_state, name, value)
    else:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep,
            create_gloo_process_groups=False,
        )
    _current[0] = layout


def release_layouts() -> int:
    """Destroy every process group Megatron created in this rank process (all layouts) and forget them;
    returns how many. Not collective (destroying a group is local)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if _current[0] is not None:
        _snapshots[_current[0]] = {name: getattr(parallel_state, name) for name in _state_names()}
    groups: dict[int, Any] = {}

    def collect(value: Any) -> None:
        if isinstance(value, dist.ProcessGroup):
            groups[id(value)] = value
        elif isinstance(value, list | tuple):
            for item in value:
                collect(item)
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)

    for snapshot in _snapshots.values():
        for value in snapshot.values():
            collect(value)
    world = dist.group.WORLD
    released = 0
    for group in groups.values():
        if group is not world:
            dist.destroy_process_group(group)
            released += 1
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _snapshots.clear()
    _current[0] = None
    return released


def rank_release_megatron(ctx: Any) -> int:
    """Destroy Megatron's process groups in this rank process; the number of threads left. A function for a
    rank pool (see :mod:`tests.rankpool`)."""
    import gc
    import os

    release_layouts()
    gc.collect()  # the models and optimizers of the tests hold the groups in reference cycles
    return len(os.listdir("/proc/self/task"))


def rank_thread_count(ctx: Any) -> int:
    """The number of threads of this rank process (a function for a rank pool)."""
    import os

    return len(os.listdir("/proc/self/task"))


def build_gpt(layout: MegatronLayout, *, vocab: int = VOCAB, seed: int = 7) -> Any:
    """A GPTModel (GQA, GLU, MoE in every layer with the allgather dispatcher, local layer spec) for this
    rank of ``layout``; the same global weights on every layout (CPU initialisation from ``seed``)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    use_layout(layout)
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=32,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        add_bias_linear=False,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_token_dispatcher_type="allgather",
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        pipeline_dtype=torch.float32,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False),
        vocab_size=vocab,
        max_sequence_length=16,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def adam_init_state(optimizer: torch.optim.Optimizer, config: Any = None) -> None:
    """Adam's state for every parameter, zeros (Megatron's init_state_fn, used before a load)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not optimizer.state[param]:
                optimizer.state[param] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(param),
                    "exp_avg_sq": torch.zeros_like(param),
                }


def build_optimizer(model: Any, *, filled: bool = False) -> Any:
    """Megatron's FP32Optimizer over Adam (dense and, if any, expert parameter groups, tagged as Megatron tags them).
    ``filled``: Adam's state holds values that differ per element and per parameter (as after training) and
    step 3; otherwise zeros."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class CpuFP32Optimizer(FP32Optimizer):  # type: ignore[misc]
        def __init__(self, optimizer: Any, config: Any, init_state_fn: Any) -> None:
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.tensor([1.0])
            self.is_stub_optimizer = False

    named = list(model.named_parameters())
    dense = [p for name, p in named if ".experts." not in name]
    experts = [p for name, p in named if ".experts." in name]
    tags = {"wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False}  # as Megatron's _get_param_groups
    groups = [{"params": dense, **tags, "is_expert_parallel": False}]
    if experts:
        groups += [{"params": experts, **tags, "is_expert_parallel": True}]
    adam = torch.optim.Adam(groups, lr=1e-3)
    optimizer = CpuFP32Optimizer(
        adam, OptimizerConfig(optimizer="adam", lr=1e-3, bf16=False, fp16=False), adam_init_state
    )
    adam_init_state(adam)
    if filled:  # derived from the parameter, so that replicas hold the same state, as after training
        for param in dense + experts:
            state = adam.state[param]
            state["step"] = torch.tensor(3.0)
            state["exp_avg"] = param.detach() * 0.5 + 0.25
            state["exp_avg_sq"] = param.detach() ** 2 + 0.125
    return optimizer


def perturb(model: Any) -> None:
    """Give every parameter values that depend on nothing but its global element (so a load that misplaces
    one is caught): the model's own values plus a key-dependent offset are enough, since CPU
    initialisation already made them layout-independent."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(zlib.crc32(name.split(".")[-1].encode()) % 7 * 0.01)


def sharded_pieces(sharded_state_dict: Any) -> list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor, bool]]:
    """Every ShardedTensor of a Megatron sharded state dict (factories applied): (key, global shape,
    global offset, local tensor with the prepended axes, whether it is the main replica)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    out = []
    pending = list(nested_values(sharded_state_dict))
    while pending:
        value = pending.pop()
        if isinstance(value, ShardedTensorFactory):
            pending.extend(nested_values(value.build()))
        elif isinstance(value, ShardedTensor):
            data = value.data.detach().reshape((1,) * value.prepend_axis_num + tuple(value.local_shape)).clone()
            out.append(
                (
                    value.key,
                    tuple(value.global_shape),
                    tuple(value.global_offset),
                    data,
                    is_main_replica(value.replica_id),
                )
            )
    return out


def assemble(pieces_per_rank: list[list[Any]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's main-replica pieces (test process side)."""
    full: dict[str, torch.Tensor] = {}
    for pieces in pieces_per_rank:
        for key, shape, offset, data, main in pieces:
            if not main:
                continue
            target = full.setdefault(key, torch.full(shape, float("nan")))
            target[tuple(slice(o, o + n) for o, n in zip(offset, data.shape, strict=True))] = data
    return full


def check_pieces(full: dict[str, torch.Tensor], pieces_per_rank: list[list[Any]]) -> list[str]:
    """The pieces (of every replica) that differ from ``full``: problems as text."""
    problems = []
    for rank, pieces in enumerate(pieces_per_rank):
        for key, shape, offset, data, _ in pieces:
            if key not in full:
                problems.append(f"rank {rank}: {key} not saved")
                continue
            region = full[key][tuple(slice(o, o + n) for o, n in zip(offset, data.shape, strict=True))]
            if full[key].shape != shape or not torch.equal(region, data):
                problems.append(f"rank {rank}: {key} at {offset} differs")
    return problems


@contextlib.contextmanager
def cpu_synchronize() -> Iterator[None]:
    """While active, ``torch.cuda.synchronize`` is a no-op in this process (see the module doc)."""
    saved = torch.cuda.synchronize
    torch.cuda.synchronize = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.synchronize = saved
