"""Which boxes an incremental save references, and the proof that the stored copies it references are the
state's bytes.

On each writer of an incremental save (``reshard.save(..., base=...)``), a box assigned to it is referenced
instead of written only when

1. its content hash (XXH3-128 of the bytes it holds) equals the hash the base records for the box in the same
   place (:func:`~reshard.planning.incremental.match_base` sent it), and
2. unless the save trusts its base (``SaveOptions(verify_base=False)``), the copy the base stores reads back as
   bytes of that very hash: the XXH3-128 of the bytes read equals that of the bytes in memory. That is a proof
   that the stored bytes *are* the state's bytes, stronger than the CRC-32C chunks a load checks (which say
   only that the bytes are the ones written then).

Without the second step a base damaged after its commit (a flipped byte, a file replaced by another of the same
size: the sizes a quick check compares stay right) would be referenced, and the new checkpoint, though
committed, would not load; so would every later incremental one. A copy that does not read back so (other
bytes, a missing or unreadable file, a file of another size) is written anew, as a full save would: the new
checkpoint is complete either way, and the writer logs a warning naming the damaged file.

The reads are spread like the writes (each writer reads back only the boxes it would otherwise have written),
read exactly the boxes' byte ranges (ranged GETs on object stores), and stream through one buffer cut from the
save's memory budget: never a whole box or file in memory. They cost a read of every referenced byte on every
save (a LoRA job's frozen base, each time): benchmarks/README.md measures it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from reshard.dtypes import byte_view
from reshard.errors import CheckpointError
from reshard.io.datafile import WRITE_PIECE_BYTES, content_digest
from reshard.io.device import HostSlabs
from reshard.planning.descriptions import WriteAssignment
from reshard.storage import CheckpointLocation, LocalStorage, ReadRequest, Storage, storage_for

__all__ = ["MAX_MAPPED_BYTES", "MAX_READBACK_BYTES", "CopyVerifier", "Reuse", "base_name_of", "choose_reused"]

logger = logging.getLogger("reshard")

MAX_READBACK_BYTES = 64 * 1024 * 1024
"""The read-back buffer of a storage that serves reads concurrently (object stores: its ranged GETs of one fill
run in parallel) takes at most this much of the budget."""

MAX_MAPPED_BYTES = 16 * 1024 * 1024
"""A storage that maps files (local files) is hashed through mapped windows of at most this much of the budget; one
that neither maps nor reads concurrently, through a buffer of :data:`WRITE_PIECE_BYTES`, hashed while it is still
in the CPU's cache."""


class CopyVerifier:
    """Reads stored copies of boxes back through ``storage`` (the new checkpoint's: a file of a sibling
    checkpoint is ``../<holder>/<path>`` there) and says whether they hold given bytes. One per save and rank;
    not thread-safe.

    Memory: one buffer, or one mapped window of a local file (whose pages count in the resident set while
    mapped), of at most a quarter of ``memory_budget_bytes`` (and of :data:`MAX_READBACK_BYTES`), plus what an
    object store holds of answers in flight (at most another quarter).
    """

    def __init__(self, storage: Storage, memory_budget_bytes: int) -> None:
        self.storage = storage
        share = max(1, memory_budget_bytes // 4)
        if storage.supports_mapping:
            cap = MAX_MAPPED_BYTES
        else:
            cap = MAX_READBACK_BYTES if storage.concurrent_reads else WRITE_PIECE_BYTES
        self.buffer_bytes = min(share, cap)
        """The most bytes read (or mapped) and hashed at a time."""
        self.in_flight_bytes = share
        self.bytes_read = 0
        """Bytes read back."""
        self.bytes_verified = 0
        """Bytes read back that hashed as expected."""
        self.seconds = 0.0
        """Time spent reading back and hashing."""
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._sizes: dict[str, int | str] = {}

    def problem(self, name: str, size: int, offset: int, length: int, digest: bytes) -> str | None:
        """None when the ``length`` bytes at ``offset`` of data file ``name`` (whose metadata says it has
        ``size`` bytes) have the XXH3-128 ``digest``; else what is wrong with them. Never raises for the
        storage's errors: a copy that cannot be read is one that cannot be proven."""
        started = time.perf_counter()
        try:
            found = self._size(name)
            if isinstance(found, str):
                return found
            if found != size:
                return f"has {found} bytes, the metadata says {size}"
            if offset + length > size:
                return f"ends at byte {size}, before the end of the box at [{offset}, {offset + length})"
            return self._hash_problem(name, offset, length, digest)
        finally:
            self.seconds += time.perf_counter() - started

    def _size(self, name: str) -> int | str:
        """The file's size (asked once per file), or why it has none."""
        if name not in self._sizes:
            try:
                self._sizes[name] = self.storage.size(name)
            except FileNotFoundError:
                self._sizes[name] = "is missing"
            except OSError as exc:
                self._sizes[name] = f"cannot be read: {exc}"
        return self._sizes[name]

    def _hash_problem(self, name: str, offset: int, length: int, digest: bytes) -> str | None:
        hasher = xxhash.xxh3_128()
        for start in range(0, length, self.buffer_bytes):
            count = min(self.buffer_bytes, length - start)
            try:
                got = self._hash_piece(hasher, name, offset + start, count)
            except OSError as exc:
                return f"cannot be read: {exc}"
            self.bytes_read += got
            if got != count:
                return f"ends at byte {offset + start + got}, inside the box at [{offset}, {offset + length})"
        if hasher.digest() != digest:
            return f"holds other bytes at [{offset}, {offset + length}) than the content hash the base records"
        self.bytes_verified += length
        return None

    def _hash_piece(self, hasher: Any, name: str, offset: int, count: int) -> int:
        """Feed ``count`` bytes at ``offset`` of ``name`` to ``hasher``, through a mapping where the storage maps
        files (hashed in the page cache, no copy: twice as fast as reading into a buffer), else read into the
        buffer; the bytes fed (fewer: the file ends)."""
        mapped = self.storage.map_range(name, offset, count) if self.storage.supports_mapping else None
        if mapped is not None:
            try:
                view = byte_view(mapped.tensor)
                hasher.update(view)
                del view  # release the buffer export, so that the mapping can be closed now
            finally:
                mapped.close()
            return count
        if self._buffer.numel() < count:
            self._buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8)
        view = byte_view(self._buffer)[:count]
        (got,) = self.storage.read_ranges([ReadRequest(name, offset, view)], max_buffered_bytes=self.in_flight_bytes)
        hasher.update(view[:got])
        return int(got)


@dataclass
class Reuse:
    """How one writer's assigned boxes divide (indices into its views)."""

    reused: list[int] = field(default_factory=list)
    """Referenced: the base holds them (and, when verified, they read back as the state's bytes)."""
    to_write: list[int] = field(default_factory=list)
    """Written into this save's data file."""
    rewritten: list[int] = field(default_factory=list)
    """Of ``to_write``, those whose content the base records, but whose stored copy did not read back as it."""
    bytes_read: int = 0
    bytes_verified: int = 0
    seconds: float = 0.0


@dataclass
class _Damaged:
    boxes: int = 0
    nbytes: int = 0
    first: str = ""


def choose_reused(
    storage: Storage,
    assignment: WriteAssignment,
    views: Sequence[torch.Tensor],
    *,
    slabs: HostSlabs,
    memory_budget_bytes: int,
    verify: bool,
    what: Callable[[int], str],
    rank: int,
) -> Reuse:
    """On one writer: which of its assigned boxes (``assignment.tensors``, indices into ``views``) it references
    and which it writes (see the module doc); with ``verify``, reading back the base's copy of each box it would
    reference, and logging a warning per damaged file. ``what(index)`` names a box for the warning; ``slabs``
    stage the bytes in memory that are not plain host bytes while they are hashed. Not collective."""
    out = Reuse()
    verifier = CopyVerifier(storage, memory_budget_bytes) if verify else None
    damaged: dict[str, _Damaged] = {}
    for position, index in enumerate(assignment.tensors):
        base_hash = assignment.base_hash(position)
        if base_hash is None or content_digest(views[index], slabs) != base_hash:
            out.to_write.append(index)
            continue
        if verifier is not None:
            copy = assignment.base_copy(position)
            problem = "its place in the base is unknown" if copy is None else verifier.problem(*copy, base_hash)
            if problem is not None:
                out.to_write.append(index)
                out.rewritten.append(index)
                entry = damaged.setdefault(copy[0] if copy is not None else "?", _Damaged())
                entry.boxes += 1
                entry.nbytes += views[index].nbytes
                entry.first = entry.first or f"{what(index)}: {problem}"
                continue
        out.reused.append(index)
    if verifier is not None:
        out.bytes_read, out.bytes_verified, out.seconds = verifier.bytes_read, verifier.bytes_verified, verifier.seconds
    for name, entry in damaged.items():
        logger.warning(
            "[rank=%d] incremental save into %s: the base's copy of %d box(es) (%d bytes) in data file %s is not the "
            "state's bytes (damaged after its commit?), so they are written into this checkpoint instead of "
            "referenced; first: %s",
            rank,
            storage.describe(),
            entry.boxes,
            entry.nbytes,
            storage.describe(name) if name != "?" else "(unknown)",
            entry.first,
        )
    return out


def base_name_of(storage: Storage, base: CheckpointLocation, storage_options: dict[str, Any] | None = None) -> str:
    """The name of checkpoint ``base`` beside ``storage``: the base of an incremental save into ``storage``, which
    may reference only sibling checkpoints (in the same directory or prefix). Not collective.

    Raises:
        CheckpointError: ``base`` is not a sibling of ``storage``, or is ``storage`` itself.
    """
    base_storage = storage_for(base, storage_options)
    try:
        name = base_storage.name
        sibling = storage.sibling(name)
        try:
            same = _same_place(sibling, base_storage)
        finally:
            sibling.close()
        if not same:
            raise CheckpointError(
                f"the base {base_storage.describe()} of an incremental save must be a sibling of {storage.describe()} "
                "(in the same directory or prefix): references name sibling checkpoints only"
            )
        if _same_place(storage, base_storage):
            raise CheckpointError(f"{storage.describe()} cannot be its own base")
        return name
    finally:
        if base_storage is not base:
            base_storage.close()


def _same_place(a: Storage, b: Storage) -> bool:
    if isinstance(a, LocalStorage) and isinstance(b, LocalStorage):
        return os.path.abspath(a.root) == os.path.abspath(b.root)
    return type(a) is type(b) and a.describe().rstrip("/") == b.describe().rstrip("/")
