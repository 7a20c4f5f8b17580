"""Hugging Face safetensors files, read and written without the ``safetensors`` package.

The format: ``header_length`` as an unsigned 64-bit little-endian integer, then ``header_length`` bytes of
UTF-8 JSON, then the data. The header maps each tensor name to ``{"dtype": "F32", "shape": [...],
"data_offsets": [begin, end]}``, offsets in bytes relative to the start of the data, half-open; an
optional ``"__metadata__"`` entry is a map of strings to strings. The tensors' bytes (row-major,
little-endian) lie back to back in the data, with no gap and nothing after the last one. Writers pad the
header with spaces so that the data starts at a multiple of 8.

:func:`parse_header` and :func:`read_header` validate a header strictly (a file from a stranger is
untrusted input) and give, per tensor, its dtype, shape and absolute byte range in the file.
:class:`SafetensorsWriter` streams one file: the header first (every tensor's name, dtype and shape are
known up front), then each tensor's bytes, one tensor at a time, in pieces of any size.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from reshard.errors import CorruptCheckpointError, StateDictError
from reshard.state.codec import strict_json_loads
from reshard.state.dtypes import byte_view
from reshard.storage import FileWriter, ReadRequest, Storage

__all__ = [
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SafetensorsHeader",
    "SafetensorsWriter",
    "TensorEntry",
    "TensorSpec",
    "encode_header",
    "parse_header",
    "read_header",
    "safetensors_dtype",
]

MAX_HEADER_BYTES = 100_000_000
"""The largest header accepted (the ``safetensors`` library's own limit)."""

_MAX_NDIM = 64
_METADATA_KEY = "__metadata__"

SAFETENSORS_DTYPES: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
"""Every dtype code of the safetensors format, with its size in **bits** per element."""

_TORCH_BY_CODE: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I32": torch.int32,
    "F32": torch.float32,
    "C64": torch.complex64,
    "F64": torch.float64,
    "I64": torch.int64,
}
"""The codes that have a reshard dtype (docs/format.md section 5), and that dtype."""

_CODE_BY_TORCH: dict[torch.dtype, str] = {dtype: code for code, dtype in _TORCH_BY_CODE.items()}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors code of ``dtype`` (``torch.bfloat16`` -> ``"BF16"``).

    Raises:
        StateDictError: safetensors has no code for it (complex128, for one).
    """
    code = _CODE_BY_TORCH.get(dtype)
    if code is None:
        raise StateDictError(f"safetensors has no dtype for {dtype}")
    return code


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """One tensor of a safetensors file, as its validated header describes it.

    ``start`` and ``end`` are **absolute** byte positions in the file (half-open ``[start, end)``), the
    header's ``data_offsets`` shifted by the header's own length and the 8 bytes before it.
    """

    name: str
    dtype: str
    """The safetensors code, e.g. ``"BF16"``."""
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The matching torch dtype, or None where reshard has none (U16, F8_E8M0, F4, ...)."""
        return _TORCH_BY_CODE.get(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class SafetensorsHeader:
    """A validated header: the tensors by name (in the header's order), the ``__metadata__`` map (empty
    when absent), and where the data begins and the file ends (bytes)."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int
    file_size: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorSpec:
    """A tensor a writer will write: its name, torch dtype and shape (elements)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _fail(where: str, message: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{where}: invalid safetensors file: {message}")


def _nonneg_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_header(prefix: bytes, file_size: int, *, where: str = "safetensors file") -> SafetensorsHeader:
    """Validate the header of a safetensors file of ``file_size`` bytes whose first bytes are ``prefix``
    (at least ``8 + header_length`` of them; more are ignored).

    Checks: the length fits the file and :data:`MAX_HEADER_BYTES`; the header is UTF-8 JSON starting with
    ``{``, with only spaces after the closing brace, no duplicate keys and no NaN/Infinity; every entry
    has exactly ``dtype``, ``shape`` and ``data_offsets``; dtypes are known codes; shapes have at most 64
    non-negative integers; each ``[begin, end)`` holds exactly ``prod(shape)`` elements of whole bytes;
    and the tensors, taken by offset, cover the data from its first byte to the end of the file with no
    gap and no overlap. ``__metadata__``, if present, maps strings to strings.

    Raises:
        CorruptCheckpointError: anything wrong, naming ``where`` and the tensor.
    """
    if file_size < 8 or len(prefix) < 8:
        raise _fail(where, f"{file_size} bytes is too short for the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise _fail(where, f"header length {length} is above the limit of {MAX_HEADER_BYTES} bytes")
    if 8 + length > file_size:
        raise _fail(where, f"header length {length} runs past the end of the file ({file_size} bytes)")
    if len(prefix) < 8 + length:
        raise ValueError(f"parse_header needs the first {8 + length} bytes of {where}, got {len(prefix)}")
    raw = bytes(prefix[8 : 8 + length])
    if not raw.startswith(b"{"):
        raise _fail(where, "the header does not start with '{'")
    if not raw.rstrip(b" ").endswith(b"}"):
        raise _fail(where, "the header is followed by something other than space padding")
    try:
        doc = strict_json_loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise _fail(where, f"the header is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):  # pragma: no cover - a '{...}' document is an object
        raise _fail(where, "the header is not a JSON object")
    data_start = 8 + length
    metadata: dict[str, str] = {}
    if _METADATA_KEY in doc:
        value = doc[_METADATA_KEY]
        if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
            raise _fail(where, "__metadata__ must map strings to strings")
        metadata = dict(value)
    entries: dict[str, TensorEntry] = {}
    for name, value in doc.items():
        if name == _METADATA_KEY:
            continue
        entries[name] = _parse_entry(name, value, data_start, where)
    position = data_start
    for entry in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if entry.start != position:
            problem = "overlaps the tensor before it" if entry.start < position else "leaves a gap before it"
            raise _fail(where, f"tensor {entry.name!r} at data bytes [{entry.start - data_start}, ...) {problem}")
        position = entry.end
    if position != file_size:
        raise _fail(where, f"the tensors end at byte {position} but the file has {file_size} bytes")
    return SafetensorsHeader(tensors=entries, metadata=metadata, data_start=data_start, file_size=file_size)


def _parse_entry(name: str, value: object, data_start: int, where: str) -> TensorEntry:
    what = f"tensor {name!r}"
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
        raise _fail(where, f"{what}: expected exactly the fields dtype, shape and data_offsets")
    code = value["dtype"]
    if not isinstance(code, str) or code not in SAFETENSORS_DTYPES:
        raise _fail(where, f"{what}: unknown dtype {code!r}")
    shape = value["shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(_nonneg_int(s) for s in shape):
        raise _fail(where, f"{what}: shape must be a list of at most {_MAX_NDIM} non-negative integers")
    offsets = value["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_nonneg_int(o) for o in offsets):
        raise _fail(where, f"{what}: data_offsets must be two non-negative integers")
    begin, end = offsets
    if end < begin:
        raise _fail(where, f"{what}: data_offsets [{begin}, {end}) end before they begin")
    bits = math.prod(shape) * SAFETENSORS_DTYPES[code]
    if bits % 8:
        raise _fail(where, f"{what}: {math.prod(shape)} elements of {code} are not a whole number of bytes")
    if end - begin != bits // 8:
        raise _fail(where, f"{what}: data_offsets span {end - begin} bytes, its shape and dtype need {bits // 8}")
    return TensorEntry(name=name, dtype=code, shape=tuple(shape), start=data_start + begin, end=data_start + end)


def read_header(storage: Storage, name: str) -> SafetensorsHeader:
    """Read and validate the header of file ``name`` of ``storage`` (two small reads; no tensor data).

    Raises:
        CorruptCheckpointError: the header is invalid (see :func:`parse_header`).
        OSError: the file cannot be read.
    """
    where = storage.describe(name)
    size = storage.size(name)
    head = bytearray(min(8, size))
    storage.read_ranges([ReadRequest(name, 0, memoryview(head))])
    if size < 8:
        return parse_header(bytes(head), size, where=where)
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        return parse_header(bytes(head), size, where=where)  # raises, naming the problem
    body = bytearray(length)
    (got,) = storage.read_ranges([ReadRequest(name, 8, memoryview(body))])
    if got != length:
        raise _fail(where, f"the file ended inside the header ({got} of {length} bytes)")
    return parse_header(bytes(head) + bytes(body), size, where=where)


def encode_header(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and the JSON header of a file holding ``specs`` back to back, in that order:
    compact JSON, padded with spaces to a multiple of 8 bytes so that the data starts aligned.

    Raises:
        StateDictError: a name is repeated or reserved, or a dtype has no safetensors code.
    """
    header: dict[str, object] = {}
    if metadata:
        header[_METADATA_KEY] = {str(k): str(v) for k, v in metadata.items()}
    position = 0
    for spec in specs:
        if spec.name == _METADATA_KEY or spec.name in header:
            raise StateDictError(f"tensor name {spec.name!r} is repeated or reserved in a safetensors file")
        header[spec.name] = {
            "dtype": safetensors_dtype(spec.dtype),
            "shape": list(spec.shape),
            "data_offsets": [position, position + spec.nbytes],
        }
        position += spec.nbytes
    raw = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("ascii")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class SafetensorsWriter:
    """Streams one safetensors file into a :class:`~reshard.storage.FileWriter`.

    Call order: construct (writes the header), then for each spec, in order, :meth:`write` its bytes in
    pieces (any split) and :meth:`end_tensor`; finally :meth:`close`, which checks that every tensor was
    written whole and commits the file. On any failure call :meth:`abort`. Not thread-safe.
    """

    def __init__(self, sink: FileWriter, specs: list[TensorSpec], metadata: Mapping[str, str] | None = None) -> None:
        self.sink = sink
        self.specs = specs
        sink.write(memoryview(encode_header(specs, metadata)))
        self._index = 0
        self._written = 0

    @property
    def current(self) -> TensorSpec:
        """The tensor whose bytes are expected next."""
        if self._index >= len(self.specs):
            raise StateDictError("every tensor of this safetensors file has been written")
        return self.specs[self._index]

    def write(self, piece: torch.Tensor) -> None:
        """Append the next elements of the current tensor (a contiguous CPU tensor of its dtype, any shape,
        its elements taken in row-major order)."""
        spec = self.current
        if piece.dtype != spec.dtype:
            raise StateDictError(f"tensor {spec.name!r}: got {piece.dtype} data, expected {spec.dtype}")
        data = byte_view(piece.contiguous())
        if self._written + len(data) > spec.nbytes:
            raise StateDictError(f"tensor {spec.name!r}: more than its {spec.nbytes} bytes were written")
        self.sink.write(data)
        self._written += len(data)

    def end_tensor(self) -> None:
        """Finish the current tensor, which must be complete."""
        spec = self.current
        if self._written != spec.nbytes:
            raise StateDictError(f"tensor {spec.name!r}: {self._written} of its {spec.nbytes} bytes were written")
        self._index += 1
        self._written = 0

    def close(self) -> None:
        """Commit the file (durable after this). Every tensor must have been written."""
        if self._index != len(self.specs):
            raise StateDictError(f"{len(self.specs) - self._index} tensors of the safetensors file were not written")
        self.sink.commit()

    def abort(self) -> None:
        """Discard the partial file; never raises."""
        self.sink.abort()
