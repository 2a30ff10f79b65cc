"""ElasticTrainer's time and energy claim at the paper's own regime, and an independent check on the TX2 traces.

    python benchmarks/reproduce/elastictrainer_time/run.py [--seeds 5] [--out benchmarks/reproduce/elastictrainer_time/result.json]

The regime of the paper (Huang et al., MobiSys 2023, and its artifact): ResNet-50, MobileNetV2 and
ViT-B/16 at 224x224, batch 4, 200 classes (CUB-200: 5,994 training images, 1,499 steps an epoch),
re-selection every 4 epochs, on a Jetson TX2. Emulated time needs no host training, so nothing is
shrunk: the models are the project's own definitions of those architectures, priced by the built-in
``jetson_tx2`` profile with its measured per-layer tables (measured at exactly this shape).

For each model and rho in {0.4, 0.5, 0.6}:

1. ``elastic_tensor``'s own ``select()`` on the TX2 cost model, with an importance vector drawn
   per seed (log-normal): under a time budget, the step time of any selection is bounded by
   rho x the full step, so the speedup does not hinge on which tensors win. The spread over
   seeds shows how much it does.
2. Emulated time of one re-selection interval (4 epochs): 4 x 1,499 steps at the selection's step
   time, plus one importance probe and the selector's work, against 4 x 1,499 full steps.
   Energy the same way (the profile's training power, plus its per-MAC term if any).
3. **Independent check.** The same selection read off the real TX2 trace of full training
   (``../shared/data/measured/jetson_tx2``; no fedelastic cost model involved): every op of the
   4 complete steps is attributed to a Keras scope, placed in forward order, and kept if the
   selection needs it: every forward op; a backward op of a scope above the deepest selected
   layer; a selected tensor's own weight-gradient op (Conv2DBackpropFilter,
   DepthwiseConv2dNativeBackpropFilter, BiasAddGrad, a Dense's second MatMul); a norm layer's
   fused gradient op at or above the deepest selected layer; backward ops outside every layer
   (the loss) always. The trace's speedup is full / selection in summed op time. Ops overlap a
   little on the TX2 (summed op time exceeds the step's wall time), so ratios are compared, not
   absolute times.

The tolerances were written before the first run (README beside this file).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.devices.profile import load_profile  # noqa: E402
from fedelastic.models import describe_model  # noqa: E402
from fedelastic.profiling.chrome_trace import project_layer_names  # noqa: E402
from fedelastic.selection.strategy import SelectionContext, make_strategy  # noqa: E402

# ../shared next to the checkout (a worktree sits one level deeper: the first ancestor that has it)
TRACES = next(
    (p / "shared" / "data" / "measured" / "jetson_tx2" for p in ROOT.parents if (p / "shared" / "data" / "measured").is_dir()),
    ROOT.parent / "shared" / "data" / "measured" / "jetson_tx2",
)
MODELS = {"resnet50": "resnet50", "mobilenetv2": "mobilenetv2", "vit_b16": "vit"}  # project name -> trace file
RHOS = (0.4, 0.5, 0.6)
BATCH, CLASSES, SIZE = 4, 200, 224
STEPS_PER_EPOCH = math.ceil(5994 / BATCH)  # CUB-200's training split
INTERVAL_EPOCHS = 4  # the artifact's re-selection interval
# the paper's ResNet-50 / TX2 figures (ALGORITHMS.md, read off its bar charts): hours of training
PAPER_HOURS = {"full": 2.95, 0.4: 0.85, 0.5: 1.26}
WEIGHT_GRAD_OPS = ("Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter")


# ---------------------------------------------------------------------------------------- the trace


def _ops(path: Path) -> list[tuple[float, bool, list[str], str, float]]:
    """(timestamp, backward?, scope path, op type, duration us) of every op in the complete steps."""
    events = json.load(gzip.open(path, "rt"))["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("ph") == "X" and names.get((e["pid"], e["tid"])) == "Steps")
    steps = steps[:-1]  # the last step is partial
    out = []
    for e in events:
        if e.get("ph") != "X" or names.get((e["pid"], e["tid"])) != "TensorFlow Ops":
            continue
        if not any(lo <= e["ts"] < hi for lo, hi in steps):
            continue
        long_name = e["args"].get("long_name", "").split(":")[0]
        backward = long_name.startswith("gradient_tape/")
        parts = long_name.removeprefix("gradient_tape/").split("/")
        out.append((e["ts"], backward, parts, e["name"], float(e["dur"])))
    return out, len(steps)


def _match(parts: list[str], scopes: list[list[str]]) -> int:
    """Index of the longest trainable-layer scope found as consecutive components of ``parts`` (-1: none)."""
    best, best_len = -1, 0
    for i, scope in enumerate(scopes):
        n = len(scope)
        if n > best_len and any(parts[j : j + n] == scope for j in range(len(parts) - n + 1)):
            best, best_len = i, n
    return best


class TraceReading:
    """Per-op attribution of a TF trace to the project's trainable layers, in forward order."""

    def __init__(self, trace: Path, layer_names: list[str]):
        ops, self.steps = _ops(trace)
        scopes = [name.split(".") for name in layer_names]
        position: dict[tuple[str, ...], float] = {}  # scope prefix -> its first forward timestamp
        for ts, backward, parts, _, _ in sorted(ops, key=lambda o: o[0]):
            if backward:
                continue
            for n in range(1, len(parts)):
                position.setdefault(tuple(parts[:n]), ts)
        layer_pos = []
        for scope in scopes:  # a layer's position: its first forward op
            hits = [ts for key, ts in position.items() if _match(list(key), [scope]) == 0]
            layer_pos.append(min(hits) if hits else math.inf)
        self.layer_pos = np.array(layer_pos)
        self.rows = []  # (backward, layer or -1, position of the op's scope, kind, duration)
        for _, backward, parts, op, dur in ops:
            layer = _match(parts[:-1], scopes)
            pos = next((position[tuple(parts[:n])] for n in range(len(parts) - 1, 0, -1) if tuple(parts[:n]) in position), -math.inf)
            if layer >= 0:
                pos = self.layer_pos[layer]
            kind = "other"
            if backward and layer >= 0:
                if op in WEIGHT_GRAD_OPS or any(w in p for p in parts for w in WEIGHT_GRAD_OPS):
                    kind = "weight_grad"
                elif op == "BiasAddGrad":
                    kind = "bias_grad"
                elif op == "MatMul" and parts[-1] == "MatMul_1":
                    kind = "weight_grad"
                elif op.startswith("FusedBatchNormGrad"):
                    kind = "norm_grad"
            self.rows.append((backward, layer, pos, kind, dur))

    def step_us(self, weight_sel: np.ndarray, bias_sel: np.ndarray, any_sel: np.ndarray) -> float:
        """Mean summed op time of one step that trains the layers' selected weights and biases."""
        picked = np.flatnonzero(any_sel)
        deepest = self.layer_pos[picked].min() if picked.size else math.inf
        total = 0.0
        for backward, layer, pos, kind, dur in self.rows:
            if not backward:
                keep = True
            elif not picked.size:
                keep = False
            elif kind == "weight_grad":
                keep = bool(weight_sel[layer])
            elif kind == "bias_grad":
                keep = bool(bias_sel[layer])
            elif kind == "norm_grad":
                keep = pos >= deepest
            else:  # an error-gradient op: needed above the deepest selected layer (or outside every layer)
                keep = pos > deepest or pos == -math.inf
            total += dur if keep else 0.0
        return total / self.steps


# ---------------------------------------------------------------------------------------- emulation


def per_layer(info, cost_layers: list[str], ratios: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight selected, bias selected, anything selected) per trace layer, from tensor ratios."""
    index = {name: i for i, name in enumerate(cost_layers)}
    w, b, a = (np.zeros(len(cost_layers), bool) for _ in range(3))
    for k, r in enumerate(ratios):
        if r <= 0:
            continue
        li = index[info.layers[info.tensor_layer[k]].name]
        role = info.tensor_roles[k]
        a[li] = True
        if role == "weight":
            w[li] = True
        elif role == "bias":
            b[li] = True
    return w, b, a


def run_model(name: str, trace_file: str, seeds: int) -> dict:
    device = load_profile(ROOT / "device_profiles" / "jetson_tx2.toml")
    info = describe_model(name, num_classes=CLASSES, input_size=SIZE)
    assert name in device.measured, f"the TX2 profile has no measured table for {name}"
    cost = CostModel(info, device, BATCH, optimizer="momentum", bn_mode="frozen")
    layers = project_layer_names(name)
    reading = TraceReading(TRACES / f"{trace_file}.trace.json.gz", layers)
    full_ratios = np.ones(info.num_tensors)
    t_full = cost.step_time_s(full_ratios)
    trace_full = reading.step_us(*per_layer(info, layers, full_ratios))
    steps = INTERVAL_EPOCHS * STEPS_PER_EPOCH
    power = device.power_train_w.value
    full_interval_s = steps * t_full
    full_energy = cost.energy_j(full_interval_s, 0, 0, steps * cost.step_macs(full_ratios))
    out = {"model": name, "full_step_ms": 1e3 * t_full, "trace_full_step_ms": trace_full / 1e3,
           "trace_steps": reading.steps, "train_power_w": power, "rhos": {}}  # fmt: skip
    probe_s = cost.probe_time_s("importance")
    for rho in RHOS:
        rows = []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            strategy = make_strategy("elastic_tensor", {"rho": rho})
            ctx = SelectionContext(info, cost, 0, rng)
            ctx.importance = rng.lognormal(0.0, 1.0, info.num_tensors)
            before = cost.evaluations
            sel = strategy.select(ctx)
            selector_s = cost.selector_time_s(cost.evaluations - before, ctx.ops)
            t_sel = cost.step_time_s(sel.ratios)
            interval_s = steps * t_sel + probe_s + selector_s
            energy = cost.energy_j(interval_s, 0, 0, steps * cost.step_macs(sel.ratios))
            trace_sel = reading.step_us(*per_layer(info, layers, sel.ratios))
            rows.append({
                "seed": seed,
                "tensors": int((sel.ratios > 0).sum()),
                "step_speedup_model": t_full / t_sel,
                "step_speedup_trace": trace_full / trace_sel,
                "interval_speedup": full_interval_s / interval_s,
                "energy_ratio": energy / full_energy,
                "probe_share": (probe_s + selector_s) / interval_s,
            })  # fmt: skip
        out["rhos"][str(rho)] = {
            "per_seed": rows,
            **{f"{k}_mean": float(np.mean([r[k] for r in rows])) for k in rows[0] if k != "seed"},
            **{f"{k}_min": float(np.min([r[k] for r in rows])) for k in rows[0] if k != "seed"},
            **{f"{k}_max": float(np.max([r[k] for r in rows])) for k in rows[0] if k != "seed"},
        }
    return out


def _cell(g: dict, k: str, f: str = "{:.2f}") -> str:
    return f"{f.format(g[k + '_mean'])} [{f.format(g[k + '_min'])}, {f.format(g[k + '_max'])}]"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5, help="importance draws per (model, rho)")
    ap.add_argument("--out", default=str(Path(__file__).with_name("result.json")))
    args = ap.parse_args(argv)
    start = time.time()
    results = [run_model(m, f, args.seeds) for m, f in MODELS.items()]
    paper = {str(r): PAPER_HOURS["full"] / PAPER_HOURS[r] for r in (0.4, 0.5)}
    doc = {"date": time.strftime("%Y-%m-%d"), "seeds": args.seeds, "paper_speedup_resnet50": paper,
           "wall_s": time.time() - start, "models": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("| model | full step ms (model / trace sum) | rho | speedup, step (model) | speedup, step (trace) | "
          "speedup, 4-epoch interval | energy ratio | probe share |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for rho, g in r["rhos"].items():
            print(f"| {r['model']} | {r['full_step_ms']:.0f} / {r['trace_full_step_ms']:.0f} | {rho} | "
                  f"{_cell(g, 'step_speedup_model')} | {_cell(g, 'step_speedup_trace')} | {_cell(g, 'interval_speedup')} | "
                  f"{_cell(g, 'energy_ratio')} | {_cell(g, 'probe_share', '{:.4f}')} |")  # fmt: skip
    print(f"paper (ResNet-50, TX2): {paper}; wrote {args.out} in {doc['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
