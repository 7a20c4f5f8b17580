"""Record buffers: a rank's variable-length records (RL rollouts, a replay buffer) in columns.

A record is a mapping of field names to tensors; every record of a buffer has the same fields, each field the
same dtype and the same shape after its first axis (its *trailing* shape), while the first axis (the record's
*length* in that field) may differ from record to record. A field may instead have a fixed shape (a scalar
reward): each record then holds exactly one "row" of it. Every record carries a global id (an int64 the caller
assigns, unique over the whole job), which is how "every record exactly once" is checked across layouts.

A :class:`RecordBuffer` keeps the records in columns: per field the concatenation of every record's rows, in
record order, plus an ``(n, F)`` table of lengths. That is exactly the rank's box of the global tensors a save
writes (:func:`reshard.data.records_state`), and what a load fills in one read per field
(:func:`reshard.data.load_records`); the records themselves are views into the columns.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from reshard.errors import DataStateError, StateDictError
from reshard.state.dtypes import DTYPE_BY_NAME, dtype_name

__all__ = ["MAX_ID", "FieldSpec", "RecordBuffer", "Schema", "check_plain_name", "schema_from_json", "schema_to_json"]

MAX_ID = 2**63 - 2
"""The largest record id: ids are int64 in ``[0, 2**63 - 2]`` (2**63 - 1 is reserved: a run of ids ends one
past its last id, in int64)."""

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")


def check_plain_name(what: str, name: object, error: type[Exception] = DataStateError) -> str:
    """``name`` if it is a plain name (letters, digits, ``_`` and ``-``, not starting with ``-``), else ``error``.

    Buffer keys and field names make the checkpoint keys ``KEY.meta``, ``KEY.index`` and ``KEY.fields.NAME``: with
    a ``.`` in them two buffers' keys could be the same (buffer ``a`` field ``b.index`` and buffer ``a.fields.b``).
    """
    if not isinstance(name, str) or not _PLAIN.fullmatch(name):
        raise error(f"{what} {name!r} is not a plain name (letters, digits, '_' and '-', no '.')")
    return name


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """The dtype and shape of one field of every record.

    ``shape`` is the shape of the field in one record; a leading ``None`` marks the variable length axis
    (``(None,)``: a 1-D field of any length, ``(None, 16)``: any number of rows of 16). Without ``None`` the shape
    is fixed (``()``: a scalar per record, ``(1,)``: one element), and each record holds one row of it.
    """

    dtype: torch.dtype
    shape: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BY_NAME.values():
            raise DataStateError(f"record field dtype {self.dtype} cannot be stored")
        shape = tuple(self.shape)
        rest = shape[1:] if shape[:1] == (None,) else shape
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in rest):
            raise DataStateError(
                f"record field shape {shape!r}: only the first axis may be None (variable), the others are ints >= 0"
            )
        object.__setattr__(self, "shape", shape)

    @property
    def variable(self) -> bool:
        """Whether the first axis is the record's length (else each record holds one row of ``shape``)."""
        return self.shape[:1] == (None,)

    @property
    def trailing(self) -> tuple[int, ...]:
        """The shape of one row: the shape after the length axis, or the whole fixed shape."""
        rest = self.shape[1:] if self.variable else self.shape
        return tuple(int(n) for n in rest if n is not None)

    @classmethod
    def of(cls, value: torch.Tensor) -> FieldSpec:
        """The spec a record's tensor implies: a 0-d tensor is a fixed scalar; any other has a variable first
        axis (a ``[1]`` reward round-trips the same either way, only the checks differ)."""
        if value.ndim == 0:
            return cls(value.dtype, ())
        return cls(value.dtype, (None, *value.shape[1:]))


Schema = tuple[tuple[str, FieldSpec], ...]
"""The fields of a buffer, sorted by name (so that the ranks agree whatever order their mappings have)."""


def _schema(given: Mapping[str, FieldSpec]) -> Schema:
    if not isinstance(given, Mapping):
        raise StateDictError(f"a record schema is a mapping of field names to FieldSpec, got {type(given).__name__}")
    for name, spec in given.items():
        if not isinstance(name, str) or not name:
            raise StateDictError(f"a record field name must be a non-empty string, got {name!r}")
        check_plain_name("record field name", name)
        if not isinstance(spec, FieldSpec):
            raise StateDictError(f"record field {name!r}: a FieldSpec, got {type(spec).__name__}")
    return tuple(sorted(given.items()))


def schema_to_json(schema: Schema) -> list[list[Any]]:
    """``[[name, dtype name, shape with null for the length axis], ...]``: how the ranks and the checkpoint
    carry a schema."""
    return [[name, dtype_name(spec.dtype), list(spec.shape)] for name, spec in schema]


def schema_from_json(value: object, *, error: type[Exception] = DataStateError) -> Schema:
    """The inverse of :func:`schema_to_json`, strictly: anything else raises ``error``."""
    if not isinstance(value, list):
        raise error(f"a record schema must be a list, got {type(value).__name__}")
    out: list[tuple[str, FieldSpec]] = []
    for entry in value:
        ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[0]
        if not ok or not isinstance(entry[1], str) or entry[1] not in DTYPE_BY_NAME or not isinstance(entry[2], list):
            raise error(f"malformed record schema entry {entry!r}")
        check_plain_name("record field name", entry[0], error)
        try:
            out.append((entry[0], FieldSpec(DTYPE_BY_NAME[entry[1]], tuple(entry[2]))))
        except DataStateError as exc:
            raise error(f"record field {entry[0]!r}: {exc}") from None
    names = [name for name, _ in out]
    if names != sorted(set(names)):
        raise error(f"record schema fields must be unique and sorted, got {names}")
    return tuple(out)


@dataclass(frozen=True, slots=True, eq=False)
class RecordBuffer:
    """One rank's records, in columns. Build it with :meth:`from_records` (or :meth:`empty`); a load returns one.

    Attributes:
        schema: the fields, sorted by name; None only for an empty buffer that does not know its fields (a save
            then takes the other ranks' schema).
        ids: int64 ``[n]``: each record's global id, non-negative and unique.
        lengths: int64 ``[n, F]``: each record's rows of each field (1 for a fixed-shape field).
        columns: per field (schema order), the concatenation of every record's rows: ``[sum of lengths, *trailing]``,
            in host memory.

    Raises:
        DataStateError: the columns do not hold what the schema and the lengths say, or ids repeat or are negative.
    """

    schema: Schema | None
    ids: torch.Tensor
    lengths: torch.Tensor
    columns: tuple[torch.Tensor, ...]
    starts: torch.Tensor = field(init=False, repr=False)
    """int64 ``[n, F]``: the row where each record starts in each column."""

    def __post_init__(self) -> None:
        schema = self.schema if self.schema is not None else ()
        n = _check_ids(self.ids)
        if self.lengths.dtype != torch.int64 or tuple(self.lengths.shape) != (n, len(schema)):
            raise DataStateError(
                f"record lengths must be int64 [{n}, {len(schema)}], got {self.lengths.dtype} "
                f"{list(self.lengths.shape)}"
            )
        if n and bool((self.lengths < 0).any()):
            raise DataStateError("a record has a negative length")
        if len(self.columns) != len(schema):
            raise DataStateError(f"{len(self.columns)} record columns for {len(schema)} fields")
        for f, ((name, spec), column) in enumerate(zip(schema, self.columns, strict=True)):
            lengths = self.lengths[:, f]
            if not spec.variable and n and bool((lengths != 1).any()):
                raise DataStateError(
                    f"record field {name!r} has the fixed shape {list(spec.shape)}: one row per record"
                )
            rows = int(lengths.sum())
            if column.dtype != spec.dtype or tuple(column.shape) != (rows, *spec.trailing):
                raise DataStateError(
                    f"record field {name!r}: the column is {column.dtype} {list(column.shape)}, the schema and "
                    f"lengths say {spec.dtype} {[rows, *spec.trailing]}"
                )
        starts = torch.cumsum(self.lengths, 0) - self.lengths
        object.__setattr__(self, "starts", starts)

    @classmethod
    def from_records(
        cls,
        records: Sequence[Mapping[str, torch.Tensor]],
        ids: Sequence[int] | torch.Tensor,
        *,
        schema: Mapping[str, FieldSpec] | None = None,
    ) -> RecordBuffer:
        """A buffer of ``records`` (each a mapping of every field to its tensor) with global ``ids`` (one per
        record). Without ``schema`` it is taken from the first record (:meth:`FieldSpec.of`); an empty buffer
        without one knows no fields. Tensors are copied into the columns (host memory).

        Raises:
            DataStateError: a record's fields, dtypes or shapes differ from the schema; ids repeat, are negative
                or not one per record.
            StateDictError: a record is not a mapping of tensors.
        """
        ids_tensor = _ids_tensor(ids)
        if len(ids_tensor) != len(records):
            raise DataStateError(f"{len(ids_tensor)} ids for {len(records)} records")
        if schema is None and not records:
            return cls.empty()
        if schema is None:
            first = records[0]
            _check_record(0, first)
            checked = _schema({name: FieldSpec.of(value) for name, value in first.items()})
        else:
            checked = _schema(schema)
        for i, record in enumerate(records):
            _check_record(i, record, checked)
        lengths = torch.tensor(
            [[int(record[name].shape[0]) if spec.variable else 1 for name, spec in checked] for record in records],
            dtype=torch.int64,
        ).reshape(len(records), len(checked))
        columns = tuple(
            torch.cat(
                [
                    record[name].detach().cpu().reshape(int(n), *spec.trailing)
                    for record, n in zip(records, lengths[:, f].tolist(), strict=True)
                ]
            )
            if records
            else torch.empty((0, *spec.trailing), dtype=spec.dtype)
            for f, (name, spec) in enumerate(checked)
        )
        return cls(checked, ids_tensor, lengths, columns)

    @classmethod
    def empty(cls, schema: Mapping[str, FieldSpec] | None = None) -> RecordBuffer:
        """A buffer of no records (with ``schema``, or knowing no fields)."""
        checked = _schema(schema) if schema is not None else None
        fields = checked or ()
        columns = tuple(torch.empty((0, *spec.trailing), dtype=spec.dtype) for _, spec in fields)
        return cls(
            checked, torch.empty(0, dtype=torch.int64), torch.empty((0, len(fields)), dtype=torch.int64), columns
        )

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Record ``i`` (in this buffer's order): each field a view into its column."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"record {i} of {n}")
        i %= n
        out: dict[str, torch.Tensor] = {}
        for f, (name, spec) in enumerate(self.schema or ()):
            start, length = int(self.starts[i, f]), int(self.lengths[i, f])
            rows = self.columns[f][start : start + length]
            out[name] = rows if spec.variable else rows[0]
        return out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (self[i] for i in range(len(self)))

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.schema or ())


def _ids_tensor(ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool or ids.is_meta:
            raise DataStateError(f"record ids must be integers with data, got {ids.dtype} on {ids.device}")
        if ids.ndim != 1:
            raise DataStateError(f"record ids must be a 1-D tensor, got the shape {list(ids.shape)}")
        return ids.detach().to("cpu", torch.int64)
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise DataStateError(f"record ids must be a sequence of ints or a 1-D tensor, got {type(ids).__name__}")
    values = list(ids)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise DataStateError("record ids must be ints")
    bad = next((v for v in values if not 0 <= v <= torch.iinfo(torch.int64).max), None)
    if bad is not None:
        raise DataStateError(f"record id {bad} is not a non-negative int64")
    return torch.tensor(values, dtype=torch.int64).reshape(-1)


def _check_ids(ids: torch.Tensor) -> int:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.ndim != 1:
        raise DataStateError("record ids must be a 1-D int64 tensor")
    n = int(ids.shape[0])
    if n and int(ids.min()) < 0:
        raise DataStateError(f"record id {int(ids.min())} is negative; ids are non-negative int64")
    if n and int(ids.max()) > MAX_ID:
        raise DataStateError("record id 2**63 - 1 is reserved (ids are int64 in [0, 2**63 - 2])")
    unique, counts = torch.unique(ids, return_counts=True)
    if len(unique) != n:
        raise DataStateError(f"record id {int(unique[counts > 1][0])} appears {int(counts.max())} times in a buffer")
    return n


def _check_record(i: int, record: object, schema: Schema | None = None) -> None:
    if not isinstance(record, Mapping):
        raise StateDictError(f"record {i} must be a mapping of field names to tensors, got {type(record).__name__}")
    for name, value in record.items():
        if not isinstance(value, torch.Tensor):
            raise StateDictError(f"record {i}, field {name!r}: a torch.Tensor, got {type(value).__name__}")
        if value.is_meta:
            raise StateDictError(f"record {i}, field {name!r}: a tensor on the meta device has no data to store")
    if schema is None:
        return
    names = sorted(record)
    expected = [name for name, _ in schema]
    if names != expected:
        raise DataStateError(f"record {i} has the fields {names}, the buffer {expected}")
    for name, spec in schema:
        value = record[name]
        if value.dtype != spec.dtype:
            raise DataStateError(f"record {i}, field {name!r}: dtype {value.dtype}, the buffer's is {spec.dtype}")
        shape = tuple(value.shape)
        fits = shape[1:] == spec.trailing and len(shape) >= 1 if spec.variable else shape == spec.trailing
        if not fits:
            raise DataStateError(
                f"record {i}, field {name!r}: shape {list(shape)} does not fit the field's shape {list(spec.shape)}"
            )
