"""The contract every registered selection strategy keeps, one matrix over the registry.

Every strategy in :func:`fedelastic.selection.available` (present and future) runs through the
same checks on tiny CPU models (``small_cnn`` and ``mcu_net`` at width 8 on 8x8 digits) with a
GPU-class and an MCU-class device profile:

(a) the budget is respected: time for strategies with a ``rho`` option, memory whenever the
    trainer says the selection fits (and strategies marked ``respects_memory`` always fit when
    the frozen model itself does);
(b) only selected tensors, and inside channel-sparse tensors only selected channels, change;
(c) a lower budget (or, for fixed schemes, the scheme against full training) really makes the
    host backward cheaper, counted in autograd nodes;
(d) the config round-trips through dicts and TOML;
(e) a seed gives identical weights and identical selections;
(f) bad options raise a ConfigError naming the key; unknown keys are rejected.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import typing

import numpy as np
import pytest
import tomli_w
import torch
from torch import nn

from fedelastic.config import from_dict, to_dict
from fedelastic.costmodel import CostModel
from fedelastic.data import load_digits_dataset
from fedelastic.devices import get_profile
from fedelastic.errors import ConfigError
from fedelastic.modelinfo import describe
from fedelastic.models.small import mcu_net, small_cnn
from fedelastic.selection import REGISTRY, Selection, SelectionContext, available, make_strategy
from fedelastic.training import (
    LocalTraining,
    count_backward_nodes,
    fisher_probe,
    importance_probe,
    ordered_params,
    train_local,
)

STRATEGIES = available()
MODELS = {"small_cnn": small_cnn, "mcu_net": mcu_net}
DEVICES = ("jetson_nano", "stm32h743")
BATCH = 16
STEPS = 7
SEED = 3
TIME_RTOL = 1e-9

# Value checks per strategy: options that must be refused, and the key the error must name.
# Type checks (a string for a number, a number for a string...) run for every option of every
# strategy without a row here.
BAD_VALUES: dict[str, list[tuple[dict, str]]] = {
    "elastic_tensor": [
        ({"rho": -1}, "rho"),
        ({"rho": 0.0}, "rho"),
        ({"rho": 1.5}, "rho"),
        ({"interval": 0}, "interval"),
        ({"solver": "simplex"}, "solver"),
        ({"resolution": 0}, "resolution"),
        ({"infeasible": "ignore"}, "infeasible"),
    ],
    "elastic_layer": [({"rho": -1}, "rho"), ({"interval": -3}, "interval")],
    "random_budget": [({"rho": 2.0}, "rho"), ({"interval": 0}, "interval")],
    "static_elastic": [({"rho": -1}, "rho"), ({"resolution": -5}, "resolution")],
    "tinytrain": [
        ({"memory_fraction": 0.0}, "memory_fraction"),
        ({"memory_fraction": 1.2}, "memory_fraction"),
        ({"compute_fraction": -0.1}, "compute_fraction"),
        ({"compute_metric": "flops"}, "compute_metric"),
        ({"channel_ratios": [0.5, 0.0]}, "channel_ratios"),
        ({"interval": -1}, "interval"),
    ],
    "sparse_update": [
        ({"bias_last_k": -1}, "bias_last_k"),
        ({"max_weight_layers": -2}, "max_weight_layers"),
        ({"channel_ratios": []}, "channel_ratios"),
        ({"channel_ratios": [0.25, 2.0]}, "channel_ratios"),
        ({"memory_fraction": 0.0}, "memory_fraction"),
    ],
}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread is fastest and avoids contention on shared CI cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def option_names(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(REGISTRY[name].config_cls)}


def is_budgeted(name: str) -> bool:
    return "rho" in option_names(name)


def matrix_options(name: str, **overrides) -> dict:
    """Options used in the matrix: rho 0.5 and re-selection every 3 steps where they exist."""
    wanted = {"rho": 0.5, "interval": 3, "interval_unit": "steps", **overrides}
    return {k: v for k, v in wanted.items() if k in option_names(name)}


@functools.cache
def setup(model_name: str, device: str):
    """(initial state, info, cost) of a seeded width-8 model on ``device``."""
    torch.manual_seed(0)
    model = MODELS[model_name](width=8)
    info = describe(model, torch.zeros(1, 1, 8, 8), model_name)
    cost = CostModel(info, get_profile(device), BATCH)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, info, cost


@functools.lru_cache(maxsize=1)
def data():
    ds = load_digits_dataset()
    return ds.subset(np.random.default_rng(0).permutation(len(ds))[:128])


def fresh_model(model_name: str, device: str) -> nn.Module:
    state, _, _ = setup(model_name, device)
    model = MODELS[model_name](width=8)
    model.load_state_dict(state)
    return model


def record(strategy) -> list[Selection]:
    """Make ``strategy`` append every Selection it returns to the returned list."""
    seen: list[Selection] = []
    inner = strategy.select

    def select(ctx):
        sel = inner(ctx)
        seen.append(sel)
        steps.append(ctx.step)
        return sel

    steps: list[int] = []
    strategy.selected_at = steps

    strategy.select = select
    return seen


@functools.cache
def run(name: str, model_name: str, device: str, options_key: tuple = ()):
    """Train once with ``name``; returns (model after, LocalResult, selections, info, cost)."""
    _, info, cost = setup(model_name, device)
    model = fresh_model(model_name, device)
    strategy = make_strategy(name, dict(options_key) or matrix_options(name))
    selections = record(strategy)
    result = train_local(
        model,
        info,
        strategy,
        cost,
        data(),
        LocalTraining(epochs=1, batch_size=BATCH, lr=0.1, weight_decay=1e-3, max_steps=STEPS),
        seed=SEED,
    )
    return model, result, selections, info, cost


def probe_context(model_name: str, device: str, probe: str | None) -> SelectionContext:
    """A selection context with the probe results ``probe`` needs, on one fixed batch."""
    _, info, cost = setup(model_name, device)
    model = fresh_model(model_name, device)
    model.train()
    ds = data()
    x, y = torch.from_numpy(ds.x[:BATCH]), torch.from_numpy(ds.y[:BATCH])
    ctx = SelectionContext(info, cost, 0, np.random.default_rng(11))
    if probe == "importance":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ctx.importance = importance_probe(model, info, opt, x, y)
    elif probe == "fisher":
        ctx.fisher = fisher_probe(model, info, x, y)
    return ctx


def backward_nodes(model_name: str, device: str, selection: Selection) -> int:
    """Autograd nodes of one backward with ``selection`` applied (requires_grad per tensor)."""
    _, info, _ = setup(model_name, device)
    model = fresh_model(model_name, device)
    for p, r in zip(ordered_params(model, info), selection.ratios):
        p.requires_grad_(bool(r > 0))
    ds = data()
    x, y = torch.from_numpy(ds.x[:BATCH]), torch.from_numpy(ds.y[:BATCH])
    return count_backward_nodes(nn.functional.cross_entropy(model(x), y))


CASES = [(s, m, d) for s in STRATEGIES for m in MODELS for d in DEVICES]
IDS = [f"{s}-{m}-{d}" for s, m, d in CASES]


def test_registry_lists_the_project_strategies():
    expected = {
        "full",
        "last_layer",
        "bn_bias",
        "elastic_tensor",
        "elastic_layer",
        "tinytrain",
        "sparse_update",
        "random_budget",
        "static_elastic",
    }
    assert expected <= set(STRATEGIES)


def reference_peak(info, device, batch: int, ratios: np.ndarray, input_sparse=None) -> float:
    """Peak training memory by ALGORITHMS.md section 4, written out per tensor and op (frozen BatchNorm)."""
    e, b = float(device.bytes_per_element), float(batch)
    sparse = np.zeros(len(ratios), bool) if input_sparse is None else np.asarray(input_sparse, bool)
    weights = float(info.tensor_numel.sum()) * e
    workspace = max(b * (layer.in_numel + layer.out_numel) * e for layer in info.layers)
    on = np.flatnonzero(ratios > 0)
    if on.size == 0:
        return weights + workspace
    acts = 0.0
    for k in on:
        layer, role = info.layers[info.tensor_layer[k]], info.tensor_roles[k]
        if role == "weight":  # its input: all of it, or the trained share for depthwise / input channels
            acts += layer.in_numel * b * e * (ratios[k] if layer.groups > 1 or sparse[k] else 1.0)
        elif role in ("norm_weight", "other"):  # the normalised input (frozen statistics)
            acts += layer.out_numel * b * e
    deepest = info.tensor_layer[on[0]]
    for op in info.ops:  # weightless ops the error gradient passes
        if op.above > deepest:
            acts += op.out_numel * b / 8 if op.kind == "mask" else op.in_numel * b * e
    trained = float(ratios @ info.tensor_numel) * e
    return weights + acts + trained * 2 + workspace  # a gradient and one momentum element per trained element


# ---- (a) budgets ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "model_name", "device"), CASES, ids=IDS)
def test_budget_respected(name, model_name, device):
    _, result, selections, info, cost = run(name, model_name, device)
    memory = cost.device.memory_train_bytes.value
    assert selections, "train_local never asked the strategy to select"
    if is_budgeted(name):
        rho = make_strategy(name, matrix_options(name)).config.rho
        limit = rho * cost.full_step_time_s() * (1 + TIME_RTOL)
        for sel in selections:
            assert cost.step_time_s(sel.ratios) <= limit
    # memory against an independent computation, not the cost model's own verdict
    peaks = [reference_peak(info, cost.device, BATCH, s.ratios, s.input_sparse) for s in selections]
    for sel, peak in zip(selections, peaks):
        assert cost.peak_memory_bytes(sel.ratios, sel.input_sparse) == pytest.approx(peak)
    probe_ok = result.probe_peak_memory_bytes <= memory
    assert result.fits == (max(peaks) <= memory and probe_ok)
    assert result.peak_memory_bytes == pytest.approx(max(max(peaks), result.probe_peak_memory_bytes))
    frozen_fits = reference_peak(info, cost.device, BATCH, np.zeros(info.num_tensors)) <= memory
    if getattr(REGISTRY[name], "respects_memory", False) and frozen_fits:
        assert result.fits, f"{name} ignored the memory budget of {device}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_train_time_is_steps_probes_and_selector(name):
    """train time = sum of the steps' times + the probes + the selector's work, priced by hand."""
    _, result, selections, info, cost = run(name, "small_cnn", "jetson_nano")  # every probe fits whole
    strategy = make_strategy(name, matrix_options(name))
    seen = record(strategy)
    rerun = train_local(
        fresh_model("small_cnn", "jetson_nano"),
        info,
        strategy,
        cost,
        data(),
        LocalTraining(epochs=1, batch_size=BATCH, lr=0.1, weight_decay=1e-3, max_steps=STEPS),
        seed=SEED,
    )
    starts = [*strategy.selected_at, min(STEPS, -(-len(data()) // BATCH))]
    steps = sum((b - a) for a, b, sel in zip(starts, starts[1:], seen) if sel.mask.any())
    step_time = sum(
        (b - a) * cost.step_time_s(sel.ratios) for a, b, sel in zip(starts, starts[1:], seen) if sel.mask.any()
    )
    ones = np.ones(info.num_tensors)
    per_probe = {
        "importance": 2 * (cost.forward_time_s + cost.backward_time_s(ones) - cost.t_opt.sum()) + cost.t_opt.sum(),
        "fisher": cost.forward_time_s + cost.t_dx[1:].sum() + cost.t_bwd_fixed,
    }
    probes = sum(per_probe[p] for p in probes_run(strategy, len(seen)))
    assert rerun.steps == steps == result.steps
    # fixed schemes do no search; Sparse Update searches offline, before deployment
    searches = getattr(REGISTRY[name], "respects_memory", False) and not REGISTRY[name].offline
    assert (rerun.selector_time_s > 0) == searches
    assert rerun.overhead_time_s == pytest.approx(probes + rerun.selector_time_s)
    assert rerun.train_time_s == pytest.approx(step_time + probes + rerun.selector_time_s)


def probes_run(strategy, selections: int) -> list[str]:
    """The probe of each selection: static_elastic probes only its first."""
    kind = type(strategy).probe
    if kind is None:
        return []
    return [kind] * (1 if strategy.name == "static_elastic" else selections)


# ---- (b) only selected tensors and channels change -------------------------------------------------
@pytest.mark.parametrize(("name", "model_name", "device"), CASES, ids=IDS)
def test_only_selected_change(name, model_name, device):
    model, result, selections, info, _ = run(name, model_name, device)
    before, _, _ = setup(model_name, device)
    after = model.state_dict()
    changed_any = False
    for k, tname in enumerate(info.tensor_names):
        old, new = before[tname], after[tname]
        trained = [sel for sel in selections if sel.ratios[k] > 0] if result.fits else []
        if not trained:
            assert torch.equal(old, new), f"{tname} changed but was never selected"
            continue
        changed_any |= not torch.equal(old, new)
        if all(k in sel.channels for sel in trained):  # channel-sparse every time it trained
            allowed = np.zeros(info.tensor_channels[k], dtype=bool)
            for sel in trained:
                allowed[sel.channels[k]] = True
            assert torch.equal(old[torch.from_numpy(~allowed)], new[torch.from_numpy(~allowed)]), (
                f"{tname}: unselected channels changed"
            )
            assert 0 < allowed.sum() < len(allowed)
    if result.fits and result.steps > 0:
        assert changed_any, "nothing changed although selected tensors trained"
    # what the client reports as trained is exactly what was selected
    union = np.zeros(info.num_tensors)
    for sel in selections:
        union = np.maximum(union, sel.ratios)
    if result.fits:
        assert {info.tensor_names[k] for k in np.flatnonzero(union > 0)} <= set(result.trained)


@pytest.mark.parametrize(("name", "model_name", "device"), CASES, ids=IDS)
def test_frozen_norm_statistics_unchanged(name, model_name, device):
    """Running statistics of a norm layer none of whose tensors trained stay bit-identical."""
    model, result, selections, info, _ = run(name, model_name, device)
    before, _, _ = setup(model_name, device)
    after = model.state_dict()
    for layer in info.layers:
        if layer.kind != "norm" or (result.fits and any(sel.mask[list(layer.tensors)].any() for sel in selections)):
            continue
        for buf in ("running_mean", "running_var"):
            key = f"{layer.name}.{buf}"
            assert torch.equal(before[key], after[key]), f"{key} changed but {layer.name} never trained"


# ---- (c) lower budget -> cheaper host backward -----------------------------------------------------
@pytest.mark.parametrize(("name", "model_name", "device"), CASES, ids=IDS)
def test_lower_budget_fewer_backward_nodes(name, model_name, device):
    probe = REGISTRY[name].probe
    ctx = probe_context(model_name, device, probe)
    if is_budgeted(name):
        low = make_strategy(name, matrix_options(name, rho=0.3)).select(ctx)
        ctx.rng = np.random.default_rng(11)
        high = make_strategy(name, matrix_options(name, rho=1.0)).select(ctx)
        assert cost_le(ctx, low, high)
        assert backward_nodes(model_name, device, low) < backward_nodes(model_name, device, high)
    else:
        sel = make_strategy(name, matrix_options(name)).select(ctx)
        full = Selection.from_mask(np.ones(ctx.info.num_tensors))
        nodes, full_nodes = backward_nodes(model_name, device, sel), backward_nodes(model_name, device, full)
        if name == "full":
            assert nodes == full_nodes
        else:
            assert nodes < full_nodes


def cost_le(ctx: SelectionContext, low: Selection, high: Selection) -> bool:
    return ctx.cost.step_time_s(low.ratios) <= ctx.cost.step_time_s(high.ratios) * (1 + TIME_RTOL)


# ---- (d) config round trip ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", STRATEGIES)
def test_config_round_trips(name):
    cls = REGISTRY[name].config_cls
    for cfg in (cls(), make_strategy(name, matrix_options(name)).config):
        raw = to_dict(cfg)
        assert from_dict(cls, raw) == cfg
        assert from_dict(cls, tomllib.loads(tomli_w.dumps(raw))) == cfg
    for f in dataclasses.fields(cls):
        assert f.metadata.get("help"), f"{name}.{f.name} has no help text"


# ---- (e) determinism -----------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "model_name", "device"), CASES, ids=IDS)
def test_seed_is_deterministic(name, model_name, device):
    model_a, result_a, sels_a, _, _ = run(name, model_name, device)
    _, info, cost = setup(model_name, device)
    model_b = fresh_model(model_name, device)
    strategy = make_strategy(name, matrix_options(name))
    sels_b = record(strategy)
    result_b = train_local(
        model_b,
        info,
        strategy,
        cost,
        data(),
        LocalTraining(epochs=1, batch_size=BATCH, lr=0.1, weight_decay=1e-3, max_steps=STEPS),
        seed=SEED,
    )
    assert result_a.fits == result_b.fits and result_a.steps == result_b.steps
    assert len(sels_a) == len(sels_b)
    for a, b in zip(sels_a, sels_b):
        assert np.array_equal(a.ratios, b.ratios)
        assert a.channels.keys() == b.channels.keys()
        assert all(np.array_equal(a.channels[k], b.channels[k]) for k in a.channels)
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


# ---- (f) bad options ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", STRATEGIES)
def test_unknown_option_rejected(name):
    with pytest.raises(ConfigError) as err:
        make_strategy(name, {"no_such_option": 1})
    assert err.value.key == "train.options.no_such_option"


def wrong_type_value(tp):
    """A value of the wrong type for a config field of type ``tp``."""
    origin = typing.get_origin(tp)
    if tp in (int, float) or origin is tuple:
        return "not-a-number"
    return 12345  # str, bool, Literal[...]


@pytest.mark.parametrize("name", STRATEGIES)
def test_bad_options_name_the_key(name):
    cls = REGISTRY[name].config_cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        with pytest.raises(ConfigError) as err:
            make_strategy(name, {f.name: wrong_type_value(hints[f.name])})
        assert err.value.key == f"train.options.{f.name}"
    for options, key in BAD_VALUES.get(name, []):
        with pytest.raises(ConfigError) as err:
            make_strategy(name, options)
        assert err.value.key == f"train.options.{key}", options
        assert key in str(err.value)
