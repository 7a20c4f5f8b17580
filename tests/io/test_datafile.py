"""The data-file writer and the reader round trip: ranges written by DataFileWriter read back and verify."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import xxhash

from reshard.errors import CorruptCheckpointError
from reshard.io.checksums import chunk_checksums
from reshard.io.chunkcheck import Segment, StoredChunks, verify_segments
from reshard.io.datafile import (
    ALIGNMENT,
    DataFileWriter,
    StoredRange,
    content_digest,
    data_file_name,
    host_slabs,
    is_data_file_of,
)
from reshard.storage import LocalStorage, ReadRequest

pytestmark = pytest.mark.unit

CHUNK = 100


def _read(storage: LocalStorage, name: str, offset: int, length: int) -> memoryview:
    view = memoryview(bytearray(length))
    assert storage.read_ranges([ReadRequest(name, offset, view)]) == [length]
    return view


def _verify(storage: LocalStorage, name: str, stored: StoredRange) -> int:
    offset, length = stored.byte_offset, stored.byte_length
    chunks = StoredChunks("range", name, name, offset, length, stored.checksums, CHUNK)
    return verify_segments(
        chunks, [(0, length)] if length else [], [Segment(0, length, _read(storage, name, offset, length))]
    )


def test_ranges_are_aligned_checksummed_and_read_back(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    name = data_file_name("0123abcd", 3)
    blobs = [os.urandom(n) for n in (1, 250, 0, 1000, 64)]
    writer = DataFileWriter(storage, name, CHUNK, hash_content=True)
    stored = [writer.append(memoryview(blob)) for blob in blobs]
    size = writer.commit()
    assert size == (tmp_path / name).stat().st_size
    for blob, where in zip(blobs, stored, strict=True):
        assert where.byte_offset % ALIGNMENT == 0 and where.byte_length == len(blob)
        assert where.checksums == chunk_checksums(memoryview(blob), CHUNK)
        assert where.content_hash == xxhash.xxh3_128_digest(blob)
        assert bytes(_read(storage, name, where.byte_offset, len(blob))) == blob
        assert _verify(storage, name, where) == len(blob)
    assert is_data_file_of(name, "0123abcd") and not is_data_file_of(name, "0123abce")


def test_tensors_through_host_slabs_store_their_c_order_bytes(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    plain = torch.arange(600, dtype=torch.float32)
    transposed = torch.arange(12 * 40, dtype=torch.int16).reshape(12, 40).t()
    slabs = host_slabs(1 << 20)
    writer = DataFileWriter(storage, "data/t.bin", CHUNK, slabs=slabs, hash_content=True)
    first, second = writer.append_tensors([plain, transposed])
    writer.commit()
    assert slabs.bytes_copied == transposed.nbytes
    got = torch.frombuffer(_read(storage, "data/t.bin", second.byte_offset, second.byte_length), dtype=torch.int16)
    assert torch.equal(got.reshape(40, 12), transposed.contiguous())
    assert second.content_hash == content_digest(transposed) == content_digest(transposed.contiguous())
    assert _verify(storage, "data/t.bin", first) == plain.nbytes


def test_streamed_pieces_checksum_as_one_range(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    data = os.urandom(777)
    writer = DataFileWriter(storage, "data/s.bin", CHUNK)
    writer.append(memoryview(b"x"))
    writer.begin()
    for start in range(0, len(data), 33):
        writer.feed(memoryview(data)[start : start + 33])
    stored = writer.end()
    writer.commit()
    assert stored.byte_offset == ALIGNMENT and stored.checksums == chunk_checksums(memoryview(data), CHUNK)
    with pytest.raises(RuntimeError, match="no range"):
        DataFileWriter(storage, "data/u.bin", CHUNK).end()


def test_a_flipped_byte_in_a_written_range_fails_verification(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    writer = DataFileWriter(storage, "data/f.bin", CHUNK)
    stored = writer.append(memoryview(os.urandom(450)))
    writer.commit()
    path = tmp_path / "data/f.bin"
    raw = bytearray(path.read_bytes())
    raw[stored.byte_offset + 333] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=r"at bytes \[300, 400\)"):
        _verify(storage, "data/f.bin", stored)


def test_an_aborted_file_is_gone_and_the_old_slab_name_is_the_same_budget(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    writer = DataFileWriter(storage, "data/a.bin", CHUNK)
    writer.append(memoryview(b"abc"))
    writer.abort()
    assert not (tmp_path / "data/a.bin").exists()
    assert host_slabs(8 << 20).slab_bytes == 1 << 20
