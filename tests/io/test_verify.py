"""End-to-end verification of a reshard: layout-independent content fingerprints (load(verify=True))."""

from __future__ import annotations

from pathlib import Path

import crc32c
import pytest
import torch

import reshard
from tests.layouts import cuts, global_tensor
from tests.metadata_docs import read_doc, write_doc
from tests.rankpool import RankContext, RankFailure, RankPool

TIMEOUT = 60.0
SHAPES = {"a": ((12, 10), torch.float32), "b": ((6, 4, 5), torch.bfloat16), "c": ((9,), torch.int64)}


def _pieces(rank: int, size: int, axis: int, *, blank: bool) -> dict[str, reshard.ShardedTensor]:
    out = {}
    for key, (shape, dtype) in SHAPES.items():
        full = global_tensor(key, shape, dtype)
        cut = min(axis, len(shape) - 1)
        start, length = cuts(shape[cut], size)[rank]
        index = tuple(slice(start, start + length) if a == cut else slice(None) for a in range(len(shape)))
        local = torch.zeros_like(full[index]) if blank else full[index].clone()
        offset = tuple(start if a == cut else 0 for a in range(len(shape)))
        out[key] = reshard.ShardedTensor(key, local.contiguous(), shape, offset)
    return out


def rank_save(ctx: RankContext, path: str) -> None:
    reshard.save(
        _pieces(ctx.rank, 4, 0, blank=False), path, timeout=TIMEOUT, options=reshard.SaveOptions(fingerprint=True)
    )


def rank_load_verified(ctx: RankContext, path: str, size: int, axis: int) -> str | None:
    group, member = ctx.group_of_size(size)
    if not member:
        return None
    template = _pieces(ctx.rank, size, axis, blank=True)
    reshard.load(template, path, group=group, timeout=TIMEOUT, options=reshard.LoadOptions(verify=True))
    for key, st in template.items():
        shape, dtype = SHAPES[key]
        full = global_tensor(key, shape, dtype)
        index = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.data.shape, strict=True))
        assert torch.equal(st.data, full[index]), key
    return "verified"


@pytest.mark.dist
@pytest.mark.parametrize(("size", "axis"), [(1, 0), (2, 1), (4, 0), (4, 1)])
def test_correct_loads_on_four_layouts_pass(pool4: RankPool, tmp_path: Path, size: int, axis: int) -> None:
    path = str(tmp_path / "ckpt")
    pool4.run_ok(rank_save, path)
    assert all(t.fingerprint is not None for t in reshard.read_metadata(path).tensors.values())
    assert pool4.run_ok(rank_load_verified, path, size, axis)[:size] == ["verified"] * size


@pytest.mark.dist
def test_damage_with_a_forged_chunk_checksum_is_caught_on_every_rank(pool4: RankPool, tmp_path: Path) -> None:
    """Chunk checksums cannot see damage whose checksum was rewritten to match (and the document resealed):
    the content fingerprint can, on every rank of another layout."""
    path = tmp_path / "ckpt"
    pool4.run_ok(rank_save, str(path))
    doc = read_doc(path)
    box = next(b for b in doc["tensors"]["a"]["boxes"] if b["offset"] == [3, 0])
    data = path / doc["files"][box["file"]]["path"]
    raw = bytearray(data.read_bytes())
    raw[box["byte_offset"] + 4 * 7] ^= 0x10  # element (3, 7) of "a"
    data.write_bytes(bytes(raw))
    chunk = doc["checksum"]["chunk_bytes"]
    stored = raw[box["byte_offset"] : box["byte_offset"] + box["byte_length"]]
    box["crc32c"] = [crc32c.crc32c(stored[i : i + chunk]) for i in range(0, len(stored), chunk)]
    write_doc(path, doc)
    results = pool4.run(rank_load_verified, str(path), 4, 1)  # saved on axis 0, loaded on axis 1
    assert all(isinstance(r, RankFailure) for r in results)
    assert {r.error_class for r in results} == {"CorruptCheckpointError"}
    assert all("content fingerprint mismatch" in r.message and "'a'" in r.message for r in results)


@pytest.mark.unit
def test_verify_needs_fingerprints_and_skips_what_it_cannot_check(tmp_path: Path) -> None:
    reshard.save({"w": torch.ones(4)}, tmp_path / "plain")
    with pytest.raises(reshard.CheckpointError, match=r"no fingerprint of 'w'.*fingerprint=True"):
        reshard.load({"w": torch.zeros(4)}, tmp_path / "plain", options=reshard.LoadOptions(verify=True))
    reshard.save({"w": torch.ones(4)}, tmp_path / "printed", options=reshard.SaveOptions(fingerprint=True))
    part = reshard.ShardedTensor("w", torch.zeros(2), (4,), (0,))
    with pytest.warns(UserWarning, match=r"not checked.*w"):
        reshard.load({"w": part}, tmp_path / "printed", options=reshard.LoadOptions(verify=True))


def _reference(full: torch.Tensor) -> int:
    """The definition, element by element: sum of w * (2i + 1) + i * G over words, mod 2**64."""
    golden = 0x9E3779B97F4A7C15
    words = full.contiguous().reshape(-1).view(torch.uint8)
    width = min(full.element_size(), 8)
    total = 0
    for index in range(words.numel() // width):
        word = int.from_bytes(bytes(words[index * width : (index + 1) * width].tolist()), "little", signed=True)
        total += word * (2 * index + 1) + index * golden
    return total % (1 << 64)


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex128])
def test_fingerprint_matches_its_definition_and_adds_up_over_any_tiling(dtype: torch.dtype) -> None:
    from reshard.geometry.boxes import Box
    from reshard.state.fingerprint import combine, fingerprint

    full = (torch.randn(5, 3, 4) * 50).to(dtype) if dtype != torch.bool else torch.rand(5, 3, 4) > 0.5
    shape = (5, 3, 4)
    whole = fingerprint(full, Box((0, 0, 0), shape), shape)
    assert whole == _reference(full)
    parts = [
        fingerprint(full[:2], Box((0, 0, 0), (2, 3, 4)), shape),
        fingerprint(full[2:, :1], Box((2, 0, 0), (3, 1, 4)), shape),
        fingerprint(full[2:, 1:, :3], Box((2, 1, 0), (3, 2, 3)), shape),
        fingerprint(full[2:, 1:, 3:], Box((2, 1, 3), (3, 2, 1)), shape),
    ]
    assert combine(parts) == whole
    swapped = full.clone()
    swapped[0, 0, 0], swapped[4, 2, 3] = full[4, 2, 3], full[0, 0, 0]
    if not torch.equal(swapped, full):
        assert fingerprint(swapped, Box((0, 0, 0), shape), shape) != whole


@pytest.mark.unit
def test_contiguous_partial_reads_verify_every_chunk_they_touch(tmp_path: Path) -> None:
    """An axis-0 slice that starts and ends inside checksum chunks reads what it needs straight into its
    destination, and the rest of its two boundary chunks beside it, so that every chunk it touches is
    verified on the bytes used: damage next to the slice is caught."""
    full = torch.arange(1000, dtype=torch.float32)
    reshard.save({"w": full}, tmp_path, options=reshard.SaveOptions(checksum_chunk_bytes=256))  # chunks of 64 elements
    template = {"w": reshard.ShardedTensor("w", torch.zeros(300), (1000,), (100,))}
    stats = reshard.LoadStats()
    reshard.load(template, tmp_path, stats=stats)
    assert stats.bytes_read == stats.bytes_needed == 1200
    # Bytes [400, 1600): chunks 2-5 are covered, chunks 1 and 6 touched at the ends: their other bytes,
    # [256, 400) and [1600, 1792), are read too.
    assert stats.bytes_verify_extra == (400 - 256) + (1792 - 1600)
    assert stats.bytes_verified == 6 * 256
    metadata = reshard.read_metadata(tmp_path)
    data = tmp_path / metadata.files[0].path
    raw = bytearray(data.read_bytes())
    raw[metadata.tensors["w"].boxes[0].byte_offset + 70 * 4] ^= 0x01  # element 70: in the chunk of element 100
    data.write_bytes(bytes(raw))
    with pytest.raises(reshard.CorruptCheckpointError, match=r"checksum mismatch"):
        reshard.load({"w": reshard.ShardedTensor("w", torch.zeros(300), (1000,), (100,))}, tmp_path)
