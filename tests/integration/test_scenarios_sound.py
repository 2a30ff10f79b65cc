"""Every shipped scenario and comparison, shrunk to a few steps, trains soundly: no client update is
rejected as non-finite or fails, no client reports a non-finite loss, no device type trains nothing
in every round, and no run diverges or fails.

The shrinking is ``benchmarks/scenarios.py --reduced``'s (1-4 rounds of 3 local steps, one
pretraining epoch, 3,000 generated images, in-process); the full-size figures are in benchmarks/studies/shipped-scenarios.md.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pandas as pd
import pytest

from fedelastic.config import read_toml
from fedelastic.results import idle
from tests.support import ROOT

SHIPPED = sorted((ROOT / "simulations").glob("*.toml"))


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("scenarios_bench", ROOT / "benchmarks" / "scenarios.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["scenarios_bench"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("scenarios_bench", None)


def test_every_shipped_scenario_is_covered():
    assert {p.stem for p in SHIPPED} >= {
        "quickstart", "adapt_new_classes", "adapt_rotated_mcu", "continual_classes", "continual_domain",
        "deadline_elastic", "single_device", "compare_fleets",
    }  # fmt: skip


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_shipped_scenario_states_its_time_on_a_2_core_machine(bench, path):
    assert "2-core machine" in path.read_text() and bench.header_seconds(path) is not None


def test_header_times_are_read_and_a_mismatch_is_flagged(bench, tmp_path):
    scenario = tmp_path / "s.toml"
    scenario.write_text("# A scenario.\n# About 40 s on this 2-core machine (load ~10)\nname = 'x'\n# About 9 s\n")
    assert bench.header_seconds(scenario) == 40.0  # the leading comment only
    scenario.write_text("# About 3 minutes for its 48 runs on this 2-core machine\nname = 'x'\n")
    assert bench.header_seconds(scenario) == 180.0
    scenario.write_text("name = 'x'  # About 40 s\n")
    assert bench.header_seconds(scenario) is None
    assert bench.vs_header(100.0, 40.0, 2.0) == (2.5, True) and bench.vs_header(30.0, 40.0, 2.0) == (0.75, False)
    assert bench.vs_header(10.0, 40.0, 2.0) == (0.25, True)
    ratio, flagged = bench.vs_header(10.0, None, 2.0)
    assert ratio != ratio and not flagged


def test_reduced_size_shrinks_rounds_steps_and_data(bench):
    raw = read_toml(ROOT / "simulations" / "continual_domain.toml", "scenario")
    small = bench.reduced(raw)
    assert small["server"]["rounds"] == 3 and small["stream"]["domain_rounds"] == 1  # three domains, one round each
    assert small["train"]["max_steps"] == 3 and small["model"]["pretrain"]["epochs"] == 1
    assert small["data"]["size"] == 3000 and small["simulation"]["backend"] == "inprocess"
    assert raw["server"]["rounds"] == 15  # the shipped dict is left as it was


def test_drift_flags_a_moved_status_or_accuracy_beyond_the_tolerance(bench):
    ref = [{"scenario": "a", "fleet": "", "strategy": "full", "status": "completed", "final_accuracy": 0.875},
           {"scenario": "c", "fleet": "gpu", "strategy": "full", "status": "completed", "final_accuracy": 0.9}]  # fmt: skip
    rows = [
        {**ref[0], "final_accuracy": 0.816},  # deadline_elastic's reported move: 0.059
        {**ref[1], "final_accuracy": 0.885, "status": "2 of 3 completed"},  # within 0.02; the status moved
        {**ref[1], "scenario": "new"},
    ]
    assert bench.drift(rows, ref, 0.02) == [
        "a / full: final accuracy 0.816 (recorded: 0.875, tolerance ±0.02)",
        "c / gpu / full: status 2 of 3 completed (recorded: completed)",
        "new / gpu / full: no recorded row",
    ]
    assert bench.drift(ref, ref, 0.0) == []
    nan = {**ref[0], "final_accuracy": float("nan")}
    assert bench.drift([nan], [nan], 0.02) == [] and len(bench.drift([nan], ref, 0.02)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_scenario_trains_soundly_at_reduced_size(bench, path, tmp_path):
    """...and has not drifted: its status and final accuracy (a comparison: per fleet and strategy) are
    those recorded in benchmarks/results/scenarios_reduced.json, within ``bench.TOLERANCE``."""
    raw = bench.reduced(read_toml(path, "scenario"))
    raw.pop("source", None)
    rows = (bench.run_compare if "compare" in raw else bench.run_single)(path, raw, tmp_path)
    lines = path.read_text().splitlines()
    header = "\n".join(lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])
    runs = [f.parent for f in tmp_path.rglob("status.json")]
    assert runs, "no run folder was written"
    for run in runs:
        status = json.loads((run / "status.json").read_text())["status"]
        assert status in ("completed", "completed_with_errors"), f"{run}: status {status}"
        clients = pd.read_parquet(run / "clients.parquet")
        bad = clients[clients.status.isin(["rejected", "failed"])]
        assert bad.empty, f"{run}: {len(bad)} client results {sorted(set(bad.status))}: {bad.iloc[0].to_dict()}"
        nothing = idle.by_device(clients)  # a device type idle throughout is the scenario's point, said in its header
        unsaid = [d for d in idle.flagged(nothing) if nothing.share[d] == 1 and d not in header]
        assert not unsaid, f"{run}: trained nothing throughout, not said in {path.name}'s header: {idle.lines(nothing)}"
        trained = clients[clients.steps > 0]
        losses = trained.train_loss.astype(float).tolist()
        assert losses and all(math.isfinite(v) for v in losses), f"{run}: non-finite train losses"
    recorded = json.loads((ROOT / "benchmarks" / "results" / "scenarios_reduced.json").read_text())["rows"]
    drifted = bench.drift(rows, recorded, bench.TOLERANCE)
    assert not drifted, f"{drifted}: if on purpose, rerun `python benchmarks/scenarios.py --reduced` and commit it"
