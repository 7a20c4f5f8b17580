"""Save a tensor-parallel layer on 4 ranks, load it on 2 ranks split along the other axis.

Run: python examples/quickstart.py ckpt
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reshard

GLOBAL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)  # the full weight, for checking


def state_of_4(rank: int) -> dict[str, Any]:
    """What rank ``rank`` of the 4 saving ranks holds."""
    local_rows = GLOBAL[rank * 2 : rank * 2 + 2].clone()  # row-parallel: 2 of 8 rows per rank
    return {
        "weight": reshard.ShardedTensor.from_rank_offsets("layer.weight", local_rows, (0, rank, 4)),
        "bias": torch.ones(6),  # a plain tensor: replicated on every rank, written once
        "step": 100,  # common state, written once by rank 0
    }


def save_on_4(rank: int, path: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    state = state_of_4(rank)
    reshard.save(state, path, overwrite=True)  # a second run replaces the first run's checkpoint, atomically
    dist.destroy_process_group()


def load_on_2(rank: int, path: str, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    local_columns = torch.empty(8, 3)  # column-parallel now: 3 of 6 columns per rank
    template = {
        "weight": reshard.ShardedTensor.from_rank_offsets("layer.weight", local_columns, (1, rank, 2)),
        "bias": torch.empty(6),
        "step": 0,
    }
    stats = reshard.LoadStats()
    loaded = reshard.load(template, path, stats=stats)
    assert torch.equal(loaded["weight"], GLOBAL[:, rank * 3 : rank * 3 + 3])
    assert loaded["step"] == 100
    line = (
        f"rank {rank}: loaded columns {rank * 3}..{rank * 3 + 2}, read {stats.bytes_read} of "
        f"{stats.bytes_needed} needed bytes in {stats.read_requests} requests\n"
    )
    sys.stdout.write(line)  # one write: the two ranks' lines never interleave
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "quickstart-checkpoint"
    port = 29000 + os.getpid() % 1000
    mp.spawn(save_on_4, args=(path, port), nprocs=4)
    mp.spawn(load_on_2, args=(path, port + 1), nprocs=2)
    print(f"saved on 4 ranks, loaded on 2: {path}")
