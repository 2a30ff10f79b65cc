"""Scale: a 10,000-client fleet, 100 clients a round, 100 rounds; is the driver flat? (issue 10)

    python benchmarks/scale.py                      # issue 10's sizes, Ray (the default path)
    python benchmarks/scale.py --backends inprocess ray --clients 100000 --per-round 1000 --rounds 50  # issue 40
    python benchmarks/scale.py --backends ray inprocess --windows-days 8
    python benchmarks/scale.py --rounds 3 --query-chunk 10000 256 10000 256   # the partition query, A/B
    python benchmarks/scale.py --clients 500 --per-round 20 --rounds 20 --samples 12000   # shrunk
    python benchmarks/scale.py --backends inprocess --clients 100000 --per-round 100 500 1000 --rounds 6  # vs the cohort

The scenario: ``synth_digits`` (``--samples`` images, by default 60,000 or 1.1 per client if that is
more; 5% held out for the server's test set, at most 3,000 images, which it evaluates every round), IID partitions over ``--clients`` clients (5-6
images each at 10,000, 1-2 at 100,000),
``small_cnn`` at width 8, strategy ``full``, one local epoch of batch 16 (one step), a mixed
fleet of three device profiles, ``--per-round`` clients sampled per round for ``--rounds``
rounds, through ``fedelastic.fl.runner.run_scenario`` (the same path as ``fedelastic run``).
Each variant runs in a fresh subprocess, one after the other.

Recorded per round (from the run's progress callback, in the driver): the wall time since the
previous round ended; the driver's RSS and CPU seconds (``/proc``); the CPU of the driver's round-loop
thread, in all and by part (``DRIVER_PARTS``: plan, messages, the cohort grid, settle, evaluation;
``time.thread_time``, so in-process the clients' training thread is not in it); the RSS and CPU seconds of
the driver's whole process tree (Ray's GCS, raylet and workers descend from it); for each
results file its size and whether it was only appended to (a ``.csv`` keeps its inode and the
bytes it had, a ``.parquet`` folder keeps every earlier part file unchanged and gains new ones).
Start-up phases are timed apart (wall, driver CPU, tree CPU): Flower's node registration, the
wait for the nodes, and the partition query (one message to every node; ``--query-chunk``
sets how many are in flight at once, a number >= the fleet sends them all at once as before).

Per client a round: the median round's wall time and process-tree CPU over the clients in it,
beside the floor under them, a bare torch loop doing each client's training (load the global
weights, one epoch of plain SGD on its partition) timed in the worker after the run.

Summary per variant: RSS growth from round 10 (``--warm-up``) to the last round (the issue's goal: < 10%); for
per-round wall time and CPU time, the median and a trend: the slope of a least-squares line
through rounds 10..R times the span, as a share of the median (0%: flat); the rounds in which
a results file was rewritten. ``--windows-days`` adds the memory held by ``sessions`` online
windows of ``--clients`` clients over that many simulated days, with and without the clock's
floor. Written to ``--out`` (benchmarks/results/scale.json) and printed as a table. The
machine is shared: compare only figures of one invocation, and prefer CPU to wall time.
"""

from __future__ import annotations

import argparse
import functools
import itertools
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
# the driver's parts of a round, timed on its thread: (class, method, part); the rest of the thread's CPU
# in a round is "other" (the round row, callbacks, the results writer's hand-over, this benchmark's progress)
DRIVER_PARTS = [
    ("RoundEngine", "plan", "plan"),
    ("EngineStrategy", "messages", "messages"),
    ("CohortGrid", "send_and_receive", "grid"),
    ("EngineStrategy", "settle", "settle"),
    ("CentralEvaluation", "evaluate", "evaluation"),
]
FLEET = {"raspberry_pi_4": 0.4, "jetson_nano": 0.4, "phone_midrange": 0.2}  # device mix, scaled to --clients


def fleet_of(num_clients: int) -> dict[str, int]:
    """FLEET's shares scaled to ``num_clients`` (largest remainder)."""
    exact = {k: v * num_clients for k, v in FLEET.items()}
    fleet = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - fleet[k], reverse=True)[: num_clients - sum(fleet.values())]:
        fleet[k] += 1
    return {k: n for k, n in fleet.items() if n}


def scenario_dict(args, backend: str, output_dir: str) -> dict:
    return {
        "name": f"scale_{backend}",
        "seed": args.seed,
        "output_dir": output_dir,
        "fleet": fleet_of(args.clients),
        "data": {
            "dataset": "synth_digits",
            "size": args.samples,
            "partitioner": "iid",
            "test_fraction": min(0.05, 3000 / args.samples),  # the server's test set: 3,000 images at most
            "min_partition_size": 1,
        },
        "model": {"name": "small_cnn", "options": {"width": 8}},
        "train": {"strategy": "full", "local_epochs": 1, "batch_size": 16, "lr": 0.05},
        "server": {"rounds": args.rounds, "clients_per_round": args.per_round},
        "simulation": {"backend": backend, "num_cpus_per_client": 1},
    }


# ---------------------------------------------------------------------------------------------
# measurements (in the worker subprocess)


def rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of one process, from /proc (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class FileWatch:
    """Sizes of a run folder's results files, and whether each round only appended to them."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.csv: dict[str, tuple[int, int, bytes]] = {}  # name -> (inode, size, last 64 bytes)
        self.parts: dict[str, dict[str, tuple[int, int]]] = {}  # folder -> part -> (size, mtime_ns)
        self.rewrites = 0  # rounds in which an earlier byte or part changed

    def check(self) -> dict:
        sizes, rewritten = {}, []
        for path in sorted(self.folder.glob("*.csv")):
            st = path.stat()
            sizes[path.name] = st.st_size
            with path.open("rb") as fh:
                before = self.csv.get(path.name)
                if before is not None:
                    inode, size, tail = before
                    fh.seek(max(size - 64, 0))
                    if st.st_ino != inode or st.st_size < size or fh.read(len(tail)) != tail:
                        rewritten.append(path.name)
                fh.seek(max(st.st_size - 64, 0))
                self.csv[path.name] = (st.st_ino, st.st_size, fh.read())
        for folder in sorted(self.folder.glob("*.parquet")):
            parts = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.glob("part-*.parquet")}
            sizes[folder.name] = sum(size for size, _ in parts.values())
            sizes[folder.name + ":parts"] = len(parts)
            old = self.parts.get(folder.name, {})
            if any(parts.get(name) != stamp for name, stamp in old.items()):
                rewritten.append(folder.name)
            self.parts[folder.name] = parts
        self.rewrites += bool(rewritten)
        return {"sizes": sizes, "rewritten": rewritten}


def worker(args, backend: str) -> dict:
    """One run of the scenario in this process; returns its per-round records and start-up figures."""
    start = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    from flwr.server.superlink.fleet.vce import vce_api

    import fedelastic.fl.server as server
    from fedelastic.fl.runner import run_scenario
    from fedelastic.scenario import parse_scenario

    phases: dict[str, float] = {}
    if args.query_chunk[0] > 0:
        server.QUERY_CHUNK = args.query_chunk[0]

    def timed(owner, name: str):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0, cpu0, tree0 = time.perf_counter(), time.process_time(), tree_usage().cpu_s
            try:
                return fn(*a, **kw)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
                phases[f"{name}_driver_cpu"] = time.process_time() - cpu0  # all the driver's threads
                phases[f"{name}_tree_cpu"] = tree_usage().cpu_s - tree0

        setattr(owner, name, wrapper)

    from fedelastic.fl.cohort import CohortGrid
    from fedelastic.sim.engine import RoundEngine

    # the driver thread's CPU in each part of a round (time.thread_time: this thread only; in-process the
    # clients train on another thread, on Ray in other processes), summed over a round, read by progress()
    parts = Timers(clock=time.thread_time)
    owners = {"RoundEngine": RoundEngine, "EngineStrategy": server.EngineStrategy, "CohortGrid": CohortGrid}
    owners["CentralEvaluation"] = server.CentralEvaluation
    for owner, name, part in DRIVER_PARTS:
        parts.wrap(owners[owner], name, part)
    timed(vce_api, "_register_nodes")  # Flower: one create_node per virtual client
    timed(server, "wait_for_nodes")
    timed(server, "discover_partitions")  # one query message to every node

    out = Path(tempfile.mkdtemp(prefix="fedelastic-scale-"))
    scenario = parse_scenario(scenario_dict(args, backend, str(out)), "<benchmarks/scale.py>")
    records: list[dict] = []
    watch: list[FileWatch] = []
    last = [time.perf_counter()]
    snapshots: dict[int, object] = {}
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(10)

    thread_cpu: list[float | None] = [None]  # set by the round loop's thread, in progress()

    def progress(row: dict) -> None:
        now = time.perf_counter()
        rnd = int(row["round"])
        # the round loop's thread (progress runs on it), since the previous round's row
        driver_thread = float("nan") if thread_cpu[0] is None else time.thread_time() - thread_cpu[0]
        if not watch:
            watch.append(FileWatch(next(out.glob("*/*"))))
        files = watch[0].check()
        usage = tree_usage()
        records.append(
            {
                "round": rnd,
                "wall_s": now - last[0],
                "since_start_s": now - start,
                "driver_rss_bytes": rss_bytes(),
                "tree_rss_bytes": usage.rss_bytes,
                "tree_processes": usage.processes,
                "driver_cpu_s": usage.root_cpu_s,  # cumulative
                "tree_cpu_s": usage.cpu_s,  # cumulative; exited processes are not counted
                "files": files["sizes"],
                "rewritten": files["rewritten"],
                "clients": row["clients"],
                "test_accuracy": row["test_accuracy"],
                "driver_thread_cpu_s": driver_thread,
                "driver_parts_cpu_s": dict(parts.total),
            }
        )
        parts.total.clear()
        if args.rounds_log:  # each round as it ends: a run cut short still leaves its rounds
            with open(args.rounds_log, "a") as fh:
                fh.write(json.dumps(records[-1]) + "\n")
        if args.tracemalloc and rnd in (10, args.rounds):
            import tracemalloc

            snapshots[rnd] = tracemalloc.take_snapshot()
        if rnd % 10 == 0 or rnd == 1:
            r = records[-1]
            print(
                f"[scale] {backend} round {rnd}: {r['wall_s']:.2f} s, driver RSS {r['driver_rss_bytes'] / 2**20:.0f} MB, "
                f"tree {usage.rss_bytes / 2**20:.0f} MB, {r['since_start_s']:.0f} s since start",
                file=sys.stderr,
                flush=True,
            )
        last[0] = time.perf_counter()
        thread_cpu[0] = time.thread_time()

    run_dir = run_scenario(scenario, progress=progress)
    status = json.loads((run_dir / "status.json").read_text())
    bare = bare_client_ms(scenario, args.per_round)
    result = {
        "backend": backend,
        "records": records,
        "startup": {
            "process_to_round_0_s": records[0]["since_start_s"] if records else None,
            **{f"{k}_s": v for k, v in phases.items()},
        },
        "status": status["status"],
        "client_results": status.get("client_results"),
        "file_rewrites": watch[0].rewrites if watch else None,
        "process_wall_s": time.perf_counter() - start,
        "bare_client_ms": bare,
    }
    if 10 in snapshots and args.rounds in snapshots:
        diff = snapshots[args.rounds].compare_to(snapshots[10], "traceback")  # type: ignore[attr-defined]
        result["tracemalloc_top_growth"] = [
            {"bytes": s.size_diff, "count": s.count_diff, "where": s.traceback.format()[-4:]} for s in diff[:15]
        ]
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    return result


def bare_client_ms(scenario, clients: int) -> dict[str, float]:
    """The floor under a client's cost: milliseconds per client of a bare torch loop doing what a
    client's training does, in this process after the run (the global weights loaded into the
    model, then one epoch of plain SGD over the client's partition at the scenario's batch size),
    over the first ``clients`` partitions (at most 500), with 1 torch thread: wall and this thread's CPU time."""
    import torch

    from fedelastic.environment import environment

    env, t = environment(scenario), scenario.train
    model = env.client_model
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    parts = [env.data.client(p) for p in range(min(clients, 500, scenario.num_clients))]
    torch.set_num_threads(1)
    start, cpu = time.perf_counter(), time.thread_time()
    for part in parts:
        model.load_state_dict(weights)
        opt = torch.optim.SGD(model.parameters(), lr=t.lr)
        for i in range(0, len(part), t.batch_size):
            x, y = torch.from_numpy(part.x[i : i + t.batch_size]), torch.from_numpy(part.y[i : i + t.batch_size])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y.long()).backward()
            opt.step()
    return {"wall": 1000 * (time.perf_counter() - start) / len(parts), "cpu": 1000 * (time.thread_time() - cpu) / len(parts)}


def windows_growth(clients: int, days: int, seed: int = 0) -> dict:
    """Python memory held by ``sessions`` online windows as the clock runs ``days`` simulated days.

    Every client is asked whether it is online once a simulated day, as the server's sampling
    does at each round start: ``no floor`` is the state before issue 10 (windows kept forever),
    ``floor`` moves the floor with the clock as the server now does. Returns MB per day.
    """
    import tracemalloc

    sys.path.insert(0, str(ROOT))
    from fedelastic.sim.availability import SessionAvailability

    out: dict[str, list[float]] = {}
    for name in ("no floor", "floor"):
        tracemalloc.start()
        windows = SessionAvailability(clients, seed, 1800.0, 1800.0, 0.8, 86400.0)
        out[name] = []
        for day in range(days + 1):
            if name == "floor":
                windows.forget_before(day * 86400.0)
            for p in range(clients):
                windows.online(p, day * 86400.0)
            out[name].append(tracemalloc.get_traced_memory()[0] / 2**20)
        del windows
        tracemalloc.stop()
    return out


# ---------------------------------------------------------------------------------------------
# summary (in the parent)


def _slope(x: np.ndarray, y: np.ndarray) -> float:
    return float(np.polyfit(x, y, 1)[0]) if len(x) >= 3 else float("nan")


def summarise(result: dict, first: int = 10) -> dict:
    """Round ``first`` against the last round: RSS growth, and the trend of per-round wall and CPU time."""
    recs = result["records"]
    for prev, rec in zip(recs, recs[1:]):
        rec["driver_cpu_round_s"] = rec["driver_cpu_s"] - prev["driver_cpu_s"]
        rec["tree_cpu_round_s"] = rec["tree_cpu_s"] - prev["tree_cpu_s"]
    recs = [r for r in recs if r["round"] >= 1]
    if not recs:
        return {}
    last = recs[-1]
    base = next((r for r in recs if r["round"] >= first), recs[0])
    span = [r for r in recs if r["round"] >= base["round"]]
    x = np.array([r["round"] for r in span], float)
    growth = lambda key: 100.0 * (last[key] - base[key]) / base[key]  # noqa: E731
    tenth = max(1, len(span) // 10)
    out = {
        "rounds": last["round"],
        "from_round": base["round"],
        "driver_rss_mb": [base["driver_rss_bytes"] / 2**20, last["driver_rss_bytes"] / 2**20],
        "driver_rss_growth_pct": growth("driver_rss_bytes"),
        "tree_rss_mb": [base["tree_rss_bytes"] / 2**20, last["tree_rss_bytes"] / 2**20],
        "tree_rss_growth_pct": growth("tree_rss_bytes"),
    }
    for key, name in (
        ("wall_s", "round_s"),
        ("driver_cpu_round_s", "driver_cpu_s"),
        ("tree_cpu_round_s", "tree_cpu_s"),
    ):
        y = np.array([r[key] for r in span], float)
        median, slope = float(np.median(y)), _slope(x, y)
        out[name] = {
            "median": median,
            "first_tenth_median": float(np.median(y[:tenth])),
            "last_tenth_median": float(np.median(y[-tenth:])),
            "slope_per_round": slope,
            "trend_pct": 100.0 * slope * (x[-1] - x[0]) / median if median else float("nan"),  # slope x span / median
        }
    clients = float(np.median([r["clients"] for r in span]))
    if "driver_thread_cpu_s" in span[0]:  # the driver thread's CPU a round by part, medians, in ms a client
        parts = {p: [r["driver_parts_cpu_s"].get(p, 0.0) for r in span] for _, _, p in DRIVER_PARTS}
        thread = [r["driver_thread_cpu_s"] for r in span]
        parts["other"] = [t - sum(v[i] for v in parts.values()) for i, t in enumerate(thread)]
        out["driver_thread_ms_per_client"] = {
            "all": 1000 * float(np.median(thread)) / clients,
            **{p: 1000 * float(np.median(v)) / clients for p, v in parts.items()},
        }
    out["ms_per_client"] = {
        "round_wall": 1000 * out["round_s"]["median"] / clients,
        "tree_cpu": 1000 * out["tree_cpu_s"]["median"] / clients,
    }
    for key, ms in result.get("bare_client_ms", {}).items():  # the same training in a bare torch loop
        out["ms_per_client"][f"bare_loop_{key}"] = ms
    out.update(
        {
            "rounds_with_rewritten_files": result["file_rewrites"],
            "rewritten": [(r["round"], r["rewritten"]) for r in result["records"] if r["rewritten"]],
            "files_at_end": last["files"],
            "startup": result["startup"],
            "status": result["status"],
            "client_results": result["client_results"],
            "process_wall_s": result["process_wall_s"],
        }
    )
    return out


def table(summaries: dict[str, dict]) -> str:
    first = next(iter(summaries.values()), {})
    a, b = first.get("from_round", 10), first.get("rounds", "R")
    lines = []
    for name, s in summaries.items():
        if "driver_thread_ms_per_client" in s:
            lines.append(f"{name}: driver thread, ms CPU a client (medians): " + ", ".join(
                f"{k} {v:.3f}" for k, v in s["driver_thread_ms_per_client"].items()))  # fmt: skip
    lines += [
        f"| variant | driver RSS r{a} -> r{b} MB | growth | tree RSS MB | growth | round wall s, median | wall trend | "
        "tree CPU s/round, median | CPU trend | ms/client: wall, CPU (bare loop: wall, CPU) | rounds with rewritten files | "
        "query s | start to round 0 s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        st, pc = s["startup"], s["ms_per_client"]
        lines.append(
            f"| {name} | {s['driver_rss_mb'][0]:.0f} -> {s['driver_rss_mb'][1]:.0f} | {s['driver_rss_growth_pct']:+.1f}% "
            f"| {s['tree_rss_mb'][0]:.0f} -> {s['tree_rss_mb'][1]:.0f} | {s['tree_rss_growth_pct']:+.1f}% "
            f"| {s['round_s']['median']:.3f} | {s['round_s']['trend_pct']:+.0f}% "
            f"| {s['tree_cpu_s']['median']:.3f} | {s['tree_cpu_s']['trend_pct']:+.0f}% "
            f"| {pc['round_wall']:.2f}, {pc['tree_cpu']:.2f} ({pc['bare_loop_wall']:.2f}, {pc['bare_loop_cpu']:.2f}) "
            f"| {s['rounds_with_rewritten_files']} | {st.get('discover_partitions_s', float('nan')):.1f} "
            f"({st.get('discover_partitions_driver_cpu_s', float('nan')):.1f}) "
            f"| {st['process_to_round_0_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=10_000)
    parser.add_argument(
        "--per-round", type=int, nargs="+", default=[100], help="clients a round; several values run one variant each"
    )
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument(
        "--samples", type=int, default=0,
        help="synth_digits images (default: 60,000, or 1.1 per client for a larger fleet: every client holds one)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-up", type=int, default=10, help="rounds left out of the summary's growth and trends")
    parser.add_argument("--backends", nargs="*", default=["ray"], choices=["ray", "inprocess"])
    parser.add_argument(
        "--query-chunk",
        type=int,
        nargs="+",
        default=[0],
        help="partition queries in flight at once (0: fedelastic's default; a number >= the fleet: all at once, as "
        "before issue 10); several values run one variant each",
    )
    parser.add_argument(
        "--tracemalloc", action="store_true", help="trace driver allocations (slow): top growth r10 -> rR"
    )
    parser.add_argument(
        "--windows-days", type=int, default=0, help="also measure 'sessions' online-window state over this many days"
    )
    parser.add_argument(
        "--rounds-log", default="", help="also append each round's record to this JSON-lines file as the round ends"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scale.json"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.samples = args.samples or max(60_000, -(-11 * args.clients // 10))
    cohorts, args.per_round = args.per_round, args.per_round[0]
    if args.worker:
        print(json.dumps(worker(args, args.worker)))
        return
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    runs, summaries = {}, {}
    sizes = ["--clients", args.clients, "--rounds", args.rounds, "--samples", args.samples, "--seed", args.seed]
    sizes += ["--tracemalloc"] if args.tracemalloc else []
    sizes += ["--rounds-log", args.rounds_log] if args.rounds_log else []
    for backend, cohort, chunk in itertools.product(args.backends, cohorts, args.query_chunk):
        name = backend if chunk == 0 else f"{backend}, query chunk {chunk}"
        name += f", {cohort} a round" if len(cohorts) > 1 else ""
        repeat = sum(k == name or k.startswith(f"{name} (run ") for k in runs)
        name = f"{name} (run {repeat + 1})" if repeat else name
        cmd = [sys.executable, __file__, "--worker", backend, "--query-chunk", str(chunk), "--per-round", str(cohort)]
        cmd += [str(a) for a in sizes]
        print(
            f"[scale] {name}: {args.clients} clients, {cohort} a round, {args.rounds} rounds",
            file=sys.stderr,
        )
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        if proc.returncode:
            raise SystemExit(f"[scale] {name} failed (exit {proc.returncode})")
        runs[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        summaries[name] = summarise(runs[name], args.warm_up)
        print(table({name: summaries[name]}), file=sys.stderr)
    windows = windows_growth(args.clients, args.windows_days, args.seed) if args.windows_days else None
    if windows:
        for name, mb in windows.items():
            print(f"[scale] sessions windows, {name}: MB by day " + " ".join(f"{m:.0f}" for m in mb), file=sys.stderr)
    doc = {
        "command": "python benchmarks/scale.py " + " ".join(sys.argv[1:]),
        "started": started,
        "machine": f"{platform.node()} {os.cpu_count()} CPUs (shared with other sessions)",
        "sizes": {"clients": args.clients, "per_round": cohorts, "rounds": args.rounds, "samples": args.samples},
        "summary": summaries,
        "windows_mb_by_day": windows,
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(table(summaries))
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
