#!/usr/bin/env python
"""A BF16 trainer layout to a low-precision inference layout: ``reshard.transfer`` quantizing on the way
against a BF16 transfer followed by a separate quantization pass on the receivers, side by side.

    python benchmarks/quantize_transfer.py                  # 64 MiB of BF16, FP8 128x128 and MXFP8, 5 repetitions
    python benchmarks/quantize_transfer.py --size-mib 256 --formats fp8_e4m3 --json quantize.json

Eight BF16 matrices of 2048 columns (``--size-mib`` MiB in all) held by the trainer layout (TP2: rows split
in two, on ranks 0 and 1) go to the inference layout (TP4: columns split in four, ranks 0 to 3), as in-process
ranks (a :class:`reshard.net.transports.ThreadGroup`: the real protocol, with memory copies for a network).
Two ways, each timed (the slowest rank's seconds, median over the repetitions after one untimed run):

- *quantizing*: the targets are ``ScaledTensor`` templates; the senders compute the block amaxes (one small
  collective), scales and low-precision bytes, and only those travel;
- *bf16 then quantize*: the targets are BF16 tensors; after the transfer each receiver quantizes its own
  columns with ``reshard.state.quantize.quantize`` (column splits fall on block boundaries, so this gives the
  same bytes).

Bytes on the wire are the sum of every rank's ``TransferStats.bytes_sent`` (local copies are not counted).
The two results are checked equal byte for byte. Ratios are quantizing / baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import reshard
from reshard.net.transports import ThreadGroup
from reshard.state.quantize import quantize

MiB = 1 << 20
COLS = 2048
BLOCKS = {"fp8_e4m3": (128, 128), "mxfp8_e4m3": None}


def _weights(size_mib: float) -> list[torch.Tensor]:
    rows = max(256, int(size_mib * MiB / 2 / 8 / COLS) // 256 * 256)
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(rows, COLS, generator=generator).to(torch.bfloat16) for _ in range(8)]


def _source(weights: list[torch.Tensor], rank: int) -> dict[str, Any]:
    if rank >= 2:
        return {}
    out = {}
    for i, full in enumerate(weights):
        half = full.shape[0] // 2
        out[f"w{i}"] = reshard.ShardedTensor(
            f"w{i}", full[rank * half : (rank + 1) * half].clone(), tuple(full.shape), (rank * half, 0)
        )
    return out


def _target(weights: list[torch.Tensor], rank: int, fmt: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, full in enumerate(weights):
        cols = full.shape[1] // 4
        if fmt is None:
            out[f"w{i}"] = reshard.ShardedTensor.from_rank_offsets(
                f"w{i}", torch.empty(full.shape[0], cols, dtype=torch.bfloat16), (1, rank, 4)
            )
            continue
        local = quantize(torch.zeros(full.shape[0], cols), fmt, BLOCKS[fmt])
        data = reshard.ShardedTensor.from_rank_offsets(f"w{i}", torch.empty_like(local.data), (1, rank, 4))
        out[f"w{i}"] = reshard.ScaledTensor(data, torch.empty_like(local.scale), fmt, BLOCKS[fmt])
    return out


def _run(weights: list[torch.Tensor], fmt: str, quantizing: bool) -> tuple[float, int, list[list[torch.Tensor]]]:
    """One transfer on 4 in-process ranks: the slowest rank's seconds, the bytes sent, each rank's bytes."""
    group = ThreadGroup(4)
    sources = [_source(weights, r) for r in range(4)]
    targets = [_target(weights, r, fmt if quantizing else None) for r in range(4)]
    seconds, sent, results = [0.0] * 4, [0] * 4, [[] for _ in range(4)]

    def rank(r: int) -> None:
        stats = reshard.TransferStats()
        start = time.perf_counter()
        reshard.transfer(sources[r], targets[r], group=group.member(r), stats=stats)
        if quantizing:
            got = [t.data.data.view(torch.uint8).flatten() for t in targets[r].values()]
            got += [t.scale.contiguous().view(torch.uint8).flatten() for t in targets[r].values()]
        else:
            done = [quantize(t.data, fmt, BLOCKS[fmt]) for t in targets[r].values()]
            got = [q.data.view(torch.uint8).flatten() for q in done] + [
                q.scale.contiguous().view(torch.uint8).flatten() for q in done
            ]
        seconds[r] = time.perf_counter() - start
        sent[r] = stats.bytes_sent
        results[r] = got

    import threading

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not all(results):
        raise RuntimeError("a rank failed")
    return max(seconds), sum(sent), results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=float, default=64.0, help="BF16 size of the weights (default 64)")
    p.add_argument("--formats", nargs="+", default=list(BLOCKS), choices=list(BLOCKS), help="target formats")
    p.add_argument("--repeat", type=int, default=5, help="timed runs of each way after one untimed (default 5)")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    weights = _weights(args.size_mib)
    bf16_bytes = sum(w.numel() * 2 for w in weights)
    report: dict[str, Any] = {"config": {"size_mib": bf16_bytes / MiB, "repeat": args.repeat}, "formats": {}}
    print(f"{bf16_bytes / MiB:.1f} MiB of BF16, TP2 rows -> TP4 columns, 4 in-process ranks")
    for fmt in args.formats:
        figures: dict[str, Any] = {}
        for way, quantizing in (("quantizing", True), ("bf16_then_quantize", False)):
            _run(weights, fmt, quantizing)  # untimed
            runs = [_run(weights, fmt, quantizing) for _ in range(args.repeat)]
            figures[way] = {
                "seconds": statistics.median(s for s, _, _ in runs),
                "seconds_all": [s for s, _, _ in runs],
                "bytes_on_wire": runs[0][1],
            }
            figures[way + "_result"] = runs[0][2]
        same = all(
            torch.equal(a, b)
            for ra, rb in zip(figures.pop("quantizing_result"), figures.pop("bf16_then_quantize_result"), strict=True)
            for a, b in zip(ra, rb, strict=True)
        )
        q, b = figures["quantizing"], figures["bf16_then_quantize"]
        figures["bytes_ratio"] = q["bytes_on_wire"] / b["bytes_on_wire"]
        figures["seconds_ratio"] = q["seconds"] / b["seconds"]
        figures["same_bytes"] = same
        report["formats"][fmt] = figures
        print(
            f"{fmt}: bytes on the wire {q['bytes_on_wire'] / MiB:.1f} MiB vs {b['bytes_on_wire'] / MiB:.1f} MiB "
            f"(ratio {figures['bytes_ratio']:.3f}); seconds {q['seconds']:.3f} vs {b['seconds']:.3f} "
            f"(ratio {figures['seconds_ratio']:.2f}, max {max(q['seconds_all']):.3f} vs min "
            f"{min(b['seconds_all']):.3f}); same bytes: {same}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(f["same_bytes"] for f in report["formats"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
