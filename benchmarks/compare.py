#!/usr/bin/env python
"""Side-by-side checkpoint benchmark: reshard vs torch.distributed.checkpoint vs Megatron-Core vs torch.save,
next to the machine's own limits, on one generated GPT-like state, in one run.

    python benchmarks/compare.py                      # about 1 GiB, 2 ranks, 5 repetitions
    python benchmarks/compare.py --size-gib 0.5 --repeat 3 --json results.json
    python benchmarks/compare.py --dp-replicas        # also: 4 ranks (TP=2 x DP=2), balanced writers

Ranks are spawned processes joined in a gloo group on 127.0.0.1 (CPU only). Every repetition runs every
system once, in a rotated order (the systems alternate, so a noisy minute hurts all of them alike); the
figures are medians over the repetitions. See benchmarks/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import importlib
import json
import math
import os
import platform
import queue
import shutil
import statistics
import sys
import threading
import time
import traceback
import warnings
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    from benchmarks.scratch import free_port, scratch_dir

    from benchmarks import tc_system
except ImportError:  # run as a script: benchmarks/ is the first entry of sys.path
    import tc_system  # type: ignore[no-redef]
    from scratch import free_port, scratch_dir  # type: ignore[no-redef]

MiB = 1 << 20
GiB = 1 << 30
ALL_SYSTEMS = ("limits", "reshard", "dcp", "megatron", "torch", "tc")
LIMIT_CHUNK = 16 * MiB
# The machine's limits op_limits measures (Worker.op_limits).
LIMIT_KINDS = ("write", "read", "read_fresh", "memcpy", "crc32c")
DEFAULT_BUILD = {"main": ("state", "same", "axis", "limits"), "dp": ("state", "limits"), "world": ("world",)}
"""What a warm pool of each scenario builds before anything is measured."""

# --------------------------------------------------------------------------------------------------------------
# The state: a GPT-like model, described once, generated identically (as a function of the global index) on
# every rank and every layout, so that every load can be checked element by element.
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One global tensor: its key, global shape, dtype and split axis on the saving (TP) layout.

    ``axis`` None: a small tensor that every rank holds whole (layer norms), saved once."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    axis: int | None

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


def gpt_specs(size_bytes: int, layers: int, unit: int) -> tuple[list[Spec], int]:
    """Tensors of a GPT with ``layers`` layers whose total is about ``size_bytes``; returns (specs, hidden).

    Vocabulary-parallel embedding [8h, h] (fp32, split on axis 0), and per layer: column-parallel fused QKV
    [3h, h] and fc1 [4h, h] (axis 0), row-parallel proj [h, h] and fc2 [h, 4h] (axis 1), two layer norms
    [h] (replicated). Even layers are fp32, odd layers bf16. The hidden size is a multiple of ``unit`` so
    that every layout of the run splits every axis evenly."""
    layer_bytes = [12 * (4 if i % 2 == 0 else 2) for i in range(layers)]  # per h^2
    per_h2 = 32 + sum(layer_bytes)
    hidden = max(unit, round(math.sqrt(size_bytes / per_h2) / unit) * unit)
    h = hidden
    specs = [Spec("embedding.word_embeddings.weight", (8 * h, h), "float32", 0)]
    for i in range(layers):
        dtype = "float32" if i % 2 == 0 else "bfloat16"
        p = f"decoder.layers.{i}"
        specs += [
            Spec(f"{p}.input_layernorm.weight", (h,), dtype, None),
            Spec(f"{p}.self_attention.linear_qkv.weight", (3 * h, h), dtype, 0),
            Spec(f"{p}.self_attention.linear_proj.weight", (h, h), dtype, 1),
            Spec(f"{p}.pre_mlp_layernorm.weight", (h,), dtype, None),
            Spec(f"{p}.mlp.linear_fc1.weight", (4 * h, h), dtype, 0),
            Spec(f"{p}.mlp.linear_fc2.weight", (h, 4 * h), dtype, 1),
        ]
    specs.append(Spec("decoder.final_layernorm.weight", (h,), "float32", None))
    return specs, hidden


@dataclass(frozen=True)
class Layout:
    """Where a rank's pieces sit: TP index ``index`` of ``parts``; ``flip`` swaps the split axis (0 <-> 1) of
    every split 2-D tensor; ``replica`` is the DP index (0: primary copy)."""

    parts: int
    index: int
    flip: bool = False
    replica: int = 0

    def axis(self, spec: Spec) -> int | None:
        if spec.axis is None:
            return None
        return 1 - spec.axis if self.flip and len(spec.shape) == 2 else spec.axis

    def box(self, spec: Spec) -> tuple[int | None, tuple[int, ...], tuple[int, ...]]:
        """(split axis or None, global offset, local shape) of this rank's piece of ``spec``."""
        axis = self.axis(spec)
        offset = [0] * len(spec.shape)
        shape = list(spec.shape)
        if axis is not None:
            if spec.shape[axis] % self.parts:
                raise ValueError(f"{spec.key}: axis {axis} of {spec.shape} does not split into {self.parts}")
            shape[axis] = spec.shape[axis] // self.parts
            offset[axis] = shape[axis] * self.index
        return axis, tuple(offset), tuple(shape)


def _value_chunks(spec: Spec, offset: tuple[int, ...], shape: tuple[int, ...]):
    """Yield (row slice, float32 values) covering the box: a hash of the global linear index, exact in fp32."""
    seed = zlib.crc32(spec.key.encode()) % 4093
    ncols = spec.shape[-1] if len(spec.shape) == 2 else 1
    rows = shape[0]
    width = shape[1] if len(shape) == 2 else 1
    step = max(1, (1 << 21) // max(1, width))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        if len(shape) == 2:
            row_idx = torch.arange(offset[0] + r0, offset[0] + r1, dtype=torch.int64).unsqueeze(1) * ncols
            lin = row_idx + torch.arange(offset[1], offset[1] + width, dtype=torch.int64).unsqueeze(0)
        else:
            lin = torch.arange(offset[0] + r0, offset[0] + r1, dtype=torch.int64)
        values = ((lin * 40503 + seed) % 4093).to(torch.float32).sub_(2046.0).div_(64.0)
        yield slice(r0, r1), values


def fill_values(out: torch.Tensor, spec: Spec, offset: tuple[int, ...]) -> None:
    for rows, values in _value_chunks(spec, offset, tuple(out.shape)):
        out[rows].copy_(values)


def check_values(data: torch.Tensor, spec: Spec, offset: tuple[int, ...], what: str) -> None:
    if data.dtype != spec.torch_dtype:
        raise AssertionError(f"{what}: {spec.key} has dtype {data.dtype}, expected {spec.torch_dtype}")
    for rows, values in _value_chunks(spec, offset, tuple(data.shape)):
        if not torch.equal(data[rows], values.to(spec.torch_dtype)):
            raise AssertionError(f"{what}: {spec.key} rows {rows.start}..{rows.stop} at {offset} differ from the saved")


# --------------------------------------------------------------------------------------------------------------
# Per-process measurement: wall time between barriers, peak RSS above the RSS before the phase, bytes read.
# --------------------------------------------------------------------------------------------------------------


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rchar() -> int:
    """Bytes this process received from read()-family calls (files, page cache included; not sockets)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Peak RSS of this process during a phase.

    Linux keeps a high-water mark (VmHWM) that ``echo 5 > /proc/self/clear_refs`` resets to the current RSS,
    so the peak of each phase is exact. Where that reset is refused, a sampler thread polls the RSS every
    millisecond instead (it can miss spikes shorter than that)."""

    def __init__(self) -> None:
        self.method = "VmHWM reset through /proc/self/clear_refs"
        try:
            self._reset_hwm()
        except OSError:
            self.method = "RSS sampled every 1 ms"
        self._stop = threading.Event()
        self._peak = 0
        self._thread: threading.Thread | None = None

    @staticmethod
    def _reset_hwm() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def start(self) -> None:
        if self.method.startswith("VmHWM"):
            self._reset_hwm()
            return
        self._peak = _rss()
        self._stop.clear()

        def sample() -> None:
            while not self._stop.wait(0.001):
                self._peak = max(self._peak, _rss())

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        if self.method.startswith("VmHWM"):
            return _proc_status("VmHWM")
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return max(self._peak, _rss())


class GcTimer:
    """Seconds this process spent in Python's cyclic garbage collector from construction to :meth:`stop`
    (a generation-2 collection after a cold start walks every object the imports created)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self.full = 0  # generation-2 collections: each walks every object of the process
        self.full_seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            spent = time.perf_counter() - self._started
            self.seconds += spent
            self.collections += 1
            if info.get("generation") == 2:
                self.full += 1
                self.full_seconds += spent

    def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS, so that a phase reusing it still shows up as a rise in RSS."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# --------------------------------------------------------------------------------------------------------------
# The rank side: one Worker per spawned process, running the operations the coordinator sends.
# --------------------------------------------------------------------------------------------------------------


def _megatron_cpu_save_strategy():
    """Megatron-Core's ``torch_dist`` save strategy with torch's synchronous DCP save.

    Megatron's own ``TorchDistSaveShardedStrategy.save`` goes through its async writer, whose tensor preloading
    calls ``torch.cuda.synchronize()`` and fails on a CPU-only build. Megatron's CPU test utilities replace it
    by the same conversion (MCore ShardedTensors -> torch ShardedTensors, main replicas only) followed by
    ``torch.distributed.checkpoint.save`` with Megatron's save planner; so does this."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

    class CpuTorchDistSaveStrategy(mcore_torch.TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            grouped, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            planner = mcore_torch.MCoreSavePlanner(
                dedup_replicated_tensors=not self.keep_only_main_replica,
                flatten_state_dict=False,
                flatten_sharded_tensors=False,
            )
            dcp.save(
                mcore_torch.mcore_to_pyt_state_dict(grouped, False),
                storage_writer=dcp.FileSystemWriter(checkpoint_dir, sync_files=True),
                planner=planner,
            )

    return CpuTorchDistSaveStrategy("torch_dist", 1)


class Worker:
    """One rank. ``scenario``: "main" (saving layout TP=world: saves, same-layout and flipped-axis loads,
    limits, async, torch.save), "world" (loads only, on TP=world of another size), "dp" (TP x DP saves)."""

    def __init__(self, rank: int, world: int, cfg: dict[str, Any]) -> None:
        self.rank = rank
        self.world = world
        self.cfg = cfg
        self.specs = [Spec(s["key"], tuple(s["shape"]), s["dtype"], s["axis"]) for s in cfg["specs"]]
        self.root = Path(cfg["dir"])
        self.scenario = cfg["scenario"]
        self.systems = set(cfg["systems"])
        # What to build: a warm pool builds everything its scenario runs; a cold-start pool (one operation)
        # only what that operation needs, so that its start-up stays short.
        build = set(cfg.get("build") or DEFAULT_BUILD[self.scenario])
        tp, dp = cfg["tp"], cfg["dp"]
        self.layout = Layout(tp, rank % tp, False, rank // tp)
        self.peak = PeakRss()
        # The libraries are imported before anything is timed (as a job imports them at start-up); what they
        # import lazily on their first call is part of that call.
        started = time.perf_counter()
        self.mesh = None
        self.dcp_dims = 1
        if "reshard" in self.systems:
            import reshard

            # reshard's public names import their modules on first use (PEP 562); resolved here, they are
            # imported before the clock, as `import torch.distributed.checkpoint` imports DCP's save and load.
            for name in ("save", "load", "AsyncCheckpointer", "ShardedTensor", "LoadStats"):
                getattr(reshard, name)
        if "tc" in self.systems:
            importlib.import_module("torch_checkpointing")
            importlib.import_module("torch_checkpointing.default_resharder")
        if self.systems & {"dcp", "tc"}:
            importlib.import_module("torch.distributed.checkpoint")
            from torch.distributed.device_mesh import init_device_mesh

            if dp > 1:
                self.mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
                self.dcp_dims = 2
            else:
                self.mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        self.megatron = None
        if "megatron" in self.systems:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from megatron.core import dist_checkpointing

            self.megatron = dist_checkpointing
            self.megatron_strategy = _megatron_cpu_save_strategy()
        self.import_seconds = time.perf_counter() - started
        # The saving state (main, dp) and the load templates (touched now: memory is reused by every load).
        self.layouts: dict[str, Layout] = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        if "state" in build:
            self._add_layout("state", self.layout, fill=True)
        if "same" in build:
            self._add_layout("same", self.layout)
        if "axis" in build:
            self._add_layout("axis", Layout(tp, rank % tp, True))
        if "world" in build:
            self._add_layout("world", self.layout)
        if "limits" in build:
            self.share = -(-sum(s.nbytes for s in self.specs) // world)
            self.scratch = torch.zeros(self.share, dtype=torch.uint8)
            self.scratch.random_(0, 256)
            if self.scenario == "main":
                self.memcpy_dst = {k: torch.zeros_like(t) for k, t in self.tensors["state"].items()}
        self.full: dict[str, torch.Tensor] | None = None
        self.ckpt_group = dist.new_group(backend="gloo")
        self.async_checkpointer = None
        self.tc_managers: dict[bool, Any] = {}
        if "tc" in self.systems:  # made at start-up, as a job makes its checkpointer (untimed)
            self.tc_managers[False] = tc_system.make_manager(rank, asynchronous=False)

    # --- state and templates -----------------------------------------------------------------------------------

    def _add_layout(self, name: str, layout: Layout, *, fill: bool = False) -> None:
        self.layouts[name] = layout
        tensors = {}
        for spec in self.specs:
            _, offset, shape = layout.box(spec)
            t = torch.zeros(shape, dtype=spec.torch_dtype)  # touched: zero pages are real pages now
            if fill:
                fill_values(t, spec, offset)
            tensors[spec.key] = t
        self.tensors[name] = tensors

    def _reshard_dict(self, name: str) -> dict[str, Any]:
        import reshard

        layout = self.layouts[name]
        out: dict[str, Any] = {}
        for spec in self.specs:
            t = self.tensors[name][spec.key]
            axis = layout.axis(spec)
            if axis is None:
                out[spec.key] = t
            else:
                out[spec.key] = reshard.ShardedTensor.from_rank_offsets(
                    spec.key, t, (axis, layout.index, layout.parts), replica_id=layout.replica
                )
        return out

    def _dcp_dict(self, name: str) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        layout = self.layouts[name]
        out: dict[str, Any] = {}
        for spec in self.specs:
            t = self.tensors[name][spec.key]
            axis = layout.axis(spec)
            tp_placement = Replicate() if axis is None else Shard(axis)
            placements = [Replicate(), tp_placement] if self.dcp_dims == 2 else [tp_placement]
            stride = tuple(math.prod(spec.shape[i + 1 :]) for i in range(len(spec.shape)))
            out[spec.key] = DTensor.from_local(
                t, self.mesh, placements, run_check=False, shape=torch.Size(spec.shape), stride=stride
            )
        return out

    def _megatron_dict(self, name: str) -> dict[str, Any]:
        from megatron.core.dist_checkpointing import ShardedTensor as McoreShardedTensor

        layout = self.layouts[name]
        out: dict[str, Any] = {}
        for spec in self.specs:
            t = self.tensors[name][spec.key]
            axis = layout.axis(spec)
            if axis is None:
                out[spec.key] = McoreShardedTensor.from_rank_offsets(spec.key, t, replica_id=self.rank)
            else:
                out[spec.key] = McoreShardedTensor.from_rank_offsets(
                    spec.key, t, (axis, layout.index, layout.parts), replica_id=layout.replica
                )
        return out

    def _needed(self, name: str) -> int:
        return sum(t.nbytes for t in self.tensors[name].values())

    def _verify(self, name: str, tensors: dict[str, torch.Tensor], what: str) -> None:
        layout = self.layouts[name]
        for spec in self.specs:
            _, offset, _ = layout.box(spec)
            check_values(tensors[spec.key], spec, offset, f"{what} (rank {self.rank})")

    def _zero(self, name: str) -> None:
        for t in self.tensors[name].values():
            t.zero_()

    def _targets(self, name: str, verify: bool) -> None:
        """Before a load (untimed): ``--targets touched`` zeroes the existing targets when the load is checked;
        ``untouched`` replaces them by new ``torch.empty`` tensors whose pages were never touched, as
        ``Module.to_empty`` leaves a model built on the meta device (the rank processes allocate large blocks with
        mmap, so the memory is fresh; it reads as zeros)."""
        if self.cfg.get("targets") != "untouched":
            if verify:
                self._zero(name)
            return
        layout = self.layouts[name]
        self.tensors[name] = {}  # the old targets freed (by reference counting: no collection runs here)
        _malloc_trim()
        for spec in self.specs:
            _, _, shape = layout.box(spec)
            self.tensors[name][spec.key] = torch.empty(shape, dtype=spec.torch_dtype)
        # Their pages enter the RSS during the load: not memory the load needs above its targets.
        self.fresh_target_bytes = sum(t.nbytes for t in self.tensors[name].values())

    # --- measurement -------------------------------------------------------------------------------------------

    def _measure(self, fn, *, profile: str | None = None, **extra: Any) -> dict[str, Any]:
        """Time ``fn`` between barriers. With ``--profile DIR``, an operation named by ``profile`` runs under
        cProfile and its statistics go to ``DIR/<profile>-<n>-r<rank>.prof``."""
        profiler = None
        if profile and self.cfg.get("profile_dir"):
            import cProfile

            profiler = cProfile.Profile()
        # No collection left due from before the clock, in either mode: the garbage of the previous repetition
        # (warm), or the generation-2 collection a fresh process owes for what its start-up created (cold: about
        # 80 ms here, whatever runs next pays it, and which system's start-up leaves it due depends only on what
        # that system imported; benchmarks/README.md). The GC column shows what the operation itself triggers.
        if self.cfg.get("gc", "collect") == "collect":
            gc.collect()
        _malloc_trim()
        collector = GcTimer()
        dist.barrier()
        rss_before = _rss()
        read_before = _rchar()
        self.peak.start()
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        returned = fn()
        if profiler is not None:
            profiler.disable()
        finished = time.perf_counter()
        collector.stop()
        if profiler is not None:
            directory = Path(self.cfg["profile_dir"])
            directory.mkdir(parents=True, exist_ok=True)
            n = sum(1 for _ in directory.glob(f"{profile}-*-r{self.rank:05d}.prof"))
            profiler.dump_stats(directory / f"{profile}-{n}-r{self.rank:05d}.prof")
        dist.barrier()
        ended = time.perf_counter()
        peak = self.peak.stop()
        # Untouched targets (--targets untouched) are counted as the touched ones are: not as extra memory.
        fresh_targets, self.fresh_target_bytes = getattr(self, "fresh_target_bytes", 0), 0
        record = {
            "seconds": ended - started,
            "rank_seconds": finished - started,
            "rss_before": rss_before,
            "peak_rss_extra": max(0, peak - rss_before - fresh_targets),
            "bytes_read": _rchar() - read_before,
            "gc_seconds": collector.seconds,
            "gc_collections": collector.collections,
            "gc_full_collections": collector.full,
            "gc_full_seconds": collector.full_seconds,
            **extra,
        }
        if isinstance(returned, dict):
            record.update(returned)
        return record

    def _fresh(self, path: Path, *, mkdir: bool = False) -> None:
        """Remove ``path`` (on rank 0, untimed) so that every save writes a new checkpoint; then flush the
        filesystem (``sync``), so that no save pays for the writeback or the journal commit (with discards,
        on a ``discard`` mount) of what came before it."""
        if self.rank == 0:
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            if mkdir:
                path.mkdir(parents=True)
            os.sync()
        dist.barrier()

    def _path(self, system: str) -> Path:
        return self.root / ("dp" if self.scenario == "dp" else "ckpt") / system

    # --- operations --------------------------------------------------------------------------------------------

    def op_info(self) -> dict[str, Any]:
        return {
            "rss": _rss(),
            "peak_method": self.peak.method,
            "threads": torch.get_num_threads(),
            "import_seconds": self.import_seconds,
        }

    def op_limits(self, write_only: bool = False) -> dict[str, Any]:
        """Sequential write (+ fsync) of this rank's share, its read from the page cache, and a memcpy of the
        rank's state into already-touched memory; all ranks at once, as the checkpoints are written."""
        directory = self.root / ("dp-limits" if self.scenario == "dp" else "limits")
        path = directory / f"r{self.rank:05d}.bin"
        if self.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.sync()  # as before every save (Worker._fresh)
        dist.barrier()
        source = memoryview(self.scratch.numpy())

        def write() -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for start in range(0, len(source), LIMIT_CHUNK):
                    view = source[start : start + LIMIT_CHUNK]
                    while view:
                        view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)

        out = {"write": self._measure(write, bytes=self.share)}
        if write_only:
            return out

        def read_into(destination: memoryview) -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < len(destination):
                    n = os.preadv(fd, [destination[done : done + LIMIT_CHUNK]], done)
                    if n == 0:
                        raise OSError(f"{path} is short: {done} bytes")
                    done += n
            finally:
                os.close(fd)

        out["read"] = self._measure(lambda: read_into(source), bytes=self.share)
        # The same read into memory never touched (a block this large is a fresh mmap): what any load into
        # targets as Module.to_empty leaves them pays at least, the kernel's page faults included.
        out["read_fresh"] = self._measure(
            lambda: read_into(memoryview(torch.empty(len(source), dtype=torch.uint8).numpy())), bytes=self.share
        )
        state, dst = self.tensors["state"], self.memcpy_dst

        def memcpy() -> None:
            with torch.no_grad():
                for key, t in state.items():
                    dst[key].copy_(t)

        out["memcpy"] = self._measure(memcpy, bytes=sum(t.nbytes for t in state.values()))
        # The checksum reshard computes on every byte it writes and verifies on every byte it loads: the
        # chunked CRC-32C of its checksum library, on this rank's share (in memory, one core).
        from reshard.flows.options import DEFAULT_CHECKSUM_CHUNK_BYTES
        from reshard.io.checksums import chunk_checksums

        out["crc32c"] = self._measure(
            lambda: chunk_checksums(source, DEFAULT_CHECKSUM_CHUNK_BYTES) and None, bytes=self.share
        )
        return out

    def op_save(self, system: str) -> dict[str, Any]:
        path = self._path(system)
        if system == "reshard":
            import reshard

            sd = self._reshard_dict("state")
            self._fresh(path)
            results: list[reshard.SaveResult] = []
            save_options = reshard.SaveOptions(
                memory_budget_bytes=self.cfg.get("save_budget_bytes") or reshard.SaveOptions().memory_budget_bytes
            )
            record = self._measure(
                lambda: results.append(reshard.save(sd, path, group=None, options=save_options)),
                profile=f"{self.cfg['mode']}-{self.scenario}-save",
            )
            stats = results[-1].stats
            record["reshard_phases"] = {
                "plan": stats.seconds_plan,
                "exchange": stats.seconds_exchange,
                "write": stats.seconds_write,
                "commit": stats.seconds_commit,
                "total": stats.seconds,
            }
            return record
        if system == "dcp":
            import torch.distributed.checkpoint as dcp

            sd = self._dcp_dict("state")
            self._fresh(path)
            return self._measure(lambda: dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True)))
        if system == "tc":
            manager = self.tc_managers[False]
            sd = self._dcp_dict("state")
            self._fresh(path)
            return self._measure(lambda: manager.save(str(path), {"model": sd}))
        if system == "megatron":
            sd = self._megatron_dict("state")
            self._fresh(path, mkdir=True)
            return self._measure(lambda: self.megatron.save(sd, str(path), sharded_strategy=self.megatron_strategy))
        raise ValueError(system)

    def op_load(self, system: str, name: str, verify: bool) -> dict[str, Any]:
        path = self._path(system)
        self._targets(name, verify)
        needed = self._needed(name)
        if system == "reshard":
            import reshard

            sd = self._reshard_dict(name)
            stats = reshard.LoadStats()
            options = reshard.LoadOptions(
                memory_budget_bytes=self.cfg.get("load_budget_bytes") or reshard.LoadOptions().memory_budget_bytes
            )
            record = self._measure(
                lambda: reshard.load(sd, path, stats=stats, options=options) and None,
                bytes_needed=needed,
                profile=f"{self.cfg['mode']}-load_{name}",
            )
            record.update(
                stats_bytes_needed=stats.bytes_needed,
                stats_bytes_read=stats.bytes_read,
                stats_read_requests=stats.read_requests,
                stats_bytes_verified=stats.bytes_verified,
                reshard_phases={
                    "metadata": stats.seconds_metadata,
                    "plan": stats.seconds_plan,
                    "read": stats.seconds_read,
                    "exchange": stats.seconds_exchange,
                    "total": stats.seconds,
                },
            )
            loaded = self.tensors[name]
        elif system == "dcp":
            import torch.distributed.checkpoint as dcp

            sd = self._dcp_dict(name)
            record = self._measure(lambda: dcp.load(sd, storage_reader=dcp.FileSystemReader(path)), bytes_needed=needed)
            loaded = self.tensors[name]
        elif system == "tc":
            # A manager of its own per load (untimed), as a resumed job has. (The checkpoints of a synchronous manager
            # hold their distributed metadata only with its cache off: benchmarks/tc_system.py.)
            manager = tc_system.make_manager(self.rank, asynchronous=False)
            sd = self._dcp_dict(name)
            try:
                record = self._measure(
                    lambda: manager.load(str(path), into={"model": sd}) and None, bytes_needed=needed
                )
            finally:
                manager.close()
            loaded = self.tensors[name]
        elif system == "megatron":
            sd = self._megatron_dict(name)
            result: dict[str, Any] = {}
            record = self._measure(lambda: result.update(self.megatron.load(sd, str(path))), bytes_needed=needed)
            loaded = {k: result[k] for k in self.tensors[name]}
            record["in_place"] = all(
                loaded[k].data_ptr() == t.data_ptr() for k, t in self.tensors[name].items() if t.numel()
            )
        else:
            raise ValueError(system)
        if verify:
            self._verify(name, loaded, f"{system} load {name}")
        return record

    def op_async(self, first: bool, warmup: bool = False) -> dict[str, Any]:
        """One asynchronous save; ``warmup``: by a new checkpointer whose buffers ``warmup()`` pre-paid before
        the clock (as a job does at start-up)."""
        import reshard

        if self.async_checkpointer is None or warmup:
            self.async_checkpointer = reshard.AsyncCheckpointer(group=self.ckpt_group)
        checkpointer = self.async_checkpointer
        path = self._path("reshard-async")
        sd = self._reshard_dict("state")
        if warmup:
            checkpointer.warmup(sd)
        self._fresh(path)

        def run() -> dict[str, Any]:
            started = time.perf_counter()
            handle = checkpointer.save(sd, path)
            blocked = time.perf_counter() - started
            handle.wait()
            return {"block_seconds": blocked, "snapshot_seconds": handle.snapshot_seconds, "first": first}

        return self._measure(run)

    def op_tc_async(self, first: bool) -> dict[str, Any]:
        """One save by torch_checkpointing's asynchronous saver: ``save()`` returns once its staging has started
        (a thread copies the state into shared memory; the caller must hold ``manager.lock()`` around updates of
        the state until then), a writer subprocess writes. ``first``: a new manager, its staging pool pre-allocated
        with ``prewarm_staging`` and its subprocess started before the clock (as ``warmup()`` for reshard)."""
        sd = self._dcp_dict("state")
        if first or True not in self.tc_managers:
            if True in self.tc_managers:
                self.tc_managers.pop(True).close()
            manager = tc_system.make_manager(self.rank, asynchronous=True)
            self.tc_managers[True] = manager
            tc_system.wait_for_writer(manager)
            manager.prewarm_staging({"model": sd})
        manager = self.tc_managers[True]
        path = self._path("tc-async")
        self._fresh(path)

        def run() -> dict[str, Any]:
            started = time.perf_counter()
            future = manager.save(str(path), {"model": sd})
            blocked = time.perf_counter() - started
            staging = manager._staging_future  # when the state may be changed again
            if staging is not None:
                staging.result()
            staged = time.perf_counter() - started
            future.result()
            return {"block_seconds": blocked, "snapshot_seconds": staged, "first": first}

        return self._measure(run)

    def op_close(self) -> None:
        for manager in self.tc_managers.values():
            with contextlib.suppress(Exception):
                manager.close()
        self.tc_managers.clear()

    def op_torch_save(self) -> dict[str, Any]:
        """torch.save of the gathered (whole) state by rank 0, flushed and fsynced."""
        path = self._path("torch.pt")
        if self.rank == 0 and self.full is None:
            self.full = {}
            for spec in self.specs:
                t = torch.empty(spec.shape, dtype=spec.torch_dtype)
                fill_values(t, spec, (0,) * len(spec.shape))
                self.full[spec.key] = t
        self._fresh(path)

        def save() -> None:
            if self.rank == 0:
                with open(path, "wb") as f:
                    torch.save(self.full, f)
                    f.flush()
                    os.fsync(f.fileno())

        return self._measure(save)

    def op_torch_load(self, verify: bool) -> dict[str, Any]:
        """Every rank torch.loads the whole file and copies its own piece into its (same-layout) targets."""
        path = self._path("torch.pt")
        name = "same"
        if verify:
            self._zero(name)
        layout, targets = self.layouts[name], self.tensors[name]

        def load() -> None:
            full = torch.load(path, weights_only=True)
            with torch.no_grad():
                for spec in self.specs:
                    _, offset, shape = layout.box(spec)
                    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
                    targets[spec.key].copy_(full[spec.key][index])
            del full

        record = self._measure(load, bytes_needed=self._needed(name))
        if verify:
            self._verify(name, targets, "torch.load")
        return record

    def op_accounting(self, name: str) -> dict[str, Any]:
        """Untimed: reshard's read accounting of one resharded load, per kind of change (saved split axis ->
        target split axis), each kind loaded on its own."""
        import reshard

        layout = self.layouts[name]
        full = self._reshard_dict(name)
        groups: dict[str, list[str]] = {}
        for spec in self.specs:
            target = layout.axis(spec)
            label = "replicated" if spec.axis is None else f"axis{spec.axis}->axis{target}"
            groups.setdefault(label, []).append(spec.key)
        out = {}
        for label, keys in sorted(groups.items()):
            stats = reshard.LoadStats()
            reshard.load({k: full[k] for k in keys}, self._path("reshard"), stats=stats)
            out[label] = {
                "bytes_needed": stats.bytes_needed,
                "bytes_read": stats.bytes_read,
                "read_requests": stats.read_requests,
            }
        return out


def _rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], tasks: Any, results: Any) -> None:
    warnings.filterwarnings("ignore")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(cfg["threads"])
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg["collective_timeout"])
        )
        worker = Worker(rank, world, cfg)
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    results.put((rank, "ok", worker.op_info()))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            op, kwargs = task
            try:
                results.put((rank, "ok", getattr(worker, f"op_{op}")(**kwargs)))
            except BaseException:
                results.put((rank, "error", traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            worker.op_close()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------------------
# The coordinator side.
# --------------------------------------------------------------------------------------------------------------


class BenchmarkError(RuntimeError):
    pass


class Pool:
    """``world`` spawned ranks in one gloo group, reused for every repetition."""

    def __init__(self, name: str, world: int, cfg: dict[str, Any], timeout: float) -> None:
        self.name = name
        self.world = world
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world, port, cfg, self.tasks[rank], self.results),
                name=f"{name}-rank{rank}",
                # torch_checkpointing's async saver starts a writer process of its own, which a daemonic process
                # may not; those pools are stopped by close() (also on an error or a signal: benchmarks/scratch.py).
                daemon="tc" not in cfg["systems"],
            )
            for rank in range(world)
        ]
        for p in self.procs:
            p.start()
        self.info: list[Any] = []
        self.closed = False

    def wait_ready(self) -> None:
        """Wait until every rank has joined the group and built its state."""
        self.info = self._collect("start-up")

    def call(self, op: str, **kwargs: Any) -> list[Any]:
        for q in self.tasks:
            q.put((op, kwargs))
        return self._collect(op)

    def _collect(self, op: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        got = 0
        deadline = time.monotonic() + self.timeout
        while got < self.world:
            try:
                rank, status, value = self.results.get(timeout=2.0)
            except queue.Empty:
                dead = [p for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    why = f"{dead[0].name} exited with {dead[0].exitcode}" if dead else f"no answer in {self.timeout} s"
                    self.close(force=True)
                    raise BenchmarkError(f"{self.name}: {op}: {why}") from None
                continue
            if status == "error":
                self.close(force=True)
                raise BenchmarkError(f"{self.name}: rank {rank} failed in {op}:\n{value}")
            out[rank] = value
            got += 1
        return out

    def close(self, *, force: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if not force:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=30)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


# --- statistics and report ------------------------------------------------------------------------------------


def _phase_summary(reps: list[list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    walls = [max(r["seconds"] for r in rep) for rep in reps]
    median = statistics.median(walls)
    world = len(reps[0])
    summary: dict[str, Any] = {
        "seconds_median": median,
        "seconds_all": walls,
        "bytes": nbytes,
        "gb_per_s": nbytes / median / 1e9 if median > 0 else None,
        "peak_rss_extra_per_rank": [max(rep[r]["peak_rss_extra"] for rep in reps) for r in range(world)],
        "bytes_read_per_rank": [reps[-1][r]["bytes_read"] for r in range(world)],
        "ranks": world,
    }
    if "bytes_needed" in reps[0][0]:
        summary["bytes_needed_per_rank"] = [reps[-1][r]["bytes_needed"] for r in range(world)]
    if "stats_bytes_read" in reps[0][0]:
        for field in ("stats_bytes_needed", "stats_bytes_read", "stats_read_requests", "stats_bytes_verified"):
            summary[field.removeprefix("stats_") + "_per_rank_reshard"] = [reps[-1][r][field] for r in range(world)]
    if "block_seconds" in reps[0][0]:
        blocks = [max(r["block_seconds"] for r in rep) for rep in reps]
        summary["block_seconds_median"] = statistics.median(blocks)
        summary["block_seconds_all"] = blocks
    if "snapshot_seconds" in reps[0][0]:  # async: until the state may be changed again (tc: its staging done)
        summary["snapshot_seconds_median"] = statistics.median(
            max(r["snapshot_seconds"] or 0.0 for r in rep) for rep in reps
        )
    if "in_place" in reps[0][0]:
        summary["in_place"] = all(r["in_place"] for rep in reps for r in rep)
    summary["gc_seconds_median"] = statistics.median(max(r.get("gc_seconds", 0.0) for r in rep) for rep in reps)
    # Generation-2 collections that started inside the clock, over every rank and repetition, and their seconds.
    summary["gc_full_collections"] = sum(r.get("gc_full_collections", 0) for rep in reps for r in rep)
    summary["gc_full_seconds_all"] = [max(r.get("gc_full_seconds", 0.0) for r in rep) for rep in reps]
    if "reshard_phases" in reps[0][0]:
        # reshard's own clock (SaveStats / LoadStats): per phase, the slowest rank's seconds, median over reps.
        names = list(reps[0][0]["reshard_phases"])
        summary["reshard_phases_median"] = {
            name: statistics.median(max(r["reshard_phases"][name] for r in rep) for rep in reps) for name in names
        }
    return summary


def _fmt_bytes(n: float) -> str:
    return f"{n / MiB:.1f}"


def _ratio_rows(
    phases: dict[str, dict[str, Any]],
    accounting: dict[str, Any],
    mode: str = "warm",
    budgets: dict[str, int] | None = None,
    untouched: bool = False,
) -> list[dict[str, Any]]:
    """The ratios of one mode's phases (``warm``: names as they are; ``cold``: the ``cold.`` phases), each with
    its target (from issue 17) where there is one; ``untouched``: the loads filled fresh targets
    (``--targets untouched``), so their floor is the read into fresh memory."""
    rows: list[dict[str, Any]] = []
    budgets = budgets or _library_budgets({})
    prefix = "cold." if mode == "cold" else ""
    phases = {k.removeprefix(prefix): v for k, v in phases.items() if k.startswith("cold.") == (mode == "cold")}

    def seconds(name: str) -> float | None:
        p = phases.get(name)
        return p["seconds_median"] if p else None

    def gbps(name: str) -> float | None:
        p = phases.get(name)
        return p["gb_per_s"] if p else None

    def add(name: str, num: float | None, den: float | None, op: str, target: float | None, note: str = "") -> None:
        value = num / den if num is not None and den else None
        passed = None
        if value is not None and target is not None:
            passed = {"<=": value <= target + 1e-9, ">=": value >= target - 1e-9, "<": value < target}[op]
        rows.append(
            {
                "mode": mode,
                "name": f"{mode}: {name}",
                "value": value,
                "target": None if target is None else f"{op} {target:g}",
                "pass": passed,
                "note": note,
            }
        )

    add("save: reshard GB/s / fsync'ed write GB/s", gbps("reshard.save"), gbps("limit.write"), ">=", 0.9)
    add("save: reshard time / DCP time", seconds("reshard.save"), seconds("dcp.save"), "<=", 0.7)
    add("save: reshard time / Megatron time", seconds("reshard.save"), seconds("megatron.save"), "<=", None)
    add("save: reshard time / torch.save time", seconds("reshard.save"), seconds("torch.save"), "<=", None)
    add("load same: reshard time / DCP time", seconds("reshard.load_same"), seconds("dcp.load_same"), "<=", 0.5)
    add("load same: reshard GB/s / page-cache read GB/s", gbps("reshard.load_same"), gbps("limit.read"), ">=", 0.5)
    add(
        "load same: reshard time / Megatron time",
        seconds("reshard.load_same"),
        seconds("megatron.load_same"),
        "<=",
        None,
    )
    add("load same: reshard time / torch.load time", seconds("reshard.load_same"), seconds("torch.load"), "<=", None)
    for scenario, label in (("load_axis", "split axis flipped"), ("load_world", "world size changed")):
        add(
            f"load {label}: reshard time / DCP time",
            seconds(f"reshard.{scenario}"),
            seconds(f"dcp.{scenario}"),
            "<=",
            0.4,
        )
        add(
            f"load {label}: reshard time / Megatron time",
            seconds(f"reshard.{scenario}"),
            seconds(f"megatron.{scenario}"),
            "<=",
            None,
        )
        p = phases.get(f"reshard.{scenario}")
        if p:
            add(
                f"load {label}: reshard bytes read / needed (all tensors)",
                sum(p["bytes_read_per_rank_reshard"]),
                sum(p["bytes_needed_per_rank_reshard"]),
                "<=",
                1.10,
            )
        for system in ("dcp", "megatron"):
            q = phases.get(f"{system}.{scenario}")
            if q:
                add(
                    f"load {label}: {system} bytes read / needed (read syscalls)",
                    sum(q["bytes_read_per_rank"]),
                    sum(q["bytes_needed_per_rank"]),
                    "<=",
                    None,
                )
        for group, stats in sorted(accounting.get(scenario, {}).items()):
            exact = group in ("axis0->axis0", "replicated")
            add(
                f"load {label}: reshard bytes read / needed, {group}",
                stats["bytes_read"],
                stats["bytes_needed"],
                "<=",
                1.0 if exact else 1.10,
                "axis-0 change: must be exact" if group == "axis0->axis0" else "",
            )
    add(
        "async: blocking time / memcpy of the state",
        _get(phases, "reshard.async", "block_seconds_median"),
        seconds("limit.memcpy"),
        "<=",
        1.1,
    )
    add(
        "async: blocking time / synchronous save",
        _get(phases, "reshard.async", "block_seconds_median"),
        seconds("reshard.save"),
        "<=",
        0.15,
    )
    add(
        "async (first save): blocking time / memcpy",
        _get(phases, "reshard.async_first", "block_seconds_median"),
        seconds("limit.memcpy"),
        "<=",
        None,
        "buffers touched for the first time",
    )
    add(
        "async (first save after warmup()): blocking time / memcpy",
        _get(phases, "reshard.async_warmup", "block_seconds_median"),
        seconds("limit.memcpy"),
        "<=",
        1.1,
        "buffers pre-paid by AsyncCheckpointer.warmup",
    )
    add(
        "async (first save after warmup()): total time / synchronous save",
        _get(phases, "reshard.async_warmup", "seconds_median"),
        seconds("reshard.save"),
        "<=",
        1.2,
    )
    add(
        "async: total time / synchronous save",
        _get(phases, "reshard.async", "seconds_median"),
        seconds("reshard.save"),
        "<=",
        1.2,
    )
    loads = [k for k in phases if k.startswith("reshard.load")]
    if loads:
        worst = max(max(phases[k]["peak_rss_extra_per_rank"]) for k in loads)
        add("load: reshard extra peak RSS per rank (MiB, worst load)", worst / MiB, 1.0, "<=", 32)
        add("load: reshard extra peak RSS per rank / budget (worst load)", worst, budgets["load"], "<=", 1.0)
        dcp_loads = [k for k in phases if k.startswith("dcp.load")]
        if dcp_loads:
            dcp_worst = max(max(phases[k]["peak_rss_extra_per_rank"]) for k in dcp_loads)
            add("load: DCP extra peak RSS per rank (MiB, worst load)", dcp_worst / MiB, 1.0, "<=", None)
    for system in ("reshard", "dcp"):
        p = phases.get(f"{system}.save")
        if p:
            label = "reshard" if system == "reshard" else "DCP"
            add(
                f"save: {label} extra peak RSS per rank (MiB)", max(p["peak_rss_extra_per_rank"]) / MiB, 1.0, "<=", None
            )
    p = phases.get("reshard.save")
    if p:
        add(
            "save: reshard extra peak RSS per rank / budget",
            max(p["peak_rss_extra_per_rank"]),
            budgets["save"],
            "<=",
            1.0,
        )
    add(
        "DP=2 save: reshard time / DCP time",
        seconds("dp.reshard.save"),
        seconds("dp.dcp.save"),
        "<=",
        1.0,
        "balanced writers",
    )
    add(
        "DP=2 save: reshard time / Megatron time",
        seconds("dp.reshard.save"),
        seconds("dp.megatron.save"),
        "<=",
        1.0,
        "balanced writers",
    )
    add("DP=2 save: reshard GB/s / fsync'ed write GB/s", gbps("dp.reshard.save"), gbps("dp.limit.write"), ">=", None)
    add("checksum: CRC-32C GB/s / page-cache read GB/s", gbps("limit.crc32c"), gbps("limit.read"), ">=", None)
    _best_peer_rows(add, seconds, phases, untouched)
    return rows


PEERS = {"dcp": "DCP", "megatron": "Megatron", "tc": "torch_checkpointing", "torch": "torch.save/load"}


def _best_peer_rows(add, seconds, phases: dict[str, Any], untouched: bool) -> None:
    """reshard against torch_checkpointing, and against the fastest peer of each row (issue 35's targets)."""
    for phase, label in (("save", "save"), ("load_same", "load same"), ("load_axis", "load split axis flipped")):
        add(
            f"{label}: reshard time / torch_checkpointing time",
            seconds(f"reshard.{phase}"),
            seconds(f"tc.{phase}"),
            "<=",
            None,
        )
    add(
        "load world size changed: reshard time / torch_checkpointing time",
        seconds("reshard.load_world"),
        seconds("tc.load_world"),
        "<=",
        None,
    )
    targets = {"save": 0.7, "load_same": 0.5, "load_axis": 0.4, "load_world": 0.4}
    # The least time any system can take (a load needs at least its bytes read from the page cache, into
    # memory as the targets mode leaves it): the floor's ratio to the best peer bounds what a target can ask.
    floor = seconds("limit.write"), seconds("limit.read_fresh" if untouched else "limit.read")
    for phase, target in targets.items():
        names = {"torch": "torch.save" if phase == "save" else "torch.load"} if phase in ("save", "load_same") else {}
        peers = {
            system: seconds(names.get(system, f"{system}.{phase}"))
            for system in PEERS
            if seconds(names.get(system, f"{system}.{phase}")) is not None
        }
        if peers:
            best = min(peers, key=lambda k: peers[k])
            add(
                f"{phase}: reshard time / best peer's time ({PEERS[best]})",
                seconds(f"reshard.{phase}"),
                peers[best],
                "<=",
                target,
            )
            if phase != "load_world":  # the floor is measured on the saving layout's ranks
                add(
                    f"{phase}: the machine's floor ({'write + fsync' if phase == 'save' else 'page-cache read'}) "
                    f"/ the fastest peer's time",
                    floor[0] if phase == "save" else floor[1],
                    peers[best],
                    "<=",
                    None,
                )
            if phase in ("load_same", "load_axis"):
                _verified_floor_rows(add, seconds, phases, phase, floor[1], peers[best])
    add(
        "async: blocking time, reshard / torch_checkpointing (save() returned)",
        _get(phases, "reshard.async", "block_seconds_median"),
        _get(phases, "tc.async", "block_seconds_median"),
        "<=",
        None,
    )
    add(
        "async: total time, reshard / torch_checkpointing",
        _get(phases, "reshard.async", "seconds_median"),
        _get(phases, "tc.async", "seconds_median"),
        "<=",
        None,
    )


def _verified_floor_rows(add, seconds, phases: dict[str, Any], phase: str, read: float | None, best: float) -> None:
    """The floor of a load that verifies what it uses, as reshard does: the page-cache read of the rank's bytes
    plus the CRC-32C of the bytes it verifies (whole checksum chunks: a resharded load that needs part of every
    chunk verifies more than it uses; the share is reshard's own LoadStats). The peers verify nothing, so
    their floor is the read alone; this row bounds what a target can ask of a load that keeps reshard's
    guarantee, and the second row says how far reshard is above it."""
    p = phases.get(f"reshard.{phase}") or {}
    verified, needed = p.get("bytes_verified_per_rank_reshard"), p.get("bytes_needed_per_rank_reshard")
    crc = seconds("limit.crc32c")
    if read is None or crc is None or not verified or not needed or not sum(needed):
        return
    share = sum(verified) / sum(needed)
    floor = read + crc * share
    add(
        f"{phase}: the floor with reshard's checks (read + CRC-32C of {share:.0%} of the bytes) / the fastest "
        "peer's time",
        floor,
        best,
        "<=",
        None,
    )
    add(f"{phase}: reshard time / the floor with reshard's checks", seconds(f"reshard.{phase}"), floor, "<=", None)


def _get(phases: dict[str, Any], name: str, field: str) -> float | None:
    p = phases.get(name)
    return p.get(field) if p else None


def _print_report(report: dict[str, Any], out) -> None:
    cfg = report["config"]
    print(file=out)
    print(
        f"state: {report['state']['bytes'] / GiB:.3f} GiB in {report['state']['tensors']} tensors "
        f"(hidden {report['state']['hidden']}, {cfg['layers']} layers, fp32/bf16); saved on {cfg['ranks']} ranks, "
        f"resharded load on {cfg['load_world']} ranks; {cfg['repeat']} repetitions, medians; mode {cfg['mode']}; "
        "page cache warm",
        file=out,
    )
    budgets = report.get("memory_budgets")
    if budgets:
        print(
            f"reshard memory budgets per rank: save {budgets['save'] / MiB:g} MiB, load {budgets['load'] / MiB:g} MiB",
            file=out,
        )
    header = (
        f"{'phase':<28}{'median s':>10}{'GB/s':>8}{'blocks s':>10}{'peak RSS +MiB':>15}{'read MiB':>11}"
        f"{'needed MiB':>12}{'read/need':>11}{'GC s':>8}"
    )
    print(header, file=out)
    print(f"{'':<56}{'(max over ranks, per rank)':>38}", file=out)
    print("-" * len(header), file=out)
    for name, p in report["phases"].items():
        rss = f"{max(p['peak_rss_extra_per_rank']) / MiB:.1f}"
        read = need = amp = ""
        if "bytes_needed_per_rank" in p:
            read = _fmt_bytes(max(p["bytes_read_per_rank"]))
            need = _fmt_bytes(max(p["bytes_needed_per_rank"]))
            if sum(p["bytes_needed_per_rank"]):
                amp = f"{sum(p['bytes_read_per_rank']) / sum(p['bytes_needed_per_rank']):.2f}"
        gb = f"{p['gb_per_s']:.3f}" if p.get("gb_per_s") else ""
        block = f"{p['block_seconds_median']:.3f}" if "block_seconds_median" in p else ""
        print(
            f"{name:<28}{p['seconds_median']:>10.3f}{gb:>8}{block:>10}{rss:>15}{read:>11}{need:>12}{amp:>11}"
            f"{p.get('gc_seconds_median', 0.0):>8.3f}",
            file=out,
        )
    breakdown = {k: p["reshard_phases_median"] for k, p in report["phases"].items() if "reshard_phases_median" in p}
    if breakdown:
        print(file=out)
        print("reshard's own phases (SaveStats / LoadStats; slowest rank per phase, median s):", file=out)
        for name, parts in breakdown.items():
            print(f"  {name:<26}" + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()), file=out)
    full = {k: p for k, p in report["phases"].items() if p.get("gc_full_collections")}
    if full:
        print(
            "generation-2 collections inside the clock (all ranks and repetitions; slowest rank's seconds per "
            "repetition): "
            + "; ".join(
                f"{k} {p['gc_full_collections']} ({', '.join(f'{v:.3f}' for v in p['gc_full_seconds_all'])})"
                for k, p in full.items()
            ),
            file=out,
        )
    if report.get("imports_seconds_median"):
        imports = ", ".join(f"{k} {v:.2f} s" for k, v in report["imports_seconds_median"].items())
        print(f"cold start: import before the clock (median, slowest rank): {imports}", file=out)
    if report["accounting"]:
        print(file=out)
        print("reshard read accounting per kind of change (LoadStats, summed over ranks):", file=out)
        for scenario, groups in report["accounting"].items():
            for group, s in sorted(groups.items()):
                amp = s["bytes_read"] / s["bytes_needed"] if s["bytes_needed"] else 1.0
                print(
                    f"  {scenario:<11}{group:<15} needed {_fmt_bytes(s['bytes_needed']):>9} MiB, read "
                    f"{_fmt_bytes(s['bytes_read']):>9} MiB ({amp:.3f}) in {s['read_requests']} requests",
                    file=out,
                )
    coverage = []
    for name, p in report["phases"].items():
        if "bytes_verified_per_rank_reshard" in p and sum(p["bytes_read_per_rank_reshard"]):
            share = sum(p["bytes_verified_per_rank_reshard"]) / sum(p["bytes_read_per_rank_reshard"])
            coverage.append(f"{name.removeprefix('reshard.')} {share:.0%}")
    if coverage:
        print(f"reshard checksum coverage (bytes verified / bytes read): {', '.join(coverage)}", file=out)
    print(file=out)
    print(f"{'ratio':<78}{'value':>9}  {'target':<9} result", file=out)
    for row in report["ratios"]:
        if row["value"] is None:
            continue
        result = "" if row["pass"] is None else ("PASS" if row["pass"] else "MISS")
        note = f"  ({row['note']})" if row["note"] else ""
        print(f"{row['name']:<78}{row['value']:>9.3f}  {row['target'] or '':<9} {result}{note}", file=out)
    for system, why in report["skipped"].items():
        print(f"skipped: {system}: {why}", file=out)
    for line in report["notes"]:
        print(f"note: {line}", file=out)


def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
    }
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        info["memory_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(Exception):
        import reshard

        info["reshard"] = reshard.__version__
    return info


def _megatron_available() -> tuple[bool, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import megatron.core
            from megatron.core import dist_checkpointing  # noqa: F401
            from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

        for name in (
            "TorchDistSaveShardedStrategy",
            "MCoreSavePlanner",
            "_replace_state_dict_keys_with_sharded_keys",
            "mcore_to_pyt_state_dict",
        ):
            if not hasattr(mcore_torch, name):
                return False, f"megatron-core {megatron.core.__version__} lacks {name}"
        return True, f"megatron-core {megatron.core.__version__}"
    except Exception as exc:
        return False, f"megatron-core is not importable ({type(exc).__name__}: {exc})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=0.25, help="total size of the generated state (default 0.25)")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the saving layout, TP=ranks (default 2)")
    p.add_argument(
        "--load-world",
        type=int,
        default=None,
        help="world size of the world-size-change load (default 2 x ranks; 1 also works)",
    )
    p.add_argument("--layers", type=int, default=8, help="transformer layers of the generated state (default 8)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; medians are quoted (default 3)")
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="the directory in which the run's scratch directory (.reshard-bench-*, git-ignored) is made "
        "(default: the current directory, so the disk of the working tree); it is removed when the run ends, "
        "by an error, Ctrl-C, SIGTERM or SIGHUP too, unless --keep",
    )
    p.add_argument("--keep", action="store_true", help="keep the checkpoints directory")
    p.add_argument("--json", type=Path, default=None, help="write every figure to this JSON file")
    p.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help=f"comma-separated subset of {','.join(ALL_SYSTEMS)} (default all; megatron is skipped "
        "when megatron-core is not installed)",
    )
    p.add_argument(
        "--dp-replicas",
        action="store_true",
        help="also save on 2 x ranks ranks with DP=2 replicas (TP=ranks), every system, to measure balanced writers",
    )
    p.add_argument(
        "--load-budget-mib",
        type=float,
        default=None,
        help="reshard.LoadOptions(memory_budget_bytes=...) in MiB (default: the library's default, 32 MiB)",
    )
    p.add_argument(
        "--save-budget-mib",
        type=float,
        default=None,
        help="reshard.SaveOptions(memory_budget_bytes=...) in MiB (default: the library's default, 256 MiB)",
    )
    p.add_argument(
        "--mode",
        choices=("warm", "cold", "both"),
        default="both",
        help="warm: one pool of rank processes reused for every repetition (a long job's steady state); cold: "
        "fresh processes for every single operation (a restart, a short job); both (default)",
    )
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="run every reshard save and load under cProfile; per-rank statistics go to DIR (read them with "
        "python -m pstats)",
    )
    p.add_argument(
        "--gc",
        choices=("collect", "none"),
        default="collect",
        help="collect (default): gc.collect() before every clock, so no collection is due when a call starts; none: "
        "no collection, the state dict built right before the clock (the first checkpoint after a restart: whatever "
        "collection the caller's objects made due is there when the call starts)",
    )
    p.add_argument(
        "--targets",
        choices=("touched", "untouched"),
        default="touched",
        help="touched (default): loads fill targets allocated and touched at start-up; untouched: new torch.empty "
        "targets before each load, never touched (as Module.to_empty leaves them), so the load pays their page faults",
    )
    p.add_argument("--no-verify", action="store_true", help="skip checking the loaded values (first repetition)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank (default cpus // ranks, >= 1)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds any one operation may take (default 1800)")
    args = p.parse_args(argv)
    if args.load_world is None:
        args.load_world = 2 * args.ranks
    if args.repeat < 1 or args.ranks < 1 or args.load_world < 1:
        p.error("--repeat, --ranks and --load-world must be at least 1")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(ALL_SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {','.join(ALL_SYSTEMS)}")
    args.systems = [s for s in ALL_SYSTEMS if s in systems]
    return args


def _lcm(*values: int) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


class Recorder:
    """Every measured repetition of every phase, as the ranks returned them."""

    def __init__(self) -> None:
        self.raw: dict[str, list[list[dict[str, Any]]]] = {}
        self.phase_bytes: dict[str, int] = {}
        self.imports: dict[str, list[float]] = {}

    def record(self, name: str, results: list[dict[str, Any]], nbytes: int) -> None:
        self.raw.setdefault(name, []).append(results)
        self.phase_bytes[name] = nbytes
        wall = max(r["seconds"] for r in results)
        extra = f" (blocks {max(r['block_seconds'] for r in results):.3f} s)" if "block_seconds" in results[0] else ""
        print(f"  {name:<28} {wall:8.3f} s{extra}", file=sys.stderr)

    def phases(self) -> dict[str, dict[str, Any]]:
        return {name: _phase_summary(reps, self.phase_bytes[name]) for name, reps in self.raw.items()}


def _needed_total(results: list[dict[str, Any]]) -> int:
    return sum(r["bytes_needed"] for r in results)


def _rotated(order: list[str], rep: int) -> list[str]:
    return order[rep % len(order) :] + order[: rep % len(order)]


def _run_warm(
    args: argparse.Namespace,
    base_cfg: dict[str, Any],
    systems: list[str],
    rec: Recorder,
    total: int,
    accounting: dict[str, Any],
) -> str:
    """Warm processes: one pool per world size, started once and reused for every repetition; returns how
    peak RSS was measured."""
    cpus = os.cpu_count() or 1
    verify = not args.no_verify
    pools: list[Pool] = []
    try:
        cfg = {**base_cfg, "mode": "warm", "scenario": "main", "tp": args.ranks, "dp": 1, "systems": systems}
        # Every pool starts at once (importing torch and building the state is the slow part of a small run);
        # nothing is measured before all of them are ready.
        main = Pool("main", args.ranks, cfg, args.timeout)
        pools.append(main)
        world_pool = None
        world_systems = [s for s in systems if s in ("reshard", "dcp", "megatron", "tc")]
        if world_systems:
            wcfg = {
                **base_cfg,
                "mode": "warm",
                "scenario": "world",
                "tp": args.load_world,
                "dp": 1,
                "systems": world_systems,
                "threads": args.threads or max(1, cpus // args.load_world),
            }
            world_pool = Pool("world", args.load_world, wcfg, args.timeout)
            pools.append(world_pool)
        dp_pool = None
        dp_systems = [s for s in systems if s in ("limits", "reshard", "dcp", "megatron")]
        if args.dp_replicas and dp_systems:
            dcfg = {
                **base_cfg,
                "mode": "warm",
                "scenario": "dp",
                "tp": args.ranks,
                "dp": 2,
                "systems": dp_systems,
                "threads": args.threads or max(1, cpus // (2 * args.ranks)),
            }
            dp_pool = Pool("dp", 2 * args.ranks, dcfg, args.timeout)
            pools.append(dp_pool)
        for pool in pools:
            pool.wait_ready()
        peak_method = str(main.info[0]["peak_method"])
        order = [s for s in ALL_SYSTEMS if s in systems]
        for rep in range(args.repeat):
            rotated = _rotated(order, rep)
            check = verify and rep == 0
            print(f"warm repetition {rep + 1}/{args.repeat}: {', '.join(rotated)}", file=sys.stderr)
            for system in rotated:
                if system == "limits":
                    lim = main.call("limits")
                    for kind in LIMIT_KINDS:
                        results = [r[kind] for r in lim]
                        rec.record(
                            f"limit.{kind}", results, total if kind == "write" else sum(r["bytes"] for r in results)
                        )
                    continue
                if system == "torch":
                    rec.record("torch.save", main.call("torch_save"), total)
                    res = main.call("torch_load", verify=check)
                    rec.record("torch.load", res, _needed_total(res))
                    continue
                rec.record(f"{system}.save", main.call("save", system=system), total)
                for name in ("same", "axis"):
                    res = main.call("load", system=system, name=name, verify=check)
                    rec.record(f"{system}.load_{name}", res, _needed_total(res))
                if world_pool is not None:
                    res = world_pool.call("load", system=system, name="world", verify=check)
                    rec.record(f"{system}.load_world", res, _needed_total(res))
                if system == "reshard":
                    if rep == 0:
                        rec.record("reshard.async_first", main.call("async", first=True), total)
                    rec.record("reshard.async", main.call("async", first=False), total)
                if system == "tc":
                    if rep == 0:
                        rec.record("tc.async_first", main.call("tc_async", first=True), total)
                    rec.record("tc.async", main.call("tc_async", first=False), total)
        if "reshard" in systems:
            accounting["load_axis"] = _sum_accounting(main.call("accounting", name="axis"))
            if world_pool is not None:
                accounting["load_world"] = _sum_accounting(world_pool.call("accounting", name="world"))
        main.close()
        if world_pool is not None:
            world_pool.close()
        if dp_pool is not None:
            for rep in range(args.repeat):
                rotated = _rotated(dp_systems, rep)
                print(f"warm DP=2 repetition {rep + 1}/{args.repeat}: {', '.join(rotated)}", file=sys.stderr)
                for system in rotated:
                    if system == "limits":
                        lim = dp_pool.call("limits", write_only=True)
                        rec.record("dp.limit.write", [r["write"] for r in lim], total)
                    else:
                        rec.record(f"dp.{system}.save", dp_pool.call("save", system=system), total)
            dp_pool.close()
        pools.clear()
        return peak_method
    finally:
        for pool in pools:
            pool.close(force=True)


def _cold_call(
    pool_name: str, world: int, cfg: dict[str, Any], timeout: float, rec: Recorder, op: str, **kwargs: Any
) -> list[Any]:
    """Cold start: spawn ``world`` fresh ranks that build only what ``op`` needs, run ``op`` once, stop them."""
    pool = Pool(pool_name, world, cfg, timeout)
    try:
        pool.wait_ready()
        for system in set(cfg["systems"]) & {"reshard", "dcp", "megatron", "tc"}:
            rec.imports.setdefault(system, []).append(max(float(i["import_seconds"]) for i in pool.info))
        results = pool.call(op, **kwargs)
        pool.close()
        return results
    finally:
        pool.close(force=True)


def _run_cold(
    args: argparse.Namespace, base_cfg: dict[str, Any], systems: list[str], rec: Recorder, total: int
) -> None:
    """Cold starts, as after a restart or in a short job: a fresh set of spawned ranks for every single
    operation (save; same-layout load; split-axis-flipped load; reshard's first async save; the limits), the
    libraries imported before the clock, the targets allocated and touched before it; systems alternating
    in a rotated order. The page cache is not dropped (the files were just written)."""
    cpus = os.cpu_count() or 1
    verify = not args.no_verify
    order = [s for s in ALL_SYSTEMS if s in systems and s != "torch"]

    def main_cfg(system: str, build: tuple[str, ...]) -> dict[str, Any]:
        return {
            **base_cfg,
            "mode": "cold",
            "scenario": "main",
            "tp": args.ranks,
            "dp": 1,
            "systems": [system],
            "build": build,
        }

    for rep in range(args.repeat):
        rotated = _rotated(order, rep)
        check = verify and rep == 0
        print(f"cold repetition {rep + 1}/{args.repeat}: {', '.join(rotated)}", file=sys.stderr)
        for system in rotated:
            if system == "limits":
                lim = _cold_call(
                    "cold-limits", args.ranks, main_cfg("limits", ("state", "limits")), args.timeout, rec, "limits"
                )
                for kind in LIMIT_KINDS:
                    results = [r[kind] for r in lim]
                    rec.record(
                        f"cold.limit.{kind}", results, total if kind == "write" else sum(r["bytes"] for r in results)
                    )
                continue
            res = _cold_call(
                f"cold-{system}-save",
                args.ranks,
                main_cfg(system, ("state",)),
                args.timeout,
                rec,
                "save",
                system=system,
            )
            rec.record(f"cold.{system}.save", res, total)
            for name in ("same", "axis"):
                res = _cold_call(
                    f"cold-{system}-load-{name}",
                    args.ranks,
                    main_cfg(system, (name,)),
                    args.timeout,
                    rec,
                    "load",
                    system=system,
                    name=name,
                    verify=check,
                )
                rec.record(f"cold.{system}.load_{name}", res, _needed_total(res))
            if system == "tc":
                res = _cold_call(
                    "cold-tc-async", args.ranks, main_cfg(system, ("state",)), args.timeout, rec, "tc_async", first=True
                )
                rec.record("cold.tc.async_warmup", res, total)
            if system == "reshard":
                for phase, warmup in (("async_first", False), ("async_warmup", True)):
                    res = _cold_call(
                        f"cold-reshard-{phase}",
                        args.ranks,
                        main_cfg(system, ("state",)),
                        args.timeout,
                        rec,
                        "async",
                        first=True,
                        warmup=warmup,
                    )
                    rec.record(f"cold.reshard.{phase}", res, total)
    dp_systems = [s for s in order if s in ("limits", "reshard", "dcp", "megatron")]
    if not (args.dp_replicas and dp_systems):
        return
    world = 2 * args.ranks
    for rep in range(args.repeat):
        rotated = _rotated(dp_systems, rep)
        print(f"cold DP=2 repetition {rep + 1}/{args.repeat}: {', '.join(rotated)}", file=sys.stderr)
        for system in rotated:
            cfg = {
                **base_cfg,
                "mode": "cold",
                "scenario": "dp",
                "tp": args.ranks,
                "dp": 2,
                "systems": [system],
                "build": ("state", "limits") if system == "limits" else ("state",),
                "threads": args.threads or max(1, cpus // world),
            }
            if system == "limits":
                lim = _cold_call("cold-dp-limits", world, cfg, args.timeout, rec, "limits", write_only=True)
                rec.record("cold.dp.limit.write", [r["write"] for r in lim], total)
            else:
                res = _cold_call(f"cold-dp-{system}-save", world, cfg, args.timeout, rec, "save", system=system)
                rec.record(f"cold.dp.{system}.save", res, total)


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    notes: list[str] = []
    skipped: dict[str, str] = {}
    systems = list(args.systems)
    if "tc" in systems:
        ok, why = tc_system.tc_available()
        if not ok:
            systems.remove("tc")
            skipped["tc"] = why
            print(f"tc: skipped: {why} (install the benchmark extra: pip install -e '.[bench]')", file=sys.stderr)
        else:
            notes.append(
                f"{why} (tc): CheckpointManager with ItemSpec(resharder=DefaultResharder()) on the DTensor state; its "
                "metadata all-gather, which puts tensors on cuda, runs with all_gather_object on the CPU group; "
                "use_direct_io=False (O_DIRECT writes fail here); its pre_finalize_callback fsyncs each rank's files "
                "(benchmarks/tc_system.py)"
            )
    if "megatron" in systems:
        ok, why = _megatron_available()
        if not ok:
            systems.remove("megatron")
            skipped["megatron"] = why
            print(f"megatron: skipped: {why} (install the benchmark extra: pip install -e '.[bench]')", file=sys.stderr)
        else:
            notes.append(
                f"{why}: saved through its torch_dist strategy with torch's synchronous DCP save "
                "(torch.distributed.checkpoint.save + Megatron's MCoreSavePlanner), as Megatron's CPU test utilities "
                "do; its default async writer calls torch.cuda.synchronize() and cannot run on CPU"
            )
    unit = _lcm(64, args.ranks, args.load_world, 2 * args.ranks)
    specs, hidden = gpt_specs(int(args.size_gib * GiB), args.layers, unit)
    total = sum(s.nbytes for s in specs)
    parent = args.dir if args.dir is not None else Path.cwd()
    parent.mkdir(parents=True, exist_ok=True)
    scratch = contextlib.ExitStack()  # removes the scratch directory on any end, SIGTERM/SIGHUP included
    root = scratch.enter_context(scratch_dir(".reshard-bench-", parent, keep=args.keep))
    cpus = os.cpu_count() or 1
    threads = args.threads or max(1, cpus // args.ranks)
    base_cfg = {
        "specs": [asdict(s) for s in specs],
        "dir": str(root),
        "threads": threads,
        "collective_timeout": args.timeout,
        "load_budget_bytes": int(args.load_budget_mib * MiB) if args.load_budget_mib else None,
        "save_budget_bytes": int(args.save_budget_mib * MiB) if args.save_budget_mib else None,
        "profile_dir": str(args.profile.resolve()) if args.profile else None,
        "gc": args.gc,
        "targets": args.targets,
    }
    if args.targets == "untouched":
        # Large allocations by mmap in the rank processes (inherited at spawn): new targets are fresh pages.
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(256 * 1024)
    try:
        rec = Recorder()
        accounting: dict[str, Any] = {}
        peak_method = PeakRss().method
        print(f"state: {total / GiB:.3f} GiB, {len(specs)} tensors, hidden {hidden}; dir {root}", file=sys.stderr)
        if args.mode in ("warm", "both"):
            peak_method = _run_warm(args, base_cfg, systems, rec, total, accounting)
        if args.mode in ("cold", "both"):
            _run_cold(args, base_cfg, systems, rec, total)
    finally:
        scratch.close()  # after the pools' own finally blocks have stopped every rank process

    phases = rec.phases()
    fsync = {
        "limits": "the write limit fsyncs its file",
        "reshard": "reshard fsyncs each data file, the data directory, metadata.json and the checkpoint directory",
        "dcp": "DCP (FileSystemWriter, sync_files=True, its default) fsyncs each data file and .metadata, not the "
        "directory",
        "megatron": "Megatron's data and .metadata go through the same DCP writer (fsynced); its metadata.json and "
        "common.pt are written without fsync",
        "torch": "the torch.save reference is flushed and fsynced",
        "tc": "torch_checkpointing's writer does not fsync (it relies on O_DIRECT, which fails here); its "
        "pre_finalize_callback fsyncs each rank's files, the metadata and the directory",
    }
    notes.append("fsync: " + "; ".join(fsync[s] for s in systems))
    if "tc" in systems:
        notes.append(
            "tc: its synchronous manager runs with its metadata cache off (torch-checkpointing 0.1.1 writes the "
            "distributed metadata only in a manager's first checkpoint otherwise, and the later ones cannot be "
            "loaded into another layout: benchmarks/tc_system.py)"
        )
    if "megatron.load_same" in phases and not phases["megatron.load_same"].get("in_place", True):
        notes.append("Megatron's load returned new tensors instead of filling the templates in place")
    notes += [
        f"peak RSS: {peak_method}, minus the RSS before the phase (targets already allocated and touched; "
        "free heap memory given back with malloc_trim first)",
        "bytes read per rank: the process's rchar counter (/proc/self/io: bytes returned by read()-family calls, "
        "page cache hits included, socket traffic excluded); reshard's own LoadStats are in the accounting table",
        f"torch threads per rank: {threads}; DCP/Megatron loads use torch's default FileSystemReader",
    ]
    if args.mode != "warm":
        notes.append(
            "cold: a fresh set of spawned ranks per operation; libraries imported before the clock (import seconds "
            "below), what they import or build on first use inside it; the page cache keeps the files just written"
        )
    report = {
        "config": {
            "size_gib": args.size_gib,
            "ranks": args.ranks,
            "load_world": args.load_world,
            "layers": args.layers,
            "repeat": args.repeat,
            "mode": args.mode,
            "systems": systems,
            "dp_replicas": args.dp_replicas,
            "dir": str(root),
            "threads": threads,
            "load_budget_mib": args.load_budget_mib,
            "save_budget_mib": args.save_budget_mib,
            "gc": args.gc,
            "targets": args.targets,
        },
        "machine": _machine(),
        "state": {"bytes": total, "tensors": len(specs), "hidden": hidden},
        "phases": phases,
        "accounting": accounting,
        "imports_seconds_median": {k: statistics.median(v) for k, v in rec.imports.items()},
        "skipped": skipped,
        "notes": notes,
        "seconds_total": time.perf_counter() - t_start,
    }
    report["ratios"] = []
    budgets = _library_budgets(base_cfg)
    report["memory_budgets"] = budgets
    if args.mode in ("warm", "both"):
        report["ratios"] += _ratio_rows(phases, accounting, "warm", budgets, args.targets == "untouched")
    if args.mode in ("cold", "both"):
        report["ratios"] += _ratio_rows(phases, {}, "cold", budgets, args.targets == "untouched")
    return report


def _library_budgets(cfg: dict[str, Any]) -> dict[str, int]:
    """The memory budgets reshard's saves and loads ran with: the ones asked for, else the library's defaults."""
    import reshard

    return {
        "save": cfg.get("save_budget_bytes") or reshard.SaveOptions().memory_budget_bytes,
        "load": cfg.get("load_budget_bytes") or reshard.LoadOptions().memory_budget_bytes,
    }


def _sum_accounting(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rank_groups in per_rank:
        for group, stats in rank_groups.items():
            acc = out.setdefault(group, {"bytes_needed": 0, "bytes_read": 0, "read_requests": 0})
            for k in acc:
                acc[k] += stats[k]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except BenchmarkError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        return 1
    _print_report(report, sys.stdout)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
