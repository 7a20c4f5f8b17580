"""Ranks as threads of this process (a :class:`reshard.transports.ThreadGroup`), for tests that run the real
protocol of several ranks without spawning processes."""

from __future__ import annotations

import threading
from collections.abc import Callable


def on_threads(ranks: int, run: Callable[[int], object]) -> None:
    """``run(rank)`` on one thread per rank; the first error of any rank is raised."""
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            run(r)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
