"""Where the default Ray path's start-up, rounds and exit go, on the peers workload (issue 10).

    python benchmarks/ray_phases.py                  # 3 runs, medians
    python benchmarks/ray_phases.py --runs 5 --out benchmarks/results/ray_phases.json
    python benchmarks/ray_phases.py --runs 1 --busy 2     # beside 2 busy-loop processes (peers.py --busy)

Each run is a fresh process doing what ``peers.py``'s ``ray`` variant does (torch and
``torch._dynamo`` imported first, then ``fedelastic.api.run`` on the shared workload), with
wall-clock stamps (``time.time()``, one clock for every process of the run):

* driver: imports, ``api.run``, Ray's start (``runtime.lifecycle.start_ray``) and what runs beside it,
  Flower's simulation, the partition query, every round's row, Ray's shutdown, ``api.run``'s
  return, the first ``atexit`` hook, and the process's exit as its parent sees it;
* Ray workers: process creation, the first call reaching the shipped app's loader, the app
  unpickled (fedelastic, torch and Flower imported), the cohort warm-up, each cohort call;
* per round: push to Ray call, call to worker start, the slower worker's training, worker end to
  reply in the driver, reply to the ServerApp's pull, and the driver's own work between rounds.

The stamps come from wrappers set in the measured process only (nothing in fedelastic changes).
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

# ------------------------------------------------------------------------------------------
# the measured process


def _created(stat: str = "/proc/self/stat") -> float:
    """This process's creation time (clock ticks since boot; 1/HZ s resolution)."""
    with open(stat) as fh:
        start = int(fh.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as fh:
        boot = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
    return boot + start / os.sysconf("SC_CLK_TCK")


_WORKER_TRACE = """
import sys as _sys
import time as _time

_traced_load = load_with_driver_code
_traced_warm = globals().get("warm_with_driver_code")


def _phases():
    T = getattr(_sys, "_ray_phases", None)
    if T is None:
        import os

        with open("/proc/self/stat") as fh:
            start = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
        T = _sys._ray_phases = [("worker: process created", boot + start / os.sysconf("SC_CLK_TCK"))]
    return T


def _dump(T):
    import json, os

    with open(OUT + "." + str(os.getpid()), "w") as fh:
        json.dump(T, fh)


if _traced_warm is not None:

    def warm_with_driver_code(root, paths, payload):
        T = _phases()
        T.append(("worker: early warm-up start", _time.time()))
        try:
            return _traced_warm(root, paths, payload)
        finally:
            T.append(("worker: early warm-up end", _time.time()))
            _dump(T)


def load_with_driver_code(root, paths, key, payload):
    T = _phases()
    first = not any(k == "worker: first call reaches the loader" for k, _ in T)
    if first:  # the stamps go in before the app is unpickled: its functions take the names they find then
        T.append(("worker: first call reaches the loader", _time.time()))
        driver_code_first(root, paths)
        import fedelastic.fl.clientapp as clientapp
        import fedelastic.fl.cohort as cohort

        def stamped(fn, label):
            def inner(*a, **k):
                T.append((label + " start", _time.time()))
                try:
                    return fn(*a, **k)
                finally:
                    T.append((label + " end", _time.time()))
                    _dump(T)
            return inner

        for module in (cohort, clientapp):  # the ClientApp calls the names it imported from cohort
            module.warm_up = stamped(cohort.warm_up, "worker: warm-up")
            module.cohort_train = stamped(cohort.cohort_train, "worker: cohort call")
    app = _traced_load(root, paths, key, payload)
    if first:
        T.append(("worker: app unpickled (imports done)", _time.time()))
        _dump(T)
    return app
"""


def measured(out: str, tmp: str, dynamo: bool) -> None:
    stamps: list[tuple[str, float]] = [("driver: first statement", time.time())]

    def st(name: str) -> None:
        stamps.append((name, time.time()))

    stamps.append(("driver: process created", _created()))
    import importlib

    import torch

    torch.set_num_threads(1)
    if dynamo:  # as peers.py's workers did before session 19 (torch.optim imported it)
        importlib.import_module("torch._dynamo")
    st("driver: torch (and torch._dynamo with --dynamo) imported")
    sys.path.insert(0, str(HERE.parent))
    import peers

    from fedelastic import api

    st("driver: fedelastic.api imported")
    import fedelastic.fl.raypool as raypool

    try:  # Ray's start and shutdown (fl/raypool.py before issue 39)
        import fedelastic.runtime.lifecycle as lifecycle
    except ImportError:
        lifecycle = raypool

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def inner(*a, **k):
            st(label + " start")
            try:
                return fn(*a, **k)
            finally:
                st(label + " end")

        setattr(obj, name, inner)

    wl = peers.Workload()
    scenario = wl.scenario("ray", tmp)
    rounds: list = []

    def instrument() -> None:  # after the runtime's imports, which api.run does beside ray.init
        import flwr.simulation
        from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

        import fedelastic.fl.rayrun as rayrun
        import fedelastic.fl.runner as runner
        import fedelastic.fl.server as server

        wrap(runner, "start_ray", "driver: ray.init")
        wrap(rayrun, "start_ray", "driver: ray.init")
        wrap(runner, "_start_ray", "driver: ray.init")  # code before issue 10's changes (for comparisons)
        if not hasattr(lifecycle, "quick_shutdown"):
            import ray

            wrap(ray, "shutdown", "driver: Ray shutdown")
        wrap(runner, "_preflight", "driver: preflight checks")
        wrap(flwr.simulation, "run_simulation", "driver: Flower's run_simulation")
        wrap(server, "discover_partitions", "driver: partition query (workers start)")
        wrap(RayBackend, "build", "driver: Flower creates the actors")
        wrap(runner.GuardedGrid, "send_and_receive", "grid: send_and_receive")
        import fedelastic.runtime.backend as backend

        wrap(backend, "_call_client", "ray: call")
        # worker-side stamps through the shipped app's loader: its module's source plus _WORKER_TRACE,
        # run under a name no worker can import, so that Ray's cloudpickle ships it by value
        import inspect

        import fedelastic.runtime.shipped_loader as shipped

        source = inspect.getsource(shipped) + _WORKER_TRACE

        def loader(name="load_with_driver_code"):
            namespace = {"__name__": "fedelastic_ray_phases_loader", "OUT": out + ".worker"}
            exec(compile(source, "<ray_phases loader>", "exec"), namespace)  # noqa: S102 (this file's text)
            return namespace[name]

        rayrun._loader = loader

    import importlib.util

    home = importlib.import_module("fedelastic.orchestrate") if importlib.util.find_spec("fedelastic.orchestrate") else api
    wrap(home, "prepare_run", "driver: imports and data beside ray.init")  # api.prepare_run in older code
    start = getattr(lifecycle, "start_ray", None)
    if start is None:  # code from before issue 10's changes
        instrument()
    else:
        done: list = []

        def started(sc) -> None:  # the rest is wrapped once Ray is up (the runtime is imported beside ray.init)
            st("driver: ray.init start")
            try:
                start(sc)
            finally:
                st("driver: ray.init end")
                if not done:
                    done.append(instrument())

        lifecycle.start_ray = started
    wrap(lifecycle, "quick_shutdown", "driver: Ray shutdown")
    wrap(raypool, "early_start", "driver: early actors")
    st("driver: api.run called")
    api.run(scenario, progress=lambda row: rounds.append((f"round {row['round']} row", time.time())))
    st("driver: api.run returned")
    stamps.extend(rounds)

    import atexit

    def dump() -> None:  # registered last: the first atexit hook to run
        st("driver: first atexit hook")
        Path(out).write_text(json.dumps(stamps))

    atexit.register(dump)


# ------------------------------------------------------------------------------------------
# the parent: runs, phases, medians


def _one(i: int, tmp: str, dynamo: bool = False, busy: int = 0) -> dict:
    out = str(Path(tmp) / f"run{i}.json")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
    }
    sys.path.insert(0, str(HERE.parent))
    from peers import busy_loops

    spinners = busy_loops(busy)
    launch = time.time()
    proc = subprocess.run(
        [sys.executable, str(HERE), "--measure", out, "--tmp", str(Path(tmp) / f"runs{i}")]
        + (["--dynamo"] if dynamo else []),
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    end = time.time()
    for spinner in spinners:
        spinner.kill()
        spinner.wait()
    if proc.returncode:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        raise SystemExit(f"ray_phases.py: run {i} failed")
    t: dict[str, float] = {}
    for k, v in json.loads(Path(out).read_text()):  # the first of repeated stamps (Ray is started and stopped once)
        t.setdefault(k, v - launch)
    workers = [
        dict((k, v - launch) for k, v in json.loads(Path(f).read_text())) for f in sorted(glob.glob(out + ".worker.*"))
    ]
    calls = {}
    for f in sorted(glob.glob(out + ".worker.*")):
        calls[f] = [(k, v - launch) for k, v in json.loads(Path(f).read_text()) if k.startswith("worker: cohort call")]
    t["process exit (parent)"] = end - launch
    return {"driver": t, "workers": workers, "calls": calls, "all": json.loads(Path(out).read_text()), "launch": launch}


def phases(run: dict) -> dict[str, float]:
    t, w = run["driver"], run["workers"]
    last = max(k for k in (int(x.split()[1]) for x in t if x.startswith("round ")))
    first = lambda key: min(x[key] for x in w) if w and all(key in x for x in w) else float("nan")  # noqa: E731
    slow = lambda key: max(x[key] for x in w) if w and all(key in x for x in w) else float("nan")  # noqa: E731
    init_end = t["driver: ray.init end"]
    p = {
        "launch -> Python's first statement": t["driver: first statement"],
        "imports (torch, fedelastic.api; torch._dynamo with --dynamo)": t["driver: fedelastic.api imported"]
        - t["driver: first statement"],
        "api.run -> ray.init starts": t["driver: ray.init start"] - t["driver: api.run called"],
        "ray.init (local cluster)": init_end - t["driver: ray.init start"],
        "  beside it: runtime imports, data, model description": t.get(
            "driver: imports and data beside ray.init end", float("nan")
        )
        - t.get("driver: imports and data beside ray.init start", float("nan")),
        "ray.init end -> early actors created": t.get("driver: early actors end", float("nan")) - init_end,
        "ray.init end -> first early warm-up starts": first("worker: early warm-up start") - init_end,
        "worker: early warm-up (imports, data, model; slower)": slow("worker: early warm-up end")
        - slow("worker: early warm-up start"),
        "ray.init end -> first worker call reaches the app": first("worker: first call reaches the loader") - init_end,
        "worker: imports (fedelastic, torch; slower worker)": slow("worker: app unpickled (imports done)")
        - slow("worker: first call reaches the loader"),
        "worker: imports done -> warm-up starts (slower)": slow("worker: warm-up start")
        - slow("worker: app unpickled (imports done)"),
        "worker: warm-up (data, model description; slower)": slow("worker: warm-up end")
        - slow("worker: warm-up start"),
        "warm-up ends -> partitions known": t["driver: partition query (workers start) end"]
        - slow("worker: warm-up end"),
        "partitions known -> round 0 row (initial evaluation)": t["round 0 row"]
        - t["driver: partition query (workers start) end"],
        "START-UP (launch -> round 0 row)": t["round 0 row"],
        f"training (round 0 row -> round {last} row)": t[f"round {last} row"] - t["round 0 row"],
        "last round -> Ray shutdown starts": t["driver: Ray shutdown start"] - t[f"round {last} row"],
        "Ray shutdown (workers, daemons; all gone)": t["driver: Ray shutdown end"] - t["driver: Ray shutdown start"],
        "Ray shutdown end -> api.run returns (status, close)": t["driver: api.run returned"]
        - t["driver: Ray shutdown end"],
        "api.run returns -> first atexit hook": t["driver: first atexit hook"] - t["driver: api.run returned"],
        "first atexit hook -> process exit (interpreter teardown)": t["process exit (parent)"]
        - t["driver: first atexit hook"],
        "PROCESS WALL (launch -> exit)": t["process exit (parent)"],
    }
    return p


def per_round(run: dict) -> list[dict[str, float]]:
    """The training rounds' dispatch pieces (the first send_and_receive is the partition query)."""
    s = run["all"]
    sr = [v for k, v in s if k == "grid: send_and_receive start"]
    se = [v for k, v in s if k == "grid: send_and_receive end"]
    cs = [v for k, v in s if k == "ray: call start"]
    ce = [v for k, v in s if k == "ray: call end"]
    wcalls = [(k, v + run["launch"]) for f in run["calls"].values() for k, v in f]
    ws = sorted(v for k, v in wcalls if k.endswith("start"))
    we = sorted(v for k, v in wcalls if k.endswith("end"))
    pairs = list(zip(sr, se))[1:]
    rows = []
    for i, (a, b) in enumerate(pairs):
        inside = lambda xs: sorted(x for x in xs if a <= x <= b)  # noqa: E731,B023
        c0, c1, w0, w1 = inside(cs), inside(ce), inside(ws), inside(we)
        if not (c0 and c1 and len(w0) == len(c0) == len(w1) == len(c1)):
            continue
        rows.append(
            {
                "push -> Ray call": c0[0] - a,
                "Ray call -> worker starts": max(w - c for w, c in zip(w0, c0)),
                "slower worker's cohort call": max(e - w for w, e in zip(w0, w1)),
                "worker ends -> reply in the driver": max(c - e for e, c in zip(w1, c1)),
                "reply -> ServerApp has it": b - c1[-1],
                "send_and_receive in all": b - a,
                "driver's work until the next round": (pairs[i + 1][0] - b) if i + 1 < len(pairs) else float("nan"),
            }
        )
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", help="write the stamps and phases as JSON here")
    p.add_argument("--dynamo", action="store_true", help="import torch._dynamo first (peers.py before session 19)")
    p.add_argument("--busy", type=int, default=0, help="run beside this many busy-loop processes (peers.py --busy)")
    p.add_argument("--measure", help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.measure:
        measured(args.measure, args.tmp, args.dynamo)
        return
    load0 = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="fedelastic-ray-phases-") as tmp:
        for i in range(args.runs):
            runs.append(_one(i, tmp, args.dynamo, args.busy))
            ph = phases(runs[-1])
            print(
                f"[run {i + 1}/{args.runs}] start-up {ph['START-UP (launch -> round 0 row)']:.2f} s, wall {ph['PROCESS WALL (launch -> exit)']:.2f} s",
                flush=True,
            )
    table = [phases(r) for r in runs]
    print(
        f"\nmedians of {args.runs} runs (load average {load0[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)\n"
    )
    print("| phase | s |\n|---|---:|")
    for key in table[0]:
        print(f"| {key} | {statistics.median(t[key] for t in table):.2f} |")
    rounds = [row for r in runs for row in per_round(r)[1:]]  # round 1 pays the first-call costs
    if rounds:
        print(f"\nper training round, rounds 2.. of every run ({len(rounds)} rounds), medians in ms\n")
        print("| piece | ms |\n|---|---:|")
        for key in rounds[0]:
            vals = [row[key] for row in rounds if row[key] == row[key]]
            print(f"| {key} | {1000 * statistics.median(vals):.1f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "command": "python benchmarks/ray_phases.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "loadavg": [load0, os.getloadavg()],
                    "phases": table,
                    "rounds": rounds,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
