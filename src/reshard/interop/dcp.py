"""``reshard import-dcp``: a ``torch.distributed.checkpoint`` (DCP) directory as a reshard checkpoint.

DCP keeps its metadata (``.metadata``) as a **pickle**: reading it can execute code from the file, so
:func:`import_dcp` refuses to start unless the caller says it trusts the source (``trust_pickle=True``,
``--trust-pickle``). Only DCP's own reader touches it; reshard's output is pickle-free.

Tensors (DCP ``TensorStorageMetadata``) are converted one at a time: each is loaded whole by DCP in this
process (``no_dist``, whatever layout saved it) and streamed into the new checkpoint, so memory holds one
tensor at a time. Keys are DCP's flattened names (``model.layers.0.weight``), which are also the keys
reshard gives the same nested state dict.

Non-tensor values (DCP ``BytesStorageMetadata``, each a ``torch.save`` stream) are opened with
``torch.load(weights_only=True)``, which builds only plain data and tensors. A value made of JSON-like
scalars, bytes, tensors, dicts, lists and tuples is stored the way :func:`reshard.save` stores that
value in a state dict: scalars and bytes as common values at their dotted paths, tensors as tensors
keyed by their dotted paths. Any other value (an arbitrary object, a set, an ``io.BytesIO``) is left
out with a warning, or, with ``strict``, makes the import fail.

A **Megatron-Core** ``torch_dist`` checkpoint (a DCP directory with Megatron's ``metadata.json`` and
``common.pt`` beside it) is converted completely, into what :mod:`reshard.interop.megatron`'s direct route writes:
its ShardedTensors under Megatron's keys; each ShardedObject cell (stored by Megatron under its unique key
``<key>/shard_<offset>_<grid>``) as a cell of reshard ShardedObject ``<key>``; and ``common.pt`` (read with
``torch.load(weights_only=True)``, ``argparse.Namespace`` allowed and stored as a dict, for Megatron-LM's
``args``) as the ShardedObject :data:`MEGATRON_COMMON_KEY`, so that
``from_reshard(reshard.load(to_reshard(template), ckpt), template)`` loads it on any layout. Entries of
``common.pt`` that cannot be stored are left out by name, never silently.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.metadata import Metadata as DcpMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from reshard.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StateDictError,
)
from reshard.flows.progress import Progress, reporting
from reshard.interop.offline import CheckpointWriter
from reshard.metadata import Metadata
from reshard.state.codec import encode_object_blob
from reshard.state.dtypes import DTYPE_BY_NAME, dtype_name
from reshard.storage import CheckpointLocation

__all__ = ["MEGATRON_COMMON_KEY", "ImportResult", "import_dcp"]

MEGATRON_COMMON_KEY = "megatron.common"
"""The ShardedObject (grid ``(1,)``) that holds a Megatron checkpoint's common state (its ``common.pt``)."""

_MEGATRON_OBJECT = re.compile(r"^(?P<key>.+)/shard_(?P<offset>[0-9]+(?:\.[0-9]+)*)_(?P<grid>[0-9]+(?:\.[0-9]+)*)$")

_PICKLE_WARNING = (
    "a torch.distributed.checkpoint directory keeps its metadata as a pickle, and loading it can execute "
    "code from the file"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportResult:
    """What an import wrote: the committed checkpoint's metadata, and the DCP values left out (each with
    the reason)."""

    metadata: Metadata
    left_out: dict[str, str]


def _flatten_value(value: object, path: str, out: dict[str, object]) -> str | None:
    """Flatten a plain value into ``out`` (dotted path -> scalar, bytes or tensor), as reshard flattens a
    state dict; the reason it cannot be stored, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int) or isinstance(key, bool):
                return f"a dict key of type {type(key).__name__} at {path!r}"
            problem = _flatten_value(item, f"{path}.{key}", out)
            if problem:
                return problem
        return None
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            problem = _flatten_value(item, f"{path}.{index}", out)
            if problem:
                return problem
        return None
    if isinstance(value, torch.Tensor):
        if value.dtype not in DTYPE_BY_NAME.values():
            return f"a tensor of dtype {value.dtype} at {path!r}"
        out[path] = value
        return None
    if value is None or isinstance(value, bool | int | float | str | bytes):
        out[path] = value
        return None
    return f"a value of type {type(value).__name__} at {path!r}"


def import_dcp(
    src: str | os.PathLike[str],
    dst: CheckpointLocation,
    *,
    trust_pickle: bool = False,
    strict: bool = False,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> ImportResult:
    """Convert the DCP checkpoint directory ``src`` into a reshard checkpoint at ``dst``. Not collective:
    run it from one process.

    Args:
        src: a local directory written by ``torch.distributed.checkpoint.save``.
        dst: where to write the reshard checkpoint (directory, URL or Storage).
        trust_pickle: must be True: DCP's ``.metadata`` is a pickle, and unpickling an untrusted file can
            run arbitrary code. Pass it only for checkpoints from a source you trust.
        strict: fail on a non-tensor value that cannot be stored (default: leave it out, with a warning).
        overwrite: replace a complete checkpoint at ``dst``.
        storage_options: for an object-store ``dst``.
        progress: told the bytes of tensor data converted.

    Returns:
        The new checkpoint's metadata and the values left out.

    Raises:
        CheckpointError: ``trust_pickle`` is off; or ``src`` is not a readable DCP checkpoint.
        CheckpointNotFoundError: ``src`` has no ``.metadata``.
        StateDictError: a tensor of a dtype reshard cannot store, a name clash, or (with ``strict``) a value
            that cannot be stored.
        CheckpointExistsError, StorageError: as for :func:`reshard.save`; nothing is committed.
    """
    if not trust_pickle:
        raise CheckpointError(
            f"refusing to read {os.fspath(src)}: {_PICKLE_WARNING}; pass trust_pickle=True (--trust-pickle) "
            "only for a checkpoint from a source you trust"
        )
    reader = _MetadataOnceReader(os.fspath(src))
    tensors, byte_keys = _catalogue(os.fspath(src), reader.read_metadata())
    values, objects, left_out = _read_non_tensors(reader, os.fspath(src), byte_keys, strict=strict)
    clashes = sorted(set(values) & set(tensors))
    if clashes:
        raise StateDictError(f"{src}: values flatten onto the names of tensors: {', '.join(clashes[:20])}")
    for path, reason in left_out.items():
        warnings.warn(f"reshard import-dcp: {path!r} is left out: {reason}", stacklevel=2)
    total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in tensors.values())
    with (
        CheckpointWriter(dst, overwrite=overwrite, storage_options=storage_options) as writer,
        reporting(progress, total, "import-dcp") as advance,
    ):
        for fqn, (dtype, shape) in tensors.items():
            tensor = torch.empty(shape, dtype=dtype)
            _load(reader, {fqn: tensor})
            writer.write_tensor(fqn, dtype, shape, [tensor])
            advance(tensor.numel() * dtype.itemsize)
            del tensor
        for path, value in values.items():
            if isinstance(value, torch.Tensor):
                writer.write_tensor(path, value.dtype, tuple(value.shape), [value])
            else:
                writer.set_common(path, value)
        for (key, grid, offset), blob in objects.items():
            writer.write_object_blob(key, grid, offset, blob)
        return ImportResult(metadata=writer.commit(), left_out=left_out)


def _catalogue(src: str, dcp_metadata: DcpMetadata) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], list[str]]:
    """The tensors of a DCP checkpoint (name -> dtype and shape), and the names of its byte values.

    Raises:
        StateDictError: a tensor of a dtype reshard cannot store.
        CorruptCheckpointError: an entry of a kind DCP does not write.
    """
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    byte_keys: list[str] = []
    for fqn, item in sorted(dcp_metadata.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            try:
                dtype_name(dtype)
            except KeyError:
                raise StateDictError(f"{src}: tensor {fqn!r} has dtype {dtype}, which reshard cannot store") from None
            tensors[fqn] = (dtype, tuple(int(s) for s in item.size))
        elif isinstance(item, BytesStorageMetadata):
            byte_keys.append(fqn)
        else:
            raise CorruptCheckpointError(f"{src}: entry {fqn!r} is a {type(item).__name__}, which is not known")
    return tensors, byte_keys


def _read_non_tensors(
    reader: _MetadataOnceReader, src: str, byte_keys: list[str], *, strict: bool
) -> tuple[dict[str, Any], dict[tuple[str, tuple[int, ...], tuple[int, ...]], bytes], dict[str, str]]:
    """The byte values of a DCP checkpoint: plain values (path -> value), the ShardedObjects of a Megatron-Core
    checkpoint (by key, grid and offset: their blobs), and the values left out with the reason of each.

    Raises:
        StateDictError: with ``strict``, a value that cannot be stored.
    """
    megatron = _is_megatron(src)
    object_keys = [k for k in byte_keys if megatron and _MEGATRON_OBJECT.match(k)]
    byte_keys = [k for k in byte_keys if k not in set(object_keys)]
    values, left_out = _read_values(reader, byte_keys, strict=strict)
    objects, objects_left_out = _read_megatron_objects(reader, object_keys, src) if megatron else ({}, {})
    left_out.update(objects_left_out)
    if strict and objects_left_out:
        details = "; ".join(f"{k!r}: {v}" for k, v in objects_left_out.items())
        raise StateDictError(
            f"{len(objects_left_out)} Megatron values cannot be stored in a reshard checkpoint: {details}"
        )
    return values, objects, left_out


def _is_megatron(src: str) -> bool:
    """Whether ``src`` is a Megatron-Core ``torch_dist`` checkpoint (Megatron's ``metadata.json`` names its
    sharded backend)."""
    config = os.path.join(src, "metadata.json")
    if not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and "sharded_backend" in doc


def _read_megatron_objects(
    reader: _MetadataOnceReader, keys: list[str], src: str
) -> tuple[dict[tuple[str, tuple[int, ...], tuple[int, ...]], bytes], dict[str, str]]:
    """Megatron's ShardedObject cells and its ``common.pt``, as encoded object blobs by (key, grid, cell);
    and what is left out, with the reason."""
    blobs: dict[tuple[str, tuple[int, ...], tuple[int, ...]], bytes] = {}
    left_out: dict[str, str] = {}
    raw: dict[str, bytes] = {}
    if keys:
        _load(reader, dict.fromkeys(keys), planner=_CapturingPlanner(raw))
    for unique_key in keys:
        match = _MEGATRON_OBJECT.match(unique_key)
        assert match is not None
        offset = tuple(int(i) for i in match["offset"].split("."))
        grid = tuple(int(i) for i in match["grid"].split("."))
        if len(grid) != len(offset):
            left_out[unique_key] = "a ShardedObject of an old Megatron format (its grid has fewer axes than its offset)"
            continue
        try:
            stored = _plain_load(raw[unique_key])  # Megatron saves [data] under each unique key
            if not isinstance(stored, list) or len(stored) != 1:
                left_out[unique_key] = (
                    f"not the one-element list Megatron writes for a ShardedObject ({type(stored).__name__})"
                )
                continue
            blobs[(match["key"], grid, offset)] = encode_object_blob(stored[0], where=f"Megatron object {unique_key!r}")
        except (StateDictError, pickle.UnpicklingError, RuntimeError, ValueError, TypeError, AttributeError) as exc:
            left_out[unique_key] = f"not plain data ({exc})"
    common_path = os.path.join(src, "common.pt")
    if os.path.isfile(common_path):
        with open(common_path, "rb") as f:
            data = f.read()
        try:
            common = _plain_load(data)
        except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, AttributeError, EOFError) as exc:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
            left_out["common.pt"] = "not plain data (torch.load(weights_only=True) refused it" + (
                f": it holds a {found.group(1)})" if found else ")"
            )
            common = None
        if isinstance(common, dict):
            kept = {}
            for name, value in common.items():
                try:
                    encode_object_blob(value, where=f"common.pt entry {name!r}")
                except StateDictError as exc:
                    left_out[f"common.pt:{name}"] = str(exc)
                    continue
                kept[name] = value
            blobs[(MEGATRON_COMMON_KEY, (1,), (0,))] = encode_object_blob(kept, where="common.pt")
        elif common is not None:
            left_out["common.pt"] = f"a {type(common).__name__}, not a dict"
    return blobs, left_out


def _plain_load(data: bytes) -> Any:
    """``torch.load(weights_only=True)`` of ``data``, ``argparse.Namespace`` allowed (Megatron-LM's ``args``)
    and turned into a dict."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        value = torch.load(io.BytesIO(data), weights_only=True)
    return _namespaces_as_dicts(value)


def _namespaces_as_dicts(value: Any) -> Any:
    if isinstance(value, argparse.Namespace):
        return {k: _namespaces_as_dicts(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: _namespaces_as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_namespaces_as_dicts(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_namespaces_as_dicts(v) for v in value)
    return value


def _read_values(
    reader: _MetadataOnceReader, keys: list[str], *, strict: bool
) -> tuple[dict[str, object], dict[str, str]]:
    """Read DCP's non-tensor values, flattened to dotted paths; and the reasons of those left out."""
    if not keys:
        return {}, {}
    raw: dict[str, bytes] = {}
    _load(reader, dict.fromkeys(keys), planner=_CapturingPlanner(raw))
    values: dict[str, object] = {}
    left_out: dict[str, str] = {}
    for fqn in keys:
        try:
            value = torch.load(io.BytesIO(raw[fqn]), weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, ValueError, TypeError, AttributeError, EOFError) as exc:
            found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
            left_out[fqn] = "not plain data (torch.load(weights_only=True) refused it" + (
                f": it holds a {found.group(1)})" if found else ")"
            )
            continue
        flat: dict[str, object] = {}
        problem = _flatten_value(value, fqn, flat)
        if problem:
            left_out[fqn] = f"holds {problem}"
            continue
        values.update(flat)
    if strict and left_out:
        details = "; ".join(f"{k!r}: {v}" for k, v in left_out.items())
        raise StateDictError(f"{len(left_out)} DCP values cannot be stored in a reshard checkpoint: {details}")
    return values, left_out


class _CapturingPlanner(DefaultLoadPlanner):
    """A DCP load planner that keeps the raw bytes of every non-tensor value instead of unpickling them."""

    def __init__(self, raw: dict[str, bytes]) -> None:
        super().__init__()
        self.raw = raw

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.raw[read_item.dest_index.fqn] = value.getvalue()


def _load(reader: _MetadataOnceReader, state_dict: dict[str, Any], planner: DefaultLoadPlanner | None = None) -> None:
    """``dcp.load`` in this process alone; DCP's failures become reshard's errors."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp_load(state_dict, storage_reader=reader, planner=planner, no_dist=True)
        except CheckpointException as exc:  # derives from BaseException, not Exception
            lines = str(exc).strip().splitlines()
            raise CorruptCheckpointError(
                f"{reader.source}: DCP could not load {', '.join(sorted(state_dict)[:5])}: "
                f"{lines[-1] if lines else type(exc).__name__}"
            ) from exc


class _MetadataOnceReader(FileSystemReader):
    """DCP's file reader, unpickling ``.metadata`` once rather than once per tensor, and turning a missing
    or unreadable one into reshard's errors."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.source = path
        self._cached: DcpMetadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> DcpMetadata:
        if self._cached is None:
            if not os.path.isdir(self.source):
                raise CheckpointNotFoundError(f"no DCP checkpoint at {self.source}: not a directory")
            if not os.path.isfile(os.path.join(self.source, ".metadata")):
                raise CheckpointNotFoundError(f"{self.source} is not a DCP checkpoint: it has no .metadata")
            try:
                self._cached = super().read_metadata(*args, **kwargs)
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as exc:
                raise CorruptCheckpointError(
                    f"{self.source}/.metadata cannot be read: {type(exc).__name__}: {exc}"
                ) from exc
        return self._cached
