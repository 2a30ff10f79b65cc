"""Strategies on a drifting stream: the continual study of issue 8.

    python benchmarks/continual_study.py [--fleets tx2,mcu,mixed] [--strategies full,elastic_tensor,...]
                                         [--seeds 0,1,2] [--rounds 30] [--lr 0.05] [--out-dir DIR]

Runs every (fleet, strategy, seed) of ``benchmarks/continual_study.toml`` in-process (a class
increment at round 11, a 30-degree rotation from round 21, on SynthDigits from a backbone
pretrained on clean digits 0-4), then, per run: final and average accuracy, forgetting, accuracy
in the round after each shift and the simulated time to recover 90% of the pre-shift accuracy,
the training clock (slowest client's emulated train time summed over rounds, probes included),
energy, and the largest client peak memory against its device's. Paired differences over seeds
(same seed = same data, partitions and stream) get a 95% t-interval. The claims of the issue are
checked from those numbers where their strategies ran:

(a) elastic_tensor within 1 point of full in final accuracy, in at most 50% of its training clock;
(b) elastic_tensor (re-selecting) ahead of static_elastic after the shifts;
(c) random_budget behind elastic_tensor;
(d) tinytrain ahead of last_layer and sparse_update on the MCU fleet.

Writes ``runs.csv`` (one row per run), ``paired.csv``, ``continual_study.png`` and the markdown
table and verdicts (``verdicts.md``) into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import tomllib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fedelastic.comparisons.comparison import USED, ci95, expand  # noqa: E402
from fedelastic.fl.runner import run_scenario  # noqa: E402
from fedelastic.results.recorder import read_status  # noqa: E402


def run_one(sc, out: Path, seed: int) -> dict:
    run_dir = run_scenario(replace(sc, output_dir=str(out / "runs")), run_id=f"s{seed}")
    status = read_status(run_dir)
    why = status.get("divergence") or status.get("error") or ""
    head = {
        "status": status["status"],
        "why": why if isinstance(why, str) else f"round {why.get('round')}: {why.get('reason')}",
    }
    if not (run_dir / "continual.json").is_file():
        return head | {"run_dir": str(run_dir)}
    summary = json.loads((run_dir / "continual.json").read_text())
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    clients = pd.read_parquet(run_dir / "clients.parquet")
    train_clock = clients.groupby("round").emulated_train_time_s.max().sum()
    row = head | {
        "final_accuracy": summary["final_accuracy"],
        "average_accuracy": summary["average_accuracy"],
        "forgetting": summary["forgetting"],
        "train_clock_s": float(train_clock),
        "sim_time_s": float(rounds.sim_time_s.iloc[-1]),
        "energy_j": float(rounds.total_energy_j.iloc[-1]),
        "peak_over_memory": float((clients.emulated_peak_memory_bytes / clients.device_memory_bytes).max()),
        "fits_fraction": float(clients.fits.mean()),
        "rejected": int((clients.status == "rejected").sum()),
        "idle_share": idle_share(clients),
        "collapse_round": summary["collapse"]["rounds"][0] if summary.get("collapse") else np.nan,
        "run_dir": str(run_dir),
    }
    for s in summary["shifts"]:
        j = s["task"]
        row[f"after_shift{j}"] = s["accuracy_after_shift"]
        row[f"recover_s_shift{j}"] = s["time_to_recover_s"] if s["time_to_recover_s"] is not None else np.nan
    return row


def idle_share(clients: pd.DataFrame) -> float:
    """Share of the fitting client-rounds that ran no step (e.g. a selection with nothing in it)."""
    rows = clients[(clients["round"] > 0) & clients.fits]
    return float((rows.steps == 0).mean()) if len(rows) else float("nan")


def fill_idle_share(rows: list[dict]) -> None:
    """``idle_share`` for rows from a runs.csv written before the column existed, from their run folders."""
    for r in rows:
        if pd.isna(r.get("idle_share", np.nan)) and Path(str(r.get("run_dir", ""))).is_dir():
            r["idle_share"] = idle_share(pd.read_parquet(Path(r["run_dir"]) / "clients.parquet"))


def paired(runs: pd.DataFrame, fleet: str, a: str, b: str, metric: str) -> dict | None:
    """Mean of (a - b) over seeds run by both, with a 95% t-interval half-width."""
    from scipy import stats

    runs = runs[runs.status == USED]  # a diverged or failed seed is never paired
    x = runs[(runs.fleet == fleet) & (runs.strategy == a)].set_index("seed")[metric]
    y = runs[(runs.fleet == fleet) & (runs.strategy == b)].set_index("seed")[metric]
    d = (x - y).dropna()
    if len(d) == 0:
        return None
    half = float(stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    return {"fleet": fleet, "a": a, "b": b, "metric": metric, "mean_diff": float(d.mean()), "ci95": half, "n": len(d)}


def verdicts(runs: pd.DataFrame, pairs: list[dict]) -> list[str]:
    def get(fleet, a, b, metric):
        return next((p for p in pairs if (p["fleet"], p["a"], p["b"], p["metric"]) == (fleet, a, b, metric)), None)

    def fmt(p):
        return f"{p['mean_diff']:+.3f} (95% CI +/- {p['ci95']:.3f}, n={p['n']})"

    out = []
    for fleet in sorted(runs.fleet.unique()):
        acc = get(fleet, "elastic_tensor", "full", "final_accuracy")
        if acc:
            done = runs[(runs.fleet == fleet) & (runs.status == USED)]
            g = done.groupby("strategy").train_clock_s.mean()
            ratio = g["elastic_tensor"] / g["full"]
            ok = acc["mean_diff"] >= -0.01 and ratio <= 0.5
            out.append(
                f"(a) {fleet}: elastic_tensor - full, final accuracy {fmt(acc)}; training clock ratio "
                f"{ratio:.2f}: {'confirmed' if ok else 'refuted'} (within 1 point and <= 0.5 of full's time)"
            )
        for metric in [c for c in runs.columns if c.startswith("after_shift")]:
            p = get(fleet, "elastic_tensor", "static_elastic", metric)
            if p:
                better = p["mean_diff"] - p["ci95"] > 0
                out.append(
                    f"(b) {fleet}: elastic_tensor - static_elastic, accuracy in the round after {metric[6:]}: "
                    f"{fmt(p)}: {'confirmed' if better else 'not shown'} (interval above 0)"
                )
        p = get(fleet, "elastic_tensor", "random_budget", "final_accuracy")
        if p:
            better = p["mean_diff"] - p["ci95"] > 0
            out.append(
                f"(c) {fleet}: elastic_tensor - random_budget, final accuracy {fmt(p)}: "
                f"{'confirmed' if better else 'not shown'} (interval above 0)"
            )
        for other in ("last_layer", "sparse_update"):
            p = get(fleet, "tinytrain", other, "final_accuracy")
            if p and fleet == "mcu":
                better = p["mean_diff"] - p["ci95"] > 0
                out.append(
                    f"(d) mcu: tinytrain - {other}, final accuracy {fmt(p)}: {'confirmed' if better else 'not shown'}"
                )
    return out


TABLE = {
    "final_accuracy": "final acc.",
    "average_accuracy": "average acc.",
    "forgetting": "forgetting",
    "after_shift1": "acc. after shift 1",
    "after_shift2": "acc. after shift 2",
    "train_clock_s": "training clock (s)",
    "energy_j": "energy (J)",
    "fits_fraction": "fits",
    "idle_share": "idle client-rounds",
}


def ci_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy): used / run, then each metric's mean +/- 95% t half-width over the used seeds."""
    rows = []
    for (fleet, strategy), g in runs.groupby(["fleet", "strategy"], sort=False):
        done = g[g.status == USED]
        row = {"fleet": fleet, "strategy": strategy, "used": f"{len(done)}/{len(g)}"}
        for col, name in TABLE.items():
            if col not in g or done.empty:
                row[name] = "n/a"
                continue
            v = done[col].astype(float).dropna().to_numpy()
            half = ci95(v)
            row[name] = f"{v.mean():.3f}" + ("" if np.isnan(half) else f" ± {half:.3f}")
        rows.append(row)
    return pd.DataFrame(rows).set_index(["fleet", "strategy"])


def collapsed(runs: pd.DataFrame) -> list[str]:
    if "collapse_round" not in runs:
        return []
    hit = runs[runs.collapse_round.notna()]
    return [
        f"COLLAPSED: {r.fleet} / {r.strategy} / seed {r.seed}: predictions collapsed to one class from round "
        f"{int(r.collapse_round)} (continual.json)"
        for r in hit.itertuples()
    ]


def central_references(variants, out: Path) -> list[str]:
    """``full``'s starting weights trained centrally on every sample its clients received (per seed)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scenarios import central_accuracy  # noqa: PLC0415

    path = out / "central.csv"
    rows = pd.read_csv(path).to_dict("records") if path.is_file() else []  # seeds already trained centrally
    seen = {int(r["seed"]) for r in rows}
    for v in variants:
        if v.strategy != "full" or v.seed in seen:
            continue
        seen.add(v.seed)
        rows.append({"seed": v.seed, **central_accuracy(v.scenario, 3000)})
        print(f"central reference, seed {v.seed}: {rows[-1]}", flush=True)
    if not rows:
        return []
    df = pd.DataFrame(rows)
    df.to_csv(out / "central.csv", index=False)
    acc = df.central_accuracy.to_numpy(float)
    return [
        f"Central reference (full's starting weights, trained centrally on every sample the clients received, "
        f"{int(df.central_samples.iloc[0])} samples, at most 3,000 steps, evaluated on the final tasks): "
        f"final accuracy {acc.mean():.3f} ± {ci95(acc):.3f} over {len(acc)} seeds"
    ]


def markdown(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(map(str, df.columns)) + " |"
    rule = "|" + "---|" * len(df.columns)
    return "\n".join([head, rule, *("| " + " | ".join(map(str, r)) + " |" for r in df.itertuples(index=False))])


def plot(runs: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    sns.scatterplot(data=runs, x="train_clock_s", y="final_accuracy", hue="strategy", style="fleet", s=60, ax=axes[0])
    axes[0].set(xscale="log", xlabel="training clock (s, slowest client per round, summed)", ylabel="final accuracy")
    shifts = [c for c in runs.columns if c.startswith("after_shift")]
    long = runs.melt(id_vars=["fleet", "strategy", "seed"], value_vars=["final_accuracy", *shifts], var_name="when")
    sns.barplot(data=long, x="strategy", y="value", hue="when", ax=axes[1], errorbar=("ci", 95))
    axes[1].set(xlabel="", ylabel="accuracy (mean over seeds and fleets, 95% CI)")
    axes[1].tick_params(axis="x", rotation=40)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fleets", default="")
    ap.add_argument("--strategies", default="")
    ap.add_argument("--seeds", default="")
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.0, help="local learning rate (0: the file's)")
    ap.add_argument("--resume", action="store_true", help="keep --out-dir's runs.csv and run only what it lacks")
    ap.add_argument("--central", action="store_true", help="also train full centrally per seed (central.csv)")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results" / "continual_study"))
    args = ap.parse_args()
    path = ROOT / "benchmarks" / "continual_study.toml"
    raw = tomllib.loads(path.read_text())
    raw = copy.deepcopy(raw)
    comp = raw["compare"]
    if args.fleets:
        comp["fleets"] = {k: v for k, v in comp["fleets"].items() if k in args.fleets.split(",")}
    if args.strategies:
        keep = args.strategies.split(",")
        comp["strategies"] = [s for s in comp["strategies"] if (s if isinstance(s, str) else s["label"]) in keep]
    if args.seeds:
        comp["seeds"] = [int(s) for s in args.seeds.split(",")]
    if args.rounds:
        raw["server"]["rounds"] = args.rounds
    if args.lr:
        raw["train"]["lr"] = args.lr
    _, variants = expand(raw, str(path))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows, start = [], time.perf_counter()
    all_variants = variants
    if args.resume and (out / "runs.csv").is_file():  # keep the runs already there; run only the missing ones
        rows = pd.read_csv(out / "runs.csv").to_dict("records")
        have = {(r["fleet"], r["strategy"], int(r["seed"])) for r in rows}
        variants = [v for v in variants if (v.fleet, v.strategy, v.seed) not in have]
    fill_idle_share(rows)
    if rows:
        pd.DataFrame(rows).to_csv(out / "runs.csv", index=False)
    for i, v in enumerate(variants):
        row = {
            "fleet": v.fleet,
            "strategy": v.strategy,
            "seed": v.seed,
            **run_one(v.scenario, ROOT / "runs" / "continual_study" / stamp, v.seed),
        }
        print(
            f"[{i + 1}/{len(variants)}] {v.fleet} / {v.strategy} / seed {v.seed}: {row['status']} "
            f"final {row.get('final_accuracy', float('nan')):.3f} {row['why']}",
            flush=True,
        )
        rows.append(row)
        pd.DataFrame(rows).to_csv(out / "runs.csv", index=False)  # after every run: nothing finished is lost
    runs = pd.DataFrame(rows)
    metrics = [
        "final_accuracy",
        "average_accuracy",
        "train_clock_s",
        *[c for c in runs.columns if c.startswith("after_shift")],
    ]
    pairs = [
        p
        for fleet in runs.fleet.unique()
        for a, b in [
            ("elastic_tensor", "full"),
            ("elastic_tensor", "static_elastic"),
            ("elastic_tensor", "random_budget"),
            ("random_budget", "full"),
            ("static_elastic", "full"),
            ("tinytrain", "last_layer"),
            ("tinytrain", "sparse_update"),
        ]
        for m in metrics
        if (p := paired(runs, fleet, a, b, m)) is not None
    ]
    pd.DataFrame(pairs).to_csv(out / "paired.csv", index=False)
    done = runs[runs.status == USED]  # diverged, failed or errored runs are listed below, never averaged
    plot(done, out / "continual_study.png")
    table = ci_table(runs)
    central = central_references(all_variants, out) if args.central else []
    not_used = [
        f"NOT USED: {r.fleet} / {r.strategy} / seed {r.seed}: {r.status} {r.why}"
        for r in runs[runs.status != USED].itertuples()
    ]
    lines = [
        f"Command: `python benchmarks/continual_study.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}; "
        f"{len(runs)} runs, {len(variants)} of them run by this call in {time.perf_counter() - start:.0f} s wall)",
        "",
        markdown(table.reset_index()),
        "",
        *not_used,
        *collapsed(runs),
        "",
        *central,
        "",
        *[f"- {v}" for v in verdicts(runs, pairs)],
    ]
    (out / "verdicts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
