"""The second day of the demo, through the real ``reshard`` command and the real clients: ``make demo``, then
``reshard export-hf`` and transformers' ``from_pretrained``; ``reshard demo --lora``, then ``reshard
export-peft`` and PEFT. The commands are the README's (its block marked with this file's name), run with fewer
steps and smaller layouts; the logits of what transformers and PEFT load equal those of the reshard model
restored from the checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers

import reshard
from reshard import cli
from reshard.demo.run import DemoOptions
from reshard.demo.training import Trainer, TrainingConfig, global_batch
from reshard.models.config import LoraConfig, ModelConfig, is_adapter_key
from reshard.models.hf import checkpoint_model_config, common_tree
from tests.demo_groups import layout_groups
from tests.doc_blocks import ROOT, marked_blocks
from tests.hf_models import MOE_OPTIONS, TOKENS, save_hf_model
from tests.rankpool import RankContext, RankPool

pytestmark = pytest.mark.slow

FAST = ["--steps", "2", "--resume-steps", "1", "--layout-a", "tp=2", "--layout-b", "dp=2,ep=2", "--json"]
"""What the tests add to each ``reshard demo`` of the README: two steps on TP=2, one more after resuming on
DP=2 x EP=2 (the README's are the defaults: ten and ten, TP=2 x PP=2 then DP=2 x TP=2 with ZeRO-1)."""

README_COMMANDS = [
    "make demo",
    "reshard export-hf demo-checkpoint hf-demo",
    "python -c \"import transformers; print(transformers.AutoModelForCausalLM.from_pretrained('hf-demo'))\"",
    "reshard demo --lora 4 --from-hf hf-demo --out demo-lora",
    "reshard export-peft demo-lora peft-demo --base-model hf-demo",
    "python -c \"import peft; print(peft.AutoPeftModelForCausalLM.from_pretrained('peft-demo'))\"",
]


def _readme_commands() -> list[str]:
    (block,) = marked_blocks(
        re.compile(r"<!-- example: (not run: .*tests/demo/test_demo_exports\.py.*) -->"), [ROOT / "README.md"]
    )
    lines = [line.split("  #")[0].strip() for line in block.values[2].splitlines()]
    return [line for line in lines if line]


def test_the_readme_shows_the_sequences_these_tests_run() -> None:
    assert _readme_commands() == README_COMMANDS


def _reshard(cwd: Path, line: str) -> dict[str, Any] | None:
    """One ``reshard`` line of the README in ``cwd``, through the command itself (``make demo`` is ``reshard
    demo``; a demo gets FAST, which the line's own options override); a demo's JSON report."""
    argv = shlex.split(line)
    if argv[:2] == ["make", "demo"]:
        argv = ["reshard", "demo"]
    assert argv[0] == "reshard", line
    demo = argv[1] == "demo"
    if not demo:  # the command itself, in this process (it starts no ranks): no second import of torch
        with contextlib.chdir(cwd), contextlib.redirect_stdout(io.StringIO()) as out:
            code = cli.main(argv[1:])
        assert code == 0, f"{line}: exit {code}\n{out.getvalue()[-3000:]}"
        return None
    command = [sys.executable, "-m", *argv[:2], *FAST, *argv[2:]]  # the line's options win
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, f"{line}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(done.stdout)
    assert report["phase_a"]["digest_saved"] == report["phase_b"]["digest_loaded"] != "", line  # bit-exact resume
    return report


def rank_checkpoint_logits(ctx: RankContext, layout: str, checkpoint: str, base: str | None) -> torch.Tensor | None:
    """The reshard model of a demo checkpoint on ``layout``, restored from it (a full checkpoint), or from the
    Hugging Face ``base`` and the checkpoint's adapters (an adapter-only one, ``base`` None for the demo's
    initial weights): its logits for TOKENS on the last stage."""
    groups = layout_groups(layout)
    if groups is None:
        return None
    metadata = reshard.read_metadata(checkpoint)
    lora_doc = common_tree(metadata.common, "trainer.lora")
    lora = LoraConfig.from_dict(lora_doc) if isinstance(lora_doc, dict) and lora_doc else None
    trainer = Trainer(checkpoint_model_config(metadata, checkpoint), TrainingConfig(), groups, lora)
    if base is not None:
        trainer.load_hf(base)
    if lora is None:
        trainer.load(checkpoint)
    else:
        trainer.load_adapter(checkpoint)
    return trainer.logits(TOKENS)


def _logits(pool: RankPool, layout: str, checkpoint: Path, base: Path | None = None) -> torch.Tensor:
    results = pool.run_ok(rank_checkpoint_logits, layout, str(checkpoint), None if base is None else str(base))
    return next(r for r in results if r is not None)


@pytest.fixture(scope="module")
def demo_day(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """``make demo`` and ``reshard export-hf demo-checkpoint hf-demo``, run once in a fresh directory."""
    cwd = tmp_path_factory.mktemp("demo-day")
    commands = _readme_commands()
    report = _reshard(cwd, commands[0])
    _reshard(cwd, commands[1])
    assert report is not None
    return cwd, report


def test_the_demo_checkpoint_exports_to_transformers_with_its_logits(
    pool4: RankPool, demo_day: tuple[Path, dict[str, Any]]
) -> None:
    """make demo -> reshard export-hf -> AutoModelForCausalLM.from_pretrained: a MixtralForCausalLM with no
    missing or unexpected keys, whose logits equal the checkpoint's model's (restored on another layout), and
    whose loss on the demo's next batch is the one the demo printed for the saved state."""
    cwd, report = demo_day
    model, info = transformers.AutoModelForCausalLM.from_pretrained(cwd / "hf-demo", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(model).__name__ == "MixtralForCausalLM"
    model_config = checkpoint_model_config(reshard.read_metadata(cwd / "demo-checkpoint"), "demo-checkpoint")
    assert model_config == DemoOptions().model_config()
    assert ModelConfig.from_hf(cwd / "hf-demo") == model_config  # config.json describes the demo's model exactly
    expected = _logits(pool4, "tp=2,pp=2", cwd / "demo-checkpoint")
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS).logits, expected, rtol=0, atol=1e-5)
        batch = global_batch(report["phase_b"]["first_step"], model_config, TrainingConfig())
        logits = model(batch[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()
    assert loss == pytest.approx(report["phase_a"]["loss_after"], rel=1e-5)


def test_demo_lora_on_the_export_goes_to_peft_with_its_logits(
    pool4: RankPool, demo_day: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """reshard demo --lora 4 --from-hf hf-demo -> reshard export-peft --base-model hf-demo -> PEFT: every adapter
    lands (the experts' through target_parameters), and AutoPeftModelForCausalLM and PeftModel give the logits of
    the reshard model with its adapters."""
    import peft

    cwd, _ = demo_day
    monkeypatch.chdir(cwd)  # the README's relative paths, base_model_name_or_path="hf-demo" among them
    commands = _readme_commands()
    _reshard(cwd, commands[3])
    _reshard(cwd, commands[4])
    config = json.loads((cwd / "peft-demo" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["base_model_name_or_path"] == "hf-demo"
    expected = _logits(pool4, "tp=2", cwd / "demo-lora", cwd / "hf-demo")
    auto = peft.AutoPeftModelForCausalLM.from_pretrained("peft-demo").eval()
    base = transformers.AutoModelForCausalLM.from_pretrained("hf-demo").eval()
    with torch.no_grad():
        base_logits = base(TOKENS).logits
        with_adapter = peft.PeftModel.from_pretrained(base, "peft-demo").eval()
        for model in (auto, with_adapter):
            torch.testing.assert_close(model(TOKENS).logits, expected, rtol=0, atol=1e-5)
    assert (base_logits - expected).abs().max() > 1e-4  # the adapters matter
    lora_keys = {k for k in with_adapter.state_dict() if ".lora_" in k}
    assert any(".experts." in k for k in lora_keys) and len(lora_keys) == 2 * (4 * 4 + 4 * 2)  # A and B


def test_demo_lora_adapters_of_the_default_model_export_to_peft(
    pool4: RankPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reshard demo --lora 4 (on the demo's initial weights; an adapter-only checkpoint, resumed bit-exactly on
    another layout) -> reshard export-peft: written, not refused (the
    demo's default model used to adapt un-gated experts that no Hugging Face model has); PEFT puts it on the
    initial weights exported as the README says (a demo of 0 steps, export-hf), with the reshard model's logits."""
    import peft

    monkeypatch.chdir(tmp_path)
    report = _reshard(tmp_path, "reshard demo --lora 4 --out demo-lora")  # a bit-exact resume on another layout
    assert report is not None and report["phase_b"]["first_step"] == 2
    assert all(is_adapter_key(k) for k in reshard.read_metadata(tmp_path / "demo-lora").tensors)  # adapters only
    _reshard(tmp_path, "reshard export-peft demo-lora peft-demo")
    # the README's line for the initial weights; no step runs, so one rank per phase holds them all
    _reshard(tmp_path, "reshard demo --steps 0 --resume-steps 0 --out demo-initial --layout-a tp=1 --layout-b tp=1")
    _reshard(tmp_path, "reshard export-hf demo-initial hf-initial")
    expected = _logits(pool4, "tp=1", tmp_path / "demo-lora")
    base = transformers.AutoModelForCausalLM.from_pretrained("hf-initial").eval()
    with torch.no_grad():
        with_adapter = peft.PeftModel.from_pretrained(base, "peft-demo").eval()
        torch.testing.assert_close(with_adapter(TOKENS).logits, expected, rtol=0, atol=1e-5)


def test_demo_lora_on_a_qwen_moe_with_dense_layers_goes_to_peft(
    pool4: RankPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """reshard demo --lora on a Qwen3-MoE with a dense layer: the adapters are ones export-peft writes (PEFT reads
    the targets of a Qwen-MoE's dense MLP as its experts' projections, so the demo does not adapt that MLP; it
    used to, and export-peft refused the checkpoint), and PEFT gives the reshard model's logits."""
    import peft

    save_hf_model(tmp_path / "qwen", {"architecture": "qwen3_moe", **MOE_OPTIONS["qwen3_moe"], "mlp_only_layers": [1]})
    monkeypatch.chdir(tmp_path)
    _reshard(tmp_path, "reshard demo --lora 2 --from-hf qwen --out qwen-lora")
    _reshard(tmp_path, "reshard export-peft qwen-lora qwen-peft --base-model qwen")
    expected = _logits(pool4, "tp=1", tmp_path / "qwen-lora", tmp_path / "qwen")
    with torch.no_grad():
        logits = peft.AutoPeftModelForCausalLM.from_pretrained("qwen-peft").eval()(TOKENS).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
