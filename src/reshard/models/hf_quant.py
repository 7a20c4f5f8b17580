"""``export-hf --quantize``: the model's high-precision Linear weights quantized on the way out, in the
tensor names and ``quantization_config`` of the consumer that loads them.

Schemes (:data:`QUANT_SCHEMES`; the reshard format and block of :mod:`reshard.state.lowprec`, quantized by
:mod:`reshard.state.quantize`):

=====================  ===================  ==============  ============================================
scheme                 consumer             reshard format  tensors per quantized ``X.weight``
=====================  ===================  ==============  ============================================
``fp8-block128``       transformers         ``fp8_e4m3``    ``X.weight`` (E4M3), ``X.weight_scale_inv``
                       FineGrainedFP8       128x128         (float32, one per 128x128 block)
``ct-fp8-block128``    compressed-tensors   ``fp8_e4m3``    ``X.weight`` (E4M3), ``X.weight_scale``
                       ``FP8_BLOCK``        128x128         (weight's dtype, one per 128x128 block)
``ct-fp8-channel``     compressed-tensors   ``fp8_e4m3``    ``X.weight`` (E4M3), ``X.weight_scale``
                       ``FP8_DYNAMIC``      per row         (weight's dtype, ``[rows, 1]``)
``ct-mxfp8``           compressed-tensors   ``mxfp8_e4m3``  ``X.weight`` (E4M3), ``X.weight_scale``
                       ``MXFP8``            1x32            (uint8 E8M0 bits)
``ct-mxfp4``           compressed-tensors   ``mxfp4``       ``X.weight_packed`` (uint8, two E2M1 a byte),
                       ``MXFP4``            1x32            ``X.weight_scale`` (uint8 E8M0 bits)
``ct-nvfp4``           compressed-tensors   ``nvfp4_``      ``X.weight_packed``, ``X.weight_scale`` (E4M3),
                       ``NVFP4A16``         ``divisor``     ``X.weight_global_scale`` (float32 ``[1]``)
                                            1x16
=====================  ===================  ==============  ============================================

Quantized: the weights of the attention projections (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``), the
MLP and shared-expert projections (``gate_proj``, ``up_proj``, ``down_proj``) and every expert's
(``w1``/``w2``/``w3`` of Mixtral). Kept in their precision: embeddings, norms, biases, ``lm_head``, the
routers and Qwen2-MoE's ``shared_expert_gate``; they are listed in the config's ``modules_to_not_convert``
(transformers) or ``ignore`` (compressed-tensors), ``lm_head`` always (also when tied).

The compressed-tensors FP8 scales have the weight's dtype, as compressed-tensors holds them in a model of
that dtype (transformers loads them into parameters of the model's dtype): the float32 scale of
:func:`~reshard.state.quantize.scales_from_amax` is rounded to it first and the data divided by the rounded
scale, so that every consumer's ``data * scale`` is the value reshard's ``dequantize`` gives (for a float32
weight nothing is rounded: the bytes of :func:`~reshard.state.quantize.quantize`).

Refused (MismatchError naming the tensor): a weight the scheme cannot hold, whose shape the transformers
128x128 blocks do not divide (transformers' CPU dequantization derives the block from the scale grid and
would misplace partial blocks; ``ct-fp8-block128`` holds them), or whose rows the group of an MX / NVFP4
scheme does not divide; a weight that is not float32, bfloat16 or float16 (already low precision: nothing is
requantized); a checkpoint whose tensor is saved as a scaled tensor of another format (see
:func:`check_source_format`). A weight saved as a scaled tensor of the scheme's format and blocks is written
as it is, not requantized (:mod:`reshard.models.hf_scaled`).

Streaming: the data and the scales of a weight are each computed by reading the weight again in strips of
whole block rows (a strip of at most ``slab_bytes``, never less than one row of blocks), with the same
deterministic operations, so its scales come out the same each time; NVFP4 adds one amax pass over the
weight for the global scale, made once per weight and kept for its other tensors (see
:func:`write_quantized`). An export holds one strip at a time, never a whole tensor's quantized copy: memory
is bounded, at the price of reading each quantized weight twice (three times for NVFP4).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from reshard.errors import MismatchError
from reshard.interop.offline import CheckpointReader
from reshard.interop.safetensors import SafetensorsWriter, TensorSpec
from reshard.state.lowprec import Block, scale_format, scale_grid_shape
from reshard.state.quantize import (
    block_amax,
    global_scale_from_amax,
    quantize_with_scales,
    scales_from_amax,
)

__all__ = [
    "GLOBAL_SCALE_NAME",
    "QUANT_SCHEMES",
    "ExportPart",
    "QuantScheme",
    "check_shape",
    "check_source_format",
    "is_quantized_weight",
    "quantization_config",
    "quantized_parts",
    "write_quantized",
]

_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_QUANTIZED_MODULE = re.compile(r"\.(?:q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


@dataclass(frozen=True, slots=True)
class QuantScheme:
    """One ``--quantize`` choice (see the module's table).

    Attributes:
        name: the CLI name.
        consumer: ``"transformers"`` (FineGrainedFP8) or ``"compressed-tensors"``.
        fmt: the reshard format (:data:`reshard.state.lowprec.FORMATS`).
        block: the block per axis of a 2-D weight (None: the whole axis).
        data_name, scale_name: the suffixes that replace ``weight`` in the tensor names.
        scale_dtype: the dtype of the written scales; None: the weight's own (float32, bfloat16 or float16),
            as compressed-tensors holds the FP8 scales of a model of that dtype.
        ct_format: the compressed-tensors ``format`` (None for transformers).
        ct_weights, ct_activations: the compressed-tensors ``weights`` / ``input_activations`` arguments
            (its preset's, as its ``model_dump`` writes them).
    """

    name: str
    consumer: str
    fmt: str
    block: Block
    data_name: str
    scale_name: str
    scale_dtype: torch.dtype | None
    ct_format: str | None = None
    ct_weights: tuple[tuple[str, object], ...] = ()
    ct_activations: tuple[tuple[str, object], ...] | None = None


def _args(bits: int, **fields: object) -> tuple[tuple[str, object], ...]:
    """compressed-tensors' ``QuantizationArgs`` of a symmetric float format, as its ``model_dump`` writes them."""
    return (("num_bits", bits), ("type", "float"), ("symmetric", True), *fields.items())


QUANT_SCHEMES: dict[str, QuantScheme] = {
    s.name: s
    for s in (
        QuantScheme(
            "fp8-block128", "transformers", "fp8_e4m3", (128, 128), "weight", "weight_scale_inv", torch.float32
        ),
        QuantScheme(
            "ct-fp8-block128", "compressed-tensors", "fp8_e4m3", (128, 128), "weight", "weight_scale", None,
            "float-quantized",
            _args(8, group_size=None, strategy="block", block_structure=(128, 128), dynamic=False),
            _args(8, group_size=128, strategy="group", dynamic=True),
        ),
        QuantScheme(
            "ct-fp8-channel", "compressed-tensors", "fp8_e4m3", (1, None), "weight", "weight_scale", None,
            "float-quantized",
            _args(8, group_size=None, strategy="channel", dynamic=False),
            _args(8, group_size=None, strategy="token", dynamic=True),
        ),
        QuantScheme(
            "ct-mxfp8", "compressed-tensors", "mxfp8_e4m3", (1, 32), "weight", "weight_scale", torch.uint8,
            "mxfp8-quantized",
            _args(8, group_size=32, strategy="group", dynamic=False, scale_dtype="torch.uint8"),
            _args(8, group_size=32, strategy="group", dynamic=True, scale_dtype="torch.uint8"),
        ),
        QuantScheme(
            "ct-mxfp4", "compressed-tensors", "mxfp4", (1, 32), "weight_packed", "weight_scale", torch.uint8,
            "mxfp4-pack-quantized",
            _args(4, group_size=32, strategy="group", dynamic=False, scale_dtype="torch.uint8"),
            _args(4, group_size=32, strategy="group", dynamic=True, scale_dtype="torch.uint8"),
        ),
        QuantScheme(
            "ct-nvfp4", "compressed-tensors", "nvfp4_divisor", (1, 16), "weight_packed", "weight_scale",
            torch.float8_e4m3fn, "nvfp4-pack-quantized",
            _args(4, group_size=16, strategy="tensor_group", dynamic=False, scale_dtype="torch.float8_e4m3fn"),
            None,
        ),
    )
}  # fmt: skip
"""The ``--quantize`` schemes by name."""

GLOBAL_SCALE_NAME = "weight_global_scale"


@dataclass(frozen=True, slots=True)
class ExportPart:
    """Output tensor ``spec``: from elements ``[start, ...)`` of checkpoint tensor ``key``'s flattening.

    ``role`` is ``"plain"`` (the elements as they are, ``spec.shape`` of them); for a weight quantized with
    ``scheme``, ``"data"``, ``"scale"`` or ``"global"``: computed from the ``source_shape`` elements there (a
    2-D weight); for a saved scaled tensor written as it is (:mod:`reshard.models.hf_scaled`), ``"as_is"``
    (its data, scales or global scale as saved) or ``"cast"`` (scales converted exactly to ``spec.dtype``).
    """

    spec: TensorSpec
    key: str
    start: int
    role: str = "plain"
    source_shape: tuple[int, ...] = ()


def is_quantized_weight(name: str) -> bool:
    """Whether the Hugging Face tensor ``name`` is a weight the schemes quantize (see the module doc)."""
    return _QUANTIZED_MODULE.search(name) is not None


def check_source_format(key: str, saved: tuple[str, Block] | None, dtype: torch.dtype, scheme: QuantScheme) -> bool:
    """Whether checkpoint tensor ``key`` is quantized by the export (False: it is a scaled tensor of the
    scheme's format already, written as it is where its blocks are the scheme's: see
    :mod:`reshard.models.hf_scaled`).

    Raises:
        MismatchError: the tensor is a scaled tensor of another format (naming both; nothing is requantized),
            or a plain tensor that is not float32, bfloat16 or float16.
    """
    if saved is not None:
        if saved[0] == scheme.fmt:
            return False
        raise MismatchError(
            f"tensor {key!r} is saved as format {saved[0]} with blocks {list(saved[1])}; --quantize {scheme.name} "
            f"writes format {scheme.fmt} with blocks {list(scheme.block)}, and a low-precision tensor is not "
            "requantized (export it without --quantize, or with the scheme of its own format)"
        )
    if dtype not in _HIGH_PRECISION:
        raise MismatchError(
            f"tensor {key!r} is {str(dtype).removeprefix('torch.')}, not float32, bfloat16 or float16: --quantize "
            f"{scheme.name} quantizes high-precision weights and does not requantize low-precision ones"
        )
    return True


def check_shape(name: str, shape: tuple[int, ...], scheme: QuantScheme) -> None:
    rows, cols = shape
    if scheme.consumer == "transformers" and (rows % 128 or cols % 128):
        raise MismatchError(
            f"{name} has shape {list(shape)}, which 128x128 blocks do not divide: transformers' FineGrainedFP8 "
            "dequantization would misplace the partial blocks (ct-fp8-block128 writes them for compressed-tensors)"
        )
    last = scheme.block[-1]
    if last is not None and last > 1 and scheme.block[0] == 1 and cols % last:
        raise MismatchError(
            f"{name} has {cols} columns, not a multiple of the {last}-element groups of --quantize {scheme.name}"
        )


def quantized_parts(spec: TensorSpec, key: str, start: int, scheme: QuantScheme) -> list[ExportPart]:
    """The output tensors of the 2-D weight ``spec`` (elements from ``start`` of checkpoint tensor ``key``)
    quantized with ``scheme``: data, scales and (NVFP4) the global scale.

    Raises:
        MismatchError: a shape the scheme cannot hold.
    """
    shape = tuple(spec.shape)
    check_shape(spec.name, shape, scheme)
    fmt = scale_format(scheme.fmt)
    base = spec.name.removesuffix("weight")
    stored = (shape[0], shape[1] // fmt.elements_per_item)
    data_dtype = torch.uint8 if fmt.elements_per_item == 2 else fmt.data_dtypes[0]
    parts = [
        ExportPart(TensorSpec(name=base + scheme.data_name, dtype=data_dtype, shape=stored), key, start, "data", shape),
        ExportPart(
            TensorSpec(
                name=base + scheme.scale_name,
                dtype=scheme.scale_dtype or spec.dtype,
                shape=scale_grid_shape(shape, scheme.block),
            ),
            key,
            start,
            "scale",
            shape,
        ),
    ]
    if fmt.global_scale is not None:
        parts.append(
            ExportPart(
                TensorSpec(name=base + GLOBAL_SCALE_NAME, dtype=torch.float32, shape=(1,)), key, start, "global", shape
            )
        )
    return parts


def quantization_config(scheme: QuantScheme, kept: list[str]) -> dict[str, object]:
    """config.json's ``quantization_config`` for ``scheme``; ``kept``: the modules left in high precision."""
    if scheme.consumer == "transformers":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(scheme.block),
            "modules_to_not_convert": kept,
        }
    group: dict[str, object] = {
        "targets": ["Linear"],
        "weights": dict(scheme.ct_weights),
        "input_activations": None if scheme.ct_activations is None else dict(scheme.ct_activations),
        "output_activations": None,
        "format": scheme.ct_format,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": scheme.ct_format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": kept,
        "kv_cache_scheme": None,
    }


def _strips(reader: CheckpointReader, part: ExportPart, rows_per_block: int, slab_bytes: int) -> Iterator[torch.Tensor]:
    """The source weight of ``part`` as strips of whole block rows (at most ``slab_bytes``, at least one block
    row), each a (rows, cols) view of the reader's slab buffer, valid until the next strip."""
    rows, cols = part.source_shape
    dtype = reader.tensor(part.key).torch_dtype
    per_strip = max(1, slab_bytes // max(1, cols * dtype.itemsize * rows_per_block)) * rows_per_block
    for r0 in range(0, rows, per_strip):
        count = min(per_strip, rows - r0)
        buffer = reader.slab_buffer(count * cols * dtype.itemsize).view(dtype)[: count * cols]
        reader.read_flat(part.key, part.start + r0 * cols, buffer)
        yield buffer.view(count, cols)


def _global_scale(reader: CheckpointReader, part: ExportPart, scheme: QuantScheme, slab_bytes: int) -> torch.Tensor:
    """The NVFP4 global scale of ``part``'s weight, from the amax of all its strips (one pass)."""
    amax = torch.zeros((), dtype=torch.float32)
    for strip in _strips(reader, part, 1, slab_bytes):
        amax = torch.maximum(amax, block_amax(strip, scheme.fmt, scheme.block).amax())
    return global_scale_from_amax(amax, scheme.fmt)


def write_quantized(
    reader: CheckpointReader,
    writer: SafetensorsWriter,
    part: ExportPart,
    scheme: QuantScheme,
    slab_bytes: int,
    advance: Callable[[int], None] | None = None,
    global_scales: dict[tuple[str, int], torch.Tensor] | None = None,
) -> None:
    """Write the tensor ``part`` (role data, scale or global) of a weight quantized with ``scheme``, strip by
    strip (see the module doc). The caller ends the tensor. ``global_scales``: NVFP4 global scales by the
    weight's ``(key, start)``, filled and reused across a weight's parts (one amax pass per weight); None:
    computed for this part alone."""
    fmt = scale_format(scheme.fmt)
    global_scale = None
    if fmt.global_scale is not None:
        weight = (part.key, part.start)
        cached = None if global_scales is None else global_scales.get(weight)
        global_scale = cached if cached is not None else _global_scale(reader, part, scheme, slab_bytes)
        if global_scales is not None:
            global_scales[weight] = global_scale
    if part.role == "global":
        assert global_scale is not None
        writer.write(global_scale.reshape(1))
        return
    scale_dtype = scheme.scale_dtype or reader.tensor(part.key).torch_dtype
    for strip in _strips(reader, part, scheme.block[0] or part.source_shape[0], slab_bytes):
        scale = scales_from_amax(block_amax(strip, fmt, scheme.block), fmt, global_scale)
        written = scale.view(torch.uint8) if scale_dtype == torch.uint8 else scale.to(scale_dtype)
        if part.role == "scale":
            out = written
        else:  # FP8 data divided by the written scale (rounded to the weight's dtype), as its consumer multiplies
            used = written.to(torch.float32) if scale.dtype == torch.float32 else scale
            out = quantize_with_scales(strip, used, fmt, scheme.block, global_scale)
        writer.write(out)
        if advance is not None:
            advance(out.numel() * out.element_size())
