"""The flows that move tensors between ranks with no storage in between: ``reshard.transfer``, a
``TransferSession`` with deltas, and the peer-memory tier (save, a death, a restore into another layout
on the survivors). None of them may touch a file at all: their places are empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tests.contract import guarantees, states
from tests.contract.events import KillPoint
from tests.contract.flows import Flow, RankRun, register
from tests.contract.guarantees import Answers, Finding


def preload() -> None:
    """Nothing beyond reshard itself."""


def tensors_of(state: dict[str, Any]) -> dict[str, Any]:
    """The tensors of a rank's state (a transfer moves tensors only)."""
    return {k: v for k, v in state.items() if k not in ("step", "rng")}


def first_exchange(events: dict[int, list[str]]) -> list[KillPoint]:
    first = next((i for i, name in enumerate(events[0]) if name == "exchange"), None)
    return [] if first is None else [KillPoint(rank=0, index=first, when=w) for w in ("before", "after")]


class _Network(Flow):
    places: ClassVar[tuple[str, ...]] = ()
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {}

    def pinned(self, events: dict[int, list[str]]) -> list[KillPoint]:
        return first_exchange(events)


@register
class Transfer(_Network):
    """``reshard.transfer``: rows (and columns of ``e``) of generation 2 to the column layout."""

    name = "transfer"

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        source = tensors_of(states.rank_state(run.rank, run.world, 2, objects=False))
        target = states.column_template(run.rank, run.world)
        with run.armed():
            reshard.transfer(source, target, timeout=run.timeout)
        generation = states.column_generation(target, run.rank, run.world, (1, 2))
        return {"generation": -1 if generation is None else generation}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        return 2, guarantees.returned_generation(answers, (2,), what="transfer")


@register
class DeltaTransfer(_Network):
    """A ``TransferSession``: generation 1 sent whole, then generation 2 with ``delta=True`` (``frozen`` is
    unchanged, so only the other cells travel)."""

    name = "delta"

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        session = reshard.TransferSession(timeout=run.timeout)
        target = states.column_template(run.rank, run.world)
        session.transfer(tensors_of(states.rank_state(run.rank, run.world, 1, objects=False)), target)
        source = tensors_of(states.rank_state(run.rank, run.world, 2, objects=False))
        with run.armed():
            session.transfer(source, target, delta=True)
        generation = states.column_generation(target, run.rank, run.world, (1, 2))
        return {"generation": -1 if generation is None else generation}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        return 2, guarantees.returned_generation(answers, (2,), what="delta transfer")


@register
class PeerTier(_Network):
    """``PeerMemoryCheckpoint`` (one rank per node, one copy each): generation 1 saved, then generation 2
    saved with a death anywhere in it; the survivors form a new group and restore into the column layout
    of their own number. The restore must give one whole generation on every survivor (2 once any rank's
    save of it returned), never a refusal while a copy of every box of a complete save survives."""

    name = "peer"
    regroups = True
    worlds = (3, 4)

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1, timeout=run.timeout)
        first: dict[str, Any] = {}
        tier.save(tensors_of(states.rank_state(run.rank, run.world, 1, objects=False)) | {"step": 1})
        try:
            with run.armed():
                tier.save(tensors_of(states.rank_state(run.rank, run.world, 2, objects=False)) | {"step": 2})
            first["saved"] = True
        except reshard.CheckpointError as exc:
            first["saved"] = False
            first["save_error"] = type(exc).__name__
        assert run.regroup is not None
        joined = run.regroup(first)
        if joined is None:
            return {**first, "restored": None}
        rank, world = joined
        template = states.column_template(rank, world, saved_world=run.world) | {"step": -1}
        with run.armed():
            restored = tier.restore(template)
        generation = states.column_generation(restored, rank, world, (1, 2), saved_world=run.world)
        if generation is not None and restored["step"] != generation:
            generation = None
        return {**first, "generation": -1 if generation is None else generation}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        restored = {a.get("generation") for a in answers.values() if a.get("ok")}
        if len(restored) > 1:
            return None, Finding("silent", f"the survivors restored different generations: {sorted(restored)}")
        saved = any(a.get("saved") for a in answers.values())
        finding = guarantees.returned_generation(answers, (2,) if saved else (1, 2), what="restore")
        lost = [r for r, a in answers.items() if a.get("error") == "DataUnavailableError"]
        if finding is None and lost:
            finding = Finding("lost", f"ranks {lost} were refused a restore although a copy of every box survived")
        return (restored.pop() if len(restored) == 1 else None), finding


# ---- a transfer that quantizes on the way ---------------------------------------------------------------

W_FORMAT, W_BLOCK = "fp8_e4m3", (8, 4)  # rows of 12 per sender cut the 8-row blocks: their amaxes are combined
E_FORMAT = "nvfp4"  # blocks of 16 over columns of 4 per sender, and the global amax over every sender


def quantized_template(rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank`` of ``world``'s zeroed ScaledTensors: ``w`` in FP8 (8, 4) blocks by columns, ``e`` in
    NVFP4 (packed) by rows, and the whole plain ``bias``."""
    import reshard

    cols, rows_e = states.COLS // world, states.ROWS // world
    w_rows = world * states.ROWS
    w = reshard.ShardedTensor.from_rank_offsets(
        "w", torch.zeros(w_rows, cols, dtype=torch.float8_e4m3fn), (1, rank, world)
    )
    w_scale = torch.zeros(-(-w_rows // W_BLOCK[0]), cols // W_BLOCK[1])
    e = reshard.ShardedTensor.from_rank_offsets(
        "e", torch.zeros(rows_e, world * 2, dtype=torch.uint8), (0, rank, world)
    )
    e_scale = torch.zeros(rows_e, -(-world * 4 // 16), dtype=torch.float8_e4m3fn)
    return {
        "w": reshard.ScaledTensor(w, w_scale, W_FORMAT, W_BLOCK),
        "e": reshard.ScaledTensor(e, e_scale, E_FORMAT, global_scale=torch.zeros(())),
        "bias": torch.zeros(17, dtype=torch.int64),
    }


def quantized_generation(target: dict[str, Any], rank: int, world: int, candidates: tuple[int, ...]) -> int | None:
    """Which generation rank ``rank``'s :func:`quantized_template` holds: every byte of its data, scales
    and global scale equal to :func:`reshard.state.quantize.quantize` of that generation's whole tensors
    (None: none of them)."""
    from reshard.state.quantize import quantize

    cols, rows_e = states.COLS // world, states.ROWS // world
    for generation in candidates:
        full = states.global_state(generation, world)
        w = quantize(full["w"], W_FORMAT, W_BLOCK)
        e = quantize(full["e"], E_FORMAT)
        c, s = slice(rank * cols, (rank + 1) * cols), slice(rank * cols // W_BLOCK[1], (rank + 1) * cols // W_BLOCK[1])
        r = slice(rank * rows_e, (rank + 1) * rows_e)
        assert e.global_scale is not None
        wanted = [
            (target["w"].data.data, w.data[:, c]),
            (target["w"].scale, w.scale[:, s]),
            (target["e"].data.data, e.data[r]),
            (target["e"].scale, e.scale[r]),
            (target["e"].global_scale.reshape(()), e.global_scale.reshape(())),
            (target["bias"], full["bias"]),
        ]
        if all(states.same_bits(got, want) for got, want in wanted):
            return generation
    return None


@register
class QuantizingTransfer(_Network):
    """A ``TransferSession`` that quantizes on the way (issue 32 part E): generation 1 sent whole, then
    generation 2 (``delta=False``: quantized keys are never sent as deltas), float32 ``w`` and bfloat16 ``e``
    of the row/column layout into FP8-block and NVFP4 ScaledTensors of the other layout. What a rank that
    returned holds must be ``quantize`` of generation 2, bit for bit: data, scales and global scale."""

    name = "quantize"

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        session = reshard.TransferSession(timeout=run.timeout)
        target = quantized_template(run.rank, run.world)
        first = tensors_of(states.rank_state(run.rank, run.world, 1, objects=False))
        session.transfer({k: first[k] for k in ("w", "e", "bias")}, target, delta=False)
        if quantized_generation(target, run.rank, run.world, (1,)) != 1:
            return {"generation": -1}  # the first transfer, unarmed, is not under test: a wrong one is silent
        second = tensors_of(states.rank_state(run.rank, run.world, 2, objects=False))
        with run.armed():
            session.transfer({k: second[k] for k in ("w", "e", "bias")}, target, delta=False)
        generation = quantized_generation(target, run.rank, run.world, (1, 2))
        return {"generation": -1 if generation is None else generation}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        return 2, guarantees.returned_generation(answers, (2,), what="quantizing transfer")
