"""Helpers for testing and benchmarking reshard: simulated layouts of large models, without tensor data.

Nothing here is needed to save or load a checkpoint; it is shipped so that tests and benchmarks (and
users who want to check how reshard behaves on their own layout at scale) can drive the real planning
code on descriptions of thousands of ranks in one process.

:mod:`reshard.testing.storage` holds the storage contract as a pytest suite (``StorageContract``) for authors of
a storage backend; it imports pytest, so it is not imported here.
"""

from __future__ import annotations

from reshard.testing.layouts import MegatronLayout, MoETransformer, Parallelism, RankCoords, ShardSpec

__all__ = ["MegatronLayout", "MoETransformer", "Parallelism", "RankCoords", "ShardSpec"]
