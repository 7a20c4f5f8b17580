#!/usr/bin/env python
"""The control path at scale: a save's planning step flat and in two levels, and with its plan reused; a read-once
load's schedule made and reused.

    python benchmarks/scale_control.py                          # 1024 and 4096 simulated ranks (about 2 minutes)
    python benchmarks/scale_control.py --ranks 8192 16384 --json control.json

The layouts are those of ``benchmarks/scale.py`` (a 1.25-trillion-parameter MoE GPT, TP 8, ZeRO-1; no tensor data),
and every figure comes from the code a real save runs, on the bytes it would exchange, in one process, timed with the
cyclic garbage collector paused as a save and a load pause it:

- **planned** (a save without a cached plan, and the first save of a manager): the coordinator decodes every
  description and plans (``DescriptionTable.from_wire``, ``plan_save_table``), then a manager writes the plan cache
  file (``encode_plan_file``; its size, and the time to encode it and write it to a file of this machine with fsync);
- **reused in memory** (every later save of the same layout): each rank sends an offer (``layout_fingerprint``,
  ``encode_offer``); the coordinator reads the offers, checks the terms agree, finds the plan in its ``PlanCache``
  and encodes every rank's assignment;
- **reused after a restart**: the coordinator reads the plan cache file, checks it against the offers
  (``decode_plan_file``: a SHA-256 of the file and one per layout) and plans again on the layouts in memory;
- **bytes of the planning step**, flat and in two levels (``reshard.net.hierarchy``, ``--ranks-per-node`` ranks per
  node), by the framing of the transports (``padded_size``: a gather pads every payload to the longest, behind its
  8-byte length; a node message is a ``frame`` of its ranks' payloads): what the coordinator receives and in how
  many messages, what a node leader receives, for the descriptions (a save without reuse) and for the offers.

- **a read-once load's schedule** on the loading layout of ``scale.py`` (TP 4, twice the stages): each rank's needs
  (``describe_need``: key, box, dtype of every target piece, encoded by ``needs_bytes``), gathered on a miss; the
  coordinator's scheduling (``Planner.schedules``: ``schedule_reads`` and the encoding of every rank's part); a hit
  of a ``ReadPlanCache`` (the offers read, the fingerprints looked up, the schedules to scatter found); after a
  restart, the needs file decoded (``decode_plan_file``) and scheduled again; and the sizes of the needs, the offers,
  the schedules and the file.

The network is not simulated: how long a gather of these bytes takes depends on it (``benchmarks/hierarchy.py``
times the two-level path over gloo on this machine).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from scale import layouts  # the same layouts as scale.py

from reshard.flows.collector import collector_paused
from reshard.flows.load_planning import Planner
from reshard.flows.plan_cache import CachedPlan, PlanCache, ReadPlanCache
from reshard.flows.save_phases import AGREED_TERMS, check_agreement
from reshard.net.hierarchy import frame
from reshard.net.transports import padded_size
from reshard.planning.descriptions import DescriptionTable, encode_description
from reshard.planning.layouts import (
    READ_PLANS,
    decode_plan_file,
    encode_offer,
    encode_plan_file,
    layout_bytes,
    layout_fingerprint,
    needs_bytes,
    read_offer,
)
from reshard.planning.save_plan import plan_save_table
from reshard.testing import MegatronLayout, MoETransformer

MiB = 1 << 20
T = TypeVar("T")
DEFAULT_RANKS = (1024, 4096)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and its wall time, with Python's cyclic collector paused as ``reshard.save`` and ``reshard.load``
    pause it (:mod:`reshard.flows.collector`): running, its collections over the millions of short-lived objects
    of a schedule doubled the time (64 s against 35 s to schedule 4096 ranks)."""
    with collector_paused():
        started = time.perf_counter()
        value = fn()
        elapsed = time.perf_counter() - started
    return value, elapsed


def gather_bytes(lengths: list[int], per_node: int) -> dict[str, float]:
    """The bytes and messages of one gather of payloads of ``lengths`` (rank order) on the coordinator, flat and in
    two levels of ``per_node`` ranks per node (nodes of consecutive ranks, the coordinator leading node 0)."""
    tagged = [len(b"\x00\x0dsave planning\x00") + n for n in lengths]  # each step's tag travels with the payload
    flat = padded_size(tagged)
    nodes = [tagged[i : i + per_node] for i in range(0, len(tagged), per_node)]
    framed = [8 + 8 * len(node) + sum(node) for node in nodes]  # frame(): a count, the lengths, the bodies
    assert framed[0] == len(frame([b"\x00" * n for n in nodes[0]]))
    node_gather = [padded_size(node) for node in nodes]
    leaders = padded_size(framed)
    return {
        "flat_coordinator_mib": flat * (len(lengths) - 1) / MiB,
        "flat_coordinator_messages": len(lengths) - 1,
        "two_level_coordinator_mib": (node_gather[0] * (len(nodes[0]) - 1) + leaders * (len(nodes) - 1)) / MiB,
        "two_level_coordinator_messages": len(nodes[0]) - 1 + len(nodes) - 1,
        "two_level_leader_mib": max(g * (len(n) - 1) for g, n in zip(node_gather, nodes, strict=True)) / MiB,
    }


def write_with_fsync(directory: Path, data: bytes) -> None:
    path = directory / "plans.reshard-cache"
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    path.unlink()


def measure(ranks: int, model: MoETransformer, per_node: int, log: Callable[[str], None]) -> dict[str, Any]:
    save_par, _ = layouts(ranks)
    layout = MegatronLayout(model, save_par)
    terms = {
        "overwrite": False, "fingerprint": True, "checksum_chunk_bytes": 4 * MiB, "content_hash": False,
        "verify_base": False, "base": None, "certify": None, "reuse_plan": True, "metadata_parts": None,
    }  # fmt: skip
    assert set(terms) == set(AGREED_TERMS)
    context = {"path": "/checkpoints/step_1000", "options": terms}
    payloads, layout_payloads, offers = [], [], []
    for rank in range(ranks):
        description = layout.rank_description(rank)
        payloads.append(encode_description(description, context))
        layout_payloads.append(layout_bytes(description))
        fingerprint = layout_fingerprint(layout_payloads[-1], rank=rank, world=ranks)
        offers.append(encode_offer(fingerprint, context))
    out: dict[str, Any] = {"ranks": ranks, "ranks_per_node": per_node, "offer_bytes_max": max(map(len, offers))}
    out["description_kib_max"] = max(map(len, payloads)) / 1024
    out |= {f"describe_{k}": v for k, v in gather_bytes(list(map(len, payloads)), per_node).items()}
    out |= {f"offer_{k}": v for k, v in gather_bytes(list(map(len, offers)), per_node).items()}
    log(f"{ranks} ranks: descriptions up to {out['description_kib_max']:.1f} KiB, offers {out['offer_bytes_max']} B")

    def plan() -> CachedPlan:
        table = DescriptionTable.from_wire(payloads)[0]
        assignments = plan_save_table(table)
        _ = [a.to_bytes() for a in assignments]
        return CachedPlan(table=table, assignments=tuple(assignments))

    cached, out["planned_s"] = timed(plan)
    fingerprints = tuple(read_offer(o).fingerprint for o in offers)
    plan_file, out["cache_encode_s"] = timed(lambda: encode_plan_file(fingerprints, tuple(layout_payloads)))
    out["cache_file_mib"] = len(plan_file) / MiB
    with tempfile.TemporaryDirectory() as scratch:
        _, out["cache_write_s"] = timed(lambda: write_with_fsync(Path(scratch), plan_file))
    log(f"  planned {out['planned_s']:.2f} s; cache file {out['cache_file_mib']:.1f} MiB")

    cache = PlanCache()
    cache.store(fingerprints, cached, tuple(layout_payloads))

    def hit() -> int:
        read = [read_offer(o) for o in offers]
        check_agreement([o.context for o in read])
        found = cache.lookup(tuple(o.fingerprint for o in read))
        assert found is not None
        return sum(len(a.to_bytes()) for a in found.assignments)

    _, out["reused_s"] = timed(hit)

    def restart() -> CachedPlan:
        found = decode_plan_file(plan_file, fingerprints)
        table = DescriptionTable.from_wire(list(found))[0]
        return CachedPlan(table=table, assignments=tuple(plan_save_table(table)))

    again, out["restart_s"] = timed(restart)
    assert [a.to_bytes() for a in again.assignments] == [a.to_bytes() for a in cached.assignments]
    log(f"  reused {out['reused_s'] * 1e3:.0f} ms in memory, {out['restart_s']:.2f} s from the file after a restart")
    return out


def measure_reads(ranks: int, model: MoETransformer, log: Callable[[str], None]) -> dict[str, Any]:
    """A read-once load's schedule on ``ranks`` ranks: made (a miss), reused in memory, made again after a restart."""
    _, load_par = layouts(ranks)
    layout = MegatronLayout(model, load_par)
    needs = [
        needs_bytes([[p.key, list(p.box.offset), list(p.box.shape), "bfloat16"] for p in layout.rank_targets(rank)])
        for rank in range(ranks)
    ]
    fingerprints = tuple(layout_fingerprint(n, rank=r, world=ranks, kind=READ_PLANS) for r, n in enumerate(needs))
    offers = [json.dumps({"grids": {}, "keys": None, "needs": None, "fingerprint": f}).encode() for f in fingerprints]
    planner = Planner(read_once=True, round_bytes=16 * MiB, min_slab_bytes=4 * MiB, refuses_unused=False)
    out: dict[str, Any] = {
        "reads_needs_mib": sum(map(len, needs)) / MiB,
        "reads_offer_bytes_max": max(map(len, offers)),
    }
    schedules, out["reads_scheduled_s"] = timed(lambda: planner.schedules_of_encoded(needs))
    assert schedules is not None
    out["reads_schedules_mib"] = sum(map(len, schedules)) / MiB
    cache = ReadPlanCache()
    cache.store(planner.key(fingerprints), schedules, tuple(needs))

    def hit() -> tuple[bytes, ...] | None:
        offered = tuple(json.loads(o)["fingerprint"] for o in offers)
        found, replies = cache.lookup(planner.key(offered), planner.schedules_of_encoded)
        assert found
        return replies

    assert timed(hit)[0] == schedules
    out["reads_reused_s"] = timed(hit)[1]
    needs_file, out["reads_cache_encode_s"] = timed(
        lambda: encode_plan_file(fingerprints, tuple(needs), kind=READ_PLANS)
    )
    out["reads_cache_file_mib"] = len(needs_file) / MiB

    def restart() -> tuple[bytes, ...] | None:
        return planner.schedules_of_encoded(list(decode_plan_file(needs_file, fingerprints, kind=READ_PLANS)))

    again, out["reads_restart_s"] = timed(restart)
    assert again == schedules
    log(
        f"  read once: needs {out['reads_needs_mib']:.1f} MiB, scheduled {out['reads_scheduled_s']:.2f} s, reused "
        f"{out['reads_reused_s'] * 1e3:.0f} ms, {out['reads_restart_s']:.2f} s after a restart"
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--ranks", type=int, nargs="+", default=list(DEFAULT_RANKS), help="powers of two from 8")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node of the two-level path (default 8)")
    p.add_argument("--layers", type=int, default=128, help="transformer layers of the model (default 128)")
    p.add_argument("--experts", type=int, default=256, help="experts per layer (default 256)")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    model = MoETransformer(layers=args.layers, experts=args.experts)
    rows = [measure(r, model, args.ranks_per_node, log) | measure_reads(r, model, log) for r in sorted(args.ranks)]
    columns = [
        ("ranks", "ranks", "{:.0f}"), ("planned_s", "planned s", "{:.2f}"), ("reused_s", "reused s", "{:.3f}"),
        ("restart_s", "restart s", "{:.2f}"), ("cache_file_mib", "cache MiB", "{:.1f}"),
        ("cache_write_s", "write s", "{:.2f}"), ("offer_bytes_max", "offer B", "{:.0f}"),
        ("describe_flat_coordinator_mib", "flat MiB", "{:.1f}"),
        ("describe_flat_coordinator_messages", "flat msgs", "{:.0f}"),
        ("describe_two_level_coordinator_mib", "2lvl MiB", "{:.1f}"),
        ("describe_two_level_coordinator_messages", "2lvl msgs", "{:.0f}"),
        ("describe_two_level_leader_mib", "leader MiB", "{:.2f}"),
        ("offer_flat_coordinator_mib", "offers MiB", "{:.2f}"),
        ("reads_needs_mib", "needs MiB", "{:.1f}"), ("reads_scheduled_s", "sched s", "{:.2f}"),
        ("reads_reused_s", "sched hit s", "{:.3f}"), ("reads_restart_s", "sched rst s", "{:.2f}"),
    ]  # fmt: skip
    print(" ".join(f"{title:>10}" for _, title, _ in columns))
    for row in rows:
        print(" ".join(f"{fmt.format(row[name]):>10}" for name, _, fmt in columns))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
