"""The Python API, used as the README's notebook example uses it."""

import subprocess
import sys
import tomllib

import pandas as pd
import pytest
import tomli_w

import fedelastic as fe
from fedelastic.api import apply_overrides, parse_overrides
from fedelastic.errors import ConfigError
from tests.support import small_scenario_dict


def test_import_stays_light():
    code = "import sys, fedelastic; print(any(m in sys.modules for m in ('torch', 'flwr', 'ray', 'pandas')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_parse_overrides_types_values_as_toml():
    assert parse_overrides(["train.lr=1e-3", "server.rounds=-1", "train.strategy=full", "data.classes=[1, 2]"]) == {
        "train.lr": 0.001,
        "server.rounds": -1,
        "train.strategy": "full",
        "data.classes": [1, 2],
    }
    with pytest.raises(ConfigError):
        parse_overrides(["no_equals_sign"])


def test_apply_overrides_sets_nested_keys_without_touching_the_input():
    raw = {"train": {"lr": 0.1}, "name": "a"}
    out = apply_overrides(raw, {"train.lr": 0.5, "model.options.width": 4})
    assert out == {"train": {"lr": 0.5}, "name": "a", "model": {"options": {"width": 4}}}
    assert raw == {"train": {"lr": 0.1}, "name": "a"}
    with pytest.raises(ConfigError) as info:
        apply_overrides(raw, {"name.x": 1})
    assert info.value.key == "name"


def test_notebook_example(tmp_path):
    """The README's notebook section, run as written (small in-process scenario)."""
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path)))
    rows = []
    result = fe.run(path, server__rounds=1, progress=rows.append)
    assert isinstance(result.rounds, pd.DataFrame) and list(result.rounds["round"]) == [0, 1]
    assert len(result.clients) == 4 and set(result.clients.device) == {"raspberry_pi_4", "jetson_nano", "stm32h743"}
    assert [r["round"] for r in rows] == [0, 1]
    assert result.status["status"].startswith("completed")
    assert result.plot().stat().st_size > 0
    # an override goes through the same validation as a file
    with pytest.raises(ConfigError) as info:
        fe.run(path, train__lrr=0.1)
    assert info.value.key == "train.lrr"
    # a Scenario object works too, and overrides apply to it
    sc = fe.load(path, overrides={"train.lr": 0.01})
    assert isinstance(sc, fe.Scenario) and sc.train.lr == 0.01


def test_callback_stops_the_run_early_and_keeps_its_rounds(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 4})))
    seen = []
    result = fe.run(path, callbacks=[seen.append, lambda row: row["round"] == 2])
    assert [r["round"] for r in seen] == [0, 1, 2]  # every callback saw every round up to the stop
    assert list(result.rounds["round"]) == [0, 1, 2]
    status = result.status
    assert status["status"] == "completed" and status["stopped_after_round"] == 2
    # a target that round 0 already meets does not stop before any training
    again = fe.run(path, server__rounds=1, callbacks=[fe.stop_at_accuracy(0.0)])
    assert list(again.rounds["round"]) == [0, 1] and again.status["stopped_after_round"] == 1


def test_compare_takes_seeds_strategies_fleets_and_dotted_overrides(tmp_path):
    raw = small_scenario_dict(tmp_path, server={"rounds": 1})
    raw["compare"] = {"strategies": ["full", "bn_bias"], "seeds": [0, 1, 2]}
    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(raw))
    result = fe.compare(
        path, seeds=[4], strategies=[{"strategy": "last_layer", "label": "head"}], fleets={"pis": {"raspberry_pi_4": 2}},
        overrides={"train.lr": 0.02}, train__max_steps=2,
    )  # fmt: skip
    summary = pd.read_csv(result.folder / "summary.csv")
    assert summary[["fleet", "strategy", "seed"]].values.tolist() == [["pis", "head", 4]]
    cell = tomllib.loads(next(tmp_path.rglob("config.toml")).read_text())
    assert cell["train"]["lr"] == 0.02 and cell["train"]["max_steps"] == 2 and cell["fleet"] == {"raspberry_pi_4": 2}
    assert tomllib.loads(path.read_text())["compare"]["seeds"] == [0, 1, 2]  # the file is left as it was
