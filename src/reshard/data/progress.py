"""The data position of a job in global terms: what each rank reports, their combination, the stored value.

Each rank reports a :class:`RankReport` (JSON): the sampler's parameters, its data-parallel rank, the
consumed positions its iteration began with (as a digest: they are the same on every rank), and how many
samples of its own sequence the training loop consumed. The coordinator combines them
(:func:`combine_reports`): every parameter must agree, every data-parallel rank be present, and ranks
that share a data-parallel rank (TP/PP peers) report the same; otherwise DataStateError. The result is
:class:`DataProgress`, layout-independent, stored as one single-cell ``ShardedObject``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from reshard.data.order import MAX_EPOCH, SEED_RANGE, Positions, generator_seed
from reshard.data.sampler import dealt_positions
from reshard.errors import DataStateError

FORMAT = "reshard.data.sampler/1"
"""The ``format`` entry of the stored value."""

MAX_INT = 2**63 - 1
"""The largest size or count a stored value may hold (an int64)."""

EXACT_FIELDS = ("size", "seed", "shuffle", "drop_last", "epoch", "dp_size", "base")
"""What every rank of a capture must agree on."""


def digest(positions: Positions) -> str:
    """A short digest of a set of positions, to check that ranks agree without sending the set."""
    return hashlib.sha256(repr(positions.intervals).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class DataProgress:
    """The combined data state: the epoch's consumed positions of a known order, or an opaque client.

    ``opaque`` names the clients whose order reshard cannot know (empty for an exact value); for them
    ``consumed_samples`` is what is known (samples the loop consumed in the current iteration, summed over the
    data-parallel ranks), and ``consumed`` is empty.
    """

    size: int | None
    seed: int | None
    shuffle: bool | None
    drop_last: bool | None
    epoch: int | None
    dp_size: int | None
    consumed: Positions
    opaque: tuple[str, ...] = ()
    consumed_samples: int | None = None

    def to_value(self) -> dict[str, Any]:
        """The stored value (JSON-like, the positions as a ``(k, 2)`` int64 tensor)."""
        return {
            "format": FORMAT,
            "kind": "opaque" if self.opaque else "exact",
            "size": self.size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "saved_dp_size": self.dp_size,
            "consumed": self.consumed.to_tensor(),
            "clients": list(self.opaque),
            "consumed_samples": self.consumed_samples,
        }

    def to_json(self) -> dict[str, Any]:
        """The value as JSON (the positions as ``[[start, stop], ...]``), for the capture's broadcast."""
        value = self.to_value()
        value["consumed"] = [list(pair) for pair in self.consumed.intervals]
        return value

    @staticmethod
    def from_json(doc: dict[str, Any]) -> DataProgress:
        """The inverse of :meth:`to_json`."""
        value = dict(doc)
        value["consumed"] = torch.tensor(doc["consumed"], dtype=torch.int64).reshape(-1, 2)
        return DataProgress.from_value(value)

    @staticmethod
    def from_value(value: object) -> DataProgress:
        """The progress a stored value holds, every field checked (DataStateError naming what is wrong)."""
        if not isinstance(value, dict) or value.get("format") != FORMAT:
            raise DataStateError(f"not a reshard.data sampler value (format {FORMAT!r}): {_short(value)}")
        kind = value.get("kind")
        if kind not in ("exact", "opaque"):
            raise DataStateError(f"reshard.data value: kind {kind!r} is neither 'exact' nor 'opaque'")
        exact = kind == "exact"
        size = _field(value, "size", int, required=exact, low=0)
        clients = value.get("clients")
        if not isinstance(clients, list) or not all(isinstance(c, str) for c in clients) or bool(clients) == exact:
            raise DataStateError(f"reshard.data value: clients {_short(clients)} do not match kind {kind!r}")
        consumed = Positions.from_tensor(
            value.get("consumed"), size if size is not None else 0, where="reshard.data value"
        )
        seed = _field(value, "seed", int, required=exact, low=SEED_RANGE[0], high=SEED_RANGE[1])
        epoch = _field(value, "epoch", int, required=exact, low=0, high=MAX_EPOCH)
        if seed is not None and epoch is not None:
            generator_seed(seed, epoch, where="reshard.data value")
        return DataProgress(
            size=size,
            seed=seed,
            shuffle=_field(value, "shuffle", bool, required=exact),
            drop_last=_field(value, "drop_last", bool, required=exact),
            epoch=epoch,
            dp_size=_field(value, "saved_dp_size", int, required=exact, low=1),
            consumed=consumed,
            opaque=tuple(clients),
            consumed_samples=_field(value, "consumed_samples", int, required=False, low=0),
        )


def _field(
    value: dict[str, Any], name: str, kind: type[Any], *, required: bool, low: int | None = None, high: int = MAX_INT
) -> Any:
    """``value[name]``, of exactly type ``kind`` (bool is not an int here), an int within ``[low, high]``
    (an int64 by default: sizes and counts beyond it are no dataset's); None allowed when not ``required``."""
    item: Any = value.get(name)
    if item is None and not required:
        return None
    if type(item) is not kind or (kind is int and (item > high or (low is not None and item < low))):
        bound = f" in [{low}, {high}]" if low is not None else f" <= {high}" if kind is int else ""
        raise DataStateError(
            f"reshard.data value: {name} is {_short(item)}, not {'an' if kind is int else 'a'} {kind.__name__}{bound}"
        )
    return item


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


@dataclass(frozen=True)
class RankReport:
    """What one rank reports at a capture (sent as JSON). ``client`` names the loader and sampler;
    ``opaque`` is True when reshard cannot know its order (then only ``taken`` and the known fields count)."""

    client: str
    opaque: bool
    dp_rank: int | None
    dp_size: int | None
    size: int | None
    seed: int | None
    shuffle: bool | None
    drop_last: bool | None
    epoch: int | None
    base: str
    taken: int | None
    finished: bool

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def combine_reports(reports: list[dict[str, Any]], base: Positions) -> dict[str, Any]:
    """The coordinator's combination of every rank's :class:`RankReport` (in rank order) into the JSON of a
    :class:`DataProgress`; ``base`` is the coordinator's own consumed positions before its iteration (every
    rank's digest must match it). DataStateError, raised on every rank by the step, when they disagree."""
    opaque = sorted({r["client"] for r in reports if r["opaque"]})
    if opaque:
        return _combine_opaque(reports, opaque).to_json()
    for name in EXACT_FIELDS:
        seen = {repr(r[name]): r[name] for r in reports}
        if len(seen) > 1:
            per_rank = ", ".join(f"rank {i}: {r[name]!r}" for i, r in enumerate(reports))
            what = "consumed positions before the iteration" if name == "base" else name
            raise DataStateError(f"reshard.data.capture: the ranks disagree on the {what} ({per_rank})")
    first = reports[0]
    if first["base"] != digest(base):
        raise DataStateError("reshard.data.capture: the coordinator's consumed positions do not match its report")
    by_dp = _by_data_rank(reports, first["dp_size"])
    size, world = first["size"], first["dp_size"]
    dealt = dealt_positions(size, world, base, first["drop_last"])
    taken_mask = base.mask(size)
    for dp_rank, (taken, finished) in enumerate(by_dp):
        own = dealt[dp_rank::world]
        if taken > own.numel():
            raise DataStateError(
                f"reshard.data.capture: data-parallel rank {dp_rank} consumed {taken} samples of its {own.numel()}"
            )
        taken_mask[own if finished else own[:taken]] = True
    consumed = Positions.from_mask(taken_mask)
    if all(finished for _, finished in by_dp):
        consumed = Positions.prefix(size)  # the epoch is over: nothing of it is left on any layout
    return DataProgress(
        size, first["seed"], first["shuffle"], first["drop_last"], first["epoch"], world, consumed
    ).to_json()


def _by_data_rank(reports: list[dict[str, Any]], world: int) -> list[tuple[int, bool]]:
    """(samples taken, finished) per data-parallel rank; every one present, replicas agreeing."""
    found: dict[int, tuple[int, bool]] = {}
    for rank, report in enumerate(reports):
        dp_rank, own = report["dp_rank"], (report["taken"], report["finished"])
        if dp_rank in found and found[dp_rank] != own:
            raise DataStateError(
                f"reshard.data.capture: ranks of data-parallel rank {dp_rank} disagree: {found[dp_rank]} "
                f"(samples taken, finished) and rank {rank}'s {own}"
            )
        found[dp_rank] = own
    missing = sorted(set(range(world)) - set(found))
    if missing:
        raise DataStateError(
            f"reshard.data.capture: data-parallel ranks {missing} of {world} are in no rank of the group"
        )
    return [found[r] for r in range(world)]


def _combine_opaque(reports: list[dict[str, Any]], clients: list[str]) -> DataProgress:
    """What is known of an opaque job: the samples consumed, summed over data-parallel ranks (once per
    data-parallel rank), and the parameters the ranks agree on."""

    def agreed(name: str) -> Any:
        values = {repr(r[name]): r[name] for r in reports}
        return next(iter(values.values())) if len(values) == 1 else None

    per_dp: dict[tuple[str, int], int | None] = {}  # a rank without a data-parallel rank counts by its own
    for rank, report in enumerate(reports):
        per_dp[("dp", report["dp_rank"]) if report["dp_rank"] is not None else ("rank", rank)] = report["taken"]
    taken = list(per_dp.values())
    total = sum(t for t in taken if t is not None) if all(t is not None for t in taken) else None
    return DataProgress(
        agreed("size"),
        agreed("seed"),
        agreed("shuffle"),
        agreed("drop_last"),
        agreed("epoch"),
        agreed("dp_size"),
        Positions(),
        tuple(clients),
        total,
    )
