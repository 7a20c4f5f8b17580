"""The phases of a load (:mod:`reshard.flows.load_phases`), one at a time, on in-process ranks
(:class:`~reshard.net.transports.ThreadGroup`) over a checkpoint in ``tmp_path``."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

import reshard
from reshard.errors import CheckpointError, CorruptCheckpointError, MismatchError, StateDictError
from reshard.flows.load_phases import (
    Agreed,
    Exchanged,
    LoadContext,
    Matched,
    Outcome,
    ReadPlan,
    Staged,
    attempt,
    exchange,
    map_back,
    match_template,
    read,
    read_metadata_once,
    stage,
    verify,
)
from reshard.flows.load_planning import Planner, plan_reads
from reshard.flows.stats import PhaseClock
from reshard.io.sources import as_source
from reshard.net.comm import Communicator
from reshard.net.transports import ThreadGroup
from reshard.planning.load_plan import LoadPlan
from tests.threads import on_threads

pytestmark = pytest.mark.unit

T = TypeVar("T")
FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
SHORT = torch.arange(5 * 6, dtype=torch.float32).reshape(5, 6) + 100  # saved unpadded, loaded padded to 6 rows


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("load_phases") / "ckpt"
    state = {
        "w": FULL,
        "v": SHORT,
        "rng": reshard.ShardedObject("rng", {"seed": 7}, (1,), (0,)),
        "step": 3,
    }
    reshard.save(state, path, options=reshard.SaveOptions(fingerprint=True, checksum_chunk_bytes=64))
    return path


def _context(path: Path, group: ThreadGroup, rank: int, *, strict: bool = True, **options: Any) -> LoadContext:
    comm = Communicator(group.member(rank))
    return LoadContext(
        as_source(path, None), comm, reshard.LoadOptions(**options), strict, PhaseClock("load", rank, 0.0)
    )


def _ranks(size: int, run: Callable[[ThreadGroup, int], T], *, timeout: float = 20.0) -> list[T]:
    group = ThreadGroup(size, timeout=timeout)
    return on_threads(size, lambda rank: run(group, rank), group=group)


def _rows(rank: int, parts: int) -> dict[str, Any]:
    rows = 8 // parts
    return {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(rows, 6), (0, rank, parts))}


def _matched(ctx: LoadContext, agreed: Agreed, template: Any) -> Outcome[Matched]:
    return attempt(
        match_template, template, agreed.metadata, rank=ctx.comm.rank, strict=ctx.strict, options=ctx.options
    )


# ---- 1. read_metadata_once ---------------------------------------------------------------------------------


def test_every_rank_gets_the_coordinators_metadata_and_the_smallest_budget(ckpt: Path) -> None:
    budgets = [64 << 20, 48 << 20, 96 << 20]

    def run(group: ThreadGroup, rank: int) -> Agreed:
        return read_metadata_once(_context(ckpt, group, rank, memory_budget_bytes=budgets[rank]))

    agreed = _ranks(3, run)
    assert all(a.metadata == reshard.read_metadata(ckpt) for a in agreed)
    assert {(a.read_once, a.budget) for a in agreed} == {(False, 48 << 20)}  # local files: no read-once


def test_read_once_on_request_is_agreed_by_every_rank(ckpt: Path) -> None:
    agreed = _ranks(2, lambda group, rank: read_metadata_once(_context(ckpt, group, rank, read_once=True)))
    assert [a.read_once for a in agreed] == [True, True]


def test_no_metadata_on_the_coordinator_fails_every_rank(tmp_path: Path) -> None:
    errors: list[str] = []

    def run(group: ThreadGroup, rank: int) -> None:
        try:
            read_metadata_once(_context(tmp_path, group, rank))
        except CheckpointError as exc:
            errors.append(type(exc).__name__)

    _ranks(2, run)
    assert len(errors) == 2  # the others do not wait for a broadcast that never comes


# ---- 2. match_template -------------------------------------------------------------------------------------


def _metadata(ckpt: Path) -> reshard.Metadata:
    return reshard.read_metadata(ckpt)


def test_a_partial_template_with_strict_off_names_what_is_missing(ckpt: Path) -> None:
    template = {
        "w": torch.zeros(8, 6),
        "gone": torch.zeros(2),
        "extra": reshard.ShardedObject("extra", None, (2,), (1,)),
        "opt": {"lr": 0.1},
    }
    before = copy.copy(template)
    matched = match_template(template, _metadata(ckpt), rank=0, strict=False, options=reshard.LoadOptions())
    assert matched.missing == ("tensor 'gone'", "object 'extra' at [1]", "common value 'opt.lr'")
    assert matched.keys == ("w",) and [t.key for t in matched.tensors] == ["w"] and matched.objects == ()
    assert template == before and all(template[k] is before[k] for k in template)  # the argument is unchanged


def test_a_missing_key_is_an_error_when_strict(ckpt: Path) -> None:
    with pytest.raises(MismatchError, match="gone"):
        match_template({"gone": torch.zeros(2)}, _metadata(ckpt), rank=0, strict=True, options=reshard.LoadOptions())


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ({"w": torch.zeros(8, 5)}, MismatchError),  # another global shape
        ({"w": torch.zeros(8, 6, dtype=torch.int32)}, MismatchError),  # a lossy cast not allowed
        ({"w": torch.zeros(8, 6, device="meta")}, StateDictError),  # nothing to fill
        ({"w": torch.zeros(6, 8).t()}, None),  # strided views are fine
    ],
    ids=["shape", "dtype", "meta", "strided"],
)
def test_hostile_templates_are_refused_before_any_read(ckpt: Path, template: Any, error: type | None) -> None:
    def match() -> Matched:
        return match_template(template, _metadata(ckpt), rank=0, strict=True, options=reshard.LoadOptions())

    if error is None:
        assert match().keys == ("w",)
    else:
        with pytest.raises(error):
            match()


def test_pieces_of_a_padded_template_are_clipped_to_the_saved_shape(ckpt: Path) -> None:
    tail = reshard.ShardedTensor.from_rank_offsets("v", torch.ones(3, 6), (0, 1, 2), logical_shape=(5, 6))
    matched = match_template({"v": tail}, _metadata(ckpt), rank=1, strict=True, options=reshard.LoadOptions())
    (piece,) = matched.pieces
    assert (piece.box.offset, piece.box.shape) == ((3, 0), (2, 6)) and piece.padded_view is not None


# ---- 3. plan_reads -----------------------------------------------------------------------------------------


def test_without_read_once_each_rank_plans_its_own_pieces(ckpt: Path) -> None:
    def run(group: ThreadGroup, rank: int) -> ReadPlan:
        ctx = _context(ckpt, group, rank)
        agreed = read_metadata_once(ctx)
        return plan_reads(ctx, agreed, _matched(ctx, agreed, _rows(rank, 2)))

    plans = _ranks(2, run)
    assert all(p.schedule is None for p in plans)
    assert [(b.offset, b.shape) for p in plans for b in p.boxes] == [((0, 0), (4, 6)), ((4, 0), (4, 6))]
    assert [p.plan.bytes_needed for p in plans] == [4 * 6 * 4, 4 * 6 * 4]


def test_with_read_once_replicas_share_the_reads(ckpt: Path) -> None:
    def run(group: ThreadGroup, rank: int) -> ReadPlan:
        ctx = _context(ckpt, group, rank, read_once=True)
        agreed = read_metadata_once(ctx)
        return plan_reads(ctx, agreed, _matched(ctx, agreed, {"w": torch.zeros(8, 6)}))

    plans = _ranks(2, run)
    assert all(p.schedule is not None and p.schedule.shared for p in plans)
    assert sum(b.volume for p in plans for b in p.boxes) == FULL.numel()  # each needed element read once
    assert len({len(p.schedule.rounds) for p in plans if p.schedule}) == 1


def test_read_once_without_anything_shared_plans_as_a_plain_load(ckpt: Path) -> None:
    def run(group: ThreadGroup, rank: int) -> ReadPlan:
        ctx = _context(ckpt, group, rank, read_once=True)
        agreed = read_metadata_once(ctx)
        return plan_reads(ctx, agreed, _matched(ctx, agreed, _rows(rank, 2)))

    plans = _ranks(2, run)
    assert [p.schedule for p in plans] == [None, None] and [len(p.boxes) for p in plans] == [1, 1]


@pytest.mark.parametrize("read_once", [False, True])
def test_a_template_refused_on_one_rank_fails_the_planning_step_on_every_rank(ckpt: Path, read_once: bool) -> None:
    errors: dict[int, str] = {}

    def run(group: ThreadGroup, rank: int) -> None:
        ctx = _context(ckpt, group, rank, read_once=read_once)
        agreed = read_metadata_once(ctx)
        template = {"w": torch.zeros(8, 5 if rank == 1 else 6)}
        try:
            plan_reads(ctx, agreed, _matched(ctx, agreed, template))
        except CheckpointError as exc:
            errors[rank] = str(exc)

    _ranks(2, run)
    assert sorted(errors) == [0, 1] and all("rank 1" in message for message in errors.values())


def test_the_planner_schedules_only_what_something_shares() -> None:
    once = Planner(read_once=True, round_bytes=4096, min_slab_bytes=64, refuses_unused=False)
    shared = [[["w", [0], [8], "float32"]]] * 2
    apart = [[["w", [0], [4], "float32"]], [["w", [4], [4], "float32"]]]
    assert once.schedules(apart) is None
    schedules = once.schedules(shared)
    assert schedules is not None and [json.loads(s)["shared"] for s in schedules] == [True, True]


# ---- 4.-6. stage, read, exchange ---------------------------------------------------------------------------


def test_without_staging_stage_is_nothing(ckpt: Path) -> None:
    def run(group: ThreadGroup, rank: int) -> Staged:
        ctx = _context(ckpt, group, rank)
        agreed = read_metadata_once(ctx)
        matched = _matched(ctx, agreed, _rows(rank, 1))
        return stage(ctx, agreed.metadata, matched.get(), plan_reads(ctx, agreed, matched))

    assert _ranks(1, run) == [Staged(None)]


def test_exchange_without_a_schedule_is_a_no_op_without_collectives(ckpt: Path) -> None:
    group = ThreadGroup(2, timeout=2.0)  # rank 1 never takes part: a collective would time out
    ctx = _context(ckpt, group, 0)
    matched = match_template(_rows(0, 2), _metadata(ckpt), rank=0, strict=True, options=ctx.options)
    planned = ReadPlan(
        plan=LoadPlan(items=()), views=(), boxes=(), schedule=None, on_device=False, metadata=_metadata(ckpt)
    )
    assert exchange(ctx, matched, planned) == Exchanged(0, 0, 0)


@pytest.mark.parametrize("read_once", [False, True])
def test_read_then_exchange_fill_every_rank(ckpt: Path, read_once: bool) -> None:
    def run(group: ThreadGroup, rank: int) -> tuple[torch.Tensor, Exchanged, dict[Any, object]]:
        ctx = _context(ckpt, group, rank, read_once=read_once)
        agreed = read_metadata_once(ctx)
        template = {"w": torch.zeros(8, 6), "rng": reshard.ShardedObject("rng", None, (1,), (0,))}
        matched = _matched(ctx, agreed, template)
        planned = plan_reads(ctx, agreed, matched)
        done = read(ctx, agreed.metadata, matched.get(), planned, Staged(None))
        return template["w"], exchange(ctx, matched.get(), planned), dict(done.objects)

    results = _ranks(2, run)
    assert all(torch.equal(w, FULL) for w, _, _ in results)
    assert all(objects == {("rng", (0,)): {"seed": 7}} for _, _, objects in results)
    moved = [x for _, x, _ in results]
    if read_once:
        assert sum(x.bytes_sent for x in moved) == sum(x.bytes_received for x in moved) == FULL.numel() * 4
        assert moved[0].rounds == moved[1].rounds > 0
    else:
        assert moved == [Exchanged(), Exchanged()]


def test_a_failed_read_on_one_rank_fails_every_rank(ckpt: Path, tmp_path: Path) -> None:
    errors: list[int] = []

    def run(group: ThreadGroup, rank: int) -> None:
        ctx = _context(ckpt, group, rank)
        agreed = read_metadata_once(ctx)
        matched = _matched(ctx, agreed, _rows(rank, 2))
        planned = plan_reads(ctx, agreed, matched)
        broken = planned if rank == 0 else ReadPlan(planned.plan, planned.views[:0], (), None, False, planned.metadata)
        try:
            read(ctx, agreed.metadata, matched.get(), broken, Staged(None))
        except CheckpointError:
            errors.append(rank)

    _ranks(2, run)
    assert sorted(errors) == [0, 1]


# ---- 7. verify, 8. map_back ---------------------------------------------------------------------------------


def _filled(ckpt: Path, group: ThreadGroup, rank: int, **options: Any) -> tuple[LoadContext, Agreed, Matched]:
    ctx = _context(ckpt, group, rank, **options)
    agreed = read_metadata_once(ctx)
    matched = _matched(ctx, agreed, _rows(rank, 2))
    read(ctx, agreed.metadata, matched.get(), plan_reads(ctx, agreed, matched), Staged(None))
    return ctx, agreed, matched.get()


def test_verify_checks_the_fingerprints_of_what_every_rank_holds(ckpt: Path) -> None:
    def run(group: ThreadGroup, rank: int) -> tuple[str, ...]:
        ctx, agreed, matched = _filled(ckpt, group, rank, verify=True)
        return verify(ctx, agreed.metadata, matched)

    assert _ranks(2, run) == [(), ()]


def test_verify_fails_every_rank_on_a_changed_byte(ckpt: Path) -> None:
    errors: list[int] = []

    def run(group: ThreadGroup, rank: int) -> None:
        ctx, agreed, matched = _filled(ckpt, group, rank, verify=True)
        if rank == 1:
            matched.pieces[0].view[0, 0] += 1
        try:
            verify(ctx, agreed.metadata, matched)
        except CorruptCheckpointError:
            errors.append(rank)

    _ranks(2, run)
    assert sorted(errors) == [0, 1]


def test_verify_names_what_the_primary_boxes_do_not_cover(ckpt: Path) -> None:
    def run(group: ThreadGroup, rank: int) -> tuple[str, ...]:
        ctx, agreed, matched = _filled(ckpt, group, rank, verify=True)
        return verify(ctx, agreed.metadata, Matched(matched.tensors[:rank], (), (), (), ()))

    assert _ranks(2, run) == [("w",), ("w",)]  # rank 1 alone holds half of it


def test_map_back_returns_the_template_filled_with_padding_zeroed(ckpt: Path) -> None:
    def run(group: ThreadGroup, rank: int) -> Any:
        ctx = _context(ckpt, group, rank, strict=False)
        agreed = read_metadata_once(ctx)
        template = {
            "v": reshard.ShardedTensor.from_rank_offsets(
                "v", torch.full((3, 6), -1.0), (0, rank, 2), logical_shape=(5, 6)
            ),
            "rng": reshard.ShardedObject("rng", None, (1,), (0,)),
            "gone": reshard.ShardedObject("gone", "mine", (1,), (0,)),
            "step": 0,
            "lr": 0.5,
        }
        matched = _matched(ctx, agreed, template)
        done = read(ctx, agreed.metadata, matched.get(), plan_reads(ctx, agreed, matched), Staged(None))
        return map_back(template, agreed.metadata, done.objects)

    first, second = _ranks(2, run)
    assert torch.equal(first["v"], SHORT[:3])
    assert torch.equal(second["v"][:2], SHORT[3:]) and torch.equal(second["v"][2], torch.zeros(6))  # padding
    assert first["rng"] == {"seed": 7} and first["gone"] == "mine"  # a missing object keeps its template value
    assert (first["step"], first["lr"]) == (3, 0.5)  # a common value from the checkpoint, a missing one kept


def test_load_reports_the_missing_entries_in_its_stats(ckpt: Path) -> None:
    stats = reshard.LoadStats()
    with pytest.warns(UserWarning, match="1 entries are not in the checkpoint"):
        reshard.load({"w": torch.zeros(8, 6), "gone": torch.zeros(1)}, ckpt, strict=False, stats=stats)
    assert stats.missing == ("tensor 'gone'",) and stats.bytes_needed == FULL.numel() * 4


def test_load_stats_keeps_its_old_home() -> None:
    from reshard.flows.load import LoadStats
    from reshard.flows.stats import LoadStats as moved

    assert LoadStats is moved is reshard.LoadStats and LoadStats().missing == ()
