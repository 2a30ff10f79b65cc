"""Cohorts: one Flower node trains a share of a round's virtual clients per call.

With ``simulation.node_mode = "cohort"`` (the default) a run has a few Flower nodes, by default
one per Ray worker, instead of one per virtual client. The server is unchanged: it still sees
one node per virtual client and sends each its own message. :class:`CohortGrid`, between the
server and Flower's grid, packs a round's messages into one message per cohort (the global
arrays once, each client's config and kept strategy state), and unpacks each cohort's reply
into the per-client replies the server expects. The node trains its clients one after another
with :func:`~fedelastic.fl.client.train_cohort`, exactly as each would train on its own node
(same seed per (seed, round, partition), same weights, same strategy state), so the results are
byte-identical to ``node_mode = "per_client"`` (tested).

What a client's own node would do, a cohort does per client:

* a client that raises is an error reply for that client alone;
* each client gets ``timeout_s`` from its start; one that overruns is a timeout for that client,
  the node returns at once and the clients it had not started are sent again; its worker, which
  still runs the abandoned client, is replaced (Ray) or its model rebuilt (in-process). A
  vectorised cohort trains its clients in one call, which gets ``timeout_s`` per client: when it
  overruns, each of its clients not yet reported is a timeout;
* a cohort whose worker process died (after ``client_retries``), or that failed as a whole, is
  sent again one client per message, so that only the client that causes it fails;
* a client's strategy state (e.g. static_elastic's fixed selection) is kept by the driver
  between rounds, as a node's context keeps it, and handed back with the client's next job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from functools import partial

import numpy as np
import torch
from flwr.app import ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from ..environment import RunEnvironment, environment, freeze_heap
from ..environment import warm_up as env_warm_up
from ..errors import with_traceback
from ..runtime.backend import timeout_reason
from ..scenario import Scenario
from ..sim.deadline import local_steps
from .arrays import record_dict, record_to_torch
from .client import prepare_job, reply_content, too_slow_content, train_cohort
from .grids import PassThroughGrid
from .threads import STOPPING, KeptThread, wait_out

# a member's state in a cohort's reply
DONE, FAILED, TIMEOUT, UNRUN = "done", "failed", "timeout", "unrun"
_MEMBER_KEYS = ("arrays", "masks", "metrics", "strategy-state", "info")


_TRAINING: list[KeptThread] = []  # this process's training thread (threads.py), made at its first call


def training_thread() -> KeptThread:
    if not _TRAINING or _TRAINING[0].retired:
        _TRAINING[:] = [KeptThread("cohort")]
    return _TRAINING[0]


def cohort_train(scenario: Scenario, msg: Message) -> Message:
    """The ClientApp's train handler for a cohort message: every member's reply, packed into one.

    The members train one after another on one training thread (:func:`train_cohort`) while
    this thread watches the clock: each member has ``timeout-s`` from its own start (vectorised:
    the one batched call has ``timeout-s`` per member). When a member overruns, the call returns
    at once: that member (vectorised: each member not yet reported) is a timeout, the members not started go
    back unrun, and the process's model is rebuilt for the next call (the abandoned thread may
    still train on the old one).
    """
    env = environment(scenario)
    sim = scenario.simulation
    torch.set_num_threads(sim.torch_threads)
    content = msg.content
    head = content["cohort"]
    pids = [int(p) for p in head["partition-ids"]]
    timeout_s = float(head["timeout-s"])
    status, reasons = [UNRUN] * len(pids), [""] * len(pids)
    members: dict[int, RecordDict] = {}

    def put(i: int, member: RecordDict) -> None:
        members[i] = member
        status[i] = DONE

    def fail(i: int, exc: BaseException) -> None:
        status[i], reasons[i] = FAILED, with_traceback(exc)

    jobs, where = [], []
    for i, pid in enumerate(pids):
        try:
            state = content[f"strategy-state.{i}"] if f"strategy-state.{i}" in content else None
            job = prepare_job(env, pid, content[f"config.{i}"], state)
            if job is None:
                put(i, too_slow_content(env, pid))
            else:
                jobs.append(job)
                where.append(i)
        except Exception as exc:  # noqa: BLE001 (this client's failure, as on its own node)
            fail(i, exc)
    abandoned = False
    if jobs:
        weights = record_to_torch(content["arrays"])
        lock = threading.Lock()  # guards finished and started: the watchdog reads them together
        finished: list[RecordDict | Exception] = []  # job j's reply content or exception, in job order
        started = [time.monotonic()]  # when the running job started
        cancelled = threading.Event()  # set when a job overran: the thread must not start another

        # The reply is built on the training thread, before the next member trains: building it on this
        # thread beside the training would not shorten the rounds (one GIL).
        def report(j: int, result) -> bool:  # on the training thread
            try:
                if isinstance(result, Exception):
                    raise result
                reply: RecordDict | Exception = reply_content(env, jobs[j], result)
            except Exception as exc:  # noqa: BLE001 (this client's failure)
                reply = exc
            with lock:
                finished.append(reply)
                started[0] = time.monotonic()
            return not cancelled.is_set() and not STOPPING.is_set()

        crashed: list[BaseException] = []  # what stopped the training thread outside any one client

        def work(model: torch.nn.Module) -> None:
            torch.set_num_threads(sim.torch_threads)  # OpenMP's thread count is per thread
            try:
                train_cohort(env, model, weights, jobs, done=report)
            except BaseException as exc:  # noqa: BLE001 (e.g. the weights do not load: every client left fails)
                crashed.append(exc)

        trained = training_thread().run(partial(work, env.client_model))
        # vectorised, every client reports when the one batched call ends: the cohort gets each client's time
        budget_s = timeout_s * (len(jobs) if env.training_path[0] else 1)
        try:
            while True:  # wakes only at a client's deadline, not after every client
                with lock:
                    deadline = started[0] + budget_s
                trained.wait(max(0.0, deadline - time.monotonic()))
                with lock:  # the replies are read once, here: an abandoned thread may still report
                    alive = not trained.is_set()
                    if alive and time.monotonic() < started[0] + budget_s:
                        continue  # a job finished meanwhile: the next one has its own deadline
                    if alive:  # job len(finished) overran
                        cancelled.set()
                        abandoned = True
                    final = list(finished)
                break
        except BaseException:  # Ctrl-C or SIGTERM: the member training now returns first (up to its deadline)
            cancelled.set()
            with lock:
                deadline = started[0] + budget_s
            wait_out(trained, deadline - time.monotonic())
            raise
        done = len(final)
        for j, reply in enumerate(final):
            if isinstance(reply, Exception):
                fail(where[j], reply)
            else:
                put(where[j], reply)
        if abandoned:  # the overrunning job timed out (vectorised: all of them, one call); the rest go back unrun
            env.__dict__.pop("client_model", None)  # the abandoned thread keeps the old one
            _TRAINING[0].retired = True  # it goes on with the abandoned job: the next call gets a new thread
            for j in range(done, len(jobs) if env.training_path[0] else done + 1):
                status[where[j]], reasons[where[j]] = TIMEOUT, timeout_reason(sim.timeout_s)
        elif crashed:  # never reported: the thread's failure is theirs
            for j in range(done, len(jobs)):
                fail(where[j], crashed[0])
    records = {f"{key}.{i}": record for i in sorted(members) for key, record in members[i].items()}
    records["cohort"] = ConfigRecord({"status": status, "reasons": reasons, "abandoned": abandoned})
    return Message(content=record_dict(records), reply_to=msg)


def warm_up(scenario: Scenario) -> None:
    """A cohort node's start-up query: :func:`fedelastic.environment.warm_up` (data, model, its description), then
    :func:`~fedelastic.environment.freeze_heap` (a Ray worker's process is the run's; in-process, the driver unfreezes)."""
    env_warm_up(scenario)
    freeze_heap()


class CohortGrid(PassThroughGrid):
    """The server's grid in cohort mode: one virtual node per client over a few Flower nodes.

    ``grid`` is the runtime's grid (its nodes are the cohorts), ``cohorts`` how many of them
    the round's clients are shared among. Only ``send_and_receive`` is used by the server.
    """

    def __init__(self, grid: Grid, env: RunEnvironment, cohorts: int):
        super().__init__(grid)
        self.env, self.cohorts = env, max(1, cohorts)
        sc = env.scenario
        self.timeout_s = sc.simulation.timeout_s
        self.virtual = {p + 1: p for p in range(sc.num_clients)}  # virtual node id -> partition
        self.real: list[int] = []
        self.states: dict[int, object] = {}  # partition -> strategy state it kept (its node's context)
        self.queried = False
        self.sent = 0  # cohort messages sent (tags their replies)
        t = sc.train
        self._steps = {}
        for p in range(sc.num_clients):
            self._steps[p] = local_steps(len(env.data.partitions[p]), t.batch_size, t.local_epochs, t.max_steps)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        """A plain message to a virtual node (Flower's grid below knows only the cohort nodes)."""
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        """The virtual nodes, once every cohort node has registered (none before)."""
        if len(self.real) < self.cohorts:
            self.real = sorted(self.grid.get_node_ids())
            if len(self.real) < self.cohorts:
                return []
        return list(self.virtual)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("CohortGrid answers send_and_receive only")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("CohortGrid answers send_and_receive only")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)
        queries = [m for m in messages if m.metadata.message_type == MessageType.QUERY]
        trains = [m for m in messages if m.metadata.message_type != MessageType.QUERY]
        replies = [self._answer_query(m, timeout) for m in queries]
        if trains:
            replies.extend(self._train(trains))
        return replies

    def _answer_query(self, msg: Message, timeout: float | None) -> Message:
        """The partition of a virtual node; the first query also checks (and warms up) every cohort node."""
        if not self.queried:
            real = [
                Message(
                    content=RecordDict({"cohort": ConfigRecord({"warm-up": True})}),
                    message_type=MessageType.QUERY,
                    dst_node_id=n,
                )
                for n in self.real
            ]
            got = list(self.grid.send_and_receive(real, timeout=timeout))
            for reply in got:
                if reply.has_error():
                    raise RuntimeError(
                        f"node {reply.metadata.src_node_id} failed the start-up query: {reply.error.reason}"
                    )
            if len(got) != len(real):
                raise RuntimeError(f"{len(got)} of {len(real)} nodes answered the start-up query")
            self.queried = True
        pid = self.virtual[msg.metadata.dst_node_id]
        return Message(content=RecordDict({"metrics": MetricRecord({"partition-id": pid})}), reply_to=msg)

    def _chunks(self, members: list[int], trains: list[Message]) -> list[list[int]]:
        """Members (indices into ``trains``) shared among the cohorts: the longest first, each to the least loaded."""
        chunks: list[list[int]] = []
        groups: dict[int, list[int]] = {}
        for i in members:  # a cohort carries one set of global arrays
            groups.setdefault(id(trains[i].content["arrays"]), []).append(i)
        for group in groups.values():
            pid = lambda i: self.virtual[trains[i].metadata.dst_node_id]  # noqa: E731
            k = min(self.cohorts, len(group))
            load, parts = np.zeros(k), [[] for _ in range(k)]
            for i in sorted(group, key=lambda i: (-self._steps[pid(i)], pid(i))):
                j = int(np.argmin(load))
                parts[j].append(i)
                load[j] += self._steps[pid(i)] + 1  # a client costs about one step besides its steps
            chunks.extend(sorted(part, key=pid) for part in parts if part)
        return chunks

    def _pack(self, chunk: list[int], trains: list[Message], node: int) -> Message:
        pids = [self.virtual[trains[i].metadata.dst_node_id] for i in chunk]
        records = {"arrays": trains[chunk[0]].content["arrays"]}  # filled as a dict: one RecordDict at the end
        for j, (i, pid) in enumerate(zip(chunk, pids)):
            member = trains[i].content
            records[f"config.{j}"] = member["config"]
            if "strategy-state" in member:  # a resumed run hands back the checkpointed state
                records[f"strategy-state.{j}"] = member["strategy-state"]
            elif pid in self.states:
                records[f"strategy-state.{j}"] = self.states[pid]
        records["cohort"] = ConfigRecord({"partition-ids": pids, "timeout-s": self.timeout_s})
        self.sent += 1
        return Message(
            content=record_dict(records),
            message_type=MessageType.TRAIN,
            dst_node_id=node,
            group_id=f"cohort-{self.sent}",
        )

    def _train(self, trains: list[Message]) -> list[Message]:
        replies: list[Message] = []
        pending, alone = list(range(len(trains))), set()  # alone: sent one per message after a cohort failed
        while pending:
            chunks = self._chunks([i for i in pending if i not in alone], trains) + [[i] for i in pending if i in alone]
            packed = [self._pack(c, trains, self.real[j % len(self.real)]) for j, c in enumerate(chunks)]
            longest = max(len(c) for c in chunks)
            got = {m.metadata.group_id: m for m in self.grid.send_and_receive(packed, timeout=self.timeout_s * longest)}
            pending = []
            for chunk, msg in zip(chunks, packed):
                reply = got.get(msg.metadata.group_id)
                if reply is None or reply.has_error():
                    if len(chunk) > 1:  # the cohort failed as a whole: each of its clients on its own
                        pending.extend(chunk)
                        alone.update(chunk)
                    elif reply is not None:
                        replies.append(
                            Message(Error(code=reply.error.code, reason=reply.error.reason), reply_to=trains[chunk[0]])
                        )
                    continue  # no reply at all: the server records the timeout
                records = dict(reply.content.items())  # a plain dict: each member's records looked up once
                head = records["cohort"]
                for j, i in enumerate(chunk):
                    state, reason = head["status"][j], head["reasons"][j]
                    if state == DONE:
                        keys = [(k, f"{k}.{j}") for k in _MEMBER_KEYS]
                        member = record_dict({k: records[key] for k, key in keys if key in records})
                        if "strategy-state" in member:
                            self.states[self.virtual[trains[i].metadata.dst_node_id]] = member["strategy-state"]
                        replies.append(Message(content=member, reply_to=trains[i]))
                    elif state in (FAILED, TIMEOUT):
                        replies.append(Message(Error(code=0, reason=str(reason)), reply_to=trains[i]))
                    else:
                        pending.append(i)
        return replies


def cohort_count(scenario: Scenario, workers: int) -> int:
    """How many cohort nodes a run has: ``simulation.cohorts``, else one per worker (at most one per client)."""
    wanted = scenario.simulation.cohorts or workers
    return max(1, min(wanted, scenario.num_clients))
