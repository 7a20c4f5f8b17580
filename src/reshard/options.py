"""Option objects of ``save`` and ``load``: small frozen values, one per concern.

Every rank of a group passes equal options; ``save`` checks that its own do agree across ranks (a rank
that passes other ones fails the save on every rank), and validates them in its first collective step,
so that a bad value is an error on every rank, never a hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from reshard.io.reader import DEFAULT_READ_BUFFER_BYTES
from reshard.planning.load_plan import DEFAULT_MAX_READ_AMPLIFICATION

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["DEFAULT_CHECKSUM_CHUNK_BYTES", "LoadOptions", "SaveOptions", "StagingOptions"]

DEFAULT_CHECKSUM_CHUNK_BYTES = 4 * 1024 * 1024
"""Stored bytes are checksummed in pieces of this size, so a partial read can verify what it touches."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions:
    """How a save writes.

    Attributes:
        fingerprint: also store, for every tensor, a layout-independent content fingerprint, so that
            ``load(..., options=LoadOptions(verify=True))`` can check a reshard end to end (an extra pass
            over the data; docs/reliability.md section 9).
        checksum_chunk_bytes: size of the pieces each stored box is checksummed in (a positive integer).
    """

    fingerprint: bool = False
    checksum_chunk_bytes: int = DEFAULT_CHECKSUM_CHUNK_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingOptions:
    """Load through node-local staging: the ranks of each node agree on the whole data files any of them
    needs, each file is downloaded once per node into ``directory`` (a temporary name, then renamed;
    complete files from an earlier run are reused after checking their size and checksums), and all reads
    are then local. For storage that is slow to range-read.

    Attributes:
        directory: the node-local directory.
        keep: keep the staged files after the load (they are removed by default).
        node_group: the process group of the ranks that share ``directory``; default: the ranks with the
            same hostname.
    """

    directory: str | os.PathLike[str]
    keep: bool = False
    node_group: dist.ProcessGroup | None = None

    @property
    def path(self) -> Path:
        return Path(self.directory)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOptions:
    """How a load reads.

    Attributes:
        allow_dtype_cast: convert saved elements to the template's dtype while copying (bf16 <-> fp32,
            fp16 -> fp32, ...); when False a dtype difference raises :class:`~reshard.MismatchError`.
        max_read_amplification: bytes read / bytes needed allowed when merging strided runs into larger
            reads (at least 1.0).
        read_buffer_bytes: the staging memory of this rank's reads that cannot land directly in their
            destination (strided overlaps, dtype conversions); reads are planned in pieces of at most this
            size, so a load's extra memory stays bounded by it whatever the tensor sizes.
        verify: after reading, recompute every tensor's content fingerprint over the primary boxes of this
            layout, combine the partial sums across ranks and compare them with the fingerprints the save
            stored (``SaveOptions(fingerprint=True)``): a wrong copy, a planner bug or a forgery of the data
            raises CorruptCheckpointError naming the tensor, on every rank. Tensors the template does not
            cover whole, or loads with a dtype conversion, cannot be checked (a warning names them).
        staging: load through node-local staging (:class:`StagingOptions`); None reads directly.

    Raises (on construction):
        ValueError: ``max_read_amplification`` below 1.0, or ``read_buffer_bytes`` below 1.
    """

    allow_dtype_cast: bool = True
    max_read_amplification: float = DEFAULT_MAX_READ_AMPLIFICATION
    read_buffer_bytes: int = DEFAULT_READ_BUFFER_BYTES
    verify: bool = False
    staging: StagingOptions | None = None

    def __post_init__(self) -> None:
        if not self.max_read_amplification >= 1.0:
            raise ValueError(f"max_read_amplification must be at least 1.0, got {self.max_read_amplification}")
        if self.read_buffer_bytes < 1:
            raise ValueError(f"read_buffer_bytes must be positive, got {self.read_buffer_bytes}")
