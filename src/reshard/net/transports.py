"""How the ranks of a checkpoint operation exchange bytes: the transports under :class:`~reshard.net.comm.Communicator`.

A :class:`Transport` moves byte payloads among the ranks of one group: a gather to the coordinator (rank
0), a broadcast from it, a scatter from it; and tensor data between pairs of ranks (:meth:`Transport.exchange`,
the data plane of :mod:`reshard.io.exchange`). Three implementations:

- :class:`TorchTransport`: a ``torch.distributed`` process group (gloo or NCCL). Payloads travel in uint8
  tensors (nothing is pickled), every collective is issued asynchronously and waited on with the timeout,
  and what a rank sends does not grow with the number of ranks (a gather pads payloads to the longest,
  found with an all-reduce of one integer; replies go out by scatter).
- :class:`SingleProcess`: one rank alone (no ``torch.distributed``).
- :class:`ThreadGroup`: ranks that are threads of one process (:meth:`ThreadGroup.member` gives each its
  transport). For tests and simulations that run the real ``save`` and ``load`` on several ranks in one
  process; a rank that does not arrive within the timeout breaks the group's barrier for every rank.

Every method is collective: every rank of the group calls it, in the same order.
"""

from __future__ import annotations

import datetime
import struct
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reshard.errors import CheckpointError, CommunicationError

__all__ = [
    "EVERY_RANK_HINT",
    "Group",
    "PlaneGroups",
    "SingleProcess",
    "ThreadGroup",
    "ThreadTransport",
    "TorchTransport",
    "Transport",
    "TransportFactory",
    "padded_size",
    "plane_devices",
]

_LENGTH = struct.Struct("<Q")


def padded_size(lengths: list[int]) -> int:
    """Bytes each rank sends in a gather (or receives in a scatter) of payloads of these lengths over a
    :class:`TorchTransport`: every payload travels padded to the longest, behind its 8-byte length."""
    return _LENGTH.size + max(lengths, default=0)


EVERY_RANK_HINT = (
    "every rank of the group must make the same reshard call (save, load, a manager's save...) at the same "
    "point; a rank that never made it, made another, or died leaves the others waiting"
)
"""The reminder in every collective timeout: the usual cause is a rank that did not call at all."""


class Transport(ABC):
    """The byte collectives of one group, seen from one rank."""

    rank: int
    size: int
    timeout: datetime.timedelta
    device: torch.device = torch.device("cpu")
    """Where the tensors of :meth:`exchange` live (the data plane: the GPU of this rank for NCCL)."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        """Payload bytes this rank has put into collectives."""
        self.bytes_received = 0
        """Payload bytes this rank has got out of collectives."""

    @abstractmethod
    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Every rank's payload on the coordinator (in rank order); None on the other ranks."""

    @abstractmethod
    def scatter_bytes(self, payloads: list[bytes] | None) -> bytes:
        """``payloads[r]`` (given by the coordinator; None elsewhere) to rank ``r``; this rank's payload."""

    @abstractmethod
    def exchange(self, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> None:
        """One round of point-to-point traffic: send each ``(peer, data)`` of ``sends`` and fill each
        ``(peer, buffer)`` of ``receives`` with what that peer sends this rank in the same round (one message
        per pair and direction; contiguous uint8 tensors on :attr:`device`, sized alike on both sides).
        Called by every rank of the group for every round, with or without traffic of its own."""

    @abstractmethod
    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """The coordinator's ``payload`` on every rank (the others pass None)."""


@dataclass(frozen=True, slots=True)
class PlaneGroups:
    """Two process groups of the same ranks for one checkpoint operation: ``control`` (gloo) carries reshard's
    own protocol, ``data`` (the job's NCCL group; None: the default group) carries tensor data between ranks.
    For a job whose groups are pure NCCL (``init_process_group("nccl")``), which would otherwise carry the
    protocol on its GPUs too (:func:`plane_devices`); Megatron-Core keeps such gloo twins of its groups.

    ``control`` must hold the same ranks as ``data``, in the same order (checked: a
    :class:`~reshard.CheckpointError` otherwise)."""

    data: dist.ProcessGroup | None
    control: dist.ProcessGroup


class TransportFactory(ABC):
    """Process groups made once (creating them is collective and expensive) from which every checkpoint
    operation makes its own :class:`Transport`, with that operation's timeout:
    :class:`~reshard.net.hierarchy.HierarchicalGroups` (the two-level control path)."""

    @abstractmethod
    def transport(self, timeout: datetime.timedelta) -> Transport:
        """This rank's transport over the groups, every wait bounded by ``timeout``. Local: no collective."""


Group = dist.ProcessGroup | Transport | PlaneGroups | TransportFactory | None
"""The ranks of a checkpoint operation: a process group, its :class:`PlaneGroups` (a gloo group for reshard's
protocol beside it), a :class:`TransportFactory` (:class:`~reshard.net.hierarchy.HierarchicalGroups`: the
protocol gathered per node first), a transport (a :class:`ThreadGroup` member), or ``None`` (the default group
when ``torch.distributed`` is initialised, else this process alone)."""


class SingleProcess(Transport):
    """A group of one: every collective returns at once."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        super().__init__()
        self.rank, self.size, self.timeout = 0, 1, timeout

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        return [payload]

    def scatter_bytes(self, payloads: list[bytes] | None) -> bytes:
        if payloads is None or len(payloads) != 1:
            raise CheckpointError("scatter_bytes on the coordinator needs one payload per rank")
        return payloads[0]

    def exchange(self, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> None:
        if sends or receives:
            raise CheckpointError("a group of one process has no peer to exchange data with")

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        return payload or b""


def plane_devices(backend_config: str) -> tuple[str, str]:
    """The device types of a process group's two planes, from its backend configuration
    (``dist.get_backend_config``: ``"cpu:gloo,cuda:nccl"``, ``"cuda:nccl"``, ``"cpu:gloo,cuda:gloo"``...):

    - the *control* plane, reshard's own protocol (gathers, scatters and broadcasts of small JSON payloads):
      on the CPU wherever the group has a CPU backend (gloo). Those collectives are latency-bound: on NCCL each
      would put an upload, a kernel and a download with a stream synchronisation on the GPU for a few kilobytes,
      and an asynchronous save's background thread would queue them beside the training's own collectives.
      Only a group without a CPU backend (pure NCCL) carries them on its GPU.
    - the *data* plane, tensor bytes between ranks (read once per replica group, ``reshard.transfer``, the
      peer-memory tier): on the GPU where the group's CUDA backend is not gloo (NCCL: NVLink and InfiniBand,
      and GPU tensors sent without a trip through host memory); on the CPU otherwise, GPU tensors being staged
      through host buffers.

    An unrecognised configuration (a custom backend) puts both planes on the CPU unless it names NCCL.
    """
    backends: dict[str, str] = {}
    for part in backend_config.split(","):
        device, _, backend = part.strip().partition(":")
        if backend:
            backends[device.strip().lower()] = backend.strip().lower()
        elif device:  # a bare backend name
            backends.setdefault("cuda" if device.strip().lower() == "nccl" else "cpu", device.strip().lower())
    control = "cpu" if "cpu" in backends or "cuda" not in backends else "cuda"
    data = "cuda" if backends.get("cuda", "gloo") != "gloo" else "cpu"
    return control, data


def _backend_config(group: dist.ProcessGroup | None) -> str:
    try:
        return str(dist.get_backend_config(group))
    except (AttributeError, ValueError, RuntimeError):  # a torch without it, or a backend it cannot name
        return str(dist.get_backend(group))


def _device(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


class TorchTransport(Transport):
    """A ``torch.distributed`` process group (``None``: the default group), every wait bounded by
    ``timeout``. Its control collectives and its data exchanges may run on different devices of the group's
    backends (:func:`plane_devices`): a group made with ``backend="cpu:gloo,cuda:nccl"`` (what
    ``init_process_group()`` makes on a machine with GPUs when no backend is named) carries reshard's protocol
    on gloo and tensor data on NCCL."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        timeout: datetime.timedelta,
        *,
        control_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        """The group of the data plane (:meth:`exchange`)."""
        self.control_group = control_group if control_group is not None else group
        """The group of the control plane (gather, scatter, broadcast): ``control_group`` (a
        :class:`PlaneGroups`' gloo group) or ``group`` itself."""
        self.timeout = timeout
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.rank < 0:
            raise CheckpointError("this process is not a member of the process group it was given")
        self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]
        if control_group is not None and dist.get_process_group_ranks(control_group) != self.global_ranks:
            raise CheckpointError(
                f"the control group of PlaneGroups holds ranks {dist.get_process_group_ranks(control_group)}, the "
                f"data group {self.global_ranks}: they must be the same ranks in the same order"
            )
        self.control_device = _device(plane_devices(_backend_config(self.control_group))[0])
        """Where the payloads of gather, scatter and broadcast travel (see :func:`plane_devices`)."""
        self.device = _device(plane_devices(_backend_config(group))[1])
        self._data_plane_ready = self.device.type == "cpu"

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise CommunicationError(
                f"collective {what} on rank {self.rank} did not complete within "
                f"{self.timeout.total_seconds():.0f} s or a peer failed ({EVERY_RANK_HINT}): {exc}"
            ) from exc

    def _longest(self, length: int) -> int:
        """The largest ``length`` of any rank (an all-reduce of one integer)."""
        value = torch.tensor([length], dtype=torch.int64, device=self.control_device)
        work = dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.control_group, async_op=True)
        self._wait(work, "all_reduce(length)")
        self.bytes_sent += value.nbytes
        self.bytes_received += value.nbytes
        return int(value.item())

    def _framed(self, payload: bytes, size: int) -> torch.Tensor:
        """``payload`` behind its length, zero-padded to ``size`` bytes, as a tensor on the device."""
        framed = torch.zeros(size, dtype=torch.uint8)
        framed[: _LENGTH.size + len(payload)] = torch.frombuffer(
            bytearray(_LENGTH.pack(len(payload)) + payload), dtype=torch.uint8
        )
        return framed.to(self.control_device)

    @staticmethod
    def _unframed(framed: torch.Tensor) -> bytes:
        raw = framed.cpu().numpy().tobytes()
        (length,) = _LENGTH.unpack_from(raw)
        return raw[_LENGTH.size : _LENGTH.size + length]

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Gather one payload per rank onto the coordinator; other ranks get None. Collective.

        Each rank sends :func:`padded_size` bytes (its payload padded to the longest), whatever the number
        of ranks; the coordinator receives that many from each.
        """
        if self.size == 1:
            return [payload]
        size = _LENGTH.size + self._longest(len(payload))
        mine = self._framed(payload, size)
        gather_list = (
            [torch.empty(size, dtype=torch.uint8, device=self.control_device) for _ in range(self.size)]
            if self.is_coordinator
            else None
        )
        work = dist.gather(mine, gather_list, dst=self.global_ranks[0], group=self.control_group, async_op=True)
        self._wait(work, "gather")
        if gather_list is None:
            self.bytes_sent += size
            return None
        self.bytes_received += size * (self.size - 1)
        return [self._unframed(t) for t in gather_list]

    def scatter_bytes(self, payloads: list[bytes] | None) -> bytes:
        """Send ``payloads[r]`` from the coordinator to rank ``r``; every rank gets its own. Collective: the
        coordinator passes one payload per rank, the others pass None.

        The longest length is broadcast first, then each rank receives :func:`padded_size` bytes.
        """
        if self.size == 1:
            if payloads is None or len(payloads) != 1:
                raise CheckpointError("scatter_bytes on the coordinator needs one payload per rank")
            return payloads[0]
        if self.is_coordinator and (payloads is None or len(payloads) != self.size):
            raise CheckpointError(f"scatter_bytes on the coordinator needs {self.size} payloads")
        longest = torch.tensor(
            [max(map(len, payloads)) if payloads else 0], dtype=torch.int64, device=self.control_device
        )
        work = dist.broadcast(longest, src=self.global_ranks[0], group=self.control_group, async_op=True)
        self._wait(work, "broadcast(length)")
        size = _LENGTH.size + int(longest.item())
        mine = torch.empty(size, dtype=torch.uint8, device=self.control_device)
        scatter_list = [self._framed(p, size) for p in payloads] if self.is_coordinator and payloads else None
        work = dist.scatter(mine, scatter_list, src=self.global_ranks[0], group=self.control_group, async_op=True)
        self._wait(work, "scatter")
        if self.is_coordinator:
            self.bytes_sent += longest.nbytes + size * (self.size - 1)
        else:
            self.bytes_received += longest.nbytes + size
        return self._unframed(mine)

    def exchange(self, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> None:
        """Point-to-point sends and receives of this rank only (a rank without traffic returns at once, after
        the first round on a GPU data plane); all are posted before any is waited on, so no order of the pairs
        can deadlock. On NCCL they are posted as one batch (``batch_isend_irecv``: a send and a receive
        between the same two ranks would otherwise wait for each other on the pair's stream), and the first
        round starts with an all-reduce of one element on the data plane, so that its communicator is made by
        every rank before any batch involves only some of them."""
        if not self._data_plane_ready:
            ready = torch.zeros(1, dtype=torch.int32, device=self.device)
            self._wait(dist.all_reduce(ready, group=self.group, async_op=True), "all_reduce(data plane)")
            self._data_plane_ready = True
        if not sends and not receives:
            return
        works: list[Any]
        if self.device.type != "cpu":
            ops = [dist.P2POp(dist.isend, data, self.global_ranks[peer], self.group) for peer, data in sends]
            ops += [dist.P2POp(dist.irecv, buffer, self.global_ranks[peer], self.group) for peer, buffer in receives]
            works = dist.batch_isend_irecv(ops)
        else:
            works = [dist.isend(data, self.global_ranks[peer], group=self.group) for peer, data in sends]
            works += [dist.irecv(buffer, self.global_ranks[peer], group=self.group) for peer, buffer in receives]
        for work in works:
            self._wait(work, "exchange (send/receive)")

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Send the coordinator's ``payload`` to every rank; others pass None."""
        if self.size == 1:
            return payload or b""
        length = torch.tensor(
            [len(payload) if payload is not None else 0], dtype=torch.int64, device=self.control_device
        )
        self._wait(
            dist.broadcast(length, src=self.global_ranks[0], group=self.control_group, async_op=True),
            "broadcast(length)",
        )
        n = int(length.item())
        if self.is_coordinator:
            self.bytes_sent += length.nbytes + n
        else:
            self.bytes_received += length.nbytes + n
        if self.is_coordinator and payload is not None:
            buffer = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.control_device)
                if n
                else torch.empty(0, dtype=torch.uint8)
            )
        else:
            buffer = torch.empty(n, dtype=torch.uint8, device=self.control_device)
        if n:
            work = dist.broadcast(buffer, src=self.global_ranks[0], group=self.control_group, async_op=True)
            self._wait(work, "broadcast")
        return bytes(buffer.cpu().numpy().tobytes())


class ThreadGroup:
    """A group whose ranks are threads of this process. Create one per group, then give each thread its
    :meth:`member` as the ``group`` of ``reshard.save``, ``reshard.load`` or a ``CheckpointManager``.

    Args:
        size: the number of ranks (threads).
        timeout: how long a rank waits for the others in one collective (seconds).
    """

    def __init__(self, size: int, *, timeout: float = 60.0) -> None:
        if size < 1:
            raise ValueError(f"a group has at least one rank, not {size}")
        self.size = size
        self.timeout = datetime.timedelta(seconds=timeout)
        self.barrier = threading.Barrier(size)
        self.slots: list[bytes] = [b""] * size
        self.shared = b""
        self.mailbox: dict[tuple[int, int], torch.Tensor] = {}

    def member(self, rank: int) -> ThreadTransport:
        """The transport of rank ``rank`` (use it from that rank's thread only)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a group of {self.size}")
        return ThreadTransport(self, rank)


class ThreadTransport(Transport):
    """One rank of a :class:`ThreadGroup`."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        super().__init__()
        self.group = group
        self.rank = rank
        self.size = group.size
        self.timeout = group.timeout

    def _sync(self, what: str) -> None:
        try:
            self.group.barrier.wait(self.timeout.total_seconds())
        except threading.BrokenBarrierError:
            raise CommunicationError(
                f"collective {what} on rank {self.rank} did not complete within "
                f"{self.timeout.total_seconds():.0f} s or a peer failed ({EVERY_RANK_HINT})"
            ) from None

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        self.group.slots[self.rank] = payload
        self._sync("gather")
        out = list(self.group.slots) if self.rank == 0 else None
        self._sync("gather")
        self.bytes_sent += len(payload)
        if out is not None:
            self.bytes_received += sum(len(p) for p in out) - len(payload)
        return out

    def scatter_bytes(self, payloads: list[bytes] | None) -> bytes:
        if self.rank == 0:
            if payloads is None or len(payloads) != self.size:
                raise CheckpointError(f"scatter_bytes on the coordinator needs {self.size} payloads")
            self.group.slots = list(payloads)
        self._sync("scatter")
        mine = self.group.slots[self.rank]
        self._sync("scatter")
        self.bytes_received += len(mine)
        return mine

    def exchange(self, sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]) -> None:
        for peer, data in sends:
            self.group.mailbox[(self.rank, peer)] = data.clone()
        self._sync("exchange")
        for peer, buffer in receives:
            buffer.copy_(self.group.mailbox.pop((peer, self.rank)))
        self._sync("exchange")

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        if self.rank == 0:
            self.group.shared = payload or b""
        self._sync("broadcast")
        value = self.group.shared
        self._sync("broadcast")
        self.bytes_received += len(value)
        return value
