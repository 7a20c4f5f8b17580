"""The errors of the strategies, as Megatron's callers catch them.

Megatron-Core's callers (``dist_checkpointing.load`` and its users, Megatron-LM's checkpointing, Megatron's own
tests) catch ``CheckpointingException``; reshard's users catch :class:`~reshard.CheckpointError` and its
subclasses. A strategy raises both at once: each reshard error class has a twin here that derives from it and
from :class:`MegatronCheckpointError` (a ``CheckpointingException``), with the same name, message and
attributes (``failures``: every rank raises the same class with the same message).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import cast

from megatron.core.dist_checkpointing.core import CheckpointingException

from reshard.errors import ERROR_CLASSES, CheckpointError

__all__ = ["MegatronCheckpointError", "as_megatron", "megatron_errors"]


class MegatronCheckpointError(CheckpointError, CheckpointingException):  # type: ignore[misc]  # megatron is untyped
    """A reshard error raised by a strategy of :mod:`reshard.interop.megatron`: Megatron's ``CheckpointingException``
    and reshard's :class:`~reshard.CheckpointError`. The error a strategy raises is an instance of the twin of
    reshard's class (``isinstance(exc, reshard.MismatchError)`` holds for a mismatch), which derives from this."""


def _twin(cls: type[CheckpointError]) -> type[CheckpointError]:
    """The twin of ``cls``, also a module attribute of its name (so that its instances pickle)."""
    if cls is CheckpointError:
        return MegatronCheckpointError
    namespace = {"__module__": __name__, "__doc__": f"{cls.__name__}, raised by a strategy (see the module doc)."}
    twin = cast(type[CheckpointError], type(cls.__name__, (cls, MegatronCheckpointError), namespace))
    globals().setdefault(cls.__name__, twin)
    return twin


_TWINS: dict[type[CheckpointError], type[CheckpointError]] = {cls: _twin(cls) for cls in ERROR_CLASSES.values()}


def as_megatron(exc: CheckpointError) -> CheckpointError:
    """``exc`` as an instance of its class's twin (itself when it is one already): the
    same message, ``failures`` and other attributes."""
    if isinstance(exc, MegatronCheckpointError):
        return exc
    cls = type(exc)
    twin = _TWINS.get(cls)
    if twin is None:  # a subclass reshard.errors does not list
        twin = _TWINS[cls] = _twin(cls)
    converted = twin(*exc.args)
    converted.__dict__.update(vars(exc))
    return converted


@contextlib.contextmanager
def megatron_errors() -> Iterator[None]:
    """Raise a reshard error escaping the block as its twin (see :func:`as_megatron`), chained to it."""
    try:
        yield
    except CheckpointError as exc:
        converted = as_megatron(exc)
        if converted is exc:
            raise
        raise converted from exc
