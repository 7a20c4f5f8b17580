"""The documentation, checked against the code.

- Every Python block of README.md and docs/*.md marked ``<!-- example: run -->`` on the line before its
  fence runs, in one process, in a fresh directory, and its own asserts hold (``<!-- example: run
  needs=MODULE -->``: skipped where the optional MODULE is not installed).
- Every block marked ``<!-- signature: NAME -->`` is the signature of ``NAME`` as the code has it now
  (``render_signature``); a failure prints the text to paste.
- Every public name of ``reshard``, ``reshard.storage``, ``reshard.interop`` and ``reshard.data`` is in docs/api.md.
- Every relative link of those files points at a file of the repository (and at one of its headings).
- docs/migrating.md's claim about Megatron-Core ``torch_dist`` checkpoints: ``import_dcp`` converts their
  tensors (4 ranks save with Megatron-Core, one process imports), leaving ``common.pt`` unread.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
import reshard.data
import reshard.interop
import reshard.storage
from tests.doc_blocks import DOCS, ROOT, marked_blocks
from tests.rankpool import RankContext, RankPool

RUN_MARK = re.compile(r"<!-- example: run(?: needs=([\w.]+))? -->")
SIGNATURE_MARK = re.compile(r"<!-- signature: ([\w.]+) -->")


@pytest.mark.dist
@pytest.mark.parametrize(("where", "needs", "code"), marked_blocks(RUN_MARK))
def test_example_runs(
    where: str, needs: str | None, code: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if needs is not None:
        pytest.importorskip(needs)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, where, "exec"), {"__name__": "__doc_example__"})


def _resolve(dotted: str) -> Any:
    """The object ``dotted`` names, as user code reaches it: attributes first (``reshard.save`` is the
    function, not the module), submodules where there is no such attribute."""
    parts = dotted.split(".")
    obj: Any = importlib.import_module(parts[0])
    for index, name in enumerate(parts[1:], start=1):
        if not hasattr(obj, name):
            importlib.import_module(".".join(parts[: index + 1]))
        obj = getattr(obj, name)
    return obj


def _default(value: object) -> str:
    if callable(value) and hasattr(value, "__name__") and not isinstance(value, type):
        return str(value.__name__)
    return repr(value)


def render_signature(dotted: str) -> str:
    """``dotted(params) -> return`` as docs/api.md shows it: one line when it fits in 100 characters,
    otherwise one parameter per line. Annotations are the source's own text."""
    obj = _resolve(dotted)
    signature = inspect.signature(obj)
    params = []
    star_done = False
    for param in signature.parameters.values():
        if param.name == "self":
            continue
        text = param.name
        if param.kind is param.VAR_POSITIONAL:
            text, star_done = "*" + text, True
        elif param.kind is param.VAR_KEYWORD:
            text = "**" + text
        elif param.kind is param.KEYWORD_ONLY and not star_done:
            params.append("*")
            star_done = True
        if param.annotation is not param.empty:
            text += f": {param.annotation}"
        if param.default is not param.empty:
            text += f" = {_default(param.default)}"
        params.append(text)
    returns = ""
    if not inspect.isclass(obj) and signature.return_annotation is not signature.empty:
        returns = f" -> {signature.return_annotation}"
    one_line = f"{dotted}({', '.join(params)}){returns}"
    if len(one_line) <= 100:
        return one_line
    return f"{dotted}(\n" + "".join(f"    {p},\n" for p in params) + f"){returns}"


def _signature_cases() -> list[Any]:
    """The signature blocks, each in the unit tier but those of reshard.interop.megatron, whose import of
    megatron-core takes two seconds (dist tier)."""
    return [
        pytest.param(
            *case.values, id=case.id, marks=pytest.mark.dist if "megatron" in case.values[1] else pytest.mark.unit
        )
        for case in marked_blocks(SIGNATURE_MARK)
    ]


@pytest.mark.parametrize(("where", "name", "text"), _signature_cases())
def test_signature_matches_code(where: str, name: str, text: str) -> None:
    expected = render_signature(name)
    assert text.strip() == expected, f"{where}: the signature of {name} changed; the code has:\n{expected}"


@pytest.mark.unit
@pytest.mark.parametrize("module", [reshard, reshard.storage, reshard.interop, reshard.data], ids=lambda m: m.__name__)
def test_every_public_name_is_in_the_api_reference(module: Any) -> None:
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = [name for name in module.__all__ if not re.search(rf"\b{re.escape(name)}\b", api)]
    assert not missing, f"docs/api.md does not mention {module.__name__}: {missing}"


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file (lower case, punctuation dropped, spaces
    to dashes, ``-1``, ``-2`` ... for repeats)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        heading = None if in_fence else re.match(r"#{1,6} (.*)", line)
        if heading is not None:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.unit
def test_relative_links_point_at_files_and_headings() -> None:
    broken = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            name, _, anchor = target.partition("#")
            linked = path.parent / name if name else path
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, broken


MEGATRON_WEIGHT = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)


def rank_save_megatron_torch_dist(ctx: RankContext, path: str) -> None:
    """TP=2 x DP=2: a TP-split weight replicated over DP, one object per TP rank, common state."""
    import warnings

    from benchmarks.compare import _megatron_cpu_save_strategy
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    tp, dp = ctx.rank % 2, ctx.rank // 2
    state = {
        "w": ShardedTensor.from_rank_offsets(
            "decoder.w", MEGATRON_WEIGHT[2 * tp : 2 * tp + 2].clone(), (0, tp, 2), replica_id=dp
        ),
        "rng": ShardedObject("rng", {"seed": 10 + tp}, (2,), (tp,), replica_id=dp),
        "iteration": 1000,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dist_checkpointing.save(state, path, sharded_strategy=_megatron_cpu_save_strategy())


@pytest.mark.dist
@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core (the bench extra) is not installed"
)
def test_megatron_torch_dist_checkpoint_imports_with_import_dcp(pool4: RankPool, tmp_path: Path) -> None:
    source = tmp_path / "megatron"
    source.mkdir()
    pool4.run_ok(rank_save_megatron_torch_dist, str(source), timeout_s=240)
    assert (source / "common.pt").is_file() and (source / ".metadata").is_file()

    result = reshard.interop.import_dcp(source, tmp_path / "converted", trust_pickle=True)
    assert sorted(result.metadata.tensors) == ["decoder.w"] and not result.left_out
    loaded = reshard.load({"decoder.w": torch.empty(4, 6)}, tmp_path / "converted")
    assert torch.equal(loaded["decoder.w"], MEGATRON_WEIGHT)
    # ShardedObject cells arrive as reshard ShardedObjects, common.pt as the megatron.common object.
    assert sorted(result.metadata.objects) == ["megatron.common", "rng"] and not result.metadata.common
    loaded = reshard.load(
        {
            "rng": reshard.ShardedObject("rng", None, (2,), (1,)),
            "c": reshard.ShardedObject("megatron.common", None, (1,), (0,)),
        },
        tmp_path / "converted",
    )
    assert loaded["rng"] == {"seed": 11} and loaded["c"] == {"iteration": 1000}


LAYERS = {
    **dict.fromkeys(["_version", "errors", "geometry"], 1),
    **dict.fromkeys(["state", "net"], 2),
    **dict.fromkeys(["metadata"], 3),
    **dict.fromkeys(["storage", "planning"], 4),
    **dict.fromkeys(["io"], 5),
    **dict.fromkeys(["flows"], 6),
    **dict.fromkeys(["interop", "models", "testing", "data"], 7),
    **dict.fromkeys(["demo", "cli", "__init__", "__main__", "_moved"], 8),
}


@pytest.mark.unit
def test_layers_import_only_downwards() -> None:
    """docs/architecture.md: no module of src/reshard imports from a layer above its own, or another
    module's underscore names."""
    import ast

    src = ROOT / "src" / "reshard"
    problems = []
    for path in sorted(src.rglob("*.py")):
        top = path.relative_to(src).parts[0].removesuffix(".py")
        assert top in LAYERS, f"{path}: add its module to docs/architecture.md and to LAYERS"
        module = ".".join(path.relative_to(src.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names if alias.name.split(".")[0] == "reshard"]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "reshard":
                imported = [node.module]
            else:
                continue
            for name in imported:
                target = name.split(".")[1] if "." in name else "__init__"
                if LAYERS[target] > LAYERS[top]:
                    problems.append(f"{module} (layer {LAYERS[top]}) imports {name} (layer {LAYERS[target]})")
            if isinstance(node, ast.ImportFrom) and node.module != module:
                problems += [
                    f"{module} imports the private {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and alias.name != "__version__"
                ]
    assert not problems, "\n".join(problems)


TEST_REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+)[^`]*)?`|`::(\w+)[^`]*`")


@pytest.mark.unit
def test_every_test_the_docs_cite_exists() -> None:
    """A claim of the docs names its test (``tests/FILE.py::test_name``, or ``::test_name`` for another test of the
    file named before it; a name ending in ``…`` is a prefix): each must exist, so a renamed or removed test cannot
    leave a claim behind that nothing checks any more."""
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        current: Path | None = None
        for match in TEST_REFERENCE.finditer(doc.read_text()):
            path, name, continued = match.groups()
            if path is not None:
                current = ROOT / path
                if not current.is_file():
                    missing.append(f"{doc.name}: {path}")
                    continue
            name = name or continued
            if name is None or current is None or not current.is_file():
                continue
            prefix = match.group(0).rstrip("`").endswith("…")
            pattern = r"^def " + re.escape(name) + ("" if prefix else r"\b")
            if not re.search(pattern, current.read_text(), re.MULTILINE):
                missing.append(f"{doc.name}: {current.relative_to(ROOT)}::{name}")
    assert not missing, "\n".join(missing)
