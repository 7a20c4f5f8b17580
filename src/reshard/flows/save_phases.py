"""The phases of :func:`reshard.save`: frozen values in, a frozen value out, at most one collective each.

A save is this fixed sequence (:func:`reshard.flows.save.save` runs it; the asynchronous save runs it on its
snapshot):

1. :func:`describe_rank` (every rank, local): flatten the state dict, encode the object values, describe every
   box (no data) and encode the description with the per-save terms every rank must pass alike. A failure here
   is kept and raised inside the planning step, so that it is agreed on by every rank.
2. :func:`plan` (every rank, one collective: gather the descriptions, scatter the assignments): the coordinator
   runs :func:`plan_on_coordinator` (check the terms agree, validate the tiling, elect one writer per box, match
   the base of an incremental save, take the save lock, leave the reference markers) and each rank gets its own
   :class:`~reshard.planning.descriptions.WriteAssignment`.
3. :func:`write_assigned` (every rank, local): write the assigned boxes and objects into this rank's data file,
   referencing the base's copies where an incremental save may. A failure is raised inside the commit step.
4. :func:`~reshard.flows.save_commit.commit` (every rank, one collective: gather the write reports,
   broadcast a summary): the coordinator assembles the metadata and publishes ``metadata.json``, the point
   of no return.
5. :func:`~reshard.flows.save_commit.finish` (every rank, local): remove the files an overwrite replaced
   (coordinator) and return this rank's statistics.

The communicator calls a step's coordinator part back and sends only JSON and bytes; what the coordinator keeps
for itself (the description table, the commit protocol, the committed metadata) leaves the callback through
:func:`kept_step`, the one write-once bridge of this module, so that the phases themselves stay functions of
frozen values.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from reshard.errors import (
    CheckpointError,
    CorruptCheckpointError,
    StateDictError,
    StorageError,
)
from reshard.flows.options import SaveOptions
from reshard.flows.plan_cache import PlanCache
from reshard.flows.stats import PhaseClock
from reshard.io.commit import CommitOutcome, SaveCommit
from reshard.io.datafile import DataFileWriter, data_file_name, host_slabs
from reshard.io.locking import LockTiming
from reshard.io.references import (
    mark_holders,
    remove_markers,
    verify_references,
)
from reshard.io.reuse import Reuse, choose_reused
from reshard.io.sources import read_full_metadata
from reshard.metadata import Metadata
from reshard.net.comm import Communicator
from reshard.planning.assemble import ObjectReport, TensorReport, WriteReport
from reshard.planning.certify import CertifyOptions
from reshard.planning.descriptions import (
    DescriptionTable,
    LocalSaveDescription,
    WriteAssignment,
    describe_state,
    encode_description,
)
from reshard.planning.incremental import ReferencedBox, match_base
from reshard.planning.layouts import is_description, layout_bytes, offer_contexts
from reshard.planning.save_plan import plan_save_table
from reshard.planning.scaled import agree_scaled, replica_digests
from reshard.state.codec import encode_object_blob, encode_tagged
from reshard.state.fingerprint import fingerprint
from reshard.state.scaled import ScaledRecord
from reshard.state.statedict import check_tensors, flatten_state_dict
from reshard.storage import Storage

__all__ = [
    "AGREED_TERMS",
    "CoordinatorPlan",
    "Described",
    "Planned",
    "SaveRequest",
    "Written",
    "check_agreement",
    "check_offers_agree",
    "describe_rank",
    "kept_step",
    "plan",
    "plan_on_coordinator",
    "read_base",
    "settle_plan",
    "write_assigned",
]

logger = logging.getLogger("reshard")

AGREED_TERMS = (
    "overwrite",
    "fingerprint",
    "checksum_chunk_bytes",
    "content_hash",
    "verify_base",
    "base",
    "certify",
    "reuse_plan",
    "metadata_parts",
)
"""The per-save terms every rank must pass alike (besides the path), in the order their differences are named."""

K = TypeVar("K")


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveRequest:
    """What one rank was asked to save into, and how (the same on every rank, checked at planning).

    ``base_name`` names the base of an incremental save among the checkpoint's siblings (None: a full save);
    ``content_hashes`` records every box's content hash (always on for an incremental save)."""

    storage: Storage
    overwrite: bool = False
    fingerprint: bool = False
    checksum_chunk_bytes: int
    memory_budget_bytes: int
    content_hashes: bool = False
    base_name: str | None = None
    verify_base: bool = True
    lock_timing: LockTiming | None = None
    replaces: str | None = None
    """Without ``overwrite``: the digest of the one checkpoint the save may replace (:class:`SaveCommit`)."""
    certify: CertifyOptions | None = None
    """The checks to run (:mod:`reshard.flows.certify`), or None."""
    certificate: bool = True
    """With ``certify``: the coordinator writes ``certified.json`` when the checks pass (a manager with a
    ``certify_hook`` writes it itself, once the hook approved)."""
    location: str | None = None
    """The checkpoint path every rank must pass alike (None: ``storage.describe()``). A node-local save
    (:mod:`reshard.flows.nodelocal`) writes each rank's file to its own node's directory, so its ranks agree on
    the directory pattern and step instead."""
    reuse_plan: bool = True
    """``SaveOptions.reuse_plan`` (an agreed term): reuse a plan of :attr:`plans` where the layout allows."""
    plans: PlanCache | None = None
    """Where the coordinator keeps plans across saves (:mod:`reshard.flows.save_reuse`); None: plan every save."""
    metadata_parts: bool | None = None
    """``SaveOptions.metadata_parts`` (an agreed term): partition the metadata (None: when it pays)."""

    @property
    def reusing(self) -> bool:
        """Whether planning may reuse a plan (``reuse_plan`` and a cache): the planner of phase 2."""
        return self.reuse_plan and self.plans is not None

    @classmethod
    def of(
        cls,
        storage: Storage,
        options: SaveOptions,
        *,
        overwrite: bool,
        base_name: str | None,
        replaces: str | None = None,
        certificate: bool = True,
        plans: PlanCache | None = None,
    ) -> SaveRequest:
        """The request of a save with ``options`` (an incremental save, ``base_name`` set, records content
        hashes; ``plans`` is used with ``options.reuse_plan`` only)."""
        return cls(
            storage=storage,
            overwrite=overwrite,
            fingerprint=options.fingerprint,
            checksum_chunk_bytes=options.checksum_chunk_bytes,
            memory_budget_bytes=options.memory_budget_bytes,
            content_hashes=options.content_hash or base_name is not None,
            base_name=base_name,
            verify_base=options.verify_base,
            replaces=replaces,
            certify=options.certify,
            certificate=certificate,
            reuse_plan=options.reuse_plan,
            plans=plans,
            metadata_parts=options.metadata_parts,
        )

    def terms(self) -> dict[str, Any]:
        """The terms every rank must pass alike (JSON values), for the coordinator's check.

        Raises:
            CheckpointError: ``checksum_chunk_bytes`` is not a positive integer.
        """
        chunk = self.checksum_chunk_bytes
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise CheckpointError(f"checksum_chunk_bytes must be a positive integer, got {chunk!r}")
        return {
            "overwrite": bool(self.overwrite),
            "fingerprint": bool(self.fingerprint),
            "checksum_chunk_bytes": chunk,
            "content_hash": bool(self.content_hashes),
            "verify_base": bool(self.verify_base),
            "base": self.base_name,
            "certify": None if self.certify is None else json.dumps(self.certify.to_json(), sort_keys=True),
            "reuse_plan": bool(self.reuse_plan),
            "metadata_parts": self.metadata_parts,
        }


# ---- 1. describe ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Described:
    """One rank's state, described: ``views[i]`` holds box ``description.tensors[i]``, ``blobs[i]`` the encoded
    value of ``description.objects[i]``; ``payload`` is what the rank sends to the coordinator (a save that may
    reuse its plan sends its ``context`` and the fingerprint of its ``layout`` instead, and ``payload`` is empty).
    ``error``: the description failed (raised inside the planning step, so that every rank agrees on it)."""

    description: LocalSaveDescription = field(default_factory=lambda: LocalSaveDescription(tensors=(), objects=()))
    views: tuple[torch.Tensor, ...] = ()
    blobs: tuple[bytes, ...] = ()
    common: Mapping[str, object] | None = None
    payload: bytes = b""
    layout: bytes = b""
    context: Mapping[str, Any] | None = None
    error: Exception | None = None

    def payload_or_raise(self) -> bytes:
        """What the rank sends at planning, or its description's failure, raised inside the step."""
        if self.error is not None:
            raise self.error
        return self.payload

    def box_name(self, index: int) -> str:
        piece = self.description.tensors[index]
        return f"tensor {piece.key!r} box at {list(piece.box.offset)}"

    def fingerprint_of(self, index: int) -> int:
        piece = self.description.tensors[index]
        return fingerprint(self.views[index], piece.box, piece.global_shape)


def describe_rank(request: SaveRequest, state_dict: Any, *, rank: int, is_coordinator: bool) -> Described:
    """Phase 1 on one rank, no collective: flatten ``state_dict``, check its tensors and keys, encode the object
    values (and, on the coordinator, check that the common values can be encoded), describe every box, and encode
    the description with the terms of ``request``. Never raises: a failure is returned in ``error``."""
    try:
        terms = request.terms()
        flat = flatten_state_dict(state_dict, rank=rank)
        check_tensors(flat.tensors, what="save", fill=False)
        for key in [*(t.key for t in flat.tensors), *(o.key for o in flat.objects), *flat.common]:
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise StateDictError(
                    f"key {key!r} is not valid Unicode text (a lone surrogate): it cannot be saved"
                ) from None
        blobs = tuple(encode_object_blob(o.value, where=f"object {o.key!r}") for o in flat.objects)
        if is_coordinator:
            for item_path, value in flat.common.items():
                encode_tagged(value, where=f"common value {item_path!r}")
        description, views = describe_state(flat)
        location = request.location if request.location is not None else request.storage.describe()
        context: dict[str, Any] = {"path": location, "options": terms}
        if flat.scaled:
            context["scaled"] = {key: record.to_json() for key, record in flat.scaled.items()}
            context["replicas"] = replica_digests(flat)
        reusing = request.reusing
        payload = b"" if reusing else encode_description(description, context)
        layout = layout_bytes(description) if reusing else b""
    except Exception as exc:  # raised inside the planning step (see Described.error)
        return Described(error=exc)
    return Described(
        description=description,
        views=tuple(views),
        blobs=blobs,
        common=dict(flat.common),
        payload=payload,
        layout=layout,
        context=context,
    )


# ---- 2. plan -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CoordinatorPlan:
    """What the coordinator keeps from planning: every rank's description in columns, the assignments, the commit
    protocol (its save lock taken), and for an incremental save the base's box of every table row that may be
    reused and the checkpoints it left reference markers in."""

    save_id: str
    table: DescriptionTable
    assignments: tuple[WriteAssignment, ...]
    commit: SaveCommit
    references: Mapping[int, ReferencedBox] | None = None
    marked: tuple[str, ...] = ()
    scaled: Mapping[str, ScaledRecord] = field(default_factory=dict)

    def undo(self) -> None:
        """After a failure before the commit: remove this save's files and markers, release its lock."""
        self.commit.discard()  # deletes this save's files only when it is known not to have committed
        if self.commit.outcome is CommitOutcome.NOT_COMMITTED:
            remove_markers(self.commit.storage, self.save_id, list(self.marked))


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """Phase 2's result on one rank: the save's id and this rank's assignment; on the coordinator also its
    :class:`CoordinatorPlan` (None elsewhere)."""

    save_id: str
    assignment: WriteAssignment
    coordinator: CoordinatorPlan | None = None


def check_agreement(contexts: list[Any]) -> None:
    """On the coordinator: every rank passed the same path and terms (else nothing is written)."""
    problems = []
    for what in ("path", *AGREED_TERMS):
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


def check_offers_agree(payloads: list[bytes]) -> None:
    """On the coordinator: when some ranks sent a layout offer and others a description (they disagree on
    ``reuse_plan``), the error naming the terms they disagree on."""
    try:
        contexts = offer_contexts(payloads)
    except (ValueError, TypeError, KeyError, CheckpointError) as exc:
        raise CheckpointError(f"a rank sent a malformed save description or layout offer: {exc}") from exc
    check_agreement(contexts)
    raise CheckpointError("some ranks sent a layout offer and others a save description (another version of reshard?)")


def plan_on_coordinator(request: SaveRequest, payloads: list[bytes], *, save_id: str, rank: int) -> CoordinatorPlan:
    """The coordinator's part of phase 2, no collective: decode every rank's description, check the terms agree,
    validate the tiling and elect the writers, then :func:`settle_plan`.

    Raises:
        ShardingError, CheckpointError, CheckpointLockedError, CheckpointExistsError, StorageError: nothing is
            written, and the lock is not held.
    """
    if not all(map(is_description, payloads)):
        check_offers_agree(payloads)
    table, contexts = DescriptionTable.from_wire(payloads)
    check_agreement(contexts)
    scaled = agree_scaled(table, contexts)
    return settle_plan(request, table, plan_save_table(table), scaled, save_id=save_id, rank=rank)


def settle_plan(
    request: SaveRequest,
    table: DescriptionTable,
    assignments: list[WriteAssignment],
    scaled: Mapping[str, ScaledRecord],
    *,
    save_id: str,
    rank: int,
) -> CoordinatorPlan:
    """What every save does on the coordinator once the writers are elected on ``table`` (planned now or reused):
    match the base of an incremental save, then take the save lock and, before any writer skips a box, leave the
    reference markers. A failure after the lock releases it.

    Raises:
        CheckpointError, CheckpointLockedError, CheckpointExistsError, StorageError: nothing is written, and the
            lock is not held.
    """
    references: dict[int, ReferencedBox] | None = None
    if request.base_name is not None:
        assignments, references = match_base(
            table,
            assignments,
            read_base(request.storage, request.base_name),
            base_name=request.base_name,
            target_name=request.storage.name,
            chunk_bytes=request.checksum_chunk_bytes,
            places=request.verify_base,
        )
    protocol = SaveCommit(
        request.storage,
        save_id,
        overwrite=request.overwrite,
        lock_timing=request.lock_timing,
        replaces=request.replaces,
    )
    try:
        try:
            protocol.begin()
        except StorageError as exc:
            raise StorageError(f"on the coordinator (rank {rank}): {exc}") from exc
        marked = []
        if references:  # before any writer skips a box; live from here on through this save's lock
            marked = mark_holders(request.storage, save_id, references.values(), check_files=not request.verify_base)
    except Exception:
        protocol.discard()  # the lock must not outlive the save
        raise
    return CoordinatorPlan(
        save_id=save_id,
        table=table,
        assignments=tuple(assignments),
        commit=protocol,
        references=references,
        marked=tuple(marked),
        scaled=scaled,
    )


def plan(comm: Communicator, request: SaveRequest, described: Described, clock: PhaseClock) -> Planned:
    """Phase 2, one collective (``save planning``: gather, scatter) called by every rank of ``comm``: the
    descriptions go to the coordinator, which plans (:func:`plan_on_coordinator`), and each rank gets its own
    assignment. A failure anywhere (a description, the plan, a rank that dies) raises on every rank, and the
    coordinator releases what planning took."""

    def decide(payloads: list[bytes]) -> tuple[CoordinatorPlan, tuple[str, list[bytes]]]:
        made = plan_on_coordinator(request, payloads, save_id=uuid.uuid4().hex, rank=comm.rank)
        return made, (made.save_id, [a.to_bytes() for a in made.assignments])

    local = clock.timed("plan", described.payload_or_raise)
    undo: Callable[[CoordinatorPlan], None] = CoordinatorPlan.undo
    with clock.exchange():
        stepped = kept_step(
            lambda combine: comm.step_scatter("save planning", local, combine), clock.timed("plan", decide), undo=undo
        )
    (save_id, mine), kept = stepped
    assignment = WriteAssignment.from_bytes(mine)
    logger.debug("[rank=%d] save %s: writing %d boxes", comm.rank, save_id, len(assignment.tensors))
    return Planned(save_id=str(save_id), assignment=assignment, coordinator=kept)


# ---- 3. write ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    """Phase 3's result on one rank: its write report for the coordinator, how its boxes divided between written
    and reused (``reuse``; ``written``: the indices of the boxes it wrote), the size of its data file (0: none).
    ``error``: the write failed (raised inside the commit step, so that every rank agrees on it)."""

    report: WriteReport = field(default_factory=WriteReport)
    reuse: Reuse | None = None
    written: tuple[int, ...] = ()
    file_bytes: int = 0
    error: Exception | None = None

    def report_or_raise(self) -> dict[str, Any]:
        """What the rank sends at the commit, or its write's failure, raised inside the step."""
        if self.error is not None:
            raise self.error
        return self.report.to_json()


def write_assigned(request: SaveRequest, described: Described, planned: Planned, *, rank: int) -> Written:
    """Phase 3 on one rank, no collective: write its assigned boxes and objects into its data file (named after
    the save and the rank) and fsync it. A box whose content hash equals the base's (an incremental save), and
    whose stored copy reads back as its bytes (``verify_base``), is not written but reported as reused
    (:func:`~reshard.io.reuse.choose_reused`). Never raises: a failure is returned in ``error``, and a data file
    begun is removed."""
    try:
        slabs = host_slabs(request.memory_budget_bytes)  # for hashing here, then for writing
        reuse = choose_reused(
            request.storage,
            planned.assignment,
            described.views,
            slabs=slabs,
            memory_budget_bytes=request.memory_budget_bytes,
            verify=request.verify_base,
            what=described.box_name,
            rank=rank,
        )
        prints = request.fingerprint
        reused_prints = [described.fingerprint_of(i) for i in reuse.reused] if prints else None
        if not reuse.to_write and not planned.assignment.objects:
            report = WriteReport(
                tensors=TensorReport.of((), (), (), (), reused=reuse.reused, reused_fingerprint=reused_prints)
            )
            return Written(report=report, reuse=reuse)
        name = data_file_name(planned.save_id, rank)
        writer = DataFileWriter(
            request.storage,
            name,
            request.checksum_chunk_bytes,
            request.memory_budget_bytes,
            hash_content=request.content_hashes,
            slabs=slabs,
        )
        tensors, objects = _append_all(writer, described, planned.assignment, reuse, reused_prints)
        size = writer.commit()
    except Exception as exc:  # raised inside the commit step (see Written.error)
        return Written(error=exc)
    rewritten = sum(described.views[i].nbytes for i in reuse.rewritten)  # a subset of to_write
    report = WriteReport(file=name, size=size, tensors=tensors, objects=objects, rewritten_bytes=rewritten)
    return Written(report=report, reuse=reuse, written=tuple(reuse.to_write), file_bytes=size)


def _append_all(
    writer: DataFileWriter,
    described: Described,
    assignment: WriteAssignment,
    reuse: Reuse,
    reused_prints: list[int] | None,
) -> tuple[TensorReport, tuple[ObjectReport, ...]]:
    """Append the boxes ``reuse.to_write`` and the objects of ``assignment`` to ``writer``; where they went (with
    the fingerprints of the boxes written when ``reused_prints`` is not None: the save computes them). The file is
    aborted (removed) if anything fails."""
    offsets: list[int] = []
    lengths: list[int] = []
    checksums: list[int] = []
    digests: list[bytes] = []
    objects = []
    prints: list[int] | None = None
    try:
        for stored in writer.append_tensors([described.views[index] for index in reuse.to_write]):
            offsets.append(stored.byte_offset)
            lengths.append(stored.byte_length)
            checksums += stored.checksums
            if stored.content_hash is not None:
                digests.append(stored.content_hash)
        if reused_prints is not None:
            prints = [described.fingerprint_of(index) for index in reuse.to_write]
        for index in assignment.objects:
            stored = writer.append(memoryview(described.blobs[index]))
            objects.append(
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
    return TensorReport.of(
        reuse.to_write,
        offsets,
        lengths,
        checksums,
        prints,
        content_hash=b"".join(digests),
        reused=reuse.reused,
        reused_fingerprint=reused_prints,
    ), tuple(objects)


def read_base(storage: Storage, base_name: str) -> Metadata:
    """On the coordinator of an incremental save: the base checkpoint's metadata, validated, its own references
    included (a copied or moved base, or one whose references leave the sibling checkpoints, is refused before
    this save leaves a marker anywhere)."""
    base = storage.sibling(base_name)
    try:
        metadata = read_full_metadata(base)
        try:
            verify_references(base, metadata)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"the base of the incremental save cannot be used: {exc}") from exc
        return metadata
    finally:
        base.close()


def kept_step(
    run: Callable[[Callable[[list[Any]], Any]], Any],
    decide: Callable[[list[Any]], tuple[K, Any]],
    *,
    undo: Callable[[K], None] | None = None,
) -> tuple[Any, K | None]:
    """Run one collective step, ``run(combine)``, whose coordinator part is ``decide``: it returns what the
    coordinator keeps and what the step sends. The step's result, and on the coordinator what it kept (None
    elsewhere, or when ``decide`` did not finish). The communicator sends only JSON and bytes, so this is the one
    place where a value leaves its callback: a list written once, here. If the step fails after ``decide``
    finished (a rank died before its answer arrived), ``undo`` is applied to what was kept before the error is
    raised."""
    kept: list[K] = []

    def combine(values: list[Any]) -> Any:
        made, sent = decide(values)
        kept.append(made)
        return sent

    try:
        return run(combine), (kept[0] if kept else None)
    except CheckpointError:
        if kept and undo is not None:
            undo(kept[0])
        raise
