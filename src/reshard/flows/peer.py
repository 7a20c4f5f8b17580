"""A peer-memory checkpoint tier: each rank's unique boxes kept in host memory and copied to ranks of
other nodes, restored after a failure into **another layout** with nothing read from storage.

:meth:`PeerMemoryCheckpoint.save` keeps a copy of every primary box this rank holds (replicas other than
the primary are not kept: the primary's copies stand for them) and sends it to ``replicas`` peers, each on
another node (rank ``r``'s peers are ``r + node_size``, ``r + 2 * node_size``, ... modulo the world size,
so losing a whole node loses no box while ``replicas >= 1``). Common values are kept on every rank.

After ranks die, the survivors (and any new ranks, with a fresh object) form a new process group and call
:meth:`PeerMemoryCheckpoint.restore` with templates of the new layout (another world size, TP, PP, DP):
every box comes from whichever survivor holds a copy, over :func:`reshard.transfer`, bit-exactly. When some
box has no surviving copy the restore says which (:class:`~reshard.DataUnavailableError`) or, given a
``fallback`` manager, loads the latest durable checkpoint instead, with a warning that names what was lost.

A save is two-phase: the previous save (the *generation* every rank holds) stays restorable until the new
one is held by every rank that must hold it (its primaries and their copies); only then does an agreed step
make it the current generation on every rank, and the previous one is released. A rank dying at any point
of a save leaves the survivors the previous generation, or the new one where the commit reached any of them
(it was complete everywhere by then): :meth:`PeerMemoryCheckpoint.restore` first agrees on the newest
generation some rank knows to be complete, and every rank restores from its part of that one. So a rank holds
two generations during a save (from the copy of its boxes until the commit), one otherwise.

What is durable: nothing. This tier survives the loss of any set of ranks that leaves a copy of every box
(with ``replicas=k``, any ``k`` whole nodes); a storage checkpoint (:class:`~reshard.CheckpointManager`)
remains the durable tier behind it. ShardedObjects (per-rank Python values) are not kept: they raise.

ScaledTensors (:class:`~reshard.ScaledTensor`) are kept as their parts (data, scales, global scale: primaries
only, as for plain tensors) with their records (format, block), agreed by the ranks at save; a restore into
ScaledTensor templates of another layout moves each part with its data, and a template that asks another
format or block, a plain tensor of a scaled key or a ScaledTensor of a plain key is the MismatchError a load
raises (:func:`reshard.planning.scaled.scaled_mismatches`), on every rank, before any byte moves.
"""

from __future__ import annotations

import datetime
import json
import uuid
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from reshard.errors import CheckpointError, DataUnavailableError, MismatchError, ShardingError, StateDictError
from reshard.flows.certify import CertifyOptions, Checks, judge, local_facts, options_term
from reshard.flows.options import check_terms, count_argument, node_size_argument
from reshard.flows.transfer import TransferStats, transfer
from reshard.io.device import copy_to_host
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.planning.scaled import record_from_json, record_mismatches, replica_conflicts, replica_digests
from reshard.state.codec import decode_tagged, encode_tagged
from reshard.state.dtensor import is_dtensor
from reshard.state.dtypes import DTYPE_BY_NAME, dtype_name
from reshard.state.scaled import ScaledTensor
from reshard.state.sharding import ShardedTensor
from reshard.state.statedict import check_tensors, filter_state_dict, flatten_state_dict, map_leaves

if TYPE_CHECKING:
    from reshard.flows.manager import CheckpointManager

__all__ = ["PeerMemoryCheckpoint", "PeerSaveResult"]

_CHECK_CHUNK_BYTES = 4 * 1024 * 1024
"""The chunk of a certified peer save's replica checksums (a differing copy is named to this many bytes)."""


@dataclass(frozen=True, slots=True)
class _Generation:
    """One peer save as this rank holds it: its number (``[counter, token]``, agreed by the group; a later save
    has a higher counter), this rank's primary boxes and the copies it keeps for its peers, the encoded
    common values and the records of its scaled tensors (as :meth:`ScaledRecord.to_json` writes them, by data
    key)."""

    number: list[Any]
    held: dict[str, ShardedTensor]
    common: str | None
    scaled: dict[str, Any]
    checks: Checks | None = None


def _newest(numbers: list[list[Any] | None]) -> list[Any] | None:
    """The highest of generation ``numbers`` (None where there is none)."""
    known = [n for n in numbers if n is not None]
    return max(known, key=lambda n: (int(n[0]), str(n[1]))) if known else None


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSaveResult:
    """What one rank's :meth:`PeerMemoryCheckpoint.save` keeps: its own primary bytes and the bytes of the
    copies it holds for its peers."""

    own_bytes: int
    copy_bytes: int
    checks: Checks | None = None
    """With ``certify``: the outcome of the checks, the same on every rank (kept with the generation:
    :attr:`PeerMemoryCheckpoint.checks`); None without."""


class PeerMemoryCheckpoint:
    """The in-memory checkpoint tier of one rank. Create one per rank; :meth:`save` and :meth:`restore`
    are collective over the group they are given.

    Args:
        replicas: copies of every box kept on other nodes (an integer, at least 1).
        node_size: ranks per node: a rank's copies go to ranks of other nodes (``rank // node_size`` is its
            node). Default: ``LOCAL_WORLD_SIZE`` from the launcher's environment, else 1.
        timeout: how long each collective may wait for the slowest rank.

    Raises:
        ValueError: ``replicas`` or ``node_size`` (or ``LOCAL_WORLD_SIZE``) is not an integer of at least 1
            (raised here, on the rank that passed it, as the option objects do).
    """

    def __init__(
        self,
        *,
        replicas: int = 1,
        node_size: int | None = None,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        self.replicas = count_argument("PeerMemoryCheckpoint", "replicas", replicas)
        self.node_size = node_size_argument("PeerMemoryCheckpoint", node_size)
        self.timeout = timeout
        self._current: _Generation | None = None
        """The generation this rank knows to be held by every rank of the save that made it."""
        self._pending: _Generation | None = None
        """A generation this rank holds whole, whose commit did not reach it (the save failed in its last
        step): it may be current on other ranks. Settled by the next save or restore."""
        self._restored_checks: Checks | None = None
        """The checks of the generation the last restore agreed on (a rank that holds none of it: a new one)."""

    @property
    def checks(self) -> Checks | None:
        """The checks of the current generation (``save(certify=...)``; the same on every rank), or None: it was
        saved without ``certify``, or there is none. After a restore: those of the generation restored."""
        return self._current.checks if self._current is not None else self._restored_checks

    @property
    def generation(self) -> list[Any] | None:
        """The number (``[counter, token]``) of the generation this rank knows to be current, None when it holds
        none: the newest one, among the ranks' numbers, is what :meth:`restore` restores. Not collective."""
        return None if self._current is None else list(self._current.number)

    def _generations(self) -> dict[str, list[Any] | None]:
        return {
            "current": None if self._current is None else self._current.number,
            "pending": None if self._pending is None else self._pending.number,
        }

    def _settle(self, current: list[Any] | None) -> None:
        """Keep generation ``current`` (the newest that some rank of the group knows to be current: complete on
        every rank that must hold it), where this rank holds it, and release every other."""
        if self._pending is not None and self._pending.number == current:
            self._current = self._pending
        elif self._current is not None and self._current.number != current:
            self._current = None
        self._pending = None

    def save(self, state_dict: Any, *, group: Group = None, certify: CertifyOptions | None = None) -> PeerSaveResult:
        """Keep this rank's primary boxes in host memory and copy them to ``replicas`` peers on other nodes.
        Called by every rank of ``group`` (with the same ``replicas``, ``node_size`` and ``certify``). The previous
        save stays restorable until every rank holds the new one; then it is released on every rank (see the module
        doc): a rank holds both during the save.

        ``certify``: run the checks of a certified save (:class:`~reshard.CertifyOptions`: no NaN or infinity in
        the primaries, every replica of a box equal to its primary by content) on the state kept: each rank's
        facts (:func:`reshard.flows.certify.local_facts`: an extra pass over its tensors, the replicas included)
        travel with the save's planning step and the coordinator judges them there (no extra collective); the
        :class:`~reshard.Checks` are in the result and kept with the generation (:attr:`checks`). A failed check
        never fails the save.

        Raises:
            StateDictError: the state holds ShardedObjects (every rank).
            ShardingError: the group has too few nodes for ``replicas`` copies on other nodes (a ValueError;
                every rank); ranks describe a scaled tensor with other formats or blocks, or as a scaled tensor
                on some ranks and a plain one on others (every rank).
            CheckpointError: ranks passed other ``replicas`` or ``node_size`` (every rank); a rank failed or
                died (the survivors keep the previous save, or the new one where it was committed).
        """
        comm = Communicator(group, timeout=self.timeout)
        pieces: list[tuple[ShardedTensor, Any]] = []

        def describe() -> bytes:  # inside the first step: a state that cannot be kept fails every rank alike
            flat = flatten_state_dict(state_dict, rank=comm.rank)
            _refuse_objects(flat.objects)
            check_tensors(flat.tensors, what="peer save", fill=False)  # copied to the host after this agreed step
            pieces.extend((t, piece) for t in flat.tensors if t.is_main_replica for piece in t.pieces())
            described = [
                [t.key, list(t.saved_shape), list(p.box.offset), list(p.view.shape), dtype_name(p.view.dtype)]
                for t, p in pieces
            ]
            common = json.dumps({p: encode_tagged(v, where=p) for p, v in flat.common.items()}, sort_keys=True)
            terms = {"replicas": self.replicas, "node_size": self.node_size, "certify": options_term(certify)}
            scaled = {key: record.to_json() for key, record in flat.scaled.items()}
            parts = {k for r in flat.scaled.values() for k in r.part_keys}
            plain = sorted({t.key for t in flat.tensors} - parts)
            doc: dict[str, Any] = {"boxes": described, "common": common, "terms": terms, "scaled": scaled}
            doc["plain"] = plain
            doc["replicas"] = replica_digests(flat)
            doc["facts"] = None if certify is None else local_facts(flat, certify, chunk_bytes=_CHECK_CHUNK_BYTES)
            return json.dumps({**doc, **self._generations()}).encode()

        plan, reply = comm.step_scatter("peer-memory save planning", describe, lambda p: self._assign(p, certify))
        self._settle(plan["current"])  # at most the current generation and the new one from here on
        own: dict[str, ShardedTensor] = {}
        to_host: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor, piece in pieces:
            copy = torch.empty(piece.view.shape, dtype=piece.view.dtype)
            to_host.append((copy, piece.view))
            own[f"own/{len(own)}"] = ShardedTensor(tensor.key, copy, tensor.saved_shape, piece.box.offset)
        copy_to_host(to_host)  # GPU pieces on a side stream, one wait for them all
        copies: dict[str, ShardedTensor] = {}
        for key, shape, offset, box_shape, dtype in json.loads(reply):
            data = torch.empty(box_shape, dtype=DTYPE_BY_NAME[dtype])
            # A replica of its owner's primary: after a failure the owner's survivor and the copies' may both
            # hold the box, and a transfer takes one primary per box.
            copies[f"copy/{len(copies)}"] = ShardedTensor(key, data, tuple(shape), tuple(offset), replica_id=1)
        transfer(own, copies, group=comm.transport, timeout=self.timeout)
        checks = None if plan["checks"] is None else Checks.from_json(plan["checks"])
        self._pending = _Generation(plan["number"], {**own, **copies}, plan["common"], plan["scaled"], checks)

        def agreed(numbers: list[list[Any]]) -> list[Any]:
            if any(n != numbers[0] for n in numbers):
                raise CheckpointError(f"peer-memory save: the ranks hold different new generations: {numbers}")
            return numbers[0]

        # Every rank holds the new generation whole: it becomes the current one wherever this decision arrives
        # (where it does not, the next save or restore settles it).
        comm.step("peer-memory save commit", lambda: plan["number"], agreed)
        self._current, self._pending = self._pending, None
        return PeerSaveResult(own_bytes=_nbytes(own), copy_bytes=_nbytes(copies), checks=checks)

    def _assign(self, payloads: list[bytes], certify: CertifyOptions | None) -> tuple[dict[str, Any], list[bytes]]:
        """On the coordinator: the ranks agree on the options; the current generation (the newest some rank
        knows to be current), the new one's number, the common values of rank 0, the checks of the ranks' facts
        (with ``certify``, which every rank passed alike once the terms agree), and what each rank keeps for
        which peers."""
        docs = [json.loads(p) for p in payloads]
        check_terms([d["terms"] for d in docs], "PeerMemoryCheckpoint.save")
        nodes = -(-len(docs) // self.node_size)
        if nodes <= self.replicas:
            raise ShardingError(
                f"{len(docs)} ranks of {self.node_size} per node make {nodes} nodes: too few for "
                f"replicas={self.replicas} copies on other nodes"
            )
        known = [n for d in docs for n in (d["current"], d["pending"]) if n is not None]
        number = [1 + max((int(n[0]) for n in known), default=0), uuid.uuid4().hex]
        keep: list[list[Any]] = [[] for _ in docs]
        for owner, doc in enumerate(docs):
            for j in range(1, self.replicas + 1):
                keep[(owner + j * self.node_size) % len(docs)].extend(doc["boxes"])
        plan = {
            "current": _newest([d["current"] for d in docs]),
            "number": number,
            "common": docs[0]["common"],
            "scaled": _agree_scaled(docs),
            "checks": None if certify is None else _judge_peer([d["facts"] for d in docs], certify).to_json(),
        }
        return plan, [json.dumps(k).encode() for k in keep]

    def restore(
        self,
        template: Any,
        *,
        group: Group = None,
        fallback: CheckpointManager | None = None,
        stats: TransferStats | None = None,
    ) -> Any:
        """Fill ``template`` (any layout) from the copies the ranks of ``group`` hold; nothing is read from
        storage. Called by every rank of the new group: survivors with the object that saved, new ranks
        with a fresh one. Common values come from any rank that holds them.

        Args:
            template: what this rank needs, as for :func:`reshard.load` (tensors and common values).
            group: the new group (survivors and new ranks).
            fallback: a manager of the durable checkpoints: when some box has no surviving copy, every rank
                loads its latest complete step instead (``load_latest_with_state``), with a warning naming
                what was lost; without one, the restore raises.
            stats: if given, filled with this rank's traffic.

        The ranks first agree on the generation to restore: the newest that some rank knows to be current
        (a save whose commit reached it), which every rank that took part in that save holds whole; every
        other generation is released. Every rank passes a ``fallback`` or none does. The checks of a certified
        save of that generation become :attr:`checks` on every rank (new ranks too).

        Raises:
            DataUnavailableError: boxes without a surviving copy (named), and no ``fallback`` (or it has
                no complete step).
            CheckpointError: some ranks passed a ``fallback`` and others did not (every rank).
            MismatchError: a template that a load of the same state would refuse for its scaled tensors: a
                ScaledTensor of another format or block, a plain tensor of a scaled key, a ScaledTensor of a
                plain key (every rank, before any byte moves).
        """
        comm = Communicator(group, timeout=self.timeout)
        flat = flatten_state_dict(template, rank=comm.rank, dedup=False)
        _refuse_objects(flat.objects)
        kept = filter_state_dict(template, lambda _path, leaf: _is_tensor(leaf) or isinstance(leaf, ScaledTensor))
        # A ScaledTensor as its parts, each filled in place from the held parts of its key.
        tensors = map_leaves(kept, lambda _path, leaf: leaf.parts() if isinstance(leaf, ScaledTensor) else leaf)

        def newest(docs: list[dict[str, Any]]) -> list[Any] | None:
            check_terms([d["terms"] for d in docs], "PeerMemoryCheckpoint.restore")
            return _newest([d["current"] for d in docs])

        mine = {"terms": {"fallback": fallback is not None}, **self._generations()}
        self._settle(comm.step("peer-memory restore", lambda: mine, newest))
        current = self._current
        saved = comm.step("peer-memory saved tensors", lambda: _saved(current), _first_saved)
        self._restored_checks = None if saved["checks"] is None else Checks.from_json(saved["checks"])

        def check() -> None:
            records = {key: record_from_json(key, doc) for key, doc in saved["scaled"].items()}
            problems = record_mismatches(flat, saved["dtypes"].get, records)
            if problems:
                raise MismatchError("the peer-memory generation does not match the template: " + "; ".join(problems))

        comm.step("peer-memory restore check", check)  # every rank raises where any template mismatches
        try:
            held = current.held if current is not None else {}
            transfer(held, tensors, group=comm.transport, timeout=self.timeout, stats=stats)
        except DataUnavailableError as exc:
            if fallback is None:
                raise
            self._restored_checks = None  # not the generation's state: the durable step's
            return _fall_back(fallback, template, exc)

        encoded = saved["common"]
        common = {p: decode_tagged(v, where=p) for p, v in json.loads(encoded or "{}").items()}

        def result_leaf(path: str, leaf: Any) -> Any:
            if isinstance(leaf, ScaledTensor):
                return leaf  # its data, scales and global scale were filled in place
            if isinstance(leaf, ShardedTensor):
                return leaf.data
            if _is_tensor(leaf):
                return leaf
            return common.get(path, leaf)

        return map_leaves(template, result_leaf)


def _fall_back(fallback: CheckpointManager, template: Any, exc: DataUnavailableError) -> Any:
    """The latest durable checkpoint of ``fallback`` loaded into ``template`` (collective), with a warning
    naming what the peer-memory tier lost."""
    warnings.warn(
        f"peer-memory restore impossible, loading the latest durable checkpoint of {fallback.root.describe()} "
        f"instead: {exc}",
        stacklevel=3,
    )
    found = fallback.load_latest_with_state(template)
    if found is None:
        nothing = f"{fallback.root.describe()} holds no complete checkpoint"
        raise DataUnavailableError(f"{exc}; and {nothing}") from exc
    return found[1]


def _refuse_objects(objects: list[Any]) -> None:
    """The StateDictError of a state holding ShardedObjects (per-rank values the tier does not keep)."""
    if objects:
        names = ", ".join(repr(o.key) for o in objects[:10])
        raise StateDictError(f"the peer-memory tier keeps tensors and common values, not ShardedObjects: {names}")


def _nbytes(tensors: dict[str, ShardedTensor]) -> int:
    return sum(t.data.numel() * t.data.element_size() for t in tensors.values())


def _agree_scaled(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """On the coordinator of a save: the records of the scaled tensors (by data key), which every rank that
    describes a key describes alike, and no rank as a plain tensor.

    Raises:
        ShardingError: naming the keys and ranks that disagree (every rank).
    """
    by_key: dict[str, dict[str, list[int]]] = {}
    for rank, doc in enumerate(docs):
        for key, record in doc["scaled"].items():
            by_key.setdefault(key, {}).setdefault(json.dumps(record, sort_keys=True), []).append(rank)
    problems = [
        f"{key!r} is described differently by the ranks ({'; '.join(f'ranks {r}: {d}' for d, r in seen.items())})"
        for key, seen in sorted(by_key.items())
        if len(seen) > 1
    ]
    for rank, doc in enumerate(docs):
        problems += [f"{k!r} is a ScaledTensor on some ranks but a plain tensor on rank {rank}" for k in doc["plain"]
                     if k in by_key]  # fmt: skip
    problems += replica_conflicts([doc["replicas"] for doc in docs])
    if problems:
        raise ShardingError("peer-memory save: the ranks disagree on scaled tensors: " + "; ".join(problems[:10]))
    return {key: json.loads(next(iter(seen))) for key, seen in by_key.items()}


def _saved(current: _Generation | None) -> dict[str, Any] | None:
    """What this rank knows of the generation it restores from (None: it holds none): the dtype of every key
    it holds a box of, the records of the scaled tensors and the common values."""
    if current is None:
        return None
    dtypes = {t.key: dtype_name(t.data.dtype) for t in current.held.values()}
    checks = None if current.checks is None else current.checks.to_json()
    return {"dtypes": dtypes, "scaled": current.scaled, "common": current.common, "checks": checks}


def _first_saved(values: list[dict[str, Any] | None]) -> dict[str, Any]:
    """On the coordinator of a restore: the dtypes of the keys the holders of the generation hold together,
    and its records and common values (the same on every holder)."""
    held = [v for v in values if v is not None]
    dtypes: dict[str, str] = {}
    for value in held:
        dtypes.update(value["dtypes"])
    first = held[0] if held else {"scaled": {}, "common": None, "checks": None}
    return {"dtypes": dtypes, "scaled": first["scaled"], "common": first["common"], "checks": first["checks"]}


def _judge_peer(facts: list[dict[str, Any] | None], options: CertifyOptions) -> Checks:
    """On the coordinator of a certified peer save: the checks of every rank's facts (each replica compared with
    its primary's checksums). Never raises: a rank whose checks could not run, or facts that cannot be judged,
    are problems (the save stands)."""
    errors = [f"rank {r} could not run its checks: {f['error']}" for r, f in enumerate(facts) if f and "error" in f]
    try:
        checks = judge([f or {} for f in facts], options, chunk_bytes=_CHECK_CHUNK_BYTES)
    except CheckpointError as exc:
        return Checks(passed=False, problems=(*errors, str(exc)), checked=options.checked)
    if errors:
        return Checks(passed=False, problems=(*errors, *checks.problems), checked=checks.checked)
    return checks


def _is_tensor(leaf: Any) -> bool:
    return isinstance(leaf, (torch.Tensor, ShardedTensor)) or is_dtensor(leaf)
