"""Helpers for testing and benchmarking reshard: simulated layouts of large models, without tensor data.

Nothing here is needed to save or load a checkpoint; it is shipped so that tests and benchmarks (and
users who want to check how reshard behaves on their own layout at scale) can drive the real planning
code on descriptions of thousands of ranks in one process.
"""

from __future__ import annotations

from reshard.testing.layouts import MegatronLayout, MoETransformer, Parallelism, RankCoords, ShardSpec

__all__ = ["MegatronLayout", "MoETransformer", "Parallelism", "RankCoords", "ShardSpec"]
