"""Vectorised cohort training vs the per-client loop (issue 10): client updates per second.

    python benchmarks/vmap.py                                   # the issue's workload, CPU
    python benchmarks/vmap.py --workload resnet --device cuda   # a compute-heavy model on a GPU

One process, one workload, the variants interleaved round by round (their order rotates), each
keeping its own global model, FedAvg between rounds:

* ``bare``: a plain torch loop, client after client (load the global weights, SGD over the
  client's batches): the same batches and optimizer as fedelastic, no pricing, no selections;
* ``loop``: fedelastic's per-client path without Flower (``fl.client.train_partition``, i.e.
  ``train_local`` with its cost pricing, written out here), client after client, on ``--device``;
* ``vmap``: the whole cohort in one call (``vectorized.train_partitions_vmap``).

Workloads. ``small`` (the issue's): 200 Dirichlet(0.5) clients on the digits (8x8), 50 a round,
a 5.5k-parameter CNN (``tiny_cnn`` below, no norm layers), SGD lr 0.05, momentum 0, weight decay
5e-4, batch 16, 1 epoch, strategy ``full``, fp32. ``resnet``: 40 IID clients of 150 SynthDigits
(32x32 RGB) samples, 20 a round, ``resnet_small`` (blocks 2-2-2-2, width 16, no dropout; BatchNorm
frozen), batch 32, momentum 0.9. ``shipped``: the small workload's clients with the shipped
scenarios' training (``small_cnn`` width 16, BatchNorm on batch statistics, int8 on the stm32h743
share, momentum 0.9; ``--width`` sweeps its MACs a sample). Reported: training-phase updates per second (all rounds, and
rounds 2+), and how far the variants' final global models are apart (max abs difference: float32
rounding only, since all train the same batches from the same weights).

Writes ``--out`` (JSON) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.environment import RunEnvironment  # noqa: E402
from fedelastic.scenario import parse_scenario  # noqa: E402
from fedelastic.train.quant import device_numerics  # noqa: E402
from fedelastic.train.trainer import CohortJob, LocalTraining, batches, make_optimizer, seed_everything, train_local  # noqa: E402
from fedelastic.train.vectorized import train_partitions_vmap  # noqa: E402


def tiny_cnn(num_classes: int = 10, in_channels: int = 1, input_size: int = 8, width: int = 8) -> nn.Sequential:
    """The issue's ~5.5k-parameter CNN for 8x8 digits (``width`` 8; ``--width`` scales it)."""
    flat = 2 * width * (input_size // 2) ** 2
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(flat, 16), nn.ReLU(), nn.Linear(16, num_classes),
    )  # fmt: skip


WORKLOADS = {
    "small": dict(
        clients=200, per_round=50,
        scenario={
            "fleet": {"raspberry_pi_4": 80, "jetson_nano": 80, "stm32h743": 40},
            "data": {"dataset": "digits", "partitioner": "dirichlet", "alpha": 0.5, "test_fraction": 0.2},
            "model": {"name": f"{Path(__file__).resolve()}:tiny_cnn"},
            "train": {"strategy": "full", "local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.0},
        },
    ),
    # the shipped scenarios' model and training: small_cnn (BatchNorm trained on batch statistics),
    # int8 on the stm32h743 share (numerics "device"), momentum 0.9; quickstart's fleet
    "shipped": dict(
        clients=200, per_round=50,
        scenario={
            "fleet": {"raspberry_pi_4": 80, "jetson_nano": 80, "stm32h743": 40},
            "data": {"dataset": "digits", "partitioner": "dirichlet", "alpha": 0.5, "test_fraction": 0.2},
            "model": {"name": "small_cnn", "options": {"width": 16}},
            "train": {"strategy": "full", "local_epochs": 1, "batch_size": 16, "lr": 0.05, "momentum": 0.9,
                      "numerics": "device", "bn_mode": "train"},
        },
    ),
    "resnet": dict(
        clients=40, per_round=20,
        scenario={
            "fleet": {"jetson_nano": 40},
            "data": {"dataset": "synth_digits", "size": 7500, "partitioner": "iid", "test_fraction": 0.2},
            "model": {"name": "resnet_small", "options": {"blocks": [2, 2, 2, 2], "width": 16, "dropout": 0.0}},
            "train": {"strategy": "full", "local_epochs": 1, "batch_size": 32, "lr": 0.05, "momentum": 0.9},
        },
    ),
}  # fmt: skip


def make_env(workload: str, batch_size: int = 0, strategy: str = "", width: int = 0) -> RunEnvironment:
    w = WORKLOADS[workload]
    raw = {"name": f"vmap-{workload}", "seed": 0, **w["scenario"]}
    if width:
        raw["model"] = {**raw["model"], "options": {**raw["model"].get("options", {}), "width": width}}
    raw["train"] = {"numerics": "fp32", "bn_mode": "frozen", **raw["train"]}  # the shipped workloads keep theirs
    if batch_size:
        raw["train"]["batch_size"] = batch_size
    if strategy:
        raw["train"]["strategy"] = strategy
        raw["train"]["options"] = {"rho": 0.4} if strategy.startswith("elastic") else {}
    return RunEnvironment(parse_scenario(raw, src="<vmap benchmark>"))


def bare_round(env, model, pids, rnd, device):
    """Plain torch: each client from the global weights, the same batches as train_local."""
    t = env.scenario.train
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    out = []
    for pid in pids:
        model.load_state_dict(glob)
        data = env.client_data(pid, rnd)
        rng = seed_everything([env.scenario.seed, rnd, pid])
        opt = make_optimizer(model.parameters(), t.optimizer, t.lr, t.momentum, t.weight_decay)
        x_all, y_all = torch.from_numpy(data.x).to(device), torch.from_numpy(data.y).to(device)
        model.train()
        for mod in model.modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm):
                mod.eval()
        for idx in batches(len(data), t.batch_size, t.local_epochs, rng, t.max_steps):
            ix = torch.as_tensor(idx, device=device)
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x_all[ix]), y_all[ix]).backward()
            opt.step()
        out.append(({k: v.detach().cpu().numpy().copy() for k, v in model.named_parameters()}, len(data)))
    model.load_state_dict(glob)
    return out


def train_partition(env, model, strategy, pid: int, rnd: int):
    """``fl.client.train_partition`` (no deadline cap), written out so that it runs where Flower is not installed."""
    t = env.scenario.train
    return train_local(model, env.info, strategy, env.cost(env.devices[pid]), env.client_data(pid, rnd), LocalTraining(epochs=t.local_epochs, batch_size=t.batch_size, lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay, max_steps=t.max_steps, bn_mode=env.bn_mode, optimizer=t.optimizer, lr_schedule=t.lr_schedule), seed=[env.scenario.seed, rnd, pid], numerics=device_numerics(t, env.profile(env.devices[pid]).train_dtype))


def loop_round(env, model, pids, rnd):
    glob = {k: v.clone() for k, v in model.state_dict().items()}
    out = []
    for pid in pids:
        model.load_state_dict(glob)
        r = train_partition(env, model, env.strategy(), pid, rnd)
        out.append((r.trained, r.num_examples))
    model.load_state_dict(glob)
    return out


def vmap_round(env, model, pids, rnd):
    results = train_partitions_vmap(env, model, [CohortJob(pid, rnd, env.strategy()) for pid in pids])
    return [(r.trained, r.num_examples) for r in results]


def fedavg(model, updates) -> None:
    """Each tensor averaged over the clients that trained it (weighted by examples); untrained ones stay."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            have = [(u[name], n) for u, n in updates if name in u]
            if have:
                avg = sum(u.astype(np.float64) * n for u, n in have) / sum(n for _, n in have)
                p.copy_(torch.from_numpy(avg.astype(np.float32)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="small")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=None, help="default: bare loop vmap")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=0, help="replace the workload's batch size")
    ap.add_argument("--strategy", default="", help="replace the workload's strategy (elastic_*: rho 0.4)")
    ap.add_argument("--width", type=int, default=0, help="replace the model's width (small: tiny_cnn's, 8; shipped: small_cnn's, 16)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here")
    torch.set_num_threads(args.threads)
    variants = args.variants or ["bare", "loop", "vmap"]
    if args.strategy not in ("", "full") and "bare" in variants:
        variants.remove("bare")  # the bare loop trains every tensor: it has no selections
    w = WORKLOADS[args.workload]
    env = make_env(args.workload, args.batch_size, args.strategy, args.width)
    t0 = time.perf_counter()
    _ = env.data, env.info
    setup_s = time.perf_counter() - t0
    dev = torch.device(args.device)
    models = {}
    for v in variants:
        models[v] = env.new_model().to(dev)  # the same seeded initial weights
    cohorts = [
        sorted(np.random.default_rng([0, r]).choice(w["clients"], w["per_round"], replace=False).tolist())
        for r in range(1, args.rounds + 1)
    ]
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, float] = dict.fromkeys(variants, 0.0)
    steps = 0
    for rnd, pids in enumerate(cohorts, start=1):
        order = variants[rnd % len(variants) :] + variants[: rnd % len(variants)]
        for v in order:
            model = models[v]
            if dev.type == "cuda":
                torch.cuda.synchronize()
            c0, w0 = time.process_time(), time.perf_counter()
            if v == "bare":
                updates = bare_round(env, model, pids, rnd, dev)
            elif v == "loop":
                updates = loop_round(env, model, pids, rnd)
            else:
                updates = vmap_round(env, model, pids, rnd)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[v].append(time.perf_counter() - w0)
            cpu[v] += time.process_time() - c0
            fedavg(model, updates)
        steps += sum(-(-len(env.client_data(p, rnd)) // env.scenario.train.batch_size) for p in pids)
    n_updates = args.rounds * w["per_round"]
    rows = {}
    for v in variants:
        total, steady = sum(times[v]), sum(times[v][1:])
        rows[v] = {
            "train_s": total,
            "updates_per_s": n_updates / total,
            "steady_updates_per_s": (n_updates - w["per_round"]) / steady if steady else float("nan"),
            "cpu_s": cpu[v],
            "round_s": times[v],
        }
    ref = variants[0]
    params = {v: {k: p.detach().cpu().numpy() for k, p in models[v].named_parameters()} for v in variants}
    diffs = {v: max(float(np.abs(params[v][k] - params[ref][k]).max()) for k in params[ref]) for v in variants}
    info = {
        "workload": args.workload,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        "rounds": args.rounds,
        "updates": n_updates,
        "local_steps": steps,
        "params": int(sum(p.numel() for p in models[ref].parameters())),
        "macs_per_sample": int(env.info.hooked_macs),
        "batch_size": env.scenario.train.batch_size,
        "strategy": env.scenario.train.strategy,
        "setup_s": setup_s,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "variants": rows,
        "max_abs_diff_vs_" + ref: diffs,
    }
    print(f"workload {args.workload} on {info['device_name']} ({args.device}), {n_updates} updates, {steps} local steps, "
          f"{info['params']} parameters, {info['macs_per_sample']:,} MACs a sample, batch {info['batch_size']}, strategy {info['strategy']}, torch {torch.__version__}, {args.threads} thread(s)")  # fmt: skip
    print(f"| variant | train s | updates/s | steady updates/s (rounds 2+) | CPU s | vs {ref} (wall) | vs {ref} (CPU) | max abs diff vs {ref} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        r = rows[v]
        print(
            f"| {v} | {r['train_s']:.2f} | {r['updates_per_s']:.0f} | {r['steady_updates_per_s']:.0f} | {r['cpu_s']:.1f} "
            f"| {rows[ref]['train_s'] / r['train_s']:.2f}x | {rows[ref]['cpu_s'] / r['cpu_s']:.2f}x | {diffs[v]:.1e} |"
        )
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"vmap_{args.workload}_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(info, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
