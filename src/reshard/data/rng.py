"""RNG streams per rank: saved as a :class:`~reshard.ShardedObject` on the grid of the ranks' coordinates, and
restored exactly at the same layout or under an explicit policy when the layout changed.

RNG state is the exception to the single-cell rule of ``reshard.data``: a generator's state has no global
meaning that another layout could redistribute (a stream is a stream of one rank), so each rank saves its
own cell, ``rng_state(key, coordinate=..., grid=...)``, and asks for the cell of its current coordinate,
``rng_template(key, coordinate=..., grid=...)``. The value holds this rank's generators (torch's CPU
generator, numpy's global ``RandomState``, Python's ``random``, every CUDA device's generator or the fact
that there was none, and generators the caller names: a ``torch.Generator`` a model uses for dropout, a
numpy ``Generator``), the coordinate and grid it was saved at, and the job's global seed when given.

``restore_rng`` then decides, on each rank and without a collective:

- same layout (the loaded value's coordinate and grid are the current ones): every generator continues its
  stream exactly, whatever the policy;
- changed layout (another grid, another coordinate, or no saved cell: ``None``, a rank the saved grid did
  not have): the caller's ``policy`` decides, and there is no default (``DataStateError`` naming the key,
  both grids and the policies):

  - ``"derive"``: every rank seeds every generator from ``derive_seed(seed, step, coordinate, name)``;
  - ``"same_coordinate"``: a rank whose coordinate the saved grid had continues exactly (its cell loaded
    with ``LoadOptions(object_grid="same_coordinate")``), every other rank derives as above.

Every part of the value is checked against the generator it would go into, by setting it on a scratch
generator of the same kind, before any generator is set: a hostile or incomplete value changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import torch

from reshard.errors import DataStateError
from reshard.state.sharding import ShardedObject

__all__ = [
    "PROCESS_GENERATORS",
    "RNG_POLICIES",
    "RestoredRng",
    "RngPolicy",
    "cuda_generator_states",
    "derive_seed",
    "restore_rng",
    "rng_state",
    "rng_template",
    "sample_generator",
]

FORMAT = "reshard.data.rng/1"
"""The ``format`` field of a saved RNG value."""

PROCESS_GENERATORS: tuple[str, ...] = ("torch", "numpy", "python", "cuda")
"""The process-wide generators, by their names in the value: torch's default CPU generator, numpy's global
``RandomState`` (``np.random.*``), Python's ``random`` and the default generator of every CUDA device."""

RngPolicy = Literal["derive", "same_coordinate"]
RNG_POLICIES: tuple[RngPolicy, ...] = ("derive", "same_coordinate")
"""The policies of ``restore_rng(policy=...)`` for a changed layout."""

UserGenerator = torch.Generator | np.random.Generator
"""A generator the caller names: a ``torch.Generator`` (any device) or a numpy ``Generator``."""

Setter = Callable[[], object]
"""Sets one generator's state (its return value, if any, is not used)."""

_TRIAL_ERRORS = (TypeError, ValueError, IndexError, KeyError, OverflowError, RuntimeError)
_MT_WORDS = 624
_UINT = {"uint32": np.uint32, "uint64": np.uint64}


@dataclass(frozen=True)
class RestoredRng:
    """What ``restore_rng`` did on this rank.

    Attributes:
        mode: ``"exact"`` (same layout: every stream continues), ``"continued"`` (changed layout, policy
            ``"same_coordinate"``, this rank's coordinate was saved: every stream continues) or ``"derived"``
            (every generator seeded by :func:`derive_seed`).
        generators: the names of the generators restored or seeded, in order (``"cuda"`` only where a CUDA
            device is).
        saved_grid: the grid the loaded value was saved at, or None where no value came back.
    """

    mode: Literal["exact", "continued", "derived"]
    generators: tuple[str, ...]
    saved_grid: tuple[int, ...] | None


# ----------------------------------------------------------------------------------------------- derivation


def _digest(fields: Mapping[str, object]) -> int:
    """The first 16 bytes of SHA-256 of the canonical JSON of ``fields``, as a big-endian int (128 bits)."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:16], "big")


def derive_seed(seed: int, step: int, coordinate: Sequence[int], generator: str) -> int:
    """The seed a rank at ``coordinate`` gives ``generator`` when its stream is derived (128 bits).

    It is the first 16 bytes (big-endian) of SHA-256 of the JSON text
    ``{"coordinate":[...],"generator":NAME,"purpose":"reshard.data.rng","seed":SEED,"step":STEP}`` (keys
    sorted, no spaces): stable across processes, Python versions and machines (not Python's ``hash``), and
    different per generator, so the torch, numpy and Python streams of one rank are not the same stream.
    """
    _check_int("seed", seed)
    _check_int("step", step)
    coord = _int_list("coordinate", coordinate)
    return _digest(
        {"coordinate": coord, "generator": generator, "purpose": "reshard.data.rng", "seed": seed, "step": step}
    )


def sample_generator(seed: int, epoch: int, sample_id: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch generator for one sample of one epoch, seeded from (``seed``, ``epoch``, ``sample_id``) alone.

    Randomness drawn from it (a sample's dropout mask, its augmentation) is the same on any layout, on
    whichever rank the sample lands: the way to randomness that no change of layout can alter, which no
    checkpoint of per-rank streams can give. The seed is SHA-256 of the JSON text
    ``{"epoch":E,"purpose":"reshard.data.sample","sample":ID,"seed":S}``, its first 8 bytes big-endian.
    """
    for name, value in (("seed", seed), ("epoch", epoch), ("sample_id", sample_id)):
        _check_int(name, value)
    fields = {"epoch": epoch, "purpose": "reshard.data.sample", "sample": sample_id, "seed": seed}
    try:
        generator = torch.Generator(device=device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DataStateError(f"sample_generator: device {device!r} cannot hold a torch generator ({exc})") from exc
    generator.manual_seed(_digest(fields) >> 64)
    return generator


# ----------------------------------------------------------------------------------------------- arguments


def _check_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise DataStateError(f"{name} must be a non-negative int, not {value!r}")


def _check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise DataStateError(f"RNG state: the key must be a non-empty string, not {key!r}")


def _is_cuda_name(name: str) -> bool:
    """Whether ``name`` is the derivation name of a CUDA device's generator (``"cuda:<n>"``, see
    :func:`_seed_one`): a named generator so called would be derived the same stream."""
    return name.startswith("cuda:") and name[5:].isdigit()


def _int_list(name: str, values: object) -> list[int]:
    if not isinstance(values, list | tuple):
        raise DataStateError(f"{name} must be a sequence of non-negative ints, not {type(values).__name__}")
    for v in values:
        _check_int(name, v)
    return [int(v) for v in values]


def _layout(key: str, coordinate: Sequence[int], grid: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    coord, shape = _int_list("coordinate", coordinate), _int_list("grid", grid)
    if len(coord) != len(shape) or not shape or any(c >= n for c, n in zip(coord, shape, strict=True)):
        raise DataStateError(f"RNG state {key!r}: coordinate {coord} is not a cell of the grid {shape}")
    return tuple(coord), tuple(shape)


def _targets(
    key: str, include: Collection[str], generators: Mapping[str, UserGenerator] | None
) -> dict[str, UserGenerator | None]:
    """The generators by name, in value order: the process-wide ones of ``include`` (None: the global one),
    then the caller's."""
    unknown = sorted(set(include) - set(PROCESS_GENERATORS))
    if isinstance(include, str) or unknown:
        raise DataStateError(f"RNG state {key!r}: include takes names of {list(PROCESS_GENERATORS)}, not {include!r}")
    out: dict[str, UserGenerator | None] = {name: None for name in PROCESS_GENERATORS if name in include}
    if generators is not None and not isinstance(generators, Mapping):
        raise DataStateError(
            f"RNG state {key!r}: generators must be a mapping of names to generators, not {type(generators).__name__}"
        )
    for name, gen in (generators or {}).items():
        if not isinstance(name, str) or not name or name in PROCESS_GENERATORS or _is_cuda_name(name):
            raise DataStateError(
                f"RNG state {key!r}: a named generator needs a non-empty name other than {list(PROCESS_GENERATORS)} "
                f"and 'cuda:<n>' (the names the process generators are derived under), not {name!r}"
            )
        if not isinstance(gen, torch.Generator | np.random.Generator):
            raise DataStateError(
                f"RNG state {key!r}: generator {name!r} is a {type(gen).__name__}, not a torch.Generator or a "
                "numpy Generator"
            )
        out[name] = gen
    return out


# ----------------------------------------------------------------------------------------------- capture


def cuda_generator_states() -> list[torch.Tensor] | None:
    """The state of every CUDA device's default generator, in device order; None where CUDA is not available.

    The only place that reads CUDA generators (tested here with CUDA absent: the machines of the test suite
    have none)."""
    if not torch.cuda.is_available():
        return None
    return [torch.cuda.get_rng_state(device) for device in range(torch.cuda.device_count())]


def _numpy_out(value: object) -> object:
    """A numpy bit generator's state in the pickle-free codec's terms: uint32/uint64 arrays (which a
    checkpoint has no dtype for) as ``{"numpy_dtype", "bits"}`` with the bits in int64."""
    if isinstance(value, dict):
        return {str(k): _numpy_out(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        name = str(value.dtype)
        bits = value.astype(np.int64) if name == "uint32" else value.view(np.int64)
        return {"numpy_dtype": name, "bits": np.ascontiguousarray(bits)}
    return value


def _capture(name: str, gen: UserGenerator | None) -> dict[str, Any]:
    if isinstance(gen, torch.Generator):
        return {"kind": "torch", "device": gen.device.type, "state": gen.get_state()}
    if isinstance(gen, np.random.Generator):
        return {"kind": "numpy", "state": _numpy_out(gen.bit_generator.state)}
    if name == "torch":
        return {"kind": "torch", "device": "cpu", "state": torch.default_generator.get_state()}
    if name == "numpy":
        return {"kind": "numpy", "state": _numpy_out(np.random.get_state(legacy=False))}
    if name == "python":
        version, internal, gauss_next = random.getstate()
        return {
            "kind": "python",
            "version": version,
            "internal": np.array(internal, dtype=np.int64),
            "gauss_next": gauss_next,
        }
    states = cuda_generator_states()
    return {"kind": "absent"} if states is None else {"kind": "cuda", "states": states}


def rng_state(
    key: str = "rng",
    *,
    coordinate: Sequence[int],
    grid: Sequence[int],
    replica_id: int = 0,
    seed: int | None = None,
    generators: Mapping[str, UserGenerator] | None = None,
    include: Collection[str] = PROCESS_GENERATORS,
) -> ShardedObject:
    """This rank's generators as cell ``coordinate`` of a grid of ``grid`` cells, for ``reshard.save``.

    Args:
        key: the object's key in the checkpoint.
        coordinate, grid: this rank's cell: the ranks whose streams differ (e.g. (pp, tp, dp) ranks; (pp, tp)
            with ``replica_id=dp`` only where the DP ranks' streams are identical copies).
        replica_id: as for any ShardedObject; only the cell's primary (0) is written.
        seed: the job's global seed, recorded for reference (a derivation uses ``restore_rng(seed=...)``).
        generators: further generators by name (a model's dropout ``torch.Generator``, a numpy ``Generator``).
        include: which process-wide generators to capture (all four by default; ``"cuda"`` is recorded as
            absent where CUDA is not available).

    Local to this rank: no collective. Raises DataStateError for a bad argument.
    """
    _check_key(key)
    coord, shape = _layout(key, coordinate, grid)
    _check_int("replica_id", replica_id)
    if seed is not None:
        _check_int("seed", seed)
    targets = _targets(key, include, generators)
    value = {
        "format": FORMAT,
        "key": key,
        "coordinate": list(coord),
        "grid": list(shape),
        "seed": seed,
        "generators": {name: _capture(name, gen) for name, gen in targets.items()},
    }
    return ShardedObject(key, value, shape, coord, replica_id=replica_id)


def rng_template(key: str = "rng", *, coordinate: Sequence[int], grid: Sequence[int]) -> ShardedObject:
    """The load template of this rank's cell: ``reshard.load`` replaces its ``None`` with the saved value
    (or leaves ``None`` for a rank a changed grid adds, under ``LoadOptions(object_grid=...)``)."""
    _check_key(key)
    coord, shape = _layout(key, coordinate, grid)
    return ShardedObject(key, None, shape, coord)


# ----------------------------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class _Saved:
    coordinate: tuple[int, ...]
    grid: tuple[int, ...]
    generators: Mapping[str, Any]


def _parse(key: str, value: object) -> _Saved:
    """The loaded value's layout and generators, its structure checked (the generators' contents are checked
    by :func:`_setter`)."""
    bad = f"RNG state {key!r}: the loaded value is not a saved RNG state of rng_state"
    fields = {"format", "key", "coordinate", "grid", "seed", "generators"}
    if not isinstance(value, dict) or set(value) != fields or value["format"] != FORMAT:
        found = sorted(value) if isinstance(value, dict) else type(value).__name__
        raise DataStateError(f"{bad} ({found})")
    if value["key"] != key:
        raise DataStateError(f"{bad}: it was saved as {value['key']!r}")
    if value["seed"] is not None:
        _check_int("the saved seed", value["seed"])
    gens = value["generators"]
    if not isinstance(gens, dict) or not all(isinstance(g, dict) and "kind" in g for g in gens.values()):
        raise DataStateError(f"{bad}: its generators are not a dict of generator states")
    try:
        coord, shape = _layout(key, value["coordinate"], value["grid"])
    except DataStateError as exc:
        raise DataStateError(f"{bad}: {exc}") from exc
    return _Saved(coord, shape, gens)


def _fields(what: str, entry: Mapping[str, Any], kind: str, fields: set[str]) -> None:
    if entry.get("kind") != kind or set(entry) != fields | {"kind"}:
        raise DataStateError(f"{what}: expected a {kind!r} state with {sorted(fields)}, found {sorted(entry)}")


def _numpy_in(what: str, value: object) -> object:
    """Undo :func:`_numpy_out`."""
    if isinstance(value, dict) and set(value) == {"numpy_dtype", "bits"}:
        bits, dtype = value["bits"], _UINT.get(value["numpy_dtype"])
        if dtype is None or not isinstance(bits, np.ndarray) or bits.dtype != np.int64 or bits.ndim != 1:
            raise DataStateError(f"{what}: a malformed numpy array in the state")
        if dtype is np.uint32:
            if bits.size and (bits.min() < 0 or bits.max() > 0xFFFFFFFF):
                raise DataStateError(f"{what}: a uint32 array holds values out of range")
            return bits.astype(np.uint32)
        return bits.view(np.uint64)
    if isinstance(value, dict):
        return {k: _numpy_in(what, v) for k, v in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise DataStateError(f"{what}: a {type(value).__name__} in the numpy state")


def _trial(what: str, trial: Setter) -> None:
    try:
        trial()
    except _TRIAL_ERRORS as exc:
        raise DataStateError(f"{what}: not a valid state ({type(exc).__name__}: {exc})") from exc


def _torch_setter(what: str, entry: Mapping[str, Any], target: torch.Generator) -> Setter:
    _fields(what, entry, "torch", {"device", "state"})
    state = entry["state"]
    if entry["device"] != target.device.type:
        raise DataStateError(f"{what}: saved from a {entry['device']!r} generator, restored into a {target.device}")
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.dim() != 1:
        raise DataStateError(f"{what}: the state must be a 1-d uint8 tensor")
    _trial(what, lambda: torch.Generator(device=target.device).set_state(state))
    return lambda: target.set_state(state)


def _numpy_setter(what: str, entry: Mapping[str, Any], target: np.random.Generator | None) -> Setter:
    _fields(what, entry, "numpy", {"state"})
    state = _numpy_in(what, entry["state"])
    wanted = "MT19937" if target is None else type(target.bit_generator).__name__
    found = state.get("bit_generator") if isinstance(state, dict) else None
    if found != wanted:
        raise DataStateError(f"{what}: a numpy state of bit generator {found!r}, restored into a {wanted}")
    assert isinstance(state, dict)
    if wanted == "MT19937":
        _check_mt19937(what, state, legacy=target is None)
    if wanted == "Philox" and not _is_uint(state.get("buffer_pos"), 0, 4):  # numpy reads buffer[buffer_pos]
        raise DataStateError(f"{what}: buffer_pos must be an int in [0, 4], not {state.get('buffer_pos')!r}")
    if target is None:
        _trial(what, lambda: np.random.RandomState().set_state(state))
        return lambda: np.random.set_state(state)
    bit_generator = type(target.bit_generator)
    _trial(what, lambda: setattr(bit_generator(), "state", state))
    return lambda: setattr(target.bit_generator, "state", state)


def _is_uint(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_mt19937(what: str, state: Mapping[str, Any], *, legacy: bool) -> None:
    """What numpy's MT19937 takes without a complaint but then draws wrong: a ``pos`` outside the key (it reads
    past it: garbage or a crash), a key that is not 624 uint32 words or is all zero (a stream of zeros; torch
    refuses it); for the legacy ``RandomState`` a ``has_gauss`` other than 0 or 1."""
    inner = state.get("state")
    key = inner.get("key") if isinstance(inner, dict) else None
    if not isinstance(key, np.ndarray) or key.dtype != np.uint32 or key.shape != (_MT_WORDS,):
        raise DataStateError(f"{what}: an MT19937 state needs a key of {_MT_WORDS} words (uint32)")
    assert isinstance(inner, dict)
    if not _is_uint(inner.get("pos"), 0, _MT_WORDS):
        raise DataStateError(f"{what}: pos must be an int in [0, {_MT_WORDS}], not {inner.get('pos')!r}")
    if not key.any():
        raise DataStateError(f"{what}: an MT19937 key of all zero words (it draws only zeros)")
    if legacy and not _is_uint(state.get("has_gauss"), 0, 1):
        raise DataStateError(f"{what}: has_gauss must be 0 or 1, not {state.get('has_gauss')!r}")


def _check_python(what: str, version: object, internal: npt.NDArray[np.int64]) -> None:
    """What ``random.setstate`` takes but changes or draws wrong: version 2 (converted), words of more than 32
    bits (truncated), all zero words (a stream of zeros); the index must be in [0, 624]."""
    if version != 3 or isinstance(version, bool):
        raise DataStateError(f"{what}: version must be 3 (what random.getstate gives), not {version!r}")
    words = internal[:_MT_WORDS]
    if bool((words < 0).any()) or bool((words > 0xFFFFFFFF).any()):
        raise DataStateError(f"{what}: the words of the state must be uint32")
    if not words.any():
        raise DataStateError(f"{what}: all zero words (it draws only zeros)")
    if not 0 <= int(internal[_MT_WORDS]) <= _MT_WORDS:
        raise DataStateError(f"{what}: the index must be in [0, {_MT_WORDS}], not {int(internal[_MT_WORDS])}")


def _python_setter(what: str, entry: Mapping[str, Any]) -> Setter:
    _fields(what, entry, "python", {"version", "internal", "gauss_next"})
    internal, gauss_next = entry["internal"], entry["gauss_next"]
    if not isinstance(internal, np.ndarray) or internal.dtype != np.int64 or internal.shape != (_MT_WORDS + 1,):
        raise DataStateError(f"{what}: the internal state must be {_MT_WORDS + 1} int64 values")
    if gauss_next is not None and not isinstance(gauss_next, float):
        raise DataStateError(f"{what}: gauss_next must be a float or None")
    _check_python(what, entry["version"], internal)
    state = (entry["version"], tuple(int(v) for v in internal), gauss_next)
    _trial(what, lambda: random.Random().setstate(state))
    return lambda: random.setstate(state)


def _cuda_setter(what: str, entry: Mapping[str, Any]) -> Setter:
    """The CUDA devices' states go back only into as many devices, each state of the size the device's
    generator has; CUDA on one side only is refused (``include`` without ``"cuda"`` leaves them alone)."""
    current = cuda_generator_states()
    if entry.get("kind") == "absent" and set(entry) == {"kind"}:
        if current is None:
            return lambda: None
        raise DataStateError(f"{what}: saved where CUDA was absent, restored where it is available")
    _fields(what, entry, "cuda", {"states"})
    states = entry["states"]
    if current is None:
        raise DataStateError(f"{what}: saved with {len(states)} CUDA devices, restored where CUDA is absent")
    if not isinstance(states, list) or len(states) != len(current):
        raise DataStateError(f"{what}: the saved CUDA states are not one per device of the {len(current)} here")
    for state, now in zip(states, current, strict=True):
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != now.shape:
            raise DataStateError(f"{what}: a CUDA state must be a uint8 tensor of {list(now.shape)} bytes")

    def set_states() -> None:
        for device, state in enumerate(states):
            torch.cuda.set_rng_state(state, device)

    return set_states


def _setter(key: str, name: str, entry: Mapping[str, Any] | None, target: UserGenerator | None) -> Setter:
    """A function that sets generator ``name`` from ``entry``, after checking that it can (DataStateError)."""
    what = f"RNG state {key!r}, generator {name!r}"
    if entry is None:
        raise DataStateError(f"{what}: the loaded value has no such generator")
    if isinstance(target, torch.Generator):
        return _torch_setter(what, entry, target)
    if isinstance(target, np.random.Generator):
        return _numpy_setter(what, entry, target)
    if name == "torch":
        return _torch_setter(what, entry, torch.default_generator)
    if name == "numpy":
        return _numpy_setter(what, entry, None)
    if name == "python":
        return _python_setter(what, entry)
    return _cuda_setter(what, entry)


# ----------------------------------------------------------------------------------------------- restore


def _seed_one(name: str, gen: UserGenerator | None, seed: int, step: int, coordinate: tuple[int, ...]) -> None:
    """Seed generator ``name`` with :func:`derive_seed` (128 bits: torch takes the low 64, numpy's legacy
    seeding the four 32-bit words, Python and numpy's SeedSequence all of it)."""
    derived = derive_seed(seed, step, coordinate, name)
    if isinstance(gen, torch.Generator):
        gen.manual_seed(derived % 2**64)
    elif isinstance(gen, np.random.Generator):
        gen.bit_generator.state = type(gen.bit_generator)(np.random.SeedSequence(derived)).state
    elif name == "torch":
        torch.default_generator.manual_seed(derived % 2**64)
    elif name == "numpy":
        np.random.seed([(derived >> (32 * i)) & 0xFFFFFFFF for i in range(4)])
    elif name == "python":
        random.seed(derived, version=2)
    else:
        for device in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
            with torch.cuda.device(device):
                torch.cuda.manual_seed(derive_seed(seed, step, coordinate, f"cuda:{device}") % 2**64)


def _changed(
    key: str, saved: _Saved | None, coord: tuple[int, ...], shape: tuple[int, ...], policy: RngPolicy | None
) -> Literal["continued", "derived"]:
    """What a changed layout does under ``policy`` (module docstring), or the DataStateError refusing it."""
    was = (
        "no saved cell came back" if saved is None else f"saved at {list(saved.coordinate)} of grid {list(saved.grid)}"
    )
    if policy is None:
        raise DataStateError(
            f"RNG state {key!r}: the layout changed ({was}; this rank is {list(coord)} of grid {list(shape)}): "
            "restore_rng needs policy='derive' (every rank seeds its generators from seed, step and its "
            "coordinate) or policy='same_coordinate' (the ranks both grids have continue their streams, loaded "
            "with LoadOptions(object_grid='same_coordinate'); the others derive)"
        )
    if policy == "derive" or saved is None:
        return "derived"
    if saved.coordinate != coord:
        raise DataStateError(
            f"RNG state {key!r}: policy 'same_coordinate' got the cell {list(saved.coordinate)} of grid "
            f"{list(saved.grid)} on the rank at {list(coord)} of grid {list(shape)}: load the cell of this "
            "rank's coordinate (rng_template) with LoadOptions(object_grid='same_coordinate')"
        )
    return "continued"


def restore_rng(
    loaded_value: object,
    *,
    key: str = "rng",
    coordinate: Sequence[int],
    grid: Sequence[int],
    policy: RngPolicy | None = None,
    seed: int | None = None,
    step: int | None = None,
    generators: Mapping[str, UserGenerator] | None = None,
    include: Collection[str] = PROCESS_GENERATORS,
) -> RestoredRng:
    """Set this rank's generators from the loaded value of its ``rng_template`` cell (module docstring).

    At the same layout every generator of ``include`` and ``generators`` continues exactly, whatever the
    policy. On a changed layout ``policy`` decides (None: DataStateError); both policies need ``seed`` and
    ``step`` (they are required whenever a policy is given, so that every rank checks the same arguments).
    A generator asked for that the value lacks, or a state that does not fit its generator, raises
    DataStateError before any generator is set. Local to this rank: no collective.
    """
    _check_key(key)
    coord, shape = _layout(key, coordinate, grid)
    if policy is not None and policy not in RNG_POLICIES:
        raise DataStateError(f"RNG state {key!r}: policy must be one of {list(RNG_POLICIES)} or None, not {policy!r}")
    if policy is not None:
        if seed is None or step is None:
            raise DataStateError(
                f"RNG state {key!r}: policy {policy!r} needs seed= and step= (the derivation's inputs)"
            )
        _check_int("seed", seed)
        _check_int("step", step)
    targets = _targets(key, include, generators)
    saved = None if loaded_value is None else _parse(key, loaded_value)
    same = saved is not None and saved.coordinate == coord and saved.grid == shape
    mode = "exact" if same else _changed(key, saved, coord, shape, policy)
    names = tuple(n for n in targets if n != "cuda" or torch.cuda.is_available())
    if mode == "derived":
        assert seed is not None
        assert step is not None
        for name in names:
            _seed_one(name, targets[name], seed, step, coord)
    else:
        assert saved is not None
        setters = [_setter(key, name, saved.generators.get(name), gen) for name, gen in targets.items()]
        for set_state in setters:
            set_state()
    return RestoredRng(mode=mode, generators=names, saved_grid=None if saved is None else saved.grid)
