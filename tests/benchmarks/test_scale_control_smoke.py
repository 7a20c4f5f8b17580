"""Keeps ``benchmarks/scale_control.py`` working: a tiny run (a 16-layer model on 16 and 32 simulated ranks, 4 per
node) with its JSON report checked for sense. The full run (to 16,384 ranks) is what docs/scale.md quotes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "scale_control.py"
MIB = 1 << 20


@pytest.mark.timeout(120)
def test_scale_control_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    report_path = tmp_path / "control.json"
    command = [
        sys.executable, str(SCRIPT), "--ranks", "16", "32", "--ranks-per-node", "4", "--layers", "16",
        "--experts", "64", "--json", str(report_path),
    ]  # fmt: skip
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = json.loads(report_path.read_text())["rows"]
    assert [row["ranks"] for row in rows] == [16, 32]
    for row in rows:
        assert 0 < row["offer_bytes_max"] < 1024 < row["description_kib_max"] * 1024  # an offer, not a description
        assert row["describe_flat_coordinator_messages"] == row["ranks"] - 1
        assert row["describe_two_level_coordinator_messages"] == 3 + row["ranks"] // 4 - 1  # its node, then leaders
        assert row["describe_two_level_leader_mib"] < row["describe_flat_coordinator_mib"]
        assert row["cache_file_mib"] * 1024 > row["description_kib_max"]  # every layout is in the file
        for name in ("planned_s", "reused_s", "restart_s", "cache_encode_s", "cache_write_s"):
            assert row[name] > 0, name
        # a read-once load's schedule: an offer of a fixed small size instead of the needs; the file holds them all
        assert (
            0 < row["reads_offer_bytes_max"] < 200 and row["reads_needs_mib"] * MIB > 16 * row["reads_offer_bytes_max"]
        )
        assert row["reads_cache_file_mib"] >= row["reads_needs_mib"] and row["reads_schedules_mib"] > 0
        for name in ("reads_scheduled_s", "reads_reused_s", "reads_restart_s"):
            assert row[name] > 0, name


def test_scale_control_benchmark_help() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], check=True, capture_output=True, text=True)
    assert "--ranks-per-node" in proc.stdout and "--json" in proc.stdout
