"""The Python API: run scenarios and comparisons from a notebook and get DataFrames back.

    import fedelastic as fe

    result = fe.run("simulations/quickstart.toml", server__rounds=3, train__lr=0.01)
    result.rounds          # one row per round (pandas)
    result.clients         # one row per client per round
    result.plot()          # accuracy against simulated time

Overrides name a scenario key with its dotted path: ``train__lr=0.01`` as a keyword, or
``overrides={"train.lr": 0.01}``; ``parse_overrides(["train.lr=0.01"])`` reads the command-line
form, with values typed as TOML. An override goes through the same validation as a file, so a
wrong key or type is a :class:`~fedelastic.errors.ConfigError` naming it.
"""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import read_toml, to_dict
from .errors import ConfigError
from .scenario import Scenario, parse_scenario, without_recorded

if TYPE_CHECKING:
    import pandas as pd


def parse_overrides(items: Iterable[str], src: str = "<overrides>") -> dict[str, Any]:
    """``["train.lr=0.01", "name='x'"]`` -> ``{"train.lr": 0.01, "name": "x"}``; values are TOML.

    A value that is not valid TOML (``train.strategy=full``) is kept as a string.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(src, item, "key=value (e.g. train.lr=0.01)")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value
    return out


def apply_overrides(raw: dict, overrides: Mapping[str, Any], src: str = "<overrides>") -> dict:
    """A copy of the scenario dict ``raw`` with each dotted key set."""
    raw = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        *path, last = dotted.split(".")
        table = raw
        for i, part in enumerate(path):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(src, ".".join(path[: i + 1]), "a table to set a key in", table)
        table[last] = value
    return raw


def _scenario_dict(scenario: Scenario | str | Path | Mapping) -> tuple[dict, str]:
    if not isinstance(scenario, (Scenario, str, os.PathLike, Mapping)):
        raise ConfigError("<scenario>", "scenario", "a Scenario, a TOML file path or a dict", type(scenario).__name__)
    if isinstance(scenario, Scenario):
        raw = to_dict(scenario)
        src = raw.pop("source", "") or "<scenario>"
        return raw, src
    if isinstance(scenario, Mapping):
        return without_recorded(dict(scenario), "<scenario>"), "<scenario>"
    return without_recorded(read_toml(scenario, "scenario"), str(scenario)), str(scenario)


def load(
    scenario: Scenario | str | Path | Mapping,
    overrides: Mapping[str, Any] | None = None,
    *,
    resolve: bool = True,
    **kw: Any,
) -> Scenario:
    """A validated :class:`Scenario` from an object, a file or a dict, with overrides applied
    (``resolve=False``: type-checked only, no user code run; see :func:`~.scenario.parse_scenario`)."""
    raw, src = _scenario_dict(scenario)
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError("<overrides>", "overrides", "a dict of dotted scenario keys", type(overrides).__name__)
    for key in overrides or {}:
        if not isinstance(key, str):
            raise ConfigError("<overrides>", repr(key), "a dotted scenario key (a string, e.g. 'train.lr')")
    dotted = {**(overrides or {}), **{k.replace("__", "."): v for k, v in kw.items()}}
    return parse_scenario(apply_overrides(raw, dotted, src), src, resolve=resolve)


@dataclass
class RunResult:
    """A finished run, read back from its folder (so a partial or earlier run works the same)."""

    run_dir: Path

    @cached_property
    def rounds(self) -> pd.DataFrame:
        import pandas as pd

        return pd.read_parquet(self.run_dir / "rounds.parquet")

    @cached_property
    def clients(self) -> pd.DataFrame:
        import pandas as pd

        return pd.read_parquet(self.run_dir / "clients.parquet")

    @property
    def status(self) -> dict:
        """status.json: 'completed', 'completed_with_errors' (with counts), 'diverged' (with its round and reason), 'failed', or 'dead' for a killed run."""
        from .results.recorder import read_status

        return read_status(self.run_dir)

    def plot(self, path: str | Path | None = None) -> Path:
        """Draw accuracy against simulated time and per-device train time; returns the PNG's path."""
        from .results.recorder import plot_accuracy

        out = Path(path) if path else self.run_dir / "accuracy_vs_time.png"
        plot_accuracy(self.rounds, self.clients, out)
        return out


def stop_at_accuracy(target: float) -> Callable[[dict], bool]:
    """A callback that stops the run at the first round whose test accuracy reaches ``target``."""
    from .sim.callbacks import StopAtAccuracy

    return StopAtAccuracy(target)


def run(
    scenario: Scenario | str | Path | Mapping,
    *,
    overrides: Mapping[str, Any] | None = None,
    run_id: str | None = None,
    progress: Callable[[dict], None] | None = None,
    callbacks: Sequence[Callable[[dict], Any]] = (),
    **kw: Any,
) -> RunResult:
    """Run a scenario (object, TOML path or dict) and return its results.

    ``progress(row)`` is called with each round's row as the round ends (its rows reach disk while
    a later round trains, within ``simulation.write_every_s``, and all of them before ``run`` returns). Each of ``callbacks``
    is called the same way (log to TensorBoard, W&B, ...); one that returns a true value stops
    the run after that round (early stopping, e.g. :func:`stop_at_accuracy`): the round is kept,
    the run ends normally and its status records ``stopped_after_round``. A callback may also be an
    object with ``on_run_start(run)``, ``on_round_end(end) -> (stop, columns)`` (or a bare ``stop``;
    the columns join ``rounds.csv``) and ``on_run_end(run, outcome)`` (:class:`fedelastic.sim.callbacks.Callback`).

    The run takes the path ``fedelastic run`` takes (:func:`fedelastic.orchestrate.run`): its folder
    is checked before a model file the scenario names is imported.
    """
    from . import orchestrate
    from .sim.callbacks import CallbackList

    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
        raise ConfigError("<callbacks>", "callbacks", "a list of callbacks", callbacks)
    on_round = CallbackList([progress, *callbacks])  # every callback sees every round
    return RunResult(orchestrate.run(load(scenario, overrides, resolve=False, **kw), run_id=run_id, progress=on_round))


@dataclass
class ComparisonResult:
    """A finished comparison: its tables as DataFrames."""

    folder: Path
    _cache: dict = field(default_factory=dict, repr=False)

    def _read(self, name: str) -> pd.DataFrame:
        if name not in self._cache:
            import pandas as pd

            self._cache[name] = pd.read_csv(self.folder / f"{name}.csv")
        return self._cache[name]

    @property
    def summary(self) -> pd.DataFrame:
        """One row per run."""
        return self._read("summary")

    @property
    def by_strategy(self) -> pd.DataFrame:
        """Per fleet and strategy: mean and 95% interval over the seeds that completed."""
        return self._read("summary_by_strategy")

    @property
    def runs(self) -> pd.DataFrame:
        """One row per run and round."""
        return self._read("runs")


def compare(
    path: str | Path,
    *,
    output: str | Path | None = None,
    backend: str | None = None,
    rounds: int | None = None,
    resume: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    seeds: Sequence[int] | None = None,
    strategies: Sequence[Any] | None = None,
    fleets: Mapping[str, Mapping[str, int]] | None = None,
    **kw: Any,
) -> ComparisonResult:
    """Run a comparison file (a scenario with a ``[compare]`` table); ``resume``: an interrupted one's folder.

    Overrides as :func:`run` takes them: ``overrides={"train.lr": 0.1, "compare.seeds": [0, 1]}``
    and keywords (``train__lr=0.1``); ``seeds``, ``strategies`` and ``fleets`` set
    ``compare.seeds``, ``compare.strategies`` and ``compare.fleets``. Resuming, give the same ones.

    Seeds that did not complete are in no mean: ``result.summary.status`` says which, and
    ``result.by_strategy.used`` counts the seeds used (``2/3``).
    """
    from .comparisons.comparison import run_comparison

    named = {f"compare.{k}": v for k, v in (("seeds", seeds), ("strategies", strategies), ("fleets", fleets))}
    dotted = {**(overrides or {}), **{k: v for k, v in named.items() if v is not None}}
    raw = None
    if dotted or kw:
        for key in dotted:
            if not isinstance(key, str):
                raise ConfigError("<overrides>", repr(key), "a dotted scenario key (a string, e.g. 'train.lr')")
        dotted = {**dotted, **{k.replace("__", "."): v for k, v in kw.items()}}
        raw = apply_overrides(read_toml(path, "scenario"), {k: _plain(v) for k, v in dotted.items()}, str(path))
    return ComparisonResult(
        run_comparison(
            path, output=Path(output) if output else None, backend=backend, rounds=rounds,
            resume=Path(resume) if resume else None, overrides=raw,
        )  # fmt: skip
    )


def _plain(value: Any) -> Any:
    """Tuples and mappings as the lists and dicts a TOML file would give."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
