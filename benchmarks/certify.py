"""The cost of certified recovery points: save time with and without ``certify`` on data-parallel replicas.

For each DP size (2 and 4 by default) this spawns that many gloo ranks. Every rank holds the whole state as a
data-parallel replica (``replica_id`` = its DP rank, the layout of plain DDP): a save writes each box once and the
other ranks hold replicas they do not write, which the ``replicas`` check checksums (the extra pass); ``finite``
scans the boxes each rank saves. In the same processes it measures, medians over ``--repeat`` repetitions (the
first is reported apart as the cold figure), the slowest rank's time of:

- ``save``: ``reshard.save`` of the state; ``save_certify``: the same with ``SaveOptions(certify=CertifyOptions())``;
- ``peer_save`` and ``peer_save_certify``: ``PeerMemoryCheckpoint.save`` without and with ``certify``.

The ratio ``*_certify / *`` is the price of the checks. Every certified save is asserted to pass its checks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
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

ORDER = ("save", "save_certify", "peer_save", "peer_save_certify")
"""The rows of the table, in order."""


def _state(size_bytes: int, rank: int) -> dict[str, Any]:
    """Eight fp32 matrices of about ``size_bytes`` in all, every rank a DP replica of the whole (``replica_id``)."""
    rows = max(1, size_bytes // (8 * 1024 * 4))
    out: dict[str, Any] = {}
    for i in range(8):
        value = torch.arange(rows * 1024.0).reshape(rows, 1024) + i
        out[f"layer{i}.weight"] = reshard.ShardedTensor(f"layer{i}.weight", value, value.shape, (0, 0), replica_id=rank)
    return out


def _check(checks: reshard.Checks | None) -> None:
    """A certified save of sound replicas passes its checks (else the figure measures something else)."""
    if checks is None or not checks.passed:
        raise SystemExit(f"a certified save of sound replicas did not pass its checks: {checks}")


def _rank(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    root = Path(args["dir"]) / f"dp{world}"
    state = _state(args["size_bytes"], rank)
    certify = reshard.CertifyOptions()
    figures: dict[str, list[float]] = {name: [] for name in ORDER}
    tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1)
    options = reshard.SaveOptions(certify=certify)
    for _ in range(args["repeat"]):
        seconds, _ = slowest_timed(lambda: reshard.save(state, root / "plain", overwrite=True))
        figures["save"].append(seconds)
        seconds, result = slowest_timed(
            lambda: reshard.save(state, root / "certified", overwrite=True, options=options)
        )
        _check(result.checks)
        figures["save_certify"].append(seconds)
        seconds, _ = slowest_timed(lambda: tier.save(state))
        figures["peer_save"].append(seconds)
        seconds, result = slowest_timed(lambda: tier.save(state, certify=certify))
        _check(result.checks)
        figures["peer_save_certify"].append(seconds)
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--size-mib", type=float, default=256.0, help="size of the state (default 256 MiB)")
    p.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="DP sizes to measure (default 2 4)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions per DP size; medians of all but the first")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = int(args.size_mib * 1024 * 1024)
    report: dict[str, Any] = {"state_bytes": 0, "dp": {}}
    with scratch_dir("reshard-bench-certify-", args.dir) as work:
        context = mp.get_context("spawn")
        for world in args.dp:
            results = context.Queue()
            options = {"dir": str(work), "size_bytes": size, "repeat": args.repeat}
            port = free_port()
            processes = [context.Process(target=_rank, args=(r, world, port, options, results)) for r in range(world)]
            for process in processes:
                process.start()
            figures = results.get(timeout=1800)
            for process in processes:
                process.join(timeout=60)
            report["dp"][world] = {name: warm_and_cold(samples) for name, samples in figures.items()}
    report["state_bytes"] = sum(v.data.numel() * 4 for v in _state(size, 0).values())
    print(f"state: {report['state_bytes'] / 2**20:.1f} MiB, every rank a DP replica of the whole")
    print(f"{'DP':>3}  {'operation':<18} {'warm s':>8} {'cold s':>8}  ratio")
    for world, rows in report["dp"].items():
        for name in ORDER:
            row = rows[name]
            ratio = ""
            if name.endswith("_certify"):
                ratio = (
                    f"vs {name[: -len('_certify')]} {row['seconds'] / rows[name[: -len('_certify')]]['seconds']:.2f}"
                )
            print(f"{world:>3}  {name:<18} {row['seconds']:>8.3f} {row['cold_seconds']:>8.3f}  {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
