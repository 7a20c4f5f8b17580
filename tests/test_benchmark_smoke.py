"""Keeps ``benchmarks/compare.py`` working: a tiny run (a few MiB, one repetition, 2 ranks) of every system,
with the JSON report checked for its structure and for positive figures.

Megatron-Core is an optional benchmark extra: when it is not installed the benchmark skips it (and says so in
the report), and so does this test."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "compare.py"


def _megatron_installed() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        return False


@pytest.mark.timeout(180)
def test_compare_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    ckpt_dir = tmp_path / "ckpt"
    command = [
        sys.executable,
        str(SCRIPT),
        "--size-gib",
        "0.004",
        "--repeat",
        "1",
        "--ranks",
        "2",
        "--load-world",
        "1",
        "--dp-replicas",
        "--dir",
        str(ckpt_dir),
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    started = time.monotonic()
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=170, cwd=tmp_path, env=env)
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert elapsed < 60, f"the tiny benchmark took {elapsed:.1f} s"
    assert "ratio" in proc.stdout  # the human-readable table was printed

    report = json.loads(out.read_text())
    for key in ("config", "machine", "state", "phases", "accounting", "ratios", "notes", "skipped"):
        assert key in report, key
    assert report["config"]["ranks"] == 2
    assert report["state"]["bytes"] > 0

    expected = [
        "limit.write",
        "limit.read",
        "limit.memcpy",
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

    # Read accounting of the resharded loads, per kind of change; an axis-0 change reads exactly what it needs.
    assert {"load_axis", "load_world"} <= set(report["accounting"])
    for groups in report["accounting"].values():
        for stats in groups.values():
            assert stats["bytes_needed"] > 0
            assert stats["bytes_read"] >= stats["bytes_needed"]
    axis0 = report["accounting"]["load_axis"]["axis1->axis0"]
    assert axis0["bytes_read"] == axis0["bytes_needed"]

    ratios = {row["name"]: row for row in report["ratios"]}
    for name in (
        "save: reshard GB/s / fsync'ed write GB/s",
        "load same: reshard time / DCP time",
        "load same: reshard GB/s / page-cache read GB/s",
        "async: blocking time / memcpy of the state",
        "async: blocking time / synchronous save",
        "DP=2 save: reshard time / DCP time",
    ):
        row = ratios[name]
        assert row["value"] is not None and math.isfinite(row["value"]) and row["value"] > 0, name
        assert row["target"] is not None and row["pass"] in (True, False), name


@pytest.mark.timeout(240)
def test_chaos_long_mode_runs_at_a_tiny_size(tmp_path: Path) -> None:
    """benchmarks/chaos.py (the long chaos mode of docs/reliability.md) on a handful of kill points and
    corruptions: it runs, reports, and exits 0."""
    out = tmp_path / "chaos.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.chaos",
        "--scenarios",
        "overwrite:2,manager:2",
        "--limit",
        "6",
        "--timed",
        "1",
        "--corruptions",
        "5",
        "--json",
        str(out),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=220, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    total = report["kills"]["total"]
    assert total["tried"] == 14 and total["lost"] == total["silent"] == total["violations"] == 0
    assert report["corruptions"]["corruptions"] == 5 and report["corruptions"]["silent"] == 0
    assert "total: 14 kill points" in done.stdout
