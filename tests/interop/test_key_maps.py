"""The two maps of interop, one name each: ``KeyMap`` renames on export, ``SourceMap`` sources a safetensors load."""

from __future__ import annotations

import pytest

import reshard.interop
from reshard.interop import export, hf_source

pytestmark = pytest.mark.unit


def test_the_one_keymap_is_the_exports() -> None:
    assert reshard.interop.KeyMap is export.KeyMap
    assert reshard.interop.SourceMap is hf_source.SourceMap
    assert reshard.interop.SourceMap is not reshard.interop.KeyMap
    assert "KeyMap" not in hf_source.__all__


def test_the_old_hf_source_name_still_imports_with_a_warning() -> None:
    with pytest.warns(DeprecationWarning, match="SourceMap"):
        from reshard.interop.hf_source import KeyMap
    assert KeyMap is hf_source.SourceMap
