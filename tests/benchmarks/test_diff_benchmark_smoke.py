"""Keeps ``benchmarks/diff.py`` working: a 1 MiB run, its JSON checked for sense, its scratch directory gone.
The figures of benchmarks/README.md come from its default size (64 MiB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_diff_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out, scratch = tmp_path / "diff.json", tmp_path / "scratch"
    scratch.mkdir()
    command = [
        sys.executable, str(REPO / "benchmarks" / "diff.py"), "--size-mib", "1", "--repeat", "2",
        "--dtypes", "float32", "bfloat16", "--dir", str(scratch), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=50, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert "diff float32 vs bfloat16" in proc.stdout and "within rtol 0.01" in proc.stdout
    report = json.loads(out.read_text())
    assert report["bytes"] == (1 << 20) // 4 * (4 + 2) and report["ok"] is True
    assert len(report["seconds_all"]) == 2 and all(s > 0 for s in report["seconds_all"])
    assert list(scratch.iterdir()) == []
