"""Why round 1 is slow, and what threads kept between rounds save (issue 10, session 20).

    python benchmarks/round_one.py                    # both parts
    python benchmarks/round_one.py --part shapes --reps 3

It uses benchmarks/peers.py's workload (200 Dirichlet clients on digits, 50 a round, its
6k-parameter CNN, batch 16, 1 epoch, SGD lr 0.05, strategy "full"), torch on 1 thread.

* ``shapes``: one round's 50 clients trained twice in a fresh process, by fedelastic's cohort
  step (``train_cohort``) and by peers.py's plain loop, the first time without and with a
  warm-up before it: the trainer's own step (``train_local``) on a copy of the model, once per
  batch size the partitions give, or a plain forward and backward pass per batch size (grads
  accumulated, contiguous batches). Wall ms of each pass.
* ``threads``: the 10 rounds' cohort step on the calling thread and on a fresh thread per round
  (what ``cohort_train`` did before ``fl/threads.py``), alternated; wall ms per round.

(A third part, whole Ray runs with the trainer's warm-up in each worker on and off, ran at commit
e20b37f, where that warm-up existed; its result is in benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

SHAPES_CHILD = r"""
import json, sys, tempfile, time
sys.path.insert(0, HERE)
import numpy as np, torch
torch.set_num_threads(1)
import peers
from flwr.app import ConfigRecord
from fedelastic.api import load
from fedelastic.fl.client import prepare_job, train_cohort
from fedelastic.environment import environment, warm_up
from fedelastic.train.trainer import LocalTraining, train_local

variant, rnd = sys.argv[1], 3
wl = peers.Workload()
sc = load(wl.scenario("inprocess", tempfile.mkdtemp()))
env = environment(sc)
warm_up(sc)
init = {k: v.detach().clone() for k, v in peers.initial_model().state_dict().items()}
sizes = sorted({len(b) for p in env.data.partitions for b in np.array_split(np.arange(len(p)), range(16, len(p), 16))})
if variant == "fedelastic, train_local per size on a copy first":
    import copy
    copied, t = copy.deepcopy(env.client_model), sc.train
    for size in sizes:
        local = LocalTraining(epochs=1, batch_size=t.batch_size, lr=t.lr, momentum=t.momentum,
                              weight_decay=t.weight_decay, bn_mode=env.bn_mode, optimizer=t.optimizer)
        train_local(copied, env.info, env.strategy(), env.cost(env.devices[0]), env.data.train.subset(np.arange(size)), local)
if variant == "fedelastic, plain forward/backward per size first":
    model = env.client_model
    for size in sizes:
        x, y = torch.from_numpy(env.data.train.x[:size]), torch.from_numpy(env.data.train.y[:size])
        torch.nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)

def fedelastic_pass():
    jobs = [prepare_job(env, pid, ConfigRecord({"server-round": rnd}), None) for pid in wl.cohort(rnd)]
    train_cohort(env, env.client_model, init, jobs)

bare = peers.initial_model()
def bare_pass():
    for pid in wl.cohort(rnd):
        bare.load_state_dict(init)
        x, y = wl.client_arrays(rnd, pid)
        peers.local_sgd(bare, x, y)

run = bare_pass if variant.startswith("bare") else fedelastic_pass
if variant.startswith("bare"):
    import importlib; importlib.import_module("torch._dynamo")  # torch.optim's import, not a first-shape cost
ms = []
for _ in range(2):
    t = time.perf_counter(); run(); ms.append((time.perf_counter() - t) * 1e3)
print("RESULT" + json.dumps(ms))
"""

SHAPE_VARIANTS = (
    "bare loop",
    "fedelastic",
    "fedelastic, train_local per size on a copy first",
    "fedelastic, plain forward/backward per size first",
)


def shapes_part(reps: int) -> dict:
    out: dict[str, list] = {v: [] for v in SHAPE_VARIANTS}
    for rep in range(reps):
        for variant in SHAPE_VARIANTS if rep % 2 == 0 else SHAPE_VARIANTS[::-1]:
            code = SHAPES_CHILD.replace("HERE", repr(str(HERE.parent)))
            p = subprocess.run([sys.executable, "-c", code, variant], capture_output=True, text=True, check=True)
            out[variant].append(json.loads(p.stdout.split("RESULT")[1]))
    med = {v: [statistics.median(r[i] for r in runs) for i in (0, 1)] for v, runs in out.items()}
    return {"ms_first_and_second_pass": out, "median_ms": med}


def threads_part(reps: int) -> dict:
    import peers
    import torch
    from flwr.app import ConfigRecord

    from fedelastic.api import load
    from fedelastic.environment import environment, warm_up
    from fedelastic.fl.client import prepare_job, train_cohort

    torch.set_num_threads(1)
    wl = peers.Workload()
    sc = load(wl.scenario("inprocess", tempfile.mkdtemp()))
    env = environment(sc)
    warm_up(sc)
    init = {k: v.detach().clone() for k, v in peers.initial_model().state_dict().items()}

    def one_round(rnd: int) -> None:
        jobs = [prepare_job(env, pid, ConfigRecord({"server-round": rnd}), None) for pid in wl.cohort(rnd)]
        train_cohort(env, env.client_model, init, jobs)

    def fresh_thread(rnd: int) -> None:
        t = threading.Thread(target=lambda: (torch.set_num_threads(1), one_round(rnd)))
        t.start()
        t.join()

    variants = {"kept thread": one_round, "fresh thread per round": fresh_thread}
    for rnd in range(1, wl.rounds + 1):  # every batch shape seen once
        one_round(rnd)
    ms: dict[str, list[float]] = {k: [] for k in variants}
    for rep in range(reps):
        for name in variants if rep % 2 == 0 else list(variants)[::-1]:
            t = time.perf_counter()
            for rnd in range(1, wl.rounds + 1):
                variants[name](rnd)
            ms[name].append((time.perf_counter() - t) * 1e3 / wl.rounds)
    return {"ms_per_round": ms, "median_ms": {k: statistics.median(v) for k, v in ms.items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("shapes", "threads"), nargs="+", default=["shapes", "threads"])
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    p.add_argument("--out", default=str(HERE.parent / "results" / "round_one.json"))
    args = p.parse_args(argv)
    report: dict = {
        "command": "python benchmarks/round_one.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    if "shapes" in args.part:
        report["shapes"] = shapes_part(args.reps)
        print("one round's 50 clients, first and second pass in a fresh process (ms, medians):")
        for v, (first, second) in report["shapes"]["median_ms"].items():
            print(f"  {v:52s} {first:6.1f} {second:6.1f}")
    if "threads" in args.part:
        report["threads"] = threads_part(args.reps)
        print("cohort step per round (ms, medians):", {k: round(v, 1) for k, v in report["threads"]["median_ms"].items()})
    report["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    main()
