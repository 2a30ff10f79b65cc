"""One self-contained HTML page for a run folder or a comparison folder.

The figures are PNGs inlined as data URIs and the page has no script and no external resource,
so it opens from disk, in a mail attachment or in a CI artifact alike. It reads only what the
run wrote (``rounds.parquet``, ``clients.parquet``, ``status.json``, ``config.toml``; for a
comparison ``summary_by_strategy.csv`` and ``runs.csv``), so a partial run gets a page too.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..devices.units import fmt_bytes
from ..sim.columns import ClientCol, RoundCol

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
figure { margin: 1em 0; } figure img { max-width: 100%; } figcaption { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; } td, th { padding: 0.25em 0.6em; text-align: right; }
th { background: #f2f2f2; } tr:nth-child(even) td { background: #fafafa; }
.bad { color: #b00; } pre { background: #f6f6f6; padding: 1em; overflow-x: auto; }
"""


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(png: str, alt: str, caption: str) -> str:
    return (
        f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{png}">'
        f"<figcaption>{html.escape(caption)}</figcaption></figure>"
    )



# ---- a run -------------------------------------------------------------------------------------


def accuracy_figure(rounds: pd.DataFrame) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    rounds = rounds[rounds[RoundCol.TEST_ACCURACY].notna()]  # rounds skipped by server.evaluate_every
    ax.plot(rounds[RoundCol.SIM_TIME_S], rounds[RoundCol.TEST_ACCURACY], marker="o")
    points = rounds[[RoundCol.ROUND, RoundCol.SIM_TIME_S, RoundCol.TEST_ACCURACY]].itertuples(index=False)
    for n, time_s, accuracy in points:
        ax.annotate(str(n), (time_s, accuracy), fontsize=7, xytext=(3, -9), textcoords="offset points")
    ax.set(xlabel="simulated time (s)", ylabel="global test accuracy", ylim=(0, 1))
    ax.grid(alpha=0.3)
    return _figure(_png(fig), "accuracy against simulated time", "Global test accuracy after each round (numbered).")


def energy_by_class(clients: pd.DataFrame) -> pd.DataFrame:
    """Per device class: clients, and active and idle energy summed over the run (J)."""
    g = clients.groupby(ClientCol.DEVICE_CLASS)
    return pd.DataFrame(
        {
            "clients": g[ClientCol.PARTITION_ID].nunique(),
            "active_j": g[ClientCol.EMULATED_ENERGY_J].sum(min_count=1),
            "idle_j": g[ClientCol.EMULATED_IDLE_ENERGY_J].sum(min_count=1),
        }
    ).fillna(0.0)


def energy_figure(clients: pd.DataFrame) -> str:
    plt = _plt()
    e = energy_by_class(clients)
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(e)))
    labels = [f"{c} ({n} clients)" for c, n in zip(e.index, e.clients)]
    ax.barh(labels, e.active_j, label="training and radio")
    ax.barh(labels, e.idle_j, left=e.active_j, label="idle, waiting for the round's slowest client")
    ax.set(xlabel="emulated energy over the run (J)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, -0.25 - 0.5 / len(e)), ncol=2, frameon=False)
    return _figure(
        _png(fig), "energy per device class", "Emulated energy per device class, summed over clients and rounds."
    )


def memory_by_device(clients: pd.DataFrame) -> pd.DataFrame:
    """Per device: the highest emulated peak training memory and the device's training memory."""
    g = clients.groupby(ClientCol.DEVICE)
    out = pd.DataFrame(
        {"peak_bytes": g[ClientCol.EMULATED_PEAK_MEMORY_BYTES].max(), "budget_bytes": g[ClientCol.DEVICE_MEMORY_BYTES].max()}
    )
    out["share"] = out.peak_bytes / out.budget_bytes
    return out


def memory_figure(clients: pd.DataFrame) -> str:
    plt = _plt()
    m = memory_by_device(clients).dropna()
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.45 * max(len(m), 1)))
    colors = ["#c0392b" if s > 1 else "#2e86c1" for s in m.share]
    ax.barh(m.index, 100 * m.share, color=colors)
    ax.axvline(100, color="black", lw=1, ls="--")
    for y, (peak, budget) in enumerate(zip(m.peak_bytes, m.budget_bytes)):
        ax.annotate(
            f"{fmt_bytes(peak)} of {fmt_bytes(budget)}",
            (100 * peak / budget, y),
            fontsize=7,
            xytext=(4, -3),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_xlim(right=max(100.0, 100 * float(m.share.max() if len(m) else 1)) * 30)  # room for the labels
    ax.set(xlabel="highest peak training memory, % of the device's training memory (log; dashed: 100%)")
    return _figure(
        _png(fig),
        "memory against budget",
        "Peak emulated training memory against each device's budget; red: over it (the selection was not trained).",
    )


def selection_heatmap(clients: pd.DataFrame) -> str:
    """Fraction of the model's parameters each client trained in each round (blank: not sampled)."""
    plt = _plt()
    table = clients.pivot_table(
        index=[ClientCol.DEVICE, ClientCol.PARTITION_ID], columns=ClientCol.ROUND, values=ClientCol.FRACTION_PARAMS_TRAINED
    )
    fig, ax = plt.subplots(figsize=(min(2 + 0.5 * table.shape[1], 12), 0.8 + 0.22 * len(table)))
    image = ax.imshow(table.to_numpy(float), aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_yticks(range(len(table)), [f"{d} #{p}" for d, p in table.index], fontsize=7)
    ax.set_xticks(range(table.shape[1]), [str(c) for c in table.columns], fontsize=7)
    ax.set(xlabel="round")
    fig.colorbar(image, ax=ax, label="fraction of parameters trained")
    return _figure(
        _png(fig),
        "parameters trained per client and round",
        "What each client trained: the fraction of the model's parameters its selection covered, per round "
        "(blank: not sampled, or failed). The run records this fraction per client, not the tensors themselves.",
    )


def device_table(clients: pd.DataFrame) -> str:
    """Per device: its figures, the share of its client-rounds that trained nothing, and below, why."""
    from ..results import idle

    g = clients.groupby([ClientCol.DEVICE, ClientCol.DEVICE_CLASS])
    nothing = idle.by_device(clients)
    t = pd.DataFrame(
        {
            "clients": g[ClientCol.PARTITION_ID].nunique(),
            "fits": g[ClientCol.FITS].mean().map("{:.0%}".format),
            "trained nothing": g[ClientCol.DEVICE].first().map(lambda d: idle.percent(nothing.share[d])),
            "failed": g[ClientCol.ERROR].apply(lambda e: int((e.fillna("") != "").sum())),
            "train s/round": g[ClientCol.EMULATED_TRAIN_TIME_S].mean().map("{:.3g}".format),
            "comm s/round": g[ClientCol.EMULATED_COMM_TIME_S].mean().map("{:.3g}".format),
            "energy J/round": g[ClientCol.EMULATED_ENERGY_J].mean().map("{:.3g}".format),
            "peak memory": g[ClientCol.EMULATED_PEAK_MEMORY_BYTES].max().map(fmt_bytes),
            "device memory": g[ClientCol.DEVICE_MEMORY_BYTES].max().map(fmt_bytes),
            "params trained": g[ClientCol.FRACTION_PARAMS_TRAINED].mean().map("{:.0%}".format),
        }
    )
    for header, column in (
        ("train s band", ClientCol.EMULATED_TRAIN_TIME_BAND_S),
        ("energy J band (with idle)", ClientCol.EMULATED_ENERGY_BAND_J),
    ):
        if column in clients:  # the emulation's one-sigma band (a run written before it has none)
            t.insert(t.columns.get_loc("peak memory"), header, g[column].mean().map("± {:.3g}".format))
    flagged = set(idle.flagged(nothing))
    why = "".join(
        f"<li{_BAD if device in flagged else ''}>{html.escape(line)}</li>"
        for device, line in idle.lines(nothing).items()
    )
    return t.reset_index().to_html(index=False, border=0) + (f"<ul>{why}</ul>" if why else "")


_BAD = ' class="bad"'


def _rate(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.3f}"


def accuracy_matrix_table(R: np.ndarray, summary: dict, labels: list[str]) -> str:
    """The textbook matrix: accuracy on every task (columns) initially and at the end of each task (rows)."""
    rows = [("initial model", 0)] + [
        (f"after task {t['task']}", t["end_round"]) for t in summary["per_task"] if t["end_round"] < len(R)
    ]
    table = pd.DataFrame(
        [[f"{name} (round {r})", *(_rate(float(v)) for v in R[r, : len(labels)])] for name, r in rows],
        columns=["", *(f"task {j}: {html.escape(label)}" for j, label in enumerate(labels))],
    )
    return table.to_html(index=False, border=0, escape=False)


def accuracy_matrix_figure(R: np.ndarray, starts: list[int], labels: list[str]) -> str:
    """Heatmap of R[t, j] over every round (cells annotated up to 40 rounds); the rounds at which tasks arrive marked."""
    plt = _plt()
    rounds, tasks = R.shape
    fig, ax = plt.subplots(figsize=(min(2.5 + 1.1 * tasks, 12), min(0.9 + 0.3 * rounds, 14)))
    image = ax.imshow(R, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    if rounds <= 40:  # each cell annotated while the text still fits
        for t, j in zip(*np.nonzero(np.isfinite(R))):
            ax.text(j, t, f"{R[t, j]:.2f}", ha="center", va="center", fontsize=7,
                    color="black" if R[t, j] > 0.6 else "white")  # fmt: skip
    for j, s in enumerate(starts):
        if 0 < s < rounds:
            ax.plot([j - 0.5, j + 0.5], [s - 0.5, s - 0.5], color="red", lw=2)
    ax.set_xticks(
        range(tasks), [f"{j}: {label}" for j, label in enumerate(labels)], fontsize=7, rotation=30, ha="right"
    )
    shown = range(0, rounds, max(1, rounds // 40))
    ax.set_yticks(shown, [str(t) for t in shown], fontsize=7)
    ax.set(ylabel="after round", xlabel="evaluation task")
    fig.colorbar(image, ax=ax, label="test accuracy")
    return _figure(
        _png(fig),
        "accuracy matrix heatmap",
        "The accuracy matrix R[t, j]: test accuracy on task j (column) after round t (row; 0: the initial model). "
        "Red line: the task arrives (the rows below it were trained on its data).",
    )


def continual_tables(summary: dict) -> str:
    """The run's forgetting and transfer, then the per-task breakdown, with each n/a's reason."""
    overall = pd.DataFrame(
        {
            "final accuracy": [_rate(summary["final_accuracy"])],
            "average accuracy": [_rate(summary["average_accuracy"])],
            "forgetting": [_rate(summary["forgetting"])],
            "backward transfer": [_rate(summary["backward_transfer"])],
            "forward transfer": [_rate(summary["forward_transfer"])],
        }
    ).to_html(index=False, border=0)
    per_task = pd.DataFrame(
        [
            {
                "task": f"{t['task']}: {t.get('label', '')}",
                "rounds": f"{t['start_round']}–{t['end_round']}",
                "accuracy at its end": _rate(t["accuracy_at_end"]),
                "final accuracy": _rate(t["final_accuracy"]),
                "forgetting": _rate(t["forgetting"]),
                "forward transfer": _rate(t["forward_transfer"]),
                "recovery after its shift": t["recovery"]
                + ("" if np.isnan(t["time_to_recover_s"]) else f" ({t['time_to_recover_s']:.3g} s)"),
            }
            for t in summary["per_task"]
        ]
    ).to_html(index=False, border=0)
    notes = [
        f"task {t['task']}: {t['forward_transfer_note']}"
        for t in summary["per_task"][1:]
        if "forward_transfer_note" in t
    ]
    listed = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return (
        overall
        + "<p>Forgetting: the best accuracy a task had at the end of a task since it was learned, minus its final "
        "accuracy (Chaudhry et al. 2018; none for the last task). Forward transfer: the accuracy on a task just "
        "before it arrives minus the initial model's (Lopez-Paz &amp; Ranzato 2017; Avalanche's "
        f"ExperienceForwardTransfer). Recovery: back to {summary['recover_share']:.0%} of the accuracy before "
        "the shift, searched from the shift's round on.</p>" + per_task + (f"<ul>{listed}</ul>" if listed else "")
    )


def continual_sections(run_dir: Path) -> list[str]:
    """The sections of a continual run (one with ``tasks.parquet``): collapse, matrix, summaries, per-task figure."""
    from ..results.continual import load, plot_tasks
    from ..results.continual_metrics import collapse_message, matrix

    tasks, summary = load(run_dir)
    R, starts, _ = matrix(tasks)
    J = summary["tasks"]
    labels = tasks.groupby("task").task_label.first().sort_index().tolist()[:J]
    out = []
    if summary["collapse"] is not None:
        out.append(f'<p class="bad"><b>Warning:</b> {html.escape(collapse_message(summary["collapse"]))}.</p>')
    out.append(
        "<h2>Accuracy matrix</h2>"
        + accuracy_matrix_table(R, summary, labels)
        + accuracy_matrix_figure(R[:, :J], starts[:J], labels)
    )
    out.append("<h2>Forgetting and transfer</h2>" + continual_tables(summary))
    buf = io.BytesIO()
    plot_tasks(tasks, starts[:J], buf)
    png = base64.b64encode(buf.getvalue()).decode("ascii")
    out.append(
        "<h2>Accuracy per task over simulated time</h2>"
        + _figure(png, "accuracy per task", "Test accuracy on every task over simulated time; dashed: a task arrives.")
    )
    return out


def _idle_warning(clients: pd.DataFrame) -> str:
    """A warning naming each device that trained nothing in most of its client-rounds ('' if none did)."""
    from ..results import idle

    nothing = idle.by_device(clients)
    named = [f"{d} in {idle.percent(nothing.share[d])}" for d in idle.flagged(nothing)]
    if not named:
        return ""
    return (
        f'<p class="bad"><b>Trained nothing</b> in most of its client-rounds: {html.escape(", ".join(named))}; '
        "the figures are the rest of the fleet's (why: under Per device).</p>"
    )


def _run_band(rounds: pd.DataFrame, column: str, unit: str) -> str:
    """`` (± x unit, the emulation's one-sigma band)``: the rounds' bands summed ('' before the band columns)."""
    if column not in rounds:
        return ""
    return f" (± {rounds[column].sum():.3g} {unit}, the emulation's one-sigma band)"


def run_sections(run_dir: Path) -> tuple[str, list[str]]:
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    clients = pd.read_parquet(run_dir / "clients.parquet")
    status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
    state = status.get("status", "unknown")
    last = rounds.iloc[-1]
    evaluated = rounds[rounds[RoundCol.TEST_ACCURACY].notna()]
    accuracy = evaluated[RoundCol.TEST_ACCURACY].iloc[-1] if len(evaluated) else float("nan")
    head = (
        f'<p>Status <b class="{"" if state == "completed" else "bad"}">{html.escape(state)}</b>'
        + (f": {html.escape(str(status['error']))}" if status.get("error") else "")
        + f". {int(last[RoundCol.ROUND])} rounds, final test accuracy <b>{accuracy:.3f}</b> after "
        f"{last[RoundCol.SIM_TIME_S]:.1f} s of simulated time{_run_band(rounds, RoundCol.ROUND_TIME_BAND_S, 's')} "
        f"and {last[RoundCol.TOTAL_ENERGY_J]:.1f} J{_run_band(rounds, RoundCol.ROUND_ENERGY_BAND_J, 'J')}; "
        f"{clients[ClientCol.PARTITION_ID].nunique()} clients on {clients[ClientCol.DEVICE].nunique()} device types.</p>"
        + _idle_warning(clients)
    )
    sections = [
        "<h2>Accuracy against simulated time</h2>" + accuracy_figure(rounds),
        *(continual_sections(run_dir) if (run_dir / "tasks.parquet").exists() else []),
        "<h2>Energy per device class</h2>" + energy_figure(clients),
        "<h2>Memory against each device's budget</h2>" + memory_figure(clients),
        "<h2>What was trained, per client and round</h2>" + selection_heatmap(clients),
        "<h2>Per device</h2>" + device_table(clients),
    ]
    if (run_dir / "config.toml").exists():
        config = html.escape((run_dir / "config.toml").read_text())
        sections.append(f"<h2>Scenario</h2><details><summary>config.toml</summary><pre>{config}</pre></details>")
    return head, sections


# ---- a comparison ------------------------------------------------------------------------------


def pareto_front(cost: np.ndarray, gain: np.ndarray) -> np.ndarray:
    """Mask of the points no other point beats: as cheap or cheaper and as good or better, one strictly."""
    cost, gain = np.asarray(cost, float), np.asarray(gain, float)
    front = np.ones(len(cost), bool)
    for i in range(len(cost)):
        no_worse = (cost <= cost[i]) & (gain >= gain[i])
        better = (cost < cost[i]) | (gain > gain[i])
        front[i] = not np.any(no_worse & better)
    return front


def _errors(table: pd.DataFrame, stem: str) -> tuple[np.ndarray, np.ndarray]:
    """Means and (2, n) error bars of ``stem``: the interval clipped at its physical bounds, 0 where there is none."""
    from .comparison import interval

    mean, ci = table[f"{stem}_mean"].to_numpy(float), table[f"{stem}_ci95"].to_numpy(float)
    bounds = np.array([interval(m, c, stem) for m, c in zip(mean, ci)], float).reshape(-1, 2)
    low = table[f"{stem}_low"].to_numpy(float) if f"{stem}_low" in table else bounds[:, 0]
    high = table[f"{stem}_high"].to_numpy(float) if f"{stem}_high" in table else bounds[:, 1]
    return mean, np.nan_to_num(np.vstack([mean - low, high - mean]))


def pareto_figure(table: pd.DataFrame) -> str:
    """Final accuracy against simulated time and against energy, mean and 95% interval over the
    seeds that completed; intervals clipped at 0 (and accuracy at 1), so no axis goes negative."""
    plt = _plt()
    table = table[np.isfinite(table.final_accuracy_mean.to_numpy(float))]  # a cell with no completed seed: no point
    fleets = list(dict.fromkeys(table.fleet))
    strategies = list(dict.fromkeys(table.strategy))
    colors = dict(zip(strategies, plt.get_cmap("tab10").colors))
    axes_of = (("sim_time_s", "simulated time (s)"), ("energy_j", "energy (J)"))
    fig, axes = plt.subplots(max(len(fleets), 1), 2, figsize=(10, 3.8 * max(len(fleets), 1)), squeeze=False)
    for row, fleet in zip(axes, fleets):
        t = table[table.fleet == fleet]
        y, yerr = _errors(t, "final_accuracy")
        for ax, (metric, label) in zip(row, axes_of):
            x, xerr = _errors(t, metric)
            for i, s in enumerate(t.strategy):
                ax.errorbar(x[i], y[i], xerr=xerr[:, i : i + 1], yerr=yerr[:, i : i + 1], fmt="o", color=colors[s],
                            capsize=3, label=s)  # fmt: skip
            front = pareto_front(x, y)
            order = np.argsort(x[front])
            ax.step(x[front][order], y[front][order], where="post", color="grey", lw=1, ls="--", label="Pareto front")
            ax.set(xlabel=f"{label}, mean over seeds", ylabel="final test accuracy", title=f"fleet {fleet}")
            ax.set_xlim(left=0)  # time and energy are never negative
            low, high = ax.get_ylim()
            ax.set_ylim(max(low, 0.0), min(high, 1.0))  # an interval past [0, 1] says nothing more
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        fig.legend(
            unique.values(),
            unique.keys(),
            loc="upper center",
            ncol=min(len(unique), 5),
            fontsize=8,
            bbox_to_anchor=(0.5, 1.02),
        )
    fig.tight_layout()
    return _figure(
        _png(fig),
        "Pareto plot of accuracy against time and energy",
        "Each point: one strategy's mean over the seeds that completed, bars: 95% interval, clipped at 0 and "
        "at accuracy 1 (none with a single seed). Dashed: the Pareto front of the means (no other strategy "
        "is both cheaper and more accurate).",
    )


def comparison_table(table: pd.DataFrame) -> str:
    from .comparison import interval, interval_text, with_band

    shown = {
        "final_accuracy": "{:.3f}", "sim_time_s": "{:.3g}", "energy_j": "{:.3g}", "time_to_target_s": "{:.3g}",
        "fits_fraction": "{:.0%}", "fraction_params_trained": "{:.0%}",
    }  # fmt: skip
    out = table[["fleet", "strategy"]].copy()
    out["seeds used"] = table["used"] if "used" in table else table.seeds.map(lambda n: f"{n}/{n}")
    for key in ("failed", "diverged", "with_errors", "lr", "bn_mode"):
        if key in table:
            out[key.replace("_", " ")] = table[key].fillna("")
    if "reached_target" in table:
        out["reached target"] = table.reached_target
    for stem, fmt in shown.items():
        if f"{stem}_mean" in table:
            bound = table.get(f"{stem}_is_lower_bound", pd.Series(False, index=table.index)).fillna(False)
            mean, ci = table[f"{stem}_mean"].to_numpy(float), table[f"{stem}_ci95"].to_numpy(float)
            clipped = [interval(m, c, stem) for m, c in zip(mean, ci)]
            low = table[f"{stem}_low"] if f"{stem}_low" in table else [lo for lo, _ in clipped]
            high = table[f"{stem}_high"] if f"{stem}_high" in table else [hi for _, hi in clipped]
            out[stem] = with_band(
                table,
                stem,
                [
                    ("≥ " if b else "") + interval_text(m, c, lo, hi, fmt)
                    for m, c, lo, hi, b in zip(mean, ci, low, high, bound.astype(bool))
                ],
            )
    if "trained_nothing" in table:  # per device, over every seed; flagged above half (fedelastic.results.idle)
        from ..results.idle import text

        out["trained nothing"] = text(table.trained_nothing)
        out["idle devices"] = text(table.idle_devices)
    return out.to_html(index=False, border=0)


def _not_completed(folder: Path) -> str:
    """The seeds that are in no mean, with their status and why ('' if every seed completed)."""
    from .comparison import not_used

    lines = not_used(folder) if (folder / "summary.csv").exists() else []
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return f'<h2 class="bad">Seeds left out of the means</h2><ul>{items}</ul>'


def _tuning(folder: Path) -> str:
    """The tuning grid's validation scores per fleet and strategy, the chosen point marked."""
    if not (folder / "tuning.csv").exists():
        return ""
    t = pd.read_csv(folder / "tuning.csv")
    shown = t[["fleet", "strategy", "lr", "bn_mode", "status", "val_accuracy", "val_loss"]].copy()
    shown["val_accuracy"] = shown.val_accuracy.map("{:.3f}".format)
    shown["val_loss"] = shown.val_loss.map("{:.3g}".format)
    shown["chosen"] = t.chosen.map({True: "✓", False: ""}).fillna("")
    if "added" in t:
        shown["added by widening"] = t.added.map({True: "✓", False: ""}).fillna("")
    from .comparison import edge_warnings

    warnings = "".join(f'<p class="bad">{html.escape(line)}</p>' for line in edge_warnings(folder))
    from .comparison import untuned_cells

    untuned = "".join(
        f'<p class="bad">No tuning run of {html.escape(f)} / {html.escape(s)} completed: its seeds ran with the '
        "scenario's own lr and bn_mode, which no validation score chose.</p>"
        for f, s in sorted(untuned_cells(folder))
    )
    return (
        "<h2>Tuning</h2><p>Each strategy's learning rate (and BatchNorm mode) was chosen per fleet by its final "
        "accuracy on a validation split held out from the clients' training data (never the test set); ties go "
        "to the lower validation loss, then the smaller learning rate. Only completed tuning runs with a finite validation loss count.</p>"
        + warnings
        + untuned
        + shown.to_html(index=False, border=0)
    )


def _statistics(folder: Path) -> str:
    """Final accuracy per seed, and the paired differences between strategies ('' without them)."""
    from .comparison import differences_table, seed_table

    if not (folder / "summary.csv").exists():
        return ""
    out = "<h2>Final accuracy per seed</h2>" + seed_table(folder).to_html(index=False, border=0)
    if (folder / "differences.csv").exists():
        frame, legend = differences_table(folder)
        notes = "".join(f"<p>{html.escape(line)}</p>" for line in legend)
        out += "<h2>Differences between strategies</h2>" + notes + frame.to_html(index=False, border=0)
    return out


def comparison_sections(folder: Path) -> tuple[str, list[str]]:
    from .comparison import plot

    table = pd.read_csv(folder / "summary_by_strategy.csv")
    used = table["used"] if "used" in table else table.seeds.map(lambda n: f"{n}/{n}")
    complete = all(u.split("/")[0] == u.split("/")[1] for u in used.astype(str))
    head = (
        f"<p>{table.strategy.nunique()} strategies on {table.fleet.nunique()} fleets, "
        f"{int(table.seeds.max())} seed(s) each. Cells: mean ± 95% interval over the seeds that completed "
        "([low, high] where the interval was clipped at a physical bound: 0, or accuracy 1); ≥: a lower bound "
        "(seeds that never reached the target enter at their end-of-run time).</p>"
        + (
            ""
            if complete
            else '<p class="bad">Not every seed completed: the failed and diverged seeds are in no mean '
            "(see “seeds used” and the list below).</p>"
        )
    )
    from ..results.idle import verdicts

    head += "".join(f'<p class="bad"><b>Idle devices.</b> {html.escape(line)}.</p>' for line in verdicts(table))
    sections = ["<h2>Accuracy against time and energy</h2>" + pareto_figure(table)]
    if (folder / "runs.csv").exists():
        buf = io.BytesIO()
        plot(pd.read_csv(folder / "runs.csv"), buf)  # type: ignore[arg-type]
        png = base64.b64encode(buf.getvalue()).decode("ascii")
        sections.append(
            "<h2>Accuracy over simulated time</h2>"
            + _figure(
                png,
                "mean accuracy curves",
                "Mean accuracy over the seeds that completed against mean simulated time; band: 95% interval.",
            )
        )
    sections.append("<h2>Summary</h2>" + comparison_table(table))
    sections += [s for s in (_statistics(folder), _not_completed(folder), _tuning(folder)) if s]
    return head, sections


def write_html(folder: str | Path, out: str | Path | None = None) -> Path:
    """Write ``report.html`` (or ``out``) for a run folder or a comparison folder; returns its path."""
    folder = Path(folder)
    if (folder / "summary_by_strategy.csv").exists():
        head, sections = comparison_sections(folder)
        title = f"fedelastic comparison: {folder.parent.name}/{folder.name}"
    elif (folder / "rounds.parquet").exists():
        head, sections = run_sections(folder)
        title = f"fedelastic run: {folder.parent.name}/{folder.name}"
    else:
        from ..errors import ConfigError

        raise ConfigError(
            folder, "<folder>", "a run folder (rounds.parquet) or a comparison folder (summary_by_strategy.csv)"
        )
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head>\n<body><h1>{html.escape(title)}</h1>{head}\n"
        + "\n".join(sections)
        + "\n</body></html>\n"
    )
    path = Path(out) if out else folder / "report.html"
    path.write_text(page, encoding="utf-8")
    return path
