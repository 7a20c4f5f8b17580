"""The long mode of the contract and fault suite: every flow through every fault source, for the figures in
docs/reliability.md.

``make test`` runs a sample of the same harnesses (tests/contract/, tests/io/test_corruption.py); this runs
them in full::

    .venv/bin/python -m benchmarks.chaos --all-flows                 # everything (about an hour on 2 cores)
    .venv/bin/python -m benchmarks.chaos --flows overwrite:2,manager:3 --limit 20 --corruptions 50 --hostile 20

Fault sources (tests/contract/__init__.py states the guarantees they check):

- kills: one rank of a real gloo job SIGKILLed before or after each of its events (collectives, storage
  operations, file-system calls) of each flow, and at random delays (tests/contract/harness.py);
- corruptions: seeded damage of a plain checkpoint, nine tools on each (tests/corruption.py), and of a
  manager's root of incremental steps, readers and mutators on each (tests/contract/damage.py);
- hostile documents of format versions 1-4 against every reading and root tool, with every path they touch
  recorded (tests/contract/hostile.py);
- options that disagree across ranks, every case (tests/contract/disagreement.py).

Prints a table per fault source and the totals; exits 1 if anything loaded wrong bytes, lost a checkpoint,
touched a file outside, hung, or broke another guarantee.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.scratch import scratch_dir
from tests import corruption
from tests.contract import damage, disagreement, harness, hostile
from tests.contract.flows import FLOWS

STATUS_COLUMNS = ("clean", "other", "hang", "silent", "lost", "outside")


def all_flows() -> list[tuple[str, int]]:
    return [(name, world) for name, flow in FLOWS.items() for world in flow.worlds]


def run_kills(base: Path, flows: list[tuple[str, int]], seed: int, timed: int, limit: int | None) -> dict[str, Any]:
    rows = []
    everything: list[harness.Outcome] = []
    for name, world in flows:
        started = time.monotonic()
        outcomes = []
        for iteration in harness.plan(
            ((name, world),), base / f"{name}-{world}", seed=seed, systematic=limit, timed=timed
        ):
            outcome = harness.run_iteration(iteration)
            outcomes.append(outcome)
            harness.remove(iteration.directory)
            if outcome.status != "clean":
                print(f"  {name}/{world} {outcome.point}: {outcome.status}: {outcome.reason[:300]}", flush=True)
                for rank, answer in sorted(outcome.answers.items()):  # what each rank said, to rerun it alone
                    said = "ok" if answer.get("ok") else f"{answer.get('error')}: {str(answer.get('message'))[:200]}"
                    print(f"    rank {rank}: {said}", flush=True)
        summary = harness.summarize(outcomes)
        row = {"flow": name, "ranks": world, **{k: v for k, v in summary.items() if k not in ("failures", "by_flow")}}
        row["seconds"] = round(time.monotonic() - started, 1)
        rows.append(row)
        everything += outcomes
        shown = ", ".join(f"{summary[s]} {s}" for s in STATUS_COLUMNS)
        print(
            f"{name:>11} x{world}: {summary['tried']:4d} kill points, {summary['killed']:4d} killed: {shown} "
            f"(kept old {summary['kept_old']}, committed new {summary['committed_new']}; {row['seconds']} s)",
            flush=True,
        )
    return {"rows": rows, "total": harness.summarize(everything)}


def run_plain_corruptions(base: Path, count: int, seed: int) -> dict[str, Any]:
    corruption.make_pristine(base / "pristine", base / "other")
    rng = random.Random(seed)
    all_runs = []
    for i in range(count):
        copy = base / f"c{i}"
        shutil.copytree(base / "pristine", copy / "ckpt")
        (copy / "out").mkdir()
        hurt = corruption.corrupt(copy / "ckpt", base / "other", rng)
        all_runs.append(corruption.run_tools(copy / "ckpt", base / "pristine", copy / "out", hurt))
        shutil.rmtree(copy)
    summary = corruption.summarize(all_runs)
    print(
        f"plain corruptions: {summary['corruptions']} damaged copies, {summary['tool_runs']} tool runs: "
        f"{summary['exact']} exact, {summary['refused']} refused, {summary['silent']} silent, "
        f"{summary['violations']} other",
        flush=True,
    )
    return summary


def run_root_damage(base: Path, count: int, seed: int) -> dict[str, Any]:
    damage.make_pristine(base / "pristine")
    rng = random.Random(seed)
    verdicts = []
    for i in range(count):
        root = base / f"c{i}"
        damage.copy(base / "pristine", root)
        with warnings.catch_warnings():  # a manager skipping a damaged step warns; the verdict records it
            warnings.simplefilter("ignore")
            verdicts.append(damage.run_tools(root, damage.corrupt(root, rng)))
        shutil.rmtree(root)
    summary = damage.summarize(verdicts)
    print(
        f"root damage: {summary['corruptions']} damaged roots, {summary['tool_runs']} tool runs: "
        f"{summary['exact']} exact, {summary['refused']} refused, {summary['silent']} silent, "
        f"{summary['lost']} lost, {summary['outside']} outside, {summary['other']} other",
        flush=True,
    )
    for failure in summary["failures"][:5]:
        print(f"  {failure}", flush=True)
    return summary


def run_hostile(base: Path, count: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    verdicts = []
    shares = {1: count // 10, 2: count // 10, 3: count // 10}
    shares[4] = count - sum(shares.values())
    for version, n in shares.items():
        pristine = base / f"pristine-v{version}"
        hostile.make_pristine(pristine, version)
        for i in range(n):
            copy = base / f"v{version}-{i}"
            shutil.copytree(pristine, copy, symlinks=True)
            with warnings.catch_warnings():  # a manager skipping a hostile step warns; the verdict records it
                warnings.simplefilter("ignore")
                verdicts.append(hostile.run_tools(copy, pristine, hostile.attack(copy, version, rng)))
            shutil.rmtree(copy)
    summary = hostile.summarize(verdicts)
    print(
        f"hostile documents: {summary['documents']} documents, {summary['tool_runs']} tool runs: "
        f"{summary['exact']} exact, {summary['refused']} refused, {summary['silent']} silent, "
        f"{summary['outside']} outside, {summary['other']} other",
        flush=True,
    )
    for failure in summary["failures"][:5]:
        print(f"  {failure}", flush=True)
    return summary


def run_disagreement(base: Path) -> dict[str, Any]:
    results = disagreement.run_all(base)
    broken = [f"{c.flow}/{c.option}: {problem}" for c, problem in results if problem]
    print(
        f"disagreeing options: {len(results)} cases, {len(results) - len(broken)} refused alike on every rank "
        f"or resolved together, {len(broken)} broken",
        flush=True,
    )
    for line in broken[:10]:
        print(f"  {line}", flush=True)
    return {"cases": len(results), "broken": broken}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--all-flows",
        action="store_true",
        help="every flow at each of its world sizes, every kill point, 1,000 corruptions (half "
        "plain, half of roots), 200 hostile documents, every disagreement case",
    )
    parser.add_argument("--flows", default="", help="flow:ranks pairs, comma-separated (instead of --all-flows)")
    parser.add_argument("--limit", type=int, default=None, help="kill points per flow, sampled (default: all)")
    parser.add_argument("--timed", type=int, default=10, help="kills at random delays per flow (default 10)")
    parser.add_argument("--corruptions", type=int, default=None, help="damaged copies, half plain, half roots")
    parser.add_argument("--hostile", type=int, default=None, help="hostile documents")
    parser.add_argument(
        "--disagreement", action="store_true", help="every disagreement case too (implied by --all-flows)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if not args.all_flows and not args.flows:
        parser.error("name --all-flows or --flows")
    flows = all_flows() if args.all_flows else [(f, int(w)) for f, w in (p.split(":") for p in args.flows.split(","))]
    corruptions = args.corruptions if args.corruptions is not None else (1000 if args.all_flows else 0)
    documents = args.hostile if args.hostile is not None else (200 if args.all_flows else 0)
    started = time.monotonic()
    report: dict[str, Any] = {}
    with scratch_dir("reshard-chaos-") as base:  # removed on SIGTERM/SIGHUP too
        report["kills"] = run_kills(base / "kills", flows, args.seed, args.timed, args.limit)
        if corruptions:
            report["plain_corruptions"] = run_plain_corruptions(
                base / "plain", corruptions - corruptions // 2, args.seed
            )
            report["root_damage"] = run_root_damage(base / "roots", corruptions // 2, args.seed)
        if documents:
            report["hostile"] = run_hostile(base / "hostile", documents, args.seed)
        if args.all_flows or args.disagreement:
            report["disagreement"] = run_disagreement(base / "disagreement")
    total = report["kills"]["total"]
    bad = sum(total[s] for s in STATUS_COLUMNS if s != "clean")
    bad += sum(report.get("plain_corruptions", {}).get(k, 0) for k in ("silent", "violations"))
    for key in ("root_damage", "hostile"):
        bad += sum(report.get(key, {}).get(k, 0) for k in ("silent", "lost", "outside", "other"))
    bad += len(report.get("disagreement", {}).get("broken", []))
    print(
        f"total: {total['tried']} kill points ({total['killed']} killed), "
        + ", ".join(f"{total[s]} {s}" for s in STATUS_COLUMNS)
        + f"; {bad} findings in all, in {time.monotonic() - started:.0f} s",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
