"""The two profile commands: ``fedelastic profile measure`` and ``fedelastic profile import-trace``.

``profile measure`` runs on the device to be emulated (a Jetson, a Raspberry Pi, or this host):
it times every layer (:mod:`fedelastic.profiling.measure`), fits the roofline and the kernel classes
(:mod:`fedelastic.profiling.roofline_fit`) and writes a profile (:mod:`fedelastic.profiling.writer`). ``profile
import-trace`` reads a Chrome trace (:mod:`fedelastic.profiling.chrome_trace`) into a profile's measured tables and
can refit the profile to them. Models are built with :func:`fedelastic.models.build_with_input`.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..devices.kernelsample import samples_json
from ..devices.profile import DeviceProfile, MeasuredTable, parse_profile
from ..models import build_with_input, describe_model
from .measure import (
    host_memory_available,
    measure_copy_bandwidth,
    measure_layers,
    measure_peak_flops,
    measure_power,
    measure_scalar_rate,
)
from .roofline_fit import FitResult, _start_device, datasheet_bandwidth, fit_roofline, fit_to_profile
from .writer import (
    apply_fit,
    build_profile_dict,
    fit_kernels_into,
    measured_by,
    measured_table_toml,
    set_measured_table,
    write_profile,
)

__all__ = ["import_trace_into", "measure_profile"]


#: Default seconds of kernel sampling (``profile measure --sample-minutes``): with the model's
#: own measurement, the command stays within 15 minutes on a 2-core host.
DEFAULT_SAMPLE_SECONDS = 600.0


def measure_profile(
    model_name: str | Sequence[str],
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
    sample_seconds: float = DEFAULT_SAMPLE_SECONDS,
    save_samples: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[DeviceProfile, FitResult, MeasuredTable]:
    """Measure this machine and write its profile to ``out`` (what ``profile measure`` does).

    Every model of ``model_name`` (one name or several) is measured layer by layer; the profile
    holds all their tables, and the roofline and kernel classes are fitted to all of them. With
    ``sample_seconds > 0`` (the default) the kernels training runs are also sampled for about that
    long (:mod:`fedelastic.devices.kernelsample`) and one predictor per kernel class is written
    (``[sampled]``): it prices every model the profile has no measured table of, and
    ``[uncertainty] step`` is then its error on the measured models' steps (which it never saw).
    ``save_samples``: also write the timed kernel configurations there (JSON). Returns the
    profile, the roofline fit and the last model's table.
    """
    import tomllib

    import torch

    from ..devices.profile import get_profile
    from ..modelinfo import describe

    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names:
        raise ValueError("profile measure needs at least one --model")
    if len(set(names)) != len(names):
        raise ValueError(f"--model repeats a model: {names}")
    out = Path(out)
    name = name or out.stem
    if name != out.stem:
        raise ValueError(f"the profile name {name!r} must equal the file stem {out.stem!r}")
    if threads is not None:
        torch.set_num_threads(threads)
    threads = torch.get_num_threads()
    by = measured_by(threads, clock)
    say = progress or (lambda _msg: None)
    pairs: list[tuple[Any, MeasuredTable]] = []
    shapes = []
    for model_id in names:
        torch.manual_seed(0)
        model, shape = build_with_input(
            model_id, num_classes=num_classes, input_size=input_size, in_channels=in_channels, **(model_options or {})
        )
        sample = torch.randn(batch_size, *shape)
        info = describe(model, sample[:1], model_name=model_id)
        say(f"{model_id}: {len(info.layers)} layers, {info.num_params:,} parameters, input {tuple(sample.shape)}")
        table = measure_layers(
            model, sample, model_name=model_id, repeats=repeats, warmup=warmup, source=by, clock=clock, progress=say
        )
        pairs.append((info, dataclasses.replace(table, shape=info.shape())))  # used only on a model of this shape
        shapes.append(f"{model_id} at input {tuple(shape)}")
    say("peak FP32 throughput")
    peak = measure_peak_flops(repeats=repeats, warmup=warmup, clock=clock)
    memory = host_memory_available()
    say("selector operations per second")
    scalar_rate = measure_scalar_rate(repeats=max(repeats, 3), warmup=warmup, clock=clock)
    say("power (RAPL or a Jetson's rails, where readable)")
    power = host_power()
    base_raw = tomllib.loads(Path(get_profile(str(like)).path).read_text()) if like else None
    start = _start_device(peak[0])
    say("memory copy bandwidth")
    copy_bw = measure_copy_bandwidth(repeats=repeats, warmup=warmup, clock=clock)
    say("fitting the roofline")
    # bounded by physics: no faster than the measured torch.mm peak, no more bandwidth than the best copy
    fit = fit_roofline(pairs, start, max_peak_eff=peak[0], max_bandwidth=copy_bw[0])
    for doubt in fit.warnings:
        say(
            f"warning: roofline fit: {doubt} (bounds: torch.mm {peak[0] / 1e9:.4g} GFLOP/s, copy {copy_bw[0] / 1e9:.4g} GB/s)"
        )
    raw = build_profile_dict(
        name,
        tables={info.model_name: table for info, table in pairs},
        fit=fit,
        peak_flops=peak,
        memory=memory,
        measured_by=by,
        device_class=device_class,
        like=base_raw,
        notes=f"Measured on {', '.join(shapes)}, batch {batch_size}.",
        scalar_rate=scalar_rate,
        power=power,
    )
    say("fitting the kernel classes")
    fit_kernels_into(raw, pairs, str(out), f"fitted: {by}", max_bandwidth=copy_bw[0])
    if sample_seconds > 0:
        samples = sample_into(
            raw, pairs, str(out), by, seconds=sample_seconds, batch=batch_size, clock=clock, progress=say
        )
        if save_samples:
            Path(save_samples).write_text(samples_json(samples))
    return write_profile(raw, out), fit, pairs[-1][1]


def host_power(root: str | Path = "/", seconds: float = 2.0) -> dict[str, tuple[float, str]]:
    """Powers read from this machine's sensors (:func:`~fedelastic.profiling.measure.measure_power`), by
    ``[power]`` key: ``compute`` while a 512x512 ``torch.mm`` loop runs (compute-bound kernels),
    ``memory`` while a 64 MiB copy loop runs (memory-bound kernels), ``train`` their mean (a step
    mixes both; the cost model uses the two phases), ``idle`` while the process sleeps. Empty where no
    sensor is readable."""
    import time

    import torch

    a, src = torch.randn(512, 512), torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    compute = measure_power(lambda: torch.mm(a, a), seconds, root=root)
    if compute is None:
        return {}
    memory = measure_power(lambda: dst.copy_(src), seconds, root=root)
    idle = measure_power(lambda: time.sleep(0.05), seconds, root=root)
    assert memory is not None and idle is not None
    return {
        "compute": (compute[0], f"{compute[2]}, while torch.mm 512x512 ran (compute-bound)"),
        "memory": (memory[0], f"{memory[2]}, while a 64 MiB tensor copy ran (memory-bound)"),
        "train": ((compute[0] + memory[0]) / 2, f"mean of power.compute and power.memory ({compute[2]})"),
        "idle": (idle[0], f"{idle[2]}, while the process slept"),
    }


def sample_into(
    raw: dict[str, Any],
    pairs: Sequence[tuple[Any, MeasuredTable]],
    src: str,
    by: str,
    *,
    seconds: float,
    batch: int,
    clock: str,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list]:
    """Sample the kernel classes for ``seconds`` and write them in (:func:`sampled_into`)."""
    from ..devices.kernelsample import sample_kernels

    say = progress or (lambda _msg: None)
    say(f"sampling the kernels for {seconds / 60:.3g} min")
    samples = sample_kernels(seconds, batch=batch, clock=clock, progress=say)
    sampled_into(raw, pairs, samples, src, by, progress=say)
    return samples


def sampled_into(
    raw: dict[str, Any],
    pairs: Sequence[tuple[Any, MeasuredTable]],
    samples: dict[str, list],
    src: str,
    by: str,
    progress: Callable[[str], None] | None = None,
) -> None:
    """Fit the predictors to ``samples`` and write ``[sampled]`` and ``[uncertainty] step``.

    A kernel timed alone is not what a model's step pays for it: its forward runs faster (its
    input stays in cache, its output reuses a freed buffer), its backward pays no gradient
    accumulation. The measured ``pairs`` calibrate that: per layer, ``scale * t + seconds`` for the
    forward and for the backward (:func:`~fedelastic.devices.kernelsample.fit_calibration`, over every
    layer of every table). The band is sized by each model's error (its layers' forward, dX and dW
    summed) predicted with the calibration fitted to the *other* models (leave one model out;
    :func:`fedelastic.cost.bands.lomo_band`); with a single model nothing is held out and the stated
    single-model rule applies (:data:`fedelastic.cost.bands.SINGLE_MODEL_BAND`).
    """
    from ..cost.bands import LOMO_RULE, SINGLE_MODEL_BAND, SINGLE_MODEL_RULE, lomo_band
    from ..devices.kernelsample import fit_predictors, predictors_toml

    say = progress or (lambda _msg: None)
    predictors: dict[str, Any] = dict(fit_predictors(samples))
    predictors["calibration"], errs = calibrate(predictors, pairs, say)
    raw["sampled"] = predictors_toml(predictors, f"{by}: {sum(map(len, samples.values()))} timed kernel configurations")
    names = ", ".join(info.model_name for info, _ in pairs)
    if len(pairs) > 1:
        band = lomo_band(errs)
        how = f"{LOMO_RULE}, the sampled kernels' layers (forward, dX, dW summed); errors: " + ", ".join(
            f"{info.model_name} {e:+.1%}" for (info, _), e in zip(pairs, errs)
        )
    else:
        band, how = SINGLE_MODEL_BAND, f"{SINGLE_MODEL_RULE} ({names})"
    raw["uncertainty"] = {"step": {"value": float(f"{max(band, 1e-4):.3g}"), "unit": "1", "source": f"{by}: {how}"}}


def calibrate(
    predictors: dict[str, Any], pairs: Sequence[tuple[Any, MeasuredTable]], say: Callable[[str], None]
) -> tuple[dict[str, tuple[float, float]], list[float]]:
    """The calibration fitted to every table of ``pairs`` and, per model, the error of its layers
    (forward, dX, dW summed) with the calibration fitted to the others (uncalibrated if alone)."""
    import numpy as np

    from ..devices.kernelsample import predicted_layers

    rows = []
    for info, table in pairs:
        pred, _ = predicted_layers(predictors, info, table.batch_size)
        names = [n for n in pred if n in table.layers]
        rows.append((np.array([pred[n] for n in names]), np.array([_row(table.layers[n]) for n in names])))
    errs = []
    for k, (_pred, meas) in enumerate(rows):
        rest = [r for j, r in enumerate(rows) if j != k]
        cal = _calibration(rest) if rest else {"fwd": (1.0, 0.0), "bwd": (1.0, 0.0)}
        held = {**predictors, "calibration": cal}
        errs.append(predicted_total(held, pairs[k][0], pairs[k][1].batch_size) / meas.sum() - 1)
        say(f"{pairs[k][0].model_name}: layers predicted by the sampled kernels {errs[-1]:+.1%} (held out)")
    return _calibration(rows), errs


def _calibration(rows: list[tuple[Any, Any]]) -> dict[str, tuple[float, float]]:
    """:func:`~fedelastic.devices.kernelsample.fit_calibration` over the (predicted, measured) layer rows
    of several models, each model's rows weighted by 1 / its measured forward."""
    import numpy as np

    from ..devices.kernelsample import fit_calibration

    weight = np.concatenate([np.full(len(m), 1 / max(m[:, 0].sum(), 1e-12)) for _, m in rows])
    return fit_calibration(np.concatenate([p for p, _ in rows]), np.concatenate([m for _, m in rows]), weight)


def _row(t) -> tuple[float, float, float]:
    return (t.fwd_s, t.dx_s, t.dw_s)


def predicted_total(predictors: dict[str, Any], info: Any, batch_size: int) -> float:
    """Seconds of every layer's forward, dX and dW as the sampled kernels price them."""
    from ..devices.kernelsample import predicted_layers

    layers, _ = predicted_layers(predictors, info, batch_size)
    return float(sum(sum(v) for v in layers.values()))


def _origin(source: str, width: int = 80) -> str:
    """A table's source, shortened for a fit's source text: whole words, never a cut date.

    The import's own ", imported by ... on DATE" tail is dropped (the fit states its own date).
    """
    text = source.split(" (")[0].split(", imported by fedelastic")[0]
    if len(text) <= width:
        return text
    return text[:width].rsplit(" ", 1)[0].rstrip(",;") + " ..."


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
    from ..config import read_toml
    from ..devices.profile import load_profile
    from ..models import BUILTIN
    from .chrome_trace import import_trace

    say = progress or (lambda _msg: None)
    day = datetime.date.today().isoformat()
    src = source or f"{Path(path).name}, imported by fedelastic profile import-trace on {day}"
    table = import_trace(path, model=model, batch_size=batch_size, source=src)
    if model in BUILTIN:  # the shape it was measured at: the cost model uses it only on a model of this shape
        say(f"describing {model}")
        table = dataclasses.replace(
            table, shape=describe_model(model, input_size=input_size, num_classes=num_classes).shape()
        )
    say(
        f"{model}: {len(table.layers)} layers, step {table.step_s * 1e3:.1f} ms (forward {table.forward_s * 1e3:.1f}, "
        f"backward {table.backward_s * 1e3:.1f}, other {table.other_s * 1e3:.1f}) over {table.n_steps} steps"
    )
    if profile is None:
        return table, {"measured": {model: measured_table_toml(table)}}, None
    profile = Path(profile)
    raw = read_toml(profile, "device profile")  # a malformed file is an error naming it
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
        for doubt in result.warnings:
            say(f"warning: roofline fit: {doubt}")
        origin = "; ".join(f"{info.model_name}: {_origin(mt.source)}" for info, mt in pairs)
        src = f"fitted to the measured tables ({origin}) by fedelastic profile import-trace --fit on {day}"
        apply_fit(raw, result, src)
        fit_kernels_into(raw, pairs, str(profile), src, max_bandwidth=datasheet_bandwidth(device))
    write_profile(raw, profile)
    load_profile(profile)
    return table, raw, result
