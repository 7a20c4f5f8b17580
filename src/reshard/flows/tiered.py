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

import dataclasses
import datetime
import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from reshard.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DataUnavailableError,
    IncompleteCheckpointError,
)
from reshard.flows.certify import CertifyHook, CertifyOptions, Checks, decide_certification, options_term
from reshard.flows.load import load
from reshard.flows.manager import CheckpointManager
from reshard.flows.nodelocal import NodeLocalCheckpoints
from reshard.flows.options import SaveOptions, check_terms
from reshard.flows.peer import PeerMemoryCheckpoint, PeerSaveResult
from reshard.flows.save import SaveResult
from reshard.flows.skipped import SkippedStep
from reshard.flows.steps import check_step, scan_root
from reshard.flows.tiered_certify import (
    carry_lost_certificates,
    certified_here,
    node_certified,
    spread_certificate,
)
from reshard.flows.tiered_drain import Drain, check_drain_group
from reshard.flows.tiered_restore import Decision, checks_known, choose, durable_listing, same_timeline
from reshard.flows.tiers import Durable, LocalDisk, PeerMemory, Tiers, check_tiers, tier_terms
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.storage import Storage

__all__ = ["StepStatus", "TieredCheckpointManager", "TieredSaveResult"]

logger = logging.getLogger("reshard")

STEP_KEY = "tiered_step"
"""The common value a peer-memory generation carries beside the state: the step it holds."""
DEFAULT_CERTIFY = CertifyOptions()
"""The checks a manager runs by default: every floating value finite, every replica alike."""
FALLBACK_ERRORS = (DataUnavailableError, CorruptCheckpointError, IncompleteCheckpointError, CheckpointNotFoundError)
"""What makes a restore fall back to its next candidate (every rank raises them alike); a MismatchError (the
template is not the checkpoint's state) is the caller's and raises."""


def node_local(tier: LocalDisk, group: Group, timeout: datetime.timedelta | float | None) -> NodeLocalCheckpoints:
    """The node-local checkpoints of ``tier`` over ``group``."""
    return NodeLocalCheckpoints(
        tier.directory, node_size=tier.node_size, keep_last=tier.keep_last, group=group, timeout=timeout
    )


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
        certified: a finalized step: the durable step holds a valid ``certified.json``; another: some tier holding
            it has it certified (a valid ``certified.json`` in this node's directory; for the peer-memory
            generation, the checks of the save of the step passed).
    """

    step: int
    tiers: tuple[str, ...]
    finalized: bool
    draining: bool = False
    certified: bool = False


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
        certify: the checks every storage tier's save runs (:class:`~reshard.CertifyOptions`; None: none): a
            step whose checks pass (and ``certify_hook`` approves) is certified (``certified.json``, carried to the
            durable step by its drain), and :meth:`restore` prefers certified steps.
        certify_hook: ``hook(step, checks) -> bool`` on every rank after a save whose checks passed; any veto (or
            exception) leaves the step uncertified, as :class:`~reshard.CheckpointManager`'s.
        timeout: collective timeout.

    Raises:
        ValueError: naming what is wrong with ``tiers``, or a ``LocalDisk`` tier with a ``group`` and no
            ``drain_group``, or a ``certify_hook`` without ``certify``.
        CheckpointError: ``drain_group`` would carry the drain's collectives on NCCL.
    """

    def __init__(
        self,
        tiers: Iterable[PeerMemory | LocalDisk | Durable],
        *,
        group: Group = None,
        drain_group: Group = None,
        certify: CertifyOptions | None = DEFAULT_CERTIFY,
        certify_hook: CertifyHook | None = None,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        self.tiers: Tiers = check_tiers(list(tiers) if not isinstance(tiers, (list, tuple)) else tiers)
        if certify_hook is not None and certify is None:
            raise ValueError("TieredCheckpointManager: certify_hook needs certify=CertifyOptions(...)")
        self.group = group
        self.timeout = timeout
        self.certify_options = certify
        self.certify_hook = certify_hook
        self._checks: dict[int, Checks] = {}
        """The checks of the steps this manager saved (as decided: the hook's veto included)."""
        self._resumed: int | None = None
        """The step :meth:`restore` resumed from, until the next node-local save discards the node-local steps newer
        than it (an abandoned timeline, restorable or not: a save of one replaces it)."""
        self._resume_checked = False
        """Whether this manager looked for a node-local step whose drain a dead job left unfinished."""
        self.durable = self._durable_manager(group)
        self._terms = {
            **tier_terms(self.tiers, self.durable.root.describe()),
            "certify": options_term(certify),
            "certify_hook": certify_hook is not None,
        }
        self._peer: PeerMemoryCheckpoint | None = None
        if self.tiers.peer is not None:
            peer = self.tiers.peer
            self._peer = PeerMemoryCheckpoint(replicas=peer.replicas, node_size=peer.node_size, timeout=timeout)
        self._peer_steps: dict[str, int] = {}
        """The step of each peer-memory generation this rank saw committed, by the generation's token."""
        self._local: NodeLocalCheckpoints | None = None
        self._drain_local: NodeLocalCheckpoints | None = None
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
            self._drainer = self._durable_manager(drain_group, drains=True)

    def _durable_manager(self, group: Group, *, drains: bool = False) -> CheckpointManager:
        """The manager of the durable root over ``group`` (``drains``: the drain's, which runs no hook)."""
        durable = self.tiers.durable
        return CheckpointManager(
            durable.root,
            keep_last=durable.keep_last,
            keep_every=durable.keep_every,
            group=group,
            storage_options=durable.storage_options,
            timeout=self.timeout,
            certify=self.certify_options,
            certify_hook=None if drains else self.certify_hook,
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
        (``options`` as for :func:`reshard.save`, for the storage tiers, but for ``certify``: the manager's is the
        only source of every tier's checks, and a ``SaveOptions.certify`` other than it fails the save). Called by
        every rank of the group with the same tiers and step. Returns once the fast tiers hold the step: a durable
        step that the ``LocalDisk`` tier saved is drained in the background (the drain in flight, if any, is
        joined first); one that no faster storage tier holds is saved to the durable root directly, before this
        returns. A step no tier keeps returns at once, with no collective.

        Raises:
            ValueError: ``step`` is not an ``int`` of at least 0 (a float, a tensor, a bool), naming it.
            CheckpointError: the ranks passed other tiers or steps (every rank, naming the difference), or some
                rank passed a ``SaveOptions.certify`` other than the manager's (every rank, naming both); the
                previous drain failed (its error, on every rank: that step is not finalized); as each tier's save.
        """
        saving = self.tiers.saving(check_step(step))
        if not saving:
            return TieredSaveResult(step=step, tiers=())
        self._agree_save(step, options)
        if self._local is not None and not self._resume_checked:
            self._resume_drain(self._local.restorable_saves(), step - 1)
        names = tuple(t.name for t in saving)
        peer = self._save_peer(step, state_dict) if "peer" in names else None
        local: SaveResult | None = None
        if self._local is not None and "local" in names:
            local = self._save_local(step, state_dict, options)
        if "durable" not in names:
            return TieredSaveResult(step=step, tiers=names, peer=peer, local=local)
        self.join_drain()
        if local is not None:
            self._start_drain(step)
            return TieredSaveResult(step=step, tiers=names[:-1], draining=True, peer=peer, local=local)
        durable = self.durable.save(step, state_dict, options=options)
        if durable.checks is not None:
            self._checks[step] = durable.checks
        return TieredSaveResult(step=step, tiers=names, peer=peer, local=local, durable=durable)

    def _save_local(self, step: int, state_dict: Any, options: SaveOptions | None) -> SaveResult:
        """The node-local save of ``step`` (collective): first the steps newer than the one a restore resumed from
        are discarded on every node, whether or not they were restorable (a save of one would be refused),
        then the save with the manager's checks; a certified step's certificate goes to every node (with a hook,
        once every rank approved)."""
        assert self._local is not None
        if self._resumed is not None:
            self._local.discard(newer_than=self._resumed)
            self._resumed = None
        self._local.keep(self._kept())
        if self.certify_options is not None:
            options = dataclasses.replace(options or SaveOptions(), certify=self.certify_options)
        result = self._local.save(step, state_dict, options=options, certificate=self.certify_hook is None)
        if result.checks is None:
            return result
        comm = Communicator(self.group, timeout=self.timeout)
        checks = result.checks
        if self.certify_hook is not None:
            checks = decide_certification(comm, self._local.path_of(step), step, checks, self.certify_hook)
            result = dataclasses.replace(result, checks=checks)
        self._checks[step] = checks
        if checks.passed and self.certify_hook is not None:  # without a hook, the node-local save spread it
            spread_certificate(comm, self._local, step)
        return result

    def _resume_drain(self, local: dict[int, str], limit: int) -> None:
        """Start the drain that a dead job left unfinished (collective, every rank; once per manager, at its first
        save or restore): the newest node-local step of ``local`` (restorable ones, with their digests) up to
        ``limit`` that is due for the durable tier, newer than its newest complete step (the coordinator's listing)
        and of its timeline (:func:`~reshard.flows.tiered_restore.same_timeline`), if any.
        :meth:`NodeLocalCheckpoints.drain` keeps what the dead drain copied whole."""
        self._resume_checked = True
        assert self._local is not None
        comm = Communicator(self.group, timeout=self.timeout)
        carry_lost_certificates(comm, self._local, self.durable.root, self.tiers.durable.every)
        due = {s: d for s, d in local.items() if s % self.tiers.durable.every == 0 and s <= limit}
        if not due or self._drainer is None:
            return
        root = self.durable.root

        def decide(_: list[None]) -> int | None:
            listed = durable_listing(root)
            newest = max((s for s, status, *_ in listed if status == "complete"), default=-1)
            durable = {s: d for s, status, _, _, _, d in listed if status == "complete"}
            pending = [s for s in same_timeline(due, durable, []) if s > newest]
            return pending[-1] if pending else None

        step = comm.step("tiered: unfinished drain", lambda: None, decide)
        if step is not None:
            logger.warning("reshard: node-local step %d is not finalized: draining it to the durable tier", step)
            self.join_drain()
            self._start_drain(int(step))

    def _agree_save(self, step: int, options: SaveOptions | None) -> None:
        """The first step of a save (collective ``tiered save``, every rank): the ranks' tiers and step agree, no
        rank's ``options.certify`` differs from the manager's ``certify`` (the only source of every tier's checks,
        the drain's included), and a drain that failed on some rank is joined on every rank, which raises its
        error."""
        comm = Communicator(self.group, timeout=self.timeout)
        given = options_term(options.certify) if options is not None and options.certify is not None else None
        mine = {
            "terms": {**self._terms, "step": step},
            "drain": self._drain.state() if self._drain else None,
            "certify": given,
        }

        def agree(values: list[dict[str, Any]]) -> bool:
            check_terms([v["terms"] for v in values], "TieredCheckpointManager.save")
            own = self._terms["certify"]
            for rank, v in enumerate(values):
                if v["certify"] is not None and v["certify"] != own:
                    raise CheckpointError(
                        f"TieredCheckpointManager.save: rank {rank} passed SaveOptions.certify={v['certify']}, but "
                        f"the manager's certify is {own}: the TieredCheckpointManager's certify is the only source "
                        "of every tier's checks (leave SaveOptions.certify None, or pass the manager's)"
                    )
            return any(v["drain"] == "failed" for v in values)

        if comm.step("tiered save", lambda: mine, agree):
            self.join_drain()

    def _save_peer(self, step: int, state_dict: Any) -> PeerSaveResult:
        """The peer-memory save of ``state_dict``, which carries its step, with the manager's checks (collective;
        a ``certify_hook`` is not consulted for this tier: it decides what the storage tiers certify)."""
        assert self._peer is not None
        result = self._peer.save({STEP_KEY: step, "state": state_dict}, group=self.group, certify=self.certify_options)
        generation = self._peer.generation
        if generation is not None:
            self._peer_steps = {str(generation[1]): step}  # only the current generation is held
        if result.checks is not None:
            self._checks[step] = result.checks  # a storage tier's save of the step, if any, judges it again
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

        def write(target: Storage, replaces: str | None) -> None:
            try:  # the drain copies the node-local certificate after the metadata.json it certifies
                source.drain(step, target, replaces=replaces)
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
        """Every step some tier holds as this rank sees it, oldest first: which tiers, finalized or not; a finalized
        step's ``certified`` is what the durable tier holds (the fast tiers' copies may go)."""
        held: dict[int, list[str]] = {}
        certified: set[int] = set()
        for step in self._peer_steps.values():
            held.setdefault(step, []).append("peer")
            if step in self._checks and self._checks[step].passed:
                certified.add(step)
        if self._local is not None:
            for step in self._local.steps():
                held.setdefault(step, []).append("local")
                if certified_here(self._local, step):
                    certified.add(step)
        for info in scan_root(self.durable.root):
            if info.status == "complete":
                held.setdefault(info.step, []).append("durable")
                if info.certified:
                    certified.add(info.step)
                else:  # a finalized step is certified when the durable tier holds its certificate
                    certified.discard(info.step)
        draining = self._drain.step if self._drain is not None and self._drain.state() == "running" else None
        return [
            StepStatus(
                step=s,
                tiers=tuple(held[s]),
                finalized="durable" in held[s],
                draining=s == draining,
                certified=s in certified,
            )
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
        root's complete steps. When the manager certifies, candidates newer than the newest certified one are
        skipped, each named in a warning with why (the checks' problems where known). A candidate whose data is
        lost (:class:`~reshard.DataUnavailableError`), damaged (:class:`~reshard.CorruptCheckpointError`) or
        incomplete falls back to the next, with a warning naming the tier, the step and the reason; newer durable
        steps that are not complete are named in a warning too.

        After the restore of step ``s``: the durable steps newer than ``s`` it skipped (damaged, or not certified)
        do not block later saves while they are still those saves (:mod:`reshard.flows.skipped`: a save goes past
        them, a save of the same step replaces it, retention deletes them); every node-local step newer than ``s``
        (complete on any node, restorable or not) is discarded at the next node-local save; and the newest
        node-local step up to ``s`` due for the durable tier that is not finalized (a dead job's drain) is drained
        again in the background.

        Raises:
            MismatchError: the template does not match the state of the candidate tried (every rank).
            CheckpointError: the ranks passed other tiers (every rank, naming the difference).
        """
        comm = Communicator(self.group, timeout=self.timeout)
        local = self._local.restorable_saves() if self._local is not None else {}
        decide = choose(local, self.certify_options is not None)
        decided = Decision.from_json(comm.step("tiered restore", lambda: self._offer(comm, load_kwargs), decide))
        for note in decided.notes:
            warnings.warn(f"reshard: {note}", stacklevel=2)
        for candidate in decided.candidates:
            step, tier = candidate.step, candidate.tier
            try:
                state = self._restore_from(tier, step, template, load_kwargs)
            except FALLBACK_ERRORS as exc:
                warnings.warn(
                    f"reshard: restoring step {step} from the {tier} tier failed, trying the next candidate: {exc}",
                    stacklevel=2,
                )
                continue
            self._resumed_at(step, decided, local)
            return step, tier, state
        return None

    def _resumed_at(self, step: int, decided: Decision, local: dict[int, str]) -> None:
        """After the restore of ``step`` (every rank, collective where a drain is resumed): what it went past."""
        uncertified = {c.step for c in decided.uncertified}
        skipped = [SkippedStep(c.step, c.digest, c.step in uncertified) for c in decided.durable if c.step > step]
        for manager in (self.durable, self._drainer):
            if manager is not None:
                manager.remember_skipped(skipped)
        self._resumed = step
        if self._local is not None:
            self._resume_drain(local, step)

    def _offer(self, comm: Communicator, load_kwargs: dict[str, Any]) -> dict[str, Any]:
        """This rank's part of the restore's decision (:mod:`reshard.flows.tiered_restore`): its terms, the
        peer-memory generation it holds and that generation's step where it knows it, the checks it knows, the
        node-local steps certified on its node; on the coordinator, the durable root's steps."""
        generation = self._peer.generation if self._peer is not None else None
        held = None if generation is None else self._peer_steps.get(str(generation[1]))
        peer = None if generation is None else [generation, held]
        checks = dict(self._checks)
        if held is not None and self._peer is not None and self._peer.checks is not None:
            checks.setdefault(held, self._peer.checks)  # the checks kept with the generation
        return {
            "terms": self._terms,
            "peer": peer,
            "kwargs": sorted(load_kwargs),
            "checks": checks_known(checks),
            "local_certified": node_certified(self._local) if self._local is not None else [],
            "durable": durable_listing(self.durable.root) if comm.is_coordinator else None,
        }

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
