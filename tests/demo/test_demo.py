"""The demo's model (``DemoOptions().model_config()``, a Mixtral): parallelism correctness, bit-exact resume across
layouts, continued training, and the ``reshard demo`` entry point.

All multi-rank cases run in one pool of 8 spawned ranks: every pool rank takes part in creating a
layout's process groups (that is collective over the default group); the layout runs on the first
``world_size`` ranks and the others return None.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
import reshard.data
from reshard.demo.run import DemoOptions, state_digest
from reshard.demo.training import Trainer, TrainingConfig
from reshard.models.config import ModelConfig
from reshard.models.parallel import ParallelConfig
from tests.demo_groups import layout_groups
from tests.rankpool import RankContext, RankPool

pytestmark = pytest.mark.slow


def _trainer(layout: str) -> Trainer | None:
    groups = layout_groups(layout)
    if groups is None:
        return None
    return Trainer(DemoOptions().model_config(), TrainingConfig(), groups)


def rank_losses(ctx: RankContext, layout: str, steps: int) -> list[float] | None:
    trainer = _trainer(layout)
    if trainer is None:
        return None
    return [trainer.train_step() for _ in range(steps)]


LAYOUTS = [
    "tp=2",
    "pp=2",
    "pp=2,vpp=2",
    "dp=2",
    "dp=2,zero",
    "cp=2",
    "dp=2,ep=2",
    "tp=2,etp=2",
    "cp=2,etp=2",
    "tp=4",
    "tp=2,pp=2,dp=2,ep=2,etp=2,zero",
]


def test_every_layout_computes_the_same_training(pool8: RankPool) -> None:
    """The model is correct on every parallel dimension: the losses of the first steps (forward, backward,
    gradient reduction and Adam) match the single-rank run up to floating-point reassociation."""
    reference = pool8.run_ok(rank_losses, "tp=1", 8)[0]
    assert max(reference[-3:]) < reference[0]  # it learns (after the warmup of the learning rate)
    for layout in LAYOUTS:
        losses = pool8.run_ok(rank_losses, layout, 3)[0]
        assert losses == pytest.approx(reference[:3], rel=2e-5), layout


def rank_train_and_save(ctx: RankContext, layout: str, steps: int, path: str) -> dict[str, Any] | None:
    trainer = _trainer(layout)
    if trainer is None:
        return None
    losses = [trainer.train_step() for _ in range(steps)]
    full = trainer.full_state()
    trainer.save(path)
    return {"losses": losses, "digest": state_digest(full), "full": full, "trainer": trainer.trainer_state()}


def rank_resume(ctx: RankContext, layout: str, path: str, steps: int) -> dict[str, Any] | None:
    trainer = _trainer(layout)
    if trainer is None:
        return None
    stats = reshard.LoadStats()
    trainer.load(path, stats=stats)
    digest = state_digest(trainer.full_state())
    losses = [trainer.train_step() for _ in range(steps)]
    return {
        "digest": digest,
        "losses": losses,
        "step": trainer.step,
        "read": stats.bytes_read,
        "needed": stats.bytes_needed,
    }


def rank_resume_in_memory(
    ctx: RankContext, layout: str, full: dict[str, torch.Tensor], state: dict[str, Any], steps: int
) -> list[float] | None:
    trainer = _trainer(layout)
    if trainer is None:
        return None
    trainer.set_full_state(full, state)
    return [trainer.train_step() for _ in range(steps)]


PAIRS = [
    ("tp=2,pp=2", "tp=4"),  # TP up, PP down
    ("tp=4", "pp=2,vpp=2"),  # TP down, PP up with virtual stages
    ("pp=2,vpp=2,tp=2", "pp=4"),  # VPP on the saving side
    ("dp=2,tp=2", "dp=4,zero"),  # DP change, ZeRO-1 on
    ("dp=4,zero", "dp=2,zero,tp=2"),  # ZeRO-1 DP change and TP change
    ("dp=2,zero,tp=2", "tp=2,pp=2"),  # ZeRO-1 off
    ("dp=2,ep=2", "dp=4,ep=4"),  # EP change
    ("tp=2,dp=2", "tp=2,etp=2,dp=2"),  # ETP change
    ("cp=2,dp=2", "cp=4,tp=2"),  # CP change
    ("tp=2,pp=2,dp=2,ep=2,etp=2,zero", "tp=1"),  # everything to one rank
]


@pytest.mark.parametrize(("saved", "resumed"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resharded_resume_is_bit_exact(pool8: RankPool, tmp_path: Path, saved: str, resumed: str) -> None:
    """Every parameter and every Adam state, gathered to full tensors after the resharded load, is
    bitwise equal to the gathered state before the save (compared by a digest of all their bytes)."""
    path = str(tmp_path / "ckpt")
    before = pool8.run_ok(rank_train_and_save, saved, 2, path)[0]
    assert all(not torch.isnan(t).any() for t in before["full"].values())
    after = pool8.run_ok(rank_resume, resumed, path, 1)
    world = ParallelConfig.parse(resumed).world_size
    assert all(a["digest"] == before["digest"] for a in after[:world])
    assert after[0]["step"] == 3
    assert all(a["read"] <= 1.10 * a["needed"] for a in after[:world])


@pytest.mark.parametrize(("saved", "resumed"), [("tp=2,pp=2", "dp=2,tp=2,zero"), ("dp=2,ep=2,zero", "tp=2,etp=2,pp=2")])
def test_continued_training_matches_an_in_memory_reshard(
    pool8: RankPool, tmp_path: Path, saved: str, resumed: str
) -> None:
    """Train N steps on layout A, save, resume on layout B and train K steps; compare with a reference
    that trains the same N steps on A, gathers the state into full tensors in memory, scatters it onto
    layout B (no reshard save or load involved) and trains the same K steps. Both runs on B start from
    the same bits and do the same arithmetic, so the losses must be exactly equal."""
    path = str(tmp_path / "ckpt")
    a = pool8.run_ok(rank_train_and_save, saved, 3, path)[0]
    resumed_losses = pool8.run_ok(rank_resume, resumed, path, 3)[0]["losses"]
    reference = pool8.run_ok(rank_resume_in_memory, resumed, a["full"], a["trainer"], 3)[0]
    assert resumed_losses == reference
    assert resumed_losses[0] == pytest.approx(a["losses"][-1], rel=0.2)  # the curve continues


def test_demo_entry_point_end_to_end(tmp_path: Path) -> None:
    """``reshard demo --json`` (the report of both phases), then a second demo over the same checkpoint that
    prints the table and draws the loss curve (``--plot``)."""
    out = tmp_path / "demo-checkpoint"
    png = tmp_path / "loss.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "reshard",
            "demo",
            "--steps",
            "2",
            "--resume-steps",
            "2",
            "--out",
            str(out),
            "--layout-a",
            "tp=2",
            "--layout-b",
            "dp=2,zero",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    a, b = result["phase_a"], result["phase_b"]
    assert a["digest_saved"] == b["digest_loaded"] != ""
    assert len(a["losses"]) == 2 and len(b["losses"]) == 2
    assert b["first_step"] == 2
    # The saved state's loss on step 3's batch, forward only on layout A, and phase B's first step on layout
    # B: the same state on the same batch, so equal up to the summation order of another layout, and not
    # the loss of another step (which differs by a training step's progress).
    assert b["losses"][0] == pytest.approx(a["loss_after"], rel=1e-5, abs=0)
    assert abs(a["losses"][-1] - a["loss_after"]) > 1e-4
    assert (out / "metadata.json").is_file()
    table = subprocess.run(
        [
            sys.executable,
            "-m",
            "reshard",
            "demo",
            "--steps",
            "1",
            "--resume-steps",
            "1",
            "--out",
            str(out),
            "--layout-a",
            "dp=2",
            "--layout-b",
            "tp=2",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert table.returncode == 0, table.stderr[-3000:]
    assert "resumed state == saved state" in table.stdout and "yes (bit-exact)" in table.stdout
    assert "loss of the saved state, step 2's batch" in table.stdout
    assert "(its first step; " in table.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # --plot: the loss curve


def _rng_digest() -> str:
    import hashlib

    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()


def rank_rng_save(ctx: RankContext, layout: str, path: str) -> dict[str, Any] | None:
    trainer = _trainer(layout)
    if trainer is None:
        return None
    trainer.train_step()
    torch.rand(ctx.rank + 1)  # every rank's RNG state differs
    c = trainer.groups.coords
    state = {"coords": [c.pp, c.dp, c.cp, c.tp], "rng": _rng_digest()}
    trainer.save(path)
    return state


def rank_rng_load(ctx: RankContext, layout: str, path: str) -> dict[str, Any] | None:
    trainer = _trainer(layout)
    if trainer is None:
        return None
    trainer.load(path)
    c = trainer.groups.coords
    return {"coords": [c.pp, c.dp, c.cp, c.tp], "rng": _rng_digest(), "rank": trainer.groups.rank}


def test_rng_states_resume_for_existing_ranks_and_are_seeded_for_new_ones(pool8: RankPool, tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = {tuple(s["coords"]): s["rng"] for s in pool8.run_ok(rank_rng_save, "dp=2", path)[:2]}
    assert len(set(saved.values())) == 2
    loaded = pool8.run_ok(rank_rng_load, "dp=4", path)[:4]
    for entry in loaded:
        coords = tuple(entry["coords"])
        if coords in saved:
            assert entry["rng"] == saved[coords]
        else:
            # step 1, the documented rule: reshard.data.derive_seed of the model's seed, the step and the coordinates
            torch.manual_seed(reshard.data.derive_seed(ModelConfig().seed, 1, coords, "torch") % 2**64)
            assert entry["rng"] == _rng_digest()
    assert sum(tuple(e["coords"]) in saved for e in loaded) == 2
