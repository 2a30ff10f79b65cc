"""Per-round host time on an existing Ray cluster against the local Ray path, as a ratio from one run.

    python benchmarks/cluster_ratio.py                      # quickstart, 4 rounds, 2 pairs
    python benchmarks/cluster_ratio.py --pairs 3 --rounds 5 --out benchmarks/results/cluster_ratio.json

A cluster is started with Ray's own ``ray start --head`` on a free port (``fedelastic.runtime.cluster``,
in a folder of its own, with as many CPUs as the local path gets), then the scenario runs as a user
runs it, ``fedelastic run SCENARIO 'simulation.ray_address="<address>"'``, alternating with the local
path (``fedelastic run SCENARIO``), each run a fresh process. For each run: the median of the
rounds' ``host_wall_s`` (rounds 2 on; round 1 holds the workers' start), and the run's wall time.
Printed: medians per path and the ratios cluster / local.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.runtime.cluster import LocalCluster  # noqa: E402


def one_run(scenario: str, rounds: int, out: str, name: str, address: str | None) -> dict:
    cli = [sys.executable, "-c", "from fedelastic.cli import main; raise SystemExit(main())"]
    args = [*cli, "run", scenario, f"server.rounds={rounds}", f'output_dir="{out}"', f'name="{name}"']
    if address:
        args.append(f'simulation.ray_address="{address}"')
    t0 = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""})  # noqa: S603
    wall = time.perf_counter() - t0
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    (folder,) = list((Path(out) / name).iterdir())
    rows = list(csv.DictReader(open(folder / "rounds.csv")))
    hosts = [float(r["host_wall_s"]) for r in rows if int(r["round"]) >= 2]
    accuracy = [(r["test_accuracy"], r["test_loss"]) for r in rows]
    return {"round_host_s": statistics.median(hosts), "wall_s": wall, "accuracy": accuracy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=str(ROOT / "simulations" / "quickstart.toml"))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="the cluster head's CPUs (the local path uses all)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` or a scheduler: the cluster is still stopped
    runs: dict[str, list[dict]] = {"local": [], "cluster": []}
    with tempfile.TemporaryDirectory() as out, LocalCluster(head_cpus=a.cpus, worker_cpus=()) as cluster:
        for i in range(a.pairs):
            for path in ("local", "cluster") if i % 2 == 0 else ("cluster", "local"):
                address = cluster.address if path == "cluster" else None
                runs[path].append(one_run(a.scenario, a.rounds, out, f"{path}{i}", address))
                print(path, f"round {runs[path][-1]['round_host_s']:.3f} s", f"run {runs[path][-1]['wall_s']:.1f} s", flush=True)
    same = all(r["accuracy"] == runs["local"][0]["accuracy"] for rs in runs.values() for r in rs)
    med = {p: {k: statistics.median(r[k] for r in rs) for k in ("round_host_s", "wall_s")} for p, rs in runs.items()}
    ratio = {k: med["cluster"][k] / med["local"][k] for k in ("round_host_s", "wall_s")}
    print(f"per-round host time: cluster {med['cluster']['round_host_s']:.3f} s, local {med['local']['round_host_s']:.3f} s, "
          f"ratio {ratio['round_host_s']:.2f}")
    print(f"run wall time: cluster {med['cluster']['wall_s']:.1f} s, local {med['local']['wall_s']:.1f} s, ratio {ratio['wall_s']:.2f}")
    print("accuracies identical on both paths:", same)
    if a.out:
        doc = {"date": time.strftime("%Y-%m-%d"), "args": vars(a), "runs": runs, "medians": med, "ratio": ratio, "identical": same}
        Path(a.out).write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
