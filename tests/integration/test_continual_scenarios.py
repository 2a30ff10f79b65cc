"""The shipped continual scenarios run end to end, in-process, at reduced size."""

import json
import tomllib

import pandas as pd
import pytest

from fedelastic.fl.runner import run_scenario
from fedelastic.scenario import parse_scenario
from tests.support import ROOT

NAMES = ("continual_domain", "continual_classes", "single_device")


@pytest.mark.parametrize("name", NAMES)
def test_shipped_continual_scenario_runs_at_reduced_size(name, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDELASTIC_CACHE", str(tmp_path / "cache"))
    path = ROOT / "simulations" / f"{name}.toml"
    raw = tomllib.loads(path.read_text())
    raw["output_dir"] = str(tmp_path / "runs")
    raw["data"]["size"] = 1500
    raw["model"]["pretrain"]["epochs"] = 1
    raw["train"]["max_steps"] = 2
    raw["server"]["rounds"] = 4
    raw["stream"].update(task_rounds=1, domain_rounds=1, eval_samples=40)
    if raw["stream"].get("onset_jitter"):
        raw["stream"]["onset_jitter"] = 1
    sc = parse_scenario(raw, src=str(path))
    run_dir = run_scenario(sc, run_id="ci")
    tasks = pd.read_parquet(run_dir / "tasks.parquet")
    n_tasks = min(4, max(len(raw["stream"].get("tasks", [])), len(raw["stream"].get("domains", []))))
    assert tasks.task.nunique() == n_tasks and set(tasks["round"]) == set(range(5))
    assert tasks.accuracy.between(0, 1).all()
    summary = json.loads((run_dir / "continual.json").read_text())
    assert summary["tasks"] == n_tasks and len(summary["shifts"]) == n_tasks - 1
    assert (run_dir / "tasks_vs_time.png").exists()
    clients = pd.read_parquet(run_dir / "clients.parquet")
    assert clients.fits.any()
    if not raw["stream"].get("federated", True):
        assert (clients.emulated_bytes_up == 0).all()
