"""Saves and loads through an HTTP fault proxy between the client (s3fs, gcsfs) and a real server (moto,
fake-gcs-server): resets, 5xx and 429 answers, slow answers, truncated bodies, ignored ``Range`` headers and
lost answers (a write that took effect, whose answer never arrived), mixed at random (seeded).

Each round saves a new state over the previous one (``overwrite=True``) through the faulty proxy, then loads
it through the proxy (directly, resharded, and through node-local staging) and through a clean connection.
Invariants: a save either succeeds (then every load that succeeds gives exactly its state) or fails with a
reshard error, and then the checkpoint is still exactly the last committed state, or this round's when its
commit did happen (a lost answer the retries could not settle); a load either gives exactly what the clean
connection sees or fails with a reshard error. Never other bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.storage import ObjectStorage, RetryPolicy

pytestmark = pytest.mark.dist

ROUNDS = 8
FAULTS = {"503": 1.0, "429": 1.0, "drop": 1.0, "drop_after": 1.0, "truncate": 1.0, "ignore_range": 0.5, "slow": 1.0}
RETRY = RetryPolicy(max_attempts=6, base_delay_s=0.005, max_delay_s=0.02)


def _state(generation: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(generation)
    return {"w": torch.randn(24, 40, generator=g), "b": torch.arange(7) * generation, "step": generation}


def _same(loaded: dict[str, Any], generation: int) -> bool:
    want = _state(generation)
    return (
        bool(torch.equal(loaded["w"], want["w"]) and torch.equal(loaded["b"], want["b"]))
        and loaded["step"] == generation
    )


def _whole() -> dict[str, Any]:
    return {"w": torch.zeros(24, 40), "b": torch.zeros(7, dtype=torch.int64), "step": -1}


def _generation(loaded: dict[str, Any], candidates: list[int]) -> int | None:
    return next((g for g in candidates if _same(loaded, g)), None)


def run_rounds(server: Any, proxy: Any, staging: Path, seed: int, rounds: int = ROUNDS) -> dict[str, int]:
    """The rounds of the module doc against ``server`` through ``proxy``; counts of what happened. Raises
    AssertionError on the first broken invariant."""
    bucket = server.new_bucket()
    url = f"{server.protocol}://{bucket}/ckpt"
    clean = ObjectStorage(url, server.options(), retry=RETRY)
    faulty = ObjectStorage(url, server.options(proxy.url), retry=RETRY)
    tried = {"saves": 0, "saved": 0, "committed_after_an_error": 0, "loads": 0, "loaded": 0, "refused": 0}
    try:
        reshard.save(_state(0), clean)
        committed = [0]
        for generation in range(1, rounds + 1):
            proxy.set_faults(rate=0.15, mix=FAULTS, seed=seed * 1000 + generation)
            tried["saves"] += 1
            try:
                reshard.save(_state(generation), faulty, overwrite=True)
                saved = True
                tried["saved"] += 1
            except reshard.CheckpointError:
                saved = False
            proxy.set_faults(rate=0.0)
            truth = _generation(reshard.load(_whole(), clean), [generation, *committed])
            assert truth is not None, f"round {generation}: the checkpoint holds neither this state nor the last"
            assert truth == generation or not saved, f"round {generation}: the save returned, the checkpoint is older"
            if truth == generation:
                committed.insert(0, generation)
                tried["committed_after_an_error"] += not saved
            proxy.set_faults(rate=0.15, mix=FAULTS, seed=seed * 1000 + 500 + generation)
            for how in ("whole", "rows", "staged"):
                tried["loads"] += 1
                try:
                    if how == "whole":
                        assert _same(reshard.load(_whole(), faulty), truth), how
                    elif how == "rows":
                        part = reshard.ShardedTensor("w", torch.zeros(9, 40), (24, 40), (7, 0))
                        out = reshard.load({"w": part}, faulty)
                        assert torch.equal(out["w"], _state(truth)["w"][7:16]), how
                    else:
                        staged = reshard.load(
                            _whole(),
                            faulty,
                            options=reshard.LoadOptions(
                                staging=reshard.StagingOptions(directory=staging / f"stage-{generation}")
                            ),
                        )
                        assert _same(staged, truth), how
                    tried["loaded"] += 1
                except reshard.CheckpointError:
                    tried["refused"] += 1
            proxy.set_faults(rate=0.0)
    finally:
        clean.close()
        faulty.close()
    tried["faults"] = proxy.count(faulted=True)
    return tried


@pytest.mark.parametrize("seed", [11, 12])
def test_faulty_http_never_costs_a_checkpoint_or_gives_wrong_bytes(
    object_store: Any, fault_proxy: Any, tmp_path: Path, seed: int
) -> None:
    proxy = fault_proxy(object_store, seed=seed, slow_s=0.02)
    tried = run_rounds(object_store, proxy, tmp_path, seed)
    assert tried["faults"] > 20, f"the proxy injected few faults: {tried}"
    assert tried["saved"] > 0 and tried["loaded"] > 0, tried
