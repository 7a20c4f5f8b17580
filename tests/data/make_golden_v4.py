"""Write ``tests/data/golden_v4/``: two tiny checkpoints of format version 4, for ``tests/test_format_golden_v4.py``.

Version 4 is version 3 plus content hashes (a top-level ``content_hash`` member; a ``hash`` per box, or a
packed ``hash`` field) and data files of sibling checkpoints (``files[i].checkpoint``), which an
incremental save references instead of rewriting what did not change (``docs/format.md``, section 15).

- ``golden_v4/base/``: the state of ``make_golden_v2.py`` saved with ``SaveOptions(content_hash=True)``; it
  also holds the reference marker that the second save left in it (``refs/step.<save id>.json``);
- ``golden_v4/step/``: the same state with ``bias[0]`` and ``grid[3, 2]`` changed and ``iteration`` 6,
  saved with ``base=golden_v4/base``: it writes the two changed boxes and references the rest.

The same rules as the other generators: rerun ONLY when the format version changes; the save ids are
pinned; the checksum chunk is 16 bytes. Run from the repository root::

    PYTHONPATH=. .venv/bin/python tests/data/make_golden_v4.py
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path
from unittest import mock

import torch
from tests.data.make_golden_v2 import CHECKSUM_CHUNK_BYTES, golden_state_dict

import reshard

OUT = Path(__file__).resolve().parent / "golden_v4"
BASE_ID = uuid.UUID("44444444444444440000000000000000")
STEP_ID = uuid.UUID("4444444444444444dddddddddddddddd")


def changed_state_dict() -> dict[str, object]:
    """The state of the second save: ``bias[0]`` is 1.5, ``grid[3, 2]`` is 100, ``iteration`` is 6."""
    state = golden_state_dict()
    state["bias"] = torch.tensor([1.5, -1.0, 2.0], dtype=torch.float32)
    cell = state["grid.3.2"]
    assert isinstance(cell, reshard.ShardedTensor)
    cell.data.fill_(100)
    state["iteration"] = 6
    return state


def main() -> int:
    if OUT.exists():
        shutil.rmtree(OUT)
    options = reshard.SaveOptions(checksum_chunk_bytes=CHECKSUM_CHUNK_BYTES, content_hash=True)
    with mock.patch("uuid.uuid4", return_value=BASE_ID):
        reshard.save(golden_state_dict(), OUT / "base", options=options)
    with mock.patch("uuid.uuid4", return_value=STEP_ID):
        result = reshard.save(changed_state_dict(), OUT / "step", options=options, base=OUT / "base")
    names = sorted(p.relative_to(OUT).as_posix() for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT}: files {names}; the second save wrote {result.file_bytes} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
