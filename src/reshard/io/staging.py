"""Node-local staging of whole data files for a load (``load(..., options=LoadOptions(staging=StagingOptions(...)))``).

For storage that is slow to range-read, the ranks of each node download the whole data files that any
of them needs, once per node, into a node-local directory, and then read locally. The seed report of
the cloud-resume bug is the trap this avoids: a node must stage every file *any* of its ranks needs
(tensors and objects whose bytes another rank wrote), and common state needs no file at all here: it
lives in ``metadata.json``, which the coordinator reads once.

Protocol (two agreement steps over the load's group):

1. every rank sends its node id and the data files it needs; the coordinator forms, per node, the union
   of the files, and assigns each file to one rank of that node (balancing bytes);
2. every rank downloads its assigned files: a complete file already in the staging directory is reused
   after checking its size and every checksum of the boxes and objects in it (a partial one never
   is); others are downloaded to a temporary name and renamed when complete. When the step returns, every
   node holds every file its ranks need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from reshard.errors import CorruptCheckpointError
from reshard.io.verified import verify_stored_ranges
from reshard.metadata import DataFile, Metadata
from reshard.storage import LocalStorage, Storage

if TYPE_CHECKING:
    from reshard.net.comm import Communicator

__all__ = ["StagedFiles", "stage_files"]


@dataclass
class StagedFiles:
    """The result of staging on one rank: where to read, and what this rank put there."""

    storage: Storage
    directory: Path
    metadata: Metadata
    """The checkpoint's metadata with every file named as staged (:func:`staged_name`)."""
    downloaded: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    bytes_downloaded: int = 0

    def remove(self) -> None:
        """Remove the files this rank staged (downloaded or reused), and empty directories; best effort.
        Called after every rank finished reading."""
        for name in [*self.downloaded, *self.reused]:
            with contextlib.suppress(OSError):
                (self.directory / name).unlink()
        for folder in sorted({(self.directory / n).parent for n in [*self.downloaded, *self.reused]}, reverse=True):
            with contextlib.suppress(OSError):
                folder.rmdir()


REFERENCED_DIR = "referenced"
"""Where staging puts the files of other checkpoints that an incremental checkpoint references."""


def staged_name(entry: DataFile) -> str:
    """The name of a data file in the staging directory: its own path, or, for a file of another checkpoint,
    ``referenced/<checkpoint>/<path>`` (the staged copy stays inside the staging directory)."""
    return entry.path if entry.checkpoint is None else f"{REFERENCED_DIR}/{entry.checkpoint}/{entry.path}"


def node_id(node_group: dist.ProcessGroup | None) -> str:
    """This rank's node: the global ranks of ``node_group``, or the hostname."""
    if node_group is not None:
        return "group:" + ",".join(map(str, dist.get_process_group_ranks(node_group)))
    return "host:" + socket.gethostname()


StoredRanges = dict[int, list[tuple[int, int, tuple[int, ...]]]]
"""Data file number -> (byte offset, byte length, chunk checksums) of every box and object stored in it."""


def stored_ranges(metadata: Metadata, files: set[int]) -> StoredRanges:
    """The stored ranges of ``files``, in one pass over the metadata (not one pass per file)."""
    ranges: StoredRanges = {file: [] for file in files}
    for t in metadata.tensors.values():
        for b in t.boxes:
            if b.file in ranges:
                ranges[b.file].append((b.byte_offset, b.byte_length, b.checksums))
    for o in metadata.objects.values():
        for e in o.entries:
            if e.file in ranges:
                ranges[e.file].append((e.byte_offset, e.byte_length, e.checksums))
    return ranges


def file_is_complete(path: Path, metadata: Metadata, file: int, ranges: StoredRanges | None = None) -> bool:
    """Whether the local file at ``path`` is a complete copy of data file ``file``: its size, and the
    checksum of every chunk of every box and object stored in it (``ranges``: from :func:`stored_ranges`,
    computed here when not given), verified by the chunk verifier of loads
    (:func:`~reshard.io.verified.verify_stored_ranges`)."""
    entry = metadata.files[file]
    try:
        if os.stat(path, follow_symlinks=False).st_size != entry.size:
            return False
    except OSError:
        return False
    stored = (ranges if ranges is not None and file in ranges else stored_ranges(metadata, {file}))[file]
    # The copy is read under the name the metadata gives it, from the directory that holds it.
    depth = len(Path(entry.path).parts) - 1
    entries = [(f"staged copy {path}", file, offset, length, checksums) for offset, length, checksums in stored]
    return not verify_stored_ranges(LocalStorage(path.parents[depth]), metadata, entries, stop_at_first=True)


def _assign(requests: list[dict[str, Any]], metadata: Metadata) -> list[list[int]]:
    """On the coordinator: for every node, each needed file goes to one of its ranks (largest files
    first, to the rank with the fewest bytes so far). Returns the files each rank downloads."""
    nodes: dict[str, list[int]] = {}
    for rank, request in enumerate(requests):
        nodes.setdefault(request["node"], []).append(rank)
    out: list[list[int]] = [[] for _ in requests]
    for ranks in nodes.values():
        files = sorted({f for r in ranks for f in requests[r]["files"]}, key=lambda f: (-metadata.files[f].size, f))
        load = dict.fromkeys(ranks, 0)
        for file in files:
            rank = min(ranks, key=lambda r: (load[r], r))
            load[rank] += metadata.files[file].size
            out[rank].append(file)
    return out


def stage_files(
    comm: Communicator,
    storage: Storage,
    metadata: Metadata,
    needed: set[int],
    directory: Path,
    node_group: dist.ProcessGroup | None,
) -> StagedFiles:
    """Stage the data files this node needs (collective over the load's group; see the module doc)."""
    node = node_id(node_group)

    def request() -> dict[str, Any]:
        return {"node": node, "files": sorted(needed)}

    assignments: list[list[int]] = comm.step("staging plan", request, lambda requests: _assign(requests, metadata))
    staged_metadata = dataclasses.replace(
        metadata, files=tuple(DataFile(path=staged_name(f), size=f.size) for f in metadata.files)
    )
    staged = StagedFiles(storage=LocalStorage(directory), directory=directory, metadata=staged_metadata)

    def download() -> None:
        mine = assignments[comm.rank]
        present = {file for file in mine if (directory / staged_name(metadata.files[file])).exists()}
        ranges = stored_ranges(metadata, present) if present else {}
        for file in mine:
            name = staged_name(metadata.files[file])
            source = metadata.files[file].location
            final = directory / name
            if file in present and file_is_complete(final, staged_metadata, file, ranges):
                staged.reused.append(name)
                continue
            final.parent.mkdir(parents=True, exist_ok=True)
            temp = final.with_name(f".{final.name}.part-{uuid.uuid4().hex}")
            try:
                storage.download(source, temp)
                size = os.stat(temp).st_size
            except FileNotFoundError:
                temp.unlink(missing_ok=True)
                raise CorruptCheckpointError(f"data file {storage.describe(source)} is missing") from None
            except BaseException:
                temp.unlink(missing_ok=True)
                raise
            if size != metadata.files[file].size:
                temp.unlink(missing_ok=True)
                raise CorruptCheckpointError(  # as a plain load says it (reshard.io.verified)
                    f"data file {storage.describe(source)} has {size} bytes, the metadata says "
                    f"{metadata.files[file].size}: it was truncated or altered"
                )
            os.replace(temp, final)
            staged.downloaded.append(name)
            staged.bytes_downloaded += metadata.files[file].size

    comm.step("staging", download)
    return staged
