"""Tests of the pickle-free encodings (tagged JSON, object blobs) and of ``metadata.json`` validation.

A hostile or damaged ``metadata.json`` must always be refused with :class:`reshard.CorruptCheckpointError`,
never another exception type, before anything is read or allocated.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reshard
from reshard import CorruptCheckpointError, ShardedObject, StateDictError
from reshard.metadata import METADATA_FILE, Metadata, check_relative_path
from reshard.state.codec import decode_object_blob, decode_tagged, encode_object_blob, encode_tagged
from reshard.state.dtypes import DTYPE_BY_NAME
from tests.metadata_docs import dumps, read_doc, seal, unseal
from tests.tiers import examples

pytestmark = pytest.mark.unit

PROPERTY = settings(max_examples=examples(150), deadline=None, database=None)


def same(a: object, b: object) -> bool:
    """Deep equality that also compares types (tuple vs list, int vs bool vs float), NaN, signed zeros,
    dict order and tensor bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        assert isinstance(b, float)
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, list | tuple):
        assert isinstance(b, list | tuple)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        assert isinstance(b, dict)
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True)
        )
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return a.dtype == b.dtype and a.shape == b.shape and _bytes(a) == _bytes(b)
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def through_json(value: object) -> object:
    """Encode, serialise strictly (no NaN in the JSON text), parse and decode."""
    text = json.dumps(encode_tagged(value, where="v"), allow_nan=False)
    return decode_tagged(json.loads(text), where="v")


# --------------------------------------------------------------------------------------------------
# Tagged JSON


ROUND_TRIPS: list[tuple[str, object]] = [
    ("none", None),
    ("bools", [True, False]),
    ("ints", [0, -1, 2**70, -(2**63)]),
    ("floats", [0.0, -0.0, 1.5, 1e-310, 1.7976931348623157e308]),
    ("nan", float("nan")),
    ("inf", [float("inf"), float("-inf")]),
    ("str", "héllo\x00\n\"'"),
    ("dollar_string_value", "$tuple"),
    ("tuple", (1, (2, 3), ())),
    ("empty", [[], {}, ()]),
    ("nested_dict", {"a": {"b": [1, {"c": (None,)}]}}),
    ("int_keys", {1: "a", 2: "b"}),
    ("mixed_keys", {"a": 1, 2: "b", (3, "x"): [4], None: 0, True: 1, 1.5: 2}),
    ("dollar_keys", {"$tuple": [1, 2], "$float": "nan", "$x": {"$y": 1}}),
    ("one_dollar_key", {"$bytes": "AAAA"}),
    ("bytes", [b"", b"\x00\xff" * 5]),
    ("nested_non_finite", {"lr": (float("nan"), {"m": [float("inf")]})}),
    ("order", {"z": 1, "a": 2, "m": 3}),
]


@pytest.mark.parametrize("value", [v for _, v in ROUND_TRIPS], ids=[name for name, _ in ROUND_TRIPS])
def test_tagged_round_trip(value: object) -> None:
    assert same(through_json(value), value)


def test_tagged_encoding_is_plain_json() -> None:
    encoded = encode_tagged({"a": (1, b"x"), 3: float("nan")})
    assert encoded == {"$dict": [["a", {"$tuple": [1, {"$bytes": "eA=="}]}], [3, {"$float": "nan"}]]}


def test_numpy_scalars_become_python_values() -> None:
    value = {"f": np.float32(1.5), "i": np.int64(7), "b": np.bool_(True), "d": np.float64("nan")}
    decoded = through_json(value)
    assert isinstance(decoded, dict)
    assert same(decoded, {"f": 1.5, "i": 7, "b": True, "d": float("nan")})


JSON_KEYS = st.one_of(
    st.text(max_size=4),
    st.text(max_size=3).map(lambda s: "$" + s),
    st.integers(-3, 3),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
    st.tuples(st.integers(0, 3), st.text(max_size=2)),
)
TAGGED_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8), st.binary(max_size=8)),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(JSON_KEYS, children, max_size=4),
    ),
    max_leaves=25,
)


@PROPERTY
@given(value=TAGGED_VALUES)
def test_tagged_round_trip_property(value: object) -> None:
    assert same(through_json(value), value)


class _Custom:
    pass


@pytest.mark.parametrize(
    "value",
    [
        {1, 2},
        frozenset(),
        1 + 2j,
        bytearray(b"x"),
        _Custom(),
        print,
        {"nested": [1, {"deep": object()}]},
        torch.zeros(2),
        np.zeros(2),
    ],
    ids=["set", "frozenset", "complex", "bytearray", "object", "function", "nested_object", "tensor", "ndarray"],
)
def test_unsupported_values_are_refused(value: object) -> None:
    with pytest.raises(StateDictError, match=re.escape("common value 'opt.x'")):
        encode_tagged(value, where="common value 'opt.x'")


def test_too_deep_values_are_refused() -> None:
    value: list[object] = []
    for _ in range(100):
        value = [value]
    with pytest.raises(StateDictError, match="nested deeper"):
        encode_tagged(value, where="v")


@pytest.mark.parametrize(
    "data",
    [
        {"$float": "1.0"},
        {"$float": 1.0},
        {"$tuple": 3},
        {"$tuple": {"a": 1}},
        {"$dict": [[1]]},
        {"$dict": [1, 2]},
        {"$dict": {"a": 1}},
        {"$dict": [[[1, 2], 3]]},
        {"$dict": [[{"a": 1}, 3]]},
        {"$dict": [[{"$tuple": [[1]]}, 3]]},
        {"$bytes": "!!!"},
        {"$bytes": "é"},
        {"$bytes": 5},
        {"$unknown": 1},
        {"$tensor": 0},
        {"$ndarray": 0},
        {"$tuple": [1], "$float": "nan"},
        {"$tuple": [1], "a": 2},
        {"a": {"b": [{"$x": None}]}},
        {1, 2},
        b"raw",
    ],
)
def test_malformed_tagged_json_is_corrupt(data: object) -> None:
    with pytest.raises(CorruptCheckpointError):
        decode_tagged(data, where="v")


def test_too_deep_tagged_json_is_corrupt() -> None:
    data: object = 1
    for _ in range(100):
        data = {"$tuple": [data]}
    with pytest.raises(CorruptCheckpointError, match="nested deeper"):
        decode_tagged(data, where="v")


# --------------------------------------------------------------------------------------------------
# Object blobs


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes of ``dtype`` (NaN payloads included), or 0/1 for bool."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    n = math.prod(shape) * dtype.itemsize
    return torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).view(dtype).reshape(shape)


BLOB_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex64,
    torch.complex128,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def blob_round_trip(value: object) -> object:
    blob = encode_object_blob(value, where="object 'x'")
    assert isinstance(blob, bytes)
    return decode_object_blob(blob, where="object 'x'")


@pytest.mark.parametrize("dtype", BLOB_DTYPES, ids=str)
def test_object_blob_tensors_are_bitwise_equal(dtype: torch.dtype) -> None:
    value = {"t": random_tensor(dtype, (3, 5)), "scalar": random_tensor(dtype, (), 1), "meta": (1, "a")}
    decoded = blob_round_trip(value)
    assert same(decoded, value)


def test_object_blob_with_several_tensors_and_structure() -> None:
    value = {
        "state": [random_tensor(torch.float32, (4,)), random_tensor(torch.bfloat16, (2, 2), 2)],
        "mask": random_tensor(torch.bool, (7,)),
        "empty": torch.empty(0, 3, dtype=torch.int64),
        3: (random_tensor(torch.int8, (1, 1, 2)), None, float("nan")),
        "raw": b"\x00",
    }
    decoded = blob_round_trip(value)
    assert same(decoded, value)


def test_object_blob_non_contiguous_and_grad_tensors() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    value = {"t": base.t(), "s": base[:, ::2], "g": torch.ones(3, requires_grad=True)}
    decoded = blob_round_trip(value)
    assert isinstance(decoded, dict)
    assert torch.equal(decoded["t"], base.t())
    assert torch.equal(decoded["s"], base[:, ::2])
    assert torch.equal(decoded["g"], torch.ones(3))
    assert not decoded["g"].requires_grad


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.arange(-5, 5, dtype=np.int16),
        np.array([True, False, True]),
        np.arange(24, dtype=np.float64).reshape(4, 6)[:, ::2],
        np.array([1 + 2j], dtype=np.complex64),
        np.zeros((0, 2), dtype=np.uint8),
    ],
    ids=["float32", "int16", "bool", "float64_strided", "complex64", "empty"],
)
def test_object_blob_numpy_arrays(array: np.ndarray) -> None:
    decoded = blob_round_trip({"a": array})
    assert isinstance(decoded, dict)
    assert isinstance(decoded["a"], np.ndarray)
    assert decoded["a"].dtype == array.dtype
    np.testing.assert_array_equal(decoded["a"], array)


def test_object_blob_zero_dimensional_numpy_array_keeps_its_shape() -> None:
    decoded = blob_round_trip({"a": np.array(5.0)})
    assert isinstance(decoded, dict)
    assert decoded["a"].shape == ()


@pytest.mark.parametrize(
    "array",
    [np.array([object()]), np.array(["abc"])],
    ids=["object", "str"],
)
def test_object_blob_unsupported_numpy_arrays_raise_state_dict_error(array: np.ndarray) -> None:
    with pytest.raises(StateDictError):
        encode_object_blob({"a": array}, where="object 'x'")


def test_object_blob_big_endian_array_is_stored_in_native_order() -> None:
    decoded = blob_round_trip({"a": np.arange(3, dtype=">f4")})
    assert isinstance(decoded, dict)
    assert decoded["a"].dtype == np.dtype("float32")
    assert decoded["a"].tolist() == [0.0, 1.0, 2.0]


def test_object_blob_unsupported_tensor_dtype_is_refused() -> None:
    with pytest.raises(StateDictError, match="uint16"):
        encode_object_blob({"a": torch.zeros(2, dtype=torch.uint16)}, where="object 'x'")


def test_object_blob_conjugate_view_tensor() -> None:
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    decoded = blob_round_trip({"c": x.conj()})
    assert isinstance(decoded, dict)
    assert torch.equal(decoded["c"], x.conj().resolve_conj())


def test_save_conjugate_view_tensor(tmp_path: Path) -> None:
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    reshard.save({"c": x.conj()}, tmp_path / "ckpt")
    out = reshard.load({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "ckpt")
    assert torch.equal(out["c"], x.conj().resolve_conj())


def make_blob(header: object, body: bytes = b"", *, header_len: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + body


def entry(dtype: object = "float32", shape: object = (2,), offset: object = 0, length: object = 8) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "offset": offset,
        "length": length,
    }


MALFORMED_BLOBS: dict[str, bytes] = {
    "empty": b"",
    "short": b"\x01\x02\x03",
    "header_past_end": make_blob({"value": 1, "tensors": []}, header_len=1000),
    "header_huge": make_blob(b"", header_len=2**64 - 1),
    "header_not_json": make_blob(b"{not json"),
    "header_not_utf8": make_blob(b"\xff\xfe\xfd"),
    "header_list": make_blob([1, 2]),
    "header_missing_tensors": make_blob({"value": 1}),
    "header_extra_field": make_blob({"value": 1, "tensors": [], "x": 0}),
    "tensors_not_list": make_blob({"value": 1, "tensors": {}}),
    "entry_not_dict": make_blob({"value": 1, "tensors": [5]}, bytes(8)),
    "entry_missing_field": make_blob({"value": 1, "tensors": [{"dtype": "float32", "shape": [2]}]}, bytes(8)),
    "unknown_dtype": make_blob({"value": 1, "tensors": [entry(dtype="float128")]}, bytes(8)),
    "dtype_not_str": make_blob({"value": 1, "tensors": [entry(dtype=7)]}, bytes(8)),
    "negative_shape": make_blob({"value": 1, "tensors": [entry(shape=[-2])]}, bytes(8)),
    "bool_shape": make_blob({"value": 1, "tensors": [entry(shape=[True, 2], length=8)]}, bytes(8)),
    "shape_not_list": make_blob({"value": 1, "tensors": [entry(shape=2)]}, bytes(8)),
    "negative_offset": make_blob({"value": 1, "tensors": [entry(offset=-1)]}, bytes(8)),
    "bool_length": make_blob({"value": 1, "tensors": [entry(dtype="bool", shape=[1], length=True)]}, bytes(8)),
    "length_not_shape": make_blob({"value": 1, "tensors": [entry(length=4)]}, bytes(8)),
    "huge_shape": make_blob({"value": 1, "tensors": [entry(shape=[2**40, 2**40], length=8)]}, bytes(8)),
    "past_body": make_blob({"value": 1, "tensors": [entry(offset=4)]}, bytes(8)),
    "truncated_body": make_blob({"value": 1, "tensors": [entry()]}, bytes(7)),
    "tensor_index_out_of_range": make_blob({"value": {"$tensor": 1}, "tensors": [entry()]}, bytes(8)),
    "tensor_index_negative": make_blob({"value": {"$tensor": -1}, "tensors": [entry()]}, bytes(8)),
    "tensor_index_bool": make_blob({"value": {"$tensor": True}, "tensors": [entry()]}, bytes(8)),
    "tensor_index_str": make_blob({"value": {"$ndarray": "0"}, "tensors": [entry()]}, bytes(8)),
    "bad_value_tag": make_blob({"value": {"$pickle": "gASVAAAA"}, "tensors": []}),
}


@pytest.mark.parametrize("blob", list(MALFORMED_BLOBS.values()), ids=list(MALFORMED_BLOBS))
def test_malformed_object_blob_is_corrupt(blob: bytes) -> None:
    with pytest.raises(CorruptCheckpointError, match="object 'x'"):
        decode_object_blob(blob, where="object 'x'")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_ndarray_tag_of_a_dtype_numpy_lacks_is_corrupt(dtype: str) -> None:
    itemsize = DTYPE_BY_NAME[dtype].itemsize
    blob = make_blob({"value": {"$ndarray": 0}, "tensors": [entry(dtype, (2,), 0, 2 * itemsize)]}, bytes(2 * itemsize))
    with pytest.raises(CorruptCheckpointError):
        decode_object_blob(blob, where="object 'x'")


def test_truncating_a_valid_blob_is_always_detected() -> None:
    blob = encode_object_blob({"t": random_tensor(torch.float32, (3,)), "b": b"abc"}, where="x")
    for cut in range(len(blob)):
        with pytest.raises(CorruptCheckpointError):
            decode_object_blob(blob[:cut], where="x")


# --------------------------------------------------------------------------------------------------
# metadata.json: a valid document written by reshard.save, then mutated copies


CHUNK = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("metadata") / "ckpt"
    state = {
        "model": {
            "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "b": torch.ones(5, dtype=torch.bfloat16),
            "s": torch.tensor(3, dtype=torch.int64),
        },
        "rng": ShardedObject("rng", {"seed": 7, "state": torch.arange(4, dtype=torch.uint8)}, (1,), (0,)),
        "step": 10,
        "lr": float("nan"),
        "betas": (0.9, 0.95),
        "blob": b"\x00\x01",
    }
    reshard.save(state, path, options=reshard.SaveOptions(checksum_chunk_bytes=CHUNK))
    return path


@pytest.fixture(scope="module")
def valid_doc(saved: Path) -> dict[str, Any]:
    return read_doc(saved)


def test_valid_metadata_parses(saved: Path, valid_doc: dict[str, Any]) -> None:
    raw = (saved / METADATA_FILE).read_bytes()
    metadata = Metadata.from_json_bytes(raw)
    assert metadata.to_json_dict() == valid_doc
    assert Metadata.from_json_bytes(metadata.to_json_bytes()).to_json_dict() == valid_doc
    assert set(metadata.tensors) == {"model.w", "model.b", "model.s"}
    assert metadata.tensors["model.w"].global_shape == (3, 4)
    assert metadata.tensors["model.b"].dtype == "bfloat16"
    assert metadata.tensors["model.s"].global_shape == ()
    assert len(metadata.tensors["model.w"].boxes[0].checksums) == 48 // CHUNK
    assert metadata.checksum_chunk_bytes == CHUNK
    assert set(metadata.objects) == {"rng"}
    assert metadata.common["step"] == 10
    assert (metadata.common["betas.0"], metadata.common["betas.1"]) == (0.9, 0.95)  # tuples are containers
    assert metadata.common["blob"] == b"\x00\x01"
    assert math.isnan(metadata.common["lr"])
    assert metadata.total_bytes == 48 + 10 + 8
    for f in metadata.files:
        assert (saved / f.path).stat().st_size == f.size
    assert reshard.read_metadata(saved).to_json_dict() == valid_doc


Mutation = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Mutation:
    """Set a field given by a dotted path (list indices as numbers; tensor keys contain dots, so
    ``tensors.<key>`` takes the rest up to the next ``|``)."""

    def apply(doc: dict[str, Any]) -> None:
        *parents, last = _resolve(path)
        node: Any = doc
        for part in parents:
            node = node[part]
        node[last] = copy.deepcopy(value)

    return apply


def _delete(path: str) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        *parents, last = _resolve(path)
        node: Any = doc
        for part in parents:
            node = node[part]
        del node[last]

    return apply


def _resolve(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for part in path.split("|"):
        parts.append(int(part) if part.lstrip("-").isdigit() else part)
    return parts


W = "tensors|model.w|boxes|0"
OBJ = "objects|rng|entries|0"


def _w_box(**fields: object) -> Mutation:
    def apply(doc: dict[str, Any]) -> None:
        doc["tensors"]["model.w"]["boxes"][0].update(copy.deepcopy(fields))

    return apply


def _duplicate_w_box(doc: dict[str, Any]) -> None:
    boxes = doc["tensors"]["model.w"]["boxes"]
    boxes.append(copy.deepcopy(boxes[0]))


def _split_w_box(*, drop_second: bool = False, overlap: bool = False) -> Mutation:
    """Describe the stored (3, 4) box as two boxes: rows [0, 1) and rows [1, 3) (or [0, 2) and [1, 3))."""

    def apply(doc: dict[str, Any]) -> None:
        box = doc["tensors"]["model.w"]["boxes"][0]
        first = dict(box, shape=[2 if overlap else 1, 4], byte_length=32 if overlap else 16)
        first["crc32c"] = box["crc32c"][: first["byte_length"] // CHUNK]
        second = dict(box, offset=[1, 0], shape=[2, 4], byte_offset=box["byte_offset"] + 16, byte_length=32)
        second["crc32c"] = box["crc32c"][2:6]
        doc["tensors"]["model.w"]["boxes"] = [first] if drop_second else [first, second]

    return apply


def _shrink_first_file(doc: dict[str, Any]) -> None:
    doc["files"][0]["size"] = doc["tensors"]["model.w"]["boxes"][0]["byte_offset"] + 40


def _repeat_first_file(doc: dict[str, Any]) -> None:
    doc["files"].append({"path": doc["files"][0]["path"], "size": 0})


def _duplicate_object_entry(doc: dict[str, Any]) -> None:
    entries = doc["objects"]["rng"]["entries"]
    entries.append(copy.deepcopy(entries[0]))


def _byte_length_off_by_one_element(doc: dict[str, Any]) -> None:
    box = doc["tensors"]["model.w"]["boxes"][0]
    box["byte_length"] = 40
    box["crc32c"] = box["crc32c"][:5]


MUTATIONS: dict[str, tuple[Mutation, str]] = {
    # format and version
    "format_other": (_set("format", "zarr"), "format"),
    "format_missing": (_delete("format"), "format"),
    "version_4": (_set("version", 4), "version"),
    "version_str": (_set("version", "1"), "version"),
    "version_missing": (_delete("version"), "version"),
    "version_true": (_set("version", True), "version"),
    "version_float": (_set("version", 1.0), "version"),
    # fields
    "unknown_top_field": (_set("extra", 1), "extra"),
    "missing_files": (_delete("files"), "files"),
    "missing_common": (_delete("common"), "common"),
    "checksum_algorithm": (_set("checksum|algorithm", "md5"), "algorithm"),
    "checksum_extra_field": (_set("checksum|salt", 1), "checksum"),
    "chunk_bytes_zero": (_set("checksum|chunk_bytes", 0), "chunk_bytes"),
    "chunk_bytes_negative": (_set("checksum|chunk_bytes", -8), "chunk_bytes"),
    "chunk_bytes_bool": (_set("checksum|chunk_bytes", True), "chunk_bytes"),
    "chunk_bytes_float": (_set("checksum|chunk_bytes", 8.0), "chunk_bytes"),
    "world_size_negative": (_set("world_size", -1), "world_size"),
    "world_size_zero": (_set("world_size", 0), "world_size"),
    "world_size_bool": (_set("world_size", True), "world_size"),
    "world_size_str": (_set("world_size", "1"), "world_size"),
    "world_size_huge": (_set("world_size", 2**63), "world_size"),
    "save_id_int": (_set("save_id", 5), "save_id"),
    "created_by_null": (_set("created_by", None), "created_by"),
    # files
    "files_not_list": (_set("files", {"path": "x"}), "files"),
    "file_extra_field": (_set("files|0|mode", "w"), "files[0]"),
    "file_size_negative": (_set("files|0|size", -1), "files[0].size"),
    "file_size_bool": (_set("files|0|size", False), "files[0].size"),
    "file_path_not_str": (_set("files|0|path", 3), "files[0].path"),
    # path traversal
    "path_parent": (_set("files|0|path", "../x"), "files[0].path"),
    "path_parent_inside": (_set("files|0|path", "data/../../x"), "files[0].path"),
    "path_absolute": (_set("files|0|path", "/abs"), "files[0].path"),
    "path_dot": (_set("files|0|path", "a/./b"), "files[0].path"),
    "path_url": (_set("files|0|path", "s3://x"), "files[0].path"),
    "path_nul": (_set("files|0|path", "data/a\x00b"), "files[0].path"),
    "path_backslash": (_set("files|0|path", "data\\..\\x"), "files[0].path"),
    "path_drive": (_set("files|0|path", "C:x"), "files[0].path"),
    "path_empty": (_set("files|0|path", ""), "files[0].path"),
    "path_trailing_slash": (_set("files|0|path", "data/"), "files[0].path"),
    "path_metadata": (_set("files|0|path", "metadata.json"), "files[0].path"),
    "path_repeated": (_repeat_first_file, "files[1].path"),
    # tensors
    "tensors_not_dict": (_set("tensors", []), "tensors"),
    "tensor_missing_boxes": (_delete("tensors|model.w|boxes"), "model.w"),
    "tensor_extra_field": (_set("tensors|model.w|logical_shape", [3, 4]), "model.w"),
    "dtype_unknown": (_set("tensors|model.w|dtype", "float128"), "dtype"),
    "dtype_not_str": (_set("tensors|model.w|dtype", 4), "dtype"),
    "global_shape_negative": (_set("tensors|model.w|global_shape", [-3, 4]), "global_shape"),
    "global_shape_bool": (_set("tensors|model.w|global_shape", [3, True]), "global_shape"),
    "global_shape_not_list": (_set("tensors|model.w|global_shape", "3x4"), "global_shape"),
    "boxes_not_list": (_set("tensors|model.w|boxes", {}), "boxes"),
    "box_not_dict": (_set(W, [0, 0]), "boxes[0]"),
    "box_offset_negative": (_w_box(offset=[-1, 0]), "offset"),
    "box_offset_bool": (_w_box(offset=[False, 0]), "offset"),
    "box_offset_float": (_w_box(offset=[0.0, 0]), "offset"),
    "box_outside": (_w_box(offset=[1, 0]), "outside"),
    "box_too_wide": (_w_box(shape=[3, 5]), "outside"),
    "box_rank_mismatch": (_w_box(offset=[0]), "outside"),
    "box_rank_above_global": (_w_box(offset=[0, 0, 0], shape=[3, 4, 1]), "outside"),
    "overlapping_boxes": (_duplicate_w_box, "overlap"),
    "overlapping_split_boxes": (_split_w_box(overlap=True), "overlap"),
    "gap": (_split_w_box(drop_second=True), "cover 4 of 12"),
    "no_boxes": (_set("tensors|model.w|boxes", []), "cover 0 of 12"),
    "byte_offset_past_file": (_shrink_first_file, "past the end"),
    "byte_length_past_file": (_w_box(byte_length=10**9), "past the end"),
    "byte_offset_negative": (_w_box(byte_offset=-64), "byte_offset"),
    "crc_missing": (lambda d: d["tensors"]["model.w"]["boxes"][0]["crc32c"].pop(), "crc32c"),
    "crc_extra": (lambda d: d["tensors"]["model.w"]["boxes"][0]["crc32c"].append(0), "crc32c"),
    "crc_too_large": (lambda d: d["tensors"]["model.w"]["boxes"][0]["crc32c"].__setitem__(0, 2**32), "crc32c"),
    "crc_negative": (lambda d: d["tensors"]["model.w"]["boxes"][0]["crc32c"].__setitem__(0, -1), "crc32c"),
    "crc_not_list": (_w_box(crc32c="abc"), "crc32c"),
    "byte_length_not_shape": (_byte_length_off_by_one_element, "does not match"),
    "file_index_out_of_range": (_w_box(file=1), "out of range"),
    "file_index_negative": (_w_box(file=-1), "file"),
    "file_index_bool": (_w_box(file=False), "file"),
    # objects
    "objects_not_dict": (_set("objects", []), "objects"),
    "object_offset_outside_grid": (_set(f"{OBJ}|offset", [1]), "outside the grid"),
    "object_offset_rank": (_set(f"{OBJ}|offset", [0, 0]), "outside the grid"),
    "object_entry_twice": (_duplicate_object_entry, "stored twice"),
    "object_cell_missing": (_set("objects|rng|entries", []), "rng"),
    "object_grid_larger": (_set("objects|rng|global_shape", [2]), "rng"),
    "object_missing_crc": (_delete(f"{OBJ}|crc32c"), "entries[0]"),
    "object_past_file": (_set(f"{OBJ}|byte_length", 10**6), "past the end"),
    "object_file_out_of_range": (_set(f"{OBJ}|file", 3), "out of range"),
    "object_entries_not_list": (_set("objects|rng|entries", None), "entries"),
    # common
    "common_not_dict": (_set("common", [1]), "common"),
    "common_bad_float": (_set("common|lr", {"$float": "NaN"}), "common"),
    "common_two_tags": (_set("common|lr", {"$float": "nan", "$tuple": []}), "common"),
    "common_bad_base64": (_set("common|blob", {"$bytes": "***"}), "common"),
    "common_unhashable_key": (_set("common|step", {"$dict": [[[1], 2]]}), "common"),
    "common_tensor_tag": (_set("common|step", {"$tensor": 0}), "common"),
}


def _corrupt(valid_doc: dict[str, Any], mutation: Mutation) -> bytes:
    doc = copy.deepcopy(valid_doc)
    mutation(doc)
    return dumps(doc, separators=(", ", ": "))


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutated_metadata_is_corrupt(valid_doc: dict[str, Any], name: str) -> None:
    mutation, fragment = MUTATIONS[name]
    raw = _corrupt(valid_doc, mutation)
    with pytest.raises(CorruptCheckpointError) as info:
        Metadata.from_json_bytes(raw, where="ckpt/metadata.json")
    assert type(info.value) is CorruptCheckpointError
    message = str(info.value)
    assert message.startswith("ckpt/metadata.json")
    assert fragment in message


def test_mutations_leave_the_rest_valid(valid_doc: dict[str, Any]) -> None:
    """The split used by the gap and overlap cases is itself a valid layout, so those cases fail for the
    reason they name."""
    doc = copy.deepcopy(valid_doc)
    _split_w_box()(doc)
    metadata = Metadata.from_json_bytes(dumps(doc))
    assert [b.shape for b in metadata.tensors["model.w"].boxes] == [(1, 4), (2, 4)]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"\xff\xfe\x00",
        b"null",
        b"[]",
        b'"reshard"',
        b'{"format": NaN}',
        b'{"format": Infinity}',
        b"[" * 100_000 + b"]" * 100_000,
        b"1" * 5000,
    ],
    ids=["empty", "truncated", "not_utf8", "null", "list", "string", "nan", "infinity", "deep", "huge_int"],
)
def test_not_a_metadata_document(raw: bytes) -> None:
    with pytest.raises(CorruptCheckpointError):
        Metadata.from_json_bytes(raw)


@pytest.mark.parametrize("where", ["top", "tensor", "common"])
def test_duplicate_json_keys_are_corrupt(saved: Path, where: str) -> None:
    raw = unseal((saved / METADATA_FILE).read_bytes())
    if where == "top":
        doc = raw.replace(b'"format":"reshard"', b'"format":"reshard","format":"reshard"', 1)
    elif where == "tensor":
        doc = raw.replace(b'"dtype":"float32"', b'"dtype":"float32","dtype":"float32"', 1)
    else:
        doc = raw.replace(b'"step":10', b'"step":10,"step":11', 1)
    assert doc != raw
    with pytest.raises(CorruptCheckpointError, match="duplicate key"):
        Metadata.from_json_bytes(seal(doc))


def test_deeply_nested_common_value(valid_doc: dict[str, Any]) -> None:
    doc = copy.deepcopy(valid_doc)
    value: object = 1
    for _ in range(200):
        value = [value]
    doc["common"]["deep"] = value
    with pytest.raises(CorruptCheckpointError, match="nested deeper"):
        Metadata.from_json_bytes(dumps(doc))


@pytest.mark.parametrize(
    ("path", "ok"),
    [
        ("data/abc-r00000.bin", True),
        ("x", True),
        ("a/b/c", True),
        ("", False),
        ("../x", False),
        ("a/../b", False),
        ("/abs", False),
        ("a/./b", False),
        ("./a", False),
        ("a//b", False),
        ("a/", False),
        ("s3://bucket/x", False),
        ("C:\\x", False),
        ("a\\b", False),
        ("a\x00b", False),
    ],
)
def test_check_relative_path(path: str, ok: bool) -> None:
    assert (check_relative_path(path) is None) is ok


@pytest.mark.parametrize("name", ["path_parent", "path_absolute", "box_outside", "crc_missing", "version_4"])
def test_load_and_read_metadata_refuse_corrupt_metadata(
    saved: Path, valid_doc: dict[str, Any], tmp_path: Path, name: str
) -> None:
    copy_path = tmp_path / "ckpt"
    shutil.copytree(saved, copy_path)
    mutation, fragment = MUTATIONS[name]
    (copy_path / METADATA_FILE).write_bytes(_corrupt(valid_doc, mutation))
    with pytest.raises(CorruptCheckpointError, match=re.escape(fragment)):
        reshard.read_metadata(copy_path)
    with pytest.raises(CorruptCheckpointError, match=re.escape(fragment)):
        reshard.load({"model": {"w": torch.zeros(3, 4)}}, copy_path)


# --------------------------------------------------------------------------------------------------
# Fuzzing: any single-field change is either still valid or refused with CorruptCheckpointError


def _paths(node: object, prefix: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    out: list[tuple[str | int, ...]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            out.append((*prefix, key))
            out.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out.append((*prefix, i))
            out.extend(_paths(value, (*prefix, i)))
    return out


JSON_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**64), 2**64),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=6),
        st.sampled_from(["float32", "bfloat16", "crc32c", "reshard", "../x", "$float", "nan"]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(
            st.sampled_from(["$float", "$tuple", "$dict", "$bytes", "a", "path", "size"]), children, max_size=2
        ),
    ),
    max_leaves=8,
)


@settings(max_examples=examples(300), deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzzed_metadata_never_raises_another_exception(valid_doc: dict[str, Any], data: st.DataObject) -> None:
    doc = copy.deepcopy(valid_doc)
    paths = _paths(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        target = data.draw(st.sampled_from(paths))
        node: Any = doc
        try:
            for part in target[:-1]:
                node = node[part]
            if data.draw(st.booleans(), label="delete") and isinstance(node, dict):
                node.pop(target[-1], None)
            else:
                node[target[-1]] = data.draw(JSON_VALUES)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed or replaced this path
    raw = dumps(doc)
    with contextlib.suppress(CorruptCheckpointError):
        Metadata.from_json_bytes(raw)


def test_empty_containers_are_saved_as_common_values(tmp_path: Path) -> None:
    """An empty list, dict or tuple of the state dict is kept (an offline reader of the checkpoint sees it),
    and a template's empty container that a checkpoint lacks (saved before they were kept) is no error."""
    state = {"w": torch.ones(2), "config": {"moe_layers": [], "extra": {}, "shape": ()}}
    reshard.save(state, tmp_path / "ckpt")
    common = reshard.read_metadata(tmp_path / "ckpt").common
    assert common["config.moe_layers"] == [] and common["config.extra"] == {} and list(common["config.shape"]) == []
    out = reshard.load({"w": torch.zeros(2), "config": {"moe_layers": [], "extra": {}, "shape": ()}}, tmp_path / "ckpt")
    assert out["config"] == {"moe_layers": [], "extra": {}, "shape": ()}
    reshard.save({"w": torch.ones(2)}, tmp_path / "old")
    out = reshard.load({"w": torch.zeros(2), "later": []}, tmp_path / "old", strict=True)
    assert out["later"] == []
