"""One checkpoint manager over tiers: peer memory, node-local disk and durable storage, with a background drain.

:class:`TieredCheckpointManager` saves each step to every tier whose ``every`` divides it, fastest first, and
returns once the fast tiers hold it. A durable step that the node-local tier also saved is *drained* to the
durable root in the background (:class:`~reshard.flows.tiered_drain.Drain`: the node-local copies are copied and
committed there by :meth:`CheckpointManager.save_written`, under the durable root's lock, ``latest.json`` and
retention); a durable step that no faster storage tier holds is saved there directly. A step is *finalized* once
the durable tier holds it complete (its ``metadata.json`` committed): nothing else is written to say so, and the
node-local tier never deletes a step that is still to be finalized.

:meth:`TieredCheckpointManager.restore` resumes from the newest step some tier can restore, into the current
layout (any world size or parallelism): the peer-memory generation the ranks hold, the node-local tier's
restorable steps, the durable root's complete steps; newest step first, fastest tier first for the same step. A
candidate that fails (data lost with the ranks or nodes that held it, a damaged copy, an incomplete step) falls
back to the next with a warning naming tier, step and reason; a template that does not match the checkpoint is the
caller's error and raises. Every rank takes the same decision: the candidates are agreed in one collective step and
every fallback is an error every rank raises alike.
"""

from __future__ import annotations

import datetime
import importlib
import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch.distributed as dist

from reshard.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DataUnavailableError,
    IncompleteCheckpointError,
)
from reshard.flows.load import load
from reshard.flows.manager import CheckpointManager
from reshard.flows.options import SaveOptions, check_terms
from reshard.flows.peer import PeerMemoryCheckpoint, PeerSaveResult
from reshard.flows.save import SaveResult
from reshard.flows.steps import scan_root
from reshard.flows.tiered_drain import Drain, check_drain_group
from reshard.flows.tiers import Durable, LocalDisk, PeerMemory, Tiers, check_tiers, tier_terms
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.storage import Storage

__all__ = ["StepStatus", "TieredCheckpointManager", "TieredSaveResult"]

logger = logging.getLogger("reshard")

STEP_KEY = "tiered_step"
"""The common value a peer-memory generation carries beside the state: the step it holds."""
FALLBACK_ERRORS = (DataUnavailableError, CorruptCheckpointError, IncompleteCheckpointError, CheckpointNotFoundError)
"""What makes a restore fall back to its next candidate (every rank raises them alike); a MismatchError (the
template is not the checkpoint's state) is the caller's and raises."""


class NodeLocal(Protocol):
    """What the tiered manager uses of :class:`reshard.flows.nodelocal.NodeLocalCheckpoints`."""

    def save(self, step: int, state_dict: Any, *, options: SaveOptions | None = None) -> SaveResult: ...
    def steps(self) -> list[int]: ...
    def restorable(self) -> list[int]: ...
    def restore(self, step: int, template: Any, **load_kwargs: Any) -> Any: ...
    def drain(self, step: int, target: Storage) -> None: ...
    def keep(self, steps: set[int]) -> None: ...


def node_local(tier: LocalDisk, group: Group, timeout: datetime.timedelta | float | None) -> NodeLocal:
    """The node-local checkpoints of ``tier`` over ``group``."""
    module = importlib.import_module("reshard.flows.nodelocal")
    made = module.NodeLocalCheckpoints(
        tier.directory, node_size=tier.node_size, keep_last=tier.keep_last, group=group, timeout=timeout
    )
    return cast(NodeLocal, made)


@dataclass(frozen=True)
class TieredSaveResult:
    """What :meth:`TieredCheckpointManager.save` did on this rank.

    Attributes:
        step: the step.
        tiers: the names of the tiers that hold it now (``peer``, ``local``, ``durable``), fastest first.
        draining: whether the step is being drained to the durable tier in the background (not finalized yet).
        peer: the peer-memory save's result, when that tier saved.
        local: the node-local save's result, when that tier saved.
        durable: the direct durable save's result, when the step was saved there directly (finalized).
    """

    step: int
    tiers: tuple[str, ...]
    draining: bool = False
    peer: PeerSaveResult | None = None
    local: SaveResult | None = None
    durable: SaveResult | None = None


@dataclass(frozen=True)
class StepStatus:
    """One step as this rank sees it (:meth:`TieredCheckpointManager.status`).

    Attributes:
        step: the step.
        tiers: the tiers that hold it, as this rank sees them: ``peer`` (the generation this rank holds),
            ``local`` (complete in this node's directory), ``durable`` (complete under the durable root).
        finalized: the durable tier holds it complete.
        draining: this rank's drain of it is running.
    """

    step: int
    tiers: tuple[str, ...]
    finalized: bool
    draining: bool = False


class TieredCheckpointManager:
    """Step checkpoints over tiers (see the module doc). Every rank of ``group`` makes one with the same tiers.

    Args:
        tiers: :class:`~reshard.PeerMemory`, :class:`~reshard.LocalDisk`, :class:`~reshard.Durable` values, at
            most one of each, fastest first; a ``Durable`` tier is required.
        group: the ranks that save and restore together (the collective methods say so).
        drain_group: the group of the background drain (a ``LocalDisk`` tier's durable steps): a group that only
            the drain uses, such as ``dist.new_group(backend="gloo")``. Default: with ``group=None`` and
            torch.distributed initialized, the constructor makes one (a collective of every process of the default
            group); with another ``group``, it must be given.
        timeout: collective timeout.

    Raises:
        ValueError: naming what is wrong with ``tiers``, or a ``LocalDisk`` tier with a ``group`` and no
            ``drain_group``.
        CheckpointError: ``drain_group`` would carry the drain's collectives on NCCL.
    """

    def __init__(
        self,
        tiers: Iterable[PeerMemory | LocalDisk | Durable],
        *,
        group: Group = None,
        drain_group: Group = None,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        self.tiers: Tiers = check_tiers(list(tiers) if not isinstance(tiers, (list, tuple)) else tiers)
        self.group = group
        self.timeout = timeout
        self.durable = self._durable_manager(group)
        self._terms = tier_terms(self.tiers, self.durable.root.describe())
        self._peer: PeerMemoryCheckpoint | None = None
        if self.tiers.peer is not None:
            peer = self.tiers.peer
            self._peer = PeerMemoryCheckpoint(replicas=peer.replicas, node_size=peer.node_size, timeout=timeout)
        self._peer_steps: dict[str, int] = {}
        """The step of each peer-memory generation this rank saw committed, by the generation's token."""
        self._local: NodeLocal | None = None
        self._drain_local: NodeLocal | None = None
        self._drainer: CheckpointManager | None = None
        self._drain: Drain | None = None
        self.drain_group: Group = None
        self._undrained: set[int] = set()
        """Durable steps the node-local tier holds that the drain has not finalized (its retention keeps them)."""
        if self.tiers.local is not None:
            drain_group = self._drain_group(group, drain_group)
            check_drain_group(drain_group, timeout)
            self.drain_group = drain_group
            self._local = node_local(self.tiers.local, group, timeout)
            self._drain_local = node_local(self.tiers.local, drain_group, timeout)
            self._drainer = self._durable_manager(drain_group)

    def _durable_manager(self, group: Group) -> CheckpointManager:
        durable = self.tiers.durable
        return CheckpointManager(
            durable.root,
            keep_last=durable.keep_last,
            keep_every=durable.keep_every,
            group=group,
            storage_options=durable.storage_options,
            timeout=self.timeout,
        )

    @staticmethod
    def _drain_group(group: Group, drain_group: Group) -> Group:
        """The drain's group: ``drain_group``, or a new gloo group of every process when ``group`` is the default."""
        if drain_group is not None:
            return drain_group
        if group is not None:
            raise ValueError(
                "TieredCheckpointManager: a LocalDisk tier with a group needs a drain_group (a group of the same "
                "ranks that only the background drain uses, e.g. dist.new_group(ranks, backend='gloo'))"
            )
        if dist.is_available() and dist.is_initialized():
            made: Group = dist.new_group(backend="gloo")
            return made
        return None

    # ---- save (collective) ---------------------------------------------------------------------------------

    def save(self, step: int, state_dict: Any, *, options: SaveOptions | None = None) -> TieredSaveResult:
        """Save ``state_dict`` as step ``step`` to every tier whose ``every`` divides ``step``, fastest first
        (``options`` as for :func:`reshard.save`, for the storage tiers). Called by every rank of the group with the
        same tiers and step. Returns once the fast tiers hold the step: a durable step that the ``LocalDisk`` tier
        saved is drained in the background (the drain in flight, if any, is joined first); one that no faster
        storage tier holds is saved to the durable root directly, before this returns. A step no tier keeps
        returns at once, with no collective.

        Raises:
            CheckpointError: the ranks passed other tiers or steps (every rank, naming the difference); the
                previous drain failed (its error, on every rank: that step is not finalized); as each tier's save.
        """
        saving = self.tiers.saving(step)
        if not saving:
            return TieredSaveResult(step=step, tiers=())
        self._agree_save(step)
        names = tuple(t.name for t in saving)
        peer = self._save_peer(step, state_dict) if "peer" in names else None
        local: SaveResult | None = None
        if self._local is not None and "local" in names:
            self._local.keep(self._kept())
            local = self._local.save(step, state_dict, options=options)
        if "durable" not in names:
            return TieredSaveResult(step=step, tiers=names, peer=peer, local=local)
        self.join_drain()
        if local is not None:
            self._start_drain(step)
            return TieredSaveResult(step=step, tiers=names[:-1], draining=True, peer=peer, local=local)
        durable = self.durable.save(step, state_dict, options=options)
        return TieredSaveResult(step=step, tiers=names, peer=peer, local=local, durable=durable)

    def _agree_save(self, step: int) -> None:
        """The first step of a save (collective ``tiered save``, every rank): the ranks' tiers and step agree, and a
        drain that failed on some rank is joined on every rank, which raises its error."""
        comm = Communicator(self.group, timeout=self.timeout)
        mine = {"terms": {**self._terms, "step": step}, "drain": self._drain.state() if self._drain else None}

        def agree(values: list[dict[str, Any]]) -> bool:
            check_terms([v["terms"] for v in values], "TieredCheckpointManager.save")
            return any(v["drain"] == "failed" for v in values)

        if comm.step("tiered save", lambda: mine, agree):
            self.join_drain()

    def _save_peer(self, step: int, state_dict: Any) -> PeerSaveResult:
        """The peer-memory save of ``state_dict``, which carries its step (collective)."""
        assert self._peer is not None
        result = self._peer.save({STEP_KEY: step, "state": state_dict}, group=self.group)
        generation = self._peer.generation
        if generation is not None:
            self._peer_steps = {str(generation[1]): step}  # only the current generation is held
        return result

    def _kept(self) -> set[int]:
        """The node-local steps retention must keep: durable steps not finalized yet, newer than the newest
        finalized step (an older one will never be: the durable root has gone past it)."""
        finalized = self.durable.steps()
        newest = finalized[-1] if finalized else -1
        self._undrained = {s for s in self._undrained if s > newest and s not in finalized}
        return set(self._undrained)

    def _start_drain(self, step: int) -> None:
        """Drain step ``step`` from the node-local tier to the durable root in the background (every rank)."""
        drainer, source = self._drainer, self._drain_local
        assert drainer is not None
        assert source is not None
        self._undrained.add(step)

        def write(target: Storage) -> None:
            try:
                source.drain(step, target)
            finally:
                target.close()

        self._drain = Drain(step, lambda: drainer.save_written(step, write))

    def join_drain(self) -> None:
        """Wait for the drain in flight, if any, and raise its error (not collective; :meth:`wait` is)."""
        drain, self._drain = self._drain, None
        if drain is None:
            return
        drain.join()
        self._undrained.discard(drain.step)
        logger.info("reshard: step %d drained to %s in %.2f s", drain.step, self.durable.root.describe(), drain.seconds)

    def wait(self) -> None:
        """Finish the drain in flight (collective over the drain group: every rank joins its drain), raising its
        error on every rank; the step is finalized when this returns."""
        self.join_drain()

    def close(self) -> None:
        """Finish the drain in flight (its error is raised) and release the tiers' resources."""
        try:
            self.join_drain()
        finally:
            self.durable.close()
            if self._drainer is not None:
                self._drainer.close()
            self._peer = None

    # ---- queries (not collective) ----------------------------------------------------------------------------

    def finalized(self, step: int) -> bool:
        """Whether the durable tier holds step ``step`` complete."""
        return step in self.durable.steps()

    def status(self) -> list[StepStatus]:
        """Every step some tier holds as this rank sees it, oldest first: which tiers, finalized or not."""
        held: dict[int, list[str]] = {}
        for step in self._peer_steps.values():
            held.setdefault(step, []).append("peer")
        if self._local is not None:
            for step in self._local.steps():
                held.setdefault(step, []).append("local")
        for step in self.durable.steps():
            held.setdefault(step, []).append("durable")
        draining = self._drain.step if self._drain is not None and self._drain.state() == "running" else None
        return [
            StepStatus(step=s, tiers=tuple(held[s]), finalized="durable" in held[s], draining=s == draining)
            for s in sorted(held)
        ]

    # ---- restore (collective) --------------------------------------------------------------------------------

    def restore(self, template: Any, **load_kwargs: Any) -> tuple[int, str, Any] | None:
        """Fill ``template`` (the current layout: any world size, TP, PP, DP) from the newest step some tier can
        restore; return ``(step, tier name, loaded state)``, or None when no tier holds a step. Called by every
        rank of the group. ``load_kwargs`` go to the storage tiers' loads (:func:`reshard.load`); the peer-memory
        tier honours none, so with any it is skipped, with a warning.

        Candidates, newest step first and fastest tier first for the same step: the peer-memory generation the
        ranks hold (the newest some rank knows to be complete), the node-local tier's restorable steps, the durable
        root's complete steps. A candidate whose data is lost (:class:`~reshard.DataUnavailableError`), damaged
        (:class:`~reshard.CorruptCheckpointError`) or incomplete falls back to the next, with a warning naming the
        tier, the step and the reason; newer durable steps that are not complete are named in a warning too.

        Raises:
            MismatchError: the template does not match the state of the candidate tried (every rank).
            CheckpointError: the ranks passed other tiers (every rank, naming the difference).
        """
        comm = Communicator(self.group, timeout=self.timeout)
        local = self._local.restorable() if self._local is not None else []
        decided = comm.step("tiered restore", lambda: self._offer(comm, load_kwargs), self._choose(local))
        for note in decided["notes"]:
            warnings.warn(f"reshard: {note}", stacklevel=2)
        for step, tier in decided["candidates"]:
            try:
                return step, tier, self._restore_from(tier, step, template, load_kwargs)
            except FALLBACK_ERRORS as exc:
                warnings.warn(
                    f"reshard: restoring step {step} from the {tier} tier failed, trying the next candidate: {exc}",
                    stacklevel=2,
                )
        return None

    def _offer(self, comm: Communicator, load_kwargs: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of the restore's decision: its terms, the peer-memory generation it holds and that
        generation's step where it knows it; on the coordinator, the durable root's steps."""
        generation = self._peer.generation if self._peer is not None else None
        peer = None if generation is None else [generation, self._peer_steps.get(str(generation[1]))]
        durable = None
        if comm.is_coordinator:
            durable = [[info.step, info.status, info.problem] for info in scan_root(self.durable.root)]
        return {"terms": self._terms, "peer": peer, "kwargs": sorted(load_kwargs), "durable": durable}

    def _choose(self, local: list[int]) -> Any:
        def choose(values: list[dict[str, Any]]) -> dict[str, Any]:
            """On the coordinator: the candidates, in the order they are tried (see :meth:`restore`), and the notes
            every rank warns of."""
            terms = [{**v["terms"], "load arguments": v["kwargs"]} for v in values]
            check_terms(terms, "TieredCheckpointManager.restore")
            candidates: list[tuple[int, str]] = [(s, "local") for s in local]
            listed = values[0]["durable"] or []
            candidates += [(s, "durable") for s, status, _ in listed if status == "complete"]
            notes: list[str] = []
            peer = _peer_candidate([v["peer"] for v in values], values[0]["kwargs"], notes)
            if peer is not None:
                candidates.append((peer, "peer"))
            order = {"peer": 0, "local": 1, "durable": 2}
            candidates.sort(key=lambda c: (-c[0], order[c[1]]))
            newest = candidates[0][0] if candidates else -1
            notes += [
                f"durable step {s} is {status}, not restored from: {problem or 'no metadata.json'}"
                for s, status, problem in listed
                if status != "complete" and s > newest
            ]
            return {"candidates": candidates, "notes": notes}

        return choose

    def _restore_from(self, tier: str, step: int, template: Any, load_kwargs: dict[str, Any]) -> Any:
        """Step ``step`` of tier ``tier`` loaded into ``template`` (collective)."""
        if tier == "peer":
            assert self._peer is not None
            restored = self._peer.restore({STEP_KEY: step, "state": template}, group=self.group)
            if restored[STEP_KEY] != step:
                raise CheckpointError(f"the peer-memory generation holds step {restored[STEP_KEY]}, not {step}")
            return restored["state"]
        if tier == "local":
            assert self._local is not None
            return self._local.restore(step, template, **load_kwargs)
        return load(template, self.durable.path_of(step), group=self.group, timeout=self.timeout, **load_kwargs)


def _peer_candidate(held: list[list[Any] | None], kwargs: list[str], notes: list[str]) -> int | None:
    """On the coordinator: the step of the peer-memory generation a restore would restore (the newest generation
    some rank holds as current, as :meth:`PeerMemoryCheckpoint.restore` agrees it), where some rank knows it; None
    when no rank holds one, or load arguments ``kwargs`` rule the tier out (said in ``notes``)."""
    known = [h for h in held if h is not None]
    if not known:
        return None
    newest = max((h[0] for h in known), key=lambda n: (int(n[0]), str(n[1])))
    steps = [h[1] for h in known if h[0] == newest and h[1] is not None]
    if kwargs:
        notes.append(f"the peer-memory tier honours no load arguments ({', '.join(kwargs)}): not restored from")
        return None
    if not steps:
        notes.append(f"no rank knows the step of the peer-memory generation {newest}: not restored from")
        return None
    return int(steps[0])
