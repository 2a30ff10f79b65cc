"""Measure a device's per-layer training times with torch, fit its roofline, write its profile.

This is what ``fedelastic profile measure`` runs on the device to be emulated (a Jetson, a
Raspberry Pi, or this host), and what ``fedelastic profile import-trace`` uses to refit a
profile from measured tables.

Measuring (:func:`measure_layers`)
----------------------------------
On a fixed batch, with ``torch.set_num_threads`` fixed by the caller (the count is recorded in
every source), the whole model runs three kinds of passes, each time-stamped per layer (a
module that owns parameters, as in :class:`~fedelastic.modelinfo.ModelInfo`) by forward hooks
on every layer and tensor hooks on every layer's output (the moment backward reaches it):

- *train*: full training steps, training mode, every parameter trainable;
- *eval-train*: the same with batch norms in eval mode;
- *frozen*: eval mode, no autograd: what a layer below the trained part costs.

The forward between the end of one layer and the end of the next is that next layer's (its
weightless ops included); the backward between two consecutive stamps is the layer's dX and dW
plus the weightless ops below it, which is the cost model's convention (the backward of
weightless ops between layer L and L+1 goes to L+1's dx). Each layer is also timed **in
isolation** on its captured input (forward with autograd on; dX = ``autograd.grad`` wrt the
input with the parameters frozen; dW = ``autograd.grad`` wrt the parameters with the input not
requiring grad; medians after warm-up), which splits its in-graph backward into dX and dW.

Training costs more than the sum of frozen forwards and backward kernels on a CPU: autograd
keeps activations (allocations, page faults) and a batch norm in training mode computes batch
statistics (~5x its eval-mode forward). The table charges each of these where the cost model
pays for it: autograd's extra forward to ``dx`` (paid by every layer above the deepest trained
tensor), training mode to a norm's ``dw`` (the trainer runs a norm in training mode only when
one of its tensors trains), so that the cost model's constant forward is the frozen one.

Fitting (:func:`fit_roofline`)
------------------------------
The roofline ``max(flops / (peak * efficiency), bytes / bandwidth) + launch_overhead`` has three
free numbers. They are fitted by ``scipy.optimize.least_squares`` to the per-layer ``fwd``,
``dx`` and ``dw`` times of one or more measured tables, each compared with what
:class:`~fedelastic.costmodel.CostModel` itself predicts for that layer (so the fit uses exactly
the cost model's flops and bytes per kernel). The default residual is least squares in seconds
with a variance proportional to the time, ``(pred - meas) / sqrt(meas * mean)``: the kernels
that make up most of a step matter most, while the many small ones still pin the launch
overhead. The peak and bandwidth can be bounded by a datasheet (efficiency <= 1).
"""

from __future__ import annotations

import datetime
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .costmodel import CostModel
from .devices import DeviceProfile, LayerTiming, parse_profile
from .devices import MeasuredTable as ProfileTable
from .modelinfo import ModelInfo, first_tensor
from .trace import LayerTime, MeasuredTable

__all__ = [
    "FIT_OBJECTIVES",
    "FitResult",
    "apply_fit",
    "build_model",
    "build_profile_dict",
    "describe_model",
    "dumps_profile",
    "fit_roofline",
    "fit_to_profile",
    "get_clock",
    "host_memory_available",
    "import_trace_into",
    "layer_roofline",
    "measure_layers",
    "measure_peak_flops",
    "measure_profile",
    "measured_by",
    "measured_table_toml",
    "profile_table",
    "set_measured_table",
    "write_profile",
]


# ----------------------------------------------------------------------------- models


def build_model(
    name: str,
    *,
    num_classes: int | None = None,
    input_size: int | None = None,
    in_channels: int | None = None,
    **options: Any,
):
    """Build a registry model (or ``module:callable``) and a matching input shape.

    Only the keyword arguments the factory accepts are passed (``input_size`` is passed as
    ``image_size`` to factories that call it that). Defaults come from the factory.

    Returns
    -------
    (torch.nn.Module, tuple of int)
        The model and the shape of one sample, ``(channels, size, size)``.
    """
    from .models import resolve_factory

    factory = resolve_factory(name, context="<command line>", key="--model")
    params = inspect.signature(factory).parameters
    kwargs: dict[str, Any] = dict(options)
    if num_classes is not None and "num_classes" in params:
        kwargs["num_classes"] = num_classes
    size_key = "input_size" if "input_size" in params else "image_size" if "image_size" in params else None
    if input_size is not None and size_key:
        kwargs[size_key] = input_size
    if in_channels is not None and "in_channels" in params:
        kwargs["in_channels"] = in_channels
    model = factory(**kwargs)

    def default(key: str, fallback: int) -> int:
        p = params.get(key)
        return int(p.default) if p is not None and isinstance(p.default, int) else fallback

    size = input_size if input_size is not None else int(getattr(model, "input_size", 0) or 0)
    if not size:
        size = default(size_key, 32) if size_key else 32
    channels = in_channels if in_channels is not None else default("in_channels", 3)
    return model, (channels, size, size)


# ----------------------------------------------------------------------------- measuring


def _cuda_clock() -> float:
    """Wall time after waiting for every queued CUDA kernel (each stamp is a device barrier)."""
    import torch

    torch.cuda.synchronize()
    return time.perf_counter()


#: Clocks ``measure_layers`` can time with: wall time, the CPU time of the calling thread
#: (only meaningful with one torch thread; it leaves out time the thread spends descheduled on
#: a machine shared with other work), or wall time after a CUDA synchronisation (``cuda``: a
#: model and sample on a GPU; every stamp waits for the kernels queued before it).
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time, "cuda": _cuda_clock}

_NORMS = ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")


def get_clock(name: str) -> Callable[[], float]:
    """The clock called ``name`` (``wall``, ``cpu`` or ``cuda``); ``cpu`` requires one torch thread."""
    import torch

    if name not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {name!r}")
    if name == "cpu" and torch.get_num_threads() != 1:
        raise ValueError("the 'cpu' clock (thread CPU time) needs torch.set_num_threads(1)")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("the 'cuda' clock needs a CUDA device (torch.cuda.is_available() is False)")
    return CLOCKS[name]


def _median_time(fn: Callable[[], Any], repeats: int, warmup: int, clock: Callable[[], float]) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(np.median(times))


def _owner_layers(model) -> list[tuple[str, Any]]:
    """Modules that own parameters directly, in ``named_modules()`` order (as ModelInfo)."""
    return [(n, m) for n, m in model.named_modules() if next(iter(m.parameters(recurse=False)), None) is not None]


def _is_norm(module) -> bool:
    """Batch norms: the trainer runs them in eval mode when none of their tensors trains."""
    return type(module).__name__ in _NORMS


@dataclass
class _Captured:
    args: tuple
    kwargs: dict


def _capture_inputs(model, sample, owners) -> dict[str, _Captured]:
    import torch

    captured: dict[str, _Captured] = {}

    def detach(t):
        return t.detach().clone() if isinstance(t, torch.Tensor) else t

    def hook(name):
        def fn(_mod, args, kwargs, _out):
            if name not in captured:
                captured[name] = _Captured(tuple(detach(a) for a in args), {k: detach(v) for k, v in kwargs.items()})

        return fn

    handles = [mod.register_forward_hook(hook(name), with_kwargs=True) for name, mod in owners]
    try:
        with torch.no_grad():
            model(sample)
    finally:
        for h in handles:
            h.remove()
    return captured


def _time_isolated(
    mod, cap: _Captured, repeats: int, warmup: int, clock: Callable[[], float]
) -> tuple[float, float, float]:
    """(fwd, dx, dw) seconds of one layer on its captured input, in the module's current mode."""
    import torch

    params = list(mod.parameters(recurse=False))
    x = cap.args[0] if cap.args and isinstance(cap.args[0], torch.Tensor) else None
    floating = x is not None and x.is_floating_point()

    def call(inp):
        args = (inp, *cap.args[1:]) if x is not None else cap.args
        return first_tensor(mod(*args, **cap.kwargs))

    for p in params:
        p.requires_grad_(True)
    fwd = _median_time(lambda: call(x), repeats, warmup, clock)
    y = call(x)
    dy = torch.randn_like(y)
    dw = _median_time(lambda: torch.autograd.grad(y, params, dy, retain_graph=True), repeats, warmup, clock)
    dx = 0.0
    if floating:
        for p in params:
            p.requires_grad_(False)
        xg = x.detach().requires_grad_(True)
        y = call(xg)
        if y.requires_grad:
            dx = _median_time(lambda: torch.autograd.grad(y, xg, dy, retain_graph=True), repeats, warmup, clock)
        for p in params:
            p.requires_grad_(True)
    return fwd, dx, dw


def _stamped_pass(model, sample, target, owners, optimizer, loss_fn, clock, train: bool) -> dict[str, Any]:
    """One forward (and, if ``train``, backward and optimizer step) with time stamps per layer.

    Forward hooks stamp every layer's start and end; when the pass trains, a tensor hook on every
    layer's output stamps the moment backward reaches it.
    """
    import torch

    stamps: dict[str, list[float]] = {}
    bwd: list[tuple[float, str]] = []

    def pre(name):
        def fn(_mod, _args):
            stamps.setdefault(name, [clock(), 0.0])

        return fn

    def post(name):
        def fn(_mod, _args, out):
            s = stamps[name]
            if s[1] == 0.0:
                s[1] = clock()
                o = first_tensor(out)
                if o is not None and o.requires_grad:
                    o.register_hook(lambda _g: bwd.append((clock(), name)))

        return fn

    handles = []
    for name, mod in owners:
        handles.append(mod.register_forward_pre_hook(pre(name)))
        handles.append(mod.register_forward_hook(post(name)))
    try:
        if not train:
            with torch.no_grad():
                t0 = clock()
                model(sample)
                t1 = t2 = t3 = clock()
        else:
            optimizer.zero_grad(set_to_none=True)
            t0 = clock()
            loss = loss_fn(model(sample), target)
            t1 = clock()
            loss.backward()
            t2 = clock()
            optimizer.step()
            t3 = clock()
    finally:
        for h in handles:
            h.remove()
    return {"t": (t0, t1, t2, t3), "stamps": stamps, "bwd": bwd}


def _summarise(runs: list[dict[str, Any]], names: list[str]) -> dict[str, np.ndarray]:
    """Per-layer medians over stamped passes.

    ``fwd[l]``: from the end of the previous layer to the end of layer l (its forward plus the
    weightless ops just below it); ``bwd[l]``: from backward reaching layer l's output to
    backward reaching the next layer (its dx and dw plus the weightless ops below it);
    ``totals``: step, forward, backward, optimizer, unattributed forward (after the last layer,
    the loss), unattributed backward (before the first layer, the loss gradient).
    """
    order = {n: i for i, n in enumerate(names)}
    fwd = np.zeros((len(runs), len(names)))
    bwd = np.zeros((len(runs), len(names)))
    totals = np.zeros((len(runs), 6))
    for r, run in enumerate(runs):
        t0, t1, t2, t3 = run["t"]
        prev_end = t0
        for _, end, n in sorted((s[0], s[1], n) for n, s in run["stamps"].items() if n in order):
            fwd[r, order[n]] = max(end - prev_end, 0.0)
            prev_end = max(prev_end, end)
        events = sorted(e for e in run["bwd"] if e[1] in order)
        for k, (ts, n) in enumerate(events):
            nxt = events[k + 1][0] if k + 1 < len(events) else t2
            bwd[r, order[n]] += nxt - ts
        first_bwd = events[0][0] if events else t2
        totals[r] = (t3 - t0, t1 - t0, t2 - t1, t3 - t2, t1 - prev_end, first_bwd - t1)
    return {"fwd": np.median(fwd, axis=0), "bwd": np.median(bwd, axis=0), "totals": np.median(totals, axis=0)}


def measure_layers(
    model,
    sample,
    *,
    model_name: str = "model",
    target=None,
    repeats: int = 10,
    warmup: int = 2,
    source: str = "",
    clock: str = "wall",
    progress: Callable[[str], None] | None = None,
) -> MeasuredTable:
    """Measure per-layer ``fwd``/``dx``/``dw`` seconds of one training step of ``model``.

    Three kinds of stamped passes over the whole model (``repeats`` each, after ``warmup``):
    *frozen* (eval mode, no autograd: what a layer below the trained part costs), *eval-train*
    (eval mode, every parameter trainable) and *train* (training mode, every parameter
    trainable: full training as the trainer runs it). Then every layer is timed in isolation
    (forward, dX, dW) in training mode, and batch norms in eval mode too. The table holds:

    - ``fwd``: the frozen forward of the layer and of the weightless ops just below it;
    - ``dx``: the eval-train backward of the layer and the weightless ops below it, less its
      ``dw`` (split off by the isolated dX:dW ratio), plus what autograd adds to the forward
      when gradients flow (eval-train minus frozen forward). The cost model charges ``dx`` to
      every layer above the deepest trained tensor, exactly the layers that pay these;
    - ``dw``: the layer's parameter gradients; for a batch norm also the extra forward and
      backward of training mode (batch statistics), which the trainer pays only when one of
      the norm's tensors trains.

    Parameters
    ----------
    model : torch.nn.Module
        Stepped a few times with a negligible learning rate; its state is restored.
    sample : torch.Tensor
        One batch of inputs; its first dimension is the batch size of the table.
    model_name : str
        Name stored in the table (the key of ``[measured.<model>]``).
    target : torch.Tensor, optional
        Labels for the cross-entropy loss (default: random classes of the model's output).
    repeats, warmup : int
        Timed and untimed runs of every measurement; medians are kept.
    source : str
        Provenance text of the table.
    clock : str
        ``wall`` (default) or ``cpu``: CPU time of the calling thread, for a machine shared
        with other work (needs one torch thread; autograd runs CPU backward on the caller).
    progress : callable, optional
        Called with a short message as the measurement goes.

    Returns
    -------
    fedelastic.trace.MeasuredTable
        Keys are the torch module names of the layers, in forward order. ``step_s`` is a full
        training step (forward, backward, SGD-with-momentum update), ``forward_s`` and
        ``backward_s`` its parts, ``other_s`` the optimizer update.
    """
    import torch

    say = progress or (lambda _msg: None)
    clock_fn = get_clock(clock)
    owners_all = _owner_layers(model)
    owners = [(n, m) for n, m in owners_all if not any(True for _ in m.children())]
    nested = [n for n, m in owners_all if any(True for _ in m.children())]
    if nested:
        say(f"left to the roofline (they own parameters and have children): {nested}")
    names = [n for n, _ in owners]
    norms = {n for n, m in owners if _is_norm(m)}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    loss_fn = torch.nn.functional.cross_entropy
    try:
        for p in model.parameters():
            p.requires_grad_(True)
        if target is None:
            with torch.no_grad():
                classes = model.eval()(sample).shape[-1]
            target = torch.randint(0, classes, (sample.shape[0],), generator=torch.Generator().manual_seed(0))
            target = target.to(sample.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-12, momentum=0.9)

        def passes(train_mode: bool, grads: bool) -> dict[str, np.ndarray]:
            model.train(train_mode)
            runs = [
                _stamped_pass(model, sample, target, owners, optimizer, loss_fn, clock_fn, grads)
                for _ in range(warmup + repeats)
            ]
            return _summarise(runs[warmup:], names)

        # full training steps first: they grow the allocator's heap to its working size, so the
        # passes after them do not pay first-touch page faults
        say("training steps")
        full = passes(True, True)
        say("eval-mode training steps")
        evaltrain = passes(False, True)
        say("frozen forward passes")
        frozen = passes(False, False)

        say(f"{len(owners)} layers in isolation")
        captured = _capture_inputs(model.train(), sample, owners)
        iso_train, iso_eval = {}, {}
        for name, mod in owners:
            if name not in captured:
                continue
            mod.train()
            iso_train[name] = _time_isolated(mod, captured[name], repeats, warmup, clock_fn)
            if name in norms:
                mod.eval()
                iso_eval[name] = _time_isolated(mod, captured[name], repeats, warmup, clock_fn)
                mod.train()
    finally:
        model.load_state_dict(state)
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)
        model.train(was_training)

    # Corrections (autograd, training mode) are differences of medians: kept signed so that noise
    # cancels over layers instead of adding up; only the final entries are clipped at zero.
    layers = {}
    for i, n in enumerate(names):
        if n not in iso_train:
            continue
        _, dx_e, dw_e = iso_eval.get(n, iso_train[n])
        share = dw_e / (dx_e + dw_e) if dx_e + dw_e > 0 else 1.0
        seg = evaltrain["bwd"][i]
        autograd = evaltrain["fwd"][i] - frozen["fwd"][i]
        dw = seg * share
        dx = seg - dw + autograd
        if i == 0:  # nothing flows below the first layer: its backward is dW only, and pays the autograd share
            dw, dx = seg + autograd, iso_train[n][1]
        if n in norms:  # training mode (batch statistics) only when the norm trains
            dw += (full["fwd"][i] - evaltrain["fwd"][i]) + (full["bwd"][i] - seg)
        layers[n] = LayerTime(float(frozen["fwd"][i]), float(max(dx, 0.0)), float(max(dw, 0.0)))
    tot = full["totals"]
    return MeasuredTable(
        model=model_name,
        batch_size=int(sample.shape[0]),
        source=source,
        layers=layers,
        step_s=float(tot[0]),
        forward_s=float(tot[1]),
        backward_s=float(tot[2]),
        other_s=float(tot[3]),
        unattributed_fwd_s=float(evaltrain["totals"][4]),
        unattributed_bwd_s=float(tot[5]),
        n_steps=repeats,
    )


# ----------------------------------------------------------------------------- roofline fit


def _roofline_device(device: DeviceProfile, peak_eff: float, bandwidth: float, launch: float) -> DeviceProfile:
    """``device`` with the given effective peak (efficiency folded in), bandwidth and launch, no tables."""
    from .devices import Quantity

    return replace(
        device,
        peak_flops=Quantity(peak_eff, "fit"),
        efficiency=Quantity(1.0, "fit"),
        mem_bandwidth_bytes_per_s=Quantity(bandwidth, "fit"),
        launch_overhead_s=Quantity(launch, "fit"),
        measured={},
    )


def layer_roofline(info: ModelInfo, device: DeviceProfile, batch_size: int) -> np.ndarray:
    """Per-layer ``[fwd, dx, dw]`` seconds the cost model's roofline gives (no measured table).

    ``fwd`` includes the weightless ops just below the layer and ``dx`` their backward, the
    convention of measured tables; ``dw`` sums the layer's tensors.
    """
    cost = CostModel(info, replace(device, measured={}), batch_size)
    out = np.zeros((len(info.layers), 3))
    for li, layer in enumerate(info.layers):
        first = layer.tensors[0]
        out[li] = (
            cost.t_fwd[first] + cost.t_ops_fwd_layer[li],
            cost.t_dx[first],
            cost.t_dw[list(layer.tensors)].sum(),
        )
    return out


def _measured_matrix(info: ModelInfo, table) -> tuple[np.ndarray, np.ndarray]:
    """Measured ``[fwd, dx, dw]`` per layer of ``info`` (scaled to nothing) and a mask of usable entries.

    The first layer's dx is never used (autograd computes no gradient below the input), and
    entries of layers missing from the table, or below 1 ns, are left out.
    """
    meas = np.zeros((len(info.layers), 3))
    ok = np.zeros((len(info.layers), 3), bool)
    for li, layer in enumerate(info.layers):
        row = table.layers.get(layer.name)
        if row is None:
            continue
        meas[li] = (row.fwd_s, row.dx_s, row.dw_s)
        ok[li] = meas[li] > 1e-9
    ok[0, 1] = False
    return meas, ok


#: Residuals :func:`fit_roofline` can minimise.
FIT_OBJECTIVES = ("time", "log", "rel")


@dataclass(frozen=True)
class FitResult:
    """Roofline parameters fitted to measured per-layer times.

    Attributes
    ----------
    peak_eff : float
        ``peak * efficiency`` in FLOP/s.
    mem_bandwidth : float
        Effective memory bandwidth in B/s.
    launch_overhead : float
        Fixed seconds per kernel.
    n_points : int
        Measured entries (layer x fwd/dx/dw) fitted to.
    median_rel_err, p90_rel_err : float
        Unweighted relative errors of the fitted roofline over those entries.
    total_rel_err : float
        Relative error of the sum of all fitted entries.
    models : tuple of str
        The models of the tables fitted to.
    """

    peak_eff: float
    mem_bandwidth: float
    launch_overhead: float
    n_points: int
    median_rel_err: float
    p90_rel_err: float
    total_rel_err: float
    models: tuple[str, ...]

    def efficiency(self, peak: float) -> float:
        """Efficiency for a given peak, clipped to (0, 1]."""
        return float(min(max(self.peak_eff / peak, 1e-6), 1.0))


def fit_roofline(
    pairs: Sequence[tuple[ModelInfo, Any]],
    device: DeviceProfile,
    *,
    fit_bandwidth: bool = True,
    max_peak_eff: float | None = None,
    max_bandwidth: float | None = None,
    objective: str = "time",
) -> FitResult:
    """Fit ``peak * efficiency``, ``mem_bandwidth`` and ``launch_overhead`` to measured tables.

    Parameters
    ----------
    pairs : sequence of (ModelInfo, table)
        A model description and its measured table (``fedelastic.trace.MeasuredTable`` or a
        profile's ``MeasuredTable``: anything with ``batch_size`` and ``layers`` of
        ``fwd_s``/``dx_s``/``dw_s``). The roofline is evaluated at the table's batch size.
    device : DeviceProfile
        Supplies the train dtype and the starting point (its current parameters).
    fit_bandwidth : bool
        Fit the bandwidth too (else keep the device's).
    max_peak_eff, max_bandwidth : float, optional
        Upper bounds, e.g. the datasheet peak (efficiency <= 1) and bandwidth.
    objective : str
        ``time`` (default): residual ``(pred - meas) / sqrt(meas * mean)``, least squares in
        seconds with a variance proportional to the time, so the kernels that make up most of a
        step count most and small ones still pin the launch overhead; ``log``: log ratio;
        ``rel``: relative error (both weigh every kernel alike).

    Returns
    -------
    FitResult
    """
    from scipy.optimize import least_squares

    if not pairs:
        raise ValueError("fit_roofline needs at least one (ModelInfo, table) pair")
    data = []
    for info, table in pairs:
        meas, ok = _measured_matrix(info, table)
        if ok.any():
            data.append((info, int(table.batch_size), meas, ok))
    if not data:
        raise ValueError("the measured tables share no layer with the models")
    total = sum(m[ok].sum() for _, _, m, ok in data)
    n_points = sum(int(ok.sum()) for *_, ok in data)
    if objective not in FIT_OBJECTIVES:
        raise ValueError(f"objective must be one of {FIT_OBJECTIVES}, got {objective!r}")
    scale = total / n_points

    peak0 = device.peak_flops.value * device.efficiency.value
    bw0 = device.mem_bandwidth_bytes_per_s.value
    launch0 = max(device.launch_overhead_s.value, 1e-7)

    def unpack(theta):
        peak_eff, launch = np.exp(theta[0]), np.exp(theta[-1])
        bw = np.exp(theta[1]) if fit_bandwidth else bw0
        return peak_eff, bw, launch

    def predict(theta):
        dev = _roofline_device(device, *unpack(theta))
        return [layer_roofline(info, dev, b) for info, b, _, _ in data]

    def residuals(theta):
        preds = predict(theta)
        out = []
        for p, (_, _, m, ok) in zip(preds, data):
            if objective == "time":  # least squares in seconds, variance taken proportional to time
                out.append((p[ok] - m[ok]) / np.sqrt(m[ok] * scale))
            elif objective == "log":
                out.append(np.log(p[ok] / m[ok]))
            else:
                out.append(p[ok] / m[ok] - 1)
        return np.concatenate(out)

    # the max() of the roofline makes the cost flat in a parameter while no kernel is bound by
    # it, so the fit starts from several bandwidths (decades apart) and keeps the best
    hi_peak = np.log(max_peak_eff) if max_peak_eff else np.log(1e16)
    hi_bw = np.log(max_bandwidth) if max_bandwidth else np.log(1e13)
    lo = [np.log(1e3)] + ([np.log(1e5)] if fit_bandwidth else []) + [np.log(1e-9)]
    hi = [hi_peak] + ([hi_bw] if fit_bandwidth else []) + [np.log(1.0)]
    peak_start = np.log(min(peak0, 0.5 * max_peak_eff) if max_peak_eff else peak0)
    bw_starts = sorted({bw0, 1e9, 1e10, 1e11}) if fit_bandwidth else [bw0]
    best = None
    for bw_start in bw_starts:
        x0 = [peak_start] + ([min(np.log(bw_start), hi_bw - 0.5)] if fit_bandwidth else []) + [np.log(launch0)]
        res = least_squares(residuals, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale=1.0, diff_step=1e-4)
        if best is None or res.cost < best.cost:
            best = res
    res = best
    peak_eff, bw, launch = unpack(res.x)
    preds = predict(res.x)
    rel = np.concatenate([np.abs(p[ok] / m[ok] - 1) for p, (_, _, m, ok) in zip(preds, data)])
    pred_total = sum(p[ok].sum() for p, (_, _, m, ok) in zip(preds, data))
    return FitResult(
        peak_eff=float(peak_eff),
        mem_bandwidth=float(bw),
        launch_overhead=float(launch),
        n_points=n_points,
        median_rel_err=float(np.median(rel)),
        p90_rel_err=float(np.percentile(rel, 90)),
        total_rel_err=float(pred_total / total - 1),
        models=tuple(info.model_name for info, *_ in data),
    )


def fit_kernels_into(
    raw: dict[str, Any], pairs: Sequence[tuple[ModelInfo, Any]], src: str, source: str, max_bandwidth: float | None
) -> None:
    """Fit the kernel classes (:func:`fedelastic.kernelfit.fit_kernels`) and write ``[kernels]``,
    ``[uncertainty]`` and ``schema_version = 2`` into ``raw``."""
    from .kernelfit import fit_kernels, kernels_toml

    device = parse_profile(raw, src)
    fit = fit_kernels(pairs, device, max_bandwidth=max_bandwidth or device.mem_bandwidth_bytes_per_s.value)
    raw["schema_version"] = 2
    raw.update(kernels_toml(fit, device, source))


def datasheet_bandwidth(device: DeviceProfile) -> float | None:
    """The profile's bandwidth before any fit (B/s), or None if a fit replaced it without saying."""
    import re

    from .units import to_si

    q = device.mem_bandwidth_bytes_per_s
    if not q.source.startswith("fitted"):
        return q.value
    found = re.search(r"; was ([0-9.eE+-]+) (\S+): ", q.source)
    try:
        return to_si(float(found.group(1)), found.group(2), "bandwidth") if found else None
    except (KeyError, ValueError):
        return None


def fit_to_profile(
    pairs: Sequence[tuple[ModelInfo, Any]], device: DeviceProfile, *, objective: str = "time"
) -> FitResult:
    """:func:`fit_roofline` bounded by the profile's peak (efficiency <= 1) and datasheet bandwidth."""
    return fit_roofline(
        pairs,
        device,
        max_peak_eff=device.peak_flops.value,
        max_bandwidth=datasheet_bandwidth(device),
        objective=objective,
    )


# ----------------------------------------------------------------------------- host facts


def measure_peak_flops(size: int = 1024, repeats: int = 10, warmup: int = 2, clock: str = "wall") -> tuple[float, str]:
    """FP32 matrix-multiply throughput of this machine (FLOP/s) and how it was measured."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    t = _median_time(lambda: torch.mm(a, b), repeats, warmup, get_clock(clock))
    return 2.0 * size**3 / t, f"torch.mm {size}x{size} fp32, median of {repeats}"


def host_memory_available() -> tuple[float, str]:
    """Bytes of memory available to a new process now, and where the number comes from.

    ``psutil.virtual_memory().available`` when psutil is installed, else ``MemAvailable`` of
    ``/proc/meminfo`` (Linux), else total physical memory from ``os.sysconf``.
    """
    try:
        import psutil

        return float(psutil.virtual_memory().available), "psutil.virtual_memory().available"
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024.0, "MemAvailable of /proc/meminfo"
    except OSError:
        pass
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "total physical memory (os.sysconf)"


def host_description() -> str:
    """``<host> (<cpu>)``, for sources."""
    import platform
    import socket

    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{socket.gethostname()} ({cpu or platform.processor() or platform.machine()})"


# ----------------------------------------------------------------------------- profile files


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def measured_table_toml(table: Any) -> dict[str, Any]:
    """The ``[measured.<model>]`` table of a measured table (times in seconds, 4 significant digits).

    ``table`` is a ``fedelastic.trace.MeasuredTable`` (or any object with ``batch_size``,
    ``source``, ``layers`` of ``fwd_s``/``dx_s``/``dw_s`` and ``unattributed_*_s``).
    """
    out: dict[str, Any] = {"batch_size": int(table.batch_size), "source": str(table.source)}
    for key in ("unattributed_fwd", "unattributed_bwd"):
        value = float(getattr(table, f"{key}_s", 0.0))
        if value > 0:
            out[key] = _sig(value)
    out["layers"] = {
        name: {"fwd": _sig(t.fwd_s), "dx": _sig(t.dx_s), "dw": _sig(t.dw_s)} for name, t in table.layers.items()
    }
    return out


def profile_table(table: Any) -> ProfileTable:
    """A ``fedelastic.devices.MeasuredTable`` (what a loaded profile holds) from a measured table."""
    return ProfileTable(
        int(table.batch_size),
        str(table.source),
        {n: LayerTiming(t.fwd_s, t.dx_s, t.dw_s) for n, t in table.layers.items()},
        float(getattr(table, "unattributed_fwd_s", 0.0)),
        float(getattr(table, "unattributed_bwd_s", 0.0)),
    )


def _quantity(value: float, unit: str, source: str, digits: int = 4) -> dict[str, Any]:
    return {"value": _sig(value, digits), "unit": unit, "source": source}


#: What ``profile measure`` cannot measure: explicit placeholders, marked unverified.
PLACEHOLDERS: dict[str, dict[str, tuple[float, str]]] = {
    "power": {"train": (10.0, "W"), "idle": (3.0, "W"), "transmit": (4.0, "W"), "receive": (3.5, "W")},
    "network": {"uplink": (20.0, "Mbit/s"), "downlink": (50.0, "Mbit/s"), "latency": (30.0, "ms")},
}


def apply_fit(raw: dict[str, Any], fit: FitResult, source: str, *, bandwidth: bool = True) -> dict[str, Any]:
    """Write a fit into a raw profile: ``efficiency`` (against its peak), ``launch_overhead``, ``mem_bandwidth``.

    The peak keeps its value and source; the datasheet bandwidth is kept in the new source text.
    """
    dtype = raw["train_dtype"]
    compute = raw["compute"]
    peak_q = compute[f"peak_{dtype}"]
    from .units import UNITS

    dim = "ops" if dtype == "int8" else "flops"
    peak = float(peak_q["value"]) * UNITS[dim][peak_q["unit"]]
    eff = fit.efficiency(peak)
    models = ", ".join(fit.models)
    compute["efficiency"] = _quantity(
        eff, "1", f"{source}: peak x efficiency = {fit.peak_eff / 1e9:.4g} GFLOP/s effective ({models})"
    )
    compute["launch_overhead"] = _quantity(fit.launch_overhead * 1e6, "us", f"{source} ({models})")
    if bandwidth:
        old = compute.get("mem_bandwidth", {})
        old_source = str(old.get("source", ""))
        if "; was " in old_source:  # refitting: keep what the first fit replaced (the datasheet figure)
            was = "; was " + old_source.split("; was ", 1)[1]
        elif old and not old_source.startswith("fitted"):
            was = f"; was {old.get('value')} {old.get('unit')}: {old_source}"
        else:
            was = ""
        compute["mem_bandwidth"] = _quantity(
            fit.mem_bandwidth / 1e9, "GB/s", f"{source}: effective bandwidth ({models}){was}"
        )
    return raw


def build_profile_dict(
    name: str,
    *,
    tables: dict[str, Any],
    fit: FitResult,
    peak_flops: tuple[float, str],
    memory: tuple[float, str],
    measured_by: str,
    display_name: str | None = None,
    device_class: str = "sbc",
    like: dict[str, Any] | None = None,
    notes: str = "",
) -> dict[str, Any]:
    """A schema-v1 profile (as a TOML-ready dict) for a measured device.

    Parameters
    ----------
    name : str
        Device name (the file stem).
    tables : dict of str to measured table
        ``[measured.<model>]`` tables, by model registry name.
    fit : FitResult
        Fitted roofline; efficiency is taken against ``peak_flops``.
    peak_flops : (float, str)
        Measured FP32 peak in FLOP/s and how it was measured.
    memory : (float, str)
        Bytes available for training and where the number comes from.
    measured_by : str
        ``"fedelastic profile measure on <host>, <date>, torch <ver>, <n> threads"``: prefixes the
        source of every measured or fitted number.
    like : dict, optional
        A raw profile whose ``[power]`` and ``[network]`` (and ``availability``) are copied
        (e.g. the datasheet profile of the same board); otherwise unverified placeholders.
    """
    raw: dict[str, Any] = {
        "schema_version": 1,
        "name": name,
        "display_name": display_name or f"{name} (measured by fedelastic profile measure)",
        "device_class": device_class,
        "train_dtype": "fp32",
    }
    placeholder_note = (
        "power and network are copied from the profile given with --like"
        if like
        else "power and network are unverified placeholders (profile measure cannot measure them): "
        "replace them with power-meter and link measurements, or pass --like <profile>"
    )
    raw["notes"] = " ".join(
        x
        for x in (
            f"Measured: {measured_by}.",
            "Compute numbers and the measured tables come from that run; "
            "efficiency, mem_bandwidth and launch_overhead are fitted to its per-layer times.",
            placeholder_note + ".",
            notes,
        )
        if x
    )
    raw["memory"] = {
        "train": _quantity(memory[0] / 1e9, "GB", f"measured: {memory[1]} at measurement time; {measured_by}", 3)
    }
    raw["compute"] = {
        "peak_fp32": _quantity(peak_flops[0] / 1e9, "GFLOP/s", f"measured: {peak_flops[1]}; {measured_by}")
    }
    apply_fit(raw, fit, f"fitted: {measured_by}", bandwidth=False)
    raw["compute"]["mem_bandwidth"] = _quantity(
        fit.mem_bandwidth / 1e9, "GB/s", f"fitted: {measured_by}: effective bandwidth ({', '.join(fit.models)})"
    )
    for section, keys in PLACEHOLDERS.items():
        if like and section in like:
            raw[section] = {k: dict(v) for k, v in like[section].items()}
            continue
        raw[section] = {
            key: _quantity(
                value,
                unit,
                f"unverified placeholder: fedelastic profile measure does not measure {section}; "
                "replace with a measurement of this device",
            )
            for key, (value, unit) in keys.items()
        }
    if like and "availability" in like:
        raw["availability"] = {k: dict(v) for k, v in like["availability"].items()}
    raw["measured"] = {model: measured_table_toml(t) for model, t in tables.items()}
    return raw


def _toml_value(value: Any) -> str:
    import tomli_w

    return tomli_w.dumps({"x": value}).split(" = ", 1)[1].rstrip("\n")


def _toml_key(key: str) -> str:
    import tomli_w

    return tomli_w.dumps({key: 0}).rsplit(" = ", 1)[0]


def _inline(table: dict[str, Any]) -> str:
    return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()) + " }"


def dumps_profile(raw: dict[str, Any]) -> str:
    """TOML text of a raw profile, in the layout of the shipped profiles.

    Quantities and layer rows are inline tables, one per line. The text is checked to parse back
    to ``raw`` exactly; if it would not, plain ``tomli_w.dumps`` output is returned instead.
    """
    import tomllib

    import tomli_w

    lines = []
    for key, value in raw.items():
        if not isinstance(value, dict):
            lines.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for section, table in raw.items():
        if not isinstance(table, dict) or section in ("measured", "kernels"):
            continue
        lines += ["", f"[{_toml_key(section)}]"]
        lines += [f"{_toml_key(k)} = {_inline(v) if isinstance(v, dict) else _toml_value(v)}" for k, v in table.items()]
    for cls, table in raw.get("kernels", {}).items():
        lines += ["", f"[kernels.{_toml_key(cls)}]"]
        lines += [f"{_toml_key(k)} = {_inline(v)}" for k, v in table.items()]
    for model, table in raw.get("measured", {}).items():
        lines += ["", f"[measured.{_toml_key(model)}]"]
        lines += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items() if k != "layers"]
        lines.append(f"[measured.{_toml_key(model)}.layers]")
        lines += [f"{_toml_key(k)} = {_inline(v)}" for k, v in table.get("layers", {}).items()]
    text = "\n".join(lines) + "\n"
    if tomllib.loads(text) != raw:
        return tomli_w.dumps(raw)
    return text


def write_profile(raw: dict[str, Any], path: str | Path) -> DeviceProfile:
    """Validate ``raw`` as the profile file ``path`` (name = file stem), write it, and load it back."""
    from .devices import load_profile

    path = Path(path)
    parse_profile(raw, str(path), stem=path.stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps_profile(raw))
    return load_profile(path)


def set_measured_table(raw: dict[str, Any], model: str, table: Any) -> dict[str, Any]:
    """Put ``table`` in ``raw`` as ``[measured.<model>]``, replacing any table of that model."""
    raw.setdefault("measured", {})[model] = measured_table_toml(table)
    return raw


def measured_by(threads: int, clock: str = "wall", date: str | None = None) -> str:
    """The provenance prefix of every number ``profile measure`` writes."""
    import torch

    day = date or datetime.date.today().isoformat()
    extra = "" if clock == "wall" else f", {clock} clock"
    return f"fedelastic profile measure on {host_description()}, {day}, torch {torch.__version__}, {threads} threads{extra}"


# ----------------------------------------------------------------------------- commands


def describe_model(name: str, *, num_classes: int | None = None, input_size: int | None = None, **options: Any):
    """ModelInfo of a registry model (``model_name`` = ``name``, as RunEnvironment sets it)."""
    import torch

    from .modelinfo import describe

    model, shape = build_model(name, num_classes=num_classes, input_size=input_size, **options)
    return describe(model, torch.zeros(1, *shape), model_name=name)


def _start_device(peak: float) -> DeviceProfile:
    """A bare fp32 device to start a fit from: half the peak, 20 GB/s, 20 us per kernel."""
    from .devices import Quantity

    def q(v: float) -> Quantity:
        return Quantity(v, "fit start")

    return DeviceProfile(
        "host", "host", "sbc", "fp32", q(1.0), q(0.5 * peak), q(20e9), q(1.0), q(20e-6),
        *(q(1.0) for _ in range(7)),
    )  # fmt: skip


def measure_profile(
    model_name: str,
    out: str | Path,
    *,
    batch_size: int = 8,
    input_size: int | None = None,
    num_classes: int | None = None,
    in_channels: int | None = None,
    name: str | None = None,
    repeats: int = 10,
    warmup: int = 2,
    threads: int | None = None,
    clock: str = "wall",
    like: str | Path | None = None,
    device_class: str = "sbc",
    model_options: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[DeviceProfile, FitResult, MeasuredTable]:
    """Measure this machine on one model and write its profile to ``out`` (what ``profile measure`` does)."""
    import tomllib

    import torch

    from .devices import get_profile
    from .modelinfo import describe

    out = Path(out)
    name = name or out.stem
    if name != out.stem:
        raise ValueError(f"the profile name {name!r} must equal the file stem {out.stem!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    by = measured_by(threads, clock)
    say = progress or (lambda _msg: None)
    torch.manual_seed(0)
    model, shape = build_model(
        model_name, num_classes=num_classes, input_size=input_size, in_channels=in_channels, **(model_options or {})
    )
    sample = torch.randn(batch_size, *shape)
    info = describe(model, sample[:1], model_name=model_name)
    say(f"{model_name}: {len(info.layers)} layers, {info.num_params:,} parameters, input {tuple(sample.shape)}")
    table = measure_layers(
        model, sample, model_name=model_name, repeats=repeats, warmup=warmup, source=by, clock=clock, progress=say
    )
    say("peak FP32 throughput")
    peak = measure_peak_flops(repeats=repeats, warmup=warmup, clock=clock)
    memory = host_memory_available()
    base_raw = tomllib.loads(Path(get_profile(str(like)).path).read_text()) if like else None
    start = _start_device(peak[0])
    say("fitting the roofline")
    fit = fit_roofline([(info, table)], start, max_peak_eff=peak[0])
    raw = build_profile_dict(
        name,
        tables={model_name: table},
        fit=fit,
        peak_flops=peak,
        memory=memory,
        measured_by=by,
        device_class=device_class,
        like=base_raw,
        notes=f"Measured on {model_name} at batch {batch_size}, input {tuple(shape)}.",
    )
    say("fitting the kernel classes")
    fit_kernels_into(raw, [(info, table)], str(out), f"fitted: {by}", max_bandwidth=None)
    return write_profile(raw, out), fit, table


def import_trace_into(
    path: str | Path,
    *,
    model: str,
    batch_size: int = 4,
    profile: str | Path | None = None,
    fit: bool = False,
    input_size: int | None = None,
    num_classes: int | None = None,
    source: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[MeasuredTable, dict[str, Any], FitResult | None]:
    """Import a Chrome trace as ``[measured.<model>]``; with ``profile``, write it into that file.

    With ``fit``, the profile's roofline (efficiency, launch overhead, effective bandwidth, bounded
    by the profile's peak and datasheet bandwidth) is refitted to all its measured tables of
    registry models (each built with the factory defaults, except ``input_size`` and
    ``num_classes`` for ``model``).

    Returns
    -------
    (table, raw, fit)
        The imported table, the resulting raw profile (or ``{"measured": {model: ...}}`` without
        ``profile``), and the fit (None unless ``fit``).
    """
    import tomllib

    from .devices import load_profile
    from .models import BUILTIN
    from .trace import import_trace

    say = progress or (lambda _msg: None)
    day = datetime.date.today().isoformat()
    src = source or f"{Path(path).name}, imported by fedelastic profile import-trace on {day}"
    table = import_trace(path, model=model, batch_size=batch_size, source=src)
    say(
        f"{model}: {len(table.layers)} layers, step {table.step_s * 1e3:.1f} ms (forward {table.forward_s * 1e3:.1f}, "
        f"backward {table.backward_s * 1e3:.1f}, other {table.other_s * 1e3:.1f}) over {table.n_steps} steps"
    )
    if profile is None:
        return table, {"measured": {model: measured_table_toml(table)}}, None
    profile = Path(profile)
    raw = tomllib.loads(profile.read_text())
    set_measured_table(raw, model, table)
    parse_profile(raw, str(profile), stem=profile.stem)
    result = None
    if fit:
        device = parse_profile(raw, str(profile), stem=profile.stem)
        pairs = []
        for name, mt in device.measured.items():
            if name not in BUILTIN:
                say(f"not fitted to [measured.{name}]: not a registry model")
                continue
            kw = {"input_size": input_size, "num_classes": num_classes} if name == model else {}
            say(f"describing {name}")
            pairs.append((describe_model(name, **kw), mt))
        result = fit_to_profile(pairs, device)
        origin = "; ".join(f"{info.model_name}: {mt.source.split(' (')[0][:80]}" for info, mt in pairs)
        src = f"fitted to the measured tables ({origin}) by fedelastic profile import-trace --fit on {day}"
        apply_fit(raw, result, src)
        fit_kernels_into(raw, pairs, str(profile), src, max_bandwidth=datasheet_bandwidth(device))
    write_profile(raw, profile)
    load_profile(profile)
    return table, raw, result
