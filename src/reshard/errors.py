"""The exceptions reshard raises.

Every error is a :class:`CheckpointError`. Specific errors also derive from the builtin that a caller
would catch without knowing reshard (``FileNotFoundError``, ``ValueError``, ``OSError``...), so existing
``except`` clauses keep working.

When a step fails on some ranks of a group, every rank of the group raises the same class of error with
the same message, naming the failing ranks; :attr:`CheckpointError.failures` maps each failing rank to
its message.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CommunicationError",
    "CorruptCheckpointError",
    "DataStateError",
    "DataUnavailableError",
    "IncompleteCheckpointError",
    "MismatchError",
    "ShardingError",
    "StateDictError",
    "StorageError",
    "UnconfirmedCommitError",
]


class CheckpointError(Exception):
    """Base class of every error reshard raises.

    Attributes:
        failures: for an error agreed across ranks, the message of each failing rank, keyed by its rank
            in the group; empty for an error raised by one process on its own.
    """

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The path does not exist, or holds nothing that looks like a checkpoint."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A complete checkpoint already exists where a save was asked to write (and overwrite is off)."""


class IncompleteCheckpointError(CheckpointError):
    """The path holds checkpoint data but no ``metadata.json``: a save that never committed."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """The checkpoint is committed but damaged or malformed: invalid metadata, a checksum mismatch,
    a truncated or missing data file."""


class ShardingError(CheckpointError, ValueError):
    """The boxes the ranks describe do not form a valid layout: gaps, overlaps, disagreeing dtypes or
    global shapes, or a box claimed as primary by two ranks."""


class MismatchError(CheckpointError, ValueError):
    """The load template does not match the checkpoint: missing keys, other global shapes or dtypes."""


class DataUnavailableError(MismatchError):
    """Parts of the requested tensors are held by no rank of the group: a transfer from ranks that lack
    them, or a peer-memory restore after more failures than its copies survive. The message names them."""


class DataStateError(MismatchError):
    """Data state (a sampler's or data loader's position, RNG streams, a record buffer) cannot be carried to
    the requested layout exactly: state whose global meaning reshard cannot know (an opaque iterator, a
    sampler of unknown order), or parts that disagree (epochs, seeds, dataset sizes, ranks missing). The
    message names the state and what a documented approximation would do instead."""


class StateDictError(CheckpointError, TypeError):
    """The state dict holds a value reshard cannot save (an unsupported type, clashing keys)."""


class CheckpointLockedError(CheckpointError):
    """Another writer holds the checkpoint (or manager root): two saves must not interleave."""


class StorageError(CheckpointError, OSError):
    """Reading or writing the checkpoint's files failed (permissions, a full disk, an I/O error)."""


class CommunicationError(CheckpointError):
    """A collective among the ranks failed: it timed out, or a peer process died."""


class UnconfirmedCommitError(CheckpointError):
    """The checkpoint **was committed and is complete**, but the save could not end in agreement: a rank
    died or lost contact after the commit. Nothing the checkpoint references was deleted; it loads like
    any other. Raised by the coordinator (which committed), and by a rank that lost contact but found the
    committed ``metadata.json`` of its own save; by :meth:`reshard.CheckpointManager.save` on every rank when
    what follows the commit (its lock, ``latest.json``, retention) fails.

    Attributes:
        path: the checkpoint.
        save_id: the save that committed it.
    """

    def __init__(
        self, message: str, *, path: str = "", save_id: str = "", failures: dict[int, str] | None = None
    ) -> None:
        super().__init__(message, failures=failures)
        self.path = path
        self.save_id = save_id


ERROR_CLASSES: dict[str, type[CheckpointError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        CheckpointNotFoundError,
        CheckpointExistsError,
        IncompleteCheckpointError,
        CorruptCheckpointError,
        ShardingError,
        MismatchError,
        DataUnavailableError,
        DataStateError,
        StateDictError,
        StorageError,
        CommunicationError,
        CheckpointLockedError,
        UnconfirmedCommitError,
    )
}
"""Error classes by name, to raise on every rank the class that a failing rank raised."""
