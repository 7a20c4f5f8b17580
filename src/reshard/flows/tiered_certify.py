"""Certificates of a :class:`~reshard.TieredCheckpointManager`'s node-local steps: which are certified on this node,
and the certificate a ``certify_hook`` approved, put on every node.

A node-local save certifies itself on every node (:meth:`NodeLocalCheckpoints.save`) and its drain carries the
certificate to the durable step. With a ``certify_hook`` the save writes none (``certificate=False``): the
manager's decision (:func:`reshard.flows.certify.decide_certification`) writes it in the coordinator's node
directory, and :func:`spread_certificate` puts the same bytes on every other node (the certificate is tied to
``metadata.json`` by its SHA-256, and every node holds the same ``metadata.json`` bytes). A node's leader reads and
writes its node's files.
"""

from __future__ import annotations

import hashlib
import json
import logging

from reshard.flows.certify import MAX_CERTIFICATE_BYTES, certificate_status
from reshard.flows.nodelocal import NodeLocalCheckpoints
from reshard.flows.steps import scan_root
from reshard.io.retirement import CERTIFICATE_FILE
from reshard.io.sources import read_metadata_bytes
from reshard.net.comm import Communicator
from reshard.storage import Storage

__all__ = ["carry_lost_certificates", "certified_here", "node_certified", "spread_certificate"]

logger = logging.getLogger("reshard")


def _valid_certificate(local: NodeLocalCheckpoints, step: int) -> str | None:
    """This node's valid ``certified.json`` of ``step`` (its text), or None."""
    storage = local.path_of(step)
    try:
        if certificate_status(storage)[0] is None:
            return None
        return storage.read_bytes(CERTIFICATE_FILE, max_bytes=MAX_CERTIFICATE_BYTES).decode()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        storage.close()


def certified_here(local: NodeLocalCheckpoints, step: int) -> bool:
    """Whether this node's copy of ``step`` is certified. Not collective."""
    return _valid_certificate(local, step) is not None


def node_certified(local: NodeLocalCheckpoints) -> list[int]:
    """The steps complete on this node whose ``certified.json`` certifies them (its leader's view; other ranks:
    []). Not collective."""
    if not local.is_leader:
        return []
    return [s for s in local.steps() if _valid_certificate(local, s) is not None]


def spread_certificate(comm: Communicator, local: NodeLocalCheckpoints, step: int) -> None:
    """After a node-local save of ``step`` that the coordinator certified (collective over ``comm``, every rank of
    the save's group): the coordinator's ``certified.json`` on every other node, written by its leader where the
    node's ``metadata.json`` is the one certified. Best effort per node: a node that cannot write it keeps the step
    uncertified (it is certified on the coordinator's node)."""
    text = _valid_certificate(local, step) if comm.is_coordinator else None
    raw = comm.broadcast_bytes(text.encode() if text is not None else b"" if comm.is_coordinator else None)

    def write() -> None:
        if not raw or not local.is_leader or comm.is_coordinator:
            return
        storage = local.path_of(step)
        try:
            digest = hashlib.sha256(read_metadata_bytes(storage)).hexdigest()
            if json.loads(raw).get("metadata_sha256") == digest:
                storage.commit(CERTIFICATE_FILE, raw, replace=True)
        except (OSError, ValueError, AttributeError):
            pass  # this node's copy stays uncertified; the coordinator's node holds the certificate
        finally:
            storage.close()

    comm.step("tiered save: certificate on every node", write)


def carry_lost_certificates(comm: Communicator, local: NodeLocalCheckpoints, root: Storage, every: int) -> list[int]:
    """Finish the certificates a dead drain did not carry (collective over ``comm``, every rank of the manager's
    group; at a manager's first save or restore): a drain killed after it published a step's ``metadata.json`` in
    the durable ``root`` and before its ``certified.json`` left the finalized step uncertified, and no drain runs
    again for a finalized step. Each node's leader offers its valid node-local certificates of the steps due for
    the durable tier (``every``); the coordinator copies one to each complete durable step that holds no valid
    certificate and whose ``metadata.json`` is the one it certifies (the same bytes: the drain copied them).
    Returns the steps it certified, on every rank. Best effort: a step it cannot write stays uncertified, logged."""

    def offer() -> dict[str, str]:
        if not local.is_leader:
            return {}
        texts = ((s, _valid_certificate(local, s)) for s in local.steps() if s % every == 0)
        return {str(s): text for s, text in texts if text is not None}

    def carry(offers: list[dict[str, str]]) -> list[int]:
        texts: dict[int, str] = {}
        for offered in offers:
            for step, text in offered.items():
                texts.setdefault(int(step), text)
        carried = []
        for info in scan_root(root):
            if info.status != "complete" or info.certified or info.step not in texts:
                continue
            child = root.child(info.name)
            try:
                raw = texts[info.step].encode()
                if json.loads(raw).get("metadata_sha256") == hashlib.sha256(read_metadata_bytes(child)).hexdigest():
                    child.commit(CERTIFICATE_FILE, raw, replace=True)
                    carried.append(info.step)
            except (OSError, ValueError, AttributeError) as exc:
                logger.warning("reshard: the certificate of %s could not be carried: %s", child.describe(), exc)
            finally:
                child.close()
        return carried

    steps: list[int] = comm.step("tiered: certificates a drain did not carry", offer, carry)
    for step in steps:
        logger.warning(
            "reshard: durable step %d: its drain did not carry its certificate; copied from its node-local copy", step
        )
    return steps
