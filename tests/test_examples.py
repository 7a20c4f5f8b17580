"""The README's quickstart, run for real: 4 spawned ranks save, 2 spawned ranks load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_example_runs(tmp_path: Path) -> None:
    """Also on a second run: the path already holds a checkpoint (of another content), which it replaces."""
    import torch

    import reshard

    reshard.save({"old": torch.zeros(3)}, tmp_path / "ckpt")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "ckpt"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # README.md shows this run's output (the ranks' lines in either order).
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    shown = readme.split("$ python examples/quickstart.py ckpt\n", 1)[1].split("```", 1)[0].splitlines()
    assert len(shown) == 3
    assert sorted(done.stdout.splitlines()) == sorted(shown)
    assert sorted(reshard.read_metadata(tmp_path / "ckpt").tensors) == ["bias", "layer.weight"]
