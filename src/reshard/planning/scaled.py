"""The coordinator's agreement on the scaled tensors of a save: every rank holding a piece of a scaled key
describes it with the same record (format, block, scale keys), and no rank describes it as a plain tensor."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from reshard.errors import ShardingError
from reshard.metadata import Metadata
from reshard.planning.descriptions import DescriptionTable
from reshard.state.dtypes import DTYPE_BY_NAME, dtype_name
from reshard.state.lowprec import FORMATS, Block
from reshard.state.quantize import INPUT_DTYPE_NAMES
from reshard.state.scaled import ScaledRecord, canonical_block
from reshard.state.sharding import is_main_replica
from reshard.state.statedict import FlatStateDict

__all__ = [
    "agree_scaled",
    "record_from_json",
    "record_mismatches",
    "replica_conflicts",
    "replica_digests",
    "scaled_mismatches",
    "transfer_scaled_mismatches",
    "transfer_source_conflicts",
]

_EXACT_WIDENING = frozenset({"bfloat16", "float16"})
"""Saved scale dtypes that a float32 scale of the FP8 formats loads exactly (every bfloat16 and float16 value is
a float32): Hugging Face checkpoints hold FP8 scales in the model's dtype (compressed-tensors, Qwen's FP8
``weight_scale_inv``). A reshard checkpoint's scales are always the format's dtype."""


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
    problems += replica_conflicts([context.get("replicas") or [] for context in contexts])
    if problems:
        raise ShardingError("the ranks disagree on scaled tensors: " + "; ".join(problems[:10]))
    return {key: next(iter(records)) for key, records in by_key.items()}


def replica_digests(flat: FlatStateDict) -> list[list[Any]]:
    """On each rank, for its save description: ``[part key, box offset, box shape, digest]`` of every box of a
    scale part that several ranks hold copies of, a whole-axis (None) block's scale cells and the global scale
    (the primary data's ranks only: data replicas carry no say). Their bytes are a few per rank; the digest
    (of the stored bytes, so NaNs compare by their bits) lets the coordinator check that the copies agree."""
    keys = set()
    for record in flat.scaled.values():
        if None in record.block:
            keys.add(record.scale_key)
        if record.global_scale_key is not None:
            keys.add(record.global_scale_key)
    out: list[list[Any]] = []
    for tensor in flat.tensors:
        rid = tensor.replica_id
        if tensor.key not in keys or not is_main_replica(rid[:-1] if isinstance(rid, tuple) else rid):
            continue
        for piece in tensor.pieces():
            stored = piece.view.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
            digest = hashlib.blake2b(stored.numpy().tobytes(), digest_size=16).hexdigest()
            out.append([tensor.key, list(piece.box.offset), list(piece.view.shape), digest])
    return out


def replica_conflicts(per_rank: list[list[list[Any]]]) -> list[str]:
    """On the coordinator: the boxes of scales held by several ranks whose copies differ (each rank's
    :func:`replica_digests`), naming the key, the box and the ranks of each value. A whole-axis scale and a
    global scale are one value for every rank's data: kept once, a differing copy would decode another rank's
    data with the wrong scale."""
    seen: dict[tuple[str, tuple[int, ...], tuple[int, ...]], dict[str, list[int]]] = {}
    for rank, digests in enumerate(per_rank):
        for key, offset, shape, digest in digests:
            seen.setdefault((key, tuple(offset), tuple(shape)), {}).setdefault(digest, []).append(rank)
    return [
        f"{key!r} (the cells at {list(offset)} of shape {list(shape)}, one value for the data of every rank) is "
        f"given differently by {' and by '.join(f'ranks {ranks}' for ranks in values.values())}: every rank "
        "must pass the same copy (compute a per-tensor or global scale over the whole tensor, not its shard)"
        for (key, offset, shape), values in sorted(seen.items())
        if len(values) > 1
    ]


def scaled_mismatches(flat: FlatStateDict, metadata: Metadata) -> list[str]:
    """How a load template's scaled and plain tensors disagree with the checkpoint's records: a ScaledTensor
    of a saved plain tensor, of another format or block, or whose parts would need a cast (never done to
    scaled bytes; the one cast done is the exact widening of bfloat16 or float16 FP8 scales of a Hugging Face source
    to float32), and a plain tensor of a saved scaled key (its data would load without its scales). Each
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
    widened: set[str] = set()
    shapes = {tensor.key: tensor.saved_shape for tensor in flat.tensors}
    for key, mine in flat.scaled.items():
        parts.update(mine.part_keys)
        if FORMATS[mine.format].scale_dtypes == (torch.float32,):
            widened.add(mine.scale_key)
        if saved_dtype(key) is None:
            continue
        saved = records.get(key)
        if saved is None:
            problems.append(
                f"{key!r}: the checkpoint holds a plain tensor, the template a ScaledTensor of {mine.describe()}"
            )
        elif (saved.format, _canonical(saved, shapes.get(key))) != (mine.format, mine.block):
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
            if tensor.key in widened and saved_name in _EXACT_WIDENING:
                continue
            problems.append(
                f"{tensor.key!r}: saved dtype {saved_name}, the template's ScaledTensor holds "
                f"{dtype_name(tensor.data.dtype)} (scaled data and scales are never cast)"
            )
    return sorted(set(problems))


def _canonical(record: ScaledRecord, shape: tuple[int, ...] | None) -> Block:
    """``record``'s block canonical against the logical ``shape`` (as :attr:`ScaledTensor.record` writes it): a
    checkpoint written before the records were measured against the logical shape may hold the block of a
    padded axis as its length (the same scale cells)."""
    if shape is None or len(shape) != len(record.block) or record.format not in FORMATS:
        return record.block
    return canonical_block(FORMATS[record.format], record.block, shape)


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
            parts.update(dict.fromkeys(mine.part_keys, name))
            source = held_records.get(key)
            if key in held and source is None:
                dtype = held[key][1]
                problems.append(
                    f"{name!r}: the source {key!r} is a plain {dtype} tensor, the target a ScaledTensor of "
                    f"{mine.describe()}: a transfer quantizes {', '.join(INPUT_DTYPE_NAMES[:-1])} and "
                    f"{INPUT_DTYPE_NAMES[-1]} sources only, and {_not_quantized(dtype)}"
                )
            elif source is not None and (source.format, source.block) != (mine.format, mine.block):
                problems.append(f"{name!r}: the source {key!r} is {source.describe()}, the target {mine.describe()}")
    scaled_sources = {p for r in held_records.values() for p in r.part_keys}
    for d in docs:
        for name, key, _shape, dtype in d["wanted"]:
            if name not in parts and key in held_records:
                source = held_records[key]
                problems.append(f"{name!r}: the source {key!r} is {source.describe()}, the target a plain tensor")
            elif key in scaled_sources and key in held and held[key][1] != dtype:
                problems.append(f"{name!r}: held as {held[key][1]}, wanted {dtype} (scaled bytes are never cast)")
    return sorted(set(problems))


def transfer_source_conflicts(docs: list[dict[str, Any]]) -> list[str]:
    """On a transfer's coordinator, before anything is planned: the source keys that some ranks hold as a
    ScaledTensor (or as the scale or global scale of one) and others as a plain tensor, naming the ranks of
    each. Each rank's description holds ``held`` (key: [shape, dtype]) and ``scaled_held`` (key: record).
    A save refuses such pieces (:func:`agree_scaled`); a transfer would pair one rank's plain values with
    another's scales (a plain primary cast to FP8 beside a replica's scales), or miss the scales of the plain
    ranks' boxes."""
    scaled_on: dict[str, list[int]] = {}
    owner: dict[str, str] = {}
    for rank, doc in enumerate(docs):
        for key, record_doc in (doc.get("scaled_held") or {}).items():
            record = record_from_json(key, record_doc)
            for part in (record.key, record.scale_key, record.global_scale_key):
                if part is not None:
                    scaled_on.setdefault(part, []).append(rank)
                    owner[part] = key
    problems = []
    for part, ranks in sorted(scaled_on.items()):
        plain = [rank for rank, doc in enumerate(docs) if part in doc["held"] and rank not in ranks]
        if plain:
            what = "a ScaledTensor" if owner[part] == part else f"a part of the ScaledTensor {owner[part]!r}"
            problems.append(f"{part!r} is {what} on ranks {sorted(set(ranks))} but a plain tensor on ranks {plain}")
    return problems


def _not_quantized(dtype: str) -> str:
    """Why a plain source of ``dtype`` (not one of :data:`INPUT_DTYPE_NAMES`) is not quantized."""
    torch_dtype = DTYPE_BY_NAME.get(dtype)
    if torch_dtype is None or not torch_dtype.is_floating_point:
        return f"{dtype} is not a floating-point dtype (there is nothing to scale)"
    if torch_dtype.itemsize > 4:
        return (
            f"{dtype} would be rounded to float32 first, which the reference quantizers never do (the bytes "
            "could differ from quantize's of the float32 tensor): convert the source to float32 on the sender"
        )
    return (
        f"{dtype} is already low-precision: its scales are not with it (send it as a reshard.ScaledTensor of "
        "its format, whose scales travel with it; a plain low-precision tensor is never taken as scaled data)"
    )
