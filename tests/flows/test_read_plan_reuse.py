"""Read-once schedules reused across loads (reshard.flows.load_planning, reshard.flows.plan_cache.ReadPlanCache):
ranks are threads of this process (ThreadGroup), checkpoints LocalStorage under tmp_path."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import CheckpointError
from reshard.flows.load import load_reusing
from reshard.flows.plan_cache import ReadPlanCache
from reshard.io.exchange import describe_need
from reshard.net.transports import ThreadGroup
from reshard.planning.layouts import (
    PLAN_CACHE_FILE,
    READ_PLANS,
    encode_plan_file,
    layout_fingerprint,
    needs_bytes,
)
from reshard.state.sharding import ShardedTensor
from reshard.state.statedict import flatten_state_dict
from tests.threads import on_threads, outcomes_on_threads

pytestmark = pytest.mark.unit

WORLD = 4
READS = READ_PLANS.name
Template = Callable[[int], dict[str, Any]]


def saved_state() -> dict[str, Any]:
    """What every test saves: a (8, 4) tensor the ranks shard, and 60 small tensors every rank loads whole (so that
    the needs of a rank are kilobytes, and every one of them is shared by all ranks)."""
    return {
        "w": torch.arange(32, dtype=torch.float32).reshape(8, 4),
        **{f"layers.{i}.norm": torch.full((4,), float(i)) for i in range(60)},
    }


def template(rank: int, *, split: int = 2, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Rank ``rank`` of ``WORLD`` loads rows ``rank % split`` of ``w`` cut in ``split`` (data-parallel replicas of a
    tensor-parallel cut) and every small tensor whole."""
    rows = 8 // split
    part = rank % split
    return {
        "w": ShardedTensor(
            key="w", data=torch.zeros(rows, 4, dtype=dtype), global_shape=(8, 4), global_offset=(part * rows, 0)
        ),
        **{f"layers.{i}.norm": torch.zeros(4, dtype=dtype) for i in range(60)},
    }


def expected(rank: int, split: int = 2) -> torch.Tensor:
    rows = 8 // split
    return saved_state()["w"][(rank % split) * rows : (rank % split + 1) * rows]


def check(loaded: list[dict[str, Any]], split: int = 2) -> None:
    for rank, state in enumerate(loaded):
        assert torch.equal(state["w"].data.float(), expected(rank, split))
        assert all(torch.equal(state[f"layers.{i}.norm"].float(), torch.full((4,), float(i))) for i in range(60))


Loaded = tuple[list[dict[str, Any]], list[reshard.LoadStats], list[int]]


def load_on_threads(
    path: Path,
    caches: list[ReadPlanCache | None],
    templates: Template = template,
    options: Callable[[int], reshard.LoadOptions] = lambda r: reshard.LoadOptions(read_once=True),
) -> Loaded:
    """One read-once load on ``WORLD`` threads: per rank, the result, its stats and the bytes it sent."""
    group = ThreadGroup(WORLD, timeout=20)

    def rank(r: int) -> tuple[dict[str, Any], reshard.LoadStats, int]:
        member, stats = group.member(r), reshard.LoadStats()
        loaded = load_reusing(caches[r], templates(r), path, group=member, options=options(r), stats=stats, timeout=20)
        return loaded, stats, member.bytes_sent

    results = on_threads(WORLD, rank, group=group)
    return [x[0] for x in results], [x[1] for x in results], [x[2] for x in results]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    reshard.save(saved_state(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def needs_size(rank: int) -> int:
    flat = flatten_state_dict(template(rank), rank=rank, dedup=False)
    return len(needs_bytes([describe_need(t.key, p) for t in flat.tensors for p in t.pieces()]))


def test_a_schedule_is_reused_in_memory_and_loads_the_same_bytes(ckpt: Path) -> None:
    caches: list[ReadPlanCache | None] = [ReadPlanCache() for _ in range(WORLD)]
    first, first_stats, first_sent = load_on_threads(ckpt, caches)
    second, second_stats, second_sent = load_on_threads(ckpt, caches)
    check(first)
    check(second)
    assert [s.schedule_reused for s in first_stats] == [False] * WORLD
    assert [s.schedule_reused for s in second_stats] == [True] * WORLD
    # The same schedule: the same bytes read and exchanged; only the needs were not gathered again.
    assert [s.bytes_from_peers for s in first_stats] == [s.bytes_from_peers for s in second_stats]
    assert all(s.bytes_from_peers > 0 for s in second_stats)
    for rank in range(1, WORLD):
        assert first_sent[rank] - second_sent[rank] >= needs_size(rank), (first_sent, second_sent)
    assert len(caches[0] or []) == 1 and all(len(c or []) == 0 for c in caches[1:])  # only the coordinator's


def test_without_a_cache_or_reuse_nothing_is_reused(ckpt: Path) -> None:
    for caches, reuse in (([None] * WORLD, True), ([ReadPlanCache() for _ in range(WORLD)], False)):
        for _ in range(2):
            loaded, stats, _ = load_on_threads(
                ckpt, list(caches), options=lambda r, reuse=reuse: reshard.LoadOptions(read_once=True, reuse_plan=reuse)
            )
            check(loaded)
            assert not any(s.schedule_reused for s in stats)


def changed_on(ranks: set[int], how: str) -> Template:
    def build(rank: int) -> dict[str, Any]:
        if rank not in ranks:
            return template(rank)
        if how == "boxes":
            return template(rank, split=4)
        if how == "dtype":
            return template(rank, dtype=torch.float64)
        state = template(rank)
        if how == "keys":
            del state["layers.59.norm"]
        elif how == "order":  # the same pieces, described in another order
            state = dict(reversed(list(state.items())))
        return state

    return build


@pytest.mark.parametrize(
    ("ranks", "how"),
    [({0, 1, 2, 3}, "boxes"), ({0, 1, 2, 3}, "dtype"), ({3}, "boxes"), ({2}, "keys"), ({1}, "order")],
)
def test_any_change_of_any_ranks_targets_schedules_again(ckpt: Path, ranks: set[int], how: str) -> None:
    caches: list[ReadPlanCache | None] = [ReadPlanCache() for _ in range(WORLD)]
    load_on_threads(ckpt, caches)
    templates = changed_on(ranks, how)
    loaded, stats, _ = load_on_threads(ckpt, caches, templates)
    assert not any(s.schedule_reused for s in stats)
    fresh, _, _ = load_on_threads(ckpt, [None] * WORLD, templates)
    for mine, theirs in zip(loaded, fresh, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(_tensor(mine[k]), _tensor(theirs[k])) for k in mine)
    _again, again_stats, _ = load_on_threads(ckpt, caches, templates)  # now that one is kept, and the first too
    assert all(s.schedule_reused for s in again_stats)
    _, first_again, _ = load_on_threads(ckpt, caches)
    assert all(s.schedule_reused for s in first_again)


def _tensor(value: Any) -> torch.Tensor:
    return value.data if isinstance(value, ShardedTensor) else value


def test_another_exchange_budget_schedules_again(ckpt: Path) -> None:
    caches: list[ReadPlanCache | None] = [ReadPlanCache() for _ in range(WORLD)]
    load_on_threads(ckpt, caches)
    smaller = reshard.LoadOptions(read_once=True, memory_budget_bytes=1 << 16)
    loaded, stats, _ = load_on_threads(
        ckpt, caches, options=lambda r: smaller if r == 2 else reshard.LoadOptions(read_once=True)
    )
    check(loaded)
    assert not any(s.schedule_reused for s in stats)


def test_another_checkpoint_of_the_same_layout_reuses_the_schedule(tmp_path: Path) -> None:
    """A schedule depends on the ranks' targets and the exchange's sizes, not on the saved boxes: the next
    checkpoint of the same run, saved on another layout, reuses it and loads its own bytes."""
    reshard.save(saved_state(), tmp_path / "a")
    group = ThreadGroup(2, timeout=20)
    newer = {k: v + 1 for k, v in saved_state().items()}

    def save_two(r: int) -> None:
        state = {k: v for k, v in newer.items() if k != "w"}
        state["w"] = ShardedTensor(
            key="w", data=newer["w"][:, 2 * r : 2 * r + 2].clone(), global_shape=(8, 4), global_offset=(0, 2 * r)
        )
        reshard.save(state, tmp_path / "b", group=group.member(r))

    on_threads(2, save_two, group=group)
    caches: list[ReadPlanCache | None] = [ReadPlanCache() for _ in range(WORLD)]
    load_on_threads(tmp_path / "a", caches)
    loaded, stats, _ = load_on_threads(tmp_path / "b", caches)
    assert all(s.schedule_reused for s in stats)
    for rank, state in enumerate(loaded):
        assert torch.equal(state["w"].data, expected(rank) + 1)
        assert torch.equal(state["layers.7.norm"], torch.full((4,), 8.0))


@pytest.mark.parametrize("term", ["reuse_plan", "plan_cache"])
def test_ranks_that_disagree_fail_alike_naming_the_term(ckpt: Path, term: str) -> None:
    group = ThreadGroup(WORLD, timeout=20)

    def rank(r: int) -> Any:
        options = reshard.LoadOptions(read_once=True, reuse_plan=not (term == "reuse_plan" and r == 1))
        cache = None if term == "plan_cache" and r == 3 else ReadPlanCache()
        return load_reusing(cache, template(r), ckpt, group=group.member(r), options=options, timeout=20)

    outcomes = outcomes_on_threads(WORLD, rank)
    assert all(isinstance(o, CheckpointError) for o in outcomes), outcomes
    assert len({str(o) for o in outcomes}) == 1 and term in str(outcomes[0])


def test_the_cache_keeps_the_newest_schedules_only() -> None:
    with pytest.raises(ValueError, match="capacity"):
        ReadPlanCache(capacity=0)
    cache = ReadPlanCache(capacity=2)
    from reshard.flows.plan_cache import ScheduleKey

    keys = [ScheduleKey((name,), 4096, 65536) for name in "abc"]
    for key in keys:
        cache.store(key, (key.fingerprints[0].encode(),), (b"[]",))
    never: Any = lambda needs: pytest.fail("no file to schedule from")  # noqa: E731
    assert len(cache) == 2 and cache.lookup(keys[0], never) == (False, None)
    assert cache.lookup(keys[2], never) == (True, (b"c",))


# ---- a manager's loads: the needs kept in its root ----------------------------------------------------------------


def manager_loads(root: Path, *, read_once: bool = True) -> tuple[list[dict[str, Any]], list[reshard.LoadStats]]:
    """A fresh manager per rank (a restarted job) loads the latest step on ``WORLD`` threads."""
    group = ThreadGroup(WORLD, timeout=20)
    managers = [reshard.CheckpointManager(root, group=group.member(r), timeout=20) for r in range(WORLD)]
    stats = [reshard.LoadStats() for _ in range(WORLD)]
    options = reshard.LoadOptions(read_once=read_once)

    def rank(r: int) -> dict[str, Any]:
        found = managers[r].load_latest_with_state(template(r), options=options, stats=stats[r])
        assert found is not None
        return found[1]

    try:
        return on_threads(WORLD, rank, group=group), stats
    finally:
        for m in managers:
            m.close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    manager = reshard.CheckpointManager(tmp_path / "root")
    manager.save(1, saved_state())
    manager.close()
    return tmp_path / "root"


def file_hit(caplog: pytest.LogCaptureFixture) -> bool:
    return any("holds these needs" in r.getMessage() for r in caplog.records)


def test_a_restarted_manager_reuses_the_needs_kept_in_its_root(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    loaded, stats = manager_loads(root)
    check(loaded)
    assert not any(s.schedule_reused for s in stats) and (root / READS).is_file()
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        loaded, stats = manager_loads(root)
    check(loaded)
    assert file_hit(caplog) and all(s.schedule_reused for s in stats)


def test_a_load_that_does_not_read_once_writes_no_cache(root: Path) -> None:
    loaded, stats = manager_loads(root, read_once=False)
    check(loaded)
    assert not (root / READS).exists() and not any(s.schedule_reused for s in stats)


def fingerprints_now() -> tuple[str, ...]:
    needs = [
        needs_bytes(
            [
                describe_need(t.key, p)
                for t in flatten_state_dict(template(r), rank=r, dedup=False).tensors
                for p in t.pieces()
            ]
        )
        for r in range(WORLD)
    ]
    return tuple(layout_fingerprint(n, rank=r, world=WORLD, kind=READ_PLANS) for r, n in enumerate(needs))


def damaged(kind: str, raw: bytes) -> bytes:
    if kind == "flipped":
        return raw[:-5] + bytes([raw[-5] ^ 1]) + raw[-4:]
    if kind == "truncated":
        return raw[: len(raw) // 2]
    if kind == "empty":
        return b""
    if kind == "forged":  # today's fingerprints, another layout's needs, a correct checksum
        other = [needs_bytes([["w", [0, 0], [8, 4], "float32"]]) for _ in range(WORLD)]
        return encode_plan_file(fingerprints_now(), tuple(other), kind=READ_PLANS)
    if kind == "a save plan file":  # the right needs, under the save cache's magic
        return raw.replace(READ_PLANS.magic, b"RSPLANS1", 1)
    if kind == "float lengths":  # the right needs, a header whose lengths are floats, the checksum made again
        import hashlib
        import json
        import struct

        body = raw[8 + 32 :]
        (length,) = struct.unpack_from("<Q", body)
        header = json.loads(body[8 : 8 + length])
        header["lengths"] = [float(n) for n in header["lengths"]]
        encoded = json.dumps(header).encode()
        body = struct.pack("<Q", len(encoded)) + encoded + body[8 + length :]
        return raw[:8] + hashlib.sha256(body).digest() + body
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["flipped", "truncated", "empty", "forged", "a save plan file", "float lengths"])
def test_a_bad_read_plan_file_is_a_miss_never_an_error(root: Path, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    manager_loads(root)
    path = root / READS
    path.write_bytes(damaged(kind, path.read_bytes()))
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        loaded, stats = manager_loads(root)
    check(loaded)
    assert not file_hit(caplog) and not any(s.schedule_reused for s in stats)
    assert kind == "empty" or any("is not used" in r.getMessage() for r in caplog.records)
    assert path.read_bytes() == encode_plan_file(fingerprints_now(), _needs_now(), kind=READ_PLANS)  # written anew


def _needs_now() -> tuple[bytes, ...]:
    return tuple(
        needs_bytes(
            [
                describe_need(t.key, p)
                for t in flatten_state_dict(template(r), rank=r, dedup=False).tensors
                for p in t.pieces()
            ]
        )
        for r in range(WORLD)
    )


def test_the_two_plan_files_are_never_taken_for_each_other(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager_loads(root)
    manager = reshard.CheckpointManager(root)
    manager.save(2, saved_state())  # writes the save plan file
    manager.close()
    reads, plans = (root / READS).read_bytes(), (root / PLAN_CACHE_FILE).read_bytes()
    (root / READS).write_bytes(plans)
    (root / PLAN_CACHE_FILE).write_bytes(reads)
    with caplog.at_level(logging.DEBUG, logger="reshard"):
        loaded, stats = manager_loads(root)
        manager = reshard.CheckpointManager(root)
        manager.save(3, saved_state())
        manager.close()
    check(loaded)
    assert not any(s.schedule_reused for s in stats)
    assert not any("holds this layout" in r.getMessage() for r in caplog.records)


def test_a_cache_that_cannot_be_written_never_fails_the_load(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A root the load cannot write (here the cache's name is a directory of the user's) loads as ever; the
    directory is left as it was."""
    (root / READS).mkdir()
    (root / READS / "mine.txt").write_text("not reshard's")
    with caplog.at_level(logging.INFO, logger="reshard"):
        loaded, _stats = manager_loads(root)
    check(loaded)
    assert any("was not written" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(root / READS)) == ["mine.txt"]


def test_the_read_plan_file_is_no_part_of_any_checkpoint(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ls, validate and gc of a manager's root and steps do not take the file for a checkpoint or a leftover;
    retention removes only the temporaries of the file that begin as one does."""
    from reshard.cli import main

    manager_loads(root)
    raw = (root / READS).read_bytes()
    assert main(["ls", str(root)]) == 0
    assert READS not in capsys.readouterr().out
    assert main(["validate", str(root / "step_000000001")]) == 0
    assert main(["gc", str(root / "step_000000001"), "--min-age", "0"]) == 0
    partial = root / f".{READS}.tmp-{'0123456789abcdef' * 2}"
    partial.write_bytes(raw[:10])
    other = root / f".{READS}.tmp-{'f' * 32}"
    other.write_bytes(b"the user's own file, named so")
    manager = reshard.CheckpointManager(root, keep_last=1)
    manager.save(2, saved_state())
    manager.close()
    assert (root / READS).read_bytes() == raw
    assert not partial.exists() and other.exists()
