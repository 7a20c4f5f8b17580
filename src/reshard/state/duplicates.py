"""Leaves of one rank's state dict that describe the same box of one key: the same bytes, or an error.

A tied weight (one parameter under two paths), a ShardedTensor listed twice, or the equal copies an asynchronous
save's snapshot makes of them describe one box: a save keeps one leaf. Two leaves holding *different* bytes for
the same box leave undefined which of them the checkpoint holds (issue 34): silent wrong bytes. This module says
which, by memory first (the same view, nothing read) and by bytes otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reshard.errors import ShardingError
from reshard.state.codec import encode_object_blob
from reshard.state.sharding import ShardedObject, ShardedTensor

__all__ = ["check_same_content", "same_bytes", "storage_holds"]


def storage_holds(data: torch.Tensor) -> bool:
    """Whether ``data``'s storage holds every element its offset, shape and strides reach."""
    if data.numel() == 0:
        return True
    reach = data.storage_offset() + sum((n - 1) * s for n, s in zip(data.shape, data.stride(), strict=True))
    return (reach + 1) * data.element_size() <= data.untyped_storage().nbytes()


def _readable(data: torch.Tensor) -> bool:
    """Whether ``data``'s memory can be read: a save refuses the others (``check_tensors``) before any byte is read,
    so they are not compared here."""
    return data.device.type != "meta" and data.layout == torch.strided and storage_holds(data)


def _flat_bytes(data: torch.Tensor) -> torch.Tensor:
    """``data``'s values as a flat uint8 tensor: what a save writes (conjugate and negative views resolved)."""
    resolved = data.detach().resolve_conj().resolve_neg().reshape(-1).contiguous()
    return resolved.view(torch.uint8)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether views ``a`` and ``b`` (of one shape and dtype) hold the same bytes: the same memory seen the same way,
    else compared element by element as bytes (NaN payloads and the sign of zero count; NaN equals itself).
    Tensors whose memory cannot be read count as the same (a save refuses them anyway)."""
    if a.numel() == 0 or not (_readable(a) and _readable(b)):
        return True
    if (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
        and (a.is_conj(), a.is_neg()) == (b.is_conj(), b.is_neg())
    ):
        return True
    return torch.equal(_flat_bytes(a), _flat_bytes(b.to(a.device)))


def _tensor_conflict(first: ShardedTensor, other: ShardedTensor) -> str | None:
    """The first box (in global coordinates) where two leaves of the same layout hold different bytes, or None."""
    for mine, theirs in zip(first.pieces(), other.pieces(), strict=True):
        if not same_bytes(mine.view, theirs.view):
            return f"box offset {list(mine.box.offset)} shape {list(mine.box.shape)}"
    return None


def _object_conflict(first: ShardedObject, other: ShardedObject, paths: tuple[str, str]) -> str | None:
    if first.value is other.value:
        return None
    blobs = [
        encode_object_blob(o.value, where=f"object {o.key!r} at {p!r}")
        for o, p in zip((first, other), paths, strict=True)
    ]
    return None if blobs[0] == blobs[1] else f"cell {list(first.global_offset)}"


def check_same_content(leaves: Sequence[tuple[str, ShardedTensor | ShardedObject]]) -> None:
    """Check leaves (``(path, leaf)``, two or more) that describe the same part of one key on one rank: those a save
    could write from (the primaries; every leaf where none is primary, since a rank holding only replicas may be
    elected to write the box) must hold the same bytes. A replica that differs from a primary of the same rank is
    left alone: the primary is what the save writes.

    Raises:
        ShardingError: two of them differ, naming the key, the box (or object cell) and both paths.
    """
    primaries = [(path, leaf) for path, leaf in leaves if leaf.is_main_replica]
    candidates = primaries or list(leaves)
    first_path, first = candidates[0]
    for path, other in candidates[1:]:
        if isinstance(first, ShardedTensor) and isinstance(other, ShardedTensor):
            where = _tensor_conflict(first, other)
        elif isinstance(first, ShardedObject) and isinstance(other, ShardedObject):
            where = _object_conflict(first, other, (first_path, path))
        else:  # pragma: no cover - tensors and objects are never grouped together
            raise TypeError("a tensor and an object cannot describe the same part of a key")
        if where is not None:
            kind = "tensors" if isinstance(first, ShardedTensor) else "values"
            raise ShardingError(
                f"{first.key!r}: {where} is held by two different {kind} of this rank's state dict, at "
                f"{first_path!r} and {path!r}; which of them to save is undefined. Put one tensor under both paths "
                "(tied weights), give one a non-zero replica_id if it is a copy, or give them different keys"
            )
