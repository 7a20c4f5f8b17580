"""A synchronous save or load pauses Python's cyclic garbage collector on the main thread, and leaves it as it
found it; a save in a background thread (the asynchronous checkpointer) never touches it (reshard.flows.collector)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest
import torch

import reshard
from reshard.storage import FileWriter, LocalStorage, ReadRequest

pytestmark = pytest.mark.unit


class WatchedStorage(LocalStorage):
    """A real checkpoint directory that notes whether the collector was enabled when data moved."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.seen: list[bool] = []

    def open_writer(self, name: str, *, max_buffered_bytes: int | None = None) -> FileWriter:
        self.seen.append(gc.isenabled())
        return super().open_writer(name, max_buffered_bytes=max_buffered_bytes)

    def read_ranges(self, requests: list[ReadRequest], *, max_buffered_bytes: int | None = None) -> list[int]:
        self.seen.append(gc.isenabled())
        return super().read_ranges(requests, max_buffered_bytes=max_buffered_bytes)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "b": torch.ones(64)}


def test_save_and_load_pause_the_collector_and_restore_it(tmp_path: Path) -> None:
    storage = WatchedStorage(tmp_path / "ckpt")
    assert gc.isenabled()
    reshard.save(_state(), storage)
    assert storage.seen and not any(storage.seen)
    assert gc.isenabled()
    storage.seen.clear()
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    reshard.load(target, storage)
    assert storage.seen and not any(storage.seen)
    assert gc.isenabled()
    assert all(torch.equal(target[k], v) for k, v in _state().items())


def test_a_collector_the_application_disabled_stays_disabled(tmp_path: Path) -> None:
    gc.disable()
    try:
        reshard.save(_state(), tmp_path / "ckpt")
        reshard.load({k: torch.zeros_like(v) for k, v in _state().items()}, tmp_path / "ckpt")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_failed_save_restores_the_collector(tmp_path: Path) -> None:
    reshard.save(_state(), tmp_path / "ckpt")
    with pytest.raises(reshard.CheckpointExistsError):
        reshard.save(_state(), tmp_path / "ckpt")  # exists, no overwrite
    assert gc.isenabled()


def test_a_save_in_a_background_thread_leaves_the_collector_alone(tmp_path: Path) -> None:
    storage = WatchedStorage(tmp_path / "ckpt")
    handle = reshard.AsyncCheckpointer().save(_state(), storage)
    handle.wait(timeout=60)
    assert storage.seen and all(storage.seen)  # the training thread's garbage is still collected meanwhile
    errors: list[BaseException] = []

    def load_in_thread() -> None:
        try:
            reshard.load({k: torch.zeros_like(v) for k, v in _state().items()}, storage)
        except BaseException as exc:
            errors.append(exc)

    storage.seen.clear()
    thread = threading.Thread(target=load_in_thread)
    thread.start()
    thread.join(timeout=60)
    assert not errors and storage.seen and all(storage.seen)
