"""``reshard diff``: compare two checkpoints tensor by tensor, in bounded memory.

Tensors are compared element by element in float64 (complex128 for complex tensors), one slab at a
time, whatever layouts saved them. Per tensor the report gives the largest absolute difference
``max |a - b|`` and the largest relative difference ``max |a - b| / |b|`` (B is the reference; an element
where ``b == 0`` and ``a != 0`` counts as infinitely far). Two NaNs at the same place are equal, a NaN
facing a number is infinitely far. An element is within tolerance when ``|a - b| <= atol + rtol * |b|``
(``torch.allclose``'s rule); the defaults, 0 and 0, ask for equal values. Integers above 2**53 lose
precision in float64, so two such integers that differ in their lowest bits may compare equal.

Keys present on one side only, differing global shapes and (unless ``ignore_dtypes``) differing dtypes
are differences too. ShardedObject cells are compared by their stored bytes, common values by value.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.flows.progress import Progress, reporting
from reshard.interop.offline import CheckpointReader
from reshard.metadata import TensorMetadata
from reshard.state.codec import encode_tagged
from reshard.storage import CheckpointLocation

__all__ = ["DEFAULT_DIFF_SLAB_BYTES", "DiffReport", "EntryDiff", "TensorDiff", "diff_checkpoints"]

DEFAULT_DIFF_SLAB_BYTES = 8 * 1024 * 1024
"""Bytes of float64 per slab and side; a comparison holds a few such slabs at once."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorDiff:
    """How tensor ``key`` differs between A and B.

    ``max_abs``, ``max_rel`` and ``mismatched`` (elements outside the tolerance) are None when the values
    were not compared (the key is on one side only, or the global shapes differ). ``problem`` says what
    makes this tensor a difference, or is None when it is not one.
    """

    key: str
    dtype_a: str | None
    dtype_b: str | None
    shape_a: tuple[int, ...] | None
    shape_b: tuple[int, ...] | None
    max_abs: float | None = None
    max_rel: float | None = None
    mismatched: int | None = None
    problem: str | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "shape_a": list(self.shape_a) if self.shape_a is not None else None,
            "shape_b": list(self.shape_b) if self.shape_b is not None else None,
            "max_abs": _json_float(self.max_abs),
            "max_rel": _json_float(self.max_rel),
            "mismatched": self.mismatched,
            "ok": self.problem is None,
            "problem": self.problem,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryDiff:
    """A ShardedObject (``kind`` "object"), common value (``kind`` "common") or scaled tensor's record
    (``kind`` "scaled": format, block, scale keys) that differs."""

    kind: str
    key: str
    problem: str

    def to_json_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "problem": self.problem}


@dataclass(frozen=True, slots=True, kw_only=True)
class DiffReport:
    """The comparison of checkpoints ``a`` and ``b``: every tensor of either, and the differing objects
    and common values. ``ok`` is True when nothing differs beyond the tolerance."""

    a: str
    b: str
    atol: float
    rtol: float
    tensors: list[TensorDiff] = field(default_factory=list)
    entries: list[EntryDiff] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.entries and all(t.problem is None for t in self.tensors)

    @property
    def problems(self) -> int:
        """The number of differences."""
        return len(self.entries) + sum(t.problem is not None for t in self.tensors)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "atol": self.atol,
            "rtol": self.rtol,
            "ok": self.ok,
            "differences": self.problems,
            "tensors": [t.to_json_dict() for t in self.tensors],
            "entries": [e.to_json_dict() for e in self.entries],
        }


def _json_float(value: float | None) -> float | str | None:
    """JSON has no infinity or NaN: those are written as strings."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


DIFF_BLOCK_ELEMENTS = 32_000
"""Elements compared at once by the fast path: three float64 blocks of this size stay in the CPU's cache, so
a pass over a block costs no memory traffic; and it is below torch's parallel grain (32768 elements), so each
operation runs on the calling thread: blocks split over the intra-op threads collapsed to a tenth of the
speed on a machine whose cores other processes were using."""


class _Accumulator:
    """Running maxima of one tensor's comparison.

    :meth:`add_slab` is the fast path: it converts a block of each side into reused float64 buffers and
    makes about eight passes over them (the exact rules below take twenty over slab-sized temporaries,
    which made a dtype-converting diff run at a fraction of the read speed). A block whose largest
    difference is not finite holds a NaN or an infinity, and is compared again by :meth:`add`, the exact
    rules, so both give the same maxima and counts.
    """

    def __init__(self, atol: float, rtol: float, work: torch.dtype) -> None:
        self.atol = atol
        self.rtol = rtol
        self.work = work
        self.max_abs = 0.0
        self.max_rel = 0.0
        self.mismatched = 0
        self._blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Compare ``a`` with ``b`` (both in the work dtype) by the exact rules: NaNs, infinities, zeros."""
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        distance = (a - b).abs().to(torch.float64)
        distance = torch.where(same, 0.0, distance)
        distance = torch.nan_to_num(distance, nan=math.inf, posinf=math.inf)
        reference = b.abs().to(torch.float64)
        relative = torch.where(distance == 0, 0.0, distance / reference)
        relative = torch.nan_to_num(relative, nan=math.inf, posinf=math.inf)
        if distance.numel():
            self.max_abs = max(self.max_abs, float(distance.max()))
            self.max_rel = max(self.max_rel, float(relative.max()))
        if self.rtol:
            allowed = self.atol + self.rtol * torch.nan_to_num(reference, nan=0.0)
            self.mismatched += int((distance > allowed).sum())
        else:  # not atol + 0 * |b|, which is NaN where b is infinite
            self.mismatched += int((distance > self.atol).sum())

    def add_slab(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Compare the 1-D slabs ``a`` and ``b`` (equal lengths, any dtypes, as stored), block by block."""
        if self.work.is_complex:
            self.add(a.to(self.work), b.to(self.work))
            return
        for start in range(0, a.numel(), DIFF_BLOCK_ELEMENTS):
            self._add_block(a[start : start + DIFF_BLOCK_ELEMENTS], b[start : start + DIFF_BLOCK_ELEMENTS])

    def _add_block(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self._blocks is None:

            def block() -> torch.Tensor:
                return torch.empty(DIFF_BLOCK_ELEMENTS, dtype=torch.float64)

            self._blocks = (block(), block(), block())
        count = a.numel()
        distance, reference, relative = (block[:count] for block in self._blocks)
        distance.copy_(a)
        reference.copy_(b)
        distance.sub_(reference).abs_()
        largest = float(distance.max())
        if not math.isfinite(largest):  # a NaN or an infinity on a side, or an overflow: the exact rules
            self.add(a.to(torch.float64), b.to(torch.float64))
            return
        # Every value is finite here, so a - b is 0 exactly where a == b, and d / |b| is NaN only for 0 / 0.
        reference.abs_()
        torch.div(distance, reference, out=relative)
        relative.nan_to_num_(nan=0.0, posinf=math.inf)
        self.max_abs = max(self.max_abs, largest)
        self.max_rel = max(self.max_rel, float(relative.max()))
        if largest <= self.atol:  # atol + rtol * |b| >= atol: nothing is beyond the tolerance
            return
        if self.rtol:
            reference.mul_(self.rtol).add_(self.atol)
            self.mismatched += int(torch.gt(distance, reference).sum())
        else:
            self.mismatched += int(torch.gt(distance, self.atol).sum())


def diff_checkpoints(
    a: CheckpointLocation,
    b: CheckpointLocation,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    ignore_dtypes: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    slab_bytes: int = DEFAULT_DIFF_SLAB_BYTES,
) -> DiffReport:
    """Compare checkpoint ``a`` with checkpoint ``b`` (the reference). Not collective.

    Args:
        a, b: the checkpoints (directories, URLs or Storages).
        atol, rtol: the tolerance: an element differs when ``|a - b| > atol + rtol * |b|``.
        ignore_dtypes: compare the values of tensors whose dtypes differ without counting the dtype
            difference itself (e.g. a bf16 copy against its fp32 source, with a tolerance).
        storage_options: for object-store URLs (both sides).
        progress: told the bytes of tensor data read (both sides).
        slab_bytes: float64 bytes per side read at once (fewer as stored in a narrower dtype).

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError: a side is not a valid
            checkpoint, or a checksum fails while reading.
    """
    if atol < 0 or rtol < 0:
        raise ValueError(f"atol and rtol must not be negative, got {atol} and {rtol}")
    with (
        CheckpointReader(a, storage_options=storage_options) as left,
        CheckpointReader(b, storage_options=storage_options) as right,
    ):
        report = DiffReport(a=left.describe(), b=right.describe(), atol=atol, rtol=rtol)
        ta, tb = left.metadata.tensors, right.metadata.tensors
        comparable = [k for k in sorted(ta.keys() & tb.keys()) if ta[k].global_shape == tb[k].global_shape]
        total = sum(ta[k].nbytes + tb[k].nbytes for k in comparable)
        with reporting(progress, total, "diff") as advance:
            for key in sorted(ta.keys() | tb.keys()):
                report.tensors.append(_diff_tensor(left, right, key, atol, rtol, ignore_dtypes, slab_bytes, advance))
        report.entries.extend(_diff_scaled(left, right))
        report.entries.extend(_diff_objects(left, right))
        report.entries.extend(_diff_common(left, right))
        return report


def _diff_tensor(
    left: CheckpointReader,
    right: CheckpointReader,
    key: str,
    atol: float,
    rtol: float,
    ignore_dtypes: bool,
    slab_bytes: int,
    advance: Callable[[int], None],
) -> TensorDiff:
    sa: TensorMetadata | None = left.metadata.tensors.get(key)
    sb: TensorMetadata | None = right.metadata.tensors.get(key)
    if sa is None or sb is None:
        return TensorDiff(
            key=key,
            dtype_a=sa.dtype if sa else None,
            dtype_b=sb.dtype if sb else None,
            shape_a=sa.global_shape if sa else None,
            shape_b=sb.global_shape if sb else None,
            problem=f"only in {'A' if sa is not None else 'B'}",
        )
    base = TensorDiff(key=key, dtype_a=sa.dtype, dtype_b=sb.dtype, shape_a=sa.global_shape, shape_b=sb.global_shape)
    if sa.global_shape != sb.global_shape:
        return dataclasses.replace(
            base, problem=f"global shapes differ: {list(sa.global_shape)} vs {list(sb.global_shape)}"
        )
    complex_values = sa.torch_dtype.is_complex or sb.torch_dtype.is_complex
    work = torch.complex128 if complex_values else torch.float64
    total = math.prod(sa.global_shape)
    per = max(1, slab_bytes // work.itemsize)
    accumulator = _Accumulator(atol, rtol, work)
    # Slabs are read in their stored dtypes (no float64 copy of a whole slab). With one dtype they are
    # compared byte for byte first: equal bytes are equal values (NaNs included), so only slabs that
    # differ pay for the float64 arithmetic.
    same_dtype = sa.dtype == sb.dtype
    buffer_a = left.slab_buffer(min(per, total) * sa.torch_dtype.itemsize).view(sa.torch_dtype)
    buffer_b = right.slab_buffer(min(per, total) * sb.torch_dtype.itemsize).view(sb.torch_dtype)
    for start in range(0, total, per):
        count = min(per, total - start)
        slab_a, slab_b = buffer_a[:count], buffer_b[:count]
        left.read_flat(key, start, slab_a)
        right.read_flat(key, start, slab_b)
        if not same_dtype or not torch.equal(slab_a.view(torch.uint8), slab_b.view(torch.uint8)):
            accumulator.add_slab(slab_a, slab_b)
        advance(count * (sa.torch_dtype.itemsize + sb.torch_dtype.itemsize))
    problems = []
    if sa.dtype != sb.dtype and not ignore_dtypes:
        problems.append(f"dtypes differ: {sa.dtype} vs {sb.dtype}")
    if accumulator.mismatched:
        problems.append(f"{accumulator.mismatched} of {total} elements differ beyond the tolerance")
    return dataclasses.replace(
        base,
        max_abs=accumulator.max_abs,
        max_rel=accumulator.max_rel,
        mismatched=accumulator.mismatched,
        problem="; ".join(problems) or None,
    )


def _diff_scaled(left: CheckpointReader, right: CheckpointReader) -> list[EntryDiff]:
    """The scaled-tensor records that differ (format, block, the keys of the scales): the same bytes under
    another record (or none) decode to other values, or load without their scales."""
    out = []
    sa, sb = left.metadata.scaled, right.metadata.scaled
    for key in sorted(sa.keys() | sb.keys()):
        a, b = sa.get(key), sb.get(key)
        if a is None or b is None:
            only = a or b
            assert only is not None
            side = "A" if a is not None else "B"
            problem = f"only in {side}: a scaled tensor of {only.describe()} there, plain tensors in the other"
            out.append(EntryDiff(kind="scaled", key=key, problem=problem))
        elif a != b:
            described = [f"{r.describe()}, scales in {r.scale_key!r} and {r.global_scale_key!r}" for r in (a, b)]
            out.append(EntryDiff(kind="scaled", key=key, problem=f"{described[0]} vs {described[1]}"))
    return out


def _diff_objects(left: CheckpointReader, right: CheckpointReader) -> list[EntryDiff]:
    out = []
    oa, ob = left.metadata.objects, right.metadata.objects
    for key in sorted(oa.keys() | ob.keys()):
        if key not in oa or key not in ob:
            out.append(EntryDiff(kind="object", key=key, problem=f"only in {'A' if key in oa else 'B'}"))
            continue
        if oa[key].global_shape != ob[key].global_shape:
            grids = f"{list(oa[key].global_shape)} vs {list(ob[key].global_shape)}"
            out.append(EntryDiff(kind="object", key=key, problem=f"grids differ: {grids}"))
            continue
        cells_b = {e.offset: e for e in ob[key].entries}
        for entry in oa[key].entries:
            other = cells_b.get(entry.offset)
            if other is None or left.read_object_blob(key, entry) != right.read_object_blob(key, other):
                out.append(EntryDiff(kind="object", key=key, problem=f"cell {list(entry.offset)} differs"))
    return out


def _diff_common(left: CheckpointReader, right: CheckpointReader) -> list[EntryDiff]:
    out = []
    ca, cb = left.metadata.common, right.metadata.common
    for path in sorted(ca.keys() | cb.keys()):
        if path not in ca or path not in cb:
            out.append(EntryDiff(kind="common", key=path, problem=f"only in {'A' if path in ca else 'B'}"))
            continue
        encoded_a = json.dumps(encode_tagged(ca[path], where=path))
        encoded_b = json.dumps(encode_tagged(cb[path], where=path))
        if encoded_a != encoded_b:
            out.append(EntryDiff(kind="common", key=path, problem=f"{encoded_a} vs {encoded_b}"))
    return out
