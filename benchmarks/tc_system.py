"""torch_checkpointing (``tc``) as a system of benchmarks/compare.py: its ``CheckpointManager`` with a synchronous
saver for saves and loads, and with its asynchronous saver (a staging thread and a writer subprocess) for the async
rows, on the same DTensor state DCP gets.

Two things differ from its defaults on this CPU-only machine, each the smallest change that lets it run, and both
said in the report's notes:

- Its metadata manager (wired in by ``ItemSpec(resharder=DefaultResharder())``, needed for any load into another
  layout) all-gathers the ranks' sharding metadata through tensors it puts on ``device="cuda"``, which a CPU build
  cannot do. :class:`CpuMetadataManager` gathers the same pickled metadata with ``all_gather_object`` on the CPU
  (gloo) group; everything else is torch_checkpointing's own.
- Its file writes try ``O_DIRECT`` and fail on this file system at the close of a file whose length is not a
  multiple of the block size (EINVAL), so the storage runs with ``use_direct_io=False``. Its writer then never
  fsyncs (it relies on O_DIRECT); so that its save is as durable as the others' (DCP fsyncs its files), its own
  ``pre_finalize_callback`` hook fsyncs each rank's files (rank 0: also the metadata and the directory) before
  the commit rename.
- Its synchronous saver writes the distributed metadata (which a load into another layout needs) only in the first
  checkpoint a manager saves: the metadata manager caches what it computed and then returns nothing to write
  (``DefaultMetadataManager.compute_metadata`` returns None "if cache is valid", and ``SyncCheckpointSaver`` writes
  the checkpoint without metadata; its async writer process does write the cached bytes every time). Every later
  checkpoint of the same manager then loads "without resharding" into another layout and fails with a shape
  mismatch (compare.py's warm mode, repetition 2). The synchronous manager therefore runs with the cache off
  (``_should_cache_metadata = False``), so that every checkpoint it saves is complete, as every other system's is.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any


def tc_available() -> tuple[bool, str]:
    """Whether torch_checkpointing can be used, and its version or why not."""
    try:
        import torch_checkpointing
        from torch_checkpointing.metadata_manager import DefaultMetadataManager

        if not hasattr(DefaultMetadataManager, "_all_gather_pickled_data"):
            return False, f"torch-checkpointing {torch_checkpointing.__version__} lacks the metadata gather it replaces"
        return True, f"torch-checkpointing {torch_checkpointing.__version__}"
    except Exception as exc:
        return False, f"torch-checkpointing is not importable ({type(exc).__name__}: {exc})"


def fsync_rank_files(rank: int, args: Any) -> None:
    """torch_checkpointing's ``pre_finalize_callback``: fsync the files this rank wrote into the temporary
    directory ``args.path`` (``<item>_<rank>.pt``); rank 0 also the metadata and the directory."""
    directory = Path(args.path)
    mine = re.compile(rf".*_{rank}\.pt$")
    other_rank = re.compile(r".*_\d+\.pt$")
    for entry in directory.iterdir():
        if entry.is_file() and (mine.match(entry.name) or (rank == 0 and not other_rank.match(entry.name))):
            fd = os.open(entry, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    if rank == 0:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _cpu_metadata_manager_class() -> type:
    import torch.distributed as dist
    from torch_checkpointing.metadata_manager import DefaultMetadataManager

    class CpuMetadataManager(DefaultMetadataManager):
        """torch_checkpointing's metadata manager, gathering the ranks' metadata on the CPU group."""

        def _all_gather_pickled_data(self, data: Any, process_group: Any = None) -> dict[int, Any]:
            out: list[Any] = [None] * dist.get_world_size(process_group)
            dist.all_gather_object(out, data, group=process_group)
            return dict(enumerate(out))

    return CpuMetadataManager


def make_manager(rank: int, *, asynchronous: bool) -> Any:
    """A torch_checkpointing CheckpointManager for one item ``model`` of DTensors (resharding enabled)."""
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    config = CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DefaultResharder())},
        save=AsyncCheckpointSaverConfig() if asynchronous else SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        pre_finalize_callback=functools.partial(fsync_rank_files, rank),
    )
    manager = CheckpointManager(config)
    manager._metadata_manager.__class__ = _cpu_metadata_manager_class()  # the one CUDA-only step, on CPU
    if not asynchronous:  # every checkpoint with its metadata (see the module doc)
        manager._metadata_manager._should_cache_metadata = False
    return manager


def wait_for_writer(manager: Any) -> None:
    """Untimed: wait until the async saver's writer subprocess has started (it starts in the background when the
    manager is made), as a job's first checkpoint finds it after minutes of training."""
    process = getattr(getattr(manager, "_saver", None), "_checkpoint_process", None)
    if process is not None:
        process.wait_for_init()
