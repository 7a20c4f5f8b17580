"""Golden-file tests of checkpoint format version 2 (``docs/format.md``, section 14: packed tensors).

``tests/data/golden_v2/`` is a tiny checkpoint that ``reshard.save`` wrote once (``tests/data/make_golden_v2.py``;
committed, never regenerated while the format version stays 2). As for version 1
(``tests/metadata/test_format_golden.py``, which keeps passing), the expected values are written out here, so that any
change of the packed encoding, on the reading or the writing side, fails a test:

- the wire form: which tensors are packed and how (grid cuts, split cells and starts, or listed boxes), and
  that every packed checksum is the CRC-32C of the bytes the packed offsets point at;
- reading: the fixture loads to the values it was saved from, on its own layout and on another;
- writing: saving the same state again gives the same document members (but for the save id and the version
  of the library; it is written as version 3, which adds the document's checksum) and the same data bytes.
"""

from __future__ import annotations

import base64
import itertools
import json
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import reshard
from tests.data.make_golden_v2 import CHECKSUM_CHUNK_BYTES, golden_state_dict

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_v2"
SAVE_ID = "fedcba9876543210fedcba9876543210"
DATA_FILE = f"data/{SAVE_ID}-r00000.bin"
ITEMSIZE = {"float32": 4, "bfloat16": 2, "int16": 2}


def _ints(text: str, dtype: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text, validate=True), dtype=dtype).tolist()


def _doc() -> dict[str, Any]:
    return json.loads((GOLDEN / "metadata.json").read_bytes())


def _boxes_in_order(doc: dict[str, Any], key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes of a packed tensor in the order of its packed fields, decoded by hand from the spec."""
    packed = doc["tensors"][key]["packed"]
    if "explicit" in packed:
        rows = np.array(_ints(packed["explicit"], "<u8")).reshape(packed["boxes"], 4)
        return [((int(r[0]), int(r[1])), (int(r[2]), int(r[3]))) for r in rows]
    cuts = packed["grid"]
    split = _ints(packed["split"], "<u8")
    counts = dict(zip(split[0::2], split[1::2], strict=True))
    starts = iter(_ints(packed["starts"], "<u8"))
    out = []
    cell = 0
    for i in range(len(cuts[0]) - 1):
        for j in range(len(cuts[1]) - 1):
            lo, shape = (cuts[0][i], cuts[1][j]), (cuts[0][i + 1] - cuts[0][i], cuts[1][j + 1] - cuts[1][j])
            bounds = [0, *(next(starts) for _ in range(counts.get(cell, 0))), shape[0] * shape[1]]
            for a, b in itertools.pairwise(bounds):
                # These golden cells split inside one row only: a run [a, b) of a row is that row's columns.
                row, col = divmod(a, shape[1])
                extent = (1, b - a) if b - a < shape[1] else ((b - a) // shape[1], shape[1])
                out.append(((lo[0] + row, lo[1] + col), extent))
            cell += 1
    return out


def test_v2_wire_form() -> None:
    doc = _doc()
    assert doc["version"] == 2
    assert list(doc) == [
        "format", "version", "save_id", "created_by", "world_size", "checksum", "files", "tensors", "objects", "common"
    ]  # fmt: skip
    assert doc["checksum"] == {"algorithm": "crc32c", "chunk_bytes": 16}
    assert doc["files"] == [{"path": DATA_FILE, "size": 7308}]
    assert doc["common"] == {"iteration": 5}
    assert doc["tensors"]["bias"] == {
        "dtype": "float32",
        "global_shape": [3],
        "boxes": [
            {"offset": [0], "shape": [3], "file": 0, "byte_offset": 7296, "byte_length": 12, "crc32c": [19239894]}
        ],
    }
    opt = doc["tensors"]["opt"]
    assert (opt["dtype"], opt["global_shape"]) == ("float32", [16, 4])
    assert list(opt["packed"]) == ["boxes", "grid", "split", "starts", "file", "byte_offset", "crc32c"]
    assert opt["packed"]["boxes"] == 42
    assert opt["packed"]["grid"] == [list(range(17)), [0, 2, 4]]
    assert _ints(opt["packed"]["split"], "<u8") == [2, 1, 3, 1, 8, 1, 9, 1, 14, 1, 15, 1, 20, 1, 21, 1, 26, 1, 27, 1]
    assert _ints(opt["packed"]["starts"], "<u8") == [1] * 10
    grid = doc["tensors"]["grid"]["packed"]
    assert (grid["boxes"], grid["grid"], grid["split"], grid["starts"]) == (
        32,
        [list(range(9)), list(range(5))],
        "",
        "",
    )
    pinwheel = doc["tensors"]["pinwheel"]["packed"]
    assert list(pinwheel) == ["boxes", "explicit", "file", "byte_offset", "crc32c"]
    arms = {((0, 0), (7, 1)), ((0, 1), (1, 7)), ((1, 7), (7, 1)), ((7, 0), (1, 7))}
    centre = {((i, j), (1, 1)) for i in range(1, 7) for j in range(1, 7)}
    assert set(_boxes_in_order(doc, "pinwheel")) == arms | centre
    # Cells in row-major order: row 0 of both column blocks whole, then row 1 of the first block split in two.
    assert _boxes_in_order(doc, "opt")[:4] == [((0, 0), (1, 2)), ((0, 2), (1, 2)), ((1, 0), (1, 1)), ((1, 1), (1, 1))]


def test_v2_packed_checksums_are_those_of_the_data() -> None:
    doc = _doc()
    data = (GOLDEN / DATA_FILE).read_bytes()
    for key in ("opt", "grid", "pinwheel"):
        packed = doc["tensors"][key]["packed"]
        itemsize = ITEMSIZE[doc["tensors"][key]["dtype"]]
        boxes = _boxes_in_order(doc, key)
        assert _ints(packed["file"], "<u4") == [0] * len(boxes)
        offsets = _ints(packed["byte_offset"], "<u8")
        crcs = _ints(packed["crc32c"], "<u4")
        at = 0
        for (_, shape), offset in zip(boxes, offsets, strict=True):
            assert offset % 64 == 0
            length = shape[0] * shape[1] * itemsize
            for start in range(0, length, CHECKSUM_CHUNK_BYTES):
                chunk = data[offset + start : offset + min(start + CHECKSUM_CHUNK_BYTES, length)]
                assert crc32c.crc32c(chunk) == crcs[at]
                at += 1
        assert at == len(crcs)


def test_v2_reads_and_loads_the_saved_values() -> None:
    metadata = reshard.read_metadata(GOLDEN)
    assert metadata.format_version == 2
    assert [len(metadata.tensors[k].boxes) for k in ("bias", "grid", "opt", "pinwheel")] == [1, 32, 42, 40]
    assert metadata.total_bytes == 12 + 32 * 2 + 64 * 4 + 64 * 2
    template = {
        "opt": torch.zeros(16, 4),
        "grid": torch.zeros(8, 4, dtype=torch.bfloat16),
        "pinwheel": torch.zeros(8, 8, dtype=torch.int16),
        "bias": torch.zeros(3),
        "iteration": 0,
    }
    out = reshard.load(template, GOLDEN)
    assert torch.equal(out["opt"], torch.arange(64, dtype=torch.float32).reshape(16, 4))
    assert torch.equal(out["grid"], torch.arange(32, dtype=torch.bfloat16).reshape(8, 4))
    assert torch.equal(out["pinwheel"], torch.arange(64, dtype=torch.int16).reshape(8, 8))
    assert out["bias"].tolist() == [0.5, -1.0, 2.0]
    assert out["iteration"] == 5
    rows = reshard.ShardedTensor.from_rank_offsets("opt", torch.zeros(8, 4), (0, 1, 2))
    assert torch.equal(
        reshard.load({"opt": rows}, GOLDEN)["opt"], torch.arange(32, 64, dtype=torch.float32).reshape(8, 4)
    )


def test_saving_the_same_state_writes_the_same_v2_members(tmp_path: Path) -> None:
    result = reshard.save(
        golden_state_dict(), tmp_path / "ckpt", options=reshard.SaveOptions(checksum_chunk_bytes=CHECKSUM_CHUNK_BYTES)
    )
    name = f"data/{result.save_id}-r00000.bin"
    assert (tmp_path / "ckpt" / name).read_bytes() == (GOLDEN / DATA_FILE).read_bytes()
    new = json.loads((tmp_path / "ckpt" / "metadata.json").read_bytes())
    old = _doc()
    assert (new.pop("version"), old.pop("version")) == (3, 2)  # version 3: version 2's members + the checksum
    assert new.pop("metadata_crc32c")
    for doc in (new, old):
        doc["files"][0]["path"] = doc["files"][0]["path"].replace(doc.pop("save_id"), "<save_id>")
        assert doc.pop("created_by").startswith("reshard ")
    assert new == old
