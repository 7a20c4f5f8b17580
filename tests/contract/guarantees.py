"""The guarantees, written once: functions over what a flow returned (each rank's *answer*) and what is on
disk, each returning ``None`` when the guarantee holds or a :class:`Finding` that says how it broke.

Every fault source of the contract suite (kills, damage, hostile documents, disagreeing options, misuse)
checks its flows with these functions and no others, so that a guarantee means the same for every flow.

An *answer* is a rank's report of its flow: ``{"ok": True}`` or ``{"error": class name, "message": ...}``
(``"other"`` holds the traceback when the exception was not a reshard error), plus what the flow measured
itself (``"generation"``: which state a load or transfer returned, -1 for none) and the paths it touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATUSES = ("clean", "silent", "lost", "outside", "hang", "other")
"""How an iteration ends: every guarantee held, or the first that broke: silent wrong bytes, a lost
checkpoint, something touched outside the checkpoint, a hang, or anything else (an exception that is not
reshard's, ranks failing with different errors, readers that disagree)."""

# The asymmetric outcome the commit protocol allows: some ranks got the confirmation, others did not.
COMMIT_OUTCOMES = frozenset({"ok", "UnconfirmedCommitError"})


@dataclass(frozen=True)
class Finding:
    status: str
    reason: str


Answers = dict[int, dict[str, Any]]


# ---- 5. no hang, 4. the same reshard error on every rank --------------------------------------------------


def answered_in_time(in_time: bool, limit_s: float) -> Finding | None:
    """Every surviving rank answered within ``limit_s``."""
    return None if in_time else Finding("hang", f"the survivors did not all answer within {limit_s:.0f} s")


def only_reshard_errors(answers: Answers) -> Finding | None:
    """Every exception a rank raised is a reshard error."""
    for rank, answer in sorted(answers.items()):
        if "other" in answer:
            return Finding(
                "other", f"rank {rank} raised {answer['error']}, not a reshard error: {answer['other'][-600:]}"
            )
    return None


def outcome_of(answer: dict[str, Any]) -> str:
    return "ok" if answer.get("ok") else str(answer.get("error"))


def same_outcome(answers: Answers, *, killed: bool) -> Finding | None:
    """The ranks that answered agree: all succeeded, or all raised the same error class. With a rank
    killed, the survivors may also split between success and :class:`UnconfirmedCommitError` (a commit
    some of them saw confirmed) and :class:`CommunicationError` (a rank that saw the death before the
    coordinator's commit was in place cannot know whether it will be: docs/reliability.md section 1; the flow's
    own check then holds the committed checkpoint to loading), and a flow whose survivors cannot know the
    victim's fate may mix success with one error class."""
    outcomes = {outcome_of(a) for a in answers.values()}
    if len(outcomes) <= 1 or (killed and outcomes <= COMMIT_OUTCOMES):
        return None
    if killed and "UnconfirmedCommitError" in outcomes and outcomes <= COMMIT_OUTCOMES | {"CommunicationError"}:
        return None
    errors = outcomes - {"ok"}
    if killed and len(errors) == 1:
        return None  # some ranks finished before the victim died, the others saw it die: one error class
    shown = ", ".join(f"rank {r}: {outcome_of(a)}" for r, a in sorted(answers.items()))
    return Finding("other", f"the ranks disagree: {shown}")


def confirmed(answers: Answers) -> bool:
    """Whether any rank reported the flow's write done (success, or the commit without confirmation)."""
    return any(outcome_of(a) in COMMIT_OUTCOMES for a in answers.values())


# ---- 1. no silent wrong bytes, 2. nothing lost -----------------------------------------------------------


def load_generation(
    path: Path | str,
    world: int,
    candidates: tuple[int, ...],
    *,
    objects: bool = True,
    under: str | None = None,
    **load_kwargs: Any,
) -> tuple[int | None, BaseException | None]:
    """Load ``path`` whole in this process: the generation it holds (-1: none of ``candidates``, a silent
    wrong load), or None and the reshard error when it does not load. ``under``: the state lies under that
    top-level key (an integration's checkpoint that nests the states it is given)."""
    import reshard
    from tests.contract import states

    template = states.full_template(world, objects=objects)
    try:
        loaded = reshard.load(template if under is None else {under: template}, path, **load_kwargs)
    except reshard.CheckpointError as exc:
        return None, exc
    loaded = loaded if under is None else loaded[under]
    generation = states.generation_of(loaded, world, candidates, objects=objects)
    return (generation if generation is not None else -1), None


def loads_as(
    path: Path | str, world: int, allowed: tuple[int, ...], *, what: str, objects: bool = True
) -> tuple[int | None, Finding | None]:
    """``path`` must load, as one of the ``allowed`` generations: a load of other bytes is silent wrong,
    no load at all is a lost checkpoint."""
    generation, error = load_generation(path, world, tuple(sorted({1, 2, 3, *allowed})), objects=objects)
    if generation is None:
        return None, Finding("lost", f"{what} does not load: {type(error).__name__}: {error}")
    if generation not in allowed:
        status = "silent" if generation == -1 else "lost"
        return generation, Finding(status, f"{what} loads as generation {generation}, expected one of {allowed}")
    return generation, None


def returned_generation(answers: Answers, allowed: tuple[int, ...], *, what: str) -> Finding | None:
    """Each rank that returned a state (a load, a restore, a transfer) returned exactly one of ``allowed``."""
    for rank, answer in sorted(answers.items()):
        if answer.get("ok") and answer.get("generation") not in allowed:
            got = answer.get("generation")
            return Finding("silent", f"rank {rank}'s {what} returned generation {got}, expected one of {allowed}")
    return None


def readers_agree(path: Path, loads: bool) -> Finding | None:
    """``reshard validate`` passes exactly the checkpoints that load."""
    import reshard
    from reshard.flows.maintenance import validate_checkpoint

    try:
        problems = validate_checkpoint(path)
    except reshard.CheckpointError as exc:  # not a checkpoint at all: nothing to pass
        problems = [f"{type(exc).__name__}: {exc}"]
    if (not problems) != loads:
        return Finding("other", f"validate says {problems[:2] or 'good'}, a load says {'loads' if loads else 'no'}")
    return None


# ---- 3. nothing touched outside -------------------------------------------------------------------------

FOREIGN = {
    "notes.txt": b"a user's notes, next to the checkpoint\n",
    "data/user.csv": b"id,value\n1,2\n",
    "src/train.py": b"print('a user script')\n",
}


def plant(directory: Path, names: Iterable[str] = FOREIGN) -> dict[Path, bytes]:
    """Files that reshard did not write, put where a user might keep them: under ``directory`` (a
    checkpoint, a root, a sibling). Returns what each must still hold."""
    planted = {}
    for name in names:
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        content = FOREIGN.get(name, f"foreign file {name}\n".encode())
        path.write_bytes(content)
        planted[path] = content
    return planted


def foreign_untouched(planted: dict[Path, bytes]) -> Finding | None:
    """Every planted file is still there with its bytes."""
    for path, content in sorted(planted.items()):
        try:
            now = path.read_bytes()
        except OSError as exc:
            return Finding("outside", f"{path} (not written by reshard) is gone: {exc}")
        if now != content:
            digest = hashlib.sha256(now).hexdigest()[:12]
            return Finding("outside", f"{path} (not written by reshard) was changed (now sha256 {digest}...)")
    return None


def _system_prefixes() -> tuple[str, ...]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, str(Path(__file__).resolve().parents[2])}
    roots |= {p for p in sys.path if p and os.path.isdir(p)}
    return (*sorted(roots), "/proc", "/sys", "/dev", "/etc", "/usr", "/lib")


def touched_inside(
    touched: Iterable[tuple[str, str]], sandbox: Path, allowed: Iterable[Path], *, rank: int | None = None
) -> Finding | None:
    """Every path a process touched lies in one of the ``allowed`` places, or outside the ``sandbox``
    (the iteration's directory, which holds the checkpoint, its siblings and the user's bait files) in the
    system's own directories (Python, its packages, /proc). An allowed place that ends with ``*`` is a
    prefix of names (``root/step_*``), one that ends with ``$`` an exact path."""
    inside = [str(p) for p in allowed]
    system = _system_prefixes()
    sandbox_text = str(sandbox)
    for operation, path in touched:
        if path == sandbox_text or any(_within(path, p) for p in inside):
            continue
        outside_sandbox = not path.startswith(sandbox_text + os.sep)
        if outside_sandbox and any(path == p or path.startswith(p.rstrip(os.sep) + os.sep) for p in system):
            continue
        who = f"rank {rank} " if rank is not None else ""
        places = ", ".join(p[len(sandbox_text) + 1 :][:60] for p in inside[:8]) or "nothing"
        return Finding("outside", f"{who}touched {path[len(sandbox_text) + 1 :][:200]} ({operation}), outside {places}")
    return None


def _within(path: str, place: str) -> bool:
    """``path`` is ``place`` or lies under it; a ``place`` ending with ``*`` is a prefix of names, one
    ending with ``$`` that exact path only (a directory that may be looked at, not into)."""
    if place.endswith("*"):
        return path.startswith(place[:-1])
    if place.endswith("$"):
        return path == place[:-1]
    return path == place or path.startswith(place + os.sep)


@contextlib.contextmanager
def recording_paths() -> Any:
    """In this process: record every path opened, listed, stat'ed or changed inside the block (an audit
    hook, installed once per process and active only inside such blocks)."""
    from tests.contract.events import PathLog

    log = PathLog()
    _ACTIVE.append(log)
    _install_recorder()
    try:
        yield log
    finally:
        _ACTIVE.remove(log)


_ACTIVE: list[Any] = []
_INSTALLED: list[bool] = []


def _install_recorder() -> None:
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    from tests.contract.events import MUTATIONS, READS

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if not _ACTIVE:
            return
        if event == "open":
            for log in _ACTIVE:
                log.add("open", args[0])
        elif event in MUTATIONS or event in READS:
            index = (MUTATIONS | READS)[event]
            dir_fd = args[-1] if event in ("os.remove", "os.rmdir", "os.mkdir") and len(args) > 1 else -1
            for log in _ACTIVE:
                log.add(event, args[index], dir_fd if isinstance(dir_fd, int) else -1)

    sys.addaudithook(hook)
    for name in ("stat", "lstat"):
        original: Callable[..., Any] = getattr(os, name)

        def recorded(path: Any, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if _ACTIVE and kwargs.get("dir_fd") is None:
                for log in _ACTIVE:
                    log.add("stat", path)
            return _original(path, *args, **kwargs)

        setattr(os, name, recorded)
