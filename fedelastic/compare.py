"""Comparisons: one scenario run over strategies x fleets x seeds, with a table and a figure.

A comparison is a scenario file with a ``[compare]`` table::

    [compare]
    strategies = ["full", "last_layer", { label = "elastic 0.4", strategy = "elastic_tensor", options = { rho = 0.4 } }]
    fleets = { gpu = { jetson_tx2 = 8 }, mcu = { stm32h743 = 8 } }
    seeds = [0, 1, 2]
    target_accuracy = 0.8

Each combination is an ordinary run (its own folder, written as it goes). The comparison folder
gets ``runs.csv`` (one row per run and round) and ``summary.csv`` (one row per run), appended
after every run, and at the end ``summary_by_strategy.csv`` and ``comparison.png``.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .config import check, field, from_dict, read_toml
from .errors import ConfigError
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
    """One run's headline figures."""
    trained = rounds[rounds["round"] > 0]
    row = {
        "final_accuracy": float(rounds.test_accuracy.iloc[-1]),
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
        row["time_to_target_s"] = float(hit.sim_time_s.iloc[0]) if len(hit) else float("nan")
        row["energy_to_target_j"] = float(hit.total_energy_j.iloc[0]) if len(hit) else float("nan")
    return row


def plot(runs: pd.DataFrame, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    grid = sns.relplot(
        data=runs, x="sim_time_s", y="test_accuracy", hue="strategy", col="fleet", kind="line", marker="o",
        units="seed", estimator=None, sort=False, alpha=0.8, facet_kws={"sharex": False}, height=3.6, aspect=1.2,
    )  # fmt: skip
    grid.set_axis_labels("simulated time (s)", "global test accuracy")
    grid.savefig(path, dpi=120)
    plt.close("all")


def run_comparison(
    path: str | Path, *, output: Path | None = None, backend: str | None = None, rounds: int | None = None
) -> Path:
    """Run every combination of a comparison file; returns the comparison folder."""
    from dataclasses import replace

    from .fl.runner import run_scenario

    path = Path(path)
    raw = read_toml(path, "scenario")
    cfg, variants = expand(raw, str(path))
    out = (
        output
        or Path(variants[0].scenario.output_dir)
        / raw.get("name", path.stem)
        / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    out.mkdir(parents=True, exist_ok=False)
    all_rounds, summary = [], []
    for i, v in enumerate(variants):
        sc = v.scenario
        if backend:
            sc = replace(sc, simulation=replace(sc.simulation, backend=backend))
        if rounds:
            sc = replace(sc, server=replace(sc.server, rounds=rounds))
        print(f"[{i + 1}/{len(variants)}] {v.fleet} / {v.strategy} / seed {v.seed}", flush=True)
        run_dir = run_scenario(sc, run_id=f"{out.name}-s{v.seed}")
        r, c = pd.read_parquet(run_dir / "rounds.parquet"), pd.read_parquet(run_dir / "clients.parquet")
        keys = {"fleet": v.fleet, "strategy": v.strategy, "seed": v.seed}
        all_rounds.append(r.assign(**keys))
        summary.append({**keys, **summarise(r, c, cfg.target_accuracy), "run_dir": str(run_dir)})
        pd.concat(all_rounds).to_csv(out / "runs.csv", index=False)
        pd.DataFrame(summary).to_csv(out / "summary.csv", index=False)
    table = pd.DataFrame(summary)
    numeric = table.drop(columns=["seed", "run_dir"]).groupby(["fleet", "strategy"], sort=False)
    agg = numeric.agg(["mean", "std"])
    agg.columns = [f"{a}_{b}" for a, b in agg.columns]
    agg.reset_index().to_csv(out / "summary_by_strategy.csv", index=False)
    plot(pd.concat(all_rounds), out / "comparison.png")
    return out


def mean_table(out: Path) -> pd.DataFrame:
    """The per-strategy means of a finished comparison, for printing."""
    t = pd.read_csv(out / "summary_by_strategy.csv")
    cols = ["fleet", "strategy"] + [c for c in t.columns if c.endswith("_mean")]
    return t[cols].rename(columns=lambda c: c.removesuffix("_mean")).replace({np.nan: None})
