"""A transfer that quantizes on the way: a high-precision source (float32, bfloat16, float16) of a key
whose target template is a :class:`~reshard.ScaledTensor` (FP8 per-tensor / per-row / 2-D blocks, MXFP8,
MXFP4, NVFP4).

The target template saying ScaledTensor is the user's request to quantize (a plain target of a
high-precision source is never quantized, and a plain low-precision source is never taken as scaled
data). Only low-precision data and scales travel:

1. Planning (the coordinator, :func:`find_jobs` and :func:`rewrite`): each such (source key, format,
   block) is a *job*. Every holder of a source piece is given *virtual* pieces of the quantized tensor: the
   data of its box (bytes for packed FP4, whose box must hold whole bytes), the scale cells whose first
   element lies in its box, and the global scale where its box holds the origin. The targets' parts are
   planned from these virtual keys as from any source (:func:`reshard.planning.exchange.schedule_transfer`).
2. Amax (:func:`reduce_amax`, one collective on the transfer's group, called by every rank): each rank
   computes the amax of every block its pieces touch; the blocks its box cuts (shared with other senders)
   and, for the NVFP4 formats, the whole tensor's amax are combined on the coordinator (a max, NaN winning)
   and sent back to every rank.
3. Quantization (:func:`quantize_pieces`, local): each holder computes the scales of its blocks from the
   combined amaxes (:func:`reshard.state.quantize.scales_from_amax`) and quantizes its own box with them
   (:func:`reshard.state.quantize.quantize_with_scales`): elementwise, so every receiver gets exactly the
   bytes :func:`reshard.state.quantize.quantize` gives on the whole high-precision tensor.

A :class:`~reshard.TransferSession` does not send deltas of quantized keys (a changed element can change
the scale of a block another sender quantizes, and for NVFP4 every block): ``delta=True`` there is a
CheckpointError on every rank.
"""

from __future__ import annotations

import base64
import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard.errors import MismatchError, ShardingError
from reshard.geometry.boxes import Box
from reshard.state.dtypes import dtype_name
from reshard.state.lowprec import Block, ScaleFormat, scale_format, scale_grid_shape, stored_block
from reshard.state.quantize import (
    INPUT_DTYPE_NAMES,
    block_amax,
    global_scale_from_amax,
    quantize_with_scales,
    scales_from_amax,
)
from reshard.state.scaled import GLOBAL_SCALE_SUFFIX, SCALE_SUFFIX, stored_view
from reshard.state.sharding import LocalPiece

__all__ = [
    "Job",
    "find_jobs",
    "quantize_pieces",
    "reduce_amax",
    "rewrite",
    "virtual_holdings",
]


@dataclass(frozen=True, slots=True)
class Job:
    """One source key quantized to one format and block (per logical axis, None: the whole axis).

    ``vkey`` names the quantized tensor in the plan (its parts: ``vkey``, ``vkey:scale``,
    ``vkey:global_scale``); ``shape`` is the source's global (logical) shape."""

    key: str
    vkey: str
    format: str
    block: Block
    shape: tuple[int, ...]

    def to_json(self) -> list[Any]:
        return [self.key, self.vkey, self.format, list(self.block), list(self.shape)]

    @classmethod
    def from_json(cls, doc: list[Any]) -> Job:
        return cls(doc[0], doc[1], doc[2], tuple(doc[3]), tuple(doc[4]))

    @property
    def spec(self) -> ScaleFormat:
        return scale_format(self.format, key=self.key)

    def stored_shape(self) -> tuple[int, ...]:
        """The quantized data's global shape as stored (packed FP4: the last axis in bytes)."""
        return _stored_box(self, Box((0,) * len(self.shape), self.shape)).shape

    def grid_shape(self) -> tuple[int, ...]:
        return scale_grid_shape(self.stored_shape(), stored_block(self.spec, self.block))


def _stored_box(job: Job, box: Box) -> Box:
    per = job.spec.elements_per_item
    if per == 1 or not box.shape:
        return box
    return Box((*box.offset[:-1], box.offset[-1] // per), (*box.shape[:-1], box.shape[-1] // per))


def _sizes(job: Job) -> tuple[int, ...]:
    """The block along each axis in logical elements, a whole-axis block as the axis's length."""
    return tuple(n if b is None else b for n, b in zip(job.shape, job.block, strict=True))


def _corner_cells(job: Job, box: Box) -> Box:
    """The scale cells whose block's first element lies in ``box``: each cell has one such holder among
    pieces that tile the tensor, so these boxes tile the scale grid as the pieces tile the data."""
    first = [-(-o // b) for o, b in zip(box.offset, _sizes(job), strict=True)]
    stop = [-(-(o + n) // b) for o, n, b in zip(box.offset, box.shape, _sizes(job), strict=True)]
    return Box(tuple(first), tuple(max(0, e - f) for f, e in zip(first, stop, strict=True)))


def _dtype_of(natural: torch.dtype) -> str:
    return dtype_name(stored_view(torch.empty(0, dtype=natural)).dtype)


def virtual_holdings(holdings: Sequence[list[Any]], jobs: Sequence[Job]) -> list[tuple[list[Any], int, str, int]]:
    """The virtual pieces a rank with source pieces ``holdings`` (``[key, offset, shape, dtype]``) holds:
    per job, per piece of its key in order, the data box, the scale cells (when any) and the global scale
    (NVFP4 formats, the piece that holds the origin). Each as ``(holding, source piece, part)``, part one of
    ``data``, ``scale``, ``global``, and the job's number). Pure: the coordinator and the rank compute the
    same list."""
    out: list[tuple[list[Any], int, str, int]] = []
    for j, job in enumerate(jobs):
        spec = job.spec
        for index, (key, offset, shape, _dtype) in enumerate(holdings):
            box = Box(tuple(offset), tuple(shape))
            if key != job.key or not box.volume:
                continue
            data = _stored_box(job, box)
            out.append(
                ([job.vkey, list(data.offset), list(data.shape), _dtype_of(spec.data_dtypes[0])], index, "data", j)
            )
            cells = _corner_cells(job, box)
            if cells.volume:
                scale = [
                    job.vkey + SCALE_SUFFIX,
                    list(cells.offset),
                    list(cells.shape),
                    _dtype_of(spec.scale_dtypes[0]),
                ]
                out.append((scale, index, "scale", j))
            if spec.global_scale is not None and all(o == 0 for o in box.offset):
                out.append(([job.vkey + GLOBAL_SCALE_SUFFIX, [], [], "float32"], index, "global", j))
    return out


def find_jobs(docs: list[dict[str, Any]]) -> list[Job]:
    """On the coordinator: the quantizing jobs of a transfer (every scaled target whose source key is held as
    a plain tensor of a high-precision dtype), checked.

    Raises:
        MismatchError: ranks that want one target name with different formats or blocks (naming the ranks).
        ShardingError: a packed-FP4 job whose source boxes cut a byte (an odd offset or length on the last
            axis), naming the key and the rank.
    """
    held = {key: value for d in docs for key, value in d["held"].items()}
    scaled_held = {key for d in docs for key in d.get("scaled_held", {})}
    wanted: dict[str, dict[tuple[str, str], list[int]]] = {}
    jobs: dict[str, Job] = {}
    for rank, doc in enumerate(docs):
        for name, (key, record) in sorted(doc.get("scaled_wanted", {}).items()):
            block = tuple(record["block"])
            wanted.setdefault(name, {}).setdefault((record["format"], str(list(block))), []).append(rank)
            if key in held and key not in scaled_held and held[key][1] in INPUT_DTYPE_NAMES:
                vkey = f"{key} quantized to {record['format']} blocks {list(block)}"
                jobs.setdefault(vkey, Job(key, vkey, record["format"], block, tuple(held[key][0])))
    differ = [
        f"{name!r}: " + "; ".join(f"ranks {ranks} want format {f} with blocks {b}" for (f, b), ranks in by.items())
        for name, by in sorted(wanted.items())
        if len(by) > 1
    ]
    if differ:
        raise MismatchError("transfer: the ranks want a target in different formats: " + "; ".join(differ[:10]))
    out = sorted(jobs.values(), key=lambda j: j.vkey)
    for job in out:
        _check_bytes(job, docs)
    return out


def _check_bytes(job: Job, docs: list[dict[str, Any]]) -> None:
    if job.spec.elements_per_item == 1:
        return
    for rank, doc in enumerate(docs):
        for key, offset, shape, _dtype in doc["holdings"]:
            if key == job.key and shape and (offset[-1] % 2 or shape[-1] % 2) and math.prod(shape):
                raise ShardingError(
                    f"transfer: {job.key!r} is quantized to {job.format} (two elements per byte), but rank {rank} "
                    f"holds the columns [{offset[-1]}, {offset[-1] + shape[-1]}): a box must start and end on an "
                    "even column"
                )


def rewrite(docs: list[dict[str, Any]], jobs: Sequence[Job]) -> list[dict[str, Any]]:
    """On the coordinator: the ranks' descriptions as the planner takes them, with every job's virtual
    pieces held (and recorded as a scaled source of the job's format) and the targets' parts wanted from
    them. The descriptions given are not changed."""
    by_target = {(job.key, job.format, tuple(job.block)): job for job in jobs}
    out = []
    for doc in docs:
        new = copy.deepcopy(doc)
        for holding, index, _part, _job in virtual_holdings(doc["holdings"], jobs):
            new["holdings"].append(holding)
            new["primary"].append(doc["primary"][index])
        for job in jobs:
            if job.key in doc["held"]:
                new["held"][job.vkey] = [list(job.stored_shape()), _dtype_of(job.spec.data_dtypes[0])]
                new["held"][job.vkey + SCALE_SUFFIX] = [list(job.grid_shape()), _dtype_of(job.spec.scale_dtypes[0])]
                if job.spec.global_scale is not None:
                    new["held"][job.vkey + GLOBAL_SCALE_SUFFIX] = [[], "float32"]
                global_key = job.vkey + GLOBAL_SCALE_SUFFIX if job.spec.global_scale else None
                record = {"format": job.format, "block": list(job.block), "scale": job.vkey + SCALE_SUFFIX}
                new["scaled_held"][job.vkey] = {**record, "global_scale": global_key}
        moved: dict[str, str] = {}  # target part name -> virtual key
        for name, (key, record) in doc.get("scaled_wanted", {}).items():
            wanted = by_target.get((key, record["format"], tuple(record["block"])))
            if wanted is None:
                continue
            new["scaled_wanted"][name] = [wanted.vkey, record]
            moved[name] = wanted.vkey
            moved[record["scale"]] = wanted.vkey + SCALE_SUFFIX
            if record["global_scale"] is not None:
                moved[record["global_scale"]] = wanted.vkey + GLOBAL_SCALE_SUFFIX
        new["wanted"] = [[n, moved.get(n, k), s, d] for n, k, s, d in doc["wanted"]]
        new["needs"] = [
            [new["wanted"][of][1], *need[1:]] if doc["wanted"][of][0] in moved else need
            for need, of in zip(doc["needs"], doc["need_of"], strict=True)
        ]
        out.append(new)
    return out


def _encode(values: torch.Tensor) -> str:
    return base64.b64encode(values.to(torch.float32).contiguous().numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    raw = base64.b64decode(text)
    return torch.frombuffer(bytearray(raw), dtype=torch.float32) if raw else torch.zeros(0)


@dataclass
class _Block:
    """One source piece's blocks: its high-precision box padded at the front to whole blocks, the amax of
    each block it touches (after :func:`reduce_amax`: the whole block's), and which cells it cuts."""

    piece: int
    padded: torch.Tensor
    front: tuple[int, ...]
    first: tuple[int, ...]
    amax: torch.Tensor
    cut: torch.Tensor


def _piece_blocks(job: Job, index: int, piece: LocalPiece) -> _Block:
    box = piece.box
    front, first, pads, cut_axes = [], [], [], []
    for o, n, b, size in zip(box.offset, box.shape, job.block, job.shape, strict=True):
        if b is None:
            front.append(0)
            first.append(0)
            cut_axes.append(torch.tensor([n != size]))
            continue
        front.append(o % b)
        first.append(o // b)
        cells = torch.arange(o // b, -(-(o + n) // b))
        cut_axes.append((cells * b < o) | (torch.clamp((cells + 1) * b, max=size) > o + n))
    for f in reversed(front):
        pads += [f, 0]
    padded = torch.nn.functional.pad(piece.view, pads) if any(front) else piece.view
    amax = block_amax(padded, job.spec, job.block)
    cut = torch.zeros(amax.shape, dtype=torch.bool)
    for axis, mask in enumerate(cut_axes):
        cut |= mask.reshape([-1 if a == axis else 1 for a in range(amax.ndim)])
    return _Block(index, padded, tuple(front), tuple(first), amax, cut)


def _flat_cells(job: Job, block: _Block) -> torch.Tensor:
    """The global (flattened) numbers of the cells ``block`` cuts, in the order of ``amax[cut]``."""
    local = torch.nonzero(block.cut)
    grid = job.grid_shape()
    strides = torch.tensor([math.prod(grid[a + 1 :]) for a in range(len(grid))], dtype=torch.int64)
    return ((local + torch.tensor(block.first, dtype=torch.int64)) * strides).sum(dim=1)


def _combine_job(parts: list[list[Any]]) -> list[Any]:
    """On the coordinator, for one job: the max over the ranks' amaxes of each cut cell (``parts``: per
    rank, its cells, their amaxes and its tensor amax, as :func:`reduce_amax`'s ``local`` sent them), NaN
    winning, in torch ops over all the cells at once; returned as the sorted cells, their maxima and the
    tensor's amax (empty where no rank holds a piece)."""
    cells = torch.cat([torch.tensor(rank_cells, dtype=torch.int64) for rank_cells, _v, _w in parts])
    values = torch.cat([_decode(v) for _c, v, _w in parts])
    order, where = torch.unique(cells, sorted=True, return_inverse=True)
    maxima = torch.full((order.numel(),), -math.inf).scatter_reduce(0, where, values, "amax")
    nan = torch.zeros(order.numel(), dtype=torch.bool).index_put_((where,), values.isnan(), accumulate=True)
    maxima[nan] = math.nan  # a NaN wins whatever the backend's max makes of it
    found = torch.cat([_decode(w) for _c, _v, w in parts])
    whole = found.amax().reshape(1) if found.numel() else torch.zeros(0)  # amax propagates NaN
    return [order.tolist(), _encode(maxima), _encode(whole)]


@dataclass
class Quantization:
    """This rank's part of a quantizing transfer: its pieces' blocks per job, and (after
    :func:`reduce_amax`) each job's global scale."""

    jobs: list[Job]
    blocks: list[list[_Block]]
    global_scales: list[torch.Tensor | None]


def reduce_amax(
    step: Callable[..., Any], jobs: Sequence[Job], sources: Sequence[LocalPiece], holdings: Sequence[list[Any]]
) -> Quantization:
    """The amaxes of every block this rank's source pieces touch, whole: the blocks a piece cuts (shared with
    other senders) and, for the NVFP4 formats, the tensor's amax are combined over the group by ``step``
    (the Communicator's agreed step: a gather on the coordinator and a broadcast, called by every rank of
    the transfer's group, those holding nothing included)."""
    blocks: list[list[_Block]] = []

    def local() -> list[list[Any]]:
        out = []
        for job in jobs:
            mine = [
                _piece_blocks(job, i, sources[i])
                for i, h in enumerate(holdings)
                if h[0] == job.key and sources[i].box.volume
            ]
            blocks.append(mine)
            cells = torch.cat([_flat_cells(job, b) for b in mine]).tolist() if mine else []
            values = torch.cat([b.amax[b.cut] for b in mine]) if mine else torch.zeros(0)
            whole = torch.stack([b.amax.amax() for b in mine]).amax().reshape(1) if mine else torch.zeros(0)
            out.append([cells, _encode(values), _encode(whole)])
        return out

    def combine(parts: list[list[list[Any]]]) -> list[list[Any]]:
        return [_combine_job([rank_parts[j] for rank_parts in parts]) for j in range(len(jobs))]

    combined = step("quantizing: block amaxes", local, combine)
    scales: list[torch.Tensor | None] = []
    for job, mine, (cells, values, whole) in zip(jobs, blocks, combined, strict=True):
        order, maxima = torch.tensor(cells, dtype=torch.int64), _decode(values)
        for block in mine:
            wanted = _flat_cells(job, block)
            if wanted.numel():  # every cell a rank cut is in the coordinator's sorted list
                found = maxima[torch.searchsorted(order, wanted)]
                block.amax[block.cut] = found.to(block.amax.device)
        tensor_amax = _decode(whole)
        amax = tensor_amax.reshape(()) if tensor_amax.numel() else torch.zeros(())
        scales.append(global_scale_from_amax(amax, job.spec) if job.spec.global_scale is not None else None)
    return Quantization(list(jobs), blocks, scales)


def quantize_pieces(quantization: Quantization, holdings: Sequence[list[Any]]) -> list[LocalPiece]:
    """This rank's virtual pieces (in :func:`virtual_holdings`' order): each source piece quantized with
    the scales of the whole blocks it touches, its scale cells and the global scale. Local."""
    made: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for j, (job, mine, g) in enumerate(
        zip(quantization.jobs, quantization.blocks, quantization.global_scales, strict=True)
    ):
        for block in mine:
            scale = scales_from_amax(block.amax, job.spec, g)
            data = quantize_with_scales(block.padded, scale, job.spec, job.block, g)
            per = job.spec.elements_per_item
            cut = tuple(slice(f // (per if a == data.ndim - 1 else 1), None) for a, f in enumerate(block.front))
            made[(j, block.piece)] = (data[cut] if cut else data, stored_view(scale))
    out = []
    for holding, piece, part, j in virtual_holdings(holdings, quantization.jobs):
        data, scale = made[(j, piece)]
        box = Box(tuple(holding[1]), tuple(holding[2]))
        if part == "data":
            view = data
        elif part == "scale":
            first = next(b.first for b in quantization.blocks[j] if b.piece == piece)
            view = scale[tuple(slice(o - f, o - f + n) for o, f, n in zip(box.offset, first, box.shape, strict=True))]
        else:
            g = quantization.global_scales[j]
            assert g is not None
            view = g.reshape(())
        out.append(LocalPiece(box, view))
    return out
