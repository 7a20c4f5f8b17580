"""Hostile tensors on one rank, for the flows that move tensors between ranks with no storage in between.

A *case* runs one flow (``transfer``, ``delta``: a ``TransferSession`` whose second, delta sync gets the
tensor, ``restore``: ``PeerMemoryCheckpoint.restore``) on the ranks of a
:class:`reshard.net.transports.ThreadGroup`. Every rank passes the flow's usual source (generation 2 of
:func:`tests.contract.states.rank_state`) and target (:func:`tests.contract.states.column_template`),
except rank 1, which passes one tensor a transfer cannot use (a meta tensor, an expanded or freed target, a
sparse source, two primaries of one box) or one it must handle (a conjugate view).

The guarantees: a refusal is the same reshard error on every rank, naming rank 1 (or the ranks of the
clash), the tensor and the cause, raised before any byte moved (rank 0's target holds what it held) and at
once (never a :class:`reshard.CommunicationError` once the timeout ran out); a tensor the flows handle
gives every rank exactly the state sent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tests.contract import guarantees, states
from tests.contract.guarantees import Answers

WORLD = 2
TIMEOUT_S = 30.0
Z = torch.tensor([1 + 2j, -3 + 4j, 5 - 6j], dtype=torch.complex64)


@dataclass(frozen=True)
class Case:
    flow: str
    tensor: str
    """What rank 1 passes: a key of :data:`TENSORS`."""
    error: str
    """The reshard error class every rank must raise; "" when the flow must handle the tensor."""
    words: tuple[str, ...] = ()
    """What the error must name."""


def _meta_source(source: dict[str, Any], target: dict[str, Any]) -> None:
    import reshard

    source["w"] = reshard.ShardedTensor.from_rank_offsets(
        "w", torch.empty_like(source["w"].data, device="meta"), (0, 1, 2)
    )


def _meta_target(source: dict[str, Any], target: dict[str, Any]) -> None:
    import reshard

    target["w"] = reshard.ShardedTensor.from_rank_offsets(
        "w", torch.empty_like(target["w"].data, device="meta"), (1, 1, 2)
    )


def _expanded_target(source: dict[str, Any], target: dict[str, Any]) -> None:
    target["bias"] = torch.zeros(1, dtype=torch.int64).expand(17)


def _freed_target(source: dict[str, Any], target: dict[str, Any]) -> None:
    target["bias"].untyped_storage().resize_(0)  # as FSDP frees an unsharded parameter


def _sparse_source(source: dict[str, Any], target: dict[str, Any]) -> None:
    source["bias"] = source["bias"].to_sparse()


def _two_primaries(source: dict[str, Any], target: dict[str, Any]) -> None:
    import reshard

    # rank 1 claims rank 0's rows of w as primary, with its own bytes
    source["w"] = reshard.ShardedTensor.from_rank_offsets("w", source["w"].data.clone(), (0, 0, 2))


def _conj_source(source: dict[str, Any], target: dict[str, Any]) -> None:
    source["c"] = torch.conj_physical(Z).conj()  # a lazily conjugated view whose values are Z


def _conj_target(source: dict[str, Any], target: dict[str, Any]) -> None:
    target["c"] = torch.zeros(3, dtype=torch.complex64).conj()


TENSORS: dict[str, Callable[[dict[str, Any], dict[str, Any]], None]] = {
    "meta_source": _meta_source,
    "meta_target": _meta_target,
    "expanded_target": _expanded_target,
    "freed_target": _freed_target,
    "sparse_source": _sparse_source,
    "two_primaries": _two_primaries,
    "conj_source": _conj_source,
    "conj_target": _conj_target,
}


def cases() -> list[Case]:
    out = []
    for flow in ("transfer", "delta", "restore"):
        targets_only = flow == "restore"  # a restore's sources are the tier's own copies
        out += [
            Case(flow, "meta_target", "StateDictError", ("rank 1", "'w'", "meta device")),
            Case(flow, "expanded_target", "StateDictError", ("rank 1", "'bias'", "overlap in memory")),
            Case(flow, "freed_target", "StateDictError", ("rank 1", "'bias'", "less storage")),
            Case(flow, "conj_target", ""),
        ]
        if not targets_only:
            out += [
                Case(flow, "meta_source", "StateDictError", ("rank 1", "'w'", "meta device")),
                Case(flow, "sparse_source", "StateDictError", ("rank 1", "'bias'", "not dense")),
                Case(flow, "two_primaries", "ShardingError", ("'w'", "ranks 0 and 1", "primary")),
                Case(flow, "conj_source", ""),
            ]
    return out


# ---- running a case ----------------------------------------------------------------------------------------


def _source(case: Case, rank: int, generation: int) -> dict[str, Any]:
    """Rank ``rank``'s usual source: its part of ``generation``'s tensors, and ``c`` (a complex tensor, for
    the conjugate cases) on the rank that does not pass the conjugate view of it."""
    source = {k: v for k, v in states.rank_state(rank, WORLD, generation, objects=False).items() if k != "step"}
    if case.tensor.startswith("conj") and rank == (1 if case.tensor == "conj_source" else 0):
        source["c"] = Z.clone()
    return source


def _target(case: Case, rank: int) -> dict[str, Any]:
    target = states.column_template(rank, WORLD)
    if case.tensor.startswith("conj"):
        target["c"] = torch.zeros(3, dtype=torch.complex64)
    return target


def _flow(case: Case, rank: int, group: Any, target: dict[str, Any]) -> None:
    """Rank ``rank``'s part of the flow with rank 1's tensor in it, filling ``target`` (in place)."""
    import reshard

    if case.flow == "delta":  # a first, good sync, then a delta sync with the tensor
        session = reshard.TransferSession(group=group, timeout=TIMEOUT_S)
        session.transfer(_source(case, rank, 1), target)
    source = _source(case, rank, 2)
    if rank == 1:
        TENSORS[case.tensor](source, target)
    if case.flow == "transfer":
        reshard.transfer(source, target, group=group, timeout=TIMEOUT_S)
    elif case.flow == "delta":
        session.transfer(source, target)
    else:
        tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=TIMEOUT_S)
        tier.save(_source(case, rank, 2), group=group)
        target.update(tier.restore(target, group=group))


def run_rank(case: Case, rank: int, group: Any) -> dict[str, Any]:
    """Rank ``rank``'s part of ``case``: its answer (``generation``: what its target holds afterwards, -1 for
    none; ``zero``: on rank 0, whether its target holds nothing but zeros)."""
    import reshard

    answer: dict[str, Any] = {}
    target = _target(case, rank)
    try:
        _flow(case, rank, group, target)
        answer["ok"] = True
    except reshard.CheckpointError as exc:
        answer.update(error=type(exc).__name__, message=str(exc))
    if rank == 0 or answer.get("ok"):
        generation = states.column_generation(target, rank, WORLD, (1, 2))
        answer["generation"] = -1 if generation is None else generation
        answer["zero"] = all(not _data(v).any() for k, v in target.items() if k != "c")
    if answer.get("ok") and "c" in target:
        answer["c_exact"] = bool(torch.equal(target["c"].resolve_conj(), Z))
    return answer


def _data(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value.data


def run_case(case: Case) -> tuple[Answers, bool]:
    """Run ``case`` on the threads of a fresh group: each rank's answer, and whether all answered in time."""
    from reshard.net.transports import ThreadGroup

    group = ThreadGroup(WORLD, timeout=TIMEOUT_S)
    answers: Answers = {}

    def rank_main(rank: int) -> None:
        try:
            answers[rank] = run_rank(case, rank, group.member(rank))
        except BaseException as exc:  # judged by the caller
            answers[rank] = {"error": type(exc).__name__, "message": str(exc), "other": repr(exc)}

    started = time.monotonic()
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT_S)
    return answers, len(answers) == WORLD and time.monotonic() - started < TIMEOUT_S / 2


def judge(case: Case, answers: Answers, in_time: bool) -> str:
    """'' when the guarantees held, else what broke."""
    for finding in (
        guarantees.answered_in_time(in_time, TIMEOUT_S / 2),
        guarantees.only_reshard_errors(answers),
        guarantees.same_outcome(answers, killed=False),
    ):
        if finding is not None:
            return f"{finding.status}: {finding.reason}"
    if not case.error:
        wrong = [r for r, a in answers.items() if a.get("generation") != 2 or not a.get("c_exact")]
        return f"ranks {wrong} did not get exactly the state sent: {answers}" if wrong else ""
    if any(a.get("error") != case.error for a in answers.values()):
        return f"expected {case.error} on every rank: {answers}"
    message = answers[0]["message"]
    missing = [w for w in case.words if w not in message]
    if missing:
        return f"the error does not name {missing}: {message}"
    untouched = answers[0]["zero"] if case.flow != "delta" else answers[0]["generation"] == 1
    return "" if untouched else f"rank 0's target was written before the refusal: {answers[0]}"
