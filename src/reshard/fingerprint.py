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

from reshard.boxes import Box, row_major_strides

__all__ = ["combine", "fingerprint"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_WORD = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}
_SLAB_ELEMENTS = 1 << 22


def combine(values: list[int]) -> int:
    """Sum partial fingerprints (mod 2**64)."""
    return sum(values) & _MASK


def fingerprint(view: torch.Tensor, box: Box, global_shape: tuple[int, ...]) -> int:
    """The partial fingerprint of ``view``, the elements of ``box`` of a global tensor of ``global_shape``."""
    if box.volume == 0:
        return 0
    data = view.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(box.shape)
    itemsize = data.element_size()
    words = 2 if itemsize == 16 else 1
    word_dtype = _WORD[itemsize]
    global_strides = row_major_strides(global_shape) if global_shape else ()
    if not box.shape:  # a 0-d tensor: one element at index 0
        bits = data.reshape(1).view(torch.uint8).view(word_dtype).to(torch.int64)
        index = torch.arange(words, dtype=torch.int64)
        return _mix_sum(index, bits)
    rows = box.shape[0]
    per_row = max(1, math.prod(box.shape[1:]))
    slab = max(1, _SLAB_ELEMENTS // per_row)
    total = 0
    for start in range(0, rows, slab):
        stop = min(rows, start + slab)
        part = data[start:stop]
        index = torch.zeros((), dtype=torch.int64)
        for axis, (offset, size) in enumerate(zip(box.offset, part.shape, strict=True)):
            base = offset + (start if axis == 0 else 0)
            coords = torch.arange(base, base + size, dtype=torch.int64) * global_strides[axis]
            index = index.unsqueeze(-1) + coords
        index = index.reshape(-1)
        bits = part.reshape(-1).contiguous().view(torch.uint8).view(word_dtype).to(torch.int64)
        if words == 2:
            index = (index.unsqueeze(-1) * 2 + torch.arange(2, dtype=torch.int64)).reshape(-1)
        total += _mix_sum(index, bits)
    return total & _MASK


def _mix_sum(index: torch.Tensor, bits: torch.Tensor) -> int:
    mixed = bits * (index * 2 + 1) + index * _GOLDEN
    return int(mixed.sum()) & _MASK
