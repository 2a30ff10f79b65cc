"""Sampled kernel predictors: forms chosen on held-out configurations, layers priced as a measured table."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from torch import nn

from fedelastic.cost.costmodel import CostModel
from fedelastic.devices.kernelsample import (
    CLASSES,
    Predictor,
    calibrated,
    fit_calibration,
    fit_predictor,
    fit_predictors,
    layer_kernel,
    load_samples,
    optimizer_seconds,
    parse_sampled,
    predicted_layers,
    predictors_toml,
    sample_kernels,
    samples_json,
)
from fedelastic.devices.profile import LayerTiming, MeasuredTable, get_profile, parse_profile
from fedelastic.errors import ConfigError
from fedelastic.modelinfo import describe
from fedelastic.profiling.measure import _state_copy
from tests.support import small_info


def _const(cls: str, *seconds: float) -> dict[str, Predictor]:
    """Affine predictors of ``cls`` that return a constant per phase."""
    n = CLASSES[cls][2]
    return {ph: Predictor("affine", (s,) + (0.0,) * n, 0.0, 3) for ph, s in zip(CLASSES[cls][0], seconds)}


# every class a constant, distinct per phase, so that the composition can be added up by hand
CONSTANT = {
    "conv": _const("conv", 1e-3, 2e-3, 3e-3),
    "batchnorm": _const("batchnorm", 10e-6, 20e-6, 30e-6),
    "relu": _const("relu", 100e-6, 200e-6),
    "maxpool": _const("maxpool", 1e-6, 2e-6),
    "avgpool": _const("avgpool", 4e-6, 8e-6),
    "linear": _const("linear", 5e-3, 6e-3, 7e-3),
    "optimizer": {"step": Predictor("affine", (50e-6, 2e-6, 1e-9), 0.0, 3)},
}


def test_fit_recovers_an_affine_law_and_picks_the_affine_form():
    rng = np.random.default_rng(1)
    flops, ins, outs = (np.exp(rng.uniform(np.log(1e4), np.log(1e9), 40)) for _ in range(3))
    feats = np.column_stack([flops, ins, outs, np.full(40, 1e3), rng.integers(1, 10, 40)])
    t = 20e-6 + flops / 30e9 + 4 * outs / 5e9  # launch + compute + a memory stream, by hand
    p = fit_predictor("linear", feats, t)
    assert p.form == "affine" and p.cv_error < 0.01
    new = np.array([[3e8, 1e5, 2e5, 1e3, 4]])
    assert p.predict("linear", new)[0] == pytest.approx(20e-6 + 3e8 / 30e9 + 4 * 2e5 / 5e9, rel=1e-3)


def test_fit_recovers_a_power_law_and_picks_the_loglinear_form():
    rng = np.random.default_rng(2)
    n = np.exp(rng.uniform(np.log(1e3), np.log(1e7), 30))
    t = 3e-8 * n**0.7  # sub-linear: no affine law fits it across four decades
    p = fit_predictor("relu", n[:, None], t)
    assert p.form == "loglinear" and p.cv_error < 0.01
    assert p.predict("relu", np.array([[5e5]]))[0] == pytest.approx(3e-8 * 5e5**0.7, rel=1e-3)


def test_fit_recovers_a_two_cache_law_and_picks_the_spill_form():
    # a memory-bound linear layer (batch 8) by hand: 0.5 ns per weight while the weights fit 2^18
    # elements (1 MiB), +1 ns beyond it, +2 ns more beyond 2^22 (16 MiB): no single affine law fits
    rng = np.random.default_rng(3)
    w = np.exp(rng.uniform(np.log(1e3), np.log(3e8), 120))
    feats = np.column_stack([16 * w, np.full(120, 8e3), np.full(120, 8e3), w, np.full(120, 8.0)])
    touched = w + 16e3  # in + out + weights

    def law(touched):
        return (
            30e-6
            + 0.5e-9 * (touched - 16e3)
            + 1e-9 * np.maximum(touched - 2**18, 0)
            + 2e-9 * np.maximum(touched - 2**22, 0)
        )

    p = fit_predictor("linear", feats, law(touched))
    assert p.form == "spill" and p.coef[:2] == (2.0**18, 2.0**22) and p.cv_error < 0.01
    vgg = np.array([[16 * 103e6, 8e3, 8e3, 103e6, 8.0]])  # VGG-11's first classifier layer
    assert p.predict("linear", vgg)[0] == pytest.approx(law(103e6 + 16e3), rel=1e-3)


def test_a_spill_optimizer_shares_its_out_of_cache_term_by_tensor_size():
    # 10 us per tensor, 1 ns per element, +3 ns per element beyond 1,000 elements (by hand)
    p = {"optimizer": {"step": Predictor("spill", (1e3, 1e9, 5e-6, 10e-6, 1e-9, 3e-9, 0.0), 0.0, 3)}}
    per_tensor, once = optimizer_seconds(p, np.array([1000.0, 3000.0]))
    beyond = 3e-9 * (4000 - 1000) / 4000  # per element, over all 4,000 elements
    assert once == 5e-6
    assert per_tensor == pytest.approx([10e-6 + 1000 * (1e-9 + beyond), 10e-6 + 3000 * (1e-9 + beyond)])
    assert per_tensor.sum() + once == pytest.approx(5e-6 + 2 * 10e-6 + 4000e-9 + 3e-9 * 3000)


def test_too_few_configurations_is_an_error_naming_the_class():
    with pytest.raises(ValueError, match="'act'.*2 timed"):
        fit_predictor("act", np.ones((2, 1)), np.ones(2))


def test_convolutions_are_classed_by_their_groups():
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),  # dense
        nn.Conv2d(16, 16, 3, padding=1, groups=16),  # depthwise
        nn.Conv2d(16, 32, 3, stride=2, padding=1, groups=4),  # grouped: not depthwise
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )
    info = describe(model, torch.zeros(1, 3, 8, 8), model_name="m")
    kinds = [layer_kernel(info, i, 2.0) for i in range(len(info.layers))]
    assert [k[0] for k in kinds] == ["conv", "conv_depthwise", "conv_grouped", "linear"]
    # the grouped conv by hand: 32 x 4 x 4 outputs per sample, each 16/4 x 9 MACs, batch 2
    flops, ins, outs, weights, kernel, stride, depth = kinds[2][1]
    assert (flops, ins, outs, weights) == (2 * 2 * 512 * 36, 2 * 16 * 64, 2 * 512, 32 * 36)
    assert (kernel, stride, depth) == (9, 4, 4)
    # the linear layer: 2 rows of 512 inputs
    assert list(kinds[3][1]) == [2 * 2 * 512 * 10, 2 * 512, 2 * 10, 5120, 2]


def test_predicted_layers_charge_the_weightless_ops_to_the_layer_above():
    info = small_info()  # conv bn relu | conv bn relu maxpool | conv bn relu avgpool flatten | linear
    layers, after = predicted_layers(CONSTANT, info, 2)
    conv, bn, relu, pool, avg, lin = 1e-3, 10e-6, 100e-6, 1e-6, 4e-6, 5e-3
    names = [layer.name for layer in info.layers]
    want = {
        names[0]: (conv, 2e-3, 3e-3),
        names[1]: (bn, 20e-6, 30e-6),
        names[2]: (conv + relu, 2e-3 + 200e-6, 3e-3),
        names[3]: (bn, 20e-6, 30e-6),
        names[4]: (conv + relu + pool, 2e-3 + 200e-6 + 2e-6, 3e-3),
        names[5]: (bn, 20e-6, 30e-6),
        names[6]: (lin + relu + avg, 6e-3 + 200e-6 + 8e-6, 7e-3),
    }
    assert layers.keys() == want.keys() and after == 0.0
    for name, row in want.items():
        assert layers[name] == pytest.approx(row)


def test_cost_model_prices_an_unmeasured_model_by_its_samples_and_a_measured_table_still_wins():
    info = small_info()
    base = get_profile("raspberry_pi_4")
    device = dataclasses.replace(base, measured={}, sampled=CONSTANT)
    cost = CostModel(info, device, 2)
    assert cost.predicted
    first = info.layers[2]
    assert cost.t_fwd[first.tensors[0]] == pytest.approx(1e-3 + 100e-6)
    # the optimizer: per tensor 2 us + 1 ns per element, and its 50 us constant once per step
    assert cost.t_opt == pytest.approx(2e-6 + 1e-9 * info.tensor_numel)
    full = np.ones(info.num_tensors)
    with_update = cost.step_time_s(full) - cost.step_time_s(np.r_[np.zeros(info.num_tensors - 1), 1.0])
    assert with_update > 0
    assert cost.time_band_s(1.0) == pytest.approx(base.uncertainty.value if base.uncertainty else 0.0)
    rows = {layer.name: LayerTiming(1e-3, 1e-3, 1e-3) for layer in info.layers}
    table = MeasuredTable(batch_size=2, source="test", layers=rows, shape=info.shape())
    measured = CostModel(info, dataclasses.replace(device, measured={"small_cnn": table}), 2)
    assert not measured.predicted and measured.measured is table


def test_calibration_recovers_a_known_forward_map_and_applies_it_per_layer():
    rng = np.random.default_rng(3)
    pred = np.exp(rng.uniform(np.log(1e-5), np.log(1e-2), (30, 3)))
    meas = pred.copy()
    meas[:, 0] = 1.5 * pred[:, 0] + 30e-6  # in a step, each forward pays 1.5x plus 30 us (by hand)
    cal = fit_calibration(pred, meas)
    assert cal["fwd"] == pytest.approx((1.5, 30e-6), rel=1e-6)
    assert cal["bwd"] == (1.0, 0.0)  # the backward is taken as timed alone (see fit_calibration)
    assert calibrated(cal, 1e-3, 2e-3, 6e-3) == pytest.approx((1.5e-3 + 30e-6, 2e-3, 6e-3))
    layers, _ = predicted_layers({**CONSTANT, "calibration": cal}, small_info(), 2)
    assert layers[small_info().layers[0].name][0] == pytest.approx(1.5 * 1e-3 + 30e-6)


def test_calibration_is_least_squares_in_seconds_so_large_layers_set_it():
    pred = np.array([1e-3, 2e-3, 3e-3, 1e-5])[:, None] * [1, 1, 1]
    meas = pred.copy()
    meas[:, 0] = [2.1e-3, 3.9e-3, 6.0e-3, 1e-4]  # the small layer 10x, the large ones ~2x
    # the ordinary least-squares line through the four points: by the normal equations
    x, y = pred[:, 0], meas[:, 0]
    scale = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    assert fit_calibration(pred, meas)["fwd"] == pytest.approx((scale, y.mean() - scale * x.mean()), rel=1e-6)
    assert 1.9 < scale < 2.0  # the large layers' slope, not pulled towards the small layer's 10x
    # rows weighted (as calibrate weights each model by 1 / its forward): the weighted normal equations
    w = np.array([1.0, 1.0, 1.0, 30.0])
    xm, ym = (w**2 * x).sum() / (w**2).sum(), (w**2 * y).sum() / (w**2).sum()
    scale_w = (w**2 * (x - xm) * (y - ym)).sum() / (w**2 * (x - xm) ** 2).sum()
    fwd = fit_calibration(pred, meas, w)["fwd"]
    assert fwd == pytest.approx((scale_w, ym - scale_w * xm), rel=1e-6)


def test_sampled_section_round_trips_and_bad_coefficients_name_the_file_and_key():
    raw = predictors_toml({**CONSTANT, "calibration": {"fwd": (1.5, 3e-5), "bwd": (1.0, 0.0)}}, "test")
    back = parse_sampled("p.toml", raw)
    assert back["conv"]["dx"].coef == CONSTANT["conv"]["dx"].coef
    assert back["calibration"] == {"fwd": (1.5, 3e-5), "bwd": (1.0, 0.0)}
    raw["conv"]["fwd"]["coef"] = [1.0, 2.0]
    with pytest.raises(ConfigError, match=r"p\.toml.*sampled\.conv\.fwd\.coef.*5 finite numbers"):
        parse_sampled("p.toml", raw)
    raw["conv"]["fwd"] = {"form": "spill", "coef": [1.0] * 5}  # spill: two knees, constant, 4 sizes, two terms
    with pytest.raises(ConfigError, match=r"sampled\.conv\.fwd\.coef.*9 finite numbers \(spill"):
        parse_sampled("p.toml", raw)
    raw["conv"]["fwd"]["coef"] = [1.0] * 9
    assert parse_sampled("p.toml", raw)["conv"]["fwd"].form == "spill"
    with pytest.raises(ConfigError, match=r"sampled\.convolution"):
        parse_sampled("p.toml", {"convolution": {}})


def test_a_profile_with_a_sampled_section_validates(tmp_path):
    import tomllib

    from fedelastic.profiling.writer import dumps_profile

    raw = tomllib.loads(open(get_profile("raspberry_pi_4").path).read())
    raw["sampled"] = predictors_toml(CONSTANT, "test")
    text = dumps_profile(raw)
    assert "[sampled.conv]" in text
    assert parse_profile(tomllib.loads(text), "x.toml").sampled["relu"]["dx"].coef[0] == 200e-6


def test_sampling_times_every_phase_and_the_samples_refit(monkeypatch):
    import fedelastic.devices.kernelsample as ks

    torch.set_num_threads(1)
    sizes = iter(range(2, 100))  # small configurations: the drawing itself is not under test
    monkeypatch.setattr(ks, "draw_config", lambda cls, rng, batch: {"b": 2, "c": 4, "size": next(sizes), "kind": 2})
    samples = sample_kernels(0, classes=("relu", "add"), min_per_class=4, repeats=2, clock="cpu")
    assert {c: len(v) for c, v in samples.items()} == {"relu": 4, "add": 4}
    for cls, rows in samples.items():
        for feats, times in rows:
            assert feats.shape == (len(CLASSES[cls][1]),) and set(times) == set(CLASSES[cls][0])
            assert all(t > 0 for t in times.values())
    back = load_samples(samples_json(samples))
    assert fit_predictors(back).keys() == {"relu", "add"}


def test_cold_timing_runs_the_flush_before_every_timed_call():
    import fedelastic.devices.kernelsample as ks

    torch.set_num_threads(1)
    calls: list[str] = []
    buffer = torch.zeros(1024)

    def flush():
        buffer.add_(1.0)  # what a cache flush does: touch a buffer
        calls.append("flush")

    cfg = {"b": 2, "c": 4, "size": 4, "kind": 0}
    ks.time_config("relu", cfg, time.thread_time, repeats=3, warmup=1, flush=flush)
    # relu: forward, forward with gradients, dX: 3 timed calls each, one flush before each
    assert len(calls) == 9 and float(buffer[0]) == 9.0


class _Versioned(nn.Module):
    """Refuses a state dict without its version metadata, as torchvision's MNASNet does."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        if local_metadata.get("version") is None:
            raise ValueError("version should be set to 1 or 2 instead of None")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)


def test_state_copy_keeps_the_module_versions():
    model = _Versioned()
    model.load_state_dict(_state_copy(model))  # the plain dict copy lost them: ValueError
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="version"):
        model.load_state_dict(plain)


def test_calibrate_fits_the_tables_and_leaves_each_model_out_for_its_band():
    from fedelastic.profiling.commands import calibrate

    info = small_info()
    layers, _ = predicted_layers(CONSTANT, info, 2)
    # a table whose every layer pays twice its forward timed alone (by hand), and the same backward
    rows = {n: LayerTiming(2 * f, dx, dw) for n, (f, dx, dw) in layers.items()}
    table = MeasuredTable(batch_size=2, source="test", layers=rows)
    cal, errs = calibrate(CONSTANT, [(info, table), (info, table)], lambda _m: None)
    assert cal["fwd"] == pytest.approx((2.0, 0.0), abs=1e-9) and cal["bwd"] == (1.0, 0.0)
    assert errs == pytest.approx([0.0, 0.0], abs=1e-9)  # each predicted by the other's calibration
    _, alone = calibrate(CONSTANT, [(info, table)], lambda _m: None)
    fwd = sum(f for f, _, _ in layers.values())
    total = sum(map(sum, layers.values()))
    assert alone == pytest.approx([total / (total + fwd) - 1])  # one model: its uncalibrated error


def test_channel_counts_are_drawn_aligned_to_eight_as_networks_use_them():
    from fedelastic.devices.kernelsample import ALIGNED, draw_config

    rng = np.random.default_rng(0)
    convs = [draw_config("conv", rng, 8) for _ in range(2000)]
    cout = np.array([c["cout"] for c in convs])
    # an unaligned draw is a multiple of 8 about 1 time in 8 by chance: P(aligned) = ALIGNED + (1 - ALIGNED) / 8
    assert np.mean(cout % 8 == 0) == pytest.approx(ALIGNED + (1 - ALIGNED) / 8, abs=0.03)
    assert cout.min() >= 8 and cout.max() <= 1024 + 4
    assert 0.02 < np.mean([c["cin"] == 3 for c in convs]) < 0.08  # an image's first layer, 5% of draws
