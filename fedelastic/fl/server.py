"""The server side: a FedAvg subclass that averages partial updates and keeps a simulated clock.

* Sampling is reproducible: nodes are sorted by partition id (asked once with a query message)
  and sampled with the run's own seeded RNG; replies are sorted by partition id.
* Aggregation averages each element only over the clients that trained it
  (:func:`~fedelastic.fl.aggregate.aggregate_partial`).
* The simulated clock (:mod:`fedelastic.fl.clock`) places every client's download, local
  training and upload, with its own links (:mod:`fedelastic.fleet`), on one timeline. Under
  ``policy = "wait_all"`` a round lasts as long as its slowest client; deadline policies close it
  at the deadline; ``overcommit`` at the K-th arrival; ``async`` runs FedBuff. Clients that
  wait idle are charged idle power; work whose update is not used is counted as wasted energy.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from ..continual import evaluate_stream
from ..continual import report as continual_report
from ..costmodel import CostModel
from ..divergence import Detector, weight_norm
from ..errors import Diverged, RunFailed, StopRun
from ..fleet import (
    Availability,
    Batteries,
    SessionAvailability,
    comm_times_s,
    deadline_from_quantile,
    deadline_rho,
    deadline_rho_steps,
    deadline_steps,
    full_round_time_s,
    link_factors,
    load_availability_trace,
    load_network_trace,
    local_steps,
)
from ..results import Recorder
from ..scenario import Scenario
from ..training import evaluate_model, evaluate_predictions, torch_threads
from .aggregate import ClientUpdate, aggregate_buffered, aggregate_partial, fednova_rescale
from .arrays import config_record, record_dict, record_from_numpy, record_to_numpy, record_to_torch
from .client import METRIC_KEYS
from .clock import COUNTED, EXTRA, LATE, NO_UPDATE, Arrival, Trip, run_async, staleness_weight, sync_round
from .env import RunEnvironment, environment, freeze_heap
from .raypool import timeout_reason


def wait_for_nodes(grid: Grid, expected: int, timeout_s: float) -> list[int]:
    """Wait until every node has registered (round 1 can otherwise see too few)."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= expected:
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {expected} nodes registered within {timeout_s:.0f} s")
        time.sleep(0.1)


QUERY_CHUNK = 256  # partition queries in flight at once (far more than the workers that answer them)


def discover_partitions(grid: Grid, nodes: list[int], timeout_s: float) -> dict[int, int]:
    """Ask every node its partition id; returns partition id -> node id.

    The queries go out :data:`QUERY_CHUNK` at a time. Sent all at once, every poll for replies
    (every 10 ms) checks every query still unanswered, and so does every sweep of the dispatch
    loop: work proportional to the fleet size, repeated for as long as the fleet takes to
    answer, so quadratic in the fleet size (at 10,000 nodes most of a minute of the driver's
    time). In chunks each poll stays small and the whole query is linear.
    """
    deadline = time.monotonic() + timeout_s
    mapping = {}
    for start in range(0, len(nodes), QUERY_CHUNK):
        chunk = nodes[start : start + QUERY_CHUNK]
        messages = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in chunk]
        for reply in grid.send_and_receive(messages, timeout=max(deadline - time.monotonic(), 0.0)):
            if reply.has_error():
                raise RuntimeError(f"node {reply.metadata.src_node_id} failed the partition query: {reply.error.reason}")
            mapping[int(reply.content["metrics"]["partition-id"])] = reply.metadata.src_node_id
        if len(mapping) != min(start + QUERY_CHUNK, len(nodes)):
            break
    if len(mapping) != len(nodes):
        raise RuntimeError(f"{len(mapping)} of {len(nodes)} nodes answered the partition query")
    return mapping


_CHECKED_MAX = 1 << 22  # elements of one tensor's stacked updates that nonfinite_tensors checks in one call (16 MB of float32)


def nonfinite_tensors(replies: list[dict[str, np.ndarray]]) -> list[set[str]]:
    """For each reply's arrays, the names of its floating tensors that hold a NaN or an inf.

    ``np.isfinite(value).all()`` per tensor per reply, with one numpy call per tensor for the
    replies whose copies of it agree in shape and dtype (stacked, at most ``_CHECKED_MAX``
    elements at once): ~8 calls a round instead of two per tensor and reply.
    """
    groups: dict[tuple[str, tuple[int, ...], str], list[int]] = {}
    for i, arrays in enumerate(replies):
        for name, value in arrays.items():
            if value.dtype.kind == "f":  # kind "f": np.floating
                groups.setdefault((name, value.shape, value.dtype.str), []).append(i)
    bad: list[set[str]] = [set() for _ in replies]
    for (name, shape, _), members in groups.items():
        step = max(1, _CHECKED_MAX // max(1, math.prod(shape)))
        for k in range(0, len(members), step):
            chunk = members[k : k + step]
            stacked = np.stack([replies[i][name] for i in chunk])
            for i, finite in zip(chunk, np.isfinite(stacked).reshape(len(chunk), -1).all(axis=1)):
                if not finite:
                    bad[i].add(name)
    return bad


def nonfinite_update(reply: Message, arrays: dict[str, np.ndarray] | None = None, nonfinite: set[str] | None = None) -> str:
    """'' if a client's reply is finite, else why it is rejected (first NaN/inf tensor or figure).

    ``arrays``: the reply's arrays, if already decoded; ``nonfinite``: the names of those that
    hold a NaN/inf, if already known (:func:`nonfinite_tensors`).
    """
    loss = float(reply.content["metrics"]["train-loss"])
    if arrays is None:
        arrays = record_to_numpy(reply.content["arrays"], copy=False)
    if nonfinite is None:
        nonfinite = nonfinite_tensors([arrays])[0]
    for name in arrays if nonfinite else ():  # the first in the reply's order, as the reply listed them
        if name in nonfinite:
            return f"non-finite update: tensor {name!r} holds NaN/inf (train loss {loss:g}); update rejected"
    if reply.content["metrics"]["fits"] and int(reply.content["metrics"]["steps"]) and not np.isfinite(loss):
        return f"non-finite update: train loss is {loss:g}; update rejected"
    return ""


class Fleet:
    """The server's view of its fleet on the clock: who is online, each client's links and deadline plans."""

    def __init__(self, env: RunEnvironment):
        self.env, sc = env, env.scenario
        n, av, net = sc.num_clients, sc.availability, sc.network
        self.windows: Availability | None = None  # None: the profiles' per-round availability draw
        if av.model in ("sessions", "diurnal"):
            amplitude = av.diurnal_amplitude if av.model == "diurnal" else 0.0
            self.windows = SessionAvailability(n, sc.seed, av.mean_session_s, av.mean_offline_s, amplitude, av.day_s)
        elif av.model == "trace":
            self.windows = load_availability_trace(av.trace, n, av.period_s)
        self.probability = [
            a.value if (a := env.profile(device).availability) is not None else 1.0 for device in env.devices
        ]
        profiles = [env.profile(device) for device in env.devices]
        if net.model == "trace":
            self.up_bps, self.down_bps = load_network_trace(net.trace, n)
        else:
            factor = link_factors(net.model, n, sc.seed, net.sigma)
            self.up_bps = np.array([p.uplink_bit_per_s.value for p in profiles]) * factor
            self.down_bps = np.array([p.downlink_bit_per_s.value for p in profiles]) * factor
        b = sc.battery
        self.batteries = (
            Batteries(n, b.capacity_j, b.min_fraction, b.recharge_w, b.charge_from_s, b.charge_until_s, b.day_s)
            if b.capacity_j > 0
            else None
        )
        t = sc.train
        self.steps = [local_steps(len(env.data.client(p)), t.batch_size, t.local_epochs, t.max_steps) for p in range(n)]

    def cost(self, pid: int) -> CostModel:
        return self.env.cost(self.env.devices[pid])

    def comm_s(self, pid: int, bytes_down: float, bytes_up: float) -> tuple[float, float]:
        stream = self.env.scenario.stream
        if stream is not None and not stream.federated:  # a fleet of one: nothing is sent
            return 0.0, 0.0
        latency = self.env.profile(self.env.devices[pid]).latency_s.value
        return comm_times_s(bytes_down, bytes_up, self.down_bps[pid], self.up_bps[pid], latency)

    def full_comm_s(self, pid: int) -> float:
        cost = self.cost(pid)
        return sum(self.comm_s(pid, cost.bytes_down(), cost.bytes_up(np.ones(self.env.info.num_tensors))))

    def full_round_s(self, pid: int) -> float:
        """Download, full local training and full upload (no probes)."""
        return full_round_time_s(self.full_comm_s(pid), self.steps[pid], self.cost(pid).full_step_time_s())

    def probe_s(self, pid: int) -> float:
        """Emulated time of the probes the train strategy runs in one round of ``steps[pid]`` steps."""
        strategy, cost = self.env.strategy(), self.cost(pid)
        if strategy.probe is None:
            return 0.0
        selections = 1 + sum(strategy.should_reselect(s) for s in range(1, self.steps[pid]))
        return selections * cost.probe_time_s(strategy.probe)  # one pass over the batch, every tensor

    def rho(self, pid: int, deadline_s: float, min_rho: float = 0.0) -> tuple[float, int]:
        """The client's rho and steps under ``deadline_s`` (steps are cut only below ``min_rho``)."""
        full_step = self.cost(pid).full_step_time_s()
        comm, steps, probe = self.full_comm_s(pid), self.steps[pid], self.probe_s(pid)
        if min_rho > 0:
            return deadline_rho_steps(deadline_s, comm, steps, full_step, probe, min_rho)
        return deadline_rho(deadline_s, comm, steps, full_step, probe), steps

    def step_cap(self, pid: int, deadline_s: float) -> int:
        return deadline_steps(deadline_s, self.full_comm_s(pid), self.cost(pid).full_step_time_s(), self.steps[pid])

    def online(self, pid: int, t: float) -> bool:
        return self.windows is None or self.windows.online(pid, t)

    def forget_before(self, t: float) -> None:
        """The clock is at ``t`` and never goes back: online windows that ended before it may go."""
        if self.windows is not None:
            self.windows.forget_before(t)

    def charged(self, pid: int, t: float) -> bool:
        """Whether the client's battery (if it has one) lets it train at ``t``."""
        return self.batteries is None or self.batteries.can_train(pid, t)

    def battery_fraction(self, pid: int, t: float) -> float:
        return float("nan") if self.batteries is None else self.batteries.fraction(pid, t)

    def ready_at(self, pid: int, t: float) -> float:
        """The earliest time from ``t`` at which ``pid`` is online and charged (``inf``: never)."""
        for _ in range(1000):
            online_t = self.next_online(pid, t)
            charged_t = online_t if self.batteries is None else self.batteries.ready_at(pid, online_t)
            if math.isinf(charged_t) or (charged_t == online_t and self.online(pid, charged_t)):
                return charged_t
            t = charged_t
        return math.inf

    def drain(self, pid: int, t: float, energy_j: float) -> None:
        if self.batteries is not None:
            self.batteries.drain(pid, t, energy_j)

    def offline_at(self, pid: int, t: float) -> float:
        return math.inf if self.windows is None else self.windows.offline_at(pid, t)

    def next_online(self, pid: int, t: float) -> float:
        return t if self.windows is None else self.windows.next_online(pid, t)


def _fits_reason(m: Message) -> str:
    """Why the client's selection did not fit (empty when it fit, or from a too-slow reply)."""
    return str(m.content["info"]["fits-reason"]) if "info" in m.content else ""


def trip_energy_j(cost: CostModel, trip: Trip, until_s: float, metrics: dict) -> float:
    """Energy a trip spent up to ``until_s`` (or until it went offline), each phase pro rata."""
    down, train, up = trip.busy_until(until_s)
    share = lambda done, whole: done / whole if whole > 0 else 1.0  # noqa: E731
    moved = metrics["emulated-bytes-down"] * share(down, trip.down_s) + metrics["emulated-bytes-up"] * share(
        up, trip.up_s
    )
    return cost.energy_j(train, up, down, metrics["emulated-macs"] * share(train, trip.train_s), moved)


# numeric columns of a client row (NaN in the row of a client that failed)
_CLIENT_FIGURES = (
    "num_examples",
    "steps",
    "selections",
    "train_loss",
    "fraction_params_trained",
    "emulated_train_time_s",
    "emulated_train_time_band_s",
    "emulated_overhead_time_s",
    "emulated_probe_time_s",
    "probes",
    "emulated_comm_time_s",
    "emulated_energy_j",
    "emulated_idle_energy_j",
    "emulated_peak_memory_bytes",
    "emulated_probe_peak_memory_bytes",
    "device_memory_bytes",
    "emulated_bytes_up",
    "emulated_bytes_down",
    "emulated_macs",
    "host_wall_s",
)
# the client's trip on the simulated clock (NaN where it has none)
_CLOCK_FIGURES = (
    "rho",
    "step_cap",
    "model_version",
    "staleness",
    "dispatch_s",
    "start_s",
    "finish_s",
    "arrival_s",
    "wasted_energy_j",
    "uplink_bit_per_s",
    "downlink_bit_per_s",
    "battery_fraction",
)

# a round's summary (PartialFedAvg._summary); round 0 (the initial model) has these values, typed
# as every later round's (ints, floats), so the rounds table keeps one schema from its first row
_ROUND_ZERO = {
    "clients": 0,
    "clients_failed": 0,
    "clients_unavailable": 0,
    "clients_not_fitting": 0,
    "clients_rejected": 0,
    "clients_no_steps": 0,
    "round_time_s": 0.0,
    "mean_train_loss": 0.0,
    "round_energy_j": 0.0,
    "max_peak_memory_bytes": 0.0,
    "policy": "",
    "round_start_s": 0.0,
    "deadline_s": float("nan"),
    "clients_counted": 0,
    "clients_late": 0,
    "clients_offline": 0,
    "clients_too_slow": 0,
    "mean_staleness": float("nan"),
    "wasted_energy_j": 0.0,
}
REJECTED = "rejected"  # a client row's status: it trained and sent a non-finite update, which was not used


class PartialFedAvg(FedAvg):
    """FedAvg over partial updates, with reproducible sampling and a simulated clock.

    Synchronous policies run in Flower's round loop (:meth:`start`); ``policy = "async"`` runs
    FedBuff's loop (:meth:`run_buffered`). Either way the clients are reached only with Flower
    messages, and every reply becomes a :class:`~fedelastic.fl.clock.Trip` on the clock.
    """

    def __init__(self, env: RunEnvironment, node_of_partition: dict[int, int], recorder: Recorder, progress: Callable):
        super().__init__(min_available_nodes=len(node_of_partition))  # evaluation is central: see configure_evaluate
        self.env, self.sc = env, env.scenario
        self.node_of_partition = node_of_partition
        self.partition_of_node = {n: p for p, n in node_of_partition.items()}
        self.recorder, self.progress = recorder, progress
        self.fleet = Fleet(env)
        self.policy = self.sc.server.policy
        self.sim_time_s = 0.0
        self.total_energy_j = 0.0
        self._arrays: ArrayRecord | None = None
        self._round: dict = {**_ROUND_ZERO, "policy": self.policy}  # round 0: the initial model
        self._round_start = time.perf_counter()
        self._unavailable = 0
        self._warned_no_steps = False
        self._deadline: float | None = None
        self._plan: dict[int, tuple[float, int]] = {}  # partition -> (rho, step cap) sent in this round
        d = self.sc.divergence
        self.detector = Detector(d.loss_factor, d.norm_factor, d.collapse_share, d.rejected_share)
        self._norm: float | None = None  # the global weights' norm after the round (None: not aggregated)
        self._params = frozenset(env.info.tensor_names)  # the norm's tensors: the trainable ones

    # ---- synchronous rounds -----------------------------------------------------------------
    def sample(self, server_round: int) -> list[int]:
        """Partition ids trained in ``server_round``: available devices, then a seeded sample of them.

        With the 'profile' availability model a device whose profile declares
        ``availability.probability = p`` is reachable in a round with probability p (a seeded draw
        per round and partition); with online windows, the devices online at the round's start.
        With batteries, only devices charged above their floor. If no device is online and
        charged, the clock first moves to the next time one is.
        """
        n = self.sc.num_clients
        rng = np.random.default_rng([self.sc.seed, server_round, 0x5A])
        t = self.sim_time_s
        self.fleet.forget_before(t)
        if not any(self.fleet.online(p, t) and self.fleet.charged(p, t) for p in range(n)):
            t = min(self.fleet.ready_at(p, t) for p in range(n))
            if math.isinf(t):
                raise RuntimeError(f"no client is online and charged at {self.sim_time_s:.1f} s or later")
            self.sim_time_s = float(t)
        if self.fleet.windows is None:
            draws = rng.random(n)
            available = [p for p in range(n) if draws[p] < self.fleet.probability[p] and self.fleet.charged(p, t)]
        else:
            available = [p for p in range(n) if self.fleet.online(p, t) and self.fleet.charged(p, t)]
        self._unavailable = n - len(available)
        k = self.sc.server.clients_per_round or n
        if self.policy == "overcommit":
            k = min(n, math.ceil(k * self.sc.server.overcommit))
        if k >= len(available):
            return available
        return sorted(rng.choice(available, size=k, replace=False).tolist())

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._arrays, self._round_start = arrays, time.perf_counter()
        chosen = self._sampled = self.sample(server_round)
        server = self.sc.server
        self._deadline = None
        if server.deadline > 0:
            self._deadline = server.deadline
        elif server.deadline_quantile > 0 and chosen:
            self._deadline = deadline_from_quantile(
                [self.fleet.full_round_s(p) for p in chosen], server.deadline_quantile
            )
        messages, self._plan = [], {}
        for p in chosen:
            cfg = {**config, "server-round": server_round}  # a plain dict, made a ConfigRecord once filled
            rho, cap = float("nan"), -1
            if self.policy == "deadline_elastic":
                assert self._deadline is not None
                rho, steps = self.fleet.rho(p, self._deadline, server.min_rho)
                cfg["rho"] = rho
                if steps < self.fleet.steps[p]:
                    cap = cfg["max-steps"] = steps
            elif self.policy == "deadline_fewer_steps":
                assert self._deadline is not None
                cap = cfg["max-steps"] = self.fleet.step_cap(p, self._deadline)
            self._plan[p] = (rho, cap)
            record = record_dict({"arrays": arrays, "config": config_record(cfg)})
            messages.append(
                Message(content=record, message_type=MessageType.TRAIN, dst_node_id=self.node_of_partition[p])
            )
        # the previous round's rows and checkpoint are handed to the writer as these messages leave
        # (GuardedGrid's on_sent), to be written while this round trains
        return messages

    def _trip(self, metrics: dict, dispatch_s: float, version: int, rejected: bool = False) -> Trip:
        """The reply's trip on the clock; a ``rejected`` (non-finite) update is waited for, but not used."""
        pid = int(metrics["partition-id"])
        down_s, up_s = self.fleet.comm_s(pid, metrics["emulated-bytes-down"], metrics["emulated-bytes-up"])
        return Trip(
            pid,
            dispatch_s,
            down_s,
            metrics["emulated-train-time-s"],
            up_s,
            offline_s=self.fleet.offline_at(pid, dispatch_s),
            version=version,
            carries_update=bool(metrics["fits"]) and not metrics["too-slow"] and not rejected,
        )

    def _row(
        self,
        rnd: int,
        metrics: dict,
        trip: Trip,
        status: str,
        energy: float,
        idle: float,
        staleness: int,
        reason: str,
        error: str = "",
    ):
        pid = trip.partition_id
        device = self.env.devices[pid]
        profile = self.env.profile(device)
        rho, cap = self._plan.get(pid, (float("nan"), -1))
        if metrics["too-slow"]:
            status = "too_slow"
        elif not metrics["fits"]:
            status = "not_fitting"
        counted = status == "counted"
        return {
            "round": rnd,
            "partition_id": pid,
            "device": device,
            "device_class": profile.device_class,
            "strategy": self.sc.train.strategy,
            "fits": bool(metrics["fits"]),
            "num_examples": int(metrics["num-examples"]),
            "steps": int(metrics["steps"]),
            "selections": int(metrics["selections"]),
            "train_loss": metrics["train-loss"],
            "fraction_params_trained": metrics["fraction-params-trained"],
            "emulated_train_time_s": trip.train_s,
            "emulated_train_time_band_s": metrics["emulated-train-time-band-s"],
            "emulated_overhead_time_s": metrics["emulated-overhead-time-s"],
            "emulated_probe_time_s": metrics["emulated-probe-time-s"],
            "probes": int(metrics["probes"]),
            "emulated_comm_time_s": trip.down_s + trip.up_s,
            "emulated_energy_j": energy,
            "emulated_idle_energy_j": idle,
            "emulated_peak_memory_bytes": metrics["emulated-peak-memory-bytes"],
            "emulated_probe_peak_memory_bytes": metrics["emulated-probe-peak-memory-bytes"],
            "device_memory_bytes": profile.memory_train_bytes.value,
            "emulated_bytes_up": metrics["emulated-bytes-up"],
            "emulated_bytes_down": metrics["emulated-bytes-down"],
            "emulated_macs": metrics["emulated-macs"],
            "host_wall_s": metrics["host-wall-s"],
            "policy": self.policy,
            "status": status,
            "counted": counted,
            "rho": rho,
            "step_cap": cap,
            "model_version": trip.version,
            "staleness": staleness,
            "dispatch_s": trip.dispatch_s,
            "start_s": trip.start_s,
            "finish_s": trip.finish_s,
            "arrival_s": trip.arrival_s if trip.completes else float("nan"),
            "wasted_energy_j": 0.0 if counted else energy,
            "uplink_bit_per_s": self.fleet.up_bps[pid],
            "downlink_bit_per_s": self.fleet.down_bps[pid],
            "battery_fraction": self.fleet.battery_fraction(pid, trip.dispatch_s),
            "fits_reason": reason,
            "error": error,
        }

    def _failed_row(self, rnd: int, pid: int, reason: str) -> dict:
        """A failed client is a row too: nothing is silently dropped."""
        log(WARNING, "client %s failed: %s", pid, reason)
        device = self.env.devices[pid] if pid >= 0 else ""
        return {
            "round": rnd,
            "partition_id": pid,
            "device": device,
            "device_class": self.env.profile(device).device_class if device else "",
            "strategy": self.sc.train.strategy,
            "fits": False,
            **dict.fromkeys(_CLIENT_FIGURES, float("nan")),
            "policy": self.policy,
            "status": "failed",
            "counted": False,
            **dict.fromkeys(_CLOCK_FIGURES, float("nan")),
            "fits_reason": "",
            "error": reason,
        }

    def _failures(
        self, replies: list[Message], sampled: list[int]
    ) -> tuple[list[tuple[Message, dict[str, np.ndarray]]], dict[int, str], dict[int, str]]:
        """Replies that can be used, each with its arrays (read-only views); partition -> reason for
        the failures (errors, no reply); partition -> reason for the rejected replies (NaN/inf),
        which are in the first list too: their clients trained, and are charged for it."""
        failures = {
            self.partition_of_node.get(m.metadata.src_node_id, -1): m.error.reason for m in replies if m.has_error()
        }
        ok, rejected = [], {}
        answered = [m for m in replies if not m.has_error()]
        decoded = [record_to_numpy(m.content["arrays"], copy=False) for m in answered]  # once: checked, then averaged
        for m, arrays, nonfinite in zip(answered, decoded, nonfinite_tensors(decoded)):
            bad = nonfinite_update(m, arrays, nonfinite)  # a NaN/inf update is rejected and recorded with its client
            if bad:
                rejected[int(m.content["metrics"]["partition-id"])] = bad
            ok.append((m, arrays))
        replied = {self.partition_of_node.get(m.metadata.src_node_id, -1) for m in replies}
        for p in sampled:  # no reply within the round's timeout: a row, not a gap
            if p not in replied:
                failures[p] = timeout_reason(self.sc.simulation.timeout_s)
        return ok, failures, rejected

    def _update(self, m: Message, arrays: dict[str, np.ndarray]) -> ClientUpdate:
        return ClientUpdate(
            float(m.content["metrics"]["num-examples"]), arrays, record_to_numpy(m.content["masks"], copy=False)
        )

    @staticmethod
    def _metrics(m: Message) -> dict:
        """The reply's figures the server uses (METRIC_KEYS), as a plain dict."""
        every = dict(m.content["metrics"].items())
        return {k: every[k] for k in METRIC_KEYS}

    def _summary(self, rows: list[dict], failed: int, start_s: float, end_s: float) -> dict:
        fitted = [r for r in rows if r["fits"] and r["status"] != "too_slow"]
        status = [r["status"] for r in rows]
        counted = [r for r in rows if r["counted"]]
        idle = [r for r in fitted if r["steps"] == 0 and r["status"] == COUNTED]  # counted, yet trained nothing
        if idle and not self._warned_no_steps:
            self._warned_no_steps = True
            first = idle[0]
            log(
                WARNING,
                "%d client(s) in round %d trained nothing (0 steps), e.g. partition %d on %s: %s; "
                "they count as 'trained nothing', not as trained (warned once per run)",
                len(idle), first["round"], first["partition_id"], first["device"],
                first["fits_reason"] or "no trainable step fits its budget",
            )  # fmt: skip
        losses = [r["train_loss"] for r in fitted if r["steps"] and r["status"] != REJECTED]
        return {
            "clients": len(rows) + failed,
            "clients_failed": failed,
            "clients_unavailable": self._unavailable,
            "clients_not_fitting": status.count("not_fitting"),
            "clients_rejected": status.count(REJECTED),
            "clients_no_steps": len(idle),
            "round_time_s": float(end_s - start_s),  # plain floats, as round 0's (one Parquet schema)
            "mean_train_loss": float(np.nanmean(losses)) if losses else float("nan"),
            "round_energy_j": float(sum(r["emulated_energy_j"] + r["emulated_idle_energy_j"] for r in rows)),
            "max_peak_memory_bytes": float(max((r["emulated_peak_memory_bytes"] for r in rows), default=0.0)),
            "policy": self.policy,
            "round_start_s": start_s,
            "deadline_s": float(self._deadline) if self._deadline is not None else float("nan"),
            "clients_counted": len(counted),
            "clients_late": status.count("late") + status.count("extra"),
            "clients_offline": status.count("offline"),
            "clients_too_slow": status.count("too_slow"),
            "mean_staleness": float(np.mean([r["staleness"] for r in counted])) if counted else float("nan"),
            "wasted_energy_j": float(sum(r["wasted_energy_j"] for r in rows)),
        }

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = sorted(replies, key=lambda m: self.partition_of_node.get(m.metadata.src_node_id, -1))
        ok, failures, rejected = self._failures(replies, getattr(self, "_sampled", []))
        metrics = [self._metrics(m) for m, _ in ok]
        start = self.sim_time_s
        trips = [self._trip(r, start, server_round - 1, int(r["partition-id"]) in rejected) for r in metrics]
        deadline = self._deadline if self.policy != "wait_all" else None
        keep = (self.sc.server.clients_per_round or self.sc.num_clients) if self.policy == "overcommit" else None
        end, status = sync_round(trips, start, deadline, keep)
        rows = []
        for (m, _), r, trip in zip(ok, metrics, trips):
            state, bad = status[trip.partition_id], rejected.get(trip.partition_id, "")
            cost = self.fleet.cost(trip.partition_id)
            # a late or surplus client is told to stop when the round closes (a rejected one too)
            energy = trip_energy_j(cost, trip, end if state in (LATE, EXTRA) or bad else math.inf, r)
            waited = end - trip.arrival_s if trip.completes and trip.arrival_s <= end else 0.0
            idle = cost.device.power_idle_w.value * waited
            if bad and state == NO_UPDATE:  # it arrived (a late one is not looked at: it is 'late')
                state = LATE if trip.arrival_s > end else REJECTED
            error = bad if state == REJECTED else ""
            rows.append(self._row(server_round, r, trip, state, energy, idle, 0, _fits_reason(m), error))
            self.fleet.drain(trip.partition_id, end, energy + idle)
        self.recorder.add_clients(
            rows + [self._failed_row(server_round, p, why) for p, why in sorted(failures.items())]
        )
        assert self._arrays is not None
        current = record_to_numpy(self._arrays)
        counted = [(m, arrays, row) for (m, arrays), row in zip(ok, rows) if row["counted"]]
        updates = [self._update(m, arrays) for m, arrays, _ in counted]
        if self.sc.server.fednova and (self.policy == "deadline_fewer_steps" or self.sc.server.min_rho > 0):
            updates = fednova_rescale(
                current, updates, [row["steps"] for _, _, row in counted], set(self.env.info.tensor_names)
            )
        new_state = aggregate_partial(current, updates)
        self._norm = weight_norm(new_state, self._params)
        self.sim_time_s = float(end)  # plain floats: the checkpoint keeps them (torch weights_only load)
        self._round = self._summary(rows, len(failures), start, end)
        self.total_energy_j += float(self._round["round_energy_j"])
        return record_from_numpy(new_state), MetricRecord({"round-time-s": end - start})

    def _divergence(self, server_round: int, arrays: ArrayRecord, test_loss: float, predicted, actual) -> str:
        """Why the round shows divergence ('' if not): the detector fed the round's figures (see divergence.py)."""
        if server_round == 0 or self._norm is None:
            self._norm = weight_norm(record_to_numpy(arrays, copy=False), self._params)
        if predicted is not None and not self.detector.classes:
            self.detector.classes = len(predicted)  # the loss floor ln(classes)
        r = self._round
        trained = r["clients_counted"] + r["clients_rejected"]
        # the mean over the updates used (NaN: none trained a step; a client's non-finite loss is a rejection)
        loss = r["mean_train_loss"] if server_round and not math.isnan(r["mean_train_loss"]) else None
        reason = self.detector.observe(
            server_round,
            train_loss=loss,
            test_loss=test_loss if server_round == 0 else None,
            norm=self._norm,
            trained=trained,
            rejected=r["clients_rejected"],
            predicted=predicted,
            actual=actual,
        )
        self._norm = None
        if reason:
            log(WARNING, "round %d diverged: %s", server_round, reason)
        return reason

    # ---- asynchronous aggregation (FedBuff) -------------------------------------------------
    def run_buffered(self, grid: Grid, initial_arrays: ArrayRecord, timeout: float) -> None:
        """FedBuff on the clock: up to ``concurrency`` clients in flight, an aggregation every ``buffer_size`` arrivals."""
        sc, n = self.sc, self.sc.num_clients
        concurrency = sc.server.concurrency or sc.server.clients_per_round or n
        buffer_size = sc.server.buffer_size or max(1, concurrency // 2)
        rng = np.random.default_rng([sc.seed, 0xA5])
        self.evaluate(0, initial_arrays)
        states = {0: record_to_numpy(initial_arrays)}
        version, last_t, dispatched = 0, 0.0, 0
        replies: dict[Trip, tuple[dict, Message, dict[str, np.ndarray], str]] = {}  # str: why it was rejected
        pending: list[dict] = []  # rows since the last aggregation
        failures = 0

        def pick(t: float, busy: frozenset[int], free: int) -> tuple[list[int], float]:
            self.fleet.forget_before(t)
            idle = [p for p in range(n) if p not in busy]
            ready = [p for p in idle if self.fleet.online(p, t) and self.fleet.charged(p, t)]
            later = min((self.fleet.ready_at(p, t) for p in idle if p not in ready), default=math.inf)
            if self.fleet.windows is None:  # the profile's probability, drawn per dispatch; re-drawn a minute later
                draws = rng.random(len(idle))
                drawn = {p for p, d in zip(idle, draws) if d < self.fleet.probability[p]}
                if any(p not in drawn for p in ready):
                    later = min(later, t + 60.0)
                ready = [p for p in ready if p in drawn]
            self._unavailable = n - len(busy) - len(ready)
            if len(ready) > free:
                ready = sorted(rng.choice(ready, size=free, replace=False).tolist())
            return ready, later

        def launch(ids: list[int], t: float, v: int) -> list[Trip]:
            nonlocal dispatched, failures
            arrays = record_from_numpy(states[v])
            messages = []
            for p in ids:
                dispatched += 1  # a unique training seed per dispatch
                cfg = ConfigRecord({"server-round": dispatched, "model-version": v})
                messages.append(
                    Message(
                        content=RecordDict({"arrays": arrays, "config": cfg}),
                        message_type=MessageType.TRAIN,
                        dst_node_id=self.node_of_partition[p],
                    )
                )
            trips = []  # earlier aggregations' writes are handed over as these messages leave (on_sent)
            got = sorted(
                grid.send_and_receive(messages, timeout=timeout),
                key=lambda m: self.partition_of_node.get(m.metadata.src_node_id, -1),
            )
            ok, failed, rejected = self._failures(got, ids)
            for p, why in sorted(failed.items()):
                failures += 1
                if failures > 10 * n + sc.server.rounds * buffer_size:
                    raise RuntimeError("asynchronous run: clients keep failing")
                pending.append(self._failed_row(version + 1, p, why))
            for m, arrays in ok:
                r = self._metrics(m)
                bad = rejected.get(int(r["partition-id"]), "")
                trip = self._trip(r, t, v, bool(bad))
                replies[trip] = (r, m, arrays, bad)
                trips.append(trip)
            return trips

        def discard(trip: Trip, t: float, why: str) -> None:
            r, m, _, bad = replies.pop(trip)
            energy = trip_energy_j(self.fleet.cost(trip.partition_id), trip, t, r)
            why = REJECTED if bad and why == NO_UPDATE else why  # it arrived; a cancelled one was never looked at
            error = bad if why == REJECTED else ""
            row = self._row(version + 1, r, trip, why, energy, 0.0, version - trip.version, _fits_reason(m), error)
            pending.append(row)
            self.fleet.drain(trip.partition_id, t, energy)

        def aggregate(v: int, t: float, buffer: list[Arrival]) -> None:
            nonlocal version, last_t
            rows, updates, bases, discounts = [], [], [], []
            for a in buffer:
                r, m, arrays, _ = replies.pop(a.trip)
                energy = trip_energy_j(self.fleet.cost(a.trip.partition_id), a.trip, math.inf, r)
                rows.append(self._row(v, r, a.trip, COUNTED, energy, 0.0, a.staleness, _fits_reason(m)))
                self.fleet.drain(a.trip.partition_id, a.trip.arrival_s, energy)
                updates.append(self._update(m, arrays))
                bases.append(states[a.trip.version])
                discounts.append(staleness_weight(a.staleness) if sc.server.staleness == "inverse_sqrt" else 1.0)
            states[v] = aggregate_buffered(states[version], updates, bases, discounts)
            self._norm = weight_norm(states[v], self._params)
            in_use = {trip.version for trip in replies} | {v}
            for old in [k for k in states if k not in in_use]:
                del states[old]
            rows = pending + rows
            self.recorder.add_clients(rows)
            pending.clear()
            self._deadline = None
            failed = sum(r["status"] == "failed" for r in rows)
            self._round = self._summary([r for r in rows if r["status"] != "failed"], failed, last_t, t)
            self.total_energy_j += float(self._round["round_energy_j"])
            self.sim_time_s, last_t, version = float(t), t, v
            self.evaluate(v, record_from_numpy(states[v]))
            self._round_start = time.perf_counter()

        end = run_async(
            concurrency=concurrency,
            buffer_size=buffer_size,
            aggregations=sc.server.rounds,
            pick=pick,
            launch=launch,
            aggregate=aggregate,
            discard=discard,
        )
        if pending:  # updates still in flight or buffered at the end: their work so far is wasted
            for row in pending:
                row["round"] = version
            self.recorder.add_clients(pending)
            self.total_energy_j += float(sum(r["emulated_energy_j"] for r in pending if r["status"] != "failed"))
        assert end == self.sim_time_s

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # the server evaluates centrally

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def evaluates(self, server_round: int) -> bool:
        """Whether the global model is evaluated after ``server_round`` (``server.evaluate_every``; 0 and the last always)."""
        server = self.sc.server
        return server_round % server.evaluate_every == 0 or server_round >= server.rounds

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """:meth:`_evaluate` on ``simulation.torch_threads`` threads, as the clients train."""
        with torch_threads(self.sc.simulation.torch_threads):
            return self._evaluate(server_round, arrays)

    def _evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Global test accuracy after the round (see :meth:`evaluates`; NaN if skipped); writes the round's row."""
        accuracy = loss = float("nan")
        val = dict.fromkeys(("val_accuracy", "val_loss"), float("nan")) if self.sc.data.validation > 0 else {}
        evaluated = self.evaluates(server_round)
        predicted = actual = None  # test predictions and labels per class (a stream's: over the seen tasks)
        if evaluated:
            model = self.env.new_model()
            model.load_state_dict(record_to_torch(arrays))
            if self.env.stream is not None:  # the accuracy matrix R[t, j]; the round's accuracy: mean over seen tasks
                rows, accuracy, loss, predicted, actual = evaluate_stream(self.env, model, server_round, self.sim_time_s)
                self.recorder.add_tasks(rows)
            else:
                test = self.env.data.test
                accuracy, loss, predicted = evaluate_predictions(model, test.x, test.y)
                actual = np.bincount(test.y, minlength=len(predicted))
            if val:  # the clients' held-out share (data.validation), never the test set
                held = self.env.data.validation_set
                val["val_accuracy"], val["val_loss"] = evaluate_model(model, held.x, held.y)
        diverged = self._divergence(server_round, arrays, loss, predicted, actual)
        row = {
            "round": server_round,
            "strategy": self.sc.train.strategy,
            "sim_time_s": self.sim_time_s,
            "test_accuracy": accuracy,
            "test_loss": loss,
            **val,
            "total_energy_j": self.total_energy_j,
            **self._round,
            "host_wall_s": time.perf_counter() - self._round_start if server_round else 0.0,
            "divergence": diverged,
        }
        first = self.detector.first
        if first is not None and self.recorder.divergence is None:
            self.recorder.divergence = first.to_dict()
        self.recorder.add_round(row)
        self.progress(row)
        self.keep_state(server_round, arrays)  # its writes are handed over when the next round is sent
        if diverged and self.sc.simulation.on_divergence == "stop":
            raise Diverged(server_round, diverged)
        return MetricRecord({"accuracy": accuracy, "loss": loss}) if evaluated else None

    def keep_state(self, server_round: int, arrays: ArrayRecord) -> None:
        """What a round leaves besides its rows (:class:`~fedelastic.fl.checkpoint.Resumable`: the checkpoint)."""


def server_main(
    scenario: Scenario,
    initial_state: dict,
    recorder: Recorder,
    progress: Callable,
    grid: Grid,
    *,
    strategy_cls: Callable[..., PartialFedAvg] | None = None,
    start_round: int = 0,
) -> None:
    """The ServerApp's body: register nodes, map partitions, run the rounds (``start_round`` + 1 on).

    The results are written behind (:meth:`~fedelastic.results.Recorder.write_behind`): a round's
    rows and checkpoint are written while a later round trains (the rounds of the last
    ``simulation.write_every_s`` seconds together); all of them are written when this returns or
    raises.
    """
    env = environment(scenario)
    timeout = scenario.simulation.timeout_s
    nodes = wait_for_nodes(grid, scenario.num_clients, timeout)
    mapping = discover_partitions(grid, nodes, max(timeout, 300.0))  # includes the workers' start-up
    strategy = (strategy_cls or PartialFedAvg)(env, mapping, recorder, progress)
    recorder.write_behind(scenario.simulation.write_every_s)
    freeze_heap()  # the run is set up: full collections walk only what the rounds make
    try:
        if scenario.server.policy == "async":
            if start_round:
                raise RunFailed("an asynchronous (policy = 'async') run cannot be resumed; start it again")
            strategy.run_buffered(grid, ArrayRecord(torch_state_dict=initial_state), timeout)
        else:
            strategy.start(
                grid=grid,
                initial_arrays=ArrayRecord(torch_state_dict=initial_state),
                num_rounds=scenario.server.rounds - start_round,
                timeout=timeout,
                evaluate_fn=strategy.evaluate,
            )
    except (StopRun, Diverged):  # a normal end: the finished rounds reach disk, and a failed write fails the run
        recorder.flush()
        raise
    except BaseException as exc:
        recorder.flush_quietly(exc)  # the finished rounds reach disk; the run's error is this one
        raise
    finally:
        gc.unfreeze()
    recorder.flush()
    if scenario.stream is not None:
        continual_report(recorder.folder, scenario.stream.recover_share)


def make_server_app(scenario: Scenario, initial_state: dict, recorder: Recorder, progress: Callable) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        server_main(scenario, initial_state, recorder, progress, grid)

    return app
