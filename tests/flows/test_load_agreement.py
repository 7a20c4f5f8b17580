"""The arguments of a load are agreed across ranks in its first collective, as a save's are.

Two gloo ranks load the same checkpoint; one field of ``LoadOptions`` (or a keyword of ``reshard.load`` that
changes what a load does) differs on one rank. Every rank must raise the same ``CheckpointError`` naming the
field and the ranks of each value, before any data is read; nothing on storage changes. The fields that may
differ per rank (``memory_budget_bytes``, ``max_read_amplification``: how a rank reads its own bytes, never
what it gets) load bit-exactly, and a read-once exchange keeps within the smallest budget of the group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import reshard
from reshard.interop import HuggingFaceSource
from reshard.storage import LocalStorage
from tests.rankpool import RankContext, RankPool

pytestmark = pytest.mark.dist

TIMEOUT = 30.0
FULL = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)
BIG = torch.arange(256 * 64, dtype=torch.float32).reshape(256, 64)  # 64 KiB: one rank reads, one receives


def _save(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    reshard.save({"w": FULL}, path, options=reshard.SaveOptions(fingerprint=True, checksum_chunk_bytes=256))
    return path


def _options(spec: dict[str, Any], root: str) -> dict[str, Any]:
    """LoadOptions keywords from a spec of plain values (a staging directory as a name under ``root``)."""
    out = dict(spec)
    if "staging" in out:
        staging = out.pop("staging")
        if staging is not None:
            out["staging"] = reshard.StagingOptions(directory=str(Path(root) / staging[0]), keep=staging[1])
    return out


def rank_load_with(ctx: RankContext, path: str, per_rank: dict[str, list[Any]]) -> dict[str, Any]:
    group, member = ctx.group_of_size(2)
    if not member:
        return {}
    mine = {name: values[ctx.rank] for name, values in per_rank.items()}
    strict = mine.pop("strict", True)
    source: Any = LocalStorage(Path(path))
    if mine.pop("source", "reshard") == "huggingface":
        source = HuggingFaceSource(LocalStorage(Path(path).parent / "hf"), allow_unused=True)
    storage = source.storage if isinstance(source, HuggingFaceSource) else source
    options = reshard.LoadOptions(**_options(mine, str(Path(path).parent)))
    template = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(32, 16), (0, ctx.rank, 2))}
    stats = reshard.LoadStats()
    try:
        reshard.load(template, source, group=group, strict=strict, options=options, timeout=TIMEOUT, stats=stats)
    except reshard.CheckpointError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "read": storage.range_bytes_read}
    except Exception as exc:  # not reshard's: a finding in itself
        return {"error": type(exc).__name__, "message": str(exc), "other": True}
    exact = torch.equal(template["w"].data, FULL[32 * ctx.rank : 32 * ctx.rank + 32])
    return {"ok": exact, "rounds": stats.exchange_rounds, "from_peers": stats.bytes_from_peers}


DIFFERENT = {
    "allow_dtype_cast": {"allow_dtype_cast": [True, False]},
    "allow_lossy_cast": {"allow_lossy_cast": [False, True]},
    "verify": {"verify": [False, True]},
    "read_once": {"read_once": [True, None]},
    "read_once_off": {"read_once": [None, False]},
    "staging": {"staging": [("stage", False), None]},
    "staging_keep": {"staging": [("stage", True), ("stage", False)]},
    "staging_directory": {"staging": [("stage-a", False), ("stage-b", False)]},
    "strict": {"strict": [True, False]},
    "source": {"source": ["reshard", "huggingface"]},
}
NAMED = {
    "read_once_off": "read_once",
    "staging_keep": "staging.keep",
    "staging_directory": "staging.directory",
}


@pytest.mark.parametrize("case", list(DIFFERENT), ids=list(DIFFERENT))
def test_a_load_argument_that_differs_on_one_rank_fails_every_rank(pool4: RankPool, tmp_path: Path, case: str) -> None:
    path = _save(tmp_path)
    (tmp_path / "hf").mkdir()
    save_file({"w": FULL}, str(tmp_path / "hf" / "model.safetensors"))
    before = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*") if p.is_file())
    results = [r for r in pool4.run(rank_load_with, str(path), DIFFERENT[case]) if r]
    named = NAMED.get(case, case)
    assert all(r.get("error") == "CheckpointError" and "other" not in r for r in results), results
    assert len({r["message"] for r in results}) == 1, results
    message = results[0]["message"]
    assert named in message and "rank 0" in message and "rank 1" in message, message
    assert all(r["read"] == 0 for r in results)  # refused before any data was read (the storage's counter)
    after = sorted((p.relative_to(tmp_path), p.stat().st_size) for p in tmp_path.rglob("*") if p.is_file())
    assert after == before  # nothing staged, nothing written


@pytest.mark.parametrize(
    "per_rank",
    [
        {"memory_budget_bytes": [32 << 20, 4096]},
        {"max_read_amplification": [None, 4.0]},
        {"memory_budget_bytes": [32 << 20, 4096], "read_once": [True, True]},
    ],
    ids=["budget", "amplification", "budget_read_once"],
)
def test_what_may_differ_per_rank_loads(pool4: RankPool, tmp_path: Path, per_rank: dict[str, list[Any]]) -> None:
    """A per-rank memory budget and read amplification change how each rank reads, not what it gets."""
    path = _save(tmp_path)
    results = pool4.run_ok(rank_load_with, str(path), per_rank)[:2]
    assert all(r.get("ok") for r in results), results


def rank_load_replicas(ctx: RankContext, path: str, budgets: list[int]) -> dict[str, int]:
    """Two replicas of the whole tensor, read once between them, with per-rank budgets."""
    group, member = ctx.group_of_size(2)
    if not member:
        return {}
    options = reshard.LoadOptions(read_once=True, memory_budget_bytes=budgets[ctx.rank])
    stats = reshard.LoadStats()
    target = torch.zeros(BIG.shape)
    reshard.load({"big": target}, path, group=group, options=options, timeout=TIMEOUT, stats=stats)
    assert torch.equal(target, BIG)
    return {"rounds": stats.exchange_rounds, "from_peers": stats.bytes_from_peers}


def test_a_read_once_exchange_keeps_within_the_smallest_budget(pool4: RankPool, tmp_path: Path) -> None:
    """Rank 1's budget of 8 KiB allows 4 KiB per round; the coordinator's own 32 MiB must not set the rounds:
    the exchange takes as many rounds as when both ranks pass 8 KiB."""
    path = tmp_path / "ckpt"
    reshard.save({"big": BIG}, path)
    mixed = pool4.run_ok(rank_load_replicas, str(path), [32 << 20, 8192])[:2]
    small = pool4.run_ok(rank_load_replicas, str(path), [8192, 8192])[:2]
    assert mixed == small and sum(r["from_peers"] for r in mixed) == BIG.nbytes, (mixed, small)
    assert mixed[0]["rounds"] >= BIG.nbytes // 4096  # 4 KiB rounds (32 MiB ones would make one)
