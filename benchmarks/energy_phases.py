"""Energy by phase per selection: how far a selection's energy ratio to full training now moves from
its time ratio (issue 41 section 5).

    OMP_NUM_THREADS=1 python benchmarks/energy_phases.py [--out benchmarks/results/energy_phases.json]

For each profile with measured per-layer tables (the shipped ``jetson_tx2``, its tables from the
ElasticTrainer artifact's traces; ``benchmarks/results/host_cpu.toml``, measured on this host), each
model it has a table for, and each selection (``full``, ``last_layer``, ``bn_bias``, and
``elastic_tensor`` at rho 0.4, 0.5, 0.6 on a log-normal importance, seed 0, as
``reproduce/elastictrainer_time`` draws it): the step time (the measured tables), the roofline's
compute-bound share of the kernels the selection's step runs (:meth:`CostModel.compute_share`), and
the energy and time ratios to full training.

**The powers are an example.** No shipped profile has ``power.compute`` / ``power.memory`` (no device
here exposes a power sensor), so each profile gets ``power.compute`` = its ``power.train`` and
``power.memory`` = ``MEMORY_SHARE`` x that: illustrative, neither measured nor from a datasheet. The
shares do not depend on them; for other powers the energy ratio is the time ratio times
``(s P_c + (1 - s) P_m) / (s_full P_c + (1 - s_full) P_m)``.

It also times the pricing this adds: microseconds a call of ``compute_share`` on a new selection,
against the rest of a price-cache miss (``peak_memory_bytes`` + ``step_time_s`` + ``step_macs``), in
the same loop (interleaved), and ``compute_time_s`` on a profile without phase powers (what every
shipped profile pays).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import Quantity, load_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.models import build_with_input, describe_model  # noqa: E402
from fedelastic.selection.strategy import SelectionContext, make_strategy  # noqa: E402

MEMORY_SHARE = 0.6  # example power.memory / power.compute
RHOS = (0.4, 0.5, 0.6)
# profile file -> [(label, ModelInfo factory, batch)]
SETUPS = {
    "device_profiles/jetson_tx2.toml": [
        (name, lambda name=name: describe_model(name, num_classes=200, input_size=224), 4)
        for name in ("resnet50", "mobilenetv2", "vit_b16")
    ],
    "benchmarks/results/host_cpu.toml": [
        ("resnet50_w16_64px", lambda: _host("resnet_small", 64, blocks=(3, 4, 6, 3), width=16, key="resnet50_w16_64px"), 8),
        ("mobilenetv2_a0.5_96px", lambda: _host("mobilenetv2", 96, width_mult=0.5, key="mobilenetv2_a0.5_96px"), 8),
    ],
}


def _host(factory: str, size: int, key: str, **options):
    """A host table's model, as benchmarks/selection_speedup.py describes it (10 classes)."""
    model, shape = build_with_input(factory, num_classes=10, input_size=size, **options)
    return describe(model, torch.zeros(1, *shape), model_name=key)


def selections(info, cost) -> dict[str, np.ndarray]:
    out = {}
    for name, options in (("full", {}), ("last_layer", {}), ("bn_bias", {})):
        out[name] = make_strategy(name, options).select(SelectionContext(info, cost, 0, np.random.default_rng(0))).ratios
    for rho in RHOS:
        rng = np.random.default_rng(0)
        ctx = SelectionContext(info, cost, 0, rng)
        ctx.importance = rng.lognormal(0.0, 1.0, info.num_tensors)
        out[f"elastic_tensor {rho}"] = make_strategy("elastic_tensor", {"rho": rho}).select(ctx).ratios
    return out


def pricing_us(cost: CostModel, plain: CostModel, sels: list[np.ndarray], reps: int) -> dict[str, float]:
    """Microseconds: the share's per-model arrays (once), then medians a call of a price-cache miss,
    of the share on it, and of ``compute_time_s`` without phase powers, interleaved."""
    t0 = time.perf_counter()
    cost.compute_share(sels[0])  # the per-tensor arrays, worked out once per cost model
    once = time.perf_counter() - t0
    times: dict[str, list[float]] = {"miss": [], "share": [], "plain_compute_time": []}
    for _ in range(reps):
        for ratios in sels:
            t0 = time.perf_counter()
            cost.peak_memory_bytes(ratios), cost.step_time_s(ratios), cost.step_macs(ratios)
            t1 = time.perf_counter()
            cost.compute_share(ratios)
            t2 = time.perf_counter()
            plain.compute_time_s(ratios, 1.0)
            t3 = time.perf_counter()
            times["miss"].append(t1 - t0)
            times["share"].append(t2 - t1)
            times["plain_compute_time"].append(t3 - t2)
    return {"once": 1e6 * once, **{k: 1e6 * float(np.median(v)) for k, v in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "energy_phases.json"))
    p.add_argument("--reps", type=int, default=200, help="timing repetitions per selection")
    args = p.parse_args()
    rows, timing = [], {}
    for path, models in SETUPS.items():
        plain = load_profile(ROOT / path)
        pc = plain.power_train_w.value
        device = dataclasses.replace(
            plain,
            power_compute_w=Quantity(pc, "example: power.train"),
            power_memory_w=Quantity(MEMORY_SHARE * pc, f"example: {MEMORY_SHARE} x power.train"),
        )
        for label, factory, batch in models:
            info = factory()
            cost, plain_cost = CostModel(info, device, batch), CostModel(info, plain, batch)
            assert cost.measured is not None and not cost.predicted, f"{path} has no table for {label}"
            sels = selections(info, cost)
            t_full, s_full = cost.step_time_s(sels["full"]), cost.compute_share(sels["full"])
            e_full = cost.energy_j(t_full, 0, 0, compute_s=cost.compute_time_s(sels["full"], t_full))
            for name, ratios in sels.items():
                t = cost.step_time_s(ratios)
                e = cost.energy_j(t, 0, 0, compute_s=cost.compute_time_s(ratios, t))
                phases = cost.roofline_phases_s(ratios)
                rows.append({
                    "profile": plain.name, "model": label, "selection": name,
                    "tensors": int((ratios > 0).sum()), "step_ms": 1e3 * t,
                    "compute_share": cost.compute_share(ratios), "full_compute_share": s_full,
                    "time_ratio": t / t_full, "energy_ratio": e / e_full,
                    "energy_over_time": (e / e_full) / (t / t_full),
                    "phases_compute_rest_s": phases.tolist(),
                    "plain_energy_over_time": plain_cost.energy_j(t, 0, 0, compute_s=plain_cost.compute_time_s(ratios, t))
                    / plain_cost.energy_j(t_full, 0, 0) / (t / t_full),
                })  # fmt: skip
                r = rows[-1]
                print(f"{plain.name:10s} {label:22s} {name:20s} time {r['time_ratio']:.3f} energy "
                      f"{r['energy_ratio']:.3f} (x{r['energy_over_time']:.3f}) share {r['compute_share']:.3f}")  # fmt: skip
            timing[f"{plain.name}/{label}"] = pricing_us(cost, plain_cost, list(sels.values()), args.reps)
            print(f"  pricing, us a call: {timing[f'{plain.name}/{label}']}")
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg": os.getloadavg(),
        "memory_share": MEMORY_SHARE,
        "rows": rows,
        "pricing_us": timing,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"load average {os.getloadavg()}; wrote {args.out}")


if __name__ == "__main__":
    main()
