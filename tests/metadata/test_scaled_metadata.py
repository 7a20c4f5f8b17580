"""The ``scaled`` member of ``metadata.json`` (format version 5, docs/format.md section 16): written only when a
checkpoint holds scaled tensors, and read hostile-proof."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard import CorruptCheckpointError, ScaledTensor, ShardedTensor
from tests.metadata_docs import dumps, unseal

pytestmark = pytest.mark.unit


def _scaled_checkpoint(path: Path) -> dict[str, Any]:
    data = ShardedTensor("w", torch.zeros(4, 16, dtype=torch.uint8), (4, 16), (0, 0))  # nvfp4: 32 elements per row
    state = {
        "w": ScaledTensor(data, torch.zeros(4, 2, dtype=torch.float8_e4m3fn), "nvfp4", global_scale=torch.ones(())),
        "bias": torch.zeros(4),
        "rng": reshard.ShardedObject("rng", {"seed": 1}, (1,), (0,)),
    }
    reshard.save(state, path)
    doc: dict[str, Any] = json.loads(unseal((path / "metadata.json").read_bytes()))
    return doc


def test_version_5_and_the_record_only_when_scaled_tensors_are_present(tmp_path: Path) -> None:
    doc = _scaled_checkpoint(tmp_path / "scaled")
    assert doc["version"] == 5
    assert doc["scaled"] == {
        "w": {"format": "nvfp4", "block": [1, 16], "scale": "w:scale", "global_scale": "w:global_scale"}
    }
    assert doc["tensors"]["w"]["dtype"] == "uint8" and doc["tensors"]["w:global_scale"]["global_shape"] == []
    reshard.save({"bias": torch.zeros(4)}, tmp_path / "plain")
    plain = json.loads(unseal((tmp_path / "plain" / "metadata.json").read_bytes()))
    assert plain["version"] == 3 and "scaled" not in plain


def _edit_unknown_format(doc: dict[str, Any]) -> None:
    doc["scaled"]["w"]["format"] = "fp6"


def _edit_scale_missing(doc: dict[str, Any]) -> None:
    doc["scaled"]["w"]["scale"] = "w:scales"


def _edit_scale_shape(doc: dict[str, Any]) -> None:
    doc["scaled"]["w"]["scale"] = "bias"  # shape [4], the grid is [4, 2]


def _edit_not_a_tensor(doc: dict[str, Any]) -> None:
    doc["scaled"]["rng"] = doc["scaled"].pop("w")


def _edit_block(doc: dict[str, Any]) -> None:
    doc["scaled"]["w"]["block"] = [1, 32]


def _edit_global_scale(doc: dict[str, Any]) -> None:
    doc["scaled"]["w"]["global_scale"] = None


def _edit_version_4(doc: dict[str, Any]) -> None:
    doc["version"] = 4


def _edit_dtype(doc: dict[str, Any]) -> None:
    doc["tensors"]["w:scale"]["dtype"] = "int8"


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_edit_unknown_format, r"scaled\['w'\]\.format: unknown low-precision format 'fp6'"),
        (_edit_scale_missing, r"scaled\['w'\]: the scale tensor 'w:scales' is missing"),
        (_edit_scale_shape, r"scaled\['w'\]: the scales 'bias' have shape \[4\].*give \[4, 2\]"),
        (_edit_not_a_tensor, r"scaled\['rng'\]: 'rng' is recorded as a scaled tensor, but it is an object"),
        (_edit_block, r"scaled\['w'\]: .*nvfp4 has blocks \[1, 16\], not \[1, 32\]"),
        (_edit_global_scale, r"scaled\['w'\]: format nvfp4 has global scale"),
        (_edit_version_4, r"unexpected \['scaled'\]"),
        (_edit_dtype, r"the scales' dtype int8 is not one of format nvfp4"),
    ],
    ids=["format", "scale_missing", "scale_shape", "not_a_tensor", "block", "global_scale", "version_4", "dtype"],
)
def test_a_hostile_scaled_record_is_refused(tmp_path: Path, edit: Callable[[dict[str, Any]], None], match: str) -> None:
    doc = _scaled_checkpoint(tmp_path)
    edit(doc)
    (tmp_path / "metadata.json").write_bytes(dumps(doc))
    with pytest.raises(CorruptCheckpointError, match=match):
        reshard.read_metadata(tmp_path)
