"""Certified recovery points (:mod:`reshard.flows.certify`): a save's checks on real ranks as threads of this process
(ThreadGroup: the real save protocol; real files), the certificate and its validation."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import reshard
from reshard.flows.certify import CERTIFICATE_FILE, certificate_status, certified, read_certificate
from reshard.net.transports import ThreadGroup
from reshard.storage import storage_for
from tests.threads import on_threads

pytestmark = pytest.mark.unit

CERTIFY = reshard.SaveOptions(certify=reshard.CertifyOptions())


def dp_state(rank: int, *, flip: bool = False, nan: bool = False) -> dict[str, Any]:
    """DP=2: a weight split 2 ways by rows on every rank (its own half), a bias replicated as a plain tensor, and
    an embedding both ranks hold whole as replicas (replica_id = rank)."""
    weight = torch.arange(16, dtype=torch.float32).reshape(4, 4)[rank * 2 : rank * 2 + 2].clone()
    if nan:
        weight[0, 1] = float("nan")
    emb = torch.linspace(0, 1, 64, dtype=torch.float32).reshape(8, 8).clone()
    if flip:
        emb.view(torch.int32)[3, 5] ^= 1 << 7  # one flipped bit in this replica
    return {
        "w": reshard.ShardedTensor.from_rank_offsets("w", weight, (0, rank, 2)),
        "emb": reshard.ShardedTensor("emb", emb, (8, 8), (0, 0), replica_id=rank),
        "bias": torch.ones(3),
        "step": 7,
    }


def save_on_threads(path: Path, states: list[Any], options: reshard.SaveOptions = CERTIFY) -> list[Any]:
    group = ThreadGroup(len(states), timeout=20)
    return on_threads(
        len(states), lambda r: reshard.save(states[r], path, group=group.member(r), options=options), group=group
    )


def test_a_sound_save_is_certified(tmp_path: Path) -> None:
    results = save_on_threads(tmp_path / "c", [dp_state(0), dp_state(1)])
    assert [r.checks for r in results] == [reshard.Checks(passed=True, checked=("finite", "replicas"))] * 2
    assert certified(tmp_path / "c")
    record = read_certificate(tmp_path / "c")
    assert record is not None and record.checks == ("finite", "replicas")


def test_a_flipped_bit_in_one_replica_names_the_key_and_both_ranks(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = save_on_threads(tmp_path / "c", [dp_state(0), dp_state(1, flip=True)])
    checks = results[0].checks
    assert checks == results[1].checks and not checks.passed
    (problem,) = checks.problems
    assert "'emb'" in problem and "(0,0)+(8,8)" in problem
    writer = 0 if "rank 1 (first" in problem else 1
    assert f"rank {1 - writer} (first in bytes [0, 256))" in problem and f"vs rank {writer} (the copy saved)" in problem
    assert not certified(tmp_path / "c") and not (tmp_path / "c" / CERTIFICATE_FILE).exists()
    assert any("not certified" in str(w.message) and "'emb'" in str(w.message) for w in caught)
    # The save itself is whole: it loads.
    loaded = reshard.load({"w": torch.empty(4, 4)}, tmp_path / "c")
    assert torch.equal(loaded["w"], torch.arange(16, dtype=torch.float32).reshape(4, 4))


def test_a_nan_is_named_and_allow_nonfinite_exempts_it(tmp_path: Path) -> None:
    results = save_on_threads(tmp_path / "c", [dp_state(0), dp_state(1, nan=True)])
    (problem,) = results[0].checks.problems
    assert problem == "'w' box (2,0)+(2,4) holds 1 NaN or infinite value(s) (saved from rank 1)"
    exempt = reshard.SaveOptions(certify=reshard.CertifyOptions(allow_nonfinite=("w*",)))
    results = save_on_threads(tmp_path / "d", [dp_state(0), dp_state(1, nan=True)], exempt)
    assert results[0].checks.passed and certified(tmp_path / "d")


def test_without_certify_no_checks_and_no_certificate(tmp_path: Path) -> None:
    results = save_on_threads(tmp_path / "c", [dp_state(0), dp_state(1, flip=True)], reshard.SaveOptions())
    assert results[0].checks is None and not certified(tmp_path / "c")


def test_ranks_with_other_certify_options_are_refused(tmp_path: Path) -> None:
    group = ThreadGroup(2, timeout=20)
    options = [CERTIFY, reshard.SaveOptions()]
    with pytest.raises(reshard.CheckpointError, match="different certify"):
        on_threads(
            2,
            lambda r: reshard.save(dp_state(r), tmp_path / "c", group=group.member(r), options=options[r]),
            group=group,
        )
    assert not (tmp_path / "c" / "metadata.json").exists()


def test_a_certificate_copied_from_another_step_is_not_accepted(tmp_path: Path) -> None:
    save_on_threads(tmp_path / "a", [dp_state(0), dp_state(1)])
    save_on_threads(tmp_path / "b", [dp_state(0), dp_state(1, flip=True)])
    shutil.copy(tmp_path / "a" / CERTIFICATE_FILE, tmp_path / "b" / CERTIFICATE_FILE)
    record, why = certificate_status(storage_for(tmp_path / "b"))
    assert record is None and "another save" in why
    assert certified(tmp_path / "a")


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b"[]", b"\xff\xfe", b"{" * 100000, b"x" * (1 << 20), b'{"format": 1}', None],
    ids=["empty", "truncated", "list", "binary", "deep", "huge", "fields", "hash"],
)
def test_a_damaged_certificate_is_not_certified_with_a_reason(tmp_path: Path, content: bytes | None) -> None:
    save_on_threads(tmp_path / "c", [dp_state(0), dp_state(1)])
    path = tmp_path / "c" / CERTIFICATE_FILE
    if content is None:
        doc = json.loads(path.read_bytes())
        doc["metadata_sha256"] = "0" * 64
        content = json.dumps(doc).encode()
    path.write_bytes(content)
    record, why = certificate_status(storage_for(tmp_path / "c"))
    assert record is None and CERTIFICATE_FILE in why
    assert not certified(tmp_path / "c")


def manager_run(root: Path, run: Any, **kwargs: Any) -> list[Any]:
    """``run(manager, rank)`` on 2 ranks as threads, each with its manager of ``root``."""
    group = ThreadGroup(2, timeout=20)

    def rank(r: int) -> Any:
        manager = reshard.CheckpointManager(root, group=group.member(r), **kwargs)
        try:
            return run(manager, r)
        finally:
            manager.close()

    return on_threads(2, rank, group=group)


def test_load_latest_prefers_the_older_certified_step_with_a_warning(tmp_path: Path) -> None:
    def run(manager: reshard.CheckpointManager, r: int) -> Any:
        manager.save(1, dp_state(r))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            saved = manager.save(2, dp_state(r, flip=r == 1))
        skipped: list[tuple[int, str]] = []
        template = {"w": reshard.ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, r, 2))}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = manager.load_latest(template, skipped=skipped)
        return (
            saved.checks,
            step,
            skipped,
            [str(w.message) for w in caught],
            [s.certified for s in manager_infos(manager)],
        )

    for checks, step, skipped, _messages, flags in manager_run(tmp_path, run, certify=reshard.CertifyOptions()):
        assert not checks.passed and "'emb'" in checks.problems[0]
        assert step == 1 and flags == [True, False]
        assert skipped[0][0] == 2 and "not certified" in skipped[0][1] and "'emb'" in skipped[0][1]


def manager_infos(manager: reshard.CheckpointManager) -> list[Any]:
    from reshard.flows.steps import scan_root

    return scan_root(manager.root)


def test_a_hook_veto_or_raise_keeps_the_step_uncertified_and_certify_promotes_it_later(tmp_path: Path) -> None:
    def run(manager: reshard.CheckpointManager, r: int) -> Any:
        vetoed = manager.save(1, dp_state(r)).checks
        raised = manager.save(2, dp_state(r)).checks
        flags = [s.certified for s in manager_infos(manager)]
        later = manager.certify(1)
        return vetoed, raised, flags, later, [s.certified for s in manager_infos(manager)]

    import threading

    local = threading.local()

    def hook_by_rank(step: int, checks: reshard.Checks) -> bool:
        if step == 2 and local.rank == 1:
            raise ValueError("loss spiked")
        return step != 1

    def run_with_rank(manager: reshard.CheckpointManager, r: int) -> Any:
        local.rank = r
        return run(manager, r)

    results = manager_run(tmp_path, run_with_rank, certify=reshard.CertifyOptions(), certify_hook=hook_by_rank)
    for vetoed, raised, flags, later, after in results:
        assert not vetoed.passed and vetoed.problems == (
            "certify_hook vetoed on rank 0",
            "certify_hook vetoed on rank 1",
        )
        assert vetoed.checked == ("finite", "replicas", "hook")
        assert raised.problems == ("certify_hook raised on rank 1: ValueError: loss spiked",)
        assert flags == [False, False] and later.passed and after == [True, False]


def test_certify_refuses_a_step_whose_checks_failed(tmp_path: Path) -> None:
    def run(manager: reshard.CheckpointManager, r: int) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.save(1, dp_state(r, nan=r == 1))
        with pytest.raises(reshard.CheckpointError, match=r"cannot be certified.*NaN"):
            manager.certify(1)
        with pytest.raises(
            reshard.CheckpointError, match=r"step 5 cannot be certified: its checks are unknown \(not checked\)"
        ):
            manager.certify(5)
        return True

    assert manager_run(tmp_path, run, certify=reshard.CertifyOptions()) == [True, True]


def test_retention_deletes_certified_json_with_its_step_and_keeps_the_newest_certified(tmp_path: Path) -> None:
    def run(manager: reshard.CheckpointManager, r: int) -> Any:
        for step in (1, 2):
            manager.save(step, dp_state(r))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            manager.save(3, dp_state(r, flip=r == 1))  # not certified: step 2 stays as the recovery point
            manager.save(4, dp_state(r, flip=r == 1))
        return manager.steps()

    assert manager_run(tmp_path, run, certify=reshard.CertifyOptions(), keep_last=1) == [[2, 4], [2, 4]]
    assert not (tmp_path / "step_000000001").exists()
    assert (tmp_path / "step_000000002" / CERTIFICATE_FILE).exists()
    assert not (tmp_path / "step_000000003").exists()


def test_a_manager_with_other_certify_options_per_rank_is_refused(tmp_path: Path) -> None:
    options = [reshard.CertifyOptions(), None]
    group = ThreadGroup(2, timeout=20)

    def rank(r: int) -> Any:
        manager = reshard.CheckpointManager(tmp_path, group=group.member(r), certify=options[r])
        with pytest.raises(reshard.CheckpointError, match="certify"):
            manager.save(1, dp_state(r))
        return True

    assert on_threads(2, rank, group=group) == [True, True]


def test_async_and_incremental_saves_certify(tmp_path: Path) -> None:
    group = ThreadGroup(2, timeout=20)

    def rank(r: int) -> Any:
        member = group.member(r)
        handle = reshard.async_save(dp_state(r, flip=r == 1), tmp_path / "a", group=member, options=CERTIFY)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            flipped = handle.wait()
        base_opts = reshard.SaveOptions(certify=reshard.CertifyOptions(), content_hash=True)
        reshard.save(dp_state(r), tmp_path / "b", group=member, options=base_opts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            incremental = reshard.save(
                dp_state(r, flip=r == 1), tmp_path / "c", group=member, options=CERTIFY, base=tmp_path / "b"
            )
        return flipped.checks, incremental

    for flipped, incremental in on_threads(2, rank, group=group):
        assert not flipped.passed and "'emb'" in flipped.problems[0]
        # 'emb' is referenced from the base, its saved copy the base's: the flipped replica is still compared.
        assert incremental.referenced_bytes > 0
        assert not incremental.checks.passed and "'emb'" in incremental.checks.problems[0]
    assert certified(tmp_path / "b") and not certified(tmp_path / "a") and not certified(tmp_path / "c")
