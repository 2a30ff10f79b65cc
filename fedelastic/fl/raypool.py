"""Crash-tolerant client calls on Flower's Ray backend.

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

A cohort message (``fl/cohort.py``) gets ``timeout_s`` per client it trains, and a cohort that
abandoned a hung client (its reply says so) has its worker replaced after it replies.

Any other client error is returned to the pool and reported as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


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
        """Stop the client calls first: Ray aborts the process if a thread touches it after shutdown."""
        _SETTINGS.stop.set()
        deadline = time.monotonic() + 5.0
        while _SETTINGS.active and time.monotonic() < deadline:
            time.sleep(0.05)
        original(self)

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
    _SETTINGS.retries, _SETTINGS.timeout_s, _SETTINGS.stop, _SETTINGS.replaced = retries, timeout_s, stop, 0
    RayBackend.process_message = _process_message
    RayBackend.terminate = _terminate(terminate)
    # a worker thread still waiting after ray.shutdown() must not start a new local Ray (whose agents outlive us)
    auto_init.enable_auto_connect = False
    try:
        yield _SETTINGS
    finally:
        RayBackend.process_message, RayBackend.terminate = original, terminate
        auto_init.enable_auto_connect = auto
