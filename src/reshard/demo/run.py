"""``reshard demo``: train on one layout, save, resume on another layout, keep training.

Each phase spawns its own CPU ranks (gloo). Phase A trains ``--steps`` steps on layout A and saves to
``--out``; phase B starts on layout B, loads the checkpoint (resharding it), checks that the resumed
state equals the saved one (a digest of every parameter and Adam state gathered into full tensors), and
trains ``--resume-steps`` more steps.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import queue
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from reshard.models.config import LoraConfig, ModelConfig

__all__ = ["DemoOptions", "PhaseResult", "main", "run_demo"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    layout_a: str = "tp=2,pp=2"
    layout_b: str = "dp=2,tp=2,zero"
    steps: int = 10
    resume_steps: int = 10
    out: str = "demo-checkpoint"
    hidden: int = 32
    layers: int = 4
    plot: str | None = None
    timeout_s: float = 300.0
    lora_rank: int = 0
    """With a positive rank: LoRA fine-tuning (frozen base) and adapter-only checkpoints."""
    from_hf: str | None = None
    """A Hugging Face Llama, Mixtral, Qwen2-MoE or Qwen3-MoE directory: the model is built from its config.json
    (``hidden`` and ``layers`` unused) and phase A starts from its weights, loaded straight into layout A; with
    ``lora_rank``, they are the frozen base of both phases."""

    def model_config(self) -> ModelConfig:
        """The model of ``from_hf``, or the demo's own: a Mixtral (gated experts in every layer) of ``hidden``
        and ``layers``, which ``reshard export-hf`` writes for transformers and whose adapters ``reshard
        export-peft`` writes for PEFT."""
        from reshard.models.config import ModelConfig

        if self.from_hf:
            return ModelConfig.from_hf(self.from_hf)
        experts = ModelConfig().expert_ffn_hidden
        # ffn_hidden is Mixtral's intermediate_size too (it has no dense MLP): what from_hf of its export reads.
        return ModelConfig(
            hidden=self.hidden,
            num_layers=self.layers,
            moe_layers=tuple(range(self.layers)),
            expert_glu=True,
            ffn_hidden=experts,
            architecture="mixtral",
        )

    def lora_config(self, model: ModelConfig) -> LoraConfig | None:
        """With ``lora_rank``: adapters of that rank on every linear of ``model`` that ``reshard export-peft``
        writes for PEFT, which is all of them but the dense MLPs of a Qwen-MoE (PEFT reads the targets
        gate_proj, up_proj and down_proj of a Qwen-MoE model as its experts' projections)."""
        from reshard.models.config import LORA_TARGETS, LoraConfig

        if not self.lora_rank:
            return None
        targets: tuple[str, ...] = LORA_TARGETS
        if model.architecture in ("qwen2_moe", "qwen3_moe"):
            targets = tuple(t for t in LORA_TARGETS if t not in ("fc1", "fc2"))
        return LoraConfig(rank=self.lora_rank, targets=targets)


@dataclass
class PhaseResult:
    layout: str
    world_size: int
    first_step: int
    losses: list[float] = field(default_factory=list)
    seconds_save: float = 0.0
    seconds_load: float = 0.0
    checkpoint_bytes: int = 0
    bytes_read: list[int] = field(default_factory=list)
    bytes_needed: list[int] = field(default_factory=list)
    digest_saved: str = ""
    loss_after: float | None = None
    """Phase A: the saved state's loss on the next step's batch (forward only); phase B's first step
    computes the same loss from the resumed state."""
    digest_loaded: str = ""
    consumed_samples: int = 0
    """Phase A: samples consumed when it saved; phase B: when it resumed (restored)."""
    data_position: str = ""
    """Where the data stream stands at that point: the epoch and the samples of it consumed."""
    first_batch_as_uninterrupted: bool | None = None
    """Phase B: whether every rank's first step read exactly the samples (indices, in order) that torch's own
    DistributedSampler gives that rank at that step in an uninterrupted run on layout B."""


def state_digest(full: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every full tensor's key and bytes, in key order."""
    import torch

    h = hashlib.sha256()
    for key in sorted(full):
        h.update(key.encode())
        h.update(full[key].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _phase(rank: int, world: int, port: int, task: dict[str, Any], results: Any) -> None:
    """One rank of one phase (spawned)."""
    import torch
    import torch.distributed as dist

    import reshard
    from reshard.demo.training import Trainer, TrainingConfig, timed
    from reshard.models.parallel import ParallelConfig, ParallelGroups

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=task["timeout_s"]),
    )
    try:
        parallel = ParallelConfig.parse(task["layout"])
        options = DemoOptions(
            hidden=task["hidden"], layers=task["layers"], from_hf=task["from_hf"], lora_rank=task["lora_rank"]
        )
        model = options.model_config()
        groups = ParallelGroups.create(parallel)
        if groups is None:  # cannot happen: the phase spawned exactly the layout's ranks
            return
        lora = options.lora_config(model)
        trainer = Trainer(model, TrainingConfig(), groups, lora)
        out: dict[str, Any] = {"rank": rank}
        if task["from_hf"] and (lora or not task.get("resume_from")):
            # The base: phase A starts from it; an adapter-only checkpoint resumes on it (it does not hold it).
            _, out["seconds_load"] = timed(trainer.load_hf, task["from_hf"], stats=reshard.LoadStats())
        if task.get("resume_from"):
            stats = reshard.LoadStats()
            load = trainer.load_adapter if lora else trainer.load
            _, out["seconds_load"] = timed(load, task["resume_from"], stats=stats)
            out["bytes_read"], out["bytes_needed"] = stats.bytes_read, stats.bytes_needed
            out["digest_loaded"] = state_digest(trainer.full_state())
        out["first_step"] = trainer.step
        out["consumed_samples"] = trainer.consumed_samples
        out["data_position"] = trainer.data.position()
        out["losses"] = []
        for _ in range(task["steps"]):
            out["losses"].append(trainer.train_step())
            if len(out["losses"]) == 1 and task.get("resume_from"):
                out["first_batch_as_uninterrupted"] = trainer.last_indices == uninterrupted_indices(trainer)
        if task.get("save_to"):
            out["consumed_samples"] = trainer.consumed_samples
            out["data_position"] = trainer.data.position()
            out["loss_after"] = trainer.loss(trainer.step)
            out["digest_saved"] = state_digest(trainer.full_state())
            save = trainer.save_adapter if lora else trainer.save
            result, out["seconds_save"] = timed(save, task["save_to"], overwrite=True)
            out["checkpoint_bytes"] = result.file_bytes
        results.put(out)
    except BaseException as exc:
        results.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}"})
        raise
    finally:
        dist.destroy_process_group()


def run_phase(task: dict[str, Any], world: int, timeout_s: float) -> PhaseResult:
    """Spawn ``world`` ranks for one phase and collect what they report."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    processes = [ctx.Process(target=_phase, args=(r, world, port, task, results), daemon=True) for r in range(world)]
    for p in processes:
        p.start()
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(reports) < world:
            try:
                report = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"phase {task['layout']} did not finish within {timeout_s:.0f} s") from None
            if "error" in report:
                raise RuntimeError(f"rank {report['rank']} of phase {task['layout']} failed: {report['error']}")
            reports[report["rank"]] = report
    finally:
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    first = reports[0]
    return PhaseResult(
        layout=task["layout"],
        world_size=world,
        first_step=first["first_step"],
        losses=first["losses"],
        seconds_save=max(r.get("seconds_save", 0.0) for r in reports.values()),
        seconds_load=max(r.get("seconds_load", 0.0) for r in reports.values()),
        checkpoint_bytes=first.get("checkpoint_bytes", 0),
        bytes_read=[reports[r].get("bytes_read", 0) for r in range(world)],
        bytes_needed=[reports[r].get("bytes_needed", 0) for r in range(world)],
        digest_saved=first.get("digest_saved", ""),
        digest_loaded=first.get("digest_loaded", ""),
        loss_after=first.get("loss_after"),
        consumed_samples=first.get("consumed_samples", 0),
        data_position=first.get("data_position", ""),
        first_batch_as_uninterrupted=(
            all(r["first_batch_as_uninterrupted"] for r in reports.values())
            if "first_batch_as_uninterrupted" in first
            else None
        ),
    )


def run_demo(options: DemoOptions) -> tuple[PhaseResult, PhaseResult]:
    """Phase A (train, save) then phase B (resume resharded, train); returns both phases' results."""
    from reshard.models.parallel import ParallelConfig

    layout_a = ParallelConfig.parse(options.layout_a)
    layout_b = ParallelConfig.parse(options.layout_b)
    model = options.model_config()
    model.check(layout_a)
    model.check(layout_b)
    out = str(Path(options.out).resolve())
    common = {
        "hidden": options.hidden,
        "layers": options.layers,
        "timeout_s": options.timeout_s,
        "lora_rank": options.lora_rank,
        "from_hf": str(Path(options.from_hf).resolve()) if options.from_hf else None,
    }
    phase_a = run_phase(
        {**common, "layout": options.layout_a, "steps": options.steps, "save_to": out},
        layout_a.world_size,
        options.timeout_s,
    )
    phase_b = run_phase(
        {**common, "layout": options.layout_b, "steps": options.resume_steps, "resume_from": out},
        layout_b.world_size,
        options.timeout_s,
    )
    return phase_a, phase_b


def _table(options: DemoOptions, a: PhaseResult, b: PhaseResult) -> str:
    from reshard.models.parallel import ParallelConfig

    equal = a.digest_saved == b.digest_loaded and bool(a.digest_saved)
    rows = [
        ("", "phase A (train, save)", "phase B (resume, train)"),
        ("layout", ParallelConfig.parse(a.layout).describe(), ParallelConfig.parse(b.layout).describe()),
        ("ranks", str(a.world_size), str(b.world_size)),
        ("steps", f"{a.first_step}..{a.first_step + len(a.losses)}", f"{b.first_step}..{b.first_step + len(b.losses)}"),
        (
            "loss first -> last",
            f"{a.losses[0]:.4f} -> {a.losses[-1]:.4f}" if a.losses else "-",
            f"{b.losses[0]:.4f} -> {b.losses[-1]:.4f}" if b.losses else "-",
        ),
        (
            f"loss of the saved state, step {a.first_step + len(a.losses) + 1}'s batch",
            f"{a.loss_after:.6f} (forward only)" if a.loss_after is not None else "-",
            _resumed_loss(a, b),
        ),
        (
            "samples consumed (saved / resumed)",
            f"{a.consumed_samples} ({a.data_position})",
            f"{b.consumed_samples} ({b.data_position})",
        ),
        (
            "first batch == an uninterrupted run on B",
            "",
            _yes_no(b.first_batch_as_uninterrupted, "yes (sample ids, every rank)"),
        ),
        ("checkpoint bytes" + (" (adapters)" if options.lora_rank else ""), f"{a.checkpoint_bytes:,}", ""),
        ("save / load seconds", f"{a.seconds_save:.3f}", f"{b.seconds_load:.3f}"),
        ("bytes read per rank", "", ", ".join(f"{n:,}" for n in b.bytes_read)),
        ("read / needed", "", f"{sum(b.bytes_read) / max(1, sum(b.bytes_needed)):.3f}"),
        ("resumed state == saved state", "", "yes (bit-exact)" if equal else "NO"),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"reshard demo: checkpoint at {options.out}"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join(lines) + "\n"


def _yes_no(flag: bool | None, yes: str) -> str:
    return "-" if flag is None else yes if flag else "NO"


def uninterrupted_indices(trainer: Any) -> list[int]:
    """The sample indices torch's own ``DistributedSampler`` gives this rank at the trainer's last step in a run
    that never stopped on the trainer's layout (a data-parallel size of ``dp``, nothing consumed yet at the
    start): the reference a resumed run's first step must equal."""
    from torch.utils.data.distributed import DistributedSampler

    training, dp = trainer.training, trainer.groups.config.dp
    epoch, within = divmod((trainer.step - 1) * training.global_batch, training.epoch_samples)
    sampler: DistributedSampler[int] = DistributedSampler(
        trainer.data.dataset, num_replicas=dp, rank=trainer.groups.coords.dp, seed=training.data_seed, drop_last=True
    )
    sampler.set_epoch(epoch)
    per_rank = training.global_batch // dp
    start = within // dp
    return list(sampler)[start : start + per_rank]


def _resumed_loss(a: PhaseResult, b: PhaseResult) -> str:
    """Phase B's first loss, and how far it is from phase A's loss of the same state on the same batch:
    zero or a float rounding of the other layout's summation order, never a training step."""
    if not b.losses or a.loss_after is None:
        return "-"
    gap = abs(b.losses[0] - a.loss_after)
    return f"{b.losses[0]:.6f} (its first step; " + ("equal)" if gap == 0 else f"differs by {gap:.1e}: sum order)")


def _plot(path: str, a: PhaseResult, b: PhaseResult) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from reshard.models.parallel import ParallelConfig

    fig, ax = plt.subplots(figsize=(7, 4))
    steps_a = list(range(a.first_step + 1, a.first_step + len(a.losses) + 1))
    steps_b = list(range(b.first_step + 1, b.first_step + len(b.losses) + 1))
    ax.plot(steps_a, a.losses, marker="o", label=ParallelConfig.parse(a.layout).describe())
    ax.plot(steps_b, b.losses, marker="o", label=ParallelConfig.parse(b.layout).describe())
    ax.axvline(b.first_step + 0.5, color="grey", linestyle="--", label="save / resume")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("reshard demo: resume on another layout")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="reshard demo")
    defaults = DemoOptions()
    parser.description = (
        "Train a small Megatron-style GPT on CPU ranks (gloo) with layout A, save it with reshard, resume it "
        "on layout B (resharding the checkpoint), check that the resumed state is bit-exact, and train on. The "
        "model is a Mixtral (gated experts in every layer): 'reshard export-hf' writes its checkpoints for "
        "transformers, and 'reshard export-peft' those of --lora for PEFT."
    )
    parser.add_argument(
        "--layout-a",
        default=defaults.layout_a,
        help="layout of phase A, e.g. 'tp=2,pp=2' (sizes tp, pp, dp, cp, ep, etp, vpp; 'zero' "
        f"for ZeRO-1; default {defaults.layout_a!r})",
    )
    parser.add_argument(
        "--layout-b", default=defaults.layout_b, help=f"layout of phase B (default {defaults.layout_b!r})"
    )
    parser.add_argument("--steps", type=int, default=defaults.steps, help="training steps before the save")
    parser.add_argument(
        "--resume-steps", type=int, default=defaults.resume_steps, help="training steps after the resume"
    )
    parser.add_argument("--out", default=defaults.out, help="checkpoint directory (default ./demo-checkpoint)")
    parser.add_argument("--hidden", type=int, default=None, help=f"model width (default {defaults.hidden})")
    parser.add_argument(
        "--layers", type=int, default=None, help=f"number of transformer layers (default {defaults.layers})"
    )
    parser.add_argument(
        "--from-hf",
        default=None,
        metavar="DIR",
        help="start from a Hugging Face Llama, Mixtral, Qwen2-MoE or Qwen3-MoE directory (config.json and "
        "safetensors, as save_pretrained or reshard export-hf writes them): the model is built from its config "
        "(not with --hidden/--layers) and its weights are loaded straight into layout A; with --lora they are "
        "the frozen base of both phases",
    )
    parser.add_argument(
        "--plot", default=None, help="write the loss curve to this PNG (needs matplotlib: the demo extra of reshard)"
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="LoRA fine-tuning instead: adapters of this rank on every linear (but a Qwen-MoE's dense MLPs, "
        "which PEFT would misplace), the base frozen (the model's initial weights, or those of --from-hf DIR), "
        "adapter-only checkpoints (reshard export-peft writes them for Hugging Face PEFT, which puts them on that "
        "base)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    return parser


def main(args: argparse.Namespace) -> int:
    defaults = DemoOptions()
    if args.from_hf and (args.hidden is not None or args.layers is not None):
        print("reshard demo: --from-hf builds the model from its config.json; drop --hidden/--layers", file=sys.stderr)
        return 2
    options = DemoOptions(
        layout_a=args.layout_a,
        layout_b=args.layout_b,
        steps=args.steps,
        resume_steps=args.resume_steps,
        out=args.out,
        hidden=defaults.hidden if args.hidden is None else args.hidden,
        layers=defaults.layers if args.layers is None else args.layers,
        plot=args.plot,
        lora_rank=args.lora,
        from_hf=args.from_hf,
    )
    try:  # a layout the model cannot run is a usage error: one line, exit 2, before any rank starts
        from reshard.models.parallel import ParallelConfig

        model = options.model_config()
        for layout in (options.layout_a, options.layout_b):
            model.check(ParallelConfig.parse(layout))
    except (ValueError, TypeError, OSError) as exc:
        print(f"reshard demo: {exc}", file=sys.stderr)
        return 2
    a, b = run_demo(options)
    if args.json:
        json.dump({"phase_a": a.__dict__, "phase_b": b.__dict__}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(_table(options, a, b))
    if options.plot:
        written = _plot(options.plot, a, b)
        sys.stdout.write(f"loss curve: {written}\n" if written else "loss curve skipped: matplotlib is not installed\n")
    ok = a.digest_saved == b.digest_loaded and b.first_batch_as_uninterrupted is not False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main(build_parser().parse_args()))
