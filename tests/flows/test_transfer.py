"""``reshard.transfer``: tensors from the ranks of one layout to the ranks of another, no storage between.

The main case runs on 8 gloo ranks: a trainer at TP=2 x PP=2 (ranks 0-3) streams its weights to an
inference layout at TP=4 (ranks 4-7) under Hugging Face-like names and in bf16, and the result equals a
save by the trainer and a load by the inference ranks through storage, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import MismatchError, StateDictError
from reshard.net.transports import ThreadGroup
from tests.rankpool import RankContext, RankPool
from tests.threads import on_threads

HIDDEN, VOCAB, LAYERS = 8, 16, 4


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    seed = sum(map(ord, name))
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


SHAPES = {
    "embed": (VOCAB, HIDDEN),
    **{f"layers.{i}.qkv": (3 * HIDDEN, HIDDEN) for i in range(LAYERS)},
    **{f"layers.{i}.proj": (HIDDEN, HIDDEN) for i in range(LAYERS)},
    **{f"layers.{i}.norm": (HIDDEN,) for i in range(LAYERS)},
}
FULL = {key: _full(key, shape) for key, shape in SHAPES.items()}
HF_NAME = {
    **{f"model.layers.{i}.self_attn.qkv_proj.weight": f"layers.{i}.qkv" for i in range(LAYERS)},
    **{f"model.layers.{i}.self_attn.o_proj.weight": f"layers.{i}.proj" for i in range(LAYERS)},
    **{f"model.layers.{i}.input_layernorm.weight": f"layers.{i}.norm" for i in range(LAYERS)},
    "model.embed_tokens.weight": "embed",
}


def _split(key: str, tp: int, tp_size: int) -> tuple[torch.Tensor, int]:
    """This TP rank's part of ``key``: columns of ``proj`` (row-parallel), rows of the others; and the axis."""
    axis = 1 if key.endswith("proj") else 0
    full = FULL[key]
    n = full.shape[axis] // tp_size
    return full.narrow(axis, tp * n, n).clone(), axis


def trainer_state(tp: int, pp: int) -> dict[str, Any]:
    """TP=2 x PP=2: stage ``pp`` holds layers 2pp and 2pp+1, stage 0 the embedding."""
    state: dict[str, Any] = {}
    keys = [k for k in SHAPES if k.startswith(("layers.0.", "layers.1.") if pp == 0 else ("layers.2.", "layers.3."))]
    for key in [*keys, *(["embed"] if pp == 0 else [])]:
        if key.endswith("norm"):
            state[key] = reshard.ShardedTensor(key, FULL[key].clone(), SHAPES[key], (0,), replica_id=tp)
            continue
        local, axis = _split(key, tp, 2)
        state[key] = reshard.ShardedTensor.from_rank_offsets(key, local, (axis, tp, 2))
    return state


def inference_template(tp: int) -> dict[str, Any]:
    """TP=4, every layer, Hugging Face names, bf16."""
    template: dict[str, Any] = {}
    for name, key in HF_NAME.items():
        if key.endswith("norm"):
            template[name] = reshard.ShardedTensor(
                name, torch.empty(SHAPES[key], dtype=torch.bfloat16), SHAPES[key], (0,), replica_id=tp
            )
            continue
        local, axis = _split(key, tp, 4)
        template[name] = reshard.ShardedTensor.from_rank_offsets(
            name, torch.empty_like(local, dtype=torch.bfloat16), (axis, tp, 4)
        )
    return template


def rank_stream(ctx: RankContext, path: str) -> dict[str, Any]:
    trainer = ctx.rank < 4
    source = trainer_state(ctx.rank % 2, ctx.rank // 2) if trainer else {}
    target = {} if trainer else inference_template(ctx.rank - 4)
    stats = reshard.TransferStats()
    streamed = reshard.transfer(source, target, key_map=HF_NAME, stats=stats)
    # The reference: the trainer saves, then (after a barrier of all 8) the inference ranks load it.
    if trainer:
        reshard.save(source, path, group=ctx.groups["lower_half"])
    torch.distributed.barrier()
    if trainer:
        return {"sent": stats.bytes_sent, "received": stats.bytes_received}
    reference_template = {
        HF_NAME[name]: reshard.ShardedTensor(
            HF_NAME[name], torch.empty_like(st.data), st.global_shape, st.global_offset, st.replica_id
        )
        for name, st in inference_template(ctx.rank - 4).items()
    }
    loaded = reshard.load(reference_template, path, group=ctx.groups["upper_half"])
    for name, key in HF_NAME.items():
        assert streamed[name].dtype == torch.bfloat16
        assert torch.equal(streamed[name], loaded[key]), name
        if not key.endswith("norm"):
            local, _ = _split(key, ctx.rank - 4, 4)
            assert torch.equal(streamed[name], local.bfloat16()), name
    return {"sent": stats.bytes_sent, "received": stats.bytes_received}


@pytest.mark.dist
def test_trainer_streams_its_weights_to_an_inference_layout(pool8: RankPool, tmp_path: Path) -> None:
    results = pool8.run_ok(rank_stream, str(tmp_path / "ckpt"))
    total = sum(t.numel() * 4 for t in FULL.values())
    norms = sum(FULL[f"layers.{i}.norm"].numel() * 4 for i in range(LAYERS))
    # Every inference rank gets its quarter of the split tensors and every norm whole; the trainer sends it.
    assert sum(r["received"] for r in results[4:]) == (total - norms) + 4 * norms
    assert sum(r["sent"] for r in results[:4]) == sum(r["received"] for r in results[4:])
    assert all(r["received"] == 0 for r in results[:4]) and all(r["sent"] == 0 for r in results[4:])


@pytest.mark.unit
def test_replicas_share_the_sending_and_own_pieces_are_copied(tmp_path: Path) -> None:
    """Two ranks hold the same full tensor (replicas) and each wants half of it back, another layout:
    each copies its half locally, nothing travels; a third rank with nothing wants it whole and gets one
    half from each replica (128 KiB: large enough to be cut among its holders)."""
    full = torch.arange(256 * 128.0).reshape(256, 128)
    group = ThreadGroup(3)
    out: list[Any] = [None] * 3
    stats = [reshard.TransferStats() for _ in range(3)]

    def rank(r: int) -> None:
        source = {"w": full.clone()} if r < 2 else {}
        if r < 2:
            target = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.empty(128, 128), (0, r, 2))}
        else:
            target = {"w": torch.empty(256, 128)}
        out[r] = reshard.transfer(source, target, group=group.member(r), stats=stats[r])

    on_threads(3, rank)
    assert torch.equal(out[0]["w"], full[:128]) and torch.equal(out[1]["w"], full[128:])
    assert torch.equal(out[2]["w"], full)
    half = 128 * 128 * 4
    assert stats[0].bytes_copied == stats[1].bytes_copied == half
    assert stats[0].bytes_sent == stats[1].bytes_sent == half  # the third rank's two halves
    assert stats[2].bytes_received == 2 * half and stats[2].bytes_copied == 0


@pytest.mark.unit
def test_segments_flat_ranges_and_padding_transfer_as_they_load(tmp_path: Path) -> None:
    """A ZeRO-1 flat range and a fused (segmented) tensor as sources, a padded template as a target."""
    q, k = torch.arange(12.0).reshape(3, 4), 100 + torch.arange(8.0).reshape(2, 4)
    fused = torch.cat([q, k])
    flat = torch.arange(20.0)
    group = ThreadGroup(2)
    out: list[Any] = [None, None]

    def rank(r: int) -> None:
        if r == 0:
            source = {
                # held as [K; Q] (local order), the global tensor is [Q; K]
                "qk": reshard.ShardedTensor.segmented("qk", torch.cat([k, q]), (5, 4), 0, [(3, 2), (0, 3)]),
                "v": reshard.ShardedTensor.from_flat_range("v", flat[:20].clone(), (20,), (20,), (0,), 0, 20),
            }
            target: dict[str, Any] = {}
        else:
            source = {}
            target = {
                "qk": torch.empty(5, 4),
                "v": reshard.ShardedTensor("v", torch.full((24,), 7.0), (24,), (0,), logical_shape=(20,)),
            }
        out[r] = reshard.transfer(source, target, group=group.member(r))

    on_threads(2, rank)
    assert torch.equal(out[1]["qk"], fused)
    assert torch.equal(out[1]["v"][:20], flat) and not out[1]["v"][20:].any()


@pytest.mark.unit
def test_what_no_rank_holds_is_named_on_every_rank() -> None:
    group = ThreadGroup(2)
    errors: list[BaseException | None] = [None, None]

    def rank(r: int) -> None:
        source = {"w": reshard.ShardedTensor("w", torch.ones(2, 4), (4, 4), (0, 0))} if r == 0 else {}
        target = {"w": torch.empty(4, 4), "missing": torch.empty(2)} if r == 1 else {}
        try:
            reshard.transfer(source, target, group=group.member(r))
        except MismatchError as exc:
            errors[r] = exc

    on_threads(2, rank)
    assert all(isinstance(e, MismatchError) for e in errors)
    assert "'missing': no rank holds it" in str(errors[0])


@pytest.mark.unit
def test_uncovered_parts_and_lossy_casts_are_refused() -> None:
    group = ThreadGroup(2)
    errors: list[str] = ["", ""]

    def rank(r: int) -> None:
        source = {"w": reshard.ShardedTensor("w", torch.ones(2, 4), (4, 4), (0, 0))} if r == 0 else {}
        target = {"w": torch.empty(4, 4)} if r == 1 else {}
        try:
            reshard.transfer(source, target, group=group.member(r))
        except MismatchError as exc:
            errors[r] = str(exc)

    on_threads(2, rank)
    assert errors[0] == errors[1] and "held by no rank" in errors[0] and "'w' box at [2, 0]" in errors[0]
    with pytest.raises(MismatchError, match="lossy"):
        reshard.transfer({"w": torch.ones(3)}, {"w": torch.empty(3, dtype=torch.int64)})
    with pytest.raises(StateDictError, match="tensors"):
        reshard.transfer({"w": torch.ones(3)}, {"w": torch.empty(3), "step": 0})


@pytest.mark.unit
def test_a_session_sends_only_what_changed() -> None:
    """A TransferSession plans once; with delta (the default) each later transfer sends only the cells
    whose content changed since they were last sent; delta=False, or target tensors at another address,
    send everything again."""
    group = ThreadGroup(2)
    held = {"a": torch.arange(64.0), "b": torch.ones(8, 8), "c": torch.zeros(16, dtype=torch.int32)}
    targets = [{}, {k: torch.empty_like(v) for k, v in held.items()}]
    sessions = [reshard.TransferSession(group=group.member(r)) for r in range(2)]
    received: list[int] = []

    def sync(*, delta: bool = True) -> None:
        stats = [reshard.TransferStats(), reshard.TransferStats()]

        def rank(r: int) -> None:
            sessions[r].transfer(held if r == 0 else {}, targets[r], delta=delta, stats=stats[r])

        on_threads(2, rank)
        assert stats[0].bytes_sent == stats[1].bytes_received
        received.append(stats[1].bytes_received)
        for key, value in held.items():
            assert torch.equal(targets[1][key], value), key

    everything = sum(v.numel() * v.element_size() for v in held.values())
    sync()
    held["b"].mul_(3)  # a training step changed one tensor, in place
    sync()
    sync()  # nothing changed
    sync(delta=False)
    targets[1]["c"] = torch.empty(16, dtype=torch.int32)  # the receiver reallocated a tensor: a new plan
    sync()
    assert received == [everything, 8 * 8 * 4, 0, everything, everything]


@pytest.mark.unit
def test_sources_of_one_key_in_different_dtypes_or_shapes_per_rank_are_refused() -> None:
    """A save refuses a key that ranks describe with different dtypes or global shapes; a transfer did not: the
    coordinator kept one rank's description, so a float32 half could be cast to a bfloat16 target with no
    ``allow_lossy_cast``, or a half of another global shape land in the target."""
    for other in ({"dtype": torch.bfloat16}, {"global_shape": (4, 8)}):
        group = ThreadGroup(2)
        errors: list[BaseException | None] = [None, None]

        def rank(r: int, other: dict[str, Any] = other, group: ThreadGroup = group, errors: list[Any] = errors) -> None:
            dtype = other.get("dtype", torch.float32) if r == 1 else torch.float32
            shape = other.get("global_shape", (4, 4)) if r == 1 else (4, 4)
            data = torch.full((2, 4), 1.0 + 1e-3 * r, dtype=dtype)
            source = {"w": reshard.ShardedTensor("w", data, shape, (2 * r, 0))}
            target = {"w": torch.empty(4, 4, dtype=torch.bfloat16)} if r == 0 else {}
            try:
                reshard.transfer(source, target, group=group.member(r))
            except reshard.ShardingError as exc:
                errors[r] = exc

        on_threads(2, rank)
        assert all(isinstance(e, reshard.ShardingError) for e in errors), (other, errors)
        assert str(errors[0]) == str(errors[1]) and "'w'" in str(errors[0]) and "ranks 0" in str(errors[0])
