"""Walking nested state dicts: flatten to dotted paths, and rebuild the same structure with new leaves.

Containers are dicts (string or int keys), lists and tuples (named tuples and ``torch.Size`` included).
Everything else is a leaf: :class:`~reshard.ShardedTensor`, :class:`~reshard.ShardedObject`, a
``torch.distributed.tensor.DTensor`` (described as the ShardedTensor of this rank's local tensor, keyed by
its path, see :mod:`reshard.state.dtensor`), a plain ``torch.Tensor`` (a full tensor, replicated on every rank)
or a *common* value (JSON-like scalars, and empty containers, saved once by the coordinator). A leaf's path
is its container keys joined with dots: ``optimizer.state.0.lr``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.errors import StateDictError
from reshard.geometry.boxes import strides_overlap
from reshard.state.dtensor import dtensor_to_sharded, is_dtensor
from reshard.state.dtypes import BYTE_VIEW_DTYPES
from reshard.state.duplicates import check_same_content, storage_holds
from reshard.state.scaled import ScaledRecord, ScaledTensor
from reshard.state.sharding import ShardedObject, ShardedTensor

__all__ = [
    "FlatStateDict",
    "check_tensors",
    "filter_state_dict",
    "flatten_state_dict",
    "is_empty_container",
    "map_leaves",
]

Leaf = Any
PathKey = str | int


def is_empty_container(obj: object) -> bool:
    """Whether ``obj`` is an empty dict, list or tuple: below the root, a leaf of its own (a common value), so
    that a save keeps it (``moe_layers: []`` would otherwise vanish from the checkpoint)."""
    return isinstance(obj, dict | list | tuple) and not obj


def _walk(obj: object, path: tuple[PathKey, ...], visit: Callable[[str, Leaf], Leaf]) -> object:
    if path and is_empty_container(obj):
        return visit(_dotted(path), obj)
    if isinstance(obj, dict):
        out: dict[Any, object] = {}
        for key, value in obj.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                raise StateDictError(
                    f"{_dotted(path) or '<root>'}: dict keys must be str or int, got {type(key).__name__}"
                )
            out[key] = _walk(value, (*path, key), visit)
        return out
    if isinstance(obj, list):
        return [_walk(v, (*path, i), visit) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_walk(v, (*path, i), visit) for i, v in enumerate(obj)]
        cls: Any = type(obj)
        if hasattr(obj, "_fields"):  # a named tuple
            return cls(*items)
        return cls(items)
    return visit(_dotted(path), obj)


def _dotted(path: tuple[PathKey, ...]) -> str:
    return ".".join(str(p) for p in path)


def map_leaves(state_dict: object, fn: Callable[[str, Leaf], Leaf]) -> object:
    """Return a copy of ``state_dict``'s containers with every leaf replaced by ``fn(path, leaf)``."""
    return _walk(state_dict, (), fn)


_DROPPED = object()


def filter_state_dict(state_dict: object, keep: Callable[[str, Leaf], bool]) -> Any:
    """The part of ``state_dict`` whose leaves satisfy ``keep(path, leaf)``, in the same structure.

    Dicts keep only the entries that hold a kept leaf somewhere below; a dict that keeps nothing is
    left out of its parent (the root stays, possibly empty). Lists and tuples are kept whole or not at
    all, so that indices keep their meaning. Leaves are not copied.

    Use it to save or load part of a training state, e.g. only the LoRA adapters::

        adapters = reshard.filter_state_dict(sd, lambda path, leaf: ".lora_" in path)
    """

    def walk(obj: object, path: tuple[PathKey, ...]) -> object:
        if isinstance(obj, dict):
            kept = {k: walk(v, (*path, k)) for k, v in obj.items()}
            kept = {k: v for k, v in kept.items() if v is not _DROPPED}
            return kept if kept or not path else _DROPPED
        if isinstance(obj, list | tuple):
            items = [walk(v, (*path, i)) for i, v in enumerate(obj)]
            return obj if any(item is not _DROPPED for item in items) else _DROPPED
        return obj if keep(_dotted(path), obj) else _DROPPED

    if not isinstance(state_dict, dict):
        raise StateDictError(f"filter_state_dict needs a dict, got {type(state_dict).__name__}")
    return walk(state_dict, ())


@dataclass
class FlatStateDict:
    """The leaves of one rank's state dict, sorted by kind.

    Plain tensors are described as ShardedTensors that cover their whole global tensor, keyed by their
    path, with this rank's rank as ``replica_id`` (so the group's rank 0 holds the primary copy).
    """

    tensors: list[ShardedTensor] = field(default_factory=list)
    objects: list[ShardedObject] = field(default_factory=list)
    common: dict[str, object] = field(default_factory=dict)
    """Common values by dotted path."""
    scaled: dict[str, ScaledRecord] = field(default_factory=dict)
    """The record of each :class:`~reshard.ScaledTensor`, by its data's key (its parts are in ``tensors``)."""


def flatten_state_dict(state_dict: object, *, rank: int, dedup: bool = True) -> FlatStateDict:
    """Sort the leaves of ``state_dict`` into tensors, objects and common values.

    With ``dedup`` (for saving), leaves that repeat a key with the same box (tied weights) are kept once;
    a load keeps them all, so that every one of them is filled.

    Raises:
        StateDictError: two leaves share a path.
        ShardingError: with ``dedup``, two leaves describe the same box of a key with different bytes (see
            :func:`_dedup`), naming the key, the box and both paths.
    """
    flat = FlatStateDict()
    seen_paths: set[str] = set()
    scaled_parts: list[ShardedTensor] = []
    tensor_paths: list[str] = []  # the path of each entry of flat.tensors, then of scaled_parts
    scaled_paths: list[str] = []
    object_paths: list[str] = []

    def visit(path: str, leaf: Leaf) -> Leaf:
        if path in seen_paths:
            raise StateDictError(f"two entries of the state dict flatten to the same path {path!r}")
        seen_paths.add(path)
        if isinstance(leaf, ScaledTensor):
            parts = _add_scaled(flat, leaf)
            scaled_parts.extend(parts)
            scaled_paths.extend([path] * len(parts))
        elif isinstance(leaf, ShardedTensor):
            flat.tensors.append(leaf)
            tensor_paths.append(path)
        elif isinstance(leaf, ShardedObject):
            flat.objects.append(leaf)
            object_paths.append(path)
        elif is_dtensor(leaf):
            if not path:
                raise StateDictError("a DTensor needs a key: put it in a dict")
            described = dtensor_to_sharded(path, leaf)
            if described is not None:  # None: this rank is not in the DTensor's mesh and holds none of it
                flat.tensors.append(described)
                tensor_paths.append(path)
        elif isinstance(leaf, torch.Tensor):
            if not path:
                raise StateDictError("a plain tensor needs a key: put it in a dict")
            _refuse_quantized_subclass(path, leaf)
            flat.tensors.append(ShardedTensor(path, leaf, tuple(leaf.shape), (0,) * leaf.ndim, replica_id=rank))
            tensor_paths.append(path)
        else:
            if not path:
                raise StateDictError("the state dict must be a dict or list, not a single value")
            flat.common[path] = leaf
        return leaf

    map_leaves(state_dict, visit)
    _check_scaled_keys(flat)
    flat.tensors.extend(scaled_parts)
    if dedup:
        flat.tensors = _dedup(flat.tensors, [*tensor_paths, *scaled_paths])
        flat.objects = _dedup(flat.objects, object_paths)
    return flat


TORCHAO_SCALED_CLASSES = ("Float8Tensor", "MXTensor", "NVFP4Tensor")
"""The torchao low-precision tensor subclasses reshard knows (:mod:`reshard.interop.torchao` describes them)."""


def torchao_class(value: object) -> str | None:
    """The name of ``value``'s torchao low-precision class (:data:`TORCHAO_SCALED_CLASSES`), or None; judged by
    class name and module, importing nothing (None at once where torchao was never imported)."""
    if not isinstance(value, torch.Tensor) or "torchao" not in sys.modules:
        return None
    for cls in type(value).__mro__:
        if cls.__name__ in TORCHAO_SCALED_CLASSES and cls.__module__.startswith("torchao."):
            return cls.__name__
    return None


def _refuse_quantized_subclass(path: str, leaf: torch.Tensor) -> None:
    """Refuse a torchao low-precision tensor given as a plain tensor: its bytes are ``qdata`` and scales, not
    elements of its dtype, and only :func:`reshard.interop.torchao.torchao_state` says which."""
    name = torchao_class(leaf)
    if name is not None:
        raise StateDictError(
            f"{path!r} is a torchao {name}: save and load it inside "
            "reshard.interop.torchao.torchao_state(state_dict), which describes its data and scales"
        )


def _add_scaled(flat: FlatStateDict, leaf: ScaledTensor) -> list[ShardedTensor]:
    """Add a scaled tensor's record and return its parts; the same key described twice (several pieces of one
    tensor on a rank) must agree on its record."""
    record = leaf.record
    known = flat.scaled.setdefault(record.key, record)
    if known != record:
        raise StateDictError(f"{record.key!r} is described twice: {known.describe()} and {record.describe()}")
    return leaf.parts()


def _check_scaled_keys(flat: FlatStateDict) -> None:
    """Refuse tensors (``flat.tensors``, before the scaled tensors' parts join them) of byte-only dtypes, and
    those whose keys are a scaled tensor's data or scale keys."""
    for tensor in flat.tensors:
        if tensor.data.dtype in BYTE_VIEW_DTYPES:
            raise StateDictError(
                f"tensor {tensor.key!r} of dtype {tensor.data.dtype} can be saved and loaded only as the data or "
                "scales of a reshard.ScaledTensor (which records its format)"
            )
    parts = {k for r in flat.scaled.values() for k in r.part_keys}
    clash = sorted({t.key for t in flat.tensors} & parts)
    if clash:
        raise StateDictError(
            f"{clash[:10]}: these keys are both a ScaledTensor's data or scales and another entry of the state dict"
        )


def _layout_signature(item: ShardedTensor | ShardedObject) -> tuple[object, ...]:
    if isinstance(item, ShardedObject):
        return (item.key, item.global_shape, item.global_offset)
    return (
        item.key,
        item.global_shape,
        item.global_offset,
        item.logical_shape,
        item.segment_axis,
        item.segments,
        item.flat_range,
        item.local_shape,
        tuple(item.data.shape),
        item.data.dtype,
    )


def _dedup(items: list[Any], paths: list[str]) -> list[Any]:
    """Keep one of several leaves that describe exactly the same part of the same key (tied weights); ``paths``
    are the leaves' state-dict paths, in the same order.

    Leaves that share a key but describe different parts (several experts or layer chunks of a stacked
    tensor on one rank) are all kept; the save planner checks that they do not overlap. Of leaves that describe
    the same part, the primary copy is kept whatever their order; the leaves it could have been (the other
    primaries, or every leaf where none is primary: a rank holding only replicas may be elected to write the box)
    must hold the same bytes (:func:`reshard.state.duplicates.check_same_content`), else which one is saved
    would be undefined: silent wrong bytes.

    Raises:
        ShardingError: two such leaves hold different bytes, naming the key, the box and both paths.
    """
    kept: dict[tuple[object, ...], int] = {}
    out: list[Any] = []
    groups: list[list[int]] = []
    for position, item in enumerate(items):
        signature = _layout_signature(item)
        index = kept.get(signature)
        if index is None:
            kept[signature] = len(out)
            out.append(item)
            groups.append([position])
            continue
        groups[index].append(position)
        if item.is_main_replica and not out[index].is_main_replica:
            out[index] = item  # the primary copy wins, whatever the order of the leaves
    for members in groups:
        if len(members) > 1:
            check_same_content([(paths[m], items[m]) for m in members])
    return out


def check_tensors(tensors: Sequence[ShardedTensor], *, what: str, fill: bool) -> None:
    """Raise StateDictError naming the ``tensors`` whose memory reshard cannot read (``fill`` False: a save, a
    transfer's sources) or fill (a load's template, a transfer's targets): on the meta device (no memory), not
    dense (sparse, nested), with less storage than their elements span (a storage resized to 0, as FSDP frees
    unsharded parameters: reading or writing it would go out of bounds), or, to fill, with elements that share
    memory (an expanded view: which value would it hold?). ``what`` starts the message ("save", "load: template",
    "transfer: target"). Each rank checks its own tensors inside an agreed step, so that every rank raises the
    same error before any byte is read or written."""
    meta = [t for t in tensors if t.data.device.type == "meta"]
    other = [t for t in tensors if t.data.device.type != "meta" and t.data.layout != torch.strided]
    dense = [t for t in tensors if t.data.device.type != "meta" and t.data.layout == torch.strided]
    causes = [
        (meta, "are on the meta device, which holds no data", "materialise them first (module.to_empty(device=...))"),
        (other, "are not dense tensors (sparse, nested...)", "pass their dense form"),
        (
            [t for t in dense if not storage_holds(t.data)],
            "have less storage than their elements span",
            "a freed storage (resized to 0) must be allocated again first",
        ),
    ]
    if fill:
        causes.append(
            (
                [t for t in dense if strides_overlap(tuple(t.data.shape), tuple(t.data.stride()))],
                "are views whose elements overlap in memory (an expanded tensor), which cannot hold a value each",
                "use a tensor of their own",
            )
        )
    problems = [
        f"{len(bad)} tensors {why}: {', '.join(repr(t.key) for t in bad[:10])}{' ...' if len(bad) > 10 else ''}; {hint}"
        for bad, why, hint in causes
        if bad
    ]
    if problems:
        raise StateDictError(f"{what}: {'; '.join(problems)}")
