"""A topology matrix: save on one Megatron-style layout, load on another, over 8 spawned gloo ranks.

Layouts come from :mod:`tests.megatron_layouts` (pure functions of parallel sizes and rank). Every load
is checked bitwise against the slice of the global tensor the rank should hold, and its read accounting
against the bytes the template covers. Smaller worlds use the group of the first N ranks of the pool.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import ShardedTensor, ShardingError
from tests.megatron_layouts import (
    AXIS0,
    DENSE,
    GQA_GROUPS,
    HEAD_DIM,
    HIDDEN,
    KEY_EMBED,
    KEY_GQA,
    KEY_NORM,
    KEY_TRAP,
    VOCAB,
    Par,
    Shard,
    build_state,
    global_value,
    glu_fc1,
    gqa_qkv,
    local_tensor,
    megatron_glu_local,
    megatron_qkv_gqa_local,
    megatron_qkv_mha_local,
    mha_qkv,
    padded_global,
    rank_layout,
    saved_shapes,
    split,
    trap_expert,
    vocab_embedding,
)
from tests.rankpool import RankContext, RankFailure, RankPool

TIMEOUT = 60.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_AMPLIFICATION = 1.10


# --- what runs on each rank --------------------------------------------------------------------------------


def rank_save(ctx: RankContext, path: str, par: Par, parts: tuple[str, ...], dtype: str = "float32") -> int | None:
    group, member = ctx.group_of_size(par.world)
    if not member:
        return None
    reshard.save(build_state(par, ctx.rank, parts, "save", DTYPES[dtype]), path, group=group, timeout=TIMEOUT)
    return ctx.rank


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check_loaded(
    result: dict[str, torch.Tensor], template: dict[str, ShardedTensor], expected: dict[str, ShardedTensor]
) -> None:
    """Every loaded local tensor is the template's own tensor and bitwise equal to the expected slice."""
    assert result.keys() == template.keys() == expected.keys()
    for key, target in template.items():
        got = result[key]
        assert got is target.data, key
        want = expected[key].data.to(got.dtype)
        assert got.shape == want.shape, (key, got.shape, want.shape)
        assert torch.equal(as_bytes(got), as_bytes(want)), (key, got, want)


def rank_load(
    ctx: RankContext,
    path: str,
    par: Par,
    parts: tuple[str, ...],
    saved: str = "float32",
    target: str | None = None,
    allow_dtype_cast: bool = True,
) -> dict[str, object] | None:
    group, member = ctx.group_of_size(par.world)
    if not member:
        return None
    saved_dtype = DTYPES[saved]
    template = build_state(par, ctx.rank, parts, "template", DTYPES[target or saved])
    stats = reshard.LoadStats()
    result = reshard.load(
        template,
        path,
        group=group,
        timeout=TIMEOUT,
        stats=stats,
        options=reshard.LoadOptions(allow_dtype_cast=allow_dtype_cast),
    )
    check_loaded(result, template, build_state(par, ctx.rank, parts, "expected", saved_dtype))
    covered = sum(p.box.volume for st in template.values() for p in st.pieces())
    out: dict[str, object] = {
        "needed": stats.bytes_needed,
        "read": stats.bytes_read,
        "covered": covered * saved_dtype.itemsize,
    }
    if KEY_TRAP in result:
        out["trap_values"] = sorted({float(v) for v in result[KEY_TRAP].reshape(-1).tolist()})
    return out


# --- what the test process does ----------------------------------------------------------------------------


def save_ok(pool: RankPool, path: str, par: Par, parts: tuple[str, ...], dtype: str = "float32") -> None:
    """Save on layout ``par``; check that every key is recorded with its logical shape and every unique
    element stored exactly once (no replica written twice, no padding written)."""
    results = pool.run_ok(rank_save, path, par, parts, dtype)
    assert results == [*range(par.world), *[None] * (pool.world_size - par.world)]
    metadata = reshard.read_metadata(path)
    shapes = saved_shapes(par, parts)
    assert metadata.world_size == par.world
    assert {k: t.global_shape for k, t in metadata.tensors.items()} == shapes
    assert metadata.total_bytes == sum(math.prod(s) for s in shapes.values()) * DTYPES[dtype].itemsize


def load_ok(
    pool: RankPool,
    path: str,
    par: Par,
    parts: tuple[str, ...],
    *,
    exact: bool = False,
    saved: str = "float32",
    target: str | None = None,
) -> list[dict[str, Any]]:
    """Load on layout ``par`` (every rank checks its tensors bitwise); check the read accounting."""
    results = pool.run_ok(rank_load, path, par, parts, saved, target)
    assert results[par.world :] == [None] * (pool.world_size - par.world)
    stats = results[: par.world]
    for rank, s in enumerate(stats):
        assert s["needed"] == s["covered"], (str(par), rank, s)
        assert s["read"] <= MAX_AMPLIFICATION * s["needed"], (str(par), rank, s)
        if exact:
            assert s["read"] == s["needed"], (str(par), rank, s)
    return stats


def failures_of(results: list[object], world: int) -> list[RankFailure]:
    """The failures of the first ``world`` ranks, asserting that every one of them failed alike."""
    failures = [f for f in results[:world] if isinstance(f, RankFailure)]
    assert len(failures) == world, results
    assert len({(f.error_class, f.message) for f in failures}) == 1, failures
    assert results[world:] == [None] * (len(results) - world)
    return failures


def case_id(case: tuple[Par, list[Par]]) -> str:
    save, loads = case
    return f"{save}->{','.join(map(str, loads))}"


# --- the layouts themselves ------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_layouts_match_megatron_formulas(tp: int) -> None:
    """The segment descriptions cut the same local tensors as Megatron's reshape/chunk formulas."""
    for r in range(tp):
        for shard, formula in (
            (mha_qkv(tp, r), megatron_qkv_mha_local),
            (gqa_qkv(tp, r), megatron_qkv_gqa_local),
            (glu_fc1(tp, r), megatron_glu_local),
        ):
            full = global_value(shard.key, shard.global_shape)
            assert torch.equal(shard.local_of(full), formula(full, tp, r)), (shard.key, tp, r)
        assert len(gqa_qkv(tp, r).segments) == 3 * GQA_GROUPS // tp


LAYOUT_SAMPLES = [
    Par(tp=8),
    Par(tp=2, pp=2, dp=2),
    Par(tp=1, dp=4, ep=2, etp=2),
    Par(dp=4, zero=True),
    Par(tp=2, dp=2, zero=True),
    Par(tp=4, dp=2, ep=2, etp=2, zero=True),
    Par(tp=2, pp=2, dp=2, ep=2, vpp=2, layer_leaves=True, expert_leaves=True, zero=True),
]


@pytest.mark.unit
@pytest.mark.parametrize("par", LAYOUT_SAMPLES, ids=str)
def test_pieces_of_every_layout_are_global_slices(par: Par) -> None:
    """Single process: every piece reshard derives from a layout's description views exactly the
    elements of the global tensor at its box (the layouts and ``pieces()`` agree)."""
    parts = ("mha", "gqa", "glu", "embed", "proj", "norm", "stacked", "per_layer", "experts", "optim", "trap")
    for rank in range(par.world):
        shards, buffers = rank_layout(par, rank, parts)
        by_key = {s.key: s for s in [*shards, *(s for b in buffers for s in b.shards)]}
        for key, st in build_state(par, rank, parts, "expected").items():
            s = by_key[st.key]
            full = padded_global(st.key, s.global_shape, s.logical_shape, torch.float32, 0.0)
            for piece in st.pieces():
                index = tuple(slice(o, o + n) for o, n in zip(piece.box.offset, piece.box.shape, strict=True))
                assert torch.equal(piece.view, full[index]), (str(par), rank, key, piece.box)


@pytest.mark.unit
def test_zero_ranges_cut_rows_and_leave_params_out() -> None:
    """Over the ZeRO layouts tested below, the DP ranges start mid-row, some cover less than one row of a
    2-D parameter, some are empty, and some hold nothing but vocabulary padding."""
    seen: dict[str, int] = dict.fromkeys(("mid_row", "partial_row", "empty", "only_padding"), 0)
    for par in {p for save, loads in ZERO_CASES for p in (save, *loads) if p.zero}:
        for rank in range(par.world):
            for st in build_state(par, rank, ("optim",), "template").values():
                if st.flat_range is None:
                    continue
                start, end = st.flat_range
                row = st.shard_shape[-1]
                seen["empty"] += start == end
                if start < end and len(st.shard_shape) == 2:
                    seen["mid_row"] += start % row != 0
                    seen["partial_row"] += end - start < row
                pieces = st.pieces()
                seen["only_padding"] += bool(pieces) and all(p.box.volume == 0 for p in pieces)
    assert all(seen.values()), seen


# --- tensor parallel ------------------------------------------------------------------------------------

TP_CASES = [
    (Par(tp=1), [Par(tp=2)]),
    (Par(tp=2), [Par(tp=4), Par(tp=8)]),
    (Par(tp=4), [Par(tp=2), Par(tp=1)]),
    (Par(tp=8), [Par(tp=2)]),
]


@pytest.mark.dist
@pytest.mark.parametrize("case", TP_CASES, ids=case_id)
def test_tensor_parallel(pool8: RankPool, tmp_path: Path, case: tuple[Par, list[Par]]) -> None:
    """Fused QKV (MHA and GQA with 8 query groups), GLU, padded vocabulary, row-parallel projection and
    replicated layernorm: TP 1->2, 2->4, 2->8, 4->2, 4->1, 8->2."""
    save, loads = case
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, save, DENSE)
    for par in loads:
        load_ok(pool8, path, par, DENSE)


@pytest.mark.dist
def test_axis0_reshard_reads_exactly_the_needed_bytes(pool8: RankPool, tmp_path: Path) -> None:
    """Tensors split along axis 0 only (segmented QKV/GLU, padded vocabulary): any TP change reads only
    whole row runs, so nothing is read that is not needed."""
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, Par(tp=2), AXIS0)
    for par in (Par(tp=4), Par(tp=1), Par(tp=8)):
        load_ok(pool8, path, par, AXIS0, exact=True)


def rank_embedding_padding(ctx: RankContext, path: str, tp: int) -> list[float] | None:
    """Load the padded embedding into a template of ones and NaN; return its padding rows."""
    group, member = ctx.group_of_size(tp)
    if not member:
        return None
    shard = vocab_embedding(tp, ctx.rank)
    data = torch.ones(shard.local_shape)
    data[::2] = math.nan
    out = reshard.load({"e": shard.describe(data)}, path, group=group, timeout=TIMEOUT)["e"]
    first_pad = VOCAB - shard.offset[0]
    expected = padded_global(KEY_EMBED, shard.global_shape, shard.logical_shape, torch.float32, 0.0)
    assert torch.equal(as_bytes(out), as_bytes(shard.local_of(expected)))
    return [float(v) for v in out[max(first_pad, 0) :].reshape(-1).tolist()]


@pytest.mark.dist
def test_vocab_padding_is_zero_after_load(pool8: RankPool, tmp_path: Path) -> None:
    """The padded rows hold garbage at save and are never stored; a load zeroes them even in a template
    full of ones and NaN, including rank 7 of TP 8, whose rows are all padding."""
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, Par(tp=1), ("embed",))
    assert reshard.read_metadata(path).tensors[KEY_EMBED].global_shape == (VOCAB, HIDDEN)
    for tp in (8, 2):
        pads = pool8.run_ok(rank_embedding_padding, path, tp)
        assert sum(len(p) for p in pads[:tp]) == (64 - VOCAB) * HIDDEN
        assert all(v == 0.0 for p in pads[:tp] for v in p)


# --- pipeline parallel ----------------------------------------------------------------------------------

PP_PARTS = ("stacked", "per_layer", "embed", "norm")
PP_CASES = [
    (Par(pp=2), [Par(pp=1), Par(pp=4)]),
    (Par(pp=1), [Par(pp=2)]),
    (Par(pp=2, vpp=2, layer_leaves=True), [Par(pp=4), Par(layer_leaves=True), Par(pp=2, vpp=4), Par(pp=4, vpp=2)]),
    (Par(pp=4, vpp=2), [Par(pp=2, vpp=2), Par(pp=1, layer_leaves=True), Par(pp=8)]),
]


@pytest.mark.dist
@pytest.mark.parametrize("case", PP_CASES, ids=case_id)
def test_pipeline_parallel(pool8: RankPool, tmp_path: Path, case: tuple[Par, list[Par]]) -> None:
    """A stacked layer axis split by PP and per-layer keys with global layer numbers: PP 2->1, 2->4,
    1->2; with virtual pipeline chunks (a rank holds several non-contiguous chunks of the stacked key)
    and Megatron-Core's one-leaf-per-layer form of the stacked key. Every split is along axis 0 or whole,
    so reads are exact."""
    save, loads = case
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, save, PP_PARTS)
    for par in loads:
        load_ok(pool8, path, par, PP_PARTS, exact=True)


@pytest.mark.dist
def test_tp_pp_dp_combined(pool8: RankPool, tmp_path: Path) -> None:
    """TP2 x PP2 x DP2 on 8 ranks (DP replicas, TP-replicated norms: (tp, dp) replica ids) to TP1 x PP4,
    TP4 x DP2 and a single rank."""
    parts = (*DENSE, "stacked", "per_layer")
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, Par(tp=2, pp=2, dp=2), parts)
    for par in (Par(pp=4), Par(tp=4, dp=2), Par()):
        load_ok(pool8, path, par, parts)


EVERYTHING = (*DENSE, "stacked", "per_layer", "experts", "optim")


@pytest.mark.dist
def test_whole_model_every_dimension_at_once(pool8: RankPool, tmp_path: Path) -> None:
    """Every tensor family at once: TP2 x PP2 (2 virtual chunks each, one leaf per layer) x DP2 with EP2,
    one leaf per expert and ZeRO-1, to TP1 x DP4 x EP4 with ZeRO, to TP4 x PP2 x ETP2 without ZeRO, and
    to a single rank."""
    path = str(tmp_path / "ckpt")
    save_ok(
        pool8,
        path,
        Par(tp=2, pp=2, dp=2, ep=2, vpp=2, layer_leaves=True, expert_leaves=True, zero=True),
        EVERYTHING,
    )
    for par in (Par(dp=4, ep=4, zero=True), Par(tp=4, pp=2, etp=2), Par()):
        load_ok(pool8, path, par, EVERYTHING)


# --- expert parallel ------------------------------------------------------------------------------------

EP_CASES = [
    (Par(dp=2, ep=2), [Par(dp=4, ep=4)]),
    (Par(dp=4, ep=4), [Par()]),
    (Par(dp=4, pp=2, ep=2), [Par(dp=4, ep=4), Par(dp=2, pp=2, ep=1)]),
    (
        Par(dp=4, ep=2, expert_leaves=True),
        [Par(dp=4, ep=4), Par(expert_leaves=True), Par(dp=2, etp=2, expert_leaves=True)],
    ),
]


@pytest.mark.dist
@pytest.mark.parametrize("case", EP_CASES, ids=case_id)
def test_expert_parallel(pool8: RankPool, tmp_path: Path, case: tuple[Par, list[Par]]) -> None:
    """Stacked experts split by EP (with expert-DP replicas where EP < ranks per stage): EP 2->4, 4->1,
    EP2 x PP2 to EP4 and to EP1 x PP2, and one leaf per local expert (sequential MLP) to one per rank."""
    save, loads = case
    parts = ("experts", "norm")
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, save, parts)
    for par in loads:
        load_ok(pool8, path, par, parts)


@pytest.mark.dist
@pytest.mark.parametrize("ep", [1, 2])
def test_tp2_etp1_to_tp1_etp2(pool8: RankPool, tmp_path: Path, ep: int) -> None:
    """Dense TP2 with experts at ETP1 (EP1: experts replicated over both ranks; EP2: split) on 2 ranks,
    loaded as dense TP1 / DP2 with experts at ETP2."""
    parts = (*DENSE, "experts")
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, Par(tp=2, ep=ep, etp=1), parts)
    load_ok(pool8, path, Par(tp=1, dp=2, ep=1, etp=2), parts)
    load_ok(pool8, path, Par(), parts)


ETP_TRAP = Par(tp=1, pp=1, dp=4, ep=2, etp=2)


@pytest.mark.dist
def test_etp_trap_keeps_all_four_expert_slices(pool8: RankPool, tmp_path: Path) -> None:
    """The seed report's topology: TP1/PP1/EP2/ETP2 on 4 ranks holding 0, 1, 10 and 11. Two ranks share
    (tp, pp, ep) but hold different ETP slices; all four must be saved and come back."""
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, ETP_TRAP, ("trap",))
    boxes = reshard.read_metadata(path).tensors[KEY_TRAP].boxes
    assert sorted((b.offset, b.shape) for b in boxes) == [
        ((e, 2 * t, 0), (1, 2, 2)) for e in range(2) for t in range(2)
    ]
    single = load_ok(pool8, path, Par(), ("trap",))
    assert single[0]["trap_values"] == [0.0, 1.0, 10.0, 11.0]
    for par in (Par(dp=2), Par(dp=2, ep=2), Par(dp=2, etp=2), Par(dp=4, etp=4), ETP_TRAP, Par(dp=8, ep=2, etp=2)):
        stats = load_ok(pool8, path, par, ("trap",))
        assert sorted({v for s in stats for v in s["trap_values"]}) == [0.0, 1.0, 10.0, 11.0], str(par)


def rank_save_trap_etp_as_replicas(ctx: RankContext, path: str) -> str | None:
    """The trap layout, with replica ids that wrongly claim the two ETP slices are copies of each other."""
    group, member = ctx.group_of_size(ETP_TRAP.world)
    if not member:
        return None
    c = ETP_TRAP.coords(ctx.rank)
    shard = trap_expert(ETP_TRAP.ep, c.ep, ETP_TRAP.etp, c.etp, replica_id=c.etp)
    data = shard.local_of(global_value(KEY_TRAP, shard.global_shape))
    reshard.save({"w": shard.describe(data)}, path, group=group, timeout=TIMEOUT)
    return "saved"


@pytest.mark.dist
def test_etp_slices_claimed_as_replicas_are_refused(pool8: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    failures = failures_of(pool8.run(rank_save_trap_etp_as_replicas, str(path)), 4)
    assert failures[0].error_class == "ShardingError"
    message = failures[0].message
    assert KEY_TRAP in message
    assert re.search(r"\branks?\b", message), message
    assert not (path / "metadata.json").exists()


@pytest.mark.dist
def test_etp_slices_claimed_as_replicas_name_the_replica_ranks(pool8: RankPool, tmp_path: Path) -> None:
    failures = failures_of(pool8.run(rank_save_trap_etp_as_replicas, str(tmp_path / "ckpt")), 4)
    message = failures[0].message
    assert "rank 1" in message or "rank 3" in message, message


# --- tied embedding and output layer ----------------------------------------------------------------------


def rank_save_tied(ctx: RankContext, path: str, output_first: bool) -> int | None:
    """TP 2 with tied input embedding and output layer on the same rank: both leaves describe the same
    shard of one key, the output layer's as a replica (as Megatron-Core marks the tied output layer)."""
    group, member = ctx.group_of_size(2)
    if not member:
        return None
    shard = vocab_embedding(2, ctx.rank)
    weight = local_tensor(shard, "save", torch.float32)
    embedding = shard.describe(weight)
    output = ShardedTensor.from_rank_offsets(
        KEY_EMBED, weight, (0, ctx.rank, 2), replica_id=1, logical_shape=shard.logical_shape
    )
    leaves = [("output_layer.weight", output), ("embedding.word_embeddings.weight", embedding)]
    state = dict(leaves if output_first else leaves[::-1])
    reshard.save(state, path, group=group, timeout=TIMEOUT)
    return ctx.rank


@pytest.mark.dist
@pytest.mark.parametrize(
    "output_first",
    [False, True],
    ids=["embedding_first", "output_layer_first"],
)
def test_tied_embedding_on_one_rank(pool8: RankPool, tmp_path: Path, output_first: bool) -> None:
    """A rank that holds a tied weight twice (primary and replica) saves it once, whatever the order of
    the two leaves in its state dict."""
    path = str(tmp_path / "ckpt")
    assert pool8.run_ok(rank_save_tied, path, output_first)[:2] == [0, 1]
    assert reshard.read_metadata(path).total_bytes == VOCAB * HIDDEN * 4
    load_ok(pool8, path, Par(), ("embed",))


# --- distributed optimizer (ZeRO-1) -----------------------------------------------------------------------

ZERO_CASES = [
    (Par(dp=4, zero=True), [Par(dp=2, zero=True)]),
    (Par(dp=2, zero=True), [Par()]),
    (Par(), [Par(dp=4, zero=True)]),
    (Par(tp=2, dp=2, zero=True), [Par(tp=4, dp=2, zero=True), Par(tp=1, dp=4, zero=True), Par(tp=1)]),
    (Par(tp=2, dp=2), [Par(tp=1, dp=4, zero=True), Par(tp=4, dp=2, zero=True)]),
    (Par(tp=2, dp=4, zero=True), [Par(tp=4, dp=1), Par(dp=8, zero=True)]),
]


@pytest.mark.dist
@pytest.mark.parametrize("case", ZERO_CASES, ids=case_id)
def test_distributed_optimizer(pool8: RankPool, tmp_path: Path, case: tuple[Par, list[Par]]) -> None:
    """Adam state of odd-sized params (TP-split on either axis, TP-replicated, GLU-segmented, padded
    vocabulary) as ZeRO-1 flat ranges or plain shards replicated over DP: DP 4->2, 2->1, 1->4, ZeRO at
    TP2 to TP4/TP1, non-ZeRO to ZeRO and back."""
    save, loads = case
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, save, ("optim",))
    for par in loads:
        load_ok(pool8, path, par, ("optim",))


# --- dtype conversion -------------------------------------------------------------------------------------

DTYPE_CASES = [
    ("bfloat16", "float32", Par(tp=2), Par(tp=4)),
    ("float32", "bfloat16", Par(tp=2), Par(tp=1)),
    ("float16", "float32", Par(tp=4), Par(tp=2)),
    ("bfloat16", "float32", Par(dp=2, zero=True), Par(dp=4, zero=True)),
]


@pytest.mark.dist
@pytest.mark.parametrize(("saved", "target", "save", "load"), DTYPE_CASES, ids=str)
def test_dtype_conversion(pool8: RankPool, tmp_path: Path, saved: str, target: str, save: Par, load: Par) -> None:
    """A load into a template of another dtype gives exactly ``saved.to(target)``; with
    allow_dtype_cast=False it is a MismatchError on every rank."""
    parts = (*DENSE, "optim")
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, save, parts, saved)
    load_ok(pool8, path, load, parts, saved=saved, target=target)
    failures = failures_of(pool8.run(rank_load, path, load, parts, saved, target, False), load.world)
    assert failures[0].error_class == "MismatchError"
    assert "allow_dtype_cast=False" in failures[0].message
    assert KEY_EMBED in failures[0].message


# --- invalid layouts --------------------------------------------------------------------------------------


@pytest.mark.unit
def test_invalid_descriptions_fail_at_construction() -> None:
    data = torch.zeros(4, 2)
    with pytest.raises(ShardingError, match=r"'qkv'.*overlap"):
        ShardedTensor.segmented("qkv", data, (8, 2), 0, [(0, 2), (1, 2)])
    with pytest.raises(ValueError, match=r"'opt'.*runs past"):
        ShardedTensor.from_flat_range("opt", torch.zeros(4), (2, 3), (4, 3), (0, 0), 3, 7)
    with pytest.raises(ShardingError, match=r"'opt'.*runs past"):
        ShardedTensor.from_flat_range(
            "opt", torch.zeros(3), (4, 2), (8, 2), (0, 0), 6, 9, segment_axis=0, segments=[(0, 2), (4, 2)]
        )
    with pytest.raises(ShardingError, match=r"'emb'.*logical_shape"):
        ShardedTensor.from_rank_offsets("emb", torch.zeros(8, 2), (0, 0, 2), logical_shape=(17, 2))
    with pytest.raises(ShardingError, match=r"'emb'.*logical_shape"):
        ShardedTensor("emb", torch.zeros(8, 2), (16, 2), (0, 0), logical_shape=(16, 3))


def rank_save_invalid(ctx: RankContext, path: str, case: str) -> str | None:
    world = 4 if case.startswith("etp") else 2
    group, member = ctx.group_of_size(world)
    if not member:
        return None
    r = ctx.rank
    shard: Shard
    if case in ("duplicate_segments", "overlapping_segments"):
        # TP 2 GQA, but rank 1's segments start one group (duplicate: group 3 twice, group 7 never) or
        # one row (overlapping) too early.
        shard = gqa_qkv(2, r)
        if r == 1:
            q_len = shard.segments[0][1]
            shift = [q_len, HEAD_DIM, HEAD_DIM] if case == "duplicate_segments" else [1, 1, 1]
            shifts = shift * (GQA_GROUPS // 2)
            segs = tuple((g - s, n) for (g, n), s in zip(shard.segments, shifts, strict=True))
            shard = Shard(shard.key, shard.global_shape, shard.offset, shard.local_shape, 0, 0, segs)
        st = shard.describe(shard.local_of(global_value(shard.key, shard.global_shape)))
    elif case == "replica_box_differs":
        # DP 2 replicas of a norm: rank 1's replica covers only part of the primary's box.
        shard = split(KEY_NORM, (HIDDEN,)) if r == 0 else Shard(KEY_NORM, (HIDDEN,), (1,), (2,), replica_id=1)
        st = shard.describe(shard.local_of(global_value(KEY_NORM, (HIDDEN,))))
    elif case == "overlapping_flat_ranges":
        # ZeRO over DP 2, rank 1's range starts one element early: element 30 of (12, 5) twice.
        lo, hi = (0, 31) if r == 0 else (30, 60)
        full = global_value("optimizer.exp_avg.a", (12, 5))
        st = ShardedTensor.from_flat_range(
            "optimizer.exp_avg.a", full.reshape(-1)[lo:hi].clone(), (12, 5), (12, 5), (0, 0), lo, hi
        )
    elif case == "etp_offset_from_tp_rank":
        # The seed report's mistake in box form: the ETP slice placed by the TP rank (always 0 at TP1) and
        # replica ids from the DP rank, so the second ETP slice of each expert looks like a replica.
        c = ETP_TRAP.coords(r)
        shard = trap_expert(ETP_TRAP.ep, c.ep, ETP_TRAP.etp, c.tp, replica_id=c.dp)
        st = shard.describe(shard.local_of(global_value(KEY_TRAP, shard.global_shape)) + c.etp)
    else:
        raise AssertionError(case)
    reshard.save({"t": st}, path, group=group, timeout=TIMEOUT)
    return "saved"


BOTH_RANKS = r"ranks? 0\b.*\b1\b"
INVALID_CASES = {
    "etp_offset_from_tp_rank": (KEY_TRAP, [r"rank [23] holds a replica", "no rank holds as primary"]),
    "duplicate_segments": (KEY_GQA, [BOTH_RANKS, "claimed as primary"]),
    "overlapping_segments": (KEY_GQA, [BOTH_RANKS, "overlap"]),
    "replica_box_differs": (KEY_NORM, [r"rank 1\b", "replica"]),
    "overlapping_flat_ranges": ("optimizer.exp_avg.a", [BOTH_RANKS, "overlap"]),
}


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(INVALID_CASES))
def test_invalid_layouts_fail_at_save_on_every_rank(pool8: RankPool, tmp_path: Path, case: str) -> None:
    path = tmp_path / "ckpt"
    failures = failures_of(pool8.run(rank_save_invalid, str(path), case), 4 if case.startswith("etp") else 2)
    key, words = INVALID_CASES[case]
    assert failures[0].error_class == "ShardingError"
    assert key in failures[0].message
    for pattern in words:
        assert re.search(pattern, failures[0].message), (pattern, failures[0].message)
    assert not (path / "metadata.json").exists()


def rank_load_other_logical_shape(ctx: RankContext, path: str) -> None:
    group, member = ctx.group_of_size(2)
    if not member:
        return
    shard = vocab_embedding(2, ctx.rank, vocab=VOCAB - 1)
    reshard.load({"e": shard.describe(torch.zeros(shard.local_shape))}, path, group=group, timeout=TIMEOUT)


@pytest.mark.dist
def test_template_with_other_logical_shape_is_a_mismatch(pool8: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    save_ok(pool8, path, Par(tp=2), ("embed",))
    failures = failures_of(pool8.run(rank_load_other_logical_shape, path), 2)
    assert failures[0].error_class == "MismatchError"
    assert KEY_EMBED in failures[0].message
    assert "logical shape" in failures[0].message
