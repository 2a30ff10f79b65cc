"""Run folders and scenarios from elsewhere: every check that can refuse them comes before a
model file's code runs, and files planted in a run folder are not written through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tomli_w

import fedelastic as fe
from fedelastic.cli import main
from fedelastic.errors import ConfigError
from fedelastic.results.recorder import read_status
from tests.support import small_scenario_dict

EVIL = """
from pathlib import Path
Path({marker!r}).write_text("ran")


def f(num_classes, in_channels, input_size):
    raise RuntimeError("never called")
"""


def _evil(tmp: Path) -> tuple[str, Path]:
    """A model file that leaves a marker when imported: 'path.py:f' and the marker."""
    marker = tmp / "imported"
    (tmp / "evil_model.py").write_text(EVIL.format(marker=str(marker)))
    return f"{tmp / 'evil_model.py'}:f", marker


def _foreign_run_folder(tmp: Path, status: dict | None) -> tuple[Path, Path]:
    name, marker = _evil(tmp)
    folder = tmp / "elsewhere"
    folder.mkdir()
    raw = small_scenario_dict(tmp, model={"name": name, "options": {}})
    (folder / "config.toml").write_text(tomli_w.dumps(raw))
    if status is not None:
        (folder / "status.json").write_text(json.dumps(status))
    return folder, marker


@pytest.mark.parametrize(
    "status, expected",
    [
        ({"status": "failed"}, "no checkpoint to resume from"),
        ({"status": "completed"}, "the run already finished"),
        (None, "nothing to resume"),  # no status.json
    ],
    ids=["failed_no_checkpoint", "completed", "no_status"],
)
def test_resume_of_a_foreign_folder_is_refused_before_its_model_file_runs(tmp_path, capsys, status, expected):
    folder, marker = _foreign_run_folder(tmp_path, status)
    if status is None:
        expected = "no checkpoint to resume from"  # 'missing' status: resumable only with a checkpoint
    assert main(["run", "--resume", str(folder)]) == 2
    assert expected in capsys.readouterr().err
    assert not marker.exists()


def test_resume_with_a_garbage_checkpoint_is_refused_before_its_model_file_runs(tmp_path, capsys):
    folder, marker = _foreign_run_folder(tmp_path, {"status": "failed"})
    (folder / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert main(["run", "--resume", str(folder)]) == 2
    assert "not a readable checkpoint" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize(
    "argv_tail, overrides, expected",
    [
        (["--run-id", "../outside"], {}, "--run-id"),
        (["--run-id", "ok"], {"fleet": {"no_such_board": 1}}, "no_such_board"),
        (["--run-id", "ok"], {"device_dirs": ["missing_dir"]}, "device_dirs[0]"),
        (["--rounds", "0"], {}, "--rounds"),
    ],
    ids=["bad_run_id", "unknown_device", "missing_device_dir", "bad_rounds"],
)
def test_a_scenarios_model_file_runs_only_after_every_other_check(tmp_path, capsys, argv_tail, overrides, expected):
    name, marker = _evil(tmp_path)
    raw = small_scenario_dict(tmp_path, model={"name": name, "options": {}})
    raw.update(overrides)
    path = tmp_path / "scn.toml"
    path.write_text(tomli_w.dumps(raw))
    assert main(["run", str(path), *argv_tail]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()


def test_the_python_api_checks_the_run_id_before_the_model_file_runs(tmp_path):
    name, marker = _evil(tmp_path)
    raw = small_scenario_dict(tmp_path, model={"name": name, "options": {}})
    with pytest.raises(ConfigError, match="--run-id"):
        fe.run(raw, run_id="a/b")
    assert not marker.exists()


def _replace_with_link(target: Path, outside: Path) -> None:
    target.unlink(missing_ok=True)
    target.symlink_to(outside)


@pytest.mark.parametrize("planted", ["clients.csv", "rounds.csv", "rounds.parquet"])
def test_a_link_planted_in_a_run_folder_is_not_written_through(tmp_path, planted):
    """After round 1 a result file is replaced by a link to a file (or folder) outside output_dir:
    no later write goes through it; the run fails naming the link."""
    outside = tmp_path / "outside"
    if planted.endswith(".parquet"):
        outside.mkdir()
    else:
        outside.write_text("precious\n")
    run_dirs: list[Path] = []

    def plant(row: dict) -> None:
        if row["round"] == 1:
            run_dir = next((tmp_path / "runs" / "tiny").iterdir())
            run_dirs.append(run_dir)
            target = run_dir / planted
            if target.is_dir():
                import shutil

                shutil.rmtree(target)
            _replace_with_link(target, outside)

    with pytest.raises(OSError, match="symbolic link"):
        fe.run(small_scenario_dict(tmp_path, server={"rounds": 3}, simulation={"write_every_s": 0}),
               run_id="planted", progress=plant)  # fmt: skip
    status = read_status(run_dirs[0])
    assert status["status"] == "failed" and "symbolic link" in status["error"], status
    if outside.is_dir():
        assert list(outside.iterdir()) == []
    else:
        assert outside.read_text() == "precious\n"


def test_a_link_planted_as_errors_log_is_not_written_through(tmp_path):
    from fedelastic.results.recorder import Recorder

    outside = tmp_path / "outside.txt"
    outside.write_text("precious\n")
    rec = Recorder(tmp_path / "run", {})
    _replace_with_link(tmp_path / "run" / "errors.log", outside)
    with pytest.raises(OSError, match="symbolic link"):
        rec.log_error("a client failed")
    rec.close()
    assert outside.read_text() == "precious\n"


def test_resume_refuses_a_device_profile_changed_since_the_run_started(tmp_path, capsys):
    """A profile edited between the kill and the resume would mix two devices' figures in one run."""
    import tomllib

    from fedelastic.devices.profile import builtin_profile_dir

    devices = tmp_path / "devices"
    devices.mkdir()
    board = devices / "my_board.toml"
    raw = tomllib.loads((builtin_profile_dir() / "jetson_nano.toml").read_text())
    raw["name"] = "my_board"
    board.write_text(tomli_w.dumps(raw))
    scenario = small_scenario_dict(tmp_path, server={"rounds": 3}, simulation={"write_every_s": 0},
                                   device_dirs=[str(devices)])  # fmt: skip
    scenario["fleet"] = {"my_board": 2, "raspberry_pi_4": 1}

    def stop(row: dict) -> None:
        if row["round"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fe.run(scenario, run_id="stopped", progress=stop)
    run_dir = tmp_path / "runs" / "tiny" / "stopped"
    assert read_status(run_dir)["status"] == "failed" and (run_dir / "checkpoint.pt").exists()
    original = board.read_text()
    raw["power"]["train"]["value"] = raw["power"]["train"]["value"] * 10  # 10 W -> 100 W
    board.write_text(tomli_w.dumps(raw))
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert str(board) in err and "changed since the run started" in err, err
    assert read_status(run_dir)["status"] == "failed"  # untouched
    board.write_text(original)
    assert main(["run", "--resume", str(run_dir)]) == 0


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_round_0(tmp_path):
    """Its folder holds the config, versions, profiles and a status written by the run, no
    checkpoint and no rows: --resume runs it from round 0, to the tables of an uninterrupted run."""
    import pandas as pd

    from fedelastic.fl.checkpoint import CHECKPOINT

    scenario = small_scenario_dict(tmp_path, server={"rounds": 2}, simulation={"write_every_s": 0})

    def stop(row: dict) -> None:
        raise KeyboardInterrupt  # at the initial evaluation's row

    with pytest.raises(KeyboardInterrupt):
        fe.run(scenario, run_id="early", progress=stop)
    early = tmp_path / "runs" / "tiny" / "early"
    for name in (CHECKPOINT, "rounds.csv", "rounds.parquet", "clients.csv", "clients.parquet"):  # as before its first write
        target = early / name
        if target.is_dir():
            import shutil

            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    assert read_status(early)["status"] == "failed" and not (early / CHECKPOINT).exists()
    assert main(["run", "--resume", str(early)]) == 0
    assert main(["run", str(write(tmp_path / "whole.toml", scenario)), "--run-id", "whole"]) == 0
    whole = tmp_path / "runs" / "tiny" / "whole"
    for name in ("rounds", "clients"):
        a, b = (pd.read_csv(d / f"{name}.csv") for d in (early, whole))
        host = [c for c in a.columns if c.startswith("host_")]
        pd.testing.assert_frame_equal(a.drop(columns=host), b.drop(columns=host))
    assert read_status(early)["status"] == "completed"


def write(path: Path, raw: dict) -> Path:
    path.write_text(tomli_w.dumps(raw))
    return path


def test_an_async_run_is_refused_by_resume_and_keeps_its_status(tmp_path, capsys):
    scenario = small_scenario_dict(tmp_path, server={"rounds": 3, "policy": "async"}, simulation={"write_every_s": 0})

    def stop(row: dict) -> None:
        if row["round"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fe.run(scenario, run_id="async", progress=stop)
    run_dir = tmp_path / "runs" / "tiny" / "async"
    before = read_status(run_dir)
    assert before["status"] == "failed"
    assert main(["run", "--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "server.policy = 'async' cannot be resumed" in err and len(err.strip().splitlines()) == 1, err
    assert read_status(run_dir) == before
