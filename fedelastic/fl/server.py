"""The server: fedelastic's own round loop around the round engine (:mod:`fedelastic.sim.engine`), over Flower's Grid.

* Nodes are sorted by partition id (asked once with a query message); replies are sorted by it.
* :meth:`EngineStrategy.run` is the synchronous loop, a round at a time: **plan** (the engine's
  :meth:`~fedelastic.sim.engine.RoundEngine.plan`: the sampled clients, the deadline, each one's
  rho and step cap), **send** (:meth:`EngineStrategy.messages`, Flower messages through
  ``grid.send_and_receive``), **settle** (:meth:`EngineStrategy.settle` decodes the replies into
  the engine's ``settle``: the clock, energy, aggregation), then **end the round**
  (:meth:`EngineStrategy.end_round`: the callbacks, :mod:`fedelastic.sim.callbacks`, in order:
  the central evaluation, the divergence check, the user's callbacks and progress, the results
  writer, the checkpoint). It returns the run's outcome; a callback ends it by returning ``stop``.
* ``policy = "async"``: :meth:`EngineStrategy.run_buffered` runs the engine's FedBuff loop, its
  clients reached the same way, each aggregation ended by the same :meth:`~EngineStrategy.end_round`.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterable, Sequence
from logging import WARNING

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from ..environment import RunEnvironment, environment, freeze_heap
from ..errors import RunFailed
from ..results.continual import evaluate_stream
from ..results.recorder import Recorder
from ..runtime.backend import timeout_reason
from ..scenario import Scenario, ServerConfig
from ..sim.aggregators import make_aggregator
from ..sim.callbacks import (
    Callback,
    CallbackList,
    ContinualReport,
    DivergenceCheck,
    Evaluation,
    FunctionCallback,
    ResultsWriter,
    RoundEnd,
)
from ..sim.deadline import local_steps
from ..sim.divergence import Detector
from ..sim.engine import Plan, Reply, RoundEngine, nonfinite_reason, nonfinite_tensors
from ..sim.fleet import Fleet
from ..sim.records import METRIC_KEYS, ClientRecord, RoundRecord
from ..train.trainer import evaluate_model, evaluate_predictions, torch_threads
from .arrays import config_record, record_dict, record_from_numpy, record_to_numpy
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


def evaluates(server: ServerConfig, rnd: int) -> bool:
    """Whether the global model is evaluated after round ``rnd`` (``server.evaluate_every``; 0 and the last always)."""
    return rnd % server.evaluate_every == 0 or rnd >= server.rounds


class CentralEvaluation(Callback):
    """The global model on the test set (a stream: on the seen tasks, :func:`~fedelastic.results.continual.evaluate_stream`)
    and on the clients' held-out shares (``data.validation``), after the rounds that :func:`evaluates`,
    on ``simulation.torch_threads`` threads; the round's ``host_wall_s`` ends here."""

    owns = ("test_accuracy", "test_loss", "val_accuracy", "val_loss", "host_wall_s")

    def __init__(self, env: RunEnvironment):
        self.env, self.sc = env, env.scenario

    def on_round_end(self, end: RoundEnd) -> tuple[bool, dict]:
        columns: dict = {}
        if evaluates(self.sc.server, end.round):
            with torch_threads(self.sc.simulation.torch_threads):
                columns = self.evaluate(end)
        columns["host_wall_s"] = time.perf_counter() - end.started if end.round else 0.0
        return False, columns

    def evaluate(self, end: RoundEnd) -> dict:
        """The evaluation's columns; sets ``end.evaluation``."""
        env = self.env
        model = env.new_model()
        model.load_state_dict({k: torch.from_numpy(v) for k, v in end.weights().items()})
        tasks: list[dict] = []
        if env.stream is not None:  # the accuracy matrix R[t, j]; the round's accuracy: mean over seen tasks
            tasks, accuracy, loss, predicted, actual = evaluate_stream(env, model, end.round, end.row["sim_time_s"])
        else:
            test = env.data.test
            accuracy, loss, predicted = evaluate_predictions(model, test.x, test.y)
            actual = np.bincount(test.y, minlength=len(predicted))
        end.evaluation = Evaluation(predicted, actual, tasks)
        columns = {"test_accuracy": accuracy, "test_loss": loss}
        if self.sc.data.validation > 0:  # the clients' held-out share, never the test set
            held = env.data.validation_set
            columns["val_accuracy"], columns["val_loss"] = evaluate_model(model, held.x, held.y)
        return columns


class EngineStrategy:
    """fedelastic's server around the :class:`~fedelastic.sim.engine.RoundEngine`: the round loop
    (:meth:`run`; ``policy = "async"``: :meth:`run_buffered`), each round's plan encoded into
    Flower messages (:meth:`messages`) and the replies decoded for the engine (:meth:`settle`),
    each round ended by the callbacks (:meth:`end_round`)."""

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
        self.env, self.sc = env, env.scenario
        self.node_of_partition = node_of_partition
        self.partition_of_node = {n: p for p, n in node_of_partition.items()}
        self.recorder = recorder
        self.aggregator = make_aggregator(self.sc.server, env.info.tensor_names, self.sc.source or "<scenario>")
        self.engine = RoundEngine(
            self.sc, build_fleet(env), env.devices, env.info.tensor_names, aggregate=self.aggregator, warn=_warn
        )
        self.fleet, self.policy = self.engine.fleet, self.sc.server.policy
        d = self.sc.divergence
        self.detector = Detector(
            d.loss_factor,
            d.norm_factor,
            d.collapse_share,
            d.rejected_share,
            collapse_margin=d.collapse_margin,
            collapse_rounds=d.collapse_rounds,
        )
        # the round's callbacks, in this order (documented in sim/callbacks.py and how-a-run-works.md)
        checks = [CentralEvaluation(env), DivergenceCheck(self.sc.simulation.on_divergence, env.info.tensor_names, _warn)]
        writes = [] if recorder is None else [ResultsWriter(recorder), Checkpointer(recorder, checkpoint)]
        if recorder is not None and self.sc.stream is not None:
            writes.append(ContinualReport(recorder.folder, self.sc.stream.recover_share))
        # objects may return columns, so they run before the row is written; plain functions of the
        # row (the command's progress line, fe.run's functions) after it: a round printed is on record
        users = CallbackList([progress, *callbacks]).callbacks
        functions = [cb for cb in users if isinstance(cb, FunctionCallback)]
        objects = [cb for cb in users if not isinstance(cb, FunctionCallback)]
        self.callbacks = CallbackList([*checks, *objects, *writes, *functions])
        self.offset = 0  # a resumed run's rounds start after the checkpoint's round (set by the Checkpointer)
        self.resumed, self.hand_back = False, False
        self.client_states: dict[int, dict[str, np.ndarray]] = {}  # every node's strategy state (checkpointed)

    # the clock and the energy total are the engine's (a checkpoint keeps and restores them)
    sim_time_s = property(lambda self: self.engine.sim_time_s, lambda self, v: setattr(self.engine, "sim_time_s", v))
    total_energy_j = property(
        lambda self: self.engine.total_energy_j, lambda self, v: setattr(self.engine, "total_energy_j", v)
    )

    # ---- the synchronous round loop -----------------------------------------------------------
    def run(self, grid: Grid, initial: ArrayRecord, timeout: float) -> str:
        """The rounds, from the checkpoint's round + 1 (round 0's row first: the initial model);
        returns how the run ended: ``completed``, or ``stopped``/``diverged`` by a callback."""
        arrays, rnd = initial, self.offset
        outcome = "" if self.resumed else self.end_round(rnd, arrays, time.perf_counter())  # round 0: the initial model
        while not outcome and rnd < self.sc.server.rounds:
            rnd += 1
            started = time.perf_counter()
            plan = self.engine.plan(rnd)                                                   # plan
            replies = grid.send_and_receive(self.messages(plan, arrays), timeout=timeout)  # send
            arrays = self.settle(plan, replies, arrays)                                    # settle
            outcome = self.end_round(rnd, arrays, started)                                 # evaluate, callbacks
        return outcome or "completed"

    def sample(self, rnd: int) -> list[int]:
        """Partition ids trained in round ``rnd`` (:meth:`~fedelastic.sim.engine.RoundEngine.sample`)."""
        return self.engine.sample(rnd)

    def messages(self, plan: Plan, arrays: ArrayRecord) -> list[Message]:
        """The plan as Flower messages: the global ``arrays`` and each client's config (round, rho, step cap)."""
        messages = []
        for p in plan.clients:
            cfg: dict = {"server-round": plan.round}  # a plain dict, made a ConfigRecord once filled
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

    def settle(self, plan: Plan, replies: Iterable[Message], arrays: ArrayRecord) -> ArrayRecord:
        """The replies decoded for :meth:`~fedelastic.sim.engine.RoundEngine.settle` (the clients'
        strategy states kept); the clients' rows recorded; returns the new global model."""
        replies = self._by_partition(replies)
        for m in replies:
            if not m.has_error() and "strategy-state" in m.content:
                pid = int(m.content["metrics"]["partition-id"])
                self.client_states[pid] = record_to_numpy(m.content["strategy-state"])
        ok, failures = self._failures(replies, plan.clients)
        rows, new_state = self.engine.settle(plan.round, ok, failures, record_to_numpy(arrays))
        self._add_clients(rows)
        return record_from_numpy(new_state)

    def end_round(self, rnd: int, arrays: ArrayRecord, started: float) -> str:
        """Round ``rnd``'s row: the engine's columns (clock, energy, the clients' summary), then the
        callbacks' (:mod:`fedelastic.sim.callbacks`, in order); returns '' to go on, or how the run
        ends after it (``stopped``, ``diverged``)."""
        record = RoundRecord(
            round=rnd,
            strategy=self.sc.train.strategy,
            sim_time_s=self.sim_time_s,
            **({"val_accuracy": math.nan, "val_loss": math.nan} if self.sc.data.validation > 0 else {}),
            total_energy_j=self.total_energy_j,
            summary=self.engine.summary,
            host_wall_s=math.nan,
        )
        end = RoundEnd(rnd, record.row(), lambda: record_to_numpy(arrays), self, started=started)
        return self.callbacks.on_round_end(end)[0]  # their writes are handed over when the next round is sent

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

    def _add_clients(self, rows: list[ClientRecord]) -> None:
        if self.recorder is not None:
            self.recorder.add_clients([r.row() for r in rows])

    # ---- asynchronous aggregation (FedBuff) -------------------------------------------------
    def run_buffered(self, grid: Grid, initial: ArrayRecord, timeout: float) -> str:
        """FedBuff (:meth:`~fedelastic.sim.engine.RoundEngine.run_async`), its clients reached with
        Flower messages, each aggregation ended as a round is (:meth:`end_round`); returns how the run ended."""
        outcome = self.end_round(0, initial, time.perf_counter())
        started = time.perf_counter()

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

        def on_aggregate(version: int, state: dict, rows: list[ClientRecord]) -> bool:
            nonlocal outcome, started
            self._add_clients(rows)
            outcome = self.end_round(version, record_from_numpy(state), started)
            started = time.perf_counter()
            return bool(outcome)  # a callback's stop ends the loop; the clients in flight are cancelled

        if not outcome:
            pending = self.engine.run_async(record_to_numpy(initial), launch, on_aggregate)
            if pending:  # updates still in flight or buffered at the end: their work so far is wasted
                self._add_clients(pending)
        return outcome or "completed"


def server_main(
    scenario: Scenario,
    initial_state: dict,
    recorder: Recorder,
    progress: Callable | None,
    grid: Grid,
    *,
    checkpoint: dict | None = None,
    callbacks: Sequence = (),
) -> str:
    """The ServerApp's body: register nodes, map partitions, run the rounds (from ``checkpoint``'s
    round + 1); returns the run's outcome (``completed``, ``stopped``, ``diverged``), raises if it failed.

    The results are written behind (:meth:`~fedelastic.results.recorder.Recorder.write_behind`): a round's
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
            initial = ArrayRecord(torch_state_dict=initial_state)
            if scenario.server.policy == "async":
                if checkpoint is not None:
                    raise RunFailed("an asynchronous (policy = 'async') run cannot be resumed; start it again")
                ended = strategy.run_buffered(grid, initial, timeout)
            else:
                ended = strategy.run(grid, initial, timeout)
        except BaseException as exc:
            recorder.flush_quietly(exc)  # the finished rounds reach disk; the run's error is this one
            raise
        finally:
            gc.unfreeze()
        recorder.flush()  # the finished rounds reach disk, and a failed write fails the run
        if ended == "stopped":  # a callback stopped it after the round it saw: a normal end
            recorder.notes["stopped_after_round"] = max((r["round"] for r in recorder.rounds.rows), default=0)
        outcome = ended
    finally:
        strategy.callbacks.on_run_end(strategy, outcome)
    return outcome


def make_server_app(scenario: Scenario, initial_state: dict, recorder: Recorder, progress: Callable) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        server_main(scenario, initial_state, recorder, progress, grid)

    return app
