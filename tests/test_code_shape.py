"""The shape rules of STYLE.md and issue 31 that a reviewer would otherwise count by hand: no module of
src/reshard over 600 lines, no function or method over 80 lines, and the flows read as short lists of phases."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src" / "reshard"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_no_module_is_over_600_lines() -> None:
    long = [
        f"{path.relative_to(SRC)}: {count} lines"
        for path in _modules()
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "\n".join(long)


def _function_lengths(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines from its ``def`` to its last line) of every function in the module, nested ones
    included (a nested function counts inside its parent too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append((name, (child.end_lineno or child.lineno) - first + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def test_no_function_is_over_80_lines() -> None:
    long = [
        f"{path.relative_to(SRC)}::{name}: {lines} lines"
        for path in _modules()
        for name, lines in _function_lengths(path)
        if lines > MAX_FUNCTION_LINES
    ]
    assert not long, "\n".join(long)


def test_the_function_length_count_sees_a_long_function(tmp_path: Path) -> None:
    """The counter itself: an 81-line function is counted as 81 lines, a nested one inside a class too."""
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    module = tmp_path / "m.py"
    module.write_text(f"class C:\n    def f(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n")
    assert dict(_function_lengths(module)) == {"C.f": 81}


@pytest.mark.parametrize(("module", "flow"), [("flows/save.py", "_save_to"), ("flows/load.py", "_load_from")])
def test_the_flows_read_as_short_lists_of_phases(module: str, flow: str) -> None:
    """docs/architecture.md "The flows, layer by layer": save and load once their storage is open are a list
    of phase calls of about 40 lines (docstrings, logging and the result included), not a function that grows
    a branch per mode."""
    assert dict(_function_lengths(SRC / module))[flow] <= 50
