"""The flow of ``reshard.data`` (issue 34): every rank captures its sampler's position (``capture``, a
collective) and describes its record buffer (``records_state``, a collective), then the job saves both with its
tensors over a committed checkpoint (``overwrite=True``). What holds afterwards: the checkpoint loads as one
generation, and its data position and its records are those of the SAME generation as its tensors (a load
never mixes two saves), read back at another layout (one process, a data-parallel size of one).

Generation 1 (committed before the flow, by one process) consumed the prefix of :data:`PREFIX` positions and
holds records 0 .. 4; generation 2 (the flow, ``world`` ranks) consumed ``2 + rank % 2`` samples on each rank (an
uneven capture) and holds records ``100 + 10 * rank + i``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from tests.contract import guarantees, states
from tests.contract.flows import Flow, RankRun, later_save, register
from tests.contract.guarantees import Answers, Finding

SIZE, SEED, PREFIX = 60, 5, 7


def preload() -> None:
    """The torch data utilities and reshard.data, imported once in the zygote."""
    import reshard.data  # noqa: F401


class Ids(Dataset[int]):
    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, index: int) -> int:
        return index


def sampler(world: int, rank: int) -> Any:
    import reshard.data

    return reshard.data.ElasticSampler(Ids(), num_replicas=world, rank=rank, seed=SEED, drop_last=True)


def consumed_by(rank: int) -> int:
    return 2 + rank % 2


def expected_positions(generation: int, world: int) -> set[int]:
    """The epoch positions generation ``generation`` consumed: torch's DistributedSampler deals position
    ``r + world * j`` to rank ``r`` (nothing consumed before), and rank ``r`` consumed :func:`consumed_by`."""
    if generation == 1:
        return set(range(PREFIX))
    return {r + world * j for r in range(world) for j in range(consumed_by(r))}


def records(generation: int, rank: int) -> tuple[list[dict[str, torch.Tensor]], list[int]]:
    first = list(range(5)) if rank == 0 else []
    ids = first if generation == 1 else [100 + 10 * rank + i for i in range(rank + 1)]
    return [{"tokens": torch.arange(i % 7 + 1, dtype=torch.int32) + i} for i in ids], ids


def data_state(generation: int, world: int, rank: int, group: Any, timeout: float | None) -> dict[str, Any]:
    """The data entries of a rank's state dict (two collectives over ``group``)."""
    import reshard.data

    mine = sampler(world, rank)
    taken = PREFIX if generation == 1 else consumed_by(rank)
    position = reshard.data.capture(mine, group=group, consumed=taken, timeout=timeout)
    found, ids = records(generation, rank)
    buffer = reshard.data.RecordBuffer.from_records(found, ids) if ids else reshard.data.RecordBuffer.empty()
    return {"data": position, "rollouts": reshard.data.records_state("rollouts", buffer, group=group, timeout=timeout)}


def data_generation(path: Path, world: int) -> tuple[int | None, str]:
    """The generation of the data position and the records at ``path``, read at one rank (-1: neither's)."""
    import reshard
    import reshard.data

    try:
        value = reshard.load({"data": reshard.data.template()}, path)["data"]
        resumed = sampler(1, 0)
        reshard.data.restore(value, resumed)
        buffer = reshard.data.load_records(path, "rollouts", rank=0, world=1)
    except reshard.CheckpointError as exc:
        return None, f"{type(exc).__name__}: {exc}"
    consumed = set(resumed.consumed_positions.mask(SIZE).nonzero().flatten().tolist())
    found = buffer.ids.tolist()
    for generation, saved_world in ((1, 1), (2, world)):
        ids = [i for r in range(saved_world) for i in records(generation, r)[1]]
        if consumed == expected_positions(generation, saved_world) and found == ids:
            return generation, ""
    return -1, f"the data position ({sorted(consumed)}) and records ({found}) are of no generation"


@register
class DataState(Flow):
    """``reshard.data.capture`` + ``records_state`` + ``reshard.save(overwrite=True)`` over generation 1."""

    name = "data"

    def prepare_place(self, place: Path, world: int) -> None:
        import reshard

        state = {**states.single_process_state(1, world), **data_state(1, 1, 0, None, None)}
        reshard.save(state, place / "ckpt")

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        state = states.rank_state(run.rank, run.world, 2)
        with run.armed():
            state.update(data_state(2, run.world, run.rank, None, run.timeout))
            reshard.save(state, run.place / "ckpt", overwrite=True, timeout=run.timeout)
        return None

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        path = place / "ckpt"
        allowed = (2,) if guarantees.confirmed(answers) else (1, 2)
        generation, finding = guarantees.loads_as(path, world, allowed, what="the checkpoint")
        if finding is not None or generation is None:
            return generation, finding
        data, reason = data_generation(path, world)
        if data is None:
            return generation, Finding("lost", f"the data state of the checkpoint does not load: {reason}")
        if data != generation:
            return generation, Finding(
                "silent", f"tensors of generation {generation}, data state of {data}: {reason or 'two saves mixed'}"
            )
        return generation, guarantees.readers_agree(path, True)

    def follow_up(self, place: Path, world: int) -> Finding | None:
        return later_save(place / "ckpt", world)
