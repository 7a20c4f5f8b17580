"""The one agreed step of every data capture: :func:`reshard.data.capture` and
:func:`reshard.data.capture_iterable` run the same phase, so that ranks that pass different kinds of data
(a sampler on one rank, an iterable dataset on another) or different keys fail in the same way everywhere.

Each rank's part is tagged with its kind (``"sampler"`` or ``"iterable"``) and the key of the value it will
return; the coordinator refuses mixed kinds or keys (DataStateError naming every rank's value) before it
combines the parts with its own kind's combination. A key that is no name fails the rank's own part, so that
every rank raises the step's DataStateError instead of one rank returning while another raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from reshard.errors import DataStateError
from reshard.net.comm import Communicator

PHASE = "data.capture"
"""The phase name of every data capture's step."""

KINDS = ("sampler", "iterable")
"""The kinds of data a capture's part may be of."""


def check_key(key: object) -> str:
    """``key`` when it is a non-empty str (the key of the captured ``ShardedObject``), else DataStateError."""
    if not isinstance(key, str) or not key:
        raise DataStateError(f"reshard.data.capture: key={key!r} is not a non-empty str")
    return key


def agreed_capture(
    comm: Communicator,
    *,
    kind: str,
    key: object,
    local: Callable[[], dict[str, Any]],
    combine: Callable[[list[dict[str, Any]]], dict[str, Any]],
) -> dict[str, Any]:
    """The combined value of a capture, agreed by every rank of ``comm`` (collective: every rank calls it,
    whatever it captures). ``local`` is this rank's part and ``combine`` the coordinator's combination of
    every rank's part (in rank order), called only when every rank is of the same ``kind`` and ``key``."""
    assert kind in KINDS

    def tagged() -> dict[str, Any]:
        return {"kind": kind, "key": check_key(key), "part": local()}

    def combined(parts: list[dict[str, Any]]) -> dict[str, Any]:
        for field in ("kind", "key"):
            if len({part[field] for part in parts}) > 1:
                per_rank = ", ".join(f"rank {r}: {part[field]!r}" for r, part in enumerate(parts))
                what = "kind of data (a sampler or loader, or an iterable dataset)" if field == "kind" else "key"
                raise DataStateError(f"reshard.data.capture: the ranks disagree on the {what} ({per_rank})")
        return combine([part["part"] for part in parts])

    result: dict[str, Any] = comm.step(PHASE, tagged, combined)
    return result
