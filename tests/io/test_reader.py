"""The read executor's modes on real files with a flipped byte: any chunk a read covers is checked, no other is read.

One float32 tensor of 64 x 64 (256-byte rows) is saved with 1 KiB checksum chunks (four rows each) on local
files. Each read mode is driven through :class:`~reshard.io.reader.ReadExecutor` on storage that records every
byte range it serves or maps: **direct** (rows 22 to 33 into a float32 destination: chunk by chunk on local
files, batched where storage serves reads concurrently), **mapped** (the same rows into a float64 destination,
or a column block, on local files), **chunks** (the same without mappings) and the **streamed** groups (a
budget whose read buffer holds fewer than two chunks). Rows 22 to 33 lie in chunks 5 to 8.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.errors import CorruptCheckpointError
from reshard.geometry.boxes import Box
from reshard.io.reader import ReadBudget, ReadExecutor
from reshard.metadata import Metadata
from reshard.planning.load_plan import TargetPiece, plan_load
from reshard.storage import LocalStorage, ReadRequest
from reshard.storage.base import MappedRange

pytestmark = pytest.mark.unit

CHUNK = 1024
ROWS, COLS = 64, 64
FULL = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(5))
TOUCHED = range(5, 9)
"""The chunks that rows [22, 34) lie in."""
SMALL_BUDGET = 1536
"""A read buffer of 768 bytes: a chunk of 1 KiB is too large to hold two (streamed and oversized paths)."""


class Recording(LocalStorage):
    """Local files that record the byte ranges ``(offset, end)`` of the data file that they read or map."""

    def __init__(self, root: Path, *, mapping: bool, concurrent: bool) -> None:
        super().__init__(root)
        self.supports_mapping = mapping
        self.concurrent_reads = concurrent
        self.served: list[tuple[int, int]] = []

    def read_ranges(self, requests: list[ReadRequest], *, max_buffered_bytes: int | None = None) -> list[int]:
        self.served += [(r.offset, r.offset + len(r.buffer)) for r in requests]
        return super().read_ranges(requests, max_buffered_bytes=max_buffered_bytes)

    def map_range(self, name: str, offset: int, length: int) -> MappedRange | None:
        if not self.supports_mapping:
            return None
        self.served.append((offset, offset + length))
        return super().map_range(name, offset, length)


STORAGES: dict[str, Callable[[Path], Recording]] = {
    "mapped": lambda root: Recording(root, mapping=True, concurrent=False),
    "unmapped": lambda root: Recording(root, mapping=False, concurrent=False),
    "batched": lambda root: Recording(root, mapping=False, concurrent=True),
}


def _rows(dtype: torch.dtype) -> tuple[torch.Tensor, tuple[int, int]]:
    return torch.zeros(12, COLS, dtype=dtype), (22, 0)


def _columns(dtype: torch.dtype) -> tuple[torch.Tensor, tuple[int, int]]:
    return torch.zeros(12, 20, dtype=dtype), (22, 30)


TARGETS = {
    "rows": lambda: _rows(torch.float32),
    "rows-cast": lambda: _rows(torch.float64),
    "columns": lambda: _columns(torch.float32),
}


def _save(root: Path) -> Metadata:
    reshard.save({"w": FULL}, root, options=reshard.SaveOptions(checksum_chunk_bytes=CHUNK))
    return reshard.read_metadata(root)


def _read(storage: Recording, metadata: Metadata, target: str, budget: int) -> tuple[ReadExecutor, torch.Tensor]:
    dest, offset = TARGETS[target]()
    box = Box(offset, tuple(dest.shape))
    plan = plan_load(
        metadata,
        [TargetPiece(key="w", box=box)],
        max_read_bytes=ReadBudget.of(budget).max_read_bytes,
        max_read_amplification=1.0,
    )
    executor = ReadExecutor(storage, metadata, memory_budget_bytes=budget)
    try:
        executor.run(plan, [dest], [box])
    finally:
        executor.close()
    rows, cols = (slice(o, o + n) for o, n in zip(offset, dest.shape, strict=True))
    assert torch.equal(dest, FULL[rows, cols].to(dest.dtype))
    return executor, dest


def _flip(root: Path, metadata: Metadata, at: int) -> None:
    path = root / metadata.files[0].path
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def _chunk(metadata: Metadata, index: int) -> tuple[int, int]:
    """The bytes of chunk ``index`` of the box in its data file."""
    start = metadata.tensors["w"].boxes[0].byte_offset + index * CHUNK
    return start, start + CHUNK


CASES = [
    pytest.param(storage, target, budget, id=f"{storage}-{target}-{'small' if budget == SMALL_BUDGET else 'default'}")
    for storage in STORAGES
    for target in TARGETS
    for budget in (32 << 20, SMALL_BUDGET)
]


@pytest.mark.parametrize(("storage_kind", "target", "budget"), CASES)
def test_reads_serve_only_the_touched_chunks(tmp_path: Path, storage_kind: str, target: str, budget: int) -> None:
    metadata = _save(tmp_path)
    storage = STORAGES[storage_kind](tmp_path)
    executor, _ = _read(storage, metadata, target, budget)
    lo, hi = _chunk(metadata, TOUCHED[0])[0], _chunk(metadata, TOUCHED[-1])[1]
    assert storage.served and all(lo <= a and b <= hi for a, b in storage.served), storage.served
    assert executor.bytes_verified >= len(TOUCHED) * CHUNK


@pytest.mark.parametrize(("storage_kind", "target", "budget"), CASES)
def test_a_flipped_byte_in_any_touched_chunk_is_caught(
    tmp_path: Path, storage_kind: str, target: str, budget: int
) -> None:
    metadata = _save(tmp_path)
    for index in TOUCHED:
        start, end = _chunk(metadata, index)
        for at in (start, end - 1):  # the first chunk's first row and the last chunk's last are not needed
            _flip(tmp_path, metadata, at)
            with pytest.raises(CorruptCheckpointError) as error:
                _read(STORAGES[storage_kind](tmp_path), metadata, target, budget)
            assert f"checksum mismatch in data file {tmp_path / metadata.files[0].path}" in str(error.value)
            assert f"at bytes [{start}, {end})" in str(error.value) and "tensor 'w'" in str(error.value)
            _flip(tmp_path, metadata, at)


@pytest.mark.parametrize(("storage_kind", "target", "budget"), CASES)
def test_a_flipped_byte_in_an_untouched_chunk_is_not_read(
    tmp_path: Path, storage_kind: str, target: str, budget: int
) -> None:
    metadata = _save(tmp_path)
    for index in (TOUCHED[0] - 1, TOUCHED[-1] + 1):
        _flip(tmp_path, metadata, _chunk(metadata, index)[0] + 100)
    _read(STORAGES[storage_kind](tmp_path), metadata, target, budget)


def test_which_mode_reads_is_seen_in_the_counts(tmp_path: Path) -> None:
    """Direct reads land in the destination; mapped and chunk reads do not; extra bytes are the untouched rows
    of the touched chunks (rows 20, 21, 34, 35)."""
    metadata = _save(tmp_path)
    needed = 12 * COLS * 4
    outside = 4 * COLS * 4
    direct, _ = _read(STORAGES["unmapped"](tmp_path), metadata, "rows", 32 << 20)
    assert (direct.bytes_direct, direct.bytes_verify_extra, direct.bytes_verified) == (needed, outside, 4 * CHUNK)
    batched, _ = _read(STORAGES["batched"](tmp_path), metadata, "rows", 32 << 20)
    assert (batched.bytes_direct, batched.bytes_verify_extra) == (needed, outside)
    for kind in ("mapped", "unmapped"):
        cast, _ = _read(STORAGES[kind](tmp_path), metadata, "rows-cast", 32 << 20)
        assert (cast.bytes_direct, cast.bytes_verify_extra, cast.bytes_verified) == (0, outside, 4 * CHUNK)


def test_object_blobs_are_verified_whole(tmp_path: Path) -> None:
    reshard.save({"o": reshard.ShardedObject("o", [1, 2, 3], (1,), (0,))}, tmp_path)
    metadata = reshard.read_metadata(tmp_path)
    entry = metadata.objects["o"].entries[0]
    executor = ReadExecutor(LocalStorage(tmp_path), metadata)
    blob = executor.read_object_blob("o", entry)
    assert len(blob) == entry.byte_length and executor.bytes_verified == entry.byte_length
    _flip(tmp_path, metadata, entry.byte_offset + entry.byte_length - 1)
    with pytest.raises(CorruptCheckpointError, match="object 'o' at \\[0\\]: checksum mismatch"):
        ReadExecutor(LocalStorage(tmp_path), metadata).read_object_blob("o", entry)


def test_a_missing_file_is_named_before_any_read(tmp_path: Path) -> None:
    metadata = _save(tmp_path)
    (tmp_path / metadata.files[0].path).unlink()
    storage: Any = STORAGES["unmapped"](tmp_path)
    with pytest.raises(CorruptCheckpointError, match="is missing"):
        _read(storage, metadata, "rows", 32 << 20)
    assert storage.served == []
