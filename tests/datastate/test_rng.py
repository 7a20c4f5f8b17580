"""RNG streams per rank (reshard.data.rng): exact continuation at the same layout, the explicit policies of a
changed layout, and what each reproduces, shown with the masks of a tiny model with dropout and numpy and
Python randomness, saved and loaded through reshard.save / reshard.load.

The process-wide generators (torch, numpy, Python) are one per process, so the ranks of these tests run one
after another in this process, each saving its own cell (a list of objects, as docs/concepts.md does); the
named generators of one test are per thread, on the real multi-rank save of a ThreadGroup.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import reshard
from reshard.data import derive_seed, restore_rng, rng_state, rng_template, sample_generator
from reshard.data.rng import cuda_generator_states
from reshard.errors import DataStateError
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads

pytestmark = pytest.mark.unit

SEED = 1234
SAVED_AT = 3  # the step the checkpoint is taken at
AFTER = 4  # steps run after the resume


@pytest.fixture(autouse=True)
def _keep_global_generators() -> Iterator[None]:
    """The tests set the process-wide generators; put them back for the tests that follow."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(states[0])
    np.random.set_state(states[1])
    random.setstate(states[2])


def _globals() -> tuple[Any, ...]:
    """The process-wide generators' states, comparable with ==."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    return torch.get_rng_state().tolist(), (name, key.tolist(), pos, has_gauss, gauss), random.getstate()


# ------------------------------------------------------------------------------------ the job's randomness

MODEL = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(p=0.5)).train()


def _start(rank: int) -> torch.Generator:
    """A rank's generators at step 0 (the job seeds each rank its own way); its model-parallel dropout
    generator (as Megatron's RNG tracker keeps one), returned."""
    torch.manual_seed(SEED + 101 * rank)
    np.random.seed(SEED + 103 * rank)
    random.seed(SEED + 107 * rank)
    return torch.Generator().manual_seed(SEED + 109 * rank)


def _step(tracker: torch.Generator) -> tuple[Any, ...]:
    """One training step's randomness: torch.nn.Dropout's mask (torch's default generator), a dropout mask
    drawn from the tracker generator, numpy noise and a Python choice."""
    with torch.no_grad():
        mask = MODEL(torch.ones(2, 8)) != 0
    tracked = torch.bernoulli(torch.full((8,), 0.5), generator=tracker)
    return (mask.tolist(), tracked.tolist(), np.random.rand(3).tolist(), random.random(), random.gauss(0, 1))


def _uninterrupted(ranks: int) -> list[list[tuple[Any, ...]]]:
    """Each rank's randomness of the steps after SAVED_AT, in a run that never stopped."""
    runs = []
    for rank in range(ranks):
        tracker = _start(rank)
        steps = [_step(tracker) for _ in range(SAVED_AT + AFTER)]
        runs.append(steps[SAVED_AT:])
    return runs


def _save(path: Path, ranks: int) -> None:
    """``ranks`` ranks (grid (ranks,)) run SAVED_AT steps and save their RNG state at step SAVED_AT."""
    cells = []
    for rank in range(ranks):
        tracker = _start(rank)
        for _ in range(SAVED_AT):
            _step(tracker)
        cells.append(rng_state(coordinate=(rank,), grid=(ranks,), seed=SEED, generators={"tracker": tracker}))
    reshard.save({"rng": cells, "step": SAVED_AT}, path)


def _resume(path: Path, ranks: int, policy: str | None, object_grid: str = "exact") -> list[list[tuple[Any, ...]]]:
    """``ranks`` ranks load their cells, restore their generators (after scrambling them: nothing of the
    process survives a restart) and run AFTER steps."""
    template = {"rng": [rng_template(coordinate=(r,), grid=(ranks,)) for r in range(ranks)], "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a changed grid's warning; tests/planning cover it
        loaded = reshard.load(template, path, options=reshard.LoadOptions(object_grid=object_grid))  # type: ignore[arg-type]
    runs = []
    for rank, value in enumerate(loaded["rng"]):
        torch.manual_seed(99), np.random.seed(99), random.seed(99)
        tracker = torch.Generator().manual_seed(99)
        restore_rng(
            value,
            coordinate=(rank,),
            grid=(ranks,),
            policy=policy,  # type: ignore[arg-type]
            seed=SEED,
            step=loaded["step"],
            generators={"tracker": tracker},
        )
        runs.append([_step(tracker) for _ in range(AFTER)])
    return runs


# ------------------------------------------------------------------------------------ (a) same layout


def test_same_layout_resume_is_bit_identical_to_the_uninterrupted_run(tmp_path: Path) -> None:
    _save(tmp_path / "ckpt", 4)
    assert _resume(tmp_path / "ckpt", 4, policy=None) == _uninterrupted(4)
    # the policy applies to a changed layout only: at the same layout every stream still continues
    assert _resume(tmp_path / "ckpt", 4, policy="derive") == _uninterrupted(4)


def test_every_generator_state_round_trips_exactly_through_a_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(5), np.random.seed(6), random.seed(7)
    np.random.standard_normal(), random.gauss(0, 1)  # a cached Gaussian in numpy's and Python's state
    pcg, mt, philox = (np.random.Generator(bg(8)) for bg in (np.random.PCG64, np.random.MT19937, np.random.Philox))
    pcg.random(3), philox.random(1)  # mid-buffer states
    named = {"pcg": pcg, "mt": mt, "philox": philox, "drop": torch.Generator().manual_seed(9)}
    before = _globals(), [g.bit_generator.state for g in (pcg, mt, philox)], named["drop"].get_state()
    reshard.save({"rng": rng_state(coordinate=(0,), grid=(1,), generators=named)}, tmp_path / "ckpt")
    loaded = reshard.load({"rng": rng_template(coordinate=(0,), grid=(1,))}, tmp_path / "ckpt")["rng"]
    assert loaded["generators"]["cuda"] == {"kind": "absent"} and cuda_generator_states() is None
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    for g in (pcg, mt, philox):
        g.random(5)
    named["drop"].manual_seed(0)
    restored = restore_rng(loaded, coordinate=(0,), grid=(1,), generators=named)
    assert restored.mode == "exact" and restored.generators == ("torch", "numpy", "python", *named)
    states = [g.bit_generator.state for g in (pcg, mt, philox)]
    assert _globals() == before[0]
    assert repr(states) == repr(before[1])  # 128-bit ints, uint32 and uint64 arrays, buffers: all exact
    assert torch.equal(named["drop"].get_state(), before[2])


def test_named_generators_of_ranks_on_threads_continue_exactly(tmp_path: Path) -> None:
    """The real multi-rank save and load (a ThreadGroup of 2): each rank's own generators only."""

    def generators(rank: int) -> dict[str, Any]:
        return {"drop": torch.Generator().manual_seed(rank), "aug": np.random.default_rng(rank)}

    def draws(gens: dict[str, Any]) -> list[Any]:
        return [torch.rand(4, generator=gens["drop"]).tolist(), gens["aug"].integers(0, 100, 4).tolist()]

    save_group, load_group = ThreadGroup(2, timeout=20), ThreadGroup(2, timeout=20)

    def save(rank: int) -> list[Any]:
        gens = generators(rank)
        draws(gens)
        cell = rng_state(coordinate=(rank,), grid=(2,), generators=gens, include=())
        reshard.save({"rng": cell}, tmp_path / "ckpt", group=save_group.member(rank))
        return draws(gens)

    def load(rank: int) -> list[Any]:
        gens = generators(rank + 10)
        value = reshard.load(
            {"rng": rng_template(coordinate=(rank,), grid=(2,))}, tmp_path / "ckpt", group=load_group.member(rank)
        )
        restore_rng(value["rng"], coordinate=(rank,), grid=(2,), generators=gens, include=())
        return draws(gens)

    expected = on_threads(2, save, group=save_group)
    assert on_threads(2, load, group=load_group) == expected


# ------------------------------------------------------------------------------------ (b) changed layout


@pytest.mark.parametrize("ranks", [2, 8])
def test_a_changed_layout_without_a_policy_is_refused_naming_key_grids_and_policies(tmp_path: Path, ranks: int) -> None:
    _save(tmp_path / "ckpt", 4)
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    before_restore = _globals()
    with pytest.raises(DataStateError) as caught:
        _resume(tmp_path / "ckpt", ranks, policy=None, object_grid="same_coordinate")
    message = str(caught.value)
    assert "'rng'" in message and "'derive'" in message and "'same_coordinate'" in message
    assert f"saved at [0] of grid [4]; this rank is [0] of grid [{ranks}]" in message
    assert _globals() == before_restore  # the resume's scrambled generators: the refusal set nothing


def test_derive_gives_identical_resumes_that_differ_from_the_uninterrupted_run(tmp_path: Path) -> None:
    _save(tmp_path / "ckpt", 4)
    first = _resume(tmp_path / "ckpt", 2, policy="derive", object_grid="skip")
    second = _resume(tmp_path / "ckpt", 2, policy="derive", object_grid="same_coordinate")
    assert first == second  # the derivation depends on (seed, step, coordinate) only
    uninterrupted = _uninterrupted(2)
    for rank in range(2):
        assert first[rank] != uninterrupted[rank]
        for after, before in zip(first[rank], uninterrupted[rank], strict=True):
            assert all(a != b for a, b in zip(after, before, strict=True))  # every generator's stream is new
    assert first[0] != first[1]  # and the ranks' streams differ from each other


def test_the_derivation_is_the_documented_sha256_and_never_changes() -> None:
    # docs/api.md: SHA-256 of {"coordinate":[1,0],"generator":"torch","purpose":"reshard.data.rng","seed":1234,"step":3}
    import hashlib

    text = '{"coordinate":[1,0],"generator":"torch","purpose":"reshard.data.rng","seed":1234,"step":3}'
    expected = int.from_bytes(hashlib.sha256(text.encode()).digest()[:16], "big")
    assert derive_seed(1234, 3, (1, 0), "torch") == expected == 0xBD7005E0F8E93E82_E0A86DC3118D188E
    assert derive_seed(1234, 3, (1, 0), "numpy") != expected != derive_seed(1234, 4, (1, 0), "torch")


# ------------------------------------------------------------------------------------ (c) same coordinate


@pytest.mark.parametrize("ranks", [2, 8])
def test_same_coordinate_continues_the_ranks_both_layouts_have_and_derives_the_others(
    tmp_path: Path, ranks: int
) -> None:
    _save(tmp_path / "ckpt", 4)
    resumed = _resume(tmp_path / "ckpt", ranks, policy="same_coordinate", object_grid="same_coordinate")
    again = _resume(tmp_path / "ckpt", ranks, policy="same_coordinate", object_grid="same_coordinate")
    uninterrupted = _uninterrupted(ranks)
    shared = min(ranks, 4)
    assert resumed[:shared] == uninterrupted[:shared]  # ranks 0..shared-1 continue exactly
    assert all(resumed[r] != uninterrupted[r] for r in range(shared, ranks))  # the new ranks derive ...
    assert resumed == again  # ... identically on every resume


def test_same_coordinate_refuses_the_cell_of_another_coordinate(tmp_path: Path) -> None:
    _save(tmp_path / "ckpt", 4)
    value = reshard.load({"rng": rng_template(coordinate=(3,), grid=(4,))}, tmp_path / "ckpt")["rng"]
    before = _globals()
    with pytest.raises(DataStateError, match=r"got the cell \[3\] of grid \[4\] on the rank at \[1\] of grid \[2\]"):
        restore_rng(value, coordinate=(1,), grid=(2,), policy="same_coordinate", seed=SEED, step=3)
    assert _globals() == before


# ------------------------------------------------------------------------------------ hostile values


def _value(tmp_path: Path) -> dict[str, Any]:
    drop = torch.Generator().manual_seed(1)
    reshard.save({"rng": rng_state(coordinate=(0,), grid=(1,), generators={"drop": drop})}, tmp_path / "ckpt")
    value: dict[str, Any] = reshard.load({"rng": rng_template(coordinate=(0,), grid=(1,))}, tmp_path / "ckpt")["rng"]
    return value


def _set(path: tuple[Any, ...], new: Any) -> Any:
    def change(value: dict[str, Any]) -> None:
        target = value
        for part in path[:-1]:
            target = target[part]
        if new is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = new

    return change


HOSTILE = {  # a change of the saved value, and what the refusal says
    # the generators are restored in the order torch, numpy, python, cuda, drop: a half-restore would show
    "not a dict": (lambda v: v.clear(), r"not a saved RNG state of rng_state \(\[\]\)"),
    "wrong format": (_set(("format",), "reshard.data.rng/9"), "not a saved RNG state"),
    "another key": (_set(("key",), "other"), "it was saved as 'other'"),
    "coordinate outside its grid": (_set(("coordinate",), [1]), r"coordinate \[1\] is not a cell of the grid \[1\]"),
    "torch state too short": (
        _set(("generators", "drop", "state"), torch.zeros(10, dtype=torch.uint8)),
        "'drop': not a valid state .*size 5056",
    ),
    "torch state of another dtype": (
        _set(("generators", "drop", "state"), torch.zeros(5056, dtype=torch.int64)),
        "'drop': the state must be a 1-d uint8 tensor",
    ),
    "a CUDA state into a CPU generator": (
        _set(("generators", "drop", "device"), "cuda"),
        "'drop': saved from a 'cuda' generator, restored into a cpu",
    ),
    "python state of a wrong size": (
        _set(("generators", "python", "internal"), np.zeros(600, dtype=np.int64)),
        "'python': the internal state must be 625 int64 values",
    ),
    "python state out of range": (
        _set(("generators", "python", "internal"), np.full(625, -1, dtype=np.int64)),
        "'python': the words of the state must be uint32",
    ),
    "python state of wrong type": (
        _set(("generators", "python", "internal"), list(range(625))),
        "'python': the internal state must be 625 int64 values",
    ),
    "numpy state of another bit generator": (
        _set(("generators", "numpy", "state"), {"bit_generator": "PCG64", "state": {"state": 1, "inc": 3}}),
        "'numpy': a numpy state of bit generator 'PCG64', restored into a MT19937",
    ),
    "numpy key too long": (
        _set(("generators", "numpy", "state", "state", "key", "bits"), np.zeros(700, dtype=np.int64)),
        "'numpy': an MT19937 state needs a key of 624 words",
    ),
    "numpy key out of range": (
        _set(("generators", "numpy", "state", "state", "key", "bits"), np.full(624, 2**40, dtype=np.int64)),
        "'numpy': a uint32 array holds values out of range",
    ),
    "a generator of another kind": (
        _set(("generators", "drop"), {"kind": "python"}),
        "'drop': expected a 'torch' state",
    ),
    "missing generator": (_set(("generators", "drop"), KeyError), "'drop': the loaded value has no such generator"),
    "missing python": (_set(("generators", "python"), KeyError), "'python': the loaded value has no such generator"),
    # numpy's legacy MT19937 and Python's random take these without a complaint and then draw garbage (pos out of
    # the 624-word key: reads past it), a stream of zeros (an all-zero key) or another state (words truncated)
    **{
        f"numpy pos {pos}": (_set(("generators", "numpy", "state", "state", "pos"), pos), "'numpy': pos must be")
        for pos in (625, -3, 100_000, 10**8)
    },
    "numpy pos not an int": (_set(("generators", "numpy", "state", "state", "pos"), True), "'numpy': pos must be"),
    "numpy key all zero": (
        _set(("generators", "numpy", "state", "state", "key", "bits"), np.zeros(624, dtype=np.int64)),
        "'numpy': an MT19937 key of all zero words",
    ),
    "numpy key of uint64 words": (
        _set(("generators", "numpy", "state", "state", "key", "numpy_dtype"), "uint64"),
        r"'numpy': an MT19937 state needs a key of 624 words \(uint32\)",
    ),
    "numpy has_gauss not 0 or 1": (_set(("generators", "numpy", "state", "has_gauss"), 7), "'numpy': has_gauss"),
    "python words of 33 bits": (
        lambda v: v["generators"]["python"]["internal"].__setitem__(slice(0, 624), 2**33 + 5),
        "'python': the words of the state must be uint32",
    ),
    "python words all zero": (
        lambda v: v["generators"]["python"]["internal"].__setitem__(slice(0, 624), 0),
        "'python': all zero words",
    ),
    "python index past the state": (
        lambda v: v["generators"]["python"]["internal"].__setitem__(624, 625),
        r"'python': the index must be in \[0, 624\]",
    ),
    "python version 2": (_set(("generators", "python", "version"), 2), "'python': version must be 3"),
    "CUDA states where CUDA is absent": (
        _set(("generators", "cuda"), {"kind": "cuda", "states": [torch.zeros(16, dtype=torch.uint8)]}),
        "'cuda': saved with 1 CUDA devices, restored where CUDA is absent",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_value_is_refused_and_sets_nothing(tmp_path: Path, case: str) -> None:
    value = _value(tmp_path)
    change, match = HOSTILE[case]
    change(value)
    drop = torch.Generator().manual_seed(77)
    torch.manual_seed(11), np.random.seed(12), random.seed(13)
    before = _globals(), drop.get_state()
    with pytest.raises(DataStateError, match=f"RNG state 'rng'.*{match}"):
        restore_rng(value, coordinate=(0,), grid=(1,), generators={"drop": drop})
    assert _globals() == before[0] and torch.equal(drop.get_state(), before[1])


@pytest.mark.parametrize(
    ("bit_generator", "pos"),
    [(np.random.MT19937, 625), (np.random.MT19937, -1), (np.random.MT19937, 10**8), (np.random.Philox, -5)],
)
def test_a_named_generator_with_a_position_out_of_its_buffer_is_refused(
    tmp_path: Path, bit_generator: Any, pos: int
) -> None:
    saved = {"aug": np.random.Generator(bit_generator(1))}
    reshard.save({"rng": rng_state(coordinate=(0,), grid=(1,), generators=saved, include=())}, tmp_path / "ckpt")
    value = reshard.load({"rng": rng_template(coordinate=(0,), grid=(1,))}, tmp_path / "ckpt")["rng"]
    if bit_generator is np.random.Philox:
        value["generators"]["aug"]["state"]["buffer_pos"] = pos
    else:
        value["generators"]["aug"]["state"]["state"]["pos"] = pos
    target = np.random.Generator(bit_generator(2))
    before = repr(target.bit_generator.state)
    with pytest.raises(DataStateError, match=r"'aug': (buffer_)?pos must be"):
        restore_rng(value, coordinate=(0,), grid=(1,), generators={"aug": target}, include=())
    assert repr(target.bit_generator.state) == before


def test_a_numpy_generator_of_another_bit_generator_is_refused(tmp_path: Path) -> None:
    saved = {"aug": np.random.Generator(np.random.PCG64(1))}
    reshard.save({"rng": rng_state(coordinate=(0,), grid=(1,), generators=saved, include=())}, tmp_path / "ckpt")
    value = reshard.load({"rng": rng_template(coordinate=(0,), grid=(1,))}, tmp_path / "ckpt")["rng"]
    target = np.random.Generator(np.random.SFC64(2))
    before = target.bit_generator.state
    with pytest.raises(DataStateError, match="bit generator 'PCG64', restored into a SFC64"):
        restore_rng(value, coordinate=(0,), grid=(1,), generators={"aug": target}, include=())
    assert repr(target.bit_generator.state) == repr(before)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "nearest", "seed": 1, "step": 1}, "policy must be one of"),
        ({"policy": "derive"}, "needs seed= and step="),
        ({"policy": "derive", "seed": -1, "step": 0}, "seed must be a non-negative int"),
        ({"include": ("torch", "gpu")}, "include takes names of"),
        ({"generators": {"torch": torch.Generator()}}, "other than"),
        ({"generators": {"drop": random.Random()}}, "not a torch.Generator or a numpy Generator"),
        ({"coordinate": (2,)}, r"coordinate \[2\] is not a cell of the grid \[2\]"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"coordinate": (0,), "grid": (2,), **kwargs}
    with pytest.raises(DataStateError, match=match):
        restore_rng(None, **arguments)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"generators": [torch.Generator()]}, "generators must be a mapping"),
        ({"generators": {"cuda:0": torch.Generator()}}, "other than"),
        ({"key": ""}, "key must be a non-empty string"),
        ({"key": 5}, "key must be a non-empty string"),
    ],
)
def test_bad_arguments_are_refused_by_rng_state_and_restore_rng(kwargs: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"coordinate": (0,), "grid": (2,), **kwargs}
    with pytest.raises(DataStateError, match=match):
        restore_rng(None, policy="derive", seed=1, step=2, **arguments)
    with pytest.raises(DataStateError, match=match):
        rng_state(**arguments)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rng_state(coordinate=(0,), grid=(1,), replica_id=-1), "replica_id must be a non-negative int"),
        (lambda: rng_state(coordinate=(0,), grid=(1,), replica_id=True), "replica_id must be a non-negative int"),
        (lambda: rng_template("", coordinate=(0,), grid=(1,)), "key must be a non-empty string"),
        (lambda: sample_generator(1, 0, 1, device="nope"), "device 'nope'"),
        (lambda: sample_generator(1, 0, 1, device=3.5), "device 3.5"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_of_the_other_functions_are_refused(call: Any, match: str) -> None:
    with pytest.raises(DataStateError, match=match):
        call()


def test_a_named_generator_may_not_take_the_derivation_name_of_a_cuda_device() -> None:
    """'cuda:0' is the name CUDA device 0's generator is derived under: a named generator so called would get
    the same stream."""
    with pytest.raises(DataStateError, match="'cuda:0'"):
        restore_rng(
            None, coordinate=(0,), grid=(2,), policy="derive", seed=1, step=2, generators={"cuda:0": torch.Generator()}
        )
    assert (
        restore_rng(
            None, coordinate=(0,), grid=(2,), policy="derive", seed=1, step=2, generators={"cuda0": torch.Generator()}
        ).mode
        == "derived"
    )


def test_cuda_absent_is_recorded_as_absent_and_a_saved_absence_restores_here() -> None:
    """The CUDA path on a machine without CUDA (the test machines have none): recorded as absent, and an
    absent record restores; the present case (states of as many devices) is refused above ("CUDA states where
    CUDA is absent")."""
    assert not torch.cuda.is_available() and cuda_generator_states() is None
    value = rng_state(coordinate=(0,), grid=(1,), include=("cuda",)).value
    assert value["generators"] == {"cuda": {"kind": "absent"}}
    restored = restore_rng(value, coordinate=(0,), grid=(1,), include=("cuda",))
    assert restored.mode == "exact" and restored.generators == ()


# ------------------------------------------------------------------------------------ per-sample randomness


def test_per_sample_generators_give_the_same_masks_on_any_layout() -> None:
    """What no checkpoint of per-rank streams can give: randomness that is the same whichever rank a sample
    lands on. Each sample's dropout mask comes from sample_generator(seed, epoch, sample_id)."""

    def masks(ranks: int) -> dict[int, list[float]]:
        out = {}
        for rank in range(ranks):
            for sample in range(rank, 16, ranks):  # a DistributedSampler-like split of 16 samples
                gen = sample_generator(SEED, 2, sample)
                out[sample] = torch.bernoulli(torch.full((8,), 0.5), generator=gen).tolist()
        return out

    assert masks(4) == masks(2) == masks(8)
    assert len({tuple(m) for m in masks(4).values()}) > 1
    first = torch.rand(2, generator=sample_generator(1, 0, 5)).tolist()
    assert first == torch.rand(2, generator=sample_generator(1, 0, 5)).tolist()
    assert first != torch.rand(2, generator=sample_generator(1, 1, 5)).tolist()
