"""The states the flows save, load and move: *generations* of one small training state, and the templates
that read them back.

Generation 1 is the state already committed before a flow runs (A), generation 2 the one the flow saves
or sends (B), generation 3 the one a follow-up save writes. ``frozen`` is the same in every generation (the
frozen base of a fine-tune), so that an incremental save of generation 2 references generation 1's bytes.
A load is matched against the generations bit for bit (:func:`generation_of`); anything else is a silent
wrong load.
"""

from __future__ import annotations

from typing import Any

import torch

ROWS, COLS = 12, 48  # divisible by 2, 3 and 4 ranks
FROZEN_ROWS = 16


def global_state(generation: int, world: int) -> dict[str, torch.Tensor]:
    """The global tensors of ``generation`` for a job of ``world`` ranks."""
    g = torch.Generator().manual_seed(1000 * generation + world)
    frozen = torch.Generator().manual_seed(7 + world)
    return {
        "w": torch.randn(world * ROWS, COLS, generator=g),
        "e": torch.randn(ROWS, world * 4, generator=g).to(torch.bfloat16),
        "bias": torch.randint(-(2**40), 2**40, (17,), generator=g, dtype=torch.int64),
        "frozen": torch.randn(world * FROZEN_ROWS, COLS, generator=frozen),
    }


def rank_state(rank: int, world: int, generation: int, *, objects: bool = True) -> dict[str, Any]:
    """What rank ``rank`` holds of ``generation``: rows of ``w`` and ``frozen``, columns of ``e``, the
    replicated ``bias``, a per-rank ShardedObject (unless ``objects`` is false: tiers that hold tensors
    only) and a common value."""
    import reshard

    full = global_state(generation, world)
    state: dict[str, Any] = {
        "w": reshard.ShardedTensor.from_rank_offsets(
            "w", full["w"][rank * ROWS : (rank + 1) * ROWS].clone(), (0, rank, world)
        ),
        "e": reshard.ShardedTensor.from_rank_offsets(
            "e", full["e"][:, rank * 4 : (rank + 1) * 4].clone(), (1, rank, world)
        ),
        "frozen": reshard.ShardedTensor.from_rank_offsets(
            "frozen", full["frozen"][rank * FROZEN_ROWS : (rank + 1) * FROZEN_ROWS].clone(), (0, rank, world)
        ),
        "bias": full["bias"].clone(),
        "step": generation,
    }
    if objects:
        state["rng"] = reshard.ShardedObject("rng", {"rank": rank, "generation": generation}, (world,), (rank,))
    return state


def single_process_state(generation: int, world: int) -> dict[str, Any]:
    """The same global content as :func:`rank_state` over ``world`` ranks, held by one process."""
    import reshard

    state: dict[str, Any] = dict(global_state(generation, world))
    state["rng"] = [
        reshard.ShardedObject("rng", {"rank": r, "generation": generation}, (world,), (r,)) for r in range(world)
    ]
    state["step"] = generation
    return state


def full_template(world: int, *, objects: bool = True) -> dict[str, Any]:
    """A template of every whole tensor (what one process loads to compare)."""
    import reshard

    template: dict[str, Any] = {
        "w": torch.zeros(world * ROWS, COLS),
        "e": torch.zeros(ROWS, world * 4, dtype=torch.bfloat16),
        "bias": torch.zeros(17, dtype=torch.int64),
        "frozen": torch.zeros(world * FROZEN_ROWS, COLS),
        "step": -1,
    }
    if objects:
        template["rng"] = reshard.ShardedObject("rng", None, (world,), (0,))
    return template


def column_template(rank: int, world: int, *, saved_world: int | None = None) -> dict[str, Any]:
    """Rank ``rank`` of ``world``'s part of another layout of the state of ``saved_world`` ranks (default
    ``world``): columns of ``w`` and ``frozen``, rows of ``e`` (a reshard of every tensor), the whole ``bias``."""
    import reshard

    saved = saved_world or world
    cols = COLS // world
    rows_e = ROWS // world
    return {
        "w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(saved * ROWS, cols), (1, rank, world)),
        "e": reshard.ShardedTensor.from_rank_offsets(
            "e", torch.zeros(rows_e, saved * 4, dtype=torch.bfloat16), (0, rank, world)
        ),
        "frozen": reshard.ShardedTensor.from_rank_offsets(
            "frozen", torch.zeros(saved * FROZEN_ROWS, cols), (1, rank, world)
        ),
        "bias": torch.zeros(17, dtype=torch.int64),
    }


def column_generation(
    loaded: dict[str, Any], rank: int, world: int, candidates: tuple[int, ...], *, saved_world: int | None = None
) -> int | None:
    """Which generation rank ``rank``'s :func:`column_template` holds, bit for bit (None: none of them)."""
    cols = COLS // world
    rows_e = ROWS // world
    for generation in candidates:
        want = global_state(generation, saved_world or world)
        parts = {
            "w": want["w"][:, rank * cols : (rank + 1) * cols],
            "e": want["e"][rank * rows_e : (rank + 1) * rows_e],
            "frozen": want["frozen"][:, rank * cols : (rank + 1) * cols],
            "bias": want["bias"],
        }
        if all(same_bits(_data(loaded[k]), v) for k, v in parts.items()):
            return generation
    return None


def _data(value: Any) -> torch.Tensor:
    return value.data if hasattr(value, "global_shape") else value


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and signed zeros included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))
    )


def generation_of(
    loaded: dict[str, Any], world: int, candidates: tuple[int, ...], *, objects: bool = True
) -> int | None:
    """Which generation ``loaded`` (a :func:`full_template` filled) is, bit for bit (None: none of them)."""
    for generation in candidates:
        want = global_state(generation, world)
        if not all(same_bits(loaded[k], v) for k, v in want.items()) or loaded["step"] != generation:
            continue
        if objects and loaded["rng"] != {"rank": 0, "generation": generation}:
            continue
        return generation
    return None
