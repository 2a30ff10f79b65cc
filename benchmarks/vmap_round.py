"""Where a round of the default (vectorised) in-process path goes, in CPU ms a round (issue 40 §1).

    OMP_NUM_THREADS=1 python benchmarks/vmap_round.py [--rounds 10] [--profile]

One in-process run of benchmarks/peers.py's workload (``Workload().scenario("inprocess", ...)``
through ``fedelastic.api.run``; 200 Dirichlet(0.5) digits clients, 50 a round, its 6,218-parameter
CNN, batch 16, plain SGD), with thread-CPU timers (``time.thread_time``, so another thread's or
another process's work is not counted) wrapped around the phases of a round, in the measured
process only. Rounds 2.. (round 1 pays the first call's set-up); figures are CPU ms a round:

* training thread: the cohort call (``train_cohort``), of it the vectorised training
  (``train_partitions_vmap``), decoding the global arrays and the replies' records (``reply_content``);
* driver thread: the server's plan, messages, settle (of it ``aggregate_partial``), end_round.

``--profile`` also runs cProfile (thread CPU clock) inside ``train_partitions_vmap`` and splits
it: the step calls (``step_fn``: forward and backward), the optimizer (``sgd``), the batches'
gather (``batch``), per-client host work (``_Client``), set-up (stacking the global weights,
ordering the samples) and what is left (the per-step Python and result assembly). cProfile
slows Python-heavy parts more than torch calls, so these shares are indicative; the totals
above are taken without it in a separate run.

``--compare N``: the step calls without ``vmap`` (``grouped_forward``, the default for this model)
against under ``vmap`` (``grouped_plan`` patched to None), in one process: rounds 1-10 of the
workload through ``train_partitions_vmap``, the two interleaved N times; process CPU ms a round
(medians) and the largest difference of the last round's weights between them.

``--layers``: each of the peers CNN's grouped convolutions (35 clients x 8 samples), CPU ms of its
forward, weight gradient and input gradient in the default layout and channels-last (the choice
behind ``fedelastic.train.vectorized.CHANNELS_LAST``), and the max pooling after the second.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measuring import Timers  # noqa: E402
from peers import Workload  # noqa: E402

# (label, module, owner attribute path, function): what is timed, on which thread
PHASES = [
    ("train: cohort call (train_cohort)", "fedelastic.fl.cohort", "", "train_cohort"),
    ("train:   vectorised training (train_partitions_vmap)", "fedelastic.train.vectorized", "", "train_partitions_vmap"),
    ("train:   replies (reply_content)", "fedelastic.fl.cohort", "", "reply_content"),
    ("train: decode global arrays", "fedelastic.fl.cohort", "", "record_to_torch"),
    ("driver: plan", "fedelastic.fl.server", "RoundEngine", "plan"),
    ("driver: messages", "fedelastic.fl.server", "EngineStrategy", "messages"),
    ("driver: settle", "fedelastic.fl.server", "EngineStrategy", "settle"),
    ("driver:   aggregate_partial", "fedelastic.fl.server", "", "aggregate_partial"),
    ("driver: end_round", "fedelastic.fl.server", "EngineStrategy", "end_round"),
]

# cProfile functions (name, file ending) -> a part of train_partitions_vmap, in priority order
PARTS = [
    ("step calls (step_fn: forward + backward)", "step_fn"),
    ("optimizer (sgd)", "sgd"),
    ("batches' gather (batch)", "batch"),
    ("set-up: stack global weights (per_client)", "per_client"),
    ("set-up: order samples (_ordered_samples)", "_ordered_samples"),
    ("set-up: clients and helpers (__init__)", "__init__"),
    ("per-client host: begin (selection due?)", "begin"),
    ("per-client host: finish (select, price)", "finish"),
    ("per-client host: count_step", "count_step"),
    ("split by width (by_width)", "by_width"),
]


def run(rounds: int, profile: bool) -> dict:
    import importlib

    from fedelastic import api

    timers = Timers(since=float("inf"), clock=time.thread_time)
    for label, module, owner, fn in PHASES:
        target = importlib.import_module(module)
        timers.wrap(getattr(target, owner) if owner else target, fn, label)
    prof = cProfile.Profile(time.thread_time) if profile else None
    if prof is not None:
        import fedelastic.train.vectorized as vec

        inner = vec.train_partitions_vmap

        def profiled(*args, **kwargs):
            if timers.since == float("inf"):
                return inner(*args, **kwargs)
            prof.enable()
            try:
                return inner(*args, **kwargs)
            finally:
                prof.disable()

        vec.train_partitions_vmap = profiled
    def progress(row: dict) -> None:
        if row["round"] == 1:  # rounds 2..: each thread's CPU clock counts from its own start, so every call from now on
            timers.since = 0.0

    wl = Workload(rounds=rounds)
    with tempfile.TemporaryDirectory() as tmp:
        result = api.run(wl.scenario("inprocess", tmp), progress=progress)
    out = {"training_path": result.status.get("training_path", ""), "phases": timers.snapshot(), "rounds": rounds - 1}
    if prof is not None:
        out["parts"] = parts(pstats.Stats(prof))
    return out


def parts(stats: pstats.Stats) -> dict[str, float]:
    """Cumulative CPU s of each part of ``PARTS`` inside train_partitions_vmap (the first match of a name in vectorized.py)."""
    cum: dict[str, float] = {}
    total = 0.0
    for (path, _, name), (_, _, _, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name == "train_partitions_vmap":
            total = max(total, ct)
        if not path.endswith("vectorized.py"):
            continue
        for label, fn in PARTS:
            if name == fn:
                cum[label] = cum.get(label, 0.0) + ct
    out = {"train_partitions_vmap (under cProfile)": total}
    out.update(cum)
    out["rest (per-step Python, result assembly)"] = total - sum(cum.values())
    return out


def compare(reps: int) -> None:
    import statistics

    import numpy as np

    from fedelastic.environment import environment
    from fedelastic.scenario import parse_scenario
    from fedelastic.train import vectorized
    from fedelastic.train.trainer import CohortJob

    wl = Workload()
    with tempfile.TemporaryDirectory() as tmp:
        env = environment(parse_scenario(wl.scenario("inprocess", tmp)))
        real = vectorized.grouped_plan

        def rounds(grouped: bool) -> tuple[float, dict]:
            vectorized.grouped_plan = real if grouped else (lambda model, dims: None)
            try:
                cpu, model = 0.0, env.new_model()
                for rnd in range(1, wl.rounds + 1):
                    jobs = [CohortJob(p, rnd, env.strategy(), None) for p in wl.cohort(rnd)]
                    t = time.process_time()
                    out = vectorized.train_partitions_vmap(env, model, jobs)
                    cpu += time.process_time() - t
            finally:
                vectorized.grouped_plan = real
            return cpu / wl.rounds, out[-1].trained

        rounds(True), rounds(False)  # warm-up
        got: dict[bool, list] = {True: [], False: []}
        for _ in range(reps):
            for grouped in (False, True):
                got[grouped].append(rounds(grouped))
    med = {g: statistics.median(c for c, _ in got[g]) * 1e3 for g in got}
    a, b = got[True][0][1], got[False][0][1]
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    print(f"train_partitions_vmap, process CPU ms a round (rounds 1-{wl.rounds}, median of {reps} interleaved):")
    print(f"  under vmap {med[False]:.1f}, without vmap (grouped_forward) {med[True]:.1f}: {med[True] / med[False]:.2f}x")
    print(f"  largest weight difference (round {wl.rounds}'s last client): {diff:.1e}")


def layers(clients: int = 35, samples: int = 8, reps: int = 10) -> None:
    import torch.nn.functional as F

    def cpu_ms(fn) -> float:
        fn()
        t = time.process_time()
        for _ in range(reps):
            fn()
        return (time.process_time() - t) / reps * 1e3

    print(f"grouped convolutions of {clients} clients x {samples} samples, CPU ms (default layout / channels-last)")
    for c, o, hw in ((1, 8, 8), (8, 16, 8), (16, 32, 4)):
        x, w = torch.randn(samples, clients * c, hw, hw), torch.randn(clients * o, c, 3, 3)
        go = torch.randn(samples, clients * o, hw, hw)
        row = []
        for fmt in (torch.contiguous_format, torch.channels_last):
            xf, gf = x.contiguous(memory_format=fmt), go.contiguous(memory_format=fmt)

            def grad(mask, xf=xf, gf=gf, w=w, o=o):
                args = ([clients * o], [1, 1], [1, 1], [1, 1], False, [0, 0], clients, mask)
                return torch.ops.aten.convolution_backward(gf, xf, w, *args)

            row.append(
                (
                    cpu_ms(lambda xf=xf, w=w: F.conv2d(xf, w, None, 1, 1, 1, clients)),
                    cpu_ms(lambda grad=grad: grad([False, True, False])),
                    cpu_ms(lambda grad=grad: grad([True, False, False])),
                )
            )
        (f0, w0, i0), (f1, w1, i1) = row
        print(f"  {c}->{o} at {hw}x{hw}: forward {f0:.2f} / {f1:.2f}, weight gradient {w0:.2f} / {w1:.2f}, input gradient {i0:.2f} / {i1:.2f}")
    a = torch.randn(samples, clients * 16, 8, 8)
    print(f"  max pooling 2x2 of 16 channels at 8x8: {cpu_ms(lambda: F.max_pool2d(a, 2)):.2f} / "
          f"{cpu_ms(lambda: F.max_pool2d(a.contiguous(memory_format=torch.channels_last), 2)):.2f} (with the conversion)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="also split train_partitions_vmap with cProfile")
    p.add_argument("--compare", type=int, default=0, metavar="N", help="grouped against vmap step calls, N interleaved runs")
    p.add_argument("--layers", action="store_true", help="the grouped convolutions' layouts, layer by layer")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {[round(x, 1) for x in os.getloadavg()]}")
    if args.layers:
        layers()
        return
    if args.compare:
        compare(args.compare)
        return
    plain = run(args.rounds, False)
    n = plain["rounds"]
    print(plain["training_path"])
    print(f"thread CPU ms a round, rounds 2..{args.rounds}:")
    for label, v in plain["phases"].items():
        print(f"  {1000 * v['s'] / n:8.1f}  {label}")
    if args.profile:
        prof = run(args.rounds, True)
        print(f"cProfile inside train_partitions_vmap, CPU ms a round, rounds 2..{args.rounds}:")
        for label, s in prof["parts"].items():
            print(f"  {1000 * s / n:8.1f}  {label}")


if __name__ == "__main__":
    main()
