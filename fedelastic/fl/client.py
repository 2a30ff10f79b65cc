"""The Flower ClientApp: one emulated device trains locally and reports its figures."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from ..quant import device_numerics
from ..scenario import Scenario
from ..training import LocalResult, train_local
from .arrays import record_from_numpy, record_to_numpy, record_to_torch
from .env import RunEnvironment, environment

# Every reply carries exactly these metric keys (Flower aborts on keys that differ between clients).
METRIC_KEYS = (
    "num-examples",
    "partition-id",
    "fits",
    "steps",
    "selections",
    "train-loss",
    "fraction-params-trained",
    "emulated-train-time-s",
    "emulated-train-time-band-s",
    "emulated-overhead-time-s",
    "emulated-comm-time-s",
    "emulated-energy-j",
    "emulated-peak-memory-bytes",
    "emulated-probe-peak-memory-bytes",
    "emulated-bytes-up",
    "emulated-bytes-down",
    "emulated-macs",
    "host-wall-s",
    "too-slow",
)


def _partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def train_partition(
    env: RunEnvironment, model, strategy, pid: int, server_round: int, max_steps: int | None = None
) -> LocalResult:
    """One round of local training of partition ``pid``, seeded by (seed, round, partition).

    ``max_steps`` (from a deadline) caps the steps below the scenario's own cap.
    """
    t = env.scenario.train
    cap = t.max_steps if max_steps is None else min(max_steps, t.max_steps or max_steps)
    return train_local(
        model,
        env.info,
        strategy,
        env.cost(env.devices[pid]),
        env.client_data(pid, server_round),
        epochs=t.local_epochs,
        batch_size=t.batch_size,
        lr=t.lr,
        momentum=t.momentum,
        weight_decay=t.weight_decay,
        max_steps=cap,
        seed=[env.scenario.seed, server_round, pid],
        numerics=device_numerics(t, env.profile(env.devices[pid]).train_dtype),
        bn_mode=env.bn_mode,
        optimizer=t.optimizer,
        lr_schedule=t.lr_schedule,
    )


def client_train(scenario: Scenario, msg: Message, context: Context) -> Message:
    """Train on this node's partition from the global arrays in ``msg``."""
    env = environment(scenario)
    torch.set_num_threads(scenario.simulation.torch_threads)
    pid = _partition_id(context)
    config = msg.content["config"]
    server_round = int(config["server-round"])
    device = env.devices[pid]
    cost = env.cost(device)
    # a deadline policy sends this client its own rho or step cap
    rho = float(config["rho"]) if "rho" in config else None
    step_cap = int(config["max-steps"]) if "max-steps" in config else None
    if (rho is not None and (rho <= 0 or cost.backward_budget_s(rho) <= 0)) or step_cap == 0:
        return too_slow_reply(env, msg, pid)
    model = env.client_model
    model.load_state_dict(record_to_torch(msg.content["arrays"]))
    strategy = env.strategy(rho)
    if "strategy-state" in msg.content:  # a resumed run hands the node its checkpointed state
        strategy.load_state(record_to_numpy(msg.content["strategy-state"]))
    elif "strategy-state" in context.state:  # kept per node across rounds (e.g. static_elastic)
        strategy.load_state(record_to_numpy(context.state["strategy-state"]))
    result = train_partition(env, model, strategy, pid, server_round, step_cap)
    context.state["strategy-state"] = record_from_numpy(strategy.state())
    ratios = result.ratios if result.ratios is not None else np.zeros(env.info.num_tensors)
    figures = cost.round_figures(result.train_time_s, result.macs, ratios, result.peak_memory_bytes)
    if scenario.stream is not None and not scenario.stream.federated:  # a fleet of one: nothing is sent
        energy = cost.energy_j(result.train_time_s, 0.0, 0.0, result.macs, 0.0)
        figures = replace(figures, comm_time_s=0.0, energy_j=energy, bytes_up=0.0, bytes_down=0.0)
    trained_params = float((ratios * env.info.tensor_numel).sum() / env.info.num_params)
    metrics = {
        "num-examples": result.num_examples,
        "partition-id": pid,
        "fits": int(result.fits),
        "steps": result.steps,
        "selections": result.selections,
        "train-loss": result.train_loss,
        "fraction-params-trained": trained_params,
        "emulated-train-time-s": figures.train_time_s,
        "emulated-train-time-band-s": cost.time_band_s(figures.train_time_s),
        "emulated-overhead-time-s": result.overhead_time_s,
        "emulated-comm-time-s": figures.comm_time_s,
        "emulated-energy-j": figures.energy_j,
        "emulated-peak-memory-bytes": figures.peak_memory_bytes,
        "emulated-probe-peak-memory-bytes": result.probe_peak_memory_bytes,
        "emulated-bytes-up": figures.bytes_up,
        "emulated-bytes-down": figures.bytes_down,
        "emulated-macs": figures.macs,
        "host-wall-s": result.host_wall_s,
        "too-slow": 0,
    }
    content = RecordDict(
        {
            "arrays": record_from_numpy(result.trained),
            "masks": record_from_numpy(result.channel_masks),
            "metrics": MetricRecord({k: metrics[k] for k in METRIC_KEYS}),
            "strategy-state": context.state["strategy-state"],  # the server checkpoints it (resume)
            "info": ConfigRecord({"fits-reason": result.reason}),  # why fits is 0 (empty when it fits)
        }
    )
    return Message(content=content, reply_to=msg)


def too_slow_reply(env: RunEnvironment, msg: Message, pid: int) -> Message:
    """The deadline leaves this device no time for even a forward pass: it says so and sends no update."""
    cost = env.cost(env.devices[pid])
    nothing = np.zeros(env.info.num_tensors)
    figures = cost.round_figures(0.0, 0.0, nothing, 0.0)
    metrics = dict.fromkeys(METRIC_KEYS, 0.0)
    metrics.update(
        {
            "num-examples": len(env.data.client(pid)),
            "partition-id": pid,
            "fits": 1,
            "train-loss": float("nan"),
            "emulated-comm-time-s": figures.comm_time_s,
            "emulated-energy-j": figures.energy_j,
            "emulated-bytes-down": figures.bytes_down,
            "too-slow": 1,
        }
    )
    content = RecordDict(
        {
            "arrays": record_from_numpy({}),
            "masks": record_from_numpy({}),
            "metrics": MetricRecord({k: metrics[k] for k in METRIC_KEYS}),
        }
    )
    return Message(content=content, reply_to=msg)


def check_same_code() -> None:
    """A Ray worker must run the fedelastic the driver runs (the runner exports its folder as FEDELASTIC_ROOT)."""
    import fedelastic

    expected = os.environ.get("FEDELASTIC_ROOT")
    here = str(Path(fedelastic.__file__).resolve().parent.parent)
    if expected and here != expected:
        raise RuntimeError(
            f"this worker imported fedelastic from {here}, the driver runs it from {expected}; "
            "run from a folder that holds no other copy of fedelastic"
        )


def make_client_app(scenario: Scenario) -> ClientApp:
    """A ClientApp bound to ``scenario`` (the scenario is small; data is rebuilt per process)."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        check_same_code()
        return Message(
            content=RecordDict({"metrics": MetricRecord({"partition-id": _partition_id(context)})}), reply_to=msg
        )

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return client_train(scenario, msg, context)

    return app
