"""The storage contract (:class:`reshard.testing.storage.StorageContract`), run against every backend of
reshard: a local directory, S3 (moto's server) and GCS (fake-gcs-server).

The contract itself is public (``reshard.testing.storage``), so that the author of another backend runs the same
tests by subclassing it; here each of reshard's own backends is one subclass. A new backend of reshard passes
this module by adding its class here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reshard.errors import StorageError
from reshard.storage import LocalStorage, ObjectStorage, Storage, TransferOptions
from reshard.testing.storage import PART_BYTES, StorageContract
from tests.objectstores import GcsServer, S3Server


def _object_storage(server: S3Server | GcsServer) -> ObjectStorage:
    url = f"{server.protocol}://{server.new_bucket()}/root"
    return ObjectStorage(url, server.options(), transfer=TransferOptions(max_concurrency=4, part_bytes=PART_BYTES))


@pytest.mark.unit
class TestLocalStorage(StorageContract):
    def make_storage(self, tmp_path: Path) -> Storage:
        return LocalStorage(tmp_path / "root")


@pytest.mark.dist
class TestS3Storage(StorageContract):
    @pytest.fixture
    def storage(self, s3_server: S3Server) -> Iterator[Storage]:
        made = _object_storage(s3_server)
        try:
            yield made
        finally:
            made.close()


@pytest.mark.dist
class TestGcsStorage(StorageContract):
    @pytest.fixture
    def storage(self, gcs_server: GcsServer) -> Iterator[Storage]:
        made = _object_storage(gcs_server)
        try:
            yield made
        finally:
            made.close()


@pytest.mark.unit
def test_a_store_without_conditional_creates_refuses_create_only_commits() -> None:
    """fsspec's in-memory filesystem creates by check-then-write: reshard must not pretend otherwise."""
    storage = ObjectStorage("memory://contract/ckpt")
    assert not storage.supports_conditional_create
    with pytest.raises(StorageError, match="conditionally"):
        storage.commit("metadata.json", b"{}", replace=False)
    storage.commit("metadata.json", b"{}", replace=True)  # a replacing put is what it can do
    assert storage.read_bytes("metadata.json") == b"{}"


@pytest.mark.unit
def test_a_subclass_without_a_backend_says_what_to_implement(tmp_path: Path) -> None:
    """The base class is not a backend: a subclass that provides neither make_storage nor a storage fixture
    fails with a message naming both, instead of an AttributeError deep in a test."""

    class TestNothing(StorageContract):
        pass

    with pytest.raises(NotImplementedError, match="make_storage"):
        TestNothing().make_storage(tmp_path)
