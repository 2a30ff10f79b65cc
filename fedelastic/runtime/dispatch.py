"""A linear-time replacement for the message dispatch loop of Flower's simulation engine.

Flower 1.41's ``vce_api.add_messages_to_queue`` polls the in-memory LinkState every 0.1 s by
asking, for *each* node, ``get_message_ins(node_id, limit=1)``; each such call walks *every*
stored message and re-validates it (``_check_stored_messages``). With N nodes and up to N
messages in flight a sweep costs O(N^2) validations, back to back, in the driver process: at
200 nodes this thread alone keeps about one core busy, which on a 2-core machine starves the
Ray actors doing the training (measured in benchmarks/overhead.py).

:func:`fast_dispatch` swaps in a loop that does the same thing in one pass per sweep: validate
the stored messages once, take the first undelivered message of each simulated node, mark it
delivered and hand it to the workers. Same messages, same validity rules, same 0.1 s period;
only the order within a sweep may differ, and the results never depend on it (the server
sorts replies and every client is seeded by (seed, round, partition)). Anything unexpected
(another LinkState class, a Flower without these internals) runs Flower's own loop.

The loop also wakes as soon as the ServerApp pushes messages (:func:`notify_pushed`, called by
the runner's grid after each push) instead of waiting out the rest of its 0.1 s period, so a round
starts without that delay. Without a push it sweeps every 0.1 s.

Replies: Flower's reply thread (``put_message_into_state``) stores each reply in the LinkState,
where the ServerApp's pull loop finds it at its next poll. :func:`fast_dispatch` swaps in the
same loop plus one line, :func:`notify_replied` after each store, and the runner's grid waits on
it (:func:`wait_for_replies`) instead of sleeping out its poll period.

At the end of a run Flower's worker and reply threads each wait out a ``Queue.get(timeout=1.0)``
before they see the stop event, so the runtime lingers up to a second after the last round.
Inside :func:`fast_dispatch` the simulation's queues are :class:`StoppableQueue`: once the stop
event is set the dispatch loop stops them, and a ``get`` that finds nothing returns at once
(``Empty``, which those threads already handle). Items still queued are returned as before.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from queue import Empty, Queue

_PERIOD_S = 0.1  # Flower's own polling period
_pushed = threading.Event()  # set when the ServerApp pushed messages: sweep now
_replied = threading.Event()  # set when a reply reached the LinkState: pull now


def notify_pushed() -> None:
    """Wake the dispatch loop: messages were just pushed (or the run is ending)."""
    _pushed.set()


def notify_replied() -> None:
    """Wake the ServerApp's pull loop: a reply was just stored."""
    _replied.set()


def replies_may_wait() -> None:
    """Call before pulling: a reply stored from now on wakes :func:`wait_for_replies`."""
    _replied.clear()


def wait_for_replies(period_s: float) -> None:
    """Sleep until a reply is stored (after the last :func:`replies_may_wait`), at most ``period_s``."""
    _replied.wait(period_s)


# SHA-256 (first 16 hex digits) of the source of Flower 1.41's put_message_into_state, which
# _storing_replies copies: another source is left in place (the pull loop then polls every 10 ms)
_REPLY_LOOP_SOURCE = "3622eb5bfcd9cd1a"


def _replaceable_reply_loop(injector) -> bool:
    """Whether ``injector`` is the Flower reply loop that :func:`_storing_replies` copies."""
    import hashlib
    import inspect

    try:
        source = inspect.getsource(injector)
    except (OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest()[:16] == _REPLY_LOOP_SOURCE


def _storing_replies(state, queue: Queue, f_stop: threading.Event) -> None:
    """Flower 1.41's ``vce_api.put_message_into_state``, which also wakes the pull loop after each store."""
    while not f_stop.is_set():
        try:
            message_reply = queue.get(timeout=1.0)
            state.store_message_res(message_reply)
            notify_replied()
        except Empty:
            pass


class StoppableQueue(Queue):
    """A ``Queue`` whose blocking ``get`` gives up (``Empty``) as soon as it is stopped and empty.

    Queues made by one thread belong together (Flower's ``run_api`` makes the message and
    reply queues of a run); :meth:`stop` stops them all.
    """

    _made: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, maxsize: int = 0):
        super().__init__(maxsize)
        self.owner = threading.get_ident()
        self.stopped = False
        StoppableQueue._made.add(self)

    def stop(self) -> None:
        """Stop this queue and the others its thread made; their waiting ``get`` calls return."""
        for q in [q for q in list(StoppableQueue._made) if q.owner == self.owner]:
            with q.mutex:
                q.stopped = True
                q.not_empty.notify_all()

    def get(self, block: bool = True, timeout: float | None = None):
        with self.not_empty:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._qsize():
                if self.stopped or not block:
                    raise Empty
                if deadline is None:
                    self.not_empty.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Empty
                self.not_empty.wait(remaining)
            item = self._get()
            self.not_full.notify()
            return item


def _linear_dispatch(original):
    def add_messages_to_queue(state, queue: Queue, nodes_mapping: dict, f_stop: threading.Event) -> None:
        from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
        from flwr.supercore.date import now

        usable = isinstance(state, InMemoryLinkState) and all(
            hasattr(state, name) for name in ("lock", "message_ins_store", "_check_stored_messages")
        )
        if not usable:
            return original(state, queue, nodes_mapping, f_stop)
        nodes = set(nodes_mapping)
        while not f_stop.is_set():
            picked: dict[int, object] = {}
            with state.lock:
                state._check_stored_messages(set(state.message_ins_store))  # drops expired/invalid ones
                for msg in list(state.message_ins_store.values()):
                    meta = msg.metadata
                    if meta.delivered_at == "" and meta.dst_node_id in nodes and meta.dst_node_id not in picked:
                        picked[meta.dst_node_id] = msg  # limit=1 per node and sweep, as Flower's loop
                delivered_at = now().isoformat()
                for msg in picked.values():
                    msg.metadata.delivered_at = delivered_at
            for msg in picked.values():
                queue.put(msg)
            _pushed.wait(_PERIOD_S)  # a push in the meantime (or during the sweep) returns at once
            _pushed.clear()
        if isinstance(queue, StoppableQueue):  # the run is over: Flower's threads stop waiting now
            queue.stop()

    return add_messages_to_queue


@contextmanager
def fast_dispatch() -> Iterator[None]:
    """Use the linear dispatch loop for simulations started inside this block (when Flower's
    patches are active: :func:`fedelastic.runtime.patches.active`)."""
    from .patches import active

    if not active("flwr"):
        yield
        return
    try:
        from flwr.server.superlink.fleet.vce import vce_api
    except ImportError:  # a Flower without this module: nothing to patch
        yield
        return
    original = getattr(vce_api, "add_messages_to_queue", None)
    if original is None:
        yield
        return
    queue_class = getattr(vce_api, "Queue", None)
    injector = getattr(vce_api, "put_message_into_state", None)
    if injector is not None and not _replaceable_reply_loop(injector):
        injector = None  # another Flower's loop: kept as it is
    vce_api.add_messages_to_queue = _linear_dispatch(original)
    if queue_class is Queue:  # the queues run_api makes: stoppable (anything else: left alone)
        vce_api.Queue = StoppableQueue
    if injector is not None:
        vce_api.put_message_into_state = _storing_replies
    try:
        yield
    finally:
        vce_api.add_messages_to_queue = original
        if queue_class is Queue:
            vce_api.Queue = queue_class
        if injector is not None:
            vce_api.put_message_into_state = injector
