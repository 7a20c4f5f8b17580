"""Pickle-free encodings of non-tensor values: common state and :class:`~reshard.ShardedObject` values.

*Tagged JSON* keeps Python types that plain JSON would lose. A JSON object whose only key starts with
``$`` is a tag:

==================================  ==========================================================
``{"$float": "nan"|"inf"|"-inf"}``  a non-finite float
``{"$tuple": [...]}``               a tuple
``{"$dict": [[k, v], ...]}``        a dict whose keys are not all strings, or start with ``$``
``{"$bytes": "<base64>"}``          bytes
``{"$tensor": i}``                  tensor ``i`` of the enclosing object blob
``{"$ndarray": i}``                 tensor ``i`` of the blob, returned as a numpy array
==================================  ==========================================================

An *object blob* stores one ShardedObject value: an 8-byte little-endian header length ``n``, ``n``
bytes of UTF-8 JSON ``{"value": <tagged>, "tensors": [{"dtype", "shape", "offset", "length"}...]}``
(offsets relative to the end of the header), then the tensors' raw little-endian bytes.
Decoding validates every field and never executes anything.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Any

import numpy as np
import torch

from reshard.errors import CorruptCheckpointError, StateDictError
from reshard.state.dtypes import DTYPE_BY_NAME, byte_view, dtype_name

__all__ = ["decode_object_blob", "decode_tagged", "encode_object_blob", "encode_tagged", "strict_json_loads"]

JSONValue = Any
"""A value made of dict/list/str/int/float/bool/None, as ``json`` produces."""

_MAX_DEPTH = 64


def _refuse_constant(name: str) -> object:
    raise ValueError(f"non-standard JSON constant {name}")


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def strict_json_loads(raw: bytes) -> Any:
    """Parse UTF-8 JSON strictly: no NaN/Infinity constants, no duplicate keys.

    Raises:
        UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError: invalid input.
    """
    return json.loads(
        raw.decode("utf-8"),
        parse_constant=_refuse_constant,
        parse_float=_finite_float,
        object_pairs_hook=_refuse_duplicates,
    )


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} overflows a float")
    return value


def encode_tagged(value: object, tensors: list[torch.Tensor] | None = None, *, where: str = "") -> JSONValue:
    """Encode ``value`` as tagged JSON. Tensors and numpy arrays are appended to ``tensors`` when it
    is given, and refused otherwise.

    Raises:
        StateDictError: for a value of a type the encoding does not cover (``where`` names it).
    """
    return _encode(value, tensors, where, 0)


def _encode(value: object, tensors: list[torch.Tensor] | None, where: str, depth: int) -> JSONValue:
    if depth > _MAX_DEPTH:
        raise StateDictError(f"{where}: value is nested deeper than {_MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, list):
        return [_encode(v, tensors, where, depth + 1) for v in value]
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, tensors, where, depth + 1) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, tensors, where, depth + 1) for k, v in value.items()}
        return {
            "$dict": [
                [_encode(k, tensors, where, depth + 1), _encode(v, tensors, where, depth + 1)] for k, v in value.items()
            ]
        }
    if isinstance(value, torch.Tensor) and tensors is not None:
        tensors.append(value.detach())
        return {"$tensor": len(tensors) - 1}
    if isinstance(value, np.ndarray) and tensors is not None:
        tensors.append(_tensor_of_array(value, where))
        return {"$ndarray": len(tensors) - 1}
    if isinstance(value, np.generic):
        return _encode(value.item(), tensors, where, depth + 1)
    raise StateDictError(
        f"{where}: cannot store a value of type {type(value).__name__} (reshard stores JSON-like "
        "values, bytes and tensors, and never pickles)"
    )


def _tensor_of_array(array: np.ndarray[Any, Any], where: str) -> torch.Tensor:
    """A tensor with the array's dtype and shape (0-d included), in native byte order."""
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    try:
        return torch.from_numpy(array)
    except (TypeError, ValueError) as exc:
        raise StateDictError(f"{where}: cannot store a numpy array of dtype {array.dtype}: {exc}") from exc


def decode_tagged(data: JSONValue, tensors: list[torch.Tensor] | None = None, *, where: str = "") -> object:
    """Decode tagged JSON produced by :func:`encode_tagged`.

    Raises:
        CorruptCheckpointError: for anything :func:`encode_tagged` cannot have produced.
    """
    return _decode(data, tensors, where, 0)


def _decode(data: JSONValue, tensors: list[torch.Tensor] | None, where: str, depth: int) -> object:
    if depth > _MAX_DEPTH:
        raise CorruptCheckpointError(f"{where}: value is nested deeper than {_MAX_DEPTH} levels")
    if data is None or isinstance(data, bool | str | int | float):
        return data
    if isinstance(data, list):
        return [_decode(v, tensors, where, depth + 1) for v in data]
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"{where}: unexpected JSON value of type {type(data).__name__}")
    if len(data) == 1:
        ((tag, payload),) = data.items()
        if tag.startswith("$"):
            return _decode_tag(tag, payload, tensors, where, depth)
    if any(k.startswith("$") for k in data):
        raise CorruptCheckpointError(f"{where}: malformed tag in {sorted(data)[:3]}")
    return {k: _decode(v, tensors, where, depth + 1) for k, v in data.items()}


def _decode_tag(tag: str, payload: JSONValue, tensors: list[torch.Tensor] | None, where: str, depth: int) -> object:
    if tag == "$float" and payload in ("nan", "inf", "-inf"):
        return float(payload)
    if tag == "$tuple" and isinstance(payload, list):
        return tuple(_decode(v, tensors, where, depth + 1) for v in payload)
    if tag == "$dict" and isinstance(payload, list):
        out: dict[Any, object] = {}
        for item in payload:
            if not isinstance(item, list) or len(item) != 2:
                raise CorruptCheckpointError(f"{where}: malformed $dict entry")
            key = _decode(item[0], tensors, where, depth + 1)
            try:
                out[key] = _decode(item[1], tensors, where, depth + 1)
            except TypeError as exc:
                raise CorruptCheckpointError(f"{where}: unhashable $dict key") from exc
        return out
    if tag == "$bytes" and isinstance(payload, str):
        try:
            return base64.b64decode(payload.encode("ascii"), validate=True)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{where}: invalid base64 in $bytes") from exc
    if tag in ("$tensor", "$ndarray") and tensors is not None:
        if not isinstance(payload, int) or isinstance(payload, bool) or not 0 <= payload < len(tensors):
            raise CorruptCheckpointError(f"{where}: {tag} index {payload!r} is out of range")
        tensor = tensors[payload]
        if tag == "$tensor":
            return tensor
        try:
            return tensor.numpy()
        except TypeError as exc:
            raise CorruptCheckpointError(f"{where}: $ndarray of dtype {tensor.dtype}, which numpy lacks") from exc
    raise CorruptCheckpointError(f"{where}: unknown or malformed tag {tag!r}")


def encode_object_blob(value: object, *, where: str) -> bytes:
    """Serialise one ShardedObject value (with any tensors in it) into a self-describing blob."""
    tensors: list[torch.Tensor] = []
    tagged = encode_tagged(value, tensors, where=where)
    entries = []
    payloads = []
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in DTYPE_BY_NAME.values():
            raise StateDictError(f"{where}: tensor dtype {tensor.dtype} cannot be stored")
        raw = byte_view(tensor.detach().cpu().resolve_conj().resolve_neg().contiguous())
        entries.append(
            {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "offset": offset, "length": len(raw)}
        )
        payloads.append(raw)
        offset += len(raw)
    header = json.dumps({"value": tagged, "tensors": entries}, separators=(",", ":"), allow_nan=False).encode()
    return b"".join([struct.pack("<Q", len(header)), header, *payloads])


def decode_object_blob(blob: bytes | memoryview, *, where: str) -> object:
    """Rebuild a value from :func:`encode_object_blob`'s bytes, validating every field.

    Raises:
        CorruptCheckpointError: the blob is malformed.
    """
    blob = memoryview(blob)
    if len(blob) < 8:
        raise CorruptCheckpointError(f"{where}: object blob of {len(blob)} bytes is too short")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if header_len > len(blob) - 8:
        raise CorruptCheckpointError(f"{where}: object header length {header_len} exceeds the blob")
    try:
        header = strict_json_loads(bytes(blob[8 : 8 + header_len]))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{where}: object header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict) or set(header) != {"value", "tensors"} or not isinstance(header["tensors"], list):
        raise CorruptCheckpointError(f"{where}: object header must hold exactly 'value' and 'tensors'")
    body = blob[8 + header_len :]
    tensors: list[torch.Tensor] = []
    for i, entry in enumerate(header["tensors"]):
        tensors.append(_decode_tensor_entry(entry, body, f"{where}: tensor {i}"))
    return decode_tagged(header["value"], tensors, where=where)


def _decode_tensor_entry(entry: object, body: memoryview, where: str) -> torch.Tensor:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "offset", "length"}:
        raise CorruptCheckpointError(f"{where}: malformed tensor entry")
    dtype = DTYPE_BY_NAME.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
    shape = entry["shape"]
    offset, length = entry["offset"], entry["length"]
    if dtype is None:
        raise CorruptCheckpointError(f"{where}: unknown dtype {entry['dtype']!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise CorruptCheckpointError(f"{where}: malformed shape {shape!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
        raise CorruptCheckpointError(f"{where}: malformed offset or length")
    if math.prod(shape) * dtype.itemsize != length or offset + length > len(body):
        raise CorruptCheckpointError(f"{where}: shape {shape} does not match {length} bytes at {offset}")
    raw = torch.frombuffer(bytearray(body[offset : offset + length]), dtype=torch.uint8) if length else None
    if raw is None:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)
