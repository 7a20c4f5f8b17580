"""What one rank's save or load did (:class:`SaveStats`, :class:`LoadStats`), and the clock that times the
phases of a save or load.

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

__all__ = ["LoadStats", "PhaseClock", "SaveStats", "fill_save_stats"]

logger = logging.getLogger("reshard")

_P = ParamSpec("_P")
_R = TypeVar("_R")

EXCHANGE = "exchange"
"""The phase name of time spent in collectives beyond local work."""


@dataclass
class SaveStats:
    """What one rank's save did: ``SaveResult.stats``, what :func:`reshard.save` returns.

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


@dataclass
class LoadStats:
    """What one rank's load did, filled in by :func:`load` when passed as ``stats=``.

    Attributes:
        bytes_needed: bytes of saved tensor data that this rank's targets cover.
        bytes_read: bytes of tensor data actually read (>= needed: strided runs merged into larger reads).
        read_requests: number of read calls issued for tensor data.
        bytes_verified: bytes whose checksum was verified.
        bytes_verify_extra: bytes read (or, for mapped local files, checksummed) beyond the planned reads,
            to verify the whole chunks that the reads touch (not counted in ``bytes_read``).
        bytes_direct: bytes read straight into their destination tensor (no intermediate copy), or, for a
            destination in GPU memory, into its pinned host proxy (one copy to the device, no other).
        bytes_to_device: bytes copied from pinned host proxies into destinations in GPU memory (on a side
            stream, overlapped with the reads; docs/concepts.md, "GPU memory").
        bytes_from_peers, bytes_to_peers: with ``LoadOptions(read_once=...)`` in effect, the bytes this rank
            received from the ranks that read them, and sent to the ranks that needed what it read (its own
            reads are in ``bytes_read``; over all ranks, storage sees each needed byte once).
        exchange_rounds: the rounds that exchange took (the same on every rank; 0 without one).
        read_once: whether the load read once per replica group (agreed: the same on every rank; with nothing
            needed by two ranks there is no exchange even so).
        read_once_reason: why, the same on every rank: ``LoadOptions(read_once=True)``, ``one rank``,
            ``staging downloads each file once per node``, ``object store s3://...``, ``/mnt/ckpt is nfs4 (a
            shared file system, mounted at /mnt/ckpt)``, ``/tmp/x is ext4 (local, mounted at /)``, an override
            (``LocalStorage(shared=True) for ...``, ``RESHARD_SHARED_FILESYSTEM=1 (...)``); where the ranks'
            storages differ, the first rank's that wanted the mode agreed on (`` (on rank 3)`` when not rank 0).
        schedule_reused: whether the read-once schedule came from a plan cache (a :class:`~reshard.CheckpointManager`'s
            loads, :func:`reshard.flows.load.load_reusing`): the ranks' needs were not gathered; the coordinator
            took the schedule from memory, or (a restarted manager) made it again from the needs kept in the root's
            ``reads.reshard-cache`` (a debug log says which); the same on every rank.
        files_downloaded, bytes_downloaded: with staging, the whole data files this rank downloaded for its
            node (each file needed by a node is downloaded by exactly one of its ranks).
        files_reused: with staging, complete files found in the staging directory and reused.
        missing: with ``strict=False``, the template's entries that the checkpoint does not hold (left as
            they were), as the warning names them (``tensor 'key'``, ``object 'key' at [0]``, ``common value 'path'``).
        objects_kept: with ``LoadOptions(object_grid="same_coordinate")`` or ``"skip"``, this rank's
            ShardedObject cells whose saved grid changed and that kept the template's value (``same_coordinate``:
            the cells outside the saved grid; ``skip``: every cell of a changed grid), as ``object 'key' at [2, 0]``.
        objects_ignored: with the same options, the saved cells of a changed grid that the load did not return
            to any rank (``same_coordinate``: those outside the requested grid; ``skip``: all of them); the same
            on every rank whose template holds the object.
        seconds_metadata: reading and validating ``metadata.json`` (on the coordinator) or decoding the
            broadcast copy (on the others).
        seconds_plan: flattening the template, checking it against the metadata and planning the reads.
        seconds_stage: with staging, agreeing on and downloading this node's files (collectives included).
        seconds_read: reading, verifying and copying this rank's data into place.
        seconds_verify: with ``LoadOptions(verify=True)``, the end-to-end fingerprint check (collectives included).
        seconds_exchange: time in the other collectives beyond this rank's own work (the metadata
            broadcast, waiting for the slowest rank at the end of each phase).
        seconds: wall time of the whole load on this rank (at least the sum of the phases).
    """

    bytes_needed: int = 0
    bytes_read: int = 0
    read_requests: int = 0
    bytes_verified: int = 0
    bytes_verify_extra: int = 0
    bytes_direct: int = 0
    bytes_to_device: int = 0
    bytes_from_peers: int = 0
    bytes_to_peers: int = 0
    exchange_rounds: int = 0
    read_once: bool = False
    read_once_reason: str = ""
    schedule_reused: bool = False
    files_downloaded: int = 0
    bytes_downloaded: int = 0
    files_reused: int = 0
    missing: tuple[str, ...] = ()
    objects_kept: tuple[str, ...] = ()
    objects_ignored: tuple[str, ...] = ()
    seconds_metadata: float = 0.0
    seconds_plan: float = 0.0
    seconds_stage: float = 0.0
    seconds_read: float = 0.0
    seconds_verify: float = 0.0
    seconds_exchange: float = 0.0
    seconds: float = 0.0

    @property
    def throughput(self) -> float:
        """bytes_read / seconds, in bytes per second (0.0 for an instant load)."""
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0

    @property
    def read_amplification(self) -> float:
        """bytes_read / bytes_needed (1.0 when nothing was needed)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0


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
