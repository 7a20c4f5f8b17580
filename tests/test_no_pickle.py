"""No pickle in the library: an AST scan of src/reshard (issue 31).

reshard's formats and collectives carry no pickle: metadata is JSON, tensors are raw bytes, objects go over the
wire as bytes (:class:`reshard.net.comm.Communicator`). The scan refuses, in every module of ``src/reshard``:

- an import of ``pickle`` (or ``cPickle``, ``dill``, ``cloudpickle``), and any use of a ``pickle`` attribute;
- ``torch.save``, and ``torch.load`` without ``weights_only=True``;
- the object collectives of ``torch.distributed`` (``broadcast_object_list``, ``all_gather_object``,
  ``gather_object``, ``scatter_object_list``, ``send_object_list``, ``recv_object_list``), which pickle.

The allow-list names each exception with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src" / "reshard"

PICKLE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle"}
OBJECT_COLLECTIVES = {
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}

WORDS = ("pickle", "dill", "torch.save", "torch.load", *OBJECT_COLLECTIVES)
"""A module whose text holds none of these cannot hold a finding of :func:`findings`: it is not parsed."""

ALLOWED: dict[tuple[str, str], str] = {
    ("interop/dcp.py", "import pickle"): (
        "the documented trust_pickle path of import_dcp: DCP's own FileSystemReader unpickles .metadata once the "
        "caller passed trust_pickle=True; reshard only catches pickle.UnpicklingError to report a broken file"
    ),
    ("interop/dcp.py", "pickle.UnpicklingError"): "the exception type of that path (no unpickling of its own)",
}


def _dotted(node: ast.expr) -> str:
    """``a.b.c`` of an attribute chain, or "" when it is not one."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _weights_only(call: ast.Call) -> bool:
    return any(
        k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True for k in call.keywords
    )


def findings(source: str) -> list[str]:
    """What the scan refuses in one module's source (see the module doc), as short labels."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLE_MODULES:
            found.append(f"from {node.module} import")
        elif isinstance(node, ast.ImportFrom):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name in OBJECT_COLLECTIVES]
        elif isinstance(node, ast.Attribute) and _dotted(node).split(".")[0] in PICKLE_MODULES:
            found.append(_dotted(node))
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rpartition(".")[2] or (node.func.id if isinstance(node.func, ast.Name) else "")
            if name == "torch.save":
                found.append("torch.save")
            elif name == "torch.load" and not _weights_only(node):
                found.append("torch.load without weights_only=True")
            elif last in OBJECT_COLLECTIVES:
                found.append(last)
    return found


def test_the_scan_finds_what_it_refuses() -> None:
    sample = (
        "import pickle\nimport torch\nimport torch.distributed as dist\n"
        "pickle.loads(b'')\ntorch.save({}, 'x')\ntorch.load('x')\ntorch.load('x', weights_only=True)\n"
        "dist.broadcast_object_list([None])\ndist.all_gather_object([], 1)\n"
    )
    assert sorted(findings(sample)) == sorted(
        [
            "import pickle",
            "pickle.loads",
            "torch.save",
            "torch.load without weights_only=True",
            "broadcast_object_list",
            "all_gather_object",
        ]
    )


def test_no_module_of_the_library_pickles() -> None:
    modules = sorted(SRC.rglob("*.py"))
    assert len(modules) > 50
    refused = []
    for path in modules:
        where = path.relative_to(SRC).as_posix()
        text = path.read_text()
        if not any(word in text for word in WORDS):  # nothing to find: spare the parse
            continue
        refused += [f"{where}: {f}" for f in findings(text) if (where, f) not in ALLOWED]
    assert refused == []


def test_every_allowed_exception_is_still_there() -> None:
    """An allow-list entry whose use went away is removed, so that the list says only what is true."""
    for where, what in ALLOWED:
        assert what in findings((SRC / where).read_text()), (where, what)
