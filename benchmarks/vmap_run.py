"""Whole runs with and without ``simulation.vectorize`` (issue 10): the vmap benchmark's workload through fedelastic.

    python benchmarks/vmap_run.py [--backend inprocess|ray] [--repeats 2]

The issue's workload (benchmarks/vmap.py ``small``: 200 Dirichlet(0.5) digits clients, 10 rounds
of 50, a 5.5k-parameter CNN, batch 16, 1 epoch, strategy ``full``, fp32) as a scenario run by
``run_scenario`` in cohort mode, ``vectorize`` off and on, alternating. Reported per run: the
run's wall time and the median round time (``rounds.parquet`` host_wall_s, rounds 2+), and the
final accuracy.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.fl.runner import run_scenario  # noqa: E402
from fedelastic.scenario import parse_scenario  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from vmap import WORKLOADS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", choices=("inprocess", "ray"), default="inprocess")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    w = WORKLOADS["small"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for vectorize in (False, True) if rep % 2 == 0 else (True, False):
                raw = {"name": "vmap-run", "seed": 0, "output_dir": tmp, **w["scenario"]}
                raw["train"] = {**raw["train"], "numerics": "fp32", "bn_mode": "frozen"}
                raw["server"] = {"rounds": 10, "clients_per_round": w["per_round"]}
                raw["simulation"] = {"backend": args.backend, "node_mode": "cohort", "vectorize": vectorize}
                sc = parse_scenario(raw, src="<vmap_run benchmark>")
                t0 = time.perf_counter()
                run_dir = run_scenario(sc, run_id=f"r{rep}-{int(vectorize)}")
                wall = time.perf_counter() - t0
                rounds = pd.read_parquet(run_dir / "rounds.parquet")
                acc = [c for c in rounds.columns if "acc" in c]
                rows.append({
                    "vectorize": vectorize, "repeat": rep, "run_wall_s": wall,
                    "median_round_s": float(np.median(rounds.host_wall_s.to_numpy()[2:])),
                    "final_accuracy": float(rounds[acc[0]].iloc[-1]) if acc else float("nan"),
                })  # fmt: skip
    df = pd.DataFrame(rows)
    print(df.to_string(index=False))
    med = df.groupby("vectorize")[["run_wall_s", "median_round_s"]].median()
    print(f"\nmedian round, off / on: {med.loc[False, 'median_round_s'] / med.loc[True, 'median_round_s']:.2f}x; "
          f"run wall, off / on: {med.loc[False, 'run_wall_s'] / med.loc[True, 'run_wall_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
