"""Flower's Ray backend, patched: crash-tolerant client calls, actors made early, a quick end.

Each patch here is listed in :mod:`fedelastic.runtime.patches` and applied only where
``patches.active("flwr")``. Flower's ``RayBackend.process_message`` hands a job to an actor and, if
the call fails for any reason, puts the actor back in its pool. When the actor's *process* died (a
segfault, an ``os._exit``, the OOM killer), every later job sent to that actor fails with
``ActorDiedError``: one crash poisons the rest of the run. It also waits for a reply without limit,
so a hung client keeps the runtime (and the driver) alive forever.

:func:`resilient_actors` swaps in a ``process_message`` that

* replaces a dead actor with a fresh one and retries the client on a healthy actor, at most
  ``retries`` more times (the node's context is the driver's, so the retry starts clean);
* gives up on a client after ``timeout_s`` (the round's timeout), counted from the moment its
  worker process is up (a fresh worker's start-up is awaited apart, up to ``START_LIMIT_S``), kills
  its actor and starts a new one, so later rounds use the full pool;
* stops waiting as soon as the run is over (``stop`` is set), so the driver exits.

Any other client error is returned to the pool and reported as before. A cohort message
(``fl/cohort.py``) gets ``timeout_s`` per client it trains, and a cohort that abandoned a hung
client (its reply says so) has its worker replaced after it replies. At the end the patched
``terminate`` kills the workers (``ray.kill``: Flower's ``exit_actor()`` runs each worker's
interpreter teardown first) and shuts Ray down (``lifecycle.quick_shutdown``). The patched ``build``
fills the pool with the actors made as Ray came up (:func:`create_early_actors`), of
:func:`actor_class`: a copy of Flower's that Ray ships by value, so that a worker does not import
``flwr.simulation``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import patches
from .lifecycle import EARLY as _EARLY
from .lifecycle import quick_shutdown


@dataclass
class _Settings:
    retries: int = 1
    timeout_s: float = 3600.0
    stop: threading.Event = field(default_factory=threading.Event)
    replaced: int = 0  # actors replaced during the run (dead or hung)
    active: int = 0  # client calls in flight
    lock: threading.Lock = field(default_factory=threading.Lock)
    # id(actor) -> its __ray_ready__ reply, for an actor whose process may still be starting
    starting: dict = field(default_factory=dict)


#: how long a fresh worker process may take to start (minutes on a loaded machine) before its client times out
START_LIMIT_S = 600.0

_SETTINGS = _Settings()


def _watch_start(actor) -> None:
    """Note when ``actor``'s process is up: a client's ``timeout_s`` counts from then, so that a
    fresh worker's start-up (tens of seconds on a loaded machine) is not taken for a hung client."""
    _SETTINGS.starting[id(actor)] = actor.__ray_ready__.remote()


class ClientTimeout(TimeoutError):
    pass


def timeout_reason(timeout_s: float) -> str:
    """The error of a client that did not reply in time (its row's ``error``; the same on every path)."""
    return f"timeout: no reply within simulation.timeout_s = {timeout_s:g} s"



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
    """The plain class of :mod:`.shipped_actor`'s ``ClientAppActor`` (not yet a Ray actor class), its
    module registered with Ray's cloudpickle to be shipped by value."""
    from ray import cloudpickle

    from . import shipped_actor

    cloudpickle.register_pickle_by_value(shipped_actor)
    return shipped_actor.ClientAppActor


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


def drop_early_actors() -> None:
    """Kill the actors :func:`create_early_actors` made and forget them (none: nothing)."""
    _kill(_EARLY.pop("actors", []))
    _EARLY.clear()


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
    for actor in self.pool.pool:
        _watch_start(actor)
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
        fresh = pool.create_actor_fn()
        _watch_start(fresh)
        pool.pool.append(fresh)
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
        started = _SETTINGS.starting.pop(id(self.pool._future_to_actor.get(future)), None)
        if started is not None:  # the worker's start-up is waited for on its own (an event, not timeout_s)
            _await(self.pool, future, started, max(_SETTINGS.timeout_s, START_LIMIT_S))
        _await(self.pool, future, future, _SETTINGS.timeout_s * max(members, 1))
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


def _await(pool, future, ref, limit_s: float) -> None:
    """Wait for ``ref`` (``future``'s reply or its actor's start) for ``limit_s`` seconds; on the
    run's end or the limit, retire ``future``'s actor and raise :class:`ClientTimeout`."""
    import ray

    deadline = time.monotonic() + limit_s
    while not ray.wait([ref], timeout=0.2)[0]:
        if _SETTINGS.stop.is_set() or not ray.is_initialized():
            _retire(pool, future, replace=False)
            raise ClientTimeout("the run ended before this client replied")
        if time.monotonic() > deadline:
            _retire(pool, future, replace=True)
            raise ClientTimeout(timeout_reason(_SETTINGS.timeout_s))


def _is_cohort(message) -> bool:
    return message.has_content() and "cohort" in message.content and "partition-ids" in message.content["cohort"]


def _abandoned(message) -> bool:
    return _is_cohort_reply(message) and bool(message.content["cohort"]["abandoned"])


def _is_cohort_reply(message) -> bool:
    return message.has_content() and "cohort" in message.content and "abandoned" in message.content["cohort"]


@contextmanager
def resilient_actors(*, retries: int, timeout_s: float, stop: threading.Event) -> Iterator[_Settings]:
    """Use the crash-tolerant ``process_message`` for simulations started inside this block (where
    Flower's patches are active; else Flower's own, and ``retries``/``timeout_s`` do not apply)."""
    _SETTINGS.retries, _SETTINGS.timeout_s, _SETTINGS.stop, _SETTINGS.replaced = retries, timeout_s, stop, 0
    _SETTINGS.starting.clear()
    if not patches.active("flwr"):
        drop_early_actors()
        yield _SETTINGS
        return
    try:
        from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
    except ImportError:  # a Flower without this module: nothing to patch
        yield _SETTINGS
        return
    import ray._private.auto_init_hook as auto_init

    original, terminate, auto = RayBackend.process_message, RayBackend.terminate, auto_init.enable_auto_connect
    build = RayBackend.build
    RayBackend.process_message = _process_message
    RayBackend.terminate = _terminate(terminate)
    if _same_build(build):  # Flower's build as this module knows it: actor_class()'s actors, the early ones first
        RayBackend.build = _build
    else:  # another Flower: its build makes its own actors, which the early ones would keep from the CPUs
        drop_early_actors()
    # a worker thread still waiting after ray.shutdown() must not start a new local Ray (whose agents outlive us)
    if patches.active("ray"):
        auto_init.enable_auto_connect = False
    try:
        yield _SETTINGS
    finally:
        RayBackend.process_message, RayBackend.terminate, RayBackend.build = original, terminate, build
        auto_init.enable_auto_connect = auto
        drop_early_actors()  # not taken (the run stopped before its pool was built)
