"""Accelerated ElasticTrainer's time claim at the paper's regime: elastic_layer against elastic_tensor.

    python benchmarks/reproduce/accelerated_elastictrainer/run.py [--seeds 5] [--out .../result.json]

For ResNet-50, MobileNetV2 and ViT-B/16 at 224x224, batch 4, 200 classes (the shape of the TX2
traces), on the built-in ``jetson_tx2`` profile whose measured per-layer tables price every layer:

1. One ``CostModel`` both selects and charges: ``elastic_tensor`` and ``elastic_layer`` (their own
   ``select()``) run at rho 0.4 / 0.5 / 0.6 on the same importance vector (log-normal per tensor,
   one draw per seed; a layer's importance is the sum of its tensors').
2. **Independent time.** Each selection read off the real TX2 trace of full training with
   ``../elastictrainer_time/run.py``'s ``TraceReading`` (forward + the backward ops the selection
   needs; no cost model). The reduction ``1 - T_layer / T_tensor`` is the claim's figure.
3. **Ablation.** Per op type, the trace time each selection pays in the backward, so that a gap
   (or its absence) is traced to the kernels that make it.
4. **Second device, real steps.** The H100 pairs in ``benchmarks/data/h100/gpu_*.json`` (both
   strategies priced by the batch's measured table, then timed for real, median of 7 steps).

Writes ``result.json`` beside this file and prints the tables the README quotes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.models import describe_model  # noqa: E402
from fedelastic.profiling.chrome_trace import project_layer_names  # noqa: E402
from fedelastic.selection.strategy import SelectionContext, make_strategy  # noqa: E402

_spec = importlib.util.spec_from_file_location("et_time", HERE.parent / "elastictrainer_time" / "run.py")
et_time = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(et_time)  # TraceReading, per_layer, TRACES, MODELS

RHOS = (0.4, 0.5, 0.6)
BATCH, CLASSES, SIZE = 4, 200, 224
STRATEGIES = ("elastic_tensor", "elastic_layer", "elastic_artifact")


def backward_by_kind(reading, w, b, a) -> dict[str, float]:
    """Trace time (ms per step) of the backward ops a selection keeps, by the reading's op kind."""
    picked = np.flatnonzero(a)
    deepest = reading.layer_pos[picked].min() if picked.size else np.inf
    out: dict[str, float] = {}
    for backward, layer, pos, kind, dur in reading.rows:
        if not backward or not picked.size:
            continue
        if kind == "weight_grad":
            keep = bool(w[layer])
        elif kind == "bias_grad":
            keep = bool(b[layer])
        elif kind == "norm_grad":
            keep = pos >= deepest
        else:
            kind = "error_grad"
            keep = pos > deepest or pos == -np.inf
        if keep:
            out[kind] = out.get(kind, 0.0) + dur / reading.steps / 1e3
    return out


def run_model(name: str, trace_file: str, seeds: int) -> dict:
    device = load_profile(ROOT / "device_profiles" / "jetson_tx2.toml")
    info = describe_model(name, num_classes=CLASSES, input_size=SIZE)
    cost = CostModel(info, device, BATCH, optimizer="momentum", bn_mode="frozen")
    layers = project_layer_names(name)
    reading = et_time.TraceReading(et_time.TRACES / f"{trace_file}.trace.json.gz", layers)
    full = np.ones(info.num_tensors)
    t_full, trace_full = cost.step_time_s(full), reading.step_us(*et_time.per_layer(info, layers, full))
    out = {"model": name, "full_step_ms_model": 1e3 * t_full, "full_step_ms_trace": trace_full / 1e3, "rhos": {}}
    for rho in RHOS:
        rows = []
        for seed in range(seeds):
            importance = np.random.default_rng(seed).lognormal(0.0, 1.0, info.num_tensors)
            row: dict = {"seed": seed}
            for strat in STRATEGIES:
                ctx = SelectionContext(info, cost, 0, np.random.default_rng(seed))
                ctx.importance = importance
                sel = make_strategy(strat, {"rho": rho}).select(ctx)
                sel_layers = et_time.per_layer(info, layers, sel.ratios)
                row[strat] = {
                    "tensors": int((sel.ratios > 0).sum()),
                    "layers": int(len(set(info.tensor_layer[sel.ratios > 0].tolist()))),
                    "importance": float(importance[sel.ratios > 0].sum()),
                    "step_ms_model": 1e3 * cost.step_time_s(sel.ratios),
                    "step_ms_trace": reading.step_us(*sel_layers) / 1e3,
                    "backward_ms_trace_by_kind": backward_by_kind(reading, *sel_layers),
                }
            t, lay = row["elastic_tensor"], row["elastic_layer"]
            row["reduction_model"] = 1 - lay["step_ms_model"] / t["step_ms_model"]
            row["reduction_trace"] = 1 - lay["step_ms_trace"] / t["step_ms_trace"]
            row["importance_ratio"] = lay["importance"] / t["importance"] if t["importance"] else float("nan")
            art = row["elastic_artifact"]  # the published ElasticTrainer: its own prior and DP
            row["artifact_reduction_model"] = 1 - lay["step_ms_model"] / art["step_ms_model"]
            row["artifact_reduction_trace"] = 1 - lay["step_ms_trace"] / art["step_ms_trace"]
            row["artifact_overrun_model"] = art["step_ms_model"] / (rho * 1e3 * t_full) - 1
            row["artifact_importance_ratio"] = lay["importance"] / art["importance"] if art["importance"] else float("nan")
            rows.append(row)
        keys = ("reduction_model", "reduction_trace", "importance_ratio", "artifact_reduction_model",
                "artifact_reduction_trace", "artifact_overrun_model", "artifact_importance_ratio")  # fmt: skip
        agg = {k: float(np.mean([r[k] for r in rows])) for k in keys}
        agg.update({f"{k}_min": float(np.min([r[k] for r in rows])) for k in ("reduction_trace", "artifact_reduction_trace")})
        agg.update({f"{k}_max": float(np.max([r[k] for r in rows])) for k in ("reduction_trace", "artifact_reduction_trace")})
        out["rhos"][str(rho)] = {"per_seed": rows, **agg}
    return out


def h100_pairs() -> list[dict]:
    """Real H100 step times of the two strategies' selections at equal predicted time (all batches)."""
    pairs = []
    for path in sorted((ROOT / "benchmarks" / "data" / "h100").glob("gpu_*.json")):
        raw = json.loads(path.read_text())
        if "batches" not in raw:
            continue
        for b, run in raw["batches"].items():
            by = {}
            for e in run.get("elastic", []):
                by.setdefault(e["rho"], {})[e["strategy"]] = e
            for rho, v in by.items():
                t, lay = v.get("elastic_tensor"), v.get("elastic_layer")
                if not (t and lay and t["real"] and lay["real"]):
                    continue
                pairs.append({"model": raw["model"], "batch": int(b), "rho": rho,
                              "real_tensor_ms": 1e3 * t["real"]["step_s"], "real_layer_ms": 1e3 * lay["real"]["step_s"],
                              "pred_tensor_ms": 1e3 * t["pred_step_s"], "pred_layer_ms": 1e3 * lay["pred_step_s"],
                              "reduction_real": 1 - lay["real"]["step_s"] / t["real"]["step_s"],
                              "spread_ms": [1e3 * t["real"]["spread"], 1e3 * lay["real"]["spread"]]})  # fmt: skip
    return pairs


def per_seed_mean(group: dict):
    """``mean(strategy, key)``: the mean of ``key`` of one strategy over a (model, rho) group's draws."""

    def mean(strat: str, k: str) -> float:
        return float(np.mean([r[strat][k] for r in group["per_seed"]]))

    return mean


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "result.json"))
    args = ap.parse_args(argv)
    start = time.time()
    models = [run_model(m, f, args.seeds) for m, f in et_time.MODELS.items()]
    h100 = h100_pairs()
    doc = {"date": time.strftime("%Y-%m-%d"), "seeds": args.seeds, "wall_s": time.time() - start, "tx2": models, "h100": h100}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    def idealised(m: dict, rho: str, g: dict, mean) -> str:
        return (f"{mean('elastic_tensor', 'tensors'):.0f} / {mean('elastic_tensor', 'layers'):.0f} | "
                f"{mean('elastic_layer', 'tensors'):.0f} / {mean('elastic_layer', 'layers'):.0f} | "
                f"{mean('elastic_tensor', 'step_ms_model'):.0f} / {mean('elastic_layer', 'step_ms_model'):.0f} | "
                f"{mean('elastic_tensor', 'step_ms_trace'):.0f} / {mean('elastic_layer', 'step_ms_trace'):.0f} | "
                f"{100 * g['reduction_trace']:+.1f}% [{100 * g['reduction_trace_min']:+.1f}, {100 * g['reduction_trace_max']:+.1f}] | "
                f"{g['importance_ratio']:.3f}")  # fmt: skip

    def artifact(m: dict, rho: str, g: dict, mean) -> str:
        return (f"{mean('elastic_artifact', 'tensors'):.0f} | "
                f"{mean('elastic_artifact', 'step_ms_model'):.0f} / {mean('elastic_layer', 'step_ms_model'):.0f} | "
                f"{100 * g['artifact_overrun_model']:+.1f}% | {100 * g['artifact_reduction_model']:+.1f}% | "
                f"{mean('elastic_artifact', 'step_ms_trace'):.0f} / {mean('elastic_layer', 'step_ms_trace'):.0f} | "
                f"{100 * g['artifact_reduction_trace']:+.1f}% [{100 * g['artifact_reduction_trace_min']:+.1f}, "
                f"{100 * g['artifact_reduction_trace_max']:+.1f}] | {g['artifact_importance_ratio']:.3f}")  # fmt: skip

    tables = [
        ("tensors / layers (tensor) | tensors / layers (layer) | step ms model (tensor / layer) | step ms TX2 trace "
         "(tensor / layer) | reduction, trace [min, max] | importance kept by layer", idealised),
        ("tensors (artifact) | step ms, model (artifact / layer) | artifact's step over rho x full (model) | reduction, "
         "model | step ms, TX2 trace (artifact / layer) | reduction, trace [min, max] | importance, layer / artifact", artifact),
    ]  # fmt: skip
    for header, cells in tables:
        print(f"\n| model | rho | {header} |\n" + "|---" * (header.count("|") + 3) + "|")
        for m in models:
            for rho, g in m["rhos"].items():
                print(f"| {m['model']} | {rho} | {cells(m, rho, g, per_seed_mean(g))} |")
    print("\nbackward ms per step kept, by op kind (TX2 trace, seed 0):")
    for m in models:
        for rho, g in m["rhos"].items():
            r0 = g["per_seed"][0]
            print(f"  {m['model']} rho {rho}: tensor {json.dumps({k: round(v, 1) for k, v in r0['elastic_tensor']['backward_ms_trace_by_kind'].items()})}"
                  f"  layer {json.dumps({k: round(v, 1) for k, v in r0['elastic_layer']['backward_ms_trace_by_kind'].items()})}")  # fmt: skip
    print("\n| model | batch | rho | real ms (tensor / layer) | reduction, real |")
    print("|---|---|---|---|---|")
    for p in h100:
        print(f"| {p['model']} | {p['batch']} | {p['rho']} | {p['real_tensor_ms']:.1f} / {p['real_layer_ms']:.1f} | {100 * p['reduction_real']:+.1f}% |")
    red = np.array([p["reduction_real"] for p in h100])
    print(f"H100 pairs {len(red)}: median {100 * np.median(red):+.1f}%, max {100 * red.max():+.1f}%, min {100 * red.min():+.1f}%")
    print(f"wrote {args.out} in {doc['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
