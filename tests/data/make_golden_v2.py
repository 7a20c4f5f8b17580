"""Write ``tests/data/golden_v2/``: a tiny checkpoint of format version 2, for ``tests/test_format_golden_v2.py``.

Version 2 adds packed tensors (``docs/format.md``, section 14). This checkpoint holds one of each kind:

- ``opt``: float32 ``(16, 4)``, two column blocks (like two TP ranks), each cut into flat ranges of 3
  elements (like ZeRO-1): a grid of two cells, split along their flattening;
- ``grid``: bfloat16 ``(8, 4)`` as 32 boxes of one element: a grid of 32 cells, none split;
- ``pinwheel``: int16 ``(8, 8)`` as four arms around a centre of 36 single elements: no full cut, so the
  boxes are listed (``explicit``);
- ``bias``: float32 ``(3,)``, one box: written out in full, as in version 1.

The same rules as ``make_golden_v1.py``: rerun ONLY when the format version changes; the save id is pinned;
the checksum chunk is 16 bytes. Run from the repository root::

    .venv/bin/python tests/data/make_golden_v2.py
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path
from unittest import mock

import torch

import reshard

OUT = Path(__file__).resolve().parent / "golden_v2"
SAVE_ID = uuid.UUID("fedcba9876543210fedcba9876543210")
CHECKSUM_CHUNK_BYTES = 16


def golden_state_dict() -> dict[str, object]:
    """The saved state; the golden test spells the values out again (``arange`` of each global shape)."""
    state: dict[str, object] = {}
    opt = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    for block in range(2):
        shard = opt[:, 2 * block : 2 * block + 2].contiguous().reshape(-1)
        for start in range(0, 32, 3):
            end = min(start + 3, 32)
            state[f"opt.{block}.{start}"] = reshard.ShardedTensor.from_flat_range(
                "opt", shard[start:end].clone(), (16, 2), (16, 4), (0, 2 * block), start, end
            )
    grid = torch.arange(32, dtype=torch.bfloat16).reshape(8, 4)
    for i in range(8):
        for j in range(4):
            state[f"grid.{i}.{j}"] = reshard.ShardedTensor("grid", grid[i : i + 1, j : j + 1].clone(), (8, 4), (i, j))
    pinwheel = torch.arange(64, dtype=torch.int16).reshape(8, 8)
    arms = [((0, 0), (7, 1)), ((0, 1), (1, 7)), ((1, 7), (7, 1)), ((7, 0), (1, 7))]
    centre = [((i, j), (1, 1)) for i in range(1, 7) for j in range(1, 7)]
    for n, (offset, shape) in enumerate(arms + centre):
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        state[f"pinwheel.{n}"] = reshard.ShardedTensor("pinwheel", pinwheel[index].clone(), (8, 8), offset)
    state["bias"] = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float32)
    state["iteration"] = 5
    return state


def main() -> int:
    if OUT.exists():
        shutil.rmtree(OUT)
    with mock.patch("uuid.uuid4", return_value=SAVE_ID):
        result = reshard.save(
            golden_state_dict(), OUT, options=reshard.SaveOptions(checksum_chunk_bytes=CHECKSUM_CHUNK_BYTES)
        )
    names = sorted(p.relative_to(OUT).as_posix() for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT}: save_id {result.save_id}, files {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
