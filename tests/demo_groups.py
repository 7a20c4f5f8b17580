"""The demo model's process groups in the ranks of a pool, created once per layout and rank process.

Creating a layout's groups (:meth:`ParallelGroups.create`) is collective over the pool's default group, and
every gloo group keeps two threads alive for the life of the process; a pool that created the groups anew
for every test case held hundreds of them, whose event loops slowed the rest of the suite. The test modules
call their rank functions with the same layouts on every rank of a pool, in the same order, so a cache per
process stays the same on every rank.
"""

from __future__ import annotations

from reshard.models.parallel import ParallelConfig, ParallelGroups

_GROUPS: dict[str, ParallelGroups | None] = {}


def layout_groups(layout: str) -> ParallelGroups | None:
    """The groups of ``layout`` (``"tp=2,pp=2"``) over the first ranks of the pool; None on the other ranks."""
    if layout not in _GROUPS:
        parallel = ParallelConfig.parse(layout)
        _GROUPS[layout] = ParallelGroups.create(parallel, layout_ranks=list(range(parallel.world_size)))
    return _GROUPS[layout]
