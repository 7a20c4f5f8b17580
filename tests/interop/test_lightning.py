"""``reshard.interop.lightning``: a real ``pytorch_lightning.Trainer`` on gloo CPU ranks saves through reshard and
resumes at another world size, bit-exact (``tests/interop/lightning_job.py`` is the job, run as a subprocess that
Lightning's own launcher forks its other rank from); and the plugin's contract in one process.

- DDP on 2 ranks with ``ReshardCheckpointIO``: the checkpoint resumes on 1 device; model, optimizer, LR scheduler,
  global step and loop state equal what Lightning's own ``TorchCheckpointIO`` saved at the same moment.
- ``ReshardModelParallelStrategy`` (FSDP2 over a 2-rank data-parallel mesh): resumes on a 1-rank mesh; the full
  model and optimizer state equal those at the save (Lightning's DCP path cannot be compared file to file: its
  checkpoint is DCP's own format).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pytorch_lightning")

import torch

from reshard.errors import CheckpointError, StateDictError
from reshard.interop.lightning import STRUCTURE_KEY, ReshardCheckpointIO

JOB = Path(__file__).with_name("lightning_job.py")
ROOT = Path(__file__).resolve().parents[2]


def _run_job(mode: str, out: Path, devices: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, str(JOB), mode, str(out), str(devices)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, f"{mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=False)  # the test's own records and Lightning's reference file


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal structure and values; tensors bit-exact (torch.equal, same dtype)."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), f"{where}: {list(a)} != {list(b)}"
        for key in b:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(b, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    (out / "keep").mkdir()
    (out / "keep" / "notes.txt").write_text("a person's file next to the checkpoints")
    _run_job("ddp-save", out, 2)
    _run_job("ddp-resume", out, 1)
    return out


@pytest.mark.dist
def test_ddp_checkpoint_holds_what_lightnings_own_io_saves(ddp_run: Path) -> None:
    ours = ReshardCheckpointIO().load_checkpoint(ddp_run / "reshard.ckpt")
    theirs = _load(ddp_run / "torch.ckpt")
    assert (ddp_run / "reshard.ckpt" / "metadata.json").is_file()
    assert_same(ours, theirs)


@pytest.mark.dist
def test_ddp_two_ranks_resume_on_one_bit_exact(ddp_run: Path) -> None:
    resumed = _load(ddp_run / "resumed-1.pt")
    saved = _load(ddp_run / "torch.ckpt")
    assert_same(resumed["state_dict"], saved["state_dict"], "state_dict")
    assert_same(resumed["optimizer"], saved["optimizer_states"][0], "optimizer")
    assert_same(resumed["lr_scheduler"], saved["lr_schedulers"][0], "lr_scheduler")
    assert resumed["global_step"] == saved["global_step"] == 3
    assert resumed["epoch"] == saved["epoch"]
    assert_same(resumed["fit_loop"], saved["loops"]["fit_loop"], "fit_loop")


@pytest.mark.dist
def test_save_top_k_removes_only_reshards_checkpoints(ddp_run: Path) -> None:
    """ModelCheckpoint(save_top_k=1) saved a checkpoint every step and removed the older ones through the plugin:
    the latest is left, and so is a file of someone else in the same directory."""
    left = sorted(p.name for p in (ddp_run / "keep").iterdir())
    assert left == ["epoch=1-step=5.ckpt", "notes.txt"]
    ReshardCheckpointIO().load_checkpoint(ddp_run / "keep" / "epoch=1-step=5.ckpt")


@pytest.mark.dist
def test_model_parallel_fsdp2_two_ranks_resume_on_one_bit_exact(tmp_path: Path) -> None:
    _run_job("mp-save", tmp_path, 2)
    _run_job("mp-resume", tmp_path, 1)
    saved = _load(tmp_path / "saved-mp.pt")
    resumed = _load(tmp_path / "resumed-mp-1.pt")
    assert list(saved["model"]) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert_same(resumed["model"], saved["model"], "model")
    assert_same(resumed["optimizer"], saved["optimizer"], "optimizer")
    assert len(saved["optimizer"]["state"]) == 4
    assert resumed["global_step"] == saved["global_step"] == 3
    assert_same(resumed["fit_loop"], saved["fit_loop"], "fit_loop")


# ---- the plugin in one process ------------------------------------------------------------------------------


def _checkpoint() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {
        "state_dict": {"l.weight": torch.randn(3, 4, generator=gen), "l.bias": torch.randn(3, generator=gen)},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 4, generator=gen)}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}],
            }
        ],
        "epoch": 1,
        "global_step": 4,
        "loops": {"fit_loop": {"state_dict": {}, "progress": [1, 2, {"ready": 3}], "empty": []}},
        "callbacks": {"ModelCheckpoint{'monitor': None}": {"best_model_path": "", "kth_value": torch.tensor(1.5)}},
        "hyper_parameters": {"width": 8, "ratio": float("inf"), "name": None},
    }


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
def test_plugin_round_trips_structure_and_values(tmp_path: Path) -> None:
    io = ReshardCheckpointIO()
    io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")  # saved again in place, as Lightning's last.ckpt is
    loaded = io.load_checkpoint(tmp_path / "a.ckpt", weights_only=True)
    assert_same(loaded, _checkpoint())


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
def test_a_value_without_a_pickle_free_form_is_an_error_naming_its_key(tmp_path: Path) -> None:
    io = ReshardCheckpointIO()
    io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    bad = {**_checkpoint(), "hyper_parameters": {"loss": torch.nn.MSELoss()}}
    with pytest.raises(StateDictError, match=r"hyper_parameters\.loss"):
        io.save_checkpoint(bad, tmp_path / "a.ckpt")
    assert_same(io.load_checkpoint(tmp_path / "a.ckpt"), _checkpoint())  # the earlier save is untouched
    with pytest.raises(StateDictError, match=STRUCTURE_KEY):
        io.save_checkpoint({**_checkpoint(), STRUCTURE_KEY: "x"}, tmp_path / "b.ckpt")


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
def test_options_it_cannot_honour_are_errors(tmp_path: Path) -> None:
    io = ReshardCheckpointIO()
    io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    with pytest.raises(CheckpointError, match="map_location"):
        io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: storage)
    with pytest.raises(CheckpointError, match="storage_options"):
        io.save_checkpoint(_checkpoint(), tmp_path / "b.ckpt", storage_options="fast")
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
def test_remove_deletes_only_what_reshard_wrote(tmp_path: Path) -> None:
    io = ReshardCheckpointIO()
    io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    io.save_checkpoint(_checkpoint(), tmp_path / "b.ckpt")
    (tmp_path / "a.ckpt" / "notes.txt").write_text("mine")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "never-saved.ckpt")
    assert sorted(p.name for p in (tmp_path / "a.ckpt").iterdir()) == ["notes.txt"]
    assert_same(io.load_checkpoint(tmp_path / "b.ckpt"), _checkpoint())


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
def test_model_parallel_strategy_removes_only_what_reshard_wrote(tmp_path: Path) -> None:
    """ModelCheckpoint's save_top_k removes through ``strategy.remove_checkpoint``, which Lightning hands to the
    strategy's CheckpointIO (TorchCheckpointIO: ``fs.rm(path, recursive=True)``, a person's file included)."""
    from reshard.interop.lightning import ReshardModelParallelStrategy

    ReshardCheckpointIO().save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    (tmp_path / "a.ckpt" / "notes.txt").write_text("mine")
    ReshardModelParallelStrategy().remove_checkpoint(tmp_path / "a.ckpt")
    assert sorted(p.name for p in (tmp_path / "a.ckpt").iterdir()) == ["notes.txt"]


# ---- found by the outside attack (issue 35) -----------------------------------------------------------------


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
def test_a_torch_size_value_saves_and_loads(tmp_path: Path) -> None:
    """``save_hyperparameters()`` of a module taking a ``torch.Size``: the save succeeded and no checkpoint of the
    run could be loaded (the structure recorded one value where reshard stored a tuple of sizes)."""
    io = ReshardCheckpointIO()
    hyper = {"input_shape": torch.Size([8, 4]), "empty": torch.Size([])}
    io.save_checkpoint({**_checkpoint(), "hyper_parameters": hyper}, tmp_path / "a.ckpt")
    loaded = io.load_checkpoint(tmp_path / "a.ckpt")
    assert loaded["hyper_parameters"] == {"input_shape": (8, 4), "empty": ()}
    assert_same(loaded["state_dict"], _checkpoint()["state_dict"])


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
def test_removing_lightnings_link_to_a_checkpoint_removes_the_link_only(tmp_path: Path) -> None:
    """``ModelCheckpoint(save_last="link")`` with a step in the last name removes the previous link: it raised
    CheckpointError (reshard deletes nothing through a link) and ended ``fit``."""
    io = ReshardCheckpointIO()
    io.save_checkpoint(_checkpoint(), tmp_path / "step=1.ckpt")
    (tmp_path / "last-step=1.ckpt").symlink_to("step=1.ckpt")
    io.remove_checkpoint(tmp_path / "last-step=1.ckpt")
    assert not (tmp_path / "last-step=1.ckpt").is_symlink()
    assert_same(io.load_checkpoint(tmp_path / "step=1.ckpt"), _checkpoint())


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
def test_a_missing_checkpoint_or_a_bad_device_is_a_reshard_error(tmp_path: Path) -> None:
    from reshard.errors import CheckpointNotFoundError

    io = ReshardCheckpointIO()
    with pytest.raises(CheckpointNotFoundError):  # also the FileNotFoundError Lightning expects
        io.load_checkpoint(tmp_path / "missing.ckpt")
    torch.save(_checkpoint(), tmp_path / "torch.ckpt")  # Lightning's own TorchCheckpointIO file
    with pytest.raises(CheckpointNotFoundError, match="not a checkpoint directory"):
        io.load_checkpoint(tmp_path / "torch.ckpt")
    io.save_checkpoint(_checkpoint(), tmp_path / "a.ckpt")
    for device in ("bogus", "meta") + (() if torch.cuda.is_available() else ("cuda:0",)):
        with pytest.raises(CheckpointError, match="map_location"):
            io.load_checkpoint(tmp_path / "a.ckpt", map_location=device)


def _forge(path: Path, change: Any) -> None:
    """Rewrite ``path``'s metadata.json by ``change(document)`` and seal it again (a hostile, valid document)."""
    import json

    from reshard.metadata.wire import seal_document

    document = json.loads((path / "metadata.json").read_text())
    del document["metadata_crc32c"]
    change(document)
    (path / "metadata.json").write_bytes(seal_document(json.dumps(document).encode()))


def _structure(record: Any) -> Any:
    import json

    text = record if isinstance(record, str) else json.dumps(record)
    return lambda document: document["common"].__setitem__(STRUCTURE_KEY, text)


def _huge(document: dict[str, Any]) -> None:
    """A consistent forgery of a 256 GiB tensor: shape, box, byte length, checksum chunk and file size agree."""
    n = 2**36
    tensor = document["tensors"]["state_dict.layer.weight"]
    tensor["global_shape"] = [n]
    tensor["boxes"][0].update(shape=[n], offset=[0], byte_length=4 * n)
    document["checksum"]["chunk_bytes"] = 2**62
    for entry in document["files"]:
        entry["size"] = 4 * n


@pytest.mark.dist  # importing Lightning takes seconds: not for the fast tier
@pytest.mark.parametrize(
    "change",
    [
        _structure("[" * 100_000 + "]" * 100_000),
        _structure({"dict": [[["unhashable"], "value"]]}),
        _structure({"dict": 5}),
        _structure({"dict": [["half a pair"]]}),
        _structure({"set": ["value"]}),
        _structure({"dict": [["epoch", "value"], ["epoch", "value"]]}),
        _structure({"dict": [["epoch", "value"]]}),  # the tensors left out
        _huge,
    ],
    ids=[
        "deep",
        "unhashable-key",
        "children-not-a-list",
        "half-pair",
        "unknown-kind",
        "key-twice",
        "tensors-dropped",
        "huge",
    ],
)
def test_a_forged_structure_or_shape_is_a_checkpoint_error_before_anything_is_allocated(
    tmp_path: Path, change: Any
) -> None:
    io = ReshardCheckpointIO()
    checkpoint = {"state_dict": {"layer.weight": torch.ones(2, 3)}, "epoch": 0}
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    _forge(tmp_path / "a.ckpt", change)
    with pytest.raises(CheckpointError):
        io.load_checkpoint(tmp_path / "a.ckpt")
