"""Does the selector's counted work predict its time? (issue 41 section 5, the check half)

    python benchmarks/selector_cost.py [--repeats 7] [--out benchmarks/results/selector_cost.json]

The device is charged a selection's work as counted operations (``ctx.ops``: the exact selector counts
what it does, the artifact DP too; the grid DP and greedy by formula, ``strategies/budget.py``'s ``solver_ops``) plus
cost-model evaluations, priced today at the device's *tensor* rate (``peak_flops * efficiency``,
``CostModel.selector_time_s``). Here, for each strategy and solver on the paper's models (``jetson_tx2``
at 224x224, batch 4, importance draw 0, rho 0.4 / 0.5 / 0.6):

* the counted operations and evaluations of one ``select()``;
* its thread CPU time on this host (median of ``--repeats`` calls, one torch thread);
* the host's implied time per counted operation (``time / ops``) and how much it varies across instances:
  if counted operations predict the time, it is about constant;
* the two pricings' predictions for this host, against the measured time: *before*, the same work at
  the host's measured ``torch.mm`` peak (``fedelastic.profiling.measure.measure_peak_flops``, efficiency 1: the
  tensor rate a profile without ``compute.scalar_ops_per_s`` is priced at); *after*, at the host's scalar
  rate as ``fedelastic profile measure`` measures it (``fedelastic.profiling.measure.measure_scalar_rate``, the exact
  DP on a synthetic 160-tensor instance), measured at the start and the end of the run (their mean).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import _OPS_PER_EVALUATION_PER_TENSOR, CostModel  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.models import describe_model  # noqa: E402
from fedelastic.profiling.measure import measure_peak_flops, measure_scalar_rate  # noqa: E402
from fedelastic.selection.strategy import SelectionContext, make_strategy  # noqa: E402

MODELS = ("resnet50", "mobilenetv2", "vit_b16")
ARMS = (("elastic_tensor", "exact"), ("elastic_layer", "exact"), ("elastic_tensor", "grid"), ("elastic_artifact", "artifact_dp"))
RHOS = (0.4, 0.5, 0.6)


def one(cost: CostModel, importance: np.ndarray, strategy: str, solver: str, rho: float, repeats: int) -> dict:
    """Counted work and host thread time of one ``select()``."""
    times, work = [], (0, 0.0)
    for _ in range(repeats):
        ctx = SelectionContext(cost.info, cost, 0, np.random.default_rng(0))
        ctx.importance = importance
        strat = make_strategy(strategy, {"rho": rho, "solver": solver})
        before = cost.evaluations
        t0 = time.thread_time()
        strat.select(ctx)
        times.append(time.thread_time() - t0)
        work = (cost.evaluations - before, ctx.ops)
    evaluations, ops = work
    counted = evaluations * _OPS_PER_EVALUATION_PER_TENSOR * cost.info.num_tensors + ops
    return {"strategy": strategy, "solver": solver, "rho": rho, "evaluations": int(evaluations), "ops": float(ops),
            "counted": float(counted), "host_s": float(np.median(times)), "tx2_priced_s": cost.selector_time_s(evaluations, ops)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "selector_cost.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    peak, peak_source = measure_peak_flops(clock="cpu")
    rates = [measure_scalar_rate(clock="cpu")[0]]
    rows = []
    tx2 = load_profile(ROOT / "device_profiles" / "jetson_tx2.toml")
    for name in MODELS:
        info = describe_model(name, num_classes=200, input_size=224)
        cost = CostModel(info, tx2, 4, optimizer="momentum", bn_mode="frozen")
        importance = np.random.default_rng(0).lognormal(0.0, 1.0, info.num_tensors)
        for strategy, solver in ARMS:
            for rho in RHOS:
                row = one(cost, importance, strategy, solver, rho, args.repeats)
                row.update(model=name, tensors=info.num_tensors, host_peak_priced_s=row["counted"] / peak)
                rows.append(row)
                print(f"{name} {strategy}/{solver} rho {rho}: {row['counted']:.3g} ops, host {1e3 * row['host_s']:.1f} ms, "
                      f"{1e9 * row['host_s'] / row['counted']:.2f} ns/op, priced at the host peak {1e3 * row['host_peak_priced_s']:.4f} ms", flush=True)  # fmt: skip
    rates.append(measure_scalar_rate(clock="cpu")[0])
    rate = float(np.mean(rates))
    for r in rows:
        r["host_scalar_priced_s"] = r["counted"] / rate
    per_op = np.array([r["host_s"] / r["counted"] for r in rows])

    def spread(x: np.ndarray) -> dict:
        return {"median": float(np.median(x)), "min": float(x.min()), "max": float(x.max()),
                "within_2x": float(np.mean((x >= 0.5) & (x <= 2.0)))}  # fmt: skip

    under = np.array([r["host_s"] / r["host_peak_priced_s"] for r in rows])
    after = np.array([r["host_s"] / r["host_scalar_priced_s"] for r in rows])
    big = np.array([r["host_s"] / r["host_scalar_priced_s"] for r in rows if r["host_s"] >= 0.02])
    doc = {"date": time.strftime("%Y-%m-%d"), "load_average": os.getloadavg(), "host_peak_flops": peak, "host_peak_source": peak_source,
           "host_scalar_rates": rates, "rows": rows,
           "ns_per_op": {"median": 1e9 * float(np.median(per_op)), "min": 1e9 * float(per_op.min()), "max": 1e9 * float(per_op.max())},
           "host_over_peak_priced": spread(under), "host_over_scalar_priced": spread(after),
           "host_over_scalar_priced_20ms_up": spread(big) | {"n": int(big.size)}}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1))
    keys = ("load_average", "host_peak_flops", "host_scalar_rates", "ns_per_op", "host_over_peak_priced",
            "host_over_scalar_priced", "host_over_scalar_priced_20ms_up")  # fmt: skip
    print(json.dumps({k: doc[k] for k in keys}, indent=1))
    for solver in sorted({r["solver"] for r in rows}):
        sub = [r for r in rows if r["solver"] == solver]
        x = np.log([r["counted"] for r in sub])
        y = np.log([r["host_s"] for r in sub])
        slope = float(np.polyfit(x, y, 1)[0]) if len(set(x)) > 1 else float("nan")
        print(f"{solver}: {len(sub)} instances, ns/op {1e9 * min(r['host_s'] / r['counted'] for r in sub):.2f}-"
              f"{1e9 * max(r['host_s'] / r['counted'] for r in sub):.2f}, log-log slope of time on counted ops {slope:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
