"""Partitioned metadata (format version 6): the writer's choice, round trips on one process and on ranks as
threads (resharding), a rank reading only the parts its keys need, and damage to the parts or to the index,
refused with the same CorruptCheckpointError on every rank before any tensor byte is read; the tools that read
or delete a whole checkpoint (validate, inspect, convert, export, gc, deletion) on a partitioned one."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.cli import main
from reshard.flows.maintenance import collect_garbage, validate_checkpoint
from reshard.io.retirement import delete_checkpoint
from reshard.io.sources import read_full_metadata
from reshard.metadata import METADATA_CHECKSUM_MEMBER, PARTITIONED_VERSION, Metadata, seal_document
from reshard.metadata.partition import metadata_documents
from reshard.metadata.parts import part_of
from reshard.net.transports import ThreadGroup
from reshard.storage import LocalStorage, storage_for
from tests.layouts import check_loaded, load_layout, save_layout
from tests.threads import on_threads, outcomes_on_threads

pytestmark = pytest.mark.unit

PARTS = reshard.SaveOptions(metadata_parts=True)


def state() -> dict[str, Any]:
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    return {
        "top": reshard.ShardedTensor("w", full[:3].clone(), (6, 8), (0, 0)),
        "bottom": reshard.ShardedTensor("w", full[3:].clone(), (6, 8), (3, 0)),
        "b": torch.linspace(0, 1, 5, dtype=torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int32),
        "rng": reshard.ShardedObject("rng", {"seed": 5}, (1,), (0,)),
        "step": 3,
    }


def template() -> dict[str, Any]:
    return {
        "w": torch.zeros(6, 8),
        "b": torch.zeros(5, dtype=torch.bfloat16),
        "ids": torch.zeros(7, dtype=torch.int32),
        "rng": reshard.ShardedObject("rng", None, (1,), (0,)),
        "step": 0,
    }


def doc(path: Path) -> dict[str, Any]:
    return json.loads((path / "metadata.json").read_bytes())


def write_sealed(path: Path, document: dict[str, Any]) -> None:
    """``metadata.json`` edited and sealed again: damage the seal does not catch (what a hostile writer makes)."""
    document.pop(METADATA_CHECKSUM_MEMBER, None)
    (path / "metadata.json").write_bytes(seal_document(json.dumps(document, separators=(",", ":")).encode()))


def repartition(path: Path, part_bytes: int = 1) -> Metadata:
    """The checkpoint at ``path`` rewritten with its metadata partitioned in parts of ``part_bytes`` (one tensor
    per part with 1), as a save that writes small parts would."""
    metadata = read_full_metadata(storage_for(path))
    for old in metadata.parts:
        (path / old.path).unlink()
    written = metadata_documents(metadata, parts=True, part_bytes=part_bytes)
    for name, raw in written.parts:
        (path / name).write_bytes(raw)
    (path / "metadata.json").write_bytes(written.document)
    return written.metadata


def test_a_small_checkpoint_keeps_the_document_it_had_byte_for_byte(tmp_path: Path) -> None:
    reshard.save(state(), tmp_path / "c")
    raw = (tmp_path / "c" / "metadata.json").read_bytes()
    metadata = Metadata.from_json_bytes(raw)
    assert doc(tmp_path / "c")["version"] == 3 and not metadata.parts
    written = metadata_documents(metadata)
    assert written.document == raw == metadata.to_json_bytes() and written.parts == ()
    assert metadata_documents(metadata, parts=False).document == raw


def test_a_forced_partitioned_save_round_trips_and_names_its_parts(tmp_path: Path) -> None:
    path = tmp_path / "c"
    reshard.save(state(), path, options=PARTS)
    document = doc(path)
    assert document["version"] == PARTITIONED_VERSION
    assert set(document["tensors"]["w"]) == {"dtype", "global_shape", "part"}
    (part,) = document["parts"]
    raw = (path / part["path"]).read_bytes()
    assert part["size"] == len(raw) and part["sha256"] == hashlib.sha256(raw).hexdigest()
    assert part["path"] == f"data/{document['save_id']}-metadata-00000.json"
    loaded = reshard.load(template(), path)
    assert torch.equal(loaded["w"], torch.arange(48, dtype=torch.float32).reshape(6, 8))
    assert torch.equal(loaded["ids"], torch.arange(7, dtype=torch.int32)) and loaded["rng"] == {"seed": 5}
    whole = reshard.read_metadata(path)
    assert whole.tensors == Metadata.from_json_bytes(metadata_documents(whole).document).tensors
    assert validate_checkpoint(path) == []


def test_save_options_refuse_a_value_they_cannot_honour(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="metadata_parts"):
        reshard.SaveOptions(metadata_parts="yes")  # type: ignore[arg-type]
    with pytest.raises(reshard.CheckpointError, match="metadata_parts"):
        reshard.save({"step": 1}, tmp_path / "c", options=PARTS)  # no tensor: nothing to partition
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_ranks_as_threads_save_partitioned_and_reshard_on_load(tmp_path: Path) -> None:
    path = tmp_path / "c"
    group = ThreadGroup(2, timeout=20)
    on_threads(2, lambda r: reshard.save(save_layout(r, 2), path, group=group.member(r), options=PARTS), group=group)
    repartition(path)  # one part per tensor
    assert len(doc(path)["parts"]) > 3
    loads = ThreadGroup(3, timeout=20)
    templates = [load_layout(r, 3, 2) for r in range(3)]
    results = on_threads(3, lambda r: reshard.load(templates[r], path, group=loads.member(r)), group=loads)
    for r in range(3):
        check_loaded(results[r], templates[r], r, 2)


def test_a_read_once_load_reads_the_parts_inside_its_planning_step(tmp_path: Path) -> None:
    """With a read-once schedule the coordinator plans who reads what from the templates alone; each rank reads its
    parts in the step, so a missing part fails every rank alike, and a whole checkpoint loads exactly."""
    path = tmp_path / "c"
    reshard.save(state(), path, options=PARTS)
    repartition(path)
    once = reshard.LoadOptions(read_once=True)
    group = ThreadGroup(2, timeout=20)
    results = on_threads(2, lambda r: reshard.load(template(), path, group=group.member(r), options=once), group=group)
    assert all(torch.equal(r["w"], torch.arange(48, dtype=torch.float32).reshape(6, 8)) for r in results)
    (path / doc(path)["parts"][-1]["path"]).unlink()
    group = ThreadGroup(2, timeout=20)
    outcomes = outcomes_on_threads(2, lambda r: reshard.load(template(), path, group=group.member(r), options=once))
    assert all(isinstance(o, reshard.CorruptCheckpointError) for o in outcomes), outcomes
    assert str(outcomes[0]) == str(outcomes[1])


def test_a_rank_reads_only_the_parts_its_keys_need(tmp_path: Path) -> None:
    path = tmp_path / "c"
    reshard.save(state(), path, options=PARTS)
    repartition(path)
    index = Metadata.from_json_bytes((path / "metadata.json").read_bytes())
    needed = part_of(index, "ids")
    assert needed is not None and len(index.parts) == 3
    for number, part in enumerate(index.parts):
        if number != needed:
            (path / part.path).unlink()
    loaded = reshard.load({"ids": torch.zeros(7, dtype=torch.int32)}, path)
    assert torch.equal(loaded["ids"], torch.arange(7, dtype=torch.int32))
    with pytest.raises(reshard.CorruptCheckpointError, match="missing"):
        reshard.read_metadata(path)


def _other_save(tmp_path: Path) -> Path:
    other = tmp_path / "other"
    reshard.save(state(), other, options=PARTS)
    return other


def _damage(path: Path, how: str, tmp_path: Path) -> None:
    document = doc(path)
    part = path / document["parts"][0]["path"]
    if how == "deleted":
        part.unlink()
    elif how == "truncated":
        part.write_bytes(part.read_bytes()[:-7])
    elif how == "flipped":
        raw = bytearray(part.read_bytes())
        raw[len(raw) // 2] ^= 0x04
        part.write_bytes(bytes(raw))
    elif how == "swapped":  # the part of another save under this save's name
        other = _other_save(tmp_path)
        shutil.copyfile(other / doc(other)["parts"][0]["path"], part)
    elif how in ("parent", "absolute", "other_save_name"):
        name = {"parent": "../x", "absolute": str(tmp_path / "x"), "other_save_name": None}[how]
        if name is None:
            other = _other_save(tmp_path)
            name = doc(other)["parts"][0]["path"]
            shutil.copyfile(other / name, path / name)
        (tmp_path / "x").write_bytes(part.read_bytes())
        document["parts"][0]["path"] = name
        write_sealed(path, document)
    elif how == "size_lies":
        document["parts"][0]["size"] += 1
        write_sealed(path, document)
    elif how == "hash_lies":
        document["parts"][0]["sha256"] = "0" * 64
        write_sealed(path, document)
    elif how == "huge":  # a sparse part of 1 GiB that the index says it is: over the limit, refused unread
        with part.open("r+b") as f:
            f.truncate(1 << 30)
        document["parts"][0]["size"] = 1 << 30
        write_sealed(path, document)
    elif how == "unicode_digits":  # the part's number in Arabic-Indic digits, which int() and \\d accept
        name = document["parts"][0]["path"].replace("00000", "\u0660" * 5)
        part.rename(path / name)
        document["parts"][0]["path"] = name
        write_sealed(path, document)
    elif how == "hostile_entry":  # a part whose index matches it, but whose boxes leave their tensor
        entries = json.loads(part.read_bytes())
        key = next(iter(entries["tensors"]))
        entries["tensors"][key] = {"boxes": [{"offset": [9], "shape": [1], "file": 0, "byte_offset": 0}]}
        raw = json.dumps(entries).encode()
        part.write_bytes(raw)
        document["parts"][0].update(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        write_sealed(path, document)
    else:
        raise AssertionError(how)


DAMAGES = [
    "deleted",
    "truncated",
    "flipped",
    "swapped",
    "parent",
    "absolute",
    "other_save_name",
    "size_lies",
    "hash_lies",
    "hostile_entry",
    "huge",
    "unicode_digits",
]


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_part_is_the_same_corruption_on_every_rank_before_any_tensor_byte(tmp_path: Path, how: str) -> None:
    path = tmp_path / "c"
    reshard.save(state(), path, options=PARTS)
    _damage(path, how, tmp_path)
    storage = LocalStorage(path)
    group = ThreadGroup(2, timeout=20)
    templates = [template(), template()]
    outcomes = outcomes_on_threads(2, lambda r: reshard.load(templates[r], storage, group=group.member(r)))
    assert all(isinstance(o, reshard.CorruptCheckpointError) for o in outcomes), outcomes
    assert str(outcomes[0]) == str(outcomes[1])
    assert str(path) in str(outcomes[0])  # the error names the checkpoint, not only a relative path
    assert storage.range_bytes_read == 0
    assert all(not t["w"].any() and not t["ids"].any() for t in templates)
    with pytest.raises(reshard.CorruptCheckpointError):
        reshard.read_metadata(path)
    assert validate_checkpoint(path)  # a problem, not a crash


def test_gc_keeps_the_committed_parts_and_removes_the_parts_of_other_saves(tmp_path: Path) -> None:
    path = tmp_path / "c"
    reshard.save(state(), path, options=PARTS)
    other = _other_save(tmp_path)
    orphan = doc(other)["parts"][0]["path"]
    shutil.copyfile(other / orphan, path / orphan)  # a save that died after its parts, before its commit
    assert collect_garbage(path, min_age_s=0) == [orphan]
    assert reshard.load(template(), path)["step"] == 3
    assert validate_checkpoint(path) == []


def test_an_overwrite_and_a_deletion_remove_the_parts(tmp_path: Path) -> None:
    path = tmp_path / "c"
    reshard.save(state(), path, options=PARTS)
    first = doc(path)["parts"][0]["path"]
    reshard.save(state(), path, options=PARTS, overwrite=True)
    assert not (path / first).exists() and (path / doc(path)["parts"][0]["path"]).exists()
    reshard.save(state(), path, overwrite=True)  # back to one document: the parts go
    assert not list((path / "data").glob("*-metadata-*"))
    reshard.save(state(), tmp_path / "d", options=PARTS)
    delete_checkpoint(storage_for(tmp_path / "d"))
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").rglob("*"))


def test_the_offline_tools_read_a_partitioned_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c"
    reshard.save(state(), path, options=PARTS)
    assert main(["inspect", str(path)]) == 0
    assert "format reshard v6" in capsys.readouterr().out
    assert main(["validate", str(path)]) == 0
    assert main(["convert", str(path), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    converted = reshard.load({"w": torch.zeros(6, 8, dtype=torch.bfloat16)}, tmp_path / "bf16", strict=False)
    assert torch.equal(converted["w"], torch.arange(48, dtype=torch.bfloat16).reshape(6, 8))
    assert main(["export", str(path), str(tmp_path / "hf")]) == 0
    assert any((tmp_path / "hf").glob("*.safetensors"))
    assert main(["diff", str(path), str(path)]) == 0
