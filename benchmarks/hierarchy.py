"""The two-level control path against the flat one: time of a gather + scatter + broadcast of reshard's protocol
over gloo processes on this machine, the bytes the coordinator receives, and the padded-bytes model at large scale.

Usage::

    .venv/bin/python benchmarks/hierarchy.py --ranks 8 16 --ranks-per-node 4 --kib 10 50 200

Each configuration forks ``ranks`` processes (one gloo group over loopback), builds a flat Communicator and a
``HierarchicalGroups(ranks_per_node=k)``, and times ``repeat`` rounds of what a planning step moves: every rank
gathers a payload of ``kib`` KiB (lengths vary from half to all of it, as descriptions do), the coordinator
scatters a reply of the same size to each and broadcasts a small decision. Printed: the median round on rank
0, the bytes the coordinator received in one gather, and the model of ``padded_size`` for 8192 ranks. For
docs/scale.md, "Two-level control path"; not a test.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reshard.net.comm import Communicator
from reshard.net.hierarchy import HierarchicalGroups, frame
from reshard.net.transports import Transport, padded_size


def _payload(rank: int, size: int, kib: int) -> bytes:
    length = kib * 1024 // 2 + (kib * 1024 // 2) * rank // max(size - 1, 1)
    return bytes([rank % 251]) * length


def _round(transport: Transport, kib: int) -> tuple[float, int]:
    rank, size = transport.rank, transport.size
    before = transport.bytes_received
    started = time.perf_counter()
    gathered = transport.gather_bytes(_payload(rank, size, kib))
    received = transport.bytes_received - before
    transport.scatter_bytes(gathered)  # the replies: as large as the descriptions
    transport.broadcast_bytes(b"{}" if rank == 0 else None)
    return time.perf_counter() - started, received


def _worker(rank: int, size: int, port: int, k: int, kibs: list[int], repeat: int, results: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=datetime.timedelta(seconds=120))
    flat = Communicator(None, timeout=120).transport
    two_level = Communicator(HierarchicalGroups(None, ranks_per_node=k, timeout=120), timeout=120).transport
    for kib in kibs:
        for name, transport in (("flat", flat), ("two-level", two_level)):
            _round(transport, kib)  # warm up
            rounds = [_round(transport, kib) for _ in range(repeat)]
            if rank == 0:
                results.put((name, kib, statistics.median(t for t, _ in rounds), rounds[0][1]))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(size: int, k: int, kibs: list[int], repeat: int) -> list[tuple[str, int, float, int]]:
    """(path, KiB, median seconds of a round, bytes the coordinator received in one gather) per configuration."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, size, port, k, kibs, repeat, results)) for r in range(size)]
    for p in procs:
        p.start()
    out = [results.get(timeout=600) for _ in range(2 * len(kibs))]
    for p in procs:
        p.join(timeout=60)
    return out


def model(size: int, k: int, longest: int) -> tuple[int, int]:
    """Bytes the coordinator receives in one gather of ``size`` payloads of at most ``longest`` bytes (all that
    long: the padding's worst case is not counted): flat, and two-level (its node's ``k - 1`` at the node level,
    then ``size / k - 1`` framed node messages, each ``8 + frame`` of ``k`` payloads)."""
    flat = (size - 1) * padded_size([longest])
    node = (k - 1) * padded_size([longest])
    leaders = (size // k - 1) * padded_size([len(frame([b"\0" * longest] * k))])
    return flat, node + leaders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--ranks-per-node", type=int, default=4)
    parser.add_argument("--kib", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print("| ranks | k | payload KiB | flat ms | two-level ms | coordinator received flat | two-level |")
    print("|---|---|---|---|---|---|---|")
    for size in args.ranks:
        rows = {(name, kib): (t, b) for name, kib, t, b in measure(size, args.ranks_per_node, args.kib, args.repeat)}
        for kib in args.kib:
            (tf, bf), (th, bh) = rows[("flat", kib)], rows[("two-level", kib)]
            print(f"| {size} | {args.ranks_per_node} | {kib} | {tf * 1e3:.2f} | {th * 1e3:.2f} | {bf:,} | {bh:,} |")
    print("\nModel (padded_size), 8192 ranks, payloads of 17.5 KiB (the descriptions of docs/scale.md):")
    for k in (4, 8):
        flat, two = model(8192, k, 17_920)
        print(
            f"k={k}: coordinator receives {flat / 2**20:.1f} MiB flat in 8191 messages, "
            f"{two / 2**20:.1f} MiB two-level in {8192 // k - 1 + k - 1} messages"
        )


if __name__ == "__main__":
    main()
