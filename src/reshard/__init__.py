"""reshard: distributed checkpoints that load into any parallel layout.

Save the training state of any layout (each rank describes its pieces as boxes of global tensors) and
load it into any other, reading only the bytes each rank needs. Metadata is JSON, never pickle; a
checkpoint is committed atomically by its ``metadata.json``.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from reshard._moved import install_moved_module_aliases
from reshard._version import __version__

if TYPE_CHECKING:
    from reshard.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointLockedError,
        CheckpointNotFoundError,
        CommunicationError,
        CorruptCheckpointError,
        DataStateError,
        DataUnavailableError,
        IncompleteCheckpointError,
        MismatchError,
        ShardingError,
        StateDictError,
        StorageError,
        UnconfirmedCommitError,
    )
    from reshard.flows.async_save import AsyncCheckpointer, SaveHandle, async_save
    from reshard.flows.certify import CertifyOptions, Checks
    from reshard.flows.load import load, read_metadata
    from reshard.flows.manager import CheckpointManager
    from reshard.flows.nodelocal import NodeLocalCheckpoints
    from reshard.flows.options import LoadOptions, SaveOptions, StagingOptions
    from reshard.flows.peer import PeerMemoryCheckpoint, PeerSaveResult
    from reshard.flows.save import SaveResult, save
    from reshard.flows.stats import LoadStats, SaveStats
    from reshard.flows.tiered import StepStatus, TieredCheckpointManager, TieredSaveResult
    from reshard.flows.tiers import Durable, LocalDisk, PeerMemory
    from reshard.flows.transfer import TransferSession, TransferStats, transfer
    from reshard.metadata import Metadata
    from reshard.state.scaled import ScaledTensor
    from reshard.state.sharding import ShardedObject, ShardedTensor
    from reshard.state.statedict import filter_state_dict

# The public names are imported on first use (PEP 562), so that ``import reshard`` and the command line's
# ``--help`` and ``--version`` do not pay for importing torch.
_PUBLIC_MODULE = {
    "AsyncCheckpointer": "reshard.flows.async_save",
    "CertifyOptions": "reshard.flows.certify",
    "Checks": "reshard.flows.certify",
    "CheckpointError": "reshard.errors",
    "CheckpointExistsError": "reshard.errors",
    "CheckpointLockedError": "reshard.errors",
    "CheckpointManager": "reshard.flows.manager",
    "CheckpointNotFoundError": "reshard.errors",
    "CommunicationError": "reshard.errors",
    "CorruptCheckpointError": "reshard.errors",
    "DataStateError": "reshard.errors",
    "DataUnavailableError": "reshard.errors",
    "Durable": "reshard.flows.tiers",
    "IncompleteCheckpointError": "reshard.errors",
    "LoadOptions": "reshard.flows.options",
    "LocalDisk": "reshard.flows.tiers",
    "LoadStats": "reshard.flows.stats",
    "Metadata": "reshard.metadata",
    "MismatchError": "reshard.errors",
    "NodeLocalCheckpoints": "reshard.flows.nodelocal",
    "PeerMemory": "reshard.flows.tiers",
    "PeerMemoryCheckpoint": "reshard.flows.peer",
    "PeerSaveResult": "reshard.flows.peer",
    "SaveHandle": "reshard.flows.async_save",
    "SaveOptions": "reshard.flows.options",
    "SaveResult": "reshard.flows.save",
    "SaveStats": "reshard.flows.stats",
    "ScaledTensor": "reshard.state.scaled",
    "ShardedObject": "reshard.state.sharding",
    "ShardedTensor": "reshard.state.sharding",
    "ShardingError": "reshard.errors",
    "StagingOptions": "reshard.flows.options",
    "StateDictError": "reshard.errors",
    "StepStatus": "reshard.flows.tiered",
    "StorageError": "reshard.errors",
    "TieredCheckpointManager": "reshard.flows.tiered",
    "TieredSaveResult": "reshard.flows.tiered",
    "TransferSession": "reshard.flows.transfer",
    "TransferStats": "reshard.flows.transfer",
    "UnconfirmedCommitError": "reshard.errors",
    "async_save": "reshard.flows.async_save",
    "filter_state_dict": "reshard.state.statedict",
    "load": "reshard.flows.load",
    "read_metadata": "reshard.flows.load",
    "save": "reshard.flows.save",
    "transfer": "reshard.flows.transfer",
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


install_moved_module_aliases()


logging.getLogger("reshard").addHandler(logging.NullHandler())

__all__ = [
    "AsyncCheckpointer",
    "CertifyOptions",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "Checks",
    "CommunicationError",
    "CorruptCheckpointError",
    "DataStateError",
    "DataUnavailableError",
    "Durable",
    "IncompleteCheckpointError",
    "LoadOptions",
    "LoadStats",
    "LocalDisk",
    "Metadata",
    "MismatchError",
    "NodeLocalCheckpoints",
    "PeerMemory",
    "PeerMemoryCheckpoint",
    "PeerSaveResult",
    "SaveHandle",
    "SaveOptions",
    "SaveResult",
    "SaveStats",
    "ScaledTensor",
    "ShardedObject",
    "ShardedTensor",
    "ShardingError",
    "StagingOptions",
    "StateDictError",
    "StepStatus",
    "StorageError",
    "TieredCheckpointManager",
    "TieredSaveResult",
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
