"""Chaos, short: the driver killed with SIGKILL at seeded random instants (at start-up, before its
folder is filled, mid-round, while a resume reloads its tables), resumed after each kill; the final
tables equal an uninterrupted run's but the host-time columns. The full harness, with Ray and 100+
kills, quiet and at load: ``benchmarks/chaos.py`` (``benchmarks/studies/chaos.md``)."""

from __future__ import annotations

import importlib.util
import random

import pytest

from tests.support import ROOT


def _chaos():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "benchmarks" / "chaos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_killed_at_random_instants_and_resumed_the_tables_equal_an_uninterrupted_run(tmp_path):
    chaos = _chaos()
    result = chaos.run_case("inprocess-static_elastic", kills=2, seed=0, work=tmp_path)
    assert sum(e["kills"] for e in result["episodes"]) == 2
    for episode in result["episodes"]:
        assert episode["status"] == "completed" and episode["exit"] == 0, episode
        assert episode["tables_equal"], episode["problem"]


def test_instants_are_seeded_so_a_failure_replays():
    a, b = random.Random("0/ray-sync/3"), random.Random("0/ray-sync/3")
    assert [a.random() for _ in range(5)] == [b.random() for _ in range(5)]


def test_tables_equal_ignores_only_host_time_columns(tmp_path):
    import pandas as pd

    chaos = _chaos()
    for name, accuracy in (("a", 0.5), ("b", 0.5), ("c", 0.6)):
        folder = tmp_path / name
        folder.mkdir()
        for table in ("rounds", "clients"):
            frame = pd.DataFrame({"round": [0, 1], "test_accuracy": [0.1, accuracy], "host_wall_s": [0.1, 9.0 if name == "b" else 1.0]})
            frame.to_csv(folder / f"{table}.csv", index=False)
            frame.to_parquet(folder / f"{table}.parquet")
    assert chaos.tables_equal(tmp_path / "a", tmp_path / "b") == ""  # host time differs: equal
    assert chaos.tables_equal(tmp_path / "a", tmp_path / "c").startswith("rounds")
    assert "missing" in chaos.tables_equal(tmp_path / "a", tmp_path / "nothing")


def test_a_start_killed_before_its_folder_was_filled_starts_again_with_its_id(tmp_path, capsys):
    """The run folder is filled whole (staged, then renamed onto the empty reservation): a start
    killed in between leaves it empty, which --resume explains and the same --run-id takes."""
    from fedelastic.cli import main
    from tests.support import scenario_file

    path = scenario_file(tmp_path, server={"rounds": 1})
    empty = tmp_path / "runs" / "tiny" / "again"
    empty.mkdir(parents=True)
    (tmp_path / "runs" / "tiny" / ".again.new").mkdir()  # the killed start's half-filled staging folder
    assert main(["run", "--resume", str(empty)]) == 2
    assert "stopped before it started" in capsys.readouterr().err
    assert main(["run", str(path), "--run-id", "again"]) == 0
    assert (empty / "config.toml").is_file() and (empty / "rounds.csv").is_file()
    assert not (tmp_path / "runs" / "tiny" / ".again.new").exists()
