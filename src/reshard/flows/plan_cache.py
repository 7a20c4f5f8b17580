"""Save plans a coordinator keeps across saves, and read-once schedules across loads, keyed by the fingerprints of
the group's layouts (a load's: its needs).

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

A :class:`ReadPlanCache` does the same for the read-once schedules of loads (:mod:`reshard.flows.load_planning`):
in memory the schedules themselves, encoded as each rank receives them (keyed by the needs' fingerprints and the
exchange's round and slab sizes), in a manager's root the needs of the newest schedule
(:data:`~reshard.planning.layouts.READ_PLANS`), from which a restarted job's coordinator schedules again, in memory,
instead of gathering them.

Thread-safe (a lock guards the entries); a lookup or a store never raises.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

from reshard.planning.descriptions import DescriptionTable, WriteAssignment
from reshard.planning.layouts import (
    READ_PLANS,
    SAVE_PLANS,
    PlanFileKind,
    decode_plan_file,
    encode_plan_file,
    plan_file_extent,
    plan_file_head_bytes,
)
from reshard.planning.save_plan import plan_save_table
from reshard.storage import ReadRequest, Storage

__all__ = ["CachedPlan", "KeptPlans", "PlanCache", "ReadPlanCache", "ScheduleKey", "read_plan_file"]

logger = logging.getLogger("reshard")

MAX_PLAN_FILE_BYTES = 1 << 30
"""A plan cache file larger than this is not read (a miss)."""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CachedPlan:
    """A plan the coordinator made for one layout: every rank's description in columns and the writer election."""

    table: DescriptionTable
    assignments: tuple[WriteAssignment, ...]


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
C = TypeVar("C", bound="KeptPlans[Any, Any]")


class KeptPlans(Generic[K, V]):
    """The newest ``capacity`` plans of one process, by key, and the root (a manager's) where a subclass keeps the
    newest plan's inputs for a restart. Thread-safe: a lock guards the entries.

    Args:
        capacity: how many plans to keep in memory (the newest; at least 1).
    """

    def __init__(self, *, capacity: int = 2) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"{type(self).__name__}: capacity must be an integer of at least 1, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self._root: Storage | None = None

    @classmethod
    def beside(cls: type[C], root: Storage, *, capacity: int = 2) -> C:
        """A cache that also keeps the newest plan's inputs in ``root`` (a manager's root, which holds the
        checkpoints)."""
        cache = cls(capacity=capacity)
        cache._root = root
        return cache

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _held(self, key: K) -> tuple[bool, V | None]:
        """``(True, plan)`` when ``key``'s plan is in memory (now the newest), else ``(False, None)``."""
        with self._lock:
            if key not in self._entries:
                return False, None
            self._entries.move_to_end(key)
            return True, self._entries[key]

    def _keep(self, key: K, value: V) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)


class PlanCache(KeptPlans[tuple[str, ...], CachedPlan]):
    """Save plans kept across saves of one process (see the module doc). Pass the same object to every save whose
    plan it may reuse, on every rank (or None on every rank). ``capacity``: how many layouts' plans to keep in memory
    (the newest; at least 1); :meth:`beside` a manager's root also keeps the newest layouts there."""

    def lookup(self, fingerprints: tuple[str, ...]) -> CachedPlan | None:
        """On the coordinator: the plan of the layout whose fingerprints (in rank order) are ``fingerprints``, from
        memory, else from the root's file (planned again on its layouts); None: plan as without a cache."""
        held, found = self._held(fingerprints)
        if held:
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
        _write_plan_file(self._root, fingerprints, layouts, SAVE_PLANS, level=logging.WARNING)

    def _keep(self, key: tuple[str, ...], value: CachedPlan) -> None:
        table = getattr(value, "table", None)
        for column in [getattr(table, f.name) for f in dataclasses.fields(table)] if table is not None else []:
            if isinstance(column, np.ndarray):
                column.setflags(write=False)  # a later save reuses these columns: nothing may change them
        super()._keep(key, value)

    def _from_file(self, fingerprints: tuple[str, ...]) -> CachedPlan | None:
        if self._root is None:
            return None
        where = self._root.describe(SAVE_PLANS.name)
        try:
            layouts = read_plan_file(self._root, fingerprints, SAVE_PLANS)
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


def _write_plan_file(
    root: Storage, fingerprints: tuple[str, ...], layouts: tuple[bytes, ...], kind: PlanFileKind, *, level: int
) -> None:
    """Publish the plan cache file of ``kind`` in ``root`` atomically; a failure is logged at ``level``, never raised
    (a cache)."""
    try:
        root.commit(kind.name, encode_plan_file(fingerprints, layouts, kind=kind), replace=True)
    except Exception as exc:  # a cache: the save or load goes on without it
        logger.log(level, "reshard: the plan cache %s was not written: %s", root.describe(kind.name), exc)


def read_plan_file(root: Storage, fingerprints: tuple[str, ...], kind: PlanFileKind) -> tuple[bytes, ...]:
    """The layouts of ``root``'s plan cache file of ``kind``, provided it is whole and of ``fingerprints``
    (:func:`~reshard.planning.layouts.decode_plan_file`). Its first bytes are read first: the file is read whole only
    once they say it is one of ``fingerprints`` and of the size its header gives (so that a large damaged or forged
    file costs a small read, never its size in memory), into one buffer of that size.

    Raises:
        FileNotFoundError: there is none. ValueError: it is not the file of this layout. OSError: unreadable.
    """
    size = root.size(kind.name)
    if size > MAX_PLAN_FILE_BYTES:
        raise ValueError(f"{size} bytes, more than a plan cache file may hold ({MAX_PLAN_FILE_BYTES})")
    head = bytearray(min(size, plan_file_head_bytes(len(fingerprints))))
    got = root.read_ranges([ReadRequest(kind.name, 0, memoryview(head))])[0]
    expected = plan_file_extent(bytes(head[:got]), fingerprints, kind=kind)
    if expected != size:
        raise ValueError(f"its header gives {expected} bytes, the file has {size}")
    whole = bytearray(size)
    if root.read_ranges([ReadRequest(kind.name, 0, memoryview(whole))])[0] != size:
        raise ValueError("it changed while it was read")
    return decode_plan_file(whole, fingerprints, kind=kind)


@dataclass(frozen=True, slots=True)
class ScheduleKey:
    """What a read-once schedule is a function of: every rank's needs (their fingerprints, in rank order) and the
    exchange's round and slab sizes (:class:`reshard.flows.load_planning.Planner`)."""

    fingerprints: tuple[str, ...]
    round_bytes: int
    min_slab_bytes: int


Scheduler = Callable[[list[bytes]], "tuple[bytes, ...] | None"]
"""Every rank's encoded schedule from every rank's needs (encoded, in rank order): None when no byte is shared."""


class ReadPlanCache(KeptPlans[ScheduleKey, "tuple[bytes, ...] | None"]):
    """The read-once schedules of loads, kept across the loads of one process (see the module doc). Pass the same
    object to every load whose schedule it may reuse, on every rank (or None on every rank). Only the coordinator's
    is used. ``capacity``: how many schedules to keep in memory (the newest; at least 1); :meth:`beside` a manager's
    root also keeps the newest needs there."""

    def lookup(self, key: ScheduleKey, schedule: Scheduler) -> tuple[bool, tuple[bytes, ...] | None]:
        """On the coordinator: ``(found, schedules)``, the schedules of ``key`` (None: no byte is shared) from memory,
        else scheduled by ``schedule`` on the needs of the root's file; ``(False, None)``: gather the needs."""
        held, found = self._held(key)
        if held:
            return True, found
        if self._root is None:
            return False, None
        where = self._root.describe(READ_PLANS.name)
        try:
            needs = read_plan_file(self._root, key.fingerprints, READ_PLANS)
        except FileNotFoundError:
            logger.debug("reshard: no read plan cache at %s: gathering the needs", where)
            return False, None
        except Exception as exc:  # any problem with the file is a miss, never an error nor a wrong schedule
            logger.debug("reshard: the read plan cache %s is not used (%s): gathering the needs", where, exc)
            return False, None
        logger.debug("reshard: the read plan cache %s holds these needs: they are not gathered", where)
        made = schedule(list(needs))
        self._keep(key, made)
        return True, made

    def store(self, key: ScheduleKey, schedules: tuple[bytes, ...] | None, needs: tuple[bytes, ...]) -> None:
        """On the coordinator, after scheduling: keep the schedules, and write the ``needs`` to the root's file (a
        manager's cache). Never raises; a failure is logged at INFO level only (a load may read from a root it cannot
        write, such as an evaluation job's read-only mount: it then gathers the needs again after a restart)."""
        self._keep(key, schedules)
        if self._root is not None:
            _write_plan_file(self._root, key.fingerprints, needs, READ_PLANS, level=logging.INFO)
