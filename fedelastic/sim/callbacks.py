"""Callbacks: code that runs at a run's start, after every round, and at its end (as pfl's TrainingProcessCallback).

A callback is an object with any of these methods (:class:`Callback` has them all, doing nothing):

* ``on_run_start(run)``: before the first round (``run``: the server, :class:`fedelastic.fl.server.EngineStrategy`;
  its ``engine`` holds the clock);
* ``on_round_end(end) -> (stop, columns)``: after every round, with a :class:`RoundEnd` (``end.row``:
  the round's columns so far, read-only). ``columns`` (a dict) are added to the round's row, and
  so reach ``rounds.csv``/``rounds.parquet`` after the built-in columns; a true ``stop`` ends the
  run after this round (every callback still sees the round, the round is kept, and the run ends
  ``stopped``, with ``stopped_after_round`` in its status). A plain bool (or None) is a ``stop``
  without columns, and raising :class:`~fedelastic.errors.StopRun` is ``stop = True``;
* ``on_run_end(run, outcome)``: once, however the run ended (``outcome``: ``completed``,
  ``stopped``, ``diverged`` or ``failed``).

The round loop (:meth:`fedelastic.fl.server.EngineStrategy.run`) calls one :class:`CallbackList`,
in this order: the central evaluation (``fl/server.py``'s ``CentralEvaluation``: the ``test_*``,
``val_*`` and ``host_wall_s`` columns), the :class:`DivergenceCheck` (the ``divergence`` column;
``stop = "diverged"`` under ``simulation.on_divergence = "stop"``), the user's callback objects
(``fe.run``'s ``callbacks`` in the order given), the :class:`ResultsWriter` (the row, with every
column, to the results), the checkpoint, then the plain functions of the row (``progress`` first,
then ``callbacks`` that are functions): a round a progress line reports is on record, so a signal
during the line loses nothing. Each sees the columns of those before it. A
built-in column (:func:`~fedelastic.sim.records.round_columns`) is set only by the callback that
declares it in its ``owns``; any other callback returning one, two callbacks returning the same
column, or a column first returned after the run's first round (the table's columns are fixed by
its first row) is a :class:`~fedelastic.errors.FedelasticError` naming the callback and the column.
A plain function ``f(row) -> bool`` is accepted too (:func:`as_callback`; it gets a copy of the row).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import ConfigError, FedelasticError, StopRun
from .divergence import advice, weight_norm
from .records import round_columns

if TYPE_CHECKING:
    from .divergence import Detector
    from .engine import RoundEngine

OUTCOMES = ("completed", "stopped", "diverged", "failed")
BUILT_IN = frozenset(round_columns(validation=True))  # the rounds table's own columns


class Run(Protocol):
    """What a callback reads of its run: the server (:class:`fedelastic.fl.server.EngineStrategy`),
    whose ``engine`` holds the clock and the fleet and whose ``detector`` watches for divergence."""

    @property
    def engine(self) -> RoundEngine: ...

    @property
    def detector(self) -> Detector: ...


@dataclass
class Evaluation:
    """The global model's evaluation after a round, besides its columns: the test predictions and
    labels counted per class (a stream's: over the seen tasks) and a stream's accuracy-matrix rows."""

    predicted: np.ndarray | None
    actual: np.ndarray | None
    tasks: list[dict] = field(default_factory=list)


@dataclass
class RoundEnd:
    """What a callback sees after a round: its number, its row (the ``rounds`` table's columns so
    far, read-only: add columns by returning them), the global model's weights (``weights()``,
    decoded once, on demand), the server (``run``), the central evaluation (None: not evaluated)
    and ``started`` (``time.perf_counter()`` as the round began: its ``host_wall_s`` counts from there)."""

    round: int
    row: Mapping[str, Any]
    weights: Callable[[], dict[str, np.ndarray]]
    run: Run
    evaluation: Evaluation | None = None
    started: float = math.nan

    def __post_init__(self) -> None:
        self._columns = dict(self.row)
        self.row = MappingProxyType(self._columns)
        self.weights = cache(self.weights)

    @property
    def tasks(self) -> list[dict]:
        """A continual run's accuracy-matrix rows of this round (none if not evaluated)."""
        return self.evaluation.tasks if self.evaluation is not None else []


class Callback:
    """A callback that does nothing; subclass it and override what you need.

    ``owns``: the built-in columns (:data:`BUILT_IN`) this callback sets; only the built-in
    callbacks own any."""

    owns: tuple[str, ...] = ()

    def on_run_start(self, run: Run) -> None:
        pass

    def on_round_end(self, end: RoundEnd) -> bool | tuple[Any, dict]:
        return False

    def on_run_end(self, run: Run, outcome: str) -> None:
        pass


class FunctionCallback(Callback):
    """``f(row)`` after every round (a copy of the row: ``f`` may change it); a true result stops the run."""

    def __init__(self, f: Callable[[dict], Any]):
        self.f = f

    def on_round_end(self, end: RoundEnd) -> bool:
        return bool(self.f(dict(end.row)))


class StopAtAccuracy(Callback):
    """Early stopping: stop at the first round (after round 0) whose test accuracy reaches ``target``."""

    def __init__(self, target: float):
        self.target = target

    def __call__(self, row: Mapping) -> bool:
        return bool(row["round"] > 0 and row["test_accuracy"] >= self.target)

    def on_round_end(self, end: RoundEnd) -> bool:
        return self(end.row)


def as_callback(cb: Any) -> Any:
    """``cb`` itself if it has a callback method, else a plain function wrapped as one."""
    if any(hasattr(cb, m) for m in ("on_run_start", "on_round_end", "on_run_end")):
        return cb
    if callable(cb):
        return FunctionCallback(cb)
    raise ConfigError(
        "<callbacks>", "callbacks", "a function of the round's row, or an object with on_round_end etc.", cb
    )


def label(cb: Any) -> str:
    """A callback's name in an error: its class, or a plain function's own name."""
    f = getattr(cb, "f", None) if isinstance(cb, FunctionCallback) else None
    return getattr(f, "__qualname__", repr(f)) if f is not None else type(cb).__qualname__


def answer(cb: Any, result: Any) -> tuple[Any, dict]:
    """``(stop, columns)`` from what ``cb.on_round_end`` returned: a pair, or a bare ``stop`` (bool or None)."""
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[1], Mapping):
            raise FedelasticError(
                f"callback {label(cb)}: on_round_end returned a tuple of {len(result)} "
                f"({', '.join(type(x).__name__ for x in result)}); expected (stop, columns) with columns a dict"
            )
        return result[0], dict(result[1])
    return result, {}


class CallbackList(Callback):
    """Callbacks called in order, itself a callback; every one sees every event. A CallbackList
    among them is spliced in (its callbacks take its place), so each is checked on its own."""

    def __init__(self, callbacks: Iterable[Any] = ()):
        self.callbacks: list[Any] = [
            one
            for cb in callbacks
            if cb is not None
            for one in (cb.callbacks if isinstance(cb, CallbackList) else [as_callback(cb)])
        ]
        self.extra: dict[str, str] | None = None  # column -> the callback that returns it (fixed by the first round)

    def on_run_start(self, run: Run) -> None:
        for cb in self.callbacks:
            if hasattr(cb, "on_run_start"):
                cb.on_run_start(run)

    def on_round_end(self, end: RoundEnd) -> tuple[str, dict]:
        """Every callback's ``on_round_end`` in turn, each seeing the columns of those before it;
        returns ``(stop, columns)``: '' to go on, else how the run ends after this round
        (``diverged`` before ``stopped``), and the columns they set."""
        stops: set[str] = set()
        added: dict[str, str] = {}
        got: dict = {}
        for cb in self.callbacks:
            if not hasattr(cb, "on_round_end"):
                continue
            try:
                stop, columns = answer(cb, cb.on_round_end(end))
            except StopRun:  # the documented way for a progress function to stop the run
                stop, columns = True, {}
            self._check(cb, columns, end)
            end._columns.update(columns)
            got.update(columns)
            added.update((c, label(cb)) for c in columns if c not in BUILT_IN)
            if stop:
                stops.add("diverged" if stop == "diverged" else "stopped")
        if self.extra is None:
            self.extra = added
        return ("diverged" if "diverged" in stops else "stopped" if stops else ""), got

    def _check(self, cb: Any, columns: dict, end: RoundEnd) -> None:
        for c in columns:
            name = label(cb)
            if c in BUILT_IN and c not in getattr(cb, "owns", ()):
                raise FedelasticError(
                    f"callback {name}: on_round_end returned column {c!r}, a built-in column of rounds.csv; "
                    "expected a name of its own (the built-in ones: docs/reference/results.md)"
                )
            if c not in BUILT_IN and c in end._columns:
                raise FedelasticError(
                    f"callback {name}: on_round_end returned column {c!r}, which an earlier callback returned "
                    "this round; expected a name no other callback uses"
                )
            if self.extra is not None and c not in BUILT_IN and c not in self.extra:
                raise FedelasticError(
                    f"callback {name}: on_round_end returned column {c!r} in round {end.round}, but not in the "
                    "run's first round, whose row fixed the columns of rounds.csv; expected every column from "
                    "the first round on (NaN where it has no value yet)"
                )

    def on_run_end(self, run: Run, outcome: str) -> None:
        for cb in self.callbacks:
            if hasattr(cb, "on_run_end"):
                cb.on_run_end(run, outcome)


class DivergenceCheck(Callback):
    """Feeds the run's divergence detector (``run.detector``, :mod:`fedelastic.sim.divergence`) the
    round's figures: the clients' mean train loss, the global weights' norm, the rejected share
    and the central evaluation's; sets ``divergence`` (why the round diverged, or ''), and ends
    the run (``stop = "diverged"``) when it diverged under ``simulation.on_divergence = "stop"``."""

    owns = ("divergence",)

    def __init__(self, on_divergence: str, params: Iterable[str], warn: Callable[..., None]):
        """``params``: the trainable tensors (the norm's); ``warn(fmt, *args)`` says a round diverged."""
        self.stop, self.params, self.warn = on_divergence == "stop", frozenset(params), warn

    def on_round_end(self, end: RoundEnd) -> tuple[Any, dict]:
        detector, summary, ev = end.run.detector, end.run.engine.summary, end.evaluation
        if ev is not None and ev.predicted is not None and not detector.classes:
            detector.classes = len(ev.predicted)  # the loss floor ln(classes)
        # the mean over the updates used (NaN: none trained a step; a client's non-finite loss is a rejection)
        loss = summary.mean_train_loss if end.round and not math.isnan(summary.mean_train_loss) else None
        reason = detector.observe(
            end.round,
            train_loss=loss,
            test_loss=end.row["test_loss"] if ev is not None else None,
            norm=weight_norm(end.weights(), self.params),
            trained=summary.clients_counted + summary.clients_rejected,
            rejected=summary.clients_rejected,
            predicted=ev.predicted if ev is not None else None,
            actual=ev.actual if ev is not None else None,
        )
        if reason:
            self.warn("round %d diverged: %s", end.round, reason)
        return ("diverged" if reason and self.stop else False), {"divergence": reason}


class ResultsWriter(Callback):
    """Hands each round's rows to the run's recorder (:class:`~fedelastic.results.recorder.Recorder`): a
    continual run's accuracy-matrix rows, then the round's row; notes the first divergence."""

    def __init__(self, recorder: Any):
        self.recorder = recorder

    def on_round_end(self, end: RoundEnd) -> bool:
        if end.tasks:
            self.recorder.add_tasks(end.tasks)
        first = end.run.detector.first
        if first is not None and self.recorder.divergence is None:
            self.recorder.divergence = found = first.to_dict()
            train, model = end.run.engine.sc.train, end.run.engine.sc.model
            pretrained = model.pretrain is not None or bool(model.weights)
            found["advice"] = advice(found, lr=train.lr, bn_mode=train.bn_mode, pretrained=pretrained)
        self.recorder.add_round(end.row)
        return False


class ContinualReport(Callback):
    """A continual run's report (forgetting, transfer, recovery) once the run completed."""

    def __init__(self, folder: Any, recover_share: float):
        self.folder, self.recover_share = folder, recover_share

    def on_run_end(self, run: Run, outcome: str) -> None:
        if outcome == "completed":
            from ..results.continual import report

            report(self.folder, self.recover_share)
