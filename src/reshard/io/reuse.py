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

from reshard.errors import CheckpointError
from reshard.io.datafile import WRITE_PIECE_BYTES, content_digest
from reshard.io.device import HostSlabs
from reshard.io.referencing import referencing
from reshard.planning.descriptions import WriteAssignment
from reshard.state.dtypes import byte_view
from reshard.storage import CheckpointLocation, LocalStorage, ReadRequest, Storage, storage_for

__all__ = [
    "MAX_MAPPED_BYTES",
    "MAX_READBACK_BYTES",
    "CopyVerifier",
    "Reuse",
    "StoredCopy",
    "base_name_of",
    "choose_reused",
]

logger = logging.getLogger("reshard")

MAX_READBACK_BYTES = 64 * 1024 * 1024
"""The read-back buffer of a storage that serves reads concurrently (object stores: its ranged GETs of one fill
run in parallel) takes at most this much of the budget."""

MAX_MAPPED_BYTES = 16 * 1024 * 1024
"""A storage that maps files (local files) is hashed through mapped windows of at most this much of the budget; one
that neither maps nor reads concurrently, through a buffer of :data:`WRITE_PIECE_BYTES`, hashed while it is still
in the CPU's cache."""


@dataclass(frozen=True, slots=True)
class StoredCopy:
    """The copy a base stores of a box: ``length`` bytes at ``offset`` of data file ``name`` (for the new
    checkpoint's storage: ``../<holder>/<path>``), whose metadata says it has ``size`` bytes; ``digest``: the
    XXH3-128 those bytes must have (the bytes in memory's)."""

    name: str
    size: int
    offset: int
    length: int
    digest: bytes


class CopyVerifier:
    """Reads stored copies of boxes back through ``storage`` (the new checkpoint's) and says whether they hold
    the bytes of given digests. One per save and rank; not thread-safe.

    How it reads: a local file through mapped windows (hashed in the page cache, no copy: twice as fast as
    reading into a buffer); an object store in batches of whole boxes, one ranged GET per run of neighbouring
    boxes of one file (gaps cheaper to read than another request are read too), the batch's GETs in flight
    together; a box larger than the buffer piece by piece.

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
        """Bytes read back (with the gaps between boxes read in one request)."""
        self.bytes_verified = 0
        """Bytes of copies that hashed as expected."""
        self.seconds = 0.0
        """Time spent reading back and hashing."""
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._sizes: dict[str, int | str] = {}

    def problems(self, copies: Sequence[StoredCopy]) -> list[str | None]:
        """For each copy, None when its bytes have its digest, else what is wrong with them (another size of
        its file, other bytes, a read that failed). Never raises for the storage's errors: a copy that cannot be
        read is one that cannot be proven."""
        started = time.perf_counter()
        try:
            out: list[str | None] = [None] * len(copies)
            batched = []
            for i, copy in enumerate(copies):
                out[i] = self._place_problem(copy)
                if out[i] is not None:
                    continue
                if (
                    self.storage.concurrent_reads
                    and not self.storage.supports_mapping
                    and copy.length <= self.buffer_bytes
                ):
                    batched.append(i)
                else:
                    out[i] = self._hash_problem(copy)
            for batch in self._batches(copies, batched):
                self._verify_batch(copies, batch, out)
            return out
        finally:
            self.seconds += time.perf_counter() - started

    def _place_problem(self, copy: StoredCopy) -> str | None:
        """Why the copy cannot be where the metadata says, before any of it is read (its file's size is asked
        once per file)."""
        if copy.name not in self._sizes:
            try:
                self._sizes[copy.name] = self.storage.size(copy.name)
            except FileNotFoundError:
                self._sizes[copy.name] = "is missing"
            except OSError as exc:
                self._sizes[copy.name] = f"cannot be read: {exc}"
        found = self._sizes[copy.name]
        if isinstance(found, str):
            return found
        if found != copy.size:
            return f"has {found} bytes, the metadata says {copy.size}"
        if copy.offset + copy.length > copy.size:
            return (
                f"ends at byte {copy.size}, before the end of the box at [{copy.offset}, {copy.offset + copy.length})"
            )
        return None

    def _hash_problem(self, copy: StoredCopy) -> str | None:
        """One copy, read (or mapped) and hashed a piece at a time."""
        hasher = xxhash.xxh3_128()
        for start in range(0, copy.length, self.buffer_bytes):
            count = min(self.buffer_bytes, copy.length - start)
            try:
                got = self._hash_piece(hasher, copy.name, copy.offset + start, count)
            except OSError as exc:
                return f"cannot be read: {exc}"
            self.bytes_read += got
            if got != count:
                return f"ends at byte {copy.offset + start + got}, inside the box at {_span(copy)}"
        return self._compare(copy, hasher.digest())

    def _compare(self, copy: StoredCopy, digest: bytes) -> str | None:
        if digest != copy.digest:
            return f"holds other bytes at {_span(copy)} than the content hash the base records"
        self.bytes_verified += copy.length
        return None

    def _hash_piece(self, hasher: Any, name: str, offset: int, count: int) -> int:
        """Feed ``count`` bytes at ``offset`` of ``name`` to ``hasher`` (mapped where the storage maps files,
        else read into the buffer); the bytes fed (fewer: the file ends)."""
        mapped = self.storage.map_range(name, offset, count) if self.storage.supports_mapping else None
        if mapped is not None:
            try:
                view = byte_view(mapped.tensor)
                hasher.update(view)
                del view  # release the buffer export, so that the mapping can be closed now
            finally:
                mapped.close()
            return count
        view = self._view(count)
        (got,) = self.storage.read_ranges([ReadRequest(name, offset, view)], max_buffered_bytes=self.in_flight_bytes)
        hasher.update(view[:got])
        return int(got)

    def _view(self, count: int) -> memoryview:
        if self._buffer.numel() < count:
            self._buffer = torch.empty(self.buffer_bytes, dtype=torch.uint8)
        return byte_view(self._buffer)[:count]

    def _batches(self, copies: Sequence[StoredCopy], indices: list[int]) -> list[list[list[int]]]:
        """``indices`` (copies no larger than the buffer) in batches that fit the buffer, each batch a list of
        runs: neighbouring copies of one file, in file order, read by one request (a gap between two is read
        when it costs less than another request, ``Storage.request_cost_bytes``)."""
        order = sorted(indices, key=lambda i: (copies[i].name, copies[i].offset))
        runs: list[list[int]] = []
        start = end = 0
        for i in order:
            copy = copies[i]
            stop = copy.offset + copy.length
            if (
                runs
                and copies[runs[-1][0]].name == copy.name
                and copy.offset - end <= self.storage.request_cost_bytes
                and max(end, stop) - start <= self.buffer_bytes
            ):
                runs[-1].append(i)
                end = max(end, stop)
            else:
                runs.append([i])
                start, end = copy.offset, stop
        batches: list[list[list[int]]] = []
        filled = self.buffer_bytes
        for run in runs:
            length = _run_end(copies, run) - copies[run[0]].offset
            if filled + length > self.buffer_bytes:
                batches.append([])
                filled = 0
            batches[-1].append(run)
            filled += length
        return batches

    def _verify_batch(self, copies: Sequence[StoredCopy], runs: list[list[int]], out: list[str | None]) -> None:
        """Read the runs of one batch together and compare each copy in them; where the batch's read fails,
        each copy is read again alone, so that the failure is told apart from the others."""
        lengths = [_run_end(copies, run) - copies[run[0]].offset for run in runs]
        buffer = self._view(sum(lengths))
        requests, at = [], 0
        for run, length in zip(runs, lengths, strict=True):
            requests.append(ReadRequest(copies[run[0]].name, copies[run[0]].offset, buffer[at : at + length]))
            at += length
        try:
            got = self.storage.read_ranges(requests, max_buffered_bytes=self.in_flight_bytes)
        except OSError:
            for run in runs:
                for i in run:
                    out[i] = self._hash_problem(copies[i])
            return
        self.bytes_read += sum(got)
        for run, request, count in zip(runs, requests, got, strict=True):
            for i in run:
                copy = copies[i]
                lo = copy.offset - request.offset
                if lo + copy.length > count:
                    out[i] = f"ends at byte {request.offset + count}, inside the box at {_span(copy)}"
                else:
                    out[i] = self._compare(copy, xxhash.xxh3_128_digest(request.buffer[lo : lo + copy.length]))


def _run_end(copies: Sequence[StoredCopy], run: list[int]) -> int:
    return max(copies[i].offset + copies[i].length for i in run)


def _span(copy: StoredCopy) -> str:
    return f"[{copy.offset}, {copy.offset + copy.length})"


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
    (the save's host slabs) carry the bytes in memory that are not plain host bytes while they are hashed. Not
    collective."""
    base = referencing(storage)  # the base's copies are named by their locations (reshard.io.referencing)
    try:
        return _choose(base, assignment, views, slabs, memory_budget_bytes, verify, what, rank)
    finally:
        if base is not storage:
            base.close()  # the siblings it opened; ``storage`` is the save's


def _choose(
    storage: Storage,
    assignment: WriteAssignment,
    views: Sequence[torch.Tensor],
    slabs: HostSlabs,
    memory_budget_bytes: int,
    verify: bool,
    what: Callable[[int], str],
    rank: int,
) -> Reuse:
    """:func:`choose_reused` on ``storage`` that reads the base's copies by their locations."""
    candidates: list[tuple[int, int, bytes]] = []  # (position, index, digest) of the boxes the base holds alike
    for position, index in enumerate(assignment.tensors):
        base_hash = assignment.base_hash(position)
        if base_hash is not None and content_digest(views[index], slabs) == base_hash:
            candidates.append((position, index, base_hash))
    problems: dict[int, tuple[str, str]] = {}  # index: (file, problem)
    out = Reuse()
    if verify and candidates:
        verifier = CopyVerifier(storage, memory_budget_bytes)
        places = [(index, assignment.base_copy(position), digest) for position, index, digest in candidates]
        checked = [(index, StoredCopy(*place, digest)) for index, place, digest in places if place is not None]
        problems.update({index: ("?", "its place in the base is unknown") for index, place, _ in places if not place})
        for (index, copy), problem in zip(checked, verifier.problems([c for _, c in checked]), strict=True):
            if problem is not None:
                problems[index] = (copy.name, problem)
        out.bytes_read, out.bytes_verified, out.seconds = verifier.bytes_read, verifier.bytes_verified, verifier.seconds
    reusable = {index for _, index, _ in candidates} - set(problems)
    for index in assignment.tensors:
        (out.reused if index in reusable else out.to_write).append(index)
    out.rewritten = [index for index in out.to_write if index in problems]
    _warn(storage, rank, {index: problems[index] for index in out.rewritten}, views, what)
    return out


def _warn(
    storage: Storage,
    rank: int,
    problems: dict[int, tuple[str, str]],
    views: Sequence[torch.Tensor],
    what: Callable[[int], str],
) -> None:
    """One warning per data file whose copies did not read back as the state's bytes."""
    by_file: dict[str, list[int]] = {}
    for index, (name, _) in problems.items():
        by_file.setdefault(name, []).append(index)
    for name, indices in by_file.items():
        logger.warning(
            "[rank=%d] incremental save into %s: the base's copy of %d box(es) (%d bytes) in data file %s is not the "
            "state's bytes (damaged after its commit?), so they are written into this checkpoint instead of "
            "referenced; first: %s: %s",
            rank,
            storage.describe(),
            len(indices),
            sum(views[i].nbytes for i in indices),
            storage.describe(name) if name != "?" else "(unknown)",
            what(indices[0]),
            problems[indices[0]][1],
        )


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
