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
   naming the strategy, atomically (:func:`publish_config`), so that from then on every load of the directory
   goes through the strategy's check, whatever checkpoint was there before (another backend's included);
2. a load checks that ``common.pt`` is the one the reshard checkpoint was committed with
   (:func:`check_common_pt`): until the new reshard checkpoint commits, the old one records another digest, and
   a load raises instead of returning a mix; from the commit on, the new save loads whole.

A save refused with an error leaves the earlier checkpoint loadable when Megatron rewrote ``common.pt`` with the
same bytes (a step saved again); otherwise the directory is refused, never loaded as a mix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from megatron.core.dist_checkpointing.core import CONFIG_FNAME, CheckpointingConfig
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

from reshard.errors import IncompleteCheckpointError
from reshard.metadata import Metadata
from reshard.storage import LocalStorage

__all__ = ["COMMON_PT_ENTRY", "check_common_pt", "common_pt_digest", "publish_config"]

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
    config = json.dumps(dataclasses.asdict(CheckpointingConfig(backend, version))).encode()
    LocalStorage(checkpoint_dir).commit(CONFIG_FNAME, config, replace=True)


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
            f"{where / 'reshard'}. A save over this directory was interrupted (or refused) after Megatron "
            "rewrote common.pt; loading would mix the common state (iteration, arguments) of one save with the "
            "tensors of another"
        )
