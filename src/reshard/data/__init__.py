"""Data state that survives a change of layout: samplers, data loaders, RNG streams and record buffers.

A resume on another data-parallel size restores the model and the optimizer bit for bit; this package does
the same for what the job reads: every sample of an epoch consumed exactly once over the whole job, RNG
streams under an explicit policy, and record buffers (RL rollouts) redistributed with every record once.
Per-rank state is described in global terms (a sample's position in the epoch's global order, a record's
global index) so that a load on another number of ranks can redistribute it; state whose global meaning
reshard cannot know is refused loudly (:class:`~reshard.errors.DataStateError`).
"""

from reshard.data.iterable import ShardedIterable
from reshard.data.iterable_state import capture_iterable, restore_iterable
from reshard.data.loaders import APPROXIMATIONS, RestoredData, capture, restore, template
from reshard.data.order import Positions, epoch_order
from reshard.data.records import FieldSpec, RecordBuffer
from reshard.data.records_load import load_records
from reshard.data.records_save import records_state
from reshard.data.rng import (
    PROCESS_GENERATORS,
    RNG_POLICIES,
    RestoredRng,
    RngPolicy,
    derive_seed,
    restore_rng,
    rng_state,
    rng_template,
    sample_generator,
)
from reshard.data.sampler import ElasticSampler

__all__ = [
    "APPROXIMATIONS",
    "PROCESS_GENERATORS",
    "RNG_POLICIES",
    "ElasticSampler",
    "FieldSpec",
    "Positions",
    "RecordBuffer",
    "RestoredData",
    "RestoredRng",
    "RngPolicy",
    "ShardedIterable",
    "capture",
    "capture_iterable",
    "derive_seed",
    "epoch_order",
    "load_records",
    "records_state",
    "restore",
    "restore_iterable",
    "restore_rng",
    "rng_state",
    "rng_template",
    "sample_generator",
    "template",
]
