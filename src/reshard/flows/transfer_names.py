"""The source key of each target tensor of a transfer, ``key_map`` applied, with a scaled target's parts
kept together.

A target :class:`~reshard.ScaledTensor` ``K`` is three tensors (``K``, ``K:scale`` and, for the NVFP4
formats, ``K:global_scale``) but one unit of state: its data and its scales must come from one source.
So ``key_map`` names the source of the data only, and the scales follow: when ``K`` comes from ``N``,
``K:scale`` comes from ``N:scale`` and ``K:global_scale`` from ``N:global_scale`` (the keys a source
ScaledTensor's parts have, and the parts a quantizing transfer makes of a high-precision ``N``). A
``key_map`` may list a part too, but only as that same source; a part mapped elsewhere (another tensor's
scales, or a scale key listed without its data key) would pair data with scales that were not computed
for it, and is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from reshard.errors import MismatchError
from reshard.state.scaled import GLOBAL_SCALE_SUFFIX, SCALE_SUFFIX, ScaledRecord

__all__ = ["ScaledParts", "scaled_parts", "source_key"]

ScaledParts = dict[str, tuple[str, str]]
"""A scaled target's scale and global-scale names, each mapped to (its data's name, its suffix)."""


def scaled_parts(records: Iterable[ScaledRecord]) -> ScaledParts:
    """The scale parts of the target ScaledTensors ``records``."""
    parts: ScaledParts = {}
    for record in records:
        parts[record.scale_key] = (record.key, SCALE_SUFFIX)
        if record.global_scale_key is not None:
            parts[record.global_scale_key] = (record.key, GLOBAL_SCALE_SUFFIX)
    return parts


def source_key(rename: Callable[[str], str], name: str, parts: ScaledParts) -> str:
    """The source key of the target tensor ``name``: ``rename(name)``, or for a part of a scaled target,
    the same part of its data's source.

    Raises:
        MismatchError: ``rename`` maps a scale part to another key than its data's source's part (naming
            the part, where it maps it, the data and its source).
    """
    if name not in parts:
        return rename(name)
    data, suffix = parts[name]
    source = rename(data)
    derived = source + suffix
    mapped = rename(name)
    if mapped not in (name, derived):
        raise MismatchError(
            f"transfer: key_map maps {name!r} to {mapped!r}, but the target ScaledTensor {data!r} comes from "
            f"{source!r}, whose {suffix[1:].replace('_', ' ')} is {derived!r}: a scaled target's parts come from "
            f"one source (map the data key {data!r} only; its scales follow)"
        )
    return derived
