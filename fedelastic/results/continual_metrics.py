"""Continual-learning figures of a run: the accuracy matrix, its summaries, and the report.

``R[t, j]`` is the accuracy after round ``t`` (row 0: the initial model) on evaluation task ``j``
(see :mod:`fedelastic.data.stream`). Task ``j`` arrives at round ``start[j]`` and is trained
until ``end[j] = start[j + 1] - 1`` (the last task until the last round). With ``J`` tasks and
``T`` the last round:

* final accuracy: ``mean_j R[T, j]``;
* average (incremental) accuracy: ``1/J sum_k mean_{j <= k} R[end[k], j]`` (Rebuffi et al. 2017);
* backward transfer: ``1/(J-1) sum_{j < J-1} R[T, j] - R[end[j], j]`` (Lopez-Paz & Ranzato 2017);
* forgetting of task ``j < J-1``: ``max_{l in j..J-2} R[end[l], j] - R[T, j]``, the best accuracy it
  had at the end of a task since it was learned minus its final accuracy; the mean over
  ``j < J-1`` (Chaudhry et al. 2018). The last task has none: it is still being trained;
* forward transfer of task ``j >= 1``: ``R[start[j] - 1, j] - R[0, j]``, the accuracy on task ``j``
  just before it arrives minus that of the initial model (Lopez-Paz & Ranzato 2017, GEM, with
  ``R[0]`` for their random-initialisation accuracy; Avalanche's ``ExperienceForwardTransfer``:
  the accuracy after the previous experience minus the accuracy at initialisation), and their mean.
  It is **n/a** for a task with a class that no earlier task had, the class-incremental case: the
  head has never been trained to output that class, so the accuracy before arrival is about 0 by
  construction, whatever the features learned, and the difference measures the untrained head;
* time to recover, per shift ``j >= 1``: the target is ``share * R[start[j] - 1, j - 1]`` (the
  accuracy on the task just before the shift); the first round ``t >= start[j]`` (after the shift,
  never before) with ``R[t, j] >= target`` is the recovery, and the time is the simulated time from
  the end of round ``start[j] - 1`` to the end of round ``t``. A target of 0 or undefined (a
  pre-shift accuracy of 0 or missing) is **n/a**: every accuracy would reach it;
* collapse: the rounds ``t >= 1`` after which the most predicted class takes more than
  ``COLLAPSE_SHARE`` of the predictions on the test data of the seen tasks, when those have at
  least ``COLLAPSE_MIN_CLASSES`` classes. The initial model (round 0) is not the run's doing and is
  not checked.

These functions are pure numpy (the ``tasks`` table: pandas); evaluating the tasks (torch) and writing
``continual.json`` and the figure (files) are :mod:`fedelastic.results.continual`.

"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: A round collapsed when one class takes more than this share of the predictions ...
COLLAPSE_SHARE = 0.9
#: ... on test data of at least this many classes.
COLLAPSE_MIN_CLASSES = 3


def task_ends(starts: list[int], last_round: int) -> list[int]:
    return [s - 1 for s in starts[1:]] + [last_round]


def forgetting_per_task(R: np.ndarray, ends: list[int]) -> list[float]:
    """Per task ``j``: ``max_{l in j..J-2} R[end[l], j] - R[T, j]`` (Chaudhry et al. 2018); NaN for the last."""
    T, J = R.shape[0] - 1, len(ends)
    return [float(max(R[ends[lo], j] for lo in range(j, J - 1)) - R[T, j]) for j in range(J - 1)] + [float("nan")]


def forward_transfer_per_task(
    R: np.ndarray, starts: list[int], classes: list[tuple[int, ...]] | None = None
) -> list[tuple[float, str]]:
    """Per task: (``R[start[j] - 1, j] - R[0, j]``, "") or (NaN, why it is n/a); see the module docstring.

    ``classes``: each task's labels; without them every task ``j >= 1`` gets the difference.
    """
    out: list[tuple[float, str]] = [(float("nan"), "n/a: the first task has no task before it")]
    for j in range(1, len(starts)):
        earlier = set().union(*classes[:j]) if classes is not None else set()
        new = sorted(set(classes[j]) - earlier) if classes is not None else []
        if new:
            out.append(
                (
                    float("nan"),
                    f"n/a: class-incremental, {_plural(new, 'class', 'classes')} {','.join(map(str, new))} "
                    f"{_plural(new, 'was', 'were')} in no earlier task, so the head was never trained to predict "
                    f"{_plural(new, 'it', 'them')} before the task arrived",
                )
            )
        else:
            out.append((float(R[starts[j] - 1, j] - R[0, j]), ""))
    return out


def _plural(items: list, one: str, many: str) -> str:
    return one if len(items) == 1 else many


def recovery(R: np.ndarray, starts: list[int], sim_time_s: np.ndarray, j: int, share: float) -> dict:
    """The time-to-recover entry of the shift to task ``j >= 1`` (see the module docstring)."""
    T = R.shape[0] - 1
    shift, before = starts[j], starts[j] - 1
    pre = float(R[before, j - 1])
    target = share * pre
    entry: dict[str, Any] = {
        "task": j,
        "shift_round": shift,
        "pre_shift_round": before,
        "pre_shift_accuracy": pre,
        "accuracy_after_shift": float(R[shift, j]),
        "target_accuracy": target if pre > 0 else float("nan"),
        "recovered_round": float("nan"),
        "rounds_to_recover": float("nan"),
        "time_to_recover_s": float("nan"),
    }
    if not pre > 0:  # 0 or NaN: no target that a recovery could mean anything against
        entry["recovery"] = f"n/a: the accuracy on task {j - 1} before the shift (round {before}) " + (
            "is unknown, so there is no target" if math.isnan(pre) else "is 0, so any accuracy would meet the target"
        )
        return entry
    hit = [t for t in range(shift, T + 1) if R[t, j] >= target]
    if not hit:
        entry["recovery"] = f"not recovered by round {T}"
        return entry
    t = hit[0]
    entry.update(
        recovered_round=t,
        rounds_to_recover=t - before,
        time_to_recover_s=float(sim_time_s[t] - sim_time_s[before]),
        recovery=f"recovered in round {t}",
    )
    return entry


def summarise(
    R: np.ndarray,
    starts: list[int],
    sim_time_s: np.ndarray,
    recover_share: float,
    classes: list[tuple[int, ...]] | None = None,
) -> dict:
    """The summaries above from ``R`` (rounds 0..T x tasks), the simulated clock per row and each task's labels."""
    T, J = R.shape[0] - 1, R.shape[1]
    starts = [s for s in starts if s <= T]
    J = min(J, len(starts))
    R = R[:, :J]
    classes = classes[:J] if classes is not None else None
    ends = task_ends(starts, T)
    out: dict = {
        "tasks": J,
        "final_accuracy": float(R[T].mean()),
        "average_accuracy": float(np.mean([R[ends[k], : k + 1].mean() for k in range(J)])),
    }
    forgetting = forgetting_per_task(R, ends)
    transfer = forward_transfer_per_task(R, starts, classes)
    defined = [f for f, _ in transfer[1:] if not math.isnan(f)]
    if J > 1:
        out["backward_transfer"] = float(np.mean([R[T, j] - R[ends[j], j] for j in range(J - 1)]))
        out["forgetting"] = float(np.mean(forgetting[:-1]))
        out["forward_transfer"] = float(np.mean(defined)) if defined else float("nan")
        left_out = [j for j, (f, _) in enumerate(transfer) if j > 0 and math.isnan(f)]
        if left_out:
            out["forward_transfer_note"] = (
                ("n/a" if not defined else f"mean over tasks {[j for j in range(1, J) if j not in left_out]}")
                + f": tasks {left_out} have classes that no earlier task had (class-incremental), and before "
                "arrival a head never trained on a class cannot predict it"
            )
    else:
        out["backward_transfer"] = out["forgetting"] = out["forward_transfer"] = float("nan")
    shifts = [recovery(R, starts, sim_time_s, j, recover_share) for j in range(1, J)]
    out["shifts"] = shifts
    out["per_task"] = [
        {
            "task": j,
            "start_round": starts[j],
            "end_round": ends[j],
            "accuracy_at_end": float(R[ends[j], j]),
            "final_accuracy": float(R[T, j]),
            "forgetting": forgetting[j],
            "forward_transfer": transfer[j][0],
            **({"forward_transfer_note": transfer[j][1]} if transfer[j][1] else {}),
            "time_to_recover_s": shifts[j - 1]["time_to_recover_s"] if j else float("nan"),
            "recovery": shifts[j - 1]["recovery"] if j else "n/a: the first task follows no shift",
        }
        for j in range(J)
    ]
    return out


def top_share(counts: np.ndarray) -> tuple[int, float]:
    """(the most predicted class, its share of the predictions) from a histogram of predicted classes."""
    counts = np.asarray(counts)
    total = counts.sum()
    top = int(np.argmax(counts))
    return top, float(counts[top] / total) if total else float("nan")


def collapse(
    rounds: np.ndarray,
    top_class: np.ndarray,
    share: np.ndarray,
    classes_seen: np.ndarray,
    threshold: float = COLLAPSE_SHARE,
    min_classes: int = COLLAPSE_MIN_CLASSES,
) -> dict | None:
    """The rounds ``>= 1`` whose predictions collapsed to one class (see the module docstring), or None.

    Per evaluated round: the most predicted class on the seen tasks' test data, its share, and
    how many classes that data has.
    """
    rounds, share = np.asarray(rounds), np.asarray(share, float)
    hit = (rounds >= 1) & (share > threshold) & (np.asarray(classes_seen) >= min_classes)
    if not hit.any():
        return None
    return {
        "rounds": [int(r) for r in rounds[hit]],
        "predicted_class": [int(c) for c in np.asarray(top_class)[hit]],
        "share": [float(s) for s in share[hit]],
        "threshold": threshold,
        "min_classes": min_classes,
    }


def collapse_message(entry: dict) -> str:
    first, n = entry["rounds"][0], len(entry["rounds"])
    return (
        f"predictions collapsed to one class in {n} round(s), first in round {first}: class "
        f"{entry['predicted_class'][0]} took {entry['share'][0]:.0%} of the predictions on the seen tasks "
        f"(threshold {entry['threshold']:.0%}); the continual figures describe a model that predicts one class"
    )


def matrix(tasks) -> tuple[np.ndarray, list[int], np.ndarray]:
    """(R, task start rounds, simulated clock per round) from a ``tasks`` table (a DataFrame)."""
    R = tasks.pivot(index="round", columns="task", values="accuracy").sort_index()
    starts = tasks.groupby("task").start_round.first().sort_index().tolist()
    clock = tasks.groupby("round").sim_time_s.first().sort_index().to_numpy()
    return R.to_numpy(), starts, clock


def task_classes(tasks) -> list[tuple[int, ...]] | None:
    """Each task's labels from a ``tasks`` table (None for a table written before they were recorded)."""
    if "classes" not in tasks:
        return None
    first = tasks.groupby("task").classes.first().sort_index()
    return [tuple(int(c) for c in str(s).split(",") if c != "") for s in first]


def collapse_of(tasks) -> dict | None:
    """:func:`collapse` over the rounds of a ``tasks`` table (None if it has no predictions recorded)."""
    if "seen_predicted_share" not in tasks:
        return None
    per_round = tasks.groupby("round")[["seen_predicted_class", "seen_predicted_share", "seen_classes"]].first()
    return collapse(
        per_round.index.to_numpy(),
        per_round.seen_predicted_class.to_numpy(),
        per_round.seen_predicted_share.to_numpy(),
        per_round.seen_classes.to_numpy(),
    )


def analyse(tasks, recover_share: float) -> dict:
    """The summary :func:`report` writes, from a ``tasks`` table: :func:`summarise` plus labels and collapse."""
    R, starts, clock = matrix(tasks)
    summary = summarise(R, starts, clock, recover_share, task_classes(tasks))
    labels = tasks.groupby("task").task_label.first().sort_index().tolist()
    for entry in summary["per_task"]:
        entry["label"] = labels[entry["task"]]
    summary["recover_share"] = recover_share
    summary["collapse"] = collapse_of(tasks)
    return summary
