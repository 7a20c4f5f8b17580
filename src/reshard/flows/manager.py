"""A root of step checkpoints that never loses the last good state.

Layout of a root (a directory or an object-store prefix)::

    step_000001000/       one checkpoint per step (zero-padded, so names sort by step)
    step_000002000/
    latest.json           {"step": 2000, "path": "step_000002000"}: the newest committed step, a hint
    .lock                 held by the manager that is saving (see reshard.io.locking)
    plans.reshard-cache   the layouts of the newest save plan, a validated cache (reshard.flows.plan_cache)
    reads.reshard-cache   the needs of the newest read-once schedule of a load, a validated cache (the same)

A checkpoint is *complete* when its ``metadata.json`` exists (it is written last, atomically) and parses;
anything else under a step directory is an interrupted or running save. ``latest.json`` is updated only
after a commit (temp + rename locally, one put on object storage), so it never points at an incomplete
checkpoint; readers do not trust it anyway: :meth:`CheckpointManager.load_latest` lists the complete
checkpoints and falls back past ones that turn out incomplete or corrupt.

Retention runs after each save, on the coordinator: it deletes complete checkpoints outside the policy
(``keep_last`` newest, plus every ``keep_every``-th step), never the newest complete one and never one a
live writer holds, and removes leftovers of interrupted saves older than the newest complete checkpoint (and the
``.latest.json.tmp-<hex>`` that a manager killed while it replaced the pointer left).
It deletes through :func:`reshard.io.retirement.remove_checkpoint`: only what a reshard save wrote and something
reshard wrote ties to it, the retirement record ``retired.json`` first, so that a deletion cut short leaves a
retired directory, never a corrupt-looking one; a step that is a symbolic link, or whose files reshard cannot
tie to a save, is left alone with a warning. A failure of retention is :class:`~reshard.UnconfirmedCommitError`
(the step is committed).

With ``incremental=True`` each save after the first is an incremental save against the newest complete
checkpoint (:func:`reshard.save`'s ``base``): only the boxes whose content changed are written, the others
are referenced where they lie. A checkpoint whose files a kept one references is *retired* (``retired.json``;
status ``retired``), keeping exactly those files, and swept once no kept checkpoint needs them; ``full_every``
makes a save full when the bytes of its base go back that many steps, so that retired holders do not live on
for ever. A newest step that cannot be a base (its references tied by no marker: copied or moved into the root;
a data file of it, or one it references, of another size than recorded) makes the save full, with a warning.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from reshard.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    UnconfirmedCommitError,
)
from reshard.flows.certify import (
    CertifyHook,
    CertifyOptions,
    Checks,
    certify_later,
    decide_certification,
    prefer_certified,
)
from reshard.flows.load import load_reusing
from reshard.flows.maintenance import validate_checkpoint
from reshard.flows.options import SaveOptions, check_terms
from reshard.flows.plan_cache import PlanCache, ReadPlanCache
from reshard.flows.save import SaveResult, save_replacing
from reshard.flows.skipped import SkippedStep, step_digest, still_skipped, uncertified_skipped
from reshard.flows.steps import (
    LATEST_FILE,
    StepInfo,
    check_step,
    lock_is_live,
    point_latest_at,
    scan_root,
    step_name,
    step_of,
    sweep_pointer_temporaries,
)
from reshard.flows.timeline import Timeline, refusal
from reshard.io.locking import Lock, acquire_lock
from reshard.io.retirement import remove_checkpoint
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.storage import CheckpointLocation, Storage, storage_for

__all__ = ["LATEST_FILE", "CheckpointManager", "StepInfo", "scan_root", "step_name"]

logger = logging.getLogger("reshard")


class CheckpointManager:
    """Step checkpoints under ``root`` (a directory or URL) with a ``latest`` pointer and retention.

    Args:
        root: where the step checkpoints live.
        keep_last: keep this many newest complete checkpoints (None: keep all).
        keep_every: also keep every checkpoint whose step is a multiple of this.
        incremental: save each step incrementally against the newest complete checkpoint (see the module
            doc); every save records content hashes.
        full_every: with ``incremental``, save in full when the oldest checkpoint holding bytes of the base is
            this many steps or more older than the step saved: no checkpoint stays referenced (retired, with
            the dead bytes of its data files) for much longer than this many steps. None: never (a load never
            walks a chain anyway: references name the checkpoint that holds the bytes).
        group: the ranks that save and load together (collective methods say so).
        storage_options: for object-store roots.
        timeout: collective timeout.
        certify: run these checks in every save (``SaveOptions(certify=...)``); a step whose checks pass (and that
            ``certify_hook`` approves) is certified (``certified.json``), :meth:`load_latest` prefers the newest
            certified step, and retention keeps it (:mod:`reshard.flows.certify`).
        certify_hook: ``hook(step, checks) -> bool``, run on every rank after a save whose checks passed: any rank
            returning False, or raising, vetoes the certification (named in ``SaveResult.checks``, on every rank;
            the save stands). :meth:`certify` certifies a step later.
    """

    def __init__(
        self,
        root: CheckpointLocation,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        incremental: bool = False,
        full_every: int | None = None,
        group: Group = None,
        storage_options: dict[str, Any] | None = None,
        timeout: datetime.timedelta | float | None = None,
        certify: CertifyOptions | None = None,
        certify_hook: CertifyHook | None = None,
    ) -> None:
        if certify_hook is not None and certify is None:
            raise ValueError("certify_hook needs certify=CertifyOptions(...)")
        if full_every is not None and (full_every < 1 or not incremental):
            raise ValueError(f"full_every needs incremental=True and at least 1, got {full_every}")
        for name, count in (("keep_last", keep_last), ("keep_every", keep_every)):
            if count is not None and count < 1:
                raise ValueError(f"{name} must be at least 1, got {count}")
        self.root = storage_for(root, storage_options)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.incremental, self.full_every = incremental, full_every
        self.group, self.timeout = group, timeout
        self.certify_options, self.certify_hook = certify, certify_hook
        self._plans = PlanCache.beside(self.root)  # save plans, kept in the root for restarts (flows/plan_cache.py)
        self._read_plans = ReadPlanCache.beside(self.root)  # the read-once schedules of its loads (the same)
        self._checks: dict[int, Checks] = {}  # the checks of the steps this manager saved (before its hook)
        self.resumed_past: frozenset[int] = frozenset()
        """The complete steps newer than the one :meth:`load_latest` resumed from whose data failed to load: a save
        may go past them while they are still the saves that failed and still fail their checks (they are deleted
        once it commits); one that loads again, or that another save replaced, counts as newer. A step it skipped
        because it was incomplete (perhaps still being written) is not among them."""
        self._skipped: tuple[SkippedStep, ...] = ()
        """:attr:`resumed_past` with the identity of each save skipped (:mod:`reshard.flows.skipped`)."""

    def close(self) -> None:
        self.root.close()

    def path_of(self, step: int) -> Storage:
        """The storage of step ``step``'s checkpoint."""
        return self.root.child(step_name(step))

    # ---- queries (not collective) ----------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints, oldest first."""
        return [s.step for s in scan_root(self.root) if s.status == "complete"]

    def latest_pointer(self) -> int | None:
        """The step ``latest.json`` names (a hint; see :meth:`load_latest`)."""
        try:
            return int(json.loads(self.root.read_bytes(LATEST_FILE, max_bytes=64 * 1024))["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    # ---- save (collective) -----------------------------------------------------------------------

    def save(
        self,
        step: int,
        state_dict: Any,
        *,
        overwrite: bool = False,
        rewind: bool = False,
        options: SaveOptions | None = None,
    ) -> SaveResult:
        """Save ``state_dict`` as step ``step`` (``options`` as for :func:`reshard.save`), then
        (coordinator) point ``latest`` at it and apply the retention policy. Called by all ranks of the
        group. Two managers saving to one root at the same time cannot interleave: the second gets
        CheckpointLockedError. With ``incremental``, the base is the newest complete checkpoint older than
        ``step`` that records content hashes with the same checksum chunk size (none: a full save).

        A save never goes back in time by accident: a step older than the newest complete checkpoint is
        refused, unless ``rewind`` is set. A rewind saves ``step`` and then, once it is committed, deletes every
        step directory newer than ``step`` (complete checkpoints and leftovers of interrupted saves; what is
        not reshard's, or a live save, stays), so that ``latest``, :meth:`load_latest` and later saves of those
        steps all follow the new timeline. Steps that this manager's :meth:`load_latest` skipped as unloadable
        do not count as newer while they are still the saves it failed to load and still fail their checks
        (judged again on the coordinator): a save goes past them (with a warning), and they are deleted once it
        commits if they still fail then; so do the newer steps it skipped as not certified (when the manager certifies)
        while they are still not certified. One that loads again, or that another save replaced, counts as newer.
        ``overwrite`` replaces a complete checkpoint of ``step`` itself.

        Raises:
            CheckpointExistsError: on every rank, before anything is written: ``step`` is complete already and
                ``overwrite`` is off, or the root holds complete checkpoints newer than ``step`` and ``rewind``
                is off (the message names them).
            UnconfirmedCommitError: the step was committed and is complete (``latest`` points at it where the
                coordinator could still say so), but a rank died or lost contact after the commit (retention
                did not run), or, on every rank, updating ``latest`` or retention failed after the commit
                (what retention deleted before it failed stays deleted).
            CheckpointError: as :func:`reshard.save`; the step is not committed and ``latest`` is unchanged.
        """
        check_step(step)  # ValueError naming it, on every rank, before any collective
        comm = Communicator(self.group, timeout=self.timeout)
        options = options if options is not None else SaveOptions()
        if self.incremental:
            options = dataclasses.replace(options, content_hash=True)
        if self.certify_options is not None:
            options = dataclasses.replace(options, certify=self.certify_options)
        held: list[Lock] = []  # the manager lock, on the coordinator once taken (released below, whatever fails)
        base: Storage | None = None
        try:
            base_name, past, replaces = self._lock_step(
                comm, held, step=step, overwrite=overwrite, rewind=rewind, chunk_bytes=options.checksum_chunk_bytes
            )
            base = self.root.child(base_name) if base_name is not None else None
            try:
                result = save_replacing(
                    state_dict,
                    self.path_of(step),
                    replaces=replaces,
                    group=self.group,
                    overwrite=overwrite,
                    options=options,
                    timeout=self.timeout,
                    base=base,
                    certificate=self.certify_hook is None,
                    plan_cache=self._plans,
                )
                result = self._decide(comm, step, result)
            except UnconfirmedCommitError:
                if comm.is_coordinator:
                    point_latest_at(self.root, step)  # the step is complete; the group is not: no retention
                raise
            self._publish_step(comm, held[0] if held else None, step=step, rewind=rewind, past=past, result=result)
        finally:
            for lock_held in held:
                lock_held.release()
            if base is not None:
                base.close()
        return result

    def save_written(self, step: int, write: Callable[[Storage, str | None], None]) -> None:
        """:meth:`save` (collective: lock, forward in time, ``latest``, retention) of what ``write(storage, replaces)``
        writes, commits, closes in ``step``'s storage (a tiered drain; ``replaces``: a skipped save's digest, None)."""
        comm, held = Communicator(self.group, timeout=self.timeout), list[Lock]()
        try:
            _, past, replaces = self._lock_step(comm, held, step=step, overwrite=False, rewind=False, chunk_bytes=0)
            write(self.path_of(step), replaces)
            self._publish_step(comm, held[0] if held else None, step=step, rewind=False, past=past, result=None)
        finally:
            for lock_held in held:
                lock_held.release()

    def _lock_step(
        self, comm: Communicator, held: list[Lock], *, step: int, overwrite: bool, rewind: bool, chunk_bytes: int
    ) -> tuple[str | None, tuple[int, ...], str | None]:
        """The first step of :meth:`save` (collective ``manager lock``, every rank): the ranks' terms agree, and the
        coordinator takes the manager lock (appended to ``held``, which the caller releases), checks that the save
        goes forward in time (or may not) and chooses the base of an incremental save; that base's name (None: a
        full save) and the newer steps the save goes past (ones :meth:`load_latest` skipped that are still the
        saves it failed to load and still fail their checks, judged on the coordinator) on every rank; and when
        ``step`` itself is such a step (without ``overwrite``), the digest of the damaged save the save replaces
        (:func:`reshard.flows.save.save_replacing` checks it again under the step's lock), else None.

        Raises:
            CheckpointExistsError: on every rank, as :meth:`save` says.
        """

        def lock() -> list[Any]:
            terms = self._terms(step=step, overwrite=overwrite, rewind=rewind)
            if not comm.is_coordinator:
                return [terms, None, None, [], None]
            held.append(acquire_lock(self.root, uuid.uuid4().hex, what="manager"))
            held[0].start_renewing()
            complete = [s.step for s in scan_root(self.root) if s.status == "complete"]
            unloadable = {
                s.step: s.digest for s in self._skipped if s.step >= step and still_skipped(self.root, s) is not None
            }
            where = f"CheckpointManager under {self.root.describe()}"
            timeline = Timeline.of(
                where, self.root.describe(step_name(step)), complete, step=step, unloadable=unloadable
            )
            refused = refusal(timeline, overwrite=overwrite, rewind=rewind)
            if refused is not None:
                again = sorted(set(self.resumed_past) & set(timeline.blocking))
                if again:
                    refused += (
                        f". Steps {again}, which load_latest skipped as unloadable, load again or were saved anew "
                        "since: they count as newer"
                    )
                return [terms, None, refused, [], None]
            base = self._base_for(step, chunk_bytes) if self.incremental else None
            replaces = unloadable[step] if timeline.replaced and not overwrite else None
            return [terms, base, None, [] if rewind else list(timeline.newer), replaces]

        def coordinators(values: list[list[Any]]) -> list[Any]:
            check_terms([terms for terms, *_ in values], "CheckpointManager.save")
            _, base_name, refused, past, replaces = values[0]
            if refused is not None:
                raise CheckpointExistsError(refused)
            return [base_name, past, replaces]

        base_name, past, replaces = comm.step("manager lock", lock, coordinators)
        if replaces is not None:
            warnings.warn(
                f"reshard: step {step} replaces the step {step} that load_latest skipped (unloadable or not certified)",
                stacklevel=3,
            )
        if past:
            warnings.warn(
                f"reshard: step {step} is saved past steps {sorted(past)}, which load_latest skipped (unloadable or "
                "not certified); they are deleted once it commits, if they still fail their checks (or are still not "
                "certified) then",
                stacklevel=3,
            )
        return base_name, tuple(past), replaces

    def _publish_step(
        self,
        comm: Communicator,
        held: Lock | None,
        *,
        step: int,
        rewind: bool,
        past: tuple[int, ...],
        result: SaveResult | None,
    ) -> None:
        """The last step of :meth:`save` (collective ``manager retention``, every rank), after the commit: the
        coordinator, still holding the manager lock ``held``, points ``latest`` at ``step`` and applies the retention
        policy (with ``rewind``, deleting the steps newer than ``step`` too; of the steps ``past``, which the save
        went past, those that are still the unloadable saves skipped, judged again now: a file that came back during
        the save keeps its step, with a warning).

        Raises:
            UnconfirmedCommitError: on every rank, when that failed (the step is committed).
        """

        def publish() -> None:
            if comm.is_coordinator:
                if held is not None:
                    held.check()
                point_latest_at(self.root, step)
                try:
                    self._retain(keep_step=step, rewind=rewind, drop=self._still_skipped(past))
                except (OSError, CheckpointError) as exc:
                    raise StorageError(f"retention failed ({LATEST_FILE} names {step_name(step)}): {exc}") from exc

        try:
            comm.step("manager retention", publish)
        except CheckpointError as exc:  # the same error on every rank, after a commit that every rank saw
            raise UnconfirmedCommitError(
                f"{step_name(step)} was committed and is complete (save {result.save_id if result else 'drained'}), "
                f"but the manager's work after the commit failed: {exc}",
                path=self.root.describe(step_name(step)),
                save_id=result.save_id if result else "",
                failures=exc.failures,
            ) from exc

    def _terms(self, **call: Any) -> dict[str, Any]:
        """What every rank of the group must pass alike to a collective method (the root, the retention
        policy, and the call's own arguments ``call``): a rank with another policy would retain other
        steps than the coordinator, which alone applies it."""
        return {
            "root": self.root.describe(),
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "incremental": self.incremental,
            "full_every": self.full_every,
            "certify_options": None
            if self.certify_options is None
            else json.dumps(self.certify_options.to_json(), sort_keys=True),
            "certify_hook": self.certify_hook is not None,
            **call,
        }

    def _base_for(self, step: int, chunk_bytes: int) -> str | None:
        """On the coordinator: the base of an incremental save of ``step``, or None (a full save)."""
        for info in reversed(scan_root(self.root)):
            if info.status == "complete" and info.step < step:
                if not info.content_hashes or info.checksum_chunk_bytes != chunk_bytes:
                    logger.info("incremental save of step %d: %s cannot be its base, saving in full", step, info.name)
                    return None
                if self.full_every is not None:
                    holders = [step_of(name) for name in info.referenced_checkpoints]
                    oldest = min([info.step, *(h for h in holders if h is not None)])
                    if step - oldest >= self.full_every:
                        logger.info("step %d: a full save (its base's bytes go back to step %d)", step, oldest)
                        return None
                return info.name if self._usable_base(info.name) else None
        return None

    def _usable_base(self, name: str) -> bool:
        """Whether checkpoint ``name`` can be an incremental save's base: its references are tied to it by
        markers (it was not copied or moved here) and its data files, and those it references, have their
        sizes (no byte is read here: the save itself reads back each box it would reference, unless
        ``SaveOptions(verify_base=False)``, and writes the ones whose stored copy is damaged). Else the save is
        made in full, so that a damaged or moved base never keeps a job from saving. A step that is a symbolic
        link is no base: no reference resolves through a link."""
        if self.root.is_link(name):
            logger.warning("%s is a symbolic link: it cannot be the base of an incremental save, saving in full", name)
            return False
        child = self.root.child(name)
        try:
            problems = validate_checkpoint(child, quick=True)
        except CheckpointError as exc:
            problems = [str(exc)]
        finally:
            child.close()
        if problems:
            logger.warning("%s cannot be the base of an incremental save, saving in full: %s", name, problems[0])
        return not problems

    def _still_skipped(self, past: tuple[int, ...]) -> dict[int, str]:
        """On the coordinator, after a save went past the steps ``past``: those still the unloadable saves that
        :meth:`load_latest` skipped (:func:`reshard.flows.skipped.still_skipped`), each with the digest of that save
        (its deletion checks it again under the step's lock); the others stay, with a warning."""
        drop = {
            s.step: s.digest
            for s in self._skipped
            if s.step in past and s.digest is not None and still_skipped(self.root, s) is not None
        }
        if set(past) - set(drop):
            logger.warning(
                "retention: steps %s, which load_latest skipped as unloadable, load again or were saved anew: kept",
                sorted(set(past) - set(drop)),
            )
        return drop

    def _retain(self, *, keep_step: int, rewind: bool = False, drop: dict[int, str] | None = None) -> None:
        """On the coordinator, under the manager lock: delete what the policy no longer keeps (with ``rewind``,
        every step newer than ``keep_step`` as well: ``keep_step`` is the newest; and the complete steps ``drop``, each
        only while it is still the save of the digest given)."""
        drop = drop or {}
        sweep_pointer_temporaries(self.root)
        infos = scan_root(self.root)

        def rewound(info: StepInfo) -> bool:  # a step of the timeline a rewind abandons, or a dropped one
            return (rewind and info.step > keep_step) or (info.step in drop and info.status == "complete")

        complete = [s.step for s in infos if s.status == "complete" and not rewound(s)]
        if not complete:
            return
        newest = max(complete)
        keep = set(complete) if self.keep_last is None else set(sorted(complete)[-self.keep_last :])
        if self.keep_every is not None:
            keep |= {s for s in complete if s % self.keep_every == 0}
        keep |= {newest, keep_step}
        if self.certify_options is not None:  # the newest certified step is the recovery point: never deleted
            keep |= set(sorted(s.step for s in infos if s.certified and s.step in complete)[-1:])

        # Newest first, so that a checkpoint referenced only by older ones being deleted too goes whole;
        # then the retired ones, whose referrers may just have gone.
        for info in sorted(infos, key=lambda i: -i.step):
            if info.status == "complete" and info.step not in keep:
                what = "deleting"
            elif info.status not in ("complete", "retired") and (info.step < newest or rewound(info)):
                what = "removing the leftovers of interrupted save"
            else:
                continue
            if not (info.locked and lock_is_live(self.root, info.name)):
                self._remove(info.name, what, only_save=drop.get(info.step) if info.status == "complete" else None)
        for info in infos:
            if info.status == "retired":
                self._remove(info.name, "sweeping retired")

    def _remove(self, name: str, what: str, only_save: str | None = None) -> None:
        """On the coordinator: delete what reshard wrote in step directory ``name`` (retired where newer
        checkpoints reference its files). A directory that is a link, or that nothing ties to a reshard save (a
        ``retired.json`` or ``metadata.json`` reshard did not write, a live save), is left with a warning; so is one
        that is no longer the save of digest ``only_save`` when given (checked under the step's lock).

        Raises:
            OSError: a deletion failed (what was deleted stays deleted).
        """
        if self.root.is_link(name):
            logger.warning("retention: %s is a symbolic link, left alone", self.root.describe(name))
            return
        logger.info("retention: %s %s", what, self.root.describe(name))
        child = self.root.child(name)
        try:
            removal = remove_checkpoint(child, only_save=only_save)
        except (CheckpointNotFoundError, CorruptCheckpointError, CheckpointLockedError, CheckpointExistsError) as exc:
            logger.warning("retention: %s left alone: %s", self.root.describe(name), exc)
            return
        finally:
            child.close()
        if removal.retired:
            logger.info("retention: %s keeps the data files newer checkpoints reference", name)
        if removal.left:
            logger.warning(
                "retention: %s keeps %d files that no reshard save wrote or records (%s)",
                self.root.describe(name),
                len(removal.left),
                ", ".join(removal.left[:5]),
            )

    # ---- load (collective) -----------------------------------------------------------------------

    def load_latest_with_state(
        self, state_dict: Any, *, skipped: list[tuple[int, str]] | None = None, **load_kwargs: Any
    ) -> tuple[int, Any] | None:
        """Load the newest complete checkpoint into ``state_dict``; return its step and the loaded state
        dict (see :func:`reshard.load`), or None when there is none. Called by all ranks of the group.

        Every step directory newer than the one loaded is accounted for: one whose ``metadata.json`` is
        missing (a save interrupted, or still writing), does not parse or fails its checks, or whose data
        fails to load, is skipped with a warning naming it and the reason, and appended to ``skipped`` as
        ``(step, reason)`` when a list is given, so that a job never resumes from an older step without
        saying so."""
        comm = Communicator(self.group, timeout=self.timeout)

        def candidates() -> list[Any]:
            root = {"root": self.root.describe()}
            if not comm.is_coordinator:
                return [root, None]
            listed = reversed(scan_root(self.root))
            return [
                root,
                [
                    [s.step, s.status, s.problem, step_digest(self.root, s), s.certified, s.certification]
                    for s in listed
                ],
            ]

        def coordinators(values: list[list[Any]]) -> list[list[Any]]:
            check_terms([terms for terms, _ in values], "CheckpointManager.load_latest")
            listed: list[list[Any]] = values[0][1] or []
            return listed

        listed = comm.step("listing checkpoints", candidates, coordinators)

        def skip(step: int, reason: str) -> None:
            warnings.warn(f"reshard: skipping checkpoint {self.root.describe(step_name(step))}: {reason}", stacklevel=3)
            if skipped is not None:
                skipped.append((step, reason))

        unloadable: list[SkippedStep] = []  # complete steps that failed to load or are not certified: a save may
        if self.certify_options is not None:  # go past them
            listed, before = prefer_certified(listed, skip, self._checks), listed
            unloadable = uncertified_skipped(before, listed)
        for step, status, problem, digest, *_ in listed:
            if status == "retired":
                skip(step, "it was deleted by retention and keeps only data files that newer checkpoints reference")
                continue
            if status != "complete":
                skip(
                    step, problem or "it has no metadata.json (a save interrupted before its commit, or still writing)"
                )
                continue
            try:
                path, plans = self.path_of(step), self._read_plans
                loaded = load_reusing(plans, state_dict, path, group=self.group, timeout=self.timeout, **load_kwargs)
            except (CorruptCheckpointError, IncompleteCheckpointError, CheckpointNotFoundError) as exc:
                skip(step, str(exc))
                unloadable.append(SkippedStep(step, digest))
                continue
            self.remember_skipped(unloadable)
            return step, loaded
        self.remember_skipped(unloadable)
        return None

    def _decide(self, comm: Communicator, step: int, result: SaveResult) -> SaveResult:
        """After the commit of ``step``: remember its checks; with a hook, decide (collective) its certification."""
        if result.checks is not None:
            self._checks[step] = result.checks
            if self.certify_hook is not None:
                hooked = decide_certification(comm, self.path_of(step), step, result.checks, self.certify_hook)
                return dataclasses.replace(result, checks=hooked)
        return result

    def certify(self, step: int) -> Checks:
        """Certify step ``step`` now (collective), as :func:`reshard.flows.certify.certify_later` says."""
        comm = Communicator(self.group, timeout=self.timeout)
        return certify_later(comm, self.path_of(step), step)

    def remember_skipped(self, skipped: list[SkippedStep]) -> None:
        """The steps a resume skipped (as :meth:`load_latest` does; a tiered restore too): a save may go past them."""
        self._skipped = tuple(skipped)
        self.resumed_past = frozenset(s.step for s in skipped)

    def load_latest(self, state_dict: Any, **load_kwargs: Any) -> int | None:
        """Like :meth:`load_latest_with_state` (tensors are filled in place), returning only the step."""
        found = self.load_latest_with_state(state_dict, **load_kwargs)
        return None if found is None else found[0]
