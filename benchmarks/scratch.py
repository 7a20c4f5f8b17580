"""Scratch directories of the benchmarks, removed however a run ends; and the two small pieces every benchmark
that spawns ranks shares (:func:`free_port`, :func:`slowest_timed`, :func:`warm_and_cold`).

A benchmark writes gigabytes of checkpoints into its scratch directory. ``try/finally`` (or a
``TemporaryDirectory``) removes it after a normal end, an exception or Ctrl-C (KeyboardInterrupt), but
SIGTERM and SIGHUP (``kill``, ``timeout``, a closed terminal, a job scheduler) end Python without running
any ``finally``: a killed ``compare.py`` left 6.2 GB in ``.reshard-bench-*`` (issue 38 item 6).
:func:`scratch_dir` turns those signals into ``SystemExit`` while the directory exists, so the
benchmark's own ``finally`` blocks (stopping its rank processes) and then the removal run; a second
signal during the cleanup is ignored rather than cutting it short.

Imported as ``benchmarks.scratch`` (``python -m benchmarks.x``, the tests) or as ``scratch`` (``python
benchmarks/x.py``, where ``benchmarks/`` is the first entry of ``sys.path``).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import statistics
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

SIGNALS = tuple(s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)
"""The signals that would end the process without running ``finally`` blocks; SIGINT already raises
KeyboardInterrupt (and is ignored, with these, while the directory is being removed)."""


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def scratch_dir(prefix: str, parent: str | Path | None = None, *, keep: bool = False) -> Iterator[Path]:
    """A new directory ``<parent>/<prefix>XXXXXXXX`` (``parent``: the system's temporary directory when
    None), removed when the block ends, by any of: its end, an exception, SIGINT, SIGTERM or SIGHUP;
    kept when ``keep``. The signal handlers are installed only from the main thread (Python delivers
    signals there), and the ones found are put back afterwards."""
    main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if main:
        for signum in SIGNALS:
            previous[signum] = signal.signal(signum, _exit_on_signal)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        if main:
            for signum in (*SIGNALS, signal.SIGINT):
                previous.setdefault(signum, signal.getsignal(signum))
                signal.signal(signum, signal.SIG_IGN)
        try:
            if not keep:
                shutil.rmtree(path, ignore_errors=True)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def warm_and_cold(samples: list[float]) -> dict[str, float]:
    """The median of the warm repetitions (all but the first, unless there is only one) and the first, cold one."""
    warm = samples[1:] or samples
    return {"seconds": statistics.median(warm), "cold_seconds": samples[0]}


def slowest_timed(run: Any) -> tuple[float, Any]:
    """Collective over the default process group: ``run()`` after a barrier, and the slowest rank's seconds for
    it, with what it returned on this rank."""
    import time

    import torch
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    result = run()
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item()), result
