"""Phases 4 and 5 of :func:`reshard.save` (the first three are in :mod:`reshard.flows.save_phases`).

4. :func:`commit` (every rank, one collective: gather the write reports, broadcast a summary): the coordinator
   runs :func:`commit_on_coordinator` (assemble the metadata, narrow the markers, check the referenced files,
   publish the metadata's part files, if partitioned, then ``metadata.json``, and remove the files an overwrite
   replaced before the save lock is released). The commit is the point of no return; a failure after it is
   :class:`~reshard.UnconfirmedCommitError`, and before it removes this save's files and markers.
5. :func:`finish` (every rank, local): this rank's statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reshard.errors import CheckpointError, CommunicationError, StorageError, UnconfirmedCommitError
from reshard.flows.certify import Checks, judge_save, write_certificate, write_checks
from reshard.flows.save_phases import CoordinatorPlan, Described, Planned, SaveRequest, Written, kept_step
from reshard.flows.stats import PhaseClock, SaveStats, fill_save_stats
from reshard.io.commit import CommitOutcome
from reshard.io.references import check_referenced_files, settle_markers
from reshard.io.reuse import Reuse
from reshard.metadata import MAX_METADATA_BYTES, METADATA_FILE, Metadata
from reshard.metadata.partition import metadata_documents
from reshard.metadata.scaled import with_scaled
from reshard.net.comm import Communicator
from reshard.planning.assemble import WriteReport, assemble_metadata
from reshard.storage import Storage

__all__ = ["Committed", "certify_on_coordinator", "commit", "commit_on_coordinator", "committed_as", "finish"]


# ---- 4. commit -----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Committed:
    """Phase 4's result on every rank: what it learns of the committed checkpoint (its own files, their bytes,
    the tensor bytes, of those the bytes referenced in other checkpoints and the bytes rewritten because the base's
    copy was bad); on the coordinator also the committed metadata (None elsewhere)."""

    files: int
    file_bytes: int
    total_bytes: int
    referenced_bytes: int = 0
    rewritten_bytes: int = 0
    metadata: Metadata | None = None
    checks: Checks | None = None

    @classmethod
    def of(cls, metadata: Metadata, rewritten_bytes: int) -> Committed:
        own = [f for f in metadata.files if f.checkpoint is None]
        return cls(
            files=len(own),
            file_bytes=sum(f.size for f in own),
            total_bytes=metadata.total_bytes,
            referenced_bytes=metadata.referenced_bytes,
            rewritten_bytes=rewritten_bytes,
            metadata=metadata,
        )

    def summary(self) -> dict[str, Any]:
        """What the coordinator sends every rank (never the whole metadata)."""
        return {
            "files": self.files,
            "file_bytes": self.file_bytes,
            "total_bytes": self.total_bytes,
            "referenced_bytes": self.referenced_bytes,
            "rewritten_bytes": self.rewritten_bytes,
            "checks": None if self.checks is None else self.checks.to_json(),
        }


def commit_on_coordinator(
    request: SaveRequest,
    coordinator: CoordinatorPlan,
    reports: list[WriteReport],
    *,
    common: Mapping[str, object],
    rank: int,
) -> Committed:
    """The coordinator's part of phase 4, no collective: assemble the metadata from the descriptions and the write
    reports (in rank order), narrow the reference markers to what is referenced, check the referenced files are
    there, and publish ``metadata.json`` (the commit point: before it an old checkpoint is intact, after it the new
    one is, and nothing it references is deleted by this save whatever fails next).

    Raises:
        CheckpointError, StorageError: not committed (``coordinator.commit.outcome`` says whether it is known).
    """
    metadata = assemble_metadata(
        coordinator.table,
        reports,
        save_id=coordinator.save_id,
        world_size=coordinator.table.world,
        chunk_bytes=request.checksum_chunk_bytes,
        common=common,
        content_hashes=request.content_hashes,
        references=coordinator.references,
    )
    if coordinator.scaled:
        metadata = with_scaled(metadata, coordinator.scaled)
    settle_markers(request.storage, metadata, list(coordinator.marked))
    if metadata.referenced_checkpoints:
        # The files referenced must still be there (a base deleted meanwhile fails the save, not a later load).
        problems = check_referenced_files(request.storage, metadata)
        if problems:
            raise CheckpointError(f"the incremental save cannot reference its base: {'; '.join(problems.values())}")
    try:
        documents = metadata_documents(metadata, parts=request.metadata_parts)
    except ValueError as exc:
        raise CheckpointError(f"SaveOptions(metadata_parts={request.metadata_parts!r}): {exc}") from None
    try:
        coordinator.commit.publish(documents.document, parts=documents.parts, keep=documents.metadata.own_paths)
    except StorageError as exc:
        raise StorageError(f"on the coordinator (rank {rank}): {exc}") from exc
    return Committed.of(documents.metadata, sum(r.rewritten_bytes for r in reports))


def commit(
    comm: Communicator,
    request: SaveRequest,
    described: Described,
    planned: Planned,
    written: Written,
    clock: PhaseClock,
    facts: dict[str, Any] | None = None,
) -> Committed:
    """Phase 4, one collective (``save``: gather, broadcast) called by every rank of ``comm``: the write reports go
    to the coordinator, which commits (:func:`commit_on_coordinator`), and every rank gets the summary. With
    ``request.certify``, each rank's ``facts`` (:func:`reshard.flows.certify.save_facts`) travel with its report and
    the coordinator judges them after the commit (:func:`certify_on_coordinator`): the summary carries the checks.

    Raises:
        UnconfirmedCommitError: the checkpoint was committed, but the end of the step failed (on the coordinator),
            or this rank lost contact before the confirmation reached it and finds the commit in storage.
        CheckpointError: any failure, on every rank; nothing is committed, and the coordinator removed this save's
            files and markers.
    """

    def decide(results: list[dict[str, Any]]) -> tuple[Committed, dict[str, Any]]:
        if planned.coordinator is None:
            raise CheckpointError("the coordinator has no plan (planning did not run here)")
        certify = request.certify is not None
        reports = [WriteReport.from_json(r["report"] if certify else r) for r in results]
        done = commit_on_coordinator(
            request, planned.coordinator, reports, common=described.common or {}, rank=comm.rank
        )
        if certify:
            done = certify_on_coordinator(request, done, [r["facts"] or {} for r in results])
        return done, done.summary()

    def report() -> dict[str, Any]:
        if request.certify is None:
            return written.report_or_raise()
        return {"report": written.report_or_raise(), "facts": facts}

    local = clock.timed("write", report)
    try:
        with clock.exchange():
            summary, kept = kept_step(lambda combine: comm.step("save", local, combine), clock.timed("commit", decide))
    except CheckpointError as exc:
        raise _after_failed_commit(comm, request, planned, exc) from exc
    if kept is not None:
        return kept
    return Committed(
        files=int(summary["files"]),
        file_bytes=int(summary["file_bytes"]),
        total_bytes=int(summary["total_bytes"]),
        referenced_bytes=int(summary["referenced_bytes"]),
        rewritten_bytes=int(summary["rewritten_bytes"]),
        checks=None if summary.get("checks") is None else Checks.from_json(summary["checks"]),
    )


def certify_on_coordinator(request: SaveRequest, done: Committed, facts: list[dict[str, Any]]) -> Committed:
    """On the coordinator, after the commit: judge every rank's facts against the committed metadata
    (:func:`reshard.flows.certify.judge_save`), record them (``checks.json``, passed or not) and, when every check
    passed (and the request writes it), write ``certified.json`` (a failure to write either is a problem of the
    checks). Never raises: the save is committed whatever this finds."""
    if request.certify is None or done.metadata is None:
        return done
    checks = judge_save(facts, request.certify, done.metadata)
    try:
        write_checks(request.storage, checks)  # what the checks found, for a later process (certify, ls)
    except CheckpointError as exc:
        problem = f"the record of the checks could not be written: {exc}"
        return dataclasses.replace(done, checks=dataclasses.replace(checks, passed=False, problems=(problem,)))
    if checks.passed and request.certificate:
        try:
            write_certificate(request.storage, checks)
        except CheckpointError as exc:
            checks = dataclasses.replace(
                checks, passed=False, problems=(f"the certificate could not be written: {exc}",)
            )
    return dataclasses.replace(done, checks=checks)


def _after_failed_commit(comm: Communicator, request: SaveRequest, planned: Planned, exc: CheckpointError) -> Exception:
    """The error a rank raises when the commit step failed: UnconfirmedCommitError where the checkpoint is known to
    be committed; else ``exc``, after the coordinator removed this save's files and markers."""
    location = request.storage.describe()
    coordinator = planned.coordinator
    if coordinator is not None:
        if coordinator.commit.outcome is CommitOutcome.COMMITTED:
            return UnconfirmedCommitError(
                f"{location} was committed (save {planned.save_id}) and is complete, but the end of the save failed "
                f"on the coordinator (rank {comm.rank}): {exc}",
                path=location,
                save_id=planned.save_id,
            )
        coordinator.undo()
    elif isinstance(exc, CommunicationError) and committed_as(request.storage, planned.save_id):
        return UnconfirmedCommitError(
            f"{location} was committed (save {planned.save_id}) and is complete, but rank {comm.rank} lost contact "
            f"before the coordinator confirmed it: {exc}",
            path=location,
            save_id=planned.save_id,
        )
    return exc


def committed_as(storage: Storage, save_id: str) -> bool:
    """Whether the checkpoint's ``metadata.json`` is that of save ``save_id`` (a rank that lost contact with the
    coordinator asks, to tell a committed checkpoint from a failed save)."""
    try:
        raw = storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
        return bool(Metadata.from_json_bytes(raw, lazy=True).save_id == save_id)
    except (OSError, CheckpointError):
        return False


# ---- 5. finish -----------------------------------------------------------------------------------------------


def finish(committed: Committed, described: Described, written: Written, clock: PhaseClock) -> SaveStats:
    """Phase 5 on one rank, no collective, after the commit: this rank's statistics of the save (what an overwrite
    replaced was removed by the commit itself, under the save lock: :meth:`reshard.io.commit.SaveCommit.publish`)."""
    reuse = written.reuse if written.reuse is not None else Reuse()
    stats = SaveStats()
    fill_save_stats(
        stats,
        clock,
        file_bytes=written.file_bytes,
        checkpoint_bytes=committed.total_bytes,
        written=[described.views[i].nbytes for i in written.written],
        base_read=(
            reuse.bytes_read,
            reuse.bytes_verified,
            sum(described.views[i].nbytes for i in reuse.rewritten),
            reuse.seconds,
        ),
    )
    return stats
