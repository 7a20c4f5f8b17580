"""``reshard.interop.accelerate.use_reshard``: ``accelerator.save_state`` / ``load_state`` with Accelerate's own
launcher (``accelerate launch``) on CPU gloo ranks. The ranks' script is tests/interop/accelerate_ranks.py.

One launch saves on 2 processes with a model sharded by FSDP2 (by hand: accelerate enters its FSDP mode on
accelerator devices only, so on CPU the model is registered unwrapped with ``prepare_model(evaluation_mode=True)``);
one launch per other layout loads it: one process with the plain model, and 2 processes with tensor parallelism
(column- then row-sharded Linears: other split axes than FSDP's). Each checks, bit for bit, the whole model and
optimizer state against the state before the save, accelerate's own items (scheduler, step, registered object,
RNG), and the step after the resume against the step of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

import torch

pytestmark = pytest.mark.dist

SCRIPT = Path(__file__).with_name("accelerate_ranks.py")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(processes: int, *args: str) -> None:
    """``accelerate launch`` of the ranks' script: ``--multi_gpu`` starts torchrun's processes (on a host without
    GPUs accelerate then runs MULTI_CPU over gloo); one process runs through the plain ``--cpu`` launcher."""
    if processes > 1:
        how = ["--multi_gpu", "--num_processes", str(processes), "--main_process_port", str(_free_port())]
    else:
        how = ["--cpu", "--num_processes", "1"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_machines", "1"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--num_cpu_threads_per_process", "1"]
    done = subprocess.run(
        [*command, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("accelerate")
    _launch(2, "save", str(out))
    return out


def test_save_state_writes_one_reshard_checkpoint_and_accelerates_other_files(saved: Path) -> None:
    reference = torch.load(saved / "reference.pt", weights_only=True)
    # accelerate's automatic naming and total_limit=2 hold; its own model and optimizer files are not written,
    # everything else it saves is.
    assert reference["folders"] == ["checkpoint_1", "checkpoint_2"]
    assert reference["files"] == [
        "custom_checkpoint_0.pkl",
        "random_states_0.pkl",
        "random_states_1.pkl",
        "reshard",
        "scheduler.bin",
    ]
    assert (saved / "checkpoints" / "checkpoint_2" / "reshard" / "metadata.json").is_file()
    for key in ("optimizer_0", "optimizer_1"):
        assert any(isinstance(v, torch.Tensor) and v.numel() > 1 for v in reference["saved"][key].values())


@pytest.mark.parametrize("layout", ["plain", "tp"])
def test_load_state_at_another_layout_is_bit_exact_and_training_continues_equal(saved: Path, layout: str) -> None:
    _launch(1 if layout == "plain" else 2, "load", str(saved), layout)
    reference = torch.load(saved / "reference.pt", weights_only=True)
    loaded = torch.load(saved / f"loaded_{layout}.pt", weights_only=True)
    # Both models (net: FSDP2 -> plain / TP; head: DDP -> plain / DDP) and both optimizers, bit for bit.
    assert reference["saved"].keys() == {"model_0", "optimizer_0", "model_1", "optimizer_1"}
    assert _equal(reference["saved"], loaded["loaded"])
    # What accelerate saves and loads itself: the scheduler, the step counter, the registered object, the RNG.
    assert _equal(reference["scheduler"], loaded["scheduler"])
    assert (loaded["step"], loaded["counter"]) == (reference["step"], reference["counter"]) == (7, 3)
    assert torch.equal(reference["draw"], loaded["draw"])
    # The step after the resume equals the uninterrupted run's: bit for bit on one process (every FSDP rank fed
    # the same batch, so its averaged gradient is one process's); tensor parallelism sums partial products in
    # another order, so there it agrees to rounding.
    if layout == "plain":
        assert _equal(reference["after"], loaded["after"])
    else:
        assert reference["after"].keys() == loaded["after"].keys()
        for key, value in reference["after"].items():
            torch.testing.assert_close(loaded["after"][key], value, rtol=1e-5, atol=1e-6)
    # Refused before anything changed: a second use_reshard, a URL as the state directory, a directory without a
    # reshard checkpoint.
    refused = {"twice": "CheckpointError", "url": "CheckpointError", "missing": "CheckpointNotFoundError"}
    refused["scheduler_untouched"] = "True"
    assert loaded["refused"] == refused


# ---- found by the outside attack (issue 35): tests/interop/accelerate_cases.py runs them in one process ------


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("accelerate-cases")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("accelerate_cases.py")), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_save_before_the_first_step_leaves_the_optimizer_and_the_training_as_they_were(
    attacked: dict[str, Any],
) -> None:
    """torch's get_optimizer_state_dict steps an optimizer without state (Adam's step counter became 1): the
    run that saved at step 0 trained differently from one that did not, and its checkpoint resumed at step 1."""
    result = attacked["save_before_the_first_step_changes_nothing"]
    assert result == {"state_after_save": 0, "same_training": True, "state_after_load": 0, "lr_after_load": 0.1}


def test_a_refused_load_leaves_the_optimizer_as_it_was(attacked: dict[str, Any]) -> None:
    assert attacked["a_refused_load_changes_nothing"] == {"error": "reshard.errors.CheckpointNotFoundError", "state": 0}


def test_optimizer_state_for_some_parameters_only_loads_as_saved(attacked: dict[str, Any]) -> None:
    """A branch that never had a gradient has no optimizer state: its checkpoint could not be loaded."""
    for name in ("SGD", "Adam"):
        assert attacked["optimizer_state_for_some_parameters_loads"][name] == {
            "error": None,
            "states": ["used.bias", "used.weight"],
            "equal": True,
        }, name


def test_a_saved_entry_the_model_does_not_have_is_refused_as_accelerate_refuses_it(attacked: dict[str, Any]) -> None:
    assert attacked["an_entry_the_model_does_not_have_is_refused"] == "reshard.errors.MismatchError"


def test_a_save_reshard_refuses_deletes_no_checkpoint(attacked: dict[str, Any]) -> None:
    """total_limit deleted the oldest good checkpoint before reshard refused the save, and a retry the next."""
    result = attacked["a_refused_save_deletes_no_checkpoint"]
    assert result == {"errors": ["reshard.errors.CheckpointError"] * 2, "left": ["checkpoint_0", "checkpoint_1"]}


def test_odd_models_and_arguments(attacked: dict[str, Any]) -> None:
    assert attacked["a_model_without_parameters_saves_and_loads"] is None
    assert attacked["arguments"] == {
        "path": None,
        "not_an_accelerator": "reshard.errors.CheckpointError",
        "bad_timeout": "reshard.errors.CheckpointError",
    }


def test_a_directory_holding_accelerates_own_model_files_is_refused_before_anything_is_written(
    attacked: dict[str, Any],
) -> None:
    """A save with use_reshard into a directory of a save without it left the old model.safetensors beside the
    new scheduler: a load without reshard read the two saves mixed."""
    result = attacked["a_directory_with_accelerates_own_model_files_is_refused"]
    assert result == {"error": "reshard.errors.CheckpointError", "unchanged": True}
