"""Keeps ``benchmarks/tiers.py`` working: a tiny run (1 MiB, 4 gloo ranks as 2 nodes, two repetitions) with its
JSON report checked for every row and positive figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.tiers import ORDER

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
def test_tiers_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "tiers.json"
    command = [sys.executable, str(REPO / "benchmarks" / "tiers.py"), "--size-mib", "1", "--repeat", "2"]
    command += ["--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert report["ranks"] == 4 and report["certify"] is True
    assert set(report["figures"]) == set(ORDER)
    assert all(report["figures"][name]["seconds"] > 0 for name in ORDER), report["figures"]
    assert "drain" in proc.stdout and "peer_restore" in proc.stdout
    assert not list(tmp_path.glob("reshard-bench-*"))  # the scratch directory is removed
