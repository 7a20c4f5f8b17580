"""Issue 32, the second outside attack (F4): ``export_safetensors`` / ``reshard export`` of a checkpoint holding
ScaledTensors keeps each scaled tensor's data with its scales and global scale: a key map that drops a part or
renames it apart from its data is refused, and every shard's ``__metadata__`` records the scaled tensors under
their output names (``reshard.scaled``) so that a reader can pair them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import reshard
from reshard.cli import main
from reshard.interop import export_safetensors
from reshard.interop.export import INDEX_FILE, SCALED_METADATA_KEY
from reshard.state.quantize import dequantize
from tests.interop.test_scaled_offline import FP8, NV, _state

pytestmark = pytest.mark.unit

KEY_MAPS: dict[str, tuple[Any, str]] = {
    "drop w:scale": ({"w:scale": None}, "'w:scale'"),
    "a function dropping every ':scale'": (lambda k: None if k.endswith(":scale") else k, "'w:scale'"),
    "drop n:global_scale": ({"n:global_scale": None}, "'n:global_scale'"),
    "w:scale renamed onto p's name": ({"w:scale": "p", "b": None}, "'w:scale'"),
    "w renamed, its scale not": ({"w": "model.w"}, "'w:scale'"),
}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    reshard.save(_state(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("case", list(KEY_MAPS))
def test_an_export_that_parts_scaled_data_from_its_scales_is_refused(checkpoint: Path, case: str) -> None:
    """Was: ``w`` exported as a bare float8_e4m3fn without its scale, success, ``left_out=('w:scale',)``. Now a
    MismatchError naming the data and the part, and nothing written."""
    key_map, part = KEY_MAPS[case]
    out = checkpoint.parent / "out"
    with pytest.raises(reshard.MismatchError) as caught:
        export_safetensors(checkpoint, out, key_map=key_map)
    assert part in str(caught.value) and f"{part.split(':')[0]}'" in str(caught.value)
    assert not (out / INDEX_FILE).exists() and not list(out.glob("*.safetensors"))


def test_the_cli_refuses_a_key_map_that_drops_a_scale(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = checkpoint.parent / "names.json"
    names.write_text(json.dumps({"w:scale": None}))
    assert main(["export", str(checkpoint), str(checkpoint.parent / "out"), "--key-map", str(names)]) == 3
    assert "'w:scale'" in capsys.readouterr().err


def _records(out: Path) -> dict[str, Any]:
    """The ``reshard.scaled`` records of every shard (the same in each)."""
    found = []
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            found.append(json.loads(f.metadata()[SCALED_METADATA_KEY]))
    assert found and all(r == found[0] for r in found)
    return found[0]


@pytest.mark.parametrize("renamed", [False, True], ids=["names kept", "renamed together"])
def test_an_export_records_the_scaled_tensors_under_their_output_names(checkpoint: Path, renamed: bool) -> None:
    """A key map that renames a scaled tensor's parts together is kept; the records name the output tensors,
    and dequantizing what they pair gives the saved values bit for bit."""
    key_map: Callable[[str], str] | None = (lambda k: "model." + k) if renamed else None
    prefix = "model." if renamed else ""
    out = checkpoint.parent / "out"
    export_safetensors(checkpoint, out, key_map=key_map, max_shard_bytes=64)
    records = _records(out)
    assert sorted(records) == [prefix + "n", prefix + "w"]
    w = records[prefix + "w"]
    assert w == {"format": "fp8_e4m3", "block": [1, 32], "scale": prefix + "w:scale", "global_scale": None}
    assert records[prefix + "n"]["global_scale"] == prefix + "n:global_scale"
    tensors: dict[str, torch.Tensor] = {}
    for path in out.glob("*.safetensors"):
        tensors.update(load_file(path))
    got = dequantize(tensors[prefix + "w"], tensors[w["scale"]], w["format"], tuple(w["block"]))
    assert torch.equal(got, dequantize(FP8.data, FP8.scale, "fp8_e4m3", (1, 32)))
    assert torch.equal(tensors[prefix + "n:global_scale"].reshape(1), NV.global_scale.reshape(1))


def test_a_plain_export_has_no_scaled_record_and_the_name_is_reserved(checkpoint: Path) -> None:
    """Only an export of scaled tensors records them; a caller's own ``reshard.scaled`` entry is refused rather
    than overwritten."""
    out = checkpoint.parent / "plain"
    export_safetensors(checkpoint, out, key_map=lambda k: k if k == "b" else None)
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        assert SCALED_METADATA_KEY not in f.metadata()
    with pytest.raises(reshard.MismatchError, match=SCALED_METADATA_KEY):
        export_safetensors(checkpoint, checkpoint.parent / "other", metadata={SCALED_METADATA_KEY: "{}"})
