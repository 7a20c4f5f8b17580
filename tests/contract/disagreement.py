"""Options that disagree across ranks, for every option object and every collective entry point.

A *case* runs one flow on the ranks of a :class:`reshard.net.transports.ThreadGroup` (the real protocol, ranks
as threads) with every rank passing the flow's usual arguments except rank 1, which passes one option with
another value. The guarantee: every rank raises the same :class:`reshard.CheckpointError` subclass, whose
message names the option, and nothing is committed (the checkpoint already there is untouched).

:data:`ALTERNATES` gives, for every field of every option object, the value rank 1 passes, or the reason
the field may differ per rank (it changes only what that rank does with its own memory, never what is
written or read). ``test_every_option_field_has_a_case`` fails when an option object gains a field that is
neither, so that a new option cannot skip the agreement.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.contract import states

PER_RANK = "per-rank"


@dataclass(frozen=True)
class Case:
    flow: str
    option: str
    """The option's name, as the error must name it."""
    flipped: Any
    """What rank 1 passes instead."""
    resolved: str = ""
    """Not an error: why the ranks resolve this difference together (then every rank must return the
    exact result)."""


def _option_fields() -> dict[str, list[str]]:
    import reshard

    return {
        "SaveOptions": [f.name for f in dataclasses.fields(reshard.SaveOptions)],
        "LoadOptions": [f.name for f in dataclasses.fields(reshard.LoadOptions)],
    }


# rank 1's value for each option, or why it may differ per rank
ALTERNATES: dict[str, dict[str, Any]] = {
    "SaveOptions": {
        "fingerprint": True,
        "checksum_chunk_bytes": 1024,
        "content_hash": True,
        "memory_budget_bytes": (PER_RANK, "the size of this rank's own write buffers"),
        "verify_base": False,
        "certify": "certify",
        "reuse_plan": False,
        "metadata_parts": True,
    },
    "LoadOptions": {
        "allow_dtype_cast": False,
        "allow_lossy_cast": True,
        "max_read_amplification": (PER_RANK, "each rank plans only its own reads"),
        "memory_budget_bytes": (PER_RANK, "the size of this rank's own read buffers"),
        "verify": True,
        "staging": "staging",
        "read_once": True,
        "object_grid": "same_coordinate",
        "reuse_plan": False,
    },
}


def cases() -> list[Case]:
    """Every option of every collective entry point, as one case each."""
    out = []
    for flow, kind in (("save", "SaveOptions"), ("async_save", "SaveOptions"), ("manager_save", "SaveOptions")):
        out += [Case(flow, name, value) for name, value in ALTERNATES[kind].items() if not _per_rank(value)]
    out += [Case("load", name, value) for name, value in ALTERNATES["LoadOptions"].items() if not _per_rank(value)]
    # the same agreement over the two-level control path (reshard.net.hierarchy: each rank a node of its own)
    out += [Case("hierarchical_save", n, v) for n, v in ALTERNATES["SaveOptions"].items() if not _per_rank(v)]
    out += [Case("hierarchical_load", n, v) for n, v in ALTERNATES["LoadOptions"].items() if not _per_rank(v)]
    out += [
        Case("save", "overwrite", False),
        Case("save", "path", "other"),
        Case("save", "base", "base"),
        Case("load", "strict", False),
        Case("manager_save", "keep_last", 5),
        Case("manager_save", "keep_every", 2),
        Case("manager_save", "incremental", True),
        Case("manager_save", "certify_options", "certify"),
        Case("manager_save", "certify_hook", "hook"),
        Case("manager_save", "overwrite", True),
        Case("manager_save", "rewind", True),
        Case("manager_load", "strict", False),
        Case("transfer", "allow_lossy_cast", True),
        Case("transfer", "round_bytes", 4096),
        Case("quantize", "format", "fp8_e5m2"),
        Case("delta", "delta", False, resolved="any rank may ask for a full send; then every rank sends all"),
        Case("peer_save", "replicas", 2),
        Case("peer_save", "node_size", 2),
    ]
    return out


def _per_rank(value: Any) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and value[0] == PER_RANK


# ---- running a case ----------------------------------------------------------------------------------------

WORLD = 2


def prepare(case: Case, place: Path) -> None:
    """What exists before the case: a committed checkpoint (and a root with a step) of generation 1."""
    import reshard

    reshard.save(states.single_process_state(1, WORLD), place / "ckpt", options=reshard.SaveOptions(content_hash=True))
    reshard.save(states.single_process_state(1, WORLD), place / "base", options=reshard.SaveOptions(content_hash=True))
    manager = reshard.CheckpointManager(place / "root", keep_last=2)
    manager.save(1, states.single_process_state(1, WORLD))
    manager.close()


def _value(case: Case, rank: int, default: Any) -> Any:
    return case.flipped if rank == 1 else default


def _save_options(case: Case, rank: int) -> Any:
    import reshard

    if case.option == "certify":
        return reshard.SaveOptions(certify=reshard.CertifyOptions() if rank == 1 else None)
    if case.option in ALTERNATES["SaveOptions"]:
        return reshard.SaveOptions(**{case.option: _value(case, rank, getattr(reshard.SaveOptions(), case.option))})
    return None


def _load_options(case: Case, rank: int, place: Path) -> Any:
    import reshard

    if case.option not in ALTERNATES["LoadOptions"]:
        return None
    if rank != 1:
        return reshard.LoadOptions()
    value = case.flipped
    if case.option == "staging":
        value = reshard.StagingOptions(directory=place / f"staging-{rank}")
    return reshard.LoadOptions(**{case.option: value})


def run_rank(case: Case, rank: int, group: Any, place: Path) -> None:
    """Rank ``rank``'s part of ``case`` (raises what the flow raises)."""
    import reshard

    state = states.rank_state(rank, WORLD, 2)
    flow = case.flow.removeprefix("hierarchical_")
    if flow in ("save", "async_save"):
        path = place / (_value(case, rank, "ckpt") if case.option == "path" else "ckpt")
        kwargs: dict[str, Any] = {"overwrite": _value(case, rank, True) if case.option == "overwrite" else True}
        if case.option == "base":
            kwargs["base"] = place / "base" if rank == 1 else None
        options = _save_options(case, rank)
        if flow == "save":
            reshard.save(state, path, group=group, options=options, timeout=10, **kwargs)
        else:
            checkpointer = reshard.AsyncCheckpointer(group=group, timeout=10)
            checkpointer.save(state, path, options=options, **kwargs).wait()
    elif flow == "load":
        strict = _value(case, rank, True) if case.option == "strict" else True
        options = _load_options(case, rank, place)
        reshard.load(states.column_template(rank, WORLD), place / "ckpt", group=group, strict=strict, options=options)
    elif flow in ("manager_save", "manager_load"):
        _manager(case, rank, group, place, state)
    elif flow in ("transfer", "delta"):
        _transfer(case, rank, group)
    elif flow == "quantize":
        _quantize(case, rank, group)
    elif flow == "peer_save":
        replicas = _value(case, rank, 1) if case.option == "replicas" else 1
        node_size = _value(case, rank, 1) if case.option == "node_size" else 1
        tier = reshard.PeerMemoryCheckpoint(replicas=replicas, node_size=node_size, timeout=10)
        tier.save({k: v for k, v in state.items() if k != "rng"}, group=group)
    else:
        raise ValueError(flow)


def _manager(case: Case, rank: int, group: Any, place: Path, state: dict[str, Any]) -> None:
    import reshard

    settings: dict[str, Any] = {"keep_last": 2, "keep_every": None, "incremental": False}
    if case.option in settings:
        settings[case.option] = _value(case, rank, settings[case.option])
    if case.option == "certify_options" and rank == 1:
        settings["certify"] = reshard.CertifyOptions()
    if case.option == "certify_hook":  # every rank certifies; rank 1 alone with a hook
        settings["certify"] = reshard.CertifyOptions()
        settings["certify_hook"] = (lambda step, checks: True) if rank == 1 else None
    manager = reshard.CheckpointManager(place / "root", group=group, timeout=10, **settings)
    try:
        if case.flow == "manager_load":
            strict = _value(case, rank, True) if case.option == "strict" else True
            manager.load_latest_with_state(states.column_template(rank, WORLD), strict=strict)
        else:
            overwrite = _value(case, rank, False) if case.option == "overwrite" else False
            rewind = _value(case, rank, False) if case.option == "rewind" else False
            manager.save(2, state, overwrite=overwrite, rewind=rewind, options=_save_options(case, rank))
    finally:
        manager.close()


def _transfer(case: Case, rank: int, group: Any) -> None:
    import reshard

    source = {k: v for k, v in states.rank_state(rank, WORLD, 2, objects=False).items() if k != "step"}
    target = states.column_template(rank, WORLD)
    defaults = {"allow_lossy_cast": False, "round_bytes": 2**24}
    kwargs = {case.option: _value(case, rank, defaults[case.option])} if case.option in defaults else {}
    if case.flow == "transfer":
        reshard.transfer(source, target, group=group, timeout=10, **kwargs)
        return
    session = reshard.TransferSession(group=group, timeout=10)
    session.transfer({k: v for k, v in states.rank_state(rank, WORLD, 1, objects=False).items() if k != "step"}, target)
    session.transfer(source, target, delta=_value(case, rank, True))
    if states.column_generation(target, rank, WORLD, (1, 2)) != 2:
        raise AssertionError(f"rank {rank} holds another state than the one sent")


def _quantize(case: Case, rank: int, group: Any) -> None:
    """A quantizing transfer: ``w`` wanted as an FP8 ScaledTensor (per-tensor scale), rank 1 in another format."""
    import torch

    import reshard

    source = {k: v for k, v in states.rank_state(rank, WORLD, 2, objects=False).items() if k != "step"}
    target = states.column_template(rank, WORLD)
    fmt = _value(case, rank, "fp8_e4m3")
    dtype = torch.float8_e5m2 if fmt == "fp8_e5m2" else torch.float8_e4m3fn
    plain = target["w"]
    data = reshard.ShardedTensor.from_rank_offsets("w", plain.data.to(dtype), (1, rank, WORLD))
    target["w"] = reshard.ScaledTensor(data, torch.zeros(1, 1), fmt)
    reshard.transfer(source, target, group=group, timeout=10)


def run_case(case: Case, place: Path) -> dict[int, BaseException | None]:
    """Run ``case`` on the threads of a fresh group; each rank's exception (None: it returned)."""
    from reshard.net.hierarchy import HierarchicalThreadGroup
    from reshard.net.transports import ThreadGroup

    hierarchical = case.flow.startswith("hierarchical_")
    group = HierarchicalThreadGroup(WORLD, 1, timeout=10.0) if hierarchical else ThreadGroup(WORLD, timeout=10.0)
    outcome: dict[int, BaseException | None] = {}

    def rank_main(rank: int) -> None:
        try:
            run_rank(case, rank, group.member(rank), place)
            outcome[rank] = None
        except BaseException as exc:  # recorded and judged by the caller
            outcome[rank] = exc

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


def judge(case: Case, outcome: dict[int, BaseException | None], place: Path) -> str:
    """'' when the guarantee held, else what broke it."""
    import reshard

    if len(outcome) != WORLD:
        return f"ranks {sorted(set(range(WORLD)) - set(outcome))} did not return within 60 s (a hang)"
    classes = {r: type(e).__name__ if e is not None else "returned" for r, e in outcome.items()}
    if case.resolved:
        failed = {r: f"{type(e).__name__}: {e}" for r, e in outcome.items() if e is not None}
        return f"{case.option} differing is resolved together, yet: {failed}" if failed else ""
    if any(e is None for e in outcome.values()):
        return f"a rank returned although rank 1 passed {case.option}={case.flipped!r}: {classes}"
    if len(set(classes.values())) != 1:
        return f"the ranks raised different errors: {classes}"
    for rank, exc in outcome.items():
        if not isinstance(exc, reshard.CheckpointError):
            return f"rank {rank} raised {classes[rank]}, not a reshard error: {exc}"
        if case.option not in str(exc):
            return f"rank {rank}'s error does not name {case.option!r}: {exc}"
    problem = _untouched(case, place)
    return problem


def _untouched(case: Case, place: Path) -> str:
    """Nothing was committed: the checkpoint and the root hold generation 1 only."""
    from tests.contract import guarantees

    _, finding = guarantees.loads_as(place / "ckpt", WORLD, (1,), what="the checkpoint")
    if finding is not None:
        return finding.reason
    if (place / "root" / "step_000000002" / "metadata.json").exists():
        return "the manager committed step 2"
    if (place / "other").exists() and any((place / "other").rglob("metadata.json")):
        return "a checkpoint was committed at the other path"
    return ""


def run_all(base: Path) -> list[tuple[Case, str]]:
    """For the long mode: every case, each in a fresh directory under ``base``; what broke, per case."""
    results = []
    for i, case in enumerate(cases()):
        place = base / f"case-{i}"
        place.mkdir(parents=True)
        prepare(case, place)
        results.append((case, judge(case, run_case(case, place), place)))
    return results
