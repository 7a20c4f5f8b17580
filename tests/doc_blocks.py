"""The fenced blocks of README.md and docs/*.md and the markers before them, for the tests that run or
check them (tests/test_docs.py, tests/test_doc_commands.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
"""The documents whose examples run; benchmarks/README.md's blocks are checked for a marker too."""
MARKED_DOCS = [*DOCS, ROOT / "benchmarks" / "README.md"]


def fenced_after(lines: list[str], index: int, where: str) -> str:
    """The body of the fenced block that starts on the line after ``index``."""
    fence = lines[index + 1] if index + 1 < len(lines) else ""
    if not fence.startswith("```"):
        raise AssertionError(f"{where}: the marker must be followed by a fenced block")
    body = []
    for line in lines[index + 2 :]:
        if line.startswith("```"):
            return "\n".join(body) + "\n"
        body.append(line)
    raise AssertionError(f"{where}: the fenced block is not closed")


def marked_blocks(pattern: re.Pattern[str], docs: list[Path] = DOCS) -> list[Any]:
    """``(where, the marker's argument, the block)`` of every block marked by ``pattern``."""
    found = []
    for path in docs:
        lines = path.read_text(encoding="utf-8").splitlines()
        for index, line in enumerate(lines):
            where = f"{path.relative_to(ROOT)}:{index + 1}"
            if (match := pattern.fullmatch(line.strip())) is not None:
                found.append(pytest.param(where, match.group(1), fenced_after(lines, index, where), id=where))
    return found


def fenced_blocks(docs: list[Path] = MARKED_DOCS) -> list[tuple[str, str, str]]:
    """``(where, the line before the fence, the fence's language)`` of every fenced block."""
    found = []
    for path in docs:
        lines = path.read_text(encoding="utf-8").splitlines()
        inside = False
        for index, line in enumerate(lines):
            if not line.startswith("```"):
                continue
            if not inside:
                before = lines[index - 1].strip() if index else ""
                found.append((f"{path.relative_to(ROOT)}:{index + 1}", before, line[3:].strip()))
            inside = not inside
    return found
