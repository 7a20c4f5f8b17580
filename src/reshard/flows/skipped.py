"""The steps a :class:`~reshard.flows.manager.CheckpointManager`'s ``load_latest`` skipped as unloadable, and
whether they still are when a later save would go past them (and delete them).

``load_latest`` remembers each skipped step with the identity of the save it failed to load (a digest of that
step's ``metadata.json`` as the listing read it, before the load). A step is *still skipped* only while its
``metadata.json`` is byte for byte that same document and the checkpoint still fails its checks (every file
present, of its recorded size, and every checksum: :func:`reshard.flows.maintenance.validate_checkpoint`, the
checks whose failure made the load fail). Anything else (another save wrote the step, or a data file that was
away is back) is a complete step like any other: it counts as newer, and nothing deletes it. The judgment runs on
the coordinator only (it alone lists and deletes), so every rank acts on one answer.

A manager that certifies skips the complete steps newer than the newest certified one (not recovery points); they
are skipped steps too (``uncertified``): still skipped while their ``metadata.json`` is that same document and
they are still not certified, so that a job resumed from an older certified step saves on past them (and saves
their steps again) without ``rewind``, as past a damaged step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import CheckpointError
from reshard.flows.certify import certification_status
from reshard.flows.maintenance import validate_checkpoint
from reshard.flows.steps import StepInfo, step_name
from reshard.io.sources import read_metadata_bytes
from reshard.metadata import document_digest
from reshard.storage import Storage

__all__ = ["SkippedStep", "metadata_digest", "step_digest", "still_skipped", "uncertified_skipped"]


@dataclass(frozen=True, slots=True)
class SkippedStep:
    """A complete step that ``load_latest`` failed to load: ``digest`` is :func:`metadata_digest` of it when it was
    listed (None: unknown on this rank; only the coordinator's record is judged); ``uncertified``: skipped as not
    certified (loadable), not as unloadable."""

    step: int
    digest: str | None
    uncertified: bool = False


def uncertified_skipped(listed: Sequence[Sequence[Any]], kept: Sequence[Sequence[Any]]) -> list[SkippedStep]:
    """The complete steps of a manager's ``load_latest`` candidates ``listed`` (``[step, status, problem, digest,
    ...]``) that preferring certified steps dropped (``kept``: those left) as not certified."""
    left = {entry[0] for entry in kept}
    return [
        SkippedStep(entry[0], entry[3], uncertified=True)
        for entry in listed
        if entry[1] == "complete" and entry[0] not in left
    ]


def metadata_digest(checkpoint: Storage) -> str | None:
    """The SHA-256 of ``checkpoint``'s ``metadata.json`` (it names the save: its id, its files), or None when it
    cannot be read. Not collective."""
    try:
        return document_digest(read_metadata_bytes(checkpoint))
    except (OSError, CheckpointError):
        return None


def step_digest(root: Storage, info: StepInfo) -> str | None:
    """The identity of a complete step's save in ``root`` as a listing of the steps shows it (None: not complete)."""
    if info.status != "complete":
        return None
    child = root.child(info.name)
    try:
        return metadata_digest(child)
    finally:
        child.close()


def still_skipped(root: Storage, skipped: SkippedStep) -> str | None:
    """On the coordinator: why step ``skipped.step`` under ``root`` is still the unloadable save that
    ``load_latest`` skipped (its first problem), or None when it is not (another save, or none, is there now, or it
    passes its checks again, or, skipped as not certified, it is certified now): then it must not be deleted. Reads
    every byte of an unloadable step."""
    if skipped.digest is None:
        return None
    child = root.child(step_name(skipped.step))
    try:
        if metadata_digest(child) != skipped.digest:
            return None
        if skipped.uncertified:  # loadable: skipped while it is still not a recovery point
            is_certified, why = certification_status(child)
            return None if is_certified else f"it is not certified ({why})"
        try:
            problems = validate_checkpoint(child)
        except CheckpointError as exc:
            problems = [str(exc)]
        return problems[0] if problems else None
    finally:
        child.close()
