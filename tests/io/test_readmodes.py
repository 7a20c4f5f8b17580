"""The read modes as functions (reshard.io.readmodes): which mode a read takes, and the runs mode, on a real file."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import reshard
from reshard.geometry.boxes import Box
from reshard.io.chunkgroups import touched_ranges
from reshard.io.readmodes import (
    BoxRead,
    DirectRun,
    ReadCounts,
    buffered,
    finish,
    is_direct,
    read_direct_run,
    requests,
)
from reshard.io.verified import VerifiedReader
from reshard.metadata import Metadata
from reshard.planning.load_plan import ReadItem, TargetPiece, plan_load
from reshard.storage import LocalStorage

pytestmark = pytest.mark.unit

CHUNK = 512
FULL = torch.arange(32 * 32, dtype=torch.float32).reshape(32, 32)  # 128-byte rows, four to a chunk


@pytest.fixture
def saved(tmp_path: Path) -> tuple[VerifiedReader, Metadata]:
    reshard.save({"w": FULL}, tmp_path, options=reshard.SaveOptions(checksum_chunk_bytes=CHUNK))
    metadata = reshard.read_metadata(tmp_path)
    return VerifiedReader(LocalStorage(tmp_path), metadata, transfer_bytes=1 << 20, stream_bytes=64), metadata


def _item(metadata: Metadata, box: Box) -> ReadItem:
    (item,) = plan_load(metadata, [TargetPiece(key="w", box=box)], max_read_amplification=1.0).items
    return item


def _read(io: VerifiedReader, metadata: Metadata, box: Box, dest: torch.Tensor, *, checked: bool = True) -> BoxRead:
    item = _item(metadata, box)
    saved = metadata.tensors["w"].boxes[0]
    stored = io.stored(saved.checksums if checked else (), saved.byte_length, 0, saved.byte_offset, "tensor 'w'")
    ranges = tuple(touched_ranges(item, saved, CHUNK)) if checked else ()
    return BoxRead(item, stored, ranges, torch.float32, saved.shape, dest)


ROWS = Box((5, 0), (6, 32))  # rows 5-10: chunks 1 and 2, rows 4 and 11 outside the run
COLUMNS = Box((5, 8), (6, 4))


def test_counts_add() -> None:
    assert ReadCounts(1, 2, 3) + ReadCounts(10, 20, 30) == ReadCounts(11, 22, 33)


def test_direct_only_for_one_run_of_the_saved_dtype_into_host_bytes(saved: tuple[VerifiedReader, Metadata]) -> None:
    _, metadata = saved
    rows, columns = _item(metadata, ROWS), _item(metadata, COLUMNS)
    assert is_direct(rows, torch.float32, torch.zeros(6, 32), through_host=False)
    assert not is_direct(rows, torch.float32, torch.zeros(6, 32, dtype=torch.float64), through_host=False)
    assert not is_direct(rows, torch.float32, torch.zeros(32, 6).t(), through_host=False)
    assert is_direct(rows, torch.float32, torch.zeros(6, 32, dtype=torch.float64), through_host=True)
    assert not is_direct(columns, torch.float32, torch.zeros(6, 4), through_host=True)


def test_how_a_read_goes_through_the_read_buffer(saved: tuple[VerifiedReader, Metadata]) -> None:
    io, metadata = saved
    rows = _read(io, metadata, ROWS, torch.zeros(6, 32))
    assert rows.ranges == ((CHUNK, 3 * CHUNK),) and rows.run == (5 * 128, 11 * 128)
    direct = buffered(rows, direct=True, oversized=False)
    assert (direct.mode, direct.nbytes, direct.streamed) == ("direct", 2 * 128, False)
    oversized = buffered(rows, direct=True, oversized=True)
    assert (oversized.mode, oversized.nbytes, oversized.streamed) == ("direct", 0, True)
    columns = buffered(_read(io, metadata, COLUMNS, torch.zeros(6, 4)), direct=False, oversized=False)
    assert (columns.mode, columns.region_start, columns.nbytes) == ("chunks", CHUNK, 2 * CHUNK)
    runs = buffered(_read(io, metadata, COLUMNS, torch.zeros(6, 4), checked=False), direct=False, oversized=False)
    assert (runs.mode, runs.nbytes) == ("runs", 6 * 4 * 4)


@pytest.mark.parametrize("checked", [True, False], ids=["chunks", "runs"])
def test_a_buffered_read_fills_its_destination(saved: tuple[VerifiedReader, Metadata], checked: bool) -> None:
    io, metadata = saved
    dest = torch.zeros(6, 4)
    planned = dataclasses.replace(
        buffered(_read(io, metadata, COLUMNS, dest, checked=checked), direct=False, oversized=False), offset=64
    )
    buffer = torch.zeros(64 + planned.nbytes, dtype=torch.uint8)
    reqs = requests(planned, buffer)
    io.read(reqs, ["w"] * len(reqs))
    counts = finish(planned, buffer, io)
    assert torch.equal(dest, FULL[5:11, 8:12])
    assert counts == (ReadCounts(2 * CHUNK, 0, 2 * CHUNK - 6 * 16) if checked else ReadCounts())
    assert not buffer[:64].any()  # the read landed at its offset


def test_consecutive_direct_reads_of_a_box_make_one_run_verified_across_them(
    saved: tuple[VerifiedReader, Metadata],
) -> None:
    io, metadata = saved
    first = torch.zeros(2, 32)
    second = torch.zeros(3, 32)
    run = DirectRun.of(_read(io, metadata, Box((5, 0), (2, 32)), first))
    longer = run.continued(_read(io, metadata, Box((7, 0), (3, 32)), second))
    assert longer is not None and (longer.lo, longer.hi, longer.start, longer.end) == (CHUNK, 3 * CHUNK, 640, 1280)
    assert run.continued(_read(io, metadata, Box((8, 0), (1, 32)), torch.zeros(1, 32))) is None
    outside = memoryview(bytearray((longer.start - longer.lo) + (longer.hi - longer.end)))
    counts = read_direct_run(longer, outside, io)
    assert torch.equal(first, FULL[5:7]) and torch.equal(second, FULL[7:10])
    assert counts == ReadCounts(2 * CHUNK, 5 * 128, 3 * 128)
