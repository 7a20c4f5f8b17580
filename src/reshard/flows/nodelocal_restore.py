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
  copy read back), *publish* (the coordinator commits the same ``metadata.json`` with the commit protocol).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from reshard.errors import CorruptCheckpointError, DataUnavailableError
from reshard.flows.load import load
from reshard.flows.load_phases import match_template
from reshard.flows.options import LoadOptions
from reshard.flows.steps import step_of
from reshard.io.commit import SaveCommit
from reshard.io.nodefiles import copy_verified, publish_on_node, read_holding, run_fetches
from reshard.metadata import MAX_METADATA_BYTES, METADATA_FILE, Metadata
from reshard.net.comm import Communicator
from reshard.net.transports import Group
from reshard.planning.nodelocal import (
    Holding,
    Judgement,
    RankFetches,
    assign_drain,
    judge_step,
    needed_files,
    node_of,
    plan_fetches,
)
from reshard.storage import CheckpointLocation, LocalStorage, storage_for

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
    """One collective step: every node's leader reports what its directory holds of ``step``; the coordinator
    judges it (DataUnavailableError on every rank when no node holds its metadata or some file)."""
    kept: list[list[Holding]] = []

    def local() -> dict[str, Any] | None:
        if not _leader(comm, site):
            return None
        return read_holding(
            site.step_directory(step), node=node_of(comm.rank, site.node_size), rank=comm.rank
        ).to_json()

    def combine(docs: list[dict[str, Any] | None]) -> dict[str, Any]:
        holdings = [Holding.from_json(d) for d in docs if d is not None]
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


def restorable_steps(comm: Communicator, site: Site) -> list[int]:
    """The steps the group can restore whole, oldest first (one collective step)."""

    def local() -> dict[str, Any] | None:
        if not _leader(comm, site):
            return None
        node = node_of(comm.rank, site.node_size)
        try:
            names = sorted(p.name for p in site.directory.iterdir())
        except OSError:
            names = []
        found = [s for s in map(step_of, names) if s is not None]
        return {str(s): read_holding(site.step_directory(s), node=node, rank=comm.rank).to_json() for s in found}

    def combine(docs: list[dict[str, Any] | None]) -> list[int]:
        by_step: dict[int, list[Holding]] = {}
        for doc in docs:
            for name, holding in (doc or {}).items():
                by_step.setdefault(int(name), []).append(Holding.from_json(holding))
        out = []
        for number, holdings in sorted(by_step.items()):
            judgement = judge_step(holdings)
            if judgement is not None and not judgement.missing:
                out.append(number)
        return out

    return [int(s) for s in comm.step("node-local: restorable steps", local, combine)]


def _needs(template: Any, metadata: Metadata, rank: int, load_kwargs: dict[str, Any]) -> bytes:
    """This rank's needed files (as JSON) for its load of ``template``."""
    options = load_kwargs.get("options") or LoadOptions()
    matched = match_template(
        template, metadata, rank=rank, strict=bool(load_kwargs.get("strict", True)), options=options
    )
    pieces = [(key, piece.box) for key, piece in zip(matched.keys, matched.pieces, strict=True)]
    return json.dumps(sorted(needed_files(metadata, pieces, [o.key for o in matched.objects]))).encode()


def plan_phase(
    comm: Communicator, site: Site, metadata: Metadata, held: _Holdings, template: Any, load_kwargs: dict[str, Any]
) -> RankFetches:
    """One collective step: each rank sends the files its load reads; the coordinator schedules the fetches
    (:func:`~reshard.planning.nodelocal.plan_fetches`) and sends each rank its part."""
    options = load_kwargs.get("options") or LoadOptions()
    round_bytes = max(4096, min(FETCH_ROUND_BYTES, options.memory_budget_bytes // 2))

    def combine(payloads: list[bytes]) -> tuple[None, list[bytes]]:
        index = {f.path: i for i, f in enumerate(metadata.files)}
        by_node = {
            h.node: {index[n] for n, size in h.held.items() if n in index and metadata.files[index[n]].size == size}
            for h in held.holdings
        }
        plans = plan_fetches(
            [f.size for f in metadata.files],
            [json.loads(p) for p in payloads],
            [node_of(r, site.node_size) for r in range(comm.size)],
            by_node,
            round_bytes=round_bytes,
        )
        return None, [json.dumps(p.to_json()).encode() for p in plans]

    _, mine = comm.step_scatter(
        "node-local restore: planning the exchange", lambda: _needs(template, metadata, comm.rank, load_kwargs), combine
    )
    return RankFetches.from_json(json.loads(mine))


def restore_step(comm: Communicator, site: Site, step: int, template: Any, load_kwargs: dict[str, Any]) -> Any:
    """:meth:`reshard.NodeLocalCheckpoints.restore` (collective): the phases of the module doc, then the load."""
    held = holdings_phase(comm, site, step)
    metadata, document = metadata_phase(comm, site, step, held.judgement)
    fetches = plan_phase(comm, site, metadata, held, template, load_kwargs)
    directory = site.step_directory(step)
    comm.step("node-local restore: fetching files", lambda: run_fetches(comm.transport, fetches, directory, metadata))

    def complete_node() -> None:
        if _leader(comm, site) and not (directory / METADATA_FILE).exists():
            publish_on_node(LocalStorage(directory), document)

    comm.step("node-local restore: metadata on every node", complete_node)
    return load(template, str(directory), group=site.group, timeout=site.timeout, **load_kwargs)


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
        if decided["done"]:
            return
        mine = [int(f) for f in decided["assign"][comm.rank]]
        directory = site.step_directory(step)
        comm.step(
            "node-local drain: copying files", lambda: [copy_verified(directory, storage, metadata, f) for f in mine]
        )
        comm.step("node-local drain: publish", lambda: None, lambda _: protocol[0].publish(document))
    finally:
        for commit in protocol:
            commit.release_lock()  # never discard: the files copied are the step's, kept for the next run
        if storage is not target:
            storage.close()
