#!/usr/bin/env python
"""GPU benchmark: reshard and torch.distributed.checkpoint (DCP) with the state in GPU memory, side by side in
one run, warm and cold.

    python benchmarks/gpu.py                                # 2 GiB on the GPU, 1 rank, 3 repetitions
    python benchmarks/gpu.py --ranks 2 --size-gib 2         # 2 ranks (sharing a GPU if there is only one)
    python benchmarks/gpu.py --device cpu --size-gib 0.01   # the same code on the CPU: a dry run

The state is compare.py's GPT-like model (fp32 and bf16 layers), each tensor split over the ranks as tensor
parallelism would (``reshard.ShardedTensor``; a ``DTensor`` with ``Shard`` for DCP), in GPU memory. Each
operation is timed between barriers, the GPU synchronised before the clock stops, as the slowest rank's wall
time:

- ``save``: a synchronous save; training is stalled for all of it (seconds per GiB of state).
- ``async``: an asynchronous save. Its *stall* is how long the call blocks before training may change the
  state again (reshard: ``AsyncCheckpointer.save`` with buffers kept from save to save; DCP: ``async_save``
  as its documentation shows it, and ``dcp_pinned``: with one ``DefaultStager`` using pinned memory and
  non-blocking copies, kept from save to save); next to ``floor``: a device-to-host copy of the state into
  pinned buffers allocated beforehand, which no snapshot can beat. ``async_total``: until the checkpoint is
  durable.
- ``step``: the stall of an asynchronous save whose snapshot overlaps with the training step that follows: a
  save, then ``--compute-ms`` of matrix products on the training stream (a forward and backward pass, which
  read the weights), then what must precede the optimizer step, then an in-place update of the state; the
  figure is that step's time minus the same step's without a save. reshard: ``overlap_snapshot=True`` and
  ``SaveHandle.wait_snapshot()``; ``dcp_pinned``: a ``DefaultStager`` that also stages in the background
  (``use_async_staging``), and its ``staging_completion``.
- ``load_same``, ``load_axis``: loads into GPU tensors of the saving layout, and of the other split axis (a
  resharded load), in GiB/s of state; ``floor`` there is a host-to-device copy from pinned buffers.

Modes, as users meet checkpoints: ``warm`` (one set of processes runs every operation ``--repeat`` times after
one unmeasured round; medians), ``cold`` (a fresh set of processes for each single operation, ``--cold-repeat``
times, as after a restart: the first pinned allocations and the libraries' first calls fall in the operation;
the process start, imports and CUDA context are reported apart). The checkpoints loaded are written once, before
the loads, and read from the page cache (both systems alike). Every load is checked value by value once.

Where CUDA is absent (``--device cpu``), everything runs on host memory, without ``dcp_pinned`` and without
pinned buffers: a dry run of the script, not a measurement of the GPU path. benchmarks/README.md has the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import queue
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from compare import Layout, Spec, check_values, fill_values, gpt_specs
from scratch import free_port, scratch_dir

GiB = 1 << 30
SYSTEMS = ("reshard", "dcp", "dcp_pinned")
OPERATIONS = ("save", "async", "step", "load_same", "load_axis")
FLOORS = {"async": "d2h", "load_same": "h2d", "load_axis": "h2d"}
"""The copy that bounds each operation from below (measured as the system ``floor``)."""


def _supports(system: str, operation: str, device: str) -> bool:
    if system == "dcp_pinned":  # DCP's pinned stager needs CUDA; it only changes asynchronous saves
        return operation in ("async", "step") and device == "cuda"
    if operation == "step":  # DCP's default async_save blocks for its whole staging: that is "async"
        return system == "reshard"
    return True


# ------------------------------------------------------------------------------------------------------------------
# One rank
# ------------------------------------------------------------------------------------------------------------------


class Rank:
    """One process of the benchmark: the state, the load templates and each system's objects."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any], jobs: list[list[Any]]) -> None:
        """Everything the ``jobs`` use is built before any is timed (a cold process builds only that)."""
        started = time.perf_counter()
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh

        import reshard

        self.dcp = dcp
        self.reshard = reshard
        self.rank, self.world, self.cfg = rank, world, cfg
        self.device = torch.device(cfg["device"], rank % torch.cuda.device_count()) if cfg["device"] == "cuda" else None
        if self.device is not None:
            torch.cuda.set_device(self.device)
            torch.zeros(1, device=self.device)  # the CUDA context
        self.mesh = init_device_mesh(cfg["device"], (world,))
        self.imports_seconds = time.perf_counter() - started
        self.root = Path(cfg["dir"])
        self.specs = [Spec(s["key"], tuple(s["shape"]), s["dtype"], s["axis"]) for s in cfg["specs"]]
        self.layouts = {
            "state": Layout(world, rank),
            "load_same": Layout(world, rank),
            "load_axis": Layout(world, rank, True),
        }
        operations = {op for _, _, op, _ in jobs}
        systems = {system for _, system, _, _ in jobs}
        wanted = {"load_same", "load_axis"} & operations
        if "floor" in systems and operations & {"load_same", "load_axis"}:
            wanted.add("load_same")  # the floor's host-to-device copy lands there
        if {"save", "async", "step", None} & operations or "floor" in systems:
            wanted.add("state")
        self.tensors = {name: self._tensors(self.layouts[name], fill=name == "state") for name in wanted}
        # No AsyncCheckpointer.warmup(): a cold asynchronous save allocates its pinned buffers in the call, as
        # DCP's stager does in its first one (warm mode drops the first round).
        self.checkpointer = reshard.AsyncCheckpointer()
        self.stager = self.overlapping = None
        if "dcp_pinned" in systems:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(True, False, False, True))
            self.overlapping = DefaultStager(StagingOptions(True, False, True, True))
        if "step" in operations:
            self._calibrate(cfg["compute_ms"])
        self.floor_host = {}
        if "floor" in systems:
            pinned = cfg["device"] == "cuda"
            for key, t in self.tensors["state"].items():
                self.floor_host[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
                self.floor_host[key].zero_()
        self.checked: set[str] = set()

    def _tensors(self, layout: Layout, *, fill: bool) -> dict[str, torch.Tensor]:
        out = {}
        for spec in self.specs:
            _, offset, shape = layout.box(spec)
            t = torch.zeros(shape, dtype=spec.torch_dtype)
            if fill:
                fill_values(t, spec, offset)
            out[spec.key] = t.to(self.device) if self.device is not None else t
        return out

    def _reshard(self, name: str) -> dict[str, Any]:
        layout, out = self.layouts[name], {}
        for spec in self.specs:
            t, axis = self.tensors[name][spec.key], self.layouts[name].axis(spec)
            out[spec.key] = (
                t
                if axis is None
                else self.reshard.ShardedTensor.from_rank_offsets(spec.key, t, (axis, layout.index, layout.parts))
            )
        return out

    def _dcp(self, name: str) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        out = {}
        for spec in self.specs:
            axis = self.layouts[name].axis(spec)
            stride = tuple(math.prod(spec.shape[i + 1 :]) for i in range(len(spec.shape)))
            out[spec.key] = DTensor.from_local(
                self.tensors[name][spec.key],
                self.mesh,
                [Replicate() if axis is None else Shard(axis)],
                run_check=False,
                shape=torch.Size(spec.shape),
                stride=stride,
            )
        return out

    def _sync(self) -> None:
        if self.device is not None:
            torch.cuda.synchronize(self.device)

    def _slowest(self, seconds: float) -> float:
        value = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return float(value.item())

    def _timed(self, fn: Any) -> tuple[float, Any]:
        self._sync()
        dist.barrier()
        started = time.perf_counter()
        returned = fn()
        self._sync()
        seconds = time.perf_counter() - started
        dist.barrier()
        return self._slowest(seconds), returned

    def _path(self, system: str, what: str) -> str:
        return str(self.root / system / what)

    def prepare(self, system: str) -> None:
        """The checkpoint the loads of ``system`` read (not timed)."""
        target = self._path(system, "ref")
        if system == "reshard":
            self.reshard.save(self._reshard("state"), target, overwrite=True)
        elif system == "dcp":
            self.dcp.save(self._dcp("state"), checkpoint_id=target)
        dist.barrier()

    def run(self, system: str, operation: str, rep: int) -> dict[str, float]:
        """One operation; its seconds (and, for an asynchronous save, the stall and the total)."""
        if system == "floor":
            return self._floor(operation)
        target = self._path(system, f"{operation}-{rep}")
        if operation == "save":
            if system == "reshard":
                seconds, _ = self._timed(lambda: self.reshard.save(self._reshard("state"), target))
            else:
                seconds, _ = self._timed(lambda: self.dcp.save(self._dcp("state"), checkpoint_id=target))
            return {"seconds": seconds}
        if operation == "async":
            return self._async(system, target)
        if operation == "step":
            return self._step(system, target)
        name = operation
        for t in self.tensors[name].values():
            t.zero_()
        source = self._path(system, "ref")
        if system == "reshard":
            seconds, _ = self._timed(lambda: self.reshard.load(self._reshard(name), source))
        else:
            seconds, _ = self._timed(lambda: self.dcp.load(self._dcp(name), checkpoint_id=source))
        if f"{system}.{name}" not in self.checked and rep == 0:
            for spec in self.specs:
                _, offset, _ = self.layouts[name].box(spec)
                check_values(self.tensors[name][spec.key].cpu(), spec, offset, f"{system} {name} (rank {self.rank})")
            self.checked.add(f"{system}.{name}")
        return {"seconds": seconds}

    def _async(self, system: str, target: str) -> dict[str, float]:
        self._sync()
        dist.barrier()
        started = time.perf_counter()
        if system == "reshard":
            handle = self.checkpointer.save(self._reshard("state"), target)
            stall = time.perf_counter() - started
            handle.wait()
        else:
            stager = {"async_stager": self.stager} if system == "dcp_pinned" else {}
            future = self.dcp.async_save(self._dcp("state"), checkpoint_id=target, **stager)
            stall = time.perf_counter() - started
            future.result()
        total = time.perf_counter() - started
        dist.barrier()
        return {"seconds": self._slowest(stall), "total_seconds": self._slowest(total)}

    def _compute(self) -> None:
        """A stand-in for a forward and backward pass: matrix products on the current stream."""
        for _ in range(self.products):
            torch.mm(self.a, self.b, out=self.c)

    def _calibrate(self, milliseconds: float) -> None:
        """Matrices and a count of products that take about ``milliseconds`` here."""
        n = 4096 if self.device is not None else 256
        self.a, self.b = (torch.randn(n, n, device=self.device) for _ in range(2))
        self.c = torch.empty(n, n, device=self.device)
        self.products = 3
        self._compute()  # the first products pay the libraries' start
        self._sync()
        started = time.perf_counter()
        self._compute()
        self._sync()
        per = (time.perf_counter() - started) / self.products
        self.products = max(1, round(milliseconds / 1e3 / per))

    def _step(self, system: str, target: str) -> dict[str, float]:
        """A training step with an overlapped asynchronous save in it, and the same step without."""
        first = next(iter(self.tensors["state"].values()))

        def step(save: bool) -> Any:
            pending = None
            if save and system == "reshard":
                pending = self.checkpointer.save(self._reshard("state"), target, overlap_snapshot=True)
            elif save:
                pending = self.dcp.async_save(self._dcp("state"), checkpoint_id=target, async_stager=self.overlapping)
            self._compute()
            if pending is not None and system == "reshard":
                pending.wait_snapshot()
            elif pending is not None:
                pending.staging_completion.result()
            first.add_(0.0)  # the optimizer's in-place update
            return pending

        plain, _ = self._timed(lambda: step(False))
        with_save, pending = self._timed(lambda: step(True))
        started = time.perf_counter()
        if system == "reshard":
            pending.wait()
        else:
            pending.upload_completion.result()
        durable = with_save + self._slowest(time.perf_counter() - started)
        dist.barrier()
        return {"seconds": max(0.0, with_save - plain), "step_seconds": plain, "total_seconds": durable}

    def _floor(self, operation: str) -> dict[str, float]:
        state = self.tensors["state"]
        if FLOORS[operation] == "d2h":

            def copy() -> None:
                for key, value in state.items():
                    self.floor_host[key].copy_(value, non_blocking=True)
        else:
            device = self.tensors["load_same"]  # the saving layout's shapes, as the pinned buffers

            def copy() -> None:
                for key, value in self.floor_host.items():
                    device[key].copy_(value, non_blocking=True)

        seconds, _ = self._timed(copy)
        return {"seconds": seconds}

    def close(self) -> None:
        self.checkpointer.wait()
        for stager in (self.stager, self.overlapping):
            if stager is not None:
                stager.close()


def _rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], jobs: list[list[Any]], results: Any) -> None:
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        backend = cfg["backend"]
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
        me = Rank(rank, world, cfg, jobs)
        out = []
        for kind, system, operation, rep in jobs:
            if kind == "prepare":
                me.prepare(system)
                continue
            job = {"system": system, "operation": operation, "rep": rep}
            try:
                out.append({**job, **me.run(system, operation, rep)})
            except Exception as exc:  # one system's failure is reported in its cell; the others go on
                out.append({**job, "error": f"{type(exc).__name__}: {exc}"})
                traceback.print_exc()
        me.close()
        if rank == 0:
            results.put(("ok", {"jobs": out, "imports_seconds": me.imports_seconds}))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails
        results.put(("error", f"rank {rank}: {''.join(traceback.format_exception(exc))}"))


def _run(
    world: int, cfg: dict[str, Any], jobs: list[list[Any]], *, fresh: bool, timeout_s: float = 3600
) -> dict[str, Any]:
    """``jobs`` on ``world`` ranks: a fresh set of processes (``fresh``, or several ranks), or this process
    (one warm rank: it already paid its imports); rank 0's report."""
    if world == 1 and not fresh:
        local: queue.Queue[Any] = queue.Queue()
        _rank_main(0, 1, free_port(), cfg, jobs, local)
        status, value = local.get()
        if status != "ok":
            raise RuntimeError(value)
        return value
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(r, world, port, cfg, jobs, results), daemon=True) for r in range(world)
    ]
    for p in processes:
        p.start()
    try:
        status, value = results.get(timeout=timeout_s)
    except queue.Empty:
        raise RuntimeError(f"the benchmark ranks did not report within {timeout_s:.0f} s") from None
    finally:
        for p in processes:
            p.join(timeout=120)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value


# ------------------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------------------


def _jobs(systems: list[str], device: str, rounds: int, *, floors: bool) -> list[list[Any]]:
    """Every measured operation of every system for ``rounds`` rounds, the systems' order rotated each round."""
    jobs = []
    for rep in range(rounds):
        for operation in OPERATIONS:
            order = [s for s in systems if _supports(s, operation, device)]
            if floors and operation in FLOORS:
                order.append("floor")
            order = order[rep % len(order) :] + order[: rep % len(order)]
            jobs += [["run", system, operation, rep] for system in order]
    return jobs


def measure(mode: str, args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    prepare = [["prepare", system, None, None] for system in args.systems if system != "dcp_pinned"]
    runs: list[dict[str, Any]] = []
    imports: list[float] = []
    if mode == "warm":
        jobs = prepare + _jobs(args.systems, args.device, args.repeat + 1, floors=True)
        report = _run(args.ranks, cfg, jobs, fresh=False)
        runs = [r for r in report["jobs"] if r["rep"] > 0 or args.repeat == 0]
        imports.append(report["imports_seconds"])
    else:
        _run(args.ranks, cfg, prepare, fresh=True)
        # The floors are copies between buffers allocated beforehand: a property of the machine, measured warm.
        for job in _jobs(args.systems, args.device, args.cold_repeat, floors=False):
            report = _run(args.ranks, cfg, [job], fresh=True)
            runs += report["jobs"]
            imports.append(report["imports_seconds"])
    figures: dict[str, dict[str, Any]] = {}
    for r in runs:
        entry = figures.setdefault(r["operation"], {}).setdefault(r["system"], {"errors": []})
        if "error" in r:
            entry["errors"].append(r["error"])
            continue
        for field in ("seconds", "total_seconds", "step_seconds"):
            if field in r:
                entry.setdefault(field, []).append(r[field])
    gib = cfg["bytes"] / GiB
    out: dict[str, Any] = {"start_seconds_median": statistics.median(imports), "operations": {}}
    for operation, by_system in figures.items():
        row: dict[str, Any] = {}
        for system, entry in by_system.items():
            if "seconds" not in entry:
                row[system] = {"errors": entry["errors"]}
                continue
            seconds = statistics.median(entry["seconds"])
            cell = {
                "seconds": seconds,
                "seconds_per_gib": seconds / gib,
                "gib_per_s": gib / seconds if seconds else None,
            }
            for field in ("total_seconds", "step_seconds"):
                if field in entry:
                    cell[field] = statistics.median(entry[field])
            if entry["errors"]:
                cell["errors"] = entry["errors"]
            row[system] = cell
        ratios = {}
        for other in ("dcp", "dcp_pinned", "floor"):
            if row.get("reshard", {}).get("seconds") is not None and row.get(other, {}).get("seconds"):
                ratios[f"reshard/{other}"] = row["reshard"]["seconds"] / row[other]["seconds"]
        out["operations"][operation] = {"systems": row, "ratios": ratios}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="size of the whole state (default 2 GiB)")
    p.add_argument("--ranks", type=int, default=1, help="processes (default 1); they share the GPUs round-robin")
    p.add_argument("--repeat", type=int, default=3, help="warm: measured repetitions per operation (default 3)")
    p.add_argument(
        "--cold-repeat",
        type=int,
        default=1,
        help="cold: repetitions per operation, each in fresh processes (default 1)",
    )
    p.add_argument("--mode", choices=("warm", "cold", "both"), default="both", help="default both")
    p.add_argument(
        "--compute-ms", type=float, default=200.0, help="the step operation's stand-in for a forward and backward pass"
    )
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a dry run on host memory")
    p.add_argument(
        "--backend",
        default=None,
        help="the process group's backend (default: cpu:gloo,cuda:nccl with one GPU per rank, else gloo)",
    )
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure as JSON")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: this torch {torch.__version__} sees no GPU (use --device cpu for a dry run)")
    if args.backend is None:
        one_each = args.device == "cuda" and torch.cuda.device_count() >= args.ranks
        args.backend = "cpu:gloo,cuda:nccl" if one_each else "gloo"
    return args


def _print(mode: str, result: dict[str, Any], cfg: dict[str, Any], out: Any = sys.stdout) -> None:
    gib = cfg["bytes"] / GiB
    print(f"\n{mode}: {gib:.2f} GiB on {cfg['device']}, {cfg['ranks']} rank(s), backend {cfg['backend']}", file=out)
    print(f"  process start and imports (median): {result['start_seconds_median']:.2f} s", file=out)
    header = f"  {'operation':<11}{'figure':<18}" + "".join(f"{s:>12}" for s in (*SYSTEMS, "floor"))
    print(header, file=out)
    for operation in OPERATIONS:
        row = result["operations"].get(operation)
        if row is None:
            continue
        load = operation.startswith("load")
        figure = {"async": "stall s/GiB", "step": "stall s/GiB"}.get(operation, "GiB/s" if load else "s/GiB")

        def cells_of(row: dict[str, Any], value_of: Any) -> str:
            cells = []
            for system in (*SYSTEMS, "floor"):
                cell = row["systems"].get(system)
                value = None if cell is None or "seconds" not in cell else value_of(cell)
                text = "error" if cell is not None and "errors" in cell and value is None else "-"
                cells.append(text if value is None else f"{value:.3f}")
            return "".join(f"{c:>12}" for c in cells)

        main = "gib_per_s" if load else "seconds_per_gib"
        print(f"  {operation:<11}{figure:<18}" + cells_of(row, lambda c, main=main: c[main]), file=out)
        if operation in ("async", "step"):
            durable = cells_of(row, lambda c: c["total_seconds"] / gib if "total_seconds" in c else None)
            print(f"  {'':<11}{'durable s/GiB':<18}" + durable, file=out)
        if operation == "step":
            print(f"  {'':<11}{'step without, s':<18}" + cells_of(row, lambda c: c.get("step_seconds")), file=out)
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items())
        print(f"  {'':<11}ratio (time) {ratios}", file=out)
        for system, cell in row["systems"].items():
            for error in cell.get("errors", [])[:1]:
                print(f"  {'':<11}{system} failed: {error}", file=out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs, hidden = gpt_specs(int(args.size_gib * GiB), layers=4, unit=8 * args.ranks)
    cfg: dict[str, Any] = {
        "device": args.device,
        "backend": args.backend,
        "ranks": args.ranks,
        "specs": [{"key": s.key, "shape": list(s.shape), "dtype": s.dtype, "axis": s.axis} for s in specs],
        "hidden": hidden,
        "bytes": sum(s.nbytes for s in specs),
        "compute_ms": args.compute_ms,
    }
    modes = ["warm", "cold"] if args.mode == "both" else [args.mode]
    report: dict[str, Any] = {
        "config": {**vars(args), "hidden": hidden, "bytes": cfg["bytes"]},
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
        },
        "results": {},
    }
    with scratch_dir("reshard-gpu-bench-", args.dir) as work:  # removed on SIGTERM/SIGHUP too
        for mode in modes:
            shutil.rmtree(work / mode, ignore_errors=True)
            cfg["dir"] = str(work / mode)
            result = measure(mode, args, cfg)
            report["results"][mode] = result
            _print(mode, result, cfg)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
