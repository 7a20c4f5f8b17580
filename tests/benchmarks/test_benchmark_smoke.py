"""Keeps ``benchmarks/compare.py`` working: a tiny run (a few MiB, one repetition, 2 ranks) of every system in
warm processes, and of the cold-start mode (fresh processes per operation), with the JSON report checked for
its structure and for positive figures.

Megatron-Core is an optional benchmark extra: when it is not installed the benchmark skips it (and says so in
the report), and so does this test."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "compare.py"


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


def _tc_installed() -> bool:
    try:
        return importlib.util.find_spec("torch_checkpointing") is not None
    except ImportError:
        return False


def _tiny_compare(ckpt_dir: Path, out: Path, *options: str) -> list[str]:
    """benchmarks/compare.py at 4 MiB, one repetition, checkpoints in ``ckpt_dir``, the JSON report in ``out``."""
    return [
        sys.executable,
        str(SCRIPT),
        "--size-gib",
        "0.004",
        "--repeat",
        "1",
        *options,
        "--dir",
        str(ckpt_dir),
        "--json",
        str(out),
    ]


@pytest.mark.timeout(180)
def test_compare_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    ckpt_dir = tmp_path / "ckpt"
    command = _tiny_compare(
        ckpt_dir,
        out,
        *("--ranks", "2", "--load-world", "1", "--dp-replicas", "--mode", "warm"),
        *("--gc", "none", "--targets", "untouched"),  # the first checkpoint after a restart, into to_empty targets
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=170, cwd=tmp_path, env=env)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "ratio" in proc.stdout  # the human-readable table was printed

    report = json.loads(out.read_text())
    for key in ("config", "machine", "state", "phases", "accounting", "ratios", "notes", "skipped"):
        assert key in report, key
    assert report["config"]["ranks"] == 2
    assert (report["config"]["gc"], report["config"]["targets"]) == ("none", "untouched")
    assert report["state"]["bytes"] > 0

    expected = [
        "limit.write",
        "limit.read",
        "limit.read_fresh",
        "limit.memcpy",
        "limit.crc32c",
        "reshard.save",
        "reshard.load_same",
        "reshard.load_axis",
        "reshard.load_world",
        "reshard.async_first",
        "reshard.async",
        "dcp.save",
        "dcp.load_same",
        "dcp.load_axis",
        "dcp.load_world",
        "torch.save",
        "torch.load",
        "dp.limit.write",
        "dp.reshard.save",
        "dp.dcp.save",
    ]
    megatron = ["megatron.save", "megatron.load_same", "megatron.load_axis", "megatron.load_world", "dp.megatron.save"]
    if "megatron" in report["skipped"]:  # an optional extra: skipped, with the reason, when it cannot be used
        assert "megatron-core" in report["skipped"]["megatron"]
        assert not set(megatron) & set(report["phases"])
    else:
        assert _megatron_installed()
        expected += megatron
    if not _megatron_installed():
        assert "megatron" in report["skipped"]
    tc = ["tc.save", "tc.load_same", "tc.load_axis", "tc.load_world", "tc.async_first", "tc.async"]
    if "tc" in report["skipped"]:  # torch_checkpointing: the bench extra, skipped with the reason without it
        assert "torch-checkpointing" in report["skipped"]["tc"]
        assert not set(tc) & set(report["phases"])
    else:
        assert _tc_installed()
        expected += tc
    phases = report["phases"]
    assert set(expected) <= set(phases), sorted(set(expected) - set(phases))

    for name, phase in phases.items():
        ranks = 4 if name.startswith("dp.") else (1 if name.endswith("load_world") else 2)
        assert phase["ranks"] == ranks, name
        assert phase["seconds_median"] > 0, name
        assert len(phase["seconds_all"]) == 1, name
        assert phase["gb_per_s"] > 0, name
        assert len(phase["peak_rss_extra_per_rank"]) == ranks, name
        assert all(v >= 0 for v in phase["peak_rss_extra_per_rank"]), name
        if ".load" in name:
            assert all(v > 0 for v in phase["bytes_needed_per_rank"]), name
            assert all(v > 0 for v in phase["bytes_read_per_rank"]), name
    for name in ("reshard.load_same", "reshard.load_axis", "reshard.load_world"):
        phase = phases[name]
        assert phase["bytes_needed_per_rank_reshard"] == phase["bytes_needed_per_rank"], name
        read, needed = phase["bytes_read_per_rank_reshard"], phase["bytes_needed_per_rank"]
        assert all(r >= n for r, n in zip(read, needed, strict=True)), name
    assert phases["reshard.async"]["block_seconds_median"] > 0
    if "tc" not in report["skipped"]:
        assert phases["tc.async"]["block_seconds_median"] > 0

    # Read accounting of the resharded loads, per kind of change; an axis-0 change reads exactly what it needs.
    assert {"load_axis", "load_world"} <= set(report["accounting"])
    for groups in report["accounting"].values():
        for stats in groups.values():
            assert stats["bytes_needed"] > 0
            assert stats["bytes_read"] >= stats["bytes_needed"]
    axis0 = report["accounting"]["load_axis"]["axis1->axis0"]
    assert axis0["bytes_read"] == axis0["bytes_needed"]

    for name in ("reshard.save", "reshard.load_same", "reshard.load_axis"):  # reshard's own phase clock
        parts = phases[name]["reshard_phases_median"]
        assert parts["total"] > 0 and all(v >= 0 for v in parts.values()), name
        assert all(v <= parts["total"] for v in parts.values()), name  # each phase is part of the whole
    ratios = {row["name"]: row for row in report["ratios"]}
    for name in (
        "save: reshard GB/s / fsync'ed write GB/s",
        "load same: reshard time / DCP time",
        "load same: reshard GB/s / page-cache read GB/s",
        "async: blocking time / memcpy of the state",
        "async: blocking time / synchronous save",
        "DP=2 save: reshard time / DCP time",
    ):
        row = ratios[f"warm: {name}"]
        assert row["value"] is not None and math.isfinite(row["value"]) and row["value"] > 0, name
        assert row["target"] is not None and row["pass"] in (True, False), name
    best = [row for row in report["ratios"] if "best peer's time" in row["name"]]  # issue 35's targets
    assert {row["name"].split(":")[1].strip() for row in best} == {"save", "load_same", "load_axis", "load_world"}
    assert all(row["pass"] in (True, False) and row["value"] > 0 for row in best)
    floors = [row for row in report["ratios"] if "the machine's floor" in row["name"]]  # what a target can ask
    assert {row["name"].split(":")[1].strip() for row in floors} == {"save", "load_same", "load_axis"}
    assert all(row["value"] > 0 and row["target"] is None for row in floors)
    # The floor of a load that verifies what it uses: at least the plain floor, more where whole chunks are
    # verified beyond the bytes used (the axis flip); and reshard's distance from it.
    with_checks = [row for row in report["ratios"] if "checks (read + CRC" in row["name"]]
    checked = {row["name"].split(":")[1].strip(): row for row in with_checks}
    assert set(checked) == {"load_same", "load_axis"}
    for phase, row in checked.items():
        plain = next(r for r in floors if r["name"].split(":")[1].strip() == phase)
        assert row["value"] > plain["value"] and row["target"] is None, phase
        above = ratios[f"warm: {phase}: reshard time / the floor with reshard's checks"]
        assert above["value"] > 0, phase
    if "tc" not in report["skipped"]:
        assert ratios["warm: save: reshard time / torch_checkpointing time"]["value"] > 0


@pytest.mark.timeout(180)
def test_torch_checkpointing_loads_every_checkpoint_its_synchronous_manager_saved(tmp_path: Path) -> None:
    """torch-checkpointing 0.1.1's synchronous saver writes the distributed metadata only in a manager's first
    checkpoint unless its metadata cache is off (benchmarks/tc_system.py): the warm mode's second repetition saves
    again with the same manager and loads that checkpoint into another layout, which failed with a shape mismatch."""
    pytest.importorskip("torch_checkpointing")
    out = tmp_path / "report.json"
    command = _tiny_compare(tmp_path / "ckpt", out, "--repeat", "2", "--mode", "warm", "--systems", "tc")
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    for phase in ("tc.save", "tc.load_same", "tc.load_axis", "tc.load_world"):
        assert len(report["phases"][phase]["seconds_all"]) == 2, phase  # the second: a second checkpoint
    assert any("metadata cache off" in note for note in report["notes"])


@pytest.mark.timeout(240)
def test_compare_cold_start_mode_runs_at_a_tiny_size(tmp_path: Path) -> None:
    """``--mode cold``: every operation in freshly spawned ranks, reshard and DCP alternating, with the limits
    (write + fsync, page-cache read, memcpy, CRC-32C), reported as ``cold.`` phases and ratios, with reshard's
    per-phase breakdown and the import times paid before the clock. (The DP=2 saves of ``--dp-replicas`` run
    the same code in the warm test: here they would cost three more 4-rank starts.)"""
    out = tmp_path / "cold.json"
    command = _tiny_compare(tmp_path / "ckpt", out, "--mode", "cold", "--systems", "limits,reshard,dcp")
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["config"]["mode"] == "cold"
    phases = report["phases"]
    expected = {
        *(f"cold.limit.{k}" for k in ("write", "read", "read_fresh", "memcpy", "crc32c")),
        *(f"cold.{s}.{op}" for s in ("reshard", "dcp") for op in ("save", "load_same", "load_axis")),
        "cold.reshard.async_first",
        "cold.reshard.async_warmup",
    }
    assert set(phases) == expected, sorted(set(phases) ^ expected)
    for name, phase in phases.items():
        assert phase["ranks"] == 2, name
        assert phase["seconds_median"] > 0 and phase["gb_per_s"] > 0, name
    for name in ("cold.reshard.save", "cold.reshard.load_same", "cold.reshard.load_axis"):
        assert phases[name]["reshard_phases_median"]["total"] > 0, name
    assert set(report["imports_seconds_median"]) == {"reshard", "dcp"}
    ratios = {row["name"]: row for row in report["ratios"]}
    for name in (
        "cold: save: reshard time / DCP time",
        "cold: save: reshard GB/s / fsync'ed write GB/s",
        "cold: load same: reshard time / DCP time",
        "cold: load split axis flipped: reshard time / DCP time",
        "cold: load: reshard extra peak RSS per rank (MiB, worst load)",
        "cold: load: reshard extra peak RSS per rank / budget (worst load)",
        "cold: save: reshard extra peak RSS per rank / budget",
        "cold: async (first save after warmup()): blocking time / memcpy",
    ):
        row = ratios[name]
        assert row["value"] is not None and math.isfinite(row["value"]) and row["value"] > 0, name
        assert row["pass"] in (True, False), name
    assert not any(name.startswith("warm:") for name in ratios)
    assert report["memory_budgets"] == {"save": 256 * 2**20, "load": 32 * 2**20}
    assert "cold: save: reshard time / DCP time" in proc.stdout


@pytest.mark.timeout(240)
def test_chaos_long_mode_runs_at_a_tiny_size(tmp_path: Path) -> None:
    """benchmarks/chaos.py (the long mode of the contract suite, docs/reliability.md) on a handful of kill
    points, corruptions and hostile documents: it runs, reports per flow, and exits 0."""
    out = tmp_path / "chaos.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.chaos",
        "--flows",
        "overwrite:2,transfer:2",
        "--limit",
        "6",
        "--timed",
        "1",
        "--corruptions",
        "4",
        "--hostile",
        "2",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=220, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    total = report["kills"]["total"]
    assert total["tried"] == 14 and total["clean"] == 14, total
    assert [row["flow"] for row in report["kills"]["rows"]] == ["overwrite", "transfer"]
    assert report["plain_corruptions"]["corruptions"] == 2 and report["root_damage"]["corruptions"] == 2
    assert report["hostile"]["documents"] == 2


@pytest.mark.timeout(120)
def test_replicas_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    """benchmarks/replicas.py at 1 MiB, DP=2, one repetition: its table, and storage bytes counted once
    with read_once, twice without (and by DCP)."""
    out = tmp_path / "replicas.json"
    command = [sys.executable, str(REPO / "benchmarks" / "replicas.py"), "--size-mib", "1", "--repeat", "1"]
    command += ["--dp", "2", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    figures = report["dp"]["2"]
    unique = report["unique_bytes"]
    assert figures["read_once"]["storage_bytes"] == unique
    assert figures["reshard"]["storage_bytes"] == 2 * unique
    assert figures["dcp"]["storage_bytes"] >= 2 * unique
    assert all(figures[name]["seconds"] > 0 for name in ("reshard", "read_once", "dcp", "peer_save", "peer_restore"))


@pytest.mark.timeout(180)
def test_incremental_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    """benchmarks/incremental.py at 1 MiB, two steps of the LoRA scenario in warm mode (one set of ranks; the
    cold mode runs the same saves, one set of fresh ranks each, which the suite's budget cannot pay for): the
    incremental save writes the trained share of the bytes and reads back the frozen share it references, DCP
    writes everything (the full reshard saves run the same loop)."""
    out = tmp_path / "incremental.json"
    command = [sys.executable, str(REPO / "benchmarks" / "incremental.py"), "--size-mib", "1", "--steps", "2"]
    command += ["--scenarios", "lora", "--systems", "incremental", "dcp", "--mode", "warm"]
    command += ["--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"lora.warm"}
    for result in report["results"].values():
        figures = result["figures"]
        trained = report["config"]["bytes"] * (1 - report["config"]["frozen_fraction"])
        assert figures["incremental"]["bytes"] < 1.5 * trained + 16384  # its data and its metadata
        assert figures["dcp"]["bytes"] >= report["config"]["bytes"]
        assert figures["incremental"]["first_bytes"] >= report["config"]["bytes"]  # the first save is full
        frozen = report["config"]["bytes"] * report["config"]["frozen_fraction"]
        assert 0.9 * frozen <= figures["incremental"]["read_back"] <= report["config"]["bytes"]  # what it references
        assert all(f["seconds"] > 0 for f in figures.values())
        assert 0 < result["ratios"]["incremental/dcp.bytes"] < 0.2
    assert "ratio incremental/dcp.bytes" in proc.stdout


@pytest.mark.timeout(120)
def test_gpu_benchmark_dry_runs_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu.py with ``--device cpu`` (its dry run where CUDA is absent) at 4 MiB, one round in warm
    processes: every operation of reshard and DCP (DCP's pinned stagers need CUDA and are left out), the copy
    floors, the loads checked value by value, and the table. On a GPU, benchmarks/gpu_check.sh runs it for real."""
    out = tmp_path / "gpu.json"
    command = [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--device", "cpu", "--size-gib", "0.004"]
    command += ["--repeat", "0", "--mode", "warm", "--compute-ms", "20", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    operations = report["results"]["warm"]["operations"]
    assert set(operations) == {"save", "async", "step", "load_same", "load_axis"}
    expected = {"save": {"reshard", "dcp"}, "step": {"reshard"}}
    for name, row in operations.items():
        assert set(row["systems"]) == expected.get(name, {"reshard", "dcp", "floor"}), name
        assert all("errors" not in cell for cell in row["systems"].values()), row
        assert all(cell["seconds"] >= 0 for cell in row["systems"].values())
        if name != "step":
            assert row["ratios"]["reshard/dcp"] > 0
    async_save = operations["async"]["systems"]["reshard"]
    assert async_save["total_seconds"] >= async_save["seconds"] > 0
    assert operations["step"]["systems"]["reshard"]["step_seconds"] > 0
    assert "stall s/GiB" in proc.stdout and "GiB/s" in proc.stdout
