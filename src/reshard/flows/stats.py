"""What one rank's save did (:class:`SaveStats`), and the clock that times the phases of a save or load.

A phase is local work: planning, writing or reading data, committing. The time a rank spends inside a
collective step beyond its own local work (sending and receiving descriptions, plans and results, and
waiting for the slowest rank) is counted apart as *exchange*, so that a slow peer shows up as exchange time
on the others rather than inflating their own phases. Phase seconds never add up to more than the total:
the rest is bookkeeping between phases.

Every phase is logged at DEBUG on the ``reshard`` logger when it ends; :func:`reshard.save` and
:func:`reshard.load` log one INFO summary per rank. The logger has a ``NullHandler``, so nothing is printed
unless the application configures logging.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

__all__ = ["PhaseClock", "SaveStats", "fill_save_stats"]

logger = logging.getLogger("reshard")

_P = ParamSpec("_P")
_R = TypeVar("_R")

EXCHANGE = "exchange"
"""The phase name of time spent in collectives beyond local work."""


@dataclass
class SaveStats:
    """What one rank's save did, filled in by :func:`reshard.save` when passed as ``stats=``.

    Attributes:
        bytes_written: bytes of tensor data this rank wrote (its boxes' ``byte_length``, each box once in
            the whole checkpoint: the ranks' values add up to ``checkpoint_bytes``).
        boxes_written: tensor boxes this rank wrote.
        file_bytes: size of the data file this rank wrote (its boxes, its ShardedObject values and alignment
            padding); 0 when it wrote none (everything it holds is written by other replicas).
        checkpoint_bytes: bytes of tensor data in the whole checkpoint (the same on every rank).
        bytes_base_read: for an incremental save that verifies its base (``SaveOptions(verify_base=True)``),
            bytes this rank read back from the base's data files: the stored copy of every box it would
            reference, read before it references it.
        bytes_base_verified: of those, the bytes that read back as the state's (referenced).
        bytes_rewritten: bytes of tensor data this rank wrote although the base records the same content,
            because the base's stored copy did not read back as it (damaged, missing, unreadable); counted in
            ``bytes_written`` too.
        seconds_plan: flattening the state dict and describing its boxes; on the coordinator also
            validating the global layout, electing writers and preparing the directory (with its lock).
        seconds_exchange: time in collectives beyond this rank's own work: gathering descriptions and
            write reports, broadcasting plans and the committed metadata, waiting for the slowest rank.
        seconds_write: writing and checksumming this rank's data file, and syncing it; for an incremental
            save also hashing the boxes it holds and reading back the base's copies.
        seconds_verify_base: of ``seconds_write``, reading back and hashing the base's copies.
        seconds_commit: on the coordinator, building and committing ``metadata.json`` (and removing the
            files of an overwritten checkpoint); on the others, nothing (they get a summary, not the metadata).
        seconds: wall time of the whole save on this rank.
    """

    bytes_written: int = 0
    boxes_written: int = 0
    file_bytes: int = 0
    checkpoint_bytes: int = 0
    bytes_base_read: int = 0
    bytes_base_verified: int = 0
    bytes_rewritten: int = 0
    seconds_plan: float = 0.0
    seconds_exchange: float = 0.0
    seconds_write: float = 0.0
    seconds_commit: float = 0.0
    seconds_verify_base: float = 0.0
    seconds: float = 0.0

    @property
    def throughput(self) -> float:
        """bytes_written / seconds, in bytes per second (0.0 for an instant save)."""
        return self.bytes_written / self.seconds if self.seconds > 0 else 0.0

    @property
    def write_throughput(self) -> float:
        """bytes_written / seconds_write: the speed of the write phase alone, in bytes per second."""
        return self.bytes_written / self.seconds_write if self.seconds_write > 0 else 0.0


class PhaseClock:
    """Seconds per phase of one save or load on one rank (not thread-safe: one per operation).

    Args:
        operation: ``"save"`` or ``"load"``, for the log lines.
        rank: this rank in the operation's group, for the log lines.
        started: the ``time.perf_counter()`` value at which the operation began.
    """

    def __init__(self, operation: str, rank: int, started: float) -> None:
        self.operation = operation
        self.rank = rank
        self.started = started
        self.seconds: dict[str, float] = {}

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        logger.debug("[rank=%d] %s %s: %.6f s", self.rank, self.operation, name, seconds)

    def get(self, name: str) -> float:
        """Seconds spent in phase ``name`` so far (0.0 if never entered)."""
        return self.seconds.get(name, 0.0)

    def elapsed(self) -> float:
        """Seconds since the operation began."""
        return time.perf_counter() - self.started

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time of the ``with`` block as phase ``name`` (also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, time.perf_counter() - start)

    def timed(self, name: str, fn: Callable[_P, _R]) -> Callable[_P, _R]:
        """``fn``, counted as phase ``name`` whenever it runs (for the parts a collective step runs)."""

        def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with self.phase(name):
                return fn(*args, **kwargs)

        return run

    @contextmanager
    def exchange(self) -> Iterator[None]:
        """Around a collective step: its wall time not spent in phases counts as exchange."""
        before = sum(self.seconds.values())
        start = time.perf_counter()
        try:
            yield
        finally:
            inner = sum(self.seconds.values()) - before
            self._add(EXCHANGE, max(0.0, time.perf_counter() - start - inner))

    def summary(self) -> str:
        """The phases in the order they were first entered, for the INFO line: ``plan 0.010 s, ...``."""
        return ", ".join(f"{name} {seconds:.3f} s" for name, seconds in self.seconds.items())


def fill_save_stats(
    stats: SaveStats,
    clock: PhaseClock,
    *,
    file_bytes: int,
    checkpoint_bytes: int,
    written: Sequence[int],
    base_read: tuple[int, int, int, float] = (0, 0, 0, 0.0),
) -> None:
    """Fill ``stats`` once the save has committed.

    Args:
        file_bytes: the size of this rank's data file (0 if it wrote none).
        checkpoint_bytes: the bytes of tensor data of the whole checkpoint.
        written: the bytes of each tensor box this rank wrote.
        base_read: for an incremental save, the bytes this rank read back from its base, of those the bytes
            verified, the bytes it rewrote because their copy was bad, and the seconds reading back took.
    """
    stats.bytes_base_read, stats.bytes_base_verified, stats.bytes_rewritten, stats.seconds_verify_base = base_read
    stats.bytes_written = sum(written)
    stats.boxes_written = len(written)
    stats.file_bytes = file_bytes
    stats.checkpoint_bytes = checkpoint_bytes
    stats.seconds_plan = clock.get("plan")
    stats.seconds_exchange = clock.get(EXCHANGE)
    stats.seconds_write = clock.get("write")
    stats.seconds_commit = clock.get("commit")
    stats.seconds = clock.elapsed()
