"""A thread kept between calls."""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable

#: Set while a run is being stopped (Ctrl-C, SIGTERM): a cohort's training thread starts no further
#: member. The stopping thread then waits for the thread's current call to return: a daemon thread
#: still inside torch when the interpreter exits is ended mid-call, which aborts the process
#: ("terminate called without an active exception", exit 134 instead of 130).
STOPPING = threading.Event()


_KEPT: weakref.WeakSet[KeptThread] = weakref.WeakSet()  # every kept thread of this process


def wait_idle(timeout_s: float) -> bool:
    """After Ctrl-C or SIGTERM, before the interpreter exits: stop cohorts between members
    (:data:`STOPPING`) and wait up to ``timeout_s`` until no kept thread is inside a call (a daemon
    thread ended inside torch at exit aborts the process). Whether every kept thread is idle."""
    STOPPING.set()
    deadline = time.monotonic() + max(0.0, timeout_s)
    while any(t.busy for t in list(_KEPT)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def wait_out(done: threading.Event, timeout_s: float) -> None:
    """After Ctrl-C or SIGTERM: let the call whose ``done`` event this is return (up to ``timeout_s``), no member started after it."""
    STOPPING.set()
    done.wait(max(0.0, timeout_s))


class KeptThread:
    """A daemon thread that runs the calls given to it one after another, kept between them.

    A fresh thread per call pays per-thread set-up again in its first torch calls: training the
    peers workload's cohort on a new thread each round cost ~2.9 ms a round more than on one kept
    thread (50.0 against 47.1 ms, ``python benchmarks/round_one.py --part threads``). A caller
    that gives up on a call that overran sets ``retired`` and makes a new one: Python cannot stop
    a thread, so this one goes on with the abandoned call and ends after it. A call that raises
    ends the thread too (Python reports the exception as for any thread) and retires it.
    """

    def __init__(self, name: str) -> None:
        self.retired = False
        self.busy = False  # inside a call (see wait_idle)
        _KEPT.add(self)
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while not self.retired:
            work, done = self._calls.get()
            self.busy = True
            try:
                work()
            except BaseException:
                self.retired = True
                raise
            finally:
                self.busy = False
                done.set()

    def close(self) -> None:
        """End the thread after the calls given to it so far."""
        self.retired = True
        self._calls.put((lambda: None, threading.Event()))  # wakes a thread waiting for a call

    def run(self, work: Callable[[], None]) -> threading.Event:
        """Run ``work()`` on this thread after the calls before it; the event is set when it has returned."""
        done = threading.Event()
        self._calls.put((work, done))
        return done
