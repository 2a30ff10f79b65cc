"""fedelastic's client step against the plain torch loop (issue 10).

    python benchmarks/client_step.py                  # 3 interleaved repetitions
    python benchmarks/client_step.py --part step --reps 5
    python benchmarks/client_step.py --vectorize false     # the per-client loop (default: the run's own path)

It uses benchmarks/peers.py's workload (200 Dirichlet clients on digits, 10 rounds of 50,
its 6k-parameter CNN, batch 16, 1 epoch, SGD lr 0.05, strategy "full"), torch on 1 thread.

* ``step``: the CPU time per client update of fedelastic's cohort client step, called directly in
  this process (``prepare_job``, ``train_cohort``, ``reply_content``: what a cohort node does for
  each member, without the server) against peers.py's plain loop (``load_state_dict``, the
  client's batches, ``local_sgd``, a copy of the weights). Each round starts from the initial
  weights (no aggregation), the same 500 client updates for both. CPU time of this process
  (``time.process_time``) is less sensitive than wall time to other load on a shared machine.

(A ``threads`` part measured in-process cohorts on 1 and 2 training threads; the threads were
removed with it: benchmarks/studies/throughput.md, "Tried and not kept".)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import peers  # noqa: E402


def step_part(reps: int, vectorize: bool | str = "auto") -> dict:
    from flwr.app import ConfigRecord

    from fedelastic.api import load
    from fedelastic.environment import environment
    from fedelastic.fl.client import prepare_job, reply_content, train_cohort

    wl = peers.Workload()
    with tempfile.TemporaryDirectory() as tmp:
        raw = wl.scenario("inprocess", tmp)
        raw["simulation"]["vectorize"] = vectorize
        env = environment(load(raw))
    _ = env.data, env.info
    model = env.client_model
    init = {k: v.detach().clone() for k, v in peers.initial_model().state_dict().items()}

    def fedelastic_round(rnd: int) -> None:
        jobs = [prepare_job(env, pid, ConfigRecord({"server-round": rnd}), None) for pid in wl.cohort(rnd)]
        replies = []

        def done(j, result) -> bool:
            replies.append(reply_content(env, jobs[j], result))
            return True

        train_cohort(env, model, init, jobs, done)

    bare_model = peers.cnn()

    def bare_round(rnd: int) -> None:
        for pid in wl.cohort(rnd):
            bare_model.load_state_dict(init)
            x, y = wl.client_arrays(rnd, pid)
            peers.local_sgd(bare_model, x, y)
            {k: v.detach().numpy().copy() for k, v in bare_model.state_dict().items()}

    variants = {"fedelastic": fedelastic_round, "bare": bare_round}
    for fn in variants.values():  # warm-up
        fn(1)
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    updates = wl.rounds * wl.per_round
    for rep in range(reps):
        for name in variants if rep % 2 == 0 else list(variants)[::-1]:
            start = time.process_time()
            for rnd in range(1, wl.rounds + 1):
                variants[name](rnd)
            cpu[name].append((time.process_time() - start) / updates * 1e3)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {"training_path": env.training_path[1], "cpu_ms_per_update": cpu, "median_ms": med, "fedelastic_x_bare_speed": med["bare"] / med["fedelastic"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("step",), default="step", help="the one part (kept for the recorded commands)")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--vectorize", choices=("auto", "true", "false"), default="auto", help="simulation.vectorize")
    p.add_argument("--out", default=str(HERE.parent / "results" / "client_step.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    report: dict = {
        "command": "python benchmarks/client_step.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    if args.part == "step":
        report["step"] = step_part(args.reps, {"true": True, "false": False}.get(args.vectorize, "auto"))
        med = report["step"]["median_ms"]
        print(
            f"client step, CPU ms per update (median of {args.reps}): fedelastic {med['fedelastic']:.3f}, "
            f"bare loop {med['bare']:.3f}: fedelastic at {report['step']['fedelastic_x_bare_speed']:.2f}x the bare loop "
            f"({report['step']['training_path']})"
        )
    report["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    main()
