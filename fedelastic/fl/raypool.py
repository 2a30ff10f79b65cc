"""Flower's Ray backend: crash-tolerant client calls, and starting and stopping Ray quickly.

Flower 1.41's ``RayBackend.process_message`` hands a job to an actor and, if the call fails for
any reason, puts the actor back in its pool. When the actor's *process* died (a segfault, an
``os._exit``, the OOM killer), every later job sent to that actor fails with ``ActorDiedError``:
one crash poisons the rest of the run. It also waits for a reply without limit, so a hung
client keeps the runtime (and the driver) alive forever.

:func:`resilient_actors` swaps in a ``process_message`` that

* replaces a dead actor with a fresh one and retries the client on a healthy actor, at most
  ``retries`` more times (the node's context is the driver's, so the retry starts clean);
* gives up on a client after ``timeout_s`` (the round's timeout), kills its actor and starts a
  new one, so later rounds use the full pool;
* stops waiting as soon as the run is over (``stop`` is set), so the driver exits.

Any other client error is returned to the pool and reported as Flower reports it. A cohort message
(``fl/cohort.py``) gets ``timeout_s`` per client it trains, and a cohort that abandoned a hung
client (its reply says so) has its worker replaced after it replies.

Start and stop: :func:`start_ray_beside` runs the driver's own start-up work on a
thread while ``ray.init`` waits for its daemons; :func:`no_autoscaler` starts a local cluster
without Ray's autoscaler monitor, which has nothing to scale on one machine (``ray start
--no-monitor`` in Ray's own CLI; ``ray.init`` has no argument for it), and :func:`no_dashboard`
without the dashboard's head process, which ``include_dashboard=False`` still starts and waits
for. At the end the patched ``terminate`` kills the workers (``ray.kill``: Flower's
``exit_actor()`` runs each worker's interpreter teardown first), and :func:`quick_shutdown`
kills a monitor if there is one (its SIGTERM handler reports to the GCS Ray has already stopped,
so ``ray.shutdown`` waits a full second on it), shuts Ray down and returns once every process of
the cluster has exited. The client actors are :func:`actor_class`'s: a copy of Flower's that Ray
ships by value, so that a worker does not import ``flwr.simulation``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import ConfigError

T = TypeVar("T")


@dataclass
class _Settings:
    retries: int = 1
    timeout_s: float = 3600.0
    stop: threading.Event = field(default_factory=threading.Event)
    replaced: int = 0  # actors replaced during the run (dead or hung)
    active: int = 0  # client calls in flight
    lock: threading.Lock = field(default_factory=threading.Lock)


_SETTINGS = _Settings()


class ClientTimeout(TimeoutError):
    pass


def timeout_reason(timeout_s: float) -> str:
    """The error of a client that did not reply in time (its row's ``error``; the same on every path)."""
    return f"timeout: no reply within simulation.timeout_s = {timeout_s:g} s"


_APPS: dict[str, object] = {}  # in a worker: the ClientApp it runs (fl/runner.ShippedClientApp)


def unpickled_app(root: str, key: str, payload: bytes):
    """The ClientApp pickled in ``payload``, unpickled once per worker and app (``key``)."""
    if key not in _APPS:
        import pickle

        os.environ["FEDELASTIC_ROOT"] = root  # the folder the driver runs fedelastic from (client.check_same_code)
        _APPS.clear()
        _APPS[key] = pickle.loads(payload)
    return _APPS[key]


_EARLY: dict = {}  # actors created as soon as Ray was up ("actors"), with the resources they reserve ("resources")

#: Flower 1.41's client actor (``flwr.simulation.ray_transport.ray_actor``: ``ClientAppActor`` and
#: its base's ``run`` and ``terminate``), method for method, built outside any importable module
#: (as ``runner._loader`` is) so that Ray ships the class by value. A worker unpickling Flower's
#: own class imports its module, hence the package ``flwr.simulation``, whose ``__init__``
#: imports Flower's CLI, SQL state and web stack (sqlalchemy, alembic, fastapi...): ~0.45 s and
#: ~85,000 objects per worker that a client never uses. Unpickling this copy imports
#: ``flwr.clientapp`` only. :func:`actor_class` uses it only while its methods compile to the same
#: code as Flower's.
_ACTOR_SOURCE = """
from logging import WARNING

import ray
from flwr.clientapp.client_app import ClientAppException, LoadClientAppError
from flwr.supercore import log


class VirtualClientEngineActor:
    def terminate(self):
        log(WARNING, "Manually terminating %s", self.__class__.__name__)
        ray.actor.exit_actor()

    def run(self, client_app_fn, message, cid, context):
        try:
            app = client_app_fn()
            out_message = app(message=message, context=context)
        except LoadClientAppError as load_ex:
            raise load_ex
        except Exception as ex:
            raise ClientAppException(str(ex)) from ex
        return cid, out_message, context


class ClientAppActor(VirtualClientEngineActor):
    def __init__(self, on_actor_init_fn=None):
        super().__init__()
        if on_actor_init_fn:
            on_actor_init_fn()
"""
_ACTOR_METHODS = ("__init__", "run", "terminate")
_ACTORS: list = []  # the Ray actor class actor_class() chose, once per process


def _same_code(ours, theirs) -> bool:
    """Whether two functions compile to the same instructions (constants by value: a docstring
    shifts their indices), names and exception table."""
    import dis
    import inspect

    ours, theirs = inspect.unwrap(ours), inspect.unwrap(theirs)  # through Ray's tracing wrappers
    a, b = ours.__code__, theirs.__code__
    ops = [[(i.opname, i.argval) for i in dis.get_instructions(c)] for c in (a, b)]
    keys = ("co_names", "co_varnames", "co_argcount", "co_freevars", "co_exceptiontable")
    same = all(getattr(a, k, None) == getattr(b, k, None) for k in keys)
    return ops[0] == ops[1] and same and ours.__defaults__ == theirs.__defaults__


def light_actor():
    """The plain class of :data:`_ACTOR_SOURCE`'s ``ClientAppActor`` (not yet a Ray actor class)."""
    namespace: dict = {"__name__": "fedelastic_ray_actor"}
    exec(compile(_ACTOR_SOURCE, "<fedelastic ray actor>", "exec"), namespace)  # noqa: S102 (fixed source above)
    return namespace["ClientAppActor"]


def actor_class():
    """The Ray actor class of Flower's client actors: :func:`light_actor` while its methods are
    Flower's (compared compiled), else Flower's ``ClientAppActor`` itself."""
    if not _ACTORS:
        import ray
        from flwr.simulation.ray_transport.ray_actor import ClientAppActor

        flower = ClientAppActor.__ray_metadata__.modified_class if hasattr(ClientAppActor, "__ray_metadata__") else None
        light = light_actor()
        same = flower is not None and all(
            hasattr(flower, m) and _same_code(getattr(light, m), getattr(flower, m)) for m in _ACTOR_METHODS
        )
        _ACTORS.append(ray.remote(light) if same else ClientAppActor)
    return _ACTORS[0]


def create_early_actors(resources: dict, init: Callable[[], None]) -> int:
    """Create as many of Flower's client actors as its Ray backend would (each reserving
    ``resources``), each running ``init`` as it starts; :func:`early_actors` hands them to the
    backend's pool. Returns how many."""
    from flwr.simulation.ray_transport.ray_actor import pool_size_from_resources

    count = pool_size_from_resources(resources)
    actors = [actor_class().options(**resources).remote(on_actor_init_fn=init) for _ in range(count)]
    _EARLY.update(actors=actors, resources=dict(resources))
    return count


def early_actors(resources: dict) -> list:
    """The actors :func:`create_early_actors` made for ``resources`` (each handed out once); [] if none."""
    actors, made_for = _EARLY.pop("actors", []), _EARLY.pop("resources", None)
    if made_for == resources:
        return actors
    _kill(actors)  # made for other resources: of no use to this pool
    return []


def _kill(actors) -> None:
    import ray

    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 (already gone)
            pass


#: The names Flower 1.41's ``RayBackend.build`` uses: a pool of ``actors_capacity`` actors of
#: ``client_resources``, and the app. A build using other names is left as it is.
_BUILD_NAMES = frozenset(
    {"BasicActorPool", "ClientAppActor", "DEBUG", "Exception", "actor_kwargs", "actors_capacity",
     "add_actors_to_pool", "app_fn", "client_resources", "log", "num_actors", "pool"}
)  # fmt: skip


def _same_build(build) -> bool:
    import inspect

    code = getattr(inspect.unwrap(build), "__code__", None)  # through a functools.wraps wrapper (a benchmark's stamps)
    return code is not None and set(code.co_names) == _BUILD_NAMES


def _build(self, app_fn) -> None:
    """Flower's ``RayBackend.build`` with :func:`actor_class`'s actors, the actors made early
    (:func:`create_early_actors`) in its pool instead of new ones when they were made for this
    pool's resources."""
    actors = early_actors(self.client_resources)
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    self.pool = BasicActorPool(
        actor_type=actor_class(), client_resources=self.client_resources, actor_kwargs=self.actor_kwargs
    )
    capacity = self.pool.actors_capacity
    _kill(actors[capacity:])
    self.pool.pool.extend(actors[:capacity])
    self.pool.num_actors += len(actors[:capacity])
    if capacity > len(actors):
        self.pool.add_actors_to_pool(capacity - len(actors))
    self.app_fn = app_fn


def _retire(pool, future, *, replace: bool) -> None:
    """Kill the actor that ran ``future`` and, unless the run is stopping, put a fresh one in the pool."""
    import ray

    actor = pool._future_to_actor.pop(future, None)
    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone  # noqa: BLE001
            pass
    if replace:
        pool.pool.append(pool.create_actor_fn())
        _SETTINGS.replaced += 1


def _process_message(self, message, context):
    with _SETTINGS.lock:
        _SETTINGS.active += 1
    try:
        return _call_client(self, message, context)
    finally:
        with _SETTINGS.lock:
            _SETTINGS.active -= 1


def _terminate(original):
    def terminate(self) -> None:
        """Stop the client calls first (Ray aborts the process if a thread touches it after
        shutdown), then end the workers and the cluster (:func:`quick_shutdown`)."""
        import ray

        _SETTINGS.stop.set()
        deadline = time.monotonic() + 5.0
        while _SETTINGS.active and time.monotonic() < deadline:
            time.sleep(0.05)
        pool = getattr(self, "pool", None)
        idle = getattr(pool, "pool", None)
        if isinstance(idle, list):  # kill the workers outright: Flower's polite exit_actor() runs each
            busy = list(getattr(pool, "_future_to_actor", {}).values())  # worker's interpreter teardown
            for actor in idle + busy:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 (already gone)
                    pass
            idle.clear()  # nothing left for Flower's terminate_all_actors to message
        quick_shutdown()
        original(self)  # Flower's own teardown (its ray.shutdown finds Ray stopped)

    return terminate


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


def _descendants(roots: list[int]) -> dict[int, str]:
    """pid -> start time of every live descendant of ``roots`` (and the roots); {} without /proc."""
    children: dict[int, list[int]] = {}
    started: dict[int, str] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return {}
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # an exited process not yet reaped is gone already
            children.setdefault(int(fields[1]), []).append(int(entry))
            started[int(entry)] = fields[19]
    found: dict[int, str] = {}
    stack = [r for r in roots if r in started]
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = started[pid]
            stack.extend(children.get(pid, ()))
    return found


def _alive(procs: dict[int, str]) -> dict[int, str]:
    """The processes of ``procs`` still running (same pid and start time, not a zombie)."""
    left = {}
    for pid, start in procs.items():
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and fields[19] == start:
            left[pid] = start
    return left


#: Ray's settings for a local cluster this process starts (``ray.init(_system_config=...)``): a
#: raylet, worker or driver that finds its object store or raylet socket not yet listening tries
#: again after 50 ms instead of Ray's 1 s (the same 10 s in all). The raylet connects to the
#: object store it has just started on another thread; when it looks before the store listens,
#: Ray's default costs the start-up a whole second (about one start in five here).
LOCAL_SYSTEM_CONFIG = {"raylet_client_connect_timeout_milliseconds": 50, "raylet_client_num_connect_attempts": 200}


def ray_init_args(sim) -> dict:
    """Ray's init arguments: no dashboard, Ray's own log lines at ERROR and above only, and
    :data:`LOCAL_SYSTEM_CONFIG` for a local cluster (a running cluster keeps its own settings).

    No ``runtime_env``: a job-wide one makes Ray start fresh workers for the job instead of using
    those ``ray.init`` starts (``runner.ShippedClientApp`` puts the driver's code first instead).
    """
    args: dict = {"include_dashboard": False, "logging_level": logging.ERROR}
    if sim.ray_address:
        args["address"] = sim.ray_address
    elif _starts_local_cluster():
        args["_system_config"] = dict(LOCAL_SYSTEM_CONFIG)
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
    if not ray.is_initialized():
        probe(sim.ray_address, src)
        try:
            with no_autoscaler(), no_dashboard(), prompt_node_wait():  # used only when ray.init starts a local cluster
                ray.init(**ray_init_args(sim))
        except Exception as exc:  # noqa: BLE001 (Ray raises ConnectionError, RuntimeError, ValueError...)
            from ..results import one_line

            raise ConfigError(
                src, "simulation.ray_address", f"a reachable Ray cluster ({one_line(str(exc))})", sim.ray_address
            ) from None
        finally:
            from ..signals import reclaim_sigterm

            reclaim_sigterm()  # ray.init's own SIGTERM handler (sys.exit) would skip the run's last writes


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


def start_ray_early(scenario, prepare: Callable[[], object]) -> bool:
    """Start the local Ray cluster of ``scenario`` now, with ``prepare()`` (the driver's imports
    and data) on a thread beside it; True if this call started Ray.

    The entry points (``api.run``, ``fedelastic run``) call it before they import the runtime, so
    that ``ray.init`` overlaps those imports too. Best effort: an error of ``prepare``
    or of ``ray.init`` is left for the run, which meets it again and reports it as usual. The
    caller shuts Ray down (:func:`quick_shutdown`) if the run ends before it does.
    """
    sim = scenario.simulation
    if sim.backend != "ray" or sim.ray_address:  # connecting to a running cluster is quick
        return False
    import ray

    if ray.is_initialized():
        return False

    def quietly() -> None:
        try:
            prepare()
        except Exception:  # noqa: BLE001,S110 (the run prepares again and reports the error)
            pass

    try:
        start_ray_beside(scenario, quietly)
        if ray.is_initialized():
            early_start(scenario)
    except Exception:  # noqa: BLE001 (the run starts Ray again and reports the error)
        return False
    except BaseException:  # Ctrl-C while Ray starts or the data is prepared: leave no cluster behind
        if ray.is_initialized():
            quick_shutdown()
        raise
    return ray.is_initialized()


def early_start(scenario) -> None:
    """Flower's client actors created now (``runner.start_actors_early``), so that they import the
    runtime and build their data while the driver sets the run up. Best effort: an error leaves
    the actors to Flower, which creates them when the simulation starts."""
    try:
        from .runner import start_actors_early

        start_actors_early(scenario)
    except Exception:  # noqa: BLE001,S110 (the run meets the error again and reports it)
        _kill(_EARLY.pop("actors", []))
        _EARLY.clear()


@contextmanager
def prompt_node_wait(period_s: float = 0.02) -> Iterator[bool]:
    """Inside this block ``ray.init`` goes on as soon as its raylet has registered, not at Ray's next 1 s poll.

    ``ray.init`` waits for the raylet it started through ``services.get_node``, whose C++ loop
    (``GlobalStateAccessor::GetNode``) sleeps a fixed second between looks at the GCS's node
    table: the raylet registers at a random point of that second, so ``ray.init`` waits half a
    second on average for nothing. The block swaps in a ``get_node`` that looks every
    ``period_s`` (at most Ray's own 30 s) and then asks Ray's, which finds the node at once.
    Yields whether it could (a Ray without these functions is left as it is).
    """
    try:
        import ray._private.services as services
        from ray._private.state import GlobalState

        original, options = services.get_node, services._get_gcs_client_options
    except Exception:  # noqa: BLE001 (another Ray)
        yield False
        return

    def get_node(gcs_address, node_id):
        try:
            state = GlobalState()
            state._initialize_global_state(options(gcs_address))
            deadline = time.monotonic() + 30.0
            try:
                while time.monotonic() < deadline:
                    table = state.node_table()
                    if any(n.get("NodeID") == node_id and n.get("Alive") for n in table):
                        break
                    if not all("NodeID" in n and "Alive" in n for n in table):  # another Ray's table: its own wait
                        break
                    time.sleep(period_s)
            finally:
                state.disconnect()
        except Exception:  # noqa: BLE001,S110 (Ray's own wait below decides)
            pass
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield True
    finally:
        services.get_node = original


@contextmanager
def no_autoscaler() -> Iterator[bool]:
    """Inside this block ``ray.init`` starts a local cluster without its autoscaler monitor.

    Ray builds its ``RayParams`` inside ``ray.init``; the block swaps in a subclass whose
    ``no_monitor`` defaults to True. Yields whether it could (a Ray without that parameter is
    left as it is).
    """
    import inspect

    try:
        import ray._private.parameter as parameter

        original = parameter.RayParams
        usable = "no_monitor" in inspect.signature(original.__init__).parameters
    except Exception:  # noqa: BLE001 (another Ray)
        usable = False
    if not usable:
        yield False
        return

    class RayParams(original):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("no_monitor", True)
            super().__init__(*args, **kwargs)

    parameter.RayParams = RayParams
    try:
        yield True
    finally:
        parameter.RayParams = original


@contextmanager
def no_dashboard() -> Iterator[bool]:
    """Inside this block ``ray.init(include_dashboard=False)`` starts a local cluster without the
    dashboard's head process.

    With ``include_dashboard=False`` Ray still starts that process, to run its usage-stats module
    only, and waits for it to publish its address (looking every 0.1 s) before it starts the
    raylet: ~0.5 s of every local start here. The block makes ``Node.start_api_server``
    return at once when the dashboard is not wanted; a wanted one (``True`` or Ray's default
    ``None``) starts as Ray starts it. Yields whether it could (a Ray whose ``start_api_server`` takes
    other arguments is left as it is).
    """
    import inspect

    try:
        from ray._private.node import Node

        original = Node.start_api_server
        usable = list(inspect.signature(original).parameters) == ["self", "include_dashboard", "raise_on_failure"]
    except Exception:  # noqa: BLE001 (another Ray)
        usable = False
    if not usable:
        yield False
        return

    def start_api_server(self, *, include_dashboard, raise_on_failure):
        if include_dashboard is False:
            self._webui_url = ""  # the address that process publishes without its web modules (raylet and workers get it)
            return None
        return original(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)

    Node.start_api_server = start_api_server
    try:
        yield True
    finally:
        Node.start_api_server = original


def quick_shutdown(wait_s: float = 3.0) -> None:
    """``ray.shutdown()`` of the local cluster this process started, without waiting on its
    autoscaler; returns once every process of that cluster has exited (workers included).

    Ray stops its own processes but not the workers they started, which exit on their own a
    moment later. Any of them still running after ``wait_s`` seconds is killed.
    """
    import ray

    _EARLY.clear()
    if not ray.is_initialized():
        return
    ours = _descendants([p.pid for p in _node_processes()])
    stop_autoscaler()
    ray.shutdown()
    deadline = time.monotonic() + wait_s
    while (left := _alive(ours)) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _call_client(self, message, context):
    import ray

    if _SETTINGS.stop.is_set() or not ray.is_initialized():
        raise ClientTimeout("the run ended before this client started")

    pid = str(context.node_config["partition-id"])
    tries = _SETTINGS.retries + 1
    # a cohort message (fl/cohort.py) trains several clients, each allowed timeout_s
    members = len(message.content["cohort"]["partition-ids"]) if _is_cohort(message) else 1
    for attempt in range(1, tries + 1):
        future = self.pool.submit(
            lambda a, a_fn, mssg, cid, state: a.run.remote(a_fn, mssg, cid, state), (self.app_fn, message, pid, context)
        )
        deadline = time.monotonic() + _SETTINGS.timeout_s * max(members, 1)
        while not ray.wait([future], timeout=0.2)[0]:
            if _SETTINGS.stop.is_set() or not ray.is_initialized():
                _retire(self.pool, future, replace=False)
                raise ClientTimeout("the run ended before this client replied")
            if time.monotonic() > deadline:
                _retire(self.pool, future, replace=True)
                raise ClientTimeout(timeout_reason(_SETTINGS.timeout_s))
        try:
            _, out_message, updated_context = ray.get(future)
        except ray.exceptions.RayActorError as exc:  # the actor's process died
            _retire(self.pool, future, replace=not _SETTINGS.stop.is_set())
            if attempt == tries:
                raise RuntimeError(
                    f"client process died {tries} time(s) (simulation.client_retries = {_SETTINGS.retries}): "
                    f"{type(exc).__name__}"
                ) from None
            continue
        except Exception:
            self.pool.add_actor_back_to_pool(future)
            raise
        if _abandoned(out_message):  # a cohort left a hung client running in this worker: replace it
            _retire(self.pool, future, replace=not _SETTINGS.stop.is_set())
        else:
            self.pool.add_actor_back_to_pool(future)
        return out_message, updated_context
    raise AssertionError("unreachable")


def _is_cohort(message) -> bool:
    return message.has_content() and "cohort" in message.content and "partition-ids" in message.content["cohort"]


def _abandoned(message) -> bool:
    return _is_cohort_reply(message) and bool(message.content["cohort"]["abandoned"])


def _is_cohort_reply(message) -> bool:
    return message.has_content() and "cohort" in message.content and "abandoned" in message.content["cohort"]


@contextmanager
def resilient_actors(*, retries: int, timeout_s: float, stop: threading.Event) -> Iterator[_Settings]:
    """Use the crash-tolerant ``process_message`` for simulations started inside this block."""
    try:
        from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
    except ImportError:  # a Flower without this module: nothing to patch
        yield _SETTINGS
        return
    import ray._private.auto_init_hook as auto_init

    original, terminate, auto = RayBackend.process_message, RayBackend.terminate, auto_init.enable_auto_connect
    build = RayBackend.build
    _SETTINGS.retries, _SETTINGS.timeout_s, _SETTINGS.stop, _SETTINGS.replaced = retries, timeout_s, stop, 0
    RayBackend.process_message = _process_message
    RayBackend.terminate = _terminate(terminate)
    if _same_build(build):  # Flower's build as this module knows it: actor_class()'s actors, the early ones first
        RayBackend.build = _build
    else:  # another Flower: its build makes its own actors, which the early ones would keep from the CPUs
        _kill(_EARLY.pop("actors", []))
        _EARLY.clear()
    # a worker thread still waiting after ray.shutdown() must not start a new local Ray (whose agents outlive us)
    auto_init.enable_auto_connect = False
    try:
        yield _SETTINGS
    finally:
        RayBackend.process_message, RayBackend.terminate, RayBackend.build = original, terminate, build
        auto_init.enable_auto_connect = auto
        _kill(_EARLY.pop("actors", []))  # not taken (the run stopped before its pool was built)
        _EARLY.clear()
