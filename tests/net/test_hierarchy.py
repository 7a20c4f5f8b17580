"""The two-level control path on threads (reshard.net.hierarchy): framing, rank order for any node layout, the
same results as the flat transport, byte counters, and the agreement of Communicator.step over it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import reshard
from reshard.errors import CheckpointError, CommunicationError
from reshard.net.comm import Communicator
from reshard.net.hierarchy import HierarchicalThreadGroup, HierarchicalTransport, NodeLayout, frame, unframe
from reshard.net.transports import ThreadGroup, Transport
from tests.threads import on_threads, outcomes_on_threads

pytestmark = pytest.mark.unit

LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "2x2": (4, {"ranks_per_node": 2}),
    "3x2": (6, {"ranks_per_node": 2}),
    "one-node": (3, {"ranks_per_node": 3}),
    "one-per-node": (3, {"ranks_per_node": 1}),
    "uneven": (5, {"nodes": [[0, 1, 2], [3], [4]]}),
    "non-contiguous": (6, {"nodes": [[5, 1, 3], [0, 4], [2]]}),
}


def _payload(rank: int) -> bytes:
    return bytes([rank]) * (3 * rank + 1)  # lengths differ, and rank 0's is not the longest


@pytest.mark.parametrize("parts", [[], [b""], [b"a", b"", b"xyz" * 100], [bytes(range(256))] * 7])
def test_frame_round_trip(parts: list[bytes]) -> None:
    assert unframe(frame(parts), len(parts)) == parts


@pytest.mark.parametrize("message", [b"", b"\x01", frame([b"ab"]) + b"x", frame([b"ab"])[:-1], frame([b"a", b"b"])])
def test_a_message_that_is_not_one_frame_of_one_part_is_refused(message: bytes) -> None:
    with pytest.raises(CommunicationError):
        unframe(message, 1)


def test_layouts_are_normalised_and_checked() -> None:
    layout = NodeLayout.of(6, [[5, 1, 3], [4, 0], [2]])
    assert layout.nodes == ((0, 4), (1, 3, 5), (2,))
    assert NodeLayout.blocks(4, 2).nodes == ((0, 1), (2, 3))
    for size, nodes in ((4, [[0, 1], [1, 2, 3]]), (4, [[0, 1], [2]]), (3, [[0, 1, 2], []])):
        with pytest.raises(CheckpointError, match="exactly one node"):
            NodeLayout.of(size, nodes)
    for rank in (1.7, True, "1", None):  # never truncated or converted (an outside attack found 1.7 taken for 1)
        with pytest.raises(CheckpointError, match="integer"):
            NodeLayout.of(2, [[0, rank]])
    with pytest.raises(CheckpointError, match="integer"):
        NodeLayout.of(2, [0, 1])  # type: ignore[list-item]  # not a list of nodes
    assert NodeLayout.of(2, [[np.int64(1), 0]]).nodes == ((0, 1),)
    with pytest.raises(CheckpointError, match="does not divide"):
        NodeLayout.blocks(6, 4)
    with pytest.raises(CheckpointError, match="at least 1"):
        NodeLayout.blocks(4, 0)


def test_the_layout_comes_from_the_arguments_else_from_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from reshard.net.hierarchy import _layout_argument

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _layout_argument(4, None, None).nodes == ((0, 1), (2, 3))
    assert _layout_argument(4, 4, None).nodes == ((0, 1, 2, 3),)
    assert _layout_argument(4, None, [[3, 0], [1, 2]]).nodes == ((0, 3), (1, 2))
    with pytest.raises(CheckpointError, match="not both"):
        _layout_argument(4, 2, [[0, 1], [2, 3]])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(CheckpointError, match="does not divide"):
        _layout_argument(4, None, None)
    for value in ("", "eight"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
        with pytest.raises(CheckpointError, match="LOCAL_WORLD_SIZE"):
            _layout_argument(4, None, None)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(CheckpointError, match="not set"):
        _layout_argument(4, None, None)


def _collectives(transport: Transport) -> tuple[list[bytes] | None, bytes, bytes]:
    rank, size = transport.rank, transport.size
    gathered = transport.gather_bytes(_payload(rank))
    replies = [f"reply to {r}".encode() * (r + 1) for r in range(size)] if rank == 0 else None
    mine = transport.scatter_bytes(replies)
    shared = transport.broadcast_bytes(b"decision" if rank == 0 else None)
    return gathered, mine, shared


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_gather_scatter_broadcast_equal_the_flat_ones(name: str) -> None:
    size, kwargs = LAYOUTS[name]
    flat = ThreadGroup(size, timeout=20)
    hierarchical = HierarchicalThreadGroup(size, timeout=20, **kwargs)
    expected = on_threads(size, lambda r: _collectives(flat.member(r)))
    got = on_threads(size, lambda r: _collectives(hierarchical.member(r)))
    assert got == expected
    assert got[0][0] == [_payload(r) for r in range(size)]
    assert [g[1] for g in got] == [f"reply to {r}".encode() * (r + 1) for r in range(size)]


def test_byte_counters_count_each_level() -> None:
    group = HierarchicalThreadGroup(4, 2, timeout=20)
    transports = [group.member(r) for r in range(4)]
    on_threads(4, lambda r: transports[r].gather_bytes(_payload(r)))
    member, leader, coordinator = transports[3], transports[2], transports[0]
    assert member.level_bytes() == {"node": (len(_payload(3)), 0), "leaders": (0, 0), "flat": (0, 0)}
    node_message = frame([_payload(2), _payload(3)])
    assert leader.level_bytes()["node"] == (len(_payload(2)), len(_payload(3)))
    assert leader.level_bytes()["leaders"] == (len(node_message), 0)
    assert coordinator.level_bytes()["leaders"] == (len(frame([_payload(0), _payload(1)])), len(node_message))
    for t in transports:
        levels = t.level_bytes().values()
        assert t.bytes_sent == sum(s for s, _ in levels) and t.bytes_received == sum(r for _, r in levels)


def test_a_member_of_a_node_that_is_not_its_transport_is_refused() -> None:
    layout = NodeLayout.blocks(4, 2)
    flat, node, leaders = ThreadGroup(4), ThreadGroup(2), ThreadGroup(2)
    with pytest.raises(CheckpointError, match="node transport"):
        HierarchicalTransport(flat.member(2), node.member(1), None, layout)
    with pytest.raises(CheckpointError, match="leaders"):
        HierarchicalTransport(flat.member(3), node.member(1), leaders.member(1), layout)
    with pytest.raises(CheckpointError, match="a node layout of 6 ranks"):
        HierarchicalTransport(flat.member(3), node.member(1), None, NodeLayout.blocks(6, 2))


# ---- Communicator.step and step_scatter over the hierarchy --------------------------------------------------


def _step(group: HierarchicalThreadGroup, failing: int | None = None) -> Any:
    def run(rank: int) -> Any:
        comm = Communicator(group.member(rank), timeout=20)

        def local() -> int:
            if rank == failing:
                raise reshard.StorageError(f"disk full on rank {rank}")
            return rank * 10

        value = comm.step("phase one", local, sum)
        combined, reply = comm.step_scatter(
            "phase two", lambda: str(rank).encode(), lambda bodies: (len(bodies), [b * 2 for b in bodies])
        )
        return value, combined, reply

    return run


def test_step_and_step_scatter_agree_over_the_hierarchy() -> None:
    group = HierarchicalThreadGroup(6, nodes=[[0, 3], [1, 4, 5], [2]], timeout=20)
    results = on_threads(6, _step(group))
    assert results == [(150, 6, str(r).encode() * 2) for r in range(6)]


@pytest.mark.parametrize(
    "failing", [5, 1, 2, 0], ids=["member-of-another-node", "member-of-node-0", "leader", "coordinator"]
)
def test_a_failing_rank_fails_every_rank_with_the_same_error_naming_it(failing: int) -> None:
    group = HierarchicalThreadGroup(6, 2, timeout=20)
    outcomes = outcomes_on_threads(6, _step(group, failing))
    assert all(isinstance(o, reshard.StorageError) for o in outcomes), outcomes
    assert {str(o) for o in outcomes} == {f"phase one failed on rank {failing}: disk full on rank {failing}"}
    assert all(o.failures == {failing: f"disk full on rank {failing}"} for o in outcomes)  # type: ignore[union-attr]


def test_the_coordinators_combine_raising_fails_every_rank_alike() -> None:
    group = HierarchicalThreadGroup(4, 2, timeout=20)

    def run(rank: int) -> Any:
        def combine(values: list[int]) -> int:
            raise reshard.ShardingError("overlapping boxes")

        return Communicator(group.member(rank), timeout=20).step("plan", lambda: rank, combine)

    outcomes = outcomes_on_threads(4, run)
    assert all(type(o) is reshard.ShardingError and str(o) == "overlapping boxes" for o in outcomes), outcomes


def test_a_rank_that_never_arrives_is_a_communication_error_on_the_others_within_the_timeout() -> None:
    timeout = 1.0
    group = HierarchicalThreadGroup(4, 2, timeout=timeout)

    def run(rank: int) -> Any:
        if rank == 3:
            return "absent"
        return Communicator(group.member(rank), timeout=timeout).step("phase", lambda: rank, sum)

    started = time.monotonic()
    outcomes = outcomes_on_threads(4, run)
    assert time.monotonic() - started < 3 * timeout + 2  # each level's wait is bounded (module doc of hierarchy)
    assert outcomes[3] == "absent"
    assert all(isinstance(o, CommunicationError) for o in outcomes[:3]), outcomes


# ---- the real save and load over it -------------------------------------------------------------------------


def test_save_on_two_level_threads_loads_bit_exact_on_a_flat_group(tmp_path: Path) -> None:
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    group = HierarchicalThreadGroup(4, nodes=[[0, 2], [1, 3]], timeout=30)

    def save(rank: int) -> None:
        shard = reshard.ShardedTensor("w", full[2 * rank : 2 * rank + 2].clone(), (8, 6), (2 * rank, 0))
        reshard.save({"w": shard, "step": 7}, tmp_path / "ckpt", group=group.member(rank))

    on_threads(4, save)
    flat = ThreadGroup(2, timeout=30)

    def load(rank: int) -> torch.Tensor:
        template = {"w": reshard.ShardedTensor("w", torch.zeros(8, 3), (8, 6), (0, 3 * rank)), "step": 0}
        loaded = reshard.load(template, tmp_path / "ckpt", group=flat.member(rank))
        assert loaded["step"] == 7
        return loaded["w"].local_tensor if isinstance(loaded["w"], reshard.ShardedTensor) else loaded["w"]

    halves = on_threads(2, load)
    assert torch.equal(torch.cat(halves, dim=1), full)
