#!/usr/bin/env python
"""Planning at scale: reshard's real planning code on simulated layouts of 8 to 8192 ranks, in one process.

    python benchmarks/scale.py                                  # 8 ... 2048 ranks (minutes: see benchmarks/README.md)
    python benchmarks/scale.py --ranks 512 8192 --json scale.json --plot docs/scale.png

Planning is pure, so it can run for thousands of ranks in one process: the descriptions of every rank come
from ``reshard.testing.layouts`` (a Megatron-style mixture-of-experts GPT of 1.25 trillion parameters, 128
layers, 256 experts, Adam state sharded with ZeRO-1; no tensor data), and each phase runs the code a real
save or load runs, on the bytes it would exchange:

- describe (every rank): encode its description for the coordinator (the rank's share of the exchange);
- plan (coordinator): decode every description, validate the global layout and elect the writers, encode
  each rank's assignment;
- commit (coordinator): assemble and encode the metadata from every rank's write report (made up: the
  reports a writer would send, offsets laid out as it would, placeholder checksums): ``metadata.json``, and
  the part files of partitioned metadata (format version 6) where the save writes them (written to a
  temporary directory, for the load);
- load (every rank of another layout: TP 4 and twice the pipeline stages): decode ``metadata.json`` (lazily,
  as the ranks that get it from the coordinator do), read and verify the parts the rank's keys need, and plan
  the reads, on sample ranks.

For each rank count it reports the time and peak memory (tracemalloc, in a second run) of planning on the
coordinator, the metadata size, the load planning time per rank, and the bytes that a rank other than the
coordinator sends and receives in the exchanges of a save (computed from the real payloads with the framing
of ``reshard.net.comm``). Then the growth exponent of each figure (slope of a log-log fit from 64 ranks up) and
the targets of docs/scale.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from reshard.io.parts import read_parts
from reshard.metadata import Metadata
from reshard.metadata.partition import MetadataDocuments, metadata_documents
from reshard.metadata.parts import part_of
from reshard.net.comm import padded_size
from reshard.planning.assemble import assemble_metadata
from reshard.planning.descriptions import DescriptionTable, WriteAssignment, encode_description
from reshard.planning.load_plan import plan_load
from reshard.planning.save_plan import plan_save_table
from reshard.storage import LocalStorage
from reshard.testing import MegatronLayout, MoETransformer, Parallelism
from reshard.testing.simulate import write_report

MiB = 1 << 20
CHUNK_BYTES = 4 * MiB
SAVE_ID = "0" * 32
DEFAULT_RANKS = (8, 32, 128, 512, 2048)
TARGETS = {
    "plan_s": (30.0, "global validation + election on the coordinator, seconds"),
    "plan_peak_mib": (4096.0, "peak memory of that, MiB"),
    "load_plan_s_max": (1.0, "load planning on one rank of another layout, seconds"),
    "metadata_mib": (32.0, "metadata (metadata.json and its parts), MiB"),
    "load_decode_plan_s_max": (0.2, "metadata decoding (parts included) + load planning on one rank, seconds"),
    "load_received_mib": (4.0, "metadata a rank receives from the coordinator at load, MiB"),
    "save_sent_kib": (1024.0, "bytes a rank other than the coordinator sends in a save, KiB"),
}
BUCKET_ELEMENTS = 40_000_000
"""Megatron's gradient bucket size (elements): each rank holds a ZeRO range of every bucket."""

T = TypeVar("T")


def layouts(ranks: int) -> tuple[Parallelism, Parallelism]:
    """The saving layout (TP 8) and the loading layout (TP 4, twice the pipeline stages) of ``ranks``."""
    if ranks % 8 or ranks & (ranks - 1):
        raise ValueError(f"--ranks takes powers of two from 8, not {ranks}")
    n = ranks // 8
    pp = {1: 1, 2: 1, 4: 2, 8: 2, 16: 4, 32: 4, 64: 4, 128: 8, 256: 8, 512: 8}.get(n, 16)
    dp = n // pp
    save = Parallelism(tp=8, pp=pp, dp=dp, ep=min(64, 8 * dp), bucket_elements=BUCKET_ELEMENTS)
    load_pp = 2 * pp
    load_dp = ranks // (4 * load_pp)
    load = Parallelism(tp=4, pp=load_pp, dp=load_dp, ep=min(64, 4 * load_dp), bucket_elements=BUCKET_ELEMENTS)
    return save, load


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def peak_mib(fn: Callable[[], object]) -> float:
    """Peak Python heap (tracemalloc) of ``fn``, in MiB, above what was allocated before."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return (tracemalloc.get_traced_memory()[1] - base) / MiB
    finally:
        tracemalloc.stop()


def measure(
    ranks: int, model: MoETransformer, *, memory: bool, load_samples: int, v1_size: bool, log: Callable[[str], None]
) -> dict[str, Any]:
    started = time.perf_counter()
    save_par, load_par = layouts(ranks)
    layout = MegatronLayout(model, save_par)
    log(f"{ranks} ranks: save {save_par}, load {load_par}")
    out: dict[str, Any] = {"ranks": ranks, "save_layout": str(save_par), "load_layout": str(load_par)}

    # Every rank describes its pieces; the time of one rank is what counts (they run in parallel).
    payloads = []
    encode_seconds = []
    for rank in range(ranks):
        description = layout.rank_description(rank)
        payload, seconds = timed(lambda d=description: encode_description(d, "/checkpoints/step_1000"))
        payloads.append(payload)
        encode_seconds.append(seconds)
    out["describe_ms_max"] = max(encode_seconds) * 1e3
    out["describe_bytes_max"] = max(map(len, payloads))

    def plan() -> tuple[DescriptionTable, list[WriteAssignment], list[bytes]]:
        table, _ = DescriptionTable.from_wire(payloads)
        assignments = plan_save_table(table)
        return table, assignments, [a.to_bytes() for a in assignments]

    (table, assignments, replies), out["plan_s"] = timed(plan)
    out["pieces"] = len(table)
    if memory:
        out["plan_peak_mib"] = peak_mib(plan)
    log(f"  plan {out['plan_s']:.2f} s over {len(table)} pieces")

    reports = [write_report(table, r, a, SAVE_ID, CHUNK_BYTES) for r, a in enumerate(assignments)]
    # Each gathered payload travels behind its step's tag: the phase's name (2-byte length) and a status byte.
    report_lengths = [2 + len("save") + 1 + len(json.dumps(r.to_json(), allow_nan=False).encode()) for r in reports]

    def commit() -> tuple[Metadata, MetadataDocuments]:
        metadata = assemble_metadata(
            table, reports, save_id=SAVE_ID, world_size=ranks, chunk_bytes=CHUNK_BYTES, common={"iteration": 1000}
        )
        return metadata, metadata_documents(metadata)

    (metadata, documents), out["commit_s"] = timed(commit)
    raw = documents.document
    if memory:
        out["commit_peak_mib"] = peak_mib(commit)
    out["boxes"] = sum(len(t.boxes) for t in metadata.tensors.values())
    out["tensors"] = len(metadata.tensors)
    out["checkpoint_tib"] = metadata.total_bytes / (1 << 40)
    out["metadata_document_mib"] = len(raw) / MiB
    out["metadata_parts"] = len(documents.parts)
    out["metadata_mib"] = (len(raw) + sum(len(b) for _, b in documents.parts)) / MiB
    entries = [json.loads(raw)["tensors"]] + [json.loads(b)["tensors"] for _, b in documents.parts]
    out["metadata_checksum_mib"] = (
        sum(len(t["packed"]["crc32c"]) for e in entries for t in e.values() if "packed" in t) / MiB
    )
    if v1_size:
        out["metadata_v1_mib"] = len(metadata.to_json_bytes(packed=False)) / MiB
    log(
        f"  commit {out['commit_s']:.2f} s, metadata {out['metadata_mib']:.1f} MiB ({out['metadata_document_mib']:.2f}"
        f" MiB metadata.json, {out['metadata_parts']} parts), {out['boxes']} boxes"
    )

    # The bytes a rank other than the coordinator puts into / gets out of the collectives of a save: the
    # all-reduce of the longest payload (8 bytes) and its padded description, then its write report; back
    # come the planning header, its assignment and the commit summary.
    header = len(json.dumps({"result": SAVE_ID}).encode())
    summary = len(json.dumps({"result": {"files": 0, "file_bytes": 2**50, "total_bytes": 2**50}}).encode())
    planning_tag = 2 + len("save planning") + 1
    out["save_sent_kib"] = (
        8 + padded_size([planning_tag + len(p) for p in payloads]) + 8 + padded_size(report_lengths)
    ) / 1024
    out["save_received_kib"] = (8 + (8 + header) + 8 + padded_size(list(map(len, replies))) + 8 + (8 + summary)) / 1024
    out["load_received_mib"] = (8 + len(raw)) / MiB

    # Loading into the other layout: every rank decodes metadata.json (lazily), reads the parts its keys need
    # (from files, verified) and plans its reads.
    _, out["parse_eager_s"] = timed(lambda: Metadata.from_json_bytes(raw))
    with tempfile.TemporaryDirectory(prefix="reshard-scale-") as directory:
        storage = LocalStorage(directory)
        storage.prepare_root()
        for name, part in documents.parts:
            (Path(directory) / name).write_bytes(part)
        out.update(load_ranks(raw, storage, MegatronLayout(model, load_par), load_par.world, load_samples))
    log(
        f"  load: decode {out['parse_lazy_s_max'] * 1e3:.0f} ms ({out['load_parts_max']} parts, "
        f"{out['load_part_mib_max']:.1f} MiB), plan {out['load_plan_s_max'] * 1e3:.0f} ms, decode + plan "
        f"{out['load_decode_plan_s_max'] * 1e3:.0f} ms (max of {load_samples} ranks)"
    )
    gc.collect()
    out["wall_s"] = time.perf_counter() - started
    log(f"  {ranks} ranks measured in {out['wall_s']:.0f} s")
    return out


def load_ranks(raw: bytes, storage: LocalStorage, target: MegatronLayout, world: int, samples: int) -> dict[str, Any]:
    """The load figures of ``samples`` ranks spread over the loading layout: per rank, decoding ``metadata.json``
    and reading the parts its keys need (``parse_lazy_s``), then planning its reads (``load_plan_s``)."""
    ranks = sorted({round(i * (world - 1) / max(1, samples - 1)) for i in range(samples)})
    # A rank of a real load holds none of the objects this process made to simulate the save (descriptions, plans,
    # reports of thousands of ranks): they are kept out of the collector's passes, which would otherwise charge the
    # rank's decoding for traversing them.
    gc.collect()
    gc.freeze()
    try:
        return _load_ranks(raw, storage, target, ranks)
    finally:
        gc.unfreeze()


def _load_ranks(raw: bytes, storage: LocalStorage, target: MegatronLayout, ranks: list[int]) -> dict[str, Any]:
    parse_times, plan_times, reads, parts, part_bytes = [], [], [], [], []
    for rank in ranks:
        targets = target.rank_targets(rank)
        keys = {t.key for t in targets}

        def decode(k: set[str] = keys) -> Metadata:
            return read_parts(storage, Metadata.from_json_bytes(raw, lazy=True), k)

        parsed, seconds = timed(decode)
        parse_times.append(seconds)
        index = Metadata.from_json_bytes(raw, lazy=True)
        numbers = {n for k in keys if k in index.tensors and (n := part_of(index, k)) is not None}
        parts.append(len(numbers))
        part_bytes.append(sum(index.parts[n].size for n in numbers))
        load_plan, seconds = timed(lambda p=parsed, t=targets: plan_load(p, t))
        plan_times.append(seconds)
        reads.append(len(load_plan.items))
    total = [a + b for a, b in zip(parse_times, plan_times, strict=True)]
    return {
        "parse_lazy_s_max": max(parse_times),
        "load_plan_s_median": statistics.median(plan_times),
        "load_plan_s_max": max(plan_times),
        "load_decode_plan_s_max": max(total),
        "load_decode_plan_s_median": statistics.median(total),
        "load_reads_median": statistics.median(reads),
        "load_parts_max": max(parts),
        "load_part_mib_max": max(part_bytes) / MiB,
    }


def exponents(rows: list[dict[str, Any]], names: list[str], since: int = 64) -> dict[str, float]:
    """Slope of log(figure) against log(ranks), least squares over the rank counts from ``since``."""
    out = {}
    for name in names:
        points = [(math.log(r["ranks"]), math.log(r[name])) for r in rows if r["ranks"] >= since and r.get(name)]
        if len(points) < 2:
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        out[name] = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["ranks"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, label in (
        ("plan_s", "save planning on the coordinator (s)"),
        ("commit_s", "metadata assembly on the coordinator (s)"),
        ("load_plan_s_max", "load planning per rank (s)"),
        ("parse_lazy_s_max", "metadata decoding per rank (s)"),
    ):
        left.plot(ranks, [r[name] for r in rows], marker="o", label=label)
    for name in ("plan_s", "load_plan_s_max"):
        left.axhline(TARGETS[name][0], color="grey", linestyle=":", linewidth=1)
    left.set_title("time (dotted: targets at 8192 ranks, 30 s and 1 s)")
    for name, label in (
        ("metadata_mib", "metadata.json (MiB)"),
        ("plan_peak_mib", "peak memory of save planning (MiB)"),
        ("save_sent_kib", "sent per non-coordinator rank in a save (KiB)"),
        ("describe_bytes_max", "largest rank description (bytes / 1024)"),
    ):
        if all(name in r for r in rows):
            scale = 1024 if name == "describe_bytes_max" else 1
            right.plot(ranks, [r[name] / scale for r in rows], marker="o", label=label)
    if all("metadata_v1_mib" in r for r in rows):
        right.plot(
            ranks,
            [r["metadata_v1_mib"] for r in rows],
            marker="x",
            linestyle="--",
            label="metadata.json as version 1 (MiB)",
        )
    for name in ("metadata_mib", "plan_peak_mib", "save_sent_kib"):
        right.axhline(TARGETS[name][0], color="grey", linestyle=":", linewidth=1)
    right.set_title("size (dotted: targets, 64 MiB, 1 MiB sent, 4 GiB)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.grid(True, which="both", linewidth=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("reshard planning at scale (simulated, one process): 1.25T-parameter MoE, TP8 save, TP4 load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=list(DEFAULT_RANKS),
        help="rank counts, powers of two from 8 (default 8 32 128 512 2048; docs/scale.md goes on to 8192, "
        "which takes about three times as long)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    p.add_argument("--plot", type=Path, default=None, help="draw the curves into this PNG (matplotlib)")
    p.add_argument("--load-samples", type=int, default=8, help="ranks of the load layout that plan (default 8)")
    p.add_argument("--layers", type=int, default=128, help="transformer layers of the model (default 128)")
    p.add_argument("--experts", type=int, default=256, help="experts per layer (default 256)")
    p.add_argument("--no-memory", action="store_true", help="skip the tracemalloc runs (peak memory)")
    p.add_argument("--no-v1", action="store_true", help="skip encoding the metadata as format version 1 too")
    p.add_argument(
        "--from-json", type=Path, default=None, help="measure nothing: report (and plot) the rows of an earlier --json"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    model = MoETransformer(layers=args.layers, experts=args.experts)
    if args.from_json is not None:
        earlier = json.loads(args.from_json.read_text())
        model = MoETransformer(layers=earlier["model"]["layers"], experts=earlier["model"]["experts"])
        rows = earlier["rows"]
    else:
        log(f"model: {model.parameters / 1e12:.2f} T parameters, {model.layers} layers, {model.experts} experts")
        rows = [
            measure(
                r, model, memory=not args.no_memory, load_samples=args.load_samples, v1_size=not args.no_v1, log=log
            )
            for r in sorted(args.ranks)
        ]
    names = [
        "plan_s", "plan_peak_mib", "commit_s", "metadata_mib", "load_plan_s_max", "parse_lazy_s_max",
        "save_sent_kib", "save_received_kib", "describe_bytes_max", "pieces", "boxes",
    ]  # fmt: skip
    slopes = exponents(rows, names)
    columns = [
        ("ranks", "ranks", "{:.0f}"), ("pieces", "pieces", "{:.0f}"), ("boxes", "boxes", "{:.0f}"),
        ("plan_s", "plan s", "{:.2f}"), ("plan_peak_mib", "plan MiB", "{:.0f}"), ("commit_s", "commit s", "{:.2f}"),
        ("metadata_mib", "meta MiB", "{:.1f}"), ("parse_lazy_s_max", "decode s", "{:.2f}"),
        ("load_plan_s_max", "load s", "{:.3f}"), ("load_decode_plan_s_max", "dec+plan s", "{:.3f}"),
        ("load_received_mib", "bcast MiB", "{:.2f}"), ("load_part_mib_max", "parts MiB", "{:.1f}"),
        ("save_sent_kib", "sent KiB", "{:.1f}"),
        ("save_received_kib", "recv KiB", "{:.1f}"),
    ]  # fmt: skip
    print(" ".join(f"{title:>9}" for _, title, _ in columns))
    for row in rows:
        print(" ".join(f"{fmt.format(row[name]) if name in row else '-':>9}" for name, _, fmt in columns))
    print("growth exponents (log-log slope from 64 ranks): " + ", ".join(f"{k} {v:.2f}" for k, v in slopes.items()))
    largest = rows[-1]
    verdicts = {}
    for name, (limit, what) in TARGETS.items():
        if name in largest:
            verdicts[name] = largest[name] <= limit
            print(f"target at {largest['ranks']} ranks: {what} <= {limit:g}: {largest[name]:.3g} "
                  f"({'met' if verdicts[name] else 'MISSED'})")  # fmt: skip
    if args.json is not None:
        report = {
            "model": {"parameters": model.parameters, "layers": model.layers, "experts": model.experts},
            "rows": rows,
            "exponents": slopes,
            "targets": {k: v[0] for k, v in TARGETS.items()},
            "met": verdicts,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot is not None:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
