"""``export-hf --quantize`` of a checkpoint whose Linear weights are saved as scaled tensors already (issue 32):
their data and scales written as they are, under the consumer's names and dtypes, never requantized.

A weight saved as a :class:`~reshard.ScaledTensor` of the scheme's format is *passed through* when the saved
blocks are the scheme's on the weight as transformers and compressed-tensors see it (a fused QKV or GLU tensor
split into its parts, a stacked expert tensor into its experts): along each axis the saved block and the
scheme's block give the same cells (a block at least as long as the axis is the whole axis), and a fused
part starts and ends on a saved block boundary (else its scales would be shared with its neighbour). The data
is written as saved (FP8 bytes, packed FP4 bytes), the scales as saved where the consumer keeps their dtype
(``weight_scale_inv`` float32, E8M0 bits, E4M3 NVFP4 scales, the float32 global scale) and converted where it
does not: compressed-tensors' FP8 ``weight_scale`` is held in the model's dtype (transformers loads it into
parameters of that dtype), so float32 scales are written in it only when every one is exactly representable
there, else the export is refused naming the first that is not (rounding it would change every dequantized
value of its block). Everything is streamed in slabs, as the rest of the export.

Without ``--quantize`` a checkpoint holding scaled weights is refused naming ``--quantize`` and the schemes
of their format: written plainly, the data would load without its scales.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from reshard.errors import MismatchError
from reshard.interop.offline import CheckpointReader
from reshard.interop.safetensors import SafetensorsWriter, TensorSpec
from reshard.models.hf_quant import GLOBAL_SCALE_NAME, QUANT_SCHEMES, ExportPart, QuantScheme, check_shape
from reshard.state.lowprec import Block, scale_format
from reshard.state.scaled import ScaledRecord

__all__ = ["PartPlace", "passthrough_parts", "refuse_unquantized", "write_cast"]


@dataclass(frozen=True, slots=True)
class PartPlace:
    """Where an exported 2-D weight lies in its checkpoint tensor: the expert (the index on the leading axis
    of a stacked tensor, None for a 2-D one) and its rows ``[row, row + rows)`` (a fused part, or all)."""

    expert: int | None
    row: int
    rows: int


def _whole(b: int | None, n: int) -> int:
    """The block ``b`` along an axis of ``n`` elements, the whole axis written as ``n``."""
    return n if b is None or b >= n else b


def _refuse(name: str, record: ScaledRecord, scheme: QuantScheme, why: str) -> MismatchError:
    return MismatchError(
        f"{name} is saved (in {record.key!r}) as {record.describe()}; --quantize {scheme.name} writes blocks "
        f"{list(scheme.block)}: {why}, and a low-precision tensor is not requantized"
    )


def _check_blocks(
    name: str, record: ScaledRecord, scheme: QuantScheme, place: PartPlace, shape: tuple[int, ...]
) -> int:
    """The saved row block (elements) of the weight ``name`` at ``place`` of the checkpoint tensor of logical
    ``shape``, after checking that its cells are the scheme's.

    Raises:
        MismatchError: the blocks differ, a fused part cuts a saved block, or experts share scales.
    """
    block: Block = record.block
    if place.expert is not None and _whole(block[0], shape[0]) != 1:
        raise _refuse(name, record, scheme, "its experts share scales")
    rows, cols = shape[-2:]
    saved_rows, saved_cols = _whole(block[-2], rows), _whole(block[-1], cols)
    stop = place.row + place.rows
    if place.row % saved_rows or (stop % saved_rows and stop != rows):
        raise _refuse(name, record, scheme, f"its rows [{place.row}, {stop}) cut the saved blocks")
    if (_whole(saved_rows, place.rows), saved_cols) != (
        _whole(scheme.block[0], place.rows),
        _whole(scheme.block[1], cols),
    ):
        raise _refuse(name, record, scheme, "the blocks differ")
    return saved_rows


def passthrough_parts(
    reader: CheckpointReader,
    spec: TensorSpec,
    start: int,
    record: ScaledRecord,
    scheme: QuantScheme,
    place: PartPlace,
    model_dtype: torch.dtype,
) -> list[ExportPart]:
    """The output tensors of weight ``spec`` (elements from ``start`` of the saved data ``record.key``, at
    ``place``), a scaled tensor of ``scheme``'s format: its data, scales and (NVFP4) global scale as saved,
    the scales in the consumer's dtype (``model_dtype`` for compressed-tensors' FP8 scales).

    Raises:
        MismatchError: blocks the scheme does not write (naming both), or a shape the consumer cannot hold.
    """
    fmt = scale_format(record.format)
    stored = tuple(reader.tensor(record.key).global_shape)
    logical = (*stored[:-1], stored[-1] * fmt.elements_per_item)
    name = spec.name
    check_shape(name, (place.rows, logical[-1]), scheme)
    saved_rows = _check_blocks(name, record, scheme, place, logical)
    grid = tuple(reader.tensor(record.scale_key).global_shape)
    cells = math.ceil((place.row + place.rows) / saved_rows) - place.row // saved_rows
    scale_start = ((place.expert or 0) * grid[-2] + place.row // saved_rows) * grid[-1]
    scale_dtype = scheme.scale_dtype or model_dtype
    base = name.removesuffix("weight")
    parts = [
        ExportPart(
            TensorSpec(name=base + scheme.data_name, dtype=spec.dtype, shape=tuple(spec.shape)),
            record.key,
            start,
            "as_is",
        ),
        ExportPart(
            TensorSpec(name=base + scheme.scale_name, dtype=scale_dtype, shape=(cells, grid[-1])),
            record.scale_key,
            scale_start,
            "as_is" if reader.tensor(record.scale_key).torch_dtype == scale_dtype else "cast",
        ),
    ]
    if record.global_scale_key is not None:
        spec_global = TensorSpec(name=base + GLOBAL_SCALE_NAME, dtype=torch.float32, shape=(1,))
        parts.append(ExportPart(spec_global, record.global_scale_key, 0, "as_is"))
    return parts


def write_cast(reader: CheckpointReader, writer: SafetensorsWriter, part: ExportPart, slab_bytes: int) -> None:
    """Write the ``"cast"`` part (saved scales in another dtype than the consumer's) in slabs, each value
    converted exactly. The caller ends the tensor.

    Raises:
        MismatchError: a saved scale the consumer's dtype cannot hold exactly (named with its value).
    """
    saved = reader.tensor(part.key).torch_dtype
    total = math.prod(part.spec.shape)
    per_slab = max(1, slab_bytes // saved.itemsize)
    for offset in range(0, total, per_slab):
        count = min(per_slab, total - offset)
        slab = reader.slab_buffer(count * saved.itemsize).view(saved)[:count]
        reader.read_flat(part.key, part.start + offset, slab)
        out = slab.to(part.spec.dtype)
        inexact = (out.to(saved) != slab).nonzero()
        if inexact.numel():
            value = slab[int(inexact[0, 0])].item()
            raise MismatchError(
                f"{part.key!r} holds the scale {value!r}, which {part.spec.name} cannot hold exactly in "
                f"{str(part.spec.dtype).removeprefix('torch.')} (the dtype its consumer keeps the scales in): "
                "rounding it would change every dequantized value of its block; export with a scheme that keeps "
                "float32 scales (fp8-block128), or save the model in float32"
            )
        writer.write(out)


def refuse_unquantized(name: str, record: ScaledRecord, scheme: QuantScheme | None) -> MismatchError:
    """The error for scaled tensor ``record`` exported as the plain tensor ``name`` (without ``--quantize``,
    or not a weight the schemes quantize): written plainly, its data would load without its scales."""
    if scheme is not None:
        return MismatchError(
            f"{name} is saved (in {record.key!r}) as a scaled tensor of {record.describe()}, but --quantize "
            f"{scheme.name} writes it in high precision: its data would be written without its scales"
        )
    schemes = [s.name for s in QUANT_SCHEMES.values() if s.fmt == record.format]
    offer = f"--quantize {' or '.join(schemes)}" if schemes else "--quantize (no scheme writes this format)"
    return MismatchError(
        f"{name} is saved (in {record.key!r}) as a scaled tensor of {record.describe()}: export it with {offer}, "
        "which writes its data and scales as they are; without --quantize its data would be written without its "
        "scales"
    )
