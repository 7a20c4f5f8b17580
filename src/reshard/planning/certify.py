"""Judging the checks of a certified save (pure: no I/O, no collectives).

A save asked to certify (``SaveOptions(certify=CertifyOptions())``) gathers each rank's *facts* on the coordinator:
the boxes of floating tensors it saved that hold NaN or infinity, and, for every box it holds but did not write (a
replica whose copy another rank saved), the CRC-32C of each checksum chunk of its bytes. :func:`judge` compares
every such copy with the checksums of the copy saved and turns the facts into one :class:`Checks`, which every rank
receives. The peer-memory tier judges the same facts, its saved copy being the primary's own checksums.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reshard.errors import CheckpointError

__all__ = [
    "MAX_PROBLEMS",
    "CertifyOptions",
    "Checks",
    "SavedCopy",
    "box_text",
    "judge",
]

MAX_PROBLEMS = 50
"""At most this many problems are named (then one line says how many more there were)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CertifyOptions:
    """What a save checks before its step may be certified (``SaveOptions(certify=...)``).

    Attributes:
        finite: every floating tensor's saved bytes are finite (no NaN, no infinity). FP8 ``e4m3fn`` and
            ``e5m2`` data and ``e8m0`` scales are checked (their NaN encodings count); packed FP4
            (``float4_e2m1fn_x2``) has no NaN or infinity and integer tensors are not checked.
        replicas: every copy of a box (data-parallel replicas, ``replica_id`` other than zeros; a replicated plain
            tensor on every rank) holds the same bytes as the copy saved; a rank that does not write a box checksums
            its copy (an extra pass over its bytes) and the coordinator compares.
        allow_nonfinite: ``fnmatch`` patterns of keys exempt from ``finite``.

    Every rank passes equal ones (the save refuses others, naming ``certify``).

    Raises (on construction):
        TypeError: ``allow_nonfinite`` is not a tuple of strings (a lone string would match letter by letter).
    """

    finite: bool = True
    replicas: bool = True
    allow_nonfinite: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.allow_nonfinite, tuple) or not all(isinstance(p, str) for p in self.allow_nonfinite):
            raise TypeError(f"allow_nonfinite must be a tuple of fnmatch patterns, got {self.allow_nonfinite!r}")

    @property
    def checked(self) -> tuple[str, ...]:
        """The names of the checks these options run, in order."""
        return tuple(name for name, on in (("finite", self.finite), ("replicas", self.replicas)) if on)

    def exempt(self, key: str) -> bool:
        """Whether ``key`` may hold NaN or infinity."""
        return any(fnmatch.fnmatchcase(key, pattern) for pattern in self.allow_nonfinite)

    def to_json(self) -> dict[str, Any]:
        """A canonical JSON form (the ranks' agreement on the options compares it)."""
        return {"finite": self.finite, "replicas": self.replicas, "allow_nonfinite": list(self.allow_nonfinite)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Checks:
    """The outcome of a save's checks, the same on every rank.

    Attributes:
        passed: every check passed (the step may be certified).
        problems: one line each, naming the key, the box and the rank(s); at most :data:`MAX_PROBLEMS`, then a
            line saying how many more.
        checked: the checks that ran (``"finite"``, ``"replicas"``).
    """

    passed: bool
    problems: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "problems": list(self.problems), "checked": list(self.checked)}

    @classmethod
    def from_json(cls, doc: Any) -> Checks:
        """The checks as :meth:`to_json` wrote them (what the coordinator broadcasts).

        Raises:
            CheckpointError: ``doc`` is not such a document.
        """
        try:
            passed, problems, checked = doc["passed"], doc["problems"], doc["checked"]
            names = [*problems, *checked]
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"not a document of checks: {exc!r}") from None
        if not isinstance(passed, bool) or not all(isinstance(p, str) for p in names):
            raise CheckpointError(f"not a document of checks: {doc!r}")
        return cls(passed=passed, problems=tuple(problems), checked=tuple(checked))


@dataclass(frozen=True, slots=True)
class SavedCopy:
    """The copy of a box that was saved: the rank that holds it (None: an incremental save referenced its base's
    copy, or the rank is unknown) and its chunk checksums."""

    rank: int | None
    checksums: tuple[int, ...]


def box_text(offset: Sequence[int], shape: Sequence[int]) -> str:
    """A box as problems name it: ``(0,0)+(4,8)``."""
    return f"({','.join(str(int(o)) for o in offset)})+({','.join(str(int(s)) for s in shape)})"


def _first_difference(mine: Sequence[int], saved: Sequence[int], chunk_bytes: int, nbytes: int | None) -> str:
    for index, (a, b) in enumerate(zip(mine, saved, strict=False)):
        if int(a) != int(b):
            end = (index + 1) * chunk_bytes if nbytes is None else min((index + 1) * chunk_bytes, nbytes)
            return f"first in bytes [{index * chunk_bytes}, {end})"
    return f"{len(mine)} chunks against {len(saved)}"


def judge(
    facts: Sequence[Mapping[str, Any]],
    options: CertifyOptions,
    *,
    chunk_bytes: int,
    saved: Mapping[tuple[str, tuple[int, ...]], SavedCopy] | None = None,
) -> Checks:
    """The checks of one save from every rank's facts (``facts[rank]``, as
    :func:`reshard.flows.certify.local_facts` makes them): ``saved`` maps ``(key, offset)`` to the copy saved of
    each box (a storage save: from its metadata); without it (the peer-memory tier), the copy of a box whose facts
    say ``primary`` is the one every other copy is compared with. Pure; never raises for well-formed facts.

    Raises:
        CheckpointError: a rank's facts are not well formed.
    """
    problems: list[str] = []
    try:
        if options.finite:
            for rank, fact in enumerate(facts):
                for key, offset, shape, count in fact.get("nonfinite", ()):
                    if not options.exempt(key):
                        problems.append(
                            f"{key!r} box {box_text(offset, shape)} holds {count} NaN or infinite value(s) "
                            f"(saved from rank {rank})"
                        )
        if options.replicas:
            problems += _replica_problems(facts, chunk_bytes, saved)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"the certification facts are not well formed: {exc!r}") from None
    shown = problems[:MAX_PROBLEMS]
    if len(problems) > MAX_PROBLEMS:
        shown.append(f"... and {len(problems) - MAX_PROBLEMS} more problems")
    return Checks(passed=not problems, problems=tuple(shown), checked=options.checked)


def _replica_problems(
    facts: Sequence[Mapping[str, Any]],
    chunk_bytes: int,
    saved: Mapping[tuple[str, tuple[int, ...]], SavedCopy] | None,
) -> list[str]:
    """One problem per box whose copies differ, naming every rank that differs from the copy saved."""
    reference: dict[tuple[str, tuple[int, ...]], SavedCopy] = dict(saved or {})
    copies: list[tuple[int, str, tuple[int, ...], tuple[int, ...], list[int], int | None]] = []
    for rank, fact in enumerate(facts):
        for entry in fact.get("copies", ()):
            key, offset, shape, checksums, primary = entry[0], entry[1], entry[2], entry[3], entry[4]
            nbytes = int(entry[5]) if len(entry) > 5 else None
            place = (str(key), tuple(int(o) for o in offset))
            if primary and saved is None:
                reference[place] = SavedCopy(rank, tuple(int(c) for c in checksums))
            else:
                copies.append((rank, place[0], place[1], tuple(int(s) for s in shape), list(checksums), nbytes))
    differing: dict[tuple[str, tuple[int, ...]], list[str]] = {}
    shapes: dict[tuple[str, tuple[int, ...]], tuple[int, ...]] = {}
    for rank, key, offset, shape, checksums, nbytes in copies:
        copy = reference.get((key, offset))
        if copy is None:
            continue  # no saved copy to compare with (not possible in a committed save)
        if tuple(int(c) for c in checksums) != copy.checksums:
            where = _first_difference(checksums, copy.checksums, chunk_bytes, nbytes)
            differing.setdefault((key, offset), []).append(f"rank {rank} ({where})")
            shapes[(key, offset)] = shape
    problems = []
    for (key, offset), ranks in sorted(differing.items()):
        copy = reference[(key, offset)]
        holder = "the copy saved" if copy.rank is None else f"rank {copy.rank} (the copy saved)"
        problems.append(
            f"replicas of {key!r} box {box_text(offset, shapes[(key, offset)])} differ: {', '.join(ranks)} vs {holder}"
        )
    return problems
