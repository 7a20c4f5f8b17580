"""Load planning: which saved bytes each target box needs, and how to read them.

Pure: given the checkpoint's metadata and the boxes a rank wants (on its own, possibly different,
layout), return the reads. Each target box is intersected with the saved boxes of its key that it
overlaps (found through an index, so the cost does not grow with the number of saved boxes); every overlap
becomes one :class:`ReadItem`, read with the fewest requests that keep the read amplification within the
bound (see :func:`reshard.geometry.boxes.read_pattern`). Before that, :func:`check_template` matches a
rank's template with the metadata (keys, shapes, dtypes, destinations that can hold a value per element).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from reshard.errors import MismatchError
from reshard.geometry.boxes import Box, ReadPattern, read_pattern, row_major_strides
from reshard.geometry.grid import BoxIndex
from reshard.metadata import Metadata, SavedBox, SavedBoxes
from reshard.planning.objects import ObjectGrid, ObjectMatch, match_objects
from reshard.planning.scaled import scaled_mismatches
from reshard.state.dtypes import dtype_name, is_lossy_cast
from reshard.state.statedict import FlatStateDict, check_tensors, is_empty_container

__all__ = [
    "DEFAULT_MAX_READ_AMPLIFICATION",
    "DEFAULT_MAX_READ_BYTES",
    "LoadPlan",
    "ReadItem",
    "TargetPiece",
    "check_template",
    "plan_load",
]

DEFAULT_MAX_READ_AMPLIFICATION = 1.10
"""Bytes read / bytes needed allowed when merging strided runs into fewer, larger reads."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TargetPiece:
    """A box a rank wants filled: ``box`` of global tensor ``key``."""

    key: str
    box: Box


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadItem:
    """Fill ``overlap`` (global coordinates) of target piece ``target`` from saved box ``saved_index`` of
    ``key``, which lies at ``byte_offset`` of file ``file``; ``pattern`` says which bytes to read."""

    target: int
    key: str
    overlap: Box
    saved_index: int
    saved_box: Box
    file: int
    byte_offset: int
    itemsize: int
    pattern: ReadPattern

    @property
    def bytes_needed(self) -> int:
        return self.pattern.needed * self.itemsize

    @property
    def bytes_read(self) -> int:
        return self.pattern.read_elements * self.itemsize

    @property
    def requests(self) -> int:
        return self.pattern.count


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadPlan:
    """All reads of one rank, sorted by file and offset."""

    items: tuple[ReadItem, ...]

    @property
    def bytes_needed(self) -> int:
        return sum(i.bytes_needed for i in self.items)

    @property
    def bytes_read(self) -> int:
        return sum(i.bytes_read for i in self.items)

    @property
    def requests(self) -> int:
        return sum(i.requests for i in self.items)


DEFAULT_MAX_READ_BYTES = 64 * 1024 * 1024
"""Largest single read item: bigger overlaps are split along their leading axes, which bounds the
staging memory of a load (and makes reads of object stores concurrent)."""


def _split_overlap(
    saved: Box,
    overlap: Box,
    itemsize: int,
    max_amplification: float | None,
    max_bytes: int,
    chunk_bytes: int = 0,
    request_cost_bytes: int = 0,
) -> list[tuple[Box, ReadPattern]]:
    """Cut ``overlap`` into consecutive slabs along its first axes so that each slab's read is at most
    ``max_bytes`` (a slab of one element is never cut further).

    What counts is the most a slab can need in memory: its planned reads, the range of the saved box it
    spans (what a memory-mapped copy touches) and, with checksum chunks of ``chunk_bytes`` that fit twice
    in ``max_bytes``, that range widened to whole chunks (a read verifies every chunk it touches, whole).
    """
    pattern = read_pattern(
        saved, overlap, max_amplification=max_amplification, request_cost=request_cost_bytes // itemsize
    )
    strides = row_major_strides(saved.shape)
    extent_elements = 1 + sum((n - 1) * st for n, st in zip(overlap.shape, strides, strict=True))
    need = max(pattern.read_elements, extent_elements) * itemsize
    if chunk_bytes and 2 * chunk_bytes <= max_bytes and pattern.needed:
        first = pattern.first * itemsize
        last = first + extent_elements * itemsize
        need = max(need, -(-last // chunk_bytes) * chunk_bytes - first // chunk_bytes * chunk_bytes)
    if need <= max_bytes:
        return [(overlap, pattern)]
    axis = next((a for a, extent in enumerate(overlap.shape) if extent > 1), None)
    if axis is None:
        return [(overlap, pattern)]
    extent = overlap.shape[axis]
    parts = min(extent, max(2, -(-need // max_bytes)))
    step = -(-extent // parts)
    row_bytes = math.prod(overlap.shape[axis + 1 :]) * itemsize
    whole_rows = overlap.shape[axis + 1 :] == saved.shape[axis + 1 :] and all(n == 1 for n in overlap.shape[:axis])
    if chunk_bytes and whole_rows and row_bytes:
        # Slabs of whole rows are contiguous: make them whole checksum chunks, so that no chunk is read
        # (and verified) by two slabs.
        unit = math.lcm(row_bytes, chunk_bytes) // row_bytes
        budget = max_bytes - 2 * chunk_bytes if 2 * chunk_bytes <= max_bytes else max_bytes
        if unit * row_bytes <= budget:
            step = (budget // (unit * row_bytes)) * unit
    out = []
    for start in range(0, extent, step):
        size = min(step, extent - start)
        offset = tuple(o + start if a == axis else o for a, o in enumerate(overlap.offset))
        shape = tuple(size if a == axis else n for a, n in enumerate(overlap.shape))
        out.extend(
            _split_overlap(
                saved, Box(offset, shape), itemsize, max_amplification, max_bytes, chunk_bytes, request_cost_bytes
            )
        )
    return out


def plan_load(
    metadata: Metadata,
    targets: list[TargetPiece],
    *,
    max_read_amplification: float | None = DEFAULT_MAX_READ_AMPLIFICATION,
    max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
    request_cost_bytes: int = 0,
) -> LoadPlan:
    """The reads that fill every target piece from the checkpoint.

    Strided runs are merged into larger reads within ``max_read_amplification``, or, when it is None, where
    a gap costs less to read than a request does (``request_cost_bytes``, the storage's).

    The caller has checked that every target's key exists with a matching global shape; saved boxes
    tile their tensor (validated when the metadata was parsed), so every target element is covered by
    exactly one read. No read item is larger than ``max_read_bytes`` unless a single row of its overlap
    already is.

    The saved boxes overlapping a target are found through each tensor's :class:`BoxIndex` (built once
    per tensor this rank touches), in time that grows with the number of overlaps, not with the number of
    saved boxes; the reads are the same as comparing each target with every saved box.
    """
    items: list[ReadItem] = []
    lookups: dict[str, _Saved] = {}
    for target_index, target in enumerate(targets):
        tensor = metadata.tensors[target.key]
        saved = lookups.get(target.key)
        if saved is None:
            saved = lookups[target.key] = _Saved.of(tensor.boxes, len(tensor.global_shape))
        itemsize = tensor.torch_dtype.itemsize
        for saved_index in saved.index.overlapping(target.box):
            saved_box = Box(tuple(saved.offset[saved_index].tolist()), tuple(saved.shape[saved_index].tolist()))
            whole = target.box.intersect(saved_box)
            if whole is None:  # the index returns only overlapping boxes
                continue
            file, byte_offset = int(saved.file[saved_index]), int(saved.byte_offset[saved_index])
            for overlap, pattern in _split_overlap(
                saved_box,
                whole,
                itemsize,
                max_read_amplification,
                max_read_bytes,
                metadata.checksum_chunk_bytes,
                request_cost_bytes,
            ):
                items.append(
                    ReadItem(
                        target=target_index,
                        key=target.key,
                        overlap=overlap,
                        saved_index=saved_index,
                        saved_box=saved_box,
                        file=file,
                        byte_offset=byte_offset,
                        itemsize=itemsize,
                        pattern=pattern,
                    )
                )
    items.sort(key=lambda i: (i.file, i.byte_offset + i.pattern.first * i.itemsize))
    return LoadPlan(items=tuple(items))


@dataclass(frozen=True, slots=True)
class _Saved:
    """The saved boxes of one tensor as the planner needs them: columns and their index."""

    offset: npt.NDArray[np.int64]
    shape: npt.NDArray[np.int64]
    file: npt.NDArray[np.int64]
    byte_offset: npt.NDArray[np.int64]
    index: BoxIndex

    @classmethod
    def of(cls, boxes: Sequence[SavedBox], ndim: int) -> _Saved:
        if isinstance(boxes, SavedBoxes):
            c = boxes.columns
            return cls(c.offset, c.shape, c.file, c.byte_offset, boxes.lookup())
        offset = np.array([b.offset for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
        shape = np.array([b.shape for b in boxes], dtype=np.int64).reshape(len(boxes), ndim)
        return cls(
            offset,
            shape,
            np.array([b.file for b in boxes], dtype=np.int64),
            np.array([b.byte_offset for b in boxes], dtype=np.int64),
            BoxIndex(offset, shape),
        )


def check_template(
    flat: FlatStateDict,
    metadata: Metadata,
    *,
    strict: bool,
    allow_dtype_cast: bool,
    allow_lossy_cast: bool,
    object_grid: ObjectGrid = "exact",
) -> tuple[list[str], ObjectMatch]:
    """Compare the template with the checkpoint. Return the missing entries (when not strict) and how the
    ShardedObject cells matched under the ``object_grid`` policy (:func:`~reshard.planning.objects.match_objects`);
    drop the missing entries, and the object cells the policy leaves as they are, from ``flat.tensors`` and
    ``flat.objects``, so that only present entries are planned and read.

    Raises:
        StateDictError: template tensors reshard cannot fill (:func:`reshard.state.statedict.check_tensors`: on the
            meta device, not dense, a freed storage, elements that overlap in memory).
        MismatchError: a global shape differs, a dtype differs and the cast is not allowed, an object's
            grid differs and ``object_grid`` refuses the change, or entries are missing (with ``strict``).
    """
    check_tensors(flat.tensors, what="load: template", fill=True)
    missing: list[str] = []
    mismatches: list[str] = scaled_mismatches(flat, metadata)
    # A ScaledTensor whose data the checkpoint lacks is missing as a whole: a part filled from a tensor that
    # is not its data's scale would mix two states.
    lacking = [r for r in flat.scaled.values() if r.key not in metadata.tensors]
    absent = {k for r in lacking for k in (r.scale_key, r.global_scale_key) if k is not None}
    present = []
    for st in flat.tensors:
        saved = None if st.key in absent else metadata.tensors.get(st.key)
        if saved is None and st.key in metadata.objects:  # not missing: another kind (strict or not)
            mismatches.append(f"{st.key!r}: saved as a ShardedObject, requested as a tensor")
            continue
        if saved is None:
            missing.append(f"tensor {st.key!r}")
            continue
        if saved.global_shape != st.saved_shape:
            kind = "logical shape" if st.logical_shape is not None else "global shape"
            mismatches.append(
                f"tensor {st.key!r}: saved global shape {list(saved.global_shape)}, requested {kind} "
                f"{list(st.saved_shape)}"
            )
        elif saved.dtype != dtype_name(st.data.dtype) and not allow_dtype_cast:
            mismatches.append(
                f"tensor {st.key!r}: saved dtype {saved.dtype}, requested {dtype_name(st.data.dtype)} "
                "(allow_dtype_cast=False)"
            )
        elif is_lossy_cast(saved.torch_dtype, st.data.dtype) and not allow_lossy_cast:
            mismatches.append(
                f"tensor {st.key!r}: saved dtype {saved.dtype}, requested {dtype_name(st.data.dtype)}: a lossy "
                "conversion (LoadOptions(allow_lossy_cast=True) allows it)"
            )
        present.append(st)
    mismatches += [
        f"{key!r}: saved as a tensor, requested as a ShardedObject"
        for key in sorted({o.key for o in flat.objects if o.key in metadata.tensors and o.key not in metadata.objects})
    ]
    objects = match_objects(flat.objects, metadata.objects, object_grid)
    mismatches += objects.mismatches
    missing += objects.missing
    for path, value in flat.common.items():
        # An empty container is structure: checkpoints saved before empty containers were kept lack it.
        if path not in metadata.common and not is_empty_container(value):
            missing.append(f"common value {path!r}")
    if mismatches:
        raise MismatchError("the checkpoint does not match the template: " + "; ".join(mismatches))
    if missing and strict:
        raise MismatchError(
            f"{len(missing)} entries of the template are missing from the checkpoint: "
            + ", ".join(missing[:50])
            + (" ..." if len(missing) > 50 else "")
        )
    flat.tensors = present
    flat.objects = list(objects.present)
    return missing, objects
