"""The tiered manager's flow: a node-local save, its drain to the durable root in the background, and a restore,
with a death anywhere in them (:class:`reshard.TieredCheckpointManager`). The guarantee: nothing finalized is lost
(the durable root's complete steps load as their own generations, step 1 always), a step is finalized once any
rank's ``wait()`` returned, and a restore returns the newest generation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from tests.contract import guarantees, states
from tests.contract.flows import Flow, RankRun, check_root, register
from tests.contract.guarantees import Answers, Finding


def preload() -> None:
    """Nothing beyond reshard itself."""


def tiers(place: Path) -> list[Any]:
    """One rank per node (``local/node<rank>``): node-local disk and the durable root keep every step."""
    import reshard

    return [
        reshard.LocalDisk(str(place / "local" / "node{node}"), every=1, node_size=1),
        reshard.Durable(place / "root", every=1),
    ]


@register
class TieredStep(Flow):
    """On a durable root whose step 1 holds A (finalized), ``TieredCheckpointManager.save(2, B)`` (the node-local
    save, then its drain started in the background), ``wait()`` (the drain's end) and ``restore`` of the whole
    state, every rank; all armed."""

    name = "tiered"
    places = ("root", "local")
    foreign: ClassVar[dict[str, tuple[str, ...]]] = {"root": ("notes.txt",)}
    worlds = (2, 3)

    def prepare_place(self, place: Path, world: int) -> None:
        import reshard

        manager = reshard.CheckpointManager(place / "root")
        manager.save(1, states.single_process_state(1, world))
        manager.close()

    def run(self, run: RankRun) -> dict[str, Any] | None:
        import reshard

        manager = reshard.TieredCheckpointManager(tiers(run.place), timeout=run.timeout)
        state = states.rank_state(run.rank, run.world, 2)
        try:
            with run.armed():
                manager.save(2, state)
                manager.wait()
                found = manager.restore(states.full_template(run.world))
        finally:
            manager.durable.close()
        assert found is not None
        generation = states.generation_of(found[2], run.world, (1, 2, 3))
        return {"generation": -1 if generation is None else generation, "tier": found[1]}

    def check(self, place: Path, world: int, answers: Answers, killed: bool) -> tuple[int | None, Finding | None]:
        # Finalized means a wait() returned: an answer "ok" (save, wait and restore done). An UnconfirmedCommitError
        # may be the node-local save's (committed on the nodes, not finalized), so it promises nothing durable.
        waited = any(guarantees.outcome_of(a) == "ok" for a in answers.values())
        newest, finding = check_root(place / "root", world, 2 if waited else None)
        if finding is None:
            _, finding = guarantees.loads_as(place / "root" / "step_000000001", world, (1,), what="finalized step 1")
        return newest, finding or guarantees.returned_generation(answers, (2,), what="restore")

    def follow_up(self, place: Path, world: int) -> Finding | None:
        """A new job (this process) saves step 3 through the same tiers and it is finalized."""
        import reshard

        manager = reshard.TieredCheckpointManager(tiers(place))
        try:
            manager.save(3, states.single_process_state(3, world))
            manager.wait()
        except reshard.CheckpointError as exc:
            return Finding("other", f"a later tiered save failed: {type(exc).__name__}: {exc}")
        finally:
            manager.close()
        return check_root(place / "root", world, 3)[1]
