"""The command line's edge: the library's commands import no application (:mod:`reshard.demo`,
:mod:`reshard.models`); ``reshard demo`` does, as the application it is. Each check runs in a fresh interpreter,
since this one has imported everything already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

_SCRIPT = """
import contextlib, io, json, sys
from reshard.cli import main
codes = []
for argv in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as exc:
            codes.append(exc.code)
apps = sorted(m for m in sys.modules if m.split(".")[:2] in (["reshard", "demo"], ["reshard", "models"]))
print(json.dumps({"codes": codes, "applications": apps, "help": out.getvalue()}))
"""


def _run(*argvs: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(list(argvs))],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_help_and_a_library_command_import_no_application(tmp_path: Path) -> None:
    (tmp_path / "step_000000001").mkdir()
    result = _run(["ls", str(tmp_path), "--json"], ["--help"])
    assert result["codes"] == [0, 0]
    assert result["applications"] == []
    assert "demo" in str(result["help"])  # listed, without its arguments


def test_the_demo_command_builds_the_demos_own_arguments() -> None:
    result = _run(["demo", "--help"])
    assert result["codes"] == [0]
    assert "--layout-a" in str(result["help"])
    assert "reshard.demo.run" in result["applications"]  # type: ignore[operator]
