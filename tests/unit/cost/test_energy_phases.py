"""Energy by phase: a selection's compute-bound share, priced by hand on a two-layer toy.

The toy is two bias-free linear layers on a v1 profile (one roofline class: P = 3 GFLOP/s x 0.5,
B = 1 GB/s, 1 us launch). Layer 0 (32 -> 32) does 2.67 FLOP per byte: its kernels are compute-bound;
layer 1 (32 -> 2) does 0.76: memory-bound. Batch 8, fp32, plain SGD (the update streams 12 bytes
per element). Every figure below is worked out from those numbers, not read from the code.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedelastic.cost.costmodel import PHASES, CostModel
from fedelastic.data.arrays import ArrayDataset
from fedelastic.devices.profile import Quantity, get_profile
from fedelastic.modelinfo import describe
from fedelastic.selection.strategy import make_strategy
from fedelastic.sim.clock import Trip
from fedelastic.sim.engine import trip_energy_j
from fedelastic.train.trainer import LocalTraining, train_local
from fedelastic.train.vectorized import train_cohort_vmap

P, B, L = 1.5e9, 1e9, 1e-6
C0 = 2 * 8 * 32 * 32 / P  # layer 0's forward, dX or dW: 16,384 FLOP at P (its 6,144 bytes take less)
M1 = (8 * 32 + 8 * 2 + 64) * 4 / B  # layer 1's forward, dX or dW: 1,344 bytes at B (its 1,024 FLOP take less)
OPT0, OPT1 = 1024 * 12 / B, 64 * 12 / B  # SGD's update of each weight
PC, PM, PT = 10.0, 4.0, 7.0  # W: power.compute, power.memory, power.train

# (compute-bound, rest) seconds per phase (forward, dX, dW, optimizer), by hand
FULL = [
    (C0, L + M1 + L),  # both forwards; the launches are never compute
    (0.0, M1 + L),  # dX of layer 1 only (autograd computes none below the deepest trained tensor)
    (C0, L + M1 + L),  # dW of both
    (0.0, OPT0 + OPT1 + L),  # the update and its one fused launch
]
LAST = [(C0, L + M1 + L), (0.0, 0.0), (0.0, M1 + L), (0.0, OPT1 + L)]
COMPUTE_FULL, COMPUTE_LAST = 2 * C0, C0
STEP_FULL = COMPUTE_FULL + sum(r for _, r in FULL)
STEP_LAST = COMPUTE_LAST + sum(r for _, r in LAST)


def toy(phases: bool = True):
    model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 2, bias=False))
    info = describe(model, torch.zeros(1, 32), model_name="toy")
    powers = {"power_compute_w": Quantity(PC, "t"), "power_memory_w": Quantity(PM, "t")} if phases else {}
    device = dataclasses.replace(
        get_profile("jetson_nano"),
        train_dtype="fp32",
        peak_flops=Quantity(3e9, "t"),
        efficiency=Quantity(0.5, "t"),
        mem_bandwidth_bytes_per_s=Quantity(B, "t"),
        launch_overhead_s=Quantity(L, "t"),
        power_train_w=Quantity(PT, "t"),
        kernels={},
        measured={},
        sampled={},
        **powers,
    )
    return model, info, CostModel(info, device, 8, optimizer="sgd")


def test_the_phase_table_of_full_and_last_layer_selections_by_hand():
    _, _, cost = toy()
    assert PHASES == ("forward", "dX", "dW", "optimizer")
    assert cost.roofline_phases_s() == pytest.approx(np.array(FULL), rel=1e-12, abs=1e-18)
    assert cost.roofline_phases_s(np.array([0.0, 1.0])) == pytest.approx(np.array(LAST), rel=1e-12, abs=1e-18)
    # on a v1 profile with no measured table the step is the roofline: the table sums to it
    assert cost.step_time_s(np.ones(2)) == pytest.approx(STEP_FULL, rel=1e-12)
    assert cost.step_time_s(np.array([0.0, 1.0])) == pytest.approx(STEP_LAST, rel=1e-12)


def test_energy_of_a_step_is_power_compute_and_power_memory_over_their_kernels():
    _, _, cost = toy()
    for ratios, compute in ((np.ones(2), COMPUTE_FULL), (np.array([0.0, 1.0]), COMPUTE_LAST)):
        step = cost.step_time_s(ratios)
        hand = PC * compute + PM * (step - compute)
        assert cost.compute_time_s(ratios, step) == pytest.approx(compute, rel=1e-12)
        assert cost.energy_j(step, 0.0, 0.0, compute_s=cost.compute_time_s(ratios, step)) == pytest.approx(hand, rel=1e-12)
        assert cost.train_power_w(ratios) * step == pytest.approx(hand, rel=1e-12)
    e_full = PC * COMPUTE_FULL + PM * (STEP_FULL - COMPUTE_FULL)
    e_last = PC * COMPUTE_LAST + PM * (STEP_LAST - COMPUTE_LAST)
    # the last layer's step is compute-heavier (its forward is most of it): energy falls less than
    # time (0.447 against 0.409)
    assert e_last / e_full > 1.05 * STEP_LAST / STEP_FULL
    # no compute_s: the full step's mix, as before (benchmarks pricing full steps call it so)
    assert cost.energy_j(2.0, 0.0, 0.0) == pytest.approx(2.0 * (PC * COMPUTE_FULL + PM * (STEP_FULL - COMPUTE_FULL)) / STEP_FULL)


def test_the_share_applies_to_whatever_step_time_is_priced():
    # a measured table changes the step's time, not which kernels are compute-bound: energy = time x mix
    _, _, cost = toy()
    share = COMPUTE_LAST / STEP_LAST
    assert cost.compute_time_s(np.array([0.0, 1.0]), 3.0) == pytest.approx(3.0 * share, rel=1e-12)


def test_without_phase_powers_training_is_power_train_times_time():
    _, _, cost = toy(phases=False)
    for ratios in (np.ones(2), np.array([0.0, 1.0])):
        step = cost.step_time_s(ratios)
        assert cost.compute_time_s(ratios, step) == 0.0
        assert cost.train_power_w(ratios) == PT
        assert cost.energy_j(step, 0.0, 0.0, compute_s=0.0) == PT * step  # bit for bit, as before
        assert cost.energy_j(step, 0.0, 0.0) == PT * step


@pytest.mark.parametrize("strategy, compute", [("full", COMPUTE_FULL), ("last_layer", COMPUTE_LAST)])
def test_local_training_reports_its_steps_compute_bound_seconds(strategy, compute):
    torch.manual_seed(0)
    model, info, cost = toy()
    rng = np.random.default_rng(0)
    data = ArrayDataset(rng.standard_normal((24, 32)).astype(np.float32), rng.integers(0, 2, 24))
    loop = train_local(model, info, make_strategy(strategy, {}), cost, data, LocalTraining(1, 8, 0.01))
    (cohort,) = train_cohort_vmap(
        model, info, [make_strategy(strategy, {})], [cost], [data], seeds=[0], epochs=1, batch_size=8, lr=0.01
    )
    for result in (loop, cohort):  # the per-client loop and the vectorised cohort
        assert result.steps == 3 and result.overhead_time_s == 0.0
        assert result.compute_time_s == pytest.approx(3 * compute, rel=1e-12)


def test_the_engine_prices_a_cut_trip_pro_rata():
    _, _, cost = toy()
    metrics = {"emulated-bytes-down": 0.0, "emulated-bytes-up": 0.0, "emulated-macs": 0.0,
               "emulated-compute-time-s": 3 * COMPUTE_LAST}  # fmt: skip
    trip = Trip(0, 0.0, 0.0, 3 * STEP_LAST, 0.0, offline_s=math.inf, version=0, carries_update=True)
    whole = PC * 3 * COMPUTE_LAST + PM * 3 * (STEP_LAST - COMPUTE_LAST)
    assert trip_energy_j(cost, trip, math.inf, metrics) == pytest.approx(whole, rel=1e-12)
    assert trip_energy_j(cost, trip, 1.5 * STEP_LAST, metrics) == pytest.approx(whole / 2, rel=1e-12)
