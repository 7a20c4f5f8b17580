"""Node-local checkpoints on ranks that are threads (reshard.net.transports.ThreadGroup): the save's agreement on a
node-local location, a step refused when complete on some node, and ranks that disagree on the directory."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

import reshard
from reshard.net.transports import ThreadGroup
from tests.threads import on_threads

pytestmark = pytest.mark.unit


def _state(rank: int) -> dict[str, object]:
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    return {"w": reshard.ShardedTensor.from_rank_offsets("w", full[rank * 2 : rank * 2 + 2].clone(), (0, rank, 4))}


def test_ranks_of_simulated_nodes_agree_on_the_pattern_and_every_node_gets_the_metadata(tmp_path: Path) -> None:
    group = ThreadGroup(4, timeout=30)
    pattern = os.path.join(tmp_path, "node{node}")

    def run(rank: int) -> list[int]:
        tiers = reshard.NodeLocalCheckpoints(pattern, node_size=2, group=group.member(rank))
        tiers.save(5, _state(rank))
        template = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(8, 1), (1, rank, 4))}
        tiers.restore(5, template)
        assert torch.equal(template["w"].data, torch.arange(32, dtype=torch.float32).reshape(8, 4)[:, rank : rank + 1])
        return tiers.restorable()

    assert on_threads(4, run, group=group) == [[5]] * 4
    docs = [(tmp_path / f"node{n}" / "step_000000005" / "metadata.json").read_bytes() for n in (0, 1)]
    assert docs[0] == docs[1]


def test_a_step_complete_on_another_node_is_refused_on_every_rank(tmp_path: Path) -> None:
    pattern = os.path.join(tmp_path, "node{node}")
    group = ThreadGroup(4, timeout=30)
    on_threads(
        4,
        lambda r: reshard.NodeLocalCheckpoints(pattern, node_size=2, group=group.member(r)).save(5, _state(r)),
        group=group,
    )
    (tmp_path / "node0" / "step_000000005" / "metadata.json").unlink()
    group = ThreadGroup(4, timeout=30)
    errors: list[str] = []

    def run(rank: int) -> None:
        try:
            reshard.NodeLocalCheckpoints(pattern, node_size=2, group=group.member(rank)).save(5, _state(rank))
        except reshard.CheckpointExistsError as exc:
            errors.append(str(exc))

    on_threads(4, run)
    assert len(errors) == 4 and "nodes [1]" in errors[0], errors


def test_ranks_passing_other_directories_fail_every_rank_and_write_nothing(tmp_path: Path) -> None:
    group = ThreadGroup(2, timeout=30)
    errors: list[tuple[type[BaseException], str]] = []

    def run(rank: int) -> None:
        tiers = reshard.NodeLocalCheckpoints(tmp_path / f"dir{rank}" / "{node}", node_size=1, group=group.member(rank))
        try:
            tiers.save(5, {"x": torch.ones(2)})
        except reshard.CheckpointError as exc:
            errors.append((type(exc), str(exc)))

    on_threads(2, run)
    assert [cls for cls, _ in errors] == [reshard.CheckpointError] * 2
    assert all("different checkpoint paths" in text for _, text in errors), errors
    assert not list(tmp_path.rglob("metadata.json"))


def test_a_certified_node_local_save_runs_its_checks(tmp_path: Path) -> None:
    """SaveOptions(certify=...) on a node-local save judges the ranks' facts (it certified every save unchecked: the
    facts were never computed): a replica with one flipped bit is named, and no certified.json is written."""
    pattern = os.path.join(tmp_path, "node{node}")
    group = ThreadGroup(4, timeout=30)
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)

    def run(rank: int) -> reshard.Checks | None:
        rows = full[(rank % 2) * 4 : (rank % 2) * 4 + 4].clone()
        if rank == 3:
            rows.view(torch.int32)[0, 0] ^= 1
        state = {"w": reshard.ShardedTensor.from_rank_offsets("w", rows, (0, rank % 2, 2), replica_id=rank // 2)}
        tiers = reshard.NodeLocalCheckpoints(pattern, node_size=2, group=group.member(rank))
        options = reshard.SaveOptions(certify=reshard.CertifyOptions())
        return tiers.save(5, state, options=options).checks

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checks = on_threads(4, run, group=group)
    assert all(c is not None and not c.passed for c in checks), checks
    assert any("differ" in p and "rank 3" in p for p in checks[0].problems), checks[0]
    assert not (tmp_path / "node0" / "step_000000005" / "certified.json").exists()
