"""The paths GPU tensors take through save and load, run on the CPU (tests/io/test_gpu.py runs them on a GPU).

A save copies tensors that are not plain host bytes a slab at a time through a ring of staging buffers
(:class:`reshard.io.device.HostSlabs`); a load fills destinations outside host memory through host proxies
carved from two arenas (:class:`reshard.io.device.DeviceFill`). On a CPU-only machine the same code runs with
host memory alone: the slabs of transposed and conjugate views, and a read executor told to fill every
destination through proxies (``fill_all_through_host``), which is the whole load path of a GPU destination
but for the copy engine. Each case is compared bit for bit with what a plain load gives.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.io.device import DeviceFill, HostSlabs, copy_to_host
from reshard.io.reader import ReadBudget, ReadExecutor
from reshard.net.comm import Communicator
from reshard.net.transports import PlaneGroups, plane_devices
from reshard.planning.load_plan import TargetPiece, plan_load
from reshard.state.statedict import flatten_state_dict
from reshard.storage import LocalStorage, ObjectStorage
from tests.rankpool import RankContext, RankPool

# ---- HostSlabs: the save's staging ring -----------------------------------------------------------------


def _stored_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().resolve_conj().resolve_neg().contiguous().numpy().tobytes()


@pytest.mark.unit
@pytest.mark.parametrize("slots", [1, 2, 3])
def test_host_slabs_cover_every_tensor_in_order(slots: int) -> None:
    """Plain host tensors pass whole and uncopied; views are staged in slabs of at most ``slab_bytes`` (rows
    cut when one row is larger); an empty tensor still yields its position; the bytes are C order."""
    base = torch.arange(40 * 25, dtype=torch.float32).reshape(40, 25)
    tensors = [
        base,
        base.t(),
        torch.empty(0, 3),
        torch.tensor(3.5),
        base[:, 3:7],
        torch.arange(5.0)._neg_view(),
        torch.complex(torch.arange(6.0), torch.ones(6)).conj(),
        base,
    ]
    slabs = HostSlabs(64, slots=slots)
    seen: dict[int, bytearray] = {}
    order: list[int] = []
    for position, view in slabs.slabs(tensors):
        assert len(view) <= 64 or position in (0, 7), "a staged slab is within slab_bytes"
        if not order or order[-1] != position:
            order.append(position)
        seen.setdefault(position, bytearray()).extend(view)
    assert order == list(range(len(tensors)))
    for position, tensor in enumerate(tensors):
        assert bytes(seen[position]) == _stored_bytes(tensor), position
    staged = sum(t.nbytes for i, t in enumerate(tensors) if i not in (0, 2, 3, 7))
    assert slabs.bytes_copied == staged
    assert slabs.held_bytes <= slots * 64


@pytest.mark.unit
def test_copy_to_host_fills_every_pair() -> None:
    sources = [torch.arange(12.0).reshape(3, 4).t(), torch.tensor(7, dtype=torch.int64), torch.empty(0)]
    hosts = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
    copy_to_host(list(zip(hosts, sources, strict=True)))
    assert all(torch.equal(h, s) for h, s in zip(hosts, sources, strict=True))


# ---- DeviceFill and the read executor: the load path of GPU destinations ------------------------------------

MiB = 1 << 20


def _save_varied(path: Any, *, chunk: int) -> dict[str, torch.Tensor]:
    """A checkpoint of several dtypes and boxes (each tensor in two row blocks, saved as two ShardedTensors of
    one rank), checksummed in ``chunk``-byte chunks; returns the whole tensors."""
    g = torch.Generator().manual_seed(5)
    whole = {
        "w": torch.randn(96, 80, generator=g),
        "h": torch.randn(50, 33, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(2**40), 2**40, (37, 11), generator=g),
        "big": torch.randn(3, 70000, generator=g),  # rows of 280 KB: larger than the small budgets' read limit
        "s": torch.tensor(2.5),
    }
    state: dict[str, Any] = {"s": whole["s"]}
    for key, tensor in whole.items():
        if tensor.ndim == 0:
            continue
        half = tensor.shape[0] // 2
        state[f"{key}.0"] = reshard.ShardedTensor(key, tensor[:half].clone(), tuple(tensor.shape), (0, 0))
        state[f"{key}.1"] = reshard.ShardedTensor(key, tensor[half:].clone(), tuple(tensor.shape), (half, 0))
    reshard.save(state, path, options=reshard.SaveOptions(checksum_chunk_bytes=chunk))
    return whole


def _template() -> tuple[dict[str, Any], torch.Tensor]:
    """Another layout: column blocks (strided reads), a transposed destination, a cast to float64 and one to
    bfloat16, and a 0-dim tensor; with the buffer that holds the transposed destination."""
    w_t = torch.zeros(80, 96)
    template = {
        "w.a": reshard.ShardedTensor("w", w_t.t()[:, :30], (96, 80), (0, 0)),  # a strided destination
        "w.b": reshard.ShardedTensor("w", torch.zeros(96, 50), (96, 80), (0, 30)),
        "h": torch.zeros(50, 33, dtype=torch.float64),
        "i": reshard.ShardedTensor("i", torch.zeros(20, 11, dtype=torch.int64), (37, 11), (17, 0)),
        "big": reshard.ShardedTensor("big", torch.zeros(2, 70000, dtype=torch.bfloat16), (3, 70000), (1, 0)),
        "s": torch.zeros(()),
    }
    return template, w_t


def _filled(template: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.data if isinstance(v, reshard.ShardedTensor) else v for k, v in template.items()}


def _read_through_proxies(storage: Any, template: dict[str, Any], budget: int) -> ReadExecutor:
    """What ``reshard.load`` does, with every destination filled through host proxies."""
    metadata = reshard.read_metadata(storage)
    flat = flatten_state_dict(template, rank=0, dedup=False)
    pieces = [(t.key, p) for t in flat.tensors for p in t.pieces()]
    plan = plan_load(
        metadata,
        [TargetPiece(key=key, box=p.box) for key, p in pieces],
        max_read_bytes=ReadBudget.of(budget, device=True).max_read_bytes,
        request_cost_bytes=storage.request_cost_bytes,
        max_read_amplification=None if storage.request_cost_bytes else 1.1,
    )
    executor = ReadExecutor(storage, metadata, memory_budget_bytes=budget, fill_all_through_host=True)
    executor.run(plan, [p.view for _, p in pieces], [p.box for _, p in pieces])
    return executor


@pytest.mark.unit
@pytest.mark.parametrize(
    ("budget", "chunk"),
    [(32 * MiB, 4 * MiB), (256 * 1024, 4096), (64 * 1024, 1 << 20)],
    ids=["default-budget", "small-arenas", "oversized-chunks"],
)
@pytest.mark.parametrize("backend", ["local", "object-store"])
def test_proxies_fill_every_destination_like_a_plain_load(
    tmp_path: Path, budget: int, chunk: int, backend: str
) -> None:
    """Every kind of read (direct into the proxy, mapped, staged chunks, runs, oversized chunks streamed)
    lands in proxies that are flushed arena by arena; the result is bit-identical to a plain load's, and every
    destination byte went through a proxy once."""
    whole = _save_varied(tmp_path / "ckpt", chunk=chunk)
    if backend == "local":
        storage: Any = LocalStorage(tmp_path / "ckpt")
    else:  # ranged reads that cannot be mapped, batched: the checkpoint copied to fsspec's memory store
        url = f"memory://device-paths-{uuid.uuid4().hex}/ckpt"
        memory = fsspec.filesystem("memory")
        for file in (tmp_path / "ckpt").rglob("*"):
            if file.is_file():
                memory.pipe(f"{url}/{file.relative_to(tmp_path / 'ckpt').as_posix()}", file.read_bytes())
        storage = ObjectStorage(url)
    try:
        expected_template, expected_w_t = _template()
        expected = reshard.load(expected_template, storage, options=reshard.LoadOptions(memory_budget_bytes=budget))
        template, w_t = _template()
        executor = _read_through_proxies(storage, template, budget)
        got = _filled(template)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert value.dtype == got[key].dtype and torch.equal(got[key], value), key
        assert torch.equal(w_t, expected_w_t) and torch.equal(w_t.t()[:, :30], whole["w"][:, :30])
        assert torch.equal(got["big"], whole["big"][1:].to(torch.bfloat16))
        needed = 96 * 80 * 4 + 50 * 33 * 2 + 20 * 11 * 8 + 2 * 70000 * 4 + 4
        assert executor.bytes_to_device == needed
    finally:
        storage.close()


@pytest.mark.unit
def test_device_fill_flushes_an_arena_before_reusing_it() -> None:
    """Two arenas of 256 bytes: a third proxy waits for the first arena's flush; a proxy larger than an arena
    gets an arena of its own size; what each destination receives is its proxy's content, converted."""
    fill = DeviceFill(256)
    dests = [torch.zeros(16, dtype=torch.float64) for _ in range(5)] + [torch.zeros(100, dtype=torch.float64)]
    written = []
    for i, dest in enumerate(dests):
        if not fill.has_room(dest, torch.float32):
            with pytest.raises(RuntimeError, match="flush"):
                fill.proxy(dest, torch.float32)
            fill.flush()
        proxy = fill.proxy(dest, torch.float32)
        assert proxy.dtype == torch.float32 and proxy.is_contiguous() and proxy.shape == dest.shape
        proxy.copy_(torch.arange(dest.numel()) + 1000 * i)
        written.append(proxy.clone())
    fill.close()
    for dest, proxy in zip(dests, written, strict=True):
        assert torch.equal(dest, proxy.double())
    assert fill.bytes_copied == sum(d.numel() * 4 for d in dests)


@pytest.mark.unit
def test_the_device_budget_keeps_a_read_item_within_an_arena() -> None:
    for budget in (16, 1000, 32 * MiB, 1 << 30):
        plain, device = ReadBudget.of(budget), ReadBudget.of(budget, device=True)
        assert plain.arena_bytes == 0
        assert device.max_read_bytes <= device.arena_bytes
        assert device.read_buffer_bytes + device.stream_bytes + device.max_read_bytes + 2 * device.arena_bytes <= budget


# ---- the planes of a process group --------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    ("config", "planes"),
    [
        ("cpu:gloo,cuda:nccl", ("cpu", "cuda")),
        ("cuda:nccl", ("cuda", "cuda")),
        ("cpu:gloo,cuda:gloo", ("cpu", "cpu")),
        ("cpu:gloo", ("cpu", "cpu")),
        ("gloo", ("cpu", "cpu")),
        ("nccl", ("cuda", "cuda")),
        ("cpu:gloo,cuda:ucc", ("cpu", "cuda")),
        ("custom", ("cpu", "cpu")),
    ],
)
def test_plane_devices(config: str, planes: tuple[str, str]) -> None:
    """reshard's protocol goes on the CPU backend where the group has one; tensor data on the GPU backend
    unless it is gloo."""
    assert plane_devices(config) == planes


def rank_plane_groups(ctx: RankContext, path: str) -> dict[str, Any]:
    """Save rows on 4 ranks, load columns, and load the whole tensor on every rank, read once, through
    PlaneGroups: the protocol on a second gloo group of the same ranks (as a gloo twin of an NCCL group would
    carry it), tensor data on the default group."""
    control = dist.new_group(backend="gloo")  # every rank makes it, in the same order
    groups = PlaneGroups(data=None, control=control)
    full = torch.arange(8 * 12, dtype=torch.float32).reshape(8, 12)
    rows = reshard.ShardedTensor.from_rank_offsets("w", full[2 * ctx.rank : 2 * ctx.rank + 2].clone(), (0, ctx.rank, 4))
    reshard.save({"w": rows}, path, group=groups)
    column = reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 3), (1, ctx.rank, 4))
    loaded = reshard.load({"w": column}, path, group=groups)
    assert torch.equal(loaded["w"], full[:, 3 * ctx.rank : 3 * ctx.rank + 3])
    stats = reshard.LoadStats()  # every rank needs every byte: each read once, then sent to the others
    options = reshard.LoadOptions(read_once=True)
    whole = reshard.load({"w": torch.zeros(8, 12)}, path, group=groups, options=options, stats=stats)
    assert torch.equal(whole["w"], full)
    transport: Any = Communicator(groups).transport
    if ctx.rank < 2:  # the first two ranks' group is not the data group's ranks
        with pytest.raises(reshard.CheckpointError, match="same ranks in the same order"):
            Communicator(PlaneGroups(data=None, control=ctx.groups["first2"]))
    return {"control_is_twin": transport.control_group is control, "from_peers": stats.bytes_from_peers}


@pytest.mark.dist
def test_plane_groups_carry_the_protocol_on_their_own_group(pool4: RankPool, tmp_path: Path) -> None:
    results = pool4.run_ok(rank_plane_groups, str(tmp_path / "ckpt"))
    assert all(r["control_is_twin"] for r in results)
    assert sum(r["from_peers"] for r in results) > 0  # the exchange ran on the data group
