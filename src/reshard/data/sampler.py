"""``ElasticSampler``: torch's ``DistributedSampler`` that can resume an epoch on any number of ranks.

Unchanged, it yields exactly what ``DistributedSampler`` yields (a drop-in replacement). It also holds the
epoch's *consumed positions* (:class:`~reshard.data.order.Positions`, set by :func:`reshard.data.restore`
or by ``load_state_dict``): an iteration then yields the REMAINING positions of the epoch's global order in
increasing order, dealt round-robin over the ranks (``remaining[rank::num_replicas]``), with
``DistributedSampler``'s tail rule (``drop_last``: truncated to a multiple of ``num_replicas``; else padded
with positions from the start of the epoch's order). A resume whose consumed set is a prefix of ``C``
positions (``C`` a multiple of the new ``num_replicas``) thus yields exactly what an uninterrupted run at the
new layout yields from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from reshard.data.order import Positions, epoch_order, generator_seed
from reshard.errors import DataStateError


def dealt_positions(size: int, world: int, consumed: Positions, drop_last: bool) -> torch.Tensor:
    """The positions ``world`` ranks deal round-robin (rank ``r`` takes ``[r::world]``) when ``consumed``
    of the epoch's ``size`` positions are taken already: the remaining ones in increasing order, with
    ``DistributedSampler``'s tail rule (truncated to a multiple of ``world``, or padded cyclically with the
    epoch's first positions)."""
    remaining = consumed.remaining(size)
    count = int(remaining.numel())
    if drop_last:
        return remaining[: (count // world) * world]
    padding = -count % world
    return torch.cat([remaining, torch.arange(padding, dtype=torch.int64) % max(size, 1)])


def share(size: int, world: int, consumed: Positions, drop_last: bool) -> int:
    """How many positions each of ``world`` ranks takes (see :func:`dealt_positions`), by arithmetic: the same
    for every rank, as the tail rule makes the dealt positions a multiple of ``world``."""
    left = size - consumed.count
    return left // world if drop_last else -(-left // world)


def rank_positions(size: int, world: int, rank: int, consumed: Positions, drop_last: bool) -> torch.Tensor:
    """The positions rank ``rank`` of ``world`` takes, in order (see :func:`dealt_positions`)."""
    return dealt_positions(size, world, consumed, drop_last)[rank::world]


class ElasticSampler(DistributedSampler[int]):
    """``DistributedSampler`` (same constructor, same sequence when nothing was consumed) whose epoch can be
    resumed on another number of ranks; see the module's docstring for the order it yields.

    ``set_epoch(e)`` with a new epoch clears the consumed positions; with the current epoch it keeps them
    (a trainer calls ``set_epoch`` again after a resume). It implements torchdata's ``Stateful`` protocol
    (``state_dict``/``load_state_dict``: the epoch, its consumed positions and how many indices the current
    iteration has drawn), so that ``StatefulDataLoader.load_state_dict`` resumes it on the same layout.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self._consumed = Positions()
        self._skip = 0
        self._drawn = 0
        self._iter_epoch: int | None = None

    @property
    def size(self) -> int:
        """The dataset's number of samples (the epoch's number of positions)."""
        return len(self.dataset)  # type: ignore[arg-type]

    @property
    def consumed_positions(self) -> Positions:
        """The positions of the epoch consumed before the current iteration began (by earlier ranks'
        work, restored); what this rank's iteration yields is not counted here."""
        return self._consumed

    @property
    def drawn(self) -> int:
        """How many indices the current iteration of the current epoch has yielded (0 when the last
        iteration belongs to another epoch)."""
        if self._skip:
            return self._skip
        return self._drawn if self._iter_epoch == self.epoch else 0

    @property
    def iterated_this_epoch(self) -> bool:
        """Whether the current iteration (begun, or restored by ``load_state_dict``) is of the current epoch."""
        return self._iter_epoch == self.epoch

    def positions(self) -> torch.Tensor:
        """The positions of the epoch's order this rank yields, in order (int64)."""
        return rank_positions(self.size, self.num_replicas, self.rank, self._consumed, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; a new epoch clears the consumed positions, the current one keeps them."""
        if epoch != self.epoch:
            self._consumed = Positions()
            self._skip = 0
        super().set_epoch(epoch)

    def resume(self, epoch: int, consumed: Positions) -> None:
        """Start ``epoch`` with ``consumed`` taken: the next iteration yields this rank's share of the rest."""
        if consumed.intervals and consumed.intervals[-1][1] > self.size:
            raise DataStateError(f"consumed positions beyond the dataset's {self.size} samples")
        generator_seed(self.seed, epoch, where="ElasticSampler")  # before anything changes
        self.epoch = epoch
        self._consumed = consumed
        self._skip = 0
        self._drawn = 0
        self._iter_epoch = None

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.size, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        indices: list[int] = order[self.positions()].tolist()
        skip, self._skip = self._skip, 0
        self._drawn = skip
        self._iter_epoch = self.epoch
        return self._yield(indices, skip)

    def _yield(self, indices: list[int], skip: int) -> Iterator[int]:
        for index in indices[skip:]:
            self._drawn += 1
            yield index

    def __len__(self) -> int:
        return share(self.size, self.num_replicas, self._consumed, self.drop_last)

    def state_dict(self) -> dict[str, Any]:
        """torchdata's ``Stateful``: the epoch, its consumed positions (``[[start, stop], ...]``) and how
        many indices the current iteration drew (``yielded``)."""
        return {
            "epoch": self.epoch,
            "consumed": [list(pair) for pair in self._consumed.intervals],
            "yielded": self.drawn,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torchdata's ``Stateful``: the next iteration resumes the saved one (same layout): same epoch and
        consumed positions, the first ``yielded`` indices skipped. DataStateError for a malformed state."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"epoch", "consumed", "yielded"}:
            raise DataStateError(f"ElasticSampler.load_state_dict: not an ElasticSampler state: {state_dict!r:.200}")
        epoch, pairs, yielded = state_dict["epoch"], state_dict["consumed"], state_dict["yielded"]
        if type(epoch) is not int or type(yielded) is not int or yielded < 0 or not isinstance(pairs, list):
            raise DataStateError(f"ElasticSampler.load_state_dict: bad epoch/yielded/consumed: {state_dict!r:.200}")
        try:
            table = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise DataStateError(f"ElasticSampler.load_state_dict: consumed is not a list of pairs: {exc}") from exc
        consumed = Positions.from_tensor(table, self.size, where="ElasticSampler.load_state_dict")
        mine = share(self.size, self.num_replicas, consumed, self.drop_last)
        if yielded > mine:  # checked before anything changes
            raise DataStateError(f"ElasticSampler.load_state_dict: {yielded} yielded of {mine} positions")
        self.resume(epoch, consumed)
        self._skip = yielded
        self._drawn = yielded
        self._iter_epoch = epoch
