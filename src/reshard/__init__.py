"""reshard: distributed checkpoints that load into any parallel layout.

Save the training state of any layout (each rank describes its pieces as boxes of global tensors) and
load it into any other, reading only the bytes each rank needs. Metadata is JSON, never pickle; a
checkpoint is committed atomically by its ``metadata.json``.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

from reshard._version import __version__

if TYPE_CHECKING:
    from reshard.async_save import AsyncCheckpointer, SaveHandle, async_save
    from reshard.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointLockedError,
        CheckpointNotFoundError,
        CommunicationError,
        CorruptCheckpointError,
        DataUnavailableError,
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
    from reshard.peer import PeerMemoryCheckpoint, PeerSaveResult
    from reshard.save import SaveResult, save
    from reshard.sharding import ShardedObject, ShardedTensor
    from reshard.statedict import filter_state_dict
    from reshard.stats import SaveStats
    from reshard.transfer import TransferSession, TransferStats, transfer

# The public names are imported on first use (PEP 562), so that ``import reshard`` and the command line's
# ``--help`` and ``--version`` do not pay for importing torch.
_PUBLIC_MODULE = {
    "AsyncCheckpointer": "reshard.async_save",
    "CheckpointError": "reshard.errors",
    "CheckpointExistsError": "reshard.errors",
    "CheckpointLockedError": "reshard.errors",
    "CheckpointManager": "reshard.manager",
    "CheckpointNotFoundError": "reshard.errors",
    "CommunicationError": "reshard.errors",
    "CorruptCheckpointError": "reshard.errors",
    "DataUnavailableError": "reshard.errors",
    "IncompleteCheckpointError": "reshard.errors",
    "LoadOptions": "reshard.options",
    "LoadStats": "reshard.load",
    "Metadata": "reshard.metadata",
    "MismatchError": "reshard.errors",
    "PeerMemoryCheckpoint": "reshard.peer",
    "PeerSaveResult": "reshard.peer",
    "SaveHandle": "reshard.async_save",
    "SaveOptions": "reshard.options",
    "SaveResult": "reshard.save",
    "SaveStats": "reshard.stats",
    "ShardedObject": "reshard.sharding",
    "ShardedTensor": "reshard.sharding",
    "ShardingError": "reshard.errors",
    "StagingOptions": "reshard.options",
    "StateDictError": "reshard.errors",
    "StorageError": "reshard.errors",
    "TransferSession": "reshard.transfer",
    "TransferStats": "reshard.transfer",
    "UnconfirmedCommitError": "reshard.errors",
    "async_save": "reshard.async_save",
    "filter_state_dict": "reshard.statedict",
    "load": "reshard.load",
    "read_metadata": "reshard.load",
    "save": "reshard.save",
    "transfer": "reshard.transfer",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC_MODULE.get(name)
    if module is None:
        raise AttributeError(f"module 'reshard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC_MODULE))


class _Package(types.ModuleType):
    """The package object: keeps ``reshard.save``, ``reshard.load``, ``reshard.async_save`` and
    ``reshard.transfer`` the functions.

    Importing a submodule sets the package's attribute of that name to the submodule; these public
    functions share their module's name, so a submodule imported before the function was asked for would
    otherwise shadow it.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _PUBLIC_MODULE.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


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
    "DataUnavailableError",
    "IncompleteCheckpointError",
    "LoadOptions",
    "LoadStats",
    "Metadata",
    "MismatchError",
    "PeerMemoryCheckpoint",
    "PeerSaveResult",
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
    "TransferSession",
    "TransferStats",
    "UnconfirmedCommitError",
    "__version__",
    "async_save",
    "filter_state_dict",
    "load",
    "read_metadata",
    "save",
    "transfer",
]
