"""The module paths of release 0.x that moved into the layer folders, importable for one more release.

``reshard.manager`` is now ``reshard.flows.manager``, ``reshard.megatron`` is ``reshard.interop.megatron``,
and so on (docs/api.md, "Moved modules"). An import of an old path returns the module at its new path (the
same module object, not a copy) with a ``DeprecationWarning`` naming the new path. ``reshard.save``,
``reshard.load``, ``reshard.transfer`` and ``reshard.async_save`` are the public functions and have no
module alias: their modules are ``reshard.flows.save`` and so on.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence

MOVED_MODULES = {
    "reshard.dtypes": "reshard.state.dtypes",
    "reshard.sharding": "reshard.state.sharding",
    "reshard.codec": "reshard.state.codec",
    "reshard.fingerprint": "reshard.state.fingerprint",
    "reshard.statedict": "reshard.state.statedict",
    "reshard.dtensor": "reshard.state.dtensor",
    "reshard.transports": "reshard.net.transports",
    "reshard.comm": "reshard.net.comm",
    "reshard.exchange": "reshard.io.exchange",
    "reshard.locking": "reshard.io.locking",
    "reshard.sources": "reshard.io.sources",
    "reshard.staging": "reshard.io.staging",
    "reshard.references": "reshard.io.references",
    "reshard.retirement": "reshard.io.retirement",
    "reshard.options": "reshard.flows.options",
    "reshard.stats": "reshard.flows.stats",
    "reshard.manager": "reshard.flows.manager",
    "reshard.maintenance": "reshard.flows.maintenance",
    "reshard.transfer_delta": "reshard.flows.transfer_delta",
    "reshard.peer": "reshard.flows.peer",
    "reshard.collector": "reshard.flows.collector",
    "reshard.progress": "reshard.flows.progress",
    "reshard.megatron": "reshard.interop.megatron",
    # moved in the two releases' worth of changes before the folders (still documented then):
    "reshard.demo.model": "reshard.models.gpt",
    "reshard.demo.parallel": "reshard.models.parallel",
    "reshard.demo.collectives": "reshard.models.collectives",
    "reshard.demo.peft": "reshard.models.peft",
    "reshard.demo.hf": "reshard.models.hf",
    "reshard.demo.hf_export": "reshard.models.hf_export",
    "reshard.boxes": "reshard.geometry.boxes",
    "reshard.planning.grid": "reshard.geometry.grid",
    "reshard.planning.tiling": "reshard.geometry.tiling",
}


def new_module_name(old: str) -> str | None:
    """The module path that ``old`` moved to (``reshard.megatron.convert`` ->
    ``reshard.interop.megatron.convert``), or None when ``old`` did not move."""
    for before, after in MOVED_MODULES.items():
        if old == before or old.startswith(before + "."):
            return after + old[len(before) :]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module already at its new path.

    The import system sets ``__spec__`` of whatever :meth:`create_module` returns to the old path's spec;
    :meth:`exec_module` gives the module its own spec back, so that ``importlib.reload`` and ``find_spec`` of
    the new path keep working after an old path was imported.
    """

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        warnings.warn(
            f"{self.old} moved to {self.new}; the old path will be removed in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run (the module at the new path is already executed): restore its own spec."""
        module.__spec__ = self.own_spec


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds old module paths ahead of the path finder, which would otherwise load a moved subpackage's
    submodules a second time under the old name."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_module_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname, new))


def install_moved_module_aliases() -> None:
    """Put the finder of old module paths first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModuleFinder())
