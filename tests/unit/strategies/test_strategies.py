"""Tests of the individual strategies and of the probes they rely on.

The shared contract (budgets, only-selected-change, backward nodes, configs, determinism) is in
``tests/contract/test_strategy_contract.py``; this file checks what is specific to each method.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import numpy as np
import pytest
import torch
from torch import nn

from fedelastic.cost.costmodel import CostModel
from fedelastic.data import load_digits_dataset
from fedelastic.devices.profile import Quantity, get_profile
from fedelastic.errors import ConfigError
from fedelastic.modelinfo import describe
from fedelastic.models.small import mcu_net, small_cnn
from fedelastic.selection.strategy import Selection, SelectionContext, SelectionStrategy, make_strategy
from fedelastic.strategies.budget import solve, tensor_times
from fedelastic.strategies.tinytrain import layer_scores
from fedelastic.train.trainer import LocalTraining, fisher_probe, importance_probe, ordered_params, train_local

BATCH = 16


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def digits():
    ds = load_digits_dataset()
    return ds.subset(np.random.default_rng(0).permutation(len(ds))[:256])


def batch(n: int = BATCH, offset: int = 0):
    ds = digits()
    return torch.from_numpy(ds.x[offset : offset + n]), torch.from_numpy(ds.y[offset : offset + n])


def build(factory, width: int, device: str, batch_size: int = BATCH, seed: int = 0):
    torch.manual_seed(seed)
    model = factory(width=width)
    info = describe(model, torch.zeros(1, 1, 8, 8), factory.__name__)
    return model, info, CostModel(info, get_profile(device), batch_size)


def recorded(strategy) -> list[Selection]:
    seen: list[Selection] = []
    inner = strategy.select

    def select(ctx):
        seen.append(inner(ctx))
        return seen[-1]

    strategy.select = select
    return seen


def context(model, info, cost, probe: str | None, seed: int = 0) -> SelectionContext:
    model.train()
    x, y = batch()
    ctx = SelectionContext(info, cost, 0, np.random.default_rng(seed))
    if probe == "importance":
        ctx.importance = importance_probe(model, info, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, y)
    elif probe == "fisher":
        ctx.fisher = fisher_probe(model, info, x, y)
    return ctx


# ---- probes --------------------------------------------------------------------------------------
def test_fisher_potential_matches_hand_computation():
    torch.manual_seed(0)
    conv, lin = nn.Conv2d(1, 3, 3, padding=1), nn.Linear(3 * 8 * 8, 10)
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), lin)
    info = describe(model, torch.zeros(1, 1, 8, 8))
    x, y = batch(6)
    n = x.shape[0]

    a1 = conv(x)
    a2 = lin(torch.relu(a1).flatten(1))
    g1, g2 = torch.autograd.grad(nn.functional.cross_entropy(a2, y), [a1, a2])
    a1, a2 = a1.detach(), a2.detach()
    per_sample_conv = (a1 * g1).sum(dim=(2, 3))  # (N, C): inner sum over positions, per sample
    per_sample_lin = a2 * g2  # (N, C): one position per channel
    hand = {0: (per_sample_conv**2).sum(0) / (2 * n), 1: (per_sample_lin**2).sum(0) / (2 * n)}

    fisher = fisher_probe(model, info, x, y)
    assert sorted(fisher) == [0, 1]
    for li in (0, 1):
        np.testing.assert_allclose(fisher[li], hand[li].numpy(), rtol=1e-5, atol=1e-12)
    assert all(p.grad is None for p in model.parameters())

    # summing over the batch before squaring is a different (wrong) number
    batch_first = per_sample_conv.sum(0) ** 2 / (2 * n)
    assert not np.allclose(batch_first.numpy(), fisher[0], rtol=1e-3)


def test_importance_probe_restores_weights_and_momentum_exactly():
    model, info, _ = build(small_cnn, 8, "jetson_nano")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    for offset in (0, BATCH):  # build up momentum
        x, y = batch(offset=offset)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    params = ordered_params(model, info)
    params[0].requires_grad_(False)  # flags must be restored too
    state = copy.deepcopy(model.state_dict())
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in params]

    # the same probe by hand, on copies
    twin = copy.deepcopy(model)
    twin_params = ordered_params(twin, info)
    for p in twin_params:
        p.requires_grad_(True)
    twin_opt = torch.optim.SGD(twin_params, lr=0.1, momentum=0.9, weight_decay=1e-3)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    x, y = batch(offset=2 * BATCH)
    start = [p.detach().clone() for p in twin_params]
    nn.functional.cross_entropy(twin(x), y).backward()
    twin_opt.step()
    delta = [p.detach() - s for p, s in zip(twin_params, start)]
    twin_opt.zero_grad()
    nn.functional.cross_entropy(twin(x), y).backward()
    hand = np.array([-(p.grad * d).sum().item() for p, d in zip(twin_params, delta)])

    importance = importance_probe(model, info, opt, x, y)
    np.testing.assert_allclose(importance, hand, rtol=1e-6, atol=1e-12)
    after = model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state)
    for p, buf in zip(params, momentum):
        assert torch.equal(opt.state[p]["momentum_buffer"], buf)
        assert p.grad is None
    assert not params[0].requires_grad and all(p.requires_grad for p in params[1:])


# ---- elastic_tensor --------------------------------------------------------------------------------
def test_elastic_tensor_reselects_and_dropped_tensors_return():
    model, info, cost = build(small_cnn, 8, "jetson_nano")
    default = make_strategy("elastic_tensor")  # the artifact's interval: 4 epochs
    assert [s for s in range(50) if default.should_reselect(s, steps_per_epoch=5)] == [20, 40]
    strategy = make_strategy("elastic_tensor", {"rho": 0.6, "interval": 2, "interval_unit": "steps"})
    assert [s for s in range(9) if strategy.should_reselect(s, steps_per_epoch=5)] == [2, 4, 6, 8]
    selections = recorded(strategy)
    result = train_local(model, info, strategy, cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=16))
    assert result.fits and result.selections == len(selections) == 8
    masks = np.array([s.mask for s in selections])
    assert len({m.tobytes() for m in masks}) > 1, "the selection never changed"
    returned = [
        k
        for k in range(info.num_tensors)
        if any(
            masks[a, k] and not masks[b, k] and masks[c, k]
            for a in range(len(masks))
            for b in range(a + 1, len(masks))
            for c in range(b + 1, len(masks))
        )
    ]
    assert returned, "no dropped tensor ever came back"
    # the probe (2 forwards, 2 gradient passes over every tensor, one optimizer step) is charged
    # once per selection, plus the selector's work
    ones = np.ones(info.num_tensors)
    probe = 2 * (cost.forward_time_s + cost.backward_time_s(ones) - cost.t_opt.sum()) + cost.t_opt.sum()
    assert result.selector_time_s > 0
    assert result.overhead_time_s == pytest.approx(8 * probe + result.selector_time_s)


def test_elastic_tensor_solvers_respect_budget():
    model, info, cost = build(mcu_net, 8, "jetson_nano")
    ctx = context(model, info, cost, "importance")
    budget = cost.backward_budget_s(0.5)
    value = {}
    for solver in ("exact", "artifact_dp", "greedy"):
        sel = make_strategy("elastic_tensor", {"rho": 0.5, "solver": solver}).select(ctx)
        assert cost.backward_time_s(sel.ratios) <= budget * (1 + 1e-9)
        value[solver] = float(ctx.importance[sel.mask].sum())
    assert value["exact"] >= value["artifact_dp"] - 1e-12
    assert value["exact"] >= value["greedy"] - 1e-12
    assert value["exact"] > 0


def test_elastic_budget_uses_device_times_not_a_fixed_ratio():
    for device in ("jetson_nano", "stm32h743"):
        _, info, cost = build(mcu_net, 8, device)
        full = cost.full_step_time_s()
        assert cost.backward_budget_s(0.5) == pytest.approx(0.5 * full - cost.forward_time_s)
        dw, dx = tensor_times(cost)
        ones = np.ones(info.num_tensors, dtype=bool)
        assert cost.backward_time_s(ones) == pytest.approx(dw.sum() + dx[1:].sum() + cost.t_bwd_fixed)


def test_elastic_tensor_shrinks_to_memory():
    model, info, cost = build(mcu_net, 16, "stm32f746")
    ctx = context(model, info, cost, "importance")
    memory = ctx.memory_budget_bytes
    dw, dx = tensor_times(cost)
    unconstrained = solve(ctx.importance, dw, dx, cost.backward_budget_s(1.0), "exact", 1000)
    assert cost.peak_memory_bytes(unconstrained.astype(float)) > memory  # the premise
    sel = make_strategy("elastic_tensor", {"rho": 1.0}).select(ctx)
    assert sel.mask.any()
    assert cost.peak_memory_bytes(sel.ratios) <= memory
    assert np.flatnonzero(sel.mask)[0] > np.flatnonzero(unconstrained)[0]  # the floor was raised


def test_no_backward_budget_skips_or_errors():
    model, info, cost = build(small_cnn, 8, "stm32h743")
    assert cost.forward_time_s / cost.full_step_time_s() > 0.3  # an MCU's forward share is about 1/3
    ctx = context(model, info, cost, "importance")
    for name in ("elastic_tensor", "elastic_layer", "random_budget", "static_elastic"):
        assert not make_strategy(name, {"rho": 0.3}).select(ctx).mask.any()
        with pytest.raises(ConfigError) as err:
            make_strategy(name, {"rho": 0.3, "infeasible": "error"}).select(ctx)
        assert err.value.key == "train.options.rho" and "forward share" in str(err.value)
    before = copy.deepcopy(model.state_dict())
    result = train_local(model, info, make_strategy("elastic_tensor", {"rho": 0.3}), cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.1, max_steps=4))
    assert result.fits and result.steps == 0
    params = dict(model.named_parameters())
    assert all(torch.equal(before[k], p) for k, p in params.items())


# ---- elastic_layer -------------------------------------------------------------------------------------
def test_elastic_layer_selects_whole_layers_only():
    model, info, cost = build(mcu_net, 8, "jetson_nano")
    strategy = make_strategy("elastic_layer", {"rho": 0.5, "interval": 2, "interval_unit": "steps"})
    selections = recorded(strategy)
    train_local(model, info, strategy, cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=8))
    assert len(selections) == 4
    for sel in selections:
        assert not sel.channels and set(np.unique(sel.ratios)) <= {0.0, 1.0}
        assert sel.mask.any()
        for layer in info.layers:
            picked = sel.mask[list(layer.tensors)]
            assert picked.all() or not picked.any(), layer.name
        assert cost.step_time_s(sel.ratios) <= 0.5 * cost.full_step_time_s() * (1 + 1e-9)


def test_elastic_layer_importance_is_summed_per_layer():
    model, info, cost = build(small_cnn, 8, "jetson_nano")
    ctx = context(model, info, cost, "importance")
    # make one norm layer's tensors individually weak but jointly strong
    imp = np.full(info.num_tensors, -1.0)
    norm = next(layer for layer in info.layers if layer.kind == "norm" and layer is not info.layers[0])
    a, b = norm.tensors
    imp[a], imp[b] = 5.0, -1.0
    ctx.importance = imp
    sel = make_strategy("elastic_layer", {"rho": 1.0}).select(ctx)
    assert sel.mask[a] and sel.mask[b]  # layer importance 4 > 0 takes the negative tensor along
    assert sel.mask.sum() == 2


# ---- static_elastic / random_budget ----------------------------------------------------------------
def test_static_elastic_keeps_its_first_selection():
    model, info, cost = build(small_cnn, 8, "jetson_nano")
    strategy = make_strategy("static_elastic", {"rho": 0.5})
    selections = recorded(strategy)
    kwargs = dict(epochs=1, batch_size=BATCH, lr=0.05, max_steps=12)
    first = train_local(model, info, strategy, cost, digits(), LocalTraining(**kwargs))
    assert first.selections == 1 and first.overhead_time_s > 0
    second = train_local(model, info, strategy, cost, digits(), LocalTraining(**kwargs), seed=1)  # e.g. a later round
    assert second.overhead_time_s == 0  # no probe: the first selection is reused
    assert selections[0] is selections[1]
    elastic = make_strategy("elastic_tensor", {"rho": 0.5})
    model2, _, _ = build(small_cnn, 8, "jetson_nano")
    ctx = context(model2, info, cost, "importance")
    assert np.array_equal(make_strategy("static_elastic", {"rho": 0.5}).select(ctx).ratios, elastic.select(ctx).ratios)


def test_random_budget_is_random_within_budget():
    model, info, cost = build(mcu_net, 8, "jetson_nano")
    masks = []
    for seed in range(4):
        ctx = SelectionContext(info, cost, 0, np.random.default_rng(seed))
        sel = make_strategy("random_budget", {"rho": 0.5}).select(ctx)
        assert sel.mask.any()
        assert cost.step_time_s(sel.ratios) <= 0.5 * cost.full_step_time_s() * (1 + 1e-9)
        masks.append(sel.mask.tobytes())
    assert len(set(masks)) > 1
    result = train_local(model, info, make_strategy("random_budget", {"interval": 2, "interval_unit": "steps"}), cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=6))
    assert result.selections == 3 and result.probe_peak_memory_bytes == 0  # no probe
    assert result.overhead_time_s == result.selector_time_s > 0  # only the selector's work


# ---- tinytrain -------------------------------------------------------------------------------------------
def test_tinytrain_fits_an_mcu_where_full_does_not():
    model, info, cost = build(mcu_net, 16, "stm32f746")
    state = copy.deepcopy(model.state_dict())
    kwargs = dict(epochs=1, batch_size=BATCH, lr=0.05, max_steps=4)
    full = train_local(model, info, make_strategy("full"), cost, digits(), LocalTraining(**kwargs))
    assert not full.fits and cost.peak_memory_bytes(np.ones(info.num_tensors)) > cost.device.memory_train_bytes.value
    model.load_state_dict(state)
    strategy = make_strategy("tinytrain")
    selections = recorded(strategy)
    result = train_local(model, info, strategy, cost, digits(), LocalTraining(**kwargs))
    assert result.fits and result.steps == 4 and result.selections == 1
    sel = selections[0]
    assert sel.channels, "expected a channel-sparse update"
    assert result.peak_memory_bytes <= cost.device.memory_train_bytes.value
    zeros = np.zeros(info.num_tensors)
    macs = cost.step_macs(sel.ratios) - cost.step_macs(zeros)
    assert macs <= 0.3 * (cost.step_macs(np.ones(info.num_tensors)) - cost.step_macs(zeros)) * (1 + 1e-9)
    assert result.channel_masks  # the client reports the partial tensors' channels


def test_tinytrain_scores_and_top_channels():
    model, info, cost = build(mcu_net, 8, "jetson_nano")
    ctx = context(model, info, cost, "fisher")
    scores = layer_scores(ctx, ctx.fisher)
    params = {li: sum(int(info.tensor_numel[k]) for k in info.layers[li].tensors) for li in ctx.fisher}
    macs = {li: info.layers[li].macs for li in ctx.fisher}
    for li, s in scores.items():
        denom = (params[li] / max(params.values())) * (macs[li] / max(macs.values()))
        assert s == pytest.approx(ctx.fisher[li].sum() / denom)
    sel = make_strategy("tinytrain", {"channel_ratios": [0.25, 0.5]}).select(ctx)
    assert sel.mask.any()
    for k in np.flatnonzero(sel.mask):
        li = int(info.tensor_layer[k])
        assert info.tensor_roles[k] in ("weight", "bias")
        assert sel.ratios[k] in (0.25, 0.5)
        chosen = sel.channels[k]
        delta = ctx.fisher[li]
        assert delta[chosen].min() >= np.delete(delta, chosen).max()  # the top channels by delta
        for j in info.layers[li].tensors:  # weight and bias of a layer share their channels
            if info.tensor_roles[j] in ("weight", "bias"):
                assert np.array_equal(sel.channels[j], chosen)


def test_tinytrain_budgets_bind():
    model, info, cost = build(mcu_net, 8, "jetson_nano")
    ctx = context(model, info, cost, "fisher")
    trained = []
    for fraction in (0.05, 0.3, 1.0):
        sel = make_strategy("tinytrain", {"compute_fraction": fraction, "compute_metric": "time"}).select(ctx)
        assert cost.backward_time_s(sel.ratios) <= fraction * cost.backward_time_s(np.ones(info.num_tensors)) + 1e-15
        trained.append(float((sel.ratios * info.tensor_numel).sum()))
    assert trained[0] < trained[1] <= trained[2]
    frozen = cost.peak_memory_bytes(np.zeros(info.num_tensors))
    tight = (frozen + 2000) / ctx.memory_budget_bytes
    sel = make_strategy("tinytrain", {"memory_fraction": tight, "compute_fraction": 1.0}).select(ctx)
    assert cost.peak_memory_bytes(sel.ratios) <= tight * ctx.memory_budget_bytes


# ---- sparse_update / bn_bias -------------------------------------------------------------------------------
def test_sparse_update_static_scheme_fits_mcu():
    model, info, cost = build(mcu_net, 16, "stm32f746")
    ctx = SelectionContext(info, cost, 0, np.random.default_rng(0))
    strategy = make_strategy("sparse_update", {"bias_last_k": 4, "max_weight_layers": 3})
    sel = strategy.select(ctx)
    assert cost.peak_memory_bytes(sel.ratios, sel.input_sparse) <= ctx.memory_budget_bytes
    weights = [k for k in np.flatnonzero(sel.mask) if info.tensor_roles[k] == "weight"]
    assert 1 <= len(weights) <= 3
    biases = [k for k in np.flatnonzero(sel.mask) if info.tensor_roles[k] in ("bias", "norm_bias")]
    bias_layers = [
        li
        for li in range(len(info.layers))
        if any(info.tensor_roles[k] in ("bias", "norm_bias") for k in info.layers[li].tensors)
    ]
    updated = bias_layers[-4:]
    assert sorted({int(info.tensor_layer[k]) for k in biases}) == updated
    for k in weights:  # input-channel ratios, only on layers whose (folded) bias is updated
        li = int(info.tensor_layer[k])
        assert sel.ratios[k] in (0.125, 0.25, 0.5, 1.0) and sel.input_sparse[k]
        assert li in updated or (li + 1 in updated and info.layers[li + 1].kind == "norm")
    again = strategy.select(SelectionContext(info, cost, 5, np.random.default_rng(1)))  # static: no rng, no probe
    assert np.array_equal(again.ratios, sel.ratios)
    assert not strategy.should_reselect(10)
    result = train_local(model, info, strategy, cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=3))
    assert result.fits and result.steps == 3


def test_sparse_update_searches_a_scheme_once_per_cost_model_and_budget(monkeypatch):
    _, info, cost = build(mcu_net, 16, "stm32f746")
    calls = []
    priced = cost.peak_memory_bytes
    monkeypatch.setattr(cost, "peak_memory_bytes", lambda *a, **k: calls.append(1) or priced(*a, **k))
    strategy = make_strategy("sparse_update", {"bias_last_k": 4, "max_weight_layers": 3})
    first = strategy.select(SelectionContext(info, cost, 0, np.random.default_rng(0)))
    searched = len(calls)
    assert searched > 10
    first.ratios[:] = 0  # a caller's change to its copy reaches no later selection
    again = make_strategy("sparse_update", {"bias_last_k": 4, "max_weight_layers": 3}).select(
        SelectionContext(info, cost, 7, np.random.default_rng(3))
    )
    assert len(calls) == searched and again.ratios.any()  # the same config, cost model and budget: not searched again
    other = make_strategy("sparse_update", {"bias_last_k": 4, "max_weight_layers": 2}).select(
        SelectionContext(info, cost, 0, np.random.default_rng(0))
    )
    assert len(calls) > searched and np.count_nonzero(other.ratios[other.input_sparse]) <= 2  # another config: searched


def test_sparse_update_input_channel_memory_matches_hand_computation():
    # conv 8 -> 4 (1x1) on 8 x 3 x 3 inputs, batch 2, fp32: its weight gradient reads its input
    model = nn.Sequential(nn.Conv2d(8, 4, 1, bias=False), nn.Flatten(), nn.Linear(36, 2))
    info = describe(model, torch.zeros(1, 8, 3, 3))
    cost = CostModel(info, get_profile("jetson_nano"), batch_size=2)
    sparse = np.array([True, False, False])
    full_input = 8 * 9 * 2 * 4
    flatten = 36 * 2 / 8  # the Flatten above it keeps a one-bit mask
    assert cost.memory(np.array([1.0, 0, 0]), sparse).activations_bytes == full_input + flatten
    one = cost.memory(np.array([0.125, 0, 0]), sparse)
    assert one.activations_bytes == full_input / 8 + flatten  # one kept input channel
    assert one.gradients_bytes == 4 * 1 * 4  # 4 outputs x 1 input channel, fp32
    # the same ratio over output channels still needs all of the input
    assert cost.memory(np.array([0.125, 0, 0])).activations_bytes == full_input + flatten


def test_sparse_update_trains_the_input_channels_of_largest_norm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, bias=True), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 10))  # fmt: skip
    info = describe(model, torch.zeros(1, 1, 8, 8))
    cost = CostModel(info, get_profile("jetson_nano"), BATCH)
    w = model[2].weight.detach().clone()
    norms = w.permute(1, 0, 2, 3).reshape(8, -1).norm(dim=1)
    kept = set(torch.argsort(-norms)[:2].tolist())  # ratio 1/4 of 8 input channels, by hand
    ratios = np.zeros(info.num_tensors)
    ratios[2] = 0.25  # the second conv's weight
    sparse = np.zeros(info.num_tensors, bool)
    sparse[2] = True
    from fedelastic.train.contribution import _Fixed

    result = train_local(model, info, _Fixed(Selection(ratios, input_sparse=sparse)), cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.5, max_steps=3))
    after = model[2].weight.detach()
    changed = {c for c in range(8) if not torch.equal(after[:, c], w[:, c])}
    assert changed == kept
    mask = result.channel_masks["2.weight"]
    assert mask.shape == (1, 8, 1, 1) and {int(c) for c in np.flatnonzero(mask.ravel())} == kept
    assert result.ratios[2] == 0.25


def test_sparse_update_contribution_search_is_brute_force_optimal(tmp_path):
    import itertools
    import json

    from fedelastic.strategies.sparse_update import bias_layers, weights_in_range

    _, info, cost = build(mcu_net, 16, "stm32f746")
    updated = set(bias_layers(info)[:6])
    weights = weights_in_range(info, updated)
    ratios = (0.125, 0.25, 0.5, 1.0)
    rng = np.random.default_rng(5)
    gains = {info.layers[info.tensor_layer[k]].name: {str(r): float(g) for r, g in zip(ratios, np.sort(rng.random(4)))}
             for k in weights}  # fmt: skip
    path = tmp_path / "gains.json"
    path.write_text(json.dumps({"bias": [0.1] * 6, "weight": gains}))
    budget_fraction = 0.8
    strategy = make_strategy("sparse_update", {"contributions": str(path), "memory_fraction": budget_fraction,
                                               "max_weight_layers": 2})  # fmt: skip
    sel = strategy.select(SelectionContext(info, cost, 0, np.random.default_rng(0)))
    base = np.zeros(info.num_tensors)
    for li in updated:
        for k in info.layers[li].tensors:
            if info.tensor_roles[k] in ("bias", "norm_bias"):
                base[k] = 1
    sparse = np.zeros(info.num_tensors, bool)
    sparse[weights] = True
    budget = budget_fraction * cost.device.memory_train_bytes.value
    best = 0.0
    for pick in itertools.product((0.0, *ratios), repeat=len(weights)):  # every scheme, by brute force
        if sum(r > 0 for r in pick) > 2:
            continue
        r = base.copy()
        r[weights] = pick
        if cost.peak_memory_bytes(r, sparse) <= budget:
            name = [info.layers[info.tensor_layer[k]].name for k in weights]
            best = max(best, sum(gains[n][str(p)] for n, p in zip(name, pick) if p > 0))
    got = sum(gains[info.layers[info.tensor_layer[k]].name][str(sel.ratios[k])] for k in weights if sel.ratios[k] > 0)
    assert got == pytest.approx(best) and best > 0
    assert cost.peak_memory_bytes(sel.ratios, sel.input_sparse) <= budget


def test_sparse_update_searches_against_memory():
    _, info, cost = build(mcu_net, 16, "stm32f746")
    ctx = SelectionContext(info, cost, 0, np.random.default_rng(0))
    trained = []
    for fraction in (0.7, 0.85, 1.0):
        sel = make_strategy("sparse_update", {"memory_fraction": fraction}).select(ctx)
        assert cost.peak_memory_bytes(sel.ratios, sel.input_sparse) <= fraction * ctx.memory_budget_bytes
        trained.append(float((sel.ratios * info.tensor_numel).sum()))
    assert trained[0] <= trained[1] <= trained[2] and trained[0] < trained[2]


def test_bn_bias_selects_norms_biases_and_head():
    _, info, cost = build(mcu_net, 8, "jetson_nano")
    sel = make_strategy("bn_bias").select(SelectionContext(info, cost, 0, np.random.default_rng(0)))
    head = set(info.layers[-1].tensors)
    for k, role in enumerate(info.tensor_roles):
        assert sel.mask[k] == (role in ("norm_weight", "norm_bias", "bias") or k in head)


# ---- probes within memory, BatchNorm mode, no budget, later failures, optimizer ----------------------
@pytest.mark.parametrize("name", ["elastic_tensor", "static_elastic", "elastic_layer", "tinytrain"])
def test_no_probe_larger_than_the_device_is_reported_as_fitting(name):
    # the example: mcu_net width 16 on stm32f746 (320 KiB); the whole importance probe needs
    # about 1.3 MiB at batch 16 and still 450 KiB on one sample, so it must run in pieces
    model, info, cost = build(mcu_net, 16, "stm32f746")
    memory = cost.device.memory_train_bytes.value
    options = {"rho": 0.4} if name != "tinytrain" else {}
    seen = recorded(strategy := make_strategy(name, options))
    result = train_local(model, info, strategy, cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=4))
    assert result.fits and result.steps == 4
    assert 0 < result.probe_peak_memory_bytes <= memory
    train_peak = max(cost.peak_memory_bytes(s.ratios, s.input_sparse) for s in seen)
    assert result.peak_memory_bytes == max(train_peak, result.probe_peak_memory_bytes) <= memory


def test_a_probe_that_cannot_fit_never_runs():
    model, info, cost = build(mcu_net, 16, "stm32f746")
    head = np.arange(info.num_tensors) == info.num_tensors - 1
    # by hand: the head's output and accumulators for one sample, and a 1/16 workspace in SRAM; the
    # weights (int8, one byte each) stay in the MCU's flash
    layer = info.layers[-1]
    need = layer.out_numel + 4 * layer.out_channels + cost._workspace / BATCH
    assert cost.probe_memory("fisher", 1, head).total_bytes == pytest.approx(need)
    assert cost.probe_memory("fisher", 1, head).flash_bytes == info.num_params
    tiny = dataclasses.replace(cost.device, memory_train_bytes=Quantity(need - 1, "test"))
    cost = CostModel(info, tiny, BATCH)
    before = copy.deepcopy(model.state_dict())
    result = train_local(model, info, make_strategy("tinytrain"), cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05))
    # below the probe's need, not even the forward pass fits: nothing can train, so the probe is not
    # even planned, and the reason gives the forward pass's need against the memory
    forward = cost.peak_memory_bytes(np.zeros(info.num_tensors))
    assert forward > need
    assert not result.fits and result.steps == 0 and result.probes == 0
    assert f"the forward pass alone needs {forward:.0f} bytes" in result.reason and f"{need - 1:.0f}" in result.reason
    assert result.probe_peak_memory_bytes == 0 and result.probe_time_s == 0
    assert result.train_time_s == result.selector_time_s  # no probe charged: only the selector's budget checks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_micro_batched_probes_equal_one_pass_with_frozen_batchnorm():
    model, info, _ = build(mcu_net, 8, "jetson_nano")
    model.train()
    for mod in model.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.eval()
    x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    whole = importance_probe(model, info, opt, x, y)
    np.testing.assert_allclose(importance_probe(model, info, opt, x, y, micro_batch=3), whole, rtol=1e-4, atol=1e-10)
    one, parts = fisher_probe(model, info, x, y), fisher_probe(model, info, x, y, micro_batch=5)
    assert one.keys() == parts.keys()
    for li in one:
        np.testing.assert_allclose(parts[li], one[li], rtol=1e-4, atol=1e-12)


def test_batchnorm_statistics_frozen_by_default_and_trained_on_request():
    model, info, cost = build(mcu_net, 8, "jetson_nano")
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    result = train_local(model, info, make_strategy("full"), cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=3))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stats.items())
    assert not any("running" in k for k in result.trained)
    train_cost = CostModel(info, cost.device, BATCH, bn_mode="train")
    result = train_local(model, info, make_strategy("full"), train_cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=3, bn_mode="train"))
    assert any(not torch.equal(model.state_dict()[k], v) for k, v in stats.items())
    assert any("running_mean" in k for k in result.trained)


def test_no_backward_budget_runs_no_probe():
    # the example: small_cnn on stm32h743 at rho 0.3 trained 0 steps but paid 4 probes (0.236 s)
    model, info, cost = build(small_cnn, 8, "stm32h743")
    assert cost.backward_budget_s(0.3) <= 0
    strategy = make_strategy("elastic_tensor", {"rho": 0.3, "interval": 2, "interval_unit": "steps"})
    result = train_local(model, info, strategy, cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=8))
    assert result.steps == 0 and result.probe_peak_memory_bytes == 0
    assert result.overhead_time_s == result.selector_time_s < 1e-3


class _ThenFull(SelectionStrategy):
    """Last layer for two steps, then everything (which an MCU cannot hold)."""

    name = "_then_full"

    def should_reselect(self, step, steps_per_epoch=0):
        return step == 2

    def select(self, ctx):
        mask = np.zeros(ctx.info.num_tensors)
        mask[list(ctx.info.layers[-1].tensors)] = 1
        return Selection.from_mask(mask if ctx.step < 2 else np.ones(ctx.info.num_tensors))


def test_a_later_selection_that_does_not_fit_keeps_the_time_spent():
    model, info, cost = build(mcu_net, 16, "stm32f746")
    before = copy.deepcopy(model.state_dict())
    result = train_local(model, info, _ThenFull(), cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=6))
    head = np.zeros(info.num_tensors)
    head[list(info.layers[-1].tensors)] = 1
    assert not result.fits and result.steps == 2 and "selection needs" in result.reason
    assert result.train_time_s == pytest.approx(2 * cost.step_time_s(head) + result.selector_time_s)
    assert result.macs == pytest.approx(2 * cost.step_macs(head))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not result.trained


def test_sgdw_decays_decoupled_and_cosine_schedules_the_rate():
    from fedelastic.train.trainer import SGDW

    w = nn.Parameter(torch.tensor([2.0, -1.0]))
    opt = SGDW([w], lr=0.1, momentum=0.0, weight_decay=0.5)
    w.grad = torch.tensor([1.0, 1.0])
    opt.step()
    # w <- w * (1 - lr * wd) - lr * g, the decay kept out of the gradient (coupled L2 would add wd * w to g)
    torch.testing.assert_close(w.detach(), torch.tensor([2.0 * 0.95 - 0.1, -1.0 * 0.95 - 0.1]))
    model, info, cost = build(small_cnn, 4, "jetson_nano")
    lrs = []
    real_step = SGDW.step

    def spy(self, closure=None):
        lrs.append(self.param_groups[0]["lr"])
        return real_step(self, closure)

    SGDW.step = spy
    try:
        train_local(model, info, make_strategy("full"), cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.2, max_steps=4, optimizer="sgdw", lr_schedule="cosine", weight_decay=1e-3))
    finally:
        del SGDW.step  # SGD's, inherited, again
    np.testing.assert_allclose(lrs, [0.2 * 0.5 * (1 + np.cos(np.pi * t / 4)) for t in range(4)])


def test_elastic_layer_objective_at_most_elastic_tensor():
    model, info, cost = build(mcu_net, 8, "jetson_nano")
    for seed, rho in ((0, 0.4), (1, 0.5), (2, 0.7)):
        ctx = context(model, info, cost, "importance", seed)
        tensor = make_strategy("elastic_tensor", {"rho": rho}).select(ctx)
        layer = make_strategy("elastic_layer", {"rho": rho}).select(ctx)
        imp = np.maximum(ctx.importance, 0)
        # layers are a restricted form of tensor units on the same budget and costs
        assert float(imp @ layer.mask) <= float(imp @ tensor.mask) + 1e-12


def _rounds(strategy_name, options, rounds, steps, *, device="jetson_nano", carry_state=True):
    """``rounds`` local trainings of ``steps`` steps each, the strategy's state handed from one
    round's instance to the next (as the client keeps it); the results, in order."""
    model, info, cost = build(small_cnn, 16, device)
    state: dict = {}
    results = []
    for r in range(rounds):
        strategy = make_strategy(strategy_name, options)
        if carry_state:
            strategy.load_state(state)
        results.append(
            train_local(model, info, strategy, cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=steps), seed=r)
        )
        state = {k: np.array(v) for k, v in strategy.state().items()}
    return results


def test_the_reselection_interval_runs_across_rounds():
    # every 4 steps, 2 steps a round: a probe in rounds 1, 3, 5 (at 0, 4, 8 steps), none in 2, 4, 6
    options = {"rho": 0.8, "interval": 4, "interval_unit": "steps"}
    results = _rounds("elastic_tensor", options, 6, 2)
    assert [r.probes for r in results] == [1, 0, 1, 0, 1, 0]
    assert [r.selections for r in results] == [1, 0, 1, 0, 1, 0]
    assert all(r.steps == 2 for r in results)
    for r in results[1::2]:  # a carried selection costs no probe and no selector work, and still trains
        assert r.overhead_time_s == r.probe_time_s == 0 and r.train_time_s > 0
    for r in results[::2]:
        assert r.probe_time_s > 0 and r.overhead_time_s == pytest.approx(r.probe_time_s + r.selector_time_s)
    # the carried selection is the one trained: round 2 trains what round 1 selected
    assert np.array_equal(results[1].ratios, results[0].ratios)
    # without the state handed on, every round starts with a probe
    assert [r.probes for r in _rounds("elastic_tensor", options, 3, 2, carry_state=False)] == [1, 1, 1]


def test_a_carried_selection_is_dropped_under_another_config():
    options = {"rho": 0.8, "interval": 4, "interval_unit": "steps"}
    first = make_strategy("elastic_tensor", options)
    model, info, cost = build(small_cnn, 16, "jetson_nano")
    train_local(model, info, first, cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05, max_steps=2))
    state = first.state()
    assert int(state["carried.since"][0]) == 2
    same, other = make_strategy("elastic_tensor", options), make_strategy("elastic_tensor", {**options, "rho": 0.7})
    same.load_state(state)
    other.load_state(state)  # a deadline's own rho: the selection was made for another budget
    assert same.carried is not None and same.since == 2 and other.carried is None
    # tinytrain's default (interval 0) selects at the start of each local training
    assert [r.probes for r in _rounds("tinytrain", {}, 2, 2)] == [1, 1]


def test_no_probe_when_the_budget_is_below_the_cheapest_tensor():
    # small_cnn width 16, batch 8, TX2, rho 0.4: a positive backward budget, below what any tensor costs
    model, info, cost = build(small_cnn, 16, "jetson_tx2", batch_size=8)
    budget = cost.backward_budget_s(0.4)
    dw, dx = cost.t_dw + cost.t_opt, cost.t_dx
    alone = [dw[k] + dx[k + 1 :].sum() for k in range(info.num_tensors)]  # a tensor trained alone, its chain above
    cheapest = min(alone) + cost.t_bwd_fixed
    assert 0 < budget < cheapest
    strategy = make_strategy("elastic_tensor", {"rho": 0.4})
    result = train_local(model, info, strategy, cost, digits(), LocalTraining(epochs=1, batch_size=8, lr=0.05, max_steps=4))
    assert result.fits and result.steps == 0 and result.probes == 0 and result.probe_time_s == 0
    assert result.overhead_time_s == result.selector_time_s  # only the budget check, no probe
    assert f"backward budget of {budget * 1e6:.3g} us" in result.reason
    assert f"below the {cheapest * 1e6:.3g} us the cheapest trainable tensor needs" in result.reason
    assert "no room beyond the forward pass" not in result.reason
    assert strategy.carried is None  # nothing is carried: the next round checks (and says why) again


def test_the_forward_share_reason_appears_only_when_true():
    model, info, cost = build(small_cnn, 8, "jetson_tx2", batch_size=8)
    assert cost.backward_budget_s(0.4) <= 0
    result = train_local(model, info, make_strategy("elastic_tensor", {"rho": 0.4}), cost, digits(), LocalTraining(epochs=1, batch_size=8, lr=0.05, max_steps=4))
    share = cost.forward_time_s / cost.full_step_time_s()
    assert result.steps == 0 and result.probes == 0
    assert f"forward share {share:.3f}" in result.reason and "no room beyond the forward pass" in result.reason


def test_no_fisher_probe_when_no_layer_fits_memory():
    model, info, cost = build(mcu_net, 16, "stm32f746")
    forward = cost.peak_memory_bytes(np.zeros(info.num_tensors))
    least = np.inf
    for layer in info.layers:  # one output channel of each conv/linear layer, by itself
        if layer.kind in ("conv", "linear"):
            r = np.zeros(info.num_tensors)
            r[list(layer.tensors)] = 1 / info.tensor_channels[layer.tensors[0]]
            least = min(least, cost.peak_memory_bytes(r))
    assert forward < least
    tight = dataclasses.replace(cost.device, memory_train_bytes=Quantity((forward + least) / 2, "test"))
    cost = CostModel(info, tight, BATCH)
    result = train_local(model, info, make_strategy("tinytrain"), cost, digits(), LocalTraining(epochs=1, batch_size=BATCH, lr=0.05))
    assert result.probes == 0 and result.probe_time_s == 0 and result.steps == 0
    assert f"the least needs {least:.0f} bytes" in result.reason


def test_the_contribution_analysis_says_what_data_it_ran_on(tmp_path):
    import json

    from fedelastic.train.contribution import analyse

    model, info, cost = build(small_cnn, 4, "jetson_tx2")
    data = digits()
    source = data.subset(np.flatnonzero(data.y < 5))  # a source task: digits 0-4
    proxy = tmp_path / "proxy.json"
    out = analyse(model, info, cost, source.subset(np.arange(40)), source.subset(np.arange(40, 80)), bias_last_k=1,
                  channel_ratios=(1.0,), epochs=1, batch_size=BATCH, lr=0.01, path=proxy, data="digits 0-4")  # fmt: skip
    written = json.loads(proxy.read_text())
    assert written == json.loads(json.dumps(out))
    assert written["kind"] == "offline proxy" and written["data"] == "digits 0-4" and written["device"] == "jetson_tx2"
    assert written["training"]["lr"] == 0.01
    make_strategy("sparse_update", {"contributions": str(proxy)})  # a proxy analysis needs no opt-in
    # on the pooled target data: a centralised oracle, used only when asked for
    oracle = tmp_path / "oracle.json"
    analyse(model, info, cost, data.subset(np.arange(40)), data.subset(np.arange(40, 80)), bias_last_k=1,
            channel_ratios=(1.0,), epochs=1, batch_size=BATCH, path=oracle, data="pooled target", oracle=True)  # fmt: skip
    assert json.loads(oracle.read_text())["kind"] == "centralised oracle"
    with pytest.raises(ConfigError, match=r"train\.options\.contributions.*centralised oracle.*oracle = true"):
        make_strategy("sparse_update", {"contributions": str(oracle)})
    assert make_strategy("sparse_update", {"contributions": str(oracle), "oracle": True}).config.oracle
    with pytest.raises(ValueError, match="describe the data"):
        analyse(model, info, cost, source, source, bias_last_k=1, channel_ratios=(1.0,), data=" ")
