"""The two-level control path: reshard's protocol gathered per node first, then by the node leaders.

Every phase of a save or load is a :meth:`~reshard.net.comm.Communicator.step`: each rank's payload is gathered on
the coordinator (rank 0), which decides and broadcasts (and, in ``step_scatter``, scatters one reply per rank).
Over a flat :class:`~reshard.net.transports.TorchTransport` the coordinator receives one message from each of the
N ranks, every one padded to the longest payload (:func:`~reshard.net.transports.padded_size`). A
:class:`HierarchicalTransport` moves the same bytes in two levels:

- gather: each rank -> its node's *leader* (the node's lowest rank), which frames its node's payloads into one
  message (:func:`frame`: a count, the lengths, the bodies; nothing is pickled); leaders -> the coordinator (the
  leader of node 0, which holds rank 0), which unframes them into rank order;
- scatter: the reverse (the coordinator frames each node's replies, the leaders unframe and scatter them);
- broadcast: coordinator -> leaders -> members;
- :meth:`~HierarchicalTransport.exchange` (tensor data between pairs of ranks) on the flat transport, unchanged.

The coordinator then receives N/k messages of k payloads each (k ranks per node), padded only to the longest
*node* message, and no rank talks to more than max(k, N/k) peers in one collective.

Which ranks call what: every method is collective over the whole group, as on any transport; inside, every rank
calls its node's collective and the leaders alone call the leaders' collective. The order of payloads is the
group's rank order for any assignment of ranks to nodes (:class:`NodeLayout`: nodes of unequal size, ranks of a
node that are not contiguous).

Failures: every wait of every level is bounded by the timeout and a dead or missing peer gives
:class:`~reshard.CommunicationError` (a rank that learns of a death only through its leader raises after at most
three waits: its leader's wait, the coordinator's, its own). The agreement of ``Communicator.step`` is unchanged:
it only moves bytes through the transport.

Selection: over ``torch.distributed`` pass a :class:`HierarchicalGroups` (made once, it creates the node groups
and the leaders' group) as the ``group`` of ``reshard.save``, ``reshard.load``, a manager or a
:class:`~reshard.net.comm.Communicator`; with threads, :class:`HierarchicalThreadGroup`. It is never chosen
automatically: measured on one machine with gloo over loopback at 8 and 16 processes (docs/scale.md, "Two-level
control path"), the extra hop costs more latency than the smaller coordinator messages save, and no machine of
the project runs the multi-node scales where it pays; so it stays opt-in.
"""

from __future__ import annotations

import datetime
import operator
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from reshard.errors import CheckpointError, CommunicationError
from reshard.net.transports import (
    PlaneGroups,
    ThreadGroup,
    ThreadTransport,
    TorchTransport,
    Transport,
    TransportFactory,
)

__all__ = [
    "HierarchicalGroups",
    "HierarchicalThreadGroup",
    "HierarchicalTransport",
    "NodeLayout",
    "frame",
    "unframe",
]

_COUNT = struct.Struct("<Q")


def frame(parts: Sequence[bytes]) -> bytes:
    """``parts`` as one message: their count, each one's length (8 bytes, little-endian), then the bodies."""
    header = struct.pack(f"<Q{len(parts)}Q", len(parts), *map(len, parts))
    return header + b"".join(parts)


def unframe(message: bytes, expected: int) -> list[bytes]:
    """The parts of a :func:`frame` message, which must hold ``expected`` of them and nothing else.

    Raises:
        CommunicationError: the message is not such a frame (a peer in another operation or version).
    """
    if len(message) < _COUNT.size:
        raise CommunicationError(f"a framed node message of {len(message)} bytes, shorter than its count")
    (count,) = _COUNT.unpack_from(message)
    body = _COUNT.size + count * _COUNT.size
    if count != expected or len(message) < body:
        raise CommunicationError(f"a framed node message of {count} parts where {expected} were expected")
    lengths = struct.unpack_from(f"<{count}Q", message, _COUNT.size)
    if body + sum(lengths) != len(message):
        raise CommunicationError(f"a framed node message of {len(message)} bytes, its parts add up to another size")
    parts, start = [], body
    for length in lengths:
        parts.append(message[start : start + length])
        start += length
    return parts


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Which ranks of a group share a node: ``nodes[i]`` are node i's group ranks, ascending (its first is its
    leader), nodes ordered by their lowest rank, so node 0 holds the coordinator (rank 0) and leads it.
    Build it with :meth:`of` (which sorts) or :meth:`blocks`."""

    size: int
    nodes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        ranks = sorted(r for node in self.nodes for r in node)
        if ranks != list(range(self.size)) or any(not node for node in self.nodes):
            raise CheckpointError(
                f"a node layout must put each rank 0..{self.size - 1} of the group on exactly one node, "
                f"got {[list(n) for n in self.nodes]}"
            )
        if any(list(node) != sorted(node) for node in self.nodes) or [n[0] for n in self.nodes] != sorted(
            n[0] for n in self.nodes
        ):
            raise CheckpointError("NodeLayout.nodes must be normalised: build it with NodeLayout.of")

    @classmethod
    def of(cls, size: int, nodes: Sequence[Sequence[int]]) -> NodeLayout:
        """The layout of these nodes (lists of group ranks, in any order). CheckpointError when they do not
        put each rank of a group of ``size`` on exactly one node."""
        normal = sorted((tuple(sorted(_rank_number(r) for r in _ranks_of(node))) for node in nodes), key=_first)
        return cls(size=size, nodes=tuple(normal))

    @classmethod
    def blocks(cls, size: int, ranks_per_node: int) -> NodeLayout:
        """Consecutive ranks ``ranks_per_node`` to a node (how launchers number ranks). CheckpointError unless
        ``ranks_per_node`` is a positive integer that divides ``size``."""
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise CheckpointError(f"ranks_per_node must be an integer of at least 1, got {ranks_per_node!r}")
        if size % ranks_per_node:
            raise CheckpointError(
                f"ranks_per_node={ranks_per_node} does not divide the group's {size} ranks into whole nodes "
                "(pass nodes=[[ranks of node 0], ...] for nodes of unequal size)"
            )
        return cls(size=size, nodes=tuple(tuple(range(s, s + ranks_per_node)) for s in range(0, size, ranks_per_node)))

    def node_of(self, rank: int) -> int:
        """The index of the node that holds group rank ``rank``."""
        return next(i for i, node in enumerate(self.nodes) if rank in node)


def _ranks_of(node: object) -> Sequence[object]:
    if isinstance(node, (str, bytes)) or not isinstance(node, Sequence):
        raise CheckpointError(f"a node of a node layout must be a list of integer ranks, got {node!r}")
    return node


def _rank_number(rank: object) -> int:
    """A rank of a node layout as an int: an integer (numpy's too), never a bool, float or text converted."""
    if isinstance(rank, bool):
        raise CheckpointError(f"a rank of a node layout must be an integer, got {rank!r}")
    try:
        return operator.index(rank)  # type: ignore[arg-type]
    except TypeError:
        raise CheckpointError(f"a rank of a node layout must be an integer, got {rank!r}") from None


def _first(node: tuple[int, ...]) -> int:
    return node[0] if node else -1


class HierarchicalTransport(Transport):
    """One rank's two-level transport (see the module doc).

    Args:
        flat: this rank's transport of the whole group (its rank and size are the group's; it carries
            :meth:`exchange`, the data plane).
        node: this rank's transport of its node's ranks, in the layout's order (local rank 0: the leader).
        leaders: on leaders only, the transport of the leaders, in node order (its rank 0: the coordinator);
            None on every other rank.
        layout: which ranks share a node; the same on every rank.
    """

    def __init__(self, flat: Transport, node: Transport, leaders: Transport | None, layout: NodeLayout) -> None:
        super().__init__()
        self.flat, self.node, self.leaders, self.layout = flat, node, leaders, layout
        self.rank, self.size, self.timeout, self.device = flat.rank, flat.size, flat.timeout, flat.device
        if layout.size != self.size:
            raise CheckpointError(f"a node layout of {layout.size} ranks for a group of {self.size}")
        index = layout.node_of(self.rank)
        members = layout.nodes[index]
        if node.size != len(members) or node.rank != members.index(self.rank):
            raise CheckpointError(
                f"rank {self.rank}: its node transport (rank {node.rank} of {node.size}) is not its node "
                f"{list(members)}"
            )
        if (leaders is not None) != (node.rank == 0) or (
            leaders is not None and (leaders.rank != index or leaders.size != len(layout.nodes))
        ):
            raise CheckpointError(f"rank {self.rank}: a leaders' transport is given to the node leaders, and only them")
        self.members = members
        """The group ranks of this rank's node, in node-rank order."""

    def level_bytes(self) -> dict[str, tuple[int, int]]:
        """(sent, received) payload bytes of each level: ``node``, ``leaders`` (zeros on members) and ``flat``."""
        levels = {"node": self.node, "leaders": self.leaders, "flat": self.flat}
        return {name: (t.bytes_sent, t.bytes_received) if t else (0, 0) for name, t in levels.items()}

    def _recount(self) -> None:
        self.bytes_sent = sum(sent for sent, _ in self.level_bytes().values())
        self.bytes_received = sum(received for _, received in self.level_bytes().values())

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Every rank's payload on the coordinator, in group rank order; None elsewhere. Every rank calls its
        node's gather; the leaders then gather their nodes' framed payloads on the coordinator."""
        try:
            from_node = self.node.gather_bytes(payload)
            if self.leaders is None or from_node is None:
                return None
            from_nodes = self.leaders.gather_bytes(frame(from_node))
            if from_nodes is None:
                return None
            out: list[bytes] = [b""] * self.size
            for members, message in zip(self.layout.nodes, from_nodes, strict=True):
                for rank, part in zip(members, unframe(message, len(members)), strict=True):
                    out[rank] = part
            return out
        finally:
            self._recount()

    def scatter_bytes(self, payloads: list[bytes] | None) -> bytes:
        """``payloads[r]`` (given by the coordinator, None elsewhere) to rank ``r``: the coordinator scatters
        one framed message per node to the leaders, each leader scatters its node's parts."""
        if self.rank == 0 and (payloads is None or len(payloads) != self.size):
            raise CheckpointError(f"scatter_bytes on the coordinator needs {self.size} payloads")
        try:
            mine: list[bytes] | None = None
            if self.leaders is not None:
                messages = None
                if payloads is not None and self.rank == 0:
                    messages = [frame([payloads[r] for r in members]) for members in self.layout.nodes]
                mine = unframe(self.leaders.scatter_bytes(messages), len(self.members))
            return self.node.scatter_bytes(mine)
        finally:
            self._recount()

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """The coordinator's ``payload`` on every rank: to the leaders, then from each leader to its node."""
        try:
            if self.leaders is not None:
                payload = self.leaders.broadcast_bytes(payload if self.rank == 0 else None)
            return self.node.broadcast_bytes(payload if self.leaders is not None else None)
        finally:
            self._recount()

    def exchange(self, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> None:
        """Tensor traffic between pairs of ranks: the flat transport's, unchanged (group ranks)."""
        self.flat.exchange(sends, receives)


class HierarchicalThreadGroup:
    """A group of threads (:class:`~reshard.net.transports.ThreadGroup`) whose protocol runs in two levels, for
    tests and simulations of the real save and load over :class:`HierarchicalTransport`: give each thread its
    :meth:`member` as the ``group``.

    Args:
        size: the number of ranks (threads).
        ranks_per_node: consecutive ranks per node (:meth:`NodeLayout.blocks`), or
        nodes: each node's ranks (any partition of the ranks; :meth:`NodeLayout.of`).
        timeout: how long a rank waits in one collective of one level (seconds).
    """

    def __init__(
        self,
        size: int,
        ranks_per_node: int | None = None,
        *,
        nodes: Sequence[Sequence[int]] | None = None,
        timeout: float = 60.0,
    ) -> None:
        if nodes is not None and ranks_per_node is None:
            self.layout = NodeLayout.of(size, nodes)
        elif ranks_per_node is not None and nodes is None:
            self.layout = NodeLayout.blocks(size, ranks_per_node)
        else:
            raise ValueError("give ranks_per_node or nodes (one of them)")
        self.size = size
        self.flat = ThreadGroup(size, timeout=timeout)
        self.nodes = [ThreadGroup(len(members), timeout=timeout) for members in self.layout.nodes]
        self.leaders = ThreadGroup(len(self.layout.nodes), timeout=timeout)

    def member(self, rank: int) -> HierarchicalTransport:
        """The transport of rank ``rank`` (use it from that rank's thread only)."""
        index = self.layout.node_of(rank)
        local = self.layout.nodes[index].index(rank)
        node: ThreadTransport = self.nodes[index].member(local)
        leaders = self.leaders.member(index) if local == 0 else None
        return HierarchicalTransport(self.flat.member(rank), node, leaders, self.layout)

    def abort(self) -> None:
        """Break every level's barrier: every rank waiting in a collective raises CommunicationError at once."""
        for group in (self.flat, self.leaders, *self.nodes):
            group.barrier.abort()


def _layout_argument(size: int, ranks_per_node: int | None, nodes: Sequence[Sequence[int]] | None) -> NodeLayout:
    """This rank's node layout from its arguments, else from the launcher's ``LOCAL_WORLD_SIZE``."""
    if nodes is not None:
        if ranks_per_node is not None:
            raise CheckpointError("HierarchicalGroups: give ranks_per_node or nodes, not both")
        return NodeLayout.of(size, nodes)
    if ranks_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        if not local.isdigit():
            raise CheckpointError(
                "HierarchicalGroups: no ranks_per_node was given and LOCAL_WORLD_SIZE (set by torchrun) is "
                f"{local or 'not set'}: pass ranks_per_node or nodes"
            )
        ranks_per_node = int(local)
    return NodeLayout.blocks(size, ranks_per_node)


class HierarchicalGroups(TransportFactory):
    """The process groups of the two-level control path over ``torch.distributed``: give it as the ``group``
    of ``reshard.save``, ``reshard.load``, a manager or a Communicator, like a process group.

    Collective, and expensive (it creates process groups): make it once, on every rank of ``group`` at the same
    point, and reuse it for every save and load. The ranks first agree on the layout (a
    :class:`~reshard.CheckpointError`, the same on every rank, when one passes another layout or one that does
    not fit); then every rank creates every node's group and the leaders' group, in node order (gloo: the
    protocol is small and latency-bound, see :func:`~reshard.net.transports.plane_devices`), as
    ``torch.distributed.new_group`` requires of every process of the job.

    ``group`` must therefore hold every process of the job, in rank order (a :class:`~reshard.CheckpointError`
    otherwise): the processes outside a subgroup would have to create its node groups too, and
    ``new_group(use_local_synchronization=True)``, which spares them, names a group by a count of the groups each
    process made before, which the ranks of different nodes need not share (their groups then never meet).

    Args:
        group: the ranks of the checkpoint operations: a process group (None: the default group) or a
            :class:`~reshard.net.transports.PlaneGroups`; tensor data keeps travelling on it.
        ranks_per_node: consecutive group ranks per node; default ``LOCAL_WORLD_SIZE`` (torchrun sets it). Must
            divide the group's size.
        nodes: instead, each node's group ranks (nodes of unequal size, non-contiguous ranks).
        timeout: how long creating the groups and agreeing on the layout may wait (seconds).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | PlaneGroups | None = None,
        ranks_per_node: int | None = None,
        *,
        nodes: Sequence[Sequence[int]] | None = None,
        timeout: float = 600.0,
    ) -> None:
        from reshard.net.comm import Communicator  # comm dispatches on TransportFactory, never imports this module

        self.group = group
        wait = datetime.timedelta(seconds=timeout)
        comm = Communicator(group, timeout=wait)
        size = comm.size

        def local() -> list[list[int]]:
            return [list(node) for node in _layout_argument(size, ranks_per_node, nodes).nodes]

        agreed = comm.step("agree on the node layout", local, _same_layout)
        self.layout = NodeLayout.of(size, agreed)
        flat = comm.transport
        if not isinstance(flat, TorchTransport):
            raise CheckpointError("HierarchicalGroups needs torch.distributed; use HierarchicalThreadGroup for threads")
        if flat.global_ranks != list(range(dist.get_world_size())):
            raise CheckpointError(
                f"HierarchicalGroups needs a group of every process of the job in rank order, not ranks "
                f"{flat.global_ranks} of {dist.get_world_size()} (every process calls torch.distributed.new_group)"
            )
        self._make_groups(flat.global_ranks, flat.rank, wait)

    def _make_groups(self, global_ranks: list[int], rank: int, timeout: datetime.timedelta) -> None:
        """Create every node's group and the leaders' group, in node order, on every rank (all of the job)."""
        self.node_group: dist.ProcessGroup | None = None
        self.leaders_group: dist.ProcessGroup | None = None
        mine = self.layout.node_of(rank)
        wanted = [[global_ranks[r] for r in members] for members in self.layout.nodes]
        wanted.append([global_ranks[members[0]] for members in self.layout.nodes])
        for index, ranks in enumerate(wanted):
            member = global_ranks[rank] in ranks
            made = dist.new_group(ranks, timeout=timeout, backend="gloo")
            if not member:
                continue
            if dist.get_process_group_ranks(made) != ranks:
                raise CheckpointError(f"a node group holds ranks {dist.get_process_group_ranks(made)}, not {ranks}")
            if index == mine:
                self.node_group = made
            elif index == len(self.layout.nodes):
                self.leaders_group = made

    def transport(self, timeout: datetime.timedelta) -> HierarchicalTransport:
        """This rank's :class:`HierarchicalTransport` over the groups, every wait bounded by ``timeout``."""
        if isinstance(self.group, PlaneGroups):
            flat = TorchTransport(self.group.data, timeout, control_group=self.group.control)
        else:
            flat = TorchTransport(self.group, timeout)
        node = TorchTransport(self.node_group, timeout)
        leaders = TorchTransport(self.leaders_group, timeout) if self.leaders_group is not None else None
        return HierarchicalTransport(flat, node, leaders, self.layout)


def _same_layout(layouts: list[list[list[int]]]) -> list[list[int]]:
    """The coordinator's check that every rank passed the same node layout."""
    if any(layout != layouts[0] for layout in layouts):
        differ = ", ".join(f"rank {r}: {layout}" for r, layout in enumerate(layouts) if layout != layouts[0])
        raise CheckpointError(
            f"HierarchicalGroups: the ranks disagree about the node layout (rank 0: {layouts[0]}; {differ}); "
            "every rank must pass the same ranks_per_node (or nodes, or LOCAL_WORLD_SIZE)"
        )
    return layouts[0]
