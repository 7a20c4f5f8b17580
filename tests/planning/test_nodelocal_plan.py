"""The pure schedules of node-local checkpoints: the judgement of a step, the fetch rounds, the drain assignment."""

from __future__ import annotations

import pytest

from reshard.planning.nodelocal import Holding, assign_drain, judge_step, node_directory, plan_fetches

pytestmark = pytest.mark.unit


def test_a_step_is_judged_whole_only_when_every_file_is_held_at_its_size() -> None:
    expected = {"data/a-r00000.bin": 10, "data/a-r00001.bin": 20}
    node0 = Holding(node=0, rank=0, metadata="d", metadata_size=5, expected=expected, held={"data/a-r00000.bin": 10})
    node1 = Holding(node=1, rank=2, held={"data/a-r00001.bin": 19})
    judged = judge_step([node0, node1])
    assert judged is not None and judged.missing == ("data/a-r00001.bin",) and judged.source == 0
    whole = judge_step([node0, Holding(node=1, rank=2, held={"data/a-r00001.bin": 20})])
    assert whole is not None and whole.missing == ()
    assert judge_step([Holding(node=0, rank=0, held={"data/a-r00000.bin": 10})]) is None


def test_fetch_rounds_stay_within_the_round_bytes_one_message_per_pair_and_cover_every_file() -> None:
    sizes = [100, 35, 7, 0]
    rank_nodes = [0, 0, 1, 1]
    held = {0: {0, 1, 3}, 1: {2}}
    needs = [[0, 2], [1, 3], [0, 1], [2, 3]]
    plans = plan_fetches(sizes, needs, rank_nodes, held, round_bytes=16)
    got: dict[int, list[tuple[int, int]]] = {}
    for rank, plan in enumerate(plans):
        for sends, receives in plan.rounds:
            assert sum(n for *_, n in sends) <= 16 and sum(n for *_, n in receives) <= 16
            assert len({peer for peer, *_ in sends}) == len(sends)
            for peer, file, offset, length in receives:
                assert (rank, file, offset, length) in [
                    (p, f, o, n) for p, f, o, n in plans[peer].rounds[plan.rounds.index((sends, receives))][0]
                ]
                got.setdefault(file, []).append((offset, length))
    # Node 1 fetches files 0, 1 and 3; node 0 fetches file 2; each file's pieces arrive in order, whole.
    assert sorted(f for p in plans[2:] for f in p.assembles) == [0, 1, 3]
    assert sorted(f for p in plans[:2] for f in p.assembles) == [2]
    for file, pieces in got.items():
        assert pieces == sorted(pieces) and sum(n for _, n in pieces) == sizes[file]


def test_a_drain_gives_each_file_to_one_rank_of_a_node_that_holds_it_balanced_by_bytes() -> None:
    out = assign_drain([50, 40, 30, 20], {0: [0], 1: [0, 1], 2: [1], 3: [0, 1]}, [0, 0, 1, 1])
    assert sorted(f for files in out for f in files) == [0, 1, 2, 3]
    assert 0 in out[0] + out[1] and 2 in out[2] + out[3]
    assert all(len(files) <= 2 for files in out)
    assert node_directory("/ckpt/node{node}", 3) == "/ckpt/node3" and node_directory("/nvme", 3) == "/nvme"
