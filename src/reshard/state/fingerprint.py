"""Layout-independent content fingerprints of tensors, for end-to-end verification of a reshard.

The fingerprint of a tensor is ``sum(mix(i, w_i))`` over the *words* of its elements, modulo 2**64:
``w_i`` are the raw bits of the elements (as signed integers of the element's width; 16-byte elements
count as two 8-byte words), and ``i`` is the word's position in the row-major flattening of the *global*
(logical) tensor. Addition is associative and commutative modulo 2**64, so partial sums over the boxes
of any tiling add up to the same value: a save sums over the boxes it writes, a load over the primary
boxes of its own layout, and the two must agree whatever the layouts. ``mix`` makes both the value and its
place matter: ``mix(i, w) = w * (2*i + 1) + i * 0x9E3779B97F4A7C15`` (wrapping 64-bit arithmetic), so a
wrong value, or a right value copied to the wrong place, changes the sum.
"""

from __future__ import annotations

import math

import torch

from reshard.geometry.boxes import Box, row_major_strides

__all__ = ["combine", "fingerprint"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_SLAB_ELEMENTS = 1 << 22


def combine(values: list[int]) -> int:
    """Sum partial fingerprints (mod 2**64)."""
    return sum(values) & _MASK


def fingerprint(view: torch.Tensor, box: Box, global_shape: tuple[int, ...]) -> int:
    """The partial fingerprint of ``view``, the elements of ``box`` of a global tensor of ``global_shape``.

    Computed without materialising the word indices: with rows along the last axis, a word's index is
    ``rowbase + j``, so ``sum(w * (2i + 1) + i * G) = 2 * sum_r(rowbase_r * S_r) + 2 * sum(w_j * j) + sum(w)
    + G * sum(i)``, where ``S_r`` is the sum of row ``r``'s words: a few passes over the data. They run where
    the data is (a GPU tensor is summed on its device, in the same wrapping 64-bit arithmetic, and only the sums
    come to the host).
    """
    if box.volume == 0:
        return 0
    data = view.detach().resolve_conj().resolve_neg().contiguous().reshape(box.shape)
    device = data.device
    itemsize = data.element_size()
    words = 2 if itemsize == 16 else 1
    word_dtype = _WORD[itemsize]
    shape = box.shape or (1,)
    offset = box.offset or (0,)
    strides = row_major_strides(global_shape) if global_shape else (1,)
    columns = shape[-1] * words
    rows_total = math.prod(shape[:-1])
    slab = max(1, _SLAB_ELEMENTS // columns)
    column_index = torch.arange(columns, dtype=torch.int64, device=device)
    flat = data.reshape(rows_total, shape[-1])
    # Global word index of the first word of every row (a small tensor: one entry per row).
    row_base = torch.zeros((), dtype=torch.int64, device=device)
    for axis in range(len(shape) - 1):
        coords = torch.arange(offset[axis], offset[axis] + shape[axis], dtype=torch.int64, device=device)
        row_base = row_base.unsqueeze(-1) + coords * strides[axis]
    row_base = (row_base.reshape(-1) + offset[-1] * strides[-1]) * words
    total = 0
    for start in range(0, rows_total, slab):
        stop = min(rows_total, start + slab)
        bits = flat[start:stop].contiguous().view(torch.uint8).view(word_dtype).to(torch.int64)
        bits = bits.reshape(stop - start, columns)
        row_sums = bits.sum(1)
        base = row_base[start:stop]
        sum_words = int(row_sums.sum())
        sum_words_index = int((base * row_sums).sum()) + int((bits * column_index).sum())
        sum_index = int(base.sum()) * columns + (stop - start) * (columns * (columns - 1) // 2)
        total += 2 * sum_words_index + sum_words + _GOLDEN * sum_index
    return total & _MASK
