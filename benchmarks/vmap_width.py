"""What a vectorised step call costs by clients and padded width, and what splitting a step's calls by width saves.

    python benchmarks/vmap_width.py [--reps 5]

1. One vectorised step (``vmap`` forward of the clients' losses, one backward) of the peers CNN
   (benchmarks/peers.py) over ``B`` clients padded to ``W`` samples, process CPU per call (best of
   ``--reps``), on a grid of (B, W); fitted by least squares to ``c0 + a x B x W``. ``c0 / a`` is the
   call's fixed cost in padded samples: ``fedelastic.train.vectorized.CALL_SAMPLES``.
2. The peers workload's rounds 1-10 (50 clients each, Dirichlet(0.5) partitions of 2-19 samples,
   batch 16) through ``train_partitions_vmap``: padded samples, step calls and process CPU per round
   with every step in one call (``CALL_SAMPLES`` set past any padding) and split by width (the
   default), interleaved ``--reps`` times; the weights of the two agree to float32 rounding.
One torch thread. CPU seconds, not wall: the host is shared.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

GRID = [(50, 16), (50, 8), (50, 4), (25, 16), (25, 8), (10, 16), (5, 4), (1, 4)]


def step_cpu(model, b: int, w: int, reps: int) -> float:
    from torch.func import functional_call, vmap

    from fedelastic.train.vectorized import cross_entropy_terms

    base = {k: v.detach() for k, v in model.named_parameters()}
    params = {k: v.unsqueeze(0).repeat(b, *([1] * v.dim())) for k, v in base.items()}
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(b, w, 1, 8, 8, generator=gen), torch.randint(0, 10, (b, w), generator=gen)

    def loss(p, xb, yb):
        return cross_entropy_terms(functional_call(model, p, (xb,)), yb).mean()

    batched = vmap(loss)
    best = float("inf")
    for _ in range(reps):
        keep = {k: v.detach().requires_grad_() for k, v in params.items()}
        t = time.process_time()
        torch.autograd.grad(batched(keep, x, y).sum(), list(keep.values()))
        best = min(best, time.process_time() - t)
    return best


def rounds_cpu(env, wl, split: bool) -> tuple[float, int, int, dict]:
    """(process CPU s, padded samples, step calls) of rounds 1-10 through train_partitions_vmap; the last round's weights."""
    from fedelastic.train import vectorized
    from fedelastic.train.trainer import CohortJob

    saved, real = vectorized.CALL_SAMPLES, vectorized.by_width
    counts = [0, 0]

    def counting(rows, width, dev):
        calls = real(rows, width, dev)
        counts[0] += sum(len(c) * int(width[c].max()) for c in calls)
        counts[1] += len(calls)
        return calls

    vectorized.CALL_SAMPLES = saved if split else 10**9
    vectorized.by_width = counting
    try:
        model, cpu = env.new_model(), 0.0
        for rnd in range(1, 11):
            jobs = [CohortJob(p, rnd, env.strategy(), None) for p in wl.cohort(rnd)]
            t = time.process_time()
            out = vectorized.train_partitions_vmap(env, model, jobs)
            cpu += time.process_time() - t
    finally:
        vectorized.CALL_SAMPLES, vectorized.by_width = saved, real
    return cpu, counts[0], counts[1], out[-1].trained


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import peers

    from fedelastic.environment import environment
    from fedelastic.scenario import parse_scenario
    from fedelastic.train.vectorized import CALL_SAMPLES

    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average {np.round(np.array(__import__('os').getloadavg()), 1).tolist()}")
    model = peers.initial_model()
    step_cpu(model, 50, 16, 2)  # warm-up
    ms = {bw: step_cpu(model, *bw, args.reps) * 1e3 for bw in GRID}
    a = np.array([[1.0, b * w] for b, w in GRID])
    (c0, per), *_ = np.linalg.lstsq(a, np.array([ms[bw] for bw in GRID]), rcond=None)
    print("| clients B | width W | CPU ms a step call | fit c0 + a B W |\n|---:|---:|---:|---:|")
    for (b, w), v in ms.items():
        print(f"| {b} | {w} | {v:.1f} | {c0 + per * b * w:.1f} |")
    print(f"fit: c0 = {c0:.2f} ms, a = {per * 1e3:.1f} us a padded sample: a call costs {c0 / per:.0f} padded samples "
          f"(CALL_SAMPLES = {CALL_SAMPLES})")

    wl = peers.Workload()
    raw = wl.scenario("inprocess", tempfile.mkdtemp(prefix="fedelastic-vmap-width-"))
    raw["simulation"]["vectorize"] = True
    env = environment(parse_scenario(raw))
    rounds_cpu(env, wl, True)  # warm-up
    got: dict[bool, list] = {False: [], True: []}
    for _ in range(args.reps):
        for split in (False, True):
            got[split].append(rounds_cpu(env, wl, split))
    real = sum(len(env.client_data(p, r)) for r in range(1, 11) for p in wl.cohort(r))
    print(f"\nrounds 1-10, {real} real samples; process CPU per round, median of {args.reps} interleaved")
    print("| step calls | padded samples | calls | CPU ms a round |\n|---|---:|---:|---:|")
    for split, label in ((False, "one a step"), (True, "split by width")):
        cpu, pad, calls, _ = got[split][0]
        med = float(np.median([g[0] for g in got[split]])) / 10 * 1e3
        print(f"| {label} | {pad} | {calls} | {med:.1f} |")
    one, two = got[False][0][3], got[True][0][3]
    diff = max(float(np.abs(one[k] - two[k]).max()) for k in one)
    ratio = np.median([g[0] for g in got[True]]) / np.median([g[0] for g in got[False]])
    print(f"split / one CPU: {ratio:.2f}; largest weight difference between them (round 10's last client): {diff:.1e}")


if __name__ == "__main__":
    main()
