"""Throughput of fedelastic's runtimes on issue 10's workload, against plain torch loops doing the same training.

    python benchmarks/throughput.py [--repeats 3] [--variants ...] [--out benchmarks/results/throughput.json]

The workload (benchmarks/throughput.toml): 200 Dirichlet(0.5) clients on digits, 10 rounds of 50
clients, a ~5.5k-parameter CNN from a user factory (benchmarks/throughput_model.py), SGD lr 0.05
without momentum, batch 16, 1 epoch, strategy "full", fp32 devices only. Variants, each in a fresh
subprocess, interleaved (variant 1..k, then again) ``--repeats`` times in one invocation (the
machine is shared: compare only numbers from one invocation):

* ``torch``: a plain torch loop, one process: per sampled client, load the global weights, one
  seeded epoch of SGD, then example-weighted FedAvg (what the issue's "bare loop" does); one
  throwaway step first, so torch's one-time set-up is not counted as training;
* ``bare``: the same loop calling fedelastic's own client step (``train_partition``: cost model,
  strategy, seeding) instead of the plain SGD loop;
* ``inprocess`` / ``inprocess-per-client``: ``run_scenario`` in-process, cohort mode (the default)
  and one Flower node per client;
* ``ray`` / ``ray-per-client``: the same on Flower's Ray backend (the default runtime).

Reported per run: training-phase updates per second (client updates / time from the start of
round 1 to the end of round 10, warm-up round included), steady updates per second (rounds 2..10),
start-up (process spawn -> start of round 1: interpreter, imports, data, Ray, workers), process
wall, CPU seconds of the whole process tree (sampled every 0.2 s), and updates per CPU second of
the driver process in the training phase (all of the work for the one-process variants, less
sensitive to the machine's other load than wall time; for Ray the actors' CPU is not in it). All fedelastic variants must give the same
clients and rounds tables (host wall columns aside) and the same final model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "benchmarks" / "throughput.toml"
VARIANTS = ("torch", "bare", "inprocess", "inprocess-per-client", "ray", "ray-per-client")


def _scenario(variant: str, output_dir: str):
    import dataclasses

    from fedelastic.scenario import load_scenario

    sc = load_scenario(SCENARIO)
    backend = "ray" if variant.startswith("ray") else "inprocess"
    mode = "per_client" if variant.endswith("per-client") else "cohort"
    sim = dataclasses.replace(sc.simulation, backend=backend, node_mode=mode)
    return dataclasses.replace(sc, output_dir=output_dir, simulation=sim)


def _digest(state: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode() + np.ascontiguousarray(state[name]).tobytes())
    return h.hexdigest()


def worker_loop(sc, plain: bool, spawned: float) -> dict:
    """``torch`` (plain SGD loop) or ``bare`` (fedelastic's train_partition), one process, no Flower."""
    import torch

    from fedelastic.environment import environment
    from fedelastic.fl.client import train_partition
    from fedelastic.fl.server import EngineStrategy
    from fedelastic.sim.aggregate import ClientUpdate, aggregate_partial
    from fedelastic.train.pretrain import initial_state
    from fedelastic.train.trainer import seed_everything

    env = environment(sc)
    torch.set_num_threads(sc.simulation.torch_threads)
    state = initial_state(env)
    model = env.new_model()
    glob = {k: v.detach().numpy().copy() for k, v in state.items()}
    sampler = EngineStrategy(env, {p: p for p in range(sc.num_clients)}, None, None)  # the server's seeded sampling
    t = sc.train
    warm = env.new_model()  # torch's first step imports and sets up much (torch._dynamo): not counted as training
    x0, y0 = torch.from_numpy(env.data.client(0).x), torch.from_numpy(env.data.client(0).y)
    torch.nn.functional.cross_entropy(warm(x0), y0).backward()
    torch.optim.SGD(warm.parameters(), lr=t.lr).step()
    stamps, cpu, updates = [time.time()], [time.process_time()], 0
    for rnd in range(1, sc.server.rounds + 1):
        results = []
        weights = {k: torch.from_numpy(v) for k, v in glob.items()}
        for pid in sampler.sample(rnd):
            model.load_state_dict(weights)
            if plain:
                data = env.client_data(pid, rnd)
                x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
                rng = seed_everything([sc.seed, rnd, pid])
                opt = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum)
                model.train()
                order = rng.permutation(len(y))
                for start in range(0, len(y), t.batch_size):
                    idx = order[start : start + t.batch_size]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                    opt.step()
                trained = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
                results.append(ClientUpdate(float(len(y)), trained, {}))
            else:
                strategy = env.strategy()
                r = train_partition(env, model, strategy, pid, rnd)
                results.append(ClientUpdate(float(r.num_examples), r.trained, r.channel_masks))
        glob = aggregate_partial(glob, results)
        updates += len(results)
        stamps.append(time.time())
        cpu.append(time.process_time())
    return {"stamps": stamps, "cpu": cpu, "updates": updates, "model": _digest(glob)}


def worker_run(sc, spawned: float) -> dict:
    import pandas as pd
    import torch

    from fedelastic.fl.runner import run_scenario

    stamps: list[float] = []
    cpu: list[float] = []
    run_dir = run_scenario(sc, progress=lambda row: (stamps.append(time.time()), cpu.append(time.process_time())))
    clients = pd.read_parquet(run_dir / "clients.parquet").drop(columns=["host_wall_s"])
    rounds = pd.read_parquet(run_dir / "rounds.parquet").drop(columns=["host_wall_s"])
    model = torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"]
    tables = hashlib.sha256(pd.util.hash_pandas_object(clients).values.tobytes()
                            + pd.util.hash_pandas_object(rounds).values.tobytes()).hexdigest()  # fmt: skip
    return {
        "stamps": stamps,
        "cpu": cpu,
        "updates": int((clients.steps > 0).sum()),
        "model": _digest({k: v.numpy() for k, v in model.items()}),
        "tables": tables,
    }


def tree_cpu_s(pid: int) -> float:
    from measuring import tree_usage  # noqa: PLC0415 (the benchmarks' shared helper, beside this file)

    return tree_usage(pid).cpu_s


def run_one(variant: str, tmp: str, tag: str) -> dict:
    result = Path(tmp) / f"{tag}.json"
    cmd = [sys.executable, __file__, "--worker", variant, "--result", str(result), "--tmp", tmp]
    log = Path(tmp) / f"{tag}.log"
    start = time.time()
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd + ["--spawned", repr(start)], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
        cpu = 0.0
        while proc.poll() is None:  # sample the tree's CPU while it lives (Ray's daemons exit with it)
            cpu = max(cpu, tree_cpu_s(proc.pid))
            time.sleep(0.2)
    wall = time.time() - start
    if proc.returncode != 0:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"{variant} failed (rc {proc.returncode}); log above")
    out = json.loads(result.read_text())
    s, c = out.pop("stamps"), out.pop("cpu")
    rounds = [b - a for a, b in zip(s, s[1:])]
    out.update(
        variant=variant,
        startup_s=s[0] - start,
        round_s=rounds,
        training_phase_s=s[-1] - s[0],
        training_upd_per_s=out["updates"] / (s[-1] - s[0]),
        steady_upd_per_s=out["updates"] * (len(rounds) - 1) / len(rounds) / sum(rounds[1:]),
        process_wall_s=wall,
        tree_cpu_s=cpu,
        # the driver process's own CPU in the training phase: all of the work for one-process variants
        training_upd_per_driver_cpu_s=out["updates"] / (c[-1] - c[0]),
    )
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "throughput.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    p.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        import logging

        logging.getLogger("flwr").setLevel(logging.ERROR)
        sc = _scenario(args.worker, args.tmp)
        if args.worker in ("torch", "bare"):
            out = worker_loop(sc, args.worker == "torch", args.spawned)
        else:
            out = worker_run(sc, args.spawned)
        Path(args.result).write_text(json.dumps(out))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    report: dict = {
        "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "loadavg_start": os.getloadavg(),
        "runs": [],
    }
    with tempfile.TemporaryDirectory(prefix="fedelastic-throughput-") as tmp:
        for rep in range(args.repeats):
            for variant in args.variants:
                r = run_one(variant, tmp, f"{variant}-{rep}")
                report["runs"].append(r)
                print(
                    f"[{rep + 1}/{args.repeats}] {variant:22s} train {r['training_upd_per_s']:6.0f} upd/s  steady "
                    f"{r['steady_upd_per_s']:6.0f}  start-up {r['startup_s']:5.1f} s  wall {r['process_wall_s']:5.1f} s  "
                    f"cpu {r['tree_cpu_s']:5.1f} s",
                    flush=True,
                )
    report["loadavg_end"] = os.getloadavg()
    report["summary"] = summary(report["runs"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(report["summary"]))
    print(f"\nwritten {out}")


def summary(runs: list[dict]) -> dict:
    by: dict[str, list[dict]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    keys = ("training_upd_per_s", "steady_upd_per_s", "startup_s", "process_wall_s", "tree_cpu_s",
            "training_upd_per_driver_cpu_s")  # fmt: skip
    out = {v: {k: float(np.median([r[k] for r in rs])) for k in keys} for v, rs in by.items()}
    fl = [r for r in runs if "tables" in r]
    out["_checks"] = {
        "fedelastic tables identical across modes and runs": len({r["tables"] for r in fl}) <= 1,
        "final model identical (bare and every fedelastic run)": len(
            {r["model"] for r in runs if r["variant"] != "torch"}
        )
        <= 1,
    }
    return out


def table(s: dict) -> str:
    ref = s.get("torch", {}).get("training_upd_per_s", float("nan"))
    cref = s.get("torch", {}).get("training_upd_per_driver_cpu_s", float("nan"))
    rows = [
        "| variant | training upd/s (median) | x torch loop | steady upd/s | start-up s | process wall s | tree CPU s "
        "| upd per driver CPU s (x torch loop) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, m in s.items():
        if v.startswith("_"):
            continue
        rows.append(
            f"| {v} | {m['training_upd_per_s']:.0f} | {m['training_upd_per_s'] / ref:.2f} | {m['steady_upd_per_s']:.0f} "
            f"| {m['startup_s']:.1f} | {m['process_wall_s']:.1f} | {m['tree_cpu_s']:.1f} "
            f"| {m['training_upd_per_driver_cpu_s']:.0f} ({m['training_upd_per_driver_cpu_s'] / cref:.2f}) |"
        )
    return "\n".join(rows + ["", *(f"- {k}: {v}" for k, v in s["_checks"].items())])


if __name__ == "__main__":
    main()
