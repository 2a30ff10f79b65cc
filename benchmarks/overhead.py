"""Overhead of Flower (+ Ray) over a bare torch loop doing the same local training (issue 2).

    python benchmarks/overhead.py [--clients 20 200] [--rounds 4] [--out benchmarks/results/overhead.json]

For each fleet size N, the quickstart scenario (simulations/quickstart.toml) is scaled to N
clients (device mix kept in proportion, largest remainder) and run these ways, each in a fresh
subprocess, one after the other, inside this one command (the machine is noisy: compare only
numbers from the same invocation):

(a) ``bare``: one process, no Flower. Per round, per sampled client: load the global weights
    into the model, ``train_partition`` (the client's own call) with exactly the client's arguments (same partition, device
    cost model, strategy and its kept state, batches, seed ``[seed, round, pid]``), then
    ``aggregate_partial``. It runs first and again last; the reference is the mean of the two.
(b) ``ray``: ``run_scenario`` with backend "ray" (Flower's simulation engine on Ray).
(c) ``inprocess``: ``run_scenario`` with backend "inprocess" (same apps, no Ray).
(d) ``ray-flower-dispatch``: (b) with Flower's own message dispatch loop instead of the
    engine's linear one (fedelastic/runtime/dispatch.py), to show what that fix is worth.
(e) ``ray-polling``: (b) as before issue 10: the dispatch loop not woken by a push (it sweeps
    every 0.1 s) and the ServerApp pulling replies every 0.05 s instead of 0.01 s.

Every variant uses the same torch thread count (``simulation.torch_threads``), and the per-client
train losses of every variant are checked against (a): the work is identical.

Timing: start-up is run start -> start of round 1 (for Ray: ray.init, actor pool, node
registration and the partition query, which waits for the actors to start); round 1 is a
warm-up round everywhere (first use of torch in a process or actor, environment build in each
actor) and is reported apart; the headline times are the sums of the steady rounds 2..R, each
timed start to start (server evaluation and result writing included for (b)-(d)). CPU seconds
of the whole process tree (driver, Ray daemons and actors) are reported too: they are less
sensitive than wall time to other load on the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from measuring import Timers, tree_usage

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "simulations" / "quickstart.toml"


def scaled_scenario(num_clients: int, rounds: int, backend: str, output_dir: str):
    """The quickstart scenario with its fleet scaled to ``num_clients`` (largest remainder)."""
    from fedelastic.scenario import load_scenario

    base = load_scenario(SCENARIO)
    total = base.num_clients
    exact = {k: v * num_clients / total for k, v in base.fleet.items()}
    fleet = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - fleet[k], reverse=True)[: num_clients - sum(fleet.values())]:
        fleet[k] += 1
    return dataclasses.replace(
        base,
        fleet=fleet,
        output_dir=output_dir,
        server=dataclasses.replace(base.server, rounds=rounds),
        simulation=dataclasses.replace(base.simulation, backend=backend),
    )


# ---------------------------------------------------------------------------------------------
# workers (one per subprocess)


def worker_bare(sc) -> dict:
    """(a): the clients' work in one plain loop, mirroring ``fedelastic.fl.client.client_train``."""
    import torch

    from fedelastic.environment import environment
    from fedelastic.fl.client import train_partition
    from fedelastic.fl.server import EngineStrategy
    from fedelastic.sim.aggregate import ClientUpdate, aggregate_partial
    from fedelastic.train.pretrain import initial_state

    t0 = time.perf_counter()
    env = environment(sc)
    state = initial_state(env)
    torch.set_num_threads(sc.simulation.torch_threads)
    model = env.new_model()
    glob = {k: v.detach().numpy().copy() for k, v in state.items()}
    # the server's own seeded sampling (availability draws, clients_per_round); nodes = partitions
    sampler = EngineStrategy(env, {p: p for p in range(sc.num_clients)}, None, None)
    strategy_state: dict[int, dict] = {}  # what the client keeps in its Context across rounds
    startup = time.perf_counter() - t0
    rounds, cpu, train_s, agg_s, losses = [], [], [], [], {}
    for rnd in range(1, sc.server.rounds + 1):
        start, cpu0 = time.perf_counter(), tree_usage().cpu_s
        updates, tr = [], 0.0
        for pid in sampler.sample(rnd):
            model.load_state_dict({k: torch.from_numpy(v) for k, v in glob.items()})
            strategy = env.strategy()
            if pid in strategy_state:
                strategy.load_state(strategy_state[pid])
            result = train_partition(env, model, strategy, pid, rnd)
            strategy_state[pid] = {k: np.array(v) for k, v in strategy.state().items()}
            tr += result.host_wall_s
            losses[f"{rnd}/{pid}"] = result.train_loss
            if result.fits:
                updates.append(ClientUpdate(float(result.num_examples), result.trained, result.channel_masks))
        a0 = time.perf_counter()
        glob = aggregate_partial(glob, updates)
        agg_s.append(time.perf_counter() - a0)
        rounds.append(time.perf_counter() - start)
        cpu.append(tree_usage().cpu_s - cpu0)
        train_s.append(tr)
    return {
        "startup_s": startup,
        "round_s": rounds,
        "round_cpu_s": cpu,
        "train_local_s": train_s,
        "aggregate_s": agg_s,
        "losses": losses,
    }


def worker_fl(sc) -> dict:
    import pandas as pd

    import fedelastic.fl.server as server
    import fedelastic.sim.aggregators as aggregators
    from fedelastic.fl.runner import run_scenario

    timers = Timers()
    timers.wrap(server, "wait_for_nodes", "server.wait_for_nodes")
    timers.wrap(server, "discover_partitions", "server.discover_partitions (query all nodes)")
    timers.wrap(server.RoundEngine, "plan", "server: RoundEngine.plan")
    timers.wrap(server.EngineStrategy, "messages", "server.messages")
    timers.wrap(server.EngineStrategy, "settle", "server.settle (incl. deserialise + record)")
    timers.wrap(aggregators, "aggregate_partial", "server.aggregate_partial")
    timers.wrap(server.EngineStrategy, "end_round", "server.end_round (test set + record)")
    if sc.simulation.backend == "ray":
        from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

        timers.wrap(RayBackend, "init_ray", "ray.init")
        timers.wrap(RayBackend, "build", "ray actor pool build")
    else:
        from flwr.app import ArrayRecord

        import fedelastic.fl.client as client

        timers.wrap(client, "client_train", "client.client_train (whole ClientApp body)")
        timers.wrap(client, "train_local", "client.train_local")
        timers.wrap(ArrayRecord, "to_torch_state_dict", "client: ArrayRecord.to_torch_state_dict")

    stamps: list[float] = []
    cpu: list[float] = []

    def progress(row: dict) -> None:
        stamps.append(time.perf_counter())
        cpu.append(tree_usage().cpu_s)

    t0 = time.perf_counter()
    run_dir = run_scenario(sc, progress=progress)
    end = time.perf_counter()
    clients = pd.read_csv(run_dir / "clients.csv")
    rounds_csv = pd.read_csv(run_dir / "rounds.csv")
    status = json.loads((run_dir / "status.json").read_text())
    return {
        "startup_s": stamps[0] - t0,  # run start -> round 0's row (initial model evaluated), i.e. start of round 1
        "round_s": [b - a for a, b in zip(stamps, stamps[1:])],
        "round_cpu_s": [b - a for a, b in zip(cpu, cpu[1:])],
        "teardown_s": end - stamps[-1],
        "host_wall_s": rounds_csv["host_wall_s"].tolist()[1:],
        "train_local_s": clients.groupby("round")["host_wall_s"].sum().tolist(),
        "elapsed_s": status["elapsed_s"],
        "timers": timers.snapshot(),
        "losses": {f"{r}/{p}": v for r, p, v in zip(clients["round"], clients["partition_id"], clients["train_loss"])},
        "run_dir": str(run_dir),
    }


def worker_main(args) -> None:
    import contextlib
    import logging

    logging.getLogger("flwr").setLevel(logging.ERROR)
    backend = {"bare": "inprocess", "inprocess": "inprocess"}.get(args.worker, "ray")
    sc = scaled_scenario(args.clients[0], args.rounds, backend, args.tmp)
    if args.threads:
        sc = dataclasses.replace(sc, simulation=dataclasses.replace(sc.simulation, torch_threads=args.threads))
    if args.worker == "ray-flower-dispatch":  # the engine without its dispatch-loop fix: Flower's own loop
        import fedelastic.fl.runner as runner

        runner.fast_dispatch = contextlib.nullcontext
    if args.worker == "ray-polling":  # the engine before issue 10: no wake-up on push, replies pulled every 0.05 s
        import fedelastic.fl.grids as grids

        grids.notify_pushed = lambda: None
        grids.PULL_PERIOD_S = 0.05
    out = worker_bare(sc) if args.worker == "bare" else worker_fl(sc)
    out.update(variant=args.worker, clients=sc.num_clients, fleet=sc.fleet, torch_threads=sc.simulation.torch_threads)
    Path(args.result).write_text(json.dumps(out))


# ---------------------------------------------------------------------------------------------
# driver

VARIANTS = ("bare", "inprocess", "ray", "ray-flower-dispatch", "ray-polling")


def run_worker(variant: str, clients: int, args, tmp: str, tag: str) -> dict:
    result = Path(tmp) / f"{tag}-{clients}.json"
    cmd = [sys.executable, __file__, "--worker", variant, "--clients", str(clients), "--rounds", str(args.rounds)]
    cmd += ["--result", str(result), "--tmp", tmp] + (["--threads", str(args.threads)] if args.threads else [])
    log = Path(tmp) / f"{tag}-{clients}.log"
    start = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(log.read_text()[-4000:])
        raise SystemExit(f"{variant} at {clients} clients failed (rc {proc.returncode}); log above")
    out = json.loads(result.read_text())
    out["process_wall_s"] = wall
    return out


def _diff(a: float, b: float) -> float:
    """|a - b|, with two NaNs (a client that ran no step) equal."""
    return 0.0 if a != a and b != b else abs(a - b)


def summarise(res: dict) -> dict:
    rounds, steady = res["round_s"], res["round_s"][1:]
    out = {
        "startup_s": res["startup_s"],
        "round1_s": rounds[0],
        "steady_s": sum(steady),
        "steady_round_median_s": float(np.median(steady)),
        "all_rounds_s": sum(rounds),
        "steady_cpu_s": sum(res["round_cpu_s"][1:]),
        "train_local_steady_s": sum(res["train_local_s"][1:]),  # wall inside train_local, summed over clients
    }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[20, 200])
    p.add_argument("--rounds", type=int, default=4, help="rounds per run; round 1 is warm-up (default 4)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: the scenario's)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overhead.json"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    if args.rounds < 2:
        p.error("--rounds must be >= 2 (round 1 is warm-up)")
    if "bare" not in args.variants:
        p.error("--variants must include bare (the reference)")

    report = {
        "command": "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "loadavg_start": os.getloadavg(),
        "rounds": args.rounds,
        "results": {},
    }
    others = [v for v in args.variants if v != "bare"]
    with tempfile.TemporaryDirectory(prefix="fedelastic-overhead-") as tmp:
        for n in args.clients:
            runs = {}
            # the reference runs first and again last: the machine's load drifts, the two bracket it
            for tag, variant in [("bare", "bare"), *[(v, v) for v in others], ("bare-again", "bare")]:
                print(f"[{n} clients] {tag} ...", flush=True)
                runs[tag] = run_worker(variant, n, args, tmp, tag)
                r = runs[tag]
                print(
                    f"  start-up {r['startup_s']:.1f} s; rounds {', '.join(f'{x:.2f}' for x in r['round_s'])} s; "
                    f"cpu {', '.join(f'{x:.2f}' for x in r['round_cpu_s'])} s",
                    flush=True,
                )
            ref = runs["bare"]["losses"]
            entry: dict = {"fleet": runs["bare"]["fleet"], "variants": {}}
            for tag, res in runs.items():
                losses = res.pop("losses")
                entry["variants"][tag] = {**summarise(res), "raw": res}
                same = set(ref) == set(losses)
                entry["variants"][tag]["max_abs_train_loss_diff_vs_bare"] = (
                    max(_diff(losses[k], ref[k]) for k in ref) if same else float("inf")
                )
            v = entry["variants"]
            base = {
                key: (v["bare"][key] + v["bare-again"][key]) / 2 for key in ("steady_s", "steady_cpu_s", "all_rounds_s")
            }
            entry["bare_reference"] = base
            for tag in others:
                entry[f"ratio_{tag}"] = v[tag]["steady_s"] / base["steady_s"]
                entry[f"cpu_ratio_{tag}"] = v[tag]["steady_cpu_s"] / base["steady_cpu_s"]
            report["results"][str(n)] = entry
    report["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(tables(report))
    print(f"\nwritten {out}")


def tables(report: dict) -> str:
    """The two Markdown tables of benchmarks/RESULTS.md."""
    nan = float("nan")

    def get(entry, tag, key):
        return entry["variants"][tag][key] if tag in entry["variants"] else nan

    main_rows, detail_rows = [], []
    for n, e in report["results"].items():
        b = e["bare_reference"]
        main_rows.append(
            f"| {n} | {b['steady_s']:.2f} | {get(e, 'inprocess', 'steady_s'):.2f} | {get(e, 'ray', 'steady_s'):.2f} "
            f"| {get(e, 'ray', 'startup_s'):.1f} (+{get(e, 'ray', 'round1_s'):.1f} warm-up round) "
            f"| **{e.get('ratio_ray', nan):.2f}** | {e.get('ratio_inprocess', nan):.2f} "
            f"| {get(e, 'ray-flower-dispatch', 'steady_s'):.2f} ({e.get('ratio_ray-flower-dispatch', nan):.2f}) |"
        )
        bare_runs = f"{get(e, 'bare', 'steady_s'):.2f} / {get(e, 'bare-again', 'steady_s'):.2f}"
        cpu = " / ".join(
            [f"{b['steady_cpu_s']:.1f}"]
            + [f"{get(e, t, 'steady_cpu_s'):.1f}" for t in ("inprocess", "ray", "ray-flower-dispatch")]
        )
        cpu_ratio = f"{e.get('cpu_ratio_ray', nan):.2f}"
        diffs = max(get(e, t, "max_abs_train_loss_diff_vs_bare") for t in e["variants"])
        detail_rows.append(f"| {n} | {bare_runs} | {cpu} | {cpu_ratio} | {diffs:g} |")
    steady = f"rounds 2..{report['rounds']}"
    return "\n".join(
        [
            f"Times are wall seconds summed over the steady {steady} (round 1 is warm-up everywhere).",
            "",
            "| clients | (a) bare torch s | (c) in-process s | (b) ray s (excl. start-up) | ray start-up s "
            "| ratio (b)/(a) | ratio (c)/(a) | ray with Flower's own dispatch loop s (ratio) |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
            *main_rows,
            "",
            "| clients | bare s, first / last run | CPU s: bare / in-process / ray / ray+Flower dispatch "
            "| CPU ratio (b)/(a) | max train-loss diff vs bare |",
            "|---:|---:|---:|---:|---:|",
            *detail_rows,
        ]
    )


if __name__ == "__main__":
    main()
