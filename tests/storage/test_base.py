"""What :class:`reshard.storage.Storage` derives from a backend's primitives (root_exists, list_children,
delete_prefix): on local files, with the base's derivations in place of LocalStorage's directory-aware ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from reshard.storage import LocalStorage, ObjectStorage, Storage

pytestmark = pytest.mark.unit


class DerivedLocal(LocalStorage):
    root_exists = Storage.root_exists
    list_children = Storage.list_children
    delete_prefix = Storage.delete_prefix


def test_the_derived_methods_follow_the_files(tmp_path: Path) -> None:
    storage = DerivedLocal(tmp_path / "step_000000001")
    assert not storage.root_exists() and storage.list_children() == []
    storage.commit("data/a.bin", b"12", replace=True)
    storage.commit("data/b.bin", b"34", replace=True)
    storage.commit("metadata.json", b"{}", replace=True)
    assert storage.root_exists()
    assert storage.list_children() == ["data", "metadata.json"]
    storage.delete_prefix("data")
    assert storage.list_files() == ["metadata.json"]
    storage.delete_prefix("missing")  # a missing prefix is fine
    assert storage.list_children() == ["metadata.json"]


def test_the_object_store_implements_only_primitives() -> None:
    derived = {"root_exists", "list_children", "delete_prefix"}
    assert derived.isdisjoint(vars(ObjectStorage))
