"""Peak resident memory of this process, for tests that bound what an operation may allocate."""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def peak_rss_growth() -> Iterator[Callable[[], int]]:
    """Yield a function giving how far the peak resident memory rose (bytes) since entering.

    The kernel's high-water mark is reset first where /proc allows it (Linux >= 4.0), so that a peak
    reached earlier in the session cannot hide a new one; resource.getrusage reads it."""
    with_reset = True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        with_reset = False
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if with_reset:
        with open("/proc/self/statm") as f:
            before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

    def grown() -> int:
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024

    yield grown
