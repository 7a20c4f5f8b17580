"""Issue 32, the outside attack on low-precision state: the values a scaled tensor holds once for several
ranks (a whole-axis scale cell, the NVFP4 global scale) must be given alike by every rank that holds them
(S4); a strict=False load of a scaled template whose data is missing (S5); empty NVFP4 and MX tensors (S7).

In-process ranks (ThreadGroup): the real save, load and peer-memory protocols."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import ScaledTensor, ShardedTensor
from reshard.state.quantize import quantize
from tests.flows.test_scaled import errors_on_ranks, on_ranks, same_bytes

pytestmark = pytest.mark.unit

E4M3 = torch.float8_e4m3fn


def _per_tensor_rows(rank: int, *, agree: bool) -> ScaledTensor:
    """Rank ``rank`` of 2 holding rows of a per-tensor FP8 ``w`` (one scale, a whole-axis cell on both axes):
    with ``agree`` both ranks give the same scale, else each its own slice's."""
    full = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    full[2:] *= 100
    q = quantize(full if agree else full[2 * rank : 2 * rank + 2], "fp8_e4m3", block=None)
    data = q.data[2 * rank : 2 * rank + 2] if agree else q.data
    return ScaledTensor(ShardedTensor.from_rank_offsets("w", data.clone(), (0, rank, 2)), q.scale, "fp8_e4m3")


def _nvfp4_rows(rank: int, *, agree: bool) -> ScaledTensor:
    """Rank ``rank`` of 2 holding rows of an NVFP4 ``n``; with ``agree`` one global scale, else each rank its own."""
    full = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    full[2:] *= 1000
    q = quantize(full if agree else full[2 * rank : 2 * rank + 2], "nvfp4")
    rows = slice(2 * rank, 2 * rank + 2) if agree else slice(0, 2)
    sharded = ShardedTensor.from_rank_offsets("n", q.data[rows].clone(), (0, rank, 2))
    assert q.global_scale is not None
    return ScaledTensor(sharded, q.scale[rows].clone(), "nvfp4", global_scale=q.global_scale.clone())


def _assert_refused_naming(errors: list[BaseException | None], key: str) -> None:
    assert all(isinstance(e, reshard.ShardingError) for e in errors), errors
    for e in errors:
        assert key in str(e) and "ranks [0]" in str(e) and "[1]" in str(e), e


@pytest.mark.parametrize("case", ["per-tensor scale", "nvfp4 global scale"])
def test_a_save_refuses_ranks_that_give_different_copies_of_one_scale(tmp_path: Path, case: str) -> None:
    """Two TP ranks each quantize their own rows: the per-tensor scale (a whole-axis cell) or the NVFP4 global
    scale differs between them. Was: rank 0's kept, rank 1's data decoded with it (errors of 191 on values of
    195). Now a ShardingError on every rank naming the key and the ranks, nothing written; ranks that agree
    save and load bit for bit."""
    build, key = (_per_tensor_rows, "'w:scale'") if case == "per-tensor scale" else (_nvfp4_rows, "'n:global_scale'")
    name = key.strip("'").split(":")[0]

    def save(rank: int, group: Any, agree: bool, path: Path) -> None:
        reshard.save({name: build(rank, agree=agree)}, path, group=group)

    _assert_refused_naming(errors_on_ranks(2, lambda r, g: save(r, g, False, tmp_path / "bad")), key)
    assert not (tmp_path / "bad").exists() or not (tmp_path / "bad" / "metadata.json").exists()
    assert errors_on_ranks(2, lambda r, g: save(r, g, True, tmp_path / "good")) == [None, None]
    assert (tmp_path / "good" / "metadata.json").exists()


@pytest.mark.parametrize("case", ["per-tensor scale", "nvfp4 global scale"])
def test_a_scaled_transfer_refuses_source_ranks_that_give_different_copies_of_one_scale(case: str) -> None:
    """A scaled-to-scaled transfer's sources: the same check as a save, before any byte moves. Was: the
    receivers got rank 0's scale with rank 1's data, reported as success. Ranks that agree transfer bit for bit."""
    build, key = (_per_tensor_rows, "'w:scale'") if case == "per-tensor scale" else (_nvfp4_rows, "'n:global_scale'")
    name = key.strip("'").split(":")[0]

    def target(rank: int) -> ScaledTensor:
        held = build(rank, agree=True)
        data = ShardedTensor.from_rank_offsets(name, torch.zeros_like(held.data.data), (0, rank, 2))
        global_scale = None if held.global_scale is None else torch.zeros_like(held.global_scale)
        return ScaledTensor(data, torch.zeros_like(held.scale), held.format, held.block, global_scale=global_scale)

    def move(rank: int, group: Any, agree: bool) -> ScaledTensor:
        out = {name: target(rank)}
        reshard.transfer({name: build(rank, agree=agree)}, out, group=group)
        return out[name]

    _assert_refused_naming(errors_on_ranks(2, lambda r, g: move(r, g, False)), key)
    moved = on_ranks(2, lambda r, g: move(r, g, True))
    for rank, leaf in enumerate(moved):
        want = build(rank, agree=True)
        assert same_bytes(leaf.data.data, want.data.data) and same_bytes(leaf.scale, want.scale)


@pytest.mark.parametrize("case", ["per-tensor scale", "nvfp4 global scale"])
def test_a_peer_memory_save_refuses_ranks_that_give_different_copies_of_one_scale(case: str) -> None:
    """The peer-memory tier's save: the same check, the same error on every rank."""
    build, key = (_per_tensor_rows, "'w:scale'") if case == "per-tensor scale" else (_nvfp4_rows, "'n:global_scale'")
    name = key.strip("'").split(":")[0]

    def save(rank: int, group: Any) -> None:
        peer = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=30)
        peer.save({name: build(rank, agree=False)}, group=group)

    _assert_refused_naming(errors_on_ranks(2, save), key)


def test_ranks_that_agree_on_a_per_row_scale_split_on_columns_save(tmp_path: Path) -> None:
    """Per-row scales (block (1, None)) of a tensor split on columns: every rank holds every row's scale
    (replicas of a whole-axis cell); equal copies save and load bit for bit."""
    q = quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(3)), "fp8_e4m3", block=(1, None))

    def piece(rank: int, parts: int, fill: bool) -> ScaledTensor:
        data = q.data.chunk(parts, dim=1)[rank].clone()
        scale = q.scale.clone() if fill else torch.zeros_like(q.scale)
        data = data if fill else torch.zeros_like(data)
        return ScaledTensor(ShardedTensor.from_rank_offsets("w", data, (1, rank, parts)), scale, "fp8_e4m3", (1, None))

    assert errors_on_ranks(2, lambda r, g: reshard.save({"w": piece(r, 2, True)}, tmp_path / "c", group=g)) == [
        None,
        None,
    ]
    out = reshard.load({"w": piece(0, 1, False)}, tmp_path / "c")["w"]
    assert same_bytes(out.data.data, q.data) and same_bytes(out.scale, q.scale)


def test_strict_false_leaves_a_scaled_template_whose_data_is_missing_whole(tmp_path: Path) -> None:
    """strict=False, the checkpoint lacks ``w`` but holds a plain tensor under the template's scale key
    ``w:scale``. Was: the template's data kept and its scales overwritten by the plain tensor (a mix of two
    states). Now the ScaledTensor is missing as a whole: no part filled, every part listed in
    LoadStats.missing."""
    q = quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(4)), "fp8_e4m3", block=(1, None))
    reshard.save(
        {
            "w_fp8": ShardedTensor.from_rank_offsets("w.data", q.data.clone()),
            "s": ShardedTensor.from_rank_offsets("w:scale", torch.full((4, 1), 7.0)),
        },
        tmp_path / "c",
    )
    data = ShardedTensor.from_rank_offsets("w", q.data.clone())
    template = ScaledTensor(data, q.scale.clone(), "fp8_e4m3", (1, None))
    stats = reshard.LoadStats()
    out = reshard.load({"w": template}, tmp_path / "c", strict=False, stats=stats)["w"]
    assert same_bytes(out.data.data, q.data) and same_bytes(out.scale, q.scale)
    assert any("'w'" in m for m in stats.missing) and any("'w:scale'" in m for m in stats.missing), stats.missing
    with pytest.raises(reshard.MismatchError, match=r"missing"):
        reshard.load({"w": template}, tmp_path / "c")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8_e4m3"])
def test_empty_inputs_quantize_to_empty_outputs(fmt: str) -> None:
    """Was: "has scales of shape [0, 2], not [1, 2]". An empty input quantizes to empty data and scales of
    the ScaledTensor's derived shapes."""
    q = quantize(torch.zeros(0, 32), fmt)
    assert q.data.shape[0] == 0 and tuple(q.scale.shape) == (0, 1 if fmt != "nvfp4" else 2)
    ScaledTensor(ShardedTensor.from_rank_offsets("w", q.data), q.scale, fmt, global_scale=q.global_scale)


def test_an_empty_nvfp4_tensor_saves_its_global_scale_and_loads_it(tmp_path: Path) -> None:
    """Was: "'w:global_scale': no rank holds a primary copy". An empty tensor's global scale is held by the
    rank whose data is the primary copy (rank order first): saved and loaded."""
    data = ShardedTensor.from_rank_offsets("w", torch.zeros(0, 16, dtype=torch.uint8))
    scale = torch.zeros(0, 2, dtype=E4M3)
    reshard.save({"w": ScaledTensor(data, scale, "nvfp4", global_scale=torch.tensor(0.5))}, tmp_path / "c")
    template = ScaledTensor(data, scale.clone(), "nvfp4", global_scale=torch.full((), 7.0))
    assert reshard.load({"w": template}, tmp_path / "c")["w"].global_scale.item() == 0.5
