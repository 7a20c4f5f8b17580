"""Tensors whose storage holds fewer bytes than their elements span (a storage resized to 0, as FSDP frees
unsharded parameters, or a view past the end of a shrunk storage): a save would read, and a load would write,
out of bounds (garbage in the checkpoint, or a crash). Each is refused with StateDictError on every rank,
before a byte is read or written, as transfer refuses them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads

pytestmark = pytest.mark.unit


def _freed(rows: int) -> torch.Tensor:
    tensor = torch.ones(rows, 4)
    tensor.untyped_storage().resize_(0)
    return tensor


def _outcomes(ranks: int, run: object) -> list[str]:
    """Each rank's error class and message, or "ok"."""

    def one(rank: int) -> str:
        try:
            run(rank, group.member(rank))  # type: ignore[operator]
        except reshard.CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "ok"

    group = ThreadGroup(ranks)
    return on_threads(ranks, one)


def test_a_save_of_a_freed_tensor_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    reshard.save({"w": torch.arange(8.0).view(2, 4)}, tmp_path / "ckpt")
    before = (tmp_path / "ckpt" / "metadata.json").read_bytes()

    def run(rank: int, group: object) -> None:
        data = _freed(1) if rank == 1 else torch.full((1, 4), 5.0)
        state = {"w": reshard.ShardedTensor.from_rank_offsets("w", data, (0, rank, 2))}
        reshard.save(state, tmp_path / "ckpt", group=group, overwrite=True, timeout=20)

    outcomes = _outcomes(2, run)
    assert all(o.startswith("StateDictError") for o in outcomes), outcomes
    assert all("'w'" in o and "less storage than their elements span" in o and "rank 1" in o for o in outcomes)
    assert (tmp_path / "ckpt" / "metadata.json").read_bytes() == before  # nothing committed over the old one


@pytest.mark.parametrize("how", ["freed", "shrunk view"])
def test_a_load_into_a_freed_template_is_refused_before_any_write(tmp_path: Path, how: str) -> None:
    reshard.save({"w": torch.arange(8.0).view(2, 4)}, tmp_path / "ckpt")
    if how == "freed":
        template = _freed(2)
    else:
        base = torch.zeros(16)
        template = base[8:].view(2, 4)
        base.untyped_storage().resize_(8 * base.element_size())  # the view now reaches past the storage
    with pytest.raises(reshard.StateDictError, match=r"less storage than their elements span.*'w'"):
        reshard.load({"w": template}, tmp_path / "ckpt")
