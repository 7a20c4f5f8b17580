"""Fuzzing ``reshard.load`` with mutated copies of a real checkpoint.

A small real checkpoint is written once by ``reshard.save`` (ten tensors of ten dtypes, several of them
saved as several boxes by one process holding several leaves of one key; a ShardedObject of two cells
holding tensors, arrays, bytes and tuples; common values of every scalar kind) and merged into a checkpoint
of two data files. Each hypothesis example copies it into a fresh sandbox, applies up to four mutations
(benign re-layouts first, then hostile changes to data files, to the metadata document, to its JSON text
and to the metadata file itself) and loads it twice, in one process: with a template of every whole
tensor, object cell and common value (sometimes with ``verify=True``), and with a random partial,
resharded template (random sub-boxes, two leaves of one key, dtype casts, ``strict=False``, read merging up
to ``max_read_amplification=100``, ``memory_budget_bytes`` down to 24, node-local staging). Every load must end
in one of:

- an exception that is a ``reshard.CheckpointError``, and not a generic one wrapping an internal error
  (a ``RuntimeError``, ``IndexError``...): that would mean hostile input reached code that did not
  validate it (known cases would be listed in ``KNOWN_INTERNAL_ERRORS``; the bugs found so far are fixed);
- a successful load that returns what the checkpoint *as it now stands* says, as an independent reference
  reader written from docs/format.md reads it: the metadata on disk (a mutation may leave a valid but
  different description: ``metadata.json`` carries no checksum) applied to the bytes on disk. On top of
  that, every checksum chunk that one of the template's byte runs covers whole must match the bytes (so
  a load of whole tensors never returns a flipped bit), object values are exactly the saved ones whenever
  their blob bytes are, with ``verify=True`` a tensor whose dtype and fingerprint are untouched is exactly
  the saved tensor, and ``LoadStats`` accounts exactly the requested bytes within the amplification bound.

An example whose mutations are all benign (moving boxes and blobs elsewhere in the files, re-tiling a
tensor into more boxes, other checksum chunk sizes, reordered JSON, unused files, aliases) must load, with
exactly the saved values. ``reshard validate`` must not raise on any example, and must not pass a checkpoint
in which a load then finds damage. Around every example: no file outside the checkpoint is written, created,
removed or read (its access time is set behind its modification time first, so that a read would move it),
the checkpoint itself is not written, and each load takes less than a few seconds; the peak memory of the
whole run grows by less than 300 MB. ``test_memory_bombs_fail_before_allocating`` checks absurd sizes on
their own, with the peak memory reset around each case.

Every random choice of an example comes from one seed that hypothesis draws (derandomized: the same 300
seeds on every run; a failure prints its seed and the mutations and templates it led to). Bugs this fuzzer
found are pinned by regression tests at the end of the file; the fuzzer did not generate their
triggers, or tolerates their signature, until they are fixed. docs/reliability.md lists them.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import math
import os
import random
import re
import shutil
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import reshard
from reshard.flows.maintenance import validate_checkpoint
from reshard.io.locking import LOCK_FILE
from reshard.metadata import METADATA_FILE
from tests.memory import peak_rss_growth
from tests.metadata_docs import CHECKSUM_MEMBER, dumps, read_doc, seal, unseal, write_doc
from tests.tiers import examples

# --------------------------------------------------------------------------------------------------
# Known bugs the fuzzer would tolerate until fixed (none now; the regression tests below pin the fixed ones).

KNOWN_INTERNAL_ERRORS: dict[str, str] = {}
SHORT_RUNS_UNVERIFIED = False
"""load.py, _copy_mapped (strided reads, dtype casts, non-contiguous destinations) verifies a run only when it
is at least ``chunk_bytes`` long, so a chunk shorter than that (the last chunk of a box, which is the whole box
when the box is smaller than a chunk) goes unchecked although the run covers it. The reference then does not
demand it. Set to False once test_every_chunk_a_mapped_read_covers_is_verified passes."""

EXAMPLES = examples(300)
LOAD_SECONDS = 5.0
FUZZ_RSS_GROWTH = 300 * 2**20
BOMB_RSS_GROWTH = 200 * 2**20

# --------------------------------------------------------------------------------------------------
# The pristine checkpoint

DTYPES: dict[str, torch.dtype] = {  # docs/format.md section 5
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
CHUNK = 16


def _make_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(20261130)
    return {
        "w": torch.randn(6, 8, generator=g),
        "b": torch.randint(-(2**40), 2**40, (10,), generator=g, dtype=torch.int64),
        "s": torch.tensor(-7, dtype=torch.int16),
        "e": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
        "h": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "c": torch.randn(2, 3, generator=g, dtype=torch.complex64),
        "d": torch.randn(4, generator=g, dtype=torch.float64),
        "q": torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8),
        "z": torch.tensor([True, False, True]),
        "k": torch.randint(-128, 128, (2, 2), generator=g, dtype=torch.int8),
    }


TENSORS = _make_tensors()
GLOBAL = {key: tuple(t.shape) for key, t in TENSORS.items()}
# key -> (which of the two saves writes it, its boxes as (offset, shape); None: one box, the whole tensor).
# "w" and "k" have boxes of equal shapes, so that swapping their offsets is a valid permutation.
LAYOUT: dict[str, tuple[int, list[tuple[tuple[int, ...], tuple[int, ...]]] | None]] = {
    "w": (0, [((0, 0), (2, 8)), ((2, 0), (4, 4)), ((2, 4), (4, 4))]),
    "b": (0, None),
    "s": (0, None),
    "e": (0, None),
    "h": (1, [((0, 0), (1, 5)), ((1, 0), (2, 5))]),
    "c": (1, None),
    "d": (1, None),
    "q": (1, None),
    "z": (1, None),
    "k": (1, [((0, 0), (1, 2)), ((1, 0), (1, 2))]),
}
OBJECT_VALUES: list[Any] = [
    {
        "seed": 5,
        "t": torch.arange(4, dtype=torch.int32),
        "a": np.arange(3.0),
        "raw": b"xy\x00",
        "pair": (1, 2.5),
        "ints": {1: "one"},
        "nan": float("nan"),
    },
    {"seed": 6, "state": torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16), "none": None},
]
COMMON_A: dict[str, Any] = {
    "step": 3,
    "lr": 0.1,
    "name": "x\u00e9\u4e2d",
    "flag": True,
    "none": None,
    "raw": b"\x00ab\xff",
    "nan": float("nan"),
    "ninf": float("-inf"),
}
COMMON_B: dict[str, Any] = {"big": 2**70, "neg": -5, "tiny": 5e-324}
COMMON = {**COMMON_A, **COMMON_B}
# Destination dtypes a partial template may ask for besides the saved one (reshard converts while copying).
CASTS: dict[str, list[torch.dtype]] = {
    "w": [torch.float64, torch.bfloat16],
    "b": [torch.float64],
    "s": [torch.int32, torch.float32],
    "e": [torch.float32],
    "h": [torch.float32],
    "c": [torch.complex128],
    "d": [torch.float32],
    "q": [torch.int16],
    "z": [torch.uint8],
    "k": [torch.int64],
}


def _state(part: int) -> dict[str, Any]:
    leaves = {}
    for key, (which, boxes) in LAYOUT.items():
        if which != part:
            continue
        full = TENSORS[key]
        for i, (offset, shape) in enumerate(boxes or [((0,) * full.ndim, tuple(full.shape))]):
            index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
            leaves[f"{key}{i}"] = reshard.ShardedTensor(key, full[index].clone(), GLOBAL[key], offset)
    state: dict[str, Any] = {"t": leaves, **(COMMON_A if part == 0 else COMMON_B)}
    if part == 0:
        state["rng"] = [reshard.ShardedObject("rng", value, (2,), (i,)) for i, value in enumerate(OBJECT_VALUES)]
    return state


@dataclass(frozen=True)
class Pristine:
    root: Path
    doc: dict[str, Any]
    blobs: tuple[bytes, ...]  # the stored bytes of object cells 0 and 1
    base: Path  # where sandboxes go


def _merge(parts: list[Path], out: Path) -> None:
    """One checkpoint of two data files from two single-process saves (a valid layout per docs/format.md)."""
    docs = [read_doc(p) for p in parts]
    (out / "data").mkdir(parents=True)
    for part, doc in zip(parts, docs, strict=True):
        for entry in doc["files"]:
            shutil.copyfile(part / entry["path"], out / entry["path"])
    first, second = docs
    for tensor in second["tensors"].values():
        for box in tensor["boxes"]:
            box["file"] += len(first["files"])
    doc = dict(first)
    doc["world_size"] = 2
    doc["files"] = first["files"] + second["files"]
    doc["tensors"] = dict(sorted({**first["tensors"], **second["tensors"]}.items()))
    doc["common"] = {**first["common"], **second["common"]}
    write_doc(out / METADATA_FILE, doc)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    base = tmp_path_factory.mktemp("fuzz")
    parts = [base / "part0", base / "part1"]
    for i, part in enumerate(parts):
        reshard.save(_state(i), part, options=reshard.SaveOptions(fingerprint=True, checksum_chunk_bytes=CHUNK))
    root = base / "pristine"
    _merge(parts, root)
    doc = read_doc(root)
    entries = sorted(doc["objects"]["rng"]["entries"], key=lambda e: e["offset"])
    blobs = tuple(_entry_bytes(root, doc, e) for e in entries)
    return Pristine(root=root, doc=doc, blobs=blobs, base=base)


# --------------------------------------------------------------------------------------------------
# Templates


@dataclass(frozen=True)
class Want:
    """A box of tensor ``key`` that a template asks for, in ``dtype``."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    global_shape: tuple[int, ...] | None = None  # default: the saved one


@dataclass(frozen=True)
class Template:
    wants: tuple[Want, ...]
    cells: tuple[int, ...]
    commons: tuple[str, ...]
    verify: bool = False
    strict: bool = True
    amplification: float = 1.10  # max_read_amplification: larger merges more strided runs into one read
    buffer_bytes: int | None = None  # memory_budget_bytes: small values cut reads into slabs and batches
    staging: bool = False  # load through node-local staging (StagingOptions)

    def options(self, top: Path) -> dict[str, Any]:
        """The keyword arguments of this template's ``reshard.load``."""
        read: dict[str, Any] = {"verify": self.verify, "max_read_amplification": self.amplification}
        if self.buffer_bytes is not None:
            read["memory_budget_bytes"] = self.buffer_bytes
        if self.staging:
            read["staging"] = reshard.StagingOptions(directory=top / "staging")
        return {"strict": self.strict, "options": reshard.LoadOptions(**read)}

    def build(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "tensors": {
                f"t{i}": reshard.ShardedTensor(
                    w.key, torch.zeros(w.shape, dtype=w.dtype), w.global_shape or GLOBAL[w.key], w.offset
                )
                for i, w in enumerate(self.wants)
            },
            "objects": [reshard.ShardedObject("rng", None, (2,), (cell,)) for cell in self.cells],
        }
        for path in self.commons:
            value = COMMON[path]
            state[path] = type(value)() if value is not None else None
        return state

    def describe(self) -> str:
        wants = ", ".join(f"{w.key}@{list(w.offset)}+{list(w.shape)}:{w.dtype}" for w in self.wants)
        return (
            f"[{wants}] cells={list(self.cells)} commons={list(self.commons)} verify={self.verify} "
            f"strict={self.strict} amplification={self.amplification} buffer={self.buffer_bytes} staging={self.staging}"
        )


def whole_template(*, verify: bool = False) -> Template:
    wants = tuple(Want(key, (0,) * len(shape), shape, TENSORS[key].dtype) for key, shape in GLOBAL.items())
    return Template(wants, (0, 1), tuple(COMMON), verify)


def random_partial_template(rng: random.Random) -> Template:
    """Random sub-boxes of 1 to 5 tensors (two leaves of "w" sometimes), in the saved dtype or a cast one,
    some object cells and common values."""
    wants: list[Want] = []
    for key in rng.sample(sorted(GLOBAL), rng.randint(1, 5)):
        shape = GLOBAL[key]
        offset = tuple(rng.randrange(n) for n in shape)
        extent = tuple(rng.randint(1, n - o) for o, n in zip(offset, shape, strict=True))
        dtype = rng.choice([TENSORS[key].dtype, TENSORS[key].dtype, *CASTS[key]])
        if key == "w" and extent[0] > 1 and rng.random() < 0.5:  # two leaves of one key on this rank
            cut = rng.randint(1, extent[0] - 1)
            wants.append(Want(key, offset, (cut, extent[1]), dtype))
            wants.append(Want(key, (offset[0] + cut, offset[1]), (extent[0] - cut, extent[1]), dtype))
        else:
            wants.append(Want(key, offset, extent, dtype))
    cells = tuple(rng.sample([0, 1], rng.randint(0, 2)))
    commons = tuple(rng.sample(sorted(COMMON), rng.randint(0, 3)))
    return Template(
        tuple(wants),
        cells,
        commons,
        strict=rng.random() < 0.8,
        amplification=rng.choice([1.0, 1.10, 1.10, 2.0, 100.0]),
        buffer_bytes=rng.choice([None, None, 24, 64, 100, 4096]),
        staging=rng.random() < 0.2,
    )


# --------------------------------------------------------------------------------------------------
# Helpers over a metadata document and its files


def _entry_bytes(root: Path, doc: dict[str, Any], entry: dict[str, Any]) -> bytes:
    path = root / doc["files"][entry["file"]]["path"]
    with open(path, "rb") as f:
        f.seek(entry["byte_offset"])
        return f.read(entry["byte_length"])


def _crcs(data: bytes, chunk: int) -> list[int]:
    return [crc32c.crc32c(data[i : i + chunk]) for i in range(0, len(data), chunk)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return _bits(t).numpy().tobytes()


def _doc_paths(node: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*prefix, key)
            yield from _doc_paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (*prefix, i)
            yield from _doc_paths(value, (*prefix, i))


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _put(doc: Any, path: tuple[Any, ...], value: Any) -> None:
    _get(doc, path[:-1])[path[-1]] = value


@dataclass
class Stored:
    """A stored box or object blob of the current document."""

    kind: str  # "tensor" or "object"
    key: str
    entry: dict[str, Any]
    itemsize: int
    dtype: torch.dtype | None


def _stored(doc: dict[str, Any]) -> list[Stored]:
    out = []
    for key, tensor in doc["tensors"].items():
        dtype = DTYPES[tensor["dtype"]]
        out += [Stored("tensor", key, box, dtype.itemsize, dtype) for box in tensor["boxes"] if box["byte_length"]]
    for key, obj in doc["objects"].items():
        out += [Stored("object", key, entry, 1, None) for entry in obj["entries"]]
    return out


def _append(path: Path, data: bytes, align: int, pad: int) -> int:
    """Append ``data`` to ``path`` at a multiple of ``align`` plus ``pad`` alignments; return its offset."""
    size = path.stat().st_size
    start = -(-size // align) * align + pad * align
    with open(path, "r+b") as f:
        f.seek(size)
        f.write(b"\x00" * (start - size) + data)
    return start


# --------------------------------------------------------------------------------------------------
# Mutations


@dataclass
class Case:
    """One example: the sandbox, the metadata document being mutated, and how to write it out."""

    top: Path
    root: Path
    doc: Any
    rng: random.Random
    notes: list[str] = field(default_factory=list)
    benign: bool = True
    metadata: str = "write"  # "write", "deleted" or "directory"
    duplicate: tuple[tuple[Any, ...], str, Any] | None = None
    text_ops: list[Callable[[bytes], bytes]] = field(default_factory=list)
    style: dict[str, Any] = field(default_factory=lambda: {"separators": (",", ":")})

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def flag(self) -> bool:
        return self.rng.random() < 0.5

    def choice(self, options: list[Any]) -> Any:
        return self.rng.choice(options)  # IndexError when there is nothing to choose from

    def data_files(self) -> list[Path]:
        return sorted(p for p in (self.root / "data").iterdir() if p.is_file() and not p.is_symlink())

    def file_index(self, path: Path) -> int | None:
        rel = path.relative_to(self.root).as_posix()
        return next((i for i, f in enumerate(self.doc["files"]) if f["path"] == rel), None)

    def write_metadata(self) -> bytes | None:
        target = self.root / METADATA_FILE
        if self.metadata == "deleted":
            target.unlink()
            return None
        if self.metadata == "directory":
            target.unlink()
            target.mkdir()
            (target / "x").write_text("{}")
            return None
        if self.duplicate is not None:
            body = {k: v for k, v in self.doc.items() if k != CHECKSUM_MEMBER}
            raw = _dumps_with_duplicate(body, *self.duplicate).encode()
            version = self.doc.get("version")
            if isinstance(version, int) and not isinstance(version, bool) and version >= 3:
                raw = seal(raw)  # a consistent forgery: the validator must catch the duplicate itself
        else:
            raw = dumps(self.doc, **self.style)
        for op in self.text_ops:
            raw = op(raw)
        target.write_bytes(raw)
        return raw


def _dumps_with_duplicate(node: Any, where: tuple[Any, ...], key: str, value: Any, path: tuple[Any, ...] = ()) -> str:
    if isinstance(node, dict):
        parts = [f"{json.dumps(k)}:{_dumps_with_duplicate(v, where, key, value, (*path, k))}" for k, v in node.items()]
        if path == where:
            parts.append(f"{json.dumps(key)}:{json.dumps(value)}")
        return "{" + ",".join(parts) + "}"
    if isinstance(node, list):
        return "[" + ",".join(_dumps_with_duplicate(v, where, key, value, (*path, i)) for i, v in enumerate(node)) + "]"
    return json.dumps(node)


# ---- benign: the checkpoint stays valid and describes the same values


def m_relocate(case: Case) -> None:
    """Move a box or blob to the end of a data file (at a multiple of its itemsize), as another writer may."""
    item = case.choice(_stored(case.doc))
    data = _entry_bytes(case.root, case.doc, item.entry)
    target = case.integer(0, len(case.doc["files"]) - 1)
    path = case.root / case.doc["files"][target]["path"]
    start = _append(path, data, item.itemsize, case.integer(0, 9))
    item.entry.update(file=target, byte_offset=start)
    case.doc["files"][target]["size"] = path.stat().st_size
    case.notes.append(f"relocate {item.kind} {item.key!r} to file {target} at {start}")


def m_rechunk(case: Case) -> None:
    """Another checksum chunk size, every checksum recomputed."""
    chunk = case.choice([1, 3, 7, 8, 24, 40, 64, 100, 4096, 2**62])
    case.doc["checksum"]["chunk_bytes"] = chunk
    for item in _stored(case.doc):
        item.entry["crc32c"] = _crcs(_entry_bytes(case.root, case.doc, item.entry), chunk)
    case.notes.append(f"rechunk {chunk}")


def m_retile(case: Case) -> None:
    """Split one stored box in two along an axis, writing both parts anew."""
    candidates = [s for s in _stored(case.doc) if s.kind == "tensor" and any(n > 1 for n in s.entry["shape"])]
    item = case.choice(candidates)
    box = item.entry
    assert item.dtype is not None
    shape = box["shape"]
    axis = case.choice([a for a, n in enumerate(shape) if n > 1])
    cut = case.integer(1, shape[axis] - 1)
    data = _entry_bytes(case.root, case.doc, box)
    full = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(item.dtype).reshape(shape)
    chunk = case.doc["checksum"]["chunk_bytes"]
    new_boxes = []
    for lo, hi in ((0, cut), (cut, shape[axis])):
        part = full.narrow(axis, lo, hi - lo)
        raw = _tensor_bytes(part)
        file = case.integer(0, len(case.doc["files"]) - 1)
        path = case.root / case.doc["files"][file]["path"]
        start = _append(path, raw, item.itemsize, case.integer(0, 3))
        case.doc["files"][file]["size"] = path.stat().st_size
        offset = list(box["offset"])
        offset[axis] += lo
        new_boxes.append(
            {
                "offset": offset,
                "shape": list(part.shape),
                "file": file,
                "byte_offset": start,
                "byte_length": len(raw),
                "crc32c": _crcs(raw, chunk),
            }
        )
    boxes = case.doc["tensors"][item.key]["boxes"]
    index = next(i for i, b in enumerate(boxes) if b is box)
    boxes[index : index + 1] = new_boxes
    case.notes.append(f"retile {item.key!r} box at {box['offset']} on axis {axis} at {cut}")


def m_reorder(case: Case) -> None:
    """Shuffle the order of JSON fields, boxes, entries and files (indices remapped)."""
    seed = case.integer(0, 2**32 - 1)
    rnd = np.random.default_rng(seed)

    def shuffled(items: list[Any]) -> list[Any]:
        return [items[i] for i in rnd.permutation(len(items))]

    doc = case.doc
    order = shuffled(list(range(len(doc["files"]))))
    new_index = {old: new for new, old in enumerate(order)}
    doc["files"] = [doc["files"][i] for i in order]
    for item in _stored(doc):
        item.entry["file"] = new_index[item.entry["file"]]
    for tensor in doc["tensors"].values():
        tensor["boxes"] = shuffled(tensor["boxes"])
    for obj in doc["objects"].values():
        obj["entries"] = shuffled(obj["entries"])

    def fields(node: Any, depth: int) -> Any:
        if isinstance(node, dict) and depth < 6:
            return {k: fields(node[k], depth + 1) for k in shuffled(list(node))}
        if isinstance(node, list) and depth < 6:
            return [fields(v, depth + 1) for v in node]
        return node

    case.doc = {k: (fields(v, 1) if k != "common" else v) for k, v in fields(doc, 5).items()}
    case.notes.append(f"reorder {seed}")


def m_leftovers(case: Case) -> None:
    """Files no commit references: a failed save's data, a commit's temporary file, a lock, a subdirectory."""
    (case.root / "data" / "0123456789abcdef0123456789abcdef-r00000.bin").write_bytes(b"partial data")
    (case.root / ".metadata.json.tmp-0123456789abcdef0123456789abcdef").write_bytes(b'{"format": "resh')
    (case.root / LOCK_FILE).write_text('{"host": "elsewhere", "pid": 1, "token": "t", "created": 0}')
    (case.root / "data" / "sub").mkdir(exist_ok=True)
    (case.root / "data" / "sub" / "x.bin").write_bytes(b"x")
    case.notes.append("leftovers")


def m_garbage_tail(case: Case) -> None:
    """Bytes after the last box of a data file, its size updated."""
    index = case.integer(0, len(case.doc["files"]) - 1)
    path = case.root / case.doc["files"][index]["path"]
    with open(path, "ab") as f:
        f.write(bytes(range(case.integer(1, 200))))
    case.doc["files"][index]["size"] = path.stat().st_size
    case.notes.append(f"garbage tail on file {index}")


def m_style(case: Case) -> None:
    """Whitespace and escaping of the JSON text."""
    case.style = case.choice(
        [
            {"indent": 2},
            {"indent": "\t", "ensure_ascii": False},
            {"separators": (" , ", " : ")},
            {"ensure_ascii": False, "separators": (",", ":")},
        ]
    )
    case.notes.append(f"style {case.style}")


def m_alias(case: Case) -> None:
    """A second tensor, object or common value sharing stored bytes (allowed: docs/format.md section 4)."""
    kind = case.choice(["tensors", "objects", "common"])
    source = case.choice(sorted(case.doc[kind]))
    case.doc[kind][f"{source}~alias"] = copy.deepcopy(case.doc[kind][source])
    case.notes.append(f"alias {kind} {source!r}")


# ---- hostile: data files


def m_data_flip(case: Case) -> None:
    files = case.data_files()
    path = case.choice(files)
    size = path.stat().st_size
    if size:
        _flip(path, case.integer(0, size - 1), case.integer(0, 7))
    case.notes.append(f"flip a bit of {path.name}")


def _flip(path: Path, offset: int, bit: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 1 << bit
    path.write_bytes(bytes(raw))


def m_data_flip_stored(case: Case) -> None:
    """Flip a bit inside a stored box or blob; with ``forge``, also recompute that chunk's checksum."""
    item = case.choice(_stored(case.doc))
    forge = case.flag()
    entry = item.entry
    at = case.integer(0, entry["byte_length"] - 1)
    path = case.root / case.doc["files"][entry["file"]]["path"]
    _flip(path, entry["byte_offset"] + at, case.integer(0, 7))
    if forge:
        entry["crc32c"] = _crcs(_entry_bytes(case.root, case.doc, entry), case.doc["checksum"]["chunk_bytes"])
    case.notes.append(f"flip {item.kind} {item.key!r} byte {at}{' (checksums forged)' if forge else ''}")


def _blob(header: object, body: bytes = b"", header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if header_len is None else header_len).to_bytes(8, "little") + raw + body


FORGED_BLOBS = [
    b"",
    b"\x01",
    _blob({"value": 1, "tensors": []}, header_len=2**64 - 1),
    _blob({"value": 1, "tensors": []}, header_len=2**40),
    _blob(b"\xff\xfe"),
    _blob(
        {"value": {"$tensor": 0}, "tensors": [{"dtype": "float32", "shape": [2**40, 2**40], "offset": 0, "length": 8}]}
    ),
    _blob({"value": {"$tensor": 0}, "tensors": [{"dtype": "float32", "shape": [0, 2**70], "offset": 0, "length": 0}]}),
    _blob(
        {"value": {"$ndarray": 0}, "tensors": [{"dtype": "bfloat16", "shape": [1], "offset": 0, "length": 2}]}, b"ab"
    ),
    _blob({"value": {"$tensor": 1}, "tensors": []}),
    _blob({"value": {"$pickle": "gASVAAAA"}, "tensors": []}),
    _blob({"value": [[[[[[[[[[1]]]]]]]]]], "tensors": []}),
    _blob(b'{"value": 1, "value": 2, "tensors": []}'),
    _blob(b'{"value": NaN, "tensors": []}'),
    _blob({"value": {"$dict": [[[1], 2]]}, "tensors": []}),
    _blob({"value": {"ok": True}, "tensors": []}),
]


def m_forge_blob(case: Case) -> None:
    """Replace an object cell by a crafted blob, with sizes and checksums that match it."""
    entries = [s for s in _stored(case.doc) if s.kind == "object"]
    item = case.choice(entries)
    blob = case.choice(FORGED_BLOBS)
    path = case.root / case.doc["files"][item.entry["file"]]["path"]
    start = _append(path, blob, 1, 0)
    case.doc["files"][item.entry["file"]]["size"] = path.stat().st_size
    item.entry.update(byte_offset=start, byte_length=len(blob), crc32c=_crcs(blob, case.doc["checksum"]["chunk_bytes"]))
    case.notes.append(f"forged blob {blob[:40]!r}")


def m_data_truncate(case: Case) -> None:
    path = case.choice(case.data_files())
    size = path.stat().st_size
    keep = case.integer(0, max(size - 1, 0))
    os.truncate(path, keep)
    case.notes.append(f"truncate {path.name} to {keep}")


def m_data_extend(case: Case) -> None:
    path = case.choice(case.data_files())
    with open(path, "ab") as f:
        f.write(b"\x00" * case.integer(1, 100))
    case.notes.append(f"extend {path.name}")


def m_data_delete(case: Case) -> None:
    path = case.choice(case.data_files())
    path.unlink()
    case.notes.append(f"delete {path.name}")


def m_data_symlink(case: Case) -> None:
    """Replace a data file by a symbolic link to an identical copy, outside the checkpoint or inside it."""
    path = case.choice(case.data_files())
    where = case.choice(["outside", "outside-relative", "inside"])
    if where == "inside":
        target = path.with_name("copy-" + path.name)
        shutil.copyfile(path, target)
        link: str | Path = target.name
    else:
        target = case.top / "outside" / "data" / path.name
        link = target if where == "outside" else os.path.relpath(target, path.parent)
    path.unlink()
    os.symlink(link, path)
    case.notes.append(f"symlink {path.name} -> {link}")


def m_data_directory(case: Case) -> None:
    """Replace a data file by a directory, possibly with the metadata's size set to the directory's."""
    path = case.choice(case.data_files())
    path.unlink()
    path.mkdir()
    index = case.file_index(path)
    if index is not None and case.flag():
        case.doc["files"][index]["size"] = os.lstat(path).st_size
    case.notes.append(f"directory in place of {path.name}")


def m_data_empty(case: Case) -> None:
    path = case.choice(case.data_files())
    path.write_bytes(b"")
    index = case.file_index(path)
    if index is not None and case.flag():
        case.doc["files"][index]["size"] = 0
    case.notes.append(f"empty {path.name}")


def m_data_swap(case: Case) -> None:
    files = case.data_files()
    if len(files) >= 2:
        a, b = files[0], files[1]
        temp = a.with_name("swap.tmp")
        a.rename(temp)
        b.rename(a)
        temp.rename(b)
    case.notes.append("swap data files")


# ---- hostile: the metadata document

HOSTILE_INTS = [
    *(0, 1, -1, 2, 3, 7, 8, 15, 16, 17, 63, 64, 65, 255, 256, 4095, 4096),
    *(2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**60, 2**61, 2**62 - 1, 2**62, 2**62 + 1),
    *(2**63 - 1, 2**63, 2**64, -(2**63), 10**20),
]
HOSTILE_VALUES: list[Any] = [
    *HOSTILE_INTS,
    *(0.0, 1.0, 0.5, -0.0, 1e308, 16.0, True, False, None),
    *("", "0", "1", "float32", "bfloat16", "int8", "bool", "complex128", "float128", "crc32c", "reshard"),
    *("../x", "/etc/passwd", "s3://x", "a\x00b"),
    *([], [0], [1, 2], [[]], [-1], [2**62], {}, {"$float": "nan"}, {"$bytes": "AA=="}),
]
HOSTILE_NAMES = [
    *("../x", "../outside/target.bin", "data/../../outside/target.bin", "data/../../x", "/etc/passwd"),
    *("s3://x", "gs://b/x", "file:///etc/passwd", "a\x00b", "data/a\x00b", "data\\..\\x", "C:x", "c:/x"),
    *("", ".", "..", "data", "data/", "./data", "data//x", "data/./x", "metadata.json", LOCK_FILE),
    *("data/nonexistent.bin", "outside/target.bin", "data/\u00e9.bin", "data/x ", "~/x", "$HOME/x"),
]
DELTAS = [-65, -64, -9, -8, -4, -2, -1, 1, 2, 4, 8, 64, 65]


def m_set_any(case: Case) -> None:
    """Replace any node of the document: an int by a nearby or extreme one, anything by a hostile value."""
    paths = list(_doc_paths(case.doc))
    path = case.choice(paths)
    old = _get(case.doc, path)
    if isinstance(old, int) and not isinstance(old, bool) and case.flag():
        value: Any = case.choice([old + d for d in DELTAS] + [old * 2, old // 2, -old, 0])
    else:
        value = copy.deepcopy(case.choice(HOSTILE_VALUES))
    _put(case.doc, path, value)
    case.notes.append(f"set {list(path)} = {value!r} (was {old!r})"[:300])


def m_drop_key(case: Case) -> None:
    dicts = [p for p in [(), *_doc_paths(case.doc)] if isinstance(_get(case.doc, p), dict) and _get(case.doc, p)]
    path = case.choice(dicts)
    node = _get(case.doc, path)
    key = case.choice(sorted(node))
    del node[key]
    case.notes.append(f"drop {[*path, key]}")


def m_add_key(case: Case) -> None:
    dicts = [p for p in [(), *_doc_paths(case.doc)] if isinstance(_get(case.doc, p), dict)]
    path = case.choice(dicts)
    key = case.choice(["extra", "fingerprint", "logical_shape", "$float", "path", "size", "crc32c", "version", ""])
    value = copy.deepcopy(case.choice(HOSTILE_VALUES))
    _get(case.doc, path)[key] = value
    case.notes.append(f"add {[*path, key]} = {value!r}")


def m_duplicate_key(case: Case) -> None:
    dicts = [p for p in [(), *_doc_paths(case.doc)] if isinstance(_get(case.doc, p), dict) and _get(case.doc, p)]
    path = case.choice(dicts)
    node = _get(case.doc, path)
    key = case.choice(sorted(node))
    value = node[key] if case.flag() else case.choice(HOSTILE_VALUES)
    case.duplicate = (path, key, copy.deepcopy(value))
    case.notes.append(f"duplicate key {[*path, key]}")


def _entry_refs(doc: dict[str, Any]) -> list[tuple[str, list[Any], int]]:
    refs = [("tensor", t["boxes"], i) for t in doc["tensors"].values() for i in range(len(t["boxes"]))]
    refs += [("object", o["entries"], i) for o in doc["objects"].values() for i in range(len(o["entries"]))]
    return refs


def m_swap(case: Case) -> None:
    """Swap two boxes (or entries) between or within tensors, or one field of theirs."""
    refs = _entry_refs(case.doc)
    a = case.integer(0, len(refs) - 1)
    b = case.integer(0, len(refs) - 1)
    (kind_a, list_a, i), (kind_b, list_b, j) = refs[a], refs[b]
    if kind_a == kind_b and case.flag():
        list_a[i], list_b[j] = list_b[j], list_a[i]
        case.notes.append(f"swap entries {a} and {b}")
        return
    shared = sorted(set(list_a[i]) & set(list_b[j]))
    name = case.choice(shared)
    list_a[i][name], list_b[j][name] = list_b[j][name], list_a[i][name]
    case.notes.append(f"swap {name} of entries {a} and {b}")


def m_file_name(case: Case) -> None:
    index = case.integer(0, len(case.doc["files"]) - 1)
    others = [f["path"] for f in case.doc["files"]]
    name = case.choice([*HOSTILE_NAMES, str(case.top / "outside" / "target.bin"), str(case.top / "x"), *others])
    case.doc["files"][index]["path"] = name
    case.notes.append(f"files[{index}].path = {name!r}")


def m_dtype(case: Case) -> None:
    key = case.choice(sorted(case.doc["tensors"]))
    name = case.choice([*DTYPES, "float128", "Float32", "torch.float32", "", "uint16", "qint8", "float8"])
    case.doc["tensors"][key]["dtype"] = name
    case.notes.append(f"dtype of {key!r} = {name}")


def m_geometry(case: Case) -> None:
    """Change a global shape, a box's offset or shape, or an object's grid or cell."""
    targets: list[list[Any]] = [t["global_shape"] for t in case.doc["tensors"].values()]
    targets += [b[f] for t in case.doc["tensors"].values() for b in t["boxes"] for f in ("offset", "shape")]
    targets += [o["global_shape"] for o in case.doc["objects"].values()]
    targets += [e["offset"] for o in case.doc["objects"].values() for e in o["entries"]]
    target = targets[case.integer(0, len(targets) - 1)]
    op = case.choice(["set", "nudge", "append", "drop", "clear", "many"])
    if op in ("set", "nudge") and target:
        axis = case.integer(0, len(target) - 1)
        target[axis] = case.choice(HOSTILE_INTS) if op == "set" else target[axis] + case.choice(DELTAS)
    elif op == "append":
        target.append(case.choice([0, 1, 2, 2**62]))
    elif op == "drop" and target:
        target.pop()
    elif op == "clear":
        target.clear()
    elif op == "many":
        target[:] = [1] * case.choice([64, 65, 1000])
    case.notes.append(f"geometry {op} -> {target[:8]}")


def m_checksums(case: Case) -> None:
    if case.flag():
        value = case.choice([0, 1, 15, 17, 32, 2**62, 2**62 + 1, -16, 16.0, True, "16", None])
        case.doc["checksum"]["chunk_bytes"] = value
        case.notes.append(f"chunk_bytes = {value!r}")
        return
    kind, entries, i = case.choice(_entry_refs(case.doc))
    crcs = entries[i]["crc32c"]
    op = case.choice(["pop", "append", "replace", "clear", "scalar"])
    if op == "pop" and crcs:
        crcs.pop()
    elif op == "append":
        crcs.append(case.choice([0, crcs[0] if crcs else 1]))
    elif op == "replace" and crcs:
        at = case.integer(0, len(crcs) - 1)
        crcs[at] = case.choice([0, crcs[at] ^ 1, 2**32 - 1, 2**32, -1, 1.5, True, "0"])
    elif op == "clear":
        crcs.clear()
    elif op == "scalar":
        entries[i]["crc32c"] = case.choice([5, None, "abc", {}])
    case.notes.append(f"checksums of a {kind} entry: {op}")


def _rechunk_whole(case: Case, chunk: int = 2**62) -> None:
    case.doc["checksum"]["chunk_bytes"] = chunk
    for item in _stored(case.doc):
        item.entry["crc32c"] = _crcs(_entry_bytes(case.root, case.doc, item.entry), chunk)


def m_bomb(case: Case) -> None:
    """Absurd sizes that are otherwise consistent, so that only the files or the template can refute them."""
    variant = case.choice(["file_size", "tensor", "object", "grid", "axes"])
    if variant == "file_size":
        index = case.integer(0, len(case.doc["files"]) - 1)
        case.doc["files"][index]["size"] = case.choice([2**40, 2**61, 2**62])
    elif variant == "tensor":
        _make_huge_tensor(case.doc, case.root, "b")
    elif variant == "object":
        _make_huge_object(case.doc, case.root, 0)
    elif variant == "grid":
        case.doc["objects"]["rng"]["global_shape"] = case.choice([[2**62], [2**31, 2**31], [2**62, 2**62, 0]])
    else:
        key = case.choice(sorted(case.doc["tensors"]))
        case.doc["tensors"][key]["global_shape"] = [2**62] * 64
        case.doc["tensors"][key]["boxes"] = []
    case.notes.append(f"bomb {variant}")


HUGE_ELEMENTS = 2**59  # 2**62 bytes of int64: the largest integer the format allows


def _make_huge_tensor(doc: dict[str, Any], root: Path, key: str) -> None:
    """Tensor ``key`` (int64) becomes one box of 2**59 elements in a file said to hold 2**62 bytes."""
    case_chunk = 2**62
    doc["checksum"]["chunk_bytes"] = case_chunk
    for item in _stored(doc):
        item.entry["crc32c"] = _crcs(_entry_bytes(root, doc, item.entry), case_chunk)
    file = doc["tensors"][key]["boxes"][0]["file"]
    doc["tensors"][key] = {
        "dtype": "int64",
        "global_shape": [HUGE_ELEMENTS],
        "boxes": [
            {
                "offset": [0],
                "shape": [HUGE_ELEMENTS],
                "file": file,
                "byte_offset": 0,
                "byte_length": 2**62,
                "crc32c": [0],
            }
        ],
    }
    doc["files"][file]["size"] = 2**62


def _make_huge_object(doc: dict[str, Any], root: Path, cell: int) -> None:
    """Object cell ``cell`` becomes a blob of 2**61 bytes in a file said to hold 2**62 bytes."""
    doc["checksum"]["chunk_bytes"] = 2**62
    for item in _stored(doc):
        item.entry["crc32c"] = _crcs(_entry_bytes(root, doc, item.entry), 2**62)
    entry = next(e for e in doc["objects"]["rng"]["entries"] if e["offset"] == [cell])
    entry.update(byte_offset=0, byte_length=2**61, crc32c=[0])
    doc["files"][entry["file"]]["size"] = 2**62


def m_files_list(case: Case) -> None:
    files = case.doc["files"]
    op = case.choice(["drop", "append", "reverse", "duplicate", "replace"])
    if op == "drop" and files:
        files.pop(case.integer(0, len(files) - 1))
    elif op == "append":
        files.append({"path": case.choice(["data/extra.bin", *HOSTILE_NAMES]), "size": case.choice(HOSTILE_INTS)})
    elif op == "reverse":
        files.reverse()
    elif op == "duplicate" and files:
        files.append(copy.deepcopy(files[0]))
    elif op == "replace":
        case.doc["files"] = case.choice([[], {}, "data", [None], [{"path": "data/x"}]])
    case.notes.append(f"files list: {op}")


def m_objects(case: Case) -> None:
    rng = case.doc["objects"]["rng"]
    op = case.choice(["grid", "offset", "drop", "copy"])
    if op == "grid":
        rng["global_shape"] = case.choice([[3], [1], [2, 1], [], [0]])
    elif op == "offset" and rng["entries"]:
        rng["entries"][0]["offset"] = case.choice([[1], [0], [2], [], [0, 0], [-1]])
    elif op == "drop" and rng["entries"]:
        rng["entries"].pop()
    elif op == "copy" and rng["entries"]:
        rng["entries"].append(dict(copy.deepcopy(rng["entries"][0]), offset=[case.choice([0, 1, 2])]))
    case.notes.append(f"objects: {op}")


def _deep(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


COMMON_VALUES: list[Any] = [
    *(4, "y", 0.5, True, None, -(2**80), {"$bytes": "AA=="}, {"$float": "inf"}, [1, 2], {"a": 1}),
    *({"$tuple": [1]}, {"$dict": [[1, 2]]}, {"$float": "NaN"}, {"$bytes": "***"}, {"$bytes": "\u00e9"}),
    *({"$tensor": 0}, {"$ndarray": 0}, {"$pickle": "gASV"}, {"$dict": [[[1], 2]]}, {"$dict": [[{"$tuple": [[1]]}, 2]]}),
    *({"$dict": [1]}, {"$tuple": 5}, {"a": 1, "$b": 2}, {"$float": 1.0}, _deep(70), _deep(300)),
]


def m_common(case: Case) -> None:
    path = case.choice([*sorted(case.doc["common"]), "zz"])
    value = copy.deepcopy(case.choice(COMMON_VALUES))
    case.doc["common"][path] = value
    case.notes.append(f"common[{path!r}] = {value!r}"[:200])


def m_fingerprint(case: Case) -> None:
    key = case.choice(sorted(case.doc["tensors"]))
    tensor = case.doc["tensors"][key]
    old = tensor.get("fingerprint", "0" * 16)
    flipped = ("1" if old[0] != "1" else "2") + old[1:] if isinstance(old, str) and old else "1" * 16
    value = case.choice(["", "0" * 16, "f" * 16, "F" * 16, "0" * 15, "g" * 16, 5, None, flipped, "DELETE"])
    if value == "DELETE":
        tensor.pop("fingerprint", None)
    else:
        tensor["fingerprint"] = value
    case.notes.append(f"fingerprint of {key!r} = {value!r}")


# ---- hostile: the JSON text and the metadata file


def m_text(case: Case) -> None:
    op = case.choice(["flip", "truncate", "insert", "delete", "bom", "trailing", "empty", "null", "latin1", "nan"])
    position = case.integer(0, 2**20)
    bit = case.integer(0, 7)
    byte = case.integer(0, 255)

    def apply(raw: bytes) -> bytes:
        at = position % max(len(raw), 1)
        if op == "flip" and raw:
            return raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1 :]
        if op == "truncate":
            return raw[:at]
        if op == "insert":
            return raw[:at] + bytes([byte]) + raw[at:]
        if op == "delete":
            return raw[:at] + raw[at + 1 + byte % 16 :]
        if op == "bom":
            return b"\xef\xbb\xbf" + raw
        if op == "trailing":
            return raw + (b"{}" if bit % 2 else b" x")
        if op == "empty":
            return b""
        if op == "null":
            return b"null"
        if op == "latin1":
            return raw.replace(b'"reshard"', b'"resh\xe4rd"', 1)
        return raw.replace(b"0.1", b"NaN", 1)

    case.text_ops.append(apply)
    case.notes.append(f"text {op} at {position} (bit {bit}, byte {byte})")


def m_metadata_file(case: Case) -> None:
    case.metadata = case.choice(["deleted", "directory"])
    case.notes.append(f"metadata.json {case.metadata}")


# (name, order of application, benign, mutation); benign ones run first, on a consistent checkpoint.
MUTATIONS: dict[str, tuple[int, bool, Callable[[Case], None]]] = {
    "relocate": (0, True, m_relocate),
    "rechunk": (0, True, m_rechunk),
    "retile": (0, True, m_retile),
    "reorder": (0, True, m_reorder),
    "leftovers": (0, True, m_leftovers),
    "garbage_tail": (0, True, m_garbage_tail),
    "style": (0, True, m_style),
    "alias": (0, True, m_alias),
    "data_flip": (1, False, m_data_flip),
    "data_flip_stored": (1, False, m_data_flip_stored),
    "forge_blob": (1, False, m_forge_blob),
    "data_truncate": (1, False, m_data_truncate),
    "data_extend": (1, False, m_data_extend),
    "data_delete": (1, False, m_data_delete),
    "data_symlink": (1, False, m_data_symlink),
    "data_directory": (1, False, m_data_directory),
    "data_empty": (1, False, m_data_empty),
    "data_swap": (1, False, m_data_swap),
    "set_any": (2, False, m_set_any),
    "drop_key": (2, False, m_drop_key),
    "add_key": (2, False, m_add_key),
    "duplicate_key": (2, False, m_duplicate_key),
    "swap": (2, False, m_swap),
    "file_name": (2, False, m_file_name),
    "dtype": (2, False, m_dtype),
    "geometry": (2, False, m_geometry),
    "checksums": (2, False, m_checksums),
    "bomb": (2, False, m_bomb),
    "files_list": (2, False, m_files_list),
    "objects": (2, False, m_objects),
    "common": (2, False, m_common),
    "fingerprint": (2, False, m_fingerprint),
    "text": (3, False, m_text),
    "metadata_file": (4, False, m_metadata_file),
}
BENIGN = sorted(name for name, (_, benign, _) in MUTATIONS.items() if benign)
HOSTILE = sorted(name for name, (_, benign, _) in MUTATIONS.items() if not benign)


def apply_mutations(case: Case, names: list[str]) -> None:
    for name in sorted(names, key=lambda n: MUTATIONS[n][0]):
        _, benign, mutate = MUTATIONS[name]
        try:
            mutate(case)
        except (KeyError, IndexError, TypeError, AttributeError, ValueError, AssertionError, OSError) as exc:
            if benign:
                raise  # benign mutations run first, on a valid checkpoint: they must apply
            # An earlier hostile change removed what this one works on: the checkpoint is hostile anyway.
            case.notes.append(f"{name}: not applicable ({type(exc).__name__})")
        case.benign = case.benign and benign


# --------------------------------------------------------------------------------------------------
# The sandbox: a canary around the checkpoint, and what must not change


def make_sandbox(pristine: Pristine) -> Path:
    top = Path(tempfile.mkdtemp(prefix="ex", dir=pristine.base))
    shutil.copytree(pristine.root, top / "ckpt")
    (top / "canary.bin").write_bytes(b"canary " * 10)
    (top / "x").write_bytes(b"the file that '../x' names")
    outside = top / "outside"
    shutil.copytree(pristine.root / "data", outside / "data")
    shutil.copyfile(pristine.root / METADATA_FILE, outside / METADATA_FILE)
    shutil.copyfile(pristine.root / pristine.doc["files"][0]["path"], outside / "target.bin")
    return top


def snapshot(top: Path, *, skip: str | None = None) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``top`` (not following links): its kind, and for files size, mtime and content."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        if skip is not None and Path(dirpath) == top and skip in dirnames:
            dirnames.remove(skip)
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            info = os.lstat(path)
            rel = path.relative_to(top).as_posix()
            if stat.S_ISLNK(info.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(info.st_mode):
                out[rel] = ("dir", info.st_mtime_ns)
            elif stat.S_ISREG(info.st_mode):
                out[rel] = ("file", info.st_size, info.st_mtime_ns, path.read_bytes())
            else:
                out[rel] = ("other", info.st_mode)
    return out


def set_access_times_behind(top: Path, *, skip: str) -> dict[str, int]:
    """Set every file's access time before its modification time, so that any read moves it (relatime)."""
    times = {}
    for rel, entry in snapshot(top, skip=skip).items():
        if entry[0] == "file":
            mtime = entry[2]
            os.utime(top / rel, ns=(mtime - 10**12, mtime))
            times[rel] = mtime - 10**12
    return times


@pytest.fixture(scope="module")
def reads_move_access_times(tmp_path_factory: pytest.TempPathFactory) -> bool:
    """Whether this filesystem records reads in access times (not with noatime)."""
    probe = tmp_path_factory.mktemp("atime") / "probe"
    probe.write_bytes(b"x")
    mtime = probe.stat().st_mtime_ns
    os.utime(probe, ns=(mtime - 10**12, mtime))
    probe.read_bytes()
    return probe.stat().st_atime_ns != mtime - 10**12


# --------------------------------------------------------------------------------------------------
# The reference reader (docs/format.md sections 3, 6 and 8) and the oracle


def _intersect(a_off: tuple[int, ...], a_shape: tuple[int, ...], b_off: Any, b_shape: Any) -> Any:
    lo = tuple(max(x, y) for x, y in zip(a_off, b_off, strict=True))
    hi = tuple(min(x + n, y + m) for x, n, y, m in zip(a_off, a_shape, b_off, b_shape, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return lo, tuple(h - low for low, h in zip(lo, hi, strict=True))


def _runs(box_shape: tuple[int, ...], rel: tuple[int, ...], sub_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """The runs (start, length in elements) of a sub-box of a stored box: docs/format.md section 8."""
    strides = [1] * len(box_shape)
    for a in range(len(box_shape) - 2, -1, -1):
        strides[a] = strides[a + 1] * box_shape[a + 1]
    if sub_shape == box_shape:
        return [(0, math.prod(box_shape))]
    m = max(a for a in range(len(box_shape)) if sub_shape[a] != box_shape[a])
    length = sub_shape[m] * strides[m]
    out = []
    for lead in product(*(range(n) for n in sub_shape[:m])):
        start = sum((rel[a] + lead[a]) * strides[a] for a in range(m)) + rel[m] * strides[m]
        out.append((start, length))
    return out


class Reference:
    """Reads what the checkpoint on disk says, from the format's definition alone."""

    def __init__(self, root: Path, raw: bytes) -> None:
        self.root = root
        self.doc = json.loads(raw)
        self.chunk: int = self.doc["checksum"]["chunk_bytes"]

    def file_bytes(self, index: int) -> bytes:
        entry = self.doc["files"][index]
        path = self.root / entry["path"]
        info = os.lstat(path)
        assert stat.S_ISREG(info.st_mode), f"reshard read {entry['path']!r}, which is not a regular file"
        assert path.resolve().is_relative_to(self.root.resolve()), f"reshard read {path}, outside the checkpoint"
        data = path.read_bytes()
        assert len(data) == entry["size"], f"reshard read {entry['path']!r} whose size is not the metadata's"
        return data

    def stored(self, entry: dict[str, Any]) -> bytes:
        data = self.file_bytes(entry["file"])
        start, length = entry["byte_offset"], entry["byte_length"]
        assert start + length <= len(data)
        return data[start : start + length]

    def tensor_region(self, key: str, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """Region ``offset + shape`` of tensor ``key``, in the stored dtype; checks that the boxes tile it and
        that every checksum chunk a byte run of the region covers whole matches."""
        tensor = self.doc["tensors"][key]
        dtype = DTYPES[tensor["dtype"]]
        out = torch.zeros(shape, dtype=dtype)
        covered = torch.zeros(shape, dtype=torch.int32)
        for box in tensor["boxes"]:
            box_off, box_shape = tuple(box["offset"]), tuple(box["shape"])
            if math.prod(box_shape) == 0:
                continue
            overlap = _intersect(offset, shape, box_off, box_shape)
            if overlap is None:
                continue
            q_off, q_shape = overlap
            data = self.stored(box)
            rel = tuple(q - b for q, b in zip(q_off, box_off, strict=True))
            self._check_chunks(box, data, dtype.itemsize, _runs(box_shape, rel, q_shape), key)
            values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(box_shape)
            src = tuple(slice(r, r + n) for r, n in zip(rel, q_shape, strict=True))
            dst = tuple(slice(q - o, q - o + n) for q, o, n in zip(q_off, offset, q_shape, strict=True))
            out[dst] = values[src]
            covered[dst] += 1
        assert bool((covered == 1).all()), f"reshard loaded {key!r}, whose boxes do not tile the requested region"
        return out

    def _check_chunks(
        self, box: dict[str, Any], data: bytes, itemsize: int, runs: list[tuple[int, int]], key: str
    ) -> None:
        chunk, length = self.chunk, len(data)
        for start, count in runs:
            lo_run, hi_run = start * itemsize, (start + count) * itemsize
            for index in range(-(-lo_run // chunk), len(box["crc32c"])):
                lo, hi = index * chunk, min(index * chunk + chunk, length)
                if hi > hi_run:
                    break
                if SHORT_RUNS_UNVERIFIED and hi - lo < chunk and hi_run - lo_run < chunk:
                    continue
                assert crc32c.crc32c(data[lo:hi]) == box["crc32c"][index], (
                    f"reshard loaded {key!r} without noticing that checksum chunk {index} of its box at "
                    f"{box['offset']} (bytes [{lo}, {hi}), covered whole by a read) does not match"
                )

    def has_cell(self, cell: int) -> bool:
        obj = self.doc["objects"].get("rng")
        return obj is not None and any(e["offset"] == [cell] for e in obj["entries"])

    def blob(self, cell: int) -> bytes:
        entry = next(e for e in self.doc["objects"]["rng"]["entries"] if e["offset"] == [cell])
        data = self.stored(entry)
        for index, expected in enumerate(entry["crc32c"]):
            piece = data[index * self.chunk : (index + 1) * self.chunk]
            assert crc32c.crc32c(piece) == expected, f"reshard decoded object cell {cell} with a checksum mismatch"
        return data


def same_value(a: Any, b: Any) -> bool:
    """Equality that tells types apart (1 from 1.0 and True, tuple from list) and takes NaN as equal."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same_value(k1, k2) and same_value(v1, v2) for (k1, v1), (k2, v2) in zip(a.items(), b.items(), strict=True)
        )
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return bool(a == b)


_SKIP = object()


def plain_common(value: Any) -> Any:
    """A common value of the scalar kinds reshard writes, decoded from tagged JSON; _SKIP for anything else."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict) and len(value) == 1:
        ((tag, payload),) = value.items()
        if tag == "$float" and payload in ("nan", "inf", "-inf"):
            return float(payload)
        if tag == "$bytes" and isinstance(payload, str) and payload.isascii():
            try:
                return base64.b64decode(payload, validate=True)
            except ValueError:
                return _SKIP
    return _SKIP


def _undefined_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    """Conversions whose result C++ leaves undefined for some inputs (no single right answer)."""
    src_float = src.is_floating_point or src.is_complex
    dst_number = dst.is_floating_point or dst.is_complex or dst == torch.bool
    return (src_float and not dst_number) or (src == torch.bool and dst != torch.bool)


def _equal_cast(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.is_complex():
        return _equal_cast(torch.view_as_real(got), torch.view_as_real(expected))
    if got.is_floating_point():
        g, e = got.to(torch.float64), expected.to(torch.float64)
        return bool(((g == e) | (g.isnan() & e.isnan())).all())
    return torch.equal(got, expected)


def check_tensor(got: torch.Tensor, stored: torch.Tensor, want: Want, what: str) -> None:
    assert got.dtype == want.dtype and tuple(got.shape) == want.shape, what
    if stored.dtype == got.dtype == torch.bool:  # bytes other than 0 and 1 (forged) are true: compare truth
        assert torch.equal(_bits(got) != 0, _bits(stored) != 0), f"{what}: not the stored truth values"
        return
    if stored.dtype == got.dtype:
        assert torch.equal(_bits(got), _bits(stored)), f"{what}: not the stored bytes"
        return
    if _undefined_cast(stored.dtype, got.dtype):
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex -> real discards the imaginary part, as reshard's copy does
        expected = stored.to(got.dtype)
    assert _equal_cast(got, expected), f"{what}: not the stored values converted to {got.dtype}"


def check_success(pristine: Pristine, root: Path, raw: bytes | None, template: Template, out: Any) -> None:
    """A load that succeeded returned what the checkpoint on disk says (see the module docstring)."""
    assert raw is not None, "reshard loaded a checkpoint whose metadata.json is gone or is a directory"
    ref = Reference(root, raw)
    saved = pristine.doc
    for i, want in enumerate(template.wants):
        got = out["tensors"][f"t{i}"]
        what = f"tensor {want.key!r} at {list(want.offset)}+{list(want.shape)} as {want.dtype}"
        if want.key not in ref.doc["tensors"]:
            assert not template.strict, f"{what}: loaded although the checkpoint lacks it"
            assert not torch.any(_bits(got)), f"{what}: missing from the checkpoint, yet changed"
            continue
        stored = ref.tensor_region(want.key, want.offset, want.shape)
        check_tensor(got, stored, want, what)
        now, before = ref.doc["tensors"][want.key], saved["tensors"][want.key]
        if template.verify and now["dtype"] == before["dtype"] and now.get("fingerprint") == before["fingerprint"]:
            index = tuple(slice(o, o + n) for o, n in zip(want.offset, want.shape, strict=True))
            assert torch.equal(_bits(got), _bits(TENSORS[want.key][index])), f"{what}: verify=True let a change through"
    for j, cell in enumerate(template.cells):
        if not ref.has_cell(cell):
            assert not template.strict and out["objects"][j] is None, f"object cell {cell} is not in the checkpoint"
            continue
        blob = ref.blob(cell)
        if blob in pristine.blobs:
            expected = OBJECT_VALUES[pristine.blobs.index(blob)]
            assert same_value(out["objects"][j], expected), f"object cell {cell}: {out['objects'][j]!r}"
    for path in template.commons:
        if path not in ref.doc["common"]:
            assert not template.strict and same_value(out[path], template.build()[path]), f"common {path!r}"
            continue
        now_json, saved_json = ref.doc["common"][path], saved["common"][path]
        if json.dumps(now_json, sort_keys=True) == json.dumps(saved_json, sort_keys=True):
            expected = COMMON[path]
        else:
            expected = plain_common(now_json)
            if expected is _SKIP:
                continue
        assert same_value(out[path], expected), f"common {path!r}: {out[path]!r}, expected {expected!r}"


def check_error(exc: BaseException) -> None:
    assert isinstance(exc, reshard.CheckpointError), f"{type(exc).__name__} escaped: {exc}"
    cause = exc.__cause__
    wrapped = type(exc) is reshard.CheckpointError and cause is not None
    if wrapped and not isinstance(cause, OSError | reshard.CheckpointError):
        if any(fragment in str(exc) for fragment in KNOWN_INTERNAL_ERRORS):
            return
        raise AssertionError(f"an internal {type(cause).__name__} reached the caller as a generic error: {exc}")


def timed_load(template: Template, root: Path) -> tuple[Any, reshard.LoadStats, BaseException | None]:
    started = time.monotonic()
    stats = reshard.LoadStats()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out, error = reshard.load(template.build(), root, stats=stats, **template.options(root.parent)), None
    except Exception as exc:
        out, error = None, exc
    elapsed = time.monotonic() - started
    assert elapsed < LOAD_SECONDS, f"a load took {elapsed:.1f} s"
    return out, stats, error


def check_stats(raw: bytes, template: Template, stats: reshard.LoadStats) -> None:
    """README, read accounting: exactly the requested bytes are needed, and merging strided runs reads at
    most max_read_amplification times that."""
    doc = json.loads(raw)
    needed = sum(
        math.prod(w.shape) * DTYPES[doc["tensors"][w.key]["dtype"]].itemsize
        for w in template.wants
        if w.key in doc["tensors"]
    )
    assert stats.bytes_needed == needed, f"bytes_needed {stats.bytes_needed}, the template covers {needed}"
    assert needed <= stats.bytes_read <= template.amplification * needed * (1 + 1e-9), stats


def _declares_huge_sizes(doc: Any) -> bool:
    """Whether a (mutated) document declares a box, blob or file of at least 2**30 bytes."""
    for path in _doc_paths(doc):
        if path[-1] in ("byte_length", "size", "chunk_bytes"):
            value = _get(doc, path)
            if isinstance(value, int) and value >= 2**30:
                return True
    return False


def check_validate(root: Path, doc: Any, whole_error: BaseException | None) -> None:
    """``reshard validate`` never raises, and a checkpoint it passes loads without corruption errors."""
    problems = validate_checkpoint(root)
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems), problems
    if not problems and whole_error is not None:  # what validate checks: presence, sizes, every checksum
        found = isinstance(whole_error, reshard.StorageError) or re.search(
            r"checksum mismatch|truncated|is missing|the metadata says", str(whole_error)
        )
        assert not found, f"validate found nothing, yet a load of every tensor failed: {whole_error!r}"


def run_example(pristine: Pristine, seed: int, atime: bool) -> None:
    """One example, all of whose random choices come from ``seed``."""
    rng = random.Random(seed)
    names = [rng.choice(BENIGN) for _ in range(rng.choice([0, 0, 1, 1, 2]))]
    names += [rng.choice(HOSTILE) for _ in range(rng.choice([0, 1, 1, 1, 2, 2]))]
    templates = [whole_template(verify=rng.random() < 0.5), random_partial_template(rng)]
    top = make_sandbox(pristine)
    try:
        root = top / "ckpt"
        case = Case(top=top, root=root, doc=copy.deepcopy(pristine.doc), rng=rng)
        apply_mutations(case, names)
        raw = case.write_metadata()
        note(f"seed {seed}: mutations {case.notes}")
        inside = snapshot(root)
        outside = snapshot(top, skip="ckpt")
        access = set_access_times_behind(top, skip="ckpt") if atime else {}
        staging = top / "staging"
        errors = []
        for template in templates:
            note(f"template: {template.describe()}")
            out, stats, error = timed_load(template, root)
            errors.append(error)
            if error is not None:
                note(f"error: {type(error).__name__}: {error}")
                check_error(error)
                assert not case.benign, f"a benign change made the load fail: {error!r}"
            else:
                assert raw is not None
                check_success(pristine, root, raw, template, out)
                check_stats(raw, template, stats)
                if template.staging:  # the staged copies are removed after a load (keep=False)
                    left = [p for p in staging.rglob("*") if not p.is_dir()] if staging.exists() else []
                    assert not left, f"staged files left behind: {left}"
            if staging.exists():
                shutil.rmtree(staging)  # the only place outside the checkpoint that a load may write (when asked)
        check_validate(root, case.doc, errors[0])
        for rel, when in access.items():
            assert os.stat(top / rel).st_atime_ns == when, f"a load read {rel}, outside the checkpoint"
        assert snapshot(top, skip="ckpt") == outside, "a load wrote outside the checkpoint"
        assert snapshot(root) == inside, "a load wrote inside the checkpoint"
    finally:
        shutil.rmtree(top)


# --------------------------------------------------------------------------------------------------
# The tests


@pytest.mark.unit
def test_reference_reads_the_pristine_checkpoint(pristine: Pristine) -> None:
    """The oracle is sound: the reference reader and reshard both read back exactly what was saved."""
    raw = (pristine.root / METADATA_FILE).read_bytes()
    ref = Reference(pristine.root, raw)
    for key, tensor in TENSORS.items():
        assert torch.equal(_bits(ref.tensor_region(key, (0,) * tensor.ndim, tensor.shape)), _bits(tensor)), key
    for verify in (False, True):
        template = whole_template(verify=verify)
        out = reshard.load(template.build(), pristine.root, options=reshard.LoadOptions(verify=verify))
        check_success(pristine, pristine.root, raw, template, out)
        for i, want in enumerate(template.wants):
            assert torch.equal(_bits(out["tensors"][f"t{i}"]), _bits(TENSORS[want.key])), want.key
        assert all(same_value(out["objects"][c], OBJECT_VALUES[c]) for c in (0, 1))
        assert all(same_value(out[path], value) for path, value in COMMON.items())


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_mutated_checkpoints_load_correctly_or_raise_checkpoint_error(
    pristine: Pristine, reads_move_access_times: bool
) -> None:
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(seed=st.integers(0, 2**64 - 1))
    def example(seed: int) -> None:
        # Hypothesis supplies reproducible seeds (derandomized); the choices themselves are uniform, which
        # its own draws (biased towards the first option and small numbers) were not.
        run_example(pristine, seed, reads_move_access_times)

    with peak_rss_growth() as grown:
        example()
    assert grown() < FUZZ_RSS_GROWTH, f"the fuzz run's peak memory grew by {grown() / 2**20:.0f} MiB"


# ---- memory bombs


def _bomb_huge_tensor(doc: dict[str, Any], root: Path) -> list[Template]:
    _make_huge_tensor(doc, root, "b")
    huge = (HUGE_ELEMENTS,)
    return [
        Template((Want("b", (0,), (4,), torch.int64, huge),), (), ()),
        Template((Want("b", (HUGE_ELEMENTS - 4,), (4,), torch.int64, huge),), (), ()),
        whole_template(),
    ]


def _bomb_file_size(doc: dict[str, Any], root: Path) -> list[Template]:
    doc["files"][0]["size"] = 2**61
    return [whole_template(), Template((Want("w", (0, 0), (6, 2), torch.float32),), (0,), ())]


def _bomb_huge_object(doc: dict[str, Any], root: Path) -> list[Template]:
    _make_huge_object(doc, root, 0)
    return [Template((), (0,), ()), whole_template()]


def _bomb_byte_length(doc: dict[str, Any], root: Path) -> list[Template]:
    doc["tensors"]["w"]["boxes"][0].update(byte_length=2**60, crc32c=[0])
    doc["checksum"]["chunk_bytes"] = 2**60
    return [whole_template()]


def _bomb_grid(doc: dict[str, Any], root: Path) -> list[Template]:
    doc["objects"]["rng"]["global_shape"] = [2**62, 2**62]
    return [Template((), (0,), ())]


def _bomb_axes(doc: dict[str, Any], root: Path) -> list[Template]:
    doc["tensors"]["d"] = {"dtype": "float64", "global_shape": [2**62] * 64, "boxes": []}
    return [whole_template()]


BOMBS: dict[str, Callable[[dict[str, Any], Path], list[Template]]] = {
    "tensor_of_2**59_elements": _bomb_huge_tensor,
    "file_size_2**61": _bomb_file_size,
    "object_blob_of_2**61_bytes": _bomb_huge_object,
    "byte_length_2**60": _bomb_byte_length,
    "object_grid_2**124_cells": _bomb_grid,
    "global_shape_64_axes_of_2**62": _bomb_axes,
}


@pytest.mark.unit
@pytest.mark.parametrize("name", list(BOMBS))
def test_memory_bombs_fail_before_allocating(pristine: Pristine, name: str) -> None:
    top = make_sandbox(pristine)
    try:
        root = top / "ckpt"
        doc = copy.deepcopy(pristine.doc)
        templates = BOMBS[name](doc, root)
        write_doc(root / METADATA_FILE, doc)
        for template in templates:
            with peak_rss_growth() as grown:
                started = time.monotonic()
                with pytest.raises(reshard.CheckpointError) as info:
                    reshard.load(template.build(), root)
                elapsed = time.monotonic() - started
            assert isinstance(info.value, reshard.CorruptCheckpointError | reshard.MismatchError), info.value
            assert not isinstance(info.value.__cause__, MemoryError), info.value
            assert grown() < BOMB_RSS_GROWTH, f"{template.describe()}: peak memory grew by {grown() / 2**20:.0f} MiB"
            assert elapsed < LOAD_SECONDS
    finally:
        shutil.rmtree(top)


def _sparse_checkpoint(root: Path, shape: tuple[int, ...], chunk: int) -> None:
    """A valid checkpoint of one float32 tensor of zeros whose data file is sparse (no disk blocks)."""
    nbytes = math.prod(shape) * 4
    (root / "data").mkdir(parents=True)
    name = "data/0123456789abcdef0123456789abcdef-r00000.bin"
    with open(root / name, "wb") as f:
        f.truncate(nbytes)
    zeros = bytes(8 * 2**20)
    crcs = []
    for start in range(0, nbytes, chunk):
        value, left = 0, min(chunk, nbytes - start)
        while left:
            piece = min(left, len(zeros))
            value = crc32c.crc32c(zeros[:piece], value)
            left -= piece
        crcs.append(value)
    box = {"offset": [0] * len(shape), "shape": list(shape), "file": 0, "byte_offset": 0, "byte_length": nbytes}
    doc = {
        "format": "reshard",
        "version": 1,
        "save_id": "0123456789abcdef0123456789abcdef",
        "created_by": "tests/metadata/test_fuzz.py",
        "world_size": 1,
        "checksum": {"algorithm": "crc32c", "chunk_bytes": chunk},
        "files": [{"path": name, "size": nbytes}],
        "tensors": {"big": {"dtype": "float32", "global_shape": list(shape), "boxes": [dict(box, crc32c=crcs)]}},
        "objects": {},
        "common": {},
    }
    write_doc(root / METADATA_FILE, doc)


HUGE_SHAPE = (2**13, 2**14)  # 512 MiB of float32


def _huge_templates(what: str) -> dict[str, Any]:
    if what == "contiguous":
        return {"big": reshard.ShardedTensor("big", torch.ones(4, 2**14), HUGE_SHAPE, (5, 0))}
    if what == "row_piece":
        return {"big": reshard.ShardedTensor("big", torch.ones(1, 100), HUGE_SHAPE, (7, 9))}
    if what == "strided":
        return {"big": reshard.ShardedTensor("big", torch.ones(64, 8), HUGE_SHAPE, (100, 1000))}
    # 80 pieces of one key, 400 bytes each, 100 rows (6.25 MiB) apart: in 80 different 4 MiB chunks
    return {f"p{i}": reshard.ShardedTensor("big", torch.ones(1, 100), HUGE_SHAPE, (100 * i, 9)) for i in range(80)}


MiB4 = 4 * 2**20


@pytest.mark.unit
@pytest.mark.parametrize(
    ("chunk", "what"),
    [
        pytest.param(MiB4, "contiguous", id="chunk_4MiB-contiguous"),
        pytest.param(MiB4, "row_piece", id="chunk_4MiB-row_piece"),
        pytest.param(MiB4, "strided", id="chunk_4MiB-strided"),
        pytest.param(2**62, "strided", id="chunk_2**62-strided"),
        pytest.param(MiB4, "many_pieces", id="chunk_4MiB-80_pieces"),
        pytest.param(2**62, "contiguous", id="chunk_2**62-contiguous"),
        pytest.param(2**62, "row_piece", id="chunk_2**62-row_piece"),
    ],
)
def test_small_reads_of_a_huge_tensor_stay_small(tmp_path: Path, chunk: int, what: str) -> None:
    """A valid checkpoint of a 512 MiB tensor (a sparse file): small reads of it cost little memory, whatever
    the checksum chunk size (README: a load's extra memory is bounded by memory_budget_bytes, 32 MiB)."""
    _sparse_checkpoint(tmp_path / "ckpt", HUGE_SHAPE, chunk)
    template = _huge_templates(what)
    with peak_rss_growth() as grown:
        out = reshard.load(template, tmp_path / "ckpt")
    assert not any(t.any() for t in out.values())
    assert grown() < BOMB_RSS_GROWTH, f"{what}: peak memory grew by {grown() / 2**20:.0f} MiB"


# --------------------------------------------------------------------------------------------------
# Bugs found by the fuzzer, pinned until fixed


def _small_checkpoint(path: Path, **save_options: Any) -> dict[str, Any]:
    reshard.save({"w": torch.arange(24.0).reshape(4, 6)}, path, options=reshard.SaveOptions(**save_options))
    return read_doc(path)


@pytest.mark.unit
def test_box_at_an_offset_not_a_multiple_of_its_itemsize_loads_resharded(tmp_path: Path) -> None:
    doc = _small_checkpoint(tmp_path)
    data = tmp_path / doc["files"][0]["path"]
    data.write_bytes(b"\x00\x00" + data.read_bytes())  # every box moves 2 bytes later
    doc["tensors"]["w"]["boxes"][0]["byte_offset"] += 2
    doc["files"][0]["size"] += 2
    write_doc(tmp_path / METADATA_FILE, doc)
    assert torch.equal(reshard.load({"w": torch.zeros(4, 6)}, tmp_path)["w"], torch.arange(24.0).reshape(4, 6))
    template = {"w": reshard.ShardedTensor("w", torch.zeros(4, 3), (4, 6), (0, 3))}
    assert torch.equal(reshard.load(template, tmp_path)["w"], torch.arange(24.0).reshape(4, 6)[:, 3:])


@pytest.mark.unit
@pytest.mark.parametrize("case", ["strided_short_last_chunk", "cast_of_a_box_smaller_than_a_chunk"])
def test_every_chunk_a_mapped_read_covers_is_verified(tmp_path: Path, case: str) -> None:
    doc = _small_checkpoint(tmp_path, checksum_chunk_bytes=40)  # chunks [0, 40), [40, 80), [80, 96) of w
    data = tmp_path / doc["files"][0]["path"]
    raw = bytearray(data.read_bytes())
    raw[doc["tensors"]["w"]["boxes"][0]["byte_offset"] + 90] ^= 0x40  # element [3, 4]
    data.write_bytes(bytes(raw))
    if case == "strided_short_last_chunk":  # runs [56, 72) and [80, 96): the second covers chunk 2 whole
        template: Any = reshard.ShardedTensor("w", torch.zeros(2, 4), (4, 6), (2, 2))
    else:
        reshard.save({"w": torch.arange(24.0).reshape(4, 6)}, tmp_path / "small")  # 96 bytes, one 4 MiB chunk
        doc = read_doc(tmp_path / "small")
        data = tmp_path / "small" / doc["files"][0]["path"]
        raw = bytearray(data.read_bytes())
        raw[doc["tensors"]["w"]["boxes"][0]["byte_offset"] + 90] ^= 0x40
        data.write_bytes(bytes(raw))
        tmp_path = tmp_path / "small"
        template = torch.zeros(4, 6, dtype=torch.float64)  # the whole box, converted from float32
    with pytest.raises(reshard.CorruptCheckpointError, match="checksum mismatch"):
        reshard.load({"w": template}, tmp_path)


def _load_in_thread(path: Path, template: dict[str, Any], fifo: Path) -> tuple[bool, str]:
    """Load in a thread; if it is still blocked after 2 s, open the FIFO's other end to release it."""
    outcome: list[str] = []

    def run() -> None:
        try:
            reshard.load(template, path)
            outcome.append("loaded")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(2)
    hung = thread.is_alive()
    for _ in range(40):
        if not thread.is_alive():
            break
        with contextlib.suppress(OSError):  # ENXIO: nobody has the FIFO open for reading (yet)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(0.5)
    return not hung, outcome[0] if outcome else ""


@pytest.mark.unit
@pytest.mark.parametrize("which", ["metadata", "data", "lock"])
def test_a_fifo_in_the_checkpoint_does_not_hang_a_load(tmp_path: Path, which: str) -> None:
    reshard.save({"w": torch.ones(2), "o": reshard.ShardedObject("o", 1, (1,), (0,))}, tmp_path)
    doc = read_doc(tmp_path)
    template: dict[str, Any] = {"w": torch.zeros(2)}
    if which == "metadata":
        fifo = tmp_path / METADATA_FILE
        fifo.unlink()
    elif which == "lock":
        (tmp_path / METADATA_FILE).unlink()
        fifo = tmp_path / LOCK_FILE
    else:
        fifo = tmp_path / "data" / "fifo.bin"
        doc["files"].append({"path": "data/fifo.bin", "size": 0})
        doc["objects"]["o"]["entries"][0].update(file=1, byte_offset=0, byte_length=0, crc32c=[])
        write_doc(tmp_path / METADATA_FILE, doc)
        template = {"o": reshard.ShardedObject("o", None, (1,), (0,))}
    os.mkfifo(fifo)
    finished, outcome = _load_in_thread(tmp_path, template, fifo)
    assert finished, f"the load blocked on the FIFO {fifo.name} (released after 2 s: {outcome})"
    assert outcome.startswith(("CorruptCheckpointError", "StorageError", "IncompleteCheckpointError")), outcome


@pytest.mark.unit
def test_a_symlinked_data_directory_is_not_followed(tmp_path: Path) -> None:
    _small_checkpoint(tmp_path / "ckpt")
    shutil.move(tmp_path / "ckpt" / "data", tmp_path / "elsewhere")
    (tmp_path / "ckpt" / "data").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(reshard.CheckpointError):
        reshard.load({"w": torch.zeros(4, 6)}, tmp_path / "ckpt")


@pytest.mark.unit
def test_a_symlinked_metadata_file_is_not_followed(tmp_path: Path) -> None:
    _small_checkpoint(tmp_path / "ckpt")
    shutil.move(tmp_path / "ckpt" / METADATA_FILE, tmp_path / "elsewhere.json")
    (tmp_path / "ckpt" / METADATA_FILE).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(reshard.CheckpointError):
        reshard.load({"w": torch.zeros(4, 6)}, tmp_path / "ckpt")


@pytest.mark.unit
def test_unencodable_file_name_is_corrupt_metadata(tmp_path: Path) -> None:
    doc = _small_checkpoint(tmp_path)
    doc["files"][0]["path"] = "data/\ud800.bin"
    write_doc(tmp_path / METADATA_FILE, doc)
    with pytest.raises(reshard.CorruptCheckpointError, match=re.escape("files[0].path")):
        reshard.read_metadata(tmp_path)


@pytest.mark.unit
def test_overflowing_float_literal_is_refused(tmp_path: Path) -> None:
    doc = _small_checkpoint(tmp_path)
    text = unseal(dumps(doc)).replace(b'"common":{}', b'"common":{"lr":1e400}')
    assert b"1e400" in text
    (tmp_path / METADATA_FILE).write_bytes(seal(text))
    with pytest.raises(reshard.CorruptCheckpointError):
        reshard.read_metadata(tmp_path)


@pytest.mark.unit
@pytest.mark.parametrize("bomb", ["object_blob_of_2**61_bytes", "tensor_of_2**59_elements"])
def test_validate_refuses_absurd_sizes_without_allocating(pristine: Pristine, bomb: str) -> None:
    top = make_sandbox(pristine)
    try:
        root = top / "ckpt"
        doc = copy.deepcopy(pristine.doc)
        BOMBS[bomb](doc, root)
        write_doc(root / METADATA_FILE, doc)
        with peak_rss_growth() as grown:
            problems = validate_checkpoint(root)
        assert any("the metadata says 4611686018427387904" in p for p in problems), problems
        assert grown() < BOMB_RSS_GROWTH
    finally:
        shutil.rmtree(top)


@pytest.mark.unit
def test_validate_handles_large_checksum_chunks(tmp_path: Path) -> None:
    """A valid checkpoint with one checksum chunk per box (chunk_bytes 2**62): validate reads by box, it does
    not allocate chunk_bytes (a bug found by the fuzzer, fixed in 9a45442)."""
    _small_checkpoint(tmp_path, checksum_chunk_bytes=2**62)
    assert torch.equal(reshard.load({"w": torch.zeros(4, 6)}, tmp_path)["w"], torch.arange(24.0).reshape(4, 6))
    assert validate_checkpoint(tmp_path) == []
