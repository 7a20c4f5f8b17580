"""The GPU path: CUDA tensors through save, asynchronous save, load, read-once loads, transfer and the
peer-memory tier, on a real GPU (docs/concepts.md, "GPU memory").

Every test here needs CUDA and is skipped, with the reason, where torch sees no GPU (the CPU build that
``make test`` installs): tests/io/test_device_paths.py runs the same code paths on host memory in every build.
``benchmarks/gpu_check.sh`` runs this file and ``benchmarks/gpu.py`` on a GPU machine. One GPU suffices for
all but the NCCL data-plane tests: several processes share it with a gloo group (NCCL refuses two ranks on
one device), and threads of one process share it through :class:`reshard.net.transports.ThreadGroup`.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.geometry.boxes import Box
from reshard.net.transports import PlaneGroups, ThreadGroup
from reshard.state.fingerprint import fingerprint
from tests.threads import on_threads

NO_GPU = (
    f"needs a CUDA GPU, and this torch {torch.__version__} sees none (the CPU build of make test): "
    "benchmarks/gpu_check.sh runs these tests on a GPU machine; tests/io/test_device_paths.py runs the same paths on "
    "host memory"
)
pytestmark = [pytest.mark.dist, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]

TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"NCCL needs one GPU per rank (it refuses two ranks on one device); this machine has "
    f"{torch.cuda.device_count()}",
)

MiB = 1 << 20


def _full(key: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The global tensor ``key`` (on the CPU), the same in every process."""
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**31), 2**31, shape, generator=g).to(dtype)


SHAPES = {
    "w": ((96, 80), torch.float32),
    "h": ((50, 34), torch.bfloat16),
    "i": ((36, 12), torch.int64),
    "e": ((300, 64), torch.float16),
}


def _rows(key: str, rank: int, parts: int, device: str = "cuda") -> torch.Tensor:
    shape, dtype = SHAPES[key]
    per = shape[0] // parts
    return _full(key, shape, dtype)[rank * per : (rank + 1) * per].to(device)


# ---- one process ----------------------------------------------------------------------------------------


def test_save_and_load_cuda_tensors_bit_exactly(tmp_path: Path) -> None:
    """CUDA tensors of four dtypes, a transposed view, a 0-dim tensor and a conjugate view are saved; loads
    into CUDA templates (same dtype, a cast, a strided destination) and into CPU templates give the saved
    values bit for bit, complete when load returns."""
    w = _full("w", (96, 80)).cuda()
    state = {
        "w": w,
        "wt": w.t(),
        "h": _full("h", (50, 34), torch.bfloat16).cuda(),
        "i": _full("i", (36, 12), torch.int64).cuda(),
        "s": torch.tensor(2.5, device="cuda"),
        "c": torch.complex(w[:4], w[4:8]).conj(),
    }
    reshard.save(state, tmp_path / "ckpt", options=reshard.SaveOptions(fingerprint=True))
    stats = reshard.LoadStats()
    buffer = torch.zeros(80, 96, device="cuda")
    template = {
        "w": buffer.t(),  # a strided CUDA destination
        "wt": torch.zeros(80, 96, device="cuda"),
        "h": torch.zeros(50, 34, dtype=torch.float32, device="cuda"),  # converted on the device
        "i": torch.zeros(36, 12, dtype=torch.int64, device="cuda"),
        "s": torch.zeros((), device="cuda"),
        "c": torch.zeros(4, 80, dtype=torch.complex64, device="cuda"),
    }
    out = reshard.load(template, tmp_path / "ckpt", stats=stats, options=reshard.LoadOptions(verify=True))
    assert torch.equal(out["w"], w) and torch.equal(buffer, w.t())
    assert torch.equal(out["wt"], w.t())
    assert torch.equal(out["h"], state["h"].float())
    assert torch.equal(out["i"], state["i"])
    assert torch.equal(out["s"], state["s"])
    assert torch.equal(out["c"], state["c"].resolve_conj())
    assert all(t.device.type == "cuda" for t in out.values())
    assert stats.bytes_to_device == stats.bytes_needed > 0
    assert stats.bytes_direct > 0
    on_cpu = reshard.load({k: torch.zeros_like(v, device="cpu") for k, v in template.items()}, tmp_path / "ckpt")
    assert all(torch.equal(on_cpu[k], out[k].cpu()) for k in out)


def test_save_sees_the_kernels_queued_before_it(tmp_path: Path) -> None:
    """The copies run on a side stream that waits for the caller's stream: a save called while a long kernel
    that writes the state is still queued saves that kernel's result (a copy on another stream without the
    wait would read the old values)."""
    x = torch.zeros(4096, 1024, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time ahead of the fill
    x.fill_(7.0)
    reshard.save({"x": x}, tmp_path / "ckpt")
    out = reshard.load({"x": torch.zeros(4096, 1024)}, tmp_path / "ckpt")
    assert torch.equal(out["x"], torch.full((4096, 1024), 7.0))


def test_a_load_is_complete_for_every_stream_when_it_returns(tmp_path: Path) -> None:
    """Copies into CUDA destinations run on a side stream; the load waits for them, so that another stream
    (or the host) reads the loaded values at once."""
    x = _full("w", (96, 80)).cuda()
    reshard.save({"x": x}, tmp_path / "ckpt")
    dest = torch.zeros(96, 80, device="cuda")
    reshard.load({"x": dest}, tmp_path / "ckpt")
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        copy = dest.clone()
    other.synchronize()
    assert torch.equal(copy, x)


def test_fingerprints_on_the_device_equal_the_hosts() -> None:
    """The content fingerprint is summed on the GPU in wrapping 64-bit arithmetic, as on the host."""
    for key, (shape, dtype) in SHAPES.items():
        data = _full(key, shape, dtype)
        box = Box((3, 0), (shape[0] - 3, shape[1]))
        global_shape = (shape[0] + 5, shape[1])
        assert fingerprint(data[3:].cuda(), box, global_shape) == fingerprint(data[3:], box, global_shape), key
    c = torch.complex(torch.randn(5, 7), torch.randn(5, 7))
    assert fingerprint(c.cuda(), Box((0, 0), (5, 7)), (5, 7)) == fingerprint(c, Box((0, 0), (5, 7)), (5, 7))


def test_incremental_save_of_a_cuda_state_hashes_on_the_way_to_the_host(tmp_path: Path) -> None:
    frozen = _full("e", (300, 64), torch.float16).cuda()
    trained = _full("w", (96, 80)).cuda()
    reshard.save(
        {"frozen": frozen, "trained": trained}, tmp_path / "s1", options=reshard.SaveOptions(content_hash=True)
    )
    trained.add_(1)
    result = reshard.save({"frozen": frozen, "trained": trained}, tmp_path / "s2", base=tmp_path / "s1")
    assert result.referenced_bytes == frozen.nbytes
    out = reshard.load(
        {"frozen": torch.zeros(300, 64, dtype=torch.float16), "trained": torch.zeros(96, 80)}, tmp_path / "s2"
    )
    assert torch.equal(out["frozen"], frozen.cpu()) and torch.equal(out["trained"], trained.cpu())


def test_resharded_load_into_cuda_destinations_on_thread_ranks(tmp_path: Path) -> None:
    """Two ranks (threads sharing the GPU) save row blocks at TP=2; three load column blocks into CUDA
    destinations, bf16 converted to fp32 on the device; every block equals the global tensor's."""
    path = tmp_path / "ckpt"
    saving = ThreadGroup(2, timeout=60)

    def save(rank: int) -> None:
        state = {k: reshard.ShardedTensor.from_rank_offsets(k, _rows(k, rank, 2), (0, rank, 2)) for k in SHAPES}
        reshard.save(state, path, group=saving.member(rank))

    on_threads(2, save, group=saving)
    loading = ThreadGroup(3, timeout=60)

    def load(rank: int) -> dict[str, torch.Tensor]:
        template = {}
        for key, (shape, dtype) in SHAPES.items():
            cols = -(-shape[1] // 3)
            start = rank * cols
            width = min(cols, shape[1] - start)
            wanted = torch.float32 if dtype == torch.bfloat16 else dtype
            data = torch.zeros(shape[0], width, dtype=wanted, device="cuda")
            template[key] = reshard.ShardedTensor(key, data, shape, (0, start))
        return reshard.load(template, path, group=loading.member(rank))

    results = on_threads(3, load, group=loading)
    for key, (shape, dtype) in SHAPES.items():
        got = torch.cat([r[key].cpu() for r in results], dim=1)
        expected = _full(key, shape, dtype)
        assert torch.equal(got, expected.float() if dtype == torch.bfloat16 else expected), key


# ---- asynchronous save ------------------------------------------------------------------------------------


def _pinned_copy_seconds(state: dict[str, torch.Tensor]) -> float:
    """The best of three device-to-host copies of ``state`` into pinned buffers allocated beforehand: the floor
    an asynchronous save's blocking time is compared with."""
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in state.items()}
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for key, value in state.items():
            buffers[key].copy_(value, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


@pytest.mark.parametrize("overlap", [False, True], ids=["blocking", "overlapped"])
def test_async_save_blocks_for_a_device_to_host_copy_or_not_at_all(tmp_path: Path, overlap: bool) -> None:
    """1 GiB of CUDA tensors. A blocking snapshot holds the caller (``SaveHandle.snapshot_seconds``) for about
    as long as a pinned device-to-host copy of the state takes, not for the write; an overlapped one
    (``overlap_snapshot=True``) returns once the copies are issued, far sooner, and ``wait_snapshot`` queues
    the in-place update after them on the device. Either way the state changed right after the call does not
    reach the checkpoint."""
    state = {f"layer{i}": _full(f"layer{i}", (1024, 4096)).cuda() for i in range(64)}  # 64 x 16 MiB
    expected = {k: v.cpu() for k, v in state.items()}
    floor = _pinned_copy_seconds(state)
    checkpointer = reshard.AsyncCheckpointer()
    checkpointer.warmup(state)
    blocked = []
    for step in range(3):
        torch.cuda.synchronize()
        handle = checkpointer.save(state, tmp_path / f"step{step}", overlap_snapshot=overlap)
        blocked.append(handle.snapshot_seconds)
        handle.wait_snapshot()
        for value in state.values():
            value.add_(1.0)  # the optimizer step, on the current stream
        handle.wait()
        assert handle.snapshot_done()
        out = reshard.load({k: torch.zeros_like(v) for k, v in expected.items()}, tmp_path / f"step{step}")
        assert all(torch.equal(out[k], expected[k]) for k in expected), f"step {step}"
        expected = {k: v + 1.0 for k, v in expected.items()}
    print(f"snapshot blocked {min(blocked) * 1e3:.1f} ms; pinned copy of the state {floor * 1e3:.1f} ms")
    if overlap:
        assert min(blocked) < 0.5 * floor, (blocked, floor)
    else:
        assert min(blocked) <= 1.5 * floor + 0.02, (blocked, floor)


def test_async_snapshot_waits_for_queued_kernels(tmp_path: Path) -> None:
    x = torch.zeros(2048, 1024, device="cuda")
    checkpointer = reshard.AsyncCheckpointer()
    checkpointer.warmup({"x": x})
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    x.fill_(3.0)
    checkpointer.save({"x": x}, tmp_path / "ckpt").wait()
    out = reshard.load({"x": torch.zeros(2048, 1024)}, tmp_path / "ckpt")
    assert torch.equal(out["x"], torch.full((2048, 1024), 3.0))


def test_an_overlapped_snapshot_keeps_a_freed_source_until_it_is_copied(tmp_path: Path) -> None:
    """A tensor made for the checkpoint and dropped when ``save`` returns is not handed to the next allocation
    while its copy has yet to run (the source is recorded on the side stream)."""
    base = _full("base", (4096, 4096)).cuda()
    checkpointer = reshard.AsyncCheckpointer()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    handle = checkpointer.save({"t": base * 2}, tmp_path / "ckpt", overlap_snapshot=True)
    junk = torch.full((4096, 4096), -1.0, device="cuda")  # the freed block's size: the allocator's first choice
    handle.wait()
    out = reshard.load({"t": torch.zeros(4096, 4096)}, tmp_path / "ckpt")
    assert torch.equal(out["t"], (base * 2).cpu())
    del junk


# ---- several processes -------------------------------------------------------------------------------------
# Ranks are spawned here (not taken from the suite's gloo pools) so that each starts with the backends asked for.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawned_rank(rank: int, world: int, port: int, backend: str, task: str, args: tuple[Any, ...], out: Any) -> None:
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        out.put((rank, "ok", globals()[task](rank, world, *args)))
        dist.destroy_process_group()
    except BaseException as exc:  # reported to the test
        out.put((rank, "error", "".join(traceback.format_exception(exc))))


def _spawn(world: int, backend: str, task: str, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """Run ``task(rank, world, *args)`` in ``world`` fresh processes joined with ``backend``; their results."""
    ctx = torch.multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    processes = [
        ctx.Process(target=_spawned_rank, args=(r, world, port, backend, task, args, out), daemon=True)
        for r in range(world)
    ]
    for p in processes:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, status, value = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(world)) - set(results))} did not answer in {timeout_s:.0f} s")
            if status != "ok":
                pytest.fail(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _group(twin: bool) -> Any:
    """The default group, or it with a gloo twin for reshard's protocol (``PlaneGroups``)."""
    import torch.distributed as dist

    return PlaneGroups(data=None, control=dist.new_group(backend="gloo")) if twin else None


def task_save_reshard_exchange(rank: int, world: int, path: str, twin: bool) -> dict[str, Any]:
    """Save CUDA row blocks at TP=world; load at another layout (column blocks, CUDA destinations), with and
    without read_once; transfer CUDA pieces to another layout; keep and restore through the peer-memory tier.
    With ``twin``, every call gets the default group with a gloo twin (``PlaneGroups``)."""
    import torch.distributed as dist

    from reshard.net.comm import Communicator

    group = _group(twin)
    transport: Any = Communicator(group).transport
    planes = (transport.control_device.type, transport.device.type)
    state = {k: reshard.ShardedTensor.from_rank_offsets(k, _rows(k, rank, world), (0, rank, world)) for k in SHAPES}
    reshard.save(state, path, group=group)

    def column_template() -> dict[str, Any]:
        template = {}
        for key, (shape, dtype) in SHAPES.items():
            data = torch.zeros(shape[0], shape[1] // world, dtype=dtype, device="cuda")
            template[key] = reshard.ShardedTensor.from_rank_offsets(key, data, (1, rank, world))
        return template

    def check(loaded: dict[str, torch.Tensor]) -> None:
        for key, (shape, dtype) in SHAPES.items():
            width = shape[1] // world
            assert torch.equal(loaded[key].cpu(), _full(key, shape, dtype)[:, rank * width : (rank + 1) * width]), key

    check(reshard.load(column_template(), path, group=group, options=reshard.LoadOptions(read_once=False)))
    # Every rank needs the whole of "w": read once between the ranks, exchanged over the data plane.
    stats = reshard.LoadStats()
    options = reshard.LoadOptions(read_once=True)
    whole = reshard.load({"w": torch.zeros(96, 80, device="cuda")}, path, group=group, options=options, stats=stats)
    assert torch.equal(whole["w"].cpu(), _full("w", (96, 80)))
    check(reshard.transfer(state, column_template(), group=group))
    tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=120)
    tier.save(state, group=group)
    check(tier.restore(column_template(), group=group))
    dist.barrier()
    return {"planes": planes, "from_peers": stats.bytes_from_peers, "to_peers": stats.bytes_to_peers}


def test_two_processes_share_one_gpu_over_gloo(tmp_path: Path) -> None:
    """Two ranks on one GPU in a gloo group: reshard's protocol and the exchanged tensor data go through
    host memory (the data plane of a gloo group), the tensors stay CUDA tensors."""
    results = _spawn(2, "gloo", "task_save_reshard_exchange", str(tmp_path / "ckpt"), False)
    assert [r["planes"] for r in results] == [("cpu", "cpu")] * 2
    assert sum(r["from_peers"] for r in results) == sum(r["to_peers"] for r in results) > 0


def task_planes(rank: int, world: int, twin: bool) -> tuple[str, str]:
    from reshard.net.comm import Communicator

    transport: Any = Communicator(_group(twin)).transport
    return transport.control_device.type, transport.device.type


@pytest.mark.parametrize(
    ("backend", "twin", "planes"),
    [
        ("cpu:gloo,cuda:nccl", False, ("cpu", "cuda")),
        ("nccl", False, ("cuda", "cuda")),
        ("nccl", True, ("cpu", "cuda")),
    ],
)
def test_the_planes_of_an_nccl_group(backend: str, twin: bool, planes: tuple[str, str]) -> None:
    """A group with gloo and NCCL carries reshard's protocol on gloo and tensor data on NCCL; a pure NCCL group
    carries both on the GPU, unless a gloo twin is given with it."""
    assert _spawn(1, backend, "task_planes", twin) == [planes]


def task_async_save_on_a_pure_nccl_group(rank: int, world: int, path: str) -> bool:
    """An asynchronous save refuses to run its background collectives on a pure NCCL group, and runs with the
    group's gloo twin."""
    import torch.distributed as dist

    state = {"x": torch.arange(6.0, device="cuda")}
    with pytest.raises(reshard.CheckpointError, match="background thread"):
        reshard.AsyncCheckpointer().save(state, path)
    twin = PlaneGroups(data=None, control=dist.new_group(backend="gloo"))
    reshard.AsyncCheckpointer(group=twin).save(state, path).wait()
    return torch.equal(reshard.load({"x": torch.zeros(6)}, path)["x"], torch.arange(6.0))


def test_an_asynchronous_save_refuses_a_pure_nccl_group(tmp_path: Path) -> None:
    assert _spawn(1, "nccl", "task_async_save_on_a_pure_nccl_group", str(tmp_path / "ckpt")) == [True]


@TWO_GPUS
@pytest.mark.parametrize(("backend", "twin"), [("cpu:gloo,cuda:nccl", False), ("nccl", False), ("nccl", True)])
def test_read_once_transfer_and_peer_memory_over_nccl(tmp_path: Path, backend: str, twin: bool) -> None:
    """Two ranks on two GPUs: the read-once exchange, ``reshard.transfer`` and the peer-memory tier send their
    tensor data over NCCL (device buffers, batched sends and receives), bit-exactly; the protocol goes on gloo
    where the group has it or a gloo twin is given."""
    results = _spawn(2, backend, "task_save_reshard_exchange", str(tmp_path / "ckpt"), twin)
    control = "cpu" if backend.startswith("cpu") or twin else "cuda"
    assert [r["planes"] for r in results] == [(control, "cuda")] * 2
    assert sum(r["from_peers"] for r in results) == sum(r["to_peers"] for r in results) > 0
