"""Golden-file tests of checkpoint format version 3 (``docs/format.md``, section 6.2: the document's checksum).

``tests/data/golden_v3/`` is a tiny checkpoint that ``reshard.save`` wrote once (``tests/data/make_golden_v3.py``;
committed, never regenerated while the format version stays 3), of the same state as the version-2 fixture.
The expected values are written out here:

- the document ends with ``,"metadata_crc32c":"6d4b11af"}``, and ``6d4b11af`` is the CRC-32C of every byte
  before those 8 digits (computed here with the ``crc32c`` package, not with reshard);
- every member but the checksum and the version is the version-2 fixture's (but for the save id), and the
  data file is the same bytes: version 3 changes nothing else;
- a change of any byte of the document (a digit of an offset, a size, a shape; one bit) is refused with
  ``CorruptCheckpointError`` before anything is read, and so is a version-3 document without its checksum;
- writing: saving the same state with the same save id gives the same document, byte for byte (but for the
  ``created_by`` string, which names the library version, and so the checksum).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from unittest import mock

import crc32c
import pytest
import torch

import reshard
from tests.data.make_golden_v2 import CHECKSUM_CHUNK_BYTES, golden_state_dict
from tests.metadata_docs import seal, unseal
from tests.tiers import FAST_TIER_ENV

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_v3"
GOLDEN_V2 = Path(__file__).resolve().parents[1] / "data" / "golden_v2"
SAVE_ID = "3333333333333333cccccccccccccccc"
CHECKSUM = "6d4b11af"
TRAILER = b',"metadata_crc32c":"' + CHECKSUM.encode() + b'"}'


def _raw() -> bytes:
    return (GOLDEN / "metadata.json").read_bytes()


def test_the_document_ends_with_its_checksum() -> None:
    raw = _raw()
    assert raw.endswith(TRAILER)
    assert f"{crc32c.crc32c(raw[:-10]):08x}" == CHECKSUM
    doc = json.loads(raw)
    assert doc["version"] == 3 and doc["metadata_crc32c"] == CHECKSUM
    assert list(doc)[-1] == "metadata_crc32c"


def test_version_3_is_version_2_plus_the_checksum() -> None:
    new = json.loads(_raw())
    old = json.loads((GOLDEN_V2 / "metadata.json").read_bytes())
    assert (new.pop("version"), old.pop("version")) == (3, 2)
    new.pop("metadata_crc32c")
    for doc in (new, old):
        doc["files"][0]["path"] = doc["files"][0]["path"].replace(doc.pop("save_id"), "<save_id>")
        doc.pop("created_by")
    assert new == old
    v3_data = (GOLDEN / "data" / f"{SAVE_ID}-r00000.bin").read_bytes()
    assert v3_data == next((GOLDEN_V2 / "data").iterdir()).read_bytes()


def test_the_fixture_loads() -> None:
    loaded = reshard.load(
        {
            "opt": torch.zeros(16, 4),
            "bias": torch.zeros(3),
            "iteration": 0,
            "pinwheel": torch.zeros(8, 8, dtype=torch.int16),
        },
        GOLDEN,
    )
    assert torch.equal(loaded["opt"], torch.arange(64, dtype=torch.float32).reshape(16, 4))
    assert torch.equal(loaded["pinwheel"], torch.arange(64, dtype=torch.int16).reshape(8, 8))
    assert loaded["bias"].tolist() == [0.5, -1.0, 2.0] and loaded["iteration"] == 5
    assert reshard.read_metadata(GOLDEN).format_version == 3


@pytest.mark.parametrize(
    "change",
    [
        (b'"size":', 1),  # the data file's size
        (b'"global_shape":[3]', 16),  # bias's shape
        (b'"byte_offset":', 14),  # a box's offset
        (b'"iteration":5', 12),  # a common value
        (b'"version":3', 10),  # the version itself
        (b"metadata_crc32c", 2),  # the member's name
        (CHECKSUM.encode(), 3),  # the checksum
    ],
    ids=["file_size", "shape", "byte_offset", "common", "version", "member_name", "checksum"],
)
def test_a_changed_byte_is_refused(tmp_path: Path, change: tuple[bytes, int]) -> None:
    needle, shift = change
    raw = bytearray(_raw())
    at = raw.index(needle) + shift
    raw[at] = ord("7") if raw[at] != ord("7") else ord("8")
    shutil.copytree(GOLDEN, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "metadata.json").write_bytes(bytes(raw))
    with pytest.raises(reshard.CorruptCheckpointError, match="metadata"):
        reshard.read_metadata(tmp_path / "ckpt")


def test_every_single_bit_flip_of_the_document_is_refused(tmp_path: Path) -> None:
    raw = _raw()
    shutil.copytree(GOLDEN, tmp_path / "ckpt")
    target = tmp_path / "ckpt" / "metadata.json"
    stride = 37 if os.environ.get(FAST_TIER_ENV) else 7  # make test-fast flips a fifth of them
    for at in range(0, len(raw), stride):
        flipped = bytearray(raw)
        flipped[at] ^= 1 << (at % 8)
        target.write_bytes(bytes(flipped))
        with pytest.raises(reshard.CorruptCheckpointError):
            reshard.read_metadata(tmp_path / "ckpt")


def test_a_version_3_document_without_its_checksum_is_refused(tmp_path: Path) -> None:
    shutil.copytree(GOLDEN, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "metadata.json").write_bytes(unseal(_raw()))
    with pytest.raises(reshard.CorruptCheckpointError, match="must end with its checksum"):
        reshard.read_metadata(tmp_path / "ckpt")
    # resealed as the format says (by tests/metadata_docs.py, not by reshard): valid again
    (tmp_path / "ckpt" / "metadata.json").write_bytes(seal(unseal(_raw())))
    assert reshard.read_metadata(tmp_path / "ckpt").save_id == SAVE_ID


def test_saving_the_same_state_writes_the_same_document(tmp_path: Path) -> None:
    with mock.patch("uuid.uuid4", return_value=uuid.UUID(SAVE_ID)):
        reshard.save(
            golden_state_dict(),
            tmp_path / "ckpt",
            options=reshard.SaveOptions(checksum_chunk_bytes=CHECKSUM_CHUNK_BYTES),
        )
    new, old = (tmp_path / "ckpt" / "metadata.json").read_bytes(), _raw()
    assert f"{crc32c.crc32c(new[:-10]):08x}".encode() == new[-10:-2]
    version = reshard.__version__.encode()
    assert unseal(new).replace(b'"created_by":"reshard ' + version + b'"', b"<by>") == unseal(old).replace(
        b'"created_by":"reshard 0.1.0"', b"<by>"
    )
    assert (tmp_path / "ckpt" / "data" / f"{SAVE_ID}-r00000.bin").read_bytes() == (
        GOLDEN / "data" / f"{SAVE_ID}-r00000.bin"
    ).read_bytes()
