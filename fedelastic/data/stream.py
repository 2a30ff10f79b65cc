"""Continual streams: what each device observes round by round, and the tasks it is tested on.

A stream (the scenario's ``[stream]`` table) has two schedules over rounds:

* **class-incremental tasks**: groups of labels; task ``k`` arrives at round ``1 + k * task_rounds``
  (a single task of every label when none are given);
* **domain drift**: a list of :class:`~fedelastic.data.shifts.Shift` domains; switch ``i`` is due
  at round ``1 + i * domain_rounds``, and each client enters it ``0..onset_jitter`` rounds late
  (seeded per client and switch), so drift is not synchronised across a fleet.

Each round every client receives ``samples_per_round`` new samples of its own partition, of the
labels of the current task, in its current domain, and keeps at most ``buffer_size`` of them
(``fifo``: the newest; ``reservoir``: a uniform sample of all it has seen). A client trains on its
buffer. The buffer is a pure function of (seed, client, round): it is replayed from round 1, so
any process (a Ray actor or the driver) builds the same one without keeping state.

The *evaluation tasks* are the segments of the nominal schedule: a new one starts at every round
where the task or the domain changes, and is tested on held-out samples of its labels in its domain.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

import numpy as np

from ..config import check, field
from . import ArrayDataset, FederatedData
from .shifts import Shift, apply_shift


@dataclass(frozen=True)
class StreamConfig:
    tasks: tuple[tuple[int, ...], ...] = field((), help="class-incremental tasks: groups of labels, in order")
    task_rounds: int = field(10, help="rounds per class task")
    domains: tuple[Shift, ...] = field((), help="domain schedule: a list of shift tables, in order")
    domain_rounds: int = field(10, help="rounds per domain")
    onset_jitter: int = field(0, help="each client enters each new domain 0..this many rounds late (seeded)")
    samples_per_round: int = field(16, help="new samples each client receives per round")
    buffer_size: int = field(64, help="most samples a device keeps (a device limit)")
    buffer_policy: Literal["fifo", "reservoir"] = field("fifo", help="which samples a full buffer keeps")
    eval_samples: int = field(500, help="held-out samples per evaluation task (fewer if the test set has fewer)")
    recover_share: float = field(0.9, help="share of the pre-shift accuracy that counts as recovered")
    federated: bool = field(True, help="false: a fleet of one device adapting alone (no aggregation, no communication)")

    def __post_init__(self):
        check(all(len(t) > 0 for t in self.tasks), "tasks", "non-empty groups of labels")
        check(self.task_rounds >= 1, "task_rounds", "an integer >= 1")
        check(self.domain_rounds >= 1, "domain_rounds", "an integer >= 1")
        check(self.onset_jitter >= 0, "onset_jitter", "an integer >= 0")
        check(self.samples_per_round >= 1, "samples_per_round", "an integer >= 1")
        check(self.buffer_size >= 1, "buffer_size", "an integer >= 1")
        check(self.eval_samples >= 1, "eval_samples", "an integer >= 1")
        check(0 < self.recover_share <= 1, "recover_share", "a share in (0, 1]")


@dataclass(frozen=True)
class Segment:
    """One evaluation task: from ``start`` (a round), the labels ``classes`` in domain ``domain``."""

    start: int
    task: int
    domain: int
    classes: tuple[int, ...]
    shift: Shift

    @property
    def label(self) -> str:
        return f"t{self.task}:{','.join(map(str, self.classes))}|d{self.domain}:{self.shift.label()}"


def task_at(cfg: StreamConfig, server_round: int) -> int:
    """Index of the class task current in ``server_round`` (rounds count from 1)."""
    return min((max(server_round, 1) - 1) // cfg.task_rounds, max(len(cfg.tasks) - 1, 0))


def domain_onsets(cfg: StreamConfig, seed: int, client: int) -> np.ndarray:
    """The rounds at which ``client`` enters domains 1, 2, ...: nominal round plus its seeded delay."""
    n = max(len(cfg.domains) - 1, 0)
    nominal = 1 + cfg.domain_rounds * np.arange(1, n + 1)
    delay = np.random.default_rng([seed, 0xD1, client]).integers(0, cfg.onset_jitter + 1, n)
    return nominal + delay


def domain_at(cfg: StreamConfig, seed: int, client: int, server_round: int) -> int:
    """Index of the domain ``client`` observes in ``server_round`` (0 when there is no schedule)."""
    return int((domain_onsets(cfg, seed, client) <= server_round).sum())


def segments(cfg: StreamConfig, rounds: int, all_classes: tuple[int, ...]) -> list[Segment]:
    """The evaluation tasks of the nominal schedule within ``rounds`` rounds."""
    tasks = cfg.tasks or (all_classes,)
    domains = cfg.domains or (Shift(),)
    starts = sorted(
        {1}
        | {1 + k * cfg.task_rounds for k in range(1, len(tasks)) if 1 + k * cfg.task_rounds <= rounds}
        | {1 + i * cfg.domain_rounds for i in range(1, len(domains)) if 1 + i * cfg.domain_rounds <= rounds}
    )
    out = []
    for s in starts:
        k = task_at(cfg, s)
        d = min((s - 1) // cfg.domain_rounds, len(domains) - 1)
        out.append(Segment(s, k, d, tuple(tasks[k]), domains[d]))
    return out


def replay_buffer(arrivals: list[np.ndarray], buffer_size: int, policy: str, rng: np.random.Generator) -> np.ndarray:
    """Items kept after the arrivals (one array of item rows per round), in arrival order for FIFO.

    ``reservoir`` is Vitter's algorithm R: item ``n`` (0-based) enters with probability
    ``buffer_size / (n + 1)``, replacing a uniformly chosen slot.
    """
    width = arrivals[0].shape[1] if arrivals else 2
    if policy == "fifo":
        seen = np.concatenate(arrivals) if arrivals else np.zeros((0, width), np.int64)
        return seen[-buffer_size:]
    buf: list[np.ndarray] = []
    n = 0
    for batch in arrivals:
        for item in batch:
            if n < buffer_size:
                buf.append(item)
            else:
                j = int(rng.integers(0, n + 1))
                if j < buffer_size:
                    buf[j] = item
            n += 1
    return np.array(buf, dtype=np.int64).reshape(-1, width)


class Stream:
    """The stream of a run: per-client buffers and the evaluation tasks."""

    def __init__(self, cfg: StreamConfig, data: FederatedData, rounds: int, seed: int):
        self.cfg, self.data, self.rounds, self.seed = cfg, data, rounds, seed
        labels = tuple(int(c) for c in np.unique(data.train.y))
        for k, task in enumerate(cfg.tasks):
            missing = sorted(set(task) - set(labels))
            if missing:
                raise ValueError(
                    f"stream.tasks[{k}]: labels {missing} are not in the training data (labels {list(labels)})"
                )
        self.segments = segments(cfg, rounds, labels)
        self._tasks = cfg.tasks or (labels,)
        self._domains = cfg.domains or (Shift(),)

    def arrivals(self, client: int, server_round: int) -> np.ndarray:
        """(n, 2) rows (train index, domain) that ``client`` receives in ``server_round``."""
        part = self.data.partitions[client]
        pool = part[np.isin(self.data.train.y[part], self._tasks[task_at(self.cfg, server_round)])]
        if len(pool) == 0:
            return np.zeros((0, 2), np.int64)
        rng = np.random.default_rng([self.seed, 0xA7, client, server_round])
        k = self.cfg.samples_per_round
        idx = rng.choice(pool, size=k, replace=len(pool) < k)
        return np.stack([idx, np.full(k, domain_at(self.cfg, self.seed, client, server_round))], axis=1)

    def buffer(self, client: int, server_round: int) -> np.ndarray:
        """(n, 2) rows (train index, domain) held by ``client`` when it trains in ``server_round``."""
        arrivals = [self.arrivals(client, r) for r in range(1, server_round + 1)]
        rng = np.random.default_rng([self.seed, 0xB0, client])
        return replay_buffer(arrivals, self.cfg.buffer_size, self.cfg.buffer_policy, rng)

    def client_data(self, client: int, server_round: int) -> ArrayDataset:
        """The images ``client`` trains on in ``server_round``: its buffer, each item in its own domain."""
        items = self.buffer(client, server_round)
        x = self.data.train.x[items[:, 0]]
        for d in np.unique(items[:, 1]):
            rows = items[:, 1] == d
            x[rows] = apply_shift(x[rows], self._domains[int(d)], [self.seed, 0xC3, client, server_round, int(d)])
        return ArrayDataset(x, self.data.train.y[items[:, 0]])

    @cached_property
    def eval_sets(self) -> list[ArrayDataset]:
        """Held-out samples of each evaluation task, in its domain (fixed for the run)."""
        test = self.data.test
        out = []
        for j, seg in enumerate(self.segments):
            pool = np.flatnonzero(np.isin(test.y, seg.classes))
            rng = np.random.default_rng([self.seed, 0xE5, j])
            pick = np.sort(rng.choice(pool, size=min(len(pool), self.cfg.eval_samples), replace=False))
            out.append(ArrayDataset(apply_shift(test.x[pick], seg.shift, [self.seed, 0xE6, seg.domain]), test.y[pick]))
        return out
