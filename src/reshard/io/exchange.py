"""Boxes over the network, executed: each rank's part of an exchange schedule
(:mod:`reshard.planning.exchange`, which decides who reads or holds which cell and who sends it to whom) run
as rounds of point-to-point traffic.

Read once (``LoadOptions(read_once=...)``): every read goes through the verifying reader of loads, so a sent
byte has had its checksum checked; nothing is re-read, and storage sees each needed byte once. Transfers
(:func:`reshard.transfer`, the peer-memory tier) send from the pieces ranks hold in memory.

Memory stays bounded: the messages of a round are one buffer per direction, reused from round to round.
Received bytes are copied into the destination tensors as they were read: bit-exact with reading them.

Who calls what: each rank describes its pieces with :func:`describe_need`; the coordinator schedules
(:func:`reshard.planning.exchange.schedule_reads` or ``schedule_transfer``) inside a collective step; each
rank then runs :func:`run_exchange` with its part of the schedule, which every rank of the group calls once
the reads of every rank have succeeded.

The schedules are re-exported here (``from reshard.io.exchange import schedule_reads`` keeps working).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard.geometry.boxes import Box
from reshard.net.transports import Transport
from reshard.planning.exchange import (
    DEFAULT_ROUND_BYTES,
    MAX_CELLS_PER_KEY,
    MAX_READERS_PER_CELL,
    MIN_SLAB_BYTES,
    CellRef,
    RankSchedule,
    TransferPlan,
    schedule_reads,
    schedule_transfer,
)
from reshard.state.dtypes import DTYPE_BY_NAME, dtype_name
from reshard.state.sharding import LocalPiece

__all__ = [
    "DEFAULT_ROUND_BYTES",
    "MAX_CELLS_PER_KEY",
    "MAX_READERS_PER_CELL",
    "MIN_SLAB_BYTES",
    "CellRef",
    "ExchangeCounters",
    "RankSchedule",
    "TransferPlan",
    "cell_view",
    "describe_need",
    "run_exchange",
    "schedule_reads",
    "schedule_transfer",
]


def describe_need(key: str, piece: LocalPiece) -> list[Any]:
    """One target piece as the coordinator's schedules take it (JSON, :mod:`reshard.planning.exchange`):
    ``[key, offset, shape, dtype name]`` (the dtype of the piece's data)."""
    return [key, list(piece.box.offset), list(piece.box.shape), dtype_name(piece.view.dtype)]


@dataclass(slots=True)
class ExchangeCounters:
    """Bytes this rank sent to and received from its peers in :func:`run_exchange`."""

    bytes_sent: int = 0
    bytes_received: int = 0


_ALIGN = 16
"""Each cell starts at a multiple of this in a message, so that it can be viewed as its dtype."""


def cell_view(pieces: Sequence[LocalPiece], ref: CellRef) -> torch.Tensor:
    """The part of this rank's piece ``ref[0]`` that holds the box ``ref[1:]``."""
    piece = pieces[ref[0]]
    box = Box(tuple(ref[1]), tuple(ref[2]))
    view = piece.view.detach()
    return view[box.relative_to(piece.box)] if view.ndim else view


def _layout(
    pieces: Sequence[LocalPiece], cells: list[CellRef], start: int
) -> tuple[list[tuple[torch.Tensor, torch.dtype, int]], int, int]:
    """One message of ``cells`` placed in a buffer at the first aligned offset from ``start``: each cell's
    view and offset, the message's first and end offsets. Sender and receiver place it alike (aligned
    start, same cells), so the padding between cells is the same on both sides."""
    out = []
    begin = at = -(-start // _ALIGN) * _ALIGN
    for ref in cells:
        at = -(-at // _ALIGN) * _ALIGN
        view = cell_view(pieces, ref)
        wire = DTYPE_BY_NAME[ref[3]] if len(ref) > 3 and ref[3] else view.dtype
        out.append((view, wire, at))
        at += view.numel() * wire.itemsize
    return out, begin, at


Placed = list[tuple[int, list[tuple[torch.Tensor, torch.dtype, int]], int, int]]
"""The messages of one direction of a round: peer, cells placed (view, wire dtype, offset), first, end."""


def _messages(pieces: Sequence[LocalPiece], messages: list[list[Any]]) -> Placed:
    """Every ``[peer, cells]`` message of a round's direction laid out one after the other in a buffer."""
    out: Placed = []
    at = 0
    for peer, cells in messages:
        placed, begin, at = _layout(pieces, cells, at)
        out.append((peer, placed, begin, at))
    return out


def _as_dtype(buffer: torch.Tensor, at: int, like: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    nbytes = like.numel() * wire.itemsize
    return buffer[at : at + nbytes].view(wire).view(like.shape)


def run_exchange(
    transport: Transport,
    schedule: RankSchedule,
    pieces: Sequence[LocalPiece],
    counters: ExchangeCounters,
    *,
    targets: Sequence[LocalPiece] | None = None,
) -> None:
    """This rank's part of the exchange: copies from its own pieces, then every round of sends and
    receives. Sends and copies read ``pieces``; receives and copies write ``targets`` (by default the same
    pieces: a load's reads land in its targets). A received cell in another dtype than its target (a
    transfer with a cast) is converted as it is copied into place. Called by every rank of the group (each
    with its own part of the same schedule), once per load or transfer, after every rank's reads (if any)
    succeeded.

    A local failure (a copy, or a cell that cannot be read into the send buffer or written from the
    receive buffer) does not leave the peers waiting: this rank goes on taking part in every round, sending
    zeros instead of what it could not read and writing nothing more, and raises the failure once the
    rounds are over, for the caller's agreed step to report on every rank. Only a failure of the transport
    itself ends the rounds at once."""
    targets = pieces if targets is None else targets
    error: Exception | None = None
    try:
        for source, target in schedule.copies:
            cell_view(targets, target).copy_(cell_view(pieces, source))
    except Exception as exc:  # raised after the rounds, which the peers are waiting for
        error = exc
    if schedule.rounds:
        error = _run_rounds(transport, schedule, pieces, targets, counters, error)
    if error is not None:
        raise error


def _run_rounds(
    transport: Transport,
    schedule: RankSchedule,
    pieces: Sequence[LocalPiece],
    targets: Sequence[LocalPiece],
    counters: ExchangeCounters,
    error: Exception | None,
) -> Exception | None:
    """Every round of :func:`run_exchange`; returns the first local failure (``error`` if given), after
    taking part in every round whatever failed."""
    rounds = [(_messages(pieces, rnd["send"]), _messages(targets, rnd["recv"])) for rnd in schedule.rounds]
    send_bytes = max((m[-1][3] for m, _ in rounds if m), default=0)
    recv_bytes = max((m[-1][3] for _, m in rounds if m), default=0)
    send_buffer = torch.empty(send_bytes, dtype=torch.uint8, device=transport.device)
    recv_buffer = torch.empty(recv_bytes, dtype=torch.uint8, device=transport.device)
    for outgoing, incoming in rounds:
        try:
            if error is None:
                for _, placed, _, _ in outgoing:
                    for view, wire, start in placed:
                        _as_dtype(send_buffer, start, view, wire).copy_(view)
                        counters.bytes_sent += view.numel() * wire.itemsize
        except Exception as exc:  # this rank fails, after the rounds its peers take part in
            error = exc
        if error is not None:
            send_buffer.zero_()  # never stale bytes of an earlier round, nor uninitialised memory
        transport.exchange(
            [(peer, send_buffer[begin:end]) for peer, _, begin, end in outgoing],
            [(peer, recv_buffer[begin:end]) for peer, _, begin, end in incoming],
        )
        try:
            if error is None:
                for _, placed, _, _ in incoming:
                    for view, wire, start in placed:
                        view.copy_(_as_dtype(recv_buffer, start, view, wire))
                        counters.bytes_received += view.numel() * wire.itemsize
        except Exception as exc:  # as above
            error = exc
    return error
