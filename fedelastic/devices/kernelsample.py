"""Kernel sampling: time the kernels training runs on this device, fit one predictor per kernel class.

``fedelastic profile measure`` (by default) times, in place, sampled configurations of every
kernel class a training step runs (:data:`CLASSES`): dense, grouped and depthwise convolutions
across kernel size, stride, channels and spatial size; linear layers; batch and layer norms;
activations; pooling; residual adds and concatenations; attention's matrix products and softmax;
and the optimizer update. Each is timed as the per-layer tables of :mod:`fedelastic.profiling.measure`
count it:

- ``fwd``: the forward without autograd (eval mode);
- ``dx``: the input gradient with the parameters frozen, plus what autograd adds to the forward
  (forward with gradients minus without);
- ``dw``: the parameter gradients with the input not requiring grad; for a batch norm also what
  training mode (batch statistics) adds to its forward and backward.

Per class and phase, the predictor forms are fitted and the one with the lower error on held-out
configurations (k-fold cross-validation) is kept (:func:`fit_predictors`):

- ``affine``: ``t = c0 + sum_i c_i f_i`` over the class's size features (FLOPs, elements in and
  out, weights...), non-negative least squares in relative error;
- ``loglinear``: ``log t = c0 + sum_i c_i log f_i`` over all its features (size and shape: kernel
  area, stride, channels per group), least squares in log time; ``logquad`` adds the squares of
  the logs of the size features;
- ``spill``: the affine form plus ``s1 max(e - k1, 0) + s2 max(e - k2, 0)``, ``e`` the elements the
  kernel touches (input, output, weights; an optimizer update's elements): what each element costs
  beyond two cache levels, the knees ``k1 < k2`` chosen from :data:`KNEES` (a large layer that
  streams its weights from memory runs at a fraction of the rate of the small ones that fill the
  samples, which one affine law averages away).

:func:`predicted_table` prices every layer of a model from them, in the shape of a measured
table; :class:`fedelastic.cost.costmodel.CostModel` uses it for a model the profile has no measured
table of. Pure numpy, except the sampling itself (:func:`sample_kernels`, torch).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..modelinfo import ModelInfo

#: class -> (its phases, its features; the size features the affine form sums come first, then
#: shape features the log-linear form also uses)
CLASSES: dict[str, tuple[tuple[str, ...], tuple[str, ...], int]] = {
    "conv": (("fwd", "dx", "dw"), ("flops", "in", "out", "weights", "kernel", "stride", "depth"), 4),
    "conv_grouped": (("fwd", "dx", "dw"), ("flops", "in", "out", "weights", "kernel", "stride", "depth"), 4),
    "conv_depthwise": (("fwd", "dx", "dw"), ("flops", "in", "out", "weights", "kernel", "stride"), 4),
    "linear": (("fwd", "dx", "dw"), ("flops", "in", "out", "weights", "rows"), 4),
    "batchnorm": (("fwd", "dx", "dw"), ("in", "channels"), 2),
    "layernorm": (("fwd", "dx", "dw"), ("in", "channels"), 2),
    "relu": (("fwd", "dx"), ("in",), 1),  # activations whose backward needs a mask (ReLU, dropout...)
    "act": (("fwd", "dx"), ("in",), 1),  # other activations (GELU, Hardswish, SiLU, Sigmoid...)
    "maxpool": (("fwd", "dx"), ("in", "out"), 2),
    "avgpool": (("fwd", "dx"), ("in", "out"), 2),
    "add": (("fwd", "dx"), ("in", "out"), 2),  # binary element-wise (residual adds, SE scaling)
    "cat": (("fwd", "dx"), ("in",), 1),
    "matmul": (("fwd", "dx"), ("flops", "in", "out"), 3),
    "softmax": (("fwd", "dx"), ("in",), 1),
    "optimizer": (("step",), ("tensors", "elements"), 2),  # SGD with momentum, one foreach update
}
FORMS = ("affine", "loglinear", "logquad", "spill")
#: elements a kernel touches (the sum of its ``in``, ``out`` and ``weights`` features; an optimizer
#: update's ``elements``) beyond which the ``spill`` form adds a per-element term, one for each of
#: two knees (two cache levels): the candidate knees, in float32 elements (128 KiB to 64 MiB)
KNEES = tuple(2.0**e for e in range(15, 25))
_TOUCHED = ("in", "out", "weights", "elements")
_MASK_OPS = {"ReLU", "ReLU6", "LeakyReLU", "Hardtanh", "Dropout", "Dropout2d", "Identity", "Flatten"}
_FREE_OPS = {"Identity", "Flatten"}  # views: no kernel
_BINARY = {"add", "sub", "mul", "div", "truediv"}


@dataclass(frozen=True)
class Predictor:
    """One kernel class's predictor of one phase: its form, coefficients and held-out error."""

    form: str
    coef: tuple[float, ...]
    cv_error: float  # median |relative error| on held-out configurations
    n: int  # configurations it was fitted to

    def predict(self, cls: str, feats: np.ndarray) -> np.ndarray:
        """Seconds for rows of raw features (``feats[:, i]``: :data:`CLASSES` ``[cls]`` features)."""
        return _evaluate(self.form, np.asarray(self.coef), cls, np.atleast_2d(feats))


def _design(form: str, cls: str, feats: np.ndarray, knees: tuple[float, float] = (0.0, 0.0)) -> np.ndarray:
    names, n_size = CLASSES[cls][1], CLASSES[cls][2]
    one = np.ones((feats.shape[0], 1))
    if form == "affine":
        return np.hstack([one, feats[:, :n_size]])
    if form == "spill":  # affine, plus the elements touched beyond each of two caches (``knees``)
        touched = sum((feats[:, i] for i, n in enumerate(names) if n in _TOUCHED), np.zeros(feats.shape[0]))
        beyond = [np.maximum(touched - k, 0.0)[:, None] for k in knees]
        return np.hstack([one, feats[:, :n_size], *beyond])
    logs = np.log(np.maximum(feats, 1e-9))
    if form == "loglinear":
        return np.hstack([one, logs])
    return np.hstack([one, logs, logs[:, :n_size] ** 2])  # logquad: curvature in the size features


def _evaluate(form: str, coef: np.ndarray, cls: str, feats: np.ndarray) -> np.ndarray:
    if form == "spill":  # coef: the two knees, then the affine coefficients and the two spill terms'
        return _design(form, cls, feats, (coef[0], coef[1])) @ coef[2:]
    x = _design(form, cls, feats)
    return x @ coef if form == "affine" else np.exp(x @ coef)


def _nnls_relative(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Non-negative least squares in relative error (each row divided by its time)."""
    from scipy.optimize import nnls

    scale = np.abs(x).max(axis=0) + 1e-30
    coef, _ = nnls(x / scale / t[:, None], np.ones_like(t))
    return coef / scale


def _fit_form(form: str, cls: str, feats: np.ndarray, t: np.ndarray) -> np.ndarray:
    if form == "spill":  # the pair of :data:`KNEES` whose fit has the lowest mean |log error|
        best = None
        for knees in ((a, b) for a in KNEES for b in KNEES if a < b):
            x = _design(form, cls, feats, knees)
            coef = _nnls_relative(x, t)
            err = float(np.mean(np.abs(np.log(np.maximum(x @ coef, 1e-12) / t))))
            if best is None or err < best[0]:
                best = (err, np.r_[knees, coef])
        assert best is not None
        return best[1]
    x = _design(form, cls, feats)
    if form == "affine":
        return _nnls_relative(x, t)
    coef, *_ = np.linalg.lstsq(x, np.log(t), rcond=None)
    return coef


def _forms(cls: str) -> tuple[str, ...]:
    """The forms fitted to ``cls``: ``spill`` only where a class has a feature of elements touched."""
    touches = any(n in _TOUCHED for n in CLASSES[cls][1][: CLASSES[cls][2]])
    if cls == "optimizer":  # the update splits over tensors only if linear in their sizes
        return ("affine", "spill")
    return FORMS if touches else tuple(f for f in FORMS if f != "spill")


def fit_predictor(cls: str, feats: np.ndarray, t: np.ndarray, folds: int = 5, seed: int = 0) -> Predictor:
    """The form (:data:`FORMS`) with the lowest k-fold held-out error, refitted on every sample.

    The error compared is the mean |log(predicted / measured)| of the held-out configurations;
    ``cv_error`` reports their median |relative error|.
    """
    feats, t = np.asarray(feats, float), np.asarray(t, float)
    keep = t > 0
    feats, t = feats[keep], t[keep]
    if t.size < 3:
        raise ValueError(f"kernel class {cls!r}: {t.size} timed configurations, at least 3 are needed")
    order = np.random.default_rng(seed).permutation(t.size)
    k = min(folds, t.size)
    best: tuple[float, str, float] | None = None
    for form in _forms(cls):
        pred = np.zeros_like(t)
        for f in range(k):
            test = order[f::k]
            train = np.setdiff1d(order, test)
            pred[test] = _evaluate(form, _fit_form(form, cls, feats[train], t[train]), cls, feats[test])
        log_err = np.abs(np.log(np.maximum(pred, 1e-12) / t))
        score = (float(log_err.mean()), form, float(np.median(np.abs(pred / t - 1))))
        if best is None or score[0] < best[0]:
            best = score
    assert best is not None
    coef = _fit_form(best[1], cls, feats, t)
    return Predictor(best[1], tuple(float(c) for c in coef), best[2], int(t.size))


def fit_predictors(samples: dict[str, list[tuple[np.ndarray, dict[str, float]]]]) -> dict[str, dict[str, Predictor]]:
    """Per class and phase, :func:`fit_predictor` on the samples ``{class: [(features, {phase: s})]}``."""
    out: dict[str, dict[str, Predictor]] = {}
    for cls, rows in samples.items():
        if len(rows) < 3:
            continue
        feats = np.array([r[0] for r in rows], float)
        out[cls] = {ph: fit_predictor(cls, feats, np.array([r[1][ph] for r in rows])) for ph in CLASSES[cls][0]}
    return out


# ----------------------------------------------------------------------------- pricing a model


def _conv_class(groups: int, cin: int) -> str:
    return "conv" if groups <= 1 else "conv_depthwise" if groups == cin else "conv_grouped"


def conv_features(b: float, cin: int, cout: int, kernel: int, stride: int, groups: int, in_numel: float,
                  out_numel: float) -> np.ndarray:  # fmt: skip
    """Features of a convolution at batch ``b`` (numels per sample), in :data:`CLASSES` order."""
    depth = cin / groups * kernel  # MACs per output element
    feats = [2 * b * out_numel * depth, b * in_numel, b * out_numel, cout * depth, kernel, stride]
    return np.array(feats if groups == cin and groups > 1 else [*feats, cin / groups], float)


def layer_kernel(info: ModelInfo, li: int, b: float) -> tuple[str, np.ndarray] | None:
    """(class, features) of layer ``li`` at batch ``b``; None when no class fits it (or no geometry)."""
    layer = info.layers[li]
    weights = float(sum(info.tensor_numel[k] for k in layer.tensors if info.tensor_roles[k] == "weight"))
    if layer.kind == "conv" and layer.kernel and layer.in_channels:
        cls = _conv_class(layer.groups, layer.in_channels)
        f = conv_features(b, layer.in_channels, layer.out_channels, layer.kernel, max(layer.stride, 1),
                          layer.groups, layer.in_numel, layer.out_numel)  # fmt: skip
        return cls, f
    if layer.kind == "linear" and layer.in_channels:
        rows = b * layer.in_numel / layer.in_channels
        return "linear", np.array([2 * b * layer.macs, b * layer.in_numel, b * layer.out_numel, weights, rows])
    if layer.kind == "norm" and layer.in_channels:
        return ("batchnorm" if layer.batch_stats else "layernorm"), np.array([b * layer.in_numel, layer.in_channels])
    return None


def _op_kernel(module: str, b: float, in_numel: float, out_numel: float) -> tuple[str, np.ndarray] | None:
    if not module or module in _FREE_OPS:
        return None
    if module in _MASK_OPS:
        return "relu", np.array([b * in_numel])
    if "MaxPool" in module:
        return "maxpool", np.array([b * in_numel, b * out_numel])
    if "AvgPool" in module:
        return "avgpool", np.array([b * in_numel, b * out_numel])
    if "Softmax" in module:
        return "softmax", np.array([b * in_numel])
    return "act", np.array([b * in_numel])


def _functional_kernel(name: str, kind: str, b: float, macs: float, in_numel: float, out_numel: float):
    base = name.split("#")[0].strip("_").lstrip("ri")
    if kind == "matmul":
        return "matmul", np.array([2 * b * macs, b * in_numel, b * out_numel])
    if kind == "softmax":
        return "softmax", np.array([b * in_numel])
    if kind == "layout":
        return "cat", np.array([b * out_numel])
    if base in _BINARY:
        return "add", np.array([b * out_numel, b * out_numel])
    if base in ("mean", "sum", "amax"):
        return "avgpool", np.array([b * in_numel, b * out_numel])
    return "act", np.array([b * out_numel])


def predicted_layers(
    predictors: dict[str, dict[str, Predictor]], info: ModelInfo, batch_size: int
) -> tuple[dict[str, tuple[float, float, float]], float]:
    """Per layer (by name) ``(fwd, dx, dw)`` seconds predicted as a measured table counts them, and
    the forward of the ops after the last layer. A layer is left out when its own kernel has no
    predictor; an op or functional op without one adds nothing."""
    b = float(batch_size)
    nl = len(info.layers)
    extra = np.zeros((nl + 1, 2))  # fwd, dx of the ops charged to each layer (last: after the last layer)

    def price(kernel, at: int) -> None:
        if kernel is None or kernel[0] not in predictors:
            return
        cls, f = kernel
        extra[at] += [predictors[cls][ph].predict(cls, f)[0] for ph in ("fwd", "dx")]

    for op in info.ops:
        price(_op_kernel(op.module, b, op.in_numel, op.out_numel), op.above)
    for fn in info.functional:
        price(_functional_kernel(fn.name, fn.kind, b, fn.macs, fn.in_numel, fn.out_numel), fn.above)
    cal = predictors.get("calibration", {"fwd": (1.0, 0.0), "bwd": (1.0, 0.0)})
    out = {}
    for li, layer in enumerate(info.layers):
        kernel = layer_kernel(info, li, b)
        if kernel is None or kernel[0] not in predictors:
            continue
        cls, f = kernel
        fwd, dx, dw = (predictors[cls][ph].predict(cls, f)[0] for ph in ("fwd", "dx", "dw"))
        if not any(info.tensor_roles[k] == "weight" for k in layer.tensors) and layer.kind != "norm":
            dw = 0.0
        out[layer.name] = calibrated(cal, fwd + extra[li, 0], dx + extra[li, 1], dw)
    return out, float(extra[nl, 0])


def calibrated(cal: dict[str, tuple[float, float]], fwd: float, dx: float, dw: float) -> tuple[float, float, float]:
    """A layer's kernels timed alone, as its step pays them: ``scale * t + seconds`` for the forward
    and for the backward (dX + dW, split as predicted)."""
    (sf, cf), (sb, cb) = cal["fwd"], cal["bwd"]
    bwd = dx + dw
    share = dx / bwd if bwd > 0 else 0.5
    total = sb * bwd + cb
    return sf * fwd + cf, total * share, total * (1 - share)


def fit_calibration(
    pred: np.ndarray, meas: np.ndarray, weight: np.ndarray | None = None
) -> dict[str, tuple[float, float]]:
    """``{fwd, bwd: (scale, seconds)}`` that map layers' predicted ``[fwd, dx, dw]`` rows (kernels
    timed alone) to their measured rows (the same layers inside a model's step): non-negative
    least squares in seconds, each row times ``weight`` (:func:`fedelastic.profiling.commands.calibrate`
    passes 1 / its model's measured forward, so that every tuning model counts alike and, within
    one, the large layers, which carry its step, set the fit).

    Only the forward is calibrated; the backward keeps ``(1, 0)``. Both choices were made on the
    tuning models alone, and are within the noise of their tables (``benchmarks/studies/fidelity.md``)."""
    from scipy.optimize import nnls

    w = np.ones(len(pred)) if weight is None else np.asarray(weight, float)
    ok = meas[:, 0] > 0
    x = np.column_stack([pred[ok, 0], np.ones(ok.sum())]) * w[ok, None]
    coef, _ = nnls(x, meas[ok, 0] * w[ok])
    return {"fwd": (float(coef[0]), float(coef[1])), "bwd": (1.0, 0.0)}


def optimizer_seconds(
    predictors: dict[str, dict[str, Predictor]], numel: np.ndarray
) -> tuple[np.ndarray, float] | None:
    """Per tensor, its share of one optimizer update of every tensor (the predictor's per-tensor
    and per-element terms; a ``spill`` form's term for the elements beyond its knee is shared in
    proportion to the tensors' sizes), and the update's constant; None without an optimizer predictor."""
    p = predictors.get("optimizer", {}).get("step")
    if p is None:
        return None
    numel = np.asarray(numel, float)
    if p.form == "spill":
        k1, k2, c0, per_tensor, per_element, s1, s2 = p.coef
        total = float(numel.sum())
        per_element += (s1 * max(total - k1, 0.0) + s2 * max(total - k2, 0.0)) / max(total, 1.0)
    else:
        c0, per_tensor, per_element = p.coef
    return per_tensor + per_element * numel, c0


# ----------------------------------------------------------------------------- TOML


def predictors_toml(predictors: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``[sampled]`` table of a profile."""
    out: dict[str, Any] = {"source": source}
    if "calibration" in predictors:
        out["calibration"] = {k: [float(f"{x:.4g}") for x in v] for k, v in predictors["calibration"].items()}
    for cls, phases in predictors.items():
        if cls == "calibration":
            continue
        out[cls] = {
            ph: {
                "form": p.form,
                "coef": [float(f"{c:.6g}") for c in p.coef],
                "cv_error": round(p.cv_error, 4),
                "n": p.n,
            }
            for ph, p in phases.items()
        }
    return out


def parse_sampled(src: str, raw: Any) -> dict[str, dict[str, Predictor]]:
    """Validate a profile's ``[sampled]`` table (errors name the file and the key)."""
    from ..errors import ConfigError

    if not isinstance(raw, dict):
        raise ConfigError(src, "sampled", "a table of [sampled.<class>] tables", raw)
    out: dict[str, dict[str, Predictor]] = {}
    for cls, phases in raw.items():
        if cls in ("source", "calibration"):
            continue
        where = f"sampled.{cls}"
        if cls not in CLASSES:
            raise ConfigError(src, where, f"a sampled kernel class, one of {list(CLASSES)}", cls)
        want, names, n_size = CLASSES[cls]
        if not isinstance(phases, dict) or set(phases) != set(want):
            raise ConfigError(src, where, f"a table with exactly the phases {list(want)}", phases)
        out[cls] = {}
        for ph, p in phases.items():
            key = f"{where}.{ph}"
            if not isinstance(p, dict) or p.get("form") not in FORMS:
                raise ConfigError(
                    src, f"{key}.form", f"one of {list(FORMS)}", p.get("form") if isinstance(p, dict) else p
                )
            size = 1 + {"affine": n_size, "loglinear": len(names), "logquad": len(names) + n_size,
                        "spill": n_size + 4}[p["form"]]  # fmt: skip
            coef = p.get("coef")
            if not isinstance(coef, list) or len(coef) != size or not all(_finite(c) for c in coef):
                raise ConfigError(src, f"{key}.coef", f"{size} finite numbers ({p['form']} over {list(names)})", coef)
            err, n = p.get("cv_error", 0.0), p.get("n", 0)
            if not _finite(err) or err < 0 or not isinstance(n, int) or n < 0:
                raise ConfigError(src, key, "cv_error >= 0 and n, a count", {"cv_error": err, "n": n})
            out[cls][ph] = Predictor(p["form"], tuple(float(c) for c in coef), float(err), n)
    out["calibration"] = _calibration(src, raw.get("calibration", {"fwd": [1.0, 0.0], "bwd": [1.0, 0.0]}))
    return out


def _calibration(src: str, raw: Any) -> dict[str, tuple[float, float]]:
    from ..errors import ConfigError

    ok = isinstance(raw, dict) and set(raw) == {"fwd", "bwd"}
    ok = ok and all(isinstance(v, list) and len(v) == 2 and all(_finite(x) and x >= 0 for x in v) for v in raw.values())
    if not ok:
        raise ConfigError(
            src, "sampled.calibration", "{ fwd = [scale, seconds], bwd = [scale, seconds] }, all >= 0", raw
        )
    return {k: (float(v[0]), float(v[1])) for k, v in raw.items()}


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and bool(np.isfinite(v))


# ----------------------------------------------------------------------------- sampling (torch)

#: relative number of configurations drawn per class
WEIGHTS = {
    "conv": 6, "conv_grouped": 3, "conv_depthwise": 4, "linear": 4, "batchnorm": 2, "layernorm": 1, "relu": 1,
    "act": 2, "maxpool": 1, "avgpool": 1, "add": 1, "cat": 1, "matmul": 2, "softmax": 1, "optimizer": 1,
}  # fmt: skip


def _loguni(rng: np.random.Generator, lo: float, hi: float) -> int:
    return int(round(np.exp(rng.uniform(np.log(lo), np.log(hi)))))


#: share of channel counts drawn as multiples of 8, as networks use them (the rest: any integer)
ALIGNED = 0.85


def _channels(rng: np.random.Generator, lo: float, hi: float) -> int:
    """A channel count, log-uniform in [lo, hi]; with probability :data:`ALIGNED` a multiple of 8.

    Library kernels (oneDNN, cuDNN) block channels by 8 or 16, so an aligned count runs at a
    different rate than its neighbours; real models almost always use aligned counts."""
    c = _loguni(rng, lo, hi)
    return max(8, 8 * round(c / 8)) if rng.random() < ALIGNED else c


def draw_config(cls: str, rng: np.random.Generator, batch: int) -> dict[str, Any]:
    """A random configuration of ``cls``, spread over the sizes small-input CNNs and transformers use."""
    size = int(rng.choice([2, 4, 7, 8, 14, 16, 28, 32, 56, 64]))
    b = int(rng.choice([max(batch // 2, 1), batch, batch, 2 * batch]))
    if cls.startswith("conv"):
        stride = int(rng.choice([1, 1, 1, 2]))
        if cls == "conv":
            k = int(rng.choice([1, 1, 1, 3, 3, 3, 5, 7]))
            cin = 3 if rng.random() < 0.05 else _channels(rng, 8, 1024)  # 3: an image's first layer
            cout, groups = _channels(rng, 8, 1024), 1
        elif cls == "conv_depthwise":
            k = int(rng.choice([3, 3, 5, 7]))
            cin = cout = groups = _channels(rng, 8, 1024)
        else:
            k = int(rng.choice([1, 3, 3, 3]))
            width = int(rng.choice([2, 4, 8, 16, 24, 32, 48, 64]))
            groups = int(max(2, _loguni(rng, 2, 64)))
            cin = cout = width * groups
        while 2 * b * cout * (size / stride) ** 2 * cin / groups * k * k > 1.5e9 and size > 2:
            size //= 2  # keep one kernel below ~1.5 GFLOP
        return {"b": b, "cin": cin, "cout": cout, "k": k, "stride": stride, "groups": groups, "size": size}
    if cls == "linear":
        rows = b * int(rng.choice([1, 1, 1, 16, 49, 64]))
        fin, fout = _channels(rng, 16, 4096), _channels(rng, 8, 4096)
        if rng.random() < 0.08:
            fin = int(rng.choice([9216, 25088]))  # the wide classifiers of VGG / AlexNet
        while 2 * rows * fin * fout > 4e9 and rows > 1:
            rows //= 2
        return {"rows": rows, "fin": fin, "fout": fout}
    if cls == "matmul":
        return {"batch": b * int(rng.choice([1, 3, 4, 8, 12])), "m": _loguni(rng, 4, 256),
                "k": _loguni(rng, 8, 256), "n": _loguni(rng, 4, 256)}  # fmt: skip
    if cls == "layernorm" or cls == "softmax":
        return {"rows": b * _loguni(rng, 1, 256), "dim": _loguni(rng, 16, 1024)}
    if cls == "optimizer":
        return {"tensors": _loguni(rng, 1, 300), "elements": _loguni(rng, 1e3, 1.2e8)}
    channels = _channels(rng, 8, 1024)
    while b * channels * size * size > 4e6 and size > 2:
        size //= 2
    return {"b": b, "c": channels, "size": size, "kind": int(rng.integers(0, 5))}


def _build(cls: str, cfg: dict[str, Any]):
    """(module or callable, input(s), features) of one configuration."""
    import torch
    from torch import nn

    if cls.startswith("conv"):
        mod = nn.Conv2d(cfg["cin"], cfg["cout"], cfg["k"], cfg["stride"], cfg["k"] // 2, groups=cfg["groups"])
        x = torch.randn(cfg["b"], cfg["cin"], cfg["size"], cfg["size"])
        out = mod(x).shape
        f = conv_features(1.0, cfg["cin"], cfg["cout"], cfg["k"] ** 2, cfg["stride"] ** 2, cfg["groups"],
                          x.numel(), float(np.prod(out)))  # fmt: skip
        return mod, (x,), f
    if cls == "linear":
        mod = nn.Linear(cfg["fin"], cfg["fout"])
        x = torch.randn(cfg["rows"], cfg["fin"])
        r, i, o = cfg["rows"], cfg["fin"], cfg["fout"]
        return mod, (x,), np.array([2.0 * r * i * o, r * i, r * o, i * o, r])
    if cls == "matmul":
        a, b = torch.randn(cfg["batch"], cfg["m"], cfg["k"]), torch.randn(cfg["batch"], cfg["k"], cfg["n"])
        bt, m, k, n = cfg["batch"], cfg["m"], cfg["k"], cfg["n"]
        return torch.bmm, (a, b), np.array([2.0 * bt * m * k * n, bt * (m * k + k * n), bt * m * n])
    if cls in ("layernorm", "softmax"):
        x = torch.randn(cfg["rows"], cfg["dim"])
        if cls == "layernorm":
            return nn.LayerNorm(cfg["dim"]), (x,), np.array([x.numel(), cfg["dim"]], float)
        return nn.Softmax(dim=-1), (x,), np.array([float(x.numel())])
    x = torch.randn(cfg["b"], cfg["c"], cfg["size"], cfg["size"])
    n = float(x.numel())
    if cls == "batchnorm":
        return nn.BatchNorm2d(cfg["c"]), (x,), np.array([n, cfg["c"]])
    if cls == "relu":
        return nn.ReLU(), (x,), np.array([n])
    if cls == "act":
        mod = [nn.GELU(), nn.Hardswish(), nn.SiLU(), nn.Sigmoid(), nn.Hardsigmoid()][cfg["kind"]]
        return mod, (x,), np.array([n])
    if cls == "maxpool":
        mod = nn.MaxPool2d(3 if cfg["kind"] % 2 else 2, 2, 1 if cfg["kind"] % 2 else 0)
        return mod, (x,), np.array([n, float(mod(x).numel())])
    if cls == "avgpool":
        mod = nn.AdaptiveAvgPool2d(1) if cfg["kind"] < 3 else nn.AvgPool2d(2)
        return mod, (x,), np.array([n, float(mod(x).numel())])
    if cls == "add":
        if cfg["kind"] < 2:  # squeeze-excite scaling: broadcast over the spatial dimensions
            return torch.mul, (x, torch.randn(cfg["b"], cfg["c"], 1, 1)), np.array([n, n])
        return torch.add, (x, torch.randn_like(x)), np.array([n, n])
    if cls == "cat":
        return (lambda a, b: torch.cat([a, b], 1)), (x, torch.randn_like(x)), np.array([2 * n])
    raise ValueError(f"unknown kernel class {cls!r}")


def time_config(
    cls: str,
    cfg: dict[str, Any],
    clock: Callable[[], float],
    repeats: int = 5,
    warmup: int = 1,
    device: str = "cpu",
    flush: Callable[[], Any] | None = None,
):
    """(features, {phase: seconds}) of one configuration on ``device``, timed as the module docstring
    says; ``flush`` (untimed) runs before every timed call (:func:`cache_flush`)."""
    import torch

    from .clocks import _median_time as _timed

    def _median_time(fn, repeats, warmup, clock):
        return _timed(fn, repeats, warmup, clock, flush)

    if cls == "optimizer":
        sizes = np.full(cfg["tensors"], max(cfg["elements"] // cfg["tensors"], 1))
        params = [torch.nn.Parameter(torch.randn(int(s), device=device)) for s in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.SGD(params, lr=1e-12, momentum=0.9)
        t = _median_time(opt.step, repeats, warmup + 1, clock)  # the first step allocates the momentum
        return np.array([float(len(sizes)), float(sizes.sum())]), {"step": t}
    fn, inputs, feats = _build(cls, cfg)
    inputs = tuple(x.to(device) for x in inputs)
    if isinstance(fn, torch.nn.Module):
        fn.to(device)
    params = list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []
    if isinstance(fn, torch.nn.Module):
        fn.eval()
    with torch.no_grad():
        fwd = _median_time(lambda: fn(*inputs), repeats, warmup, clock)
    grad_in = [x.detach().requires_grad_(True) for x in inputs]
    for p in params:
        p.requires_grad_(False)
    fwd_grad = _median_time(lambda: fn(*grad_in), repeats, warmup, clock)
    y = fn(*grad_in)
    dy = torch.randn_like(y)
    dx = _median_time(lambda: torch.autograd.grad(y, grad_in, dy, retain_graph=True), repeats, warmup, clock)
    times = {"fwd": fwd, "dx": dx + max(fwd_grad - fwd, 0.0)}
    if "dw" in CLASSES[cls][0]:
        for p in params:
            p.requires_grad_(True)
        y = fn(*inputs)
        times["dw"] = _median_time(
            lambda: torch.autograd.grad(y, params, dy, retain_graph=True), repeats, warmup, clock
        )
        if cls == "batchnorm":  # training mode's batch statistics: paid only when the norm trains
            fn.train()
            grad_all = [*grad_in, *params]
            fwd_train = _median_time(lambda: fn(*grad_in), repeats, warmup, clock)
            y = fn(*grad_in)
            bwd_train = _median_time(
                lambda: torch.autograd.grad(y, grad_all, dy, retain_graph=True), repeats, warmup, clock
            )
            y = fn.eval()(*grad_in)
            bwd_eval = _median_time(
                lambda: torch.autograd.grad(y, grad_all, dy, retain_graph=True), repeats, warmup, clock
            )
            times["dw"] += max(fwd_train - fwd_grad, 0.0) + max(bwd_train - bwd_eval, 0.0)
    return feats, times


def cache_flush(mib: float) -> Callable[[], Any]:
    """A ``flush`` for :func:`time_config`: adds 1 to every element of a ``mib`` MiB buffer, which
    evicts what the last timed call left in caches smaller than it (a layer in a model finds its
    weights evicted by the rest of the step)."""
    import torch

    buffer = torch.zeros(max(int(mib * 2**20) // 4, 1))
    return lambda: buffer.add_(1.0)


def sample_kernels(
    seconds: float,
    *,
    batch: int = 8,
    clock: str = "wall",
    seed: int = 0,
    repeats: int = 5,
    min_per_class: int = 8,
    classes: tuple[str, ...] = tuple(CLASSES),
    device: str = "cpu",
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[tuple[np.ndarray, dict[str, float]]]]:
    """Time random configurations of every class (:data:`CLASSES`) for about ``seconds`` of wall time.

    Classes are drawn in proportion to :data:`WEIGHTS`, after ``min_per_class`` of each; the
    drawing stops at the deadline (a configuration started before it finishes). ``device``: where
    the kernels run (``cuda`` with the ``cuda`` clock: every stamp waits for the device).
    """
    from .clocks import get_clock

    clock_fn = get_clock(clock)
    rng = np.random.default_rng(seed)
    say = progress or (lambda _msg: None)
    names = list(classes)
    weights = np.array([WEIGHTS[c] for c in names], float)
    out: dict[str, list[tuple[np.ndarray, dict[str, float]]]] = {c: [] for c in names}
    start = time.perf_counter()
    order = [c for _ in range(min_per_class) for c in names]
    while True:
        cls = order.pop(0) if order else str(rng.choice(names, p=weights / weights.sum()))
        out[cls].append(time_config(cls, draw_config(cls, rng, batch), clock_fn, repeats, device=device))
        done = sum(map(len, out.values()))
        if done % 50 == 0:
            say(f"{done} kernel configurations timed ({time.perf_counter() - start:.0f} s)")
        if time.perf_counter() - start > seconds and not order:
            break
    return out


def samples_json(samples: dict[str, list[tuple[np.ndarray, dict[str, float]]]]) -> str:
    """The timed configurations as JSON: ``{class: [[features...], {phase: seconds}], ...}``."""
    import json

    return json.dumps({c: [[list(map(float, f)), t] for f, t in rows] for c, rows in samples.items()})


def load_samples(text: str) -> dict[str, list[tuple[np.ndarray, dict[str, float]]]]:
    """The inverse of :func:`samples_json`."""
    import json

    return {c: [(np.array(f, float), dict(t)) for f, t in rows] for c, rows in json.loads(text).items()}
