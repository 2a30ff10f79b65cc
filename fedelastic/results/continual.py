"""A run's continual-learning figures evaluated and written: the accuracy matrix evaluated on the
stream's tasks (torch), ``continual.json`` and ``tasks_vs_time.png`` (:func:`report`). The metrics
themselves are pure: :mod:`fedelastic.results.continual_metrics`.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import numpy as np

from .continual_metrics import analyse, collapse_message, top_share

if TYPE_CHECKING:
    from ..data.stream import Stream


class StreamSource(Protocol):
    """What continual evaluation reads of a run's environment (:class:`fedelastic.environment.RunEnvironment`)."""

    @property
    def stream(self) -> Stream | None: ...


_warned: set[str] = set()  # the collapse warnings given in this process


def evaluate_tasks(env: StreamSource, model, server_round: int, sim_time_s: float) -> tuple[list[dict], float, float]:
    """Rows of the accuracy matrix for ``server_round``, and (accuracy, loss) averaged over seen tasks (see
    :func:`evaluate_stream`)."""
    rows, accuracy, loss, _, _ = evaluate_stream(env, model, server_round, sim_time_s)
    return rows, accuracy, loss


def evaluate_stream(
    env: StreamSource, model, server_round: int, sim_time_s: float
) -> tuple[list[dict], float, float, np.ndarray | None, np.ndarray | None]:
    """Rows of the accuracy matrix for ``server_round``, (accuracy, loss) averaged over seen tasks, and the
    counts per class of the predictions and of the labels pooled over the seen tasks' test data (the
    divergence detector's collapse check).

    Each row also has the task's labels, its most predicted class and that class's share, and, the
    same on every row of the round, those of the predictions pooled over the seen tasks with the
    number of classes their test data has (for :func:`collapse`).
    """
    stream = env.stream
    if stream is None:
        raise ValueError("not a continual run: the scenario has no [stream]")
    current = max((j for j, s in enumerate(stream.segments) if s.start <= max(server_round, 1)), default=0)
    rows, seen_acc, seen_loss = [], [], []
    seen_counts: np.ndarray | None = None
    seen_actual: np.ndarray | None = None
    seen_labels: set[int] = set()
    from ..train.evaluation import evaluate_predictions  # noqa: PLC0415 (the metrics stay importable without torch)

    for j, (seg, ds) in enumerate(zip(stream.segments, stream.eval_sets)):
        accuracy, loss, counts = evaluate_predictions(model, ds.x, ds.y)
        seen = seg.start <= max(server_round, 1)
        top, share = top_share(counts)
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
                "classes": ",".join(map(str, seg.classes)),
                "predicted_class": top,
                "predicted_share": share,
            }
        )
        if seen:
            seen_acc.append(accuracy)
            seen_loss.append(loss)
            seen_counts = counts if seen_counts is None else seen_counts + counts
            seen_labels.update(int(c) for c in np.unique(ds.y))
            labels = np.bincount(ds.y, minlength=len(counts))
            seen_actual = labels if seen_actual is None else seen_actual + labels
    top, share = top_share(seen_counts) if seen_counts is not None else (-1, float("nan"))
    for row in rows:
        row.update(seen_predicted_class=top, seen_predicted_share=share, seen_classes=len(seen_labels))
    return rows, float(np.mean(seen_acc)), float(np.mean(seen_loss)), seen_counts, seen_actual


def load(run_dir: Path, recover_share: float | None = None) -> tuple[Any, dict]:
    """(the ``tasks`` table, :func:`analyse`'s summary) of a run folder; the share defaults to the run's config."""
    import pandas as pd

    tasks = pd.read_parquet(run_dir / "tasks.parquet")
    if recover_share is None:
        recover_share = _recover_share(run_dir)
    return tasks, analyse(tasks, recover_share)


def report(run_dir: str | Path, recover_share: float | None = None) -> dict:
    """Write ``continual.json`` and ``tasks_vs_time.png`` from ``tasks.parquet`` (finished or partial run).

    A collapse (see :func:`collapse`) is warned about once per process (a ``UserWarning``).
    """
    run_dir = Path(run_dir)
    tasks, summary = load(run_dir, recover_share)
    (run_dir / "continual.json").write_text(json.dumps(_clean(summary), indent=2))
    plot_tasks(tasks, [t["start_round"] for t in summary["per_task"]], run_dir / "tasks_vs_time.png")
    message = f"{run_dir}: {collapse_message(summary['collapse'])}" if summary["collapse"] is not None else ""
    if message and message not in _warned:  # the run's end and the command's report both call this
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=2)
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


def plot_tasks(tasks, starts: list[int], path: Path | IO[bytes]) -> None:
    """Accuracy on every task over simulated time, with each task's arrival marked (a PNG at ``path``)."""
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
