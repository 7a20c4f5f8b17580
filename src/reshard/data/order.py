"""The global order of an epoch and sets of positions in it.

An epoch's *global order* is the permutation of a map-style dataset's ``N`` indices that torch's
``DistributedSampler`` draws (``torch.randperm(N)`` from a generator seeded ``seed + epoch``, or
``range(N)`` without shuffling). A *position* is an index into that order, the same on every layout: the
data state reshard saves is the set of positions consumed in the epoch, so that any number of ranks can
take the rest. A set of positions is kept as sorted disjoint half-open intervals (a prefix is one interval),
stored as an ``(k, 2)`` int64 tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from reshard.errors import DataStateError

MAX_EPOCH = 2**63 - 1
"""The largest epoch a saved value may hold (an int64, as torch and the stored values keep it)."""

SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds ``torch.Generator.manual_seed`` takes: an epoch's order is drawn with ``seed + epoch``."""


def generator_seed(seed: int, epoch: int, *, where: str) -> int:
    """``seed + epoch``, the seed of an epoch's order, checked so that torch's generator takes it: the epoch
    in ``[0, MAX_EPOCH]`` and the sum in :data:`SEED_RANGE`; DataStateError naming ``where`` otherwise (a
    restore checks this so that a hostile value fails there, not at the first iteration with a ValueError)."""
    if not 0 <= epoch <= MAX_EPOCH:
        raise DataStateError(f"{where}: epoch is {epoch}, outside [0, 2**63 - 1]")
    low, high = SEED_RANGE
    if not low <= seed + epoch <= high:
        raise DataStateError(
            f"{where}: seed {seed} + epoch {epoch} is outside [-2**63, 2**64 - 1], the seeds torch's generator takes"
        )
    return seed + epoch


def epoch_order(size: int, *, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The dataset indices of an epoch in torch's ``DistributedSampler`` order (int64, length ``size``)."""
    if not shuffle:
        return torch.arange(size, dtype=torch.int64)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator)


@dataclass(frozen=True)
class Positions:
    """A set of positions of an epoch's order: sorted, disjoint, non-adjacent half-open intervals."""

    intervals: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of(positions: Iterable[int]) -> Positions:
        """The set of the given positions (any order, repeats allowed)."""
        ordered = sorted({int(p) for p in positions})
        merged: list[tuple[int, int]] = []
        for p in ordered:
            if merged and merged[-1][1] == p:
                merged[-1] = (merged[-1][0], p + 1)
            else:
                merged.append((p, p + 1))
        return Positions(tuple(merged))

    @staticmethod
    def prefix(count: int) -> Positions:
        """Positions ``0 .. count-1`` (one interval)."""
        return Positions(((0, count),)) if count > 0 else Positions()

    @property
    def count(self) -> int:
        """How many positions the set holds."""
        return sum(stop - start for start, stop in self.intervals)

    def union(self, other: Positions) -> Positions:
        """The positions of either set."""
        pairs = sorted(self.intervals + other.intervals)
        merged: list[tuple[int, int]] = []
        for start, stop in pairs:
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
            else:
                merged.append((start, stop))
        return Positions(tuple(merged))

    @staticmethod
    def from_mask(taken: torch.Tensor) -> Positions:
        """The set of the True entries of a bool tensor (vectorised: for sets of millions of positions)."""
        edges = torch.diff(
            taken.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8), append=torch.zeros(1, dtype=torch.int8)
        )
        starts = torch.nonzero(edges == 1).flatten().tolist()
        stops = torch.nonzero(edges == -1).flatten().tolist()
        return Positions(tuple(zip(starts, stops, strict=True)))

    def mask(self, size: int) -> torch.Tensor:
        """A bool tensor of length ``size``, True at the set's positions."""
        taken = torch.zeros(size, dtype=torch.bool)
        for start, stop in self.intervals:
            taken[start:stop] = True
        return taken

    def remaining(self, size: int) -> torch.Tensor:
        """The positions of ``[0, size)`` not in the set, increasing (int64)."""
        return torch.nonzero(~self.mask(size), as_tuple=False).flatten()

    def to_tensor(self) -> torch.Tensor:
        """The ``(k, 2)`` int64 tensor of the intervals, the stored form."""
        return torch.tensor(self.intervals, dtype=torch.int64).reshape(-1, 2)

    @staticmethod
    def from_tensor(value: object, size: int, *, where: str) -> Positions:
        """The set a stored ``(k, 2)`` int64 tensor holds, checked: within ``[0, size)``, each interval
        non-empty, sorted and disjoint. DataStateError naming ``where`` otherwise."""
        if not isinstance(value, torch.Tensor) or value.dtype != torch.int64 or value.dim() != 2:
            raise DataStateError(f"{where}: the consumed positions must be a (k, 2) int64 tensor, not {_kind(value)}")
        if value.shape[1] != 2:
            raise DataStateError(f"{where}: the consumed positions have shape {tuple(value.shape)}, not (k, 2)")
        if value.device.type != "cpu":
            raise DataStateError(f"{where}: the consumed positions are on {value.device}, not the CPU")
        pairs = [(int(a), int(b)) for a, b in value.tolist()]
        previous = -1
        for start, stop in pairs:
            if not 0 <= start < stop <= size:
                raise DataStateError(
                    f"{where}: the consumed interval [{start}, {stop}) is empty or outside the epoch [0, {size})"
                )
            if start <= previous:
                raise DataStateError(
                    f"{where}: the consumed intervals overlap or are out of order at [{start}, {stop})"
                )
            previous = stop
        return Positions(()).union(Positions(tuple(pairs)))


def _kind(value: object) -> str:
    """How an error names a value that has the wrong type."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
