"""Comparisons: one scenario run over strategies x fleets x seeds, with a table and a figure.

A comparison is a scenario file with a ``[compare]`` table::

    [compare]
    strategies = ["full", "last_layer", { label = "elastic 0.5", strategy = "elastic_tensor", options = { rho = 0.5 } }]
    fleets = { gpu = { jetson_tx2 = 8 }, mcu = { stm32h743 = 8 } }
    seeds = [0, 1, 2]
    target_accuracy = 0.8

Each combination is an ordinary run, written as it goes under the comparison folder
(``runs/<scenario>-<fleet>-<label>/s<seed>/``). The comparison folder gets ``runs.csv`` (one row
per run and round) and ``summary.csv`` (one row per run), appended after every run, and at the
end ``summary_by_strategy.csv`` (mean and 95% interval over seeds of every metric; time to target
censored, with the count of seeds that reached it) and ``comparison.png`` (mean accuracy against
simulated time with a 95% band and the target line).

Only seeds whose run ``completed`` enter a mean or an interval: a seed that failed, diverged or
completed with client errors keeps its row in ``summary.csv`` (with its ``status``) and is counted
in ``used`` (e.g. ``2/3``), ``failed``, ``diverged`` and ``with_errors``. Interval bounds are
clipped at the metric's physical bounds (every metric is >= 0; accuracies and fractions <= 1).

With ``[compare.tune]``, every (fleet, strategy) first runs a short tuning run per grid point of
learning rates (and BatchNorm modes), scored on a validation split carved from the clients'
training data (``data.validation``), and its seeds then run with the best point (``tuning.csv``).
"""

from __future__ import annotations

import copy
import itertools
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..config import check, field, from_dict, read_toml
from ..errors import ConfigError, FedelasticError
from ..results import idle
from ..results.plots import plot_comparison as plot

# the statistics over seeds, re-exported here: this module's API
from ..results.seedstats import ALPHA, USED, aggregate, differences, summarise
from ..results.seedstats import bounds as bounds
from ..results.seedstats import ci95 as ci95
from ..results.seedstats import curves as curves
from ..results.seedstats import exit_code as exit_code
from ..results.seedstats import interval as interval
from ..results.seedstats import interval_text as interval_text
from ..scenario import Scenario, parse_scenario
from ..sim.columns import RoundCol


@dataclass(frozen=True)
class StrategyVariant:
    strategy: str = field(help="registered strategy name")
    label: str = field("", help="name in tables and plots (default: the strategy name)")
    options: dict[str, Any] = field(default_factory=dict, help="the strategy's options")


@dataclass(frozen=True)
class TuneConfig:
    lr: tuple[float, ...] = field(
        (), help="learning rates to try (empty: the scenario's train.lr; with bn_mode also empty, no tuning runs)"
    )
    bn_mode: tuple[Literal["auto", "frozen", "train"], ...] = field(
        (), help="BatchNorm modes to try (empty: the scenario's train.bn_mode)"
    )
    rounds: int = field(0, help="rounds of each tuning run (0: as many as the comparison's runs)")
    seed: int = field(0, help="seed of the tuning runs")
    validation: float = field(
        0.1, help="share of each client's training data held out to score the tuning runs (data.validation)"
    )
    widen: int = field(
        3,
        help="most learning rates added per fleet and strategy while the chosen one is at the grid's edge, each "
        "one geometric step beyond it (the ratio of the two rates at that edge); 0: only warn. A choice still "
        "at an edge is marked in the table, tuning.csv and the log",
    )

    def __post_init__(self):
        check(all(lr > 0 for lr in self.lr) and len(set(self.lr)) == len(self.lr), "lr", "distinct positive numbers")
        check(len(set(self.bn_mode)) == len(self.bn_mode), "bn_mode", "distinct modes")
        check(self.rounds >= 0, "rounds", "an integer >= 0")
        check(0 < self.validation < 1, "validation", "a fraction in (0, 1)")
        check(self.widen >= 0, "widen", "an integer >= 0")


@dataclass(frozen=True)
class CompareConfig:
    strategies: tuple[Any, ...] = field((), help="strategy names or { strategy, label, options } tables")
    fleets: dict[str, dict[str, int]] = field(
        default_factory=dict, help="fleet label -> fleet (default: the scenario's)"
    )
    seeds: tuple[int, ...] = field((), help="seeds (default: the scenario's)")
    target_accuracy: float = field(0.0, help="report simulated time and energy to reach this accuracy (0: skip)")
    tune: TuneConfig | None = field(
        None, help="tune lr (and bn_mode) per fleet and strategy on a validation split before the seeds run"
    )
    pretrain: Literal["per_seed", "shared"] = field(
        "per_seed",
        help="'per_seed': each seed pretrains (and splits train/test) with its own seed; 'shared': one "
        "pretrain and one test set, with the first seed, for all (model.pretrain.seed set to it)",
    )

    def __post_init__(self):
        check(0 <= self.target_accuracy <= 1, "target_accuracy", "a fraction in [0, 1]")


@dataclass(frozen=True)
class Variant:
    strategy: str
    fleet: str
    seed: int
    scenario: Scenario


@dataclass(frozen=True)
class TuneCell:
    """One tuning run: a grid point of one (fleet, strategy)."""

    strategy: str
    fleet: str
    lr: float
    bn_mode: str
    scenario: Scenario


def _combinations(raw: dict, src: str) -> tuple[CompareConfig, list[tuple[str, dict, StrategyVariant, str]]]:
    """The comparison config and its (fleet label, fleet, strategy variant, label) combinations, in run order."""
    cfg = from_dict(CompareConfig, raw.get("compare", {}), src, prefix="compare")
    variants: list[StrategyVariant] = []
    train = raw.get("train", {})
    own = {"strategy": train.get("strategy", "full"), "options": train.get("options", {})}  # its options kept
    for i, item in enumerate(cfg.strategies or (own,)):
        item = {"strategy": item} if isinstance(item, str) else item
        variants.append(from_dict(StrategyVariant, item, src, prefix=f"compare.strategies[{i}]"))
    labels = [v.label or v.strategy for v in variants]
    if len(set(labels)) != len(labels):
        raise ConfigError(src, "compare.strategies", "distinct labels (add label = ... to tell variants apart)", labels)
    fleets = cfg.fleets or {"fleet": raw.get("fleet", {})}
    return cfg, [(f, fleet, v, label) for f, fleet in fleets.items() for v, label in zip(variants, labels)]


def _share_pretrain(raw: dict, cfg: CompareConfig, src: str) -> dict:
    """``raw`` with ``model.pretrain.seed`` set to the first seed when ``compare.pretrain = "shared"``
    (and the scenario does not fix it): every seed then starts from one cached pretrain."""
    if cfg.pretrain != "shared":
        return raw
    pre = raw.get("model", {}).get("pretrain")
    if not isinstance(pre, dict):
        raise ConfigError(
            src, "compare.pretrain", "'per_seed' unless the scenario has a [model.pretrain] table", "shared"
        )
    if "seed" in pre:
        return raw
    seed = (cfg.seeds or (raw.get("seed", 0),))[0]
    return {**raw, "model": {**raw["model"], "pretrain": {**pre, "seed": seed}}}


def _cell_raw(raw: dict, fleet_label: str, fleet: dict, variant: StrategyVariant, label: str, seed: int) -> dict:
    r = copy.deepcopy({k: v for k, v in raw.items() if k != "compare"})
    r.update(fleet=fleet, seed=seed, name=f"{raw.get('name', 'compare')}-{fleet_label}-{label}".replace(" ", "_"))
    r["train"] = {**r.get("train", {}), "strategy": variant.strategy, "options": variant.options}
    return r


def _parse_cell(raw: dict, src: str, fleet_label: str, from_compare: bool, strategy_key: str = ""):
    """A cell's validated scenario; a fault in a fleet from ``compare.fleets`` names that key, one in
    the options of a strategy from ``compare.strategies`` names ``strategy_key`` (its entry)."""
    try:
        return parse_scenario(raw, src)
    except ConfigError as exc:
        if strategy_key and exc.key.startswith("train.options"):
            raise ConfigError(exc.source, strategy_key + exc.key[len("train") :], exc.expected, exc.got) from None
        if not from_compare or not (exc.key == "fleet" or exc.key.startswith("fleet.")):
            raise
        key = f"compare.fleets.{fleet_label}{exc.key[len('fleet') :]}"
        raise ConfigError(exc.source, key, exc.expected, exc.got) from None


def expand(raw: dict, src: str) -> tuple[CompareConfig, list[Variant]]:
    """The comparison config and one validated scenario per combination."""
    cfg, combos = _combinations(raw, src)
    seeds = cfg.seeds or (raw.get("seed", 0),)
    raw = _share_pretrain(raw, cfg, src)
    out = []
    for fleet_label, fleet, variant, label in combos:
        key = _strategy_key(cfg, combos, label)
        for seed in seeds:
            r = _cell_raw(raw, fleet_label, fleet, variant, label, seed)
            out.append(Variant(label, fleet_label, seed, _parse_cell(r, src, fleet_label, bool(cfg.fleets), key)))
    return cfg, out


def _strategy_key(cfg: CompareConfig, combos: list, label: str) -> str:
    """``compare.strategies[i]`` of the entry labelled ``label``; "" for the scenario's own strategy."""
    if not cfg.strategies:
        return ""
    return f"compare.strategies[{list(dict.fromkeys(c[3] for c in combos)).index(label)}]"


def expand_tuning(raw: dict, src: str) -> list[TuneCell]:
    """One validated tuning scenario per (fleet, strategy) and grid point; none without ``[compare.tune]``.

    A tuning run holds out ``tune.validation`` of each client's data (``data.validation``), runs
    ``tune.rounds`` rounds with ``tune.seed``, and lives in a folder named after its grid point.
    """
    cfg, combos = _combinations(raw, src)
    tune = cfg.tune
    if tune is None or not (tune.lr or tune.bn_mode):  # nothing to choose: the seeds run at the scenario's values
        return []
    raw = _share_pretrain(raw, cfg, src)
    out = []
    for fleet_label, fleet, variant, label in combos:
        r = _cell_raw(raw, fleet_label, fleet, variant, label, tune.seed)
        train = r["train"]
        for lr, bn in itertools.product(tune.lr or (train.get("lr"),), tune.bn_mode or (train.get("bn_mode"),)):
            t = copy.deepcopy(r)
            t["train"] = {**train, **({"lr": lr} if lr is not None else {}), **({"bn_mode": bn} if bn else {})}
            t["data"] = {**t.get("data", {}), "validation": tune.validation}
            if tune.rounds:
                t["server"] = {**t.get("server", {}), "rounds": tune.rounds}
            sc = _parse_cell(t, src, fleet_label, bool(cfg.fleets), _strategy_key(cfg, combos, label))
            sc = replace(sc, name=f"{sc.name}-tune-lr{sc.train.lr:g}-{sc.train.bn_mode}")
            out.append(TuneCell(label, fleet_label, sc.train.lr, sc.train.bn_mode, sc))
    return out


def run_comparison(
    path: str | Path,
    *,
    output: Path | None = None,
    backend: str | None = None,
    rounds: int | None = None,
    resume: Path | None = None,
    overrides: dict | None = None,
) -> Path:
    """Run every combination of a comparison file; returns the comparison folder.

    ``overrides``: the file's dict with these top-level tables and keys replaced (``{"seed": 1,
    "compare": {...}}``; built by :func:`fedelastic.compare`).

    A cell whose run raised is recorded as ``failed`` and the comparison goes on (a bad scenario,
    a :class:`ConfigError`, still stops it). ``resume``: the folder of an interrupted comparison;
    finished cells (tuning runs included) are read back, a killed cell continues from its
    checkpoint, and the rest run.
    """
    path = Path(path)
    raw = {**read_toml(path, "scenario"), **(overrides or {})}
    cfg, variants = expand(raw, str(path))
    tuning = expand_tuning(raw, str(path))
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
    if cfg.tune is not None and cfg.tune.lr:  # train.lr is not what the seeds run with: say so
        print(
            f"lr: tuned per fleet and strategy over {list(cfg.tune.lr)} on the validation split; train.lr "
            f"({variants[0].scenario.train.lr:g}) is used only where no tuning run completes",
            flush=True,
        )
    cells = _Cells(out, backend, rounds, cfg, total=len(variants) + len(tuning))
    console = Console()
    bar = Progress(
        TextColumn("[bold]compare"), BarColumn(), MofNCompleteColumn(), TextColumn("cells"), TimeElapsedColumn(),
        console=console, disable=not console.is_terminal,
    )  # fmt: skip
    with bar:
        task = bar.add_task("cells", total=cells.total)
        cells.advance = lambda: bar.advance(task)
        try:
            for (fleet, strategy), group in itertools.groupby(variants, key=lambda v: (v.fleet, v.strategy)):
                grid = [t for t in tuning if (t.fleet, t.strategy) == (fleet, strategy)]
                chosen = cells.tune(grid) if grid else None
                for v in group:
                    cells.run(v, chosen)
        except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM: the command's resume hint names this folder
            exc.compare_dir = out  # type: ignore[attr-defined]
            raise
    summary = pd.DataFrame(cells.summary)
    by_strategy = aggregate(summary)
    if cells.idle:  # per device, the share of client-rounds that trained nothing, and why
        by_strategy = by_strategy.merge(idle.per_cell(pd.DataFrame(cells.idle)), on=["fleet", "strategy"], how="left")
    by_strategy.to_csv(out / "summary_by_strategy.csv", index=False)
    if "final_accuracy" in summary:
        differences(summary).to_csv(out / "differences.csv", index=False)
    plot(
        pd.concat(cells.rounds_tables) if cells.rounds_tables else pd.DataFrame(),
        out / "comparison.png",
        cfg.target_accuracy,
    )
    return out


def pick(scores: pd.DataFrame) -> int | None:
    """The index of the best tuning run in ``scores`` (columns ``lr``, ``status``, ``val_accuracy``,
    ``val_loss``), or None when none completed with a score.

    Only ``completed`` runs with a finite validation loss count (a NaN or infinite loss is a
    model that blew up, whatever its accuracy). Best: the highest validation accuracy; ties go to
    the lower validation loss, then to the smaller learning rate, then to the row listed first.
    """
    finite = np.isfinite(scores.val_loss.to_numpy(float))
    ok = scores[(scores.status == USED) & scores.val_accuracy.notna() & finite]
    if not len(ok):
        return None
    order = sorted(ok.index, key=lambda i: (-ok.val_accuracy[i], ok.val_loss[i], ok.lr[i], list(ok.index).index(i)))
    return int(order[0])


class _Cells:
    """Runs (or reads back, or resumes) the cells of a comparison and writes its tables as it goes."""

    def __init__(self, out: Path, backend: str | None, rounds: int | None, cfg: CompareConfig, total: int):
        self.out, self.backend, self.rounds, self.cfg, self.total = out, backend, rounds, cfg, total
        self.done = 0
        self.advance = lambda: None
        self.rounds_tables: list[pd.DataFrame] = []
        self.summary: list[dict] = []
        self.tuning: list[dict] = []
        self.idle: list[dict] = []  # per run and device: client-rounds that trained nothing (fedelastic.results.idle)

    def tune(self, grid: list[TuneCell]) -> TuneCell | None:
        """Run one (fleet, strategy)'s tuning grid; returns the chosen grid point (None: none completed).

        While the chosen learning rate is the highest or lowest of the grid (for its bn_mode) and
        fewer than ``tune.widen`` rates were added, one more rate one geometric step beyond that
        edge runs and the choice is made again. A choice left at an edge is warned about and marked
        in ``tuning.csv`` (``edge``: top or bottom; ``added``: the rates widening added).
        """
        first, grid = len(self.tuning), list(grid)
        for cell in grid:
            self._tune_one(cell)
        best = pick(pd.DataFrame(self.tuning[first:], index=range(first, len(self.tuning))))
        widen = self.cfg.tune.widen if self.cfg.tune else 0
        added = 0
        while best is not None:
            chosen = grid[best - first]
            lrs = sorted(c.lr for c in grid if c.bn_mode == chosen.bn_mode)
            edge, further = _edge(lrs, chosen.lr), beyond(lrs, chosen.lr)
            if further is None or added >= widen:
                break
            cell = _with_lr(chosen, further)
            grid.append(cell)
            self.total += 1
            self._tune_one(cell, added=True)
            added += 1
            best = pick(pd.DataFrame(self.tuning[first:], index=range(first, len(self.tuning))))
        if best is None:
            print(f"    no tuning run of {grid[0].fleet} / {grid[0].strategy} completed: its seeds run with the "
                  "scenario's own lr and bn_mode", flush=True)  # fmt: skip
            return None
        self.tuning[best]["chosen"] = True
        self.tuning[best]["edge"] = edge
        pd.DataFrame(self.tuning).to_csv(self.out / "tuning.csv", index=False)
        chosen = grid[best - first]
        print(f"    chosen: lr {chosen.lr:g}, bn_mode {chosen.bn_mode}", flush=True)
        if edge:
            print(f"    warning: {edge_warning(self.tuning[best], lrs, added)}", flush=True)
        return chosen

    def _tune_one(self, cell: TuneCell, added: bool = False) -> None:
        """Run (or read back) one tuning run and append its scores to ``tuning.csv``."""
        sc = self._prepare(cell.scenario, "tuning", tuning=True)
        label = f"{cell.fleet} / {cell.strategy} / tune lr {cell.lr:g}, bn {cell.bn_mode}"
        run_dir, status, error = self._execute(sc, label)
        r = _read(run_dir, "rounds")
        scored = r is not None and RoundCol.VAL_ACCURACY in r  # a run with a validation share
        evaluated = r[r[RoundCol.VAL_ACCURACY].notna()] if scored else pd.DataFrame()
        self.tuning.append(
            {
                "fleet": cell.fleet, "strategy": cell.strategy, "lr": cell.lr, "bn_mode": cell.bn_mode,
                "status": status, "error": error,
                "val_accuracy": float(evaluated[RoundCol.VAL_ACCURACY].iloc[-1]) if len(evaluated) else float("nan"),
                "val_loss": float(evaluated[RoundCol.VAL_LOSS].iloc[-1]) if len(evaluated) else float("nan"),
                "chosen": False, "edge": "", "added": added, "run_dir": str(run_dir),
            }
        )  # fmt: skip
        pd.DataFrame(self.tuning).to_csv(self.out / "tuning.csv", index=False)

    def run(self, v: Variant, chosen: TuneCell | None) -> None:
        """Run one seed of a cell (with the tuned lr and bn_mode, if any) and write the tables so far."""
        sc = v.scenario
        if chosen is not None:
            sc = replace(sc, train=replace(sc.train, lr=chosen.lr, bn_mode=chosen.bn_mode))
        sc = self._prepare(sc, "runs")
        run_dir, status, error = self._execute(sc, f"{v.fleet} / {v.strategy} / seed {v.seed}", f"s{v.seed}")
        keys = {"fleet": v.fleet, "strategy": v.strategy, "seed": v.seed}
        row: dict[str, Any] = {**keys, "status": status, "error": error, "lr": sc.train.lr, "bn_mode": _bn_mode(sc)}
        r, c = _read(run_dir, "rounds"), _read(run_dir, "clients")
        if r is not None and len(r):
            self.rounds_tables.append(r.assign(**keys, status=status))
            if c is not None:
                row.update(summarise(r, c, self.cfg.target_accuracy))
                for device, d in idle.by_device(c).iterrows():
                    self.idle.append({"fleet": v.fleet, "strategy": v.strategy, "device": device, **d.to_dict()})
        self.summary.append({**row, "run_dir": str(run_dir)})
        if self.rounds_tables:
            pd.concat(self.rounds_tables).to_csv(self.out / "runs.csv", index=False)
        pd.DataFrame(self.summary).to_csv(self.out / "summary.csv", index=False)

    def _prepare(self, sc: Scenario, folder: str, tuning: bool = False) -> Scenario:
        sc = replace(sc, output_dir=str(self.out / folder))  # a comparison's runs live under its folder
        if self.backend:
            sc = replace(sc, simulation=replace(sc.simulation, backend=self.backend))
        if self.rounds and not (tuning and self.cfg.tune and self.cfg.tune.rounds):
            sc = replace(sc, server=replace(sc.server, rounds=self.rounds))
        return sc

    def _execute(self, sc: Scenario, label: str, run_id: str | None = None) -> tuple[Path, str, str]:
        """Run ``sc`` into its folder unless it finished there earlier: (run folder, status, one-line error)."""
        from ..fl.runner import run_scenario
        from ..results.recorder import one_line, read_status

        self.done += 1
        print(f"[{self.done}/{self.total}] {label}", flush=True)
        run_id = run_id or f"s{sc.seed}"
        run_dir = Path(sc.output_dir) / sc.name / run_id
        state = read_status(run_dir)["status"] if run_dir.exists() else "new"
        raised = ""
        if state in FINISHED:
            print(f"    finished earlier: {run_dir} ({state})", flush=True)
        else:
            try:
                if state != "new" and (run_dir / "checkpoint.pt").exists():
                    print(f"    resuming {run_dir} ({state})", flush=True)
                    run_scenario(sc, resume=run_dir)
                else:
                    if state != "new":  # died before its first checkpoint: nothing finished to keep
                        shutil.rmtree(run_dir)
                    run_scenario(sc, run_id=run_id)
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 (one cell's failure is recorded; the comparison goes on)
                raised = one_line(f"{type(exc).__name__}: {exc}")
        status = read_status(run_dir)
        state = status["status"]
        if raised and state not in FINISHED:
            state = "failed"
        if state != USED:
            print(f"    {state}: {run_dir}", flush=True)
        self.advance()
        return run_dir, state, raised or _why(status)


def _edge(lrs: list[float], lr: float) -> str:
    """``"top"`` or ``"bottom"`` when ``lr`` is the highest or lowest of ``lrs`` (sorted, at least two); else ''."""
    if len(lrs) < 2:
        return ""
    return "top" if lr == lrs[-1] else "bottom" if lr == lrs[0] else ""


def beyond(lrs: list[float], lr: float) -> float | None:
    """The rate one geometric step beyond ``lr`` when it is the highest or lowest of ``lrs`` (the ratio
    of the two rates at that edge, to 6 significant digits); None when ``lr`` is interior or alone."""
    lrs = sorted(lrs)
    edge = _edge(lrs, lr)
    if not edge:
        return None
    step = lrs[-1] / lrs[-2] if edge == "top" else lrs[0] / lrs[1]
    return float(f"{lr * step:.6g}")


@dataclass(frozen=True)
class LrSearch:
    """What :func:`tune_lr` tried and chose."""

    scores: dict[float, float]  # every rate tried -> its score (NaN: unusable), in the order tried
    chosen: float | None  # the best usable rate; None when none was usable
    edge: str  # "top" / "bottom": the choice is still at that edge of the rates tried (the limit bound)
    added: int  # rates added beyond the first grid


def tune_lr(score: Callable[[float], float], lrs: tuple[float, ...], max_widen: int) -> LrSearch:
    """The best of ``lrs`` by ``score(lr)`` (higher is better; NaN: unusable, e.g. diverged; ties go to
    the smaller rate), with the grid widened one geometric step (:func:`beyond`) past the edge the
    choice sits at, while it does and fewer than ``max_widen`` rates were added."""
    scores = {lr: float(score(lr)) for lr in lrs}
    while True:
        usable = {lr: s for lr, s in scores.items() if np.isfinite(s)}
        chosen = max(usable, key=lambda lr: (usable[lr], -lr)) if usable else None
        further = None if chosen is None else beyond(list(scores), chosen)
        added = len(scores) - len(lrs)
        if further is None or added >= max_widen:
            edge = "" if chosen is None else _edge(sorted(scores), chosen)
            return LrSearch(scores, chosen, edge, added)
        scores[further] = float(score(further))


def _with_lr(cell: TuneCell, lr: float) -> TuneCell:
    """``cell``'s tuning run at another learning rate, in a folder named after it."""
    sc = cell.scenario
    name = f"{sc.name.rsplit('-tune-lr', 1)[0]}-tune-lr{lr:g}-{cell.bn_mode}"
    return replace(cell, lr=lr, scenario=replace(sc, name=name, train=replace(sc.train, lr=lr)))


def edge_warning(row: dict, lrs: list[float], added: int) -> str:
    """One line on a tuned lr left at its grid's edge (``row``: its tuning.csv row; ``added``: the rates
    ``tune.widen`` added, all it allowed, since a choice at an edge widens while it may)."""
    grid = ", ".join(f"{lr:g}" for lr in lrs)
    where = f"{row['fleet']} / {row['strategy']}: lr {row['lr']:g} is at the {row['edge']} of the grid [{grid}]"
    if added:
        return f"{where} after {added} rate(s) added, the limit of compare.tune.widen: the best lr may lie beyond"
    return f"{where}: the best lr may lie beyond (compare.tune.widen = N extends the grid by up to N rates)"


def edge_warnings(out: Path) -> list[str]:
    """The warnings of a finished comparison's tuned learning rates left at their grid's edge (tuning.csv)."""
    if not (out / "tuning.csv").exists():
        return []
    t = pd.read_csv(out / "tuning.csv")
    if "edge" not in t:
        return []
    lines = []
    for row in t[t.chosen.astype(bool) & t.edge.notna() & (t.edge.astype(str) != "")].to_dict("records"):
        cell = t[(t.fleet == row["fleet"]) & (t.strategy == row["strategy"])]
        lrs = sorted(cell[cell.bn_mode == row["bn_mode"]].lr)
        lines.append(edge_warning(row, lrs, int(cell.added.astype(bool).sum())))
    return lines


FINISHED = ("completed", "completed_with_errors", "diverged")  # final states a resumed comparison keeps


def _why(status: dict) -> str:
    """One line on why a run did not complete, from its status.json ('' for a completed run)."""
    if status.get("status") == "diverged" and isinstance(status.get("divergence"), dict):
        d = status["divergence"]
        return f"diverged in round {d.get('round')}: {d.get('reason', '')}"
    if status.get("status") == "completed_with_errors":
        return f"{status.get('clients_failed', '?')} of {status.get('client_results', '?')} client results failed"
    return str(status.get("error", ""))


def _bn_mode(sc: Scenario) -> str:
    """``train.bn_mode`` with ``auto`` resolved as the run resolves it."""
    from ..environment import RunEnvironment

    return RunEnvironment(sc).bn_mode


def _read(run_dir: Path, table: str) -> pd.DataFrame | None:
    """A run's ``rounds`` or ``clients`` table, or None where the run left none."""
    try:
        return pd.read_parquet(run_dir / f"{table}.parquet")
    except (OSError, ValueError):
        return None


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

# the summary columns holding the emulation's one-sigma band of a shown column
_BANDS = {"sim_time_s": "sim_time_band_s", "energy_j": "energy_band_j"}
BAND_LEGEND = (
    "~x%: the emulation's one-sigma band (the device profiles' stated errors, summed over rounds), mean over seeds"
)


def with_band(t: pd.DataFrame, stem: str, cells: list[str]) -> list[str]:
    """``cells`` of column ``stem`` with the emulation's one-sigma band appended (``~x%`` of the mean),
    where ``summary_by_strategy`` has one (a band of NaN: a run written before the band columns)."""
    key = f"{_BANDS.get(stem)}_mean"
    if key not in t:
        return cells
    return [c if np.isnan(b) else f"{c} ~{b / m:.0%}" for c, b, m in zip(cells, t[key], t[f"{stem}_mean"])]


def mean_table(out: Path) -> tuple[pd.DataFrame, list[str]]:
    """A finished comparison's table for a terminal, and its legend.

    Every cell is ``mean ± 95% interval`` over the seeds that completed (``mean [low, high]``
    where a physical bound clipped the interval); ``used`` counts them (``2/3``). Strategy labels
    are shown whole, as the comparison names them.
    """
    t = pd.read_csv(out / "summary_by_strategy.csv")
    legend = [
        "cells: mean ± 95% interval over the seeds that completed ([low, high]: clipped at a physical bound); "
        "used: seeds completed / run"
    ]
    frame = pd.DataFrame({"fleet": t.fleet, "strategy": t.strategy})
    frame["used"] = [_used(row) for row in t.itertuples()]
    legend.append("used (fail, div, err): seeds failed, diverged, completed with client errors; in no mean")
    for key, header in (("lr", "lr"), ("bn_mode", "bn")):
        if key in t:
            frame[header] = t[key].fillna("").astype(str)
    untuned, edges = untuned_cells(out), edge_cells(out)
    if (untuned or edges) and "lr" in frame:
        frame["lr"] = [
            f"{lr} (untuned)" if (f, s) in untuned else f"{lr} ({edges[f, s]} edge)" if (f, s) in edges else lr
            for f, s, lr in zip(frame.fleet, frame.strategy, frame.lr)
        ]
    for stem, header, fmt in _SHOWN:
        if f"{stem}_mean" not in t:
            continue
        mean, ci = t[f"{stem}_mean"], t[f"{stem}_ci95"]
        low = t[f"{stem}_low"] if f"{stem}_low" in t else mean - ci
        high = t[f"{stem}_high"] if f"{stem}_high" in t else mean + ci
        if stem == "peak_memory_bytes":
            mean, ci, low, high, fmt = mean / 2**20, ci / 2**20, low / 2**20, high / 2**20, "{:.3g}"
        cells = [interval_text(*v, fmt) for v in zip(mean, ci, low, high)]
        if f"{_BANDS.get(stem)}_mean" in t:
            cells = with_band(t, stem, cells)
            legend += [] if BAND_LEGEND in legend else [BAND_LEGEND]
        if stem == "time_to_target_s":
            lower = t["time_to_target_s_is_lower_bound"].fillna(False).astype(bool)
            cells = [("≥" if lb else "") + c + f" ({n})" for c, lb, n in zip(cells, lower, t.reached_target)]
            legend.append(
                "t→target: (seeds that reached it); ≥: a lower bound, unreached seeds enter at their end time"
            )
        frame[header] = cells
    if "trained_nothing" in t:
        frame["trained nothing"] = [_idle_cell(row) for row in t.itertuples()]
        legend.append(
            "trained nothing: per device, the share of client-rounds (all seeds) with no training step, "
            "where above 0; !: more than half"
        )
    if (out / "tuning.csv").exists():
        legend.append("lr, bn: chosen per fleet and strategy on the validation split (grid scores: tuning.csv)")
    if edges:
        legend.append(
            "(top/bottom edge): the chosen lr is still at that edge of its grid after compare.tune.widen "
            "added all it allows: the best lr may lie beyond"
        )
    if untuned:
        legend.append(
            "(untuned): no tuning run of that cell completed; its seeds ran with the scenario's lr and bn_mode"
        )
    return frame, legend


def untuned_cells(out: Path) -> set[tuple[str, str]]:
    """The (fleet, strategy) cells of a tuned comparison with no chosen grid point (none completed):
    their seeds ran with the scenario's own lr and bn_mode, which no validation score chose."""
    if not (out / "tuning.csv").exists():
        return set()
    t = pd.read_csv(out / "tuning.csv")
    chosen = t.chosen.fillna(False).astype(bool).groupby([t.fleet, t.strategy]).any()
    return {key for key, any_chosen in chosen.items() if not any_chosen}


def edge_cells(out: Path) -> dict[tuple[str, str], str]:
    """(fleet, strategy) -> ``top`` / ``bottom`` for the cells of a tuned comparison whose chosen lr
    is still at that edge of its grid (tuning.csv)."""
    if not (out / "tuning.csv").exists():
        return {}
    t = pd.read_csv(out / "tuning.csv")
    if "edge" not in t:
        return {}
    rows = t[t.chosen.fillna(False).astype(bool) & t.edge.isin(["top", "bottom"])]
    return {(r.fleet, r.strategy): r.edge for r in rows.itertuples()}


def _idle_cell(row) -> str:
    """The devices of a cell that trained nothing in some client-round (``jetson_tx2 100%!``), or ``0%``."""
    text = row.trained_nothing if isinstance(row.trained_nothing, str) else ""
    flagged = set(row.idle_devices.split(", ")) if isinstance(row.idle_devices, str) else set()
    shown = [
        item + ("!" if item.rsplit(" ", 1)[0] in flagged else "")
        for item in text.split(", ")
        if item and item.rsplit(" ", 1)[-1] != "0%"
    ]
    return ", ".join(shown) or "0%"


def _used(row) -> str:
    """``2/3``, with the seeds left out counted: ``1/3 (1 fail, 1 div)``."""
    used = getattr(row, "used", None)
    if not isinstance(used, str):
        return f"{row.seeds}/{row.seeds}"
    counts = [
        (getattr(row, key, 0), name) for key, name in (("failed", "fail"), ("diverged", "div"), ("with_errors", "err"))
    ]
    left = ", ".join(f"{int(n)} {name}" for n, name in counts if n == n and n)
    return used + (f" ({left})" if left else "")


def not_used(out: Path) -> list[str]:
    """One line per seed of a comparison that did not complete (and so is in no mean)."""
    summary = pd.read_csv(out / "summary.csv")
    if "status" not in summary:
        return []
    bad = summary[summary.status.fillna("failed") != USED]
    return [
        f"{r.status}: {r.fleet} / {r.strategy} / seed {r.seed}" + (f" ({r.error})" if isinstance(r.error, str) else "")
        for r in bad.itertuples()
    ]


def seed_table(out: Path, metric: str = "final_accuracy") -> pd.DataFrame:
    """Per fleet and strategy, ``metric`` of every seed; a seed in no mean shows its status instead."""
    s = pd.read_csv(out / "summary.csv")
    status = s.status.fillna("failed") if "status" in s else pd.Series(USED, index=s.index)
    value = s[metric] if metric in s else pd.Series(float("nan"), index=s.index)
    s["shown"] = [f"{v:.3f}" if st == USED else str(st) for v, st in zip(value, status)]
    wide = s.pivot_table(index=["fleet", "strategy"], columns="seed", values="shown", aggfunc="first", sort=False)
    wide.columns = [f"seed {c}" for c in wide.columns]
    return wide.fillna("").reset_index()


def differences_table(out: Path) -> tuple[pd.DataFrame, list[str]]:
    """A finished comparison's paired differences in final accuracy (differences.csv) for a terminal, and its legend."""
    d = pd.read_csv(out / "differences.csv")
    tests = int(d.p.notna().sum())
    frame = pd.DataFrame({"fleet": d.fleet, "a − b": d.a + " − " + d.b, "seeds": d.seeds})
    frame["difference"] = d.mean_diff.map("{:+.3f}".format)
    frame["p"] = d.p.map("{:.3g}".format)
    frame["p Holm"] = d.p_holm.map("{:.3g}".format)
    frame["significant"] = d.significant.map({True: "yes", False: "no"})
    frame["detectable"] = d.detectable.map("{:.3f}".format)
    legend = [
        f"difference: mean over the seeds both completed of a − b in final accuracy; p: two-sided paired t-test; "
        f"p Holm: Holm-Bonferroni over the {tests} pairs; significant: p Holm < {ALPHA:g}",
        f"detectable: the smallest true difference this design (its seeds, the pair's spread over them) "
        f"detects with power 0.8 at level {ALPHA:g}/{tests}; a smaller one is no evidence of equality",
    ]
    return frame, legend
