"""How long operations (validation, the offline tools of :mod:`reshard.interop`) report progress: a small
protocol the caller implements (the command line draws a tqdm bar with it), so that the library itself
prints nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

__all__ = ["Progress", "reporting"]


class Progress(Protocol):
    """Receives the progress of one operation, in bytes of tensor data.

    Call order: :meth:`start` once, :meth:`advance` any number of times, then :meth:`finish` once (also
    when the operation fails). Called from the thread that runs the operation.
    """

    def start(self, total_bytes: int, description: str) -> None:
        """The operation will process ``total_bytes`` bytes; ``description`` names it ("export", ...)."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more bytes are done."""

    def finish(self) -> None:
        """The operation ended (successfully or not)."""


@contextlib.contextmanager
def reporting(progress: Progress | None, total_bytes: int, description: str) -> Iterator[Callable[[int], None]]:
    """Start ``progress`` (if any) for ``total_bytes`` and give the function that advances it; finish it
    when the block ends, however it ends."""
    if progress is None:
        yield _ignore
        return
    progress.start(total_bytes, description)
    try:
        yield progress.advance
    finally:
        progress.finish()


def _ignore(nbytes: int) -> None:
    """Progress nobody watches."""
