"""Layout fingerprints, the offers of a save that may reuse its plan, and the plan cache's file format.

Pure functions over bytes: no storage, no collectives.

A rank's *layout* is exactly the part of its save description that determines the save plan: its tensor pieces
(key, dtype, global shape, box, replica id) and object cells, in the compact form of
:func:`~reshard.planning.descriptions.encode_description` without a context (so neither the path nor the save id
nor any per-save term is in it). Its *fingerprint* is the SHA-256 of that, the rank's position and the group's
size: equal fingerprints on every rank mean the descriptions the coordinator would gather are byte for byte the
ones it planned on before, so the plan (the table and the writer election) is the same.

An *offer* is what a rank sends in the first step of a save that may reuse its plan: its fingerprint and the small
context whose terms must agree (path, options), instead of its description.

The plan cache file (:data:`PLAN_CACHE_FILE`, written by :class:`reshard.flows.plan_cache.PlanCache`) stores the
layouts of one group, with their fingerprints and a SHA-256 of the whole: :func:`decode_plan_file` returns the
layouts only when the checksum holds and every stored layout hashes to the fingerprint its rank sent now, so a
damaged, truncated, stale or forged file is never used (a forgery would need a SHA-256 collision).

A load that reads once keeps its schedules the same way (:class:`reshard.flows.plan_cache.ReadPlanCache`): a rank's
"layout" there is its *needs* (:func:`needs_bytes`: the target pieces the read-once schedule is computed from), in a
file and a fingerprint domain of their own (:data:`READ_PLANS`), so that neither file is ever taken for the other.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Any

from reshard.planning.descriptions import DescriptionTable, LocalSaveDescription, encode_description

__all__ = [
    "PLAN_CACHE_FILE",
    "PLAN_FILES",
    "PLAN_FILE_MAGIC",
    "READ_PLANS",
    "SAVE_PLANS",
    "Offer",
    "PlanFileKind",
    "decode_plan_file",
    "encode_offer",
    "encode_plan_file",
    "is_description",
    "layout_bytes",
    "layout_fingerprint",
    "needs_bytes",
    "offer_contexts",
    "plan_file_extent",
    "plan_file_head_bytes",
    "read_offer",
]

PLAN_CACHE_FILE = "plans.reshard-cache"
"""The plan cache's file, in a :class:`~reshard.CheckpointManager` root (never inside a checkpoint)."""

_DOMAIN = b"reshard layout fingerprint v1\x00"
_POSITION = struct.Struct("<QQ")
_OFFER_MAGIC = b"RSO1"
_DESCRIPTION_MAGIC = b"RSD1"
PLAN_FILE_MAGIC = b"RSPLANS1"
"""The first bytes of a plan cache file."""
_HEADER_LENGTH = struct.Struct("<Q")
_DIGEST_BYTES = 32


@dataclass(frozen=True, slots=True)
class PlanFileKind:
    """What a plan cache file holds: its name in a manager's root, the magic it begins with, and the domain its
    layouts' fingerprints are hashed in (a save layout and a load's needs never share a fingerprint)."""

    name: str
    magic: bytes
    domain: bytes


SAVE_PLANS = PlanFileKind(PLAN_CACHE_FILE, PLAN_FILE_MAGIC, _DOMAIN)
"""The layouts of the newest save plan (:class:`reshard.flows.plan_cache.PlanCache`)."""
READ_PLANS = PlanFileKind("reads.reshard-cache", b"RSREADS1", b"reshard read-once needs v1\x00")
"""The needs of the newest read-once schedule of a load (:class:`reshard.flows.plan_cache.ReadPlanCache`)."""
PLAN_FILES = (SAVE_PLANS, READ_PLANS)
"""Every plan cache file a manager may keep in its root."""


def layout_bytes(description: LocalSaveDescription) -> bytes:
    """The part of a rank's description that determines the save plan (its encoded form, without a context)."""
    return encode_description(description, None)


def needs_bytes(needs: list[list[Any]]) -> bytes:
    """A load's target pieces as a read-once schedule takes them (``[key, offset, shape, dtype name]`` each, in piece
    order: :func:`reshard.io.exchange.describe_need`), in one canonical encoding: what its fingerprint is of."""
    return json.dumps(needs, separators=(",", ":"), allow_nan=False).encode()


def layout_fingerprint(layout: bytes, *, rank: int, world: int, kind: PlanFileKind = SAVE_PLANS) -> str:
    """SHA-256 (hex) of ``layout`` at position ``rank`` of a group of ``world`` ranks (in the domain of ``kind``)."""
    digest = hashlib.sha256(kind.domain)
    digest.update(_POSITION.pack(rank, world))
    digest.update(layout)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Offer:
    """What a rank sends in the first step of a save that may reuse its plan."""

    fingerprint: str
    context: Any


def encode_offer(fingerprint: str, context: Any) -> bytes:
    """The wire form of an :class:`Offer` (a magic of its own, so that it is never taken for a description)."""
    return _OFFER_MAGIC + json.dumps({"layout": fingerprint, "context": context}, allow_nan=False).encode()


def is_description(payload: bytes) -> bool:
    """Whether ``payload`` is a whole description (a rank that plans without reuse), not an offer."""
    return payload[: len(_DESCRIPTION_MAGIC)] == _DESCRIPTION_MAGIC


def read_offer(payload: bytes) -> Offer:
    """The :class:`Offer` ``payload`` encodes.

    Raises:
        ValueError: it is not one.
    """
    if payload[: len(_OFFER_MAGIC)] != _OFFER_MAGIC:
        raise ValueError("not a layout offer")
    doc = json.loads(payload[len(_OFFER_MAGIC) :])
    fingerprint = doc["layout"]
    if not isinstance(fingerprint, str) or len(fingerprint) != 2 * _DIGEST_BYTES:
        raise ValueError(f"a layout fingerprint of {fingerprint!r}")
    return Offer(fingerprint=fingerprint, context=doc["context"])


def offer_contexts(payloads: list[bytes]) -> list[Any]:
    """The context of every payload of a first planning step, offers and whole descriptions alike (the
    coordinator names the terms the ranks disagree on when some plan with reuse and others without).

    Raises:
        ValueError: a payload is neither.
    """
    return [DescriptionTable.from_wire([p])[1][0] if is_description(p) else read_offer(p).context for p in payloads]


def encode_plan_file(
    fingerprints: tuple[str, ...], layouts: tuple[bytes, ...], *, kind: PlanFileKind = SAVE_PLANS
) -> bytes:
    """The plan cache file of one group: its fingerprints and layouts (in rank order), behind a SHA-256 of all."""
    header = json.dumps(
        {"format": 1, "world": len(layouts), "fingerprints": list(fingerprints), "lengths": [len(x) for x in layouts]}
    ).encode()
    body = b"".join((_HEADER_LENGTH.pack(len(header)), header, *layouts))
    return kind.magic + hashlib.sha256(body).digest() + body


def _lengths(values: Any) -> list[int]:
    """A header's layout lengths: a list of integers (a float, a string or a bool is not one).

    Raises:
        ValueError: naming what is not.
    """
    if not isinstance(values, list) or not all(type(n) is int for n in values):
        raise ValueError(f"its layout lengths are not integers: {str(values)[:80]}")
    return values


def plan_file_head_bytes(world: int) -> int:
    """How many first bytes of a plan cache file of a group of ``world`` ranks :func:`plan_file_extent` needs at most
    (its header holds a fingerprint and a length per rank)."""
    return len(PLAN_FILE_MAGIC) + _DIGEST_BYTES + _HEADER_LENGTH.size + 4096 + 128 * world


def plan_file_extent(head: bytes, fingerprints: tuple[str, ...], *, kind: PlanFileKind = SAVE_PLANS) -> int:
    """From the first bytes of a plan cache file (at least :func:`plan_file_head_bytes`, or all of a shorter file):
    the size the whole file must have, provided its header is a plan cache's, of ``fingerprints`` (so that a file
    of another layout, or garbage, is known for a miss without being read whole).

    Raises:
        ValueError: naming what does not hold.
    """
    start = len(kind.magic) + _DIGEST_BYTES
    if head[: len(kind.magic)] != kind.magic or len(head) < start + _HEADER_LENGTH.size:
        raise ValueError("not a plan cache file")
    (length,) = _HEADER_LENGTH.unpack_from(head, start)
    at = start + _HEADER_LENGTH.size
    if at + length > len(head):
        raise ValueError(f"a header of {length} bytes, longer than the file's first {len(head) - at}")
    try:
        header = json.loads(head[at : at + length])
        lengths = _lengths(header["lengths"])
        match = header["format"] == 1 and header["world"] == len(fingerprints)
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise ValueError(f"its header is not a plan cache's ({exc})") from None
    if not match:
        raise ValueError(f"it holds a group of {header.get('world')!r} ranks, not {len(fingerprints)}")
    if tuple(header["fingerprints"]) != fingerprints:
        raise ValueError("it holds another layout")
    if len(lengths) != len(fingerprints) or min(lengths, default=0) < 0:
        raise ValueError("its header's layout lengths are not one per rank")
    return int(at + length + sum(lengths))


def decode_plan_file(
    raw: bytes | bytearray, fingerprints: tuple[str, ...], *, kind: PlanFileKind = SAVE_PLANS
) -> tuple[bytes, ...]:
    """The layouts of a plan cache file, provided its checksum holds and every layout hashes, at its rank in a group
    of ``len(fingerprints)``, to ``fingerprints[rank]`` (what that rank sent now).

    Raises:
        ValueError: naming what does not hold (the file is then a miss, never an error).
    """
    start = len(kind.magic) + _DIGEST_BYTES
    if raw[: len(kind.magic)] != kind.magic or len(raw) < start + _HEADER_LENGTH.size:
        raise ValueError("not a plan cache file")
    body = memoryview(raw)[start:]
    if hashlib.sha256(body).digest() != raw[len(kind.magic) : start]:
        raise ValueError("its checksum does not match (damaged or truncated)")
    (length,) = _HEADER_LENGTH.unpack_from(body)
    header = json.loads(bytes(body[_HEADER_LENGTH.size : _HEADER_LENGTH.size + length]))
    if header.get("format") != 1 or header.get("world") != len(fingerprints):
        raise ValueError(f"it holds a group of {header.get('world')!r} ranks, not {len(fingerprints)}")
    if tuple(header["fingerprints"]) != fingerprints:
        raise ValueError("it holds another layout")
    lengths = _lengths(header["lengths"])
    at = _HEADER_LENGTH.size + length
    if len(lengths) != len(fingerprints) or at + sum(lengths) != len(body) or min(lengths, default=0) < 0:
        raise ValueError("its layouts do not fill it")
    layouts = []
    for rank, size in enumerate(lengths):
        layout = bytes(body[at : at + size])
        at += size
        if layout_fingerprint(layout, rank=rank, world=len(fingerprints), kind=kind) != fingerprints[rank]:
            raise ValueError(f"the layout of rank {rank} does not hash to its fingerprint")
        layouts.append(layout)
    return tuple(layouts)
