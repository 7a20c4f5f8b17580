"""A save simulated in one process, without tensor data: what each rank would report after writing.

Save planning and the coordinator's metadata assembly take only descriptions and write reports, so a save
of any number of ranks can be run for real in one process once the reports are made up: this module makes
them the way a writer does (boxes back to back at 64-byte boundaries, in assignment order, objects after),
with placeholder checksums since there is no data to checksum. ``benchmarks/scale.py`` and the scale tests
use it to build the metadata of thousands of ranks with reshard's own code.
"""

from __future__ import annotations

import numpy as np

from reshard.io.datafile import ALIGNMENT, data_file_name
from reshard.planning.assemble import ObjectReport, TensorReport, WriteReport
from reshard.planning.descriptions import DescriptionTable, WriteAssignment
from reshard.state.dtypes import DTYPE_BY_NAME

__all__ = ["write_report"]


def write_report(
    table: DescriptionTable,
    rank: int,
    assignment: WriteAssignment,
    save_id: str,
    chunk_bytes: int,
    *,
    object_bytes: int = 96,
    fingerprints: bool = False,
) -> WriteReport:
    """The report rank ``rank`` would send after writing ``assignment`` (the form ``reshard.save``'s
    writers send): each box's byte offset and length as the writer lays them out, one checksum per chunk
    (deterministic placeholders), each ShardedObject value counted as ``object_bytes``."""
    if not assignment.tensors and not assignment.objects:
        return WriteReport()
    rows = table.rank_start[rank] + np.asarray(assignment.tensors, dtype=np.int64)
    itemsize = np.array([DTYPE_BY_NAME[d].itemsize for d in table.header_dtype], dtype=np.int64)
    ndim = table.ndim[rows]
    volume = np.prod(np.where(np.arange(table.shape.shape[1]) < ndim[:, None], table.shape[rows], 1), axis=1)
    lengths = (volume * itemsize[table.header[rows]]).tolist()
    offsets = []
    position = 0
    for length in lengths:
        position += -position % ALIGNMENT
        offsets.append(position)
        position += length
    objects = []
    for index in assignment.objects:
        position += -position % ALIGNMENT
        checksums_of_object = (rank,) * -(-object_bytes // chunk_bytes)
        objects.append(
            ObjectReport(index=index, byte_offset=position, byte_length=object_bytes, checksums=checksums_of_object)
        )
        position += object_bytes
    chunks = sum(-(-n // chunk_bytes) for n in lengths)
    checksums = np.random.default_rng(rank).integers(0, 2**32, size=chunks, dtype=np.uint32).tolist()
    prints = [(rank << 32) + i for i in range(len(lengths))] if fingerprints else None
    return WriteReport(
        file=data_file_name(save_id, rank),
        size=position,
        tensors=TensorReport.of(assignment.tensors, offsets, lengths, checksums, prints),
        objects=tuple(objects),
    )
