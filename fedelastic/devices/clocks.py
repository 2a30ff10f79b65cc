"""The clocks a measurement times with, and the median of repeated timings (no fedelastic imports:
both :mod:`fedelastic.profiling.measure` and :mod:`fedelastic.devices.kernelsample` time with them)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np


def _cuda_clock() -> float:
    """Wall time after waiting for every queued CUDA kernel (each stamp is a device barrier)."""
    import torch

    torch.cuda.synchronize()
    return time.perf_counter()


#: Clocks ``measure_layers`` can time with: wall time, the CPU time of the calling thread
#: (only meaningful with one torch thread; it leaves out time the thread spends descheduled on
#: a machine shared with other work), or wall time after a CUDA synchronisation (``cuda``: a
#: model and sample on a GPU; every stamp waits for the kernels queued before it).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time, "cuda": _cuda_clock}


def get_clock(name: str) -> Callable[[], float]:
    """The clock called ``name`` (``wall``, ``cpu`` or ``cuda``); ``cpu`` requires one torch thread."""
    import torch

    if name not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {name!r}")
    if name == "cpu" and torch.get_num_threads() != 1:
        raise ValueError("the 'cpu' clock (thread CPU time) needs torch.set_num_threads(1)")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("the 'cuda' clock needs a CUDA device (torch.cuda.is_available() is False)")
    return CLOCKS[name]


def _median_time(
    fn: Callable[[], Any],
    repeats: int,
    warmup: int,
    clock: Callable[[], float],
    between: Callable[[], Any] | None = None,
) -> float:
    """Median of ``repeats`` timings of ``fn`` after ``warmup`` calls; ``between`` runs untimed
    before each timed call (e.g. to evict the caches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if between is not None:
            between()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(np.median(times))
