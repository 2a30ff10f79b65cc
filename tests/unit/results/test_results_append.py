"""Results tables are appended per round: same frame as one table of all rows, a part per append."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from fedelastic.results.recorder import Recorder, _Table


def _rows(r: int) -> list[dict]:
    # types that change across rounds: an error string first in round 3, a NaN in an int column in
    # round 5, an all-missing bool column in round 6
    return [
        {
            "round": r,
            "partition_id": i,
            "loss": 0.5 + r + i / 8,
            "error": "boom" if (r == 3 and i == 1) else None,
            "n": math.nan if (r == 5 and i == 0) else i,
            "fits": None if r == 6 else bool(i % 2),
        }
        for i in range(3)
    ]


def test_parquet_folder_reads_back_as_one_frame_of_all_rows(tmp_path):
    table, every = _Table(tmp_path, "clients", keep_rows=False), []
    for r in range(1, 9):
        table.append(_rows(r))
        every += _rows(r)
        # a single DataFrame of every row so far
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "clients.parquet"), pd.DataFrame(every))
        assert pd.read_csv(tmp_path / "clients.csv")["round"].tolist() == [row["round"] for row in every]
    assert table.rows == [] and table.n_rows == 24
    parts = sorted(p.name for p in (tmp_path / "clients.parquet").iterdir())
    # round 3 gave the all-empty error column strings: rounds 1-3 merged into one part; the NaN of
    # round 5 fits the int column as a null and the empty bools of round 6 as nulls: appended
    assert parts == [f"part-{k:06d}.parquet" for k in range(1, 7)]
    assert len(pd.read_parquet(tmp_path / "clients.parquet" / parts[-1])) == 3  # only its own rows


def test_a_leftover_temporary_part_is_not_read(tmp_path):
    table = _Table(tmp_path, "rounds")
    table.append(_rows(1))
    (tmp_path / "rounds.parquet" / ".part-000002.parquet.tmp").write_bytes(b"half a file")
    assert pd.read_parquet(tmp_path / "rounds.parquet")["round"].tolist() == [1, 1, 1]


def test_failed_part_write_leaves_csv_and_parquet_agreeing(tmp_path, monkeypatch):
    table = _Table(tmp_path, "t")
    table.append(_rows(1))
    import pyarrow.parquet as pq  # what writes every part

    monkeypatch.setattr(pq, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    with pytest.raises(OSError):
        table.append(_rows(2))
    assert len(pd.read_csv(tmp_path / "t.csv")) == 3 and len(pd.read_parquet(tmp_path / "t.parquet")) == 3
    assert not list((tmp_path / "t.parquet").glob(".*"))


def test_recorder_counts_errors_without_keeping_client_rows(tmp_path):
    rec = Recorder(tmp_path / "run", {"x": 1})
    rec.add_clients(_rows(1) + _rows(3))
    rec.add_clients([{**_rows(4)[0], "error": "Traceback...\nValueError: bad"}])
    rec.add_tasks([{"round": r, "task": 0, "accuracy": r / 10} for r in (1, 3, 4)])
    counts = rec.counts()
    rec.close()
    assert counts["client_results"] == 7 and counts["clients_failed"] == 2
    assert counts["errors"] == {"boom": 1, "ValueError: bad": 1}
    assert rec.clients.rows == []
    rec2 = Recorder(tmp_path / "run", {}, resume=True)
    rec2.reload(lambda r: r["round"] <= 3)
    assert rec2.counts()["errors"] == {"boom": 1} and rec2.counts()["client_results"] == 6
    rec2.add_tasks([{"round": 4, "task": 0, "accuracy": 0.45}])  # round 4 again, after the resume
    rec2.close()
    tasks = pd.read_parquet(tmp_path / "run" / "tasks.parquet")
    assert tasks["round"].tolist() == [1, 3, 4] and tasks.accuracy.tolist() == [0.1, 0.3, 0.45]


def test_a_signature_that_typed_the_table_takes_the_fast_path_from_its_second_append(tmp_path):
    """The first part's types become the table's; the same value types again need no pandas round trip."""
    from tests.pandas_writer import PandasTable

    (tmp_path / "new").mkdir(), (tmp_path / "old").mkdir()
    new, old = _Table(tmp_path / "new", "t", keep_rows=False), PandasTable(tmp_path / "old", "t")
    for r in range(3):
        rows = [{"round": r, "loss": 0.5 + r, "status": "counted", "fits": True}]
        new.append([dict(row) for row in rows])
        old.append([dict(row) for row in rows])
        assert new.direct_parts == r  # the first append through pandas, every later one direct
        for part in sorted(p.name for p in (tmp_path / "old" / "t.parquet").iterdir()):
            assert (tmp_path / "new" / "t.parquet" / part).read_bytes() == (tmp_path / "old" / "t.parquet" / part).read_bytes()


def test_a_runs_rounds_table_is_never_merged(make_scenario):
    """Round 0's row (the initial model) carries the types of every later round's: one part per round."""
    from fedelastic.fl.runner import run_scenario

    run_dir = run_scenario(make_scenario(server={"rounds": 3}, simulation={"write_every_s": 0}))
    parts = sorted(p.name for p in (run_dir / "rounds.parquet").iterdir())
    assert parts == [f"part-{i:06d}.parquet" for i in range(1, 5)]  # rounds 0..3, each its own part
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    assert rounds["round"].tolist() == [0, 1, 2, 3]
    assert rounds.dtypes["round_time_s"] == "float64" and rounds.dtypes["clients"] == "int64"


def test_writer_warm_up_writes_nothing(tmp_path, monkeypatch):
    import sys

    from fedelastic.results.recorder import warm_up

    monkeypatch.chdir(tmp_path)
    warm_up()
    assert list(tmp_path.iterdir()) == []
    assert "pyarrow.parquet" in sys.modules


def _record(rec: Recorder, r: int, log: list) -> None:
    """What a round gives its recorder: client rows, the round row, the checkpoint (a logged job)."""
    rec.add_clients(_rows(r))
    rec.add_round({"round": r, "clients": 3, "loss": 0.5 + r})
    rec.write(lambda: log.append(f"checkpoint {r}"), newest_only=True)


def test_rounds_handed_over_within_every_s_are_written_together(tmp_path, monkeypatch):
    """``write_behind(every_s)``: the rounds kept between two hand-overs are one append per table
    and only the newest checkpoint, written after their rows; the files are byte for byte those of
    a recorder that writes every round at once."""
    import fedelastic.results.recorder as results

    clock = [100.0]
    monkeypatch.setattr(results.time, "monotonic", lambda: clock[0])
    log: list[str] = []
    real_append = _Table.append

    def logged(self, rows):
        if self.csv.parent.name == "behind":
            log.append(f"{self.csv.stem} {sorted({row['round'] for row in rows})}")
        real_append(self, rows)

    monkeypatch.setattr(_Table, "append", logged)
    at_once = Recorder(tmp_path / "at_once", {"x": 1})
    behind = Recorder(tmp_path / "behind", {"x": 1})
    behind.write_behind(every_s=10.0)
    for r in range(1, 8):
        _record(at_once, r, [])
        _record(behind, r, log)
        behind.hand_over()  # as round r + 1's messages leave
        clock[0] += 3.0  # rounds of 3 s: a hand-over every 4th round
        behind._writer.wait()
        if r == 1:
            assert log == ["clients [1]", "rounds [1]", "checkpoint 1"]  # the first hand-over at once
    assert log[3:] == ["clients [2, 3, 4, 5]", "rounds [2, 3, 4, 5]", "checkpoint 5"]  # at 112 s
    assert read_rounds(tmp_path / "behind") == [1, 2, 3, 4, 5]  # rounds 6 and 7 still kept
    behind.close()  # the final flush hands over the rest
    at_once.close()
    assert log[6:] == ["clients [6, 7]", "rounds [6, 7]", "checkpoint 7"]
    for name in ("clients", "rounds"):
        assert (tmp_path / "behind" / f"{name}.csv").read_bytes() == (tmp_path / "at_once" / f"{name}.csv").read_bytes()
        pd.testing.assert_frame_equal(
            pd.read_parquet(tmp_path / "behind" / f"{name}.parquet"), pd.read_parquet(tmp_path / "at_once" / f"{name}.parquet")
        )
    assert behind.counts()["errors"] == at_once.counts()["errors"] == {"boom": 1}


def read_rounds(run_dir) -> list[int]:
    return pd.read_csv(run_dir / "rounds.csv")["round"].tolist()


class _Killed(BaseException):
    """Stands for kill -9: nothing after it runs (not an Exception, so no handler catches it)."""


def _kill_at_step(kill_at: int, monkeypatch) -> dict:
    """From now on, the file-system step number ``kill_at`` (a rename, unlink, folder removal or
    Parquet part write; counted from 0) raises :class:`_Killed`; returns the step counter."""
    import os
    import shutil

    import pyarrow.parquet as pq

    steps = {"n": 0}

    def step(real):
        def wrapped(*args, **kwargs):
            if steps["n"] == kill_at:
                raise _Killed
            steps["n"] += 1
            return real(*args, **kwargs)

        return wrapped

    for mod, name in ((os, "replace"), (os, "rename"), (os, "unlink"), (shutil, "rmtree"), (pq, "write_table")):
        monkeypatch.setattr(mod, name, step(getattr(mod, name)))
    return steps


@pytest.mark.parametrize("kill_at", range(12))
def test_a_reload_killed_at_any_step_loses_no_finished_round(kill_at, tmp_path, monkeypatch):
    """Resume rewrites a table keeping rounds <= 3 of 5. Killed at each file-system step of that
    rewrite (every rename, unlink, folder removal and part write), the next reload still finds
    rounds 1 to 3 whole, and the CSV and Parquet agree: the rewrite goes through temporary names."""
    table = _Table(tmp_path, "clients", keep_rows=False)
    for r in range(1, 6):
        table.append(_rows(r))
    steps = _kill_at_step(kill_at, monkeypatch)
    keep = lambda row: row["round"] <= 3  # noqa: E731
    try:
        _Table(tmp_path, "clients", keep_rows=False).load(keep)
    except _Killed:
        pass
    monkeypatch.undo()
    assert kill_at < 3 or steps["n"] == kill_at  # the step was reached (a kill after the last one: none)
    again = _Table(tmp_path, "clients", keep_rows=False)
    rows = again.load(keep)
    expected = pd.DataFrame([row for r in range(1, 4) for row in _rows(r)])
    assert len(rows) == len(expected)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "clients.parquet"), expected, check_dtype=False)
    assert pd.read_csv(tmp_path / "clients.csv")["round"].tolist() == expected["round"].tolist()
    again.append(_rows(4))  # the resumed run goes on
    assert pd.read_parquet(tmp_path / "clients.parquet")["round"].tolist()[-1] == 4


def test_a_table_killed_before_its_first_rows_reloads_as_empty_and_takes_new_rows(tmp_path):
    """A Parquet folder with no part (or only a temporary one) and a CSV without a header read as
    an empty table; the resumed run's first rows then name the columns."""
    (tmp_path / "rounds.parquet").mkdir()
    (tmp_path / "rounds.parquet" / ".part-000001.parquet.tmp").write_bytes(b"half")
    (tmp_path / "rounds.csv").write_text("")
    table = _Table(tmp_path, "rounds", keep_rows=False)
    assert table.load(lambda row: True) == []
    table.append([{"round": 0, "test_accuracy": 0.1}])
    assert pd.read_parquet(tmp_path / "rounds.parquet")["round"].tolist() == [0]
    assert pd.read_csv(tmp_path / "rounds.csv").columns.tolist() == ["round", "test_accuracy"]


@pytest.mark.parametrize("kill_at", range(8))
def test_a_merge_killed_at_any_step_leaves_the_old_parts_or_the_merged_one_never_both(kill_at, tmp_path, monkeypatch):
    """Round 3 brings the first error string: the parts are merged into one. Killed at each step of
    that merge, the folder reads back as rounds 1-2 or rounds 1-3, each row once (before, a kill
    between the merged part's rename and the old parts' removal doubled rounds 1-2)."""
    table = _Table(tmp_path, "clients", keep_rows=False)
    table.append(_rows(1))
    table.append(_rows(2))
    _kill_at_step(kill_at, monkeypatch)
    try:
        table.append(_rows(3))
    except _Killed:
        pass
    monkeypatch.undo()
    rounds = _Table(tmp_path, "clients", keep_rows=False).load(lambda row: True)
    got = [row["round"] for row in rounds]
    assert got in ([1] * 3 + [2] * 3, [1] * 3 + [2] * 3 + [3] * 3), got
