"""SIGTERM handled as Ctrl-C is, while a ``fedelastic`` command runs (the CLI only, never the Python API)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .errors import Terminated

_HANDLING: list[object] = []  # the handlers replaced, while a command handles SIGTERM


def _terminate(signum: int, frame) -> None:
    """Raise :class:`Terminated` in the main thread, once: a second SIGTERM does not cut the clean-up short."""
    signal.signal(signum, signal.SIG_IGN)
    raise Terminated(signal.Signals(signum).name)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within this block SIGTERM raises :class:`Terminated` (a KeyboardInterrupt); the previous handler after it."""
    if not _main_thread():  # only the main thread may set handlers (and receives signals)
        yield
        return
    before = signal.signal(signal.SIGTERM, _terminate)
    _HANDLING.append(before)
    try:
        yield
    finally:
        _HANDLING.pop()
        signal.signal(signal.SIGTERM, before)


def reclaim_sigterm() -> None:
    """SIGTERM is :func:`sigterm_as_interrupt`'s again, inside that block (``ray.init`` sets its own handler, ``sys.exit``)."""
    if _HANDLING and _main_thread():
        signal.signal(signal.SIGTERM, _terminate)


def calls_returned(timeout_s: float = 30.0) -> None:
    """After Ctrl-C or SIGTERM, before the command exits: wait until no kept thread is inside a
    client call (one ended inside torch at interpreter exit aborts the process: exit 134 instead
    of 130 or 143). Nothing to wait for if no run started."""
    threads = sys.modules.get("fedelastic.fl.threads")
    if threads is not None:
        threads.wait_idle(timeout_s)
