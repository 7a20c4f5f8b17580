"""Single-process tests of the tiling check and of save planning (validation and writer election).

Every test builds the descriptions of N simulated ranks by hand and calls the pure planning functions,
as the coordinator would after gathering them.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard.errors import ShardingError
from reshard.geometry.boxes import Box
from reshard.geometry.tiling import TilingProblem, find_tiling_problem
from reshard.planning.descriptions import LocalSaveDescription, ObjectPiece, TensorPiece, WriteAssignment
from reshard.planning.save_plan import plan_save
from reshard.state.sharding import ReplicaId
from tests.tiers import examples

PROPERTY = settings(max_examples=examples(100), deadline=None, database=None)


def grid_boxes(global_shape: tuple[int, ...], cuts: list[list[int]]) -> list[Box]:
    """The boxes of a regular grid: ``cuts[axis]`` are the interior cut points of that axis."""
    intervals = []
    for size, axis_cuts in zip(global_shape, cuts, strict=True):
        bounds = [0, *axis_cuts, size]
        intervals.append([(lo, hi - lo) for lo, hi in itertools.pairwise(bounds)])
    return [Box(tuple(lo for lo, _ in combo), tuple(n for _, n in combo)) for combo in itertools.product(*intervals)]


# --------------------------------------------------------------------------------------------------
# find_tiling_problem


@pytest.mark.unit
class TestFindTilingProblem:
    def test_exact_grid_tiling(self) -> None:
        assert find_tiling_problem((4, 6), grid_boxes((4, 6), [[2], [1, 3]])) is None

    def test_uneven_tiling_in_any_order(self) -> None:
        boxes = [Box((0, 0), (3, 2)), Box((3, 0), (1, 5)), Box((0, 2), (3, 3))]
        for perm in itertools.permutations(boxes):
            assert find_tiling_problem((4, 5), list(perm)) is None

    def test_gap(self) -> None:
        boxes = grid_boxes((4, 6), [[2], [3]])
        del boxes[1]
        problem = find_tiling_problem((4, 6), boxes)
        assert problem == TilingProblem("gap", (), 18, 24)

    def test_no_boxes_at_all(self) -> None:
        assert find_tiling_problem((3,), []) == TilingProblem("gap", (), 0, 3)

    def test_overlap_names_the_two_boxes(self) -> None:
        boxes = [Box((0, 0), (2, 6)), Box((2, 0), (2, 3)), Box((2, 3), (2, 3)), Box((1, 5), (2, 1))]
        problem = find_tiling_problem((4, 6), boxes)
        assert problem is not None
        assert problem.kind == "overlap"
        assert problem.indices in {(0, 3), (2, 3)}
        a, b = (boxes[i] for i in problem.indices)
        assert a.intersect(b) is not None

    def test_overlap_with_the_same_total_volume_is_not_mistaken_for_a_tiling(self) -> None:
        # Volumes add up to the tensor's, but one box overlaps another and an element is uncovered.
        boxes = [Box((0,), (3,)), Box((2,), (3,))]
        problem = find_tiling_problem((5,), [*boxes, Box((4,), (0,))])
        assert problem is not None
        assert problem.kind == "overlap"
        assert problem.indices == (0, 1)

    def test_duplicate_box_is_an_overlap(self) -> None:
        boxes = [*grid_boxes((3, 3), [[1], [1]]), Box((1, 1), (2, 2))]
        problem = find_tiling_problem((3, 3), boxes)
        assert problem == TilingProblem("overlap", (3, 4), 0, 9)

    def test_zero_dimensional(self) -> None:
        scalar = Box((), ())
        assert find_tiling_problem((), [scalar]) is None
        assert find_tiling_problem((), []) == TilingProblem("gap", (), 0, 1)
        problem = find_tiling_problem((), [scalar, scalar])
        assert problem is not None
        assert problem.kind == "overlap"
        assert problem.indices == (0, 1)

    def test_zero_volume_boxes_are_ignored(self) -> None:
        boxes = [Box((0, 0), (0, 4)), *grid_boxes((2, 4), [[1], []]), Box((1, 2), (3, 0))]
        assert find_tiling_problem((2, 4), boxes) is None

    def test_zero_volume_boxes_keep_their_indices(self) -> None:
        boxes = [Box((0,), (0,)), Box((0,), (3,)), Box((1,), (1,))]
        problem = find_tiling_problem((3,), boxes)
        assert problem is not None
        assert problem.indices == (1, 2)

    def test_zero_volume_tensor(self) -> None:
        assert find_tiling_problem((0, 3), []) is None
        assert find_tiling_problem((0, 3), [Box((0, 0), (0, 3))]) is None
        assert find_tiling_problem((2, 0), [Box((0, 0), (1, 0)), Box((0, 0), (2, 0))]) is None


@st.composite
def grid_tiling(draw: st.DrawFn) -> tuple[tuple[int, ...], list[Box]]:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
    cuts = [sorted(draw(st.sets(st.integers(1, max(s - 1, 1)), max_size=max(s - 1, 0)))) for s in shape]
    cuts = [[c for c in axis_cuts if 0 < c < s] for axis_cuts, s in zip(cuts, shape, strict=True)]
    boxes = grid_boxes(shape, cuts)
    return shape, draw(st.permutations(boxes))


@pytest.mark.unit
class TestFindTilingProblemProperties:
    @PROPERTY
    @given(tiling=grid_tiling())
    def test_any_grid_tiles(self, tiling: tuple[tuple[int, ...], list[Box]]) -> None:
        shape, boxes = tiling
        assert find_tiling_problem(shape, boxes) is None

    @PROPERTY
    @given(tiling=grid_tiling(), data=st.data())
    def test_removing_a_box_leaves_a_gap(self, tiling: tuple[tuple[int, ...], list[Box]], data: st.DataObject) -> None:
        shape, boxes = tiling
        removed = boxes.pop(data.draw(st.integers(0, len(boxes) - 1)))
        problem = find_tiling_problem(shape, boxes)
        assert problem == TilingProblem("gap", (), math.prod(shape) - removed.volume, math.prod(shape))

    @PROPERTY
    @given(tiling=grid_tiling(), data=st.data())
    def test_adding_any_box_makes_an_overlap(
        self, tiling: tuple[tuple[int, ...], list[Box]], data: st.DataObject
    ) -> None:
        shape, boxes = tiling
        offset = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
        extra = Box(offset, tuple(data.draw(st.integers(1, s - o)) for o, s in zip(offset, shape, strict=True)))
        position = data.draw(st.integers(0, len(boxes)))
        boxes.insert(position, extra)
        problem = find_tiling_problem(shape, boxes)
        assert problem is not None
        assert problem.kind == "overlap"
        i, j = problem.indices
        assert i < j
        assert boxes[i].intersect(boxes[j]) is not None


# --------------------------------------------------------------------------------------------------
# plan_save


def piece(
    key: str,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    global_shape: tuple[int, ...],
    *,
    replica_id: ReplicaId = 0,
    dtype: str = "float32",
) -> TensorPiece:
    return TensorPiece(key=key, dtype=dtype, global_shape=global_shape, box=Box(offset, shape), replica_id=replica_id)


def cell(key: str, offset: tuple[int, ...], global_shape: tuple[int, ...], replica_id: ReplicaId = 0) -> ObjectPiece:
    return ObjectPiece(key=key, global_shape=global_shape, offset=offset, replica_id=replica_id)


def desc(*tensors: TensorPiece, objects: tuple[ObjectPiece, ...] = ()) -> LocalSaveDescription:
    return LocalSaveDescription(tensors=tuple(tensors), objects=tuple(objects))


def written(descriptions: list[LocalSaveDescription], plan: list[WriteAssignment]) -> list[tuple[int, TensorPiece]]:
    """(writer rank, piece) for every written tensor piece."""
    return [(rank, descriptions[rank].tensors[i]) for rank, a in enumerate(plan) for i in a.tensors]


def sharding_error(descriptions: list[LocalSaveDescription]) -> str:
    with pytest.raises(ShardingError) as info:
        plan_save(descriptions)
    assert isinstance(info.value, ValueError)
    return str(info.value)


@pytest.mark.unit
class TestPlanSaveValidation:
    def test_valid_layout_writes_every_box_once(self) -> None:
        g = (4, 6)
        descriptions = [desc(piece("w", (0, 0), (2, 6), g)), desc(piece("w", (2, 0), (2, 6), g))]
        plan = plan_save(descriptions)
        assert plan == [WriteAssignment(tensors=(0,), objects=()), WriteAssignment(tensors=(0,), objects=())]

    def test_dtype_disagreement(self) -> None:
        g = (4,)
        message = sharding_error(
            [desc(piece("w", (0,), (2,), g)), desc(piece("w", (2,), (2,), g, dtype="bfloat16"))],
        )
        assert "'w'" in message
        assert "dtype" in message
        assert "rank 0 has float32" in message
        assert "rank 1 has bfloat16" in message

    def test_global_shape_disagreement(self) -> None:
        message = sharding_error(
            [desc(piece("w", (0,), (2,), (4,))), desc(), desc(piece("w", (2,), (2,), (5,)))],
        )
        assert "'w'" in message
        assert "global_shape" in message
        assert "rank 0 has [4]" in message
        assert "rank 2 has [5]" in message

    def test_overlapping_primaries(self) -> None:
        g = (6, 4)
        descriptions = [
            # A valid tensor, and an empty piece of the faulty one (empty pieces are ignored).
            desc(piece("b", (0, 0), (6, 4), g), piece("layer.w", (0, 0), (0, 4), g)),
            desc(piece("layer.w", (0, 0), (4, 4), g)),
            desc(piece("layer.w", (3, 0), (3, 4), g)),
        ]
        message = sharding_error(descriptions)
        assert "'layer.w'" in message
        assert "overlap" in message
        assert "rank 1 offset [0, 0] shape [4, 4]" in message
        assert "rank 2 offset [3, 0] shape [3, 4]" in message

    def test_duplicate_primary_claim(self) -> None:
        g = (4, 4)
        descriptions = [
            desc(piece("w", (0, 0), (2, 4), g)),
            desc(piece("w", (2, 0), (2, 4), g)),
            desc(piece("w", (2, 0), (2, 4), g)),  # a DP copy that forgot its replica_id
        ]
        message = sharding_error(descriptions)
        assert "'w'" in message
        assert "claimed as primary by ranks 1 and 2" in message
        assert "replica_id" in message

    def test_duplicate_primary_claim_with_tuple_replica_ids(self) -> None:
        g = (4,)
        descriptions = [desc(piece("w", (0,), (4,), g, replica_id=(0, 0))), desc(piece("w", (0,), (4,), g))]
        assert "claimed as primary by ranks 0 and 1" in sharding_error(descriptions)

    def test_gap(self) -> None:
        g = (8,)
        descriptions = [
            desc(piece("w", (0,), (2,), g)),
            desc(piece("w", (2,), (2,), g)),
            desc(piece("w", (4,), (2,), g, replica_id=1)),  # a replica of a box no rank holds as primary
            desc(piece("w", (6,), (2,), g)),
        ]
        message = sharding_error(descriptions)
        assert "'w'" in message
        assert "rank 2 holds a replica" in message  # the rank whose replica_id is wrong is named first
        del descriptions[2]
        message = sharding_error(descriptions)
        assert "cover 6 of 8 elements" in message
        assert "[0, 1, 2]" in message

    def test_missing_tensor_on_some_ranks_is_a_gap(self) -> None:
        g = (4,)
        message = sharding_error([desc(piece("w", (0,), (2,), g)), desc()])
        assert "cover 2 of 4" in message
        assert "ranks with primaries: [0]" in message

    def test_replica_box_matching_no_primary(self) -> None:
        g = (4, 4)
        descriptions = [
            desc(piece("w", (0, 0), (2, 4), g)),
            desc(piece("w", (2, 0), (2, 4), g)),
            desc(piece("w", (0, 0), (2, 4), g, replica_id=1)),
            desc(piece("w", (1, 0), (2, 4), g, replica_id=(1, 2))),  # shifted by one row
        ]
        message = sharding_error(descriptions)
        assert "'w'" in message
        assert "rank 3" in message
        assert "replica" in message
        assert "offset [1, 0] shape [2, 4]" in message

    def test_replica_of_part_of_a_primary_box_is_refused(self) -> None:
        g = (4,)
        descriptions = [desc(piece("w", (0,), (4,), g)), desc(piece("w", (0,), (2,), g, replica_id=1))]
        assert "rank 1" in sharding_error(descriptions)

    def test_all_replicas_and_no_primary(self) -> None:
        g = (3,)
        descriptions = [desc(piece("w", (0,), (3,), g, replica_id=1)), desc(piece("w", (0,), (3,), g, replica_id=2))]
        message = sharding_error(descriptions)
        assert "'w'" in message
        assert "primary" in message
        assert "[0, 1]" in message

    def test_zero_volume_pieces_are_not_written(self) -> None:
        g = (4, 3)
        descriptions = [
            desc(piece("w", (0, 0), (4, 3), g)),
            desc(piece("w", (4, 0), (0, 3), g)),
            desc(piece("w", (2, 0), (0, 3), g, replica_id=1)),
        ]
        plan = plan_save(descriptions)
        assert [a.tensors for a in plan] == [(0,), (), ()]

    def test_zero_volume_tensor_has_nothing_to_write(self) -> None:
        g = (0, 5)
        plan = plan_save([desc(piece("e", (0, 0), (0, 5), g)), desc(piece("e", (0, 0), (0, 5), g, replica_id=1))])
        assert [a.tensors for a in plan] == [(), ()]

    def test_scalar_tensor(self) -> None:
        descriptions = [desc(piece("s", (), (), (), replica_id=r)) for r in range(3)]
        plan = plan_save(descriptions)
        assert sum(len(a.tensors) for a in plan) == 1

    def test_box_outside_global_shape_is_refused(self) -> None:
        g = (4,)
        # [0, 2) and [3, 5): element 2 is held by nobody, element 4 lies outside the tensor.
        descriptions = [desc(piece("w", (0,), (2,), g)), desc(piece("w", (3,), (2,), g))]
        message = sharding_error(descriptions)
        assert "'w'" in message
        assert "rank 1" in message

    def test_box_of_the_wrong_rank_is_refused(self) -> None:
        g = (4, 2)
        descriptions = [desc(piece("w", (0, 0), (2, 2), g)), desc(piece("w", (2,), (2,), g))]
        assert "'w'" in sharding_error(descriptions)


@pytest.mark.unit
class TestPlanSaveObjects:
    def test_one_writer_per_cell(self) -> None:
        grid = (2, 2)
        descriptions = [
            desc(objects=(cell("rng", (pp, tp), grid, replica_id=dp),))
            for dp in range(2)
            for pp in range(2)
            for tp in range(2)
        ]
        plan = plan_save(descriptions)
        writers = [rank for rank, a in enumerate(plan) for _ in a.objects]
        assert writers == [0, 1, 2, 3]

    def test_grid_shape_disagreement(self) -> None:
        message = sharding_error([desc(objects=(cell("rng", (0,), (2,)),)), desc(objects=(cell("rng", (1,), (3,)),))])
        assert "object 'rng'" in message
        assert "rank 0 has [2]" in message
        assert "rank 1 has [3]" in message

    def test_duplicate_cell(self) -> None:
        descriptions = [
            desc(objects=(cell("rng", (0,), (2,)),)),
            desc(objects=(cell("rng", (1,), (2,)),)),
            desc(objects=(cell("rng", (1,), (2,)),)),
        ]
        message = sharding_error(descriptions)
        assert "object 'rng'" in message
        assert "cell [1]" in message
        assert "ranks 1 and 2" in message

    def test_missing_cell_held_by_no_rank(self) -> None:
        grid = (2, 2)
        descriptions = [desc(objects=(cell("rng", c, grid),)) for c in [(0, 0), (0, 1), (1, 1)]]
        message = sharding_error(descriptions)
        assert "object 'rng'" in message
        assert "1 of 4 cells have no primary" in message
        assert "[[1, 0]]" in message
        assert "held by no rank" in message

    def test_missing_cell_held_only_as_replica(self) -> None:
        descriptions = [
            desc(objects=(cell("rng", (0,), (2,)),)),
            desc(objects=(cell("rng", (1,), (2,), replica_id=3),)),
        ]
        message = sharding_error(descriptions)
        assert "held only as replicas" in message
        assert "[[1]]" in message

    def test_scalar_grid(self) -> None:
        descriptions = [desc(objects=(cell("cfg", (), (), replica_id=r),)) for r in range(3)]
        assert [a.objects for a in plan_save(descriptions)] == [(0,), (), ()]
        message = sharding_error([desc(objects=(cell("cfg", (), (), replica_id=1),))])
        assert "1 of 1 cells" in message


# --------------------------------------------------------------------------------------------------
# Writer election


def replicated_layout(sizes: list[int], replicas: int) -> list[LocalSaveDescription]:
    """``replicas`` ranks that each hold every tensor ``t{i}`` (1-D, ``sizes[i]`` elements) whole, as plain
    tensors are described: replica_id = rank."""
    return [
        desc(*(piece(f"t{i}", (0,), (n,), (n,), replica_id=rank) for i, n in enumerate(sizes)))
        for rank in range(replicas)
    ]


@pytest.mark.unit
class TestWriterElection:
    def test_replicas_of_equal_boxes_are_spread_over_holders(self) -> None:
        descriptions = replicated_layout([16] * 8, 4)
        plan = plan_save(descriptions)
        assert [len(a.tensors) for a in plan] == [2, 2, 2, 2]

    def test_largest_box_goes_first_to_the_least_loaded(self) -> None:
        descriptions = replicated_layout([100, 60, 50, 10], 2)
        writers = {p.key: rank for rank, p in written(descriptions, plan_save(descriptions))}
        # 100 -> rank 0; 60 -> rank 1; 50 -> rank 1 (60 < 100); 10 -> rank 0 (100 < 110).
        assert writers == {"t0": 0, "t1": 1, "t2": 1, "t3": 0}

    def test_ties_go_to_the_lower_rank(self) -> None:
        descriptions = replicated_layout([8], 3)
        assert [a.tensors for a in plan_save(descriptions)] == [(0,), (), ()]

    def test_writer_holds_the_box(self) -> None:
        # TP=2 x DP=2: each half is held by two ranks; each is written once, by one of its holders.
        g = (4, 4)
        descriptions = [
            desc(
                piece("w", (2 * tp, 0), (2, 4), g, replica_id=dp), piece("n", (0,), (4,), (4,), replica_id=2 * dp + tp)
            )
            for dp in range(2)
            for tp in range(2)
        ]
        plan = plan_save(descriptions)
        boxes = Counter((p.key, p.box) for _, p in written(descriptions, plan))
        assert boxes == Counter(
            {("w", Box((0, 0), (2, 4))): 1, ("w", Box((2, 0), (2, 4))): 1, ("n", Box((0,), (4,))): 1}
        )
        assert sorted(len(a.tensors) for a in plan) == [0, 1, 1, 1]

    def test_election_is_deterministic_and_survives_a_json_round_trip(self) -> None:
        descriptions = replicated_layout([5, 7, 7, 3, 11, 2, 7], 3)
        plan = plan_save(descriptions)
        assert plan_save(descriptions) == plan
        round_tripped = [LocalSaveDescription.from_json(json.loads(json.dumps(d.to_json()))) for d in descriptions]
        assert round_tripped == descriptions
        assert plan_save(round_tripped) == plan


@st.composite
def replicated_grid_layout(draw: st.DrawFn) -> list[LocalSaveDescription]:
    """Several tensors, each cut on a grid and replicated a random number of times; the copies of a box
    are given to random ranks (the primary anywhere) and every rank's pieces come in a random order."""
    n_ranks = draw(st.integers(1, 6))
    per_rank: list[list[TensorPiece]] = [[] for _ in range(n_ranks)]
    for t in range(draw(st.integers(1, 3))):
        shape, boxes = draw(grid_tiling())
        dtype = draw(st.sampled_from(["float32", "bfloat16", "int64", "bool"]))
        for box in boxes:
            copies = draw(st.integers(1, n_ranks))
            holders = draw(st.permutations(range(n_ranks)))[:copies]
            for replica, rank in enumerate(holders):
                rid: ReplicaId = replica if draw(st.booleans()) else (0, replica)
                per_rank[rank].append(
                    TensorPiece(key=f"k{t}", dtype=dtype, global_shape=shape, box=box, replica_id=rid)
                )
    return [desc(*draw(st.permutations(pieces))) for pieces in per_rank]


@pytest.mark.dist  # hypothesis at scale, seconds: kept out of make test-fast
class TestWriterElectionProperties:
    @PROPERTY
    @given(descriptions=replicated_grid_layout())
    def test_every_box_is_written_exactly_once_by_a_holder(self, descriptions: list[LocalSaveDescription]) -> None:
        plan = plan_save(descriptions)
        assert len(plan) == len(descriptions)
        for rank, assignment in enumerate(plan):
            assert list(assignment.tensors) == sorted(set(assignment.tensors))
            assert all(0 <= i < len(descriptions[rank].tensors) for i in assignment.tensors)
        writes = Counter((p.key, p.box) for _, p in written(descriptions, plan))
        unique = {(p.key, p.box) for d in descriptions for p in d.tensors if p.box.volume > 0}
        assert set(writes) == unique
        assert all(n == 1 for n in writes.values())
        assert plan_save(descriptions) == plan

    @PROPERTY
    @given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12), replicas=st.integers(1, 5))
    def test_fully_replicated_load_is_balanced(self, sizes: list[int], replicas: int) -> None:
        descriptions = replicated_layout(sizes, replicas)
        plan = plan_save(descriptions)
        loads = [sum(descriptions[r].tensors[i].box.volume * 4 for i in a.tensors) for r, a in enumerate(plan)]
        assert sum(loads) == sum(sizes) * 4
        # Greedy largest-first to the least loaded: no rank exceeds the average by more than one box.
        assert max(loads) <= sum(loads) / replicas + max(sizes) * 4


@pytest.mark.unit
def test_error_messages_quote_the_key_exactly() -> None:
    key = "decoder.layers.3.mlp.experts.7.weight"
    g = (2,)
    message = sharding_error([desc(piece(key, (0,), (1,), g))])
    assert re.search(re.escape(repr(key)), message)
