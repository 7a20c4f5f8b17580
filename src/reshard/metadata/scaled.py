"""The ``scaled`` member of ``metadata.json`` (version 5): one record per scaled tensor, read hostile-proof.

A record says which format and block shape a low-precision tensor has and which tensors of the checkpoint
hold its scales and global scale (docs/format.md section 16). A reader trusts nothing: the format must be
known, the block must fit the format and the tensor, the data and scale dtypes must be the format's, the
scales' global shape must be the grid the data's shape and block give, and the global scale must be a
0-d float32 tensor exactly when the format has one; else :class:`~reshard.CorruptCheckpointError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from reshard.errors import ShardingError
from reshard.metadata.model import Metadata, ObjectMetadata, TensorMetadata
from reshard.state.dtypes import BYTE_VIEW_DTYPES, dtype_name
from reshard.state.lowprec import FORMATS, ScaleFormat, normalize_block, scale_grid_shape, stored_block
from reshard.state.scaled import ScaledRecord

__all__ = ["check_record", "parse_scaled", "stored_dtype_names", "with_scaled"]

Fail = Callable[[str, str], Exception]
_FIELDS = {"format", "block", "scale", "global_scale"}


def stored_dtype_names(dtypes: tuple[Any, ...]) -> set[str]:
    """The dtype names a checkpoint records for tensors of ``dtypes`` (byte-only dtypes as ``uint8``)."""
    return {"uint8" if d in BYTE_VIEW_DTYPES else dtype_name(d) for d in dtypes}


def parse_scaled(
    value: object, tensors: Mapping[str, TensorMetadata], objects: Mapping[str, ObjectMetadata], fail: Fail
) -> dict[str, ScaledRecord]:
    """The records of the ``scaled`` member, each checked against the tensors it names.

    Raises:
        whatever ``fail(path, message)`` returns (the parser's CorruptCheckpointError), for anything wrong.
    """
    if not isinstance(value, dict):
        raise fail("scaled", "expected an object")
    out: dict[str, ScaledRecord] = {}
    used: dict[str, str] = {}
    for key, entry in value.items():
        path = f"scaled[{key!r}]"
        record = _record(key, entry, path, fail)
        for part in (record.scale_key, record.global_scale_key):
            if part is None:
                continue
            if part in used or part in value:
                raise fail(path, f"tensor {part!r} holds the scales of two scaled tensors, or is itself one")
            used[part] = key
        problem = check_record(record, tensors, objects)
        if problem:
            raise fail(path, problem)
        out[key] = record
    return out


def _record(key: str, entry: object, path: str, fail: Fail) -> ScaledRecord:
    if not isinstance(entry, dict) or set(entry) != _FIELDS:
        raise fail(path, f"expected an object with fields {sorted(_FIELDS)}")
    name = entry["format"]
    if not isinstance(name, str) or name not in FORMATS:
        raise fail(f"{path}.format", f"unknown low-precision format {name!r}; this reshard knows {sorted(FORMATS)}")
    block = entry["block"]
    if not isinstance(block, list) or not all(b is None or (type(b) is int and 1 <= b <= 2**62) for b in block):
        raise fail(f"{path}.block", "expected a list of positive integers or nulls")
    scale, global_scale = entry["scale"], entry["global_scale"]
    if not isinstance(scale, str) or not (global_scale is None or isinstance(global_scale, str)):
        raise fail(path, "scale must be a tensor key, global_scale a tensor key or null")
    return ScaledRecord(key=key, format=name, block=tuple(block), scale_key=scale, global_scale_key=global_scale)


def check_record(
    record: ScaledRecord, tensors: Mapping[str, TensorMetadata], objects: Mapping[str, ObjectMetadata]
) -> str | None:
    """What is wrong with ``record`` against the checkpoint's tensors, or None."""
    fmt = FORMATS[record.format]
    data = tensors.get(record.key)
    if data is None:
        kind = "an object" if record.key in objects else "not in the checkpoint"
        return f"{record.key!r} is recorded as a scaled tensor, but it is {kind}, not a tensor"
    try:
        block = normalize_block(fmt, record.block, len(data.global_shape), key=record.key)
        grid = scale_grid_shape(data.global_shape, stored_block(fmt, block))
    except ShardingError as exc:
        return str(exc)
    if block != record.block:
        return f"block {list(record.block)} is not the block of format {fmt.name}: {list(block)}"
    if data.dtype not in stored_dtype_names(fmt.data_dtypes):
        return f"the data's dtype {data.dtype} is not one of format {fmt.name}"
    return _check_scale_tensors(record, fmt, grid, tensors)


def _check_scale_tensors(
    record: ScaledRecord, fmt: ScaleFormat, grid: tuple[int, ...], tensors: Mapping[str, TensorMetadata]
) -> str | None:
    scale = tensors.get(record.scale_key)
    if scale is None or record.scale_key == record.key:
        return f"the scale tensor {record.scale_key!r} is missing"
    if scale.global_shape != grid:
        return (
            f"the scales {record.scale_key!r} have shape {list(scale.global_shape)}, but the data's shape "
            f"{list(tensors[record.key].global_shape)} and the block {list(record.block)} give {list(grid)}"
        )
    if scale.dtype not in stored_dtype_names(fmt.scale_dtypes):
        return f"the scales' dtype {scale.dtype} is not one of format {fmt.name}"
    if (record.global_scale_key is None) != (fmt.global_scale is None):
        return f"format {fmt.name} {'has' if fmt.global_scale else 'has no'} global scale"
    if record.global_scale_key is not None:
        glob = tensors.get(record.global_scale_key)
        if glob is None or glob.global_shape != () or glob.dtype != "float32":
            return f"the global scale {record.global_scale_key!r} must be a 0-d float32 tensor of the checkpoint"
    return None


def with_scaled(metadata: Metadata, records: Mapping[str, ScaledRecord]) -> Metadata:
    """``metadata`` with the save's scaled records, each checked as a reader will check it (so that a save
    never commits what a load refuses).

    Raises:
        ShardingError: a record does not fit the saved tensors.
    """
    for record in records.values():
        problem = check_record(record, metadata.tensors, metadata.objects)
        if problem:
            raise ShardingError(f"scaled tensor {record.key!r}: {problem}")
    return replace(metadata, scaled=dict(records))
