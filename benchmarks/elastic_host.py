"""Does elastic selection make the host's local training faster, as much as the cost model says? (issue 10)

    python benchmarks/elastic_host.py                    # CPU, 1 torch thread
    python benchmarks/elastic_host.py --device cuda      # the same on a GPU

One client's whole local training, run by fedelastic's trainer (``training.train_local``, as the
Flower client runs it: probes, selection, steps, pricing), with strategy ``full`` and with
``elastic_tensor`` and ``elastic_layer`` at rho = 0.4 (their default reselection interval, 4
epochs: one importance probe per local training here), for 1 and 4 local epochs.

* Model: the ResNet-50 topology at width 16 (``resnet_small``, blocks 3-4-6-3, dropout 0) on
  32x32 RGB SynthDigits, 10 classes, batch 32, BatchNorm frozen; 160 client samples (5 steps an
  epoch); SGD lr 0.05, momentum 0.9, weight decay 5e-4. The model first takes 10 full SGD steps
  on other samples, so the importance is that of a model that has started to learn.
* Cost model: the host's roofline profile measured by issue 4 (``benchmarks/results/host_cpu.toml``:
  fitted on this VM, 1 thread; its measured tables are for other models, so the roofline prices
  this one). The selections are made on it, and the predicted speedup is
  ``train_time_s(full) / train_time_s(elastic)`` (probe and selector work included), plus the
  per-step prediction ``step_time_s``.
* Measured: thread CPU time (``time.thread_time``; with one torch thread autograd runs on the
  calling thread, so this is the work done, robust to other jobs) and wall time, per config the
  median of ``--repeats`` interleaved runs after one warm-up; each run restarts from the same
  weights with the same seed. On CUDA the clock is wall time with synchronisation.

Writes ``--out`` (JSON) and prints a markdown table.
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
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.data import ArrayDataset, load_dataset  # noqa: E402
from fedelastic.devices.profile import get_profile  # noqa: E402
from fedelastic.modelinfo import describe  # noqa: E402
from fedelastic.models.resnet import resnet_small  # noqa: E402
from fedelastic.selection.strategy import make_strategy  # noqa: E402
from fedelastic.train.trainer import LocalTraining, count_backward_nodes, importance_probe, make_optimizer, train_local  # noqa: E402

CONFIGS = (("full", {}), ("elastic_tensor", {"rho": 0.4}), ("elastic_layer", {"rho": 0.4}))
BATCH, SAMPLES = 32, 160


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--epochs", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", default=str(ROOT / "benchmarks" / "results" / "host_cpu.toml"))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    ds = load_dataset("synth_digits", size=2000)
    torch.manual_seed(0)
    model = resnet_small(10, blocks=(3, 4, 6, 3), width=16, dropout=0.0)
    info = describe(model, torch.zeros(1, 3, 32, 32), model_name="resnet_small_3463_w16_32px")
    model.to(dev)
    # a few full steps on other samples first (BatchNorm frozen, as in training)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    for i in range(10):
        sl = slice(SAMPLES + i * BATCH, SAMPLES + (i + 1) * BATCH)
        x, y = torch.from_numpy(ds.x[sl]).to(dev), torch.from_numpy(ds.y[sl]).to(dev)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = ArrayDataset(ds.x[:SAMPLES], ds.y[:SAMPLES])
    cost = CostModel(info, get_profile(args.profile), BATCH, "momentum", "frozen")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run(name: str, options: dict, epochs: int):
        model.load_state_dict(start)
        strategy = make_strategy(name, options)
        sync()
        c0, w0 = time.thread_time(), time.perf_counter()
        r = train_local(
            model,
            info,
            strategy,
            cost,
            data,
            LocalTraining(epochs=epochs, batch_size=BATCH, lr=0.05, momentum=0.9, weight_decay=5e-4, bn_mode="frozen"),
            seed=[0, 1, 0],
        )
        sync()
        return r, time.thread_time() - c0, time.perf_counter() - w0

    report: dict = {
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "profile": Path(args.profile).name,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "results": {},
    }
    # the importance probe alone (what elastic_* pay once per local training here), on the first batch
    probe_cpu, probe_wall = [], []
    x, y = torch.from_numpy(data.x[:BATCH]).to(dev), torch.from_numpy(data.y[:BATCH]).to(dev)
    for rep in range(args.repeats + 1):
        model.load_state_dict(start)
        opt = make_optimizer(list(model.parameters()), "sgd", 0.05, 0.9, 5e-4)
        sync()
        c0, w0 = time.thread_time(), time.perf_counter()
        importance_probe(model, info, opt, x, y)
        sync()
        if rep:
            probe_cpu.append(time.thread_time() - c0)
            probe_wall.append(time.perf_counter() - w0)
    report["probe"] = {
        "predicted_s": cost.probe_time_s("importance", 0, None),
        "measured_cpu_s": float(np.median(probe_cpu)),
        "measured_wall_s": float(np.median(probe_wall)),
    }
    print(
        f"importance probe: predicted {report['probe']['predicted_s']:.3f} s, measured {report['probe']['measured_cpu_s']:.3f} s "
        f"CPU, {report['probe']['measured_wall_s']:.3f} s wall"
    )
    for epochs in args.epochs:
        cpu: dict[str, list[float]] = {n: [] for n, _ in CONFIGS}
        wall: dict[str, list[float]] = {n: [] for n, _ in CONFIGS}
        results = {}
        for rep in range(args.repeats + 1):
            order = CONFIGS[rep % 3 :] + CONFIGS[: rep % 3]
            for name, options in order:
                r, c, w = run(name, options, epochs)
                results[name] = r
                if rep:  # the first round warms up
                    cpu[name].append(c)
                    wall[name].append(w)
        # the selection of each config, and its autograd work per step (a noise-free proxy)
        rows = {}
        for name, _ in CONFIGS:
            r = results[name]
            ratios = r.ratios if r.ratios is not None else np.zeros(info.num_tensors)
            model.load_state_dict(start)
            for p, on in zip(model.parameters(), ratios > 0):
                p.requires_grad_(bool(on))
            x, y = torch.from_numpy(data.x[:BATCH]).to(dev), torch.from_numpy(data.y[:BATCH]).to(dev)
            nodes = count_backward_nodes(F.cross_entropy(model(x), y))
            for p in model.parameters():
                p.requires_grad_(True)
            rows[name] = {
                "steps": r.steps,
                "tensors": int((ratios > 0).sum()),
                "deepest": int(np.flatnonzero(ratios > 0)[0]) if (ratios > 0).any() else -1,
                "predicted_train_s": r.train_time_s,
                "predicted_overhead_s": r.overhead_time_s,
                "predicted_step_s": cost.step_time_s(ratios),
                "measured_cpu_s": float(np.median(cpu[name])),
                "measured_wall_s": float(np.median(wall[name])),
                "autograd_nodes": nodes,
            }
        full = rows["full"]
        for row in rows.values():
            row["predicted_speedup"] = full["predicted_train_s"] / row["predicted_train_s"]
            row["predicted_step_speedup"] = full["predicted_step_s"] / row["predicted_step_s"]
            row["measured_speedup_cpu"] = full["measured_cpu_s"] / row["measured_cpu_s"]
            row["measured_speedup_wall"] = full["measured_wall_s"] / row["measured_wall_s"]
        report["results"][f"epochs_{epochs}"] = rows
        print(f"\n{epochs} local epoch(s), {SAMPLES} samples, batch {BATCH}, {args.device}, {args.threads} thread(s):")
        print(
            "| strategy | steps | tensors | pred. train s | of it probe+selector s | pred. speedup | pred. step speedup "
            "| meas. CPU s | meas. speedup (CPU) | meas. wall s | meas. speedup (wall) | autograd nodes |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for name, row in rows.items():
            print(
                f"| {name} | {row['steps']} | {row['tensors']} | {row['predicted_train_s']:.3f} "
                f"| {row['predicted_overhead_s']:.3f} | {row['predicted_speedup']:.2f}x | {row['predicted_step_speedup']:.2f}x "
                f"| {row['measured_cpu_s']:.3f} | {row['measured_speedup_cpu']:.2f}x | {row['measured_wall_s']:.3f} "
                f"| {row['measured_speedup_wall']:.2f}x | {row['autograd_nodes']} |"
            )
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"elastic_host_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
