"""Which way a step checkpoint goes in time: the rules by which :class:`~reshard.flows.manager.CheckpointManager`
lets a save of a step run, refuses it, or lets it replace the steps after it (a rewind).

A save goes forward: a step older than the newest complete checkpoint of the root is refused unless the caller
rewinds (``rewind=True``), or unless every newer complete step is one that this manager's ``load_latest`` skipped
as unloadable and that are still those saves and still fail their checks (a damaged newest step: the job resumed
from an older one and must be able to save past it; those steps are deleted once the save commits, as a rewind
deletes; :mod:`reshard.flows.skipped` judges them). A skipped step equal to the step saved, judged so too, is no
refusal either: the save replaces it (an overwrite of a damaged step, which the restart resumed past and now saves
again). Only complete checkpoints count: leftovers of
interrupted saves never stop a restart. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

__all__ = ["Timeline", "refusal", "steps_text"]


def steps_text(steps: Iterable[int]) -> str:
    """Steps as a message names them: the first ten, then how many in all."""
    listed = sorted(steps)
    shown = ", ".join(str(s) for s in listed[:10])
    return shown if len(listed) <= 10 else f"{shown}, ... ({len(listed)} in all, up to {listed[-1]})"


@dataclass(frozen=True)
class Timeline:
    """Where a save of ``step`` stands among the root's complete steps.

    Attributes:
        where: the save, as a message names it (the manager's call, the root).
        step_path: the step's checkpoint, described.
        step: the step to save.
        complete: the root's complete steps.
        newer: complete steps newer than ``step`` that the manager's ``load_latest`` skipped as unloadable.
        blocking: complete steps newer than ``step`` that it did not skip.
        replaced: ``step`` itself is complete and one of those skipped: the save replaces it.
    """

    where: str
    step_path: str
    step: int
    complete: tuple[int, ...]
    newer: tuple[int, ...]
    blocking: tuple[int, ...]
    replaced: bool = False

    @classmethod
    def of(
        cls, where: str, step_path: str, complete: Iterable[int], *, step: int, unloadable: Collection[int]
    ) -> Timeline:
        steps = tuple(sorted(complete))
        later = [s for s in steps if s > step]
        return cls(
            where=where,
            step_path=step_path,
            step=step,
            complete=steps,
            newer=tuple(s for s in later if s in unloadable),
            blocking=tuple(s for s in later if s not in unloadable),
            replaced=step in steps and step in unloadable,
        )


def refusal(timeline: Timeline, *, overwrite: bool, rewind: bool) -> str | None:
    """Why a save of ``timeline.step`` must not run, saying the ways out; None when it may: a step older than a
    complete step the manager did not skip as unloadable, without ``rewind``; a complete step again, without
    ``overwrite`` (unless it is a skipped step the save replaces)."""
    step, blocking = timeline.step, timeline.blocking
    exists = step in timeline.complete and not overwrite and not timeline.replaced
    call = f"{timeline.where}: a save of step {step}"
    if blocking and not rewind:
        also = f" and overwrite=True (step {step} is complete already)" if exists else ""
        return (
            f"{call} would go back in time: the root holds newer complete checkpoints, steps {steps_text(blocking)}. "
            f"Resume from the newest, step {blocking[-1]} (CheckpointManager.load_latest), and save a later step; or "
            f"pass rewind=True{also} to save step {step} and then delete every step newer than it "
            f"({steps_text(blocking + timeline.newer)})"
        )
    if exists:
        later = blocking + timeline.newer
        then = f" and then delete the newer steps {steps_text(later)}" if later else ""
        return (
            f"{call}: step {step} is complete already ({timeline.step_path}). Pass overwrite=True to replace it{then}, "
            f"or save a step after the newest, {max(timeline.complete)}"
        )
    return None
