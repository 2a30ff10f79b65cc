"""Where an in-process round goes, and what the results writer does in each round (issue 10, session 21).

    python benchmarks/round_breakdown.py                       # 3 runs of 30 rounds
    python benchmarks/round_breakdown.py --runs 5 --rounds 40 --out benchmarks/results/round_breakdown.json

Each run is a fresh process running benchmarks/peers.py's workload (200 Dirichlet clients on
digits, 50 a round, its 6k-parameter CNN, batch 16, 1 epoch, SGD lr 0.05, strategy "full") on
the in-process backend, with wall-clock stamps (``time.perf_counter``) at the entry and exit of
the driver's steps, set by wrappers in the measured process only (nothing in fedelastic changes):

* ``phases``: per round, the time between consecutive stamps: the server's ``messages``,
  the cohort grid packing the messages (``CohortGrid._train`` to ``InProcessGrid``), the call
  reaching the ClientApp's cohort handler and its training thread, the cohort's training
  (``train_cohort``: every client's weights, training and reply), the replies unpacked, the
  server's ``settle`` and ``end_round`` (the round's row). Medians over rounds 3 to the
  last but one, and rounds 1 and 2 on their own.
* ``writer``: each job of the results writer's thread (``clients``/``rounds`` table appends,
  ``status.json``, the checkpoint), with its CPU time (``time.thread_time``) and wall time, by
  the round whose results it writes. Medians over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]

CHILD = r"""
import functools, json, sys, tempfile, time
sys.path.insert(0, HERE)
import torch
torch.set_num_threads(1)
import peers
from fedelastic import api
import fedelastic.fl.checkpoint as checkpoint
import fedelastic.fl.server as server
import fedelastic.fl.cohort as cohort
import fedelastic.fl.runner as runner
import fedelastic.results.recorder as results

stamps, jobs, current = [], [], [0]


def stamp(owner, name, tag):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        stamps.append((time.perf_counter(), tag + ">"))
        try:
            return fn(*args, **kwargs)
        finally:
            stamps.append((time.perf_counter(), "<" + tag))

    setattr(owner, name, timed)


def job(owner, name, tag):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        cpu, wall = time.thread_time(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            label = f"{tag} {args[0].csv.stem}" if tag == "append" else tag
            jobs.append((current[0], label, time.thread_time() - cpu, time.perf_counter() - wall))

    setattr(owner, name, timed)


stamp(server.EngineStrategy, "messages", "configure")
stamp(cohort.CohortGrid, "_train", "pack")
stamp(runner.InProcessGrid, "send_and_receive", "call")
stamp(cohort, "cohort_train", "cohort")
stamp(cohort, "train_cohort", "train")
stamp(server.EngineStrategy, "settle", "aggregate")
stamp(server.EngineStrategy, "end_round", "evaluate")
job(results._Table, "append", "append")
job(results.Recorder, "_write_status", "status")
job(checkpoint, "save_checkpoint", "checkpoint")


def progress(row):
    current[0] = row["round"]  # the writes after this row are this round's


rounds = int(sys.argv[1])
wl = peers.Workload(200, rounds, 50)
api.run(wl.scenario("inprocess", tempfile.mkdtemp()), progress=progress)
print(json.dumps({"stamps": stamps, "jobs": jobs}))
"""

STEPS = (  # (from, to, label)
    ("configure>", "<configure", "server: configure_train"),
    ("<configure", "call>", "cohort grid packs the messages"),
    ("call>", "cohort>", "call reaches the ClientApp's cohort handler"),
    ("cohort>", "train>", "cohort handler: jobs prepared, training thread started"),
    ("train>", "<train", "cohort training (weights, train_local, replies) x50"),
    ("<train", "<cohort", "cohort reply packed"),
    ("<cohort", "<pack", "replies unpacked into per-client messages"),
    ("<pack", "aggregate>", "back in the strategy"),
    ("aggregate>", "<aggregate", "server: aggregate_train"),
    ("aggregate>", "<evaluate", "server: aggregate_train to evaluate's end"),
    ("configure>", "next", "whole round"),
)


def one_run(rounds: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    code = CHILD.replace("HERE", repr(str(HERE.parent)))
    out = subprocess.run([sys.executable, "-c", code, str(rounds)], capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(f"round_breakdown.py: the measured run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def phases(stamps: list) -> list[dict[str, float]]:
    """Per training round, ms between the stamps of STEPS (rounds split at each configure>)."""
    starts = [i for i, (_, tag) in enumerate(stamps) if tag == "configure>"]
    per_round = []
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(stamps)
        at = {}
        for t, tag in stamps[i:end]:
            at.setdefault(tag, t)
        at["next"] = stamps[end][0] if end < len(stamps) else float("nan")
        per_round.append({label: (at[b] - at[a]) * 1e3 for a, b, label in STEPS if a in at and b in at})
    return per_round


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    runs = [one_run(args.rounds) for _ in range(args.runs)]
    rows = {"steady (rounds 3..R-1)": [], "round 1": [], "round 2": []}
    for run in runs:
        per = phases(run["stamps"])
        rows["round 1"].append(per[0])
        rows["round 2"].append(per[1])
        rows["steady (rounds 3..R-1)"].extend(per[2:-1])
    table = {
        which: {label: statistics.median(r[label] for r in got if label in r) for _, _, label in STEPS}
        for which, got in rows.items()
    }
    print(f"\nmedians, ms ({args.runs} runs of {args.rounds} rounds; load average {load0[0]:.1f} at the start)\n")
    print("| step | " + " | ".join(table) + " |\n|---|" + "---:|" * len(table))
    for _, _, label in STEPS:
        print(f"| {label} | " + " | ".join(f"{table[w][label]:.2f}" for w in table) + " |")
    writer: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for run in runs:
        for rnd, label, cpu, wall in run["jobs"]:
            which = f"round {rnd}" if rnd <= 2 else "rounds 3..R"
            writer.setdefault((which, label), []).append((cpu * 1e3, wall * 1e3))
    print("\nresults writer, per job: CPU ms / wall ms (medians)\n\n| the writes of | job | CPU ms | wall ms |\n|---|---|---:|---:|")
    for (which, label), got in sorted(writer.items()):
        print(f"| {which} | {label} | {statistics.median(c for c, _ in got):.2f} | {statistics.median(w for _, w in got):.2f} |")
    if args.out:
        doc = {
            "command": "python benchmarks/round_breakdown.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "loadavg_start": load0,
            "loadavg_end": os.getloadavg(),
            "phases_ms": table,
            "writer_ms": {f"{w} | {label}": got for (w, label), got in writer.items()},
        }
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
