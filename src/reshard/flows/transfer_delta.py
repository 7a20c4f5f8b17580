"""What a delta transfer (:class:`reshard.TransferSession`) knows and checks on each rank: the last transfer
it took part in, the digests of the cells it sends and receives, and which of its target cells share memory.

A delta leaves a cell in place only when it is proven right on both ends (see
:class:`~reshard.TransferSession`). Targets that share memory need more: an inference engine that ties its
output layer to its embedding holds one tensor under two names, fed from two trainer keys, and views of one
buffer may overlap. There the last cell a transfer writes decides the shared bytes, so a delta must write
every cell that shares memory with one it writes, in the order a whole transfer writes them (copies of a
rank's own pieces first, then the rounds): :func:`aliasing` finds those cells, the coordinator sends each
such group whole when any of it travels, and keeps the whole plan's rounds for them
(:meth:`reshard.planning.exchange.TransferPlan.schedules` with ``keep_order``). A received cell that shares memory
with a local copy (always made) travels every time.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from reshard.io.exchange import cell_view
from reshard.planning.exchange import RankSchedule
from reshard.state.dtypes import byte_view
from reshard.state.sharding import LocalPiece

__all__ = ["Aliasing", "LastSync", "aliasing", "cell_digests", "digest_json", "widen_to_groups"]

_TOO_HARD: type[Exception] = getattr(getattr(np, "exceptions", np), "TooHardError", ArithmeticError)
_MAX_WORK = 100_000
"""The most work numpy may spend proving that two strided views share no memory; beyond it they are taken
to share some (a cell sent again for nothing, never one left out)."""


@dataclass(frozen=True)
class LastSync:
    """What one rank's session knows of the last transfer it took part in, the base of a delta."""

    token: str
    """The transfer's identity, drawn by the coordinator: a delta needs every rank to name the same one."""
    signature: str
    """The digest of this rank's description then (its pieces, keys, dtypes, target addresses)."""
    schedule: RankSchedule
    """This rank's part of the whole plan (every cell, not only those sent then)."""
    sent: dict[int, bytes]
    """The digest of each cell this rank sends, as its source held it then, by the cell's number."""
    held: dict[int, bytes]
    """The digest of each cell this rank receives, as its target held it once that transfer was done."""


def digest_json(value: Any) -> str:
    """The SHA-256 of ``value``'s canonical JSON: a description's identity."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def cell_digests(pieces: Sequence[LocalPiece], schedule: RankSchedule, direction: str) -> dict[int, bytes]:
    """A BLAKE2b digest of every cell this rank sends (``direction="send"``, read from its source pieces)
    or receives (``"recv"``, read from its target pieces) in ``schedule``, by the cell's number: of the
    cell's values, so a conjugate or negative view is hashed as what it reads as. A cell on a GPU is
    copied to the host to be hashed."""
    out = {}
    for rnd in schedule.rounds:
        for _peer, cells in rnd[direction]:
            for ref in cells:
                values = cell_view(pieces, ref).detach().cpu().resolve_conj().resolve_neg().contiguous()
                out[ref[4]] = hashlib.blake2b(byte_view(values), digest_size=16).digest()
    return out


@dataclass(frozen=True)
class Aliasing:
    """The received cells of one rank that share memory with others (by cell number).

    Attributes:
        always: cells that share memory with a copy of the rank's own pieces, which every transfer makes
            first: they travel every time.
        groups: cells that share memory with each other (directly or through others), two or more a group:
            when one travels, all do, in the whole plan's order.
    """

    always: list[int]
    groups: list[list[int]]


@dataclass(frozen=True)
class _Cell:
    piece: int
    ident: int | None
    """The received cell's number; None for the destination of a local copy."""
    view: torch.Tensor


def aliasing(targets: Sequence[LocalPiece], schedule: RankSchedule) -> Aliasing:
    """Which cells of ``schedule`` that this rank writes share memory: first the target pieces that do (a
    sweep over their address ranges, then an exact test), then the cells of those pieces only. Cheap when
    no two pieces share memory, the usual case."""
    pairs = _sharing_pieces(targets)
    if not pairs:
        return Aliasing([], [])
    involved = {p for pair in pairs for p in pair}
    cells = [_Cell(dst[0], None, cell_view(targets, dst)) for _, dst in schedule.copies if dst[0] in involved]
    for rnd in schedule.rounds:
        for _peer, refs in rnd["recv"]:
            cells += [_Cell(ref[0], ref[4], cell_view(targets, ref)) for ref in refs if ref[0] in involved]
    of_piece: dict[int, list[int]] = {}
    for index, cell in enumerate(cells):
        of_piece.setdefault(cell.piece, []).append(index)
    parent = list(range(len(cells)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for p, q in pairs:
        for i in of_piece.get(p, []):
            for j in of_piece.get(q, []):
                if _share_memory(cells[i].view, cells[j].view):
                    parent[root(i)] = root(j)
    components: dict[int, list[_Cell]] = {}
    for index, cell in enumerate(cells):
        components.setdefault(root(index), []).append(cell)
    always: list[int] = []
    groups: list[list[int]] = []
    for members in components.values():
        received = sorted(c.ident for c in members if c.ident is not None)
        if len(members) < 2 or not received:
            continue
        if len(received) < len(members):  # a local copy shares its memory
            always += received
        if len(received) > 1:
            groups.append(received)
    return Aliasing(sorted(always), groups)


def widen_to_groups(only: set[int], groups: list[list[int]]) -> bool:
    """Add to ``only`` (the cells a delta sends) every cell of each group that has one there; return whether
    any group was touched (then the delta must keep the whole plan's order)."""
    touched = False
    for group in groups:
        if only.intersection(group):
            only.update(group)
            touched = True
    return touched


def _extent(view: torch.Tensor) -> tuple[str, int, int]:
    """The device and the byte range ``[start, end)`` that the elements of ``view`` lie in."""
    start = view.data_ptr()
    last = sum((n - 1) * s for n, s in zip(view.shape, view.stride(), strict=True))
    return str(view.device), start, start + (last + 1) * view.element_size()


def _sharing_pieces(targets: Sequence[LocalPiece]) -> list[tuple[int, int]]:
    """The pairs of target pieces whose elements share memory (a tied weight, overlapping views)."""
    spans = sorted((*_extent(piece.view), index) for index, piece in enumerate(targets) if piece.view.numel() > 0)
    pairs = []
    active: list[tuple[str, int, int, int]] = []
    for span in spans:
        device, start = span[0], span[1]
        active = [a for a in active if a[0] == device and a[2] > start]
        pairs += [(a[3], span[3]) for a in active if _share_memory(targets[a[3]].view, targets[span[3]].view)]
        active.append(span)
    return pairs


class _Interface:
    """A numpy array interface over a tensor's memory (its address, shape and strides: never read)."""

    def __init__(self, view: torch.Tensor) -> None:
        size = view.element_size()
        self.__array_interface__ = {
            "shape": tuple(view.shape),
            "typestr": f"|V{size}",
            "data": (view.data_ptr(), False),
            "strides": tuple(s * size for s in view.stride()),
            "version": 3,
        }


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether some element of ``a`` and some element of ``b`` share a byte (exact, by numpy's solver over
    the two views' addresses and strides; when that is too hard to prove, assumed)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (dev_a, start_a, end_a), (dev_b, start_b, end_b) = _extent(a), _extent(b)
    if dev_a != dev_b or end_a <= start_b or end_b <= start_a:
        return False
    try:  # numpy's stubs list only the two special values of max_work; a positive bound is documented too
        shared = np.shares_memory(np.asarray(_Interface(a)), np.asarray(_Interface(b)), max_work=_MAX_WORK)  # type: ignore[arg-type]
        return bool(shared)
    except _TOO_HARD:
        return True
