"""Hugging Face safetensors checkpoints as a load source: ``load(template, HuggingFaceSource(hf_dir, key_map))``.

A directory with ``model.safetensors``, or with ``model.safetensors.index.json`` and the shards it names,
is read as if it were a reshard checkpoint in which every source tensor is one whole box: the validated
safetensors headers give each tensor's dtype, shape and byte range, so each rank reads only the bytes of
the boxes its template overlaps, from any layout, with the usual planning (strided runs, dtype casts,
padding). There are no checksums in safetensors, so these reads are not verified.

``key_map`` maps the template's keys to sources; keys it does not name are looked up under their own
name. A source is

- a tensor name (``"model.norm.weight"``): the target is that tensor;
- :class:`Concat` ``(name, name, ..., axis=0)``: the target is the named tensors concatenated along
  ``axis`` (fused QKV ``[Q; K; V]`` with any number of query groups, a GLU's ``[gate; up]``);
- :class:`Stack` ``(name, name, ...)``: the target is the named tensors stacked on a new axis 0 (per-expert
  weights into one ``[E, ...]`` tensor).

Each part of a Concat or Stack is one box of the target, so a rank whose shard covers only the K rows
of a fused QKV reads only from ``k_proj``. Nothing is converted or copied beforehand.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from reshard.errors import CheckpointNotFoundError, CorruptCheckpointError, MismatchError, StorageError
from reshard.interop.hf_scaled import Pairs, ScaledLayout, describe_pairs, scaled_layout
from reshard.interop.safetensors import TensorEntry, read_header
from reshard.io.sources import CheckpointSource
from reshard.metadata import DataFile, Metadata, SavedBox, TensorMetadata, check_relative_path
from reshard.state.codec import strict_json_loads
from reshard.state.dtypes import dtype_name
from reshard.state.scaled import ScaledRecord
from reshard.storage import CheckpointLocation, FileTooLargeError, Storage, storage_for

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "Concat",
    "HuggingFaceSource",
    "Source",
    "SourceMap",
    "Stack",
    "describe_source",
    "is_safetensors_source",
    "source_metadata",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_INDEX_BYTES = 64 * 1024 * 1024
_CHUNK_BYTES = 4 * 1024 * 1024
"""How read planning splits slabs; safetensors sources have no checksums to align with."""


@dataclass(frozen=True, slots=True, init=False)
class Concat:
    """A target that is several source tensors concatenated along ``axis`` (in order)."""

    sources: tuple[str, ...]
    axis: int

    def __init__(self, *sources: str, axis: int = 0) -> None:
        if not sources or not all(isinstance(s, str) for s in sources):
            raise TypeError("Concat needs one or more source tensor names")
        object.__setattr__(self, "sources", tuple(sources))
        object.__setattr__(self, "axis", axis)


@dataclass(frozen=True, slots=True, init=False)
class Stack:
    """A target that is several source tensors of one shape stacked on a new axis 0 (in order)."""

    sources: tuple[str, ...]

    def __init__(self, *sources: str) -> None:
        if not sources or not all(isinstance(s, str) for s in sources):
            raise TypeError("Stack needs one or more source tensor names")
        object.__setattr__(self, "sources", tuple(sources))


Source = str | Concat | Stack
SourceMap = Mapping[str, Source]
"""Template key -> where its tensor comes from in the safetensors checkpoint (a tensor name, a :class:`Concat` or a
:class:`Stack`). Not :data:`reshard.interop.KeyMap`, which renames a reshard checkpoint's keys on export."""


def __getattr__(name: str) -> Any:
    """``KeyMap``, this module's old name of :data:`SourceMap`, still imports (with a DeprecationWarning): the one
    ``KeyMap`` of reshard is the export's (:data:`reshard.interop.KeyMap`)."""
    if name == "KeyMap":
        warnings.warn(
            "reshard.interop.hf_source.KeyMap is now SourceMap (reshard.interop.SourceMap)", DeprecationWarning, 2
        )
        return SourceMap
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_safetensors_source(storage: Storage) -> bool:
    """Whether ``storage`` holds a Hugging Face safetensors checkpoint (an index or a single file)."""
    return storage.exists(INDEX_FILE) or storage.exists(SINGLE_FILE)


def describe_source(storage: Storage) -> dict[str, Any]:
    """Read the index (if any) and every shard's header: the JSON-able description that
    :func:`source_metadata` turns into a Metadata (the coordinator reads it once and sends it to the
    other ranks). Only small reads: the index and each header.

    Raises:
        CorruptCheckpointError: an invalid index or header, an index naming a tensor its shard lacks, or a
            ``config.json`` whose quantization does not fit the tensors (``hf_scaled.describe_pairs``).
        CheckpointNotFoundError: neither file is there.
    """
    where = storage.describe()
    if storage.exists(INDEX_FILE):
        try:
            raw = storage.read_bytes(INDEX_FILE, max_bytes=_MAX_INDEX_BYTES)
        except FileTooLargeError:
            raise CorruptCheckpointError(
                f"{storage.describe(INDEX_FILE)} is larger than {_MAX_INDEX_BYTES} bytes; refused unread"
            ) from None
        try:
            index = strict_json_loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:
            raise CorruptCheckpointError(f"{storage.describe(INDEX_FILE)} is not valid JSON: {exc}") from exc
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CorruptCheckpointError(f"{storage.describe(INDEX_FILE)} has no weight_map of names to files")
        files = sorted(set(weight_map.values()))
    elif storage.exists(SINGLE_FILE):
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise CheckpointNotFoundError(f"{where} holds neither {INDEX_FILE} nor {SINGLE_FILE}")
    described_files = []
    tensors: dict[str, list[Any]] = {}
    for number, name in enumerate(files):
        problem = check_relative_path(name)
        if problem is not None:
            raise CorruptCheckpointError(f"{storage.describe(INDEX_FILE)}: shard name {name!r} {problem}")
        try:
            header = read_header(storage, name)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{storage.describe(name)}, named by {INDEX_FILE}, is missing") from None
        except OSError as exc:
            raise StorageError(f"cannot read {storage.describe(name)}: {exc}") from exc
        described_files.append([name, header.file_size])
        for tensor_name, entry in header.tensors.items():
            if weight_map is None or weight_map.get(tensor_name) == name:
                tensors[tensor_name] = [number, entry.dtype, list(entry.shape), entry.start, entry.end]
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(tensors))
        if absent:
            raise CorruptCheckpointError(
                f"{storage.describe(INDEX_FILE)} names tensors their shards do not hold: {', '.join(absent[:20])}"
            )
    entries = {name: (described_files[doc[0]][0], _entry(name, doc)[1]) for name, doc in tensors.items()}
    return {"files": described_files, "tensors": tensors, "pairs": describe_pairs(storage, entries)}


def _entry(name: str, doc: list[Any]) -> tuple[int, TensorEntry]:
    number, code, shape, start, end = doc
    return number, TensorEntry(name=name, dtype=code, shape=tuple(shape), start=start, end=end)


def source_metadata(description: dict[str, Any], key_map: SourceMap | None) -> Metadata:
    """A Metadata whose tensors are the keys of ``key_map``, each built from its source (see the module
    docstring), and every source tensor under its own name (unless the key map names it as a target). A
    low-precision pair (:mod:`reshard.interop.hf_scaled`) is a scaled tensor: its data under the key, its
    scales and global scale under ``<key>:scale`` and ``<key>:global_scale``, and its record.

    Raises:
        MismatchError: a key_map source names a tensor the checkpoint lacks, parts that do not fit together
            (shapes, dtypes, formats, blocks cut by a part, global scales), a target mixing low-precision pairs
            and plain tensors, or a dtype reshard cannot hold.
    """
    sources = {name: _entry(name, doc) for name, doc in description["tensors"].items()}
    pairs = Pairs.from_doc(description.get("pairs"))
    key_map = key_map or {}
    built = _Built({}, {}, [])
    for key, spec in key_map.items():
        _add_target(key, spec, sources, pairs, built)
    partners = pairs.partners()
    for name in [*sources, *pairs.by_name]:
        if name not in built.tensors and name not in key_map and name not in partners:
            _add_target(name, name, sources, pairs, built)
    if built.problems:
        raise MismatchError("the safetensors source does not fit the key map: " + "; ".join(built.problems[:30]))
    return Metadata(
        save_id="safetensors",
        created_by="safetensors",
        world_size=1,
        checksum_chunk_bytes=_CHUNK_BYTES,
        files=tuple(DataFile(path=name, size=size) for name, size in description["files"]),
        tensors=built.tensors,
        scaled=built.scaled,
    )


@dataclass(frozen=True, slots=True)
class _Built:
    tensors: dict[str, TensorMetadata]
    scaled: dict[str, ScaledRecord]
    problems: list[str]


def _names(spec: Source) -> list[str]:
    return [spec] if isinstance(spec, str) else list(spec.sources)


def _add_target(
    key: str, spec: Source, sources: dict[str, tuple[int, TensorEntry]], pairs: Pairs, built: _Built
) -> None:
    """Add target ``key`` (its tensor, and for low-precision pairs its scales and record) to ``built``."""
    found = [pairs.lookup(name) for name in _names(spec)]
    scaled = [p for p in found if p is not None]
    if scaled and len(scaled) != len(found):
        built.problems.append(f"{key!r}: its sources mix low-precision pairs and plain tensors")
        return
    names = [p.data for p in scaled] or _names(spec)
    parts = []
    for name in names:
        if name not in sources:
            built.problems.append(f"{key!r}: the source has no tensor {name!r}")
        else:
            parts.append(sources[name])
    if len(parts) != len(names):
        return
    layout = _layout(key, spec, parts, built.problems)
    if layout is None:
        return
    offsets, shape = layout
    shapes = [(1, *p.shape) if isinstance(spec, Stack) else p.shape for _, p in parts]
    built.tensors[key] = _tensor(key, parts, offsets, shape, shapes, built.problems)
    if scaled:
        try:
            scales = scaled_layout(key, scaled, offsets, shapes, shape)
        except MismatchError as exc:
            built.problems.append(str(exc))
            return
        _add_scales(scales, sources, built)


def _add_scales(scales: ScaledLayout, sources: dict[str, tuple[int, TensorEntry]], built: _Built) -> None:
    """The scale and global-scale tensors of a scaled target, and its record. E8M0 scales stored as F8_E8M0
    are their uint8 bit patterns (the dtype a checkpoint records them as)."""
    record = scales.record
    parts = [sources[name] for name in scales.scale_names]
    parts = [(n, replace(e, dtype="U8") if e.dtype == "F8_E8M0" else e) for n, e in parts]
    built.tensors[record.scale_key] = _tensor(
        record.scale_key, parts, list(scales.scale_offsets), scales.grid, list(scales.scale_shapes), built.problems
    )
    if record.global_scale_key is not None and scales.global_scale is not None:
        glob = sources[scales.global_scale]
        built.tensors[record.global_scale_key] = _tensor(
            record.global_scale_key, [glob], [()], (), [()], built.problems
        )
    built.scaled[record.key] = record


def _layout(
    key: str, spec: Source, parts: list[tuple[int, TensorEntry]], problems: list[str]
) -> tuple[list[tuple[int, ...]], tuple[int, ...]] | None:
    """The offset of each part in the target and the target's global shape; None (and a problem) when the
    parts do not fit together."""
    if isinstance(spec, str):
        return [(0,) * len(parts[0][1].shape)], parts[0][1].shape
    if isinstance(spec, Stack):
        shape = parts[0][1].shape
        if any(p.shape != shape for _, p in parts):
            problems.append(f"{key!r}: Stack of tensors of different shapes {[list(p.shape) for _, p in parts]}")
            return None
        return [(i, *(0,) * len(shape)) for i in range(len(parts))], (len(parts), *shape)
    first = parts[0][1].shape
    axis = spec.axis
    if not 0 <= axis < len(first) or any(
        len(p.shape) != len(first) or p.shape[:axis] + p.shape[axis + 1 :] != first[:axis] + first[axis + 1 :]
        for _, p in parts
    ):
        problems.append(f"{key!r}: cannot concatenate shapes {[list(p.shape) for _, p in parts]} on axis {axis}")
        return None
    offsets, position = [], 0
    for _, p in parts:
        offsets.append(tuple(position if a == axis else 0 for a in range(len(first))))
        position += p.shape[axis]
    return offsets, tuple(position if a == axis else n for a, n in enumerate(first))


def _tensor(
    key: str,
    parts: list[tuple[int, TensorEntry]],
    offsets: list[tuple[int, ...]],
    global_shape: tuple[int, ...],
    shapes: list[tuple[int, ...]],
    problems: list[str],
) -> TensorMetadata:
    """The tensor ``key`` whose boxes are ``parts`` (each a whole source tensor) at ``offsets``, of ``shapes``
    (the parts' own shapes, or the same bytes seen as another shape: stacked, a per-tensor scale's grid)."""
    dtypes = {p.dtype for _, p in parts}
    torch_dtype = parts[0][1].torch_dtype
    if len(dtypes) > 1:
        problems.append(f"{key!r}: its parts have different dtypes {sorted(dtypes)}")
    elif torch_dtype is None:
        problems.append(f"{key!r}: safetensors dtype {parts[0][1].dtype} has no torch dtype reshard can load")
    boxes = tuple(
        SavedBox(
            offset=offset,
            shape=shape,
            file=number,
            byte_offset=entry.start,
            byte_length=entry.nbytes,
            checksums=(),
        )
        for (number, entry), offset, shape in zip(parts, offsets, shapes, strict=True)
    )
    name = dtype_name(torch_dtype) if torch_dtype is not None and len(dtypes) == 1 else "float32"
    return TensorMetadata(key=key, dtype=name, global_shape=global_shape, boxes=boxes)


class HuggingFaceSource(CheckpointSource):
    """A Hugging Face safetensors directory (``model.safetensors``, or ``model.safetensors.index.json`` and
    the shards it names) as a source for :func:`reshard.load`.

    Args:
        path: the directory: a path, a ``file://``, ``s3://`` or ``gs://`` URL, or a Storage.
        key_map: template key -> source (a tensor name, :class:`Concat` or :class:`Stack`); keys it does not
            name are looked up under their own name (see the module doc).
        storage_options: passed to the object-store client.
        allow_unused: whether source tensors that no template key of the load uses (over all its ranks) are
            allowed; by default they raise :class:`~reshard.MismatchError` listing them, since a tensor a
            model does not ask for is usually a key map that does not fit the checkpoint.

    Each rank reads only the bytes of its boxes; safetensors has no checksums, so nothing is verified.
    """

    def __init__(
        self,
        path: CheckpointLocation,
        key_map: SourceMap | None = None,
        *,
        storage_options: dict[str, Any] | None = None,
        allow_unused: bool = False,
    ) -> None:
        self.storage = storage_for(path, storage_options)
        self._owns_storage = self.storage is not path
        self.key_map = key_map
        self.allow_unused = allow_unused
        self.refuses_unused = not allow_unused
        self._source_names: list[str] = []
        self._pairs = Pairs({})

    def unused_entries(self, keys: set[str]) -> list[str]:
        if self.allow_unused:
            return []
        key_map = self.key_map or {}
        used: set[str] = set()
        for key in keys:
            for name in _names(key_map.get(key, key)):
                pair = self._pairs.lookup(name)
                used.update([name] if pair is None else [pair.data, pair.scale, pair.global_scale or pair.data])
        return sorted(set(self._source_names) - used)

    def read_metadata(self) -> tuple[bytes, Metadata]:
        if not is_safetensors_source(self.storage):
            raise CheckpointNotFoundError(
                f"{self.storage.describe()} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a Hugging Face "
                "safetensors checkpoint"
            )
        description = describe_source(self.storage)
        self._source_names = list(description["tensors"])
        self._pairs = Pairs.from_doc(description.get("pairs"))
        return json.dumps(description).encode(), source_metadata(description, self.key_map)

    def decode_metadata(self, raw: bytes) -> Metadata:
        description = json.loads(raw)
        self._source_names = list(description["tensors"])
        self._pairs = Pairs.from_doc(description.get("pairs"))
        return source_metadata(description, self.key_map)

    def close(self) -> None:
        if self._owns_storage:
            self.storage.close()
