"""Statistics of a comparison's runs over seeds: one run's headline figures, per (fleet,
strategy) the mean and 95% interval of each over the seeds that completed, and per pair of
strategies their difference paired by seed, tested and Holm-corrected (:func:`differences`).

Only seeds whose run ``completed`` (:data:`USED`) enter a mean or an interval; interval bounds are
clipped at the metric's physical bounds (:func:`bounds`); time and energy to target are censored
at the run's end, never dropped (:func:`aggregate`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from ..sim.columns import ClientCol as C
from ..sim.columns import RoundCol as R


def summarise(rounds: pd.DataFrame, clients: pd.DataFrame, target: float) -> dict:
    """One run's headline figures.

    ``time_to_target_s`` is the simulated time of the first round at or above ``target``; a run
    that never gets there has NaN there and ``reached_target = False`` (censored at its end,
    ``sim_time_s``), never a made-up time. Only evaluated rounds count (``server.evaluate_every``
    skips some: their accuracy is NaN), and ``final_accuracy`` is the last evaluated round's.
    """
    trained = rounds[rounds[R.ROUND] > 0]
    evaluated = rounds[R.TEST_ACCURACY].dropna()
    row = {
        "final_accuracy": float(evaluated.iloc[-1]) if len(evaluated) else float("nan"),
        "sim_time_s": float(rounds[R.SIM_TIME_S].iloc[-1]),
        "energy_j": float(rounds[R.TOTAL_ENERGY_J].iloc[-1]),
        # the emulation's one-sigma bands (rounds' bands add: a profile's error is systematic); NaN
        # for a run written before the band columns
        "sim_time_band_s": _total(rounds, R.ROUND_TIME_BAND_S),
        "energy_band_j": _total(rounds, R.ROUND_ENERGY_BAND_J),
        "peak_memory_bytes": float(clients[C.EMULATED_PEAK_MEMORY_BYTES].max()),
        "fits_fraction": float(clients[C.FITS].mean()),
        "mean_train_time_per_round_s": float(clients[C.EMULATED_TRAIN_TIME_S].mean()),
        "fraction_params_trained": float(clients[C.FRACTION_PARAMS_TRAINED].mean()),
        "host_wall_s": float(trained[R.HOST_WALL_S].sum()),
    }
    if target:
        hit = rounds[rounds[R.TEST_ACCURACY] >= target]
        row["reached_target"] = bool(len(hit))
        row["time_to_target_s"] = float(hit[R.SIM_TIME_S].iloc[0]) if len(hit) else float("nan")
        row["energy_to_target_j"] = float(hit[R.TOTAL_ENERGY_J].iloc[0]) if len(hit) else float("nan")
    return row


def _total(rounds: pd.DataFrame, column: str) -> float:
    return float(rounds[column].sum()) if column in rounds else float("nan")


def ci95(values: np.ndarray) -> float:
    """Half-width of the 95% confidence interval of the mean (Student t); NaN for fewer than 2 values."""
    from scipy import stats

    values = np.asarray(values, float)
    n = len(values)
    if n < 2:
        return float("nan")
    return float(stats.t.ppf(0.975, n - 1) * values.std(ddof=1) / np.sqrt(n))


_TO_TARGET = ("time_to_target_s", "energy_to_target_j")
USED = "completed"  # the only run status whose seeds enter means and intervals
ALPHA = 0.05  # the level of the paired tests between strategies (Holm-corrected: :func:`differences`)
_NOT_METRICS = ("fleet", "strategy", "seed", "run_dir", "reached_target", "status", "error", "lr", "bn_mode")


def bounds(metric: str) -> tuple[float, float]:
    """The physical range of a summary metric: every one is a time, energy, memory, count or share
    (>= 0), and accuracies and fractions are also <= 1."""
    return 0.0, 1.0 if ("accuracy" in metric or "fraction" in metric) else math.inf


def interval(mean: float, ci: float, metric: str) -> tuple[float, float]:
    """``mean -+ ci`` clipped at ``metric``'s :func:`bounds` (NaN for a NaN half-width)."""
    lo, hi = bounds(metric)
    if math.isnan(ci) or math.isnan(mean):
        return float("nan"), float("nan")
    return max(mean - ci, lo), min(mean + ci, hi)


def interval_text(mean: float, ci: float, low: float, high: float, fmt: str) -> str:
    """``mean ± ci``; ``mean [low, high]`` where a bound clipped the interval; ``mean`` alone without one."""
    if math.isnan(mean):
        return "-"
    if math.isnan(ci):
        return fmt.format(mean)
    if low > mean - ci or high < mean + ci:
        return f"{fmt.format(mean)} [{fmt.format(low)}, {fmt.format(high)}]"
    return f"{fmt.format(mean)} ± {fmt.format(ci)}"


def _counts(status: pd.Series) -> dict[str, Any]:
    used = int((status == USED).sum())
    diverged = int((status == "diverged").sum())
    with_errors = int((status == "completed_with_errors").sum())
    return {
        "used": f"{used}/{len(status)}",
        "failed": len(status) - used - diverged - with_errors,
        "diverged": diverged,
        "with_errors": with_errors,
    }


def _values(column: pd.Series) -> str:
    """The distinct values of a column as one cell (``0.01`` or ``0.01, 0.1``)."""
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in dict.fromkeys(column.dropna()))


def aggregate(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy): mean and 95% interval of every metric over the seeds that completed.

    A seed whose ``status`` is anything but ``completed`` (failed, diverged, completed with
    client errors, or a run that raised) enters no mean and no interval; ``used`` says how many
    did (``2/3``), ``failed``, ``diverged`` and ``with_errors`` count the others. A table without
    a ``status`` column is taken as all completed. ``*_low``/``*_high`` are the interval's bounds,
    clipped at the metric's :func:`bounds`.

    Time and energy to target are censored, not dropped: a seed that never reached the target
    enters at its end-of-run time and energy, so the mean is a lower bound whenever
    ``reached`` (e.g. ``2/3``) is below all seeds, and ``*_is_lower_bound`` says so.
    """
    metrics = [c for c in summary.columns if c not in _NOT_METRICS]
    rows = []
    for (fleet, strategy), g in summary.groupby(["fleet", "strategy"], sort=False):
        status = g["status"].fillna("failed") if "status" in g else pd.Series(USED, index=g.index)
        row: dict[str, Any] = {"fleet": fleet, "strategy": strategy, "seeds": len(g), **_counts(status)}
        for key in ("lr", "bn_mode"):
            if key in g:
                row[key] = _values(g[key])
        u = g[status == USED]
        for m in metrics:
            values = u[m].to_numpy(float)
            if m in _TO_TARGET:
                censored = ~u["reached_target"].to_numpy(bool)
                end = u["sim_time_s" if m == "time_to_target_s" else "energy_j"].to_numpy(float)
                values = np.where(censored, end, values)
                row[f"{m}_is_lower_bound"] = bool(censored.any())
            mean = float(values.mean()) if len(values) else float("nan")
            ci = ci95(values)
            row[f"{m}_mean"], row[f"{m}_ci95"] = mean, ci
            row[f"{m}_low"], row[f"{m}_high"] = interval(mean, ci, m)
        if "reached_target" in g:
            row["reached_target"] = f"{int(u.reached_target.astype(bool).sum())}/{len(u)}"
        rows.append(row)
    return pd.DataFrame(rows)


def exit_code(summary: pd.DataFrame) -> int:
    """What ``fedelastic compare`` exits with: 4 if any seed diverged, else 3 if any seed did not
    complete (failed, raised, or completed with client errors), else 0."""
    status = summary["status"].fillna("failed") if "status" in summary else pd.Series([], dtype=object)
    if (status == "diverged").any():
        return 4
    return 3 if (status != USED).any() else 0


def curves(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy, round): mean simulated time and mean accuracy with its 95% interval over seeds.

    Rounds without an accuracy (skipped by ``server.evaluate_every``) are left out, and so are
    the runs whose ``status`` (where the table has one) is not ``completed``.
    """
    if "status" in runs:
        runs = runs[runs.status == USED]
    runs = runs[runs[R.TEST_ACCURACY].notna()]  # runs.csv: the runs' rounds tables, with fleet and strategy
    g = runs.groupby(["fleet", "strategy", R.ROUND], sort=False)
    out = g.agg(sim_time_s=(R.SIM_TIME_S, "mean"), accuracy=(R.TEST_ACCURACY, "mean")).reset_index()
    out["accuracy_ci95"] = g[R.TEST_ACCURACY].apply(lambda v: ci95(v.to_numpy())).to_numpy()
    return out


def holm(p: np.ndarray) -> np.ndarray:
    """Holm-Bonferroni adjusted p-values (NaN p-values stay NaN and do not count as comparisons).

    The i-th smallest of m p-values becomes ``max over j <= i of min(1, (m - j + 1) * p_(j))``; a
    comparison is significant at level alpha when its adjusted p-value is below alpha.
    """
    p = np.asarray(p, float)
    out = np.full(len(p), np.nan)
    idx = np.flatnonzero(~np.isnan(p))
    order = idx[np.argsort(p[idx], kind="stable")]
    m = len(order)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def detectable_difference(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The smallest true mean difference a two-sided paired t-test on ``n`` pairs, whose differences
    have standard deviation ``sd``, detects with probability ``power`` at level ``alpha``.

    Exact for the t-test: the noncentral t with ``n - 1`` degrees of freedom and noncentrality
    ``delta * sqrt(n) / sd`` falls beyond the critical value with probability ``power``. NaN for
    fewer than 2 pairs; 0 when ``sd`` is 0.
    """
    from scipy import optimize, stats

    if n < 2 or not math.isfinite(sd):
        return float("nan")
    if sd == 0:
        return 0.0
    df = n - 1
    crit = stats.t.ppf(1 - alpha / 2, df)

    def missing(nc: float) -> float:
        below = np.nan_to_num(stats.nct.sf(crit, df, -nc))  # P(T < -crit), by symmetry (cdf can give NaN)
        return float(stats.nct.sf(crit, df, nc) + below) - power

    high = 1.0
    while missing(high) < 0:  # the power rises with the noncentrality: bracket the root
        high *= 2
    nc = optimize.brentq(missing, 0.0, high, xtol=1e-10)
    return float(nc * sd / math.sqrt(n))


def differences(summary: pd.DataFrame, metric: str = "final_accuracy", alpha: float = ALPHA, power: float = 0.8):
    """Every pair of strategies within a fleet, compared on ``metric`` paired by seed.

    Only seeds that both runs of a pair completed are paired. Per pair: ``mean_diff`` (a - b) and
    ``sd_diff`` over the paired seeds, the two-sided paired t-test's ``p``, its Holm-Bonferroni
    adjusted ``p_holm`` over every pair of the comparison (all fleets: one family),
    ``significant`` (``p_holm < alpha``), and ``detectable``: the smallest difference the design
    detects with probability ``power`` at level ``alpha / m`` (m: the number of pairs tested,
    Holm's strictest step), from the pair's own ``sd_diff`` and seed count.
    """
    from scipy import stats

    if "status" in summary:
        summary = summary[summary.status == USED]
    rows = []
    for fleet, g in summary.groupby("fleet", sort=False):
        wide = g.pivot_table(index="seed", columns="strategy", values=metric, aggfunc="first")
        labels = list(dict.fromkeys(g.strategy))
        for i, a in enumerate(labels):
            for b in labels[i + 1 :]:
                pair = wide[[a, b]].dropna() if a in wide and b in wide else pd.DataFrame()
                d = (pair[a] - pair[b]).to_numpy(float) if len(pair) else np.array([])
                sd = float(d.std(ddof=1)) if len(d) > 1 else float("nan")
                if len(d) < 2:
                    p = float("nan")
                elif sd == 0:  # every seed differs by the same amount: no spread to test against
                    p = 0.0 if d[0] != 0 else 1.0
                else:
                    p = float(stats.ttest_rel(pair[a], pair[b]).pvalue)
                rows.append({"fleet": fleet, "a": a, "b": b, "seeds": len(d),
                             "mean_diff": float(d.mean()) if len(d) else float("nan"), "sd_diff": sd, "p": p})  # fmt: skip
    out = pd.DataFrame(rows, columns=["fleet", "a", "b", "seeds", "mean_diff", "sd_diff", "p"])
    out["p_holm"] = holm(out.p.to_numpy(float)) if len(out) else []
    out["significant"] = out.p_holm < alpha
    m = max(int(out.p.notna().sum()), 1)
    out["detectable"] = [detectable_difference(sd, n, alpha / m, power) for sd, n in zip(out.sd_diff, out.seeds)]
    out.attrs.update(metric=metric, alpha=alpha, power=power, tests=m)
    return out
