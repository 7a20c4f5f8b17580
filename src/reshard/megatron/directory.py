"""Megatron's files around the strategy's reshard checkpoint, and how a save over an earlier one stays safe.

``dist_checkpointing.save`` writes, in this order: ``common.pt`` (rank 0, ``torch.save`` in place, not synced),
then calls the strategy (here: the reshard checkpoint in ``reshard/``, committed atomically), then writes its
``metadata.json`` (rank 0, in place). ``dist_checkpointing.load`` trusts a directory that has a
``metadata.json`` and reads ``common.pt`` before it calls the strategy. Over an earlier checkpoint, a save
that dies part way would leave the new ``common.pt`` (iteration, arguments, scheduler) beside the old
tensors, under the old ``metadata.json``: a load that succeeds with a mix of two saves. The strategy closes
that (points in save order, each safe whatever rank a kill hits):

1. the strategy starts: rank 0 makes the new ``common.pt`` durable, records its SHA-256 and removes
   Megatron's ``metadata.json`` (:func:`withdraw_config`), so that no reader trusts the directory while it
   changes; the reshard checkpoint it then commits holds the digest (the common value
   :data:`COMMON_PT_ENTRY`);
2. a load checks that ``common.pt`` is the one the reshard checkpoint was committed with
   (:func:`check_common_pt`): a kill between Megatron's ``common.pt`` and step 1 (the old ``metadata.json``
   still there) raises instead of loading a mix;
3. after the reshard commit, rank 0 writes Megatron's ``metadata.json`` atomically (:func:`publish_config`):
   the new save is complete and loadable before Megatron rewrites the same file in place.

A save that fails with an error rather than a kill restores ``metadata.json`` when the committed reshard
checkpoint and ``common.pt`` still belong together (:func:`restore_config`): a refused save that changed
neither leaves the earlier checkpoint loadable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

from reshard.errors import CheckpointError, CheckpointNotFoundError, IncompleteCheckpointError
from reshard.load import read_metadata
from reshard.metadata import Metadata
from reshard.storage import LocalStorage

__all__ = [
    "COMMON_PT_ENTRY",
    "check_common_pt",
    "common_pt_digest",
    "publish_config",
    "restore_config",
    "withdraw_config",
]

logger = logging.getLogger("reshard")

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


def withdraw_config(checkpoint_dir: str | os.PathLike[str]) -> None:
    """Remove Megatron's ``metadata.json`` (durably): ``dist_checkpointing.load`` then refuses the directory."""
    storage = LocalStorage(checkpoint_dir)
    storage.delete(CONFIG_FNAME)
    storage.sync_dir("")


def _config_bytes(backend: str, version: int) -> bytes:
    return json.dumps(dataclasses.asdict(CheckpointingConfig(backend, version))).encode()


def publish_config(checkpoint_dir: str | os.PathLike[str], backend: str, version: int) -> None:
    """Write Megatron's ``metadata.json`` naming ``backend`` and ``version`` atomically (temporary file, fsync,
    rename, directory fsync): the content Megatron's save writes after the strategy returns."""
    LocalStorage(checkpoint_dir).commit(CONFIG_FNAME, _config_bytes(backend, version), replace=True)


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
            f"{where / 'reshard'}. A save over this directory was interrupted after Megatron rewrote common.pt; "
            "loading would mix the common state (iteration, arguments) of one save with the tensors of another"
        )


def restore_config(
    checkpoint_dir: str | os.PathLike[str], reshard_dir: str | os.PathLike[str], backend: str, version: int
) -> None:
    """After a failed save (rank 0): write ``metadata.json`` again if the committed reshard checkpoint and
    ``common.pt`` belong together (the earlier save is then whole and loadable). Best effort; never raises."""
    try:
        stored = read_metadata(reshard_dir)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        return  # no earlier checkpoint of the strategy: nothing to restore
    except (OSError, CheckpointError) as exc:
        logger.warning("after the failed save, %s stays without metadata.json: %s", checkpoint_dir, exc)
        return
    try:
        recorded = stored.common.get(COMMON_PT_ENTRY)
        if recorded is not None and recorded == common_pt_digest(checkpoint_dir):
            publish_config(checkpoint_dir, backend, version)
    except OSError as exc:
        logger.warning("after the failed save, %s stays without metadata.json: %s", checkpoint_dir, exc)
