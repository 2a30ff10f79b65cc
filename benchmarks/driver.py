"""Where the ServerApp driver's main thread spends a round (issue 10): cProfile of the peers workload.

    python benchmarks/driver.py                      # in-process, 10 rounds x 50 of 200 clients
    python benchmarks/driver.py --evaluate-every 5   # the central evaluation on rounds 5 and 10 only
    python benchmarks/driver.py --timers             # perf_counter around the driver's entry points, no cProfile

Runs ``benchmarks/peers.py``'s workload in-process through ``fedelastic.api.run`` and profiles the
main thread from the initial evaluation's row to the last round's row (the training phase). It
prints, per round, the cumulative CPU time and call count of each part of the driver's own work
(the ServerApp's configure/aggregate/evaluate and the results and checkpoint writes), the
training phase's wall time, and the time the main thread waited for clients. cProfile time is
CPU time of the profiled thread plus profiling overhead: compare runs of this script, not wall
clocks of other benchmarks. Only the main thread is profiled: results written behind (on the
writer thread) show as the wait in ``Recorder.flush``, if any. ``--top N`` also prints pstats'
top N by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (label, file suffix, function name): the driver's parts, outermost first
PARTS = (
    ("plan (engine)", "sim/engine.py", "plan"),
    ("messages", "fl/server.py", "messages"),
    ("settle (server)", "fl/server.py", "settle"),
    ("  _failures (decode, NaN checks)", "fl/server.py", "_failures"),
    ("  settle (engine)", "sim/engine.py", "settle"),
    ("  aggregate_partial", "sim/aggregate.py", "aggregate_partial"),
    ("  Recorder.add_clients", "results.py", "add_clients"),
    ("end_round (server)", "fl/server.py", "end_round"),
    ("  CentralEvaluation.evaluate", "fl/server.py", "evaluate"),
    ("  evaluate_model (test set)", "training.py", "evaluate_model"),
    ("  Recorder.add_round", "results.py", "add_round"),
    ("  Checkpointer.on_round_end", "fl/checkpoint.py", "on_round_end"),
    ("  save_checkpoint", "fl/checkpoint.py", "save_checkpoint"),
    ("_Table.append (both tables)", "results.py", "append"),
    ("Recorder.flush (waiting for the writer)", "results.py", "flush"),
    ("os.fsync", "~", "<built-in method posix.fsync>"),
)
# the driver's whole work: the round loop's steps (EngineStrategy.run calls them)
TOTAL = (("sim/engine.py", "plan"), ("fl/server.py", "messages"), ("fl/server.py", "settle"), ("fl/server.py", "end_round"))


def _timed(cls, name: str, times: list[float], t: dict) -> None:
    """Time ``cls.name`` in the training phase (from round 0's row to the last round's)."""
    real = getattr(cls, name)

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            if "t0" in t and "t1" not in t:
                times.append(time.perf_counter() - start)

    setattr(cls, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=50)
    p.add_argument("--evaluate-every", type=int, default=1)
    p.add_argument("--top", type=int, default=0, help="also print pstats' top N by cumulative time")
    p.add_argument(
        "--timers",
        action="store_true",
        help="no cProfile: time the driver's three entry points with perf_counter (no profiling overhead)",
    )
    args = p.parse_args()

    sys.path.insert(0, str(HERE))
    import torch

    torch.set_num_threads(1)
    importlib.import_module("torch._dynamo")  # imported by the first optimizer: not a round's cost
    import peers

    from fedelastic import api

    wl = peers.Workload(args.clients, args.rounds, args.per_round)
    sc = wl.scenario("inprocess", tempfile.mkdtemp(prefix="driver-"))
    if args.evaluate_every != 1:  # (left out at 1: the key is new, and the old code refuses unknown keys)
        sc["server"]["evaluate_every"] = args.evaluate_every
    t: dict = {}

    def progress(row: dict) -> None:
        if row["round"] == 0:
            t["prof"] = cProfile.Profile()
            if not args.timers:
                t["prof"].enable()
            t["t0"] = time.perf_counter()
        if row["round"] == wl.rounds:
            t["prof"].disable()
            t["t1"] = time.perf_counter()

    spent: dict[str, list[float]] = {}
    if args.timers:
        from fedelastic.fl.server import EngineStrategy

        for name in ("messages", "settle", "end_round"):
            _timed(EngineStrategy, name, spent.setdefault(name, []), t)
    api.run(sc, progress=progress)
    rounds = args.rounds
    import fedelastic

    print(f"fedelastic: {Path(fedelastic.__file__).parent}")
    print(f"training phase: {t['t1'] - t['t0']:.3f} s wall for {rounds} rounds of {args.per_round} clients")
    if args.timers:
        print(f"{'part (perf_counter, per round)':40s} {'ms':>8s}")
        for name, times in spent.items():
            print(f"{name:40s} {1000 * sum(times) / rounds:8.2f}")
        print(f"{'driver total (main thread)':40s} {1000 * sum(map(sum, spent.values())) / rounds:8.2f}")
        return
    stats = pstats.Stats(t["prof"])
    print(f"{'part (main thread, per round)':40s} {'cum ms':>8s} {'calls':>6s}")
    table = stats.stats  # type: ignore[attr-defined]
    for label, suffix, name in PARTS:
        hits = [(v[1], v[3]) for (f, _, fn), v in table.items() if fn == name and f.endswith(suffix)]
        if not hits:
            continue
        calls, cum = sum(h[0] for h in hits), sum(h[1] for h in hits)
        print(f"{label:40s} {1000 * cum / rounds:8.2f} {calls / rounds:6.1f}")
    total = sum(v[3] for (f, _, fn), v in table.items() if any(f.endswith(s) and fn == n for s, n in TOTAL))
    print(f"{'driver total (main thread)':40s} {1000 * total / rounds:8.2f}")
    wait = sum(v[3] for (f, _, fn), v in table.items() if fn == "send_and_receive" and f.endswith("runner.py"))
    print(f"{'waiting for clients (runner send_and_receive)':40s} {1000 * wait / rounds:8.2f}")
    if args.top:
        stats.sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
