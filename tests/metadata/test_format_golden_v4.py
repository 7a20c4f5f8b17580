"""Golden-file tests of checkpoint format version 4 (``docs/format.md``, section 15: content hashes and
references to the data files of sibling checkpoints).

``tests/data/golden_v4/`` holds two checkpoints that ``reshard.save`` wrote once
(``tests/data/make_golden_v4.py``; committed, never regenerated while the format version stays 4): ``base``
(the version-2 fixture's state, with content hashes) and ``step`` (the same state with two boxes changed,
saved incrementally against ``base``). The expected values are computed here, without reshard:

- every box's ``hash`` is the XXH3-128 digest (``xxhash.xxh3_128_digest``, as 32 lowercase hex digits) of its
  bytes in the data file that holds it; a packed tensor's ``hash`` field is those 16-byte digests in box order;
- ``step`` lists its own file and ``base``'s file (``"checkpoint": "base"``); exactly the changed boxes lie in
  its own file, every other box is ``base``'s, at the same byte range and with the same checksums and hash;
- ``base`` holds the reference marker ``refs/step.<step's save id>.json`` naming the file ``step`` uses;
- both load, ``step`` with the changed values; a reader refuses a reference that could leave the parent
  directory, a hash of the wrong length or algorithm, and the version-4 members in a version-3 document;
- writing: saving the same two states with the same save ids gives the same documents, byte for byte (but for
  the ``created_by`` string and so the document's checksum).
"""

from __future__ import annotations

import base64
import json
import shutil
import uuid
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import xxhash

import reshard
from reshard.flows.maintenance import validate_checkpoint
from tests.data.make_golden_v2 import CHECKSUM_CHUNK_BYTES, golden_state_dict
from tests.data.make_golden_v4 import changed_state_dict
from tests.metadata_docs import dumps, unseal

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden_v4"
BASE_ID = "44444444444444440000000000000000"
STEP_ID = "4444444444444444dddddddddddddddd"
BASE_FILE = f"data/{BASE_ID}-r00000.bin"
STEP_FILE = f"data/{STEP_ID}-r00000.bin"


def _doc(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name / "metadata.json").read_bytes())


def _boxes(doc: dict[str, Any], key: str) -> list[dict[str, Any]]:
    """Every box of ``key`` as (file, byte_offset, hash) dicts, packed or not (geometry left out)."""
    tensor = doc["tensors"][key]
    if "boxes" in tensor:
        return [{k: b[k] for k in ("file", "byte_offset", "hash")} for b in tensor["boxes"]]
    packed = tensor["packed"]
    n = packed["boxes"]
    files = list(memoryview(base64.b64decode(packed["file"])).cast("I"))
    offsets = list(memoryview(base64.b64decode(packed["byte_offset"])).cast("Q"))
    hashes = base64.b64decode(packed["hash"])
    assert len(files) == len(offsets) == n and len(hashes) == 16 * n
    return [{"file": files[i], "byte_offset": offsets[i], "hash": hashes[16 * i : 16 * i + 16].hex()} for i in range(n)]


def _file_bytes(checkpoint: str, doc: dict[str, Any], file: int) -> bytes:
    entry = doc["files"][file]
    holder = entry.get("checkpoint", checkpoint)
    return (GOLDEN / holder / entry["path"]).read_bytes()


def test_every_box_hash_is_the_xxh3_128_of_its_bytes() -> None:
    """Every box's hash, as the document spells it (``_boxes``, without reshard), is the XXH3-128 of the bytes
    that reshard's reader locates for it (byte ranges of packed boxes follow from their geometry)."""
    for name in ("base", "step"):
        doc = _doc(name)
        assert doc["version"] == 4 and doc["content_hash"] == {"algorithm": "xxh3_128"}
        metadata = reshard.read_metadata(GOLDEN / name)
        checked = 0
        for key, tensor in metadata.tensors.items():
            spelled = {(b["file"], b["byte_offset"]): b["hash"] for b in _boxes(doc, key)}
            for box in tensor.boxes:
                data = _file_bytes(name, doc, box.file)[box.byte_offset : box.byte_offset + box.byte_length]
                assert spelled[box.file, box.byte_offset] == xxhash.xxh3_128_digest(data).hex(), (name, key)
                checked += 1
        assert checked == sum(len(_boxes(doc, key)) for key in doc["tensors"])


def test_the_step_references_base_for_every_unchanged_box() -> None:
    base, step = _doc("base"), _doc("step")
    assert base["files"] == [{"path": BASE_FILE, "size": 7308}]
    assert step["files"] == [{"path": STEP_FILE, "size": 76}, {"path": BASE_FILE, "size": 7308, "checkpoint": "base"}]
    own = {key: [i for i, b in enumerate(_boxes(step, key)) if b["file"] == 0] for key in step["tensors"]}
    assert own == {"bias": [0], "grid": [14], "opt": [], "pinwheel": []}  # grid cell (3, 2) is box 3 * 4 + 2
    for key in step["tensors"]:
        for i, (new, old) in enumerate(zip(_boxes(step, key), _boxes(base, key), strict=True)):
            if i in own[key]:
                assert new["hash"] != old["hash"]
            else:
                assert (new["file"], new["byte_offset"], new["hash"]) == (1, old["byte_offset"], old["hash"])
    marker = json.loads((GOLDEN / "base" / "refs" / f"step.{STEP_ID}.json").read_bytes())
    assert marker == {"checkpoint": "step", "save_id": STEP_ID, "files": [BASE_FILE]}


def _template() -> dict[str, Any]:
    return {
        "opt": torch.zeros(16, 4),
        "grid": torch.zeros(8, 4, dtype=torch.bfloat16),
        "bias": torch.zeros(3),
        "iteration": 0,
        "pinwheel": torch.zeros(8, 8, dtype=torch.int16),
    }


def test_both_checkpoints_load() -> None:
    grid = torch.arange(32, dtype=torch.bfloat16).reshape(8, 4)
    for name, bias, iteration in (("base", 0.5, 5), ("step", 1.5, 6)):
        loaded = reshard.load(_template(), GOLDEN / name, options=reshard.LoadOptions(verify=False))
        assert torch.equal(loaded["opt"], torch.arange(64, dtype=torch.float32).reshape(16, 4))
        assert torch.equal(loaded["pinwheel"], torch.arange(64, dtype=torch.int16).reshape(8, 8))
        expected = grid.clone()
        if name == "step":
            expected[3, 2] = 100
        assert torch.equal(loaded["grid"], expected)
        assert loaded["bias"].tolist() == [bias, -1.0, 2.0] and loaded["iteration"] == iteration
        metadata = reshard.read_metadata(GOLDEN / name)
        assert metadata.format_version == 4 and metadata.content_hashes
    assert reshard.read_metadata(GOLDEN / "step").referenced_checkpoints == ("base",)


def _rewrite(tmp_path: Path, edit: Any) -> Path:
    shutil.copytree(GOLDEN, tmp_path / "golden")
    path = tmp_path / "golden" / "step" / "metadata.json"
    doc = json.loads(path.read_bytes())
    edit(doc)
    path.write_bytes(dumps(doc, separators=(",", ":")))
    return tmp_path / "golden" / "step"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d["files"][1].update(checkpoint=".."), "checkpoint name"),
        (lambda d: d["files"][1].update(checkpoint="base/../../etc"), "checkpoint name"),
        (lambda d: d["files"][1].update(checkpoint="a/b"), "checkpoint name"),
        (lambda d: d["files"][1].update(checkpoint=""), "checkpoint name"),
        (lambda d: d["files"][1].update(checkpoint=7), "expected a string"),
        (lambda d: d["tensors"]["bias"]["boxes"][0].update(hash="00" * 15), "hex digits"),
        (lambda d: d["tensors"]["bias"]["boxes"][0].update(hash="AB" * 16), "hex digits"),
        (lambda d: d["tensors"]["bias"]["boxes"][0].pop("hash"), "missing \\['hash'\\]"),
        (lambda d: d.update(content_hash={"algorithm": "md5"}), "unsupported algorithm"),
        (lambda d: d.pop("content_hash"), "missing \\['content_hash'\\]"),
        (lambda d: d["tensors"]["opt"]["packed"].update(hash="AAAA"), "expected a 16-byte hash per box"),
        (lambda d: d.update(version=3), "unexpected \\['content_hash'\\]"),
    ],
    ids=[
        "dotdot",
        "escape",
        "slash",
        "empty",
        "not_a_string",
        "short_hash",
        "upper_hash",
        "no_hash",
        "algorithm",
        "no_member",
        "packed_hash",
        "version_3",
    ],
)
def test_a_hostile_version_4_document_is_refused(tmp_path: Path, edit: Any, match: str) -> None:
    with pytest.raises(reshard.CorruptCheckpointError, match=match):
        reshard.read_metadata(_rewrite(tmp_path, edit))


def test_a_version_3_document_with_a_reference_is_refused(tmp_path: Path) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["version"] = 3
        doc.pop("content_hash")
        for box in doc["tensors"]["bias"]["boxes"]:
            box.pop("hash")
        for key in ("grid", "opt", "pinwheel"):
            doc["tensors"][key]["packed"].pop("hash")

    with pytest.raises(reshard.CorruptCheckpointError, match="unexpected \\['checkpoint'\\]"):
        reshard.read_metadata(_rewrite(tmp_path, edit))


def test_a_missing_referenced_checkpoint_names_both(tmp_path: Path) -> None:
    shutil.copytree(GOLDEN, tmp_path / "golden")
    shutil.rmtree(tmp_path / "golden" / "base")
    with pytest.raises(reshard.CorruptCheckpointError, match=r"of checkpoint base, which .*step references"):
        reshard.load(_template(), tmp_path / "golden" / "step")
    problems = validate_checkpoint(tmp_path / "golden" / "step", quick=True)
    assert len(problems) == 1 and "data file data/" in problems[0] and "of checkpoint base" in problems[0]
    assert "golden/step references" in problems[0] and problems[0].endswith("is missing")


def test_saving_the_same_states_writes_the_same_documents(tmp_path: Path) -> None:
    options = reshard.SaveOptions(checksum_chunk_bytes=CHECKSUM_CHUNK_BYTES, content_hash=True)
    with mock.patch("uuid.uuid4", return_value=uuid.UUID(BASE_ID)):
        reshard.save(golden_state_dict(), tmp_path / "base", options=options)
    with mock.patch("uuid.uuid4", return_value=uuid.UUID(STEP_ID)):
        reshard.save(changed_state_dict(), tmp_path / "step", options=options, base=tmp_path / "base")
    version = reshard.__version__.encode()
    for name in ("base", "step"):
        new, old = (tmp_path / name / "metadata.json").read_bytes(), (GOLDEN / name / "metadata.json").read_bytes()
        assert unseal(new).replace(b'"created_by":"reshard ' + version + b'"', b"<by>") == unseal(old).replace(
            b'"created_by":"reshard 0.1.0"', b"<by>"
        )
    for name, file in (("base", BASE_FILE), ("step", STEP_FILE)):
        assert (tmp_path / name / file).read_bytes() == (GOLDEN / name / file).read_bytes()
    assert (tmp_path / "base" / "refs" / f"step.{STEP_ID}.json").read_bytes() == (
        GOLDEN / "base" / "refs" / f"step.{STEP_ID}.json"
    ).read_bytes()


def test_the_files_example_of_format_md_is_the_fixture() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "format.md").read_text(encoding="utf-8")
    section = text[text.index("## 15. Version 4") :]
    block = section[section.index("```json\n") + len("```json\n") :]
    block = block[: block.index("```")]
    assert json.loads("{" + block + "}")["files"] == _doc("step")["files"]
