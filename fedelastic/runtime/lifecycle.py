"""Starting and stopping Ray for a run: a local cluster quickly, or an existing one by its address.

:func:`start_ray` starts Ray (or connects to ``simulation.ray_address``), with Ray's start-up
patches where they are active (:mod:`fedelastic.runtime.raystart`); :func:`start_ray_beside` runs the
driver's own start-up work on a thread while ``ray.init`` waits for its daemons
(:func:`fedelastic.fl.raypool.start_ray_early` does so before the runtime is imported, creating
Flower's client actors early). :func:`quick_shutdown` kills the autoscaler monitor if
there is one (its SIGTERM handler reports to the GCS Ray has already stopped, so ``ray.shutdown``
waits a full second on it), shuts Ray down and returns once every process of the cluster has
exited. The crash-tolerant client calls of Flower's Ray backend are in :mod:`fedelastic.runtime.backend`.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import warnings
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from ..errors import ConfigError
from . import patches
from .orphans import descendants, reap
from .raystart import _ray_start_patches

T = TypeVar("T")


EARLY: dict = {}  # actors created as soon as Ray was up ("actors"), with the resources they reserve ("resources")
_APPS: dict[str, object] = {}  # in a worker: the ClientApp it runs (fedelastic.fl.rayrun.ShippedClientApp)


def unpickled_app(root: str, key: str, payload: bytes):
    """The ClientApp pickled in ``payload``, unpickled once per worker and app (``key``)."""
    if key not in _APPS:
        import pickle

        plain_message_pickling()  # the worker's replies
        os.environ["FEDELASTIC_ROOT"] = root  # the folder the driver runs fedelastic from (fedelastic.fl.clientapp.check_same_code)
        _APPS.clear()
        _APPS[key] = pickle.loads(payload)
    return _APPS[key]


def plain_message_pickling() -> None:
    """Ray pickles Flower's ``Message`` in this process with the standard library's pickle (its C
    pickler), not cloudpickle (``ray.util.register_serializer``; this process's Ray must be up).

    cloudpickle calls its Python ``reducer_override`` for every object it meets: a cohort's reply
    (25 clients' arrays, metrics and state, 0.67 MB) takes 1.5x the CPU to pickle (1.58 against
    1.08 ms, ``benchmarks/message_pickling.py``), and more wall time in a process whose other
    threads want the GIL. A message holds Flower's records only, which plain pickle handles; the
    receiving process unpickles it with ``pickle.loads``, so it needs no registration, and gets
    the same message back.
    """
    import pickle

    from flwr.app import Message
    from ray.util import register_serializer

    register_serializer(Message, serializer=partial(pickle.dumps, protocol=5), deserializer=pickle.loads)


def stop_autoscaler() -> None:
    """Kill the autoscaler monitor of the local cluster this process started (nothing else, and nothing if none).

    A single-node cluster has nothing to scale; ``ray.shutdown`` would SIGTERM the monitor after
    the GCS is gone, wait a full second for it, then SIGKILL it.
    """
    for proc in _node_processes("PROCESS_TYPE_MONITOR"):
        if proc.poll() is None:
            proc.kill()
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                pass


def _node_processes(kind: str | None = None) -> list[subprocess.Popen]:
    """The processes ``ray.init`` started here for its local cluster (all, or those of ``ray_constants.<kind>``); [] if none."""
    try:
        import ray._private.worker as ray_worker
        from ray._private import ray_constants

        node = ray_worker._global_node
        if node is None:
            return []
        kinds = [getattr(ray_constants, kind)] if kind else list(node.all_processes)
        infos = [info for kind in kinds for info in node.all_processes.get(kind, ())]
    except Exception:  # noqa: BLE001 (another Ray: leave the shutdown to it)
        return []
    return [p for p in (getattr(info, "process", None) for info in infos) if isinstance(p, subprocess.Popen)]


def ray_processes() -> dict[int, str]:
    """pid -> start time of every live process of the local cluster this process started (workers
    and agents included); {} when it started none."""
    return descendants([p.pid for p in _node_processes()])


#: Ray's settings for a local cluster this process starts (``ray.init(_system_config=...)``): a
#: raylet, worker or driver that finds its object store or raylet socket not yet listening tries
#: again after 50 ms instead of Ray's 1 s (the same 10 s in all). The raylet connects to the
#: object store it has just started on another thread; when it looks before the store listens,
#: Ray's default costs the start-up a whole second (about one start in five here).
LOCAL_SYSTEM_CONFIG = {"raylet_client_connect_timeout_milliseconds": 50, "raylet_client_num_connect_attempts": 200}

# Ray starts its worker processes at nice 15 (its ``worker_niceness``): on a quiet machine they
# compete only with the driver, but beside another job at nice 0 (a browser, a build) the CPU
# scheduler gives each worker about 36/1024 of the weight of that job's processes, and a run
# trained at ~0.1 of its quiet speed beside 2 busy loops on 2 cores (benchmarks/studies/throughput.md,
# "A busy machine"). A local cluster's workers get the driver's niceness instead.


def ray_init_args(sim) -> dict:
    """Ray's init arguments: no dashboard, Ray's own log lines at ERROR and above only, and for a
    local cluster workers at the driver's niceness (not Ray's nice 15) and, where Ray's
    patches are active, :data:`LOCAL_SYSTEM_CONFIG` (a running cluster keeps its own settings).

    No ``runtime_env``: a job-wide one makes Ray start fresh workers for the job instead of using
    those ``ray.init`` starts (``rayrun.ShippedClientApp`` puts the driver's code first instead).
    """
    args: dict = {"include_dashboard": False, "logging_level": logging.ERROR}
    if sim.ray_address:
        args["address"] = sim.ray_address
    elif _starts_local_cluster():
        args["_system_config"] = {"worker_niceness": os.nice(0)} | (LOCAL_SYSTEM_CONFIG if patches.active("ray") else {})
    return args


def _starts_local_cluster() -> bool:
    """Whether ``ray.init()`` without an address starts a cluster: it connects instead to
    ``RAY_ADDRESS``'s, or to the one ``ray start`` recorded (``<ray temp dir>/ray_current_cluster``),
    and a connecting ``ray.init`` refuses ``_system_config``. False for a Ray without that record."""
    if os.environ.get("RAY_ADDRESS"):
        return False
    try:
        from ray._private.services import find_bootstrap_address

        return find_bootstrap_address(None) is None
    except Exception:  # noqa: BLE001 (another Ray: its settings are left alone)
        return False


def probe(address: str, src: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds, not Ray's half minute of retries, when a ``host:port`` cluster address does not answer."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not address or address == "auto" or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(src, "simulation.ray_address", f"a reachable Ray cluster ({reason})", address) from None


def start_ray(scenario) -> None:
    """``ray.init`` (a local cluster, or ``simulation.ray_address``) unless Ray is already up.

    Call it on the main thread: Ray ties its daemons' lives to the thread that starts them.
    """
    import ray

    sim, src = scenario.simulation, scenario.source or "<scenario>"
    patches.configure(sim.patches)
    if not ray.is_initialized():
        probe(sim.ray_address, src)
        try:
            # Ray 2.55's "Tip" about a future default (accelerator env vars, which no client here uses): this one only
            warnings.filterwarnings("ignore", "Tip: In future versions of Ray", FutureWarning, "ray._private.worker")
            with _ray_start_patches():
                ray.init(**ray_init_args(sim))
        except Exception as exc:  # noqa: BLE001 (Ray raises ConnectionError, RuntimeError, ValueError...)
            from ..results.recorder import one_line

            raise ConfigError(
                src, "simulation.ray_address", f"a reachable Ray cluster ({one_line(str(exc))})", sim.ray_address
            ) from None
        finally:
            from ..signals import reclaim_sigterm

            reclaim_sigterm()  # ray.init's own SIGTERM handler (sys.exit) would skip the run's last writes
    plain_message_pickling()  # the driver's messages to the workers


def start_ray_beside(scenario, work: Callable[[], T]) -> T:
    """``work()`` on a helper thread while this thread starts Ray (:func:`start_ray`): the two overlap.

    Ray's start is mostly waiting for its daemons; ``work`` is the driver's own (imports, data,
    the model's description, checks). An error of ``work`` wins: Ray is shut down and the error
    raised, as if Ray had not been started. Returns what ``work`` returned.
    """
    box: list = []

    def run() -> None:
        try:
            box.append(work())
        except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
            box.append(exc)

    thread = threading.Thread(target=run, name="fedelastic-beside-ray", daemon=True)
    thread.start()
    try:
        start_ray(scenario)
    except BaseException as exc:
        if not isinstance(exc, Exception):  # Ctrl-C: do not wait for ``work`` first
            raise
        thread.join()
        if box and isinstance(box[0], BaseException):
            raise box[0] from None
        raise
    thread.join()
    if isinstance(box[0], BaseException):
        quick_shutdown()
        raise box[0]
    return box[0]


def quick_shutdown(wait_s: float = 3.0) -> None:
    """``ray.shutdown()`` of the local cluster this process started, without waiting on its
    autoscaler; returns once every process of that cluster has exited (workers included).

    Ray stops its own processes but not the workers they started, which exit on their own a
    moment later. Any of them still running after ``wait_s`` seconds is killed.
    """
    import ray

    EARLY.clear()
    if not ray.is_initialized():
        return
    ours = ray_processes()
    stop_autoscaler()
    ray.shutdown()
    reap(ours, wait_s)


