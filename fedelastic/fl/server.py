"""The server side: a FedAvg subclass that averages partial updates and keeps a simulated clock.

* Sampling is reproducible: nodes are sorted by partition id (asked once with a query message)
  and sampled with the run's own seeded RNG; replies are sorted by partition id.
* Aggregation averages each element only over the clients that trained it
  (:func:`~fedelastic.fl.aggregate.aggregate_partial`).
* The simulated clock is synchronous: a round lasts as long as its slowest client's emulated
  train time plus communication time. Faster clients idle, and their idle energy is counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from logging import WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from ..continual import evaluate_tasks
from ..continual import report as continual_report
from ..errors import RunFailed
from ..results import Recorder
from ..scenario import Scenario
from ..training import evaluate_model
from .aggregate import ClientUpdate, aggregate_partial
from .arrays import record_from_numpy, record_to_numpy, record_to_torch
from .client import METRIC_KEYS
from .env import RunEnvironment, environment


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


def discover_partitions(grid: Grid, nodes: list[int], timeout_s: float) -> dict[int, int]:
    """Ask every node its partition id; returns partition id -> node id."""
    messages = [Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=n) for n in nodes]
    mapping = {}
    for reply in grid.send_and_receive(messages, timeout=timeout_s):
        if reply.has_error():
            raise RuntimeError(f"node {reply.metadata.src_node_id} failed the partition query: {reply.error.reason}")
        mapping[int(reply.content["metrics"]["partition-id"])] = reply.metadata.src_node_id
    if len(mapping) != len(nodes):
        raise RuntimeError(f"{len(mapping)} of {len(nodes)} nodes answered the partition query")
    return mapping


def nonfinite_update(reply: Message) -> str:
    """'' if a client's reply is finite, else why it is rejected (first NaN/inf tensor or figure)."""
    loss = float(reply.content["metrics"]["train-loss"])
    for name, value in record_to_numpy(reply.content["arrays"]).items():
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            return f"non-finite update: tensor {name!r} holds NaN/inf (train loss {loss:g}); update rejected"
    if reply.content["metrics"]["fits"] and int(reply.content["metrics"]["steps"]) and not np.isfinite(loss):
        return f"non-finite update: train loss is {loss:g}; update rejected"
    return ""


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

_ROUND_KEYS = (
    "clients",
    "clients_failed",
    "clients_unavailable",
    "clients_not_fitting",
    "clients_no_steps",
    "round_time_s",
    "mean_train_loss",
    "round_energy_j",
    "max_peak_memory_bytes",
)


class PartialFedAvg(FedAvg):
    """FedAvg over partial updates, with reproducible sampling and a simulated synchronous clock."""

    def __init__(self, env: RunEnvironment, node_of_partition: dict[int, int], recorder: Recorder, progress: Callable):
        super().__init__(min_available_nodes=len(node_of_partition))  # evaluation is central: see configure_evaluate
        self.env, self.sc = env, env.scenario
        self.node_of_partition = node_of_partition
        self.partition_of_node = {n: p for p, n in node_of_partition.items()}
        self.recorder, self.progress = recorder, progress
        self.sim_time_s = 0.0
        self.total_energy_j = 0.0
        self._arrays: ArrayRecord | None = None
        self._round: dict = dict.fromkeys(_ROUND_KEYS, 0)  # round 0: the initial model
        self._round_start = time.perf_counter()
        self._unavailable = 0
        self._warned_no_steps = False
        self._availability = [
            a.value if (a := env.profile(device).availability) is not None else 1.0 for device in env.devices
        ]

    def sample(self, server_round: int) -> list[int]:
        """Partition ids trained in ``server_round``: available devices, then a seeded sample of them.

        A device whose profile declares ``availability.probability = p`` is reachable in a round
        with probability p (a seeded draw per round and partition).
        """
        rng = np.random.default_rng([self.sc.seed, server_round, 0x5A])
        draws = rng.random(self.sc.num_clients)
        available = [p for p in range(self.sc.num_clients) if draws[p] < self._availability[p]]
        self._unavailable = self.sc.num_clients - len(available)
        k = self.sc.server.clients_per_round or self.sc.num_clients
        if k >= len(available):
            return available
        return sorted(rng.choice(available, size=k, replace=False).tolist())

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._arrays, self._round_start = arrays, time.perf_counter()
        config["server-round"] = server_round
        record = RecordDict({"arrays": arrays, "config": config})
        self._sampled = self.sample(server_round)
        return [
            Message(content=record, message_type=MessageType.TRAIN, dst_node_id=self.node_of_partition[p])
            for p in self._sampled
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = sorted(replies, key=lambda m: self.partition_of_node.get(m.metadata.src_node_id, -1))
        failures = {self.partition_of_node.get(m.metadata.src_node_id, -1): m.error.reason for m in replies if m.has_error()}
        ok = []
        for m in replies:
            if m.has_error():
                continue
            bad = nonfinite_update(m)  # a NaN/inf update is rejected and recorded with its client
            if bad:
                failures[int(m.content["metrics"]["partition-id"])] = bad
            else:
                ok.append(m)
        replied = {self.partition_of_node.get(m.metadata.src_node_id, -1) for m in replies}
        for p in getattr(self, "_sampled", []):  # no reply within the round's timeout: a row, not a gap
            if p not in replied:
                failures[p] = f"timeout: no reply within simulation.timeout_s = {self.sc.simulation.timeout_s:g} s"
        for pid, reason in failures.items():
            log(WARNING, "client %s failed: %s", pid, reason)
        metrics = [{k: m.content["metrics"][k] for k in METRIC_KEYS} for m in ok]
        round_time = max((r["emulated-train-time-s"] + r["emulated-comm-time-s"] for r in metrics), default=0.0)
        reasons = [str(m.content["info"]["fits-reason"]) if "info" in m.content else "" for m in ok]
        rows = []
        for r, reason in zip(metrics, reasons):
            device = self.env.devices[int(r["partition-id"])]
            profile = self.env.profile(device)
            busy = r["emulated-train-time-s"] + r["emulated-comm-time-s"]
            idle_j = profile.power_idle_w.value * (round_time - busy)
            rows.append(
                {
                    "round": server_round,
                    "partition_id": int(r["partition-id"]),
                    "device": device,
                    "device_class": profile.device_class,
                    "strategy": self.sc.train.strategy,
                    "fits": bool(r["fits"]),
                    "num_examples": int(r["num-examples"]),
                    "steps": int(r["steps"]),
                    "selections": int(r["selections"]),
                    "train_loss": r["train-loss"],
                    "fraction_params_trained": r["fraction-params-trained"],
                    "emulated_train_time_s": r["emulated-train-time-s"],
                    "emulated_train_time_band_s": r["emulated-train-time-band-s"],
                    "emulated_overhead_time_s": r["emulated-overhead-time-s"],
                    "emulated_comm_time_s": r["emulated-comm-time-s"],
                    "emulated_energy_j": r["emulated-energy-j"],
                    "emulated_idle_energy_j": idle_j,
                    "emulated_peak_memory_bytes": r["emulated-peak-memory-bytes"],
                    "emulated_probe_peak_memory_bytes": r["emulated-probe-peak-memory-bytes"],
                    "device_memory_bytes": profile.memory_train_bytes.value,
                    "emulated_bytes_up": r["emulated-bytes-up"],
                    "emulated_bytes_down": r["emulated-bytes-down"],
                    "emulated_macs": r["emulated-macs"],
                    "host_wall_s": r["host-wall-s"],
                    "fits_reason": reason,
                    "error": "",
                }
            )
        failed_rows = []
        for pid, reason in sorted(failures.items()):  # a failed client is a row too: nothing is silently dropped
            device = self.env.devices[pid] if pid >= 0 else ""
            failed_rows.append(
                {
                    "round": server_round,
                    "partition_id": pid,
                    "device": device,
                    "device_class": self.env.profile(device).device_class if device else "",
                    "strategy": self.sc.train.strategy,
                    "fits": False,
                    **dict.fromkeys(_CLIENT_FIGURES, float("nan")),
                    "fits_reason": "",
                    "error": reason,
                }
            )
        self.recorder.add_clients(rows + failed_rows)
        assert self._arrays is not None
        current = record_to_numpy(self._arrays)
        updates = [
            ClientUpdate(
                float(m.content["metrics"]["num-examples"]),
                record_to_numpy(m.content["arrays"]),
                record_to_numpy(m.content["masks"]),
            )
            for m, r in zip(ok, metrics)
            if r["fits"]
        ]
        new_state = aggregate_partial(current, updates)
        for name, value in new_state.items():
            if not np.isfinite(value).all():
                raise RunFailed(
                    f"round {server_round}: the global model became non-finite (tensor {name!r}); "
                    "lower train.lr or check the model and its starting weights"
                )
        self.sim_time_s += round_time
        energy = sum(r["emulated_energy_j"] + r["emulated_idle_energy_j"] for r in rows)
        self.total_energy_j += energy
        fitted = [r for r in rows if r["fits"]]
        idle = [r for r in fitted if r["steps"] == 0]  # fits, yet trained nothing: counted apart, warned once
        if idle and not self._warned_no_steps:
            self._warned_no_steps = True
            first = idle[0]
            why = first["fits_reason"] or "no trainable step fits its budget"
            log(
                WARNING,
                "%d client(s) in round %d trained nothing (0 steps), e.g. partition %d on %s: %s; "
                "they count as 'trained nothing', not as trained (warned once per run)",
                len(idle), server_round, first["partition_id"], first["device"], why,
            )  # fmt: skip
        self._round = {
            "clients": len(replied | set(failures)),
            "clients_failed": len(failures),
            "clients_unavailable": self._unavailable,
            "clients_not_fitting": len(rows) - len(fitted),
            "clients_no_steps": len(idle),
            "round_time_s": round_time,
            "mean_train_loss": float(np.nanmean(losses)) if (losses := [r["train_loss"] for r in fitted if r["steps"]]) else float("nan"),
            "round_energy_j": energy,
            "max_peak_memory_bytes": max((r["emulated_peak_memory_bytes"] for r in rows), default=0.0),
        }
        arrays = record_from_numpy(new_state)
        return arrays, MetricRecord({"round-time-s": round_time})

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # the server evaluates centrally

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        """Global test accuracy after every round; writes the round's row."""
        model = self.env.new_model()
        model.load_state_dict(record_to_torch(arrays))
        if self.env.stream is not None:  # the accuracy matrix R[t, j]; the round's accuracy: mean over seen tasks
            rows, accuracy, loss = evaluate_tasks(self.env, model, server_round, self.sim_time_s)
            self.recorder.add_tasks(rows)
        else:
            test = self.env.data.test
            accuracy, loss = evaluate_model(model, test.x, test.y)
        row = {
            "round": server_round,
            "strategy": self.sc.train.strategy,
            "sim_time_s": self.sim_time_s,
            "test_accuracy": accuracy,
            "test_loss": loss,
            "total_energy_j": self.total_energy_j,
            **self._round,
            "host_wall_s": time.perf_counter() - self._round_start if server_round else 0.0,
        }
        self.recorder.add_round(row)
        self.progress(row)
        return MetricRecord({"accuracy": accuracy, "loss": loss})


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
    """The ServerApp's body: register nodes, map partitions, run the rounds (``start_round`` + 1 on)."""
    env = environment(scenario)
    timeout = scenario.simulation.timeout_s
    nodes = wait_for_nodes(grid, scenario.num_clients, timeout)
    mapping = discover_partitions(grid, nodes, max(timeout, 300.0))  # includes the workers' start-up
    strategy = (strategy_cls or PartialFedAvg)(env, mapping, recorder, progress)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(torch_state_dict=initial_state),
        num_rounds=scenario.server.rounds - start_round,
        timeout=timeout,
        evaluate_fn=strategy.evaluate,
    )
    if scenario.stream is not None:
        continual_report(recorder.folder, scenario.stream.recover_share)


def make_server_app(scenario: Scenario, initial_state: dict, recorder: Recorder, progress: Callable) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        server_main(scenario, initial_state, recorder, progress, grid)

    return app
