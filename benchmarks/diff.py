#!/usr/bin/env python
"""``reshard diff`` across dtypes: how fast two checkpoints of different dtypes are compared, in one process.

    python benchmarks/diff.py                      # 64 MiB fp32 against its bf16 copy, 5 repetitions
    python benchmarks/diff.py --size-mib 256 --dtypes float16 bfloat16 --json diff.json

Saves a state of ``--size-mib`` MiB of float32 values (8 matrices, split by rows into two boxes, as two ranks
would save it) and the same values cast to the second dtype, into a scratch directory (removed afterwards, on
SIGTERM too), then times ``reshard.interop.diff_checkpoints(a, b, ignore_dtypes=True, rtol=...)`` (what
``reshard diff A B --ignore-dtypes --rtol ...`` runs, without the interpreter's start) with the files in the
page cache. MB/s counts the bytes of both checkpoints' tensors (10^6 bytes per MB).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import reshard
from reshard.interop import diff_checkpoints

try:
    from benchmarks.scratch import scratch_dir
except ImportError:  # run as a script: benchmarks/ is the first entry of sys.path
    from scratch import scratch_dir  # type: ignore[no-redef]

MiB = 1 << 20


def _state(size_mib: float, dtype: torch.dtype, seed: int) -> dict[str, reshard.ShardedTensor]:
    """Eight matrices of 1024 columns holding ``size_mib`` MiB as float32, each saved as two row halves."""
    rows = max(2, int(size_mib * MiB / 4 / 8 / 1024) // 2 * 2)
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(8):
        full = torch.randn(rows, 1024, generator=generator).to(dtype)
        half = rows // 2
        for j in range(2):
            piece = full[j * half : (j + 1) * half].clone()
            out[f"w{i}.{j}"] = reshard.ShardedTensor(f"w{i}", piece, (rows, 1024), (j * half, 0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=float, default=64.0, help="float32 size of the state (default 64)")
    p.add_argument("--dtypes", nargs=2, default=["float32", "bfloat16"], help="dtypes of A and B")
    p.add_argument("--repeat", type=int, default=5, help="timed diffs after one untimed (default 5)")
    p.add_argument("--rtol", type=float, default=1e-2, help="the diff's relative tolerance (default 0.01)")
    p.add_argument("--dir", type=Path, default=None, help="where the scratch directory goes (default: /tmp)")
    p.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    dtype_a, dtype_b = (getattr(torch, name) for name in args.dtypes)
    with scratch_dir("reshard-bench-diff-", args.dir) as work:
        reshard.save(_state(args.size_mib, dtype_a, 0), work / "a")
        reshard.save(_state(args.size_mib, dtype_b, 0), work / "b")
        seconds = []
        for rep in range(args.repeat + 1):
            started = time.perf_counter()
            report = diff_checkpoints(work / "a", work / "b", ignore_dtypes=True, rtol=args.rtol)
            if rep:
                seconds.append(time.perf_counter() - started)
    nbytes = sum(math.prod(t.shape_a or ()) * (dtype_a.itemsize + dtype_b.itemsize) for t in report.tensors)
    median = statistics.median(seconds) if seconds else float("nan")
    worst = max(t.max_rel or 0.0 for t in report.tensors)
    print(
        f"diff {args.dtypes[0]} vs {args.dtypes[1]}: {nbytes / MiB:.0f} MiB of tensors in {median:.3f} s "
        f"(median of {len(seconds)}; all {', '.join(f'{s:.3f}' for s in seconds)}): {nbytes / median / 1e6:.0f} MB/s; "
        f"max relative difference {worst:.3g}, {'within' if report.ok else 'beyond'} rtol {args.rtol:g}"
    )
    if args.json is not None:
        figures = {"bytes": nbytes, "seconds_all": seconds, "seconds_median": median, "ok": report.ok}
        config = {"size_mib": args.size_mib, "dtypes": args.dtypes, "repeat": args.repeat, "rtol": args.rtol}
        args.json.write_text(json.dumps({"config": config, **figures}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
