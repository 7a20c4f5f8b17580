"""Deterministic global tensors and the ways ranks cut them, shared by the multi-process tests."""

from __future__ import annotations

import torch

from reshard import ShardedObject, ShardedTensor


def cuts(length: int, parts: int) -> list[tuple[int, int]]:
    """Split ``length`` into ``parts`` consecutive (start, size) pieces, as even as possible, larger
    pieces first (uneven when ``parts`` does not divide ``length``)."""
    base, extra = divmod(length, parts)
    out = []
    start = 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((start, size))
        start += size
    return out


def global_tensor(key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor whose every element is distinct and depends only on ``key`` and its index."""
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(key))
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=torch.int64).to(dtype)


def box_of(full: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]


def sharded(
    key: str, full: torch.Tensor, axis: int, rank: int, parts: int, *, replica_id: int = 0, blank: bool = False
) -> ShardedTensor:
    """Piece ``rank`` of ``parts`` of ``full`` along ``axis`` (uneven allowed). With ``blank`` the local
    tensor is zero-filled (a load target) instead of holding the data."""
    start, size = cuts(full.shape[axis], parts)[rank]
    offset = tuple(start if a == axis else 0 for a in range(full.ndim))
    shape = tuple(size if a == axis else full.shape[a] for a in range(full.ndim))
    local = box_of(full, offset, shape).clone()
    if blank:
        local = torch.zeros_like(local)
    return ShardedTensor(key, local, tuple(full.shape), offset, replica_id)


GLOBALS: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "layers.0.weight": ((8, 6), torch.float32),
    "embedding": ((10, 4), torch.bfloat16),
    "cube": ((3, 5, 4), torch.int64),
    "norm": ((6,), torch.float16),
    "scalar": ((), torch.float64),
    "dp_weight": ((4, 4), torch.float32),
}


def full(key: str) -> torch.Tensor:
    shape, dtype = GLOBALS[key]
    return global_tensor(key, shape, dtype)


def save_layout(rank: int, size: int) -> dict[str, object]:
    """A state dict of rank ``rank`` of ``size`` saving ranks: splits on different axes per tensor,
    replicated tensors, a plain tensor, TP x DP replicas, an object and common state."""
    tp = 2 if size % 2 == 0 else 1
    return {
        "model": {
            "layers.0.weight": sharded("layers.0.weight", full("layers.0.weight"), 0, rank, size),
            "embedding": sharded("embedding", full("embedding"), 1, rank, size),
            "cube": sharded("cube", full("cube"), 2, rank, size),
            "norm": ShardedTensor("norm", full("norm").clone(), (6,), (0,), replica_id=rank),
            "scalar": ShardedTensor("scalar", full("scalar").clone(), (), (), replica_id=(0, rank)),
            "dp_weight": sharded("dp_weight", full("dp_weight"), 0, rank % tp, tp, replica_id=rank // tp),
            "bias": global_tensor("bias", (5,), torch.float32),
        },
        "rng": ShardedObject(
            "rng", {"rank": rank, "state": torch.arange(3) + rank, "t": (rank, "x")}, (size,), (rank,)
        ),
        "step": 42,
        "config": {"lr": 0.1, "name": "gpt", "sizes": [1, 2], "nothing": None},
    }


def load_layout(rank: int, size: int, saved_size: int) -> dict[str, object]:
    """A blank template of rank ``rank`` of ``size`` loading ranks, cut on other axes than the save."""
    return {
        "model": {
            "layers.0.weight": sharded("layers.0.weight", full("layers.0.weight"), 1, rank, size, blank=True),
            "embedding": sharded("embedding", full("embedding"), 0, rank, size, blank=True),
            "cube": sharded("cube", full("cube"), 1, rank, size, blank=True),
            "norm": sharded("norm", full("norm"), 0, rank, size, blank=True),
            "scalar": ShardedTensor("scalar", torch.zeros((), dtype=torch.float64), (), ()),
            "dp_weight": sharded("dp_weight", full("dp_weight"), 1, rank, size, blank=True),
            "bias": torch.zeros(5),
        },
        "rng": ShardedObject("rng", None, (saved_size,), (rank % saved_size,)),
        "step": 0,
        "config": {"lr": 0.0, "name": "", "sizes": [0, 0], "nothing": 1},
    }


def check_loaded(result: dict[str, object], template: dict[str, object], rank: int, saved_size: int) -> None:
    """Assert that ``result`` (returned by load of ``template``) holds exactly the saved values."""
    model = result["model"]
    assert isinstance(model, dict)
    template_model = template["model"]
    assert isinstance(template_model, dict)
    for key in GLOBALS:
        target = template_model[key]
        assert isinstance(target, ShardedTensor)
        expected = box_of(full(key), target.global_offset, tuple(target.data.shape))
        assert model[key] is target.data, key
        assert torch.equal(
            model[key].view(-1).view(torch.uint8), expected.contiguous().reshape(-1).view(torch.uint8)
        ), key
    assert torch.equal(model["bias"], global_tensor("bias", (5,), torch.float32))
    rng = result["rng"]
    assert isinstance(rng, dict)
    cell = rank % saved_size
    assert rng["rank"] == cell
    assert rng["t"] == (cell, "x")
    assert torch.equal(rng["state"], torch.arange(3) + cell)
    assert result["step"] == 42
    assert result["config"] == {"lr": 0.1, "name": "gpt", "sizes": [1, 2], "nothing": None}
