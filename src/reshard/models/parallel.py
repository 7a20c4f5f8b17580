"""Parallel layouts of the demo model: sizes, each rank's coordinates, and explicit process groups.

There is no module-level parallel state: a :class:`ParallelGroups` object is created from the sizes and
passed to every layer and every state-dict function that needs a group (the lesson of the seed report
on explicit process groups).

Rank order inside a layout is Megatron's: tensor parallel fastest, then context parallel, then data
parallel, then pipeline parallel::

    rank = ((pp * DP + dp) * CP + cp) * TP + tp

Experts are laid out inside each pipeline stage. The ``TP * CP`` ranks that share a data-parallel index
process the same tokens; expert tensor parallelism (ETP) splits each expert over ranks that share tokens
(consecutive ranks of that set), and expert parallelism (EP) splits the experts over ranks with different
data-parallel indices, which hold different tokens. What is left is expert data parallelism (EDP):
replicas of the same expert slice.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["Group", "ParallelConfig", "ParallelGroups", "RankCoords"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelConfig:
    """The sizes of one layout. ``world_size = tp * cp * dp * pp``; ``ep`` and ``etp`` subdivide each
    pipeline stage; ``vpp`` is the number of virtual pipeline chunks per rank; ``zero`` shards Adam's
    state over data-parallel ranks (ZeRO-1)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: int = 1
    zero: bool = False

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"parallel size {name} must be a positive int, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: expert-parallel ranks hold different tokens")
        if (self.tp * self.cp) % self.etp:
            raise ValueError(
                f"etp={self.etp} must divide tp*cp={self.tp * self.cp}: expert-tensor-parallel ranks share tokens"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Parse ``"tp=2,pp=2,zero"`` style text (sizes default to 1; ``zero`` turns ZeRO-1 on)."""
        sizes: dict[str, int] = {}
        zero = False
        for part in filter(None, (p.strip() for p in text.replace("x", ",").split(","))):
            if part.lower() in ("zero", "zero1", "zero-1"):
                zero = True
                continue
            name, _, value = part.partition("=")
            name = name.strip().lower()
            if name not in ("tp", "pp", "dp", "cp", "ep", "etp", "vpp") or not value.strip().isdigit():
                raise ValueError(f"cannot parse layout part {part!r} (expected e.g. 'tp=2,pp=2,dp=1,zero')")
            sizes[name] = int(value)
        return cls(**sizes, zero=zero)

    def describe(self) -> str:
        """A short name such as ``TP2xPP2`` or ``DP2xTP2+ZeRO`` (sizes of 1 are left out)."""
        parts = [
            f"{name.upper()}{getattr(self, name)}"
            for name in ("dp", "cp", "tp", "pp", "vpp", "ep", "etp")
            if getattr(self, name) > 1
        ]
        return "x".join(parts or ["1 rank"]) + ("+ZeRO" if self.zero else "")

    def coords(self, rank: int) -> RankCoords:
        """The coordinates of ``rank`` (0 .. world_size-1) in this layout."""
        tp_i = rank % self.tp
        cp_i = (rank // self.tp) % self.cp
        dp_i = (rank // (self.tp * self.cp)) % self.dp
        pp_i = rank // (self.tp * self.cp * self.dp)
        shared = cp_i * self.tp + tp_i
        return RankCoords(
            tp=tp_i,
            cp=cp_i,
            dp=dp_i,
            pp=pp_i,
            etp=shared % self.etp,
            etp_rest=shared // self.etp,
            ep=dp_i % self.ep,
            dp_rest=dp_i // self.ep,
        )

    def rank_of(self, *, tp: int, cp: int, dp: int, pp: int) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp


@dataclass(frozen=True, slots=True)
class RankCoords:
    """A rank's index along every parallel dimension.

    ``etp``/``etp_rest`` split the rank's index among the ``tp * cp`` ranks that share tokens;
    ``ep``/``dp_rest`` split its data-parallel index. The expert-data-parallel index combines the rests.
    """

    tp: int
    cp: int
    dp: int
    pp: int
    etp: int
    etp_rest: int
    ep: int
    dp_rest: int


class Group:
    """The ranks of one parallel dimension that include this process, and their process group.

    Groups of one rank have no process group: their collectives are no-ops. ``ranks`` are global ranks
    of the default group; ``index`` is this process's position among them.
    """

    def __init__(self, ranks: list[int], process_group: dist.ProcessGroup | None, me: int) -> None:
        self.ranks = ranks
        self.process_group = process_group
        self.index = ranks.index(me)

    @property
    def size(self) -> int:
        return len(self.ranks)


class ParallelGroups:
    """All the process groups of one layout, for one rank of it.

    Create with :meth:`create`, which every process of the default group must call with the same
    arguments (creating a process group is collective over the default group); processes outside the
    layout's ranks get None.
    """

    def __init__(self, config: ParallelConfig, layout_ranks: list[int], me: int, groups: dict[str, Group]) -> None:
        self.config = config
        self.layout_ranks = layout_ranks
        self.global_rank = me
        self.rank = layout_ranks.index(me)
        self.coords = config.coords(self.rank)
        self.tp = groups["tp"]
        self.cp = groups["cp"]
        self.dp = groups["dp"]
        self.dp_cp = groups["dp_cp"]
        self.pp = groups["pp"]
        self.etp = groups["etp"]
        self.ep = groups["ep"]
        self.edp = groups["edp"]
        self.layout = groups["layout"]
        self.embedding: Group | None = groups.get("embedding", groups["pp"] if config.pp <= 2 else None)
        """The first and the last pipeline stage's ranks of this rank's (dp, cp, tp) coordinates, which hold the
        word embedding twice with ``tie_word_embeddings`` (None on the stages between them)."""

    @property
    def edp_index(self) -> int:
        return self.edp.index

    @classmethod
    def create(
        cls,
        config: ParallelConfig,
        *,
        layout_ranks: list[int] | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=120),
    ) -> ParallelGroups | None:
        """Create the groups of ``config`` over ``layout_ranks`` (default: every rank of the default group).

        Collective over the default group: every process calls it, in the same order of calls.
        """
        world = dist.get_world_size()
        me = dist.get_rank()
        ranks = list(range(world)) if layout_ranks is None else list(layout_ranks)
        if len(ranks) != config.world_size:
            raise ValueError(f"layout {config.describe()} needs {config.world_size} ranks, got {len(ranks)}")
        mine: dict[str, Group] = {}
        for name, rank_lists in _group_rank_lists(config).items():
            for local in rank_lists:
                members = [ranks[r] for r in local]
                # One-rank groups need no collectives, except the layout's own group, which reshard uses
                # (group=None would mean the whole default group).
                needed = len(members) > 1 or name == "layout"
                group = dist.new_group(members, timeout=timeout, backend="gloo") if needed else None
                if me in members:
                    mine[name] = Group(members, group, me)
        if me not in ranks:
            return None
        return cls(config, ranks, me, mine)


def _group_rank_lists(config: ParallelConfig) -> dict[str, list[list[int]]]:
    """For every kind of group, the lists of layout ranks that form one group, in a fixed order."""
    c = config
    coords = [c.coords(r) for r in range(c.world_size)]

    def by(key: Callable[[RankCoords], tuple[int, ...]]) -> list[list[int]]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, rc in enumerate(coords):
            groups.setdefault(key(rc), []).append(rank)
        return [groups[k] for k in sorted(groups)]

    return {
        "tp": by(lambda r: (r.pp, r.dp, r.cp)),
        "cp": by(lambda r: (r.pp, r.dp, r.tp)),
        "dp": by(lambda r: (r.pp, r.cp, r.tp)),
        "dp_cp": by(lambda r: (r.pp, r.tp)),
        "pp": by(lambda r: (r.dp, r.cp, r.tp)),
        "etp": by(lambda r: (r.pp, r.dp, r.etp_rest)),
        "ep": by(lambda r: (r.pp, r.etp_rest, r.etp, r.dp_rest)),
        "edp": by(lambda r: (r.pp, r.etp, r.ep)),
        "layout": [list(range(c.world_size))],
        # With two stages or fewer the pp groups are the embedding groups: no groups of their own.
        **({"embedding": [[g[0], g[-1]] for g in by(lambda r: (r.dp, r.cp, r.tp))]} if c.pp > 2 else {}),
    }
