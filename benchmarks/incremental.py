"""Incremental checkpoints: bytes written and save time, full vs incremental, side by side with DCP in the same run.

A job saves ``--steps`` step checkpoints of a state split by rows over ``--ranks`` gloo ranks (TP-like: every
rank holds a slice of every tensor). Between two saves, training changes part of the state:

- ``lora``: a frozen base (``--frozen-fraction``, 96 % of the bytes by default) and trained adapters plus
  their Adam moments (the rest), which change every step;
- ``ten_percent``: 10 % of the tensors change every step (a different tenth each time), the others stay.

Systems, each saving every step into its own directory:

- ``reshard``: ``reshard.save`` of the whole state (what reshard does without ``base``);
- ``reshard_hashed``: the same with ``SaveOptions(content_hash=True)`` (the cost of hashing alone);
- ``incremental``: ``reshard.save(..., base=<previous step>)`` (the first step is a hashed full save), which reads
  back every box it references from the base's files and checks its XXH3-128 before referencing it (the default,
  ``SaveOptions(verify_base=True)``);
- ``incremental_trusted``: the same with ``SaveOptions(verify_base=False)``, which trusts the base's recorded hashes
  and reads nothing of it (the cost of verifying is the difference);
- ``dcp``: ``torch.distributed.checkpoint.save`` of the same tensors as DTensors (``Shard(0)`` over the ranks).

Measured per save: the slowest rank's seconds, the bytes the save added to storage (the sizes of the files
it created), the bytes it read back from its base (all ranks together) and the slowest rank's seconds reading
them back and hashing them (``SaveStats.seconds_verify_base``). Two modes, as users meet saves:
``warm`` (one set of processes saves every step of every system: medians over the steps after the first) and
``cold`` (a fresh set of processes for every single save, as after a restart or in a short job; the save call
itself is timed, the imports are reported apart). The base's files were written moments before, so its bytes are
read back from the page cache in both modes. Ratios are incremental / reshard, incremental / DCP and
incremental / incremental_trusted (below 1: incremental is smaller or faster).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from benchmarks.scratch import free_port, scratch_dir
except ImportError:  # run as a script: benchmarks/ is the first entry of sys.path
    from scratch import free_port, scratch_dir  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SYSTEMS = ("reshard", "reshard_hashed", "incremental", "incremental_trusted", "dcp")
SCENARIOS = ("lora", "ten_percent")
TENSORS = 40
"""The state is this many equally sized fp32 matrices (the LoRA scenario's trained part is its last ones)."""


def _changed(scenario: str, index: int, step: int, frozen_fraction: float) -> bool:
    """Whether tensor ``index`` changes before step ``step`` (every tensor is new at step 1)."""
    if scenario == "lora":
        return index >= round(TENSORS * frozen_fraction)
    return index % 10 == step % 10


def global_tensor(scenario: str, index: int, step: int, rows: int, frozen_fraction: float) -> torch.Tensor:
    """Tensor ``index`` as of step ``step``: its value changes exactly at the steps :func:`_changed` says."""
    last = max([1] + [s for s in range(2, step + 1) if _changed(scenario, index, s, frozen_fraction)])
    g = torch.Generator().manual_seed(1000 * index + last)
    return torch.randn(rows, 1024, generator=g)


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _total(count: int) -> int:
    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return int(value.item())


def _new_bytes(directory: Path) -> int:
    """Bytes of the files under ``directory`` (a checkpoint one save created)."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _rank(rank: int, world: int, port: int, args: dict[str, Any], jobs: list[tuple[str, int]], results: Any) -> None:
    """Run the saves ``jobs`` ((system, step) pairs, in order) in this process; rank 0 reports."""
    started_imports = time.perf_counter()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import reshard

    imports = time.perf_counter() - started_imports
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    mesh = init_device_mesh("cpu", (world,))
    root = Path(args["dir"])
    rows = args["rows"]
    out = []
    for system, step in jobs:
        local = {}
        for i in range(TENSORS):
            full = global_tensor(args["scenario"], i, step, rows * world, args["frozen_fraction"])
            local[f"layer{i}.weight"] = full[rank * rows : (rank + 1) * rows].clone()
        target = root / system / f"step_{step:04d}"
        stats = reshard.SaveStats()  # DCP's run reads zeros
        dist.barrier()
        started = time.perf_counter()
        if system == "dcp":
            state = {k: DTensor.from_local(v, mesh, [Shard(0)], run_check=False) for k, v in local.items()}
            dcp.save(state, checkpoint_id=str(target))
        else:
            sharded = {k: reshard.ShardedTensor.from_rank_offsets(k, v, (0, rank, world)) for k, v in local.items()}
            hashed = system != "reshard"
            base = root / system / f"step_{step - 1:04d}" if system.startswith("incremental") and step > 1 else None
            options = reshard.SaveOptions(content_hash=hashed, verify_base=system != "incremental_trusted")
            stats = reshard.save(sharded, target, options=options, base=base).stats
        seconds = _slowest(time.perf_counter() - started)
        read_back = _total(stats.bytes_base_read)
        verify_seconds = _slowest(stats.seconds_verify_base)
        dist.barrier()
        if rank == 0:
            row = {"system": system, "step": step, "seconds": seconds, "bytes": _new_bytes(target)}
            out.append({**row, "read_back": read_back, "verify_seconds": verify_seconds})
    if rank == 0:
        results.put({"saves": out, "imports_seconds": imports})
    dist.destroy_process_group()


def _run(world: int, args: dict[str, Any], jobs: list[tuple[str, int]]) -> dict[str, Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_rank, args=(r, world, port, args, jobs, results)) for r in range(world)]
    for p in processes:
        p.start()
    report = results.get(timeout=1800)
    for p in processes:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"a benchmark rank exited with {p.exitcode}")
    return report


def measure(
    scenario: str, mode: str, world: int, steps: int, rows: int, frozen_fraction: float, systems: list[str], work: Path
) -> dict[str, Any]:
    """Every save of ``systems`` for ``steps`` steps; per system the median seconds and bytes of the saves after
    the first, and the first's."""
    args = {
        "dir": str(work / f"{scenario}-{mode}"),
        "rows": rows,
        "scenario": scenario,
        "frozen_fraction": frozen_fraction,
    }
    jobs = [(system, step) for step in range(1, steps + 1) for system in systems]
    saves: list[dict[str, Any]] = []
    imports: list[float] = []
    if mode == "warm":
        report = _run(world, args, jobs)
        saves, imports = report["saves"], [report["imports_seconds"]]
    else:
        for job in jobs:
            report = _run(world, args, [job])
            saves += report["saves"]
            imports.append(report["imports_seconds"])
    figures: dict[str, Any] = {}
    for system in systems:
        mine = [s for s in saves if s["system"] == system]
        later = [s for s in mine if s["step"] > 1]
        figures[system] = {
            "first_seconds": mine[0]["seconds"],
            "first_bytes": mine[0]["bytes"],
            "seconds": statistics.median(s["seconds"] for s in later) if later else None,
            "bytes": statistics.median(s["bytes"] for s in later) if later else None,
            "read_back": statistics.median(s["read_back"] for s in later) if later else None,
            "verify_seconds": statistics.median(s["verify_seconds"] for s in later) if later else None,
        }
    ratios = {}
    inc = figures.get("incremental")
    for other in ("reshard", "dcp", "incremental_trusted"):
        if inc is not None and inc["seconds"] is not None and other in figures:
            ratios[f"incremental/{other}.bytes"] = inc["bytes"] / figures[other]["bytes"]
            ratios[f"incremental/{other}.seconds"] = inc["seconds"] / figures[other]["seconds"]
    return {"figures": figures, "ratios": ratios, "imports_seconds_median": statistics.median(imports)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--size-mib", type=float, default=160.0, help="size of the whole state (default 160 MiB)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--steps", type=int, default=4, help="step checkpoints per system (default 4)")
    p.add_argument("--frozen-fraction", type=float, default=0.96, help="the LoRA scenario's frozen share of the bytes")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--mode", choices=("warm", "cold", "both"), default="both", help="default both")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    return p.parse_args(argv)


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:8.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = max(1, int(args.size_mib * 2**20) // (TENSORS * 1024 * 4 * args.ranks))
    modes = ["warm", "cold"] if args.mode == "both" else [args.mode]
    report: dict[str, Any] = {
        "config": {
            **vars(args),
            "rows_per_rank": rows,
            "tensors": TENSORS,
            "bytes": TENSORS * rows * args.ranks * 4096,
        },
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
        "results": {},
    }
    with scratch_dir("reshard-bench-", args.dir) as work:
        for scenario in args.scenarios:
            for mode in modes:
                result = measure(
                    scenario, mode, args.ranks, args.steps, rows, args.frozen_fraction, args.systems, Path(work)
                )
                report["results"][f"{scenario}.{mode}"] = result
                print(f"\n{scenario}, {mode} ({args.ranks} ranks, {report['config']['bytes'] / 2**20:.0f} MiB state)")
                print(
                    f"  {'system':<20}{'MiB written':>12}{'MiB read back':>14}{'seconds':>10}{'of which verify':>16}"
                    "   (first save: MiB, seconds)"
                )
                for system, f in result["figures"].items():
                    seconds = "-" if f["seconds"] is None else f"{f['seconds']:10.3f}"
                    verify = "-" if f["verify_seconds"] is None else f"{f['verify_seconds']:16.3f}"
                    first = f"({_mib(f['first_bytes'])}, {f['first_seconds']:.3f})"
                    read_back = _mib(f["read_back"])
                    print(f"  {system:<20}{_mib(f['bytes']):>12}{read_back:>14}{seconds:>10}{verify}   {first}")
                for name, value in result["ratios"].items():
                    print(f"  ratio {name}: {value:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
