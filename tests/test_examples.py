"""The README's quickstart, run for real: 4 spawned ranks save, 2 spawned ranks load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_example_runs(tmp_path: Path) -> None:
    """Also on a second run: the path already holds a checkpoint (of another content), which it replaces."""
    import torch

    import reshard

    reshard.save({"old": torch.zeros(3)}, tmp_path / "ckpt")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved on 4 ranks, loaded on 2" in done.stdout
    assert "rank 1: loaded columns 3..5, read 120 of 120 needed bytes" in done.stdout
    assert sorted(reshard.read_metadata(tmp_path / "ckpt").tensors) == ["bias", "layer.weight"]
