"""Property test: save under one random layout, load under another, get the same bytes.

The N saving ranks are threads of this process (a :class:`~reshard.net.transports.ThreadGroup`), each calling
the real ``reshard.save`` with its own state dict: planning, writer election, writing, agreement and the
commit run exactly as on N processes. The M loading ranks are another thread group calling the real
``reshard.load``, each with a template of its own box, and must get exactly the bytes of that box of the
global tensor, reading no more than the amplification bound allows.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard
from reshard.geometry.boxes import Box
from reshard.metadata import Metadata
from reshard.net.transports import ThreadGroup, Transport
from reshard.planning.load_plan import DEFAULT_MAX_READ_AMPLIFICATION
from reshard.state.sharding import ReplicaId
from tests.threads import on_threads

pytestmark = pytest.mark.dist  # in-process, but seconds: kept out of make test-fast

T = TypeVar("T")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
MAX_SAVE_BOXES = 8
MAX_LOAD_BOXES = 8


@dataclass(frozen=True)
class Case:
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    save_boxes: list[Box]
    replicas: int
    tuple_replica_ids: bool
    rank_order: list[int]
    """Simulated save rank of each (box, replica) copy, so primaries are not always on the low ranks."""
    load_boxes: list[Box]
    load_cuts_only_axis_0: bool
    seed: int
    views_on_save: bool
    views_on_load: bool
    checksum_chunk_bytes: int


def _split(draw: st.DrawFn, size: int, parts: int, allow_empty: bool) -> list[tuple[int, int]]:
    """(start, length) of ``parts`` consecutive pieces of ``[0, size)``, cut at random points."""
    if parts == 1:
        cuts = []
    elif allow_empty:
        cuts = sorted(draw(st.lists(st.integers(0, size), min_size=parts - 1, max_size=parts - 1)))
    else:
        cuts = sorted(draw(st.lists(st.integers(1, size - 1), min_size=parts - 1, max_size=parts - 1, unique=True)))
    bounds = [0, *cuts, size]
    return [(lo, hi - lo) for lo, hi in itertools.pairwise(bounds)]


def _grid(
    draw: st.DrawFn, shape: tuple[int, ...], max_boxes: int, *, only_axis_0: bool, allow_empty: bool
) -> list[Box]:
    """A regular grid tiling of ``shape``: each axis cut into a random number (up to 3) of uneven parts,
    at most ``max_boxes`` boxes in all."""
    caps = [1 if only_axis_0 and axis > 0 else (3 if allow_empty else min(size, 3)) for axis, size in enumerate(shape)]
    parts = [draw(st.integers(1, cap)) for cap in caps]
    while math.prod(parts) > max_boxes:
        parts[parts.index(max(parts))] -= 1
    per_axis = [_split(draw, size, n, allow_empty) for size, n in zip(shape, parts, strict=True)]
    return [
        Box(tuple(start for start, _ in combo), tuple(n for _, n in combo)) for combo in itertools.product(*per_axis)
    ]


@st.composite
def cases(draw: st.DrawFn) -> Case:
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.sampled_from([1, 3, 5, 7, 9])) for _ in range(ndim))
    save_boxes = _grid(draw, shape, MAX_SAVE_BOXES, only_axis_0=False, allow_empty=draw(st.booleans()))
    replicas = draw(st.integers(1, 3))
    only_axis_0 = draw(st.booleans())
    load_boxes = _grid(draw, shape, MAX_LOAD_BOXES, only_axis_0=only_axis_0, allow_empty=draw(st.booleans()))
    return Case(
        global_shape=shape,
        dtype=draw(st.sampled_from(DTYPES)),
        save_boxes=save_boxes,
        replicas=replicas,
        tuple_replica_ids=draw(st.booleans()),
        rank_order=draw(st.permutations(range(len(save_boxes) * replicas))),
        load_boxes=load_boxes,
        load_cuts_only_axis_0=only_axis_0,
        seed=draw(st.integers(0, 2**31 - 1)),
        views_on_save=draw(st.booleans()),
        views_on_load=draw(st.booleans()),
        checksum_chunk_bytes=draw(st.sampled_from([8, 24, 4 * 1024 * 1024])),
    )


def random_global(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: NaNs with payloads, infinities and subnormals included, so only a
    bitwise comparison can pass."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).view(dtype).reshape(shape)


def slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offset, box.shape, strict=True))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def local_data(full: torch.Tensor, box: Box, *, as_view: bool) -> torch.Tensor:
    """The box's data: a contiguous copy, or a (generally non-contiguous) view into the global tensor."""
    part = full[slices(box)]
    return part if as_view else part.clone()


def blank_target(box: Box, dtype: torch.dtype, *, as_view: bool) -> torch.Tensor:
    """A zeroed load target; as a view, it sits inside a larger buffer (non-contiguous unless 1-D)."""
    if not as_view:
        return torch.zeros(box.shape, dtype=dtype)
    padded = torch.zeros(tuple(s + 2 for s in box.shape), dtype=dtype)
    return padded[tuple(slice(1, 1 + s) for s in box.shape)]


def on_group_threads(count: int, work: Callable[[int, Transport], T]) -> list[T]:
    """``work(rank, group member)`` on ``count`` threads of one ThreadGroup; the results in rank order (the
    first exception of any rank is raised, the others' barrier aborted)."""
    group = ThreadGroup(count, timeout=30.0)
    return on_threads(count, lambda rank: work(rank, group.member(rank)), group=group)


def save_on_threads(state_dicts: list[dict[str, object]], path: Path, chunk_bytes: int) -> Metadata:
    """The real ``reshard.save`` on one thread per state dict; the committed metadata."""
    options = reshard.SaveOptions(checksum_chunk_bytes=chunk_bytes)
    results = on_group_threads(
        len(state_dicts), lambda rank, group: reshard.save(state_dicts[rank], path, group=group, options=options)
    )
    assert all(r.metadata is None for r in results[1:])  # only the coordinator holds the metadata
    metadata = results[0].metadata
    assert metadata is not None
    return metadata


def replica_id(replica: int, tuple_ids: bool) -> ReplicaId:
    return (0, replica) if tuple_ids else replica


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
def test_save_under_one_layout_load_under_another(case: Case, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("reshard") / "ckpt"
    full = random_global(case.global_shape, case.dtype, case.seed)
    extra = random_global((3,), torch.float32, case.seed + 1)  # a plain tensor, replicated on every rank

    # Save: one state dict per simulated rank; copy r of box b lives on rank rank_order[b * replicas + r].
    n_ranks = len(case.save_boxes) * case.replicas
    owned: list[tuple[Box, int]] = [(Box((), ()), -1)] * n_ranks
    for b, box in enumerate(case.save_boxes):
        for r in range(case.replicas):
            owned[case.rank_order[b * case.replicas + r]] = (box, r)
    state_dicts: list[dict[str, object]] = []
    for rank, (box, r) in enumerate(owned):
        state_dicts.append(
            {
                "model": {
                    "w": reshard.ShardedTensor(
                        "model.w",
                        local_data(full, box, as_view=case.views_on_save),
                        case.global_shape,
                        box.offset,
                        replica_id(r, case.tuple_replica_ids),
                    ),
                    "extra": extra.clone(),
                },
                "rng": reshard.ShardedObject("rng", {"rank": rank, "t": torch.tensor([rank])}, (n_ranks,), (rank,)),
                "step": 17,
            }
        )
    metadata = save_on_threads(state_dicts, path, case.checksum_chunk_bytes)

    # Each unique non-empty box is written once; nothing else is stored.
    itemsize = case.dtype.itemsize
    non_empty = sorted(b.offset for b in case.save_boxes if b.volume > 0)
    assert sorted(b.offset for b in metadata.tensors["model.w"].boxes) == non_empty
    assert metadata.total_bytes == full.numel() * itemsize + extra.numel() * 4
    assert reshard.read_metadata(path).to_json_dict() == metadata.to_json_dict()

    # Load: one loading rank (thread) per box, together.
    targets = [blank_target(box, case.dtype, as_view=case.views_on_load) for box in case.load_boxes]

    def load_box(rank: int, group: Transport) -> tuple[torch.Tensor, reshard.LoadStats]:
        box = case.load_boxes[rank]
        template = {"model": {"w": reshard.ShardedTensor("model.w", targets[rank], case.global_shape, box.offset)}}
        stats = reshard.LoadStats()
        out = reshard.load(template, path, group=group, stats=stats)
        return out["model"]["w"], stats

    for box, target, (loaded, stats) in zip(
        case.load_boxes, targets, on_group_threads(len(case.load_boxes), load_box), strict=True
    ):
        assert loaded is target  # filled in place
        assert loaded.shape == box.shape
        assert torch.equal(raw_bytes(loaded), raw_bytes(full[slices(box)])), f"box {box} differs"
        assert stats.bytes_needed == box.volume * itemsize
        assert stats.bytes_read >= stats.bytes_needed
        if stats.bytes_needed:
            assert stats.bytes_read / stats.bytes_needed <= DEFAULT_MAX_READ_AMPLIFICATION
            if case.load_cuts_only_axis_0:
                assert stats.bytes_read == stats.bytes_needed
        else:
            assert stats.bytes_read == 0

    # The replicated plain tensor, an object cell and the common value.
    cell = case.seed % n_ranks
    out = reshard.load(
        {
            "model": {"extra": torch.zeros(3)},
            "rng": reshard.ShardedObject("rng", None, (n_ranks,), (cell,)),
            "step": 0,
        },
        path,
    )
    assert torch.equal(raw_bytes(out["model"]["extra"]), raw_bytes(extra))
    assert out["rng"]["rank"] == cell
    assert torch.equal(out["rng"]["t"], torch.tensor([cell]))
    assert out["step"] == 17


def test_a_thread_group_of_one_saves_as_a_lone_process(tmp_path: Path) -> None:
    """A ThreadGroup of one rank and a lone process write the same layout."""
    full = random_global((5, 3), torch.bfloat16, 3)
    state = {"w": reshard.ShardedTensor("w", full.clone(), (5, 3), (0, 0)), "step": 1}
    real = reshard.save(state, tmp_path / "real", options=reshard.SaveOptions(checksum_chunk_bytes=8)).metadata
    assert real is not None  # a single process is the coordinator
    simulated = save_on_threads([state], tmp_path / "sim", 8)

    def layout(metadata: Metadata) -> dict[str, object]:
        return {k: v for k, v in metadata.to_json_dict().items() if k not in ("save_id", "files")}

    assert layout(real) == layout(simulated)
    assert [f.size for f in real.files] == [f.size for f in simulated.files]
    for name in ("real", "sim"):
        out = reshard.load({"w": torch.zeros(5, 3, dtype=torch.bfloat16)}, tmp_path / name)
        assert torch.equal(raw_bytes(out["w"]), raw_bytes(full))


def test_scalar_and_empty_tensors_round_trip(tmp_path: Path) -> None:
    """0-d tensors (one box, replicated) and tensors with a zero-length axis (nothing to store)."""
    scalar = random_global((), torch.float16, 5)
    state_dicts: list[dict[str, object]] = [
        {
            "s": reshard.ShardedTensor("s", scalar.clone(), (), (), replica_id=rank),
            "e": reshard.ShardedTensor("e", torch.zeros(0, 2, dtype=torch.int64), (0, 4), (0, 2 * rank)),
        }
        for rank in range(2)
    ]
    metadata = save_on_threads(state_dicts, tmp_path / "ckpt", 8)
    assert [b.shape for b in metadata.tensors["s"].boxes] == [()]
    assert metadata.tensors["e"].boxes == ()
    assert metadata.tensors["e"].global_shape == (0, 4)
    target = torch.zeros((), dtype=torch.float16)
    stats = reshard.LoadStats()
    out = reshard.load(
        {"s": reshard.ShardedTensor("s", target, (), ()), "e": torch.zeros(0, 4, dtype=torch.int64)},
        tmp_path / "ckpt",
        stats=stats,
    )
    assert out["s"] is target
    assert torch.equal(raw_bytes(target), raw_bytes(scalar))
    assert out["e"].shape == (0, 4)
    assert stats.bytes_needed == stats.bytes_read == 2
