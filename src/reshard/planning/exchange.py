"""The schedules of boxes over the network: who reads or holds which part of the global tensors and who
sends it to whom, in rounds of bounded size. Pure: no I/O, no collectives, no tensors (JSON-able lists in,
frozen values out); :mod:`reshard.io.exchange` runs them.

Read once (``LoadOptions(read_once=...)``): data-parallel and context-parallel replicas need the same
boxes, so a plain load reads every unique byte once per replica. Instead the coordinator gathers what
every rank needs and :func:`schedule_reads` cuts it into *cells*: the regions of a global tensor that the
same set of ranks (with the same destination dtype) needs. A cell needed by one rank is read by it, as in a
plain load. A cell needed by several is cut into up to one slab per needer (at most
:data:`MAX_READERS_PER_CELL`) along its first axis that has room, each slab read by the needer with the
fewest bytes to read so far (so readers are balanced), and sent to the other needers.

Transfers (:func:`reshard.transfer`, the peer-memory tier): :func:`schedule_transfer` fills target pieces
from pieces that ranks hold in memory instead of from storage, cell by cell, a rank's own cells by a local
copy.

Memory stays bounded: the sends and receives are cut into rounds in which no rank sends, nor receives,
more than ``round_bytes``, and a cell larger than that travels in slabs.

Who calls what: only the coordinator, inside a collective step of the flow (the functions here are local
and deterministic); each rank then runs its :class:`RankSchedule` with :func:`reshard.io.exchange.run_exchange`.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from reshard.geometry.boxes import Box
from reshard.geometry.tiling import first_overlap
from reshard.state.dtypes import DTYPE_BY_NAME

__all__ = [
    "DEFAULT_ROUND_BYTES",
    "MAX_CELLS_PER_KEY",
    "MAX_READERS_PER_CELL",
    "MIN_SLAB_BYTES",
    "CellRef",
    "RankSchedule",
    "Round",
    "Transfer",
    "TransferPlan",
    "cells_of",
    "pack_rounds",
    "schedule_reads",
    "schedule_transfer",
    "slabs",
]

DEFAULT_ROUND_BYTES = 16 * 1024 * 1024
"""The most bytes a rank sends (and, apart, receives) in one round of the exchange."""

MIN_SLAB_BYTES = 64 * 1024
"""A shared cell is split among its needers only into slabs of at least this size (fewer, larger reads)."""

MAX_READERS_PER_CELL = 8
"""A shared cell is read by at most this many of its needers (one slab each), each sending its slab to every
other needer: enough to spread the reading, while the transfers (readers x needers per cell) and so the
coordinator's planning stay small with many replicas."""

MAX_CELLS_PER_KEY = 4096
"""Beyond this many cells for one tensor (boxes that overlap in many different ways), its pieces are read
by their own ranks: sharing would cost more planning than it saves."""

CellRef = list[Any]
"""``[piece, offset, shape]``: a box of a rank's own piece number ``piece`` (JSON-able)."""


@dataclass(frozen=True, slots=True)
class _Holder:
    rank: int
    piece: int
    box: Box


@dataclass(frozen=True, slots=True)
class Transfer:
    """One cell sent from a piece of rank ``src`` to a piece of rank ``dst`` (``nbytes`` on the wire)."""

    src: int
    src_piece: int
    dst: int
    dst_piece: int
    box: Box
    nbytes: int
    wire: str | None = None
    """The dtype the bytes travel in when it is not the receiver's (a transfer with a cast)."""
    ident: int = 0
    """Its number in its schedule (the same on sender and receiver): how a delta transfer names it."""


Round = dict[str, list[list[Any]]]
"""One rank's part of one round: ``{"send": [[peer, [cells]]...], "recv": [...]}``."""

_IDLE: Round = {"send": [], "recv": []}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSchedule:
    """One rank's part of the schedule.

    Attributes:
        reads: the cells this rank reads from storage into its own pieces.
        copies: ``(from, to)`` cells this rank copies between two of its own pieces (a key it holds twice).
        round_count: how many rounds the exchange has (the same on every rank; every rank takes part in each).
        active: ``(index, round)`` of the rounds in which this rank sends or receives, in order: kept sparse (and
            sent so) because at scale most ranks move bytes in few of hundreds of rounds; :attr:`rounds` expands.
        shared: whether any byte travels between ranks (False: a plain load).
    """

    reads: list[CellRef]
    copies: list[list[CellRef]]
    round_count: int
    active: list[tuple[int, Round]]
    shared: bool

    @property
    def rounds(self) -> list[Round]:
        """Per round, the cells this rank sends to each peer and receives from each peer, in message order
        (empty in the rounds it only takes part in)."""
        out = [_IDLE] * self.round_count
        for index, part in self.active:
            out[index] = part
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "reads": self.reads,
            "copies": self.copies,
            "round_count": self.round_count,
            "active": [[index, part] for index, part in self.active],
            "shared": self.shared,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RankSchedule:
        """The schedule :meth:`to_json` wrote (the coordinator of the same step sent it)."""
        active = [(int(index), part) for index, part in doc["active"]]
        count = int(doc["round_count"])
        return cls(reads=doc["reads"], copies=doc["copies"], round_count=count, active=active, shared=doc["shared"])


def _ref(piece: int, box: Box) -> CellRef:
    return [piece, list(box.offset), list(box.shape)]


def cells_of(boxes: list[Box]) -> list[Box] | None:
    """The grid cells that the boundaries of ``boxes`` cut their union into, inside each box (each cell
    once); None when there would be more than :data:`MAX_CELLS_PER_KEY`."""
    ndim = boxes[0].ndim
    cuts = [sorted({b.offset[a] for b in boxes} | {b.end[a] for b in boxes}) for a in range(ndim)]
    cells: set[Box] = set()
    for box in boxes:
        spans = []
        for axis in range(ndim):
            points = [p for p in cuts[axis] if box.offset[axis] <= p <= box.end[axis]]
            spans.append(list(itertools.pairwise(points)))
        count = math.prod(len(s) for s in spans)
        if len(cells) + count > MAX_CELLS_PER_KEY:
            return None
        for corner in itertools.product(*spans):
            cells.add(Box(tuple(lo for lo, _ in corner), tuple(hi - lo for lo, hi in corner)))
    return sorted(cells, key=lambda b: (b.offset, b.shape))


def _narrowed(box: Box, axis: int, lo: int, length: int) -> Box:
    """Elements ``[lo, lo + length)`` of ``box`` along ``axis`` (relative to its offset)."""
    offset, shape = list(box.offset), list(box.shape)
    offset[axis] += lo
    shape[axis] = length
    return Box(tuple(offset), tuple(shape))


def _slab_count(ranks: int, nbytes: int, min_slab_bytes: int) -> int:
    """How many slabs a cell of ``nbytes`` that ``ranks`` ranks share is read or sent in."""
    return min(ranks, MAX_READERS_PER_CELL, max(1, nbytes // min_slab_bytes))


def slabs(box: Box, parts: int) -> list[Box]:
    """``box`` cut into up to ``parts`` near-equal slabs along its first axis of extent > 1."""
    axis = next((a for a, n in enumerate(box.shape) if n > 1), None)
    if axis is None or parts <= 1:
        return [box]
    n = box.shape[axis]
    parts = min(parts, n)
    return [_narrowed(box, axis, n * i // parts, n * (i + 1) // parts - n * i // parts) for i in range(parts)]


def _pieces_of(box: Box, itemsize: int, max_bytes: int) -> list[Box]:
    """``box`` cut into boxes of at most ``max_bytes`` (at least one element each), along the first axes."""
    if box.volume * itemsize <= max_bytes or box.volume <= 1:
        return [box]
    axis = next(a for a, n in enumerate(box.shape) if n > 1)
    n = box.shape[axis]
    step = max(1, max_bytes // (box.volume // n * itemsize))
    slices = [_narrowed(box, axis, lo, min(step, n - lo)) for lo in range(0, n, step)]
    return [part for piece in slices for part in _pieces_of(piece, itemsize, max_bytes)]


def schedule_reads(
    needs: list[list[list[Any]]], *, round_bytes: int = DEFAULT_ROUND_BYTES, min_slab_bytes: int = MIN_SLAB_BYTES
) -> list[RankSchedule]:
    """On the coordinator: who reads which cell and who sends it to whom, for every rank.

    A shared cell is split into slabs of at least ``min_slab_bytes`` (a load passes the checkpoint's
    checksum chunk size when larger: a reader verifies whole chunks, so a chunk cut by a slab boundary is
    read by both readers, and slabs of at least a chunk keep that waste small).

    ``needs[r]`` lists rank ``r``'s target pieces, ``[key, offset, shape, dtype name]`` each
    (:func:`reshard.io.exchange.describe_need`), in the order the schedule's piece numbers refer to. Pure
    and deterministic.
    """
    size = len(needs)
    holders: dict[tuple[str, str], list[_Holder]] = {}
    for rank, rank_needs in enumerate(needs):
        for piece, (key, offset, shape, dtype) in enumerate(rank_needs):
            box = Box(tuple(offset), tuple(shape))
            if box.volume:
                holders.setdefault((key, dtype), []).append(_Holder(rank, piece, box))
    reads: list[list[CellRef]] = [[] for _ in range(size)]
    copies: list[list[list[CellRef]]] = [[] for _ in range(size)]
    transfers: list[Transfer] = []
    load = [0] * size  # bytes each rank reads so far
    for (_key, dtype), group in sorted(holders.items()):
        itemsize = DTYPE_BY_NAME[dtype].itemsize
        distinct = sorted({h.box for h in group}, key=lambda b: (b.offset, b.shape))
        overlapping = first_overlap(distinct) is not None
        cells = cells_of(distinct) if overlapping else distinct
        if cells is None:  # too many cells: every piece read by its own rank
            for h in group:
                reads[h.rank].append(_ref(h.piece, h.box))
                load[h.rank] += h.box.volume * itemsize
            continue
        by_box: dict[Box, list[_Holder]] = {}
        for h in group:
            by_box.setdefault(h.box, []).append(h)
        for cell in cells:
            # Boxes that only repeat each other (replicas) are their own cells: their needers at a lookup.
            needers = [h for h in group if cell.intersect(h.box) == cell] if overlapping else by_box[cell]
            if len(needers) == 1:
                (only,) = needers
                reads[only.rank].append(_ref(only.piece, cell))
                load[only.rank] += cell.volume * itemsize
                continue
            by_rank: dict[int, list[_Holder]] = {}
            for h in needers:
                by_rank.setdefault(h.rank, []).append(h)
            ranks = sorted(by_rank)
            for slab in slabs(cell, _slab_count(len(ranks), cell.volume * itemsize, min_slab_bytes)):
                reader = min(ranks, key=lambda r: (load[r], r))
                load[reader] += slab.volume * itemsize
                first = by_rank[reader][0]
                reads[reader].append(_ref(first.piece, slab))
                for other in by_rank[reader][1:]:
                    copies[reader].append([_ref(first.piece, slab), _ref(other.piece, slab)])
                for rank in ranks:
                    if rank == reader:
                        continue
                    for h in by_rank[rank]:
                        for part in _pieces_of(slab, itemsize, round_bytes):
                            nbytes = part.volume * itemsize
                            ident = len(transfers)
                            transfers.append(Transfer(reader, first.piece, rank, h.piece, part, nbytes, None, ident))
    return TransferPlan(size, round_bytes, copies, transfers, reads).schedules()


def pack_rounds(transfers: list[Transfer], size: int, round_bytes: int) -> list[list[Transfer]]:
    """Transfers packed into rounds so that no rank sends or receives more than ``round_bytes`` in one.

    First fit from each rank's first round with room: a rank whose sends (or receives) filled a round never
    looks at it again, so packing stays about linear in the number of transfers (replicas make many: a
    cell shared by n ranks is n slabs sent to n - 1 ranks each)."""
    sent: list[list[int]] = []
    received: list[list[int]] = []
    placed: list[list[Transfer]] = []
    send_floor = [0] * size  # every round before it is full for the rank's sends
    recv_floor = [0] * size
    count = 0  # len(placed), kept apart: the scan below is the hot loop at scale
    for t in transfers:
        src, dst, nbytes = t.src, t.dst, t.nbytes
        room = round_bytes - nbytes
        index = max(send_floor[src], recv_floor[dst])
        while index < count and (sent[index][src] > room or received[index][dst] > room):
            index += 1
        if index == count:
            placed.append([])
            sent.append([0] * size)
            received.append([0] * size)
            count += 1
        placed[index].append(t)
        sent[index][src] += nbytes
        received[index][dst] += nbytes
        floor = send_floor[src]
        while floor < count and sent[floor][src] >= round_bytes:
            floor += 1
        send_floor[src] = floor
        floor = recv_floor[dst]
        while floor < count and received[floor][dst] >= round_bytes:
            floor += 1
        recv_floor[dst] = floor
    return placed


def _rounds(placed: list[list[Transfer]], size: int) -> list[list[tuple[int, Round]]]:
    """Packed rounds as messages, per rank: ``(round index, {"send": [[peer, [cells]]...], "recv": [...]})`` of the
    rounds it moves bytes in. A rank receives a round's messages in the order of their peers, each message's cells
    in plan order. Only the ranks a round moves bytes of appear in it, so that the work (and the size of what is
    sent) is the transfers' and not rounds times ranks (hundreds of rounds of thousands of ranks at scale)."""
    out: list[list[tuple[int, Round]]] = [[] for _ in range(size)]
    for index, batch in enumerate(placed):
        outgoing: dict[int, dict[int, list[CellRef]]] = {}
        incoming: dict[int, dict[int, list[CellRef]]] = {}
        for t in batch:
            outgoing.setdefault(t.src, {}).setdefault(t.dst, []).append([*_ref(t.src_piece, t.box), None, t.ident])
            incoming.setdefault(t.dst, {}).setdefault(t.src, []).append([*_ref(t.dst_piece, t.box), t.wire, t.ident])
        for rank in sorted(outgoing.keys() | incoming.keys()):
            sends, receives = outgoing.get(rank, {}), incoming.get(rank, {})
            out[rank].append(
                (
                    index,
                    {
                        "send": [[peer, cells] for peer, cells in sorted(sends.items())],
                        "recv": [[peer, cells] for peer, cells in sorted(receives.items())],
                    },
                )
            )
    return out


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Every rank's part of an exchange (reads from storage, local copies, cells sent), kept on the
    coordinator so that a later transfer between the same pieces can send only some of its cells
    (:meth:`schedules`)."""

    size: int
    round_bytes: int
    copies: list[list[list[CellRef]]]
    transfers: list[Transfer]
    reads: list[list[CellRef]] | None = None
    """Per rank, the cells it reads from storage (a read-once load; None for a transfer)."""

    def schedules(self, only: set[int] | None = None, *, keep_order: bool = False) -> list[RankSchedule]:
        """Every rank's schedule: all cells, or only the sent cells numbered in ``only`` (local copies are
        always made). ``only`` is packed into rounds of its own, unless ``keep_order``: then each of its cells
        stays in its round of the whole plan (rounds left empty are dropped), so that every rank writes them
        in the order the whole plan does (which decides the bytes of targets that share memory)."""
        if only is None:
            placed = pack_rounds(self.transfers, self.size, self.round_bytes)
        elif keep_order:
            whole = pack_rounds(self.transfers, self.size, self.round_bytes)
            placed = [kept for batch in whole if (kept := [t for t in batch if t.ident in only])]
        else:
            placed = pack_rounds([t for t in self.transfers if t.ident in only], self.size, self.round_bytes)
        shared = any(placed)
        active = _rounds(placed, self.size)
        return [
            RankSchedule(
                reads=self.reads[r] if self.reads is not None else [],
                copies=self.copies[r],
                round_count=len(placed),
                active=active[r],
                shared=shared,
            )
            for r in range(self.size)
        ]


def schedule_transfer(
    holdings: list[list[list[Any]]], needs: list[list[list[Any]]], *, round_bytes: int = DEFAULT_ROUND_BYTES
) -> tuple[TransferPlan, list[str]]:
    """On the coordinator: where every rank's target pieces get their bytes from the pieces ranks hold.

    ``holdings[r]`` and ``needs[r]`` list rank ``r``'s source and target pieces (``[key, offset, shape, dtype name]``,
    with the source's key). Each target piece is cut by the boundaries of the source pieces it overlaps;
    each cell is copied locally when its rank holds it, otherwise sent by the holder that has sent the
    least so far (so replicas share the sending). The bytes travel in the holder's dtype and are converted
    on arrival. Returns the plan (:meth:`TransferPlan.schedules` gives every rank's part) and the parts of
    targets that no rank holds (one line each: the transfer cannot fill them). Pure and deterministic.
    """
    size = len(needs)
    held: dict[str, list[tuple[int, int, Box, str]]] = {}
    for rank, rank_holdings in enumerate(holdings):
        for piece, (key, offset, shape, dtype) in enumerate(rank_holdings):
            box = Box(tuple(offset), tuple(shape))
            if box.volume:
                held.setdefault(key, []).append((rank, piece, box, dtype))
    copies: list[list[list[CellRef]]] = [[] for _ in range(size)]
    transfers: list[Transfer] = []
    sent = [0] * size
    problems: list[str] = []
    for rank, rank_needs in enumerate(needs):
        for piece, (key, offset, shape, dtype) in enumerate(rank_needs):
            box = Box(tuple(offset), tuple(shape))
            if not box.volume:
                continue
            overlapping = [(h, o) for h in held.get(key, []) if (o := h[2].intersect(box)) is not None]
            sources = [h for h, _ in overlapping]
            # The cells of the target box (the overlaps lie inside it, so they only add boundaries).
            cells = cells_of([box, *(o for _, o in overlapping)])
            if cells is None:
                problems.append(f"{key!r}: the source boxes cut the target box at {list(box.offset)} too finely")
                continue
            for cell in cells:
                holders = [h for h in sources if cell.intersect(h[2]) == cell]
                if not holders:
                    problems.append(f"{key!r} box at {list(cell.offset)} of shape {list(cell.shape)} (rank {rank})")
                    continue
                own = next((h for h in holders if h[0] == rank), None)
                if own is not None:
                    copies[rank].append([_ref(own[1], cell), _ref(piece, cell)])
                    continue
                # A large cell held by several ranks comes in slabs, one from each (as a shared read does).
                ranks = len({h[0] for h in holders})
                wire_itemsize = DTYPE_BY_NAME[holders[0][3]].itemsize
                for slab in slabs(cell, _slab_count(ranks, cell.volume * wire_itemsize, MIN_SLAB_BYTES)):
                    src, src_piece, _, src_dtype = min(holders, key=lambda h: (sent[h[0]], h[0]))
                    src_itemsize = DTYPE_BY_NAME[src_dtype].itemsize
                    sent[src] += slab.volume * src_itemsize
                    wire = src_dtype if src_dtype != dtype else None
                    for part in _pieces_of(slab, src_itemsize, round_bytes):
                        nbytes = part.volume * src_itemsize
                        transfers.append(Transfer(src, src_piece, rank, piece, part, nbytes, wire, len(transfers)))
    return TransferPlan(size, round_bytes, copies, transfers), problems
