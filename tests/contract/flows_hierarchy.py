"""The flows of the two-level control path (:mod:`reshard.net.hierarchy`): a save and a resharding load whose
protocol goes through node leaders (``HierarchicalGroups``, nodes of two consecutive ranks, the last one short
when the world is odd), so that every kill point of a member, a leader and the coordinator is visited over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.contract import guarantees, states
from tests.contract.flows import Flow, Overwrite, RankRun, register, save_single
from tests.contract.guarantees import Answers, Finding


def preload() -> None:
    """Nothing beyond reshard itself."""


def hierarchical_groups(run: RankRun) -> Any:
    """Nodes of two consecutive ranks, made before the flow is armed (creating groups is the job's start-up)."""
    from reshard.net.hierarchy import HierarchicalGroups

    nodes = [list(range(start, min(start + 2, run.world))) for start in range(0, run.world, 2)]
    return HierarchicalGroups(None, nodes=nodes, timeout=run.timeout)


@register
class HierarchicalOverwrite(Overwrite):
    """``reshard.save(B, path, overwrite=True, group=HierarchicalGroups(...))`` over a committed A."""

    name = "hierarchical"

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        groups = hierarchical_groups(run)
        state = states.rank_state(run.rank, run.world, 2)
        with run.armed():
            reshard.save(state, run.place / "ckpt", overwrite=True, group=groups, timeout=run.timeout)
        return None


@register
class HierarchicalLoad(Flow):
    """Every rank loads its columns of a committed checkpoint of rows (a reshard) through the node leaders."""

    name = "hierarchical_load"

    def prepare_place(self, place: Path, world: int) -> None:
        save_single(place / "ckpt", 1, world)

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        groups = hierarchical_groups(run)
        template = states.column_template(run.rank, run.world)
        with run.armed():
            loaded = reshard.load(template, run.place / "ckpt", group=groups, timeout=run.timeout)
        generation = states.column_generation(loaded, run.rank, run.world, (1, 2, 3))
        return {"generation": -1 if generation is None else generation}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        finding = guarantees.returned_generation(answers, (1,), what="load")
        generation, lost = guarantees.loads_as(place / "ckpt", world, (1,), what="the checkpoint after the load")
        return generation, finding or lost
