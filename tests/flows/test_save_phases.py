"""The phases of a save (reshard.flows.save_phases), each on its own: ranks are threads of this process
(ThreadGroup), the checkpoint a LocalStorage on tmp_path."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import CheckpointError, CheckpointExistsError, ShardingError, StateDictError
from reshard.flows.save_commit import commit, finish
from reshard.flows.save_phases import (
    Described,
    Planned,
    SaveRequest,
    Written,
    describe_rank,
    plan,
    plan_on_coordinator,
    write_assigned,
)
from reshard.flows.stats import PhaseClock
from reshard.io.datafile import data_file_name
from reshard.io.locking import read_lock
from reshard.metadata import DATA_DIR, METADATA_FILE
from reshard.net.comm import Communicator
from reshard.net.transports import ThreadGroup
from reshard.state.sharding import ShardedObject, ShardedTensor
from reshard.storage import Storage, storage_for
from tests.threads import on_threads

pytestmark = pytest.mark.unit

TIMEOUT = datetime.timedelta(seconds=20)


def request_for(storage: Storage, **terms: Any) -> SaveRequest:
    return SaveRequest(storage=storage, checksum_chunk_bytes=1024, memory_budget_bytes=1 << 20, **terms)


def row_state(rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank`` holds row ``rank`` of a (world, 4) tensor, a replicated bias, its cell of an object grid."""
    row = torch.arange(4, dtype=torch.float32) + 10 * rank
    return {
        "w": ShardedTensor(key="w", data=row[None], global_shape=(world, 4), global_offset=(rank, 0)),
        "bias": torch.full((3,), 7.0),
        "rng": ShardedObject(key="rng", value={"seed": rank}, global_shape=(world,), global_offset=(rank,)),
        "step": 5,
    }


def described_ranks(request: SaveRequest, states: list[Any]) -> list[Described]:
    return [describe_rank(request, s, rank=r, is_coordinator=r == 0) for r, s in enumerate(states)]


def clock(rank: int = 0) -> PhaseClock:
    return PhaseClock("save", rank, 0.0)


# ---- 1. describe -------------------------------------------------------------------------------------------


def test_describe_rank_describes_every_box_with_its_view() -> None:
    storage = storage_for("/nonexistent/never/written")
    described = describe_rank(request_for(storage), row_state(1, 2), rank=1, is_coordinator=False)
    assert described.error is None
    keys = [piece.key for piece in described.description.tensors]
    assert sorted(keys) == ["bias", "w"]
    for piece, view in zip(described.description.tensors, described.views, strict=True):
        assert tuple(view.shape) == tuple(piece.box.shape)
    assert [o.key for o in described.description.objects] == ["rng"]
    assert len(described.blobs) == 1
    assert described.payload_or_raise() == described.payload != b""


@pytest.mark.parametrize(
    ("state", "error"),
    [
        ({"w": torch.zeros(4, device="meta")}, StateDictError),  # no memory to read
        ({"bad\udcff": torch.zeros(2)}, StateDictError),  # a lone surrogate
        ({"o": object()}, None),  # a common value that cannot be encoded
    ],
)
def test_describe_rank_keeps_a_hostile_state_as_its_error(state: dict[str, Any], error: type | None) -> None:
    described = describe_rank(request_for(storage_for("/nonexistent")), state, rank=0, is_coordinator=True)
    assert described.error is not None
    if error is not None:
        assert isinstance(described.error, error)
    with pytest.raises(type(described.error)):
        described.payload_or_raise()


def test_describe_rank_refuses_a_chunk_size_that_is_not_a_positive_integer() -> None:
    request = request_for(storage_for("/nonexistent"))
    bad = SaveRequest(storage=request.storage, checksum_chunk_bytes=0, memory_budget_bytes=1 << 20)
    described = describe_rank(bad, row_state(0, 1), rank=0, is_coordinator=True)
    assert isinstance(described.error, CheckpointError)
    assert "checksum_chunk_bytes" in str(described.error)


# ---- 2. plan -------------------------------------------------------------------------------------------------


def test_plan_on_coordinator_elects_one_writer_per_box_and_holds_the_lock(tmp_path: Path) -> None:
    storage = storage_for(tmp_path / "ckpt")
    request = request_for(storage)
    described = described_ranks(request, [row_state(r, 3) for r in range(3)])
    made = plan_on_coordinator(request, [d.payload for d in described], save_id="a" * 32, rank=0)
    try:
        boxes = [(r, i) for r, a in enumerate(made.assignments) for i in a.tensors]
        written = [(described[r].description.tensors[i].key, described[r].description.tensors[i].box) for r, i in boxes]
        assert sorted(k for k, _ in written) == ["bias", "w", "w", "w"]  # the replicated bias once
        assert len(set(written)) == len(written)
        assert sorted(len(a.objects) for a in made.assignments) == [1, 1, 1]
        assert read_lock(storage) is not None
    finally:
        made.undo()
    assert read_lock(storage) is None


def test_plan_on_coordinator_refuses_two_primaries_of_one_box_without_taking_the_lock(tmp_path: Path) -> None:
    storage = storage_for(tmp_path / "ckpt")
    request = request_for(storage)
    states = [row_state(0, 2), row_state(0, 2)]  # both ranks claim row 0 as primary; row 1 is held by none
    described = described_ranks(request, states)
    with pytest.raises(ShardingError, match="claimed as primary by ranks 0 and 1"):
        plan_on_coordinator(request, [d.payload for d in described], save_id="b" * 32, rank=0)
    assert read_lock(storage) is None
    assert not (tmp_path / "ckpt").exists()


def test_plan_on_coordinator_names_a_term_the_ranks_disagree_on(tmp_path: Path) -> None:
    storage = storage_for(tmp_path / "ckpt")
    payloads = [
        describe_rank(request_for(storage, overwrite=r == 1), row_state(r, 2), rank=r, is_coordinator=r == 0).payload
        for r in range(2)
    ]
    with pytest.raises(CheckpointError, match=r"different overwrite: \{False: \[0\], True: \[1\]\}"):
        plan_on_coordinator(request_for(storage), payloads, save_id="c" * 32, rank=0)
    assert not (tmp_path / "ckpt").exists()


def test_plan_on_coordinator_releases_the_lock_when_a_checkpoint_is_there(tmp_path: Path) -> None:
    reshard.save(row_state(0, 1), tmp_path / "ckpt")
    storage = storage_for(tmp_path / "ckpt")
    request = request_for(storage)
    payloads = [d.payload for d in described_ranks(request, [row_state(0, 1)])]
    with pytest.raises(CheckpointExistsError):
        plan_on_coordinator(request, payloads, save_id="d" * 32, rank=0)
    assert read_lock(storage) is None


def plan_on_threads(tmp_path: Path, world: int, states: list[Any]) -> tuple[SaveRequest, list[Any]]:
    group = ThreadGroup(world, timeout=20)
    storage = storage_for(tmp_path / "ckpt")
    request = request_for(storage)

    def rank(r: int) -> tuple[Described, Planned | BaseException]:
        comm = Communicator(group.member(r), timeout=TIMEOUT)
        described = describe_rank(request, states[r], rank=r, is_coordinator=r == 0)
        try:
            return described, plan(comm, request, described, clock(r))
        except CheckpointError as exc:
            return described, exc

    return request, on_threads(world, rank)


def test_plan_gives_every_rank_its_own_assignment_and_the_coordinator_its_plan(tmp_path: Path) -> None:
    request, ranks = plan_on_threads(tmp_path, 3, [row_state(r, 3) for r in range(3)])
    planned = [p for _, p in ranks]
    assert all(isinstance(p, Planned) for p in planned)
    assert len({p.save_id for p in planned}) == 1
    assert planned[0].coordinator is not None and all(p.coordinator is None for p in planned[1:])
    assert [p.assignment for p in planned] == list(planned[0].coordinator.assignments)
    planned[0].coordinator.undo()
    assert read_lock(request.storage) is None


def test_a_hostile_state_on_one_rank_fails_planning_on_every_rank_alike(tmp_path: Path) -> None:
    states: list[Any] = [row_state(r, 2) for r in range(2)]
    states[1] = {**states[1], "bad": torch.zeros(3, device="meta")}
    request, ranks = plan_on_threads(tmp_path, 2, states)
    errors = [p for _, p in ranks]
    assert all(isinstance(e, CheckpointError) for e in errors)
    assert len({str(e) for e in errors}) == 1 and "rank 1" in str(errors[0])
    assert read_lock(request.storage) is None


# ---- 3. write, 4. commit, 5. finish ----------------------------------------------------------------------------


def run_save(tmp_path: Path, world: int, *, break_rank: int | None = None) -> list[Any]:
    """The five phases on ``world`` threads; with ``break_rank``, that rank's data file cannot be created."""
    group = ThreadGroup(world, timeout=20)
    storage = storage_for(tmp_path / "ckpt")
    request = request_for(storage, fingerprint=True)

    def rank(r: int) -> Any:
        comm = Communicator(group.member(r), timeout=TIMEOUT)
        timing = clock(r)
        described = describe_rank(request, row_state(r, world), rank=r, is_coordinator=r == 0)
        planned = plan(comm, request, described, timing)
        if r == break_rank:
            (tmp_path / "ckpt" / data_file_name(planned.save_id, r)).mkdir(parents=True)
        written = write_assigned(request, described, planned, rank=r)
        try:
            committed = commit(comm, request, described, planned, written, timing)
        except CheckpointError as exc:
            return written, exc
        return written, committed, finish(committed, described, written, timing)

    return on_threads(world, rank)


def test_write_then_commit_makes_a_checkpoint_that_loads(tmp_path: Path) -> None:
    ranks = run_save(tmp_path, 2)
    committed = [c for _, c, _ in ranks]
    assert committed[0].metadata is not None and committed[1].metadata is None
    assert committed[0].summary() == committed[1].summary()
    assert committed[0].files == 2 and committed[0].total_bytes == 2 * 4 * 4 + 3 * 4
    stats = [s for _, _, s in ranks]
    assert sum(s.bytes_written for s in stats) == committed[0].total_bytes
    assert sum(s.file_bytes for s in stats) == committed[0].file_bytes
    target = {"w": torch.zeros(2, 4), "bias": torch.zeros(3)}
    reshard.load(target, tmp_path / "ckpt", options=reshard.LoadOptions(verify=True))
    assert torch.equal(target["w"], torch.tensor([[0.0, 1, 2, 3], [10, 11, 12, 13]]))
    assert torch.equal(target["bias"], torch.full((3,), 7.0))


def test_a_failed_write_leaves_nothing_committed_and_no_file(tmp_path: Path) -> None:
    ranks = run_save(tmp_path, 2, break_rank=1)
    written = [w for w, _ in ranks]
    assert written[0].error is None and written[1].error is not None
    errors = [e for _, e in ranks]
    assert all(isinstance(e, CheckpointError) for e in errors) and "rank 1" in str(errors[0])
    assert not (tmp_path / "ckpt" / METADATA_FILE).exists()
    left = [p.name for p in (tmp_path / "ckpt" / DATA_DIR).iterdir() if p.is_file()]
    assert left == []  # rank 0's file went with the failed save
    assert read_lock(storage_for(tmp_path / "ckpt")) is None


def test_write_assigned_writes_no_file_for_an_empty_assignment(tmp_path: Path) -> None:
    request, ranks = plan_on_threads(tmp_path, 2, [row_state(r, 2) for r in range(2)])
    described, planned = ranks[1]
    assert isinstance(planned, Planned)
    nothing = Planned(save_id=planned.save_id, assignment=type(planned.assignment)(tensors=(), objects=()))
    written = write_assigned(request, described, nothing, rank=1)
    assert written == Written(report=written.report, reuse=written.reuse)
    assert written.report.file is None and written.file_bytes == 0
    assert not (tmp_path / "ckpt" / data_file_name(planned.save_id, 1)).exists()
    ranks[0][1].coordinator.undo()
