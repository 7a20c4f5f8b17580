"""The collective flows of node-local checkpoints that read a step back: which steps the group can restore, a
restore into any layout, and a drain to durable storage (:class:`reshard.NodeLocalCheckpoints` calls them).

Each flow is a short list of phases, one collective step each, over the nodes' holdings (:mod:`reshard.planning.
nodelocal`, reported by each node's leader) and the byte moves of :mod:`reshard.io.nodefiles`:

- restore: *holdings* (the coordinator judges the step: DataUnavailableError naming the files no node holds,
  before any byte moves), *metadata* (the chosen ``metadata.json`` to every rank, its digest checked),
  *planning* (each rank's needed files from its template; the coordinator schedules the fetches), *fetching*
  (the rounds, each copy verified and renamed), *metadata on every node*, then :func:`reshard.load`;
- drain: *holdings*, *metadata*, *plan* (the coordinator takes the target's save lock, or finds the step there
  already, and assigns each file to one rank of a node that holds it), *copy* (each chunk verified as read, the
  copy read back), *publish* (the coordinator commits the same ``metadata.json`` with the commit protocol),
  *certificate* (the source node's ``certified.json``, when it certifies that document, copied after it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from reshard.errors import CorruptCheckpointError, DataUnavailableError
from reshard.flows.certify import CERTIFICATE_FILE, MAX_CERTIFICATE_BYTES, certificate_status
from reshard.flows.load import load
from reshard.flows.load_phases import match_template
from reshard.flows.options import LoadOptions
from reshard.flows.steps import step_of
from reshard.io.commit import SaveCommit
from reshard.io.nodefiles import copy_verified, is_whole, publish_on_node, read_holding, run_fetches
from reshard.metadata import MAX_METADATA_BYTES, METADATA_FILE, Metadata
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.planning.nodelocal import (
    Holding,
    Judgement,
    RankFetches,
    agree_on_node_size,
    assign_drain,
    judge_step,
    needed_files,
    node_of,
    plan_fetches,
)
from reshard.storage import CheckpointLocation, LocalStorage, Storage, storage_for

__all__ = ["FETCH_ROUND_BYTES", "Site", "drain_step", "restorable_steps", "restore_step"]

FETCH_ROUND_BYTES = 64 * 1024 * 1024
"""The most a rank sends (and receives) in one round of a restore's file exchange, unless the load's memory
budget is smaller (then half of it)."""


class Site(Protocol):
    """Where a rank's node-local checkpoints live (:class:`reshard.NodeLocalCheckpoints`)."""

    node_size: int
    directory: Path
    group: Group
    timeout: Any

    def step_directory(self, step: int) -> Path: ...


@dataclass(frozen=True, slots=True)
class _Holdings:
    """What the holdings step leaves: the judgement (every rank) and the nodes' holdings (the coordinator)."""

    judgement: Judgement
    holdings: tuple[Holding, ...] = ()


def _leader(comm: Communicator, site: Site) -> bool:
    return comm.rank % site.node_size == 0


def _judged(step: int, holdings: list[Holding]) -> Judgement:
    """The coordinator's judgement of ``step``; DataUnavailableError when it cannot be restored whole."""
    judgement = judge_step(holdings)
    if judgement is None:
        raise DataUnavailableError(f"node-local step {step}: no node holds a valid metadata.json of it")
    if judgement.missing:
        shown = ", ".join(judgement.missing[:20]) + (" ..." if len(judgement.missing) > 20 else "")
        raise DataUnavailableError(
            f"node-local step {step}: {len(judgement.missing)} data files are held whole by no node of the group: "
            f"{shown}"
        )
    return judgement


def holdings_phase(comm: Communicator, site: Site, step: int) -> _Holdings:
    """One collective step: every node's leader reports what its directory holds of ``step``, every rank its
    ``node_size`` (CheckpointError on every rank when they differ); the coordinator judges it
    (DataUnavailableError on every rank when no node holds its metadata or some file)."""
    kept: list[list[Holding]] = []

    def local() -> tuple[int, dict[str, Any] | None]:
        if not _leader(comm, site):
            return site.node_size, None
        holding = read_holding(site.step_directory(step), node=node_of(comm.rank, site.node_size), rank=comm.rank)
        return site.node_size, holding.to_json()

    def combine(reports: list[tuple[int, dict[str, Any] | None]]) -> dict[str, Any]:
        agree_on_node_size([size for size, _ in reports], f"node-local step {step}")
        holdings = [Holding.from_json(d) for _, d in reports if d is not None]
        kept.append(holdings)
        return _judged(step, holdings).to_json()

    judgement = Judgement.from_json(comm.step("node-local: holdings", local, combine))
    return _Holdings(judgement, tuple(kept[0]) if kept else ())


def metadata_phase(comm: Communicator, site: Site, step: int, judgement: Judgement) -> tuple[Metadata, bytes]:
    """The chosen ``metadata.json`` on every rank: its holder sends it to the coordinator (point to point, where
    they differ), which broadcasts it; every rank checks its digest (CorruptCheckpointError on every rank when it
    does not match: the bytes are the same everywhere)."""
    raw = b""
    if comm.rank == judgement.source:
        try:
            raw = (site.step_directory(step) / METADATA_FILE).read_bytes()
        except OSError:
            raw = b""
    if judgement.source != 0:
        buffer = torch.zeros(judgement.size, dtype=torch.uint8)
        if comm.rank == judgement.source and len(raw) == judgement.size:
            buffer = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        device = comm.transport.device
        sends = [(0, buffer.to(device))] if comm.rank == judgement.source else []
        receives = (
            [(judgement.source, torch.empty(judgement.size, dtype=torch.uint8, device=device))]
            if comm.rank == 0
            else []
        )
        comm.transport.exchange(sends, receives)
        if receives:
            raw = receives[0][1].cpu().numpy().tobytes()
    document = comm.broadcast_bytes(raw if comm.is_coordinator else None)
    if hashlib.sha256(document).hexdigest() != judgement.digest:
        raise CorruptCheckpointError(
            f"node-local step {step}: the metadata.json of rank {judgement.source}'s node changed while it was read"
        )
    return Metadata.from_json_bytes(document, where=f"node-local step {step} metadata.json"), document


def restorable_steps(comm: Communicator, site: Site) -> dict[int, str]:
    """The steps the group can restore whole, oldest first, each with the digest of the ``metadata.json`` it would
    restore (:func:`reshard.metadata.document_digest`: which save it is); one collective step, CheckpointError on
    every rank when the ranks' ``node_size`` differ."""

    def local() -> tuple[int, dict[str, Any] | None]:
        if not _leader(comm, site):
            return site.node_size, None
        node = node_of(comm.rank, site.node_size)
        try:
            names = sorted(p.name for p in site.directory.iterdir())
        except OSError:
            names = []
        found = [s for s in map(step_of, names) if s is not None]
        return site.node_size, {
            str(s): read_holding(site.step_directory(s), node=node, rank=comm.rank).to_json() for s in found
        }

    def combine(reports: list[tuple[int, dict[str, Any] | None]]) -> dict[str, str]:
        agree_on_node_size([size for size, _ in reports], "node-local restorable steps")
        by_step: dict[int, list[Holding]] = {}
        for _, doc in reports:
            for name, holding in (doc or {}).items():
                by_step.setdefault(int(name), []).append(Holding.from_json(holding))
        out = {}
        for number, holdings in sorted(by_step.items()):
            judgement = judge_step(holdings)
            if judgement is not None and not judgement.missing:
                out[str(number)] = judgement.digest
        return out

    found = comm.step("node-local: restorable steps", local, combine)
    return {int(step): str(digest) for step, digest in found.items()}


def _needs(template: Any, metadata: Metadata, rank: int, load_kwargs: dict[str, Any]) -> bytes:
    """This rank's needed files (as JSON) for its load of ``template``."""
    options = load_kwargs.get("options") or LoadOptions()
    matched = match_template(
        template, metadata, rank=rank, strict=bool(load_kwargs.get("strict", True)), options=options
    )
    pieces = [(key, piece.box) for key, piece in zip(matched.keys, matched.pieces, strict=True)]
    return json.dumps(sorted(needed_files(metadata, pieces, [o.key for o in matched.objects]))).encode()


def _verifications(
    metadata: Metadata, held: _Holdings, needs: list[list[int]], rank_nodes: list[int]
) -> list[list[int]]:
    """On the coordinator: which held copies each rank verifies before the exchange: every file a node's ranks
    need that the node holds with its recorded size, each by one rank of that node (the fewest bytes so far)."""
    index = {f.path: i for i, f in enumerate(metadata.files)}
    holds = {
        h.node: {index[n] for n, size in h.held.items() if n in index and metadata.files[index[n]].size == size}
        for h in held.holdings
    }
    wanted = sorted({(rank_nodes[r], f) for r, files in enumerate(needs) for f in files})
    work: list[list[int]] = [[] for _ in rank_nodes]
    load: dict[int, int] = {}
    for node, file in wanted:
        if file in holds.get(node, set()):
            ranks = [r for r, n in enumerate(rank_nodes) if n == node]
            rank = min(ranks, key=lambda r: (load.get(r, 0), r))
            load[rank] = load.get(rank, 0) + metadata.files[file].size
            work[rank].append(file)
    return work


def _good_holdings(
    metadata: Metadata, held: _Holdings, bad: set[tuple[int, int]], verified: set[tuple[int, int]]
) -> dict[int, set[int]]:
    """The files each node holds whole for the exchange: not those whose copy failed verification (``bad``, as
    (node, file)), and, for a file some node verified whole (``verified``), only the verified copies."""
    index = {f.path: i for i, f in enumerate(metadata.files)}
    proven = {f for _, f in verified}
    by_node: dict[int, set[int]] = {}
    for h in held.holdings:
        files = {index[n] for n, size in h.held.items() if n in index and metadata.files[index[n]].size == size}
        by_node[h.node] = {f for f in files if (h.node, f) not in bad and (f not in proven or (h.node, f) in verified)}
    return by_node


def plan_phase(
    comm: Communicator,
    site: Site,
    directory: Path,
    metadata: Metadata,
    held: _Holdings,
    template: Any,
    load_kwargs: dict[str, Any],
) -> RankFetches:
    """Two collective steps over this node's step ``directory``. First each rank sends the files its load reads;
    the coordinator gives each rank the held copies of its node to verify (:func:`_verifications`). Then each
    rank verifies those (size and every chunk checksum: a copy damaged since it was written or fetched) and
    reports the bad ones; the coordinator schedules the fetches (:func:`~reshard.planning.nodelocal.plan_fetches`)
    from verified copies, so that a node whose copy is bad fetches the file again from a node that holds it whole
    (the new copy replaces the bad one), and sends each rank its part.

    Raises:
        CorruptCheckpointError: (every rank) a needed file's only copies failed verification (named).
    """
    options = load_kwargs.get("options") or LoadOptions()
    round_bytes = max(4096, min(FETCH_ROUND_BYTES, options.memory_budget_bytes // 2))
    rank_nodes = [node_of(r, site.node_size) for r in range(comm.size)]
    needs: list[list[int]] = []

    def assign(payloads: list[bytes]) -> tuple[None, list[bytes]]:
        needs.extend(json.loads(p) for p in payloads)
        return None, [json.dumps(w).encode() for w in _verifications(metadata, held, needs, rank_nodes)]

    _, work = comm.step_scatter(
        "node-local restore: planning the exchange",
        lambda: _needs(template, metadata, comm.rank, load_kwargs),
        assign,
    )
    storage = LocalStorage(directory)

    def verify() -> bytes:
        mine = [int(f) for f in json.loads(work)]
        return json.dumps([[f, is_whole(storage, metadata, f)] for f in mine]).encode()

    def schedule(payloads: list[bytes]) -> tuple[None, list[bytes]]:
        bad: set[tuple[int, int]] = set()
        verified: set[tuple[int, int]] = set()
        for rank, payload in enumerate(payloads):
            for file, whole in json.loads(payload):
                (verified if whole else bad).add((rank_nodes[rank], int(file)))
        by_node = _good_holdings(metadata, held, bad, verified)
        _refuse_lost(metadata, bad, by_node, needs, rank_nodes)
        plans = plan_fetches([f.size for f in metadata.files], needs, rank_nodes, by_node, round_bytes=round_bytes)
        return None, [json.dumps(p.to_json()).encode() for p in plans]

    _, mine = comm.step_scatter("node-local restore: verifying held copies", verify, schedule)
    return RankFetches.from_json(json.loads(mine))


def _refuse_lost(
    metadata: Metadata,
    bad: set[tuple[int, int]],
    by_node: dict[int, set[int]],
    needs: list[list[int]],
    rank_nodes: list[int],
) -> None:
    """CorruptCheckpointError when a file some rank needs is held whole by no node once the bad copies are out."""
    whole = {f for files in by_node.values() for f in files}
    lost = sorted({f for files in needs for f in files if f not in whole})
    if lost:
        damaged = sorted({f"{metadata.files[f].path} on node {n}" for n, f in bad if f in lost})
        raise CorruptCheckpointError(
            f"{len(lost)} data files the restore reads are held whole by no node: the copies there do not match "
            f"their checksums ({', '.join(damaged[:20])})"
        )


def restore_step(comm: Communicator, site: Site, step: int, template: Any, load_kwargs: dict[str, Any]) -> Any:
    """:meth:`reshard.NodeLocalCheckpoints.restore` (collective): the phases of the module doc, then the load."""
    held = holdings_phase(comm, site, step)
    metadata, document = metadata_phase(comm, site, step, held.judgement)
    directory = site.step_directory(step)
    fetches = plan_phase(comm, site, directory, metadata, held, template, load_kwargs)
    comm.step("node-local restore: fetching files", lambda: run_fetches(comm.transport, fetches, directory, metadata))

    def complete_node() -> None:
        if _leader(comm, site) and not (directory / METADATA_FILE).exists():
            publish_on_node(LocalStorage(directory), document)

    comm.step("node-local restore: metadata on every node", complete_node)
    return load(template, str(directory), group=site.group, timeout=site.timeout, **load_kwargs)


def _copy_certificate(comm: Communicator, site: Site, step: int, judgement: Judgement, target: Storage) -> None:
    """On the rank whose node's ``metadata.json`` the drain published (``judgement.source``), after the publish:
    copy that node's ``certified.json`` to ``target`` when it is a valid certificate of that very document (so
    the durable copy is file for file the local one, certified too); nothing when the step is not certified
    there. A drain run again after a cut here copies it then."""
    if comm.rank != judgement.source:
        return
    local = LocalStorage(site.step_directory(step))
    record, _ = certificate_status(local)
    if record is None or record.metadata_sha256 != judgement.digest:
        return
    raw = local.read_bytes(CERTIFICATE_FILE, max_bytes=MAX_CERTIFICATE_BYTES)
    try:
        found: bytes | None = target.read_bytes(CERTIFICATE_FILE, max_bytes=MAX_CERTIFICATE_BYTES)
    except FileNotFoundError:
        found = None
    if found != raw:
        target.commit(CERTIFICATE_FILE, raw, replace=True)


def drain_step(
    comm: Communicator,
    site: Site,
    step: int,
    target: CheckpointLocation,
    storage_options: dict[str, Any] | None,
    *,
    replaces: str | None = None,
) -> None:
    """:meth:`reshard.NodeLocalCheckpoints.drain` (collective): the phases of the module doc."""
    held = holdings_phase(comm, site, step)
    metadata, document = metadata_phase(comm, site, step, held.judgement)
    storage = storage_for(target, storage_options)
    protocol: list[SaveCommit] = []

    def begin(_: list[None]) -> dict[str, Any]:
        try:
            found = storage.read_bytes(METADATA_FILE, max_bytes=MAX_METADATA_BYTES)
        except FileNotFoundError:
            found = None
        if found == document:
            return {"done": True, "assign": []}
        commit = SaveCommit(storage, metadata.save_id, overwrite=False, replaces=replaces)
        commit.begin()  # the save lock (CheckpointExistsError: another checkpoint is there)
        protocol.append(commit)
        holders: dict[int, list[int]] = {}
        for i, f in enumerate(metadata.files):
            holders[i] = [h.node for h in held.holdings if h.holds(f.path, f.size)]
        rank_nodes = [node_of(r, site.node_size) for r in range(comm.size)]
        return {"done": False, "assign": assign_drain([f.size for f in metadata.files], holders, rank_nodes)}

    try:
        decided = comm.step("node-local drain: plan", lambda: None, begin)
        if not decided["done"]:
            mine = [int(f) for f in decided["assign"][comm.rank]]
            directory = site.step_directory(step)
            comm.step(
                "node-local drain: copying files",
                lambda: [copy_verified(directory, storage, metadata, f) for f in mine],
            )
            comm.step("node-local drain: publish", lambda: None, lambda _: protocol[0].publish(document))
        comm.step("node-local drain: certificate", lambda: _copy_certificate(comm, site, step, held.judgement, storage))
    finally:
        for commit in protocol:
            commit.release_lock()  # never discard: the files copied are the step's, kept for the next run
        if storage is not target:
            storage.close()
