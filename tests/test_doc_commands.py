"""The command-line examples of README.md and docs/*.md, run as written.

Every fenced block of README.md, docs/*.md and benchmarks/README.md carries a marker on the line before
its fence that says how it is checked:

- ``<!-- example: run -->``: a Python block, run by tests/test_docs.py.
- ``<!-- signature: NAME -->``: a signature, compared by tests/test_docs.py.
- ``<!-- example: sh setup=A,B -->``: ``reshard`` commands, one per line, run in this process in a fresh
  directory that the named setups prepared (``ckpt``: the quickstart's checkpoint; ``run``: a manager root;
  ``dcp``: DCP checkpoints; ``s3``/``gcs``: a bucket on the test servers, see below). Exit 0, or 1 for
  ``diff`` and ``validate`` (a difference or a problem, which some examples show on purpose).
- ``<!-- example: transcript setup=... -->``: ``$ reshard ...`` lines run the same way; the lines after
  each are its expected output, ``...`` standing for any number of lines.
- ``<!-- example: bash setup=... ports=P,Q -->``: a shell session, run by bash with the virtual environment's
  commands on PATH; each port P is replaced by a free one (the servers it starts must not collide with
  anything on the machine), and background jobs are killed at the end.
- ``<!-- example: options -->``: synopses: every ``--option`` of each line is one the command accepts.
- ``<!-- example: not run: REASON -->``: the reason says why it cannot run here and what checks it instead.

The ``s3`` and ``gcs`` setups point the clients at the session's moto and fake-gcs-server through the
clients' environment (``AWS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``), replace ``http://127.0.0.1:9000``
with moto's address and the bucket names ``bucket`` and ``my-bucket`` with a fresh bucket, which holds a
copy of the quickstart checkpoint under ``ckpt``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.cli import build_parser, main
from tests.doc_blocks import MARKED_DOCS, ROOT, fenced_blocks, marked_blocks
from tests.threads import on_threads

SH_MARK = re.compile(r"<!-- example: sh(?: setup=([\w,]+))? -->")
TRANSCRIPT_MARK = re.compile(r"<!-- example: transcript(?: setup=([\w,]+))? -->")
BASH_MARK = re.compile(r"<!-- example: bash( [\w=, ]+)? -->")
OPTIONS_MARK = re.compile(r"<!-- example: options() -->")
KNOWN_MARKS = [
    re.compile(r"<!-- example: run(?: needs=[\w.]+)? -->"),
    re.compile(r"<!-- signature: [\w.]+ -->"),
    SH_MARK,
    TRANSCRIPT_MARK,
    BASH_MARK,
    OPTIONS_MARK,
    re.compile(r"<!-- example: not run: .{20,} -->"),
]
CODE_LANGUAGES = {"python", "sh", "bash", "json"}
"""Blocks in these languages are examples; a block without a language is a picture or an output."""
DIFFERENCE_EXITS = {"diff": {0, 1}, "validate": {0, 1}}
"""Commands whose exit 1 is an outcome, not a failure (docs/cli.md, "Exit codes")."""


@pytest.mark.unit
def test_every_block_says_how_it_is_checked() -> None:
    """A new example cannot go unchecked by accident: it is run, compared, or says why not."""
    unmarked = [
        f"{where} ({language or 'no language'}): the line before the fence is {before!r}"
        for where, before, language in fenced_blocks()
        if language in CODE_LANGUAGES and not any(mark.fullmatch(before) for mark in KNOWN_MARKS)
    ]
    assert not unmarked, "every block needs a marker (see this module's docstring):\n" + "\n".join(unmarked)


# ---- setups -------------------------------------------------------------------------------------


@dataclass
class Session:
    """One block's run: its directory, the fixtures it may start, and the text replacements."""

    cwd: Path
    request: pytest.FixtureRequest
    monkeypatch: pytest.MonkeyPatch
    replacements: dict[str, str] = field(default_factory=dict)

    def rewrite(self, line: str) -> str:
        for old, new in self.replacements.items():
            line = line.replace(old, new)
        return line


def _quickstart() -> Any:
    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples" / "quickstart.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setup_ckpt(session: Session) -> None:
    """``ckpt``: the checkpoint examples/quickstart.py saves on 4 ranks (here 4 threads of one process,
    the same protocol and files), as README.md's tour uses it."""
    from reshard.net.transports import ThreadGroup

    if (session.cwd / "ckpt").exists():
        return
    quickstart = _quickstart()
    group = ThreadGroup(4)
    on_threads(4, lambda r: reshard.save(quickstart.state_of_4(r), session.cwd / "ckpt", group=group.member(r)))


def setup_ckpt_bf16(session: Session) -> None:
    """``ckpt_bf16``: the quickstart checkpoint cast to bf16 (as docs/cli.md's convert example makes it)."""
    from reshard.interop import convert_checkpoint

    setup_ckpt(session)
    convert_checkpoint(session.cwd / "ckpt", session.cwd / "ckpt_bf16", dtype=torch.bfloat16)


NAMES_JSON = {"model.embed.weight": "model.embed_tokens.weight", "optimizer.step": None}
"""docs/cli.md's key map (its comment shows it)."""


def setup_run(session: Session) -> None:
    """``run``: a manager root with steps 100, 200 and 1000 of a small model whose keys start with
    ``model.``, and ``names.json``, the key map of docs/cli.md's export example."""
    manager = reshard.CheckpointManager(session.cwd / "run")
    generator = torch.Generator().manual_seed(0)
    embed, layer = torch.randn(16, 8, generator=generator), torch.randn(8, 8, generator=generator)
    for step in (100, 200, 1000):
        state = {
            "model": {"embed": {"weight": embed * step}, "layer": {"weight": layer + step}},
            "optimizer": {"step": torch.tensor(float(step))},
        }
        manager.save(step, state)
    manager.close()
    (session.cwd / "names.json").write_text(json.dumps(NAMES_JSON))


def setup_dcp(session: Session) -> None:
    """``dcp``: torch.distributed.checkpoint directories under the names the examples use."""
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"model": {"weight": torch.arange(12.0).reshape(3, 4)}, "step": 500}
    for name in ("old-dcp-checkpoint", "ckpts/dcp/step_500", "OLD_DCP_DIR"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.save(state, checkpoint_id=str(session.cwd / name), no_dist=True)


def _object_store(session: Session, protocol: str, fixture: str, env: dict[str, str], options: Any) -> None:
    from reshard.interop import convert_checkpoint

    server = session.request.getfixturevalue(fixture)
    bucket = server.new_bucket("docs")
    for name, value in env.items():
        session.monkeypatch.setenv(name, value.format(url=server.endpoint_url))
    for named in ("bucket", "my-bucket"):
        session.replacements[f"{protocol}://{named}/"] = f"{protocol}://{bucket}/"
    setup_ckpt(session)
    convert_checkpoint(session.cwd / "ckpt", f"{protocol}://{bucket}/ckpt", dst_storage_options=options)


def setup_s3(session: Session) -> None:
    session.replacements["http://127.0.0.1:9000"] = session.request.getfixturevalue("s3_server").endpoint_url
    env = {"AWS_ENDPOINT_URL": "{url}", "AWS_ACCESS_KEY_ID": "docs", "AWS_SECRET_ACCESS_KEY": "docs"}
    _object_store(session, "s3", "s3_server", env, None)


def setup_gcs(session: Session) -> None:
    _object_store(session, "gs", "gcs_server", {"STORAGE_EMULATOR_HOST": "{url}"}, {"token": "anon"})


SETUPS: dict[str, Callable[[Session], None]] = {
    "ckpt": setup_ckpt,
    "ckpt_bf16": setup_ckpt_bf16,
    "run": setup_run,
    "dcp": setup_dcp,
    "s3": setup_s3,
    "gcs": setup_gcs,
}


@pytest.fixture
def session(tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Session:
    monkeypatch.chdir(tmp_path)
    return Session(tmp_path, request, monkeypatch)


def _prepare(session: Session, setups: str | None) -> None:
    for name in (setups or "").split(","):
        if name:
            SETUPS[name](session)


def _run_reshard(session: Session, line: str, capsys: pytest.CaptureFixture[str], where: str) -> str:
    """One ``reshard ...`` line, in this process; its stdout."""
    argv = shlex.split(session.rewrite(line), comments=True)
    assert argv[0] == "reshard", f"{where}: {line!r} is not a reshard command"
    capsys.readouterr()
    code = main(argv[1:])
    out, err = capsys.readouterr()
    allowed = DIFFERENCE_EXITS.get(argv[1], {0})
    assert code in allowed, f"{where}: {line!r} exited {code}\nstdout:\n{out}\nstderr:\n{err}"
    return out


@pytest.mark.dist
@pytest.mark.parametrize(("where", "setups", "block"), marked_blocks(SH_MARK))
def test_command_example_runs(
    where: str, setups: str | None, block: str, session: Session, capsys: pytest.CaptureFixture[str]
) -> None:
    _prepare(session, setups)
    lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines, where
    for line in lines:
        _run_reshard(session, line, capsys, where)


def _matches(expected: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` is ``expected`` with each ``...`` standing for any number of lines."""
    if not expected:
        return not actual
    if expected[0].strip() == "...":
        return any(_matches(expected[1:], actual[i:]) for i in range(len(actual) + 1))
    return bool(actual) and actual[0].rstrip() == expected[0].rstrip() and _matches(expected[1:], actual[1:])


@pytest.mark.unit
@pytest.mark.parametrize(("where", "setups", "block"), marked_blocks(TRANSCRIPT_MARK))
def test_transcript_example_prints_what_it_shows(
    where: str, setups: str | None, block: str, session: Session, capsys: pytest.CaptureFixture[str]
) -> None:
    _prepare(session, setups)
    steps: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        else:
            assert steps, f"{where}: output before the first command"
            steps[-1][1].append(line)
    for command, expected in steps:
        actual = _run_reshard(session, command, capsys, where).splitlines()
        assert _matches(expected, actual), f"{where}: {command!r} printed\n" + "\n".join(actual)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.dist
@pytest.mark.parametrize(("where", "options", "block"), marked_blocks(BASH_MARK))
def test_shell_session_example_runs(where: str, options: str | None, block: str, session: Session) -> None:
    settings = dict(item.split("=", 1) for item in (options or "").split())
    _prepare(session, settings.get("setup"))
    for port in filter(None, settings.get("ports", "").split(",")):
        block = re.sub(rf"\b{port}\b", str(_free_port()), block)
    script = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + block
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-c", script], cwd=session.cwd, env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, f"{where}: exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}"


def _reshard_options() -> dict[str, set[str]]:
    """Every subcommand's option strings (and the top level's under "")."""
    parser = build_parser()
    found = {"": {s for action in parser._actions for s in action.option_strings}}
    for action in parser._actions:
        for name, sub in (getattr(action, "choices", None) or {}).items():
            found[name] = {s for a in sub._actions for s in a.option_strings}
    return found


@pytest.mark.dist
@pytest.mark.parametrize(("where", "unused", "block"), marked_blocks(OPTIONS_MARK, MARKED_DOCS))
def test_synopsis_names_only_real_options(where: str, unused: str | None, block: str) -> None:
    known = _reshard_options()
    script_help: dict[str, str] = {}
    problems = []
    for line in block.replace("\\\n", " ").splitlines():
        argv = [w.strip("[]") for w in shlex.split(line, comments=True)]
        if not argv:
            continue
        if argv[0] == "reshard":
            accepted = known[""] | known[argv[1]]
            problems += [
                f"{line!r}: reshard {argv[1]} has no {w}"
                for w in argv
                if w.startswith("-") and w.split("=")[0] not in accepted
            ]
        elif argv[0].endswith("python") and argv[1].endswith(".py"):
            if argv[1] not in script_help:
                script_help[argv[1]] = subprocess.run(
                    [sys.executable, argv[1], "--help"],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=120,
                    check=True,
                ).stdout
            problems += [
                f"{line!r}: {argv[1]} has no {w}"
                for w in argv
                if w.startswith("--") and w.split("=")[0] not in script_help[argv[1]]
            ]
        else:
            problems.append(f"{line!r}: not a reshard command or a Python script")
    assert not problems, f"{where}:\n" + "\n".join(problems)


@pytest.mark.unit
def test_the_format_example_is_what_two_ranks_write(tmp_path: Path) -> None:
    """docs/format.md section 12: its Python block, run by two ranks (threads of this process, the same
    protocol and files), writes the document shown there, member for member: the same tensors, boxes, byte
    offsets, sizes, checksums, objects and common values. Only what changes with every save or release
    differs: the save id (and so the file names), the version (3 now, with its checksum member), the
    library version."""
    from reshard.net.transports import ThreadGroup

    (python_block,) = marked_blocks(re.compile(r"<!-- example: (not run: the save of section 12.*) -->"))
    code = python_block.values[2]
    (json_block,) = marked_blocks(re.compile(r"<!-- example: (not run: the document of section 12.*) -->"))
    shown = json.loads(json_block.values[2])
    group = ThreadGroup(2)
    path = tmp_path / "ckpt"

    class RankReshard:
        """``reshard`` as the block sees it on one rank: its save goes to this test's path and group."""

        def __init__(self, rank: int) -> None:
            self.rank = rank

        def __getattr__(self, name: str) -> Any:
            return getattr(reshard, name)

        def save(self, state: Any, _where: str, **kwargs: Any) -> Any:
            return reshard.save(state, path, group=group.member(self.rank), **kwargs)

    on_threads(
        2,
        lambda r: exec(
            compile(code, "docs/format.md", "exec"), {"torch": torch, "reshard": RankReshard(r)} | {"rank": r}
        ),
    )
    written = json.loads((path / "metadata.json").read_text().rsplit(',"', 1)[0] + "}")
    for document in (shown, written):
        document.pop("version"), document.pop("created_by")
        save_id = document.pop("save_id")
        for entry in document["files"]:
            entry["path"] = entry["path"].replace(save_id, "SAVE_ID")
    assert written == shown
