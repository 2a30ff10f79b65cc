"""The ``fedelastic`` command line."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import FedelasticError

console = Console(width=None if sys.stdout.isatty() else 160)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def report(run_dir: Path) -> None:
    """Write the figure and print the summary table of a finished (or partial) run."""
    import pandas as pd

    from .results import plot_accuracy

    rounds, clients = pd.read_parquet(run_dir / "rounds.parquet"), pd.read_parquet(run_dir / "clients.parquet")
    plot_accuracy(rounds, clients, run_dir / "accuracy_vs_time.png")
    table = Table(
        title=f"{run_dir}  (final accuracy {rounds.test_accuracy.iloc[-1]:.3f}, simulated {rounds.sim_time_s.iloc[-1]:.1f} s)"
    )
    for col in (
        "device",
        "clients",
        "fits",
        "train time/round",
        "energy/round",
        "peak memory",
        "device memory",
        "trained params",
    ):
        table.add_column(col, justify="right")
    for device, g in clients.groupby("device"):
        table.add_row(
            str(device),
            str(g.partition_id.nunique()),
            f"{g.fits.mean():.0%}",
            f"{g.emulated_train_time_s.mean():.3g} s",
            f"{g.emulated_energy_j.mean():.3g} J",
            _fmt_bytes(g.emulated_peak_memory_bytes.max()),
            _fmt_bytes(g.device_memory_bytes.iloc[0]),
            f"{g.fraction_params_trained.mean():.0%}",
        )
    console.print(table)
    console.print(f"results: {run_dir}/{{clients,rounds}}.{{csv,parquet}}, figure: {run_dir}/accuracy_vs_time.png")


def cmd_run(args) -> None:
    from .fl.runner import run_scenario
    from .scenario import load_scenario

    sc = load_scenario(args.scenario)
    if args.rounds:
        sc = replace(sc, server=replace(sc.server, rounds=args.rounds))
    if args.backend:
        sc = replace(sc, simulation=replace(sc.simulation, backend=args.backend))
    if args.output_dir:
        sc = replace(sc, output_dir=args.output_dir)
    console.print(
        f"[bold]{sc.name}[/]: {sc.num_clients} clients ({', '.join(f'{n}x {d}' for d, n in sc.fleet.items())}), "
        f"strategy {sc.train.strategy}, {sc.server.rounds} rounds, backend {sc.simulation.backend}"
    )

    def progress(row: dict) -> None:
        r = row["round"]
        head = "initial" if r == 0 else f"round {r}/{sc.server.rounds}"
        console.print(
            f"{head:>12}  accuracy {row['test_accuracy']:.3f}  simulated {row['sim_time_s']:9.2f} s  "
            f"energy {row['total_energy_j']:9.1f} J  not fitting {row['clients_not_fitting']}  host {row['host_wall_s']:.2f} s"
        )

    run_dir = run_scenario(sc, run_id=args.run_id, progress=progress)
    report(run_dir)


def cmd_compare(args) -> None:
    from .compare import mean_table, run_comparison

    out = run_comparison(args.scenario, output=args.output, backend=args.backend, rounds=args.rounds)
    table = Table(title=f"comparison (means over seeds): {out}")
    frame = mean_table(out)
    for col in frame.columns:
        table.add_column(col, justify="right")
    for row in frame.itertuples(index=False):
        table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row))
    console.print(table)
    console.print(f"tables: {out}/summary*.csv, {out}/runs.csv; figure: {out}/comparison.png")


def cmd_devices(args) -> None:
    from .devices import load_profile, profile_paths

    if args.action == "list":
        table = Table(title="device profiles")
        for col in ("name", "class", "dtype", "peak", "bandwidth", "train memory", "train power"):
            table.add_column(col)
        for name, path in profile_paths(tuple(args.dir)).items():
            p = load_profile(path)
            table.add_row(
                name,
                p.device_class,
                p.train_dtype,
                f"{p.peak_flops.value / 1e9:.3g} G/s",
                f"{p.mem_bandwidth_bytes_per_s.value / 1e9:.3g} GB/s",
                _fmt_bytes(p.memory_train_bytes.value),
                f"{p.power_train_w.value:.3g} W",
            )
        console.print(table)
    elif args.action == "show":
        from .devices import get_profile

        p = get_profile(args.target, tuple(args.dir), context="<command line>")
        console.print(
            f"[bold]{p.name}[/] ({p.display_name}), class {p.device_class}, trains in {p.train_dtype}: {p.path}"
        )
        for key, value in vars(p).items():
            if hasattr(value, "source"):
                console.print(f"  {key:28} {value.value:<12.4g} {value.source}")
        for model, table in p.measured.items():
            console.print(
                f"  measured table {model}: {len(table.layers)} layers at batch {table.batch_size} ({table.source})"
            )
        if p.notes:
            console.print(f"  notes: {p.notes}")
    else:
        p = load_profile(args.target)
        console.print(f"{args.target}: valid profile '{p.name}' (schema v1)")


def cmd_strategies(args) -> None:
    import dataclasses

    from .selection import REGISTRY, available

    for name in available():
        cls = REGISTRY[name]
        opts = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.config_cls))
        doc = cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ""
        console.print(escape(f"{name:16} {doc}  [{opts}]"))


def cmd_pretrain(args) -> None:
    from .fl.env import environment
    from .pretrain import initial_state
    from .scenario import load_scenario

    sc = load_scenario(args.scenario)
    if sc.model.pretrain is None:
        raise FedelasticError(f"{args.scenario}: key 'model.pretrain': expected a [model.pretrain] table to pretrain")
    initial_state(environment(sc))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedelastic", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a scenario file")
    run.add_argument("scenario")
    run.add_argument("--rounds", type=int, help="override server.rounds")
    run.add_argument("--backend", choices=["ray", "inprocess"], help="override simulation.backend")
    run.add_argument("--output-dir", help="override output_dir")
    run.add_argument("--run-id", help="name of the run folder (default: a timestamp)")
    run.set_defaults(fn=cmd_run)
    cmp = sub.add_parser("compare", help="run a comparison scenario (strategies x fleets x seeds)")
    cmp.add_argument("scenario")
    cmp.add_argument("--rounds", type=int, help="override server.rounds")
    cmp.add_argument("--backend", choices=["ray", "inprocess"], help="override simulation.backend")
    cmp.add_argument("--output", type=Path, help="comparison folder (default: under the scenario's output_dir)")
    cmp.set_defaults(fn=cmd_compare)
    rep = sub.add_parser("report", help="summarise a run folder")
    rep.add_argument("run_dir", type=Path)
    rep.set_defaults(fn=lambda a: report(a.run_dir))
    dev = sub.add_parser("devices", help="list, show or validate device profiles")
    dev.add_argument("action", choices=["list", "show", "validate"])
    dev.add_argument("target", nargs="?", help="device name (show) or profile file (validate)")
    dev.add_argument("--dir", action="append", default=[], help="extra profile folder")
    dev.set_defaults(fn=cmd_devices)
    st = sub.add_parser("strategies", help="list the registered selection strategies")
    st.set_defaults(fn=cmd_strategies)
    pre = sub.add_parser("pretrain", help="pretrain (and cache) a scenario's starting weights")
    pre.add_argument("scenario")
    pre.set_defaults(fn=cmd_pretrain)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "devices" and args.action != "list" and not args.target:
        parser.error(f"devices {args.action} needs a target")
    try:
        args.fn(args)
    except FedelasticError as exc:
        console.print(f"[red]error:[/] {exc}", highlight=False)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
