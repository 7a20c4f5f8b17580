"""Tensors a transfer cannot read or write, refused before any byte moves, with the same reshard error on
every rank; and tensors it can, that a session must handle as a one-off transfer does.

``reshard.transfer``, ``TransferSession.transfer`` and ``PeerMemoryCheckpoint.restore`` refuse, on every
rank and before the exchange: a source or target on the meta device (a model built under
``torch.device("meta")`` with a tensor left unmaterialised), an expanded target (elements that share
memory), two primaries of one box. A failure of one rank's own part is agreed on promptly (the error names
the rank and the cause), never left for the others to wait out. Conjugate and negative views (``x.conj()``,
``z.conj().imag``) travel as their values, in a session as in a one-off transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import reshard
from reshard.net.transports import ThreadGroup
from tests.rankpool import RankContext, RankPool
from tests.threads import on_threads

W = torch.arange(16.0).reshape(4, 4)
GARBAGE = 7.0


def _outcomes(size: int, run: Callable[[int, Any], Any], *, timeout: float = 60.0) -> list[BaseException | None]:
    """``run(rank, member)`` on the threads of a fresh group; each rank's exception (None: it returned).
    The timeout is long: a rank left waiting for a peer that already failed would show as a
    CommunicationError naming no cause, not as a slow test."""
    group = ThreadGroup(size, timeout=timeout)
    errors: list[BaseException | None] = [None] * size

    def rank(r: int) -> None:
        try:
            run(r, group.member(r))
        except reshard.CheckpointError as exc:
            errors[r] = exc

    on_threads(size, rank)
    return errors


def _same_error(errors: list[BaseException | None], cls: type[BaseException], *words: str) -> None:
    assert all(type(e) is cls for e in errors), [f"{type(e).__name__}: {e}" for e in errors]
    assert len({str(e) for e in errors}) == 1, [str(e) for e in errors]
    for word in words:
        assert word in str(errors[0]), str(errors[0])


def _one_off(source: Any, target: Any, member: Any) -> Any:
    return reshard.transfer(source, target, group=member, timeout=60)


def _session(source: Any, target: Any, member: Any) -> Any:
    session = reshard.TransferSession(group=member, timeout=60)
    session.transfer(source, target)
    return session.transfer(source, target)


FLOWS = {"transfer": _one_off, "session": _session}


# ---- a source on the meta device ---------------------------------------------------------------------------


def rank_meta_source(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 holds ``w`` on the meta device (and ``b``, real); ranks 2 and 3 want both."""
    source = {"w": torch.empty(4, 4, device="meta"), "b": torch.ones(4)} if ctx.rank == 0 else {}
    b = torch.full((4,), GARBAGE)
    target = {"w": torch.zeros(4, 4), "b": b} if ctx.rank >= 2 else {}
    try:
        reshard.transfer(source, target, timeout=60)
    except reshard.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "b_untouched": bool((b == GARBAGE).all())}
    return {"error": None}


@pytest.mark.dist
def test_a_meta_source_fails_every_rank_at_once_naming_the_rank_and_the_cause(pool4: RankPool) -> None:
    """Gloo ranks, a timeout of 60 s: the sender of a meta tensor cannot send it; every rank raises the same
    StateDictError naming rank 0, the key and the meta device, before any byte moved (not a
    CommunicationError naming no cause once the timeout ran out)."""
    results = pool4.run_ok(rank_meta_source)
    assert {r["error"] for r in results} == {"StateDictError"}, results
    assert len({r["message"] for r in results}) == 1, results
    message = results[0]["message"]
    assert "rank 0" in message and "'w'" in message and "meta device" in message, message
    assert results[2]["b_untouched"] and results[3]["b_untouched"]


@pytest.mark.unit
@pytest.mark.parametrize("flow", sorted(FLOWS))
def test_a_meta_source_in_a_session_or_a_transfer_fails_every_rank_alike(flow: str) -> None:
    def run(r: int, member: Any) -> None:
        source = {"w": torch.empty(4, 4, device="meta")} if r == 1 else {"v": torch.ones(2)} if r == 0 else {}
        FLOWS[flow](source, {"w": torch.zeros(4, 4), "v": torch.zeros(2)} if r == 2 else {}, member)

    _same_error(_outcomes(3, run), reshard.StateDictError, "rank 1", "'w'", "meta device")


class _Unreadable(torch.Tensor):
    """A tensor whose bytes cannot be copied in or out (its device was lost): a failure that no check
    before the exchange can see."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.Tensor.copy_ and any(isinstance(a, _Unreadable) for a in args[:2]):
            raise RuntimeError("the device holding it was lost")
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.unit
@pytest.mark.parametrize("side", ["source", "target"])
def test_a_rank_that_fails_inside_the_exchange_fails_every_rank_at_once(side: str) -> None:
    """A tensor that cannot be read into the send buffer (on rank 0) or written from the receive buffer (on
    rank 1), in the first of several rounds: the failing rank takes part in the remaining rounds, and every
    rank raises the same CheckpointError naming it and the cause, instead of its peers waiting out the
    timeout of 60 s for a round it never joined."""
    bad = torch.Tensor._make_subclass(_Unreadable, torch.zeros(64))

    def run(r: int, member: Any) -> None:
        w = bad if side == "source" else torch.arange(64.0)
        source = {"w": w, "v": torch.ones(64)} if r == 0 else {}
        target = {1: {"w": bad if side == "target" else torch.zeros(64)}, 2: {"v": torch.zeros(64)}}.get(r, {})
        reshard.transfer(source, target, group=member, timeout=60, round_bytes=64)

    failing = "rank 0" if side == "source" else "rank 1"
    _same_error(_outcomes(3, run), reshard.CheckpointError, failing, "the device holding it was lost")


# ---- a target on the meta device, an expanded target ---------------------------------------------------------


def _restore(source: Any, target: Any, member: Any) -> Any:
    tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=60)
    tier.save(source, group=member)
    return tier.restore(target, group=member)


@pytest.mark.unit
@pytest.mark.parametrize("flow", ["transfer", "session", "restore"])
@pytest.mark.parametrize("bad", ["meta", "expanded"])
def test_a_target_that_cannot_hold_the_bytes_is_refused_before_any_byte_moves(flow: str, bad: str) -> None:
    """Rank 1's target ``w`` is on the meta device (nothing to fill: a load refuses it) or expanded (its
    elements share memory); every rank raises the same StateDictError naming rank 1, the key and why,
    and nothing was written (rank 0's ``v`` is as it was)."""
    v = torch.full((2,), GARBAGE)

    def run(r: int, member: Any) -> None:
        source = {"w": reshard.ShardedTensor.from_rank_offsets("w", W[2 * r : 2 * r + 2].clone(), (0, r, 2))}
        source["v"] = reshard.ShardedTensor.from_rank_offsets("v", torch.ones(1), (0, r, 2))
        if r == 0:
            target = {"v": v}
        elif bad == "meta":
            target = {"w": torch.empty(4, 4, device="meta")}
        else:
            target = {"w": torch.zeros(4, 1).expand(4, 4)}
        if flow == "restore":
            _restore(source, target, member)
        else:
            FLOWS[flow](source, target, member)

    cause = "meta device" if bad == "meta" else "overlap in memory"
    _same_error(_outcomes(2, run), reshard.StateDictError, "rank 1", "'w'", cause)
    assert (v == GARBAGE).all()


# ---- conjugate and negative views ---------------------------------------------------------------------------

Z = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j], dtype=torch.complex64)
VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "complex": lambda z: z,
    "conj": lambda z: z.conj(),  # a lazily conjugated view: is_conj()
    "imag": lambda z: z.imag,  # a real, strided view
    "neg": lambda z: z.conj().imag,  # a negative view: is_neg()
}
PAIRS = [("conj", "complex"), ("complex", "conj"), ("conj", "conj"), ("neg", "imag"), ("imag", "neg"), ("neg", "neg")]


@pytest.mark.unit
@pytest.mark.parametrize("elements", [3, 1])
@pytest.mark.parametrize(("source_view", "target_view"), PAIRS)
def test_conjugate_and_negative_views_travel_as_their_values_in_a_session(
    source_view: str, target_view: str, elements: int
) -> None:
    """A session's sources and targets may be conjugate or negative views, as a one-off transfer's: each sync
    (the first, one with nothing changed, one after the source changed) leaves the target's values equal to
    the source's, and the one with nothing changed sends nothing. (One element: the view is contiguous.)"""
    group = ThreadGroup(2)
    sessions = [reshard.TransferSession(group=group.member(r)) for r in range(2)]
    held = Z[:elements].clone()
    target = VIEWS[target_view](torch.zeros(elements, dtype=torch.complex64))
    for step in range(3):
        if step == 2:
            held.mul_(2)
        source = VIEWS[source_view](held)
        stats = reshard.TransferStats()

        def rank(r: int, source: torch.Tensor = source, stats: reshard.TransferStats = stats) -> None:
            sessions[r].transfer(
                {"w": source} if r == 0 else {}, {"w": target} if r else {}, stats=stats if r else None
            )

        on_threads(2, rank, group=group)
        assert torch.equal(target.resolve_conj().resolve_neg(), source.resolve_conj().resolve_neg()), step
        assert (stats.bytes_received == 0) == (step == 1), (step, stats)


# ---- two primaries of one box -------------------------------------------------------------------------------


@pytest.mark.unit
def test_two_primaries_of_one_box_are_refused_on_every_rank() -> None:
    """Two ranks hold ``w`` as primaries (``replica_id`` 0 on both), with different bytes: which one a
    target gets would depend on the plan. Every rank raises ShardingError naming the key and the ranks, as a
    save does; replicas marked as such (or a plain tensor, a replica on every rank but rank 0) transfer."""

    def run(r: int, member: Any) -> None:
        source = {"w": reshard.ShardedTensor.from_rank_offsets("w", W + 100 * r)} if r < 2 else {}
        _one_off(source, {"w": torch.zeros(4, 4)} if r == 2 else {}, member)

    _same_error(_outcomes(3, run), reshard.ShardingError, "'w'", "ranks 0 and 1", "primar")
    out: list[Any] = [None] * 3

    def replicas(r: int, member: Any) -> None:
        source = {"w": reshard.ShardedTensor.from_rank_offsets("w", W.clone(), replica_id=r)} if r < 2 else {}
        source["p"] = W.clone()
        out[r] = _one_off(source, {"w": torch.zeros(4, 4), "p": torch.zeros(4, 4)} if r == 2 else {}, member)

    assert _outcomes(3, replicas) == [None] * 3
    assert torch.equal(out[2]["w"], W) and torch.equal(out[2]["p"], W)


@pytest.mark.unit
def test_two_leaves_of_one_box_on_one_rank_are_one_source() -> None:
    """A trainer with tied weights holds the same box of ``w`` under two paths (one key): it is kept once,
    as a save keeps it, not refused as two primaries."""
    group = ThreadGroup(2)
    out: list[Any] = [None, None]
    shared = reshard.ShardedTensor.from_rank_offsets("w", W.clone())

    def rank(r: int) -> None:
        source = {"embed": shared, "head": shared} if r == 0 else {}
        out[r] = reshard.transfer(source, {"w": torch.zeros(4, 4)} if r else {}, group=group.member(r))

    on_threads(2, rank, group=group)
    assert torch.equal(out[1]["w"], W)


# ---- a key map changed between syncs -------------------------------------------------------------------------


@pytest.mark.unit
def test_a_key_map_dict_changed_between_syncs_is_used_on_the_next() -> None:
    """The session reads a dict key map at every transfer, as it calls a function one: an entry changed
    on every rank between syncs takes effect (a new plan: everything is sent again), never the old map."""
    group = ThreadGroup(2)
    key_maps = [{"lm_head": "embed"}, {"lm_head": "embed"}]
    sessions = [reshard.TransferSession(group=group.member(r), key_map=key_maps[r]) for r in range(2)]
    head = torch.zeros(4, 4)
    held = {"embed": W, "out": -W}

    def sync() -> None:
        on_threads(2, lambda r: sessions[r].transfer(held if r == 0 else {}, {"lm_head": head} if r else {}))

    sync()
    assert torch.equal(head, W)
    for key_map in key_maps:
        key_map["lm_head"] = "out"  # the engine unties its output layer
    sync()
    assert torch.equal(head, -W)


@pytest.mark.unit
def test_two_different_sources_of_one_box_on_one_rank_are_refused_on_every_rank() -> None:
    """Issue 34: rank 0 holds two different tensors as the same box of ``w`` (paths ``embed`` and ``head``):
    which one a target got was undefined. Every rank raises the same ShardingError naming the key and both
    paths, and the target keeps its bytes."""
    target = torch.full((4, 4), GARBAGE)

    def run(r: int, member: Any) -> None:
        source = {
            "embed": reshard.ShardedTensor.from_rank_offsets("w", W),
            "head": reshard.ShardedTensor.from_rank_offsets("w", -W),
        }
        _one_off(source if r == 0 else {}, {"w": target} if r else {}, member)

    _same_error(_outcomes(2, run), reshard.ShardingError, "'w'", "'embed'", "'head'")
    assert torch.equal(target, torch.full((4, 4), GARBAGE))
