"""``reshard convert``: copy a checkpoint elsewhere (local <-> object storage), optionally casting its
floating-point tensors, tensor by tensor in bounded memory.

The copy holds the same keys, global shapes, objects, common values and scaled-tensor records (a dtype
conversion casts plain floating-point tensors only: the data, scales and global scales of scaled tensors are
copied as saved); each tensor becomes one box (the
saving layout does not matter to a load). Reading verifies every checksum, and the copy is written with
the format and commit protocol of :func:`reshard.save`, so it passes ``reshard validate``. Writing over
the source itself (with ``overwrite``) is safe: the new data files get new names, the new
``metadata.json`` replaces the old one atomically, and the old files are removed only after that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from reshard.flows.progress import Progress, reporting
from reshard.interop.offline import (
    DEFAULT_SLAB_BYTES,
    CheckpointReader,
    CheckpointWriter,
    cast_floating,
    scaled_part_keys,
)
from reshard.metadata import Metadata
from reshard.storage import CheckpointLocation

__all__ = ["convert_checkpoint"]


def convert_checkpoint(
    src: CheckpointLocation,
    dst: CheckpointLocation,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    fingerprint: bool | None = None,
    storage_options: dict[str, Any] | None = None,
    dst_storage_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    slab_bytes: int = DEFAULT_SLAB_BYTES,
) -> Metadata:
    """Copy checkpoint ``src`` to ``dst``. Not collective: run it from one process.

    Args:
        src: the checkpoint to copy (directory, URL or Storage).
        dst: where to write the copy (directory, URL or Storage); may be ``src`` itself with ``overwrite``.
        dtype: cast plain floating-point tensors (float8 included) to this dtype; others keep theirs, and so
            do the parts of scaled tensors (data, scales, global scale: never cast apart from each other).
        overwrite: replace a complete checkpoint at ``dst``.
        fingerprint: store content fingerprints in the copy (default: when ``src`` has them).
        storage_options: for object-store URLs (``src``, and ``dst`` unless ``dst_storage_options``).
        dst_storage_options: for an object-store ``dst``, when it needs other options than ``src``.
        progress: told the bytes of tensor data read.
        slab_bytes: the largest piece of a tensor held in memory at once.

    Returns:
        The committed copy's metadata.

    Raises:
        CheckpointNotFoundError, IncompleteCheckpointError, CorruptCheckpointError: ``src`` is not a
            valid checkpoint (a checksum mismatch included); nothing is committed at ``dst``.
        CheckpointExistsError: ``dst`` holds a complete checkpoint and ``overwrite`` is off.
        CheckpointLockedError, StorageError: as for :func:`reshard.save`.
    """
    with CheckpointReader(src, storage_options=storage_options) as reader:
        metadata = reader.metadata
        if fingerprint is None:
            fingerprint = any(t.fingerprint is not None for t in metadata.tensors.values())
        with (
            CheckpointWriter(
                dst,
                overwrite=overwrite,
                fingerprint=fingerprint,
                checksum_chunk_bytes=metadata.checksum_chunk_bytes,
                storage_options=dst_storage_options if dst_storage_options is not None else storage_options,
            ) as writer,
            reporting(progress, metadata.total_bytes, "convert") as advance,
        ):
            scaled = scaled_part_keys(metadata)
            for key, saved in metadata.tensors.items():
                out_dtype = saved.torch_dtype if key in scaled else cast_floating(saved.torch_dtype, dtype)
                slabs = _counted(
                    reader.iter_slabs(key, dtype=out_dtype, slab_bytes=slab_bytes), saved.torch_dtype, advance
                )
                writer.write_tensor(key, out_dtype, saved.global_shape, slabs)
            for key, obj in metadata.objects.items():
                for entry in obj.entries:
                    writer.write_object_blob(key, obj.global_shape, entry.offset, reader.read_object_blob(key, entry))
            for path, value in metadata.common.items():
                writer.set_common(path, value)
            for record in metadata.scaled.values():
                writer.set_scaled(record)
            return writer.commit()


def _counted(
    slabs: Iterator[torch.Tensor], source_dtype: torch.dtype, advance: Callable[[int], None]
) -> Iterator[torch.Tensor]:
    """``slabs``, reporting the source bytes of each once it has been consumed."""
    for slab in slabs:
        yield slab
        advance(slab.numel() * source_dtype.itemsize)
