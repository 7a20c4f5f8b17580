"""Record buffers (RL rollouts, replay) saved on one number of ranks and loaded on another: every record exactly
once (asserted by id), every field bit-equal; disagreeing and hostile inputs refused with the same error on every
rank. Ranks are threads (:class:`~reshard.net.transports.ThreadGroup`) except one gloo test at 4 -> 2."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.data import FieldSpec, RecordBuffer, load_records, records_state
from reshard.errors import CheckpointError, CorruptCheckpointError, DataStateError, MismatchError, StateDictError
from reshard.net.transports import ThreadGroup
from reshard.storage import CheckpointLocation
from tests.rankpool import RankContext, RankPool
from tests.threads import on_threads

COUNTS = [3, 0, 6, 2]
"""Records per saving rank: uneven, one rank empty."""

TIMEOUT = 60.0


def rollout(ident: int) -> dict[str, torch.Tensor]:
    """Record ``ident``: a length of its own, an int32, a bf16 [L, 2], a bool and a scalar field."""
    gen = torch.Generator().manual_seed(ident)
    length = ident % 5 + 1
    return {
        "tokens": torch.randint(0, 50_000, (length,), generator=gen, dtype=torch.int32),
        "logprobs": torch.randn(length, 2, generator=gen).to(torch.bfloat16),
        "mask": torch.rand(length, generator=gen) > 0.5,
        "reward": torch.randn((), generator=gen),
    }


def job_buffers(counts: list[int], first_id: int = 1000) -> list[RecordBuffer]:
    """Each rank's buffer; ids are not contiguous (every third) so that they travel as ids, not runs; an
    empty rank knows no schema."""
    out, next_id = [], first_id
    for count in counts:
        ids = [next_id + 3 * i for i in range(count)]
        next_id += 3 * count
        out.append(RecordBuffer.from_records([rollout(i) for i in ids], ids) if count else RecordBuffer.empty())
    return out


def save_buffers(path: CheckpointLocation, buffers: list[RecordBuffer], key: str = "rollouts") -> None:
    group = ThreadGroup(len(buffers))

    def rank(r: int) -> None:
        state = {"step": 7, key: records_state(key, buffers[r], group=group.member(r), timeout=TIMEOUT)}
        reshard.save(state, path, group=group.member(r), timeout=TIMEOUT)

    on_threads(len(buffers), rank, group=group)


def load_on(path: CheckpointLocation, world: int, key: str = "rollouts") -> list[RecordBuffer]:
    group = ThreadGroup(world)
    return on_threads(
        world,
        lambda r: load_records(path, key, rank=r, world=world, group=group.member(r), timeout=TIMEOUT),
        group=group,
    )


def every_rank_raises(world: int, run: Callable[[int, ThreadGroup], Any]) -> list[BaseException]:
    """``run(rank, group)`` on every rank; each rank's exception (the test fails if one did not raise)."""
    group = ThreadGroup(world)
    errors: list[BaseException | None] = [None] * world

    def rank(r: int) -> None:
        try:
            run(r, group)
        except CheckpointError as exc:
            errors[r] = exc

    on_threads(world, rank)
    assert all(e is not None for e in errors), errors
    return [e for e in errors if e is not None]


def assert_same_records(loaded: list[RecordBuffer], saved: list[RecordBuffer]) -> None:
    """Every saved record exactly once (by id), in the rank-major order, each field bit-equal."""
    loaded_ids = [i for b in loaded for i in b.ids.tolist()]
    saved_ids = [i for b in saved for i in b.ids.tolist()]
    assert loaded_ids == saved_ids and len(set(loaded_ids)) == len(loaded_ids)
    loaded_records = [record for b in loaded for record in b]
    for ident, record in zip(loaded_ids, loaded_records, strict=True):
        expected = rollout(ident)
        assert record.keys() == expected.keys()
        for name, value in expected.items():
            assert value.dtype == record[name].dtype and torch.equal(record[name], value), (ident, name)


@pytest.mark.unit
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_saved_on_4_uneven_ranks_loads_on_any_number_with_every_record_once(tmp_path: Path, world: int) -> None:
    saved = job_buffers(COUNTS)
    save_buffers(tmp_path / "ckpt", saved)
    loaded = load_on(tmp_path / "ckpt", world)
    assert_same_records(loaded, saved)
    total = sum(COUNTS)
    assert [len(b) for b in loaded] == [len(a) for a in torch.arange(total).tensor_split(world)]  # balanced blocks
    assert all(b.schema == loaded[0].schema and b.schema is not None for b in loaded)


@pytest.mark.unit
def test_4_to_2_to_8_keeps_every_record_and_the_order(tmp_path: Path) -> None:
    saved = job_buffers(COUNTS)
    save_buffers(tmp_path / "a", saved)
    at_two = load_on(tmp_path / "a", 2)
    save_buffers(tmp_path / "b", at_two)  # a resumed job saves again
    at_eight = load_on(tmp_path / "b", 8)
    assert_same_records(at_eight, saved)
    assert sum(1 for b in at_eight if len(b) == 0) == 0 and len(at_eight[7]) == 1


@pytest.mark.unit
def test_contiguous_ids_and_a_step_of_a_manager(tmp_path: Path) -> None:
    ids = [list(range(5)), list(range(5, 6)), [], list(range(6, 9))]
    saved = [
        RecordBuffer.from_records([rollout(i) for i in rank_ids], rank_ids, schema=schema_of_rollouts())
        for rank_ids in ids
    ]
    group = ThreadGroup(4)

    def rank(r: int) -> None:
        manager = reshard.CheckpointManager(tmp_path / "run", group=group.member(r), timeout=TIMEOUT)
        manager.save(20, {"rollouts": records_state("rollouts", saved[r], group=group.member(r))})

    on_threads(4, rank, group=group)
    step = reshard.CheckpointManager(tmp_path / "run").path_of(20)
    assert_same_records(load_on(step, 3), saved)


def schema_of_rollouts() -> dict[str, FieldSpec]:
    return {
        "tokens": FieldSpec(torch.int32, (None,)),
        "logprobs": FieldSpec(torch.bfloat16, (None, 2)),
        "mask": FieldSpec(torch.bool, (None,)),
        "reward": FieldSpec(torch.float32, ()),
    }


@pytest.mark.unit
@pytest.mark.parametrize("schema", [None, "given"])
def test_an_empty_job_saves_and_loads_empty_buffers(tmp_path: Path, schema: str | None) -> None:
    fields = schema_of_rollouts() if schema else None
    save_buffers(tmp_path / "ckpt", [RecordBuffer.empty(fields if r == 2 else None) for r in range(4)])
    loaded = load_on(tmp_path / "ckpt", 3)
    assert [len(b) for b in loaded] == [0, 0, 0]
    expected = tuple(sorted(fields.items())) if fields else ()
    assert all(b.schema == expected and list(b) == [] for b in loaded)


@pytest.mark.unit
def test_ranks_whose_schemas_differ_fail_alike_and_save_nothing(tmp_path: Path) -> None:
    def run(r: int, group: ThreadGroup) -> None:
        record = rollout(r)
        if r == 3:
            record["tokens"] = record["tokens"].to(torch.int64)
        buffer = RecordBuffer.from_records([record], [r])
        reshard.save({"b": records_state("b", buffer, group=group.member(r))}, tmp_path / "c", group=group.member(r))

    errors = every_rank_raises(4, run)
    assert {type(e) for e in errors} == {DataStateError}
    assert all("schemas differ" in str(e) and "int64" in str(e) for e in errors)
    assert not (tmp_path / "c").exists()


@pytest.mark.unit
@pytest.mark.parametrize("contiguous", [True, False])
def test_an_id_held_by_two_ranks_fails_alike(contiguous: bool) -> None:
    ids = [[0, 1, 2], [3, 4], [], [5, 4, 6]] if contiguous else [[0, 10], [20, 30], [], [40, 30]]

    def run(r: int, group: ThreadGroup) -> None:
        buffer = RecordBuffer.from_records([rollout(i) for i in ids[r]], ids[r], schema=schema_of_rollouts())
        records_state("b", buffer, group=group.member(r))

    errors = every_rank_raises(4, run)
    duplicate = 4 if contiguous else 30
    assert {type(e) for e in errors} == {DataStateError}
    assert all(f"record id {duplicate} is held by rank 1 and rank 3" in str(e) for e in errors)


def _save_tampered(path: Path, tamper: Callable[[dict[str, Any]], None], *, everywhere: bool = False) -> None:
    """A checkpoint written by reshard (valid checksums) whose record buffer ``b`` was changed on rank 0 after
    records_state (on every rank with ``everywhere``): what a hostile or buggy writer produces."""
    buffers = job_buffers([4, 3])
    group = ThreadGroup(2)

    def rank(r: int) -> None:
        state = records_state("b", buffers[r], group=group.member(r))
        if r == 0 or everywhere:
            tamper(state)
        reshard.save({"b": state}, path, group=group.member(r))

    on_threads(2, rank, group=group)


def _lengths_off_by_one(state: dict[str, Any]) -> None:
    state["index"].data[0, 1] += 1


def _negative_length(state: dict[str, Any]) -> None:
    state["index"].data[0, 1] = -1


def _repeated_id(state: dict[str, Any]) -> None:
    state["index"].data[1, 0] = state["index"].data[0, 0]


def _fixed_field_of_two_rows(state: dict[str, Any]) -> None:
    column = 1 + sorted(rollout(0)).index("reward")  # the index's columns: the id, then the fields by name
    state["index"].data[0, column] = 2


@pytest.mark.unit
@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (_lengths_off_by_one, "lengths add up to"),
        (_negative_length, "negative id or length"),
        (_repeated_id, "id twice"),
        (_fixed_field_of_two_rows, "is fixed"),
    ],
)
def test_a_hostile_index_is_refused_on_every_rank(
    tmp_path: Path, tamper: Callable[[dict[str, Any]], None], message: str
) -> None:
    _save_tampered(tmp_path / "c", tamper)
    for world in (1, 3):
        errors = every_rank_raises(
            world, lambda r, g, w=world: load_records(tmp_path / "c", "b", rank=r, world=w, group=g.member(r))
        )
        assert {type(e) for e in errors} == {CorruptCheckpointError}, errors
        assert all(message in str(e) for e in errors), errors


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rows": [1000, 0, 0, 0]}, "is saved of the shape"),  # refused from the metadata, before a read
        ({"records": 8}, "does not match its index"),
        ({"version": 2}, "description version 2"),
        ({"schema": [["tokens", "float32", [None]]]}, "does not match its index"),
        ({"schema": [["tokens", "no-such-dtype", [None]]]}, "malformed record schema"),
    ],
)
def test_a_description_that_disagrees_with_the_index_is_refused(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    _save_tampered(tmp_path / "c", lambda state: state["meta"].value.update(change))
    errors = every_rank_raises(2, lambda r, g: load_records(tmp_path / "c", "b", rank=r, world=2, group=g.member(r)))
    assert {type(e) for e in errors} == {CorruptCheckpointError} and all(message in str(e) for e in errors), errors


@pytest.mark.unit
def test_a_field_saved_with_another_dtype_than_its_schema_is_refused(tmp_path: Path) -> None:
    def retyped(state: dict[str, Any]) -> None:
        mask = state["fields"]["mask"]
        state["fields"]["mask"] = reshard.ShardedTensor(
            mask.key, mask.data.to(torch.uint8), mask.global_shape, mask.global_offset
        )

    _save_tampered(tmp_path / "c", lambda state: None)
    _save_tampered(tmp_path / "d", retyped, everywhere=True)
    assert len(load_on(tmp_path / "c", 2, key="b")[0]) == 4
    errors = every_rank_raises(2, lambda r, g: load_records(tmp_path / "d", "b", rank=r, world=2, group=g.member(r)))
    assert {type(e) for e in errors} == {MismatchError}, errors  # never a silent cast of the bytes


@pytest.mark.unit
def test_a_missing_buffer_or_a_data_rank_no_one_loads_is_refused(tmp_path: Path) -> None:
    save_buffers(tmp_path / "c", job_buffers([2, 2]))
    errors = every_rank_raises(
        2, lambda r, g: load_records(tmp_path / "c", "other", rank=r, world=2, group=g.member(r))
    )
    assert {type(e) for e in errors} == {MismatchError} and "no record buffer 'other'" in str(errors[0])
    errors = every_rank_raises(
        2, lambda r, g: load_records(tmp_path / "c", "rollouts", rank=0, world=2, group=g.member(r))
    )
    assert {type(e) for e in errors} == {DataStateError} and "data rank(s) [1]" in str(errors[0])


@pytest.mark.unit
def test_tensor_parallel_peers_of_a_data_rank_get_the_same_records(tmp_path: Path) -> None:
    saved = job_buffers(COUNTS)
    save_buffers(tmp_path / "c", saved)
    group = ThreadGroup(4)  # 2 data ranks x 2 tensor-parallel peers
    loaded = on_threads(
        4, lambda r: load_records(tmp_path / "c", "rollouts", rank=r // 2, world=2, group=group.member(r)), group=group
    )
    assert torch.equal(loaded[0].ids, loaded[1].ids) and torch.equal(loaded[2].ids, loaded[3].ids)
    assert_same_records([loaded[0], loaded[2]], saved)


@pytest.mark.unit
def test_a_buffer_checks_its_records() -> None:
    good = [rollout(1), rollout(2)]
    with pytest.raises(DataStateError, match="dtype"):
        RecordBuffer.from_records([good[0], {**good[1], "tokens": good[1]["tokens"].float()}], [1, 2])
    with pytest.raises(DataStateError, match="does not fit"):
        RecordBuffer.from_records(
            [good[0], {**good[1], "logprobs": torch.zeros(3, 2, 1, dtype=torch.bfloat16)}], [1, 2]
        )
    with pytest.raises(DataStateError, match="does not fit"):
        RecordBuffer.from_records([good[0], {**good[1], "reward": torch.zeros(2)}], [1, 2])
    with pytest.raises(DataStateError, match="fields"):
        RecordBuffer.from_records([good[0], {"tokens": good[1]["tokens"]}], [1, 2])
    with pytest.raises(DataStateError, match="appears 2 times"):
        RecordBuffer.from_records(good, [5, 5])
    with pytest.raises(DataStateError, match="2 ids for 1 records"):
        RecordBuffer.from_records(good[:1], [5, 6])
    with pytest.raises(DataStateError, match="negative"):
        RecordBuffer.from_records(good, [-1, 6])
    with pytest.raises(StateDictError):
        RecordBuffer.from_records([{"tokens": [1, 2]}], [1])
    with pytest.raises(StateDictError):
        records_state("b", [rollout(1)])  # type: ignore[arg-type]
    buffer = RecordBuffer.from_records(good, [7, 9])
    assert torch.equal(buffer[1]["logprobs"], good[1]["logprobs"]) and buffer[-1]["reward"].shape == ()


# ---- one real multi-process run: gloo ranks ----------------------------------------------------------------------


def rank_save_records(ctx: RankContext, path: str) -> None:
    buffer = job_buffers(COUNTS)[ctx.rank]
    reshard.save({"rollouts": records_state("rollouts", buffer, timeout=TIMEOUT)}, path, timeout=TIMEOUT)


def rank_load_records_on_two(ctx: RankContext, path: str) -> list[list[int]] | None:
    group, member = ctx.group_of_size(2)
    if not member:
        return None
    buffer = load_records(path, "rollouts", rank=ctx.rank, world=2, group=group, timeout=TIMEOUT)
    expected = [rollout(i) for i in buffer.ids.tolist()]
    equal = all(torch.equal(record[k], e[k]) for record, e in zip(buffer, expected, strict=True) for k in e)
    return [buffer.ids.tolist(), [int(equal)]]


@pytest.mark.dist
def test_saved_on_four_processes_loaded_on_two(pool4: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    pool4.run_ok(rank_save_records, path)
    results = pool4.run_ok(rank_load_records_on_two, path)
    assert results[2:] == [None, None]
    ids = [i for result in results[:2] for i in result[0]]
    assert ids == [i for b in job_buffers(COUNTS) for i in b.ids.tolist()]
    assert [len(result[0]) for result in results[:2]] == [6, 5] and all(r[1] == [1] for r in results[:2])


# ---- hostile checkpoints written with plain reshard.save, and bad arguments (issue 34, second attack) -------------


def _craft(path: Path, meta: dict[str, Any], index: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
    """A record buffer ``rb`` written field by field with reshard.save (valid checksums): what a hostile writer
    produces without going through records_state."""
    state = {
        "meta": reshard.ShardedObject("rb.meta", meta, (1,), (0,)),
        "index": reshard.ShardedTensor("rb.index", index, tuple(index.shape), (0,) * index.dim()),
        "fields": {
            name: reshard.ShardedTensor(f"rb.fields.{name}", value, tuple(value.shape), (0,) * value.dim())
            for name, value in fields.items()
        },
    }
    reshard.save({"rb": state}, path)


def _good_meta(**change: Any) -> dict[str, Any]:
    meta = {"format": "reshard.records", "version": 1, "schema": [["x", "float32", [None]]], "records": 4, "rows": [6]}
    return {**meta, **change}


def _refused_on(path: Path, world: int, error: type[Exception], message: str) -> None:
    errors = every_rank_raises(world, lambda r, g: load_records(path, "rb", rank=r, world=world, group=g.member(r)))
    assert {type(e) for e in errors} == {error}, errors
    assert all(message in str(e) for e in errors), errors


@pytest.mark.unit
def test_lengths_whose_int64_sum_wraps_to_the_rows_are_refused_never_wrong_rows(tmp_path: Path) -> None:
    big = 2**62  # 4 lengths adding up to 2**64 + 6: 6 in int64, the field's rows
    index = torch.tensor([[10, big], [11, big], [12, big], [13, big + 6]])
    _craft(tmp_path / "c", _good_meta(), index, {"x": torch.arange(6.0)})
    for world in (1, 2, 3):
        _refused_on(tmp_path / "c", world, CorruptCheckpointError, "lengths add up to more rows")


@pytest.mark.unit
def test_the_largest_int64_id_in_an_index_is_a_corrupt_checkpoint(tmp_path: Path) -> None:
    index = torch.tensor([[10, 1], [11, 2], [2**63 - 1, 3], [12, 0]])
    _craft(tmp_path / "c", _good_meta(), index, {"x": torch.arange(6.0)})
    for world in (1, 2):
        _refused_on(tmp_path / "c", world, CorruptCheckpointError, "2**63 - 1")


@pytest.mark.unit
def test_a_huge_trailing_shape_is_refused_before_any_allocation(tmp_path: Path) -> None:
    """The description says rows of 2**40 elements, the saved tensor [6]: refused from the checkpoint's
    metadata, not by the allocator (a 24 TB torch.empty)."""
    index = torch.tensor([[10, 1], [11, 2], [12, 3], [13, 0]])
    _craft(tmp_path / "c", _good_meta(schema=[["x", "float32", [None, 2**40]]]), index, {"x": torch.arange(6.0)})
    for world in (1, 2):
        _refused_on(tmp_path / "c", world, CorruptCheckpointError, "[6, 1099511627776]")


@pytest.mark.unit
@pytest.mark.parametrize("saved", [{"x", "y"}, set()], ids=["a field more", "a field less"])
def test_a_description_listing_other_fields_than_were_saved_is_refused(tmp_path: Path, saved: set[str]) -> None:
    index = torch.tensor([[10, 1], [11, 2], [12, 3], [13, 0]])
    _craft(tmp_path / "c", _good_meta(), index, {name: torch.arange(6.0) for name in saved})
    _refused_on(tmp_path / "c", 2, CorruptCheckpointError, "fields")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "message"), [({"version": True}, "description version True"), ({"records": 4.0}, "4.0 records")]
)
def test_description_values_of_another_type_are_refused(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    index = torch.tensor([[10, 1], [11, 2], [12, 3], [13, 0]])
    _craft(tmp_path / "c", _good_meta(**change), index, {"x": torch.arange(6.0)})
    _refused_on(tmp_path / "c", 1, CorruptCheckpointError, message)


@pytest.mark.unit
def test_field_names_and_buffer_keys_must_be_plain_names(tmp_path: Path) -> None:
    """Buffer 'a' field 'b.index' and buffer 'a.fields.b' would both write checkpoint key 'a.fields.b.index'."""
    ids = [0, 1]
    with pytest.raises(DataStateError, match="plain name"):
        RecordBuffer.from_records([{"b.index": torch.ones(2)} for _ in ids], ids)
    with pytest.raises(DataStateError, match="plain name"):
        RecordBuffer.empty({"a b": FieldSpec(torch.float32, ())})
    for keys in (["a.fields.b", "a.fields.b"], ["", ""], ["a", ""]):
        errors = every_rank_raises(
            2, lambda r, g, k=keys: records_state(k[r], job_buffers([1, 1])[r], group=g.member(r))
        )
        assert {type(e) for e in errors} == {DataStateError}, (keys, errors)
    save_buffers(tmp_path / "c", job_buffers([1, 1]))
    errors = every_rank_raises(
        2, lambda r, g: load_records(tmp_path / "c", "rollouts.x", rank=r, world=2, group=g.member(r))
    )
    assert {type(e) for e in errors} == {DataStateError} and all("plain name" in str(e) for e in errors), errors


@pytest.mark.unit
def test_ranks_passing_different_keys_get_a_data_state_error(tmp_path: Path) -> None:
    errors = every_rank_raises(2, lambda r, g: records_state(["a", "b"][r], job_buffers([1, 1])[r], group=g.member(r)))
    assert {type(e) for e in errors} == {DataStateError} and all("different keys" in str(e) for e in errors)
    save_buffers(tmp_path / "c", job_buffers([1, 1]))
    errors = every_rank_raises(
        2, lambda r, g: load_records(tmp_path / "c", ["rollouts", "other"][r], rank=r, world=2, group=g.member(r))
    )
    assert {type(e) for e in errors} == {DataStateError} and all("different keys" in str(e) for e in errors)


@pytest.mark.unit
def test_a_world_larger_than_the_group_is_refused_before_any_work(tmp_path: Path) -> None:
    """Every data rank must be loaded by a rank of the group: a world of 10**6 (10**12 never returned) is
    refused from the group's size."""
    save_buffers(tmp_path / "c", job_buffers([1]))
    errors = every_rank_raises(
        2, lambda r, g: load_records(tmp_path / "c", "rollouts", rank=r, world=10**6, group=g.member(r))
    )
    assert {type(e) for e in errors} == {DataStateError}
    assert all("world 1000000 has more data ranks than the group's 2 ranks" in str(e) for e in errors), errors


@pytest.mark.unit
def test_from_records_refuses_bad_ids_and_tensors_with_its_own_errors() -> None:
    record = {"x": torch.ones(2)}
    with pytest.raises(DataStateError, match="int64"):
        RecordBuffer.from_records([record], [2**63])
    with pytest.raises(DataStateError, match="reserved"):
        RecordBuffer.from_records([record], [2**63 - 1])
    with pytest.raises(DataStateError, match="a sequence"):
        RecordBuffer.from_records([record], None)  # type: ignore[arg-type]
    with pytest.raises(DataStateError, match="1-D"):
        RecordBuffer.from_records([record, record], torch.tensor([[1, 2]]))
    with pytest.raises(StateDictError, match="meta"):
        RecordBuffer.from_records([{"x": torch.ones(2, device="meta")}], [0])
