"""Hostile documents: checkpoints written by someone else, of every format version, whose ``metadata.json``
(resealed, as a forger who knows the format would), reference markers, ``retired.json``, ``latest.json`` or the
certification records (``certified.json``, ``checks.json``: oversized, deeply nested, of wrong types, with
hostile strings) name things they must not: file names with ``..``, absolute paths, URLs of other buckets, references to
sibling directories that are not checkpoints or are not tied to this one by a marker, to the checkpoint
itself (a cycle), huge counts.

A *sandbox* is a directory laid out as a root of steps beside a user's files::

    step_000000001/   a checkpoint (generation 1, content hashes): the base
    step_000000002/   the checkpoint under attack: version 4, an incremental save of generation 2 that
                      references the base's file (versions 1-3: a golden fixture of that version)
    archive/          another reshard checkpoint, which nothing references
    home/             a user's directory: .ssh/id_rsa, notes.txt, data/<a name like a data file>.bin
    decoy/            a project's directory that holds a retired.json of its own, and sources
    out/              where the tools write (exports, copies)

Every reading tool runs on the attacked checkpoint (load, read_metadata, validate, inspect, export,
convert, diff, gc) and every root tool on the sandbox (ls, a manager's load and its save with retention),
with every path each of them opens, lists, stats or changes recorded (an audit hook: the in-process
equivalent of strace). The guarantees: each tool raises a reshard error or gives exactly the pristine
values; nothing outside the checkpoint, the sibling it legitimately references, and ``out/`` is opened
(a sibling named by a reference may be looked at for its marker, never for its data, unless the marker
ties it); the user's files are intact; nothing hangs (the suite's timeout).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from reshard.planning.layouts import PLAN_CACHE_FILE, READ_PLANS
from reshard.state.dtypes import DTYPE_BY_NAME
from tests.contract import guarantees, states
from tests.metadata_docs import read_doc, write_doc

WORLD = 2
BASE, CKPT, ARCHIVE = "step_000000001", "step_000000002", "archive"
GOLDEN = Path(__file__).resolve().parents[1] / "data"
USER_FILES = {
    "home": (".ssh/id_rsa", "notes.txt", "data/00000000000000000000000000000000-r00000.bin"),
    "decoy": ("retired.json", "src/a.py", "data/user.csv"),
}
ROOT_NAMES = (".lock", "latest.json", "step_", PLAN_CACHE_FILE, READ_PLANS.name)
"""What a root tool may touch in the root: its lock, pointer and plan cache (docs/api.md's manager root) and the
steps' directories (their names start so)."""
SIBLING_FILES = ("metadata.json", "retired.json", "refs", ".lock")
"""What a reader may look at in a sibling that a reference names, before it knows the sibling is tied."""


@dataclass(frozen=True)
class Attack:
    version: int
    kind: str
    detail: str
    retired: bool = False
    """The attacked checkpoint was made retired: every reader must refuse it, never serve its state."""


@dataclass
class Verdict:
    attack: Attack
    results: dict[str, str] = field(default_factory=dict)
    """Per tool: 'exact', 'error', or a finding ('silent: ...', 'outside: ...', 'other: ...')."""

    @property
    def findings(self) -> list[str]:
        return [f"{tool}: {r}" for tool, r in self.results.items() if r not in ("exact", "error")]


# ---- the sandbox ------------------------------------------------------------------------------------------


def make_pristine(parent: Path, version: int) -> None:
    """A pristine sandbox whose attacked checkpoint has format ``version``."""
    import reshard

    parent.mkdir(parents=True)
    hashes = reshard.SaveOptions(content_hash=True)
    reshard.save(states.single_process_state(1, WORLD), parent / BASE, options=hashes)
    if version == 4:
        state = states.single_process_state(2, WORLD)
        certify = reshard.SaveOptions(content_hash=True, certify=reshard.CertifyOptions())  # certified
        reshard.save(state, parent / CKPT, options=certify, base=parent / BASE)
    elif version == 6:  # partitioned metadata: the index in metadata.json, the boxes in part files
        parts = reshard.SaveOptions(content_hash=True, metadata_parts=True)
        reshard.save(states.single_process_state(2, WORLD), parent / CKPT, options=parts)
    else:
        shutil.copytree(GOLDEN / f"golden_v{version}", parent / CKPT)
    reshard.save(states.single_process_state(3, WORLD), parent / ARCHIVE)
    (parent / "latest.json").write_text(json.dumps({"step": 2, "path": CKPT}))
    for where, names in USER_FILES.items():
        guarantees.plant(parent / where, names)
    (parent / "out").mkdir()


def planted(parent: Path) -> dict[Path, bytes]:
    return {
        parent / where / name: guarantees.FOREIGN.get(name, f"foreign file {name}\n".encode())
        for where, names in USER_FILES.items()
        for name in names
    }


# ---- the attacks ----------------------------------------------------------------------------------------

HOSTILE_NAMES = [
    "../home/.ssh/id_rsa",
    "../../home/.ssh/id_rsa",
    "data/../../home/.ssh/id_rsa",
    "/etc/passwd",
    "s3://other-bucket/data/x.bin",
    "gs://other-bucket/data/x.bin",
    "data/./x.bin",
    "data//x.bin",
    "",
    ".",
    "data/",
    "metadata.json",
    "refs/x.json",
    "data\\x.bin",
    "data/x\u0000.bin",
    "C:x.bin",
    "data/" + "x" * 5000,
]
HOSTILE_SIBLINGS = [
    "home",
    "..",
    ".",
    "",
    CKPT,
    ARCHIVE,
    "decoy",
    "out",
    "home/.ssh",
    "/home",
    "s3:",
    "a\\b",
    "x" * 300,
]


ATTACKS_V4 = (
    "path",
    "sibling",
    "sibling_path",
    "cycle",
    "many",
    "marker",
    "retired",
    "latest",
    "downgrade",
    "archive",
    "numbers",
    "record",
)


def _attacks_v4(rng: random.Random, doc: dict[str, Any], parent: Path) -> tuple[str, str]:
    """One seeded change of the attacked version-4 checkpoint or of its neighbours; (kind, detail)."""
    files = doc["files"]
    kind = rng.choice(ATTACKS_V4)
    i = rng.randrange(len(files))
    if kind == "numbers":
        return kind, _attack_numbers(rng, doc)
    if kind == "path":
        files[i]["path"] = rng.choice(HOSTILE_NAMES)
        return kind, files[i]["path"]
    if kind == "sibling":
        files[i]["checkpoint"] = rng.choice(HOSTILE_SIBLINGS)
        files[i]["path"] = rng.choice([files[i]["path"], ".ssh/id_rsa", "notes.txt", USER_FILES["home"][2]])
        return kind, f"{files[i]['checkpoint']}/{files[i]['path']}"
    if kind == "sibling_path":
        files[i]["checkpoint"] = BASE
        files[i]["path"] = rng.choice(HOSTILE_NAMES)
        return kind, files[i]["path"]
    if kind == "cycle":
        base = read_doc(parent / BASE / "metadata.json")
        base["files"].append({"path": files[0]["path"], "size": files[0]["size"], "checkpoint": CKPT})
        base["version"] = 4
        write_doc(parent / BASE / "metadata.json", base)
        files[i]["checkpoint"] = rng.choice([BASE, CKPT])
        return kind, f"base <-> ckpt, file {i} in {files[i]['checkpoint']}"
    if kind == "many":
        count = rng.choice([1000, 5000])
        template = dict(files[-1])
        files.extend({**template, "path": f"data/{j:032x}-r00000.bin", "checkpoint": BASE} for j in range(count))
        return kind, f"{count} references"
    if kind == "marker":
        return kind, _attack_marker(rng, parent)
    if kind == "record":
        return kind, attack_record(parent, rng.choice(RECORDS), rng.choice(sorted(HOSTILE_RECORDS)))
    if kind == "retired":
        doc_text = {"retired": 1, "kept": [rng.choice(HOSTILE_NAMES), "../home/notes.txt", "/etc/hosts"]}
        target = rng.choice([CKPT, BASE])
        (parent / target / "retired.json").write_text(json.dumps(doc_text))
        return f"retired_{'ckpt' if target == CKPT else 'base'}", f"{target}: {doc_text}"
    if kind == "latest":
        latest = rng.choice([{"step": 9, "path": "../home"}, {"step": 2, "path": "/etc"}, {"step": -1}, [1], "x"])
        (parent / "latest.json").write_text(json.dumps(latest))
        return kind, json.dumps(latest)
    if kind == "downgrade":
        doc["version"] = rng.choice([1, 2, 3])
        return kind, f"version {doc['version']} with references"
    files[i]["checkpoint"] = ARCHIVE  # a real checkpoint that does not reference us
    archive = read_doc(parent / ARCHIVE / "metadata.json")
    files[i]["path"], files[i]["size"] = archive["files"][0]["path"], archive["files"][0]["size"]
    return kind, "a file of an untied sibling checkpoint, with its true size"


def _attack_marker(rng: random.Random, parent: Path) -> str:
    refs = parent / BASE / "refs"
    markers = sorted(refs.glob("*.json"))
    marker = markers[0] if markers else refs / f"{CKPT}.{'0' * 32}.json"
    doc = json.loads(marker.read_text()) if marker.exists() else {"checkpoint": CKPT, "save_id": "0" * 32}
    choice = rng.randrange(5)
    if choice == 0:
        doc["files"] = ["../home/.ssh/id_rsa", "../../home/notes.txt", "/etc/passwd", "../decoy/src/a.py"]
    elif choice == 1:
        doc["checkpoint"] = rng.choice(["../home", "home", "/", ".."])
    elif choice == 2:
        marker.write_bytes(b"{not json" + b"x" * 1000)
        return f"{marker.name}: invalid JSON"
    elif choice == 3:
        (refs / "..%2Fhome.json").write_text(json.dumps({**doc, "checkpoint": "..%2Fhome"}))
        return "a marker named ..%2Fhome.json"
    else:
        doc["files"] = [f"data/{j:032x}-r00000.bin" for j in range(50_000)]
    marker.write_text(json.dumps(doc))
    return f"{marker.name}: {json.dumps(doc)[:120]}"


RECORDS = ("certified.json", "checks.json")
HOSTILE_RECORDS: dict[str, Callable[[dict[str, Any], bytes], bytes]] = {
    "oversized": lambda doc, raw: raw + b" " * (1 << 20),
    "deep": lambda doc, raw: b"[" * 100_000 + b"]" * 100_000,
    "deep_object": lambda doc, raw: b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    "format_string": lambda doc, raw: _dumps({**doc, "format": "1"}),
    "digest_int": lambda doc, raw: _dumps({**doc, "metadata_sha256": 12}),
    "digest_path": lambda doc, raw: _dumps({**doc, "metadata_sha256": "../" * 21 + "a"}),
    "lists_as_string": lambda doc, raw: _dumps({k: "finite" if isinstance(v, list) else v for k, v in doc.items()}),
    "lists_of_numbers": lambda doc, raw: _dumps({k: [1, None] if isinstance(v, list) else v for k, v in doc.items()}),
    "bool_as_time": lambda doc, raw: _dumps({k: True if k.endswith("_at") else v for k, v in doc.items()}),
    "nan_time": lambda doc, raw: _dumps({k: math.nan if k.endswith("_at") else v for k, v in doc.items()}),
    "huge_time": lambda doc, raw: _dumps({k: 10**400 if k.endswith("_at") else v for k, v in doc.items()}),
    "passed_string": lambda doc, raw: _dumps({**doc, "passed": "yes"}),
    "extra_field": lambda doc, raw: _dumps({**doc, "path": "../home/.ssh/id_rsa"}),
    "not_utf8": lambda doc, raw: b"\xff\xfe" + raw,
    "escape_codes": lambda doc, raw: _dumps({**doc, "checks": ["\x1b[2J\u202e"], "problems": ["\x1b]0;x\x07"]}),
}
"""Hostile certification records, from the genuine document and its bytes."""


def _dumps(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).encode()


def attack_record(parent: Path, record: str, how: str) -> str:
    """The attacked checkpoint's ``record`` replaced by the hostile document ``how`` made of it."""
    path = parent / CKPT / record
    raw = path.read_bytes()
    path.write_bytes(HOSTILE_RECORDS[how](json.loads(raw), raw))
    return f"{record}: {how}"


HOSTILE_NUMBERS: list[Any] = [-1, 2**62, 2**62 + 1, 2**63, 2**64, 1.5, True, None, "8", [8], 10**400]


def _attack_numbers(rng: random.Random, doc: dict[str, Any]) -> str:
    """A hostile number in a file's size or in a box's place (of a referenced file's box, when it has one)."""
    value = rng.choice(HOSTILE_NUMBERS)
    if rng.random() < 0.5:
        entry = rng.choice(doc["files"])
        entry["size"] = value
        return f"size of {entry['path'][-40:]}: {str(value)[:30]}"
    tensor = doc["tensors"][rng.choice(sorted(doc["tensors"]))]
    boxes = tensor.get("boxes")
    if not boxes:
        tensor["global_shape"] = [value]
        return f"a packed tensor's global shape: {str(value)[:30]}"
    field = rng.choice(["byte_offset", "byte_length", "file"])
    boxes[0][field] = value
    return f"a box's {field}: {str(value)[:30]}"


def _attacks_old(rng: random.Random, doc: dict[str, Any]) -> tuple[str, str]:
    """A change of a version 1-3 document: hostile file names, or a reference field it cannot have."""
    files = doc["files"]
    i = rng.randrange(len(files))
    if rng.random() < 0.7:
        files[i]["path"] = rng.choice(HOSTILE_NAMES)
        return "path", files[i]["path"]
    files[i]["checkpoint"] = rng.choice([BASE, "home", ".."])
    return "reference_before_v4", files[i]["checkpoint"]


def _attacks_v6(rng: random.Random, doc: dict[str, Any], parent: Path) -> tuple[str, str]:
    """A change of the parts of a version-6 document (sealed again: what a hostile writer makes): a part named
    outside the checkpoint, a size or SHA-256 that lies, a part of another save, an index naming no part."""
    parts = doc["parts"]
    i = rng.randrange(len(parts))
    kind = rng.choice(["part_path", "part_size", "part_sha256", "part_swapped", "part_index"])
    if kind == "part_path":
        parts[i]["path"] = rng.choice(HOSTILE_NAMES)
        return kind, parts[i]["path"]
    if kind == "part_size":
        parts[i]["size"] = rng.choice([0, parts[i]["size"] - 1, parts[i]["size"] + 1, 2**61])
        return kind, str(parts[i]["size"])
    if kind == "part_sha256":
        parts[i]["sha256"] = rng.choice(["0" * 64, parts[i]["sha256"][::-1], "x"])
        return kind, parts[i]["sha256"]
    if kind == "part_swapped":  # the archive's document names its parts as this save's (their bytes differ)
        archive = parent / ARCHIVE / "data"
        name = parent / CKPT / parts[i]["path"]
        victim = next(iter(sorted(archive.glob("*-r*.bin"))))
        name.write_bytes(victim.read_bytes()[: parts[i]["size"]])
        return kind, parts[i]["path"]
    key = rng.choice(sorted(doc["tensors"]))
    doc["tensors"][key]["part"] = rng.choice([len(parts), -1, "0", None])
    return kind, f"{key}: {doc['tensors'][key]['part']!r}"


def attack(parent: Path, version: int, rng: random.Random) -> Attack:
    """Apply one seeded attack to a copy of a pristine sandbox."""
    path = parent / CKPT / "metadata.json"
    doc = read_doc(path)
    if version == 4:
        kind, detail = _attacks_v4(rng, doc, parent)
    elif version == 6 and rng.random() < 0.7:
        kind, detail = _attacks_v6(rng, doc, parent)
    else:
        kind, detail = _attacks_old(rng, doc)
    write_doc(path, doc)
    return Attack(version, kind, detail, retired=kind == "retired_ckpt")


# ---- the tools, and the paths they may touch --------------------------------------------------------------


def allowed_paths(parent: Path, *, root_tool: bool) -> list[Path]:
    """Where a tool may touch: the attacked checkpoint, ``out/``, the base only when a marker ties it to the
    attacked one, the marker and metadata of any sibling a reference names; a root tool also every step."""
    allowed = [parent / CKPT, parent / "out", parent / BASE / "refs", parent / BASE / "metadata.json"]
    allowed += [parent / BASE / n for n in SIBLING_FILES]
    for sibling in _named_siblings(parent) | _referrers(parent):
        allowed += [parent / sibling / n for n in SIBLING_FILES]
        allowed.append(Path(f"{parent / sibling}$"))
    if _tied(parent) or root_tool:
        allowed.append(parent / BASE)
    if root_tool:
        allowed += [parent / f"{name}*" for name in ROOT_NAMES]
        allowed += [parent / f".{name}*" for name in ROOT_NAMES]  # the temporary names of their commits
    return allowed


def _named_siblings(parent: Path) -> set[str]:
    with contextlib.suppress(Exception):
        doc = json.loads((parent / CKPT / "metadata.json").read_bytes())
        return {f["checkpoint"] for f in doc.get("files", []) if isinstance(f, dict) and _safe(f.get("checkpoint"))}
    return set()


def _referrers(parent: Path) -> set[str]:
    """The checkpoints the base's markers name (their liveness is checked at their metadata and lock)."""
    names = set()
    for marker in (parent / BASE / "refs").glob("*.json"):
        names.add(marker.name.split(".")[0])
        with contextlib.suppress(Exception):
            names.add(json.loads(marker.read_bytes())["checkpoint"])
    return {n for n in names if _safe(n)}


def _safe(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name


def _tied(parent: Path) -> bool:
    """Whether the base holds an intact marker naming the attacked checkpoint's save."""
    with contextlib.suppress(Exception):
        save_id = json.loads((parent / CKPT / "metadata.json").read_bytes())["save_id"]
        marker = json.loads((parent / BASE / "refs" / f"{CKPT}.{save_id}.json").read_text())
        return bool(marker.get("checkpoint") == CKPT and marker.get("save_id") == save_id)
    return False


def _template(pristine: Path) -> dict[str, Any]:
    import reshard

    meta = reshard.read_metadata(pristine / CKPT)
    out: dict[str, Any] = {
        k: torch.zeros(t.global_shape, dtype=DTYPE_BY_NAME[t.dtype]) for k, t in meta.tensors.items()
    }
    out.update(dict.fromkeys(meta.common))
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_same_value(v, b[k]) for k, v in a.items())


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and states.same_bits(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _cli(*args: str) -> None:
    import reshard
    from reshard.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(list(args))
    if code in (1, 3) and "Traceback" not in err.getvalue():
        raise reshard.CheckpointError(err.getvalue().strip()[:300])
    if code != 0:
        raise AssertionError(f"reshard {args[0]} exited {code}: {err.getvalue()[-300:]}")


READERS = ("load", "read_metadata", "validate", "inspect", "export", "convert", "diff")
"""The tools that serve a checkpoint's content: a retired checkpoint must be refused by each."""


def tools(parent: Path, pristine: Path) -> dict[str, tuple[bool, Callable[[], bool]]]:
    """name -> (a root tool?, run it: True when its result is exactly the pristine one)."""
    import reshard
    from reshard.flows.maintenance import collect_garbage, validate_checkpoint
    from reshard.interop import convert_checkpoint, diff_checkpoints, export_safetensors

    ckpt = parent / CKPT
    want = reshard.load(_template(pristine), pristine / CKPT, strict=False)

    def load() -> bool:
        return _same(reshard.load(_template(pristine), ckpt, strict=False), want)

    def validate() -> bool:
        problems = validate_checkpoint(ckpt)
        if problems:
            raise reshard.CorruptCheckpointError(problems[0])
        return load()

    def manager_load() -> bool:
        manager = reshard.CheckpointManager(parent)
        try:
            found = manager.load_latest_with_state(_template(pristine), strict=False)
        finally:
            manager.close()
        if found is not None and found[0] == 2 and (parent / CKPT / "retired.json").exists():
            return False  # a retired step served
        return found is None or found[0] != 2 or _same(found[1], want)

    def certification() -> bool:
        """A hostile record certifies nothing: certified only with the genuine record and metadata."""
        from reshard.flows.certify import certification_status

        storage = reshard.storage.LocalStorage(ckpt)
        try:
            is_certified, why = certification_status(storage)
        finally:
            storage.close()
        genuine = (
            all(
                (ckpt / n).exists() and (ckpt / n).read_bytes() == (pristine / CKPT / n).read_bytes()
                for n in ("metadata.json", "certified.json")
            )
            and not (ckpt / "retired.json").exists()
        )  # a retired checkpoint is no recovery point
        if is_certified or not (pristine / CKPT / "certified.json").exists():
            return genuine or not is_certified  # certified only as the pristine one was
        if genuine:
            return False  # the genuine certificate refused
        raise reshard.CheckpointError(why)  # refused: not certified

    def manager_save() -> bool:
        manager = reshard.CheckpointManager(parent, keep_last=1)
        try:
            manager.save(3, states.single_process_state(3, WORLD))
        finally:
            manager.close()
        return True

    return {
        "load": (False, load),
        "read_metadata": (False, lambda: reshard.read_metadata(ckpt) is not None),
        "validate": (False, validate),
        "inspect": (False, lambda: _cli("inspect", str(ckpt)) is None),
        "export": (False, lambda: export_safetensors(ckpt, parent / "out" / "hf") is not None),
        "convert": (False, lambda: convert_checkpoint(ckpt, parent / "out" / "copy") is not None),
        "diff": (False, lambda: diff_checkpoints(ckpt, pristine / CKPT).ok),
        "gc": (False, lambda: collect_garbage(ckpt, min_age_s=0.0) is not None),
        "gc_base": (True, lambda: collect_garbage(parent / BASE, min_age_s=0.0) is not None),
        "ls": (True, lambda: _cli("ls", str(parent)) is None),
        "validate_cli": (False, lambda: _cli("validate", str(ckpt)) is None),
        "certification": (False, certification),
        "manager_load": (True, manager_load),
        "manager_save": (True, manager_save),
    }


def run_tools(parent: Path, pristine: Path, attack_: Attack) -> Verdict:
    """Every tool on the attacked sandbox, each judged by the guarantees."""
    import reshard

    verdict = Verdict(attack_)
    for name, (root_tool, tool) in tools(parent, pristine).items():
        allowed = [*allowed_paths(parent, root_tool=root_tool), pristine]
        with guarantees.recording_paths() as log:
            try:
                verdict.results[name] = "exact" if tool() else "silent: not the pristine values"
                if attack_.retired and name in READERS:
                    verdict.results[name] = "silent: a retired checkpoint was served"
            except reshard.CheckpointError:
                verdict.results[name] = "error"
            except Exception as exc:  # anything else escaping is a finding
                verdict.results[name] = f"other: {type(exc).__name__}: {str(exc)[:300]}"
        outside = guarantees.touched_inside(log.touched, parent, allowed)
        if outside is not None:
            verdict.results[name] = f"outside: {outside.reason}"
        lost = guarantees.foreign_untouched(planted(parent))
        if lost is not None:
            verdict.results[name] = f"outside: {lost.reason}"
            break
    return verdict


def summarize(verdicts: list[Verdict]) -> dict[str, Any]:
    results = [r for v in verdicts for r in v.results.values()]
    return {
        "documents": len(verdicts),
        "tool_runs": len(results),
        "exact": sum(r == "exact" for r in results),
        "refused": sum(r == "error" for r in results),
        **{s: sum(r.startswith(f"{s}:") for r in results) for s in ("silent", "outside", "other")},
        "by_kind": {k: sum(v.attack.kind == k for v in verdicts) for k in sorted({v.attack.kind for v in verdicts})},
        "failures": [{"attack": vars(v.attack), "findings": v.findings} for v in verdicts if v.findings][:20],
    }
