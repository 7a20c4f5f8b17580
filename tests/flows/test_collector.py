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


class Collections:
    """The generations of the collections that start while ``inside`` is set (gc.callbacks)."""

    def __init__(self) -> None:
        self.inside = False
        self.started: list[int] = []
        self.after: list[int] = []

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            (self.started if self.inside else self.after).append(info["generation"])


def _make_generation_2_due(keep: list[object]) -> None:
    """Allocate objects that stay alive (as building a state dict does) until the collector's counters say that
    the next automatic collection is a full one: generation 2's count above its threshold. The process's own
    objects are frozen by the caller, so the surviving objects are what makes it worth running."""
    threshold = gc.get_threshold()[2]
    while gc.get_count()[2] <= threshold:
        keep.append([[], {}])


@pytest.mark.parametrize("operation", ["save", "load"])
def test_a_generation_2_collection_the_callers_objects_made_due_runs_outside_the_call(
    tmp_path: Path, operation: str
) -> None:
    """The first checkpoint after a restart: the caller built its state dict right before the call, and its
    objects made a full collection due (walking every object of the process: about 0.1 s per rank after
    importing torch). It used to run inside the call (the collector, enabled again at the end of the call,
    collected at the first allocation after it, while the call still returned); now it runs in the caller's
    code after the call, where it would have run without reshard. Counted with gc.callbacks, not timed."""
    assert gc.isenabled()
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    reshard.save(_state(), tmp_path / "ckpt")
    seen = Collections()
    keep: list[object] = []
    gc.collect()
    gc.freeze()  # the process's objects out of the count, so that the objects made here make a full one due
    gc.callbacks.append(seen)
    try:
        gc.collect()
        # The setup is right: with the counters so, the next automatic collection is a full one.
        _make_generation_2_due(keep)
        while not seen.after:
            keep.append([[], {}])
        assert seen.after[0] == 2
        seen.after.clear()
        _make_generation_2_due(keep)
        seen.inside = True
        if operation == "save":
            reshard.save(_state(), tmp_path / "again")
        else:
            reshard.load(target, tmp_path / "ckpt")
        seen.inside = False
        assert 2 not in seen.started, seen.started
        assert gc.get_count()[2] > gc.get_threshold()[2]  # still due: the caller's next collection is the full one
        while not seen.after:
            keep.append([[], {}])
        assert seen.after[0] == 2
    finally:
        seen.inside = False
        gc.callbacks.remove(seen)
        gc.unfreeze()
        keep.clear()
    assert gc.isenabled()
    if operation == "load":
        assert all(torch.equal(target[k], v) for k, v in _state().items())
