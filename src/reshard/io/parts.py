"""Reading a checkpoint's metadata through its storage, part files included (format version 6).

Two entry points:

- :func:`reshard.io.sources.read_full_metadata`: the whole :class:`~reshard.metadata.Metadata` of a
  checkpoint, every tensor's boxes included, each part verified. For every reader that wants the whole
  document (validate, inspect, export, convert, diff, incremental bases, the Megatron strategy, ...): one
  function, whatever the version.
- :func:`read_parts`: the parts holding the boxes of some keys, for a rank of a load that has the (small)
  ``metadata.json`` already and needs only its template's tensors.

Each part is checked against the sealed document before it is parsed (its size, then its SHA-256), so a part
that is missing, damaged, of another save or hostile is a :class:`~reshard.CorruptCheckpointError` before any
of its boxes is used.
"""

from __future__ import annotations

from collections.abc import Iterable

from reshard.errors import CorruptCheckpointError, StorageError
from reshard.metadata import Metadata, TensorMetadata
from reshard.metadata.parts import parse_part, part_of, with_tensors
from reshard.storage import FileTooLargeError, Storage

__all__ = ["read_parts"]


def read_parts(storage: Storage, metadata: Metadata, keys: Iterable[str] | None = None) -> Metadata:
    """``metadata`` with the boxes of ``keys`` (None: every tensor) read from their part files.

    Keys the metadata does not hold, and tensors whose boxes are already there (versions 1 to 5, or parts
    read before), are left as they are. Each part is read and verified whole once, whatever the number of its
    keys; only the boxes of ``keys`` are decoded (the part's other tensors stay unread).

    Raises:
        CorruptCheckpointError: a part is missing, of another size or SHA-256 than the document says, or
            holds invalid entries.
        StorageError: a part exists but cannot be read.
    """
    wanted = set(metadata.tensors if keys is None else keys)
    numbers = sorted({n for key in wanted if key in metadata.tensors and (n := part_of(metadata, key)) is not None})
    tensors: dict[str, TensorMetadata] = {}
    for number in numbers:
        where = storage.describe(metadata.parts[number].path)
        tensors |= parse_part(_read_part(storage, metadata, number), metadata, number, wanted, where=where)
    return with_tensors(metadata, tensors)


def _read_part(storage: Storage, metadata: Metadata, number: int) -> bytes:
    """The bytes of part ``number``, at most its recorded size plus one (so that a longer file is refused by
    its size, unread past that)."""
    part = metadata.parts[number]
    try:
        return storage.read_bytes(part.path, max_bytes=part.size)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{storage.describe(part.path)}: metadata part {number} of save {metadata.save_id} is missing"
        ) from None
    except FileTooLargeError:
        raise CorruptCheckpointError(
            f"{storage.describe(part.path)}: metadata part {number} is larger than the {part.size} bytes the "
            "metadata says"
        ) from None
    except OSError as exc:
        raise StorageError(f"cannot read {storage.describe(part.path)}: {exc}") from exc
