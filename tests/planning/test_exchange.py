"""The pure schedules of :mod:`reshard.planning.exchange`: cells, slabs, rounds, who reads and who sends."""

from __future__ import annotations

import math
from typing import Any

import pytest

from reshard.geometry.boxes import Box
from reshard.planning.exchange import (
    MAX_CELLS_PER_KEY,
    RankSchedule,
    Transfer,
    cells_of,
    pack_rounds,
    schedule_reads,
    schedule_transfer,
    slabs,
)

pytestmark = pytest.mark.unit


def _need(key: str, offset: tuple[int, ...], shape: tuple[int, ...], dtype: str = "float32") -> list[Any]:
    return [key, list(offset), list(shape), dtype]


def _box(ref: list[Any]) -> Box:
    return Box(tuple(ref[1]), tuple(ref[2]))


def _elements(boxes: list[Box]) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    for box in boxes:
        ranges = [range(o, o + n) for o, n in zip(box.offset, box.shape, strict=True)]
        grid = [()]
        for r in ranges:
            grid = [(*g, i) for g in grid for i in r]
        out.update(grid)
    return out


def test_cells_partition_the_union_of_overlapping_boxes() -> None:
    boxes = [Box((0, 0), (4, 4)), Box((2, 2), (4, 4))]
    cells = cells_of(boxes)
    assert cells is not None
    assert sum(c.volume for c in cells) == len(_elements(boxes))  # no overlap between cells
    assert _elements(cells) == _elements(boxes)
    assert all(any(c.intersect(b) == c for b in boxes) for c in cells)  # each inside some box


def test_cells_give_up_beyond_the_limit() -> None:
    boxes = [Box((0, 0), (100, 100)), *(Box((2 * i, 2 * i), (1, 1)) for i in range(1, 40))]
    assert cells_of(boxes) is None  # about 77 x 77 cells in the first box
    assert MAX_CELLS_PER_KEY < 77 * 77


def test_slabs_cut_the_first_axis_with_room_near_equally() -> None:
    parts = slabs(Box((0, 5), (1, 10)), 3)
    assert [p.shape for p in parts] == [(1, 3), (1, 3), (1, 4)]
    assert [p.offset for p in parts] == [(0, 5), (0, 8), (0, 11)]
    assert slabs(Box((0,), (1,)), 4) == [Box((0,), (1,))]


def test_pack_rounds_keeps_every_rank_within_the_round_bytes() -> None:
    transfers = [Transfer(0, 0, 1, 0, Box((i,), (1,)), 40, None, i) for i in range(5)]
    transfers.append(Transfer(2, 0, 3, 0, Box((0,), (1,)), 40, None, 5))
    rounds = pack_rounds(transfers, 4, 100)
    for batch in rounds:
        assert sum(t.nbytes for t in batch if t.src == 0) <= 100
    assert len(rounds) == 3 and sorted(t.ident for b in rounds for t in b) == list(range(6))
    assert transfers[5] in rounds[0]  # another pair of ranks shares the first round


def test_disjoint_needs_are_read_by_their_own_ranks() -> None:
    needs = [[_need("w", (0, 0), (2, 4))], [_need("w", (2, 0), (2, 4))]]
    schedules = schedule_reads(needs)
    assert [s.shared for s in schedules] == [False, False]
    assert [[_box(r) for r in s.reads] for s in schedules] == [[Box((0, 0), (2, 4))], [Box((2, 0), (2, 4))]]
    assert all(not s.rounds and not s.copies for s in schedules)


def test_a_replicated_box_is_read_once_and_sent_to_the_other_needers() -> None:
    whole = Box((0, 0), (8, 16))
    needs = [[_need("w", (0, 0), (8, 16))] for _ in range(3)]  # 512 bytes each, 3 replicas
    schedules = schedule_reads(needs, min_slab_bytes=64)
    reads = [_box(r) for s in schedules for r in s.reads]
    assert sum(b.volume for b in reads) == whole.volume  # storage sees each byte once
    assert _elements(reads) == _elements([whole])
    assert all(s.shared and s.reads for s in schedules)  # the reading is spread over the three
    for rank, s in enumerate(schedules):
        received = [_box(c) for rnd in s.rounds for _, cells in rnd["recv"] for c in cells]
        own = [_box(r) for r in s.reads]
        assert _elements(received) | _elements(own) == _elements([whole]), rank


def test_small_shared_cells_are_not_split_and_rounds_are_bounded() -> None:
    needs = [[_need("b", (0,), (16,))], [_need("b", (0,), (16,))]]
    schedules = schedule_reads(needs, round_bytes=16, min_slab_bytes=1024)
    assert sum(len(s.reads) for s in schedules) == 1  # 64 bytes: one reader
    receiver = next(s for s in schedules if not s.reads)
    sizes = [sum(math.prod(c[2]) * 4 for _, cells in rnd["recv"] for c in cells) for rnd in receiver.rounds]
    assert sizes == [16, 16, 16, 16]


def test_a_key_held_twice_by_one_rank_is_copied_not_sent() -> None:
    needs = [[_need("w", (0,), (8,)), _need("w", (0,), (8,))]]
    (only,) = schedule_reads(needs)
    assert only.reads == [[0, [0], [8]]] and only.copies == [[[0, [0], [8]], [1, [0], [8]]]]


def test_rank_schedule_round_trips_through_json() -> None:
    (schedule, _) = schedule_reads([[_need("w", (0,), (8,))], [_need("w", (0,), (8,))]])
    assert RankSchedule.from_json(schedule.to_json()) == schedule


def test_transfer_copies_its_own_cells_sends_the_rest_and_names_the_holes() -> None:
    holdings = [[_need("w", (0,), (4,))], [_need("w", (4,), (2,), "bfloat16")]]
    needs = [[_need("w", (0,), (8,))], []]
    plan, problems = schedule_transfer(holdings, needs)
    sender, receiver = plan.schedules()[1], plan.schedules()[0]
    assert receiver.copies == [[[0, [0], [4]], [0, [0], [4]]]]
    (rnd,) = receiver.rounds
    assert rnd["recv"] == [[1, [[0, [4], [2], "bfloat16", 0]]]]  # travels in the holder's dtype
    assert sender.rounds[0]["send"] == [[0, [[0, [4], [2], None, 0]]]]
    assert problems == ["'w' box at [6] of shape [2] (rank 0)"]


def test_only_some_cells_keep_their_rounds_with_keep_order() -> None:
    holdings = [[_need("w", (0,), (8,))], []]
    needs = [[], [_need("w", (0,), (8,))]]
    plan, _ = schedule_transfer(holdings, needs, round_bytes=8)
    assert len(plan.schedules()[1].rounds) == 4
    kept = plan.schedules({3}, keep_order=True)[1]
    packed = plan.schedules({3})[1]
    assert len(kept.rounds) == len(packed.rounds) == 1 and kept.rounds[0]["recv"][0][1][0][4] == 3
    assert plan.schedules(set())[1].shared is False


def test_a_ranks_schedule_lists_only_the_rounds_it_moves_bytes_in() -> None:
    """Ranks 0 and 1 share a cell sent in many small rounds; ranks 2 and 3 share one sent in a single round; rank
    4 reads alone. Each rank's part names only its own rounds (what the coordinator encodes grows with the
    transfers, not rounds times ranks), and every rank expands them to the same number of rounds."""
    big, small = (64, 4), (2, 4)
    needs = [
        [_need("a", (0, 0), big)],
        [_need("a", (0, 0), big)],
        [_need("b", (0, 0), small)],
        [_need("b", (0, 0), small)],
        [_need("c", (0, 0), small)],
    ]
    schedules = schedule_reads(needs, round_bytes=64, min_slab_bytes=16)
    counts = {s.round_count for s in schedules}
    assert counts == {len(schedules[0].rounds)} and len(schedules[0].rounds) > 4
    assert [len(s.active) for s in schedules][2:] == [1, 1, 0]
    for schedule in schedules:
        again = RankSchedule.from_json(schedule.to_json())
        assert again.rounds == schedule.rounds and again == schedule
        busy = {i for i, rnd in enumerate(schedule.rounds) if rnd["send"] or rnd["recv"]}
        assert busy == {i for i, _ in schedule.active}
    idle = schedules[4].to_json()
    assert idle["active"] == [] and idle["round_count"] == schedules[0].round_count
    assert schedules[4].rounds == [{"send": [], "recv": []}] * schedules[0].round_count
