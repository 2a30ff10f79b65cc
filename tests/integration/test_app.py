"""fedelastic as a Flower App: the run config, the module-level apps, and a real `flwr run`."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import tomli_w
from flwr.app import Context, RecordDict
from flwr.common.config import flatten_dict

from fedelastic.app import client_app, scenario_from_run_config, server_app
from fedelastic.config import to_dict
from fedelastic.errors import ConfigError
from fedelastic.fl.grids import InProcessGrid
from fedelastic.fl.runner import run_scenario
from fedelastic.scenario import load_scenario
from tests.support import ROOT, processes_with, small_scenario_dict


def _pyproject_run_config() -> dict:
    raw = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return flatten_dict(raw["tool"]["flwr"]["app"]["config"])


def test_default_run_config_is_the_quickstart_unchanged():
    # every declared override key is "" (keep the file's value), so the result is the file itself
    config = _pyproject_run_config()
    assert config["scenario"] == "simulations/quickstart.toml"
    assert {k for k, v in config.items() if v != ""} == {"scenario"}
    got = scenario_from_run_config(config, ROOT)
    want = load_scenario(ROOT / "simulations" / "quickstart.toml")
    assert to_dict(got) == to_dict(want)


def test_run_config_keys_override_dotted_scenario_keys(tmp_path):
    (tmp_path / "sims").mkdir()
    (tmp_path / "sims" / "tiny.toml").write_text(tomli_w.dumps(small_scenario_dict(tmp_path)))
    sc = scenario_from_run_config(
        {"scenario": "sims/tiny.toml", "server.rounds": 7, "train.lr": "", "seed": 11, "train.strategy": "last_layer"},
        tmp_path,
    )
    assert (sc.server.rounds, sc.seed, sc.train.strategy) == (7, 11, "last_layer")
    assert sc.train.lr == 0.05 and sc.train.max_steps == 3  # "" and absent keys keep the file's values
    with pytest.raises(ConfigError, match="server.round"):
        scenario_from_run_config({"scenario": "sims/tiny.toml", "server.round": 3}, tmp_path)
    with pytest.raises(ConfigError, match="'scenario'"):
        scenario_from_run_config({"server.rounds": 3}, tmp_path)
    with pytest.raises(ConfigError, match="missing.toml"):
        scenario_from_run_config({"scenario": "missing.toml"}, tmp_path)


def test_module_level_apps_run_a_scenario_like_fedelastic_run(tmp_path):
    """The ServerApp (with its Recorder) and ClientApp driven by a grid give the runner's results."""
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 3})))
    run_config = {"scenario": str(path), "server.rounds": 2, "output_dir": str(tmp_path / "app-runs")}
    grid = InProcessGrid(client_app, 4)
    for ctx in grid.contexts.values():
        ctx.run_config = dict(run_config)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flwr").addHandler(handler)  # where `flwr run --stream` reads the ServerApp's lines
    try:
        server_app(grid=grid, context=Context(0, 0, {}, RecordDict(), dict(run_config)))
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert [m.split(":")[0] for m in seen if m.startswith("[fedelastic] round")] == [
        "[fedelastic] round 0", "[fedelastic] round 1", "[fedelastic] round 2"
    ]  # fmt: skip

    (run_dir,) = (tmp_path / "app-runs" / "tiny").iterdir()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert (run_dir / "accuracy_vs_time.png").stat().st_size > 0  # the figure `fedelastic run` writes
    assert not (run_dir / "superlink.pid").exists()  # no SuperLink here: none is named
    reference = run_scenario(scenario_from_run_config(run_config), run_id="ref")
    for table in ("clients", "rounds"):
        got = pd.read_parquet(run_dir / f"{table}.parquet").drop(columns="host_wall_s")
        want = pd.read_parquet(reference / f"{table}.parquet").drop(columns="host_wall_s")
        assert list(got["round"].unique()) == list(range(0 if table == "rounds" else 1, 3))
        pd.testing.assert_frame_equal(got, want)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the SuperLink's processes through /proc")
def test_flwr_run_runs_the_app_on_a_local_simulation_federation(tmp_path):
    """`flwr run .` starts a local SuperLink, runs a tiny scenario, and we stop every process it left."""
    scenario = tmp_path / "tiny.toml"
    raw = small_scenario_dict(tmp_path, server={"rounds": 4})
    raw["fleet"] = {"raspberry_pi_4": 1, "jetson_nano": 1}
    scenario.write_text(tomli_w.dumps(raw))
    home = tmp_path / "flwr-home"
    env = {
        **os.environ,
        "FLWR_HOME": str(home),  # Flower's config, the SuperLink's state and the installed app go here
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",  # offline: use this environment's packages
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    marker = f"FLWR_HOME={home}".encode()
    out = tmp_path / "runs"
    cmd = [
        str(Path(sys.executable).parent / "flwr"),
        "run",
        str(ROOT),
        "--run-config",
        f'scenario="{scenario}" output_dir="{out}" server.rounds=2 train.strategy="last_layer"',
        "--federation-config",
        "num-supernodes=2 client-resources-num-cpus=1",
        "--stream",
    ]
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log
        assert "Starting local SuperLink" in log, log
        assert "[fedelastic] round 2: test accuracy" in log, log  # per-round progress reaches --stream
    finally:
        left = processes_with(marker)
        for pid in left:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)
    assert any("flower-superlink" in cmdline for cmdline in left.values()), left  # we found and stopped it
    time.sleep(0.5)
    assert not processes_with(marker), "processes of the local SuperLink outlived the test"

    (run_dir,) = (out / "tiny").iterdir()
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed", log
    pid = int((run_dir / "superlink.pid").read_text())  # the process `kill PID` stops, as the log says
    assert "flower-superlink" in left[pid] and f"stop it with `kill {pid}`" in log, (pid, left)
    rounds = pd.read_csv(run_dir / "rounds.csv")
    clients = pd.read_csv(run_dir / "clients.csv")
    assert list(rounds["round"]) == [0, 1, 2]  # --run-config's server.rounds=2 replaced the file's 4
    assert sorted(clients.partition_id.unique()) == [0, 1] and set(clients.strategy) == {"last_layer"}
    assert (clients.fraction_params_trained < 0.5).all()  # last_layer trains the classifier only
