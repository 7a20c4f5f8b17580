"""What a newcomer trips on, each an error or a warning instead of a silent outcome: a project directory
mistaken for an interrupted save (and gc deleting its files), meta-device templates, lossy dtype casts, and a
manager that resumes from an older step without saying why."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.cli import main
from reshard.errors import CheckpointNotFoundError, IncompleteCheckpointError, MismatchError, StateDictError
from reshard.flows.maintenance import collect_garbage
from reshard.io.locking import LOCK_FILE, LockInfo, machine_identity, pid_namespace
from reshard.state.dtypes import is_lossy_cast


def _old(path: Path) -> None:
    os.utime(path, (1_000_000_000, 1_000_000_000))


@pytest.mark.unit
def test_a_directory_with_its_own_data_folder_is_not_an_interrupted_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A project directory with ``data/train.csv`` is "not a reshard checkpoint", not an interrupted save, and
    ``reshard gc --incomplete`` refuses it (exit 3) and deletes nothing."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    csv = project / "data" / "train.csv"
    csv.write_text("a,b\n1,2\n")
    _old(csv)
    with pytest.raises(CheckpointNotFoundError, match="is not a reshard checkpoint"):
        reshard.read_metadata(project)
    with pytest.raises(CheckpointNotFoundError):
        collect_garbage(project, include_incomplete=True, min_age_s=0)
    assert main(["gc", str(project), "--incomplete", "--min-age", "0"]) == 3
    assert "not a reshard checkpoint" in capsys.readouterr().err
    assert csv.read_text() == "a,b\n1,2\n"


@pytest.mark.dist
def test_gc_of_an_interrupted_save_removes_only_the_files_a_save_names(tmp_path: Path) -> None:
    """An interrupted save (a data file named as a save names it, no metadata.json, the lock of the save that
    died) is incomplete; gc --incomplete removes that file and the lock, and leaves a file a person put beside
    it; without the lock that names the save, nothing ties the file to it, and gc removes nothing."""
    ckpt = tmp_path / "ckpt"
    save_id = reshard.save({"w": torch.ones(4)}, ckpt).save_id
    (ckpt / "metadata.json").unlink()  # as if the save died before its commit ...
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
    )
    lock = LockInfo(
        host=socket.gethostname(),
        machine=machine_identity(),
        pid_namespace=pid_namespace(),
        pid=int(dead.stdout),
        token=save_id,
        created=1_000_000_000.0,
    )
    (ckpt / LOCK_FILE).write_bytes(lock.to_bytes())  # ... leaving its lock
    foreign = ckpt / "data" / "notes.txt"
    foreign.write_text("mine")
    for name in (ckpt / "data").iterdir():
        _old(name)
    with pytest.raises(IncompleteCheckpointError):
        reshard.read_metadata(ckpt)
    (ckpt / LOCK_FILE).rename(tmp_path / "lock")
    with pytest.raises(IncompleteCheckpointError, match="nothing ties"):
        collect_garbage(ckpt, include_incomplete=True, min_age_s=0)
    (tmp_path / "lock").rename(ckpt / LOCK_FILE)
    removed = collect_garbage(ckpt, include_incomplete=True, min_age_s=0)
    assert len(removed) == 2 and removed[0].startswith(f"data/{save_id}-") and removed[1] == LOCK_FILE
    assert sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*")) == ["data", "data/notes.txt"]


@pytest.mark.unit
def test_a_meta_device_template_is_an_error_not_a_silent_no_op(tmp_path: Path) -> None:
    reshard.save({"w": torch.arange(6.0), "b": torch.ones(2)}, tmp_path / "ckpt")
    stats = reshard.LoadStats()
    template = {"w": torch.empty(6, device="meta"), "b": torch.zeros(2)}
    with pytest.raises(StateDictError, match=r"meta device.*'w'"):
        reshard.load(template, tmp_path / "ckpt", stats=stats)
    assert stats.bytes_read == 0


@pytest.mark.unit
def test_lossy_dtype_casts_need_an_opt_in(tmp_path: Path) -> None:
    """float -> int (truncation) and int64 -> int32 are MismatchErrors unless allow_lossy_cast; precision
    changes of floats and widening integer casts load as before."""
    values = torch.tensor([1.75, -2.5, 3.25])
    reshard.save({"f": values, "i": torch.tensor([1, 2**40, 3])}, tmp_path / "ckpt")
    with pytest.raises(MismatchError, match=r"'f': saved dtype float32, requested int64: a lossy conversion"):
        reshard.load({"f": torch.zeros(3, dtype=torch.int64)}, tmp_path / "ckpt")
    with pytest.raises(MismatchError, match=r"'i': saved dtype int64, requested int32"):
        reshard.load({"i": torch.zeros(3, dtype=torch.int32)}, tmp_path / "ckpt")
    lossy = reshard.LoadOptions(allow_lossy_cast=True)
    truncated = reshard.load({"f": torch.zeros(3, dtype=torch.int64)}, tmp_path / "ckpt", options=lossy)
    assert truncated["f"].tolist() == [1, -2, 3]
    fine = reshard.load({"f": torch.zeros(3, dtype=torch.bfloat16)}, tmp_path / "ckpt")
    assert torch.equal(fine["f"], values.to(torch.bfloat16))
    assert is_lossy_cast(torch.float32, torch.int64) and is_lossy_cast(torch.int64, torch.int32)
    assert is_lossy_cast(torch.int8, torch.uint8) and is_lossy_cast(torch.complex64, torch.float32)
    assert is_lossy_cast(torch.int32, torch.bool)
    assert not is_lossy_cast(torch.int32, torch.int64) and not is_lossy_cast(torch.float32, torch.bfloat16)
    assert not is_lossy_cast(torch.int64, torch.float32) and not is_lossy_cast(torch.uint8, torch.int16)


@pytest.mark.unit
def test_the_manager_says_which_newer_steps_it_skipped(tmp_path: Path) -> None:
    """Step 3's metadata.json does not parse and step 4 was interrupted: load_latest_with_state resumes step 2,
    warning about both and listing them in ``skipped``, newest first."""
    manager = reshard.CheckpointManager(tmp_path / "run")
    for step in (1, 2, 3, 4):
        manager.save(step, {"w": torch.full((2,), float(step))})
    (tmp_path / "run" / "step_000000003" / "metadata.json").write_text("{ not json")
    (tmp_path / "run" / "step_000000004" / "metadata.json").unlink()
    skipped: list[tuple[int, str]] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = manager.load_latest_with_state({"w": torch.zeros(2)}, skipped=skipped)
    assert found is not None and found[0] == 2 and torch.equal(found[1]["w"], torch.full((2,), 2.0))
    assert [step for step, _ in skipped] == [4, 3]
    assert "no metadata.json" in skipped[0][1] and "metadata.json" in skipped[1][1]
    messages = [str(w.message) for w in caught if "skipping checkpoint" in str(w.message)]
    assert len(messages) == 2 and "step_000000004" in messages[0] and "step_000000003" in messages[1]


@pytest.mark.unit
def test_ranks_started_by_a_launcher_without_a_process_group_are_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun (WORLD_SIZE=2) without init_process_group, each rank would save alone as "rank 0":
    instead every collective call says what is missing."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(reshard.CheckpointError, match=r"WORLD_SIZE=2 .*torch.distributed is not initialised"):
        reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.setenv("WORLD_SIZE", "1")
    reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt")


@pytest.mark.unit
def test_a_collective_timeout_says_every_rank_must_call(tmp_path: Path) -> None:
    """Only rank 0 of a group of two calls save: it fails after the timeout, saying that every rank must
    make the same call."""
    from reshard.net.transports import ThreadGroup

    group = ThreadGroup(2, timeout=0.5)
    with pytest.raises(reshard.CheckpointError, match="every rank of the group must make the same reshard call"):
        reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt", group=group.member(0), timeout=0.5)
    assert not (tmp_path / "ckpt" / "metadata.json").exists()


@pytest.mark.dist
def test_a_missing_bucket_or_root_is_one_line_naming_it(
    object_store: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bucket that does not exist: CheckpointNotFoundError naming it, from the API and the manager, and one
    line with exit 3 from the commands; a missing local root for ``ls`` and a missing path for ``validate``
    are exit 3 too, not "0 step directories" or a list of problems."""
    url = f"{object_store.protocol}://no-such-bucket-for-reshard/ckpt"
    options = object_store.storage_options
    with pytest.raises(CheckpointNotFoundError, match="the bucket 'no-such-bucket-for-reshard' does not exist"):
        reshard.read_metadata(url, storage_options=options)
    with pytest.raises(CheckpointNotFoundError, match="no-such-bucket-for-reshard"):
        reshard.CheckpointManager(url, storage_options=options).steps()
    flags = [f"--storage-option={key}={json.dumps(value)}" for key, value in options.items()]
    for command in (["inspect", url], ["ls", url], ["validate", url]):
        assert main([*command, *flags]) == 3, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "no-such-bucket-for-reshard" in err[0], (command, err)
    assert main(["ls", str(tmp_path / "nowhere")]) == 3
    assert "does not exist" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "nowhere")]) == 3
    assert "checked" not in capsys.readouterr().out


@pytest.mark.dist
def test_strided_loads_from_object_stores_make_few_large_gets(object_store: Any, tmp_path: Path) -> None:
    """A column slice of a row-major tensor is 2048 strided runs. From an object store the default merges
    them into a few large ranged GETs (the gaps cost less than requests); an explicit
    max_read_amplification=1.0 still reads exact runs, one request each; a local file keeps exact reads."""
    full = torch.arange(2048 * 64, dtype=torch.float32).view(2048, 64)
    url = f"{object_store.protocol}://{object_store.new_bucket()}/ckpt"
    options = object_store.storage_options
    reshard.save({"w": full}, url, storage_options=options)
    reshard.save({"w": full}, tmp_path / "local")

    def load(source: Any, **kwargs: Any) -> reshard.LoadStats:
        stats = reshard.LoadStats()
        template = {"w": reshard.ShardedTensor("w", torch.empty(2048, 16), (2048, 64), (0, 16))}
        loaded = reshard.load(template, source, stats=stats, **kwargs)
        assert torch.equal(loaded["w"], full[:, 16:32])
        return stats

    merged = load(url, storage_options=options)
    assert merged.read_requests <= 4, merged.read_requests
    exact = load(url, storage_options=options, options=reshard.LoadOptions(max_read_amplification=1.0))
    assert exact.read_requests >= 2048 and exact.bytes_read == exact.bytes_needed
    local = load(tmp_path / "local")
    assert local.bytes_read <= 1.1 * local.bytes_needed


@pytest.mark.unit
def test_usage_mistakes_are_one_line_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed --storage-option and a demo layout the model cannot run are usage errors (exit 2, one
    line, before anything starts); an existing destination names the command-line flag."""
    reshard.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    assert main(["inspect", str(tmp_path / "ckpt"), "--storage-option", "novalue"]) == 2
    assert "--storage-option expects KEY=VALUE" in capsys.readouterr().err
    assert main(["demo", "--layout-a", "tp=3", "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tp=3" in err[0] and not (tmp_path / "demo").exists()
    reshard.save({"w": torch.ones(2)}, tmp_path / "other")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "other")]) == 3
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["demo", "--help"], ["gc", "--help"]])
def test_the_command_line_answers_help_and_version_without_importing_torch(argv: list[str]) -> None:
    """``reshard --help`` and ``--version`` must not pay the seconds of importing torch: the package's
    public names and each subcommand's work are imported on first use. A fresh interpreter proves it."""
    probe = (
        "import sys\n"
        "from reshard.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "heavy = ('torch', 'numpy', 'reshard.flows.load', 'reshard.flows.save')\n"
        "heavy = sorted(m for m in heavy if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    assert "reshard" in _in_a_fresh_interpreter(probe)


@pytest.mark.dist
def test_the_package_imports_its_public_names_on_first_use() -> None:
    """``import reshard`` stays light, and the functions named like their modules (``save``, ``load``,
    ``async_save``, ``transfer``) stay functions even when their module was imported first (as every internal
    import does)."""
    probe = (
        "import sys, types\n"
        "import reshard\n"
        "assert 'torch' not in sys.modules\n"
        "import reshard.flows.save, reshard.flows.load, reshard.flows.async_save, reshard.flows.transfer\n"
        "for name in ('save', 'load', 'async_save', 'transfer'):\n"
        "    assert not isinstance(getattr(reshard, name), types.ModuleType), name\n"
        "    assert callable(getattr(reshard, name)), name\n"
        "for name in reshard.__all__:\n"
        "    assert getattr(reshard, name) is not None, name\n"
        "assert set(reshard.__all__) <= set(dir(reshard))\n"
        "try:\n"
        "    reshard.no_such_name\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
    )
    _in_a_fresh_interpreter(probe)


@pytest.mark.dist
def test_a_moved_module_imports_from_its_old_path_with_a_warning() -> None:
    """docs/api.md "Moved modules": an old module path (``reshard.manager``, ``reshard.transports.ThreadGroup``,
    a submodule of a moved package) is the module at its new path, not a second copy, and warns once."""
    probe = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "import reshard.flows.manager, reshard.net.transports\n"
        "try:\n"
        "    import reshard.manager\n"
        "except DeprecationWarning as warning:\n"
        "    assert 'reshard.flows.manager' in str(warning), warning\n"
        "else:\n"
        "    raise AssertionError('no DeprecationWarning')\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "import reshard.manager\n"
        "from reshard.transports import ThreadGroup\n"
        "import sys\n"
        "assert sys.modules['reshard.manager'] is reshard.flows.manager\n"
        "assert ThreadGroup is reshard.net.transports.ThreadGroup\n"
        "import reshard.statedict, reshard.state.statedict\n"
        "assert sys.modules['reshard.statedict'] is reshard.state.statedict\n"
        "import reshard\n"
        "assert callable(reshard.save) and callable(reshard.transfer)\n"
        # the alias leaves the module its own spec: find_spec and reload of the new path still work
        "import importlib, importlib.util\n"
        "assert reshard.flows.manager.__spec__.name == 'reshard.flows.manager'\n"
        "assert importlib.util.find_spec('reshard.flows.manager').name == 'reshard.flows.manager'\n"
        "old_class = reshard.flows.manager.CheckpointManager\n"
        "assert importlib.reload(reshard.flows.manager).CheckpointManager is not old_class\n"
        # modules moved before the folders keep their old paths too
        "import reshard.demo.parallel, reshard.boxes, reshard.planning.tiling\n"
        "assert sys.modules['reshard.demo.parallel'] is sys.modules['reshard.models.parallel']\n"
        "assert sys.modules['reshard.boxes'] is sys.modules['reshard.geometry.boxes']\n"
    )
    _in_a_fresh_interpreter(probe)


def _in_a_fresh_interpreter(probe: str) -> str:
    """Run ``probe`` in a new Python process (nothing imported yet); its stdout. Fails on a failed probe."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


class _RecordedProgress:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def start(self, total_bytes: int, description: str) -> None:
        self.calls.append((f"start {description}", total_bytes))

    def advance(self, nbytes: int) -> None:
        self.calls.append(("advance", nbytes))

    def finish(self) -> None:
        self.calls.append(("finish", 0))


@pytest.mark.unit
def test_diff_compares_bytes_first_and_values_where_bytes_differ(tmp_path: Path) -> None:
    """``diff`` compares same-dtype slabs byte for byte and converts only those that differ: values that are
    equal with different bytes (-0.0 and 0.0, NaNs with different payloads) stay equal, and a difference in
    one slab among equal ones is counted exactly."""
    from reshard.interop.diff import diff_checkpoints

    base = torch.arange(4096, dtype=torch.float32)
    changed = base.clone()
    changed[3000] += 0.5  # one element in the third 1 KiB slab (128 float64 per slab)
    changed[3001] -= 2.0
    zeros = torch.zeros(256)
    negative_zeros = -torch.zeros(256)
    nan_a = torch.full((64,), float("nan"))
    nan_b = nan_a.view(torch.int32).bitwise_or(1).view(torch.float32)  # another NaN payload
    assert torch.isnan(nan_b).all() and not torch.equal(nan_a.view(torch.int32), nan_b.view(torch.int32))
    reshard.save({"w": base, "z": zeros, "n": nan_a}, tmp_path / "a")
    reshard.save({"w": changed, "z": negative_zeros, "n": nan_b}, tmp_path / "b")
    progress = _RecordedProgress()
    report = diff_checkpoints(tmp_path / "b", tmp_path / "a", slab_bytes=1024, progress=progress)
    tensors = {t.key: t for t in report.tensors}
    assert tensors["w"].mismatched == 2 and tensors["w"].max_abs == 2.0
    assert tensors["w"].max_rel == pytest.approx(2.0 / 3001)
    assert tensors["z"].problem is None and tensors["z"].max_abs == 0.0
    assert tensors["n"].problem is None and tensors["n"].max_abs == 0.0
    assert progress.calls[0] == ("start diff", 2 * 4 * (4096 + 256 + 64))
    assert sum(n for what, n in progress.calls if what == "advance") == progress.calls[0][1]
    assert progress.calls[-1][0] == "finish"
    assert diff_checkpoints(tmp_path / "a", tmp_path / "a", slab_bytes=1024).ok


@pytest.mark.unit
def test_validate_reports_progress_and_is_quiet_on_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``validate`` tells a progress object the bytes it checks (the command line draws the bar on a
    terminal); ``-q`` leaves only problems on stdout, and the exit code says the outcome."""
    from reshard.flows.maintenance import validate_checkpoint

    reshard.save({"w": torch.randn(64, 64), "b": torch.randn(64)}, tmp_path / "ckpt")
    metadata = reshard.read_metadata(tmp_path / "ckpt")
    stored = sum(box.byte_length for tensor in metadata.tensors.values() for box in tensor.boxes)
    progress = _RecordedProgress()
    assert validate_checkpoint(tmp_path / "ckpt", progress=progress) == []
    assert progress.calls[0] == ("start validate", stored)
    assert sum(n for what, n in progress.calls if what == "advance") == stored
    assert progress.calls[-1][0] == "finish"
    assert main(["validate", str(tmp_path / "ckpt"), "-q"]) == 0
    assert capsys.readouterr().out == ""
    data = next((tmp_path / "ckpt" / "data").iterdir())
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["validate", str(tmp_path / "ckpt"), "-q"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("PROBLEM: ") and out.count("\n") == 1
