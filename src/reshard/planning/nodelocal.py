"""The schedules of node-local checkpoints (:mod:`reshard.flows.nodelocal`), pure: no I/O, no collectives.

A node-local save leaves each data file on the node of the rank that wrote it, and ``metadata.json`` on every
node. What the group holds of one step is one :class:`Holding` per node (reported by the node's leader, its
lowest rank); from those the coordinator judges whether the step can be restored whole (:func:`judge_step`),
which files each node must fetch from another for a restore and in which rounds the bytes move
(:func:`plan_fetches`), and which rank copies each file to durable storage for a drain (:func:`assign_drain`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reshard.errors import CheckpointError
from reshard.geometry.boxes import Box
from reshard.metadata import Metadata

__all__ = [
    "Holding",
    "Judgement",
    "RankFetches",
    "agree_on_node_size",
    "assign_drain",
    "judge_step",
    "needed_files",
    "node_directory",
    "node_of",
    "plan_fetches",
]

NODE_FIELD = "{node}"
"""The placeholder of a directory pattern that each rank formats with its node index."""


def node_of(rank: int, node_size: int) -> int:
    """The node index of group rank ``rank`` when every ``node_size`` consecutive ranks share a node."""
    return rank // node_size


def node_directory(pattern: str, node: int) -> str:
    """The directory of node ``node``: ``pattern`` with ``{node}`` replaced by the node index (a pattern without
    it is the same directory string on every node: each node's own local disk)."""
    return pattern.replace(NODE_FIELD, str(node))


def agree_on_node_size(node_sizes: Sequence[int], what: str) -> None:
    """On the coordinator, first in every node-local collective: every rank's ``node_size`` (in rank order) must be
    the same, since it decides each rank's node and each node's leader (no rank's value is used for the others).

    Raises:
        CheckpointError: they differ (the caller's step raises it on every rank), naming the ranks of each value.
    """
    by_value: dict[int, list[int]] = {}
    for rank, size in enumerate(node_sizes):
        by_value.setdefault(int(size), []).append(rank)
    if len(by_value) > 1:
        shown = "; ".join(f"node_size={size} on ranks {ranks}" for size, ranks in sorted(by_value.items()))
        raise CheckpointError(
            f"{what}: the ranks passed different node_size to NodeLocalCheckpoints ({shown}): every rank must pass "
            "the same; nothing was done"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Holding:
    """What one node holds of one step, as its leader (rank ``rank``) found it on its own disk: the SHA-256 of
    its ``metadata.json`` (None: none, or not a valid one), that document's size and the data files it names with
    their recorded sizes (``expected``), and the data files present with their sizes (``held``)."""

    node: int
    rank: int
    metadata: str | None = None
    metadata_size: int = 0
    expected: Mapping[str, int] = field(default_factory=dict)
    held: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "rank": self.rank,
            "metadata": self.metadata,
            "metadata_size": self.metadata_size,
            "expected": dict(self.expected),
            "held": dict(self.held),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Holding:
        return cls(
            node=int(doc["node"]),
            rank=int(doc["rank"]),
            metadata=None if doc["metadata"] is None else str(doc["metadata"]),
            metadata_size=int(doc["metadata_size"]),
            expected={str(k): int(v) for k, v in doc["expected"].items()},
            held={str(k): int(v) for k, v in doc["held"].items()},
        )

    def holds(self, name: str, size: int) -> bool:
        """Whether this node holds data file ``name`` whole by its size."""
        return self.held.get(name) == size


@dataclass(frozen=True, slots=True, kw_only=True)
class Judgement:
    """The coordinator's judgement of one step: the ``metadata.json`` chosen (its digest and size, and the rank
    that reads it: the leader of a node that holds it, the coordinator's own node first), and the data files it
    names that no node holds whole (``missing``, sorted; empty: the step can be restored whole)."""

    digest: str
    size: int
    source: int
    missing: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size, "source": self.source, "missing": list(self.missing)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Judgement:
        return cls(
            digest=str(doc["digest"]),
            size=int(doc["size"]),
            source=int(doc["source"]),
            missing=tuple(str(n) for n in doc["missing"]),
        )


def judge_step(holdings: Sequence[Holding]) -> Judgement | None:
    """Whether the nodes' ``holdings`` of one step restore it whole; None when no node holds a valid
    ``metadata.json``. Where nodes hold different documents (a save of the step again on some nodes only), the
    one whose files are all held wins, then the one of the lowest leader rank."""
    documents: dict[str, list[Holding]] = {}
    for holding in sorted(holdings, key=lambda h: h.rank):
        if holding.metadata is not None:
            documents.setdefault(holding.metadata, []).append(holding)
    judged = []
    for digest, with_it in documents.items():
        expected = with_it[0].expected
        missing = tuple(
            sorted(name for name, size in expected.items() if not any(h.holds(name, size) for h in holdings))
        )
        judged.append(Judgement(digest=digest, size=with_it[0].metadata_size, source=with_it[0].rank, missing=missing))
    if not judged:
        return None
    return min(judged, key=lambda j: (len(j.missing) > 0, j.source))


@dataclass(frozen=True, slots=True, kw_only=True)
class RankFetches:
    """One rank's part of a restore's file exchange: its rounds (each a list of sends and a list of receives,
    ``(peer, file, offset, length)``: bytes ``[offset, offset + length)`` of data file number ``file``), and the
    files it assembles from what it receives (written under a temporary name, verified, then renamed)."""

    rounds: tuple[tuple[tuple[tuple[int, int, int, int], ...], tuple[tuple[int, int, int, int], ...]], ...] = ()
    assembles: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "rounds": [[[list(s) for s in sends], [list(r) for r in recvs]] for sends, recvs in self.rounds],
            "assembles": list(self.assembles),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> RankFetches:
        def moves(items: Sequence[Sequence[int]]) -> tuple[tuple[int, int, int, int], ...]:
            return tuple((int(a), int(b), int(c), int(d)) for a, b, c, d in items)

        return cls(
            rounds=tuple((moves(sends), moves(recvs)) for sends, recvs in doc["rounds"]),
            assembles=tuple(int(f) for f in doc["assembles"]),
        )


def _least_loaded(ranks: Sequence[int], load: dict[int, int]) -> int:
    return min(ranks, key=lambda r: (load.get(r, 0), r))


def plan_fetches(
    sizes: Sequence[int],
    needs: Sequence[Sequence[int]],
    rank_nodes: Sequence[int],
    held: Mapping[int, set[int]],
    *,
    round_bytes: int,
) -> list[RankFetches]:
    """On the coordinator: every rank's part of the exchange that gives each node every data file its ranks
    need (``needs[r]``: file numbers rank ``r``'s load reads; ``sizes[f]``: file ``f``'s bytes; ``held[node]``:
    the files node ``node`` holds whole). Each file a node lacks is assembled by one of its ranks and sent by
    one rank of a node that holds it (both chosen by the fewest bytes so far, largest files first), in pieces of
    at most ``round_bytes``; a round gives each rank at most ``round_bytes`` to send and to receive, one message
    per pair of ranks, and a file's pieces in order.

    Raises:
        CheckpointError: a needed file no node holds (the caller checks that first: a bug, not damage).
    """
    if round_bytes < 1:
        raise CheckpointError(f"round_bytes must be positive, got {round_bytes}")
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        by_node.setdefault(node, []).append(rank)
    wanted = {(rank_nodes[r], f) for r, files in enumerate(needs) for f in files}
    fetches = sorted((f, n) for n, f in wanted if f not in held.get(n, set()))
    fetches.sort(key=lambda fn: (-sizes[fn[0]], fn))
    sent: dict[int, int] = {}
    got: dict[int, int] = {}
    queue: list[list[tuple[int, int, int, int, int]]] = []  # per fetch: its pieces (src, dst, file, off, len)
    for file, node in fetches:
        sources = [r for n, ranks in sorted(by_node.items()) if file in held.get(n, set()) for r in ranks]
        if not sources:
            raise CheckpointError(f"data file number {file} is held by no node")
        src, dst = _least_loaded(sources, sent), _least_loaded(by_node[node], got)
        sent[src] = sent.get(src, 0) + sizes[file]
        got[dst] = got.get(dst, 0) + sizes[file]
        pieces = [
            (src, dst, file, offset, min(round_bytes, sizes[file] - offset))
            for offset in range(0, sizes[file], round_bytes)
        ] or [(src, dst, file, 0, 0)]
        queue.append(pieces)
    rounds = _rounds(queue, round_bytes)
    out = []
    for rank in range(len(rank_nodes)):
        mine = tuple(
            (
                tuple((d, f, o, n) for s, d, f, o, n in rnd if s == rank),
                tuple((s, f, o, n) for s, d, f, o, n in rnd if d == rank),
            )
            for rnd in rounds
        )
        assembles = tuple(sorted({f for pieces in queue for s, d, f, _, _ in pieces[:1] if d == rank}))
        out.append(RankFetches(rounds=mine, assembles=assembles))
    return out


def _rounds(
    queue: list[list[tuple[int, int, int, int, int]]], round_bytes: int
) -> list[list[tuple[int, int, int, int, int]]]:
    """The pieces of ``queue`` (one list per file, in order) in rounds: each round takes, file by file, the next
    piece of every file whose sender, receiver and pair still have room in it."""
    rounds: list[list[tuple[int, int, int, int, int]]] = []
    at = [0] * len(queue)
    while any(at[i] < len(q) for i, q in enumerate(queue)):
        out_bytes: dict[int, int] = {}
        in_bytes: dict[int, int] = {}
        pairs: set[tuple[int, int]] = set()
        taken = []
        for i, pieces in enumerate(queue):
            if at[i] == len(pieces):
                continue
            src, dst, file, offset, length = pieces[at[i]]
            if (src, dst) in pairs or out_bytes.get(src, 0) + length > round_bytes:
                continue
            if in_bytes.get(dst, 0) + length > round_bytes:
                continue
            pairs.add((src, dst))
            out_bytes[src] = out_bytes.get(src, 0) + length
            in_bytes[dst] = in_bytes.get(dst, 0) + length
            taken.append((src, dst, file, offset, length))
            at[i] += 1
        rounds.append(taken)
    return rounds


def assign_drain(
    sizes: Sequence[int], holders: Mapping[int, Sequence[int]], rank_nodes: Sequence[int]
) -> list[list[int]]:
    """On the coordinator: the files each rank copies to durable storage in a drain: every file (``holders[f]``:
    the nodes that hold file ``f`` whole) to one rank of a node that holds it, the one with the fewest bytes so
    far, largest files first.

    Raises:
        CheckpointError: a file no node holds (the caller checks that first).
    """
    by_node: dict[int, list[int]] = {}
    for rank, node in enumerate(rank_nodes):
        by_node.setdefault(node, []).append(rank)
    load: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in rank_nodes]
    for file in sorted(range(len(sizes)), key=lambda f: (-sizes[f], f)):
        ranks = [r for n in holders.get(file, ()) for r in by_node.get(n, [])]
        if not ranks:
            raise CheckpointError(f"data file number {file} is held by no node")
        rank = _least_loaded(ranks, load)
        load[rank] = load.get(rank, 0) + sizes[file]
        out[rank].append(file)
    return out


def needed_files(metadata: Metadata, pieces: Sequence[tuple[str, Box]], objects: Sequence[str] = ()) -> set[int]:
    """The data files (numbers) a load of ``pieces`` (key, box of the global tensor) and of the object keys
    ``objects`` reads: those holding a stored box that overlaps a piece, and every file holding a cell of one of
    the objects (objects are small: every cell's file, whatever grid the load regrids to)."""
    files: set[int] = set()
    for key, box in pieces:
        saved = metadata.tensors.get(key)
        if saved is None:
            continue
        for stored in saved.boxes:
            if stored.file not in files and Box(tuple(stored.offset), tuple(stored.shape)).intersect(box) is not None:
                files.add(stored.file)
    for key in objects:
        saved_object = metadata.objects.get(key)
        if saved_object is not None:
            files.update(e.file for e in saved_object.entries)
    return files
