"""Certified recovery points: the checks a save runs on the state it saves, and the record of a certified step.

A checkpoint written correctly can still hold bad state: a NaN from silent data corruption, or data-parallel
replicas that diverged (one GPU flipped a bit). With ``SaveOptions(certify=CertifyOptions())`` a save checks, in its
own pass (:func:`save_facts`, on every rank between its write and the commit):

- ``finite``: every floating box a rank saves holds no NaN or infinity (keys matching ``allow_nonfinite`` exempt);
- ``replicas``: every rank that holds a box it does not write (a replica; the writer may be any holder) computes the
  CRC-32C of each checksum chunk of its copy, the same checksums the writer computed as it wrote, and the coordinator
  compares them with the checksums the metadata records, naming the differing ranks, the key, the box and the first
  differing byte range (a box an incremental save references is compared with its base's checksums).

The facts travel with the commit's write reports (no extra collective); the coordinator judges them after the
commit (:func:`reshard.planning.certify.judge`) and every rank gets the same :class:`Checks` in
``SaveResult.checks``. A failed check never fails the save (the bytes are what the job had), it is a warning on the
coordinator; when every check passed, the coordinator writes :data:`CERTIFICATE_FILE`, tied to the save by the
SHA-256 of its ``metadata.json`` (a re-save of the step, or a certificate copied from another step, does not
match). ShardedObjects are per-rank values, not replicas: they are not checked.
"""

from __future__ import annotations

import json
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reshard.errors import CheckpointError, StorageError
from reshard.io.checksums import ChunkedChecksum
from reshard.io.device import HostSlabs
from reshard.io.references import is_retired
from reshard.io.retirement import CERTIFICATE_FILE, CHECKS_FILE
from reshard.io.sources import read_metadata_bytes
from reshard.metadata import Metadata, document_digest
from reshard.net.comm import Communicator
from reshard.planning.certify import CertifyOptions, Checks, SavedCopy, judge
from reshard.storage import CheckpointLocation, Storage, storage_for

__all__ = [
    "CERTIFICATE_FILE",
    "CHECKS_FILE",
    "Certificate",
    "CertifyHook",
    "CertifyOptions",
    "Checks",
    "certificate_status",
    "certification_status",
    "certified",
    "certify_later",
    "checks_status",
    "decide_certification",
    "judge",
    "judge_save",
    "local_facts",
    "nonfinite_count",
    "options_term",
    "prefer_certified",
    "read_certificate",
    "recorded_checks",
    "save_facts",
    "write_certificate",
    "write_checks",
]

logger = logging.getLogger("reshard")

CertifyHook = Callable[[int, Checks], bool]
"""``certify_hook(step, checks) -> bool``: user code run on every rank after a save whose checks passed."""

CERTIFICATE_FORMAT = 1
MAX_CERTIFICATE_BYTES = 64 * 1024
"""A larger certified.json is not read (hostile or broken): the step is not certified."""
MAX_CHECKS_BYTES = 256 * 1024
"""A larger checks.json is not read (hostile or broken): the step's checks are unknown."""
_MAX_PROBLEM_CHARS = 1000
"""Each problem kept in checks.json is cut to this many characters (the record stays under its limit)."""

_FACT_ELEMENTS = 1 << 24
"""Elements checked for finiteness at a time (bounds the temporary memory of the check)."""
_UPCAST = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu})
"""Floating types whose NaN/inf encodings are found by converting to float32 (torch's isfinite does not take them)."""
_UNCHECKED = frozenset({torch.float4_e2m1fn_x2})
"""Packed FP4: no NaN or infinity encodings."""


# ---- the checks, one rank's part -----------------------------------------------------------------------------


def nonfinite_count(tensor: torch.Tensor) -> int:
    """How many elements of ``tensor`` are NaN or infinite (0 for integer, bool and packed FP4 tensors); on the
    tensor's device, :data:`_FACT_ELEMENTS` at a time."""
    dtype = tensor.dtype
    if (not dtype.is_floating_point and not dtype.is_complex) or dtype in _UNCHECKED or tensor.numel() == 0:
        return 0
    flat = tensor.detach().reshape(-1)
    count = 0
    for start in range(0, flat.numel(), _FACT_ELEMENTS):
        part = flat[start : start + _FACT_ELEMENTS]
        if dtype in _UPCAST:
            part = part.to(torch.float32)
        # A sum is finite when every element is (one vectorized pass, no mask: about 40x faster than counting);
        # a NaN or infinity, or finite values whose sum overflows, are counted exactly.
        accumulate = torch.float64 if part.dtype == torch.float64 else None
        total = part.sum(dtype=accumulate) if part.is_complex() else part.sum(dtype=accumulate or torch.float32)
        if not bool(torch.isfinite(total).all()):
            count += int((~torch.isfinite(part)).sum().item())
    return count


def chunk_checksums(tensor: torch.Tensor, chunk_bytes: int, slabs: HostSlabs | None = None) -> tuple[int, ...]:
    """The CRC-32C of each ``chunk_bytes`` piece of ``tensor``'s bytes in C order: what a writer of it records."""
    checksum = ChunkedChecksum(chunk_bytes)
    for _, view in (slabs if slabs is not None else HostSlabs(16 * 1024 * 1024)).slabs([tensor]):
        checksum.update(view)
    return checksum.finish()


def _facts(
    items: Iterable[tuple[str, Sequence[int], Sequence[int], torch.Tensor, bool, bool]],
    options: CertifyOptions,
    chunk_bytes: int,
    slabs: HostSlabs | None,
) -> dict[str, Any]:
    """Facts of ``(key, offset, shape, view, saved, primary)`` items: the non-finite counts of the saved ones
    (``finite``), the checksums of the others and, with ``primary``, of the copy every other is compared with."""
    nonfinite: list[list[Any]] = []
    copies: list[list[Any]] = []
    for key, offset, shape, view, saved, primary in items:
        if saved and options.finite and not options.exempt(key):
            count = nonfinite_count(view)
            if count:
                nonfinite.append([key, list(offset), list(shape), count])
        if options.replicas and (not saved or primary):
            sums = list(chunk_checksums(view, chunk_bytes, slabs))
            copies.append([key, list(offset), list(shape), sums, primary, int(view.nbytes)])
    return {"nonfinite": nonfinite, "copies": copies}


def save_facts(
    pieces: Sequence[Any],
    views: Sequence[torch.Tensor],
    written: Iterable[int],
    options: CertifyOptions,
    *,
    chunk_bytes: int,
    slabs: HostSlabs | None = None,
) -> dict[str, Any]:
    """One rank's facts in a save (local, no collective): ``pieces[i]`` (a
    :class:`~reshard.planning.descriptions.TensorPiece`) is held in ``views[i]``, ``written`` the indices this rank
    saves (written or referenced). Never raises: a failure is a fact (``error``), judged as a problem."""
    try:
        mine = set(written)
        items = ((p.key, p.box.offset, p.box.shape, views[i], i in mine, False) for i, p in enumerate(pieces))
        return _facts(items, options, chunk_bytes, slabs)
    except Exception as exc:  # a check that cannot run is a problem, never a failed save
        return {"error": f"{type(exc).__name__}: {exc}"}


def local_facts(flat: Any, options: CertifyOptions, *, chunk_bytes: int = 4 * 1024 * 1024) -> dict[str, Any]:
    """One rank's facts over a flattened state dict (:func:`reshard.state.statedict.flatten_state_dict`), for a
    tier without storage (the peer-memory tier): its primary boxes are the copies saved, checked for finiteness
    and checksummed; its replicas are checksummed. JSON-able; :func:`judge` (coordinator) compares them."""
    try:
        items = (
            (t.key, p.box.offset, p.box.shape, p.view, t.is_main_replica, t.is_main_replica)
            for t in flat.tensors
            for p in t.pieces()
        )
        return _facts(items, options, chunk_bytes, None)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


# ---- the judgment (coordinator) ------------------------------------------------------------------------------


def _writer_rank(path: str) -> int | None:
    """The rank whose data file ``path`` is (``data/<save id>-r<rank>.bin``)."""
    stem = path.rsplit("-r", 1)[-1].split(".", 1)[0]
    return int(stem) if stem.isdigit() else None


def judge_save(facts: Sequence[Mapping[str, Any]], options: CertifyOptions, metadata: Metadata) -> Checks:
    """On the coordinator of a save, after its commit: the checks of every rank's :func:`save_facts`, every
    replica compared with the checksums ``metadata`` records for its box. Never raises."""
    errors = [f"rank {r} could not run its checks: {f['error']}" for r, f in enumerate(facts) if "error" in f]
    wanted = {(str(c[0]), tuple(int(o) for o in c[1])) for f in facts for c in f.get("copies", ())}
    saved: dict[tuple[str, tuple[int, ...]], SavedCopy] = {}
    try:
        for key in {k for k, _ in wanted}:
            tensor = metadata.tensors.get(key)
            for box in tensor.boxes if tensor is not None else ():
                if (key, tuple(box.offset)) in wanted:
                    entry = metadata.files[box.file]
                    rank = None if entry.checkpoint is not None else _writer_rank(entry.path)
                    saved[(key, tuple(box.offset))] = SavedCopy(rank, tuple(int(c) for c in box.checksums))
        checks = judge(facts, options, chunk_bytes=metadata.checksum_chunk_bytes, saved=saved)
    except Exception as exc:  # after the commit nothing may fail the save: a check that cannot be judged fails
        return Checks(passed=False, problems=(f"the checks could not be judged: {exc}",), checked=options.checked)
    if errors:
        return Checks(passed=False, problems=(*errors, *checks.problems), checked=checks.checked)
    return checks


# ---- the record ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Certificate:
    """A valid ``certified.json``: the SHA-256 of the ``metadata.json`` it certifies, the checks that passed, and
    when (seconds since the epoch)."""

    metadata_sha256: str
    checks: tuple[str, ...]
    certified_at: float

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": CERTIFICATE_FORMAT,
                "metadata_sha256": self.metadata_sha256,
                "checks": list(self.checks),
                "certified_at": self.certified_at,
            },
            sort_keys=True,
        ).encode()


def _metadata_sha256(storage: Storage) -> str:
    return document_digest(read_metadata_bytes(storage))


def write_certificate(storage: Storage, checks: Checks, *, metadata_sha256: str | None = None) -> Certificate:
    """Certify the checkpoint at ``storage`` (coordinator only, after its commit): write :data:`CERTIFICATE_FILE`
    atomically, tied to its ``metadata.json`` (read here unless its SHA-256 is given).

    Raises:
        CheckpointError: ``checks`` did not pass, or the checkpoint has no valid ``metadata.json``.
        StorageError: the record could not be written.
    """
    if not checks.passed:
        raise CheckpointError(f"{storage.describe()} failed its checks, it cannot be certified: {checks.problems}")
    digest = metadata_sha256 if metadata_sha256 is not None else _metadata_sha256(storage)
    record = Certificate(metadata_sha256=digest, checks=checks.checked, certified_at=time.time())
    try:
        storage.commit(CERTIFICATE_FILE, record.to_bytes(), replace=True)
    except OSError as exc:
        raise StorageError(f"writing {storage.describe(CERTIFICATE_FILE)} failed: {exc}") from exc
    return record


def _is_time(value: Any) -> bool:
    """Whether ``value`` (parsed JSON) is a time in seconds: a finite number (an integer too large for a float is
    not, nor is a bool)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _parse(raw: bytes) -> Certificate:
    doc = json.loads(raw)
    if not isinstance(doc, dict) or set(doc) != {"format", "metadata_sha256", "checks", "certified_at"}:
        raise ValueError("not a certificate document")
    digest, checks, at = doc["metadata_sha256"], doc["checks"], doc["certified_at"]
    if doc["format"] != CERTIFICATE_FORMAT:
        raise ValueError(f"unknown format {doc['format']!r}")
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError("metadata_sha256 is not a SHA-256")
    if not isinstance(checks, list) or not all(isinstance(c, str) for c in checks):
        raise ValueError("checks is not a list of names")
    if not _is_time(at):
        raise ValueError("certified_at is not a time")
    return Certificate(metadata_sha256=digest, checks=tuple(checks), certified_at=float(at))


def certificate_status(storage: Storage) -> tuple[Certificate | None, str]:
    """The checkpoint's valid certificate and ``""``, or None and why it is not certified. Not collective; never
    raises (an unreadable, oversized, malformed or foreign record is a reason, not an error)."""
    try:
        raw = storage.read_bytes(CERTIFICATE_FILE, max_bytes=MAX_CERTIFICATE_BYTES)
    except FileNotFoundError:
        return None, "not certified"
    except OSError as exc:
        return None, f"{CERTIFICATE_FILE} cannot be read: {exc}"
    try:
        record = _parse(raw)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        return None, f"{CERTIFICATE_FILE} is not a certificate reshard wrote ({exc})"
    try:
        digest = _metadata_sha256(storage)
    except (OSError, CheckpointError) as exc:
        return None, f"its {CERTIFICATE_FILE} certifies nothing: {exc}"
    if digest != record.metadata_sha256:
        return None, f"its {CERTIFICATE_FILE} certifies another save (of another metadata.json)"
    return record, ""


def write_checks(storage: Storage, checks: Checks, *, metadata_sha256: str | None = None) -> None:
    """Record what the save's checks found (:data:`CHECKS_FILE`, coordinator only, after its commit, passed or not),
    tied to its ``metadata.json`` as the certificate is, so that a later process (a restarted job's
    :meth:`~reshard.CheckpointManager.certify`, ``reshard ls``) knows them.

    Raises:
        CheckpointError: the checkpoint has no valid ``metadata.json``.
        StorageError: the record could not be written.
    """
    digest = metadata_sha256 if metadata_sha256 is not None else _metadata_sha256(storage)
    doc = {
        "format": CERTIFICATE_FORMAT,
        "metadata_sha256": digest,
        **Checks(
            passed=checks.passed,
            problems=tuple(p[:_MAX_PROBLEM_CHARS] for p in checks.problems),
            checked=checks.checked,
        ).to_json(),
        "checked_at": time.time(),
    }
    try:
        storage.commit(CHECKS_FILE, json.dumps(doc, sort_keys=True).encode(), replace=True)
    except OSError as exc:
        raise StorageError(f"writing {storage.describe(CHECKS_FILE)} failed: {exc}") from exc


def _parse_checks(raw: bytes) -> tuple[str, Checks]:
    doc = json.loads(raw)
    fields = {"format", "metadata_sha256", "passed", "problems", "checked", "checked_at"}
    if not isinstance(doc, dict) or set(doc) != fields:
        raise ValueError("not a record of checks")
    if doc["format"] != CERTIFICATE_FORMAT:
        raise ValueError(f"unknown format {doc['format']!r}")
    digest = doc["metadata_sha256"]
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError("metadata_sha256 is not a SHA-256")
    if not isinstance(doc["problems"], list) or not isinstance(doc["checked"], list):
        raise TypeError("problems and checked are not lists")
    if not _is_time(doc["checked_at"]):
        raise ValueError("checked_at is not a time")
    try:
        return digest, Checks.from_json(doc)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None


def checks_status(storage: Storage) -> tuple[Checks | None, str]:
    """The checks the save of the checkpoint at ``storage`` recorded (:func:`write_checks`) and ``""``, or None and
    why they are unknown (``"not checked"``: no record). Not collective; never raises."""
    checks, why, _digest = recorded_checks(storage)
    return checks, why


def recorded_checks(storage: Storage) -> tuple[Checks | None, str, str]:
    """:func:`checks_status` with the SHA-256 of the ``metadata.json`` the checks belong to (``""`` when unknown):
    a certificate written from them is tied to that save, so a step saved again meanwhile is not certified by them.
    Not collective; never raises."""
    try:
        raw = storage.read_bytes(CHECKS_FILE, max_bytes=MAX_CHECKS_BYTES)
    except FileNotFoundError:
        return None, "not checked", ""
    except OSError as exc:
        return None, f"{CHECKS_FILE} cannot be read: {exc}", ""
    try:
        digest, checks = _parse_checks(raw)
    except (ValueError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        return None, f"{CHECKS_FILE} is not a record reshard wrote ({exc})", ""
    try:
        mine = _metadata_sha256(storage)
    except (OSError, CheckpointError) as exc:
        return None, f"its {CHECKS_FILE} records nothing: {exc}", ""
    if digest != mine:
        return None, f"its {CHECKS_FILE} records the checks of another save (of another metadata.json)", ""
    return checks, "", digest


def certification_status(storage: Storage) -> tuple[bool, str]:
    """Whether the checkpoint at ``storage`` is certified, and why not: its certificate's problem, else what its
    save's checks recorded (``"not checked"``, ``"its checks failed: ..."``, ``"not certified yet (its checks
    passed)"``); a retired checkpoint (deleted by retention, kept for the files newer ones reference) is no
    recovery point. Not collective; never raises."""
    try:
        if is_retired(storage):
            return False, "it is retired (deleted by retention; only files newer checkpoints reference are kept)"
    except OSError as exc:
        return False, f"it cannot be read: {exc}"
    record, why = certificate_status(storage)
    if record is not None:
        return True, ""
    if why != "not certified":
        return False, why
    checks, unknown = checks_status(storage)
    if checks is None:
        return False, unknown
    if checks.passed:
        return False, "not certified yet (its checks passed)"
    return False, f"its checks failed: {'; '.join(checks.problems)}"


def read_certificate(path: CheckpointLocation, storage_options: dict[str, Any] | None = None) -> Certificate | None:
    """The valid certificate of the checkpoint at ``path``, or None (see :func:`certificate_status`)."""
    storage = storage_for(path, storage_options)
    try:
        return certificate_status(storage)[0]
    finally:
        if storage is not path:
            storage.close()


def certified(path: CheckpointLocation, storage_options: dict[str, Any] | None = None) -> bool:
    """Whether the checkpoint at ``path`` holds a valid certificate of its own ``metadata.json`` (and is not
    retired: :func:`certification_status`). Not collective."""
    storage = storage_for(path, storage_options)
    try:
        return certification_status(storage)[0]
    finally:
        if storage is not path:
            storage.close()


# ---- the decision (collective) -------------------------------------------------------------------------------


def _run_hook(hook: CertifyHook | None, step: int, checks: Checks) -> list[Any]:
    if hook is None:
        return [True, ""]
    try:
        answer: object = hook(step, checks)  # user code: typed bool, but anything may come back
    except Exception as exc:  # user code: a veto named, never a failed save
        return [False, f"raised on rank {{rank}}: {type(exc).__name__}: {exc}"]
    if not isinstance(answer, bool):  # "no" is truthy: only True approves, and anything but a bool is named
        return [False, f"returned {answer!r:.200} ({type(answer).__name__}) on rank {{rank}}, not True or False"]
    return [answer, ""]


def decide_certification(
    comm: Communicator, storage: Storage, step: int, checks: Checks, hook: CertifyHook | None
) -> Checks:
    """Collective (``certification``, every rank of ``comm``): when ``checks`` passed, run ``hook(step, checks)`` on
    every rank (an exception is a veto naming it); if no rank vetoed, the coordinator writes the certificate. The
    checks as decided, the same on every rank: ``hook`` added to ``checked``, and a veto, or a certificate that could
    not be written, as a problem (then ``passed`` is False). Raises only what the collective raises."""

    def local() -> list[Any]:
        return _run_hook(hook, step, checks) if checks.passed else [False, ""]

    def combine(values: list[list[Any]]) -> dict[str, Any]:
        checked = (*checks.checked, "hook") if hook is not None else checks.checked
        if not checks.passed:
            return Checks(passed=False, problems=checks.problems, checked=checked).to_json()
        vetoes = [
            f"certify_hook {why.replace('{rank}', str(r), 1)}" if why else f"certify_hook vetoed on rank {r}"
            for r, (approved, why) in enumerate(values)
            if not approved
        ]
        if not vetoes:
            try:
                write_certificate(storage, checks)
            except CheckpointError as exc:
                vetoes.append(f"the certificate could not be written: {exc}")
        return Checks(passed=not vetoes, problems=tuple(vetoes), checked=checked).to_json()

    return Checks.from_json(comm.step("certification", local, combine))


def options_term(options: CertifyOptions | None) -> str | None:
    """``options`` as a term every rank must pass alike (hashable: the agreement groups ranks by it)."""
    return None if options is None else json.dumps(options.to_json(), sort_keys=True)


def certify_later(comm: Communicator, storage: Storage, step: int) -> Checks:
    """Collective (every rank of ``comm``): certify the step at ``storage`` now, after its save (a
    :class:`~reshard.CheckpointManager`'s ``certify(step)``: a decision that needed later information, such as the
    loss a few steps on; the hook is not run again). The coordinator reads the checks the save recorded in
    :data:`CHECKS_FILE`, which must belong to the step's ``metadata.json`` now, and ties the certificate to that same
    ``metadata.json``: checks this process remembers are never used, since the step may have been saved again since
    (by this job or another), and its new bytes were not checked.

    Raises:
        CheckpointError: on every rank: the checks are unknown (the step was saved without checks, or its record
            is missing, damaged or another save's: save it again) or did not pass, or the certificate could not be
            written.
    """

    def combine(_values: list[None]) -> dict[str, Any]:
        known, why, digest = recorded_checks(storage)
        if known is None:
            return {"problem": f"its checks are unknown ({why})"}
        if not known.passed:
            return {"problem": "; ".join(known.problems)}
        try:
            write_certificate(storage, known, metadata_sha256=digest)
        except CheckpointError as exc:
            return {"problem": f"the certificate could not be written: {exc}"}
        return {"checks": known.to_json()}

    decided = comm.step("certification", lambda: None, combine)
    if "problem" in decided:
        raise CheckpointError(f"step {step} cannot be certified: {decided['problem']}")
    return Checks.from_json(decided["checks"])


def prefer_certified(
    listed: list[list[Any]], skip: Callable[[int, str], None], known: Mapping[int, Checks]
) -> list[list[Any]]:
    """A manager's ``load_latest`` candidates (newest first: ``[step, status, problem, digest, certified, why]``)
    when it certifies: the complete steps newer than the newest certified one are skipped (``skip(step, reason)``,
    the reason their checks' problems where ``known``, else why they are not certified); with no certified step,
    every candidate stays, and a warning says that the newest complete one is not certified."""
    certified_steps = [entry[0] for entry in listed if entry[1] == "complete" and entry[4]]
    if not certified_steps:
        if any(entry[1] == "complete" for entry in listed):
            warnings.warn("reshard: no certified step: loading the newest complete one, not certified", stacklevel=4)
        return listed
    newest = max(certified_steps)
    kept = []
    for entry in listed:
        step, status, why = entry[0], entry[1], entry[5]
        if status == "complete" and step > newest:
            checks = known.get(step)
            reason = "; ".join(checks.problems) if checks is not None and checks.problems else why or "not certified"
            skip(step, f"it is not certified ({reason}); step {newest} is")
            continue
        kept.append(entry)
    return kept
