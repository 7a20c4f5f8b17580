"""The step directories of a :class:`~reshard.flows.manager.CheckpointManager` root: their names
(``step_<step, 9+ digits>``, so that names sort by step) and what each holds (:func:`scan_root`). Not collective."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import warnings
from dataclasses import dataclass
from typing import Any

from reshard.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
)
from reshard.flows.certify import certification_status
from reshard.io.locking import foreign_holder, read_lock, stale_at_sight
from reshard.io.parts import read_parts
from reshard.io.references import is_retired
from reshard.io.sources import read_metadata_bytes
from reshard.metadata import METADATA_FILE, Metadata
from reshard.planning.layouts import PLAN_FILES, PlanFileKind
from reshard.storage import FileTooLargeError, ReadRequest, Storage

__all__ = [
    "LATEST_FILE",
    "StepInfo",
    "check_step",
    "lock_is_live",
    "point_latest_at",
    "scan_root",
    "step_name",
    "step_of",
    "sweep_pointer_temporaries",
]

LATEST_FILE = "latest.json"
_LATEST_TEMPORARY = re.compile(rf"^\.{re.escape(LATEST_FILE)}\.tmp-[0-9a-f]{{32}}$")
"""The temporary of ``latest.json``'s commit (a manager killed while it replaced the pointer leaves one)."""


def _plans_temporary(kind: PlanFileKind) -> re.Pattern[str]:
    """The temporary of a plan cache's commit (:mod:`reshard.flows.plan_cache`; a manager killed while writing it)."""
    return re.compile(rf"^\.{re.escape(kind.name)}\.tmp-[0-9a-f]{{32}}$")


def _is_pointer(pointer: dict[str, Any]) -> bool:
    step = pointer["step"]
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0 and pointer["path"] == step_name(step)


logger = logging.getLogger("reshard")

_STEP = re.compile(r"^step_([0-9]{9,})$")


def step_of(name: str) -> int | None:
    """The step that directory ``name`` holds, or None when it is not a step directory."""
    match = _STEP.match(name)
    return int(match.group(1)) if match is not None else None


def check_step(step: object) -> int:
    """``step``, when it is a step: an ``int`` (not a bool) of at least 0. Not collective.

    Raises:
        ValueError: naming the step (a float, tensor or bool step would otherwise fail deep in a save, differently).
    """
    if isinstance(step, bool) or not isinstance(step, int):
        # ValueError, as every other bad step (negative): the error class callers already handle
        raise ValueError(f"a step is an int of at least 0, got {step!r} ({type(step).__name__})")  # noqa: TRY004
    if step < 0:
        raise ValueError(f"steps are non-negative, got {step}")
    return step


def step_name(step: int) -> str:
    """The directory name of step ``step`` (ValueError naming it when it is not a step: :func:`check_step`)."""
    return f"step_{check_step(step):09d}"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInfo:
    """One step directory of a root: ``status`` is ``complete``, ``incomplete`` (no metadata.json: an
    interrupted save, or one running when ``locked``; ``dead_writer_pid`` names a writer known to be gone),
    ``corrupt`` (metadata.json that does not parse) or ``retired`` (deleted, keeping the data files that other
    checkpoints reference).

    ``tensor_bytes`` counts the tensor data of a complete checkpoint, of which ``referenced_bytes`` lie in
    other checkpoints' files (an incremental save's references); ``content_hashes`` and
    ``checksum_chunk_bytes`` say whether it can be an incremental save's base."""

    step: int
    name: str
    status: str
    locked: bool
    tensor_bytes: int
    world_size: int | None
    problem: str = ""
    referenced_bytes: int = 0
    content_hashes: bool = False
    checksum_chunk_bytes: int | None = None
    referenced_checkpoints: tuple[str, ...] = ()
    """The sibling checkpoints whose data files this one references."""
    dead_writer_pid: int | None = None
    """The process id of the holder of the step's lock when it ran on this host and no longer exists (its save was
    interrupted: ``locked`` is then False, nobody is writing the step), else None."""
    certified: bool = False
    """A complete step whose ``certified.json`` certifies its ``metadata.json`` (:mod:`reshard.flows.certify`)."""
    certification: str = ""
    """Why a complete step is not certified, else ``""``: ``"not checked"`` (saved without checks), ``"its checks
    failed: ..."``, ``"not certified yet (its checks passed)"`` (a hook vetoed, or it awaits ``certify``), or what is
    wrong with its ``certified.json`` or ``checks.json`` (:func:`reshard.flows.certify.certification_status`)."""

    @property
    def written_bytes(self) -> int:
        """Tensor bytes stored in this checkpoint's own files."""
        return self.tensor_bytes - self.referenced_bytes


def scan_root(storage: Storage) -> list[StepInfo]:
    """Every step directory under ``storage``, oldest first, with its status. Not collective."""
    out = []
    for name in storage.list_children():
        step = step_of(name)
        if step is not None:
            out.append(_inspect_step(storage, name, step))
    return sorted(out, key=lambda s: s.step)


def _inspect_step(storage: Storage, name: str, step: int) -> StepInfo:
    child = storage.child(name)
    try:
        holder = read_lock(child)
        dead = holder.pid if holder is not None and holder.holder_is_gone() else None
        locked = holder is not None and dead is None
        if is_retired(child):
            return StepInfo(
                step=step,
                name=name,
                status="retired",
                locked=locked,
                tensor_bytes=0,
                world_size=None,
                dead_writer_pid=dead,
            )
        status, problem = "complete", ""
        metadata = None
        try:
            metadata = Metadata.from_json_bytes(read_metadata_bytes(child), where=child.describe(METADATA_FILE))
            # The parts of partitioned metadata, for the figures only: damaged parts are like damaged data files,
            # which a load or validate finds and a listing does not (it reads metadata.json, as certification).
            with contextlib.suppress(CheckpointError):
                metadata = read_parts(child, metadata)
        except (IncompleteCheckpointError, CheckpointNotFoundError):
            status = "incomplete"
        except CorruptCheckpointError as exc:
            status, problem = "corrupt", str(exc)
        is_certified, why = certification_status(child) if metadata is not None else (False, "")
        return StepInfo(
            step=step,
            name=name,
            status=status,
            certified=is_certified,
            certification=why,
            locked=locked,
            tensor_bytes=metadata.total_bytes if metadata is not None else 0,
            world_size=metadata.world_size if metadata is not None else None,
            problem=problem,
            referenced_bytes=metadata.referenced_bytes if metadata is not None else 0,
            content_hashes=metadata is not None and metadata.content_hashes,
            checksum_chunk_bytes=metadata.checksum_chunk_bytes if metadata is not None else None,
            referenced_checkpoints=metadata.referenced_checkpoints if metadata is not None else (),
            dead_writer_pid=dead,
        )
    finally:
        child.close()


def lock_is_live(root: Storage, name: str) -> bool:
    """On the coordinator: whether step ``name``'s lock holder is live, judged without watching the lock (the other
    ranks wait in a collective meanwhile): a holder of another host always is
    (:func:`reshard.io.locking.stale_at_sight`), so the step is kept for this run, and the log says so."""
    child = root.child(name)
    try:
        holder = read_lock(child)
    finally:
        child.close()
    if holder is None or stale_at_sight(holder):
        return False
    if foreign_holder(holder):
        logger.warning(
            "retention: kept %s: its lock by host %s has not been seen unchanged for the lease yet (a lock of "
            "another host is judged only by watching it on this host's clock; a save over the step, or `reshard "
            "gc`, does)",
            name,
            holder.host,
        )
    return True


def sweep_pointer_temporaries(root: Storage) -> None:
    """On the coordinator, under the manager lock (so that no manager is replacing ``latest.json`` or writing its plan
    cache): delete the temporaries of ``latest.json`` and of the plan cache that managers killed mid-commit left,
    only those whose content is a pointer reshard wrote, or begins as a plan cache does (a file named so that is
    not one stays). One that cannot be read as a regular file (a FIFO, a link, unreadable) is not reshard's either: it
    stays, with a warning, and the sweep goes on (never a reason for retention to fail).

    Raises:
        OSError: listing failed.
    """
    for name in root.list_names(f".{LATEST_FILE}.tmp-"):
        if _LATEST_TEMPORARY.match(name) and _is_latest_temporary(root, name):
            logger.info("retention: removing %s, left by a manager killed while it moved the pointer", name)
            _delete_temporary(root, name)
    for kind in PLAN_FILES:
        pattern = _plans_temporary(kind)
        for name in root.list_names(f".{kind.name}.tmp-"):
            if pattern.match(name) and _is_plans_temporary(root, name, kind):
                logger.info("retention: removing %s, left by a manager killed while it wrote a plan cache", name)
                _delete_temporary(root, name)


def _is_latest_temporary(root: Storage, name: str) -> bool:
    """Whether ``name`` holds a pointer reshard wrote (False: gone, not one, or not readable as a regular file)."""
    try:
        pointer = json.loads(root.read_bytes(name, max_bytes=4096))
    except (FileNotFoundError, FileTooLargeError, ValueError, RecursionError):
        return False
    except OSError as exc:
        _warn_unread_temporary(root, name, exc)
        return False
    return isinstance(pointer, dict) and set(pointer) == {"step", "path"} and _is_pointer(pointer)


def _is_plans_temporary(root: Storage, name: str, kind: PlanFileKind) -> bool:
    """Whether ``name`` begins as reshard's plan cache of ``kind`` does, or is empty (False: gone, another start,
    unreadable)."""
    head = memoryview(bytearray(len(kind.magic)))
    try:
        got = root.read_ranges([ReadRequest(name, 0, head)])[0]
    except FileNotFoundError:
        return False
    except OSError as exc:
        _warn_unread_temporary(root, name, exc)
        return False
    return kind.magic.startswith(bytes(head[:got]))


def _warn_unread_temporary(root: Storage, name: str, exc: OSError) -> None:
    warnings.warn(
        f"reshard: retention leaves {root.describe(name)}, named like a temporary of the manager but not a regular "
        f"file it can read ({exc.strerror or exc}): not reshard's; delete it yourself if it is yours",
        stacklevel=2,
    )


def _delete_temporary(root: Storage, name: str) -> None:
    """Delete a dead manager's temporary; one that cannot be deleted stays, with a warning (a later sweep retries)."""
    try:
        root.delete(name)
    except FileNotFoundError:
        pass
    except OSError as exc:
        warnings.warn(f"reshard: retention could not remove {root.describe(name)}: {exc}", stacklevel=2)


def point_latest_at(root: Storage, step: int) -> None:
    """On the coordinator of a manager, after step ``step`` committed: replace ``latest.json`` (atomically).

    Raises:
        StorageError: the pointer could not be written.
    """
    pointer = json.dumps({"step": step, "path": step_name(step)}).encode()
    try:
        root.commit(LATEST_FILE, pointer, replace=True)
    except OSError as exc:
        raise StorageError(f"updating {root.describe(LATEST_FILE)} failed: {exc}") from exc
