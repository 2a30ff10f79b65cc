"""Bad input gets a clear error naming the file, the key and what was expected."""

import copy
import subprocess
import sys

import pytest
import tomli_w

from fedelastic.devices.profile import load_profile, parse_profile, profile_paths
from fedelastic.errors import ConfigError
from fedelastic.scenario import load_scenario
from tests.support import small_scenario_dict


def test_every_builtin_profile_validates():
    paths = profile_paths()
    assert len(paths) >= 10
    for path in paths.values():
        assert load_profile(path).name == path.stem


def _err(raw, **kw) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_profile(raw, "dev.toml", **kw)
    return info.value


def test_profile_missing_key(profile_raw):
    del profile_raw["power"]["idle"]
    e = _err(profile_raw)
    assert e.key == "power.idle" and "dev.toml" in str(e)


def test_profile_wrong_unit(profile_raw):
    profile_raw["compute"]["mem_bandwidth"]["unit"] = "W"
    e = _err(profile_raw)
    assert e.key == "compute.mem_bandwidth.unit" and "GB/s" in e.expected


def test_profile_wrong_type(profile_raw):
    profile_raw["memory"]["train"]["value"] = "lots"
    assert _err(profile_raw).key == "memory.train.value"
    raw = copy.deepcopy(profile_raw)
    raw["memory"]["train"] = 4
    assert _err(raw).key == "memory.train"


def test_profile_unknown_key(profile_raw):
    profile_raw["compute"]["turbo"] = {"value": 1, "unit": "1", "source": "x"}
    e = _err(profile_raw)
    assert e.key == "compute.turbo" and "unknown" in e.expected


def test_profile_missing_source(profile_raw):
    del profile_raw["network"]["uplink"]["source"]
    assert _err(profile_raw).key == "network.uplink.source"
    profile_raw["network"]["uplink"]["source"] = "  "
    assert _err(profile_raw).key == "network.uplink.source"


def test_profile_schema_version_and_name(profile_raw):
    assert _err({**profile_raw, "schema_version": 3}).key == "schema_version"
    assert _err(profile_raw, stem="other_name").key == "name"
    assert _err({**profile_raw, "device_class": "toaster"}).key == "device_class"


def test_profile_malformed_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("schema_version = = 1")
    with pytest.raises(ConfigError, match="bad.toml: key '<toml>'"):
        load_profile(bad)


def _write(tmp_path, raw):
    path = tmp_path / "scn.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"rounds": 3}, "rounds"),  # top-level unknown key (belongs under [server])
        ({"server": {"rounds": 2, "round": 3}}, "server.round"),
        ({"train": {"strategy": "nope"}}, "train.strategy"),
        ({"train": {"strategy": "full", "options": {"rho": 0.5}}}, "train.options.rho"),
        ({"fleet": {"jetson_nanoo": 2}}, "fleet.jetson_nanoo"),
        ({"model": {"name": "no_such_model"}}, "model.name"),
        ({"server": {"rounds": 0}}, "server.rounds"),
        ({"train": {"batch_size": "16"}}, "train.batch_size"),
        ({"data": {"partitioner": "zipf"}}, "data.partitioner"),
    ],
)
def test_scenario_errors_name_file_and_key(tmp_path, change, key):
    raw = small_scenario_dict(tmp_path)
    raw.update(change)
    path = _write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert info.value.key == key
    assert str(path) in str(info.value)


def test_malformed_profile_in_a_user_folder_is_reported(tmp_path, profile_raw):
    folder = tmp_path / "devices"
    folder.mkdir()
    profile_raw["name"] = "my_board"
    del profile_raw["compute"]["efficiency"]
    (folder / "my_board.toml").write_text(tomli_w.dumps(profile_raw))
    raw = small_scenario_dict(tmp_path, fleet={"my_board": 2}, device_dirs=["devices"])
    with pytest.raises(ConfigError) as info:
        load_scenario(_write(tmp_path, raw))
    assert info.value.key == "compute.efficiency" and "my_board.toml" in str(info.value)


def test_cli_prints_the_error_without_a_traceback(tmp_path):
    raw = small_scenario_dict(tmp_path)
    raw["train"]["strategy"] = "nope"
    path = _write(tmp_path, raw)
    proc = subprocess.run([sys.executable, "-m", "fedelastic.cli", "run", str(path)], capture_output=True, text=True)
    assert proc.returncode == 2
    out = proc.stdout + proc.stderr
    assert "train.strategy" in out and "Traceback" not in out
