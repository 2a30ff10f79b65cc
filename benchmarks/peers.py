"""fedelastic against its peers on one shared workload (issue 10): bare torch, pfl-research, stock Flower.

    python benchmarks/peers.py                       # 3 runs of every variant, interleaved
    python benchmarks/peers.py --runs 1 --variants bare inprocess
    python benchmarks/peers.py --busy --variants bare pfl ray inprocess   # each also beside 2 busy loops
    python benchmarks/peers.py --part scale          # the 10,000-client run: benchmarks/scale.py

The workload (``Workload``; one definition for every variant): sklearn's digits (8x8) split
80/20 and cut into 200 Dirichlet(0.5) client partitions by fedelastic's partitioner; 10 rounds of
50 clients; the cohort of each round drawn as fedelastic's server draws it (seed, round); a
6,218-parameter CNN without BatchNorm (``cnn``, initial weights from ``torch.manual_seed(seed)``);
local training: 1 epoch, batches of 16 in the order fedelastic's trainer draws for (seed, round,
client), plain SGD lr 0.05 (no momentum, no weight decay), mean cross-entropy; weighted FedAvg by
number of examples, summed in float64 in ascending client order (fedelastic's ``aggregate_partial``).

Variants, each run in a fresh subprocess, round-robin over variants for ``--runs`` rounds:

* ``bare``: the loop above in plain torch, one process.
* ``pfl``: pfl-research 0.6 (``pip install -e ".[bench]"``): its ``SimulatedBackend``, its local
  SGD loop and its sum aggregator; the users of a round are the workload's cohort (a user sampler
  that yields them), each user's data already permuted into that round's batch order. pfl's own
  ``FederatedAveraging`` averages float32 *differences* (``x + mean(x_i - x)``), which rounds
  differently from the workload's float64 mean of weights; ``ExactFedAvg`` (a FedAvg subclass,
  float64 example-weighted sums) keeps the arithmetic identical. ``pfl2``: the same with two
  worker processes (``torchrun --nproc_per_node 2``, gloo all-reduce): the two workers' sums are
  added in another order, so its weights differ from the others' in the last bits.
* ``flower``: stock Flower 1.41 on Ray: a ClientApp doing the same local training and the stock
  ``FedAvg`` strategy through ``flwr.simulation.run_simulation``, 1 CPU per virtual client. Its
  cohorts are FedAvg's own random 50 of 200 (stock sampling), so its weights differ.
* ``ray`` / ``inprocess``: fedelastic through its public API (``fedelastic.api.run``), the model
  given as a user factory (``benchmarks/peers.py:cnn``), ``train.strategy = "full"``, 200
  ``raspberry_pi_4`` devices (always available, fp32), backend ``ray`` (the default) or ``inprocess``,
  ``simulation.vectorize`` left at its default (``"auto"``: this workload takes the vectorised path,
  so its checksum differs from the bare loop's in the last bits; the run's ``training_path`` is printed).
  ``server.evaluate_every`` is the number of rounds: the central test set is evaluated on the
  initial model and after the last round only, as close as fedelastic comes to pfl and the bare
  loop, which never evaluate during the run.

On request only (``--variants``): ``pfl-stock`` (pfl's own ``FederatedAveraging`` with
``WeightByDatapoints``: how far its float32 arithmetic lands from the workload's) and
``ray-per-client`` (fedelastic on Ray with ``simulation.node_mode = "per_client"``, where the
scenario has that key: one Flower node per virtual client), ``ray-vmap`` / ``inprocess-vmap``
(``simulation.vectorize = true``: each cohort trained as one batched model with torch.func.vmap;
equal to the others to float32 rounding only, so its checksum differs), ``ray-loop`` /
``inprocess-loop`` (``vectorize = false``: the per-client loop, the bare loop's checksum).

``--busy``: every variant also runs beside 2 busy-loop processes (``while True: pass``) that the
benchmark starts before launching it and kills after, interleaved with its quiet runs; the table's
last column is the share of its quiet training-phase speed each variant keeps.

Measured per run: start-up (process launch -> round 1 starts), training-phase updates/s (500
updates / rounds 1..10) and steady updates/s (450 / rounds 2..10), process wall (launch -> exit),
peak RSS of the whole process tree (sampled every 0.2 s: Ray's daemons and actors, torchrun's
workers), CPU seconds of the tree over the training phase, the final model's SHA-256 and its max
abs difference from ``bare``, and the test accuracy. Every variant runs torch on 1 thread per
process. For fedelastic, wall-time timers around its phases say where a round goes.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # measuring.py beside this file, also when tests load this file by path
from measuring import Timers, tree_usage  # noqa: E402

# the shared workload
SEED = 0
CLIENTS = 200
ROUNDS = 10
PER_ROUND = 50
ALPHA = 0.5
TEST_FRACTION = 0.2
MIN_PARTITION = 2
LR = 0.05
BATCH = 16
EPOCHS = 1
DEVICE = "raspberry_pi_4"  # fp32, no availability model: every client is always online

VARIANTS = ("bare", "pfl", "pfl2", "flower", "ray", "inprocess")
# on request only: pfl's own FederatedAveraging (float32 differences, WeightByDatapoints); fedelastic on
# Ray with one Flower node per virtual client, where the scenario has simulation.node_mode
EXTRA_VARIANTS = ("pfl-stock", "ray-per-client", "ray-vmap", "inprocess-vmap", "ray-loop", "inprocess-loop")
BUSY = 2  # --busy: busy-loop processes the benchmark starts beside a run (one per core of the 2-core host)
REFERENCE = "bare"
TORCH_OPTIM_VARIANTS = ("bare", "pfl", "pfl2", "pfl-stock", "flower")  # they train with torch.optim.SGD


class PeersCNN(nn.Sequential):
    """Three convolutions and a linear head, no BatchNorm (6,218 parameters at 8x8x1, 10 classes).

    ``loss`` and ``metrics`` are what pfl's ``PyTorchModel`` asks of a module (labels reach them as
    float32: pfl converts every array of a batch to float32).
    """

    def loss(self, x, y, eval=False):  # noqa: A002 (pfl's signature)
        return nn.functional.cross_entropy(self(x), y.long())

    def metrics(self, x, y, eval=False):  # noqa: A002
        from pfl.metrics import Weighted

        with torch.no_grad():
            out = self(x)
            loss = nn.functional.cross_entropy(out, y.long(), reduction="sum").item()
        return {"loss": Weighted(loss, len(y))}


def cnn(num_classes: int = 10, in_channels: int = 1, input_size: int = 8) -> PeersCNN:
    """The workload's model (a fedelastic user factory: ``benchmarks/peers.py:cnn``)."""
    return PeersCNN(
        nn.Conv2d(in_channels, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def initial_model() -> PeersCNN:
    torch.manual_seed(SEED)  # what fedelastic's RunEnvironment.new_model does before calling the factory
    return cnn()


class Workload:
    """Data, partitions, cohorts and batch orders of one (clients, rounds, per_round) workload."""

    def __init__(self, clients: int = CLIENTS, rounds: int = ROUNDS, per_round: int = PER_ROUND):
        from fedelastic.data import load_digits_dataset, partition, train_test_split

        self.clients, self.rounds, self.per_round = clients, rounds, per_round
        ds = load_digits_dataset()
        train_idx, test_idx = train_test_split(ds.y, TEST_FRACTION, SEED)
        self.train, self.test = ds.subset(train_idx), ds.subset(test_idx)
        self.partitions = partition(
            self.train.y, clients, "dirichlet", SEED, alpha=ALPHA, min_size=MIN_PARTITION
        )

    def cohort(self, rnd: int) -> list[int]:
        """Round ``rnd``'s clients, ascending: fedelastic's server draw (``EngineStrategy.sample``)."""
        rng = np.random.default_rng([SEED, rnd, 0x5A])
        rng.random(self.clients)  # the availability draws (all available)
        if self.per_round >= self.clients:
            return list(range(self.clients))
        return sorted(rng.choice(list(range(self.clients)), size=self.per_round, replace=False).tolist())

    def order(self, rnd: int, pid: int) -> np.ndarray:
        """Client ``pid``'s sample order in round ``rnd``: fedelastic's trainer's (seed, round, client) draw."""
        rng = np.random.default_rng([SEED, rnd, pid])
        rng.integers(2**62)  # seed_everything's torch seed
        return np.concatenate([rng.permutation(len(self.partitions[pid])) for _ in range(EPOCHS)])

    def client_arrays(self, rnd: int, pid: int) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of client ``pid`` in round ``rnd``, already in batch order."""
        part = self.partitions[pid]
        idx = part[self.order(rnd, pid)]
        return self.train.x[idx], self.train.y[idx]

    def scenario(self, backend: str, output_dir: str) -> dict:
        """The same workload as a fedelastic scenario."""
        return {
            "name": "peers",
            "seed": SEED,
            "output_dir": output_dir,
            "fleet": {DEVICE: self.clients},
            "data": {
                "dataset": "digits",
                "partitioner": "dirichlet",
                "alpha": ALPHA,
                "test_fraction": TEST_FRACTION,
                "min_partition_size": MIN_PARTITION,
            },
            "model": {"name": f"{HERE}:cnn"},
            "train": {
                "strategy": "full",
                "local_epochs": EPOCHS,
                "batch_size": BATCH,
                "lr": LR,
                "momentum": 0.0,
                "weight_decay": 0.0,
            },
            # pfl (evaluation_frequency past the last round) and the bare loop never evaluate centrally:
            # fedelastic evaluates the initial model and the last round only
            "server": {"rounds": self.rounds, "clients_per_round": self.per_round, "evaluate_every": self.rounds},
            "simulation": {"backend": backend, "torch_threads": 1},
        }


def local_sgd(model: nn.Module, x: np.ndarray, y: np.ndarray) -> None:
    """One client's training on (x, y) already in batch order: fedelastic's step, in plain torch."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.0, weight_decay=0.0)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    model.train()
    for start in range(0, len(y), BATCH):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(xt[start : start + BATCH]), yt[start : start + BATCH])
        loss.backward()
        opt.step()


def fedavg(updates: list[tuple[int, dict[str, np.ndarray]]], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Example-weighted mean, float64 sums in the given order, cast back (``aggregate_partial``'s arithmetic)."""
    out = {}
    for name, value in current.items():
        num = np.zeros(value.shape, np.float64)
        den = np.zeros(value.shape, np.float64)
        for n, arrays in updates:
            w = np.full(value.shape, float(n))
            num += w * np.asarray(arrays[name], np.float64)
            den += w
        out[name] = np.where(den > 0, num / np.where(den > 0, den, 1.0), value).astype(value.dtype)
    return out


def checksum(state: dict) -> str:
    """SHA-256 of the float32 bytes of every tensor, by name."""
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(np.ascontiguousarray(np.asarray(state[name], np.float32)).tobytes())
    return h.hexdigest()


def accuracy(state: dict, wl: Workload) -> float:
    model = cnn()
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()})
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(wl.test.x)).argmax(1).numpy()
    return float((pred == wl.test.y).mean())


# ---------------------------------------------------------------------------------------------
# process-tree memory


class PeakRSS(threading.Thread):
    """Samples the RSS of a process tree every ``period_s``; ``peak`` is the largest sum seen."""

    def __init__(self, pid: int, period_s: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.period_s, self.peak = pid, period_s, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, tree_usage(self.pid).rss_bytes)
            self.done.wait(self.period_s)


# ---------------------------------------------------------------------------------------------
# workers: each writes {stamps: [round 1 start, round 1 end, ..., round R end] (epoch s), ...}


def worker_bare(wl: Workload, out: dict) -> dict[str, np.ndarray]:
    model = initial_model()
    glob = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    cpu0 = tree_usage(os.getpid()).cpu_s
    stamps = [time.time()]
    for rnd in range(1, wl.rounds + 1):
        updates = []
        for pid in wl.cohort(rnd):
            model.load_state_dict({k: torch.from_numpy(v) for k, v in glob.items()})
            x, y = wl.client_arrays(rnd, pid)
            local_sgd(model, x, y)
            updates.append((len(y), {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}))
        glob = fedavg(updates, glob)
        stamps.append(time.time())
    out.update(stamps=stamps, train_cpu_s=tree_usage(os.getpid()).cpu_s - cpu0)
    return glob


def _pfl_classes():
    from pfl.algorithm import FederatedAveraging
    from pfl.callback.base import TrainingProcessCallback
    from pfl.internal.bridge import FrameworkBridgeFactory as bridges
    from pfl.metrics import Metrics
    from pfl.stats import MappedVectorStatistics

    class ExactFedAvg(FederatedAveraging):
        """FedAvg as the workload defines it: float64 sums of examples x weights, divided by total examples.

        pfl's own ``FederatedAveraging`` sends float32 differences and applies their mean with a
        central SGD step; the rounding differs (see the module doc). Local training is pfl's.
        """

        def get_next_central_contexts(self, model, iteration, algorithm_params, model_train_params, model_eval_params=None):
            import dataclasses

            contexts, model, metrics = super().get_next_central_contexts(
                model, iteration, algorithm_params, model_train_params, model_eval_params
            )
            if contexts is not None:  # no per-user evaluation (pfl does it every evaluation_frequency rounds)
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model, metrics

        def train_one_user(self, initial_model_state, model, user_dataset, central_context):
            bridges.sgd_bridge().do_sgd(model, user_dataset, central_context.model_train_params)
            n = len(user_dataset)
            stats = {k: v.detach().double() * float(n) for k, v in model.variable_map.items()}
            return MappedVectorStatistics(stats, weight=n), Metrics()

        def process_aggregated_statistics(self, central_context, aggregate_metrics, model, statistics):
            weight = float(statistics.weight)
            model.set_parameters(
                MappedVectorStatistics({k: (v / weight).float() for k, v in statistics.items()})
            )
            return model, Metrics()

    class Stamps(TrainingProcessCallback):
        def __init__(self):
            self.stamps: list[float] = []

        def on_train_begin(self, *, model):
            self.stamps.append(time.time())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.stamps.append(time.time())
            return False, Metrics()

    return ExactFedAvg, Stamps


def worker_pfl(wl: Workload, out: dict, stock: bool = False) -> dict[str, np.ndarray] | None:
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.internal.ops.selector import get_framework_module as get_ops
    from pfl.model.pytorch import PyTorchModel

    ExactFedAvg, Stamps = _pfl_classes()
    users = iter([(rnd, pid) for rnd in range(1, wl.rounds + 1) for pid in wl.cohort(rnd)])

    def make_user(user):
        rnd, pid = user
        return Dataset(wl.client_arrays(rnd, pid), user_id=f"{rnd}/{pid}")

    training = FederatedDataset(make_user, lambda: next(users))
    val = FederatedDataset(make_user, lambda: (1, 0))  # never sampled: val_cohort_size = 0
    module = initial_model()
    model = PyTorchModel(
        module, local_optimizer_create=torch.optim.SGD, central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0)
    )
    stamps = Stamps()
    if stock:
        from pfl.aggregate.weighting import WeightByDatapoints
        from pfl.algorithm import FederatedAveraging

        algorithm = FederatedAveraging()
        backend = SimulatedBackend(training_data=training, val_data=val, postprocessors=[WeightByDatapoints()])
    else:
        algorithm = ExactFedAvg()
        backend = SimulatedBackend(training_data=training, val_data=val)
    params = NNAlgorithmParams(
        central_num_iterations=wl.rounds, evaluation_frequency=wl.rounds + 1, train_cohort_size=wl.per_round,
        val_cohort_size=0,
    )  # fmt: skip
    train_params = NNTrainHyperParams(local_learning_rate=LR, local_num_epochs=EPOCHS, local_batch_size=BATCH)
    cpu_root = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()
    cpu0 = tree_usage(cpu_root).cpu_s
    algorithm.run(
        algorithm_params=params, backend=backend, model=model, model_train_params=train_params,
        model_eval_params=NNEvalHyperParams(local_batch_size=512), callbacks=[stamps],
    )  # fmt: skip
    out.update(stamps=stamps.stamps, train_cpu_s=tree_usage(cpu_root).cpu_s - cpu0)
    if get_ops().distributed.global_rank != 0:
        return None
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


_FLOWER_CLIENT: dict = {}


def worker_flower(wl: Workload, out: dict) -> dict[str, np.ndarray]:
    import logging

    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.WARNING)
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        if "model" not in _FLOWER_CLIENT:  # once per Ray worker process (this dict travels empty)
            torch.set_num_threads(1)
            _FLOWER_CLIENT["model"] = cnn()
        data, model = wl, _FLOWER_CLIENT["model"]
        pid, rnd = int(context.node_config["partition-id"]), int(msg.content["config"]["server-round"])
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = data.client_arrays(rnd, pid)
        local_sgd(model, x, y)
        content = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})}
        )
        return Message(content=content, reply_to=msg)

    stamps: list[float] = []
    final: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=wl.per_round / wl.clients, fraction_evaluate=0.0, min_available_nodes=wl.clients)

        def stamp(server_round: int, arrays: ArrayRecord) -> None:  # called before round 1 and after each round
            stamps.append(time.time())

        result = strategy.start(
            grid=grid, initial_arrays=ArrayRecord(initial_model().state_dict()), num_rounds=wl.rounds, evaluate_fn=stamp
        )
        final.update({k: v.numpy().copy() for k, v in result.arrays.to_torch_state_dict().items()})

    cpu0 = tree_usage(os.getpid()).cpu_s
    run_simulation(
        server_app=server_app, client_app=client_app, num_supernodes=wl.clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )  # fmt: skip
    out.update(stamps=stamps, train_cpu_s=tree_usage(os.getpid()).cpu_s - cpu0)
    return final


def worker_fedelastic(
    wl: Workload, out: dict, backend: str, per_client: bool = False, vectorize: bool | str = "auto"
) -> dict[str, np.ndarray]:
    import fedelastic.fl.checkpoint as checkpoint
    import fedelastic.fl.server as server
    import fedelastic.results.recorder as results
    from fedelastic import api

    timers = Timers(since=float("inf"))  # counts from round 1 (progress sets since)
    timers.wrap(server.RoundEngine, "plan", "server: plan (sample, deadline, assignments)")
    timers.wrap(server.EngineStrategy, "messages", "server: messages (the plan as Flower messages)")
    timers.wrap(server.EngineStrategy, "settle", "server: settle (all of it)")
    timers.wrap(server, "aggregate_partial", "server: aggregate_partial (the FedAvg arithmetic)")
    timers.wrap(server.EngineStrategy, "end_round", "server: end_round (test set, round row; progress)")
    timers.wrap(results.Recorder, "add_clients", "server: write client rows")
    timers.wrap(results.Recorder, "add_round", "server: write round row")
    timers.wrap(checkpoint, "save_checkpoint", "server: save checkpoint")
    if backend == "inprocess":
        import fedelastic.fl.client as client

        try:  # cohort mode (one call trains many virtual clients); imported first so it keeps the unwrapped names
            import fedelastic.fl.cohort as cohort
        except ImportError:
            cohort = None
        timers.wrap(client, "client_train", "client: whole ClientApp body (one client a call)")
        timers.wrap(client, "train_local", "client: train_local (the training)")
        timers.wrap(client, "reply_content", "client: reply record (figures, encode)")
        timers.wrap(client, "record_to_torch", "client: decode global arrays")
        timers.wrap(client, "record_from_numpy", "client: encode arrays and state")
        if cohort is not None:
            timers.wrap(cohort, "cohort_train", "client: whole ClientApp body (a cohort a call)")
            timers.wrap(cohort, "reply_content", "client: reply record (figures, encode)")
            timers.wrap(cohort, "record_to_torch", "client: decode global arrays")

    stamps: list[float] = []
    tmp = out.pop("_tmp")
    cpu: list[float] = []

    def progress(row: dict) -> None:  # round 0's row: the initial model evaluated, round 1 starts
        stamps.append(time.time())
        if row["round"] in (0, wl.rounds):  # Ray's processes are still alive at the last round's row
            cpu.append(tree_usage(os.getpid()).cpu_s)
        if row["round"] == 0:
            timers.since = time.perf_counter()

    scenario = wl.scenario(backend, tmp)
    if per_client:  # fedelastic's per-client node mode (the default before cohorts)
        scenario["simulation"]["node_mode"] = "per_client"
    if per_client or vectorize != "auto":  # the default ("auto") picks the vectorised path on this workload
        scenario["simulation"]["vectorize"] = False if per_client else vectorize
    result = api.run(scenario, progress=progress)
    clients = result.clients
    rounds = result.rounds
    out.update(
        stamps=stamps,
        train_cpu_s=cpu[-1] - cpu[0],
        phases=timers.snapshot(),
        train_local_s_per_round=clients.groupby("round")["host_wall_s"].sum().tolist(),
        round_host_wall_s=rounds["host_wall_s"].tolist()[1:],
        status=result.status.get("status"),
        training_path=result.status.get("training_path", ""),
    )
    state = torch.load(Path(result.run_dir) / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    return {k: np.asarray(v.numpy() if hasattr(v, "numpy") else v) for k, v in state.items()}


def worker_main(args) -> None:
    variant = args.worker
    torch.set_num_threads(1)
    if variant in TORCH_OPTIM_VARIANTS:
        # torch.optim's constructor and step import torch._dynamo (~0.9 s of CPU) on first use: an
        # import, so it belongs to start-up (the bare loop would pay it in round 1). fedelastic's
        # variants train with fedelastic.train.optim and never import it.
        importlib.import_module("torch._dynamo")
    wl = Workload(args.clients, args.rounds, args.per_round)
    out: dict = {"variant": variant, "_tmp": args.tmp}
    if variant == "bare":
        state = worker_bare(wl, out)
    elif variant in ("pfl", "pfl2", "pfl-stock"):
        state = worker_pfl(wl, out, stock=variant == "pfl-stock")
    elif variant == "flower":
        state = worker_flower(wl, out)
    else:
        backend = "inprocess" if variant.startswith("inprocess") else "ray"
        vectorize = {"-vmap": True, "-loop": False}.get(variant[variant.rfind("-") :], "auto")
        state = worker_fedelastic(wl, out, backend, variant == "ray-per-client", vectorize)
    out.pop("_tmp", None)
    if state is None:  # a pfl worker other than rank 0
        return
    np.savez(args.result + ".npz", **state)
    out.update(checksum=checksum(state), test_accuracy=accuracy(state, wl))
    Path(args.result).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# driver


def have_pfl() -> bool:
    import importlib.util

    return importlib.util.find_spec("pfl") is not None


def busy_loops(n: int) -> list[subprocess.Popen]:
    """``n`` processes that spin on the CPU until killed: a fixed background load."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_one(variant: str, args, tmp: str, tag: str, busy: int = 0) -> dict:
    result = str(Path(tmp) / f"{tag}.json")
    work = Path(tmp) / tag
    work.mkdir()
    base = [
        str(HERE), "--worker", variant, "--clients", str(args.clients), "--rounds", str(args.rounds),
        "--per-round", str(args.per_round), "--result", result, "--tmp", str(work),
    ]  # fmt: skip
    if variant == "pfl2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *base]
    else:
        cmd = [sys.executable, *base]
    path = [x for x in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if x]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(path)}
    log = Path(tmp) / f"{tag}.log"
    spinners = busy_loops(busy)
    launch = time.time()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        sampler = PeakRSS(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        sampler.done.set()
        sampler.join()
    wall = time.time() - launch
    for spinner in spinners:
        spinner.kill()
        spinner.wait()
    if rc != 0 or not Path(result).exists():
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"peers.py: variant {variant} failed (rc {rc}); its log is above")
    out = json.loads(Path(result).read_text())
    stamps = out["stamps"]
    if len(stamps) != args.rounds + 1:
        raise SystemExit(f"peers.py: variant {variant} reported {len(stamps)} round stamps, expected {args.rounds + 1}")
    updates = args.rounds * args.per_round
    out.update(
        process_wall_s=wall,
        startup_s=stamps[0] - launch,
        training_s=stamps[-1] - stamps[0],
        steady_s=stamps[-1] - stamps[1],
        round_s=[b - a for a, b in zip(stamps, stamps[1:])],
        train_upd_s=updates / (stamps[-1] - stamps[0]),
        steady_upd_s=(updates - args.per_round) / (stamps[-1] - stamps[1]) if args.rounds > 1 else float("nan"),
        peak_rss_mb=sampler.peak / 2**20,
        weights=str(Path(result + ".npz")),
    )
    shutil.rmtree(work, ignore_errors=True)
    return out


METRICS = ("train_upd_s", "steady_upd_s", "process_wall_s", "startup_s", "peak_rss_mb", "train_cpu_s", "test_accuracy")


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Medians per variant, ratios to pfl (1 process) and bare, weight differences from bare."""
    ref = dict(np.load(runs[REFERENCE][0]["weights"])) if REFERENCE in runs else None
    summary: dict = {}
    for variant, rs in runs.items():
        med = {m: float(statistics.median(r[m] for r in rs)) for m in METRICS}
        diffs = []
        for r in rs:
            w = dict(np.load(r["weights"]))
            diffs.append(max(float(np.abs(w[k].astype(np.float64) - ref[k]).max()) for k in ref) if ref else float("nan"))
        summary[variant] = {
            **med,
            "checksums": sorted({r["checksum"] for r in rs}),
            "max_abs_weight_diff_vs_bare": max(diffs),
        }
    for variant, s in summary.items():
        quiet = summary.get(variant.removesuffix(BUSY_TAG))
        if variant.endswith(BUSY_TAG) and quiet:  # the share of its quiet speed a variant keeps when busy
            s["busy_share"] = s["train_upd_s"] / quiet["train_upd_s"]
        for base in ("pfl", "bare"):
            if base in summary:
                s[f"train_upd_s_x_{base}"] = s["train_upd_s"] / summary[base]["train_upd_s"]
                s[f"steady_upd_s_x_{base}"] = s["steady_upd_s"] / summary[base]["steady_upd_s"]
                s[f"process_wall_s_x_{base}"] = s["process_wall_s"] / summary[base]["process_wall_s"]
    return summary


LABELS = {
    "bare": "bare torch loop, 1 process",
    "pfl": "pfl 0.6, 1 process",
    "pfl2": "pfl 0.6, 2 workers (torchrun)",
    "flower": "stock Flower 1.41 + Ray",
    "ray": "**fedelastic, Ray (default: vectorize auto)**",
    "inprocess": "**fedelastic, in-process (default: vectorize auto)**",
    "pfl-stock": "pfl 0.6 own FedAvg (float32 differences), 1 process",
    "ray-per-client": "fedelastic, Ray, one Flower node per virtual client",
    "ray-vmap": "fedelastic, Ray, vectorize = true",
    "inprocess-vmap": "fedelastic, in-process, vectorize = true",
    "ray-loop": "fedelastic, Ray, vectorize = false (per-client loop)",
    "inprocess-loop": "fedelastic, in-process, vectorize = false (per-client loop)",
}
BUSY_TAG = "@busy"  # a variant run beside BUSY busy-loop processes (--busy)


def label(variant: str) -> str:
    base = variant.removesuffix(BUSY_TAG)
    return LABELS[base] + (f", busy ({BUSY} spinning processes)" if base != variant else "")


def table(summary: dict) -> str:
    rows = [
        "| variant | training upd/s | steady upd/s | x pfl (training) | x bare (training) | process wall s "
        "| wall x pfl | start-up s | peak tree RSS MB | training CPU s (tree) | same checksum as bare "
        "| max abs weight diff | test acc | busy / quiet |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    ref = summary.get(REFERENCE, {}).get("checksums", [])
    for v in [x + tag for tag in ("", BUSY_TAG) for x in VARIANTS + EXTRA_VARIANTS]:
        if v not in summary:
            continue
        s = summary[v]
        same = "yes" if s["checksums"] == ref and len(ref) == 1 else "no"
        rows.append(
            f"| {label(v)} | {s['train_upd_s']:.0f} | {s['steady_upd_s']:.0f} "
            f"| {s.get('train_upd_s_x_pfl', float('nan')):.2f} | {s.get('train_upd_s_x_bare', float('nan')):.2f} "
            f"| {s['process_wall_s']:.1f} | {s.get('process_wall_s_x_pfl', float('nan')):.2f} | {s['startup_s']:.1f} "
            f"| {s['peak_rss_mb']:.0f} | {s['train_cpu_s']:.1f} | {same} | {s['max_abs_weight_diff_vs_bare']:.2g} | {s['test_accuracy']:.3f} "
            + (f"| {s['busy_share']:.2f} |" if "busy_share" in s else "| |")
        )
    return "\n".join(rows)


def phases_table(runs: dict[str, list[dict]]) -> str:
    """fedelastic's timers, summed over the training phase (rounds 1..R), median over runs."""
    lines = []
    for v in ("ray", "ray-per-client", "inprocess", "ray-loop", "inprocess-loop"):
        if v not in runs:
            continue
        rs = runs[v]
        labels = sorted({k for r in rs for k in r["phases"]})
        train = statistics.median(r["training_s"] for r in rs)
        local = statistics.median(sum(r["train_local_s_per_round"]) for r in rs)
        steady = statistics.median(r["steady_s"] for r in rs)
        local_steady = statistics.median(sum(r["train_local_s_per_round"][1:]) for r in rs)
        lines += [
            f"{LABELS[v]}: training phase {train:.2f} s, of which rounds 2.. {steady:.2f} s (medians); "
            f"clients' train_local (summed over clients, on {'2 Ray actors' if v.startswith('ray') else '1 thread'}) "
            f"{local:.2f} s, rounds 2.. {local_steady:.2f} s",
            "",
        ]
        lines += ["| phase | s (median) | share of training phase | calls |", "|---|---:|---:|---:|"]
        for k in labels:
            s = statistics.median(r["phases"].get(k, {}).get("s", 0.0) for r in rs)
            calls = rs[0]["phases"].get(k, {}).get("calls", 0)
            lines.append(f"| {k} | {s:.2f} | {s / train:.0%} | {calls} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("peers", "scale"), default="peers", help="scale: run benchmarks/scale.py")
    p.add_argument("--runs", type=int, default=3, help="runs of each variant (default 3)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS + EXTRA_VARIANTS, default=list(VARIANTS))
    p.add_argument("--clients", type=int, default=CLIENTS)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--per-round", type=int, default=PER_ROUND)
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    p.add_argument(
        "--busy", action="store_true",
        help=f"also run every variant beside {BUSY} busy-loop processes (started here), interleaved with its quiet runs",
    )  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "peers.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.worker:
        worker_main(args)
        return
    if args.part == "scale":
        scale = ROOT / "benchmarks" / "scale.py"
        if not scale.exists():
            raise SystemExit("peers.py: --part scale needs benchmarks/scale.py, which is not in this checkout")
        raise SystemExit(subprocess.call([sys.executable, str(scale), *rest], cwd=ROOT))
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    variants = list(args.variants)
    if {"pfl", "pfl2", "pfl-stock"} & set(variants) and not have_pfl():
        print('peers.py: pfl is not installed (pip install -e ".[bench]"): skipping the pfl variants', file=sys.stderr)
        variants = [v for v in variants if not v.startswith("pfl")]
    if not variants:
        raise SystemExit('peers.py: no variant left to run (pfl is not installed: pip install -e ".[bench]")')
    if "pfl2" in variants and args.per_round % 2:
        # each pfl worker draws one user per worker for each of its users: odd cohorts desynchronise the two
        print("peers.py: pfl2 needs an even --per-round (pfl deals a cohort out in pairs): skipping it", file=sys.stderr)
        variants.remove("pfl2")
    if args.rounds < 2 or args.per_round > args.clients or args.runs < 1:
        p.error("--rounds must be >= 2, --per-round <= --clients, --runs >= 1")

    report: dict = {
        "command": "python benchmarks/peers.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "loadavg_start": os.getloadavg(),
        "workload": {"clients": args.clients, "rounds": args.rounds, "per_round": args.per_round},
        "order": [],
    }
    if args.busy:
        variants = [v + tag for v in variants for tag in ("", BUSY_TAG)]
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="fedelastic-peers-") as tmp:
        for i in range(args.runs):
            order = variants[i % len(variants) :] + variants[: i % len(variants)]  # rotate: no variant always first
            for v in order:
                tag = f"{v}-{i}"
                print(f"[run {i + 1}/{args.runs}] {v} ...", flush=True)
                try:
                    r = run_one(v.removesuffix(BUSY_TAG), args, tmp, tag, BUSY if v.endswith(BUSY_TAG) else 0)
                except SystemExit as exc:  # one failed run (e.g. Ray's start timing out on a loaded host): go on
                    print(f"  FAILED: {exc}", flush=True)
                    report.setdefault("failed", []).append({"run": tag, "error": str(exc)})
                    continue
                r["loadavg_after"] = os.getloadavg()[0]
                runs[v].append(r)
                report["order"].append(tag)
                print(
                    f"  {r['train_upd_s']:.0f} upd/s (steady {r['steady_upd_s']:.0f}); wall {r['process_wall_s']:.1f} s; "
                    f"start-up {r['startup_s']:.1f} s; peak RSS {r['peak_rss_mb']:.0f} MB; {r['checksum'][:12]}; "
                    f"load {r['loadavg_after']:.1f}{'; ' + r['training_path'] if r.get('training_path') else ''}",
                    flush=True,
                )
        report["summary"] = summarise({v: rs for v, rs in runs.items() if rs})
    for rs in runs.values():
        for r in rs:
            r.pop("weights", None)
    report["runs"] = runs
    report["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(report["summary"]))
    print()
    print(phases_table(runs))
    print(f"written {out}")


if __name__ == "__main__":
    main()
