"""Collectives over an explicit process group, and agreement on failure.

Every collective reshard makes goes through :class:`Communicator`, which takes the group explicitly
(``None`` means the default world group when ``torch.distributed`` is initialised, and a lone process
otherwise). Payloads are bytes (JSON), carried in uint8 tensors: nothing is pickled. Every collective is
issued asynchronously and waited on with a timeout, so a dead or missing peer turns into a
:class:`~reshard.CommunicationError` instead of a hang.

:meth:`Communicator.step` is the building block of every phase: each rank runs its part, the coordinator
(rank 0 of the group) gathers the outcomes and combines them, and every rank then either gets the
combined result or raises the same error, naming the ranks that failed.
"""

from __future__ import annotations

import datetime
import json
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from reshard.errors import ERROR_CLASSES, CheckpointError, CommunicationError, StorageError

__all__ = ["DEFAULT_TIMEOUT", "Communicator", "StepFailure"]

logger = logging.getLogger("reshard")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""Default time a rank waits for its peers in one collective."""


@dataclass(frozen=True, slots=True)
class StepFailure:
    """One rank's failure in a step: the error class name reshard will raise, and the message."""

    error_class: str
    message: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> StepFailure:
        if isinstance(exc, CheckpointError):
            name = type(exc).__name__ if type(exc).__name__ in ERROR_CLASSES else _nearest_class(exc)
            return cls(name, str(exc))
        if isinstance(exc, OSError):
            return cls(StorageError.__name__, f"{type(exc).__name__}: {exc}")
        return cls(CheckpointError.__name__, f"{type(exc).__name__}: {exc}")

    def to_json(self) -> dict[str, str]:
        return {"class": self.error_class, "message": self.message}


def _nearest_class(exc: CheckpointError) -> str:
    for cls in type(exc).__mro__:
        if cls.__name__ in ERROR_CLASSES and ERROR_CLASSES[cls.__name__] is cls:
            return cls.__name__
    return CheckpointError.__name__


def _failure_error(phase: str, failures: dict[int, StepFailure]) -> CheckpointError:
    """The error every rank raises when ``failures`` happened in ``phase``."""
    classes = {f.error_class for f in failures.values()}
    cls = ERROR_CLASSES[classes.pop()] if len(classes) == 1 else CheckpointError
    ranks = sorted(failures)
    if len(ranks) == 1:
        message = f"{phase} failed on rank {ranks[0]}: {failures[ranks[0]].message}"
    else:
        details = "; ".join(f"rank {r}: {failures[r].message}" for r in ranks)
        message = f"{phase} failed on ranks {', '.join(map(str, ranks))}: {details}"
    return cls(message, failures={r: f.message for r, f in failures.items()})


class Communicator:
    """Collectives of one checkpoint operation over one process group.

    Args:
        group: the process group whose ranks take part; ``None`` means the default group if
            ``torch.distributed`` is initialised, else a single process.
        timeout: how long each collective may wait for the slowest peer.

    All methods are collective: every rank of the group calls them, in the same order.
    """

    def __init__(
        self, group: dist.ProcessGroup | None = None, *, timeout: datetime.timedelta | float | None = None
    ) -> None:
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        elif not isinstance(timeout, datetime.timedelta):
            timeout = datetime.timedelta(seconds=float(timeout))
        self.timeout = timeout
        self.distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not self.distributed:
            raise CheckpointError("a process group was given but torch.distributed is not initialised")
        self.group = group
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.size = dist.get_world_size(group)
            if self.rank < 0:
                raise CheckpointError("this process is not a member of the process group it was given")
            self.global_ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)]
            backend = str(dist.get_backend(group))
            self.device = (
                torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            )
        else:
            self.rank, self.size, self.global_ranks = 0, 1, [0]
            self.device = torch.device("cpu")

    @property
    def is_coordinator(self) -> bool:
        """Whether this process is the group's rank 0, which combines results and writes metadata."""
        return self.rank == 0

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            raise CommunicationError(
                f"collective {what} on rank {self.rank} did not complete within "
                f"{self.timeout.total_seconds():.0f} s or a peer failed: {exc}"
            ) from exc

    def _all_gather_lengths(self, length: int) -> list[int]:
        mine = torch.tensor([length], dtype=torch.int64, device=self.device)
        out = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        self._wait(dist.all_gather(out, mine, group=self.group, async_op=True), "all_gather(lengths)")
        return [int(t.item()) for t in out]

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Gather one payload per rank onto the coordinator; other ranks get None."""
        if self.size == 1:
            return [payload]
        lengths = self._all_gather_lengths(len(payload))
        longest = max(lengths)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        mine = mine.to(self.device)
        gather_list = (
            [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
            if self.is_coordinator
            else None
        )
        work = dist.gather(mine, gather_list, dst=self.global_ranks[0], group=self.group, async_op=True)
        self._wait(work, "gather")
        if gather_list is None:
            return None
        return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(gather_list, lengths, strict=True)]

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Send the coordinator's ``payload`` to every rank; others pass None."""
        if self.size == 1:
            return payload or b""
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=self.device)
        self._wait(
            dist.broadcast(length, src=self.global_ranks[0], group=self.group, async_op=True), "broadcast(length)"
        )
        n = int(length.item())
        if self.is_coordinator and payload is not None:
            buffer = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
                if n
                else torch.empty(0, dtype=torch.uint8)
            )
        else:
            buffer = torch.empty(n, dtype=torch.uint8, device=self.device)
        if n:
            self._wait(dist.broadcast(buffer, src=self.global_ranks[0], group=self.group, async_op=True), "broadcast")
        return bytes(buffer.cpu().numpy().tobytes())

    def step(
        self,
        phase: str,
        local: Callable[[], Any],
        combine: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """Run one phase on every rank and agree on its outcome.

        Each rank runs ``local()``, which returns a JSON-able value. The values are gathered on the
        coordinator, which calls ``combine(values)`` (values in rank order) when every rank succeeded; the
        JSON-able result of ``combine`` (or None without it) is broadcast and returned on every rank.

        If ``local`` raised on any rank, every rank raises the same error class naming the failing ranks
        and their messages (the original exception is chained on a failing rank). If ``combine`` raised
        (a global check, such as a layout validation), every rank raises that error as it is.
        """
        if self.size == 1:
            return self._step_alone(local, combine)
        own_error: BaseException | None = None
        try:
            outcome: dict[str, Any] = {"ok": local()}
        except Exception as exc:  # collected, then raised on every rank below
            own_error = exc
            logger.debug("[rank=%d] %s failed:\n%s", self.rank, phase, "".join(traceback.format_exception(exc)))
            outcome = {"error": StepFailure.from_exception(exc).to_json()}
        gathered = self.gather_bytes(json.dumps(outcome, allow_nan=False).encode())
        decision: bytes | None = None
        if gathered is not None:
            decision = self._decide(phase, [json.loads(g) for g in gathered], combine)
        result = json.loads(self.broadcast_bytes(decision))
        if "failures" in result:
            failures = {int(r): StepFailure(f["class"], f["message"]) for r, f in result["failures"].items()}
            raise _failure_error(phase, failures) from own_error
        if "error" in result:
            error = ERROR_CLASSES[result["error"]["class"]](result["error"]["message"])
            raise error from own_error
        return result["result"]

    @staticmethod
    def _step_alone(local: Callable[[], Any], combine: Callable[[list[Any]], Any] | None) -> Any:
        """A step of a one-process group: reshard's errors propagate unchanged, others are wrapped."""
        try:
            value = local()
            return combine([value]) if combine is not None else None
        except CheckpointError:
            raise
        except Exception as exc:
            failure = StepFailure.from_exception(exc)
            raise ERROR_CLASSES[failure.error_class](failure.message) from exc

    def _decide(self, phase: str, outcomes: list[dict[str, Any]], combine: Callable[[list[Any]], Any] | None) -> bytes:
        failures = {r: o["error"] for r, o in enumerate(outcomes) if "error" in o}
        if failures:
            return json.dumps({"failures": failures}, allow_nan=False).encode()
        try:
            combined = combine([o["ok"] for o in outcomes]) if combine is not None else None
            return json.dumps({"result": combined}, allow_nan=False).encode()
        except Exception as exc:  # a global check failed: every rank raises it
            logger.debug("[rank=%d] %s failed:\n%s", self.rank, phase, "".join(traceback.format_exception(exc)))
            return json.dumps({"error": StepFailure.from_exception(exc).to_json()}, allow_nan=False).encode()
