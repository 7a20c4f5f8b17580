"""Loading on data-parallel replicas, and the peer-memory tier: reshard side by side with DCP in the same run.

For each DP size (1, 2, 4 by default) this spawns that many gloo ranks, every one a replica that needs the
whole state (TP=1), and measures, in the same processes:

- ``reshard``: ``reshard.load`` with ``LoadOptions(read_once=False)``: every replica reads its own bytes;
- ``read_once``: ``reshard.load`` with ``read_once=True``: each byte read once, then exchanged over gloo;
- ``dcp``: ``torch.distributed.checkpoint.load`` of the same tensors (each replica reads them);
- ``peer``: ``PeerMemoryCheckpoint.save`` (how long it blocks) and ``restore`` (all in host memory), next to
  ``reshard.save`` and ``reshard.load`` of the same state on storage (needs DP >= 2: copies go to other
  "nodes" of one rank each).

Storage bytes are counted by the storage layer: reshard's ``Storage.range_bytes_read`` and, for DCP, the
bytes its processes read through system calls (``rchar`` of ``/proc/self/io``), summed over the ranks. Times
are the slowest rank's, medians over ``--repeat`` repetitions; the first repetition of each measurement, in
freshly started processes, is reported apart as the cold figure. Ratios are reshard / DCP (below 1: reshard
is faster) and read_once / reshard.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
import warnings
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

import reshard
from reshard.storage import storage_for
from reshard.storage.local import LocalStorage


def _state(size_bytes: int) -> dict[str, torch.Tensor]:
    """Eight fp32 matrices of about ``size_bytes`` in all, with values that identify every element."""
    rows = max(1, size_bytes // (8 * 1024 * 4))
    return {f"layer{i}.weight": torch.arange(rows * 1024.0).reshape(rows, 1024) + i for i in range(8)}


ORDER = ("reshard", "read_once", "dcp", "reshard_s3", "read_once_s3", "save", "peer_save", "load", "peer_restore")
"""The rows of the table, in order."""


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value.item())


def _total(count: int) -> int:
    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value)
    return int(value.item())


def _rank(rank: int, world: int, port: int, args: dict[str, Any], results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    root = Path(args["dir"])
    full = _state(args["size_bytes"])
    names = ["reshard", "read_once", "dcp", "reshard_s3", "read_once_s3", "save", "peer_save", "load", "peer_restore"]
    figures: dict[str, list[tuple[float, int]]] = {name: [] for name in names}
    tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1) if world > 1 else None
    for _ in range(args["repeat"]):
        stores = [("reshard", False, None), ("read_once", True, None)]
        if args["s3"]:
            stores += [("reshard_s3", False, args["s3"]), ("read_once_s3", True, args["s3"])]
        for name, read_once, s3 in stores:
            template = {k: torch.empty_like(v) for k, v in full.items()}
            storage = LocalStorage(root / "reshard") if s3 is None else storage_for("s3://bench/ckpt", s3)
            dist.barrier()
            started = time.perf_counter()
            reshard.load(template, storage, options=reshard.LoadOptions(read_once=read_once))
            figures[name].append((_slowest(time.perf_counter() - started), _total(storage.range_bytes_read)))
            assert all(torch.equal(template[k], v) for k, v in full.items())
        import torch.distributed.checkpoint as dcp

        template = {k: torch.empty_like(v) for k, v in full.items()}
        dist.barrier()
        before = _rchar()
        started = time.perf_counter()
        dcp.load(template, checkpoint_id=str(root / "dcp"))
        figures["dcp"].append((_slowest(time.perf_counter() - started), _total(_rchar() - before)))
        assert all(torch.equal(template[k], v) for k, v in full.items())
        if tier is not None:
            mine = _dp_state(full, rank, world)
            dist.barrier()
            started = time.perf_counter()
            reshard.save(mine, root / "storage", overwrite=True)
            figures["save"].append((_slowest(time.perf_counter() - started), 0))
            dist.barrier()
            started = time.perf_counter()
            tier.save(mine)
            figures["peer_save"].append((_slowest(time.perf_counter() - started), 0))
            other = _dp_template(full, rank, world)
            dist.barrier()
            started = time.perf_counter()
            reshard.load(other, root / "storage", options=reshard.LoadOptions(read_once=False))
            figures["load"].append((_slowest(time.perf_counter() - started), 0))
            other = _dp_template(full, rank, world)
            dist.barrier()
            started = time.perf_counter()
            tier.restore(other)
            figures["peer_restore"].append((_slowest(time.perf_counter() - started), 0))
    if rank == 0:
        results.put(figures)
    dist.destroy_process_group()


def _dp_state(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """The state split by rows over ``world`` ranks (each rank a primary: peer copies have work to do)."""
    out = {}
    for key, value in full.items():
        rows = value.shape[0] // world
        local = value[rank * rows : (rank + 1) * rows].clone()
        out[key] = reshard.ShardedTensor.from_rank_offsets(key, local, (0, rank, world))
    return out


def _dp_template(full: dict[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """Another layout of the same state: split by columns."""
    out = {}
    for key, value in full.items():
        cols = value.shape[1] // world
        out[key] = reshard.ShardedTensor.from_rank_offsets(key, torch.empty(value.shape[0], cols), (1, rank, world))
    return out


def _start_s3(full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """moto's S3 server in a thread of this process, a bucket, and the checkpoint saved into it."""
    import logging
    import urllib.request

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"endpoint_url": f"http://{host}:{port}", "key": "bench", "secret": "bench"}
    urllib.request.urlopen(urllib.request.Request(f"{options['endpoint_url']}/bench", method="PUT"))
    reshard.save(full, "s3://bench/ckpt", storage_options=options)
    return options


def _summary(samples: list[tuple[float, int]]) -> dict[str, Any]:
    if not samples:
        return {}
    warm = samples[1:] or samples
    return {
        "seconds": statistics.median(s for s, _ in warm),
        "cold_seconds": samples[0][0],
        "storage_bytes": statistics.median(b for _, b in warm),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--size-mib", type=float, default=64.0, help="size of the state (default 64 MiB)")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="DP sizes to measure (default 1 2 4)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions per DP size; medians of all but the first")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    p.add_argument(
        "--s3", action="store_true", help="also load from S3: moto's server on 127.0.0.1 (needs moto[server])"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    size = int(args.size_mib * 1024 * 1024)
    with scratch_dir("reshard-bench-", args.dir) as work:
        root = Path(work)
        full = _state(size)
        reshard.save(full, root / "reshard")
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(full, checkpoint_id=str(root / "dcp"), no_dist=True)
        unique = sum(v.numel() * v.element_size() for v in full.values())
        s3_options = _start_s3(full) if args.s3 else None
        report: dict[str, Any] = {"unique_bytes": unique, "dp": {}}
        context = mp.get_context("spawn")
        for world in args.dp:
            results = context.Queue()
            options = {"dir": str(root), "size_bytes": size, "repeat": args.repeat, "s3": s3_options}
            processes = [
                context.Process(target=_rank, args=(r, world, port, options, results))
                for port in [free_port()]
                for r in range(world)
            ]
            for process in processes:
                process.start()
            figures = results.get(timeout=1800)
            for process in processes:
                process.join(timeout=60)
            report["dp"][world] = {name: _summary(samples) for name, samples in figures.items()}
    print(f"state: {unique / 2**20:.1f} MiB; storage bytes over all ranks in units of the unique bytes")
    print(f"{'DP':>3}  {'system':<12} {'warm s':>8} {'cold s':>8} {'storage':>8}  ratios")
    for world, systems in report["dp"].items():
        base = systems["dcp"]["seconds"]
        for name in ORDER:
            s = systems.get(name) or {}
            if not s:
                continue
            ratio = ""
            if name in ("reshard", "read_once"):
                ratio = f"vs dcp {s['seconds'] / base:.2f}"
            if name == "read_once":
                ratio += f", vs reshard {s['seconds'] / systems['reshard']['seconds']:.2f}"
            if name == "read_once_s3":
                ratio = f"vs reshard_s3 {s['seconds'] / systems['reshard_s3']['seconds']:.2f}"
            if name == "peer_save":
                ratio = f"vs save {s['seconds'] / systems['save']['seconds']:.2f}"
            if name == "peer_restore":
                ratio = f"vs load {s['seconds'] / systems['load']['seconds']:.2f}"
            counted = ("reshard", "read_once", "dcp", "reshard_s3", "read_once_s3")
            stored = f"{s['storage_bytes'] / unique:.2f}x" if name in counted else "-"
            print(f"{world:>3}  {name:<12} {s['seconds']:>8.3f} {s['cold_seconds']:>8.3f} {stored:>8}  {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
