"""The offline tools of the command line: ``diff``, ``convert`` (local and to a real S3 server), the
progress bar on a terminal, ``--help`` of every subcommand, and the exit codes."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.cli import main
from reshard.flows.maintenance import validate_checkpoint

SUBCOMMANDS = ["inspect", "validate", "ls", "diff", "convert", "export", "import-dcp", "gc", "demo"]


def _state(scale: float = 1.0) -> dict[str, Any]:
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8) * scale
    return {
        "top": reshard.ShardedTensor("w", full[:3].clone(), (6, 8), (0, 0)),
        "bottom": reshard.ShardedTensor("w", full[3:].clone(), (6, 8), (3, 0)),
        "b": torch.linspace(0, 1, 5, dtype=torch.bfloat16),
        "ids": torch.arange(7, dtype=torch.int32),
        "rng": reshard.ShardedObject("rng", {"seed": 5, "state": torch.arange(3)}, (1,), (0,)),
        "step": 3,
        "name": "run",
    }


def _save(path: Path, **changes: Any) -> None:
    state = _state()
    state.update(changes)
    reshard.save(state, path, options=reshard.SaveOptions(fingerprint=True, checksum_chunk_bytes=32))


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.unit
@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as helped:
        main([command, "--help"])
    assert helped.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: reshard {command}")
    if command in ("diff", "convert", "export", "import-dcp"):
        assert "Exit codes:" in text and "--quiet" in text


@pytest.mark.unit
def test_diff_exit_codes_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "a")
    _save(tmp_path / "same")
    changed = _state(scale=1.001)
    _save(tmp_path / "b", top=changed["top"], bottom=changed["bottom"], extra=torch.zeros(2), step=4)
    code, out, _ = _run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "same"))
    assert code == 0 and "no differences beyond the tolerance" in out
    code, out, _ = _run(capsys, "diff", str(tmp_path / "b"), str(tmp_path / "a"), "--json")
    assert code == 1
    report = json.loads(out)
    by_key = {t["key"]: t for t in report["tensors"]}
    assert by_key["w"]["max_abs"] == pytest.approx(47 * 0.001, rel=1e-4)
    assert by_key["w"]["max_rel"] == pytest.approx(0.001, rel=1e-3)
    assert by_key["w"]["mismatched"] == 47  # every element but the 0
    assert by_key["extra"]["problem"] == "only in A" and by_key["ids"]["ok"]
    assert report["entries"] == [{"kind": "common", "key": "step", "problem": "4 vs 3"}]
    code, out, _ = _run(capsys, "diff", str(tmp_path / "b"), str(tmp_path / "a"), "--rtol", "0.002")
    assert code == 1 and "extra" in out and "only in A" in out and "w " not in out
    assert "common step: 4 vs 3" in out
    code, out, err = _run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "missing"))
    assert code == 3 and "does not exist" in err
    with pytest.raises(SystemExit) as usage:
        main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "-1"])
    assert usage.value.code == 2


@pytest.mark.unit
def test_diff_compares_values_across_dtypes_and_reports_shapes(tmp_path: Path) -> None:
    from reshard.interop import diff_checkpoints

    _save(tmp_path / "a")
    _save(tmp_path / "nan", b=torch.tensor([float("nan"), 0.25, 0.5, 0.75, float("inf")], dtype=torch.bfloat16))
    _save(tmp_path / "nan2", b=torch.tensor([float("nan"), 0.25, 0.5, 0.75, float("inf")], dtype=torch.bfloat16))
    _save(tmp_path / "wide", ids=torch.arange(8, dtype=torch.int32))
    assert diff_checkpoints(tmp_path / "nan", tmp_path / "nan2").ok  # NaN == NaN, inf == inf
    against = {t.key: t for t in diff_checkpoints(tmp_path / "nan", tmp_path / "a").tensors}
    assert against["b"].max_abs == float("inf") and against["b"].mismatched == 2
    shapes = {t.key: t for t in diff_checkpoints(tmp_path / "wide", tmp_path / "a").tensors}
    assert shapes["ids"].problem == "global shapes differ: [8] vs [7]" and shapes["ids"].max_abs is None


@pytest.mark.unit
def test_convert_casts_and_copies_everything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "src")
    code, out, _ = _run(capsys, "convert", str(tmp_path / "src"), str(tmp_path / "dst"), "--dtype", "bf16")
    assert code == 0 and "wrote" in out
    assert validate_checkpoint(tmp_path / "dst") == []
    metadata = reshard.read_metadata(tmp_path / "dst")
    assert {k: t.dtype for k, t in metadata.tensors.items()} == {"w": "bfloat16", "b": "bfloat16", "ids": "int32"}
    assert all(len(t.boxes) == 1 and t.fingerprint is not None for t in metadata.tensors.values())
    template = {
        "w": torch.empty(6, 8, dtype=torch.bfloat16),
        "ids": torch.empty(7, dtype=torch.int32),
        "rng": reshard.ShardedObject("rng", None, (1,), (0,)),
        "step": 0,
        "name": "",
    }
    loaded = reshard.load(template, tmp_path / "dst", options=reshard.LoadOptions(verify=True))
    expected = torch.arange(48, dtype=torch.float32).reshape(6, 8).bfloat16()
    assert torch.equal(loaded["w"], expected) and torch.equal(loaded["ids"], torch.arange(7, dtype=torch.int32))
    assert loaded["rng"]["seed"] == 5 and torch.equal(loaded["rng"]["state"], torch.arange(3))
    assert (loaded["step"], loaded["name"]) == (3, "run")
    code, out, _ = _run(capsys, "diff", str(tmp_path / "dst"), str(tmp_path / "src"), "--ignore-dtypes")
    assert code == 0, out  # these values are exact in bf16
    code, _, err = _run(capsys, "convert", str(tmp_path / "src"), str(tmp_path / "dst"))
    assert code == 3 and "already holds a complete checkpoint" in err
    code, _, _ = _run(capsys, "convert", str(tmp_path / "dst"), str(tmp_path / "dst"), "--dtype", "fp32", "--overwrite")
    assert code == 0 and reshard.read_metadata(tmp_path / "dst").tensors["w"].dtype == "float32"
    assert len(list((tmp_path / "dst" / "data").iterdir())) == 1  # the replaced data file is gone
    code, _, err = _run(capsys, "convert", str(tmp_path / "src"))
    assert code == 2 and "exactly one" in err


@pytest.mark.unit
def test_convert_of_a_corrupt_source_commits_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "src")
    metadata = reshard.read_metadata(tmp_path / "src")
    data = tmp_path / "src" / metadata.files[0].path
    raw = bytearray(data.read_bytes())
    raw[metadata.tensors["ids"].boxes[0].byte_offset] ^= 1
    data.write_bytes(bytes(raw))
    code, _, err = _run(capsys, "convert", str(tmp_path / "src"), str(tmp_path / "dst"))
    assert code == 3 and "checksum mismatch" in err
    assert not (tmp_path / "dst" / "metadata.json").exists()
    assert not list((tmp_path / "dst" / "data").iterdir()) and not (tmp_path / "dst" / ".lock").exists()


@pytest.mark.dist
def test_convert_to_and_from_s3(s3_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _save(tmp_path / "src")
    url = f"s3://{s3_server.new_bucket()}/copies/step_1"
    options = [f"--storage-option={key}={json.dumps(value)}" for key, value in s3_server.storage_options.items()]
    code, _, err = _run(capsys, "convert", str(tmp_path / "src"), "--to", url, "--dtype", "fp16", *options)
    assert code == 0, err
    assert validate_checkpoint(url, storage_options=s3_server.storage_options) == []
    assert reshard.read_metadata(url, storage_options=s3_server.storage_options).tensors["w"].dtype == "float16"
    code, _, err = _run(capsys, "convert", url, str(tmp_path / "back"), *options)
    assert code == 0, err
    code, out, _ = _run(capsys, "diff", str(tmp_path / "back"), str(tmp_path / "src"), "--ignore-dtypes", "--all")
    assert code == 0 and "within tolerance" in out


def _cli_on_a_terminal(*args: str) -> tuple[int, str]:
    """Run ``reshard ARGS`` with stderr on a pseudo-terminal; return the exit code and what it showed."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty has 0 columns
    process = subprocess.Popen(
        [sys.executable, "-m", "reshard", *args], stdout=subprocess.DEVNULL, stderr=follower, stdin=subprocess.DEVNULL
    )
    os.close(follower)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    return process.wait(timeout=120), shown.decode(errors="replace")


@pytest.mark.dist
def test_progress_bar_on_a_terminal_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    reshard.save({"t": torch.zeros(300_000)}, tmp_path / "src")
    code, shown = _cli_on_a_terminal("convert", str(tmp_path / "src"), str(tmp_path / "a"))
    assert code == 0, shown
    assert "convert" in shown and "100%" in shown and "1.14M" in shown and "B/s" in shown  # 1.14 MiB, throughput
    code, shown = _cli_on_a_terminal("convert", str(tmp_path / "src"), str(tmp_path / "b"), "--quiet")
    assert code == 0 and shown == ""
    code, out, err = _run(capsys, "export", str(tmp_path / "src"), str(tmp_path / "hf"))  # not a terminal
    assert code == 0 and err == "" and "wrote" in out
