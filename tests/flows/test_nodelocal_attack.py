"""What an outside attack on reshard.NodeLocalCheckpoints found (issue 33), on ranks that are threads
(reshard.net.transports.ThreadGroup): certification of a node-local save, retention that must not delete a
user's files or follow a link, a damaged fetched copy while another node holds the file whole, and ranks that
pass different ``node_size``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.flows.certify import certificate_status
from reshard.net.transports import ThreadGroup
from reshard.storage import LocalStorage
from tests.threads import on_threads

pytestmark = pytest.mark.unit

CERTIFY = reshard.SaveOptions(certify=reshard.CertifyOptions())


def _state(rank: int) -> dict[str, Any]:
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    return {"w": reshard.ShardedTensor.from_rank_offsets("w", full[rank * 2 : rank * 2 + 2].clone(), (0, rank, 4))}


def _replicated(rank: int, *, differ: bool = False, nan: bool = False) -> dict[str, Any]:
    """TP 2 x DP 2: ranks 2 and 3 hold replicas of ranks 0 and 1's parts (rank 3's differs with ``differ``)."""
    tp, dp = rank % 2, rank // 2
    part = torch.arange(16.0).reshape(4, 4)[tp * 2 : (tp + 1) * 2].clone()
    if differ and rank == 3:
        part[0, 0] += 1
    if nan and tp == 0:
        part[0, 0] = float("nan")
    return {"w": reshard.ShardedTensor.from_rank_offsets("w", part, (0, tp, 2), replica_id=dp)}


def _tiers(pattern: str, group: ThreadGroup, rank: int, **kwargs: Any) -> reshard.NodeLocalCheckpoints:
    return reshard.NodeLocalCheckpoints(pattern, node_size=2, group=group.member(rank), **kwargs)


def _save_all(pattern: str, step: int, state: Any, options: reshard.SaveOptions | None = None, **kw: Any) -> list[Any]:
    group = ThreadGroup(4, timeout=30)
    return on_threads(
        4, lambda r: _tiers(pattern, group, r, **kw).save(step, state(r), options=options).checks, group=group
    )


def _step(tmp_path: Path, node: int, step: int) -> Path:
    return tmp_path / f"node{node}" / f"step_{step:09d}"


# ---- 1. certification ------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:reshard. .* is saved but not certified")
def test_a_differing_replica_or_a_nan_is_reported_on_every_rank_and_certifies_no_node(tmp_path: Path) -> None:
    pattern = os.path.join(tmp_path, "node{node}")
    cases = ((1, lambda r: _replicated(r, differ=True), "replica"), (2, lambda r: _replicated(r, nan=True), "finite"))
    for step, state, named in cases:
        checks = _save_all(pattern, step, state, CERTIFY)
        assert all(c is not None and not c.passed for c in checks), checks
        assert len({repr(c.to_json()) for c in checks}) == 1  # the same on every rank
        assert named in " ".join(checks[0].problems), checks[0].problems
        for node in (0, 1):
            assert (_step(tmp_path, node, step) / "metadata.json").exists()
            assert not (_step(tmp_path, node, step) / "certified.json").exists()


def test_a_passing_save_is_certified_on_every_node_with_the_same_bytes(tmp_path: Path) -> None:
    pattern = os.path.join(tmp_path, "node{node}")
    checks = _save_all(pattern, 1, _replicated, CERTIFY)
    assert all(c is not None and c.passed for c in checks), checks
    raw = [(_step(tmp_path, n, 1) / "certified.json").read_bytes() for n in (0, 1)]
    assert raw[0] == raw[1]
    for node in (0, 1):
        record, why = certificate_status(LocalStorage(_step(tmp_path, node, 1)))
        assert record is not None, why
        assert set(record.checks) >= {"finite", "replicas"}
    # A drain's copy is file for file the local one, certified too.
    group = ThreadGroup(4, timeout=30)
    durable = tmp_path / "durable" / "step_000000001"
    on_threads(4, lambda r: _tiers(pattern, group, r).drain(1, str(durable)), group=group)
    assert (durable / "certified.json").read_bytes() == raw[0]
    assert certificate_status(LocalStorage(durable))[0] is not None


# ---- 2. retention ----------------------------------------------------------------------------------------------


def test_retention_leaves_a_linked_step_directory_and_its_target_alone(tmp_path: Path) -> None:
    pattern = os.path.join(tmp_path, "node{node}")
    _save_all(pattern, 1, _state, keep_last=1)
    user = tmp_path / "user_results"
    (user / "data").mkdir(parents=True)
    (user / "data" / "experiment.csv").write_text("precious")
    (user / "README").write_text("precious")
    os.symlink(user, tmp_path / "node1" / "step_000000002")
    _save_all(pattern, 3, _state, keep_last=1)
    assert (user / "data" / "experiment.csv").read_text() == "precious"
    assert (user / "README").read_text() == "precious"
    assert os.path.islink(tmp_path / "node1" / "step_000000002")
    assert not _step(tmp_path, 1, 1).exists()  # the real old step went


def test_retention_keeps_files_no_save_wrote_in_an_old_step_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pattern = os.path.join(tmp_path, "node{node}")
    _save_all(pattern, 1, _state, keep_last=1)
    old = _step(tmp_path, 1, 1)
    (old / "data" / "notes.bin").write_text("mine")
    (old / "NOTES.txt").write_text("mine")
    (old / "data" / "sub").mkdir()
    (old / "data" / "sub" / "deep.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="reshard"):
        _save_all(pattern, 2, _state, keep_last=1)
    assert (old / "data" / "notes.bin").read_text() == "mine"
    assert (old / "NOTES.txt").read_text() == "mine"
    assert (old / "data" / "sub" / "deep.txt").read_text() == "mine"
    assert not (old / "metadata.json").exists()
    assert not [p for p in (old / "data").iterdir() if p.name.endswith(".bin") and p.name != "notes.bin"]
    assert "notes.bin" in caplog.text


def test_retention_of_an_incomplete_step_deletes_only_files_a_save_ties_to_it(tmp_path: Path) -> None:
    pattern = os.path.join(tmp_path, "node{node}")
    old = _step(tmp_path, 1, 1)
    (old / "data").mkdir(parents=True)
    (old / "data" / f"{'ab' * 16}-r00002.bin").write_text("looks like a data file, nothing ties it")
    _save_all(pattern, 2, _state, keep_last=1)
    assert (old / "data" / f"{'ab' * 16}-r00002.bin").exists()


# ---- 3. a damaged fetched copy -----------------------------------------------------------------------------------


def _restore_all(pattern: str, step: int) -> list[bool]:
    group = ThreadGroup(4, timeout=30)

    def run(rank: int) -> bool:
        template = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 1), (1, rank, 4))}
        _tiers(pattern, group, rank).restore(step, template)
        return torch.equal(template["w"].data, torch.arange(32, dtype=torch.float32).reshape(8, 4)[:, rank : rank + 1])

    return on_threads(4, run, group=group)


def test_a_damaged_fetched_copy_is_fetched_again_from_the_node_that_holds_it_whole(tmp_path: Path) -> None:
    pattern = os.path.join(tmp_path, "node{node}")
    _save_all(pattern, 5, _state)
    assert _restore_all(pattern, 5) == [True] * 4  # node 0 fetched node 1's files
    fetched = next((_step(tmp_path, 0, 5) / "data").glob("*-r00002.bin"))
    good = fetched.read_bytes()
    damaged = bytearray(good)
    damaged[-1] ^= 1
    fetched.write_bytes(bytes(damaged))
    assert _restore_all(pattern, 5) == [True] * 4
    assert fetched.read_bytes() == good  # replaced by a verified copy


# ---- 4. node_size differing per rank -----------------------------------------------------------------------------


@pytest.mark.parametrize("call", ["save", "restorable", "restore", "drain"])
def test_ranks_passing_different_node_size_fail_every_rank_naming_it(tmp_path: Path, call: str) -> None:
    pattern = os.path.join(tmp_path, "node{node}")
    if call != "save":
        _save_all(pattern, 5, _state)
    group = ThreadGroup(4, timeout=30)
    errors: list[tuple[type[BaseException], str]] = []

    def run(rank: int) -> None:
        tiers = reshard.NodeLocalCheckpoints(pattern, node_size=2 if rank < 2 else 1, group=group.member(rank))
        template = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 1), (1, rank, 4))}
        try:
            if call == "save":
                tiers.save(6, _state(rank))
            elif call == "restorable":
                tiers.restorable()
            elif call == "restore":
                tiers.restore(5, template)
            else:
                tiers.drain(5, str(tmp_path / "durable"))
        except reshard.CheckpointError as exc:
            errors.append((type(exc), str(exc)))

    on_threads(4, run)
    assert [cls for cls, _ in errors] == [reshard.CheckpointError] * 4, errors
    assert all("node_size" in text for _, text in errors), errors
    assert not (tmp_path / "node0" / "step_000000006").exists()
    assert not (tmp_path / "durable").exists()
