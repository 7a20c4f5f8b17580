"""Loading record buffers into any number of ranks: :func:`load_records`.

The rule: the records' global order (rank-major at the save, see :mod:`reshard.data.records_save`) is split into
``world`` contiguous blocks balanced by count, as ``numpy.array_split`` splits it: with ``R`` records, data rank
``r`` gets records ``[r*q + min(r, m), (r+1)*q + min(r+1, m))`` where ``q, m = divmod(R, world)``. A load followed
by a save keeps that order, so repeated reshards never reorder the records.

A load is two agreed steps and two reads: the coordinator reads the checkpoint's metadata (the index's global
shape); every rank reads the description and its block of the index; one step checks the index (lengths that
add up to the fields' rows, ids unique over the job) and gives each rank its row offsets; then every rank reads
its rows of each field, only those bytes.
"""

from __future__ import annotations

import datetime
import functools
from typing import Any

import numpy as np
import torch

from reshard.data.record_ids import first_duplicate, frame, id_runs, runs_from_payload, unframe
from reshard.data.records import MAX_ID, RecordBuffer, Schema, check_plain_name, schema_from_json
from reshard.data.records_save import FORMAT, VERSION, record_keys
from reshard.errors import CorruptCheckpointError, DataStateError, MismatchError
from reshard.flows.load import load, read_metadata
from reshard.flows.options import LoadOptions
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.state.sharding import ShardedObject, ShardedTensor
from reshard.storage import CheckpointLocation

__all__ = ["block_of", "load_records"]

_EXACT = LoadOptions(allow_dtype_cast=False)
"""Record bytes are loaded as stored: a field saved with another dtype than its schema says is an error."""


def block_of(records: int, rank: int, world: int) -> tuple[int, int]:
    """``[start, end)`` of data rank ``rank``'s records among ``records`` split into ``world`` balanced blocks."""
    q, m = divmod(records, world)
    start = rank * q + min(rank, m)
    return start, start + q + (1 if rank < m else 0)


def load_records(
    source: CheckpointLocation,
    key: str,
    *,
    rank: int,
    world: int,
    group: Group = None,
    storage_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta | float | None = None,
) -> RecordBuffer:
    """Data rank ``rank`` of ``world``'s records of the record buffer ``key`` saved at ``source``.

    Collective: every rank of ``group`` calls it (two agreed steps and two :func:`reshard.load` calls). ``rank``
    and ``world`` are data-parallel coordinates: ranks of the group that pass the same ``rank`` (tensor-parallel
    peers) get the same records, and every data rank in ``range(world)`` must be in the group, so that every record
    is loaded exactly once. ``source`` is a directory, URL or :class:`~reshard.storage.Storage` (for a step of a
    :class:`~reshard.CheckpointManager`: ``manager.path_of(step)``).

    Raises:
        DataStateError: ``key`` is not a plain name, the ranks disagree on ``key`` or ``world``, a rank is out
            of range, ``world`` is larger than the group or a data rank is missing from the group.
        CorruptCheckpointError: the description or the index is malformed (lengths that do not add up to the
            fields' rows, negative lengths, repeated ids, the reserved id), or the description's fields are not the
            saved tensors or not of their shapes (checked from the metadata before anything is allocated); never
            wrong bytes.
        MismatchError: no record buffer ``key`` in the checkpoint, or its tensors disagree with its description.
        CheckpointError: any other failure of the loads, the same on every rank.
    """
    comm = Communicator(group, timeout=timeout)
    meta_key, index_key = f"{key}.meta", f"{key}.index"

    # the steps' names hold no key: ranks passing different keys meet in one step, refused by _check_ranks
    opening = functools.partial(_opening, comm, source, key, rank, world, storage_options)
    records, width, saved_fields = comm.step("load_records", opening, _check_ranks)
    shape = (records, width)
    start, end = block_of(records, rank, world)
    first = load(
        {
            "meta": ShardedObject(meta_key, None, (1,), (0,)),
            "index": ShardedTensor(index_key, torch.empty((end - start, width), dtype=torch.int64), shape, (start, 0)),
        },
        source,
        group=group,
        options=_EXACT,
        storage_options=storage_options,
        timeout=timeout,
    )
    meta, index = first["meta"], first["index"]

    rows = _rows(meta)

    def describe() -> bytes:
        schema = _schema_of(key, meta, records, width)
        _check_fields(key, schema, rows, saved_fields)  # before any allocation of the description's sizes
        return _describe_block(key, schema, rows, index, rank)

    _, reply = comm.step_scatter("load_records index", describe, lambda p: _combine(key, rows, world, p))
    _, offsets = unframe(reply)
    schema = _schema_of(key, meta, records, width)
    lengths = index[:, 1:].contiguous()
    sums = lengths.sum(dim=0).tolist() if len(schema) else []
    _, _, field_keys = record_keys(key, schema)
    template = {
        name: ShardedTensor(
            field_keys[name],
            torch.empty((int(sums[f]), *spec.trailing), dtype=spec.dtype),
            (rows[f], *spec.trailing),
            (int(offsets[f]),) + (0,) * len(spec.trailing),
        )
        for f, (name, spec) in enumerate(schema)
    }
    loaded = load(template, source, group=group, options=_EXACT, storage_options=storage_options, timeout=timeout)
    columns = tuple(loaded[name] for name, _ in schema)
    return RecordBuffer(schema, index[:, 0].contiguous(), lengths, columns)


def _opening(
    comm: Communicator, source: CheckpointLocation, key: str, rank: int, world: int, options: dict[str, Any] | None
) -> dict[str, Any]:
    """A rank's part of the first step: its arguments and, on the coordinator, the global shapes of the index and
    of every field, from the checkpoint's metadata."""
    check_plain_name("load_records: the buffer key", key)
    shape, fields = None, None
    if comm.is_coordinator:
        tensors = read_metadata(source, storage_options=options).tensors
        index_key, prefix = f"{key}.index", f"{key}.fields."
        shape = list(tensors[index_key].global_shape) if index_key in tensors else None
        fields = {k[len(prefix) :]: list(t.global_shape) for k, t in tensors.items() if k.startswith(prefix)}
    return {"key": key, "rank": rank, "world": world, "shape": shape, "fields": fields}


def _check_ranks(values: list[dict[str, Any]]) -> list[Any]:
    """On the coordinator: the ranks agree on the key and ``world``, and cover every data rank; the index's
    global shape and the saved fields' global shapes. O(group): a ``world`` larger than the group cannot be
    covered and is refused before anything grows with it."""
    keys = {v["key"] for v in values}
    worlds = {v["world"] for v in values}
    if len(keys) > 1:
        raise DataStateError(f"load_records: the ranks passed different keys {sorted(map(str, keys))}")
    world = values[0]["world"]
    if len(worlds) > 1 or not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise DataStateError(
            f"load_records: world must be one positive int on every rank, got {sorted(map(str, worlds))}"
        )
    if world > len(values):
        raise DataStateError(
            f"load_records({values[0]['key']!r}): world {world} has more data ranks than the group's {len(values)} "
            "ranks: every data rank must be loaded by some rank of the group"
        )
    ranks = [v["rank"] for v in values]
    bad = [r for r in ranks if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world]
    if bad:
        raise DataStateError(f"load_records: rank {bad[0]!r} is not a data rank of world {world}")
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise DataStateError(
            f"load_records({values[0]['key']!r}): no rank of the group loads data rank(s) {missing[:20]} of {world}: "
            "their records would be lost; every data rank must be loaded by some rank of the group"
        )
    shape, key = values[0]["shape"], values[0]["key"]
    if shape is None:
        raise MismatchError(f"the checkpoint holds no record buffer {key!r} (no tensor {key + '.index'!r})")
    if not isinstance(shape, list) or len(shape) != 2 or shape[1] < 1:
        raise CorruptCheckpointError(f"record buffer {key!r}: an index of shape {shape}, not [records, 1 + fields]")
    return [int(shape[0]), int(shape[1]), values[0]["fields"]]


def _rows(meta: object) -> list[int]:
    rows = meta.get("rows") if isinstance(meta, dict) else None
    if not isinstance(rows, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in rows):
        return []
    return rows


def _schema_of(key: str, meta: object, records: int, width: int) -> Schema:
    """The schema of a loaded description, checked against the index's shape; CorruptCheckpointError else."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptCheckpointError(f"record buffer {key!r}: its description is not a {FORMAT} object")
    if type(meta.get("version")) is not int or meta.get("version") != VERSION:
        raise CorruptCheckpointError(
            f"record buffer {key!r}: description version {meta.get('version')!r}, this reshard reads {VERSION}"
        )
    schema = schema_from_json(meta.get("schema"), error=CorruptCheckpointError)
    if (
        type(meta.get("records")) is not int
        or meta.get("records") != records
        or width != 1 + len(schema)
        or len(_rows(meta)) != len(schema)
    ):
        raise CorruptCheckpointError(
            f"record buffer {key!r}: the description ({meta.get('records')!r} records, rows {meta.get('rows')!r}, "
            f"{len(schema)} fields) does not match its index of shape [{records}, {width}]"
        )
    return schema


def _check_fields(key: str, schema: Schema, rows: list[int], saved: dict[str, list[int]]) -> None:
    """The description's fields are the saved tensors ``KEY.fields.NAME``, each of the global shape the
    description says: checked from the metadata, before anything of the description's sizes is allocated."""
    names = [name for name, _ in schema]
    if sorted(saved) != names:
        raise CorruptCheckpointError(
            f"record buffer {key!r}: its description lists the fields {names}, the checkpoint holds {sorted(saved)}"
        )
    for f, (name, spec) in enumerate(schema):
        expected = [rows[f], *spec.trailing]
        if saved[name] != expected:
            raise CorruptCheckpointError(
                f"record buffer {key!r}: field {name!r} is saved of the shape {saved[name]}, its description says "
                f"{expected}"
            )


def _block_sums(key: str, schema: Schema, rows: list[int], lengths: torch.Tensor) -> list[int]:
    """The rows of each field this block's lengths add up to, without an int64 overflow: every length is at most
    the field's rows, and a running sum that decreases or passes them has wrapped (lengths are non-negative)."""
    sums = []
    for f, (name, _) in enumerate(schema):
        running = torch.cumsum(lengths[:, f], 0)
        if len(running) and (int(running[-1]) > rows[f] or bool((running[1:] < running[:-1]).any())):
            raise CorruptCheckpointError(
                f"record buffer {key!r}: the index's lengths add up to more rows of field {name!r} than the "
                f"{rows[f]} it holds"
            )
        sums.append(int(running[-1]) if len(running) else 0)
    return sums


def _describe_block(key: str, schema: Schema, rows: list[int], index: torch.Tensor, rank: int) -> bytes:
    """This rank's block of the index, checked, as a step payload: its rows per field and its ids."""
    ids, lengths = index[:, 0], index[:, 1:]
    if len(index) and (bool((lengths < 0).any()) or int(ids.min()) < 0):
        raise CorruptCheckpointError(f"record buffer {key!r}: the index holds a negative id or length")
    if len(index) and int(ids.max()) > MAX_ID:
        raise CorruptCheckpointError(f"record buffer {key!r}: the index holds the reserved record id 2**63 - 1")
    for f, (name, spec) in enumerate(schema):
        if not spec.variable and bool((lengths[:, f] != 1).any()):
            raise CorruptCheckpointError(
                f"record buffer {key!r}: field {name!r} is fixed but a record has another length"
            )
    if len(torch.unique(ids)) != len(ids):
        raise CorruptCheckpointError(f"record buffer {key!r}: the index holds an id twice")
    kind, runs = id_runs(ids)
    sums = _block_sums(key, schema, rows, lengths)
    return frame({"rank": rank, "count": len(ids), "sums": sums, "ids": kind}, runs)


def _combine(key: str, rows: list[int], world: int, payloads: list[bytes]) -> tuple[None, list[bytes]]:
    """On the coordinator: the blocks' rows add up to the fields' rows and their ids are unique; each group rank's
    row offsets (those of its data rank)."""
    by_rank: dict[int, bytes] = {}
    for payload in payloads:
        header, _ = unframe(payload)
        seen = by_rank.setdefault(header["rank"], payload)
        if seen != payload:
            raise DataStateError(
                f"record buffer {key!r}: the ranks loading data rank {header['rank']} read different indexes"
            )
    parts, sums = [], []
    for r in range(world):
        header, array = unframe(by_rank[r])
        parts.append((r, *runs_from_payload(header["ids"], array, header["count"])))
        sums.append(header["sums"])
    totals = [sum(int(block[f]) for block in sums) for f in range(len(rows))]  # Python ints: no overflow
    if totals != rows:
        raise CorruptCheckpointError(
            f"record buffer {key!r}: the index's lengths add up to {totals} rows per field, the fields hold {rows}"
        )
    duplicate = first_duplicate(parts)
    if duplicate is not None:
        raise CorruptCheckpointError(f"record buffer {key!r}: the index holds record id {duplicate[0]} twice")
    starts = [[sum(int(block[f]) for block in sums[:r]) for f in range(len(rows))] for r in range(world)]
    replies = []
    for payload in payloads:
        header, _ = unframe(payload)
        replies.append(frame({}, np.array(starts[header["rank"]], dtype=np.int64).reshape(len(rows))))
    return None, replies
