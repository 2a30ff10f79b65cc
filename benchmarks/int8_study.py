"""What int8 training numerics cost each strategy on an MCU fleet, with and without QAS (issue 15.3).

    python benchmarks/int8_study.py [--seeds 0 1] [--rounds 5] [--out-dir benchmarks/results]

The base scenario is the strategy study's (``benchmarks/strategy_study.toml``: ``mcu_net``
pretrained centrally on digits 0-4 and adapted by the fleet to all ten digits, Dirichlet 0.5,
2 local epochs, SGD lr 0.05, momentum 0.9, ``bn_mode = "auto"``: frozen BatchNorm statistics for this
pretrained start) on its MCU fleet, 4 x ``stm32h743`` + 4 x ``stm32f746``
(both ``train_dtype = "int8"``), in two workloads:

* ``study``: the strategy study's own model and batch (``width = 16``, batch 16). Full training
  (1,104 KiB) and bn_bias (615 KiB) do not fit the MCUs there, so they never train;
* ``fits``: ``width = 8`` at batch 8, where every strategy fits both MCUs (full needs 283 KiB).

Each (workload, strategy, seed) runs under these numerics (``[train]`` keys):

* ``fp32``: ``numerics = "fp32"``, the host's fp32 training (what every fleet got before);
* ``int8``: ``numerics = "device"``, ``qas = false``: int8 weights/activations, the paper's
  integer-domain SGD without quantisation-aware scaling;
* ``int8+qas``: ``qas = true`` (the default);
* ``int8+qas+int8w``: QAS with ``master_weights = "device"``: trained weights stored in int8
  (each update rounded onto the int8 grid), no fp32 copy.

Strategies: full, last_layer, bn_bias, sparse_update, tinytrain, each with its defaults. Runs use
the in-process backend, one after another; each finished run is appended to
``int8_study_runs.csv`` at once, and a re-started study skips the runs it already has. Outputs in
``--out-dir``: ``int8_study_runs.csv`` (one row per run: final accuracy, accuracy per round,
train loss, emulated training clock, host wall time) and ``int8_study.csv`` (per workload,
strategy and numerics: mean and std over seeds, and the change against the same seed's fp32
run in points); two markdown tables are printed (the second: one row per workload and strategy).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fedelastic as fe  # noqa: E402

BASE = ROOT / "benchmarks" / "strategy_study.toml"
FLEET = {"stm32h743": 4, "stm32f746": 4}
STRATEGIES = ("full", "last_layer", "bn_bias", "sparse_update", "tinytrain")
WORKLOADS = {"study": {"width": 16, "batch_size": 16}, "fits": {"width": 8, "batch_size": 8}}
NUMERICS = {
    "fp32": {"numerics": "fp32"},
    "int8": {"numerics": "device", "qas": False},
    "int8+qas": {"numerics": "device", "qas": True},
    "int8+qas+int8w": {"numerics": "device", "qas": True, "master_weights": "device"},
}


def base_scenario(rounds: int) -> dict:
    raw = tomllib.loads(BASE.read_text())
    raw.pop("compare")
    raw["name"] = "int8_study"
    raw["fleet"] = dict(FLEET)
    raw["server"]["rounds"] = rounds
    return raw


def one_run(raw: dict, workload: str, strategy: str, numerics: str, seed: int) -> dict:
    w = WORKLOADS[workload]
    overrides = {
        "seed": seed,
        "model.options": {"width": w["width"]},
        "train.batch_size": w["batch_size"],
        "train.strategy": strategy,
        **{f"train.{k}": v for k, v in NUMERICS[numerics].items()},
    }
    run_id = f"{workload}-{strategy}-{numerics}-s{seed}-{time.strftime('%H%M%S')}"
    t0 = time.perf_counter()
    result = fe.run(raw, overrides=overrides, run_id=run_id)
    wall = time.perf_counter() - t0
    rounds, clients = result.rounds, result.clients
    clients = clients[clients["round"] > 0]
    return {
        "workload": workload,
        "strategy": strategy,
        "numerics": numerics,
        "seed": seed,
        "final_accuracy": float(rounds.test_accuracy.iloc[-1]),
        "initial_accuracy": float(rounds.test_accuracy.iloc[0]),
        "accuracy_per_round": " ".join(f"{a:.4f}" for a in rounds.test_accuracy),
        "train_loss": float(clients.train_loss.mean()),
        "fits_fraction": float(clients.fits.mean()),
        "train_clock_s": float(clients.groupby("round").emulated_train_time_s.max().sum()),
        "host_wall_s": wall,
        "run_dir": str(result.run_dir),
    }


def summarise(runs: pd.DataFrame) -> pd.DataFrame:
    keys = ["workload", "strategy", "numerics"]
    agg = runs.groupby(keys).agg(
        seeds=("seed", "nunique"),
        final_accuracy_mean=("final_accuracy", "mean"),
        final_accuracy_std=("final_accuracy", "std"),
        fits_fraction=("fits_fraction", "mean"),
        train_loss=("train_loss", "mean"),
        train_clock_s=("train_clock_s", "mean"),
        host_wall_s=("host_wall_s", "mean"),
    )
    agg = agg.reset_index()
    # paired by seed: each seed's int8 accuracy minus the same seed's fp32 accuracy, in points
    fp32 = runs[runs.numerics == "fp32"].set_index(["workload", "strategy", "seed"]).final_accuracy
    paired = runs.join(fp32.rename("fp32_accuracy"), on=["workload", "strategy", "seed"])
    paired["delta_points"] = 100 * (paired.final_accuracy - paired.fp32_accuracy)
    delta = paired.groupby(keys).delta_points.agg(["mean", "min", "max"]).add_prefix("delta_points_")
    agg = agg.join(delta, on=keys)
    order = {
        "workload": {k: i for i, k in enumerate(WORKLOADS)},
        "strategy": {k: i for i, k in enumerate(STRATEGIES)},
        "numerics": {k: i for i, k in enumerate(NUMERICS)},
    }
    return agg.sort_values(keys, key=lambda c: c.map(order[c.name])).reset_index(drop=True)


def markdown(agg: pd.DataFrame) -> str:
    lines = [
        "| workload | strategy | numerics | final accuracy (mean ± std) | vs fp32, points: mean [min, max] over seeds "
        "| fits | mean train loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, r in agg.iterrows():
        std = "" if np.isnan(r.final_accuracy_std) else f" ± {r.final_accuracy_std:.3f}"
        delta = (
            "—"
            if r.numerics == "fp32"
            else f"{r.delta_points_mean:+.1f} [{r.delta_points_min:+.1f}, {r.delta_points_max:+.1f}]"
        )
        lines.append(
            f"| {r.workload} | {r.strategy} | {r.numerics} | {r.final_accuracy_mean:.3f}{std} | {delta} "
            f"| {r.fits_fraction:.2f} | {r.train_loss:.3f} |"
        )
    return "\n".join(lines)


def pivot_markdown(agg: pd.DataFrame) -> str:
    """One row per (workload, strategy): fp32 accuracy, then each int8 variant as accuracy (change in points)."""
    variants = [n for n in NUMERICS if n in set(agg.numerics)]
    lines = ["| workload | strategy | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for (w, s), g in agg.groupby(["workload", "strategy"], sort=False):
        g = g.set_index("numerics")
        cells = []
        for n in variants:
            if n not in g.index:
                cells.append("")
                continue
            r = g.loc[n]
            acc = f"{r.final_accuracy_mean:.3f}"
            cells.append(acc if n == "fp32" else f"{acc} ({r.delta_points_mean:+.1f})")
        lines.append(f"| {w} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--numerics", nargs="+", default=list(NUMERICS), choices=list(NUMERICS))
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # runs go to ./runs (git-ignored)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / "int8_study_runs.csv"
    done = pd.read_csv(path) if path.exists() else pd.DataFrame(columns=["workload", "strategy", "numerics", "seed"])
    have = set(zip(done.workload, done.strategy, done.numerics, done.seed.astype(int)))
    raw = base_scenario(args.rounds)
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    cells = [
        (w, s, n, seed)
        for seed in args.seeds
        for w in args.workloads
        for s in args.strategies
        for n in args.numerics
        if (w, s, n, seed) not in have
    ]
    for i, (w, s, n, seed) in enumerate(cells):
        row = one_run(raw, w, s, n, seed)
        pd.DataFrame([row]).to_csv(path, mode="a", header=not path.exists(), index=False, float_format="%.6g")
        print(
            f"[{i + 1}/{len(cells)}] {w} {s} {n} seed {seed}: {row['final_accuracy']:.4f} ({row['host_wall_s']:.0f} s)"
        )
    runs = pd.read_csv(path)
    agg = summarise(runs)
    agg.to_csv(args.out_dir / "int8_study.csv", index=False, float_format="%.6g")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"\ndate {time.strftime('%Y-%m-%d %H:%M')}, commit {commit}, {platform.machine()}, {os.cpu_count()} cores, "
        f"this call {time.perf_counter() - t0:.0f} s for {len(cells)} runs (load average {load0:.1f} -> "
        f"{os.getloadavg()[0]:.1f}); {len(runs)} runs in {path}\n"
    )
    print(markdown(agg))
    print()
    print(pivot_markdown(agg))


if __name__ == "__main__":
    main()
