"""reshard: distributed checkpoints that load into any parallel layout.

Save the training state of any layout (each rank describes its pieces as boxes of global tensors) and
load it into any other, reading only the bytes each rank needs. Metadata is JSON, never pickle; a
checkpoint is committed atomically by its ``metadata.json``.
"""

from __future__ import annotations

import logging

from reshard._version import __version__
from reshard.async_save import AsyncCheckpointer, SaveHandle, async_save
from reshard.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    CommunicationError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MismatchError,
    ShardingError,
    StateDictError,
    StorageError,
    UnconfirmedCommitError,
)
from reshard.load import LoadStats, load, read_metadata
from reshard.manager import CheckpointManager
from reshard.metadata import Metadata
from reshard.options import LoadOptions, SaveOptions, StagingOptions
from reshard.save import SaveResult, save
from reshard.sharding import ShardedObject, ShardedTensor
from reshard.statedict import filter_state_dict
from reshard.stats import SaveStats

logging.getLogger("reshard").addHandler(logging.NullHandler())

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CommunicationError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "LoadOptions",
    "LoadStats",
    "Metadata",
    "MismatchError",
    "SaveHandle",
    "SaveOptions",
    "SaveResult",
    "SaveStats",
    "ShardedObject",
    "ShardedTensor",
    "ShardingError",
    "StagingOptions",
    "StateDictError",
    "StorageError",
    "UnconfirmedCommitError",
    "__version__",
    "async_save",
    "filter_state_dict",
    "load",
    "read_metadata",
    "save",
]
