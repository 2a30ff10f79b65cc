"""Comparisons: one scenario run over strategies x fleets x seeds, with a table and a figure.

A comparison is a scenario file with a ``[compare]`` table::

    [compare]
    strategies = ["full", "last_layer", { label = "elastic 0.4", strategy = "elastic_tensor", options = { rho = 0.4 } }]
    fleets = { gpu = { jetson_tx2 = 8 }, mcu = { stm32h743 = 8 } }
    seeds = [0, 1, 2]
    target_accuracy = 0.8

Each combination is an ordinary run, written as it goes under the comparison folder
(``runs/<scenario>-<fleet>-<label>/s<seed>/``). The comparison folder gets ``runs.csv`` (one row
per run and round) and ``summary.csv`` (one row per run), appended after every run, and at the
end ``summary_by_strategy.csv`` (mean and 95% interval over seeds of every metric; time to target
censored, with the count of seeds that reached it) and ``comparison.png`` (mean accuracy against
simulated time with a 95% band and the target line).
"""

from __future__ import annotations

import copy
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .config import check, field, from_dict, read_toml
from .errors import ConfigError, FedelasticError
from .scenario import Scenario, parse_scenario


@dataclass(frozen=True)
class StrategyVariant:
    strategy: str = field(help="registered strategy name")
    label: str = field("", help="name in tables and plots (default: the strategy name)")
    options: dict[str, Any] = field(default_factory=dict, help="the strategy's options")


@dataclass(frozen=True)
class CompareConfig:
    strategies: tuple[Any, ...] = field((), help="strategy names or { strategy, label, options } tables")
    fleets: dict[str, dict[str, int]] = field(
        default_factory=dict, help="fleet label -> fleet (default: the scenario's)"
    )
    seeds: tuple[int, ...] = field((), help="seeds (default: the scenario's)")
    target_accuracy: float = field(0.0, help="report simulated time and energy to reach this accuracy (0: skip)")

    def __post_init__(self):
        check(0 <= self.target_accuracy <= 1, "target_accuracy", "a fraction in [0, 1]")


@dataclass(frozen=True)
class Variant:
    strategy: str
    fleet: str
    seed: int
    scenario: Scenario


def expand(raw: dict, src: str) -> tuple[CompareConfig, list[Variant]]:
    """The comparison config and one validated scenario per combination."""
    raw = copy.deepcopy(raw)
    cfg = from_dict(CompareConfig, raw.pop("compare", {}), src, prefix="compare")
    variants: list[StrategyVariant] = []
    for i, item in enumerate(cfg.strategies or (raw.get("train", {}).get("strategy", "full"),)):
        item = {"strategy": item} if isinstance(item, str) else item
        variants.append(from_dict(StrategyVariant, item, src, prefix=f"compare.strategies[{i}]"))
    labels = [v.label or v.strategy for v in variants]
    if len(set(labels)) != len(labels):
        raise ConfigError(src, "compare.strategies", "distinct labels (add label = ... to tell variants apart)", labels)
    fleets = cfg.fleets or {"fleet": raw.get("fleet", {})}
    seeds = cfg.seeds or (raw.get("seed", 0),)
    out = []
    for fleet_label, fleet in fleets.items():
        for variant, label in zip(variants, labels):
            for seed in seeds:
                r = copy.deepcopy(raw)
                r.update(
                    fleet=fleet, seed=seed, name=f"{raw.get('name', 'compare')}-{fleet_label}-{label}".replace(" ", "_")
                )
                r["train"] = {**r.get("train", {}), "strategy": variant.strategy, "options": variant.options}
                out.append(Variant(label, fleet_label, seed, parse_scenario(r, src)))
    return cfg, out


def summarise(rounds: pd.DataFrame, clients: pd.DataFrame, target: float) -> dict:
    """One run's headline figures.

    ``time_to_target_s`` is the simulated time of the first round at or above ``target``; a run
    that never gets there has NaN there and ``reached_target = False`` (censored at its end,
    ``sim_time_s``), never a made-up time. Only evaluated rounds count (``server.evaluate_every``
    skips some: their accuracy is NaN), and ``final_accuracy`` is the last evaluated round's.
    """
    trained = rounds[rounds["round"] > 0]
    evaluated = rounds.test_accuracy.dropna()
    row = {
        "final_accuracy": float(evaluated.iloc[-1]) if len(evaluated) else float("nan"),
        "sim_time_s": float(rounds.sim_time_s.iloc[-1]),
        "energy_j": float(rounds.total_energy_j.iloc[-1]),
        "peak_memory_bytes": float(clients.emulated_peak_memory_bytes.max()),
        "fits_fraction": float(clients.fits.mean()),
        "mean_train_time_per_round_s": float(clients.emulated_train_time_s.mean()),
        "fraction_params_trained": float(clients.fraction_params_trained.mean()),
        "host_wall_s": float(trained.host_wall_s.sum()),
    }
    if target:
        hit = rounds[rounds.test_accuracy >= target]
        row["reached_target"] = bool(len(hit))
        row["time_to_target_s"] = float(hit.sim_time_s.iloc[0]) if len(hit) else float("nan")
        row["energy_to_target_j"] = float(hit.total_energy_j.iloc[0]) if len(hit) else float("nan")
    return row


def ci95(values: np.ndarray) -> float:
    """Half-width of the 95% confidence interval of the mean (Student t); NaN for fewer than 2 values."""
    from scipy import stats

    values = np.asarray(values, float)
    n = len(values)
    if n < 2:
        return float("nan")
    return float(stats.t.ppf(0.975, n - 1) * values.std(ddof=1) / np.sqrt(n))


_TO_TARGET = ("time_to_target_s", "energy_to_target_j")


def aggregate(summary: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy): mean and 95% interval of every metric over seeds.

    Time and energy to target are censored, not dropped: a seed that never reached the target
    enters at its end-of-run time and energy, so the mean is a lower bound whenever
    ``reached`` (e.g. ``2/3``) is below all seeds, and ``*_is_lower_bound`` says so.
    """
    metrics = [c for c in summary.columns if c not in ("fleet", "strategy", "seed", "run_dir", "reached_target")]
    rows = []
    for (fleet, strategy), g in summary.groupby(["fleet", "strategy"], sort=False):
        row: dict[str, Any] = {"fleet": fleet, "strategy": strategy, "seeds": len(g)}
        for m in metrics:
            values = g[m].to_numpy(float)
            if m in _TO_TARGET:
                censored = ~g["reached_target"].to_numpy(bool)
                end = g["sim_time_s" if m == "time_to_target_s" else "energy_j"].to_numpy(float)
                values = np.where(censored, end, values)
                row[f"{m}_is_lower_bound"] = bool(censored.any())
            row[f"{m}_mean"] = float(values.mean())
            row[f"{m}_ci95"] = ci95(values)
        if "reached_target" in g:
            row["reached_target"] = f"{int(g.reached_target.sum())}/{len(g)}"
        rows.append(row)
    return pd.DataFrame(rows)


def curves(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (fleet, strategy, round): mean simulated time and mean accuracy with its 95% interval over seeds.

    Rounds without an accuracy (skipped by ``server.evaluate_every``) are left out.
    """
    runs = runs[runs.test_accuracy.notna()]
    g = runs.groupby(["fleet", "strategy", "round"], sort=False)
    out = g.agg(sim_time_s=("sim_time_s", "mean"), accuracy=("test_accuracy", "mean")).reset_index()
    out["accuracy_ci95"] = g.test_accuracy.apply(lambda v: ci95(v.to_numpy())).to_numpy()
    return out


def plot(runs: pd.DataFrame, path: Path, target: float = 0.0) -> None:
    """Mean accuracy over seeds against mean simulated time, a 95% band, one panel per fleet."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    data = curves(runs)
    fleets = list(dict.fromkeys(data.fleet))
    palette = dict(zip(dict.fromkeys(data.strategy), sns.color_palette(n_colors=data.strategy.nunique())))
    fig, axes = plt.subplots(1, len(fleets), figsize=(4.6 * len(fleets), 3.8), squeeze=False)
    for ax, fleet in zip(axes[0], fleets):
        for strategy, g in data[data.fleet == fleet].groupby("strategy", sort=False):
            ax.plot(g.sim_time_s, g.accuracy, marker="o", ms=3, color=palette[strategy], label=strategy)
            band = g.accuracy_ci95.fillna(0.0)
            ax.fill_between(g.sim_time_s, g.accuracy - band, g.accuracy + band, color=palette[strategy], alpha=0.2)
        if target:
            ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:g}")
        ax.set(title=f"fleet {fleet}", xlabel="simulated time (s), mean over seeds", ylabel="global test accuracy")
        ax.set_ylim(0, 1)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_comparison(
    path: str | Path,
    *,
    output: Path | None = None,
    backend: str | None = None,
    rounds: int | None = None,
    resume: Path | None = None,
) -> Path:
    """Run every combination of a comparison file; returns the comparison folder.

    ``resume``: the folder of an interrupted comparison; finished cells are read back, a killed
    cell continues from its checkpoint, and the rest run.
    """
    path = Path(path)
    raw = read_toml(path, "scenario")
    cfg, variants = expand(raw, str(path))
    if resume is not None:
        out = Path(resume)
        if not out.is_dir():
            raise FedelasticError(f"{out}: no such comparison folder to resume")
    else:
        out = (
            output
            or Path(variants[0].scenario.output_dir)
            / raw.get("name", path.stem)
            / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        try:
            out.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise FedelasticError(f"{out}: exists; continue it with `fedelastic compare --resume {out}`") from None
    all_rounds: list[pd.DataFrame] = []
    summary: list[dict] = []
    console = Console()
    bar = Progress(
        TextColumn("[bold]compare"), BarColumn(), MofNCompleteColumn(), TextColumn("cells"), TimeElapsedColumn(),
        console=console, disable=not console.is_terminal,
    )  # fmt: skip
    with bar:
        task = bar.add_task("cells", total=len(variants))
        for i, v in enumerate(variants):
            _run_cell(i, v, variants, out, backend, rounds, cfg, all_rounds, summary)
            bar.advance(task)
    aggregate(pd.DataFrame(summary)).to_csv(out / "summary_by_strategy.csv", index=False)
    plot(pd.concat(all_rounds), out / "comparison.png", cfg.target_accuracy)
    return out


def _run_cell(i, v, variants, out: Path, backend, rounds, cfg, all_rounds: list, summary: list) -> None:
    """Run (or read back, or resume) one cell of a comparison and write the tables so far."""
    from dataclasses import replace

    from .fl.runner import run_scenario
    from .results import read_status

    sc = replace(v.scenario, output_dir=str(out / "runs"))  # a comparison's runs live under its folder
    if backend:
        sc = replace(sc, simulation=replace(sc.simulation, backend=backend))
    if rounds:
        sc = replace(sc, server=replace(sc.server, rounds=rounds))
    print(f"[{i + 1}/{len(variants)}] {v.fleet} / {v.strategy} / seed {v.seed}", flush=True)
    run_dir = Path(sc.output_dir) / sc.name / f"s{v.seed}"
    state = read_status(run_dir)["status"] if run_dir.exists() else "new"
    if state in ("completed", "completed_with_errors"):
        print(f"    finished earlier: {run_dir}", flush=True)
    elif state != "new" and (run_dir / "checkpoint.pt").exists():
        print(f"    resuming {run_dir} ({state})", flush=True)
        run_scenario(sc, resume=run_dir)
    else:
        if state != "new":  # died before its first checkpoint: nothing finished to keep
            shutil.rmtree(run_dir)
        run_dir = run_scenario(sc, run_id=f"s{v.seed}")
    r, c = pd.read_parquet(run_dir / "rounds.parquet"), pd.read_parquet(run_dir / "clients.parquet")
    keys = {"fleet": v.fleet, "strategy": v.strategy, "seed": v.seed}
    all_rounds.append(r.assign(**keys))
    summary.append({**keys, **summarise(r, c, cfg.target_accuracy), "run_dir": str(run_dir)})
    pd.concat(all_rounds).to_csv(out / "runs.csv", index=False)
    pd.DataFrame(summary).to_csv(out / "summary.csv", index=False)


# columns of the printed table: (column stem, short header, how a value is shown)
_SHOWN = (
    ("final_accuracy", "acc", "{:.3f}"),
    ("sim_time_s", "sim s", "{:.3g}"),
    ("energy_j", "energy J", "{:.3g}"),
    ("time_to_target_s", "t→target s", "{:.3g}"),
    ("peak_memory_bytes", "peak MiB", None),
    ("fits_fraction", "fits", "{:.0%}"),
    ("fraction_params_trained", "trained", "{:.0%}"),
)


def mean_table(out: Path) -> tuple[pd.DataFrame, list[str]]:
    """A finished comparison's table for a terminal, and its legend.

    Every cell is ``mean ± 95% interval`` over seeds; strategy labels longer than 12 characters
    are replaced by ``S1, S2, ...`` and spelled out in the legend, so no label is truncated.
    """
    t = pd.read_csv(out / "summary_by_strategy.csv")
    legend = ["cells: mean ± 95% interval over seeds"]
    short = {}
    for i, name in enumerate(dict.fromkeys(t.strategy)):
        short[name] = name if len(name) <= 12 else f"S{i + 1}"
        if short[name] != name:
            legend.append(f"{short[name]} = {name}")
    frame = pd.DataFrame({"fleet": t.fleet, "strategy": t.strategy.map(short), "seeds": t.seeds})
    for stem, header, fmt in _SHOWN:
        if f"{stem}_mean" not in t:
            continue
        mean, ci = t[f"{stem}_mean"], t[f"{stem}_ci95"]
        if stem == "peak_memory_bytes":
            mean, ci, fmt = mean / 2**20, ci / 2**20, "{:.3g}"
        cells = [fmt.format(m) + ("" if np.isnan(c) else " ± " + fmt.format(c)) for m, c in zip(mean, ci)]
        if stem == "time_to_target_s":
            lower = t["time_to_target_s_is_lower_bound"].astype(bool)
            cells = [("≥" if lb else "") + c + f" ({n})" for c, lb, n in zip(cells, lower, t.reached_target)]
            legend.append(
                "t→target: (seeds that reached it); ≥: a lower bound, unreached seeds enter at their end time"
            )
        frame[header] = cells
    return frame, legend
