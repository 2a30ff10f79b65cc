"""profile measure / import-trace: valid profiles, sane fits, measured tables the cost model uses."""

from __future__ import annotations

import json
import shutil
import tomllib

import numpy as np
import pytest
import torch

from fedelastic.cli import main
from fedelastic.cost.costmodel import CostModel
from fedelastic.devices.profile import LayerTiming, MeasuredTable, builtin_profile_dir, get_profile, load_profile
from fedelastic.models.small import small_cnn
from fedelastic.profiling.measure import measure_layers
from fedelastic.profiling.roofline_fit import _roofline_device, fit_roofline, layer_roofline
from fedelastic.profiling.writer import dumps_profile
from tests.support import small_info


def test_measure_cli_writes_a_valid_profile_the_cost_model_uses(tmp_path):
    out = tmp_path / "tiny_host.toml"
    argv = ["profile", "measure", "--model", "small_cnn", "--out", str(out), "--batch-size", "4"]
    argv += ["--repeats", "2", "--warmup", "1", "--threads", "1", "--option", "width=4", "--no-kernel-samples"]
    assert main(argv) == 0
    profile = load_profile(out)  # validates schema v2
    assert profile.sampled == {}  # --no-kernel-samples: today's fitted classes only
    assert profile.name == "tiny_host" and profile.train_dtype == "fp32"
    # the kernel classes are fitted too: the ones small_cnn has kernels of, and a one-model band
    assert {"gemm_fwd", "gemm_dx", "gemm_dw"} <= set(profile.kernels)
    assert all(0 < k.efficiency.value <= 1 and k.bandwidth.value > 0 for k in profile.kernels.values())
    assert profile.uncertainty is not None and "one model" in profile.uncertainty.source
    assert profile.uncertainty.value == 0.19  # the stated single-model rule, not the in-sample residual
    info = small_info()
    table = profile.measured["small_cnn"]
    assert table.batch_size == 4 and table.shape == info.shape()  # measured on width 4: recorded, and matched below
    assert list(table.layers) == [layer.name for layer in info.layers]
    assert all(min(t.fwd_s, t.dx_s, t.dw_s) >= 0 for t in table.layers.values())
    assert sum(t.fwd_s for t in table.layers.values()) > 0
    # the fit is sane: a share of the measured peak, a positive bandwidth and launch overhead
    assert 0 < profile.efficiency.value <= 1
    assert 1e6 < profile.mem_bandwidth_bytes_per_s.value < 1e13
    assert 0 < profile.launch_overhead_s.value < 0.1
    assert profile.peak_flops.value > 1e8
    for q in (profile.peak_flops, profile.efficiency, profile.memory_train_bytes):
        assert "fedelastic profile measure on" in q.source and "1 threads" in q.source
    assert profile.peak_flops.source.startswith("measured:")
    rate = profile.scalar_ops_per_s  # the selector's counted operations per second, timed on the exact DP
    assert rate is not None and rate.source.startswith("measured: the exact selector DP") and 1e6 < rate.value < 1e11
    assert profile.efficiency.source.startswith("fitted:")
    for q in (profile.power_train_w, profile.power_idle_w, profile.uplink_bit_per_s, profile.latency_s):
        assert "unverified" in q.source
    cost = CostModel(info, profile, batch_size=8)
    assert cost.measured is table
    first = info.layers[1]
    assert cost.t_fwd[first.tensors[0]] == pytest.approx(2 * table.layers[first.name].fwd_s)


def test_a_repeated_model_keeps_every_table_and_fits_them_together(tmp_path):
    out = tmp_path / "two.toml"
    argv = ["profile", "measure", "--model", "small_cnn", "--model", "mcu_net", "--out", str(out), "--batch-size", "2"]
    argv += ["--repeats", "1", "--warmup", "1", "--threads", "1", "--option", "width=4", "--input-size", "8"]
    assert main([*argv, "--no-kernel-samples"]) == 0
    profile = load_profile(out)
    assert set(profile.measured) == {"small_cnn", "mcu_net"}  # not only the last one
    assert "small_cnn, mcu_net" in profile.efficiency.source  # one roofline fitted to both
    assert "leave-one-model-out" in profile.uncertainty.source  # two models: a held-out band
    assert main([*argv[:5], "--model", "small_cnn", "--out", str(out), "--no-kernel-samples"]) == 2  # twice: refused


def test_measure_cli_rejects_a_name_that_is_not_the_file_stem(tmp_path):
    argv = ["profile", "measure", "--model", "small_cnn", "--out", str(tmp_path / "a.toml"), "--name", "b"]
    assert main(argv) == 2
    assert not (tmp_path / "a.toml").exists()


def test_measure_layers_keys_and_totals():
    torch.manual_seed(0)
    model = small_cnn(width=4)
    table = measure_layers(model, torch.randn(4, 1, 8, 8), model_name="small_cnn", repeats=2, warmup=1)
    assert list(table.layers) == [layer.name for layer in small_info().layers]
    assert table.step_s >= table.forward_s > 0 and table.backward_s > 0
    assert all(p.requires_grad for p in model.parameters()) and model.training


@pytest.mark.parametrize("objective", ["time", "log", "rel"])
def test_fit_recovers_known_roofline_parameters(objective):
    info = small_info(width=16)
    base = get_profile("raspberry_pi_4")
    truth = (40e9, 8e9, 15e-6)
    rows = layer_roofline(info, _roofline_device(base, *truth), 16)
    table = MeasuredTable(
        model="small_cnn",
        batch_size=16,
        source="synthetic",
        layers={layer.name: LayerTiming(*row) for layer, row in zip(info.layers, rows)},
        step_s=0.0,
        forward_s=0.0,
        backward_s=0.0,
        other_s=0.0,
        unattributed_fwd_s=0.0,
        unattributed_bwd_s=0.0,
    )
    start = _roofline_device(base, 5e9, 50e9, 100e-6)
    fit = fit_roofline([(info, table)], start, objective=objective)
    assert fit.peak_eff == pytest.approx(truth[0], rel=0.05)
    assert fit.mem_bandwidth == pytest.approx(truth[1], rel=0.05)
    assert fit.launch_overhead == pytest.approx(truth[2], rel=0.05)
    assert fit.median_rel_err < 0.01 and fit.models == ("small_cnn",)
    bounded = fit_roofline([(info, table)], start, max_peak_eff=20e9, objective=objective)
    assert bounded.peak_eff <= 20e9 * (1 + 1e-9)
    assert bounded.efficiency(20e9) <= 1


def _torch_trace(path, layers, per_step):
    """A fedelastic-style torch.profiler trace: 2 steps, per layer fwd/dx/dw regions (µs)."""
    events, ts = [], 0.0
    for _ in range(2):
        start = ts
        for phase in ("fwd", "dx", "dw"):
            for name in layers if phase == "fwd" else reversed(layers):
                dur = per_step[name][phase]
                events.append(
                    {"ph": "X", "name": f"fedelastic::{name}::{phase}", "ts": ts, "dur": dur, "cat": "user_annotation"}
                )
                ts += dur + 1.0
        events.append({"ph": "X", "name": "fedelastic::step", "ts": start, "dur": ts - start, "cat": "user_annotation"})
        ts += 10.0
    path.write_text(json.dumps({"traceEvents": events}))


def test_import_trace_cli_writes_a_valid_measured_table(tmp_path, capsys):
    info = small_info()
    layers = [layer.name for layer in info.layers]
    per_step = {n: {"fwd": 100.0 + i, "dx": 200.0 + i, "dw": 300.0 + i} for i, n in enumerate(layers)}
    trace = tmp_path / "small.trace.json"
    _torch_trace(trace, layers, per_step)
    profile = tmp_path / "jetson_nano.toml"
    shutil.copy(builtin_profile_dir() / "jetson_nano.toml", profile)
    before = tomllib.loads(profile.read_text())

    # without --profile: the TOML table is printed
    assert main(["profile", "import-trace", str(trace), "--model", "small_cnn"]) == 0
    printed = tomllib.loads(capsys.readouterr().out)
    assert printed["measured"]["small_cnn"]["layers"][layers[0]] == {"fwd": 100e-6, "dx": 200e-6, "dw": 300e-6}

    argv = ["profile", "import-trace", str(trace), "--model", "small_cnn", "--batch-size", "4"]
    assert main([*argv, "--profile", str(profile)]) == 0
    loaded = load_profile(profile)
    table = loaded.measured["small_cnn"]
    assert table.batch_size == 4 and list(table.layers) == layers
    assert table.layers[layers[2]].dw_s == pytest.approx(302e-6)
    # the shape it records: the registry model as the command describes it (the factory's defaults here)
    from fedelastic.models import describe_model

    assert table.shape == describe_model("small_cnn").shape() and set(table.shape) == {"input", "classes", "params", "macs"}
    after = tomllib.loads(profile.read_text())
    assert {k: v for k, v in after.items() if k != "measured"} == before  # everything else kept
    # importing again replaces the table; --fit refits the roofline to it and says so
    assert main([*argv, "--profile", str(profile), "--fit"]) == 0
    refit = load_profile(profile)
    assert list(refit.measured) == ["small_cnn"]
    assert "fitted" in refit.efficiency.source and "small_cnn" in refit.launch_overhead_s.source
    assert 0 < refit.efficiency.value <= 1 and refit.launch_overhead_s.value > 0
    assert refit.peak_flops == loaded.peak_flops  # the datasheet peak is kept
    assert "was 25.6 GB/s" in refit.mem_bandwidth_bytes_per_s.source
    assert main([*argv, "--profile", str(profile), "--fit"]) == 0  # a refit still knows the datasheet bandwidth
    again = load_profile(profile).mem_bandwidth_bytes_per_s
    assert again.source.count("; was ") == 1 and again.value <= 25.6e9


def test_import_trace_cli_reports_a_bad_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": []}))
    assert main(["profile", "import-trace", str(bad), "--model", "resnet50"]) == 2


@pytest.mark.parametrize("name", sorted(p.stem for p in builtin_profile_dir().glob("*.toml")))
def test_dumps_profile_round_trips_the_shipped_profiles(name):
    raw = tomllib.loads((builtin_profile_dir() / f"{name}.toml").read_text())
    assert tomllib.loads(dumps_profile(raw)) == raw


def test_tx2_profile_has_measured_tables_for_the_registry_models():
    tx2 = get_profile("jetson_tx2")
    assert set(tx2.measured) >= {"resnet50", "mobilenetv2", "vit_b16"}
    assert all(t.batch_size == 4 for t in tx2.measured.values())
    assert "fitted" in tx2.efficiency.source and "fitted" in tx2.launch_overhead_s.source
    assert np.isclose(tx2.peak_flops.value, 573.4e9)
