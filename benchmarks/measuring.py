"""Measuring helpers the benchmarks share: process-tree CPU and memory from /proc, and wall-time timers.

The benchmarks run as scripts (``python benchmarks/X.py``), so this sits beside them and is
imported as ``measuring``.
"""

from __future__ import annotations

import collections
import functools
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class TreeUsage:
    cpu_s: float  # user + system CPU seconds of the root and its live descendants
    rss_bytes: int  # resident set sizes summed (pages shared between processes count in each)
    root_cpu_s: float  # the root process's own CPU seconds
    processes: int


def tree_usage(root: int | None = None) -> TreeUsage:
    """CPU and memory used so far by process ``root`` (default: this one) and all its live descendants.

    Ray's GCS, raylet and actor processes descend from the driver, so this counts the whole
    simulation, a figure less sensitive than wall time to other load on the machine.
    """
    root = root or os.getpid()
    children: dict[int, list[int]] = collections.defaultdict(list)
    usage: dict[int, tuple[int, int]] = {}  # pid -> (cpu ticks, rss pages)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children[int(fields[1])].append(int(entry))
        usage[int(entry)] = (int(fields[11]) + int(fields[12]), int(fields[21]))
    ticks = pages = count = 0
    stack = [root]
    while stack:
        pid = stack.pop()
        t, p = usage.get(pid, (0, 0))
        ticks, pages, count = ticks + t, pages + p, count + 1
        stack.extend(children.get(pid, ()))
    hz = os.sysconf("SC_CLK_TCK")
    return TreeUsage(ticks / hz, pages * os.sysconf("SC_PAGE_SIZE"), usage.get(root, (0, 0))[0] / hz, count)


class Timers:
    """Wall-time accumulators wrapped around functions (monkeypatched in the measured process only)."""

    def __init__(self, since: float = float("-inf"), clock=time.perf_counter):
        self.total: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.since = since  # only calls that start at or after this clock() time count
        self.clock = clock  # time.thread_time: the calling thread's CPU instead of wall time

    def wrap(self, owner, name: str, label: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:  # not in this version of fedelastic
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                if start >= self.since:
                    self.total[label] += self.clock() - start
                    self.calls[label] += 1

        setattr(owner, name, timed)

    def snapshot(self) -> dict:
        return {k: {"s": self.total[k], "calls": self.calls[k]} for k in sorted(self.total)}
