"""Nothing fails silently (clients that trained nothing, shadowed profiles, implausible fits)."""

from __future__ import annotations

import logging
import shutil
import warnings

import pandas as pd
import pytest

from fedelastic.devices.profile import LayerTiming, MeasuredTable, builtin_profile_dir, get_profile, profile_paths
from fedelastic.fl.runner import run_scenario
from fedelastic.models import build_model
from fedelastic.profiling.commands import _origin
from fedelastic.profiling.measure import measure_copy_bandwidth
from fedelastic.profiling.roofline_fit import _roofline_device, fit_roofline, layer_roofline
from tests.support import small_info


def test_clients_that_train_nothing_are_counted_apart_and_warned_once(make_scenario, caplog):
    # rho 0.05 is below every device's forward share: with infeasible = "skip" all 4 clients fit and run 0 steps
    sc = make_scenario(train={"strategy": "elastic_tensor", "options": {"rho": 0.05}, "max_steps": 2})
    rows = []
    with caplog.at_level(logging.WARNING, logger="flwr"):
        run_dir = run_scenario(sc, progress=rows.append)
    rounds = pd.read_csv(run_dir / "rounds.csv")
    assert rounds.clients_no_steps.tolist() == [0, 4, 4]
    assert rounds.clients_failed.sum() == 0 and rounds.clients_not_fitting.sum() == 0
    assert [r["clients_no_steps"] for r in rows] == [0, 4, 4]  # the progress callback sees it
    warned = [r.getMessage() for r in caplog.records if "trained nothing" in r.getMessage()]
    clients = pd.read_csv(run_dir / "clients.csv")
    first = clients[(clients["round"] == 1)].sort_values("partition_id").iloc[0]
    assert (clients.steps == 0).all() and clients.fits.all()
    assert len(warned) == 1 and "rho" in warned[0] and f"partition 0 on {first.device}:" in warned[0], warned
    import json

    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "completed_with_errors" and status["empty_rounds"] == [1, 2]


def test_summary_counts_client_rounds_and_says_energy_excludes_idle(make_scenario, capsys):
    from fedelastic.cli import report

    run_dir = run_scenario(make_scenario())
    capsys.readouterr()
    report(run_dir)
    out = capsys.readouterr().out
    assert "client-rounds" in out and "no idle" in out and "trained nothing" in out
    line = next(x for x in out.splitlines() if "raspberry_pi_4" in x)
    assert line.split("│")[2].strip() == "4"  # 2 devices x 2 rounds


def test_the_runner_leaves_the_flwr_logger_level_as_it_was(make_scenario):
    logger = logging.getLogger("flwr")
    before = logger.level
    try:
        logger.setLevel(logging.DEBUG)
        run_scenario(make_scenario(server={"rounds": 1}))
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)


def test_a_user_profile_shadowing_a_builtin_is_reported_once(tmp_path):
    shutil.copy(builtin_profile_dir() / "jetson_nano.toml", tmp_path / "jetson_nano.toml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            paths = profile_paths((tmp_path,))
    assert paths["jetson_nano"] == tmp_path / "jetson_nano.toml"
    shadow = [w for w in caught if "jetson_nano" in str(w.message)]
    assert len(shadow) == 1 and str(builtin_profile_dir()) in str(shadow[0].message)


def _synthetic_table(info, truth):
    rows = layer_roofline(info, _roofline_device(get_profile("raspberry_pi_4"), *truth), 16)
    return MeasuredTable(
        model="small_cnn", batch_size=16, source="synthetic",
        layers={layer.name: LayerTiming(*row) for layer, row in zip(info.layers, rows)},
        step_s=0.0, forward_s=0.0, backward_s=0.0, other_s=0.0, unattributed_fwd_s=0.0, unattributed_bwd_s=0.0,
    )  # fmt: skip


def test_fitted_bandwidth_is_bounded_by_a_physical_limit_and_the_bound_is_reported():
    info = small_info(width=16)
    table = _synthetic_table(info, (40e9, 8e9, 15e-6))  # generated with 8 GB/s
    start = _roofline_device(get_profile("raspberry_pi_4"), 5e9, 1e9, 100e-6)
    free = fit_roofline([(info, table)], start)
    assert free.warnings == () and free.mem_bandwidth == pytest.approx(8e9, rel=0.05)
    capped = fit_roofline([(info, table)], start, max_bandwidth=2e9)  # a copy bandwidth of 2 GB/s
    assert capped.mem_bandwidth <= 2e9 * (1 + 1e-9)
    assert any("mem_bandwidth stopped at its upper bound" in w for w in capped.warnings), capped.warnings


def test_copy_bandwidth_counts_bytes_read_and_written_and_keeps_the_best_size(monkeypatch):
    import fedelastic.profiling.measure as measure

    times = iter([1e-3, 2e-3])  # 1 MiB copied in 1 ms, 8 MiB in 2 ms (a stand-in clock: no timing in tests)
    monkeypatch.setattr(measure, "_median_time", lambda fn, repeats, warmup, clock: (fn(), next(times))[1])
    bw, text = measure_copy_bandwidth(sizes_mib=(1, 8), repeats=3, warmup=0)
    assert bw == pytest.approx(2 * 8 * 2**20 / 2e-3)  # by hand: read + write of 8 MiB over 2 ms = 8.39 GB/s
    assert "at 8 MiB" in text and "Tensor.copy_" in text


def test_fit_source_keeps_whole_dates():
    src = "tx2_small_cnn_trace.json, imported by fedelastic profile import-trace on 2026-11-23"
    assert _origin(src) == "tx2_small_cnn_trace.json"
    long = "a very long measurement description " * 4 + "on 2026-11-23"
    short = _origin(long)
    assert short.endswith(" ...") and len(short) <= 84 and "2026-11-2" not in short


def test_model_factory_from_a_file_path(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(
        "from torch import nn\n\ndef net(num_classes, in_channels, input_size):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size**2, num_classes))\n"
    )
    scenario = tmp_path / "s.toml"
    scenario.write_text("")
    monkeypatch.chdir("/")  # relative to the scenario file's folder, not the current directory
    model = build_model("mine.py:net", context=str(scenario), num_classes=3, in_channels=1, input_size=4)
    assert model[1].weight.shape == (3, 16)


def test_accuracy_axis_starts_at_zero_and_names_the_range(tmp_path, monkeypatch):
    import matplotlib.figure

    from fedelastic.results.recorder import plot_accuracy

    seen = {}
    real = matplotlib.figure.Figure.savefig

    def spy(fig, path, **kw):
        seen["ylim"], seen["title"] = fig.axes[0].get_ylim(), fig.axes[0].get_title()
        return real(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    rounds = pd.DataFrame({"round": [0, 1, 2], "sim_time_s": [0.0, 1.0, 2.0], "test_accuracy": [0.1003, 0.1030, 0.1010]})
    plot_accuracy(rounds, pd.DataFrame(), tmp_path / "a.png")
    assert seen["ylim"][0] == 0.0 and seen["ylim"][1] >= 1.0
    assert "0.1003 to 0.1030" in seen["title"]


def test_cli_strategies_name_and_models(capsys, monkeypatch):
    from fedelastic.cli import main

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["strategies", "elastic_tensor"]) == 0
    out = capsys.readouterr().out
    for option in ("rho", "solver", "resolution", "infeasible", "interval", "interval_unit"):
        assert f"│ {option} " in out, out
    assert "must exceed" in out  # rho's help text
    main(["models"])
    out = capsys.readouterr().out
    for name in ("small_cnn", "mcu_net", "resnet_small", "resnet50", "mobilenetv2", "vit_b16", "vit_tiny"):
        assert f"{name}:" in out
    assert "patch_size" in out and "width" in out
    assert main(["strategies", "no_such"]) == 2
    assert capsys.readouterr().err.count("error: ") == 1


@pytest.mark.ray
def test_plugins_registered_in_the_driver_reach_the_ray_workers(make_scenario):
    # a strategy registered here (a class local to this test: Ray must ship it by
    # value) and a model name added here exist only in this process; Ray's workers must know both
    import json

    from fedelastic import register_strategy
    from fedelastic.models import BUILTIN
    from fedelastic.selection.strategy import REGISTRY
    from strategies.last_layer import LastLayer

    class MyLastLayer(LastLayer):
        name = "my_last_layer"

    register_strategy(MyLastLayer)
    BUILTIN["my_cnn"] = "fedelastic.models.small:small_cnn"
    try:
        sc = make_scenario(
            model={"name": "my_cnn", "options": {"width": 8}},
            train={"strategy": "my_last_layer", "max_steps": 2}, server={"rounds": 1},
            simulation={"backend": "ray", "num_cpus_per_client": 1},
        )  # fmt: skip
        run_dir = run_scenario(sc)
        clients = pd.read_csv(run_dir / "clients.csv")
        assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
        assert len(clients) == 4 and clients.error.isna().all()  # an empty error column reads back as NaN
        assert clients.fits.any() and (clients[clients.fits].steps == 2).all()
        assert set(clients.strategy) == {"my_last_layer"}
        local = run_scenario(replace_backend(sc))  # the same run in-process: identical updates
        assert pd.read_csv(local / "rounds.csv").test_accuracy.tolist() == pd.read_csv(run_dir / "rounds.csv").test_accuracy.tolist()
    finally:
        REGISTRY.pop("my_last_layer", None)
        BUILTIN.pop("my_cnn", None)


def replace_backend(sc):
    from dataclasses import replace

    return replace(sc, simulation=replace(sc.simulation, backend="inprocess"))


def test_cli_run_takes_toml_typed_key_value_overrides(tmp_path, capsys):
    import tomllib

    from fedelastic.cli import main
    from tests.support import scenario_file

    path = scenario_file(tmp_path)
    code = main(["run", str(path), "server.rounds=1", "train.lr=1e-3", "--run-id", "ov"])
    assert code == 0, capsys.readouterr()
    run_dir = next((tmp_path / "runs").glob("*/ov"))
    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["train"]["lr"] == 0.001 and isinstance(config["train"]["lr"], float)  # not the string '1e-3'
    assert pd.read_csv(run_dir / "rounds.csv")["round"].tolist() == [0, 1]
    capsys.readouterr()
    for bad, key in (("server.rounds=-1", "server.rounds"), ("rounds", "rounds"), ("train.lr=fast", "train.lr")):
        assert main(["run", str(path), bad]) == 2
        err = capsys.readouterr().err
        assert err.count("error: ") == 1 and key in err, err
