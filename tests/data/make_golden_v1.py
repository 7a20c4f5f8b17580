"""Write ``tests/data/golden_v1/``: a tiny checkpoint of format version 1, for ``tests/test_format_golden.py``.

The fixture pins the on-disk format: the golden test loads these committed bytes with the current code and
compares every value with constants written in the test. Rerun this script ONLY when the format version
changes (then bump the directory name and write a new golden test next to the old one, which must keep
passing for as long as version 1 is readable); regenerating it for any other reason defeats the test.

Run from the repository root::

    .venv/bin/python tests/data/make_golden_v1.py

The save id, which names the data file, is normally random; here it is pinned (``uuid.uuid4`` is patched
for the duration of the save) so that reruns with an unchanged format give the same bytes, apart from
``created_by``. The checksum chunk is 16 bytes so that boxes and blobs have several chunks, the last one
shorter.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path
from unittest import mock

import torch

import reshard

OUT = Path(__file__).resolve().parent / "golden_v1"
SAVE_ID = uuid.UUID("0123456789abcdef0123456789abcdef")
CHECKSUM_CHUNK_BYTES = 16


def golden_state_dict() -> dict[str, object]:
    """The saved state. The expected values are spelled out again, independently, in the golden test."""
    weight = torch.tensor([[0.5, -1.25, 2.0], [3.75, 100.0, -0.015625]], dtype=torch.float32)
    return {
        "model": {
            # A ShardedTensor covering its whole global tensor (one box).
            "weight": reshard.ShardedTensor("model.weight", weight, (2, 3), (0, 0)),
            # Plain tensors: stored under their dotted state-dict path as key.
            "bias": torch.tensor([1.5, -2.0, 0.3125, 65280.0], dtype=torch.bfloat16),
        },
        "counts": torch.tensor([1, -2, 2**40], dtype=torch.int64),
        "scale": torch.tensor(0.25, dtype=torch.float32),  # 0-d
        "rng": reshard.ShardedObject(
            "rng",
            {
                "state": torch.tensor([7, 8, 9], dtype=torch.int32),
                "shape": (3, "x", None, float("inf")),
                "seed": 1234,
                "raw": b"\x00\xffok",
                "by_step": {10: "ten"},
            },
            (1,),
            (0,),
        ),
        # Common values (written by the coordinator into metadata.json).
        "iteration": 1000,
        "loss_scale": float("nan"),
        "name": "golden",
        "note": None,
        "resume": True,
        "nested": [1, [2.5, "three"]],
    }


def main() -> int:
    if OUT.exists():
        shutil.rmtree(OUT)
    with mock.patch("uuid.uuid4", return_value=SAVE_ID):
        metadata = reshard.save(
            golden_state_dict(), OUT, options=reshard.SaveOptions(checksum_chunk_bytes=CHECKSUM_CHUNK_BYTES)
        )
    # Leave no stray files (the temporary metadata file is renamed away by the commit).
    names = sorted(p.relative_to(OUT).as_posix() for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT}: save_id {metadata.save_id}, files {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
