"""Run a scenario: Flower's simulation on the Ray backend, or the same apps called in-process.

``backend = "ray"`` is the real runtime (``flwr.simulation.run_simulation``). ``"inprocess"``
drives the same ClientApp and server strategy through a minimal :class:`InProcessGrid`, for
tests and for measuring Flower/Ray's own overhead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from ..config import to_dict
from ..pretrain import initial_state
from ..results import Recorder
from ..scenario import Scenario
from .client import make_client_app
from .dispatch import fast_dispatch
from .env import environment
from .server import make_server_app, server_main


class InProcessGrid(Grid):
    """A Grid that calls a ClientApp directly; node ids are random, as in Flower."""

    def __init__(self, client_app: ClientApp, num_nodes: int):
        self.app = client_app
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = (
            0,
            1,
            0,
        )  # what Flower's runtime sets in a ServerApp process
        ids = np.random.default_rng().choice(2**31, size=num_nodes, replace=False)
        self.contexts = {
            int(node): Context(0, int(node), {"partition-id": i, "num-partitions": num_nodes}, RecordDict(), {})
            for i, node in enumerate(ids)
        }
        self._replies: dict[str, Message] = {}
        self._run = None

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def _call(self, msg: Message) -> Message:
        node = msg.metadata.dst_node_id
        try:
            reply = self.app(msg, self.contexts[node])
        except Exception as exc:  # a client failure becomes an error reply, as in Flower
            reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
        return reply

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for i, msg in enumerate(messages):
            key = f"{len(self._replies)}-{i}"
            self._replies[key] = self._call(msg)
            ids.append(key)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return [self._call(msg) for msg in messages]


def new_run_dir(scenario: Scenario, run_id: str | None = None) -> Path:
    run_id = run_id or time.strftime("%Y%m%d-%H%M%S") + f"-s{scenario.seed}"
    return Path(scenario.output_dir) / scenario.name / run_id


def run_scenario(
    scenario: Scenario,
    *,
    run_id: str | None = None,
    progress: Callable[[dict], None] | None = None,
    grid: Grid | None = None,
) -> Path:
    """Run ``scenario`` to completion; returns the run folder. Results reach disk every round.

    With ``grid`` (a Flower App's ServerApp passes its own), the rounds run on that grid's
    nodes and ``simulation.backend`` is not used.
    """
    run_dir = new_run_dir(scenario, run_id)
    recorder = Recorder(run_dir, to_dict(scenario))
    progress = progress or (lambda row: None)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    env = environment(scenario)
    try:
        state = initial_state(env)
        client_app = make_client_app(scenario)
        sim = scenario.simulation
        if grid is not None or sim.backend == "inprocess":
            grid = grid or InProcessGrid(client_app, scenario.num_clients)
            server_main(scenario, state, recorder, progress, grid)
        else:
            from flwr.simulation import run_simulation

            init_args: dict = {"include_dashboard": False, "logging_level": logging.ERROR}
            if sim.ray_address:
                init_args["address"] = sim.ray_address
            with fast_dispatch():  # Flower's own dispatch loop is O(nodes^2) per 0.1 s sweep
                run_simulation(
                    server_app=make_server_app(scenario, state, recorder, progress),
                    client_app=client_app,
                    num_supernodes=scenario.num_clients,
                    backend_config={
                        "client_resources": {"num_cpus": sim.num_cpus_per_client, "num_gpus": 0.0},
                        "init_args": init_args,
                    },
                )
        done = len(recorder.rounds.rows) - 1  # row 0 is the initial model
        if done < scenario.server.rounds:
            raise RuntimeError(f"the simulation stopped after {max(done, 0)} of {scenario.server.rounds} rounds")
    except BaseException as exc:
        recorder.status("failed", error=f"{type(exc).__name__}: {exc}")
        raise
    recorder.status("completed")
    return run_dir
