"""``reshard ls`` and ``reshard validate`` report the certification of a step (:mod:`reshard.flows.certify`), and
``gc``'s summary counts the certification records as the checkpoint's files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reshard.cli import main
from reshard.flows.maintenance import describe_removed
from tests.flows.test_certify_restart import OPTIONS, saved_by

pytestmark = pytest.mark.unit


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1 (certified), 2 (its checks failed: a NaN), 3 (checks passed, vetoed by the hook) and 4 (no checks)."""
    saved_by(tmp_path, {1: {}, 2: {"nan": True}}, certify=OPTIONS)
    saved_by(tmp_path, {3: {}}, certify=OPTIONS, certify_hook=lambda step, checks: False)
    saved_by(tmp_path, {4: {}})
    return tmp_path


def test_ls_shows_the_certification_of_each_step(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "ls", str(root))
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert code == 0
    assert lines["step_000000001"].endswith("certified")
    assert "not certified: its checks failed: 'w' box (2,0)+(2,4) holds 1 NaN" in lines["step_000000002"]
    assert lines["step_000000003"].endswith("not certified: not certified yet (its checks passed)")
    assert lines["step_000000004"].endswith("not checked")
    code, out = run(capsys, "ls", str(root), "--json")
    steps = json.loads(out)["steps"]
    assert [s["certified"] for s in steps] == [True, False, False, False]
    assert steps[3]["certification"] == "not checked"


def test_validate_reports_the_certification_and_a_foreign_certificate(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def certification(step: int) -> str:
        code, out = run(capsys, "validate", str(root / f"step_{step:09d}"))
        assert code == 0 and out.endswith("checksum checked)\n")  # the data's verdict, unchanged
        (line,) = [line for line in out.splitlines() if line.startswith("certification: ")]
        return line

    assert certification(1) == "certification: certified (finite, replicas)"
    shutil.copy(root / "step_000000001" / "certified.json", root / "step_000000003" / "certified.json")
    assert "not certified: its certified.json certifies another save" in certification(3)
    (root / "step_000000001" / "certified.json").write_bytes(b"{")
    assert "not certified: certified.json is not a certificate reshard wrote" in certification(1)
    assert certification(4) == "certification: not checked"
    assert run(capsys, "validate", str(root / "step_000000001"), "--quiet") == (0, "")  # summary: not with -q


def test_describe_removed_counts_the_certification_records_as_the_checkpoints() -> None:
    names = ["certified.json", "checks.json", "metadata.json", "data/a-r0.bin"]
    assert describe_removed(names) == "1 data file, metadata.json, certified.json and checks.json"
    assert "other" not in describe_removed(["certified.json"])


def test_the_help_of_ls_and_validate_names_certification(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("ls", "validate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "certif" in capsys.readouterr().out
