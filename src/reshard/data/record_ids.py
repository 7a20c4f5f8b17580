"""The ids of a record buffer as runs, and the check that they are unique over the job.

A rank sends the coordinator its ids as runs of consecutive ids (``[start, end)``), or, when that would be
larger, as the sorted ids themselves: ids a job numbers with a counter per rank cost a few bytes however many
records there are, scattered ids 8 bytes each (10^6 records: 8 MB to the coordinator, checked in a vectorised
sort). The coordinator decides uniqueness exactly: sorted by start, runs of different ranks are disjoint iff
each starts at or after the end of the one before it.

A step's payload is framed as bytes: a 4-byte length, a JSON header, then the int64 array (little-endian).
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from reshard.errors import DataStateError

__all__ = ["first_duplicate", "frame", "id_runs", "runs_from_payload", "unframe"]

Int64Array = npt.NDArray[np.int64]

_HEADER = struct.Struct("<I")


def frame(header: dict[str, Any], array: Int64Array) -> bytes:
    """``header`` (JSON) followed by ``array``'s int64 little-endian bytes."""
    text = json.dumps(header, allow_nan=False).encode()
    return _HEADER.pack(len(text)) + text + np.ascontiguousarray(array, dtype="<i8").tobytes()


def unframe(payload: bytes) -> tuple[dict[str, Any], Int64Array]:
    """The inverse of :func:`frame`; DataStateError on anything else."""
    if len(payload) < _HEADER.size:
        raise DataStateError(f"a record step payload of {len(payload)} bytes")
    (length,) = _HEADER.unpack_from(payload)
    end = _HEADER.size + length
    body = payload[end:]
    if end > len(payload) or len(body) % 8:
        raise DataStateError("a malformed record step payload")
    header = json.loads(payload[_HEADER.size : end])
    if not isinstance(header, dict):
        raise DataStateError("a malformed record step payload")
    return header, np.frombuffer(body, dtype="<i8").astype(np.int64)


def id_runs(ids: torch.Tensor) -> tuple[str, Int64Array]:
    """How to send ``ids`` (unique): ``("runs", starts then ends)`` or ``("ids", the sorted ids)``, the smaller."""
    values = np.sort(ids.numpy().astype(np.int64, copy=False))
    if len(values) == 0:
        return "runs", np.zeros(0, dtype=np.int64)
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    starts = np.concatenate([values[:1], values[breaks]])
    ends = np.concatenate([values[breaks - 1] + 1, values[-1:] + 1])
    if 2 * len(starts) <= len(values):
        return "runs", np.concatenate([starts, ends])
    return "ids", values


def runs_from_payload(kind: object, array: Int64Array, count: int) -> tuple[Int64Array, Int64Array]:
    """``(starts, ends)`` of a rank's ids sent by :func:`id_runs`, checked to hold ``count`` sorted ids."""
    if kind == "ids":
        starts, ends = array, array + 1
    elif kind == "runs" and len(array) % 2 == 0:
        starts, ends = array[: len(array) // 2], array[len(array) // 2 :]
    else:
        raise DataStateError(f"malformed record ids of kind {kind!r}")
    if (
        (ends <= starts).any()
        or (len(starts) > 1 and (starts[1:] < ends[:-1]).any())
        or int((ends - starts).sum()) != count
        or (len(starts) and starts[0] < 0)
    ):
        raise DataStateError(f"the record ids sent do not describe {count} sorted unique non-negative ids")
    return starts, ends


def first_duplicate(parts: list[tuple[int, Int64Array, Int64Array]]) -> tuple[int, int, int] | None:
    """``(id, rank, other rank)`` of an id that two parts ``(rank, starts, ends)`` both hold, or None when every
    id is held once."""
    if not parts:
        return None
    starts = np.concatenate([p[1] for p in parts])
    ends = np.concatenate([p[2] for p in parts])
    owner = np.concatenate([np.full(len(p[1]), p[0], dtype=np.int64) for p in parts])
    order = np.argsort(starts, kind="stable")
    starts, ends, owner = starts[order], ends[order], owner[order]
    clash = np.flatnonzero(starts[1:] < ends[:-1])
    if len(clash) == 0:
        return None
    i = int(clash[0]) + 1
    return int(starts[i]), int(owner[i - 1]), int(owner[i])
