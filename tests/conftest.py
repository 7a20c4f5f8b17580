"""Shared fixtures: pools of spawned ranks, started once per session and restarted if a test breaks one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.rankpool import RankPool


class PoolRegistry:
    """The session's rank pools by world size; a broken pool is replaced on the next request."""

    def __init__(self) -> None:
        self.pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self.pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            pool = RankPool(world_size)
            self.pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()


@pytest.fixture(scope="session")
def pools() -> Iterator[PoolRegistry]:
    registry = PoolRegistry()
    yield registry
    registry.close()


@pytest.fixture
def pool4(pools: PoolRegistry) -> RankPool:
    """Four ranks in one gloo group, with subgroups ``first1``, ``first2``, ``lower_half``, ``upper_half``."""
    return pools.get(4)


def pytest_configure(config: pytest.Config) -> None:
    """Keep hypothesis' own cache out of the working directory (tests never write into the CWD)."""
    import os
    import tempfile

    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "reshard-hypothesis"))


@pytest.fixture
def pool8(pools: PoolRegistry) -> RankPool:
    """Eight ranks in one gloo group, with subgroups ``first1``, ``first2``, ``first4``, ``lower_half``,
    ``upper_half``."""
    return pools.get(8)
