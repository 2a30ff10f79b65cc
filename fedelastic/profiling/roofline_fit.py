"""Fit a device's roofline to measured per-layer tables: one roofline for all kernels, or one per kernel class.

Single roofline
---------------
The roofline ``max(flops / (peak * efficiency), bytes / bandwidth) + launch_overhead`` has three
free numbers. They are fitted by ``scipy.optimize.least_squares`` to the per-layer ``fwd``,
``dx`` and ``dw`` times of one or more measured tables, each compared with what
:class:`~fedelastic.cost.costmodel.CostModel` itself predicts for that layer (so the fit uses exactly
the cost model's flops and bytes per kernel). The default residual is least squares in seconds
with a variance proportional to the time, ``(pred - meas) / sqrt(meas * mean)``: the kernels
that make up most of a step matter most, while the many small ones still pin the launch
overhead. The peak and bandwidth can be bounded by a datasheet (efficiency <= 1).

Kernel classes
--------------
Every layer's measured ``fwd``, ``dx`` and ``dw`` is a sum of kernels the cost model knows (its
own, the weightless and functional ops charged to it); each kernel's time is
``max(flops / P_c, bytes / B_c) / s + L_c`` with ``s = outputs / (outputs + W_c)`` for its class
``c`` (see :mod:`fedelastic.cost.costmodel`). :func:`fit_kernels` fits ``(P_c, B_c, L_c, W_c)`` of
every class by ``scipy.optimize.least_squares``. The default residual (``objective="sym"``) is
least squares in seconds with a variance proportional to the mean of the predicted and the
measured time, ``(pred - meas) / sqrt((pred + meas) / 2 * mean)``. The single roofline's residual
(``"time"``, variance proportional to the measured time: Neyman's chi-square) underestimates the
sum of the entries it is fitted to (in-sample totals 10-16% low on the TX2 traces), a known bias of
that estimator when the model cannot fit every entry; the symmetric variance removes most of it
(3-5% low). ``"log"`` (the log ratio weighted by the square root of the entry's time share)
overestimates instead. The fit starts from two saturating widths (:data:`WIDTH_STARTS`) and keeps
the optimum with the lower objective. Classes are tied to a shared *global* roofline by a weak prior (a penalty on the
log distance, ``prior_weight``): a class with kernels in the tables is fitted by them, a class
with none (e.g. depthwise kernels when no table has a depthwise conv) takes its fallback class's
values (:data:`~fedelastic.devices.profile.KERNEL_CLASSES`), or the global ones.

Uncertainty. With two or more tables, each model is left out in turn, the rest refitted, and the
left-out model's whole-step time (sum of its entries) predicted: those relative errors size the
profile's ``[uncertainty] step`` (:func:`fedelastic.cost.bands.lomo_band`). With one table nothing is
held out: the stated single-model rule applies (:data:`fedelastic.cost.bands.SINGLE_MODEL_BAND`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..cost.bands import LOMO_RULE, SINGLE_MODEL_BAND, SINGLE_MODEL_RULE, lomo_band
from ..cost.costmodel import CostModel
from ..cost.kernels import DW, DX, FWD, OPS, kernel_times
from ..devices.profile import KERNEL_CLASSES, DeviceProfile, KernelClass, Quantity
from ..devices.units import to_si
from ..modelinfo import ModelInfo

# ----------------------------------------------------------------------------- one roofline


def _roofline_device(device: DeviceProfile, peak_eff: float, bandwidth: float, launch: float) -> DeviceProfile:
    """``device`` with the given effective peak (efficiency folded in), bandwidth and launch; no tables, no kernel classes."""
    return replace(
        device,
        peak_flops=Quantity(peak_eff, "fit"),
        efficiency=Quantity(1.0, "fit"),
        mem_bandwidth_bytes_per_s=Quantity(bandwidth, "fit"),
        launch_overhead_s=Quantity(launch, "fit"),
        measured={},
        kernels={},
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
    warnings : tuple of str
        Why the fitted values deserve doubt: a value stopped at its physical bound, or a fit the
        data do not determine (ill-conditioned); empty when neither.
    """

    peak_eff: float
    mem_bandwidth: float
    launch_overhead: float
    n_points: int
    median_rel_err: float
    p90_rel_err: float
    total_rel_err: float
    models: tuple[str, ...]
    warnings: tuple[str, ...] = ()

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
        A model description and its measured table (a :class:`fedelastic.devices.profile.MeasuredTable`,
        or anything with ``batch_size`` and ``layers`` of
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
    assert best is not None
    res = best
    peak_eff, bw, launch = unpack(res.x)
    preds = predict(res.x)
    names = ["peak x efficiency"] + (["mem_bandwidth"] if fit_bandwidth else []) + ["launch_overhead"]
    doubts = [
        f"{name} stopped at its {'upper' if active > 0 else 'lower'} bound ({np.exp(x):.4g} SI)"
        for name, active, x in zip(names, res.active_mask, res.x)
        if active and not (name == "peak x efficiency" and active > 0 and max_peak_eff)  # efficiency 1 is plausible
    ]
    cond = _condition(res.jac)
    if cond > CONDITION_LIMIT:
        doubts.append(
            f"poorly conditioned fit (condition number {cond:.3g}): the measured layers barely constrain "
            "some parameter, e.g. mem_bandwidth when no layer is bandwidth-bound"
        )
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
        warnings=tuple(doubts),
    )


CONDITION_LIMIT = 1e6  # of the log-parameter Jacobian: beyond it, some fitted value is not pinned by the data


def _condition(jac) -> float:
    """Condition number of a Jacobian (inf when a column is zero: that parameter does not change the fit)."""
    jac = np.asarray(jac, dtype=float)
    if not np.all(np.linalg.norm(jac, axis=0) > 0):
        return float("inf")
    sv = np.linalg.svd(jac, compute_uv=False)
    return float(sv[0] / sv[-1]) if sv[-1] > 0 else float("inf")


def datasheet_bandwidth(device: DeviceProfile) -> float | None:
    """The profile's bandwidth before any fit (B/s), or None if a fit replaced it without saying."""
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


def _start_device(peak: float) -> DeviceProfile:
    """A bare fp32 device to start a fit from: half the peak, 20 GB/s, 20 us per kernel."""

    def q(v: float) -> Quantity:
        return Quantity(v, "fit start")

    one = q(1.0)
    return DeviceProfile(
        "host", "host", "sbc", "fp32", one, q(0.5 * peak), q(20e9), one, q(20e-6), one, one, one, one, one, one, one
    )  # fmt: skip


# ----------------------------------------------------------------------------- kernel classes

_CLASSES = list(KERNEL_CLASSES)
_N = len(_CLASSES)
_PARENT = [(_CLASSES.index(p) if p is not None else _N) for p in KERNEL_CLASSES.values()]  # _N: global


@dataclass(frozen=True)
class KernelFit:
    """Fitted per-class rooflines (SI units) and how well they fit.

    ``params[c] = (P_c FLOP/s, B_c B/s, overhead_c s, W_c elements)`` where the overhead is on
    top of the device's launch overhead. ``fitted`` lists the classes that had kernels in the
    tables; the others hold their prior. ``uncertainty`` is the relative 1-sigma step band.
    ``objective_value`` is the fit's own criterion at its optimum (lower: the tables are fitted
    better); it compares two pricings of the same tables, e.g. with and without layout copies.
    """

    params: dict[str, tuple[float, float, float, float]]
    fitted: tuple[str, ...]
    models: tuple[str, ...]
    n_points: int
    median_rel_err: float
    weighted_median_rel_err: float
    total_rel_err: float
    uncertainty: float
    uncertainty_how: str
    objective_value: float = 0.0  # half the sum of squared residuals (prior included) at the optimum


def kernel_device(device: DeviceProfile, params: dict[str, tuple[float, float, float, float]], source: str = "fit"):
    """``device`` with ``params`` as its ``[kernels]`` (no measured tables)."""
    peak = device.peak_flops.value
    kernels = {
        c: KernelClass(
            Quantity(min(p / peak, 1.0), source),
            Quantity(b, source),
            Quantity(max(o, 0.0), source),
            Quantity(w, source),
        )
        for c, (p, b, o, w) in params.items()
    }
    return replace(device, kernels=kernels, measured={})


@dataclass
class _Data:
    info: ModelInfo
    cls: np.ndarray
    flops: np.ndarray
    nbytes: np.ndarray
    outputs: np.ndarray
    entry: np.ndarray  # flat index (layer * 3 + phase) of each kernel, -1 if in no entry
    meas: np.ndarray  # flat measured entries
    ok: np.ndarray


def _data(info: ModelInfo, table: Any, device: DeviceProfile) -> _Data:
    """The kernels of ``info`` at the table's batch size, each mapped to a (layer, phase) entry."""
    placeholder = {c: (device.peak_flops.value, device.mem_bandwidth_bytes_per_s.value, 0.0, 0.0) for c in _CLASSES}
    cost = CostModel(info, kernel_device(device, placeholder), int(table.batch_size))
    nl = len(info.layers)
    layer_of = np.where(
        np.isin(cost.kernel_slot, (FWD, DX, DW)),
        info.tensor_layer[np.minimum(cost.kernel_index, info.num_tensors - 1)],
        cost.kernel_index,
    )
    phase = np.select([cost.kernel_slot == DX, cost.kernel_slot == DW], [1, 2], 0)
    entry = np.where((cost.kernel_slot == OPS) & (cost.kernel_index >= nl), -1, layer_of * 3 + phase)
    meas = np.zeros((nl, 3))
    ok = np.zeros((nl, 3), bool)
    for li, layer in enumerate(info.layers):
        row = table.layers.get(layer.name)
        if row is not None:
            meas[li] = (row.fwd_s, row.dx_s, row.dw_s)
            ok[li] = meas[li] > 1e-9
    ok[0, 1] = False  # never paid: no gradient below the input
    return _Data(
        info,
        cost.kernel_class,
        cost.kernel_flops,
        cost.kernel_bytes,
        cost.kernel_outputs,
        entry,
        meas.ravel(),
        ok.ravel(),
    )


def _predict(d: _Data, table_params: np.ndarray, launch: float) -> np.ndarray:
    p = table_params.copy()
    p[:, 2] += launch
    t = kernel_times(p, d.cls, d.flops, d.nbytes, d.outputs)
    out = np.zeros(d.meas.size)
    on = d.entry >= 0
    np.add.at(out, d.entry[on], t[on])
    return out


def _unpack(theta: np.ndarray) -> np.ndarray:
    """theta (log P, log B, log overhead, log W per class, then global) -> class params (no global)."""
    return np.exp(theta.reshape(_N + 1, 4)[:_N])


def _fit(data: list[_Data], device: DeviceProfile, max_peak: float, max_bw: float, prior_weight: float, objective: str):
    from scipy.optimize import least_squares

    launch = device.launch_overhead_s.value
    present = np.zeros(_N, bool)
    for d in data:
        used = np.unique(d.cls[(d.entry >= 0) & np.isin(d.entry, np.flatnonzero(d.ok))])
        present[used] = True
    total = sum(float(d.meas[d.ok].sum()) for d in data)
    scale = total / sum(int(d.ok.sum()) for d in data)
    lo = np.tile([np.log(1e6), np.log(1e5), np.log(1e-8), np.log(1.0)], _N + 1)
    hi = np.tile([np.log(max_peak), np.log(max_bw), np.log(1e-1), np.log(1e9)], _N + 1)
    parent = np.array(_PARENT)

    def residuals(theta):
        params = _unpack(theta)
        out = []
        for d in data:
            pred = _predict(d, params, launch)
            m = d.meas[d.ok]
            if objective == "time":  # least squares in seconds, variance taken proportional to time
                out.append((pred[d.ok] - m) / np.sqrt(m * scale))
            elif objective == "sym":  # variance proportional to the mean of predicted and measured time
                out.append((pred[d.ok] - m) / np.sqrt(0.5 * (pred[d.ok] + m) * scale))
            else:  # log ratio weighted by the square root of the entry's time share
                out.append(np.log(pred[d.ok] / m) * np.sqrt(m / scale))
        t = theta.reshape(_N + 1, 4)
        out.append(np.sqrt(prior_weight) * (t[:_N] - t[parent]).ravel())
        return np.concatenate(out)

    # the saturating width barely moves the cost while it is far below the kernels' outputs, so the
    # fit starts from two widths, WIDTH_STARTS, and keeps the lower objective (an in-sample choice)
    best = None
    for width in WIDTH_STARTS:
        x0 = np.tile([np.log(0.3 * max_peak), np.log(0.3 * max_bw), np.log(1e-6), np.log(width)], _N + 1)
        res = least_squares(residuals, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale=1.0, diff_step=1e-5, max_nfev=3000)
        if best is None or res.cost < best.cost:
            best = res
    assert best is not None
    return _unpack(best.x), present, float(best.cost)


#: Starting widths (output elements) of the kernel fit: no saturation in practice, and saturation
#: over a mid-size kernel (1e5 outputs: a 7x7x512 map at batch 4, a 197x768 token matrix at batch 1).
WIDTH_STARTS = (1e2, 1e5)


#: Residuals :func:`fit_kernels` can minimise.
KERNEL_OBJECTIVES = ("sym", "time", "log")


def fit_kernels(
    pairs: Sequence[tuple[ModelInfo, Any]],
    device: DeviceProfile,
    *,
    max_peak: float | None = None,
    max_bandwidth: float | None = None,
    prior_weight: float = 0.01,
    objective: str = "sym",
    leave_one_out: bool = True,
) -> KernelFit:
    """Fit every kernel class's roofline to measured tables (see the module docstring).

    Parameters
    ----------
    pairs : sequence of (ModelInfo, table)
        Model descriptions and their measured tables (anything with ``batch_size`` and ``layers``
        of ``fwd_s``/``dx_s``/``dw_s``); a model may appear with several tables (batch sizes).
    device : DeviceProfile
        Supplies the dtype, peak, bandwidth and launch overhead the classes are relative to.
    max_peak, max_bandwidth : float, optional
        Upper bounds of ``P_c`` and ``B_c`` (default: the device's peak and bandwidth; pass the
        datasheet bandwidth when the profile's is an effective, fitted one).
    prior_weight : float
        Weight of the pull of each class toward its fallback (log distance).
    objective : str
        ``sym`` (default), ``time`` or ``log``: the residual (see the module docstring).
    leave_one_out : bool
        Compute the uncertainty by refitting without each model (when there are two or more).
    """
    if not pairs:
        raise ValueError("fit_kernels needs at least one (ModelInfo, table) pair")
    if objective not in KERNEL_OBJECTIVES:
        raise ValueError(f"objective must be one of {KERNEL_OBJECTIVES}, got {objective!r}")
    max_peak = max_peak or device.peak_flops.value
    max_bw = max_bandwidth or device.mem_bandwidth_bytes_per_s.value
    data = [_data(info, table, device) for info, table in pairs]
    data = [d for d in data if d.ok.any()]
    if not data:
        raise ValueError("the measured tables share no layer with the models")
    params, present, cost = _fit(data, device, max_peak, max_bw, prior_weight, objective)
    launch = device.launch_overhead_s.value
    preds = [_predict(d, params, launch) for d in data]
    rel = np.concatenate([p[d.ok] / d.meas[d.ok] - 1 for p, d in zip(preds, data)])
    weights = np.concatenate([d.meas[d.ok] for d in data])
    total = float(weights.sum())
    pred_total = sum(float(p[d.ok].sum()) for p, d in zip(preds, data))
    models = tuple(dict.fromkeys(d.info.model_name for d in data))
    if not leave_one_out:  # asked not to hold out (benchmarks): the in-sample residual, not a held-out band
        uncertainty = float(np.sqrt(np.sum(weights * rel**2) / total))
        how = "time-weighted RMS of the in-sample per-layer residuals (leave_one_out=False: not a held-out band)"
    elif len(models) >= 2:
        errs = []
        for held in models:
            rest = [d for d in data if d.info.model_name != held]
            p_rest, _, _ = _fit(rest, device, max_peak, max_bw, prior_weight, objective)
            for d in data:
                if d.info.model_name == held:
                    errs.append(float(_predict(d, p_rest, launch)[d.ok].sum() / d.meas[d.ok].sum() - 1))
        uncertainty = lomo_band(errs, df=len(models))  # a model's tables (batch sizes) are not independent
        how = f"{LOMO_RULE}; errors over {', '.join(models)}: " + ", ".join(f"{e:+.1%}" for e in errs)
    else:
        uncertainty, how = SINGLE_MODEL_BAND, SINGLE_MODEL_RULE
    order = np.argsort(np.abs(rel))
    cum = np.cumsum(weights[order]) / total
    return KernelFit(
        params={c: tuple(float(v) for v in params[i]) for i, c in enumerate(_CLASSES)},  # type: ignore[misc]
        fitted=tuple(c for i, c in enumerate(_CLASSES) if present[i]),
        models=models,
        n_points=int(rel.size),
        median_rel_err=float(np.median(np.abs(rel))),
        weighted_median_rel_err=float(np.abs(rel)[order][np.searchsorted(cum, 0.5)]),
        total_rel_err=pred_total / total - 1,
        uncertainty=uncertainty,
        uncertainty_how=how,
        objective_value=cost,
    )


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def kernels_toml(fit: KernelFit, device: DeviceProfile, source: str) -> dict[str, Any]:
    """``[kernels]`` and ``[uncertainty]`` tables (TOML-ready) of a fit, relative to ``device``."""
    peak = device.peak_flops.value
    models = ", ".join(fit.models)
    kernels = {}
    for c, (p, b, o, w) in fit.params.items():
        src = (
            f"{source} ({models})"
            if c in fit.fitted
            else f"{source}: no {c} kernels in the tables ({models}), the prior"
        )
        kernels[c] = {
            "efficiency": {"value": _sig(min(p / peak, 1.0)), "unit": "1", "source": src},
            "bandwidth": {"value": _sig(b / 1e9), "unit": "GB/s", "source": src},
            "overhead": {"value": _sig(o * 1e6), "unit": "us", "source": src},
            "width": {"value": _sig(w), "unit": "elements", "source": src},
        }
    band = {"step": {"value": _sig(fit.uncertainty, 3), "unit": "1", "source": f"{source}: {fit.uncertainty_how}"}}
    return {"kernels": kernels, "uncertainty": band}
