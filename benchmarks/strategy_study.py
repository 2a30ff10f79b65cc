"""Every registered selection strategy on a GPU-class fleet and an MCU fleet, 3 seeds (issue 4).

    python benchmarks/strategy_study.py [--rounds N] [--out-dir benchmarks/results]
    python benchmarks/strategy_study.py --analyse runs/strategy_study/compare-YYYYmmdd-HHMMSS
    python benchmarks/strategy_study.py --strategies full,elastic_tensor --fleets gpu \
        --train 'bn_mode="train"' --out-dir benchmarks/results/ablation_bn_train   # an ablation

The scenario is ``benchmarks/strategy_study.toml``: ``mcu_net`` (width 16) pretrained centrally on
digits 0-4 and adapted by the fleet to all ten digits; fleets ``gpu`` (8 x Jetson TX2) and ``mcu``
(4 x STM32H743 + 4 x STM32F746); 5 rounds of 2 local epochs at batch 16; seeds 0, 1, 2. This script
fills ``[compare].strategies`` with every strategy of :func:`fedelastic.selection.strategy.available`, each
with its defaults except:

* strategies with a ``rho`` option (the ElasticTrainer family: elastic_tensor, elastic_layer,
  random_budget, static_elastic) run at ``rho = 0.4``; their re-selection interval is the
  default, the artifact's 4 epochs: each local training (one round, two local epochs) starts with
  a probe and a selection and re-selects no more within the round;
* ``sparse_update`` gets ``contributions``: its offline contribution analysis
  (:func:`fedelastic.train.contribution.analyse`), measured once by this script from the pretrained
  model on a **proxy task** made from the source task (the pretraining classes of the training
  split, what the server has before deployment, rotated 90 degrees: ``--contributions-proxy``;
  the source task itself gives every gain 0, the model already fits it; half to fine-tune, half
  to score), 2 epochs per choice, with the
  scenario's ``[train]`` settings, on the TX2's cost model (the gains are accuracies; each client's
  own memory decides which schemes it may run). ``--oracle-contributions`` adds the variant
  ``sparse_update (centralised oracle)``, whose analysis runs on the pooled target-task training
  data of every client (no other strategy sees it offline); the plain variant is always run.

It writes the resolved comparison file, then runs it with :func:`fedelastic.comparisons.comparison.run_comparison`
on the in-process backend (the comparison folder, with every run, goes under ``runs/``). From the
runs it computes per (fleet, strategy), mean and std over seeds:

* ``time_to_target_s``: simulated clock (slowest client's train + communication time, summed over
  rounds) when the global accuracy first reaches ``target_accuracy`` (NaN when never reached;
  ``reached`` counts the seeds that did);
* ``final_accuracy``, ``energy_j`` (total, idle included), ``sim_time_s`` (clock after the last
  round) and ``train_clock_s`` (the same clock without communication: the slowest client's
  emulated train time, probes included, summed over rounds);
* ``peak_memory_kib`` (largest emulated peak memory of any client, training or probe),
  ``probe_peak_memory_kib`` (largest probe peak alone) and
  ``peak_over_budget`` (largest ratio of a client's peak memory to its own device's training
  memory; > 1 means it did not fit), ``fits_fraction`` (client-rounds whose selection fit).

Outputs in ``--out-dir``: ``strategy_study.csv`` (the table), ``strategy_study_runs.csv`` (one
row per run), ``strategy_study_rounds.csv`` (accuracy per round), ``strategy_study.png`` (seaborn
figure), ``strategy_study_resolved.toml``; the markdown table and the four verdicts are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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

from fedelastic.comparisons.comparison import USED, ci95, run_comparison  # noqa: E402
from fedelastic.selection.strategy import REGISTRY, available  # noqa: E402

SCENARIO = ROOT / "benchmarks" / "strategy_study.toml"
RHO = 0.4
PREFERRED = (
    "full", "last_layer", "bn_bias", "elastic_tensor", "elastic_layer", "random_budget", "static_elastic",
    "tinytrain", "sparse_update",
)  # fmt: skip


ORACLE_LABEL = "sparse_update (centralised oracle)"


def strategy_entries(contributions: str = "", oracle_contributions: str = "") -> list[dict]:
    """Every registered strategy, with rho = 0.4 where it has that option, and sparse_update's gains
    (with ``oracle_contributions``, also its centralised-oracle variant)."""
    entries = []
    for name in strategy_order():
        fields = {f.name for f in dataclasses.fields(REGISTRY[name].config_cls)}
        options: dict = {}
        if "rho" in fields:
            options["rho"] = RHO
        if "contributions" in fields and contributions:
            options["contributions"] = contributions
        entries.append({"strategy": name, "label": name, "options": options})
        if name == "sparse_update" and oracle_contributions:
            oracle = {**options, "contributions": oracle_contributions, "oracle": True}
            entries.append({"strategy": name, "label": ORACLE_LABEL, "options": oracle})
    return entries


def measure_contributions(base: Path, path: Path, oracle: bool = False, proxy: str = "rotate90") -> dict:
    """Sparse Update's contribution analysis on the study's pretrained model (see the module doc):
    on a proxy task made from the source task's data (the pretraining classes of the training split
    under the domain shift ``proxy``: ``none`` keeps the source task itself, which the pretrained
    model already fits, so every gain is 0), or with ``oracle`` on the pooled target-task data."""
    import torch

    from fedelastic.comparisons.comparison import expand
    from fedelastic.data import transform
    from fedelastic.environment import RunEnvironment
    from fedelastic.train.contribution import analyse
    from fedelastic.train.pretrain import initial_state

    raw = tomllib.loads(base.read_text())
    raw["compare"]["strategies"] = ["sparse_update"]
    raw["compare"]["seeds"] = [raw["compare"].get("seeds", [0])[0]]
    _, variants = expand(raw, str(base))
    env = RunEnvironment(variants[0].scenario)
    torch.set_num_threads(1)
    model = env.new_model()
    model.load_state_dict(initial_state(env))
    pre = env.scenario.model.pretrain
    if oracle:
        train = env.data.train
        data = "the target task's pooled training split (every client's data)"
    else:
        train = env.view(env.split[0], pre.classes, pre.transform)  # what pretraining trained on
        data = f"the source task: classes {list(pre.classes)} of the training split (the pretraining data)"
        if proxy != "none":
            train = transform(train, proxy, env.scenario.seed)
            data = f"a proxy task: {data}, under the shift {proxy!r}"
    order = np.random.default_rng(0).permutation(len(train))
    half = len(order) // 2
    t = env.scenario.train
    gains = analyse(
        model, env.info, env.cost("jetson_tx2"), train.subset(order[:half]), train.subset(order[half:]),
        epochs=2, batch_size=t.batch_size, lr=t.lr, path=path, oracle=oracle,
        data=f"{data}: {half} samples to fine-tune, {len(order) - half} to score",
        momentum=t.momentum, weight_decay=t.weight_decay, optimizer=t.optimizer, lr_schedule=t.lr_schedule,
    )  # fmt: skip
    return gains


def resolved_toml(
    base: Path,
    rounds: int | None,
    contributions: str = "",
    strategies: list[str] | None = None,
    fleets: list[str] | None = None,
    train: dict | None = None,
    oracle_contributions: str = "",
) -> str:
    import tomli_w

    raw = tomllib.loads(base.read_text())
    entries = strategy_entries(contributions, oracle_contributions)
    raw["compare"]["strategies"] = [e for e in entries if not strategies or e["strategy"] in strategies]
    if fleets:
        raw["compare"]["fleets"] = {k: v for k, v in raw["compare"]["fleets"].items() if k in fleets}
    raw["train"].update(train or {})
    if rounds:
        raw["server"]["rounds"] = rounds
    header = (
        f"# Resolved from {base.relative_to(ROOT) if base.is_relative_to(ROOT) else base} by benchmarks/strategy_study.py "
        "(strategies filled from fedelastic.selection.strategy.available())\n"
    )
    return header + tomli_w.dumps(raw)


# ----------------------------------------------------------------------------- analysis


def per_run(out: Path) -> tuple[pd.DataFrame, pd.DataFrame, float]:
    """One row per run with the study's figures, and the per-round accuracy of every run."""
    summary = pd.read_csv(out / "summary.csv")
    rounds_all = pd.read_csv(out / "runs.csv")
    raw = tomllib.loads((out / "comparison.toml").read_text())
    target = float(raw["compare"]["target_accuracy"])
    rows = []
    for _, s in summary.iterrows():
        row = {"fleet": s.fleet, "strategy": s.strategy, "seed": int(s.seed), "status": s.get("status", USED)}
        row["error"] = s.get("error", "") if isinstance(s.get("error", ""), str) else ""
        run = Path(s.run_dir) if isinstance(s.run_dir, str) else None
        if run is not None and not run.is_absolute():
            run = ROOT / run
        if run is None or not (run / "rounds.parquet").exists():  # a run that failed before writing rounds
            rows.append(row)
            continue
        clients = pd.read_parquet(run / "clients.parquet")
        rounds = pd.read_parquet(run / "rounds.parquet")
        clients = clients[clients["round"] > 0]
        train_clock = clients.groupby("round").emulated_train_time_s.max().reindex(rounds["round"], fill_value=0.0)
        rounds = rounds.assign(train_clock_s=train_clock.cumsum().to_numpy())
        hit = rounds[rounds.test_accuracy >= target]
        rows.append(
            row
            | {
                "final_accuracy": float(rounds.test_accuracy.iloc[-1]),
                "initial_accuracy": float(rounds.test_accuracy.iloc[0]),
                "time_to_target_s": float(hit.sim_time_s.iloc[0]) if len(hit) else np.nan,
                "train_clock_to_target_s": float(hit.train_clock_s.iloc[0]) if len(hit) else np.nan,
                "reached": float(len(hit) > 0),
                "sim_time_s": float(rounds.sim_time_s.iloc[-1]),
                "train_clock_s": float(rounds.train_clock_s.iloc[-1]),
                "energy_j": float(rounds.total_energy_j.iloc[-1]),
                "peak_memory_kib": float(clients.emulated_peak_memory_bytes.max() / 1024),
                "probe_peak_memory_kib": float(clients.emulated_probe_peak_memory_bytes.max() / 1024),
                "peak_over_budget": float((clients.emulated_peak_memory_bytes / clients.device_memory_bytes).max()),
                "fits_fraction": float(clients.fits.mean()),
                "rejected_fraction": float((clients.status == "rejected").mean()),
                "fraction_params_trained": float(clients.fraction_params_trained.mean()),
                "host_wall_s": float(s.host_wall_s),
            }
        )
    return pd.DataFrame(rows), rounds_all, target


def strategy_order() -> list[str]:
    """Baselines first, then the ElasticTrainer family, then the memory-first methods, then any others."""
    preferred = [s for s in PREFERRED if s in available()]
    return preferred + [s for s in available() if s not in preferred]


def aggregate(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy): mean and 95% t half-width (``_ci``) of every metric over the seeds whose
    run completed; ``used`` is ``completed/run``, and a diverged or failed seed enters no mean."""
    order = {name: i for i, name in enumerate(strategy_order())}
    metrics = [c for c in runs.columns if c not in ("fleet", "strategy", "seed", "status", "error")]
    rows = []
    for (fleet, strategy), g in runs.groupby(["fleet", "strategy"], sort=False):
        u = g[g.status == USED]
        row = {"fleet": fleet, "strategy": strategy, "used": f"{len(u)}/{len(g)}"}
        row["diverged"] = int((g.status == "diverged").sum())
        row["not_used"] = int((g.status != USED).sum())
        for m in metrics:
            values = u[m].dropna().to_numpy(float)
            row[f"{m}_mean"] = float(values.mean()) if len(values) else np.nan
            row[f"{m}_ci"] = ci95(values)
        row["reached"] = int(u.reached.sum()) if len(u) else 0
        rows.append(row)
    agg = pd.DataFrame(rows)
    agg["_o"] = agg.strategy.map(lambda name: order.get(name, len(order)))  # variants (the oracle) last
    return agg.sort_values(["fleet", "_o"]).drop(columns="_o").reset_index(drop=True)


def plot(runs: pd.DataFrame, rounds: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    strategies = [s for s in strategy_order() if s in set(runs.strategy)]
    strategies += sorted(set(runs.strategy) - set(strategies))  # variants (the oracle)
    palette = dict(zip(strategies, sns.color_palette("tab10", len(strategies))))
    fleets = list(dict.fromkeys(runs.fleet))
    sns.set_theme(style="whitegrid", font_scale=0.8)
    fig, axes = plt.subplots(len(fleets), 4, figsize=(18, 4.2 * len(fleets)), squeeze=False)
    for i, fleet in enumerate(fleets):
        r = rounds[rounds.fleet == fleet]
        if "status" in r:
            r = r[r.status == USED]
        curve = r.groupby(["strategy", "round"], as_index=False)[["sim_time_s", "test_accuracy"]].mean()
        sns.lineplot(
            data=curve, x="sim_time_s", y="test_accuracy", hue="strategy", hue_order=strategies,
            palette=palette, marker="o", ax=axes[i, 0], legend=i == 0,
        )  # fmt: skip
        axes[i, 0].set(xlabel="simulated time (s)", ylabel="global test accuracy")
        axes[i, 0].set_title(f"{fleet}: accuracy vs simulated time (mean of seeds)")
        f = runs[(runs.fleet == fleet) & (runs.status == USED)]
        for ax, col, label, log in (
            (axes[i, 1], "final_accuracy", "final accuracy", False),
            (axes[i, 2], "train_clock_s", "emulated training clock (s)", False),
            (axes[i, 3], "peak_over_budget", "peak memory / device memory (log)", True),
        ):
            sns.barplot(
                data=f, y="strategy", x=col, hue="strategy", order=strategies, hue_order=strategies,
                palette=palette, errorbar="sd", ax=ax, legend=False,
            )  # fmt: skip
            ax.set(xlabel=label, ylabel="")
            if log:
                ax.set_xscale("log")
            ax.set_title(f"{fleet}: {label.split(' (')[0]}")
        axes[i, 3].axvline(1.0, color="k", lw=1, ls="--")
        axes[i, 1].set_xlim(0, 1)
    if axes[0, 0].get_legend() is not None:
        sns.move_legend(axes[0, 0], "lower right", fontsize=7, title=None)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- report


def fmt(mean: float, std: float, spec: str = ".3f", scale: float = 1.0) -> str:
    if np.isnan(mean):
        return "n/a"
    s = f"{mean * scale:{spec}}"
    return s if np.isnan(std) else f"{s} ± {std * scale:{spec}}"


def markdown_table(agg: pd.DataFrame, target: float) -> str:
    head = (
        f"| fleet | strategy | used | time to {target:.0%} (s) [seeds reached] | final accuracy | training clock (s) "
        "| sim clock (s) | energy (J) | peak memory (KiB) | probe peak (KiB) | peak / device memory | fits | rejected |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in agg.iterrows():
        n = r.used.split("/")[0]
        used = r.used + (f" ({r.diverged} div)" if r.diverged else "")
        lines.append(
            f"| {r.fleet} | {r.strategy} | {used} | {fmt(r.time_to_target_s_mean, r.time_to_target_s_ci, '.2f')} "
            f"[{r.reached}/{n}] | {fmt(r.final_accuracy_mean, r.final_accuracy_ci)} "
            f"| {fmt(r.train_clock_s_mean, r.train_clock_s_ci, '.3g')} | {fmt(r.sim_time_s_mean, r.sim_time_s_ci, '.3g')} "
            f"| {fmt(r.energy_j_mean, r.energy_j_ci, '.3g')} | {r.peak_memory_kib_mean:,.0f} "
            f"| {r.probe_peak_memory_kib_mean:,.0f} "
            f"| {r.peak_over_budget_mean:.3g} | {r.fits_fraction_mean:.2f} | {r.rejected_fraction_mean:.2f} |"
        )
    return "\n".join(lines)


def verdicts(agg: pd.DataFrame) -> str:
    a = agg.set_index(["fleet", "strategy"])

    def g(fleet, strategy, col):
        return float(a.loc[(fleet, strategy), col]) if (fleet, strategy) in a.index else np.nan

    out = []
    # (a): judged where full trains at all; on a fleet where full never fits, say so
    parts, verdict = [], []
    for fleet in dict.fromkeys(agg.fleet):
        d_acc = 100 * (g(fleet, "elastic_tensor", "final_accuracy_mean") - g(fleet, "full", "final_accuracy_mean"))
        full_fit = g(fleet, "full", "fits_fraction_mean")
        if np.isnan(full_fit):  # no seed of full completed: no reference on this fleet
            parts.append(f"{fleet}: NOT TESTABLE, no seed of full completed ({a.loc[(fleet, 'full'), 'used']} used)")
            verdict.append(False)
            continue
        if full_fit == 0:
            parts.append(
                f"{fleet}: full never fits, so it never trains (its accuracy stays at the pretrained "
                f"{g(fleet, 'full', 'final_accuracy_mean'):.3f}); elastic_tensor ends {d_acc:+.1f} points above it"
            )
            continue
        r_train = g(fleet, "elastic_tensor", "train_clock_s_mean") / g(fleet, "full", "train_clock_s_mean")
        r_sim = g(fleet, "elastic_tensor", "sim_time_s_mean") / g(fleet, "full", "sim_time_s_mean")
        r_tt = g(fleet, "elastic_tensor", "time_to_target_s_mean") / g(fleet, "full", "time_to_target_s_mean")
        verdict.append(d_acc >= -1 and r_train <= 0.4 and r_sim <= 0.4)
        parts.append(
            f"{fleet}: accuracy {d_acc:+.1f} points vs full; training clock {r_train:.0%}, simulated clock "
            f"{r_sim:.0%} and time to target {r_tt:.0%} of full's"
        )
    out.append(f"(a) {'CONFIRMED' if verdict and all(verdict) else 'REFUTED'}: " + "; ".join(parts) + ".")
    # (b)
    t_l, t_t = g("gpu", "elastic_layer", "train_clock_s_mean"), g("gpu", "elastic_tensor", "train_clock_s_mean")
    s_l, s_t = g("gpu", "elastic_layer", "sim_time_s_mean"), g("gpu", "elastic_tensor", "sim_time_s_mean")
    tt_l, tt_t = g("gpu", "elastic_layer", "time_to_target_s_mean"), g("gpu", "elastic_tensor", "time_to_target_s_mean")
    a_l, a_t = g("gpu", "elastic_layer", "final_accuracy_mean"), g("gpu", "elastic_tensor", "final_accuracy_mean")
    out.append(
        "(b) NOT TESTABLE in this emulator: one roofline both selects the layers and charges them, so layer "
        "units are only a restricted form of tensor units (elastic_layer's objective can never exceed "
        f"elastic_tensor's on the same budget). For the record, GPU fleet: elastic_layer training clock {t_l:.3g} s vs "
        f"elastic_tensor {t_t:.3g} s ({t_l / t_t - 1:+.0%}); simulated clock {s_l:.3g} vs {s_t:.3g} s; time to target "
        f"{tt_l:.3g} vs {tt_t:.3g} s; final accuracy {a_l:.3f} vs {a_t:.3f}. A test needs a device whose measured "
        "kernel efficiency depends on kernel size (small dW kernels slower than the roofline says), as in the "
        "elastic-layer paper."
    )
    # (c)
    f_tt, f_full, f_et = (g("mcu", s, "fits_fraction_mean") for s in ("tinytrain", "full", "elastic_tensor"))
    acc_tt, acc_ll = g("mcu", "tinytrain", "final_accuracy_mean"), g("mcu", "last_layer", "final_accuracy_mean")
    ok_c = f_tt == 1 and f_full < 1 and f_et < 1 and acc_tt > acc_ll
    out.append(
        f"(c) {'CONFIRMED' if ok_c else 'REFUTED' if not (f_tt == 1 and acc_tt > acc_ll) else 'PARTLY CONFIRMED'}: MCU fleet, "
        f"fits: tinytrain {f_tt:.0%}, full {f_full:.0%}, elastic_tensor {f_et:.0%} of client-rounds; peak / device "
        f"memory: tinytrain {g('mcu', 'tinytrain', 'peak_over_budget_mean'):.2f}, full "
        f"{g('mcu', 'full', 'peak_over_budget_mean'):.2f}, elastic_tensor {g('mcu', 'elastic_tensor', 'peak_over_budget_mean'):.2f}; "
        f"final accuracy tinytrain {acc_tt:.3f} vs last_layer {acc_ll:.3f}."
    )
    # (d)
    parts, ok_d = [], True
    for fleet in dict.fromkeys(agg.fleet):
        e = g(fleet, "elastic_tensor", "final_accuracy_mean")
        for s in ("random_budget", "static_elastic"):
            v = g(fleet, s, "final_accuracy_mean")
            ok_d &= v < e
            parts.append(
                f"{fleet} {s} {v:.3f} vs {e:.3f} ({100 * (v - e):+.1f} pts; time to target "
                f"{g(fleet, s, 'time_to_target_s_mean'):.3g} vs {g(fleet, 'elastic_tensor', 'time_to_target_s_mean'):.3g} s)"
            )
    out.append(f"(d) {'CONFIRMED' if ok_d else 'REFUTED'} (final accuracy): " + "; ".join(parts) + ".")
    return "\n\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", type=Path, default=SCENARIO)
    ap.add_argument("--rounds", type=int, default=None, help="override [server].rounds")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--analyse", type=Path, default=None, help="re-analyse a finished comparison folder")
    ap.add_argument("--strategies", default="", help="comma-separated subset of strategies (ablations)")
    ap.add_argument("--fleets", default="", help="comma-separated subset of fleets (ablations)")
    ap.add_argument(
        "--train", action="append", default=[], metavar="KEY=VALUE", help="override a [train] key (TOML value)"
    )
    ap.add_argument(
        "--contributions-proxy",
        default="rotate90",
        choices=("rotate90", "noise", "invert", "none"),
        help="the shift that makes Sparse Update's proxy task from the source task ('none': the source task)",
    )
    ap.add_argument(
        "--oracle-contributions",
        action="store_true",
        help=f"also run {ORACLE_LABEL!r}: Sparse Update's analysis on the pooled target-task data",
    )
    args = ap.parse_args(argv)
    strategies = [x for x in args.strategies.split(",") if x]
    fleets = [x for x in args.fleets.split(",") if x]
    train = {k: tomllib.loads(f"v = {v}")["v"] for k, v in (item.split("=", 1) for item in args.train)}
    os.chdir(ROOT)  # runs go to ./runs (git-ignored)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    if args.analyse is None:
        contributions = oracle_contributions = ""
        if not strategies or "sparse_update" in strategies:
            for oracle in (False, True) if args.oracle_contributions else (False,):
                name = "strategy_study_contributions_oracle.json" if oracle else "strategy_study_contributions.json"
                gains_path = args.out_dir / name
                t1 = time.perf_counter()
                gains = measure_contributions(args.scenario.resolve(), gains_path, oracle, args.contributions_proxy)
                print(f"contribution analysis ({time.perf_counter() - t1:.0f} s): {json.dumps(gains)}", flush=True)
                if oracle:
                    oracle_contributions = str(gains_path.resolve().relative_to(ROOT))
                else:
                    contributions = str(gains_path.resolve().relative_to(ROOT))
        text = resolved_toml(
            args.scenario.resolve(), args.rounds, contributions, strategies, fleets, train, oracle_contributions
        )
        resolved = args.out_dir / "strategy_study_resolved.toml"
        resolved.write_text(text)
        raw = tomllib.loads(text)
        out = ROOT / "runs" / raw["name"] / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
        out = run_comparison(resolved, output=out, backend="inprocess")
        (out / "comparison.toml").write_text(text)
    else:
        out = args.analyse
    runtime = time.perf_counter() - t0
    runs, rounds, target = per_run(out)
    agg = aggregate(runs)
    agg.to_csv(args.out_dir / "strategy_study.csv", index=False, float_format="%.6g")
    runs.to_csv(args.out_dir / "strategy_study_runs.csv", index=False, float_format="%.6g")
    rounds[["fleet", "strategy", "seed", "round", "sim_time_s", "test_accuracy", "total_energy_j"]].to_csv(
        args.out_dir / "strategy_study_rounds.csv", index=False, float_format="%.6g"
    )
    plot(runs, rounds, args.out_dir / "strategy_study.png")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"\ncomparison folder: {out}")
    print(
        f"date {time.strftime('%Y-%m-%d %H:%M')}, commit {commit}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores; runtime {runtime:.0f} s (load average {load0:.1f} -> {os.getloadavg()[0]:.1f}); "
        f"host training wall time summed over runs {runs.host_wall_s.sum():.0f} s\n"
    )
    print(markdown_table(agg, target))
    print("\n(mean ± 95% t half-width over the seeds that completed; `used` = completed / run)")
    for r in runs[runs.status != USED].itertuples(index=False):
        print(f"NOT USED: {r.fleet} / {r.strategy} / seed {r.seed}: {r.status} {r.error}")
    print()
    if not strategies and not fleets:  # the verdicts need every strategy on both fleets
        print(verdicts(agg))


if __name__ == "__main__":
    main()
