"""When should an in-process round hand the previous round's writes to the results writer? (issue 10)

    python benchmarks/handover.py [--pairs 10] [--rounds 60] [--out FILE]

The peers workload (``benchmarks/peers.py``: 200 clients, 50 a round, the 6k-parameter CNN) run
in-process for ``--rounds`` rounds, one fresh process per run, the variants alternating:

* ``second``: the writes are handed over once the round's second client is done (the default,
  ``cohort.when_under_way`` with ``UNDER_WAY_AFTER = 2``);
* ``first``: once its first client is done (``UNDER_WAY_AFTER = 1``);
* ``send``: as the round's messages leave (``GuardedGrid``'s ``on_sent``, the code before).

Reports each variant's median steady round (rounds 3..R, from the progress callback's stamps) and,
per variant, the paired differences from ``send`` run beside it. Every run must end ``completed``
on the same final model (the hand-over moves no result).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
VARIANTS = ("send", "second", "first")


def worker(variant: str, rounds: int) -> None:
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE.parent))
    import peers

    import fedelastic.fl.cohort as cohort
    import fedelastic.fl.runner as runner
    from fedelastic import api

    if variant == "send":
        runner.hand_over_under_way = lambda scenario: False
    elif variant == "first":
        cohort.UNDER_WAY_AFTER = 1
    wl = peers.Workload(rounds=rounds)
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        result = api.run(wl.scenario("inprocess", tmp), progress=lambda row: stamps.append(time.perf_counter()))
        status = result.status["status"]
        model = torch.load(Path(result.run_dir) / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
        checksum = peers.checksum(model)
    steady = [b - a for a, b in zip(stamps[2:], stamps[3:])]
    print(json.dumps({"variant": variant, "steady_ms": statistics.median(steady) * 1e3, "status": status, "checksum": checksum}))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--out", default="")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rounds)
        return
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for i in range(args.pairs):
        order = args.variants[i % len(args.variants) :] + args.variants[: i % len(args.variants)]
        for v in order:
            cmd = [sys.executable, str(HERE), "--worker", v, "--rounds", str(args.rounds)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            runs[v].append(json.loads(out))
            print(f"[{i + 1}/{args.pairs}] {v}: steady round {runs[v][-1]['steady_ms']:.1f} ms", flush=True)
    bad = [r for rs in runs.values() for r in rs if r["status"] != "completed"]
    sums = {r["checksum"] for rs in runs.values() for r in rs}
    if bad or len(sums) != 1:
        raise SystemExit(f"handover.py: runs not completed ({len(bad)}) or final models differ ({sorted(sums)})")
    summary = {}
    for v, rs in runs.items():
        ms = [r["steady_ms"] for r in rs]
        entry = {"steady_ms_median": statistics.median(ms), "steady_ms": ms}
        if v != "send" and "send" in runs:
            diffs = [a["steady_ms"] - b["steady_ms"] for a, b in zip(rs, runs["send"])]
            entry.update(diff_vs_send_ms=diffs, diff_median_ms=statistics.median(diffs), shorter=sum(d < 0 for d in diffs))
        summary[v] = entry
    print("| hand-over | steady round, median ms | paired difference from `send`, median ms | shorter than `send` |")
    print("|---|---:|---:|---:|")
    for v, e in summary.items():
        diff = f"{e['diff_median_ms']:+.2f}" if "diff_median_ms" in e else ""
        shorter = f"{e['shorter']} of {len(e['steady_ms'])}" if "shorter" in e else ""
        print(f"| {v} | {e['steady_ms_median']:.2f} | {diff} | {shorter} |")
    if args.out:
        doc = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "summary": summary}
        Path(args.out).write_text(json.dumps(doc, indent=2))
        print(f"written {args.out}")


if __name__ == "__main__":
    main()
