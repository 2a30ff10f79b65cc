"""The ``fedelastic`` command line."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import ConfigError, FedelasticError, RunFailed, Terminated
from .results.summary import console, report

if TYPE_CHECKING:
    from .scenario import Scenario


def cmd_report(args) -> None:
    if args.html:
        from .comparisons.report import write_html

        console.print(f"report: {write_html(args.run_dir)}")
    if not args.html or (args.run_dir / "rounds.parquet").exists():
        report(args.run_dir)


def _override(key: str, build):
    """Apply a command-line override; a bad value is a one-line error naming the flag."""
    try:
        return build()
    except ValueError as exc:
        raise ConfigError("<command line>", key, str(exc).partition(": ")[2] or str(exc)) from None


def exit_code(run_dir: Path) -> int:
    """0 completed (or errors within simulation.max_failure_rate), 3 errors above it, 4 diverged, 1 failed."""
    from .results.recorder import read_status

    status = read_status(run_dir)
    if status["status"] == "completed":
        return 0
    if status["status"] == "completed_with_errors":
        n, total = status.get("clients_failed", 0), status.get("client_results", 0)
        empty = status.get("empty_rounds", [])
        where = [f"{run_dir}/errors.log"] if (run_dir / "errors.log").exists() else []  # only client errors write it
        if empty:
            where.append("the summary's 'trained nothing' reasons (simulation.allow_empty_rounds = true accepts such rounds)")
        console.print(
            f"completed with errors: {n} of {total} client results failed, {status.get('clients_rejected', 0)} "
            f"rejected (non-finite), {len(empty)} round(s) with no client trained"
            + (f" ({_rounds_text(empty)})" if empty else "")
            + f" (simulation.max_failure_rate = {status.get('max_failure_rate', 0):g})"
            + (f"; details in {' and '.join(where)}" if where else ""),
            markup=False,
            highlight=False,
        )
        return 3 if status.get("over_threshold") else 0
    if status["status"] == "diverged":
        d = status.get("divergence", {})
        console.print(
            f"diverged in round {d.get('round')}: {d.get('reason')}; most likely at fault: "
            f"{d.get('advice') or 'train.lr'} (docs/reference/status.md, Divergence)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return 4
    return 1


def _rounds_text(rounds: list[int]) -> str:
    """``rounds 7-11, 19``: runs of consecutive rounds joined."""
    spans: list[list[int]] = []
    for r in sorted(rounds):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)
    return ("rounds " if len(rounds) > 1 else "round ") + text


def skip_final_gc() -> None:
    """At interpreter exit, skip the garbage collector's last passes over every object torch,
    Flower and Ray made (about a second on a small machine). The command has closed
    its files by then; this is for the ``fedelastic`` process only, never the Python API."""
    import atexit
    import gc

    if gc.freeze not in _AT_EXIT:
        _AT_EXIT.append(gc.freeze)
        atexit.register(gc.freeze)  # registered last, so run first: Ray's own shutdown hook still runs


_AT_EXIT: list = []


def cmd_run(args) -> int:
    from . import orchestrate

    if (args.scenario is None) == (args.resume is None):
        raise ConfigError("<command line>", "scenario", "a scenario file, or --resume RUN_DIR (not both)")
    if args.resume is not None:
        if args.rounds is not None or args.backend or args.output_dir or args.run_id or args.overrides:
            raise ConfigError("<command line>", "--resume", "no other options (a run resumes with its own config)")
        run_dir = orchestrate.resume(args.resume, progress=_print_round)
    else:
        run_dir = orchestrate.run(_scenario(args), run_id=args.run_id, progress=_print_round, on_start=_print_header)
    skip_final_gc()
    try:
        report(run_dir)
    except Exception as exc:  # noqa: BLE001 (the run is finished and on disk; a report failure must not hide it)
        console.print(f"warning: the report failed ({type(exc).__name__}: {exc}); results are in {run_dir}", markup=False)
    return exit_code(run_dir)


def _scenario(args) -> Scenario:
    """The scenario file with the command line's overrides applied, type-checked (not yet validated:
    the run checks its folder before it imports a model file the scenario names)."""
    from .scenario import load_scenario

    if args.overrides:
        from .api import load, parse_overrides

        sc = load(args.scenario, parse_overrides(args.overrides, "<command line>"), resolve=False)
    else:
        sc = load_scenario(args.scenario, resolve=False)
    if args.rounds is not None:
        sc = _override("--rounds", lambda: replace(sc, server=replace(sc.server, rounds=args.rounds)))
    if args.backend:
        sc = replace(sc, simulation=replace(sc.simulation, backend=args.backend))
    if args.output_dir is not None:
        sc = _override("--output-dir", lambda: replace(sc, output_dir=args.output_dir))
    return sc


def _print_header(sc: Scenario) -> None:
    """The run's header line: its fleet, strategy, rounds and backend."""
    console.print(
        f"{sc.name}: {sc.num_clients} clients ({', '.join(f'{n}x {d}' for d, n in sc.fleet.items())}), "
        f"strategy {sc.train.strategy}, {sc.server.rounds} rounds, backend {sc.simulation.backend}",
        markup=False,
        highlight=False,
    )


def _print_round(row: dict) -> None:
    """One line per round: accuracy, simulated time, energy, client counts, host time."""
    from .sim.columns import RoundCol as R

    r = row[R.ROUND]
    head = "initial" if r == 0 else f"round {r}"
    acc = row[R.TEST_ACCURACY]
    console.print(
        f"{head:>12}  accuracy {'  -  ' if acc != acc else f'{acc:.3f}'}  simulated {row[R.SIM_TIME_S]:9.2f} s  "
        f"energy {row[R.TOTAL_ENERGY_J]:9.1f} J  failed {row[R.CLIENTS_FAILED]}  not fitting {row[R.CLIENTS_NOT_FITTING]}  "
        f"rejected {row.get(R.CLIENTS_REJECTED, 0)}  trained nothing {row.get(R.CLIENTS_NO_STEPS, 0)}  "
        f"host {row[R.HOST_WALL_S]:.2f} s" + (f"  diverged: {row[R.DIVERGENCE]}" if row.get(R.DIVERGENCE) else ""),
        markup=False,
        highlight=False,
    )


_WHOLE = ("fleet", "strategy", "used", "lr", "bn")  # columns of the comparison table shown uncut


def cmd_compare(args) -> int:
    """Run a comparison and print its table; exits 4 if a seed diverged, 3 if one did not complete, else 0."""
    import pandas as pd

    from .comparisons.comparison import exit_code, mean_table, not_used, run_comparison
    from .results.idle import verdicts as idle_verdicts

    if args.rounds is not None and args.rounds < 1:
        raise ConfigError("<command line>", "--rounds", "an integer >= 1", args.rounds)
    raw = None
    if args.overrides:  # KEY=VALUE, as `run` takes them (compare.seeds=[0, 1] too); resuming, give the same
        from .api import apply_overrides, parse_overrides
        from .config import read_toml

        raw = apply_overrides(
            read_toml(args.scenario, "scenario"), parse_overrides(args.overrides, "<command line>"), "<command line>"
        )
    out = run_comparison(
        args.scenario, output=args.output, backend=args.backend, rounds=args.rounds, resume=args.resume, overrides=raw
    )
    frame, legend = mean_table(out)
    table = Table(title=f"comparison: {out}")
    for col in frame.columns:  # labels, seeds used, lr and bn are never cut; intervals wrap if they must
        width = max([len(col), *(len(str(v)) for v in frame[col])]) if col in _WHOLE else None
        table.add_column(col, justify="right", no_wrap=width is not None, min_width=width, overflow="fold")
    for row in frame.itertuples(index=False):
        table.add_row(*map(str, row))
    console.print(table)
    for line in legend:
        console.print(line, markup=False)
    for line in idle_verdicts(pd.read_csv(out / "summary_by_strategy.csv")):
        console.print(f"! {line}", markup=False, highlight=False)
    tuning = f", {out}/tuning.csv" if (out / "tuning.csv").exists() else ""
    console.print(f"tables: {out}/summary*.csv, {out}/runs.csv{tuning}; figure: {out}/comparison.png", markup=False)
    _print_statistics(out)
    lines = not_used(out)
    for line in lines:
        console.print(f"  {line}", markup=False, highlight=False)
    code = exit_code(pd.read_csv(out / "summary.csv"))
    if code:
        console.print(
            f"{len(lines)} seed(s) did not complete and are in no mean (exit code {code}; see docs/howto/compare-strategies.md)",
            markup=False,
            highlight=False,
        )
    return code


def _print_statistics(out) -> None:
    """A comparison's final accuracy per seed, its paired differences and its lr-grid warnings."""
    from .comparisons.comparison import differences_table, edge_warnings, seed_table

    frames = [(f"final accuracy per seed: {out}/summary.csv", seed_table(out), [])]
    if (out / "differences.csv").exists():
        frames.append((f"paired differences: {out}/differences.csv", *differences_table(out)))
    for title, frame, legend in frames:
        table = Table(title=title)
        for col in frame.columns:
            table.add_column(col, justify="right", no_wrap=True)
        for row in frame.itertuples(index=False):
            table.add_row(*map(str, row))
        console.print(table)
        for line in legend:
            console.print(line, markup=False)
    for line in edge_warnings(out):
        console.print(f"warning: {line}", markup=False, highlight=False)


def cmd_devices(args) -> None:
    from .devices.profile import load_profile, profile_paths

    if args.action == "list":
        from .devices.units import fmt_bytes, si

        table = Table(title="device profiles")
        for col in ("name", "class", "dtype", "peak", "bandwidth", "train memory", "train power"):
            table.add_column(col, no_wrap=True)
        for name, path in profile_paths(tuple(args.dir)).items():
            p = load_profile(path)
            table.add_row(
                name,
                p.device_class,
                p.train_dtype,
                si(p.peak_flops.value, "OP/s" if p.train_dtype == "int8" else "FLOP/s"),
                si(p.mem_bandwidth_bytes_per_s.value, "B/s"),
                fmt_bytes(p.memory_train_bytes.value),
                f"{p.power_train_w.value:.3g} W",
            )
        console.print(table)
    elif args.action == "show":
        from .devices.profile import get_profile

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


def _options_table(title: str, rows: list[tuple[str, ...]], columns=("option", "type", "default", "help")) -> Table:
    """A table of options: name, type, default(, help), folded, never cut."""
    table = Table(title=escape(title), title_justify="left")
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*(escape(x) for x in row))
    return table


def cmd_strategies(args) -> None:
    import dataclasses
    import inspect

    from .errors import ConfigError as _ConfigError
    from .selection.strategy import REGISTRY, available

    if args.name is None:
        for name in available():
            cls = REGISTRY[name]
            opts = ", ".join(f"{f.name}={f.default!r}" for f in dataclasses.fields(cls.config_cls))
            doc = cls.__doc__.strip().splitlines()[0] if cls.__doc__ else ""
            console.print(escape(f"{name:16} {doc}  [{opts}]"))
        if available():
            console.print("details of one strategy: fedelastic strategies NAME", markup=False)
        return
    if args.name not in available():
        raise _ConfigError("<command line>", "strategies NAME", f"a registered strategy, one of {available()}", args.name)
    cls = REGISTRY[args.name]
    rows = []
    for f in dataclasses.fields(cls.config_cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)"
        )  # fmt: skip
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        rows.append((f.name, str(kind), repr(default), str(f.metadata.get("help", ""))))
    doc = inspect.cleandoc(cls.__doc__ or "").split("\n\n")[0]
    console.print(escape(f"{args.name}: {doc}"), highlight=False)
    console.print(_options_table(f"options (train.options.*) of {args.name}", rows))


def cmd_models(args) -> None:
    import inspect

    from .models import BUILTIN, resolve_factory

    for name in BUILTIN:
        factory = resolve_factory(name, context="<command line>")
        doc = inspect.cleandoc(factory.__doc__ or "").split("\n")[0]
        rows = []
        for p in inspect.signature(factory).parameters.values():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            default = "(set by the scenario)" if p.name in ("num_classes", "in_channels", "input_size") else (
                repr(p.default) if p.default is not p.empty else "(required)"
            )  # fmt: skip
            kind = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
            rows.append((p.name, "" if p.annotation is p.empty else str(kind), default))
        console.print(_options_table(f"{name}: {doc}", rows, ("model.options", "type", "default")))
    console.print(
        "model.options are passed to the factory; your own model: model.name = 'package.module:callable' "
        "(importable: PYTHONPATH=. or an installed package) or 'path/to/file.py:callable'",
        markup=False,
        highlight=False,
    )


def cmd_pretrain(args) -> None:
    from .environment import environment
    from .scenario import load_scenario
    from .train.pretrain import initial_state

    sc = load_scenario(args.scenario)
    if sc.model.pretrain is None:
        raise FedelasticError(f"{args.scenario}: key 'model.pretrain': expected a [model.pretrain] table to pretrain")
    initial_state(environment(sc))


def cmd_profile(args) -> None:
    from .profiling.commands import import_trace_into, measure_profile

    progress = Console(stderr=True)  # stdout may carry the TOML table

    def say(msg: str) -> None:
        progress.print(f"  {msg}", highlight=False, markup=False)

    try:
        if args.action == "measure":
            options = dict(kv.split("=", 1) for kv in args.option)
            options = {k: float(v) if v.replace(".", "", 1).isdigit() else v for k, v in options.items()}
            options = {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in options.items()}
            profile, fit, table = measure_profile(
                args.model,
                args.out,
                sample_seconds=args.sample_minutes * 60 if args.kernel_samples else 0.0,
                save_samples=args.save_samples,
                batch_size=args.batch_size,
                input_size=args.input_size,
                num_classes=args.num_classes,
                in_channels=args.in_channels,
                name=args.name,
                repeats=args.repeats,
                warmup=args.warmup,
                threads=args.threads,
                clock=args.clock,
                like=args.like,
                device_class=args.device_class,
                model_options=options,
                progress=say,
            )
            console.print(
                f"[bold]{profile.name}[/]: step {table.step_s * 1e3:.1f} ms (forward {table.forward_s * 1e3:.1f}, "
                f"backward {table.backward_s * 1e3:.1f}, optimizer {table.other_s * 1e3:.1f}) at batch {table.batch_size}; "
                f"fitted peak x efficiency {fit.peak_eff / 1e9:.3g} GFLOP/s, bandwidth {fit.mem_bandwidth / 1e9:.3g} GB/s, "
                f"launch {fit.launch_overhead * 1e6:.3g} us (median layer error {fit.median_rel_err:.0%}); "
                f"written to {args.out}",
                highlight=False,
            )
            return
        table, raw, fit = import_trace_into(
            args.file,
            model=args.model,
            batch_size=args.batch_size,
            profile=args.profile,
            fit=args.fit,
            input_size=args.input_size,
            num_classes=args.num_classes,
            source=args.source,
            progress=say,
        )
    except (ValueError, OSError) as exc:
        raise FedelasticError(f"profile {args.action}: {exc}") from None
    if args.profile is None:
        from .profiling.writer import dumps_profile

        console.print(dumps_profile(raw), end="", highlight=False, markup=False, soft_wrap=True)
        return
    console.print(
        f"{args.profile}: [measured.{args.model}] written ({len(table.layers)} layers), profile valid",
        markup=False,
        highlight=False,
    )
    if fit is not None:
        c = raw["compute"]
        console.print(
            f"  refitted on {', '.join(fit.models)}: efficiency {c['efficiency']['value']}, launch_overhead "
            f"{c['launch_overhead']['value']} us, mem_bandwidth {c['mem_bandwidth']['value']} GB/s "
            f"(layer error median {fit.median_rel_err:.0%}, p90 {fit.p90_rel_err:.0%}; total {fit.total_rel_err:+.0%})",
            highlight=False,
        )


_Backend = click.Choice(["ray", "inprocess"])
app = typer.Typer(
    name="fedelastic",
    help=__doc__,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
devices_app = typer.Typer(help="list, show or validate device profiles", no_args_is_help=True)
profile_app = typer.Typer(help="measure this device, or import a measured trace into a profile", no_args_is_help=True)
app.add_typer(devices_app, name="devices")
app.add_typer(profile_app, name="profile")


def _call(command: str, fn, **args) -> int:
    """Run one command; map its errors to one line on stderr and the exit code."""
    from .signals import calls_returned, sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():
            return fn(SimpleNamespace(command=command, **args)) or 0
    except FedelasticError as exc:  # bad input: one line naming the file and key
        _error(str(exc))
        return 2
    except RunFailed as exc:
        _error(f"run failed: {exc}")
        return 1
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        calls_returned()
        _error(f"{exc if isinstance(exc, Terminated) else 'interrupted'}{_resume_hint(exc, args)}")
        return 143 if isinstance(exc, Terminated) else 130
    except Exception as exc:  # noqa: BLE001 (a run records the traceback in its errors.log)
        from .results.recorder import one_line

        _error(f"{command} failed: {one_line(f'{type(exc).__name__}: {exc}')} (traceback in the run folder's errors.log)")
        return 1


@app.command("run")
def run_command(
    scenario: Annotated[str | None, typer.Argument(help="scenario file (omit with --resume)")] = None,
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...",
            help="scenario keys to override, values in TOML: train.lr=0.01 server.rounds=20 'train.strategy=\"full\"'",
        ),
    ] = None,
    resume: Annotated[
        str | None, typer.Option(metavar="RUN_DIR", help="continue a killed run from its last finished round")
    ] = None,
    rounds: Annotated[int | None, typer.Option(help="override server.rounds")] = None,
    backend: Annotated[str | None, typer.Option(click_type=_Backend, help="override simulation.backend")] = None,
    output_dir: Annotated[str | None, typer.Option(help="override output_dir")] = None,
    run_id: Annotated[str | None, typer.Option(help="name of the run folder (default: a timestamp)")] = None,
) -> int:
    """run a scenario file (SCENARIO; omit it with --resume), with KEY=VALUE overrides typed as TOML"""
    return _call(
        "run", cmd_run, scenario=scenario, overrides=overrides or [], resume=resume, rounds=rounds,
        backend=backend, output_dir=output_dir, run_id=run_id,
    )  # fmt: skip


@app.command("compare")
def compare_command(
    scenario: Annotated[str, typer.Argument(help="comparison scenario file")],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY=VALUE]...",
            help="scenario keys to override, values in TOML: train.local_epochs=1 'compare.seeds=[0, 1]'",
        ),
    ] = None,
    rounds: Annotated[int | None, typer.Option(help="override server.rounds")] = None,
    backend: Annotated[str | None, typer.Option(click_type=_Backend, help="override simulation.backend")] = None,
    output: Annotated[
        Path | None, typer.Option(help="comparison folder (default: under the scenario's output_dir)")
    ] = None,
    resume: Annotated[
        Path | None, typer.Option(metavar="COMPARE_DIR", help="continue an interrupted comparison")
    ] = None,
) -> int:
    """run a comparison scenario (strategies x fleets x seeds), with KEY=VALUE overrides typed as TOML"""
    return _call(
        "compare", cmd_compare, scenario=scenario, overrides=overrides or [], rounds=rounds, backend=backend,
        output=output, resume=resume,
    )  # fmt: skip


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="a run folder (or, with --html, a comparison folder)")],
    html: Annotated[bool, typer.Option("--html", help="write RUN_DIR/report.html (a run or a comparison folder)")] = False,
) -> int:
    """summarise a run folder (with --html: a run or a comparison folder)"""
    return _call("report", cmd_report, run_dir=run_dir, html=html)


_DirOption = Annotated[list[str] | None, typer.Option("--dir", help="extra profile folder (repeatable)")]


@devices_app.command("list")
def devices_list(dir: _DirOption = None) -> int:
    """list the device profiles"""
    return _call("devices", cmd_devices, action="list", target=None, dir=dir or [])


@devices_app.command("show")
def devices_show(
    target: Annotated[str, typer.Argument(metavar="NAME", help="device name")], dir: _DirOption = None
) -> int:
    """show one device profile with the source of every value"""
    return _call("devices", cmd_devices, action="show", target=target, dir=dir or [])


@devices_app.command("validate")
def devices_validate(target: Annotated[str, typer.Argument(metavar="FILE", help="profile file")]) -> int:
    """check a device profile file"""
    return _call("devices", cmd_devices, action="validate", target=target, dir=[])


@app.command("strategies")
def strategies_command(
    name: Annotated[str | None, typer.Argument(help="a strategy: show its options with their help")] = None,
) -> int:
    """list the registered selection strategies, or show one's options (NAME)"""
    return _call("strategies", cmd_strategies, name=name)


@app.command("models")
def models_command() -> int:
    """list the built-in models with their options"""
    return _call("models", cmd_models)


@app.command("pretrain")
def pretrain_command(scenario: Annotated[str, typer.Argument(help="scenario file")]) -> int:
    """pretrain (and cache) a scenario's starting weights"""
    return _call("pretrain", cmd_pretrain, scenario=scenario)


@profile_app.command("measure")
def profile_measure(
    model: Annotated[
        list[str],
        typer.Option(help="registry model name or package.module:callable (repeatable: one table each, one fit)"),
    ],
    out: Annotated[Path, typer.Option(help="profile file to write (its stem is the device name)")],
    batch_size: Annotated[int, typer.Option()] = 8,
    input_size: Annotated[int | None, typer.Option(help="input height and width (default: the factory's)")] = None,
    num_classes: Annotated[int | None, typer.Option(help="classifier size (default: the factory's)")] = None,
    in_channels: Annotated[int | None, typer.Option(help="input channels (default: the factory's, else 3)")] = None,
    option: Annotated[
        list[str] | None, typer.Option(metavar="KEY=VALUE", help="extra factory argument (repeatable)")
    ] = None,
    name: Annotated[str | None, typer.Option(help="device name (default: the --out file stem; must equal it)")] = None,
    repeats: Annotated[int, typer.Option(help="timed runs per measurement (medians)")] = 10,
    warmup: Annotated[int, typer.Option(help="untimed runs before each measurement")] = 2,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's default); recorded")] = None,
    clock: Annotated[
        str, typer.Option(click_type=click.Choice(["wall", "cpu"]), help="cpu: thread CPU time (1 thread)")
    ] = "wall",
    like: Annotated[str | None, typer.Option(help=r"profile (name or file) to copy \[power] and \[network] from")] = None,
    device_class: Annotated[str, typer.Option(click_type=click.Choice(["mcu", "sbc", "gpu-edge", "phone"]))] = "sbc",
    kernel_samples: Annotated[
        bool, typer.Option(help="also time sampled kernels and fit the predictors that price unmeasured models")
    ] = True,
    sample_minutes: Annotated[float, typer.Option(help="minutes of kernel sampling (longer: more configurations)")] = 10.0,
    save_samples: Annotated[Path | None, typer.Option(help="also write the timed kernel configurations (JSON)")] = None,
) -> int:
    """measure this machine with torch and write its device profile"""
    return _call(
        "profile", cmd_profile, action="measure", model=model, out=out, batch_size=batch_size,
        input_size=input_size, num_classes=num_classes, in_channels=in_channels, option=option or [], name=name,
        repeats=repeats, warmup=warmup, threads=threads, clock=clock, like=like, device_class=device_class,
        kernel_samples=kernel_samples, sample_minutes=sample_minutes, save_samples=save_samples,
    )  # fmt: skip


@profile_app.command("import-trace")
def profile_import_trace(
    file: Annotated[Path, typer.Argument(help="Chrome-trace file (.json or .json.gz)")],
    model: Annotated[str, typer.Option(help="model registry name the table is for (e.g. resnet50)")],
    batch_size: Annotated[int, typer.Option()] = 4,
    profile: Annotated[Path | None, typer.Option(help="profile to write the table into (else print it)")] = None,
    fit: Annotated[bool, typer.Option("--fit", help="also refit the profile's roofline to its measured tables")] = False,
    input_size: Annotated[
        int | None,
        typer.Option(help="input size --model was traced at, recorded with the table and used by the fit (default: the factory's)"),
    ] = None,
    num_classes: Annotated[
        int | None, typer.Option(help="classes --model was traced with, recorded and used as --input-size (default: the factory's)")
    ] = None,
    source: Annotated[str | None, typer.Option(help="source text of the table (default: the file name)")] = None,
) -> int:
    r"""turn a Chrome trace into a \[measured.<model>] table (FILE: a .json or .json.gz Chrome trace)"""
    return _call(
        "profile", cmd_profile, action="import-trace", file=file, model=model, batch_size=batch_size,
        profile=profile, fit=fit, input_size=input_size, num_classes=num_classes, source=source,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """The console script: run one command, return its exit code (2 for a usage error, with one line)."""
    command = typer.main.get_command(app)
    try:
        code = command.main(args=argv, prog_name="fedelastic", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "fedelastic"
        _error(f"{where}: a command is needed (see `{where} --help`)")
        return 2
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "fedelastic"
        _error(f"{where}: {exc.format_message()} (see `{where} --help`)")
        return 2
    except click.ClickException as exc:
        _error(exc.format_message())
        return exc.exit_code
    except click.Abort:
        _error("interrupted")
        return 130
    return code if isinstance(code, int) else 0


def _resume_hint(exc: KeyboardInterrupt, args: dict) -> str:
    """How to continue what an interrupt stopped, naming its folder ('' when none was made yet)."""
    compare_dir, run_dir = getattr(exc, "compare_dir", None), getattr(exc, "run_dir", None)
    if compare_dir is not None:
        return (
            f"; the finished runs are on disk (continue with `fedelastic compare {args.get('scenario')} "
            f"--resume {compare_dir}`)"
        )
    if run_dir is not None:
        return f"; the finished rounds are on disk (continue with `fedelastic run --resume {run_dir}`)"
    return ""


def _error(text: str) -> None:
    """Print an error line; user text is printed literally (no rich markup)."""
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 100000)
    err.print("error: " + text, markup=False, highlight=False, soft_wrap=True)


if __name__ == "__main__":
    sys.exit(main())
