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
    import tomllib

    import pandas as pd
    import tomli_w

    from tests.support import small_scenario_dict

    scenario = tmp_path / "tiny.toml"
    scenario.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 1})))
    assert main(["run", str(scenario), "--run-id", "first"]) == 0
    first = next((tmp_path / "runs").glob("*/first"))
    recorded = tomllib.loads((first / "config.toml").read_text())
    assert recorded["recorded"] == {"source": str(scenario)} and "source" not in recorded  # never a top-level key
    assert main(["run", str(first / "config.toml"), "--run-id", "again"]) == 0, capsys.readouterr()
    again = next((tmp_path / "runs").glob("*/again"))
    cols = ["round", "sim_time_s", "test_accuracy", "test_loss", "total_energy_j", "mean_train_loss"]
    pd.testing.assert_frame_equal(pd.read_csv(first / "rounds.csv")[cols], pd.read_csv(again / "rounds.csv")[cols])


def test_quantities_print_with_si_prefixes_and_missing_ones_as_n_a():
    from fedelastic.devices.units import fmt_bytes, si

    assert si(5.32e12, "FLOP/s") == "5.32 TFLOP/s" and si(25.6e9, "B/s") == "25.6 GB/s"
    assert si(480e6, "FLOP/s") == "480 MFLOP/s" and si(999.7, "B/s") == "1 kB/s" and si(7.0, "W") == "7 W"
    assert si(float("nan"), "B/s") == "n/a"
    for fmt in (fmt_bytes,):  # a device whose every client failed has no memory figure
        assert fmt(float("nan")) == "n/a" and fmt(2.0e9) == "2.0 GB" and fmt(512) == "512 B"


def test_devices_list_shows_whole_names_and_prefixed_peaks(tmp_path, capsys):
    import tomllib

    import tomli_w

    from fedelastic.devices.profile import builtin_profile_dir

    raw = tomllib.loads((builtin_profile_dir() / "jetson_nano.toml").read_text())
    raw["name"] = "jetson_agx_orin_64gb_with_a_long_name"
    raw["compute"]["peak_fp32"] = {"value": 5.32, "unit": "TFLOP/s", "source": "test"}

    (tmp_path / f"{raw['name']}.toml").write_text(tomli_w.dumps(raw))
    assert main(["devices", "list", "--dir", str(tmp_path)]) in (0, None)
    out = capsys.readouterr().out
    assert "jetson_agx_orin_64gb_with_a_long_name" in out  # on one line, not folded
    assert "5.32 TFLOP/s" in out and "e+" not in out
