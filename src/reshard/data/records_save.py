"""Saving record buffers: :func:`records_state`, one agreed step, then ordinary sharded tensors.

Every rank of the group sends the coordinator its record count, rows per field, schema and ids (as runs, see
:mod:`reshard.data.record_ids`). The coordinator checks that the ranks agree (the key, one schema, ids unique
over the job) and lays the records out in the global, rank-major order: rank 0's records, then rank 1's, and so
on. Each rank gets back the common description (stored once, as a single-cell object) and its own offsets,
and describes its columns as boxes of global tensors at those offsets.
"""

from __future__ import annotations

import datetime
import itertools
import json
from typing import Any

import torch

from reshard.data.record_ids import first_duplicate, frame, id_runs, runs_from_payload, unframe
from reshard.data.records import RecordBuffer, Schema, check_plain_name, schema_from_json, schema_to_json
from reshard.errors import DataStateError, StateDictError
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.state.sharding import ShardedObject, ShardedTensor

__all__ = ["FORMAT", "VERSION", "record_keys", "records_state"]

FORMAT = "reshard.records"
"""The ``format`` of a record buffer's description (its single-cell object)."""

VERSION = 1
"""The version of that description this code writes and reads."""


def record_keys(key: str, schema: Schema) -> tuple[str, str, dict[str, str]]:
    """The checkpoint keys of buffer ``key``: its description object, its index tensor, and each field's tensor."""
    return f"{key}.meta", f"{key}.index", {name: f"{key}.fields.{name}" for name, _ in schema}


def records_state(
    key: str,
    buffer: RecordBuffer,
    *,
    group: Group = None,
    timeout: datetime.timedelta | float | None = None,
) -> dict[str, Any]:
    """The state-dict entries that save this rank's ``buffer`` as part of the job's record buffer ``key``.

    Collective: every rank of ``group`` calls it (one :meth:`~reshard.net.comm.Communicator.step_scatter`), then
    passes the result (inside its state dict) to :func:`reshard.save` or a manager's save with the same group.
    The records' global order is rank-major (rank 0's records in its buffer's order, then rank 1's ...).

    Returns:
        ``{"meta": ShardedObject, "index": ShardedTensor, "fields": {name: ShardedTensor}}``: the description
        (format, version, schema, record and row counts; a single cell that rank 0 writes), the int64 index
        ``[records, 1 + fields]`` (per record its id, then its rows of each field) and per field the global
        concatenation of every record's rows ``[rows, *trailing]``; this rank's entries are boxes at its offsets
        (zero-size on a rank with no records).

    Raises:
        DataStateError: on every rank, when the ranks' schemas or keys differ or an id is held twice over the job.
        StateDictError: ``buffer`` is not a RecordBuffer (on every rank).
    """
    comm = Communicator(group, timeout=timeout)

    def local() -> bytes:
        check_plain_name("records_state: the buffer key", key)
        if not isinstance(buffer, RecordBuffer):
            raise StateDictError(f"records_state({key!r}): a RecordBuffer, got {type(buffer).__name__}")
        kind, ids = id_runs(buffer.ids)
        schema = None if buffer.schema is None else schema_to_json(buffer.schema)
        rows = [int(column.shape[0]) for column in buffer.columns]
        header = {"key": key, "version": VERSION, "schema": schema, "count": len(buffer), "rows": rows, "ids": kind}
        return frame(header, ids)

    # the step's name holds no key: ranks passing different keys meet in one step, refused by _combine
    meta, reply = comm.step_scatter("records_state", local, _combine)
    _, offsets = unframe(reply)
    assert isinstance(buffer, RecordBuffer)  # local() raised on every rank otherwise
    return _entries(key, buffer, meta, offsets, comm.rank)


def _combine(payloads: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
    """On the coordinator: check the ranks' descriptions, lay the records out rank-major; the description and
    each rank's ``[record offset, row offset per field]``."""
    described = [unframe(p) for p in payloads]
    headers = [h for h, _ in described]
    _agree(headers, "key", "keys")
    _agree(headers, "version", "versions of reshard")
    schemas = {json_key(h["schema"]) for h in headers if h["schema"] is not None}
    if len(schemas) > 1:
        listing = "; ".join(f"rank {r}: {h['schema']}" for r, h in enumerate(headers) if h["schema"] is not None)
        raise DataStateError(f"record buffer {headers[0]['key']!r}: the ranks' schemas differ ({listing})")
    schema_json: list[Any] = next((h["schema"] for h in headers if h["schema"] is not None), [])
    schema = schema_from_json(schema_json)
    parts = []
    for rank, (header, array) in enumerate(described):
        rows = header["rows"] if header["schema"] is not None else [0] * len(schema)
        if header["schema"] is None and header["count"]:
            raise DataStateError(f"rank {rank} sent {header['count']} records without a schema")
        header["rows"] = rows
        parts.append((rank, *runs_from_payload(header["ids"], array, header["count"])))
    duplicate = first_duplicate(parts)
    if duplicate is not None:
        ident, first, second = duplicate
        raise DataStateError(
            f"record buffer {headers[0]['key']!r}: record id {ident} is held by rank {first} and rank {second}; "
            "ids must be unique over the job"
        )
    record_starts = [0, *itertools.accumulate(h["count"] for h in headers)]
    row_starts = [[0] * len(schema)]
    for header in headers:
        row_starts.append([a + b for a, b in zip(row_starts[-1], header["rows"], strict=True)])
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "schema": schema_json,
        "records": record_starts[-1],
        "rows": row_starts[-1],
    }
    replies = [frame({}, torch.tensor([record_starts[r], *row_starts[r]]).numpy()) for r in range(len(headers))]
    return meta, replies


def json_key(value: object) -> str:
    """A canonical text of a JSON value, to compare values."""
    return json.dumps(value, sort_keys=True)


def _agree(headers: list[dict[str, Any]], name: str, what: str) -> None:
    values = {json_key(h[name]) for h in headers}
    if len(values) > 1:
        listing = ", ".join(f"rank {r}: {h[name]!r}" for r, h in enumerate(headers))
        raise DataStateError(f"records_state: the ranks passed different {what} ({listing})")


def _entries(key: str, buffer: RecordBuffer, meta: dict[str, Any], offsets: Any, rank: int) -> dict[str, Any]:
    """This rank's state-dict entries, from the agreed description and its offsets."""
    schema = schema_from_json(meta["schema"])
    meta_key, index_key, field_keys = record_keys(key, schema)
    records, rows = int(meta["records"]), [int(n) for n in meta["rows"]]
    record_offset, row_offsets = int(offsets[0]), [int(n) for n in offsets[1:]]
    n = len(buffer)
    if buffer.schema is None:  # an empty rank that knew no fields takes the job's
        columns = tuple(torch.empty((0, *spec.trailing), dtype=spec.dtype) for _, spec in schema)
        lengths = torch.empty((0, len(schema)), dtype=torch.int64)
    else:
        columns, lengths = buffer.columns, buffer.lengths
    index = torch.cat([buffer.ids.reshape(n, 1), lengths], dim=1)
    fields = {
        name: ShardedTensor(
            field_keys[name], column, (rows[f], *spec.trailing), (row_offsets[f],) + (0,) * len(spec.trailing)
        )
        for f, ((name, spec), column) in enumerate(zip(schema, columns, strict=True))
    }
    return {
        "meta": ShardedObject(meta_key, meta, (1,), (0,), replica_id=rank),
        "index": ShardedTensor(index_key, index, (records, 1 + len(schema)), (record_offset, 0)),
        "fields": fields,
    }
