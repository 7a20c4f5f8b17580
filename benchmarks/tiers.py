"""The tiers of ``reshard.TieredCheckpointManager``: how long a save stalls training on each tier, how long a drain
takes next to a direct durable save, and how long a restore takes from each tier.

This spawns ``--ranks`` gloo ranks (default 4) as nodes of ``--node-size`` ranks (default 2: two simulated nodes,
each with its own directory), holding a state of ``--size-mib`` (8 fp32 matrices split by rows over TP=2 and
replicated over DP=world/2), and measures, in the same processes, each through its own manager:

- ``peer_save``: a save to the ``PeerMemory`` tier (host memory, copies on the other node);
- ``local_save``: a save to the ``LocalDisk`` tier (each node's directory);
- ``durable_save``: a save straight to the ``Durable`` tier (no faster storage tier: what training waits for);
- ``drained_save``: a save to ``LocalDisk`` + ``Durable`` (the stall: the node-local save, the drain started);
- ``drain``: that drain, from the save's return to the end of ``wait()`` (in the background of training);
- ``peer_restore``, ``local_restore``, ``durable_restore``: a restore from each tier into another layout (rows
  split over every rank), by a manager that holds only that tier's steps.

Every save runs the default checks (``certify=CertifyOptions()``; ``--no-certify``: none). Times are the slowest
rank's, medians over ``--repeat`` repetitions (the first reported apart, as ``cold``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from benchmarks.scratch import free_port, scratch_dir, slowest_timed, warm_and_cold
except ImportError:  # run as a script: benchmarks/ is the first entry of sys.path
    from scratch import free_port, scratch_dir, slowest_timed, warm_and_cold  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import reshard

ORDER = (
    "peer_save",
    "local_save",
    "durable_save",
    "drained_save",
    "drain",
    "peer_restore",
    "local_restore",
    "durable_restore",
)
"""The rows of the table, in order."""
NEVER = 10**9
"""A Durable tier's ``every`` that keeps no step of a run (a durable tier is required)."""


def _full(size_bytes: int) -> dict[str, torch.Tensor]:
    """Eight fp32 matrices of about ``size_bytes`` in all (rows a multiple of 8)."""
    rows = max(8, size_bytes // (8 * 1024 * 4) // 8 * 8)
    return {f"layer{i}.weight": torch.arange(rows * 1024.0).reshape(rows, 1024) + i for i in range(8)}


def _state(full: dict[str, torch.Tensor], rank: int, world: int, step: int) -> dict[str, Any]:
    """TP=2 (rows) x DP=world/2 (replicas) of ``full``, and the step."""
    tp, dp = rank % 2, rank // 2
    out: dict[str, Any] = {"step": step}
    for key, value in full.items():
        rows = value.shape[0] // 2
        local = value[tp * rows : (tp + 1) * rows].clone()
        out[key] = reshard.ShardedTensor.from_rank_offsets(key, local, (0, tp, 2), replica_id=dp)
    return out


def _template(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """Another layout: rows split ``world`` ways."""
    out: dict[str, Any] = {"step": -1}
    for key, value in full.items():
        rows = value.shape[0] // world
        out[key] = reshard.ShardedTensor.from_rank_offsets(key, torch.empty(rows, value.shape[1]), (0, rank, world))
    return out


def _rank(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # the peer tier's steps are not certified: restore says so, each time
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    root, node_size = Path(args["dir"]), args["node_size"]
    full = _full(args["size_bytes"])
    certify = reshard.CertifyOptions() if args["certify"] else None
    drains = dist.new_group(backend="gloo")

    def manager(name: str, *tiers: Any) -> reshard.TieredCheckpointManager:
        return reshard.TieredCheckpointManager(list(tiers), drain_group=drains, certify=certify, timeout=600)

    local = str(root / "local" / "node{node}")
    peer = manager("peer", reshard.PeerMemory(every=1, node_size=node_size), reshard.Durable(root / "none", NEVER))
    disk = manager(
        "local", reshard.LocalDisk(local, every=1, node_size=node_size), reshard.Durable(root / "none", NEVER)
    )
    direct = manager("durable", reshard.Durable(root / "direct", every=1))
    drained = manager(
        "drained", reshard.LocalDisk(local + "-drained", every=1, node_size=node_size), reshard.Durable(root / "d", 1)
    )
    figures: dict[str, list[float]] = {name: [] for name in ORDER}
    for step in range(1, args["repeat"] + 1):
        state = _state(full, rank, world, step)
        for name, saver in (
            ("peer_save", peer),
            ("local_save", disk),
            ("durable_save", direct),
            ("drained_save", drained),
        ):
            figures[name].append(slowest_timed(lambda m=saver, s=step, st=state: m.save(s, st))[0])
        figures["drain"].append(slowest_timed(drained.wait)[0])
        for name, restorer in (("peer_restore", peer), ("local_restore", disk), ("durable_restore", direct)):
            seconds, found = slowest_timed(lambda r=restorer: r.restore(_template(full, rank, world)))
            assert found is not None, name
            assert found[0] == step, (name, found[:2])
            figures[name].append(seconds)
    for each in (peer, disk, direct, drained):
        each.close()
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--size-mib", type=float, default=256.0, help="size of the state (default 256 MiB)")
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks (default 4; an even number)")
    p.add_argument("--node-size", type=int, default=2, help="ranks per simulated node (default 2)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; medians of all but the first")
    p.add_argument("--no-certify", action="store_true", help="saves without the default checks")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ranks < 2 or args.ranks % 2 or args.ranks % args.node_size:
        raise SystemExit("--ranks must be even, at least 2, and a multiple of --node-size")
    size = int(args.size_mib * 1024 * 1024)
    with scratch_dir("reshard-bench-", args.dir) as work:
        unique = sum(v.numel() * v.element_size() for v in _full(size).values())
        options = {
            "dir": str(work),
            "size_bytes": size,
            "repeat": args.repeat,
            "node_size": args.node_size,
            "certify": not args.no_certify,
        }
        context = mp.get_context("spawn")
        results = context.Queue()
        port = free_port()
        processes = [
            context.Process(target=_rank, args=(r, args.ranks, port, options, results)) for r in range(args.ranks)
        ]
        for process in processes:
            process.start()
        try:
            figures = results.get(timeout=3600)
        finally:
            for process in processes:
                process.join(timeout=60)
                if process.is_alive():
                    process.kill()
    report: dict[str, Any] = {
        "unique_bytes": unique,
        "ranks": args.ranks,
        "node_size": args.node_size,
        "certify": not args.no_certify,
        "figures": {name: warm_and_cold(samples) for name, samples in figures.items()},
    }
    rows = report["figures"]
    print(f"state: {unique / 2**20:.1f} MiB on {args.ranks} ranks, nodes of {args.node_size}", end="")
    print(f"; certify: {report['certify']}")
    print(f"{'':<16} {'warm s':>8} {'cold s':>8}  ratio")
    for name in ORDER:
        ratio = ""
        if name.endswith("_save") and name != "durable_save":
            ratio = f"stall vs durable_save {rows[name]['seconds'] / rows['durable_save']['seconds']:.2f}"
        if name == "drain":
            ratio = f"vs durable_save {rows[name]['seconds'] / rows['durable_save']['seconds']:.2f}"
        if name.endswith("_restore") and name != "durable_restore":
            ratio = f"vs durable_restore {rows[name]['seconds'] / rows['durable_restore']['seconds']:.2f}"
        print(f"{name:<16} {rows[name]['seconds']:>8.3f} {rows[name]['cold_seconds']:>8.3f}  {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
