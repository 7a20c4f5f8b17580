"""Golden-file tests of checkpoint format version 1 (``docs/format.md``).

``tests/data/golden_v1/`` is a tiny checkpoint that ``reshard.save`` wrote once (see
``tests/data/make_golden_v1.py``; it is committed and must not be regenerated while the format version stays
1). Every expected value below is a constant written out here, never recomputed by reshard, so that any
accidental change of the on-disk format, on the reading or the writing side, fails one of these tests:

- reading: the committed fixture must load to exactly these values and parse to exactly these fields;
- bytes: the data file must hold exactly these little-endian bytes at exactly these offsets;
- writing: saving the same state again must produce the same data bytes and the same metadata members
  (apart from the random save id and the library version): the document is now written as version 3,
  which is this one plus its own checksum (``tests/metadata/test_format_golden_v3.py``).
"""

from __future__ import annotations

import base64
import json
import math
import struct
from pathlib import Path

import crc32c
import pytest
import torch

import reshard

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_v1"
SAVE_ID = "0123456789abcdef0123456789abcdef"
DATA_FILE = f"data/{SAVE_ID}-r00000.bin"
DATA_FILE_SIZE = 496
CHUNK_BYTES = 16

WEIGHT = [[0.5, -1.25, 2.0], [3.75, 100.0, -0.015625]]
BIAS = [1.5, -2.0, 0.3125, 65280.0]
BIAS_BITS = (0x3FC0, 0xC000, 0x3EA0, 0x477F)  # the bfloat16 encodings of BIAS
COUNTS = [1, -2, 2**40]
SCALE = 0.25
RNG_STATE = [7, 8, 9]

# key -> (dtype, global_shape, box offset, box shape, byte_offset, byte_length, crc32c of 16-byte chunks)
EXPECTED_TENSORS = {
    "counts": ("int64", (3,), (0,), (3,), 128, 24, (1024398206, 694755572)),
    "model.bias": ("bfloat16", (4,), (0,), (4,), 64, 8, (956321850,)),
    "model.weight": ("float32", (2, 3), (0, 0), (2, 3), 0, 24, (3179691698, 3183785150)),
    "scale": ("float32", (), (), (), 192, 4, (792676264,)),
}
RNG_BYTE_OFFSET = 256
RNG_BYTE_LENGTH = 240
RNG_CHECKSUMS = (
    2750183803,
    229913101,
    1028285095,
    261550448,
    1856441812,
    2430097082,
    3530242403,
    1219261510,
    1658275784,
    3064292734,
    551271843,
    1760688955,
    2118061090,
    2738269106,
    1578549954,
)
RNG_HEADER = (
    b'{"value":{"state":{"$tensor":0},"shape":{"$tuple":[3,"x",null,{"$float":"inf"}]},"seed":1234,'
    b'"raw":{"$bytes":"AP9vaw=="},"by_step":{"$dict":[[10,"ten"]]}},'
    b'"tensors":[{"dtype":"int32","shape":[3],"offset":0,"length":12}]}'
)
COMMON_WIRE = {
    "iteration": 1000,
    "loss_scale": {"$float": "nan"},
    "name": "golden",
    "note": None,
    "resume": True,
    "nested.0": 1,
    "nested.1.0": 2.5,
    "nested.1.1": "three",
}
TOP_LEVEL_FIELDS = [
    "format",
    "version",
    "save_id",
    "created_by",
    "world_size",
    "checksum",
    "files",
    "tensors",
    "objects",
    "common",
]


def golden_state() -> dict[str, object]:
    """The state dict the fixture was saved from, spelled out independently of the generator script."""
    return {
        "model": {
            "weight": reshard.ShardedTensor("model.weight", torch.tensor(WEIGHT, dtype=torch.float32), (2, 3), (0, 0)),
            "bias": torch.tensor(BIAS, dtype=torch.bfloat16),
        },
        "counts": torch.tensor(COUNTS, dtype=torch.int64),
        "scale": torch.tensor(SCALE, dtype=torch.float32),
        "rng": reshard.ShardedObject(
            "rng",
            {
                "state": torch.tensor(RNG_STATE, dtype=torch.int32),
                "shape": (3, "x", None, float("inf")),
                "seed": 1234,
                "raw": b"\x00\xffok",
                "by_step": {10: "ten"},
            },
            (1,),
            (0,),
        ),
        "iteration": 1000,
        "loss_scale": float("nan"),
        "name": "golden",
        "note": None,
        "resume": True,
        "nested": [1, [2.5, "three"]],
    }


def template() -> dict[str, object]:
    """What a loader asks for: same structure, empty tensors and placeholder values."""
    return {
        "model": {
            "weight": reshard.ShardedTensor("model.weight", torch.zeros(2, 3), (2, 3), (0, 0)),
            "bias": torch.zeros(4, dtype=torch.bfloat16),
        },
        "counts": torch.zeros(3, dtype=torch.int64),
        "scale": torch.zeros((), dtype=torch.float32),
        "rng": reshard.ShardedObject("rng", None, (1,), (0,)),
        "iteration": 0,
        "loss_scale": 0.0,
        "name": "",
        "note": "placeholder",
        "resume": False,
        "nested": [0, [0.0, ""]],
    }


def data_file_bytes() -> bytes:
    return (GOLDEN / DATA_FILE).read_bytes()


def test_fixture_is_complete_and_tiny() -> None:
    files = sorted(p.relative_to(GOLDEN).as_posix() for p in GOLDEN.rglob("*") if p.is_file())
    assert files == [DATA_FILE, "metadata.json"]
    assert (GOLDEN / DATA_FILE).stat().st_size == DATA_FILE_SIZE
    assert sum((GOLDEN / f).stat().st_size for f in files) < 20 * 1024


def test_load_returns_the_saved_values() -> None:
    out = reshard.load(template(), GOLDEN)

    weight = out["model"]["weight"]
    assert weight.dtype == torch.float32
    assert weight.tolist() == WEIGHT
    bias = out["model"]["bias"]
    assert bias.dtype == torch.bfloat16
    assert bias.float().tolist() == BIAS
    assert bytes(bias.view(torch.uint8).numpy()) == struct.pack("<4H", *BIAS_BITS)
    counts = out["counts"]
    assert counts.dtype == torch.int64
    assert counts.tolist() == COUNTS
    scale = out["scale"]
    assert scale.dtype == torch.float32
    assert scale.shape == ()
    assert scale.item() == SCALE

    rng = out["rng"]
    assert list(rng) == ["state", "shape", "seed", "raw", "by_step"]
    assert isinstance(rng["state"], torch.Tensor)
    assert rng["state"].dtype == torch.int32
    assert rng["state"].tolist() == RNG_STATE
    assert isinstance(rng["shape"], tuple)
    assert rng["shape"][:3] == (3, "x", None)
    assert rng["shape"][3] == math.inf
    assert rng["seed"] == 1234
    assert rng["raw"] == b"\x00\xffok"
    assert rng["by_step"] == {10: "ten"}

    assert out["iteration"] == 1000
    assert type(out["iteration"]) is int
    assert isinstance(out["loss_scale"], float)
    assert math.isnan(out["loss_scale"])
    assert out["name"] == "golden"
    assert out["note"] is None
    assert out["resume"] is True
    assert out["nested"] == [1, [2.5, "three"]]
    assert type(out["nested"][0]) is int
    assert type(out["nested"][1][0]) is float


def test_load_of_a_sub_box_reads_the_right_elements() -> None:
    part = torch.zeros(2, 2)
    out = reshard.load({"w": reshard.ShardedTensor("model.weight", part, (2, 3), (0, 1))}, GOLDEN)
    assert out["w"] is part
    assert part.tolist() == [[-1.25, 2.0], [100.0, -0.015625]]


def test_read_metadata_fields() -> None:
    md = reshard.read_metadata(GOLDEN)
    assert md.save_id == SAVE_ID
    assert md.created_by.startswith("reshard ")
    assert md.world_size == 1
    assert md.checksum_chunk_bytes == CHUNK_BYTES
    assert [(f.path, f.size) for f in md.files] == [(DATA_FILE, DATA_FILE_SIZE)]
    assert list(md.tensors) == ["counts", "model.bias", "model.weight", "scale"]
    for key, (dtype, global_shape, offset, shape, byte_offset, byte_length, checksums) in EXPECTED_TENSORS.items():
        tensor = md.tensors[key]
        assert tensor.key == key
        assert tensor.dtype == dtype
        assert tensor.global_shape == global_shape
        assert len(tensor.boxes) == 1
        (box,) = tensor.boxes
        assert (box.offset, box.shape, box.file) == (offset, shape, 0)
        assert (box.byte_offset, box.byte_length) == (byte_offset, byte_length)
        assert box.checksums == checksums
    assert md.total_bytes == 24 + 8 + 24 + 4
    assert list(md.objects) == ["rng"]
    rng = md.objects["rng"]
    assert rng.global_shape == (1,)
    assert len(rng.entries) == 1
    (entry,) = rng.entries
    assert (entry.offset, entry.file) == ((0,), 0)
    assert (entry.byte_offset, entry.byte_length) == (RNG_BYTE_OFFSET, RNG_BYTE_LENGTH)
    assert entry.checksums == RNG_CHECKSUMS
    assert list(md.common) == list(COMMON_WIRE)
    assert math.isnan(md.common["loss_scale"])
    assert {k: v for k, v in md.common.items() if k != "loss_scale"} == {
        k: v for k, v in COMMON_WIRE.items() if k != "loss_scale"
    }


def test_metadata_json_wire_form() -> None:
    raw = (GOLDEN / "metadata.json").read_bytes()
    assert raw.isascii()
    assert b"NaN" not in raw
    assert b"Infinity" not in raw
    doc = json.loads(raw)
    assert list(doc) == TOP_LEVEL_FIELDS
    assert doc["format"] == "reshard"
    assert doc["version"] == 1
    assert doc["checksum"] == {"algorithm": "crc32c", "chunk_bytes": CHUNK_BYTES}
    assert doc["files"] == [{"path": DATA_FILE, "size": DATA_FILE_SIZE}]
    assert doc["tensors"]["scale"] == {
        "dtype": "float32",
        "global_shape": [],
        "boxes": [{"offset": [], "shape": [], "file": 0, "byte_offset": 192, "byte_length": 4, "crc32c": [792676264]}],
    }
    assert doc["tensors"]["model.weight"]["boxes"] == [
        {
            "offset": [0, 0],
            "shape": [2, 3],
            "file": 0,
            "byte_offset": 0,
            "byte_length": 24,
            "crc32c": [3179691698, 3183785150],
        }
    ]
    assert doc["objects"] == {
        "rng": {
            "global_shape": [1],
            "entries": [
                {
                    "offset": [0],
                    "file": 0,
                    "byte_offset": RNG_BYTE_OFFSET,
                    "byte_length": RNG_BYTE_LENGTH,
                    "crc32c": list(RNG_CHECKSUMS),
                }
            ],
        }
    }
    assert doc["common"] == COMMON_WIRE


def test_data_file_bytes() -> None:
    data = data_file_bytes()
    assert len(data) == DATA_FILE_SIZE
    # Boxes: C order, little-endian, each starting at a multiple of 64; the gaps are zero bytes.
    assert data[0:24] == struct.pack("<6f", *WEIGHT[0], *WEIGHT[1])
    assert data[24:64] == bytes(40)
    assert data[64:72] == struct.pack("<4H", *BIAS_BITS)
    assert data[72:128] == bytes(56)
    assert data[128:152] == struct.pack("<3q", *COUNTS)
    assert data[152:192] == bytes(40)
    assert data[192:196] == struct.pack("<f", SCALE)
    assert data[196:256] == bytes(60)
    # The object blob: u64 header length, JSON header, then the tensors' raw bytes.
    blob = data[RNG_BYTE_OFFSET : RNG_BYTE_OFFSET + RNG_BYTE_LENGTH]
    assert len(RNG_HEADER) == 220
    assert blob == struct.pack("<Q", 220) + RNG_HEADER + struct.pack("<3i", *RNG_STATE)
    assert RNG_BYTE_OFFSET + RNG_BYTE_LENGTH == DATA_FILE_SIZE


def test_checksums_are_crc32c_of_chunks_of_each_box() -> None:
    assert crc32c.crc32c(b"123456789") == 0xE3069283  # the CRC-32C (Castagnoli) check value
    data = data_file_bytes()
    ranges = [(v[4], v[5], v[6]) for v in EXPECTED_TENSORS.values()]
    ranges.append((RNG_BYTE_OFFSET, RNG_BYTE_LENGTH, RNG_CHECKSUMS))
    for byte_offset, byte_length, checksums in ranges:
        box = data[byte_offset : byte_offset + byte_length]
        chunks = [box[i : i + CHUNK_BYTES] for i in range(0, byte_length, CHUNK_BYTES)]
        assert len(chunks) == -(-byte_length // CHUNK_BYTES)
        assert tuple(crc32c.crc32c(c) for c in chunks) == checksums


def test_an_independent_reader_finds_an_element() -> None:
    """Read element [1, 2] of model.weight with json and struct alone, as docs/format.md describes."""
    doc = json.loads((GOLDEN / "metadata.json").read_bytes())
    tensor = doc["tensors"]["model.weight"]
    assert tensor["dtype"] == "float32"
    index = (1, 2)
    (box,) = [
        b
        for b in tensor["boxes"]
        if all(o <= i < o + s for i, o, s in zip(index, b["offset"], b["shape"], strict=True))
    ]
    local = [i - o for i, o in zip(index, box["offset"], strict=True)]
    linear = local[0] * box["shape"][1] + local[1]
    position = box["byte_offset"] + linear * 4
    path = doc["files"][box["file"]]["path"]
    data = (GOLDEN / path).read_bytes()
    raw = data[position : position + 4]
    assert struct.unpack("<f", raw) == (-0.015625,)
    chunk = linear * 4 // doc["checksum"]["chunk_bytes"]
    chunk_start = box["byte_offset"] + chunk * CHUNK_BYTES
    chunk_end = box["byte_offset"] + min((chunk + 1) * CHUNK_BYTES, box["byte_length"])
    assert crc32c.crc32c(data[chunk_start:chunk_end]) == box["crc32c"][chunk]
    blob_entry = doc["objects"]["rng"]["entries"][0]
    assert doc["files"][blob_entry["file"]]["path"] == path
    blob = data[blob_entry["byte_offset"] : blob_entry["byte_offset"] + blob_entry["byte_length"]]
    (header_length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + header_length])
    assert base64.b64decode(header["value"]["raw"]["$bytes"]) == b"\x00\xffok"
    (entry,) = header["tensors"]
    body = blob[8 + header_length :]
    assert struct.unpack("<3i", body[entry["offset"] : entry["offset"] + entry["length"]]) == tuple(RNG_STATE)


def test_saving_the_same_state_writes_the_same_members(tmp_path: Path) -> None:
    md = reshard.save(
        golden_state(), tmp_path / "ckpt", options=reshard.SaveOptions(checksum_chunk_bytes=CHUNK_BYTES)
    ).metadata
    assert md is not None  # a single process is the coordinator
    (data_file,) = md.files
    assert data_file.path == f"data/{md.save_id}-r00000.bin"
    assert (tmp_path / "ckpt" / data_file.path).read_bytes() == data_file_bytes()
    new = json.loads((tmp_path / "ckpt" / "metadata.json").read_bytes())
    old = json.loads((GOLDEN / "metadata.json").read_bytes())
    assert (new.pop("version"), old.pop("version")) == (3, 1)  # version 3: version 1's members + the checksum
    assert new.pop("metadata_crc32c")
    assert len(new["save_id"]) == 32
    assert all(c in "0123456789abcdef" for c in new["save_id"])
    for doc in (new, old):
        doc["files"][0]["path"] = doc["files"][0]["path"].replace(doc.pop("save_id"), "<save_id>")
        assert doc.pop("created_by").startswith("reshard ")
    assert new == old
