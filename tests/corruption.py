"""Seeded corruption of a committed checkpoint, and the tools run on it: "error or exact, never wrong".

A *pristine* checkpoint of two data files (two ranks, every leaf kind) is copied and damaged by one seeded
corruption: a bit flip (anywhere in a data file, inside a stored box, in ``metadata.json``), a truncation,
a deletion, two data files swapped, two byte ranges of a file swapped, a data file replaced by another
save's, ``metadata.json`` replaced by another save's. Then every tool that reads a checkpoint runs on the
damaged copy, each in this process:

- ``load`` of the whole state, and of three resharded templates (rows that span both files, a column
  block, a flat range);
- ``reshard validate`` (API), ``reshard inspect`` (command line);
- ``export_safetensors`` (read back with the ``safetensors`` library), ``convert_checkpoint`` (the copy
  loaded), ``diff_checkpoints`` against the pristine checkpoint.

Each run must either raise a reshard error (or, for the command line, exit with code 1 or 3 and one line)
or give exactly the pristine values; ``validate`` must pass only a checkpoint that then loads exactly. A run
that returns other values is *silent*; any other exception is a *violation*.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.rankpool import RankContext, RankPool

ROWS, COLS = 8, 48
CHUNK = 512


def pristine_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4242)
    return {
        "w": torch.randn(2 * ROWS, COLS, generator=g),
        "e": torch.randn(6, 2 * 10, generator=g).to(torch.bfloat16),
        "bias": torch.randint(-(2**50), 2**50, (11,), generator=g, dtype=torch.int64),
        "scale": torch.tensor(0.125, dtype=torch.float64),
    }


def rank_state(rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the two saves (rows of w, columns of e; the rest written by rank 0)."""
    import reshard

    full = pristine_tensors()
    return {
        "w": reshard.ShardedTensor.from_rank_offsets(
            "w", full["w"][rank * ROWS : (rank + 1) * ROWS].clone(), (0, rank, 2)
        ),
        "e": reshard.ShardedTensor.from_rank_offsets(
            "e", full["e"][:, rank * 10 : (rank + 1) * 10].clone(), (1, rank, 2)
        ),
        "bias": full["bias"].clone(),
        "scale": full["scale"].clone(),
        "rng": reshard.ShardedObject("rng", {"rank": rank, "state": torch.arange(5) + rank}, (2,), (rank,)),
        "iteration": 77,
    }


def templates() -> dict[str, Callable[[], dict[str, Any]]]:
    """The loads every corruption is tried with: name -> a fresh template."""
    import reshard

    def whole() -> dict[str, Any]:
        return {
            "w": torch.zeros(2 * ROWS, COLS),
            "e": torch.zeros(6, 20, dtype=torch.bfloat16),
            "bias": torch.zeros(11, dtype=torch.int64),
            "scale": torch.tensor(0.0, dtype=torch.float64),
            "rng": [reshard.ShardedObject("rng", None, (2,), (r,)) for r in range(2)],
            "iteration": 0,
        }

    def spanning_rows() -> dict[str, Any]:  # rows [3, 13) of w: both files, both cut inside a chunk
        return {"w": reshard.ShardedTensor("w", torch.zeros(10, COLS), (2 * ROWS, COLS), (3, 0))}

    def columns() -> dict[str, Any]:  # a strided block of w, converted, and of e across its column split
        return {
            "w": reshard.ShardedTensor("w", torch.zeros(2 * ROWS, 7, dtype=torch.float64), (2 * ROWS, COLS), (0, 20)),
            "e": reshard.ShardedTensor("e", torch.zeros(6, 4, dtype=torch.bfloat16), (6, 20), (0, 8)),
        }

    def flat() -> dict[str, Any]:  # a ZeRO-style flat range of w
        return {
            "w": reshard.ShardedTensor.from_flat_range(
                "w", torch.zeros(300), (2 * ROWS, COLS), (2 * ROWS, COLS), (0, 0), 100, 400
            )
        }

    return {"whole": whole, "spanning_rows": spanning_rows, "columns": columns, "flat": flat}


def expected(name: str, loaded: dict[str, Any]) -> bool:
    """Whether ``loaded`` (from template ``name``) holds exactly the pristine values."""
    full = pristine_tensors()

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
        )

    if name == "whole":
        rng_ok = all(
            isinstance(v, dict) and v.get("rank") == r and torch.equal(v.get("state"), torch.arange(5) + r)
            for r, v in enumerate(loaded["rng"])
        )
        return all(same(loaded[k], full[k]) for k in full) and loaded["iteration"] == 77 and rng_ok
    if name == "spanning_rows":
        return same(loaded["w"], full["w"][3:13])
    if name == "columns":
        return same(loaded["w"], full["w"][:, 20:27].to(torch.float64)) and same(loaded["e"], full["e"][:, 8:12])
    return same(loaded["w"], full["w"].reshape(-1)[100:400])


def _save_rank(rank: int, path: str, generation: int, port: int) -> None:
    import datetime
    import os

    import torch.distributed as dist

    import reshard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    options = reshard.SaveOptions(checksum_chunk_bytes=CHUNK)
    reshard.save(_generation_state(rank, generation), path, timeout=60, options=options)
    dist.destroy_process_group()


def _generation_state(rank: int, generation: int) -> dict[str, Any]:
    """What rank ``rank`` saves: the pristine state (generation 0), or another save's (``w`` changed)."""
    state = rank_state(rank)
    if generation:
        state = {
            k: (v.__class__(v.key, v.data + 1, v.global_shape, v.global_offset) if k == "w" else v)
            for k, v in state.items()
        }
    return state


def rank_save_pristine(ctx: RankContext, path: str, generation: int) -> None:
    """In a rank of a pool: ranks 0 and 1 (the pool's ``first2`` group) save what :func:`_save_rank` saves."""
    import reshard

    group, member = ctx.group_of_size(2)
    if member:
        options = reshard.SaveOptions(checksum_chunk_bytes=CHUNK)
        reshard.save(_generation_state(ctx.rank, generation), path, group=group, timeout=60, options=options)


def make_pristine(path: Path, other: Path) -> None:
    """The pristine checkpoint (two ranks, two data files) at ``path``, and at ``other`` another save of
    the same layout with other values of ``w``. Two spawned processes each."""
    import socket

    import torch.multiprocessing as mp

    for target, generation in ((path, 0), (other, 1)):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(_save_rank, args=(str(target), generation, port), nprocs=2, start_method="spawn")


def make_pristine_in(pool: RankPool, path: Path, other: Path) -> None:
    """:func:`make_pristine` on the first two ranks of a running ``pool`` (the same two saves, by two ranks of a
    two-rank group, without spawning two pairs of processes)."""
    for target, generation in ((path, 0), (other, 1)):
        pool.run_ok(rank_save_pristine, str(target), generation)


# ---- corruptions ---------------------------------------------------------------------------------------


@dataclass
class Damage:
    """One corruption applied to a copy: what it did, for the report."""

    kind: str
    detail: str = ""
    benign: bool = False
    """The change cannot alter any value (a flip in alignment padding): the tools must succeed."""


def _data_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "data").iterdir() if p.is_file())


def _stored_ranges(doc: dict[str, Any]) -> dict[int, list[tuple[int, int]]]:
    ranges: dict[int, list[tuple[int, int]]] = {}
    for tensor in doc["tensors"].values():
        for box in tensor.get("boxes", []):
            ranges.setdefault(box["file"], []).append((box["byte_offset"], box["byte_offset"] + box["byte_length"]))
    for obj in doc["objects"].values():
        for entry in obj["entries"]:
            ranges.setdefault(entry["file"], []).append(
                (entry["byte_offset"], entry["byte_offset"] + entry["byte_length"])
            )
    return ranges


def corrupt(root: Path, other: Path, rng: random.Random) -> Damage:
    """Apply one seeded corruption to the checkpoint at ``root`` (``other``: another save of the same
    layout, with other values)."""
    from tests.metadata_docs import read_doc

    doc = read_doc(root)
    files = _data_files(root)
    kind = rng.choice(
        [
            "data_flip",
            "data_flip",
            "box_flip",
            "box_flip",
            "metadata_flip",
            "metadata_flip",
            "metadata_byte",
            "data_truncate",
            "metadata_truncate",
            "data_delete",
            "metadata_delete",
            "data_swap_files",
            "data_swap_ranges",
            "data_from_other_save",
            "metadata_from_other_save",
            "data_zero_range",
        ]
    )
    if kind in ("data_flip", "box_flip"):
        target = rng.choice(files)
        raw = bytearray(target.read_bytes())
        index = next(i for i, f in enumerate(doc["files"]) if (root / f["path"]) == target)
        stored = _stored_ranges(doc).get(index, [])
        if kind == "box_flip" and stored:
            lo, hi = rng.choice(stored)
            at = rng.randrange(lo, hi)
        else:
            at = rng.randrange(len(raw))
        bit = rng.randrange(8)
        raw[at] ^= 1 << bit
        target.write_bytes(bytes(raw))
        benign = not any(lo <= at < hi for lo, hi in stored)
        return Damage(kind, f"{target.name} byte {at} bit {bit}", benign=benign)
    if kind in ("metadata_flip", "metadata_byte"):
        target = root / "metadata.json"
        raw = bytearray(target.read_bytes())
        at = rng.randrange(len(raw))
        before = raw[at]
        if kind == "metadata_flip":
            raw[at] ^= 1 << rng.randrange(8)
        else:
            raw[at] = rng.choice(b'0123456789,:{}[]" ')
        target.write_bytes(bytes(raw))
        return Damage(kind, f"byte {at}", benign=raw[at] == before)
    if kind in ("data_truncate", "metadata_truncate"):
        target = rng.choice(files) if kind == "data_truncate" else root / "metadata.json"
        size = target.stat().st_size
        keep = rng.randrange(size)
        with open(target, "r+b") as f:
            f.truncate(keep)
        return Damage(kind, f"{target.name} to {keep} of {size} bytes")
    if kind == "data_delete":
        target = rng.choice(files)
        target.unlink()
        return Damage(kind, target.name)
    if kind == "metadata_delete":
        (root / "metadata.json").unlink()
        return Damage(kind)
    if kind == "data_swap_files":
        a, b = files[0], files[1]
        data_a, data_b = a.read_bytes(), b.read_bytes()
        a.write_bytes(data_b)
        b.write_bytes(data_a)
        return Damage(kind, f"{a.name} <-> {b.name}")
    if kind in ("data_swap_ranges", "data_zero_range"):
        target = rng.choice(files)
        raw = bytearray(target.read_bytes())
        length = rng.randint(1, max(1, len(raw) // 4))
        x = rng.randrange(0, len(raw) - length + 1)
        if kind == "data_zero_range":
            before = bytes(raw[x : x + length])
            raw[x : x + length] = bytes(length)
            target.write_bytes(bytes(raw))
            return Damage(kind, f"{target.name} [{x}, {x + length})", benign=before == bytes(length))
        y = rng.randrange(0, len(raw) - length + 1)
        before = bytes(raw)
        raw[x : x + length], raw[y : y + length] = raw[y : y + length], raw[x : x + length]
        target.write_bytes(bytes(raw))
        return Damage(kind, f"{target.name} [{x}, +{length}) <-> [{y}, +{length})", benign=bytes(raw) == before)
    if kind == "data_from_other_save":
        target = rng.choice(files)
        source = _data_files(other)[files.index(target)]
        shutil.copyfile(source, target)
        return Damage(kind, f"{target.name} <- {source.name}")
    shutil.copyfile(other / "metadata.json", root / "metadata.json")
    return Damage(kind)


# ---- the tools -----------------------------------------------------------------------------------------


@dataclass
class Runs:
    """The outcome of every tool run on one damaged copy."""

    damage: Damage
    results: dict[str, str] = field(default_factory=dict)
    """Tool -> 'exact', 'error' (a reshard error), 'silent' (other values) or 'violation: ...'."""

    @property
    def silent(self) -> list[str]:
        return [t for t, r in self.results.items() if r == "silent"]

    @property
    def violations(self) -> list[str]:
        return [f"{t}: {r}" for t, r in self.results.items() if r.startswith("violation")]


def _attempt(runs: Runs, tool: str, fn: Callable[[], bool]) -> None:
    import reshard

    try:
        runs.results[tool] = "exact" if fn() else "silent"
    except reshard.CheckpointError:
        runs.results[tool] = "error"
    except Exception as exc:  # anything else escaping is a finding
        runs.results[tool] = f"violation: {type(exc).__name__}: {exc}"


def run_tools(root: Path, pristine: Path, scratch: Path, damage: Damage) -> Runs:
    """Every tool on the damaged checkpoint at ``root`` (``scratch``: an empty directory for outputs)."""
    import reshard
    from reshard.flows.maintenance import validate_checkpoint
    from reshard.interop import convert_checkpoint, diff_checkpoints, export_safetensors

    runs = Runs(damage)
    for name, build in templates().items():
        _attempt(runs, f"load:{name}", lambda n=name, b=build: expected(n, reshard.load(b(), root)))

    def validate() -> bool:
        problems = validate_checkpoint(root)
        if problems:
            raise reshard.CorruptCheckpointError(problems[0])
        return all(r == "exact" for t, r in runs.results.items() if t.startswith("load:"))

    _attempt(runs, "validate", validate)

    def inspect() -> bool:
        from reshard.cli import main

        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = main(["inspect", str(root)])
        if code == 3 and err.getvalue().count("\n") == 1:
            raise reshard.CorruptCheckpointError(err.getvalue())
        if code != 0:
            raise AssertionError(f"inspect exited {code}: {err.getvalue()!r}")
        return True

    _attempt(runs, "inspect", inspect)

    def export() -> bool:
        from safetensors.torch import load_file

        export_safetensors(root, scratch / "hf")
        tensors: dict[str, torch.Tensor] = {}
        for path in sorted((scratch / "hf").glob("*.safetensors")):
            tensors.update(load_file(str(path)))
        full = pristine_tensors()
        return set(tensors) == set(full) and all(torch.equal(tensors[k], full[k]) for k in full)

    _attempt(runs, "export", export)

    def convert() -> bool:
        convert_checkpoint(root, scratch / "converted")
        return expected("whole", reshard.load(templates()["whole"](), scratch / "converted"))

    _attempt(runs, "convert", convert)

    def diff() -> bool:
        report = diff_checkpoints(root, pristine)
        if not report.ok:
            raise reshard.CorruptCheckpointError(f"diff found {report.problems} differences")
        return all(r == "exact" for t, r in runs.results.items() if t.startswith("load:"))

    _attempt(runs, "diff", diff)
    if runs.damage.benign:
        for tool, result in runs.results.items():
            if result != "exact":
                runs.results[tool] = f"violation: a change that alters no value made {tool} give {result}"
    return runs


def summarize(all_runs: list[Runs]) -> dict[str, Any]:
    results = [r for runs in all_runs for r in runs.results.values()]
    return {
        "corruptions": len(all_runs),
        "tool_runs": len(results),
        "exact": sum(r == "exact" for r in results),
        "refused": sum(r == "error" for r in results),
        "silent": sum(r == "silent" for r in results),
        "violations": sum(r.startswith("violation") for r in results),
        "by_kind": {
            k: sum(1 for r in all_runs if r.damage.kind == k) for k in sorted({r.damage.kind for r in all_runs})
        },
        "failures": [
            {"damage": vars(r.damage), "silent": r.silent, "violations": r.violations}
            for r in all_runs
            if r.silent or r.violations
        ][:20],
    }


def dumps(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2)
