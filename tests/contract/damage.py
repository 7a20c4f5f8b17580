"""Seeded damage of every artefact a flow of the manager leaves: data files (a holder's referenced file
included), ``metadata.json``, reference markers, ``retired.json``, ``latest.json``, the certification records
(``certified.json``, ``checks.json``), the root's lock; then every reader and every mutator of a root, judged by
the guarantees.

The pristine root is what ``CheckpointManager(root, keep_last=2, incremental=True, certify=CertifyOptions())``
(every step certified) leaves after three
steps of generations 1, 2 and 3 that share ``frozen``: step 1 holds every box (and is *retired*: deleted
by retention but kept for the files steps 2 and 3 reference), steps 2 and 3 hold their own boxes and
reference step 1's file (markers in ``step_000000001/refs/``), ``latest.json`` names step 3. Step 3's metadata
is partitioned (format version 6): its part files are artefacts too.

After one seeded change the tools run in order:

- readers: a load of every step (exact or a reshard error), ``validate`` of every step (passes only what
  loads), ``reshard ls`` (complete only what loads), the certification of every step (certified only what loads
  exactly: a damaged, truncated, garbage or copied record certifies nothing, and never changes what loads),
  ``CheckpointManager(certify=...).load_latest_with_state`` (the state of the step it names, exactly);
- mutators: ``reshard gc`` of every step, then a manager's save of step 4 with retention. Nothing that
  loaded before them and that the policy keeps (step 3, the newest complete one before step 4) may stop
  loading, step 4 must load, and the user's files in the root must be intact.

:func:`corrupt_held` damages the held file of the frozen base without changing its size (a flipped bit in the
referenced box, other bytes of the same size), which no size check sees: the save of step 4 must not reference
it (it reads what it references back, and writes what does not read back as the state's bytes).

The plain checkpoint's damage (nine tools, including export and diff) is :mod:`tests.corruption`.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.contract import guarantees, states

WORLD = 2
ROOT_FOREIGN = ("notes.txt", "src/train.py", "mine/retired.json")


@dataclass(frozen=True)
class Damage:
    kind: str
    target: str
    """The damaged file, relative to the root."""


@dataclass
class Verdict:
    damage: Damage
    results: dict[str, str] = field(default_factory=dict)
    """Per tool: 'exact', 'error', or a finding ('silent: ...', 'lost: ...', 'outside: ...', 'other: ...')."""

    @property
    def findings(self) -> list[str]:
        return [f"{tool}: {r}" for tool, r in self.results.items() if r not in ("exact", "error")]


def make_pristine(root: Path) -> None:
    """Three incremental steps under ``root`` (see the module doc), and the user's files."""
    import reshard

    manager = reshard.CheckpointManager(root, keep_last=2, incremental=True, certify=reshard.CertifyOptions())
    for step in (1, 2, 3):  # step 3's metadata partitioned (format version 6): its parts are damaged too
        options = reshard.SaveOptions(metadata_parts=True) if step == 3 else None
        manager.save(step, states.single_process_state(step, WORLD), options=options)
    manager.close()
    guarantees.plant(root, ROOT_FOREIGN)
    assert (root / "step_000000001" / "retired.json").exists(), "step 1 should be retired and referenced"


def _artefacts(root: Path) -> dict[str, list[Path]]:
    return {
        "data": sorted(root.glob("step_*/data/*.bin")),
        "part": sorted(root.glob("step_*/data/*-metadata-*.json")),
        "metadata": sorted(root.glob("step_*/metadata.json")),
        "marker": sorted(root.glob("step_*/refs/*.json")),
        "retired": sorted(root.glob("step_*/retired.json")),
        "latest": [root / "latest.json"],
        "certificate": sorted(root.glob("step_*/certified.json")),
        "checks": sorted(root.glob("step_*/checks.json")),
    }


def corrupt(root: Path, rng: random.Random) -> Damage:
    """One seeded change of one artefact of the copy at ``root``."""
    artefacts = {k: v for k, v in _artefacts(root).items() if v}
    kind = rng.choice(sorted(artefacts))
    path = rng.choice(artefacts[kind])
    how = rng.choice(["flip", "truncate", "delete", "garbage", "swap"] + (["retarget"] if kind == "latest" else []))
    damage_file(path, how, rng, others=[p for p in artefacts[kind] if p != path])
    return Damage(f"{kind}:{how}", str(path.relative_to(root)))


def damage_file(path: Path, how: str, rng: random.Random, *, others: list[Path]) -> Damage:
    """``path`` damaged ``how``: ``flip`` one bit, ``truncate`` (shorter), ``delete``, ``garbage`` (other JSON or
    random bytes), ``swap`` (the bytes of one of ``others``, a file of the same kind), ``retarget`` (latest.json)."""
    raw = path.read_bytes()
    if how == "flip" and raw:
        at = rng.randrange(len(raw))
        path.write_bytes(raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1 :])
    elif how == "truncate":
        path.write_bytes(raw[: rng.randrange(max(len(raw), 1))])
    elif how == "delete":
        path.unlink()
    elif how == "garbage":
        path.write_bytes(
            rng.choice([b"", b"{", b"null", b"[]", b'{"step": 1}', bytes(rng.randrange(256) for _ in range(64))])
        )
    elif how == "retarget":
        step = rng.choice([1, 2, 9, -1])
        path.write_text(json.dumps({"step": step, "path": f"step_{max(step, 0):09d}"}))
    else:
        path.write_bytes(rng.choice(others or [path]).read_bytes())
    return Damage(f"{path.name}:{how}", f"{path.parent.name}/{path.name}")


def corrupt_held(root: Path, how: str, rng: random.Random) -> Damage:
    """Damage that keeps the size of the file holding the frozen base (step 1's, which steps 2 and 3 reference):
    ``flip`` one bit inside the referenced box, or ``same_size``: replace the file by other bytes of its size.
    Sizes are all a quick check sees; only reading the bytes back can tell."""
    import reshard

    metadata = reshard.read_metadata(root / "step_000000003")
    box = metadata.tensors["frozen"].boxes[0]
    entry = metadata.files[box.file]
    assert entry.checkpoint == "step_000000001", entry
    path = root / entry.checkpoint / entry.path
    raw = path.read_bytes()
    if how == "flip":
        at = box.byte_offset + rng.randrange(box.byte_length)
        path.write_bytes(raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1 :])
    elif how == "same_size":
        path.write_bytes(rng.randbytes(len(raw)))
    else:
        raise ValueError(how)
    return Damage(f"held:{how}", str(path.relative_to(root)))


def _steps(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.name.startswith("step_"))


def _loads(root: Path) -> dict[str, int | None]:
    """Each step's generation (None: a reshard error; -1: other bytes)."""
    return {p.name: guarantees.load_generation(p, WORLD, (1, 2, 3, 4))[0] for p in _steps(root)}


def run_tools(root: Path, damage: Damage) -> Verdict:
    """The readers, then the mutators, on the damaged root."""
    verdict = Verdict(damage)
    try:
        before = _readers(root, verdict)
        _mutators(root, verdict, before)
    except Exception as exc:  # a tool's own failure was recorded; anything escaping is a finding
        verdict.results["harness"] = f"other: {type(exc).__name__}: {exc}"
    planted = {root / n: guarantees.FOREIGN.get(n, f"foreign file {n}\n".encode()) for n in ROOT_FOREIGN}
    lost = guarantees.foreign_untouched(planted)
    if lost is not None:
        verdict.results["user files"] = f"outside: {lost.reason}"
    return verdict


def _readers(root: Path, verdict: Verdict) -> dict[str, int | None]:
    import reshard
    from reshard.flows.maintenance import validate_checkpoint

    loads = _loads(root)
    for name, generation in loads.items():
        step = int(name.split("_")[1])
        if generation is None:
            verdict.results[f"load {name}"] = "error"
        elif generation == step:
            verdict.results[f"load {name}"] = "exact"
        else:
            verdict.results[f"load {name}"] = f"silent: {name} loads as generation {generation}"
        try:
            passes = not validate_checkpoint(root / name)
        except reshard.CheckpointError:
            passes = False
        if passes and generation != step:
            verdict.results[f"validate {name}"] = f"other: validate passes {name}, which does not load exactly"
        else:
            verdict.results[f"validate {name}"] = "exact" if passes else "error"
    listed = {info.name: info.status for info in reshard.flows.manager.scan_root(reshard.storage.LocalStorage(root))}
    # ls reads metadata only: a step with damaged data is still listed complete (validate finds it), but a
    # step that loads must be listed complete
    wrong = [n for n, s in listed.items() if s != "complete" and loads.get(n) == int(n.split("_")[1])]
    verdict.results["ls"] = f"other: ls does not list {wrong} complete, yet they load" if wrong else "exact"
    _certification(root, loads, verdict)
    manager = reshard.CheckpointManager(root, certify=reshard.CertifyOptions())
    try:
        found = manager.load_latest_with_state(states.full_template(WORLD))
        if found is None:
            verdict.results["load_latest"] = "error"
        else:
            got = states.generation_of(found[1], WORLD, (found[0],))
            verdict.results["load_latest"] = "exact" if got == found[0] else f"silent: step {found[0]} is not its state"
    except reshard.CheckpointError:
        verdict.results["load_latest"] = "error"
    finally:
        manager.close()
    return loads


def _certification(root: Path, loads: dict[str, int | None], verdict: Verdict) -> None:
    """Every step's certification (never raising), as ``ls`` says: a damaged ``metadata.json``, ``certified.json`` or
    ``checks.json`` never leaves a step certified unless it still loads exactly (a certificate vouches for the save
    its ``metadata.json`` names, not for data damaged since: that step is certified and fails to load, as
    ``validate`` says)."""
    import reshard
    from reshard.flows.certify import certification_status

    listed = {i.name: i.certified for i in reshard.flows.manager.scan_root(reshard.storage.LocalStorage(root))}
    for name, generation in loads.items():
        storage = reshard.storage.LocalStorage(root / name)
        try:
            is_certified, _ = certification_status(storage)
        except Exception as exc:  # it never raises: anything escaping is a finding
            verdict.results[f"certified {name}"] = f"other: {type(exc).__name__}: {exc}"
            continue
        finally:
            storage.close()
        records = {f"{name}/{n}" for n in ("metadata.json", "certified.json", "checks.json")}
        if is_certified and generation != int(name.split("_")[1]) and verdict.damage.target in records:
            verdict.results[f"certified {name}"] = f"silent: {name} is certified but does not load exactly"
        elif is_certified != listed.get(name, False):
            verdict.results[f"certified {name}"] = f"other: ls says certified={listed.get(name)} of {name}"
        else:
            verdict.results[f"certified {name}"] = "exact" if is_certified else "error"


def _mutators(root: Path, verdict: Verdict, before: dict[str, int | None]) -> None:
    import reshard
    from reshard.flows.maintenance import collect_garbage

    for step in _steps(root):
        try:
            collect_garbage(step, min_age_s=0.0)
            verdict.results[f"gc {step.name}"] = "exact"
        except reshard.CheckpointError:
            verdict.results[f"gc {step.name}"] = "error"
    lost = [n for n, g in _loads(root).items() if before.get(n) == int(n.split("_")[1]) and g != before[n]]
    if lost:
        verdict.results["gc"] = f"lost: gc made {lost} stop loading"
        return
    manager = reshard.CheckpointManager(root, keep_last=2, incremental=True, certify=reshard.CertifyOptions())
    try:
        manager.save(4, states.single_process_state(4, WORLD))
        verdict.results["save"] = "exact"
    except reshard.CheckpointError as exc:
        verdict.results["save"] = f"other: a save of a new step failed: {type(exc).__name__}: {exc}"
    finally:
        manager.close()
    after = _loads(root)
    if after.get("step_000000004") != 4:
        verdict.results["save"] = f"lost: the new step 4 loads as {after.get('step_000000004')}"
    if before.get("step_000000003") == 3 and after.get("step_000000003") != 3:
        verdict.results["retention"] = "lost: retention made step 3 (kept by keep_last=2) stop loading"


def summarize(verdicts: list[Verdict]) -> dict[str, Any]:
    results = [r for v in verdicts for r in v.results.values()]
    return {
        "corruptions": len(verdicts),
        "tool_runs": len(results),
        "exact": sum(r == "exact" for r in results),
        "refused": sum(r == "error" for r in results),
        **{s: sum(r.startswith(f"{s}:") for r in results) for s in ("silent", "lost", "outside", "other")},
        "by_kind": {k: sum(v.damage.kind == k for v in verdicts) for k in sorted({v.damage.kind for v in verdicts})},
        "failures": [{"damage": vars(v.damage), "findings": v.findings} for v in verdicts if v.findings][:20],
    }


def copy(pristine: Path, to: Path) -> None:
    shutil.copytree(pristine, to, symlinks=True)
