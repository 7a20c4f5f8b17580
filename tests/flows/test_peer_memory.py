"""The peer-memory tier (``reshard.PeerMemoryCheckpoint``), with real process deaths.

Six gloo ranks (three "nodes" of two) at TP=2 x DP=3 save a durable checkpoint and a peer-memory one
(one copy of every primary box on the next node). Then node 0, which holds every primary box, is killed
with SIGKILL; the four survivors and two new ranks (fresh processes, holding nothing) form a new process
group on a new port and restore at TP=6, with no storage to fall back on: bit-exact. Then node 1, which
held the copies, is killed too: the last two ranks cannot restore from memory, are told which boxes were
lost, and fall back to the durable checkpoint.
"""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import reshard
from reshard.net.transports import ThreadGroup
from tests.memory import peak_rss_growth
from tests.rankpool import forkserver_context
from tests.threads import on_threads

W = torch.arange(12 * 4, dtype=torch.float32).reshape(12, 4)
EMB = torch.arange(6 * 8, dtype=torch.float64).reshape(6, 8) / 3
BIAS = torch.arange(5, dtype=torch.bfloat16)
TIMEOUT = datetime.timedelta(seconds=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _training_state(rank: int) -> dict[str, Any]:
    """TP=2 x DP=3: ``w`` split on rows, ``emb`` on columns, by TP; DP ranks are replicas."""
    tp, dp = rank % 2, rank // 2
    return {
        "w": reshard.ShardedTensor.from_rank_offsets("w", W[tp * 6 : tp * 6 + 6].clone(), (0, tp, 2), replica_id=dp),
        "emb": reshard.ShardedTensor.from_rank_offsets(
            "emb", EMB[:, tp * 4 : tp * 4 + 4].clone(), (1, tp, 2), replica_id=dp
        ),
        "bias": BIAS.clone(),
        "step": 7,
    }


def _template(rank: int, world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """TP=``world``: ``w`` on rows, ``emb`` on rows (world 6, unlike the training layout) or columns; and
    what each tensor must hold."""
    rows = 12 // world
    if 6 % world == 0 and world > 2:
        emb_rows = 6 // world
        emb = reshard.ShardedTensor.from_rank_offsets(
            "emb", torch.empty(emb_rows, 8, dtype=torch.float64), (0, rank, world)
        )
        emb_expected = EMB[rank * emb_rows : (rank + 1) * emb_rows]
    else:
        cols = 8 // world
        emb = reshard.ShardedTensor.from_rank_offsets(
            "emb", torch.empty(6, cols, dtype=torch.float64), (1, rank, world)
        )
        emb_expected = EMB[:, rank * cols : (rank + 1) * cols]
    template = {
        "w": reshard.ShardedTensor.from_rank_offsets("w", torch.empty(rows, 4), (0, rank, world)),
        "emb": emb,
        "bias": torch.empty(5, dtype=torch.bfloat16),
        "step": 0,
    }
    return template, {"w": W[rank * rows : (rank + 1) * rows], "emb": emb_expected, "bias": BIAS}


def _check_restore(tier: Any, new_rank: int, world: int, root: str, with_fallback: bool, rank: int) -> tuple[Any, ...]:
    """Restore this rank's part of the new layout; what to report."""
    template, expected = _template(new_rank, world)
    stats = reshard.TransferStats()
    fallback = reshard.CheckpointManager(Path(root) / "durable", timeout=60) if with_fallback else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            restored = tier.restore(template, fallback=fallback, stats=stats)
        except reshard.DataUnavailableError as exc:
            return ("unavailable", rank, str(exc))
    exact = all(torch.equal(restored[k], v) for k, v in expected.items()) and restored["step"] == 7
    lost = [str(w.message) for w in caught if "peer-memory restore impossible" in str(w.message)]
    return ("restored", rank, exact, stats.bytes_received + stats.bytes_copied, lost)


def _reported_restore(
    tier: Any, new_rank: int, world: int, root: str, with_fallback: bool, rank: int
) -> tuple[Any, ...]:
    """:func:`_check_restore`'s report, or ``("error", rank, ...)`` naming what it raised: a rank that fails
    reports it instead of leaving the test to wait out its timeout for a message that never comes."""
    try:
        return _check_restore(tier, new_rank, world, root, with_fallback, rank)
    except Exception as exc:
        return ("error", rank, f"{type(exc).__name__}: {exc}")


def late_rank(rank: int, new_rank: int, world: int, port: int, root: str, results: Any) -> None:
    """A rank started after the failure: it holds nothing, joins the new group and restores."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=new_rank, world_size=world, timeout=TIMEOUT
    )
    tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=2, timeout=60)
    results.put(_reported_restore(tier, new_rank, world, root, False, rank))
    dist.destroy_process_group()


def peer_rank(rank: int, port: int, root: str, commands: Any, results: Any) -> None:
    """One rank: save both tiers, then restore whenever told to (in a new group), until told to exit."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=6, timeout=TIMEOUT)
    state = _training_state(rank)
    manager = reshard.CheckpointManager(Path(root) / "durable", timeout=60)
    manager.save(7, state)
    manager.close()
    tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=2, timeout=60)
    saved = tier.save(state)
    results.put(("saved", rank, saved.own_bytes, saved.copy_bytes))
    while True:
        command = commands.get(timeout=240)
        if command[0] == "exit":
            return
        _, new_rank, world, new_port, with_fallback = command
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{new_port}", rank=new_rank, world_size=world, timeout=TIMEOUT
        )
        results.put(_reported_restore(tier, new_rank, world, root, with_fallback, rank))


def _collect(results: Any, count: int, kind: str) -> list[tuple[Any, ...]]:
    out = []
    for _ in range(count):
        try:
            message = results.get(timeout=180)
        except queue.Empty:
            pytest.fail(f"ranks did not report {kind} within 180 s")
        assert message[0] in (kind, "unavailable"), message
        out.append(message)
    return sorted(out, key=lambda m: m[1])


@pytest.mark.dist
def test_restore_from_peer_memory_into_another_layout_after_sigkill(tmp_path: Path) -> None:
    context = forkserver_context()  # fresh processes, forked from a server that imported torch and reshard once
    results = context.Queue()
    commands = [context.Queue() for _ in range(6)]
    port = _free_port()
    processes = [
        context.Process(target=peer_rank, args=(r, port, str(tmp_path), commands[r], results)) for r in range(6)
    ]
    for p in processes:
        p.start()
    try:
        saved = _collect(results, 6, "saved")
        # Only DP rank 0 (node 0) holds primaries, 6 rows of w, 4 columns of emb each; node 0's copies are on node 1.
        primary = 6 * 4 * 4 + 6 * 4 * 8
        assert [s[2] for s in saved] == [primary + 5 * 2, primary, 0, 0, 0, 0]  # rank 0 also the plain bias
        assert [s[3] for s in saved] == [0, 0, primary + 5 * 2, primary, 0, 0]
        for r in (0, 1):  # node 0 dies: every primary box is gone from its owner
            os.kill(processes[r].pid, signal.SIGKILL)
            processes[r].join(timeout=30)
        port = _free_port()
        for new_rank_number, old in enumerate((2, 3, 4, 5)):
            commands[old].put(("restore", new_rank_number, 6, port, False))
        joined = [
            context.Process(target=late_rank, args=(6 + i, 4 + i, 6, port, str(tmp_path), results)) for i in range(2)
        ]
        for p in joined:
            p.start()
        processes.extend(joined)
        restored = _collect(results, 6, "restored")
        assert all(m[0] == "restored" and m[2] for m in restored), restored  # bit-exact, no storage
        needed = (12 // 6) * 4 * 4 + (6 // 6) * 8 * 8 + 5 * 2
        assert [m[3] for m in restored] == [needed] * 6
        assert all(not m[4] for m in restored)
        for r in (2, 3):  # node 1 dies too: the copies of node 0's boxes are gone as well
            os.kill(processes[r].pid, signal.SIGKILL)
            processes[r].join(timeout=30)
        port = _free_port()
        for new_rank_number, old in enumerate((4, 5)):
            commands[old].put(("restore", new_rank_number, 2, port, False))
        refused = _collect(results, 2, "unavailable")
        assert all(m[0] == "unavailable" and "held by no rank" in m[2] for m in refused), refused
        port = _free_port()
        for new_rank_number, old in enumerate((4, 5)):
            commands[old].put(("restore", new_rank_number, 2, port, True))
        fallen_back = _collect(results, 2, "restored")
        assert all(m[2] for m in fallen_back), fallen_back  # bit-exact, from the durable checkpoint
        assert all(m[4] and "held by no rank" in m[4][0] for m in fallen_back)
    finally:
        for r, p in enumerate(processes[:6]):
            if p.is_alive():
                commands[r].put(("exit",))
        for p in processes:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


@pytest.mark.unit
def test_too_few_nodes_for_the_copies_is_an_error() -> None:
    with pytest.raises(ValueError, match="too few"):
        reshard.PeerMemoryCheckpoint(replicas=1, node_size=1).save({"w": torch.ones(2)})


# ---- what the ranks of a peer save or restore must agree on, and what a save holds -------------------------


def _thread_errors(ranks: int, run: Any) -> list[str]:
    group = ThreadGroup(ranks)
    errors = [""] * ranks

    def rank(r: int) -> None:
        try:
            run(r, group.member(r))
        except reshard.CheckpointError as exc:
            errors[r] = f"{type(exc).__name__}: {exc}"

    on_threads(ranks, rank)
    return errors


@pytest.mark.unit
def test_ranks_passing_other_peer_arguments_fail_every_rank() -> None:
    """A rank with another ``node_size`` (or ``replicas``) would keep copies where the others do not look for
    them; one restoring with a ``fallback`` while the others do not would load alone. Every rank raises the same
    CheckpointError naming the argument and the ranks of each value."""

    def save(r: int, member: Any) -> None:
        tier = reshard.PeerMemoryCheckpoint(replicas=1, node_size=1 if r == 3 else 2)
        tier.save({"w": reshard.ShardedTensor.from_rank_offsets("w", torch.ones(2, 4), (0, r, 4))}, group=member)

    errors = _thread_errors(4, save)
    assert all(e.startswith("CheckpointError") for e in errors) and len(set(errors)) == 1, errors
    assert "node_size: 2 on ranks 0, 1, 2, 1 on rank 3" in errors[0], errors[0]

    tiers = [reshard.PeerMemoryCheckpoint(replicas=1, node_size=1) for _ in range(2)]
    group = ThreadGroup(2)
    on_threads(2, lambda r: tiers[r].save({"w": torch.ones(4)}, group=group.member(r)))
    manager = reshard.CheckpointManager(reshard.storage.ObjectStorage("memory://peer-fallback/root"))

    def restore(r: int, member: Any) -> None:
        tiers[r].restore({"w": torch.zeros(4)}, group=member, fallback=manager if r == 0 else None)

    errors = _thread_errors(2, restore)
    assert all(e.startswith("CheckpointError") and "fallback: True on rank 0, False on rank 1" in e for e in errors)


@pytest.mark.unit
def test_a_peer_save_holds_two_generations_at_most() -> None:
    """Each save keeps the previous generation until the new one is everywhere, then releases it. Two ranks,
    each with 16 MiB of its own and a 16 MiB copy of its peer's (a 64 MiB generation): three more saves raise
    the peak resident memory no more than the first save did (one generation and the transfer's buffers), so
    no more than two generations are ever held; holding a third would add 64 MiB."""
    mib = 1 << 20
    tiers = [reshard.PeerMemoryCheckpoint(replicas=1, node_size=1) for _ in range(2)]
    data = [torch.zeros(4 * mib) for _ in range(2)]
    states = [{"w": reshard.ShardedTensor.from_rank_offsets("w", data[r], (0, r, 2))} for r in range(2)]
    group = ThreadGroup(2)

    def save(g: int) -> None:
        for tensor in data:
            tensor.fill_(float(g))
        on_threads(2, lambda r: tiers[r].save(states[r], group=group.member(r)))

    with peak_rss_growth() as first:
        save(0)
    with peak_rss_growth() as later:
        for g in range(1, 4):
            save(g)
    assert later() <= first() + 32 * mib, f"first save: {first() / mib:.0f} MiB, later ones: {later() / mib:.0f} MiB"
    template = {"w": torch.zeros(8 * mib)}
    restored = on_threads(
        2, lambda r: tiers[r].restore(template if r else {"w": torch.zeros(8 * mib)}, group=group.member(r))
    )
    assert torch.equal(restored[0]["w"], torch.full((8 * mib,), 3.0))


@pytest.mark.unit
@pytest.mark.parametrize(
    ("arguments", "environment", "named"),
    [
        ({"replicas": 0}, None, "replicas"),
        ({"replicas": 1.5}, None, "replicas"),
        ({"replicas": "2"}, None, "replicas"),
        ({"replicas": True}, None, "replicas"),
        ({"node_size": 0}, None, "node_size"),
        ({"node_size": 2.0}, None, "node_size"),
        ({}, "two", "LOCAL_WORLD_SIZE"),
        ({}, "0", "LOCAL_WORLD_SIZE"),
    ],
)
def test_bad_peer_memory_arguments_are_a_value_error_naming_them(
    arguments: dict[str, Any], environment: str | None, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like SaveOptions, LoadOptions and CheckpointManager: an argument that is not a positive integer is a
    ValueError that names it, raised by the constructor (not a TypeError from a comparison, nor a float or a
    bool taken as a count)."""
    if environment is not None:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", environment)
    with pytest.raises(ValueError, match=named):
        reshard.PeerMemoryCheckpoint(**arguments)


@pytest.mark.unit
def test_two_different_tensors_of_one_box_on_one_rank_fail_a_peer_save_on_every_rank() -> None:
    """Issue 34: rank 1 holds two different tensors as its box of ``w``: every rank raises the same ShardingError
    naming the key and both paths, and the generation saved before still restores."""
    tiers = [reshard.PeerMemoryCheckpoint(replicas=1, node_size=1) for _ in range(2)]

    def shard(r: int, value: float) -> reshard.ShardedTensor:
        return reshard.ShardedTensor.from_rank_offsets("w", torch.full((2,), value), (0, r, 2))

    _thread_errors(2, lambda r, member: tiers[r].save({"a": shard(r, r)}, group=member))
    errors = _thread_errors(
        2, lambda r, member: tiers[r].save({"a": shard(r, 3.0), "b": shard(r, 3.0 + r)}, group=member)
    )
    assert errors[0] == errors[1] and errors[0].startswith("ShardingError"), errors
    assert all(word in errors[0] for word in ("'w'", "'a'", "'b'")), errors[0]
    group = ThreadGroup(2)
    restored = on_threads(2, lambda r: tiers[r].restore({"w": torch.zeros(4)}, group=group.member(r)))
    assert torch.equal(restored[0]["w"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
