"""``diff_checkpoints`` across dtypes after its fast path (issue 38 item 7): blocks of finite values are
compared in reused float64 buffers, blocks holding a NaN, an infinity or an overflowing difference by the
exact rules; both must give what the documented rules give, element by element, on real checkpoints."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import reshard
from reshard.interop import diff_checkpoints
from reshard.interop.diff import DIFF_BLOCK_ELEMENTS

pytestmark = pytest.mark.unit


def _expected(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float, int]:
    """The rules of the module docstring, written out element by element over float64 values."""
    x, y = a.double().flatten().tolist(), b.double().flatten().tolist()
    max_abs = max_rel = 0.0
    mismatched = 0
    for u, v in zip(x, y, strict=True):
        if u == v or (math.isnan(u) and math.isnan(v)):
            distance = 0.0
        else:
            distance = abs(u - v)
            distance = math.inf if math.isnan(distance) else distance
        if distance == 0:
            relative = 0.0
        elif v == 0 or math.isinf(v):
            relative = math.inf
        else:
            relative = distance / abs(v)
        max_abs, max_rel = max(max_abs, distance), max(max_rel, relative)
        allowed = atol + rtol * (0.0 if math.isnan(v) else abs(v)) if rtol else atol  # NaN: beyond any
        mismatched += distance > allowed
    return max_abs, max_rel, mismatched


def _values(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, generator=generator, dtype=torch.float64) * 3


def _special_first_block(values: torch.Tensor) -> torch.Tensor:
    """Zeros, a subnormal, NaN and infinities in the first block; the later blocks stay finite."""
    out = values.clone()
    out[:8] = torch.tensor([0.0, -0.0, 1e-310, math.nan, math.inf, -math.inf, 0.0, 5.0], dtype=torch.float64)
    return out


@pytest.mark.parametrize(("dtype_a", "dtype_b"), [(torch.float32, torch.bfloat16), (torch.float16, torch.float64)])
@pytest.mark.parametrize(("atol", "rtol"), [(0.0, 0.0), (0.0, 0.01), (0.05, 0.0), (1e-3, 2e-3), (100.0, 0.0)])
def test_a_dtype_converting_diff_gives_the_documented_maxima_and_counts(
    tmp_path: Path, dtype_a: torch.dtype, dtype_b: torch.dtype, atol: float, rtol: float
) -> None:
    count = 2 * DIFF_BLOCK_ELEMENTS + 123  # three blocks, the last one short
    source = _values(count, seed=1)
    special = _special_first_block(source)
    b_side = special.clone()
    b_side[6] = 0.0  # a = 0 against b = 0 stays 0, a = 5 against b = 0 is infinitely far
    b_side[7] = 0.0
    b_side[4] = 1.0  # inf against a number: infinitely far; -inf against -inf and NaN against NaN: equal
    b_side[8] = math.nan
    tensors_a = {"plain": source.to(dtype_a), "special": special.to(dtype_a), "empty": torch.empty(0, dtype=dtype_a)}
    tensors_b = {"plain": source.to(dtype_b), "special": b_side.to(dtype_b), "empty": torch.empty(0, dtype=dtype_b)}
    reshard.save(tensors_a, tmp_path / "a")
    reshard.save(tensors_b, tmp_path / "b")
    report = diff_checkpoints(
        tmp_path / "a", tmp_path / "b", atol=atol, rtol=rtol, ignore_dtypes=True, slab_bytes=1 << 17
    )
    got = {t.key: t for t in report.tensors}
    for key, values in tensors_a.items():
        max_abs, max_rel, mismatched = _expected(values, tensors_b[key], atol, rtol)
        assert (got[key].max_abs, got[key].max_rel, got[key].mismatched) == (max_abs, max_rel, mismatched), key
    assert got["special"].max_abs == math.inf and got["special"].mismatched
    assert got["plain"].max_abs and 0 < got["plain"].max_abs < math.inf


def test_finite_values_whose_difference_overflows_are_infinitely_far(tmp_path: Path) -> None:
    a = torch.tensor([1e308, 1.0, 2.0], dtype=torch.float64)
    b = torch.tensor([-1e308, 1.0, 2.5], dtype=torch.float64)  # 1e308 - -1e308 overflows float64
    c = torch.tensor([-math.inf, 1.0, 2.5], dtype=torch.float32)
    for name, values in (("a", a), ("b", b), ("c", c)):
        reshard.save({"w": values}, tmp_path / name)
    for other, values in (("b", b), ("c", c)):
        (diff,) = diff_checkpoints(tmp_path / "a", tmp_path / other, ignore_dtypes=True).tensors
        assert (
            (diff.max_abs, diff.max_rel, diff.mismatched) == _expected(a, values, 0.0, 0.0) == (math.inf, math.inf, 2)
        )


def test_integers_and_a_sharded_layout_compare_by_value_across_dtypes(tmp_path: Path) -> None:
    full = torch.arange(4 * DIFF_BLOCK_ELEMENTS, dtype=torch.int64).reshape(4, -1)
    halves = {
        "top": reshard.ShardedTensor("ids", full[:2].clone(), tuple(full.shape), (0, 0)),
        "bottom": reshard.ShardedTensor("ids", full[2:].clone(), tuple(full.shape), (2, 0)),
    }
    reshard.save(halves, tmp_path / "a")
    changed = full.clone()
    changed[3, -1] += 7
    reshard.save({"ids": changed.to(torch.float64)}, tmp_path / "b")
    (diff,) = diff_checkpoints(tmp_path / "a", tmp_path / "b", ignore_dtypes=True, slab_bytes=1 << 16).tensors
    assert (diff.max_abs, diff.mismatched) == (7.0, 1)
    assert diff.max_rel == 7.0 / float(changed[3, -1])
