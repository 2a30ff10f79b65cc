"""The figures: a run folder's at its end (accuracy against simulated time, train time per device
class, the first rounds' timeline of client trips) and a comparison's (mean accuracy over seeds
with a 95% band). matplotlib and seaborn are imported when a figure is drawn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from ..sim.columns import RoundCol as R
from .seedstats import curves


def plot_accuracy(rounds: pd.DataFrame, clients: pd.DataFrame, path: Path) -> None:
    """Accuracy against simulated time, and per device class the emulated train time per round.

    Draws what it can from any run: no rounds, no client rows, or NaN/inf/zero times leave an
    empty (labelled) panel rather than an error.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    import seaborn as sns

    timeline = "dispatch_s" in clients.columns and clients.dispatch_s.notna().any()
    fig, axes = plt.subplots(1, 3 if timeline else 2, figsize=(17 if timeline else 11, 4))
    finite = lambda col: np.isfinite(rounds.get(col, pd.Series(dtype=float)).astype(float))  # noqa: E731
    # NaN accuracy: a round that server.evaluate_every skipped
    curve = rounds[finite("sim_time_s") & finite("test_accuracy")] if len(rounds) else rounds
    if len(curve):
        sns.lineplot(data=curve, x="sim_time_s", y="test_accuracy", marker="o", ax=axes[0])
    acc = curve["test_accuracy"].astype(float) if len(curve) else pd.Series(dtype=float)
    acc = acc[np.isfinite(acc)]
    span = f" (range {acc.min():.4f} to {acc.max():.4f})" if len(acc) else ""
    empty = rounds[empty_rounds(rounds)] if len(rounds) else rounds
    if len(empty):  # no time passes in them: their points would hide under the round before
        y = empty["test_accuracy"].astype(float).where(lambda a: np.isfinite(a), 0.0)
        axes[0].scatter(empty["sim_time_s"], y, marker="x", s=60, color="red", zorder=3,
                        label=f"no client trained ({len(empty)} round{'s' if len(empty) > 1 else ''})")  # fmt: skip
        axes[0].legend(loc="lower right")
    axes[0].set(xlabel="simulated time (s)", ylabel="global test accuracy", title=f"accuracy vs simulated time{span}")
    axes[0].set_ylim(0.0, 1.02)  # from 0: a flat line near chance must not look like a collapse
    times = clients.get("emulated_train_time_s", pd.Series(dtype=float)).astype(float) if len(clients) else None
    ok = clients[np.isfinite(times) & (times > 0)] if times is not None else clients
    if len(ok):
        hue_order = sorted(ok.device_class.unique())  # the timeline colours classes in this order
        sns.barplot(data=ok, x="device", y="emulated_train_time_s", hue="device_class", hue_order=hue_order, ax=axes[1])
        axes[1].tick_params(axis="x", rotation=30)
        axes[1].set_yscale("log")
    else:
        axes[1].text(0.5, 0.5, "no client trained", ha="center", va="center", transform=axes[1].transAxes)
    axes[1].set(xlabel="", ylabel="emulated train time per round (s)", title="per-device train time")
    if timeline:
        plot_timeline(rounds, clients, axes[2])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def empty_rounds(rounds: pd.DataFrame) -> pd.Series:
    """Per row of a rounds table: a round (not round 0) in which no client trained, as the run's
    status counts them (``empty_rounds``: every client failed, did not fit, trained nothing or was rejected)."""
    n = lambda col: rounds.get(col, pd.Series(0, index=rounds.index)).fillna(0)  # noqa: E731
    trained = n(R.CLIENTS) - n(R.CLIENTS_FAILED) - n(R.CLIENTS_NOT_FITTING) - n(R.CLIENTS_NO_STEPS) - n(R.CLIENTS_REJECTED)
    return (rounds[R.ROUND] > 0) & (trained <= 0) & (R.CLIENTS in rounds)


def plot_timeline(rounds: pd.DataFrame, clients: pd.DataFrame, ax, first_rounds: int = 3) -> None:
    """A Gantt chart of the simulated clock over the first rounds: one line per client.

    Each trip shows its download (light), local training (dark) and upload (light); trips whose
    update did not count are hatched. Dotted lines mark the aggregations.
    """
    from matplotlib.patches import Patch

    end = float(rounds.loc[rounds["round"] <= first_rounds, "sim_time_s"].max())
    shown = clients[clients.dispatch_s.notna() & (clients.dispatch_s < end)]
    ids = sorted(shown.partition_id.unique())
    colors = {c: f"C{i}" for i, c in enumerate(sorted(shown.device_class.unique()))}
    for _, r in shown.iterrows():
        y = ids.index(r.partition_id)
        stop = r.arrival_s if r.arrival_s == r.arrival_s else r.finish_s  # NaN arrival: it went offline
        hatch = None if r.counted else "///"
        phases = ((r.dispatch_s, r.start_s, 0.35), (r.start_s, r.finish_s, 0.9), (r.finish_s, stop, 0.35))
        for a, b, alpha in phases:
            if b > a:
                ax.barh(y, b - a, left=a, height=0.7, color=colors[r.device_class], alpha=alpha, hatch=hatch)
    for t in rounds.loc[(rounds["round"] > 0) & (rounds.sim_time_s <= end), "sim_time_s"]:
        ax.axvline(t, color="k", linestyle=":", linewidth=0.8)
    labels = dict(zip(shown.partition_id, shown.device))
    ax.set_yticks(range(len(ids)), [f"{p} {labels[p]}" for p in ids], fontsize=7)
    ax.set(xlabel="simulated time (s)", title=f"timeline of the first {first_rounds} aggregations")
    handles = [Patch(color=c, label=k) for k, c in colors.items()] + [
        Patch(fill=False, hatch="///", label="not counted")
    ]
    ax.legend(handles=handles, fontsize=7, loc="lower right")


def plot_comparison(runs: pd.DataFrame, path: Path, target: float = 0.0) -> None:
    """Mean accuracy over seeds against mean simulated time, a 95% band, one panel per fleet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    data = curves(runs) if len(runs) else pd.DataFrame(columns=["fleet", "strategy", "sim_time_s", "accuracy"])
    if not len(data):  # no seed completed: a figure that says so
        fig, ax = plt.subplots(figsize=(4.6, 3.8))
        ax.text(0.5, 0.5, "no run completed", ha="center", va="center")
        ax.set_axis_off()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    fleets = list(dict.fromkeys(data.fleet))
    palette = dict(zip(dict.fromkeys(data.strategy), sns.color_palette(n_colors=data.strategy.nunique())))
    fig, axes = plt.subplots(1, len(fleets), figsize=(4.6 * len(fleets), 3.8), squeeze=False)
    for ax, fleet in zip(axes[0], fleets):
        for strategy, g in data[data.fleet == fleet].groupby("strategy", sort=False):
            ax.plot(g.sim_time_s, g.accuracy, marker="o", ms=3, color=palette[strategy], label=strategy)
            band = g.accuracy_ci95.fillna(0.0)
            low, high = np.clip(g.accuracy - band, 0, 1), np.clip(g.accuracy + band, 0, 1)  # accuracy is in [0, 1]
            ax.fill_between(g.sim_time_s, low, high, color=palette[strategy], alpha=0.2)
        if target:
            ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
        ax.set(title=f"fleet {fleet}", xlabel="simulated time (s), mean over seeds", ylabel="global test accuracy")
        ax.set_ylim(0, 1)
        ax.set_xlim(left=0)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
