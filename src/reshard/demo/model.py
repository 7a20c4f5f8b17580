"""A small Megatron-style GPT: TP, PP (with virtual stages), DP, CP, EP and ETP, on CPU with gloo.

Every parameter has a *global* key (global layer numbers, global expert numbers) and a
:class:`ParamLayout` that says where the rank's local tensor lies in the global tensor: this is all
reshard needs to save it on one layout and load it on any other. Parameters are initialised from their
global tensors (seeded per key), so every layout starts from the same model.

Tensor layouts (global tensor -> local tensor on TP rank ``r`` of ``tp``):

- word embedding and output layer ``[V_pad, h]``: vocabulary-parallel rows, ``V`` padded to a multiple of
  ``tp * vocab_pad_multiple``; the checkpoint holds the logical ``[V, h]``.
- fused QKV ``[Q; K; V]`` (all query heads, then key heads, then value heads): the local tensor is
  interleaved by query group, ``[q_g, k_g, v_g]`` for each of the rank's groups (3 segments per group).
- attention output projection ``[h, heads * d]``: row-parallel, split on axis 1.
- GLU ``fc1`` ``[gate; up]``: local ``[gate_r; up_r]`` (2 segments); ``fc2 [h, ffn]`` split on axis 1.
- norms and the MoE router: replicated on every TP rank.
- experts, stacked per layer: ``fc1 [E, ffn_e, h]`` and ``fc2 [E, h, ffn_e]``, experts split by EP,
  the ffn axis split by ETP.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from reshard.demo.collectives import (
    copy_to_group,
    gather_last_dim,
    gather_tokens,
    reduce_from_group,
    reduce_then_slice_tokens,
)
from reshard.demo.parallel import ParallelConfig, ParallelGroups
from reshard.sharding import ShardedTensor

__all__ = ["GPTStage", "ModelConfig", "ParamLayout"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Sizes of the demo GPT. ``moe_layers`` are the global layer numbers that use experts."""

    vocab_size: int = 61
    hidden: int = 32
    num_layers: int = 4
    num_heads: int = 8
    num_query_groups: int = 4
    head_dim: int = 4
    ffn_hidden: int = 64
    moe_layers: tuple[int, ...] = (1, 3)
    num_experts: int = 4
    moe_topk: int = 2
    expert_ffn_hidden: int = 32
    seq_len: int = 16
    vocab_pad_multiple: int = 8
    seed: int = 1234

    def padded_vocab(self, tp: int) -> int:
        multiple = tp * self.vocab_pad_multiple
        return -(-self.vocab_size // multiple) * multiple

    def check(self, parallel: ParallelConfig) -> None:
        """Raise ValueError when ``parallel`` cannot run this model."""
        chunks = parallel.pp * parallel.vpp
        problems = []
        if self.num_layers % chunks:
            problems.append(f"num_layers={self.num_layers} is not divisible by pp*vpp={chunks}")
        if self.num_query_groups % parallel.tp:
            problems.append(f"num_query_groups={self.num_query_groups} is not divisible by tp={parallel.tp}")
        if self.num_heads % self.num_query_groups:
            problems.append("num_heads must be a multiple of num_query_groups")
        if self.ffn_hidden % parallel.tp:
            problems.append(f"ffn_hidden={self.ffn_hidden} is not divisible by tp={parallel.tp}")
        if self.moe_layers and self.num_experts % parallel.ep:
            problems.append(f"num_experts={self.num_experts} is not divisible by ep={parallel.ep}")
        if self.moe_layers and self.expert_ffn_hidden % parallel.etp:
            problems.append(f"expert_ffn_hidden={self.expert_ffn_hidden} is not divisible by etp={parallel.etp}")
        if problems:
            raise ValueError(f"layout {parallel.describe()} cannot run this model: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["moe_layers"] = list(self.moe_layers)
        return out

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> ModelConfig:
        return cls(**{**doc, "moe_layers": tuple(doc["moe_layers"])})


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamLayout:
    """Where a rank's local tensor of parameter ``key`` lies in the global tensor (see ShardedTensor)."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    replica_id: tuple[int, ...]
    segment_axis: int | None = None
    segments: tuple[tuple[int, int], ...] | None = None
    logical_shape: tuple[int, ...] | None = None
    is_expert: bool = False
    tp_replicated: bool = False
    zero_replica_id: tuple[int, ...] = field(default=(0,))
    """Replica id of this parameter's ZeRO flat ranges (only TP copies of a TP-replicated parameter)."""

    def sharded(
        self, tensor: torch.Tensor, key: str | None = None, replica_id: tuple[int, ...] | None = None
    ) -> ShardedTensor:
        """``tensor`` (this parameter's local tensor, or an optimizer state of the same shape) described
        for reshard."""
        return ShardedTensor(
            key or self.key,
            tensor,
            self.global_shape,
            self.global_offset,
            self.replica_id if replica_id is None else replica_id,
            logical_shape=self.logical_shape,
            segment_axis=self.segment_axis,
            segments=self.segments,
        )

    def flat(self, data: torch.Tensor, start: int, end: int, key: str) -> ShardedTensor:
        """Elements ``[start, end)`` of the flattened local tensor (a ZeRO-1 slice) described for reshard."""
        return ShardedTensor.from_flat_range(
            key,
            data,
            self.local_shape,
            self.global_shape,
            self.global_offset,
            start,
            end,
            self.zero_replica_id,
            segment_axis=self.segment_axis,
            segments=self.segments,
            logical_shape=self.logical_shape,
        )

    @property
    def saved_shape(self) -> tuple[int, ...]:
        return self.logical_shape if self.logical_shape is not None else self.global_shape


def init_global(key: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """The initial value of a whole global tensor: the same on every layout."""
    if key.endswith("norm.weight"):
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    fan_in = shape[-1]
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


class GPTStage:
    """The part of the GPT that one rank holds: its pipeline chunks' layers (and the embedding on the
    first virtual stage, the final norm and output layer on the last), as local tensors.

    Attributes:
        params: local parameter tensors by global key (leaf tensors that require grad).
        layouts: the ParamLayout of every parameter, by the same key.
        chunks: for each local virtual-pipeline chunk, its global layer numbers.
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups) -> None:
        parallel = groups.config
        config.check(parallel)
        self.config = config
        self.groups = groups
        c = groups.coords
        self.num_chunks = parallel.pp * parallel.vpp
        per_chunk = config.num_layers // self.num_chunks
        self.virtual_stages = [c.pp + i * parallel.pp for i in range(parallel.vpp)]
        self.chunks = [list(range(v * per_chunk, (v + 1) * per_chunk)) for v in self.virtual_stages]
        self.has_embedding = 0 in self.virtual_stages
        self.has_output = self.num_chunks - 1 in self.virtual_stages
        self.layouts: dict[str, ParamLayout] = {}
        self._build_layouts()
        self.params: dict[str, torch.Tensor] = {}
        for key, layout in self.layouts.items():
            local = torch.zeros(layout.local_shape)
            full = init_global(key, layout.saved_shape, config.seed)
            with torch.no_grad():
                for piece in layout.sharded(local).pieces():
                    piece.view.copy_(
                        full[tuple(slice(o, o + n) for o, n in zip(piece.box.offset, piece.box.shape, strict=True))]
                    )
            self.params[key] = local.requires_grad_(True)

    # ---- layouts ---------------------------------------------------------------------------------

    def _dense(
        self,
        key: str,
        global_shape: tuple[int, ...],
        local_shape: tuple[int, ...],
        offset: tuple[int, ...],
        *,
        tp_replicated: bool = False,
        **extra: Any,
    ) -> None:
        c = self.groups.coords
        tp_rep = c.tp if tp_replicated else 0
        self.layouts[key] = ParamLayout(
            key=key,
            global_shape=global_shape,
            global_offset=offset,
            local_shape=local_shape,
            replica_id=(tp_rep, c.cp, c.dp),
            tp_replicated=tp_replicated,
            zero_replica_id=(tp_rep,),
            **extra,
        )

    def _build_layouts(self) -> None:
        cfg = self.config
        parallel = self.groups.config
        c = self.groups.coords
        tp, r = parallel.tp, c.tp
        h, d = cfg.hidden, cfg.head_dim
        vocab_padded = cfg.padded_vocab(tp)
        rows = vocab_padded // tp
        if self.has_embedding:
            self._dense(
                "embedding.word_embeddings.weight",
                (vocab_padded, h),
                (rows, h),
                (r * rows, 0),
                logical_shape=(cfg.vocab_size, h),
            )
        groups_local = cfg.num_query_groups // tp
        per_group = cfg.num_heads // cfg.num_query_groups
        q_rows = cfg.num_heads * d
        kv_rows = cfg.num_query_groups * d
        ffn_local = cfg.ffn_hidden // tp
        for chunk in self.chunks:
            for layer in chunk:
                prefix = f"decoder.layers.{layer}"
                self._dense(f"{prefix}.input_norm.weight", (h,), (h,), (0,), tp_replicated=True)
                segments = []
                for g in range(r * groups_local, (r + 1) * groups_local):
                    segments += [(g * per_group * d, per_group * d), (q_rows + g * d, d), (q_rows + kv_rows + g * d, d)]
                qkv_local = groups_local * (per_group + 2) * d
                self._dense(
                    f"{prefix}.self_attention.qkv.weight",
                    (q_rows + 2 * kv_rows, h),
                    (qkv_local, h),
                    (0, 0),
                    segment_axis=0,
                    segments=tuple(segments),
                )
                heads_cols = groups_local * per_group * d
                self._dense(f"{prefix}.self_attention.proj.weight", (h, q_rows), (h, heads_cols), (0, r * heads_cols))
                self._dense(f"{prefix}.pre_mlp_norm.weight", (h,), (h,), (0,), tp_replicated=True)
                if layer in cfg.moe_layers:
                    self._build_moe_layouts(prefix)
                else:
                    self._dense(
                        f"{prefix}.mlp.fc1.weight",
                        (2 * cfg.ffn_hidden, h),
                        (2 * ffn_local, h),
                        (0, 0),
                        segment_axis=0,
                        segments=((r * ffn_local, ffn_local), (cfg.ffn_hidden + r * ffn_local, ffn_local)),
                    )
                    self._dense(f"{prefix}.mlp.fc2.weight", (h, cfg.ffn_hidden), (h, ffn_local), (0, r * ffn_local))
        if self.has_output:
            self._dense("decoder.final_norm.weight", (h,), (h,), (0,), tp_replicated=True)
            self._dense(
                "output_layer.weight", (vocab_padded, h), (rows, h), (r * rows, 0), logical_shape=(cfg.vocab_size, h)
            )

    def _build_moe_layouts(self, prefix: str) -> None:
        cfg = self.config
        parallel = self.groups.config
        c = self.groups.coords
        h = cfg.hidden
        self._dense(
            f"{prefix}.mlp.router.weight", (cfg.num_experts, h), (cfg.num_experts, h), (0, 0), tp_replicated=True
        )
        experts = cfg.num_experts // parallel.ep
        ffn = cfg.expert_ffn_hidden // parallel.etp
        edp = (self.groups.edp_index,)
        self.layouts[f"{prefix}.mlp.experts.fc1.weight"] = ParamLayout(
            key=f"{prefix}.mlp.experts.fc1.weight",
            global_shape=(cfg.num_experts, cfg.expert_ffn_hidden, h),
            global_offset=(c.ep * experts, c.etp * ffn, 0),
            local_shape=(experts, ffn, h),
            replica_id=edp,
            is_expert=True,
        )
        self.layouts[f"{prefix}.mlp.experts.fc2.weight"] = ParamLayout(
            key=f"{prefix}.mlp.experts.fc2.weight",
            global_shape=(cfg.num_experts, h, cfg.expert_ffn_hidden),
            global_offset=(c.ep * experts, 0, c.etp * ffn),
            local_shape=(experts, h, ffn),
            replica_id=edp,
            is_expert=True,
        )

    # ---- forward ---------------------------------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.params["embedding.word_embeddings.weight"]
        start = self.groups.tp.index * weight.shape[0]
        inside = (tokens >= start) & (tokens < start + weight.shape[0])
        local = torch.where(inside, tokens - start, torch.zeros_like(tokens))
        out = weight[local] * inside.unsqueeze(-1)
        return reduce_from_group(out, self.groups.tp)

    def layer(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        prefix = f"decoder.layers.{layer}"
        p = self.params
        x = x + self._attention(prefix, rms_norm(x, p[f"{prefix}.input_norm.weight"]))
        normed = rms_norm(x, p[f"{prefix}.pre_mlp_norm.weight"])
        if layer in self.config.moe_layers:
            return x + self._moe(prefix, normed)
        return x + self._mlp(prefix, normed)

    def _attention(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        tp = self.groups.tp
        batch, seq, _ = x.shape
        per_group = cfg.num_heads // cfg.num_query_groups
        groups_local = cfg.num_query_groups // tp.size
        qkv = copy_to_group(x, tp) @ self.params[f"{prefix}.self_attention.qkv.weight"].t()
        qkv = qkv.view(batch, seq, groups_local, per_group + 2, cfg.head_dim)
        q = qkv[:, :, :, :per_group].reshape(batch, seq, groups_local * per_group, cfg.head_dim)
        k = qkv[:, :, :, per_group].repeat_interleave(per_group, dim=2)
        v = qkv[:, :, :, per_group + 1].repeat_interleave(per_group, dim=2)
        context = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        context = context.transpose(1, 2).reshape(batch, seq, -1)
        return reduce_from_group(context @ self.params[f"{prefix}.self_attention.proj.weight"].t(), tp)

    def _mlp(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        tp = self.groups.tp
        gate_up = copy_to_group(x, tp) @ self.params[f"{prefix}.mlp.fc1.weight"].t()
        gate, up = gate_up.chunk(2, dim=-1)
        return reduce_from_group((F.silu(gate) * up) @ self.params[f"{prefix}.mlp.fc2.weight"].t(), self.groups.tp)

    def _moe(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        g = self.groups
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = torch.softmax(tokens @ self.params[f"{prefix}.mlp.router.weight"].t(), dim=-1)
        weights, chosen = probs.topk(cfg.moe_topk, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        # Expert parallelism: every rank of the EP group sees the tokens of all of them.
        all_tokens = copy_to_group(gather_tokens(tokens, g.ep), g.etp)
        # Each ETP rank multiplies only its slice of the expert output by the routing weight, so the
        # weight's gradient is a sum over the ETP group, like the tokens'.
        all_weights = copy_to_group(gather_tokens(weights, g.ep), g.etp)
        all_chosen = _all_gather_plain(chosen, g)
        fc1 = self.params[f"{prefix}.mlp.experts.fc1.weight"]
        fc2 = self.params[f"{prefix}.mlp.experts.fc2.weight"]
        first_expert = g.coords.ep * fc1.shape[0]
        partial = torch.zeros_like(all_tokens)
        for local in range(fc1.shape[0]):
            rows, slots = (all_chosen == first_expert + local).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            hidden = F.gelu(all_tokens[rows] @ fc1[local].t())
            out = (hidden @ fc2[local].t()) * all_weights[rows, slots].unsqueeze(-1)
            partial = partial.index_add(0, rows, out)
        partial = reduce_from_group(partial, g.etp)  # expert tensor parallelism: sum the ffn slices
        return reduce_then_slice_tokens(partial, g.ep).reshape(shape)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the logical vocabulary (padding columns removed)."""
        x = rms_norm(x, self.params["decoder.final_norm.weight"])
        local = copy_to_group(x, self.groups.tp) @ self.params["output_layer.weight"].t()
        return gather_last_dim(local, self.groups.tp)[..., : self.config.vocab_size]


def _all_gather_plain(x: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """All-gather along axis 0 over the EP group, without autograd (integer expert choices)."""
    group = groups.ep
    if group.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.process_group)
    return torch.cat(parts, 0)
