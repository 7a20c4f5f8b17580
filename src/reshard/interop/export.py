"""``reshard export``: a checkpoint's tensors as Hugging Face style sharded safetensors.

The output directory gets ``model-00001-of-0000N.safetensors`` files (always numbered, also when there is
one) and ``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {name:
file}}``), which ``transformers``, ``safetensors`` and ``huggingface_hub`` read. Every tensor is written
whole, with its logical (unpadded) global shape, whatever layout saved it. The index is written last,
so a directory with an index holds a complete export.

Memory stays bounded: each tensor is read as slabs of at most ``slab_bytes`` (see
:class:`~reshard.interop.offline.CheckpointReader`) and streamed into its shard, so an export never holds
more than one slab and the read buffer, whatever the sizes of the tensors and shards.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reshard.errors import CheckpointError, CheckpointExistsError, MismatchError, StateDictError, StorageError
from reshard.flows.progress import Progress, reporting
from reshard.interop.offline import DEFAULT_SLAB_BYTES, CheckpointReader, cast_floating, kept_scaled, scaled_part_keys
from reshard.interop.safetensors import SafetensorsWriter, TensorSpec, safetensors_dtype
from reshard.metadata import check_relative_path
from reshard.state.scaled import GLOBAL_SCALE_SUFFIX, SCALE_SUFFIX
from reshard.storage import CheckpointLocation, Storage, storage_for

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "SCALED_METADATA_KEY",
    "ExportResult",
    "KeyMap",
    "export_safetensors",
    "parse_size",
    "plan_shards",
    "shard_file_names",
]

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""5 GB, Hugging Face's default shard size."""

SCALED_METADATA_KEY = "reshard.scaled"
"""The ``__metadata__`` entry of every shard of an export holding scaled tensors: JSON of ``{output name of the
data: {"format", "block", "scale": output name, "global_scale": output name or null}}``."""

KeyMap = Mapping[str, str | None] | Callable[[str], str | None]
"""Checkpoint key -> output name; None leaves the tensor out. A mapping leaves unlisted keys unchanged. (A load
from safetensors maps the other way, template key -> source tensors: :data:`reshard.interop.SourceMap`.)"""

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """A byte count from ``"2GB"``, ``"500MB"``, ``"1.5GiB"`` or ``"123"``: KB/MB/GB/TB are powers of 1000
    (as in Hugging Face's ``max_shard_size``), KiB/MiB/GiB/TiB powers of 1024.

    Raises:
        ValueError: not a positive size.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size such as 2GB, 500MB or 1GiB")
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportResult:
    """What an export wrote."""

    files: tuple[str, ...]
    """The shard files, in order, relative to the output directory."""
    weight_map: dict[str, str]
    """Output tensor name -> shard file (the index's ``weight_map``)."""
    total_bytes: int
    """Bytes of tensor data written (the index's ``metadata.total_size``)."""
    left_out: tuple[str, ...]
    """Checkpoint keys the key map left out."""
    not_tensors: int
    """ShardedObjects and common values of the checkpoint, which safetensors cannot hold (not exported)."""
    kept_scaled: tuple[str, ...] = ()
    """The scaled tensors (data keys) a ``dtype`` conversion left in their formats: their data, scales and
    global scale are written as saved (cast apart, the data would decode with wrong scales)."""


@dataclass(frozen=True, slots=True)
class _Item:
    key: str
    spec: TensorSpec


def _output_names(reader: CheckpointReader, key_map: KeyMap | None) -> tuple[list[tuple[str, str]], list[str]]:
    """(checkpoint key, output name) for every exported tensor, and the keys left out."""
    keys = list(reader.metadata.tensors)
    if isinstance(key_map, Mapping):
        unknown = sorted(set(key_map) - set(keys))
        if unknown:
            raise MismatchError(
                f"the key map names {len(unknown)} keys that {reader.describe()} does not have: "
                + ", ".join(repr(k) for k in unknown[:20])
            )
    pairs: list[tuple[str, str]] = []
    left_out: list[str] = []
    owners: dict[str, str] = {}
    for key in keys:
        if key_map is None:
            name: str | None = key
        elif isinstance(key_map, Mapping):
            name = key_map.get(key, key)
        else:
            name = key_map(key)
        if name is None:
            left_out.append(key)
            continue
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise StateDictError(f"the key map gives tensor {key!r} the invalid name {name!r}")
        if name in owners:
            raise StateDictError(f"tensors {owners[name]!r} and {key!r} would both be exported as {name!r}")
        owners[name] = key
        pairs.append((key, name))
    return pairs, left_out


def plan_shards(sizes: list[int], max_shard_bytes: int) -> list[list[int]]:
    """Split tensors of ``sizes`` bytes (in order) into shards of at most ``max_shard_bytes``, as Hugging Face
    does: a new shard starts when the next tensor would not fit; a tensor larger than the limit gets a shard
    alone. Returns the indices of each shard's tensors."""
    shards: list[list[int]] = []
    size = 0
    for index, nbytes in enumerate(sizes):
        if not shards or (shards[-1] and size + nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(index)
        size += nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    """The names of ``count`` shards: ``model-00001-of-0000N.safetensors``, numbered also when there is one."""
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _shards(items: list[_Item], max_shard_bytes: int) -> list[list[_Item]]:
    return [[items[i] for i in shard] for shard in plan_shards([item.spec.nbytes for item in items], max_shard_bytes)]


def _clear_previous(storage: Storage, names: list[str], *, overwrite: bool) -> None:
    """Refuse to write over an earlier export (unless ``overwrite``); with it, remove the earlier index
    first (so that no index points at half-written shards), then its shards and any file in the way."""
    present = [n for n in [INDEX_FILE, *names] if storage.exists(n)]
    if not present:
        return
    if not overwrite:
        raise CheckpointExistsError(
            f"{storage.describe()} already holds {present[0]}; pass overwrite=True (--overwrite) to replace the export"
        )
    previous: set[str] = set()
    if storage.exists(INDEX_FILE):
        try:
            weight_map = json.loads(storage.read_bytes(INDEX_FILE, max_bytes=64 * 1024 * 1024)).get("weight_map", {})
            previous = {f for f in weight_map.values() if isinstance(f, str) and check_relative_path(f) is None}
        except (OSError, ValueError, AttributeError):
            previous = set()
        storage.delete(INDEX_FILE)
    for name in sorted(previous | set(names)):
        if name.endswith(".safetensors"):
            storage.delete(name)


def export_safetensors(
    checkpoint: CheckpointLocation,
    out: CheckpointLocation,
    *,
    key_map: KeyMap | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    metadata: Mapping[str, str] | None = None,
    storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> ExportResult:
    """Write the tensors of ``checkpoint`` into ``out`` as Hugging Face sharded safetensors. Not collective.

    Args:
        checkpoint: the reshard checkpoint (directory, URL or Storage).
        out: the output directory (or URL); created if needed. Other files in it are left alone.
        key_map: output names: a mapping from checkpoint key to name (None leaves the tensor out; keys it
            does not list keep their names; a key the checkpoint lacks is an error), or a function of the
            key returning the name or None.
        dtype: cast floating-point tensors to this dtype (integer, bool and complex tensors keep theirs, and so
            do the data, scales and global scales of scaled tensors: see ``ExportResult.kept_scaled``).
        max_shard_bytes: shard size limit in bytes (a larger tensor gets a shard of its own).
        overwrite: replace an earlier export in ``out`` (its index and shards).
        metadata: extra ``__metadata__`` entries of every shard (``format: pt`` is always set, and
            :data:`SCALED_METADATA_KEY` when scaled tensors are exported).
        storage_options: for object-store URLs (both sides).
        progress: told the bytes written.
        slab_bytes: the largest piece of a tensor held in memory at once.

    Returns:
        What was written.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError: ``checkpoint`` is not
            a loadable checkpoint.
        MismatchError, StateDictError: a bad key map (one that leaves out every tensor, too, or one that
            exports a scaled tensor's data without its scale or global scale, or with one renamed apart from
            it: naming the parts), a dtype safetensors cannot hold (complex128), or a ``metadata`` entry
            ``reshard.scaled`` (the export's own).
        CheckpointExistsError: ``out`` holds an export and ``overwrite`` is off.
        StorageError: writing failed (the shards written so far are removed).
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if SCALED_METADATA_KEY in (metadata or {}):
        raise MismatchError(f"the __metadata__ entry {SCALED_METADATA_KEY!r} is the export's own (its scaled tensors)")
    with CheckpointReader(checkpoint, storage_options=storage_options) as reader:
        items, left_out = _items(reader, key_map, dtype)
        scaled = _scaled_records(reader, items)
        if scaled:
            metadata = {**(metadata or {}), SCALED_METADATA_KEY: json.dumps(scaled, sort_keys=True)}
        shards = _shards(items, max_shard_bytes)
        names = shard_file_names(len(shards))
        storage = storage_for(out, storage_options)
        try:
            _clear_previous(storage, names, overwrite=overwrite)
            total = sum(item.spec.nbytes for item in items)
            with reporting(progress, total, "export") as advance:
                _write_shards(reader, storage, shards, names, {**(metadata or {}), "format": "pt"}, advance, slab_bytes)
            weight_map = {item.spec.name: name for shard, name in zip(shards, names, strict=True) for item in shard}
            _write_index(storage, names, total, weight_map)
        finally:
            if storage is not out:
                storage.close()
        return ExportResult(
            files=tuple(names),
            weight_map=weight_map,
            total_bytes=total,
            left_out=tuple(left_out),
            not_tensors=len(reader.metadata.objects) + len(reader.metadata.common),
            kept_scaled=kept_scaled(reader.metadata, dtype, (item.key for item in items)),
        )


def _items(
    reader: CheckpointReader, key_map: KeyMap | None, dtype: torch.dtype | None
) -> tuple[list[_Item], list[str]]:
    """The tensors to export, by output name (each with the name, dtype and shape it is written with), and the
    keys the key map leaves out.

    Raises:
        MismatchError: the key map leaves out every tensor (or names a key the checkpoint lacks).
        StateDictError: a dtype safetensors cannot hold.
    """
    pairs, left_out = _output_names(reader, key_map)
    if not pairs:
        firsts = sorted({key.split(".")[0] + "." for key in reader.metadata.tensors})
        raise MismatchError(
            f"the key map leaves out all {len(left_out)} tensors of {reader.describe()}: the export would write "
            f"no tensors (the checkpoint's keys start with {', '.join(firsts[:8])}"
            f"{' ...' if len(firsts) > 8 else ''})"
        )
    items = []
    scaled = scaled_part_keys(reader.metadata)
    for key, name in sorted(pairs, key=lambda pair: pair[1]):
        saved = reader.metadata.tensors[key]
        out = saved.torch_dtype if key in scaled else cast_floating(saved.torch_dtype, dtype)
        spec = TensorSpec(name=name, dtype=out, shape=saved.global_shape)
        try:
            safetensors_dtype(spec.dtype)
        except StateDictError:
            raise StateDictError(f"tensor {key!r}: safetensors cannot hold dtype {saved.dtype}") from None
        items.append(_Item(key, spec))
    return items, left_out


def _scaled_records(reader: CheckpointReader, items: list[_Item]) -> dict[str, Any]:
    """The records of the exported scaled tensors under their output names (``SCALED_METADATA_KEY``).

    Raises:
        MismatchError: naming the parts, for a scaled tensor whose data is exported without a scale or global
            scale, or with one renamed apart from it (not ``<data's output name>:scale`` / ``:global_scale``):
            its data could not be decoded, or paired with its scales by name.
    """
    names = {item.key: item.spec.name for item in items}
    records: dict[str, Any] = {}
    problems = []
    for key, record in sorted(reader.metadata.scaled.items()):
        if key not in names:
            continue
        doc = record.to_json()
        for field, part, suffix in (
            ("scale", record.scale_key, SCALE_SUFFIX),
            ("global_scale", record.global_scale_key, GLOBAL_SCALE_SUFFIX),
        ):
            if part is None:
                continue
            want = names[key] + suffix
            if names.get(part) != want:
                done = "left out" if part not in names else f"named {names[part]!r}"
                problems.append(f"{part!r} (of {key!r}, exported as {names[key]!r}) is {done}: it must be {want!r}")
            doc[field] = want
        records[names[key]] = doc
    if problems:
        raise MismatchError(
            "the key map parts scaled data from its scales: " + "; ".join(problems[:20]) + ". Export a scaled "
            "tensor's data, scale and global scale together, under its name with ':scale' and ':global_scale' "
            "(or leave all three out); `reshard export-hf --quantize` writes a model's Hugging Face names"
        )
    return records


def _write_index(storage: Storage, names: list[str], total: int, weight_map: dict[str, str]) -> None:
    """Commit ``model.safetensors.index.json``, last: an export is complete once its index is there. A failure
    removes the shards ``names`` and raises StorageError."""
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    try:
        storage.commit(INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode(), replace=True)
    except OSError as exc:
        _remove(storage, names)
        raise StorageError(f"writing {storage.describe(INDEX_FILE)} failed: {exc}") from exc


def _write_shards(
    reader: CheckpointReader,
    storage: Storage,
    shards: list[list[_Item]],
    names: list[str],
    metadata: dict[str, str],
    advance: Callable[[int], None],
    slab_bytes: int,
) -> None:
    """Write every shard, tensor by tensor, slab by slab; on failure remove the shards written so far."""
    written: list[str] = []
    try:
        for shard, name in zip(shards, names, strict=True):
            # Within a shard, larger elements first: every tensor then starts aligned to its element size.
            specs = sorted((item.spec for item in shard), key=lambda s: (-s.dtype.itemsize, s.name))
            key_of = {item.spec.name: item.key for item in shard}
            sink = storage.open_writer(name)
            written.append(name)
            try:
                writer = SafetensorsWriter(sink, specs, metadata)
                for spec in specs:
                    for slab in reader.iter_slabs(key_of[spec.name], dtype=spec.dtype, slab_bytes=slab_bytes):
                        writer.write(slab)
                        advance(slab.numel() * spec.dtype.itemsize)
                    writer.end_tensor()
                writer.close()
            except BaseException:
                sink.abort()
                raise
    except BaseException as exc:
        _remove(storage, written)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise StorageError(f"writing the export into {storage.describe()} failed: {exc}") from exc
        raise


def _remove(storage: Storage, names: list[str]) -> None:
    """Best effort: remove files of a failed export."""
    for name in names:
        try:
            storage.delete(name)
        except OSError:
            continue
