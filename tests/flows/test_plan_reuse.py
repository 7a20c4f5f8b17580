"""Save plans reused across saves (reshard.flows.save_reuse, reshard.flows.plan_cache): ranks are threads of this
process (ThreadGroup), checkpoints LocalStorage under tmp_path."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import CheckpointError
from reshard.flows.plan_cache import PlanCache
from reshard.flows.save import save_replacing
from reshard.flows.save_phases import Described, Planned, SaveRequest, describe_rank, plan
from reshard.flows.save_reuse import offer_layout, plan_layouts
from reshard.flows.stats import PhaseClock
from reshard.io.locking import read_lock
from reshard.net.comm import Communicator
from reshard.net.transports import ThreadGroup
from reshard.planning.layouts import PLAN_CACHE_FILE, encode_plan_file, layout_bytes, layout_fingerprint
from reshard.state.sharding import ShardedObject, ShardedTensor
from reshard.storage import Storage, storage_for
from tests.threads import on_threads, outcomes_on_threads

pytestmark = pytest.mark.unit

TIMEOUT = datetime.timedelta(seconds=20)
State = Callable[[int, int], dict[str, Any]]


def row_state(rank: int, world: int, *, rows: int = 2, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Rank ``rank`` holds ``rows`` rows of a (world * rows, 4) tensor, a replicated bias and 40 more small replicated
    tensors (so that a description is some kilobytes), its cell of an object grid; the values depend on nothing but
    the rank."""
    data = (torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 100 * rank).to(dtype)
    return {
        **{f"layers.{i}.norm": torch.full((2,), float(i)) for i in range(40)},
        "w": ShardedTensor(key="w", data=data, global_shape=(world * rows, 4), global_offset=(rank * rows, 0)),
        "bias": torch.full((3,), 7.0),
        "rng": ShardedObject(key="rng", value={"seed": rank}, global_shape=(world,), global_offset=(rank,)),
        "step": 5,
    }


def template(rank: int, world: int, **kwargs: Any) -> dict[str, Any]:
    state = row_state(rank, world, **kwargs)
    state["w"] = ShardedTensor(
        key="w",
        data=torch.zeros_like(state["w"].data),
        global_shape=state["w"].global_shape,
        global_offset=state["w"].global_offset,
    )
    state["bias"] = torch.zeros(3)
    return state


def request_for(storage: Storage, plans: PlanCache | None, reuse: bool = True) -> SaveRequest:
    return SaveRequest(
        storage=storage, checksum_chunk_bytes=1024, memory_budget_bytes=1 << 20, plans=plans, reuse_plan=reuse
    )


def plan_rounds(
    root: Path, world: int, states: list[State], caches: list[PlanCache | None], reuse: tuple[bool, ...] = ()
) -> list[list[tuple[Planned | BaseException, int]]]:
    """Phase 2 (with reuse where a cache is given) once per element of ``states``, on ``world`` threads: per round,
    per rank, what planning returned (or raised) and the bytes the rank sent in it. Each round's lock is released."""
    group = ThreadGroup(world, timeout=20)
    rounds = []
    for number, state in enumerate(states):
        storage = storage_for(root / f"ckpt{number}")

        def rank(r: int, state: State = state, storage: Storage = storage) -> tuple[Planned | BaseException, int]:
            member = group.member(r)
            comm = Communicator(member, timeout=TIMEOUT)
            request = request_for(storage, caches[r], reuse[r] if reuse else True)
            described: Described = describe_rank(request, state(r, world), rank=r, is_coordinator=r == 0)
            before = member.bytes_sent
            clock = PhaseClock("save", r, 0.0)
            try:
                planned: Planned | BaseException = (
                    plan_layouts(comm, request, described, clock, offer_layout(comm, request, described, clock))
                    if request.reusing
                    else plan(comm, request, described, clock)
                )
            except CheckpointError as exc:
                planned = exc
            return planned, member.bytes_sent - before

        outcome = on_threads(world, rank)
        made = outcome[0][0]
        if isinstance(made, Planned) and made.coordinator is not None:
            made.coordinator.undo()
        rounds.append(outcome)
    return rounds


def test_the_same_layout_planned_again_sends_only_fingerprints_and_the_same_plan(tmp_path: Path) -> None:
    world = 3
    rounds = plan_rounds(tmp_path, world, [row_state, row_state, row_state], [PlanCache() for _ in range(world)])
    first, second, third = rounds
    assert all(isinstance(p, Planned) for r in rounds for p, _ in r)
    # The first save gathered the layouts (two steps); the next ones send an offer of a fixed, small size.
    assert all(sent > 3000 for _, sent in first[1:])
    assert all(sent < 600 for _, sent in second[1:]) and all(sent < 600 for _, sent in third[1:])
    assignments = [[p.assignment for p, _ in r] for r in rounds]  # type: ignore[union-attr]
    assert assignments[0] == assignments[1] == assignments[2]
    ids = {p.save_id for r in rounds for p, _ in r}  # type: ignore[union-attr]
    assert len(ids) == 3  # a new save id every save


def test_without_a_cache_planning_is_one_step_as_before(tmp_path: Path) -> None:
    (flat,) = plan_rounds(tmp_path, 2, [row_state], [None, None])
    (reused,) = plan_rounds(tmp_path / "b", 2, [row_state], [PlanCache(), PlanCache()])
    assert [p.assignment for p, _ in flat] == [p.assignment for p, _ in reused]  # type: ignore[union-attr]


def changed(which: str) -> State:
    """``row_state`` with one thing changed on every rank, or (``rank1``) on rank 1 alone."""

    def state(rank: int, world: int) -> dict[str, Any]:
        if which == "shape":
            return row_state(rank, world, rows=3)
        if which == "dtype":
            return row_state(rank, world, dtype=torch.bfloat16)
        base = row_state(rank, world)
        if which == "key":
            base["extra"] = torch.ones(2)
        elif which == "replica":
            base["w"] = ShardedTensor(
                key="w", data=base["w"].data, global_shape=(world * 2, 4), global_offset=(rank * 2, 0), replica_id=0
            )
            base["extra"] = ShardedTensor(
                key="extra", data=torch.ones(2), global_shape=(2,), global_offset=(0,), replica_id=rank
            )
        elif which == "box":  # the boxes are given in another order of rows: rank r holds rows of rank world-1-r
            other = world - 1 - rank
            base["w"] = ShardedTensor(
                key="w", data=base["w"].data, global_shape=(world * 2, 4), global_offset=(other * 2, 0)
            )
        return base

    return state


@pytest.mark.parametrize("which", ["shape", "dtype", "key", "replica", "box"])
def test_any_change_of_the_layout_plans_again(tmp_path: Path, which: str) -> None:
    world = 3
    caches = [PlanCache() for _ in range(world)]
    _, second = plan_rounds(tmp_path, world, [row_state, changed(which)], caches)
    (fresh,) = plan_rounds(tmp_path / "fresh", world, [changed(which)], [None] * world)
    assert all(isinstance(p, Planned) for p, _ in second)
    assert all(second[r][1] > 3000 for r in range(1, world))  # the layouts were gathered
    assert [p.assignment for p, _ in second] == [p.assignment for p, _ in fresh]  # type: ignore[union-attr]


def test_another_group_size_plans_again(tmp_path: Path) -> None:
    coordinator = PlanCache()
    plan_rounds(tmp_path / "two", 2, [row_state, row_state], [coordinator, PlanCache()])
    (three,) = plan_rounds(tmp_path / "three", 3, [row_state], [coordinator, PlanCache(), PlanCache()])
    (fresh,) = plan_rounds(tmp_path / "fresh", 3, [row_state], [None] * 3)
    assert all(sent > 3000 for _, sent in three[1:])
    assert [p.assignment for p, _ in three] == [p.assignment for p, _ in fresh]  # type: ignore[union-attr]
    assert len(coordinator) == 2


def test_a_rank_whose_layout_alone_changed_is_caught(tmp_path: Path) -> None:
    def rank1_moved(rank: int, world: int) -> dict[str, Any]:
        state = row_state(rank, world)
        if rank == 1:  # a box that overlaps rank 0's: the plan made now refuses it
            state["w"] = ShardedTensor(key="w", data=state["w"].data, global_shape=(world * 2, 4), global_offset=(1, 0))
        return state

    world = 3
    _, second = plan_rounds(tmp_path, world, [row_state, rank1_moved], [PlanCache() for _ in range(world)])
    errors = [p for p, _ in second]
    assert all(isinstance(e, reshard.ShardingError) for e in errors)
    assert len({str(e) for e in errors}) == 1


@pytest.mark.parametrize("reuse", [(True, False), (False, True)])
def test_ranks_that_disagree_on_reuse_fail_alike_naming_the_term(tmp_path: Path, reuse: tuple[bool, ...]) -> None:
    (outcome,) = plan_rounds(tmp_path, 2, [row_state], [PlanCache(), PlanCache()], reuse)
    errors = [p for p, _ in outcome]
    assert all(isinstance(e, CheckpointError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1 and "reuse_plan" in str(errors[0])
    assert read_lock(storage_for(tmp_path / "ckpt0")) is None


def test_a_cache_on_some_ranks_only_fails_every_rank_alike(tmp_path: Path) -> None:
    for caches in ([PlanCache(), None], [None, PlanCache()]):
        (outcome,) = plan_rounds(tmp_path / str(caches[0] is None), 2, [row_state], caches)
        errors = [p for p, _ in outcome]
        assert all(isinstance(e, CheckpointError) for e in errors), errors
        assert len({str(e) for e in errors}) == 1 and "layout offer" in str(errors[0])


def test_the_cache_keeps_the_newest_layouts_only() -> None:
    cache = PlanCache(capacity=2)
    with pytest.raises(ValueError, match="capacity"):
        PlanCache(capacity=0)
    table_plan: Any = object()
    for name in "abc":
        cache._keep((name,), table_plan)
    assert len(cache) == 2 and cache.lookup(("a",)) is None and cache.lookup(("c",)) is table_plan


# ---- whole saves ---------------------------------------------------------------------------------------------


def save_on_threads(
    path: Path, world: int, state: State, caches: list[PlanCache | None], group: ThreadGroup | None = None
) -> list[reshard.SaveResult]:
    group = group or ThreadGroup(world, timeout=20)
    return on_threads(
        world,
        lambda r: save_replacing(state(r, world), path, replaces=None, group=group.member(r), plan_cache=caches[r]),
    )


def load_on_threads(path: Path, world: int, state: State) -> list[dict[str, Any]]:
    group = ThreadGroup(world, timeout=20)

    def rank(r: int) -> dict[str, Any]:
        loaded = reshard.load(state(r, world), path, group=group.member(r))
        return {"w": loaded["w"].data.clone(), "bias": loaded["bias"].clone(), "rng": loaded["rng"]}

    return on_threads(world, rank)


def test_a_save_that_reuses_its_plan_loads_bit_identical(tmp_path: Path) -> None:
    world = 2
    caches: list[PlanCache | None] = [PlanCache() for _ in range(world)]
    group = ThreadGroup(world, timeout=20)
    save_on_threads(tmp_path / "a", world, row_state, caches, group)
    save_on_threads(tmp_path / "b", world, row_state, caches, group)
    save_on_threads(tmp_path / "c", world, row_state, [None, None])
    loaded = [load_on_threads(tmp_path / name, world, template) for name in "abc"]
    for r in range(world):
        for name in ("w", "bias"):
            assert torch.equal(loaded[1][r][name], loaded[2][r][name])
            assert torch.equal(
                loaded[1][r][name], row_state(r, world)[name].data if name == "w" else torch.full((3,), 7.0)
            )
        assert loaded[1][r]["rng"] == {"seed": r}


# ---- the manager's cache beside the checkpoints ---------------------------------------------------------------


def manager_saves(root: Path, world: int, steps: list[int], state: State = row_state) -> list[list[Any]]:
    """A fresh manager per rank (a restarted job) saves ``steps``; per step, per rank, the result."""
    group = ThreadGroup(world, timeout=20)
    managers = [reshard.CheckpointManager(root, group=group.member(r)) for r in range(world)]
    try:
        return [on_threads(world, lambda r, s=s: managers[r].save(s, state(r, world)), group=group) for s in steps]
    finally:
        for m in managers:
            m.close()


def layouts_of(world: int, state: State) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
    request = request_for(storage_for("/nonexistent/never/written"), PlanCache())
    layouts = tuple(
        layout_bytes(describe_rank(request, state(r, world), rank=r, is_coordinator=r == 0).description)
        for r in range(world)
    )
    return tuple(layout_fingerprint(x, rank=r, world=world) for r, x in enumerate(layouts)), layouts


def file_hit(root: Path, caplog: pytest.LogCaptureFixture) -> bool:
    """Whether the last restarted manager's coordinator used the plan cache file."""
    return any("holds this layout" in r.getMessage() for r in caplog.records)


def test_a_restarted_manager_reuses_the_plan_kept_in_its_root(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    world = 2
    manager_saves(tmp_path, world, [1])
    assert (tmp_path / PLAN_CACHE_FILE).is_file()
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        manager_saves(tmp_path, world, [2])
    assert file_hit(tmp_path, caplog)
    loaded = load_on_threads(tmp_path / "step_000000002", world, template)
    assert all(torch.equal(loaded[r]["w"], row_state(r, world)["w"].data) for r in range(world))
    group = ThreadGroup(world, timeout=20)
    managers = [reshard.CheckpointManager(tmp_path, keep_last=1, group=group.member(r)) for r in range(world)]
    on_threads(world, lambda r: managers[r].save(3, row_state(r, world)), group=group)  # retention runs
    assert managers[0].steps() == [3] and (tmp_path / PLAN_CACHE_FILE).is_file()
    for m in managers:
        m.close()


def test_a_manager_reuses_its_plan_in_memory_and_matches_an_incremental_base_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    world = 2
    group = ThreadGroup(world, timeout=20)
    managers = [reshard.CheckpointManager(tmp_path, incremental=True, group=group.member(r)) for r in range(world)]
    on_threads(world, lambda r: managers[r].save(1, row_state(r, world)), group=group)
    (tmp_path / PLAN_CACHE_FILE).unlink()  # the second save can only reuse the plan the manager holds
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        results = on_threads(world, lambda r: managers[r].save(2, row_state(r, world)), group=group)
    assert sum("the plan of this layout is reused" in r.getMessage() for r in caplog.records) == world
    assert results[0].referenced_bytes == results[0].total_bytes > 0  # every box referenced in step 1
    loaded = load_on_threads(tmp_path / "step_000000002", world, template)
    assert all(torch.equal(loaded[r]["w"], row_state(r, world)["w"].data) for r in range(world))
    for m in managers:
        m.close()


def test_the_plan_cache_file_is_no_part_of_any_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ls, validate and gc of a manager's root and steps do not take the file for a checkpoint or a leftover."""
    from reshard.cli import main

    manager_saves(tmp_path, 2, [1, 2])
    assert (tmp_path / PLAN_CACHE_FILE).is_file()
    assert main(["ls", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert PLAN_CACHE_FILE not in listing and "step_000000002" in listing
    assert main(["validate", str(tmp_path / "step_000000002")]) == 0
    assert main(["gc", str(tmp_path / "step_000000002"), "--min-age", "0"]) == 0
    assert (tmp_path / PLAN_CACHE_FILE).is_file()


def damaged(kind: str, raw: bytes, world: int) -> bytes:
    if kind == "flipped":
        return raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:]
    if kind == "truncated":
        return raw[: len(raw) // 2]
    if kind == "empty":
        return b""
    if kind == "other layout":
        return encode_plan_file(*layouts_of(world, changed("shape")))
    if kind == "forged":  # today's fingerprints, another layout's descriptions, a correct checksum
        fingerprints, _ = layouts_of(world, row_state)
        return encode_plan_file(fingerprints, layouts_of(world, changed("box"))[1])
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["flipped", "truncated", "empty", "other layout", "forged"])
def test_a_bad_plan_cache_file_is_a_miss_never_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    world = 2
    manager_saves(tmp_path, world, [1])
    path = tmp_path / PLAN_CACHE_FILE
    path.write_bytes(damaged(kind, path.read_bytes(), world))
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        manager_saves(tmp_path, world, [2])
    assert not file_hit(tmp_path, caplog)
    assert any("is not used" in r.getMessage() for r in caplog.records)
    loaded = load_on_threads(tmp_path / "step_000000002", world, template)
    assert all(torch.equal(loaded[r]["w"], row_state(r, world)["w"].data) for r in range(world))
    assert read_lock(storage_for(tmp_path)) is None


@pytest.mark.parametrize("kind", ["garbage body", "lying lengths"])
def test_a_huge_bad_plan_cache_file_is_a_miss_without_being_read_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """A file of 768 MiB (sparse) that begins as a plan cache does, with a garbage header or with a header whose
    layout lengths do not add up to the file, is a miss found from its first bytes: the coordinator never holds it
    in memory (an outside attack found 2 GiB allocated and the planning step timing out, for a file under the size
    limit)."""
    import tracemalloc

    world = 2
    manager_saves(tmp_path, world, [1])
    path = tmp_path / PLAN_CACHE_FILE
    raw = path.read_bytes()
    with path.open("r+b" if kind == "lying lengths" else "wb") as f:
        if kind == "garbage body":
            f.write(raw[:8])
        f.truncate(768 << 20)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.DEBUG, logger="reshard"):
            manager_saves(tmp_path, world, [2])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not file_hit(tmp_path, caplog)
    assert any("is not used" in r.getMessage() for r in caplog.records)
    assert peak < 64 << 20, peak
    loaded = load_on_threads(tmp_path / "step_000000002", world, template)
    assert all(torch.equal(loaded[r]["w"], row_state(r, world)["w"].data) for r in range(world))


def test_a_partial_plan_cache_write_is_never_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A process killed while writing the file leaves at most a temporary beside it: the file itself is whole or
    absent (``Storage.commit``), so the next save reads the previous file or none."""
    world = 2
    manager_saves(tmp_path, world, [1])
    raw = (tmp_path / PLAN_CACHE_FILE).read_bytes()
    (tmp_path / PLAN_CACHE_FILE).unlink()
    partial = tmp_path / f".{PLAN_CACHE_FILE}.tmp-{'0123456789abcdef' * 2}"
    partial.write_bytes(raw[: len(raw) // 3])
    other = tmp_path / f".{PLAN_CACHE_FILE}.tmp-{'f' * 32}"
    other.write_bytes(b"the user's own file, named so")
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        manager_saves(tmp_path, world, [2])
    assert not file_hit(tmp_path, caplog)
    assert (tmp_path / PLAN_CACHE_FILE).read_bytes() == raw  # the same layout, written again
    assert not partial.exists() and other.exists()  # retention removes what a killed manager left, only that


def test_two_jobs_writing_the_cache_leave_one_whole_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    world = 2
    outcomes = outcomes_on_threads(
        2, lambda job: manager_saves(tmp_path / "root", world, [1], changed("shape") if job else row_state)
    )
    assert any(not isinstance(o, BaseException) for o in outcomes)  # one may meet the other's lock
    raw = (tmp_path / "root" / PLAN_CACHE_FILE).read_bytes()
    assert raw in (
        encode_plan_file(*layouts_of(world, row_state)),
        encode_plan_file(*layouts_of(world, changed("shape"))),
    )
