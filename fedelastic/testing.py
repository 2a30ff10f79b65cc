"""The contract every selection strategy keeps, as one call: :func:`check_strategy`.

Like scikit-learn's ``check_estimator``: a strategy of your own (a notebook's, a package's) proves
itself with ``fedelastic.testing.check_strategy(MyStrategy)``, which raises ``AssertionError``
naming the check, the model and the device at the first breach. The built-in strategies pass the
same checks (``tests/contract/test_strategy_contract.py``). It trains tiny CPU models (``small_cnn`` and
``mcu_net`` at width 8 on 128 8x8 digits, 7 steps of batch 16) on a GPU-class and an MCU-class
device profile (``jetson_nano``, ``stm32h743``); it takes seconds per strategy.

(a) the budget is respected: time for strategies with a ``rho`` option (not those marked
    ``respects_time = False``, which select on a prior of their own), memory (against a peak
    written out per tensor, not the cost model's verdict) whenever the trainer says the selection
    fits, and strategies marked ``respects_memory`` always fit when the frozen model does;
(b) only selected tensors, and inside channel-sparse tensors only selected channels, change; the
    running statistics of a norm layer that never trained stay bit-identical;
(c) a lower ``rho`` (or, without one, the strategy against full training) makes the backward
    cheaper, counted in autograd nodes (``full`` itself: equal);
(d) the config round-trips through dicts and TOML, and every option has help text;
(e) a seed gives identical weights and identical selections;
(f) unknown options and options of the wrong type raise a ConfigError naming
    ``train.options.<option>``, as do the ``bad_values`` given.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tomllib
import typing
from collections.abc import Iterable

import numpy as np
import tomli_w
import torch
from torch import nn

from .config import from_dict, to_dict
from .cost.costmodel import CostModel
from .data import load_digits_dataset
from .devices.profile import get_profile
from .errors import ConfigError
from .modelinfo import describe
from .models.small import mcu_net, small_cnn
from .selection.strategy import REGISTRY, Selection, SelectionContext, SelectionStrategy, make_strategy, register
from .train.trainer import (
    LocalTraining,
    count_backward_nodes,
    fisher_probe,
    importance_probe,
    ordered_params,
    torch_threads,
    train_local,
)

MODELS = {"small_cnn": small_cnn, "mcu_net": mcu_net}
DEVICES = ("jetson_nano", "stm32h743")
BATCH, STEPS, SEED, TIME_RTOL = 16, 7, 3, 1e-9


def check_strategy(
    cls: type[SelectionStrategy],
    *,
    options: dict | None = None,
    bad_values: Iterable[tuple[dict, str]] = (),
    models: Iterable[str] = tuple(MODELS),
    devices: Iterable[str] = DEVICES,
) -> None:
    """Run checks (a)-(f) of the module doc on ``cls`` (registered under ``cls.name`` if it is not).

    ``options``: the strategy's options in the training checks (default: ``rho = 0.5`` and
    re-selection every 3 steps where those options exist). ``bad_values``: (options, key) pairs
    that must be refused with a ConfigError naming ``train.options.<key>``.
    """
    if REGISTRY.get(getattr(cls, "name", None)) is not cls:
        register(cls)
    name = cls.name
    with torch_threads(1):  # tiny models: one thread is fastest
        _check_config(name, list(bad_values))
        for model_name in models:
            for device in devices:
                where = f"{name} on {model_name} / {device}"
                opts = _options(name, options)
                first = _train(name, model_name, device, opts)
                _check_budget(name, model_name, device, opts, first, where)
                _check_only_selected(model_name, device, first, where)
                _check_cheaper(name, model_name, device, opts, where)
                _check_deterministic(name, model_name, device, opts, first, where)


def _expect(condition: bool, where: str, what: str) -> None:
    if not condition:
        raise AssertionError(f"{where}: {what}")


def _option_names(name: str) -> set[str]:
    return {f.name for f in dataclasses.fields(REGISTRY[name].config_cls)}


def _options(name: str, options: dict | None, **overrides) -> dict:
    wanted = {"rho": 0.5, "interval": 3, "interval_unit": "steps", **(options or {}), **overrides}
    return {k: v for k, v in wanted.items() if k in _option_names(name) or k in (options or {})}


@functools.cache
def _setup(model_name: str, device: str):
    """(initial state, info, cost) of a seeded width-8 model on ``device``."""
    torch.manual_seed(0)
    model = MODELS[model_name](width=8)
    info = describe(model, torch.zeros(1, 1, 8, 8), model_name)
    cost = CostModel(info, get_profile(device), BATCH)
    return {k: v.clone() for k, v in model.state_dict().items()}, info, cost


@functools.cache
def _data():
    ds = load_digits_dataset()
    return ds.subset(np.random.default_rng(0).permutation(len(ds))[:128])


def _fresh(model_name: str, device: str) -> nn.Module:
    model = MODELS[model_name](width=8)
    model.load_state_dict(_setup(model_name, device)[0])
    return model


def _train(name: str, model_name: str, device: str, options: dict):
    """Train once; returns (model after, LocalResult, the selections made)."""
    _, info, cost = _setup(model_name, device)
    model = _fresh(model_name, device)
    strategy = make_strategy(name, options)
    seen: list[Selection] = []
    inner = strategy.select
    strategy.select = lambda ctx: seen.append(inner(ctx)) or seen[-1]  # type: ignore[method-assign]
    local = LocalTraining(epochs=1, batch_size=BATCH, lr=0.1, weight_decay=1e-3, max_steps=STEPS)
    result = train_local(model, info, strategy, cost, _data(), local, seed=SEED)
    return model, result, seen


def reference_peak(info, device, batch: int, ratios: np.ndarray, input_sparse=None) -> float:
    """Peak training memory by ALGORITHMS.md section 4, written out per tensor and op (frozen BatchNorm).

    RAM only: on a device with ``memory.flash`` the frozen weights are in flash, not counted here
    (:func:`reference_flash`), and the trained elements are the weights in RAM.
    """
    e, b = float(device.bytes_per_element), float(batch)
    sparse = np.zeros(len(ratios), bool) if input_sparse is None else np.asarray(input_sparse, bool)
    weights = float(info.tensor_numel.sum()) * e
    if device.memory_flash_bytes is not None:
        weights = float(sum(r * n for r, n in zip(ratios, info.tensor_numel))) * e
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


def reference_flash(info, device, ratios: np.ndarray) -> float:
    """Bytes of frozen weights in flash: every element not trained (0 on a device without flash)."""
    if device.memory_flash_bytes is None:
        return 0.0
    return float(sum((1.0 - r) * n for r, n in zip(ratios, info.tensor_numel))) * device.bytes_per_element


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _check_budget(name, model_name, device, options, trained, where) -> None:
    _, result, selections = trained
    _, info, cost = _setup(model_name, device)
    memory = cost.device.memory_train_bytes.value
    _expect(bool(selections), where, "train_local never asked the strategy to select")
    if "rho" in _option_names(name) and getattr(REGISTRY[name], "respects_time", True):
        limit = make_strategy(name, options).config.rho * cost.full_step_time_s() * (1 + TIME_RTOL)
        for sel in selections:
            _expect(cost.step_time_s(sel.ratios) <= limit, where, "(a) a selection's step time exceeds rho x full")
    peaks = [reference_peak(info, cost.device, BATCH, s.ratios, s.input_sparse) for s in selections]
    for sel, peak in zip(selections, peaks, strict=True):
        _expect(_close(cost.peak_memory_bytes(sel.ratios, sel.input_sparse), peak), where, "(a) peak memory")
    probe_ok = result.probe_peak_memory_bytes <= memory
    flash = cost.device.memory_flash_bytes
    flash_ok = flash is None or all(reference_flash(info, cost.device, s.ratios) <= flash.value for s in selections)
    _expect(
        result.fits == (max(peaks) <= memory and probe_ok and flash_ok), where, "(a) 'fits' disagrees with the peak"
    )
    _expect(_close(result.peak_memory_bytes, max(max(peaks), result.probe_peak_memory_bytes)), where, "(a) peak")
    frozen_fits = reference_peak(info, cost.device, BATCH, np.zeros(info.num_tensors)) <= memory
    if getattr(REGISTRY[name], "respects_memory", False) and frozen_fits:
        _expect(result.fits, where, "(a) respects_memory, yet the selection does not fit the device's memory")


def _check_only_selected(model_name, device, trained, where) -> None:
    model, result, selections = trained
    before, info, _ = _setup(model_name, device)
    after = model.state_dict()
    changed_any = False
    for k, tname in enumerate(info.tensor_names):
        old, new = before[tname], after[tname]
        sels = [sel for sel in selections if sel.ratios[k] > 0] if result.fits else []
        if not sels:
            _expect(torch.equal(old, new), where, f"(b) {tname} changed but was never selected")
            continue
        changed_any |= not torch.equal(old, new)
        if all(k in sel.channels for sel in sels):  # channel-sparse every time it trained
            allowed = np.zeros(info.tensor_channels[k], dtype=bool)
            for sel in sels:
                allowed[sel.channels[k]] = True
            unselected = torch.from_numpy(~allowed)
            _expect(torch.equal(old[unselected], new[unselected]), where, f"(b) {tname}: unselected channels changed")
    if result.fits and result.steps > 0:
        _expect(changed_any, where, "(b) nothing changed although selected tensors trained")
    union = np.zeros(info.num_tensors)
    for sel in selections:
        union = np.maximum(union, sel.ratios)
    if result.fits:
        names = {info.tensor_names[k] for k in np.flatnonzero(union > 0)}
        _expect(names <= set(result.trained), where, "(b) a selected tensor is missing from the client's report")
    for layer in info.layers:  # norm statistics of layers that never trained
        if layer.kind != "norm" or (result.fits and any(sel.mask[list(layer.tensors)].any() for sel in selections)):
            continue
        for buf in ("running_mean", "running_var"):
            key = f"{layer.name}.{buf}"
            _expect(torch.equal(before[key], after[key]), where, f"(b) {key} changed but {layer.name} never trained")


def _context(model_name: str, device: str, probe: str | None) -> SelectionContext:
    """A selection context with the probe results ``probe`` needs, on one fixed batch."""
    _, info, cost = _setup(model_name, device)
    model = _fresh(model_name, device)
    model.train()
    x, y = torch.from_numpy(_data().x[:BATCH]), torch.from_numpy(_data().y[:BATCH])
    ctx = SelectionContext(info, cost, 0, np.random.default_rng(11))
    if probe == "importance":
        ctx.importance = importance_probe(model, info, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), x, y)
    elif probe == "fisher":
        ctx.fisher = fisher_probe(model, info, x, y)
    return ctx


def _nodes(model_name: str, device: str, selection: Selection) -> int:
    """Autograd nodes of one backward with ``selection`` applied (requires_grad per tensor)."""
    _, info, _ = _setup(model_name, device)
    model = _fresh(model_name, device)
    for p, r in zip(ordered_params(model, info), selection.ratios, strict=True):
        p.requires_grad_(bool(r > 0))
    x, y = torch.from_numpy(_data().x[:BATCH]), torch.from_numpy(_data().y[:BATCH])
    return count_backward_nodes(nn.functional.cross_entropy(model(x), y))


def _check_cheaper(name, model_name, device, options, where) -> None:
    ctx = _context(model_name, device, REGISTRY[name].probe)
    if "rho" in _option_names(name):
        low = make_strategy(name, _options(name, options, rho=0.3)).select(ctx)
        ctx.rng = np.random.default_rng(11)
        high = make_strategy(name, _options(name, options, rho=1.0)).select(ctx)
        cost = ctx.cost
        _expect(cost.step_time_s(low.ratios) <= cost.step_time_s(high.ratios) * (1 + TIME_RTOL), where,
                "(c) rho 0.3 costs more step time than rho 1.0")  # fmt: skip
        _expect(_nodes(model_name, device, low) < _nodes(model_name, device, high), where,
                "(c) rho 0.3 leaves no fewer backward nodes than rho 1.0")  # fmt: skip
        return
    sel = make_strategy(name, options).select(ctx)
    nodes = _nodes(model_name, device, sel)
    full = _nodes(model_name, device, Selection.from_mask(np.ones(ctx.info.num_tensors)))
    if name == "full":
        _expect(nodes == full, where, "(c) full training's backward differs from all tensors'")
    else:
        _expect(nodes < full, where, "(c) the selection's backward is no cheaper than full training's")


def _check_deterministic(name, model_name, device, options, first, where) -> None:
    model_a, result_a, sels_a = first
    model_b, result_b, sels_b = _train(name, model_name, device, options)
    same = result_a.fits == result_b.fits and result_a.steps == result_b.steps and len(sels_a) == len(sels_b)
    _expect(same, where, "(e) one seed, two different trainings (fits, steps or selections)")
    for a, b in zip(sels_a, sels_b, strict=True):
        equal = np.array_equal(a.ratios, b.ratios) and a.channels.keys() == b.channels.keys()
        equal = equal and all(np.array_equal(a.channels[k], b.channels[k]) for k in a.channels)
        _expect(equal, where, "(e) one seed, two different selections")
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    _expect(all(torch.equal(state_a[k], state_b[k]) for k in state_a), where, "(e) one seed, two different weights")


def _wrong_type(tp):
    """A value of the wrong type for a config field of type ``tp``."""
    if tp in (int, float) or typing.get_origin(tp) is tuple:
        return "not-a-number"
    return 12345  # str, bool, Literal[...]


def _refused(name: str, options: dict, key: str) -> None:
    try:
        make_strategy(name, options)
    except ConfigError as err:
        _expect(err.key == f"train.options.{key}", name, f"(f) {options} was refused naming {err.key!r}, not {key!r}")
        return
    raise AssertionError(f"{name}: (f) options {options} were accepted")


def _check_config(name: str, bad_values: list[tuple[dict, str]]) -> None:
    cls = REGISTRY[name].config_cls
    for cfg in (cls(), make_strategy(name, _options(name, None)).config):
        raw = to_dict(cfg)
        _expect(from_dict(cls, raw) == cfg, name, "(d) the config does not round-trip through a dict")
        _expect(from_dict(cls, tomllib.loads(tomli_w.dumps(raw))) == cfg, name, "(d) nor through TOML")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        _expect(bool(f.metadata.get("help")), name, f"(d) option {f.name} has no help text (config.field(help=...))")
        _refused(name, {f.name: _wrong_type(hints[f.name])}, f.name)
    _refused(name, {"no_such_option": 1}, "no_such_option")
    for options, key in bad_values:
        _refused(name, options, key)
