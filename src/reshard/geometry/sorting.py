"""Sorting many rows of integer keys fast: :func:`lexsort` is ``numpy.lexsort`` with the keys packed.

``numpy.lexsort`` sorts once per key (a stable sort each); the planners sort millions of rows by three to nine
integer keys (a tensor, then its coordinates), which at 16,384 ranks took seconds. Integer keys whose ranges
multiply to less than ``2 ** 63`` pack into one int64 (mixed radix, the primary key most significant), and one
stable sort of that gives exactly the order ``numpy.lexsort`` gives, ties included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["lexsort"]

_PACKED_LIMIT = 1 << 62
"""The packed keys stay below this (a margin under the int64 maximum)."""


def lexsort(keys: Sequence[npt.NDArray[Any]]) -> npt.NDArray[np.intp]:
    """The indices that sort the rows by ``keys`` as ``numpy.lexsort(keys)`` does (the *last* key primary, ties
    kept in index order), for keys of integers or booleans: the most significant keys that fit are packed into one
    int64 and sorted once, any others sort first as ``numpy.lexsort`` would."""
    if not keys:
        raise ValueError("lexsort needs at least one key")
    if len(keys[0]) == 0:
        return np.zeros(0, dtype=np.intp)
    packed: npt.NDArray[np.int64] | None = None
    radix_product = 1
    taken = 0
    for key in reversed(keys):  # the primary key first
        low, high = int(key.min()), int(key.max())
        radix = high - low + 1
        if radix_product * radix >= _PACKED_LIMIT:
            break
        shifted = key.astype(np.int64) - low
        packed = shifted if packed is None else packed * radix + shifted
        radix_product *= radix
        taken += 1
    if packed is None:
        return np.lexsort(tuple(keys))
    rest = tuple(keys[: len(keys) - taken])
    if not rest:
        return np.argsort(packed, kind="stable")
    return np.lexsort((*rest, packed))
