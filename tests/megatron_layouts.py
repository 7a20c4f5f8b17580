"""Megatron-style parallel layouts as pure functions of (parallel sizes, rank).

Every tensor has a deterministic *global* value (built identically on every rank, every element
distinct) and a canonical global layout that does not depend on the parallel sizes:

- fused QKV weight: rows ``[Q; K; V]`` (all query heads, then all key heads, then all value heads),
  hidden columns whole; a TP rank's local fused tensor is *segmented* along axis 0:
  plain MHA ``[q_tp; k_tp; v_tp]``, GQA interleaved by query group ``[q_g0, k_g0, v_g0, q_g1, ...]``;
- GLU fused gate/up: global ``[gate; up]``, local ``[gate_tp; up_tp]``;
- vocabulary-parallel embedding: logical vocabulary padded to a multiple of ``tp * 8`` (so the padded
  global shape depends on TP), split on axis 0, ``logical_shape = (VOCAB, HIDDEN)``;
- row-parallel projection (split on axis 1), replicated layernorm (``replica_id`` = TP rank);
- a stacked layer axis split by PP (one key, leading axis of ``LAYERS``; one leaf per contiguous chunk
  of layers, or, like Megatron-Core's prepended layer axis, one leaf per layer; with virtual pipeline
  chunks a rank holds several non-contiguous chunks) and per-layer keys with global layer numbers;
- stacked experts (leading axis of ``EXPERTS`` split by EP; one leaf per rank, or one per local expert
  like a sequential MLP), the ffn axis split by ETP;
- Adam ``exp_avg``/``exp_avg_sq``: either plain TP shards replicated over DP, or (ZeRO-1) one flat
  buffer per TP rank, the concatenation of the rank's local shards, split evenly over DP ranks.

A layout is a list of :class:`Shard` (pure description); :func:`build_state` turns it into a rank's
state dict in one of three modes: ``"save"`` (the rank's slice of the global tensors, with garbage in
padding), ``"template"`` (same layout, zeros; NaN for padded tensors) and ``"expected"`` (what a load
must produce: the global slice with zero padding).

Rank order (as Megatron's default ``tp-cp-ep-dp-pp``): TP fastest, then DP, then PP; expert ranks inside
a PP stage: ETP fastest, then EP, then expert-DP.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from reshard import ShardedTensor

HIDDEN = 4
MHA_HEADS = 8
HEAD_DIM = 2
GQA_HEADS = 16
GQA_GROUPS = 8
FFN = 16
VOCAB = 50
VOCAB_MULTIPLE = 8
LAYERS = 8
LAYER_ROWS = 8
LAYER_COLS = 3
MOE_LAYERS = (1, 6)
EXPERTS = 4
EXPERT_FFN = 4
EXPERT_HIDDEN = 3
TRAP_SHAPE = (2, 4, 2)  # 2 experts, ffn 4 (split by ETP 2), hidden 2
OPT_VOCAB = 13
PAD_GARBAGE = 777.0

KEY_MHA = "decoder.layers.0.self_attention.linear_qkv.weight"
KEY_GQA = "gqa.decoder.layers.0.self_attention.linear_qkv.weight"
KEY_GLU = "decoder.layers.0.mlp.linear_fc1.weight"
KEY_EMBED = "embedding.word_embeddings.weight"
KEY_PROJ = "decoder.layers.0.self_attention.linear_proj.weight"
KEY_NORM = "decoder.final_layernorm.weight"
KEY_STACKED = "decoder.layers.mlp.linear_fc1.weight"
KEY_TRAP = "trap.decoder.layers.0.mlp.experts.linear_fc1.weight"

PARTS = ("mha", "gqa", "glu", "embed", "proj", "norm", "stacked", "per_layer", "experts", "optim", "trap")
DENSE = ("mha", "gqa", "glu", "embed", "proj", "norm")
AXIS0 = ("mha", "gqa", "glu", "embed")
"""Parts split only along axis 0: a TP change reads exactly the needed bytes."""

ReplicaId = int | tuple[int, ...]


@dataclass(frozen=True)
class Par:
    """Parallel sizes. World = tp * dp * pp; experts use ep * etp * edp = tp * dp ranks of each stage.

    ``zero``: the optimizer state is ZeRO-1 sharded over DP (only meaningful with dp > 1). ``vpp``:
    virtual pipeline chunks per stage. ``layer_leaves``: the stacked layer key as one leaf per layer
    (else one per chunk); ``expert_leaves``: stacked experts as one leaf per local expert (else one).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1
    zero: bool = False
    vpp: int = 1
    layer_leaves: bool = False
    expert_leaves: bool = False

    def __post_init__(self) -> None:
        if (self.tp * self.dp) % (self.ep * self.etp):
            raise ValueError(f"{self}: ep * etp must divide tp * dp")
        if LAYERS % (self.pp * self.vpp):
            raise ValueError(f"{self}: pp * vpp must divide {LAYERS} layers")

    @property
    def world(self) -> int:
        return self.tp * self.dp * self.pp

    def coords(self, rank: int) -> Coords:
        stage = self.tp * self.dp
        in_stage = rank % stage
        return Coords(
            tp=rank % self.tp,
            dp=(rank // self.tp) % self.dp,
            pp=rank // stage,
            etp=in_stage % self.etp,
            ep=(in_stage // self.etp) % self.ep,
            edp=in_stage // (self.etp * self.ep),
        )

    def __str__(self) -> str:
        text = f"TP{self.tp}PP{self.pp}DP{self.dp}EP{self.ep}ETP{self.etp}"
        text += f"VPP{self.vpp}" if self.vpp > 1 else ""
        text += "-layerleaves" if self.layer_leaves else ""
        text += "-expertleaves" if self.expert_leaves else ""
        return text + ("-zero" if self.zero else "")


@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int


@dataclass(frozen=True)
class Shard:
    """Where one rank's local shard of tensor ``key`` lies: a box at ``offset`` of shape ``local_shape``,
    or, with ``segment_axis``, the concatenation along that axis of the global ranges ``segments``."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    replica_id: ReplicaId = 0
    segment_axis: int | None = None
    segments: tuple[tuple[int, int], ...] = ()
    logical_shape: tuple[int, ...] | None = None
    rank_offsets: tuple[tuple[int, int, int], ...] = ()
    """When set, described with ``ShardedTensor.from_rank_offsets``."""

    @property
    def saved_shape(self) -> tuple[int, ...]:
        return self.logical_shape if self.logical_shape is not None else self.global_shape

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This shard's local tensor cut out of the padded global tensor ``full`` (a new tensor)."""
        index = [slice(o, o + n) for o, n in zip(self.offset, self.local_shape, strict=True)]
        if self.segment_axis is None:
            return full[tuple(index)].clone()
        parts = []
        for start, length in self.segments:
            index[self.segment_axis] = slice(start, start + length)
            parts.append(full[tuple(index)])
        return torch.cat(parts, dim=self.segment_axis)

    def describe(self, data: torch.Tensor) -> ShardedTensor:
        if self.segment_axis is not None:
            return ShardedTensor.segmented(
                self.key,
                data,
                self.global_shape,
                self.segment_axis,
                list(self.segments),
                self.replica_id,
                global_offset=self.offset,
                logical_shape=self.logical_shape,
            )
        if self.rank_offsets:
            return ShardedTensor.from_rank_offsets(
                self.key, data, *self.rank_offsets, replica_id=self.replica_id, logical_shape=self.logical_shape
            )
        return ShardedTensor(
            self.key, data, self.global_shape, self.offset, self.replica_id, logical_shape=self.logical_shape
        )

    def describe_flat(self, data: torch.Tensor, start: int, end: int, replica_id: ReplicaId) -> ShardedTensor:
        return ShardedTensor.from_flat_range(
            self.key,
            data,
            self.local_shape,
            self.global_shape,
            self.offset,
            start,
            end,
            replica_id,
            segment_axis=self.segment_axis,
            segments=list(self.segments) if self.segment_axis is not None else None,
            logical_shape=self.logical_shape,
        )


def split(
    key: str,
    global_shape: tuple[int, ...],
    *rank_offsets: tuple[int, int, int],
    replica_id: ReplicaId = 0,
    logical_shape: tuple[int, ...] | None = None,
) -> Shard:
    """Even split: for each ``(axis, rank, parts)`` the shard is part ``rank`` of ``parts`` on ``axis``."""
    offset = [0] * len(global_shape)
    local = list(global_shape)
    for axis, rank, parts in rank_offsets:
        assert global_shape[axis] % parts == 0, (key, global_shape, axis, parts)
        local[axis] = global_shape[axis] // parts
        offset[axis] = local[axis] * rank
    return Shard(
        key,
        global_shape,
        tuple(offset),
        tuple(local),
        replica_id,
        logical_shape=logical_shape,
        rank_offsets=tuple(rank_offsets),
    )


def segmented(
    key: str, global_shape: tuple[int, ...], axis: int, segments: Iterable[tuple[int, int]], replica_id: ReplicaId = 0
) -> Shard:
    segs = tuple(segments)
    local = tuple(sum(n for _, n in segs) if a == axis else s for a, s in enumerate(global_shape))
    return Shard(key, global_shape, (0,) * len(global_shape), local, replica_id, segment_axis=axis, segments=segs)


# --- global values ---------------------------------------------------------------------------------


@functools.cache
def global_value(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The logical global tensor ``key``: seeded randn, every element distinct (for float32), identical on
    every rank. ``trap.*`` keys hold ``10 * expert + etp_slice`` (the seed report's values)."""
    if key.startswith("trap."):
        experts, ffn, hidden = shape
        e = torch.arange(experts).view(-1, 1, 1)
        f = torch.arange(ffn).view(1, -1, 1) // (ffn // 2)
        return (10 * e + f).expand(experts, ffn, hidden).to(dtype).contiguous()
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    value = torch.randn(shape, generator=gen, dtype=torch.float32)
    assert torch.unique(value).numel() == value.numel(), key
    return value.to(dtype)


@functools.cache
def padded_global(
    key: str,
    global_shape: tuple[int, ...],
    logical_shape: tuple[int, ...] | None,
    dtype: torch.dtype,
    pad: float,
) -> torch.Tensor:
    """The global tensor padded to ``global_shape`` with ``pad`` past ``logical_shape``. Do not mutate."""
    logical = logical_shape if logical_shape is not None else global_shape
    full = torch.full(global_shape, pad, dtype=dtype)
    full[tuple(slice(0, n) for n in logical)] = global_value(key, logical, dtype)
    return full


# --- layouts of one rank -------------------------------------------------------------------------------


def padded_vocab(tp: int, vocab: int = VOCAB, multiple: int = VOCAB_MULTIPLE) -> int:
    return math.ceil(vocab / (tp * multiple)) * tp * multiple


def mha_qkv(tp: int, r: int, replica_id: ReplicaId = 0, key: str = KEY_MHA) -> Shard:
    """Fused QKV of plain multi-head attention: local ``[q_tp; k_tp; v_tp]``."""
    rows = MHA_HEADS * HEAD_DIM
    n = rows // tp
    return segmented(key, (3 * rows, HIDDEN), 0, [(i * rows + r * n, n) for i in range(3)], replica_id)


def gqa_qkv(tp: int, r: int, replica_id: ReplicaId = 0, key: str = KEY_GQA) -> Shard:
    """Fused QKV with GQA interleaved by query group: local ``[q_g, k_g, v_g for g in this rank's groups]``."""
    per_group = GQA_HEADS // GQA_GROUPS * HEAD_DIM
    q_rows = GQA_HEADS * HEAD_DIM
    kv_rows = GQA_GROUPS * HEAD_DIM
    groups = GQA_GROUPS // tp
    segments = []
    for g in range(r * groups, (r + 1) * groups):
        segments += [
            (g * per_group, per_group),
            (q_rows + g * HEAD_DIM, HEAD_DIM),
            (q_rows + kv_rows + g * HEAD_DIM, HEAD_DIM),
        ]
    return segmented(key, (q_rows + 2 * kv_rows, HIDDEN), 0, segments, replica_id)


def glu_fc1(
    tp: int, r: int, replica_id: ReplicaId = 0, key: str = KEY_GLU, ffn: int = FFN, hidden: int = HIDDEN
) -> Shard:
    """Fused gate/up of a GLU: local ``[gate_tp; up_tp]``."""
    n = ffn // tp
    return segmented(key, (2 * ffn, hidden), 0, [(r * n, n), (ffn + r * n, n)], replica_id)


def vocab_embedding(
    tp: int,
    r: int,
    replica_id: ReplicaId = 0,
    key: str = KEY_EMBED,
    vocab: int = VOCAB,
    multiple: int = VOCAB_MULTIPLE,
    hidden: int = HIDDEN,
) -> Shard:
    """Vocabulary-parallel embedding padded to a multiple of ``tp * multiple`` rows."""
    return split(
        key,
        (padded_vocab(tp, vocab, multiple), hidden),
        (0, r, tp),
        replica_id=replica_id,
        logical_shape=(vocab, hidden),
    )


def row_parallel_proj(tp: int, r: int, replica_id: ReplicaId = 0) -> Shard:
    return split(KEY_PROJ, (HIDDEN, MHA_HEADS * HEAD_DIM), (1, r, tp), replica_id=replica_id)


def replica(tp_rep: int, dp_rank: int, dp: int) -> ReplicaId:
    """The replica id of a copy: an int for TP-only layouts, a (tp, dp) tuple when DP replicates too."""
    return tp_rep if dp == 1 else (tp_rep, dp_rank)


def stage_chunks(pp: int, pp_rank: int, vpp: int = 1) -> list[tuple[int, range]]:
    """The (chunk index, global layers) of the model chunks that PP stage ``pp_rank`` holds: with virtual
    pipelining, chunks ``v * pp + pp_rank`` for ``v < vpp`` (not contiguous)."""
    size = LAYERS // (pp * vpp)
    chunks = [v * pp + pp_rank for v in range(vpp)]
    return [(c, range(c * size, (c + 1) * size)) for c in chunks]


def expert_shards(
    ep: int,
    ep_rank: int,
    etp: int,
    etp_rank: int,
    replica_id: ReplicaId,
    layers: Iterable[int],
    *,
    per_expert: bool = False,
) -> list[Shard]:
    """Stacked experts of every MoE layer in ``layers``: fc1 (E, ffn, h) and fc2 (E, h, ffn); EP splits
    the expert axis, ETP the ffn axis. ``per_expert``: one shard per local expert (global expert number
    on the expert axis), as a sequential MLP holds them."""
    local = EXPERTS // ep
    cuts = [(e, EXPERTS) for e in range(ep_rank * local, (ep_rank + 1) * local)] if per_expert else [(ep_rank, ep)]
    out = []
    for g in layers:
        if g not in MOE_LAYERS:
            continue
        base = f"decoder.layers.{g}.mlp.experts"
        for index, parts in cuts:
            out.append(
                split(
                    f"{base}.linear_fc1.weight",
                    (EXPERTS, EXPERT_FFN, EXPERT_HIDDEN),
                    (0, index, parts),
                    (1, etp_rank, etp),
                    replica_id=replica_id,
                )
            )
            out.append(
                split(
                    f"{base}.linear_fc2.weight",
                    (EXPERTS, EXPERT_HIDDEN, EXPERT_FFN),
                    (0, index, parts),
                    (2, etp_rank, etp),
                    replica_id=replica_id,
                )
            )
    return out


def trap_expert(ep: int, ep_rank: int, etp: int, etp_rank: int, replica_id: ReplicaId) -> Shard:
    """The seed report's expert tensor: expert ``e``, ETP slice ``t`` holds ``10 * e + t``."""
    return split(KEY_TRAP, TRAP_SHAPE, (0, ep_rank, ep), (1, etp_rank, etp), replica_id=replica_id)


def optimizer_params(tp: int, r: int, prefix: str) -> list[Shard]:
    """The local TP shards of the optimizer's parameters, in buffer order, keyed ``prefix + name``.

    Odd sizes and this order on purpose: over the ZeRO layouts of the tests, DP boundaries fall mid-row,
    some ranges hold less than one row, some parameters are absent from some ranks, and the embedding
    (vocabulary 13 padded to a multiple of ``tp * 8``) leaves some TP ranks with nothing but padding.
    """
    return [
        split(prefix + "a", (8, 5), (0, r, tp)),
        split(prefix + "e", (1, 3), replica_id=r),
        split(prefix + "c", (7,), replica_id=r),
        glu_fc1(tp, r, key=prefix + "d", ffn=8, hidden=3),
        split(prefix + "b", (3, 8), (1, r, tp)),
        gqa_qkv(tp, r, key=prefix + "qkv"),
        vocab_embedding(tp, r, key=prefix + "emb", vocab=OPT_VOCAB, multiple=8, hidden=2),
    ]


def zero_range(total: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """Rank ``dp_rank``'s part of a flat buffer of ``total`` elements split evenly over ``dp`` ranks."""
    base, extra = divmod(total, dp)
    start = dp_rank * base + min(dp_rank, extra)
    return start, start + base + (1 if dp_rank < extra else 0)


@dataclass(frozen=True)
class ZeroBuffer:
    """One ZeRO-1 optimizer state buffer: elements [start, end) of the concatenated local shards."""

    shards: tuple[Shard, ...]
    start: int
    end: int


def rank_layout(par: Par, rank: int, parts: Iterable[str]) -> tuple[list[Shard], list[ZeroBuffer]]:
    """The shards (and ZeRO buffers) that rank ``rank`` of layout ``par`` holds for ``parts``."""
    c = par.coords(rank)
    parts = set(parts)
    unknown = parts - set(PARTS)
    assert not unknown, unknown
    first, last = c.pp == 0, c.pp == par.pp - 1
    tp, r = par.tp, c.tp
    sharded_rid = replica(0, c.dp, par.dp)
    shards: list[Shard] = []
    buffers: list[ZeroBuffer] = []
    if first and "mha" in parts:
        shards.append(mha_qkv(tp, r, sharded_rid))
    if first and "gqa" in parts:
        shards.append(gqa_qkv(tp, r, sharded_rid))
    if first and "glu" in parts:
        shards.append(glu_fc1(tp, r, sharded_rid))
    if first and "embed" in parts:
        shards.append(vocab_embedding(tp, r, sharded_rid))
    if first and "proj" in parts:
        shards.append(row_parallel_proj(tp, r, sharded_rid))
    if last and "norm" in parts:
        shards.append(split(KEY_NORM, (HIDDEN,), replica_id=replica(r, c.dp, par.dp)))
    chunks = stage_chunks(par.pp, c.pp, par.vpp)
    layers = [g for _, chunk in chunks for g in chunk]
    if "stacked" in parts:
        cuts = [(g, LAYERS) for g in layers] if par.layer_leaves else [(i, par.pp * par.vpp) for i, _ in chunks]
        for index, count in cuts:
            shards.append(
                split(
                    KEY_STACKED,
                    (LAYERS, LAYER_ROWS, LAYER_COLS),
                    (0, index, count),
                    (1, r, tp),
                    replica_id=sharded_rid,
                )
            )
    if "per_layer" in parts:
        for g in layers:
            shards.append(
                split(
                    f"decoder.layers.{g}.mlp.linear_fc2.weight",
                    (LAYER_COLS, LAYER_ROWS),
                    (1, r, tp),
                    replica_id=sharded_rid,
                )
            )
            shards.append(
                split(f"decoder.layers.{g}.input_layernorm.weight", (LAYER_COLS,), replica_id=replica(r, c.dp, par.dp))
            )
    if "experts" in parts:
        shards += expert_shards(par.ep, c.ep, par.etp, c.etp, c.edp, layers, per_expert=par.expert_leaves)
    if "trap" in parts:
        shards.append(trap_expert(par.ep, c.ep, par.etp, c.etp, c.edp))
    if first and "optim" in parts:
        for p in optimizer_params(tp, r, "model."):  # model weights: TP shards replicated over DP
            shards.append(_with_replica(p, replica(_tp_rep(p), c.dp, par.dp)))
        for state in ("exp_avg", "exp_avg_sq"):
            params = optimizer_params(tp, r, f"optimizer.{state}.")
            if par.zero:
                total = sum(math.prod(p.local_shape) for p in params)
                buffers.append(ZeroBuffer(tuple(params), *zero_range(total, par.dp, c.dp)))
            else:
                shards += [_with_replica(p, replica(_tp_rep(p), c.dp, par.dp)) for p in params]
    return shards, buffers


def _tp_rep(shard: Shard) -> int:
    """The TP replica number carried by a TP-replicated shard (its replica_id), 0 for a TP-split one."""
    rid = shard.replica_id
    return rid if isinstance(rid, int) else rid[0]


def _with_replica(shard: Shard, replica_id: ReplicaId) -> Shard:
    return Shard(
        shard.key,
        shard.global_shape,
        shard.offset,
        shard.local_shape,
        replica_id,
        shard.segment_axis,
        shard.segments,
        shard.logical_shape,
        shard.rank_offsets,
    )


# --- materialising a layout ------------------------------------------------------------------------------


def local_tensor(shard: Shard, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """The local tensor of ``shard``: ``save`` (global slice, garbage in padding), ``expected`` (global
    slice, zero padding) or ``template`` (zeros; NaN when the tensor is padded)."""
    if mode == "template":
        fill = math.nan if shard.logical_shape is not None else 0.0
        return torch.full(shard.local_shape, fill, dtype=dtype)
    pad = PAD_GARBAGE if mode == "save" else 0.0
    assert mode in ("save", "expected"), mode
    return shard.local_of(padded_global(shard.key, shard.global_shape, shard.logical_shape, dtype, pad))


def build_state(
    par: Par, rank: int, parts: Iterable[str], mode: str, dtype: torch.dtype = torch.float32
) -> dict[str, ShardedTensor]:
    """Rank ``rank``'s state dict for layout ``par``: every leaf a ShardedTensor (see module docstring)."""
    shards, buffers = rank_layout(par, rank, parts)
    state: dict[str, ShardedTensor] = {}
    for s in shards:  # several leaves of one key (layer chunks, experts) get distinct paths
        path = s.key if s.key not in state else f"{s.key}@{','.join(map(str, s.offset))}"
        state[path] = s.describe(local_tensor(s, mode, dtype))
    for buf in buffers:
        flat = torch.cat([local_tensor(s, mode, dtype).reshape(-1) for s in buf.shards])
        data = flat[buf.start : buf.end].clone()
        start = 0
        for s in buf.shards:
            size = math.prod(s.local_shape)
            lo = min(max(buf.start - start, 0), size)
            hi = min(max(buf.end - start, 0), size)
            view = data[start + lo - buf.start : start + hi - buf.start] if hi > lo else data[:0]
            state[s.key] = s.describe_flat(view, lo, hi, s.replica_id)
            start += size
    return state


def saved_shapes(par: Par, parts: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """Every key that layout ``par`` saves for ``parts``, with its saved (logical) global shape."""
    out: dict[str, tuple[int, ...]] = {}
    for rank in range(par.world):
        shards, buffers = rank_layout(par, rank, parts)
        for s in [*shards, *(s for b in buffers for s in b.shards)]:
            out[s.key] = s.saved_shape
    return out


# --- Megatron's own formulas, to check the descriptions above against -----------------------------------


def megatron_qkv_mha_local(full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    q, k, v = full.chunk(3)
    return torch.cat([t.chunk(tp)[r] for t in (q, k, v)])


def megatron_qkv_gqa_local(full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    q_rows = GQA_HEADS * HEAD_DIM
    kv_rows = GQA_GROUPS * HEAD_DIM
    q, k, v = torch.split(full, [q_rows, kv_rows, kv_rows])
    hidden = full.shape[1]
    fused = torch.cat(
        [q.view(GQA_GROUPS, -1, hidden), k.view(GQA_GROUPS, -1, hidden), v.view(GQA_GROUPS, -1, hidden)], dim=1
    )
    return fused.chunk(tp)[r].reshape(-1, hidden)


def megatron_glu_local(full: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    gate, up = full.chunk(2)
    return torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]])
