"""The file verifier (reshard.io.verified.verify_stored_ranges) and the checks of VerifiedReader, on real files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard
from reshard.errors import CorruptCheckpointError
from reshard.io.verified import StoredEntry, VerifiedReader, verify_stored_ranges
from reshard.metadata import Metadata
from reshard.storage import LocalStorage, ReadRequest

pytestmark = pytest.mark.unit

CHUNK = 128


def _saved(tmp_path: Path) -> tuple[LocalStorage, Metadata, list[StoredEntry]]:
    state = {"a": torch.arange(300, dtype=torch.float32), "b": torch.ones(40, dtype=torch.float64)}
    reshard.save(state, tmp_path, options=reshard.SaveOptions(checksum_chunk_bytes=CHUNK))
    metadata = reshard.read_metadata(tmp_path)
    entries = [
        (f"tensor {key!r}", box.file, box.byte_offset, box.byte_length, box.checksums)
        for key, tensor in sorted(metadata.tensors.items())
        for box in tensor.boxes
    ]
    return LocalStorage(tmp_path), metadata, entries


def _flip(tmp_path: Path, metadata: Metadata, at: int) -> None:
    path = tmp_path / metadata.files[0].path
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def test_good_files_have_no_problem_and_every_byte_is_reported(tmp_path: Path) -> None:
    storage, metadata, entries = _saved(tmp_path)
    told: list[int] = []
    assert verify_stored_ranges(storage, metadata, entries, on_verified=told.append) == []
    assert told == [entry[3] for entry in entries]


@pytest.mark.parametrize("piece", [1, 7, 1 << 20])
def test_one_problem_per_damaged_box_naming_it_whatever_the_buffer(tmp_path: Path, piece: int) -> None:
    storage, metadata, entries = _saved(tmp_path)
    _, _, offset, length, _ = entries[0]
    _flip(tmp_path, metadata, offset + length - 1)
    problems = verify_stored_ranges(storage, metadata, entries, memory_budget_bytes=piece)
    assert len(problems) == 1 and problems[0].startswith("tensor 'a': checksum mismatch")
    last = offset + (length - 1) // CHUNK * CHUNK
    assert f"[{last}, {offset + length})" in problems[0]


def test_stop_at_first_ends_the_check(tmp_path: Path) -> None:
    storage, metadata, entries = _saved(tmp_path)
    for _, _, offset, _, _ in entries:
        _flip(tmp_path, metadata, offset)
    assert len(verify_stored_ranges(storage, metadata, entries)) == 2
    assert len(verify_stored_ranges(storage, metadata, entries, stop_at_first=True)) == 1


def test_a_truncated_file_is_a_problem_not_an_error(tmp_path: Path) -> None:
    storage, metadata, entries = _saved(tmp_path)
    path = tmp_path / metadata.files[0].path
    path.write_bytes(path.read_bytes()[: entries[1][2] + 8])
    problems = verify_stored_ranges(storage, metadata, entries)
    assert len(problems) == 1 and "truncated" in problems[0]


def test_check_file_refuses_another_size(tmp_path: Path) -> None:
    storage, metadata, _ = _saved(tmp_path)
    reader = VerifiedReader(storage, metadata, transfer_bytes=1024, stream_bytes=64)
    reader.check_file(0)
    path = tmp_path / metadata.files[0].path
    path.write_bytes(path.read_bytes() + b"x")
    reader.check_file(0)  # checked once per reader
    with pytest.raises(CorruptCheckpointError, match="truncated or altered"):
        VerifiedReader(storage, metadata, transfer_bytes=1024, stream_bytes=64).check_file(0)


def test_a_short_read_is_a_truncated_file(tmp_path: Path) -> None:
    storage, metadata, _ = _saved(tmp_path)
    reader = VerifiedReader(storage, metadata, transfer_bytes=1024, stream_bytes=64)
    size = metadata.files[0].size
    with pytest.raises(CorruptCheckpointError, match="is truncated"):
        reader.read([ReadRequest(metadata.files[0].location, size - 4, memoryview(bytearray(8)))], ["x"])
