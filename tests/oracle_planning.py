"""The straightforward planning implementations that reshard used before it was made to scale, kept as
test oracles: the scalable planners must give exactly the same results on layouts small enough for these.

- :func:`plan_save`: validate the global layout and elect one writer per box, piece by piece;
- :func:`plan_load`: for every target box, scan every saved box of its key;
- :func:`build_metadata` and :func:`metadata_json_v1`: the coordinator's metadata assembly and the format
  version 1 encoding (every box written out in full).

Copied from ``src/reshard/planning/save_plan.py``, ``planning/load_plan.py``, ``save.py`` and
``metadata.py`` as of commit cc33297; do not "improve" them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from reshard.errors import ShardingError
from reshard.geometry.boxes import Box
from reshard.geometry.tiling import find_tiling_problem
from reshard.metadata import DataFile, Metadata, ObjectMetadata, SavedBox, SavedObject, TensorMetadata
from reshard.planning.descriptions import LocalSaveDescription, ObjectPiece, TensorPiece, WriteAssignment
from reshard.planning.load_plan import LoadPlan, ReadItem, TargetPiece, _split_overlap
from reshard.state.codec import encode_tagged
from reshard.state.dtypes import DTYPE_BY_NAME
from reshard.state.fingerprint import combine
from reshard.state.sharding import is_main_replica

__all__ = ["build_metadata", "metadata_json_v1", "plan_load", "plan_save"]


def _box_text(box: Box) -> str:
    return f"offset {list(box.offset)} shape {list(box.shape)}"


def plan_save(descriptions: list[LocalSaveDescription]) -> list[WriteAssignment]:
    """Validate the layout described by every rank and choose who writes each box.

    Checks, for every tensor key: all ranks agree on dtype and global shape; the primary boxes (replica
    id all zeros) tile the global tensor exactly: no gap, no overlap, no box claimed as primary twice;
    every replica box equals a primary box. For every object key: ranks agree on the grid shape and
    every cell has exactly one primary.

    Writers are balanced: every box is written by one of the ranks that hold it (its primary or any
    replica); boxes are assigned from the largest down to the holder with the fewest bytes assigned so
    far (ties to the lower rank), so replicated state is spread over its replicas. The result depends only
    on the descriptions, so it is the same wherever it is computed.

    Raises:
        ShardingError: naming the key, the ranks and the boxes involved.
    """
    pieces_by_key: dict[str, list[tuple[int, int, TensorPiece]]] = defaultdict(list)
    for rank, desc in enumerate(descriptions):
        for index, piece in enumerate(desc.tensors):
            pieces_by_key[piece.key].append((rank, index, piece))

    assigned_tensors: list[list[int]] = [[] for _ in descriptions]
    jobs: list[tuple[int, str, tuple[int, ...], list[tuple[int, int]]]] = []
    for key in sorted(pieces_by_key):
        jobs.extend(_validate_tensor(key, pieces_by_key[key]))
    load = [0] * len(descriptions)
    for nbytes, _key, _offset, holders in sorted(jobs, key=lambda j: (-j[0], j[1], j[2])):
        rank, index = min(holders, key=lambda h: (load[h[0]], h[0]))
        load[rank] += nbytes
        assigned_tensors[rank].append(index)

    assigned_objects: list[list[int]] = [[] for _ in descriptions]
    objects_by_key: dict[str, list[tuple[int, int, ObjectPiece]]] = defaultdict(list)
    for rank, desc in enumerate(descriptions):
        for index, obj in enumerate(desc.objects):
            objects_by_key[obj.key].append((rank, index, obj))
    for key in sorted(objects_by_key):
        for rank, index in _validate_object(key, objects_by_key[key]):
            assigned_objects[rank].append(index)

    return [
        WriteAssignment(tensors=tuple(sorted(t)), objects=tuple(sorted(o)))
        for t, o in zip(assigned_tensors, assigned_objects, strict=True)
    ]


def _validate_tensor(
    key: str, pieces: list[tuple[int, int, TensorPiece]]
) -> list[tuple[int, str, tuple[int, ...], list[tuple[int, int]]]]:
    """Check one tensor's pieces; return its write jobs: (bytes, key, offset, holders as (rank, index))."""
    first_rank, _, first = pieces[0]
    for rank, _, piece in pieces:
        if not piece.box.is_inside(piece.global_shape):
            raise ShardingError(
                f"{key!r}: rank {rank} describes box {_box_text(piece.box)}, which does not lie inside its "
                f"global_shape {list(piece.global_shape)}"
            )
        if piece.dtype != first.dtype:
            raise ShardingError(
                f"{key!r}: ranks disagree on dtype: rank {first_rank} has {first.dtype}, rank {rank} has {piece.dtype}"
            )
        if piece.global_shape != first.global_shape:
            raise ShardingError(
                f"{key!r}: ranks disagree on global_shape: rank {first_rank} has {list(first.global_shape)}, "
                f"rank {rank} has {list(piece.global_shape)}"
            )
    primaries = [(rank, index, p) for rank, index, p in pieces if is_main_replica(p.replica_id) and p.box.volume > 0]
    holders: dict[Box, list[tuple[int, int]]] = {}
    for rank, index, piece in primaries:
        if piece.box in holders:
            other = holders[piece.box][0][0]
            raise ShardingError(
                f"{key!r}: box {_box_text(piece.box)} is claimed as primary by ranks {other} and {rank}; "
                "give all but one copy a non-zero replica_id"
            )
        holders[piece.box] = [(rank, index)]
    if not primaries and any(p.box.volume for _, _, p in pieces):
        raise ShardingError(
            f"{key!r}: no rank holds a primary copy (replica_id 0): ranks {sorted({r for r, _, _ in pieces})} "
            "all hold replicas; the group must include the rank holding replica 0 (rank 0 of the group for a plain "
            "tensor, coordinate 0 of the replicated mesh dimensions for a DTensor)"
        )
    for rank, index, piece in pieces:
        if is_main_replica(piece.replica_id) or piece.box.volume == 0:
            continue
        if piece.box not in holders:
            raise ShardingError(
                f"{key!r}: rank {rank} holds a replica (replica_id {piece.replica_id}) of box "
                f"{_box_text(piece.box)}, which no rank holds as primary; a replica must equal its primary's box"
            )
        holders[piece.box].append((rank, index))
    problem = find_tiling_problem(first.global_shape, [p.box for _, _, p in primaries])
    if problem is not None:
        if problem.kind == "overlap":
            (ra, _, a), (rb, _, b) = (primaries[i] for i in problem.indices)
            raise ShardingError(
                f"{key!r}: primary boxes overlap: rank {ra} {_box_text(a.box)} and rank {rb} {_box_text(b.box)}"
            )
        raise ShardingError(
            f"{key!r}: primary boxes cover {problem.covered} of {problem.total} elements of global_shape "
            f"{list(first.global_shape)} (ranks with primaries: {sorted({r for r, _, _ in primaries})}); "
            "some part of the tensor is held by no rank as primary"
        )
    itemsize = DTYPE_BY_NAME[first.dtype].itemsize
    return [(box.volume * itemsize, key, box.offset, hs) for box, hs in holders.items()]


def _validate_object(key: str, pieces: list[tuple[int, int, ObjectPiece]]) -> list[tuple[int, int]]:
    """Check one object's cells; return the writers as (rank, index)."""
    first_rank, _, first = pieces[0]
    cells: dict[tuple[int, ...], int] = {}
    writers = []
    for rank, index, piece in pieces:
        if piece.global_shape != first.global_shape:
            raise ShardingError(
                f"object {key!r}: ranks disagree on global_shape: rank {first_rank} has "
                f"{list(first.global_shape)}, rank {rank} has {list(piece.global_shape)}"
            )
        if not is_main_replica(piece.replica_id):
            continue
        if piece.offset in cells:
            raise ShardingError(
                f"object {key!r}: cell {list(piece.offset)} is claimed as primary by ranks "
                f"{cells[piece.offset]} and {rank}"
            )
        cells[piece.offset] = rank
        writers.append((rank, index))
    total = 1
    for s in first.global_shape:
        total *= s
    if len(cells) != total:
        held = {p.offset for _, _, p in pieces}
        missing = [c for c in _grid(first.global_shape) if c not in cells][:5]
        kind = "held only as replicas" if all(m in held for m in missing) else "held by no rank"
        raise ShardingError(
            f"object {key!r}: {total - len(cells)} of {total} cells have no primary, e.g. "
            f"{[list(m) for m in missing]} ({kind})"
        )
    return writers


def _grid(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    cells: list[tuple[int, ...]] = [()]
    for size in shape:
        cells = [(*c, i) for c in cells for i in range(size)]
        if len(cells) > 100_000:
            break
    return cells


def plan_load(
    metadata: Metadata,
    targets: list[TargetPiece],
    *,
    max_read_amplification: float = 1.10,
    max_read_bytes: int = 64 * 1024 * 1024,
) -> LoadPlan:
    """Every target against every saved box of its key."""
    items: list[ReadItem] = []
    for target_index, target in enumerate(targets):
        tensor = metadata.tensors[target.key]
        itemsize = tensor.torch_dtype.itemsize
        for saved_index, saved in enumerate(tensor.boxes):
            whole = target.box.intersect(saved.box)
            if whole is None:
                continue
            for overlap, pattern in _split_overlap(
                saved.box, whole, itemsize, max_read_amplification, max_read_bytes, metadata.checksum_chunk_bytes
            ):
                items.append(
                    ReadItem(
                        target=target_index,
                        key=target.key,
                        overlap=overlap,
                        saved_index=saved_index,
                        saved_box=saved.box,
                        file=saved.file,
                        byte_offset=saved.byte_offset,
                        itemsize=itemsize,
                        pattern=pattern,
                    )
                )
    items.sort(key=lambda i: (i.file, i.byte_offset + i.pattern.first * i.itemsize))
    return LoadPlan(items=tuple(items))


def build_metadata(
    descriptions: list[LocalSaveDescription],
    results: list[dict[str, Any]],
    save_id: str,
    world_size: int,
    chunk_bytes: int,
    *,
    created_by: str,
    common: dict[str, Any],
) -> Metadata:
    """The coordinator's metadata from every rank's description and write report (the version 1 report
    form: ``{"file", "size", "tensors": [[index, offset, length, checksums, fingerprint], ...],
    "objects": [[index, offset, length, checksums], ...]}``)."""
    files: list[DataFile] = []
    tensor_info: dict[str, tuple[str, tuple[int, ...]]] = {}
    boxes: dict[str, list[SavedBox]] = {}
    prints: dict[str, list[int]] = {}
    fingerprinted = False
    object_shapes: dict[str, tuple[int, ...]] = {}
    entries: dict[str, list[SavedObject]] = {}
    for desc in descriptions:
        for piece in desc.tensors:
            tensor_info.setdefault(piece.key, (piece.dtype, piece.global_shape))
            boxes.setdefault(piece.key, [])
        for obj in desc.objects:
            object_shapes.setdefault(obj.key, obj.global_shape)
            entries.setdefault(obj.key, [])
    for rank, report in enumerate(results):
        if report["file"] is None:
            continue
        file_index = len(files)
        files.append(DataFile(path=report["file"], size=report["size"]))
        desc = descriptions[rank]
        for index, offset, length, checksums, print_ in report["tensors"]:
            piece = desc.tensors[index]
            if print_ is not None:
                fingerprinted = True
                prints.setdefault(piece.key, []).append(print_)
            boxes[piece.key].append(
                SavedBox(
                    offset=piece.box.offset,
                    shape=piece.box.shape,
                    file=file_index,
                    byte_offset=offset,
                    byte_length=length,
                    checksums=tuple(checksums),
                )
            )
        for index, offset, length, checksums in report["objects"]:
            obj = desc.objects[index]
            entries[obj.key].append(
                SavedObject(
                    offset=obj.offset,
                    file=file_index,
                    byte_offset=offset,
                    byte_length=length,
                    checksums=tuple(checksums),
                )
            )
    return Metadata(
        save_id=save_id,
        created_by=created_by,
        world_size=world_size,
        checksum_chunk_bytes=chunk_bytes,
        files=tuple(files),
        tensors={
            key: TensorMetadata(
                key=key,
                dtype=dtype,
                global_shape=shape,
                boxes=tuple(sorted(boxes[key], key=lambda b: b.offset)),
                fingerprint=combine(prints.get(key, [])) if fingerprinted else None,
            )
            for key, (dtype, shape) in sorted(tensor_info.items())
        },
        objects={
            key: ObjectMetadata(
                key=key, global_shape=shape, entries=tuple(sorted(entries[key], key=lambda e: e.offset))
            )
            for key, shape in sorted(object_shapes.items())
        },
        common=dict(common),
    )


def metadata_json_v1(metadata: Metadata) -> dict[str, Any]:
    """The version 1 wire form of ``metadata``."""
    return {
        "format": "reshard",
        "version": 1,
        "save_id": metadata.save_id,
        "created_by": metadata.created_by,
        "world_size": metadata.world_size,
        "checksum": {"algorithm": "crc32c", "chunk_bytes": metadata.checksum_chunk_bytes},
        "files": [{"path": f.path, "size": f.size} for f in metadata.files],
        "tensors": {
            key: {
                "dtype": t.dtype,
                "global_shape": list(t.global_shape),
                **({"fingerprint": f"{t.fingerprint:016x}"} if t.fingerprint is not None else {}),
                "boxes": [
                    {
                        "offset": list(b.offset),
                        "shape": list(b.shape),
                        "file": b.file,
                        "byte_offset": b.byte_offset,
                        "byte_length": b.byte_length,
                        "crc32c": list(b.checksums),
                    }
                    for b in t.boxes
                ],
            }
            for key, t in metadata.tensors.items()
        },
        "objects": {
            key: {
                "global_shape": list(o.global_shape),
                "entries": [
                    {
                        "offset": list(e.offset),
                        "file": e.file,
                        "byte_offset": e.byte_offset,
                        "byte_length": e.byte_length,
                        "crc32c": list(e.checksums),
                    }
                    for e in o.entries
                ],
            }
            for key, o in metadata.objects.items()
        },
        "common": {path: encode_tagged(value, where=path) for path, value in metadata.common.items()},
    }
