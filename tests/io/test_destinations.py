"""Destinations of every memory layout, through every read path of a load.

A template's tensors may be views of larger buffers: a column of a transposed buffer, a slice with a step,
a permuted block, a single element, a 0-dim tensor, an empty one. Each read path (a run read straight into
its destination, a copy out of a mapped local file, whole checksum chunks staged in memory as for an object
store, a single run, read-once replicas exchanging over the group) must fill exactly the destination's
elements, bit-exactly, and touch no other byte of the buffer. Destinations whose elements share memory (an
expanded tensor) cannot be filled and are refused with :class:`~reshard.StateDictError` on every rank.
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard
from reshard.net.transports import ThreadGroup
from reshard.storage import LocalStorage
from tests.threads import on_threads

pytestmark = pytest.mark.dist  # in-process, but seconds: kept out of make test-fast

SENTINEL = -7.0


class NoMapStorage(LocalStorage):
    """Local files read through ``read_ranges`` only, as an object store reads them (whole checksum chunks
    staged in memory, no mapping)."""

    def map_range(self, name: str, offset: int, length: int) -> None:
        return None


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) / 4


def _save(path: Path, full: torch.Tensor, row_cuts: list[int], chunk: int) -> None:
    """``full`` saved as boxes of rows cut at ``row_cuts``, checksummed in chunks of ``chunk`` bytes."""
    bounds = [0, *row_cuts, full.shape[0]]
    boxes = [
        reshard.ShardedTensor("w", full[lo:hi].clone(), tuple(full.shape), (lo, *[0] * (full.ndim - 1)))
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]
    reshard.save({"w": boxes}, path, options=reshard.SaveOptions(checksum_chunk_bytes=chunk))


def _destination(
    shape: tuple[int, ...], order: list[int], step_axis: int | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """A buffer full of SENTINEL, and a view of it of ``shape`` whose axes are laid out in ``order`` (the
    last axis of ``order`` varies fastest in memory) and, with ``step_axis``, every other element along it."""
    stretched = [n * 2 if a == step_axis else n for a, n in enumerate(shape)]
    buffer = torch.full([stretched[a] for a in order], SENTINEL, dtype=dtype)
    view = buffer.permute([order.index(a) for a in range(len(shape))])
    if step_axis is not None:
        view = view[tuple(slice(None, None, 2) if a == step_axis else slice(None) for a in range(len(shape)))]
    return buffer, view


def _load(template: dict[str, Any], path: Path, *, budget: int, storage: type[LocalStorage], read_once: bool) -> None:
    options = reshard.LoadOptions(memory_budget_bytes=budget, read_once=read_once or None)
    if not read_once:
        reshard.load(template, storage(path), options=options)
        return
    # Two replicas needing the same box: each reads part of it and receives the rest from the other.
    group = ThreadGroup(2)
    twin = {
        k: reshard.ShardedTensor(v.key, torch.empty_like(v.data), v.global_shape, v.global_offset)
        for k, v in template.items()
    }

    def rank(r: int) -> None:
        reshard.load(template if r == 0 else twin, storage(path), group=group.member(r), options=options)

    on_threads(2, rank, group=group)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    offset = tuple(draw(st.integers(0, n - 1)) for n in shape)
    size = tuple(draw(st.integers(1, n - o)) for n, o in zip(shape, offset, strict=True))
    return {
        "shape": shape,
        "offset": offset,
        "size": size,
        "cuts": sorted(set(draw(st.lists(st.integers(1, max(1, shape[0] - 1)), max_size=2)))),
        "order": draw(st.permutations(list(range(ndim)))),
        "step_axis": draw(st.one_of(st.none(), st.integers(0, ndim - 1))),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "chunk": draw(st.sampled_from([4, 12, 40, 4 << 20])),
        "budget": draw(st.sampled_from([16, 48, 160, 1024, 32 << 20])),
        "storage": draw(st.sampled_from([LocalStorage, NoMapStorage])),
        "read_once": draw(st.booleans()),
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_every_destination_layout_through_every_read_path(case: dict[str, Any]) -> None:
    """Random boxes of a random tensor into views of every layout (permuted axes, steps, columns of
    transposed buffers, single elements), with budgets down to 16 bytes (every read item a single run) and
    checksum chunks of 4 bytes to 4 MiB, on mapped and staged storage, alone and read once: the view holds
    exactly the saved values, and no other byte of its buffer changed."""
    full = _full(case["shape"])
    index = tuple(slice(o, o + n) for o, n in zip(case["offset"], case["size"], strict=True))
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "ckpt"
        _save(path, full, case["cuts"], case["chunk"])
        buffer, view = _destination(case["size"], case["order"], case["step_axis"], case["dtype"])
        template = {"w": reshard.ShardedTensor("w", view, case["shape"], case["offset"])}
        _load(template, path, budget=case["budget"], storage=case["storage"], read_once=case["read_once"])
    assert torch.equal(view, full[index].to(case["dtype"]))
    # every value loaded is positive: the SENTINEL left is exactly the buffer outside the view
    assert int((buffer == SENTINEL).sum()) == buffer.numel() - view.numel()


@pytest.mark.parametrize("read_once", [False, True], ids=["alone", "read_once"])
@pytest.mark.parametrize("storage", [LocalStorage, NoMapStorage], ids=["mapped", "staged"])
@pytest.mark.parametrize("budget", [16, 32 << 20], ids=["single_runs", "default_budget"])
def test_a_column_of_a_transposed_buffer(
    tmp_path: Path, storage: type[LocalStorage], budget: int, read_once: bool
) -> None:
    """The reported case: column 2 of a row-major [8, 6] tensor loaded into a column of a transposed
    buffer; with a tiny budget each element is a read item of one run, and was read "directly" into a
    destination element whose stride is not 1 (an internal RuntimeError)."""
    full = _full((8, 6))
    _save(tmp_path / "ckpt", full, [], 4 << 20)
    buffer = torch.full((6, 8), SENTINEL)
    column = buffer.t()[:, 2:3]
    template = {"w": reshard.ShardedTensor("w", column, (8, 6), (0, 2))}
    _load(template, tmp_path / "ckpt", budget=budget, storage=storage, read_once=read_once)
    assert torch.equal(column, full[:, 2:3])
    assert int((buffer == SENTINEL).sum()) == buffer.numel() - 8  # no other element of the buffer changed


@pytest.mark.parametrize("storage", [LocalStorage, NoMapStorage], ids=["mapped", "staged"])
def test_a_view_with_the_negative_bit_gets_the_values_not_their_negation(
    tmp_path: Path, storage: type[LocalStorage]
) -> None:
    """``c.conj().imag`` is a view whose values are the negated stored floats: elements loaded one run at a
    time must hold the saved values (raw bytes written into it would read back negated)."""
    full = _full((8,))
    _save(tmp_path / "ckpt", full, [], 4 << 20)
    buffer = torch.zeros(8, dtype=torch.complex64)
    imaginary = buffer.conj().imag
    for i in range(8):
        template = {"w": reshard.ShardedTensor("w", imaginary[i : i + 1], (8,), (i,))}
        reshard.load(template, storage(tmp_path / "ckpt"), options=reshard.LoadOptions(memory_budget_bytes=16))
    assert torch.equal(imaginary, full)
    assert torch.equal(buffer.imag, -full)


@pytest.mark.parametrize("storage", [LocalStorage, NoMapStorage], ids=["mapped", "staged"])
def test_zero_dim_and_empty_destinations(tmp_path: Path, storage: type[LocalStorage]) -> None:
    reshard.save({"s": torch.tensor(3.5), "e": torch.zeros(0, 3), "w": _full((4, 3))}, tmp_path / "ckpt")
    scalar = torch.full((5,), SENTINEL)[2]
    empty = torch.zeros(3, 0).t()
    element = torch.full((3, 4), SENTINEL).t()[1:2, 2:3]  # a one-element window of a transposed buffer
    template = {
        "s": scalar,
        "e": empty,
        "w": reshard.ShardedTensor("w", element, (4, 3), (1, 2)),
    }
    out = reshard.load(template, storage(tmp_path / "ckpt"), options=reshard.LoadOptions(memory_budget_bytes=16))
    assert out["s"].item() == 3.5 and out["e"].shape == (0, 3) and element.item() == _full((4, 3))[1, 2].item()


def _refused(template_of: Any, path: Path) -> list[str]:
    group = ThreadGroup(2)
    errors: list[str] = ["", ""]

    def rank(r: int) -> None:
        try:
            reshard.load(template_of(r), path, group=group.member(r))
        except reshard.CheckpointError as exc:
            errors[r] = f"{type(exc).__name__}: {exc}"

    on_threads(2, rank)
    return errors


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(1, 3).expand(4, 3),
        lambda: torch.zeros(12).as_strided((4, 3), (1, 1)),
        lambda: torch.zeros(4).as_strided((4, 3), (1, 0)),
    ],
    ids=["expanded", "overlapping_rows", "broadcast_column"],
)
def test_destinations_whose_elements_share_memory_are_refused(tmp_path: Path, make: Any) -> None:
    """An expanded (or otherwise self-overlapping) destination cannot hold a tensor: every rank raises a
    StateDictError naming the key, before anything is read, and the saved checkpoint is untouched."""
    reshard.save({"w": _full((4, 3))}, tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "metadata.json").read_bytes()
    errors = _refused(lambda r: {"w": make() if r == 1 else torch.zeros(4, 3)}, tmp_path / "ckpt")
    assert all(e.startswith("StateDictError") and "'w'" in e and "overlap" in e for e in errors), errors
    assert (tmp_path / "ckpt" / "metadata.json").read_bytes() == before
