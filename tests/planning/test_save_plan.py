"""The pieces of save planning (reshard.planning.save_plan) on hand-made descriptions: no ranks, no I/O."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.errors import ShardingError
from reshard.geometry.boxes import Box
from reshard.planning.descriptions import DescriptionTable, LocalSaveDescription, ObjectPiece, TensorPiece
from reshard.planning.save_plan import BoxGroups, elect_writers, header_domains, plan_save_table, untiled_keys

pytestmark = pytest.mark.unit


def piece(
    key: str,
    offset: tuple[int, ...],
    shape: tuple[int, ...],
    *,
    replica: int = 0,
    dtype: str = "float32",
    global_shape: tuple[int, ...] = (4, 4),
) -> TensorPiece:
    return TensorPiece(key=key, dtype=dtype, global_shape=global_shape, box=Box(offset, shape), replica_id=replica)


def table_of(*ranks: list[TensorPiece], objects: list[list[ObjectPiece]] | None = None) -> DescriptionTable:
    cells = objects if objects is not None else [[] for _ in ranks]
    return DescriptionTable.from_descriptions(
        [LocalSaveDescription(tensors=tuple(t), objects=tuple(o)) for t, o in zip(ranks, cells, strict=True)]
    )


def checked(table: DescriptionTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, BoxGroups]:
    piece_key = table.header_key[table.header]
    domain, itemsize, slow = header_domains(table)
    return piece_key, domain, itemsize, slow, BoxGroups.of(table, piece_key, slow)


def test_header_domains_sets_aside_the_keys_ranks_disagree_on() -> None:
    table = table_of(
        [piece("a", (0, 0), (4, 4)), piece("b", (0, 0), (2, 4))],
        [piece("b", (2, 0), (2, 4), dtype="bfloat16"), piece("c", (0,), (8,), dtype="no-such", global_shape=(8,))],
    )
    domain, itemsize, slow = header_domains(table)
    assert {table.keys[k] for k in np.flatnonzero(slow)} == {"b", "c"}
    good = [h for h in range(len(table.header_key)) if table.keys[table.header_key[h]] == "a"]
    assert domain[good[0]].tolist()[:2] == [4, 4] and itemsize[good[0]] == 4


def test_box_groups_put_the_primary_first_and_count_primaries() -> None:
    table = table_of(
        [piece("w", (0, 0), (2, 4), replica=1), piece("w", (2, 0), (2, 4))],
        [piece("w", (0, 0), (2, 4)), piece("w", (2, 0), (2, 4))],  # (2, 0) claimed as primary twice
    )
    _, _, _, _, groups = checked(table)
    assert groups.primaries.tolist() == [1, 2]
    first = groups.primary[0]
    assert (int(table.rank[first]), int(table.index[first])) == (1, 0)  # rank 1's primary before rank 0's replica


def test_untiled_keys_finds_a_gap_and_an_overlap() -> None:
    table = table_of(
        [piece("gap", (0, 0), (2, 4)), piece("ok", (0, 0), (2, 4)), piece("over", (0, 0), (3, 4))],
        [piece("ok", (2, 0), (2, 4)), piece("over", (2, 0), (2, 4))],
    )
    piece_key, domain, _, slow, groups = checked(table)
    untiled = untiled_keys(table, piece_key, slow, groups.primary, domain)
    assert {table.keys[k] for k in np.flatnonzero(untiled)} == {"gap", "over"}


def test_elect_writers_spreads_replicated_boxes_over_their_holders() -> None:
    # Four equal boxes, each held by both ranks: two go to each rank, whatever the primaries say.
    rows = [piece("w", (r, 0), (1, 4), replica=0) for r in range(4)]
    replicas = [piece("w", (r, 0), (1, 4), replica=1) for r in range(4)]
    table = table_of(rows, replicas)
    piece_key, _, itemsize, slow, groups = checked(table)
    assigned = elect_writers(table, piece_key, slow, groups, itemsize, [])
    assert sorted(len(a) for a in assigned) == [2, 2]
    written = sorted((r, i) for r, a in enumerate(assigned) for i in a)
    assert len({i for _, i in written}) == 4  # every box once


def test_plan_save_table_names_the_ranks_of_a_duplicate_primary() -> None:
    table = table_of([piece("w", (0, 0), (4, 4))], [piece("w", (0, 0), (4, 4))])
    with pytest.raises(ShardingError, match="claimed as primary by ranks 0 and 1"):
        plan_save_table(table)


def test_plan_save_table_assigns_each_object_cell_to_its_primary() -> None:
    cells = [
        [ObjectPiece(key="rng", global_shape=(2,), offset=(0,), replica_id=0)],
        [
            ObjectPiece(key="rng", global_shape=(2,), offset=(1,), replica_id=0),
            ObjectPiece(key="rng", global_shape=(2,), offset=(0,), replica_id=1),
        ],
    ]
    table = table_of([piece("w", (0, 0), (4, 4))], [], objects=cells)
    plan = plan_save_table(table)
    assert [a.objects for a in plan] == [(0,), (0,)]
    assert [a.tensors for a in plan] == [(0,), ()]
