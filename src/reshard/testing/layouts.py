"""Megatron-style layouts of a mixture-of-experts transformer, as descriptions without tensor data.

Planning is pure, so how reshard behaves on ten thousand ranks can be measured in one process: this
module produces, for any rank of any parallel layout, exactly what that rank's state dict would describe
(keys, dtypes, global shapes, boxes, segments, flat ranges, replica ids), without allocating a byte of
tensor data. It is used by ``benchmarks/scale.py`` and by the tests that compare the planners with their
reference implementations.

The model is a GPT with grouped-query attention and a mixture of experts in every layer, described the
way Megatron-Core's distributed checkpointing describes it:

- ``embedding.word_embeddings.weight`` (first stage) and ``output_layer.weight`` (last stage): split along
  the vocabulary by TP, padded to a multiple of ``tp * vocab_multiple`` (``logical_shape`` is the real
  vocabulary);
- per layer ``L`` (global layer numbers; a PP stage holds ``layers / pp`` consecutive layers):
  ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight`` (replicated), the fused QKV weight (global
  rows ``[Q; K; V]``, each TP rank holding its query groups interleaved ``[q_g, k_g, v_g, ...]``: a
  segmented shard), ``linear_proj.weight`` (split along its input axis), the router (replicated) and the
  stacked experts ``mlp.experts.linear_fc1.weight`` (``(experts, 2 * expert_ffn, hidden)``, fused gate/up)
  and ``linear_fc2.weight`` (``(experts, hidden, expert_ffn)``): EP splits the expert axis, ETP the ffn axis
  (fc1 then holds ``[gate_etp; up_etp]``, a segmented shard); optionally shared experts, split by TP;
- ``decoder.final_layernorm.weight`` (last stage);
- the Adam state of every parameter (``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<key>``, float32):
  with ``zero`` (Megatron's distributed optimizer, ZeRO-1) each rank holds a flat range of every bucket of
  its stage's parameter buffer (dense parameters over the data-parallel-with-context-parallel group,
  expert parameters over the expert-data-parallel group), described with ``from_flat_range``; without it,
  the same boxes as the parameters, replicated over DP;
- the RNG state of each (pp, tp, cp) rank, a ShardedObject replicated over DP.

Ranks are ordered like Megatron's default ``tp-cp-ep-dp-pp``: TP fastest, then CP, then DP, then PP; the
expert ranks of a stage (``ep * etp * edp == tp * cp * dp``) have ETP fastest, then EP, then expert-DP.

Two ways to get a rank's description: :meth:`MegatronLayout.rank_description` builds it directly (fast:
thousands of ranks per second), and :meth:`MegatronLayout.rank_state_dict` builds the real state dict of
:class:`~reshard.ShardedTensor` leaves on the ``meta`` device, which reshard's own save path describes.
The tests check that the two agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from reshard.geometry.boxes import Box, flat_range_boxes
from reshard.planning.descriptions import LocalSaveDescription, ObjectPiece, TensorPiece
from reshard.planning.load_plan import TargetPiece
from reshard.state.dtypes import DTYPE_BY_NAME
from reshard.state.sharding import ReplicaId, ShardedObject, ShardedTensor

__all__ = ["MegatronLayout", "MoETransformer", "Parallelism", "RankCoords", "ShardSpec"]

OPTIMIZER_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")
"""The optimizer state kept per parameter (Adam with fp32 main parameters), in buffer order."""

RNG_KEY = "rng_state"


@dataclass(frozen=True, slots=True, kw_only=True)
class MoETransformer:
    """The shapes of the model. The defaults are a model of about 1.25 trillion parameters: 128 layers of
    grouped-query attention (48 heads of 128, 8 query groups, hidden 6144) and 256 experts of ffn 2048."""

    layers: int = 128
    hidden: int = 6144
    heads: int = 48
    query_groups: int = 8
    head_dim: int = 128
    experts: int = 256
    expert_ffn: int = 2048
    shared_expert_ffn: int = 0
    """ffn of the shared experts of each layer (0: none)."""
    vocab: int = 129_280
    vocab_multiple: int = 128
    """The vocabulary is padded to a multiple of ``tp * vocab_multiple``, as Megatron does."""
    dtype: str = "bfloat16"
    """dtype of the parameters; the optimizer state is float32."""

    @property
    def parameters(self) -> int:
        """Number of model parameters (logical vocabulary)."""
        attention = (self.heads + 2 * self.query_groups) * self.head_dim * self.hidden
        attention += self.hidden * self.heads * self.head_dim + 2 * self.hidden
        moe = self.experts * self.hidden + self.experts * 3 * self.expert_ffn * self.hidden
        moe += 3 * self.shared_expert_ffn * self.hidden
        return self.layers * (attention + moe) + 2 * self.vocab * self.hidden + self.hidden


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where a rank sits in each parallel dimension."""

    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    ep: int
    edp: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """Parallel sizes. ``world = tp * cp * dp * pp``; the experts of a stage use ``ep * etp`` of its
    ``tp * cp * dp`` ranks, the rest being expert-data-parallel replicas (``edp``).

    Attributes:
        zero: the optimizer state is sharded over data-parallel ranks (Megatron's distributed optimizer).
        bucket_elements: with ``zero``, parameters are grouped into buckets of at least this many
            elements (closed at a parameter boundary), each split evenly over the data-parallel ranks, as
            Megatron's gradient buffers are; None: one bucket per buffer.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    zero: bool = True
    bucket_elements: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def coords(self, rank: int) -> RankCoords:
        """The coordinates of ``rank`` (``0 <= rank < world``)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a world of {self.world}")
        stage = self.tp * self.cp * self.dp
        in_stage = rank % stage
        return RankCoords(
            tp=rank % self.tp,
            cp=(rank // self.tp) % self.cp,
            dp=(rank // (self.tp * self.cp)) % self.dp,
            pp=rank // stage,
            etp=in_stage % self.etp,
            ep=(in_stage // self.etp) % self.ep,
            edp=in_stage // (self.etp * self.ep),
        )

    def __str__(self) -> str:
        text = f"TP{self.tp}xPP{self.pp}xDP{self.dp}"
        text += f"xCP{self.cp}" if self.cp > 1 else ""
        text += f",EP{self.ep}" if self.ep > 1 else ""
        text += f",ETP{self.etp}" if self.etp > 1 else ""
        return text + (",ZeRO-1" if self.zero else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardSpec:
    """One ShardedTensor leaf of a rank's state dict, without its data: the arguments reshard's
    constructors take (see :class:`~reshard.ShardedTensor`)."""

    key: str
    dtype: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    replica_id: ReplicaId = 0
    logical_shape: tuple[int, ...] | None = None
    segment_axis: int | None = None
    segments: tuple[tuple[int, int], ...] | None = None
    flat_range: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        """Elements of the local shard (before any flat range)."""
        return math.prod(self.local_shape)

    @property
    def saved_shape(self) -> tuple[int, ...]:
        return self.logical_shape if self.logical_shape is not None else self.global_shape

    def sharded_tensor(self, device: str | torch.device = "meta") -> ShardedTensor:
        """The real ShardedTensor this spec stands for, its data an uninitialised tensor on ``device``
        (``meta``: no memory at all)."""
        dtype = DTYPE_BY_NAME[self.dtype]
        if self.flat_range is not None:
            start, end = self.flat_range
            return ShardedTensor.from_flat_range(
                self.key,
                torch.empty(end - start, dtype=dtype, device=device),
                self.local_shape,
                self.global_shape,
                self.global_offset,
                start,
                end,
                self.replica_id,
                segment_axis=self.segment_axis,
                segments=self.segments,
                logical_shape=self.logical_shape,
            )
        data = torch.empty(self.local_shape, dtype=dtype, device=device)
        if self.segments is not None and self.segment_axis is not None:
            return ShardedTensor.segmented(
                self.key,
                data,
                self.global_shape,
                self.segment_axis,
                self.segments,
                self.replica_id,
                global_offset=self.global_offset,
                logical_shape=self.logical_shape,
            )
        return ShardedTensor(
            self.key, data, self.global_shape, self.global_offset, self.replica_id, logical_shape=self.logical_shape
        )

    def with_state(
        self, prefix: str, dtype: str, flat_range: tuple[int, int] | None, replica_id: ReplicaId
    ) -> ShardSpec:
        """The spec of an optimizer state of this parameter: key ``prefix + key``, and a flat range."""
        return ShardSpec(
            key=prefix + self.key,
            dtype=dtype,
            global_shape=self.global_shape,
            global_offset=self.global_offset,
            local_shape=self.local_shape,
            replica_id=replica_id,
            logical_shape=self.logical_shape,
            segment_axis=self.segment_axis,
            segments=self.segments,
            flat_range=flat_range,
        )


def shard_boxes(spec: ShardSpec) -> list[Box]:
    """The boxes of the global (logical) tensor that ``spec``'s data holds, in the order and form of
    :meth:`ShardedTensor.pieces <reshard.ShardedTensor.pieces>` (empty boxes dropped, padding clipped)."""
    shape = spec.local_shape
    mappings: list[tuple[Box, tuple[int, ...]]]
    if spec.segments is None or spec.segment_axis is None:
        mappings = [(Box.full(shape), spec.global_offset)]
    else:
        axis = spec.segment_axis
        mappings = []
        local_start = 0
        for global_start, length in spec.segments:
            if length:
                local = Box(
                    tuple(local_start if a == axis else 0 for a in range(len(shape))),
                    tuple(length if a == axis else n for a, n in enumerate(shape)),
                )
                offset = tuple(global_start if a == axis else o for a, o in enumerate(spec.global_offset))
                mappings.append((local, offset))
            local_start += length
    raw: list[Box] = []
    if spec.flat_range is None:
        raw = [Box(offset, local.shape) for local, offset in mappings]
    else:
        for flat_box, _ in flat_range_boxes(shape, *spec.flat_range):
            for local, offset in mappings:
                part = flat_box.intersect(local)
                if part is not None:
                    moved = tuple(o + p - lo for o, p, lo in zip(offset, part.offset, local.offset, strict=True))
                    raw.append(Box(moved, part.shape))
    if spec.logical_shape is None:
        return [box for box in raw if box.volume or not box.ndim]
    logical = Box.full(spec.logical_shape)
    out = []
    for box in raw:
        if box.volume == 0 and box.ndim:
            continue
        if box.ndim == 0:
            out.append(box)
            continue
        clipped = box.intersect(logical)
        if clipped is not None:
            out.append(clipped)
        else:  # all padding: ShardedTensor.pieces keeps an empty box for it
            out.append(Box(tuple(min(o, n) for o, n in zip(box.offset, logical.shape, strict=True)), (0,) * box.ndim))
    return out


def _even_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``total`` elements split over ``parts`` as evenly as possible."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _replica_ids(c: RankCoords, p: Parallelism) -> tuple[ReplicaId, ReplicaId]:
    """The replica ids of a rank's tensor-parallel-split parameters and of those every tp rank holds whole: the
    data-parallel-with-context-parallel rank tells the replicas apart."""
    dp_rank = c.dp * p.cp + c.cp
    return (0, dp_rank), (c.tp, dp_rank)


def _cut(
    dtype: str,
    key: str,
    global_shape: tuple[int, ...],
    replica_id: ReplicaId,
    *cuts: tuple[int, int, int],
    logical: tuple[int, ...] | None = None,
) -> ShardSpec:
    """Part ``index`` of ``parts`` equal parts along ``axis``, for each ``(axis, index, parts)`` of ``cuts``."""
    offset = [0] * len(global_shape)
    local = list(global_shape)
    for axis, index, parts in cuts:
        local[axis] = global_shape[axis] // parts
        offset[axis] = local[axis] * index
    return ShardSpec(
        key=key,
        dtype=dtype,
        global_shape=global_shape,
        global_offset=tuple(offset),
        local_shape=tuple(local),
        replica_id=replica_id,
        logical_shape=logical,
    )


def _segmented(
    dtype: str,
    key: str,
    global_shape: tuple[int, ...],
    axis: int,
    segments: list[tuple[int, int]],
    replica_id: ReplicaId,
    offset: tuple[int, ...] | None = None,
    local_other: dict[int, int] | None = None,
) -> ShardSpec:
    """The ``(start, length)`` segments of ``axis`` (a fused tensor's parts of one rank), one shard."""
    local = [sum(n for _, n in segments) if a == axis else s for a, s in enumerate(global_shape)]
    for a, n in (local_other or {}).items():
        local[a] = n
    return ShardSpec(
        key=key,
        dtype=dtype,
        global_shape=global_shape,
        global_offset=offset if offset is not None else (0,) * len(global_shape),
        local_shape=tuple(local),
        replica_id=replica_id,
        segment_axis=axis,
        segments=tuple(segments),
    )


@dataclass
class MegatronLayout:
    """The per-rank descriptions of ``model`` on ``parallelism`` (see the module docstring).

    An instance caches the geometry it has computed (ranks of one layout share most of it), so describing
    every rank of a large layout takes seconds; the cache lives and dies with the instance.
    """

    model: MoETransformer
    parallelism: Parallelism
    optimizer: bool = True
    """Include the optimizer state (three float32 states per parameter)."""
    rng: bool = True
    """Include the RNG state ShardedObject."""
    _boxes: dict[tuple[object, ...], tuple[Box, ...]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        m, p = self.model, self.parallelism
        problems = []
        if min(p.tp, p.pp, p.dp, p.cp, p.ep, p.etp) < 1:
            problems.append("every parallel size must be at least 1")
        if m.layers % p.pp:
            problems.append(f"pp {p.pp} must divide {m.layers} layers")
        if m.query_groups % p.tp or m.heads % m.query_groups:
            problems.append(f"tp {p.tp} must divide {m.query_groups} query groups, which must divide {m.heads} heads")
        if m.experts % p.ep or m.expert_ffn % p.etp or m.shared_expert_ffn % p.tp:
            problems.append(f"ep {p.ep} must divide {m.experts} experts and etp {p.etp} the expert ffn")
        if (p.tp * p.cp * p.dp) % (p.ep * p.etp):
            problems.append(f"ep * etp ({p.ep * p.etp}) must divide tp * cp * dp ({p.tp * p.cp * p.dp})")
        if problems:
            raise ValueError(f"{p} does not fit the model: {'; '.join(problems)}")

    # --- the parameters of one rank ------------------------------------------------------------------

    def padded_vocab(self) -> int:
        multiple = self.parallelism.tp * self.model.vocab_multiple
        return -(-self.model.vocab // multiple) * multiple

    def _params_of(self, c: RankCoords) -> tuple[list[ShardSpec], list[ShardSpec]]:
        """The (dense, expert) parameters of a rank, in state-dict order."""
        m, p = self.model, self.parallelism
        split, everywhere = _replica_ids(c, p)
        dense: list[ShardSpec] = []
        experts: list[ShardSpec] = []
        h = m.hidden
        vocab_shape = (self.padded_vocab(), h)
        logical = (m.vocab, h) if vocab_shape[0] != m.vocab else None
        if c.pp == 0:
            dense.append(
                _cut(m.dtype, "embedding.word_embeddings.weight", vocab_shape, split, (0, c.tp, p.tp), logical=logical)
            )
        per_stage = m.layers // p.pp
        for layer in range(c.pp * per_stage, (c.pp + 1) * per_stage):
            dense += self._layer_dense(c, f"decoder.layers.{layer}")
            experts += self._layer_experts(c, f"decoder.layers.{layer}")
        if c.pp == p.pp - 1:
            dense.append(_cut(m.dtype, "decoder.final_layernorm.weight", (h,), everywhere))
            dense.append(_cut(m.dtype, "output_layer.weight", vocab_shape, split, (0, c.tp, p.tp), logical=logical))
        return dense, experts

    def _layer_dense(self, c: RankCoords, base: str) -> list[ShardSpec]:
        """The dense parameters of layer ``base`` on a rank: norms, fused QKV (its query groups), projection,
        router, and the shared experts' GLU."""
        m, p = self.model, self.parallelism
        dtype, h, d = m.dtype, m.hidden, m.head_dim
        split, everywhere = _replica_ids(c, p)
        q_per_group = m.heads // m.query_groups * d
        q_rows, kv_rows = m.heads * d, m.query_groups * d
        groups = m.query_groups // p.tp
        qkv_segments = []
        for g in range(c.tp * groups, (c.tp + 1) * groups):
            qkv_segments += [(g * q_per_group, q_per_group), (q_rows + g * d, d), (q_rows + kv_rows + g * d, d)]
        out = [
            _cut(dtype, f"{base}.input_layernorm.weight", (h,), everywhere),
            _segmented(
                dtype, f"{base}.self_attention.linear_qkv.weight", (q_rows + 2 * kv_rows, h), 0, qkv_segments, split
            ),
            _cut(dtype, f"{base}.self_attention.linear_proj.weight", (h, q_rows), split, (1, c.tp, p.tp)),
            _cut(dtype, f"{base}.pre_mlp_layernorm.weight", (h,), everywhere),
            _cut(dtype, f"{base}.mlp.router.weight", (m.experts, h), everywhere),
        ]
        if m.shared_expert_ffn:
            fs = m.shared_expert_ffn
            n = fs // p.tp
            fc1 = f"{base}.mlp.shared_experts.linear_fc1.weight"
            out.append(_segmented(dtype, fc1, (2 * fs, h), 0, [(c.tp * n, n), (fs + c.tp * n, n)], split))
            out.append(_cut(dtype, f"{base}.mlp.shared_experts.linear_fc2.weight", (h, fs), split, (1, c.tp, p.tp)))
        return out

    def _layer_experts(self, c: RankCoords, base: str) -> list[ShardSpec]:
        """The routed experts' parameters of layer ``base`` on a rank (its ``ep`` experts, its ``etp`` cut)."""
        m, p = self.model, self.parallelism
        expert_rid: ReplicaId = (0, c.edp)
        f, h = m.expert_ffn, m.hidden
        fc1_shape = (m.experts, 2 * f, h)
        fc1 = f"{base}.mlp.experts.linear_fc1.weight"
        if p.etp == 1:
            first = _cut(m.dtype, fc1, fc1_shape, expert_rid, (0, c.ep, p.ep))
        else:
            n = f // p.etp
            local_experts = m.experts // p.ep
            first = _segmented(
                m.dtype,
                fc1,
                fc1_shape,
                1,
                [(c.etp * n, n), (f + c.etp * n, n)],
                expert_rid,
                offset=(c.ep * local_experts, 0, 0),
                local_other={0: local_experts},
            )
        second = _cut(
            m.dtype,
            f"{base}.mlp.experts.linear_fc2.weight",
            (m.experts, h, f),
            expert_rid,
            (0, c.ep, p.ep),
            (2, c.etp, p.etp),
        )
        return [first, second]

    def rank_shards(self, rank: int) -> list[ShardSpec]:
        """Every ShardedTensor leaf of ``rank``'s state dict, in order: parameters, then optimizer states."""
        p = self.parallelism
        c = p.coords(rank)
        dense, experts = self._params_of(c)
        out = [*dense, *experts]
        if not self.optimizer:
            return out
        if not p.zero:
            for state in OPTIMIZER_STATES:
                out += [s.with_state(f"optimizer.state.{state}.", "float32", None, s.replica_id) for s in dense]
                out += [s.with_state(f"optimizer.state.{state}.", "float32", None, s.replica_id) for s in experts]
            return out
        dp_rank = c.dp * p.cp + c.cp
        for params, group, index in ((dense, p.dp * p.cp, dp_rank), (experts, p.edp, c.edp)):
            ranges = self._zero_ranges(params, group, index)
            for state in OPTIMIZER_STATES:
                for param, flat in ranges:
                    rid = param.replica_id
                    replica = (rid[0] if isinstance(rid, tuple) else rid, 0)  # DP ranks hold distinct ranges
                    out.append(param.with_state(f"optimizer.state.{state}.", "float32", flat, replica))
        return out

    def _zero_ranges(self, params: list[ShardSpec], group: int, index: int) -> list[tuple[ShardSpec, tuple[int, int]]]:
        """The flat range of each parameter's local shard that data-parallel rank ``index`` of ``group``
        holds: the buffer (the parameters' local shards back to back) is cut into buckets, each split
        evenly over the group. Parameters the rank holds nothing of are left out, as Megatron does."""
        bucket_limit = self.parallelism.bucket_elements
        buckets: list[list[tuple[ShardSpec, int]]] = [[]]
        size = 0
        for param in params:
            if bucket_limit is not None and size >= bucket_limit:
                buckets.append([])
                size = 0
            buckets[-1].append((param, size))
            size += param.numel
        out = []
        for bucket in buckets:
            if not bucket:
                continue
            total = bucket[-1][1] + bucket[-1][0].numel
            lo, hi = _even_range(total, group, index)
            for param, start in bucket:
                a, b = max(lo - start, 0), min(hi - start, param.numel)
                if a < b:
                    out.append((param, (a, b)))
        return out

    def rank_objects(self, rank: int) -> list[ObjectPiece]:
        """The ShardedObject cells of ``rank`` (its RNG state, replicated over DP)."""
        if not self.rng:
            return []
        p = self.parallelism
        c = p.coords(rank)
        return [ObjectPiece(key=RNG_KEY, global_shape=(p.pp, p.tp, p.cp), offset=(c.pp, c.tp, c.cp), replica_id=c.dp)]

    # --- what reshard sees ----------------------------------------------------------------------------

    def boxes(self, spec: ShardSpec) -> tuple[Box, ...]:
        """:func:`shard_boxes` of ``spec``, cached by geometry (layers, replicas and states share it)."""
        geometry = (
            spec.global_shape,
            spec.global_offset,
            spec.local_shape,
            spec.logical_shape,
            spec.segment_axis,
            spec.segments,
            spec.flat_range,
        )
        found = self._boxes.get(geometry)
        if found is None:
            found = tuple(shard_boxes(spec))
            self._boxes[geometry] = found
        return found

    def rank_description(self, rank: int) -> LocalSaveDescription:
        """What ``reshard.save`` describes on ``rank`` (the same as describing :meth:`rank_state_dict`)."""
        tensors = []
        for spec in self.rank_shards(rank):
            saved = spec.saved_shape
            boxes = self.boxes(spec) or (Box((0,) * len(saved), (0,) * len(saved)),)
            tensors += [
                TensorPiece(key=spec.key, dtype=spec.dtype, global_shape=saved, box=box, replica_id=spec.replica_id)
                for box in boxes
            ]
        return LocalSaveDescription(tensors=tuple(tensors), objects=tuple(self.rank_objects(rank)))

    def rank_targets(self, rank: int) -> list[TargetPiece]:
        """The target pieces ``reshard.load`` plans for on ``rank`` when :meth:`rank_state_dict` is the
        template (the same layout's boxes, kept as they are)."""
        return [TargetPiece(key=spec.key, box=box) for spec in self.rank_shards(rank) for box in self.boxes(spec)]

    def rank_state_dict(self, rank: int, device: str | torch.device = "meta") -> dict[str, object]:
        """``rank``'s real state dict: ShardedTensors over uninitialised tensors on ``device`` (``meta``: no
        memory), the RNG ShardedObject and an iteration counter. For small layouts: building the tensors is
        far slower than :meth:`rank_description`."""
        state: dict[str, object] = {}
        for i, spec in enumerate(self.rank_shards(rank)):
            state[f"{i:06d}:{spec.key}"] = spec.sharded_tensor(device)
        for obj in self.rank_objects(rank):
            state["rng"] = ShardedObject(obj.key, {"seed": rank}, obj.global_shape, obj.offset, obj.replica_id)
        state["iteration"] = 1000
        return state
