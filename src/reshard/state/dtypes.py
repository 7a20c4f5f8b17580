"""The element types a checkpoint can hold, by the names the format uses.

Names are torch's own dtype names without the ``torch.`` prefix. Bytes are stored little-endian.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["BYTE_VIEW_DTYPES", "DTYPE_BY_NAME", "byte_view", "dtype_name", "is_lossy_cast", "itemsize"]

DTYPE_BY_NAME: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

BYTE_VIEW_DTYPES: frozenset[torch.dtype] = frozenset({torch.float4_e2m1fn_x2, torch.float8_e8m0fnu})
"""One-byte dtypes a checkpoint does not name: packed FP4 and E8M0 scales. Only a
:class:`~reshard.ScaledTensor` holds them; they are saved and filled through ``uint8`` views of the same
memory (no cast: torch implements few operations on them)."""

_NAME_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPE_BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name of ``dtype``.

    Raises:
        KeyError: reshard cannot store this dtype.
    """
    return _NAME_BY_DTYPE[dtype]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A flat, writable byte view of a contiguous CPU tensor's memory (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if sys.byteorder != "little":  # the format is little-endian; byte-swapping is not implemented
        raise NotImplementedError("reshard reads and writes tensor bytes on little-endian hosts only")
    flat = tensor.detach().reshape(-1)
    if flat.numel() <= 1:  # contiguous whatever its stride: a single element's stride may be any number
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat.view(torch.uint8).numpy().data.cast("B")


def is_lossy_cast(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether converting ``source`` elements to ``target`` can change values beyond rounding: floating or
    complex to integer or bool (truncation), complex to real (the imaginary part), integer to an integer type
    that does not hold every value of the source (int64 -> int32, int8 -> uint8), anything to bool. Floating
    precision changes (fp32 <-> bf16, fp64 -> fp16) and integer to floating are rounding, not lossy here."""
    if source == target:
        return False
    if target == torch.bool:
        return True
    if source.is_complex and not target.is_complex:
        return True
    target_integral = not (target.is_floating_point or target.is_complex)
    if (source.is_floating_point or source.is_complex) and target_integral:
        return True
    if source != torch.bool and not (source.is_floating_point or source.is_complex) and target_integral:
        wide, narrow = torch.iinfo(source), torch.iinfo(target)
        return narrow.min > wide.min or narrow.max < wide.max
    return False
