"""Deadline-driven elastic budgets against the other ways of handling stragglers (issue 9).

    python benchmarks/deadline_study.py [--seeds 0 1 2] [--rounds 20] [--targets 0.9 0.8] [--out-dir benchmarks/results]
    python benchmarks/deadline_study.py --local-epochs 6 --tag _compute --only wait_all deadline_drop ...

A mixed fleet of 16 clients (4 x STM32H743 MCU, 4 x Raspberry Pi 4, 4 x Jetson Nano, 4 x mid-range
phone) adapts ``small_cnn`` (width 16, pretrained centrally on digits 0-4, cached) to all ten digits
(Dirichlet alpha 0.5), 8 clients per round, 2 local epochs at batch 16, ``bn_mode = "train"``, plain ``full`` training
except where a policy says otherwise. Policies (``[server] policy``):

* ``wait_all``: every round waits for its slowest client;
* ``deadline_drop``: deadline = the 0.75 quantile of the sampled clients' full-training round
  times; late updates are discarded and their energy is wasted;
* ``deadline_fewer_steps``: the same deadline; each client runs the full-training steps that fit
  (FedNova-normalised aggregation);
* ``deadline_elastic/<strategy>``: the same deadline; each client gets its own rho for
  ``elastic_tensor`` (importance probe; interval 1000, so one probe per round) or ``random_budget``
  (no probe);
* ``deadline_elastic+steps/<strategy>``: the same, with ``min_rho = 0.5``: a client whose rho
  would fall below 0.5 runs fewer steps at rho >= 0.5 instead (elastic selection only shortens
  the backward pass, so rho cannot usefully approach the forward share of a step, about 1/3);
* the deadline policies again at the tighter 0.5 quantile (labels ending ``@q0.5``);
* ``deadline_fewer_steps/no_fednova``: fewer steps with a plain (not step-normalised) average, an
  ablation run only when named in ``--only``;
* ``overcommit``: 1.3 x 8 = 11 sampled, the first 8 arrivals kept;
* ``async``: FedBuff, 8 in flight, aggregation every 4 arrivals (2 x the rounds, so that as many
  updates can count as in the synchronous runs), staleness weight 1/sqrt(1+s).

Every run is in-process (the tests check Ray gives the same results). Per run: time to reach
each of ``--targets`` global accuracy on the simulated clock (NaN if never), final accuracy, energy in
total and wasted, and the share of dispatched client trips whose update counted. Per policy:
means over seeds, and for every other policy the paired difference to ``deadline_elastic/
elastic_tensor`` in time to target with a 95% t interval over seeds (only seeds where both reach
the target). Outputs in ``--out-dir``: ``deadline_study.csv`` (per policy), ``deadline_study_runs.csv``
(per run), ``deadline_study_rounds.csv`` (accuracy per aggregation), ``deadline_study.png`` and
``deadline_study_timeline.png`` (Gantt timelines of seed 0's wait_all, elastic and async runs;
``--timeline RUNS.csv`` redraws it from the run folders a runs CSV names).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic.fl.runner import run_scenario  # noqa: E402
from fedelastic.results.recorder import read_status  # noqa: E402
from fedelastic.scenario import parse_scenario  # noqa: E402

FLEET = {"stm32h743": 4, "raspberry_pi_4": 4, "jetson_nano": 4, "phone_midrange": 4}
PER_ROUND = 8
QUANTILE = 0.75
TIGHT = 0.5
MIN_RHO = 0.5
REFERENCE = "deadline_elastic/elastic_tensor"
USED = "completed"  # the only run status whose seeds enter means and paired differences
ABLATIONS = ("deadline_fewer_steps/no_fednova",)  # run only when named in --only


def base(seed: int, rounds: int, out: Path, local_epochs: int = 2) -> dict:
    return {
        "name": "deadline_study",
        "seed": seed,
        "output_dir": str(out),
        "fleet": FLEET,
        "data": {"partitioner": "dirichlet", "alpha": 0.5},
        "model": {
            "name": "small_cnn",
            "options": {"width": 16},
            "pretrain": {"classes": [0, 1, 2, 3, 4], "epochs": 30},
        },
        # batch statistics in training: with frozen ones (bn_mode "auto" from pretrained weights) lr 0.05
        # diverges to NaN in the first round on this model
        "train": {"strategy": "full", "local_epochs": local_epochs, "batch_size": 16, "lr": 0.05, "bn_mode": "train"},
        "server": {"rounds": rounds, "clients_per_round": PER_ROUND},
        "simulation": {"backend": "inprocess"},
    }


def policies(rounds: int) -> dict[str, tuple[dict, dict]]:
    """label -> (server overrides, train overrides). Deadline policies also run at a tighter quantile (0.5)."""
    out: dict[str, tuple[dict, dict]] = {"wait_all": ({"policy": "wait_all"}, {})}
    for q, suffix in ((QUANTILE, ""), (TIGHT, f"@q{TIGHT}")):
        deadline = {"deadline_quantile": q}
        out[f"deadline_drop{suffix}"] = ({"policy": "deadline_drop", **deadline}, {})
        out[f"deadline_fewer_steps{suffix}"] = ({"policy": "deadline_fewer_steps", **deadline}, {})
        out[f"deadline_elastic/elastic_tensor{suffix}"] = (
            {"policy": "deadline_elastic", **deadline},
            {"strategy": "elastic_tensor", "options": {"interval": 1000}},
        )
        out[f"deadline_elastic/random_budget{suffix}"] = (
            {"policy": "deadline_elastic", **deadline},
            {"strategy": "random_budget"},
        )
        out[f"deadline_elastic+steps/elastic_tensor{suffix}"] = (
            {"policy": "deadline_elastic", "min_rho": MIN_RHO, **deadline},
            {"strategy": "elastic_tensor", "options": {"interval": 1000}},
        )
        out[f"deadline_elastic+steps/random_budget{suffix}"] = (
            {"policy": "deadline_elastic", "min_rho": MIN_RHO, **deadline},
            {"strategy": "random_budget"},
        )
    out["deadline_fewer_steps/no_fednova"] = (
        {"policy": "deadline_fewer_steps", "deadline_quantile": QUANTILE, "fednova": False},
        {},
    )
    out["overcommit"] = ({"policy": "overcommit", "overcommit": 1.3}, {})
    out["async"] = (
        {"policy": "async", "rounds": 2 * rounds, "concurrency": PER_ROUND, "buffer_size": PER_ROUND // 2},
        {},
    )
    return out


def one_run(
    label: str, seed: int, rounds: int, out: Path, targets: list[float], local_epochs: int = 2
) -> tuple[dict, pd.DataFrame]:
    raw = base(seed, rounds, out, local_epochs)
    server, train = policies(rounds)[label]
    raw["server"] = {**raw["server"], **server}
    raw["train"] = {**raw["train"], **train}
    scenario = parse_scenario(raw, src=str(ROOT / "benchmarks" / "deadline_study.py"))
    start = time.perf_counter()
    run_dir = run_scenario(scenario, run_id=f"{label.replace('/', '-')}-s{seed}")
    wall = time.perf_counter() - start
    rounds_df = pd.read_parquet(run_dir / "rounds.parquet")
    clients = pd.read_parquet(run_dir / "clients.parquet")
    status = read_status(run_dir)
    trips = clients[clients.status != "failed"]
    row: dict = {"policy": label, "seed": seed, "status": status["status"]}
    if "divergence" in status:
        row["divergence"] = f"round {status['divergence'].get('round')}: {status['divergence'].get('reason')}"
    for i, target in enumerate(targets):
        hit = rounds_df[rounds_df.test_accuracy >= target]
        suffix = "" if i == 0 else f"_{target:g}"
        row[f"time_to_target{suffix}_s"] = float(hit.sim_time_s.iloc[0]) if len(hit) else np.nan
        row[f"energy_to_target{suffix}_j"] = float(hit.total_energy_j.iloc[0]) if len(hit) else np.nan
    row |= {
        "final_accuracy": float(rounds_df.test_accuracy.iloc[-1]),
        "best_accuracy": float(rounds_df.test_accuracy.max()),
        "sim_time_s": float(rounds_df.sim_time_s.iloc[-1]),
        "energy_j": float(trips.emulated_energy_j.sum() + trips.emulated_idle_energy_j.sum()),
        "wasted_energy_j": float(trips.wasted_energy_j.sum()),
        "counted_share": float(trips.counted.mean()),
        "too_slow_share": float((trips.status == "too_slow").mean()),
        "mean_rho_counted": float(trips.loc[trips.counted, "rho"].mean()),
        "mean_fraction_trained": float(trips.loc[trips.counted, "fraction_params_trained"].mean()),
        "mcu_counted_share": float(trips.loc[trips.device_class == "mcu", "counted"].mean()),
        "host_wall_s": wall,
        "run_dir": str(run_dir),
    }
    curve = rounds_df[["round", "sim_time_s", "test_accuracy", "total_energy_j"]].assign(policy=label, seed=seed)
    return row, curve


def paired(runs: pd.DataFrame, col: str) -> pd.DataFrame:
    """Per policy: mean paired difference to the reference in ``col``, with a 95% t interval over seeds."""
    from scipy import stats

    runs = runs[runs.status == USED]
    ref = runs[runs.policy == REFERENCE].set_index("seed")[col]
    rows = []
    for label, g in runs.groupby("policy", sort=False):
        if label == REFERENCE:
            continue
        diff = (g.set_index("seed")[col] - ref).dropna()
        n = len(diff)
        half = float(stats.t.ppf(0.975, n - 1) * diff.std(ddof=1) / math.sqrt(n)) if n > 1 else np.nan
        rows.append(
            {"policy": label, f"{col}_minus_reference": diff.mean(), "ci95_half_width": half, "seeds_paired": n}
        )
    return pd.DataFrame(rows)


def markdown(frame: pd.DataFrame) -> str:
    """A pipe table (numbers to 3 significant digits)."""
    cells = [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row] for row in frame.itertuples(index=False)]
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|" + "---|" * len(frame.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def plot(curves: pd.DataFrame, runs: pd.DataFrame, target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    order = list(dict.fromkeys(runs.policy))
    sns.set_theme(style="whitegrid", font_scale=0.8)
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    sns.lineplot(
        data=curves, x="sim_time_s", y="test_accuracy", hue="policy", hue_order=order, units="seed",
        estimator=None, alpha=0.8, ax=axes[0],
    )  # fmt: skip
    axes[0].axhline(target, color="k", ls="--", lw=1)
    axes[0].set(xlabel="simulated time (s)", ylabel="global test accuracy", title="accuracy vs simulated time")
    sns.move_legend(axes[0], "lower right", fontsize=7, title=None)
    sns.barplot(data=runs, y="policy", x="time_to_target_s", order=order, errorbar="sd", ax=axes[1])
    axes[1].set(xlabel=f"simulated time to {target:.0%} accuracy (s)", ylabel="", title="time to target (mean, sd)")
    energy = runs.melt(id_vars=["policy", "seed"], value_vars=["energy_j", "wasted_energy_j"], var_name="kind")
    sns.barplot(data=energy, y="policy", x="value", hue="kind", order=order, errorbar="sd", ax=axes[2])
    axes[2].set(xlabel="fleet energy over the run (J)", ylabel="", title="energy, and the part wasted")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_timelines(runs: pd.DataFrame, path: Path, labels=("wait_all", REFERENCE, "async")) -> None:
    """Gantt timelines of the first aggregations of the first seed's runs of ``labels``, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedelastic.results.recorder import plot_timeline

    first = runs[runs.seed == runs.seed.min()].set_index("policy")
    labels = [label for label in labels if label in first.index]
    if not labels:
        return
    fig, axes = plt.subplots(1, len(labels), figsize=(6.5 * len(labels), 5), squeeze=False)
    for ax, label in zip(axes[0], labels):
        run = Path(first.loc[label, "run_dir"])
        plot_timeline(pd.read_parquet(run / "rounds.parquet"), pd.read_parquet(run / "clients.parquet"), ax)
        ax.set_title(f"{label}: first 3 aggregations")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--targets", type=float, nargs="+", default=[0.9, 0.8], help="accuracy targets; the first is primary"
    )
    ap.add_argument("--only", nargs="*", default=None, help="run only these policy labels")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--runs-dir", type=Path, default=ROOT / "runs")
    ap.add_argument("--timeline", type=Path, default=None, help="only redraw the timelines from a runs CSV")
    ap.add_argument("--local-epochs", type=int, default=2, help="local epochs (more: a more compute-bound fleet)")
    ap.add_argument("--tag", default="", help="suffix of the output files (deadline_study<tag>.csv, ...)")
    args = ap.parse_args()
    if args.timeline:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        plot_timelines(pd.read_csv(args.timeline), args.out_dir / f"deadline_study{args.tag}_timeline.png")
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.runs_dir / f"deadline_study-{stamp}"
    rows, curves = [], []
    labels = args.only or [label for label in policies(args.rounds) if label not in ABLATIONS]
    for seed in args.seeds:
        for label in labels:
            row, curve = one_run(label, seed, args.rounds, out, args.targets, args.local_epochs)
            rows.append(row)
            curves.append(curve)
            print(
                f"{label:34s} seed {seed}: t->target {row['time_to_target_s']:8.2f} s  final {row['final_accuracy']:.3f}"
                f"  energy {row['energy_j']:8.1f} J (wasted {row['wasted_energy_j']:7.1f})  counted {row['counted_share']:.2f}"
                f"  [{row['host_wall_s']:.0f} s host] {row['status']}",
                flush=True,
            )
    runs = pd.DataFrame(rows)
    curves_df = pd.concat(curves, ignore_index=True)
    metrics = [c for c in runs.columns if c not in ("policy", "seed", "run_dir", "status", "divergence")]
    used = runs[runs.status == USED]  # a diverged, failed or errored run is listed, never averaged
    table = used.groupby("policy", sort=False)[metrics].mean().reindex(list(dict.fromkeys(runs.policy)))
    table["reached"] = used.groupby("policy", sort=False).time_to_target_s.apply(lambda s: int(s.notna().sum()))
    table["used"] = runs.groupby("policy", sort=False).status.apply(lambda s: f"{int((s == USED).sum())}/{len(s)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out_dir / f"deadline_study{args.tag}.csv")
    runs.to_csv(args.out_dir / f"deadline_study{args.tag}_runs.csv", index=False)
    curves_df.to_csv(args.out_dir / f"deadline_study{args.tag}_rounds.csv", index=False)
    plot(curves_df, runs[runs.status == USED], args.targets[0], args.out_dir / f"deadline_study{args.tag}.png")
    plot_timelines(runs, args.out_dir / f"deadline_study{args.tag}_timeline.png")
    secondary = [c for c in runs.columns if c.startswith("time_to_target_") and c != "time_to_target_s"]
    cols = [
        "used", "time_to_target_s", "reached", *secondary, "final_accuracy", "best_accuracy", "energy_j", "wasted_energy_j",
        "counted_share", "mcu_counted_share", "mean_rho_counted", "mean_fraction_trained", "sim_time_s",
    ]  # fmt: skip
    print(f"\n{platform.node()} {time.strftime('%Y-%m-%d')}; targets {args.targets}; seeds {args.seeds}\n")
    print(markdown(table[cols].reset_index()))
    bad = runs[runs.status != USED]
    for r in bad.itertuples(index=False):
        why = getattr(r, "divergence", "")
        print(f"NOT USED: {r.policy} seed {r.seed}: {r.status} {why if isinstance(why, str) else ''}")
    if REFERENCE in set(runs.policy):
        for col in ("time_to_target_s", *secondary, "final_accuracy"):
            print(f"\npaired vs {REFERENCE}: {col}\n")
            print(markdown(paired(runs, col)))


if __name__ == "__main__":
    main()
