"""reshard's own safetensors reader and writer, checked against the ``safetensors`` library both ways."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from reshard.errors import CorruptCheckpointError, StateDictError
from reshard.interop.safetensors import SafetensorsWriter, TensorSpec, encode_header, parse_header, read_header
from reshard.storage import LocalStorage

pytestmark = pytest.mark.unit


def _samples() -> dict[str, torch.Tensor]:
    values = torch.linspace(-3, 3, 24, dtype=torch.float64).reshape(2, 3, 4)
    return {
        "f64": values,
        "f32": values.float()[1],
        "f16": values.half()[:, 0],
        "bf16": values.bfloat16().reshape(4, 6),
        "f8_e4m3": values.float()[0].to(torch.float8_e4m3fn),
        "f8_e5m2": values.float()[0].to(torch.float8_e5m2),
        "c64": torch.complex(values.float(), -values.float())[0, 0],
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "i32": torch.arange(7, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 200, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
    }


def _write(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None, piece: int) -> None:
    """Stream ``tensors`` through reshard's writer, ``piece`` elements at a time."""
    specs = [TensorSpec(name=k, dtype=v.dtype, shape=tuple(v.shape)) for k, v in tensors.items()]
    storage = LocalStorage(path.parent)
    writer = SafetensorsWriter(storage.open_writer(path.name), specs, metadata)
    for spec in specs:
        flat = tensors[spec.name].reshape(-1)
        for start in range(0, flat.numel(), piece):
            writer.write(flat[start : start + piece])
        writer.end_tensor()
    writer.close()


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_streamed_file_reads_back_with_the_safetensors_library(tmp_path: Path) -> None:
    tensors = _samples()
    path = tmp_path / "model.safetensors"
    _write(path, tensors, {"format": "pt", "note": "héllo"}, piece=5)
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert _tensor_bytes(loaded[name]) == _tensor_bytes(tensor), name
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "note": "héllo"}
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert length % 8 == 0  # data starts aligned


def test_header_of_a_library_written_file_gives_absolute_byte_ranges(tmp_path: Path) -> None:
    tensors = {k: v.contiguous().clone() for k, v in _samples().items() if k != "c64"}
    path = tmp_path / "lib.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    raw = path.read_bytes()
    header = read_header(LocalStorage(tmp_path), path.name)
    assert header.metadata == {"format": "pt"}
    assert header.file_size == len(raw)
    assert set(header.tensors) == set(tensors)
    for name, tensor in tensors.items():
        entry = header.tensors[name]
        assert entry.shape == tuple(tensor.shape)
        assert entry.torch_dtype == tensor.dtype
        assert raw[entry.start : entry.end] == _tensor_bytes(tensor), name
    assert parse_header(raw, len(raw)) == header


def _file(header: object, data: bytes = b"", *, pad: bytes = b"") -> bytes:
    raw = (header if isinstance(header, bytes) else json.dumps(header).encode()) + pad
    return struct.pack("<Q", len(raw)) + raw + data


def _u8(offsets: list[int], shape: object = None) -> dict[str, object]:
    return {"dtype": "U8", "shape": shape if shape is not None else [offsets[1] - offsets[0]], "data_offsets": offsets}


BAD_FILES = {
    "shorter than the length field": (b"\x01\x00", "too short"),
    "length past the end": (struct.pack("<Q", 100) + b"{}", "runs past the end"),
    "length above the limit": (struct.pack("<Q", 200_000_000) + b"{}", "above the limit"),
    "not an object": (_file(b"[1, 2]  "), "does not start with '{'"),
    "leading space": (_file(b' {"a": 1}'), "does not start with '{'"),
    "NUL padding": (_file({"a": _u8([0, 1])}, b"x", pad=b"\x00\x00"), "other than space padding"),
    "duplicate names": (_file(b'{"a":' + json.dumps(_u8([0, 1])).encode() * 1 + b',"a":{}}', b"x"), "not valid JSON"),
    "NaN": (_file(b'{"__metadata__": {"x": NaN}}'), "not valid JSON"),
    "extra field": (_file({"a": {**_u8([0, 1]), "extra": 1}}, b"x"), "exactly the fields"),
    "unknown dtype": (_file({"a": {**_u8([0, 1]), "dtype": "C128"}}, b"x"), "unknown dtype"),
    "float in shape": (_file({"a": _u8([0, 1], [1.0])}, b"x"), "non-negative integers"),
    "bool in shape": (_file({"a": _u8([0, 1], [True])}, b"x"), "non-negative integers"),
    "negative offset": (_file({"a": _u8([-1, 1], [2])}, b"xx"), "two non-negative integers"),
    "offsets reversed": (_file({"a": _u8([1, 0], [0])}, b"x"), "end before they begin"),
    "size does not match shape": (_file({"a": _u8([0, 2], [3])}, b"xx"), "need 3"),
    "sub-byte total": (_file({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, b"x"), "whole number"),
    "gap": (_file({"a": _u8([1, 2])}, b"xx"), "leaves a gap"),
    "overlap": (_file({"a": _u8([0, 2]), "b": _u8([1, 2])}, b"xx"), "overlaps"),
    "trailing bytes": (_file({"a": _u8([0, 1])}, b"xy"), "the file has"),
    "missing bytes": (_file({"a": _u8([0, 2])}, b"x"), "the file has"),
    "metadata not strings": (_file({"__metadata__": {"a": 1}}), "map strings to strings"),
    "too many axes": (_file({"a": _u8([0, 1], [1] * 65)}, b"x"), "at most 64"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_strict_header_validation_refuses(case: str, tmp_path: Path) -> None:
    raw, message = BAD_FILES[case]
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)):
        parse_header(raw, len(raw), where="bad.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(raw)
    with pytest.raises(CorruptCheckpointError, match=r"bad\.safetensors: invalid safetensors file"):
        read_header(LocalStorage(tmp_path), "bad.safetensors")


def test_valid_edge_cases_are_accepted() -> None:
    empty = _file({})
    assert parse_header(empty, len(empty)).tensors == {}
    zero_sized = _file({"z": _u8([0, 0], [0, 5]), "a": _u8([0, 1])}, b"x", pad=b"   ")
    header = parse_header(zero_sized, len(zero_sized))
    assert header.tensors["z"].nbytes == 0 and header.tensors["a"].end == len(zero_sized)
    odd = _file({"u16": {"dtype": "U16", "shape": [1], "data_offsets": [0, 2]}}, b"xx")
    assert parse_header(odd, len(odd)).tensors["u16"].torch_dtype is None  # a code reshard has no dtype for


def test_writer_refuses_misuse(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    specs = [TensorSpec(name="a", dtype=torch.float32, shape=(2,)), TensorSpec(name="b", dtype=torch.int8, shape=())]
    writer = SafetensorsWriter(storage.open_writer("w.safetensors"), specs)
    with pytest.raises(StateDictError, match=r"expected torch\.float32"):
        writer.write(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(StateDictError, match="more than its 8 bytes"):
        writer.write(torch.zeros(3))
    writer.write(torch.zeros(1))
    with pytest.raises(StateDictError, match="4 of its 8 bytes"):
        writer.end_tensor()
    writer.write(torch.zeros(1))
    writer.end_tensor()
    with pytest.raises(StateDictError, match="1 tensors of the safetensors file were not written"):
        writer.close()
    writer.abort()
    assert not (tmp_path / "w.safetensors").exists()
    with pytest.raises(StateDictError, match="repeated or reserved"):
        encode_header([specs[0], specs[0]])
    with pytest.raises(StateDictError, match="repeated or reserved"):
        encode_header([TensorSpec(name="__metadata__", dtype=torch.float32, shape=())])
    with pytest.raises(StateDictError, match=r"no dtype for torch\.complex128"):
        encode_header([TensorSpec(name="c", dtype=torch.complex128, shape=(1,))])
