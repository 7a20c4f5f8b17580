"""``TransferSession(delta=True)`` trusts nothing it cannot prove.

The loop of a reinforcement-learning job: a trainer at TP=2 (ranks 0, 1) syncs its weights after every step
into an inference engine at TP=1 or TP=3 (the ranks after them), whose vocabulary is padded past its logical
size. Between syncs the engine may re-create its tensors at the same address, write into them in place
(through ``.data`` or outside torch, where no version counter moves), or replace them; a trainer may roll
back a step and switch session objects. After every sync each engine tensor must equal, bit for bit, what a
fresh full transfer gives, and a delta sync must still send only the cells that need it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import CheckpointError
from reshard.net.transports import ThreadGroup
from tests.rankpool import RankContext, RankPool
from tests.threads import on_threads

HIDDEN, VOCAB, ROWS = 4, 11, 12
"""The embedding has VOCAB logical rows (padded to 12 by the trainer at TP=2); ``w`` has ROWS rows."""
KEY_MAP = {"model.embed_tokens.weight": "embed", "model.w": "w", "model.norm": "norm"}
GARBAGE = 7.0


def initial_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed": torch.randn(VOCAB, HIDDEN, generator=g),
        "w": torch.randn(ROWS, HIDDEN, generator=g),
        "norm": torch.randn(HIDDEN, generator=g),
    }


def trainer_state(full: dict[str, torch.Tensor], tp: int) -> dict[str, Any]:
    """TP rank ``tp`` of 2: half the (padded) embedding rows, half of ``w``'s rows, ``norm`` replicated."""
    padded = torch.full((12, HIDDEN), -3.0)  # the trainer's own padding rows hold anything
    padded[:VOCAB] = full["embed"]
    return {
        "embed": reshard.ShardedTensor.from_rank_offsets(
            "embed", padded[6 * tp : 6 * tp + 6].clone(), (0, tp, 2), logical_shape=(VOCAB, HIDDEN)
        ),
        "w": reshard.ShardedTensor.from_rank_offsets("w", full["w"][6 * tp : 6 * tp + 6].clone(), (0, tp, 2)),
        "norm": reshard.ShardedTensor("norm", full["norm"].clone(), (HIDDEN,), (0,), replica_id=tp),
    }


def engine_template(tp: int, size: int) -> dict[str, Any]:
    """TP rank ``tp`` of ``size`` of the engine: the vocabulary padded to 16 (TP=1) or 12 (TP=3) rows,
    ``w`` in bf16, ``norm`` a plain tensor; every element starts as garbage."""
    vocab = 16 if size == 1 else 12
    return {
        "model.embed_tokens.weight": reshard.ShardedTensor.from_rank_offsets(
            "model.embed_tokens.weight",
            torch.full((vocab // size, HIDDEN), GARBAGE),
            (0, tp, size),
            logical_shape=(VOCAB, HIDDEN),
        ),
        "model.w": reshard.ShardedTensor.from_rank_offsets(
            "model.w", torch.full((ROWS // size, HIDDEN), GARBAGE, dtype=torch.bfloat16), (0, tp, size)
        ),
        "model.norm": torch.full((HIDDEN,), GARBAGE),
    }


def tensors(template: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.data if isinstance(v, reshard.ShardedTensor) else v for k, v in template.items()}


class RLLoop:
    """A trainer at TP=2 syncing into an engine at TP=``engine_tp`` over one ThreadGroup, one session per
    rank (replaceable: ``sessions[r]``)."""

    def __init__(self, engine_tp: int) -> None:
        self.engine_tp = engine_tp
        self.size = 2 + engine_tp
        self.group = ThreadGroup(self.size)
        self.full = initial_weights()
        self.engine = [engine_template(e, engine_tp) for e in range(engine_tp)]
        self.sessions = [self.new_session(r) for r in range(self.size)]

    def new_session(self, rank: int, **options: Any) -> reshard.TransferSession:
        return reshard.TransferSession(group=self.group.member(rank), key_map=KEY_MAP, **options)

    def sync(self, *, delta: Callable[[int], bool] = lambda _r: True) -> list[reshard.TransferStats]:
        """One weight sync; every rank's stats."""
        stats = [reshard.TransferStats() for _ in range(self.size)]

        def rank(r: int) -> None:
            source = trainer_state(self.full, r) if r < 2 else {}
            target = self.engine[r - 2] if r >= 2 else {}
            self.sessions[r].transfer(source, target, delta=delta(r), stats=stats[r])

        on_threads(self.size, rank, group=self.group)
        assert sum(s.bytes_sent for s in stats) == sum(s.bytes_received for s in stats)
        assert len({s.rounds for s in stats}) == 1
        return stats

    def received(self, stats: list[reshard.TransferStats]) -> int:
        return sum(s.bytes_received for s in stats[2:])

    def everything(self) -> int:
        """Bytes a full sync sends: the logical embedding, ``w`` (fp32 on the wire), ``norm`` per engine rank."""
        return (VOCAB * HIDDEN + ROWS * HIDDEN + self.engine_tp * HIDDEN) * 4

    def reference(self) -> list[dict[str, torch.Tensor]]:
        """What a fresh full transfer gives the engine ranks (on a group of its own)."""
        group = ThreadGroup(self.size)
        fresh = [engine_template(e, self.engine_tp) for e in range(self.engine_tp)]

        def rank(r: int) -> None:
            source = trainer_state(self.full, r) if r < 2 else {}
            reshard.transfer(source, fresh[r - 2] if r >= 2 else {}, group=group.member(r), key_map=KEY_MAP)

        on_threads(self.size, rank, group=group)
        return [tensors(t) for t in fresh]

    def check(self) -> None:
        """Every engine tensor equals a fresh full transfer's, bit for bit (padding rows zero)."""
        for e, (got, want) in enumerate(zip([tensors(t) for t in self.engine], self.reference(), strict=True)):
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype
                assert torch.equal(got[name], tensor), f"engine rank {e}: {name}"
        last = tensors(self.engine[-1])["model.embed_tokens.weight"]
        rows = last.shape[0] - (VOCAB - (self.engine_tp - 1) * last.shape[0])
        assert rows > 0 and not last[-rows:].any(), "the padding rows are zero"


@pytest.mark.unit
@pytest.mark.parametrize("engine_tp", [1, 3])
def test_padding_is_zeroed_without_touching_the_real_rows(engine_tp: int) -> None:
    """The last engine rank's embedding piece is padded; a delta sync after a step that changed only ``w``
    leaves its real rows as they were (not zeroed, then not re-sent) and zeroes its padding, whatever the
    engine wrote there."""
    loop = RLLoop(engine_tp)
    assert loop.received(loop.sync()) == loop.everything()
    loop.check()
    for step in range(2):
        loop.full["w"].add_(1.0 + step)  # a training step that changed w only
        tensors(loop.engine[-1])["model.embed_tokens.weight"][-1].fill_(123.0)  # the engine's scratch padding
        assert loop.received(loop.sync()) == ROWS * HIDDEN * 4
        loop.check()
    assert loop.received(loop.sync()) == 0  # nothing changed: nothing travels
    loop.check()


@pytest.mark.unit
def test_zero_padding_touches_only_the_padding() -> None:
    """Padding past the logical shape on two axes, a piece that is all padding, a ZeRO flat range that
    ends in padding: zero_padding() zeroes exactly the elements outside the logical shape."""
    data = torch.full((4, 5), 9.0)
    st = reshard.ShardedTensor.from_rank_offsets("t", data, (0, 1, 2), (1, 1, 2), logical_shape=(6, 7))
    (piece,) = st.pieces()  # rows 4..7, columns 5..9 of (8, 10): real rows 4..5, columns 5..6
    piece.zero_padding()
    expected = torch.zeros(4, 5)
    expected[:2, :2] = 9.0
    assert torch.equal(data, expected)
    empty = torch.full((2, 3), 9.0)
    st = reshard.ShardedTensor.from_rank_offsets("t", empty, (0, 3, 4), logical_shape=(6, 3))  # rows 6..7
    for piece in st.pieces():
        piece.zero_padding()
    assert not empty.any()
    flat = torch.full((6,), 9.0)  # elements 6..11 of a (3, 4) shard whose last row is padding
    st = reshard.ShardedTensor.from_flat_range("t", flat, (3, 4), (3, 4), (0, 0), 6, 12, logical_shape=(2, 4))
    for piece in st.pieces():
        piece.zero_padding()
    assert torch.equal(flat, torch.tensor([9.0, 9.0, 0.0, 0.0, 0.0, 0.0]))
    plain = torch.full((3,), 9.0)
    for piece in reshard.ShardedTensor("t", plain, (3,), (0,)).pieces():
        piece.zero_padding()  # no padding: nothing to do
    assert torch.equal(plain, torch.full((3,), 9.0))


def _recreate_w_with_old_weights(loop: RLLoop, old: torch.Tensor) -> None:
    """The engine reloads ``w`` from an old checkpoint into a new tensor object over the same memory (same
    address, new storage, a fresh version counter), writing outside torch as a C++ loader does."""
    size = loop.engine_tp
    for e, template in enumerate(loop.engine):
        before = template["model.w"].data
        recreated = torch.from_numpy(before.view(torch.int16).numpy()).view(torch.bfloat16)
        assert recreated.data_ptr() == before.data_ptr() and recreated._version == 0
        recreated.view(torch.int16).numpy()[:] = (
            old[e * ROWS // size : (e + 1) * ROWS // size].bfloat16().view(torch.int16).numpy()
        )
        template["model.w"] = reshard.ShardedTensor.from_rank_offsets("model.w", recreated, (0, e, size))


def _zero_embed_through_data(loop: RLLoop, _old: torch.Tensor) -> None:
    """The engine clears its embedding through ``.data`` (no version counter moves)."""
    for template in loop.engine:
        version = template["model.embed_tokens.weight"].data._version
        template["model.embed_tokens.weight"].data.data.zero_()
        assert template["model.embed_tokens.weight"].data._version == version


def _scale_norm_in_place(loop: RLLoop, _old: torch.Tensor) -> None:
    """The engine rescales ``norm`` in place (a fused kernel's preprocessing)."""
    for template in loop.engine:
        template["model.norm"].mul_(2.0)


def _replace_norm(loop: RLLoop, _old: torch.Tensor) -> None:
    """The engine replaces ``norm`` by another tensor, at another address."""
    for template in loop.engine:
        template["model.norm"] = torch.zeros(HIDDEN)


def _expected_bytes(case: str, loop: RLLoop) -> int:
    return {
        "recreated": ROWS * HIDDEN * 4,
        "data": VOCAB * HIDDEN * 4,
        "in_place": loop.engine_tp * HIDDEN * 4,
        "new_address": loop.everything(),
    }[case]


CHANGES = {
    "recreated": _recreate_w_with_old_weights,
    "data": _zero_embed_through_data,
    "in_place": _scale_norm_in_place,
    "new_address": _replace_norm,
}


@pytest.mark.unit
@pytest.mark.parametrize("engine_tp", [1, 3])
@pytest.mark.parametrize("case", sorted(CHANGES))
def test_a_changed_engine_tensor_is_sent_again(engine_tp: int, case: str) -> None:
    """After the engine changed what it holds between two syncs (the trainer unchanged), a delta sync
    sends exactly the cells the engine no longer holds right, and the engine equals a fresh transfer."""
    loop = RLLoop(engine_tp)
    loop.sync()
    old = loop.full["w"].clone()
    loop.full["w"].mul_(-1.0)  # a step: the engine must now hold -old
    assert loop.received(loop.sync()) == ROWS * HIDDEN * 4
    loop.check()
    CHANGES[case](loop, old)
    stats = loop.sync()
    loop.check()
    assert loop.received(stats) == _expected_bytes(case, loop)
    assert loop.received(loop.sync()) == 0
    loop.check()


@pytest.mark.unit
def test_a_trainer_that_switches_sessions_and_rolls_back_resends() -> None:
    """The trainer syncs through session A, then through a fresh session B after a step, then rolls the step
    back and syncs through A again: A last sent exactly these bytes, but the engine holds B's; only a sync
    that every rank's session took part in can be a base for a delta."""
    loop = RLLoop(1)
    loop.sync()
    first = loop.sessions[:2]
    before = loop.full["w"].clone()
    loop.full["w"].add_(1.0)
    loop.sessions[:2] = [loop.new_session(0), loop.new_session(1)]
    assert loop.received(loop.sync()) == loop.everything()  # a fresh session: everything
    loop.check()
    loop.full["w"].copy_(before)  # the step is rolled back
    loop.sessions[:2] = first
    stats = loop.sync()
    loop.check()
    assert loop.received(stats) == loop.everything()


@pytest.mark.unit
def test_an_engine_rank_with_a_fresh_session_gets_everything() -> None:
    """One engine rank joins with a fresh session (a restarted engine worker) while every other rank reuses
    its own: every rank agrees that no delta is valid, and everything is sent."""
    loop = RLLoop(3)
    loop.sync()
    loop.full["w"].add_(1.0)
    loop.sync()
    tensors(loop.engine[1])["model.w"].zero_()
    loop.sessions[3] = loop.new_session(3)
    assert loop.received(loop.sync()) == loop.everything()
    loop.check()
    assert loop.received(loop.sync()) == 0


@pytest.mark.unit
def test_delta_on_some_ranks_and_not_on_others_sends_everything() -> None:
    """``delta=False`` on any rank (an engine that wants everything again) is a full sync on every rank: the
    same schedule everywhere, the engine equal to a fresh transfer; the next delta sync sends nothing."""
    loop = RLLoop(3)
    loop.sync()
    loop.full["w"].add_(1.0)
    tensors(loop.engine[2])["model.norm"].zero_()
    stats = loop.sync(delta=lambda r: r != 4)
    assert loop.received(stats) == loop.everything()
    loop.check()
    assert loop.received(loop.sync(delta=lambda r: r == 0)) == loop.everything()
    assert loop.received(loop.sync()) == 0
    loop.check()


def _disagreement(size: int, run: Callable[[int], None]) -> list[BaseException | None]:
    group_errors: list[BaseException | None] = [None] * size

    def rank(r: int) -> None:
        try:
            run(r)
        except CheckpointError as exc:
            group_errors[r] = exc

    on_threads(size, rank)
    return group_errors


@pytest.mark.unit
@pytest.mark.parametrize("one_off", [False, True])
@pytest.mark.parametrize(
    ("option", "values"),
    [("allow_lossy_cast", (True, False)), ("round_bytes", (1 << 20, 1 << 16))],
)
def test_session_options_that_differ_across_ranks_are_refused_on_every_rank(
    option: str, values: tuple[Any, Any], one_off: bool
) -> None:
    """A session option that differs between ranks is a CheckpointError naming it, on every rank, for a
    session and for a one-off transfer (each rank would otherwise plan or convert by other rules)."""
    group = ThreadGroup(2)

    def run(r: int) -> None:
        options = {option: values[r]}
        source = {"w": torch.arange(6.0)} if r == 0 else {}
        target = {"w": torch.empty(6)} if r == 1 else {}
        if one_off:
            reshard.transfer(source, target, group=group.member(r), **options)
        else:
            reshard.TransferSession(group=group.member(r), **options).transfer(source, target)

    errors = _disagreement(2, run)
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    assert len({(type(e), str(e)) for e in errors}) == 1
    assert f"different {option}" in str(errors[0])


@pytest.mark.unit
def test_round_bytes_must_be_a_positive_integer() -> None:
    """round_bytes=0 (or a float) cannot bound a round: a CheckpointError on every rank, not a transfer
    cut into one-element rounds."""
    for bad in (0, 1.5):
        group = ThreadGroup(2)

        def run(r: int, bad: Any = bad, group: ThreadGroup = group) -> None:
            source = {"w": torch.arange(6.0)} if r == 0 else {}
            reshard.transfer(source, {"w": torch.empty(6)} if r == 1 else {}, group=group.member(r), round_bytes=bad)

        errors = _disagreement(2, run)
        assert all(isinstance(e, CheckpointError) for e in errors), errors
        assert all("round_bytes must be a positive integer" in str(e) for e in errors)


KEY_MAPS: dict[str, list[Any]] = {
    "other_key": [{"x": "a"}, {"x": "a"}, {"x": "b"}],
    "none_on_an_engine_rank": [{"x": "a"}, {"x": "a"}, None],
    "none_on_the_coordinator": [None, {"x": "a"}, {"x": "a"}],
    "functions": [lambda _k: "a", lambda _k: "a", lambda k: {"x": "b"}[k]],
}


@pytest.mark.unit
@pytest.mark.parametrize("case", sorted(KEY_MAPS))
def test_key_maps_that_differ_across_ranks_are_refused_on_every_rank(case: str) -> None:
    """Two engine ranks map the same name to different trainer keys (or one has no key map): the ranks
    would fill the same name from different tensors, so every rank raises a CheckpointError naming
    key_map."""
    key_maps = KEY_MAPS[case]
    group = ThreadGroup(3)

    def run(r: int) -> None:
        source = {"a": torch.ones(4), "b": torch.zeros(4), "x": torch.full((4,), 2.0)} if r == 0 else {}
        target = {"x": torch.empty(4)} if r > 0 else {}
        reshard.TransferSession(group=group.member(r), key_map=key_maps[r]).transfer(source, target)

    errors = _disagreement(3, run)
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    assert len({(type(e), str(e)) for e in errors}) == 1
    assert "different key_map results" in str(errors[0])


@pytest.mark.unit
def test_two_names_mapped_to_one_key_are_each_checked() -> None:
    """Tied weights: two engine names from one trainer key; a name whose shape does not fit is refused
    even when another name of the same key fits."""
    group = ThreadGroup(2)

    def run(r: int) -> None:
        source = {"embed": torch.arange(8.0).reshape(4, 2)} if r == 0 else {}
        target = {"embed_tokens": torch.empty(2, 2), "lm_head": torch.empty(4, 2)} if r == 1 else {}
        key_map = {"lm_head": "embed", "embed_tokens": "embed"}
        reshard.TransferSession(group=group.member(r), key_map=key_map).transfer(source, target)

    errors = _disagreement(2, run)
    assert all(isinstance(e, reshard.MismatchError) for e in errors), errors
    assert "'embed_tokens'" in str(errors[0]) and "[2, 2]" in str(errors[0])


@pytest.mark.unit
def test_a_bad_target_on_one_rank_is_the_same_error_on_every_rank() -> None:
    """A target that holds a non-tensor on one rank only: every rank raises StateDictError (the pieces are
    described inside the agreed planning step), none waits for the others."""
    group = ThreadGroup(2, timeout=30.0)
    errors: list[BaseException | None] = [None, None]

    def rank(r: int) -> None:
        source = {"w": torch.ones(3)} if r == 0 else {}
        target = {"w": torch.empty(3), "step": 7} if r == 1 else {}
        try:
            reshard.TransferSession(group=group.member(r)).transfer(source, target)
        except CheckpointError as exc:
            errors[r] = exc

    on_threads(2, rank, group=group)
    assert all(isinstance(e, reshard.StateDictError) for e in errors), errors
    assert "rank 1" in str(errors[0]) and "entries: step" in str(errors[0])


# --- the same loop on four gloo processes: trainer ranks 0-1, engine ranks 2-3 --------------------------------


def rank_rl_loop(ctx: RankContext) -> list[int]:
    """Syncs: full; after a step (w only); after the engine re-created ``w`` with its old weights; with
    nothing changed. Checks the engine against the expected tensors after each; returns bytes received."""
    trainer = ctx.rank < 2
    full = initial_weights()
    template = {} if trainer else engine_template(ctx.rank - 2, 2)
    session = reshard.TransferSession(key_map=KEY_MAP)
    received = []

    def sync() -> None:
        stats = reshard.TransferStats()
        session.transfer(trainer_state(full, ctx.rank) if trainer else {}, template, stats=stats)
        received.append(stats.bytes_received)
        if trainer:
            return
        e = ctx.rank - 2
        got = tensors(template)
        assert torch.equal(got["model.embed_tokens.weight"][: VOCAB - 6 * e], full["embed"][6 * e : 6 * e + 6])
        assert not got["model.embed_tokens.weight"][VOCAB - 6 * e :].any()
        assert torch.equal(got["model.w"], full["w"][6 * e : 6 * e + 6].bfloat16())
        assert torch.equal(got["model.norm"], full["norm"])

    sync()
    old = full["w"].clone()
    full["w"].mul_(-1.0)
    sync()
    if not trainer:
        e = ctx.rank - 2
        before = template["model.w"].data
        recreated = torch.from_numpy(before.view(torch.int16).numpy()).view(torch.bfloat16)
        recreated.view(torch.int16).numpy()[:] = old[6 * e : 6 * e + 6].bfloat16().view(torch.int16).numpy()
        template["model.w"] = reshard.ShardedTensor.from_rank_offsets("model.w", recreated, (0, e, 2))
    sync()
    sync()
    return received


@pytest.mark.dist
def test_the_rl_loop_on_gloo_processes(pool4: RankPool) -> None:
    results = pool4.run_ok(rank_rl_loop)
    assert results[0] == results[1] == [0, 0, 0, 0]
    embed, w, norm = 6 * HIDDEN * 4, 6 * HIDDEN * 4, HIDDEN * 4
    assert results[2] == [embed + w + norm, w, w, 0]
    assert results[3] == [(VOCAB - 6) * HIDDEN * 4 + w + norm, w, w, 0]


# --- targets that alias each other: tied weights, overlapping views of one buffer -----------------------------


def _tied(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": base.view(4, 2), "y": base.view(4, 2)}  # lm_head tied to the embedding: one tensor, two names


def _tied_reversed(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(reversed(list(_tied(base).items())))


def _overlapping(base: torch.Tensor) -> dict[str, torch.Tensor]:
    flat = base.view(-1)
    return {"x": flat[0:8].view(4, 2), "y": flat[4:12].view(4, 2)}  # rows 2-3 of x are rows 0-1 of y


def _overlapping_reversed(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return dict(reversed(list(_overlapping(base).items())))


def _disjoint_columns(base: torch.Tensor) -> dict[str, torch.Tensor]:
    wide = base.view(2, 8)  # interleaved in memory, no element shared
    return {"x": wide[:, 0:4].t(), "y": wide[:, 4:8].t()}


ALIASING: dict[str, tuple[Callable[[torch.Tensor], dict[str, torch.Tensor]], int]] = {
    "tied": (_tied, 8),
    "tied_reversed": (_tied_reversed, 8),
    "overlapping": (_overlapping, 12),
    "overlapping_reversed": (_overlapping_reversed, 12),
    "disjoint_strided": (_disjoint_columns, 16),
}


def _aliasing_sources(step: int) -> dict[str, torch.Tensor]:
    """The trainer's two tensors (separate keys) at ``step``: x changes at steps 1 and 4, y at step 2."""
    x = torch.arange(8.0).reshape(4, 2) + 100 + 1000 * (step >= 1) + 5000 * (step >= 4)
    y = torch.arange(8.0).reshape(4, 2) + 200 + 1000 * (step >= 2)
    return {"x": x, "y": y}


@pytest.mark.unit
@pytest.mark.parametrize("local", [False, True], ids=["remote", "one_source_local"])
@pytest.mark.parametrize("case", sorted(ALIASING))
def test_aliasing_targets_sync_like_a_fresh_transfer(case: str, local: bool) -> None:
    """An engine whose target names share memory (a tied lm_head and embedding fed from two trainer keys,
    overlapping views of one buffer): after every delta sync (x changed, y changed, nothing changed, the
    engine scribbled over its buffer, x changed again) the engine's memory equals, byte for byte, what a
    fresh transfer into the same layout gives. With ``local``, the engine rank holds y itself (a local
    copy, always made, that overwrites x's bytes)."""
    layout, elements = ALIASING[case]
    group = ThreadGroup(2)
    sessions = [reshard.TransferSession(group=group.member(r)) for r in range(2)]
    base = torch.zeros(elements)

    def sources(r: int, step: int) -> dict[str, torch.Tensor]:
        both = _aliasing_sources(step)
        if local:
            return {"x": both["x"]} if r == 0 else {"y": both["y"]}
        return both if r == 0 else {}

    def fresh(step: int) -> torch.Tensor:
        other = torch.zeros(elements)
        fresh_group = ThreadGroup(2)

        def rank(r: int) -> None:
            reshard.transfer(sources(r, step), layout(other) if r else {}, group=fresh_group.member(r))

        on_threads(2, rank, group=fresh_group)
        return other

    received = []
    for step in [0, 1, 2, 3, 4, 4]:
        if step == 3:
            base.view(-1)[3:9].fill_(-1.0)  # the engine wrote into its buffer across both names
        stats = reshard.TransferStats()

        def rank(r: int, step: int = step, stats: reshard.TransferStats = stats) -> None:
            sessions[r].transfer(sources(r, step), layout(base) if r else {}, stats=stats if r else None)

        on_threads(2, rank, group=group)
        assert torch.equal(base, fresh(step)), f"sync {step}: {base.tolist()} != {fresh(step).tolist()}"
        received.append(stats.bytes_received)
    if not local:  # the delta still works: nothing changed, nothing travels
        assert received[0] == 2 * 8 * 4 and received[-1] == 0, received
    if case == "disjoint_strided":  # interleaved, sharing no element: x changed, x alone travels
        assert received[1] == 8 * 4, received


@pytest.mark.unit
def test_a_delta_into_tied_targets_writes_in_the_order_of_a_fresh_transfer() -> None:
    """The last writer of tied memory decides its bytes, so a delta must write the cells it resends in the
    order a fresh transfer writes them. Rounds of 32 bytes: a fresh transfer sends ``z`` (rank 0 to 2) in
    round 0, so rank 0's ``x`` for rank 3 waits for round 1 while rank 1's ``y`` comes in round 0: ``x``
    wins. A delta that only packed the cells it resends into rounds afresh would write ``x`` first."""
    group = ThreadGroup(4)
    sessions = [reshard.TransferSession(group=group.member(r), round_bytes=32) for r in range(4)]
    tied, z = torch.zeros(4, 2), torch.zeros(4, 2)

    def sources(r: int, step: int) -> dict[str, torch.Tensor]:
        x = torch.full((4, 2), 1.0 + 10 * (step >= 1))
        y = torch.full((4, 2), 2.0 + 10 * step)  # y changes at every step: x must be written after it
        return [{"z": torch.full((4, 2), 5.0), "x": x}, {"y": y}, {}, {}][r]

    def targets(r: int, tied: torch.Tensor) -> dict[str, torch.Tensor]:
        return [{}, {}, {"z": z}, {"x": tied, "y": tied}][r]

    for step in range(4):
        on_threads(4, lambda r, step=step: sessions[r].transfer(sources(r, step), targets(r, tied)), group=group)
        fresh = torch.zeros(4, 2)
        fresh_group = ThreadGroup(4)

        def one_off(r: int, step: int = step, fresh: torch.Tensor = fresh, group: ThreadGroup = fresh_group) -> None:
            reshard.transfer(sources(r, step), targets(r, fresh), group=group.member(r), round_bytes=32)

        on_threads(4, one_off, group=fresh_group)
        assert torch.equal(fresh, sources(0, step)["x"])  # x is written last
        assert torch.equal(tied, fresh), f"sync {step}: {tied[0].tolist()}, a fresh transfer {fresh[0].tolist()}"
