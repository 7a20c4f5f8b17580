"""The one chunk verifier (reshard.io.chunkcheck) alone: bytes in memory or streamed, checked against chunk CRC-32Cs."""

from __future__ import annotations

import os

import pytest

from reshard.errors import CorruptCheckpointError
from reshard.io.checksums import chunk_checksums, crc32c_of
from reshard.io.chunkcheck import ChunkProgress, Segment, StoredChunks, check_chunk, feed, verify_segments

pytestmark = pytest.mark.unit

CHUNK = 16
DATA = os.urandom(100)  # 7 chunks: six of 16 bytes, the last of 4


def _stored(data: bytes = DATA) -> StoredChunks:
    return StoredChunks(
        what="tensor 'w' box at [0]",
        name="data/x.bin",
        where="/ckpt/data/x.bin",
        byte_offset=128,
        byte_length=len(DATA),
        checksums=chunk_checksums(memoryview(data), CHUNK),
        chunk_bytes=CHUNK,
    )


def _flipped(at: int) -> bytes:
    return DATA[:at] + bytes([DATA[at] ^ 1]) + DATA[at + 1 :]


def test_chunks_cut_a_range_at_chunk_bounds_and_the_box_end() -> None:
    assert list(_stored().chunks(32, 100)) == [(32, 48), (48, 64), (64, 80), (80, 96), (96, 100)]


def test_check_chunk_passes_the_right_crc_and_names_file_offset_and_key_otherwise() -> None:
    stored = _stored()
    assert check_chunk(stored, 96, 100, crc32c_of(DATA[96:100])) == 4
    with pytest.raises(CorruptCheckpointError) as error:
        check_chunk(stored, 16, 32, crc32c_of(DATA[16:32]) ^ 1)
    assert (
        str(error.value) == "tensor 'w' box at [0]: checksum mismatch in data file /ckpt/data/x.bin at bytes [144, 160)"
    )


def test_a_chunk_past_the_checksums_is_a_mismatch() -> None:
    stored = StoredChunks("w", "n", "n", 0, 100, (), CHUNK)
    with pytest.raises(CorruptCheckpointError):
        check_chunk(stored, 0, 16, crc32c_of(DATA[:16]))


def test_segments_in_memory_verify_and_count_the_chunks() -> None:
    view = memoryview(DATA)
    segments = [Segment(16, 10, view[16:26]), Segment(26, 22, view[26:48])]
    assert verify_segments(_stored(), [(16, 48)], segments) == 32


@pytest.mark.parametrize("at", [16, 31, 40, 47])
def test_a_flipped_byte_in_a_covered_chunk_is_caught(at: int) -> None:
    view = memoryview(_flipped(at))
    with pytest.raises(CorruptCheckpointError, match=r"at bytes \[1(44|60), 1(60|76)\)"):
        verify_segments(_stored(), [(16, 48)], [Segment(16, 32, view[16:48])])


def test_a_flipped_byte_outside_the_ranges_is_not_looked_at() -> None:
    view = memoryview(_flipped(70))
    assert verify_segments(_stored(), [(16, 48), (96, 100)], [Segment(16, 32, view[16:48]), Segment(96, 4, view[96:])])


def test_segments_without_a_view_are_streamed_from_the_callable() -> None:
    asked: list[tuple[int, int]] = []

    def stream(start: int, length: int, value: int) -> int:
        asked.append((start, length))
        return crc32c_of(DATA[start : start + length], value)

    view = memoryview(DATA)
    segments = [Segment(0, 20), Segment(20, 8, view[20:28]), Segment(28, 4)]
    assert verify_segments(_stored(), [(0, 32)], segments, stream) == 32
    assert asked == [(0, 16), (16, 4), (28, 4)]


def test_streamed_bytes_that_differ_are_caught() -> None:
    def stream(start: int, length: int, value: int) -> int:
        return crc32c_of(_flipped(5)[start : start + length], value)

    with pytest.raises(CorruptCheckpointError, match=r"\[128, 144\)"):
        verify_segments(_stored(), [(0, 100)], [Segment(0, 100)], stream)


def test_a_gap_in_the_segments_is_a_bug_not_damage() -> None:
    view = memoryview(DATA)
    with pytest.raises(AssertionError, match="no bytes"):
        verify_segments(_stored(), [(0, 32)], [Segment(0, 16, view[:16]), Segment(20, 12, view[20:32])])
    with pytest.raises(AssertionError, match="neither in memory"):
        verify_segments(_stored(), [(0, 16)], [Segment(0, 16)])


@pytest.mark.parametrize("piece", [1, 5, 16, 23, 100])
def test_feed_checks_each_chunk_when_its_last_byte_arrives(piece: int) -> None:
    stored, progress, verified = _stored(), ChunkProgress(), 0
    for start in range(0, len(DATA), piece):
        before = verified
        progress, done = feed(stored, progress, start, memoryview(DATA)[start : start + piece])
        verified += done
        end = min(start + piece, len(DATA))
        assert verified - before == sum(
            min(c + CHUNK, 100) - c for c in range(0, 100, CHUNK) if start < min(c + CHUNK, 100) <= end
        )
    assert verified == 100 and progress.position == 100


def test_feed_may_skip_to_another_chunk_start_only() -> None:
    stored = _stored()
    progress, _ = feed(stored, ChunkProgress(), 0, memoryview(DATA)[:16])
    progress, done = feed(stored, progress, 48, memoryview(DATA)[48:64])
    assert done == 16 and progress == ChunkProgress(64, 0)
    with pytest.raises(ValueError, match="expected 64"):
        feed(stored, progress, 70, memoryview(DATA)[70:80])


def test_feed_catches_a_flipped_byte_at_the_end_of_its_chunk() -> None:
    stored, data = _stored(), memoryview(_flipped(33))
    progress, done = feed(stored, ChunkProgress(), 0, data[:40])
    assert done == 32
    with pytest.raises(CorruptCheckpointError, match=r"\[160, 176\)"):
        feed(stored, progress, 40, data[40:48])
