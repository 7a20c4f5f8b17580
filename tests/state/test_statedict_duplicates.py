"""One rank's state dict holding one box of one key under two paths (issue 34, found attacking record buffers).

The same tensor reachable twice (tied weights, a shared parameter listed twice, the copies an asynchronous
snapshot makes of them) is one box, saved once. Two *different* tensors claiming the same box as primary were
kept silently, one of them at random: a load returned either. A save's flattening now refuses them with
ShardingError naming the key, the box and both paths; everything else that repeats a key stays allowed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import reshard
from reshard.state.statedict import flatten_state_dict

pytestmark = pytest.mark.unit

W = torch.arange(16.0).reshape(4, 4)


def _st(data: torch.Tensor, *rank_offsets: tuple[int, int, int], replica_id: int = 0) -> reshard.ShardedTensor:
    return reshard.ShardedTensor.from_rank_offsets("k", data, *rank_offsets, replica_id=replica_id)


def _refused(state: object, *words: str) -> None:
    with pytest.raises(reshard.ShardingError) as caught:
        flatten_state_dict(state, rank=0)
    for word in words:
        assert word in str(caught.value), str(caught.value)


def _kept(state: object) -> list[torch.Tensor]:
    return [t.data for t in flatten_state_dict(state, rank=0).tensors]


def test_two_different_tensors_of_one_box_are_refused_naming_key_box_and_paths() -> None:
    _refused(
        {"p": _st(torch.zeros(4)), "q": {"r": _st(torch.ones(4))}},
        "'k'",
        "offset [0] shape [4]",
        "'p'",
        "'q.r'",
    )
    # a plain tensor's key is its path: a ShardedTensor elsewhere claiming that key and box is the same defect
    _refused({"k": torch.zeros(4), "x": _st(torch.ones(4))}, "'k'", "'x'")


def test_only_the_differing_box_of_a_segmented_or_flat_range_shard_is_named() -> None:
    a = torch.zeros(4, 2)
    b = a.clone()
    b[3, 1] = 1.0  # the second segment differs
    seg = [(0, 2), (4, 2)]
    _refused(
        {
            "a": reshard.ShardedTensor.segmented("k", a, (8, 2), 0, seg),
            "b": reshard.ShardedTensor.segmented("k", b, (8, 2), 0, seg),
        },
        "offset [4, 0] shape [2, 2]",
        "'a'",
        "'b'",
    )
    flat = torch.arange(6.0)
    other = flat.clone()
    other[5] = -1.0

    def zero(data: torch.Tensor) -> reshard.ShardedTensor:
        return reshard.ShardedTensor.from_flat_range("k", data, (4, 4), (4, 4), (0, 0), 2, 8)

    _refused({"m": zero(flat), "n": zero(other)}, "'k'", "'m'", "'n'")


def test_two_replicas_of_one_box_that_differ_are_refused() -> None:
    """A rank holding only replicas of a box may be elected its writer: which of two different leaves it wrote
    would be undefined too."""
    _refused({"p": _st(torch.zeros(4), replica_id=1), "q": _st(torch.ones(4), replica_id=2)}, "'p'", "'q'")


def test_bytes_differing_in_nan_payload_or_sign_of_zero_are_different() -> None:
    _refused({"p": _st(torch.tensor([0.0])), "q": _st(torch.tensor([-0.0]))}, "'k'")
    nan = torch.tensor([float("nan")])
    assert len(_kept({"p": _st(nan), "q": _st(nan.clone())})) == 1  # NaN != NaN, but the bytes are equal


def test_a_conjugate_view_of_the_same_memory_is_a_different_tensor() -> None:
    z = torch.tensor([1 + 2j, 3 - 1j])
    _refused({"p": _st(z), "q": _st(z.conj())}, "'p'", "'q'")
    assert len(_kept({"p": _st(z.conj()), "q": _st(z.conj())})) == 1


def test_the_same_tensor_or_an_equal_copy_under_two_paths_is_kept_once() -> None:
    """Tied weights (one parameter under two paths, wrapped twice), a ShardedTensor listed twice, and the equal
    copies an asynchronous save's snapshot makes of a tied weight (one buffer per path)."""
    shared = _st(W)
    assert len(_kept({"embed": shared, "head": shared})) == 1
    kept = _kept({"embed": _st(W[0], (0, 0, 4)), "head": _st(W[0], (0, 0, 4))})
    assert len(kept) == 1 and kept[0].data_ptr() == W.data_ptr()
    assert len(_kept({"embed": _st(W), "head": _st(W.clone())})) == 1


def test_a_replica_that_differs_from_the_primary_on_the_same_rank_is_not_written() -> None:
    """The primary wins, whatever the order (as tests/flows/test_topologies.py's tied output layer): a
    replica's bytes are never chosen over a primary of the same rank."""
    for order in (1, -1):
        leaves = [("embed", _st(W)), ("head", _st(torch.zeros(4, 4), replica_id=1))][::order]
        kept = _kept(dict(leaves))
        assert len(kept) == 1 and kept[0] is W


def test_different_boxes_of_one_key_on_one_rank_are_all_kept() -> None:
    """A rank holding two slices of a stacked tensor (two experts, two layer chunks) describes two boxes."""
    kept = _kept({"e0": _st(W[0:1], (0, 0, 4)), "e2": _st(W[2:3], (0, 2, 4))})
    assert len(kept) == 2


def test_padding_past_the_logical_shape_is_not_compared() -> None:
    """Elements past ``logical_shape`` are never saved: two leaves that differ only there hold the same bytes."""
    a = torch.tensor([1.0, 2.0, 3.0, 0.0])
    b = torch.tensor([1.0, 2.0, 3.0, 9.0])
    padded = {
        path: reshard.ShardedTensor("k", data, (4,), (0,), logical_shape=(3,)) for path, data in (("p", a), ("q", b))
    }
    assert len(_kept(padded)) == 1


def test_a_scaled_tensor_listed_twice_is_kept_once_and_two_different_ones_are_refused() -> None:
    data = torch.zeros(32, 32).to(torch.float8_e4m3fn)
    scaled = reshard.ScaledTensor(_st(data), torch.ones(1, 1), "fp8_e4m3", (32, 32))
    flat = flatten_state_dict({"a": scaled, "b": scaled}, rank=0)
    assert len(flat.tensors) == 2  # the data and its scales, once
    other = reshard.ScaledTensor(_st(data), torch.full((1, 1), 2.0), "fp8_e4m3", (32, 32))
    _refused({"a": scaled, "b": other}, "'k:scale'", "'a'", "'b'")


def test_object_cells_held_twice_must_hold_the_same_value() -> None:
    def obj(value: object, replica_id: int = 0) -> reshard.ShardedObject:
        return reshard.ShardedObject("rng", value, (2,), (1,), replica_id)

    state = {"seed": 7, "tensor": torch.arange(3)}
    assert len(flatten_state_dict({"a": obj(state), "b": obj(state)}, rank=0).objects) == 1
    assert (
        len(flatten_state_dict({"a": obj(state), "b": obj({"seed": 7, "tensor": torch.arange(3)})}, rank=0).objects)
        == 1
    )
    with pytest.raises(reshard.ShardingError, match=r"'rng'.*cell \[1\].*'a'.*'b'"):
        flatten_state_dict({"a": obj(state), "b": obj({"seed": 8})}, rank=0)
    assert flatten_state_dict({"a": obj(state), "b": obj({"seed": 8}, 1)}, rank=0).objects[0].value is state


def test_a_load_template_keeps_every_leaf_of_a_repeated_box() -> None:
    """A load fills every leaf (each gets the checkpoint's bytes): a repeated box there is no conflict."""
    flat = flatten_state_dict({"p": _st(torch.zeros(4)), "q": _st(torch.ones(4))}, rank=0, dedup=False)
    assert len(flat.tensors) == 2


def test_a_load_fills_every_leaf_of_one_key_whose_boxes_overlap(tmp_path: Path) -> None:
    """Through reshard.load: the whole of ``k`` and an overlapping box of it, in one template, both get the bytes."""
    reshard.save({"k": torch.arange(8.0)}, tmp_path / "ckpt")
    whole, middle = torch.zeros(8), torch.zeros(4)
    template = {"a": _st(whole), "b": reshard.ShardedTensor("k", middle, (8,), (2,))}
    reshard.load(template, tmp_path / "ckpt")
    assert torch.equal(whole, torch.arange(8.0)) and torch.equal(middle, torch.arange(2.0, 6.0))
