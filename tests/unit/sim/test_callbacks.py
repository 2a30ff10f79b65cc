"""Callbacks: the protocol's three hooks, in order, with the run's outcome; a callback object stops a run."""

from __future__ import annotations

import tomli_w

import fedelastic as fe
from fedelastic.sim.callbacks import Callback, CallbackList, RoundEnd, StopAtAccuracy, as_callback
from tests.support import small_scenario_dict


class Log(Callback):
    """Records every hook it sees; stops the run after round ``stop_after`` (None: never)."""

    def __init__(self, stop_after: int | None = None):
        self.events: list[tuple] = []
        self.stop_after = stop_after

    def on_run_start(self, run) -> None:
        self.events.append(("start", run.sim_time_s))

    def on_round_end(self, end: RoundEnd) -> bool:
        has_weights = set(end.run.env.info.tensor_names) <= set(end.weights())  # the global model after the round
        self.events.append(("round", end.round, end.row["round"], has_weights))
        return end.round == self.stop_after

    def on_run_end(self, run, outcome: str) -> None:
        self.events.append(("end", outcome))


def test_hooks_run_in_order_and_a_callback_object_can_stop_the_run(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 3})))
    whole, stopper = Log(), Log(stop_after=1)
    fe.run(path, run_id="whole", callbacks=[whole])
    assert whole.events == [("start", 0.0), *[("round", r, r, True) for r in range(4)], ("end", "completed")]
    result = fe.run(path, run_id="stopped", callbacks=[stopper])
    assert stopper.events == [("start", 0.0), ("round", 0, 0, True), ("round", 1, 1, True), ("end", "stopped")]
    assert list(result.rounds["round"]) == [0, 1] and result.status["stopped_after_round"] == 1


def test_plain_functions_are_callbacks_and_every_callback_sees_every_round():
    seen: list[int] = []
    row = {"round": 2, "test_accuracy": 0.5}
    end = RoundEnd(2, row, dict, None)
    callbacks = CallbackList([lambda r: seen.append(r["round"]), StopAtAccuracy(0.9), lambda r: r["round"] == 2, lambda r: seen.append(-1)])
    assert callbacks.on_round_end(end) == ("stopped", {})  # the third asked to stop; the fourth still saw the round
    assert seen == [2, -1]
    assert StopAtAccuracy(0.5)(row) and not StopAtAccuracy(0.5)({"round": 0, "test_accuracy": 1.0})
    assert as_callback(print) is not print and isinstance(as_callback(Log()), Log)
