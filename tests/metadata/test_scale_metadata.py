"""Metadata format version 2 (packed tensors) and load planning at scale.

- On a simulated 512-rank save (:mod:`reshard.testing`), the coordinator's metadata has exactly the content
  of the straightforward assembly (``tests/oracle_planning.py``), packed or not, lazily decoded or not, and
  the load plans of another layout are exactly the oracle's.
- Packed metadata round-trips, and a hostile packed entry (wrong sizes, overlaps, gaps, out-of-range
  numbers, bad base64...) is refused with CorruptCheckpointError naming the field, like the rest.
- Real saves pack what they should and load back into another layout.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard
from reshard.errors import CorruptCheckpointError
from reshard.metadata import (
    FORMAT_VERSION,
    PACK_MIN_BOXES,
    DataFile,
    Metadata,
    SavedBox,
    SavedBoxes,
    TensorMetadata,
)
from reshard.planning.assemble import WriteReport, assemble_metadata
from reshard.planning.descriptions import DescriptionTable, encode_description
from reshard.planning.load_plan import plan_load
from reshard.planning.save_plan import plan_save_table
from reshard.testing import MegatronLayout, Parallelism
from reshard.testing.simulate import write_report
from tests import oracle_planning as oracle
from tests.metadata_docs import dumps
from tests.planning.test_scale_planning import LAYOUT_512, MODEL_512

pytestmark = pytest.mark.dist  # in-process, but seconds: kept out of make test-fast

CHUNK = 4096
SAVE_ID = "5" * 32


@pytest.fixture(scope="module")
def simulated() -> tuple[Metadata, Metadata]:
    """The metadata of a simulated 512-rank save: (reshard's, the oracle's)."""
    layout = MegatronLayout(MODEL_512, LAYOUT_512)
    descriptions = [layout.rank_description(r) for r in range(LAYOUT_512.world)]
    table, _ = DescriptionTable.from_wire([encode_description(d) for d in descriptions])
    assignments = plan_save_table(table)
    reports = [  # as they travel: JSON
        json.loads(json.dumps(write_report(table, r, a, SAVE_ID, CHUNK, fingerprints=True).to_json()))
        for r, a in enumerate(assignments)
    ]
    mine = assemble_metadata(
        table,
        [WriteReport.from_json(r) for r in reports],
        save_id=SAVE_ID,
        world_size=LAYOUT_512.world,
        chunk_bytes=CHUNK,
        common={"iteration": 7},
    )
    legacy = [
        {
            "file": r["file"],
            "size": r["size"],
            "tensors": _legacy_tensors(r["tensors"], CHUNK),
            "objects": r["objects"],
        }
        for r in reports
    ]
    theirs = oracle.build_metadata(
        descriptions,
        legacy,
        SAVE_ID,
        LAYOUT_512.world,
        CHUNK,
        created_by=mine.created_by,
        common={"iteration": 7},
    )
    return mine, theirs


def _legacy_tensors(report: dict[str, Any], chunk: int) -> list[list[Any]]:
    crcs = np.frombuffer(base64.b64decode(report["crc32c"]), dtype="<u4").tolist()
    out = []
    at = 0
    prints = report["fingerprint"] or [None] * len(report["index"])
    for index, offset, length, print_ in zip(
        report["index"], report["byte_offset"], report["byte_length"], prints, strict=True
    ):
        count = -(-length // chunk)
        out.append([index, offset, length, crcs[at : at + count], print_])
        at += count
    return out


def test_metadata_matches_the_oracle_on_512_ranks(simulated: tuple[Metadata, Metadata]) -> None:
    mine, theirs = simulated
    assert mine == theirs
    assert {**mine.to_json_dict(packed=False), "version": 1} == oracle.metadata_json_v1(theirs)
    assert sum(len(t.boxes) for t in mine.tensors.values()) > 10_000
    raw = mine.to_json_bytes()
    doc = json.loads(raw)
    assert doc["version"] == FORMAT_VERSION == 3
    packed = [k for k, t in doc["tensors"].items() if "packed" in t]
    assert packed and any("grid" in doc["tensors"][k]["packed"] for k in packed)
    assert any(doc["tensors"][k]["packed"]["split"] for k in packed)  # ZeRO ranges: split cells
    assert any("boxes" in t for t in doc["tensors"].values())  # few boxes: written out in full
    assert len(raw) < len(json.dumps(oracle.metadata_json_v1(theirs), separators=(",", ":"))) / 1.5
    for lazy in (False, True):
        again = Metadata.from_json_bytes(raw, lazy=lazy)
        assert again == theirs
        assert again.format_version == 3
    everything = Metadata.from_json_bytes(mine.to_json_bytes(packed=True))
    assert everything == theirs
    assert Metadata.from_json_bytes(mine.to_json_bytes(packed=False)).format_version == 3


def test_load_plans_match_the_oracle_on_512_ranks(simulated: tuple[Metadata, Metadata]) -> None:
    """Another layout (TP 4, PP 8, ETP 2, other ZeRO ranges) plans the same reads through the index as by
    comparing every target with every saved box."""
    mine, theirs = simulated
    parsed = Metadata.from_json_bytes(mine.to_json_bytes(), lazy=True)
    target = MegatronLayout(MODEL_512, Parallelism(tp=4, pp=8, dp=16, ep=8, etp=2, bucket_elements=3000))
    for rank in range(0, 512, 23):
        targets = target.rank_targets(rank)
        expected = oracle.plan_load(theirs, targets, max_read_bytes=1 << 14)
        assert expected.items
        assert plan_load(parsed, targets, max_read_bytes=1 << 14) == expected
        assert plan_load(mine, targets, max_read_bytes=1 << 14) == expected


# --------------------------------------------------------------------------------------------------
# Packed entries, valid and hostile


def _small_metadata() -> Metadata:
    """Three tensors in a 600-byte file: a grid with flat-split cells, a pinwheel (no full cut: packed
    boxes), and a scalar."""
    files = (DataFile(path="data/x-r00000.bin", size=4096),)
    position = 0

    def boxes(geometry: list[tuple[tuple[int, ...], tuple[int, ...]]], itemsize: int) -> tuple[SavedBox, ...]:
        nonlocal position
        out = []
        for offset, shape in geometry:
            length = int(np.prod(shape)) * itemsize
            out.append(
                SavedBox(
                    offset=offset,
                    shape=shape,
                    file=0,
                    byte_offset=position,
                    byte_length=length,
                    checksums=tuple(range(position, position + -(-length // 16))),
                )
            )
            position += length
        return tuple(sorted(out, key=lambda b: b.offset))

    zero = [((0, 0), (2, 3)), ((2, 0), (1, 2)), ((2, 2), (1, 1)), ((3, 0), (1, 3)), ((0, 3), (4, 2))]
    pinwheel = [((0, 0), (3, 1)), ((0, 1), (1, 3)), ((1, 3), (3, 1)), ((3, 0), (1, 3)), ((1, 1), (2, 2))]
    return Metadata(
        save_id="0" * 32,
        created_by="test",
        world_size=1,
        checksum_chunk_bytes=16,
        files=files,
        tensors={
            "zero": TensorMetadata(key="zero", dtype="float32", global_shape=(4, 5), boxes=boxes(zero, 4)),
            "pinwheel": TensorMetadata(key="pinwheel", dtype="int8", global_shape=(4, 4), boxes=boxes(pinwheel, 1)),
            "scalar": TensorMetadata(key="scalar", dtype="float64", global_shape=(), boxes=boxes([((), ())], 8)),
        },
    )


@pytest.fixture(scope="module")
def packed_doc() -> dict[str, Any]:
    doc = _small_metadata().to_json_dict(packed=True)
    assert doc["version"] == 3
    assert set(doc["tensors"]["zero"]["packed"]) == {
        "boxes",
        "grid",
        "split",
        "starts",
        "file",
        "byte_offset",
        "crc32c",
    }
    assert "explicit" in doc["tensors"]["pinwheel"]["packed"]
    return doc


def test_packed_metadata_round_trips(packed_doc: dict[str, Any]) -> None:
    metadata = _small_metadata()
    raw = dumps(packed_doc)
    for lazy in (False, True):
        parsed = Metadata.from_json_bytes(raw, lazy=lazy)
        assert parsed == metadata
        assert all(isinstance(t.boxes, SavedBoxes) for t in parsed.tensors.values())
        assert parsed.total_bytes == metadata.total_bytes == (20 * 4 + 16 + 8)
    zero = packed_doc["tensors"]["zero"]["packed"]
    # Column 3 is a full cut (no box crosses it); the left cell holds 4 boxes, contiguous along its rows.
    assert zero["grid"] == [[0, 4], [0, 3, 5]]
    assert np.frombuffer(base64.b64decode(zero["split"]), dtype="<u8").tolist() == [0, 3]
    assert np.frombuffer(base64.b64decode(zero["starts"]), dtype="<u8").tolist() == [6, 8, 9]
    boxes = Metadata.from_json_bytes(raw).tensors["zero"].boxes
    assert [b.offset for b in boxes] == [(0, 0), (0, 3), (2, 0), (2, 2), (3, 0)]
    assert (
        boxes[1] == metadata.tensors["zero"].boxes[1]
        and boxes[-1].checksums == metadata.tensors["zero"].boxes[-1].checksums
    )
    assert boxes[1:3] == tuple(metadata.tensors["zero"].boxes[1:3])
    with pytest.raises(IndexError):
        boxes[5]


def _b64(values: list[int], dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def _field(name: str, value: Any, key: str = "zero") -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        doc["tensors"][key]["packed"][name] = value

    return mutate


def _ints(name: str, dtype: str, change: Any, key: str = "zero") -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        packed = doc["tensors"][key]["packed"]
        values = np.frombuffer(base64.b64decode(packed[name]), dtype=dtype).tolist()
        packed[name] = _b64(change(values), dtype)

    return mutate


def _doc(change: Any) -> Any:
    def mutate(doc: dict[str, Any]) -> None:
        change(doc)

    return mutate


HOSTILE: dict[str, tuple[Any, str]] = {
    "count_low": (_field("boxes", 4), "packed.file"),
    "count_high": (_field("boxes", 6), "packed.file"),
    "count_negative": (_field("boxes", -1), "packed.boxes"),
    "count_huge": (_field("boxes", 2**62), "packed.file"),
    "count_string": (_field("boxes", "5"), "packed.boxes"),
    "grid_axes": (_field("grid", [[0, 4]]), "packed.grid"),
    "grid_not_list": (_field("grid", "0,4"), "packed.grid"),
    "grid_start": (_field("grid", [[1, 4], [0, 3, 5]]), "packed.grid"),
    "grid_end": (_field("grid", [[0, 5], [0, 3, 5]]), "packed.grid"),
    "grid_repeat": (_field("grid", [[0, 4], [0, 5, 5]]), "packed.grid"),
    "grid_empty_axis": (_field("grid", [[], [0, 3, 5]]), "packed.grid"),
    "grid_negative": (_field("grid", [[0, -2, 4], [0, 5]]), "packed.grid[0][1]"),
    "grid_float": (_field("grid", [[0, 2.0, 4], [0, 5]]), "packed.grid[0][1]"),
    "grid_more_cells": (_field("grid", [[0, 1, 2, 3, 4], [0, 3, 5]]), "packed.boxes"),
    "grid_other_cuts": (_field("grid", [[0, 4], [0, 2, 5]]), "packed.grid"),
    "split_odd": (_ints("split", "<u8", lambda v: v[:-1]), "packed.split"),
    "split_cell_range": (_ints("split", "<u8", lambda v: [99, *v[1:]]), "packed.grid"),
    "split_count_zero": (_ints("split", "<u8", lambda v: [v[0], 0]), "packed.boxes"),
    "split_count_huge": (_ints("split", "<u8", lambda v: [v[0], 2**62]), "packed.boxes"),
    "split_int_too_big": (_ints("split", "<u8", lambda v: [v[0], 2**63]), "packed.split"),
    "starts_past_cell": (_ints("starts", "<u8", lambda v: [v[0], v[1], 12]), "packed.grid"),
    "starts_zero": (_ints("starts", "<u8", lambda v: [0, v[1], v[2]]), "packed.grid"),
    "starts_decreasing": (_ints("starts", "<u8", lambda v: [v[1], v[0], v[2]]), "packed.grid"),
    "starts_not_contiguous": (_ints("starts", "<u8", lambda v: [1, v[1], v[2]]), "packed.grid"),
    "starts_count": (_ints("starts", "<u8", lambda v: v[:2]), "packed.grid"),
    "starts_missing": (_field("starts", ""), "packed.grid"),
    "file_length": (_ints("file", "<u4", lambda v: v[:-1]), "packed.file"),
    "file_range": (_ints("file", "<u4", lambda v: [1, *v[1:]]), "packed.file"),
    "file_base64": (_field("file", "@@@@"), "packed.file"),
    "file_padding": (_field("file", "AAAAAA"), "packed.file"),
    "file_not_string": (_field("file", [0, 0, 0, 0, 0]), "packed.file"),
    "offset_past_end": (_ints("byte_offset", "<u8", lambda v: [4090, *v[1:]]), "packed.byte_offset"),
    "offset_huge": (_ints("byte_offset", "<u8", lambda v: [2**63 + 5, *v[1:]]), "packed.byte_offset"),
    "offset_overflow": (_ints("byte_offset", "<u8", lambda v: [2**62, *v[1:]]), "packed.byte_offset"),
    "crc_extra": (_ints("crc32c", "<u4", lambda v: [*v, 1]), "packed.crc32c"),
    "crc_missing": (_ints("crc32c", "<u4", lambda v: v[:-1]), "packed.crc32c"),
    "crc_odd_bytes": (_field("crc32c", base64.b64encode(b"abc").decode()), "packed.crc32c"),
    "explicit_overlap": (
        _ints("explicit", "<u8", lambda v: [0, 0, 3, 1, *v[4:8], 0, 0, 3, 1, *v[12:]], "pinwheel"),
        "packed.explicit",
    ),
    "explicit_gap": (_ints("explicit", "<u8", lambda v: [*v[:-2], 1, 1], "pinwheel"), "packed.explicit"),
    "explicit_outside": (_ints("explicit", "<u8", lambda v: [*v[:-4], 3, 3, 2, 2], "pinwheel"), "packed.explicit"),
    "explicit_empty": (_ints("explicit", "<u8", lambda v: [*v[:-2], 0, 2], "pinwheel"), "packed.explicit"),
    "explicit_length": (_ints("explicit", "<u8", lambda v: v[:-1], "pinwheel"), "packed.explicit"),
    "explicit_and_grid": (_field("grid", [[0, 4], [0, 4]], "pinwheel"), "packed"),
    "packed_and_boxes": (_doc(lambda d: d["tensors"]["zero"].update(boxes=[])), "tensors['zero']"),
    "packed_missing_field": (_doc(lambda d: d["tensors"]["zero"]["packed"].pop("crc32c")), "packed"),
    "packed_not_object": (_doc(lambda d: d["tensors"]["zero"].update(packed=[])), "packed"),
    "packed_in_version_1": (_doc(lambda d: d.update(version=1)), "tensors['zero']"),
    "huge_tensor": (_doc(lambda d: d["tensors"]["scalar"].update(global_shape=[2**31, 2**31, 2])), "global_shape"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_packed_metadata_is_corrupt(packed_doc: dict[str, Any], name: str) -> None:
    mutation, fragment = HOSTILE[name]
    doc = copy.deepcopy(packed_doc)
    mutation(doc)
    raw = dumps(doc)
    with pytest.raises(CorruptCheckpointError) as info:
        Metadata.from_json_bytes(raw)
    assert fragment in str(info.value), str(info.value)
    # A lazy parse refuses the same document when the bad tensor's boxes are first used, if not before.
    with pytest.raises(CorruptCheckpointError):
        _use_every_box(Metadata.from_json_bytes, raw)


def _use_every_box(parse: Any, raw: bytes) -> None:
    for tensor in parse(raw, lazy=True).tensors.values():
        list(tensor.boxes)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzzed_packed_fields_are_valid_or_corrupt(packed_doc: dict[str, Any], data: st.DataObject) -> None:
    """Any bytes in a packed field either decode to a valid tiling or are refused as corrupt."""
    doc = copy.deepcopy(packed_doc)
    key = data.draw(st.sampled_from(["zero", "pinwheel", "scalar"]))
    packed = doc["tensors"][key]["packed"]
    name = data.draw(st.sampled_from(sorted(set(packed) - {"boxes", "grid"})))
    raw = bytearray(base64.b64decode(packed[name]))
    for _ in range(data.draw(st.integers(1, 4))):
        if raw and data.draw(st.booleans()):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        else:
            raw += bytes(data.draw(st.binary(max_size=8)))
    packed[name] = base64.b64encode(bytes(raw)).decode()
    try:
        parsed = Metadata.from_json_bytes(dumps(doc))
    except CorruptCheckpointError:
        return
    boxes = parsed.tensors[key].boxes
    covered = sum(int(np.prod(b.shape)) for b in boxes)
    assert covered == int(np.prod(parsed.tensors[key].global_shape))


# --------------------------------------------------------------------------------------------------
# Real saves


def test_a_save_packs_tensors_with_many_boxes_and_loads_them_into_another_layout(tmp_path: Path) -> None:
    """One process holding many ZeRO-like flat ranges of a tensor (a packed, split grid) and a few boxes of
    another (written out in full); loaded back into column blocks."""
    full = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6)
    leaves: dict[str, Any] = {}
    cuts = [*range(0, 240, 7), 240]
    for i, (a, b) in enumerate(itertools.pairwise(cuts)):
        flat = full.reshape(-1)[a:b].clone()
        leaves[f"z{i}"] = reshard.ShardedTensor.from_flat_range("opt", flat, (40, 6), (40, 6), (0, 0), a, b)
    leaves["small"] = reshard.ShardedTensor("small", full[:4].clone(), (4, 6), (0, 0))
    result = reshard.save(leaves, tmp_path / "ckpt", options=reshard.SaveOptions(checksum_chunk_bytes=64))
    assert result.metadata is not None and result.world_size == 1 and result.num_files == 1
    assert result.total_bytes == (240 + 24) * 4
    doc = json.loads((tmp_path / "ckpt" / "metadata.json").read_bytes())
    assert doc["version"] == 3
    assert "packed" in doc["tensors"]["opt"] and "boxes" in doc["tensors"]["small"]
    assert len(result.metadata.tensors["opt"].boxes) >= PACK_MIN_BOXES
    assert reshard.read_metadata(tmp_path / "ckpt") == result.metadata
    template = {
        "opt": reshard.ShardedTensor.from_rank_offsets("opt", torch.zeros(40, 3), (1, 1, 2)),
        "small": torch.zeros(4, 6),
    }
    stats = reshard.LoadStats()
    out = reshard.load(template, tmp_path / "ckpt", stats=stats)
    assert torch.equal(out["opt"], full[:, 3:])
    assert torch.equal(out["small"], full[:4])
    assert stats.bytes_needed == (120 + 24) * 4


def test_length_prefix_of_a_packed_field_cannot_smuggle_data(packed_doc: dict[str, Any]) -> None:
    """Base64 must be canonical enough: whitespace, URL-safe letters or a missing padding are refused."""
    for bad in (" " + packed_doc["tensors"]["zero"]["packed"]["file"], "-_-_", "AAA"):
        doc = copy.deepcopy(packed_doc)
        doc["tensors"]["zero"]["packed"]["file"] = bad
        with pytest.raises(CorruptCheckpointError, match=r"packed\.file"):
            Metadata.from_json_bytes(dumps(doc))
    assert struct.calcsize("<Q") == 8
