"""Save plans a coordinator keeps across saves, keyed by the layout fingerprints of the group.

A :class:`PlanCache` is an explicit object (no module state), owned by what saves again and again: a
:class:`~reshard.CheckpointManager` (kept in its root as well) and an :class:`~reshard.AsyncCheckpointer` (in memory),
which pass it to :func:`reshard.flows.save.save_replacing`; :func:`reshard.save` keeps none (its signature stays
small, and a module-level cache is what STYLE.md rules out). Only the coordinator's is used (the other ranks send
their fingerprint only); every rank passes one or none alike.

It holds, in memory, the plans of the last ``capacity`` layouts (the description table and the writer election,
before any incremental base is matched: that depends on the base and is redone on every save). A manager's cache
also keeps the layouts of the newest plan in its root (:data:`~reshard.planning.layouts.PLAN_CACHE_FILE`), so that a
restarted job skips the gather of the descriptions: the file is published atomically (``Storage.commit``), carries
a SHA-256 of its content, and is used only when every layout in it hashes to the fingerprint its rank sends now
(:func:`~reshard.planning.layouts.decode_plan_file`); the coordinator then plans again on those layouts, in memory.
Anything else (no file, damaged, truncated, another layout, a forgery, unreadable) is a miss, logged at debug
level: the save gathers the descriptions as without a cache. Writing it is best effort (a failure is logged and the
save goes on): it is a cache, never part of a checkpoint, and neither ``gc``, retention nor ``validate`` look at it.

Thread-safe (a lock guards the entries); a lookup or a store never raises.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from reshard.planning.descriptions import DescriptionTable, WriteAssignment
from reshard.planning.layouts import (
    PLAN_CACHE_FILE,
    decode_plan_file,
    encode_plan_file,
    plan_file_extent,
    plan_file_head_bytes,
)
from reshard.planning.save_plan import plan_save_table
from reshard.storage import ReadRequest, Storage

__all__ = ["CachedPlan", "PlanCache"]

logger = logging.getLogger("reshard")

MAX_PLAN_FILE_BYTES = 1 << 30
"""A plan cache file larger than this is not read (a miss)."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CachedPlan:
    """A plan the coordinator made for one layout: every rank's description in columns and the writer election."""

    table: DescriptionTable
    assignments: tuple[WriteAssignment, ...]


class PlanCache:
    """Save plans kept across saves of one process (see the module doc). Pass the same object to every save whose
    plan it may reuse, on every rank (or None on every rank).

    Args:
        capacity: how many layouts' plans to keep in memory (the newest; at least 1).
    """

    def __init__(self, *, capacity: int = 2) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"PlanCache: capacity must be an integer of at least 1, got {capacity!r}")
        self.capacity = capacity
        self._plans: OrderedDict[tuple[str, ...], CachedPlan] = OrderedDict()
        self._lock = threading.Lock()
        self._root: Storage | None = None

    @classmethod
    def beside(cls, root: Storage, *, capacity: int = 2) -> PlanCache:
        """A cache that also keeps the newest layouts in ``root`` (a manager's root, which holds the checkpoints)."""
        cache = cls(capacity=capacity)
        cache._root = root
        return cache

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)

    def lookup(self, fingerprints: tuple[str, ...]) -> CachedPlan | None:
        """On the coordinator: the plan of the layout whose fingerprints (in rank order) are ``fingerprints``, from
        memory, else from the root's file (planned again on its layouts); None: plan as without a cache."""
        with self._lock:
            found = self._plans.get(fingerprints)
            if found is not None:
                self._plans.move_to_end(fingerprints)
                return found
        found = self._from_file(fingerprints)
        if found is not None:
            self._keep(fingerprints, found)
        return found

    def store(self, fingerprints: tuple[str, ...], plan: CachedPlan, layouts: tuple[bytes, ...]) -> None:
        """On the coordinator, after planning a layout: keep its plan, and write its ``layouts`` to the root's file
        (a manager's cache). Never raises."""
        self._keep(fingerprints, plan)
        if self._root is None:
            return
        try:
            self._root.commit(PLAN_CACHE_FILE, encode_plan_file(fingerprints, layouts), replace=True)
        except Exception as exc:  # a cache: the save goes on without it
            logger.warning("reshard: the plan cache %s was not written: %s", self._root.describe(PLAN_CACHE_FILE), exc)

    def _keep(self, fingerprints: tuple[str, ...], plan: CachedPlan) -> None:
        table = getattr(plan, "table", None)
        for column in [getattr(table, f.name) for f in dataclasses.fields(table)] if table is not None else []:
            if isinstance(column, np.ndarray):
                column.setflags(write=False)  # a later save reuses these columns: nothing may change them
        with self._lock:
            self._plans[fingerprints] = plan
            self._plans.move_to_end(fingerprints)
            while len(self._plans) > self.capacity:
                self._plans.popitem(last=False)

    def _from_file(self, fingerprints: tuple[str, ...]) -> CachedPlan | None:
        if self._root is None:
            return None
        where = self._root.describe(PLAN_CACHE_FILE)
        try:
            layouts = decode_plan_file(_read_plan_file(self._root, fingerprints), fingerprints)
            table = DescriptionTable.from_wire(list(layouts))[0]
            plan = CachedPlan(table=table, assignments=tuple(plan_save_table(table)))
        except FileNotFoundError:
            logger.debug("reshard: no plan cache at %s: planning", where)
            return None
        except Exception as exc:  # any problem with the file is a miss, never an error nor a wrong plan
            logger.debug("reshard: the plan cache %s is not used (%s): planning", where, exc)
            return None
        logger.debug("reshard: the plan cache %s holds this layout: the descriptions are not gathered", where)
        return plan


def _read_plan_file(root: Storage, fingerprints: tuple[str, ...]) -> bytearray:
    """``root``'s plan cache file, read whole only once its first bytes say it is one of ``fingerprints`` and of
    the size its header gives (so that a large damaged or forged file costs a small read, never its size in
    memory), into one buffer of that size.

    Raises:
        FileNotFoundError: there is none. ValueError: it is not the file of this layout. OSError: unreadable.
    """
    size = root.size(PLAN_CACHE_FILE)
    if size > MAX_PLAN_FILE_BYTES:
        raise ValueError(f"{size} bytes, more than a plan cache file may hold ({MAX_PLAN_FILE_BYTES})")
    head = bytearray(min(size, plan_file_head_bytes(len(fingerprints))))
    got = root.read_ranges([ReadRequest(PLAN_CACHE_FILE, 0, memoryview(head))])[0]
    expected = plan_file_extent(bytes(head[:got]), fingerprints)
    if expected != size:
        raise ValueError(f"its header gives {expected} bytes, the file has {size}")
    whole = bytearray(size)
    if root.read_ranges([ReadRequest(PLAN_CACHE_FILE, 0, memoryview(whole))])[0] != size:
        raise ValueError("it changed while it was read")
    return whole
