"""Shared fixtures: pools of spawned ranks, started once per session and restarted if a test breaks one."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.objectstores import FaultProxy, GcsServer, S3Server
from tests.rankpool import RankPool
from tests.tiers import UnitGuard, tier_errors, tiers_of, unit_guard

# gcsfs (2026.10.1 here) picks its GCSFileSystem class when it is *imported*: unless this variable is "false",
# ``gcsfs.GCSFileSystem`` is the experimental ExtendedGcsFileSystem, which asks Google's Storage Control
# gRPC API (over TLS, to the endpoint's host) whether each bucket is zonal/HNS before it reads or writes.
# Against an emulator that lookup fails its TLS handshake and retries for its full 60 s deadline before
# falling back, so every first access to a bucket stalls a minute. Must be set before anything imports
# gcsfs; tests/objectstores.py refuses to start the GCS server if gcsfs was imported with it on.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


class PoolRegistry:
    """The session's rank pools by world size; a broken pool is replaced on the next request."""

    def __init__(self) -> None:
        self.pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        pool = self.pools.get(world_size)
        if pool is None or pool.broken:
            if pool is not None:
                pool.close()
            # Forked by the session's forkserver (tests/rankpool.py, private_pool), which has imported torch and
            # reshard once: 8 ranks start in under a second where spawning them took about 16 s.
            pool = RankPool(world_size, start_method="forkserver")
            self.pools[world_size] = pool
        return pool

    def close(self) -> None:
        for pool in self.pools.values():  # every pool's ranks exit at once, then each is waited for
            pool.request_close()
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
    # One intra-op thread in the test process, as in every rank (tests/rankpool.py): the tests' tensors are small,
    # and a second OpenMP thread spinning after each op costs the unit tier about a seventh of its CPU time on
    # two cores (and takes a core from the ranks of the dist tier).
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test has exactly one tier (unit, dist or slow; tests/tiers.py): a test without one, or with two, stops
    the run before anything runs, so a new test file cannot forget its ``pytestmark``."""
    errors = tier_errors(items)
    if errors:
        raise pytest.UsageError("tests without exactly one tier:\n" + "\n".join(errors))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``-m unit`` (``make test-fast``), a test file that never names the unit mark holds no unit test, so it
    is not even imported: importing megatron-core, transformers or the object store clients would cost the fast
    tier seconds before its first test."""
    if config.option.markexpr != "unit" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.suffix != ".py":
        return None
    return True if "pytest.mark.unit" not in collection_path.read_text(encoding="utf-8") else None


UNIT_GUARD = pytest.StashKey[UnitGuard]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """A ``unit`` test that starts a process or a server fails (tests/tiers.py, :func:`unit_guard`); the guard
    covers its setup (fixtures) and teardown too."""
    if tiers_of(item) != ["unit"]:
        return (yield)
    guard = item.stash[UNIT_GUARD] = UnitGuard(item.nodeid)
    with unit_guard(guard):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """A start refused in another thread than the test's (a server thread) fails the test's report all the same."""
    report: pytest.TestReport = yield
    guard = item.stash.get(UNIT_GUARD, None)
    if guard is not None and guard.violations:
        if report.passed:
            report.outcome = "failed"
            report.longrepr = "\n".join(guard.violations)
        # once: a violation already failed this phase (in the test's own thread) or now fails it; the next
        # phase (the teardown of a failed test) is not failed again for it
        guard.violations.clear()
    return report


@pytest.fixture
def pool8(pools: PoolRegistry) -> RankPool:
    """Eight ranks in one gloo group, with subgroups ``first1``, ``first2``, ``first4``, ``lower_half``,
    ``upper_half``."""
    return pools.get(8)


# --- Object stores: real S3 and GCS protocol servers on 127.0.0.1 (see tests/objectstores.py) -----------


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server: ``endpoint_url``, ``storage_options`` (for ``s3fs.S3FileSystem(**...)``),
    ``options(endpoint_url)``, ``new_bucket()``, ``filesystem(endpoint_url, retries=)``, ``boto3_client()``,
    ``object_path(bucket, key)``, ``proxy(**kw)``."""
    from tests.objectstores import start_s3_server

    server = start_s3_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsServer]:
    """fake-gcs-server (in memory, HTTP): ``endpoint_url``, ``storage_options`` (for
    ``gcsfs.GCSFileSystem(**...)``), ``options(endpoint_url)``, ``new_bucket()``, ``filesystem(endpoint_url)``,
    ``object_path(bucket, key)``, ``proxy(**kw)``. The binary is stopped at session end."""
    from tests.objectstores import start_gcs_server

    server = start_gcs_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["s3", "gcs"])
def object_store(request: pytest.FixtureRequest) -> S3Server | GcsServer:
    """Each of the two servers in turn (same interface; ``protocol`` is ``"s3"`` or ``"gs"``)."""
    server: S3Server | GcsServer = request.getfixturevalue(f"{request.param}_server")
    return server


@pytest.fixture
def fault_proxy() -> Iterator[Callable[..., FaultProxy]]:
    """A factory: ``fault_proxy(server_or_url, **kw)`` starts a :class:`FaultProxy` in front of a server (S3-style
    errors for the S3 server) and stops it when the test ends."""
    started: list[FaultProxy] = []

    def make(upstream: S3Server | GcsServer | str, **kwargs: Any) -> FaultProxy:
        proxy = FaultProxy(upstream, **kwargs) if isinstance(upstream, str) else upstream.proxy(**kwargs)
        started.append(proxy.start())
        return proxy

    try:
        yield make
    finally:
        for proxy in started:
            proxy.stop()
