"""Collectives over an explicit process group, and agreement on failure.

Every collective reshard makes goes through :class:`Communicator`, which takes the group explicitly
(``None`` means the default world group when ``torch.distributed`` is initialised, and a lone process
otherwise; a :class:`~reshard.net.transports.ThreadGroup` member runs ranks as threads of one process). It
moves bytes (JSON) through a :class:`~reshard.net.transports.Transport`: over torch.distributed they are carried
in uint8 tensors, nothing is pickled, and every collective is waited on with a timeout, so a dead or missing
peer turns into a :class:`~reshard.CommunicationError` instead of a hang.

:meth:`Communicator.step` is the building block of every phase: each rank runs its part, the coordinator
(rank 0 of the group) gathers the outcomes and combines them, and every rank then either gets the
combined result or raises the same error, naming the ranks that failed. :meth:`Communicator.step_scatter`
is the same with a reply of its own for each rank, so that no rank receives what only another needs
(save planning: each rank gets its own write assignment, not everyone's).

What a rank sends does not grow with the number of ranks (see :mod:`reshard.net.transports`);
:attr:`Communicator.bytes_sent` and :attr:`Communicator.bytes_received` count the payload bytes.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import struct
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch.distributed as dist

from reshard.errors import ERROR_CLASSES, CheckpointError, StorageError
from reshard.net.transports import (
    Group,
    PlaneGroups,
    SingleProcess,
    ThreadGroup,
    TorchTransport,
    Transport,
    TransportFactory,
    padded_size,
)

__all__ = ["DEFAULT_TIMEOUT", "Communicator", "StepFailure", "ThreadGroup", "Transport", "padded_size"]

logger = logging.getLogger("reshard")

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""Default time a rank waits for its peers in one collective."""

_PHASE_LENGTH = struct.Struct("<H")
_OK, _FAILED = b"\x00", b"\x01"


def _tagged(phase: str, status: bytes, body: bytes) -> bytes:
    """A step's gathered payload: the phase's name (so that the coordinator can tell when the ranks are
    not in the same step), a status byte, then the body."""
    name = phase.encode("utf-8")
    return _PHASE_LENGTH.pack(len(name)) + name + status + body


def _untagged(payload: bytes) -> tuple[str, bytes, bytes]:
    """(phase, status, body) of a :func:`_tagged` payload; ValueError when it is not one."""
    if len(payload) < _PHASE_LENGTH.size:
        raise ValueError(f"a payload of {len(payload)} bytes")
    (length,) = _PHASE_LENGTH.unpack_from(payload)
    start = _PHASE_LENGTH.size
    if len(payload) < start + length + 1:
        raise ValueError(f"a payload of {len(payload)} bytes, shorter than its phase name")
    phase = payload[start : start + length].decode("utf-8")
    status = payload[start + length : start + length + 1]
    if status not in (_OK, _FAILED):
        raise ValueError(f"status byte {status!r}")
    return phase, status, payload[start + length + 1 :]


def _phase_mismatch(phase: str, gathered: list[bytes]) -> tuple[dict[int, tuple[bytes, bytes]], str | None]:
    """Split the gathered payloads of ``phase``; the second value is the message of the error every rank
    raises when some rank is in another step (another reshard call, or another version of reshard)."""
    parts: dict[int, tuple[bytes, bytes]] = {}
    elsewhere: dict[int, str] = {}
    for rank, payload in enumerate(gathered):
        try:
            their_phase, status, body = _untagged(payload)
        except (ValueError, UnicodeDecodeError):
            elsewhere[rank] = "an unrecognised message (another version of reshard?)"
            continue
        if their_phase != phase:
            elsewhere[rank] = repr(their_phase)
        parts[rank] = (status, body)
    if not elsewhere:
        return parts, None
    details = ", ".join(f"rank {r} in {what}" for r, what in sorted(elsewhere.items()))
    return parts, (
        f"the ranks of the group are not in the same reshard operation: the coordinator (rank 0) is in "
        f"{phase!r}, {details}. Every rank of the group must call the same reshard function (save, load, "
        "a manager method) at the same point, with the same group"
    )


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


def parse_timeout(timeout: object) -> tuple[datetime.timedelta, str | None]:
    """The timeout to wait with, and what is wrong with the one given (None: nothing). A value that is no
    positive, finite number of seconds (or timedelta) waits :data:`DEFAULT_TIMEOUT` and is refused in the
    first step (:meth:`Communicator.step` or :meth:`Communicator.step_scatter`), so that every rank raises the
    same error instead of the one that passed it failing alone while the others wait. Every operation's first
    collective is such a step; one that began with a raw gather or broadcast would wait the default there."""
    if timeout is None:
        return DEFAULT_TIMEOUT, None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, int | float) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        return DEFAULT_TIMEOUT, f"timeout={timeout!r} is not a number of seconds or a datetime.timedelta"
    if not math.isfinite(seconds) or seconds <= 0:
        return DEFAULT_TIMEOUT, f"timeout={timeout!r} is not a positive, finite number of seconds"
    return datetime.timedelta(seconds=seconds), None


def _check_not_launched_alone() -> None:
    """Raise when a launcher (torchrun, ``torch.distributed.run``) started several ranks but this one has not
    initialised torch.distributed: each would otherwise save or load alone, as rank 0 of a group of one."""
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:
        raise CheckpointError(
            f"WORLD_SIZE={world} (set by torchrun or another launcher) but torch.distributed is not initialised: "
            "call torch.distributed.init_process_group() on every rank before reshard's collective calls, or "
            "unset WORLD_SIZE to save or load in this process alone"
        )


class Communicator:
    """Collectives of one checkpoint operation over one group, and agreement on every phase's outcome.

    Args:
        group: the ranks that take part: a ``torch.distributed`` process group, ``None`` (the default group
            if ``torch.distributed`` is initialised, else this process alone), a
            :class:`~reshard.net.transports.PlaneGroups` (a gloo group for the protocol beside an NCCL group for
            tensor data), a :class:`~reshard.net.hierarchy.HierarchicalGroups` (the protocol gathered per node, then
            by the node leaders), or a :class:`~reshard.net.transports.Transport` (a
            :class:`~reshard.net.transports.ThreadGroup` member).
        timeout: how long each collective may wait for the slowest peer.

    All methods are collective: every rank of the group calls them, in the same order.
    """

    def __init__(
        self,
        group: Group = None,
        *,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        timeout, self.timeout_problem = parse_timeout(timeout)
        self.timeout = timeout
        distributed = dist.is_available() and dist.is_initialized()
        self.transport: Transport
        if isinstance(group, Transport):
            self.transport = group
        elif isinstance(group, TransportFactory):
            self.transport = group.transport(timeout)
        elif distributed:
            if isinstance(group, PlaneGroups):
                self.transport = TorchTransport(group.data, timeout, control_group=group.control)
            else:
                self.transport = TorchTransport(group, timeout)
        elif group is not None:
            raise CheckpointError("a process group was given but torch.distributed is not initialised")
        else:
            _check_not_launched_alone()
            self.transport = SingleProcess(timeout)
        self.rank = self.transport.rank
        self.size = self.transport.size

    @property
    def is_coordinator(self) -> bool:
        """Whether this process is the group's rank 0, which combines results and writes metadata."""
        return self.rank == 0

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has put into collectives (gathers, broadcasts, scatters, reductions)."""
        return self.transport.bytes_sent

    @property
    def bytes_received(self) -> int:
        """Payload bytes this rank has got out of collectives."""
        return self.transport.bytes_received

    def gather_bytes(self, payload: bytes) -> list[bytes] | None:
        """Gather one payload per rank onto the coordinator; other ranks get None. Collective.

        Over torch.distributed each rank sends :func:`padded_size` bytes (its payload padded to the
        longest), whatever the number of ranks; the coordinator receives that many from each.
        """
        return self.transport.gather_bytes(payload)

    def scatter_bytes(self, payloads: list[bytes] | None) -> bytes:
        """Send ``payloads[r]`` from the coordinator to rank ``r``; every rank gets its own. Collective: the
        coordinator passes one payload per rank, the others pass None."""
        return self.transport.scatter_bytes(payloads)

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        """Send the coordinator's ``payload`` to every rank; others pass None."""
        return self.transport.broadcast_bytes(payload)

    @overload
    def step(self, phase: str, local: Callable[[], object]) -> None: ...

    @overload
    def step(self, phase: str, local: Callable[[], T], combine: Callable[[list[T]], R]) -> R: ...

    def step(
        self,
        phase: str,
        local: Callable[[], Any],
        combine: Callable[[list[Any]], Any] | None = None,
    ) -> Any:
        """Run one phase on every rank and agree on its outcome.

        Typed: ``combine`` takes the values of ``local`` and its result is what every rank returns, after a
        JSON round trip (so a tuple comes back as a list on the other ranks: return JSON types).

        Each rank runs ``local()``, which returns a JSON-able value. The values are gathered on the
        coordinator, which calls ``combine(values)`` (values in rank order) when every rank succeeded; the
        JSON-able result of ``combine`` (or None without it) is broadcast and returned on every rank.

        If ``local`` raised on any rank, every rank raises the same error class naming the failing ranks
        and their messages (the original exception is chained on a failing rank). If ``combine`` raised
        (a global check, such as a layout validation), every rank raises that error as it is.
        """
        local = self._refusing_a_bad_timeout(local)
        if self.size == 1:
            return self._step_alone(local, combine)
        own_error: BaseException | None = None
        try:
            payload = _tagged(phase, _OK, json.dumps(local(), allow_nan=False).encode())
        except Exception as exc:  # collected, then raised on every rank below
            own_error = exc
            logger.debug("[rank=%d] %s failed:\n%s", self.rank, phase, "".join(traceback.format_exception(exc)))
            payload = _tagged(phase, _FAILED, json.dumps(StepFailure.from_exception(exc).to_json()).encode())
        gathered = self.gather_bytes(payload)
        decision: bytes | None = None
        if gathered is not None:
            decision = self._decide(phase, gathered, combine)
        return self._agreed(phase, _decoded_decision(self.broadcast_bytes(decision)), own_error)

    def _refusing_a_bad_timeout(self, local: Callable[[], T]) -> Callable[[], T]:
        """``local``, or, when this rank was given a timeout it cannot use, a part that raises that problem:
        every rank then raises the same error, in the step."""
        problem = self.timeout_problem
        if problem is None:
            return local

        def refused() -> T:
            raise CheckpointError(problem)

        return refused

    @staticmethod
    def _agreed(phase: str, result: dict[str, Any], own_error: BaseException | None) -> Any:
        """The combined result a step broadcast, or the error every rank raises."""
        if "failures" in result:
            failures = {int(r): StepFailure(f["class"], f["message"]) for r, f in result["failures"].items()}
            raise _failure_error(phase, failures) from own_error
        if "error" in result:
            error = ERROR_CLASSES[result["error"]["class"]](result["error"]["message"])
            raise error from own_error
        return result["result"]

    def step_scatter(
        self,
        phase: str,
        local: Callable[[], bytes],
        combine: Callable[[list[bytes]], tuple[R, list[bytes]]],
    ) -> tuple[R, bytes]:
        """:meth:`step` with a reply of its own for each rank. Called by every rank of the group.

        Each rank runs ``local()``, which returns bytes; they are gathered on the coordinator, which calls
        ``combine(payloads)`` (in rank order) when every rank succeeded. ``combine`` returns a JSON-able
        value for every rank and a list of one bytes reply per rank. Every rank returns ``(value, its
        reply)``. So what a rank sends is its own payload and what it receives is the common value and its
        reply: nothing grows with the number of ranks except on the coordinator.

        Failures are agreed on as in :meth:`step`: if ``local`` raised anywhere, or ``combine`` raised,
        every rank raises the same error and no reply is sent.
        """
        local = self._refusing_a_bad_timeout(local)
        if self.size == 1:
            alone, alone_replies = self._step_alone(local, combine)
            return alone, alone_replies[0]
        own_error: BaseException | None = None
        try:
            payload = _tagged(phase, _OK, local())
        except Exception as exc:  # collected, then raised on every rank below
            own_error = exc
            logger.debug("[rank=%d] %s failed:\n%s", self.rank, phase, "".join(traceback.format_exception(exc)))
            payload = _tagged(phase, _FAILED, json.dumps(StepFailure.from_exception(exc).to_json()).encode())
        gathered = self.gather_bytes(payload)
        header: bytes | None = None
        replies: list[bytes] | None = None
        if gathered is not None:
            header, replies = self._decide_scatter(phase, gathered, combine)
        value = self._agreed(phase, _decoded_decision(self.broadcast_bytes(header)), own_error)
        return value, self.scatter_bytes(replies)

    def _failures_or_mismatch(self, phase: str, gathered: list[bytes]) -> tuple[list[bytes], bytes | None]:
        """The bodies of every rank's successful part, or the decision that fails the step: a rank in
        another step, or failures."""
        parts, mismatch = _phase_mismatch(phase, gathered)
        if mismatch is not None:
            failure = StepFailure(CheckpointError.__name__, mismatch)
            return [], json.dumps({"error": failure.to_json()}, allow_nan=False).encode()
        failures = {}
        for rank, (status, body) in parts.items():
            if status == _OK:
                continue
            try:
                doc = json.loads(body)
                failures[rank] = {"class": str(doc["class"]), "message": str(doc["message"])}
            except (ValueError, KeyError, TypeError):
                failures[rank] = {"class": CheckpointError.__name__, "message": "an unreadable failure report"}
            if failures[rank]["class"] not in ERROR_CLASSES:
                failures[rank]["class"] = CheckpointError.__name__
        if failures:
            return [], json.dumps({"failures": failures}, allow_nan=False).encode()
        return [parts[r][1] for r in range(len(gathered))], None

    def _combine_failed(self, phase: str, exc: Exception) -> bytes:
        """The decision when the coordinator's ``combine`` raised: reshard's errors (a global check such as
        a layout validation) as they are; anything else names the coordinator."""
        logger.debug("[rank=%d] %s failed:\n%s", self.rank, phase, "".join(traceback.format_exception(exc)))
        failure = StepFailure.from_exception(exc)
        if not isinstance(exc, CheckpointError):
            failure = StepFailure(
                failure.error_class, f"{phase} failed on the coordinator (rank {self.rank}): {failure.message}"
            )
        return json.dumps({"error": failure.to_json()}, allow_nan=False).encode()

    def _decide_scatter(
        self, phase: str, gathered: list[bytes], combine: Callable[[list[bytes]], tuple[Any, list[bytes]]]
    ) -> tuple[bytes, list[bytes] | None]:
        bodies, failed = self._failures_or_mismatch(phase, gathered)
        if failed is not None:
            return failed, None
        try:
            value, replies = combine(bodies)
            header = json.dumps({"result": value}, allow_nan=False).encode()
        except Exception as exc:  # a global check failed: every rank raises it
            return self._combine_failed(phase, exc), None
        if len(replies) != self.size:
            failure = StepFailure(CheckpointError.__name__, f"{phase}: {len(replies)} replies for {self.size} ranks")
            return json.dumps({"error": failure.to_json()}, allow_nan=False).encode(), None
        return header, replies

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

    def _decide(self, phase: str, gathered: list[bytes], combine: Callable[[list[Any]], Any] | None) -> bytes:
        bodies, failed = self._failures_or_mismatch(phase, gathered)
        if failed is not None:
            return failed
        try:
            values = [json.loads(body) for body in bodies]
        except ValueError as exc:
            return self._combine_failed(phase, CheckpointError(f"{phase}: a rank sent an unreadable result: {exc}"))
        try:
            combined = combine(values) if combine is not None else None
            return json.dumps({"result": combined}, allow_nan=False).encode()
        except Exception as exc:  # a global check failed: every rank raises it
            return self._combine_failed(phase, exc)


def _decoded_decision(raw: bytes) -> dict[str, Any]:
    """The coordinator's broadcast decision; a rank that gets something else (the coordinator runs
    another operation or another version of reshard) raises a reshard error instead of a parse error."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict) or not ({"result", "failures", "error"} & doc.keys()):
        raise CheckpointError(
            "the coordinator (rank 0) answered with something that is not a reshard decision: the ranks of the "
            "group are not in the same reshard operation (every rank must call the same function at the same point)"
        )
    return doc
