"""Write ``tests/data/golden_v3/``: a tiny checkpoint of format version 3, for ``tests/test_format_golden_v3.py``.

Version 3 is version 2 plus the document's own checksum (``docs/format.md``, section 6.2): the last member of
``metadata.json`` is ``"metadata_crc32c"``, the CRC-32C of every byte before its 8 hexadecimal digits. The
state is that of ``make_golden_v2.py`` (packed and listed tensors, a common value), so the data file is the
same bytes as version 2's.

The same rules as the other generators: rerun ONLY when the format version changes; the save id is pinned;
the checksum chunk is 16 bytes. Run from the repository root::

    PYTHONPATH=. .venv/bin/python tests/data/make_golden_v3.py
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path
from unittest import mock

from tests.data.make_golden_v2 import CHECKSUM_CHUNK_BYTES, golden_state_dict

import reshard

OUT = Path(__file__).resolve().parent / "golden_v3"
SAVE_ID = uuid.UUID("3333333333333333cccccccccccccccc")


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
