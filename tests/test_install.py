"""The install README.md documents for an existing training environment: a wheel built from the sources
(``make dist`` runs the same pip command) installs into a fresh virtual environment that already has torch,
and works there: the ``reshard`` command, a save and a load, a validation.

The fresh environment gets this test environment's packages (torch and the rest) through a ``.pth`` file,
as a training environment already has them; reshard itself comes only from the wheel.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _run(*argv: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, check=False, cwd=cwd)
    assert done.returncode == 0, f"{argv}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of the tracked sources, built as ``make dist`` builds it, from a copy (a build/ directory
    left in the clone by an earlier build would otherwise add modules that no longer exist)."""
    work = tmp_path_factory.mktemp("build")
    source = work / "source"
    source.mkdir()
    tracked = _run("git", "ls-files", "src", "pyproject.toml", "README.md", cwd=ROOT).split()
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes((ROOT / name).read_bytes())
    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", work, source)
    (built,) = work.glob("reshard-*.whl")
    return built


def test_the_wheel_holds_the_package_and_declares_what_it_needs(wheel: Path) -> None:
    """Every module of src/ and py.typed, nothing else; requirements that this environment's torch, numpy,
    crc32c, xxhash and tqdm satisfy (the torch pin of the Makefile among them), and the s3 / gcs extras pinned to
    the fsspec clients the tests run against."""
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        headers = HeaderParser().parsestr(archive.read(metadata_name).decode())
        entry_points = archive.read(metadata_name.replace("METADATA", "entry_points.txt")).decode()
    packaged = {n for n in names if n.startswith("reshard/")}
    sources = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src" / "reshard").rglob("*.py")}
    assert packaged == sources | {"reshard/py.typed"}
    assert "reshard = reshard.cli:main" in entry_points
    requirements = [Requirement(r) for r in headers.get_all("Requires-Dist")]
    plain = {r.name: r for r in requirements if r.marker is None}
    assert set(plain) == {"torch", "numpy", "crc32c", "xxhash", "tqdm"}
    for name, requirement in plain.items():
        assert requirement.specifier.contains(metadata.version(name), prereleases=True), (name, requirement)
    assert requirements[0].name == "torch"
    assert requirements[0].specifier.contains("2.13.0")
    for extra, client in (("s3", "s3fs"), ("gcs", "gcsfs")):
        wanted = {r.name: r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": extra})}
        assert set(wanted) == {"fsspec", client}
        for name, requirement in wanted.items():
            assert requirement.specifier.contains(metadata.version(name)), (name, requirement)


def test_the_wheel_installs_and_works_in_an_environment_that_has_torch(wheel: Path, tmp_path: Path) -> None:
    """``pip install reshard-*.whl`` into a fresh environment (no reshard in it, torch already there) gives a
    working ``reshard`` command and library: a save, a load and a ``validate`` with the installed copy."""
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index", wheel)
    site = Path(_run(python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    existing = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "training_environment.pth").write_text("".join(f"{p}\n" for p in sorted(existing)))
    script = (
        "import pathlib, sys, torch, reshard\n"
        f"assert pathlib.Path(reshard.__file__).is_relative_to({str(site)!r}), reshard.__file__\n"
        "path = pathlib.Path(sys.argv[1])\n"
        "state = {'w': torch.arange(12.0).reshape(3, 4), 'step': 7}\n"
        "reshard.save(state, path)\n"
        "loaded = reshard.load({'w': torch.zeros(3, 4), 'step': 0}, path)\n"
        "assert torch.equal(loaded['w'], state['w']) and loaded['step'] == 7, loaded\n"
        "print('round trip ok')\n"
    )
    checkpoint = tmp_path / "ckpt"
    assert _run(python, "-I", "-c", script, checkpoint) == "round trip ok\n"
    assert _run(venv / "bin" / "reshard", "--version") == f"reshard {metadata.version('reshard')}\n"
    assert "every checksum checked" in _run(venv / "bin" / "reshard", "validate", checkpoint)
