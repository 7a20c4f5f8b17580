"""Node-local checkpoints: saved to each node's own disk, restored into any layout, drained to durable storage.

Large jobs checkpoint often to each node's local NVMe and rarely to durable storage. A node-local save is a
:func:`reshard.save` whose ranks each write their data file into their own node's directory (the phases of
:mod:`reshard.flows.save_phases` and :mod:`reshard.flows.save_commit` over a per-node storage: the ranks agree on
the directory pattern and step, not on one path), then one more collective step puts the committed
``metadata.json`` (the coordinator's bytes) on every other node, atomically. The files are ordinary reshard data
files; only their placement differs. A step is complete on a node when its ``metadata.json`` is there.

A restore (:meth:`NodeLocalCheckpoints.restore`, :mod:`reshard.flows.nodelocal_restore`) first gives each node
every data file its ranks' loads read (fetched from a node that holds it, over the group's transport, verified
before it is renamed into place), then runs an ordinary :func:`reshard.load` from this node's directory: any
layout, any world size. A drain (:meth:`NodeLocalCheckpoints.drain`) copies the step's files from the nodes that
hold them to durable storage and publishes the same ``metadata.json`` there: a normal checkpoint.

What reshard.save assumes about one storage for all ranks, and how a node-local save keeps it true:

- the ranks agree on the checkpoint path: here on the pattern and the step (``SaveRequest.location``);
- the coordinator's commit (save lock, the refusal of a complete checkpoint, the cleanup of dead saves'
  files, the fsync of ``data/``) acts on its own node's directory; each other node's leader makes its
  ``data/`` durable before it writes ``metadata.json``, removes the data files of earlier failed saves of
  the step there, and a save of a step complete on any node is refused (CheckpointExistsError) before
  anything is written;
- a failed save's files on other nodes are not removed by the coordinator: the next save's retention (or a
  save of the same step) removes them. One job owns a node-local directory.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from reshard.errors import CheckpointError, CheckpointExistsError, CommunicationError, UnconfirmedCommitError
from reshard.flows.certify import CERTIFICATE_FILE, Certificate, Checks
from reshard.flows.collector import collector_paused
from reshard.flows.nodelocal_restore import drain_step, restorable_steps, restore_step
from reshard.flows.options import SaveOptions, count_argument, node_size_argument
from reshard.flows.save import SaveResult, run_phases, saved_result
from reshard.flows.save_phases import SaveRequest
from reshard.flows.stats import PhaseClock
from reshard.flows.steps import step_name, step_of
from reshard.io.nodefiles import publish_on_node, remove_unlisted
from reshard.io.retirement import remove_checkpoint
from reshard.metadata import MAX_METADATA_BYTES, METADATA_FILE, Metadata
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.planning.nodelocal import agree_on_node_size, node_directory, node_of
from reshard.storage import CheckpointLocation, LocalStorage, Storage

__all__ = ["NodeLocalCheckpoints"]

logger = logging.getLogger("reshard")


class NodeLocalCheckpoints:
    """Step checkpoints on each node's own disk. Create one per rank, with the same arguments on every rank;
    :meth:`save`, :meth:`restorable`, :meth:`restore` and :meth:`drain` are collective over ``group``.

    Args:
        directory: local to each node: the same string on every node, or one containing ``{node}`` (replaced by
            this rank's node index, ``rank // node_size``: several simulated nodes on one machine). Step ``s``
            lives in ``<directory>/step_<s, 9 digits>``.
        node_size: ranks per node (consecutive group ranks share a node). Default: ``LOCAL_WORLD_SIZE`` from
            the launcher's environment, else 1.
        keep_last: complete steps each save keeps (besides the steps given to :meth:`keep`).
        group: the ranks that save and restore together (``None``: the default group).
        timeout: how long each collective may wait for the slowest rank.

    Raises:
        ValueError: ``node_size`` (or ``LOCAL_WORLD_SIZE``) or ``keep_last`` is not an integer of at least 1.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        node_size: int | None = None,
        keep_last: int = 2,
        group: Group = None,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        self.node_size = node_size_argument("NodeLocalCheckpoints", node_size)
        self.keep_last = count_argument("NodeLocalCheckpoints", "keep_last", keep_last)
        self.pattern = os.fspath(directory)
        self.group = group
        self.timeout = timeout
        self._kept: frozenset[int] = frozenset()
        comm = Communicator(group, timeout=timeout)
        self.rank = comm.rank
        self.world_size = comm.size
        self.node = node_of(self.rank, self.node_size)
        """This rank's node index."""
        self.directory = Path(node_directory(self.pattern, self.node))
        """This node's directory."""

    # ---- paths -------------------------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """Whether this rank is its node's leader (its lowest rank): it reads and writes what is per node."""
        return self.rank % self.node_size == 0

    def step_directory(self, step: int) -> Path:
        """This node's directory of ``step``."""
        return self.directory / step_name(step)

    def path_of(self, step: int) -> Storage:
        """This node's directory of ``step``, as a storage (a checkpoint directory once the step is complete)."""
        return LocalStorage(self.step_directory(step))

    def _location(self, step: int) -> str:
        """What every rank agrees on for a save of ``step``: the directory pattern (with ``{node}`` kept) and the
        step."""
        return f"node-local {os.path.join(self.pattern, step_name(step))}"

    def _comm(self, group: Group = None) -> Communicator:
        comm = Communicator(self.group if group is None else group, timeout=self.timeout)
        if comm.rank != self.rank and group is None:
            raise CheckpointError(f"the group's rank of this process is {comm.rank}, it was {self.rank}")
        return comm

    # ---- steps, keep -------------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The steps complete in this node's directory (``metadata.json`` there), oldest first. Not collective."""
        return _complete_steps(self.directory)

    def keep(self, steps: set[int]) -> None:
        """Steps that retention must not delete (not yet drained, say), replacing those given before. Every rank
        passes the same; the coordinator's count."""
        self._kept = frozenset(int(s) for s in steps)

    # ---- save --------------------------------------------------------------------------------------------

    def save(
        self, step: int, state_dict: Any, *, options: SaveOptions | None = None, certificate: bool = True
    ) -> SaveResult:
        """Save ``state_dict`` as ``step``: each rank writes its data file into its own node's directory, the
        coordinator commits ``metadata.json`` on its node, then every other node's leader writes the same bytes
        on its node (one more collective step); then retention, per node. Collective over the group.
        ``certificate=False``: with ``SaveOptions(certify=...)`` the checks run but ``certified.json`` is written on
        no node (a caller with a ``certify_hook`` writes and spreads it once the hook approved).

        Raises:
            CheckpointExistsError: the step is complete on some node (nothing is written).
            CheckpointError: as :func:`reshard.save` (the same error on every rank); nothing is committed.
            UnconfirmedCommitError: committed on the coordinator's node, but a later step failed: the step may be
                complete on some nodes only (:meth:`restorable` tells).
        """
        started = time.perf_counter()
        options = options if options is not None else SaveOptions()
        comm = self._comm()
        storage = self.path_of(step)
        # With certify, certified.json is written on every node after its metadata.json (_certify), not by the commit.
        request = SaveRequest.of(storage, options, overwrite=False, base_name=None, certificate=False)
        # One document on every node: partitioned metadata's parts would live on the coordinator's node only.
        request = dataclasses.replace(request, location=self._location(step), metadata_parts=False)
        self._refuse_complete(comm, step, parts=options.metadata_parts)
        with collector_paused():
            planned, committed, stats = run_phases(request, state_dict, comm, PhaseClock("save", comm.rank, started))
            kept, document = self._spread(comm, step)
            checks = self._certify(comm, step, committed.checks, document) if certificate else committed.checks
            # Each node leader retires its old steps; the step ends once all did (a rank's steps() then agrees).
            comm.step("node-local save: retention", lambda: self._retire(step, kept))
        return saved_result(request, comm, planned, committed, stats, checks, stacklevel=3)

    def _certify(self, comm: Communicator, step: int, checks: Checks | None, document: bytes) -> Checks | None:
        """With ``SaveOptions(certify=...)``, after every node holds ``metadata.json``: when the checks (judged by
        the coordinator at the commit, the same on every rank) passed, one collective step writes the coordinator's
        ``certified.json`` (its bytes, broadcast: tied to the SHA-256 of ``document``, the same on every node) on
        every node, by its leader. A node that cannot write it makes the checks fail (a problem naming it); the
        step is committed whatever happens here. Returns the checks, the same on every rank."""
        if checks is None or not checks.passed:
            return checks
        record = None
        if comm.is_coordinator:
            digest = hashlib.sha256(document).hexdigest()
            record = Certificate(metadata_sha256=digest, checks=checks.checked, certified_at=time.time()).to_bytes()
        certificate = comm.broadcast_bytes(record)

        def local() -> str | None:
            if not self.is_leader:
                return None
            try:
                self.path_of(step).commit(CERTIFICATE_FILE, certificate, replace=True)
            except OSError as exc:
                return f"certified.json could not be written on node {self.node}: {exc}"
            return None

        problems = comm.step("node-local save: certificate on every node", local, lambda p: [x for x in p if x])
        if problems:
            return dataclasses.replace(checks, passed=False, problems=tuple(problems))
        return checks

    def _refuse_complete(self, comm: Communicator, step: int, *, parts: bool | None = None) -> None:
        """One collective step before a save: the ranks agree on ``node_size`` (CheckpointError on every rank, naming
        it, when not) and the nodes where ``step`` is complete already; CheckpointExistsError on every rank when
        there is one (the coordinator's commit would only see its own node). ``SaveOptions(metadata_parts=True)``
        on any rank is refused here: a node-local save copies one ``metadata.json`` to every node, and the parts of
        partitioned metadata would live on the coordinator's node only."""

        def local() -> tuple[int, bool]:
            if parts:
                raise CheckpointError(
                    "a node-local save cannot honour SaveOptions(metadata_parts=True): it copies one metadata.json "
                    "to every node, and the metadata's parts would live on the coordinator's node only"
                )
            return self.node_size, self.is_leader and (self.step_directory(step) / METADATA_FILE).exists()

        def combine(reports: list[tuple[int, bool]]) -> None:
            agree_on_node_size([size for size, _ in reports], f"node-local save of step {step}")
            nodes = sorted({node_of(r, self.node_size) for r, (_, f) in enumerate(reports) if f})
            if nodes:
                raise CheckpointExistsError(
                    f"step {step} is complete already in {self._location(step)} on nodes {nodes}: a node-local "
                    "save never replaces a step"
                )

        comm.step("node-local save: existing steps", local, combine)

    def _spread(self, comm: Communicator, step: int) -> tuple[list[int], bytes]:
        """After the commit, one collective step: the coordinator's ``metadata.json`` (its bytes, broadcast) on
        every other node, written by the node's leader after its ``data/`` is durable, and the data files of
        earlier failed saves of the step removed there; returns the steps retention keeps (the coordinator's
        judgement: its ``keep_last`` newest complete steps, the steps given to :meth:`keep`, this one) and the
        document.

        Raises:
            UnconfirmedCommitError: a node could not write it (the step is committed on the coordinator's node).
        """
        storage = self.path_of(step)
        raw = storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES) if comm.is_coordinator else None
        document = comm.broadcast_bytes(raw)

        def local() -> None:
            if self.is_leader:
                if not comm.is_coordinator:
                    publish_on_node(storage, document)
                remove_unlisted(storage, Metadata.from_json_bytes(document, lazy=True))

        def combine(_: list[None]) -> list[int]:
            complete = _complete_steps(self.directory)
            return sorted({*complete[-self.keep_last :], *self._kept, step})

        try:
            kept: list[int] = comm.step("node-local save: metadata on every node", local, combine)
        except CheckpointError as exc:
            if isinstance(exc, CommunicationError):
                raise
            raise UnconfirmedCommitError(
                f"step {step} was committed on the coordinator's node, but not every node holds its metadata: {exc}",
                path=storage.describe(),
                save_id=Metadata.from_json_bytes(document, lazy=True).save_id,
            ) from exc
        return kept, document

    def _retire(self, step: int, kept: list[int]) -> None:
        """Retention on this node (its leader; not collective): every step directory older than ``step`` that
        ``kept`` does not name, complete here or not, goes through :func:`~reshard.io.retirement.remove_checkpoint`,
        as the manager's retention: only files a reshard save wrote and something reshard wrote ties to it (its
        ``metadata.json``, a stale save lock, a record or marker) are deleted; a directory that is a symbolic link
        is left alone, and so are files nothing ties (a person's, or those of a failed save on a node without its
        lock), with a warning. Best effort: a failure is logged."""
        if not self.is_leader or not self.directory.is_dir():
            return
        root = LocalStorage(self.directory)
        for name in sorted(os.listdir(self.directory)):
            old = step_of(name)
            if old is None or old >= step or old in kept:
                continue
            _remove_step(root, name, "node-local retention")

    def discard(self, steps: set[int] | None = None, *, newer_than: int | None = None) -> None:
        """Remove ``steps``, and with ``newer_than`` every step directory newer than it, from every node (collective
        over the group; each node's leader removes its own copies, complete or not, whichever nodes hold them, as
        retention does: only files a save ties to the step, a symbolic link left alone, with a warning): steps of
        a timeline a restore abandoned, which a save of the same step would otherwise be refused for (a step
        complete on one node only is not restorable, yet blocks it). Best effort per node: a failure is logged."""
        chosen = {int(s) for s in steps or ()}

        def remove() -> None:
            if not self.is_leader or not self.directory.is_dir():
                return
            root = LocalStorage(self.directory)
            for name in sorted(os.listdir(self.directory)):
                step = step_of(name)
                if step is not None and (step in chosen or (newer_than is not None and step > newer_than)):
                    _remove_step(root, name, "node-local discard")

        self._comm().step("node-local: discard steps", remove)

    # ---- restorable, restore, drain ------------------------------------------------------------------------

    def restorable(self) -> list[int]:
        """The steps the group can restore whole (a ``metadata.json`` on some node, every data file it names on
        some node with its recorded size), oldest first. Collective over the group."""
        return list(self.restorable_saves())

    def restorable_saves(self) -> dict[int, str]:
        """:meth:`restorable`, each step with the digest of the ``metadata.json`` it would restore
        (:func:`reshard.metadata.document_digest`: which save it is, to compare with another tier's copy of the
        step). Collective over the group."""
        return restorable_steps(self._comm(), self)

    def restore(self, step: int, template: Any, **load_kwargs: Any) -> Any:
        """Restore ``step`` into ``template`` (any layout, any world size: the group restoring). Collective.

        First a file exchange gives each node every data file its ranks' loads read that it does not hold
        (sent by a rank of a node that holds it, in rounds of bounded bytes; each copy verified, size and every
        chunk checksum, before it is renamed into place; fetched files stay: they are valid files of the step),
        and ``metadata.json`` to nodes that lack it; then :func:`reshard.load` from this node's directory with
        ``load_kwargs`` (``strict``, ``options``, ...). Returns the loaded state dict.

        Raises:
            DataUnavailableError: (every rank) no node holds the step's metadata or some of its data files whole
                (named), before any byte moves.
            CorruptCheckpointError: (every rank) a copy does not match its checksums.
            CheckpointError: as :func:`reshard.load`.
        """
        return restore_step(self._comm(), self, step, template, load_kwargs)

    def drain(
        self,
        step: int,
        target: CheckpointLocation,
        *,
        group: Group = None,
        storage_options: dict[str, Any] | None = None,
        replaces: str | None = None,
    ) -> None:
        """Copy ``step`` to ``target`` (a step directory of durable storage: a path, URL or Storage): every data
        file by one rank of a node that holds it (balanced by bytes), each chunk verified as it is read and the
        copy read back once written, then the coordinator publishes the same ``metadata.json`` there
        (atomically, under the save lock): a normal checkpoint, byte-identical to the local one. Idempotent: a
        file already whole in ``target`` is not copied again, and a target already holding this step's
        ``metadata.json`` is done, so a drain killed at any point is simply run again. Collective over
        ``group`` (default: the group given at construction; a drain in a background thread passes its own).
        ``replaces``: the SHA-256 of a damaged or uncertified ``metadata.json`` in ``target`` that the drain may
        replace (as :func:`reshard.flows.save.save_replacing`; checked under the save lock).

        Raises:
            DataUnavailableError: no node holds the step whole (named files).
            CheckpointExistsError: ``target`` holds another checkpoint.
            CorruptCheckpointError: a local file or a copy does not match its checksums.
            CheckpointError, StorageError: the same on every rank; ``target`` has no ``metadata.json`` then.
        """
        comm = Communicator(self.group if group is None else group, timeout=self.timeout)
        drain_step(comm, self, step, target, storage_options, replaces=replaces)


def _remove_step(root: LocalStorage, name: str, why: str) -> None:
    """Remove step directory ``name`` of this node through :func:`~reshard.io.retirement.remove_checkpoint` (only
    files a reshard save wrote and something reshard wrote ties to it; a symbolic link is left alone). Best effort:
    a failure is logged."""
    if root.is_link(name):
        logger.warning("%s: %s is a symbolic link, left alone", why, root.describe(name))
        return
    storage = root.child(name)
    try:
        removal = remove_checkpoint(storage)
    except (OSError, CheckpointError) as exc:
        logger.warning("%s kept %s: %s", why, storage.describe(), exc)
        return
    finally:
        storage.close()
    if removal.left:
        logger.warning(
            "%s: %s keeps %d files that no reshard save wrote or records (%s)",
            why,
            storage.describe(),
            len(removal.left),
            ", ".join(removal.left[:5]),
        )


def _complete_steps(directory: Path) -> list[int]:
    """The steps whose directory under ``directory`` holds ``metadata.json``, oldest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    steps = [s for s in map(step_of, names) if s is not None]
    return sorted(s for s in steps if (directory / step_name(s) / METADATA_FILE).is_file())
