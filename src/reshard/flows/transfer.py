"""``reshard.transfer``: move tensors from the layout that holds them to another layout, rank to rank,
with no storage in between.

The ranks of a training layout hold the source (its ShardedTensors, DTensors, plain tensors); the ranks of
an inference layout hold the target (a template, as for :func:`reshard.load`); all are in one process
group, and a rank may hold both. Every target piece is cut into the cells the source pieces cover; each
cell is copied locally where its rank holds it and otherwise sent by a holder, replicas taking turns
(:func:`reshard.planning.exchange.schedule_transfer`), in rounds of bounded size. Dtypes convert on arrival (the
rules of a load: lossy conversions need ``allow_lossy_cast``), segments (fused QKV), ZeRO flat ranges and
padding work as in a load, and ``key_map`` renames (a Hugging Face naming on the inference side).

This is the weight sync of reinforcement-learning loops (trainer to rollout engines) and of any reshard
that needs no checkpoint: it reads and writes nothing but the tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.errors import CheckpointError, DataUnavailableError, MismatchError, ShardingError, StateDictError
from reshard.flows.transfer_delta import LastSync, aliasing, cell_digests, digest_json, widen_to_groups
from reshard.flows.transfer_names import scaled_parts, source_key
from reshard.flows.transfer_quantize import Job, find_jobs, quantize_pieces, reduce_amax, rewrite
from reshard.geometry.boxes import Box
from reshard.geometry.tiling import find_tiling_problem
from reshard.io.exchange import ExchangeCounters, describe_need, run_exchange
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.planning.exchange import DEFAULT_ROUND_BYTES, RankSchedule, TransferPlan, schedule_transfer
from reshard.planning.scaled import (
    record_from_json,
    replica_conflicts,
    replica_digests,
    transfer_scaled_mismatches,
    transfer_source_conflicts,
)
from reshard.state.dtypes import DTYPE_BY_NAME, dtype_name, is_lossy_cast
from reshard.state.sharding import LocalPiece, ShardedTensor
from reshard.state.statedict import check_tensors, flatten_state_dict, is_empty_container, map_leaves

__all__ = ["TransferSession", "TransferStats", "transfer"]


@dataclass
class TransferStats:
    """What one rank's :func:`transfer` did, filled in when passed as ``stats=``.

    Attributes:
        bytes_sent, bytes_received: tensor bytes this rank sent to and received from other ranks.
        bytes_copied: tensor bytes copied from this rank's own source pieces into its targets.
        rounds: rounds of point-to-point traffic (the same on every rank).
        seconds: wall time of the transfer on this rank.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    rounds: int = 0
    seconds: float = 0.0


def transfer(
    source: Any,
    target: Any,
    *,
    group: Group = None,
    key_map: Mapping[str, str] | Callable[[str], str] | None = None,
    allow_lossy_cast: bool = False,
    round_bytes: int = DEFAULT_ROUND_BYTES,
    timeout: datetime.timedelta | float | None = None,
    stats: TransferStats | None = None,
) -> Any:
    """Fill ``target`` on every rank from the ``source`` pieces that the ranks of ``group`` hold. Called by
    every rank of ``group``; a rank with nothing to give passes ``{}`` as ``source``, one with nothing to
    receive ``{}`` as ``target``. A :class:`TransferSession` repeats it and sends only what changed.

    Args:
        source: what this rank holds: a state dict of ShardedTensors (any layout), DTensors or plain
            tensors (a plain tensor is the whole tensor of its key). Non-tensor values are not sent. Each
            box has one primary holder (``replica_id`` 0, as in a save); the other holders are replicas,
            which must hold the same bytes (any holder may send a cell).
        target: what this rank needs: a template as for :func:`reshard.load` (ShardedTensors, DTensors,
            plain tensors), filled in place. It may hold tensors only. Target tensors may share memory
            (tied weights): they are written in the plan's order, the last write deciding shared bytes.
        group: the ranks of both layouts (a process group, ``None`` for the default one, or a
            :class:`~reshard.net.transports.ThreadGroup` member).
        key_map: the source key of each target key (a mapping, or a function), for keys that differ
            (a Hugging Face naming on the inference side); unlisted keys are their own. The same on every
            rank: the coordinator checks every rank's results against its own. A mapping is read at every
            transfer (a session's later change of it takes effect, as a function is called every time).
            A target ScaledTensor's scales follow its data key's source (``K:scale`` from ``N:scale``;
            :mod:`reshard.flows.transfer_names`).
        allow_lossy_cast: allow conversions that change values beyond rounding (float to int, ...), as
            ``LoadOptions(allow_lossy_cast=True)``.
        round_bytes: the most bytes a rank sends, and receives, in one round (its two buffers).
        timeout: how long each collective and each round may wait for the slowest rank.
        stats: if given, filled with this rank's traffic.

    Returns:
        ``target``'s structure with each ShardedTensor replaced by its filled local tensor.

    Raises:
        StateDictError: the target holds ShardedObjects or non-tensor values; or tensors that a transfer
            cannot read or fill (:func:`reshard.state.statedict.check_tensors`: on the meta device, not dense, a freed
            storage, an expanded target), named with their rank, on every rank before any byte moves.
        ShardingError: two primaries of overlapping boxes of a source key (named with their ranks), or a
            source key held as a ScaledTensor on some ranks and as a plain tensor on others, or with other global
            shapes or dtypes by different ranks (named with the ranks of each), on every rank before any byte moves.
        MismatchError: a global shape or a lossy dtype conversion that differs, or a ``key_map`` that maps
            a part of a scaled target to another source than its data's, on every rank.
        DataUnavailableError: a target key that no rank holds, or parts of target tensors that no rank
            holds (named), on every rank (a MismatchError too).
        CheckpointError: the ranks passed different ``allow_lossy_cast`` or ``round_bytes``, or a
            ``key_map`` that maps some rank's target name otherwise than the coordinator's does (named),
            or a ``round_bytes`` that is not a positive integer; on every rank. Also a rank's failure
            inside the exchange, on every rank once the rounds are over (named with the rank and the cause;
            the targets may be partly written).
    """
    session = TransferSession(
        group=group, key_map=key_map, allow_lossy_cast=allow_lossy_cast, round_bytes=round_bytes, timeout=timeout
    )
    return session._run(source, target, delta=False, stats=stats, keep=False)


class TransferSession:
    """:func:`transfer` repeated between the same layouts (a weight sync after every training step): the
    plan is made once, and with ``delta=True`` only the cells that the session cannot prove to be right
    already travel. Create one per rank with the same arguments (a difference is a CheckpointError on
    every rank); :meth:`transfer` is collective over ``group``.

    A cell stays where it is only when all three hold: every rank's session took part in the same last
    transfer (the coordinator names each one with a random token), the sender's BLAKE2b digest of the
    cell equals that of what it sent then, and the receiver's digest of what its target holds in the cell
    equals that of what it held right after that transfer. So a target that was written in place (through
    ``.data``, by a kernel, outside torch), reloaded or re-created at the same address is sent its cells
    again. The price: a receiver hashes the cells it receives before a delta transfer and the cells
    written after it (a copy to the host for GPU tensors), as a sender hashes the cells it sends. The
    plan is made again whenever any rank's pieces change (other boxes, dtypes, keys, or target tensors at
    another address), and then everything is sent; so is everything when any rank passes
    ``delta=False``.

    Targets that share memory (an output layer tied to the embedding, fed from two source keys;
    overlapping views) are decided by the last cell written there, so a cell that shares memory with one
    that travels travels too, and in the order of the whole plan (see :mod:`reshard.flows.transfer_delta`): a
    delta leaves exactly the bytes a fresh :func:`transfer` would.

    Args: as for :func:`transfer`.
    """

    def __init__(
        self,
        *,
        group: Group = None,
        key_map: Mapping[str, str] | Callable[[str], str] | None = None,
        allow_lossy_cast: bool = False,
        round_bytes: int = DEFAULT_ROUND_BYTES,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        self.group = group
        self.rename = _renamer(key_map)
        self.allow_lossy_cast = allow_lossy_cast
        self.round_bytes = round_bytes
        self.timeout = timeout
        self._last: LastSync | None = None
        self._plan: TransferPlan | None = None  # on the coordinator
        self._plan_signature = ""  # on the coordinator: the digest of every rank's description it was made for
        self._jobs: list[Job] = []  # on the coordinator: the plan's quantizing jobs

    def transfer(self, source: Any, target: Any, *, delta: bool = True, stats: TransferStats | None = None) -> Any:
        """Fill ``target`` from the ``source`` pieces of the group's ranks; with ``delta``, send only the
        cells that are not proven unchanged on both ends since the last transfer. Collective over the group:
        every rank calls it, and the ranks agree on the plan and on whether this transfer is a delta."""
        return self._run(source, target, delta=delta, stats=stats, keep=True)

    def _run(self, source: Any, target: Any, *, delta: bool, stats: TransferStats | None, keep: bool) -> Any:
        """:meth:`transfer`; ``keep=False`` (a one-off :func:`transfer`) skips the digests that only a
        later delta would use. Collective over the group."""
        started = time.perf_counter()
        comm = Communicator(self.group, timeout=self.timeout)
        last, self._last = self._last, None  # until this transfer succeeds: a failed one is no base for a delta
        found: list[Any] = []

        def local() -> bytes:
            sources, targets, description = self._describe(comm.rank, source, target)
            signature = digest_json(description)
            base = last if delta and last is not None and last.signature == signature else None
            report = {"description": description, "options": self._options(), "delta": bool(delta), "token": None}
            checked = None
            if base is not None:
                checked = (cell_digests(sources, base.schedule, "send"), cell_digests(targets, base.schedule, "recv"))
                stale = {i for i, d in checked[0].items() if base.sent.get(i) != d}
                stale |= {i for i, d in checked[1].items() if base.held.get(i) != d}
                shared = aliasing(targets, base.schedule)
                report.update(token=base.token, stale=sorted(stale | set(shared.always)), groups=shared.groups)
            found.extend([sources, targets, checked, signature, description["holdings"]])
            return json.dumps(report).encode()

        decision, reply = comm.step_scatter("transfer planning", local, self._decide)
        sources, targets, checked, signature, holdings = found
        schedule = RankSchedule.from_json(json.loads(reply))
        counters = ExchangeCounters()
        jobs = [Job.from_json(j) for j in decision["quantize"]]
        quantization = reduce_amax(comm.step, jobs, sources, holdings) if jobs else None

        def send_and_receive() -> None:
            with torch.no_grad():
                pieces = sources
                if quantization is not None:  # on a failure here the exchange sends zeros, then fails everywhere
                    try:
                        pieces = sources + quantize_pieces(quantization, holdings)
                    except Exception:
                        with contextlib.suppress(Exception):  # the peers' rounds; this rank's error wins
                            run_exchange(comm.transport, schedule, sources, counters, targets=[])
                        raise
                run_exchange(comm.transport, schedule, pieces, counters, targets=targets)

        comm.step("transferring", send_and_receive)
        if keep and not jobs:  # what a later delta starts from: every cell written is hashed as the exchange left it
            received = cell_digests(targets, schedule, "recv")
            if decision["full"] or last is None or checked is None:
                sent = cell_digests(sources, schedule, "send")
                self._last = LastSync(decision["token"], signature, schedule, sent, received)
            else:  # a cell not written is unchanged: it shares no memory with one that was (see aliasing)
                sent, held = checked
                self._last = LastSync(decision["token"], signature, last.schedule, sent, {**held, **received})
        if stats is not None:
            stats.bytes_sent = counters.bytes_sent
            stats.bytes_received = counters.bytes_received
            copied = schedule.copies
            stats.bytes_copied = sum(math.prod(ref[2]) * targets[ref[0]].view.element_size() for _, ref in copied)
            stats.rounds = len(schedule.rounds)
            stats.seconds = time.perf_counter() - started
        return map_leaves(target, lambda _path, leaf: leaf.data if isinstance(leaf, ShardedTensor) else leaf)

    def _options(self) -> dict[str, Any]:
        """This rank's session options, which every rank must pass alike (checked on the coordinator)."""
        round_bytes = self.round_bytes
        if isinstance(round_bytes, bool) or not isinstance(round_bytes, int) or round_bytes < 1:
            raise CheckpointError(f"transfer: round_bytes must be a positive integer, got {round_bytes!r}")
        return {"allow_lossy_cast": bool(self.allow_lossy_cast), "round_bytes": round_bytes}

    def _decide(self, payloads: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """On the coordinator: check that the ranks agree on the options, plan again if any rank's pieces
        changed, and decide for every rank at once whether this transfer is a delta. It is one only when
        nothing was planned again, every rank asked for it and names the same last transfer; then the
        cells any sender or receiver reported stale travel, with every cell that shares memory with one of
        them on its receiver. Returns the decision and every rank's schedule."""
        docs = [json.loads(p) for p in payloads]
        _check_agreement(docs, self.rename)
        descriptions = [d["description"] for d in docs]
        everything = digest_json(descriptions)
        plan = self._plan
        replanned = plan is None or everything != self._plan_signature
        if plan is None or replanned:
            plan, self._jobs = self._make_plan(descriptions)
            self._plan, self._plan_signature = plan, everything
        if self._jobs and any(d["delta"] for d in docs):
            raise CheckpointError(
                f"transfer: a TransferSession does not send deltas of the tensors it quantizes "
                f"({', '.join(repr(j.key) for j in self._jobs[:10])}: a changed element can change the scales "
                "of blocks other ranks send); pass delta=False"
            )
        tokens = {d["token"] for d in docs}
        delta = not replanned and all(d["delta"] for d in docs) and len(tokens) == 1 and None not in tokens
        only = {i for d in docs for i in d["stale"]} if delta else None
        # Cells that share memory on their receiver travel together, in the whole plan's order.
        keep_order = only is not None and widen_to_groups(only, [g for d in docs for g in d["groups"]])
        decision = {
            "full": not delta,
            "replanned": replanned,
            "token": secrets.token_hex(16),
            "quantize": [j.to_json() for j in self._jobs],
        }
        return decision, [json.dumps(s.to_json()).encode() for s in plan.schedules(only, keep_order=keep_order)]

    def _describe(self, rank: int, source: Any, target: Any) -> tuple[list[LocalPiece], list[LocalPiece], Any]:
        """This rank's source and target pieces, and their description for the coordinator. Checks that
        every tensor can be read (sources) or filled (targets) first, and zeroes the padding of the target
        pieces (never their real elements: cells left in place keep their bytes). A source that repeats a
        box of its key (a tied weight under two paths) is one source, as in a save."""
        held = flatten_state_dict(source, rank=rank, dedup=True)
        wanted = flatten_state_dict(target, rank=rank, dedup=False)
        extra = [o.key for o in wanted.objects] + [p for p, v in wanted.common.items() if not is_empty_container(v)]
        if extra:
            raise StateDictError(
                f"transfer moves tensors; the target holds {len(extra)} other entries: {', '.join(extra[:10])}"
            )
        check_tensors(held.tensors, what="transfer: source", fill=False)
        check_tensors(wanted.tensors, what="transfer: target", fill=True)
        sources: list[LocalPiece] = []
        targets: list[LocalPiece] = []
        holdings: list[list[Any]] = []
        primary: list[bool] = []
        needs: list[list[Any]] = []
        need_of: list[int] = []
        shapes: dict[str, list[Any]] = {}
        wanted_shapes: list[list[Any]] = []
        addresses = []
        parts = scaled_parts(wanted.scaled.values())
        for tensor in held.tensors:
            shapes[tensor.key] = [list(tensor.saved_shape), dtype_name(tensor.data.dtype)]
            for piece in tensor.pieces():
                sources.append(piece)
                holdings.append(describe_need(tensor.key, piece))
                primary.append(tensor.is_main_replica)
        for tensor in wanted.tensors:
            key = source_key(self.rename, tensor.key, parts)
            wanted_shapes.append([tensor.key, key, list(tensor.saved_shape), dtype_name(tensor.data.dtype)])
            addresses.append(tensor.data.data_ptr())
            for piece in tensor.pieces():
                piece.zero_padding()  # the padding only: unchanged real cells are not sent again
                targets.append(piece)
                needs.append(describe_need(key, piece))
                need_of.append(len(wanted_shapes) - 1)
        description = {
            "holdings": holdings,
            "primary": primary,
            "needs": needs,
            "need_of": need_of,
            "held": shapes,
            "wanted": wanted_shapes,
            "at": addresses,
            "scaled_held": {key: record.to_json() for key, record in held.scaled.items()},
            "scale_copies": replica_digests(held),
            "scaled_wanted": {name: [self.rename(name), record.to_json()] for name, record in wanted.scaled.items()},
        }
        return sources, targets, description

    def _make_plan(self, descriptions: list[dict[str, Any]]) -> tuple[TransferPlan, list[Job]]:
        """On the coordinator: check the pieces against each other and plan the whole transfer, with the
        quantized tensors of its quantizing jobs (:mod:`reshard.flows.transfer_quantize`) as sources. A source
        key that is scaled on some ranks and plain on others is refused first, as a save refuses it."""
        mixed = transfer_source_conflicts(descriptions)
        if mixed:
            raise ShardingError("transfer: the ranks disagree on scaled tensors: " + "; ".join(mixed[:10]))
        _check_held_agreement(descriptions)
        jobs = find_jobs(descriptions)
        if jobs:
            descriptions = rewrite(descriptions, jobs)
        _check(descriptions, self.allow_lossy_cast)
        _check_primaries(descriptions)
        conflicts = replica_conflicts([d["scale_copies"] for d in descriptions])
        if conflicts:
            raise ShardingError("transfer: the source ranks disagree on scales: " + "; ".join(conflicts[:10]))
        plan, problems = schedule_transfer(
            [d["holdings"] for d in descriptions], [d["needs"] for d in descriptions], round_bytes=self.round_bytes
        )
        if problems:
            raise DataUnavailableError(
                f"transfer: {len(problems)} parts of target tensors are held by no rank of the group: "
                + "; ".join(problems[:20])
                + (" ..." if len(problems) > 20 else "")
            )
        return plan, jobs


def _renamer(key_map: Mapping[str, str] | Callable[[str], str] | None) -> Callable[[str], str]:
    if key_map is None:
        return lambda key: key
    if callable(key_map):
        return key_map
    return lambda key: key_map.get(key, key)  # read at every transfer, as a function is called at every one


def _check(docs: list[dict[str, Any]], allow_lossy_cast: bool) -> None:
    """On the coordinator: every wanted key is held, with the same (logical) global shape, and a dtype it
    may be converted to (each target name on its own: several may come from one source key)."""
    held: dict[str, list[Any]] = {}
    for doc in docs:
        held.update(doc["held"])
    problems = transfer_scaled_mismatches(docs)
    unavailable = []
    for doc in docs:
        for name, key, shape, dtype in sorted(doc["wanted"]):
            what = f"{name!r}" + (f" (source {key!r})" if name != key else "")
            if key not in held:
                unavailable.append(f"{what}: no rank holds it")
            elif held[key][0] != shape:
                problems.append(f"{what}: held with global shape {held[key][0]}, wanted {shape}")
            elif is_lossy_cast(DTYPE_BY_NAME[held[key][1]], DTYPE_BY_NAME[dtype]) and not allow_lossy_cast:
                conversion = f"held as {held[key][1]}, wanted {dtype}"
                problems.append(f"{what}: {conversion}: a lossy conversion (allow_lossy_cast=True allows it)")
    if problems:
        unique = sorted(set(problems))
        raise MismatchError(f"transfer: the sources do not fit the targets: {'; '.join(unique[:20])}")
    if unavailable:
        unique = sorted(set(unavailable))
        shown = "; ".join(unique[:20])
        raise DataUnavailableError(f"transfer: {len(unique)} target tensors are held by no rank: {shown}")


def _check_held_agreement(docs: list[dict[str, Any]]) -> None:
    """On the coordinator: every rank that holds pieces of a source key describes it with the same global shape
    and dtype, as a save requires (else one rank's description would stand for all: a half in another dtype cast
    without ``allow_lossy_cast``, or a half of another global shape placed in the target).

    Raises:
        ShardingError: naming each key and the ranks of each description (every rank).
    """
    by_key: dict[str, dict[str, list[int]]] = {}
    for rank, doc in enumerate(docs):
        for key, (shape, dtype) in doc["held"].items():
            by_key.setdefault(key, {}).setdefault(f"global shape {shape}, {dtype}", []).append(rank)
    problems = [
        f"{key!r} is held as " + "; ".join(f"{what} on ranks {', '.join(map(str, rs))}" for what, rs in seen.items())
        for key, seen in sorted(by_key.items())
        if len(seen) > 1
    ]
    if problems:
        raise ShardingError(
            f"transfer: the source ranks describe keys differently: {'; '.join(problems[:10])}"
            + (" ..." if len(problems) > 10 else "")
        )


def _check_agreement(docs: list[dict[str, Any]], rename: Callable[[str], str]) -> None:
    """On the coordinator: every rank passed the same session options, and its ``key_map`` gives the
    coordinator's source key for each of its target names (else ranks would convert, cut rounds or fill
    a name by other rules, silently). Raises CheckpointError naming each option that differs."""
    problems = []
    for option in ("allow_lossy_cast", "round_bytes"):
        by_value: dict[Any, list[int]] = {}
        for rank, doc in enumerate(docs):
            by_value.setdefault(doc["options"][option], []).append(rank)
        if len(by_value) > 1:
            problems.append(f"different {option}: " + ", ".join(f"{v!r} on ranks {r}" for v, r in by_value.items()))
    differ = []
    for rank, doc in enumerate(docs):
        records = [record_from_json(n, r) for n, (_key, r) in doc["description"]["scaled_wanted"].items()]
        parts = scaled_parts(records)
        for name, key, _shape, _dtype in doc["description"]["wanted"]:
            try:
                ours = repr(source_key(rename, name, parts))
            except Exception as exc:  # a key_map that cannot map a name another rank's maps: they differ
                ours = f"an error ({type(exc).__name__}: {exc})"
            if ours != repr(key):
                differ.append(f"rank {rank} maps {name!r} to {key!r}, rank 0 to {ours}")
    if differ:
        problems.append(f"different key_map results: {'; '.join(differ[:10])}" + (" ..." if len(differ) > 10 else ""))
    if problems:
        raise CheckpointError(
            f"transfer: the ranks passed {'; '.join(problems)} (every rank of the group must pass the same)"
        )


def _check_primaries(docs: list[dict[str, Any]]) -> None:
    """On the coordinator: no two primary pieces (``replica_id`` 0) of a source key overlap. A box has one
    primary holder, as in a save; other holders are replicas, which must hold its bytes (any holder may
    send a cell). Two primaries with different bytes would fill a target from whichever the plan picks."""
    primaries: dict[str, list[tuple[int, Box]]] = {}
    for rank, doc in enumerate(docs):
        for (key, offset, shape, _dtype), main in zip(doc["holdings"], doc["primary"], strict=True):
            box = Box(tuple(offset), tuple(shape))
            if main and box.volume:
                primaries.setdefault(key, []).append((rank, box))
    problems = []
    for key, held in sorted(primaries.items()):
        if len(held) < 2:
            continue
        shape = next(doc["held"][key][0] for doc in docs if key in doc["held"])
        problem = find_tiling_problem(tuple(shape), [box for _, box in held])
        if problem is not None and problem.kind == "overlap":
            (ra, a), (rb, b) = (held[i] for i in problem.indices)
            problems.append(
                f"{key!r} is held as primary (replica_id 0) by ranks {ra} and {rb}, in boxes that overlap (at "
                f"{list(a.offset)} of shape {list(a.shape)}, at {list(b.offset)} of shape {list(b.shape)})"
            )
    if problems:
        raise ShardingError(
            f"transfer: {'; '.join(problems[:20])}{' ...' if len(problems) > 20 else ''}. A box has one primary "
            "holder: give the other copies a non-zero replica_id (replicas must hold the same bytes)"
        )
