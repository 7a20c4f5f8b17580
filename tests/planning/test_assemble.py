"""The pieces of a save's metadata (reshard.planning.assemble) on hand-made descriptions and reports: no I/O."""

from __future__ import annotations

import numpy as np
import pytest

from reshard.geometry.boxes import Box
from reshard.planning.assemble import (
    BoxParts,
    TensorReport,
    WriteReport,
    assemble_metadata,
    referenced_parts,
    tensor_metadata,
    written_parts,
)
from reshard.planning.descriptions import DescriptionTable, LocalSaveDescription, TensorPiece
from reshard.planning.incremental import ReferencedBox

pytestmark = pytest.mark.unit


def row(r: int) -> TensorPiece:
    return TensorPiece(key="w", dtype="float32", global_shape=(2, 4), box=Box((r, 0), (1, 4)), replica_id=0)


TABLE = DescriptionTable.from_descriptions([LocalSaveDescription(tensors=(row(r),), objects=()) for r in range(2)])


def report(rank: int, *, prints: bool = True) -> WriteReport:
    tensors = TensorReport.of((0,), (0,), (16,), (100 + rank,), (7 + rank,) if prints else None)
    return WriteReport(file=f"data/x-r{rank:05d}.bin", size=16, tensors=tensors)


def base_box() -> ReferencedBox:
    return ReferencedBox(
        checkpoint="a",
        path="data/y-r00000.bin",
        size=32,
        byte_offset=16,
        byte_length=16,
        checksums=np.array([5], dtype=np.uint32),
        content_hash=b"h" * 16,
    )


def test_written_parts_number_the_files_of_the_ranks_that_wrote() -> None:
    files, parts, entries = written_parts(TABLE, [WriteReport(), report(1)])
    assert [f.path for f in files] == ["data/x-r00001.bin"]
    assert [r.tolist() for r in parts.rows] == [[1]]  # rank 1's box is table row 1
    assert [f.tolist() for f in parts.file] == [[0]]
    assert parts.fingerprints == (8,) and parts.fingerprinted
    assert entries == {}


def test_referenced_parts_list_each_holders_file_once_after_the_saves_own() -> None:
    reused = WriteReport(tensors=TensorReport.of((), (), (), (), reused=(0,)))
    files, parts = referenced_parts(TABLE, [reused, reused], {0: base_box(), 1: base_box()}, first_file=3)
    assert [(f.checkpoint, f.path) for f in files] == [("a", "data/y-r00000.bin")]
    assert [f.tolist() for f in parts.file] == [[3], [3]]
    with pytest.raises(ValueError, match="no base"):
        referenced_parts(TABLE, [reused], None, first_file=0)


def test_box_parts_join_in_order_and_count_checksums_per_chunk() -> None:
    _, parts, _ = written_parts(TABLE, [report(0), report(1)])
    row_ids, columns = (parts + BoxParts()).columns(TABLE, chunk_bytes=10, content_hashes=False)
    assert row_ids.tolist() == [0, 1]
    assert columns.crc_count.tolist() == [2, 2] and columns.crc_start.tolist() == [0, 2]
    assert columns.content_hash is None


def test_tensor_metadata_combines_fingerprints_only_when_computed() -> None:
    _, parts, _ = written_parts(TABLE, [report(0), report(1)])
    row_ids, columns = parts.columns(TABLE, chunk_bytes=16, content_hashes=False)
    with_prints = tensor_metadata(TABLE, row_ids, columns, parts.fingerprints)
    without = tensor_metadata(TABLE, row_ids, columns, None)
    assert with_prints["w"].fingerprint is not None and without["w"].fingerprint is None
    assert with_prints["w"].global_shape == (2, 4)


def test_assemble_metadata_records_every_box_once() -> None:
    metadata = assemble_metadata(
        TABLE, [report(0), report(1, prints=True)], save_id="s" * 32, world_size=2, chunk_bytes=16, common={"step": 3}
    )
    assert metadata.total_bytes == 32 and len(metadata.files) == 2
    assert metadata.common == {"step": 3}
