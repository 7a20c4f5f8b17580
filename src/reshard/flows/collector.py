"""Python's cyclic garbage collector, paused while a synchronous save or load runs.

A save or load creates many short-lived objects (descriptions, plans, read items) and frees nearly all of
them by reference counting; left running, the collector still counts them and runs its collections in the
middle of the operation, between collectives, where a pause on one rank stalls all of them. Paused, objects
the operation frees never reach a collection at all, and what remains runs once, when the block ends, on
each rank by itself: a collection of the youngest generation only, which holds just what the operation
allocated and kept. A collection of an older generation that was already due does not go away, and must not
land in the operation either: a process fresh from its imports, or a caller that has just built its state dict,
often owes a generation-2 collection that walks every object the process holds (about 0.1 s per rank after
importing torch on the benchmark machine). Enabled again with the young generation over its threshold, the
collector would run that full collection at the next allocation, which is still inside the save or load; with
the young generation collected first, the counters stay as the caller's objects left them, and the caller pays
its own collection at its next allocations, as it would have without reshard (benchmarks/README.md). The
application's collector settings (thresholds, frozen objects) are never changed.

The collector is process-wide, so only the main thread pauses it: a save in a background thread (the
asynchronous checkpointer) runs next to the training loop, whose garbage must still be collected.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


class _PauseState:
    """How deep the main thread is in paused blocks, and whether to enable the collector after them."""

    depth = 0
    resume = False


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the ``with`` block, on the main thread only (elsewhere: nothing).

    Nested blocks are fine; the collector is enabled again after the outermost one only if it was
    enabled before it (an application that disabled it keeps it disabled), after a collection of generation 0
    if the block left it over its threshold (see the module doc: an older generation due stays due)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _PauseState.depth == 0:
        _PauseState.resume = gc.isenabled()
        gc.disable()
    _PauseState.depth += 1
    try:
        yield
    finally:
        _PauseState.depth -= 1
        if _PauseState.depth == 0 and _PauseState.resume:
            threshold = gc.get_threshold()[0]
            if threshold > 0 and gc.get_count()[0] > threshold:  # 0: the application turned collections off
                gc.collect(0)
            gc.enable()
