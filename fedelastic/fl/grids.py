"""The grids between fedelastic's server and Flower's: each a :class:`PassThroughGrid` that
changes only what it must.

* :class:`InProcessGrid`: the bottom of the stack without Flower's runtime: it calls the ClientApp
  directly (backend ``inprocess``);
* :class:`GuardedGrid`: stops waiting for replies when the runtime died or the run was stopped;
* :class:`~fedelastic.fl.cohort.CohortGrid`: one virtual node per client over a few Flower nodes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from ..errors import with_traceback
from ..runtime.dispatch import notify_pushed, replies_may_wait, wait_for_replies
from .threads import STOPPING, KeptThread, wait_out


class PassThroughGrid(Grid):
    """Flower's ``Grid``, every call handed to ``grid``, the grid below; a subclass overrides only what it changes.

    With ``grid=None`` (the bottom of a stack) it holds the run itself and makes plain messages; a
    subclass then answers the node ids and the sends itself.
    """

    def __init__(self, grid: Grid | None):
        self.grid = grid
        self._run = None

    def set_run(self, run) -> None:
        if self.grid is None:
            self._run = run
        else:
            self.grid.set_run(run)

    @property
    def run(self):
        return self._run if self.grid is None else self.grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        if self.grid is None:
            return Message(content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id)
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self._below().get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._below().push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._below().pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self._below().send_and_receive(messages, timeout=timeout)

    def _below(self) -> Grid:
        if self.grid is None:
            raise NotImplementedError(f"{type(self).__name__} has no grid below it to hand this call to")
        return self.grid


class InProcessGrid(PassThroughGrid):
    """A Grid that calls a ClientApp directly (the bottom of the stack: it holds the run itself);
    node ids are random, as in Flower."""

    def __init__(self, client_app: ClientApp, num_nodes: int):
        super().__init__(None)
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
        STOPPING.clear()  # a run stopped before this one in the process is over
        self._caller: KeptThread | None = None  # the thread client calls run on (threads.py)
        self.on_abandon: Callable[[], None] = lambda: None

    def close(self) -> None:
        """End the thread client calls run on (once an abandoned call returns, if one is running)."""
        if self._caller is not None:
            self._caller.close()

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def _call(self, msg: Message, timeout: float | None = None) -> Message | None:
        """Run the ClientApp on ``msg``; None if it did not return within ``timeout`` seconds.

        Calls run on one kept thread (:class:`~.threads.KeptThread`). A call that overruns is
        abandoned on that (daemon) thread, which Python cannot stop: it keeps its CPU until it
        returns, and its late result is dropped; the next call gets a new thread. The process's
        shared client model is rebuilt so the abandoned call cannot disturb later clients.
        """
        node = msg.metadata.dst_node_id
        box: list[Message] = []

        def work() -> None:
            try:
                box.append(self.app(msg, self.contexts[node]))
            except Exception as exc:  # a client failure becomes an error reply, as in Flower
                box.append(Message(Error(code=0, reason=with_traceback(exc)), reply_to=msg))

        if timeout is None:
            work()
            return box[0]
        if self._caller is None or self._caller.retired:
            self._caller = KeptThread("client-call")
        done = self._caller.run(work)
        try:
            returned = done.wait(max(timeout, 0.0))
        except BaseException:  # Ctrl-C or SIGTERM: the call returns first, within its timeout (threads.STOPPING)
            wait_out(done, timeout)
            raise
        if not returned or not box:
            self._caller.retired = True  # it goes on with the abandoned call: the next call gets a new thread
            self.on_abandon()
            return None
        return box[0]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = []
        for i, msg in enumerate(messages):
            key = f"{len(self._replies)}-{i}"
            reply = self._call(msg)
            assert reply is not None
            self._replies[key] = reply
            ids.append(key)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(i) for i in message_ids]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Each client in turn, each given ``timeout`` seconds (clients run one after another here,
        not side by side as on Ray); a client that overruns gets no reply, as on Ray."""
        replies = [self._call(msg, timeout) for msg in messages]
        return [r for r in replies if r is not None]


class GuardedGrid(PassThroughGrid):
    """A Grid that stops waiting for replies when ``stop`` is set (the runtime died, or Ctrl-C).

    Without it the ServerApp thread of a failed Flower runtime waits out ``timeout_s`` (an hour
    by default) and keeps the driver alive. ``on_sent()`` is called as each batch of messages
    (not an empty one) leaves, before the wait for replies: the runner hands the recorder's
    kept writes (the previous round's rows and checkpoint) to its writer there, so that they
    are made while the clients train, not while this thread still builds the round's messages
    (a writer holding the GIL then made that 1-2 ms slower a round).
    """

    def __init__(
        self,
        grid: Grid,
        stop: threading.Event,
        pull_period_s: float | None = None,
        on_sent: Callable[[], None] = lambda: None,
    ):
        super().__init__(grid)
        self.stop, self.on_sent = stop, on_sent
        self.pull_period_s = pull_period_s  # None: PULL_PERIOD_S (the in-memory simulation grid)

    def get_node_ids(self) -> Iterable[int]:
        if self.stop.is_set():
            raise RunAborted("the simulation runtime stopped")
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids = self.grid.push_messages(messages)
        notify_pushed()  # the dispatch loop sweeps now rather than at its next 0.1 s tick
        return ids

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        messages = list(messages)  # on_sent: not at the empty send of Flower's evaluate step (the driver evaluates then)
        if isinstance(self.grid, InProcessGrid):
            if messages:
                self.on_sent()
            return self.grid.send_and_receive(messages, timeout=timeout)
        replies_may_wait()
        pending = {i for i in self.grid.push_messages(messages) if i}
        notify_pushed()
        if messages:
            self.on_sent()
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            if self.stop.is_set():
                raise RunAborted("the simulation runtime stopped")
            replies_may_wait()  # a reply stored from here on ends the wait below at once
            got = list(self.grid.pull_messages(pending))
            replies.extend(got)
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending or (deadline is not None and time.monotonic() >= deadline):
                break
            if self.pull_period_s is None:  # the simulation's grid: woken by each stored reply
                wait_for_replies(PULL_PERIOD_S)
            else:
                time.sleep(self.pull_period_s)
        return replies


PULL_PERIOD_S = 0.01  # how often the ServerApp asks for replies at most (a stored reply wakes it sooner)


class RunAborted(RuntimeError):
    """The runtime under the ServerApp stopped; the server gives up instead of waiting."""
