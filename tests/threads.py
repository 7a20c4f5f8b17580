"""Ranks as threads of this process (a :class:`reshard.net.transports.ThreadGroup`), for tests that run the real
protocol of several ranks without spawning processes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from reshard.net.transports import ThreadGroup

T = TypeVar("T")


def on_threads(ranks: int, run: Callable[[int], T], *, group: ThreadGroup | None = None) -> list[T]:
    """``run(rank)`` on one thread per rank; the results in rank order (the first error of any rank is
    raised). With ``group``, a failing rank aborts the group's barrier, so that the others fail at once
    instead of waiting out its timeout."""
    results: list[Any] = [None] * ranks
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            results[r] = run(r)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)
            if group is not None:
                group.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def outcomes_on_threads(ranks: int, run: Callable[[int], T]) -> list[T | BaseException]:
    """``run(rank)`` on one thread per rank; each rank's result or the exception it raised, in rank order (for
    tests that compare how the ranks ended)."""
    outcomes: list[Any] = [None] * ranks

    def rank(r: int) -> None:
        try:
            outcomes[r] = run(r)
        except BaseException as exc:  # returned to the test, which compares the ranks
            outcomes[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes
