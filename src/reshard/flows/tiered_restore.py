"""The decision of a :class:`~reshard.TieredCheckpointManager` restore: which (step, tier) candidates, in which
order, and what every rank warns of.

Every rank offers what it alone knows (:func:`offer`): the peer-memory generation it holds and that generation's
step, the outcome of the checks of the steps it saved, the node-local steps certified on its node (a node's leader);
the coordinator adds the durable root's listing. The coordinator orders the candidates (:func:`choose`): newest
step first, fastest tier first for the same step. When the manager certifies, the candidates newer than the newest
certified one are dropped, each named in a note with why it is not certified; with no certified candidate, every
candidate stays and a note says the one restored is not certified. A peer-memory generation is certified when its
checks passed (those of its own save, kept with the generation, or of a storage tier's save of the same step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reshard.flows.certify import Checks
from reshard.flows.options import check_terms
from reshard.flows.skipped import metadata_digest
from reshard.flows.steps import scan_root
from reshard.storage import Storage

__all__ = ["Candidate", "Decision", "checks_known", "choose", "durable_listing", "same_timeline"]

ORDER = {"peer": 0, "local": 1, "durable": 2}


@dataclass(frozen=True)
class Candidate:
    """One (step, tier) a restore may restore: ``certified`` (or why not, in ``why``); ``digest``: a durable step's
    ``metadata.json`` SHA-256 (the save a later save may go past when the restore skips it)."""

    step: int
    tier: str
    certified: bool = False
    why: str = ""
    digest: str | None = None

    def to_json(self) -> list[Any]:
        return [self.step, self.tier, self.certified, self.why, self.digest]

    @classmethod
    def from_json(cls, doc: list[Any]) -> Candidate:
        return cls(int(doc[0]), str(doc[1]), bool(doc[2]), str(doc[3]), doc[4])


@dataclass(frozen=True)
class Decision:
    """The coordinator's decision, the same on every rank: ``candidates`` in the order they are tried, ``notes``
    every rank warns of, ``uncertified``: the durable candidates dropped as not certified (a save may go past them),
    ``durable``: every complete durable step (a restore of an older step went past the ones that failed)."""

    candidates: tuple[Candidate, ...]
    notes: tuple[str, ...]
    uncertified: tuple[Candidate, ...]
    durable: tuple[Candidate, ...]

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Decision:
        def of(key: str) -> tuple[Candidate, ...]:
            return tuple(Candidate.from_json(c) for c in doc[key])

        return cls(of("candidates"), tuple(doc["notes"]), of("uncertified"), of("durable"))


def durable_listing(root: Storage) -> list[list[Any]]:
    """On the coordinator: the durable root's steps as ``[step, status, problem, certified, why, digest]``."""
    listed = []
    for info in scan_root(root):
        digest = None
        if info.status == "complete":
            child = root.child(info.name)
            try:
                digest = metadata_digest(child)
            finally:
                child.close()
        listed.append([info.step, info.status, info.problem, info.certified, info.certification, digest])
    return listed


def checks_known(checks: dict[int, Checks]) -> dict[str, str]:
    """This rank's outcome of the checks of the steps it saved: ``""`` passed, else their problems."""
    return {str(s): "" if c.passed else "; ".join(c.problems) or "failed" for s, c in checks.items()}


def choose(local: dict[int, str], certify: bool) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
    """The coordinator's ``combine`` of the restore's step over the ranks' :meth:`offer` values; ``local``: the
    node-local tier's restorable steps with the digests of their ``metadata.json`` (agreed before); ``certify``:
    whether to prefer certified candidates."""

    def decide(values: list[dict[str, Any]]) -> dict[str, Any]:
        terms = [{**v["terms"], "load arguments": v["kwargs"]} for v in values]
        check_terms(terms, "TieredCheckpointManager.restore")
        known: dict[str, str] = {}
        for v in values:
            for step, problems in v["checks"].items():
                known[step] = known.get(step) or problems  # a rank that saw the checks fail names why
        certified_local = {s for v in values for s in v["local_certified"]}
        notes: list[str] = []
        listed = values[0]["durable"] or []
        kept_local = same_timeline(local, {s: d for s, st, _, _, _, d in listed if st == "complete"}, notes)
        candidates = [_judged(s, "local", s in certified_local, known) for s in kept_local]
        durable = [
            Candidate(s, "durable", c, known.get(str(s)) or _why_not(why, "durable"), d)
            for s, st, _, c, why, d in listed
            if st == "complete"
        ]
        candidates += durable
        peer = _peer_candidate([v["peer"] for v in values], values[0]["kwargs"], notes)
        if peer is not None:
            candidates.append(_judged(peer, "peer", known.get(str(peer)) == "", known))
        candidates.sort(key=lambda c: (-c.step, ORDER[c.tier]))
        dropped: list[Candidate] = []
        if certify:
            candidates, dropped = _prefer_certified(candidates, notes)
        newest = candidates[0].step if candidates else -1
        notes += [
            f"durable step {s} is {status}, not restored from: {problem or 'no metadata.json'}"
            for s, status, problem, *_ in listed
            if status != "complete" and s > newest
        ]
        return {
            "candidates": [c.to_json() for c in candidates],
            "notes": notes,
            "uncertified": [c.to_json() for c in dropped if c.tier == "durable"],
            "durable": [c.to_json() for c in durable],
        }

    return decide


def same_timeline(local: dict[int, str], durable: dict[int, str], notes: list[str]) -> list[int]:
    """The node-local steps of the durable tier's timeline. A node-local copy of a step that the durable tier holds
    as another save (another job resumed from an older step, on other nodes, and finalized its own save of the step)
    is of an abandoned timeline, and so is every node-local step after it (the steps of one node-local directory are
    one timeline: a restore discards the newer ones at its next save); they are dropped, with a note."""
    diverged = [s for s in sorted(local) if s in durable and durable[s] != local[s]]
    if not diverged:
        return sorted(local)
    dropped = [s for s in sorted(local) if s >= diverged[0]]
    notes.append(
        f"node-local steps {dropped} are of another timeline: the durable tier holds step {diverged[0]} as another "
        "save (finalized by a job that resumed from an older step); not restored from"
    )
    return [s for s in sorted(local) if s < diverged[0]]


def _judged(step: int, tier: str, certified: bool, known: dict[str, str]) -> Candidate:
    why = "" if certified else known.get(str(step)) or _why_not("", tier)
    return Candidate(step, tier, certified, why)


def _why_not(why: str, tier: str) -> str:
    """Why a candidate of ``tier`` is not certified, where no rank knows its checks' problems: ``why`` (the durable
    step's own reason), unless it only says "not certified" (a note says that already)."""
    if why and why != "not certified":
        return why
    return "no checks passed for it in this job" if tier == "peer" else "no certified.json"


def _prefer_certified(candidates: list[Candidate], notes: list[str]) -> tuple[list[Candidate], list[Candidate]]:
    """The candidates kept (none newer than the newest certified one) and those dropped, each named in ``notes``."""
    certified = [c.step for c in candidates if c.certified]
    if not certified:
        if candidates:
            notes.append("no certified step: restoring the newest one, not certified")
        return candidates, []
    newest = max(certified)
    dropped = [c for c in candidates if c.step > newest]
    notes += [f"step {c.step} of the {c.tier} tier is not certified ({c.why}): step {newest} is" for c in dropped]
    return [c for c in candidates if c.step <= newest], dropped


def _peer_candidate(held: list[list[Any] | None], kwargs: list[str], notes: list[str]) -> int | None:
    """On the coordinator: the step of the peer-memory generation a restore would restore (the newest generation
    some rank holds as current, as :meth:`PeerMemoryCheckpoint.restore` agrees it), where some rank knows it; None
    when no rank holds one, or load arguments ``kwargs`` rule the tier out (said in ``notes``)."""
    known = [h for h in held if h is not None]
    if not known:
        return None
    newest = max((h[0] for h in known), key=lambda n: (int(n[0]), str(n[1])))
    steps = [h[1] for h in known if h[0] == newest and h[1] is not None]
    if kwargs:
        notes.append(f"the peer-memory tier honours no load arguments ({', '.join(kwargs)}): not restored from")
        return None
    if not steps:
        notes.append(f"no rank knows the step of the peer-memory generation {newest}: not restored from")
        return None
    return int(steps[0])
