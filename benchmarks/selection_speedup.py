"""Does an elastic_tensor selection make a real training step as much faster as the cost model says? (issue 4)

    python benchmarks/selection_speedup.py [--threads 1] [--repeats 21] [--out-dir benchmarks/results]

One command, two parts.

**Part 1: predicted vs measured speedup on this host.** For a ResNet-style model (the ResNet-50
topology, blocks 3-4-6-3, at width 16 and 64x64 input) and a MobileNetV2 (width 0.5, 96x96
input), batch 8, sized so that a full training step takes ~50-300 ms on one core:

1. Data: a fixed batch of the embedded digits (8x8 grey), bilinearly upsampled to the model's
   input size and repeated to 3 channels; 10 classes. The model first takes a few full SGD steps
   on other digit batches, so the importance below is that of a model that has started to adapt.
2. Host profile: fedelastic's profiler on this machine (:func:`fedelastic.profiling.measure.measure_layers`,
   per-layer fwd/dx/dw of exactly this model, batch and thread count; then
   :func:`fedelastic.profiling.roofline_fit.fit_roofline` for the roofline numbers the measured table does
   not cover, i.e. the optimizer update). The profile is written beside the results
   (``host_cpu.toml``, with :func:`fedelastic.profiling.writer.build_profile_dict` and
   :func:`~fedelastic.profiling.writer.write_profile`, as ``fedelastic profile measure`` writes one).
3. Importance: :func:`fedelastic.train.trainer.importance_probe` (the real probe: full backward, one
   real SGD step with momentum 0.9 and weight decay 5e-4, second backward, state restored).
4. For rho in {0.3, 0.4, 0.5, 0.7, 1.0}: ``elastic_tensor``'s ``select()`` on a
   :class:`~fedelastic.cost.costmodel.CostModel` of the host profile. Predicted step time =
   ``cost.step_time_s(ratios)``; predicted speedup = full / selection.
5. Measured: each selection applied exactly as the trainer applies it
   (:class:`fedelastic.train.trainer._Applied`: ``requires_grad=False`` on unselected tensors, norm
   layers with no trained tensor in eval mode), then zero_grad + forward + loss + backward +
   optimizer step (SGD, momentum 0.9). The configurations (full and every rho) are interleaved
   round-robin, ``--repeats`` rounds after warm-up rounds, so drift on this shared machine hits
   them alike; the median per configuration is kept. Two clocks: CPU time of the calling thread
   (``time.thread_time``; with one torch thread autograd runs CPU backward on the caller, so this
   is the work done, robust to other jobs on the machine; the profile is measured with this
   clock too) and wall time. Also the autograd node count of each configuration
   (:func:`fedelastic.train.trainer.count_backward_nodes`), a noise-free proxy of backward work.

**Part 2: selector and cost-model speed** on ResNet-50 (214 trainable tensors at 32x32: Keras'
320 variables include the 106 BN moving statistics), a deeper ResNet (blocks 3-4-13-3, 298
tensors, "about 300") and ResNet-101 (418), priced on the built-in ``jetson_tx2`` profile
(batch 4) with a given importance (seeded log-normal): the median time of
:func:`fedelastic.selection.budgeted.select_exact` directly (and its objective against the former
1000-unit grid selector and a 100,000-unit one, issue 7) and of every registered strategy's
``select()`` (TinyTrain with a seeded per-channel Fisher), and the pricing rate
(``step_time_s`` + ``peak_memory_bytes`` of random selections per second).

Writes ``selection_speedup.json`` and ``host_cpu.toml`` into ``--out-dir`` and prints
markdown tables (pasted into benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.data import load_dataset  # noqa: E402
from fedelastic.devices.profile import Quantity, get_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.models import build_model  # noqa: E402
from fedelastic.profiling.measure import host_memory_available, measure_layers, measure_peak_flops  # noqa: E402
from fedelastic.profiling.roofline_fit import _start_device, fit_roofline  # noqa: E402
from fedelastic.profiling.writer import build_profile_dict, measured_by, write_profile  # noqa: E402
from fedelastic.selection.budgeted import select_exact  # noqa: E402
from fedelastic.selection.strategy import SelectionContext, available, make_strategy  # noqa: E402
from fedelastic.train.trainer import _Applied, count_backward_nodes, importance_probe, ordered_params  # noqa: E402

RHOS = (0.3, 0.4, 0.5, 0.7, 1.0)
MODELS = {
    # key: (factory, options, input size, batch, description)
    "resnet50_w16_64px": (
        "resnet_small",
        {"blocks": (3, 4, 6, 3), "width": 16},
        64,
        8,
        "ResNet-50 topology (blocks 3-4-6-3, 214 tensors) at width 16, 64x64 input",
    ),
    "mobilenetv2_a0.5_96px": ("mobilenetv2", {"width_mult": 0.5}, 96, 8, "MobileNetV2 width 0.5, 96x96 input"),
}
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 5e-4


# ----------------------------------------------------------------------------- data


def digits_batches(size: int, batch: int, count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of digits upsampled to ``size`` x ``size``, 3 channels, roughly standardised."""
    ds = load_dataset("digits")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        idx = rng.choice(len(ds), batch, replace=False)
        x = torch.from_numpy(ds.x[idx])
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
        out.append(((x - 0.3) / 0.4, torch.from_numpy(ds.y[idx])))
    return out


# ----------------------------------------------------------------------------- part 1


def time_configs(model, info, params, batch, selections: dict, repeats: int, warmup: int) -> dict:
    """Median CPU and wall time of a training step under each selection, interleaved round-robin."""
    x, y = batch
    opt = torch.optim.SGD(params, lr=1e-4, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    cpu = {k: [] for k in selections}
    wall = {k: [] for k in selections}
    nodes = {}
    for r in range(warmup + repeats):
        for key, sel in selections.items():
            applied = _Applied(model, info, params, sel, "train")  # trained from scratch: BN statistics train
            c0, w0 = time.thread_time(), time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            if sel.mask.any():  # rho at or below the forward share selects nothing: a forward-only step
                loss.backward()
                applied.step(opt)
            c1, w1 = time.thread_time(), time.perf_counter()
            if r >= warmup:
                cpu[key].append(c1 - c0)
                wall[key].append(w1 - w0)
            if key not in nodes:
                opt.zero_grad(set_to_none=True)
                nodes[key] = count_backward_nodes(F.cross_entropy(model(x), y))
    for p in params:
        p.requires_grad_(True)
    model.train()
    return {
        k: {
            "cpu_s": float(np.median(cpu[k])),
            "wall_s": float(np.median(wall[k])),
            "cpu_iqr_s": float(np.subtract(*np.percentile(cpu[k], [75, 25]))),
            "nodes": nodes[k],
        }
        for k in selections
    }


def part1(args) -> tuple[dict, dict]:
    from fedelastic.selection.strategy import Selection

    torch.set_num_threads(args.threads)
    clock = "cpu" if args.threads == 1 else "wall"
    built = {}
    tables = {}
    for key, (factory, options, size, bs, _desc) in MODELS.items():
        torch.manual_seed(0)
        model = build_model(factory, num_classes=10, in_channels=3, input_size=size, **options)
        data = digits_batches(size, bs, 12, seed=0)
        params = list(model.parameters())
        opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        model.train()
        for x, y in data[1:]:  # a few full steps: the probe sees a model that has started to adapt
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        info = describe(model, data[0][0][:1], model_name=key)
        print(f"[{key}] measuring per-layer times ({len(info.layers)} layers, {info.num_tensors} tensors)", flush=True)
        tables[key] = measure_layers(
            model,
            data[0][0],
            model_name=key,
            target=data[0][1],
            repeats=args.profile_repeats,
            warmup=2,
            clock=clock,
            source=f"fedelastic.profiling.measure.measure_layers on this host, batch {bs}, {size}x{size}, "
            f"{args.threads} thread(s), {clock} clock, {time.strftime('%Y-%m-%d')}",
        )
        built[key] = (model, info, data)
    # what `fedelastic profile measure` does (measure_profile), for two models and a real batch:
    # GEMM peak, available memory, a roofline fit bounded by the peak, then a schema-v1 profile
    peak = measure_peak_flops(clock=clock)
    fit = fit_roofline([(built[k][1], tables[k]) for k in built], _start_device(peak[0]), max_peak_eff=peak[0])
    raw = build_profile_dict(
        "host_cpu",
        tables=tables,
        fit=fit,
        peak_flops=peak,
        memory=host_memory_available(),
        measured_by=measured_by(args.threads, clock),
        display_name=f"this benchmark host ({args.threads} torch thread(s))",
        notes="Written by benchmarks/selection_speedup.py: one table per benchmarked model, each measured on "
        "a batch of upsampled digits; the roofline is fitted to both tables.",
    )
    host = write_profile(raw, args.out_dir / "host_cpu.toml")

    results: dict = {
        "fit": {
            "peak_eff_gflops": fit.peak_eff / 1e9,
            "bandwidth_gbs": fit.mem_bandwidth / 1e9,
            "launch_us": fit.launch_overhead * 1e6,
            "median_rel_err": fit.median_rel_err,
            "gemm_peak_gflops": peak[0] / 1e9,
        },
        "models": {},
    }
    for key, (model, info, data) in built.items():
        factory, options, size, bs, desc = MODELS[key]
        cost = CostModel(info, host, bs)
        assert cost.measured is not None
        params = ordered_params(model, info)
        x, y = data[0]
        probe_opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
        importance = importance_probe(model, info, probe_opt, x, y)
        n = info.num_tensors
        selections = {"full": Selection.from_mask(np.ones(n))}
        for rho in RHOS:
            strategy = make_strategy("elastic_tensor", {"rho": rho})
            ctx = SelectionContext(info, cost, 0, np.random.default_rng(0), importance=importance)
            selections[f"rho={rho}"] = strategy.select(ctx)
        print(f"[{key}] timing {len(selections)} configurations x {args.repeats} interleaved repeats", flush=True)
        measured = time_configs(model, info, params, (x, y), selections, args.repeats, args.warmup)
        full_pred = cost.full_step_time_s()
        rows = []
        for name, sel in selections.items():
            pred = cost.step_time_s(sel.ratios)
            m = measured[name]
            deepest = int(np.flatnonzero(sel.mask)[0]) if sel.mask.any() else -1
            rows.append(
                {
                    "config": name,
                    "tensors": int(sel.mask.sum()),
                    "deepest": deepest,
                    "pred_step_ms": pred * 1e3,
                    "pred_speedup": full_pred / pred,
                    "meas_cpu_ms": m["cpu_s"] * 1e3,
                    "meas_cpu_iqr_ms": m["cpu_iqr_s"] * 1e3,
                    "meas_wall_ms": m["wall_s"] * 1e3,
                    "meas_speedup_cpu": measured["full"]["cpu_s"] / m["cpu_s"],
                    "meas_speedup_wall": measured["full"]["wall_s"] / m["wall_s"],
                    "nodes": m["nodes"],
                }
            )
        for r in rows:
            r["ratio_cpu"] = r["meas_speedup_cpu"] / r["pred_speedup"]
            r["ratio_wall"] = r["meas_speedup_wall"] / r["pred_speedup"]
            r["nodes_ratio"] = rows[0]["nodes"] / r["nodes"] if r["nodes"] else float("inf")  # no backward at all
        t = tables[key]
        results["models"][key] = {
            "description": desc,
            "factory": factory,
            "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
            "input_size": size,
            "batch_size": bs,
            "tensors": n,
            "layers": len(info.layers),
            "profiled_step_ms": t.step_s * 1e3,
            "profiled_forward_ms": t.forward_s * 1e3,
            "pred_full_ms": full_pred * 1e3,
            "pred_forward_share": cost.forward_time_s / full_pred,
            "rows": rows,
        }
    return results, raw


# ----------------------------------------------------------------------------- part 2


def _median_time(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


BUDGETED = ("elastic_tensor", "elastic_layer", "random_budget", "static_elastic")


def grid_value(importance, dw, dx, budget, resolution) -> float:
    """Best importance with costs rounded up to ``resolution`` units of the budget (the old grid selector)."""
    from fedelastic.selection.budgeted import to_grid

    n = len(importance)
    w = to_grid(dw, budget, resolution)
    chain = to_grid(np.concatenate([np.cumsum(dx[::-1])[::-1][1:], [0.0]]), budget, resolution)
    dp, best = np.zeros(resolution + 1), 0.0
    for j in range(n - 1, -1, -1):
        if j + 1 < n and importance[j + 1] > 0 and w[j + 1] <= resolution:
            wi = w[j + 1]
            dp[wi:] = np.maximum(dp[wi:], dp[: resolution + 1 - wi] + importance[j + 1])
        room = resolution - w[j] - chain[j]
        if importance[j] > 0 and room >= 0:
            best = max(best, importance[j] + dp[room])
    return float(best)


def time_selectors(info, device, args) -> dict:
    """Median select() times of the selector and every strategy, and the pricing rate, on ``info``."""
    from fedelastic.strategies.budget import tensor_times

    cost = CostModel(info, device, 4)
    rng = np.random.default_rng(0)
    importance = rng.lognormal(0, 1, info.num_tensors) * 1e-3
    fisher = {
        li: rng.lognormal(0, 1, layer.out_channels) * 1e-4
        for li, layer in enumerate(info.layers)
        if layer.kind in ("conv", "linear")
    }
    dw, dx = tensor_times(cost)
    row: dict = {"tensors": info.num_tensors, "layers": len(info.layers)}
    for rho in (0.4, 0.7):
        budget = cost.backward_budget_s(rho)
        row[f"select_exact_rho{rho}_ms"] = 1e3 * _median_time(
            lambda b=budget: select_exact(importance, dw, dx, b, resolution=1000), args.selector_repeats
        )
        # quality (issue 7): against the 1000-unit grid the selector used to solve on, and a 100k-unit one
        b = budget - cost.t_bwd_fixed
        value = float(importance[select_exact(importance, dw, dx, b, resolution=1000)].sum())
        row[f"grid1000_value_only_rho{rho}_ms"] = 1e3 * _median_time(
            lambda b=b: grid_value(importance, dw, dx, b, 1000), args.selector_repeats
        )  # the former 1000-unit grid DP (its value pass alone), timed in the same run for comparison
        row[f"exact_over_grid1000_rho{rho}"] = value / grid_value(importance, dw, dx, b, 1000)
        row[f"exact_over_grid100k_rho{rho}"] = value / grid_value(importance, dw, dx, b, 100_000)

    def run(name: str, cm: CostModel):
        ctx = SelectionContext(info, cm, 0, np.random.default_rng(1), importance=importance, fisher=fisher)
        return make_strategy(name, {"rho": 0.4} if name in BUDGETED else {}).select(ctx)

    few = max(3, args.selector_repeats // 5)
    for name in available():
        reps = few if name in ("sparse_update", "tinytrain") else args.selector_repeats
        row[f"{name}_ms"] = 1e3 * _median_time(lambda n=name: run(n, cost), reps)
    # memory-bound: the device holds half of what the time-optimal rho=0.4 selection needs, so the
    # floor is raised (one re-solve each time) until the selection fits
    need = cost.peak_memory_bytes(run("elastic_tensor", cost).ratios)
    tight = replace(device, memory_train_bytes=Quantity(0.5 * need, "benchmark: half the unconstrained need"))
    cost_tight = CostModel(info, tight, 4)
    row["elastic_tensor_memory_bound_ms"] = 1e3 * _median_time(lambda: run("elastic_tensor", cost_tight), few)
    # pricing rate: random selections (0/1, a tenth of them at half their channels)
    masks = (rng.random((2000, info.num_tensors)) < rng.random((2000, 1))).astype(float)
    masks *= np.where(rng.random(masks.shape) < 0.1, 0.5, 1.0)
    t0 = time.perf_counter()
    done = 0
    while time.perf_counter() - t0 < args.pricing_seconds:
        for r in masks[done % 2000 : done % 2000 + 200]:
            cost.step_time_s(r)
            cost.peak_memory_bytes(r)
        done += 200
    row["pricing_per_s"] = done / (time.perf_counter() - t0)
    return row


def part2(args) -> dict:
    torch.set_num_threads(args.threads)
    device = get_profile("jetson_tx2")
    specs = {
        "resnet50": ("resnet50", {}),
        "resnet_3-4-13-3": ("resnet_small", {"blocks": (3, 4, 13, 3), "width": 64}),
        "resnet101": ("resnet_small", {"blocks": (3, 4, 23, 3), "width": 64}),
    }
    out = {}
    for label, (factory, options) in specs.items():
        model = build_model(factory, num_classes=200, in_channels=3, input_size=32, **options)
        info = describe(model, torch.zeros(1, 3, 32, 32), model_name=label)
        del model
        out[label] = time_selectors(info, device, args)
        print(f"[selector] {label}: {info.num_tensors} tensors done", flush=True)
    return out


# ----------------------------------------------------------------------------- report


def markdown(results: dict) -> str:
    lines = []
    f = results["part1"]["fit"]
    lines.append(
        f"Host profile fit: peak x efficiency {f['peak_eff_gflops']:.1f} GFLOP/s (GEMM {f['gemm_peak_gflops']:.1f}), "
        f"bandwidth {f['bandwidth_gbs']:.1f} GB/s, launch {f['launch_us']:.1f} us, median layer error "
        f"{f['median_rel_err']:.0%} (the measured tables replace the roofline for every layer; the roofline "
        "prices only the optimizer update)."
    )
    for m in results["part1"]["models"].values():
        lines += [
            "",
            f"**{m['description']}**, batch {m['batch_size']}, {m['tensors']} tensors: profiled full step "
            f"{m['profiled_step_ms']:.1f} ms, predicted full step {m['pred_full_ms']:.1f} ms, predicted forward "
            f"share {m['pred_forward_share']:.2f}.",
            "",
            "| config | tensors | deepest | pred. step ms | pred. speedup | meas. step ms (CPU) | meas. speedup (CPU) "
            "| meas./pred. (CPU) | meas. step ms (wall) | meas./pred. (wall) | autograd nodes | nodes full/sel |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in m["rows"]:
            lines.append(
                f"| {r['config']} | {r['tensors']} | {r['deepest']} | {r['pred_step_ms']:.1f} | {r['pred_speedup']:.2f}x "
                f"| {r['meas_cpu_ms']:.1f} ± {r['meas_cpu_iqr_ms'] / 2:.1f} | {r['meas_speedup_cpu']:.2f}x "
                f"| {r['ratio_cpu']:.0%} | {r['meas_wall_ms']:.1f} | {r['ratio_wall']:.0%} | {r['nodes']} "
                f"| {r['nodes_ratio']:.2f}x |"
            )
    p2 = results["part2"]
    names = [k for k in next(iter(p2.values())) if k.endswith("_ms")]
    lines += ["", "| selector / strategy select() (median ms) | " + " | ".join(p2) + " |"]
    lines.append("|---|" + "---|" * len(p2))
    lines.append("| tensors | " + " | ".join(str(r["tensors"]) for r in p2.values()) + " |")
    for n in names:
        lines.append(f"| {n.removesuffix('_ms')} | " + " | ".join(f"{r[n]:.2f}" for r in p2.values()) + " |")
    for n in [k for k in next(iter(p2.values())) if k.startswith("exact_over_")]:
        lines.append(f"| {n} (objective ratio) | " + " | ".join(f"{r[n]:.5f}" for r in p2.values()) + " |")
    lines.append(
        "| pricing rate (step_time_s + peak_memory_bytes per s) | "
        + " | ".join(f"{r['pricing_per_s']:,.0f}" for r in p2.values())
        + " |"
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (fixed for the whole run)")
    ap.add_argument("--repeats", type=int, default=21, help="timed interleaved rounds of every configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    ap.add_argument("--profile-repeats", type=int, default=10, help="repeats of the profiler's measurements")
    ap.add_argument("--selector-repeats", type=int, default=50)
    ap.add_argument("--pricing-seconds", type=float, default=2.0)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--skip-part1", action="store_true", help="selector timings only")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        commit = commit.stdout.strip()
    except OSError:
        commit = ""
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": commit,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "load_avg_start": os.getloadavg()[0],
        "threads": args.threads,
        "command": "python benchmarks/selection_speedup.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    results["part1"] = {"fit": {}, "models": {}} if args.skip_part1 else part1(args)[0]
    results["part2"] = part2(args)
    results["load_avg_end"] = os.getloadavg()[0]
    results["runtime_s"] = time.perf_counter() - t0
    (args.out_dir / "selection_speedup.json").write_text(json.dumps(results, indent=1))
    print(markdown(results) if not args.skip_part1 else json.dumps(results["part2"], indent=1))
    print(
        f"\nruntime {results['runtime_s']:.0f} s, load average {results['load_avg_start']:.1f} -> {results['load_avg_end']:.1f}"
    )


if __name__ == "__main__":
    main()
