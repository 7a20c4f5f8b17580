"""DTensor leaves: a ``torch.distributed.tensor.DTensor`` described as the :class:`~reshard.ShardedTensor`
of this rank's local tensor.

A DTensor knows its global shape, its device mesh and one placement per mesh dimension. ``Shard(d)`` cuts
tensor axis ``d`` over that mesh dimension with ``torch.chunk`` semantics (the last coordinates may get
fewer or zero rows); ``Replicate()`` copies the tensor along it; ``Partial()`` means every rank holds a
summand of the values, which cannot be saved as is. Several ``Shard`` placements of the same axis nest
left to right (mesh dimension 0 cuts first), unless the spec carries another shard order.
``_StridedShard(d, split_factor=k)`` (FSDP2 on top of tensor parallelism) first cuts the current range into
``k`` chunks, cuts each of them over the mesh dimension and concatenates this coordinate's pieces.

:func:`local_index_runs` follows those rules for one mesh coordinate, with reshard's own arithmetic (no
collective, no torch internals): per tensor axis, the global index ranges this coordinate's local tensor
holds, in local order. One range per axis is a plain box; several ranges on one axis (a strided shard whose
rows are not contiguous) are a segmented shard; several ranges on two axes cannot be described and raise
:class:`~reshard.ShardingError`.

The replica id is the coordinate on the mesh dimensions whose placement is ``Replicate()``: the ranks at
coordinate 0 on all of them hold the primary copy, which is the one written. The mesh coordinates say
nothing about the process group of a save, so every rank of the group must hold the primary copy of its
boxes or a replica of a box some rank of the group holds as primary; the default group (or any group
holding every rank of every DTensor's mesh) always does.

Nothing here imports ``torch.distributed.tensor`` at module import time: a state dict can hold a DTensor
only once that module has been imported by its creator.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from reshard.errors import ShardingError
from reshard.state.sharding import ReplicaId, ShardedTensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["IndexRuns", "dtensor_to_sharded", "is_dtensor", "local_index_runs"]

IndexRuns = tuple[tuple[int, int], ...]
"""The ``(global_start, length)`` ranges of one tensor axis that a local tensor holds, in local order."""


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (without importing that module). While another
    thread is still importing it, the module is in ``sys.modules`` without its class: no DTensor exists yet."""
    dtensor_class = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor_class is not None and isinstance(value, dtensor_class)


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``length`` positions are cut into ``parts`` with
    ``torch.chunk`` semantics: chunks of ``ceil(length / parts)``, the last ones shorter or empty."""
    size = -(-length // parts)
    return min(index * size, length), min((index + 1) * size, length)


def _take(runs: IndexRuns, start: int, stop: int) -> list[tuple[int, int]]:
    """The global ranges of local positions ``[start, stop)`` of ``runs``."""
    out = []
    position = 0
    for first, length in runs:
        lo, hi = max(start, position), min(stop, position + length)
        if lo < hi:
            out.append((first + lo - position, hi - lo))
        position += length
    return out


def _merge(runs: list[tuple[int, int]]) -> IndexRuns:
    """``runs`` without empty ranges, with each range that continues the previous one merged into it."""
    out: list[tuple[int, int]] = []
    for first, length in runs:
        if not length:
            continue
        if out and out[-1][0] + out[-1][1] == first:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((first, length))
    return tuple(out)


def local_index_runs(
    key: str,
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[object],
    shard_order: Sequence[tuple[int, Sequence[int]]] | None = None,
) -> tuple[IndexRuns, ...]:
    """Per tensor axis, the global index ranges held at mesh ``coordinate`` by a DTensor of
    ``global_shape`` with ``placements`` on a mesh of ``mesh_shape``. Pure; see the module doc.

    Args:
        key: the tensor's key, for error messages.
        global_shape: the DTensor's global shape, in elements.
        mesh_shape, coordinate: the device mesh's shape and this rank's coordinate in it.
        placements: one ``Shard``, ``_StridedShard`` or ``Replicate`` per mesh dimension.
        shard_order: ``(tensor_axis, mesh_dims)`` pairs when a DTensor spec orders the shardings of an axis
            otherwise than left to right (no ``_StridedShard`` then); None: left to right.

    Raises:
        ShardingError: naming the key, for a ``Partial`` placement or one reshard does not know, or
            placements that do not fit the mesh or the tensor.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if len(placements) != len(mesh_shape) or len(coordinate) != len(mesh_shape):
        raise ShardingError(
            f"{key!r}: {len(placements)} placements and coordinate {list(coordinate)} for a mesh of shape "
            f"{list(mesh_shape)}"
        )
    order: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Partial):
            raise ShardingError(
                f"{key!r}: a DTensor with a Partial placement ({placement}) holds partial values that must be "
                "reduced first: redistribute it to Replicate() or Shard() placements before saving or loading"
            )
        if isinstance(placement, Shard | _StridedShard):
            if not 0 <= placement.dim < len(global_shape):
                raise ShardingError(f"{key!r}: {placement} on a {len(global_shape)}-d tensor")
            order.setdefault(placement.dim, []).append(mesh_dim)
        elif not isinstance(placement, Replicate):
            raise ShardingError(f"{key!r}: DTensor placement {placement!r} is not supported")
    if shard_order is not None:
        if any(isinstance(p, _StridedShard) for p in placements):
            raise ShardingError(f"{key!r}: a DTensor with both a shard order and _StridedShard is not supported")
        given = {axis: list(dims) for axis, dims in shard_order}
        if {axis: sorted(dims) for axis, dims in given.items()} != order:
            raise ShardingError(f"{key!r}: shard order {given} does not match placements {list(placements)}")
        order = given
    runs: list[IndexRuns] = [_merge([(0, n)]) for n in global_shape]
    for axis, mesh_dims in order.items():
        for mesh_dim in mesh_dims:
            placement = placements[mesh_dim]
            parts, index = mesh_shape[mesh_dim], coordinate[mesh_dim]
            length = sum(n for _, n in runs[axis])
            if isinstance(placement, _StridedShard):
                pieces: list[tuple[int, int]] = []
                split_factor = int(placement.split_factor)
                for split in range(split_factor):
                    lo, hi = _chunk(length, split_factor, split)
                    start, stop = _chunk(hi - lo, parts, index)
                    pieces.extend(_take(runs[axis], lo + start, lo + stop))
                runs[axis] = _merge(pieces)
            else:
                runs[axis] = _merge(_take(runs[axis], *_chunk(length, parts, index)))
    return tuple(runs)


def _replica_id(placements: Sequence[object], coordinate: Sequence[int]) -> ReplicaId:
    """The coordinates on the ``Replicate()`` mesh dimensions (0 when there is none)."""
    from torch.distributed.tensor import Replicate

    replicas = tuple(c for c, p in zip(coordinate, placements, strict=True) if isinstance(p, Replicate))
    return replicas if replicas else 0


def _shard_order(dtensor: DTensor) -> list[tuple[int, tuple[int, ...]]] | None:
    """The spec's shard order when it differs from left to right, else None."""
    spec = dtensor._spec
    if getattr(spec, "use_strided_shard_as_shard_order", True):
        return None
    entries = getattr(spec, "shard_order", None)
    if not entries:
        return None
    order = [(int(e.tensor_dim), tuple(int(d) for d in e.mesh_dims)) for e in entries]
    if all(list(dims) == sorted(dims) for _, dims in order):
        return None
    return order


def dtensor_to_sharded(key: str, dtensor: DTensor) -> ShardedTensor | None:
    """Describe this rank's part of ``dtensor`` as a ShardedTensor keyed ``key`` whose ``data`` shares
    memory with the DTensor's local tensor (so a load fills the DTensor in place). None when this rank
    is not in the DTensor's mesh (it holds nothing of it). Not collective.

    Raises:
        ShardingError: naming the key, for a ``Partial`` placement, a placement reshard does not know, a
            local tensor whose shape differs from the one its placements give, or a local tensor whose
            rows are not contiguous on more than one axis.
    """
    mesh = dtensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    placements = tuple(dtensor.placements)
    global_shape = tuple(int(n) for n in dtensor.shape)
    runs = local_index_runs(
        key, global_shape, tuple(mesh.shape), tuple(coordinate), placements, shard_order=_shard_order(dtensor)
    )
    with torch.no_grad():
        local = dtensor.to_local().detach()
    expected = tuple(sum(n for _, n in axis_runs) for axis_runs in runs)
    if tuple(local.shape) != expected:
        raise ShardingError(
            f"{key!r}: the DTensor's local tensor has shape {list(local.shape)}, but its placements {placements} "
            f"on mesh coordinate {list(coordinate)} give {list(expected)}"
        )
    replica_id = _replica_id(placements, coordinate)
    split = [axis for axis, axis_runs in enumerate(runs) if len(axis_runs) > 1]
    offset = tuple(axis_runs[0][0] if axis_runs else 0 for axis_runs in runs)
    if not split:
        return ShardedTensor(key, local, global_shape, offset, replica_id)
    if len(split) > 1:
        raise ShardingError(
            f"{key!r}: the DTensor's placements {placements} give this rank non-contiguous rows on axes {split}; "
            "reshard describes non-contiguous (strided) shards on one axis only"
        )
    axis = split[0]
    return ShardedTensor.segmented(
        key,
        local,
        global_shape,
        axis,
        runs[axis],
        replica_id,
        global_offset=tuple(0 if a == axis else o for a, o in enumerate(offset)),
    )
