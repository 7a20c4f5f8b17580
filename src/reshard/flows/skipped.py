"""The steps a :class:`~reshard.flows.manager.CheckpointManager`'s ``load_latest`` skipped as unloadable, and
whether they still are when a later save would go past them (and delete them).

``load_latest`` remembers each skipped step with the identity of the save it failed to load (a digest of that
step's ``metadata.json`` as the listing read it, before the load). A step is *still skipped* only while its
``metadata.json`` is byte for byte that same document and the checkpoint still fails its checks (every file
present, of its recorded size, and every checksum: :func:`reshard.flows.maintenance.validate_checkpoint`, the
checks whose failure made the load fail). Anything else (another save wrote the step, or a data file that was
away is back) is a complete step like any other: it counts as newer, and nothing deletes it. The judgment runs on
the coordinator only (it alone lists and deletes), so every rank acts on one answer. A step a resume skipped as
not certified (``SkippedStep.uncertified``) is still skipped while it is that save and still has no valid
certificate.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from reshard.errors import CheckpointError
from reshard.flows.certify import certificate_status
from reshard.flows.maintenance import validate_checkpoint
from reshard.flows.steps import step_name
from reshard.io.sources import read_metadata_bytes
from reshard.storage import Storage

__all__ = ["SkippedStep", "metadata_digest", "still_skipped"]


@dataclass(frozen=True, slots=True)
class SkippedStep:
    """A complete step that ``load_latest`` failed to load: ``digest`` is :func:`metadata_digest` of it when it was
    listed (None: unknown on this rank; only the coordinator's record is judged). ``uncertified``: it loads, but a
    resume that prefers certified steps skipped it as not certified (a tiered restore): it is still skipped while it
    is that save and still not certified."""

    step: int
    digest: str | None
    uncertified: bool = False


def metadata_digest(checkpoint: Storage) -> str | None:
    """The SHA-256 of ``checkpoint``'s ``metadata.json`` (it names the save: its id, its files), or None when it
    cannot be read. Not collective."""
    try:
        return hashlib.sha256(read_metadata_bytes(checkpoint)).hexdigest()
    except (OSError, CheckpointError):
        return None


def still_skipped(root: Storage, skipped: SkippedStep) -> str | None:
    """On the coordinator: why step ``skipped.step`` under ``root`` is still the unloadable save that
    ``load_latest`` skipped (its first problem), or None when it is not (another save, or none, is there now, or it
    passes its checks again): then it must not be deleted. Reads every byte of the step."""
    if skipped.digest is None:
        return None
    child = root.child(step_name(skipped.step))
    try:
        if metadata_digest(child) != skipped.digest:
            return None
        if skipped.uncertified:
            certificate, why = certificate_status(child)
            return None if certificate is not None else why
        try:
            problems = validate_checkpoint(child)
        except CheckpointError as exc:
            problems = [str(exc)]
        return problems[0] if problems else None
    finally:
        child.close()
