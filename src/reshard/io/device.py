"""Tensor bytes between device memory and the host, for saves and loads, off the training's CUDA stream.

Storage reads and writes host memory, so a tensor in GPU memory crosses to the host on its way to a data file
and back on its way from one. Three pieces do it, all the same way: the copies are issued on a *side stream*
of the tensor's device that first waits for the stream current at the call (so they see every kernel the
training queued before it), and the host then waits for the side stream's work only, never with
``torch.cuda.synchronize()``, which would also wait for whatever else the device was given meanwhile. The
host buffers are pinned (page-locked), so that the copies are DMA transfers that run while the host works.

- :func:`copy_to_host`: many tensors into host tensors at once, then one wait (an asynchronous save's
  snapshot, the peer-memory tier's own copies); :func:`start_copies_to_host` only starts them, for a snapshot
  that overlaps with the caller's next kernels (:class:`HostCopies`).
- :class:`HostSlabs`: a save's tensors as consecutive byte slabs in host memory, for a writer to checksum
  and write: device slabs pass through a ring of reused pinned buffers, the copy of the next slab (of the
  same tensor or the next one) running while the writer handles the current one.
- :class:`DeviceFill`: a load's device destinations, each filled through a host *proxy* (a contiguous tensor
  of the saved dtype) carved from one of two pinned arenas; when an arena is full its proxies are copied into
  their destinations on the side stream, converting the dtype on the device, while reads go on into the
  other arena.

Tensors in host memory pass through unchanged (a contiguous CPU tensor is never copied); where CUDA is
absent, every piece works on host memory alone, which is how the CPU test suite exercises the same paths.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from reshard.state.dtypes import byte_view

__all__ = ["DeviceFill", "HostCopies", "HostSlabs", "copy_to_host", "is_host_bytes", "slabs_of", "start_copies_to_host"]

_ALIGN = 64
"""Every proxy of a :class:`DeviceFill` arena starts at a multiple of this many bytes."""


def is_host_bytes(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements are, as they are, the bytes a data file stores: contiguous CPU memory, no
    pending conjugation or negation (such a tensor is written and hashed without a copy)."""
    return tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()


def slabs_of(tensor: torch.Tensor, max_bytes: int) -> Iterator[torch.Tensor]:
    """Consecutive views that cover ``tensor`` in C order, each of at most ``max_bytes`` (or one element):
    runs of whole rows along the first axis, or, where one row is already larger, the slabs of each row."""
    if tensor.nbytes <= max_bytes or tensor.ndim == 0:
        yield tensor
        return
    row_bytes = tensor.nbytes // tensor.shape[0]
    if row_bytes <= max_bytes:
        step = max_bytes // row_bytes
        for start in range(0, tensor.shape[0], step):
            yield tensor[start : start + step]
        return
    for row in tensor:
        yield from slabs_of(row, max_bytes)


class _SideStreams:
    """One side stream per CUDA device, each made to wait, when first used, for the stream that was current
    on its device then (the caller's: the training's)."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}

    def of(self, device: torch.device) -> Any:
        stream = self.streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(device))
            self.streams[device] = stream
        return stream


def _recorded_event(stream: Any) -> Any:
    """An event recorded on ``stream`` now: complete once the work queued on it so far is."""
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


class HostCopies:
    """Copies into host tensors issued by :func:`start_copies_to_host`, possibly still running on side streams.

    :meth:`wait` blocks the calling thread until they are complete (any thread may call it);
    :meth:`order_current_streams` makes the calling thread's current stream of each device wait for them on
    the device instead, so that the host goes on and only the kernels queued afterwards wait."""

    def __init__(self, events: dict[torch.device, Any]) -> None:
        self._events = events

    def done(self) -> bool:
        """Whether every copy is complete (without waiting)."""
        return all(event.query() for event in self._events.values())

    def wait(self) -> None:
        """Block until every copy is complete."""
        for event in self._events.values():
            event.synchronize()

    def order_current_streams(self) -> None:
        """Make the current stream of every device involved wait for the copies (no host wait)."""
        for device, event in self._events.items():
            torch.cuda.current_stream(device).wait_event(event)


def start_copies_to_host(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> HostCopies:
    """Copy the source of every ``(host, source)`` pair into its host tensor (same shape; the source may be a
    view). Host sources are copied before it returns; CUDA sources are copied on side streams (see the module
    doc) that it only starts: they see every kernel the caller queued before the call, and neither the sources
    nor the host tensors may be changed or freed until the returned copies are complete. ``host`` tensors of
    CUDA sources should be pinned, or the transfers are synchronous.

    Not collective."""
    streams = _SideStreams()
    with torch.no_grad():
        for host, source in copies:
            data = source.detach()
            if data.device.type == "cuda":
                stream = streams.of(data.device)
                with torch.cuda.stream(stream):
                    host.copy_(data, non_blocking=True)
                # A source freed by the caller before the copy ran (a tensor made for the checkpoint) must not
                # be handed to the caller's next allocation meanwhile.
                data.record_stream(stream)
            else:
                host.copy_(data)
    return HostCopies({device: _recorded_event(stream) for device, stream in streams.streams.items()})


def copy_to_host(copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """:func:`start_copies_to_host`, then wait until every copy is complete: all are issued before the one
    wait, so that the host waits for the transfers, not for each tensor."""
    start_copies_to_host(copies).wait()


class HostSlabs:
    """Tensors as consecutive host byte slabs, for a writer that checksums and writes them in order (see the
    module doc). Owned by one writer and reused for all its tensors; not thread-safe.

    Memory: ``slots`` buffers of at most ``slab_bytes`` each, allocated at first need (pinned when a tensor
    of the call is on a CUDA device) and kept for later calls.

    Args:
        slab_bytes: the largest slab (a single element larger than it is one slab).
        slots: how many slabs may be in flight: 2 lets one copy run while the writer handles the previous
            slab.
    """

    def __init__(self, slab_bytes: int, *, slots: int = 2) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self.slab_bytes = max(1, slab_bytes)
        self.slots = slots
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * slots
        self.bytes_copied = 0
        """Bytes copied through the host slabs (device-to-host, or host views that were not plain bytes)."""

    @property
    def held_bytes(self) -> int:
        """Host memory the buffers hold now."""
        return sum(b.numel() for b in self._buffers)

    def _host_slab(self, slot: int, slab: torch.Tensor, pinned: bool, largest: int) -> torch.Tensor:
        """Buffer ``slot`` viewed as ``slab``'s dtype and shape, (re)allocated when too small or not pinned
        where it must be: at ``largest`` bytes, the largest slab of the call."""
        buffer = self._buffers[slot]
        if buffer.numel() < slab.nbytes or (pinned and not buffer.is_pinned()):
            buffer = torch.empty(max(largest, slab.nbytes), dtype=torch.uint8, pin_memory=pinned)
            self._buffers[slot] = buffer
        return buffer[: slab.nbytes].view(slab.dtype).view(slab.shape)

    def slabs(self, tensors: Sequence[torch.Tensor]) -> Iterator[tuple[int, memoryview]]:
        """``(position, bytes)`` covering the elements of ``tensors[position]`` in C order, positions in
        order, every position at least once (a tensor without elements: one empty slab).

        A yielded view is valid until the generator is resumed. Tensors already in plain host bytes
        (:func:`is_host_bytes`) are yielded whole without a copy; others are copied a slab at a time into the
        buffers: CUDA slabs up to ``slots`` ahead on a side stream, each waited for (its event, on the host)
        only when it is yielded; other host views (transposed, conjugate) synchronously. Leaving the generator
        early waits for the copies in flight, so that no buffer is released while a copy writes it."""
        datas = [t.detach() for t in tensors]
        pinned = torch.cuda.is_available() and any(d.device.type == "cuda" for d in datas)
        largest = min(self.slab_bytes, max((d.nbytes for d in datas if not is_host_bytes(d)), default=0))
        streams = _SideStreams()
        in_flight: deque[tuple[int, torch.Tensor, Any]] = deque()  # (position, host slab, its copy's event)
        issued = 0
        try:
            for position, data in enumerate(datas):
                if data.nbytes == 0 or is_host_bytes(data):
                    while in_flight:
                        yield self._ready(in_flight.popleft())
                    yield position, byte_view(data) if data.nbytes else memoryview(b"")
                    continue
                for slab in slabs_of(data, self.slab_bytes):
                    if data.device.type == "cuda":
                        if len(in_flight) == self.slots:
                            yield self._ready(in_flight.popleft())
                        host_slab = self._host_slab(issued % self.slots, slab, pinned, largest)
                        stream = streams.of(data.device)
                        with torch.no_grad(), torch.cuda.stream(stream):
                            host_slab.copy_(slab, non_blocking=True)
                        event = _recorded_event(stream)
                        in_flight.append((position, host_slab, event))
                    else:
                        while in_flight:
                            yield self._ready(in_flight.popleft())
                        host_slab = self._host_slab(issued % self.slots, slab, pinned, largest)
                        with torch.no_grad():
                            host_slab.copy_(slab)  # resolves a conjugate or negative view, converts nothing else
                        yield position, byte_view(host_slab)
                    issued += 1
                    self.bytes_copied += slab.nbytes
            while in_flight:
                yield self._ready(in_flight.popleft())
        finally:
            for _, _, event in in_flight:
                event.synchronize()

    @staticmethod
    def _ready(entry: tuple[int, torch.Tensor, Any]) -> tuple[int, memoryview]:
        position, host_slab, event = entry
        event.synchronize()
        return position, byte_view(host_slab)


class DeviceFill:
    """A load's destinations outside host memory, filled through host proxies (see the module doc). One per
    load; not thread-safe.

    Call order: :meth:`proxy` for each destination, then fill the proxy (read, verify, copy into it); when
    :meth:`has_room` answers False the current arena is full: finish every read into the proxies given so
    far, :meth:`flush`, then ask for the proxy. At the end :meth:`close` (every destination filled and complete), or
    :meth:`abandon` after a failure (the copies in flight are waited for, the rest dropped).

    Memory: two arenas of ``arena_bytes`` (pinned where CUDA is available), allocated at first need; a proxy
    larger than an arena (a single row larger than the load's read limit) gets an arena of its own size.
    """

    def __init__(self, arena_bytes: int) -> None:
        self.arena_bytes = max(1, arena_bytes)
        self._pinned = torch.cuda.is_available()
        self._arenas: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * 2
        self._current = 0
        self._used = 0
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(destination, proxy) of the current arena, not yet copied."""
        self._events: list[list[Any]] = [[], []]
        """The events of the copies out of each arena that may still run."""
        self._streams = _SideStreams()
        self.bytes_copied = 0
        """Bytes of proxies copied into their destinations."""

    def has_room(self, dest: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the current arena can hold the proxy of ``dest`` (an empty arena always can: it grows)."""
        start = -(-self._used // _ALIGN) * _ALIGN
        return not self._pending or start + dest.numel() * dtype.itemsize <= self._arenas[self._current].numel()

    def proxy(self, dest: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of ``dest``'s shape and of ``dtype`` (the saved dtype: a conversion to
        ``dest``'s happens on its device), copied into ``dest`` at the next :meth:`flush`. Ask
        :meth:`has_room` first: a full arena must be flushed.

        Raises:
            RuntimeError: the current arena has no room for it.
        """
        if not self.has_room(dest, dtype):
            raise RuntimeError("the arena is full: flush it before asking for another proxy")
        nbytes = dest.numel() * dtype.itemsize
        start = -(-self._used // _ALIGN) * _ALIGN
        arena = self._arenas[self._current]
        if start + nbytes > arena.numel():  # the arena is empty but too small (or not allocated yet)
            start = 0
            arena = torch.empty(max(nbytes, self.arena_bytes), dtype=torch.uint8, pin_memory=self._pinned)
            self._arenas[self._current] = arena
        host = arena[start : start + nbytes].view(dtype).view(dest.shape)
        self._pending.append((dest, host))
        self._used = start + nbytes
        return host

    def flush(self) -> None:
        """Copy the current arena's proxies into their destinations (issued on the side streams for CUDA
        destinations, at once for others), then switch to the other arena, waiting for the copies out of it
        first. Call only once every read into those proxies is done."""
        if not self._pending:
            return
        events = []
        used: set[torch.device] = set()
        with torch.no_grad():
            for dest, host in self._pending:
                if dest.device.type == "cuda":
                    stream = self._streams.of(dest.device)
                    with torch.cuda.stream(stream):
                        dest.copy_(host, non_blocking=True)
                    used.add(dest.device)
                else:
                    dest.copy_(host)
                self.bytes_copied += host.nbytes
        for device in used:
            events.append(_recorded_event(self._streams.of(device)))
        self._events[self._current] = events
        self._pending = []
        self._used = 0
        self._current ^= 1
        self._wait(self._current)

    def _wait(self, arena: int) -> None:
        for event in self._events[arena]:
            event.synchronize()
        self._events[arena] = []

    def close(self) -> None:
        """Copy what remains and wait until every destination holds its data."""
        self.flush()
        self._wait(0)
        self._wait(1)

    def abandon(self) -> None:
        """After a failure: drop the proxies not yet copied and wait for the copies in flight (never raises
        for lack of copies)."""
        self._pending = []
        self._wait(0)
        self._wait(1)
