"""The ServerApp driver: ``server.evaluate_every``, results written byte for byte as a plain pandas writer
writes them, aggregation bit for bit the plain float64 arithmetic, and the write-behind order."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedelastic.comparisons.comparison import curves, summarise
from fedelastic.comparisons.report import write_html
from fedelastic.errors import ConfigError
from fedelastic.fl.runner import resume_run, run_scenario
from fedelastic.results.recorder import plot_accuracy
from fedelastic.scenario import parse_scenario
from tests.support import full_disk, small_scenario_dict


def _no_host(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.drop(columns=[c for c in frame.columns if c.startswith("host_")])


def test_evaluate_every_evaluates_multiples_the_start_and_the_last_round(make_scenario):
    every = run_scenario(make_scenario(server={"rounds": 7, "evaluate_every": 3}), run_id="every3")
    plain = run_scenario(make_scenario(server={"rounds": 7}), run_id="plain")
    rounds = pd.read_parquet(every / "rounds.parquet")
    # by hand: 0 (initial), 3 and 6 (multiples of 3), 7 (the last)
    assert list(rounds["round"]) == list(range(8))
    assert list(rounds.loc[rounds.test_accuracy.notna(), "round"]) == [0, 3, 6, 7]
    assert list(rounds.loc[rounds.test_loss.notna(), "round"]) == [0, 3, 6, 7]
    # skipping an evaluation changes nothing else: the default run's accuracy on those rounds,
    # and the same client rows and round figures everywhere
    base = pd.read_parquet(plain / "rounds.parquet")
    assert base.test_accuracy.notna().all()
    shown = rounds.test_accuracy.notna()
    assert np.array_equal(rounds.test_accuracy[shown], base.test_accuracy[shown])
    assert np.array_equal(rounds.test_loss[shown], base.test_loss[shown])
    figures = [c for c in base.columns if c not in ("test_accuracy", "test_loss", "host_wall_s")]
    pd.testing.assert_frame_equal(rounds[figures], base[figures])
    pd.testing.assert_frame_equal(
        _no_host(pd.read_parquet(every / "clients.parquet")), _no_host(pd.read_parquet(plain / "clients.parquet"))
    )
    # the CSV says the same (NaN is an empty field)
    csv = pd.read_csv(every / "rounds.csv")
    assert list(csv.loc[csv.test_accuracy.notna(), "round"]) == [0, 3, 6, 7]
    # downstream: a summary takes the last evaluated accuracy; plots and the report draw
    summary = summarise(rounds, pd.read_parquet(every / "clients.parquet"), target=0.0)
    assert summary["final_accuracy"] == base.test_accuracy.iloc[-1]
    plot_accuracy(rounds, pd.read_parquet(every / "clients.parquet"), every / "plot.png")
    assert (every / "plot.png").stat().st_size > 0
    assert write_html(every).exists()


def test_evaluate_every_default_is_every_round(make_scenario):
    sc = make_scenario(server={"rounds": 3})
    assert sc.server.evaluate_every == 1
    rounds = pd.read_parquet(run_scenario(sc, run_id="d") / "rounds.parquet")
    assert rounds.test_accuracy.notna().all() and list(rounds["round"]) == [0, 1, 2, 3]


def test_async_aggregations_follow_evaluate_every(make_scenario):
    sc = make_scenario(server={"rounds": 5, "policy": "async", "concurrency": 2, "buffer_size": 1, "evaluate_every": 2})
    rounds = pd.read_parquet(run_scenario(sc, run_id="a") / "rounds.parquet")
    assert list(rounds.loc[rounds.test_accuracy.notna(), "round"]) == [0, 2, 4, 5]
    assert rounds.loc[rounds.test_accuracy.isna(), "round"].tolist() == [1, 3]


# fedadam: its moments are checkpointed, so that a resumed run steps exactly as an uninterrupted one
@pytest.mark.parametrize("aggregator", [{}, {"aggregator": "fedadam", "aggregator_options": {"eta": 0.001, "tau": 0.001}}])
def test_a_resumed_run_evaluates_the_same_rounds(make_scenario, monkeypatch, aggregator):
    import fedelastic.fl.server as server

    sc = make_scenario(server={"rounds": 5, "evaluate_every": 2, **aggregator})
    whole = run_scenario(sc, run_id="whole")
    original = server.EngineStrategy.settle

    def crash_in_round_4(self, plan, replies, arrays):
        if plan.round == 4:
            raise KeyboardInterrupt("killed")
        return original(self, plan, replies, arrays)

    monkeypatch.setattr(server.EngineStrategy, "settle", crash_in_round_4)
    with pytest.raises(KeyboardInterrupt):
        run_scenario(sc, run_id="killed")
    monkeypatch.setattr(server.EngineStrategy, "settle", original)
    killed = Path(sc.output_dir) / "tiny" / "killed"
    assert list(pd.read_parquet(killed / "rounds.parquet")["round"]) == [0, 1, 2, 3]
    resume_run(killed)
    a, b = pd.read_parquet(killed / "rounds.parquet"), pd.read_parquet(whole / "rounds.parquet")
    assert list(a.loc[a.test_accuracy.notna(), "round"]) == [0, 2, 4, 5]
    pd.testing.assert_frame_equal(_no_host(a), _no_host(b))


@pytest.mark.parametrize("value", [0, -1, "2", 1.5, True])
def test_bad_evaluate_every_is_a_config_error(tmp_path, value):
    raw = small_scenario_dict(tmp_path, server={"evaluate_every": value})
    with pytest.raises(ConfigError, match=r"server\.evaluate_every"):
        parse_scenario(raw, src="bad.toml")


def test_a_continual_stream_needs_every_round(tmp_path):
    raw = small_scenario_dict(tmp_path, server={"evaluate_every": 2}, stream={"tasks": [[0, 1], [2, 3]]})
    with pytest.raises(ConfigError, match=r"server\.evaluate_every.*continual"):
        parse_scenario(raw, src="stream.toml")


def test_summaries_and_curves_skip_rounds_without_accuracy():
    nan = math.nan
    rounds = pd.DataFrame(
        {
            "round": [0, 1, 2, 3, 4],
            "test_accuracy": [0.1, nan, 0.6, nan, 0.5],
            "sim_time_s": [0.0, 1.0, 2.0, 3.0, 4.0],
            "total_energy_j": [0.0, 10.0, 20.0, 30.0, 40.0],
            "host_wall_s": [0.0, 1.0, 1.0, 1.0, 1.0],
        }
    )
    clients = pd.DataFrame(
        {
            "emulated_peak_memory_bytes": [1.0],
            "fits": [True],
            "emulated_train_time_s": [1.0],
            "fraction_params_trained": [1.0],
        }
    )
    # target 0.55: first reached at round 2 (t = 2 s, 20 J); the NaN round 1 is not a hit
    row = summarise(rounds, clients, target=0.55)
    assert row["final_accuracy"] == 0.5 and row["reached_target"]
    assert row["time_to_target_s"] == 2.0 and row["energy_to_target_j"] == 20.0
    # a run stopped on a skipped round: its final accuracy is the last evaluated one
    assert summarise(rounds.iloc[:4], clients, target=0.0)["final_accuracy"] == 0.6
    runs = rounds.assign(fleet="f", strategy="s")
    assert curves(runs)["round"].tolist() == [0, 2, 4]


def test_the_command_line_shows_skipped_rounds_and_reports_the_last_accuracy(tmp_path, capsys):
    import tomli_w

    from fedelastic.cli import main

    path = tmp_path / "every.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 3, "evaluate_every": 2})))
    assert main(["run", str(path), "--run-id", "cli"]) == 0
    out = capsys.readouterr().out
    lines = {line.split("accuracy")[0].strip(): line for line in out.splitlines() if "  accuracy " in line}
    assert "accuracy   -    simulated" in lines["round 1"]
    assert "accuracy   -  " not in lines["round 2"] and "accuracy   -  " not in lines["round 3"]
    assert "nan" not in out.split("final accuracy")[1].split(",")[0]


# -- results files: byte for byte what the pandas writer wrote ------------------------------------


def _same_files(new: Path, old: Path, name: str) -> None:
    assert (new / f"{name}.csv").read_bytes() == (old / f"{name}.csv").read_bytes(), name
    parts = sorted(p.name for p in (new / f"{name}.parquet").iterdir())
    assert parts == sorted(p.name for p in (old / f"{name}.parquet").iterdir()), name
    for part in parts:
        a, b = (new / f"{name}.parquet" / part).read_bytes(), (old / f"{name}.parquet" / part).read_bytes()
        assert a == b, f"{name}.parquet/{part}"


def _mixed_rows(r: int, plain: bool = False) -> list[dict]:
    """Value types that change between appends: pandas decides each append's column types.

    ``plain``: only the kinds of values a run's rows hold (str, int, float, bool, NaN; no None).
    """
    big = 2**63 + 5 if r == 7 else r  # beyond int64 once: pandas makes it uint64 (a merge)
    if plain:
        return [
            {
                "round": r,
                "id": np.int64(i),
                "loss": np.float64(0.25 * i) if i else 1,  # an int among floats
                "error": "boom" if (r == 3 and i == 1) else "",
                "n": math.nan if (r == 5 and i == 0) else i,  # an int column gets a NaN: a merge
                "fits": bool(i % 2),
                "big": 2**62 if r == 8 else r,
                "x": 2**53 + 1 if r == 9 else 0.5,  # an int that a float64 rounds
                **({} if r >= 4 and i == 2 else {"late": 1.5, "tag": f"t{i}"}),  # keys some rows lack
            }
            for i in range(3)
        ]
    return [
        {
            "round": r,
            "id": np.int64(i),
            "loss": np.float64(0.25 * i) if i else 1,  # an int among floats
            "error": "boom" if (r == 3 and i == 1) else None,
            "n": math.nan if (r == 5 and i == 0) else i,
            "fits": None if r == 6 else bool(i % 2),
            "flag": np.bool_(i == 2),
            "big": big,
            "name": "" if i else "x,\"quoted\"\nline",
            **({} if r >= 4 and i == 2 else {"late": 1.5}),  # a key some rows lack
        }
        for i in range(3)
    ]


def test_appends_write_the_pandas_writers_bytes(tmp_path):
    from fedelastic.results.recorder import _Table
    from tests.pandas_writer import PandasTable

    (tmp_path / "new").mkdir(), (tmp_path / "pandas").mkdir()
    for name, keep_last, plain in (("mixed", False, False), ("single", True, False), ("plain", False, True)):
        new, old = _Table(tmp_path / "new", name, keep_rows=False), PandasTable(tmp_path / "pandas", name)
        for r in range(1, 10):
            rows = _mixed_rows(r, plain)
            if keep_last:  # one row per append, as the rounds table
                rows = rows[r % 3 : r % 3 + 1]
            new.append([dict(row) for row in rows])
            old.append([dict(row) for row in rows])
            _same_files(tmp_path / "new", tmp_path / "pandas", name)
        assert len(pd.read_parquet(tmp_path / "new" / f"{name}.parquet")) == (9 if keep_last else 27)
        assert (new.direct_parts >= 4) == plain  # None in a column: always through pandas
        extra = [{**_mixed_rows(1)[0], "surprise": 1}]  # a key the table has no column for: refused by both
        with pytest.raises(ValueError, match="surprise"):
            new.append(extra)
        with pytest.raises(ValueError, match="surprise"):
            old.append(extra)
        _same_files(tmp_path / "new", tmp_path / "pandas", name)


@pytest.mark.parametrize("write_every_s", [0, 3600])
def test_a_runs_results_files_are_byte_identical_to_the_pandas_writers(make_scenario, tmp_path, monkeypatch, write_every_s):
    """Every append of a real run (failed clients, late ones, NaN columns) also goes to the pandas writer,
    whether each round is appended on its own (0) or the rounds are appended together (3600). The
    rows reach the oracle through a wrapper of the private ``_Table.append``: the only place that sees
    each append's rows as the run hands them over."""
    import fedelastic.fl.client as client
    import fedelastic.results.recorder as results
    from tests.pandas_writer import PandasTable

    real_train = client.train_local

    def flaky(*args, seed, **kwargs):
        if seed[2] == 1 and seed[1] % 2:  # partition 1 fails in odd rounds
            raise RuntimeError("device fell over")
        return real_train(*args, seed=seed, **kwargs)

    monkeypatch.setattr(client, "train_local", flaky)
    pandas_dir = tmp_path / "pandas"
    pandas_dir.mkdir()
    oracles: dict[str, PandasTable] = {}
    direct: dict[str, int] = {}
    real_append = results._Table.append

    def both(self, rows):
        oracle = oracles.setdefault(self.csv.stem, PandasTable(pandas_dir, self.csv.stem))
        oracle.append([dict(row) for row in rows])
        real_append(self, rows)
        direct[self.csv.stem] = self.direct_parts

    monkeypatch.setattr(results._Table, "append", both)
    sc = make_scenario(
        server={"rounds": 5, "policy": "deadline_drop", "deadline_quantile": 0.6, "evaluate_every": 2},
        network={"model": "lognormal"},
        simulation={"write_every_s": write_every_s, "vectorize": False},  # train_local is patched: per-client
    )
    run_dir = run_scenario(sc, run_id="new")
    clients = pd.read_parquet(run_dir / "clients.parquet")
    assert set(clients.status) >= {"counted", "failed", "late"}  # the rows cover those kinds
    for name in ("clients", "rounds"):
        _same_files(run_dir, pandas_dir, name)
    if write_every_s == 0:  # the rows took the fast path too
        assert direct["clients"] >= 1 and direct["rounds"] >= 2, direct
    else:  # round 0's row at once (the first hand-over), every later row at the end: one append each
        assert len(list((run_dir / "rounds.parquet").iterdir())) == 2
        assert len(list((run_dir / "clients.parquet").iterdir())) == 1


# -- aggregation: bit for bit the plain float64 arithmetic, written out here -----------------------


def _plain_value_and_weight(upd, name, current):  # a tensor's float64 values and per-element weights
    value = np.asarray(upd.arrays[name], dtype=np.float64)
    w = np.full(current.shape, float(upd.weight))
    if name in upd.channel_masks:
        mask = np.asarray(upd.channel_masks[name], dtype=np.float64)
        if mask.ndim == 1:
            mask = mask.reshape((-1,) + (1,) * (current.ndim - 1))
        w = w * np.broadcast_to(mask, current.shape)
    return value, w


def _plain_aggregate_partial(global_state, updates):
    new_state = {}
    for name, current in global_state.items():
        num = np.zeros(current.shape, dtype=np.float64)
        den = np.zeros(current.shape, dtype=np.float64)
        for upd in updates:
            if name not in upd.arrays:
                continue
            value, w = _plain_value_and_weight(upd, name, current)
            num += w * value
            den += w
        trained = den > 0
        merged = np.where(trained, num / np.where(trained, den, 1.0), current)
        new_state[name] = merged.astype(current.dtype, copy=False)
    return new_state


def _plain_aggregate_buffered(global_state, updates, bases, discounts):
    new_state = {}
    for name, current in global_state.items():
        num = np.zeros(current.shape, dtype=np.float64)
        den = np.zeros(current.shape, dtype=np.float64)
        for upd, base, discount in zip(updates, bases, discounts):
            if name not in upd.arrays:
                continue
            value, w = _plain_value_and_weight(upd, name, current)
            num += discount * w * (value - np.asarray(base[name], dtype=np.float64))
            den += w
        trained = den > 0
        merged = np.asarray(current, dtype=np.float64) + np.where(trained, num / np.where(trained, den, 1.0), 0.0)
        new_state[name] = merged.astype(current.dtype, copy=False)
    return new_state


def test_aggregation_is_bit_for_bit_the_plain_float64_arithmetic():
    from fedelastic.sim.aggregate import ClientUpdate, aggregate_buffered, aggregate_partial

    rng = np.random.default_rng(7)
    shapes = {"conv": (6, 3, 3, 3), "bias": (6,), "fc": (10, 24), "half": (4, 4)}
    state = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    state["half"] = state["half"].astype(np.float64)
    updates, bases = [], []
    for i in range(9):
        arrays = {k: (v + rng.normal(scale=0.1, size=v.shape)).astype(v.dtype) for k, v in state.items() if (i + len(k)) % 4}
        for v in arrays.values():
            v.setflags(write=False)  # as the read-only views of a reply's bytes
        masks = {}
        if "conv" in arrays and i % 2:
            masks["conv"] = (rng.random(6) < 0.5).astype(np.float32)  # output channels
        if "fc" in arrays and i % 3 == 0:
            masks["fc"] = (rng.random((1, 24)) < 0.5).astype(np.float32)  # broadcasts over rows
        updates.append(ClientUpdate(float(rng.integers(1, 90)), arrays, masks))
        bases.append({k: (v + rng.normal(scale=0.01, size=v.shape)).astype(v.dtype) for k, v in state.items()})
    discounts = [1 / math.sqrt(1 + i % 3) for i in range(9)]
    for new, old in (
        (aggregate_partial(state, updates), _plain_aggregate_partial(state, updates)),
        (aggregate_buffered(state, updates, bases, discounts), _plain_aggregate_buffered(state, updates, bases, discounts)),
    ):
        for k in state:
            assert new[k].dtype == old[k].dtype and new[k].tobytes() == old[k].tobytes(), k


# -- results written behind, beside the next round --------------------------------------------------


def test_rows_and_checkpoint_are_written_behind_in_order(make_scenario, monkeypatch):
    """Round 2's client rows are written while round 3 trains; its checkpoint never overtakes
    them; the finished run's files are the same as when every write is made at once. The writer is
    held at round 2's client rows by wrapping the private ``_Table.append`` (no public hook pauses it)."""
    import threading

    import torch

    import fedelastic.fl.client as client
    import fedelastic.results.recorder as results

    release, blocked = threading.Event(), threading.Event()
    real_append, real_train = results._Table.append, client.train_local

    def slow_append(self, rows):
        if self.csv.stem == "clients" and rows[0]["round"] == 2 and not release.is_set():
            blocked.set()
            assert release.wait(60)
        real_append(self, rows)

    seen = {}

    def train(*args, seed, **kwargs):
        if seed[1] == 3 and not release.is_set():  # round 3 trains while the writer is on round 2's rows
            assert blocked.wait(60)
            run = Path(sc.output_dir) / "tiny" / "behind"
            seen["csv_rounds"] = set(pd.read_csv(run / "clients.csv")["round"])
            seen["checkpoint"] = torch.load(run / "checkpoint.pt", weights_only=True)["round"]
            release.set()
        return real_train(*args, seed=seed, **kwargs)

    monkeypatch.setattr(results._Table, "append", slow_append)
    monkeypatch.setattr(client, "train_local", train)
    # each round handed over; train_local is patched: the per-client path
    sc = make_scenario(server={"rounds": 3}, simulation={"write_every_s": 0, "vectorize": False})
    behind = run_scenario(sc, run_id="behind")
    assert seen == {"csv_rounds": {1}, "checkpoint": 1}
    monkeypatch.setattr(results.Recorder, "write_behind", lambda self, every_s=0.0: None)  # every write at once
    at_once = run_scenario(sc, run_id="at_once")
    for name in ("clients", "rounds"):
        pd.testing.assert_frame_equal(
            _no_host(pd.read_parquet(behind / f"{name}.parquet")), _no_host(pd.read_parquet(at_once / f"{name}.parquet"))
        )
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (behind, at_once))
    assert a["round"] == b["round"] == 3 and a["server"] == b["server"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert results.read_status(behind)["status"] == "completed" and results.read_status(behind)["rounds_done"] == 3


def test_a_failed_write_behind_fails_the_run_and_keeps_earlier_rounds(make_scenario, monkeypatch):
    import fedelastic.results.recorder as results

    full_disk(monkeypatch, lambda name, rounds: name == "clients" and 2 in rounds)
    sc = make_scenario(server={"rounds": 4}, simulation={"write_every_s": 0})  # each round handed over
    with pytest.raises(OSError, match="No space left"):
        run_scenario(sc, run_id="full")
    run = Path(sc.output_dir) / "tiny" / "full"
    status = results.read_status(run)
    assert status["status"] == "failed" and "No space left" in status["error"]
    # round 1 complete (rows and checkpoint); nothing after the failed write
    assert set(pd.read_csv(run / "clients.csv")["round"]) == {1}
    assert list(pd.read_csv(run / "rounds.csv")["round"]) == [0, 1]
    import torch

    assert torch.load(run / "checkpoint.pt", weights_only=True)["round"] == 1


def test_a_comparison_with_skipped_evaluations(tmp_path):
    import tomli_w

    from fedelastic.api import stop_at_accuracy
    from fedelastic.comparisons.comparison import run_comparison

    raw = small_scenario_dict(tmp_path, server={"rounds": 3, "evaluate_every": 2})
    raw["compare"] = {"strategies": ["full"], "fleets": {"sbc": {"raspberry_pi_4": 3}}, "seeds": [0, 1]}
    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(raw))
    out = run_comparison(path, output=tmp_path / "cmp")
    runs = pd.read_csv(out / "runs.csv")
    assert runs.loc[runs.test_accuracy.isna(), "round"].unique().tolist() == [1]  # rounds 0, 2, 3 evaluated
    assert pd.read_csv(out / "summary.csv").final_accuracy.notna().all()
    assert (out / "comparison.png").stat().st_size > 0
    # early stopping never fires on a round without an accuracy
    assert not stop_at_accuracy(0.0)({"round": 1, "test_accuracy": math.nan})


def test_a_progress_callback_that_changes_its_row_does_not_change_the_results(make_scenario):
    def meddle(row):  # the row is written after progress sees it: a copy is written
        row["test_accuracy"], row["clients"] = 123.0, -1

    run = run_scenario(make_scenario(server={"rounds": 2}), run_id="meddle", progress=meddle)
    rounds = pd.read_parquet(run / "rounds.parquet")
    assert (rounds.test_accuracy <= 1).all() and rounds.clients.tolist() == [0, 4, 4]


def test_a_failed_write_is_raised_at_the_next_round_and_stops_training(make_scenario, monkeypatch):
    """At most one round waits to be written: round 2's failed write stops the run before round 4 is sent."""
    from fedelastic.fl import server

    real_messages = server.EngineStrategy.messages
    sent: list[int] = []

    def spy(self, plan, arrays):
        sent.append(plan.round)
        return real_messages(self, plan, arrays)

    full_disk(monkeypatch, lambda name, rounds: name == "clients" and 2 in rounds)
    monkeypatch.setattr(server.EngineStrategy, "messages", spy)
    sc = make_scenario(server={"rounds": 6}, simulation={"write_every_s": 0})
    with pytest.raises(OSError, match="No space left"):
        run_scenario(sc, run_id="full")
    assert sent == [1, 2, 3]  # round 3's client rows wait for round 2's write, which failed


def test_a_failed_write_in_the_round_a_callback_stops_fails_the_run(make_scenario, monkeypatch):
    import fedelastic.results.recorder as results
    from fedelastic.errors import StopRun

    def stop_at_2(row):
        if row["round"] == 2:
            raise StopRun("enough")

    full_disk(monkeypatch, lambda name, rounds: name == "clients" and 2 in rounds)
    sc = make_scenario(server={"rounds": 4}, simulation={"write_every_s": 0})
    with pytest.raises(OSError, match="No space left"):
        run_scenario(sc, run_id="stop", progress=stop_at_2)
    status = results.read_status(Path(sc.output_dir) / "tiny" / "stop")
    assert status["status"] == "failed" and "No space left" in status["error"]


def test_async_aggregations_are_handed_to_the_writer_before_the_next_one(make_scenario, monkeypatch):
    import fedelastic.results.recorder as results

    real = results.Recorder.add_clients
    waiting: list[int] = []

    def spy(self, rows):
        real(self, rows)  # hands over and waits for everything before this aggregation
        waiting.append(len(self._kept))  # this aggregation's own rows only

    monkeypatch.setattr(results.Recorder, "add_clients", spy)
    sc = make_scenario(
        server={"rounds": 8, "policy": "async", "concurrency": 4, "buffer_size": 1},
        fleet={"raspberry_pi_4": 4},
        simulation={"write_every_s": 0},
    )
    run_scenario(sc, run_id="async")
    assert waiting and max(waiting) == 1


def test_a_hand_over_interrupted_by_ctrl_c_writes_each_job_once(tmp_path):
    from fedelastic.results.recorder import Recorder

    rec = Recorder(tmp_path / "run", {"x": 1})
    rec.write_behind()
    ran: list[int] = []
    for i in range(3):
        rec.write(lambda i=i: ran.append(i))
    real, calls = rec._writer.submit, []

    def submit(job):
        calls.append(job)
        real(job)
        if len(calls) == 1:
            raise KeyboardInterrupt  # Ctrl-C lands inside the hand-over, after the batch was queued

    rec._writer.submit = submit
    with pytest.raises(KeyboardInterrupt):
        rec.hand_over()
    rec.flush_quietly()  # hands the same writes over again
    rec.close()
    assert ran == [0, 1, 2] and len(calls) == 2


@pytest.mark.parametrize(("policy", "node_mode"), [("wait_all", "cohort"), ("deadline_drop", "cohort"), ("wait_all", "per_client")])
def test_a_rounds_writes_go_to_the_writer_once_the_next_rounds_messages_are_built(make_scenario, monkeypatch, policy, node_mode):
    """Handed over as the messages leave (GuardedGrid's on_sent), after the cohort packed them and
    before any client runs: never while the driver's thread still builds them, nor at the empty
    send of Flower's evaluate step, while the driver evaluates the model."""
    import fedelastic.fl.cohort as cohort
    import fedelastic.fl.grids as grids
    import fedelastic.results.recorder as results

    events: list[str] = []

    def logged(cls, name, tag):
        real = getattr(cls, name)

        def call(self, *args, **kwargs):
            if tag == "hand_over":
                events.append(f"hand_over:{len(self._kept)}")
            else:
                events.append(tag)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, call)

    logged(cohort.CohortGrid, "_pack", "pack")
    logged(results.Recorder, "hand_over", "hand_over")
    logged(grids.InProcessGrid, "_call", "call")
    deadline = {} if policy == "wait_all" else {"deadline_quantile": 0.6}
    sim = {"node_mode": node_mode, "write_every_s": 0}  # each round handed over
    run_scenario(make_scenario(server={"rounds": 4, "policy": policy, **deadline}, simulation=sim))
    handed = [i for i, e in enumerate(events) if e.startswith("hand_over:") and e != "hand_over:0"]
    assert len(handed) >= 3, events  # every round after the first has writes waiting
    for i in handed[:-1]:  # the last: the run's final flush
        assert events[i + 1] == "call", events[max(0, i - 3) : i + 3]
        assert events[i - 1] == "pack" or node_mode == "per_client", events[max(0, i - 3) : i + 3]


@pytest.mark.perf
def test_the_start_ups_objects_are_frozen_during_the_rounds_only(make_scenario):
    """A full collection walks only what the rounds make (gc.freeze after the set-up); the run
    hands every object back to the collector when it ends: stopped by a callback, or failed."""
    import gc

    from fedelastic.errors import StopRun

    frozen: list[int] = []

    def progress(row):
        frozen.append(gc.get_freeze_count())
        if row["round"] == 1:
            raise StopRun("enough")

    assert gc.get_freeze_count() == 0
    run_scenario(make_scenario(server={"rounds": 3}), progress=progress, run_id="stopped")
    assert len(frozen) == 2 and min(frozen) > 10_000  # round 0's row and round 1's
    assert gc.get_freeze_count() == 0

    def fail(row):
        raise RuntimeError("a callback that fails")

    with pytest.raises(RuntimeError, match="a callback that fails"):
        run_scenario(make_scenario(server={"rounds": 3}), progress=fail, run_id="failed")
    assert gc.get_freeze_count() == 0
