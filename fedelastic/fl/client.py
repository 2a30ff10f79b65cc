"""One emulated client's round: it trains locally and reports what it measured or emulated (the
ClientApp that calls this is :mod:`fedelastic.fl.clientapp`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from ..cost.costmodel import CostModel
from ..environment import RunEnvironment, environment
from ..scenario import Scenario
from ..sim.aggregators import proximal_mu
from ..sim.records import METRIC_KEYS
from ..train.quant import device_numerics
from ..train.trainer import CohortJob, LocalResult, LocalTraining, Prepared, train_local
from .arrays import config_record, metric_record, record_dict, record_from_numpy, record_to_numpy, record_to_torch


def _partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def train_partition(
    env: RunEnvironment,
    model,
    strategy,
    pid: int,
    server_round: int,
    max_steps: int | None = None,
    prepared: Prepared | None = None,
) -> LocalResult:
    """One round of local training of partition ``pid``, seeded by (seed, round, partition).

    ``max_steps`` (from a deadline) caps the steps below the scenario's own cap; ``prepared``:
    the model's :class:`~fedelastic.train.trainer.Prepared`, shared by the clients of a cohort.
    """
    t = env.scenario.train
    return train_local(
        model,
        env.info,
        strategy,
        env.cost(env.devices[pid]),
        env.client_data(pid, server_round),
        LocalTraining.of(t, env.bn_mode, max_steps, proximal_mu(env.scenario)),
        seed=[env.scenario.seed, server_round, pid],
        numerics=device_numerics(t, env.profile(env.devices[pid]).train_dtype),
        prepared=prepared,
    )


# modules whose state-dict loading is a plain copy into each tensor (BatchNorm's only adds a
# missing num_batches_tracked, which weights_loader requires to be present)
_PLAIN_LOADS = (torch.nn.Module._load_from_state_dict, torch.nn.modules.batchnorm._NormBase._load_from_state_dict)


def weights_loader(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> Callable[[], None]:
    """A function that loads ``weights`` into ``model``: what ``model.load_state_dict(weights)`` does.

    ``load_state_dict`` walks every module and checks every key on every call (~0.2 ms for a
    small CNN, as long as its training step). When every module loads plainly (no load hooks,
    no custom ``_load_from_state_dict``), the keys match and the shapes agree, the returned
    function copies each tensor in place, as ``load_state_dict`` does; otherwise it is
    ``load_state_dict`` itself (which also raises its own errors).
    """
    targets = model.state_dict(keep_vars=True)
    plain = (
        list(targets) == list(weights)
        and not torch.__future__.get_swap_module_params_on_conversion()
        and all(
            type(m)._load_from_state_dict in _PLAIN_LOADS
            and not m._load_state_dict_pre_hooks
            and not m._load_state_dict_post_hooks
            for m in model.modules()
        )
        and all(targets[k].shape == weights[k].shape for k in targets)
    )
    if not plain:
        return lambda: model.load_state_dict(weights)
    pairs = [(targets[k], weights[k]) for k in targets]

    def load() -> None:
        with torch.no_grad():
            for target, value in pairs:
                target.copy_(value)

    return load


def train_cohort(
    env: RunEnvironment,
    model: torch.nn.Module,
    weights: dict[str, torch.Tensor],
    jobs: list[CohortJob],
    done: Callable[[int, LocalResult | Exception], bool] = lambda i, r: True,
) -> list[LocalResult | Exception]:
    """Train each job from ``weights``, one after another on ``model``; an exception is that job's result.

    This is the one training step of a cohort (a Flower node training many virtual clients per
    call): each job gives exactly what :func:`train_partition` gives for that client alone.
    ``done(i, result)`` is called as each job finishes (the caller's watchdog counts on it); when
    it returns False the remaining jobs are not started. The jobs share one
    :class:`~fedelastic.train.trainer.Prepared` view of ``model``. On the vectorised path (``env.training_path``) the
    jobs train together in one vectorised call (:func:`fedelastic.train.vectorized.train_partitions_vmap`),
    and ``done`` is called for each once all are trained.
    """
    out: list[LocalResult | Exception] = []
    load = weights_loader(model, weights)
    if env.training_path[0] and jobs:  # all jobs in one batched call (fedelastic/train/vectorized.py)
        from ..train.vectorized import train_partitions_vmap

        load()
        try:
            batch: list[LocalResult | Exception] = list(train_partitions_vmap(env, model, jobs))
        except Exception as exc:  # noqa: BLE001 (the cohort's failure is each of its clients' row)
            batch = [exc] * len(jobs)
        for i, result in enumerate(batch):
            out.append(result)
            if not done(i, result):
                break
        return out
    prepared = Prepared(model, env.info)
    for i, job in enumerate(jobs):
        result: LocalResult | Exception
        try:
            load()
            result = train_partition(env, model, job.strategy, job.pid, job.server_round, job.max_steps, prepared)
        except Exception as exc:  # noqa: BLE001 (a client's failure is its own row, as on its own node)
            result = exc
        out.append(result)
        if not done(i, result):
            break
    return out


def prepare_job(env: RunEnvironment, pid: int, config: ConfigRecord, state: ArrayRecord | None) -> CohortJob | None:
    """Partition ``pid``'s job from its round ``config`` and kept strategy ``state``; None if it is too slow.

    A deadline policy sends the client its own rho or step cap; a device the deadline leaves no
    time for even a forward pass is too slow and trains nothing.
    """
    cost = env.cost(env.devices[pid])
    rho = float(config["rho"]) if "rho" in config else None
    step_cap = int(config["max-steps"]) if "max-steps" in config else None
    if (rho is not None and (rho <= 0 or cost.backward_budget_s(rho) <= 0)) or step_cap == 0:
        return None
    strategy = env.strategy(rho)
    if state is not None:
        strategy.load_state(record_to_numpy(state))
    return CohortJob(pid, int(config["server-round"]), strategy, step_cap)


def round_figures(
    env: RunEnvironment, cost: CostModel, result: LocalResult, ratios: np.ndarray
) -> tuple[float, float, float]:
    """(the bytes sent up, the train time's error band, the share of parameters trained) of a result.

    All three are pure functions of the cost model and the key's numbers (``cost.device`` is a
    fixed profile), and in a round most clients of a device train alike (the same selections and
    steps: the same times, MACs and ratios), so each distinct combination is worked out once.
    The times and MACs are sums of non-negative prices from 0.0, never -0.0 (which a dict would
    take for 0.0); a NaN never matches and is worked out afresh. The cache lives on ``env``
    (keyed by cost model, train time, MACs, peak memory, ratios' dtype and bytes), so it goes
    with the run's environment.
    """
    key = (cost, result.train_time_s, result.macs, result.peak_memory_bytes, ratios.dtype.str, ratios.tobytes())
    known = env.figures.get(key)
    if known is None:
        trained = float((ratios * env.info.tensor_numel).sum() / env.info.num_params)
        known = (cost.bytes_up(ratios), cost.time_band_s(result.train_time_s), trained)
        if len(env.figures) >= 4096:
            env.figures.clear()
        env.figures[key] = known
    return known


def reply_content(env: RunEnvironment, job: CohortJob, result: LocalResult) -> RecordDict:
    """What a client sends back after training: its update, masks, figures and strategy state.

    The figures are what the client measured or emulated on its own device (train time, MACs, peak
    memory, the bytes it moved); what depends on the fleet (link times, energy, idle) the server's
    engine prices (:class:`fedelastic.sim.engine.RoundEngine`).
    """
    scenario, pid = env.scenario, job.pid
    cost = env.cost(env.devices[pid])
    ratios = result.ratios if result.ratios is not None else np.zeros(env.info.num_tensors)
    bytes_up, band, trained_params = round_figures(env, cost, result, ratios)
    bytes_down = cost.bytes_down()
    if scenario.stream is not None and not scenario.stream.federated:  # a fleet of one: nothing is sent
        bytes_up = bytes_down = 0.0
    metrics = {
        "num-examples": result.num_examples,
        "partition-id": pid,
        "fits": int(result.fits),
        "steps": result.steps,
        "selections": result.selections,
        "train-loss": result.train_loss,
        "fraction-params-trained": trained_params,
        "emulated-train-time-s": result.train_time_s,
        "emulated-train-time-band-s": band,
        "emulated-overhead-time-s": result.overhead_time_s,
        "emulated-probe-time-s": result.probe_time_s,  # included in the overhead
        "probes": result.probes,
        "emulated-peak-memory-bytes": result.peak_memory_bytes,
        "emulated-probe-peak-memory-bytes": result.probe_peak_memory_bytes,
        "emulated-bytes-up": bytes_up,
        "emulated-bytes-down": bytes_down,
        "emulated-macs": result.macs,
        # energy by phase: the steps' compute-bound seconds, the probes and selector at the full step's mix
        "emulated-compute-time-s": result.compute_time_s + cost.compute_time_s(None, result.overhead_time_s),
        "host-wall-s": result.host_wall_s,
        "too-slow": 0,
    }
    return record_dict(
        {
            "arrays": record_from_numpy(result.trained),
            "masks": record_from_numpy(result.channel_masks),
            "metrics": metric_record({k: metrics[k] for k in METRIC_KEYS}),
            "strategy-state": record_from_numpy(job.strategy.state()),  # the server checkpoints it (resume)
            "info": config_record({"fits-reason": result.reason}),  # why fits is 0, or why it ran 0 steps
        }
    )


def client_train(scenario: Scenario, msg: Message, context: Context) -> Message:
    """Train on this node's partition from the global arrays in ``msg`` (one virtual client per node)."""
    env = environment(scenario)
    torch.set_num_threads(scenario.simulation.torch_threads)
    pid = _partition_id(context)
    if "strategy-state" in msg.content:  # a resumed run hands the node its checkpointed state
        state = msg.content["strategy-state"]
    elif "strategy-state" in context.state:  # kept per node across rounds (e.g. static_elastic)
        state = context.state["strategy-state"]
    else:
        state = None
    job = prepare_job(env, pid, msg.content["config"], state)
    if job is None:
        return Message(content=too_slow_content(env, pid), reply_to=msg)
    model = env.client_model
    model.load_state_dict(record_to_torch(msg.content["arrays"]))
    result = train_partition(env, model, job.strategy, pid, job.server_round, job.max_steps)
    content = reply_content(env, job, result)
    context.state["strategy-state"] = content["strategy-state"]
    return Message(content=content, reply_to=msg)


def too_slow_content(env: RunEnvironment, pid: int) -> RecordDict:
    """The deadline leaves this device no time for even a forward pass: it says so and sends no update."""
    cost = env.cost(env.devices[pid])
    metrics = dict.fromkeys(METRIC_KEYS, 0.0)
    metrics.update(
        {
            "num-examples": len(env.data.client(pid)),
            "partition-id": pid,
            "fits": 1,
            "train-loss": float("nan"),
            "emulated-bytes-down": cost.bytes_down(),
            "too-slow": 1,
        }
    )
    return RecordDict(
        {
            "arrays": record_from_numpy({}),
            "masks": record_from_numpy({}),
            "metrics": MetricRecord({k: metrics[k] for k in METRIC_KEYS}),
        }
    )
