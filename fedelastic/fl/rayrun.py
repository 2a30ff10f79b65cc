"""Flower's simulation on Ray: the ClientApp as Ray ships it, the client actors made early, and the run.

:func:`run_on_ray` runs the server (``runner``'s ServerApp body) and the ClientApp with
``flwr.simulation.run_simulation`` on Ray (a local cluster, or ``simulation.ray_address``), inside
the runtime patches where they are active (``fedelastic.runtime``), and records the local cluster's
processes in the run folder (``fedelastic.runtime.orphans``).
"""

from __future__ import annotations

import pickle
import sys
import threading
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path

from flwr.app import Context
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid

from ..environment import environment
from ..results.recorder import Recorder
from ..runtime import orphans
from ..runtime.backend import create_early_actors, resilient_actors
from ..runtime.dispatch import fast_dispatch, notify_pushed
from ..runtime.lifecycle import quick_shutdown, ray_processes, start_ray
from ..scenario import Scenario
from .cohort import CohortGrid, cohort_count
from .grids import GuardedGrid


def _loader(name: str = "load_with_driver_code"):
    """A worker-side function of :mod:`fedelastic.runtime.shipped_loader` (the loader of
    :class:`ShippedClientApp`, or the warm-up of :func:`start_actors_early`), which Ray ships by
    value (unpickling it imports no fedelastic)."""
    from ..runtime.shipped_loader import by_value

    return by_value(name)


def _driver_paths() -> tuple[str, list[str]]:
    """The folder the driver's fedelastic is in, and the driver's ``sys.path``."""
    import fedelastic

    return str(Path(fedelastic.__file__).resolve().parent.parent), [p for p in sys.path if p]


class ShippedClientApp(ClientApp):
    """The ClientApp as Ray ships it to its workers: with the driver's code path, unpickled once per worker.

    Ray puts the driver's working directory and script folder first on every worker's path, so a
    folder holding another copy of fedelastic would shadow the one the driver runs. Unpickling
    this app first puts the driver's fedelastic folder, then the driver's own ``sys.path``, ahead
    of the worker's, imports fedelastic from there, and only then unpickles the app (whose
    functions import the rest). This needs no Ray ``runtime_env``, so the workers ``ray.init``
    starts are used as they are rather than replaced by fresh ones (about a second of
    start-up). Flower pickles the app with every call; the pickled app is made once, and each
    worker keeps the app it unpickled.
    """

    def __init__(self, app: ClientApp):
        self.__dict__.update(app.__dict__)
        self._root, self._paths = _driver_paths()
        self._payload: bytes | None = None
        self._key = uuid.uuid4().hex  # names this app in the workers (a long-lived cluster serves many runs)

    def __reduce__(self):
        if self._payload is None:  # the loader's call, pickled once (not the loader by value at every call)
            from ray import cloudpickle

            plain = ClientApp.__new__(ClientApp)
            own = ("_root", "_paths", "_payload", "_key")
            plain.__dict__.update({k: v for k, v in self.__dict__.items() if k not in own})
            call = _Call(_loader(), (self._root, self._paths, self._key, cloudpickle.dumps(plain)))
            self._payload = cloudpickle.dumps(call)
        return (pickle.loads, (self._payload,))


class _Call:
    """Pickles as the call ``fn(*args)``: unpickling it calls ``fn``."""

    def __init__(self, fn, args: tuple):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


def client_resources(sim) -> dict:
    """What each of Flower's client actors reserves on Ray (``simulation.num_cpus_per_client``, no GPU)."""
    return {"num_cpus": sim.num_cpus_per_client, "num_gpus": 0.0}


def start_actors_early(scenario: Scenario) -> int:
    """Create Flower's client actors now, Ray being up, rather than when the simulation starts;
    returns how many.

    Each actor, as it is created, puts the driver's code first on its path (as
    :class:`ShippedClientApp` does), imports the runtime and builds its data and client model,
    with the driver's model description (:func:`fedelastic.fl.clientapp.warm_worker`), while the driver sets the run
    up. Flower's Ray backend then takes these actors (``fedelastic.runtime.backend.early_actors``) instead of
    creating its own. Call it after the runtime's imports and the data (``orchestrate.prepare_run``).
    """
    from ray import cloudpickle

    from .. import plugins
    from .clientapp import warm_worker

    env = environment(scenario)
    warm = partial(warm_worker, scenario, plugins.registered(), env.info)
    root, paths = _driver_paths()
    init = partial(_loader("warm_with_driver_code"), root, paths, cloudpickle.dumps(warm))
    return create_early_actors(client_resources(scenario.simulation), init)


def ray_workers(cpus_per_client: float) -> int:
    """How many client workers Flower's Ray backend starts: per Ray node, its CPUs over a client's (at least 1)."""
    import ray

    total = sum(int(n["Resources"].get("CPU", 0) / cpus_per_client) for n in ray.nodes() if n.get("Resources"))
    return max(1, total)


def run_on_ray(
    scenario: Scenario, server: Callable[[Grid], None], client_app: ClientApp, stop: threading.Event, recorder: Recorder
) -> None:
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    sim = scenario.simulation
    app = ServerApp()

    nodes = scenario.num_clients
    sends = [0]

    def record_early() -> None:  # the workers and agents Ray starts with the first rounds
        sends[0] += 1
        if sends[0] <= 2:
            _record_ray(recorder.folder)

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        try:
            guarded = GuardedGrid(grid, stop, on_sent=lambda: (recorder.hand_over(), record_early()))
            server(CohortGrid(guarded, environment(scenario), nodes) if cohort else guarded)
        finally:
            stop.set()  # the runtime's workers stop waiting on hung clients
            notify_pushed()  # and the dispatch loop sees the end now, not at its next sweep

    start_ray(scenario)
    _record_ray(recorder.folder)  # the cluster's processes, for the next run to clean up after a kill -9
    cohort = sim.node_mode == "cohort"
    if cohort:  # one Flower node per Ray worker (or simulation.cohorts), each training a share of every round
        nodes = cohort_count(scenario, ray_workers(sim.num_cpus_per_client))
    try:
        with fast_dispatch(), resilient_actors(retries=sim.client_retries, timeout_s=sim.timeout_s, stop=stop) as pool:
            recorder.notes["actors_replaced"] = 0
            run_simulation(
                server_app=app,
                client_app=ShippedClientApp(client_app),
                num_supernodes=nodes,
                backend_config={"client_resources": client_resources(sim)},
            )
            recorder.notes["actors_replaced"] = pool.replaced  # dead or hung workers replaced by fresh ones
    finally:
        stop.set()
        quick_shutdown()
        orphans.stop_recorded(recorder.folder)  # what Ray's own shutdown left (patches off), then the record


def _record_ray(run_dir: Path) -> None:
    """Record the processes of the local Ray cluster this process started in ``run_dir`` (none: nothing)."""
    procs = ray_processes()
    if procs:
        orphans.record(run_dir, procs)


