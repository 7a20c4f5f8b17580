"""Referenced data files resolve in one place (:mod:`reshard.io.referencing`); backends take no ``../`` name."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from reshard.io.referencing import ReferencingStorage, referencing, resolve_location, split_location
from reshard.storage import LocalStorage, ReadRequest

pytestmark = pytest.mark.unit


def _two_checkpoints(tmp_path: Path) -> tuple[LocalStorage, LocalStorage]:
    base, new = LocalStorage(tmp_path / "step_1"), LocalStorage(tmp_path / "step_2")
    base.commit("data/held.bin", b"0123456789", replace=False)
    new.commit("data/own.bin", b"abcdef", replace=False)
    return base, new


def test_split_location() -> None:
    assert split_location("data/x.bin") == (None, "data/x.bin")
    assert split_location("../step_1/data/x.bin") == ("step_1", "data/x.bin")


def test_a_sibling_location_resolves_to_the_siblings_storage(tmp_path: Path) -> None:
    _, new = _two_checkpoints(tmp_path)
    assert resolve_location(new, "data/own.bin") == (new, "data/own.bin")
    holder, name = resolve_location(new, "../step_1/data/held.bin")
    assert name == "data/held.bin" and holder.describe() == str(tmp_path / "step_1")
    assert holder.size(name) == 10


def test_no_reference_resolves_through_a_link(tmp_path: Path) -> None:
    _, new = _two_checkpoints(tmp_path)
    (tmp_path / "linked").symlink_to(tmp_path / "step_1")
    with pytest.raises(OSError) as caught:
        resolve_location(new, "../linked/data/held.bin")
    assert caught.value.errno == errno.ELOOP


def test_a_backend_refuses_a_name_outside_its_root(tmp_path: Path) -> None:
    _, new = _two_checkpoints(tmp_path)
    with pytest.raises(OSError) as caught:
        new.size("../step_1/data/held.bin")
    assert caught.value.errno == errno.EINVAL


def test_reads_by_location_in_one_batch_counted_on_the_checkpoint(tmp_path: Path) -> None:
    _, new = _two_checkpoints(tmp_path)
    located = referencing(new)
    assert isinstance(located, ReferencingStorage) and referencing(located) is located
    own, held = bytearray(3), bytearray(4)
    got = located.read_ranges(
        [ReadRequest("data/own.bin", 1, memoryview(own)), ReadRequest("../step_1/data/held.bin", 2, memoryview(held))]
    )
    assert got == [3, 4] and bytes(own) == b"bcd" and bytes(held) == b"2345"
    assert new.range_bytes_read == 7 == located.range_bytes_read
    assert located.describe("../step_1/data/held.bin") == str(tmp_path / "step_1" / "data" / "held.bin")
    assert located.exists("../step_1/data/held.bin") and not located.exists("../step_1/data/gone.bin")
    mapped = located.map_range("../step_1/data/held.bin", 0, 10)
    assert mapped is not None and bytes(mapped.tensor.numpy()) == b"0123456789"
    mapped.close()
    assert new.range_bytes_read == 17
    located.close()
    assert located.siblings == {}
