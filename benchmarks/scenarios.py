"""Every shipped scenario and comparison, run as shipped, against chance and central training.

    python benchmarks/scenarios.py                  # full size (long: see benchmarks/studies/shipped-scenarios.md)
    python benchmarks/scenarios.py --reduced        # a few steps of each, in-process (a minute or two)
    python benchmarks/scenarios.py --only quickstart,compare_fleets

For each ``simulations/*.toml`` (a comparison when it has a ``[compare]`` table: one row per fleet
and strategy, over its seeds), it records:

* ``final_accuracy``: the global model's accuracy after the last round (a comparison: mean over
  the seeds that ended ``completed``), against ``chance`` (1 / classes);
* ``central_accuracy``: the same starting weights trained centrally by the project's trainer
  (strategy ``full``, the scenario's batch size, lr, BatchNorm mode, optimizer and schedule) on the
  pooled training data of the clients (a stream: every sample the clients received, each in its
  domain), for ``rounds x local_epochs`` epochs (at most ``--central-steps`` steps), evaluated as
  the run is (the test set, or the stream's tasks);
* ``full_gap``: for strategy ``full``, central minus final accuracy (the reference must come
  within 0.05 of central training); ``--with-full`` also runs each single scenario whose strategy
  is not ``full`` with ``full`` (policy ``wait_all`` for a deadline-elastic one), its reference row;
* ``status``: status.json's ``status`` of each run; ``rejected`` / ``failed``: client results the
  server rejected as non-finite or that failed; ``not_fitting``: client results whose selection did
  not fit the device's memory; ``nonfinite_loss``: client rows with a
  non-finite train loss that ran steps; ``wall_s``: the scenario's wall time, pretraining included;
* ``header_s``: the time the scenario's header comment states ("About 40 s on this 2-core
  machine", "About 3 minutes"), and ``vs_header``: ``wall_s / header_s``, flagged ``MISMATCH``
  when it lies outside [1/``--factor``, ``--factor``] (default 2; full size only, a ``--reduced``
  run is not comparable): then correct the header, or find what made the scenario slower.

A comparison's rows also carry each seed's accuracy, the chosen lr (and whether it is at its
grid's edge) and the paired differences between its strategies (``differences.csv``).

Writes ``--out`` (default ``benchmarks/results/scenarios.json``, with ``_reduced`` for
``--reduced``) and prints a markdown table; ``--only`` replaces the rows of the scenarios it runs
and keeps the others (each row has its own date). A full-size run to the default ``--out`` also
writes the page ``benchmarks/studies/shipped-scenarios.md`` (``--page-only``: only that, from the
JSON, with the header columns read again from the scenario files). Runs go under a temporary
folder (``--keep DIR``: under DIR, kept).

``--check`` writes nothing: it runs and exits 1 when a row's status differs from, or its final
accuracy is more than ``--tolerance`` (default 0.02, 7 of digits' 359 test images) away from, the
row of the same scenario, fleet and strategy in ``--out`` (the page's figures). CI runs the same
check at reduced size against ``benchmarks/results/scenarios_reduced.json``
(``tests/integration/test_scenarios_sound.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import tomli_w
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fedelastic import api  # noqa: E402
from fedelastic.config import read_toml  # noqa: E402
from fedelastic.cost.costmodel import CostModel  # noqa: E402
from fedelastic.data import ArrayDataset  # noqa: E402
from fedelastic.data.shifts import Shift, apply_shift  # noqa: E402
from fedelastic.environment import environment  # noqa: E402
from fedelastic.results.recorder import read_status  # noqa: E402
from fedelastic.selection.strategy import make_strategy  # noqa: E402
from fedelastic.train.pretrain import initial_state  # noqa: E402
from fedelastic.train.trainer import LocalTraining, evaluate_model, torch_threads, train_local  # noqa: E402

SIMULATIONS = ROOT / "simulations"
PAGE = ROOT / "benchmarks" / "studies" / "shipped-scenarios.md"
TOLERANCE = 0.02  # --check: the most a final accuracy may move from its recorded figure
HEADER_TIME = re.compile(r"About (\d+(?:\.\d+)?) (s|seconds?|minutes?)\b")


def header_seconds(path: Path) -> float | None:
    """The wall time a scenario's leading comment states ("About 40 s", "About 3 minutes"); None if none."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            return None
        if m := HEADER_TIME.search(line):
            return float(m.group(1)) * (60.0 if m.group(2).startswith("minute") else 1.0)
    return None


def vs_header(wall_s: float, header_s: float | None, factor: float) -> tuple[float, bool]:
    """(wall / header, whether that ratio lies outside [1/factor, factor]); (nan, False) without a header."""
    if not header_s:
        return float("nan"), False
    ratio = wall_s / header_s
    return ratio, not (1 / factor <= ratio <= factor)
REDUCED_STEPS = 3  # train.max_steps of a reduced run
COST_DEVICE = "jetson_tx2"  # central training's steps are priced on it (full training fits its memory)


def reduced(raw: dict) -> dict:
    """A scenario's dict shrunk to a few steps: 1-4 rounds, 3 local steps, 1 pretraining epoch, in-process;
    a comparison: one seed, its lr grid not widened."""
    raw = json.loads(json.dumps(raw))  # a deep copy
    stream = raw.get("stream")
    rounds = 2
    if stream is not None:
        stream["eval_samples"] = 40
        if "tasks" in stream:
            stream["task_rounds"] = 1
            rounds = len(stream["tasks"])
        if "domains" in stream:
            stream["domain_rounds"] = 1
            stream["onset_jitter"] = 0
            rounds = len(stream["domains"])
    raw.setdefault("server", {})["rounds"] = rounds
    raw.setdefault("train", {})["max_steps"] = REDUCED_STEPS
    if "pretrain" in raw.get("model", {}):
        raw["model"]["pretrain"]["epochs"] = 1
    if raw.get("data", {}).get("dataset") == "synth_digits":
        raw["data"]["size"] = 3000
    raw.setdefault("simulation", {})["backend"] = "inprocess"
    if "compare" in raw:
        raw["compare"]["seeds"] = [0]
        if "tune" in raw["compare"]:
            raw["compare"]["tune"]["widen"] = 0  # the grid as listed (widening is tested on its own)
    return raw


def stream_pool(env) -> ArrayDataset:
    """Every sample the clients of a stream received over the run, each in its domain."""
    sc, stream = env.scenario, env.stream
    domains = sc.stream.domains or (Shift(),)
    xs, ys = [], []
    for pid in range(sc.num_clients):
        for r in range(1, sc.server.rounds + 1):
            items = stream.arrivals(pid, r)
            x = env.data.train.x[items[:, 0]]
            for d in np.unique(items[:, 1]):
                rows = items[:, 1] == d
                x[rows] = apply_shift(x[rows], domains[int(d)], [sc.seed, 0xC3, pid, r, int(d)])
            xs.append(x)
            ys.append(env.data.train.y[items[:, 0]])
    return ArrayDataset(np.concatenate(xs), np.concatenate(ys))


def central_accuracy(sc, max_steps: int) -> dict:
    """The scenario's starting weights trained centrally on its clients' pooled data (module doc)."""
    from fedelastic.results.continual import evaluate_tasks  # noqa: PLC0415

    env = environment(sc)
    t = sc.train
    model = env.new_model()
    model.load_state_dict(initial_state(env))
    pooled = stream_pool(env) if env.stream is not None else env.data.train
    cost = CostModel(env.info, env.profile(COST_DEVICE), t.batch_size, "momentum", env.bn_mode)  # prices steps only
    epochs = sc.server.rounds * t.local_epochs
    with torch_threads(sc.simulation.torch_threads):
        res = train_local(
            model,
            env.info,
            make_strategy("full", {}),
            cost,
            pooled,
            LocalTraining(
                epochs=epochs,
                batch_size=t.batch_size,
                lr=t.lr,
                momentum=t.momentum,
                weight_decay=t.weight_decay,
                max_steps=max_steps,
                bn_mode=env.bn_mode,
                optimizer=t.optimizer,
                lr_schedule=t.lr_schedule,
            ),
            seed=[sc.seed, 0xCE],
        )
        if env.stream is not None:
            _, accuracy, _ = evaluate_tasks(env, model, sc.server.rounds, 0.0)
        else:
            accuracy, _ = evaluate_model(model, env.data.test.x, env.data.test.y)
    finite = math.isfinite(res.train_loss) and all(
        bool(torch.isfinite(v).all()) for v in model.state_dict().values() if v.is_floating_point()
    )
    return {
        "central_accuracy": accuracy if finite else float("nan"),
        "central_steps": res.steps,
        "central_samples": len(pooled),
        "chance": 1 / env.num_classes,
    }


def run_figures(run_dir: Path) -> dict:
    """A run's final accuracy, status and failure counts, from its folder."""
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    clients = pd.read_parquet(run_dir / "clients.parquet")
    evaluated = rounds.dropna(subset=["test_accuracy"])
    final = float(evaluated.test_accuracy.iloc[-1]) if len(evaluated) else float("nan")
    ran = clients[clients.get("steps", pd.Series(0, index=clients.index)) > 0]
    return {
        "final_accuracy": final,
        "status": read_status(run_dir)["status"],
        "rejected": int((clients.status == "rejected").sum()),
        "failed": int((clients.status == "failed").sum()),
        "not_fitting": int((clients.status == "not_fitting").sum()),
        "nonfinite_loss": int((~np.isfinite(ran.train_loss.astype(float))).sum()),
        "client_rows": len(clients),
    }


def run_single(path: Path, raw: dict, out: Path) -> list[dict]:
    from fedelastic.fl.runner import run_scenario  # noqa: PLC0415

    sc = api.load({**raw, "output_dir": str(out)})
    run_dir = run_scenario(sc, run_id="run")
    row = {"scenario": path.stem, "fleet": "", "strategy": sc.train.strategy, "seeds": 1, **run_figures(run_dir)}
    row["statuses"] = [row["status"]]
    return [row]


def run_compare(path: Path, raw: dict, out: Path) -> list[dict]:
    from fedelastic.comparisons.comparison import run_comparison  # noqa: PLC0415

    raw = {**raw, "output_dir": str(out)}
    file = out / f"{path.stem}.toml"
    file.write_text(tomli_w.dumps(raw))
    folder = run_comparison(file, output=out / "compare")
    summary = pd.read_csv(folder / "summary.csv")
    tuning = pd.read_csv(folder / "tuning.csv") if (folder / "tuning.csv").exists() else None
    pairs = pd.read_csv(folder / "differences.csv") if (folder / "differences.csv").exists() else pd.DataFrame()
    rows = []
    for (fleet, strategy), cell in summary.groupby(["fleet", "strategy"], sort=False):
        runs = [run_figures(Path(d)) for d in cell.run_dir]
        used = [r for r in runs if r["status"] == "completed"]
        chosen = tuning[tuning.chosen & (tuning.fleet == fleet) & (tuning.strategy == strategy)] if tuning is not None else []
        rows.append(
            {
                "scenario": path.stem, "fleet": fleet, "strategy": strategy, "seeds": len(runs),
                "final_accuracy": float(np.mean([r["final_accuracy"] for r in used])) if used else float("nan"),
                "status": "completed" if len(used) == len(runs) else f"{len(used)} of {len(runs)} completed",
                "statuses": [r["status"] for r in runs],
                "per_seed": [r["final_accuracy"] for r in runs],
                "lr": float(cell.lr.iloc[0]),
                "lr_edge": str(chosen.edge.iloc[0]) if len(chosen) and isinstance(chosen.edge.iloc[0], str) else "",
                "pairs": pairs[(pairs.fleet == fleet) & (pairs.a == strategy)].to_dict("records") if len(pairs) else [],
                **{k: sum(r[k] for r in runs) for k in ("rejected", "failed", "not_fitting", "nonfinite_loss", "client_rows")},
            }
        )  # fmt: skip
    return rows


def run_one(
    path: Path, small: bool, central_steps: int, work: Path, with_full: bool = False, factor: float = 2.0
) -> list[dict]:
    raw = read_toml(path, "scenario")
    raw.pop("source", None)
    if small:
        raw = reduced(raw)
    start = time.perf_counter()
    out = work / path.stem
    out.mkdir(parents=True, exist_ok=True)
    rows = run_compare(path, raw, out) if "compare" in raw else run_single(path, raw, out)
    wall = time.perf_counter() - start
    header = header_seconds(path)
    ratio, off = vs_header(wall, None if small else header, factor)
    for row in rows:
        row.update(wall_s=wall, header_s=header, vs_header=ratio, header_mismatch=off)
    if with_full and "compare" not in raw and raw.get("train", {}).get("strategy", "full") != "full":
        ref = {**raw, "train": {**raw["train"], "strategy": "full", "options": {}}}
        if ref.get("server", {}).get("policy") == "deadline_elastic":
            ref["server"] = {**ref["server"], "policy": "wait_all"}  # full training takes no rho from a deadline
        start = time.perf_counter()
        (full,) = run_single(path, ref, work / f"{path.stem}-full")
        rows.append({**full, "strategy": "full (reference)", "wall_s": time.perf_counter() - start})
    base = {k: v for k, v in raw.items() if k != "compare"}
    central = central_accuracy(api.load({**base, "output_dir": str(out)}), central_steps)
    for row in rows:
        row.update(central)
        gap = central["central_accuracy"] - row["final_accuracy"]
        row["full_gap"] = gap if row["strategy"].startswith("full") else float("nan")
    return rows


def table(rows: list[dict]) -> str:
    head = "| scenario | fleet | strategy | seeds | final acc | chance | central acc | full gap | status | rejected | failed | not fitting | non-finite loss | client rows | wall s | header s | wall / header |"
    lines = [head, "|" + "---|" * 17]

    def f(x, fmt="{:.3f}"):
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)

    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['fleet'] or '—'} | {r['strategy']} | {r['seeds']} | {f(r['final_accuracy'])} | "
            f"{f(r['chance'], '{:.2f}')} | {f(r['central_accuracy'])} | {f(r['full_gap'], '{:+.3f}')} | {r['status']} | "
            f"{r['rejected']} | {r['failed']} | {r.get('not_fitting', 0)} | {r['nonfinite_loss']} | {r['client_rows']} | "
            f"{f(r['wall_s'], '{:.0f}')} | {f(r.get('header_s'), '{:.0f}')} | {f(r.get('vs_header'), '{:.2f}')}"
            f"{' MISMATCH' if r.get('header_mismatch') else ''} |"
        )
    return "\n".join(lines)


def drift(rows: list[dict], reference: list[dict], tolerance: float) -> list[str]:
    """One line per row whose status differs from, or whose final accuracy is more than ``tolerance``
    from, the reference row of the same scenario, fleet and strategy (or that has no reference row)."""
    recorded = {(r["scenario"], r["fleet"], r["strategy"]): r for r in reference}
    lines = []
    for r in rows:
        key = (r["scenario"], r["fleet"], r["strategy"])
        name = " / ".join(k for k in key if k)
        old = recorded.get(key)
        if old is None:
            lines.append(f"{name}: no recorded row")
            continue
        if r["status"] != old["status"]:
            lines.append(f"{name}: status {r['status']} (recorded: {old['status']})")
        now, then = float(r["final_accuracy"]), float(old["final_accuracy"])
        if not abs(now - then) <= tolerance and not (math.isnan(now) and math.isnan(then)):
            lines.append(f"{name}: final accuracy {now:.3f} (recorded: {then:.3f}, tolerance ±{tolerance:g})")
    return lines


def _pairs_table(rows: list[dict]) -> str:
    """A comparison's paired differences (its rows' ``pairs``) as markdown."""
    pairs = [p for r in rows for p in r.get("pairs", [])]
    tests = sum(1 for p in pairs if p["p"] == p["p"])
    lines = [
        f"Paired over seeds: a − b in final accuracy, two-sided paired t-test, Holm-Bonferroni over the {tests} "
        f"pairs; significant: Holm-adjusted p < 0.05; detectable: the smallest true difference this design detects "
        f"with power 0.8 at level 0.05/{tests}.",
        "",
        "| fleet | a − b | seeds | difference | p | p Holm | significant | detectable |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        lines.append(
            f"| {p['fleet']} | {p['a']} − {p['b']} | {p['seeds']} | {p['mean_diff']:+.3f} | {p['p']:.3g} | "
            f"{p['p_holm']:.3g} | {'**yes**' if p['significant'] else 'no'} | {p['detectable']:.3f} |"
        )
    return "\n".join(lines)


def page(doc: dict) -> str:
    """The page benchmarks/studies/shipped-scenarios.md, from the JSON a full-size run wrote."""
    rows = doc["rows"]
    when = sorted({r.get("date", "an earlier, undated run") for r in rows})
    runs = f"on {when[0]}" if len(when) == 1 else f"between {when[0]} and {when[-1]} (each row's date: the JSON)"
    out = [
        "<!-- generated by `python benchmarks/scenarios.py` from benchmarks/results/scenarios.json: do not edit "
        "(`--page-only` rewrites it from the JSON) -->",
        "",
        "# Shipped scenarios: every scenario as shipped, against central training",
        "",
        "**Question.** Does every shipped scenario train (finite, above chance, no rejected or failed client),",
        "and how close does its `full` reference come to the same model trained centrally?",
        "",
        f"**Command:** `python benchmarks/scenarios.py` (or `--only NAME,...`, which replaces those rows), run {runs}",
        f"on {doc.get('host', '?')} ({doc.get('cpus', '?')} CPUs, shared with other jobs: wall times are this "
        "machine's under that load). Raw rows: [`benchmarks/results/scenarios.json`](../results/scenarios.json).",
        "",
        "`final acc`: the global model's accuracy after the last round (a comparison: mean over its seeds that",
        "completed). `central acc`: the same starting weights trained centrally by `train_local` (strategy `full`,",
        "the scenario's batch, lr and BatchNorm mode) on the clients' pooled training data for rounds x local",
        "epochs (at most 3,000 steps), evaluated as the run is. `full gap`: central minus the `full` run's accuracy.",
        "A comparison's wall time is the whole comparison's.",
        "",
        table(rows),
        "",
    ]
    notes = []
    bad = [r for r in rows if r["status"] != "completed"]
    if bad:
        notes.append("Not `completed`: " + "; ".join(f"{r['scenario']} {r['fleet']} {r['strategy']} ({r['status']})".replace("  ", " ") for r in bad) + ".")
    low = [r for r in rows if r["final_accuracy"] < r["chance"] + 0.05]
    if low:
        notes.append("Within 0.05 of chance: " + ", ".join(f"{r['scenario']} {r['strategy']}" for r in low) + ".")
    far = [r for r in rows if r["full_gap"] == r["full_gap"] and r["full_gap"] > 0.05]
    notes.append(
        "`full` more than 0.05 below central training: "
        + (", ".join(f"{r['scenario']} {r['fleet']} ({r['full_gap']:+.3f})".replace("  ", " ") for r in far) or "none")
        + "."
        + (
            " continual_classes' central training sees every sample at once, its devices a stream through 128-sample"
            " reservoirs, and they forget: that gap is what the scenario shows."
            if any(r["scenario"] == "continual_classes" for r in far)
            else ""
        )
    )
    out += [f"- {n}" for n in notes] + [""]
    for name in dict.fromkeys(r["scenario"] for r in rows if "per_seed" in r):
        cells = [r for r in rows if r["scenario"] == name]
        seeds = max(len(r["per_seed"]) for r in cells)
        out += [
            f"## {name}: every seed, the tuned lr and the differences",
            "",
            "| fleet | strategy | lr | " + " | ".join(f"seed {i}" for i in range(seeds)) + " |",
            "|---|---|---|" + "---|" * seeds,
        ]
        for r in cells:
            edge = f" ({r['lr_edge']} of grid)" if r.get("lr_edge") else ""
            vals = [f"{v:.3f}" if st == "completed" else st for v, st in zip(r["per_seed"], r["statuses"])]
            out.append(f"| {r['fleet']} | {r['strategy']} | {r['lr']:g}{edge} | " + " | ".join(vals) + " |")
        out += ["", _pairs_table(cells), ""]
    out += [
        "## Drift check",
        "",
        "`python benchmarks/scenarios.py --check` reruns every scenario (about 45 minutes here; `--only NAME,...`",
        "for some) and exits 1 when a row's status differs from this page's or its final accuracy moved more than",
        f"±{TOLERANCE:g} (7 of the 359 test images most scenarios have) from it; it writes nothing. At reduced size (a",
        "few steps, in-process) CI runs the same check against `benchmarks/results/scenarios_reduced.json`",
        "(`python benchmarks/scenarios.py --reduced` rewrites it) in `tests/integration/test_scenarios_sound.py`.",
        "When a change moves a figure on purpose, rerun and commit both.",
        "",
        "On this machine, with one torch thread, deadline_elastic gave the same figure in each of ten reruns (either",
        "backend, 1 to 4 cohorts, runtime patches on or off). On another machine a single-seed scenario can move by",
        "more than the tolerance with no change in the code: deadline_elastic ends anywhere from 0.763 to 0.889 when",
        "only the floating-point summation order changes ([why deadline_elastic moved](deadline-elastic-move.md)).",
        "There a flag means rerun and look, not a regression.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reduced", action="store_true", help="a few steps of each scenario, in-process")
    ap.add_argument("--only", default="", help="comma-separated scenario names (default: every simulations/*.toml)")
    ap.add_argument(
        "--central-steps", type=int, default=0, help="most central-training steps (default 3000; reduced 30)"
    )
    ap.add_argument("--out", default="", help="the JSON to write (and, with --check, to check against)")
    ap.add_argument("--central-only", action="store_true", help="recompute the central columns of --out's table")
    ap.add_argument(
        "--with-full", action="store_true", help="also run each single scenario with strategy full, as its reference"
    )
    ap.add_argument(
        "--factor", type=float, default=2.0, help="flag a wall time off its header's figure by more than this factor"
    )
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a row drifted from --out's")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="--check: most a final accuracy may move")
    ap.add_argument(
        "--page-only", action="store_true", help="rewrite the page (and header columns) from --out's JSON, run nothing"
    )
    ap.add_argument("--keep", default="", help="write the runs under this folder and keep them (default: a temporary one)")
    args = ap.parse_args(argv)
    central_steps = args.central_steps or (30 if args.reduced else 3000)
    paths = sorted(SIMULATIONS.glob("*.toml"))
    if args.only:
        wanted = args.only.split(",")
        paths = [p for p in paths if p.stem in wanted]
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"scenarios{'_reduced' if args.reduced else ''}.json")
    writes_page = not args.reduced and not args.out and not args.check
    if args.page_only and args.reduced:
        ap.error("--page-only writes the full-size page: not with --reduced")
    if args.page_only:  # the header columns from the scenario files as they are now, then the page
        doc = json.loads(out.read_text())
        for row in doc["rows"]:
            row["header_s"] = header_seconds(SIMULATIONS / f"{row['scenario']}.toml")
            row["vs_header"], row["header_mismatch"] = vs_header(row["wall_s"], row["header_s"], args.factor)
        doc["table"] = table(doc["rows"])
        out.write_text(json.dumps(doc, indent=1, default=float))
        PAGE.write_text(page(doc))
        print(f"wrote {out} and {PAGE}")
        return
    if args.central_only:  # recompute the central columns of an existing table, runs kept
        doc = json.loads(out.read_text())
        for path in paths:
            raw = read_toml(path, "scenario")
            raw.pop("source", None)
            raw = reduced(raw) if args.reduced else raw
            base = {k: v for k, v in raw.items() if k != "compare"}
            with tempfile.TemporaryDirectory() as work:
                central = central_accuracy(api.load({**base, "output_dir": work}), central_steps)
            for row in doc["rows"]:
                if row["scenario"] == path.stem:
                    row.update(central)
                    gap = central["central_accuracy"] - row["final_accuracy"]
                    row["full_gap"] = gap if row["strategy"].startswith("full") else float("nan")
        doc["table"] = table(doc["rows"])
        out.write_text(json.dumps(doc, indent=1, default=float))
        if writes_page:
            PAGE.write_text(page(doc))
        print(doc["table"])
        return
    recorded = json.loads(out.read_text())["rows"] if out.exists() else []
    order = [p.stem for p in sorted(SIMULATIONS.glob("*.toml"))]
    command = "python benchmarks/scenarios.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedelastic-scenarios-") as temporary:
        work = args.keep or temporary
        for path in paths:
            print(f"== {path.stem}", flush=True)
            got = run_one(path, args.reduced, central_steps, Path(work), args.with_full, args.factor)
            stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            rows.extend({**r, "date": stamp, "command": command.strip()} for r in got)
            print("\n".join(table(got).splitlines()[2:]), flush=True)
            if args.check:
                continue
            # the other scenarios' rows as the file has them now (another --only run may have written since)
            now = json.loads(out.read_text())["rows"] if out.exists() else []
            kept = [r for r in now if r["scenario"] in order and r["scenario"] not in {p.stem for p in paths}]
            merged = sorted(kept + rows, key=lambda r: order.index(r["scenario"]))  # stable: rows keep their order
            doc = {
                "command": command.strip(),
                "date": stamp,
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "wall_s": time.perf_counter() - start,
                "table": table(merged),
                "rows": merged,
            }
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1, default=float))  # after each scenario
            if writes_page:
                PAGE.write_text(page(doc))
    print(table(rows))
    if args.check:
        lines = drift(rows, recorded, args.tolerance)
        for line in lines:
            print(f"DRIFT: {line}")
        print(f"{len(lines)} row(s) drifted from {out}" if lines else f"every row within ±{args.tolerance:g} of {out}")
        sys.exit(1 if lines else 0)
    for r in rows:
        if r.get("header_mismatch"):
            print(f"MISMATCH: {r['scenario']} took {r['wall_s']:.0f} s, its header says about {r['header_s']:.0f} s "
                  f"(beyond x{args.factor:g}): correct the header or find the slowdown")  # fmt: skip
    print(f"wrote {out}" + (f" and {PAGE}" if writes_page else ""))


if __name__ == "__main__":
    main()
