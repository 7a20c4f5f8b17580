"""The storage contract (``reshard.storage.Storage``), run against every backend: a local directory, S3
(moto's server) and GCS (fake-gcs-server).

What reshard relies on from a backend, each checked the same way on all three: files written through a
writer read back whole and by range; a short read happens only at the end of a file; create-only commits
are atomic (of racing creators exactly one wins) and replacing ones replace; small reads are bounded;
listings, names at the root, children, deletion and aborts behave as documented; capabilities are declared.
A new backend passes this module by adding itself to ``BACKENDS``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reshard.errors import StorageError
from reshard.storage import FileTooLargeError, LocalStorage, ObjectStorage, ReadRequest, Storage, TransferOptions

BACKENDS = ["local", "s3", "gcs"]


@pytest.fixture(params=BACKENDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "local":
        yield LocalStorage(tmp_path / "root")
        return
    server: Any = request.getfixturevalue(f"{request.param}_server")
    url = f"{server.protocol}://{server.new_bucket()}/root"
    made = ObjectStorage(url, server.options(), transfer=TransferOptions(max_concurrency=4, part_bytes=5 * 1024 * 1024))
    try:
        yield made
    finally:
        made.close()


def _write(storage: Storage, name: str, data: bytes, pieces: int = 3) -> None:
    writer = storage.open_writer(name)
    step = max(1, len(data) // pieces)
    for start in range(0, len(data), step):
        writer.write(memoryview(data[start : start + step]))
    assert writer.tell() == len(data)
    writer.commit()


def test_written_files_read_back_whole_and_by_range(storage: Storage) -> None:
    storage.prepare_root()
    data = bytes(range(256)) * 40
    _write(storage, "data/a.bin", data)
    assert storage.exists("data/a.bin") and not storage.exists("data/b.bin")
    assert storage.size("data/a.bin") == len(data)
    assert storage.read_bytes("data/a.bin") == data
    buffers = [bytearray(10), bytearray(100), bytearray(1)]
    requests = [
        ReadRequest("data/a.bin", at, memoryview(b)) for at, b in zip((0, 5000, len(data) - 1), buffers, strict=True)
    ]
    assert storage.read_ranges(requests) == [10, 100, 1]
    assert bytes(buffers[0]) == data[:10] and bytes(buffers[1]) == data[5000:5100] and bytes(buffers[2]) == data[-1:]
    tail = bytearray(50)
    assert storage.read_ranges([ReadRequest("data/a.bin", len(data) - 20, memoryview(tail))]) == [20]  # at the end
    assert bytes(tail[:20]) == data[-20:]
    assert storage.modified_time("data/a.bin") > 0


def test_a_file_of_several_parts_reads_back(storage: Storage) -> None:
    data = bytes((i * 7) % 251 for i in range(12 * 1024 * 1024 + 333))  # more than two 5 MiB parts
    _write(storage, "data/big.bin", data, pieces=7)
    assert storage.size("data/big.bin") == len(data)
    buffer = bytearray(1000)
    storage.read_ranges([ReadRequest("data/big.bin", 10 * 1024 * 1024, memoryview(buffer))])
    assert bytes(buffer) == data[10 * 1024 * 1024 : 10 * 1024 * 1024 + 1000]
    assert storage.list_files("data") == ["data/big.bin"]  # no part left behind


def test_create_only_commits_are_exclusive_and_replacing_ones_replace(storage: Storage) -> None:
    assert storage.supports_conditional_create
    storage.commit("metadata.json", b"first", replace=False)
    with pytest.raises(FileExistsError):
        storage.commit("metadata.json", b"second", replace=False)
    assert storage.read_bytes("metadata.json") == b"first"
    storage.commit("metadata.json", b"third", replace=True)
    assert storage.read_bytes("metadata.json") == b"third"


def test_racing_create_only_commits_have_exactly_one_winner(storage: Storage) -> None:
    start = threading.Barrier(6)
    won: list[int] = []
    lost: list[int] = []

    def create(i: int) -> None:
        start.wait()
        try:
            storage.commit(".lock.000000000001", f"writer {i}".encode(), replace=False)
            won.append(i)
        except FileExistsError:
            lost.append(i)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and len(lost) == 5, (won, lost)
    assert storage.read_bytes(".lock.000000000001") == f"writer {won[0]}".encode()


def test_small_reads_are_bounded(storage: Storage) -> None:
    storage.commit("latest.json", b"x" * 1000, replace=True)
    assert storage.read_bytes("latest.json", max_bytes=1000) == b"x" * 1000
    with pytest.raises(FileTooLargeError):
        storage.read_bytes("latest.json", max_bytes=999)


def test_listings_names_children_and_deletion(storage: Storage) -> None:
    storage.prepare_root()
    _write(storage, "data/x-r00000.bin", b"x")
    _write(storage, "data/sub/y.bin", b"y")
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


def test_an_aborted_writer_leaves_nothing(storage: Storage) -> None:
    writer = storage.open_writer("data/partial.bin")
    writer.write(memoryview(b"z" * (6 * 1024 * 1024)))  # at least one part in flight on object stores
    writer.abort()
    assert storage.list_files("data") == []
    assert not storage.exists("data/partial.bin")


def test_a_store_without_conditional_creates_refuses_create_only_commits() -> None:
    """fsspec's in-memory filesystem creates by check-then-write: reshard must not pretend otherwise."""
    storage = ObjectStorage("memory://contract/ckpt")
    assert not storage.supports_conditional_create
    with pytest.raises(StorageError, match="conditionally"):
        storage.commit("metadata.json", b"{}", replace=False)
    storage.commit("metadata.json", b"{}", replace=True)  # a replacing put is what it can do
    assert storage.read_bytes("metadata.json") == b"{}"
