"""Asynchronous save: take a consistent snapshot now, write and commit in the background.

Phase one (the caller's thread, blocking): every tensor of the state dict is copied into a host buffer
that the :class:`AsyncCheckpointer` owns and reuses from one save to the next (memory touched for the first
time is slow, so steady-state saves copy into memory that is already mapped); CUDA tensors go to pinned
buffers with asynchronous copies on a side stream that first waits for the caller's current stream, then the
host waits for that side stream alone (never ``torch.cuda.synchronize()``: kernels queued on other streams
are not waited for), so the caller is blocked for about a device-to-host copy of the state. After this the
caller may change its tensors. With ``overlap_snapshot=True`` the caller is not blocked even for that: the
copies run while it queues its next forward and backward pass, and :meth:`SaveHandle.wait_snapshot`, called
before the optimizer step, makes the GPU (not the host) wait for whatever of them is not done by then.
Phase two (a background thread): the ordinary :func:`reshard.save` protocol on the snapshot: planning,
writing, agreement, commit. :meth:`SaveHandle.wait` joins it and raises its error (on every rank, since
save agrees on failures); :meth:`SaveHandle.done` polls.

Collectives and the training stream: the background thread runs reshard's collectives on the group you
give. They must not interleave with the training's own collectives on the same group, so pass a group
that only checkpointing uses, created once at start-up on every rank, e.g.
``dist.new_group(backend="gloo")`` (gloo also keeps the traffic off the GPUs' NCCL streams). With
``group=None`` the default group is used, which is only safe when nothing else issues collectives on it
while a save is in flight. A group that would carry them on NCCL (a pure NCCL group) is refused with
:class:`~reshard.CheckpointError`, as DCP refuses it for its asynchronous save.

A crash while the background thread writes leaves the previous checkpoint intact and the new one
incomplete (no ``metadata.json``), as with a synchronous save. One save is in flight per checkpointer: a
new save first finalises the previous one.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import threading
import time
from typing import Any

import torch

from reshard.errors import CheckpointError
from reshard.flows.options import SaveOptions
from reshard.flows.plan_cache import PlanCache
from reshard.flows.save import SaveResult, save_replacing
from reshard.flows.stats import SaveStats
from reshard.io.device import HostCopies, start_copies_to_host
from reshard.net.comm import Communicator
from reshard.net.transports import Group, TorchTransport
from reshard.state.dtensor import dtensor_to_sharded, is_dtensor
from reshard.state.scaled import GLOBAL_SCALE_SUFFIX, SCALE_SUFFIX, ScaledTensor, stored_view
from reshard.state.sharding import ShardedObject, ShardedTensor
from reshard.state.statedict import map_leaves
from reshard.storage import CheckpointLocation

__all__ = ["AsyncCheckpointer", "SaveHandle", "async_save"]


class SaveHandle:
    """A save running in the background. Thread-safe to poll; wait from the thread that started it."""

    def __init__(self, snapshot_seconds: float, copies: HostCopies | None = None) -> None:
        self.snapshot_seconds = snapshot_seconds
        """How long the caller was blocked taking the snapshot (with ``overlap_snapshot``: issuing it)."""
        self._copies = copies
        self.total_seconds: float | None = None
        """Snapshot plus background save, once done."""
        self.stats = SaveStats()
        """The background save's :class:`~reshard.SaveStats` (bytes, seconds per phase); complete once
        :meth:`done`."""
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._result: SaveResult | None = None
        self._reported = False
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        """Whether the background save has finished (successfully or not)."""
        return self._done.is_set()

    def snapshot_done(self) -> bool:
        """Whether the snapshot's copies are complete (always, unless the save was made with
        ``overlap_snapshot=True``), so that the saved tensors may change."""
        return self._copies is None or self._copies.done()

    def wait_snapshot(self) -> None:
        """With ``overlap_snapshot=True``: call before changing a saved tensor (before the optimizer step), on
        the thread that will change it. It makes that thread's current CUDA stream wait, on the device, for the
        snapshot's copies, so that the kernels queued next (the optimizer's) run after them; the host does not
        wait. A no-op for a blocking snapshot. Changing a tensor on another stream needs that stream to wait
        too (``torch.cuda.current_stream().wait_stream``), or a host wait: :meth:`snapshot_done` polls."""
        if self._copies is not None:
            self._copies.order_current_streams()

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Wait for the background save; return its :class:`~reshard.flows.save.SaveResult` (the committed
        metadata is in it on the coordinator).

        Raises the background save's error the first time it is called after a failure (later calls
        return None), and TimeoutError if ``timeout`` seconds pass first.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background save did not finish within {timeout} s")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error
        return self._result


class AsyncCheckpointer:
    """Asynchronous saves of one process, with host snapshot buffers reused across saves.

    Args:
        group: the process group of the saves (see the module doc: best a gloo group used only for
            checkpointing).
        timeout: collective timeout of the background saves.

    Every rank of the group creates one and calls :meth:`save` at the same points.
    """

    def __init__(self, *, group: Group = None, timeout: datetime.timedelta | float | None = None) -> None:
        self.group = group
        self.timeout = timeout
        self._buffers: dict[str, torch.Tensor] = {}
        self._inflight: SaveHandle | None = None
        self._plans: PlanCache | None = PlanCache()  # its saves' plans, in memory (reshard.flows.save_reuse)

    def _buffer(self, path: str, source: torch.Tensor) -> torch.Tensor:
        """The reusable host buffer for the leaf at ``path`` (same shape and dtype as ``source``)."""
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pin = source.device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
            self._buffers[path] = buffer
        return buffer

    def warmup(self, state_dict: Any) -> int:
        """Allocate and touch the snapshot buffers of ``state_dict`` now, so that the first :meth:`save` blocks
        only for a copy into memory already mapped, as every later one does (memory touched for the first time
        costs page faults: about three times a copy on a busy host). Call it once at start-up with the state
        that will be saved (same leaves, shapes and dtypes; the values do not matter); each rank calls it on its
        own, no collective. A save in flight is finalised first (its error, if any, is raised here).

        Returns the bytes of the buffers: the host memory an asynchronous save holds for its snapshot (the
        state's size, on top of ``SaveOptions(memory_budget_bytes=...)`` of the background save)."""
        self.wait()
        self._visit(state_dict, fill=False)[1].wait()
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def snapshot(self, state_dict: Any) -> Any:
        """A copy of ``state_dict`` whose tensors live in this checkpointer's host buffers (complete when it
        returns)."""
        snapshot, copies = self._visit(state_dict, fill=True)
        copies.wait()
        return snapshot

    def _visit(self, state_dict: Any, *, fill: bool) -> tuple[Any, HostCopies]:
        """Map every tensor leaf of ``state_dict`` to its buffer: copied into it (``fill``: the copies of GPU
        tensors are started, on side streams that first wait for the caller's stream, so that the snapshot
        holds what the kernels queued before this call computed) or only touched."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []

        def copy_tensor(path: str, tensor: torch.Tensor) -> torch.Tensor:
            source = stored_view(tensor)  # byte-only dtypes (packed FP4, E8M0) are copied as their bytes
            buffer = self._buffer(path, source)
            if fill:
                copies.append((buffer, source))
            else:
                buffer.zero_()
            return buffer.view(tensor.dtype)

        def copy_scaled(path: str, value: ScaledTensor) -> ScaledTensor:
            glob = value.global_scale
            return ScaledTensor(
                dataclasses.replace(value.data, data=copy_tensor(path, value.data.data)),
                copy_tensor(path + SCALE_SUFFIX, value.scale),
                value.format,
                value.block,
                copy_tensor(path + GLOBAL_SCALE_SUFFIX, glob) if glob is not None else None,
            )

        def leaf(path: str, value: Any) -> Any:
            if is_dtensor(value):
                # Snapshot this rank's local tensor. A rank outside the DTensor's mesh holds none of it: the
                # DTensor stays as it is, and the save skips it.
                described = dtensor_to_sharded(path, value)
                if described is None:
                    return value
                value = described
            if isinstance(value, ScaledTensor):
                return copy_scaled(path, value)
            if isinstance(value, ShardedTensor):
                return dataclasses.replace(value, data=copy_tensor(path, value.data))
            if isinstance(value, torch.Tensor):
                return copy_tensor(path, value)
            if isinstance(value, ShardedObject):
                return dataclasses.replace(value, value=copy.deepcopy(value.value)) if fill else value
            return value

        snapshot = map_leaves(state_dict, leaf)
        return snapshot, start_copies_to_host(copies)

    def save(
        self,
        state_dict: Any,
        path: CheckpointLocation,
        *,
        overwrite: bool = False,
        options: SaveOptions | None = None,
        storage_options: dict[str, Any] | None = None,
        base: CheckpointLocation | None = None,
        overlap_snapshot: bool = False,
    ) -> SaveHandle:
        """Snapshot ``state_dict`` and save it to ``path`` in the background (``overwrite``, ``options``,
        ``storage_options`` and ``base``, for an incremental save, as for :func:`reshard.save`). Called by every
        rank of the group. A previous save of this checkpointer is finalised first (its error, if any, is
        raised here), so a ``base`` that this checkpointer saved is complete before it is used.

        By default it returns once the snapshot is complete: the caller may change its tensors at once. With
        ``overlap_snapshot``, it returns once the copies of GPU tensors are *issued* (CPU tensors are copied
        either way): they run on side streams while the caller queues its next kernels (a forward and backward
        pass, which read the weights but do not change them), and the caller must call
        :meth:`SaveHandle.wait_snapshot` before it changes a saved tensor (before the optimizer step); the
        background save waits for them before it writes. The GPU then waits for the copies only where they
        are not done by the optimizer step.

        Raises:
            CheckpointError: the checkpointer's group would carry the background collectives on NCCL (a pure
                NCCL group; see the module doc), or the previous save's error."""
        if self._inflight is not None:
            previous, self._inflight = self._inflight, None
            previous.wait()
        _check_background_group(self.group, self.timeout)
        started = time.perf_counter()
        snapshot, copies = self._visit(state_dict, fill=True)
        if not overlap_snapshot:
            copies.wait()
        handle = SaveHandle(time.perf_counter() - started, copies if overlap_snapshot else None)

        def run() -> None:
            try:
                copies.wait()
                handle._result = save_replacing(
                    snapshot,
                    path,
                    replaces=None,
                    plan_cache=self._plans,
                    group=self.group,
                    overwrite=overwrite,
                    options=options,
                    timeout=self.timeout,
                    storage_options=storage_options,
                    base=base,
                )
                vars(handle.stats).update(vars(handle._result.stats))  # complete once done, as documented
            except BaseException as exc:  # delivered by wait()
                handle._error = exc
            finally:
                handle.total_seconds = time.perf_counter() - started
                handle._done.set()

        thread = threading.Thread(target=run, name="reshard-async-save", daemon=True)
        handle._thread = thread
        self._inflight = handle
        thread.start()
        return handle

    def wait(self) -> SaveResult | None:
        """Finalise the save in flight, if any."""
        if self._inflight is None:
            return None
        handle, self._inflight = self._inflight, None
        return handle.wait()


def _check_background_group(group: Group, timeout: datetime.timedelta | float | None) -> None:
    """Refuse a group that would carry the background save's collectives on NCCL (a pure NCCL group: its
    control plane is its GPU, :func:`~reshard.net.transports.plane_devices`): they would be queued on the
    communicator of the training's own collectives from another thread, in an order that can differ between
    ranks, and hang."""
    transport = Communicator(group, timeout=timeout).transport
    if isinstance(transport, TorchTransport) and transport.control_device.type != "cpu":
        raise CheckpointError(
            "an asynchronous save runs reshard's collectives on a background thread, and this group would carry "
            "them on NCCL beside the training's own collectives (their order could differ between ranks and hang): "
            "pass a group with a CPU backend, such as dist.new_group(backend='gloo') made once at start-up, a group "
            "made with backend='cpu:gloo,cuda:nccl', or "
            "reshard.net.transports.PlaneGroups(data=group, control=gloo_group)"
        )


def async_save(
    state_dict: Any,
    path: CheckpointLocation,
    *,
    group: Group = None,
    overwrite: bool = False,
    options: SaveOptions | None = None,
    timeout: datetime.timedelta | float | None = None,
    storage_options: dict[str, Any] | None = None,
    base: CheckpointLocation | None = None,
    overlap_snapshot: bool = False,
) -> SaveHandle:
    """A one-off asynchronous save (fresh snapshot buffers); see :class:`AsyncCheckpointer` to reuse
    buffers and keep one save in flight at a time (and for ``overlap_snapshot``). Called by every rank of
    ``group``. Its plan is not kept (a fresh checkpointer would only miss: one planning step, as :func:`reshard.save`).
    """
    checkpointer = AsyncCheckpointer(group=group, timeout=timeout)
    checkpointer._plans = None
    return checkpointer.save(
        state_dict,
        path,
        overwrite=overwrite,
        options=options,
        storage_options=storage_options,
        base=base,
        overlap_snapshot=overlap_snapshot,
    )
