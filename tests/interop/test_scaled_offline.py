"""Issue 32, the outside attack (S2, S3): ``convert``, ``export --dtype`` and ``diff`` of a checkpoint holding
ScaledTensors. A copy keeps the scaled records; a dtype conversion casts plain tensors only (scaled data,
scales and global scales are written as saved, and the command says so); ``diff`` compares the records."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import reshard
from reshard import ScaledTensor, ShardedTensor
from reshard.cli import main
from reshard.interop import export_safetensors
from reshard.interop.convert import convert_checkpoint
from reshard.interop.diff import diff_checkpoints
from reshard.state.quantize import quantize
from tests.flows.test_scaled import same_bytes

pytestmark = pytest.mark.unit

FP8 = quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 30, "fp8_e4m3", block=(1, 32))
NV = quantize(torch.randn(2, 32, generator=torch.Generator().manual_seed(1)), "nvfp4")
PLAIN = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))


def _state(fill: bool = True) -> dict[str, Any]:
    def f(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if fill else torch.zeros_like(t)

    assert NV.global_scale is not None
    w = ScaledTensor(ShardedTensor.from_rank_offsets("w", f(FP8.data)), f(FP8.scale), "fp8_e4m3", block=(1, 32))
    n = ShardedTensor.from_rank_offsets("n", f(NV.data))
    return {
        "w": w,
        "n": ScaledTensor(n, f(NV.scale), "nvfp4", global_scale=f(NV.global_scale)),
        "b": f(PLAIN),
    }


def _check_scaled(path: Path) -> None:
    """``path`` holds the scaled tensors as saved (records, data and scales bit for bit)."""
    metadata = reshard.read_metadata(path)
    assert sorted(metadata.scaled) == ["n", "w"]
    assert (metadata.scaled["w"].format, metadata.scaled["w"].block) == ("fp8_e4m3", (1, 32))
    out = reshard.load({k: v for k, v in _state(fill=False).items() if k != "b"}, path)
    assert same_bytes(out["w"].data.data, FP8.data) and same_bytes(out["w"].scale, FP8.scale)
    assert same_bytes(out["n"].data.data, NV.data) and same_bytes(out["n"].scale, NV.scale)
    assert NV.global_scale is not None and torch.equal(out["n"].global_scale.reshape(1), NV.global_scale.reshape(1))
    with pytest.raises(reshard.MismatchError, match=r"load it as a reshard\.ScaledTensor"):
        reshard.load({"w": torch.zeros(4, 64, dtype=torch.float8_e4m3fn)}, path)


def test_convert_keeps_the_scaled_records_and_a_dtype_cast_leaves_scaled_parts_as_saved(tmp_path: Path) -> None:
    """Was: the copy dropped the records (a plain template then loaded w without its scale), --dtype bf16 cast
    the FP8 data without its scale and rounded the float32 scales, and an in-place --overwrite destroyed the
    original's records for good."""
    reshard.save(_state(), tmp_path / "src")
    convert_checkpoint(tmp_path / "src", tmp_path / "copy")
    _check_scaled(tmp_path / "copy")
    convert_checkpoint(tmp_path / "src", tmp_path / "bf16", dtype=torch.bfloat16)
    _check_scaled(tmp_path / "bf16")
    assert reshard.read_metadata(tmp_path / "bf16").tensors["b"].dtype == "bfloat16"  # plain tensors are cast
    convert_checkpoint(tmp_path / "src", tmp_path / "src", dtype=torch.bfloat16, overwrite=True)
    _check_scaled(tmp_path / "src")


def test_convert_and_export_with_dtype_say_what_they_keep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command line names the scaled tensors a --dtype leaves in their formats (convert, its dry run and
    export); export --dtype writes scaled data and scales as saved (was: w as bf16 without its scale, w:scale
    rounded to bf16)."""
    reshard.save(_state(), tmp_path / "src")
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "dry"), "--dtype", "bf16", "--dry-run"]) == 0
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "copy"), "--dtype", "bf16"]) == 0
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "hf"), "--dtype", "bf16"]) == 0
    said = capsys.readouterr().out
    assert said.count("2 scaled tensors (n, w) kept in their formats") == 3, said
    files: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        files.update(load_file(str(f)))
    assert same_bytes(files["w"], FP8.data) and same_bytes(files["w:scale"], FP8.scale)
    assert same_bytes(files["n"], NV.data) and same_bytes(files["n:scale"], NV.scale)
    assert files["n:global_scale"].dtype == torch.float32 and files["b"].dtype == torch.bfloat16
    result = export_safetensors(tmp_path / "src", tmp_path / "hf2", dtype=torch.float16)
    assert result.kept_scaled == ("n", "w")


def test_diff_compares_the_scaled_records(tmp_path: Path) -> None:
    """A copy whose records differ (here: w saved as plain tensors of the same bytes) is a difference naming
    the key. Was: "no differences"."""
    reshard.save(_state(), tmp_path / "a")
    plain = {"w": FP8.data.clone(), "w:scale": FP8.scale.clone(), "b": PLAIN.clone()}
    state = _state()
    plain.update({"n": state["n"]})
    reshard.save(plain, tmp_path / "b")
    report = diff_checkpoints(tmp_path / "a", tmp_path / "b")
    assert not report.ok
    assert [(e.kind, e.key) for e in report.entries] == [("scaled", "w")], report.entries
    assert "only in A" in report.entries[0].problem and "fp8_e4m3" in report.entries[0].problem
    assert diff_checkpoints(tmp_path / "a", tmp_path / "a").ok
