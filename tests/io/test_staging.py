"""Node-local staging's verification of a copy already on local disk (reshard.io.staging.file_is_complete)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import reshard
from reshard.io.staging import file_is_complete, staged_name, stored_ranges
from reshard.metadata import Metadata

pytestmark = pytest.mark.unit

CHUNK = 256


def _saved(tmp_path: Path) -> tuple[Metadata, Path]:
    """A checkpoint of one tensor and one object in one data file, copied into a staging directory."""
    source = tmp_path / "ckpt"
    state = {"w": torch.arange(512, dtype=torch.float32), "o": reshard.ShardedObject("o", {"a": 1}, (1,), (0,))}
    reshard.save(state, source, options=reshard.SaveOptions(checksum_chunk_bytes=CHUNK))
    metadata = reshard.read_metadata(source)
    (entry,) = metadata.files
    staged = tmp_path / "stage" / staged_name(entry)
    staged.parent.mkdir(parents=True)
    shutil.copyfile(source / entry.path, staged)
    return metadata, staged


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_complete_copy_is_complete(tmp_path: Path) -> None:
    metadata, staged = _saved(tmp_path)
    assert file_is_complete(staged, metadata, 0)
    assert file_is_complete(staged, metadata, 0, stored_ranges(metadata, {0}))


def test_a_flipped_byte_in_any_stored_box_or_blob_makes_it_incomplete(tmp_path: Path) -> None:
    metadata, staged = _saved(tmp_path)
    box = metadata.tensors["w"].boxes[0]
    blob = metadata.objects["o"].entries[0]
    for at in (
        box.byte_offset,
        box.byte_offset + 3 * CHUNK + 7,
        box.byte_offset + box.byte_length - 1,
        blob.byte_offset,
    ):
        _flip(staged, at)
        assert not file_is_complete(staged, metadata, 0), at
        _flip(staged, at)
    assert file_is_complete(staged, metadata, 0)


def test_a_copy_of_another_size_or_none_is_incomplete(tmp_path: Path) -> None:
    metadata, staged = _saved(tmp_path)
    with staged.open("ab") as f:
        f.write(b"\0")
    assert not file_is_complete(staged, metadata, 0)
    staged.unlink()
    assert not file_is_complete(staged, metadata, 0)


def test_stored_ranges_lists_every_box_and_blob_of_the_file(tmp_path: Path) -> None:
    metadata, _ = _saved(tmp_path)
    ranges = stored_ranges(metadata, {0})[0]
    box, blob = metadata.tensors["w"].boxes[0], metadata.objects["o"].entries[0]
    assert sorted(ranges) == sorted(
        [(box.byte_offset, box.byte_length, box.checksums), (blob.byte_offset, blob.byte_length, blob.checksums)]
    )


@pytest.mark.parametrize("damage", ["truncated", "grown", "missing"])
def test_a_staged_load_of_a_damaged_source_file_is_corrupt_like_a_plain_load(tmp_path: Path, damage: str) -> None:
    """Found by the outside attack on issue 31: a data file of another size than the metadata says, or gone,
    is a damaged checkpoint (``CorruptCheckpointError`` naming the file, as the plain load says), not a storage
    failure, whether or not the load stages files on node-local disk; nothing is left in the staging
    directory."""
    metadata, _ = _saved(tmp_path)
    (entry,) = metadata.files
    data_file = tmp_path / "ckpt" / entry.path
    if damage == "missing":
        data_file.unlink()
    else:
        raw = data_file.read_bytes()
        data_file.write_bytes(raw[:-4] if damage == "truncated" else raw + b"\0")
    template = {"w": torch.empty(512), "o": reshard.ShardedObject("o", None, (1,), (0,))}
    errors = []
    for staging in (None, reshard.StagingOptions(directory=tmp_path / "node")):
        with pytest.raises(reshard.CorruptCheckpointError, match=entry.path.split("/")[-1]) as caught:
            reshard.load(template, tmp_path / "ckpt", options=reshard.LoadOptions(staging=staging))
        errors.append(type(caught.value))
    assert errors[0] is errors[1]
    assert not [p for p in (tmp_path / "node").rglob("*") if p.is_file()]
