"""The command line, through its real entry point (``python -m reshard``) in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reshard

pytestmark = pytest.mark.dist


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reshard", *args], capture_output=True, text=True, timeout=120, check=False
    )


def _checkpoint(path: Path) -> None:
    state = {
        "model": {
            "w": reshard.ShardedTensor("w", torch.ones(4, 6), (4, 6), (0, 0)),
            "b": torch.zeros(3, dtype=torch.bfloat16),
        },
        "rng": reshard.ShardedObject("rng", {"seed": 1}, (1,), (0,)),
        "step": 12,
    }
    reshard.save(state, path)


def test_inspect_table_and_json(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt")
    table = run_cli("inspect", str(tmp_path / "ckpt"))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    row = next(line for line in lines if line.strip().startswith("w "))
    assert row.split()[:4] == ["w", "float32", "[4,", "6]"]
    assert "saved by 1 rank (" in table.stdout
    assert "1 entry " in table.stdout
    assert "total: 2 tensors" in table.stdout
    as_json = run_cli("inspect", str(tmp_path / "ckpt"), "--json")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    by_key = {t["key"]: t for t in doc["tensors"]}
    assert by_key["w"] == {
        "key": "w",
        "dtype": "float32",
        "global_shape": [4, 6],
        "boxes": 1,
        "grid": [1, 1],
        "bytes": 96,
    }
    assert by_key["model.b"]["dtype"] == "bfloat16"
    assert doc["layout"]["world_size"] == 1
    assert doc["tensor_bytes"] == 96 + 6
    assert doc["common"] == {"step": 12}
    assert doc["objects"][0]["key"] == "rng"


def test_inspect_errors_exit_3_with_one_line(tmp_path: Path) -> None:
    missing = run_cli("inspect", str(tmp_path / "missing"))
    assert missing.returncode == 3
    assert missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
    _checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "metadata.json").unlink()
    incomplete = run_cli("inspect", str(tmp_path / "ckpt"))
    assert incomplete.returncode == 3 and "interrupted" in incomplete.stderr


def test_usage_errors_exit_2_and_help_lists_commands() -> None:
    assert run_cli().returncode == 2
    helped = run_cli("--help")
    assert helped.returncode == 0 and "inspect" in helped.stdout and "Exit codes" in helped.stdout
    assert run_cli("inspect", "--help").returncode == 0
