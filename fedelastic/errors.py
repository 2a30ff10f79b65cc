"""User-facing errors: every one names the file, the key and what was expected."""

from __future__ import annotations

import traceback
from pathlib import Path


class FedelasticError(Exception):
    """Base class of the errors the CLI prints without a traceback."""


class ConfigError(FedelasticError, ValueError):
    """A scenario, profile or strategy config value is wrong.

    The message reads ``<file>: key '<key>': expected <expected>, got <got>``.
    """

    def __init__(self, source: str | Path | None, key: str, expected: str, got: object = None):
        self.source = str(source) if source is not None else "<config>"
        self.key = key
        self.expected = expected
        self.got = got
        got_text = "" if got is None else f", got {got!r}"
        super().__init__(f"{_printable(self.source)}: key '{_printable(key)}': expected {_printable(expected)}{got_text}")


def _printable(text: str) -> str:
    """``text`` on one line: control characters (a newline in a TOML key, a multi-line exception) escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))


class DoesNotFitError(FedelasticError):
    """A selection needs more memory than the device has for training."""


class RunFailed(Exception):
    """A run stopped on something that is not bad input (e.g. the global model turned non-finite).

    The CLI prints it in one line and exits 1; the run's status.json says 'failed'.
    """


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, ``timeout``, systemd) in a ``fedelastic`` command: handled as Ctrl-C is.

    A KeyboardInterrupt, so every path that ends a run on Ctrl-C ends it on SIGTERM too: the
    finished rounds are written, ``status.json`` says ``failed`` ("stopped by SIGTERM"), and
    the command exits 143.
    """

    def __init__(self, signame: str = "SIGTERM"):
        self.signame = signame
        super().__init__(f"stopped by {signame}")


class StopRun(Exception):
    """Raised by a progress function or a callback's ``on_round_end`` to end a run after the round it was shown
    (early stopping); the same as returning a true ``stop`` (:mod:`fedelastic.sim.callbacks`).

    The round is kept, every callback still sees it, the run ends normally (outcome ``stopped``),
    and ``status.json`` records ``stopped_after_round``.
    """


def with_traceback(exc: BaseException) -> str:
    """``exc`` with its traceback, as Python prints it: a client's error reason (the server keeps it in
    errors.log, the tables its last line; see :func:`fedelastic.results.recorder.one_line`)."""
    return "".join(traceback.format_exception(exc)).rstrip()
