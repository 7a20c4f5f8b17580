"""Megatron's files around the strategy's reshard checkpoint, and how a save over an earlier one stays safe.

``dist_checkpointing.save`` writes, in this order: ``common.pt`` (rank 0, ``torch.save`` in place, not synced),
then calls the strategy (here: the reshard checkpoint in ``reshard/``, committed atomically), then writes its
``metadata.json`` (rank 0, in place). ``dist_checkpointing.load`` trusts a directory that has a
``metadata.json`` and reads ``common.pt`` before it calls the strategy. Over an earlier checkpoint, a save
that dies part way would leave the new ``common.pt`` (iteration, arguments, scheduler) beside the old
tensors, under the old ``metadata.json``: a load that succeeds with a mix of two saves. The strategy ties
``common.pt`` to the reshard checkpoint instead:

1. when the strategy starts, rank 0 makes the new ``common.pt`` durable, records its SHA-256 (the common value
   :data:`COMMON_PT_ENTRY` of the reshard checkpoint it then commits) and writes Megatron's ``metadata.json``
   naming the strategy, atomically (:func:`repoint`, which keeps what it replaced), so that from then on every
   load of the directory goes through the strategy's check, whatever checkpoint was there before (another
   backend's included);
2. a load checks that ``common.pt`` is the one the reshard checkpoint was committed with
   (:func:`check_common_pt`): until the new reshard checkpoint commits, the old one records another digest, and
   a load raises instead of returning a mix; from the commit on, the new save loads whole.

A save that the strategy refuses (an error every rank raises, before the reshard checkpoint commits) leaves
Megatron's ``metadata.json`` as it was where that cannot make a mix loadable (:func:`put_back`): in a directory
that had none (it is removed), and over an earlier reshard-strategy checkpoint (whose digest refuses the
``common.pt`` Megatron wrote for the refused save, unless it has the same bytes). Over a checkpoint of another
backend (Megatron's ``torch_dist``), which records no digest, ``metadata.json`` keeps naming the strategy, whose
load refuses the directory (:func:`check_started`): Megatron has already replaced that checkpoint's
``common.pt``, and nothing can tell whether the new one still belongs to the old tensors, so putting the old
``metadata.json`` back would let Megatron's load return the new iteration and arguments with the old tensors.
A save that dies part way leaves ``metadata.json`` naming the strategy, whose load refuses what it did not
commit whole.

What the strategy cannot reach: Megatron writes ``common.pt`` before it calls any strategy, so a save that dies
before the strategy starts leaves the new ``common.pt`` under the earlier ``metadata.json``. Over a
reshard-strategy checkpoint the digest refuses it; over one of another backend (Megatron's ``torch_dist``), that
backend's load reads the mix, exactly as after the same death in a save with Megatron's own strategies.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

from reshard.errors import IncompleteCheckpointError, StorageError
from reshard.io.retirement import remove_checkpoint
from reshard.metadata import METADATA_FILE, Metadata
from reshard.storage import LocalStorage

__all__ = [
    "COMMON_PT_ENTRY",
    "RESHARD_SUBDIR",
    "Repointed",
    "check_common_pt",
    "check_started",
    "common_pt_digest",
    "publish_config",
    "put_back",
    "repoint",
]

RESHARD_SUBDIR = "reshard"
"""Where in a Megatron checkpoint directory the strategy keeps the reshard checkpoint."""

MAX_CONFIG_BYTES = 1 << 20
"""The largest Megatron ``metadata.json`` the strategy keeps to put back (Megatron's holds a few names)."""

COMMON_PT_ENTRY = "__megatron_common_pt__"
"""The common value of the strategy's reshard checkpoint that holds ``"sha256:<hex>"`` of the ``common.pt`` it
was saved with (``""``: there was none, the strategy was called without Megatron's save)."""


def common_pt_digest(checkpoint_dir: str | os.PathLike[str], *, durable: bool = False) -> str:
    """``"sha256:<hex>"`` of ``checkpoint_dir/common.pt``, ``""`` when there is none. ``durable``: fsync it
    first (Megatron's ``torch.save`` does not)."""
    path = Path(checkpoint_dir) / COMMON_STATE_FNAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return ""
    digest = hashlib.sha256()
    try:
        if durable:
            os.fsync(fd)
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
    finally:
        os.close(fd)
    return f"sha256:{digest.hexdigest()}"


def publish_config(checkpoint_dir: str | os.PathLike[str], backend: str, version: int) -> None:
    """Write Megatron's ``metadata.json`` naming ``backend`` and ``version`` atomically (temporary file, fsync,
    rename, directory fsync, which also makes ``common.pt``'s entry durable): what Megatron's save writes in
    place after the strategy returns."""
    LocalStorage(checkpoint_dir).commit(CONFIG_FNAME, _config_bytes(backend, version), replace=True)


def _config_bytes(backend: str, version: int) -> bytes:
    return json.dumps(dataclasses.asdict(CheckpointingConfig(backend, version))).encode()


@dataclasses.dataclass(frozen=True)
class Repointed:
    """What :func:`repoint` found in the directory before it pointed ``metadata.json`` at the strategy: what
    :func:`put_back` restores after a refused save."""

    config: bytes | None
    """Megatron's ``metadata.json`` as it was (None: there was none)."""
    published: bytes
    """The ``metadata.json`` :func:`repoint` wrote in its place."""
    committed: tuple[int, int, int, int] | None
    """The identity of ``reshard/metadata.json`` then (device, inode, size, modification time in ns; None:
    there was none): another one afterwards means that a reshard checkpoint may have committed since."""


def repoint(checkpoint_dir: str | os.PathLike[str], backend: str, version: int) -> Repointed:
    """Point Megatron's ``metadata.json`` at ``backend``/``version`` (:func:`publish_config`); what was there
    before. On rank 0, when the strategy starts."""
    storage = LocalStorage(checkpoint_dir)
    try:
        config: bytes | None = storage.read_bytes(CONFIG_FNAME, max_bytes=MAX_CONFIG_BYTES)
    except FileNotFoundError:
        config = None
    if config is not None and _backend_of(config) != backend:
        _remove_superseded(checkpoint_dir)
    before = Repointed(config, _config_bytes(backend, version), _identity(checkpoint_dir))
    publish_config(checkpoint_dir, backend, version)
    return before


def _remove_superseded(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Remove the reshard checkpoint in ``checkpoint_dir/reshard`` that a save of another backend superseded
    (Megatron's ``metadata.json`` names that backend, whose save leaves ``reshard/`` alone): before the directory
    is pointed at the strategy again, so that no load through it can find that older save, whose ``common.pt``
    may even have the bytes of the one Megatron has just written (a step saved again), and return it in place of
    the newer save of the other backend. Under the checkpoint's save lock, as retention removes a checkpoint
    (:func:`reshard.io.retirement.remove_checkpoint`)."""
    reshard_dir = Path(checkpoint_dir) / RESHARD_SUBDIR
    if not (reshard_dir / METADATA_FILE).is_file():
        return
    try:
        remove_checkpoint(LocalStorage(reshard_dir))
    except OSError as exc:
        raise StorageError(f"cannot remove the superseded reshard checkpoint in {reshard_dir}: {exc}") from exc


def put_back(checkpoint_dir: str | os.PathLike[str], before: Repointed) -> bool:
    """Undo :func:`repoint` after a save that raised before its reshard checkpoint committed: Megatron's
    ``metadata.json`` as it was, atomically (removed, and the directory synced, where there was none). Nothing
    is changed when ``reshard/metadata.json`` is not the one :func:`repoint` saw (a reshard checkpoint may have
    committed since: ``metadata.json`` keeps naming the strategy, whose load checks ``common.pt``), nor when it
    named another backend (see the module doc: the strategy's load refuses the directory, never a mix). On
    rank 0. Whether ``metadata.json`` is as it was."""
    if _identity(checkpoint_dir) != before.committed:
        return False
    if before.config == before.published:
        return True
    if before.config is not None and _backend_of(before.config) != _backend_of(before.published):
        return False  # another backend's checkpoint, whose common.pt Megatron replaced: refused, never a mix
    storage = LocalStorage(checkpoint_dir)
    if before.config is None:
        storage.delete(CONFIG_FNAME)
        storage.sync_dir("")
    else:
        storage.commit(CONFIG_FNAME, before.config, replace=True)
    return True


def _backend_of(config: bytes) -> object:
    """The ``sharded_backend`` a Megatron ``metadata.json`` names (None: unreadable)."""
    try:
        doc = json.loads(config)
    except ValueError:
        return None
    return doc.get("sharded_backend") if isinstance(doc, dict) else None


def _identity(checkpoint_dir: str | os.PathLike[str]) -> tuple[int, int, int, int] | None:
    """The identity of the strategy's committed ``reshard/metadata.json`` (None: there is none). A commit
    renames or links a new file into place, so a commit changes it."""
    try:
        found = os.stat(Path(checkpoint_dir) / RESHARD_SUBDIR / METADATA_FILE, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)


def check_started(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Called when there is no reshard checkpoint in ``checkpoint_dir/reshard``: refuse a directory whose
    Megatron ``metadata.json`` is there while ``reshard/`` is not as an interrupted save (the strategy points
    ``metadata.json`` at itself before it writes anything there), not as a path that does not exist.

    Raises:
        IncompleteCheckpointError: ``metadata.json`` is there, ``reshard/`` is not.
    """
    where = Path(checkpoint_dir)
    if (where / CONFIG_FNAME).is_file() and not os.path.lexists(where / RESHARD_SUBDIR):
        raise IncompleteCheckpointError(
            f"{where / CONFIG_FNAME} is there but {where / RESHARD_SUBDIR} is not: a save with the reshard strategy "
            "was interrupted (or refused) after it pointed Megatron's metadata.json at itself and before it wrote its "
            "checkpoint "
            "(the checkpoint that was in the directory before, if any, is no longer loadable from it)"
        )


def check_common_pt(checkpoint_dir: str | os.PathLike[str], stored: Metadata) -> None:
    """Check that ``common.pt`` is the one the reshard checkpoint (``stored``) was committed with. A checkpoint
    saved before the strategy recorded the digest is not checked.

    Raises:
        IncompleteCheckpointError: another ``common.pt`` (or none, or one where there was none).
    """
    recorded = stored.common.get(COMMON_PT_ENTRY)
    if recorded is None:
        return
    found = common_pt_digest(checkpoint_dir)
    if found != recorded:
        where = Path(checkpoint_dir)
        state = "is missing" if not found else ("should not be there" if not recorded else "is another one")
        raise IncompleteCheckpointError(
            f"{where / COMMON_STATE_FNAME} {state}: it does not belong to the sharded checkpoint in "
            f"{where / RESHARD_SUBDIR}. A save over this directory was interrupted (or refused) after Megatron "
            "rewrote common.pt; loading would mix the common state (iteration, arguments) of one save with the "
            "tensors of another"
        )
