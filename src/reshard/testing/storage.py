"""The storage contract as a test suite a backend author runs: subclass :class:`StorageContract`.

What reshard relies on from a :class:`~reshard.storage.Storage` backend, checked the same way on every backend:
files written through a writer read back whole and by range; a short read happens only at the end of a file; a
file of several parts reads back and leaves no part behind; create-only commits are atomic (of racing creators
exactly one wins) and replacing ones replace; small reads are bounded; listings, names at the root, children,
deletion and aborts behave as documented; the capabilities the guarantees depend on are declared.

Like zarr's ``StoreTests``, this is a base class for pytest (it needs ``pytest``, which reshard itself does not
import): subclass it in a test module as ``TestMyStorage`` and either implement :meth:`make_storage` (a fresh,
empty storage under pytest's ``tmp_path``) or override the ``storage`` fixture (for a backend that needs other
fixtures, such as a server)::

    class TestMyStorage(StorageContract):
        def make_storage(self, tmp_path: Path) -> Storage:
            return MyStorage(tmp_path / "root")

reshard's own backends run through it in ``tests/storage/test_storage_contract.py`` (a local directory, and S3
and GCS against real protocol servers).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from reshard.storage import FileTooLargeError, ReadRequest, Storage

__all__ = ["StorageContract"]

PART_BYTES = 5 * 1024 * 1024
"""The part size an object store backend is expected to be configured with for :meth:`StorageContract
.test_a_file_of_several_parts_reads_back` to write more than two parts (S3's smallest multipart part)."""


def write_file(storage: Storage, name: str, data: bytes, pieces: int = 3) -> None:
    """Write ``data`` to ``name`` through a writer, in ``pieces`` writes, and commit it."""
    writer = storage.open_writer(name)
    step = max(1, len(data) // pieces)
    for start in range(0, len(data), step):
        writer.write(memoryview(data[start : start + step]))
    assert writer.tell() == len(data)
    writer.commit()


class StorageContract:
    """The storage contract; a subclass named ``Test...`` provides the backend and pytest runs the tests.

    Each test gets a fresh storage from the ``storage`` fixture: by default :meth:`make_storage` under
    ``tmp_path``, closed when the test ends. Every test writes and reads through the backend itself (nothing is
    mocked), so a pass says the backend keeps the contract, not that a double of it does.
    """

    racing_creators = 6
    """How many threads race to create one name in :meth:`test_racing_create_only_commits_have_exactly_one_winner`."""

    def make_storage(self, tmp_path: Path) -> Storage:
        """A fresh storage whose root does not exist yet (or is empty); implement it, or override ``storage``."""
        raise NotImplementedError(f"{type(self).__name__} implements make_storage(tmp_path) or a storage fixture")

    @pytest.fixture
    def storage(self, tmp_path: Path) -> Iterator[Storage]:
        """The storage under test: :meth:`make_storage`, closed after the test."""
        made = self.make_storage(tmp_path)
        try:
            yield made
        finally:
            made.close()

    def test_written_files_read_back_whole_and_by_range(self, storage: Storage) -> None:
        storage.prepare_root()
        data = bytes(range(256)) * 40
        write_file(storage, "data/a.bin", data)
        assert storage.exists("data/a.bin")
        assert not storage.exists("data/b.bin")
        assert storage.size("data/a.bin") == len(data)
        assert storage.read_bytes("data/a.bin") == data
        buffers = [bytearray(10), bytearray(100), bytearray(1)]
        starts = (0, 5000, len(data) - 1)
        requests = [ReadRequest("data/a.bin", at, memoryview(b)) for at, b in zip(starts, buffers, strict=True)]
        assert storage.read_ranges(requests) == [10, 100, 1]
        assert bytes(buffers[0]) == data[:10]
        assert bytes(buffers[1]) == data[5000:5100]
        assert bytes(buffers[2]) == data[-1:]
        tail = bytearray(50)  # a range past the end is short, and only at the end
        assert storage.read_ranges([ReadRequest("data/a.bin", len(data) - 20, memoryview(tail))]) == [20]
        assert bytes(tail[:20]) == data[-20:]
        assert storage.modified_time("data/a.bin") > 0

    def test_a_file_of_several_parts_reads_back(self, storage: Storage) -> None:
        size = 2 * PART_BYTES + 2 * 1024 * 1024 + 333  # over two parts
        period = bytes((i * 7) % 251 for i in range(251))  # byte i is (i * 7) % 251: no part repeats another's
        data = (period * (size // 251 + 1))[:size]
        write_file(storage, "data/big.bin", data, pieces=7)
        assert storage.size("data/big.bin") == len(data)
        buffer = bytearray(1000)
        at = 2 * PART_BYTES
        storage.read_ranges([ReadRequest("data/big.bin", at, memoryview(buffer))])
        assert bytes(buffer) == data[at : at + 1000]
        assert storage.list_files("data") == ["data/big.bin"]  # no part left behind

    def test_create_only_commits_are_exclusive_and_replacing_ones_replace(self, storage: Storage) -> None:
        assert storage.supports_conditional_create
        storage.commit("metadata.json", b"first", replace=False)
        with pytest.raises(FileExistsError):
            storage.commit("metadata.json", b"second", replace=False)
        assert storage.read_bytes("metadata.json") == b"first"
        storage.commit("metadata.json", b"third", replace=True)
        assert storage.read_bytes("metadata.json") == b"third"

    def test_racing_create_only_commits_have_exactly_one_winner(self, storage: Storage) -> None:
        count = self.racing_creators
        start = threading.Barrier(count)
        outcomes: list[tuple[int, bool]] = []  # list.append is atomic: each thread appends its own outcome once

        def create(i: int) -> None:
            start.wait()
            try:
                storage.commit(".lock.000000000001", f"writer {i}".encode(), replace=False)
                outcomes.append((i, True))
            except FileExistsError:
                outcomes.append((i, False))

        threads = [threading.Thread(target=create, args=(i,)) for i in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        won = [i for i, ok in outcomes if ok]
        assert len(outcomes) == count, outcomes  # no creator hung
        assert len(won) == 1, outcomes
        assert storage.read_bytes(".lock.000000000001") == f"writer {won[0]}".encode()

    def test_small_reads_are_bounded(self, storage: Storage) -> None:
        storage.commit("latest.json", b"x" * 1000, replace=True)
        assert storage.read_bytes("latest.json", max_bytes=1000) == b"x" * 1000
        with pytest.raises(FileTooLargeError):
            storage.read_bytes("latest.json", max_bytes=999)

    def test_listings_names_children_and_deletion(self, storage: Storage) -> None:
        storage.prepare_root()
        write_file(storage, "data/x-r00000.bin", b"x")
        write_file(storage, "data/sub/y.bin", b"y")
        storage.commit(".lock", b"{}", replace=False)
        storage.commit(".lock.000000000002", b"{}", replace=False)
        storage.commit("metadata.json", b"{}", replace=False)
        assert storage.list_files("data") == ["data/sub/y.bin", "data/x-r00000.bin"]
        assert storage.list_names(".lock") == [".lock", ".lock.000000000002"]
        assert set(storage.list_children()) >= {"data", "metadata.json", ".lock"}
        assert storage.root_exists()
        storage.delete("data/x-r00000.bin")
        storage.delete("data/never-was.bin")  # a missing name is not an error
        assert storage.list_files("data") == ["data/sub/y.bin"]
        child = storage.child("data")
        try:
            assert child.read_bytes("sub/y.bin") == b"y"
        finally:
            child.close()
        storage.delete_prefix("data")
        assert storage.list_files("data") == []
        with pytest.raises(FileNotFoundError):
            storage.read_bytes("data/sub/y.bin")

    def test_an_aborted_writer_leaves_nothing(self, storage: Storage) -> None:
        writer = storage.open_writer("data/partial.bin")
        writer.write(memoryview(b"z" * (PART_BYTES + 1024 * 1024)))  # at least one part in flight on object stores
        writer.abort()
        assert storage.list_files("data") == []
        assert not storage.exists("data/partial.bin")
