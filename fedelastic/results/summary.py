"""The terminal summary of a run: its figure, and one table of its devices' time, energy, memory and accuracy."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..devices.units import fmt_bytes
from ..errors import FedelasticError
from ..sim.columns import ClientCol as C
from ..sim.columns import RoundCol as R
from . import idle

console = Console(width=None if sys.stdout.isatty() else 160)



def report(run_dir: Path) -> None:
    """Write the figure and print the summary table of a finished (or partial, or empty) run."""

    from .recorder import read_status

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FedelasticError(f"{run_dir}: no such run folder")
    if read_status(run_dir)["status"] == "unreadable":
        raise FedelasticError(f"{run_dir / 'status.json'}: {read_status(run_dir)['error']}")
    if not (run_dir / "rounds.parquet").exists():
        raise FedelasticError(f"{run_dir}: no results yet (no rounds.parquet; status: {read_status(run_dir)['status']})")
    rounds, clients = write_figures(run_dir)
    status = read_status(run_dir)
    last = rounds.iloc[-1]
    evaluated = rounds[R.TEST_ACCURACY].dropna()  # the last evaluated round's (server.evaluate_every)
    accuracy = evaluated.iloc[-1] if len(evaluated) else float("nan")
    table = Table(
        title=escape(
            f"{run_dir}  ({status['status']}; final accuracy {accuracy:.3f}, simulated {last[R.SIM_TIME_S]:.1f} s"
            + (f" ±{rounds[R.ROUND_TIME_BAND_S].sum():.2g} s" if R.ROUND_TIME_BAND_S in rounds else "")
            + ")"
        )
    )
    for col in (
        "device",
        "client-rounds",
        "fits",
        "trained nothing",
        "failed",
        "train time/round",
        "energy/round (no idle)",
        "peak memory",
        "device memory",
        "trained params",
    ):
        table.add_column(col, justify="right", overflow="fold", no_wrap=col == "device")  # names whole
    nothing = idle.by_device(clients)
    for device, g in clients.groupby(C.DEVICE) if len(clients) else ():
        table.add_row(
            escape(str(device)),
            str(len(g)),
            f"{g[C.FITS].mean():.0%}",
            f"{idle.percent(nothing.share[device])} ({nothing.trained_nothing[device]})",
            str(int(_failed(g))),
            f"{g[C.EMULATED_TRAIN_TIME_S].mean():.3g} s"
            + (
                f" ±{g[C.EMULATED_TRAIN_TIME_BAND_S].mean() / g[C.EMULATED_TRAIN_TIME_S].mean():.0%}"
                if C.EMULATED_TRAIN_TIME_BAND_S in g and g[C.EMULATED_TRAIN_TIME_BAND_S].mean() > 0
                else ""
            ),
            f"{g[C.EMULATED_ENERGY_J].mean():.3g} J",
            fmt_bytes(g[C.EMULATED_PEAK_MEMORY_BYTES].max()),
            fmt_bytes(g[C.DEVICE_MEMORY_BYTES].iloc[0]),
            f"{g[C.FRACTION_PARAMS_TRAINED].mean():.0%}",
        )
    console.print(table)
    for line in idle.lines(nothing).values():  # a device that idled is named with why, under its table
        console.print(f"  {line}", markup=False, highlight=False)
    for message, count in status.get("errors", {}).items():
        console.print(f"  {count} x {message}", markup=False, highlight=False)
    if status.get("empty_rounds"):
        console.print(f"  rounds in which no client trained: {status['empty_rounds']}", markup=False)
    if status.get("clients_rejected"):
        console.print(
            f"  client results rejected (non-finite updates, charged, not used): {status['clients_rejected']}",
            markup=False,
        )
    if status.get("divergence"):
        d = status["divergence"]
        console.print(
            f"  diverged in round {d.get('round')}: {d.get('reason')}", markup=False, highlight=False, soft_wrap=True
        )
    console.print(
        f"results: {run_dir}/{{clients,rounds}}.{{csv,parquet}}, figure: {run_dir}/accuracy_vs_time.png",
        markup=False,
        highlight=False,
    )


def write_figures(run_dir: Path):
    """Write a run folder's ``accuracy_vs_time.png`` (and a continual run's figures and summaries);
    returns its rounds and clients tables."""
    import pandas as pd

    from .recorder import plot_accuracy

    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    clients_path = run_dir / "clients.parquet"
    clients = pd.read_parquet(clients_path) if clients_path.exists() else pd.DataFrame()
    plot_accuracy(rounds, clients, run_dir / "accuracy_vs_time.png")
    if (run_dir / "tasks.parquet").exists():  # a continual run: its accuracy matrix, summaries and figure
        from .continual import report as continual_report

        continual_report(run_dir)
    return rounds, clients


def _failed(g) -> int:
    """Client rows that carry an error (an empty or missing error reads back as '' or NaN), rejected updates aside."""
    from ..sim.records import REJECTED

    if C.ERROR not in g:
        return 0
    failed = g[C.ERROR].notna() & (g[C.ERROR].astype(str) != "")
    if C.STATUS in g:
        failed &= g[C.STATUS] != REJECTED
    return int(failed.sum())
