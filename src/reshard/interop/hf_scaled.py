"""Low-precision (data, scale) pairs of a Hugging Face checkpoint, presented to a load as scaled tensors.

``config.json``'s ``quantization_config`` says which tensors are low-precision data and where their scales are:

=======================================  ==================  =====================================================
``quant_method`` / ``format``            reshard format      tensors per quantized module ``X``
=======================================  ==================  =====================================================
``fp8`` (transformers FineGrainedFP8,    ``fp8_e4m3``        ``X.weight`` (E4M3), ``X.weight_scale_inv`` (float32
DeepSeek-V3)                             (``fmt: e5m2``:     or bf16), one per ``weight_block_size`` block (no
                                         ``fp8_e5m2``)       block size: one per tensor)
compressed-tensors ``float-quantized``   ``fp8_e4m3``        ``X.weight`` (E4M3), ``X.weight_scale`` (strategy
(``naive-quantized`` of 8-bit floats)                        ``tensor``, ``channel``, ``group``, ``block``)
compressed-tensors ``mxfp8-quantized``   ``mxfp8_e4m3``      ``X.weight`` (E4M3), ``X.weight_scale`` (E8M0, uint8)
compressed-tensors                       ``mxfp4``           ``X.weight_packed`` (uint8), ``X.weight_scale``
``mxfp4-pack-quantized``                                     (E8M0, uint8)
compressed-tensors                       ``nvfp4_divisor``   ``X.weight_packed`` (uint8), ``X.weight_scale``
``nvfp4-pack-quantized``                                     (E4M3), ``X.weight_global_scale`` (float32 ``[1]``)
=======================================  ==================  =====================================================

Each pair is checked against the config (data and scale dtypes, the scale grid the data's shape and the block
give); anything inconsistent or hostile is a :class:`~reshard.CorruptCheckpointError`. A one-byte tensor is
never taken as low precision by its dtype alone: an FP8 tensor that is not the data of a pair, in a checkpoint
whose config names a quantization method, is an error naming it; a uint8/int8 tensor without a pair is plain.

A pair is listed under its module's weight name (``X.weight``; ``X.weight_packed`` is accepted too in a key
map), its scales are not listed under their own names. The FP8 scales of a file may be bfloat16 or float16
(compressed-tensors holds them in the model's dtype): the pair records them as they are, and a load into
reshard's float32 scales widens them, which is exact (see :mod:`reshard.planning.scaled`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from typing import Any

from reshard.errors import CorruptCheckpointError, MismatchError
from reshard.interop.safetensors import TensorEntry
from reshard.state.codec import strict_json_loads
from reshard.state.lowprec import FORMATS, Block, scale_grid_shape, stored_block
from reshard.state.scaled import GLOBAL_SCALE_SUFFIX, SCALE_SUFFIX, ScaledRecord, canonical_block
from reshard.storage import FileTooLargeError, ReadRequest, Storage

__all__ = ["CONFIG_FILE", "Pair", "Pairs", "ScaledLayout", "describe_pairs", "scaled_layout"]

CONFIG_FILE = "config.json"
_MAX_CONFIG_BYTES = 16 * 1024 * 1024
_WIDENED_SCALES = {"BF16", "F16"}
_FP8_CODES = {"F8_E4M3", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}
_DATA_CODES = {
    "fp8_e4m3": "F8_E4M3",
    "fp8_e5m2": "F8_E5M2",
    "mxfp8_e4m3": "F8_E4M3",
    "mxfp4": "U8",
    "nvfp4_divisor": "U8",
}
_SCALE_CODES = {"fp8_e4m3": {"F32"} | _WIDENED_SCALES, "fp8_e5m2": {"F32"} | _WIDENED_SCALES}
_SCALE_CODES.update({"mxfp8_e4m3": {"U8", "F8_E8M0"}, "mxfp4": {"U8", "F8_E8M0"}, "nvfp4_divisor": {"F8_E4M3"}})


@dataclass(frozen=True, slots=True)
class _Scheme:
    """How the config says a module is quantized: reshard format, block (2-D, logical), tensor suffixes."""

    format: str
    block: Block
    data: str
    scale: str
    global_scale: str | None = None


@dataclass(frozen=True, slots=True)
class Pair:
    """One low-precision tensor of the files: its data tensor, scale tensor and global-scale tensor (names in
    the files), its format and block (per axis of the logical data), and the global scale's bytes (hex)."""

    name: str
    data: str
    scale: str
    global_scale: str | None
    format: str
    block: Block
    global_bytes: str | None = None

    def to_json(self) -> list[Any]:
        return [self.data, self.scale, self.global_scale, self.format, list(self.block), self.global_bytes]


@dataclass(frozen=True, slots=True)
class Pairs:
    """The pairs of a checkpoint by listing name, and the names (data and the alias ``X.weight_packed``) that
    lead to each."""

    by_name: dict[str, Pair]

    @classmethod
    def from_doc(cls, doc: object) -> Pairs:
        if not isinstance(doc, dict):
            return cls({})
        return cls({n: Pair(n, d, s, g, f, tuple(b), h) for n, (d, s, g, f, b, h) in doc.items()})

    def lookup(self, name: str) -> Pair | None:
        """The pair whose listing name or data tensor is ``name``."""
        found = self.by_name.get(name)
        if found is None and name.endswith("_packed"):
            found = self.by_name.get(name.removesuffix("_packed"))
        return found

    def partners(self) -> set[str]:
        """The tensor names that only travel inside a pair (scales, global scales, packed data)."""
        out = {p.scale for p in self.by_name.values()} | {p.data for p in self.by_name.values()}
        return (out | {p.global_scale for p in self.by_name.values() if p.global_scale}) - set(self.by_name)


def _fail(message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{CONFIG_FILE}: {message}")


def read_quantization_config(storage: Storage) -> dict[str, Any] | None:
    """``quantization_config`` of the directory's config.json; None when there is no config or no such member.

    Raises:
        CorruptCheckpointError: a config that is too large, not JSON, or whose member is not an object.
    """
    if not storage.exists(CONFIG_FILE):
        return None
    try:
        raw = storage.read_bytes(CONFIG_FILE, max_bytes=_MAX_CONFIG_BYTES)
    except FileTooLargeError:
        raise _fail(f"larger than {_MAX_CONFIG_BYTES} bytes; refused unread") from None
    try:
        config = strict_json_loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:
        raise _fail(f"not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise _fail("not a JSON object")
    found = config.get("quantization_config")
    if found is None:
        return None
    if not isinstance(found, dict) or not isinstance(found.get("quant_method"), str):
        raise _fail("quantization_config must be an object with a quant_method string")
    return found


def _block(value: object, what: str) -> Block:
    if value is None:
        return (None, None)
    if not isinstance(value, list) or len(value) != 2 or not all(type(b) is int and 1 <= b <= 2**31 for b in value):
        raise _fail(f"{what} must be two positive integers, not {value!r}")
    return (value[0], value[1])


def _fine_grained(qc: dict[str, Any]) -> _Scheme:
    fmt = {"e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}.get(qc.get("fmt", "e4m3"))
    if fmt is None:
        raise _fail(f"quant_method fp8 with fmt {qc.get('fmt')!r}: reshard knows e4m3 and e5m2")
    return _Scheme(fmt, _block(qc.get("weight_block_size"), "weight_block_size"), "weight", "weight_scale_inv")


def _ct_scheme(weights: dict[str, Any], fmt: str) -> _Scheme | None:
    """The scheme of a compressed-tensors group (its ``weights`` args and compression format); None for the
    formats that hold no scaled floats (integers, dense, sparse)."""
    bits, kind, strategy, group = (weights.get(k) for k in ("num_bits", "type", "strategy", "group_size"))
    if kind != "float":
        return None
    if fmt == "nvfp4-pack-quantized" and bits == 4 and group == 16:
        return _Scheme("nvfp4_divisor", (1, 16), "weight_packed", "weight_scale", "weight_global_scale")
    if fmt == "mxfp4-pack-quantized" and bits == 4 and group == 32:
        return _Scheme("mxfp4", (1, 32), "weight_packed", "weight_scale")
    if fmt == "mxfp8-quantized" and bits == 8 and group == 32:
        return _Scheme("mxfp8_e4m3", (1, 32), "weight", "weight_scale")
    if fmt in ("float-quantized", "naive-quantized") and bits == 8:
        blocks: dict[object, Block] = {"tensor": (None, None), "channel": (1, None)}
        if strategy == "group":
            blocks["group"] = (1, _block([1, group], "group_size")[1])
        if strategy == "block":
            blocks["block"] = _block(weights.get("block_structure"), "block_structure")
        if strategy in blocks:
            return _Scheme("fp8_e4m3", blocks[strategy], "weight", "weight_scale")
    raise _fail(f"compressed-tensors format {fmt!r} with weights {weights!r} is not a format reshard can load")


def _ct_groups(qc: dict[str, Any]) -> list[tuple[list[str], _Scheme]]:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict):
        raise _fail("compressed-tensors quantization_config has no config_groups object")
    out = []
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("targets", []), list):
            raise _fail(f"config group {name!r} must be an object with a targets list")
        weights, fmt = group.get("weights"), group.get("format") or qc.get("format")
        if weights is None:
            continue
        if not isinstance(weights, dict) or not isinstance(fmt, str):
            raise _fail(f"config group {name!r}: weights must be an object and format a string")
        scheme = _ct_scheme(weights, fmt)
        if scheme is not None:
            out.append(([str(t) for t in group.get("targets", [])], scheme))
    return out


def _matches(target: str, module: str) -> int:
    """How well ``target`` names ``module`` (compressed-tensors' precedence): 3 the name, 2 a ``re:`` pattern,
    1 a module class (every Linear here: the files do not say a module's class), 0 not at all."""
    if target == module:
        return 3
    if target.startswith("re:"):
        try:
            return 2 if re.match(target[3:], module) else 0
        except re.error as exc:
            raise _fail(f"target {target!r} is not a regular expression: {exc}") from exc
    return 1 if "." not in target and target[:1].isupper() else 0


def _scheme_for(module: str, groups: list[tuple[list[str], _Scheme]], ignore: list[str]) -> _Scheme | None:
    if any(_matches(t, module) >= 2 for t in ignore):
        return None
    ranked = [(max((_matches(t, module) for t in targets), default=0), s) for targets, s in groups]
    best = max((rank for rank, _ in ranked), default=0)
    schemes = {s for rank, s in ranked if rank == best and best}
    if len(schemes) > 1:
        raise _fail(f"module {module!r} is targeted by config groups of different schemes: {sorted(map(str, schemes))}")
    return next(iter(schemes), None)


def describe_pairs(storage: Storage, tensors: dict[str, tuple[str, TensorEntry]]) -> dict[str, Any] | None:
    """The pairs of the checkpoint (JSON-able, for the description the coordinator sends), found through
    config.json and checked against ``tensors`` (name -> (file, entry)); None when the config names no
    quantization. Reads each global scale (4 bytes), so that fused targets can check that their parts share one.

    Raises:
        CorruptCheckpointError: a hostile or inconsistent config or pair; an FP8 tensor that is not the data of
            a pair; a compressed-tensors float format reshard cannot read.
    """
    qc = read_quantization_config(storage)
    entries = {name: entry for name, (_, entry) in tensors.items()}
    if qc is None:
        _refuse_unpaired_scales(entries, Pairs({}))
        return None
    method = qc["quant_method"]
    if method == "fp8":
        fine = _fine_grained(qc)
        schemes: Any = lambda module: fine  # noqa: E731
    elif method == "compressed-tensors":
        groups, ignore = _ct_groups(qc), qc.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise _fail("ignore must be a list of strings")
        schemes = lambda module: _scheme_for(module, groups, ignore)  # noqa: E731
    else:
        schemes = lambda module: None  # noqa: E731
    pairs: dict[str, Pair] = {}
    for name, entry in entries.items():
        for suffix in ("weight", "weight_packed"):
            if name.endswith("." + suffix):
                module = name[: -len(suffix) - 1]
                scheme = schemes(module)
                plain = suffix == "weight" and entry.dtype not in _FP8_CODES
                if scheme is not None and scheme.data == suffix and not (plain and _lone(module, scheme, entries)):
                    pair = _pair(module, scheme, entries)
                    pairs[pair.name] = _with_global(storage, pair, tensors)
    _refuse_loose_fp8(method, entries, Pairs(pairs))
    _refuse_unpaired_scales(entries, Pairs(pairs))
    return {name: pair.to_json() for name, pair in pairs.items()}


def _lone(module: str, scheme: _Scheme, tensors: dict[str, TensorEntry]) -> bool:
    """Whether ``module`` has no scale tensor: its high-precision weight is plain (a norm, an ignored Linear)."""
    return f"{module}.{scheme.scale}" not in tensors


def _pair(module: str, scheme: _Scheme, tensors: dict[str, TensorEntry]) -> Pair:
    """The pair of ``module``, its tensors checked against ``scheme``."""
    data = tensors[f"{module}.{scheme.data}"]
    scale = tensors.get(f"{module}.{scheme.scale}")
    glob = tensors.get(f"{module}.{scheme.global_scale}") if scheme.global_scale else None
    fmt = FORMATS[scheme.format]
    if scale is None or (scheme.global_scale and glob is None):
        missing = f"{module}.{scheme.scale}" if scale is None else f"{module}.{scheme.global_scale}"
        raise _fail(f"{data.name!r} is {scheme.format} data, but its scale tensor {missing!r} is missing")
    if data.dtype != _DATA_CODES[scheme.format] or scale.dtype not in _SCALE_CODES[scheme.format]:
        raise _fail(
            f"{data.name!r} ({data.dtype}) and {scale.name!r} ({scale.dtype}) are not the data and scales of "
            f"{scheme.format} (data {_DATA_CODES[scheme.format]}, scales {sorted(_SCALE_CODES[scheme.format])})"
        )
    if len(data.shape) != 2:
        raise _fail(f"{data.name!r} has shape {list(data.shape)}; a quantized weight here is 2-D")
    logical_cols = data.shape[1] * fmt.elements_per_item
    if fmt.elements_per_item > 1 and logical_cols % (scheme.block[1] or 1):
        raise _fail(f"{data.name!r}: {logical_cols} elements per row are not whole groups of {scheme.block[1]}")
    grid = scale_grid_shape(data.shape, stored_block(fmt, scheme.block))
    if scale.shape != grid and not (math.prod(scale.shape) == 1 and math.prod(grid) == 1 and len(scale.shape) <= 2):
        raise _fail(
            f"{scale.name!r} has shape {list(scale.shape)}, but {data.name!r} of shape {list(data.shape)} with "
            f"blocks {list(scheme.block)} ({scheme.format}) has a scale grid of {list(grid)}"
        )
    if glob is not None and (glob.dtype != "F32" or math.prod(glob.shape) != 1 or len(glob.shape) > 1):
        raise _fail(f"{glob.name!r} must be one float32 (the global scale of {data.name!r})")
    name = f"{module}.weight"
    return Pair(name, data.name, scale.name, glob.name if glob else None, scheme.format, scheme.block)


def _with_global(storage: Storage, pair: Pair, tensors: dict[str, tuple[str, TensorEntry]]) -> Pair:
    if pair.global_scale is None:
        return pair
    file, entry = tensors[pair.global_scale]
    raw = bytearray(4)
    (got,) = storage.read_ranges([ReadRequest(file, entry.start, memoryview(raw))])
    if got != 4:
        raise _fail(f"the global scale {pair.global_scale!r} lies beyond the end of {file}")
    return replace(pair, global_bytes=raw.hex())


def _refuse_loose_fp8(method: str, tensors: dict[str, TensorEntry], pairs: Pairs) -> None:
    inside = {p.data for p in pairs.by_name.values()} | {p.scale for p in pairs.by_name.values()}
    loose = sorted(n for n, e in tensors.items() if e.dtype in _FP8_CODES and n not in inside)
    if loose:
        raise _fail(
            f"names quant_method {method!r}, but these FP8 tensors are not the data of a (data, scale) pair it "
            f"describes: {', '.join(loose[:10])}; reshard does not take a one-byte tensor as FP8 without its scales"
        )


_ONE_BYTE_CODES = _FP8_CODES | {"U8", "I8"}
"""The dtypes of low-precision data as safetensors names them: FP8, and packed FP4 bytes (U8, I8)."""


def _refuse_unpaired_scales(tensors: dict[str, TensorEntry], pairs: Pairs) -> None:
    """Refuse a one-byte tensor beside a scale tensor of its name (``<name>_scale_inv``, ``<name>_scale``,
    ``<module>.weight_scale`` beside ``weight_packed``) that no pair of the config holds: its data would load
    without its scales, whatever the template (and ``allow_unused`` would leave the scale behind silently)."""
    inside = {n for p in pairs.by_name.values() for n in (p.data, p.scale)}
    for name, entry in sorted(tensors.items()):
        if entry.dtype not in _ONE_BYTE_CODES or name in inside:
            continue
        siblings = [name + "_scale_inv", name + "_scale"]
        if name.endswith(".weight_packed"):
            siblings.append(name.removesuffix("_packed") + "_scale")
        scale = next((s for s in siblings if s in tensors and s not in inside), None)
        if scale is not None:
            raise _fail(
                f"{name!r} ({entry.dtype}) lies beside the scale tensor {scale!r}, but no quantization_config "
                "names them as a (data, scale) pair: loaded, the data would come without its scales; reshard "
                "does not guess the format and block (give the config.json that wrote them)"
            )


@dataclass(frozen=True, slots=True)
class ScaledLayout:
    """The scales of a scaled target: its record, each part's scale tensor name and the box (offset, shape)
    it fills in the scale grid, the grid's shape, and the global-scale tensor (None: the format has none)."""

    record: ScaledRecord
    scale_names: tuple[str, ...]
    scale_offsets: tuple[tuple[int, ...], ...]
    scale_shapes: tuple[tuple[int, ...], ...]
    grid: tuple[int, ...]
    global_scale: str | None


def scaled_layout(
    key: str,
    pairs: list[Pair],
    data_offsets: list[tuple[int, ...]],
    data_shapes: list[tuple[int, ...]],
    data_shape: tuple[int, ...],
) -> ScaledLayout:
    """The scales of target ``key``: the data of ``pairs`` fill boxes (``data_offsets``, ``data_shapes``; a
    stacked part is ``(1, ...)``) of a data tensor of ``data_shape`` (stored elements).

    Raises:
        MismatchError: parts of other formats or blocks, a part that starts inside a block (its scales could
            not follow it into one scale grid), or parts with different global scales (one target holds one).
    """
    first = pairs[0]
    fmt = FORMATS[first.format]
    if any((p.format, p.block) != (first.format, first.block) for p in pairs):
        described = ", ".join(f"{p.data} {p.format} {list(p.block)}" for p in pairs)
        raise MismatchError(f"{key!r}: its parts have different formats or blocks ({described})")
    if len({p.global_bytes for p in pairs}) > 1:
        raise MismatchError(f"{key!r}: its parts have different global scales; a ScaledTensor holds one")
    block: Block = (1,) * (len(data_shape) - 2) + first.block
    sblock = stored_block(fmt, block)
    offsets, shapes = [], []
    for pair, offset, shape in zip(pairs, data_offsets, data_shapes, strict=True):
        for axis, (o, b) in enumerate(zip(offset, sblock, strict=True)):
            if o and (b is None or o % b):
                raise MismatchError(
                    f"{key!r}: part {pair.data!r} starts at {o} on axis {axis}, inside a block of "
                    f"{block[axis] or 'the whole axis'}: its scales cannot follow it into one scale grid"
                )
        offsets.append(tuple(0 if b is None else o // b for o, b in zip(offset, sblock, strict=True)))
        shapes.append(scale_grid_shape(shape, sblock))
    block = canonical_block(fmt, block, data_shape)  # as ScaledTensor records it
    record = ScaledRecord(
        key=key,
        format=first.format,
        block=block,
        scale_key=key + SCALE_SUFFIX,
        global_scale_key=key + GLOBAL_SCALE_SUFFIX if fmt.global_scale else None,
    )
    grid = scale_grid_shape(data_shape, sblock)
    return ScaledLayout(record, tuple(p.scale for p in pairs), tuple(offsets), tuple(shapes), grid, first.global_scale)
