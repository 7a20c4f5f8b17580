"""One process, many cases of ``use_reshard`` that an outside attack broke (issue 35), each reported as a JSON
verdict by ``tests/interop/test_accelerate.py`` (accelerate's state is a process-wide singleton: the cases run
here, in a process of their own, not in the test process).

Usage: ``python tests/interop/accelerate_cases.py OUT_DIR`` prints one JSON object, case name to result.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import reshard
from reshard.interop.accelerate import use_reshard

OUT = Path(sys.argv[1])
CASES: dict[str, Callable[[Path], Any]] = {}


def case(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
    CASES[fn.__name__] = fn
    return fn


def _job(seed: int = 0, reshard_on: bool = True, **kwargs: Any) -> tuple[Accelerator, Any, Any]:
    torch.manual_seed(seed)
    accelerator = Accelerator(cpu=True, **kwargs)
    if reshard_on:
        use_reshard(accelerator)
    model = torch.nn.Linear(3, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _steps(model: Any, optimizer: Any, n: int) -> torch.Tensor:
    for i in range(n):
        model(torch.ones(2, 3) * (i + 1)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.weight.detach().clone()


def _error(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as exc:  # the verdict is the class's name
        return f"{type(exc).__module__}.{type(exc).__name__}"
    return None


@case
def save_before_the_first_step_changes_nothing(d: Path) -> dict[str, Any]:
    """get_optimizer_state_dict stepped a fresh Adam with zero gradients (step counter 1): training diverged."""
    _, model, optimizer = _job(reshard_on=False)
    plain = _steps(model, optimizer, 3)
    accelerator, model, optimizer = _job()
    accelerator.save_state(str(d / "s"))
    state_after_save = len(optimizer.state)
    saved_run = _steps(model, optimizer, 3)
    accelerator, model, optimizer = _job(seed=1)
    accelerator.load_state(str(d / "s"))
    state_after_load = len(optimizer.state)
    return {
        "state_after_save": state_after_save,
        "same_training": bool(torch.equal(plain, saved_run)),
        "state_after_load": state_after_load,
        "lr_after_load": optimizer.param_groups[0]["lr"],
    }


@case
def a_refused_load_changes_nothing(d: Path) -> dict[str, Any]:
    accelerator, _, _ = _job(reshard_on=False)
    accelerator.save_state(str(d / "plain"))
    accelerator, _, optimizer = _job()
    error = _error(lambda: accelerator.load_state(str(d / "plain")))
    return {"error": error, "state": len(optimizer.state)}


class TwoBranches(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(2, 2)
        self.unused = torch.nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@case
def optimizer_state_for_some_parameters_loads(d: Path) -> dict[str, Any]:
    """A branch that never had a gradient has no momentum: the checkpoint could not be loaded."""
    results = {}
    for optimizer_class in (torch.optim.SGD, torch.optim.Adam):
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        use_reshard(accelerator)
        model = TwoBranches()
        kwargs = {"momentum": 0.9} if optimizer_class is torch.optim.SGD else {}
        model, optimizer = accelerator.prepare(model, optimizer_class(model.parameters(), lr=0.1, **kwargs))
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        accelerator.save_state(str(d / optimizer_class.__name__))
        saved = {name: dict(optimizer.state[p]) for name, p in model.named_parameters() if p in optimizer.state}
        accelerator = Accelerator(cpu=True)
        use_reshard(accelerator)
        model = TwoBranches()
        model, optimizer = accelerator.prepare(model, optimizer_class(model.parameters(), lr=0.1, **kwargs))
        where, loading = str(d / optimizer_class.__name__), accelerator
        error = _error(lambda: loading.load_state(where))  # noqa: B023 (called at once)
        loaded = {name: dict(optimizer.state[p]) for name, p in model.named_parameters() if p in optimizer.state}
        equal = sorted(saved) == sorted(loaded) and all(
            torch.equal(torch.as_tensor(saved[n][k]), torch.as_tensor(loaded[n][k])) for n in saved for k in saved[n]
        )
        results[optimizer_class.__name__] = {"error": error, "states": sorted(loaded), "equal": equal}
    return results


@case
def an_entry_the_model_does_not_have_is_refused(d: Path) -> str | None:
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    use_reshard(accelerator)
    accelerator.prepare(TwoBranches())
    accelerator.save_state(str(d / "s"))
    smaller = torch.nn.Module()
    smaller.used = torch.nn.Linear(2, 2)
    accelerator = Accelerator(cpu=True)
    use_reshard(accelerator)
    accelerator.prepare(smaller)
    return _error(lambda: accelerator.load_state(str(d / "s")))


@case
def a_refused_save_deletes_no_checkpoint(d: Path) -> dict[str, Any]:
    """total_limit removed the oldest good checkpoint before reshard refused the save; a retry the next one."""
    config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    accelerator, model, _ = _job(project_dir=str(d / "p"), project_config=config)
    accelerator.save_state()
    accelerator.save_state()
    other = accelerator.prepare(torch.nn.Linear(3, 3))
    accelerator.prepare(torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1))
    errors = [_error(accelerator.save_state) for _ in range(2)]
    return {"errors": errors, "left": sorted(os.listdir(d / "p" / "checkpoints"))}


@case
def a_model_without_parameters_saves_and_loads(d: Path) -> str | None:
    accelerator, _, _ = _job()
    accelerator.prepare(torch.nn.Identity())
    return _error(lambda: (accelerator.save_state(str(d / "s")), accelerator.load_state(str(d / "s"))))


@case
def arguments(d: Path) -> dict[str, Any]:
    accelerator, _, _ = _job()
    return {
        "path": _error(lambda: (accelerator.save_state(d / "p"), accelerator.load_state(d / "p"))),
        "not_an_accelerator": _error(lambda: use_reshard(object())),  # type: ignore[arg-type]
        "bad_timeout": _error(lambda: use_reshard(Accelerator(cpu=True), timeout=-5)),
    }


@case
def a_directory_with_accelerates_own_model_files_is_refused(d: Path) -> dict[str, Any]:
    accelerator, _, _ = _job(reshard_on=False)
    accelerator.save_state(str(d / "s"))
    before = sorted(os.listdir(str(d / "s")))
    accelerator, _, _ = _job()
    error = _error(lambda: accelerator.save_state(str(d / "s")))
    return {"error": error, "unchanged": sorted(os.listdir(str(d / "s"))) == before}


results: dict[str, Any] = {}
for name, run in CASES.items():
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    try:
        results[name] = run(directory)
    except Exception as exc:  # a case that raised is reported, not hidden
        results[name] = f"raised {type(exc).__name__}: {exc}"
assert reshard is not None
print(json.dumps(results))
