"""The coordinator's agreement on the scaled tensors of a save: every rank holding a piece of a scaled key
describes it with the same record (format, block, scale keys), and no rank describes it as a plain tensor."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from reshard.errors import ShardingError
from reshard.metadata import Metadata
from reshard.planning.descriptions import DescriptionTable
from reshard.state.dtypes import dtype_name
from reshard.state.scaled import ScaledRecord
from reshard.state.statedict import FlatStateDict

__all__ = [
    "agree_scaled",
    "record_from_json",
    "record_mismatches",
    "scaled_mismatches",
    "transfer_scaled_mismatches",
]


def record_from_json(key: str, doc: dict[str, Any]) -> ScaledRecord:
    """A record as :meth:`ScaledRecord.to_json` wrote it (in a rank's save description)."""
    return ScaledRecord(
        key=key,
        format=doc["format"],
        block=tuple(doc["block"]),
        scale_key=doc["scale"],
        global_scale_key=doc["global_scale"],
    )


def agree_scaled(table: DescriptionTable, contexts: list[Any]) -> dict[str, ScaledRecord]:
    """On the coordinator, inside the planning step (so every rank raises the same error): the records of the
    save's scaled tensors, checked to agree.

    Raises:
        ShardingError: naming the key and the ranks, when ranks describe a key with different formats or blocks,
            or one rank as a scaled tensor and another as a plain one.
    """
    by_key: dict[str, dict[ScaledRecord, list[int]]] = {}
    for rank, context in enumerate(contexts):
        for key, doc in (context.get("scaled") or {}).items():
            by_key.setdefault(key, {}).setdefault(record_from_json(key, doc), []).append(rank)
    if not by_key:
        return {}
    problems = []
    for key, records in sorted(by_key.items()):
        if len(records) > 1:
            described = "; ".join(f"ranks {ranks}: {r.describe()}" for r, ranks in records.items())
            problems.append(f"{key!r} is described differently by the ranks ({described})")
    number = {key: i for i, key in enumerate(table.keys)}
    wanted = {number[k]: k for k in by_key if k in number}
    if wanted:
        key_of_row = table.header_key[table.header]
        rows = np.isin(key_of_row, np.fromiter(wanted, dtype=np.int64))
        for key_number, rank in sorted(set(zip(key_of_row[rows].tolist(), table.rank[rows].tolist(), strict=True))):
            key = wanted[key_number]
            if not any(rank in ranks for ranks in by_key[key].values()):
                problems.append(f"{key!r} is a ScaledTensor on some ranks but a plain tensor on rank {rank}")
    if problems:
        raise ShardingError("the ranks disagree on scaled tensors: " + "; ".join(problems[:10]))
    return {key: next(iter(records)) for key, records in by_key.items()}


def scaled_mismatches(flat: FlatStateDict, metadata: Metadata) -> list[str]:
    """How a load template's scaled and plain tensors disagree with the checkpoint's records: a ScaledTensor
    of a saved plain tensor, of another format or block, or whose parts would need a cast (never done to
    scaled bytes), and a plain tensor of a saved scaled key (its data would load without its scales). Each
    names both sides. A ScaledTensor whose data the checkpoint lacks is missing, not a mismatch."""

    def saved_dtype(key: str) -> str | None:
        saved = metadata.tensors.get(key)
        return None if saved is None else saved.dtype

    return record_mismatches(flat, saved_dtype, metadata.scaled)


def record_mismatches(
    flat: FlatStateDict, saved_dtype: Callable[[str], str | None], records: Mapping[str, ScaledRecord]
) -> list[str]:
    """:func:`scaled_mismatches` against saved state that is not a checkpoint's metadata (the peer-memory
    tier's generation): ``saved_dtype(key)`` is the dtype name of saved tensor ``key`` (None: not saved),
    ``records`` the saved scaled tensors' records by data key."""
    problems = []
    parts: set[str] = set()
    for key, mine in flat.scaled.items():
        parts.update(k for k in (mine.key, mine.scale_key, mine.global_scale_key) if k is not None)
        if saved_dtype(key) is None:
            continue
        saved = records.get(key)
        if saved is None:
            problems.append(
                f"{key!r}: the checkpoint holds a plain tensor, the template a ScaledTensor of {mine.describe()}"
            )
        elif (saved.format, saved.block) != (mine.format, mine.block):
            problems.append(f"{key!r}: the checkpoint holds {saved.describe()}, the template {mine.describe()}")
        elif (saved.scale_key, saved.global_scale_key) != (mine.scale_key, mine.global_scale_key):
            problems.append(
                f"{key!r}: the checkpoint keeps its scales in {saved.scale_key!r} and {saved.global_scale_key!r}, "
                f"the template in {mine.scale_key!r} and {mine.global_scale_key!r}"
            )
    for tensor in flat.tensors:
        saved_name = saved_dtype(tensor.key)
        if tensor.key not in parts:
            record = records.get(tensor.key)
            if record is not None:
                problems.append(
                    f"{tensor.key!r}: the checkpoint holds a scaled tensor of {record.describe()}, the template a "
                    "plain tensor (its data would load without its scales); load it as a reshard.ScaledTensor"
                )
        elif saved_name is not None and saved_name != dtype_name(tensor.data.dtype):
            problems.append(
                f"{tensor.key!r}: saved dtype {saved_name}, the template's ScaledTensor holds "
                f"{dtype_name(tensor.data.dtype)} (scaled data and scales are never cast)"
            )
    return sorted(set(problems))


def transfer_scaled_mismatches(docs: list[dict[str, Any]]) -> list[str]:
    """On a transfer's coordinator: how the targets' scaled tensors disagree with the sources' (each rank's
    description holds ``held`` (key: [shape, dtype]), ``wanted`` ([name, source key, shape, dtype]),
    ``scaled_held`` (key: record) and ``scaled_wanted`` (name: [source key, record]). A scaled target needs a
    source of the same format and block (and never a cast of its parts); a plain target of a scaled source
    would receive data without its scales."""
    held_records = {key: record_from_json(key, doc) for d in docs for key, doc in d.get("scaled_held", {}).items()}
    held = {key: value for d in docs for key, value in d["held"].items()}
    problems = []
    parts: dict[str, str] = {}
    for d in docs:
        for name, (key, doc) in d.get("scaled_wanted", {}).items():
            mine = record_from_json(name, doc)
            parts.update({p: name for p in (mine.key, mine.scale_key, mine.global_scale_key) if p is not None})
            source = held_records.get(key)
            if key in held and source is None:
                problems.append(f"{name!r}: the source {key!r} is a plain tensor, the target a {mine.describe()}")
            elif source is not None and (source.format, source.block) != (mine.format, mine.block):
                problems.append(f"{name!r}: the source {key!r} is {source.describe()}, the target {mine.describe()}")
    scaled_sources = {p for r in held_records.values() for p in (r.key, r.scale_key, r.global_scale_key) if p}
    for d in docs:
        for name, key, _shape, dtype in d["wanted"]:
            if name not in parts and key in held_records:
                source = held_records[key]
                problems.append(f"{name!r}: the source {key!r} is {source.describe()}, the target a plain tensor")
            elif (name in parts or key in scaled_sources) and key in held and held[key][1] != dtype:
                problems.append(f"{name!r}: held as {held[key][1]}, wanted {dtype} (scaled bytes are never cast)")
    return sorted(set(problems))
