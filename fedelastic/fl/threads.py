"""A thread kept between calls (issue 10)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


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
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while not self.retired:
            work, done = self._calls.get()
            try:
                work()
            except BaseException:
                self.retired = True
                raise
            finally:
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
