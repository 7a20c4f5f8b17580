"""A peer-memory checkpoint tier: each rank's unique boxes kept in host memory and copied to ranks of
other nodes, restored after a failure into **another layout** with nothing read from storage.

:meth:`PeerMemoryCheckpoint.save` keeps a copy of every primary box this rank holds (replicas other than
the primary are not kept: the primary's copies stand for them) and sends it to ``replicas`` peers, each on
another node (rank ``r``'s peers are ``r + node_size``, ``r + 2 * node_size``, ... modulo the world size,
so losing a whole node loses no box while ``replicas >= 1``). Common values are kept on every rank.

After ranks die, the survivors (and any new ranks, with a fresh object) form a new process group and call
:meth:`PeerMemoryCheckpoint.restore` with templates of the new layout (another world size, TP, PP, DP):
every box comes from whichever survivor holds a copy, over :func:`reshard.transfer`, bit-exactly. When some
box has no surviving copy the restore says which (:class:`~reshard.DataUnavailableError`) or, given a
``fallback`` manager, loads the latest durable checkpoint instead, with a warning that names what was lost.

What is durable: nothing. This tier survives the loss of any set of ranks that leaves a copy of every box
(with ``replicas=k``, any ``k`` whole nodes); a storage checkpoint (:class:`~reshard.CheckpointManager`)
remains the durable tier behind it. ShardedObjects (per-rank Python values) are not kept: they raise.
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from reshard.codec import decode_tagged, encode_tagged
from reshard.comm import Communicator
from reshard.dtensor import is_dtensor
from reshard.dtypes import DTYPE_BY_NAME, dtype_name
from reshard.errors import DataUnavailableError, StateDictError
from reshard.io.device import copy_to_host
from reshard.sharding import ShardedTensor
from reshard.statedict import filter_state_dict, flatten_state_dict, map_leaves
from reshard.transfer import TransferStats, transfer
from reshard.transports import Group

if TYPE_CHECKING:
    from reshard.manager import CheckpointManager

__all__ = ["PeerMemoryCheckpoint", "PeerSaveResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSaveResult:
    """What one rank's :meth:`PeerMemoryCheckpoint.save` keeps: its own primary bytes and the bytes of the
    copies it holds for its peers."""

    own_bytes: int
    copy_bytes: int


class PeerMemoryCheckpoint:
    """The in-memory checkpoint tier of one rank. Create one per rank; :meth:`save` and :meth:`restore`
    are collective over the group they are given.

    Args:
        replicas: copies of every box kept on other nodes (at least 1).
        node_size: ranks per node: a rank's copies go to ranks of other nodes (``rank // node_size`` is its
            node). Default: ``LOCAL_WORLD_SIZE`` from the launcher's environment, else 1.
        timeout: how long each collective may wait for the slowest rank.
    """

    def __init__(
        self,
        *,
        replicas: int = 1,
        node_size: int | None = None,
        timeout: datetime.timedelta | float | None = None,
    ) -> None:
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        self.replicas = replicas
        self.node_size = node_size if node_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if self.node_size < 1:
            raise ValueError(f"node_size must be at least 1, got {self.node_size}")
        self.timeout = timeout
        self._held: dict[str, ShardedTensor] = {}
        self._common: str | None = None  # the encoded common values of the last save

    def save(self, state_dict: Any, *, group: Group = None) -> PeerSaveResult:
        """Keep this rank's primary boxes in host memory and copy them to ``replicas`` peers on other nodes.
        Called by every rank of ``group``; replaces the previous save (its memory is released first).

        Raises:
            StateDictError: the state holds ShardedObjects.
            ValueError: the group has too few nodes for ``replicas`` copies on other nodes.
        """
        comm = Communicator(group, timeout=self.timeout)
        nodes = -(-comm.size // self.node_size)
        if nodes <= self.replicas:
            raise ValueError(
                f"{comm.size} ranks of {self.node_size} per node make {nodes} nodes: too few for "
                f"{self.replicas} copies on other nodes"
            )
        flat = flatten_state_dict(state_dict, rank=comm.rank)
        if flat.objects:
            names = ", ".join(repr(o.key) for o in flat.objects[:10])
            raise StateDictError(f"the peer-memory tier keeps tensors and common values, not ShardedObjects: {names}")
        self._held = {}
        own: dict[str, ShardedTensor] = {}
        described: list[list[Any]] = []
        to_host: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensor in flat.tensors:
            if not tensor.is_main_replica:
                continue
            for piece in tensor.pieces():
                copy = torch.empty(piece.view.shape, dtype=piece.view.dtype)
                to_host.append((copy, piece.view))
                path = f"own/{len(own)}"
                own[path] = ShardedTensor(tensor.key, copy, tensor.saved_shape, piece.box.offset)
                box = [list(piece.box.offset), list(copy.shape)]
                described.append([tensor.key, list(tensor.saved_shape), *box, dtype_name(copy.dtype)])
        copy_to_host(to_host)  # GPU pieces on a side stream, one wait for them all
        common = json.dumps({p: encode_tagged(v, where=p) for p, v in flat.common.items()}, sort_keys=True)

        def assign(payloads: list[bytes]) -> tuple[str, list[bytes]]:
            """On the coordinator: what each rank keeps for which peers, and the common values of rank 0."""
            docs = [json.loads(p) for p in payloads]
            keep: list[list[Any]] = [[] for _ in docs]
            for owner, doc in enumerate(docs):
                for j in range(1, self.replicas + 1):
                    keep[(owner + j * self.node_size) % len(docs)].extend(doc["boxes"])
            return docs[0]["common"], [json.dumps(k).encode() for k in keep]

        payload = json.dumps({"boxes": described, "common": common}).encode()
        self._common, reply = comm.step_scatter("peer-memory save planning", lambda: payload, assign)
        copies: dict[str, ShardedTensor] = {}
        for key, shape, offset, box_shape, dtype in json.loads(reply):
            data = torch.empty(box_shape, dtype=DTYPE_BY_NAME[dtype])
            copies[f"copy/{len(copies)}"] = ShardedTensor(key, data, tuple(shape), tuple(offset))
        transfer(own, copies, group=comm.transport, timeout=self.timeout)
        self._held = {**own, **copies}
        return PeerSaveResult(own_bytes=_nbytes(own), copy_bytes=_nbytes(copies))

    def restore(
        self,
        template: Any,
        *,
        group: Group = None,
        fallback: CheckpointManager | None = None,
        stats: TransferStats | None = None,
    ) -> Any:
        """Fill ``template`` (any layout) from the copies the ranks of ``group`` hold; nothing is read from
        storage. Called by every rank of the new group: survivors with the object that saved, new ranks
        with a fresh one. Common values come from any rank that holds them.

        Args:
            template: what this rank needs, as for :func:`reshard.load` (tensors and common values).
            group: the new group (survivors and new ranks).
            fallback: a manager of the durable checkpoints: when some box has no surviving copy, every rank
                loads its latest complete step instead (``load_latest_with_state``), with a warning naming
                what was lost; without one, the restore raises.
            stats: if given, filled with this rank's traffic.

        Raises:
            DataUnavailableError: boxes without a surviving copy (named), and no ``fallback`` (or it has
                no complete step).
        """
        comm = Communicator(group, timeout=self.timeout)
        objects = flatten_state_dict(template, rank=comm.rank, dedup=False).objects
        if objects:
            names = ", ".join(repr(o.key) for o in objects[:10])
            raise StateDictError(f"the peer-memory tier keeps tensors and common values, not ShardedObjects: {names}")
        tensors = filter_state_dict(template, lambda _path, leaf: _is_tensor(leaf))
        try:
            transfer(self._held, tensors, group=comm.transport, timeout=self.timeout, stats=stats)
        except DataUnavailableError as exc:
            if fallback is None:
                raise
            warnings.warn(
                f"peer-memory restore impossible, loading the latest durable checkpoint of "
                f"{fallback.root.describe()} instead: {exc}",
                stacklevel=2,
            )
            found = fallback.load_latest_with_state(template)
            if found is None:
                nothing = f"{fallback.root.describe()} holds no complete checkpoint"
                raise DataUnavailableError(f"{exc}; and {nothing}") from exc
            return found[1]

        def first_common(values: list[str | None]) -> str | None:
            return next((v for v in values if v is not None), None)

        encoded = comm.step("peer-memory common values", lambda: self._common, first_common)
        common = {p: decode_tagged(v, where=p) for p, v in json.loads(encoded or "{}").items()}

        def result_leaf(path: str, leaf: Any) -> Any:
            if isinstance(leaf, ShardedTensor):
                return leaf.data
            if _is_tensor(leaf):
                return leaf
            return common.get(path, leaf)

        return map_leaves(template, result_leaf)


def _nbytes(tensors: dict[str, ShardedTensor]) -> int:
    return sum(t.data.numel() * t.data.element_size() for t in tensors.values())


def _is_tensor(leaf: Any) -> bool:
    return isinstance(leaf, (torch.Tensor, ShardedTensor)) or is_dtensor(leaf)
