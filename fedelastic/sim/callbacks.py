"""Callbacks: code that runs at a run's start, after every round, and at its end (as pfl's TrainingProcessCallback).

A callback is an object with any of these methods (:class:`Callback` has them all, doing nothing):

* ``on_run_start(run)``: before the first round (``run``: the server strategy; its ``engine`` holds the clock);
* ``on_round_end(end) -> bool``: after every round's evaluation, with a :class:`RoundEnd`; a true
  result stops the run after that round (every callback still sees the round; the round is kept,
  and the run ends normally with ``stopped_after_round`` in its status);
* ``on_run_end(run, outcome)``: once, however the run ended (``outcome``: ``completed``,
  ``stopped``, ``diverged`` or ``failed``).

The results writer, checkpointing, the continual report, early stopping and user callbacks are
all callbacks. A plain function ``f(row) -> bool`` is accepted too (:func:`as_callback`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..divergence import advice
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..divergence import Detector
    from .engine import RoundEngine

OUTCOMES = ("completed", "stopped", "diverged", "failed")


class Run(Protocol):
    """What a callback reads of its run: the server strategy (:class:`fedelastic.fl.server.EngineStrategy`),
    whose ``engine`` holds the clock and the fleet and whose ``detector`` watches for divergence."""

    @property
    def engine(self) -> RoundEngine: ...

    @property
    def detector(self) -> Detector: ...


@dataclass
class RoundEnd:
    """What a callback sees after a round: its number, its row (the ``rounds`` table's columns), the
    global model's weights (``weights()``, computed on demand) and the server strategy (``run``)."""

    round: int
    row: dict
    weights: Callable[[], dict[str, np.ndarray]]
    run: Run
    tasks: list[dict] = field(default_factory=list)  # a continual run's accuracy-matrix rows of this round


class Callback:
    """A callback that does nothing; subclass it and override what you need."""

    def on_run_start(self, run: Run) -> None:
        pass

    def on_round_end(self, end: RoundEnd) -> bool:
        return False

    def on_run_end(self, run: Run, outcome: str) -> None:
        pass


class FunctionCallback(Callback):
    """``f(row)`` after every round; a true result stops the run."""

    def __init__(self, f: Callable[[dict], Any]):
        self.f = f

    def on_round_end(self, end: RoundEnd) -> bool:
        return bool(self.f(end.row))


class StopAtAccuracy(Callback):
    """Early stopping: stop at the first round (after round 0) whose test accuracy reaches ``target``."""

    def __init__(self, target: float):
        self.target = target

    def __call__(self, row: dict) -> bool:
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


class CallbackList(Callback):
    """Callbacks called in order, itself a callback; every one sees every event."""

    def __init__(self, callbacks: Iterable[Any] = ()):
        self.callbacks = [as_callback(cb) for cb in callbacks if cb is not None]

    def on_run_start(self, run: Run) -> None:
        for cb in self.callbacks:
            if hasattr(cb, "on_run_start"):
                cb.on_run_start(run)

    def on_round_end(self, end: RoundEnd) -> bool:
        """Whether some callback asked to stop the run."""
        return any([bool(cb.on_round_end(end)) for cb in self.callbacks if hasattr(cb, "on_round_end")])

    def on_run_end(self, run: Run, outcome: str) -> None:
        for cb in self.callbacks:
            if hasattr(cb, "on_run_end"):
                cb.on_run_end(run, outcome)


class ResultsWriter(Callback):
    """Hands each round's rows to the run's recorder (:class:`~fedelastic.results.Recorder`): a
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
            from ..continual import report

            report(self.folder, self.recover_share)
