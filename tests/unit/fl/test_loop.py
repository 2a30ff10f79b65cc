"""fedelastic's own round loop (``fl/server.py``: ``EngineStrategy.run``, ``run_buffered``), run
through the real in-process grid and ClientApp: a run ends by returning its outcome, a callback's
columns reach ``rounds.csv``/``rounds.parquet``, and a column that collides is a clear error."""

from __future__ import annotations

import threading

import pandas as pd
import pytest

from fedelastic.environment import environment
from fedelastic.errors import FedelasticError, StopRun
from fedelastic.fl.clientapp import make_client_app
from fedelastic.fl.grids import GuardedGrid, InProcessGrid
from fedelastic.fl.server import server_main
from fedelastic.results.recorder import Recorder
from fedelastic.sim.callbacks import Callback
from fedelastic.sim.records import round_columns
from fedelastic.train.pretrain import initial_state

# small_cnn from its initialisation at lr 50, BatchNorm frozen: the weights reach ~1e13 in round 1
EXPLODES = {"strategy": "full", "batch_size": 16, "max_steps": 3, "lr": 50.0, "bn_mode": "frozen"}
ASYNC = {"policy": "async", "concurrency": 2, "buffer_size": 2}


def serve(sc, folder, callbacks=(), progress=None) -> str:
    """``server_main`` on a node per client (the runner's in-process grid stack); the run's outcome."""
    recorder = Recorder(folder, {}, planned_rounds=sc.server.rounds)
    grid = GuardedGrid(InProcessGrid(make_client_app(sc), sc.num_clients), threading.Event())
    try:
        return server_main(sc, initial_state(environment(sc)), recorder, progress, grid, callbacks=callbacks)
    finally:
        recorder.close()


class Ends(Callback):
    """Keeps the outcome its ``on_run_end`` is given, and the rounds it saw."""

    def __init__(self):
        self.rounds: list[int] = []
        self.outcome = ""

    def on_round_end(self, end) -> bool:
        self.rounds.append(end.round)
        return False

    def on_run_end(self, run, outcome: str) -> None:
        self.outcome = outcome


class Count(Callback):
    """Two columns of its own: how many rounds it has seen, and twice the round's clients."""

    def __init__(self):
        self.seen = 0

    def on_round_end(self, end):
        self.seen += 1
        return False, {"seen": self.seen, "clients_x2": 2 * end.row["clients"]}


@pytest.mark.parametrize("server", [{"rounds": 2}, {"rounds": 2, **ASYNC}], ids=["sync", "async"])
def test_a_callbacks_columns_reach_the_rounds_table_after_the_built_in_ones(make_scenario, tmp_path, server):
    later: list[int] = []  # a later callback sees the earlier one's columns

    def reads(row):
        later.append(row["seen"])

    sc = make_scenario(server=server, simulation={"node_mode": "per_client"})
    assert serve(sc, tmp_path / "run", callbacks=[Count()], progress=reads) == "completed"
    for rounds in (pd.read_csv(tmp_path / "run" / "rounds.csv"), pd.read_parquet(tmp_path / "run" / "rounds.parquet")):
        assert list(rounds.columns) == [*round_columns(), "seen", "clients_x2"]
        assert rounds["seen"].tolist() == [1, 2, 3] == later
        assert rounds["clients_x2"].tolist() == (2 * rounds["clients"]).tolist()
        if "policy" not in server:  # all 4 clients in each round
            assert rounds["clients_x2"].tolist() == [0, 8, 8]


def test_a_callbacks_stop_returns_stopped_with_the_rounds_so_far(make_scenario, tmp_path):
    ends = Ends()

    def stop_at_1(row):  # fe.StopRun from a progress function: the same as returning stop
        if row["round"] == 1:
            raise StopRun("enough")

    sc = make_scenario(server={"rounds": 3}, simulation={"node_mode": "per_client"})
    assert serve(sc, tmp_path / "run", callbacks=[ends], progress=stop_at_1) == "stopped"
    assert pd.read_csv(tmp_path / "run" / "rounds.csv")["round"].tolist() == [0, 1]
    assert len(pd.read_csv(tmp_path / "run" / "clients.csv")) == 4  # round 1's four clients
    assert ends.rounds == [0, 1] and ends.outcome == "stopped"


@pytest.mark.parametrize("server", [{"rounds": 3}, {"rounds": 3, **ASYNC}], ids=["sync", "async"])
def test_a_divergence_returns_diverged_after_the_round_that_diverged(make_scenario, tmp_path, server):
    ends = Ends()
    sc = make_scenario(train=EXPLODES, server=server, simulation={"node_mode": "per_client"})
    assert serve(sc, tmp_path / "run", callbacks=[ends]) == "diverged"
    rounds = pd.read_csv(tmp_path / "run" / "rounds.csv", dtype={"divergence": "string"})
    assert rounds["round"].tolist() == [0, 1] and ends.outcome == "diverged"
    assert pd.isna(rounds["divergence"][0]) and "norm" in rounds["divergence"][1]


class Meddles(Callback):
    def __init__(self, column: str, after: int = 0):
        self.column, self.after = column, after

    def on_round_end(self, end):
        return False, ({self.column: 1.0} if end.round >= self.after else {})


@pytest.mark.parametrize(
    ("callbacks", "message"),
    [
        ([Meddles("test_accuracy")], r"callback Meddles: .* column 'test_accuracy', a built-in column of rounds\.csv"),
        ([Meddles("mine"), Meddles("mine")], r"callback Meddles: .* column 'mine', which an earlier callback returned"),
        ([Meddles("late", after=1)], r"callback Meddles: .* column 'late' in round 1, but not in the run's first round"),
    ],
    ids=["built-in", "twice", "late"],
)
def test_a_column_that_collides_is_an_error_naming_the_callback_and_the_column(make_scenario, tmp_path, callbacks, message):
    sc = make_scenario(server={"rounds": 1}, simulation={"node_mode": "per_client"})
    with pytest.raises(FedelasticError, match=message):
        serve(sc, tmp_path / "run", callbacks=callbacks)


def test_the_apis_callbacks_are_each_checked_on_their_own(tmp_path):
    """fe.run hands its progress and callbacks down as one CallbackList: spliced into the loop's."""
    import tomli_w

    import fedelastic as fe
    from tests.support import small_scenario_dict

    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 1})))
    result = fe.run(path, run_id="api", callbacks=[Count()], progress=lambda row: None)
    assert result.rounds["seen"].tolist() == [1, 2]
    with pytest.raises(FedelasticError, match=r"callback Meddles: .* column 'seen', which an earlier callback returned"):
        fe.run(path, run_id="twice", callbacks=[Count(), Meddles("seen")])
