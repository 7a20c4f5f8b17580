"""Read items that share checksum chunks (reshard.io.chunkgroups): grouped, and streamed once through a buffer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard
from reshard.errors import CorruptCheckpointError
from reshard.geometry.boxes import Box
from reshard.io.chunkgroups import chunk_groups, merged, stream_group, touched_ranges
from reshard.io.verified import VerifiedReader
from reshard.metadata import Metadata
from reshard.planning.load_plan import LoadPlan, TargetPiece, plan_load
from reshard.storage import LocalStorage, ReadRequest

pytestmark = pytest.mark.unit

CHUNK = 512
FULL = torch.arange(32 * 32, dtype=torch.float32).reshape(32, 32)  # 128-byte rows, four to a chunk


def _saved(tmp_path: Path) -> Metadata:
    reshard.save({"w": FULL}, tmp_path, options=reshard.SaveOptions(checksum_chunk_bytes=CHUNK))
    return reshard.read_metadata(tmp_path)


def _plan(metadata: Metadata, boxes: list[Box], max_read_bytes: int = 1 << 20) -> LoadPlan:
    targets = [TargetPiece(key="w", box=box) for box in boxes]
    return plan_load(metadata, targets, max_read_bytes=max_read_bytes, max_read_amplification=1.0)


def test_merged_joins_touching_and_overlapping_ranges() -> None:
    assert merged([(512, 1024), (0, 512), (2048, 2560), (700, 900)]) == [(0, 1024), (2048, 2560)]
    assert merged([]) == []


def test_items_in_one_chunk_form_one_group_and_others_their_own(tmp_path: Path) -> None:
    metadata = _saved(tmp_path)
    rows = [Box((r, 0), (1, 32)) for r in (0, 1, 2, 9, 30)]  # rows 0-2 share chunk 0; 9 and 30 stand alone
    plan = _plan(metadata, rows)
    saved = metadata.tensors["w"].boxes[0]
    groups = list(chunk_groups(plan.items, lambda item: touched_ranges(item, saved, CHUNK)))
    assert [len(g.items) for g in groups] == [3, 1, 1]
    assert groups[0].touched_bytes == 3 * CHUNK and groups[0].union_bytes == CHUNK
    assert [g.ranges for g in groups[1:]] == [[[(2 * CHUNK, 3 * CHUNK)]], [[(7 * CHUNK, 8 * CHUNK)]]]


ROWS = [Box((4, 0), (2, 32)), Box((7, 0), (2, 32)), Box((9, 0), (1, 32))]
"""Rows 4-5, 7-8 and 9: items that share chunks 1 (rows 4-7) and 2 (rows 8-11)."""


def _stream(tmp_path: Path, metadata: Metadata, buffer_bytes: int) -> tuple[int, dict[Box, torch.Tensor]]:
    plan = _plan(metadata, ROWS)
    saved = metadata.tensors["w"].boxes[0]
    (group,) = chunk_groups(plan.items, lambda item: touched_ranges(item, saved, CHUNK))
    reader = VerifiedReader(LocalStorage(tmp_path), metadata, transfer_bytes=1 << 20, stream_bytes=64)
    served: list[tuple[int, int]] = []

    def read(requests: list[ReadRequest], whats: list[str]) -> None:
        served.extend((r.offset, len(r.buffer)) for r in requests)
        reader.read(requests, whats)

    dests = {item.overlap: torch.zeros(item.overlap.shape) for item in group.items}
    name = metadata.files[0].location
    verified = stream_group(
        [(item, dests[item.overlap]) for item in group.items],
        merged(r for ranges in group.ranges for r in ranges),
        saved,
        dtype=torch.float32,
        chunk_bytes=CHUNK,
        name=name,
        where=name,
        what="tensor 'w'",
        buffer=torch.empty(buffer_bytes, dtype=torch.uint8),
        read=read,
    )
    assert sum(length for _, length in served) == verified  # each touched chunk served once
    return verified, dests


@pytest.mark.parametrize("buffer_bytes", [8, 100, 4096])
def test_a_group_is_read_once_and_fills_every_item(tmp_path: Path, buffer_bytes: int) -> None:
    metadata = _saved(tmp_path)
    verified, dests = _stream(tmp_path, metadata, buffer_bytes)
    assert verified == 2 * CHUNK and set(dests) == set(ROWS)
    for box, dest in dests.items():
        assert torch.equal(dest, FULL[box.offset[0] : box.offset[0] + box.shape[0]])


@pytest.mark.parametrize("at", [0, 200, 511, 512, 1023])
def test_a_flipped_byte_of_a_streamed_chunk_fails_the_group(tmp_path: Path, at: int) -> None:
    metadata = _saved(tmp_path)
    offset = metadata.tensors["w"].boxes[0].byte_offset + CHUNK + at  # chunk 1 or 2
    path = tmp_path / metadata.files[0].path
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 4
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="tensor 'w': checksum mismatch"):
        _stream(tmp_path, metadata, 100)
