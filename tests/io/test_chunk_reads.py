"""A checksum chunk touched by several read items is read and verified once per load, whatever the budget.

A load verifies every checksum chunk it touches. When several read items touch one chunk (a budget below four
chunks cuts every overlap into items smaller than a chunk; a template of many small pieces puts many items in
one chunk), the chunk must not be read again for each item: the bytes storage serves stay near the stored
bytes the load touches. Bytes are counted by the storage layer (``Storage.range_bytes_read``), on local files
(mapped, and read as an object store reads them) and on real S3 and GCS protocol servers.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.storage import LocalStorage, ObjectStorage, Storage

KiB = 1024
CHUNK = 64 * KiB
ROWS, COLS = 512, 512  # 1 MiB of float32: 16 chunks of 64 KiB, 32 rows each
FULL = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(13))


class NoMapStorage(LocalStorage):
    """Local files read through ``read_ranges`` only, as an object store reads them."""

    def map_range(self, name: str, offset: int, length: int) -> None:
        return None


def _save(path: Any, storage_options: dict[str, Any] | None = None) -> None:
    options = reshard.SaveOptions(checksum_chunk_bytes=CHUNK)
    reshard.save({"w": FULL}, path, options=options, storage_options=storage_options)


def _columns() -> dict[str, Any]:
    """Columns [128, 256) of every row: strided runs touching every chunk."""
    return {"w": reshard.ShardedTensor("w", torch.zeros(ROWS, 128), (ROWS, COLS), (0, 128))}


def _every_other_row() -> dict[str, Any]:
    """Rows 0, 2, 4, ... as pieces of their own: 256 one-run items, 16 in each chunk."""
    return {f"r{i}": reshard.ShardedTensor("w", torch.zeros(1, COLS), (ROWS, COLS), (i, 0)) for i in range(0, ROWS, 2)}


def _every_other_row_cast() -> dict[str, Any]:
    """The same, loaded as float64: every item is copied out of staged (or mapped) chunks."""
    return {
        f"r{i}": reshard.ShardedTensor("w", torch.zeros(1, COLS, dtype=torch.float64), (ROWS, COLS), (i, 0))
        for i in range(0, ROWS, 2)
    }


def _rows() -> dict[str, Any]:
    """Rows [100, 400): one contiguous overlap, cut into items by small budgets."""
    return {"w": reshard.ShardedTensor("w", torch.zeros(300, COLS), (ROWS, COLS), (100, 0))}


TEMPLATES = {"columns": _columns, "every_other_row": _every_other_row, "cast": _every_other_row_cast, "rows": _rows}
TOUCHED = {"columns": FULL.nbytes, "every_other_row": FULL.nbytes, "cast": FULL.nbytes, "rows": 10 * CHUNK}
"""Stored bytes of the chunks each template touches (rows [100, 400) lie in chunks 3 to 12)."""


def _check(template: dict[str, Any]) -> None:
    for name, st in template.items():
        index = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.data.shape, strict=True))
        assert torch.equal(st.data, FULL[index].to(st.data.dtype)), name


def _load(storage: Storage, name: str, budget: int | None) -> tuple[int, reshard.LoadStats]:
    template = TEMPLATES[name]()
    stats = reshard.LoadStats()
    options = reshard.LoadOptions() if budget is None else reshard.LoadOptions(memory_budget_bytes=budget)
    before = storage.range_bytes_read
    reshard.load(template, storage, options=options, stats=stats)
    _check(template)
    return storage.range_bytes_read - before, stats


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One checkpoint of FULL, saved once for the module; a test that damages it works on a copy."""
    path = tmp_path_factory.mktemp("chunk-reads") / "ckpt"
    _save(path)
    return path


BUDGETS = [None, 3 * CHUNK, 2 * CHUNK, CHUNK // 2]
"""The default budget, and budgets below four chunks (down to half a chunk)."""


@pytest.mark.dist  # a 48-case matrix, seconds: kept out of make test-fast
@pytest.mark.parametrize("budget", BUDGETS, ids=["default", "3_chunks", "2_chunks", "half_a_chunk"])
@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("storage_class", [LocalStorage, NoMapStorage], ids=["mapped", "staged"])
def test_each_touched_chunk_is_read_once_on_local_files(
    tmp_path: Path, storage_class: type[LocalStorage], name: str, budget: int | None
) -> None:
    """Storage serves at most twice the touched chunks (once, where several items share them), and every
    touched chunk is verified, at most twice."""
    _save(tmp_path / "ckpt")
    read, stats = _load(storage_class(tmp_path / "ckpt"), name, budget)
    touched = TOUCHED[name]
    assert touched <= read <= 2 * touched, (read, touched)
    assert touched <= stats.bytes_verified <= 2 * touched, (stats.bytes_verified, touched)
    if name != "rows":  # several items in every chunk: each chunk read once
        assert read == stats.bytes_verified == touched, (read, touched)


@pytest.mark.dist
@pytest.mark.parametrize("budget", [None, 2 * CHUNK], ids=["default", "2_chunks"])
@pytest.mark.parametrize("name", ["columns", "every_other_row"])
def test_each_touched_chunk_is_read_once_on_object_stores(object_store: Any, name: str, budget: int | None) -> None:
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    _save(url, object_store.storage_options)
    storage = ObjectStorage(url, object_store.storage_options)
    try:
        read, stats = _load(storage, name, budget)
    finally:
        storage.close()
    assert read == stats.bytes_verified == TOUCHED[name], (read, stats.bytes_verified)


@pytest.mark.unit
@pytest.mark.parametrize("budget", [None, 2 * CHUNK, CHUNK // 2], ids=["default", "2_chunks", "half_a_chunk"])
@pytest.mark.parametrize("name", ["columns", "every_other_row", "cast"])
@pytest.mark.parametrize("storage_class", [LocalStorage, NoMapStorage], ids=["mapped", "staged"])
def test_a_chunk_read_once_is_still_verified(
    tmp_path: Path, saved: Path, storage_class: type[LocalStorage], name: str, budget: int | None
) -> None:
    """A flipped bit in a touched chunk, in a byte the load uses or only in one it reads to verify the chunk,
    fails the load, whichever item read it."""
    shutil.copytree(saved, tmp_path / "ckpt")  # a copy of its own to damage
    metadata = reshard.read_metadata(tmp_path / "ckpt")
    box = metadata.tensors["w"].boxes[0]
    data = tmp_path / "ckpt" / metadata.files[box.file].path
    pristine = data.read_bytes()
    used = (301 * COLS + 130) * 4  # row 301, column 130: used by columns, not by every other row
    unused = (301 * COLS + 20) * 4  # row 301, column 20: used by neither, in a touched chunk
    for position in (used, unused, (7 * 32 + 3) * COLS * 4 + 17):
        damaged = bytearray(pristine)
        damaged[box.byte_offset + position] ^= 0x10
        data.write_bytes(bytes(damaged))
        with pytest.raises(reshard.CorruptCheckpointError, match="checksum mismatch"):
            _load(storage_class(tmp_path / "ckpt"), name, budget)
    data.write_bytes(pristine)
    _load(storage_class(tmp_path / "ckpt"), name, budget)
