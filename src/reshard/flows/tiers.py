"""The tiers of a :class:`~reshard.TieredCheckpointManager`, as frozen values: where each keeps a step, and how often.

``PeerMemory`` (host memory of the ranks, copies on other nodes), ``LocalDisk`` (each node's own disk) and
``Durable`` (a root of step checkpoints: a directory, ``s3://`` or ``gs://``). Each value checks its own fields when
it is made (a ValueError naming the field); :func:`check_tiers` checks the list a manager is given: at most one of
each kind, fastest first, a ``Durable`` tier always (it is what *finalized* means). :func:`tier_terms` is what
every rank of the group must pass alike (agreed in the first collective of every save and restore).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from reshard.storage import CheckpointLocation, Storage

__all__ = ["Durable", "LocalDisk", "PeerMemory", "Tier", "Tiers", "check_tiers", "tier_terms"]


def _count(kind: str, field: str, value: object, *, optional: bool = False) -> None:
    """A ValueError naming ``kind.field`` unless ``value`` is an integer of at least 1 (or None when ``optional``)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "None or an integer" if optional else "an integer"
        raise ValueError(f"{kind}.{field} must be {allowed} of at least 1, got {value!r}")


@dataclass(frozen=True)
class PeerMemory:
    """Keep every ``every``-th step in the ranks' host memory, each box copied to ``replicas`` ranks of other nodes
    (:class:`~reshard.PeerMemoryCheckpoint`; ``node_size`` ranks per node, default ``LOCAL_WORLD_SIZE``). Only
    the newest such step is held; it survives the loss of any ``replicas`` whole nodes, not a restart of the job."""

    every: int
    replicas: int = 1
    node_size: int | None = None
    name = "peer"

    def __post_init__(self) -> None:
        _count("PeerMemory", "every", self.every)
        _count("PeerMemory", "replicas", self.replicas)
        _count("PeerMemory", "node_size", self.node_size, optional=True)


@dataclass(frozen=True)
class LocalDisk:
    """Keep every ``every``-th step on each node's own disk, under ``directory`` (the same string on every node, or
    one holding ``{node}``, formatted with the node's index); the ``keep_last`` newest per node, never one that the
    ``Durable`` tier has not finalized yet. Durable steps that this tier holds are drained to the durable root in the
    background."""

    directory: str | os.PathLike[str]
    every: int
    keep_last: int = 2
    node_size: int | None = None
    name = "local"

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, os.PathLike)) or not os.fspath(self.directory):
            raise ValueError(f"LocalDisk.directory must be a non-empty path, got {self.directory!r}")
        _count("LocalDisk", "every", self.every)
        _count("LocalDisk", "keep_last", self.keep_last)
        _count("LocalDisk", "node_size", self.node_size, optional=True)


@dataclass(frozen=True)
class Durable:
    """Keep every ``every``-th step under ``root`` as a :class:`~reshard.CheckpointManager` does (``keep_last``,
    ``keep_every``, ``storage_options`` as there): a step is *finalized* once this tier holds it complete."""

    root: CheckpointLocation
    every: int
    keep_last: int | None = None
    keep_every: int | None = None
    storage_options: dict[str, Any] | None = None
    name = "durable"

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike, Storage)) or (
            not isinstance(self.root, Storage) and not os.fspath(self.root)
        ):
            raise ValueError(f"Durable.root must be a non-empty path, URL or Storage, got {self.root!r}")
        _count("Durable", "every", self.every)
        _count("Durable", "keep_last", self.keep_last, optional=True)
        _count("Durable", "keep_every", self.keep_every, optional=True)
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ValueError(f"Durable.storage_options must be a dict or None, got {self.storage_options!r}")


Tier = PeerMemory | LocalDisk | Durable
_ORDER: tuple[type[Any], ...] = (PeerMemory, LocalDisk, Durable)


@dataclass(frozen=True)
class Tiers:
    """The tiers of one manager, by kind (``durable`` always)."""

    peer: PeerMemory | None
    local: LocalDisk | None
    durable: Durable

    def saving(self, step: int) -> tuple[Tier, ...]:
        """The tiers that keep step ``step`` (its ``every`` divides it), fastest first."""
        tiers: tuple[Tier | None, ...] = (self.peer, self.local, self.durable)
        return tuple(t for t in tiers if t is not None and step % t.every == 0)


def check_tiers(tiers: Any) -> Tiers:
    """``tiers`` (a list of tier values, fastest first) by kind.

    Raises:
        ValueError: naming what is wrong: not a list of tier values, two of one kind, not fastest first, no
            ``Durable`` tier.
    """
    if not isinstance(tiers, (list, tuple)) or not tiers:
        raise ValueError(f"tiers must be a list of PeerMemory, LocalDisk and Durable values, got {tiers!r}")
    kinds: list[int] = []
    for tier in tiers:
        kind = _ORDER.index(type(tier)) if type(tier) in _ORDER else -1
        if kind < 0:
            raise ValueError(f"tiers: {tier!r} is not a PeerMemory, LocalDisk or Durable value")
        if kind in kinds:
            raise ValueError(f"tiers: more than one {type(tier).__name__} tier")
        if kinds and kind < kinds[-1]:
            raise ValueError(f"tiers must be ordered fastest first (PeerMemory, LocalDisk, Durable), got {tiers!r}")
        kinds.append(kind)
    peer = next((t for t in tiers if isinstance(t, PeerMemory)), None)
    local = next((t for t in tiers if isinstance(t, LocalDisk)), None)
    durable = next((t for t in tiers if isinstance(t, Durable)), None)
    if durable is None:
        raise ValueError("tiers: a Durable tier is required (a step is finalized when the durable tier holds it)")
    if local is not None and _same_directory(local.directory, durable.root):
        raise ValueError(
            f"tiers: LocalDisk.directory {os.fspath(local.directory)!r} is the Durable root {durable.root!r}: each "
            "tier needs its own directory (their steps have the same names)"
        )
    return Tiers(peer=peer, local=local, durable=durable)


def _same_directory(pattern: str | os.PathLike[str], root: Any) -> bool:
    """Whether the node-local ``pattern`` (``{node}`` standing for any node index) names the local directory
    ``root`` (a path; an object-store URL or a storage object never is one)."""
    if not isinstance(root, (str, os.PathLike)) or "://" in os.fspath(root):
        return False
    wanted = os.path.abspath(os.fspath(root))
    parts = [re.escape(part) for part in os.path.abspath(os.fspath(pattern)).split("{node}")]
    return re.fullmatch(r"[0-9]+".join(parts), wanted) is not None


def tier_terms(tiers: Tiers, durable_root: str) -> dict[str, Any]:
    """What every rank must pass alike, as JSON, one term per kind (None: no such tier; the durable root as its
    storage describes it; of the storage options, only their names: their values may be secrets)."""
    terms: dict[str, Any] = {"PeerMemory": None, "LocalDisk": None}
    if tiers.peer is not None:
        terms["PeerMemory"] = {
            "every": tiers.peer.every,
            "replicas": tiers.peer.replicas,
            "node_size": tiers.peer.node_size,
        }
    if tiers.local is not None:
        terms["LocalDisk"] = {
            "directory": os.fspath(tiers.local.directory),
            "every": tiers.local.every,
            "keep_last": tiers.local.keep_last,
            "node_size": tiers.local.node_size,
        }
    durable = tiers.durable
    terms["Durable"] = {
        "root": durable_root,
        "every": durable.every,
        "keep_last": durable.keep_last,
        "keep_every": durable.keep_every,
        "storage_options": sorted(durable.storage_options or {}),
    }
    return terms
