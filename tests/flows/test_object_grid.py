"""Per-rank ShardedObjects on a changed grid (issue 38 item 3): ``LoadOptions(object_grid=...)``.

A checkpoint saved by 4 ranks on a 2 x 2 (pp, tp) grid, each cell an RNG-like object, loaded on other grids:
``"exact"`` (the default) refuses any grid change with the same MismatchError on every rank;
``"same_coordinate"`` loads each requested cell from the saved cell of the same coordinate, keeps the
template's value where the saved grid has none, and names both the kept cells and the saved cells nothing
loads; ``"skip"`` loads no cell of a changed grid and names them all. The load runs on in-process ranks
(:class:`~reshard.net.transports.ThreadGroup`); one test runs it on real processes (gloo).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import CheckpointError, CorruptCheckpointError, MismatchError
from reshard.metadata import METADATA_FILE, Metadata
from reshard.metadata.wire import seal_document
from reshard.net.transports import ThreadGroup
from tests.rankpool import RankContext, RankPool
from tests.threads import on_threads

GRID = (2, 2)
FULL = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
TIMEOUT = 60.0
FRESH = "fresh"
"""The template's value of a cell: what a cell that loads nothing keeps."""


def _saved_value(pp: int, tp: int) -> dict[str, Any]:
    return {"cell": [pp, tp], "torch": torch.arange(3) + 10 * pp + tp}


def _save_state(rank: int) -> dict[str, Any]:
    pp, tp = divmod(rank, GRID[1])
    return {
        "w": reshard.ShardedTensor.from_rank_offsets("w", FULL[rank * 2 : rank * 2 + 2].clone(), (0, rank, 4)),
        "rng": reshard.ShardedObject("rng", _saved_value(pp, tp), GRID, (pp, tp)),
        "step": 5,
    }


def _template(rank: int, grid: tuple[int, ...], cell: tuple[int, ...]) -> dict[str, Any]:
    return {"w": torch.zeros(8, 3), "rng": reshard.ShardedObject("rng", FRESH, grid, cell), "step": 0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("object_grid") / "ckpt"
    group = ThreadGroup(4, timeout=20.0)
    on_threads(4, lambda rank: reshard.save(_save_state(rank), path, group=group.member(rank)), group=group)
    return path


def _load_on(
    path: Path, grid: tuple[int, ...], cells: list[tuple[int, ...]], **options: Any
) -> tuple[list[Any], list[reshard.LoadStats], list[str]]:
    """Load on ``len(cells)`` thread ranks, rank r requesting cell ``cells[r]`` of ``grid``: each rank's
    result (or the exception it raised), its stats, and the warnings the load issued."""
    size = len(cells)
    group = ThreadGroup(size, timeout=20.0)
    stats = [reshard.LoadStats() for _ in range(size)]

    def rank_main(rank: int) -> Any:
        try:
            return reshard.load(
                _template(rank, grid, cells[rank]),
                path,
                group=group.member(rank),
                options=reshard.LoadOptions(**options),
                stats=stats[rank],
            )
        except CheckpointError as exc:
            return exc

    with warnings.catch_warnings(record=True) as caught:  # entered once, here: every rank's thread records
        warnings.simplefilter("always")
        results = on_threads(size, rank_main)
    return results, stats, [str(w.message) for w in caught]


def _cells(*cells: tuple[int, ...]) -> list[str]:
    return [f"object 'rng' at {list(c)}" for c in cells]


@pytest.mark.unit
@pytest.mark.parametrize(("grid", "cells"), [((2, 1), [(0, 0), (1, 0)]), ((4, 1), [(r, 0) for r in range(4)])])
def test_the_default_refuses_a_changed_grid_with_the_same_error_on_every_rank(
    ckpt: Path, grid: tuple[int, ...], cells: list[tuple[int, ...]]
) -> None:
    results, _, _ = _load_on(ckpt, grid, cells)
    assert all(isinstance(r, MismatchError) for r in results), results
    messages = {str(r) for r in results}
    assert len(messages) == 1, messages
    (message,) = messages
    assert f"object 'rng': saved grid [2, 2], requested {list(grid)}" in message
    assert "object_grid" in message  # the error says how to load it on another grid


@pytest.mark.unit
def test_same_coordinate_on_a_shrunk_grid_loads_the_cells_both_grids_hold_and_names_the_rest(ckpt: Path) -> None:
    """tp 2 -> 1: rank pp loads saved cell (pp, 0); saved cells (0, 1) and (1, 1) are named, on every rank."""
    results, stats, caught = _load_on(ckpt, (2, 1), [(0, 0), (1, 0)], object_grid="same_coordinate")
    for pp, result in enumerate(results):
        assert not isinstance(result, Exception), result
        assert result["rng"]["cell"] == [pp, 0]
        assert torch.equal(result["rng"]["torch"], torch.arange(3) + 10 * pp)
        assert torch.equal(result["w"], FULL) and result["step"] == 5
        assert stats[pp].objects_kept == ()
        assert stats[pp].objects_ignored == tuple(_cells((0, 1), (1, 1)))
    assert len(caught) == 2, caught
    assert all("'rng'" in w and "[0, 1]" in w and "[1, 1]" in w and "saved grid [2, 2]" in w for w in caught)


@pytest.mark.unit
def test_same_coordinate_on_a_grown_grid_keeps_the_template_value_of_new_cells_and_names_them(ckpt: Path) -> None:
    """pp 2 -> 4, tp 2 -> 1: ranks 0 and 1 load (0, 0) and (1, 0); ranks 2 and 3, cells the checkpoint
    never had, keep their template's value (with strict=True: the policy decided, nothing is missing)."""
    results, stats, caught = _load_on(ckpt, (4, 1), [(r, 0) for r in range(4)], object_grid="same_coordinate")
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result
        assert torch.equal(result["w"], FULL)
        assert stats[rank].objects_ignored == tuple(_cells((0, 1), (1, 1)))
        assert stats[rank].missing == ()
        if rank < 2:
            assert result["rng"]["cell"] == [rank, 0]
            assert stats[rank].objects_kept == ()
        else:
            assert result["rng"] == FRESH
            assert stats[rank].objects_kept == tuple(_cells((rank, 0)))
    assert sum("object 'rng' at [2, 0]" in w for w in caught) == 1, caught
    assert sum("object 'rng' at [3, 0]" in w for w in caught) == 1, caught


@pytest.mark.unit
def test_same_coordinate_on_one_rank(ckpt: Path) -> None:
    results, stats, caught = _load_on(ckpt, (1, 1), [(0, 0)], object_grid="same_coordinate")
    assert results[0]["rng"]["cell"] == [0, 0]
    assert stats[0].objects_ignored == tuple(_cells((0, 1), (1, 0), (1, 1)))
    assert len(caught) == 1


@pytest.mark.unit
def test_skip_loads_no_cell_of_a_changed_grid_and_names_them_all(ckpt: Path) -> None:
    results, stats, caught = _load_on(ckpt, (2, 1), [(0, 0), (1, 0)], object_grid="skip")
    for pp, result in enumerate(results):
        assert not isinstance(result, Exception), result
        assert result["rng"] == FRESH and torch.equal(result["w"], FULL) and result["step"] == 5
        assert stats[pp].objects_kept == tuple(_cells((pp, 0)))
        assert stats[pp].objects_ignored == tuple(_cells((0, 0), (0, 1), (1, 0), (1, 1)))
    assert len(caught) == 2 and all("'rng'" in w for w in caught), caught


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["same_coordinate", "skip"])
def test_an_unchanged_grid_loads_as_ever_under_every_policy(ckpt: Path, policy: str) -> None:
    cells = [(pp, tp) for pp in range(2) for tp in range(2)]
    results, stats, caught = _load_on(ckpt, GRID, cells, object_grid=policy)
    for rank, result in enumerate(results):
        assert result["rng"]["cell"] == list(cells[rank])
        assert stats[rank].objects_kept == () and stats[rank].objects_ignored == ()
    assert caught == []


@pytest.mark.unit
def test_same_coordinate_refuses_another_number_of_axes_on_every_rank(ckpt: Path) -> None:
    """A grid of other axes has no same coordinate: a MismatchError that points at ``skip``."""
    results, _, _ = _load_on(ckpt, (4,), [(0,), (1,)], object_grid="same_coordinate")
    assert all(isinstance(r, MismatchError) for r in results), results
    assert len({str(r) for r in results}) == 1
    assert "saved grid [2, 2]" in str(results[0]) and "'skip'" in str(results[0])


@pytest.mark.unit
def test_an_unknown_policy_is_refused_on_construction() -> None:
    with pytest.raises(ValueError, match="object_grid"):
        reshard.LoadOptions(object_grid="nearest")  # type: ignore[arg-type]


@pytest.mark.unit
def test_ranks_that_pass_different_policies_fail_alike(ckpt: Path) -> None:
    group = ThreadGroup(2, timeout=20.0)

    def rank_main(rank: int) -> Any:
        options = reshard.LoadOptions(object_grid="same_coordinate" if rank == 0 else "skip")
        try:
            return reshard.load(_template(rank, (2, 1), (rank, 0)), ckpt, group=group.member(rank), options=options)
        except CheckpointError as exc:
            return exc

    results = on_threads(2, rank_main)
    assert all(type(r) is CheckpointError for r in results), results
    assert len({str(r) for r in results}) == 1 and "object_grid" in str(results[0])


# ---- real processes ------------------------------------------------------------------------------------------


def rank_save(ctx: RankContext, path: str) -> None:
    reshard.save(_save_state(ctx.rank), path, timeout=TIMEOUT)


def rank_load_on_two(ctx: RankContext, path: str) -> dict[str, Any] | None:
    """On the first 2 of 4 ranks (a 2 x 1 grid): the default load, then one with ``same_coordinate``."""
    group, member = ctx.group_of_size(2)
    if not member:
        return None
    template = _template(ctx.rank, (2, 1), (ctx.rank, 0))
    try:
        reshard.load(template, path, group=group, timeout=TIMEOUT)
        default = ""
    except MismatchError as exc:
        default = str(exc)
    stats = reshard.LoadStats()
    options = reshard.LoadOptions(object_grid="same_coordinate")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        loaded = reshard.load(template, path, group=group, timeout=TIMEOUT, options=options, stats=stats)
    return {
        "default": default,
        "cell": loaded["rng"]["cell"],
        "torch": loaded["rng"]["torch"].tolist(),
        "w": bool(torch.equal(loaded["w"], FULL)),
        "ignored": list(stats.objects_ignored),
    }


@pytest.mark.dist
def test_saved_on_four_processes_resumed_on_two_with_same_coordinate(pool4: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    pool4.run_ok(rank_save, path)
    results = pool4.run_ok(rank_load_on_two, path)
    assert results[2:] == [None, None]
    defaults = {r["default"] for r in results[:2]}
    assert len(defaults) == 1 and "saved grid [2, 2], requested [2, 1]" in defaults.pop()
    for pp, result in enumerate(results[:2]):
        assert result["cell"] == [pp, 0] and result["torch"] == [10 * pp, 10 * pp + 1, 10 * pp + 2]
        assert result["w"]
        assert result["ignored"] == _cells((0, 1), (1, 1))


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["exact", "same_coordinate", "skip"])
def test_ranks_whose_templates_give_an_object_different_grids_fail_alike(ckpt: Path, policy: str) -> None:
    """Found by the outside attack on the policy: rank 0's template kept the saved grid [2, 2] while rank 1's
    asked for [2, 3]; under ``skip`` rank 0 loaded its cell and rank 1's stats named it as loaded by no rank. A
    grid is global: ranks that disagree on it get the same MismatchError, naming each rank's grid."""
    group = ThreadGroup(2, timeout=20.0)
    grids = [(2, 2), (2, 3)]

    def rank_main(rank: int) -> Any:
        try:
            return reshard.load(
                _template(rank, grids[rank], (0, rank)),
                ckpt,
                group=group.member(rank),
                options=reshard.LoadOptions(object_grid=policy),
            )
        except CheckpointError as exc:
            return exc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = on_threads(2, rank_main)
    assert all(isinstance(r, MismatchError) for r in results), results
    assert len({str(r) for r in results}) == 1
    if policy == "exact":  # rank 1's grid differs from the saved one: refused before the ranks compare
        assert "saved grid [2, 2], requested [2, 3]" in str(results[0]), results[0]
    else:
        assert "different grids" in str(results[0]) and "[2, 2] on ranks [0]" in str(results[0]), results[0]


@pytest.mark.unit
def test_a_saved_object_grid_of_no_cells_is_a_corrupt_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    """Found by the second outside attack (F4): ``metadata.json`` (a hostile or damaged edit, its checksum
    recomputed) whose object has ``global_shape [0]`` and no entries was accepted, though no save writes one. It is
    refused with CorruptCheckpointError when parsed, naming the object."""
    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt, damaged)
    doc = json.loads((damaged / METADATA_FILE).read_bytes())
    doc.pop("metadata_crc32c")
    doc["objects"]["rng"].update(global_shape=[0], entries=[])
    raw = seal_document(json.dumps(doc, separators=(",", ":")).encode())
    (damaged / METADATA_FILE).write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=r"objects\['rng'\].*no cells"):
        Metadata.from_json_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match="no cells"):
        reshard.load({"rng": reshard.ShardedObject("rng", FRESH, (1,), (0,))}, damaged)


@pytest.mark.unit
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("tensor_on", [(1,), (0, 1)])
def test_a_key_saved_as_an_object_and_asked_for_as_a_tensor_names_both_kinds_on_every_rank(
    ckpt: Path, strict: bool, tensor_on: tuple[int, ...]
) -> None:
    """Found by the second outside attack (F3): a template holding a tensor for the key saved as a ShardedObject was
    told the key is "missing from the checkpoint"; with ``strict=False`` that rank silently kept its tensor while
    another rank loaded the object. The kinds differ: the same MismatchError on every rank, naming the key and both
    kinds, strict or not."""
    group = ThreadGroup(2, timeout=20.0)

    def rank_main(rank: int) -> Any:
        rng = torch.zeros(3) if rank in tensor_on else reshard.ShardedObject("rng", FRESH, (2, 1), (rank, 0))
        try:
            return reshard.load(
                {"w": torch.zeros(8, 3), "rng": rng},
                ckpt,
                group=group.member(rank),
                strict=strict,
                options=reshard.LoadOptions(object_grid="same_coordinate"),
            )
        except CheckpointError as exc:
            return exc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = on_threads(2, rank_main)
    assert all(isinstance(r, MismatchError) for r in results), results
    assert all("'rng'" in str(r) and "ShardedObject" in str(r) and "tensor" in str(r) for r in results), results


@pytest.mark.unit
def test_a_key_saved_as_a_tensor_and_asked_for_as_an_object_names_both_kinds(ckpt: Path) -> None:
    """The reverse of the test above (F3): a ShardedObject for the key saved as a tensor, even with strict=False."""
    with pytest.raises(MismatchError, match=r"'w': saved as a tensor, requested as a ShardedObject"):
        reshard.load({"w": reshard.ShardedObject("w", FRESH, (1,), (0,))}, ckpt, strict=False)
