"""The memory budgets of save and load (SaveOptions/LoadOptions ``memory_budget_bytes``).

A save streams tensors that are not contiguous CPU memory through a staging buffer cut from its budget, and
keeps an object store's upload parts in flight within the rest; a load plans its reads so that its staging
buffer and mapped windows stay within its budget. Peak resident memory is measured with the kernel's
high-water mark (tests/memory.py), against real files and real S3/GCS protocol servers.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.storage import ObjectStorage, TransferOptions
from tests.memory import peak_rss_growth

MiB = 2**20

# 64 MiB of float32, stored transposed: a view that is not contiguous, as a transposed weight or an
# optimizer state laid out for a kernel often is.
ROWS, COLS = 4096, 4096


@pytest.fixture(scope="module")
def transposed() -> torch.Tensor:
    generator = torch.Generator().manual_seed(17)
    return torch.randn(COLS, ROWS, generator=generator).t()


@pytest.mark.dist  # seconds of fsync-heavy saves: kept out of the fast tier (make test-fast)
def test_save_streams_a_non_contiguous_tensor_through_its_budget(tmp_path: Path, transposed: torch.Tensor) -> None:
    """A transposed 64 MiB tensor saved with a 4 MiB budget grows the peak RSS by far less than the tensor (a
    whole contiguous copy would add 64 MiB), and loads back bit-identical."""
    assert not transposed.is_contiguous()
    options = reshard.SaveOptions(memory_budget_bytes=4 * MiB)
    with peak_rss_growth() as grown:
        reshard.save({"w": transposed}, tmp_path / "ckpt", options=options)
    assert grown() < 16 * MiB, f"peak RSS grew by {grown() / MiB:.1f} MiB"
    loaded = reshard.load({"w": torch.empty(ROWS, COLS)}, tmp_path / "ckpt")["w"]
    assert torch.equal(loaded, transposed)


@pytest.mark.unit
def test_save_of_a_sharded_non_contiguous_view_round_trips_with_a_tiny_budget(tmp_path: Path) -> None:
    """Slabs smaller than a row, and conjugate/negative views resolved while they are copied."""
    base = torch.arange(6 * 10, dtype=torch.float64).reshape(6, 10)
    half = base.t()[:, :3]  # [10, 3], strided
    state = {
        "half": reshard.ShardedTensor("w", half, (10, 6), (0, 0)),
        "rest": reshard.ShardedTensor("w", base.t()[:, 3:].contiguous(), (10, 6), (0, 3)),
        "neg": torch._neg_view(torch.arange(5.0)),
    }
    reshard.save(state, tmp_path / "ckpt", options=reshard.SaveOptions(memory_budget_bytes=reshard_min_budget()))
    out = reshard.load({"w": torch.zeros(10, 6), "neg": torch.zeros(5)}, tmp_path / "ckpt")
    assert torch.equal(out["w"], base.t())
    assert torch.equal(out["neg"], -torch.arange(5.0))


def reshard_min_budget() -> int:
    from reshard.io.datafile import MIN_SAVE_MEMORY_BUDGET

    return MIN_SAVE_MEMORY_BUDGET


@pytest.mark.unit
@pytest.mark.parametrize("budget_mib", [2, 32])
def test_strided_load_keeps_within_its_budget(tmp_path: Path, transposed: torch.Tensor, budget_mib: int) -> None:
    """A load that cuts across the trailing axis of a 64 MiB box (strided reads, every checksum chunk touched)
    grows the peak RSS by at most its budget, plus a little for the plan."""
    contiguous = transposed.contiguous()
    reshard.save({"w": contiguous}, tmp_path / "ckpt")
    target = torch.zeros(ROWS, COLS // 2)  # allocated and touched before measuring
    template = {"w": reshard.ShardedTensor("w", target, (ROWS, COLS), (0, COLS // 2))}
    options = reshard.LoadOptions(memory_budget_bytes=budget_mib * MiB)
    # a small load first, so that what a process sets up once (imports, thread pools, caches) is not counted
    small = {"w": reshard.ShardedTensor("w", torch.zeros(8, 8), (ROWS, COLS), (0, 8))}
    reshard.load(small, tmp_path / "ckpt", options=options)
    with peak_rss_growth() as grown:
        reshard.load(template, tmp_path / "ckpt", options=options)
    assert grown() <= (budget_mib + 4) * MiB, f"peak RSS grew by {grown() / MiB:.1f} MiB"
    assert torch.equal(target, contiguous[:, COLS // 2 :])


@pytest.mark.unit
def test_budgets_below_their_minimum_are_refused() -> None:
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        reshard.SaveOptions(memory_budget_bytes=MiB - 1)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        reshard.LoadOptions(memory_budget_bytes=15)


# ---- object stores: upload parts in flight -------------------------------------------------------------

PART = 5 * MiB  # S3's smallest part


@pytest.mark.dist
def test_upload_parts_in_flight_are_cut_to_the_budget(object_store: Any) -> None:
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    storage = ObjectStorage(url, object_store.options(), transfer=TransferOptions(part_bytes=PART, max_concurrency=8))
    try:
        writers = {
            budget: storage.open_writer(f"probe-{budget}", max_buffered_bytes=budget)
            for budget in (2 * PART, 4 * PART, 100 * PART)
        }
        unbounded = storage.open_writer("probe-none")
        assert {budget: w.max_in_flight for budget, w in writers.items()} == {2 * PART: 1, 4 * PART: 3, 100 * PART: 8}
        assert unbounded.max_in_flight == 8
        for writer in [*writers.values(), unbounded]:
            writer.abort()
    finally:
        storage.close()


@pytest.mark.dist
def test_a_budget_below_two_upload_parts_fails_the_save_and_keeps_the_checkpoint(object_store: Any) -> None:
    """SaveOptions(memory_budget_bytes=12 MiB) leaves 9 MiB for uploads after the staging buffer: less than two
    5 MiB parts. The save raises StorageError, nothing is committed, and the checkpoint already there loads."""
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    storage = ObjectStorage(url, object_store.options(), transfer=TransferOptions(part_bytes=PART))
    old = torch.arange(4 * MiB, dtype=torch.float32)  # 16 MiB
    try:
        reshard.save({"w": old}, storage)
        with pytest.raises(reshard.StorageError, match="memory budget"):
            reshard.save(
                {"w": old + 1}, storage, overwrite=True, options=reshard.SaveOptions(memory_budget_bytes=12 * MiB)
            )
        out = reshard.load({"w": torch.zeros_like(old)}, storage)
        assert torch.equal(out["w"], old)
        # the smallest budget that holds two parts after its staging share saves, in parts, one in flight
        reshard.save({"w": old + 1}, storage, overwrite=True, options=reshard.SaveOptions(memory_budget_bytes=14 * MiB))
        out = reshard.load({"w": torch.zeros_like(old)}, storage)
        assert torch.equal(out["w"], old + 1)
    finally:
        storage.close()


@pytest.mark.unit
def test_a_single_put_store_refuses_a_file_larger_than_the_budget() -> None:
    """A store without multipart uploads buffers a data object whole: the write that would take it past the
    budget raises, and a file within it is put whole."""
    storage = ObjectStorage(f"memory://budget-{uuid.uuid4().hex}/ckpt")
    try:
        writer = storage.open_writer("data/big.bin", max_buffered_bytes=MiB)
        writer.write(memoryview(bytes(MiB)))
        with pytest.raises(reshard.StorageError, match="memory budget"):
            writer.write(memoryview(b"x"))
        writer.abort()
        small = storage.open_writer("data/small.bin", max_buffered_bytes=MiB)
        small.write(memoryview(b"abc"))
        small.commit()
        assert storage.read_bytes("data/small.bin") == b"abc"
    finally:
        storage.close()


# ---- slabs of one box, verified across their boundaries ------------------------------------------------


@pytest.mark.dist  # seconds of fsync-heavy saves: kept out of the fast tier (make test-fast)
def test_a_box_cut_into_slabs_reads_each_chunk_once_and_still_verifies_it(tmp_path: Path) -> None:
    """A 20 MiB box of 5120-byte rows loaded with a 16 MiB budget is read in slabs of at most 7 MiB whose edges
    fall inside
    checksum chunks (no whole number of rows makes 4 MiB). Each straddling chunk is verified across the two
    destinations: no byte beyond the box is read, every byte is verified, and a flipped byte in a straddling
    chunk is still caught."""
    rows, cols = 4096, 1280
    value = torch.randn(rows, cols, generator=torch.Generator().manual_seed(3))
    reshard.save({"w": value}, tmp_path / "ckpt")
    options = reshard.LoadOptions(memory_budget_bytes=16 * MiB)
    stats = reshard.LoadStats()
    target = torch.zeros(rows, cols)
    reshard.load({"w": target}, tmp_path / "ckpt", options=options, stats=stats)
    assert torch.equal(target, value)
    assert stats.bytes_read == value.nbytes and stats.bytes_verify_extra == 0
    assert stats.bytes_verified == value.nbytes
    assert stats.read_requests > 1  # it was read in slabs
    # slab edges fall at rows 1366 and 2732 (6.7 and 13.3 MiB): inside chunks 1 (4-8 MiB) and 3 (12-16 MiB)
    doc = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    data = tmp_path / "ckpt" / doc["files"][0]["path"]
    box_offset = doc["tensors"]["w"]["boxes"][0]["byte_offset"]
    with open(data, "r+b") as f:
        for position in (box_offset + 4 * MiB + 7, box_offset + 16 * MiB - 3):
            f.seek(position)
            byte = f.read(1)
            f.seek(position)
            f.write(bytes([byte[0] ^ 0x40]))
            f.flush()
            with pytest.raises(reshard.CorruptCheckpointError):
                reshard.load({"w": torch.zeros(rows, cols)}, tmp_path / "ckpt", options=options)
            f.seek(position)
            f.write(byte)
            f.flush()


def _range_lengths(proxy: Any) -> list[int]:
    lengths = []
    for record in proxy.records:
        if record.method == "GET" and record.range and "/data/" in record.path:
            first, last = record.range.removeprefix("bytes=").split("-")
            lengths.append(int(last) - int(first) + 1)
    return lengths


@pytest.mark.dist
def test_object_store_loads_keep_their_gets_in_flight_within_the_budget(object_store: Any, fault_proxy: Any) -> None:
    """With a 16 MiB load budget, 7 MiB of it is for response bodies in flight: the ranged GETs of a 12 MiB
    box are cut to 1 MiB, at most 7 in flight; with the default budget (32 MiB) to 1 MiB, at most 15 in
    flight. The tensor arrives whole, every byte verified once."""
    proxy = fault_proxy(object_store)
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    value = torch.randn(3 * MiB, generator=torch.Generator().manual_seed(5))  # 12 MiB
    options = object_store.options(proxy.url)
    reshard.save({"w": value}, url, storage_options=options)
    for budget in (16 * MiB, None):
        proxy.reset()
        stats = reshard.LoadStats()
        load_options = reshard.LoadOptions() if budget is None else reshard.LoadOptions(memory_budget_bytes=budget)
        out = reshard.load(
            {"w": torch.zeros_like(value)}, url, storage_options=options, options=load_options, stats=stats
        )
        assert torch.equal(out["w"], value)
        assert stats.bytes_verified == value.nbytes
        lengths = _range_lengths(proxy)
        assert sum(lengths) == value.nbytes and max(lengths) <= MiB, lengths


@pytest.mark.unit
def test_get_sizes_under_the_load_budgets_of_docs_api() -> None:
    """docs/api.md: the default load budget makes 1 MiB GETs, 15 in flight; 256 MiB about 8 MiB, 16 in flight;
    without a budget, part-sized GETs at full concurrency."""
    from reshard.io.reader import ReadBudget

    storage = ObjectStorage(f"memory://sizes-{uuid.uuid4().hex}/ckpt")
    try:

        def sizes(budget: int) -> tuple[int, int]:
            return storage.get_sizes(ReadBudget.of(budget).max_read_bytes)

        assert sizes(reshard.LoadOptions().memory_budget_bytes) == (MiB, 15)
        piece, in_flight = sizes(256 * MiB)
        assert 7.9 * MiB < piece <= 8 * MiB and in_flight == 16
        assert storage.get_sizes(None) == (16 * MiB, 16)
        assert storage.get_sizes(100) == (100, 1)
    finally:
        storage.close()
