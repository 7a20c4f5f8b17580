"""The byte moves of node-local checkpoints (:mod:`reshard.flows.nodelocal`): what a node holds of a step, the
file exchange of a restore, and the verified copy of a drain.

Every copy is checked by the chunk verifier of loads before it counts: a file a node fetched from another is
assembled under a temporary name, its size and every chunk checksum of the boxes and objects in it verified
(:func:`~reshard.io.verified.verify_stored_ranges`, as node-local staging verifies a download), and only then
renamed to its name; a file a drain copies to durable storage is verified chunk by chunk as it is read from the
local disk (:func:`~reshard.io.chunkcheck.feed`), and read back from the target (size and every checksum) after
it is written. Not collective, except :func:`run_fetches`, which every rank of the group calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from reshard.errors import CheckpointError, CorruptCheckpointError, StorageError
from reshard.io.chunkcheck import ChunkProgress, StoredChunks, feed
from reshard.io.datafile import DATA_FILE_PATTERN
from reshard.io.verified import verify_stored_ranges
from reshard.metadata import DATA_DIR, MAX_METADATA_BYTES, METADATA_FILE, DataFile, Metadata
from reshard.net.transports import Transport
from reshard.planning.nodelocal import Holding, RankFetches
from reshard.storage import FileWriter, LocalStorage, Storage

__all__ = [
    "COPY_BLOCK_BYTES",
    "copy_verified",
    "is_whole",
    "publish_on_node",
    "read_holding",
    "remove_unlisted",
    "run_fetches",
]

COPY_BLOCK_BYTES = 8 * 1024 * 1024
"""The bytes a drain reads from the local file and writes to the target at a time."""


def read_holding(directory: Path, *, node: int, rank: int) -> Holding:
    """What the step directory ``directory`` of this node holds (its leader, rank ``rank``, asks): the digest and
    data files of its ``metadata.json`` (none when it is missing or not a valid document) and the data files
    present with their sizes (temporary names of copies in progress are not files)."""
    storage = LocalStorage(directory)
    digest, size, expected = None, 0, {}
    try:
        raw = storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
        metadata = Metadata.from_json_bytes(raw, where=storage.describe(METADATA_FILE))
        digest, size = hashlib.sha256(raw).hexdigest(), len(raw)
        expected = {f.path: f.size for f in metadata.files if f.checkpoint is None}
    except (OSError, CheckpointError):
        pass  # no document here: another node's serves, or the step is not restorable
    held = {}
    with contextlib.suppress(OSError):
        for name in storage.list_files(DATA_DIR):
            if not Path(name).name.startswith("."):
                held[name] = storage.size(name)
    return Holding(node=node, rank=rank, metadata=digest, metadata_size=size, expected=expected, held=held)


def _entries(metadata: Metadata, file: int, where: str) -> list[tuple[str, int, int, int, tuple[int, ...]]]:
    """Every stored box and object blob of data file ``file``, as the chunk verifier takes them, by offset."""
    out = []
    for t in metadata.tensors.values():
        for b in t.boxes:
            if b.file == file:
                out.append(
                    (
                        f"tensor {t.key!r} box at {list(b.offset)} in {where}",
                        file,
                        b.byte_offset,
                        b.byte_length,
                        b.checksums,
                    )
                )
    for o in metadata.objects.values():
        for e in o.entries:
            if e.file == file:
                out.append(
                    (
                        f"object {o.key!r} cell {list(e.offset)} in {where}",
                        file,
                        e.byte_offset,
                        e.byte_length,
                        e.checksums,
                    )
                )
    return sorted(out, key=lambda e: e[2])


def is_whole(storage: Storage, metadata: Metadata, file: int) -> bool:
    """Whether ``storage`` holds data file ``file`` whole: its recorded size, and every chunk checksum of the boxes
    and objects in it (read back through the chunk verifier)."""
    entry = metadata.files[file]
    try:
        if storage.size(entry.path) != entry.size:
            return False
    except OSError:
        return False
    return not verify_stored_ranges(
        storage, metadata, _entries(metadata, file, storage.describe(entry.path)), stop_at_first=True
    )


# ---- the file exchange of a restore --------------------------------------------------------------------------


def _read_at(fd: int, offset: int, buffer: memoryview) -> None:
    while buffer:
        got = os.preadv(fd, [buffer], offset)
        if got <= 0:
            raise StorageError(f"a data file ended before byte {offset + len(buffer)}")
        buffer, offset = buffer[got:], offset + got


def _write_at(fd: int, offset: int, data: memoryview) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


class _Assembly:
    """The files one rank assembles from what it receives: each under a temporary name in ``data/``."""

    def __init__(self, directory: Path, metadata: Metadata, files: Sequence[int]) -> None:
        self.directory = directory
        self.metadata = metadata
        self.temps: dict[int, Path] = {}
        self.fds: dict[int, int] = {}
        (directory / DATA_DIR).mkdir(parents=True, exist_ok=True)
        for file in files:
            final = directory / metadata.files[file].path
            temp = final.with_name(f".{final.name}.part-{uuid.uuid4().hex}")
            self.temps[file] = temp
            self.fds[file] = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)

    def finish(self) -> None:
        """fsync every file, verify it (size, every chunk) and rename it to its name.

        Raises:
            CorruptCheckpointError: a copy does not match the metadata (it is removed).
        """
        for fd in list(self.fds.values()):
            os.fsync(fd)
        self._close()
        for file, temp in self.temps.items():
            entry = self.metadata.files[file]
            relative = temp.relative_to(self.directory).as_posix()
            size = temp.stat().st_size
            if size != entry.size:
                raise CorruptCheckpointError(
                    f"data file {entry.path} fetched into {self.directory} has {size} bytes, the metadata says "
                    f"{entry.size}: the copy it came from was truncated or altered"
                )
            files = list(self.metadata.files)
            files[file] = DataFile(path=relative, size=entry.size)
            renamed = dataclasses.replace(self.metadata, files=tuple(files))
            where = f"{entry.path} (fetched from another node into {self.directory})"
            problems = verify_stored_ranges(LocalStorage(self.directory), renamed, _entries(renamed, file, where))
            if problems:
                raise CorruptCheckpointError("; ".join(problems[:5]))
            os.replace(temp, self.directory / entry.path)
        if self.temps:
            fd = os.open(self.directory / DATA_DIR, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.temps = {}

    def _close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = {}

    def abandon(self) -> None:
        """After a failure: remove what is still under a temporary name; never raises."""
        self._close()
        for temp in self.temps.values():
            temp.unlink(missing_ok=True)
        self.temps = {}


def run_fetches(transport: Transport, fetches: RankFetches, directory: Path, metadata: Metadata) -> None:
    """This rank's part of a restore's file exchange (every rank of the group calls it, with its own part of the
    same schedule, :func:`~reshard.planning.nodelocal.plan_fetches`): in every round, send the pieces it reads
    from the files of its node's ``directory`` and receive the pieces of the files it assembles; then verify and
    rename those. A local failure does not leave the peers waiting: this rank takes part in every round (sending
    zeros) and raises once they are over, for the caller's agreed step.

    Raises:
        CorruptCheckpointError: a fetched copy does not match its checksums (it came from a damaged file).
        OSError, StorageError: a file could not be read or written.
    """
    error: Exception | None = None
    assembly: _Assembly | None = None
    sources: dict[int, int] = {}
    try:
        assembly = _Assembly(directory, metadata, fetches.assembles)
    except Exception as exc:  # after the rounds
        error = exc
    try:
        for sends, receives in fetches.rounds:
            error = _round(transport, sends, receives, directory, metadata, sources, assembly, error)
        if error is None and assembly is not None:
            assembly.finish()
    except BaseException:
        if assembly is not None:
            assembly.abandon()
        raise
    finally:
        for fd in sources.values():
            with contextlib.suppress(OSError):
                os.close(fd)
    if error is not None:
        if assembly is not None:
            assembly.abandon()
        raise error


def _round(
    transport: Transport,
    sends: Sequence[tuple[int, int, int, int]],
    receives: Sequence[tuple[int, int, int, int]],
    directory: Path,
    metadata: Metadata,
    sources: dict[int, int],
    assembly: _Assembly | None,
    error: Exception | None,
) -> Exception | None:
    """One round of :func:`run_fetches`; the first local failure (``error`` if given)."""
    outgoing = []
    for peer, file, offset, length in sends:
        buffer = torch.zeros(length, dtype=torch.uint8)
        try:
            if error is None and length:
                if file not in sources:
                    sources[file] = os.open(directory / metadata.files[file].path, os.O_RDONLY)
                _read_at(sources[file], offset, buffer.numpy().data)
        except Exception as exc:  # zeros go out; raised after the rounds
            error = exc
            buffer.zero_()
        if length:
            outgoing.append((peer, buffer.to(transport.device)))
    incoming = [
        (peer, torch.empty(length, dtype=torch.uint8, device=transport.device), file, offset)
        for peer, file, offset, length in receives
        if length
    ]
    transport.exchange(outgoing, [(peer, buffer) for peer, buffer, _, _ in incoming])
    try:
        if error is None and assembly is not None:
            for _, buffer, file, offset in incoming:
                _write_at(assembly.fds[file], offset, buffer.cpu().numpy().data)
    except Exception as exc:  # as above
        error = exc
    return error


# ---- a node's metadata.json, and what no save of the step names ------------------------------------------------


def publish_on_node(storage: Storage, document: bytes) -> None:
    """Write ``document`` as this node's ``metadata.json`` of the step, atomically (a temporary file, fsync, a
    rename over any earlier one, a directory fsync), after making ``data/`` durable: the step is complete on this
    node from then on."""
    with contextlib.suppress(FileNotFoundError):
        storage.sync_dir(DATA_DIR)
    storage.commit(METADATA_FILE, document, replace=True)


def remove_unlisted(storage: Storage, metadata: Metadata) -> list[str]:
    """Remove the data files in ``data/`` that ``metadata`` does not name (an earlier save of the step on this node
    that failed, or was replaced), and temporary copies left by a killed fetch; the names removed. Only names a
    save or a fetch gives are touched."""
    listed = {f.path for f in metadata.files if f.checkpoint is None}
    removed = []
    for name in storage.list_files(DATA_DIR):
        base = Path(name).name
        leftover = base.startswith(".") and ".part-" in base
        if name not in listed and (leftover or DATA_FILE_PATTERN.match(name)):
            storage.delete(name)
            removed.append(name)
    return removed


# ---- the verified copy of a drain ----------------------------------------------------------------------------


def copy_verified(directory: Path, target: Storage, metadata: Metadata, file: int) -> int:
    """Copy data file ``file`` from this node's step ``directory`` to ``target`` unless ``target`` holds it whole
    already; the bytes copied (0: it was there). Every chunk is verified as it is read from ``directory``; the copy
    is read back (size and every checksum) once written.

    Raises:
        CorruptCheckpointError: the local file, or the copy read back, does not match its checksums.
        OSError, StorageError: reading or writing failed.
    """
    entry = metadata.files[file]
    if target.exists(entry.path) and is_whole(target, metadata, file):
        return 0
    target.delete(entry.path)  # a part left by a drain that was killed: the writer creates the name anew
    where = str(directory / entry.path)
    chunks = [
        StoredChunks(what, entry.path, where, offset, length, checksums, metadata.checksum_chunk_bytes)
        for what, _, offset, length, checksums in _entries(metadata, file, where)
    ]
    progress = [ChunkProgress() for _ in chunks]
    writer = target.open_writer(entry.path)  # the storage bounds what it buffers (its part size)
    try:
        with open(directory / entry.path, "rb", buffering=0) as local:
            _stream(local, writer, chunks, progress, where, entry.size)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    for stored, done in zip(chunks, progress, strict=True):
        if done.position != stored.byte_length:
            raise CorruptCheckpointError(f"{stored.what}: the data file {where} ends inside it")
    if not is_whole(target, metadata, file):
        raise CorruptCheckpointError(
            f"the copy of data file {entry.path} at {target.describe(entry.path)} does not read back as written"
        )
    return entry.size


def _stream(
    local: BinaryIO,
    writer: FileWriter,
    chunks: list[StoredChunks],
    progress: list[ChunkProgress],
    where: str,
    size: int,
) -> None:
    """Read the ``size`` bytes of ``local`` in blocks, verify them (:func:`_feed_block`) and write them."""
    position = 0
    while position < size:
        block = local.read(min(COPY_BLOCK_BYTES, size - position))
        if not block:
            raise CorruptCheckpointError(f"data file {where} ends at byte {position}; the metadata says {size}")
        _feed_block(chunks, progress, position, memoryview(block))
        writer.write(memoryview(block))
        position += len(block)


def _feed_block(chunks: list[StoredChunks], progress: list[ChunkProgress], position: int, block: memoryview) -> None:
    """Feed the bytes ``[position, position + len(block))`` of the file to the running checksums of the boxes they
    overlap (``chunks``, by offset)."""
    end = position + len(block)
    for i, stored in enumerate(chunks):
        lo, hi = max(position, stored.byte_offset), min(end, stored.byte_offset + stored.byte_length)
        if lo >= hi:
            continue
        progress[i], _ = feed(stored, progress[i], lo - stored.byte_offset, block[lo - position : hi - position])
