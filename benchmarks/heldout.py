"""Held-out fidelity: a host profile predicts the training steps of architectures it never measured.

    pip install --no-deps torchvision==0.28.0   # the benchmark's own dependency, not fedelastic's
    fedelastic profile measure --model resnet_small --model mcu_net --clock cpu --threads 1 \\
        --out benchmarks/results/heldout_host.toml            # ~13 min: tables + 10 min of kernel sampling
    python benchmarks/heldout.py --profile benchmarks/results/heldout_host.toml

The profile is measured on the project's own models (the *tuning* set: resnet_small, mcu_net;
the kernel sampling grid was designed looking at them and mobilenetv2). The *held-out* set is
torchvision classification models the project does not ship, at 64x64, batch 8, random init,
1000 classes. For each, four selections (full; last layer; suffix: the upper half of the
tensors; sparse: a seeded 30% of the tensors in the upper three quarters, plus the last layer)
are run for real, as the trainer applies them (``requires_grad`` per tensor, untrained batch
norms in eval mode; forward, cross-entropy, backward, SGD-momentum step), in thread CPU time with
one torch thread, interleaved over ``--reps`` rounds (each round: one warm-up and two timed steps
per selection); the real figure is the median. Each model's per-layer fwd + dX + dW is measured
with :func:`fedelastic.profiling.measure.measure_layers` (thread CPU time).

Two pricings of the same profile are compared: **after**, the sampled kernel predictors
(``[sampled]``) price the unmeasured model; **before**, the same profile without them (the fitted
per-class roofline ``[kernels]``: what main did). Reported per pricing: share of (model,
selection) cells within +-10%, median |error|, share of selection/full speedups within +-5%,
per-layer median |error|, and the real median's own uncertainty (bootstrap, relative).

``--interleave MINUTES`` (the honest check on a shared host) times everything in one run, in rounds:
each round measures the tuning models' per-layer tables (one repeat), every held-out cell's real
steps and per-layer table, and a new slice of the kernel sampler's sequence between the models;
the profile is then fitted (roofline classes and sampled predictors, calibrated on the tuning
tables' medians over rounds) to those samples, so the fit and the truths see the same host state.
The timings are saved (``--data``); ``--from-data`` refits and prices them again without timing
(several runs pooled), with the ``fedelastic`` of ``$HELDOUT_CODE`` (default: this checkout), so
that two versions of the code are compared on the same timings. The noise floor is reported with
it: the goal's figures of the even rounds' truth against the odd rounds'.

    python benchmarks/heldout.py --profile benchmarks/results/heldout_host.toml --interleave 38   # ~30-40 min
    python benchmarks/heldout.py --profile benchmarks/results/heldout_host.toml --from-data \
        --data benchmarks/results/heldout_interleaved.json benchmarks/results/heldout_interleaved2.json

torchvision 0.28's compiled detection ops do not load against this CPU torch; the classification
models do not need them, so :func:`import_torchvision` skips the registration of their fake
kernels (only inside this benchmark).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
CODE = Path(os.environ.get("HELDOUT_CODE", ROOT))  # whose fedelastic prices (e.g. main's checkout, for "before")
sys.path.insert(0, str(CODE))
sys.path.insert(0, str(CODE / "benchmarks"))

from fidelity import apply_selection, layer_matrix  # noqa: E402

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.profiling.measure import measure_layers  # noqa: E402

if "HELDOUT_CODE" in os.environ and not Path(sys.modules["fedelastic"].__file__ or "").resolve().is_relative_to(CODE.resolve()):
    # a partial checkout falls back to the installed fedelastic: the "before" row would be this code's
    raise SystemExit(f"HELDOUT_CODE={CODE}: imported fedelastic from {sys.modules['fedelastic'].__file__}, not from it")

HELD_OUT = (
    "resnet18", "mobilenet_v3_small", "efficientnet_b0", "mnasnet0_5", "shufflenet_v2_x0_5",
    "squeezenet1_1", "regnet_x_400mf", "densenet121", "vgg11", "regnet_y_400mf",
)  # fmt: skip
SELECTIONS = ("full", "last", "suffix", "sparse")
CLOCK = time.thread_time


def import_torchvision():
    """torchvision's model zoo without its compiled ops (their fake-kernel registration fails here)."""
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import torchvision.models

    return torchvision.models


def selections(info, seed: int = 0) -> dict[str, np.ndarray]:
    n = info.num_tensors
    last = np.zeros(n)
    last[list(info.layers[-1].tensors)] = 1
    suffix = np.zeros(n)
    suffix[n // 2 :] = 1
    rng = np.random.default_rng(seed)
    sparse = np.zeros(n)
    sparse[n // 4 :] = rng.random(n - n // 4) < 0.3
    sparse = np.maximum(sparse, last)
    return {"full": np.ones(n), "last": last, "suffix": suffix, "sparse": sparse}


def real_step_times(model, info, x, y, sels: dict[str, np.ndarray], reps: int, clock=CLOCK) -> dict[str, list[float]]:
    """Interleaved real steps: each round runs every selection (one warm-up, two timed steps)."""
    out: dict[str, list[float]] = {k: [] for k in sels}
    for _ in range(reps):
        for key, ratios in sels.items():
            params = apply_selection(model, info, ratios)
            opt = torch.optim.SGD([p for p in params if p.requires_grad], lr=1e-12, momentum=0.9)
            for i in range(3):
                t0 = clock()
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                if i:
                    out[key].append(clock() - t0)
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    return out


def median_uncertainty(samples: list[float], rng: np.random.Generator, n: int = 400) -> float:
    """Relative standard deviation of the median (bootstrap)."""
    s = np.asarray(samples)
    meds = np.median(rng.choice(s, (n, s.size)), axis=1)
    return float(np.std(meds) / np.median(s))


def evaluate(name: str, zoo, profiles: dict, reps: int, layer_repeats: int, log, reuse: dict | None = None) -> dict:
    """One held-out model: real steps and per-layer table (or those of ``reuse``, a row of an
    earlier run), and each profile's prediction of them."""
    torch.manual_seed(0)
    model = getattr(zoo, name)(weights=None)
    x = torch.randn(8, 3, 64, 64)
    y = torch.randint(0, 1000, (8,), generator=torch.Generator().manual_seed(0))
    info = describe(model, x[:1], model_name=name)
    sels = selections(info)
    t0 = time.perf_counter()
    row: dict = {"model": name, "tensors": info.num_tensors, "params": info.num_params, "pred_s": {}, "layer_err": {}}
    if reuse is None:
        real = real_step_times(model, info, x, y, sels, reps)
        table = measure_layers(model, x, model_name=name, repeats=layer_repeats, warmup=1, clock="cpu")
        rng = np.random.default_rng(0)
        row["real_s"] = {k: float(np.median(v)) for k, v in real.items()}
        row["real_median_rel_sd"] = {k: median_uncertainty(v, rng) for k, v in real.items()}
        row["samples"] = len(real["full"])
        row["layers"] = {n: [t.fwd_s, t.dx_s, t.dw_s] for n, t in table.layers.items()}
    else:
        row.update({k: reuse[k] for k in ("real_s", "real_median_rel_sd", "samples", "layers")})
    names_measured = [layer.name for layer in info.layers if layer.name in row["layers"]]
    meas = np.array([row["layers"][n] for n in names_measured])
    row["layer_names"] = names_measured
    row["layer_class"] = [_layer_class(info, i) for i, layer in enumerate(info.layers) if layer.name in names_measured]
    row["layer_pred"] = {}
    for label, device in profiles.items():
        cost = CostModel(info, device, 8)
        row["pred_s"][label] = {k: cost.step_time_s(r) for k, r in sels.items()}
        pred = layer_matrix(cost, info)[[i for i, layer in enumerate(info.layers) if layer.name in names_measured]]
        # per layer fwd + dX + dW; the first layer's dx is never paid (no gradient below the input)
        row["layer_pred"][label] = pred.tolist()
        p_sum, m_sum = pred.sum(axis=1) - np.r_[pred[0, 1], np.zeros(len(pred) - 1)], meas.sum(axis=1)
        ok = m_sum > 0
        row["layer_err"][label] = (p_sum[ok] / m_sum[ok] - 1).tolist()
    log(
        f"{name}: real full {row['real_s']['full'] * 1e3:.1f} ms (+-{row['real_median_rel_sd']['full']:.1%}); "
        + "; ".join(f"{lab} {row['pred_s'][lab]['full'] * 1e3:.1f}" for lab in profiles)
        + f" ({time.perf_counter() - t0:.0f} s)"
    )
    return row


def _layer_class(info, li: int) -> str:
    from fedelastic.devices.kernelsample import layer_kernel

    kernel = layer_kernel(info, li, 8.0)
    return kernel[0] if kernel else info.layers[li].kind


def by_class(rows: list[dict], label: str) -> dict[str, dict]:
    """Per layer class and phase (fwd, dx, dw): layers, median predicted / measured, and the class's
    share of the measured time of every held-out layer (where the per-layer error comes from)."""
    out: dict[str, dict] = {}
    total = sum(np.sum(r["layers"][n]) for r in rows for n in r["layer_names"])
    for r in rows:
        pred = np.array(r["layer_pred"][label])
        meas = np.array([r["layers"][n] for n in r["layer_names"]])
        for i, cls in enumerate(r["layer_class"]):
            d = out.setdefault(cls, {"n": 0, "ratio": [[], [], []], "share": 0.0})
            d["n"] += 1
            d["share"] += float(meas[i].sum() / total)
            for ph in range(3):
                if meas[i, ph] > 1e-7 and not (i == 0 and ph == 1):
                    d["ratio"][ph].append(pred[i, ph] / meas[i, ph])
    return {c: {"n": d["n"], "share": d["share"], "median_ratio": [float(np.median(v)) if v else None for v in d["ratio"]]}
            for c, d in sorted(out.items(), key=lambda kv: -kv[1]["share"])}  # fmt: skip


def summary(rows: list[dict], label: str, band: float = 0.0) -> dict:
    cell, speed, layers = [], [], []
    for r in rows:
        pred, real = r["pred_s"][label], r["real_s"]
        cell += [pred[k] / real[k] - 1 for k in SELECTIONS]
        speed += [(pred[k] / pred["full"]) / (real[k] / real["full"]) - 1 for k in SELECTIONS if k != "full"]
        layers += r["layer_err"][label]
    cell_a, speed_a, layer_a = (np.abs(np.array(v)) for v in (cell, speed, layers))
    return {
        "cells": len(cell),
        "within_10": float(np.mean(cell_a <= 0.10)),
        "within_25": float(np.mean(cell_a <= 0.25)),
        "median_abs": float(np.median(cell_a)),
        "median_signed": float(np.median(cell)),
        "speedup_within_5": float(np.mean(speed_a <= 0.05)),
        "speedup_median_abs": float(np.median(speed_a)),
        "layer_median_abs": float(np.median(layer_a)),
        "layers": len(layers),
        "band": band,  # the profile's 1-sigma step band ([uncertainty] step)
        "coverage": float(np.mean(cell_a <= band)),  # cells whose real step falls inside it (1 sigma: ~68%)
    }


def band(profile) -> float:
    return profile.uncertainty.value if profile.uncertainty is not None else 0.0


def markdown(res: dict) -> str:
    lines = [
        f"Command: `{res['command']}` ({res['date']}; {res['host']}; torch {res['torch']}, 1 thread, thread CPU time; "
        f"{res['wall_s']:.0f} s wall). Profile: `{res['profile']}` ({res['profile_models']}). Raw numbers: `{res['out']}`.",
        "",
        "| pricing | cells within +-10% | within +-25% | median abs error (signed) | speedup within +-5% | "
        "speedup median abs error | per-layer median abs error | stated 1-sigma band: cells inside |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, s in res["summary"].items():
        lines.append(
            f"| {label} | {s['within_10']:.0%} of {s['cells']} | {s['within_25']:.0%} | {s['median_abs']:.1%} "
            f"({s['median_signed']:+.1%}) | {s['speedup_within_5']:.0%} | {s['speedup_median_abs']:.1%} | "
            f"{s['layer_median_abs']:.1%} (of {s['layers']}) | {s['band']:.1%}: {s['coverage']:.0%} |"
        )
    if "noise" in res:
        n, loads = res["noise"], [r["load"] for r in res["rounds"]]
        lines.append(
            f"| the truth itself (even rounds' medians against odd rounds') | {n['within_10']:.0%} | | {n['median_abs']:.1%} | "
            f"{n['speedup_within_5']:.0%} | | {n['layer_median_abs']:.1%} | |"
        )
        lines += ["", f"{len(loads)} rounds, {res['kernels_timed']} kernel configurations; load average "
                  f"{min(loads):.1f}-{max(loads):.1f} at the rounds' ends; a cell's round-to-round sd: median "
                  f"{n['round_spread_median']:.1%}, max {n['round_spread_max']:.1%}."]  # fmt: skip
    labels = list(res["summary"])
    lines += ["", "| layer class | layers | share of measured layer time | "
              + " | ".join(f"{lab}: predicted / measured, fwd / dX / dW (medians)" for lab in labels) + " |",
              "|---|---|---|" + "---|" * len(labels)]  # fmt: skip
    classes = {lab: by_class(res["rows"], lab) for lab in labels}
    for cls, d in classes[labels[0]].items():
        ratios = [" / ".join("-" if x is None else f"{x:.2f}" for x in classes[lab][cls]["median_ratio"]) for lab in labels]
        lines.append(f"| {cls} | {d['n']} | {d['share']:.1%} | " + " | ".join(ratios) + " |")
    lines += [
        "",
        "| model | real full step (median's rel. sd) | "
        + " | ".join(f"{lab}: full / last / suffix / sparse error" for lab in labels)
        + " | "
        + " | ".join(f"{lab}: layer median" for lab in labels)
        + " |",
        "|---|---|" + "---|" * (2 * len(labels)),
    ]
    for r in res["rows"]:
        errs = [
            " / ".join(f"{r['pred_s'][lab][k] / r['real_s'][k] - 1:+.0%}" for k in SELECTIONS) for lab in labels
        ]
        lay = [f"{np.median(np.abs(r['layer_err'][lab])):.0%}" for lab in labels]
        sd = max(r["real_median_rel_sd"].values())
        lines.append(f"| {r['model']} | {r['real_s']['full'] * 1e3:.1f} ms ({sd:.1%}) | " + " | ".join(errs + lay) + " |")
    return "\n".join(lines) + "\n"


def refit(path: Path, samples: Path, input_size: int | None = None) -> Path:
    """A copy of the profile ``path`` (beside it, ``*_refit.toml``) with ``[sampled]`` refitted to ``samples``
    by the current code, calibrated on the profile's own measured tables (registry models at
    ``input_size`` with 3 input channels, or the factory defaults)."""
    import tomllib

    from fedelastic.devices.kernelsample import load_samples
    from fedelastic.models import describe_model
    from fedelastic.profiling.commands import sampled_into
    from fedelastic.profiling.writer import write_profile

    profile = load_profile(path)
    raw = tomllib.loads(path.read_text())
    out = path.with_name(path.stem + "_refit.toml")
    size = {"input_size": input_size, "in_channels": 3} if input_size else {}
    pairs = [(describe_model(m, **size), t) for m, t in profile.measured.items()]
    by = raw["sampled"]["source"].split(":")[0]
    raw["name"] = out.stem
    sampled_into(raw, pairs, load_samples(samples.read_text()), str(out), by, progress=print)
    write_profile(raw, out)
    return out


TUNING = ("resnet_small", "mobilenetv2", "mcu_net")  # the project's own models (their factory sizes)


def _table_row(table) -> dict:
    return {
        "layers": {n: [t.fwd_s, t.dx_s, t.dw_s] for n, t in table.layers.items()},
        "unattributed": [table.unattributed_fwd_s, table.unattributed_bwd_s],
    }


def time_interleaved(
    zoo, models: list[str], tuning: list[str], minutes: float, kernel_share: float, seed: int, log, cold_mib: float = 0.0
) -> dict:
    """Time, in rounds until ``minutes`` of wall time are spent, the tuning models' per-layer tables,
    every held-out cell's real steps and per-layer table, and kernel samples (a new slice of the
    sampler's sequence each round, between the models, ``kernel_share`` of each round's time), so
    that the fit and the truths see the same host state. Everything is kept per round. With
    ``cold_mib``, every configuration is also timed with a cache flush of that size before each
    timed call (``times_cold``; ``--from-data --cold`` fits those)."""
    from fedelastic.devices.clocks import get_clock
    from fedelastic.devices.kernelsample import CLASSES, WEIGHTS, cache_flush, draw_config, time_config
    from fedelastic.models import build_with_input
    from fedelastic.profiling.measure import measure_copy_bandwidth

    clock = get_clock("cpu")
    rng = np.random.default_rng(seed)
    names = list(CLASSES)
    weights = np.array([WEIGHTS[c] for c in names], float)
    order = [c for _ in range(8) for c in names]  # 8 of each class first, as the sampler does
    kernels: list[dict] = []
    flush = cache_flush(cold_mib) if cold_mib else None

    def sample_for(seconds: float, rnd: int) -> float:
        start = time.perf_counter()
        while time.perf_counter() < start + seconds:
            cls = order.pop(0) if order else str(rng.choice(names, p=weights / weights.sum()))
            cfg = draw_config(cls, rng, 8)
            feats, times = time_config(cls, cfg, clock, repeats=5)
            kernels.append({"cls": cls, "cfg": cfg, "feats": feats.tolist(), "times": times, "round": rnd})
            if flush is not None:
                kernels[-1]["times_cold"] = time_config(cls, cfg, clock, repeats=5, flush=flush)[1]
        return time.perf_counter() - start

    tun = []
    for name in tuning:
        torch.manual_seed(0)
        model, shape = build_with_input(name)
        tun.append((name, model, torch.randn(8, *shape)))
    held = []
    for name in models:
        torch.manual_seed(0)
        model = getattr(zoo, name)(weights=None)
        x = torch.randn(8, 3, 64, 64)
        y = torch.randint(0, 1000, (8,), generator=torch.Generator().manual_seed(0))
        info = describe(model, x[:1], model_name=name)
        held.append((name, model, info, x, y, selections(info)))
    out: dict = {"copy_bandwidth": measure_copy_bandwidth(clock="cpu")[0], "rounds": [], "kernels": kernels,
                 "tuning": {n: [] for n in tuning}, "held": {n: {"steps": [], "layers": []} for n in models}}  # fmt: skip
    t0 = time.perf_counter()
    rnd, last, chunk = 0, 0.0, 20.0  # the first round's kernel chunks: 20 s each
    while rnd < 3 or time.perf_counter() - t0 + last < minutes * 60:
        r0, in_kernels = time.perf_counter(), 0.0
        for name, model, x in tun:
            out["tuning"][name].append(_table_row(measure_layers(model, x, repeats=1, warmup=1, clock="cpu")))
        in_kernels += sample_for(chunk, rnd)
        for name, model, info, x, y, sels in held:
            out["held"][name]["steps"].append(real_step_times(model, info, x, y, sels, 1))
            table = measure_layers(model, x, model_name=name, repeats=1, warmup=1, clock="cpu")
            out["held"][name]["layers"].append(_table_row(table)["layers"])
            in_kernels += sample_for(chunk, rnd)
        last = time.perf_counter() - r0
        # next round: kernels take kernel_share of the round
        chunk = kernel_share / (1 - kernel_share) * (last - in_kernels) / (len(held) + 1)
        out["rounds"].append({"wall_s": last, "load": os.getloadavg()[0]})
        log(f"round {rnd}: {last:.0f} s, {len(kernels)} kernels, load {os.getloadavg()[0]:.1f}")
        rnd += 1
    return out


def pooled(runs: list[dict]) -> dict:
    """Several interleaved runs as one: their rounds, kernel samples and tables together."""
    out = json.loads(json.dumps(runs[0]))
    for run in runs[1:]:
        out["rounds"] += run["rounds"]
        out["kernels"] += run["kernels"]
        for name, rounds in run["tuning"].items():
            out["tuning"][name] += rounds
        for name, h in run["held"].items():
            out["held"][name]["steps"] += h["steps"]
            out["held"][name]["layers"] += h["layers"]
    return out


def _median_layers(rounds: list[dict]) -> dict[str, list[float]]:
    return {n: np.median([r[n] for r in rounds], axis=0).tolist() for n in rounds[0]}


def interleaved_profile(data: dict, base: Path, out: Path, tuning: list[str], cold: bool = False) -> Path:
    """A profile fitted by the code on ``sys.path`` to an interleaved run's median tuning tables and
    kernel samples (features recomputed from each configuration where the code can:
    ``kernelsample.config_features``; ``cold``: their times with a cache flush before each timed
    call), the rest of ``base``'s keys kept."""
    import tomllib

    from fedelastic.devices import kernelsample
    from fedelastic.devices.profile import LayerTiming, MeasuredTable
    from fedelastic.models import build_with_input
    from fedelastic.profiling.commands import sampled_into
    from fedelastic.profiling.writer import fit_kernels_into, set_measured_table, write_profile

    raw = tomllib.loads(base.read_text())
    raw["name"], by = out.stem, "interleaved run"
    raw.pop("measured", None)
    pairs = []
    for name in tuning:
        model, shape = build_with_input(name)
        info = describe(model, torch.zeros(1, *shape), model_name=name)
        rounds = data["tuning"][name]
        layers = _median_layers([r["layers"] for r in rounds])
        unatt = np.median([r["unattributed"] for r in rounds], axis=0)
        table = MeasuredTable(8, by, {n: LayerTiming(*v) for n, v in layers.items()}, float(unatt[0]),
                              float(unatt[1]), model=name, shape=info.shape())  # fmt: skip
        set_measured_table(raw, name, table)
        pairs.append((info, table))
    fit_kernels_into(raw, pairs, str(out), f"fitted: {by}", max_bandwidth=data["copy_bandwidth"])
    features = getattr(kernelsample, "config_features", None)
    samples: dict[str, list] = {}
    for k in data["kernels"]:
        f = features(k["cls"], k["cfg"]) if features else np.array(k["feats"])
        samples.setdefault(k["cls"], []).append((f, k["times_cold" if cold else "times"]))
    sampled_into(raw, pairs, samples, str(out), by, progress=print)
    write_profile(raw, out)
    return out


def interleaved_rows(data: dict) -> dict[str, dict]:
    """Per held-out model, the row :func:`evaluate` reuses: medians over every round."""
    rng = np.random.default_rng(0)
    rows = {}
    for name, h in data["held"].items():
        steps = {k: [t for r in h["steps"] for t in r[k]] for k in SELECTIONS}
        rows[name] = {
            "real_s": {k: float(np.median(v)) for k, v in steps.items()},
            "real_median_rel_sd": {k: median_uncertainty(v, rng) for k, v in steps.items()},
            "samples": len(steps["full"]),
            "layers": _median_layers(h["layers"]),
        }
    return rows


def noise_floor(data: dict) -> dict:
    """The goal's figures of one half of the rounds' truth "predicting" the other half's (even
    rounds against odd ones), and the round-to-round spread of a cell: what timing noise alone gives."""
    cell, speed, layer, spread = [], [], [], []
    for h in data["held"].values():
        half = [h["steps"][i::2] for i in (0, 1)]
        med = [{k: np.median([t for r in part for t in r[k]]) for k in SELECTIONS} for part in half]
        cell += [med[0][k] / med[1][k] - 1 for k in SELECTIONS]
        speed += [(med[0][k] / med[0]["full"]) / (med[1][k] / med[1]["full"]) - 1 for k in SELECTIONS[1:]]
        lay = [_median_layers(h["layers"][i::2]) for i in (0, 1)]
        for n in lay[0]:
            a, b = sum(lay[0][n]), sum(lay[1][n])
            if b > 0:
                layer.append(a / b - 1)
        for k in SELECTIONS:
            per = np.array([np.median(r[k]) for r in h["steps"]])
            spread.append(float(np.std(per) / np.median(per)))
    c, s, la = (np.abs(np.array(v)) for v in (cell, speed, layer))
    return {
        "within_10": float(np.mean(c <= 0.10)),
        "median_abs": float(np.median(c)),
        "speedup_within_5": float(np.mean(s <= 0.05)),
        "layer_median_abs": float(np.median(la)),
        "round_spread_median": float(np.median(spread)),
        "round_spread_max": float(np.max(spread)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", type=Path, required=True, help="a profile written by `fedelastic profile measure`")
    parser.add_argument("--models", nargs="*", default=list(HELD_OUT))
    parser.add_argument("--reps", type=int, default=8, help="interleaved rounds (2 timed steps per selection each)")
    parser.add_argument("--layer-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "heldout.json")
    parser.add_argument("--markdown", type=Path, help="also write the tables (markdown) here")
    parser.add_argument("--refit-samples", type=Path, help="refit [sampled] of --profile to these samples (JSON of --save-samples) first")
    parser.add_argument("--tuning-input-size", type=int, help="with --refit-samples: the input size the profile's tables were measured at (--input-size of profile measure)")
    parser.add_argument("--reuse", type=Path, help="an earlier --out: reuse its real steps and layer tables, re-price only")
    parser.add_argument("--interleave", type=float, metavar="MINUTES",
                        help="time the tuning tables, kernel samples and held-out cells interleaved in rounds for "
                        "about MINUTES, write them to --data, then fit a profile to them (--profile: the base whose "
                        "other keys it keeps) and price")  # fmt: skip
    parser.add_argument("--kernel-share", type=float, default=0.45, help="with --interleave: share of a round spent on kernel samples")
    parser.add_argument("--tuning", nargs="*", default=list(TUNING), help="the tuning models (interleaved runs)")
    parser.add_argument("--data", type=Path, nargs="+", default=[ROOT / "benchmarks" / "results" / "heldout_interleaved.json"],
                        help="an interleaved run's timings (written by --interleave; read by --from-data, "
                        "several runs pooled round by round)")  # fmt: skip
    parser.add_argument("--from-data", action="store_true", help="fit and price from --data (no timing)")
    parser.add_argument("--cold-mib", type=float, default=0.0,
                        help="with --interleave: also time every kernel configuration with a cache flush of this many "
                        "MiB before each timed call")  # fmt: skip
    parser.add_argument("--cold", action="store_true", help="fit the kernels' cold times (a run with --cold-mib)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    zoo = import_torchvision()
    data = None
    if args.interleave:
        log = lambda m: print(m, flush=True)  # noqa: E731
        data = time_interleaved(zoo, args.models, args.tuning, args.interleave, args.kernel_share, 0, log, args.cold_mib)
        args.data[0].parent.mkdir(parents=True, exist_ok=True)
        args.data[0].write_text(json.dumps(data))
    elif args.from_data:
        data = pooled([json.loads(p.read_text()) for p in args.data])
    if data is not None:
        args.profile = interleaved_profile(data, args.profile, args.out.with_suffix(".toml"), args.tuning, args.cold)
    elif args.refit_samples:
        args.profile = refit(args.profile, args.refit_samples, args.tuning_input_size)
    profile = load_profile(args.profile)
    if not profile.sampled:
        raise SystemExit(f"{args.profile}: no [sampled] kernel predictors (measure it without --no-kernel-samples)")
    profiles = {"after (sampled kernels)": profile, "before (fitted kernel classes)": dataclasses.replace(profile, sampled={})}
    t0 = time.perf_counter()
    earlier = {r["model"]: r for r in json.loads(args.reuse.read_text())["rows"]} if args.reuse else {}
    if data is not None:
        earlier, args.reuse = interleaved_rows(data), args.data[0]
    rows = []
    for name in args.models:
        if args.reuse and name not in earlier:
            continue
        log = lambda m: print(m, flush=True)  # noqa: E731
        rows.append(evaluate(name, zoo, profiles, args.reps, args.layer_repeats, log, earlier.get(name)))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".partial.json").write_text(json.dumps(rows))  # kept if a later model fails
    import platform

    res = {
        "command": "python " + " ".join(["benchmarks/heldout.py", *sys.argv[1:]]),
        "real_from": str(args.reuse) if args.reuse else "this run",
        "date": time.strftime("%Y-%m-%d"),
        "host": f"{platform.node()}, {platform.machine()}",
        "torch": torch.__version__,
        "profile": str(args.profile),
        "profile_models": ", ".join(profile.measured),
        "out": str(args.out),
        "wall_s": time.perf_counter() - t0,
        "summary": {label: summary(rows, label, band(p)) for label, p in profiles.items()},
        "rows": rows,
    }
    if data is not None:
        res["noise"] = noise_floor(data)
        res["rounds"] = data["rounds"]
        res["kernels_timed"] = len(data["kernels"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    text = markdown(res)
    if args.markdown:
        args.markdown.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
