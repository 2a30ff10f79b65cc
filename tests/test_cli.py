"""The typer command line: usage errors are one line with exit 2, every command has --help."""

import pytest

from fedelastic.cli import main

COMMANDS = [
    ["run"], ["compare"], ["report"], ["strategies"], ["models"], ["pretrain"],
    ["devices"], ["devices", "list"], ["devices", "show"], ["devices", "validate"],
    ["profile"], ["profile", "measure"], ["profile", "import-trace"],
]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) for c in COMMANDS])
def test_every_command_has_help(command, capsys):
    assert main([*command, "--help"]) == 0
    out = capsys.readouterr().out
    assert "Usage: fedelastic " + " ".join(command) in out, out


@pytest.mark.parametrize(
    "argv, says",
    [
        (["nope"], "No such command 'nope'"),
        (["run", "--bogus"], "No such option '--bogus'"),
        (["run", "x.toml", "--backend", "gpu"], "--backend"),
        (["run", "x.toml", "--rounds", "two"], "--rounds"),
        (["devices", "show"], "Missing argument 'NAME'"),
        (["profile", "measure", "--out", "x.toml"], "--model"),
        (["compare"], "Missing argument 'SCENARIO'"),
    ],
)
def test_usage_error_is_one_line_on_stderr_with_exit_2(argv, says, capsys):
    assert main(argv) == 2
    got = capsys.readouterr()
    assert got.out == ""
    lines = got.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: fedelastic") and says in lines[0], got.err


@pytest.mark.parametrize("argv", [[], ["devices"], ["profile"]])
def test_a_group_without_its_command_shows_its_help_and_exits_2(argv, capsys):
    assert main(argv) == 2
    got = capsys.readouterr()
    assert "Usage: fedelastic " + " ".join(argv) in got.out
    lines = got.err.splitlines()
    assert len(lines) == 1 and "a command is needed" in lines[0], got.err


def test_a_runs_own_config_toml_runs_again_to_the_same_results(tmp_path, capsys):
    import pandas as pd
    import tomli_w

    from .conftest import small_scenario_dict

    scenario = tmp_path / "tiny.toml"
    scenario.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 1})))
    assert main(["run", str(scenario), "--run-id", "first"]) == 0
    first = next((tmp_path / "runs").glob("*/first"))
    assert "source" in (first / "config.toml").read_text()  # what used to be refused
    assert main(["run", str(first / "config.toml"), "--run-id", "again"]) == 0, capsys.readouterr()
    again = next((tmp_path / "runs").glob("*/again"))
    cols = ["round", "sim_time_s", "test_accuracy", "test_loss", "total_energy_j", "mean_train_loss"]
    pd.testing.assert_frame_equal(pd.read_csv(first / "rounds.csv")[cols], pd.read_csv(again / "rounds.csv")[cols])
