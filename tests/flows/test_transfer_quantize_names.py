"""``key_map`` and scaled targets (issue 32, part E): a target ScaledTensor ``K`` whose key_map names the
source ``N`` takes ``N``'s scales and global scale (``K:scale`` from ``N:scale``), whether the source is a
ScaledTensor of the same format or a high-precision tensor quantized on the way; a key_map that maps a
part otherwise (another tensor's scales, a scale key alone) is a MismatchError naming the parts, on every
rank, before any byte moves. On in-process ranks, compared byte for byte with ``quantize``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

import reshard
from reshard import MismatchError
from reshard.state.quantize import quantize
from tests.flows.test_scaled import errors_on_ranks, on_ranks
from tests.flows.test_transfer_quantize import W, check, rows_source, target, weights

pytestmark = pytest.mark.unit

V = weights(128, 512, seed=5)
FORMATS = [("fp8_e4m3", (128, 128)), ("nvfp4", None)]


def scaled_source(key: str, full: torch.Tensor, fmt: str, block: Any, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s half (by columns, 2 ranks) of ``quantize(full)`` as a ScaledTensor ``key``."""
    want = quantize(full, fmt, block)
    source = target(key, want, fmt, block, 2, 1, rank)
    if source:
        source[key].data.data.copy_(want.data.chunk(2, dim=1)[rank])
        source[key].scale.copy_(want.scale if want.scale.shape[1] == 1 else want.scale.chunk(2, dim=1)[rank])
        if want.global_scale is not None:
            source[key].global_scale.copy_(want.global_scale.reshape(()))
    return source


def run_transfer(
    source: Callable[[int], dict[str, Any]],
    want: Any,
    fmt: str,
    block: Any,
    key_map: Mapping[str, str] | Callable[[str], str],
    *,
    session: bool,
) -> None:
    """``source(rank)`` to the target ``hf.w`` on 4 ranks by columns, through ``key_map``; checked."""

    def run(rank: int, g: Any) -> dict[str, Any]:
        state = target("hf.w", want, fmt, block, 4, 1, rank)
        if session:
            reshard.TransferSession(group=g, key_map=key_map).transfer(source(rank), state, delta=False)
        else:
            reshard.transfer(source(rank), state, group=g, key_map=key_map)
        return state

    for rank, state in enumerate(on_ranks(4, run)):
        check(state, "hf.w", want, 4, 1, rank)


@pytest.mark.parametrize("session", [False, True], ids=["transfer", "session"])
@pytest.mark.parametrize(("fmt", "block"), FORMATS)
def test_a_renamed_scaled_source_brings_its_scales_and_global_scale(fmt: str, block: Any, session: bool) -> None:
    """``{"hf.w": "w"}`` alone: ``hf.w:scale`` (and ``hf.w:global_scale``) come from ``w``'s."""
    want = quantize(W, fmt, block)

    def source(rank: int) -> dict[str, Any]:
        return scaled_source("w", W, fmt, block, rank) | scaled_source("v", V, fmt, block, rank)

    run_transfer(source, want, fmt, block, {"hf.w": "w"}, session=session)
    run_transfer(source, want, fmt, block, lambda k: k.removeprefix("hf."), session=session)
    consistent = {"hf.w": "w", "hf.w:scale": "w:scale"}
    run_transfer(source, want, fmt, block, consistent, session=session)


@pytest.mark.parametrize("session", [False, True], ids=["transfer", "session"])
@pytest.mark.parametrize(("fmt", "block"), FORMATS)
def test_a_renamed_high_precision_source_is_quantized(fmt: str, block: Any, session: bool) -> None:
    want = quantize(W, fmt, block)

    def source(rank: int) -> dict[str, Any]:
        return rows_source("w", W, 64, rank) | rows_source("v", V, 64, rank)

    run_transfer(source, want, fmt, block, {"hf.w": "w"}, session=session)


def fails_alike(run: Callable[[int, Any], None], *named: str) -> None:
    errors = errors_on_ranks(4, run)
    assert all(isinstance(e, MismatchError) for e in errors), errors
    for name in named:
        assert all(repr(name) in str(e) for e in errors), (name, errors)


@pytest.mark.parametrize("quantizing", [False, True], ids=["scaled_source", "quantizing"])
@pytest.mark.parametrize(("fmt", "block"), FORMATS)
def test_a_key_map_that_splits_a_scaled_tensor_is_refused(fmt: str, block: Any, quantizing: bool) -> None:
    """``hf.w`` from ``w`` but its scales from ``v``'s (another tensor of the same shape and format), and a
    scale key listed alone (``w:scale`` from ``v:scale``): never filled, on every rank."""
    want = quantize(W, fmt, block)

    def source(rank: int) -> dict[str, Any]:
        w = rows_source("w", W, 64, rank) if quantizing else scaled_source("w", W, fmt, block, rank)
        return w | scaled_source("v", V, fmt, block, rank)

    def renamed(rank: int, g: Any) -> None:
        state = target("hf.w", want, fmt, block, 4, 1, rank)
        reshard.transfer(source(rank), state, group=g, key_map={"hf.w": "w", "hf.w:scale": "v:scale"})

    fails_alike(renamed, "hf.w:scale", "v:scale", "w:scale")

    def alone(rank: int, g: Any) -> None:
        state = target("w", want, fmt, block, 4, 1, rank)
        reshard.transfer(source(rank), state, group=g, key_map={"w:scale": "v:scale"})

    fails_alike(alone, "w:scale", "v:scale")
    if fmt == "nvfp4":

        def glob(rank: int, g: Any) -> None:
            state = target("hf.w", want, fmt, block, 4, 1, rank)
            key_map = {"hf.w": "w", "hf.w:global_scale": "v:global_scale"}
            reshard.TransferSession(group=g, key_map=key_map).transfer(source(rank), state, delta=False)

        fails_alike(glob, "hf.w:global_scale", "v:global_scale", "w:global_scale")
