"""The flows at the edge: Megatron-Core's ``dist_checkpointing`` with the reshard strategy (a save over an
earlier checkpoint, then a load by the survivors), and the offline writers (``convert``, ``import-dcp``),
which run in one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from tests.contract import guarantees, states
from tests.contract.events import KillPoint
from tests.contract.flows import Flow, ForeignFailure, RankRun, raised_inside_reshard, register, save_single
from tests.contract.guarantees import Answers, Finding


def preload() -> None:
    """Import megatron-core (seconds) once, in the zygote, when it is installed."""
    import contextlib

    with contextlib.suppress(ImportError):
        import megatron.core.dist_checkpointing  # noqa: F401

        import reshard.interop.megatron  # noqa: F401


# ---- Megatron-Core: dist_checkpointing.save / load with ("reshard", 1) ----------------------------------


def megatron_state(rank: int, world: int, generation: int, *, saved_world: int | None = None) -> dict[str, Any]:
    """A Megatron sharded state dict: ``w`` in rows, ``e`` in columns, ``frozen`` in rows, a replicated
    ``bias`` and the iteration as common state (Megatron pickles it into ``common.pt``). With
    ``saved_world``, an empty template of the column layout of ``world`` ranks over that state."""
    from megatron.core.dist_checkpointing import ShardedTensor

    saved = saved_world or world
    full = states.global_state(generation, saved)
    if saved_world is None:
        parts = {
            "w": (full["w"][rank * states.ROWS : (rank + 1) * states.ROWS].clone(), (0, rank, world)),
            "e": (full["e"][:, rank * 4 : (rank + 1) * 4].clone(), (1, rank, world)),
            "frozen": (
                full["frozen"][rank * states.FROZEN_ROWS : (rank + 1) * states.FROZEN_ROWS].clone(),
                (0, rank, world),
            ),
        }
    else:
        cols, rows_e = states.COLS // world, states.ROWS // world
        parts = {
            "w": (torch.zeros(saved * states.ROWS, cols), (1, rank, world)),
            "e": (torch.zeros(rows_e, saved * 4, dtype=torch.bfloat16), (0, rank, world)),
            "frozen": (torch.zeros(saved * states.FROZEN_ROWS, cols), (1, rank, world)),
        }
    state: dict[str, Any] = {k: ShardedTensor.from_rank_offsets(k, t, offsets) for k, (t, offsets) in parts.items()}
    bias = full["bias"].clone() if saved_world is None else torch.zeros(17, dtype=torch.int64)
    state["bias"] = ShardedTensor.from_rank_offsets("bias", bias, replica_id=rank)
    state["iteration"] = generation if saved_world is None else -1
    return state


@register
class MegatronSave(Flow):
    """``dist_checkpointing.save(B, dir, sharded_strategy=("reshard", 1))`` over a directory that holds A
    (saved by the same ranks first), a death anywhere in it; then the survivors, in a new group, load it
    with ``dist_checkpointing.load`` into the column layout of their number: the tensors and the common
    state (``iteration``) must come from one save, never a mix."""

    name = "megatron"
    regroups = True
    places = ("mcore",)
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"mcore": ("notes.txt",)}
    worlds = (2, 3)

    def run(self, run: RankRun) -> dict[str, Any] | None:
        from megatron.core import dist_checkpointing

        import reshard

        path = str(run.place / "mcore")
        dist_checkpointing.save(megatron_state(run.rank, run.world, 1), path, sharded_strategy=("reshard", 1))
        first: dict[str, Any] = {}
        try:
            with run.armed():
                dist_checkpointing.save(megatron_state(run.rank, run.world, 2), path, sharded_strategy=("reshard", 1))
            first["saved"] = True
        except (reshard.CheckpointError, dist_checkpointing.core.CheckpointingException) as exc:
            first.update(saved=False, save_error=type(exc).__name__)
        except RuntimeError as exc:  # Megatron's own collectives (its barrier) finding the victim dead
            if raised_inside_reshard(exc):
                raise
            first.update(saved=False, save_error=f"foreign {type(exc).__name__}")
        assert run.regroup is not None
        joined = run.regroup(first)
        if joined is None:
            return first
        rank, world = joined
        template = megatron_state(rank, world, 0, saved_world=run.world)
        try:
            with run.armed():
                loaded = dist_checkpointing.load(template, path)
        except RuntimeError as exc:
            if raised_inside_reshard(exc):
                raise
            raise ForeignFailure(exc) from exc
        generation = states.column_generation(loaded, rank, world, (1, 2), saved_world=run.world)
        if generation is not None and loaded["iteration"] != generation:
            generation = None  # the tensors of one save with the common state of another
        return {**first, "generation": -1 if generation is None else generation}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        loaded = {a.get("generation") for a in answers.values() if a.get("ok")}
        saved = any(a.get("saved") for a in answers.values())
        finding = guarantees.returned_generation(answers, (2,) if saved else (1, 2), what="dist_checkpointing.load")
        return (loaded.pop() if len(loaded) == 1 else None), finding

    def pinned(self, events: dict[int, list[str]]) -> list[KillPoint]:
        names = events[0]
        commit = [i for i, name in enumerate(names) if name == "commit metadata.json"]
        common = [i for i, name in enumerate(names) if name.endswith("common.pt")]
        points = [KillPoint(rank=0, index=i, when="after") for i in commit[1:2] + common[1:2]]
        return points


# ---- the offline writers: convert, import-dcp (one process) -------------------------------------------------


@register
class Convert(Flow):
    """``reshard.interop.convert_checkpoint(src, dst, overwrite=True)``: generation 2 copied over a
    committed generation 1."""

    name = "convert"
    places = ("src", "dst")
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"dst": ("notes.txt", "data/user.csv")}
    worlds = (1,)

    def prepare_place(self, place: Path, world: int) -> None:
        save_single(place / "src", 2, 2)
        save_single(place / "dst", 1, 2)

    def write(self, run: RankRun) -> None:
        from reshard.interop.convert import convert_checkpoint

        convert_checkpoint(run.place / "src", run.place / "dst", overwrite=True)

    def run(self, run: RankRun) -> dict[str, Any] | None:
        with run.armed():
            self.write(run)
        return None

    objects: ClassVar[bool] = True

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        allowed = (2,) if guarantees.confirmed(answers) else (1, 2)
        generation, finding = guarantees.loads_as(
            place / "dst", 2, allowed, what="the destination", objects=self.objects
        )
        if finding is None:
            finding = guarantees.readers_agree(place / "dst", True)
        if finding is None and (place / "src" / "metadata.json").exists():
            finding = guarantees.loads_as(place / "src", 2, (2,), what="the source", objects=self.objects)[1]
        return generation, finding

    def pinned(self, events: dict[int, list[str]]) -> list[KillPoint]:
        commit = next((i for i, name in enumerate(events[0]) if name == "commit metadata.json"), None)
        return [] if commit is None else [KillPoint(rank=0, index=commit, when=w) for w in ("before", "after")]


@register
class ImportDcp(Convert):
    """``reshard.interop.import_dcp(src, dst, trust_pickle=True, overwrite=True)``: a DCP checkpoint of
    generation 2 imported over a committed reshard checkpoint of generation 1."""

    name = "import_dcp"
    objects = False

    def prepare_place(self, place: Path, world: int) -> None:
        import torch.distributed.checkpoint as dcp

        state: dict[str, Any] = dict(states.global_state(2, 2))
        state["step"] = 2
        dcp.save(state, checkpoint_id=str(place / "src"), no_dist=True)
        first: dict[str, Any] = dict(states.global_state(1, 2))
        first["step"] = 1
        import reshard

        reshard.save(first, place / "dst")

    def write(self, run: RankRun) -> None:
        from reshard.interop.dcp import import_dcp

        import_dcp(run.place / "src", run.place / "dst", trust_pickle=True, overwrite=True)

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        allowed = (2,) if guarantees.confirmed(answers) else (1, 2)
        generation, finding = guarantees.loads_as(place / "dst", 2, allowed, what="the destination", objects=False)
        if finding is None:
            finding = guarantees.readers_agree(place / "dst", True)
        return generation, finding
