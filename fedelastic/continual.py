"""Continual-learning figures of a run: the accuracy matrix, its summaries, and the report.

``R[t, j]`` is the accuracy after round ``t`` (row 0: the initial model) on evaluation task ``j``
(see :mod:`fedelastic.data.stream`). Task ``j`` arrives at round ``start[j]`` and is trained
until ``end[j] = start[j + 1] - 1`` (the last task until the last round). With ``J`` tasks and
``T`` the last round:

* final accuracy: ``mean_j R[T, j]``;
* average (incremental) accuracy: ``1/J sum_k mean_{j <= k} R[end[k], j]`` (Rebuffi et al. 2017);
* backward transfer: ``1/(J-1) sum_{j < J-1} R[T, j] - R[end[j], j]`` (Lopez-Paz & Ranzato 2017);
* forgetting: ``1/(J-1) sum_{j < J-1} max_{l in j..J-2} R[end[l], j] - R[T, j]`` (Chaudhry et al. 2018);
* forward transfer: ``1/(J-1) sum_{j >= 1} R[start[j] - 1, j] - R[0, j]`` (Lopez-Paz & Ranzato 2017);
* time to recover, per shift ``j >= 1``: the simulated time from the end of round ``start[j] - 1``
  until the first round ``t >= start[j] - 1`` with ``R[t, j] >= share * R[start[j] - 1, j - 1]``
  (NaN if never).

The metric functions are pure numpy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def task_ends(starts: list[int], last_round: int) -> list[int]:
    return [s - 1 for s in starts[1:]] + [last_round]


def summarise(R: np.ndarray, starts: list[int], sim_time_s: np.ndarray, recover_share: float) -> dict:
    """The summaries above from ``R`` (rounds 0..T x tasks) and the simulated clock per row."""
    T, J = R.shape[0] - 1, R.shape[1]
    starts = [s for s in starts if s <= T]
    J = min(J, len(starts))
    R = R[:, :J]
    ends = task_ends(starts, T)
    out: dict = {
        "tasks": J,
        "final_accuracy": float(R[T].mean()),
        "average_accuracy": float(np.mean([R[ends[k], : k + 1].mean() for k in range(J)])),
    }
    if J > 1:
        out["backward_transfer"] = float(np.mean([R[T, j] - R[ends[j], j] for j in range(J - 1)]))
        out["forgetting"] = float(
            np.mean([max(R[ends[lo], j] for lo in range(j, J - 1)) - R[T, j] for j in range(J - 1)])
        )
        out["forward_transfer"] = float(np.mean([R[starts[j] - 1, j] - R[0, j] for j in range(1, J)]))
    else:
        out["backward_transfer"] = out["forgetting"] = out["forward_transfer"] = float("nan")
    recoveries = []
    for j in range(1, J):
        before = starts[j] - 1
        target = recover_share * R[before, j - 1]
        hit = [t for t in range(before, T + 1) if R[t, j] >= target]
        t = hit[0] if hit else None
        recoveries.append(
            {
                "task": j,
                "shift_round": starts[j],
                "pre_shift_accuracy": float(R[before, j - 1]),
                "accuracy_after_shift": float(R[starts[j], j]),
                "target_accuracy": float(target),
                "recovered_round": t if t is not None else float("nan"),
                "rounds_to_recover": (t - before) if t is not None else float("nan"),
                "time_to_recover_s": float(sim_time_s[t] - sim_time_s[before]) if t is not None else float("nan"),
            }
        )
    out["shifts"] = recoveries
    return out


def evaluate_tasks(env, model, server_round: int, sim_time_s: float) -> tuple[list[dict], float, float]:
    """Rows of the accuracy matrix for ``server_round``, and (accuracy, loss) averaged over seen tasks."""
    from .fl.server import evaluate_model  # noqa: PLC0415 (avoids importing Flower at module load)

    stream = env.stream
    current = max((j for j, s in enumerate(stream.segments) if s.start <= max(server_round, 1)), default=0)
    rows, seen_acc, seen_loss = [], [], []
    for j, (seg, ds) in enumerate(zip(stream.segments, stream.eval_sets)):
        accuracy, loss = evaluate_model(model, ds.x, ds.y)
        seen = seg.start <= max(server_round, 1)
        rows.append(
            {
                "round": server_round,
                "sim_time_s": sim_time_s,
                "task": j,
                "task_label": seg.label,
                "start_round": seg.start,
                "class_task": seg.task,
                "domain": seg.domain,
                "seen": seen,
                "current": j == current,
                "accuracy": accuracy,
                "loss": loss,
                "samples": len(ds),
            }
        )
        if seen:
            seen_acc.append(accuracy)
            seen_loss.append(loss)
    return rows, float(np.mean(seen_acc)), float(np.mean(seen_loss))


def matrix(tasks) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(R, task start rounds, simulated clock per round) from a ``tasks`` table (a DataFrame)."""
    R = tasks.pivot(index="round", columns="task", values="accuracy").sort_index()
    starts = tasks.groupby("task").start_round.first().sort_index().tolist()
    clock = tasks.groupby("round").sim_time_s.first().sort_index().to_numpy()
    return R.to_numpy(), starts, clock


def report(run_dir: str | Path, recover_share: float | None = None) -> dict:
    """Write ``continual.json`` and ``tasks_vs_time.png`` from ``tasks.parquet`` (finished or partial run)."""
    import pandas as pd

    run_dir = Path(run_dir)
    tasks = pd.read_parquet(run_dir / "tasks.parquet")
    if recover_share is None:
        recover_share = _recover_share(run_dir)
    R, starts, clock = matrix(tasks)
    summary = summarise(R, starts, clock, recover_share)
    summary["recover_share"] = recover_share
    (run_dir / "continual.json").write_text(json.dumps(_clean(summary), indent=2))
    plot_tasks(tasks, starts, run_dir / "tasks_vs_time.png")
    return summary


def _recover_share(run_dir: Path) -> float:
    import tomllib

    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
        return float(cfg.get("stream", {}).get("recover_share", 0.9))
    except (OSError, ValueError):
        return 0.9


def _clean(obj):
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


def plot_tasks(tasks, starts: list[int], path: Path) -> None:
    """Accuracy on every task over simulated time, with each task's arrival marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    fig, ax = plt.subplots(figsize=(9, 4.5))
    sns.lineplot(data=tasks, x="sim_time_s", y="accuracy", hue="task_label", marker=".", ax=ax)
    clock = tasks.groupby("round").sim_time_s.first()
    for j, s in enumerate(starts):
        if j > 0 and s - 1 in clock.index:
            t = clock.loc[s - 1]
            ax.axvline(t, color="grey", linestyle="--", linewidth=1)
            ax.text(t, 0.98, f" shift {j}", fontsize=8, ha="left", va="top", transform=ax.get_xaxis_transform())
    ax.set(
        xlabel="simulated time (s)",
        ylabel="test accuracy",
        ylim=(0, 1),
        title="accuracy per task (dashed: a new task arrives)",
    )
    ax.legend(fontsize=7, title="task", loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
