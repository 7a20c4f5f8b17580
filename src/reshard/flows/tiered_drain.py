"""The background drain of a :class:`~reshard.TieredCheckpointManager`: one thread per rank that copies a step from
the node-local tier to the durable root and commits it there, while training goes on.

The drain runs reshard's collectives on its own process group (``drain_group``), never on the training's or the
saves' group, from a background thread, under the rules of an asynchronous save (:mod:`reshard.flows.async_save`):
a group that would carry them on NCCL is refused. One drain is in flight per manager; its error is kept and
raised on every rank by :meth:`Drain.join` (the drain's own steps agree on failures, so every rank's drain fails
alike).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable

from reshard.errors import CheckpointError
from reshard.net.comm import Communicator
from reshard.net.transports import Group, TorchTransport

__all__ = ["Drain", "check_drain_group"]


class Drain:
    """Step ``step`` drained by ``run`` on a background thread (started at once)."""

    def __init__(self, step: int, run: Callable[[], None]) -> None:
        self.step = step
        self.seconds: float | None = None
        """How long the drain took, once done."""
        self._error: BaseException | None = None
        self._done = threading.Event()
        started = time.perf_counter()

        def body() -> None:
            try:
                run()
            except BaseException as exc:  # delivered by join()
                self._error = exc
            finally:
                self.seconds = time.perf_counter() - started
                self._done.set()

        self._thread = threading.Thread(target=body, name=f"reshard-drain-{step}", daemon=True)
        self._thread.start()

    def state(self) -> str:
        """``running``, ``finalized`` or ``failed`` (not collective: this rank's drain)."""
        if not self._done.is_set():
            return "running"
        return "failed" if self._error is not None else "finalized"

    def join(self) -> None:
        """Wait for the drain; raise its error (the step is then not finalized)."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def check_drain_group(group: Group, timeout: datetime.timedelta | float | None) -> None:
    """Refuse a drain group that would carry the drain's collectives on NCCL (a pure NCCL group): they would be
    queued beside the training's own collectives from another thread, in an order that can differ between ranks.

    Raises:
        CheckpointError: naming what to pass instead.
    """
    transport = Communicator(group, timeout=timeout).transport
    if isinstance(transport, TorchTransport) and transport.control_device.type != "cpu":
        raise CheckpointError(
            "TieredCheckpointManager drains on a background thread, and drain_group would carry its collectives "
            "on NCCL beside the training's own: pass drain_group=dist.new_group(backend='gloo'), made once at "
            "start-up on every rank"
        )
