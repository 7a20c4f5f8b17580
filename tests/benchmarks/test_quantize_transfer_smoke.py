"""Keeps ``benchmarks/quantize_transfer.py`` working: a tiny run, its JSON checked for sense (half the bytes
of BF16 on the wire for FP8, the same bytes both ways). The figures of benchmarks/README.md come from its
default size (64 MiB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_quantize_transfer_benchmark_runs_at_a_tiny_size(tmp_path: Path) -> None:
    out = tmp_path / "quantize.json"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "quantize_transfer.py"),
        "--size-mib",
        "1",
        "--repeat",
        "1",
        "--json",
        str(out),
    ]
    proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=110, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    fp8 = report["formats"]["fp8_e4m3"]
    assert fp8["same_bytes"] is True and report["formats"]["mxfp8_e4m3"]["same_bytes"] is True
    assert 0.5 <= fp8["bytes_ratio"] < 0.51  # one byte per element plus the scales, against two
    assert fp8["quantizing"]["seconds"] > 0 and fp8["bf16_then_quantize"]["seconds"] > 0
