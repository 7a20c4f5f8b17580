"""The demo's data: a dataset of token sequences read in an epoch order that survives a change of layout.

The dataset holds ``epoch_samples`` sequences (sample ``i`` is an arithmetic progression modulo the vocabulary
whose start and stride are drawn from a generator seeded with ``data_seed`` and ``i``, which a small model can
learn). Each epoch reads them in the order of torch's ``DistributedSampler`` (a permutation seeded with
``data_seed + epoch``), and step ``s`` of an uninterrupted run trains on the ``global_batch`` samples at
positions ``[s * global_batch, (s + 1) * global_batch)`` of its epoch's order, whatever the layout: each
data-parallel rank takes its share through a :class:`reshard.data.ElasticSampler` (positions ``r, r + dp, ...``
of what is left). So every layout trains on the same samples at the same step, and a resume on another
data-parallel size (the sampler's consumed positions saved with :func:`reshard.data.capture`) trains on exactly
the samples an uninterrupted run on the new layout would, each sample of the epoch once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from reshard.data import ElasticSampler, capture, epoch_order, restore
from reshard.state.sharding import ShardedObject

if TYPE_CHECKING:
    from reshard.demo.training import TrainingConfig
    from reshard.models.config import ModelConfig
    from reshard.net.transports import Group

__all__ = ["DataStream", "DemoDataset", "global_batch"]


class DemoDataset(Dataset[torch.Tensor]):
    """``epoch_samples`` token sequences ``[seq_len + 1]``, each a function of its index only."""

    def __init__(self, model: ModelConfig, training: TrainingConfig) -> None:
        self.vocab_size = model.vocab_size
        self.length = model.seq_len + 1
        self.seed = training.data_seed
        self.size = training.epoch_samples

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} of a dataset of {self.size}")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start = torch.randint(0, self.vocab_size, (1,), generator=generator)
        stride = torch.randint(1, 5, (1,), generator=generator)
        return (start + stride * torch.arange(self.length)) % self.vocab_size

    def batch(self, indices: list[int]) -> torch.Tensor:
        """The samples ``indices``, stacked ``[len(indices), seq_len + 1]``."""
        return torch.stack([self[i] for i in indices])


def global_batch(step: int, model: ModelConfig, training: TrainingConfig) -> torch.Tensor:
    """The token sequences step ``step`` of an uninterrupted run trains on (``[global_batch, seq_len + 1]``,
    in the epoch's order), on any layout."""
    dataset = DemoDataset(model, training)
    steps_per_epoch = training.epoch_samples // training.global_batch
    epoch, within = divmod(step, steps_per_epoch)
    start = within * training.global_batch
    order = epoch_order(len(dataset), seed=dataset.seed, epoch=epoch, shuffle=True).tolist()
    return dataset.batch(order[start : start + training.global_batch])


class DataStream:
    """One rank's reading of the dataset: its share of each epoch, ``per_rank`` samples a step.

    ``dp`` and ``dp_rank`` are the rank's data-parallel size and coordinate (ranks of one data-parallel
    coordinate read the same samples)."""

    def __init__(self, model: ModelConfig, training: TrainingConfig, *, dp: int, dp_rank: int) -> None:
        self.dataset = DemoDataset(model, training)
        self.per_rank = training.global_batch // dp
        self.sampler = ElasticSampler(
            self.dataset, num_replicas=dp, rank=dp_rank, shuffle=True, seed=training.data_seed, drop_last=True
        )
        self._start_reading()

    @property
    def epoch(self) -> int:
        """The epoch being read (the sampler's)."""
        return self.sampler.epoch

    def _start_reading(self) -> None:
        self.order = list(self.sampler)
        self.taken = 0

    def next_indices(self) -> list[int]:
        """The sample indices of this rank's next step (the next epoch's first when this one is read)."""
        if self.taken + self.per_rank > len(self.order):
            self.sampler.set_epoch(self.epoch + 1)
            self._start_reading()
        indices = self.order[self.taken : self.taken + self.per_rank]
        self.taken += self.per_rank
        return indices

    def next_batch(self) -> tuple[list[int], torch.Tensor]:
        """This rank's next step: its sample indices and their token sequences."""
        indices = self.next_indices()
        return indices, self.dataset.batch(indices)

    def skip_to(self, consumed_samples: int) -> None:
        """Stand where an uninterrupted run stands after ``consumed_samples`` samples (a multiple of the global
        batch): its epoch, and this rank's share of the epoch's first ``consumed_samples % epoch_samples``
        positions read. For a fresh stream (nothing restored)."""
        epoch, within = divmod(consumed_samples, len(self.dataset))
        self.sampler.set_epoch(epoch)
        self._start_reading()
        self.taken = within // self.sampler.num_replicas

    def position(self) -> str:
        """Where the stream stands, for people: ``"epoch 1, 32 of 48 read"``."""
        read = len(self.dataset) - (len(self.order) - self.taken) * self.sampler.num_replicas
        return f"epoch {self.epoch}, {read} of {len(self.dataset)} read"

    def captured(self, group: Group) -> ShardedObject:
        """The job's reading position in global terms, for the checkpoint. Collective over ``group`` (the
        layout: every rank calls it)."""
        return capture(self.sampler, key="data", group=group, consumed=self.taken)

    def restore(self, value: Any) -> None:
        """Continue from a captured position (saved on any layout): this rank reads its share of what is left
        of the saved epoch, then the next epochs."""
        restore(value, self.sampler)
        self._start_reading()
