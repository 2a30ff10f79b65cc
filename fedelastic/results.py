"""Results that reach disk as the run goes, and the end-of-run report.

A run folder holds ``config.toml`` (the resolved scenario), ``versions.json``, ``clients.csv``
and ``clients.parquet`` (one row per client per round), ``rounds.csv`` and ``rounds.parquet``
(one row per round), ``status.json``, and at the end a figure and a summary. CSV rows are
appended and flushed every round; each Parquet file is rewritten atomically every round, so a
killed run leaves every finished round readable.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pandas as pd
import tomli_w

PACKAGES = ("fedelastic", "flwr", "ray", "torch", "numpy", "pandas", "seaborn", "scikit-learn")


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).parent
        )
        out["git"] = sha.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        out["git"] = "unknown"
    return out


class _Table:
    """One table appended row by row to CSV and mirrored to Parquet."""

    def __init__(self, folder: Path, name: str):
        self.csv, self.parquet = folder / f"{name}.csv", folder / f"{name}.parquet"
        self.rows: list[dict] = []
        self.columns: list[str] | None = None

    def append(self, rows: list[dict]) -> None:
        if not rows:
            return
        if self.columns is None:
            self.columns = list(rows[0])
        self.rows.extend(rows)
        new = not self.csv.exists()
        with self.csv.open("a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=self.columns)
            if new:
                writer.writeheader()
            writer.writerows(rows)
            fh.flush()
            os.fsync(fh.fileno())
        tmp = self.parquet.with_suffix(".parquet.tmp")
        pd.DataFrame(self.rows, columns=self.columns).to_parquet(tmp, index=False)
        os.replace(tmp, self.parquet)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=self.columns)


class Recorder:
    """Writes one run's results into ``folder`` as the run goes."""

    def __init__(self, folder: str | Path, config: dict):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=False)
        self.clients = _Table(self.folder, "clients")
        self.rounds = _Table(self.folder, "rounds")
        self.started = time.time()
        (self.folder / "config.toml").write_text(tomli_w.dumps(config))
        (self.folder / "versions.json").write_text(json.dumps(package_versions(), indent=2))
        self.status("running")

    def status(self, state: str, **extra) -> None:
        doc = {"status": state, "rounds_done": len(self.rounds.rows), "elapsed_s": time.time() - self.started, **extra}
        (self.folder / "status.json").write_text(json.dumps(doc, indent=2))

    def add_clients(self, rows: list[dict]) -> None:
        self.clients.append(rows)

    def add_round(self, row: dict) -> None:
        self.rounds.append([row])
        self.status("running")


def plot_accuracy(rounds: pd.DataFrame, clients: pd.DataFrame, path: Path) -> None:
    """Accuracy against simulated time, and per device class the emulated train time per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    timeline = "dispatch_s" in clients.columns and clients.dispatch_s.notna().any()
    fig, axes = plt.subplots(1, 3 if timeline else 2, figsize=(17 if timeline else 11, 4))
    sns.lineplot(data=rounds, x="sim_time_s", y="test_accuracy", marker="o", ax=axes[0])
    axes[0].set(xlabel="simulated time (s)", ylabel="global test accuracy", title="accuracy vs simulated time")
    if not clients.empty:
        hue_order = sorted(clients.device_class.unique())  # the timeline colours classes in this order
        sns.barplot(
            data=clients, x="device", y="emulated_train_time_s", hue="device_class", hue_order=hue_order, ax=axes[1]
        )
        axes[1].set(xlabel="", ylabel="emulated train time per round (s)", title="per-device train time")
        axes[1].tick_params(axis="x", rotation=30)
        axes[1].set_yscale("log")
    if timeline:
        plot_timeline(rounds, clients, axes[2])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
