"""Phase 2 of a save that may reuse its plan (``SaveOptions(reuse_plan=True)`` with a
:class:`~reshard.flows.plan_cache.PlanCache`): two phases of one collective each, :func:`offer_layout` then
:func:`plan_layouts`, in place of :func:`reshard.flows.save_phases.plan` (the planner choice of
:func:`reshard.flows.save.run_phases`).

1. :func:`offer_layout`, ``save planning`` (every rank, one collective: gather, scatter): each rank sends an offer,
   the fingerprint of its layout and the small context whose terms must agree (:mod:`reshard.planning.layouts`),
   never its description. The coordinator checks the terms agree and looks the fingerprints (in rank order, so the
   group's size and every rank's position are in the key) up in its cache. On a hit it reuses the cached
   description table and writer election (no decoding, no tiling validation, no election) and does what every save
   does (:func:`~reshard.flows.save_phases.settle_plan`: a new save id, the incremental base matched again on the
   cached table, the save lock, the reference markers), and each rank gets its assignment.
2. :func:`plan_layouts`: after a hit, nothing (no collective). On a miss (no cache, any rank's layout differs, a
   restart whose file does not hold this layout) the first answer said so and every rank runs ``save planning
   (layouts)`` (gather, scatter): the layouts are gathered, the coordinator plans as a save without a cache does,
   and stores the plan (with the layouts, in a manager's root).

Every failure is agreed on as in any step: the coordinator's decision is the only thing a rank acts on, and a rank
uses nothing it did not send or receive in an agreed step. A save whose ranks disagree on ``reuse_plan`` fails on
every rank, naming the term, in the first step.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from reshard.errors import CheckpointError
from reshard.flows.plan_cache import CachedPlan
from reshard.flows.save_phases import (
    CoordinatorPlan,
    Described,
    Planned,
    SaveRequest,
    check_agreement,
    check_offers_agree,
    kept_step,
    settle_plan,
)
from reshard.flows.stats import PhaseClock
from reshard.net.comm import Communicator
from reshard.planning.descriptions import DescriptionTable, WriteAssignment
from reshard.planning.layouts import encode_offer, is_description, layout_fingerprint, read_offer
from reshard.planning.save_plan import plan_save_table
from reshard.planning.scaled import agree_scaled

__all__ = ["FirstStep", "Offered", "Replanned", "decide_offers", "offer_layout", "plan_layouts", "replan_layouts"]

logger = logging.getLogger("reshard")


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class FirstStep:
    """What the coordinator keeps from the first step: the plan on a hit (None on a miss), the agreed contexts and
    fingerprints (for the second step)."""

    plan: CoordinatorPlan | None
    contexts: tuple[object, ...]
    fingerprints: tuple[str, ...]

    def undo(self) -> None:
        if self.plan is not None:
            self.plan.undo()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Replanned:
    """What the coordinator keeps from the second step: the plan, and what the cache stores of it."""

    plan: CoordinatorPlan
    cached: CachedPlan
    layouts: tuple[bytes, ...]

    def undo(self) -> None:
        self.plan.undo()


def decide_offers(request: SaveRequest, payloads: list[bytes], *, rank: int) -> FirstStep:
    """The coordinator's part of the first step, no collective: read the offers, check the terms agree, look the
    layout up; on a hit, settle the plan (lock taken).

    Raises:
        CheckpointError (and what :func:`~reshard.flows.save_phases.settle_plan` raises): nothing is written.
    """
    if any(map(is_description, payloads)):
        check_offers_agree(payloads)
    try:
        offers = [read_offer(p) for p in payloads]
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"a rank sent a malformed layout offer: {exc}") from exc
    contexts = [o.context for o in offers]
    check_agreement(contexts)
    fingerprints = tuple(o.fingerprint for o in offers)
    cached = request.plans.lookup(fingerprints) if request.plans is not None else None
    if cached is None:
        logger.debug("[rank=%d] save planning: a layout not planned before: gathering the layouts", rank)
        return FirstStep(plan=None, contexts=tuple(contexts), fingerprints=fingerprints)
    scaled = agree_scaled(cached.table, contexts)
    made = settle_plan(request, cached.table, list(cached.assignments), scaled, save_id=uuid.uuid4().hex, rank=rank)
    return FirstStep(plan=made, contexts=tuple(contexts), fingerprints=fingerprints)


def replan_layouts(request: SaveRequest, first: FirstStep, layouts: list[bytes], *, rank: int) -> Replanned:
    """The coordinator's part of the second step, no collective: decode the layouts, validate the tiling and elect
    the writers (as a save without a cache), then settle the plan.

    Raises:
        ShardingError, CheckpointError (and what :func:`~reshard.flows.save_phases.settle_plan` raises).
    """
    table = DescriptionTable.from_wire(layouts)[0]
    scaled = agree_scaled(table, list(first.contexts))
    assignments = plan_save_table(table)
    made = settle_plan(request, table, list(assignments), scaled, save_id=uuid.uuid4().hex, rank=rank)
    cached = CachedPlan(table=table, assignments=tuple(assignments))
    return Replanned(plan=made, cached=cached, layouts=tuple(layouts))


def _undo(made: FirstStep | Replanned | None) -> None:
    """After a failed step: release what the coordinator's plan took (nothing when it made none)."""
    if made is not None:
        made.undo()


def _sent(made: CoordinatorPlan | None, size: int) -> tuple[str | None, list[bytes]]:
    if made is None:
        return None, [b""] * size
    return made.save_id, [a.to_bytes() for a in made.assignments]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Offered:
    """The first step's result on one rank: on a hit, the plan (``planned``); on a miss, None, and on the coordinator
    what it kept for the second step (``first``)."""

    planned: Planned | None
    first: FirstStep | None = None


def offer_layout(comm: Communicator, request: SaveRequest, described: Described, clock: PhaseClock) -> Offered:
    """Phase 2a, one collective (``save planning``: gather the offers, scatter the assignments) called by every rank
    of ``comm``: on a hit every rank has its assignment. A failure anywhere raises on every rank, and the coordinator
    releases what planning took."""

    def offer() -> bytes:
        if described.error is not None:
            raise described.error
        fingerprint = layout_fingerprint(described.layout, rank=comm.rank, world=comm.size)
        return encode_offer(fingerprint, described.context)

    def first(payloads: list[bytes]) -> tuple[FirstStep, tuple[str | None, list[bytes]]]:
        made = decide_offers(request, payloads, rank=comm.rank)
        return made, _sent(made.plan, comm.size)

    undo: Callable[[FirstStep | None], None] = _undo
    with clock.exchange():
        (save_id, mine), kept = kept_step(
            lambda combine: comm.step_scatter("save planning", clock.timed("plan", offer), combine),
            clock.timed("plan", first),
            undo=undo,
        )
    if save_id is None:
        return Offered(planned=None, first=kept)
    logger.debug("[rank=%d] save %s: the plan of this layout is reused", comm.rank, save_id)
    coordinator = kept.plan if kept is not None else None
    return Offered(
        planned=Planned(save_id=str(save_id), assignment=WriteAssignment.from_bytes(mine), coordinator=coordinator)
    )


def plan_layouts(
    comm: Communicator, request: SaveRequest, described: Described, clock: PhaseClock, offered: Offered
) -> Planned:
    """Phase 2b, after a miss one collective (``save planning (layouts)``: gather the layouts, scatter the
    assignments) called by every rank of ``comm``; after a hit, the plan of phase 2a (no collective). The coordinator
    stores what it planned in its cache."""
    if offered.planned is not None:
        return offered.planned
    first = offered.first

    def decide(layouts: list[bytes]) -> tuple[Replanned, tuple[str | None, list[bytes]]]:
        if first is None:
            raise CheckpointError("the coordinator has no first planning step (it did not run here)")
        made = replan_layouts(request, first, layouts, rank=comm.rank)
        return made, _sent(made.plan, comm.size)

    undo: Callable[[Replanned | None], None] = _undo
    with clock.exchange():
        (save_id, mine), kept = kept_step(
            lambda combine: comm.step_scatter(
                "save planning (layouts)", clock.timed("plan", lambda: described.layout), combine
            ),
            clock.timed("plan", decide),
            undo=undo,
        )
    if kept is not None and first is not None and request.plans is not None:
        with clock.phase("plan"):
            request.plans.store(first.fingerprints, kept.cached, kept.layouts)
    return Planned(
        save_id=str(save_id),
        assignment=WriteAssignment.from_bytes(mine),
        coordinator=kept.plan if kept is not None else None,
    )
