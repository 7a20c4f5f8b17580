"""The long chaos mode: every kill point of every scenario, random kills, and seeded corruptions.

``make test`` runs a sample of the same harnesses (tests/test_chaos.py, tests/test_corruption.py); this runs
them in full, for the figures in docs/reliability.md::

    .venv/bin/python -m benchmarks.chaos                      # every kill point, 4 scenarios x 2-4 ranks
    .venv/bin/python -m benchmarks.chaos --timed 50 --corruptions 2000 --json chaos.json

Kill points (tests/chaos.py): one rank of a real gloo job is SIGKILLed before or after each of its events
(collectives and storage operations) during a save of each scenario (plain overwrite, async overwrite,
fresh path, CheckpointManager step with retention), and at random delays; after each, the newest committed
checkpoint must load bit-exactly, ``latest.json`` must name a complete step, ``reshard validate`` and ``reshard
ls`` must agree with the load, and a later save must succeed. Corruptions (tests/corruption.py): seeded
damage of a committed checkpoint, then nine tools each give an error or exactly the saved values.

Prints a table and the totals; exits 1 if any iteration lost a checkpoint, loaded wrong bytes or broke
another invariant.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests import chaos, corruption

SCENARIOS = [(s, w) for s in ("overwrite", "async", "fresh", "manager") for w in (2, 3, 4)]


def run_kills(base: Path, scenarios: list[tuple[str, int]], seed: int, timed: int, limit: int | None) -> dict[str, Any]:
    rows = []
    everything: list[chaos.Outcome] = []
    for scenario, world in scenarios:
        started = time.monotonic()
        outcomes = []
        for iteration in chaos.plan(
            ((scenario, world),), base / f"{scenario}-{world}", seed=seed, systematic=limit, timed=timed
        ):
            outcome = chaos.run_iteration(iteration)
            outcomes.append(outcome)
            chaos.remove(iteration.directory)
            if outcome.status != "clean":
                print(f"  {scenario}/{world} {outcome.point}: {outcome.status}: {outcome.reason}", flush=True)
        summary = chaos.summarize(outcomes)
        rows.append({"scenario": scenario, "ranks": world, **{k: v for k, v in summary.items() if k != "failures"}})
        rows[-1]["seconds"] = round(time.monotonic() - started, 1)
        everything += outcomes
        print(
            f"{scenario:>9} x{world}: {summary['tried']:4d} kill points, {summary['killed']:4d} killed, "
            f"{summary['clean']:4d} clean, {summary['lost']} lost, {summary['silent']} silent, "
            f"{summary['violations']} other; kept A {summary['kept_old']}, committed B {summary['committed_new']} "
            f"({rows[-1]['seconds']} s)",
            flush=True,
        )
    total = chaos.summarize(everything)
    return {"rows": rows, "total": total}


def run_corruptions(base: Path, count: int, seed: int) -> dict[str, Any]:
    corruption.make_pristine(base / "pristine", base / "other")
    rng = random.Random(seed)
    all_runs = []
    for i in range(count):
        copy = base / f"c{i}"
        shutil.copytree(base / "pristine", copy / "ckpt")
        (copy / "out").mkdir()
        damage = corruption.corrupt(copy / "ckpt", base / "other", rng)
        all_runs.append(corruption.run_tools(copy / "ckpt", base / "pristine", copy / "out", damage))
        shutil.rmtree(copy)
    summary = corruption.summarize(all_runs)
    print(
        f"corruptions: {summary['corruptions']} damaged copies, {summary['tool_runs']} tool runs: "
        f"{summary['exact']} exact, {summary['refused']} refused, {summary['silent']} silent, "
        f"{summary['violations']} other",
        flush=True,
    )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scenarios",
        default=",".join(f"{s}:{w}" for s, w in SCENARIOS),
        help="scenario:ranks pairs, comma-separated (default: every scenario on 2, 3 and 4 ranks)",
    )
    parser.add_argument("--limit", type=int, default=None, help="kill points per scenario, sampled (default: all)")
    parser.add_argument("--timed", type=int, default=20, help="kills at random delays per scenario (default 20)")
    parser.add_argument("--corruptions", type=int, default=1000, help="seeded corruptions (default 1000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    scenarios = [(s, int(w)) for s, w in (item.split(":") for item in args.scenarios.split(","))]
    base = Path(tempfile.mkdtemp(prefix="reshard-chaos-"))
    started = time.monotonic()
    try:
        kills = run_kills(base / "kills", scenarios, args.seed, args.timed, args.limit)
        corrupted = run_corruptions(base / "corruption", args.corruptions, args.seed) if args.corruptions else None
    finally:
        shutil.rmtree(base, ignore_errors=True)
    total = kills["total"]
    print(
        f"total: {total['tried']} kill points ({total['killed']} killed), {total['lost']} lost checkpoints, "
        f"{total['silent']} silent wrong loads, {total['violations']} other violations, in "
        f"{time.monotonic() - started:.0f} s",
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps({"kills": kills, "corruptions": corrupted}, indent=2, default=str))
    bad = total["lost"] + total["silent"] + total["violations"]
    if corrupted is not None:
        bad += corrupted["silent"] + corrupted["violations"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
