"""Phase 3 of :func:`reshard.load`: planning the reads, one collective step (two after a miss of the plan cache).

Each rank describes its template (a failure of :func:`~reshard.flows.load_phases.match_template` on any rank fails
the step on every rank); the coordinator checks that no source entry goes unused where the source refuses that, and
that the object grids agree. Then the :class:`Planner`'s choice:

- **each rank reads its own pieces** (no ``read_once``): the step is a gather and a broadcast of the verdict; each
  rank plans its own reads (:func:`reshard.planning.load_plan.plan_load`);
- **read once** (``LoadOptions(read_once=...)`` in effect): each rank sends its *needs* (its target pieces,
  :func:`~reshard.io.exchange.describe_need`), the coordinator schedules who reads which cell and who sends it to
  whom (:func:`reshard.planning.exchange.schedule_reads`) and scatters each rank its part;
- **read once, reusing the schedule** (the same with a :class:`~reshard.flows.plan_cache.ReadPlanCache`, as a
  :class:`~reshard.CheckpointManager`'s loads have, and ``LoadOptions(reuse_plan=True)``): each rank sends only the
  SHA-256 of its needs (with its rank and the group's size: :func:`~reshard.planning.layouts.layout_fingerprint`);
  the coordinator looks the fingerprints and the exchange's sizes up (in memory, else the needs in the manager's
  root, scheduled again) and scatters the schedules it holds: no needs gathered, no second step. On a miss the
  answer says so and a second step, ``load planning (needs)``, gathers the needs and schedules as without a cache,
  and the coordinator keeps the result.

Who reads what is only ever decided by the coordinator, inside an agreed step; a rank acts on nothing else. A
failure anywhere raises the same error on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Any

from reshard.errors import CheckpointError, MismatchError
from reshard.flows.load_phases import Agreed, LoadContext, Matched, Outcome, ReadPlan, attempt
from reshard.flows.plan_cache import ReadPlanCache, ScheduleKey
from reshard.geometry.boxes import Box
from reshard.io.exchange import cell_view, describe_need
from reshard.io.reader import ReadBudget
from reshard.io.sources import CheckpointSource
from reshard.metadata import Metadata
from reshard.planning.exchange import MIN_SLAB_BYTES, CellRef, RankSchedule, schedule_reads
from reshard.planning.layouts import READ_PLANS, layout_fingerprint, needs_bytes
from reshard.planning.load_plan import DEFAULT_MAX_READ_AMPLIFICATION, TargetPiece, plan_load

__all__ = ["LocalPlan", "Planner", "check_object_grids", "check_unused", "plan_reads"]

SHARED, PLAIN, MISS = "shared", "plain", "miss"
"""The coordinator's verdict of a planning step: schedules scattered, each rank reads its own pieces, or (reusing
schedules) the fingerprints were not found and the needs are gathered next."""


@dataclass(frozen=True)
class Planner:
    """How the reads of a load are planned, the same on every rank. Without ``read_once`` each rank reads
    its own pieces; with it the coordinator schedules one reader per shared cell, exchanging in rounds of at
    most ``round_bytes`` and slabs of at least ``min_slab_bytes``. ``refuses_unused``: the source refuses
    entries that no rank's template uses (safetensors), so the coordinator needs every rank's keys.
    ``plans``: reading once, the cache whose schedules may be reused (None: none is)."""

    read_once: bool
    round_bytes: int
    min_slab_bytes: int
    refuses_unused: bool
    plans: ReadPlanCache | None = None

    @classmethod
    def of(cls, agreed: Agreed, ctx: LoadContext) -> Planner:
        """The planner of a load: the exchange's round is half the smallest budget (the send and the
        receive buffers live together; the read buffers are released by then). The cache is used where every
        rank passes one and ``LoadOptions(reuse_plan=True)`` (agreed in the first step)."""
        reuse = agreed.read_once and ctx.options.reuse_plan and ctx.plans is not None
        return cls(
            read_once=agreed.read_once,
            round_bytes=max(4096, agreed.budget // 2),
            min_slab_bytes=max(MIN_SLAB_BYTES, agreed.metadata.checksum_chunk_bytes),
            refuses_unused=ctx.source.refuses_unused,
            plans=ctx.plans if reuse else None,
        )

    def describe(self, matched: Matched, needs: list[list[Any]] | None, *, rank: int, world: int) -> dict[str, Any]:
        """What this rank sends the coordinator: its object grids, its keys (where the source refuses unused
        entries) and, reading once, its needs, or their fingerprint where the schedule may be reused."""
        reusing = self.plans is not None and needs is not None
        return {
            "grids": {key: list(grid) for key, grid in matched.grids},
            "keys": sorted(set(matched.keys)) if self.refuses_unused else None,
            "needs": None if reusing else needs,
            "fingerprint": layout_fingerprint(needs_bytes(needs), rank=rank, world=world, kind=READ_PLANS)
            if reusing and needs is not None
            else None,
        }

    def schedules(self, needs: list[list[list[Any]]]) -> tuple[bytes, ...] | None:
        """On the coordinator: every rank's read-once schedule (encoded as it is scattered), or None when
        nothing is needed by more than one rank (each rank reads its own pieces)."""
        schedules = schedule_reads(needs, round_bytes=self.round_bytes, min_slab_bytes=self.min_slab_bytes)
        if not any(s.shared for s in schedules):
            return None
        return tuple(json.dumps(s.to_json()).encode() for s in schedules)

    def schedules_of_encoded(self, needs: list[bytes]) -> tuple[bytes, ...] | None:
        """:meth:`schedules` of needs as :func:`~reshard.planning.layouts.needs_bytes` encodes them."""
        return self.schedules([json.loads(n) for n in needs])

    def key(self, fingerprints: tuple[str, ...]) -> ScheduleKey:
        return ScheduleKey(fingerprints, self.round_bytes, self.min_slab_bytes)


def _verdict(schedules: tuple[bytes, ...] | None, size: int) -> tuple[str, list[bytes]]:
    return (PLAIN, [b""] * size) if schedules is None else (SHARED, list(schedules))


def check_unused(source: CheckpointSource, keys_per_rank: list[list[str] | None]) -> None:
    """On the coordinator: the source's entries no rank's template uses, an error where it refuses them."""
    if not source.refuses_unused:
        return
    unused = source.unused_entries({key for keys in keys_per_rank for key in keys or ()})
    if unused:
        shown = ", ".join(repr(name) for name in unused[:20])
        raise MismatchError(
            f"{source.describe()}: {len(unused)} tensors of the source are used by no template key of this "
            f"load: {shown}{' ...' if len(unused) > 20 else ''} (a key map that does not fit the checkpoint? "
            "pass allow_unused=True to the source to load a part of it)"
        )


def check_object_grids(grids_per_rank: list[dict[str, list[int]]]) -> None:
    """On the coordinator: every rank's template gives each per-rank object the same grid (its global shape),
    else a :class:`~reshard.MismatchError` naming the ranks' grids (an ``object_grid`` policy is applied to one
    grid, the same for every rank)."""
    seen: dict[str, dict[tuple[int, ...], list[int]]] = {}
    for rank, grids in enumerate(grids_per_rank):
        for key, grid in grids.items():
            seen.setdefault(key, {}).setdefault(tuple(grid), []).append(rank)
    for key, by_grid in sorted(seen.items()):
        if len(by_grid) > 1:
            shown = "; ".join(f"{list(grid)} on ranks {ranks}" for grid, ranks in by_grid.items())
            raise MismatchError(f"object {key!r}: the ranks' templates give it different grids: {shown}")


def _check_all_unused(source: CheckpointSource, docs: list[dict[str, Any]]) -> None:
    """The coordinator's part of a planning step without a schedule: the object grids agree, and no source
    entry goes unused where the source refuses that."""
    check_object_grids([d["grids"] for d in docs])
    check_unused(source, [d["keys"] for d in docs])


def _own_reads(ctx: LoadContext, metadata: Metadata, matched: Matched, schedule: RankSchedule | None) -> ReadPlan:
    """The plan of the cells this rank reads: its scheduled ones, or all its pieces."""
    refs: list[CellRef]
    if schedule is None:
        refs = [[i, list(p.box.offset), list(p.box.shape)] for i, p in enumerate(matched.pieces)]
    else:
        refs = schedule.reads
    boxes = tuple(Box(tuple(ref[1]), tuple(ref[2])) for ref in refs)
    views = tuple(matched.pieces[ref[0]].view if schedule is None else cell_view(matched.pieces, ref) for ref in refs)
    on_device = any(view.device.type != "cpu" for view in views)
    # Staged loads read local copies; otherwise the storage says what a request costs.
    request_cost = 0 if ctx.options.staging is not None else ctx.source.storage.request_cost_bytes
    amplification = ctx.options.max_read_amplification
    if amplification is None and request_cost == 0:
        amplification = DEFAULT_MAX_READ_AMPLIFICATION
    plan = plan_load(
        metadata,
        [TargetPiece(key=matched.keys[ref[0]], box=box) for ref, box in zip(refs, boxes, strict=True)],
        max_read_amplification=amplification,
        max_read_bytes=ReadBudget.of(ctx.options.memory_budget_bytes, device=on_device).max_read_bytes,
        request_cost_bytes=request_cost,
    )
    return ReadPlan(plan, views, boxes, schedule, on_device, metadata)


def _combine_plans(source: CheckpointSource, planner: Planner, payloads: list[bytes]) -> tuple[str, list[bytes]]:
    """The coordinator's part of a read-once planning step without reuse: check unused entries, then schedule."""
    docs = [json.loads(p) for p in payloads]
    _check_all_unused(source, docs)
    return _verdict(planner.schedules([d["needs"] for d in docs]), len(docs))


@dataclass(frozen=True)
class LocalPlan:
    """This rank's part of the planning step: what it sends (``description``), the plan of its own pieces where
    nothing is scheduled, else the metadata to plan its scheduled cells with (``own``), and, reusing schedules, its
    needs encoded (sent only after a miss)."""

    description: dict[str, Any]
    own: ReadPlan | Metadata
    needs: bytes = b""


def _local_plan(ctx: LoadContext, metadata: Metadata, planner: Planner, matched: Outcome[Matched]) -> LocalPlan:
    """This rank's part of the planning step: its description and, unless the coordinator may schedule its
    reads, the plan of its own pieces, else the metadata to plan them with (the parts of partitioned metadata
    that this rank's keys need are read here, inside the step, so that a failure is agreed on)."""
    mine = matched.get()
    metadata = ctx.source.complete_metadata(metadata, set(mine.keys))  # the parts this rank's keys need
    comm = ctx.comm
    if not planner.read_once:
        return LocalPlan(
            planner.describe(mine, None, rank=comm.rank, world=comm.size), _own_reads(ctx, metadata, mine, None)
        )
    needs = [describe_need(k, p) for k, p in zip(mine.keys, mine.pieces, strict=True)]
    described = planner.describe(mine, needs, rank=comm.rank, world=comm.size)
    return LocalPlan(described, metadata, needs_bytes(needs) if planner.plans is not None else b"")


def _description(local: Outcome[LocalPlan]) -> dict[str, Any]:
    return local.get().description


def _encoded(local: Outcome[LocalPlan]) -> bytes:
    return json.dumps(local.get().description).encode()


def _fingerprints(docs: list[dict[str, Any]]) -> tuple[str, ...]:
    """The needs' fingerprints the ranks offered, in rank order.

    Raises:
        CheckpointError: a rank offered none, or a malformed one.
    """
    found = tuple(d.get("fingerprint") for d in docs)
    for rank, fingerprint in enumerate(found):
        if not isinstance(fingerprint, str) or len(fingerprint) != 64:
            raise CheckpointError(f"rank {rank} offered no fingerprint of its needs ({fingerprint!r})")
    return found  # type: ignore[return-value]


@dataclass
class _Missed:
    """On the coordinator, between the two steps of a miss: what it looked up, then what it scheduled."""

    key: ScheduleKey | None = None
    stored: tuple[tuple[bytes, ...] | None, tuple[bytes, ...]] | None = None


def _reusing(
    ctx: LoadContext, planner: Planner, plans: ReadPlanCache, local: Outcome[LocalPlan]
) -> tuple[str, bytes, bool]:
    """The planning steps of a load that may reuse its schedule, called by every rank: ``load planning`` (the
    fingerprints gathered, each rank's schedule scattered on a hit), after a miss ``load planning (needs)`` (the
    needs gathered, scheduled, scattered; the coordinator keeps the schedules, and a manager's cache the needs in
    its root). Returns the verdict (:data:`SHARED` or :data:`PLAIN`, the same on every rank), this rank's
    encoded schedule, and whether it came from the cache."""
    comm, clock = ctx.comm, ctx.clock
    missed = _Missed()

    def offered(payloads: list[bytes]) -> tuple[str, list[bytes]]:
        docs = [json.loads(p) for p in payloads]
        _check_all_unused(ctx.source, docs)
        missed.key = planner.key(_fingerprints(docs))
        found, schedules = plans.lookup(missed.key, planner.schedules_of_encoded)
        return _verdict(schedules, len(docs)) if found else (MISS, [b""] * len(docs))

    verdict, reply = comm.step_scatter(
        "load planning", functools.partial(_encoded, local), clock.timed("plan", offered)
    )
    if verdict != MISS:
        return verdict, reply, True

    def gathered(needs: list[bytes]) -> tuple[str, list[bytes]]:
        schedules = planner.schedules_of_encoded(needs)
        missed.stored = (schedules, tuple(needs))
        return _verdict(schedules, len(needs))

    def own_needs() -> bytes:
        return local.get().needs

    verdict, reply = comm.step_scatter("load planning (needs)", own_needs, clock.timed("plan", gathered))
    if missed.key is not None and missed.stored is not None:
        with clock.phase("plan"):
            plans.store(missed.key, *missed.stored)
    return verdict, reply, False


def plan_reads(ctx: LoadContext, agreed: Agreed, matched: Outcome[Matched]) -> ReadPlan:
    """Phase 3 (see the module doc), called by every rank: one collective step, or two after a miss of the plan
    cache; each rank then has the plan of its own reads (``ReadPlan.reused``: its schedule came from the cache)."""
    comm, clock = ctx.comm, ctx.clock
    planner = Planner.of(agreed, ctx)
    reused = False
    with clock.exchange():
        with clock.phase("plan"):
            local = attempt(_local_plan, ctx, agreed.metadata, planner, matched)
        if planner.plans is not None:
            verdict, reply, reused = _reusing(ctx, planner, planner.plans, local)
        elif planner.read_once:
            combine = functools.partial(_combine_plans, ctx.source, planner)
            verdict, reply = comm.step_scatter("load planning", functools.partial(_encoded, local), combine)
        else:
            verdict, reply = PLAIN, b""
            comm.step(
                "load planning",
                functools.partial(_description, local),
                functools.partial(_check_all_unused, ctx.source),
            )
    with clock.phase("plan"):
        own = local.get().own
        if isinstance(own, ReadPlan):
            return own
        schedule = RankSchedule.from_json(json.loads(reply)) if verdict == SHARED else None
        return dataclasses.replace(_own_reads(ctx, own, matched.get(), schedule), reused=reused)
