"""What the vectorised path's first call costs in a fresh process (issue 40): CPU seconds per call.

    python benchmarks/vmap_first_call.py [--calls 3]

The peers workload (benchmarks/peers.py): its scenario with ``simulation.vectorize = true``, its
round-1..N cohorts of 50 clients, each trained by ``vectorized.train_partitions_vmap`` from the
same initial model, one torch thread. Prints the set-up's and each call's process CPU and wall
seconds and the modules each call imported (an import in the first call is round 1's cost).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import peers

    from fedelastic.environment import environment
    from fedelastic.scenario import parse_scenario
    from fedelastic.train.trainer import CohortJob
    from fedelastic.train.vectorized import train_partitions_vmap

    t0 = time.process_time()
    wl = peers.Workload()
    raw = wl.scenario("inprocess", tempfile.mkdtemp(prefix="fedelastic-first-call-"))
    raw["simulation"]["vectorize"] = True
    env = environment(parse_scenario(raw))
    _ = env.data, env.info, env.client_model
    print(f"set-up: {time.process_time() - t0:.3f} s CPU")
    for rnd in range(1, args.calls + 1):
        jobs = [CohortJob(p, rnd, env.strategy(), None) for p in wl.cohort(rnd)]
        modules, c0, w0 = len(sys.modules), time.process_time(), time.perf_counter()
        train_partitions_vmap(env, env.client_model, jobs)
        print(
            f"call {rnd} ({len(jobs)} clients): {time.process_time() - c0:.3f} s CPU, "
            f"{time.perf_counter() - w0:.3f} s wall, {len(sys.modules) - modules} modules imported"
        )


if __name__ == "__main__":
    main()
