"""Writing partitioned metadata (format version 6): ``metadata.json`` with an index, the boxes in part files.

At ten thousand ranks the tensors' boxes are most of ``metadata.json`` (tens of MiB), and a load needs only
the boxes of the keys its rank loads. Version 6 moves each tensor's boxes (the plain or packed encoding of
versions 1 to 5, unchanged) into part files of a few MiB, keys grouped by their layer and expert numbers
(:func:`locality`, so that a pipeline stage's keys fall in few parts), and keeps in ``metadata.json`` what
everyone needs: the header, the files, the objects, the common values, and an index giving each tensor's
dtype, global shape and part, and each part's name, size and SHA-256. The document is sealed as before
(docs/format.md section 19).

:func:`metadata_documents` decides: a save partitions only when the tensors' section is large
(:data:`PARTITION_MIN_BYTES`) unless told to, so small checkpoints keep the document they had, byte for byte.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass

from reshard.metadata.model import PART_FORMAT, Metadata, MetadataPart, part_path
from reshard.metadata.wire import metadata_to_json, seal_document, tensor_entry

__all__ = ["PARTITION_MIN_BYTES", "PART_BYTES", "MetadataDocuments", "locality", "metadata_documents"]

PARTITION_MIN_BYTES = 8 * 1024 * 1024
"""A save partitions its metadata when the encoded boxes of its tensors take at least this many bytes: below,
one document costs every rank less than the extra reads of the parts (docs/scale.md, "Partitioned metadata")."""
_NUMBERS = re.compile(r"(?:^|\.)([0-9]+)(?=\.|$)")
"""The components of a dotted key that are numbers (``layers.28``, ``experts.5``; not the 32 of ``fp32_param``)."""
PART_BYTES = 2 * 1024 * 1024
"""A part is closed once it holds this many bytes of boxes (a tensor's boxes are never split: a part may be
larger by the last tensor's)."""


@dataclass(frozen=True, slots=True)
class MetadataDocuments:
    """What a save writes for its metadata: the part files (name and bytes, to be durable before the commit)
    and ``metadata.json`` (the commit); ``metadata`` is the committed metadata, naming its parts."""

    document: bytes
    parts: tuple[tuple[str, bytes], ...]
    metadata: Metadata


def metadata_documents(
    metadata: Metadata, *, parts: bool | None = None, part_bytes: int = PART_BYTES
) -> MetadataDocuments:
    """The documents of ``metadata``: one ``metadata.json`` (the version :attr:`Metadata.writes_version` says,
    exactly :meth:`Metadata.to_json_bytes`), or partitioned (version 6).

    Args:
        metadata: the checkpoint's metadata (a save's, with every tensor's boxes).
        parts: None partitions when the tensors' encoded boxes take :data:`PARTITION_MIN_BYTES` or more; True
            always; False never.
        part_bytes: the size at which a part is closed.

    Raises:
        ValueError: ``parts`` is True for metadata without tensors (it has nothing to partition).
    """
    if parts is True and not metadata.tensors:
        raise ValueError("metadata without tensors cannot be partitioned (it has no boxes to put in parts)")
    if parts is False or not metadata.tensors:
        return MetadataDocuments(metadata.to_json_bytes(), (), metadata)
    hashed = metadata.content_hashes
    entries = {key: tensor_entry(t, None, hashed) for key, t in metadata.tensors.items()}
    index: dict[str, dict[str, object]] = {}
    boxes: dict[str, bytes] = {}
    for key in sorted(entries, key=locality):
        entry = entries[key]
        stored = {name: entry.pop(name) for name in ("packed", "boxes") if name in entry}
        index[key] = entry
        boxes[key] = json.dumps(stored, separators=(",", ":"), allow_nan=False).encode()
    if parts is None and sum(map(len, boxes.values())) < PARTITION_MIN_BYTES:
        return MetadataDocuments(metadata.to_json_bytes(), (), metadata)
    groups: list[list[str]] = [[]]
    size = 0
    for key, text in boxes.items():
        if size >= part_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += len(text)
    files = tuple(_part_document(metadata.save_id, n, [(k, boxes[k]) for k in keys]) for n, keys in enumerate(groups))
    for n, keys in enumerate(groups):
        for key in keys:
            index[key]["part"] = n
    described = tuple(
        MetadataPart(path=part_path(metadata.save_id, n), size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        for n, raw in enumerate(files)
    )
    doc = metadata_to_json(
        metadata,
        index=index,
        parts=[{"path": p.path, "size": p.size, "sha256": p.sha256} for p in described],
    )
    document = seal_document(json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8"))
    return MetadataDocuments(
        document,
        tuple((p.path, raw) for p, raw in zip(described, files, strict=True)),
        dataclasses.replace(metadata, parts=described),
    )


def locality(key: str) -> tuple[tuple[tuple[int, str], ...], str]:
    """The order in which partitioned metadata lists its keys (index and parts alike): by the components of the
    dotted key that are numbers (layer, then expert numbers), then by the key. A pipeline stage holds consecutive
    layers and an expert-parallel rank consecutive experts, each with their optimizer state under other prefixes
    (``optimizer.state.exp_avg.`` ...): in this order those keys are neighbours, so a rank's keys fall in few
    parts. In plain key order, ``layers.10`` sorts between ``layers.1`` and ``layers.2`` and each prefix is a
    region of its own."""
    numbers = (n.lstrip("0") for n in _NUMBERS.findall(key))
    return tuple((len(n), n) for n in numbers), key  # numeric order without int(): keys may hold any digits


def _part_document(save_id: str, number: int, entries: list[tuple[str, bytes]]) -> bytes:
    """The bytes of one part file: its format, save id and number, and each of its tensors' boxes (the
    ``packed`` or ``boxes`` member of the tensor's entry of versions 1 to 5) by key, in the index's order."""
    head = json.dumps({"format": PART_FORMAT, "save_id": save_id, "part": number}, separators=(",", ":"))
    body = b",".join(json.dumps(key).encode() + b":" + text for key, text in entries)
    return head[:-1].encode() + b',"tensors":{' + body + b"}}"
