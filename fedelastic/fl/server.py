"""The server side in Flower: a thin strategy around the round engine (:mod:`fedelastic.sim.engine`).

* Nodes are sorted by partition id (asked once with a query message); replies are sorted by it.
* :meth:`EngineStrategy.configure_train` encodes the engine's plan (the sampled clients, each
  one's rho and step cap) into Flower messages; :meth:`EngineStrategy.aggregate_train` decodes the
  replies (arrays, masks, figures, NaN/inf checks) into the engine's ``settle``, which closes the
  round on the simulated clock and aggregates with the run's aggregator (``server.aggregator``).
* :meth:`EngineStrategy.evaluate` evaluates the global model and hands the round's row to the
  callbacks (:mod:`fedelastic.sim.callbacks`): the results writer, the checkpoint, progress,
  user callbacks; any of them may stop the run.
* ``policy = "async"`` runs the engine's FedBuff loop, its clients reached the same way.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable, Sequence
from logging import WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.supercore import log

from ..continual import evaluate_stream
from ..divergence import Detector, weight_norm
from ..environment import RunEnvironment, environment, freeze_heap
from ..errors import Diverged, RunFailed, StopRun
from ..results import Recorder
from ..runtime.backend import timeout_reason
from ..scenario import Scenario
from ..sim.aggregators import make_aggregator
from ..sim.callbacks import CallbackList, ContinualReport, ResultsWriter, RoundEnd
from ..sim.engine import Reply, RoundEngine, nonfinite_reason, nonfinite_tensors
from ..sim.fleet import Fleet, local_steps
from ..sim.records import METRIC_KEYS, ClientRecord, RoundRecord
from ..training import evaluate_model, evaluate_predictions, torch_threads
from .arrays import config_record, record_dict, record_from_numpy, record_to_numpy, record_to_torch
from .checkpoint import Checkpointer


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
                raise RuntimeError(
                    f"node {reply.metadata.src_node_id} failed the partition query: {reply.error.reason}"
                )
            mapping[int(reply.content["metrics"]["partition-id"])] = reply.metadata.src_node_id
        if len(mapping) != min(start + QUERY_CHUNK, len(nodes)):
            break
    if len(mapping) != len(nodes):
        raise RuntimeError(f"{len(mapping)} of {len(nodes)} nodes answered the partition query")
    return mapping


def nonfinite_update(
    reply: Message, arrays: dict[str, np.ndarray] | None = None, nonfinite: set[str] | None = None
) -> str:
    """'' if a client's reply is finite, else why it is rejected (first NaN/inf tensor or figure).

    ``arrays``: the reply's arrays, if already decoded; ``nonfinite``: the names of those that
    hold a NaN/inf, if already known (:func:`~fedelastic.sim.engine.nonfinite_tensors`).
    """
    if arrays is None:
        arrays = record_to_numpy(reply.content["arrays"], copy=False)
    if nonfinite is None:
        nonfinite = nonfinite_tensors([arrays])[0]
    return nonfinite_reason(reply.content["metrics"], arrays, nonfinite)


def build_fleet(env: RunEnvironment) -> Fleet:
    """The run's :class:`~fedelastic.sim.fleet.Fleet`: every partition's profile, cost model and local steps."""
    sc, t = env.scenario, env.scenario.train
    steps = [
        local_steps(len(env.data.partitions[p]), t.batch_size, t.local_epochs, t.max_steps) for p in range(sc.num_clients)
    ]
    profiles, costs = [env.profile(d) for d in env.devices], [env.cost(d) for d in env.devices]
    return Fleet(sc, profiles, costs, steps, env.info.num_tensors, env.strategy)


def _warn(*args) -> None:
    log(WARNING, *args)


class EngineStrategy(FedAvg):
    """The Flower strategy around the :class:`~fedelastic.sim.engine.RoundEngine`.

    It encodes each round's :class:`~fedelastic.sim.engine.Plan` into Flower messages and decodes
    the replies for :meth:`~fedelastic.sim.engine.RoundEngine.settle`. Synchronous policies run in
    Flower's round loop (:meth:`start`); ``policy = "async"`` runs the engine's FedBuff loop
    (:meth:`run_buffered`). The round's row is made by :meth:`evaluate`, and handed to the callbacks.
    """

    def __init__(
        self,
        env: RunEnvironment,
        node_of_partition: dict[int, int],
        recorder: Recorder | None,
        progress: Callable | None,
        *,
        checkpoint: dict | None = None,
        callbacks: Sequence = (),
    ):
        """``recorder``: where rows and checkpoints go (None: nowhere); ``progress(row)`` and each of
        ``callbacks`` (:mod:`fedelastic.sim.callbacks`) see every round; ``checkpoint``: resume from it."""
        super().__init__(min_available_nodes=len(node_of_partition))  # evaluation is central: see configure_evaluate
        self.env, self.sc = env, env.scenario
        self.node_of_partition = node_of_partition
        self.partition_of_node = {n: p for p, n in node_of_partition.items()}
        self.recorder = recorder
        self.aggregator = make_aggregator(self.sc.server, env.info.tensor_names, self.sc.source or "<scenario>")
        self.engine = RoundEngine(
            self.sc, build_fleet(env), env.devices, env.info.tensor_names, aggregate=self.aggregator, warn=_warn
        )
        self.fleet, self.policy = self.engine.fleet, self.sc.server.policy
        builtin = [] if recorder is None else [ResultsWriter(recorder)]
        kept = [] if recorder is None else [Checkpointer(recorder, checkpoint)]
        if recorder is not None and self.sc.stream is not None:
            kept.append(ContinualReport(recorder.folder, self.sc.stream.recover_share))
        self.callbacks = CallbackList([*builtin, progress, *callbacks, *kept])
        self.offset = 0  # a resumed run's rounds: Flower's loop counts from 1, shifted by the checkpoint's round
        self.resumed, self.hand_back = False, False
        self.client_states: dict[int, dict[str, np.ndarray]] = {}  # every node's strategy state (checkpointed)
        self._arrays: ArrayRecord | None = None
        self._round_start = time.perf_counter()
        self._sampled: list[int] = []
        d = self.sc.divergence
        self.detector = Detector(
            d.loss_factor,
            d.norm_factor,
            d.collapse_share,
            d.rejected_share,
            collapse_margin=d.collapse_margin,
            collapse_rounds=d.collapse_rounds,
        )
        self._norm: float | None = None  # the global weights' norm after the round (None: not aggregated)
        self._params = frozenset(env.info.tensor_names)  # the norm's tensors: the trainable ones

    # the clock and the energy total are the engine's (a checkpoint keeps and restores them)
    sim_time_s = property(lambda self: self.engine.sim_time_s, lambda self, v: setattr(self.engine, "sim_time_s", v))
    total_energy_j = property(
        lambda self: self.engine.total_energy_j, lambda self, v: setattr(self.engine, "total_energy_j", v)
    )

    # ---- synchronous rounds -----------------------------------------------------------------
    def sample(self, server_round: int) -> list[int]:
        """Partition ids trained in ``server_round`` (:meth:`~fedelastic.sim.engine.RoundEngine.sample`)."""
        return self.engine.sample(server_round)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        server_round += self.offset
        self._arrays, self._round_start = arrays, time.perf_counter()
        plan = self.engine.plan(server_round)
        self._sampled = plan.clients
        messages = []
        for p in plan.clients:
            cfg = {**config, "server-round": server_round}  # a plain dict, made a ConfigRecord once filled
            a = plan.assignments[p]
            if not math.isnan(a.rho):
                cfg["rho"] = a.rho
            if a.step_cap >= 0:
                cfg["max-steps"] = a.step_cap
            content = {"arrays": arrays, "config": config_record(cfg)}
            if self.hand_back and p in self.client_states:  # a resumed run hands each node its checkpointed state
                content["strategy-state"] = record_from_numpy(self.client_states[p])
            record = record_dict(content)
            messages.append(
                Message(content=record, message_type=MessageType.TRAIN, dst_node_id=self.node_of_partition[p])
            )
        self.hand_back = False  # the nodes keep their state from now on, as in an uninterrupted run
        # the previous round's rows and checkpoint are handed to the writer as these messages leave
        # (GuardedGrid's on_sent), to be written while this round trains
        return messages

    def _failures(self, replies: list[Message], sampled: list[int]) -> tuple[list[Reply], dict[int, str]]:
        """The replies, decoded (arrays as read-only views; a NaN/inf one is marked rejected: its
        client trained, and is charged for it), and partition -> reason for the failures (errors, no reply)."""
        failures = {
            self.partition_of_node.get(m.metadata.src_node_id, -1): m.error.reason for m in replies if m.has_error()
        }
        answered = [m for m in replies if not m.has_error()]
        decoded = [record_to_numpy(m.content["arrays"], copy=False) for m in answered]  # once: checked, then averaged
        ok = []
        for m, arrays, nonfinite in zip(answered, decoded, nonfinite_tensors(decoded)):
            every = dict(m.content["metrics"].items())
            metrics = {k: every[k] for k in METRIC_KEYS}
            reason = str(m.content["info"]["fits-reason"]) if "info" in m.content else ""
            masks = record_to_numpy(m.content["masks"], copy=False)
            bad = nonfinite_reason(metrics, arrays, nonfinite)
            ok.append(Reply(int(metrics["partition-id"]), metrics, arrays, masks, reason, bad))
        replied = {self.partition_of_node.get(m.metadata.src_node_id, -1) for m in replies}
        for p in sampled:  # no reply within the round's timeout: a row, not a gap
            if p not in replied:
                failures[p] = timeout_reason(self.sc.simulation.timeout_s)
        return ok, failures

    def _by_partition(self, replies: Iterable[Message]) -> list[Message]:
        return sorted(replies, key=lambda m: self.partition_of_node.get(m.metadata.src_node_id, -1))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = self._by_partition(replies)
        for m in replies:
            if not m.has_error() and "strategy-state" in m.content:
                pid = int(m.content["metrics"]["partition-id"])
                self.client_states[pid] = record_to_numpy(m.content["strategy-state"])
        ok, failures = self._failures(replies, self._sampled)
        assert self._arrays is not None
        start = self.sim_time_s
        rows, new_state = self.engine.settle(server_round + self.offset, ok, failures, record_to_numpy(self._arrays))
        self._add_clients(rows)
        self._norm = weight_norm(new_state, self._params)
        return record_from_numpy(new_state), MetricRecord({"round-time-s": self.sim_time_s - start})

    def _add_clients(self, rows: list[ClientRecord]) -> None:
        if self.recorder is not None:
            self.recorder.add_clients([r.row() for r in rows])

    def _divergence(self, server_round: int, arrays: ArrayRecord, test_loss: float, predicted, actual) -> str:
        """Why the round shows divergence ('' if not): the detector fed the round's figures (see divergence.py)."""
        if server_round == 0 or self._norm is None:
            self._norm = weight_norm(record_to_numpy(arrays, copy=False), self._params)
        if predicted is not None and not self.detector.classes:
            self.detector.classes = len(predicted)  # the loss floor ln(classes)
        r = self.engine.summary
        trained = r.clients_counted + r.clients_rejected
        # the mean over the updates used (NaN: none trained a step; a client's non-finite loss is a rejection)
        loss = r.mean_train_loss if server_round and not math.isnan(r.mean_train_loss) else None
        reason = self.detector.observe(
            server_round,
            train_loss=loss,
            test_loss=test_loss if self.evaluates(server_round) else None,
            norm=self._norm,
            trained=trained,
            rejected=r.clients_rejected,
            predicted=predicted,
            actual=actual,
        )
        self._norm = None
        if reason:
            log(WARNING, "round %d diverged: %s", server_round, reason)
        return reason

    # ---- asynchronous aggregation (FedBuff) -------------------------------------------------
    def run_buffered(self, grid: Grid, initial_arrays: ArrayRecord, timeout: float) -> None:
        """FedBuff (:meth:`~fedelastic.sim.engine.RoundEngine.run_async`), its clients reached with Flower messages."""
        self.evaluate(0, initial_arrays)

        def launch(ids: list[int], first: int, version: int, state: dict) -> tuple[list[Reply], dict[int, str]]:
            arrays = record_from_numpy(state)
            messages = []
            for i, p in enumerate(ids):  # a unique training seed per dispatch
                cfg = ConfigRecord({"server-round": first + i, "model-version": version})
                content = RecordDict({"arrays": arrays, "config": cfg})
                messages.append(
                    Message(content=content, message_type=MessageType.TRAIN, dst_node_id=self.node_of_partition[p])
                )
            # earlier aggregations' writes are handed over as these messages leave (on_sent)
            return self._failures(self._by_partition(grid.send_and_receive(messages, timeout=timeout)), ids)

        def on_aggregate(version: int, state: dict, rows: list[ClientRecord]) -> None:
            self._norm = weight_norm(state, self._params)
            self._add_clients(rows)
            self.evaluate(version, record_from_numpy(state))
            self._round_start = time.perf_counter()

        pending = self.engine.run_async(record_to_numpy(initial_arrays), launch, on_aggregate)
        if pending:  # updates still in flight or buffered at the end: their work so far is wasted
            self._add_clients(pending)

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
        """Flower's last call of a round: evaluate the global model after ``server_round``
        (:meth:`evaluates`; NaN if skipped) on ``simulation.torch_threads`` threads, as the clients
        train, then end the round (:meth:`end_round`: Flower's loop has no other per-round hook)."""
        if server_round == 0 and self.resumed:
            return None  # the initial row is already on disk (also when the checkpoint is round 0's)
        server_round += self.offset
        with torch_threads(self.sc.simulation.torch_threads):
            record, tasks, predicted, actual = self._evaluate(server_round, arrays)
        self.end_round(server_round, arrays, record, tasks, predicted, actual)
        if not self.evaluates(server_round):
            return None
        return MetricRecord({"accuracy": record.test_accuracy, "loss": record.test_loss})

    def end_round(
        self, server_round: int, arrays: ArrayRecord, record: RoundRecord, tasks: list[dict], predicted, actual
    ) -> None:
        """The round's divergence check, then its row to the callbacks (results writer, checkpoint,
        continual report, user callbacks); raises :class:`Diverged` or :class:`StopRun` to end the run."""
        record.divergence = self._divergence(server_round, arrays, record.test_loss, predicted, actual)
        end = RoundEnd(server_round, record.row(), lambda: record_to_numpy(arrays), self, tasks)
        stop = self.callbacks.on_round_end(end)  # their writes are handed over when the next round is sent
        if record.divergence and self.sc.simulation.on_divergence == "stop":
            raise Diverged(server_round, record.divergence)
        if stop:
            raise StopRun(f"a callback stopped the run after round {server_round}")

    def _evaluate(self, server_round: int, arrays: ArrayRecord) -> tuple[RoundRecord, list[dict], Any, Any]:
        """The round's record (its evaluation, if :meth:`evaluates`), a stream's task rows, and the test
        predictions and labels per class (a stream's: over the seen tasks; None if not evaluated)."""
        accuracy = loss = float("nan")
        val = dict.fromkeys(("val_accuracy", "val_loss"), float("nan")) if self.sc.data.validation > 0 else {}
        predicted = actual = None
        tasks: list[dict] = []
        if self.evaluates(server_round):
            model = self.env.new_model()
            model.load_state_dict(record_to_torch(arrays))
            if self.env.stream is not None:  # the accuracy matrix R[t, j]; the round's accuracy: mean over seen tasks
                tasks, accuracy, loss, predicted, actual = evaluate_stream(
                    self.env, model, server_round, self.sim_time_s
                )
            else:
                test = self.env.data.test
                accuracy, loss, predicted = evaluate_predictions(model, test.x, test.y)
                actual = np.bincount(test.y, minlength=len(predicted))
            if val:  # the clients' held-out share (data.validation), never the test set
                held = self.env.data.validation_set
                val["val_accuracy"], val["val_loss"] = evaluate_model(model, held.x, held.y)
        record = RoundRecord(
            round=server_round,
            strategy=self.sc.train.strategy,
            sim_time_s=self.sim_time_s,
            test_accuracy=accuracy,
            test_loss=loss,
            **val,
            total_energy_j=self.total_energy_j,
            summary=self.engine.summary,
            host_wall_s=time.perf_counter() - self._round_start if server_round else 0.0,
        )
        return record, tasks, predicted, actual


def server_main(
    scenario: Scenario,
    initial_state: dict,
    recorder: Recorder,
    progress: Callable | None,
    grid: Grid,
    *,
    checkpoint: dict | None = None,
    callbacks: Sequence = (),
) -> None:
    """The ServerApp's body: register nodes, map partitions, run the rounds (from ``checkpoint``'s round + 1).

    The results are written behind (:meth:`~fedelastic.results.Recorder.write_behind`): a round's
    rows and checkpoint are written while a later round trains (the rounds of the last
    ``simulation.write_every_s`` seconds together); all of them are written when this returns or
    raises. The callbacks' ``on_run_end`` follows, with the run's outcome.
    """
    env = environment(scenario)
    timeout = scenario.simulation.timeout_s
    nodes = wait_for_nodes(grid, scenario.num_clients, timeout)
    mapping = discover_partitions(grid, nodes, max(timeout, 300.0))  # includes the workers' start-up
    strategy = EngineStrategy(env, mapping, recorder, progress, checkpoint=checkpoint, callbacks=callbacks)
    strategy.callbacks.on_run_start(strategy)
    recorder.write_behind(scenario.simulation.write_every_s)
    freeze_heap()  # the run is set up: full collections walk only what the rounds make
    outcome = "failed"
    try:
        try:
            if scenario.server.policy == "async":
                if checkpoint is not None:
                    raise RunFailed("an asynchronous (policy = 'async') run cannot be resumed; start it again")
                strategy.run_buffered(grid, ArrayRecord(torch_state_dict=initial_state), timeout)
            else:
                strategy.start(
                    grid=grid,
                    initial_arrays=ArrayRecord(torch_state_dict=initial_state),
                    num_rounds=scenario.server.rounds - strategy.offset,
                    timeout=timeout,
                    evaluate_fn=strategy.evaluate,
                )
        except (
            StopRun,
            Diverged,
        ) as exc:  # a normal end: the finished rounds reach disk, and a failed write fails the run
            recorder.flush()
            outcome = "stopped" if isinstance(exc, StopRun) else "diverged"
            raise
        except BaseException as exc:
            recorder.flush_quietly(exc)  # the finished rounds reach disk; the run's error is this one
            raise
        finally:
            gc.unfreeze()
        recorder.flush()
        outcome = "completed"
    finally:
        strategy.callbacks.on_run_end(strategy, outcome)


def make_server_app(scenario: Scenario, initial_state: dict, recorder: Recorder, progress: Callable) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        server_main(scenario, initial_state, recorder, progress, grid)

    return app
