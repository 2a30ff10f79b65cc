"""What int8 training numerics cost each strategy on an MCU fleet, with and without QAS (issue 15.3).

    python benchmarks/int8_study.py [--seeds 0 1 2 3 4] [--rounds 5] [--central] [--analyse]
                                    [--out-dir benchmarks/results/int8_study]

The base scenario is the strategy study's (``benchmarks/strategy_study.toml``: ``mcu_net``
pretrained centrally on digits 0-4 and adapted by the fleet to all ten digits, Dirichlet 0.5,
2 local epochs, SGD lr 0.05, momentum 0.9, constant lr) on its MCU fleet, 4 x ``stm32h743`` +
4 x ``stm32f746`` (both ``train_dtype = "int8"``), in three workloads:

* ``study``: the strategy study's own model and batch (``width = 16``, batch 16), BatchNorm on batch
  statistics (``bn_mode = "train"``, the default). Full training (1,104 KiB) and bn_bias (615 KiB)
  do not fit the MCUs there (the strategy study), so they are not run;
* ``fits``: ``width = 8`` at batch 8, where every strategy fits both MCUs (full needs 283 KiB),
  ``bn_mode = "train"``;
* ``study-frozen`` (only when named in ``--workloads``): ``study`` with ``bn_mode = "frozen"``: what
  an int8 device graph does (its norm layers are folded into the convolutions, with no batch
  statistics) and what the papers ran. It is offered only for the strategies that trained with it at
  lr 0.05 in the 2026-11-23 run (last_layer, sparse_update, tinytrain); frozen full training of this
  model diverges at lr 0.05 (RESULTS.md "Default training settings"). Read its runs' status before
  using them.

Each (workload, strategy, seed) runs under these numerics (``[train]`` keys):

* ``fp32``: ``numerics = "fp32"``, the host's fp32 training;
* ``int8``: ``numerics = "device"``, ``qas = false``: int8 weights/activations, the paper's
  integer-domain SGD without quantisation-aware scaling;
* ``int8+qas``: ``qas = true`` (the default);
* ``int8+qas+int8w``: QAS with ``master_weights = "device"``: trained weights stored in int8
  (each update rounded onto the int8 grid), no fp32 copy.

Every run's ``status.json`` is read: only runs that ended ``completed`` enter a mean or a paired
change (a run that ``diverged``, ``failed`` or ``completed_with_errors`` is listed, never
averaged); each cell reports ``used / run``. Paired changes (int8 minus the same seed's fp32, in
points) are over the seeds whose two runs both completed, with a 95% t half-width.

Runs use the in-process backend, one after another; each finished run is appended to
``int8_study_runs.csv`` at once, and a re-started study skips the runs it already has (the
summary covers ``--seeds`` only). ``--central`` also trains each workload's starting weights
centrally (strategy ``full``, fp32, the workload's batch, lr and BatchNorm mode, 10 epochs = rounds
x local epochs) on the clients' pooled training data: ``central.csv``, the reference ``full`` must
come within 5 points of. Outputs in ``--out-dir``: ``int8_study_runs.csv`` (one row per run: status,
final accuracy, accuracy per round, train loss, rejected client results, emulated training clock,
host wall time) and ``int8_study.csv`` (per workload, strategy and numerics: used / run, mean and
95% interval, paired change against fp32); two markdown tables are printed.
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
from fedelastic.comparisons.comparison import USED, ci95  # noqa: E402

BASE = ROOT / "benchmarks" / "strategy_study.toml"
FLEET = {"stm32h743": 4, "stm32f746": 4}
STRATEGIES = ("full", "last_layer", "bn_bias", "sparse_update", "tinytrain")
WORKLOADS = {
    "study": {"width": 16, "batch_size": 16, "bn_mode": "train", "strategies": ("last_layer", "sparse_update", "tinytrain")},
    "fits": {"width": 8, "batch_size": 8, "bn_mode": "train", "strategies": STRATEGIES},
    "study-frozen": {
        "width": 16, "batch_size": 16, "bn_mode": "frozen", "strategies": ("last_layer", "sparse_update", "tinytrain"),
    },
}  # fmt: skip
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
        "train.bn_mode": w["bn_mode"],
        "train.strategy": strategy,
        **{f"train.{k}": v for k, v in NUMERICS[numerics].items()},
    }
    run_id = f"{workload}-{strategy}-{numerics}-s{seed}-{time.strftime('%H%M%S')}"
    t0 = time.perf_counter()
    result = fe.run(raw, overrides=overrides, run_id=run_id)
    wall = time.perf_counter() - t0
    status = result.status
    why = status.get("divergence") or status.get("error") or ""
    if isinstance(why, dict):
        why = f"round {why.get('round')}: {why.get('reason')}"
    rounds, clients = result.rounds, result.clients
    clients = clients[clients["round"] > 0]
    evaluated = rounds.dropna(subset=["test_accuracy"])
    return {
        "workload": workload,
        "strategy": strategy,
        "numerics": numerics,
        "seed": seed,
        "status": status["status"],
        "why": str(why).replace("\n", " ")[:300],
        "rejected": int((clients.status == "rejected").sum()),
        "final_accuracy": float(evaluated.test_accuracy.iloc[-1]),
        "initial_accuracy": float(rounds.test_accuracy.iloc[0]),
        "accuracy_per_round": " ".join(f"{a:.4f}" for a in rounds.test_accuracy),
        "train_loss": float(clients.train_loss.mean()),
        "fits_fraction": float(clients.fits.mean()),
        "train_clock_s": float(clients.groupby("round").emulated_train_time_s.max().sum()),
        "host_wall_s": wall,
        "run_dir": str(result.run_dir),
    }


def summarise(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, strategy, numerics): used / run, then over the completed runs only: mean and 95%
    half-width of the final accuracy, and the paired change against the same seed's completed fp32 run."""
    keys = ["workload", "strategy", "numerics"]
    runs = runs.copy()
    runs["used"] = runs.status == USED
    fp32 = runs[(runs.numerics == "fp32") & runs.used].set_index(["workload", "strategy", "seed"]).final_accuracy
    runs = runs.join(fp32.rename("fp32_accuracy"), on=["workload", "strategy", "seed"])
    runs["delta_points"] = 100 * (runs.final_accuracy - runs.fp32_accuracy)
    rows = []
    for key, g in runs.groupby(keys):
        done = g[g.used]
        d = done.delta_points.dropna().to_numpy(float)
        acc = done.final_accuracy.to_numpy(float)
        rows.append(
            dict(
                zip(keys, key),
                runs=len(g),
                used=len(done),
                diverged=int((g.status == "diverged").sum()),
                failed=int((g.status == "failed").sum()),
                with_errors=int((g.status == "completed_with_errors").sum()),
                final_accuracy_mean=acc.mean() if len(acc) else np.nan,
                final_accuracy_ci95=ci95(acc),
                fits_fraction=done.fits_fraction.mean(),
                train_loss=done.train_loss.mean(),
                rejected=int(g.rejected.sum()),
                train_clock_s=done.train_clock_s.mean(),
                host_wall_s=done.host_wall_s.mean(),
                delta_points_mean=d.mean() if len(d) else np.nan,
                delta_points_ci95=ci95(d),
                delta_points_n=len(d),
                delta_points_min=d.min() if len(d) else np.nan,
                delta_points_max=d.max() if len(d) else np.nan,
            )
        )
    agg = pd.DataFrame(rows)
    order = {
        "workload": {k: i for i, k in enumerate(WORKLOADS)},
        "strategy": {k: i for i, k in enumerate(STRATEGIES)},
        "numerics": {k: i for i, k in enumerate(NUMERICS)},
    }
    return agg.sort_values(keys, key=lambda c: c.map(order[c.name])).reset_index(drop=True)


def _pm(mean: float, half: float, fmt: str = "{:.3f}") -> str:
    if np.isnan(mean):
        return "n/a"
    return fmt.format(mean) + ("" if np.isnan(half) else " ± " + fmt.format(half).lstrip("+"))


def markdown(agg: pd.DataFrame) -> str:
    lines = [
        "| workload | strategy | numerics | used / run | final accuracy (mean ± 95% CI) "
        "| vs fp32, points (paired, ± 95% CI) [min, max] | fits | mean train loss | rejected |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for _, r in agg.iterrows():
        delta = (
            "—"
            if r.numerics == "fp32" or r.delta_points_n == 0
            else f"{_pm(r.delta_points_mean, r.delta_points_ci95, '{:+.1f}')} "
            f"[{r.delta_points_min:+.1f}, {r.delta_points_max:+.1f}]"
        )
        lines.append(
            f"| {r.workload} | {r.strategy} | {r.numerics} | {r.used}/{r.runs} "
            f"| {_pm(r.final_accuracy_mean, r.final_accuracy_ci95)} | {delta} "
            f"| {r.fits_fraction:.2f} | {r.train_loss:.3f} | {r.rejected} |"
        )
    return "\n".join(lines)


def pivot_markdown(agg: pd.DataFrame) -> str:
    """One row per (workload, strategy): fp32 accuracy, then each int8 variant as accuracy (paired change in
    points ± 95% CI), with used / run."""
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
            acc = f"{r.final_accuracy_mean:.3f}" if r.used else "—"
            used = f" [{r.used}/{r.runs}]"
            if n == "fp32" or r.delta_points_n == 0:
                cells.append(acc + used)
            else:
                cells.append(f"{acc} ({_pm(r.delta_points_mean, r.delta_points_ci95, '{:+.1f}')}){used}")
        lines.append(f"| {w} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def not_used(runs: pd.DataFrame) -> list[str]:
    return [
        f"NOT USED: {r.workload} / {r.strategy} / {r.numerics} / seed {r.seed}: {r.status} {r.why}"
        for r in runs[runs.status != USED].itertuples()
    ]


def central_references(raw: dict, seeds: list[int], workloads: list[str]) -> pd.DataFrame:
    """Each workload's starting weights trained centrally (fp32 ``full``) on the clients' pooled data."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scenarios import central_accuracy  # noqa: PLC0415

    rows = []
    for w in workloads:
        spec = WORKLOADS[w]
        for seed in seeds:
            overrides = {
                "seed": seed,
                "model.options": {"width": spec["width"]},
                "train.batch_size": spec["batch_size"],
                "train.bn_mode": spec["bn_mode"],
            }
            sc = fe.load(raw, overrides=overrides)
            rows.append({"workload": w, "seed": seed, **central_accuracy(sc, 3000)})
            print(f"central reference: {rows[-1]}", flush=True)
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workloads", nargs="+", default=["study", "fits"], choices=list(WORKLOADS))
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--numerics", nargs="+", default=list(NUMERICS), choices=list(NUMERICS))
    ap.add_argument("--analyse", action="store_true", help="run nothing: the tables from --out-dir's runs")
    ap.add_argument("--central", action="store_true", help="also train each workload centrally (central.csv)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results" / "int8_study")
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
        if s in WORKLOADS[w]["strategies"]
        for n in args.numerics
        if (w, s, n, seed) not in have
    ]
    if args.analyse:  # tables from the runs already in the CSV only
        cells = []
    for i, (w, s, n, seed) in enumerate(cells):
        row = one_run(raw, w, s, n, seed)
        pd.DataFrame([row]).to_csv(path, mode="a", header=not path.exists(), index=False, float_format="%.6g")
        print(
            f"[{i + 1}/{len(cells)}] {w} {s} {n} seed {seed}: {row['status']} {row['final_accuracy']:.4f} "
            f"({row['host_wall_s']:.0f} s) {row['why']}",
            flush=True,
        )
    runs = pd.read_csv(path, keep_default_na=False, na_values=["nan", "NaN", ""])
    runs = runs[runs.seed.isin(args.seeds) & runs.workload.isin(args.workloads) & runs.numerics.isin(args.numerics)]
    agg = summarise(runs)
    agg.to_csv(args.out_dir / "int8_study.csv", index=False, float_format="%.6g")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(
        f"\ndate {time.strftime('%Y-%m-%d %H:%M')}, commit {commit}, {platform.machine()}, {os.cpu_count()} cores, "
        f"this call {time.perf_counter() - t0:.0f} s for {len(cells)} runs (load average {load0:.1f} -> "
        f"{os.getloadavg()[0]:.1f}); {len(runs)} runs of seeds {args.seeds} in {path}\n"
    )
    print(markdown(agg))
    print()
    print(pivot_markdown(agg))
    print()
    print("\n".join(not_used(runs)) or "every run completed")
    if args.central:
        seeds = sorted(int(x) for x in set(runs[runs.workload == "fits"].seed))  # study: full never fits the MCUs
        central = central_references(raw, seeds, ["fits"])
        central.to_csv(args.out_dir / "central.csv", index=False)
        for w, g in central.groupby("workload", sort=False):
            acc = g.central_accuracy.to_numpy(float)
            print(f"central reference, {w}: {_pm(acc.mean(), ci95(acc))} over {len(acc)} seeds")


if __name__ == "__main__":
    main()
