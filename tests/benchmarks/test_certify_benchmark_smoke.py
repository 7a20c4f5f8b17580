"""Keeps ``benchmarks/certify.py`` working: a tiny run (1 MiB, DP=2, two repetitions) with its JSON report checked
for its structure and for positive figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "certify.py"


@pytest.mark.timeout(180)
def test_certify_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "certify.json"
    command = [sys.executable, str(SCRIPT), "--size-mib", "1", "--dp", "2", "--repeat", "2", "--json", str(out)]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "save_certify" in proc.stdout and "vs save" in proc.stdout
    report = json.loads(out.read_text())
    assert report["state_bytes"] > 0 and list(report["dp"]) == ["2"]
    for name in ("save", "save_certify", "peer_save", "peer_save_certify"):
        assert report["dp"]["2"][name]["seconds"] > 0, name
