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

LoRA (:class:`LoraConfig`): a low-rank update ``W + (alpha / r) * B @ A`` on the targeted linears, with
the base frozen. Adapters are keyed ``<base key without .weight>.lora_A.weight`` / ``.lora_B.weight`` and
follow the base's parallelism, as in Megatron: for a column-parallel base (QKV, GLU ``fc1``, expert
``fc1`` under ETP) ``A [r, in]`` is replicated and ``B [out, r]`` is split like the base's output axis
(same segments); for a row-parallel base (attention ``proj``, ``fc2``, expert ``fc2`` under ETP) ``A
[r, in]`` is split like the base's input axis and ``B [out, r]`` is replicated. Expert adapters are
stacked per layer like the experts (``[E, r, in]`` and ``[E, out, r]``), split by EP.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from reshard.models.collectives import (
    copy_to_group,
    gather_last_dim,
    gather_tokens,
    reduce_from_group,
    reduce_then_slice_tokens,
)
from reshard.models.config import (
    EMBEDDING_KEY,
    GATE_ACTIVATIONS,
    LORA_TARGET_OF_SUFFIX,
    OUTPUT_WEIGHT_KEY,
    LoraConfig,
    ModelConfig,
    is_adapter_key,
)
from reshard.models.parallel import Group, ParallelGroups
from reshard.state.sharding import ShardedTensor

__all__ = ["GPTStage", "ParamLayout", "apply_rope", "init_global", "rms_norm", "rope_inverse_frequencies"]


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


def init_global(key: str, shape: tuple[int, ...], seed: int, *, lora_b: str = "zeros") -> torch.Tensor:
    """The initial value of a whole global tensor: the same on every layout."""
    if key.endswith("norm.weight"):
        return torch.ones(shape)
    if ".lora_B." in key and lora_b == "zeros":
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    fan_in = shape[-1]
    return torch.randn(shape, generator=generator) / math.sqrt(fan_in)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The rotary embedding's inverse frequencies over ``head_dim``, as transformers computes them for Llama
    (the default, or Llama 3.1's scaling that divides the low frequencies and blends the middle ones)."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[batch, seq, heads, head_dim]`` rotated by the ``[seq, head_dim]`` tables (halves convention)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class GPTStage:
    """The part of the GPT that one rank holds: its pipeline chunks' layers (and the embedding on the
    first virtual stage, the final norm and output layer on the last), as local tensors.

    Attributes:
        params: local parameter tensors by global key (the trainable ones require grad).
        layouts: the ParamLayout of every parameter, by the same key.
        trainable: the keys that train: all of them, or only the adapters with LoRA (the base is frozen).
        adapters: with LoRA, the adapted base key -> its (lora_A key, lora_B key).
        chunks: for each local virtual-pipeline chunk, its global layer numbers.
    """

    def __init__(self, config: ModelConfig, groups: ParallelGroups, lora: LoraConfig | None = None) -> None:
        parallel = groups.config
        config.check(parallel)
        self.config = config
        self.groups = groups
        self.lora = lora
        self.adapters: dict[str, tuple[str, str]] = {}
        c = groups.coords
        self.num_chunks = parallel.pp * parallel.vpp
        per_chunk = config.num_layers // self.num_chunks
        self.virtual_stages = [c.pp + i * parallel.pp for i in range(parallel.vpp)]
        self.chunks = [list(range(v * per_chunk, (v + 1) * per_chunk)) for v in self.virtual_stages]
        self.has_embedding = 0 in self.virtual_stages
        self.has_output = self.num_chunks - 1 in self.virtual_stages
        self.layouts: dict[str, ParamLayout] = {}
        self._inv_freq = rope_inverse_frequencies(config)
        self._rope_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._build_layouts()
        if lora is not None:
            for key in list(self.layouts):
                target = next((t for s, t in LORA_TARGET_OF_SUFFIX.items() if key.endswith("." + s)), None)
                if target in lora.targets:
                    self._build_adapter_layouts(key, lora.rank)
        self.trainable = [k for k in self.layouts if lora is None or is_adapter_key(k)]
        self.params: dict[str, torch.Tensor] = {}
        for key, layout in self.layouts.items():
            local = torch.zeros(layout.local_shape)
            full = init_global(key, layout.saved_shape, config.seed, lora_b=lora.init_b if lora else "zeros")
            with torch.no_grad():
                for piece in layout.sharded(local).pieces():
                    piece.view.copy_(
                        full[tuple(slice(o, o + n) for o, n in zip(piece.box.offset, piece.box.shape, strict=True))]
                    )
            self.params[key] = local.requires_grad_(key in self.trainable)

    # ---- layouts ---------------------------------------------------------------------------------

    def _dense(
        self,
        key: str,
        global_shape: tuple[int, ...],
        local_shape: tuple[int, ...],
        offset: tuple[int, ...],
        *,
        tp_replicated: bool = False,
        copy: bool = False,
        **extra: Any,
    ) -> None:
        """The layout of a dense parameter: replicated over CP and DP (and TP when ``tp_replicated``); a
        ``copy`` (the last stage's word embedding, when tied) is a replica of the same key on another stage."""
        c = self.groups.coords
        tp_rep = c.tp if tp_replicated else 0
        marker = (1,) if copy else ()
        self.layouts[key] = ParamLayout(
            key=key,
            global_shape=global_shape,
            global_offset=offset,
            local_shape=local_shape,
            replica_id=(tp_rep, c.cp, c.dp, *marker),
            tp_replicated=tp_replicated,
            zero_replica_id=(tp_rep, *marker),
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
        # Tied embeddings on several stages: the last stage holds a copy of the word embedding as its output
        # layer, under the embedding's key as a replica (saved once, loaded into both); the embedding group
        # sums the two copies' gradients, so they stay equal (Megatron's embedding group).
        tied_copy = cfg.tie_word_embeddings and self.has_output and not self.has_embedding
        if self.has_embedding or tied_copy:
            self._dense(
                EMBEDDING_KEY,
                (vocab_padded, h),
                (rows, h),
                (r * rows, 0),
                logical_shape=(cfg.vocab_size, h),
                copy=tied_copy,
            )
        groups_local = cfg.num_query_groups // tp
        per_group = cfg.num_heads // cfg.num_query_groups
        q_rows = cfg.num_heads * d
        kv_rows = cfg.num_query_groups * d
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
                if cfg.attention_bias or cfg.qkv_bias:
                    self._dense(
                        f"{prefix}.self_attention.qkv.bias",
                        (q_rows + 2 * kv_rows,),
                        (qkv_local,),
                        (0,),
                        segment_axis=0,
                        segments=tuple(segments),
                    )
                if cfg.attention_bias:
                    self._dense(f"{prefix}.self_attention.proj.bias", (h,), (h,), (0,), tp_replicated=True)
                if cfg.qk_norm:  # one weight over head_dim for every head: replicated on every TP rank
                    self._dense(f"{prefix}.self_attention.q_norm.weight", (d,), (d,), (0,), tp_replicated=True)
                    self._dense(f"{prefix}.self_attention.k_norm.weight", (d,), (d,), (0,), tp_replicated=True)
                self._dense(f"{prefix}.pre_mlp_norm.weight", (h,), (h,), (0,), tp_replicated=True)
                if layer in cfg.moe_layers:
                    self._build_moe_layouts(prefix)
                else:
                    self._build_glu_layouts(f"{prefix}.mlp", cfg.ffn_hidden, bias=cfg.mlp_bias)
        if self.has_output:
            self._dense("decoder.final_norm.weight", (h,), (h,), (0,), tp_replicated=True)
            if not cfg.tie_word_embeddings:  # tied: the output layer is the word embedding (or its copy, above)
                self._dense(
                    "output_layer.weight",
                    (vocab_padded, h),
                    (rows, h),
                    (r * rows, 0),
                    logical_shape=(cfg.vocab_size, h),
                )

    def _build_glu_layouts(self, module: str, ffn_hidden: int, *, bias: bool) -> None:
        """A tensor-parallel gated MLP at ``module``: ``fc1 [gate; up]`` column-parallel (2 segments per rank),
        ``fc2`` row-parallel; the dense MLP of a layer, or a shared expert."""
        h = self.config.hidden
        tp, r = self.groups.config.tp, self.groups.coords.tp
        ffn_local = ffn_hidden // tp
        segments = ((r * ffn_local, ffn_local), (ffn_hidden + r * ffn_local, ffn_local))
        self._dense(
            f"{module}.fc1.weight", (2 * ffn_hidden, h), (2 * ffn_local, h), (0, 0), segment_axis=0, segments=segments
        )
        self._dense(f"{module}.fc2.weight", (h, ffn_hidden), (h, ffn_local), (0, r * ffn_local))
        if bias:
            self._dense(
                f"{module}.fc1.bias", (2 * ffn_hidden,), (2 * ffn_local,), (0,), segment_axis=0, segments=segments
            )
            self._dense(f"{module}.fc2.bias", (h,), (h,), (0,), tp_replicated=True)

    def _build_moe_layouts(self, prefix: str) -> None:
        cfg = self.config
        parallel = self.groups.config
        c = self.groups.coords
        h = cfg.hidden
        self._dense(
            f"{prefix}.mlp.router.weight", (cfg.num_experts, h), (cfg.num_experts, h), (0, 0), tp_replicated=True
        )
        if cfg.shared_expert_ffn_hidden:  # Qwen2-MoE: a tensor-parallel gated MLP for every token, sigmoid-gated
            self._build_glu_layouts(f"{prefix}.mlp.shared_expert", cfg.shared_expert_ffn_hidden, bias=False)
            self._dense(f"{prefix}.mlp.shared_expert_gate.weight", (1, h), (1, h), (0, 0), tp_replicated=True)
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
        if cfg.expert_glu:  # the gate projection: laid out like fc1 (ETP splits its ffn axis the same way)
            fc1 = self.layouts[f"{prefix}.mlp.experts.fc1.weight"]
            self.layouts[f"{prefix}.mlp.experts.gate.weight"] = dataclasses.replace(
                fc1, key=f"{prefix}.mlp.experts.gate.weight"
            )
        self.layouts[f"{prefix}.mlp.experts.fc2.weight"] = ParamLayout(
            key=f"{prefix}.mlp.experts.fc2.weight",
            global_shape=(cfg.num_experts, h, cfg.expert_ffn_hidden),
            global_offset=(c.ep * experts, 0, c.etp * ffn),
            local_shape=(experts, h, ffn),
            replica_id=edp,
            is_expert=True,
        )

    def _build_adapter_layouts(self, base_key: str, rank: int) -> None:
        """The LoRA A and B layouts of the linear ``base_key``, derived from the base's layout (see the
        module docstring): the factor on the split side follows the base's split, the other is replicated
        over the ranks that split the base (TP for dense linears, ETP for experts)."""
        base = self.layouts[base_key]
        stem = base_key.removesuffix(".weight")
        a_key, b_key = f"{stem}.lora_A.weight", f"{stem}.lora_B.weight"
        self.adapters[base_key] = (a_key, b_key)
        c = self.groups.coords
        if base.is_expert:
            experts, out, inp = base.global_shape
            e0, out0, in0 = base.global_offset
            local_e, local_out, local_in = base.local_shape
            edp = base.replica_id
            # ETP splits fc1's output axis (column-parallel) and fc2's input axis (row-parallel).
            column = base_key.endswith("experts.fc1.weight")
            etp_rep = (c.etp, *edp)
            a_rep, b_rep = (etp_rep, edp) if column else (edp, etp_rep)
            self.layouts[a_key] = ParamLayout(
                key=a_key,
                global_shape=(experts, rank, inp),
                global_offset=(e0, 0, in0),
                local_shape=(local_e, rank, local_in),
                replica_id=a_rep,
                is_expert=True,
                zero_replica_id=(c.etp,) if column else (0,),
            )
            self.layouts[b_key] = ParamLayout(
                key=b_key,
                global_shape=(experts, out, rank),
                global_offset=(e0, out0, 0),
                local_shape=(local_e, local_out, rank),
                replica_id=b_rep,
                is_expert=True,
                zero_replica_id=(0,) if column else (c.etp,),
            )
            return
        out, inp = base.global_shape
        local_out, local_in = base.local_shape
        if base.segments is not None or local_out != out:  # column-parallel: the output axis is split
            self._dense(a_key, (rank, inp), (rank, inp), (0, 0), tp_replicated=True)
            self._dense(
                b_key,
                (out, rank),
                (local_out, rank),
                (base.global_offset[0], 0),
                segment_axis=base.segment_axis,
                segments=base.segments,
            )
        else:  # row-parallel: the input axis is split
            self._dense(a_key, (rank, inp), (rank, local_in), (0, base.global_offset[1]))
            self._dense(b_key, (out, rank), (out, rank), (0, 0), tp_replicated=True)

    # ---- forward ---------------------------------------------------------------------------------

    def _column(self, key: str, x: torch.Tensor, group: Group) -> torch.Tensor:
        """``x`` (the same on every rank of ``group``) through the column-parallel linear ``key``: this
        rank's output columns, with its adapter's update. ``A``'s gradient is summed over the group
        (``copy_to_group`` of ``x A^T``), so the replicated ``A`` stays identical on every rank."""
        out = copy_to_group(x, group) @ self.params[key].t()
        bias = self.params.get(key.removesuffix(".weight") + ".bias")
        if bias is not None:
            out = out + bias
        adapter = self._adapter_tensors(key)
        if adapter is None:
            return out
        a, b = adapter
        return out + self._lora_scale * (copy_to_group(x @ a.t(), group) @ b.t())

    @property
    def _lora_scale(self) -> float:
        return self.lora.scale if self.lora is not None else 0.0

    def _adapter_tensors(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        adapter = self.adapters.get(key)
        return None if adapter is None else (self.params[adapter[0]], self.params[adapter[1]])

    def _row(self, key: str, x: torch.Tensor, group: Group) -> torch.Tensor:
        """This rank's slice ``x`` of the input through the row-parallel linear ``key``: the whole output
        (summed over ``group``), with its adapter's update (``x A^T`` summed over the group, then the
        replicated ``B``)."""
        out = reduce_from_group(x @ self.params[key].t(), group)
        bias = self.params.get(key.removesuffix(".weight") + ".bias")  # replicated: added once, after the sum
        if bias is not None:
            out = out + bias
        adapter = self._adapter_tensors(key)
        if adapter is None:
            return out
        a, b = adapter
        return out + self._lora_scale * (reduce_from_group(x @ a.t(), group) @ b.t())

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
        eps = self.config.rms_norm_eps
        x = x + self._attention(prefix, rms_norm(x, p[f"{prefix}.input_norm.weight"], eps))
        normed = rms_norm(x, p[f"{prefix}.pre_mlp_norm.weight"], eps)
        if layer in self.config.moe_layers:
            return x + self._moe(prefix, normed)
        return x + self._mlp(f"{prefix}.mlp", normed)

    def _attention(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        tp = self.groups.tp
        batch, seq, _ = x.shape
        per_group = cfg.num_heads // cfg.num_query_groups
        groups_local = cfg.num_query_groups // tp.size
        qkv = self._column(f"{prefix}.self_attention.qkv.weight", x, tp)
        qkv = qkv.view(batch, seq, groups_local, per_group + 2, cfg.head_dim)
        cos, sin = self._rope_tables(seq)
        q = qkv[:, :, :, :per_group].reshape(batch, seq, groups_local * per_group, cfg.head_dim)
        k = qkv[:, :, :, per_group]
        if cfg.qk_norm:
            # Each TP rank normalises only its heads with the shared weight: copy_to_group sums the weight's
            # partial gradients over the TP group, so every rank's copy stays the same.
            eps = cfg.rms_norm_eps
            q = rms_norm(q, copy_to_group(self.params[f"{prefix}.self_attention.q_norm.weight"], tp), eps)
            k = rms_norm(k, copy_to_group(self.params[f"{prefix}.self_attention.k_norm.weight"], tp), eps)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin).repeat_interleave(per_group, dim=2)
        v = qkv[:, :, :, per_group + 1].repeat_interleave(per_group, dim=2)
        context = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        context = context.transpose(1, 2).reshape(batch, seq, -1)
        return self._row(f"{prefix}.self_attention.proj.weight", context, tp)

    def _rope_tables(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[seq, head_dim]`` of positions ``0 .. seq-1`` (every rank holds whole sequences)."""
        tables = self._rope_cache.get(seq)
        if tables is None:
            freqs = torch.arange(seq, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
            angles = torch.cat((freqs, freqs), dim=-1)
            tables = self._rope_cache[seq] = (angles.cos(), angles.sin())
        return tables

    def _mlp(self, module: str, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the tensor-parallel gated MLP at ``module`` (a layer's ``mlp`` or a shared expert)."""
        tp = self.groups.tp
        gate_up = self._column(f"{module}.fc1.weight", x, tp)
        gate, up = gate_up.chunk(2, dim=-1)
        return self._row(f"{module}.fc2.weight", GATE_ACTIVATIONS[self.config.hidden_act](gate) * up, tp)

    def _moe(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        g = self.groups
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = torch.softmax(tokens @ self.params[f"{prefix}.mlp.router.weight"].t(), dim=-1)
        weights, chosen = probs.topk(cfg.moe_topk, dim=-1)
        if cfg.moe_norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        # Expert parallelism: every rank of the EP group sees the tokens of all of them.
        ep_tokens = gather_tokens(tokens, g.ep)
        all_tokens = copy_to_group(ep_tokens, g.etp)
        # Each ETP rank multiplies only its slice of the expert output by the routing weight, so the
        # weight's gradient is a sum over the ETP group, like the tokens'.
        ep_weights = gather_tokens(weights, g.ep)
        all_weights = copy_to_group(ep_weights, g.etp)
        all_chosen = _all_gather_plain(chosen, g)
        fc1_key, fc2_key = f"{prefix}.mlp.experts.fc1.weight", f"{prefix}.mlp.experts.fc2.weight"
        fc1, fc2 = self.params[fc1_key], self.params[fc2_key]
        gate = self.params.get(f"{prefix}.mlp.experts.gate.weight")
        fc1_adapter = self._adapter_tensors(fc1_key)
        fc2_adapter = self._adapter_tensors(fc2_key)
        first_expert = g.coords.ep * fc1.shape[0]
        partial = torch.zeros_like(all_tokens)
        replicated = torch.zeros_like(all_tokens)  # adapter outputs that are whole on every ETP rank
        for local in range(fc1.shape[0]):
            # The same rows on every ETP rank (they share tokens, router and experts), so the collectives
            # below are called by all of them or by none.
            rows, slots = (all_chosen == first_expert + local).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            pre = all_tokens[rows] @ fc1[local].t()
            if fc1_adapter is not None:  # column-parallel over ETP: A replicated, B split like fc1
                a, b = fc1_adapter
                pre = pre + self._lora_scale * (copy_to_group(ep_tokens[rows] @ a[local].t(), g.etp) @ b[local].t())
            if gate is None:
                hidden = F.gelu(pre)
            else:
                hidden = GATE_ACTIVATIONS[cfg.hidden_act](all_tokens[rows] @ gate[local].t()) * pre
            out = (hidden @ fc2[local].t()) * all_weights[rows, slots].unsqueeze(-1)
            partial = partial.index_add(0, rows, out)
            if fc2_adapter is not None:  # row-parallel over ETP: A split like fc2, B replicated
                a, b = fc2_adapter
                low_rank = reduce_from_group(hidden @ a[local].t(), g.etp)
                update = self._lora_scale * (low_rank @ b[local].t()) * ep_weights[rows, slots].unsqueeze(-1)
                replicated = replicated.index_add(0, rows, update)
        partial = reduce_from_group(partial, g.etp) + replicated  # expert tensor parallelism: sum the slices
        routed = reduce_then_slice_tokens(partial, g.ep).reshape(shape)
        if not cfg.shared_expert_ffn_hidden:
            return routed
        gate_weight = self.params[f"{prefix}.mlp.shared_expert_gate.weight"]
        return routed + torch.sigmoid(x @ gate_weight.t()) * self._mlp(f"{prefix}.mlp.shared_expert", x)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the logical vocabulary (padding columns removed)."""
        x = rms_norm(x, self.params["decoder.final_norm.weight"], self.config.rms_norm_eps)
        weight = self.params[OUTPUT_WEIGHT_KEY if not self.config.tie_word_embeddings else EMBEDDING_KEY]
        local = copy_to_group(x, self.groups.tp) @ weight.t()
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
