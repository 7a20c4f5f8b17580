"""``reshard.save``: every rank writes its unique boxes once; the coordinator commits.

Flow (each phase ends in agreement, so a failure on any rank raises on every rank and nothing is
committed):

1. *describe*: each rank flattens its state dict into pieces (boxes, no data); the descriptions are
   gathered on the coordinator (in a compact form), which validates the global tiling, elects one writer
   per box and prepares the directory, then sends each rank its own assignment only.
2. *write*: each elected rank writes its boxes, with CRC-32C checksums, into its own data file, whose
   name is unique to this save, and fsyncs it.
3. *commit*: the coordinator writes ``metadata.json`` atomically (temporary file, fsync, rename or
   exclusive link, directory fsync; a conditional put on object stores), through
   :class:`~reshard.io.commit.SaveCommit`. Until then the directory holds no committed checkpoint from
   this save, and a failure removes this save's files. The commit is a point of no return: after it,
   nothing this save wrote is deleted whatever fails next; a failure then (a rank that dies before the
   coordinator's confirmation reaches it) is :class:`~reshard.UnconfirmedCommitError`, and the checkpoint
   stays. The other ranks get a summary (:class:`SaveResult`), never the whole metadata.

The per-save arguments (path, ``overwrite``, ``fingerprint``, ``checksum_chunk_bytes``, ``content_hash``,
``verify_base``, ``base``) travel with the descriptions and must agree across ranks, or nothing is written.

An *incremental* save (``base=``) differs in two places: planning looks every assigned box up in the base
(:mod:`reshard.planning.incremental`) and tells its writer the base's content hash and where the base stores
the box, and a writer whose box hashes the same, and whose stored copy reads back as its bytes, references it
instead of writing it (:mod:`reshard.io.reuse`; a copy damaged since its commit is written anew); at planning,
before any box is skipped, the coordinator leaves reference markers in the checkpoints it may reference, under
each one's lock, and checks that their files are there; at the commit the markers are narrowed to what is
referenced (:mod:`reshard.io.references`).

So what a rank other than the coordinator sends and receives does not grow with the number of ranks
(docs/scale.md measures it, with the coordinator's planning time and memory, up to 8192 ranks).
"""

from __future__ import annotations

import datetime
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.errors import (
    CheckpointError,
    CommunicationError,
    CorruptCheckpointError,
    StateDictError,
    StorageError,
    UnconfirmedCommitError,
)
from reshard.flows.collector import collector_paused
from reshard.flows.options import SaveOptions
from reshard.flows.stats import PhaseClock, SaveStats, fill_save_stats
from reshard.io.commit import CommitOutcome, SaveCommit
from reshard.io.datafile import DataFileWriter, data_file_name, staging_slabs, tensor_bytes
from reshard.io.locking import LockTiming
from reshard.io.references import (
    check_referenced_files,
    mark_holders,
    remove_markers,
    settle_markers,
    verify_references,
)
from reshard.io.reuse import Reuse, base_name_of, choose_reused
from reshard.io.sources import read_metadata_bytes
from reshard.metadata import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    Metadata,
)
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.planning.assemble import ObjectReport, TensorReport, WriteReport, assemble_metadata
from reshard.planning.descriptions import (
    DescriptionTable,
    LocalSaveDescription,
    WriteAssignment,
    describe_state,
    encode_description,
)
from reshard.planning.incremental import ReferencedBox, match_base
from reshard.planning.save_plan import plan_save_table
from reshard.state.codec import encode_object_blob, encode_tagged
from reshard.state.fingerprint import fingerprint
from reshard.state.statedict import FlatStateDict, check_tensors, flatten_state_dict
from reshard.storage import CheckpointLocation, Storage, storage_for

__all__ = ["SaveResult", "save", "tensor_bytes"]

logger = logging.getLogger("reshard")


@dataclass
class _SaveState:
    """What one rank keeps between the phases of one save."""

    flat: FlatStateDict = field(default_factory=FlatStateDict)
    views: list[torch.Tensor] = field(default_factory=list)
    """The local data of every described box, in description order."""
    blobs: list[bytes] = field(default_factory=list)
    file_bytes: int = 0
    """The size of the data file this rank wrote (0: none)."""
    description: LocalSaveDescription = field(default_factory=lambda: LocalSaveDescription(tensors=(), objects=()))
    """This rank's own description."""
    table: DescriptionTable | None = None
    """Every rank's description in columns; on the coordinator only."""
    commit: SaveCommit | None = None
    """The commit protocol; on the coordinator only, from planning on."""
    references: dict[int, ReferencedBox] | None = None
    """For an incremental save, the base's box of every table row that may be reused; on the coordinator."""
    written: list[int] = field(default_factory=list)
    """The indices (in ``views``) of the boxes this rank wrote (an incremental save reuses others)."""
    reuse: Reuse = field(default_factory=Reuse)
    """For an incremental save, how this rank's boxes divided and what reading the base back cost."""
    marked: list[str] = field(default_factory=list)
    """The checkpoints this save left reference markers in; on the coordinator."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveResult:
    """What :func:`save` returns on every rank of the group.

    Attributes:
        path: the checkpoint, as its storage describes it.
        save_id: the id of this save (data file names contain it).
        world_size: ranks in the group that saved.
        num_files: data files this save wrote (one per rank that wrote something).
        file_bytes: bytes of the data files this save wrote together.
        total_bytes: bytes of tensor data in the checkpoint (each box once), written or referenced.
        referenced_bytes: of those, the bytes an incremental save did not write because its base held them
            (they stay in the files of the checkpoints that hold them).
        rewritten_bytes: of the bytes written, those an incremental save wrote although its base records the
            same content, because the copy the base stores did not read back as it (damaged after its commit,
            missing, unreadable; ``SaveOptions(verify_base=True)``, the default): 0 when the base is sound.
        metadata: on the coordinator (rank 0 of the group), the committed metadata; None on the other ranks,
            which never receive the whole checkpoint's metadata (at ten thousand ranks that would be every
            rank holding everyone's plan): use :func:`reshard.read_metadata` where it is needed.
    """

    path: str
    save_id: str
    world_size: int
    num_files: int
    file_bytes: int
    total_bytes: int
    metadata: Metadata | None
    referenced_bytes: int = 0
    rewritten_bytes: int = 0


def save(
    state_dict: Any,
    path: CheckpointLocation,
    *,
    group: Group = None,
    overwrite: bool = False,
    options: SaveOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout: datetime.timedelta | float | None = None,
    stats: SaveStats | None = None,
    base: CheckpointLocation | None = None,
) -> SaveResult:
    """Save a (sharded) state dict as a checkpoint at ``path``. Called by all ranks of ``group``.

    Args:
        state_dict: nested dicts/lists whose leaves are :class:`~reshard.ShardedTensor`,
            :class:`~reshard.ShardedObject`, plain tensors (full, replicated on every rank: written
            once) or JSON-like common values (the coordinator's are written).
        path: the checkpoint: a directory (created if needed), a ``file://``, ``s3://bucket/prefix`` or
            ``gs://bucket/prefix`` URL, or a :class:`~reshard.storage.Storage`. Every rank passes the same.
        group: the ranks that save together: a process group (``None``: the default group, or this process
            alone when ``torch.distributed`` is not initialised), or a :class:`~reshard.net.transports.ThreadGroup`
            member.
        overwrite: replace a complete checkpoint at ``path``. The old one stays loadable until the new
            ``metadata.json`` replaces it; its data files are removed after that.
        options: how to write (:class:`~reshard.SaveOptions`: content fingerprints, the checksum chunk
            size, whether an incremental save reads its base back); every rank passes equal ones.
        timeout: how long any collective may wait for the slowest rank (default 10 minutes).
        storage_options: passed to the object-store client (fsspec ``s3``/``gs`` filesystem options such
            as ``endpoint_url``); credentials otherwise come from the client's usual configuration.
        stats: if given, filled with this rank's bytes written and seconds per phase (see
            :class:`~reshard.SaveStats`) once the save has committed.
        base: save incrementally against this earlier checkpoint, a sibling of ``path`` (same parent
            directory or prefix) saved with content hashes: a box whose place and content hash equal the
            base's, and whose stored copy reads back as its bytes (unless ``SaveOptions(verify_base=False)``),
            is not written, and the metadata references the file that holds it (docs/format.md section 15);
            the new checkpoint records content hashes too. Every rank passes the same.

    Returns:
        A :class:`SaveResult` on every rank: the checkpoint's id, size and files; on the coordinator also
        its committed metadata.

    Raises:
        ShardingError: the ranks' boxes do not tile their tensors (same on every rank).
        CheckpointExistsError: ``path`` holds a complete checkpoint and ``overwrite`` is off.
        CheckpointLockedError: another save holds ``path``, or (incremental) a checkpoint holding bytes of the base
            is locked by a gc, retention or save changing its files (nothing is written then).
        CheckpointError: ``base`` is not a sibling of ``path``, has no content hashes, or checksums in
            chunks of another size; or a data file it references is missing at the commit (nothing is
            written then; a file already missing when it is read back is not referenced);
            CorruptCheckpointError when ``base`` itself references files that no marker ties to it (a
            copied or moved checkpoint).
        StorageError: a file could not be written on some rank.
        UnconfirmedCommitError: the checkpoint was committed and is complete, but a failure after the commit
            (a rank died or lost contact) kept the save from ending in agreement; nothing is deleted.
        CheckpointError: any failure, on every rank, naming the failing ranks; nothing is committed.
    """
    started = time.perf_counter()
    options = options if options is not None else SaveOptions()
    comm = Communicator(group, timeout=timeout)
    storage = storage_for(path, storage_options)
    try:
        base_name = None if base is None else base_name_of(storage, base, storage_options)
        with collector_paused():
            return _save_to(
                storage,
                state_dict,
                comm,
                overwrite=overwrite,
                checksum_chunk_bytes=options.checksum_chunk_bytes,
                with_fingerprints=options.fingerprint,
                memory_budget_bytes=options.memory_budget_bytes,
                started=started,
                stats=stats,
                content_hashes=options.content_hash or base_name is not None,
                base_name=base_name,
                verify_base=options.verify_base,
            )
    finally:
        if storage is not path:
            storage.close()


def _save_options(
    overwrite: bool,
    with_fingerprints: bool,
    checksum_chunk_bytes: int,
    content_hashes: bool,
    base_name: str | None,
    verify_base: bool = True,
) -> dict[str, Any]:
    """The per-save parameters every rank must pass alike (agreed in the first collective)."""
    if isinstance(checksum_chunk_bytes, bool) or not isinstance(checksum_chunk_bytes, int) or checksum_chunk_bytes < 1:
        raise CheckpointError(f"checksum_chunk_bytes must be a positive integer, got {checksum_chunk_bytes!r}")
    return {
        "overwrite": bool(overwrite),
        "fingerprint": bool(with_fingerprints),
        "checksum_chunk_bytes": checksum_chunk_bytes,
        "content_hash": bool(content_hashes),
        "verify_base": bool(verify_base),
        "base": base_name,
    }


def _check_agreement(contexts: list[Any]) -> None:
    """On the coordinator: every rank passed the same path and options (else nothing is written)."""
    problems = []
    for what in ("path", "overwrite", "fingerprint", "checksum_chunk_bytes", "content_hash", "verify_base", "base"):
        by_value: dict[Any, list[int]] = {}
        for rank, context in enumerate(contexts):
            value = context[what] if what == "path" else context["options"][what]
            by_value.setdefault(value, []).append(rank)
        if len(by_value) > 1:
            problems.append(f"different {'checkpoint paths' if what == 'path' else what}: {by_value}")
    if problems:
        raise CheckpointError(
            f"the ranks passed {'; '.join(problems)} (every rank of the group must pass the same to save)"
        )


def _save_to(
    storage: Storage,
    state_dict: Any,
    comm: Communicator,
    *,
    overwrite: bool,
    checksum_chunk_bytes: int,
    with_fingerprints: bool,
    memory_budget_bytes: int,
    started: float,
    stats: SaveStats | None = None,
    lock_timing: LockTiming | None = None,
    content_hashes: bool = False,
    base_name: str | None = None,
    verify_base: bool = True,
) -> SaveResult:
    """The body of :func:`save` once the storage is open."""
    clock = PhaseClock("save", comm.rank, started)
    location = storage.describe()
    state = _SaveState()

    def describe() -> bytes:
        options = _save_options(
            overwrite, with_fingerprints, checksum_chunk_bytes, content_hashes, base_name, verify_base
        )
        description = _prepare_rank_state(state, state_dict, rank=comm.rank, is_coordinator=comm.is_coordinator)
        return encode_description(description, {"path": location, "options": options})

    def plan(payloads: list[bytes]) -> tuple[str, list[bytes]]:
        state.table, contexts = DescriptionTable.from_wire(payloads)
        _check_agreement(contexts)
        assignments = plan_save_table(state.table)
        if base_name is not None:
            base = _read_base(storage, base_name)
            assignments, state.references = match_base(
                state.table,
                assignments,
                base,
                base_name=base_name,
                target_name=storage.name,
                chunk_bytes=checksum_chunk_bytes,
                places=verify_base,
            )
        save_id = uuid.uuid4().hex
        state.commit = SaveCommit(storage, save_id, overwrite=overwrite, lock_timing=lock_timing)
        try:
            state.commit.begin()
        except StorageError as exc:
            raise StorageError(f"on the coordinator (rank {comm.rank}): {exc}") from exc
        if state.references:  # before any writer skips a box; live from here on through this save's lock
            state.marked = mark_holders(storage, save_id, state.references.values(), check_files=not verify_base)
        return save_id, [a.to_bytes() for a in assignments]

    try:
        with clock.exchange():
            save_id, mine = comm.step_scatter("save planning", clock.timed("plan", describe), clock.timed("plan", plan))
    except CheckpointError:
        # Planning failed after the coordinator took the lock (a peer died before the plan reached it, say):
        # nothing was written, and the lock must not outlive the save.
        if state.commit is not None:
            state.commit.discard()
            remove_markers(storage, state.commit.save_id, state.marked)
        raise
    assignment = WriteAssignment.from_bytes(mine)
    logger.debug("[rank=%d] save %s: writing %d boxes", comm.rank, save_id, len(assignment.tensors))

    def write() -> dict[str, Any]:
        report = _write_assigned(
            storage,
            state,
            assignment,
            save_id,
            comm.rank,
            checksum_chunk_bytes,
            with_fingerprints,
            memory_budget_bytes,
            content_hashes,
            verify_base,
        )
        return report.to_json()

    committed: list[Metadata] = []

    def commit(results: list[dict[str, Any]]) -> dict[str, Any]:
        if state.commit is None:
            raise CheckpointError("the coordinator has no commit protocol (planning did not run here)")
        if state.table is None:
            raise CheckpointError("the coordinator has no descriptions (planning did not run here)")
        reports = [WriteReport.from_json(r) for r in results]
        metadata = assemble_metadata(
            state.table,
            reports,
            save_id=save_id,
            world_size=comm.size,
            chunk_bytes=checksum_chunk_bytes,
            common=state.flat.common,
            content_hashes=content_hashes,
            references=state.references,
        )
        settle_markers(storage, metadata, state.marked)  # the markers of planning name exactly what is referenced
        if metadata.referenced_checkpoints:
            # The files referenced must still be there (a base deleted meanwhile fails the save, not a later load).
            problems = check_referenced_files(storage, metadata)
            if problems:
                raise CheckpointError(f"the incremental save cannot reference its base: {'; '.join(problems.values())}")
        # The commit point: before it the old checkpoint (if any) is intact, after it the new one is, and
        # nothing it references is deleted by this save whatever fails next.
        try:
            state.commit.publish(metadata.to_json_bytes())
        except StorageError as exc:
            raise StorageError(f"on the coordinator (rank {comm.rank}): {exc}") from exc
        committed.append(metadata)
        return {**_summary(metadata), "rewritten_bytes": sum(r.rewritten_bytes for r in reports)}

    try:
        with clock.exchange():
            summary = comm.step("save", clock.timed("write", write), clock.timed("commit", commit))
    except CheckpointError as exc:
        if comm.is_coordinator and state.commit is not None:
            if state.commit.outcome is CommitOutcome.COMMITTED:
                raise UnconfirmedCommitError(
                    f"{location} was committed (save {save_id}) and is complete, but the end of the save failed "
                    f"on the coordinator (rank {comm.rank}): {exc}",
                    path=location,
                    save_id=save_id,
                ) from exc
            state.commit.discard()  # deletes this save's files only when it is known not to have committed
            if state.commit.outcome is CommitOutcome.NOT_COMMITTED:
                remove_markers(storage, save_id, state.marked)
        elif isinstance(exc, CommunicationError) and _committed_as(storage, save_id):
            raise UnconfirmedCommitError(
                f"{location} was committed (save {save_id}) and is complete, but rank {comm.rank} lost contact "
                f"before the coordinator confirmed it: {exc}",
                path=location,
                save_id=save_id,
            ) from exc
        raise
    result = SaveResult(
        path=location,
        save_id=save_id,
        world_size=comm.size,
        num_files=summary["files"],
        file_bytes=summary["file_bytes"],
        total_bytes=summary["total_bytes"],
        metadata=committed[0] if committed else None,
        referenced_bytes=summary["referenced_bytes"],
        rewritten_bytes=summary["rewritten_bytes"],
    )
    with clock.phase("commit"):
        if result.metadata is not None and state.commit is not None:
            state.commit.remove_replaced({f.path for f in result.metadata.files if f.checkpoint is None})
    stats = _fill_stats(stats if stats is not None else SaveStats(), clock, state, result.total_bytes)
    logger.info(
        "[rank=%d] saved %s in %.3f s (%s): this rank wrote %d bytes (%.1f MB/s); the checkpoint holds %d bytes "
        "in %d files",
        comm.rank,
        storage.describe(),
        stats.seconds,
        clock.summary(),
        stats.bytes_written,
        stats.throughput / 1e6,
        result.total_bytes,
        result.num_files,
    )
    return result


def _fill_stats(stats: SaveStats, clock: PhaseClock, state: _SaveState, checkpoint_bytes: int) -> SaveStats:
    """This rank's statistics of a committed save."""
    reuse = state.reuse
    rewritten = sum(state.views[i].nbytes for i in reuse.rewritten)
    fill_save_stats(
        stats,
        clock,
        file_bytes=state.file_bytes,
        checkpoint_bytes=checkpoint_bytes,
        written=[state.views[i].nbytes for i in state.written],
        base_read=(reuse.bytes_read, reuse.bytes_verified, rewritten, reuse.seconds),
    )
    return stats


def _committed_as(storage: Storage, save_id: str) -> bool:
    """Whether the checkpoint's ``metadata.json`` is that of save ``save_id`` (a rank that lost contact
    with the coordinator asks, to tell a committed checkpoint from a failed save)."""
    try:
        raw = storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
        return bool(Metadata.from_json_bytes(raw, lazy=True).save_id == save_id)
    except (OSError, CheckpointError):
        return False


def _summary(metadata: Metadata) -> dict[str, int]:
    """What every rank learns of the committed checkpoint (the coordinator keeps the metadata itself)."""
    own = [f for f in metadata.files if f.checkpoint is None]
    return {
        "files": len(own),
        "file_bytes": sum(f.size for f in own),
        "total_bytes": metadata.total_bytes,
        "referenced_bytes": metadata.referenced_bytes,
    }


def _prepare_rank_state(state: _SaveState, state_dict: Any, *, rank: int, is_coordinator: bool) -> LocalSaveDescription:
    """Phase one on one rank: flatten the state dict, encode object values (and, on the coordinator,
    check that common values can be encoded), and describe every box. Fills ``state``."""
    state.flat = flatten_state_dict(state_dict, rank=rank)
    check_tensors(state.flat.tensors, what="save", fill=False)  # inside the agreed step: the same error everywhere
    for key in [*(t.key for t in state.flat.tensors), *(o.key for o in state.flat.objects), *state.flat.common]:
        try:
            key.encode("utf-8")
        except UnicodeEncodeError:
            raise StateDictError(
                f"key {key!r} is not valid Unicode text (a lone surrogate): it cannot be saved"
            ) from None
    state.blobs = [encode_object_blob(o.value, where=f"object {o.key!r}") for o in state.flat.objects]
    if is_coordinator:
        for item_path, value in state.flat.common.items():
            encode_tagged(value, where=f"common value {item_path!r}")
    state.description, state.views = describe_state(state.flat)
    return state.description


def _write_assigned(
    storage: Storage,
    state: _SaveState,
    assignment: WriteAssignment,
    save_id: str,
    rank: int,
    chunk_bytes: int,
    with_fingerprints: bool,
    memory_budget_bytes: int,
    content_hashes: bool = False,
    verify_base: bool = True,
) -> WriteReport:
    """Write this rank's assigned boxes and objects into its data file; where they went. A box whose
    content hash equals the base's (an incremental save), and whose stored copy reads back as its bytes
    (``verify_base``), is not written but reported as reused (:func:`~reshard.io.reuse.choose_reused`)."""
    slabs = staging_slabs(memory_budget_bytes)  # for hashing here, then for writing
    state.reuse = choose_reused(
        storage,
        assignment,
        state.views,
        slabs=slabs,
        memory_budget_bytes=memory_budget_bytes,
        verify=verify_base,
        what=lambda index: _box_name(state, index),
        rank=rank,
    )
    reused, to_write = state.reuse.reused, state.reuse.to_write
    reused_prints = [_fingerprint_of(state, index) for index in reused] if with_fingerprints else []
    state.written = to_write
    if not to_write and not assignment.objects:
        return WriteReport(
            tensors=TensorReport.of(
                (), (), (), (), reused=reused, reused_fingerprint=reused_prints if with_fingerprints else None
            )
        )
    name = data_file_name(save_id, rank)
    writer = DataFileWriter(storage, name, chunk_bytes, memory_budget_bytes, hash_content=content_hashes, slabs=slabs)
    offsets: list[int] = []
    lengths: list[int] = []
    checksums: list[int] = []
    digests: list[bytes] = []
    prints: list[int] = []
    written_objects = []
    try:
        for stored in writer.append_tensors([state.views[index] for index in to_write]):
            offsets.append(stored.byte_offset)
            lengths.append(stored.byte_length)
            checksums += stored.checksums
            if stored.content_hash is not None:
                digests.append(stored.content_hash)
        if with_fingerprints:
            prints += [_fingerprint_of(state, index) for index in to_write]
        for index in assignment.objects:
            stored = writer.append(memoryview(state.blobs[index]))
            written_objects.append(
                ObjectReport(
                    index=index,
                    byte_offset=stored.byte_offset,
                    byte_length=stored.byte_length,
                    checksums=stored.checksums,
                )
            )
    except BaseException:
        writer.abort()
        raise
    size = writer.commit()
    state.file_bytes = size
    report = TensorReport.of(
        to_write,
        offsets,
        lengths,
        checksums,
        prints if with_fingerprints else None,
        content_hash=b"".join(digests),
        reused=reused,
        reused_fingerprint=reused_prints if with_fingerprints else None,
    )
    rewritten = sum(state.views[i].nbytes for i in state.reuse.rewritten)  # a subset of to_write
    return WriteReport(file=name, size=size, tensors=report, objects=tuple(written_objects), rewritten_bytes=rewritten)


def _box_name(state: _SaveState, index: int) -> str:
    piece = state.description.tensors[index]
    return f"tensor {piece.key!r} box at {list(piece.box.offset)}"


def _fingerprint_of(state: _SaveState, index: int) -> int:
    piece = state.description.tensors[index]
    return fingerprint(state.views[index], piece.box, piece.global_shape)


def _read_base(storage: Storage, base_name: str) -> Metadata:
    """On the coordinator of an incremental save: the base checkpoint's metadata, validated, its own references
    included (a copied or moved base, or one whose references leave the sibling checkpoints, is refused before
    this save leaves a marker anywhere)."""
    base = storage.sibling(base_name)
    try:
        metadata = Metadata.from_json_bytes(read_metadata_bytes(base), where=base.describe(METADATA_FILE))
        try:
            verify_references(base, metadata)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"the base of the incremental save cannot be used: {exc}") from exc
        return metadata
    finally:
        base.close()
